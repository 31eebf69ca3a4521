"""Loop rolling, the rewrite: a ``for`` loop's body also as a function.

A decorated method's ``for`` statement is compiled so that, when what it
iterates is a stack of layers and a JAX trace is running, the runtime
(``autostate.loops``) can run the body as one ``lax.scan`` instead of once
per layer. The loop stays in the code exactly as written; in front of it
the rewrite adds its body as a function of the locals it carries (in
short; ``docs/rewrite_rules.md`` section 9 prints the exact code)::

    def __autostate_body_1(__autostate_item, __autostate_values):
        (x, h) = __autostate_values
        if h is UNBOUND: del h                # a local the loop found unbound
        block = __autostate_item
        x = block(x)                          # the body, as written
        h = x.mean()
        return (x, h)                         # each, or UNBOUND
    __autostate_it_1 = loops.over(self.blocks)
    if __autostate_it_1.__class__ is loops.Rolling:
        __autostate_r_1 = __autostate_it_1.run(
            __autostate_body_1, (x, h), ("x", "h"), (True, False), False
        )                                     # (values, names, read in the body?, last item?)
        if __autostate_r_1 is None:           # it could not roll: the plain loop
            __autostate_it_1 = __autostate_it_1.plain()
        else:
            (x, h) = __autostate_r_1[0]       # those the scan left bound
            __autostate_it_1 = ()
    for block in __autostate_it_1:            # the loop as written
        x = block(x)
        h = x.mean()

Outside a trace, or over anything but a stack, ``over`` gives the iterable
itself and the plain loop runs. Both copies of the body keep the user's
line numbers; what is added takes the line of the ``for``.

A loop whose meaning a function of its locals cannot carry is left as it
is, its iterable wrapped in ``loops.unrolled(..., reason)`` (so that a stack
made with ``require_scan=True`` can say why): ``break``, ``continue``,
``return``, ``yield`` or ``await`` in the body, ``global`` / ``nonlocal``,
``del`` of a local, a nested ``def`` or ``class``, zero-argument
``super()``, ``locals()``, a target other than names, a local the body
changes in place, or one a function defined outside the loop reads.

This is an ``ast`` pass over the wrapper source the state rewrite produced
(``rewrite.rewrite_method``), run by ``loader.compile_method``; it needs
nothing but the source.
"""

from __future__ import annotations

import ast
import copy
from collections.abc import Iterator, Sequence
from typing import Any

from autostate.transform.method import MUTATING_METHODS, SCOPE_READERS

# Calls whose arguments the runtime looks into (``enumerate(self.blocks)``):
# they are deferred, so the runtime sees the stack rather than an iterator.
_DEFERRED = frozenset({"enumerate", "zip", "reversed"})
# Methods that change their object in place (``outs.append(x)``, ``d.__setitem__(k, v)``).
_MUTATING = MUTATING_METHODS | {"__setitem__", "__delitem__"}


