"""Attribute spellings: ``setattr``/``getattr``/``delattr``/``hasattr``,
``__dict__``, ``vars()``, ``object.__setattr__``, lazily created and deleted
state.

Each case runs a class as plain Python and decorated (the harness in
``tests/semantics/harness.py``, or a direct comparison) and asserts the
decorated program means what the plain one does: eagerly, through
``f(states, ...)``, under ``jax.jit`` and after ``autostate.freeze``, or that it
is refused with a clear error. A known difference stays as ``xfail(strict=True)``
with what differs.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import libcst as cst
import numpy as np
import pytest

import autostate
from autostate import errors
from autostate.errors import (
    DecorationError,
    StateAccessError,
)
from autostate.transform import analysis, method, rewrite
from semantics.harness import (
    Loader,
    X,
    _fcall,
    assert_same,
    assert_user_line,
    build_pair,
    check,
    check_transform,
    class_pair,
    data_for,
    error_line,
    library,
    load_plain,
    modes_of,
    names_of,
    pair,
    raises_autostate,
    read_plain,
    run_case,
    same,
    snapshot,
    staged,
    user_line,
)
from semantics.programs_attribute_access import BEHIND, DUNDERS, DYNAMIC, PROTO
from semantics.programs_attribute_access import CONTEXT_CONSTRUCTS as CONSTRUCTS
from semantics.programs_attribute_access import HOOKS as HOOKS_fidelity
from semantics.programs_class_shapes import EQX
from semantics.programs_control_flow import LATE_METHODS
from semantics.programs_shared import A1, A2, TWO, V2_RANGE, V3, X23
from semantics.programs_shared import POSITIVE_CALLS as TWO_CALLS
from semantics.programs_shared import V2 as V2_POSITIVE
from semantics.programs_shared import XS_SIGNED as XS
from semantics.programs_static_state import TORCH_IDIOMS
from semantics.programs_submodels import TORCH
from semantics.programs_transformations import LAZY

X1 = jnp.float32(1.5)


X2 = jnp.float32(2.0)


V2 = jnp.array([1.0, -2.0])




WRITES = {
    "attribute": "self.{name} = {value}",
    "setattr": 'setattr(self, "{name}", {value})',
    "object": 'object.__setattr__(self, "{name}", {value})',
    "super": 'super().__setattr__("{name}", {value})',
}


READS = {
    "attribute": "self.{name}",
    "getattr": 'getattr(self, "{name}")',
    "getattr-default": 'getattr(self, "{name}", None)',
    "object": 'object.__getattribute__(self, "{name}")',
}


def spelled(init: str, write: str, read: str) -> str:
    """A model whose states ``ema`` and ``count`` are initialized with
    ``init``, written with ``write`` and read with ``read``."""

    def w(spelling: str, name: str, value: str) -> str:
        return WRITES[spelling].format(name=name, value=value)

    def r(name: str) -> str:
        return READS[read].format(name=name)

    return f"""
@DECORATE
class Ema:
    def __init__(self):
        self.weight = jnp.ones(2)
        {w(init, "ema", "jnp.zeros(2)")}
        {w(init, "count", "jnp.zeros((), jnp.int32)")}

    def __call__(self, x):
        {w(write, "ema", f"0.5 * {r('ema')} + 0.5 * x")}
        {w(write, "count", f"{r('count')} + 1")}
        return x * self.weight + {r("ema")} * {r("count")}

    def reset(self):
        {w(write, "ema", "jnp.zeros(2)")}
        return {r("count")}
"""


CALLS = [("__call__", (V2,)), ("__call__", (V2 * 2,)), ("reset", ()), ("__call__", (V2,))]


# Each write spelling after a plain ``self.x = ...`` in __init__, and after the same
# spelling there (each statement is read and rewritten on its own: not every pair).
@pytest.mark.parametrize(
    ("init", "write"),
    [("attribute", "setattr"), ("attribute", "object"), ("attribute", "super"),
     ("setattr", "setattr"), ("object", "object"), ("super", "super")],
)
def test_state_written_by_a_spelling(write_module: Loader, init: str, write: str) -> None:
    """Written in a method by the spelling: a state, initialized whichever way."""
    read = {"setattr": "getattr", "object": "object", "super": "attribute"}[write]
    plain, dec = pair(write_module, spelled(init, write, read))
    check(plain, dec, "Ema()", CALLS)
    assert sorted(dec.Ema().functionalize()[1]) == ["count", "ema"]


@pytest.mark.parametrize("init", ["setattr", "object", "super"])
def test_state_initialized_by_a_spelling_and_assigned_later(write_module: Loader, init: str) -> None:
    plain, dec = pair(write_module, spelled(init, "attribute", "attribute"))
    check(plain, dec, "Ema()", CALLS)


@pytest.mark.parametrize("read", ["getattr", "getattr-default", "object"])
def test_state_read_by_a_spelling(write_module: Loader, read: str) -> None:
    plain, dec = pair(write_module, spelled("attribute", "attribute", read))
    check(plain, dec, "Ema()", CALLS)


def generated(text: str, state: frozenset[str], *, is_init: bool = False) -> str:
    module = cst.parse_module(text)
    function = module.body[0]
    assert isinstance(function, cst.FunctionDef)
    return rewrite.rewrite_method(module, function, "self", state, "M", is_init=is_init)


def test_each_spelling_becomes_the_effect_call_of_its_statement() -> None:
    text = (
        "def step(self, v):\n"
        '    setattr(self, "x", v)\n'
        '    object.__setattr__(self, "x", getattr(self, "x") + v)\n'
        '    y = object.__getattribute__(self, "x")\n'
        '    super().__setattr__("x", v)\n'
        '    z = getattr(self, "x", None)\n'
        '    setattr(self, "w", v)\n'
    )
    assert generated(text, frozenset({"x"})).splitlines() == [
        "def step(self, v):",
        # The function as written goes along: the access happens while it is the builtin.
        '    __autostate__.spelled.set(setattr, self, "x", v)',
        '    __autostate__.spelled.store_state(object.__setattr__, self, "x", '
        '__autostate__.spelled.get(getattr, self, "x") + v)',
        '    y = __autostate__.spelled.read_state(object.__getattribute__, self, "x")',
        # Through the MRO's next __setattr__, then the state's descriptor.
        '    super().__setattr__("x", v)',
        '    z = getattr(self, "x", None)',
        '    setattr(self, "w", v)',  # not a state
    ]
    init = generated('def __init__(self, v):\n    setattr(self, "x", v)\n', frozenset({"x"}), is_init=True)
    assert '__autostate__.spelled.init(setattr, self, "x", v)' in init


def test_comments_and_lines_inside_the_call_are_kept() -> None:
    text = 'def step(self, v):\n    setattr(self, "x",  # why\n            v)\n'
    assert generated(text, frozenset({"x"})) == (
        'def step(self, v):\n    __autostate__.spelled.set(setattr, self, "x",  # why\n            v)\n'
    )


def facts_of(text: str, shadowed: frozenset[str] = frozenset()) -> analysis.MethodFacts:
    source = analysis.MethodSource(
        key="step", attr="step", filename="model.py", first_line=10,
        text="    " + text.replace("\n", "\n    ").rstrip() + "\n", freevars=(), has_receiver=True,
    )
    return analysis.collect_facts("M", source, shadowed)


@pytest.mark.parametrize(
    ("line", "kind"),
    [
        ('setattr(self, "x", v)', "set"),
        ('object.__setattr__(self, "x", v)', "set"),
        ('super().__setattr__("x", v)', "set"),
        ('getattr(self, "x")', "get"),
        ('getattr(self, "x", None)', "get"),
        ('object.__getattribute__(self, "x")', "get"),
        ('super().__getattribute__("x")', "get"),
        ('delattr(self, "x")', "del"),
        ('object.__delattr__(self, "x")', "del"),
        ('super().__delattr__("x")', "del"),
        # Not the receiver, a computed or unspellable name, keywords, other arities.
        ('setattr(other, "x", v)', None),
        ("setattr(self, name, v)", None),
        ('setattr(self, "not-a-name", v)', None),
        ('setattr(self, "class", v)', None),
        ('setattr(self, "__dict__", v)', None),
        ('setattr(self, *["x", v])', None),
        ('object.__setattr__(self, "x")', None),
        ('super(M, self).__setattr__("x", v)', None),
        ('(lambda: super().__setattr__("x", v))()', None),
        ('[super().__setattr__("x", w) for w in v]', None),
    ],
)
def test_what_the_analysis_reads_as_an_attribute_statement(line: str, kind: str | None) -> None:
    facts = facts_of(f"def step(self, v, other=None, name='x'):\n    {line}\n")
    found = (
        ["set" for a in facts.assignments if a.attr == "x"]
        + ["get" for attr in facts.reads if attr == "x"]
        + ["del" for access, _ in facts.named_deletes if access.name == "x"]
    )
    expected = [] if kind is None else [kind]
    if "super" in line and "[" in line:
        # A comprehension has its own frame (zero-argument super() fails there) before 3.12.
        import sys

        expected = ["set"] if sys.version_info >= (3, 12) else []
    assert found == expected


@pytest.mark.parametrize(
    "text",
    [
        'def step(self, v, setattr=print):\n    setattr(self, "x", v)\n',
        'def step(self, v):\n    object = type(self)\n    object.__setattr__(self, "x", v)\n',
        'def step(self, v):\n    global setattr\n    setattr(self, "x", v)\n',
    ],
    ids=["parameter", "local", "global"],
)
def test_a_rebound_builtin_is_no_attribute_statement(text: str) -> None:
    assert facts_of(text).assignments == []
    assert "__autostate__" not in generated(text, frozenset({"x"}))


def test_a_builtin_the_module_rebinds_is_no_attribute_statement() -> None:
    text = 'def step(self, v):\n    setattr(self, "x", v)\n'
    assert facts_of(text, frozenset({"setattr"})).assignments == []
    assert analysis.ACCESS_BUILTINS is method.ACCESS_BUILTINS  # one list, libcst-free


def test_literal_names_are_not_mangled() -> None:
    facts = facts_of('def step(self, v):\n    setattr(self, "__h", v)\n    self.__h = v\n')
    assert [a.attr for a in facts.assignments] == ["__h", "_M__h"]


FROZEN = """
@DECORATE
@dataclasses.dataclass(frozen=True)
class Frozen:
    weight: jax.Array
    count: jax.Array = dataclasses.field(default_factory=lambda: jnp.zeros((), jnp.int32))
    ema: jax.Array = dataclasses.field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "ema", jnp.zeros_like(self.weight))

    def __call__(self, x):
        object.__setattr__(self, "count", self.count + 1)
        object.__setattr__(self, "ema", 0.5 * self.ema + 0.5 * x)
        return x * self.weight * self.count + self.ema

    def via_super(self, x):
        super().__setattr__("count", self.count * 2)
        return self.count

    def plain_assign(self):
        self.count = self.count + 1  # FROZEN-ASSIGN

    def by_setattr(self):
        setattr(self, "count", self.count + 1)  # FROZEN-SETATTR


