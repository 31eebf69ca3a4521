"""Property test: random class structures run like plain Python.

Where ``tests/property/test_programs.py`` varies method bodies, this file varies the
shape of the classes around them. Hypothesis writes, as Python source:

- a hierarchy of one to three levels ``L0 <- L1 <- L2`` (the last is the
  model), each level ``@stateful`` or not (the leaf always ends up decorated,
  explicitly or as the subclass of a decorated base); every ``__init__`` calls
  ``super().__init__(seed)``, and a level's ``__call__`` may call
  ``super().__call__(...)``;
- maybe an undecorated mixin (``class L1(Mixin, L0)``) with a cooperative
  ``__init__`` and ``__call__`` (both through ``super()``) and methods that
  read and assign state;
- helper methods defined every way Python allows: a plain ``def``, a
  module-level function assigned in the class body (``m = _m``), a
  ``functools.wraps`` decorator, ``functools.partialmethod``, a
  ``staticmethod`` that takes the model as an argument, a lambda assigned in
  the class body, a ``property`` whose getter reads and setter writes state,
  and a method overridden in a subclass that calls ``super().m(x)``; a
  ``classmethod`` factory may build the model;
- method bodies that read state (also ``getattr(self, "a0")``), assign,
  augment, item-assign arrays and a list state, call a decorated sub-model,
  write its state from outside, and call other methods as ``self.m(v)``,
  ``type(self).m(self, v)`` and ``self.__class__.m(self, v)``.

The source goes to a fresh ``.py`` file imported twice: with ``stateful`` the
identity and ``xp = numpy`` (plain Python, the reference), and with
``stateful = autostate.stateful`` and ``xp = jax.numpy``. The decorated model
runs (2) eagerly, (3) as ``f(states, x)`` eagerly, (4) as ``f`` under one
``jax.jit``; then (5) ``autostate.freeze(f, states)`` takes one more eager
step. Outputs, every attribute and the functional states must agree with
plain Python, and the state names must be what the rewrite rules say:
whatever any method but ``__init__`` assigns through its receiver (in a
decorated class, an undecorated base or a mixin), what ``__init__`` declares
with ``autostate.state``, and every int array.

An item write in a method of an undecorated base or mixin is the decoration
error of docs/errors.md ("An undecorated base class changes state in
place"); a few programs generate one and must raise it, naming the file.

Generated code keeps every stored array fresh (an operator or call result,
never a bare name), so numpy's in-place ``+=`` and item writes alias
nothing; values go through ``tanh``. Method calls only go to methods defined
earlier in a fixed order, so there is no recursion.
Size with ``AUTOSTATE_PROPERTY_EXAMPLES`` (default 20: about 3 s on 2
cores). Two gaps it found are explicit tests at the end: a lambda in the
class body that assigns state is not analysed (a clear error through ``f``;
declaring the state makes it work), and an item write that is an undecorated
base's only write of a JAX array was JAX's raw immutability error (now a
``DecorationError`` at the class statement); the generator steers clear of
both.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib.util
import itertools
import os
import shutil
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from models.checks import assert_generated_close, read_path
from semantics.harness import staged

import autostate
from autostate.errors import DecorationError, StateAccessError

pytestmark = pytest.mark.property

EXAMPLES = int(os.environ.get("AUTOSTATE_PROPERTY_EXAMPLES", "20"))
STEPS = 2
SEED = 0.25

jit_step = staged(lambda f, s, x: f(s, x))

# As tests/property/test_programs.py: numpy's and XLA's tanh differ in the last bits,
# and jitted (fused) arithmetic rounds differently from eager op by op.
RTOL, ATOL = 1e-4, 1e-5

LAMBDA_WRITES = False  # see test_lambda_in_class_body_assigning_state

# Method forms a helper method may take (see ``_define``).
FORMS = ("def", "assigned", "wraps", "partial", "static", "lambda", "property")


# --- generating source ---------------------------------------------------------


@dataclasses.dataclass
class Method:
    index: int
    name: str
    form: str
    owner: int | str  # a level, or "mixin"
    overrides: list[int] = dataclasses.field(default_factory=list)  # levels that override
    alias_of: str | None = None  # ``m3b = m3``: one function under two names


@dataclasses.dataclass
class Facts:
    """What the generated program does, for the expected states."""

    own_writes: set[str] = dataclasses.field(default_factory=set)
    outside_writes: set[str] = dataclasses.field(default_factory=set)
    undecorated_item_write: str | None = None  # "Class.method" that item-writes


@dataclasses.dataclass
class Context:
    """Where a body is generated: its receiver and what it may touch."""

    me: str
    floats: list[str]  # float vector attributes it may assign
    ints: list[str]
    decorated: bool
    static: bool = False  # the receiver is an argument, not the method's own
    where: str = ""
    before: int = 10**9  # may call methods with a smaller index
    scalar_param: str | None = None  # partialmethod's bound argument
    has_x: bool = True  # a property's getter has no argument
    level: int = 0  # the lowest level whose class runs this body
    locals: list[str] = dataclasses.field(default_factory=list)


class Writer:
    def __init__(self, draw, facts: Facts, methods: list[Method], allow_error: bool):
        self.draw = draw
        self.facts = facts
        self.methods = methods
        self.allow_error = allow_error
        self.counter = itertools.count()

    def pick(self, options):
        return self.draw(st.sampled_from(list(options)))

    def flip(self, p_true: int = 1, of: int = 2) -> bool:
        return self.draw(st.integers(0, of - 1)) < p_true

    # expressions
    def properties(self) -> list[Method]:
        return [m for m in self.methods if m.form == "property"]

    def form_of(self, name: str | None) -> str:
        return next(m.form for m in self.methods if m.name == name)

    def settable(self, ctx: Context) -> list[Method]:
        # A base assigning a property only a subclass defines assigns, for the
        # decorated base, a state that has no initial value: the clear
        # DecorationError "first assigned outside __init__" (docs/errors.md).
        return [m for m in self.properties() if isinstance(m.owner, int) and m.owner <= ctx.level]

    def callables(self, ctx: Context) -> list[Method]:
        return [m for m in self.methods if m.form != "property" and m.index < ctx.before]

    def index(self) -> str:
        return self.pick(["0", "1", "2", "-1"])

    def vector_atom(self, ctx: Context) -> str:
        me = ctx.me
        options = [*(["x"] if ctx.has_x else []), *(f"{me}.{a}" for a in ctx.floats), f"{me}.w"]
        options += ctx.locals
        options += [f"{me}.lst[0]", f"{me}.lst[1]", f"{me}.sub.s"]
        options += [f'getattr({me}, "{self.pick(ctx.floats)}")']
        for prop in self.properties():
            if prop.index < ctx.before:
                options += [f"{me}.{prop.name}", f'getattr({me}, "{prop.name}")']
        return self.pick(options)

    def scalar_atom(self, ctx: Context) -> str:
        me = ctx.me
        options = ["0.5", "-1.25", f"{me}.{self.pick(ctx.floats)}[{self.index()}]"]
        options.append(f"{me}.{self.pick(ctx.ints)}.astype(xp.float32) * 0.25")
        if ctx.scalar_param:
            options.append(ctx.scalar_param)
        return self.pick(options)

    def vector(self, ctx: Context, depth: int = 0) -> str:
        kind = self.pick(["atom", "atom", "tanh", "binop"] if depth < 2 else ["atom"])
        if kind == "atom":
            return self.vector_atom(ctx)
        if kind == "tanh":
            return f"xp.tanh({self.vector(ctx, depth + 1)})"
        return self.binop(ctx, depth)

    def binop(self, ctx: Context, depth: int = 0) -> str:
        vec = self.vector(ctx, depth + 1)
        other = self.vector(ctx, depth + 1) if self.flip() else self.scalar_atom(ctx)
        op = self.pick("+-*")
        return f"({vec} {op} {other})" if self.flip() else f"({other} {op} {vec})"

    def bounded(self, ctx: Context) -> str:
        return f"xp.tanh({self.vector(ctx)})"

    def fresh(self, ctx: Context) -> str:
        return self.bounded(ctx) if self.flip() else self.binop(ctx)

    def call(self, ctx: Context, method: Method, arg: str) -> str:
        me = ctx.me
        static = method.form == "static" or (
            method.form == "alias" and self.form_of(method.alias_of) == "static"
        )
        own = f"{me}.{method.name}({me}, {arg})" if static else f"{me}.{method.name}({arg})"
        via_type = f"type({me}).{method.name}({me}, {arg})"
        via_class = f"{me}.__class__.{method.name}({me}, {arg})"
        return self.pick([own, own, via_type, via_class])

    # statements
    def write(self, ctx: Context, attr: str) -> str:
        (self.facts.outside_writes if ctx.static else self.facts.own_writes).add(attr)
        return f"{ctx.me}.{attr}"

    def local(self, ctx: Context, value: str) -> list[str]:
        name = f"t{next(self.counter)}"
        ctx.locals.append(name)
        return [f"{name} = {value}"]

    def item_allowed(self, ctx: Context) -> bool:
        # Outside its class a state is a plain (immutable) jax array: a static
        # method writes whole values only. Undecorated code may item-write only
        # in the programs that check the decoration error.
        return not ctx.static and (ctx.decorated or self.allow_error)

    def statement(self, ctx: Context) -> list[str]:
        kinds = ["local", "set", "set", "aug", "int", "call_sub", "sub_write", "lst_whole"]
        if self.item_allowed(ctx):
            kinds += ["item", "augitem", "lst_item"]
        if self.callables(ctx):
            kinds += ["call", "call"]
        if self.settable(ctx):
            kinds.append("prop_set")
        kind = self.pick(kinds)
        me = ctx.me
        prefix: list[str] = []
        if kind in ("item", "augitem", "lst_item") and not ctx.decorated:
            self.facts.undecorated_item_write = ctx.where
            # An item write is refused only on what is state anyway: one that is
            # the attribute's only write is not seen at all (JAX's TypeError
            # later; test_undecorated_base_item_write_only below), so the
            # attribute is also assigned whole first.
            attr = "lst" if kind == "lst_item" else self.pick(ctx.floats)
            whole = "list(self.lst)" if attr == "lst" else f"{me}.{attr} + 0.0"
            prefix = [f"{self.write(ctx, attr)} = {whole.replace('self.', me + '.')}"]
            if kind != "lst_item":
                kind = f"{kind}:{attr}"
        if kind == "local":
            return self.local(ctx, self.fresh(ctx))
        if kind == "set":
            attr = self.pick(ctx.floats)
            if self.flip(1, 4):  # a literal-name setattr spells the same statement
                self.write(ctx, attr)
                return [f'setattr({me}, "{attr}", {self.fresh(ctx)})']
            return [f"{self.write(ctx, attr)} = {self.fresh(ctx)}"]
        if kind == "aug":
            attr = self.write(ctx, self.pick(ctx.floats))
            return [f"{attr} {self.pick('+-*')}= {self.bounded(ctx)}"]
        if kind == "int":
            attr = self.write(ctx, self.pick(ctx.ints))
            return [f"{attr} {self.pick(['+= 1', '-= 2', '= ({a} * 3 + 1) % 7'])}".format(a=attr)]
        if kind.startswith("item"):
            name = kind.partition(":")[2] or self.pick(ctx.floats)
            attr = self.write(ctx, name)
            return [*prefix, f"{attr}[{self.index()}] = {self.bounded(ctx)}[{self.index()}]"]
        if kind.startswith("augitem"):
            name = kind.partition(":")[2] or self.pick(ctx.floats)
            attr = self.write(ctx, name)
            return [*prefix, f"{attr}[{self.index()}] {self.pick('+-*')}= {self.bounded(ctx)}[1]"]
        if kind == "lst_item":
            index = self.pick(["0", "1", "-1"])
            return [*prefix, f"{self.write(ctx, 'lst')}[{index}] = {self.fresh(ctx)}"]
        if kind == "lst_whole":
            return [f"{self.write(ctx, 'lst')} = [{me}.lst[1], {self.fresh(ctx)}]"]
        if kind == "call_sub":
            return self.local(ctx, f"{me}.sub({self.fresh(ctx)})")
        if kind == "sub_write":
            return [f"{me}.sub.s = {self.fresh(ctx)}"]
        if kind == "call":
            method = self.pick(self.callables(ctx))
            return self.local(ctx, self.call(ctx, method, self.fresh(ctx)))
        assert kind == "prop_set"
        name = self.pick(self.settable(ctx)).name
        if self.flip(1, 3):
            return [f'setattr({me}, "{name}", {self.fresh(ctx)})']
        return [f"{me}.{name} = {self.fresh(ctx)}"]

    def body(self, ctx: Context, low: int = 1, high: int = 3) -> list[str]:
        lines: list[str] = []
        for _ in range(self.draw(st.integers(low, high))):
            lines += self.statement(ctx)
        return [*lines, f"return {self.fresh(ctx)}"]


def indent(lines: list[str]) -> list[str]:
    return ["    " + line for line in lines]


HEADER = '''"""Generated by tests/property/test_class_shapes.py."""
import functools


def logged(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


@stateful
class Leaf:
    def __init__(self, seed):
        self.s = xp.full((3,), seed, dtype=xp.float32)
        self.c = xp.asarray(0, dtype=xp.int32)

    def __call__(self, x):
        self.s = xp.tanh(self.s * 0.5 + x)
        self.c += 1
        return self.s * 2.0
'''


@dataclasses.dataclass
class Program:
    source: str
    cls: str  # the model's class
    factory: bool
    expected_states: list[str]
    paths: list[str]
    error_site: str | None  # "Class.method" when decoration must fail
    declare_error: str | None  # an attribute declared in an undecorated __init__
    seed: int


@st.composite
def programs(draw) -> Program:
    facts = Facts()
    levels = draw(st.integers(1, 3))
    explicit = [draw(st.booleans()) for _ in range(levels)]
    if not any(explicit):
        explicit[-1] = True
    decorated = [any(explicit[: i + 1]) for i in range(levels)]
    mixin_at = draw(st.integers(1, levels - 1)) if levels > 1 and draw(st.booleans()) else None
    mixin_init = mixin_at is not None and draw(st.booleans())
    mixin_call = mixin_at is not None and draw(st.booleans())
    receiver = draw(st.sampled_from(["self", "self", "this"]))
    allow_error = draw(st.integers(0, 9)) == 0

    # Helper methods, in calling order: method k calls only methods j < k.
    methods: list[Method] = []
    for k in range(draw(st.integers(0, 5))):
        owner: int | str = draw(st.integers(0, levels - 1))
        if mixin_at is not None and draw(st.integers(0, 3)) == 0:
            owner = "mixin"
        forms = ("def", "wraps", "lambda") if owner == "mixin" else FORMS
        form = draw(st.sampled_from(forms))
        method = Method(k, f"p{k}" if form == "property" else f"m{k}", form, owner)
        if form in ("def", "assigned", "wraps", "lambda") and owner != "mixin":
            method.overrides = [lv for lv in range(owner + 1, levels) if draw(st.booleans())]
        methods.append(method)
        if form in ("def", "assigned", "wraps") and draw(st.integers(0, 3)) == 0:
            methods.append(Method(k, f"m{k}b", "alias", owner, alias_of=method.name))

    writer = Writer(draw, facts, methods, allow_error)

    def attrs(level: int | str) -> tuple[list[str], list[str]]:
        if level == "mixin":
            return ["a0", *(["mz"] if mixin_init else [])], ["n0"]
        return [f"a{i}" for i in range(level + 1)], [f"n{i}" for i in range(level + 1)]

    def ctx(level: int | str, where: str, before: int, *, me: str = receiver, **kw) -> Context:
        floats, ints = attrs(level)
        is_decorated = level != "mixin" and decorated[level]
        lowest = mixin_at if level == "mixin" else level
        return Context(
            me, floats, ints, is_decorated, where=where, before=before, level=lowest, **kw
        )

    module_lines: list[str] = []  # module-level functions assigned in class bodies
    class_lines: dict[int | str, list[str]] = {lv: [] for lv in (*range(levels), "mixin")}
    cls_name = {lv: f"L{lv}" for lv in range(levels)} | {"mixin": "Mixin"}

    def define(method: Method, level: int | str, override: bool) -> None:
        name, me = method.name, receiver
        where = f"{cls_name[level]}.{name}"
        out = class_lines[level]
        if override:
            c = ctx(level, where, method.index)
            head = writer.local(c, f"super().{name}({writer.fresh(c)})")
            deco = ["@logged"] if writer.flip() else []
            lines = [*head, *writer.body(c, 0, 2)[:-1], f"return {c.locals[0]} * 0.5"]
            out += [*deco, f"def {name}({me}, x):", *indent(lines), ""]
            return
        form = method.form
        # Property, static and partial methods are written in the class body
        # (with their decorators) or as module-level functions wrapped there.
        at_module = writer.flip(1, 3)
        home = module_lines if at_module else out
        if form == "alias":
            out += [f"{name} = {method.alias_of}", ""]
            return
        if form == "lambda":
            c = ctx(level, where, method.index)
            calls = writer.callables(c)
            value = writer.bounded(c)
            if calls and writer.flip():
                value = f"{writer.call(c, writer.pick(calls), value)} * 0.5"
            # A lambda in the class body that assigns state (through a literal
            # setattr) is not analysed (transform/source.py _is_user_function
            # skips lambdas), so the state is missing and f refuses the write:
            # test_lambda_in_class_body_assigning_state below. Kept off here.
            if LAMBDA_WRITES and writer.flip(1, 3):
                attr = writer.pick(c.floats)
                writer.write(c, attr)
                value = f'setattr({me}, "{attr}", {writer.fresh(c)}) or {value}'
            out += [f"{name} = lambda {me}, x: {value}", ""]
            return
        if form == "property":
            c = ctx(level, where, method.index, has_x=False)
            attr = writer.pick(c.floats)
            getter = [f"return xp.tanh({me}.{attr} * 2.0 + {writer.vector_atom(c)})"]
            writer.write(c, attr)
            setter = [f"{me}.{attr} = xp.tanh(v) * 0.5"]
            if at_module:
                home += [f"def _{name}_get({me}):", *indent(getter), "", ""]
                home += [f"def _{name}_set({me}, v):", *indent(setter), "", ""]
                out += [f"{name} = property(_{name}_get, _{name}_set)", ""]
                return
            out += ["@property", f"def {name}({me}):", *indent(getter), ""]
            out += [f"@{name}.setter", f"def {name}({me}, v):", *indent(setter), ""]
            return
        if form == "static":
            c = ctx(level, where, method.index, me="m", static=True)
            if at_module:
                home += [f"def _{name}(m, x):", *indent(writer.body(c)), "", ""]
                out += [f"{name} = staticmethod(_{name})", ""]
                return
            out += ["@staticmethod", f"def {name}(m, x):", *indent(writer.body(c)), ""]
            return
        if form == "partial":
            c = ctx(level, where, method.index, scalar_param="c")
            home += [f"def _{name}_impl({me}, c, x):", *indent(writer.body(c)), "", ""]
            bound = writer.pick(["0.5", "2.0"])
            out += [f"{name} = functools.partialmethod(_{name}_impl, {bound})", ""]
            return
        c = ctx(level, where, method.index)
        lines = [
            f"def {'_' if form == 'assigned' else ''}{name}({me}, x):",
            *indent(writer.body(c)),
        ]
        if form == "assigned":
            module_lines.extend([*lines, "", ""])
            out += [f"{name} = _{name}", ""]
        else:
            out += [*(["@logged"] if form == "wraps" else []), *lines, ""]

    for method in methods:
        define(method, method.owner, False)
        for level in method.overrides:
            define(method, level, True)

    # __call__ at each level (L0 always; above it maybe, maybe calling super).
    n_methods = len(methods)
    for level in range(levels):
        if level and not writer.flip(2, 3):
            continue
        c = ctx(level, f"L{level}.__call__", n_methods)
        head = (
            writer.local(c, f"super().__call__({writer.fresh(c)})")
            if level and writer.flip()
            else []
        )
        out = class_lines[level]
        if writer.flip(1, 4):  # one function under two names: ``__call__ = step``
            out += [f"def step({receiver}, x):", *indent([*head, *writer.body(c, 1, 4)]), ""]
            out += ["__call__ = step", ""]
        else:
            out += [f"def __call__({receiver}, x):", *indent([*head, *writer.body(c, 1, 4)]), ""]
    if mixin_call:
        c = ctx("mixin", "Mixin.__call__", n_methods)
        head = writer.local(c, f"super().__call__({writer.fresh(c)})")
        lines = [f"def __call__({receiver}, x):", *indent([*head, *writer.body(c, 0, 2)]), ""]
        class_lines["mixin"] += lines

    factory_level = draw(st.integers(0, levels - 1)) if draw(st.booleans()) else None
    if factory_level is not None:
        facts.outside_writes.add("a0")
        class_lines[factory_level] += [
            "@classmethod",
            "def build(cls, seed):",
            "    obj = cls(seed)",
            "    obj.a0 = xp.tanh(obj.a0 + 0.5)",
            "    return obj",
            "",
        ]

    def level_of(attr: str) -> int | str:
        return "mixin" if attr == "mz" else 0 if attr == "lst" else int(attr[1:])

    def is_decorated(attr: str) -> bool:
        level = level_of(attr)
        return level != "mixin" and decorated[level]

    # State assigned only from outside the class (static methods, the factory)
    # must be declared; some other attributes are declared too. Only a
    # decorated class's __init__ can declare (an undecorated base's
    # ``autostate.state(...)`` is the StateAccessError "the decorator did not
    # see"): there a ``touch_`` method assigns the attribute instead.
    candidates = [f"a{i}" for i in range(levels)] + (["mz"] if mixin_init else [])
    declared = {a for a in candidates if is_decorated(a) and draw(st.integers(0, 4)) == 0}
    for attr in sorted(facts.outside_writes - facts.own_writes):
        if is_decorated(attr):
            declared.add(attr)
        else:
            facts.own_writes.add(attr)
            value = {"n": f"self.{attr} + 0", "l": "list(self.lst)"}.get(
                attr[0], f"self.{attr} + 0.0"
            )
            class_lines[level_of(attr)] += [
                f"def touch_{attr}(self):",
                f"    self.{attr} = {value}",
                "",
            ]
    # A declaration in an undecorated __init__ is refused only when nothing
    # else makes the attribute state (then the declaration is redundant).
    undeclarable = [a for a in candidates if not is_decorated(a) and a not in facts.own_writes]
    if allow_error and undeclarable and draw(st.booleans()):
        attr = draw(st.sampled_from(undeclarable))
        declared.add(attr)
        declare_error = f"{attr}"
    else:
        declare_error = None

    def init(attr: str, value: str) -> str:
        return f"{receiver}.{attr} = {f'declare({value})' if attr in declared else value}"

    source = [HEADER, *module_lines]
    if mixin_at is not None:
        init_lines = []
        if mixin_init:
            init_lines = [
                f"def __init__({receiver}, seed):",
                "    super().__init__(seed)",
                f"    {init('mz', 'xp.full((3,), 0.2, dtype=xp.float32)')}",
                "",
            ]
        source += ["", "class Mixin:", *indent(init_lines + class_lines["mixin"] + ["pass"])]
    for level in range(levels):
        if level == 0:
            init_lines = [
                init("a0", "xp.full((3,), seed, dtype=xp.float32)"),
                init("n0", "xp.asarray(1, dtype=xp.int32)"),
                f"{receiver}.w = xp.asarray([0.5, -0.25, 1.0], dtype=xp.float32)",
                init(
                    "lst", "[xp.zeros(3, dtype=xp.float32), xp.full((3,), 0.3, dtype=xp.float32)]"
                ),
                f"{receiver}.sub = Leaf(seed * 0.5)",
            ]
            bases = ""
        else:
            init_lines = [
                "super().__init__(seed)",
                init(f"a{level}", f"xp.asarray([seed, {0.1 * level}, -seed], dtype=xp.float32)"),
                init(f"n{level}", f"xp.asarray({level + 2}, dtype=xp.int32)"),
            ]
            bases = f"(Mixin, L{level - 1})" if level == mixin_at else f"(L{level - 1})"
        source += ["", ""]
        if explicit[level]:
            source.append("@stateful")
        source += [
            f"class L{level}{bases}:",
            *indent([f"def __init__({receiver}, seed):", *indent(init_lines), ""]),
            *indent(class_lines[level]),
        ]
    source.append("")

    floats = [f"a{i}" for i in range(levels)] + (["mz"] if mixin_init else [])
    ints = [f"n{i}" for i in range(levels)]
    # Int arrays are always in the states (never trained: constants otherwise).
    state = (facts.own_writes | declared | set(ints)) & {*floats, *ints, "lst"}
    expected = sorted([*state, "sub.c", "sub.s"])
    paths = [*floats, *ints, "w", "lst", "sub.s", "sub.c"]
    return Program(
        "\n".join(source),
        f"L{levels - 1}",
        factory_level is not None,
        expected,
        paths,
        facts.undecorated_item_write,
        declare_error,
        draw(st.integers(0, 2**16)),
    )


# --- running it ------------------------------------------------------------------

_directory: Path | None = None
_names = itertools.count()


def _load(path: Path, name: str, xp: Any, stateful: Any, declare: Any) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    module.xp = xp
    module.stateful = stateful
    module.declare = declare
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _write(source: str) -> tuple[Path, str]:
    global _directory
    if _directory is None:
        _directory = Path(tempfile.mkdtemp(prefix="autostate-shapes-"))
        atexit.register(shutil.rmtree, _directory, True)
    name = f"autostate_shapes_{os.getpid()}_{next(_names)}"
    path = _directory / f"{name}.py"
    path.write_text(source)
    return path, name


def _snapshot(model: Any, paths: list[str]) -> dict[str, Any]:
    return {p: jax.tree_util.tree_map(np.array, read_path(model, p)) for p in paths}


def _assert_close(actual: Any, expected: Any, what: str, source: str) -> None:
    assert_generated_close(actual, expected, what, source, rtol=RTOL, atol=ATOL)


def _build(module: types.ModuleType, program: Program) -> Any:
    cls = getattr(module, program.cls)
    return cls.build(SEED) if program.factory else cls(SEED)


def _run(program: Program) -> None:
    path, name = _write(program.source)
    rng = np.random.default_rng(program.seed)
    xs = [rng.standard_normal(3).astype(np.float32) for _ in range(STEPS + 1)]
    try:
        plain = _load(path, f"{name}_plain", np, lambda cls: cls, lambda value: value)
        reference = _build(plain, program)
        plain_outs = [jax.tree_util.tree_map(np.array, reference(x.copy())) for x in xs[:STEPS]]
        final_plain = _snapshot(reference, program.paths)
        last_plain = np.array(reference(xs[STEPS].copy()))
        after_plain = _snapshot(reference, program.paths)

        if program.error_site is not None:
            with pytest.raises(DecorationError) as info:
                _load(path, f"{name}_decorated", jnp, autostate.stateful, autostate.state)
            assert str(path) in str(info.value) or path.name in str(info.value), info.value
            assert "fix" in str(info.value), info.value
            return
        decorated = _load(path, f"{name}_decorated", jnp, autostate.stateful, autostate.state)
        if program.declare_error is not None:
            with pytest.raises(StateAccessError) as info:
                _build(decorated, program)
            message = str(info.value)
            assert f".{program.declare_error} was assigned an autostate.state" in message
            assert str(path) in message and "fix" in message, message
            return

        eager = _build(decorated, program)
        eager_outs = [eager(jnp.asarray(x)) for x in xs[:STEPS]]
        _assert_close(eager_outs, plain_outs, "eager and plain outputs", program.source)
        final_eager = _snapshot(eager, program.paths)
        _assert_close(final_eager, final_plain, "eager and plain attributes", program.source)

        f, states = _build(decorated, program).functionalize()
        assert sorted(states) == program.expected_states, (sorted(states), program.source)
        f_outs = []
        for x in xs[:STEPS]:
            out, states = f(states, jnp.asarray(x))
            f_outs.append(out)
        _assert_close(f_outs, plain_outs, "f(states, x) and plain outputs", program.source)
        for state_name, value in states.items():
            _assert_close(value, final_plain[state_name], f"f state {state_name}", program.source)

        f, states = _build(decorated, program).functionalize()
        jit_outs = []
        for x in xs[:STEPS]:
            out, states = jit_step(f, states, jnp.asarray(x))
            jit_outs.append(out)
        _assert_close(jit_outs, plain_outs, "jit and plain outputs", program.source)
        for state_name, value in states.items():
            _assert_close(value, final_plain[state_name], f"jit state {state_name}", program.source)
        assert not any(
            isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves((f, states))
        )

        frozen = autostate.freeze(f, states)
        assert type(frozen) is getattr(decorated, program.cls)
        _assert_close(
            _snapshot(frozen, program.paths), final_plain, "frozen attributes", program.source
        )
        last = frozen(jnp.asarray(xs[STEPS]))
        _assert_close(last, last_plain, "frozen and plain last output", program.source)
        _assert_close(
            _snapshot(frozen, program.paths), after_plain, "frozen attributes after", program.source
        )
    finally:
        for module_name in (f"{name}_plain", f"{name}_decorated"):
            sys.modules.pop(module_name, None)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(programs())
def test_class_shapes_run_like_plain_python(program: Program) -> None:
    _run(program)


# --- the generator itself --------------------------------------------------------


def test_generator_reaches_every_form() -> None:
    """Forms the generator must be able to produce (a smoke check of the strategy)."""
    seen: set[str] = set()

    @settings(max_examples=60, deadline=None, database=None)
    @given(programs())
    def collect(program: Program) -> None:
        for needle in (
            "functools.partialmethod",
            "@staticmethod",
            "@classmethod",
            ".setter",
            "lambda ",
            "@logged",
            "super().__call__",
            "class Mixin",
            "type(",
            ".__class__.",
            "getattr(",
        ):
            if needle in program.source:
                seen.add(needle)

    collect()
    assert len(seen) >= 9, seen


# --- reproducers of what the property test found ----------------------------------


LAMBDA_SOURCE = """
import jax.numpy as jnp
import autostate


