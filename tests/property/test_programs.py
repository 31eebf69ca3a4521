"""Property test: random stateful classes run the same three ways.

Hypothesis writes two classes as Python source (a ``Sub`` with state, and a
``Model`` holding one ``Sub``, a list of two and maybe an alias of the first):
random sequences of state reads, assignments, augmented and subscript
assignments, tuple targets, Python ``if``/``for`` on static values, calls of
sub-models, writes to a sub-model's state from outside its class (directly,
through a loop variable and through a module-level helper). The source goes
to a fresh ``.py`` file (``@stateful`` reads source) that is imported twice:

1. undecorated, with ``xp = numpy`` (plain Python, the reference);
2. decorated with ``@stateful``, ``xp = jax.numpy``, called eagerly;
3. the same, functionalized and stepped by one ``jax.jit``;
4. the same model stepped by ``autostate.jit`` (updated in place).

All four must give the same outputs and final states; the functional states
must be exactly the attributes the source assigns (by their first path).

Construct families beyond plain methods (issue 11): a ``functools.wraps``
decorator on ``__call__``; a module-level function assigned in the class body
(``extra = external_extra``) and a factory-made method (``inc = make_inc(c)``),
both only reached indirectly by the analysis; ``copy.copy(self)`` and
``copy.deepcopy(self.sub)`` written and called inside the method; list and
dict state (``self.buf``, ``self.dd``) with item writes and in-place operators
(``+=`` on a list, ``|=`` on a dict); a list mixing a sub-model and a Python
scalar (``self.mixed = [Sub(...), 2]``).

Generated code keeps every stored or passed array fresh (a call or an
operator result, never a bare name), so numpy's in-place ``+=`` and item
assignment cannot be seen through a second reference; augmented updates and
most assignments go through ``tanh``, so values stay small and well
conditioned.
Size with ``AUTOSTATE_PROPERTY_EXAMPLES`` (default 50: about 6 s on 2 cores); the long mode
``AUTOSTATE_PROPERTY_LONG=1`` runs at least 2,000 programs.
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
from models.checks import assert_generated_close, assert_trees_close, read_path
from semantics.harness import staged

import autostate

pytestmark = pytest.mark.property

EXAMPLES = int(os.environ.get("AUTOSTATE_PROPERTY_EXAMPLES", "50"))
if os.environ.get("AUTOSTATE_PROPERTY_LONG"):
    EXAMPLES = max(EXAMPLES, 2000)
STEPS = 3
FLOATS = ("f0", "f1")
INTS = ("n0",)
SUB_PATHS = ("sub", "subs[0]", "subs[1]", "mixed[0]")
CONTAINERS = ("buf", "dd")

# One jitted step for every example: ``f`` is an argument, as in training.
jit_step = staged(lambda f, s, x: f(s, x))

# numpy's and XLA's tanh differ in the last bits, and XLA's fused jitted
# arithmetic rounds differently from eager op-by-op; values that grow through
# many unbounded sub-model updates (to ~1e4) amplify that to ~2e-5 relative.
RTOL, ATOL = 1e-4, 1e-5


# --- generating source ---------------------------------------------------------


@dataclasses.dataclass
class ClassInfo:
    name: str
    receiver: str
    own_writes: set[str] = dataclasses.field(default_factory=set)
    outside_writes: set[str] = dataclasses.field(default_factory=set)


@dataclasses.dataclass
class Scope:
    """What a statement may refer to where it is generated."""

    locals: list[str]
    loop_vars: list[tuple[str, int]]  # (name, range bound)
    sub_var: str | None = None  # loop variable over self.subs
    depth: int = 0

    def nested(self, **changes: Any) -> Scope:
        return dataclasses.replace(
            self, locals=list(self.locals), depth=self.depth + 1, **changes
        )


class BodyWriter:
    """Draws the statements of one method of ``Sub`` or ``Model``."""

    def __init__(
        self, draw, info: ClassInfo, sub: ClassInfo | None, has_alias: bool, top: bool = True
    ):
        self.draw = draw
        self.top = top  # the method itself (not the assigned function)
        self.info = info
        self.me = info.receiver
        self.sub = sub  # set for Model: the Sub it holds
        self.has_alias = has_alias
        self.counter = itertools.count()

    # expressions
    def pick(self, options):
        return self.draw(st.sampled_from(options))

    def index(self, scope: Scope) -> str:
        options = ["0", "1", "2", f"{self.me}.n0 % 3", "-1"]
        options += [name for name, bound in scope.loop_vars if bound <= 3]
        return self.pick(options)

    def sub_refs(self, scope: Scope) -> list[str]:
        if self.sub is None:
            return []
        refs = [f"{self.me}.sub", f"{self.me}.subs[0]", f"{self.me}.subs[1]", f"{self.me}.mixed[0]"]
        if self.has_alias:
            refs.append(f"{self.me}.alias")
        if scope.sub_var:
            refs.append(scope.sub_var)
        return refs

    def vector_atom(self, scope: Scope) -> str:
        options = ["x", *(f"{self.me}.{f}" for f in FLOATS), *scope.locals]
        options += [f"{ref}.{f}" for ref in self.sub_refs(scope) for f in FLOATS]
        if self.sub is not None:
            options += [f"{self.me}.buf[0]", f"{self.me}.buf[1]", f"{self.me}.dd['a']"]
        return self.pick(options)

    def scalar_atom(self, scope: Scope) -> str:
        return self.pick(
            [
                "0.5",
                "-1.25",
                "2.0",
                f"{self.me}.{self.pick(FLOATS)}[{self.index(scope)}]",
                f"{self.me}.n0.astype(xp.float32) * 0.25",
            ]
        )

    def vector(self, scope: Scope, depth: int = 0) -> str:
        kind = self.pick(["atom", "atom", "tanh", "binop", "binop"] if depth < 2 else ["atom"])
        if kind == "atom":
            return self.vector_atom(scope)
        if kind == "tanh":
            return f"xp.tanh({self.vector(scope, depth + 1)})"
        return self.binop(scope, depth)

    def binop(self, scope: Scope, depth: int = 0) -> str:
        vec = self.vector(scope, depth + 1)
        other = self.vector(scope, depth + 1) if self.draw(st.booleans()) else self.scalar_atom(scope)
        op = self.pick(["+", "-", "*"])
        return f"({vec} {op} {other})" if self.draw(st.booleans()) else f"({other} {op} {vec})"

    def bounded(self, scope: Scope) -> str:
        return f"xp.tanh({self.vector(scope)})"

    def fresh(self, scope: Scope) -> str:
        """A new array (never a bare name), so numpy's in-place ops alias nothing."""
        return self.bounded(scope) if self.draw(st.booleans()) else self.binop(scope)

    def condition(self, scope: Scope) -> str:
        options = [f"{self.me}.flag", f"not {self.me}.flag", f"{self.me}.k > 1", f"{self.me}.k == 2"]
        for name, _ in scope.loop_vars:
            options += [f"{name} == 1", f"{name} % 2 == 0"]
        return self.pick(options)

    # statements
    def block(self, scope: Scope, low: int = 1, high: int = 3) -> list[str]:
        lines: list[str] = []
        for _ in range(self.draw(st.integers(low, high))):
            lines += self.statement(scope)
        return lines

    def own(self, attr: str) -> str:
        self.info.own_writes.add(attr)
        return f"{self.me}.{attr}"

    def outside(self, ref: str, attr: str) -> str:
        assert self.sub is not None
        self.sub.outside_writes.add(attr)
        return f"{ref}.{attr}"

    def statement(self, scope: Scope) -> list[str]:
        kinds = ["local", "local", "set", "aug", "int", "item", "augitem", "tuple"]
        if scope.depth < 2:
            kinds += ["if", "for"]
        if self.sub is not None:
            kinds += ["call_sub", "sub_write", "helper", "container", "container", "mixed"]
            if self.top:
                kinds += ["call_extra", "call_inc", "copy", "deepcopy"]
            if scope.depth < 2 and scope.sub_var is None:
                kinds.append("for_subs")
        kind = self.pick(kinds)
        f = self.pick(FLOATS)
        if kind == "local":
            name = f"t{next(self.counter)}"
            line = f"{name} = {self.fresh(scope)}"
            scope.locals.append(name)
            return [line]
        if kind == "set":
            return [f"{self.own(f)} = {self.fresh(scope)}"]
        if kind == "aug":
            return [f"{self.own(f)} {self.pick(['+', '-', '*'])}= {self.bounded(scope)}"]
        if kind == "int":
            form = self.pick(["+= 1", "-= 2", "+= {me}.k", "= ({me}.n0 * 3 + 1) % 7"])
            return [f"{self.own('n0')} {form.format(me=self.me)}"]
        if kind == "item":
            return [f"{self.own(f)}[{self.index(scope)}] = {self.bounded(scope)}[{self.index(scope)}]"]
        if kind == "augitem":
            op = self.pick(["+", "-", "*"])
            return [f"{self.own(f)}[{self.index(scope)}] {op}= {self.bounded(scope)}[1]"]
        if kind == "tuple":
            form = self.pick(["two", "swap", "with_local", "items"])
            if form == "two":
                return [f"{self.own('f0')}, {self.own('f1')} = {self.fresh(scope)}, {self.fresh(scope)}"]
            if form == "swap":
                return [f"{self.own('f0')}, {self.own('f1')} = {self.me}.f1, {self.me}.f0"]
            if form == "items":
                value = self.bounded(scope)
                return [
                    f"{self.own('f0')}[{self.index(scope)}], {self.own('f1')}[0] = "
                    f"{value}[0], {value}[2]"
                ]
            name = f"t{next(self.counter)}"
            line = f"{name}, {self.own(f)} = {self.fresh(scope)}, {self.fresh(scope)}"
            scope.locals.append(name)
            return [line]
        if kind == "if":
            lines = [f"if {self.condition(scope)}:", *indent(self.block(scope.nested()))]
            if self.draw(st.booleans()):
                lines += ["else:", *indent(self.block(scope.nested()))]
            return lines
        if kind == "for":
            var = f"i{scope.depth}"
            bound, header = self.pick([(3, f"range({self.me}.k)"), (2, "range(2)")])
            inner = scope.nested(loop_vars=[*scope.loop_vars, (var, bound)])
            return [f"for {var} in {header}:", *indent(self.block(inner))]
        if kind == "call_sub":
            ref = self.pick(self.sub_refs(scope))
            name = f"t{next(self.counter)}"
            line = f"{name} = {ref}({self.fresh(scope)})"
            scope.locals.append(name)
            return [line]
        if kind == "sub_write":
            ref = self.pick(self.sub_refs(scope))
            # No item writes: outside the class a state is a plain (immutable) jax array.
            form = self.pick(["set", "aug", "int"])
            if form == "set":
                return [f"{self.outside(ref, f)} = {self.fresh(scope)}"]
            if form == "aug":
                return [f"{self.outside(ref, f)} {self.pick(['+', '-', '*'])}= {self.bounded(scope)}"]
            return [f"{self.outside(ref, 'n0')} += 1"]
        if kind == "helper":
            ref = self.pick(self.sub_refs(scope))
            self.outside(ref, "f0")
            name = f"t{next(self.counter)}"
            line = f"{name} = helper({ref}, {self.fresh(scope)})"
            scope.locals.append(name)
            return [line]
        if kind == "container":
            form = self.pick(["shift", "iadd", "item", "ior", "dset", "daug"])
            self.info.own_writes.add("buf" if form in ("shift", "iadd", "item") else "dd")
            me = self.me
            if form == "shift":
                return [f"{me}.buf = [{me}.buf[1], {self.fresh(scope)}]"]
            if form == "iadd":
                return [f"{me}.buf += [{self.fresh(scope)}]", f"{me}.buf = {me}.buf[-2:]"]
            if form == "item":
                return [f"{me}.buf[{self.pick(['0', '1', '-1'])}] = {self.fresh(scope)}"]
            if form == "ior":
                return [f"{me}.dd |= [('a', {self.fresh(scope)})]"]
            if form == "dset":
                return [f"{me}.dd['b'] = {self.fresh(scope)}"]
            return [f"{me}.dd['b'] {self.pick(['+', '-', '*'])}= {self.bounded(scope)}"]
        if kind in ("mixed", "call_extra", "call_inc"):
            name = f"t{next(self.counter)}"
            call = {"mixed": "mixed[0]", "call_extra": "extra", "call_inc": "inc"}[kind]
            line = f"{name} = {self.me}.{call}({self.fresh(scope)})"
            if kind == "mixed":
                line += f" * {self.me}.mixed[1]"
            scope.locals.append(name)
            return [line]
        if kind == "copy":
            # Only whole-value writes on the copy: it shares its arrays with
            # self, and numpy's in-place += would change both (jax's cannot).
            name, value = f"c{next(self.counter)}", f"t{next(self.counter)}"
            lines = [
                f"{name} = copy.copy({self.me})",
                f"{name}.{f} = {self.fresh(scope)}",
                f"{name}.n0 = {name}.n0 + 5",
                f"{value} = {name}.{f} * {self.me}.{f}",
            ]
            scope.locals.append(value)
            return lines
        if kind == "deepcopy":
            name, value = f"c{next(self.counter)}", f"t{next(self.counter)}"
            ref = self.pick(self.sub_refs(scope))
            lines = [
                f"{name} = copy.deepcopy({ref})",
                f"{name}.{f} = {self.fresh(scope)}",
                f"{value} = {name}({self.fresh(scope)}) + {name}.{f}",
            ]
            scope.locals.append(value)
            return lines
        assert kind == "for_subs"
        var = f"m{scope.depth}"
        inner = scope.nested(sub_var=var)
        return [f"for {var} in {self.me}.subs:", *indent(self.block(inner, 1, 3))]


