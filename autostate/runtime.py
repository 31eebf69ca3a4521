"""The small runtime that rewritten methods call (``__autostate__.<name>``).

Each state attribute of an instance holds a *slot* in ``obj.__dict__``: an
``InitialLocalStateRequest`` or ``FrozenLocalStateRequest`` while the model
runs eagerly, a ``HandledLocalStateRef`` once functionalized, or a host-store
slot under ``fallback="host"``. Every slot speaks the one protocol of
``effects.StateSlot`` (``read``, ``write`` returning its replacement), so
``get`` and ``set`` serve every mode and this module is the only code that
puts a slot into an instance. It also holds the run-time guard on non-state
writes and the class-level descriptor of state attributes. Names here are
what a traceback through user code shows, so they say what they do.
"""

from __future__ import annotations

import builtins
import collections
import collections.abc
import functools
import importlib
import operator
import re
import sys
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from autostate import graph as _graph
from autostate import sharding as _sharding
from autostate import tree as _tree
from autostate import values as _values
from autostate.effects.local_state import (
    FrozenLocalStateRequest,
    HandledLocalStateRef,
    InitialLocalStateRequest,
    StateSlot,
    handler_running,
)
from autostate.errors import (
    InvalidArgumentError,
    InvalidTypeError,
    StateAccessError,
    TracedEagerStateError,
    format_error,
    refused,
    user_location,
)
from autostate.guard import at_object_boundary, check_structure_change, is_guarded, lax_body_of
from autostate.guard import check_write as check_guarded_write
from autostate.lifetime import (
    check_not_traced,
    contains_tracer,
    initial_slot,
    recording_state_reads,
)
from autostate.state_values import (
    HandledStaticState,
    StaticState,
    is_static_value,
    makes_static_state,
)
from autostate.transform import source as _source
from autostate.transform.method import INPLACE_OPERATORS, INPLACE_TENSOR_METHODS
from autostate.unsortable import unsortable_keys_error

_MISSING = object()


def is_slot(value: Any) -> bool:
    """Whether ``value`` is a slot (of any engine) rather than a plain value."""
    return slot_kind(type(value)).is_slot


class StateDeclaration:
    """What ``autostate.state(value, category=..., name=..., sharding=...)`` returns
    (and ``autostate.constant(value)``: ``marker`` names the function the user
    called, for the errors)."""

    __slots__ = ("value", "category", "name", "sharding", "marker")

    def __init__(
        self,
        value: Any,
        category: Any,
        name: str | None,
        sharding: Any = None,
        marker: str = "state",
    ):
        self.value = value
        self.category = category
        self.name = name
        self.sharding = sharding
        self.marker = marker

    def __repr__(self) -> str:
        return f"{self.marker}({self.value!r}, category={self.category!r}, name={self.name!r})"

    def _used_as_value(self, *_args: Any) -> Any:
        raise InvalidTypeError(_declaration_used_message(marker=self.marker))

    # The marker reached as a value (kept in a local, a list, a helper's
    # result, a dataclass field's default): its first use says so, instead of
    # an operand error naming a class the user never wrote.
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _used_as_value
    __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = _used_as_value
    __mod__ = __rmod__ = __pow__ = __rpow__ = __matmul__ = __rmatmul__ = _used_as_value
    __neg__ = __pos__ = __abs__ = __invert__ = __float__ = __int__ = _used_as_value
    __index__ = __complex__ = __getitem__ = __len__ = __iter__ = _used_as_value
    __array__ = __jax_array__ = _used_as_value

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # protocols (copy, pickle) look for what is not here
            raise AttributeError(name)
        raise StateAccessError(_declaration_used_message(marker=self.marker))


def _declaration_used_message(
    subject: str | None = None, cls: type | None = None, marker: str = "state"
) -> str:
    """Why a marker (``autostate.state`` or ``autostate.constant``: ``marker``)
    reached code that is not where the decorator sees it."""
    where = user_location()
    if cls is not None and (where is None or where.startswith("<")):
        # Code generated for the class (a dataclass's __init__): its class line.
        from autostate.transform.pipeline import class_location

        where = class_location(cls)
    kind = "a constant" if marker == "constant" else "a state"
    return format_error(
        f"{subject or f'An autostate.{marker}(...) declaration was used as a value.'} "
        f"autostate.{marker}(value) declares {kind} only where the decorator sees it: "
        "assigned directly in a method of an @autostate.stateful class (`self.x = "
        f"autostate.{marker}(value)`), not kept in a local or a list, returned by a helper, "
        "set with a computed name (`setattr(self, name, ...)`), or set by generated code "
        "such as a dataclass field's default.",
        where=where,
        fix="assign it directly in __init__ (or a dataclass's __post_init__): `self.x = "
        f"autostate.{marker}(value)`; a helper can return the value itself.",
    )


def _refuse_declaration_in_model(value: StateDeclaration) -> Any:
    raise StateAccessError(
        _declaration_used_message(
            f"A model holds an autostate.{value.marker}(...) declaration as a value.",
            marker=value.marker,
        )
    )


_graph.register_node_kind(StateDeclaration, canonical=_refuse_declaration_in_model)


def make_slot(obj: Any, name: str, value: Any) -> Any:
    """The eager slot for a state first assigned ``value`` (a declaration or a value)."""
    info = _tree.info_of(obj)
    category, explicit, spec = info.category, None, None
    if isinstance(value, StateDeclaration):
        if value.category is not None:
            category = value.category
        explicit, spec = value.name, value.sharding
        value = value.value
    # --- sharding annotations (autostate.sharding) ---
    value, sharded_spec = _sharding.split_annotation(value)
    if spec is not None or sharded_spec is not None:
        _sharding.record(obj, name, spec if spec is not None else sharded_spec)
    # --- end sharding annotations ---
    if _graph.holds_instance(value):
        # A sub-model (``self.sub = Leaf()`` in a method, ``self.blocks =
        # [Block(), ...]``): a plain attribute, so the model graph holds it and
        # its own states stay states, as if __init__ had assigned it.
        return value
    if info.slot_factory is not None:
        unsortable = check_not_traced(value, explicit or name)
        error = unsortable and unsortable_keys_error(value, unsortable, None, _HOST_STORE)
        if error:
            raise error
        return info.slot_factory(obj, name, value, category, explicit)
    return initial_slot(as_state_value(value, name), category, explicit, name)