@autostate.stateful
class Model:
    def __init__(self):
        self.b = INIT

    bump = lambda self, x: setattr(self, "b", self.b + x) or self.b * 1.0

    def __call__(self, x):
        return self.bump(x)
"""


def test_lambda_in_class_body_assigning_state(write_module) -> None:
    # A lambda in the class body is not analysed (only ``def`` methods are):
    # eagerly it is plain Python; through f the attribute it assigns is not
    # state, which is refused clearly, and declaring it makes it work.
    x = jnp.ones(3)
    module = write_module(LAMBDA_SOURCE.replace("INIT", "jnp.zeros(3)"))
    np.testing.assert_allclose(module.Model()(x), [1.0, 1.0, 1.0])
    f, states = module.Model().functionalize()
    with pytest.raises(StateAccessError) as raised:
        f(states, x)
    assert f"{module.__file__}:" in str(raised.value) and "fix:" in str(raised.value)
    declared = write_module(LAMBDA_SOURCE.replace("INIT", "autostate.state(jnp.zeros(3))"))
    f, states = declared.Model().functionalize()
    for step in (f, staged(f)):
        out, new = step(states, x)
        np.testing.assert_allclose(out, [1.0, 1.0, 1.0])
        np.testing.assert_allclose(new["b"], [1.0, 1.0, 1.0])


def test_undecorated_base_item_write_only(write_module) -> None:
    try:
        module = write_module(
            """
            import jax.numpy as jnp
            import autostate


            class Base:
                def __init__(self):
                    self.a = jnp.zeros(3)

                def __call__(self, x):
                    self.a[1] = x[1]
                    return self.a * 1.0


            @autostate.stateful
            class Model(Base):
                pass
            """
        )
    except DecorationError as error:  # docs/errors.md: "changes state in place"
        assert "Base" in str(error) and "the JAX array 'a'" in str(error) and "fix" in str(error)
        return
    pytest.fail(f"no DecorationError: {module}")


ITEM_WRITE_BASE = """
import jax.numpy as jnp
import autostate


