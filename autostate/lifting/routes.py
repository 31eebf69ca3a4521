"""The routes: which JAX function a method's call goes through which function here.

One row per JAX function: the function, the name error messages and the
rewrite use, and the function of a family module that places the states
for it. ``@stateful`` rewrites a call whose name resolved to one of these
functions at decoration (``lax.scan(...)`` reads
``__autostate__.lifting.routed(lax.scan)(...)``), and ``routed`` swaps it
where the method runs. Adding a JAX function is its placement in its
family's module and its row here.

A decoration reads only the names; a family's module is imported by the
first call routed to it (a model without control flow never imports one).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from typing import Any

import jax
from jax import lax


def _table() -> list[tuple[Any, str, str]]:
    rows: list[tuple[Any, str, str]] = [
        (lax.scan, "scan", "loops"),
        (lax.while_loop, "while_loop", "loops"),
        (lax.fori_loop, "fori_loop", "loops"),
        (lax.map, "map", "loops"),
        (lax.cond, "cond", "branches"),
        (lax.switch, "switch", "branches"),
        (jax.checkpoint, "checkpoint", "autodiff"),
        (jax.remat, "checkpoint", "autodiff"),
        (jax.grad, "grad", "autodiff"),
        (jax.value_and_grad, "value_and_grad", "autodiff"),
        (jax.jacfwd, "jacfwd", "autodiff"),
        (jax.jacrev, "jacrev", "autodiff"),
        (jax.jacobian, "jacobian", "autodiff"),
        (jax.hessian, "hessian", "autodiff"),
        (jax.jvp, "jvp", "autodiff"),
        (jax.vjp, "vjp", "autodiff"),
        (jax.linearize, "linearize", "autodiff"),
        (jax.custom_vjp, "custom_vjp", "autodiff"),
        (jax.custom_jvp, "custom_jvp", "autodiff"),
        (jax.vmap, "vmap", "mapping"),
        (jax.jit, "jit", "jit"),
    ]
    with contextlib.suppress(AttributeError):
        rows.append((jax.shard_map, "shard_map", "mapping"))
    with contextlib.suppress(ImportError, AttributeError):
        from jax import ad_checkpoint

        rows.append((ad_checkpoint.checkpoint, "checkpoint", "autodiff"))  # type: ignore[attr-defined]
    return rows


# The table: (JAX function, its name, the family module whose function of
# that name places the states).
TABLE = tuple(_table())
# JAX function -> its name; id(JAX function) -> (the function, the one here,
# ``None`` until the first call routed to it imports its family)
_NAMES: dict[Any, str] = {target: name for target, name, _ in TABLE}
_ROUTES: dict[int, tuple[Any, Callable[..., Any] | None]] = {
    id(target): (target, None) for target, _, _ in TABLE
}


def through(target: Any) -> Callable[..., Any]:
    """The function here that places the states for ``target``, a JAX
    function of the table (its family's module imported on the first ask)."""
    found = _ROUTES[id(target)][1]
    if found is None:
        _, name, family = next(row for row in TABLE if row[0] is target)
        found = getattr(importlib.import_module(f"autostate.lifting.{family}"), name)
        _ROUTES[id(target)] = (target, found)
    return found


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
        return found[1] or through(obj)
    return obj


def wrapper_name(obj: Any) -> str | None:
    """The name of the function here that stands for ``obj`` (``jax.lax.scan`` -> ``"scan"``)."""
    try:
        return _NAMES.get(obj)
    except TypeError:  # unhashable
        return None
