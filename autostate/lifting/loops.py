"""``lax.scan``, ``lax.while_loop``, ``lax.fori_loop`` and ``lax.map``: the
states the body assigns go into the carry; a stacked sub-model's into
``xs`` and ``ys`` (``core``).

Also the rolled ``for`` loop, run as one such ``lax.scan``. A decorated
method's ``for`` loop is compiled with its body also as a function of the
locals it carries (``transform.loops``). When the loop starts, ``over`` looks
at what it iterates: under a JAX trace, a stack of layers, or ``enumerate``,
``zip`` or ``reversed`` of one (zipped with other stacks, arrays or lists of
like arrays), gives a ``Rolling``, whose ``run`` calls the body through
``scan``: each step gets one layer, whose state writes come back stacked.
Anything else, and any loop outside a trace, runs as written.

The scan carries the locals the body may read before it assigns them and
finds bound when the loop starts (``x = block(x)``); a local it assigns first
and the code after the loop reads leaves the scan stacked, its last entry
kept. A carried local that is no array must come out of the body as it went
in (a scan carries arrays only), except a number that becomes an array
(``aux = aux + loss``), carried from the start as an array of that dtype.

A loop that cannot roll runs unrolled, with the plain meaning: for what the
rewrite sees (``break``, ``return``: ``unrolled``) or one of the named
reasons of ``FALLBACKS`` that only running the body shows. The attempt is
then undone (the states it touched, the refusals it recorded), the reason
logged at DEBUG, and the plain loop runs. Any other exception is the
body's own: the attempt is undone and the plain loop runs, which raises it
at the user's line after the layers before it have run (their writes are
there for a caller that catches it, as in plain Python); a plain loop that
ends without raising it raises it at its end, so it is never lost. A stack
made with ``require_scan=True`` turns "could not roll" into a ``StackError``
naming the reason and the loop's line, and raises the body's own error as
the rolled body raised it.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from autostate import graph as _graph
from autostate import values as _values
from autostate.effects.local_state import running_cells
from autostate.errors import (
    ControlFlowStateError,
    EscapedStateError,
    StackError,
    StateAccessError,
    StaticStateError,
    TracedValueError,
    format_error,
    refusals_kept_apart,
    user_location,
)
from autostate.lifetime import contains_tracer, current_trace
from autostate.lifting.core import (
    Cells,
    LostState,
    PassedModels,
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
    type_of,
    weak_types,
    with_eager_states,
    with_layer_views,
    writes_of,
)
from autostate.state_values import same_static


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
    passed = PassedModels(init, received_at=0, returned_at=0, loop=True)
    return passed.result(with_eager_states(
        (f, init, xs), lambda: _scan(passed.body(f), init, xs, options), "the body of a lax.scan"
    ))


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
    passed = PassedModels(init_val, received_at=0, returned_at=None, loop=True)
    return passed.result(with_eager_states(
        roots, lambda: _while_loop(cond_fun, passed.body(body_fun), init_val), "a lax.while_loop"
    ))


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
    passed = PassedModels(init_val, received_at=1, returned_at=None, loop=True)
    return passed.result(with_eager_states(
        roots,
        lambda: _fori_loop(lower, upper, passed.body(body_fun), init_val, kwargs),
        "the body of a lax.fori_loop",
    ))


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


# --- the rolled for loop -------------------------------------------------------


class _Unbound:
    """A local with no value (the rolled body deletes it, as unbound)."""

    def __repr__(self) -> str:
        return "UNBOUND"


UNBOUND = _Unbound()
_log = logging.getLogger(__name__)
_NUMBERS = (int, float, bool, complex)
_ARRAY_TYPES = (jax.Array, jax.core.Tracer)

# The stack types and whether a loop over one must roll (``require_scan``):
# fields of their node kinds (``graph.NodeKind.stacked`` / ``must_roll``).
_STRICT = _graph.MUST_ROLL


class Deferred:
    """``enumerate(a)``, ``zip(a, b)`` or ``reversed(a)`` in a loop's header,
    not called yet, so that ``over`` sees the stack inside."""

    __slots__ = ("func", "args", "kwargs")

    def __init__(self, func: Any, args: tuple, kwargs: dict[str, Any]):
        self.func, self.args, self.kwargs = func, args, kwargs

    def plain(self) -> Any:
        """The call, as the loop header spells it."""
        args = self.args
        if any(type(a) is Deferred for a in args):
            args = tuple(_plain(a) for a in args)
        return self.func(*args, **self.kwargs)


def _plain(source: Any) -> Any:
    return source.plain() if type(source) is Deferred else source


def _raising_at_end(items: Any, error: BaseException) -> Iterator[Any]:
    yield from items
    raise error


class _Plan:
    """What a rolled loop scans over: ``xs``, how one step's slice of it
    becomes the loop's item, and the item after the last step."""

    def __init__(
        self, xs: Any, item: Callable[[Any], Any], length: int,
        last: Callable[[], Any], reverse: bool = False,
    ):
        self.xs, self.item, self.length = xs, item, length
        self.last, self.reverse = last, reverse


