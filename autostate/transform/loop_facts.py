"""Loop facts: what the rolling rewrite needs of each ``for`` statement.

A ``for`` loop's body also becomes a function of the locals it carries
(``transform.loops`` writes it; ``lifting.loops`` runs it as one scan).
What that function is follows from the facts found here, on the method's
libcst tree that ``analysis`` parsed and with its rules of which names a
node binds and which scope a name is in: the names the body binds, those it
may read before it binds them, those read outside it, and why the body
cannot be one step of a scan, if so. Nothing here imports JAX.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import libcst as cst

from autostate.transform import walk
from autostate.transform.analysis import binding_names, hides, scope_names
from autostate.transform.method import IN_PLACE_METHODS, SCOPE_LISTERS, SCOPE_READERS, mangle
from autostate.transform.syntax import identifier, name_nodes

# What a loop's header spells that is never a stack: literals and displays.
_NEVER_STACKS = (
    cst.Integer, cst.Float, cst.Imaginary, cst.SimpleString, cst.ConcatenatedString,
    cst.FormattedString, cst.List, cst.Tuple, cst.Set, cst.Dict, cst.ListComp, cst.SetComp,
    cst.DictComp, cst.GeneratorExp,
)
_SCOPE_NODES = (cst.FunctionDef, cst.Lambda, cst.ClassDef)


@dataclasses.dataclass(frozen=True)
class LoopFacts:
    """One ``for`` statement of a method: ``targets`` (``None``: not names only),
    ``bound`` (what the body binds), ``read_first`` (what it may read before
    binding), ``live`` (names read outside the body; ``None``: any),
    ``reason`` (why it cannot be one step of a scan), ``receiver_changes``
    (receiver attributes changed in place other than by a state write)."""

    targets: tuple[str, ...] | None
    bound: frozenset[str] = frozenset()
    read_first: frozenset[str] = frozenset()
    live: frozenset[str] | None = frozenset()
    reason: str | None = None
    receiver: str | None = None
    receiver_changes: frozenset[str] = frozenset()
    # False: what it iterates is never a stack (``range(n)``, a literal, ``d.items()``).
    may_roll: bool = True

    def why_not(self, state: frozenset[str]) -> str | None:
        """Why the loop cannot be rolled in a class whose states are ``state``."""
        if self.reason is not None:
            return self.reason
        if self.receiver_changes - state:
            return f"its body changes `{self.receiver}` in place"
        return None

    @property
    def carried(self) -> tuple[str, ...]:
        """The locals the body function takes in and gives back: those the body
        binds (not the loop variable) that it may read first or that are read
        outside the loop."""
        targets = set(self.targets or ())
        return tuple(sorted(
            name for name in self.bound - targets
            if name in self.read_first or self.live is None or name in self.live
        ))

    @property
    def wants_last(self) -> bool:
        """Whether the loop variable is read outside the loop (its last value is kept)."""
        return self.live is None or bool(set(self.targets or ()) & self.live)


def may_hold_loops(text: str) -> bool:
    """Whether ``text`` (a method's source) may hold a ``for`` statement."""
    return "for " in text or "for\t" in text


def loop_facts(
    function: cst.FunctionDef, receiver: str | None, class_name: str
) -> tuple[LoopFacts, ...]:
    """The facts of every (not ``async``) ``for`` statement of ``function``
    and of the functions nested in it (not of class bodies), in source order."""
    found: list[LoopFacts] = []
    scopes: dict[int, _Scope] = {}

    def statements(node: cst.CSTNode, scope: cst.FunctionDef, ancestors: list[cst.CSTNode]) -> None:
        for child in walk.children(node):
            if isinstance(child, (cst.ClassDef, cst.BaseExpression, cst.SimpleStatementLine)):
                continue
            if isinstance(child, cst.For) and child.asynchronous is None:
                here = scopes.get(id(scope))
                if here is None:
                    here = scopes[id(scope)] = _Scope(scope, None if receiver is None or (
                        scope is not function and hides(scope, receiver)
                    ) else receiver)
                found.append(_one_loop(child, here, bool(ancestors), class_name))
            if isinstance(child, cst.FunctionDef):
                statements(child.body, child, [])
            else:
                looped = isinstance(child, (cst.For, cst.While))
                statements(child, scope, [*ancestors, child] if looped else ancestors)

    statements(function.body, function, [])
    return tuple(found)


class _Scope:
    """What the loops of one function share: its own nodes, the names it reads,
    the functions it makes (computed once, whatever the number of its loops)."""

    def __init__(self, function: cst.FunctionDef, receiver: str | None):
        self.receiver = receiver
        self.own = _own_nodes(function.body)
        self.called: set[int] = set()  # the name nodes called (``g`` of ``g(...)``)
        self.loads = _loads(function.body, called=self.called)
        self.reads = collections.Counter(identifier(n.value) for n in self.loads)
        # Whether it reads its own locals by name: then any may be read after a loop.
        self.by_name = not SCOPE_READERS.isdisjoint(self.reads) and any(
            reads_scope(n) for n in _all_nodes(function)
        )
        self.declared = {
            identifier(item.name.value)
            for node in self.own
            if isinstance(node, (cst.Global, cst.Nonlocal))
            for item in node.names
        }
        # What reads the method's locals when it runs, not when it is made: a
        # function, a lambda, a class (its methods) and a generator expression.
        consumed = {
            id(node.args[0].value) for node in self.own
            if isinstance(node, cst.Call) and isinstance(node.func, cst.Name)
            and node.func.value in _CONSUMERS and len(node.args) == 1
        }
        self.functions = [
            (i, n) for i, n in enumerate(self.own)
            if isinstance(n, _READS_LATER) and id(n) not in consumed
        ]
        # The functions held by a name (``def g``, ``g = lambda ...``, ``class C``,
        # ``gen = (... for ...)``), the only way one is kept without being handed on.
        self.held: dict[int, str] = {}
        # Those whose call makes an object that reads the locals later (a class,
        # a generator function): calling one hands it on.
        self.lasting: set[int] = set()
        for node in self.own:
            if isinstance(node, (cst.FunctionDef, cst.ClassDef)) and not node.decorators:
                self.held[id(node)] = identifier(node.name.value)
                if isinstance(node, cst.ClassDef) or _yields(node):
                    self.lasting.add(id(node))
            elif (
                isinstance(node, cst.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0].target, cst.Name)
                and isinstance(node.value, (cst.Lambda, cst.GeneratorExp))
            ):
                self.held[id(node.value)] = identifier(node.targets[0].target.value)
        self._free: dict[int, set[str]] = {}

    def free_reads(self, function: cst.CSTNode) -> set[str]:
        """The names a function's (lambda's, class's, generator expression's)
        body reads from enclosing scopes."""
        found = self._free.get(id(function))
        if found is None:
            if isinstance(function, cst.GeneratorExp):  # (its targets are no reads)
                found = self._free[id(function)] = _read_names(function)
                return found
            assert isinstance(function, (cst.FunctionDef, cst.Lambda, cst.ClassDef))
            bound, declared = scope_names(function)
            globals_ = {n for n, is_global in declared.items() if is_global}
            found = self._free[id(function)] = _read_names(function.body) - bound - globals_
        return found


