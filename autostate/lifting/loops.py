"""``lax.scan``, ``lax.while_loop``, ``lax.fori_loop`` and ``lax.map``: the
states the body assigns go into the carry; a stacked sub-model's into
``xs`` and ``ys`` (``core``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax import lax

from autostate import graph as _graph
from autostate.effects.local_state import running_cells
from autostate.errors import ControlFlowStateError, format_error, user_location
from autostate.lifting.core import (
    Cells,
    abstract_of,
    bound_to,
    check_stacked,
    current_values,
    guarding_copies,
    jit_disabled,
    land,
    layers_mapped,
    lift,
    member_body,
    members_of,
    probed,
    weak_types,
    with_eager_states,
    with_layer_views,
    writes_of,
)


def scan(
    f: Callable[[Any, Any], tuple[Any, Any]],
    init: Any,
    xs: Any = None,
    length: int | None = None,
    reverse: bool = False,
    unroll: int | bool = 1,
    **kwargs: Any,
) -> tuple[Any, Any]:
    """``jax.lax.scan`` whose body may read and assign model state.

    Inside a ``@stateful`` method a plain ``jax.lax.scan`` call does the same;
    code the decorator never saw (a helper function outside any class) calls
    this one.

    Args:
        f: the body, ``(carry, x) -> (carry, y)``, as for ``jax.lax.scan``.
        init: the initial carry.
        xs: the sequence scanned over (or ``None`` with ``length``).
        length: the number of iterations when ``xs`` is ``None``.
        reverse: scan from the end, as ``jax.lax.scan``.
        unroll: how many iterations each loop step runs, as ``jax.lax.scan``.
        **kwargs: any other option of ``jax.lax.scan``.

    Returns:
        ``(carry, ys)``, as ``jax.lax.scan``; the states the body assigned hold
        their values after the last iteration.

    Examples:
        >>> @autostate.stateful
        ... class Cell:
        ...     def __init__(self):
        ...         self.steps = jnp.zeros((), jnp.int32)
        ...
        ...     def __call__(self, h, x):
        ...         self.steps += 1
        ...         return jnp.tanh(h + x)
        >>> def unroll(cell, h, xs):  # a helper outside any class
        ...     h, _ = autostate.scan(lambda h, x: (cell(h, x), None), h, xs)
        ...     return h
        >>> cell = Cell()
        >>> h = unroll(cell, 0.0, jnp.ones(5))
        >>> print(cell.steps)
        5
    """
    xs = layers_mapped(xs)
    if jit_disabled():
        return lax.scan(f, init, xs, length=length, reverse=reverse, unroll=unroll, **kwargs)
    options = dict(length=length, reverse=reverse, unroll=unroll, **kwargs)
    return with_eager_states(
        (f, init, xs), lambda: _scan(f, init, xs, options), "the body of a lax.scan"
    )


def _scan(
    f: Callable, init: Any, xs: Any, options: dict[str, Any], what: str = "the body of a lax.scan"
) -> tuple[Any, Any]:
    return with_layer_views(xs, what, lambda: _scan_members(f, init, xs, options, what))


def _scan_members(
    f: Callable, init: Any, xs: Any, options: dict[str, Any], what: str
) -> tuple[Any, Any]:
    if _graph.holds_instance(xs):  # a sub-model scanned over: each step's copy guarded
        step = f

        def f(carry: Any, x: Any) -> Any:
            return guarding_copies(x, what, lambda: step(carry, x))

    cells = running_cells()
    members = members_of(cells, xs) if cells else []
    if not members:
        return _scan_threaded(cells, f, init, xs, options, what)
    # A stacked sub-model in ``xs``: its states are scanned over with it.
    chosen = [cells[i] for i in members]
    check_stacked(chosen, [0] * len(chosen), _scan_length(xs, options.get("length")), what)
    body = member_body(cells, members, f, what)
    carry, (ys, written) = _scan_threaded(
        cells, body, init, (xs, current_values(chosen)), options, what
    )
    land(chosen, written)
    return carry, ys


def _scan_threaded(
    cells: Cells, f: Callable, init: Any, xs: Any, options: dict[str, Any], what: str
) -> tuple[Any, Any]:
    """``lax.scan``, the states ``f`` assigns threaded as carry."""
    if not cells:
        return lax.scan(f, init, xs, **options)
    if _scan_length(xs, options.get("length")) == 0:
        return lax.scan(_never_run(cells, f, what), init, xs, **options)

    def as_carry(pure_of: Callable, values: list[Any]) -> tuple[Any, list[Any]]:
        step = pure_of(f)

        def body(carry: tuple[Any, list[Any]], x: Any) -> tuple[tuple[Any, list[Any]], Any]:
            (inner, y), values = step(carry[1], carry[0], x)
            return (inner, values), y

        (carry, values), ys = lax.scan(body, (init, values), xs, **options)
        return (carry, ys), values

    written = probed(cells, what, f, abstract_of(init), _step_slice(xs))
    return lift(cells, written, what, as_carry, lambda: lax.scan(f, init, xs, **options))


def _step_slice(xs: Any) -> Any:
    """The abstract value of one step's slice of ``xs`` (its leading axis dropped)."""
    return jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(
            jax.numpy.shape(a)[1:], jax.numpy.result_type(a), weak_type=weak_types(a)[0]
        ),
        xs,
    )