def _leaf_plan(source: Any) -> _Plan | None:
    t = type(source)
    if t in _STRICT or (isinstance(source, _ARRAY_TYPES) and jnp.ndim(source) >= 1):
        n = len(source)  # (a stack's depth, an array's leading axis)
        return _Plan(source, lambda x: x, n, lambda: source[n - 1])
    if (t is list or t is tuple) and source and all(
        isinstance(v, _ARRAY_TYPES) for v in source
    ):
        kinds = {(jnp.shape(v), jnp.result_type(v), weak_types(v)) for v in source}
        if len(kinds) == 1:
            return _Plan(jnp.stack(source), lambda x: x, len(source), lambda: source[-1])
    return None


def _plan(source: Any) -> _Plan | None:
    if type(source) is not Deferred:
        return _leaf_plan(source)
    func, args, kwargs = source.func, source.args, source.kwargs
    if func is builtins.enumerate:
        if len(args) not in (1, 2) or set(kwargs) - {"start"} or (len(args) == 2 and kwargs):
            return None
        start = args[1] if len(args) == 2 else kwargs.get("start", 0)
        found = _plan(args[0])
        if found is None or found.reverse or type(start) is not int:
            return None
        inner = found
        # (Weakly typed, as a Python int is: ``x_int8 * i`` stays int8.)
        index = _values.weakly_typed(jnp.arange(start, start + inner.length))
        return _Plan(
            (index, inner.xs), lambda x: (x[0], inner.item(x[1])), inner.length,
            lambda: (start + inner.length - 1, inner.last()),
        )
    if func is builtins.zip:
        parts = [_plan(a) for a in args]
        if not parts or set(kwargs) - {"strict"} or any(p is None or p.reverse for p in parts):
            return None
        lengths = {p.length for p in parts}  # type: ignore[union-attr]
        if len(lengths) != 1:
            return None  # (zip stops at the shortest: the plain loop)
        plans: list[_Plan] = parts  # type: ignore[assignment]
        return _Plan(
            tuple(p.xs for p in plans),
            lambda x: tuple(p.item(v) for p, v in zip(plans, x)),
            plans[0].length,
            lambda: tuple(p.last() for p in plans),
        )
    if func is builtins.reversed and len(args) == 1 and not kwargs:
        leaf = _leaf_plan(args[0])
        if leaf is None:
            return None
        return _Plan(leaf.xs, leaf.item, leaf.length, lambda: args[0][0], True)
    return None


def _stacks_in(source: Any) -> list[Any]:
    if type(source) is Deferred:
        return [s for a in source.args for s in _stacks_in(a)]
    return [source] if type(source) in _STRICT else []


def _strict(stacks: Sequence[Any]) -> bool:
    return any(_STRICT[type(s)](s) for s in stacks)


def over(source: Any) -> Any:
    """What a rewritten loop iterates: a ``Rolling`` where the loop can run
    as one scan, else ``source`` itself (a ``Deferred`` called)."""
    if current_trace() is None or not _STRICT or jit_disabled():
        return _plain(source)
    stacks = _stacks_in(source)
    if not stacks:  # (a list of arrays alone is never stacked: the plain loop)
        return _plain(source)
    plan = _plan(source)
    if plan is None or plan.length < 1:
        if _strict(stacks):
            what = "what it iterates is not one stack (or stacks, arrays and lists of one length)"
            raise _not_rolled(what)
        return _plain(source)
    return Rolling(source, plan)


def unrolled(source: Any, reason: str) -> Any:
    """The iterable of a loop the rewrite left unrolled for ``reason``."""
    if current_trace() is not None and _STRICT and _strict(_stacks_in(source)):
        raise _not_rolled(reason)
    return _plain(source)


def _not_rolled(reason: str) -> StackError:
    return StackError(
        format_error(
            "A loop over a stack made with require_scan=True cannot be rolled into one "
            f"lax.scan: {reason}.",
            where=user_location(),
            fix="write the loop so that each layer's step is the same function of the "
            "carried locals (no break / continue / return, no Python branching on the layer "
            "index); or drop require_scan=True to let it run layer by layer.",
        )
    )