_HOST_STORE = 'so a fallback="host" store, which keeps a state as flat arrays, cannot hold it'


# numpy dtype kinds a jax array can hold: bool, ints, floats, complex.
_JAX_KINDS = frozenset("biufc")
_Tracer = jax.core.Tracer
# The type of a concrete jax array (no tracer, nothing to convert), learnt
# from the first one written: building one here would start a backend.
_CONCRETE_ARRAY: type = type(_MISSING)


# How a write puts a slot into ``__dict__``: as an attribute store does, never
# through the ``__setitem__`` of a dict subclass assigned to ``obj.__dict__``.
_dict_setitem = dict.__setitem__


def _sole_holder_count() -> int:
    """What ``request._holders`` (its reference count) reads in the write paths
    below for a request only the instance's ``__dict__`` holds; ``-1`` where it
    cannot tell (a free-threaded build).

    An eager write changes such a request in place only when no one can tell:
    nothing else holds it (no copy sharing it, no saved ``vars()``, no tied
    attribute, no running walk). Between the count and the store no other code
    runs: the count is read from C and both sit on one line (no debugger's line
    event). Otherwise a new request goes in and every holder of the old one
    keeps its value, as in plain Python."""
    if not getattr(sys, "_is_gil_enabled", lambda: True)():
        return -1

    def probe(d: dict[str, Any], name: str) -> int:
        try:
            slot = d[name]
        except KeyError:
            slot = None
        if type(slot) is FrozenLocalStateRequest:
            return slot._holders
        return -1

    d = {"x": FrozenLocalStateRequest(0, "probe", None)}
    alone = probe(d, "x")
    held = d["x"]
    with_one_more = probe(d, "x")
    del held
    return alone if with_one_more == alone + 1 and probe(d, "x") == alone else -1


_SOLE_HOLDER = _sole_holder_count()


def as_state_value(value: Any, name: str = "") -> Any:
    """A value as state holds it: numpy arrays become jax arrays, as ``jax.jit``
    would see them, so eager calls mean what jitted ones do."""
    if _values.is_numpy(value):
        if value.dtype.kind not in _JAX_KINDS:
            # Strings, objects, datetimes: no jax array holds them.
            raise InvalidTypeError(
                format_error(
                    f"State {name!r} was assigned a numpy value of dtype {value.dtype}, which "
                    "a JAX array cannot hold.",
                    where=user_location(),
                    fix="keep such values as Python data outside state (a tuple of str "
                    "assigned only in __init__ is static config), or encode them as numbers.",
                )
            )
        return jax.numpy.asarray(value)
    t = type(value)
    # Containers are rebuilt here, not by tree_map, which sorts a dict's keys.
    if t is dict:
        return {k: as_state_value(v, name) for k, v in value.items()}
    if t is list or t is tuple:
        items = [as_state_value(v, name) for v in value]
        return items if t is list else tuple(items)
    if (kind := _values.kind_of(value)).atom or kind is _values.ARRAY or not _graph.is_dynamic(value):
        return value
    # Another pytree node (a NamedTuple, an OrderedDict): its own flatten
    # keeps its order; a plain dict inside it is rebuilt as above.
    leaves, treedef = jax.tree_util.tree_flatten(value, is_leaf=lambda v: type(v) is dict)
    if jax.tree_util.treedef_is_leaf(treedef):
        return value  # a leaf JAX does not flatten (a ShapeDtypeStruct): held as is
    return jax.tree_util.tree_unflatten(treedef, [as_state_value(v, name) for v in leaves])


# Classes with a user __getattribute__ / __setattr__: state access goes through
# them (and then the class's descriptors) so it means what plain Python means.
_HOOKED_GET: set[type] = set()
_HOOKED_SET: set[type] = set()


def register_access_hooks(cls: type, *, getattribute: bool, setattr_: bool) -> None:
    """Records whether ``cls``'s state access must go through its own hooks:
    ``get``/``set`` are ``read_state``/``store_state`` themselves until a class has one."""
    global get, set
    for hooked, on in ((_HOOKED_GET, getattribute), (_HOOKED_SET, setattr_)):
        if on:
            hooked.add(cls)
        else:
            hooked.discard(cls)
    get = _get_through_hooks if _HOOKED_GET else read_state
    set = _set_through_hooks if _HOOKED_SET else store_state


def _get_through_hooks(obj: Any, name: str) -> Any:
    """``get`` while a class has a ``__getattribute__`` of its own."""
    if type(obj) in _HOOKED_GET:
        return getattr(obj, name)
    return read_state(obj, name)


def read_state(obj: Any, name: str) -> Any:
    """``get`` without the class's ``__getattribute__`` (the descriptor's read)."""
    try:
        slot = obj.__dict__[name]
    except KeyError:
        default = _class_value(type(obj), name)
        if default is not _MISSING:
            return default  # a static class-level default (see install_class_defaults)
        if name not in _tree.info_of(obj).state:
            # Code rewritten for another class (see store_state): the plain read.
            return getattr(obj, name)
        raise StateAccessError(
            format_error(
                f"{type(obj).__name__!r} object has no state {name!r} yet.",
                fix=f"assign `self.{name}` in __init__ before reading it.",
            )
        ) from None
    if is_slot(slot):
        return slot.read()
    return slot


def _set_through_hooks(obj: Any, name: str, value: Any) -> None:
    """``set`` while a class has a ``__setattr__`` of its own."""
    if type(obj) in _HOOKED_SET:
        setattr(obj, name, value)
        return
    store_state(obj, name, value)


