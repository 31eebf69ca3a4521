"""``lax.cond`` and ``lax.switch``: the states any branch assigns go into
every branch's operands and come out of every branch's output."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax import lax

from autostate import graph as _graph
from autostate.effects.local_state import running_cells
from autostate.errors import ControlFlowStateError, format_error, user_location
from autostate.lifting.core import (
    PassedModels,
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
    models: list[Any] = []
    noted = [_noting_models(branch, models) for branch in branches]
    try:
        return _threaded_branches(call, noted, operands, what)
    except TypeError as err:
        if not models or "must have the same pytree structure" not in str(err):
            raise
        # JAX's own error: the branches' outputs differ in structure, here
        # because they return different models.
        names = ", ".join(sorted({type(obj).__name__ for obj in models}))
        raise ControlFlowStateError(format_error(
            f"The branches of {what} return different models ({names}): JAX returns one "
            "object holding the taken branch's arrays, so the branches must return values "
            "of one structure, and a model returned is not the model itself as plain "
            "Python's taken branch returns it (a layer of a stack and a standalone model do "
            "not even flatten alike).",
            where=user_location(),
            fix="call the model inside the branches and return its output "
            "(`lax.cond(p, lambda a, b: a(x), lambda a, b: b(x), a, b)`), or choose the "
            "model with a Python `if` on a concrete value.",
        )) from None


def _noting_models(branch: Callable[..., Any], models: list[Any]) -> Callable[..., Any]:
    """``branch``, noting into ``models`` the models its output holds."""

    def noting(*args: Any, **kwargs: Any) -> Any:
        out = branch(*args, **kwargs)
        if _graph.holds_instance(out):
            is_model = _graph.is_stateful_instance
            models.extend(x for x in jax.tree_util.tree_leaves(out, is_leaf=is_model)
                          if is_model(x))
        return out

    functools.update_wrapper(noting, branch, updated=())
    return noting


def _threaded_branches(
    call: Callable[[Sequence[Callable], tuple], Any],
    branches: Sequence[Callable[..., Any]],
    operands: tuple,
    what: str,
) -> Any:
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
    passed = PassedModels(operands, received_at=None, returned_at=None, loop=False)
    return passed.result(with_eager_states(
        roots,
        lambda: _branches(
            lambda bs, ops: lax.cond(pred, bs[0], bs[1], *ops),
            (passed.body(true_fun), passed.body(false_fun)),
            operands,
            "a lax.cond",
        ),
        "a branch of a lax.cond",
    ))


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
    passed = PassedModels(operands, received_at=None, returned_at=None, loop=False)
    return passed.result(with_eager_states(
        (branches, operands),
        lambda: _branches(
            lambda bs, ops: lax.switch(index, list(bs), *ops),
            [passed.body(branch) for branch in branches],
            operands,
            "a lax.switch",
        ),
        "a branch of a lax.switch",
    ))


