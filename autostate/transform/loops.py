"""Loop rolling, the rewrite: a ``for`` loop's body also as a function.

A decorated method's ``for`` statement is compiled so that, when what it
iterates is a stack of layers and a JAX trace is running, the runtime
(``lifting.loops``) can run the body as one ``lax.scan`` instead of once
per layer. The loop stays exactly as written; in front of it the rewrite
adds its body as a function of the locals it carries, and a call of
``loops.over`` that decides (``docs/rewrite_rules.md`` section 9 prints the
generated code). Both copies of the body keep the user's line numbers; what
is added takes the line of the ``for``. A loop whose meaning such a function
cannot carry (``break``, ``return``, ``yield``, ``global``, a nested
``def``, ...) keeps its iterable wrapped in ``loops.unrolled(..., reason)``,
so that a stack made with ``require_scan=True`` can say why.

Which locals are carried and why a loop cannot roll are facts of the source
analysis (``loop_facts``); this module only fills the template below. It
works on the ``ast`` of the wrapper source the state rewrite produced, since
only a tree lets both copies keep the user's lines; the rewrite keeps every
``for`` statement, so the analysis's loops and the tree's match in order.
"""

from __future__ import annotations

import ast
import copy
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autostate.transform.loop_facts import LoopFacts

# Calls whose arguments the runtime looks into (``enumerate(self.blocks)``):
# they are deferred, so the runtime sees the stack rather than an iterator.
_DEFERRED = frozenset({"enumerate", "zip", "reversed"})
_PREFIX = "__autostate_"


def roll_loops(
    tree: ast.Module, method_name: str, runtime: str, loops: Sequence[LoopFacts],
    state: frozenset[str],
) -> bool:
    """Adds the rolled form to each ``for`` loop of the method ``method_name``
    in ``tree`` (a wrapper module: ``class C: def outer(): def method``), as
    ``loops`` (the analysis's facts of its ``for`` statements, in source
    order) say, in a class whose states are ``state``; whether any was changed."""
    method = _find_method(tree, method_name)
    if method is None:
        return False
    found = sorted(_for_statements(method.body), key=lambda n: (n.lineno, n.col_offset))
    if len(found) != len(loops):
        return False  # (not the statements analysed: every loop runs as written)
    roller = _Roller(runtime, {id(n): f for n, f in zip(found, loops)}, state)
    roller.statements(method.body)
    return roller.changed


