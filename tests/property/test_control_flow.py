"""Property test: state read and written inside ``lax`` control flow means what Python means.

Hypothesis writes a ``Sub`` and a ``Model`` class as Python source whose
methods call ``lx.scan``, ``lx.fori_loop``, ``lx.cond``, ``lx.switch``,
``lx.while_loop``, ``lx.checkpoint`` and ``lx.map`` with bodies that read
and assign state by every road: a closure defined in the method, a lambda, a
bound method of the model handed to ``lx`` directly (``self.branch_a``), a
sub-model's method (``self.sub.update``), a module-level helper that takes
the model (``bump(self, v)``), nested control flow (a ``scan`` inside a
``cond`` inside a ``fori_loop``), ``+=`` and item writes on array state
(with a traced index too), list and dict state item writes, state read
before and after the call, and a state (``r``) that bodies only read while
the method writes it outside them.

The source goes to a fresh ``.py`` file that is imported twice:

1. undecorated, ``xp = numpy`` and ``lx`` plain Python loops and ``if``s
   (the body's writes to ``self`` happen once per trip: the reference);
2. decorated with ``@stateful``, ``xp = jax.numpy`` and ``lx`` JAX's own
   ``jax.lax.*`` / ``jax.checkpoint`` (so ``@stateful`` routes them), run
   (b) eagerly, (c) as ``f(states, x)``, (d) under one ``jax.jit`` and (d')
   through ``autostate.jit`` on the model.

All must give the same outputs and states, and the functional states must be
exactly the attributes the source assigns (by their first path). Then
(e) one step of ``jax.vmap(f, in_axes=(None, 0))`` over the inputs (so
``cond``/``switch``/``while`` predicates are batched) must equal, row by row,
one plain step from the initial states, and (f) the derivative of the output
plus every float state after one step w.r.t. ``x`` (``jax.jacfwd`` and, with
no while loop, ``jax.grad`` through ``f``) must equal central differences of
the plain program run in float64.

Generated code keeps every stored, carried or returned array fresh (an
operator or call result, never a bare name), so numpy's in-place ``+=`` and
item writes cannot be seen through a second reference. Values go through
``tanh``; predicates are ``x.sum() > 0``-style and while loops are bounded by
an int counter in the carry.
Size with ``AUTOSTATE_PROPERTY_EXAMPLES`` (default 5: about 15 s on 2 cores;
about 1.3 s per further example). No generated construct is excluded: ~1,100
programs found no disagreement when this file was written.
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

pytestmark = pytest.mark.property

EXAMPLES = int(os.environ.get("AUTOSTATE_PROPERTY_EXAMPLES", "5"))
STEPS = 2

# One jitted step for every example: ``f`` is an argument, as in training.
jit_step = staged(lambda f, s, x: f(s, x))

# As tests/property/test_programs.py: numpy's and XLA's tanh differ in the last bits,
# and jitted (fused) arithmetic rounds differently from eager op by op.
RTOL, ATOL = 1e-4, 1e-5

MODEL_FLOATS = ("h", "g", "r")
SUB_FLOATS = ("a",)
SUB_PATHS = ("sub", "subs[0]")


# --- the two ``lx`` shims --------------------------------------------------------


def _py_scan(body, carry, xs):
    ys = []
    for i in range(len(xs)):
        carry, y = body(carry, xs[i])
        ys.append(y)
    return carry, np.stack(ys)


def _py_fori_loop(lo, hi, body, init):
    for i in range(int(lo), int(hi)):
        init = body(i, init)
    return init


def _py_cond(pred, true_fun, false_fun, *operands):
    return true_fun(*operands) if bool(pred) else false_fun(*operands)


def _py_switch(index, branches, *operands):
    return branches[min(max(int(index), 0), len(branches) - 1)](*operands)


def _py_while_loop(cond_fun, body, init):
    while bool(cond_fun(init)):
        init = body(init)
    return init


def _py_checkpoint(fn):
    return fn


def _py_map(fn, xs):
    return np.stack([fn(xs[i]) for i in range(len(xs))])


PLAIN_LX = types.SimpleNamespace(
    scan=_py_scan,
    fori_loop=_py_fori_loop,
    cond=_py_cond,
    switch=_py_switch,
    while_loop=_py_while_loop,
    checkpoint=_py_checkpoint,
    map=_py_map,
)
JAX_LX = types.SimpleNamespace(
    scan=jax.lax.scan,
    fori_loop=jax.lax.fori_loop,
    cond=jax.lax.cond,
    switch=jax.lax.switch,
    while_loop=jax.lax.while_loop,
    checkpoint=jax.checkpoint,
    map=jax.lax.map,
)


# --- generating source ---------------------------------------------------------

HELPER = '''
COEFS = [1.0, -0.5, 0.25]


def bump(m, v):
    """Outside any class: reads, assigns and augments the model's state."""
    m.count = m.count + 1
    m.g = xp.tanh(m.g + v)
    m.g *= 0.5
    return m.g * 1.0


