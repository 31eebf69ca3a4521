"""The local-state effect: requests, handled references, handlers, freezing.

A model tree holds *requests* where it wants state (``Initial``, ``Frozen``
or ``SharedLocalStateRequest``). ``handle_local_states`` swaps each for a
``HandledLocalStateRef`` and returns the states as a plain dict, so the
tree plus the dict are a pure function's inputs; ``freeze_local_states``
swaps them back.

Design choice: a handled reference does not carry its value. While a handler
runs its body it publishes one mutable ``LocalStateEffectImpl`` cell per
state in a context variable keyed by handler id, and references look their
cell up there: the body is never rebuilt per call, any copy of a reference
(after a ``jax.jit`` round trip) reaches the same cell, and nested handlers
with distinct ids see only their own states.

Where it departs from penzai: every request and reference is also a slot
(``StateSlot``), what a decorated instance's state attribute holds, so an
eager model reads and writes its requests outside any handler (the
runtime's ``eager_write`` hook).

It must not know about source code, tracer lifetime, static values,
unsortable dicts, threads or the guard: what can be an argument is one
(``run_with_states``'s ``instances``), a slot kind it does not define takes
part through ``StateSlot``'s methods, and what is left it asks through
``autostate.slot_hooks``."""

from __future__ import annotations

import contextvars
import dataclasses
import itertools
import operator
import sys
import types
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any, Literal, Protocol, overload, runtime_checkable

import jax

from autostate import graph as _graph
from autostate import tree as _tree
from autostate.errors import (
    category_argument_error,
    conflicting_definitions_error,
    duplicate_name_error,
    freeze_handler_type_error,
    freeze_missing_state_error,
    handled_twice_error,
    mismatched_category_error,
    missing_state_error,
    rename_fn_type_error,
    renamed_to_non_str_error,
    shared_request_first_error,
    shared_request_forbidden_error,
    shared_request_read_error,
    sharing_mode_error,
    states_not_dict_error,
    unhandled_ref_error,
    unhandled_request_error,
)
from autostate.slot_hooks import WriteNote
from autostate.slot_hooks import hooks as _hooks
from autostate.values import own_value

Category = Hashable
StateSharing = Literal["forbidden", "allowed", "unsafe"]


class HandlerId:
    """The handler id of one ``functionalize()``: equal to every other of its
    label (functionalizing a frozen model again gives an equal ``f``, so a
    jitted step is not traced again), told apart by identity (one model's ``f``
    called inside another's reads its own states; copies of ``f`` copy the id
    once for ``f`` and its references)."""

    __slots__ = ("label",)

    def __init__(self, label: str):
        self.label = label

    def __eq__(self, other: object) -> bool:
        return other is self or (
            other.label == self.label if type(other) is HandlerId else other == self.label
        )

    def __hash__(self) -> int:
        return hash(self.label)

    def __repr__(self) -> str:
        return repr(self.label)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (HandlerId, (self.label,))


_handler_counter = itertools.count()


def fresh_handler_id() -> str:
    """A handler id unique within this process."""
    return f"local_state_{next(_handler_counter)}"


# handler id -> the call running under it now: ``(id, {state name -> cell},
# outer)``, ``outer`` the entry of a call with an equal id that this one runs
# inside (one model's ``f`` called in another's method) or None.
_Running = tuple[Hashable, dict[str, "LocalStateEffectImpl"], Any]
_ACTIVE: contextvars.ContextVar[Mapping[Hashable, _Running]] = contextvars.ContextVar(
    "autostate_active_handlers", default=types.MappingProxyType({})
)
# The ids of the objects the bodies running now are made of, as their callers
# named them (``run_with_states``'s ``instances``): what ``in_running_body`` asks.
_BODY_INSTANCES: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
    "autostate_running_body_instances", default=frozenset()
)


def running_call(handler_id: Hashable) -> _Running | None:
    """The running call of ``handler_id`` in this context, or None."""
    entry = _ACTIVE.get().get(handler_id)
    if entry is None or entry[0] is handler_id or type(handler_id) is not HandlerId:
        return entry
    # Another ``f`` with an equal id runs inside (or instead of) this one's call.
    entry = entry[2]
    while entry is not None and entry[0] is not handler_id:
        entry = entry[2]
    return entry


def running_calls() -> Iterator[_Running]:
    """Every call running in this context, the innermost call of an id first."""
    for entry in _ACTIVE.get().values():
        while entry is not None:
            yield entry
            entry = entry[2]


def in_running_body(obj: Any) -> bool:
    """Whether ``obj`` is one of the instances a running call named as its
    body's (``run_with_states``'s ``instances``)."""
    ids = _BODY_INSTANCES.get()
    return bool(ids) and id(obj) in ids


def handler_running() -> bool:
    """Whether some handler is running its body in this context."""
    return bool(_ACTIVE.get())


def is_running(handler_id: Hashable) -> bool:
    """Whether the handler with ``handler_id`` is running its body now."""
    return running_call(handler_id) is not None


def handler_cells(handler_id: Hashable) -> Mapping[str, LocalStateEffectImpl]:
    """The cells of the running handler ``handler_id`` (empty if it is not running)."""
    entry = running_call(handler_id)
    return {} if entry is None else entry[1]


