"""Decoration-time fidelity: class bodies that plain Python accepts decorate.

Each case writes the same source twice with ``write_module``, plain
(``@DECORATE`` removed) and with ``@autostate.stateful``, and runs it eagerly,
through ``f(states, ...)`` and through ``jax.jit(f)``; the plain run is the
reference. Covered: one object bound to several names in the class body
(``__call__ = step``, wrapped, plain, property, staticmethod, classmethod),
``self.__dict__[k] = v`` and other dunder attributes, class-level defaults
of states, and dataclass subclasses of decorated dataclasses.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autostate

Loader = Callable[..., types.ModuleType]
Call = tuple[str, tuple[Any, ...]]

HEADER = """
from __future__ import annotations
import dataclasses
import functools
import jax
import jax.numpy as jnp
import autostate
"""


def pair(write_module: Loader, source: str) -> tuple[types.ModuleType, types.ModuleType]:
    plain = write_module(HEADER + source.replace("@DECORATE", ""))
    dec = write_module(HEADER + source.replace("@DECORATE", "@autostate.stateful"))
    return plain, dec


def snapshot(obj: Any, depth: int = 0) -> Any:
    """Every attribute of a (plain or decorated) model, read with getattr."""
    if depth > 6:
        return "<deep>"
    if isinstance(obj, list | tuple):
        return type(obj)(snapshot(v, depth + 1) for v in obj)
    if isinstance(obj, dict):
        return {k: snapshot(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, jax.Array | np.ndarray | np.generic):
        return np.asarray(obj)
    if isinstance(obj, bool | int | float | str | type(None)):
        return obj
    if hasattr(obj, "__dict__") and type(obj).__module__.startswith("autostate_testmod"):
        return {
            "__class__": type(obj).__name__,
            **{k: snapshot(getattr(obj, k), depth + 1) for k in sorted(vars(obj))},
        }
    return f"<{type(obj).__name__}>"


def assert_same(expected: Any, got: Any, where: str = "") -> None:
    if isinstance(expected, dict):
        assert isinstance(got, dict), f"{where}: expected dict, got {type(got).__name__}"
        assert sorted(map(str, expected)) == sorted(map(str, got)), f"{where}: keys differ"
        for k in expected:
            assert_same(expected[k], got[k], f"{where}[{k!r}]")
        return
    if isinstance(expected, list | tuple):
        assert isinstance(got, list | tuple) and len(expected) == len(got), where
        for i, (a, b) in enumerate(zip(expected, got)):
            assert_same(a, b, f"{where}[{i}]")
        return
    if isinstance(expected, str) or expected is None:
        assert expected == got, f"{where}: {expected!r} != {got!r}"
        return
    a, b = np.asarray(expected), np.asarray(got)
    assert a.shape == b.shape, f"{where}: shape {a.shape} != {b.shape}"
    np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=1e-6,
                               err_msg=where)


def _fcall(f: Any, name: str) -> Callable[..., Any]:
    return f if name == "__call__" else getattr(f, name)


def check(
    plain: types.ModuleType, dec: types.ModuleType, build: str, calls: Sequence[Call]
) -> None:
    """``calls`` on a plain and a decorated model: eager, ``f``, ``jax.jit(f)``."""
    ref = eval(build, vars(plain))  # noqa: S307
    expected = [getattr(ref, m)(*a) for m, a in calls]
    model = eval(build, vars(dec))  # noqa: S307
    assert_same(expected, [getattr(model, m)(*a) for m, a in calls], "eager outputs")
    assert_same(snapshot(ref), snapshot(model), "eager attributes")
    for mode in ("f", "jit"):
        model = eval(build, vars(dec))  # noqa: S307
        before = snapshot(model)
        f, states = model.functionalize()
        got = []
        for m, a in calls:
            if mode == "f":
                out, states = _fcall(f, m)(states, *a)
            else:
                out, states = jax.jit(lambda f, s, *a, m=m: _fcall(f, m)(s, *a))(f, states, *a)
            got.append(out)
        assert_same(expected, got, f"{mode} outputs")
        for key, value in states.items():
            assert_same(snapshot(getattr(ref, key)), snapshot(value), f"{mode} state {key}")
        assert_same(before, snapshot(model), f"{mode}: the eager model changed")


# --- 1. one object under several names ---------------------------------------------

ALIASES = """
def logged(fn):
    @functools.wraps(fn)
    def wrapper(self, *args):
        return fn(self, *args)
    return wrapper


