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
    seen: set[int] = set()
    stateful, kind_of = _graph.STATEFUL_CLASSES, _values.kind_of

    def visit(value: Any, where: str, depth: int) -> None:
        t = type(value)
        kind = kind_of(value)
        if kind.atom or kind.array or t in stateful or t is HandledLocalStateRef:
            # No containers in it: a leaf, a slot, or a decorated instance
            # (visited on its own, as one of ``instances``).
            return
        if depth > 16 or id(value) in seen:
            return
        if kind.mutable:
            seen.add(id(value))
            saved.append((value, kind.copy(value), where))  # type: ignore[misc]
            if kind is _values.DICT or kind is _values.DICT_SUBCLASS:
                for item in value.values():
                    visit(item, where, depth + 1)
            elif kind is not _values.SET and kind is not _values.BYTEARRAY:
                for item in value:
                    visit(item, where, depth + 1)
        elif kind is _values.TUPLE:
            for item in value:
                visit(item, where, depth + 1)
        elif (d := _graph.plain_attributes(value)) is not None:
            seen.add(id(value))
            saved.append((d, d.copy(), where))
            for item in d.values():
                visit(item, where, depth + 1)

    classes: dict[type, None] = {}
    for obj in instances:
        cls = type(obj)
        classes[cls] = None
        for name, value in obj.__dict__.items():
            visit(value, f"{cls.__name__}.{name}", 0)
    for cls in classes:
        for klass in cls.__mro__[:-1]:
            for name, value in list(vars(klass).items()):
                if _values.is_mutable(value) and not name.startswith("__"):
                    visit(value, f"{klass.__name__}.{name}", 0)
    for label, value in values:
        visit(value, label, 0)
    return saved


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
