"""The libcst transformer: state reads and writes become runtime calls.

It only rewrites what ``analysis.py`` decided is state, and every rewrite
stays on the line it came from: ``self.x`` becomes ``__autostate__.get(self,
"x")``, ``self.x = v`` ``__autostate__.set(self, "x", v)``, and so on (the
table of rules with the generated code is ``docs/rewrite_rules.md``
section 2). Where a rewrite leaves out source that spanned lines, the new
code holds as many line breaks in its place (``_keep_lines``), so the code
after it keeps its line.

No JAX here: the runtime the generated code calls is ``autostate.runtime``,
a closure variable named ``__autostate__`` (``__autostate_1__``, ... in a
method whose text uses that name: ``method.runtime_name``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import libcst as cst

from autostate.transform import walk
from autostate.transform.analysis import (
    RUNTIME_NAME,
    NamedAccess,
    ReceiverScopes,
    ScopeVisits,
    inplace_receiver,
    locally_bound,
    mangle,
    named_access,
)
from autostate.transform.method import INPLACE_OPERATORS, SCOPE_LISTERS
from autostate.transform.syntax import dotted_name, subscript_base


def _string(value: str, avoid: frozenset[str] = frozenset()) -> cst.SimpleString:
    # Before Python 3.12 an f-string expression cannot reuse the f-string's
    # own quote character, so reads inside f-strings pick the other one.
    quote = "'" if '"' in avoid else '"'
    return cst.SimpleString(f"{quote}{value}{quote}")


# Renders a node on its own: a newline in brackets comes without the indent
# of the block around it, so only the line count of such text is exact.
_CODE = cst.Module(body=[])


def _code(*nodes: cst.CSTNode) -> str:
    return "".join(_text(node) for node in nodes)


def _text(node: cst.CSTNode) -> str:
    # Most of what a rewrite leaves out is ``self.x =``, spelled out here:
    # libcst's code generation of it was a tenth of a method's rewrite.
    if isinstance(node, cst.SimpleWhitespace):
        return node.value
    if isinstance(node, cst.Name) and not node.lpar:
        return node.value
    if isinstance(node, cst.Dot):
        return _text(node.whitespace_before) + "." + _text(node.whitespace_after)
    if isinstance(node, cst.Attribute) and not node.lpar:
        return _text(node.value) + _text(node.dot) + node.attr.value
    if isinstance(node, cst.AssignTarget):
        return _code(node.target, node.whitespace_before_equal) + "=" + _text(node.whitespace_after_equal)
    return _CODE.code_for_node(node)


def _annotation_code(annotation: cst.Annotation) -> str:
    # An annotation renders only with its indicator given (``:`` here).
    before = annotation.whitespace_before_indicator
    return (
        (_code(before) if isinstance(before, cst.CSTNode) else "")
        + ":" + _code(annotation.whitespace_after_indicator, annotation.annotation)
    )


def _line_breaks(
    dropped: str, *, moved: int = 0, then: int = 0, bracketed: bool = False
) -> cst.BaseParenthesizableWhitespace | None:
    """Whitespace holding the line breaks of ``dropped``, source a rewrite left
    out, less ``moved`` breaks whose code it kept elsewhere; None if none are left.

    Plain newlines where the whitespace is ``bracketed`` (inside the new
    call's parentheses, or an f-string's braces, where a backslash is a
    syntax error before Python 3.12), else backslash continuations. The last
    line is indented to where the left-out source ended, less the ``then``
    characters the rewrite writes there, so that a continued line can read
    as the user's does (the loader keeps a traceback's columns only on such
    lines).
    """
    lines = dropped.count("\n") - moved
    if lines <= 0:
        return None
    indent = " " * max(len(dropped.rsplit("\n", 1)[1]) - then, 0)
    if not bracketed:
        return cst.SimpleWhitespace(" \\\n" * lines + indent)
    return cst.ParenthesizedWhitespace(
        empty_lines=[cst.EmptyLine(indent=False)] * (lines - 1),
        indent=False,
        last_line=cst.SimpleWhitespace(indent),
    )


def _keep_lines(call: cst.Call, dropped: str, *, before: int, moved: int = 0) -> cst.Call:
    """``call`` with the line breaks of ``dropped`` (see ``_line_breaks``) just
    before its argument ``before``, or after the last one when ``before`` is
    their number: where the left-out source was, relative to the arguments
    kept from it, so each kept argument stays on its line where the order allows."""
    after_last = before == len(call.args)
    breaks = _line_breaks(dropped, moved=moved, then=1 if after_last else 0, bracketed=True)
    if breaks is None:
        return call
    if before == 0:
        return call.with_changes(whitespace_before_args=breaks)
    args = list(call.args)
    if after_last:
        args[-1] = args[-1].with_changes(whitespace_after_arg=breaks)
    else:
        args[before - 1] = args[before - 1].with_changes(comma=cst.Comma(whitespace_after=breaks))
    return call.with_changes(args=args)


def _present(node: cst.CSTNode | cst.MaybeSentinel) -> tuple[cst.CSTNode, ...]:
    return (node,) if isinstance(node, cst.CSTNode) else ()


def _statement(call: cst.Call, replaced: cst.BaseSmallStatement) -> cst.Expr:
    # The ``;`` after the statement, with its whitespace, stays.
    return cst.Expr(call, semicolon=replaced.semicolon)


def _narrowed(expr: cst.BaseExpression) -> cst.BaseExpression:
    """A dotted name broken over lines (``lax \\\n    .scan``) with one space
    less before its last dot, where it has one: the ``)`` that closes the
    routing call after it keeps what follows in its column."""
    if not isinstance(expr, cst.Attribute) or not isinstance(expr.dot, cst.Dot):
        return expr
    before = expr.dot.whitespace_before
    if isinstance(before, cst.SimpleWhitespace) and "\n" in before.value:
        if before.value.endswith(" "):
            before = before.with_changes(value=before.value[:-1])
            return expr.with_changes(dot=expr.dot.with_changes(whitespace_before=before))
    elif isinstance(before, cst.ParenthesizedWhitespace) and before.last_line.value.endswith(" "):
        last = before.last_line.with_changes(value=before.last_line.value[:-1])
        return expr.with_changes(
            dot=expr.dot.with_changes(whitespace_before=before.with_changes(last_line=last))
        )
    return expr


class StateRewriter(ScopeVisits, cst.CSTTransformer):
    """Rewrites one method (see the module docstring for the table)."""

    def __init__(
        self, method: cst.FunctionDef, receiver: str, state: frozenset[str], class_name: str, *,
        is_init: bool, control: Mapping[str, str] | None = None,
        shadowed: frozenset[str] = frozenset(), runtime: str = RUNTIME_NAME,
    ):
        super().__init__()
        self.runtime = runtime
        self.control = control or {}
        self.method = method
        # ``MethodFacts.shadowed_outside``: builtins the module or closure rebinds.
        self.shadowed_outside = shadowed
        self._shadowed: frozenset[str] | None = None
        self.scopes = ReceiverScopes(method, receiver)
        self.receiver = receiver
        self.state = state
        self.class_name = class_name
        self.is_init = is_init
        self._targets: set[int] = set()
        # The ``.value`` of each in-place call rewritten onto a target
        # (``_inplace``): a chain's next call goes on with the target.
        self._links: set[int] = set()
        # ``X.__dict__`` / ``vars(X)`` nodes kept as written: assigned to
        # (``self.__dict__ = d``), or the dict so assigned (``= self.__dict__``).
        self._dict_targets: set[int] = set()
        self._fstring_quotes: list[str] = []
        # Inside a match value pattern (``case self.x:``) an attribute must stay
        # a dotted name; the class's descriptor reads the state there.
        self._in_pattern = 0

    # helpers
    def _runtime(self, name: str) -> cst.Attribute:
        return cst.Attribute(value=cst.Name(self.runtime), attr=cst.Name(name))

    def _call(self, name: str, *args: cst.BaseExpression) -> cst.Call:
        return cst.Call(func=self._runtime(name), args=[cst.Arg(a) for a in args])

    def _write(self, attr: str, value: cst.BaseExpression) -> cst.Call:
        """``self.<attr> = value`` as the runtime's call (``init`` in ``__init__``)."""
        return self._call("init" if self.is_init else "set", self._receiver(), _string(attr), value)

    def _state_attr(self, expr: cst.CSTNode) -> str | None:
        attr = self.scopes.attr_of(expr)
        if attr is None:
            return None
        mangled = mangle(self.class_name, attr)
        return mangled if mangled in self.state else None

    def _mark(self, expr: cst.BaseExpression) -> None:
        """Remembers state attributes in target position so reads skip them."""
        if isinstance(expr, (cst.Tuple, cst.List)):
            for element in expr.elements:
                self._mark(element.value)
        elif isinstance(expr, cst.StarredElement):
            self._mark(expr.value)
        else:
            if isinstance(expr, cst.Attribute) and expr.attr.value == "__dict__":
                self._dict_targets.add(id(expr))
            base = subscript_base(expr)
            if self._state_attr(base) is not None:
                self._targets.add(id(base))

    def _receiver(self) -> cst.Name:
        return cst.Name(self.receiver)

    def _indices(self, expr: cst.BaseExpression) -> list[cst.BaseExpression]:
        indices: list[cst.BaseExpression] = []
        while isinstance(expr, cst.Subscript):
            indices.append(cst.Subscript(value=self._runtime("ix"), slice=expr.slice))
            expr = expr.value
        return indices[::-1]

    def _proxy(self, expr: cst.BaseExpression) -> cst.BaseExpression:
        """Turns state targets inside ``expr`` into proxy targets."""
        if isinstance(expr, (cst.Tuple, cst.List)):
            return expr.with_changes(
                elements=[e.with_changes(value=self._proxy(e.value)) for e in expr.elements]
            )
        if isinstance(expr, cst.StarredElement):
            return expr.with_changes(value=self._proxy(expr.value))
        if isinstance(expr, cst.Subscript):
            return expr.with_changes(value=self._proxy(expr.value))
        if isinstance(expr, cst.Attribute) and self._state_attr(expr) is not None:
            target = self._call("target", self._receiver())
            if expr.value.lpar:  # ``(self\n).x``
                target = _keep_lines(target, _code(expr.value), before=1)
            return expr.with_changes(value=target)
        return expr

    def _has_state_target(self, expr: cst.BaseExpression) -> bool:
        return self._proxy(expr) is not expr

    # patterns
    def _enter_pattern(self, node: cst.MatchValue | cst.MatchMappingElement) -> None:
        self._in_pattern += 1

    def _leave_pattern(self, original_node, updated_node):
        self._in_pattern -= 1
        return updated_node

    visit_MatchValue = visit_MatchMappingElement = _enter_pattern
    leave_MatchValue = leave_MatchMappingElement = _leave_pattern

    # control flow
    def _control(self, original: cst.BaseExpression, updated: cst.BaseExpression):
        """``lax.scan`` (a name that resolved to a JAX control-flow function at
        decoration) as ``__autostate__.lifting.routed(lax.scan)``: the name is
        still evaluated where the method runs, so a local or a parameter of
        the same name (``def f(self, x, checkpoint=False)``), or a global
        rebound since, is itself; only the JAX function is routed."""
        dotted = dotted_name(original) if self.control else None
        if dotted is None or dotted not in self.control:
            return updated
        return cst.Call(
            func=cst.Attribute(value=self._runtime("lifting"), attr=cst.Name("routed")),
            args=[cst.Arg(_narrowed(updated))],
        )

    def _shadowed_names(self) -> frozenset[str]:
        if self._shadowed is None:
            self._shadowed = self.shadowed_outside | locally_bound(self.method)
        return self._shadowed

    def _named_access(self, call: cst.Call) -> str | None:
        """The runtime function (of ``runtime.spelled``) a state access by
        literal name becomes, if any.

        ``setattr``/``getattr`` go through the class's own hooks as ``self.x``
        does (``set``, ``init``, ``get``); ``object.__setattr__`` /
        ``object.__getattribute__`` bypass them (``store_state``,
        ``read_state``: what the state's descriptor does). ``super().__setattr__``
        and ``getattr`` with a default stay as written: the state's
        descriptor routes them (after the MRO's hooks) to the same slot.
        """
        access: NamedAccess | None = named_access(call, self.scopes, self._shadowed_names)
        if access is None or access.name not in self.state or access.via in ("super", "self"):
            return None  # (the call reaches the state's descriptor as it is)
        if access.kind == "set":
            if access.via == "object":
                return "store_state"
            return "init" if self.is_init else "set"
        if access.kind == "get" and not access.has_default:
            return "read_state" if access.via == "object" else "get"
        return None

    def visit_Call(self, node: cst.Call) -> None:
        receiver = inplace_receiver(node)
        if receiver is not None:
            base = subscript_base(receiver)
            if self._state_attr(base) is not None:
                self._targets.add(id(base))  # (``self.x`` stays: ``_inplace`` reads it)

    def _inplace(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        """A call of one of PyTorch's in-place tensor methods (the rule of
        ``runtime.InPlace``): ``self.x.mul_(m)`` as
        ``__autostate__.inplace(self, "x").mul_(m).value``, ``self.x[i].add_(v)``
        with the keys after the name (``__autostate__.ix[i]``), another
        object's attribute (``self.bn.mean.zero_()``) as
        ``__autostate__.inplace_attribute(self.bn, "mean").zero_().value``, a
        chain's next call on the target (``....mul_(m).add_(v).value``), and
        any other receiver as ``__autostate__.tensor_method(v, "mul_")(m)``
        (its own method, or the error a JAX array gets)."""
        func: cst.Attribute = updated_node.func  # type: ignore[assignment]
        original: cst.Attribute = original_node.func  # type: ignore[assignment]
        quotes = frozenset(self._fstring_quotes)
        if self.control:
            updated_node = updated_node.with_changes(args=[
                a.with_changes(value=self._control(o.value, a.value))
                for o, a in zip(original_node.args, updated_node.args)
            ])
        receiver = func.value
        original_base = subscript_base(original.value)
        if id(receiver) in self._links:
            target = receiver.value  # type: ignore[attr-defined]
        else:
            base = subscript_base(receiver)
            attr = self._state_attr(original_base)
            if attr is not None:
                target = self._call("inplace", self._receiver(), _string(attr, quotes), *self._indices(receiver))
                target = _keep_lines(target, _code(base), before=2)
            elif isinstance(original_base, cst.Attribute) and isinstance(base, cst.Attribute):
                name = _string(mangle(self.class_name, base.attr.value), quotes)
                target = self._call("inplace_attribute", base.value, name, *self._indices(receiver))
                target = _keep_lines(target, _code(base.dot, base.attr), before=1)
            else:
                method = self._call("tensor_method", receiver, _string(original.attr.value, quotes))
                method = _keep_lines(method, _code(func.dot, func.attr), before=1)
                return updated_node.with_changes(func=method)
        call = updated_node.with_changes(func=func.with_changes(value=target), lpar=[], rpar=[])
        result = cst.Attribute(
            value=call, attr=cst.Name("value"), lpar=updated_node.lpar, rpar=updated_node.rpar
        )
        self._links.add(id(result))
        return result

    def leave_Call(self, original_node, updated_node):
        if inplace_receiver(original_node) is not None:
            return self._inplace(original_node, updated_node)
        func, args = original_node.func, original_node.args
        runtime_name = self._named_access(original_node)
        if runtime_name is not None:
            # ``setattr(self, "x", v)`` as ``spelled.set(setattr, self, "x", v)``:
            # the function as written goes first, evaluated where the method
            # runs, so the runtime does the state access only while it is the
            # builtin (a module may rebind ``setattr`` after the class). The
            # arguments keep their order and lines (``object \\\n .__setattr__``
            # one space narrower: the comma after it takes the ``(``'s place).
            before_args = updated_node.whitespace_before_args
            comma = cst.Comma(
                whitespace_before=updated_node.whitespace_after_func,
                whitespace_after=before_args if _code(before_args) else cst.SimpleWhitespace(" "),
            )
            return updated_node.with_changes(
                func=cst.Attribute(value=self._runtime("spelled"), attr=cst.Name(runtime_name)),
                whitespace_after_func=cst.SimpleWhitespace(""),
                whitespace_before_args=cst.SimpleWhitespace(""),
                args=[cst.Arg(_narrowed(updated_node.func), comma=comma), *updated_node.args],
            )
        if (
            isinstance(func, cst.Name)
            and func.value in SCOPE_LISTERS
            and not args
            and not {"'", '"'} <= set(self._fstring_quotes)  # (no quote left for the name)
        ):
            # ``locals()``: the call stays in the method's frame, and the
            # runtime drops its own name from the result; the function is
            # passed along, so a ``locals`` of the user's own is left alone.
            call = self._call(
                "without_runtime",
                updated_node.with_changes(lpar=[], rpar=[]),
                cst.Name(func.value),
                _string(self.runtime, frozenset(self._fstring_quotes)),
            )
            return call.with_changes(lpar=updated_node.lpar, rpar=updated_node.rpar)
        if (
            (
                (isinstance(func, cst.Name) and func.value == "vars")
                or (isinstance(func, cst.Attribute) and func.attr.value == "vars")  # builtins.vars
            )
            and len(args) == 1
            and id(original_node) not in self._dict_targets
            and args[0].star == "" and args[0].keyword is None
        ):
            # ``vars(self)``: the instance dict with the states' values (the
            # name is passed along, so a ``vars`` of the user's own is called).
            arg = updated_node.args[0]
            call = self._call("vars_of", updated_node.func, arg.value)
            call = _keep_lines(
                call, _code(updated_node.whitespace_after_func, updated_node.whitespace_before_args),
                before=1,
            )
            call = _keep_lines(call, _code(arg.whitespace_after_arg, *_present(arg.comma)), before=2)
            return call.with_changes(lpar=updated_node.lpar, rpar=updated_node.rpar)
        if not self.control:
            return updated_node
        args = [
            a.with_changes(value=self._control(o.value, a.value))
            for o, a in zip(original_node.args, updated_node.args)
        ]
        return updated_node.with_changes(
            func=self._control(original_node.func, updated_node.func), args=args
        )

    def leave_Decorator(self, original_node, updated_node):
        return updated_node.with_changes(
            decorator=self._control(original_node.decorator, updated_node.decorator)
        )

    # reads
    def visit_FormattedString(self, node: cst.FormattedString) -> None:
        self._fstring_quotes.append(node.start[-1])

    def leave_FormattedString(self, original_node, updated_node):
        self._fstring_quotes.pop()
        if not any(
            isinstance(p, cst.FormattedStringExpression) and p.equal is not None
            and p is not o
            for p, o in zip(updated_node.parts, original_node.parts)
        ):
            return updated_node
        parts: list[cst.BaseFormattedStringContent] = []
        for new, old in zip(updated_node.parts, original_node.parts):
            if isinstance(new, cst.FormattedStringExpression) and new.equal is not None:
                parts += _self_documenting(new, old, updated_node.start)
            else:
                parts.append(new)
        return updated_node.with_changes(parts=parts)

    def leave_Attribute(self, original_node, updated_node):
        if id(original_node) in self._targets or self._in_pattern:
            return updated_node
        if original_node.attr.value == "__dict__" and id(original_node) not in self._dict_targets:
            call = self._call("dict_of", updated_node.value)
            call = _keep_lines(call, _code(updated_node.dot, updated_node.attr), before=1)
            return call.with_changes(lpar=updated_node.lpar, rpar=updated_node.rpar)
        attr = self._state_attr(original_node)
        if attr is None:
            return updated_node
        if {"'", '"'} <= set(self._fstring_quotes):
            # An f-string inside an f-string of the other quote leaves no quote
            # for the name (before 3.12); the class's descriptor reads it.
            return updated_node
        call = self._call("get", self._receiver(), _string(attr, frozenset(self._fstring_quotes)))
        call = _keep_lines(call, _code(updated_node.value, updated_node.dot, updated_node.attr), before=2)
        return call.with_changes(lpar=updated_node.lpar, rpar=updated_node.rpar)

    # writes
    def visit_Assign(self, node: cst.Assign) -> None:
        for target in node.targets:
            self._mark(target.target)
        if any(id(t.target) in self._dict_targets for t in node.targets):
            # ``new.__dict__ = self.__dict__`` shares the dict object itself.
            self._dict_targets.add(id(node.value))

    def leave_Assign(self, original_node, updated_node):
        targets = updated_node.targets
        if len(targets) == 1:
            target = targets[0].target
            attr = self._state_attr(target)
            if attr is not None:
                call = self._write(attr, updated_node.value)
                # What precedes the value (the target and ``=``) is left out.
                return _statement(_keep_lines(call, _code(targets[0]), before=2), updated_node)
            base_attr = self._state_attr(subscript_base(target))
            if isinstance(target, cst.Subscript) and base_attr is not None:
                # The keys follow the value here: their own line breaks move
                # after it (the statement keeps its number of lines).
                indices = self._indices(target)
                call = self._call(
                    "setitem", self._receiver(), _string(base_attr), updated_node.value, *indices
                )
                moved = _code(*indices).count("\n")
                call = _keep_lines(call, _code(targets[0]), before=2, moved=moved)
                return _statement(call, updated_node)
        if not any(self._has_state_target(t.target) for t in targets):
            return updated_node
        return updated_node.with_changes(
            targets=[t.with_changes(target=self._proxy(t.target)) for t in targets]
        )

    def leave_AugAssign(self, original_node, updated_node):
        target = updated_node.target
        symbol = _code(updated_node.operator).strip(" \t\f\\\r\n")[:-1]  # `` += `` -> ``+``
        attr = self._state_attr(target)
        if attr is not None:
            current = self._call("get", self._receiver(), _string(attr))
            combined = _keep_lines(
                self._call(INPLACE_OPERATORS[symbol], current, updated_node.value),
                _code(target, updated_node.operator),  # what precedes the value
                before=1,
            )
            return _statement(self._call("set", self._receiver(), _string(attr), combined), updated_node)
        base_attr = self._state_attr(subscript_base(target))
        if isinstance(target, cst.Subscript) and base_attr is not None:
            # Python's order: the keys and the old item first, then the value.
            indices = self._indices(target)
            item = self._call("item", self._receiver(), _string(base_attr), *indices)
            call = self._call("augitem", item, _string(symbol), updated_node.value)
            # The keys' own line breaks stay in ``item``, before the value.
            moved = _code(*indices).count("\n")
            call = _keep_lines(call, _code(target, updated_node.operator), before=2, moved=moved)
            return _statement(call, updated_node)
        return updated_node

    def visit_Annotation(self, node: cst.Annotation) -> bool:
        # An annotation keeps its text: under ``from __future__ import
        # annotations`` it is that text, and where Python evaluates it (a
        # nested function's parameters) ``self.x`` reads the state through
        # its descriptor.
        return False

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        if node.value is not None:
            self._mark(node.target)
        elif isinstance(node.target, cst.Attribute) and node.target.attr.value == "__dict__":
            self._dict_targets.add(id(node.target))

    def leave_AnnAssign(self, original_node, updated_node):
        if updated_node.value is None:
            # ``self.x: T`` alone assigns nothing and reads nothing: as written.
            return updated_node.with_changes(target=original_node.target)
        attr = self._state_attr(updated_node.target)
        if attr is None and not self._has_state_target(updated_node.target):
            return updated_node
        # The annotation and ``=`` are left out (the target too, for a state).
        dropped = _annotation_code(updated_node.annotation) + _code(*_present(updated_node.equal))
        if attr is not None:
            call = self._write(attr, updated_node.value)
            return _statement(
                _keep_lines(call, _code(updated_node.target) + dropped, before=2), updated_node
            )
        breaks = _line_breaks(dropped)
        return cst.Assign(
            targets=[
                cst.AssignTarget(
                    self._proxy(updated_node.target),
                    whitespace_after_equal=breaks or cst.SimpleWhitespace(" "),
                )
            ],
            value=updated_node.value,
            semicolon=updated_node.semicolon,
        )

    def _mark_target(self, node: cst.For | cst.CompFor | cst.Del | cst.AugAssign) -> None:
        self._mark(node.target)

    def _proxy_target(self, original_node, updated_node):
        return updated_node.with_changes(target=self._proxy(updated_node.target))

    visit_For = visit_CompFor = visit_Del = visit_AugAssign = _mark_target
    leave_For = leave_CompFor = leave_Del = _proxy_target

    def visit_WithItem(self, node: cst.WithItem) -> None:
        if node.asname is not None:
            self._mark(node.asname.name)

    def leave_WithItem(self, original_node, updated_node):
        if updated_node.asname is None:
            return updated_node
        return updated_node.with_changes(
            asname=updated_node.asname.with_changes(name=self._proxy(updated_node.asname.name))
        )


def _self_documenting(
    new: cst.FormattedStringExpression, old: cst.FormattedStringExpression, start: str
) -> list[cst.BaseFormattedStringContent]:
    """``{expr=}`` whose expression was rewritten: the text Python would show
    (the original source of ``expr`` and the ``=``), then the value, with the
    conversion ``=`` implies (``!r`` unless a format spec is given). ``start``
    opens the f-string (``f"``, ``rf'''``).

    The expression keeps its line breaks (and those around it), so the text
    writes its own as ``\\n``, or the f-string would gain lines; a raw
    f-string cannot, and a field of it spanning lines has them twice.
    """
    raw = "r" in start.lower()
    # Python shows the field's source less its comments (only whitespace
    # around the expression can hold one).
    text = (
        _COMMENT.sub("", _code(old.whitespace_before_expression))
        + _code(old.expression)
        + _COMMENT.sub("", _code(old.whitespace_after_expression, old.equal))  # type: ignore[arg-type]
    )
    escaped = text.replace("{", "{{").replace("}", "}}")
    if not raw:
        escaped = _literal_text(escaped, start.lstrip("rRfFbBuU")[0])
    conversion = new.conversion
    if conversion is None and new.format_spec is None:
        conversion = "r"
    # The ``=`` goes; the line breaks around the expression and it stay.
    before = after = None
    if not raw:
        before = _line_breaks(_code(old.whitespace_before_expression), bracketed=True)
        after = _line_breaks(
            _code(old.whitespace_after_expression, old.equal), bracketed=True  # type: ignore[arg-type]
        )
    return [
        cst.FormattedStringText(escaped),
        new.with_changes(
            equal=None,
            conversion=conversion,
            whitespace_before_expression=before or cst.SimpleWhitespace(""),
            whitespace_after_expression=after or cst.SimpleWhitespace(""),
        ),
    ]


_COMMENT = re.compile(r"#[^\n]*")


def _literal_text(text: str, quote: str) -> str:
    """``text`` written inside a (not raw) string literal opened by ``quote``
    so that it reads back as Python shows a field's source: its escapes
    decoded, as in the shown text since Python 3.12 (before, a field could
    hold no backslash), its quotes escaped (Python 3.12 lets a field hold
    the f-string's own), its line breaks as ``\\n``."""
    breaks = {"\n": "\\n", "\r": "\\r"}
    out: list[str] = []
    chars = iter(text)
    for char in chars:
        if char == "\\":  # an escape, kept whole
            escaped = next(chars, "")
            out.append(char + breaks.get(escaped, escaped))
        elif char == quote:
            out.append("\\" + char)
        else:
            out.append(breaks.get(char, char))
    return "".join(out)


def rewrite_method(
    module: cst.Module, method: cst.FunctionDef, receiver: str | None, state: frozenset[str],
    class_name: str, *, is_init: bool, control: Mapping[str, str] | None = None,
    shadowed: frozenset[str] = frozenset(), runtime: str = RUNTIME_NAME,
) -> str:
    """Returns the wrapper module's source with ``method`` rewritten.

    ``control`` maps dotted names (``"lax.scan"``) to the ``autostate.lifting``
    function each call of them goes through (``"scan"``); ``shadowed`` names
    the builtins of ``method.ACCESS_BUILTINS`` the method's module or
    closure binds to something else; ``runtime`` is the name the wrapper
    binds the runtime to (``MethodFacts.runtime``).
    """
    rewriter = StateRewriter(
        method, receiver, state, class_name,  # type: ignore[arg-type]
        is_init=is_init, control=control, shadowed=shadowed, runtime=runtime,
    )
    new_method = walk.transform(method, rewriter)
    return _replace_method(module, method, new_method).code


def _replace_method(module: cst.Module, old: cst.FunctionDef, new: cst.CSTNode) -> cst.Module:
    """``module.deep_replace(old, new)`` along the wrapper's known path, with no walk.

    The wrapper module ends with ``class <name>: def <outer>(): <method>``
    (the method last in the wrapper function, after its ``global``).
    """
    wrapper_class = module.body[-1]
    if isinstance(wrapper_class, cst.ClassDef):
        outer = wrapper_class.body.body[0]
        if isinstance(outer, cst.FunctionDef) and outer.body.body[-1] is old:
            outer = outer.with_changes(
                body=outer.body.with_changes(body=(*outer.body.body[:-1], new))
            )
            wrapper_class = wrapper_class.with_changes(
                body=wrapper_class.body.with_changes(body=(outer, *wrapper_class.body.body[1:]))
            )
            return module.with_changes(body=(*module.body[:-1], wrapper_class))
    return module.deep_replace(old, new)  # type: ignore[arg-type]