# Why a loop that started to roll runs as written after all: the one list of
# them. Each says that the body cannot be one step of a scan (name -> what the
# message says); ``_fallback`` tells them from any other exception, which
# reaches the user as the body raised it, at their line (as the plain loop,
# which would raise it too, does). The rewrite's reasons (``break``, ``return``,
# ...: ``unrolled``) never start a scan.
FALLBACKS: dict[str, str] = {
    # A local of Python value (not carried: a scan carries arrays) that the body changes.
    "python-value": "its body changes a Python value from step to step, which a scan cannot carry",
    # A carried array local that comes out of a step with another shape, dtype or structure.
    "carry-changes": "its body changes the shape, dtype or structure of a local it carries",
    # A value that differs from step to step (the layer index, a carried local)
    # where Python needs a concrete one: ``if i == 0:``, ``int(i)``, ``xs[i]``.
    "concrete-value": (
        "its body uses a value that differs from layer to layer (the layer index, a "
        "carried local) where Python needs a concrete one, as in `if i == 0:`"
    ),
    # A state whose shape, dtype or structure (or static value) a step changes:
    # the lifting's refusal, which the plain loop may make layer by layer.
    "state-structure": "its body changes a state's shape, dtype, structure or static value",
    # A change outside the states (a captured list changed in place, a traced
    # value given to an attribute that is no state): the guard's refusal under
    # the scan, which the plain loop either makes at the line or does not need;
    # or a traced value kept outside the states from one trace of the body to
    # the next (JAX's UnexpectedTracerError: a cache on an undecorated object).
    "outside-states": "its body changes something outside the states, which a scan cannot carry",
}


class _CannotRoll(Exception):
    """One of ``FALLBACKS`` (``name``), found while the body runs as one step."""

    def __init__(self, name: str, detail: str):
        super().__init__(detail)
        self.name = name


_CONCRETE_ERRORS = (
    jax.errors.ConcretizationTypeError,  # (TracerBoolConversionError too)
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerArrayConversionError,
    TracedValueError,
)


def _fallback(raised: BaseException) -> tuple[str, str] | None:
    """``(name, message)`` of the ``FALLBACKS`` reason ``raised`` says, or
    ``None``: then it is the body's own error."""
    if isinstance(raised, _CannotRoll):
        return raised.name, str(raised)
    if isinstance(raised, _CONCRETE_ERRORS) or (
        # Python's and JAX's own checks on a traced index, key or size
        # (``d[i]``, ``x[:i]``, ``jnp.zeros(i)``) say so by naming the tracer.
        isinstance(raised, (TypeError, IndexError, KeyError, ValueError))
        and "Tracer" in str(raised)
    ):
        name = "concrete-value"
    elif isinstance(raised, (ControlFlowStateError, StaticStateError)):
        name = "state-structure"
    elif isinstance(raised, (EscapedStateError, StateAccessError, jax.errors.UnexpectedTracerError)):
        name = "outside-states"
    else:
        return None
    first = str(raised).strip().splitlines()
    # (The reason says all of a concrete value; a refusal's first line says which state or value.)
    detail = f" ({type(raised).__name__}: {first[0]})" if first and name != "concrete-value" else ""
    return name, FALLBACKS[name] + detail


class _Promote(Exception):  # noqa: N818 - a signal, not an error
    """Local ``k``, a Python value, became an array of ``dtype`` in the body."""

    def __init__(self, k: int, dtype: Any):
        self.k, self.dtype = k, dtype


def _arrays(value: Any) -> bool:
    """Whether ``value`` is an array or a tree of arrays only, what a scan
    carries (a model is not: its states are the scan's own to thread)."""
    leaves = jax.tree_util.tree_leaves(value)
    return (
        bool(leaves)
        and all(isinstance(v, _ARRAY_TYPES) for v in leaves)
        and not _graph.holds_instance(value)
    )


class _Kept:
    """What the last trace of a rolled body left in the locals it does not
    carry or stack: Python values, the same at every step (an attribute, not
    a dict the body's guard would see change)."""

    __slots__ = ("values",)

    def __init__(self) -> None:
        self.values: dict[int, Any] = {}


def _same(a: Any, b: Any) -> bool:
    return a is b or (type(a) in (*_NUMBERS, str) and same_static(a, b))


