"""``lax.cond`` and ``lax.switch``: the states any branch assigns go into
every branch's operands and come out of every branch's output."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from jax import lax

from autostate import graph as _graph
from autostate.effects.local_state import StateSlot, running_cells
from autostate.errors import ControlFlowStateError, format_error, user_location
from autostate.lifting.core import (
    check_kept,
    jit_disabled,
    lift,
    strengthened,
    strong_where_mixed,
    with_eager_states,
    writes_of,
)


def _branches(
    call: Callable[[Sequence[Callable], tuple], Any],
    branches: Sequence[Callable[..., Any]],
    operands: tuple,
    what: str,
) -> Any:
    branches = [_returning_no_model(b, branches, operands, what) for b in branches]
    cells = running_cells()
    if not cells:
        return call(branches, operands)
    written: set[int] = set()
    news: list[tuple[list[int], list[Any]]] = []
    for branch in branches:
        indices, new = writes_of(cells, lambda branch=branch: branch(*operands), what=f"a branch of {what}")
        written.update(indices)
        news.append((indices, new))
    order = sorted(written)
    for indices, new in news:
        check_kept([cells[i] for i in indices], new, f"a branch of {what}")

    def as_operands(pure_of: Callable, values: list[Any]) -> tuple[Any, list[Any]]:
        outcomes = [
            [dict(zip(indices, new)).get(i, value) for i, value in zip(order, values)]
            for indices, new in news
        ]
        strong = strong_where_mixed(outcomes)

        def threaded(branch: Callable[..., Any]) -> Callable[..., Any]:
            pure = pure_of(branch, f"a branch of {what}")

            def run(inner: tuple, values: list[Any]) -> tuple[Any, list[Any]]:
                out, values = pure(values, *inner)
                result = out, [strengthened(v) if s else v for v, s in zip(values, strong)]
                # The TPU compiler (jaxlib 0.10) fails on a conditional compiled
                # on its own (eagerly, under eager grad or vmap) whose branches
                # return one value at two positions that differ from branch to
                # branch (a state and the output; two aliases): a RET_CHECK in
                # its layout assignment, reproduced without autostate by
                # benchmarks/tpu_cond_repro.py. It accepts the program whose
                # branch results pass an optimization barrier, which changes
                # no value and, inside a larger jitted program, no instruction
                # that computes.
                return lax.optimization_barrier(result)

            return run

        return call([threaded(b) for b in branches], (operands, values))

    return lift(cells, order, what, as_operands, lambda: call(branches, operands))


def _returning_no_model(
    branch: Callable[..., Any], branches: Sequence[Callable[..., Any]], operands: tuple, what: str
) -> Callable[..., Any]:
    """``branch``, refusing a model it returns that lives outside it (an
    operand, a sub-model it reaches, a layer of a stack): JAX's output is a
    new object holding the taken branch's arrays, where plain Python returns
    the model itself, so a call or write through it would miss the model. A
    model the branch builds is returned as JAX returns it."""

    def checked(*args: Any, **kwargs: Any) -> Any:
        out = branch(*args, **kwargs)
        if _graph.holds_instance(out):
            outside = _graph.instance_ids((branches, operands))
            for obj in _graph.instances_of(out):
                if id(obj) in outside or _is_view(obj):
                    raise ControlFlowStateError(format_error(
                        f"A branch of {what} returns a model ({type(obj).__name__}) that lives "
                        "outside the branch: JAX returns a new object holding the taken "
                        "branch's arrays, not the model itself as plain Python does, so a "
                        "call or an assignment through it would not reach the model.",
                        where=user_location(),
                        fix="call the model inside the branches and return its output "
                        "(`lax.cond(p, lambda a, b: a(x), lambda a, b: b(x), a, b)`), or "
                        "choose the model with a Python `if` on a concrete value.",
                    ))
        return out

    functools.update_wrapper(checked, branch, updated=())
    return checked


def _is_view(obj: Any) -> bool:
    """Whether ``obj`` is a layer of a stack (its states are parts of the stack's)."""
    return any(
        isinstance(value, StateSlot) and value.part_of() is not None
        for value in obj.__dict__.values()
    )


# ``operand=`` not given (``None`` is an operand).
_NO_OPERAND: Any = object()


def _operands(operands: tuple, operand: Any, what: str) -> tuple:
    """The operands of a ``cond``/``switch`` call, JAX's ``operand=`` keyword included."""
    if operand is _NO_OPERAND:
        return operands
    if operands:
        raise TypeError(
            f"{what}: if the 'operand' keyword is passed, no operands can be passed "
            f"positionally (got {len(operands)})."
        )
    return (operand,)


def cond(
    pred: Any,
    true_fun: Callable[..., Any],
    false_fun: Callable[..., Any],
    *operands: Any,
    operand: Any = _NO_OPERAND,
) -> Any:
    """``jax.lax.cond`` whose branches may read and assign state.

    Under ``jax.vmap`` with a batched ``pred`` each example keeps the state
    of the branch it took.

    Args:
        pred: a boolean scalar choosing ``true_fun`` or ``false_fun``.
        true_fun: the branch taken when ``pred`` is true.
        false_fun: the branch taken otherwise.
        *operands: the branches' arguments.
        operand: a single operand, as ``jax.lax.cond``'s old keyword.

    Returns:
        The taken branch's output; its assignments hold after.

    Examples:
        >>> @autostate.stateful
        ... class Block:
        ...     def __init__(self):
        ...         self.calls = jnp.zeros((), jnp.int32)
        ...
        ...     def __call__(self, x):
        ...         self.calls += 1
        ...         return 2 * x
        >>> block = Block()
        >>> y = autostate.cond(True, block, lambda x: x, 1.0)
        >>> y = autostate.cond(False, block, lambda x: x, y)  # statistics only when run
        >>> print(y, block.calls)
        2.0 1
    """
    operands = _operands(operands, operand, "lax.cond")
    if jit_disabled():
        return lax.cond(pred, true_fun, false_fun, *operands)
    roots = (true_fun, false_fun, operands)
    return with_eager_states(
        roots,
        lambda: _branches(
            lambda bs, ops: lax.cond(pred, bs[0], bs[1], *ops),
            (true_fun, false_fun),
            operands,
            "a lax.cond",
        ),
        "a branch of a lax.cond",
    )


def switch(
    index: Any, branches: Sequence[Callable[..., Any]], *operands: Any, operand: Any = _NO_OPERAND
) -> Any:
    """``jax.lax.switch`` whose branches may read and assign state.

    Args:
        index: which branch runs (clamped into range, as ``jax.lax.switch``).
        branches: the functions to choose from.
        *operands: the branches' arguments.
        operand: a single operand, as ``jax.lax.switch``'s old keyword.

    Returns:
        The chosen branch's output; its assignments hold after.

    Examples:
        >>> @autostate.stateful
        ... class Block:
        ...     def __init__(self):
        ...         self.calls = jnp.zeros((), jnp.int32)
        ...
        ...     def __call__(self, x):
        ...         self.calls += 1
        ...         return 2 * x
        >>> block = Block()
        >>> print(autostate.switch(1, [lambda x: x, block], 3.0), block.calls)
        6.0 1
    """
    operands = _operands(operands, operand, "lax.switch")
    branches = list(branches)
    if jit_disabled():
        return lax.switch(index, branches, *operands)
    return with_eager_states(
        (branches, operands),
        lambda: _branches(
            lambda bs, ops: lax.switch(index, list(bs), *ops), branches, operands, "a lax.switch"
        ),
        "a branch of a lax.switch",
    )