def indent(lines: list[str]) -> list[str]:
    return ["    " + line for line in lines]


HELPER = '''
import copy
import functools


def helper(m, v):
    """Code outside any class, reading, assigning and augmenting a model's state."""
    m.f0 = xp.tanh(m.f0 + v)
    m.f0 *= 0.5
    return m.f0 * 1.0


def logged(fn):
    """A functools.wraps decorator: the analysis must see through it."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


def make_inc(c):
    """A factory-made method: only its code object says where its source is."""
    def inc(self, v):
        self.f0 = xp.tanh(self.f0 + c * v)
        return self.f0 * 1.0
    return inc
'''


@dataclasses.dataclass
class Program:
    source: str
    has_alias: bool
    expected_states: list[str]
    seed: int


def _init_lines(info: ClassInfo, me: str, declared: set[str], values: dict[str, str]) -> list[str]:
    lines = []
    for attr, value in values.items():
        if attr in declared:
            value = f"declare({value})"
        lines.append(f"{me}.{attr} = {value}")
    return lines


@st.composite
def programs(draw) -> Program:
    sub = ClassInfo("Sub", draw(st.sampled_from(["self", "self", "this"])))
    model = ClassInfo("Model", "self")
    has_alias = draw(st.booleans())

    sub_body = BodyWriter(draw, sub, None, False)
    sub_lines = sub_body.block(Scope([], []), 1, 4)
    sub_lines.append(f"return {sub_body.fresh(Scope([], []))}")

    model_body = BodyWriter(draw, model, sub, has_alias)
    model_scope = Scope([], [])
    model_lines = model_body.block(model_scope, 1, 6)
    model_lines.append(f"return {model_body.fresh(model_scope)}, self.n0 * 1")

    # A module-level function assigned in Model's body (``extra = external_extra``).
    extra_body = BodyWriter(draw, model, sub, has_alias, top=False)
    extra_scope = Scope([], [])
    extra_lines = [f"self.f1 = {extra_body.fresh(extra_scope)}", *extra_body.block(extra_scope, 0, 2)]
    extra_lines.append(f"return {extra_body.fresh(extra_scope)}")
    wrapped = draw(st.booleans())

    # State written only from outside the class must be declared; some
    # other attributes are declared too, which must change nothing.
    def declared(info: ClassInfo) -> set[str]:
        chosen = {a for a in (*FLOATS, *INTS) if draw(st.integers(0, 4)) == 0}
        return chosen | (info.outside_writes - info.own_writes)

    sub_declared, model_declared = declared(sub), declared(model)
    s = sub.receiver
    sub_init = _init_lines(
        sub,
        s,
        sub_declared,
        {
            "f0": "xp.full((3,), seed, dtype=xp.float32)",
            "f1": "xp.asarray([seed, 0.5, -seed], dtype=xp.float32)",
            "n0": "xp.asarray(int(4 * seed), dtype=xp.int32)",
        },
    )
    sub_k, sub_flag = draw(st.integers(1, 3)), draw(st.booleans())
    model_init = _init_lines(
        model,
        "self",
        model_declared,
        {
            "f0": "xp.asarray([0.1, -0.2, 0.3], dtype=xp.float32)",
            "f1": "xp.full((3,), 0.75, dtype=xp.float32)",
            "n0": "xp.asarray(1, dtype=xp.int32)",
        },
    )
    model_k, model_flag = draw(st.integers(1, 3)), draw(st.booleans())
    alias = ["self.alias = self.sub"] if has_alias else []
    source = "\n".join(
        [
            '"""Generated by tests/property/test_programs.py."""',
            HELPER,
            "",
            "def external_extra(self, x):",
            *indent(extra_lines),
            "",
            "class Sub:",
            f"    def __init__({s}, seed):",
            *indent(indent(sub_init)),
            f"        {s}.k = {sub_k}",
            f"        {s}.flag = {sub_flag}",
            "",
            f"    def __call__({s}, x):",
            *indent(indent(sub_lines)),
            "",
            "",
            "class Model:",
            "    def __init__(self):",
            *indent(indent(model_init)),
            f"        self.k = {model_k}",
            f"        self.flag = {model_flag}",
            "        self.sub = Sub(0.25)",
            "        self.subs = [Sub(0.5), Sub(-0.75)]",
            "        self.mixed = [Sub(0.125), 2]",
            "        self.buf = [xp.zeros(3, dtype=xp.float32), xp.ones(3, dtype=xp.float32)]",
            "        self.dd = {'a': xp.full((3,), 0.5, dtype=xp.float32), "
            "'b': xp.zeros(3, dtype=xp.float32)}",
            *indent(indent(alias)),
            "",
            "    extra = external_extra",
            "    inc = make_inc(0.5)",
            "",
            *(["    @logged"] if wrapped else []),
            "    def __call__(self, x):",
            *indent(indent(model_lines)),
            "",
        ]
    )
    # Int arrays that are not states are constants: never trained, so in the states too.
    # ``extra`` assigns f1 and ``inc`` assigns f0 whether or not they are called:
    # the analysis reads every function that can run as a method.
    model.own_writes.update(("f0", "f1"))
    sub_state = sorted(sub.own_writes | sub_declared | set(INTS))
    model_state = sorted(model.own_writes | model_declared | set(INTS))
    expected = model_state + [f"{p}.{a}" for p in SUB_PATHS for a in sub_state]
    return Program(source, has_alias, sorted(expected), draw(st.integers(0, 2**16)))


