"""The routes: which JAX function a method's call goes through which function here.

One row per JAX function: the function, the name error messages and the
rewrite use, and the function of a family module that places the states
for it. ``@stateful`` rewrites a call whose name resolved to one of these
functions at decoration (``lax.scan(...)`` reads
``__autostate__.lifting.routed(lax.scan)(...)``), and ``routed`` swaps it
where the method runs. Adding a JAX function is its placement in its
family's module and its row here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax
from jax import lax

from autostate.lifting import autodiff, branches, jit, loops, mapping


def _rows() -> list[tuple[Any, str, Callable[..., Any]]]:
    rows: list[tuple[Any, str, Callable[..., Any]]] = [
        (lax.scan, "scan", loops.scan),
        (lax.while_loop, "while_loop", loops.while_loop),
        (lax.fori_loop, "fori_loop", loops.fori_loop),
        (lax.map, "map", loops.map),
        (lax.cond, "cond", branches.cond),
        (lax.switch, "switch", branches.switch),
        (jax.checkpoint, "checkpoint", autodiff.checkpoint),
        (jax.remat, "checkpoint", autodiff.checkpoint),
        (jax.grad, "grad", autodiff.grad),
        (jax.value_and_grad, "value_and_grad", autodiff.value_and_grad),
        (jax.jacfwd, "jacfwd", autodiff.jacfwd),
        (jax.jacrev, "jacrev", autodiff.jacrev),
        (jax.jacobian, "jacobian", autodiff.jacobian),
        (jax.hessian, "hessian", autodiff.hessian),
        (jax.jvp, "jvp", autodiff.jvp),
        (jax.vjp, "vjp", autodiff.vjp),
        (jax.linearize, "linearize", autodiff.linearize),
        (jax.custom_vjp, "custom_vjp", autodiff.custom_vjp),
        (jax.custom_jvp, "custom_jvp", autodiff.custom_jvp),
        (jax.vmap, "vmap", mapping.vmap),
        (jax.jit, "jit", jit.jit),
    ]
    with contextlib.suppress(AttributeError):
        rows.append((jax.shard_map, "shard_map", mapping.shard_map))
    with contextlib.suppress(ImportError, AttributeError):
        from jax import ad_checkpoint

        rows.append((ad_checkpoint.checkpoint, "checkpoint", autodiff.checkpoint))  # type: ignore[attr-defined]
    return rows


# The table: (JAX function, its name, the function here that places the states).
ROWS = tuple(_rows())
# JAX function -> its name; id(JAX function) -> (the function, the one here)
_NAMES: dict[Any, str] = {target: name for target, name, _ in ROWS}
_ROUTES: dict[int, tuple[Any, Callable[..., Any]]] = {
    id(target): (target, through) for target, _, through in ROWS
}


def routed(obj: Any) -> Any:
    """What a rewritten method calls where its source named a JAX function
    of the table (``lax.scan(...)`` reads
    ``__autostate__.lifting.routed(lax.scan)(...)``): the function here that
    threads state when ``obj``, evaluated where the method runs, is that JAX
    function; ``obj`` itself otherwise. So a local or a parameter of the same
    name (``def run(self, x, checkpoint=False)``, ``cond = x > 0``), or a
    global rebound since the decoration, means what plain Python says."""
    found = _ROUTES.get(id(obj))
    if found is not None and found[0] is obj:
        return found[1]
    return obj


def wrapper_name(obj: Any) -> str | None:
    """The name of the function here that stands for ``obj`` (``jax.lax.scan`` -> ``"scan"``)."""
    try:
        return _NAMES.get(obj)
    except TypeError:  # unhashable
        return None