_READS_LATER = (cst.FunctionDef, cst.Lambda, cst.ClassDef, cst.GeneratorExp)
# The builtins that run a generator expression given them to its end (or drop
# it) before they return: ``sum(x * k for k in ...)`` reads the locals at once.
_CONSUMERS = frozenset({
    "sum", "list", "tuple", "set", "frozenset", "dict", "sorted", "min", "max", "any", "all",
})


def _yields(function: cst.FunctionDef) -> bool:
    """Whether ``function`` is a generator function (a ``yield`` of its own)."""
    return any(isinstance(n, cst.Yield) for n in _own_nodes(function.body))


def _read_names(root: cst.CSTNode, skip: cst.CSTNode | None = None) -> set[str]:
    """Every name read under ``root`` (nested scopes included; ``x`` of ``x +=
    1`` too), except under ``skip``."""
    return {identifier(n.value) for n in _loads(root, skip)}


# The nodes ``binding_names`` finds names in.
_BINDERS = frozenset({
    cst.Assign, cst.AnnAssign, cst.NamedExpr, cst.For, cst.Del, cst.WithItem, cst.ExceptHandler,
    cst.ExceptStarHandler, cst.MatchAs, cst.MatchStar, cst.MatchMapping, cst.FunctionDef,
    cst.ClassDef, cst.TypeAlias,
})