def _scan_length(xs: Any, length: int | None) -> int | None:
    """How many times a ``lax.scan`` runs its body (always known when it is traced)."""
    if length is not None:
        return int(length)
    leaves = jax.tree_util.tree_leaves(xs)
    return int(jax.numpy.shape(leaves[0])[0]) if leaves else None


def _never_run(cells: Cells, body: Callable[..., Any], what: str) -> Callable[..., Any]:
    """``body`` for a loop that runs it zero times, as JAX still traces it: what it assigns
    is dropped, so every state keeps its value and its type (a Python float stays one,
    where a carry would come out a strong array) as after plain Python's empty loop."""

    def run(*args: Any) -> Any:
        with bound_to(cells, (), (), what):
            return body(*args)

    return run


def _static_int(value: Any) -> int | None:
    """``value`` as an int where it is known when traced, as ``lax.fori_loop`` decides."""
    if isinstance(value, jax.core.Tracer):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def while_loop(cond_fun: Callable[[Any], Any], body_fun: Callable[[Any], Any], init_val: Any) -> Any:
    """``jax.lax.while_loop`` whose body may assign state and whose ``cond_fun`` may read it.

    Args:
        cond_fun: ``value -> bool``; it may read state.
        body_fun: ``value -> value``; it may read and assign state.
        init_val: the initial loop value.

    Returns:
        The final loop value; assigned states hold their final values.

    Examples:
        >>> @autostate.stateful
        ... class Counter:
        ...     def __init__(self):
        ...         self.n = jnp.zeros((), jnp.int32)
        ...
        ...     def run(self, limit):
        ...         def body(i):
        ...             self.n += 1
        ...             return i + 1
        ...
        ...         return jax.lax.while_loop(lambda i: self.n < limit, body, 0)
        >>> counter = Counter()
        >>> print(counter.run(3), counter.n)
        3 3
    """
    if jit_disabled():
        return lax.while_loop(cond_fun, body_fun, init_val)
    roots = (cond_fun, body_fun, init_val)
    return with_eager_states(
        roots, lambda: _while_loop(cond_fun, body_fun, init_val), "a lax.while_loop"
    )


def _while_loop(cond_fun: Callable, body_fun: Callable, init_val: Any) -> Any:
    cells = running_cells()
    if not cells:
        return lax.while_loop(cond_fun, body_fun, init_val)
    what = "the body of a lax.while_loop"

    def as_carry(pure_of: Callable, values: list[Any]) -> tuple[Any, list[Any]]:
        test = pure_of(cond_fun, "the cond_fun of a lax.while_loop", reads_only=True)
        step = pure_of(body_fun)
        return lax.while_loop(
            lambda carry: test(carry[1], carry[0])[0],
            lambda carry: step(carry[1], carry[0]),
            (init_val, values),
        )

    # (No plain call when the body assigns nothing: cond_fun is checked all the same.)
    return lift(cells, probed(cells, what, body_fun, abstract_of(init_val)), what, as_carry)