class Base:
    def __init__(self):
        self.a = VALUE

    def touch(self, x):
        WRITE
        return x


@autostate.stateful
class Model(Base):
    def __call__(self, x):
        return self.touch(x)
"""


@pytest.mark.parametrize(
    ("value", "write", "refused"),
    [
        ("jnp.zeros(3)", "self.a[1] = x[1]", True),
        ("jnp.zeros(3)", "self.a[1] += x[1]", True),
        ("jnp.arange(3.0)", "self.a[0:2] = x[0:2]", True),
        # A list or dict an undecorated base fills in place is plain Python
        # there (a memo, a log): not refused.
        ("[0.0, 0.0]", "self.a[1] = 1.0", False),
        ("{}", "self.a['k'] = 1.0", False),
    ],
)
def test_an_undecorated_base_writing_an_item_of_an_attribute(
    write_module, value: str, write: str, refused: bool
) -> None:
    source = ITEM_WRITE_BASE.replace("VALUE", value).replace("WRITE", write)
    if refused:
        with pytest.raises(DecorationError, match="changes the JAX array 'a' in place"):
            write_module(source)
        return
    model = write_module(source).Model()
    model(jnp.ones(3))
    assert model.a == ([0.0, 1.0] if value.startswith("[") else {"k": 1.0})