def _loads(
    root: cst.CSTNode, skip: cst.CSTNode | None = None, called: set[int] | None = None
) -> list[cst.Name]:
    """The name nodes under ``root`` that read a name, except under ``skip``
    (``called`` collects those called, ``g`` of ``g(...)``)."""
    names: list[cst.Name] = []
    stores: set[int] = set()
    pending = [root]
    while pending:
        node = pending.pop()
        if node is skip:
            continue
        t = type(node)
        if t is cst.Name:
            if id(node) not in stores:
                names.append(node)  # type: ignore[arg-type]
            continue
        if t is cst.Attribute or t is cst.Arg:
            pending.append(node.value)  # type: ignore[attr-defined]
            continue
        if t is cst.Param:
            pending.extend(x for x in (node.default, node.annotation) if x is not None)  # type: ignore[attr-defined]
            continue
        if t in (cst.Import, cst.ImportFrom, cst.Global, cst.Nonlocal):
            continue
        if t is cst.MatchKeywordElement:
            pending.append(node.pattern)  # type: ignore[attr-defined]
            continue
        if t is cst.CompFor:
            stores.update(id(n) for n in name_nodes(node.target))  # type: ignore[attr-defined]
        elif t in _BINDERS:
            stores.update(id(n) for n in binding_names(node))
        elif t is cst.Call and called is not None and type(node.func) is cst.Name:  # type: ignore[attr-defined]
            called.add(id(node.func))  # type: ignore[attr-defined]
        pending.extend(walk.children(node))
    return names


def _own_nodes(root: cst.CSTNode) -> list[cst.CSTNode]:
    """The nodes under ``root`` (included) that run in its scope, in source
    order: not inside a nested function, lambda or class (their decorators,
    defaults and bases are)."""
    out: list[cst.CSTNode] = []
    pending = [root]
    while pending:
        node = pending.pop()
        out.append(node)
        inner: list[Any]
        if isinstance(node, cst.FunctionDef):
            inner = [*node.decorators, node.params]
        elif isinstance(node, cst.Lambda):
            inner = [node.params]
        elif isinstance(node, cst.ClassDef):
            inner = [*node.decorators, *node.bases, *node.keywords]
        elif isinstance(node, cst.Param):
            inner = [node.default] if node.default is not None else []
        else:
            inner = list(walk.children(node))
        pending.extend(reversed(inner))
    return out


def _statements_of(suite: cst.BaseSuite) -> list[cst.CSTNode]:
    """The statements of a block, each small statement of a line its own."""
    out: list[cst.CSTNode] = []
    for statement in suite.body:
        if isinstance(statement, cst.SimpleStatementLine):
            out.extend(statement.body)
        else:
            out.append(statement)
    return out


def _target_names(target: cst.BaseExpression) -> tuple[str, ...] | None:
    """The names of a loop target made of names only (``x``, ``i, (a, b)``)."""
    if isinstance(target, cst.Name):
        return (identifier(target.value),)
    if isinstance(target, (cst.Tuple, cst.List)):
        names: list[str] = []
        for element in target.elements:
            inner = None if isinstance(element, cst.StarredElement) else _target_names(element.value)
            if inner is None:
                return None
            names += inner
        return tuple(names)
    return None


def _never_a_stack(iterable: cst.BaseExpression) -> bool:
    """``range(...)``, a literal, a comprehension, ``d.items()``: never a stack."""
    if isinstance(iterable, _NEVER_STACKS):
        return True
    if isinstance(iterable, cst.Call):
        func = iterable.func
        if isinstance(func, cst.Name) and func.value == "range":
            return True
        if isinstance(func, cst.Attribute) and func.attr.value in ("items", "keys", "values"):
            return True
    return False


def reads_scope(node: cst.CSTNode) -> bool:
    """``locals()``, ``vars()``, ``dir()``: the running function's locals by
    name (``SCOPE_LISTERS``); ``eval(...)`` and ``exec(...)`` too, without
    namespaces of their own (``SCOPE_READERS``)."""
    if not isinstance(node, cst.Call) or not isinstance(node.func, cst.Name):
        return False
    name = node.func.value
    if name in SCOPE_LISTERS:
        return not node.args
    return name in SCOPE_READERS and len(node.args) < 2


