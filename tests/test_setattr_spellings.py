"""Attribute statements spelled as calls: ``setattr(self, "x", v)``,
``object.__setattr__(self, "x", v)`` (the frozen-dataclass / Equinox idiom),
``super().__setattr__("x", v)``, ``getattr(self, "x"[, default])``,
``object.__getattribute__(self, "x")``, ``delattr(self, "x")`` and
``object.__delattr__(self, "x")``.

With a literal name on the method's receiver each means the attribute
statement it spells: a write in a method other than ``__init__`` makes a
state, one in ``__init__`` initializes it, a delete of a state is the
documented decoration error of ``del self.x``. ``object.*`` bypasses the
class's own ``__setattr__`` / ``__getattribute__``, ``setattr``/``getattr``
go through them, as in plain Python. The function's name is resolved at each
call, as Python does: one the module rebinds after the class statement is
called as written. A computed name keeps the run-time guard's documented error.

Each source is written plain and decorated (``differential.pair``); the plain
run is the reference, eagerly, through ``f``, under ``jax.jit`` and after
``autostate.freeze``.
"""

from __future__ import annotations

import re
import types
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import libcst as cst
import pytest
from differential import assert_same, check, pair, snapshot  # noqa: I001 - tests/ is on sys.path

from autostate.errors import DecorationError, StateAccessError
from autostate.transform import analysis, method, rewrite

Loader = Callable[..., types.ModuleType]

X1 = jnp.float32(1.5)
X2 = jnp.float32(2.0)
V2 = jnp.array([1.0, -2.0])


def error_line(err: BaseException) -> str:
    """The source text of the test module line an error names."""
    m = re.search(r"at (\S+autostate_testmod_\d+\.py):(\d+)", str(err))
    assert m, f"no user file:line in: {err}"
    return Path(m.group(1)).read_text().splitlines()[int(m.group(2)) - 1]


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


@pytest.mark.parametrize("write", ["setattr", "object", "super"])
@pytest.mark.parametrize("init", ["attribute", "setattr", "object", "super"])
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


# --- the generated code --------------------------------------------------------


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


# --- frozen dataclasses ----------------------------------------------------------

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
    for call in (getattr(f, method), jax.jit(getattr(f, method))):
        with pytest.raises(dataclasses.FrozenInstanceError):
            call(states)
    assert_same(snapshot(plain.Frozen(jnp.ones(2))), snapshot(model))


# --- a class with its own __setattr__ / __getattribute__ ---------------------------

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
    for call in (f, jax.jit(f)):
        s, got = states, []
        for _, (x,) in calls:
            out, s = call(s, x)
            got.append(out)
        assert_same(expected, got)
        assert_same(object.__getattribute__(ref, "x"), s["x"])


# --- nested functions, lambdas, comprehensions, lax bodies ----------------------------

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


# --- deletes ------------------------------------------------------------------------

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


# --- an undecorated base, a declaration, a rebound builtin -----------------------------

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
    out, _ = jax.jit(lambda f, s, x: f(s, x))(f, states, X1)
    assert_same(plain.Declared()(X1), out)
    assert sorted(dec.Declared().functionalize("cache")[1]) == ["cache"]


def test_private_literal_and_mangled_names_are_two_states(write_module: Loader) -> None:
    _, dec = pair(write_module, MISC)
    assert sorted(dec.Private().functionalize()[1]) == ["_Private__h", "__h"]


# --- a computed name keeps the run-time guard's documented error ------------------------

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
    for call in (f, jax.jit(f)):
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