@DECORATE
@dataclasses.dataclass(frozen=True)
class Holder:
    inner: Frozen
    steps: jax.Array = dataclasses.field(default_factory=lambda: jnp.zeros((), jnp.int32))

    def __call__(self, x):
        object.__setattr__(self, "steps", self.steps + 1)
        return self.inner(x) + self.steps
"""


def test_frozen_dataclass_mutating_through_object_setattr(write_module: Loader) -> None:
    plain, dec = pair(write_module, FROZEN)
    calls = [("__call__", (V2,)), ("via_super", (X1,)), ("__call__", (V2 * 3,))]
    check(plain, dec, "Frozen(jnp.ones(2))", calls)
    check(plain, dec, "Holder(Frozen(jnp.ones(2)))", [("__call__", (V2,))] * 3)
    assert sorted(dec.Holder(dec.Frozen(jnp.ones(2))).functionalize()[1]) == [
        "inner.count", "inner.ema", "steps"]


@pytest.mark.parametrize("method", ["plain_assign", "by_setattr"])
def test_frozen_dataclass_refuses_self_x_and_setattr_like_plain(
    write_module: Loader, method: str
) -> None:
    import dataclasses

    plain, dec = pair(write_module, FROZEN)
    with pytest.raises(dataclasses.FrozenInstanceError):
        getattr(plain.Frozen(jnp.ones(2)), method)()
    model = dec.Frozen(jnp.ones(2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        getattr(model, method)()
    f, states = model.functionalize()
    for call in (getattr(f, method), staged(getattr(f, method))):
        with pytest.raises(dataclasses.FrozenInstanceError):
            call(states)
    assert_same(snapshot(plain.Frozen(jnp.ones(2))), snapshot(model))


HOOKS = """
@DECORATE
class Clamped:
    def __init__(self):
        self.x = jnp.zeros(())
        object.__setattr__(self, "raw", jnp.zeros(()))

    def __setattr__(self, name, value):
        if name in ("x", "raw"):
            value = jnp.clip(value, -1.0, 1.0)
        super().__setattr__(name, value)

    def by_setattr(self, v):
        setattr(self, "x", self.x + v)  # clamps
        setattr(self, "raw", self.raw + v)
        return self.x, self.raw

    def by_object(self, v):
        object.__setattr__(self, "x", self.x + v)  # does not clamp
        object.__setattr__(self, "raw", self.raw + v)
        return self.x, self.raw

    def by_super(self, v):
        super().__setattr__("x", self.x + v)  # object's: does not clamp
        return self.x


class ClampBase:
    def __setattr__(self, name, value):
        if name == "x":
            value = jnp.clip(value, -1.0, 1.0)
        object.__setattr__(self, name, value)


@DECORATE
class ClampedChild(ClampBase):
    def __init__(self):
        super().__setattr__("x", jnp.zeros(()))  # the base's: clamps

    def by_super(self, v):
        super().__setattr__("x", self.x + v)
        return self.x


@DECORATE
class Doubled:
    def __init__(self):
        self.x = jnp.ones(())

    def __getattribute__(self, name):
        value = object.__getattribute__(self, name)
        return value * 2 if name == "x" else value

    def __call__(self, v):
        setattr(self, "x", getattr(self, "x") + v)
        return getattr(self, "x"), object.__getattribute__(self, "x"), self.x
"""


@pytest.mark.parametrize(
    ("build", "method"),
    [
        ("Clamped()", "by_setattr"),
        ("Clamped()", "by_object"),
        ("Clamped()", "by_super"),
        ("ClampedChild()", "by_super"),
    ],
)
def test_user_setattr_is_followed_or_bypassed_as_in_plain_python(
    write_module: Loader, build: str, method: str
) -> None:
    plain, dec = pair(write_module, HOOKS)
    check(plain, dec, build, [(method, (X1,)), (method, (X2,)), (method, (-X2 * 3,))])


def test_user_getattribute_is_followed_or_bypassed_as_in_plain_python(
    write_module: Loader,
) -> None:
    """``Doubled.x`` reads twice the state, so only outputs are compared through f
    (the harness compares ``states`` with what ``ref.x`` reads)."""
    plain, dec = pair(write_module, HOOKS)
    calls = [("__call__", (X1,)), ("__call__", (X2,))]
    check(plain, dec, "Doubled()", calls, modes=("eager",))
    ref = plain.Doubled()
    expected = [ref(X1), ref(X2)]
    f, states = dec.Doubled().functionalize()
    for call in (f, staged(f)):
        s, got = states, []
        for _, (x,) in calls:
            out, s = call(s, x)
            got.append(out)
        assert_same(expected, got)
        assert_same(object.__getattribute__(ref, "x"), s["x"])


NESTED = """
@DECORATE
class Nested:
    def __init__(self):
        self.c = jnp.zeros(())
        self.a = jnp.zeros(())

    def closures(self, x):
        bump = lambda v: setattr(self, "c", self.c + v)
        def twice(v):
            object.__setattr__(self, "a", getattr(self, "a") + v)
            bump(v)
            object.__setattr__(self, "a", object.__getattribute__(self, "a") * 2)
        twice(x)
        bump(x)
        [setattr(self, "c", self.c + k) for k in (1.0, 2.0)]
        return self.c, self.a

    def in_lax(self, x):
        y = lax.fori_loop(0, 3, lambda i, v: (setattr(self, "c", self.c + v), v * 2)[1], x)
        def body(carry, v):
            object.__setattr__(self, "a", self.a + v)
            return carry + getattr(self, "a"), None
        out, _ = lax.scan(body, jnp.zeros(()), jnp.stack([x, x + 1.0]))
        return y, out