def _changed_in_place(node: cst.CSTNode) -> list[tuple[cst.BaseExpression, bool]]:
    """What ``node`` changes in place (``a[i] = v``, ``a.b = v``, ``del a[i]``,
    ``a[i] += v``, ``a.append(v)``), each with whether only by assigning
    attributes (``a.b = v``, ``a.b.c += v``)."""
    targets: list[cst.BaseExpression] = []
    if isinstance(node, cst.Assign):
        targets = [t.target for t in node.targets]
    elif isinstance(node, (cst.AugAssign, cst.AnnAssign, cst.Del)):
        targets = [node.target]
    elif isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute):
        return [(node.func.value, False)] if node.func.attr.value in IN_PLACE_METHODS else []
    out: list[tuple[cst.BaseExpression, bool]] = []
    while targets:
        target = targets.pop()
        if isinstance(target, (cst.Tuple, cst.List)):
            targets.extend(e.value for e in target.elements)
        elif isinstance(target, cst.StarredElement):
            targets.append(target.value)
        elif isinstance(target, (cst.Subscript, cst.Attribute)):
            chain: cst.BaseExpression = target
            while isinstance(chain, cst.Attribute):
                chain = chain.value
            out.append((target, isinstance(chain, cst.Name) and not isinstance(node, cst.Del)))
    return out


def _base(expr: cst.BaseExpression) -> tuple[str | None, str | None]:
    """``a`` of ``a.b[c].d``, and ``b`` (the attribute read from ``a``, if any)."""
    attr = None
    while isinstance(expr, (cst.Attribute, cst.Subscript)):
        attr = expr.attr.value if isinstance(expr, cst.Attribute) else None
        expr = expr.value
    return (identifier(expr.value), attr) if isinstance(expr, cst.Name) else (None, None)


def _breaks(body: cst.BaseSuite) -> bool:
    """Whether a ``break`` or ``continue`` of this loop (not of a loop inside it) is in ``body``."""
    pending: list[cst.CSTNode] = [body]
    while pending:
        node = pending.pop()
        if isinstance(node, (cst.Break, cst.Continue)):
            return True
        if isinstance(node, (cst.For, cst.While)):
            pending.extend([node.orelse] if node.orelse is not None else [])  # (its body's are its own)
        elif not isinstance(node, (*_SCOPE_NODES, cst.BaseExpression)):
            pending.extend(walk.children(node))
    return False


def _body_reads(body: cst.BaseSuite) -> tuple[set[str], collections.Counter[str]]:
    """The names the body may read before it binds them (read in a statement
    before the first one that surely binds them: an assignment at the body's
    top level; one inside an ``if`` may not run), and how often it reads each."""
    bound: set[str] = set()
    first: set[str] = set()
    counts: collections.Counter[str] = collections.Counter()
    for statement in _statements_of(body):
        read = [identifier(n.value) for n in _loads(statement)]
        counts.update(read)
        first.update(n for n in read if n not in bound)
        if isinstance(statement, cst.AnnAssign) and statement.value is None:
            continue
        if isinstance(statement, (cst.Assign, cst.AnnAssign, cst.AugAssign)):
            targets = (
                [t.target for t in statement.targets]
                if isinstance(statement, cst.Assign) else [statement.target]
            )
            for target in targets:
                bound.update(_target_names(target) or ())
    return first, counts


def _one_loop(loop: cst.For, scope: _Scope, repeated: bool, class_name: str) -> LoopFacts:
    targets = _target_names(loop.target)
    if _never_a_stack(loop.iter):
        return LoopFacts(targets, may_roll=False)
    own = _own_nodes(loop.body)
    bound = frozenset(identifier(n.value) for node in own for n in binding_names(node))
    first, counts = _body_reads(loop.body)
    live = None if scope.by_name else frozenset(
        name for name, n in scope.reads.items() if n > counts.get(name, 0)
    )
    changes: set[str] = set()
    reason = _why_not(loop, scope, own, repeated, targets, bound, counts, live, changes)
    return LoopFacts(
        targets, bound, frozenset(first), live, reason, scope.receiver,
        frozenset(mangle(class_name, a) for a in changes),
    )


def _all_nodes(root: cst.CSTNode) -> list[cst.CSTNode]:
    out, pending = [], [root]
    while pending:
        node = pending.pop()
        out.append(node)
        pending.extend(walk.children(node))
    return out


