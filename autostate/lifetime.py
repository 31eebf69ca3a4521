"""Tracer lifetime: which JAX values a model may keep, and for how long.

A tracer lives as long as its trace. A model built inside a trace (a
temporary instance in a jitted step, a model frozen there) lives there too,
its *home*, and may keep that trace's values; any other tracer stored in an
eager model would outlive its trace, and a handled state holding a finished
trace's tracer has no value. This module answers those questions in one
place: the trace running now, whether a value holds a (escaped) tracer, the
slots a state's first value or an eager write makes and where they live
(``initial_slot``, ``written_slot``, ``home_of``), what a state holds once
its traced body raised (``LostValue``), the functionalized calls running in
every thread, and ``CopiedRef``, a running model's state in the copy JAX
makes of it. The engine asks it through the slot hooks, registered below."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import types
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any

import jax
from jax._src import core as _core

from autostate import graph as _graph
from autostate import tree as _tree
from autostate.effects.local_state import (
    Category,
    FrozenLocalStateRequest,
    HandledLocalStateRef,
    HandlerId,
    InitialLocalStateRequest,
    StateSlot,
    running_call,
    running_calls,
)
from autostate.errors import (
    AutostateError,
    ControlFlowStateError,
    EscapedStateError,
    TracedEagerStateError,
    UnhandledLocalStateError,
    escaped_state_message,
    format_error,
    user_location,
)
from autostate.slot_hooks import WriteNote, register_slot_hooks
from autostate.unsortable import Unsortable, leaves_in_own_order
from autostate.values import CONCRETE_LEAF_TYPES, is_iterator, leaves_within_opaque, opaque_items


class LostValue:
    """What a state holds once the traced body that assigned it raised: JAX kept
    nothing it computed, while plain Python's loop kept the assignment. Reading
    it raises; assigning it gives it a value again."""

    __slots__ = ("name", "what", "raised", "where", "late")

    def __init__(
        self, name: str, what: str, raised: BaseException | None, where: str | None,
        late: Callable[[], AutostateError] | None = None,
    ):
        self.name = name
        self.what = what
        self.raised = raised
        self.where = where
        # (A value that no longer exists where it is read: ``late()`` is the
        # error, made at the read, so that it names the line that reads.)
        self.late = late

    def error(self) -> AutostateError:
        """The error a read of the state raises."""
        if self.late is not None:
            return self.late()
        return ControlFlowStateError(
            format_error(
                f"State {self.name!r} has no value: it was assigned inside {self.what}"
                f"{f' (at {self.where})' if self.where else ''}, which then raised "
                f"{type(self.raised).__name__}. JAX traces that body instead of running it, "
                "and keeps nothing a body that raises computed, so the assignment is lost "
                "(plain Python would have kept it, unless this is a branch or loop body it "
                "never runs: JAX traces those too).",
                fix="let the exception end the call instead of catching it around the lax "
                "call, or check its condition before the call; or assign the state again "
                "before reading it.",
            )
        )


def is_escaped_tracer(value: Any) -> bool:
    """Whether ``value`` is a tracer of a trace that has ended (a state assigned
    in a ``lax`` body autostate did not thread holds one)."""
    if not isinstance(value, jax.core.Tracer):
        return False
    trace = value._trace
    live = _core.trace_ctx.trace
    if live is trace:
        return False  # the common case: a tracer of the trace running now
    if not trace.is_valid():
        return True
    # JAX does not invalidate the trace of a finished lax body, nor that of a
    # finished ``jax.grad`` (a state written inside ``jax.grad(loss)`` in a
    # method), so look for the tracer's trace among the live ones. Only a
    # chain that reaches the eager root is complete (some internal traces
    # have no parent); short of that, the tracer is given the benefit of the
    # doubt.
    while live is not trace:
        parent = getattr(live, "parent_trace", None)
        if parent is None:
            # The chain of a function JAX traces on its own (a custom_jvp's,
            # a custom_vjp's) reaches the root without the trace of the call
            # around it, which is live: a functionalized call started in it,
            # or a lifted body (a lax body, its abstract probe) runs in it.
            # (JAX refuses such a function closing over a value it
            # differentiates: that one is refused here, at the user's line.)
            return isinstance(live, _core.EvalTrace) and not (
                type(trace).__name__ not in _DIFFERENTIATING
                and (id(trace) in LIFT_TRACES.get() or _call_started_in(trace))
            )
        live = parent
    return False


_DIFFERENTIATING = frozenset({"JVPTrace", "LinearizeTrace"})


def ended_trace_of(value: Any) -> str | None:
    """What JAX traced for (``"checkpoint / remat"``, ``"jit"``) the trace of a
    tracer in ``value`` that is none of the traces running now; ``""`` where it
    does not say; ``None`` when every tracer in ``value`` is of a running
    trace. Strict, unlike ``is_escaped_tracer``: for a function JAX traces
    after the call that read the value has ended."""
    if type(value) in CONCRETE_LEAF_TYPES:
        return None
    leaves = [x for x in jax.tree_util.tree_leaves(value) if isinstance(x, jax.core.Tracer)]
    if not leaves:
        return None
    live = {id(t) for t in _trace_chain(current_trace())}
    for leaf in leaves:
        trace = _trace_of(leaf)
        if id(trace) not in live:
            info = getattr(getattr(trace, "frame", None), "debug_info", None)
            return str(getattr(info, "traced_for", "") or "")
    return None


def _call_started_in(trace: Any) -> bool:
    """Whether a running functionalized call started in ``trace`` or in a
    transformation inside it (its trace is then live)."""
    for call in running_calls():
        live = trace_of_call(call)
        while live is not None:
            if live is trace:
                return True
            live = getattr(live, "parent_trace", None)
    return False


def holds_escaped_tracer(value: Any) -> bool:
    """Whether ``value`` is, or a leaf of it (a dict or tuple state) is, an
    escaped tracer. A single tracer or a concrete leaf is decided without
    walking a tree: most state reads, and most states a call returns."""
    if isinstance(value, jax.core.Tracer):
        return is_escaped_tracer(value)
    if type(value) in CONCRETE_LEAF_TYPES:
        return False
    try:
        leaves = jax.tree_util.tree_leaves(value)
    except (ValueError, TypeError) as err:
        leaves = leaves_in_own_order(value, err)
    return any(is_escaped_tracer(leaf) for leaf in leaves_within_opaque(leaves))


def contains_tracer(value: Any) -> bool:
    """Whether any leaf of ``value`` is a JAX tracer."""
    t = type(value)
    if t in CONCRETE_LEAF_TYPES:
        return False
    # (An iterator -- a generator passed to ``f`` -- is a leaf: no tracer
    # there, and JAX warns when it meets one unasked.)
    try:
        leaves = jax.tree_util.tree_leaves(value, is_leaf=is_iterator)
    except (ValueError, TypeError) as err:
        leaves = leaves_in_own_order(value, err)
        return any(isinstance(leaf, jax.core.Tracer) for leaf in leaves)
    if len(leaves) == 1 and leaves[0] is value and not isinstance(value, jax.core.Tracer):
        if opaque_items(value) is not None:
            return contains_tracer_in_opaque(value)
        CONCRETE_LEAF_TYPES.add(t)
        return False
    return any(
        isinstance(leaf, jax.core.Tracer)
        or (type(leaf) not in CONCRETE_LEAF_TYPES and contains_tracer_in_opaque(leaf))
        for leaf in leaves
    )


def contains_tracer_in_opaque(leaf: Any) -> bool:
    """Whether a tracer is among the items of a container JAX took as one leaf."""
    return any(isinstance(x, jax.core.Tracer) for x in leaves_within_opaque([leaf]))


def trace_of(tracer: Any) -> Any:
    """The trace ``tracer`` is a value of (the home of a model holding it)."""
    return getattr(tracer, "_trace", None)


_trace_of = trace_of


def current_trace() -> Any:
    """The JAX trace running now, or ``None`` outside every transformation."""
    trace = getattr(_core, "trace_ctx", None)
    trace = getattr(trace, "trace", None)
    return None if trace is None or isinstance(trace, _core.EvalTrace) else trace


def _trace_chain(trace: Any) -> Iterator[Any]:
    """``trace`` and the traces it runs inside, innermost first."""
    while trace is not None and not isinstance(trace, _core.EvalTrace):
        yield trace
        trace = getattr(trace, "parent_trace", None)


def under_staging_trace() -> bool:
    """Whether a trace that stages a program (``jax.jit``, a lax body) runs
    now, around or at the current one: arrays made there are its tracers,
    so a concrete array was made outside it (under ``grad`` or ``vmap``
    alone an array made inside may be concrete)."""
    return any(type(t).__name__ == "DynamicJaxprTrace" for t in _trace_chain(current_trace()))


def _enclosing_traces(trace: Any) -> set[int]:
    """Ids of ``trace`` and of the traces it runs inside."""
    return set(map(id, _trace_chain(trace)))


def _tracers(value: Any) -> tuple[list[Any], bool]:
    """The tracers among ``value``'s leaves, and whether ``value`` holds a dict
    whose keys do not sort (a state eager Python keeps, but that JAX cannot
    flatten: ``unsortable_keys_error`` refuses it where ``f`` would need it).
    Under a trace, a leaf that is a function, a ``functools.partial`` or a
    plain object is looked into too (``held_tracers``)."""
    try:
        leaves = jax.tree_util.tree_leaves(value)
    except (ValueError, TypeError) as err:
        leaves = leaves_in_own_order(value, err)
        return [leaf for leaf in leaves if isinstance(leaf, jax.core.Tracer)], True
    leaves = leaves_within_opaque(leaves)
    found = [leaf for leaf in leaves if isinstance(leaf, jax.core.Tracer)]
    if current_trace() is not None:
        found += held_tracers([leaf for leaf in leaves if not isinstance(leaf, jax.core.Tracer)])
    return found, False


_HOLDERS_OF_NOTHING = (type, types.ModuleType, types.BuiltinFunctionType)


def held_tracers(leaves: Iterable[Any]) -> list[Any]:
    """The tracers that the functions (closures, defaults), ``functools.partial``s,
    bound methods and plain objects among ``leaves`` hold, at any depth: a value
    that JAX takes as one leaf but that keeps a value of the trace (`self.fn =
    lambda: x * 2`, `self.box = Box(x)`), which would outlive it. A decorated
    instance is not looked into (its states are checked as they are written)."""
    found: list[Any] = []
    seen: set[int] = set()
    stack = list(leaves)
    while stack:
        value = stack.pop()
        if isinstance(value, jax.core.Tracer):
            found.append(value)
            continue
        t = type(value)
        if id(value) in seen or t in CONCRETE_LEAF_TYPES or isinstance(value, _HOLDERS_OF_NOTHING):
            continue
        seen.add(id(value))
        if t is types.FunctionType:
            for cell in value.__closure__ or ():
                with contextlib.suppress(ValueError):  # (an empty cell)
                    stack.append(cell.cell_contents)
            stack.extend(value.__defaults__ or ())
        elif t is functools.partial:
            stack.extend((value.func, *value.args, *value.keywords.values()))
        elif t is types.MethodType:
            stack.append(value.__func__)
        elif t is list or t is tuple or t is set or t is frozenset:
            stack.extend(value)
        elif t is dict:
            stack.extend(value.values())
        elif t in _graph.STATEFUL_CLASSES or isinstance(value, jax.Array):
            continue
        else:
            attrs = getattr(value, "__dict__", None)
            if type(attrs) is dict:
                stack.extend(attrs.values())
    return found


def check_not_traced(
    value: Any, name: str | None, home: Any = None, inside_call: bool = False
) -> Unsortable | None:
    """Refuses to store a tracer that would outlive its trace in an eager model.

    A model built inside a trace lives there (its ``home``) and may keep that
    trace's values; any other tracer would leak. ``inside_call``: the state is
    a running call's (``check_written_inside``). Returns ``(name, the user's
    line)`` when ``value`` holds a dict whose keys do not sort, for the error
    raised where the state must be flattened, else None."""
    tracers, unsortable = _tracers(value)
    where = (name or "?", user_location()) if unsortable else None
    if not tracers:
        return where
    if home is not None:
        if all(_trace_of(t) is home for t in tracers):
            return where
        # A value of a trace the home trace runs inside (the model built inside
        # ``jax.grad`` of a jitted step, given a value of the ``jit`` trace):
        # it lives at least as long as the model.
        around = _enclosing_traces(home)
        if all(id(_trace_of(t)) in around for t in tracers):
            return where
    if home is not None or inside_call:
        # The model lives in a trace (the copy `autostate.jit` or `jax.jit`
        # makes of a model argument) or in a call of ``f`` (``inside_call``):
        # the tracer comes from a transformation applied inside it, which
        # does not carry the model's states out.
        raise TracedEagerStateError(
            format_error(
                f"State {name!r} was assigned a value of a transformation (jax.eval_shape, "
                "jax.vmap, jax.grad, a jax.lax loop or branch, ...) applied to the model inside the trace or call it "
                "lives in (the function autostate.jit compiles, a call of f, or the function "
                "that built the model): that "
                "transformation does not carry the model's states out, so the model would "
                "keep a value that only exists inside it.",
                fix="apply the inner transformation to a function of the states: "
                "`f, states = model.functionalize()`, then `jax.eval_shape(f, states, x)` "
                "(or `autostate.vmap`/`autostate.grad`, which thread them; for a "
                "jax.lax loop or branch in code @stateful did not rewrite, "
                "autostate.scan/cond/switch/while_loop/fori_loop/map); a function "
                "that only reads the model's states needs no change.",
            )
        )
    raise TracedEagerStateError(
        format_error(
            f"State {name!r} was assigned a JAX tracer on a model that is not "
            "functionalized and was built outside the running transformation "
            "(jax.jit, grad, vmap, eval_shape): the model would keep a value that only "
            "exists inside its trace.",
            fix="use autostate's transformation, which threads the model's states and "
            "writes them back: `autostate.jit(fn)(model, x)` for jax.jit "
            "(`autostate.grad`, `autostate.vmap` for jax.grad, jax.vmap), or call "
            "`f, states = model.functionalize()` and use "
            "`out, states = f(states, ...)` inside the transformation, build the "
            "model inside it (values created while it is built are its initial "
            'values), or decorate the class with @autostate.stateful(fallback="host"); '
            "inside jax.lax control flow in code @stateful did not rewrite, call "
            "autostate.scan/cond/switch/while_loop/fori_loop/map/vmap/checkpoint instead.",
        )
    )


def check_initial_value(value: Any, name: str | None) -> Unsortable | None:
    """A state's first value may hold tracers of the running trace or its
    parents (a model built inside a transformation); a finished trace's is a
    leak. Returns what ``check_not_traced`` returns."""
    tracers, unsortable = _tracers(value)
    where = (name or "?", user_location()) if unsortable else None
    if not tracers:
        return where
    live = _enclosing_traces(current_trace())
    if all(id(_trace_of(t)) in live for t in tracers):
        return where
    check_not_traced(value, name)
    return where


def home_of(slot: Any) -> Any:
    """The trace a slot's model was built in (``None``: built outside every trace)."""
    return getattr(slot, "_home", None)