"""


@pytest.mark.parametrize("method", ["closures", "in_lax"])
def test_spellings_in_nested_functions_lambdas_and_lax_bodies(
    write_module: Loader, method: str
) -> None:
    plain, dec = pair(write_module, NESTED)
    check(plain, dec, "Nested()", [(method, (X1,)), (method, (X2,))])


DELETE = """
@DECORATE
class Deleting:
    def __init__(self):
        self.cache = jnp.zeros(())
        self.tmp = 1

    def __call__(self, x):
        self.cache = self.cache + x
        return self.cache

    def reset(self):
        {stmt}  # HERE
"""


@pytest.mark.parametrize(
    "stmt", ['delattr(self, "cache")', 'object.__delattr__(self, "cache")',
             'super().__delattr__("cache")'],
)
def test_deleting_a_state_by_a_spelling_is_the_documented_decoration_error(
    write_module: Loader, stmt: str
) -> None:
    with pytest.raises(DecorationError, match="deletes state 'cache'") as err:
        pair(write_module, DELETE.replace("{stmt}", stmt))
    assert stmt in error_line(err.value) and "# HERE" in error_line(err.value)
    assert stmt.partition("(")[0] in str(err.value)
    assert "fix:" in str(err.value)


@pytest.mark.parametrize(
    "stmt", ['delattr(self, "tmp")', 'object.__delattr__(self, "tmp")',
             'super().__delattr__("tmp")'],
)
def test_deleting_a_plain_attribute_by_a_spelling_is_plain_eagerly(
    write_module: Loader, stmt: str
) -> None:
    plain, dec = pair(write_module, DELETE.replace("{stmt}", stmt))
    check(plain, dec, "Deleting()", [("__call__", (X1,)), ("reset", ())], modes=("eager",))


MISC = """
class CountingMixin:
    def tick(self):
        object.__setattr__(self, "ticks", self.ticks + 1)
        return self.ticks


@DECORATE
class UsesMixin(CountingMixin):
    def __init__(self):
        object.__setattr__(self, "ticks", jnp.zeros((), jnp.int32))

    def __call__(self, x):
        return x * self.tick()


@DECORATE
class Declared:
    def __init__(self):
        object.__setattr__(self, "cache", STATE(jnp.zeros(()), category="cache"))
        setattr(self, "total", STATE(jnp.zeros(()), name="running_total"))

    def __call__(self, x):
        return x + self.cache + self.total


@DECORATE
class Private:
    def __init__(self):
        object.__setattr__(self, "__h", jnp.zeros(()))
        self.__h = jnp.ones(())

    def __call__(self, x):
        object.__setattr__(self, "__h", getattr(self, "__h") + x)
        self.__h = self.__h * 2
        return getattr(self, "__h"), self.__h
"""


REBOUND = """
_written = []


def mysetattr(obj, name, value):
    _written.append(name)


def mygetattr(obj, name):
    _written.append(name)
    return -1.0


class MyObject:
    @staticmethod
    def __setattr__(obj, name, value):
        _written.append(name)

    @staticmethod
    def __getattribute__(obj, name):
        _written.append(name)
        return -2.0


@DECORATE
class Rebound:
    def __init__(self):
        self.c = jnp.zeros(())
        setattr(self, "c", jnp.ones(()))  # the module's setattr below: no write

    def __call__(self, x):
        self.c = self.c + x
        setattr(self, "c", self.c * 100)  # no write
        return self.c


@DECORATE
class ReboundReads:
    def __init__(self):
        self.c = jnp.zeros(())

    def __call__(self, x):
        self.c = self.c + x
        object.__setattr__(self, "c", self.c * 100)  # the module's object below: no write
        return self.c, getattr(self, "c"), object.__getattribute__(self, "c")


# Rebound after the class statements: each call above resolves its name when it runs.
setattr = mysetattr
getattr = mygetattr
object = MyObject
"""


@pytest.mark.parametrize("build", ["UsesMixin()", "Rebound()", "ReboundReads()", "Private()"])
def test_mixins_rebound_builtins_and_private_names(write_module: Loader, build: str) -> None:
    plain, dec = pair(write_module, REBOUND if build.startswith("Rebound") else MISC)
    check(plain, dec, build, [("__call__", (X1,)), ("__call__", (X2,))])
    if build.startswith("Rebound"):
        # The module's functions were called with the arguments as written, not the state's.
        assert plain._written and set(dec._written) == set(plain._written) == {"c"}


def test_state_declared_through_a_spelling_in_init(write_module: Loader) -> None:
    plain, dec = pair(write_module, MISC)
    # An explicit name is no attribute path of the plain model: eager, then f by name.
    check(plain, dec, "Declared()", [("__call__", (X1,))], modes=("eager",))
    f, states = dec.Declared().functionalize()
    assert sorted(states) == ["cache", "running_total"]
    out, _ = staged(lambda f, s, x: f(s, x))(f, states, X1)
    assert_same(plain.Declared()(X1), out)
    assert sorted(dec.Declared().functionalize("cache")[1]) == ["cache"]


def test_private_literal_and_mangled_names_are_two_states(write_module: Loader) -> None:
    _, dec = pair(write_module, MISC)
    assert sorted(dec.Private().functionalize()[1]) == ["_Private__h", "__h"]


COMPUTED = """
@DECORATE
class Computed:
    def __init__(self):
        self.c = jnp.zeros(())
        self.extra = jnp.zeros(())

    def __call__(self, x, name="extra"):
        self.c = self.c + x
        setattr(self, name, self.c * 2)  # COMPUTED
        return self.c
"""


def test_a_computed_name_keeps_the_documented_error(write_module: Loader) -> None:
    plain, dec = pair(write_module, COMPUTED)
    check(plain, dec, "Computed()", [("__call__", (X1,))] * 2, modes=("eager",))
    f, states = dec.Computed().functionalize()
    assert sorted(states) == ["c"]
    for call in (f, staged(f)):
        with pytest.raises(StateAccessError, match="Computed.extra is not state") as err:
            call(states, X1)
        assert "# COMPUTED" in error_line(err.value)


def test_the_decorated_class_keeps_every_spelling_working_from_outside(write_module: Loader) -> None:
    """Code outside the class spells the same writes on a model (the descriptors)."""
    plain, dec = pair(write_module, spelled("object", "object", "object"))
    results = []
    for mod in (plain, dec):
        m = mod.Ema()
        object.__setattr__(m, "ema", jnp.ones(2))
        setattr(m, "count", getattr(m, "count") + 3)  # noqa: B009, B010
        results.append((m(V2), getattr(m, "ema"), object.__getattribute__(m, "count")))  # noqa: B009
    assert_same(*results)


SOURCE = """
import builtins


def vars(obj):  # noqa: A001 - a module that shadows the builtin
    return {"shadowed": 1.0}


