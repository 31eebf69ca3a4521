"""Walks over libcst trees that skip libcst's own visiting machinery.

``node.visit(visitor)`` rebuilds every node of the tree (a dataclass
``__init__`` with validation per node) even when the visitor only reads,
and a transformer's walk rebuilds the nodes it did not change. Both were
most of a cold decoration. ``visit`` here only reads; ``transform`` rebuilds
a node only when one of its children changed, and otherwise returns the very
node it was given. Both call a visitor's ``visit_<Node>`` and
``leave_<Node>`` methods as libcst does (``visit_<Node>`` returning ``False``
skips the children), children in source order, and never descend into
whitespace, comments or operator tokens, which neither of the package's
visitors reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import libcst as cst
from libcst._nodes import op as _op

_TOKENS: tuple[type, ...] = (
    cst.BaseParenthesizableWhitespace, cst.EmptyLine, cst.TrailingWhitespace, cst.Newline,
    cst.Comment, cst.LeftParen, cst.RightParen, cst.LeftSquareBracket, cst.RightSquareBracket,
    cst.LeftCurlyBrace, cst.RightCurlyBrace,
    *(
        t for t in vars(_op).values()
        if isinstance(t, type) and issubclass(t, cst.CSTNode) and t.__module__ == _op.__name__
    ),
)

# Fields whose source comes before the ones listed ahead of them.
_SOURCE_ORDER: dict[type, tuple[str, ...]] = {
    cst.IfExp: ("body", "test", "orelse"),
    cst.FunctionDef: ("decorators", "name", "params", "returns"),
    cst.ClassDef: ("decorators",),
    cst.DictComp: ("key", "value", "for_in"),
}

_FIELDS: dict[type, tuple[str, ...]] = {}


def _fields(t: type) -> tuple[str, ...]:
    """The fields of node type ``t`` that may hold nodes a visitor reads."""
    names = _FIELDS.get(t)
    if names is None:
        every = [f.name for f in dataclasses.fields(t)]
        first = [n for n in _SOURCE_ORDER.get(t, ()) if n in every]
        names = _FIELDS[t] = (*first, *(n for n in every if n not in first))
    return names


# type -> whether a value of it is a node to walk into (a cache: libcst's base
# classes are ABCs, and isinstance against them was most of a walk).
_WALKED: dict[type, bool] = {}


def _is_node(value: Any) -> bool:
    t = type(value)
    walked = _WALKED.get(t)
    if walked is None:
        walked = _WALKED[t] = issubclass(t, cst.CSTNode) and not issubclass(t, _TOKENS)
    return walked


_Hooks = tuple[Callable[..., Any] | None, Callable[..., Any] | None]
_HOOKS: dict[tuple[type, type], _Hooks] = {}


def _hooks(visitor: Any, t: type) -> _Hooks:
    key = (type(visitor), t)
    hooks = _HOOKS.get(key)
    if hooks is None:
        hooks = _HOOKS[key] = (
            _own(type(visitor), f"visit_{t.__name__}"),
            _own(type(visitor), f"leave_{t.__name__}"),
        )
    return hooks


def _own(cls: type, name: str) -> Callable[..., Any] | None:
    """``cls``'s method ``name``, unless it is libcst's default (which does nothing)."""
    method = getattr(cls, name, None)
    for base in (cst.CSTVisitor, cst.CSTTransformer):
        if method is not None and method is getattr(base, name, None):
            return None
    return method


def children(node: cst.CSTNode) -> Iterator[cst.CSTNode]:
    """The child nodes ``visit`` walks into, in source order."""
    for name in _fields(type(node)):
        value = getattr(node, name)
        if isinstance(value, (tuple, list)):
            yield from (item for item in value if _is_node(item))
        elif _is_node(value):
            yield value


def visit(node: cst.CSTNode, visitor: cst.CSTVisitor) -> None:
    """``node.visit(visitor)`` for a visitor that only reads."""
    enter, leave = _hooks(visitor, type(node))
    if enter is None or enter(visitor, node) is not False:
        for name in _fields(type(node)):
            value = getattr(node, name)
            if isinstance(value, (tuple, list)):
                for item in value:
                    if _is_node(item):
                        visit(item, visitor)
            elif _is_node(value):
                visit(value, visitor)
    if leave is not None:
        leave(visitor, node)


def transform(node: cst.CSTNode, transformer: cst.CSTTransformer) -> Any:
    """``node.visit(transformer)``, rebuilding only the nodes that change."""
    enter, leave = _hooks(transformer, type(node))
    updated = node
    if enter is None or enter(transformer, node) is not False:
        changes: dict[str, Any] = {}
        for name in _fields(type(node)):
            value = getattr(node, name)
            if isinstance(value, (tuple, list)):
                items = _transform_sequence(value, transformer)
                if items is not None:
                    changes[name] = items
            elif _is_node(value):
                new = transform(value, transformer)
                if new is not value:
                    changes[name] = new
        if changes:
            updated = node.with_changes(**changes)
    return leave(transformer, node, updated) if leave is not None else updated


def _transform_sequence(values: Any, transformer: cst.CSTTransformer) -> list[Any] | None:
    """The transformed items, or ``None`` when every item came back unchanged."""
    out: list[Any] = []
    changed = False
    for item in values:
        if not _is_node(item):
            out.append(item)
            continue
        new = transform(item, transformer)
        if new is item:
            out.append(item)
            continue
        changed = True
        if isinstance(new, cst.FlattenSentinel):
            out.extend(new.nodes)
        elif not isinstance(new, cst.RemovalSentinel):
            out.append(new)
    return out if changed else None