def store_state(obj: Any, name: str, value: Any) -> None:
    """``set`` without the class's ``__setattr__`` (the descriptor's write), and
    ``model.x = v`` from outside (``guarded_setattr``).

    The one write path: what ``obj.__dict__`` holds for ``name`` has a kind in
    ``_SLOT_KINDS`` that says what the write does. Its first lines are the one
    fast path: a concrete jax array into an unhandled request, changed in place
    only when no one can tell (``_sole_holder_count``)."""
    d = obj.__dict__
    slot = d.get(name, _MISSING)
    if type(slot) is FrozenLocalStateRequest and type(value) is _CONCRETE_ARRAY:
        # One line: no debugger's line event between the count and the store.
        if slot._holders == _SOLE_HOLDER: slot.state = value  # noqa: E701
        else: _dict_setitem(d, name, slot.replaced(value))  # noqa: E701
        return
    kind = _SLOT_KINDS.get(type(slot)) or slot_kind(type(slot))
    kind.write(kind, obj, name, slot, value)


# What rewritten methods call: the current value of state ``name`` of ``obj``
# (``get``), and its write, in place eagerly, in the handler's cell when
# handled (``set``); see ``register_access_hooks``.
get: Callable[[Any, str], Any] = read_state
set: Callable[[Any, str, Any], None] = store_state  # noqa: A001 - generated code reads well


class SlotKind:
    """What a write does with one kind of slot (an entry of ``_SLOT_KINDS``),
    instead of a branch in ``store_state``: ``is_slot`` (else a plain value: a
    sub-model, or nothing yet), ``handled`` (a running call's slot, which a
    sub-model cannot replace), ``jax_values`` (numpy is converted),
    ``eager_request`` (an eager model's own request, which a running call must
    not give a tracer), and ``write(kind, obj, name, slot, value)``."""

    __slots__ = ("is_slot", "handled", "jax_values", "eager_request", "write")

    def __init__(
        self,
        write: Callable[[SlotKind, Any, str, Any, Any], None],
        *,
        is_slot: bool = True,
        handled: bool = False,
        jax_values: bool = False,
        eager_request: bool = False,
    ):
        self.write = write
        self.is_slot = is_slot
        self.handled = handled
        self.jax_values = jax_values
        self.eager_request = eager_request


def _write_into_slot(kind: SlotKind, obj: Any, name: str, slot: Any, value: Any) -> None:
    """A write into a slot: the slot's own ``write``, around the checks its
    kind asks for; the replacement it returns takes its place."""
    if type(value) is StateDeclaration:
        value = _declared_value(obj, name, slot, value)
    if kind.handled and isinstance(value, _Tracer):
        slot.write(value)  # the common traced write: nothing below applies to a tracer
        return
    if _graph.holds_instance(value):
        # ``self.sub = Leaf()`` after ``self.sub = None``: the sub-model
        # becomes a plain attribute (see make_slot), eagerly and at an object
        # boundary (the running call's state then is no longer the
        # attribute's: ``lifting.run_handled``); refused in f or a lax body.
        check_structure_change(obj, name, value, kind.handled)
        _dict_setitem(obj.__dict__, name, value)
        return
    if kind.handled and makes_static_state(value) and at_object_boundary(obj):
        # A static config switched at an object boundary (``self.mode =
        # "eval"`` over the placeholder None): a static state, as the plain
        # call makes it, written back (``lifting.run_handled``; DESIGN.md
        # section 8).
        _dict_setitem(obj.__dict__, name, StaticState(value, slot.category, name))
        return
    if kind.jax_values and _values.is_numpy(value):
        value = as_state_value(value, name)
    if kind.eager_request and is_guarded(obj):
        _check_unhandled_write(obj, name, slot, value)
    try:
        replacement = slot.write(value, name)
    except (ValueError, TypeError) as err:
        # A slot that flattens what it stores (a host store) met a dict
        # whose keys do not sort: said in autostate's words.
        error = unsortable_keys_error(value, None, name, _HOST_STORE)
        if error is None or "dictionary keys" not in str(err):
            raise
        raise error from None
    if replacement is not None:
        _dict_setitem(obj.__dict__, name, replacement)
    if kind.eager_request and _CONCRETE_ARRAY is not type(value):
        _learn_concrete_array(value)


def _write_plain(kind: SlotKind, obj: Any, name: str, held: Any, value: Any) -> None:
    """A write where ``__dict__`` holds no slot: nothing yet, or a sub-model."""
    if name not in _tree.info_of(obj).state:
        # An attribute that is not state (``model.lr = 0.1``), or code
        # rewritten for another class running on this instance (a method
        # borrowed from a decorated class: ``forward = Donor.forward``): the
        # plain attribute assignment, guarded. (A class with a ``__setattr__``
        # of its own never gets here: ``set`` calls it.)
        assign_attribute(obj, name, value)
        return
    if type(value) is StateDeclaration and held is not _MISSING:
        value = _declared_value(obj, name, held, value)
    if held is _MISSING and is_guarded(obj):
        default = _class_value(type(obj), name)
        if default is not _MISSING:
            # Still the class's static value, part of f's structure: the
            # same value again is allowed, another one refused.
            HandledStaticState(None, name, default, False, _tree.info_of(obj).category).write(
                value, name
            )
            return
    if (
        value is not held
        and (is_guarded(obj) or lax_body_of(obj))
        and (_graph.holds_instance(value) or _graph.holds_instance(held))
    ):
        check_structure_change(obj, name, value, False)
    if held is _MISSING:
        _restore_descriptor(type(obj), name)
    _dict_setitem(obj.__dict__, name, make_slot(obj, name, value))


def _restore_descriptor(cls: type, name: str) -> None:
    """Puts back the descriptor of state ``name`` when the class lost it after
    decoration (``@dataclass`` above ``@stateful``, ``Model.v = ...`` after the
    class statement); without it, code outside would read the raw slot."""
    if state_descriptor(cls, name) is None:
        setattr(cls, name, StateAttribute(name, _class_value(cls, name)))


_EAGER_REQUEST = SlotKind(_write_into_slot, jax_values=True, eager_request=True)
_FOREIGN_SLOT = SlotKind(_write_into_slot)
_PLAIN_VALUE = SlotKind(_write_plain, is_slot=False)
# The kind of each type a state's entry in ``__dict__`` may have. The
# engine's slots are listed; another ``StateSlot`` (a host store, a copy's
# state, a lax body's placeholder) is a foreign slot unless its class says it is
# ``written_as_request`` (a state a compiled call left packed), any other type
# a plain value: each found once per type by ``slot_kind``.
_SLOT_KINDS: dict[type, SlotKind] = {
    InitialLocalStateRequest: _EAGER_REQUEST,
    FrozenLocalStateRequest: _EAGER_REQUEST,
    HandledLocalStateRef: SlotKind(_write_into_slot, handled=True, jax_values=True),
    HandledStaticState: SlotKind(_write_into_slot, handled=True),
}