def with_home(slot: Any, home: Any) -> Any:
    """``slot``, living in ``home`` (see ``home_of``)."""
    if home is not None:
        object.__setattr__(slot, "_home", home)
    return slot


def made_here(slots: Iterable[Any]) -> None:
    """``slots``, made now (by freezing a model), live in the trace running
    now: a model frozen inside a transformation is built there (the
    ``made_here`` slot hook)."""
    home = current_trace()
    if home is not None:
        for slot in slots:
            object.__setattr__(slot, "_home", home)


class InitialValue:
    """The initializer ``initial_slot`` makes: the state's first value, computed
    once. It compares by identity, as penzai's initializers do; ``home`` is the
    trace the model was built in, ``_note`` what ``check_initial_value`` noted."""

    __slots__ = ("value", "home", "_note")

    def __init__(self, value: Any, home: Any = None, note: WriteNote | None = None):
        self.value = value
        self.home = home
        self._note = note

    def __call__(self) -> Any:
        return self.value

    def __repr__(self) -> str:
        return f"InitialValue({_tree.describe(self.value)})"

    def __reduce__(self) -> tuple[type, tuple[Any]]:
        # (Its value alone: a trace and a note belong to the process that made it.
        # Not __getstate__, whose value pickle drops when it is falsy: None, 0.)
        return InitialValue, (self.value,)