def fori_loop(
    lower: Any, upper: Any, body_fun: Callable[[Any, Any], Any], init_val: Any, **kwargs: Any
) -> Any:
    """``jax.lax.fori_loop`` whose body may read and assign state.

    Args:
        lower: the first index.
        upper: the index the loop stops before.
        body_fun: ``(i, value) -> value``; it may read and assign state.
        init_val: the initial loop value.
        **kwargs: any other option of ``jax.lax.fori_loop`` (``unroll``).

    Returns:
        The final loop value; assigned states hold their final values.

    Examples:
        >>> @autostate.stateful
        ... class Decoder:
        ...     def __init__(self):
        ...         self.cache = jnp.zeros(4)
        ...
        ...     def fill(self):
        ...         def body(i, token):
        ...             self.cache = self.cache.at[i].set(token)  # a traced index
        ...             return token + 1.0
        ...
        ...         return jax.lax.fori_loop(0, 4, body, 1.0)
        >>> decoder = Decoder()
        >>> print(decoder.fill(), decoder.cache)
        5.0 [1. 2. 3. 4.]
    """
    if jit_disabled():
        return lax.fori_loop(lower, upper, body_fun, init_val, **kwargs)
    roots = (body_fun, init_val)
    return with_eager_states(
        roots,
        lambda: _fori_loop(lower, upper, body_fun, init_val, kwargs),
        "the body of a lax.fori_loop",
    )


def _fori_loop(lower: Any, upper: Any, body_fun: Callable, init_val: Any, options: dict) -> Any:
    cells = running_cells()
    if not cells:
        return lax.fori_loop(lower, upper, body_fun, init_val, **options)
    what = "the body of a lax.fori_loop"
    low, high = _static_int(lower), _static_int(upper)
    if low is not None and high is not None and high <= low:
        return lax.fori_loop(lower, upper, _never_run(cells, body_fun, what), init_val, **options)
    index = jax.ShapeDtypeStruct((), jax.numpy.result_type(lower, upper))

    def as_carry(pure_of: Callable, values: list[Any]) -> tuple[Any, list[Any]]:
        step = pure_of(body_fun)
        return lax.fori_loop(
            lower, upper, lambda i, carry: step(carry[1], i, carry[0]), (init_val, values),
            **options,
        )

    return lift(
        cells, probed(cells, what, body_fun, index, abstract_of(init_val)), what, as_carry,
        lambda: lax.fori_loop(lower, upper, body_fun, init_val, **options),
    )


def map(f: Callable[[Any], Any], xs: Any, **kwargs: Any) -> Any:  # noqa: A001 - jax's name
    """``jax.lax.map`` whose function may read and assign state, element after element.

    Args:
        f: ``x -> y``, applied to each element of ``xs`` in order.
        xs: the elements, stacked along the leading axis.
        **kwargs: any other option of ``jax.lax.map``; a ``batch_size`` needs
            a function that assigns no state (batched elements run at once,
            not in order).

    Returns:
        The stacked outputs, as ``jax.lax.map``.

    Examples:
        >>> @autostate.stateful
        ... class Total:
        ...     def __init__(self):
        ...         self.sum = jnp.zeros(())
        ...
        ...     def __call__(self, x):
        ...         self.sum += x
        ...         return self.sum  # the running total: every element in order
        >>> total = Total()
        >>> print(autostate.map(total, jnp.arange(4.0)), total.sum)
        [0. 1. 3. 6.] 6.0
    """
    xs = layers_mapped(xs)
    if jit_disabled():
        return lax.map(f, xs, **kwargs)
    return with_eager_states((f, xs), lambda: _map(f, xs, kwargs), "the function of a lax.map")


def _map(f: Callable, xs: Any, options: dict[str, Any]) -> Any:
    cells = running_cells()
    what = "the function of a lax.map"
    if not cells:
        return lax.map(f, xs, **options)
    if options.get("batch_size") is None:
        _, ys = _scan(lambda carry, x: (carry, f(x)), None, xs, {}, what)
        return ys
    members = members_of(cells, xs)
    if members:
        raise ControlFlowStateError(
            format_error(
                f"A lax.map with batch_size maps over a stacked sub-model (state "
                f"{cells[members[0]].name!r}); its batched elements run under jax.vmap, "
                "which lax.map does not give the members' states to.",
                where=user_location(),
                fix="drop batch_size, or call jax.vmap over the sub-model for each batch.",
            )
        )
    written, _ = writes_of(cells, f, _step_slice(xs), what=what)
    if written:
        raise ControlFlowStateError(
            format_error(
                f"The function of a lax.map with batch_size assigns state "
                f"{cells[written[0]].name!r}; batched elements run at once, so there is no "
                "order in which to apply the writes.",
                where=user_location(),
                fix="drop batch_size (elements then run one after another), or assign the "
                "state outside the map.",
            )
        )
    return lax.map(f, xs, **options)