def slot_kind(t: type) -> SlotKind:
    """The ``SlotKind`` of a type ``obj.__dict__`` holds for a state."""
    kind = _SLOT_KINDS.get(t)
    if kind is None:
        if not issubclass(t, StateSlot):
            kind = _PLAIN_VALUE
        elif getattr(t, "written_as_request", False):
            # (A state a compiled call left packed: written as the request it stands for.)
            kind = _EAGER_REQUEST
        else:
            kind = _FOREIGN_SLOT
        _SLOT_KINDS[t] = kind
    return kind


def _declared_value(obj: Any, name: str, slot: Any, declared: StateDeclaration) -> Any:
    """The value of ``self.x = autostate.state(v)`` where ``x`` is a state already;
    another category or name is refused (they are fixed where first assigned)."""
    category = getattr(slot, "category", None)
    if (declared.category is not None and declared.category != category) or (
        declared.name is not None and declared.name != getattr(slot, "name", None)
    ):
        raise InvalidArgumentError(
            format_error(
                f"{type(obj).__name__}.{name} is a state already; assigning it "
                f"autostate.state(..., category={declared.category!r}, name={declared.name!r}) "
                "cannot change its category or name.",
                fix=f"assign the value itself (`self.{name} = v`); declare the category and "
                f"name where the state is first assigned (in __init__).",
            )
        )
    return declared.value


def compute_cached_property(compute: Callable[[], Any], obj: Any, name: str) -> Any:
    """``obj.<name>`` of a ``functools.cached_property``, computed by ``compute``.

    Plain Python keeps the first value. A value computed from a state inside a
    traced functionalized call is a value of that trace, which the call drops:
    refused the first time. One computed from config only is kept."""
    if not handler_running():
        return compute()
    with recording_state_reads() as reads:
        value = compute()
    if reads and contains_tracer(value):
        obj.__dict__.pop(name, None)
        cls = type(obj).__name__
        raise refused(StateAccessError(
            format_error(
                f"functools.cached_property {cls}.{name} was first computed inside a traced "
                f"functionalized call (jax.jit, grad, vmap) from state "
                f"{', '.join(map(repr, dict.fromkeys(reads)))}: plain Python keeps that "
                "first value for every later call, but a value of the trace cannot outlive "
                "it, so every call would compute it again from the states it is given.",
                where=user_location(),
                fix=f"compute it once before functionalizing (read `model.{name}`, then "
                "`model.functionalize()`: f keeps the value), or keep it as a state assigned "
                f"where it is computed (`self.{name}_value = ...` in a method), or make it a "
                "@property if it should follow the state.",
            )
        ))
    return value


_source.on_cached_compute(compute_cached_property)


def _learn_concrete_array(value: Any) -> None:
    global _CONCRETE_ARRAY
    if isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer):
        _CONCRETE_ARRAY = type(value)


def _check_unhandled_write(obj: Any, name: str, slot: Any, value: Any) -> None:
    """A state of a category this call does not handle lives in the model itself."""
    if contains_tracer(value):
        raise TracedEagerStateError(
            format_error(
                f"State {type(obj).__name__}.{name} (category {slot.category!r}) is not handled "
                "by the running functionalized call, so it cannot take a traced value: the "
                "model would keep a tracer after the call returns.",
                fix="functionalize every category the call writes "
                "(`model.functionalize()` handles all of them), or assign this state outside "
                "the transformed call.",
            )
        )


def init(obj: Any, name: str, value: Any) -> None:
    """``self.x = v`` in ``__init__``: a fresh initial-state request holding ``v``."""
    if _HOOKED_SET and type(obj) in _HOOKED_SET:
        setattr(obj, name, value)
        return
    if name not in _tree.info_of(obj).state:
        # A base's __init__ on an instance of a class where ``name`` is no
        # state (a subclass made it a property; a borrowed method): the
        # plain assignment, its setter included.
        setattr(obj, name, value.value if isinstance(value, StateDeclaration) else value)
        return
    slot = obj.__dict__.get(name, _MISSING)
    if is_slot(slot) and not isinstance(slot, InitialLocalStateRequest):
        # __init__ called again on a functionalized or frozen model: a write.
        value = value.value if isinstance(value, StateDeclaration) else value
        set(obj, name, _sharding.split_annotation(value)[0])
        return
    obj.__dict__[name] = make_slot(obj, name, value)


class _Indexer:
    """``ix[a, 1:2]`` returns the key Python would pass to ``__setitem__``."""

    __slots__ = ()

    def __getitem__(self, key: Any) -> Any:
        return key


ix = _Indexer()


def _updated(container: Any, key: Any, value: Any) -> Any:
    """A copy of ``container`` with ``container[key] = value``, of the same
    type (an OrderedDict, a defaultdict with its factory, a deque); arrays via ``.at``."""
    update = _values.kind_of(container).update
    if update is not None:
        return update(container, key, value)
    raise InvalidTypeError(
        format_error(
            f"Cannot assign an item of a state of type {type(container).__name__}.",
            fix="keep arrays, dicts, lists, tuples, deques or UserDicts/UserLists in state, or "
            "assign the whole value.",
        )
    )


def _set_path(container: Any, keys: tuple, value: Any) -> Any:
    if len(keys) == 1:
        return _updated(container, keys[0], value)
    return _updated(container, keys[0], _set_path(container[keys[0]], keys[1:], value))


def setitem(obj: Any, name: str, value: Any, *keys: Any) -> None:
    """``self.x[k1][k2] = value`` as a functional update of state ``x``."""
    set(obj, name, _set_path(get(obj, name), keys, value))


# The scatter each operator maps to on jax arrays (others read, combine, set).
_AT_METHODS = {"+": "add", "*": "multiply", "/": "divide", "**": "power"}