def initial_slot(value: Any, category: Category, name: str | None, label: str | None) -> Any:
    """The slot where ``__init__`` first assigns a state: a static slot for a
    value that is structure, else an ``InitialLocalStateRequest``; it lives in
    the trace running now (``check_initial_value``)."""
    # (Static slots are ``state_values``'s, a module above this one: the
    # states dict's rules stand on the slots defined here.)
    from autostate.state_values import static_slot

    home = current_trace()
    static = static_slot(value, category, name)
    if static is not None:
        return with_home(static, home)
    note = check_initial_value(value, name or label)
    return InitialLocalStateRequest(InitialValue(value, home, note), category, name)


def eager_home(slot: Any) -> Any:
    """The trace an eager slot's model was built in (``None``: outside every
    trace, where no tracer may be written into it)."""
    if type(slot) is InitialLocalStateRequest:
        init = slot.state_initializer
        return init.home if isinstance(init, InitialValue) else None
    return home_of(slot)


def written_slot(slot: Any, value: Any, label: str | None) -> Any:
    """The slot that takes an eager slot's place once assigned ``value`` (the
    ``eager_write`` hook).

    A frozen request gives a new one. A placeholder ``None`` or a static state
    takes its kind from ``value`` as a first value does. An initializer's
    request gives a frozen request (an array state stays one when assigned a
    Python number, as when handled). The new slot lives where ``slot`` does
    (``check_not_traced``)."""
    t = type(slot)
    home = eager_home(slot)
    if t is FrozenLocalStateRequest:
        placeholder = slot.state is None
    elif t is InitialLocalStateRequest:
        init = slot.state_initializer
        placeholder = isinstance(init, InitialValue) and init.value is None
    else:  # a static state (``autostate.state_values.StaticState``)
        placeholder = True
    note = check_not_traced(value, slot.name or label, home)
    if t is FrozenLocalStateRequest and not placeholder:
        new = slot.replaced(value)
    else:
        from autostate.state_values import static_slot  # (above this module)

        static = static_slot(value, slot.category, slot.name) if placeholder else None
        if static is not None:
            return with_home(static, home)
        new = FrozenLocalStateRequest(value, slot.category, slot.name, _home=home)
    if note is not None:
        new._note = note
    return new


