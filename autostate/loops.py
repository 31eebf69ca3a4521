"""Loop rolling, at run time: a ``for`` loop over a stack runs as one ``lax.scan``.

A decorated method's ``for`` loop is compiled with its body also as a
function of the locals it carries (``transform.loops``). When the loop
starts, ``over`` looks at what it iterates: under a JAX trace, a stack of
layers (``autostate.stack``), or ``enumerate``, ``zip`` or ``reversed`` of
one (zipped with other stacks, arrays or lists of like arrays), gives a
``Rolling``, whose ``run`` calls the body through ``lax.scan`` (the
lifting of ``lifting.scan``: each step gets one layer, whose state writes
come back stacked; the model's other states are threaded as carry).
Anything else, and any loop outside a trace, is the plain iterable: the
loop runs as written, layer by layer.

What the scan carries are the locals the body may read before it assigns
them and finds bound when the loop starts (``x = block(x)``); a local it
assigns first and the code after the loop reads (``h = ...``) leaves the
scan stacked, its last entry kept. A carried local that is no array (a Python number, a string, a
config object) must come out of the body as it went in, since a scan
carries arrays only: a number that becomes an array (``aux = 0`` then
``aux = aux + loss``) is carried from the start as an array of the dtype
it becomes; any other change cannot be rolled.

A loop that cannot be rolled runs unrolled, with the plain meaning. What
the rewrite sees (``break``, ``return``, ...) never starts a scan
(``unrolled``); what only running the body shows is one of the named
reasons of ``FALLBACKS`` (Python branching on the layer index, ``if i ==
0:``; a Python value that changes each step; a carried local that changes
shape; a state's structure that changes; a change outside the states the
guard refuses): then the attempt is undone (the states it touched, the
refusals it recorded), the reason logged (``logging``, ``autostate.loops``,
at DEBUG) and the plain loop runs. Any other exception of the body reaches
the user at their line, as the plain loop would raise it. A stack made with
``require_scan=True`` turns "could not roll" into a ``StackError`` that
names the reason and the loop's line.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax._src.lax import lax as _lax_internal  # (a weakly typed index: no public spelling)

from autostate import graph as _graph
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
from autostate.lifting import core as _lift
from autostate.lifting import loops as _lax_loops
from autostate.state_values import same_static

__all__ = ["FALLBACKS", "UNBOUND", "Deferred", "Rolling", "over", "unrolled"]


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
        kinds = {(jnp.shape(v), jnp.result_type(v), _lift.weak_types(v)) for v in source}
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
        index = _weak(jnp.arange(start, start + inner.length))
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


def _weak(index: Any) -> Any:
    """``index`` weakly typed, as a Python int is: ``x_int8 * i`` stays int8."""
    convert = getattr(_lax_internal, "_convert_element_type", None)
    return index if convert is None else convert(index, weak_type=True)


def _stacks_in(source: Any) -> list[Any]:
    if type(source) is Deferred:
        return [s for a in source.args for s in _stacks_in(a)]
    return [source] if type(source) in _STRICT else []


def _strict(stacks: Sequence[Any]) -> bool:
    return any(_STRICT[type(s)](s) for s in stacks)


def over(source: Any) -> Any:
    """What a rewritten loop iterates: a ``Rolling`` where the loop can run
    as one scan, else ``source`` itself (a ``Deferred`` called)."""
    if current_trace() is None or not _STRICT or _lift.jit_disabled():
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

    __slots__ = ("source", "plan")

    def __init__(self, source: Any, plan: _Plan):
        self.source, self.plan = source, plan

    def plain(self) -> Any:
        """The iterable of the plain loop."""
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
                    raise  # (the body's own error, at the user's line)
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
                if _kinds(out[k]) != _kinds(v):
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

        carry, ys = _lax_loops.scan(step, init, plan.xs, reverse=plan.reverse)
        result = [UNBOUND] * len(values)
        for k, v in zip(dynamic, carry):
            result[k] = v
        result_last = 0 if plan.reverse else -1
        for k, y in ys.items():
            result[k] = jax.tree_util.tree_map(lambda a: a[result_last], y)
        for k, v in kept.values.items():
            result[k] = v
        return tuple(result)


def _kinds(value: Any) -> Any:
    """The structure, shapes and dtypes of a tree of arrays (what a carry keeps)."""
    leaves, tree = jax.tree_util.tree_flatten(value)
    return tree, [(jnp.shape(v), jnp.result_type(v)) for v in leaves]


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
                    if type(slot) is _lift.LostState:
                        obj.__dict__[attr] = slot.slot
            kept.clear()
            raise