def _inplace(op: Any) -> Any:
    # A container whose in-place operators mutate (a list, dict, set, deque,
    # UserList... and subclasses): state never changes in place, so the
    # operator runs on a shallow copy (and keeps its own meaning:
    # ``list += range(3)``, ``dict |= [("k", v)]``).
    def apply(current: Any, value: Any) -> Any:
        copy = _values.kind_of(current).copy
        if copy is not None:
            current = copy(current)
        return op(current, value)

    return apply


# The runtime function of each in-place operator, by the name generated code
# calls (``__autostate__.iadd`` for ``+=``: ``transform.method.INPLACE_OPERATORS``).
_INPLACE = {op: _inplace(getattr(operator, name)) for op, name in INPLACE_OPERATORS.items()}
globals().update({name: _INPLACE[op] for op, name in INPLACE_OPERATORS.items()})


class _Item:
    """``self.x[k]`` read for ``self.x[k] op= v``: the keys and the old item,
    taken before ``v`` is evaluated, as Python does."""

    __slots__ = ("obj", "name", "keys", "current", "container", "old")

    def __init__(self, obj: Any, name: str, keys: tuple):
        self.obj, self.name, self.keys = obj, name, keys
        self.current = container = get(obj, name)
        for key in keys[:-1]:
            container = container[key]
        self.container = container
        self.old = container[keys[-1]]


def item(obj: Any, name: str, *keys: Any) -> _Item:
    """The target of ``self.x[k1][k2] op= v`` (evaluated before ``v``)."""
    return _Item(obj, name, keys)


def augitem(target: _Item, op: str, value: Any) -> None:
    """``self.x[k] op= value`` as a functional update of state ``x``."""
    container, keys, current = target.container, target.keys, target.current
    at = getattr(container, "at", None)
    method = _AT_METHODS.get(op)
    if at is not None and method is not None and not isinstance(container, np.ndarray):
        updated = getattr(at[keys[-1]], method)(value)
        new = updated if len(keys) == 1 else _set_path(current, keys[:-1], updated)
    else:
        new = _set_path(current, keys, _INPLACE[op](target.old, value))
    set(target.obj, target.name, new)


def delitem(obj: Any, name: str, *keys: Any) -> None:
    """``del self.x[k]`` on dict or list state, as a functional update."""
    current = get(obj, name)
    parent = current
    for key in keys[:-1]:
        parent = parent[key]
    delete = _values.kind_of(parent).delete
    if delete is not None:
        # (A copy of the same type, as an item write makes.)
        shrunk = delete(parent, keys[-1])
    else:
        raise InvalidTypeError(
            format_error(
                f"Cannot delete an item of state {name!r} of type {type(parent).__name__}.",
                fix="only dict and list state (and their subclasses, deque, UserDict and "
                "UserList) support `del self.x[key]`.",
            )
        )
    set(obj, name, shrunk if len(keys) == 1 else _set_path(current, keys[:-1], shrunk))


# --- PyTorch's in-place tensor methods (``transform.method.INPLACE_TENSOR_METHODS``) ---


@functools.cache
def _inplace_function(method: str) -> Callable[..., Any]:
    """The table row's functional expression as a function of ``x`` and the
    method's own parameters, named as the method (what a traceback shows);
    compiled by the method's first call, not by ``import autostate``."""
    params, expression, _casting = INPLACE_TENSOR_METHODS[method]
    namespace: dict[str, Any] = {"jnp": jax.numpy}
    exec(f"def {method}(x, {params}):\n    return {expression}", namespace)  # noqa: S102
    return namespace[method]


def _functional_spelling(method: str, target: str) -> str:
    """``self.x = self.x * other``: what ``target.<method>(...)`` means, as an assignment."""
    params, expression, _casting = INPLACE_TENSOR_METHODS[method]
    value = re.sub(r"\bx\b", target, expression)
    return f"`{target} = {value}` (the parameters as in `{method}({params})`)"


def _is_view_key(key: Any) -> bool:
    """Whether ``key`` indexes an array as PyTorch's view does (basic indexing:
    ints, slices, ``None``, ``...``, a 0-d integer array), not as a copy
    (a list, an integer or boolean array: advanced indexing)."""
    if isinstance(key, tuple):
        return all(_is_view_key(k) for k in key)
    if key is None or key is Ellipsis or isinstance(key, (slice, int, np.integer)):
        return not isinstance(key, bool)
    return _values.is_array(key) and key.ndim == 0 and jax.numpy.issubdtype(key.dtype, np.integer)