def running_cells() -> list[LocalStateEffectImpl]:
    """The cells of every handler running in this context."""
    return [cell for entry in running_calls() for cell in entry[1].values()]


class StateSlot:
    """What a state attribute holds: the one protocol every kind of state shares.

    ``read()`` gives the current value; ``write(value)`` stores a new one and
    returns the slot that must take this one's place, or ``None`` when stored in
    place (a handler's cell, a host store): the holder puts the replacement in,
    no slot writes into its holder; ``as_request()`` is the request handling
    takes in its place (when the class says ``handleable``). A slot that is
    part of the structure rather than of the states dict (a static state) says
    so by ``handled_in_structure``; its handled stand-in gives it back by
    ``frozen``."""

    __slots__ = ()
    category: Category
    # Whether handle_local_states may take this slot (a handled reference or a
    # read-only view may not).
    handleable = True
    # Whether this slot stands for a state of the handler with its
    # ``handler_id``: handling again with that id refuses it, freezing replaces it.
    handled = False

    def read(self) -> Any:
        raise NotImplementedError

    def write(self, value: Any, label: str | None = None) -> StateSlot | None:
        """``label`` names the state in error messages when it has no explicit name."""
        raise NotImplementedError

    def as_request(self) -> Any:
        raise NotImplementedError

    def handled_in_structure(self, handler_id: Hashable, path: str) -> StateSlot | None:
        """The ``handled`` slot handling puts in this one's place, holding its
        value in the body's structure; ``None`` (most slots): its value goes
        into the states dict, as ``as_request()``'s. ``path`` names an unnamed state."""
        return None

    def frozen(self) -> StateSlot:
        """What freezing puts in the place of a ``handled`` slot that
        ``handled_in_structure`` made."""
        raise NotImplementedError

    def part_of(self) -> tuple[Any, str] | None:
        """``(instance, attribute)`` of the state this slot reads and writes a
        part of (a layer's slice of a stack's state), or ``None`` for a state
        of its own."""
        return None


def _static_pytree(cls):
    """Registers a dataclass with only static fields as a childless pytree node."""
    fields = tuple(f.name for f in dataclasses.fields(cls))

    def flatten(node):
        return (), tuple(getattr(node, f) for f in fields)

    def unflatten(aux, _children):
        return cls(*aux)

    jax.tree_util.register_pytree_node(cls, flatten, unflatten)
    return cls


@_static_pytree
@dataclasses.dataclass(frozen=True)
class InitialLocalStateRequest(StateSlot):
    """Asks the handler for a new state, initialized by ``state_initializer()``.

    Args:
        state_initializer: zero-argument callable giving the initial value.
        category: which handler handles it (compared with ``==``).
        name: explicit state name; ``None`` names it by its path.

    Examples:
        >>> from autostate import InitialLocalStateRequest, handle_local_states
        >>> req = InitialLocalStateRequest(lambda: jnp.zeros(3), category="cache")
        >>> handler, states = handle_local_states([req], category="cache")
        >>> states
        {'[0]': Array([0., 0., 0.], dtype=float32)}
    """

    state_initializer: Callable[[], Any]
    category: Category
    name: str | None = None

    def get(self) -> Any:
        raise unhandled_request_error(self)

    def set(self, value: Any) -> None:
        raise unhandled_request_error(self)

    def read(self) -> Any:
        return self.state_initializer()

    def write(self, value: Any, label: str | None = None) -> Any:
        return _hooks.eager_write(self, value, label)

    def as_request(self) -> InitialLocalStateRequest:
        return self

    def with_renamed_parameters(self, rename_fn: Callable[[str], str]) -> InitialLocalStateRequest:
        """This request with its explicit name renamed; an unnamed one is returned as is.

        Examples:
            >>> from autostate import InitialLocalStateRequest
            >>> req = InitialLocalStateRequest(lambda: 0.0, category="c", name="n")
            >>> req.with_renamed_parameters(lambda n: "enc." + n).name
            'enc.n'
        """
        return _renamed(self, rename_fn)


_new_object = object.__new__