def _why_not(
    loop: cst.For, scope: _Scope, own: list[cst.CSTNode], repeated: bool,
    targets: tuple[str, ...] | None, bound: frozenset[str], reads: collections.Counter[str],
    live: frozenset[str] | None, receiver_changes: set[str],
) -> str | None:
    """Why ``loop`` cannot be rolled, or ``None``; fills ``receiver_changes``
    (``own``: its body's own nodes, ``reads``: the names its body reads)."""
    if targets is None:
        return "its target is not a name or a tuple of names"
    receiver = scope.receiver
    for node in own[1:]:
        if isinstance(node, cst.Return):
            return "a `return` in its body"
        if isinstance(node, cst.Yield):
            return "a `yield` in its body"
        if isinstance(node, cst.Await):
            return "an `await` in its body"
        if isinstance(node, (cst.Global, cst.Nonlocal)):
            return "a `global` or `nonlocal` statement in its body"
        if isinstance(node, (cst.FunctionDef, cst.ClassDef)):
            return f"a nested `{'class' if isinstance(node, cst.ClassDef) else 'def'}` in its body"
        if isinstance(node, cst.Del) and any(
            isinstance(t, cst.Name)
            for t in (
                [e.value for e in node.target.elements]
                if isinstance(node.target, (cst.Tuple, cst.List)) else [node.target]
            )
        ):
            return "a `del` of a local in its body"
        if isinstance(node, cst.Call) and isinstance(node.func, cst.Name):
            if node.func.value == "super" and not node.args:
                return "a zero-argument `super()` in its body"
            if reads_scope(node):
                return f"a call of `{node.func.value}()` in its body"
        for changed, attribute in _changed_in_place(node):
            name, attr = _base(changed)
            if name is None or name in bound or (attribute and name in targets):
                continue  # (an attribute of a layer assigned: a state write, as a list's layer)
            if name == receiver and attr is not None:
                receiver_changes.add(identifier(attr))  # (a state's write, or not: ``why_not``)
                continue
            return f"its body changes `{name}` in place"
    if "__class__" in reads:
        return "`__class__` in its body"
    if _breaks(loop.body):
        return "a `break` or `continue` in its body"
    if set(targets) & bound:
        return "its body assigns the loop variable"
    if scope.declared & (bound | set(targets)):
        return "it assigns a name declared `global` or `nonlocal`"
    if not scope.functions:
        return None
    return _observed(loop, scope, own, repeated, set(bound) | set(targets), set(reads), live)


def _observed(
    loop: cst.For, scope: _Scope, own: list[cst.CSTNode], repeated: bool,
    per_step: set[str], body_reads: set[str], live: frozenset[str] | None,
) -> str | None:
    """Why a function defined in the method could see one step's locals, or
    ``None``. Made after the loop, it sees what the loop leaves (as the rolled
    loop leaves it). Made before, only if the body calls it or it was handed
    on. Made in the body, it reads that step's locals, unless the code after
    the loop keeps it."""
    held = scope.held
    for node in own[1:]:
        if isinstance(node, (cst.Lambda, cst.GeneratorExp)) and id(node) in held:
            name = held[id(node)]
            if (live is None or name in live) and scope.free_reads(node) & per_step:
                return (
                    f"`{name}`, a function its body makes that reads a local the body assigns, "
                    "is read after the loop"
                )
    body_start = next(i for i, n in enumerate(scope.own) if n is loop.body)
    body_end = body_start + len(own)
    functions = [
        n for i, n in scope.functions
        if not body_start <= i < body_end and (repeated or i < body_start)
    ]
    seeing = set(per_step)
    observers: list[cst.CSTNode] = []
    changed = True
    while changed:  # (one that calls a function that can see a step's locals can too)
        changed = False
        for function in functions:
            if any(f is function for f in observers) or not scope.free_reads(function) & seeing:
                continue
            observers.append(function)
            changed = True
            if id(function) in held:
                seeing.add(held[id(function)])
    for observer in observers:
        holder = held.get(id(observer))
        if holder is None:
            return "a function defined outside the loop reads a local its body assigns and is handed on"
        if holder in body_reads:
            return (
                f"its body calls `{holder}`, a function defined outside the loop that reads a "
                "local the body assigns"
            )
        lasting = id(observer) in scope.lasting
        if any(
            identifier(n.value) == holder and (lasting or id(n) not in scope.called)
            for n in scope.loads
        ):
            return (
                f"`{holder}`, a function defined outside the loop that reads a local its body "
                "assigns, is handed on"
            )
    return None