def rows(n, v):
    """An (n, 3) stack of fresh rows for scan and map."""
    return xp.outer(xp.asarray(COEFS[:n], dtype=xp.float32), v)
'''


@dataclasses.dataclass
class Facts:
    """What the generated source assigns, for the expected state names."""

    model_writes: set[str] = dataclasses.field(default_factory=set)
    sub_writes: set[str] = dataclasses.field(default_factory=set)  # inside Sub
    sub_outside: set[str] = dataclasses.field(default_factory=set)  # from Model
    helper_used: bool = False


@dataclasses.dataclass
class Scope:
    """What a statement may refer to where it is generated."""

    me: str  # the receiver: ``self`` (Model or Sub)
    in_sub: bool  # inside Sub.update
    locals: list[str]
    has_x: bool  # the method input ``x`` is visible (closures in __call__)
    index_var: str | None = None  # a fori_loop index (traced under jax)
    lax_depth: int = 0  # lax calls around this point
    in_body: bool = False  # inside some lax body (r is read-only there)
    allow_methods: bool = True  # bound methods may be handed to lx here
    alias: bool = False  # the local ``s = self.sub`` (taken in __call__) is visible

    def nested(self, **changes: Any) -> Scope:
        changes.setdefault("locals", list(self.locals))
        return dataclasses.replace(self, **changes)


MAX_LAX_DEPTH = 3


class Writer:
    def __init__(self, draw, facts: Facts):
        self.draw = draw
        self.facts = facts
        self.counter = itertools.count()

    def pick(self, options):
        return self.draw(st.sampled_from(options))

    def sub_ref(self, scope: Scope) -> str:
        """A sub-model: by attribute, by list item, or by a local alias captured by bodies."""
        refs = [f"{scope.me}.{path}" for path in SUB_PATHS]
        return self.pick([*refs, "s"] if scope.alias else refs)

    def name(self, prefix: str) -> str:
        return f"{prefix}{next(self.counter)}"

    # expressions
    def floats(self, scope: Scope) -> tuple[str, ...]:
        return SUB_FLOATS if scope.in_sub else MODEL_FLOATS

    def vector_atom(self, scope: Scope) -> str:
        me = scope.me
        options = ["c", *scope.locals, *(f"{me}.{a}" for a in self.floats(scope))]
        if scope.has_x:
            options.append("x")
        if not scope.in_sub:
            options += [f"{me}.buf[0]", f"{me}.buf[1]", f"{me}.dd['a']", f"{me}.sub.a"]
            options += [f"{me}.subs[0].a"]
        return self.pick(options)

    def index(self, scope: Scope) -> str:
        options = ["0", "1", "2", "-1", f"{scope.me}.{'n' if scope.in_sub else 'count'} % 3"]
        if scope.index_var:
            options.append(f"{scope.index_var} % 3")
        return self.pick(options)

    def scalar_atom(self, scope: Scope) -> str:
        counter = "n" if scope.in_sub else "count"
        options = [
            "0.5",
            "-1.25",
            f"{scope.me}.{self.pick(self.floats(scope))}[{self.index(scope)}]",
            f"{scope.me}.{counter}.astype(xp.float32) * 0.25",
        ]
        if scope.index_var:
            options.append(f"{scope.index_var} * 0.5")
        return self.pick(options)

    def vector(self, scope: Scope, depth: int = 0) -> str:
        kind = self.pick(["atom", "atom", "tanh", "binop"] if depth < 2 else ["atom"])
        if kind == "atom":
            return self.vector_atom(scope)
        if kind == "tanh":
            return f"xp.tanh({self.vector(scope, depth + 1)})"
        return self.binop(scope, depth)

    def binop(self, scope: Scope, depth: int = 0) -> str:
        vec = self.vector(scope, depth + 1)
        other = (
            self.vector(scope, depth + 1) if self.draw(st.booleans()) else self.scalar_atom(scope)
        )
        op = self.pick(["+", "-", "*"])
        return f"({vec} {op} {other})" if self.draw(st.booleans()) else f"({other} {op} {vec})"

    def bounded(self, scope: Scope) -> str:
        return f"xp.tanh({self.vector(scope)})"

    def fresh(self, scope: Scope) -> str:
        """A new array (never a bare name), so numpy's in-place ops alias nothing."""
        return self.bounded(scope) if self.draw(st.booleans()) else self.binop(scope)

    def predicate(self, scope: Scope) -> str:
        me = scope.me
        counter = "n" if scope.in_sub else "count"
        options = [
            "c.sum() > 0",
            f"{me}.{self.pick(self.floats(scope))}.sum() > 0",
            f"{me}.{counter} % 2 == 0",
        ]
        if scope.has_x:
            options.append("x.sum() > 0")
        return self.pick(options)

    # statements
    def block(self, scope: Scope, low: int = 1, high: int = 3) -> list[str]:
        lines: list[str] = []
        for _ in range(self.draw(st.integers(low, high))):
            lines += self.statement(scope)
        return lines

    def own(self, scope: Scope, attr: str) -> str:
        (self.facts.sub_writes if scope.in_sub else self.facts.model_writes).add(attr)
        return f"{scope.me}.{attr}"

    def statement(self, scope: Scope) -> list[str]:
        kinds = ["local", "carry", "carry", "set", "aug", "int", "item", "augitem"]
        if not scope.in_sub:
            kinds += ["container", "sub_call", "sub_write", "helper"]
        if scope.lax_depth < MAX_LAX_DEPTH:
            kinds += ["lax", "lax", "lax"] if scope.lax_depth == 0 else ["lax", "lax"]
        kind = self.pick(kinds)
        me = scope.me
        floats = [a for a in self.floats(scope) if not (scope.in_body and a == "r")]
        counter = "n" if scope.in_sub else "count"
        if kind == "local":
            name = self.name("t")
            line = f"{name} = {self.fresh(scope)}"
            scope.locals.append(name)
            return [line]
        if kind == "carry":
            return [f"c = {self.fresh(scope)}"]
        if kind == "set":
            return [f"{self.own(scope, self.pick(floats))} = {self.fresh(scope)}"]
        if kind == "aug":
            target = self.own(scope, self.pick(floats))
            return [f"{target} {self.pick(['+', '-', '*'])}= {self.bounded(scope)}"]
        if kind == "int":
            form = self.pick(["+= 1", "-= 2", "= ({me}.{n} * 3 + 1) % 7", "= {me}.{n} + 1"])
            return [f"{self.own(scope, counter)} {form.format(me=me, n=counter)}"]
        if kind == "item":
            target = self.own(scope, self.pick(floats))
            return [f"{target}[{self.index(scope)}] = {self.bounded(scope)}[{self.index(scope)}]"]
        if kind == "augitem":
            target = self.own(scope, self.pick(floats))
            op = self.pick(["+", "-", "*"])
            return [f"{target}[{self.index(scope)}] {op}= {self.bounded(scope)}[1]"]
        if kind == "container":
            form = self.pick(["item", "augitem", "shift", "dset", "daug", "deep", "ddeep"])
            if form in ("deep", "ddeep"):
                # An item of an array inside list or dict state (index maybe traced).
                self.facts.model_writes.add("buf" if form == "deep" else "dd")
                target = f"{me}.buf[{self.pick(['0', '1'])}]" if form == "deep" else f"{me}.dd['a']"
                op = self.pick(["", "+", "*"])
                return [f"{target}[{self.index(scope)}] {op}= {self.bounded(scope)}[1]"]
            self.facts.model_writes.add("buf" if form in ("item", "augitem", "shift") else "dd")
            if form == "item":
                return [f"{me}.buf[{self.pick(['0', '1', '-1'])}] = {self.fresh(scope)}"]
            if form == "augitem":
                return [f"{me}.buf[{self.pick(['0', '1', '-1'])}] += {self.bounded(scope)}"]
            if form == "shift":
                return [f"{me}.buf = [{me}.buf[1] * 1.0, {self.fresh(scope)}]"]
            if form == "dset":
                return [f"{me}.dd['{self.pick(['a', 'b'])}'] = {self.fresh(scope)}"]
            return [f"{me}.dd['b'] {self.pick(['+', '-', '*'])}= {self.bounded(scope)}"]
        if kind == "sub_call":
            ref = self.sub_ref(scope)
            if self.draw(st.booleans()):
                return [f"c = c + {ref}.update({self.fresh(scope)})"]
            name = self.name("t")
            line = f"{name} = {ref}.update({self.fresh(scope)})"
            scope.locals.append(name)
            return [line]
        if kind == "sub_write":
            ref = self.sub_ref(scope)
            form = self.pick(["set", "aug", "int"])
            if form == "int":
                self.facts.sub_outside.add("n")
                return [f"{ref}.n += 1"]
            self.facts.sub_outside.add("a")
            if form == "set":
                return [f"{ref}.a = {self.fresh(scope)}"]
            return [f"{ref}.a {self.pick(['+', '-', '*'])}= {self.bounded(scope)}"]
        if kind == "helper":
            self.facts.helper_used = True
            return [f"c = c + bump({me}, {self.fresh(scope)})"]
        assert kind == "lax"
        return self.lax_call(scope)

    # lax calls and their bodies
    def body_scope(self, scope: Scope, **changes: Any) -> Scope:
        return scope.nested(lax_depth=scope.lax_depth + 1, in_body=True, **changes)

    def closure(self, scope: Scope, params: str, head: list[str], tail: str, **changes) -> tuple:
        """A nested ``def`` returning (name, lines); ``tail`` formats with a fresh value."""
        name = self.name("body")
        inner = self.body_scope(scope, **changes)
        lines = self.block(inner)
        lines.append(tail.format(fresh=self.fresh(inner)))
        return name, [f"def {name}({params}):", *indent(head), *indent(lines)]

    def unary_fn(self, scope: Scope) -> tuple[str, list[str]]:
        """A function of one vector returning a vector, by some road."""
        me = scope.me
        roads = ["closure", "closure", "lambda_sub"]
        if not scope.in_sub:
            roads += ["sub_method", "lambda_helper"]
            if scope.allow_methods:
                roads += ["method", "method"]
        else:
            roads.append("lambda_self")  # reads only: a lambda cannot assign
        roads.append("lambda_pure")
        road = self.pick(roads)
        if road == "closure":
            return self.closure(scope, "c", [], "return {fresh}", has_x=scope.has_x)
        if road == "sub_method":
            return f"{self.sub_ref(scope)}.update", []
        if road == "method":
            return f"{me}.{self.pick(['branch_a', 'branch_b'])}", []
        if road == "lambda_helper":
            self.facts.helper_used = True
            return f"lambda c: bump({me}, c * 0.5)", []
        if road == "lambda_self":
            return f"lambda c: {me}.a * c", []
        if road == "lambda_pure":
            return f"lambda c: xp.tanh(c * {me}.{self.pick(self.floats(scope))})", []
        if scope.in_sub:
            return "lambda c: xp.tanh(c - 0.5)", []
        return f"lambda c: {self.sub_ref(scope)}.update(c * 2.0)", []

    def lax_call(self, scope: Scope) -> list[str]:
        kinds = ["scan", "fori", "cond", "switch", "while", "checkpoint", "map"]
        if not scope.in_sub:
            kinds.append("operand")
        kind = self.pick(kinds)
        me = scope.me
        if kind == "operand":
            # A sub-model handed to lx as an operand: its state is reached through it.
            ref = self.sub_ref(scope)
            form = self.pick(["cond", "switch", "checkpoint"])
            write = "lambda s, v: s.update(v)"
            read = "lambda s, v: xp.tanh(v * s.a)"
            value = self.fresh(scope)
            if form == "checkpoint":
                return [f"c = lx.checkpoint(lambda s, v: s.update(v) + s.a)({ref}, {value})"]
            if form == "cond":
                branches = self.pick([(write, read), (read, write), (write, write)])
                call = f"lx.cond({self.predicate(scope)}, {branches[0]}, {branches[1]}"
                return [f"c = {call}, {ref}, {value})"]
            index = self.pick([f"{me}.count % 3", "(c.sum() > 0).astype(xp.int32)"])
            return [f"c = lx.switch({index}, [{write}, {read}, {write}], {ref}, {value})"]
        if kind == "scan":
            n = self.draw(st.integers(1, 3))
            roads = ["closure", "closure"]
            if not scope.in_sub:
                roads.append("lambda_sub")
                if scope.allow_methods:
                    roads += ["method", "method"]
            road = self.pick(roads)
            pre: list[str] = []
            if road == "closure":
                name, pre = self.closure(
                    scope.nested(locals=[*scope.locals, "xi"]),
                    "c, xi",
                    [],
                    "return {fresh}, c * 0.5",
                )
            elif road == "method":
                name = f"{me}.scan_step"
            else:
                name = f"lambda c, xi: ({self.sub_ref(scope)}.update(c + xi), c * 0.5)"
            ys = self.name("ys")
            return [
                *pre,
                f"c, {ys} = lx.scan({name}, {self.fresh(scope)}, rows({n}, {self.fresh(scope)}))",
                f"c = c + {ys}.mean(0)",
            ]
        if kind == "map":
            n = self.draw(st.integers(1, 3))
            name, pre = self.unary_fn(scope)
            ys = self.name("ys")
            return [
                *pre,
                f"{ys} = lx.map({name}, rows({n}, {self.fresh(scope)}))",
                f"c = c + {ys}.sum(0)",
            ]
        if kind == "fori":
            hi = self.pick(["0", "1", "2", "3", f"{me}.{'n' if scope.in_sub else 'count'} % 3"])
            roads = ["closure", "closure", "lambda"]
            if not scope.in_sub and scope.allow_methods:
                roads.append("method")
            road = self.pick(roads)
            pre = []
            if road == "closure":
                var = f"i{scope.lax_depth}"
                name, pre = self.closure(scope, f"{var}, c", [], "return {fresh}", index_var=var)
            elif road == "method":
                name = f"{me}.loop_step"
            else:
                inner, pre = self.unary_fn(scope)
                name = f"lambda i, c: ({inner})(c) * 0.5"
            return [*pre, f"c = lx.fori_loop(0, {hi}, {name}, {self.fresh(scope)})"]
        if kind in ("cond", "switch"):
            count = 2 if kind == "cond" else self.draw(st.integers(1, 3))
            names, pre = [], []
            for _ in range(count):
                name, lines = self.unary_fn(scope)
                names.append(name)
                pre += lines
            if kind == "cond":
                call = (
                    f"lx.cond({self.predicate(scope)}, {names[0]}, {names[1]}, {self.fresh(scope)})"
                )
            else:
                counter = "n" if scope.in_sub else "count"
                index = self.pick(
                    [f"{me}.{counter} % 3", f"{me}.{counter}", "(c.sum() > 0).astype(xp.int32)"]
                )
                call = f"lx.switch({index}, [{', '.join(names)}], {self.fresh(scope)})"
            return [*pre, f"c = {call}"]
        if kind == "checkpoint":
            name, pre = self.unary_fn(scope)
            return [*pre, f"c = lx.checkpoint({name})({self.fresh(scope)})"]
        assert kind == "while"
        bound = self.draw(st.integers(0, 3))
        counter = "n" if scope.in_sub else "count"
        cond_name = self.name("keep")
        test = self.pick(
            [
                f"jc[0] < {bound}",
                f"(jc[0] < {bound}) & (jc[1].sum() < 1.0)",
                f"(jc[0] < {bound}) & ({me}.{self.pick(self.floats(scope))}.sum() < 2.0)",
                f"(jc[0] < {bound}) & ({me}.{counter} < 100)",
            ]
        )
        pre = [f"def {cond_name}(jc):", f"    return {test}"]
        roads = ["closure", "closure"]
        if not scope.in_sub and scope.allow_methods:
            roads.append("method")
        if self.pick(roads) == "closure":
            name, lines = self.closure(scope, "jc", ["j, c = jc"], "return j + 1, {fresh}")
            pre += lines
        else:
            name = f"{me}.wstep"
        zero = "xp.asarray(0, dtype=xp.int32)"
        return [*pre, f"_, c = lx.while_loop({cond_name}, {name}, ({zero}, {self.fresh(scope)}))"]


def indent(lines: list[str]) -> list[str]:
    return ["    " + line for line in lines]


@dataclasses.dataclass
class Program:
    source: str
    expected_states: list[str]
    seed: int


def _method(
    writer: Writer, signature: str, head: list[str], tail: str, names=(), **scope: Any
) -> list[str]:
    inner = Scope(
        me="self", in_sub=False, locals=list(names), has_x=False, allow_methods=False, **scope
    )
    lines = [*head, *writer.block(inner, 1, 3), tail.format(fresh=writer.fresh(inner))]
    return [f"def {signature}:", *indent(lines)]


@st.composite
def programs(draw) -> Program:
    facts = Facts()
    w = Writer(draw, facts)

    # Sub.update: may itself run lx with closures and lambdas.
    sub_scope = Scope(me="self", in_sub=True, locals=[], has_x=False, lax_depth=1)
    sub_lines = ["c = xp.tanh(v)", *w.block(sub_scope, 1, 3), f"return {w.fresh(sub_scope)}"]

    # Bound methods handed to lx directly; their own lx calls use no bound methods
    # (so none recurses into itself). They run inside a body: r is read-only there.
    methods = [
        _method(
            w,
            "scan_step(self, c, xi)",
            [],
            "return {fresh}, c * 0.5",
            names=("xi",),
            lax_depth=1,
            in_body=True,
        ),
        _method(
            w,
            "loop_step(self, i, c)",
            [],
            "return {fresh}",
            lax_depth=1,
            in_body=True,
            index_var="i",
        ),
        _method(w, "branch_a(self, c)", [], "return {fresh}", lax_depth=1, in_body=True),
        _method(w, "branch_b(self, c)", [], "return {fresh}", lax_depth=1, in_body=True),
        _method(
            w, "wstep(self, jc)", ["j, c = jc"], "return j + 1, {fresh}", lax_depth=1, in_body=True
        ),
    ]

    # __call__: state read and written before, between and after the lx calls; r
    # (only read in bodies) is written here.
    alias = draw(st.booleans())
    call_scope = Scope(me="self", in_sub=False, locals=[], has_x=True, alias=alias)
    call_lines = ["c = xp.tanh(x)", *(["s = self.sub"] if alias else [])]
    if draw(st.booleans()):
        facts.model_writes.add("r")
        call_lines.append(f"self.r = {w.fresh(call_scope)}")
    call_lines += w.block(call_scope, 1, 4)
    # At least one lx call at the top.
    call_lines += w.lax_call(call_scope)
    call_lines += w.block(call_scope, 0, 2)
    if draw(st.booleans()):
        facts.model_writes.add("r")
        call_lines.append(f"self.r = {w.fresh(call_scope)}")
    call_lines.append(f"return {w.fresh(call_scope)}, self.count * 1")

    # State only written from outside its class (bump writes count and g; Model
    # writes Sub's a and n) must be declared; a few others are declared too.
    if facts.helper_used:
        facts.model_writes.update(("count", "g"))
    model_declared = {a for a in (*MODEL_FLOATS, "count") if draw(st.integers(0, 4)) == 0}
    sub_declared = {a for a in ("a", "n") if draw(st.integers(0, 4)) == 0}
    sub_declared |= facts.sub_outside - facts.sub_writes
    helper_declared = {"count", "g"} if facts.helper_used else set()
    model_declared |= helper_declared

    def init(attr: str, value: str, declared: set[str]) -> str:
        return f"self.{attr} = {f'declare({value})' if attr in declared else value}"

    source = "\n".join(
        [
            '"""Generated by tests/property/test_control_flow.py."""',
            HELPER,
            "",
            "class Sub:",
            "    def __init__(self, seed):",
            "        " + init("a", "xp.full((3,), seed, dtype=xp.float32)", sub_declared),
            "        " + init("n", "xp.asarray(int(4 * seed), dtype=xp.int32)", sub_declared),
            "",
            "    def update(self, v):",
            *indent(indent(sub_lines)),
            "",
            "",
            "class Model:",
            "    def __init__(self):",
            "        "
            + init("h", "xp.asarray([0.1, -0.2, 0.3], dtype=xp.float32)", model_declared),
            "        " + init("g", "xp.full((3,), 0.75, dtype=xp.float32)", model_declared),
            "        "
            + init("r", "xp.asarray([0.5, 1.0, -0.5], dtype=xp.float32)", model_declared),
            "        " + init("count", "xp.asarray(1, dtype=xp.int32)", model_declared),
            "        self.buf = [xp.zeros(3, dtype=xp.float32), xp.ones(3, dtype=xp.float32)]",
            "        self.dd = {'a': xp.full((3,), 0.5, dtype=xp.float32), "
            "'b': xp.zeros(3, dtype=xp.float32)}",
            "        self.sub = Sub(0.25)",
            "        self.subs = [Sub(-0.5)]",
            "",
            *indent([line for m in methods for line in (*m, "")]),
            "    def __call__(self, x):",
            *indent(indent(call_lines)),
            "",
        ]
    )
    # Int arrays are always in the states (constants, never trained).
    model_state = facts.model_writes | model_declared | {"count"}
    sub_state = facts.sub_writes | sub_declared | {"n"}
    expected = sorted(model_state) + [f"{p}.{a}" for p in SUB_PATHS for a in sorted(sub_state)]
    return Program(source, sorted(expected), draw(st.integers(0, 2**16)))


# --- running it four ways ------------------------------------------------------

_directory: Path | None = None
_names = itertools.count()
STATE_PATHS = [
    *MODEL_FLOATS,
    "count",
    "buf",
    "dd",
    *(f"{p}.{a}" for p in SUB_PATHS for a in (*SUB_FLOATS, "n")),
]


def _load(path: Path, name: str, xp: Any, lx: Any, declare: Any) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    module.xp = xp
    module.lx = lx
    module.declare = declare
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _snapshot(model: Any) -> dict[str, Any]:
    return {p: jax.tree_util.tree_map(np.array, read_path(model, p)) for p in STATE_PATHS}


def _assert_close(actual: Any, expected: Any, what: str, source: str) -> None:
    assert_generated_close(actual, expected, what, source, rtol=RTOL, atol=ATOL)


def _write(source: str) -> tuple[Path, str]:
    global _directory
    if _directory is None:
        _directory = Path(tempfile.mkdtemp(prefix="autostate-property-cf-"))
        atexit.register(shutil.rmtree, _directory, True)
    name = f"autostate_prop_cf_{os.getpid()}_{next(_names)}"
    path = _directory / f"{name}.py"
    path.write_text(source)
    return path, name


def _pair(source: str) -> tuple[types.ModuleType, types.ModuleType, str]:
    path, name = _write(source)
    plain = _load(path, f"{name}_plain", np, PLAIN_LX, lambda value: value)
    decorated = _load(path, f"{name}_decorated", jnp, JAX_LX, autostate.state)
    for cls in ("Sub", "Model"):
        if hasattr(decorated, cls):
            autostate.stateful(getattr(decorated, cls))
    return plain, decorated, name


def _run(program: Program) -> None:
    rng = np.random.default_rng(program.seed)
    xs = [rng.standard_normal(3).astype(np.float32) for _ in range(STEPS)]
    plain, decorated, name = _pair(program.source)
    source = program.source
    try:
        reference = plain.Model()
        plain_outs = [jax.tree_util.tree_map(np.array, reference(x.copy())) for x in xs]
        final_plain = _snapshot(reference)

        eager = decorated.Model()
        eager_outs = [eager(jnp.asarray(x)) for x in xs]
        _assert_close(eager_outs, plain_outs, "eager and plain outputs", source)
        _assert_close(_snapshot(eager), final_plain, "eager and plain states", source)

        f, states = decorated.Model().functionalize()
        assert sorted(states) == program.expected_states, (sorted(states), source)
        f_outs = []
        for x in xs:
            out, states = f(states, jnp.asarray(x))
            f_outs.append(out)
        _assert_close(f_outs, plain_outs, "f and plain outputs", source)
        _assert_close(
            _snapshot(autostate.freeze(f, states)), final_plain, "f and plain states", source
        )

        f, states = decorated.Model().functionalize()
        jit_outs = []
        for x in xs:
            out, states = jit_step(f, states, jnp.asarray(x))
            jit_outs.append(out)
        _assert_close(jit_outs, plain_outs, "jit and plain outputs", source)
        _assert_close(
            _snapshot(autostate.freeze(f, states)), final_plain, "jit and plain states", source
        )
        assert not any(
            isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves((f, states))
        )
        compiled = decorated.Model()
        step = autostate.jit(lambda model, x: model(x))
        compiled_outs = [step(compiled, jnp.asarray(x)) for x in xs]
        _assert_close(compiled_outs, plain_outs, "autostate.jit and plain outputs", source)
        _assert_close(_snapshot(compiled), final_plain, "autostate.jit and plain states", source)
        _check_vmap(plain, decorated, xs, source)
        _check_grad(program, decorated, xs[0])
    finally:
        for module_name in (f"{name}_plain", f"{name}_decorated", f"{name}_plain64"):
            sys.modules.pop(module_name, None)


def _check_vmap(plain: Any, decorated: Any, xs: list[np.ndarray], source: str) -> None:
    """(e) One step of ``jax.vmap(f)`` over a batch of inputs (predicates batched too)
    is, per example, one plain step from the initial states."""
    f, states = decorated.Model().functionalize()
    outs, batched = jax.vmap(f, in_axes=(None, 0))(states, jnp.asarray(np.stack(xs)))
    for b, x in enumerate(xs):
        reference = plain.Model()
        out = jax.tree_util.tree_map(np.array, reference(x.copy()))
        row = jax.tree_util.tree_map(lambda a, b=b: a[b], (outs, batched))
        expected = {n: jax.tree_util.tree_map(np.array, read_path(reference, n)) for n in batched}
        _assert_close(row, (out, expected), f"vmap row {b} and plain step", source)


# The float64 plain reference for finite differences: ``xp.float32`` is float64 there.
NP64 = types.SimpleNamespace(
    full=np.full,
    asarray=np.asarray,
    zeros=np.zeros,
    ones=np.ones,
    tanh=np.tanh,
    outer=np.outer,
    float32=np.float64,
    int32=np.int32,
)
GRAD_RTOL, GRAD_ATOL = 2e-3, 2e-3


def _check_grad(program: Program, decorated: Any, x: np.ndarray) -> None:
    """(f) d/dx of (output + every float state after one step) through ``f``, in forward
    mode and (without while loops) reverse mode, against central differences of the
    plain program run in float64."""
    source = program.source
    floats = [n for n in program.expected_states if n != "count" and not n.endswith(".n")]
    path, name = _write(source)
    plain64 = _load(path, f"{name}_plain64", NP64, PLAIN_LX, lambda value: value)

    def plain_loss(v: np.ndarray) -> float:
        model = plain64.Model()
        out, _ = model(v)
        leaves = jax.tree_util.tree_leaves([read_path(model, n) for n in floats])
        return float(np.sum(out) + sum(np.sum(leaf) for leaf in leaves))

    eps = 1e-5
    x64 = x.astype(np.float64)
    basis = np.eye(3)
    numeric = np.array(
        [(plain_loss(x64 + eps * e) - plain_loss(x64 - eps * e)) / (2 * eps) for e in basis]
    )

    f, states = decorated.Model().functionalize()

    def loss(v: jax.Array) -> jax.Array:
        (out, _), new = f(states, v)
        leaves = jax.tree_util.tree_leaves([new[n] for n in floats])
        return jnp.sum(out) + sum(jnp.sum(leaf) for leaf in leaves)

    try:
        np.testing.assert_allclose(
            jax.jacfwd(loss)(jnp.asarray(x)), numeric, rtol=GRAD_RTOL, atol=GRAD_ATOL
        )
        # JAX has no reverse mode through while_loop (nor fori_loop with traced bounds).
        if "while_loop" not in source and "fori_loop(0, self." not in source:
            np.testing.assert_allclose(
                jax.grad(loss)(jnp.asarray(x)), numeric, rtol=GRAD_RTOL, atol=GRAD_ATOL
            )
    except AssertionError as exc:
        raise AssertionError(f"gradients differ:\n{exc}\n--- source ---\n{source}") from None


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(programs())
def test_state_in_lax_control_flow_means_what_python_means(program: Program) -> None:
    _run(program)