# --- running it three ways ------------------------------------------------------

_directory: Path | None = None
_names = itertools.count()


def _load(path: Path, name: str, xp: Any, declare: Any) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    module.xp = xp
    module.declare = declare
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _state_paths(has_alias: bool) -> list[str]:
    paths = [*FLOATS, *INTS]
    for prefix in (*SUB_PATHS, *(("alias",) if has_alias else ())):
        paths += [f"{prefix}.{a}" for a in (*FLOATS, *INTS)]
    return paths


def _snapshot(model: Any, paths: list[str]) -> dict[str, Any]:
    paths = [*paths, *CONTAINERS]
    return {p: jax.tree_util.tree_map(np.array, read_path(model, p)) for p in paths}


def _assert_close(actual: Any, expected: Any, what: str, source: str) -> None:
    assert_generated_close(actual, expected, what, source, rtol=RTOL, atol=ATOL)


def _run(program: Program) -> None:
    global _directory
    if _directory is None:
        _directory = Path(tempfile.mkdtemp(prefix="autostate-property-"))
        atexit.register(shutil.rmtree, _directory, True)
    name = f"autostate_prop_{os.getpid()}_{next(_names)}"
    path = _directory / f"{name}.py"
    path.write_text(program.source)
    rng = np.random.default_rng(program.seed)
    xs = [rng.standard_normal(3).astype(np.float32) for _ in range(STEPS)]
    paths = _state_paths(program.has_alias)
    try:
        plain = _load(path, f"{name}_plain", np, lambda value: value)
        decorated = _load(path, f"{name}_decorated", jnp, autostate.state)
        autostate.stateful(decorated.Sub)
        autostate.stateful(decorated.Model)

        reference = plain.Model()
        plain_outs = [jax.tree_util.tree_map(np.array, reference(x.copy())) for x in xs]

        eager = decorated.Model()
        eager_outs = [eager(jnp.asarray(x)) for x in xs]

        f, states = decorated.Model().functionalize()
        assert sorted(states) == program.expected_states, program.source
        jit_outs = []
        for x in xs:
            out, states = jit_step(f, states, jnp.asarray(x))
            jit_outs.append(out)
        frozen = autostate.freeze(f, states)
        compiled = decorated.Model()
        step = autostate.jit(lambda model, x: model(x))
        compiled_outs = [step(compiled, jnp.asarray(x)) for x in xs]

        _assert_close(eager_outs, plain_outs, "eager and plain outputs", program.source)
        _assert_close(compiled_outs, eager_outs, "autostate.jit and eager outputs", program.source)
        _assert_close(jit_outs, eager_outs, "jit and eager outputs", program.source)
        final_plain = _snapshot(reference, paths)
        final_eager = _snapshot(eager, paths)
        _assert_close(final_eager, final_plain, "eager and plain states", program.source)
        _assert_close(
            _snapshot(compiled, paths), final_eager, "autostate.jit and eager states", program.source
        )
        assert (compiled.alias is compiled.sub) if program.has_alias else True
        _assert_close(_snapshot(frozen, paths), final_eager, "frozen and eager states", program.source)
        for state_name, value in states.items():
            assert_trees_close(value, final_eager[state_name])
        assert not any(
            isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves((f, states))
        )
        assert type(frozen) is decorated.Model
        assert (frozen.alias is frozen.sub) if program.has_alias else True
    finally:
        for module_name in (f"{name}_plain", f"{name}_decorated"):
            sys.modules.pop(module_name, None)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(programs())
def test_plain_eager_and_jitted_runs_agree(program: Program) -> None:
    _run(program)