@DECORATE
class W:
    def __init__(self):
        self.n = jnp.zeros(())

    @logged
    def step(self, x):
        self.n += x
        return self.n

    __call__ = step
    again = step

    def scale(self, k):
        self.n = self.n * k
        return self.n

    times = scale

    @property
    def value(self):
        return self.n + 0

    @value.setter
    def value(self, v):
        self.n = v

    alias_value = value

    def set_via_alias(self, v):
        self.alias_value = v
        return self.value

    @staticmethod
    def bump(model, x):
        model.n = model.n + x
        return model.n

    bump_alias = bump

    def call_static(self, x):
        return self.bump_alias(self, x)

    @classmethod
    def kind(cls):
        return cls.__name__

    kind_alias = kind

    def named(self, x):
        self.n = self.n + x
        return self.n + len(self.kind_alias())
"""


def test_aliases_are_one_object(write_module: Loader) -> None:
    plain, dec = pair(write_module, ALIASES)
    for module in (plain, dec):
        W = module.W
        assert W.__call__ is W.step is W.again
        assert W.times is W.scale
        assert vars(W)["alias_value"] is vars(W)["value"]
        assert vars(W)["bump_alias"] is vars(W)["bump"]
        assert vars(W)["kind_alias"] is vars(W)["kind"]


@pytest.mark.parametrize(
    "calls",
    [
        [("step", (1.0,)), ("__call__", (2.0,)), ("again", (0.5,))],
        [("__call__", (2.0,)), ("times", (3.0,)), ("scale", (0.5,))],
        [("set_via_alias", (4.0,)), ("step", (1.0,))],
        [("call_static", (2.0,)), ("bump_alias", (None, 1.0))],
        [("named", (1.0,)), ("__call__", (1.0,))],
    ],
    ids=["wrapped", "plain", "property", "staticmethod", "classmethod"],
)
def test_aliased_methods(write_module: Loader, calls: list[Call]) -> None:
    plain, dec = pair(write_module, ALIASES)
    if calls[-1][0] == "bump_alias":  # a static method called through the class
        ref, model = plain.W(), dec.W()
        assert_same(plain.W.bump_alias(ref, 1.0), dec.W.bump_alias(model, 1.0))
        assert_same(snapshot(ref), snapshot(model))
        calls = calls[:-1]
    check(plain, dec, "W()", calls)


# --- 2. dunder attributes are never state -------------------------------------------

DUNDERS = """
@DECORATE
class D:
    def __init__(self):
        self.x = jnp.zeros(())

    def step(self, v):
        self.x = self.x + v
        return self.x

    def raw(self, v):
        self.__dict__["x"] = v
        return self.x

    def extra(self, v):
        self.__dict__["note"] = v
        return self.note

    def kind(self):
        return float(len(self.__class__.__name__))


class E(D):
    pass


@DECORATE
class Switch:
    def __init__(self):
        self.x = jnp.zeros(())

    def become(self):
        self.__class__ = Other
        return 1.0


@DECORATE
class Other(Switch):
    def step(self, v):
        self.x = self.x + v
        return self.x
