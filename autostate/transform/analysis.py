"""Which attributes of a class are state, and what ``@stateful`` must reject.

Pure function of the methods' source text: each method is parsed with libcst
(at its real line numbers, so every fact carries the user's ``file:line``),
one visitor collects facts about how the method touches its receiver, and
``analyze_class`` turns the facts of all methods into the state set or a
``DecorationError`` that says what to do. Nothing here imports JAX, and
nothing here rewrites code (``rewrite.py`` does, from the result).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import keyword
import re
import sys
import tokenize
from collections.abc import Callable, Sequence
from typing import Any

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from autostate.errors import DecorationError, format_error
from autostate.transform import walk
from autostate.transform.method import (
    ACCESS_BUILTINS,
    IN_PLACE_METHODS,
    INPLACE_TENSOR_METHODS,
    OUTER_NAME,
    RUNTIME_NAME,
    VIEW_BUILTINS,
    VIEW_METHODS,
    MethodSource,
    is_dunder,
    mangle,
    runtime_name,
)
from autostate.transform.syntax import (
    dotted_name,
    identifier,
    name_nodes,
    reaches_within,
    subscript_base,
    subscripts,
    unpacked,
)

# ``self.register_buffer("x", v)``: PyTorch's spelling of a declared buffer.
# Recorded for every class; it declares ``x`` (as ``self.x =
# autostate.constant(v)`` does) only in a class that says its
# ``register_buffer`` declares (``analyze_class``'s ``declaring_methods``:
# ``autostate.nn.Module``), not where a class of its own defines one.
_DECLARING_METHODS = frozenset({"register_buffer"})
# Calls whose result is a mutable container, by the dotted name they spell.
_CONTAINER_CONSTRUCTORS = frozenset(
    {"list", "dict", "set", "bytearray", "collections.deque", "collections.OrderedDict",
     "collections.defaultdict", "collections.Counter"}
)
# Modules whose functions give arrays (or containers of them), by the first
# name of the dotted name a call spells (``jnp.zeros``, ``jax.random.normal``).
_ARRAY_MODULES = frozenset({"jnp", "np", "numpy", "jax", "lax"})
_CONTAINER_DISPLAYS = (cst.List, cst.Dict, cst.Set, cst.ListComp, cst.DictComp, cst.SetComp)
_LITERALS = (
    cst.Integer, cst.Float, cst.Imaginary, cst.SimpleString, cst.ConcatenatedString,
    cst.FormattedString,
)


@dataclasses.dataclass
class Assignment:
    attr: str
    line: int
    kind: str  # "set", "aug", "item", "inplace" (``self.x.mul_(m)``, ``self.x[i].add_(v)``)
    nested: bool
    # The expression a "set" assigns, where the source spells one for this
    # attribute alone (``self.x = v``, ``self.x: T = v``, ``setattr(self,
    # "x", v)``); None for the others (``self.a, self.b = v``, ``for self.x in``).
    # For "inplace", the call itself (``self.x.mul_(m)``).
    value: cst.BaseExpression | None = None
    # For "item", the subscripted target (``self.x[i][j]``).
    target: cst.BaseExpression | None = None


@dataclasses.dataclass
class MethodFacts:
    """What one method does with its receiver."""

    source: MethodSource
    receiver: str | None
    module: cst.Module
    function: cst.FunctionDef
    # The parsed wrapper source (``wrapper_source``) and its line shift.
    text: str = ""
    shift: int = 0
    assignments: list[Assignment] = dataclasses.field(default_factory=list)
    reads: dict[str, int] = dataclasses.field(default_factory=dict)
    deletes: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    reflective: list[tuple[str, str, int]] = dataclasses.field(default_factory=list)
    mutating_calls: list[tuple[str, str, int]] = dataclasses.field(default_factory=list)
    # One per ``mutating_calls`` entry: how many subscripts lie between the
    # attribute and the method (``self.x[i].append``: 1, an item's method).
    mutating_depths: list[int] = dataclasses.field(default_factory=list)
    # Whether the method calls one of PyTorch's in-place tensor methods on an
    # attribute (``inplace_receiver``): only then are its aliases checked.
    updates_in_place: bool = False
    # A local alias PyTorch would see change (``_InPlaceAliases.problem``).
    alias_problem: tuple[str, int, str] | None = None
    rebinds: list[int] = dataclasses.field(default_factory=list)
    # Methods called through the receiver (``self.m()``) or taken from the
    # class (``type(self).m``, ``self.__class__.m``, ``Cls.m``).
    self_calls: set[str] = dataclasses.field(default_factory=set)
    declarations: dict[str, tuple[str, int]] = dataclasses.field(default_factory=dict)
    # ``self.register_buffer("x", v)`` (``_DECLARING_METHODS``), with its line:
    # where the class's ``register_buffer`` declares, ``x`` is a declared
    # state wherever the call is.
    buffers: dict[str, int] = dataclasses.field(default_factory=dict)
    # Dotted names called (or passed to a call, or used as a decorator): the
    # caller resolves them to find jax.lax control flow to route to autostate.
    references: set[str] = dataclasses.field(default_factory=set)
    is_async: bool = False
    is_generator: bool = False
    # ``delattr(self, "x")`` and the other deletes by a literal name, with
    # their lines (``del self.x`` is in ``deletes``).
    named_deletes: list[tuple[NamedAccess, int]] = dataclasses.field(default_factory=list)
    # Names of ``ACCESS_BUILTINS`` the method's module or closure binds to
    # something else (the caller has the globals); ``shadowed()`` adds the
    # method's own bindings.
    shadowed_outside: frozenset[str] = frozenset()
    # The closure variable the rewritten method reaches the runtime through
    # (``method.runtime_name``: a name the method's text does not use).
    runtime: str = RUNTIME_NAME

    def touched(self) -> set[str]:
        return set(self.reads) | {a.attr for a in self.assignments}


@dataclasses.dataclass(frozen=True)
class ClassAnalysis:
    """The decision: the class's state attributes (mangled names)."""

    class_name: str
    state: frozenset[str]
    declared: dict[str, str]  # attr -> dotted name of the state() call
    methods: tuple[MethodFacts, ...]
    # What construction assigns (own __init__, what it calls, and the bases'),
    # so a subclass may turn any of it into state.
    initialized: frozenset[str] = frozenset()
    # The names construction reaches on the receiver (``__init__``, the
    # methods it calls, what they read): in a subclass, its override of one
    # (``reset`` that a base's ``__init__`` calls) runs when it is built.
    constructs: frozenset[str] = frozenset()


def wrapper_source(class_name: str, source: MethodSource) -> tuple[str, int]:
    """Source to parse and compile for one method, and its line shift.

    The method sits inside ``class <Name>:`` (so private names mangle as in the
    original class) inside a function whose parameters are the method's free
    variables and the runtime's name, so they compile as closure variables.
    That function declares ``global`` the names of ``source.global_names``: in
    the class body the ``def`` binds a class attribute, so the ``relu`` that
    ``def relu(self, x): return relu(x)`` calls is the module's. Line ``n`` of
    the text is line ``n + shift`` of the file; no blank lines pad it (libcst
    would parse them; ``loader.compile_method`` pads for the compiler)."""
    text, indent = _space_indented(source.text)
    params = ", ".join((*source.freevars, runtime_name(source.text)))
    header = f"class {source.mangle_as or class_name}:\n def {OUTER_NAME}({params}):\n"
    names = [n for n in source.global_names if n.isidentifier() and n not in source.freevars]
    if names:
        header += f"{indent}global {', '.join(names)}\n"
    return header + text, source.first_line - 1 - header.count("\n")