@DECORATE
class Buffers:
    def __init__(self):
        self.w = jnp.ones(3)            # a parameter
        self.mean = jnp.zeros(3)        # states
        self.count = jnp.zeros((), jnp.int32)
        self.training = True            # a static state
        self.name = "bn"

    def __call__(self, x):
        self.mean = 0.9 * self.mean + 0.1 * x
        self.count += 1
        return (x - self.mean) * self.w

    def train(self, on):
        self.training = on
        return 0.0

    def buffers(self):
        return {k: v for k, v in self.__dict__.items() if isinstance(v, jax.Array)}

    def arrays_sum(self, x):
        d = builtins.vars(self)
        return sum(jnp.sum(v) for v in d.values() if isinstance(v, jax.Array)) * x

    def protocol(self, x):
        d = self.__dict__
        return [
            len(d), "mean" in d, len(sorted(d)), d.get("count"), d["mean"] * x,
            dict(d)["count"], {**d}["mean"], d.copy()["count"], len(list(d.keys())[:2]),
            d == dict(d), d["training"], d["name"] == "bn", len(d.items()),
            jax.tree_util.tree_leaves(d)[0], jnp.sum(jnp.stack([v for v in d.values()
                                                                if isinstance(v, jax.Array)
                                                                and v.shape == (3,)])),
        ]

    def load(self, sd):
        self.__dict__.update(sd)
        return self.mean.sum()

    def set_item(self, x):
        self.__dict__["mean"] = self.__dict__["mean"] + x
        self.__dict__["count"] += 1
        return self.mean

    def set_default(self, x):
        got = self.__dict__.setdefault("mean", x)
        self.__dict__.setdefault("extra_default", 0)
        return got

    def ior(self, x):
        d = self.__dict__
        d |= {"mean": d["mean"] * x}
        return self.mean

    def shadowed(self):
        return vars(self)["shadowed"]

    def live(self, x):
        d = self.__dict__
        self.mean = self.mean + x
        return d["mean"]  # the dict is live: it sees the write


@DECORATE
class Outer:
    def __init__(self):
        self.inner = Buffers()
        self.scale = jnp.full((), 2.0)

    def __call__(self, x):
        out = self.inner(x)
        return out * self.scale

    def inner_buffers(self):
        return len([k for k, v in builtins.vars(self.inner).items() if isinstance(v, jax.Array)])

    def bump_inner(self, x):
        self.inner.__dict__["count"] = self.inner.count + 10
        return self.inner.count
"""


def _pair(write_module: Loader):
    return pair(write_module, SOURCE)


@pytest.mark.parametrize(
    "calls",
    [
        [("__call__", (X1,)), ("buffers", ()), ("__call__", (X1,)), ("buffers", ())],
        [("__call__", (X1,)), ("arrays_sum", (X1,))],
        [("__call__", (X1,)), ("protocol", (X1,))],
        [("set_item", (X1,)), ("set_item", (X1,)), ("__call__", (X1,))],
        [("set_default", (X1,)), ("__call__", (X1,))],
        [("__call__", (X1,)), ("ior", (X1,)), ("__call__", (X1,))],
        [("shadowed", ())],
        [("__call__", (X1,)), ("live", (X1,))],
    ],
    ids=["buffers", "vars", "protocol", "set_item", "setdefault", "ior", "shadowed", "live"],
)
def test_the_instance_dict_like_plain_python(write_module: Loader, calls: list) -> None:
    plain, dec = _pair(write_module)
    modes = ("eager",) if calls[0][0] == "set_default" else ("eager", "f", "jit", "freeze")
    check(plain, dec, "Buffers()", calls, modes=modes)


def test_setdefault_of_a_new_name_inside_f_is_refused(write_module: Loader) -> None:
    """A name that is not state, written into the dict inside ``f``, would be
    lost when the call returns: refused, as ``self.extra = ...`` is."""
    _, dec = _pair(write_module)
    f, states = dec.Buffers().functionalize()
    with pytest.raises(StateAccessError, match="extra_default"):
        f.set_default(states, X1)


def test_load_a_state_dict_through_the_instance_dict(write_module: Loader) -> None:
    plain, dec = _pair(write_module)
    sd = {"mean": jnp.full(3, 2.0), "count": jnp.asarray(7, jnp.int32)}
    check(plain, dec, "Buffers()", [("load", (sd,)), ("__call__", (X1,)), ("buffers", ())])


def test_a_static_state_read_through_the_instance_dict_follows_the_mode(
    write_module: Loader,
) -> None:
    plain, dec = _pair(write_module)
    check(plain, dec, "Buffers()", [("train", (False,)), ("protocol", (X1,))], modes=("eager",))
    model = dec.Buffers()
    model.train(False)
    f, states = model.functionalize()
    out, _ = staged(lambda s, x: f.protocol(s, x))(states, X1)
    assert not bool(out[10])


def test_sub_models_through_the_instance_dict(write_module: Loader) -> None:
    plain, dec = _pair(write_module)
    check(plain, dec, "Outer()", [("__call__", (X1,)), ("inner_buffers", ()),
                                  ("bump_inner", (X1,)), ("__call__", (X1,))])


def test_grad_through_values_read_from_the_instance_dict(write_module: Loader) -> None:
    plain, dec = _pair(write_module)
    ref = plain.Buffers()
    ref(X1)
    expected = jax.grad(lambda x: ref.arrays_sum(x))(X1)
    model = dec.Buffers()
    model(X1)
    f, states = model.functionalize()
    got = jax.grad(lambda x: f.arrays_sum(states, x)[0])(X1)
    assert_same(expected, got, "grad")


def test_sharing_the_instance_dict_itself(write_module: Loader) -> None:
    """``new.__dict__ = self.__dict__`` (the Borg pattern) shares the dict
    object itself, as in plain Python: a write through one is seen by the other."""
    source = """
@DECORATE
class Borg:
    def __init__(self):
        self.x = jnp.zeros(())

    def twin(self):
        new = object.__new__(type(self))
        new.__dict__ = self.__dict__
        return new

    def step(self, v):
        self.x = self.x + v
        return self.x
"""
    plain, dec = pair(write_module, source)
    for module in (plain, dec):
        model = module.Borg()
        twin = model.twin()
        model.step(jnp.float32(2.0))
        twin.step(jnp.float32(3.0))
        assert float(model.x) == float(twin.x) == 5.0, module


def test_vars_from_outside_the_class_holds_the_slots() -> None:
    """Documented: code outside a decorated class (not rewritten) sees each
    state's slot in ``vars(model)``, and ``model.x`` the value."""

    @autostate.stateful
    class Counter:
        def __init__(self):
            self.n = jnp.zeros(())

        def step(self):
            self.n += 1

    model = Counter()
    model.step()
    assert not isinstance(vars(model)["n"], jax.Array)
    assert float(model.n) == 1.0
    np.testing.assert_allclose(np.asarray(vars(model)["n"].read()), 1.0)


BASE_SOURCE = """
class Module:  # an undecorated user base, as a PyTorch user writes one
    def buffers(self):
        return {k: v for k, v in vars(self).items() if isinstance(v, jax.Array)}

    def num_arrays(self):
        return len(self.__dict__) and sum(
            1 for v in self.__dict__.values() if isinstance(v, jax.Array))

    def l2(self):
        return sum(jnp.sum(v ** 2) for v in self.buffers().values())


class Middle(Module):
    pass


@DECORATE
class Net(Middle):
    def __init__(self):
        self.w = jnp.full(2, 2.0)
        self.mean = jnp.zeros(2)

    def __call__(self, x):
        self.mean = self.mean + x
        return self.w * x + self.l2()


class PlainChild(Module):
    def __init__(self):
        self.v = jnp.ones(3)
"""


def test_an_undecorated_base_method_reads_the_states_values(write_module: Loader) -> None:
    """A helper of an undecorated base that walks ``vars(self)`` sees the
    states' values on a decorated subclass (its copy is rewritten with the
    subclass), eagerly, in f, under jit and after freeze."""
    plain, dec = pair(write_module, BASE_SOURCE)
    calls = [("__call__", (X1,)), ("buffers", ()), ("num_arrays", ()), ("l2", ()),
             ("__call__", (X1,)), ("buffers", ())]
    check(plain, dec, "Net()", calls)


def test_the_undecorated_base_itself_is_left_as_written(write_module: Loader) -> None:
    plain, dec = pair(write_module, BASE_SOURCE)
    base_fn = vars(dec.Module)["buffers"]
    dec.Net()  # decorates Net (the first use)
    assert vars(dec.Module)["buffers"] is base_fn
    assert "buffers" not in vars(dec.Middle)
    child = dec.PlainChild()
    assert_same(plain.PlainChild().buffers(), child.buffers())
    assert child.num_arrays() == 1


