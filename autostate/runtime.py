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

import operator
from typing import Any

import numpy as np

# Rewritten calls of jax.lax control flow read ``__autostate__.control.scan(...)``.
from autostate import control  # noqa: F401
from autostate import tree as _tree
from autostate.effects import (
    HandledLocalStateRef,
    InitialLocalStateRequest,
    InitialValue,
    StateSlot,
)
from autostate.effects.local_state import _check_not_traced, handler_running
from autostate.errors import InvalidTypeError, StateAccessError, format_error

_MISSING = object()
# type -> whether it is a StateSlot; a cache of issubclass, not a registry.
_IS_SLOT: dict[type, bool] = {}


def is_slot(value: Any) -> bool:
    """Whether ``value`` is a slot (of any engine) rather than a plain value."""
    t = type(value)
    known = _IS_SLOT.get(t)
    if known is None:
        known = _IS_SLOT[t] = issubclass(t, StateSlot)
    return known


class StateDeclaration:
    """What ``autostate.state(value, category=..., name=...)`` returns."""

    __slots__ = ("value", "category", "name")

    def __init__(self, value: Any, category: Any, name: str | None):
        self.value = value
        self.category = category
        self.name = name

    def __repr__(self) -> str:
        return f"state({self.value!r}, category={self.category!r}, name={self.name!r})"


def make_slot(obj: Any, name: str, value: Any) -> Any:
    """The eager slot for a state first assigned ``value`` (a declaration or a value)."""
    info = _tree.info_of(obj)
    category, explicit = info.category, None
    if isinstance(value, StateDeclaration):
        if value.category is not None:
            category = value.category
        explicit = value.name
        value = value.value
    _check_not_traced(value, explicit or name)
    if info.slot_factory is not None:
        return info.slot_factory(obj, name, value, category, explicit)
    return InitialLocalStateRequest(InitialValue(value), category, explicit)


def get(obj: Any, name: str) -> Any:
    """Current value of state ``name`` of ``obj``."""
    try:
        slot = obj.__dict__[name]
    except KeyError:
        raise StateAccessError(
            format_error(
                f"{type(obj).__name__!r} object has no state {name!r} yet.",
                fix=f"assign `self.{name}` in __init__ before reading it.",
            )
        ) from None
    if is_slot(slot):
        return slot.read()
    return slot


def set(obj: Any, name: str, value: Any) -> None:  # noqa: A001 - generated code reads well
    """Sets state ``name`` of ``obj`` (in place eagerly, in the handler's cell when handled)."""
    d = obj.__dict__
    slot = d.get(name, _MISSING)
    # is_slot inlined: this is the whole of an eager write besides the slot's.
    known = _IS_SLOT.get(type(slot))
    if known or (known is None and is_slot(slot)):
        replacement = slot.write(value, name)
        if replacement is not None:
            d[name] = replacement
    else:
        d[name] = make_slot(obj, name, value)


def init(obj: Any, name: str, value: Any) -> None:
    """``self.x = v`` in ``__init__``: a fresh initial-state request holding ``v``."""
    slot = obj.__dict__.get(name, _MISSING)
    if is_slot(slot) and not isinstance(slot, InitialLocalStateRequest):
        # __init__ called again on a functionalized or frozen model: a write.
        set(obj, name, value.value if isinstance(value, StateDeclaration) else value)
        return
    obj.__dict__[name] = make_slot(obj, name, value)


class _Indexer:
    """``ix[a, 1:2]`` returns the key Python would pass to ``__setitem__``."""

    __slots__ = ()

    def __getitem__(self, key: Any) -> Any:
        return key


ix = _Indexer()


def _updated(container: Any, key: Any, value: Any) -> Any:
    """A copy of ``container`` with ``container[key] = value``; arrays via ``.at``."""
    at = getattr(container, "at", None)
    if at is not None and not isinstance(container, np.ndarray):
        return at[key].set(value)
    if isinstance(container, np.ndarray):
        out = container.copy()
        out[key] = value
        return out
    if isinstance(container, dict):
        out = dict(container)
        out[key] = value
        return out
    if isinstance(container, list):
        out = list(container)
        out[key] = value
        return out
    if isinstance(container, tuple):
        items = list(container)
        items[key] = value
        return type(container)(*items) if hasattr(container, "_fields") else tuple(items)
    raise InvalidTypeError(
        format_error(
            f"Cannot assign an item of a state of type {type(container).__name__}.",
            fix="keep arrays, dicts, lists or tuples in state, or assign the whole value.",
        )
    )


