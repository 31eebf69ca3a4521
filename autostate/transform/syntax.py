"""Questions about the syntax of one expression or target, asked by the
analysis (``analysis.py``), the loop facts and the rewrite alike: what a
name is as Python binds it, the dotted name an expression spells, the names
a target binds, and the subscripts of an item (``self.x[i][j]``)."""

from __future__ import annotations

import unicodedata

import libcst as cst


def identifier(name: str) -> str:
    """``name`` as Python binds it: identifiers are NFKC-normalized (PEP 3131)."""
    return name if name.isascii() else unicodedata.normalize("NFKC", name)



def dotted_name(expr: cst.BaseExpression) -> str | None:
    """``a.b.c`` for a chain of names, else None."""
    if isinstance(expr, cst.Name):
        return expr.value
    if isinstance(expr, cst.Attribute):
        head = dotted_name(expr.value)
        return f"{head}.{expr.attr.value}" if head else None
    return None



def name_nodes(target: cst.CSTNode) -> list[cst.Name]:
    """The names an assignment target binds (``a``, ``a, *b``; not ``a.x`` or ``a[i]``)."""
    if isinstance(target, cst.Name):
        return [target]
    if isinstance(target, (cst.Tuple, cst.List)):
        return [n for e in target.elements for n in name_nodes(e.value)]
    if isinstance(target, cst.StarredElement):
        return name_nodes(target.value)
    return []



def subscript_base(expr: cst.BaseExpression) -> cst.BaseExpression:
    while isinstance(expr, cst.Subscript):
        expr = expr.value
    return expr



def subscripts(expr: cst.BaseExpression) -> tuple[cst.SubscriptElement, ...] | None:
    """The subscripts of ``self.x[i][j]`` from the attribute on (``[i], [j]``),
    ``()`` for a dotted name; None for anything else (a call's view)."""
    items: list[cst.SubscriptElement] = []
    while isinstance(expr, cst.Subscript):
        items[:0] = expr.slice
        expr = expr.value
    return tuple(items) if dotted_name(expr) is not None else None



def literal_index(element: cst.SubscriptElement) -> bool:
    index = element.slice
    return isinstance(index, cst.Index) and isinstance(
        index.value, cst.Integer | cst.SimpleString | cst.Float
    )


def reaches_within(
    alias: tuple[cst.SubscriptElement, ...] | None,
    assigned: tuple[cst.SubscriptElement, ...] | None,
) -> bool:
    """Whether an item assignment at ``assigned`` may change, in place, the
    container an alias at ``alias`` is bound to: one it reaches through it
    (subscripts that may be the same; two different literals are not)."""
    if alias is None or assigned is None or len(alias) >= len(assigned):
        return False
    return all(
        a.deep_equals(b) or not (literal_index(a) and literal_index(b)) for a, b in zip(alias, assigned)
    )


def unpacked(
    target: cst.BaseExpression, value: cst.BaseExpression
) -> list[tuple[cst.Name, cst.BaseExpression | None]]:
    """The names ``target = value`` binds, each with the expression it is
    given where the source spells one (``m, n = self.x, 1``), else ``value``."""
    sequences = (cst.Tuple, cst.List)
    if (
        isinstance(target, sequences) and isinstance(value, sequences)
        and len(target.elements) == len(value.elements)
        and not any(isinstance(e, cst.StarredElement | cst.StarredDictElement)
                    for e in (*target.elements, *value.elements))
    ):
        return [p for t, v in zip(target.elements, value.elements) for p in unpacked(t.value, v.value)]
    return [(name, value) for name in name_nodes(target)]