@dataclasses.dataclass(slots=True)
class FrozenLocalStateRequest(StateSlot):
    """A state with a known value, embedded in a tree (its value is a child).

    Never changed where anyone could see it: a write makes a new request
    (``replaced``), so a copy of a model, or anything else holding a request,
    keeps its value; only a request nothing else holds takes an eager write
    in place (see ``runtime._sole_holder_count``). Not a frozen dataclass
    because that one's ``__setattr__`` made every eager write several times
    slower; slots make the new request cheap.

    Args:
        state: the value (any pytree of arrays).
        category: which handler handles it.
        name: explicit state name; ``None`` names it by its path.

    Examples:
        >>> from autostate import FrozenLocalStateRequest, handle_local_states
        >>> req = FrozenLocalStateRequest(jnp.ones(2), category="cache", name="k")
        >>> req.get()
        Array([1., 1.], dtype=float32)
        >>> handler, states = handle_local_states({"a": req}, category="cache")
        >>> states
        {'k': Array([1., 1.], dtype=float32)}
    """

    state: Any
    category: Category
    name: str | None = None
    # Kept for the runtime, opaque here: ``_home``, where the model holding the
    # request lives (``replaced`` keeps it: it is the model's, not the value's);
    # ``_note``, what the runtime noted about the value, for its errors where
    # JAX cannot flatten the value. ``replaced`` leaves ``_note`` unset, so an eager
    # write pays nothing for it: readers use ``getattr(..., None)``.
    _home: Any = dataclasses.field(default=None, repr=False, compare=False, kw_only=True)
    _note: WriteNote | None = dataclasses.field(
        default=None, init=False, repr=False, compare=False
    )
    # ``sys.getrefcount(self)``, read as an attribute: computed from C inside
    # the attribute read, with no point where a signal handler, another
    # thread, a profiler or a debugger can run between it and the next
    # bytecode (a call of getrefcount has one, right after it returns).
    _holders = property(sys.getrefcount)

    def get(self) -> Any:
        """Returns the embedded value."""
        return self.state

    def set(self, value: Any) -> None:
        raise unhandled_request_error(self)

    def read(self) -> Any:
        return self.state

    def write(self, value: Any, label: str | None = None) -> Any:
        return _hooks.eager_write(self, value, label)

    def replaced(self, value: Any) -> FrozenLocalStateRequest:
        """This request holding ``value`` instead, unchecked (``write`` checks),
        filled without ``__init__``: an eager write's whole cost."""
        new = _new_object(FrozenLocalStateRequest)
        new.state = value
        new.category = self.category
        new.name = self.name
        new._home = self._home
        return new

    def as_request(self) -> FrozenLocalStateRequest:
        return self

    def with_renamed_parameters(self, rename_fn: Callable[[str], str]) -> FrozenLocalStateRequest:
        """This request with its explicit name renamed; an unnamed one is returned as is.

        Examples:
            >>> from autostate import FrozenLocalStateRequest
            >>> req = FrozenLocalStateRequest(jnp.ones(2), category="c", name="k")
            >>> req.with_renamed_parameters(lambda n: "dec." + n).name
            'dec.k'
        """
        return _renamed(self, rename_fn)


# Its pytree flatten (the value a child; the Python values inside a container
# value structure, as in a states dict) is registered by
# ``autostate.state_values``, which owns which values are structure.
_graph.register_node_kind(
    FrozenLocalStateRequest, model_child=True, witnessed=operator.attrgetter("state"),
    own_value=True,
)
# ``InitialLocalStateRequest``'s node kind (a fresh model's state seen as it
# will be after its first write) is registered by ``autostate.lifetime``,
# which makes those initial values.


@_static_pytree
@dataclasses.dataclass(frozen=True)
class SharedLocalStateRequest(StateSlot):
    """Shares the value of an earlier request with the same explicit ``name``.

    Only valid when handling with ``state_sharing="allowed"`` or ``"unsafe"``.

    Args:
        name: the explicit name of the state it shares.
        category: which handler handles it.

    Examples:
        >>> from autostate import (
        ...     FrozenLocalStateRequest, SharedLocalStateRequest, handle_local_states
        ... )
        >>> tree = {
        ...     "enc": FrozenLocalStateRequest(jnp.ones(2), category="kv", name="kv"),
        ...     "dec": SharedLocalStateRequest("kv", category="kv"),  # the same state
        ... }
        >>> handler, states = handle_local_states(tree, category="kv", state_sharing="allowed")
        >>> states
        {'kv': Array([1., 1.], dtype=float32)}
    """

    name: str
    category: Category

    def get(self) -> Any:
        raise unhandled_request_error(self)

    def set(self, value: Any) -> None:
        raise unhandled_request_error(self)

    def read(self) -> Any:
        raise shared_request_read_error(self.name)

    def write(self, value: Any, label: str | None = None) -> None:
        self.read()

    def as_request(self) -> SharedLocalStateRequest:
        return self

    def with_renamed_parameters(self, rename_fn: Callable[[str], str]) -> SharedLocalStateRequest:
        """This request, naming ``rename_fn(name)`` (a shared request is always named).

        Examples:
            >>> from autostate import SharedLocalStateRequest
            >>> SharedLocalStateRequest("kv", "cache").with_renamed_parameters(str.upper).name
            'KV'
        """
        return _renamed(self, rename_fn)


_graph.register_node_kind(SharedLocalStateRequest, model_child=True)


def _renamed(request: Any, rename_fn: Callable[[str], str]) -> Any:
    if request.name is None:
        return request
    new_name = rename_fn(request.name)
    if not isinstance(new_name, str):
        raise renamed_to_non_str_error(request.name, new_name)
    return dataclasses.replace(request, name=new_name)


@runtime_checkable
class LocalStateEffect(Protocol):
    """The local-state effect: what a body may do with a handled state.

    ``HandledLocalStateRef`` (what a body holds) and ``LocalStateEffectImpl``
    (the cell a running handler provides) both implement it.

    Examples:
        >>> from autostate import LocalStateEffect, LocalStateEffectImpl
        >>> def bump(state: LocalStateEffect) -> None:
        ...     state.set(state.get() + 1)  # works on a handled ref or a cell
        >>> cell = LocalStateEffectImpl(jnp.zeros(()), name="count")
        >>> bump(cell)
        >>> bump(cell)
        >>> print(cell.get())
        2.0
    """

    def get(self) -> Any:
        """The state's current value."""
        ...

    def set(self, value: Any) -> None:
        """Replaces the state's value."""
        ...


