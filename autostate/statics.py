"""The containers a model holds outside its states: found, compared, put back.

Inside a traced call (a jitted ``f``, a ``lax`` body) a list or dict that is
not state cannot change in place as plain Python would change it: the
change is made once per trace, and a traced value put there outlives the
trace. ``functional`` and ``control`` snapshot these containers before such
a call, and refuse (and undo) a change after it.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

from autostate import graph as _graph
from autostate import values as _values
from autostate.effects import HandledLocalStateRef


def mutable_statics(
    instances: list[Any], values: Sequence[tuple[str, Any]] = ()
) -> list[tuple[Any, Any, str]]:
    """``(container, shallow copy, "Class.attr")`` for every list, dict, set,
    deque or bytearray the model's instances hold outside their states, at
    any depth of containers, tuples and plain objects (whose ``__dict__`` is
    taken as one), and for those of the instances' classes (``shared = []``
    in a class body); and for those in ``values`` (``(label, value)``: the
    states a ``lax`` body may reach through a reference taken outside it).

    Inside a traced call such a container is a copy the call throws away
    (or, for ``f``'s own model, one a later call starts from): a change in
    place (``self.log.append(x)``) would be lost with the trace, or keep a
    tracer. ``functional`` and ``control`` refuse it; a refused call puts the old
    contents back.
    """
    saved: list[tuple[Any, Any, str]] = []
    seen: set[int] = set()  # shared by the walks from every root: a container is saved once

    def visit(value: Any, where: str) -> None:
        walk = _graph.iter_tree(
            value, _values.is_mutable, into_targets=True, children=_held_outside_states, seen=seen
        )
        for _, c in walk:
            saved.append((c, _values.kind_of(c).copy(c), where))  # type: ignore[misc]

    classes: dict[type, None] = {}
    for obj in instances:
        cls = type(obj)
        classes[cls] = None
        for name, value in obj.__dict__.items():
            if _may_hold_containers(value):  # (most attributes: no walk)
                visit(value, f"{cls.__name__}.{name}")
    for cls in classes:
        for klass in cls.__mro__[:-1]:
            for name, value in list(vars(klass).items()):
                if _values.is_mutable(value) and not name.startswith("__"):
                    visit(value, f"{klass.__name__}.{name}")
    for label, value in values:
        if _may_hold_containers(value):
            visit(value, label)
    return saved


def _may_hold_containers(value: Any) -> bool:
    """Not a leaf, a slot, or a decorated instance (visited as one of the instances)."""
    t, kind = type(value), _values.kind_of(value)
    return not (kind.atom or kind.array or t in _graph.STATEFUL_CLASSES or t is HandledLocalStateRef)


def _held_outside_states(value: Any) -> list[tuple[str, Any]]:
    """The step of ``mutable_statics``'s walk: a container's items (a set's or
    bytearray's aside), a tuple's, a plain object's ``__dict__`` (a dict)."""
    kind = _values.kind_of(value)
    if kind is _values.SET or kind is _values.BYTEARRAY:
        return []
    if kind.mutable or kind is _values.TUPLE:
        items = value.values() if isinstance(value, dict) else value
        return [("", item) for item in items if _may_hold_containers(item)]
    d = _graph.plain_attributes(value)
    return [] if d is None else [("", d)]


def same_contents(value: Any, contents: Any) -> bool:
    """Whether a container holds exactly what its copy held (by identity: a
    value may be a tracer, whose ``==`` would be traced)."""
    if isinstance(value, dict):
        return list(value) == list(contents) and all(
            map(operator.is_, value.values(), contents.values())
        )
    if isinstance(value, (set, bytearray)):
        return bool(value == contents)
    return len(value) == len(contents) and all(map(operator.is_, value, contents))


def restore(saved: Any) -> None:
    """Puts back the contents of every container of ``saved`` (``mutable_statics``) that changed."""
    for value, contents, _where in saved:
        if same_contents(value, contents):
            continue
        if isinstance(value, (list, bytearray)):
            value[:] = contents
        elif isinstance(value, dict):
            dict.clear(value)
            dict.update(value, contents)
        elif isinstance(value, set):
            value.clear()
            value.update(contents)
        else:  # a deque
            value.clear()
            value.extend(contents)
