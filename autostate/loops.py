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

A loop that cannot be rolled runs unrolled, with the plain meaning: the
attempt is undone (the states it touched, the refusals it recorded) and
the plain loop runs. That covers what the rewrite sees (``break``,
``return``, ...: ``unrolled``) and what only running the body shows:
Python branching on the layer index (``if i == 0:``), a Python value that
changes each step, a change outside the states the guard refuses. A stack
made with ``require_scan=True`` turns "could not roll" into a
``StackError`` that names the reason and the loop's line.
"""

from __future__ import annotations

import builtins
import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax._src.lax import lax as _lax_internal  # (a weakly typed index: no public spelling)

from autostate import graph as _graph
from autostate.effects.local_state import running_cells
from autostate.errors import (
    StackError,
    TracedValueError,
    format_error,
    refusals_kept_apart,
    user_location,
)
from autostate.lifetime import contains_tracer, current_trace
from autostate.lifting import core as _lift
from autostate.lifting import loops as _lax_loops
from autostate.state_values import same_static

__all__ = ["UNBOUND", "Deferred", "Rolling", "over", "unrolled"]


class _Unbound:
    """A local with no value (the rolled body deletes it, as unbound)."""

    def __repr__(self) -> str:
        return "UNBOUND"


UNBOUND = _Unbound()
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


class _CannotRoll(Exception):
    pass


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
            except Exception as raised:  # noqa: BLE001 - any failure means: the plain loop
                if _strict(_stacks_in(self.source)):
                    raise _not_rolled(_reason(raised)) from raised
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
                        f"its body changes `{names[k]}` ({type(values[k]).__name__}), which a "
                        "scan cannot carry"
                    )
            for k in dynamic:
                if not _arrays(out[k]):
                    raise _CannotRoll(f"its body makes `{names[k]}` a value a scan cannot carry")
            ys, statics = {}, {}
            for k, v in enumerate(out):
                if k in carried:
                    continue
                if v is not UNBOUND and _arrays(v):
                    ys[k] = v
                elif contains_tracer(v):
                    raise _CannotRoll(
                        f"`{names[k]}`, which the code after the loop reads, holds arrays "
                        "and other values"
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


def _reason(raised: BaseException) -> str:
    if isinstance(raised, _CannotRoll):
        return str(raised)
    if isinstance(raised, (jax.errors.ConcretizationTypeError, TracedValueError)):
        return (
            "its body uses a value that differs from layer to layer (the layer index, a "
            "carried local) where Python needs a concrete one, as in `if i == 0:`"
        )
    first = str(raised).strip().splitlines()
    return f"running its body as one step raised {type(raised).__name__}" + (
        f" ({first[0]})" if first else ""
    )


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