def _reads_scope(node: ast.AST) -> bool:
    """``locals()``, ``vars()``, ``dir()``: the running function's locals by
    name; ``eval(...)`` and ``exec(...)`` too (without their own namespaces)."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        return False
    name = node.func.id
    return name in SCOPE_READERS and (not node.args or (name in ("eval", "exec") and len(node.args) < 2))
_PREFIX = "__autostate_"
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
_SCOPES = (*_FUNCTIONS, ast.ClassDef)


def has_loops(text: str) -> bool:
    """Whether ``text`` (a method's source) may hold a ``for`` statement."""
    return "for " in text or "for\t" in text


def roll_loops(tree: ast.Module, method_name: str, runtime: str) -> bool:
    """Adds the rolled form to each ``for`` loop of the method ``method_name``
    in ``tree`` (a wrapper module: ``class C: def outer(): def method``);
    whether any was changed."""
    method = _find_method(tree, method_name)
    if method is None:
        return False
    roller = _Roller(runtime)
    roller.visit_function(method)
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


def _own_nodes(nodes: list[ast.stmt] | ast.AST) -> Iterator[ast.AST]:
    """Every node under ``nodes`` that runs in their scope: not inside a nested
    function, lambda or class (their default values and decorators are)."""
    pending: list[ast.AST] = list(nodes) if isinstance(nodes, list) else [nodes]
    while pending:
        node = pending.pop()
        yield node
        inner: list[ast.AST | None]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inner = [*node.decorator_list, *node.args.defaults, *node.args.kw_defaults]
        elif isinstance(node, ast.Lambda):
            inner = [*node.args.defaults, *node.args.kw_defaults]
        elif isinstance(node, ast.ClassDef):
            inner = [*node.decorator_list, *node.bases, *node.keywords]
        else:
            inner = list(ast.iter_child_nodes(node))
        pending += [n for n in inner if n is not None]


def _bound_names(nodes: list[ast.stmt]) -> set[str]:
    """Names the statements bind in their own scope (walrus targets in
    comprehensions included, as Python binds them there)."""
    names: set[str] = set()
    for node in _own_nodes(nodes):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).partition(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
        elif isinstance(node, (ast.MatchAs, ast.MatchStar)) and node.name:
            names.add(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            names.add(node.rest)
    for node in ast.walk(ast.Module(body=list(nodes), type_ignores=[])):
        if isinstance(node, ast.NamedExpr) and isinstance(node.target, ast.Name):
            names.add(node.target.id)  # (binds in the function, even in a comprehension)
    return names


def _loaded(nodes: list[ast.stmt] | ast.AST, skip: Sequence[ast.stmt] = ()) -> set[str]:
    """Every name read anywhere under ``nodes`` (nested scopes included; ``x``
    of ``x += 1`` too), except under the statements ``skip``."""
    pending: list[ast.AST] = list(nodes) if isinstance(nodes, list) else [nodes]
    skipped = {id(s) for s in skip}
    names: set[str] = set()
    while pending:
        node = pending.pop()
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            names.add(node.id)
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        pending += ast.iter_child_nodes(node)
    return names


def _read_first(body: list[ast.stmt]) -> set[str]:
    """Names the body may read before it assigns them: read in a statement
    before the first one that surely binds them (an assignment at the body's
    top level; one inside an ``if`` may not run)."""
    bound: set[str] = set()
    read: set[str] = set()
    for statement in body:
        read |= _loaded([statement]) - bound
        if isinstance(statement, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            if isinstance(statement, ast.AnnAssign) and statement.value is None:
                continue
            for target in targets:
                bound.update(_target_names(target) or ())
    return read


def _target_names(target: ast.expr) -> list[str] | None:
    """The names of a loop target made of names only (``x``, ``i, (a, b)``)."""
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        names: list[str] = []
        for element in target.elts:
            inner = _target_names(element)
            if inner is None:
                return None
            names += inner
        return names
    return None


def _base_name(node: ast.expr) -> str | None:
    """``a`` of ``a.b[c].d``."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _why_not(loop: ast.For, scope: ast.AST, targets: list[str] | None) -> str | None:
    """Why ``loop`` (in function ``scope``) cannot be rolled, or ``None``."""
    if targets is None:
        return "its target is not a name or a tuple of names"
    body = loop.body
    assigned = _bound_names(body)
    for node in _own_nodes(body):
        if isinstance(node, ast.Return):
            return "a `return` in its body"
        if isinstance(node, (ast.Yield, ast.YieldFrom)):
            return "a `yield` in its body"
        if isinstance(node, ast.Await):
            return "an `await` in its body"
        if isinstance(node, (ast.Global, ast.Nonlocal)):
            return "a `global` or `nonlocal` statement in its body"
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if not node.name.startswith(_PREFIX):
                return f"a nested `{'class' if isinstance(node, ast.ClassDef) else 'def'}` in its body"
        if isinstance(node, ast.Delete) and any(isinstance(t, ast.Name) for t in node.targets):
            return "a `del` of a local in its body"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "super" and not node.args:
                return "a zero-argument `super()` in its body"
            if _reads_scope(node):
                return f"a call of `{node.func.id}()` in its body"
        if isinstance(node, ast.Name) and node.id == "__class__":
            return "`__class__` in its body"
        changed, attribute = _changed_in_place(node)
        if changed is None or changed in assigned or (attribute and changed in targets):
            continue  # (an attribute of a layer assigned: a state write, as a list's layer)
        return f"its body changes `{changed}` in place"
    if _breaks(body):
        return "a `break` or `continue` in its body"
    if set(targets) & assigned:
        return "its body assigns the loop variable"
    declared = {
        name
        for node in _own_nodes(getattr(scope, "body", []))
        if isinstance(node, (ast.Global, ast.Nonlocal))
        for name in node.names
    }
    if declared & (assigned | set(targets)):
        return "it assigns a name declared `global` or `nonlocal`"
    repeated = _in_a_loop(scope, loop)
    for node in _own_nodes(getattr(scope, "body", [])):
        if not isinstance(node, _FUNCTIONS) or getattr(node, "name", "").startswith(_PREFIX):
            continue
        if _inside(node, loop):
            continue
        # A function made after the loop cannot run during it (unless a loop
        # around both makes it on an earlier trip): it sees the locals after
        # the loop, which the rolled loop leaves as the plain one does.
        if not repeated and node.lineno > (loop.end_lineno or loop.lineno):
            continue
        if _loaded(node) & assigned:
            return "a function defined outside the loop reads a local its body assigns"
    return None


def _in_a_loop(scope: ast.AST, loop: ast.AST) -> bool:
    """Whether ``loop`` runs inside another loop of its own scope."""
    return any(
        isinstance(node, (ast.For, ast.AsyncFor, ast.While)) and node is not loop
        and _inside(loop, node)
        for node in _own_nodes(getattr(scope, "body", []))
    )


def _changed_in_place(node: ast.AST) -> tuple[str | None, bool]:
    """The name whose object ``node`` changes in place (``a[i] = v``, ``a.b =
    v``, ``del a[i]``, ``a[i] += v``, ``a.append(v)``), and whether only by
    assigning attributes (``a.b = v``, ``a.b.c += v``)."""
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif isinstance(node, ast.Delete):
        targets = node.targets
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr in _MUTATING:
            return _base_name(node.func.value), False
        return None, False
    for target in targets:
        for part in ast.walk(target):
            if isinstance(part, (ast.Subscript, ast.Attribute)) and isinstance(
                part.ctx, (ast.Store, ast.Del)
            ):
                chain: ast.expr = part
                while isinstance(chain, ast.Attribute):
                    chain = chain.value
                attribute = isinstance(chain, ast.Name) and not isinstance(node, ast.Delete)
                return _base_name(part), attribute
    return None, False


def _breaks(body: list[ast.stmt]) -> bool:
    """Whether a ``break`` or ``continue`` of this loop (not of a loop inside it) is in ``body``."""
    pending: list[ast.AST] = list(body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Break, ast.Continue)):
            return True
        if isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
            pending += node.orelse  # (its body's belong to it)
        elif not isinstance(node, _SCOPES):
            pending += ast.iter_child_nodes(node)
    return False


def _inside(node: ast.AST, container: ast.AST) -> bool:
    return any(n is node for n in ast.walk(container))


class _Roller:
    """Walks one method, innermost loops first, adding each loop's rolled form."""

    def __init__(self, runtime: str):
        self.runtime = runtime
        self.count = 0
        self.changed = False

    def visit_function(self, function: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self._statements(function.body, function)

    def _statements(self, statements: list[ast.stmt], scope: ast.AST) -> None:
        i = 0
        while i < len(statements):
            node = statements[i]
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                inner = getattr(node, field, None)
                if not isinstance(inner, list) or isinstance(node, ast.ClassDef):
                    continue
                nested = node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else scope
                for part in inner:
                    if isinstance(part, (ast.ExceptHandler, ast.match_case)):
                        self._statements(part.body, nested)
                if inner and isinstance(inner[0], ast.stmt):
                    self._statements(inner, nested)
            if isinstance(node, ast.For) and not self._plainly_not_a_stack(node.iter):
                replacement = self._rolled(node, scope)
                statements[i : i + 1] = replacement
                i += len(replacement)
                self.changed = True
                continue
            i += 1

    @staticmethod
    def _plainly_not_a_stack(iterable: ast.expr) -> bool:
        """``range(...)``, a literal, a comprehension, ``d.items()``: never a stack."""
        if isinstance(iterable, (ast.Constant, ast.List, ast.Tuple, ast.Set, ast.Dict,
                                 ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp,
                                 ast.JoinedStr)):
            return True
        if isinstance(iterable, ast.Call):
            func = iterable.func
            if isinstance(func, ast.Name) and func.id == "range":
                return True
            if isinstance(func, ast.Attribute) and func.attr in ("items", "keys", "values"):
                return True
        return False

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

    def _rolled(self, loop: ast.For, scope: ast.AST) -> list[ast.stmt]:
        targets = _target_names(loop.target)
        reason = _why_not(loop, scope, targets)
        source = self._deferred(loop.iter)
        if reason is not None or targets is None:
            loop.iter = ast.Call(self._runtime("unrolled"), [source, ast.Constant(reason)], [])
            _locate(loop.iter, loop)
            return [loop]
        self.count += 1
        assigned = _bound_names(loop.body)
        read = _read_first(loop.body)
        live = self._live_after(scope, loop)
        needed = sorted(
            name for name in assigned - set(targets)
            if not name.startswith(_PREFIX) and (name in read or live is None or name in live)
        )
        wants_last = live is None or bool(set(targets) & live)
        text = _rolled_form(
            self.count, self.runtime, needed, read, ast.unparse(loop.target), wants_last
        )
        added = ast.parse(text).body
        _locate(source, loop)
        for node in added:
            _locate(node, loop, every=True)
        filled = [_Filled(loop.body, source).visit(node) for node in added]
        loop.iter = ast.Name(f"{_PREFIX}it_{self.count}", ast.Load())
        _locate(loop.iter, loop)
        return [*filled, loop]

    def _live_after(self, scope: ast.AST, loop: ast.For) -> set[str] | None:
        """Names read in ``scope`` outside ``loop``'s body (``None``: any may be,
        the scope reads its own locals by name)."""
        if any(_reads_scope(node) for node in ast.walk(scope)):
            return None
        return _loaded(scope, skip=loop.body)


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
    n: int, runtime: str, needed: list[str], read: set[str], target: str, wants_last: bool
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