def _find_method(tree: ast.Module, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    wrapper = tree.body[-1] if tree.body else None
    if not isinstance(wrapper, ast.ClassDef) or not wrapper.body:
        return None
    outer = wrapper.body[0]
    if not isinstance(outer, ast.FunctionDef):
        return None
    for node in reversed(outer.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    return None


_BLOCKS = ("body", "orelse", "finalbody", "handlers", "cases")


def _for_statements(statements: list[Any]) -> Iterator[ast.For]:
    """The ``for`` statements among ``statements`` and the blocks under them
    (functions' bodies included, class bodies not), as ``loop_facts.loop_facts``
    lists them."""
    for node in statements:
        if isinstance(node, ast.ClassDef):
            continue
        if isinstance(node, ast.For):
            yield node
        for field in _BLOCKS:
            inner = getattr(node, field, None)
            if isinstance(inner, list):
                yield from _for_statements(inner)


class _Roller:
    """Walks one method, innermost loops first, adding each loop's rolled form."""

    def __init__(self, runtime: str, facts: dict[int, LoopFacts], state: frozenset[str]):
        self.runtime = runtime
        self.facts = facts
        self.state = state
        self.count = 0
        self.changed = False

    def statements(self, statements: list[Any]) -> None:
        i = 0
        while i < len(statements):
            node = statements[i]
            if not isinstance(node, ast.ClassDef):
                for field in _BLOCKS:
                    inner = getattr(node, field, None)
                    if isinstance(inner, list):
                        self.statements(inner)
            facts = self.facts.get(id(node)) if isinstance(node, ast.For) else None
            if facts is not None and facts.may_roll:
                replacement = self._rolled(node, facts)
                statements[i : i + 1] = replacement
                i += len(replacement)
                self.changed = True
                continue
            i += 1

    def _runtime(self, attr: str) -> ast.expr:
        return ast.Attribute(
            ast.Attribute(ast.Name(self.runtime, ast.Load()), "loops", ast.Load()), attr, ast.Load()
        )

    def _deferred(self, expr: ast.expr) -> ast.expr:
        """``enumerate(a)`` as ``loops.Deferred(enumerate, (a,), {})``, inner calls too."""
        if not (
            isinstance(expr, ast.Call)
            and isinstance(expr.func, ast.Name)
            and expr.func.id in _DEFERRED
            and not any(isinstance(a, ast.Starred) for a in expr.args)
            and all(k.arg is not None for k in expr.keywords)
        ):
            return expr
        return ast.Call(
            self._runtime("Deferred"),
            [
                expr.func,
                ast.Tuple([self._deferred(a) for a in expr.args], ast.Load()),
                ast.Dict([ast.Constant(k.arg) for k in expr.keywords],
                         [k.value for k in expr.keywords]),
            ],
            [],
        )

    def _rolled(self, loop: ast.For, facts: LoopFacts) -> list[ast.stmt]:
        reason = facts.why_not(self.state)
        source = self._deferred(loop.iter)
        if reason is not None:
            loop.iter = ast.Call(self._runtime("unrolled"), [source, ast.Constant(reason)], [])
            _locate(loop.iter, loop)
            return [loop]
        self.count += 1
        needed = list(facts.carried)
        text = _rolled_form(
            self.count, self.runtime, needed, facts.read_first, ast.unparse(loop.target),
            facts.wants_last,
        )
        added = ast.parse(text).body
        _locate(source, loop)
        for node in added:
            _locate(node, loop, every=True)
        filled = [_Filled(loop.body, source).visit(node) for node in added]
        loop.iter = ast.Name(f"{_PREFIX}it_{self.count}", ast.Load())
        _locate(loop.iter, loop)
        return [*filled, loop]


# Where the rolled form's text holds the loop's body and its iterable.
_BODY, _SOURCE = f"{_PREFIX}body__", f"{_PREFIX}source__"


class _Filled(ast.NodeTransformer):
    """The rolled form with its placeholders replaced: a copy of the loop's
    body, its iterable (each keeping the user's own lines)."""

    def __init__(self, body: list[ast.stmt], source: ast.expr):
        self.body, self.source = body, source

    def visit_Expr(self, node: ast.Expr) -> Any:
        if isinstance(node.value, ast.Name) and node.value.id == _BODY:
            return copy.deepcopy(self.body)
        return self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> ast.expr:
        return self.source if node.id == _SOURCE else node


def _rolled_form(
    n: int, runtime: str, needed: list[str], read: frozenset[str], target: str, wants_last: bool
) -> str:
    """The statements added in front of loop ``n``, as text: ``needed`` are the
    locals it hands to its body function and takes back (``read``: those the
    body may read first), ``target`` its loop variable (names only)."""
    loops = f"{runtime}.loops"
    temps = [f"{_PREFIX}v{n}_{k}" for k in range(len(needed))]

    def grab(indent: str) -> str:  # each local's value, or UNBOUND
        return "".join(
            f"{indent}try:\n{indent}    {t} = {v}\n"
            f"{indent}except NameError:\n{indent}    {t} = {loops}.UNBOUND\n"
            for t, v in zip(temps, needed)
        )

    values = "".join(f"{v}, " for v in needed)
    unbind = "".join(f"    if {v} is {loops}.UNBOUND:\n        del {v}\n" for v in needed)
    land = "".join(
        f"        if {_PREFIX}r_{n}[0][{k}] is not {loops}.UNBOUND:\n"
        f"            {v} = {_PREFIX}r_{n}[0][{k}]\n"
        for k, v in enumerate(needed)
    )
    last = f"        {target} = {_PREFIX}r_{n}[1]\n" if wants_last else ""
    arguments = ", ".join([
        f"{_PREFIX}body_{n}",
        f"({''.join(f'{t}, ' for t in temps)})",
        repr(tuple(needed)),
        repr(tuple(v in read for v in needed)),
        repr(wants_last),
    ])
    return (
        f"def {_PREFIX}body_{n}({_PREFIX}item, {_PREFIX}values):\n"
        + (f"    ({values}) = {_PREFIX}values\n" if needed else "")
        + unbind
        + f"    {target} = {_PREFIX}item\n"
        + f"    {_BODY}\n"
        + grab("    ")
        + f"    return ({''.join(f'{t}, ' for t in temps)})\n"
        + f"{_PREFIX}it_{n} = {loops}.over({_SOURCE})\n"
        + f"if {_PREFIX}it_{n}.__class__ is {loops}.Rolling:\n"  # (no builtin: `type` may be a local)
        + grab("    ")
        + f"    {_PREFIX}r_{n} = {_PREFIX}it_{n}.run({arguments})\n"
        + f"    if {_PREFIX}r_{n} is None:\n"
        + f"        {_PREFIX}it_{n} = {_PREFIX}it_{n}.plain()\n"
        + "    else:\n"
        + land
        + last
        + f"        {_PREFIX}it_{n} = ()\n"
    )


def _locate(node: ast.AST, at: ast.AST, every: bool = False) -> None:
    """Gives the nodes added under ``node`` the location of ``at`` (the loop's
    ``for``); those copied from the user's code keep their own (``every``:
    all nodes under ``node`` are added ones)."""
    line, col = getattr(at, "lineno", 1), getattr(at, "col_offset", 0)
    for part in ast.walk(node):
        if "lineno" in part._attributes and (every or getattr(part, "lineno", None) is None):
            for attr, value in (("lineno", line), ("col_offset", col),
                                ("end_lineno", line), ("end_col_offset", col)):
                setattr(part, attr, value)