jit_call = staged(lambda f, s, *a: f(s, *a))




def test_a_user_setattr_is_honoured_eagerly_and_under_jit(write_module):
    plain_cls, cls, _ = class_pair(write_module, HOOKS_fidelity, "Clamped")
    assert float(plain_cls()(1.0)) == 10.0
    assert float(cls()(1.0)) == 10.0
    f, states = cls().functionalize()
    out, states = jit_call(f, states, 1.0)
    assert float(out) == 10.0 and float(states["count"]) == 10.0


def test_a_user_getattribute_sees_state_reads(write_module):
    plain_cls, cls, _ = class_pair(write_module, HOOKS_fidelity, "Counted")
    plain_cls()(1.0)
    model = cls()
    model(1.0)
    assert cls.reads == plain_cls.reads == 2  # the read in __call__, and the return


DYNAMIC_ONLY = """
@DECORATE
class Dyn:
    def __init__(self):
        self.a = jnp.zeros(())
        self.count = jnp.zeros(())

    def bump(self, name, v):
        setattr(self, name, getattr(self, name) + v)
        self.count += 1
        return getattr(self, name)
"""


def test_setattr_dynamic_name_on_a_non_state_is_plain_eagerly_refused_in_f(
    write_module: Loader,
) -> None:
    plain, dec = pair(write_module, DYNAMIC_ONLY)
    check(plain, dec, "Dyn()", [("bump", ("a", 2.0)), ("bump", ("count", 1.0))], modes=("eager",))
    f, states = dec.Dyn().functionalize()
    out, states = f.bump(states, "count", 1.0)  # count is state: fine
    assert float(states["count"]) == 2.0
    with raises_autostate(autostate.errors.StateAccessError):
        f.bump(states, "a", 1.0)


DICT_WRITE = """
@DECORATE
class DictWrite:
    def __init__(self):
        self.x = jnp.zeros(())

    def step(self, v):
        self.x = self.x + v
        return self.x

    def raw(self, v):
        RAW
        return self.x
"""


@pytest.mark.parametrize(
    "raw",
    [
        'self.__dict__["x"] = v',
        'vars(self)["x"] = v',
        "self.__dict__.update(x=v)",
        'object.__setattr__(self, "x", v)',
    ],
    ids=["dunder_dict_item", "vars_item", "dunder_dict_update", "object_setattr"],
)
def test_writing_a_state_behind_the_descriptor(write_module: Loader, raw: str) -> None:
    plain, dec = pair(write_module, DICT_WRITE.replace("RAW", raw))
    ref = plain.DictWrite()
    expected = [ref.step(1.0), ref.raw(jnp.float32(5.0)), ref.step(1.0)]
    model = dec.DictWrite()
    try:
        got = [model.step(1.0), model.raw(jnp.float32(5.0)), model.step(1.0)]
    except autostate.AutostateError as err:
        assert_user_line(err, ".py")  # a clear refusal naming the line is acceptable
        return
    assert_same(expected, got, "eager outputs")
    assert_same(snapshot(ref), snapshot(model), "eager attributes")
    for mode in ("f", "jit"):
        f, states = dec.DictWrite().functionalize()
        states0 = states
        call: Callable[..., Any] = (
            (lambda f, s, m, *a: _fcall(f, m)(s, *a)) if mode == "f"
            else staged(lambda f, s, m, *a: _fcall(f, m)(s, *a), static_argnums=2)
        )
        try:
            outs = []
            for m, a in [("step", (1.0,)), ("raw", (jnp.float32(5.0),)), ("step", (1.0,))]:
                out, states = call(f, states, m, *a)
                outs.append(out)
        except autostate.AutostateError:
            # refused: f must be left as it was
            out, _ = f.step(states0, 1.0)
            assert float(out) == 1.0
            continue
        assert_same(expected, outs, f"{mode} outputs")
        assert_same(snapshot(ref.x), snapshot(states["x"]), f"{mode} state")


KWARGS_INIT = """
@DECORATE
class Config:
    def __init__(self, **kwargs):
        for k, v in kwargs.items():
            setattr(self, k, v)

    def step(self, v):
        self.mean = self.mean * 0.5 + v
        return self.mean
"""


def test_states_initialised_by_setattr_in_init(write_module: Loader) -> None:
    try:
        plain, dec = pair(write_module, KWARGS_INIT)
    except autostate.errors.DecorationError as err:
        # `mean` is first assigned outside __init__ as far as the source shows: documented.
        assert_user_line(err, ".py")
        return
    check(plain, dec, "Config(mean=jnp.zeros(()))", [("step", (1.0,)), ("step", (2.0,))])


DELEGATING_HOOKS = """
@DECORATE
class Inner:
    def __init__(self):
        self.hits = jnp.zeros(())
        self.w = jnp.full((2,), 3.0)

    def __call__(self, x):
        self.hits = self.hits + 1
        return x * self.w


@DECORATE
class Delegate:
    def __init__(self):
        self.inner = Inner()
        self.seen = jnp.zeros(())

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, x):
        self.seen = self.seen + x.sum()
        return self.inner(x) + self.w + self.hits


@DECORATE
class Redirect:
    def __init__(self):
        self._store = jnp.zeros(())
        self.writes = jnp.zeros((), jnp.int32)

    def __setattr__(self, name, value):
        if name == "value":
            name = "_store"
            value = value * 10
        object.__setattr__(self, name, value)

    def __getattr__(self, name):
        if name == "value":
            return self._store / 10
        raise AttributeError(name)

    def step(self, x):
        self._store = self._store + x
        self.writes += 1
        return self._store
"""


def test_getattr_delegation_to_a_sub_model(write_module: Loader) -> None:
    plain, dec = pair(write_module, DELEGATING_HOOKS)
    x = jnp.array([1.0, 2.0])
    check(plain, dec, "Delegate()", [("__call__", (x,)), ("__call__", (x,))])


def test_setattr_getattr_hooks(write_module: Loader) -> None:
    plain, dec = pair(write_module, DELEGATING_HOOKS)
    check(plain, dec, "Redirect()", [("step", (1.0,)), ("step", (2.0,))])
    p, d = plain.Redirect(), dec.Redirect()
    p.value = 2.0
    d.value = 2.0
    assert_same(snapshot(p), snapshot(d))
    assert float(p.value) == float(d.value)








def test_hasattr_getattr_setattr_from_outside(write_module: Loader) -> None:
    plain, dec = pair(write_module, PROTO)
    for mod in (plain, dec):
        m = mod.Acc()
        m(1.0)
        assert hasattr(m, "n") and hasattr(m, "w") and not hasattr(m, "missing")
        assert getattr(m, "missing", 7) == 7
        setattr(m, "n", jnp.full(2, 3.0))  # noqa: B010
        setattr(m, "w", jnp.full(2, 2.0))  # noqa: B010
    p, d = plain.Acc(), dec.Acc()
    for m in (p, d):
        setattr(m, "n", jnp.full(2, 3.0))  # noqa: B010
        setattr(m, "w", jnp.full(2, 2.0))  # noqa: B010
        m(1.0)
    assert_same(snapshot(p), snapshot(d))
    assert_same(getattr(p, "n", None), getattr(d, "n", None))


def test_dir_and_vars_keys_match_plain(write_module: Loader) -> None:
    plain, dec = pair(write_module, PROTO)
    p, d = plain.Acc(), dec.Acc()
    p(1.0)
    d(1.0)
    assert sorted(vars(p)) == sorted(vars(d))
    public = {n for n in dir(p) if not n.startswith("_")}
    assert public <= set(dir(d))


