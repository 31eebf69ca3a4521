"""``jax.jit`` inside a method: the states the function assigns go into
its arguments and come out of its output. It is an object boundary: the
function runs once per call, as plain Python's does."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

from autostate import graph as _graph
from autostate.effects.local_state import running_cells
from autostate.errors import ControlFlowStateError, format_error, user_location
from autostate.lifting.core import (
    after_states,
    argument_writes,
    current_values,
    land,
    traceable,
    transformation,
    with_states_first,
)

# --- jit ----------------------------------------------------------------------------
# ``jax.jit``'s placement: the live states JAX can trace are extra arguments
# of the jitted function and the ones it assigns extra outputs, so a write
# inside lands with its value, as if the function ran eagerly, and a read is
# the state's value at the call, never a constant of an earlier trace.


def jit(fun: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    """``jax.jit`` of a function that may read and assign state (what a
    method's ``jax.jit(...)`` calls).

    The states are arguments and outputs of the compiled function: a read is
    the state's value at the call, and a write lands, as if the function ran
    eagerly. A static state (a Python value) may not be assigned there.

    Args:
        fun: the function to compile.
        **options: those of ``jax.jit`` (``static_argnums``, ``donate_argnums``, ...),
            numbered as the arguments of ``fun``.

    Returns:
        The compiled function.

    Examples:
        >>> @autostate.stateful
        ... class Counter:
        ...     def __init__(self):
        ...         self.n = jnp.zeros((), jnp.int32)
        ...
        ...     def _add(self, k):
        ...         self.n += k
        ...         return self.n
        ...
        ...     def step(self, k):
        ...         return jax.jit(self._add)(k)  # routed here
        >>> counter = Counter()
        >>> print(counter.step(2), counter.step(3), counter.n)
        2 5 5
    """
    for name in ("in_shardings", "out_shardings"):
        if options.get(name) is not None:
            raise ControlFlowStateError(
                format_error(
                    f"jax.jit with {name} inside a method: the states the function reads "
                    "and assigns are extra arguments and outputs of the compiled function, "
                    f"so {name} given for the function's own would not line up with them.",
                    where=user_location(),
                    fix="annotate the states with autostate.sharded(value, spec) and jit the "
                    "outer step (f) with the shardings autostate.shardings gives, or "
                    "constrain values inside with jax.lax.with_sharding_constraint.",
                )
            )
    # Donation is left out: a donated state would delete the caller's states
    # dict (through f) or the model's old arrays, which plain Python keeps.
    options = {k: v for k, v in options.items() if k not in ("donate_argnums", "donate_argnames")}
    shifted = dict(options)
    if options.get("static_argnums") is not None:
        shifted["static_argnums"] = after_states(options["static_argnums"])
    # An object boundary (DESIGN.md section 8): the function is traced on every
    # call, once, so a static config it switches (``self.training = False``) or
    # a sub-model it assigns (``self.cur = self.b``) is written back as the
    # plain call leaves it.
    return transformation(
        fun, "a jax.jit", lambda args, kwargs: _jit_call(fun, options, shifted, args, kwargs),
        boundary=True,
    )


def _jit_call(
    fun: Callable, options: dict, shifted: dict, args: tuple, kwargs: dict
) -> Any:
    fun, args, kwargs = _models_held(fun, args, kwargs)
    cells = running_cells()
    if not cells:
        if _graph.holds_instance((fun, args, kwargs)):
            # (Traced afresh, as below: a static config the function assigns
            # is assigned on every call, never skipped by JAX's cache.)
            fun = functools.wraps(fun)(functools.partial(fun))
        return jax.jit(fun, **options)(*args, **kwargs)
    what = "a jax.jit"
    passed = [i for i, cell in enumerate(cells) if traceable(cell.value)]
    chosen = [cells[i] for i in passed]

    def threaded(values: list[Any], *inner: Any, **inner_kwargs: Any) -> Any:
        return argument_writes(cells, passed, values, what, lambda: fun(*inner, **inner_kwargs))

    threaded.__name__ = getattr(fun, "__name__", threaded.__name__)  # (the jaxpr's name)
    with_states_first(threaded, fun)
    out, new = jax.jit(threaded, **shifted)(current_values(chosen), *args, **kwargs)
    land(chosen, new)
    return out


def _models_held(fun: Callable, args: tuple, kwargs: dict) -> tuple[Callable, tuple, dict]:
    """``fun`` and its arguments, with the models among them (at any depth)
    held by ``fun`` instead: the function is given the same objects, as the
    plain call is, where JAX would flatten each into a copy whose writes (a
    parameter, ``self.training = False``) nothing reads back. Their states are
    threaded as any running state is; every other write meets the guard."""
    def hole_or_model(x: Any) -> bool:
        return x is None or _graph.is_stateful_instance(x)

    flat, treedef = jax.tree_util.tree_flatten((args, kwargs), is_leaf=hole_or_model)
    models = {i: x for i, x in enumerate(flat) if _graph.is_stateful_instance(x)}
    if not models:
        return fun, args, kwargs
    args, kwargs = jax.tree_util.tree_unflatten(
        treedef, [None if i in models else x for i, x in enumerate(flat)]
    )

    @functools.wraps(fun)
    def holding(*inner: Any, **inner_kwargs: Any) -> Any:
        given = jax.tree_util.tree_leaves((inner, inner_kwargs), is_leaf=hole_or_model)
        for i, model in models.items():
            given[i] = model
        inner, inner_kwargs = jax.tree_util.tree_unflatten(treedef, given)
        return fun(*inner, **inner_kwargs)

    return holding, args, kwargs