class InPlace:
    """The tensor PyTorch's in-place methods update: ``self.x``, an item of it,
    or an attribute of another object (``self.bn.mean``).

    Each method reads the current value, computes the functional expression,
    keeps shape and dtype, and writes back (a state through ``set``, an item as
    ``self.x[i] = ...``, another object's attribute by ``setattr``). It returns
    the target, so a chain goes on; ``value`` is what PyTorch's call returns."""

    __slots__ = ("obj", "name", "keys", "own", "value")

    def __init__(self, obj: Any, name: str, keys: tuple, own: bool):
        self.obj, self.name, self.keys, self.own = obj, name, keys, own
        self.value: Any = None

    def _spelling(self) -> str:
        owner = "self" if self.own else "obj"
        keys = "[...]" if self.keys else ""
        return f"{owner}.{self.name}{keys}"

    def update(self, method: str, args: tuple, kwargs: dict[str, Any]) -> InPlace:
        whole = get(self.obj, self.name) if self.own else getattr(self.obj, self.name)
        part = whole
        for key in self.keys:
            if _values.is_array(part) and not _is_view_key(key):
                raise InvalidTypeError(
                    format_error(
                        f"`{self._spelling()}.{method}(...)` indexes {self.name!r} with "
                        f"{type(key).__name__} {key!r}: in PyTorch such an index (advanced "
                        "indexing) gives a copy, so the in-place update would change nothing.",
                        where=user_location(),
                        fix=f"assign the item to write it (`{self._spelling().removesuffix('[...]')}"
                        "[idx] = v`, a functional update here as in PyTorch), or drop the update "
                        "if the copy's change was not meant to last.",
                    )
                )
            part = part[key]
        if not _values.is_array(part):
            own_method = getattr(part, method, None)
            if own_method is None:
                raise InvalidTypeError(
                    format_error(
                        f"`{self._spelling()}.{method}(...)`: {self.name!r} holds a "
                        f"{type(part).__name__}, which has no in-place tensor method "
                        f"{method!r}.",
                        where=user_location(),
                        fix=f"keep an array there, or assign the new value: "
                        f"{_functional_spelling(method, self._spelling())}.",
                    )
                )
            self.value = own_method(*args, **kwargs)  # (an object's own method, as written)
            return self
        try:
            new = _inplace_function(method)(part, *args, **kwargs)
        except TypeError as err:
            if "argument" not in str(err):
                raise
            params = INPLACE_TENSOR_METHODS[method][0]
            raise InvalidTypeError(
                format_error(
                    f"`{self._spelling()}.{method}(...)`: {err} (autostate's {method} takes "
                    f"({params})).",
                    where=user_location(),
                    fix=f"pass {method}'s arguments as PyTorch names them, or write the "
                    f"functional value: {_functional_spelling(method, self._spelling())}.",
                )
            ) from None
        new = self._kept_like(part, new, method)
        new_whole = _set_path(whole, self.keys, new) if self.keys else new
        if self.own:
            set(self.obj, self.name, new_whole)
        else:
            setattr(self.obj, self.name, new_whole)
        self.value = new
        return self

    def _kept_like(self, x: Any, new: Any, method: str) -> Any:
        """``new`` as an in-place update leaves it: ``x``'s shape and dtype."""
        jnp = jax.numpy
        new = jnp.asarray(new)
        if new.shape != x.shape:
            try:
                fits = jnp.broadcast_shapes(new.shape, x.shape) == x.shape
            except ValueError:
                fits = False
            if not fits:
                raise InvalidTypeError(
                    format_error(
                        f"`{self._spelling()}.{method}(...)` gives shape {new.shape} for "
                        f"{self.name!r} of shape {x.shape}: an in-place update keeps its "
                        "tensor's shape.",
                        where=user_location(),
                        fix="pass values that broadcast to the tensor's shape, or assign the "
                        f"new value: {_functional_spelling(method, self._spelling())}.",
                    )
                )
            new = jnp.broadcast_to(new, x.shape)
        if new.dtype != x.dtype:
            casting = INPLACE_TENSOR_METHODS[method][2]
            if casting == "same_kind" and not jnp.can_cast(new.dtype, x.dtype, casting="same_kind"):
                raise InvalidTypeError(
                    format_error(
                        f"`{self._spelling()}.{method}(...)` gives dtype {new.dtype} for "
                        f"{self.name!r} of dtype {x.dtype}: an in-place update keeps its "
                        "tensor's dtype, and PyTorch refuses this cast too.",
                        where=user_location(),
                        fix=f"cast the argument to {x.dtype}, or assign the new value: "
                        f"{_functional_spelling(method, self._spelling())}.",
                    )
                )
            new = new.astype(x.dtype)
        return new


def _inplace_method(method: str) -> Callable[..., InPlace]:
    def call(self: InPlace, *args: Any, **kwargs: Any) -> InPlace:
        return self.update(method, args, kwargs)

    call.__name__ = call.__qualname__ = method
    return call


for _method in INPLACE_TENSOR_METHODS:
    setattr(InPlace, _method, _inplace_method(_method))


def inplace(obj: Any, name: str, *keys: Any) -> InPlace:
    """``self.x`` (or ``self.x[k]``) before an in-place tensor method: state ``x``."""
    return InPlace(obj, name, keys, True)


def inplace_attribute(obj: Any, name: str, *keys: Any) -> InPlace:
    """``obj.x`` (or ``obj.x[k]``) before an in-place tensor method, where
    ``obj`` is not the method's receiver (``self.bn.running_mean.zero_()``)."""
    return InPlace(obj, name, keys, False)


def tensor_method(value: Any, method: str) -> Any:
    """``value.<method>`` for a PyTorch in-place method name on anything but
    an attribute: the value's own method, or the error a JAX array gets."""
    kind = _values.kind_of(value)
    if kind.array or kind.number:
        what = "a numpy array" if kind.numpy else "a JAX array" if kind.array else "a number"
        raise InvalidTypeError(
            format_error(
                f"`.{method}(...)` on {what} that no attribute holds: JAX "
                "arrays never change in place; autostate gives PyTorch's in-place methods "
                "their meaning on an attribute (`self.x.mul_(m)` updates state x), not on a "
                "local value.",
                where=user_location(),
                fix=f"assign the new value to the local instead: "
                f"{_functional_spelling(method, 'x')}, with x the local's name.",
            )
        )
    return getattr(value, method)


class _ItemTarget:
    """``target(self).x[k]`` in a target position: item writes become setitem."""

    __slots__ = ("_as_obj", "_as_name", "_as_keys")

    def __init__(self, obj: Any, name: str, keys: tuple):
        self._as_obj, self._as_name, self._as_keys = obj, name, keys

    def __getitem__(self, key: Any) -> _ItemTarget:
        return _ItemTarget(self._as_obj, self._as_name, (*self._as_keys, key))

    def __setitem__(self, key: Any, value: Any) -> None:
        setitem(self._as_obj, self._as_name, value, *self._as_keys, key)

    def __delitem__(self, key: Any) -> None:
        delitem(self._as_obj, self._as_name, *self._as_keys, key)


class _Target:
    """``target(self)``: attribute writes become ``set``, in Python's own order."""

    __slots__ = ("_as_obj",)

    def __init__(self, obj: Any):
        object.__setattr__(self, "_as_obj", obj)

    def __setattr__(self, name: str, value: Any) -> None:
        set(self._as_obj, name, value)

    def __getattr__(self, name: str) -> _ItemTarget:
        return _ItemTarget(self._as_obj, name, ())


# --- vars(self) and self.__dict__ in a decorated method -----------------------