_STRING_TOKENS = {tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
_NOT_CODE = {tokenize.NL, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING}
_LEADING = re.compile(r"[ \t\f]*")


def _column(indent: str) -> int:
    """The column the tokenizer gives ``indent`` (tabs to multiples of 8, a
    form feed back to 0)."""
    column = 0
    for char in indent:
        column = 0 if char == "\f" else (column // 8 + 1) * 8 if char == "\t" else column + 1
    return column


def _space_indented(text: str) -> tuple[str, str]:
    """``text`` indented to nest under the one-space wrapper header, and its first
    line's indentation there. Two or more spaces are left as written; any other
    indentation (one space, tabs, a form feed, none) becomes spaces per logical
    line, as many as its column is deeper than the first line's, plus two;
    continuation lines and multi-line strings keep theirs."""
    indent = _LEADING.match(text).group()  # type: ignore[union-attr]
    if "\f" not in text and len(indent) >= 2 and not indent.strip(" "):
        return text, indent
    in_string: set[int] = set()
    starts: set[int] = set()
    new_line = True
    try:
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.start[0] != token.end[0] and token.type in _STRING_TOKENS:
                in_string.update(range(token.start[0] + 1, token.end[0] + 1))
            if token.type == tokenize.NEWLINE:
                new_line = True
            elif new_line and token.type not in _NOT_CODE:
                starts.add(token.start[0])
                new_line = False
    except (tokenize.TokenError, SyntaxError):
        return text, indent
    base = _column(indent)
    after_feed = indent.rpartition("\f")[2]
    width = base if base >= 2 and not after_feed.strip(" ") else 2
    lines = text.splitlines(keepends=True)
    for number, line in enumerate(lines, start=1):
        if number in in_string:
            continue
        leading = _LEADING.match(line).group()  # type: ignore[union-attr]
        if number in starts:
            lines[number - 1] = " " * (_column(leading) - base + width) + line[len(leading) :]
        elif "\f" in leading:
            lines[number - 1] = leading.rpartition("\f")[2] + line[len(leading) :]
    return "".join(lines), " " * width


def _parse(text: str, shift: int, class_name: str, source: MethodSource) -> cst.Module:
    try:
        module = cst.parse_module(text)
    except cst.ParserSyntaxError as exc:
        raise DecorationError(format_error(
            f"@stateful could not parse the source of {class_name}.{source.key}: "
            f"{exc.message}",
            where=f"{source.filename}:{exc.raw_line + shift}",
            fix="make sure the file on disk matches the code that was imported "
            "(reload the module after editing it).",
        )) from None
    return module


def _method_node(module: cst.Module, class_name: str, source: MethodSource) -> cst.FunctionDef:
    wrapper_class = module.body[-1]
    outer = wrapper_class.body.body[0] if isinstance(wrapper_class, cst.ClassDef) else None
    # The method is the wrapper function's last statement (after its ``global``).
    node = outer.body.body[-1] if isinstance(outer, cst.FunctionDef) else None
    if not isinstance(node, cst.FunctionDef):
        # The lines at the function's first line are no function definition:
        # the file holds other text than the code was compiled from.
        raise DecorationError(format_error(
            f"@stateful could not find the source of {class_name}.{source.key}: "
            f"{source.filename!r} holds no function definition at line {source.first_line} "
            "(the file was edited after the import, or the code was compiled from other "
            "text under this file name).",
            where=f"{source.filename}:{source.first_line}",
            fix="make sure the file on disk matches the code that was imported "
            "(reload the module after editing it).",
        ))
    return node


def _param_names(params: cst.Parameters) -> list[str]:
    names = [p.name.value for p in (*params.posonly_params, *params.params, *params.kwonly_params)]
    for star in (params.star_arg, params.star_kwarg):
        if isinstance(star, cst.Param):
            names.append(star.name.value)
    return [identifier(n) for n in names]


def receiver_name(function: cst.FunctionDef) -> str | None:
    names = _param_names(function.params)
    return names[0] if names else None


_COMPREHENSIONS = (cst.ListComp, cst.SetComp, cst.DictComp, cst.GeneratorExp)


def _imported_name(alias: cst.ImportAlias) -> cst.CSTNode:
    if alias.asname is not None:
        return alias.asname.name
    name: cst.CSTNode = alias.name
    while isinstance(name, cst.Attribute):  # ``import a.b`` binds ``a``
        name = name.value
    return name


def binding_names(node: cst.CSTNode) -> list[cst.Name]:
    """The names ``node`` binds in the scope it runs in: every binding form but
    parameters and a comprehension's ``for`` targets (assignment targets,
    ``for``, ``with ... as``, ``:=``, ``del``, ``except ... as``, match
    captures, imports, ``def``/``class``/``type`` names). Shared, so what binds
    the receiver's name is decided in one place."""
    targets: list[cst.CSTNode]
    if isinstance(node, cst.Assign):
        targets = [t.target for t in node.targets]
    elif isinstance(node, (cst.AugAssign, cst.AnnAssign, cst.NamedExpr, cst.For, cst.Del)):
        targets = [node.target]
    elif isinstance(node, cst.WithItem):
        targets = [node.asname.name] if node.asname is not None else []
    elif isinstance(node, (cst.ExceptHandler, cst.ExceptStarHandler)):
        targets = [node.name.name] if node.name is not None else []
    elif isinstance(node, (cst.MatchAs, cst.MatchStar)):
        targets = [node.name] if node.name is not None else []
    elif isinstance(node, cst.MatchMapping):
        targets = [node.rest] if node.rest is not None else []
    elif isinstance(node, (cst.Import, cst.ImportFrom)):
        names = node.names
        targets = [] if isinstance(names, cst.ImportStar) else [_imported_name(a) for a in names]
    elif isinstance(node, (cst.FunctionDef, cst.ClassDef, cst.TypeAlias)):
        targets = [node.name]
    else:
        return []
    return [n for t in targets for n in name_nodes(t)]


def _comprehension_names(node: cst.CSTNode) -> set[str]:
    names: set[str] = set()
    clause = getattr(node, "for_in", None)
    while clause is not None:
        names.update(identifier(n.value) for n in name_nodes(clause.target))
        clause = clause.inner_for_in
    return names


def scope_names(scope: cst.FunctionDef | cst.Lambda | cst.ClassDef) -> tuple[set[str], dict[str, bool]]:
    """The names ``scope`` binds of its own (parameters included, not a class
    body's), and those it declares: name -> ``True`` for ``global``, ``False``
    for ``nonlocal``."""
    bound: set[str] = set() if isinstance(scope, cst.ClassDef) else set(_param_names(scope.params))
    declared: dict[str, bool] = {}
    pending: list[cst.CSTNode] = [scope.body]
    while pending:
        node = pending.pop()
        bound.update(identifier(n.value) for n in binding_names(node))
        if isinstance(node, (cst.Global, cst.Nonlocal)):
            for item in node.names:
                declared[identifier(item.name.value)] = isinstance(node, cst.Global)
        # A nested scope's own body binds in that scope; what runs here is
        # its decorators, defaults and annotations (or bases).
        if isinstance(node, cst.FunctionDef):
            pending.extend((*node.decorators, node.params, *filter(None, [node.returns])))
        elif isinstance(node, cst.ClassDef):
            pending.extend((*node.decorators, *node.bases, *node.keywords))
        elif isinstance(node, cst.Lambda):
            pending.append(node.params)
        else:
            pending.extend(walk.children(node))
    return bound, declared


def hides(scope: cst.FunctionDef | cst.Lambda | cst.ClassDef, name: str) -> bool:
    """Whether ``name`` inside ``scope`` is not the enclosing scope's ``name``:
    a parameter, bound there (Python makes it local to the whole body) and not
    declared ``nonlocal``, or declared ``global``."""
    bound, declared = scope_names(scope)
    return declared[name] if name in declared else name in bound


class ReceiverScopes:
    """Tracks whether the method's receiver name is visible at a node: functions,
    lambdas, classes and comprehensions that bind it push a scope; the innermost
    scope with the name of its own decides (``hides``); class bodies count only
    for their own statements. Shared by the analysis and the rewriter."""

    def __init__(self, method: cst.FunctionDef, receiver: str | None):
        self.method = method
        self.receiver = receiver
        # One entry per enclosing scope: (hides the receiver, is a class body).
        self.stack: list[tuple[bool, bool]] = []
        self.inside = False
        self._comprehensions: set[int] = set()
        # Comprehensions entered (each its own frame before Python 3.12).
        self._frames: set[int] = set()

    def enter(self, node: cst.CSTNode) -> None:
        if node is self.method:
            self.inside = True
            return
        if not self.inside:
            return
        if isinstance(node, _COMPREHENSIONS):
            self._frames.add(id(node))
            # A comprehension is a scope only for the names its ``for`` binds:
            # ``sum(m.x for self in others)`` does not rebind the receiver.
            if self.receiver in _comprehension_names(node):
                self._comprehensions.add(id(node))
                self.stack.append((True, False))
            return
        if isinstance(node, (cst.FunctionDef, cst.Lambda, cst.ClassDef)):
            hidden = self.receiver is not None and hides(node, self.receiver)
            self.stack.append((hidden, isinstance(node, cst.ClassDef)))
        else:
            self.stack.append((False, False))

    def leave(self, node: cst.CSTNode) -> None:
        if node is self.method:
            self.inside = False
        elif isinstance(node, _COMPREHENSIONS):
            self._frames.discard(id(node))
            if id(node) in self._comprehensions:
                self._comprehensions.discard(id(node))
                self.stack.pop()
        elif self.inside:
            self.stack.pop()

    @property
    def nested(self) -> bool:
        return bool(self.stack)

    @property
    def in_method_frame(self) -> bool:
        """Whether code here runs in the method's own frame, where zero-argument
        ``super()`` binds the receiver (a comprehension had a frame of its own
        before Python 3.12)."""
        return (
            self.inside
            and not self.stack
            and (not self._frames or sys.version_info >= (3, 12))
            and self.receiver is not None
        )

    @property
    def visible(self) -> bool:
        if not self.inside or self.receiver is None:
            return False
        innermost = len(self.stack) - 1
        return not any(
            hides for i, (hides, is_class) in enumerate(self.stack) if i == innermost or not is_class
        )

    def attr_of(self, expr: cst.CSTNode) -> str | None:
        """The attribute name if ``expr`` is ``<receiver>.<name>``."""
        if (
            isinstance(expr, cst.Attribute)
            and isinstance(expr.value, cst.Name)
            and identifier(expr.value.value) == self.receiver
            and self.visible
        ):
            return identifier(expr.attr.value)
        return None


# The builtins that reach an attribute by name (of ``ACCESS_BUILTINS``):
# builtin -> (kind, how many arguments it takes, receiver included)
_BY_NAME = {"setattr": ("set", (3,)), "getattr": ("get", (2, 3)), "delattr": ("del", (2,)),
            "hasattr": ("has", (2,))}
# ``object.<dunder>`` / ``super().<dunder>`` -> kind
_BY_DUNDER = {"__setattr__": "set", "__getattribute__": "get", "__delattr__": "del"}


class ScopeVisits:
    """The ``visit_``/``leave_`` methods of every scope node, for a visitor or a
    transformer with a ``scopes`` (``ReceiverScopes``): each enters and leaves it."""

    scopes: ReceiverScopes

    def _enter(self, node: Any) -> None:
        self.scopes.enter(node)

    def _leave(self, original_node: Any, *updated_node: Any) -> Any:
        self.scopes.leave(original_node)
        return updated_node[0] if updated_node else None  # a transformer's node

    visit_FunctionDef = visit_Lambda = visit_ClassDef = _enter
    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _enter
    leave_FunctionDef = leave_Lambda = leave_ClassDef = _leave
    leave_ListComp = leave_SetComp = leave_DictComp = leave_GeneratorExp = _leave


@dataclasses.dataclass(frozen=True)
class NamedAccess:
    """A call that reads, writes or deletes a receiver's attribute by a literal
    name (``setattr(self, "x", v)``, ``object.__getattribute__(self, "x")``,
    ``super().__setattr__("x", v)``, ...). ``name`` as the string spells it
    (never mangled); ``via``: whose hooks it goes through, ``"class"``,
    ``"object"`` (none), ``"super"`` (the next in the MRO) or ``"self"``."""

    kind: str  # "set", "get", "del", "has"
    name: str
    via: str
    spelling: str  # the function as written: "setattr", "object.__setattr__", "super().__setattr__"
    value: cst.BaseExpression | None  # what ``set`` assigns
    has_default: bool  # ``getattr(self, "x", default)``

    def text(self, receiver: str) -> str:
        """How the call reads in an error message: ``delattr(self, 'x')``."""
        args = [repr(self.name), *(["..."] if self.kind == "set" or self.has_default else [])]
        if self.via not in ("super", "self"):
            args.insert(0, receiver)
        return f"{self.spelling}({', '.join(args)})"


def _literal_name(expr: cst.BaseExpression) -> str | None:
    """The attribute a literal string names, if ``self.<it>`` could spell it."""
    if not isinstance(expr, (cst.SimpleString, cst.ConcatenatedString)):
        return None
    value = expr.evaluated_value
    if not isinstance(value, str) or not value.isidentifier() or keyword.iskeyword(value):
        return None
    return None if is_dunder(value) else value


def named_access(
    call: cst.Call, scopes: ReceiverScopes, shadowed: Callable[[], frozenset[str]]
) -> NamedAccess | None:
    """``call`` as a ``NamedAccess`` of the receiver ``scopes`` tracks, else None:
    only plain positional arguments, a literal name and the builtin meaning of
    the function's name (``shadowed()``) count; a computed name is left to the
    run-time guard. Shared by the analysis and the rewriter."""
    func, args = call.func, call.args
    if not args or any(a.star or a.keyword is not None for a in args):
        return None
    if isinstance(func, cst.Name):
        kind, counts = _BY_NAME.get(func.value, (None, ()))
        if kind is None or len(args) not in counts:
            return None
        receiver_arg, rest, via, spelling = args[0], args[1:], "class", func.value
    elif (
        isinstance(func, cst.Attribute)
        and func.attr.value in _BY_DUNDER
        and isinstance(func.value, (cst.Name, cst.Call))
    ):
        kind, owner = _BY_DUNDER[func.attr.value], func.value
        if isinstance(owner, cst.Name) and owner.value == "object":
            receiver_arg, rest, via = args[0], args[1:], "object"
            spelling = f"object.{func.attr.value}"
        elif (
            isinstance(owner, cst.Call)
            and isinstance(owner.func, cst.Name)
            and owner.func.value == "super"
            and not owner.args
            and scopes.in_method_frame
        ):
            receiver_arg, rest, via = None, args, "super"
            spelling = f"super().{func.attr.value}"
        elif (
            isinstance(owner, cst.Name)
            and scopes.attr_of(cst.Attribute(value=owner, attr=cst.Name("_"))) is not None
        ):
            # ``self.__setattr__("x", v)``: the class's own hook, as ``setattr``.
            receiver_arg, rest, via = None, args, "self"
            spelling = f"{owner.value}.{func.attr.value}"
        else:
            return None
        if len(rest) != (2 if kind == "set" else 1):
            return None
    else:
        return None
    if not rest:
        return None
    name = _literal_name(rest[0].value)
    if name is None:
        return None
    if receiver_arg is not None and scopes.attr_of(
        cst.Attribute(value=receiver_arg.value, attr=cst.Name("_"))
    ) is None:
        return None
    if spelling.partition(".")[0].partition("(")[0] in shadowed():
        return None
    value = rest[1].value if kind == "set" else None
    return NamedAccess(kind, name, via, spelling, value, kind == "get" and len(rest) == 2)


def locally_bound(function: cst.FunctionDef, names: frozenset[str] = ACCESS_BUILTINS) -> frozenset[str]:
    """Which of ``names`` the method binds itself (a parameter, a local, a
    ``global`` declaration), so that there they are not the builtins."""
    bound, declared = scope_names(function)
    return frozenset(n for n in names if n in bound or n in declared)


def _subscript_depth(expr: cst.BaseExpression) -> int:
    depth = 0
    while isinstance(expr, cst.Subscript):
        expr, depth = expr.value, depth + 1
    return depth


def inplace_receiver(call: cst.Call) -> cst.BaseExpression | None:
    """What a call of a PyTorch in-place tensor method updates, else None:
    ``self.x`` for ``self.x.mul_(m)``, ``self.x[i]`` for ``self.x[i].add_(v)``,
    also along a chain. Shared by the analysis and the rewrite."""
    func = call.func
    if not isinstance(func, cst.Attribute) or func.attr.value not in INPLACE_TENSOR_METHODS:
        return None
    receiver = func.value
    if isinstance(receiver, cst.Call):
        return inplace_receiver(receiver) or receiver
    return receiver


def _aliased(expr: cst.BaseExpression) -> str | None:
    """The dotted name of the tensor ``expr`` is (``self.x``), or a view of
    in PyTorch (``self.x[i]``, ``self.x.mul_(m)``), else None."""
    if isinstance(expr, cst.Call):
        receiver = inplace_receiver(expr)
        return None if receiver is None else _aliased(receiver)
    return dotted_name(subscript_base(expr))


def _viewed(expr: cst.BaseExpression) -> str | None:
    """The dotted attribute ``expr`` is a view or an iterator of
    (``self.d.values()``, ``iter(self.lst)``, ``enumerate(self.lst)``), else None."""
    if not isinstance(expr, cst.Call):
        return None
    func = expr.func
    if isinstance(func, cst.Attribute) and func.attr.value in VIEW_METHODS and not expr.args:
        return dotted_name(func.value)
    if isinstance(func, cst.Name) and func.value in VIEW_BUILTINS:
        return next((d for arg in expr.args if (d := dotted_name(arg.value)) and "." in d), None)
    return None


def _is_one_of(element: cst.SubscriptElement, names: set[str]) -> bool:
    index = element.slice
    return (
        isinstance(index, cst.Index) and isinstance(index.value, cst.Name)
        and identifier(index.value.value) in names
    )


class _InPlaceAliases(cst.CSTVisitor):
    """Finds the first local that PyTorch would see change when the tensor it
    names is updated in place later (``m = self.x``, ``self.x.mul_(b)``, then a
    read of ``m``), or an in-place call on such a name; here ``m`` keeps its
    value. An item assignment (``self.x[i] = v``, ``self.x[i][j] += v``)
    updates a list, a dict or a PyTorch tensor in place too: a local bound to
    the whole attribute (``m = self.x``) or to a container within it that the
    assignment may reach (``m = self.x[i]``) would see it; one bound to the
    item it replaces keeps the old item. ``problem``: (what, line, fix)."""

    def __init__(self, facts: MethodFacts, line: Callable[[cst.CSTNode], int]):
        super().__init__()
        self.facts = facts
        self.line = line
        self.order = 0
        self.loops: list[int] = []
        # name -> (the dotted name it aliases, the loops around its binding)
        self.aliases: dict[str, tuple[str, tuple[int, ...]]] = {}
        # name -> the subscripts between the attribute and what it is bound
        # to (``m = self.x[i]``: ``[i]``); absent for a view a call made.
        self.items: dict[str, tuple[cst.SubscriptElement, ...]] = {}
        # a loop's iterator (``<for id>``) -> the names its target binds
        self.steps: dict[str, set[str]] = {}
        # name -> the in-place update after which it is stale (its node, spelled)
        self.stale: dict[str, tuple[cst.CSTNode, str]] = {}
        # name -> its reads (node, loops around it) since its binding
        self.reads: dict[str, list[tuple[cst.CSTNode, tuple[int, ...]]]] = {}
        self.skipped: set[int] = set()
        self.shadowed: list[set[str]] = []
        self.problem: tuple[str, int, str] | None = None

    def visit_While(self, node: cst.While) -> None:
        self.loops.append(id(node))

    def leave_While(self, original_node: cst.While) -> None:
        self.loops.pop()

    def leave_For(self, original_node: cst.For) -> None:
        self.loops.pop()
        self.aliases.pop(f"<for {id(original_node)}>", None)

    def visit_Attribute(self, node: cst.Attribute) -> None:
        self.skipped.add(id(node.attr))

    def visit_Arg(self, node: cst.Arg) -> None:
        if node.keyword is not None:
            self.skipped.add(id(node.keyword))

    # Names a nested function's parameters or a comprehension's ``for`` bind
    # are that scope's own: no read of the method's local.
    def _enter_scope(self, node: Any) -> None:
        if node is self.facts.function:
            return
        if isinstance(node, _COMPREHENSIONS):
            self.shadowed.append(_comprehension_names(node))
        else:
            self.shadowed.append(set(_param_names(node.params)))

    def _leave_scope(self, original_node: Any) -> None:
        if original_node is not self.facts.function:
            self.shadowed.pop()

    visit_FunctionDef = visit_Lambda = _enter_scope
    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _enter_scope
    leave_FunctionDef = leave_Lambda = _leave_scope
    leave_ListComp = leave_SetComp = leave_DictComp = leave_GeneratorExp = _leave_scope

    def visit_Param(self, node: cst.Param) -> None:
        self.skipped.add(id(node.name))

    def _bind(self, node: cst.CSTNode, value: cst.BaseExpression | None) -> None:
        self._bind_names([(name, value) for name in binding_names(node)])

    def _bind_names(self, pairs: list[tuple[cst.Name, cst.BaseExpression | None]]) -> None:
        for name, value in pairs:
            self.skipped.add(id(name))
            key = identifier(name.value)
            self.aliases.pop(key, None)
            self.items.pop(key, None)
            self.stale.pop(key, None)
            self.reads.pop(key, None)
            if value is None:
                continue
            aliased = _aliased(value)
            items = subscripts(value)
            if (viewed := _viewed(value)) is not None:
                aliased, items = viewed, ()
            if isinstance(value, cst.Name) and identifier(value.value) in self.aliases:
                aliased = self.aliases[identifier(value.value)][0]
                items = self.items.get(identifier(value.value))
            if aliased is not None and "." in aliased:
                self.aliases[key] = (aliased, tuple(self.loops))
                self.reads[key] = []
                if items is not None:
                    self.items[key] = items

    def _skip_targets(self, node: cst.Assign | cst.AugAssign) -> None:
        self.skipped.update(id(n) for n in binding_names(node))

    visit_Assign = visit_AugAssign = _skip_targets

    def leave_Assign(self, original_node: cst.Assign) -> None:
        for target in original_node.targets:
            self._item_update(target.target, original_node)
        value = original_node.value
        self._bind_names([p for t in original_node.targets for p in unpacked(t.target, value)])

    def leave_AugAssign(self, original_node: cst.AugAssign) -> None:
        self._item_update(original_node.target, original_node)
        self._bind(original_node, None)

    def _item_update(self, target: cst.BaseExpression, node: cst.CSTNode) -> None:
        """``self.x[i] = v``, ``del self.x[i]`` (also within a tuple target):
        an update of ``self.x`` in place, which a local bound to all of it
        would see."""
        if isinstance(target, cst.Tuple | cst.List):
            for element in target.elements:
                self._item_update(element.value, node)
            return
        if not isinstance(target, cst.Subscript) or self.facts.receiver is None:
            return
        updated = dotted_name(subscript_base(target))
        if updated is None or updated.partition(".")[0] != self.facts.receiver:
            return
        doing = "Deleting" if isinstance(node, cst.Del) else "Assigning"
        self._updated(updated, node, f"{doing} an item of `{updated}`", subscripts(target))

    def leave_Del(self, original_node: cst.Del) -> None:  # ``del self.x[i]``
        self._item_update(original_node.target, original_node)

    def leave_AnnAssign(self, original_node: cst.AnnAssign) -> None:
        self._bind(original_node, original_node.value)

    def leave_NamedExpr(self, original_node: cst.NamedExpr) -> None:
        self._bind(original_node, original_node.value)

    def visit_For(self, node: cst.For) -> None:  # (the target binds in the loop)
        self._bind(node, None)
        # The loop's iterator: an alias of what it iterates over, read by
        # every step (``for v in self.x``, ``for k, v in self.d.items()``),
        # which an item assignment of the step's own key or index does not
        # change (the iterator has passed it).
        iterated = _viewed(node.iter)
        items: tuple[cst.SubscriptElement, ...] | None = ()
        if iterated is None:
            iterated, items = dotted_name(node.iter), subscripts(node.iter)
        if isinstance(node.iter, cst.Name) and identifier(node.iter.value) in self.aliases:
            iterated = self.aliases[identifier(node.iter.value)][0]
            items = self.items.get(identifier(node.iter.value))
        bound_in = tuple(self.loops)
        self.loops.append(id(node))
        if iterated is not None and "." in iterated and items is not None:
            key = f"<for {id(node)}>"
            self.aliases[key] = (iterated, bound_in)
            self.items[key] = items
            self.reads[key] = [(node, tuple(self.loops))]
            self.steps[key] = {identifier(n.value) for n in name_nodes(node.target)}

    def visit_Name(self, node: cst.Name) -> None:
        name = identifier(node.value)
        if id(node) in self.skipped or name not in self.aliases or self.problem:
            return
        if any(name in names for names in self.shadowed):
            return
        if name in self.stale:
            self._refuse(name, self.stale[name], node)
        else:
            self.reads[name].append((node, tuple(self.loops)))

    def leave_Call(self, original_node: cst.Call) -> None:
        receiver = inplace_receiver(original_node)
        if receiver is None or self.problem:
            return
        base = subscript_base(receiver)
        if isinstance(base, cst.Name) and identifier(base.value) in self.aliases:
            name = identifier(base.value)
            method = original_node.func.attr.value  # type: ignore[attr-defined]
            target = self.aliases[name][0]
            self.problem = (
                f"`{name}.{method}(...)` updates local `{name}` in place, which PyTorch would "
                f"see as an update of `{target}` (`{name}` is bound to it); here `{name}` is a "
                "value of its own, and the update would not reach the model.",
                self.line(original_node),
                f"call it on the attribute: `{target}.{method}(...)`.",
            )
            return
        updated = dotted_name(base)
        if updated is None:
            return
        method = original_node.func.attr.value  # type: ignore[attr-defined]
        self._updated(updated, original_node, f"`{updated}.{method}(...)`", None)

    def _updated(
        self, updated: str, node: cst.CSTNode, spelled: str,
        item: tuple[cst.SubscriptElement, ...] | None,
    ) -> None:
        """``updated`` changes in place at ``node`` (``spelled``; ``item``:
        the subscripts an item assignment assigns, None for a tensor method):
        the locals bound to it are stale from here on, and one read in a loop
        around both already saw the update."""
        for name, (aliased, bound_in) in self.aliases.items():
            if aliased != updated or (item is not None and not reaches_within(self.items.get(name), item)):
                continue
            if (
                item is not None and name in self.steps and not isinstance(node, cst.Del)
                and _is_one_of(item[0], self.steps[name])
            ):
                continue  # (a delete moves the later items, or changes a dict's size)
            self.stale.setdefault(name, (node, spelled))
            for read, loops in self.reads[name]:
                shared = [loop for loop in loops if loop in self.loops and loop not in bound_in]
                if shared:
                    self._refuse(name, (node, spelled), read)
                    return

    def _refuse(self, name: str, update: tuple[cst.CSTNode, str], read: cst.CSTNode) -> None:
        aliased = self.aliases[name][0]
        node, spelled = update
        if name in self.steps:
            self.problem = (
                f"{spelled} updates `{aliased}` in place inside the `for` loop (line "
                f"{self.line(read)}) that iterates over it: in plain Python the loop's later "
                "steps would see the update, here they take the values the loop started with.",
                self.line(node),
                f"iterate over a copy where the values at the loop's start are meant (`for v in "
                f"list({aliased})`, `list({aliased}.items())`), or read `{aliased}[i]` inside the "
                "loop where the updated ones are meant.",
            )
            return
        # A tensor method's update is PyTorch's; an item assignment's, plain Python's too.
        tensor = isinstance(node, cst.Call)
        where = "PyTorch" if tensor else "plain Python (and PyTorch)"
        copies = "" if tensor else f", `list({aliased})` or `dict({aliased})` for a container"
        self.problem = (
            f"{spelled} updates `{aliased}` in place while local `{name}` is "
            f"bound to it{' (to a container within it)' if self.items.get(name) else ''} "
            f"and read afterwards (line {self.line(read)}): in {where} `{name}` would see the "
            "update, here it keeps the value it was given.",
            self.line(node),
            f"take a copy where the old value is meant (`{name} = jnp.array({aliased})`, "
            f"PyTorch's `.clone()`{copies}), or read `{aliased}` again where the new one is "
            f"meant; or write the update functionally (`{aliased} = ...`), which `{name}` "
            f"does not follow in {'PyTorch' if tensor else 'Python'} either.",
        )


class _Positions:
    """Start lines of a parsed method's nodes, computed on first use (libcst
    regenerates every node's code for them: a third of a cold decoration)."""

    def __init__(self, module: cst.Module, shift: int):
        self.module = module
        self.shift = shift
        self._lines: Any = None

    def line(self, node: cst.CSTNode) -> int:
        if self._lines is None:
            wrapper = MetadataWrapper(self.module, unsafe_skip_copy=True)
            self._lines = wrapper.resolve(PositionProvider)
        return int(self._lines[node].start.line) + self.shift


@functools.total_ordering
class Line:
    """A fact's line in the user's file; an int once read (``int``, ``str``, ``==``)."""

    __slots__ = ("_positions", "_node")

    def __init__(self, positions: _Positions, node: cst.CSTNode):
        self._positions = positions
        self._node = node

    def __int__(self) -> int:
        return self._positions.line(self._node)

    __index__ = __int__

    def __str__(self) -> str:
        return str(int(self))

    __repr__ = __str__

    def __format__(self, spec: str) -> str:
        return format(int(self), spec)

    def __eq__(self, other: object) -> bool:
        return int(self) == (int(other) if isinstance(other, (int, Line)) else other)

    def __lt__(self, other: int | Line) -> bool:
        return int(self) < int(other)

    def __hash__(self) -> int:
        return hash(int(self))


class _FactCollector(ScopeVisits, cst.CSTVisitor):
    def __init__(self, facts: MethodFacts, class_name: str, shift: int):
        super().__init__()
        self.facts = facts
        self.class_name = class_name
        self.positions = _Positions(facts.module, shift)
        self.scopes = ReceiverScopes(facts.function, facts.receiver)
        self._shadowed: frozenset[str] | None = None

    def shadowed(self) -> frozenset[str]:
        if self._shadowed is None:  # walks the method: only once a candidate call is seen
            self._shadowed = self.facts.shadowed_outside | locally_bound(self.facts.function)
        return self._shadowed

    def _line(self, node: cst.CSTNode) -> int:
        return Line(self.positions, node)  # type: ignore[return-value]

    def _attr(self, expr: cst.CSTNode) -> str | None:
        attr = self.scopes.attr_of(expr)
        return mangle(self.class_name, attr) if attr is not None else None

    # scopes (the rest are ``ScopeVisits``')
    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        if node is self.facts.function:
            self.facts.is_async = node.asynchronous is not None
        self._binds(node)  # a nested ``def self():`` binds in the enclosing scope
        self.scopes.enter(node)

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self._binds(node)
        self.scopes.enter(node)

    # bindings of the receiver's name (every form ``binding_names`` knows)
    def _binds(self, node: cst.CSTNode) -> None:
        if not self.scopes.visible:
            return
        for name in binding_names(node):
            if identifier(name.value) == self.facts.receiver:
                self.facts.rebinds.append(self._line(name))

    visit_Import = visit_ImportFrom = visit_ExceptHandler = visit_ExceptStarHandler = _binds
    visit_MatchAs = visit_MatchStar = visit_MatchMapping = visit_TypeAlias = _binds

    # targets
    def _target(
        self, expr: cst.BaseExpression, kind: str, value: cst.BaseExpression | None = None
    ) -> None:
        if isinstance(expr, (cst.Tuple, cst.List)):
            for element in expr.elements:
                self._target(element.value, kind)
            return
        if isinstance(expr, cst.StarredElement):
            self._target(expr.value, kind)
            return
        item = isinstance(expr, cst.Subscript)
        attr = self._attr(subscript_base(expr))
        if attr is not None and not is_dunder(attr):
            self.facts.assignments.append(Assignment(
                attr, self._line(expr), "item" if item else kind, self.scopes.nested,
                None if item else value, expr if item else None,
            ))

    def visit_Assign(self, node: cst.Assign) -> None:
        self._binds(node)
        for target in node.targets:
            self._target(target.target, "set", node.value)
        if len(node.targets) == 1 and isinstance(node.value, cst.Call):
            attr = self._attr(node.targets[0].target)
            func = dotted_name(node.value.func)
            if attr is not None and func is not None and not is_dunder(attr):
                self.facts.declarations[attr] = (func, self._line(node))

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        self._binds(node)
        self._target(node.target, "aug")

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        if node.value is not None:
            self._binds(node)
            self._target(node.target, "set", node.value)

    def _binds_target(self, node: cst.For | cst.NamedExpr) -> None:
        self._binds(node)
        self._target(node.target, "set")

    visit_For = visit_NamedExpr = _binds_target

    def visit_CompFor(self, node: cst.CompFor) -> None:
        self._target(node.target, "set")

    def visit_WithItem(self, node: cst.WithItem) -> None:
        self._binds(node)
        if node.asname is not None:
            self._target(node.asname.name, "set")

    def visit_Del(self, node: cst.Del) -> None:
        self._binds(node)
        targets = node.target.elements if isinstance(node.target, (cst.Tuple, cst.List)) else None
        for expr in [e.value for e in targets] if targets is not None else [node.target]:
            attr = self._attr(expr)
            if attr is not None:
                self.facts.deletes.append((attr, self._line(expr)))
            elif isinstance(expr, cst.Subscript):
                self._target(expr, "item")

    # reads and calls
    def visit_Attribute(self, node: cst.Attribute) -> None:
        attr = self._attr(node)
        if attr is not None:
            self.facts.reads.setdefault(attr, self._line(node))
        elif self._is_own_class(node.value):
            self.facts.self_calls.add(mangle(self.class_name, identifier(node.attr.value)))

    def _is_own_class(self, expr: cst.BaseExpression) -> bool:
        """``type(self)``, ``self.__class__`` or the class's own name: what
        ``type(self).reset(self)`` takes a method from."""
        if isinstance(expr, cst.Name):
            return identifier(expr.value) == self.class_name
        if isinstance(expr, cst.Call):
            return (
                isinstance(expr.func, cst.Name)
                and expr.func.value == "type"
                and len(expr.args) == 1
                and self.scopes.attr_of(cst.Attribute(value=expr.args[0].value, attr=cst.Name("_")))
                is not None
            )
        return self.scopes.attr_of(expr) == "__class__"

    def visit_Call(self, node: cst.Call) -> None:
        func = node.func
        access = named_access(node, self.scopes, self.shadowed)
        if access is not None and access.kind == "set":
            # ``setattr(self, "x", v)`` is ``self.x = v`` (no mangling: a string).
            self.facts.assignments.append(
                Assignment(access.name, self._line(node), "set", self.scopes.nested, access.value)
            )
            value = access.value
            if isinstance(value, cst.Call) and (dotted := dotted_name(value.func)) is not None:
                self.facts.declarations[access.name] = (dotted, self._line(node))
        elif access is not None and access.kind == "get":
            self.facts.reads.setdefault(access.name, self._line(node))
        elif access is not None and access.kind == "del":
            self.facts.named_deletes.append((access, self._line(node)))
        elif isinstance(func, cst.Name) and func.value in ("setattr", "getattr", "delattr", "hasattr"):
            # ``hasattr(self, "x")`` and the forms above the rewrite cannot
            # follow (a name ``self.<it>`` cannot spell, extra arguments).
            if len(node.args) >= 2 and func.value not in self.shadowed() and self.scopes.attr_of(
                cst.Attribute(value=node.args[0].value, attr=cst.Name("_"))
            ):
                literal = node.args[1].value
                if isinstance(literal, cst.SimpleString):
                    self.facts.reflective.append(
                        (func.value, literal.evaluated_value, self._line(node))  # type: ignore[arg-type]
                    )
        for expr in (func, *(arg.value for arg in node.args)):
            dotted = dotted_name(expr)
            if dotted is not None:
                self.facts.references.add(dotted)
        attr = self._attr(func)
        if attr is not None:
            self.facts.self_calls.add(attr)
            if attr in _DECLARING_METHODS:
                self._declared_buffer(node)
        receiver = inplace_receiver(node)
        if receiver is not None:
            self.facts.updates_in_place = True
            attr = self._attr(subscript_base(receiver))
            if attr is not None and not is_dunder(attr):
                # ``self.x.mul_(m)``: a write of ``x``, as ``self.x = self.x * m``.
                self.facts.assignments.append(
                    Assignment(attr, self._line(node), "inplace", self.scopes.nested, node)
                )
        if (
            isinstance(func, cst.Attribute) and func.attr.value in IN_PLACE_METHODS
            and not is_dunder(func.attr.value)  # (``__setitem__`` on a state: threaded)
        ):
            owner = self._attr(subscript_base(func.value))
            if owner is not None:
                self.facts.mutating_calls.append((owner, func.attr.value, self._line(node)))
                self.facts.mutating_depths.append(_subscript_depth(func.value))

    def _declared_buffer(self, node: cst.Call) -> None:
        """``self.register_buffer("x", v, ...)``: a write of ``x`` that declares it."""
        positional = [a.value for a in node.args if a.keyword is None and a.star == ""]
        named = {a.keyword.value: a.value for a in node.args if a.keyword is not None}
        name_expr = positional[0] if positional else named.get("name")
        name = _literal_name(name_expr) if name_expr is not None else None
        if name is None:
            return  # a computed name: ``Module.register_buffer`` checks it at run time
        self.facts.buffers.setdefault(name, self._line(node))

    def visit_Decorator(self, node: cst.Decorator) -> None:
        dotted = dotted_name(node.decorator)
        if dotted is not None:
            self.facts.references.add(dotted)

    def visit_Yield(self, node: cst.Yield) -> None:
        if not self.scopes.nested:
            self.facts.is_generator = True


def collect_facts(
    class_name: str, source: MethodSource, shadowed: frozenset[str] = frozenset()
) -> MethodFacts:
    """Parses one method and collects how it uses its receiver.

    ``shadowed``: the names of ``ACCESS_BUILTINS`` the method's globals bind
    to something else (``setattr(self, "x", v)`` is no write there).
    """
    text, shift = wrapper_source(class_name, source)
    module = _parse(text, shift, class_name, source)
    function = _method_node(module, class_name, source)
    receiver = receiver_name(function) if source.has_receiver else None
    facts = MethodFacts(
        source=source, receiver=receiver, module=module, function=function, text=text, shift=shift,
        shadowed_outside=shadowed | (ACCESS_BUILTINS & frozenset(source.freevars)),
        runtime=runtime_name(source.text),
    )
    collector = _FactCollector(facts, source.mangle_as or class_name, shift)
    walk.visit(module, collector)
    if facts.updates_in_place or any(a.kind == "item" for a in facts.assignments):
        aliases = _InPlaceAliases(facts, collector._line)
        walk.visit(function, aliases)
        facts.alias_problem = aliases.problem
    return facts


def without_decorator_helpers(class_name: str, methods: Sequence[MethodFacts]) -> list[MethodFacts]:
    """``methods``, where a function the class body uses as a decorator above a
    ``def`` of the same body is taken as having no receiver: it ran on the
    function below it, so what it assigns is no state."""
    used: dict[tuple[str, str], int] = {}  # (file, name) -> the last line it decorates
    for facts in methods:
        for decorator in facts.function.decorators:
            expr = decorator.decorator
            expr = expr.func if isinstance(expr, cst.Call) else expr
            if isinstance(expr, cst.Name):
                name = mangle(facts.source.mangle_as or class_name, identifier(expr.value))
                key = (facts.source.filename, name)
                used[key] = max(used.get(key, 0), facts.source.first_line)
    return [
        collect_facts(
            class_name,
            dataclasses.replace(facts.source, has_receiver=False),
            facts.shadowed_outside,
        )
        if facts.receiver is not None
        and facts.source.first_line < used.get((facts.source.filename, facts.source.key), 0)
        else facts
        for facts in methods
    ]


def _fail(class_name: str, what: str, source: MethodSource, line: int, fix: str) -> DecorationError:
    return DecorationError(format_error(
        f"@stateful cannot rewrite class {class_name}: {what}",
        where=f"{source.filename}:{line} (in {class_name}.{source.key})",
        fix=fix,
    ))


def may_be_object(
    value: cst.BaseExpression | None, depth: int, bound: Callable[[], frozenset[str]],
    declared: Callable[[str], bool],
) -> bool:
    """Whether ``value`` (its items ``depth`` subscripts deep) may be an object
    with methods of its own, such as a sub-model: anything but what its
    spelling shows to be a container, an array, a literal or ``None`` (and no
    expression at all may be one). ``bound()``: constructor names the method
    binds; ``declared(dotted)``: whether ``dotted(...)`` is ``autostate.state``."""
    if value is None:
        return True
    if isinstance(value, cst.Call):
        dotted = dotted_name(value.func)
        if dotted is None:
            return True
        if declared(dotted):
            return may_be_object(_declared_value(value), depth, bound, declared)
        head = dotted.partition(".")[0]
        if dotted in _CONTAINER_CONSTRUCTORS or head in _ARRAY_MODULES:
            # Items a call builds are not spelled here.
            return depth > 0 or head in bound()
        return True
    if depth > 0:
        if isinstance(value, (cst.List, cst.Tuple, cst.Dict)):
            items = [e.value if isinstance(e, (cst.Element, cst.DictElement)) else None
                     for e in value.elements]
        elif isinstance(value, cst.ListComp):
            items = [value.elt]
        elif isinstance(value, cst.DictComp):
            items = [value.value]
        else:
            items = []
        # ``[]`` has no items to show anything of; ``[*xs]`` has unknown ones.
        return not items or any(may_be_object(i, depth - 1, bound, declared) for i in items)
    if isinstance(value, cst.IfExp):
        return any(may_be_object(v, 0, bound, declared) for v in (value.body, value.orelse))
    if isinstance(value, cst.Name):
        return value.value not in ("None", "True", "False")
    # Arithmetic gives an array (or a number, a container) whatever its
    # operands; ``a or b`` gives one of them.
    return not isinstance(
        value,
        (*_CONTAINER_DISPLAYS, *_LITERALS, cst.BinaryOperation, cst.UnaryOperation,
         cst.Comparison),
    )


def holds_plain_values(
    attr: str, methods: Sequence[MethodFacts], depth: int = 0,
    is_state_declaration: Callable[[MethodFacts, str], bool] = lambda facts, func: False,
) -> bool:
    """Whether no value the methods assign to ``attr`` (``depth`` subscripts deep)
    may be an object with methods (``may_be_object``), and there is one: source
    shows no types, and ``self.ema.update(x)`` changes a container in place
    only if ``ema`` holds one."""
    heads = frozenset(name.partition(".")[0] for name in _CONTAINER_CONSTRUCTORS | _ARRAY_MODULES)
    found = False
    for facts in methods:
        if facts.receiver is None:
            continue
        bound = functools.cache(functools.partial(locally_bound, facts.function, heads))
        declared = functools.partial(is_state_declaration, facts)
        for assignment in facts.assignments:
            if assignment.attr != attr:
                continue
            if assignment.kind != "set":
                # ``self.x += v`` and ``self.x[k] = v`` keep the kind of value
                # ``self.x`` holds (a container's in-place operators return
                # itself), but may put any item into it.
                if depth > 0:
                    return False
                continue
            if may_be_object(assignment.value, depth, bound, declared):
                return False
            found = True
    return found


def holds_jax_arrays(attr: str, methods: Sequence[MethodFacts]) -> bool:
    """Whether every value the methods assign to ``attr`` is, by its spelling, a
    JAX array (``jnp.*``, ``jax.*``, ``lax.*``), and there is one: then an item
    write needs the functional update."""
    found = False
    for facts in methods:
        if facts.receiver is None:
            continue
        for assignment in facts.assignments:
            if assignment.attr != attr or assignment.kind != "set":
                continue
            value = assignment.value
            dotted = dotted_name(value.func) if isinstance(value, cst.Call) else None
            head = None if dotted is None else dotted.partition(".")[0]
            if head not in _JAX_MODULES or head in locally_bound(facts.function, _JAX_MODULES):
                return False
            found = True
    return found


_JAX_MODULES = frozenset({"jnp", "jax", "lax"})


def _declared_value(call: cst.Call) -> cst.BaseExpression | None:
    """The value of ``autostate.state(value, ...)`` as the call spells it."""
    for arg in call.args:
        if arg.keyword is None and arg.star == "":
            return arg.value
        if arg.keyword is not None and arg.keyword.value == "value":
            return arg.value
    return None


def analyze_class(
    class_name: str, methods: Sequence[MethodFacts], *,
    inherited_state: frozenset[str] = frozenset(),
    inherited_initialized: frozenset[str] = frozenset(),
    is_state_declaration: Callable[[MethodFacts, str], bool] = lambda facts, func: False,
    inherited_properties: frozenset[str] = frozenset(),
    declaring_methods: frozenset[str] = frozenset(),
    inherited_constructs: frozenset[str] = frozenset(),
) -> ClassAnalysis:
    """Decides the state set of a class from the facts of its methods.

    A nested function or lambda that assigns state is accepted: its writes
    are threaded at run time (``autostate.lifting``, or the host store).

    Args:
        class_name: the class's name, for error messages.
        methods: facts of every function defined in the class body.
        inherited_state: state attributes of decorated base classes.
        inherited_initialized: attributes that base ``__init__``s assign.
        is_state_declaration: ``(facts, dotted)``: whether the call
            ``dotted(...)`` in that method is ``autostate.state`` (resolved by
            the caller, which has the globals).
        inherited_properties: properties of base classes; like the class's
            own properties they are never state (assigning one calls its
            setter).
        declaring_methods: the class's methods that declare a state by a
            literal name (``{"register_buffer"}`` for ``autostate.nn.Module``):
            ``self.register_buffer("x", v)`` anywhere is ``self.x =
            autostate.constant(v)``.
        inherited_constructs: the names the bases' construction reaches on
            the receiver (``ClassAnalysis.constructs``): this class's methods
            of those names run when an instance is built.

    Returns:
        The state set and what construction initializes.

    Raises:
        DecorationError: for every construct the engine cannot express,
            naming the class, attribute, file:line and the fix.
    """
    declared: dict[str, str] = {}
    # Property parts have keys like "value.fset"; what their setter assigns is
    # state, the property itself stays a property.
    properties = {f.source.attr for f in methods if f.source.key.endswith((".fget", ".fset", ".fdel"))}
    # A property of this class over a base's state (``scale`` made a clamping
    # property): the name is the property here, what its setter assigns the state.
    state: set[str] = set(inherited_state) - properties
    properties |= inherited_properties
    for facts in methods:
        if facts.receiver is None:
            continue
        is_init = facts.source.attr == "__init__"
        for assignment in facts.assignments:
            if not is_init and assignment.attr not in properties:
                state.add(assignment.attr)
        state.update(attr for attr in _buffers(facts, declaring_methods) if attr not in properties)
        if is_init:
            for attr, (func, _line) in facts.declarations.items():
                if attr not in properties and is_state_declaration(facts, func):
                    state.add(attr)
                    declared[attr] = func

    by_attr: dict[str, list[MethodFacts]] = {}
    for facts in methods:
        by_attr.setdefault(facts.source.attr, []).append(facts)

    # Attributes that PyTorch's in-place methods update (``self.x.mul_(m)``),
    # or an item assignment outside ``__init__`` (``self.x[i] = v``): a list,
    # a dict or a PyTorch tensor changes in place there.
    updated_in_place: dict[str, list[tuple[MethodFacts, Assignment]]] = {}
    for facts in methods:
        for a in facts.assignments:
            if facts.receiver is not None and (
                a.kind == "inplace" or (a.kind == "item" and facts.source.attr != "__init__")
            ):
                updated_in_place.setdefault(a.attr, []).append((facts, a))
    for facts in methods:
        src = facts.source
        if facts.alias_problem is not None:
            what, line, fix = facts.alias_problem
            raise _fail(class_name, what, src, line, fix)
        for assignment in facts.assignments if updated_in_place else ():
            if assignment.kind != "set" or assignment.value is None:
                continue
            aliased = _aliased(assignment.value)
            head, _, attr = (aliased or "").partition(".")
            if head != facts.receiver or attr == assignment.attr:
                continue
            # Either side updated in place: the other sees it in plain Python
            # (``self.y = self.x`` then ``self.x[i] = v`` or ``self.y[i] = v``);
            # an item assignment of ``self.x`` reaches an alias of one of its
            # items only through it (``self.y = self.x[0]``, ``self.x[0][j] = v``).
            items = subscripts(assignment.value)
            found = next((
                (updated, where, update)
                for updated in (attr, assignment.attr)
                for where, update in updated_in_place.get(updated, ())
                if update.kind != "item" or (
                    update.target is not None and reaches_within(items, subscripts(update.target))
                    if updated == attr else items is not None
                )
            ), None)
            if found is None:
                continue
            updated, where, update = found
            spelled = (
                f"`{where.receiver}.{updated}[...] = ...`" if update.kind == "item"
                else f"`{where.receiver}.{updated}.{update.value.func.attr.value}(...)`"  # type: ignore[union-attr]
            )
            other = f"{facts.receiver}.{assignment.attr}" if updated == attr else str(aliased)
            raise _fail(
                class_name,
                f"`{facts.receiver}.{assignment.attr} = "
                f"{cst.Module([]).code_for_node(assignment.value)}` keeps a second reference to "
                f"state {updated!r}, which {spelled} updates in place "
                f"({where.source.filename}:{update.line}): in "
                f"{'PyTorch' if update.kind == 'inplace' else 'plain Python (and PyTorch)'} "
                f"`{other}` would see every such update, here it keeps the value it was given.",
                src, assignment.line,
                f"read `{facts.receiver}.{updated}` where its current value is meant (a @property "
                f"`{other.partition('.')[2]}` returning it), or assign a copy where the value of "
                f"this moment is meant (`jnp.array({aliased})`, PyTorch's `.clone()`, "
                f"`list({aliased})` or `dict({aliased})` for a container).",
            )
        touched = facts.touched() & state
        receiver = facts.receiver
        deletes = [(attr, line, f"`del {receiver}.{attr}` deletes state {attr!r}")
                   for attr, line in facts.deletes]
        deletes += [
            (a.name, line, f"`{a.text(receiver or 'self')}` deletes state {a.name!r}, as "
             f"`del {receiver}.{a.name}` does")
            for a, line in facts.named_deletes
        ]
        for attr, line, what in deletes:
            if attr in state:
                raise _fail(
                    class_name, f"{what}; a state cannot be removed from a pure function's inputs.",
                    src, line,
                    f"assign a placeholder instead (`{receiver}.{attr} = None`) or keep the attribute.",
                )
        for func, attr, line in facts.reflective:
            if attr not in state:
                continue
            if func == "hasattr":
                raise _fail(
                    class_name,
                    f"`hasattr({facts.receiver}, {attr!r})` tests state {attr!r} by name; a state "
                    "exists from __init__ on, so the rewrite has no test to follow.",
                    src, line,
                    f"drop the test, and give the state its initial value in __init__ "
                    f"(`{facts.receiver}.{attr} = jnp.zeros(...)`).",
                )
            raise _fail(
                class_name,
                f"`{func}({receiver}, {attr!r}, ...)` accesses state {attr!r} by name, "
                "which the rewrite cannot follow.",
                src, line, f"use `{receiver}.{attr}` directly.",
            )
        if src.attr != "__init__":
            for (attr, method, line), depth in zip(
                facts.mutating_calls, facts.mutating_depths, strict=True
            ):
                # Refused only where the value cannot be a sub-model or another
                # object whose ``update`` is its own. Otherwise the call runs,
                # and should the value be a container state after all, the run
                # time threads the change (each call copies it in and returns
                # what it holds at the end) or refuses it where it cannot (a
                # lax body, an unhandled category under jax.jit).
                if attr in state and holds_plain_values(attr, methods, depth, is_state_declaration):
                    raise _fail(
                        class_name,
                        f"`{facts.receiver}.{attr}.{method}(...)` mutates state {attr!r} in "
                        "place, which a pure function cannot see.",
                        src, line,
                        f"assign a new value instead, e.g. "
                        f"`{_rebuilt(f'{facts.receiver}.{attr}', method)}`.",
                    )
        if touched and facts.rebinds:
            raise _fail(
                class_name,
                f"the receiver `{facts.receiver}` is rebound in a method that uses state "
                f"{sorted(touched)[0]!r}.",
                src, facts.rebinds[0],
                f"use another local name instead of reassigning `{facts.receiver}`.",
            )
        if touched and (facts.is_async or facts.is_generator):
            kind = "async" if facts.is_async else "generator"
            raise _fail(
                class_name,
                f"{kind} method {src.key!r} uses state {sorted(touched)[0]!r}; its body runs "
                "after the call that handles state has returned.",
                src, facts.reads.get(sorted(touched)[0], src.first_line),
                "move the state access into a regular (non-async) method and call it "
                "before awaiting"
                if facts.is_async
                else "return a list (or a tuple) instead of yielding, or move the state "
                "access into a regular method.",
            )

    initialized = set(inherited_initialized)
    # A base's __init__ assigning a name this class makes a property runs
    # the property's setter (``self.scale = v`` into ``self._scale``).
    pending = ["__init__", *sorted(inherited_initialized & properties), *sorted(inherited_constructs)]
    visited: set[str] = set()
    while pending:
        attr = pending.pop()
        if attr in visited:
            continue
        visited.add(attr)
        for facts in by_attr.get(attr, ()):
            if facts.receiver is None:
                continue
            for assignment in facts.assignments:
                initialized.add(assignment.attr)
                pending.append(assignment.attr)  # property setters
            initialized.update(_buffers(facts, declaring_methods))
            # Whatever the method takes from its receiver may run: a call
            # (``self.reset()``), a bound method kept (``r = self.reset``), a
            # property read; and methods taken from its class (``self_calls``).
            pending.extend(facts.self_calls)
            pending.extend(facts.reads)
    for attr in sorted(state - initialized):
        for facts in methods:
            first = next((a for a in facts.assignments if a.attr == attr), None)
            if first is not None:
                error = _fail(
                    class_name,
                    f"state {attr!r} is first assigned outside __init__; every state needs an "
                    f"initial value when the model is built, and no `self.{attr} = ...` runs in "
                    "__init__ or a method it calls (setattr with a computed name and "
                    "self.__dict__ updates are not read).",
                    facts.source, first.line,
                    f"assign an initial value in __init__, e.g. `self.{attr} = jnp.zeros(...)` "
                    f"(or `self.{attr} = autostate.state(...)`).",
                )
                raise error
    return ClassAnalysis(
        class_name, frozenset(state), declared, tuple(methods), frozenset(initialized),
        frozenset(visited),
    )


def _buffers(facts: MethodFacts, declaring_methods: frozenset[str]) -> list[str]:
    """What ``self.register_buffer("x", ...)`` calls declare, where the class's
    ``register_buffer`` declares (else nothing: a method of the user's own)."""
    return list(facts.buffers) if "register_buffer" in declaring_methods else []


def _rebuilt(target: str, method: str) -> str:
    """An assignment that makes the change of ``target.method(...)`` as a new value."""
    if method in ("update", "setdefault", "pop", "popitem", "clear", "__setitem__", "__delitem__"):
        return f'{target} = {{**{target}, "key": value}}'
    if method in ("add", "discard", "remove", "difference_update", "intersection_update"):
        return f"{target} = {target} | {{item}}"
    return f"{target} = {target} + [item]"