class LocalStateEffectImpl:
    """The mutable cell holding one state while its handler runs.

    Args:
        value: the state's value.
        name: the state's name.
        category: the state's category.

    Examples:
        >>> from autostate import LocalStateEffectImpl
        >>> cell = LocalStateEffectImpl(jnp.zeros(2), name="mean")
        >>> cell.set(cell.get() + 1.0)
        >>> cell
        LocalStateEffectImpl(name='mean', value=f32[2])
    """

    __slots__ = ("value", "name", "category")

    def __init__(self, value: Any, name: str, category: Category = None):
        self.value = value
        self.name = name
        self.category = category

    def get(self) -> Any:
        return self.value

    def set(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"LocalStateEffectImpl(name={self.name!r}, value={_tree.describe(self.value)})"


@_static_pytree
@dataclasses.dataclass(frozen=True)
class HandledLocalStateRef(StateSlot):
    """Stands where a request was; reads and writes go to its handler's cell.

    ``get()`` / ``set(v)`` work only while the handler with ``handler_id`` is
    running its body (``handler((arg, states))``, or ``f(states, ...)`` for a
    functionalized model); outside, they raise ``UnhandledLocalStateError``.

    Examples:
        >>> import dataclasses
        >>> from autostate import HandledLocalStateRef, InitialLocalStateRequest
        >>> @jax.tree_util.register_dataclass
        ... @dataclasses.dataclass
        ... class Count:
        ...     count: object  # a request; after handling, a HandledLocalStateRef
        ...
        ...     def __call__(self, x):
        ...         self.count.set(self.count.get() + 1)
        ...         return x * self.count.get()
        >>> body = Count(InitialLocalStateRequest(lambda: jnp.zeros(()), category="c"))
        >>> handler, states = autostate.handle_local_states(body, category="c")
        >>> ref = handler.body.count
        >>> print(type(ref).__name__, ref.name)
        HandledLocalStateRef count
        >>> try:
        ...     ref.get()  # no handler is running
        ... except autostate.AutostateError as e:
        ...     print(type(e).__name__)
        UnhandledLocalStateError
    """

    handler_id: Hashable
    name: str
    was_explicitly_named: bool
    category: Category
    handleable = False
    handled = True

    def _cell(self) -> LocalStateEffectImpl:
        running = running_call(self.handler_id)
        if running is not None:
            cells = running[1]
        elif self.handler_id in _ACTIVE.get():
            # Another functionalized call with an equal id is running.
            raise unhandled_ref_error(self, "another call")
        else:
            found = _hooks.cells_elsewhere(self)
            if found is None:
                raise unhandled_ref_error(self, "not running")
            cells = found
        try:
            return cells[self.name]
        except KeyError:
            raise missing_state_error(self.name, self.handler_id, cells) from None

    def get(self) -> Any:
        """Current value of the state in the running handler."""
        return self._cell().value

    def set(self, value: Any) -> None:
        """Sets the state in the running handler."""
        self._cell().value = value

    def read(self) -> Any:
        cell = self._cell()
        value = cell.value
        _hooks.check_read(self.name, value, cell)
        return value

    def write(self, value: Any, label: str | None = None) -> None:
        cell = self._cell()
        _hooks.check_handled_write(self, label, cell.value, value)
        cell.value = value

    def __reduce_ex__(self, protocol: Any) -> Any:
        # A pickle made inside the running call (``pickle.dumps(self)`` in a
        # method) holds the state's value now, as ``copy.deepcopy`` of the
        # model there does: the unpickled model's state is its own.
        if is_running(self.handler_id):
            return (DetachedState, self.detached().__reduce__()[1])
        return super().__reduce_ex__(protocol)

    def detached(self) -> DetachedState:
        """A state holding this running state's value, its own from now on:
        what a copy of the model made inside the call holds."""
        return DetachedState(
            self.read(), self.category, self.name if self.was_explicitly_named else None
        )


class DetachedState(StateSlot):
    """A state of a copy made inside a functionalized call (``copy``, ``deepcopy``
    or ``pickle`` of the model there): it holds its own value (maybe traced: the
    copy is a temporary of the call), as a Python copy would."""

    __slots__ = ("value", "category", "name")

    def __init__(self, value: Any, category: Any, name: str | None):
        self.value, self.category, self.name = value, category, name

    def read(self) -> Any:
        return self.value

    def write(self, value: Any, label: str | None = None) -> DetachedState:
        return DetachedState(value, self.category, self.name)

    def as_request(self) -> FrozenLocalStateRequest:
        return FrozenLocalStateRequest(self.value, self.category, self.name)

    def __reduce__(self) -> tuple[type, tuple[Any, Any, str | None]]:
        return (DetachedState, (self.value, self.category, self.name))


jax.tree_util.register_pytree_node(
    DetachedState,
    lambda s: ((s.value,), (s.category, s.name)),
    lambda aux, children: DetachedState(children[0], *aux),
)
_graph.register_node_kind(DetachedState, model_child=True, own_value=True)


# How the walks see a handled reference (and what stands for it in the copy
# JAX makes of a running model, ``CopiedRef``) is registered by
# ``autostate.lifetime``, which owns those copies.

REQUEST_TYPES = (InitialLocalStateRequest, FrozenLocalStateRequest, SharedLocalStateRequest)
# type -> what a walk does with it: _HANDLED (a ``handled`` slot), _HANDLEABLE
# (another slot, handled as its ``as_request()``) or None (not a slot to take).
_HANDLED, _HANDLEABLE = "handled", "handleable"
_SLOT_ROLE: dict[type, str | None] = {}


def _slot_role(t: type) -> str | None:
    """What a walk does with a node of type ``t`` (cached per type)."""
    if t not in _SLOT_ROLE:
        if not issubclass(t, StateSlot):
            _SLOT_ROLE[t] = None
        else:
            _SLOT_ROLE[t] = _HANDLED if t.handled else _HANDLEABLE if t.handleable else None
    return _SLOT_ROLE[t]


@dataclasses.dataclass(frozen=True)
class WithFunctionalLocalState:
    """A body whose local states were handled: a pure function of its states.

    ``handler((argument, states))`` runs ``body(argument)`` with the states
    and returns ``(result, new_states)``. It is a pytree (the body is its
    child; the handler id is static), so it can be an argument of
    ``jax.jit`` or ``jax.grad``.

    Examples:
        >>> import dataclasses
        >>> from autostate import InitialLocalStateRequest, WithFunctionalLocalState
        >>> @jax.tree_util.register_dataclass
        ... @dataclasses.dataclass
        ... class Count:
        ...     count: object
        ...
        ...     def __call__(self, x):
        ...         self.count.set(self.count.get() + 1)
        ...         return x * self.count.get()
        >>> body = Count(InitialLocalStateRequest(lambda: jnp.zeros(()), category="c"))
        >>> handler, states = autostate.handle_local_states(body, category="c")
        >>> isinstance(handler, WithFunctionalLocalState)
        True
        >>> out, states = jax.jit(lambda h, s, x: h((x, s)))(handler, states, 2.0)
        >>> out, states = handler((out, states))  # penzai's convention: ((argument, states))
        >>> print(out, states["count"])
        4.0 2.0
    """

    handler_id: Hashable
    body: Any

    def __call__(self, argument: tuple[Any, dict[str, Any]]) -> tuple[Any, dict[str, Any]]:
        inner, states = argument
        instances = _graph.instance_ids(self.body)
        return run_with_states(self.handler_id, states, self.body, (inner,), {}, instances)


class _BodyHolder:
    """Holds a handler's body so the body flattens as one graph (``tree.flatten_graph``)."""


def _flatten_handler(h: WithFunctionalLocalState) -> tuple[list[Any], tuple]:
    # As a graph, not per instance: a sub-model reachable from two paths (tied
    # weights) stays one instance and one leaf through jit, grad and freezing.
    holder = _BodyHolder()
    holder.body = h.body  # type: ignore[attr-defined]
    leaves, graphdef = _graph.flatten_graph(holder)
    return leaves, (h.handler_id, graphdef)


def _flatten_handler_with_keys(h: WithFunctionalLocalState) -> tuple[list[Any], tuple]:
    leaves, aux = _flatten_handler(h)
    keys = [jax.tree_util.GetAttrKey(name) for name in aux[1].names]
    return list(zip(keys, leaves)), aux


def _unflatten_handler(aux: tuple, leaves: Any) -> WithFunctionalLocalState:
    handler_id, graphdef = aux
    return WithFunctionalLocalState(handler_id, _graph.unflatten_graph(graphdef, list(leaves)).body)


jax.tree_util.register_pytree_with_keys(
    WithFunctionalLocalState, _flatten_handler_with_keys, _unflatten_handler, _flatten_handler
)
_graph.register_node_kind(
    WithFunctionalLocalState,
    children=lambda h: [(".body", h.body)],
    rebuild=lambda h, children: WithFunctionalLocalState(h.handler_id, children[0]),
    model_child=True,
)


def run_with_states(
    handler_id: Hashable,
    states: dict[str, Any],
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict[str, Any],
    instances: frozenset[int] = frozenset(),
) -> tuple[Any, dict[str, Any]]:
    """Calls ``fn(*args, **kwargs)`` with ``states`` bound to ``handler_id``;
    ``instances``: the ids of the objects the body is made of, for
    ``in_running_body`` (the guard refuses their non-state writes)."""
    if not isinstance(states, dict):
        raise states_not_dict_error(states)
    cells = {
        # The call's own copy (``values.own_value``): the caller's states,
        # and a model sharing them, stay as they were.
        name: LocalStateEffectImpl(own_value(value), name)
        for name, value in states.items()
    }
    outer = _ACTIVE.get()
    running = (handler_id, cells, outer.get(handler_id) if outer else None)
    token = _ACTIVE.set({**outer, handler_id: running} if outer else {handler_id: running})
    ended = _hooks.call_started(handler_id, cells)
    if instances:
        around = _BODY_INSTANCES.get()
        body_token = _BODY_INSTANCES.set(around | instances if around else instances)
    try:
        result = fn(*args, **kwargs)
    except (ValueError, TypeError) as err:
        # JAX flattening the states a lax call threads failed: said in the
        # runtime's words (the ``states_flatten_error`` hook), or raised as it was.
        error = _hooks.states_flatten_error(
            {name: cell.value for name, cell in cells.items()}, "threaded", err, {}
        )
        if error is None:
            raise
        raise error from None
    finally:
        if instances:
            _BODY_INSTANCES.reset(body_token)
        _ACTIVE.reset(token)
        ended()
    return result, _states_dict({name: cell.value for name, cell in cells.items()}, {})


def _states_dict(values: dict[str, Any], notes: Mapping[str, WriteNote]) -> dict[str, Any]:
    """The states dict of ``values`` (the ``states_dict`` hook); a value JAX
    cannot flatten is said in the runtime's words (``states_flatten_error``)."""
    try:
        return _hooks.states_dict(values)
    except (ValueError, TypeError) as err:
        error = _hooks.states_flatten_error(values, "states", err, notes)
        if error is None:
            raise
        raise error from None


def _category_predicate(
    category: Category | None, category_predicate: Callable[[Category], bool] | None
) -> Callable[[Category], bool]:
    if (category is None) == (category_predicate is None):
        raise category_argument_error(category, category_predicate)
    if category_predicate is not None:
        return category_predicate
    return lambda c: c == category


# Typed by ``lazy``: the states dict, or (lazy=True) a function that builds it.
@overload
def handle_local_states(
    body: Any,
    category: Category | None = None,
    category_predicate: Callable[[Category], bool] | None = None,
    lazy: Literal[False] = False,
    state_sharing: StateSharing = "forbidden",
    handler_id: Hashable | None = None,
) -> tuple[WithFunctionalLocalState, dict[str, Any]]: ...
@overload
def handle_local_states(
    body: Any,
    category: Category | None = None,
    category_predicate: Callable[[Category], bool] | None = None,
    *,
    lazy: Literal[True],
    state_sharing: StateSharing = "forbidden",
    handler_id: Hashable | None = None,
) -> tuple[WithFunctionalLocalState, Callable[[], dict[str, Any]]]: ...
@overload
def handle_local_states(
    body: Any,
    category: Category | None = None,
    category_predicate: Callable[[Category], bool] | None = None,
    lazy: bool = False,
    state_sharing: StateSharing = "forbidden",
    handler_id: Hashable | None = None,
) -> tuple[WithFunctionalLocalState, dict[str, Any] | Callable[[], dict[str, Any]]]: ...


def handle_local_states(
    body: Any,
    category: Category | None = None,
    category_predicate: Callable[[Category], bool] | None = None,
    lazy: bool = False,
    state_sharing: StateSharing = "forbidden",
    handler_id: Hashable | None = None,
) -> tuple[WithFunctionalLocalState, dict[str, Any] | Callable[[], dict[str, Any]]]:
    """Handles every state request in ``body`` whose category matches.

    Each ``InitialLocalStateRequest``, ``FrozenLocalStateRequest`` (and,
    with sharing, ``SharedLocalStateRequest``) of the category is replaced by
    a ``HandledLocalStateRef``; its value goes into the states dict, under
    its explicit name or, unnamed, its path in ``body``.

    Args:
        body: any pytree (or ``@stateful`` model) holding requests.
        category: the category of the requests to handle.
        category_predicate: alternatively, a predicate on categories (exactly
            one of the two).
        lazy: return a thunk computing the initial states instead of the dict.
        state_sharing: ``"forbidden"``, ``"allowed"`` or ``"unsafe"``.
        handler_id: id for the new handler; a fresh one by default.

    Returns:
        ``(handler, states)``: a ``WithFunctionalLocalState`` and the states
        dict; requests not matching are left in place.

    Raises:
        CategoryArgumentError: neither or both of ``category`` and
            ``category_predicate``.
        StateSharingError: two requests name one state and sharing does not
            allow it.

    Examples:
        >>> import dataclasses
        >>> from autostate import FrozenLocalStateRequest, InitialLocalStateRequest
        >>> @jax.tree_util.register_dataclass
        ... @dataclasses.dataclass
        ... class Count:
        ...     count: object
        ...
        ...     def __call__(self, x):
        ...         self.count.set(self.count.get() + 1)
        ...         return x * self.count.get()
        >>> body = [
        ...     Count(InitialLocalStateRequest(lambda: jnp.zeros(()), category="c")),
        ...     Count(FrozenLocalStateRequest(jnp.ones(()), category="c", name="n")),
        ...     Count(FrozenLocalStateRequest(jnp.ones(()), category="other")),
        ... ]
        >>> handler, states = autostate.handle_local_states(body, category="c")
        >>> states
        {'[0].count': Array(0., dtype=float32), 'n': Array(1., dtype=float32)}
        >>> type(handler.body[2].count).__name__  # another category: left in place
        'FrozenLocalStateRequest'
    """
    predicate = _category_predicate(category, category_predicate)
    if state_sharing not in ("forbidden", "allowed", "unsafe"):
        raise sharing_mode_error(state_sharing)
    if handler_id is None:
        handler_id = fresh_handler_id()
    initializers: dict[str, Callable[[], Any]] = {}
    valued: dict[str, Any] = {}
    paths: dict[str, str] = {}
    # The runtime's notes on the values (``_note`` of a frozen request or of an
    # initializer), handed back to the ``states_flatten_error`` hook.
    notes: dict[str, WriteNote] = {}

    def is_target(node: Any) -> bool:
        t = type(node)
        if t in REQUEST_TYPES:
            return predicate(node.category)
        role = _slot_role(t)
        if role is _HANDLED:
            return node.handler_id == handler_id
        # Another slot (a static state, a host store) is handled as the request it stands for.
        return role is _HANDLEABLE and predicate(node.category)

    def replace(request: Any, path: str) -> Any:
        if type(request) not in REQUEST_TYPES and _slot_role(type(request)) is not _HANDLED:
            in_structure = request.handled_in_structure(handler_id, path)
            if in_structure is not None:
                return in_structure  # part of the structure, not of the states dict
            request = request.as_request()
        if _slot_role(type(request)) is _HANDLED:
            # Two handlers with one id would read each other's cells.
            raise handled_twice_error(request.name, handler_id, path)
        explicit = request.name is not None
        name = request.name if explicit else path
        if isinstance(request, SharedLocalStateRequest):
            if state_sharing == "forbidden":
                raise shared_request_forbidden_error(name)
            if name not in valued:
                raise shared_request_first_error(name)
            return HandledLocalStateRef(handler_id, name, True, request.category)
        if isinstance(request, InitialLocalStateRequest):
            source: Any = request.state_initializer
            initializer = source
        else:
            source = request
            initializer = _frozen_initializer(request.state)
        note = getattr(source, "_note", None)
        if note is not None:
            notes[name] = note
        if name in valued:
            same_initializer = isinstance(request, InitialLocalStateRequest) and valued[name] is source
            if state_sharing == "forbidden" or (
                state_sharing == "allowed" and not same_initializer
            ):
                raise duplicate_name_error(name, paths.get(name), path or "the root")
        valued[name] = source
        paths.setdefault(name, path or "the root")
        initializers[name] = initializer
        return HandledLocalStateRef(handler_id, name, explicit, request.category)

    handled_body = _graph.map_tree(body, replace, is_target)
    handler = WithFunctionalLocalState(handler_id, handled_body)

    def initial_states() -> dict[str, Any]:
        return _states_dict(
            {name: own_value(init()) for name, init in initializers.items()}, notes
        )

    return handler, (initial_states if lazy else initial_states())


def _frozen_initializer(value: Any) -> Callable[[], Any]:
    return lambda: value


def freeze_local_states(handler: WithFunctionalLocalState, states: dict[str, Any]) -> Any:
    """Embeds ``states`` back into the handler's body (inverse of handling).

    The first reference to an explicitly named state becomes a
    ``FrozenLocalStateRequest`` holding its value; later references to it
    become ``SharedLocalStateRequest``s. Path-named states become unnamed
    frozen requests, so handling the result again gives the same names.

    Args:
        handler: the ``WithFunctionalLocalState`` of ``handle_local_states``.
        states: its states dict (as handling or a call of the handler gave it).

    Returns:
        The body, its handled references replaced by requests.

    Raises:
        InvalidTypeError: ``handler`` is not a ``WithFunctionalLocalState``.

    Examples:
        >>> from autostate import FrozenLocalStateRequest, freeze_local_states
        >>> body = {"a": FrozenLocalStateRequest(jnp.ones(()), category="c", name="n")}
        >>> handler, states = autostate.handle_local_states(body, category="c")
        >>> freeze_local_states(handler, {"n": jnp.zeros(())})["a"]
        FrozenLocalStateRequest(state=Array(0., dtype=float32), category='c', name='n')
    """
    if not isinstance(handler, WithFunctionalLocalState):
        raise freeze_handler_type_error(handler)
    return freeze_body(handler.handler_id, handler.body, states)


def freeze_body(handler_id: Hashable, body: Any, states: dict[str, Any]) -> Any:
    """Replaces ``handler_id``'s references in ``body`` by frozen requests, handed
    to the ``made_here`` hook (a model frozen inside a transformation lives there)."""
    emitted: set[str] = set()
    made: list[StateSlot] = []

    def is_target(node: Any) -> bool:
        return _slot_role(type(node)) is _HANDLED and node.handler_id == handler_id

    def replace(ref: Any, _path: str) -> Any:
        slot = frozen(ref)
        made.append(slot)
        return slot

    def frozen(ref: Any) -> Any:
        if type(ref) is not HandledLocalStateRef:
            return ref.frozen()  # held in the structure (``handled_in_structure``)
        if ref.name not in states:
            raise freeze_missing_state_error(ref.name, states)
        value = own_value(states[ref.name])  # the model's own: the dict is the caller's
        if not ref.was_explicitly_named:
            return FrozenLocalStateRequest(value, ref.category, None)
        if ref.name in emitted:
            return SharedLocalStateRequest(ref.name, ref.category)
        emitted.add(ref.name)
        return FrozenLocalStateRequest(value, ref.category, ref.name)

    frozen_body = _graph.map_tree(body, replace, is_target)
    _hooks.made_here(made)
    return frozen_body


def hoist_shared_state_requests(tree: Any, unsafe: bool = False) -> tuple[Any, dict[str, Any]]:
    """Pulls the requests of every explicitly named state used in several places out of ``tree``.

    A name counts as used in several places when two or more requests in
    ``tree`` (Initial, Frozen or Shared) carry it, as in penzai v1; a name used
    once stays where it is. Each Initial/Frozen request of such a name is
    replaced by a ``SharedLocalStateRequest`` and the first one is returned in
    ``requests``. Unless ``unsafe``, the requests of one name must be
    ``InitialLocalStateRequest``s with the same initializer object: a
    ``FrozenLocalStateRequest`` may define a shared state only once.

    Args:
        tree: any pytree (or ``@stateful`` model) holding requests.
        unsafe: allow conflicting definitions of one name; the first one is
            kept.

    Returns:
        ``(tree_with_shared, requests)``, for ``embed_shared_state_requests``.

    Raises:
        StateSharingError: without ``unsafe``, a name is defined twice in
            ways that conflict.

    Examples:
        >>> from autostate import FrozenLocalStateRequest, SharedLocalStateRequest
        >>> tree = {
        ...     "enc": FrozenLocalStateRequest(jnp.ones(2), category="kv", name="kv"),
        ...     "dec": SharedLocalStateRequest("kv", category="kv"),
        ... }
        >>> hoisted, requests = autostate.hoist_shared_state_requests(tree)
        >>> hoisted["enc"]
        SharedLocalStateRequest(name='kv', category='kv')
        >>> requests["kv"] is tree["enc"]
        True
    """
    uses: dict[str, int] = {}
    for _path, request in _graph.iter_tree(
        tree, lambda node: type(node) in REQUEST_TYPES and node.name is not None
    ):
        uses[request.name] = uses.get(request.name, 0) + 1
    requests: dict[str, Any] = {}

    def is_target(node: Any) -> bool:
        return (
            type(node) in (InitialLocalStateRequest, FrozenLocalStateRequest)
            and node.name is not None
            and uses.get(node.name, 0) > 1
        )

    def replace(request: Any, _path: str) -> SharedLocalStateRequest:
        previous = requests.get(request.name)
        if previous is None:
            requests[request.name] = request
        elif not unsafe and not _same_initializer(previous, request):
            raise conflicting_definitions_error(request.name)
        return SharedLocalStateRequest(request.name, request.category)

    return _graph.map_tree(tree, replace, is_target), requests


def _same_initializer(a: Any, b: Any) -> bool:
    # Penzai compares initializers only: one FrozenLocalStateRequest object used
    # twice is two definitions of a value, which would be two states once handled.
    return (
        isinstance(a, InitialLocalStateRequest)
        and isinstance(b, InitialLocalStateRequest)
        and a.state_initializer is b.state_initializer
    )


def embed_shared_state_requests(tree: Any, requests: dict[str, Any]) -> Any:
    """Inverse of ``hoist_shared_state_requests``.

    The first ``SharedLocalStateRequest`` of each name in ``requests`` is
    replaced by that request; later ones stay shared.

    Args:
        tree: a tree holding ``SharedLocalStateRequest``s.
        requests: ``{name: request}``, as ``hoist_shared_state_requests``
            returns it.

    Returns:
        A copy of ``tree`` with the first use of each name holding its request.

    Raises:
        StateSharingError: a request's category differs from that of the
            shared request it replaces.

    Examples:
        >>> from autostate import FrozenLocalStateRequest, SharedLocalStateRequest
        >>> tree = {
        ...     "enc": FrozenLocalStateRequest(jnp.ones(2), category="kv", name="kv"),
        ...     "dec": SharedLocalStateRequest("kv", category="kv"),
        ... }
        >>> hoisted, requests = autostate.hoist_shared_state_requests(tree)
        >>> embedded = autostate.embed_shared_state_requests(hoisted, requests)
        >>> embedded["enc"] is tree["enc"], embedded["dec"]
        (True, SharedLocalStateRequest(name='kv', category='kv'))
    """
    pending = dict(requests)

    def is_target(node: Any) -> bool:
        return type(node) is SharedLocalStateRequest and node.name in pending

    def replace(shared: SharedLocalStateRequest, _path: str) -> Any:
        replacement = pending.pop(shared.name)
        if replacement.category != shared.category:
            raise mismatched_category_error(shared.name, replacement.category, shared.category)
        return replacement

    return _graph.map_tree(tree, replace, is_target)


def rename_local_states(tree: Any, rename_fn: Callable[[str], str]) -> Any:
    """Renames every explicitly named state request in ``tree`` with ``rename_fn``.

    Models composed from named parts reuse names (two encoders with a ``"kv"``
    cache each); prefixing the names of each part keeps them apart. Initial,
    Frozen and Shared requests are renamed through their
    ``with_renamed_parameters``; unnamed requests (named by their path when
    handled) and already handled references are left as they are.

    Args:
        tree: any pytree (or ``@stateful`` model) holding requests.
        rename_fn: old name -> new name.

    Returns:
        A copy of ``tree`` with renamed requests (``tree`` is unchanged).

    Examples:
        >>> @autostate.stateful
        ... class Encoder:
        ...     def __init__(self):
        ...         self.kv = autostate.state(jnp.zeros(2), category="cache", name="kv")
        ...
        ...     def __call__(self, x):
        ...         self.kv = self.kv + x
        ...         return self.kv
        >>> enc = autostate.rename_local_states(Encoder(), lambda name: "enc." + name)
        >>> dec = autostate.rename_local_states(Encoder(), lambda name: "dec." + name)
        >>> handler, states = autostate.handle_local_states([enc, dec], category="cache")
        >>> sorted(states)
        ['dec.kv', 'enc.kv']
    """
    if not callable(rename_fn):
        raise rename_fn_type_error(rename_fn)
    return _graph.map_tree(
        tree,
        lambda request, _path: request.with_renamed_parameters(rename_fn),
        lambda node: type(node) in REQUEST_TYPES and node.name is not None,
    )