"""


def test_dunder_attributes_are_not_state(write_module: Loader) -> None:
    _, dec = pair(write_module, DUNDERS)
    info = autostate.tree.class_info(dec.D)
    assert info.state == frozenset({"x"})
    assert autostate.tree.class_info(dec.Switch).state == frozenset()


def test_dunder_dict_item_write_is_plain_python_eagerly(write_module: Loader) -> None:
    plain, dec = pair(write_module, DUNDERS)
    calls = [("step", (1.0,)), ("raw", (jnp.float32(5.0),)), ("step", (1.0,)),
             ("extra", (3,)), ("kind", ())]
    ref, model = plain.D(), dec.D()
    assert_same([getattr(ref, m)(*a) for m, a in calls],
                [getattr(model, m)(*a) for m, a in calls])
    assert_same(snapshot(ref), snapshot(model))
    check(plain, dec, "D()", [("step", (1.0,)), ("kind", ()), ("step", (2.0,))])


def test_dunder_dict_item_write_of_a_state_is_a_state_write(write_module: Loader) -> None:
    """``self.__dict__["x"] = v`` in a method means ``self.x = v`` for a state,
    as in plain Python, eagerly, in f and under jit (it was refused in f)."""
    plain, dec = pair(write_module, DUNDERS)
    check(plain, dec, "D()", [("raw", (jnp.float32(5.0),)), ("step", (1.0,))])


@pytest.mark.parametrize("mode", ["f", "jit"])
def test_dunder_dict_item_write_of_a_non_state_inside_f_is_refused(
    write_module: Loader, mode: str
) -> None:
    _, dec = pair(write_module, DUNDERS)
    f, states = dec.D().functionalize()
    call = f.extra if mode == "f" else jax.jit(lambda f, s, v: f.extra(s, v))
    with pytest.raises(autostate.errors.StateAccessError, match="note"):
        call(states, jnp.float32(5.0)) if mode == "f" else call(f, states, jnp.float32(5.0))
    out, _ = f.step(states, 1.0)  # f is left as it was
    assert float(out) == 1.0


def test_assigning_dunder_class_is_plain_python(write_module: Loader) -> None:
    plain, dec = pair(write_module, DUNDERS)
    ref, model = plain.Switch(), dec.Switch()
    ref.become()
    model.become()
    assert type(model) is dec.Other
    assert_same(ref.step(2.0), model.step(2.0))
    f, states = model.functionalize()
    out, states = jax.jit(lambda f, s, v: f.step(s, v))(f, states, 1.0)
    assert_same(ref.step(1.0), out)


# --- 3. class-level defaults ---------------------------------------------------------

CLASS_DEFAULTS = """
@DECORATE
class Mode:
    training = True
    scale = 2.0
    cache = None

    def __init__(self):
        self.w = jnp.ones(())

    def eval(self):
        self.training = False
        return self

    def remember(self, x):
        self.cache = x
        return x

    def __call__(self, x):
        return x * self.w * (self.scale if self.training else 1.0)


class Defaults:
    steps = 0
    label = "base"


@DECORATE
class FromBase(Defaults):
    def __init__(self):
        self.w = jnp.ones(())

    def tick(self, x):
        self.steps = self.steps + 1
        return x * self.w * self.steps


@DECORATE
class Child(Mode):
    training = False


@DECORATE
class Counter:
    count = jnp.zeros(())

    def __init__(self, w=2.0):
        self.w = jnp.float32(w)

    def __call__(self, x):
        self.count = self.count + x
        return self.count * self.w


@DECORATE
class NoInit:
    count = 0

    def step(self):
        self.count = self.count + 1
        return self.count
"""


def test_class_defaults_keep_the_class_attribute(write_module: Loader) -> None:
    plain, dec = pair(write_module, CLASS_DEFAULTS)
    for module in (plain, dec):
        assert module.Mode.training is True
        assert module.Mode.cache is None
        assert module.Child.training is False
        assert module.FromBase.steps == 0
        assert float(module.Counter.count) == 0.0
        assert inspect.signature(module.Counter) .parameters.keys() == {"w"}
        assert str(inspect.signature(module.NoInit)) == "()"
    model = dec.Mode().eval()
    assert dec.Mode.training is True and model.training is False
    with pytest.raises(TypeError, match="takes no arguments"):
        dec.NoInit(1)


@pytest.mark.parametrize(
    ("build", "calls"),
    [
        ("Mode()", [("__call__", (3.0,))]),
        ("Mode().eval()", [("__call__", (3.0,))]),
        ("Child()", [("__call__", (3.0,))]),
        ("FromBase()", [("tick", (1.0,)), ("tick", (2.0,))]),
        ("Counter()", [("__call__", (1.0,)), ("__call__", (2.0,))]),
        ("NoInit()", [("step", ()), ("step", ())]),
    ],
    ids=["static", "eval", "subclass_override", "undecorated_base", "array", "no_init"],
)
def test_class_default_as_initial_value(write_module: Loader, build: str, calls: list[Call]) -> None:
    plain, dec = pair(write_module, CLASS_DEFAULTS)
    if build in ("FromBase()", "NoInit()"):
        # an int state: eagerly plain Python; f refuses changing a static state
        ref, model = eval(build, vars(plain)), eval(build, vars(dec))  # noqa: S307
        assert_same([getattr(ref, m)(*a) for m, a in calls],
                    [getattr(model, m)(*a) for m, a in calls])
        assert_same(snapshot(ref), snapshot(model))
        f, states = eval(build, vars(dec)).functionalize()  # noqa: S307
        with pytest.raises(autostate.errors.StaticStateError, match="holds 0"):
            _fcall(f, calls[0][0])(states, *calls[0][1])
        return
    check(plain, dec, build, calls)


def test_array_class_default_is_in_the_states(write_module: Loader) -> None:
    _, dec = pair(write_module, CLASS_DEFAULTS)
    f, states = dec.Counter().functionalize()
    assert list(states) == ["count"]
    _, states = f(states, 3.0)
    assert float(autostate.freeze(f, states).count) == 3.0
    assert float(dec.Counter.count) == 0.0


def test_static_class_default_inside_f(write_module: Loader) -> None:
    _, dec = pair(write_module, CLASS_DEFAULTS)
    f, states = dec.Mode().functionalize()
    assert states == {}
    with pytest.raises(autostate.errors.StaticStateError, match="static state 'training'"):
        f.eval(states)
    with pytest.raises(autostate.errors.StaticStateError, match="static state 'cache'"):
        f.remember(states, jnp.ones(2))
    model = dec.Mode()
    model.remember(jnp.ones(2))  # eagerly plain Python: None, then an array
    f, states = model.functionalize()
    assert list(states) == ["cache"]


def test_state_without_any_initial_value_is_still_refused(write_module: Loader) -> None:
    source = """