def test_param_added_from_outside_after_construction(write_module: Loader) -> None:
    plain, dec = pair(write_module, PROTO)
    p, d = plain.Host(), dec.Host()
    for m in (p, d):
        m.added = jnp.arange(3.0)
    expected = [p.use_param(1.0), p.use_param(2.0)]
    assert "added" in autostate.param_dict(d)
    f, states = d.functionalize()
    got = []
    for x in (1.0, 2.0):
        out, states = staged(lambda f, s, x: f.use_param(s, x))(f, states, x)
        got.append(out)
    assert_same(expected, got)
    g = jax.grad(lambda f: f.use_param(states, 1.0)[0])(f)
    assert_same(np.ones(3), g.model.added)


def test_delete_parameter_and_state_from_outside(write_module: Loader) -> None:
    plain, dec = pair(write_module, PROTO)
    p, d = plain.Acc(), dec.Acc()
    del p.tag
    del d.tag
    assert not hasattr(p, "tag") and not hasattr(d, "tag")
    del p.n
    with pytest.raises(errors.StateAccessError, match="Cannot delete state 'n'"):
        del d.n
    assert hasattr(d, "n")  # refused: the state is still there






def f_still_works(f: Any, states: dict[str, Any], name: str, *args: Any) -> None:
    """f answers the same eagerly and under jit after a refused call."""
    out1, s1 = _fcall(f, name)(states, *args)
    out2, s2 = staged(lambda f, s, *a: _fcall(f, name)(s, *a))(f, states, *args)
    assert_same(out1, out2, "after refusal")
    assert_same(s1, s2, "states after refusal")


@pytest.mark.parametrize("method", ["via_vars", "via_update"])
def test_state_writes_through_the_instance_dict_are_state_writes(
    write_module: Loader, method: str
) -> None:
    """``vars(self)["n"] = x`` and ``self.__dict__.update(n=x)`` in a method
    mean ``self.n = x`` for a state, as in plain Python: eagerly, in f and
    under jit (they were refused inside f)."""
    plain, dec = pair(write_module, BEHIND)
    check(plain, dec, "Behind()", [(method, (5.0,)), ("__call__", (1.0,))])


@pytest.mark.parametrize(
    "method",
    # (``object.__setattr__(self, "w", x)`` with a literal name is ``self.w = x``:
    # ``w`` is a state; tests/semantics/test_attribute_access.py.)
    ["via_sub_vars", "add_attr", "del_attr", "set_static"],
)
def test_writes_behind_descriptors_are_refused_and_f_survives(
    write_module: Loader, method: str
) -> None:
    plain, dec = pair(write_module, BEHIND)
    check(plain, dec, "Behind()", [(method, (5.0,)), ("__call__", (1.0,))], modes=("eager",))
    model = dec.Behind()
    before = snapshot(model)
    f, states = model.functionalize()
    with raises_autostate():
        getattr(f, method)(states, 5.0)
    f_still_works(f, states, "__call__", 1.0)
    with raises_autostate():
        staged(getattr(f, method))(states, 5.0)
    f_still_works(f, states, "__call__", 1.0)
    out, _ = f(states, 1.0)
    assert float(out) == float(plain.Behind()(1.0))
    assert_same(before, snapshot(model), "the eager model changed")


def test_object_setattr_on_state_means_an_assignment(write_module: Loader) -> None:
    """object.__setattr__ reaches the state's descriptor: plain meaning."""
    plain, dec = pair(write_module, BEHIND)
    check(plain, dec, "Behind()", [("via_object_state", (5.0,)), ("__call__", (1.0,))])


def test_dunder_setattr_call_means_an_assignment(write_module: Loader) -> None:
    plain, dec = pair(write_module, BEHIND)
    try:
        check(plain, dec, "Behind()", [("dunder_setattr", (1.0,)), ("dunder_setattr", (2.0,))])
    except autostate.AutostateError:
        f, states = dec.Behind().functionalize()
        f_still_works(f, states, "__call__", 1.0)




@pytest.mark.parametrize("method", ["count_arrays", "buffers"])
def test_iterating_the_instance_dict_sees_values(write_module: Loader, method: str) -> None:
    plain, dec = pair(write_module, CONSTRUCTS)
    check(plain, dec, "Ctx()", [(method, ())])


def test_sum_over_vars_keys_under_grad(write_module: Loader) -> None:
    plain, dec = pair(write_module, CONSTRUCTS)
    check_transform(plain, dec, "Ctx()", [("sum_over_vars_keys", (X,))], X1, "grad")


def test_lazy_linear_eagerly_like_plain(write_module: Loader) -> None:
    plain, dec = pair(write_module, TORCH_IDIOMS)
    check(plain, dec, "LazyLinear(2)", [("__call__", (V3,))] * 2, modes=("eager",))


def test_lazy_linear_first_built_inside_f_means_plain_python(write_module: Loader) -> None:
    # None is a placeholder (DESIGN.md section 3): the weight built inside f lands in the states.
    plain, dec = pair(write_module, TORCH_IDIOMS)
    check(plain, dec, "LazyLinear(2)", [("__call__", (V3,))] * 2)
    f, states = dec.LazyLinear(2).functionalize()
    for call in modes_of(f, "__call__"):
        _, new_states = call(states, V3)
        assert_same(new_states["w"], jnp.ones((3, 2)) * 0.5)


def test_lazy_linear_built_eagerly_then_functionalized(write_module: Loader) -> None:
    plain, dec = pair(write_module, TORCH_IDIOMS)
    ref, model = plain.LazyLinear(2), dec.LazyLinear(2)
    assert_same(ref(V3), model(V3))
    f, states = model.functionalize()
    assert sorted(states) == ["w"]
    out, states = staged(lambda f, s, x: f(s, x))(f, states, V3 * 2)
    assert_same(ref(V3 * 2), out)
    assert_same(ref.w, states["w"])
    grad = jax.grad(lambda s: f(s, V3)[0].sum())(states)
    assert_same(np.outer(np.asarray(V3), np.ones(2)), grad["w"])


def test_hasattr_lazy_cache_is_a_documented_decoration_error(write_module: Loader) -> None:
    source = """
@DECORATE
class HasattrCache:
    def __init__(self):
        self.k = jnp.ones(())

    def __call__(self, x):
        if not hasattr(self, "cache"):
            self.cache = x * 0
        self.cache = self.cache + x
        return self.cache * self.k
"""
    with pytest.raises(DecorationError, match="'cache' by name") as info:
        pair(write_module, source)
    assert re.search(r"\.py:\d+ \(in HasattrCache\.__call__\)", str(info.value))
    assert "fix:" in str(info.value)


def test_state_initialized_by_dict_update_is_a_clear_decoration_error(write_module: Loader) -> None:
    """Plain Python runs it; the analysis sees no `self.count = ...` in __init__ and
    says so at the user's line (the message calls it 'first assigned outside __init__')."""
    source = """
@DECORATE
class Counted:
    def __init__(self):
        self.__dict__.update(count=jnp.zeros((), jnp.int32))

    def __call__(self, x):
        self.count += 1
        return x * self.count
"""
    with pytest.raises(DecorationError, match="state 'count'") as info:
        pair(write_module, source)
    assert re.search(r"\.py:\d+ \(in Counted\.__call__\)", str(info.value))
    assert "fix:" in str(info.value)


















@pytest.mark.parametrize(
    ("kind", "base_decorated"),
    [("mlp_dropout", True), ("tracked", True), ("mlp_dropout", False), ("tracked", False)],
)
def test_regularized_loss_method_trains_like_hand_threaded(write_module: Loader, kind: str,
                                                           base_decorated: bool) -> None:
    """The loss is a model method that walks ``vars()`` for ``parameters()``."""
    plain, dec = library(write_module, base_decorated)
    template, model, n_out = build_pair(plain, dec, kind)
    data = data_for(n_out, 4)
    f, states = model.functionalize()

    def ref_loss(params: Any, states: Any, x: Any, y: Any) -> Any:
        m = load_plain(template, params, states)
        return m.regularized(x, y), read_plain(m, states)

    def dec_loss(f: Any, states: Any, x: Any, y: Any) -> Any:
        return f.regularized(states, x, y)

    params = names_of(f)
    ref_step = staged(jax.value_and_grad(ref_loss, has_aux=True))
    dec_step = staged(jax.value_and_grad(dec_loss, has_aux=True))
    for i, (x, y) in enumerate(data):
        (r_loss, r_states), r_grads = ref_step(params, dict(states), x, y)
        (loss, new_states), grads = dec_step(f, states, x, y)
        assert_same(r_loss, loss, f"step {i} loss")
        assert_same(r_grads, names_of(grads), f"step {i} grads")
        assert_same(r_states, new_states, f"step {i} states")
        params = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, r_grads)
        f = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, f, grads)
        states = new_states


