"""``copy.copy`` and ``copy.deepcopy`` of a decorated instance.

A copy is another model, as in plain Python: its states are its own. A copy
made inside a functionalized call holds the running state's value in a
``DetachedState`` instead of sharing the original's handler cell, and an
eager copy gets its own requests (an eager write changes a request nothing
else holds in place). A host-fallback model's copy gets its own host store,
holding the values (``HostSlot``s of one instance share one store, so one
memo copies it once). A class's own copy protocol (``__reduce__``,
``__getstate__``/``__setstate__``, a ``copyreg`` entry) is followed, its
states then detached the same way. ``api`` installs ``copy_instance`` and
``deepcopy_instance`` as a decorated class's ``__copy__``/``__deepcopy__``.
"""

from __future__ import annotations

import copy as _copy
import copyreg
from typing import Any

from autostate import graph as _graph
from autostate.effects.local_state import (
    DetachedState,
    FrozenLocalStateRequest,
    HandledLocalStateRef,
    is_running,
)
from autostate.host import HostSlot

__all__ = ["DetachedState", "copy_instance", "deepcopy_instance"]


def _detached(value: Any, memo: dict[int, Any] | None = None) -> Any:
    """A running call's state (or a copy's) as a state of the copy's own; with
    a deep copy's ``memo``, what it holds is copied too, as Python's deepcopy
    copies an attribute's list (a list the copy changed was the call's)."""
    value = _graph.materialized(value)  # (a value a compiled call left packed: made)
    if type(value) is HandledLocalStateRef and is_running(value.handler_id):
        detached = value.detached()
    elif type(value) is DetachedState:
        detached = DetachedState(value.value, value.category, value.name)
    else:
        return value
    if memo is not None:
        detached.value = _copy.deepcopy(detached.value, memo)
    return detached


def _own_slot(value: Any, memo: dict[int, Any]) -> Any:
    """``_detached`` for a shallow copy, whose requests are its own too: an eager
    write changes a request nothing else holds in place (``_SOLE_HOLDER``), and
    a host state is written into a store of the copy's own (one per ``memo``)."""
    value = _graph.materialized(value)
    if type(value) is FrozenLocalStateRequest:
        return value.replaced(value.state)
    if type(value) is HostSlot:
        return _copy.deepcopy(value, memo)
    return _detached(value)


_REDUCTION_METHODS = ("__reduce_ex__", "__reduce__", "__getstate__", "__setstate__")


def _user_reduction(obj: Any) -> tuple | str | None:
    """What ``copy`` would reduce ``obj`` to when its class customises that
    (``__reduce__``, ``__getstate__``/``__setstate__``, a ``copyreg`` entry);
    ``None`` for the default, which copies ``__dict__``."""
    cls = type(obj)
    reductor = copyreg.dispatch_table.get(cls)
    if reductor is not None:
        return reductor(obj)
    if all(getattr(cls, m, None) is getattr(object, m, None) for m in _REDUCTION_METHODS):
        return None
    return obj.__reduce_ex__(4)


def _copy_by_protocol(obj: Any, reduction: tuple | str, memo: dict[int, Any] | None) -> Any:
    """``copy`` of ``obj`` through its class's own reduction (deep with a
    ``memo``), its running states then detached, as the default copy does."""
    if isinstance(reduction, str):
        return obj  # a global: copy returns the object itself
    new = _copy._reconstruct(obj, memo, *reduction)  # type: ignore[attr-defined]
    d = new.__dict__
    stores: dict[int, Any] = {}
    for k, v in list(d.items()):
        detached = _own_slot(v, stores) if memo is None else _detached(v)
        if detached is not v:
            d[k] = detached
    return new


def copy_instance(self: Any) -> Any:
    """``copy.copy`` of a decorated instance: its states are its own; a class's
    own copy protocol is followed, as ``copy`` would."""
    reduction = _user_reduction(self)
    if reduction is not None:
        return _copy_by_protocol(self, reduction, None)
    cls = type(self)
    new = cls.__new__(cls)  # type: ignore[call-overload]
    stores: dict[int, Any] = {}
    new.__dict__.update({k: _own_slot(v, stores) for k, v in self.__dict__.items()})
    return new


def deepcopy_instance(self: Any, memo: dict[int, Any]) -> Any:
    """``copy.deepcopy`` of a decorated instance: its states are its own
    (following the class's own copy protocol, as ``copy_instance`` does)."""
    reduction = _user_reduction(self)
    if reduction is not None:
        return _copy_by_protocol(self, reduction, memo)
    cls = type(self)
    new = cls.__new__(cls)  # type: ignore[call-overload]
    memo[id(self)] = new
    d = new.__dict__
    for k, v in self.__dict__.items():
        v = _graph.materialized(v)
        detached = _detached(v, memo)
        d[k] = detached if detached is not v else _copy.deepcopy(v, memo)
    return new