@DECORATE
class Tracker:
    def helper(self):
        pass

    def __call__(self, x):
        self.last = x
        return x
"""
    with pytest.raises(autostate.errors.DecorationError, match="first assigned outside __init__"):
        pair(write_module, source)


# --- 4. dataclass subclasses of decorated dataclasses ------------------------------

DATACLASSES = """
@DECORATE
@dataclasses.dataclass
class Base:
    mean: jax.Array = dataclasses.field(default_factory=lambda: jnp.zeros(()))

    def update(self, x):
        self.mean = self.mean + x
        return self.mean


@DECORATE
@dataclasses.dataclass
class WithPost(Base):
    extra: jax.Array = dataclasses.field(default_factory=lambda: jnp.ones(()))

    def __post_init__(self):
        self.extra = self.extra * 3

    def bump(self, x):
        self.extra = self.extra + x
        return self.extra + self.update(x)


@dataclasses.dataclass
class Undecorated(Base):
    # Decorated by the subclass hook alone, before @dataclass runs.

    extra: jax.Array = dataclasses.field(default_factory=lambda: jnp.ones(()))

    def bump(self, x):
        self.extra = self.extra * 3 + x
        return self.extra


@DECORATE
@dataclasses.dataclass
class WithDefault(Base):
    rate: float = 0.5
    total: jax.Array = dataclasses.field(default_factory=lambda: jnp.zeros(()))

    def bump(self, x):
        self.total = self.total + self.rate * x
        return self.total
"""


@pytest.mark.parametrize(
    ("build", "calls"),
    [
        ("WithPost()", [("bump", (1.0,)), ("bump", (2.0,)), ("update", (1.0,))]),
        ("WithPost(mean=jnp.ones(()), extra=jnp.full((), 2.0))", [("bump", (1.0,))]),
        ("WithDefault()", [("bump", (1.0,)), ("update", (2.0,))]),
        ("Undecorated()", [("bump", (1.0,)), ("update", (2.0,)), ("bump", (1.0,))]),
    ],
    ids=["post_init", "post_init_args", "field_default", "subclass_hook_only"],
)
def test_dataclass_subclass(write_module: Loader, build: str, calls: list[Call]) -> None:
    plain, dec = pair(write_module, DATACLASSES)
    assert dataclasses.is_dataclass(dec.WithPost)
    assert [f.name for f in dataclasses.fields(dec.WithPost)] == ["mean", "extra"]
    assert autostate.tree.class_info(dec.WithPost).state >= {"mean", "extra"}
    check(plain, dec, build, calls)
    if build == "Undecorated()":
        # Read from outside: the state's value, not its slot (the descriptor
        # @dataclass removed is put back by the first write).
        model = dec.Undecorated()
        assert isinstance(model.extra, jax.Array) and float(model.extra) == 1.0