OBJECT_SETATTR_PARAM = """
@DECORATE
class Bypass:
    def __init__(self):
        self.c = jnp.zeros(())
    def __call__(self, x):
        object.__setattr__(self, "c", self.c + x)  # HERE
        return self.c
"""


def test_object_setattr_in_a_method_makes_state(write_module: Loader) -> None:
    """``object.__setattr__(self, "c", v)`` is the attribute statement ``self.c = v``:
    ``c`` is state, and f runs the method like plain Python."""
    check(*pair(write_module, OBJECT_SETATTR_PARAM), "Bypass()", TWO_CALLS)


GETATTR = """
@DECORATE
class Core:
    def __init__(self):
        self.n = jnp.zeros(())
        self.w = jnp.asarray(2.0)

    def bump(self, x):
        self.n = self.n + x
        return self.n * self.w


@DECORATE
class Wrapper:
    def __init__(self):
        self.core = Core()
        self.calls = jnp.zeros(())

    def __getattr__(self, name):
        if name.startswith("__") or name == "core":
            raise AttributeError(name)
        return getattr(self.core, name)

    def __call__(self, x):
        self.calls = self.calls + 1
        return self.bump(x) + self.n * self.w
"""


def test_getattr_forwarding_to_a_sub_model(write_module: Loader) -> None:
    plain, dec = pair(write_module, GETATTR)
    check(plain, dec, "Wrapper()", [("__call__", (X1,)), ("__call__", (TWO,))])


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_getattr_forwarding_under_grad_and_vmap(write_module: Loader, transform: str) -> None:
    plain, dec = pair(write_module, GETATTR)
    x = X1 if transform == "grad" else jnp.arange(3.0)
    check_transform(plain, dec, "Wrapper()", [("__call__", (X,))] * 2, x, transform)


def test_forwarded_method_eagerly_from_outside(write_module: Loader) -> None:
    plain, dec = pair(write_module, GETATTR)
    p, d = plain.Wrapper(), dec.Wrapper()
    assert_same([p.bump(X1), p.n], [d.bump(X1), d.n], "forwarded")
    assert_same(snapshot(p), snapshot(d), "attributes")




def test_setattr_registry_records_the_same_names(write_module: Loader) -> None:
    plain, dec = pair(write_module, TORCH)
    for mod in (plain, dec):
        mod.REGISTRY.clear()
        m = mod.Recorder()
        m(V2_POSITIVE)
    assert plain.REGISTRY == dec.REGISTRY == ["w", "mean", "steps"]
    ref, model = plain.InstRecorder(), dec.InstRecorder()
    assert_same(ref(V2_POSITIVE), model(V2_POSITIVE))
    assert ref.order() == model.order() == ["w", "mean"]
    f, states = dec.InstRecorder().functionalize()
    for call in modes_of(f, "__call__"):
        out, states = call(states, V2_POSITIVE)
    ref2 = plain.InstRecorder()
    ref2(V2_POSITIVE)
    assert_same(ref2(V2_POSITIVE), out)
    assert f.order(states)[0] == ["w", "mean"]


def test_register_buffer_method_later_is_refused_in_f_at_its_setattr(write_module: Loader) -> None:
    """`register_buffer` assigns by a computed name: not state (documented); eagerly plain,
    in f the write is refused naming the setattr line."""
    plain, dec = pair(write_module, TORCH)
    check(plain, dec, "RegBuf()", [("__call__", (V2_POSITIVE,))] * 2, modes=("eager",))
    f, states = dec.RegBuf().functionalize()
    for call in modes_of(f, "__call__"):
        with pytest.raises(StateAccessError, match="RegBuf.running is not state") as err:
            call(states, V2_POSITIVE)
        assert "setattr(self, name, value)" in error_line(err.value)


@pytest.mark.parametrize("source", ["register-buffer", "object-setattr", "super-setattr"])
def test_state_initialized_behind_a_name_is_the_documented_decoration_error(
    write_module: Loader, source: str
) -> None:
    """A computed name (`register_buffer`) is the documented decoration error; a literal
    one (`object.__setattr__` / `super().__setattr__`) initializes the state as plain
    Python does."""
    init = {
        "register-buffer": 'self.register_buffer("running", jnp.zeros(2))',
        "object-setattr": 'object.__setattr__(self, "running", jnp.zeros(2))',
        "super-setattr": 'super().__setattr__("running", jnp.zeros(2))',
    }[source]
    text = f"""
@DECORATE
class Buf:
    def __init__(self):
        self.w = jnp.ones(2)
        {init}

    def register_buffer(self, name, value):
        setattr(self, name, value)

    def __call__(self, x):
        self.running = 0.9 * self.running + 0.1 * x
        return x * self.w + self.running
"""
    if source != "register-buffer":
        check(*pair(write_module, text), "Buf()", [("__call__", (V2_POSITIVE,))] * 2)
        return
    with pytest.raises(DecorationError, match="state 'running' is first assigned outside") as err:
        pair(write_module, text)
    assert "self.running = 0.9" in error_line(err.value)
    assert "fix:" in str(err.value)


def test_lazy_state_by_computed_hasattr_name(write_module: Loader) -> None:
    plain, dec = pair(write_module, TORCH)
    check(plain, dec, "LazyByName()", [("__call__", (X1,))] * 2, modes=("eager",))
    f, states = dec.LazyByName().functionalize()
    for call in modes_of(f, "__call__"):
        with pytest.raises(StateAccessError, match="LazyByName.cache is not state") as err:
            call(states, X1)
        assert "setattr(self, CACHE, x * 0)" in error_line(err.value)


CACHE_LINES = {"reset": "delattr(self, CACHE)", "reset_dict": "del self.__dict__[CACHE]",
               "reset_vars": "vars(self).pop(CACHE)"}


@pytest.mark.parametrize("reset", ["reset", "reset_dict", "reset_vars"])
def test_deleting_a_state_by_name_in_reset_is_refused_at_the_users_line(
    write_module: Loader, reset: str
) -> None:
    """Plain Python deletes and re-creates the cache; a state cannot be deleted
    (documented `StateAccessError`), eagerly and in f, and the model keeps its value."""
    plain, dec = pair(write_module, TORCH)
    ref = plain.Cache()
    ref(X1)
    getattr(ref, reset)()
    assert not hasattr(ref, "cache")
    model = dec.Cache()
    model(X1)
    with pytest.raises(StateAccessError, match="Cannot delete state 'cache'") as err:
        getattr(model, reset)()
    assert CACHE_LINES[reset] in error_line(err.value)
    assert_same(np.float32(1.5), model.cache)
    f, states = dec.Cache().functionalize()
    for call in modes_of(f, reset):
        with pytest.raises(StateAccessError, match="Cannot delete state 'cache'") as err:
            call(states)
        assert CACHE_LINES[reset] in error_line(err.value)


@pytest.mark.parametrize("stmt", ['delattr(self, "cache")', "del self.cache"])
def test_literal_delete_in_reset_is_the_documented_decoration_error(
    write_module: Loader, stmt: str
) -> None:
    text = f"""
@DECORATE
class Cache:
    def __init__(self):
        self.cache = jnp.zeros(())

    def __call__(self, x):
        self.cache = self.cache + x
        return self.cache

    def reset(self):
        {stmt}
"""
    with pytest.raises(DecorationError, match="'cache'") as err:
        pair(write_module, text)
    assert stmt in error_line(err.value)
    assert "fix:" in str(err.value)