class InstanceDict(dict):
    """``vars(model)`` / ``model.__dict__`` as a decorated method reads it: a live
    view that reads each state's value and writes a state through its slot
    (``vars(self)["n"] = v`` is ``self.n = v``), any other name into the
    instance dict. A ``dict`` for ``isinstance``; copies are plain dicts."""

    __slots__ = ("_obj",)

    def __init__(self, obj: Any):
        super().__init__()
        self._obj = obj

    def _state(self, key: Any) -> bool:
        return type(key) is str and key in _tree.info_of(self._obj).state

    # reads: live, each state's value
    def __getitem__(self, key: Any) -> Any:
        if key in _HIDDEN_KEYS:
            raise KeyError(key)
        value = self._obj.__dict__[key]
        return value.read() if is_slot(value) else value

    def _keys(self) -> list[Any]:
        return [k for k in self._obj.__dict__ if k not in _HIDDEN_KEYS]

    def __iter__(self) -> Any:
        return iter(self._keys())

    def __reversed__(self) -> Any:
        return reversed(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

    def __contains__(self, key: object) -> bool:
        return key in self._obj.__dict__ and key not in _HIDDEN_KEYS

    # (As a mapping makes them from its reads: ``dict``'s own read the raw slots.)
    get = collections.abc.Mapping.get  # type: ignore[assignment]
    keys = collections.abc.Mapping.keys  # type: ignore[assignment]
    values = collections.abc.Mapping.values  # type: ignore[assignment]
    items = collections.abc.Mapping.items  # type: ignore[assignment]

    def copy(self) -> dict[Any, Any]:
        return {key: self[key] for key in self}

    def __eq__(self, other: object) -> bool:
        return self.copy() == other

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = None

    def __repr__(self) -> str:
        return repr(self.copy())

    def __or__(self, other: Any) -> Any:
        return self.copy() | other

    def __ror__(self, other: Any) -> Any:
        return other | self.copy()

    def __reduce__(self) -> Any:
        return (dict, (self.copy(),))  # a copy or pickle of it is a plain dict

    # writes: into the model
    def __setitem__(self, key: Any, value: Any) -> None:
        if self._state(key):
            store_state(self._obj, key, value)
        else:
            self._obj.__dict__[key] = value

    def __delitem__(self, key: Any) -> None:
        if self._state(key):
            delattr(self._obj, key)  # what `del self.n` does with a state
        else:
            del self._obj.__dict__[key]

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def __ior__(self, other: Any) -> InstanceDict:
        self.update(other)
        return self

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def pop(self, key: Any, *default: Any) -> Any:
        if key not in self and default:
            return default[0]
        value = self[key]
        del self[key]
        return value

    def popitem(self) -> tuple[Any, Any]:
        if not self:
            raise KeyError("popitem(): dictionary is empty")
        key = next(reversed(self))
        return key, self.pop(key)

    def clear(self) -> None:
        for key in list(self):
            del self[key]


# What autostate itself keeps in an instance dict (sharding annotations): not
# in plain Python's dict, so not in the view.
_HIDDEN_KEYS = frozenset({_sharding.ANNOTATIONS})


def _flatten_instance_dict(d: InstanceDict) -> tuple[list[Any], tuple[Any, ...]]:
    keys = tuple(sorted(d))  # as a dict flattens
    return [d[k] for k in keys], keys


def _unflatten_instance_dict(keys: tuple[Any, ...], values: Any) -> Any:
    return dict(zip(keys, values))  # a plain dict of the new values


jax.tree_util.register_pytree_node(InstanceDict, _flatten_instance_dict, _unflatten_instance_dict)


def vars_of(vars_fn: Any, obj: Any) -> Any:
    """``vars(obj)`` in a decorated method (``vars_fn`` is what the name reads there)."""
    if vars_fn is builtins.vars and _graph.is_stateful_instance(obj):
        return InstanceDict(obj)
    return vars_fn(obj)


def _spelled(builtin: Any, access: Callable[..., Any]) -> Callable[..., Any]:
    """``access`` where a call by name spells it, as ``builtin`` spells it: the
    name is evaluated where the method runs, so a name rebound since decoration
    is called with the arguments as written."""

    def call(fn: Any, *args: Any) -> Any:
        if fn is builtin:
            return access(*args)
        return fn(*args)

    call.__name__ = call.__qualname__ = access.__name__
    return call


# The state accesses the calls of ``analysis.NamedAccess`` become, by the
# runtime function the rewrite names (``__autostate__.spelled.set``).
spelled = types.SimpleNamespace(
    set=_spelled(builtins.setattr, _set_through_hooks),
    init=_spelled(builtins.setattr, init),
    get=_spelled(builtins.getattr, _get_through_hooks),
    store_state=_spelled(builtins.object.__setattr__, store_state),
    read_state=_spelled(builtins.object.__getattribute__, read_state),
)


def without_runtime(names: Any, scope_fn: Any, runtime_name: str) -> Any:
    """``locals()``, ``vars()`` or ``dir()`` with no argument in a decorated method
    (``names`` its result, ``scope_fn`` what the name reads there), without the
    closure variable ``runtime_name``: a frame snapshot is copied without it."""
    if scope_fn is builtins.dir:
        return [n for n in names if n != runtime_name] if runtime_name in names else names
    if scope_fn is builtins.locals or scope_fn is builtins.vars:
        if type(names) is dict and runtime_name in names:
            names = dict(names)
            del names[runtime_name]
    return names


def dict_of(obj: Any) -> Any:
    """``obj.__dict__`` read in a decorated method."""
    if _graph.is_stateful_instance(obj):
        return InstanceDict(obj)
    return obj.__dict__


def target(obj: Any) -> _Target:
    """Proxy used where a state attribute is one of several assignment targets."""
    return _Target(obj)


def assign_attribute(self: Any, name: str, value: Any) -> None:
    """``model.x = v`` for an attribute that is not state: plain Python, guarded.

    ``self.w = autostate.sharded(w, spec)`` stores ``w`` and records ``spec``.
    """
    check_guarded_write(self, name, value)
    if type(value) is StateDeclaration:
        kind = "constant" if value.marker == "constant" else "state"
        raise refused(StateAccessError(
            _declaration_used_message(
                f"{type(self).__name__}.{name} was assigned an autostate.{value.marker}(...) "
                f"declaration the decorator did not see, so it is not a {kind}.",
                type(self),
                value.marker,
            )
        ))
    if type(value) is _sharding.Annotated:
        value, spec = _sharding.split_annotation(value)
        _sharding.record(self, name, spec)
    object.__setattr__(self, name, value)


# ``model.x = v`` on a decorated class without a ``__setattr__`` of its own:
# the one write path itself, so a write from outside costs one call, as one
# from a method does (a state's write; any other attribute's through
# ``assign_attribute``).
guarded_setattr = store_state


def state_descriptor(cls: type, name: str) -> StateAttribute | None:
    """The ``StateAttribute`` ``cls`` (or a base) has for ``name``, if any."""
    for klass in cls.__mro__:
        if name in klass.__dict__:
            found = klass.__dict__[name]
            return found if type(found) is StateAttribute else None
    return None


def guard_setattr(user_setattr: Any) -> Any:
    """Wraps a class's own ``__setattr__`` with the run-time guard."""

    @functools.wraps(user_setattr)
    def __setattr__(self: Any, name: str, value: Any) -> None:
        check_guarded_write(self, name, value)
        user_setattr(self, name, value)

    __setattr__._autostate_guarded = user_setattr  # type: ignore[attr-defined]
    return __setattr__


class StateAttribute:
    """Class-level descriptor for a state attribute: code that is not rewritten
    reads and assigns ``model.x`` through ``get``/``set``, the same state."""

    __slots__ = ("name", "class_value")

    def __init__(self, name: str, class_value: Any = _MISSING):
        self.name = name
        # What the class attribute of that name was, so ``Cls.x`` still gives
        # it (``None`` included); ``_MISSING`` when there was none.
        self.class_value = class_value

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            if self.class_value is _MISSING:
                # An instance attribute read from the class: as in plain Python.
                owner_name = owner.__name__ if owner is not None else "object"
                raise AttributeError(f"type object {owner_name!r} has no attribute {self.name!r}")
            return self.class_value
        return read_state(obj, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        store_state(obj, self.name, value)

    def __delete__(self, obj: Any) -> None:
        raise refused(StateAccessError(
            format_error(
                f"Cannot delete state {self.name!r} of {type(obj).__name__}.",
                fix=f"assign a placeholder instead (`model.{self.name} = None`).",
            )
        ))


# --- class-level defaults -----------------------------------------------------

# Decorated class -> its states whose initial value is a class attribute.
_CLASS_DEFAULTS: dict[type, tuple[str, ...]] = {}


def _class_value(cls: type, name: str) -> Any:
    """What ``cls.<name>`` gives as a plain class attribute, else ``_MISSING``."""
    for k in cls.__mro__:
        if name in k.__dict__:
            value = k.__dict__[name]
            if type(value) is StateAttribute:
                return value.class_value
            return _MISSING if hasattr(type(value), "__get__") else value
    return _MISSING


def _no_arguments(self):  # noqa: ANN001, ANN202
    """The signature of a class with neither ``__init__`` nor ``__new__``."""


class ClassDefaultsNew:
    """``cls.__new__`` of a class whose states start from a class attribute: each
    new instance gets the class value in its state slot before ``__init__``, so
    ``functionalize()`` sees it; the class's own ``__new__`` still makes it."""

    def __init__(self, owner: type, original: Any):
        self.owner = owner
        self.original = original

    @property
    def __wrapped__(self) -> Any:  # what inspect.signature(cls) reads
        if self.original is not object.__new__:
            return self.original
        init = getattr(self.owner, "__init__")  # noqa: B009 - mypy refuses the attribute
        return _no_arguments if init is object.__init__ else init

    def __call__(self, cls: type, /, *args: Any, **kwargs: Any) -> Any:
        if self.original is object.__new__:
            if (args or kwargs) and getattr(cls, "__init__") is object.__init__:  # noqa: B009
                raise TypeError(f"{cls.__name__}() takes no arguments")
            obj = object.__new__(cls)
        else:
            obj = self.original(cls, *args, **kwargs)
        return fill_class_defaults(obj)


def fill_class_defaults(obj: Any) -> Any:
    """Gives a new instance the slots of its states that start from a class
    attribute (see ``ClassDefaultsNew``), those it does not hold yet."""
    names = _CLASS_DEFAULTS.get(type(obj))
    if names:
        d = obj.__dict__
        for name in names:
            if name not in d:
                value = _class_value(type(obj), name)
                if value is not _MISSING:
                    _restore_descriptor(type(obj), name)
                    d[name] = make_slot(obj, name, value)
    return obj


def install_class_defaults(cls: type, names: frozenset[str]) -> None:
    """States ``names`` of ``cls`` start from a class attribute's value.

    A static value (``training = True``) stays the class's, as in plain Python,
    until the instance assigns its own (a functionalized call may not assign
    another). Any other value is given to each new instance's state slot
    (``ClassDefaultsNew``), so the states dict has it."""
    filled = tuple(sorted(n for n in names if not is_static_value(_class_value(cls, n))))
    if not filled:
        _CLASS_DEFAULTS.pop(cls, None)
        return
    _CLASS_DEFAULTS[cls] = filled
    current = cls.__new__
    if not isinstance(current, ClassDefaultsNew):
        cls.__new__ = staticmethod(ClassDefaultsNew(cls, current))  # type: ignore[method-assign]


# --- what the rewritten code reaches through this module ---------------------------
# The rewritten code reaches the lift and the rolled loops through here:
# ``__autostate__.lifting.routed(lax.scan)(...)``, ``__autostate__.loops.over(...)``.
# They sit above this module (they call its reads and writes), so they are
# imported when the rewritten code first asks, then kept as this module's own.
_ABOVE = {"lifting": "autostate.lifting", "loops": "autostate.lifting.loops"}


if not TYPE_CHECKING:  # (mypy keeps checking every other name read from this module)

    def __getattr__(name: str) -> Any:
        module = _ABOVE.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        globals()[name] = value = importlib.import_module(module)
        return value