def _canonical_initial(request: InitialLocalStateRequest) -> Any:
    # A fresh model's state is a leaf as it will be after its first write.
    init = request.state_initializer
    if not isinstance(init, InitialValue):
        return request
    frozen = FrozenLocalStateRequest(init.value, request.category, request.name)
    if init._note is not None:
        frozen._note = init._note
    return frozen


_graph.register_node_kind(
    InitialLocalStateRequest,
    model_child=True,
    canonical=_canonical_initial,
    # (Its first value, a list or dict the model may still change in place.)
    witnessed=lambda r: getattr(r.state_initializer, "value", r.state_initializer),
    own_value=True,
)


# The names of the handled states read while ``recording_state_reads`` runs
# (None: nothing records).
_STATE_READS: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "autostate_state_reads", default=None
)


@contextlib.contextmanager
def recording_state_reads() -> Iterator[list[str]]:
    """Collects the names of the handled states read inside the block (in
    blocks around it too)."""
    outer = _STATE_READS.get()
    reads: list[str] = []
    token = _STATE_READS.set(reads)
    try:
        yield reads
    finally:
        _STATE_READS.reset(token)
        if outer is not None:
            outer.extend(reads)


def _check_read(name: str, value: Any, cell: Any) -> None:
    """A handled state's value read: recorded (``recording_state_reads``), and
    refused when it has no plain meaning."""
    reads = _STATE_READS.get()
    if reads is not None:
        reads.append(name)
    if id(cell) in MEMBER_CELLS.get():
        raise ControlFlowStateError(
            format_error(
                f"State {name!r} of a stacked sub-model is read through the stack itself "
                "inside a transformation that maps over its members (a jax.vmap or "
                "lax.scan given the stack): each step holds only its member's slice, so "
                "the whole stack's value has no meaning there, and a slice would be "
                "silently read as it.",
                where=user_location(),
                fix="read it through the member the step gets (the body's argument), or "
                "before or after the call and pass it in.",
            )
        )
    if holds_escaped_tracer(value):
        raise EscapedStateError(escaped_state_message(name, user_location()))
    if type(value) is LostValue:  # (after the check above: tracers come first)
        raise value.error()