class Rolling:
    """A loop about to run as one ``lax.scan`` (``run``), or, if it cannot,
    as written (``plain``)."""

    __slots__ = ("source", "plan", "raised")

    def __init__(self, source: Any, plan: _Plan):
        self.source, self.plan = source, plan
        self.raised: BaseException | None = None  # (the body's own error, if it raised one)

    def plain(self) -> Any:
        """The iterable of the plain loop (after the body's own error: one
        that raises that error if the plain loop ends without raising one)."""
        if self.raised is not None:
            return _raising_at_end(_plain(self.source), self.raised)
        return _plain(self.source)

    def run(
        self, body: Callable[[Any, tuple], tuple], values: tuple, names: tuple, reads: tuple,
        wants_last: bool,
    ) -> tuple[tuple, Any] | None:
        """Runs the loop as one scan of ``body(item, values) -> values``:
        ``(each local's value after the loop or UNBOUND, the last item)``,
        or ``None`` where it cannot (the plain loop then runs)."""
        promoted: dict[int, Any] = {}
        while True:
            try:
                with _undone_on_failure(body, self.plan.xs, values):
                    out = self._scan(body, values, names, reads, promoted)
            except _Promote as signal:
                promoted[signal.k] = signal.dtype
                continue
            except Exception as raised:
                found = _fallback(raised)
                if found is None:
                    if _strict(_stacks_in(self.source)):
                        raise  # (the body's own error, at the user's line)
                    # The plain loop raises it at the user's line, after the
                    # layers before have run (a caller that catches it sees their
                    # writes, as plain Python's do); one that ends without it
                    # (the rolled body alone raised it) raises it at its end.
                    self.raised = raised
                    return None
                name, reason = found
                if _strict(_stacks_in(self.source)):
                    raise _not_rolled(f"{reason} [{name}]") from raised
                _log.debug("a loop at %s runs as written: %s [%s]", user_location(), reason, name)
                return None
            last = self.plan.last() if wants_last else UNBOUND
            return out, last

    def _scan(
        self, body: Callable[[Any, tuple], tuple], values: tuple, names: tuple, reads: tuple,
        promoted: dict[int, Any],
    ) -> tuple:
        plan = self.plan
        carried = [k for k, v in enumerate(values) if reads[k] and v is not UNBOUND]
        dynamic = [k for k in carried if k in promoted or _arrays(values[k])]
        static = [k for k in carried if k not in dynamic]
        given = [UNBOUND] * len(values)
        for k in static:
            given[k] = values[k]
        init = [
            jnp.asarray(values[k], promoted[k]) if k in promoted else values[k]
            for k in dynamic
        ]
        kept = _Kept()

        def step(carry: list[Any], x: Any) -> tuple[list[Any], dict[int, Any]]:
            now = list(given)
            for k, v in zip(dynamic, carry):
                now[k] = v
            out = body(plan.item(x), tuple(now))
            for k in static:
                if not _same(out[k], values[k]):
                    if type(values[k]) in _NUMBERS and isinstance(out[k], _ARRAY_TYPES):
                        raise _Promote(k, jnp.result_type(out[k]))
                    raise _CannotRoll(
                        "python-value",
                        f"its body changes `{names[k]}` ({type(values[k]).__name__}), which a "
                        "scan cannot carry",
                    )
            for k, v in zip(dynamic, carry):
                if not _arrays(out[k]):
                    raise _CannotRoll(
                        "python-value", f"its body makes `{names[k]}` a value a scan cannot carry"
                    )
                if type_of(out[k]) != type_of(v):
                    raise _CannotRoll(
                        "carry-changes",
                        f"its body changes the shape, dtype or structure of `{names[k]}`, which "
                        "a scan carries",
                    )
            ys, statics = {}, {}
            for k, v in enumerate(out):
                if k in carried:
                    continue
                if v is not UNBOUND and _arrays(v):
                    ys[k] = v
                elif contains_tracer(v):
                    raise _CannotRoll(
                        "python-value",
                        f"`{names[k]}`, which the code after the loop reads, holds arrays "
                        "and other values",
                    )
                else:
                    statics[k] = v
            kept.values = statics
            return [out[k] for k in dynamic], ys

        carry, ys = scan(step, init, plan.xs, reverse=plan.reverse)
        result = [UNBOUND] * len(values)
        for k, v in zip(dynamic, carry):
            result[k] = v
        result_last = 0 if plan.reverse else -1
        for k, y in ys.items():
            result[k] = jax.tree_util.tree_map(lambda a: a[result_last], y)
        for k, v in kept.values.items():
            result[k] = v
        return tuple(result)


@contextlib.contextmanager
def _undone_on_failure(body: Any, xs: Any, values: tuple) -> Iterator[None]:
    """Undoes what a failed attempt left: the running states it marked lost,
    the eager states it marked lost, the refusals it recorded."""
    cells = running_cells()
    saved = [cell.value for cell in cells]
    with refusals_kept_apart() as kept:
        try:
            yield
        except BaseException:
            for cell, value in zip(cells, saved):
                cell.value = value
            for obj in _graph.reachable_instances((body, xs, values), []):
                for attr, slot in list(vars(obj).items()):
                    if type(slot) is LostState:
                        obj.__dict__[attr] = slot.slot
            kept.clear()
            raise