def _set_path(container: Any, keys: tuple, value: Any) -> Any:
    if len(keys) == 1:
        return _updated(container, keys[0], value)
    return _updated(container, keys[0], _set_path(container[keys[0]], keys[1:], value))


def setitem(obj: Any, name: str, value: Any, *keys: Any) -> None:
    """``self.x[k1][k2] = value`` as a functional update of state ``x``."""
    set(obj, name, _set_path(get(obj, name), keys, value))


_OPERATORS = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "/": operator.truediv,
    "//": operator.floordiv,
    "%": operator.mod,
    "**": operator.pow,
    "@": operator.matmul,
    "<<": operator.lshift,
    ">>": operator.rshift,
    "&": operator.and_,
    "|": operator.or_,
    "^": operator.xor,
}
# The scatter each operator maps to on jax arrays (others read, combine, set).
_AT_METHODS = {"+": "add", "*": "multiply", "/": "divide", "**": "power"}


def augitem(obj: Any, name: str, op: str, value: Any, *keys: Any) -> None:
    """``self.x[k] op= value`` as a functional update of state ``x``."""
    current = get(obj, name)
    container = current
    for key in keys[:-1]:
        container = container[key]
    at = getattr(container, "at", None)
    method = _AT_METHODS.get(op)
    if at is not None and method is not None and not isinstance(container, np.ndarray):
        updated = getattr(at[keys[-1]], method)(value)
        new = updated if len(keys) == 1 else _set_path(current, keys[:-1], updated)
    else:
        new = _set_path(current, keys, _OPERATORS[op](container[keys[-1]], value))
    set(obj, name, new)


def delitem(obj: Any, name: str, *keys: Any) -> None:
    """``del self.x[k]`` on dict or list state, as a functional update."""
    current = get(obj, name)
    parent = current
    for key in keys[:-1]:
        parent = parent[key]
    if isinstance(parent, dict):
        shrunk: Any = {k: v for k, v in parent.items() if k != keys[-1]}
    elif isinstance(parent, list):
        shrunk = list(parent)
        del shrunk[keys[-1]]
    else:
        raise InvalidTypeError(
            format_error(
                f"Cannot delete an item of state {name!r} of type {type(parent).__name__}.",
                fix="only dict and list state support `del self.x[key]`.",
            )
        )
    set(obj, name, shrunk if len(keys) == 1 else _set_path(current, keys[:-1], shrunk))


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


def target(obj: Any) -> _Target:
    """Proxy used where a state attribute is one of several assignment targets."""
    return _Target(obj)


def guarded_setattr(self: Any, name: str, value: Any) -> None:
    """``model.x = v`` for an attribute that is not state.

    Plain Python, except inside a functionalized call on a model whose states
    are handled: there such a write would land on a copy that the pure
    function throws away (or keep a tracer), so it is refused with the fix.
    """
    if type(type(self).__dict__.get(name)) is StateAttribute:
        # What the descriptor's __set__ does, without the guard and the
        # descriptor call: a third of an eager write from outside the class.
        set(self, name, value)
        return
    if (
        handler_running()
        and name not in _tree.info_of(self).state
        and not hasattr(type(getattr(type(self), name, None)), "__set__")  # a property
        and any(type(v) is HandledLocalStateRef for v in self.__dict__.values())
    ):
        raise StateAccessError(
            format_error(
                f"{type(self).__name__}.{name} is not state, so assigning it inside a "
                "functionalized call would be lost when the call returns.",
                fix=f"make it state: assign `self.{name}` in a method of the class, or declare "
                f"it in __init__ with `self.{name} = autostate.state(...)`.",
            )
        )
    object.__setattr__(self, name, value)


class StateAttribute:
    """Class-level descriptor for a state attribute.

    Code that is not rewritten (a training loop, a helper function, an
    undecorated base class) reads and assigns ``model.x`` like plain Python;
    the descriptor routes it through ``get``/``set`` so it sees and changes
    the same state the rewritten methods do, eagerly or functionalized.
    """

    __slots__ = ("name", "class_value")

    def __init__(self, name: str, class_value: Any = None):
        self.name = name
        # What the class attribute of that name was, so ``Cls.x`` still gives it.
        self.class_value = class_value

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self if self.class_value is None else self.class_value
        return get(obj, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        set(obj, self.name, value)

    def __delete__(self, obj: Any) -> None:
        raise StateAccessError(
            format_error(
                f"Cannot delete state {self.name!r} of {type(obj).__name__}.",
                fix=f"assign a placeholder instead (`model.{self.name} = None`).",
            )
        )