# Ids of the traces of the lifted bodies running now (``lifting.core`` binds
# the call's cells there): a copy of a model may write through to a cell there.
LIFT_TRACES: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
    "autostate_lift_traces", default=frozenset()
)


# Handlers running a call on models that hold their own states (an eager
# model's in a lax body, the copies ``autostate.jit`` traces), each with the
# call it runs (``"the body of a lax.scan"``; ``None`` when unnamed):
# ``lifting.core``.
OWN_STATE_HANDLERS: dict[Any, str | None] = {}


def check_written_inside(ref: Any, value: Any) -> None:
    """A call on models that hold their own states refuses at the write a value
    of a transformation it does not place states in (``jax.eval_shape``, a
    ``jax.jit`` the decorator never saw): the models outlive its trace."""
    if ref.handler_id not in OWN_STATE_HANDLERS or type(value) in CONCRETE_LEAF_TYPES:
        return
    call = running_call(ref.handler_id)
    trace = current_trace()
    if call is None or trace is trace_of_call(call) or id(trace) in LIFT_TRACES.get():
        return
    check_not_traced(value, ref.name, trace_of_call(call), inside_call=True)


def _check_handled_write(ref: Any, label: str | None, old: Any, value: Any) -> None:
    """What a handled state's write refuses: a Python value in place of the
    placeholder ``None`` (``state_values.check_placeholder_write``), and a
    value that outlives its transformation (``check_written_inside``)."""
    if old is None:
        from autostate.state_values import check_placeholder_write  # (above this module)

        # (The states of f's call are returned, so each must be a JAX value;
        # a call on models that hold their states, autostate.jit's, writes
        # the rest back as the structure it is.)
        check_placeholder_write(
            ref.name, label, value, returned=ref.handler_id not in OWN_STATE_HANDLERS,
            inside=OWN_STATE_HANDLERS.get(ref.handler_id),
        )
    check_written_inside(ref, value)