@pytest.mark.parametrize("build", ["ObjectSetattr()", "FrozenObjectSetattr(jnp.ones(2))"])
def test_object_setattr_in_a_method(write_module: Loader, build: str) -> None:
    plain, dec = pair(write_module, EQX)
    calls = [("__call__", (V2_POSITIVE,))] * 2
    check(plain, dec, build, calls, modes=("eager",))
    try:
        check(plain, dec, build, calls)
    except autostate.AutostateError as err:
        assert "object.__setattr__" in error_line(err)


LINEN_LAZY = """
@DECORATE
class Dense:
    def __init__(self, n):
        self.n = n
        self.is_setup = False

    def setup(self):
        self.kernel = jnp.ones((self.n, self.n))
        self.steps = jnp.zeros((), jnp.int32)
        self.is_setup = True

    def __call__(self, x):
        if not self.is_setup:
            self.setup()
        self.steps += 1
        return x @ self.kernel
"""


def test_linen_setup_called_lazily_is_the_documented_decoration_error(write_module: Loader) -> None:
    with pytest.raises(DecorationError, match="'kernel' is first assigned outside __init__") as err:
        pair(write_module, LINEN_LAZY)
    assert "self.kernel = jnp.ones" in error_line(err.value)
    assert "(in Dense.setup)" in str(err.value)


def assert_here(err: BaseException) -> None:
    """The error names the user's file and the line marked ``# HERE``."""
    found = re.search(r"at (\S+\.py):(\d+)", str(err))
    assert found, f"no user file:line in: {err}"
    line = Path(found[1]).read_text().splitlines()[int(found[2]) - 1]
    assert "# HERE" in line, f"{found[0]} is {line!r}, not the marked line"


def test_del_two_states_in_one_statement_is_the_documented_error(write_module: Loader) -> None:
    source = """
@DECORATE
class Del:
    def __init__(self):
        self.a = jnp.zeros(())
        self.b = jnp.zeros(())

    def step(self, v):
        self.a = self.a + v
        self.b = self.b - v

    def reset(self):
        del self.a, self.b  # HERE
"""
    with pytest.raises(DecorationError, match=r"del self\.a") as err:
        pair(write_module, source)
    assert_here(err.value)












GETATTR_FALLBACKS = """
@DECORATE
class Stats:
    def __init__(self):
        self.buffers = {"mean": jnp.zeros(2), "var": jnp.ones(2)}
        self.w = jnp.ones(2)
    def __getattr__(self, name):
        buffers = self.__dict__.get("buffers")
        if buffers is not None and name in self.buffers:
            return self.buffers[name]
        raise AttributeError(name)
    def __call__(self, x):
        self.buffers = {**self.buffers, "mean": 0.5 * self.mean + 0.5 * x}
        return (x - self.mean) / self.var * self.w + hasattr(self, "nothing")

@DECORATE
class Naive:
    def __init__(self):
        self.extra = {"mean": jnp.zeros(2)}
        self.w = jnp.ones(2)
        self.n = jnp.zeros((), jnp.int32)
    def __getattr__(self, name):
        try:
            return self.extra[name]
        except KeyError:
            raise AttributeError(name) from None
    def __call__(self, x):
        self.n += 1
        return (x - self.mean) * self.w * self.n + getattr(self, "missing", 3.0)
"""


@pytest.mark.parametrize("cls", ["Stats", "Naive"])
def test_getattr_fallbacks(write_module: Loader, cls: str) -> None:
    plain, dec = pair(write_module, GETATTR_FALLBACKS)
    run_case(plain, dec, f"{cls}()", [("__call__", (jnp.ones(2),)), ("__call__", (V2_RANGE,))],
             extra=("__call__", (V2_RANGE,)))


def test_dynamic_roads_under_vmap(write_module: Loader) -> None:
    plain, dec = pair(write_module, DYNAMIC)
    xs = jnp.stack([XS, XS * -0.5])
    check_transform(plain, dec, "M()", [("partial_scan", (X,)), ("setattr_loop", (X,))], xs, "vmap")


def test_late_setattr_with_computed_name_on_a_non_state_is_refused(write_module: Loader) -> None:
    _, dec = pair(write_module, LATE_METHODS)
    f, states = dec.M().functionalize()
    with pytest.raises(autostate.errors.StateAccessError) as e:
        staged(f.named, static_argnums=1)(states, "extra", A1)
    user_line(e.value, dec, "M.named = logged(lambda self, name, v: setattr(self, name, v))")
    out, new = f.named(states, "h", A2)  # a state by a computed name: fine
    same({"h": A2}, new, "computed-name write to a state")




def test_lazy_linear_after_the_first_eager_call(write_module: Loader) -> None:
    # A lazily made weight is assigned in __call__, so it is a state (docs/faq.md, "A
    # weight that a method re-initializes is a state"): in `states`, not in f.
    plain, dec = pair(write_module, LAZY)
    run_case(plain, dec, "LazyLinear(0, 2)", [("__call__", (X23,)), ("__call__", (2 * X23,))],
             modes=("eager",))
    calls = [("__call__", (X23,)), ("__call__", (-X23,))]
    plain.X = dec.X = X23
    run_case(plain, dec, "primed(LazyLinear(0, 2), X)", calls)
    run_case(plain, dec, "primed(LazyMLP(3, [4, 2]), X)", calls)
    f, states = dec.primed(dec.LazyLinear(0, 2), X23).functionalize()
    assert sorted(states) == ["b", "calls", "key", "w"]
    assert autostate.param_dict(f) == {}


def test_lazy_linear_functionalized_before_the_first_call_means_plain_python(
    write_module: Loader,
) -> None:
    # None is a placeholder an array may replace inside f (tests/test_static_state.py):
    # the lazy weight is made by the first call of f, eagerly as under jit.
    plain, dec = pair(write_module, LAZY)
    run_case(plain, dec, "LazyLinear(0, 2)", [("__call__", (X23,)), ("__call__", (-X23,))])
    f, states = dec.LazyLinear(0, 2).functionalize()
    assert sorted(states) == ["b", "calls", "key", "w"] and states["w"] is None












def test_dunder_dict_item_write_is_plain_python_eagerly(write_module: Loader) -> None:
    plain, dec = pair(write_module, DUNDERS, fresh=True)
    calls = [("step", (1.0,)), ("raw", (jnp.float32(5.0),)), ("step", (1.0,)),
             ("extra", (3,)), ("kind", ())]
    ref, model = plain.D(), dec.D()
    assert_same([getattr(ref, m)(*a) for m, a in calls],
                [getattr(model, m)(*a) for m, a in calls], rtol=1e-6, atol=0.0)
    assert_same(snapshot(ref), snapshot(model), rtol=1e-6, atol=0.0)
    check(plain, dec, "D()", [("step", (1.0,)), ("kind", ()), ("step", (2.0,))], modes=("eager", "f", "jit"), rtol=1e-6, atol=0.0)


def test_dunder_dict_item_write_of_a_state_is_a_state_write(write_module: Loader) -> None:
    """``self.__dict__["x"] = v`` in a method means ``self.x = v`` for a state,
    as in plain Python, eagerly, in f and under jit (it was refused in f)."""
    plain, dec = pair(write_module, DUNDERS, fresh=True)
    check(plain, dec, "D()", [("raw", (jnp.float32(5.0),)), ("step", (1.0,))], modes=("eager", "f", "jit"), rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("mode", ["f", "jit"])
def test_dunder_dict_item_write_of_a_non_state_inside_f_is_refused(
    write_module: Loader, mode: str
) -> None:
    _, dec = pair(write_module, DUNDERS, fresh=True)
    f, states = dec.D().functionalize()
    call = f.extra if mode == "f" else staged(lambda f, s, v: f.extra(s, v))
    with pytest.raises(autostate.errors.StateAccessError, match="note"):
        call(states, jnp.float32(5.0)) if mode == "f" else call(f, states, jnp.float32(5.0))
    out, _ = f.step(states, 1.0)  # f is left as it was
    assert float(out) == 1.0