@contextlib.contextmanager
def lifted_body() -> Iterator[None]:
    """While a lifted body runs in the current trace (see ``LIFT_TRACES``)."""
    token = LIFT_TRACES.set(LIFT_TRACES.get() | {id(current_trace())})
    try:
        yield
    finally:
        LIFT_TRACES.reset(token)


# Ids of the cells bound to a member's slice while a transformation maps over
# a stacked sub-model (set by ``control``): read only through the members.
MEMBER_CELLS: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
    "autostate_member_cells", default=frozenset()
)


# The functionalized calls running now in every thread: id of a call's cells
# -> ``(handler id, cells, trace it started in, serial)``, the serial a number
# no other call gets (part of the key a running model's state flattens with:
# ``_split_running_ref``). Kept by the ``call_started`` slot hook, for a state
# reached from a thread the call's method started (``cells_elsewhere``) and
# for the trace a running call started in (``trace_of_call``).
_CALLS: dict[int, tuple[Hashable, dict[str, Any], Any, int]] = {}
_SERIAL = itertools.count()


def _call_started(handler_id: Hashable, cells: dict[str, Any]) -> Callable[[], None]:
    """A functionalized call starts with ``cells``: recorded, with the trace
    running now, until the function returned is called (when it ends)."""
    key = id(cells)
    _CALLS[key] = (handler_id, cells, current_trace(), next(_SERIAL))
    return functools.partial(_call_ended, key)


def _call_ended(key: int) -> None:
    _, cells, _, _ = _CALLS.pop(key)
    if _WRITTEN_THROUGH:
        for cell in cells.values():
            _WRITTEN_THROUGH.pop(id(cell), None)


def trace_of_call(call: Any) -> Any:
    """The trace a running call (an entry of the engine's ``running_call``)
    started in: ``None`` outside every transformation."""
    record = _CALLS.get(id(call[1]))
    return None if record is None else record[2]


def _serial_of_call(call: Any) -> int | None:
    record = _CALLS.get(id(call[1]))
    return None if record is None else record[3]


def _calls_in_every_thread(handler_id: Hashable) -> list[tuple[dict[str, Any], Any]]:
    """``(cells, trace)`` of each call of ``handler_id`` running now in any
    thread (by identity for a ``HandlerId``, else by equality)."""
    return [
        (cells, trace)
        for running_id, cells, trace, _serial in list(_CALLS.values())
        if running_id is handler_id
        or (type(handler_id) is not HandlerId and running_id == handler_id)
    ]


def _cells_in_another_thread(ref: Any) -> dict[str, Any] | None:
    """The cells of a state's call running in another thread that handed this
    one a method of its model: shared eagerly, refused under a transformation."""
    calls = _calls_in_every_thread(ref.handler_id)
    if len(calls) != 1:
        return None
    cells, trace = calls[0]
    cell = cells.get(ref.name)
    if trace is not None or (
        cell is not None and isinstance(cell.value, jax.core.Tracer)
    ):
        raise UnhandledLocalStateError(
            format_error(
                f"State {ref.name!r} was reached from a thread other than the one "
                "running its functionalized call, while that call runs under a JAX "
                "transformation (jit, grad, vmap or a lax body), whose values cannot "
                "cross threads.",
                fix="reach the model's state in the thread that calls f (for example "
                "loop over the inputs in the method itself), or call f eagerly.",
            )
        )
    return cells


_UNSET: Any = object()
# id of a running call's cell -> the value a copy wrote through to it last
# (dropped when the call ends: ``_call_ended``).
_WRITTEN_THROUGH: dict[int, Any] = {}


class CopiedRef(StateSlot):
    """A handled state of a copy JAX made of a model inside the running call.

    ``jax.vmap`` over a stacked sub-model, ``lax.scan``'s ``xs`` or a slicing
    ``tree_map`` rebuild the model from leaves they made, so the copy reads its
    own slice. A write where the call runs stays the copy's, as eagerly; a
    write inside a transformation the call's method started goes to the
    handler's cell, where an escaped trace of it is caught."""

    __slots__ = ("ref", "value", "category", "name")

    def __init__(self, ref: HandledLocalStateRef, value: Any):
        self.ref, self.value = ref, value
        self.category, self.name = ref.category, ref.name

    def read(self) -> Any:
        # Inside a transformation the call started, a value another copy of
        # the same model wrote through to the cell (one model passed twice,
        # ``vmap(f)(m, m)``) is the state from then on, as for the one
        # object plain Python has.
        call = running_call(self.ref.handler_id)
        if call is not None and trace_of_call(call) is not current_trace():
            cell = call[1].get(self.name)
            if cell is not None and _WRITTEN_THROUGH.get(id(cell), _UNSET) is cell.value:
                return cell.value
        return self.value

    def write(self, value: Any, label: str | None = None) -> HandledLocalStateRef | None:
        call = running_call(self.ref.handler_id)
        if call is None or trace_of_call(call) is current_trace():
            self.value = value
            return None
        self.ref.write(value, label)  # (checked there: ``check_written_inside``)
        cell = call[1].get(self.name)
        if cell is not None:
            _WRITTEN_THROUGH[id(cell)] = cell.value
        return None  # (the copy reads the cell from now on: ``read``)

    def as_request(self) -> FrozenLocalStateRequest:
        return FrozenLocalStateRequest(self.read(), self.ref.category, None)


def _split_running_ref(ref: HandledLocalStateRef) -> tuple[Any, Any] | None:
    """A running model's state flattened by JAX: its value is a child and the key
    names the call, so JAX's caches never replay one call's trace in another."""
    call = running_call(ref.handler_id)
    if call is None:
        return None
    return ref.read(), (ref, _serial_of_call(call))


def _split_copy(copy: CopiedRef) -> tuple[Any, Any]:
    """A copy's state, flattened again (a copy of the copy): keyed as above."""
    call = running_call(copy.ref.handler_id)
    return copy.read(), (copy.ref, None if call is None else _serial_of_call(call))


def _copied(key: tuple[HandledLocalStateRef, Any], value: Any) -> CopiedRef:
    return CopiedRef(key[0], value)


# Frozen and childless: one object per graphdef entry serves every rebuild.
_graph.register_node_kind(
    HandledLocalStateRef, model_child=True, shared=True, running=(_split_running_ref, _copied)
)
_graph.register_node_kind(CopiedRef, running=(_split_copy, _copied), own_value=True)


register_slot_hooks(
    eager_write=written_slot,
    check_handled_write=_check_handled_write,
    made_here=made_here,
    check_read=_check_read,
    call_started=_call_started,
    cells_elsewhere=_cells_in_another_thread,
)
