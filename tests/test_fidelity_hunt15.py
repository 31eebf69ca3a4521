"""Differential bug hunt 15: class hierarchies, and methods however defined.

- Inheritance: a decorated base with an undecorated subclass (decorated by
  the subclass hook) and an undecorated base under a decorated subclass, three
  decorated levels each adding states after ``super().__init__()``, diamond
  multiple inheritance with cooperative ``super()`` chains through
  ``__init__`` and ``__call__`` where several classes write one state and
  their own, decorated and undecorated mixins adding states and methods,
  two non-cooperative bases initializing one state name, overrides calling
  ``super().method()`` (also in lambdas and ``lax.scan`` bodies, with
  explicit arguments), a subclass turning a base's array state into a Python
  int and back, a base parameter that a subclass makes state, a subclass
  property shadowing a base's state, subclasses that never call (or call
  late) ``super().__init__()``, subclasses made in a factory.
- Class shapes: ``abc.ABC`` templates (and the abstract-instantiation
  ``TypeError``), ``typing.Generic`` bases and ``Box[T](...)`` instances,
  dataclass subclasses of decorated classes with ``__post_init__``,
  ``__init_subclass__`` plugin registries (and one that wraps the subclass's
  ``__call__``), ``classmethod`` alternative constructors (also through
  ``cls.__new__`` without ``__init__``), a base whose state only its
  subclasses initialize (the documented error and its fix).
- Methods however defined: replaced on the class (base or subclass) after
  the first instance, wrapped after it, replaced on one instance with
  ``types.MethodType`` (through ``f.<name>``, ``__call__`` reaching it, after
  ``freeze`` and ``deepcopy``) or a ``functools.partial`` (the documented
  error), user decorators with and without ``functools.wraps`` (timing,
  logging, with arguments, calling the method twice or conditionally,
  stacked, ``lru_cache``: the documented error), methods made in a loop in
  the class body or by a factory, set by ``setattr(cls, ...)`` after the
  class statement or by class decorators above and below ``@stateful``,
  added after the first instance (writing a non-state: the documented
  error), borrowed from another decorated class before and after its first
  instance.
- For every class: the state names of ``functionalize()`` and the keys of
  ``param_dict`` / ``state_dict`` against what the attributes say.

Each source is written plain and decorated (``differential.pair``); the plain
run is the reference. A case that shows a mismatch stays, marked
``xfail(strict=True)`` with what differs.
"""

from __future__ import annotations

import copy
import re
import types
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from differential import (  # noqa: I001 - tests/ is on sys.path
    X,
    assert_same,
    assert_user_line,
    check,
    check_transform,
    pair,
    snapshot,
)

import autostate
from autostate.errors import (
    DecorationError,
    InvalidTypeError,
    StateAccessError,
    StaticStateError,
)

Loader = Callable[..., types.ModuleType]

X1 = jnp.float32(1.5)
X2 = jnp.float32(2.0)


def keys_of(dec: types.ModuleType, build: str) -> tuple[list[str], list[str], list[str]]:
    """State names, ``param_dict`` keys and ``state_dict`` keys of a fresh model."""
    model = eval(build, vars(dec))  # noqa: S307
    _, states = model.functionalize()
    return (
        sorted(states),
        sorted(autostate.param_dict(model)),
        sorted(autostate.state_dict(model)),
    )


def assert_line_is(err: BaseException, module: types.ModuleType, text: str) -> None:
    """The error names ``module``'s file at a line whose source contains ``text``."""
    assert_user_line(err, module.__file__)
    m = re.search(re.escape(module.__file__) + r":(\d+)", str(err))
    assert m, str(err)
    line = Path(module.__file__).read_text().splitlines()[int(m.group(1)) - 1]
    assert text in line, f"{line!r} is not the line of {text!r}: {err}"


def error_line(err: BaseException) -> str:
    """The source text of the test module line an error names."""
    m = re.search(r"at (\S+autostate_testmod_\d+\.py):(\d+)", str(err))
    assert m, f"no user file:line in: {err}"
    return Path(m.group(1)).read_text().splitlines()[int(m.group(2)) - 1]


# ======================================================================================
# 1. Hierarchies
# ======================================================================================

HIER = """
@DECORATE
class Base:
    def __init__(self, n=2):
        self.w = jnp.ones(n)
        self.count = jnp.zeros((), jnp.int32)
        self.acc = jnp.zeros(n)

    def __call__(self, x):
        self.count = self.count + 1
        self.acc = self.acc + x * self.w
        return self.acc.sum()

    def reset(self):
        self.acc = jnp.zeros_like(self.acc)
        return self.count


class PlainSub(Base):
    # not decorated: the subclass hook of Base decorates it
    def __init__(self):
        super().__init__(3)
        self.extra = jnp.zeros(())

    def __call__(self, x):
        y = super().__call__(x)
        self.extra = self.extra + y
        return y + self.extra


class Undecorated:
    def __init__(self):
        self.hits = jnp.zeros(())

    def bump(self, x):
        self.hits = self.hits + x
        return self.hits


@DECORATE
class OnUndecorated(Undecorated):
    def __init__(self):
        super().__init__()
        self.w = jnp.full((), 2.0)

    def __call__(self, x):
        return self.bump(x * self.w) + 1


@DECORATE
class L1:
    def __init__(self):
        self.a = jnp.zeros(())

    def __call__(self, x):
        self.a = self.a + x
        return self.a


@DECORATE
class L2(L1):
    def __init__(self):
        super().__init__()
        self.b = jnp.ones(())

    def __call__(self, x):
        self.b = self.b * 2
        return super().__call__(x * self.b) + self.b


@DECORATE
class L3(L2):
    def __init__(self):
        super().__init__()
        self.c = jnp.zeros(())
        self.a = jnp.full((), 10.0)   # overrides the base's initial value

    def __call__(self, x):
        out = super().__call__(x)
        self.c = self.c + out
        self.a = self.a - 1
        return out + self.c


@DECORATE
class Root:
    def __init__(self, **kw):
        self.trace = jnp.zeros(4)
        self.shared = jnp.zeros(())

    def __call__(self, x):
        self.trace = self.trace.at[0].add(x)
        self.shared = self.shared * 10 + 1
        return self.shared


@DECORATE
class Left(Root):
    def __init__(self, left=1.0, **kw):
        super().__init__(**kw)
        self.lstate = jnp.full((), left)

    def __call__(self, x):
        self.lstate = self.lstate + x
        self.trace = self.trace.at[1].add(x)
        self.shared = self.shared * 10 + 2
        return super().__call__(x) + self.lstate


@DECORATE
class Right(Root):
    def __init__(self, right=2.0, **kw):
        super().__init__(**kw)
        self.rstate = jnp.full((), right)

    def __call__(self, x):
        self.rstate = self.rstate * x
        self.trace = self.trace.at[2].add(x)
        self.shared = self.shared * 10 + 3
        return super().__call__(x) * self.rstate


@DECORATE
class Diamond(Left, Right):
    def __init__(self):
        super().__init__(left=5.0, right=3.0)
        self.shared = jnp.full((), 7.0)

    def __call__(self, x):
        self.trace = self.trace.at[3].add(x)
        self.shared = self.shared * 10 + 4
        return super().__call__(x)


class UndecoratedDiamond(Right, Left):
    pass


@DECORATE
class CountMixin:
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.calls = jnp.zeros((), jnp.int32)

    def tick(self):
        self.calls = self.calls + 1
        return self.calls

    def __call__(self, x):
        self.tick()
        return super().__call__(x)


class EmaMixin:
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.ema = jnp.zeros(())

    def track(self, v):
        self.ema = 0.5 * self.ema + 0.5 * v
        return self.ema


@DECORATE
class Mixed(CountMixin, EmaMixin, Base):
    def __call__(self, x):
        y = super().__call__(x)
        return self.track(y) + y


class MixedPlain(EmaMixin, CountMixin, Base):
    def __call__(self, x):
        return self.track(super().__call__(x))


@DECORATE
class Grand:
    def __init__(self):
        self.s = jnp.zeros(())
        self.t = jnp.zeros(())

    def step(self, x):
        self.s = self.s + x
        return self.s


@DECORATE
class Parent(Grand):
    def step(self, x):
        self.t = self.t + 1
        return super(Parent, self).step(x * 2)


@DECORATE
class Child(Parent):
    def step(self, x):
        a = super(Parent, self).step(x)      # Grand.step, skipping Parent
        b = super(Child, self).step(x)       # Parent.step
        c = Grand.step(self, x)              # unbound, through the class
        return a + b + c
"""

HIER_CASES = {
    "plain-sub": ("PlainSub()", [("__call__", (X1,)), ("reset", ()), ("__call__", (X2,))]),
    "undecorated-base": ("OnUndecorated()", [("__call__", (X1,)), ("bump", (X2,))]),
    "three-levels": ("L3()", [("__call__", (X1,)), ("__call__", (X2,))]),
    "diamond": ("Diamond()", [("__call__", (X1,)), ("__call__", (X2,))]),
    "undecorated-diamond": ("UndecoratedDiamond()", [("__call__", (X1,)), ("__call__", (X2,))]),
    "mixins": ("Mixed()", [("__call__", (X1,)), ("tick", ()), ("__call__", (X2,))]),
    "mixins-undecorated-leaf": ("MixedPlain()", [("__call__", (X1,)), ("reset", ())]),
    "super-explicit": ("Child()", [("step", (X1,)), ("step", (X2,))]),
}


@pytest.mark.parametrize("case", sorted(HIER_CASES))
def test_hierarchies_match_plain_python(write_module: Loader, case: str) -> None:
    plain, dec = pair(write_module, HIER)
    build, calls = HIER_CASES[case]
    check(plain, dec, build, calls)


HIER_KEYS = {
    "PlainSub()": (["acc", "count", "extra"], ["w"]),
    "OnUndecorated()": (["hits"], ["w"]),
    "L3()": (["a", "b", "c"], []),
    "Diamond()": (["lstate", "rstate", "shared", "trace"], []),
    "UndecoratedDiamond()": (["lstate", "rstate", "shared", "trace"], []),
    "Mixed()": (["acc", "calls", "count", "ema"], ["w"]),
    "Child()": (["s", "t"], []),
}


@pytest.mark.parametrize("build", sorted(HIER_KEYS))
def test_hierarchy_state_and_param_names(write_module: Loader, build: str) -> None:
    plain, dec = pair(write_module, HIER)
    ref = eval(build, vars(plain))  # noqa: S307
    names, params, sdict = keys_of(dec, build)
    arrays = {k for k, v in vars(ref).items() if isinstance(v, jax.Array)}
    assert set(names) | set(params) == arrays
    assert names == HIER_KEYS[build][0]
    assert params == HIER_KEYS[build][1]
    assert sdict == names


# ======================================================================================
# 2. Class shapes: a state's type changed by a subclass, ABCs, generics,
#    dataclass subclasses, plugin registries, alternative constructors
# ======================================================================================

SHAPES = """
T = typing.TypeVar("T")


@DECORATE
class Stepper:
    def __init__(self):
        self.step = jnp.zeros((), jnp.int32)
        self.total = jnp.zeros(())

    def __call__(self, x):
        self.step = self.step + 1
        self.total = self.total + x * self.step
        return self.total


class IntStepper(Stepper):
    def __init__(self):
        super().__init__()
        self.step = 0          # a Python int: static state from here on


@DECORATE
class Template(abc.ABC):
    def __init__(self):
        self.seen = jnp.zeros(())

    @abc.abstractmethod
    def transform(self, x): ...

    @property
    @abc.abstractmethod
    def scale(self): ...

    def __call__(self, x):
        self.seen = self.seen + 1
        return self.transform(x) * self.scale


class Doubler(Template):
    def __init__(self):
        super().__init__()
        self.last = jnp.zeros(())

    def transform(self, x):
        self.last = x * 2
        return self.last + self.seen

    @property
    def scale(self):
        return self.seen + 0.5


@DECORATE
class Box(typing.Generic[T]):
    def __init__(self, v: T):
        self.v = v
        self.n = jnp.zeros(())

    def put(self, v: T) -> T:
        self.n = self.n + 1
        old, self.v = self.v, v
        return old


class FloatBox(Box[jax.Array]):
    def put(self, v):
        return super().put(v * 2) + self.n


@DECORATE
class Plugin:
    registry: typing.ClassVar[dict] = {}

    def __init_subclass__(cls, name=None, **kw):
        super().__init_subclass__(**kw)
        if name is not None:
            Plugin.registry[name] = cls

    def __init__(self):
        self.calls = jnp.zeros(())

    def __call__(self, x):
        self.calls = self.calls + 1
        return self.run(x)

    def run(self, x):
        return x


class Square(Plugin, name="square"):
    def __init__(self):
        super().__init__()
        self.peak = jnp.zeros(())

    def run(self, x):
        self.peak = jnp.maximum(self.peak, x * x)
        return x * x + self.calls


class Neg(Plugin, name="neg"):
    def run(self, x):
        self.calls = self.calls + 10
        return -x


@DECORATE
class Configured:
    def __init__(self, n, rate):
        self.rate = rate
        self.w = jnp.arange(float(n))
        self.avg = jnp.zeros(n)

    @classmethod
    def from_config(cls, cfg):
        return cls(cfg["n"], cfg["rate"])

    def __call__(self, x):
        self.avg = self.rate * self.avg + (1 - self.rate) * x * self.w
        return self.avg.sum()


class Scaled(Configured):
    @classmethod
    def from_config(cls, cfg):
        obj = super().from_config(cfg)
        obj.k = cfg["k"]
        return obj

    def __call__(self, x):
        return super().__call__(x) * self.k
"""

SHAPE_CASES = {
    "abc-template": ("Doubler()", [("__call__", (X1,)), ("__call__", (X2,))]),
    "generic": ("FloatBox(jnp.ones(()))", [("put", (X1,)), ("put", (X2,))]),
    "plugin-square": ("Plugin.registry['square']()", [("__call__", (X1,)), ("__call__", (-X2,))]),
    "plugin-neg": ("Plugin.registry['neg']()", [("__call__", (X1,)), ("__call__", (X2,))]),
    "from-config": ("Configured.from_config({'n': 3, 'rate': 0.5})", [("__call__", (X1,))] * 2),
    "from-config-sub": (
        "Scaled.from_config({'n': 2, 'rate': 0.25, 'k': 3.0})",
        [("__call__", (X1,)), ("__call__", (X2,))],
    ),
}


@pytest.mark.parametrize("case", sorted(SHAPE_CASES))
def test_class_shapes_match_plain_python(write_module: Loader, case: str) -> None:
    plain, dec = pair(write_module, SHAPES)
    build, calls = SHAPE_CASES[case]
    check(plain, dec, build, calls)


def test_plugin_registry_holds_the_same_classes(write_module: Loader) -> None:
    plain, dec = pair(write_module, SHAPES)
    assert sorted(plain.Plugin.registry) == sorted(dec.Plugin.registry) == ["neg", "square"]
    assert dec.Plugin.registry["square"] is dec.Square
    names, params, _ = keys_of(dec, "Square()")
    assert (names, params) == (["calls", "peak"], [])


def test_a_subclass_turning_an_array_state_into_a_python_int(write_module: Loader) -> None:
    """Eagerly the int step counts as in plain Python; it is a static state,
    so a functionalized call that counts it is the documented
    ``StaticStateError`` naming the base's line that assigns it."""
    plain, dec = pair(write_module, SHAPES)
    calls = [("__call__", (X1,)), ("__call__", (X2,)), ("__call__", (X2,))]
    check(plain, dec, "IntStepper()", calls, modes=("eager",))
    names, _, _ = keys_of(dec, "IntStepper()")
    assert names == ["total"]
    f, states = dec.IntStepper().functionalize()
    with pytest.raises(StaticStateError) as info:
        f(states, X1)
    assert_line_is(info.value, dec, "self.step = self.step + 1")
    with pytest.raises(StaticStateError) as info:
        jax.jit(lambda f, s, x: f(s, x))(f, states, X1)
    assert_line_is(info.value, dec, "self.step = self.step + 1")


DATACLASSES = """
@DECORATE
@dataclasses.dataclass
class Posted:
    n: int = 3
    scale: float = 1.0

    def __post_init__(self):
        self.w = jnp.arange(float(self.n)) * self.scale
        self.m = jnp.zeros(self.n)
        self.calls = 0

    def __call__(self, x):
        self.m = self.m + x * self.w
        return self.m.sum()

    def bump(self):
        self.calls = self.calls + 1
        return self.calls
"""

DATACLASS_CASES = {
    "post-init": ("Posted(n=2, scale=2.0)", [("__call__", (X1,)), ("__call__", (X2,))]),
}


@pytest.mark.parametrize("case", sorted(DATACLASS_CASES))
def test_dataclass_subclasses_and_post_init(write_module: Loader, case: str) -> None:
    plain, dec = pair(write_module, DATACLASSES)
    build, calls = DATACLASS_CASES[case]
    check(plain, dec, build, calls)


def test_dataclass_names(write_module: Loader) -> None:
    _, dec = pair(write_module, DATACLASSES)
    # `w` is assigned by a method other than __init__ (__post_init__, like a
    # `self._build()` helper __init__ calls), so by the documented rule it is
    # a state, not a parameter
    assert keys_of(dec, "Posted(n=2)")[:2] == (["m", "w"], [])


DATACLASS_SUB = """
@DECORATE
class Core:
    def __init__(self):
        self.count = jnp.zeros(())

    def __call__(self, x):
        self.count = self.count + 1
        return x * self.count


@dataclasses.dataclass
class Cfg(Core):
    # a dataclass subclass of a decorated class (decorated by Core's hook):
    # its generated __init__ calls __post_init__, which initializes `hist`
    k: float = 2.0

    def __post_init__(self):
        super().__init__()
        self.hist = jnp.zeros(3)

    def __call__(self, x):
        self.hist = jnp.roll(self.hist, 1).at[0].set(x)
        return super().__call__(x) + self.k
"""


def test_dataclass_subclass_state_initialized_in_post_init(write_module: Loader) -> None:
    plain, dec = pair(write_module, DATACLASS_SUB)
    check(plain, dec, "Cfg(k=3.0)", [("__call__", (X1,)), ("__call__", (X2,))])
    assert keys_of(dec, "Cfg()")[:2] == (["count", "hist"], [])


def test_post_init_python_int_counter_eagerly(write_module: Loader) -> None:
    plain, dec = pair(write_module, DATACLASSES)
    check(
        plain, dec, "Posted()", [("bump", ()), ("bump", ()), ("__call__", (X1,))], modes=("eager",)
    )


def test_decorated_dataclass_subclass_extending_post_init(write_module: Loader) -> None:
    plain, dec = pair(
        write_module,
        DATACLASSES
        + """

@DECORATE
@dataclasses.dataclass
class Posted2(Posted):
    extra: float = 5.0

    def __post_init__(self):
        super().__post_init__()
        self.e = jnp.full((), self.extra)

    def __call__(self, x):
        self.e = self.e - x
        return super().__call__(x) + self.e
""",
    )
    check(plain, dec, "Posted2(n=2)", [("__call__", (X1,)), ("__call__", (X2,))])
    # w is assigned by a method other than __init__ (Posted's __post_init__), so
    # a state here as in Posted (test_dataclass_names)
    assert keys_of(dec, "Posted2(n=2)")[:2] == (["e", "m", "w"], [])


# ======================================================================================
# 3. Methods however defined
# ======================================================================================

WRAPPED = """
import time

CALLS = []


def timed(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kw):
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        CALLS.append(("timed", fn.__name__, time.perf_counter() >= t0))
        return out
    return wrapper


def logged(fn):
    # no functools.wraps: a bare closure over the method
    def wrapper(self, *args):
        CALLS.append(("logged", len(args)))
        return fn(self, *args)
    return wrapper


def repeat(n):
    def deco(fn):
        @functools.wraps(fn)
        def wrapper(self, *args):
            out = None
            for _ in range(n):
                out = fn(self, *args)
            return out
        return wrapper
    return deco


def when(flag_name):
    def deco(fn):
        @functools.wraps(fn)
        def wrapper(self, x):
            if getattr(self, flag_name):
                return fn(self, x)
            return x
        return wrapper
    return deco


def twice_sum(fn):
    @functools.wraps(fn)
    def wrapper(self, x):
        return fn(self, x) + fn(self, x * 2)
    return wrapper


@DECORATE
class Wrapped:
    def __init__(self, on=True):
        self.on = on
        self.s = jnp.zeros(())
        self.n = jnp.zeros((), jnp.int32)

    @timed
    def timed_step(self, x):
        self.s = self.s + x
        return self.s

    @logged
    def logged_step(self, x):
        self.n = self.n + 1
        self.s = self.s * 2 + x
        return self.s

    @repeat(3)
    def thrice(self, x):
        self.s = self.s + x
        self.n += 1
        return self.s

    @when("on")
    def gated(self, x):
        self.s = self.s - x
        return self.s

    @twice_sum
    def doubled(self, x):
        self.s = self.s + x
        return self.s

    @timed
    @repeat(2)
    @logged
    def stacked(self, x):
        self.n = self.n + 1
        self.s = self.s + x * self.n
        return self.s
"""

WRAPPED_CASES = {
    "timed": ("Wrapped()", [("timed_step", (X1,)), ("timed_step", (X2,))]),
    "logged-no-wraps": ("Wrapped()", [("logged_step", (X1,)), ("logged_step", (X2,))]),
    "decorator-with-args": ("Wrapped()", [("thrice", (X1,)), ("thrice", (X2,))]),
    "conditional-on": ("Wrapped(True)", [("gated", (X1,)), ("gated", (X2,))]),
    "conditional-off": ("Wrapped(False)", [("gated", (X1,)), ("gated", (X2,))]),
    "calls-twice": ("Wrapped()", [("doubled", (X1,)), ("doubled", (X2,))]),
    "stacked": ("Wrapped()", [("stacked", (X1,)), ("stacked", (X2,))]),
}


@pytest.mark.parametrize("case", sorted(WRAPPED_CASES))
def test_user_decorators_on_methods(write_module: Loader, case: str) -> None:
    plain, dec = pair(write_module, WRAPPED)
    build, calls = WRAPPED_CASES[case]
    plain.CALLS.clear()
    dec.CALLS.clear()
    check(plain, dec, build, calls, modes=("eager",))
    # one eager run each: the wrappers' side effects happen as often
    assert plain.CALLS == dec.CALLS
    check(plain, dec, build, calls)


def test_user_decorators_under_grad_and_vmap(write_module: Loader) -> None:
    plain, dec = pair(write_module, WRAPPED)
    calls = [("stacked", (X,)), ("doubled", (X,)), ("thrice", (X,))]
    check_transform(plain, dec, "Wrapped()", calls, X1, "grad")
    check_transform(plain, dec, "Wrapped()", calls, jnp.arange(3.0), "vmap")


MADE = """
def make_inc(k):
    def inc(self, x):
        self.s = self.s + k * x
        return self.s
    inc.__name__ = f"inc{k}"
    return inc


@DECORATE
class Looped:
    def __init__(self):
        self.s = jnp.zeros(())
        self.hits = jnp.zeros(3)

    for _k in (1, 2, 3):
        def _m(self, x, _k=_k):
            self.hits = self.hits.at[_k - 1].add(1)
            self.s = self.s + _k * x
            return self.s
        locals()[f"add{_k}"] = _m
    del _m, _k

    mul = make_inc(10)


@DECORATE
class SetLater:
    def __init__(self):
        self.s = jnp.zeros(())

    def __call__(self, x):
        return self.inc2(x) + self.s


for _name, _k in (("inc2", 2), ("inc5", 5)):
    setattr(SetLater, _name, make_inc(_k))


@DECORATE
class Donor:
    def __init__(self):
        self.s = jnp.zeros(())

    def forward(self, x):
        self.s = self.s * 2 + x
        return self.s


@DECORATE
class Borrower:
    forward = Donor.forward

    def __init__(self):
        self.s = jnp.ones(())
        self.w = jnp.full((), 3.0)

    def __call__(self, x):
        return self.forward(x * self.w)
"""

MADE_CASES = {
    "loop-in-class-body": ("Looped()", [("add1", (X1,)), ("add3", (X2,)), ("add2", (X1,))]),
    "factory-in-class-body": ("Looped()", [("mul", (X1,)), ("add1", (X2,))]),
    "borrowed": ("Borrower()", [("__call__", (X1,)), ("forward", (X2,))]),
}


@pytest.mark.parametrize("case", sorted(MADE_CASES))
def test_methods_made_by_code(write_module: Loader, case: str) -> None:
    plain, dec = pair(write_module, MADE)
    build, calls = MADE_CASES[case]
    check(plain, dec, build, calls)


def test_methods_made_by_code_state_names(write_module: Loader) -> None:
    plain, dec = pair(write_module, MADE)
    assert keys_of(dec, "Looped()")[:2] == (["hits", "s"], [])
    # Methods set after the class statement are not analysed: s is a
    # parameter, and their writes of it inside f are refused (docs/limitations.md).
    assert keys_of(dec, "SetLater()")[:2] == ([], ["s"])
    plain_model, model = plain.SetLater(), dec.SetLater()
    assert_same(plain_model(X1), model(X1))
    f, states = model.functionalize()
    with pytest.raises(StateAccessError, match="SetLater.s is not state"):
        f(states, X1)
    assert keys_of(dec, "Borrower()")[:2] == (["s"], ["w"])
    # the donor keeps its own method
    donor = dec.Donor()
    assert_same(donor.forward(X1), X1)


BORROW_LATE = """
@DECORATE
class Donor:
    def __init__(self):
        self.s = jnp.zeros(())

    def forward(self, x):
        self.s = self.s * 2 + x
        return self.s


FIRST = Donor()          # Donor is complete: Donor.forward is the rewritten one
FIRST.forward(1.0)


@DECORATE
class Borrower:
    forward = Donor.forward

    def __init__(self):
        self.s = jnp.ones(())

    def __call__(self, x):
        return self.forward(x) + self.s
"""


def test_method_borrowed_from_a_completed_decorated_class(write_module: Loader) -> None:
    plain, dec = pair(write_module, BORROW_LATE)
    p, d = plain.Borrower(), dec.Borrower()
    assert_same(p.forward(X1), d.forward(X1), "eager output")
    assert_same(snapshot(p), snapshot(d), "b.s after one eager call")  # a raw request: fails here
    check(plain, dec, "Borrower()", [("__call__", (X1,)), ("forward", (X2,))])
    check(plain, dec, "Donor()", [("forward", (X1,))])


REPLACED = """
import types


@DECORATE
class Net:
    def __init__(self):
        self.s = jnp.zeros(())
        self.w = jnp.full((), 2.0)

    def __call__(self, x):
        self.s = self.s + x
        return self.s * self.w

    def forward(self, x):
        return self(x) + 1


class SubNet(Net):
    def __init__(self):
        super().__init__()
        self.t = jnp.zeros(())

    def __call__(self, x):
        self.t = self.t - x
        return super().__call__(x) + self.t


def new_call(self, x):
    # replaces Net.__call__ after the first instance: not rewritten
    self.s = self.s * 3 + x
    return self.s - self.w


def new_forward(self, x):
    self.s = self.s + 100 * x
    return self.s


def timed(fn):
    @functools.wraps(fn)
    def wrapper(self, *a):
        self.s = self.s + 0.5
        return fn(self, *a)
    wrapper.timed = True
    return wrapper


def build_replaced():
    first = Net()
    first(1.0)
    Net.__call__ = new_call
    return Net()


def build_subclass_replaced():
    SubNet()
    SubNet.__call__ = new_call     # the subclass's, not Net's
    return SubNet()


def build_wrapped_later():
    Net()
    if not getattr(Net.forward, "timed", False):   # once per module
        Net.forward = timed(Net.forward)
    return Net()


def build_instance_method():
    m = Net()
    m.forward = types.MethodType(new_forward, m)
    return m
"""

REPLACED_CASES = {
    "class-call-replaced": ("build_replaced()", [("__call__", (X1,)), ("forward", (X2,))]),
    "subclass-call-replaced": (
        "build_subclass_replaced()",
        [("__call__", (X1,)), ("forward", (X2,))],
    ),
    "wrapped-after-first-instance": (
        "build_wrapped_later()",
        [("forward", (X1,)), ("forward", (X2,))],
    ),
    "instance-method-type": ("build_instance_method()", [("forward", (X1,)), ("__call__", (X2,))]),
}


@pytest.mark.parametrize("case", sorted(REPLACED_CASES))
def test_methods_replaced_after_the_first_instance(write_module: Loader, case: str) -> None:
    # each case edits its own module's classes: a fresh pair per case
    plain, dec = pair(write_module, REPLACED + f"\n# {case}\n")
    build, calls = REPLACED_CASES[case]
    check(plain, dec, build, calls)


def test_instance_method_type_is_what_f_forward_calls(write_module: Loader) -> None:
    plain, dec = pair(write_module, REPLACED + "\n# method-type-f\n")
    ref = plain.build_instance_method()
    expected = ref.forward(X1)
    f, states = dec.build_instance_method().functionalize()
    out, states = f.forward(states, X1)
    assert_same(expected, out)
    assert_same(np.asarray(ref.s), states["s"])
    out, states = jax.jit(lambda f, s, x: f.forward(s, x))(f, states, X2)
    assert_same(ref.forward(X2), out)
    assert_same(np.asarray(ref.s), states["s"])


LRU = """
@DECORATE
class Cached:
    def __init__(self):
        self.s = jnp.zeros(())

    @functools.lru_cache(maxsize=None)
    def cached(self, k):
        self.s = self.s + k   # HERE
        return k * 2
"""


def test_lru_cache_on_a_state_writing_method_is_the_documented_error(write_module: Loader) -> None:
    """``functools.lru_cache`` keeps the function in a C wrapper, not a
    closure: the documented 'decorator autostate cannot see through'."""
    with pytest.raises(DecorationError, match="cannot reach the function inside") as info:
        pair(write_module, LRU)
    assert "@functools.lru_cache" in error_line(info.value)


# ======================================================================================
# 4. More hierarchy corners
# ======================================================================================

SRC2 = """
import types


@DECORATE
class PBase:
    def __init__(self):
        self.y = jnp.ones(())      # a parameter of PBase

    def __call__(self, x):
        return x * self.y


class PSub(PBase):
    def step(self, x):
        self.y = self.y + x        # a state of PSub
        return self.y


@DECORATE
class Scaled:
    def __init__(self):
        self.scale = jnp.ones(())

    def step(self, x):
        self.scale = self.scale * x
        return self.scale


@DECORATE
class A:
    def __init__(self):
        self.count = jnp.zeros((), jnp.int32)
        self.a = jnp.zeros(())

    def fa(self, x):
        self.count = self.count + 1
        self.a = self.a + x
        return self.a


@DECORATE
class B:
    def __init__(self):
        self.count = jnp.full((), 0.5)
        self.b = jnp.zeros(())

    def fb(self, x):
        self.count = self.count * 2
        self.b = self.b - x
        return self.b


@DECORATE
class AB(A, B):
    def __init__(self):
        A.__init__(self)
        B.__init__(self)           # B's count wins, as in plain Python

    def __call__(self, x):
        return self.fa(x) + self.fb(x) + self.count


def counting(fn):
    @functools.wraps(fn)
    def wrapper(self, *a):
        self.ncalls = self.ncalls + 1
        return fn(self, *a)
    return wrapper


@DECORATE
class Auto:
    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if "__call__" in cls.__dict__:
            cls.__call__ = counting(cls.__call__)

    def __init__(self):
        self.ncalls = jnp.zeros((), jnp.int32)
        self.s = jnp.zeros(())

    def __call__(self, x):
        return x


class AutoSub(Auto):
    def __call__(self, x):
        self.s = self.s + x * self.ncalls
        return self.s


@DECORATE
class Raw:
    def __init__(self, n=2):
        self.s = jnp.zeros(n)
        self.w = jnp.ones(n)

    @classmethod
    def from_arrays(cls, s, w):
        obj = cls.__new__(cls)     # bypasses __init__
        obj.s = s
        obj.w = w
        return obj

    def __call__(self, x):
        self.s = self.s + x * self.w
        return self.s.sum()


@DECORATE
class Fwd:
    def __init__(self, k=1.0):
        self.s = jnp.zeros(())
        self.k = k

    def forward(self, x):
        self.s = self.s + x * self.k
        return self.s

    def alt(self, x):
        self.s = self.s * 2 - x
        return self.s


def partial_forward():
    m = Fwd()
    m.forward = functools.partial(Fwd.alt, m)
    return m


def factory(k):
    class Local(Scaled):
        def step(self, x):
            self.scale = self.scale + k
            return super().step(x) + k
    return Local


LOCAL = factory(3.0)
"""

CORNER_CASES = {
    "param-in-base-state-in-sub": (
        "PSub()",
        [("__call__", (X1,)), ("step", (X2,)), ("__call__", (X1,))],
    ),
    "two-bases-one-state-name": ("AB()", [("__call__", (X1,)), ("__call__", (X2,))]),
    "new-bypassing-init": (
        "Raw.from_arrays(jnp.ones(3), jnp.arange(3.0))",
        [("__call__", (X1,)), ("__call__", (X2,))],
    ),
    "factory-subclass": ("LOCAL()", [("step", (X2,)), ("step", (X1,))]),
}


@pytest.mark.parametrize("case", sorted(CORNER_CASES))
def test_hierarchy_corners(write_module: Loader, case: str) -> None:
    plain, dec = pair(write_module, SRC2)
    build, calls = CORNER_CASES[case]
    check(plain, dec, build, calls)


def test_partial_over_the_instance_held_as_a_method(write_module: Loader) -> None:
    """``m.forward = functools.partial(Fwd.alt, m)``: plain Python eagerly;
    ``functionalize()`` is the documented ``InvalidTypeError`` (a partial
    holding the model), naming the line that functionalizes."""
    plain, dec = pair(write_module, SRC2)
    check(
        plain, dec, "partial_forward()", [("forward", (X1,)), ("forward", (X2,))], modes=("eager",)
    )
    model = dec.partial_forward()
    with pytest.raises(InvalidTypeError, match="functools.partial") as info:
        model.functionalize()
    assert_user_line(info.value, __file__)


def test_corner_state_names(write_module: Loader) -> None:
    _, dec = pair(write_module, SRC2)
    assert keys_of(dec, "PSub()")[:2] == (["y"], [])
    assert keys_of(dec, "PBase()")[:2] == ([], ["y"])
    assert keys_of(dec, "AB()")[:2] == (["a", "b", "count"], [])


CLAMPED = """
@DECORATE
class Scaled:
    def __init__(self):
        self.scale = jnp.ones(())

    def step(self, x):
        self.scale = self.scale * x
        return self.scale


class Clamped(Scaled):
    # a property in the subclass shadows the base's state: Scaled.__init__'s
    # `self.scale = ...` runs this setter, which initializes `_scale`
    @property
    def scale(self):
        return self._scale

    @scale.setter
    def scale(self, v):
        self._scale = jnp.clip(v, 0.0, 4.0)
"""


def test_subclass_property_shadowing_a_base_state(write_module: Loader) -> None:
    plain, dec = pair(write_module, CLAMPED)
    check(plain, dec, "Clamped()", [("step", (X2,)), ("step", (X2,)), ("step", (X2,))])


LAYER = """
@DECORATE
class Layer:
    def __call__(self, x):
        self.calls = self.calls + 1   # HERE
        return self.forward(x)

    def forward(self, x):
        raise NotImplementedError
"""

LAYER_FIXED = """
@DECORATE
class Layer:
    calls = None   # the documented fix: a class attribute gives the initial value

    def __call__(self, x):
        self.calls = self.calls + 1
        return self.forward(x)

    def forward(self, x):
        raise NotImplementedError


class Dense(Layer):
    def __init__(self):
        self.calls = jnp.zeros((), jnp.int32)
        self.w = jnp.full((), 3.0)
        self.out = jnp.zeros(())

    def forward(self, x):
        self.out = x * self.w + self.calls
        return self.out
"""


def test_abstract_base_whose_state_only_subclasses_initialize(write_module: Loader) -> None:
    """A base with no ``__init__`` that writes a state its subclasses
    initialize: the documented 'first assigned outside __init__' error at the
    write; with the documented fix (a class attribute) it matches plain Python."""
    with pytest.raises(DecorationError, match="first assigned outside __init__") as info:
        pair(write_module, LAYER)
    assert "# HERE" in error_line(info.value)
    plain, dec = pair(write_module, LAYER_FIXED)
    check(plain, dec, "Dense()", [("__call__", (X1,)), ("__call__", (X2,))])
    assert keys_of(dec, "Dense()")[:2] == (["calls", "out"], ["w"])


COUNTING = """
def counting(fn):
    @functools.wraps(fn)
    def wrapper(self, *a):
        self.ncalls = self.ncalls + 1   # HERE: the wrapper runs as the method
        return fn(self, *a)
    return wrapper


@DECORATE
class Counted:
    def __init__(self):
        self.ncalls = jnp.zeros((), jnp.int32)
        self.s = jnp.zeros(())

    @counting
    def __call__(self, x):
        self.s = self.s + x
        return self.s


@DECORATE
class Auto:
    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if "__call__" in cls.__dict__:
            cls.__call__ = counting(cls.__call__)

    def __init__(self):
        self.ncalls = jnp.zeros((), jnp.int32)
        self.s = jnp.zeros(())

    def __call__(self, x):
        return x


class AutoSub(Auto):
    def __call__(self, x):
        self.s = self.s + x * self.ncalls
        return self.s
"""


@pytest.mark.parametrize("build", ["Counted()", "AutoSub()"], ids=["class-body", "init-subclass"])
def test_a_wrapper_that_writes_state(write_module: Loader, build: str) -> None:
    plain, dec = pair(write_module, COUNTING)
    check(plain, dec, build, [("__call__", (X1,)), ("__call__", (X2,))], modes=("eager",))
    check(plain, dec, build, [("__call__", (X1,)), ("__call__", (X2,))])


# ======================================================================================
# 5. More ways to define and reach methods
# ======================================================================================

MORE = """
import types


@DECORATE
class Module:
    ncall = 0

    def __call__(self, x):
        self.ncall = self.ncall + 1
        return self.forward(x)


class Lin(Module):
    def __init__(self):
        self.ncall = jnp.zeros((), jnp.int32)
        self.w = jnp.full((), 2.0)
        self.s = jnp.zeros(())

    def forward(self, x):
        self.s = self.s + x
        return x * self.w


def noisy_forward(self, x):
    self.s = self.s - x
    return x * self.w + self.ncall


def patched():
    m = Lin()
    m.forward = types.MethodType(noisy_forward, m)   # __call__ reaches it via self.forward
    return m


@DECORATE
class P:
    def __init__(self):
        self.s = jnp.zeros(())

    def step(self, x):
        self.s = self.s + x
        return self.s


class Q(P):
    def step(self, x):
        g = lambda v: super(Q, self).step(v)     # explicit super in a lambda
        return g(x) + g(x * 2)

    def scanned(self, xs):
        def body(c, x):
            return c + super(Q, self).step(x), None
        c, _ = lax.scan(body, jnp.zeros(()), xs)
        return c


@DECORATE
class S0:
    def __init__(self):
        self.step = 0                     # a static Python int in the base

    def __call__(self, x):
        self.step = self.step + 1
        return x * self.step


class S1(S0):
    def __init__(self):
        super().__init__()
        self.step = jnp.zeros((), jnp.int32)   # an array in the subclass


class Early(P):
    def __init__(self):
        self.s = jnp.full((), 5.0)        # before super().__init__(), which resets it
        self.k = jnp.ones(())
        super().__init__()

    def step(self, x):
        self.k = self.k + 1
        return super().step(x) * self.k


class NoSuper(P):
    def __init__(self):                 # never calls P.__init__
        self.s = jnp.full((), 7.0)


T = typing.TypeVar("T")


@DECORATE
class Box(typing.Generic[T]):
    def __init__(self, v):
        self.v = v
        self.n = jnp.zeros(())

    def put(self, v):
        self.n = self.n + 1
        old, self.v = self.v, v
        return old
"""

MORE_CASES = {
    "template-forward": ("Lin()", [("__call__", (X1,)), ("__call__", (X2,))]),
    "instance-forward-via-call": ("patched()", [("__call__", (X1,)), ("forward", (X2,))]),
    "super-in-lambda": ("Q()", [("step", (X1,)), ("step", (X2,))]),
    "super-in-scan-body": ("Q()", [("scanned", (jnp.arange(3.0),)), ("step", (X1,))]),
    "static-base-array-sub": ("S1()", [("__call__", (X1,)), ("__call__", (X2,))]),
    "set-before-super-init": ("Early()", [("step", (X1,)), ("step", (X2,))]),
    "no-super-init": ("NoSuper()", [("step", (X1,)), ("step", (X2,))]),
    "generic-alias-instance": ("Box[jax.Array](jnp.ones(()))", [("put", (X1,)), ("put", (X2,))]),
}


@pytest.mark.parametrize("case", sorted(MORE_CASES))
def test_more_ways_to_reach_methods(write_module: Loader, case: str) -> None:
    plain, dec = pair(write_module, MORE)
    build, calls = MORE_CASES[case]
    check(plain, dec, build, calls)


def test_more_state_names(write_module: Loader) -> None:
    _, dec = pair(write_module, MORE)
    assert keys_of(dec, "Lin()")[:2] == (["ncall", "s"], ["w"])
    assert keys_of(dec, "patched()")[:2] == (["ncall", "s"], ["w"])
    assert keys_of(dec, "S1()")[:2] == (["step"], [])
    assert keys_of(dec, "Early()")[:2] == (["k", "s"], [])
    assert keys_of(dec, "Box[jax.Array](jnp.ones(()))")[:2] == (["n", "v"], [])


def test_super_chains_under_grad_and_vmap(write_module: Loader) -> None:
    plain, dec = pair(write_module, MORE)
    calls = [("step", (X,)), ("scanned", (jnp.arange(3.0),)), ("step", (X,))]
    check_transform(plain, dec, "Q()", calls, X1, "grad")
    check_transform(plain, dec, "Early()", [("step", (X,))] * 2, jnp.arange(3.0), "vmap")
    hier_plain, hier_dec = pair(write_module, HIER)
    check_transform(hier_plain, hier_dec, "Diamond()", [("__call__", (X,))] * 2, X1, "grad")
    check_transform(
        hier_plain, hier_dec, "Mixed()", [("__call__", (X,))] * 2, jnp.arange(2.0), "vmap"
    )


def test_abstract_class_still_refuses_instances(write_module: Loader) -> None:
    plain, dec = pair(write_module, SHAPES)
    with pytest.raises(TypeError) as p_info:
        plain.Template()
    with pytest.raises(TypeError) as d_info:
        dec.Template()
    assert str(p_info.value) == str(d_info.value)


LATE_SETATTR = """
@DECORATE
class Late:
    def __init__(self):
        self.s = jnp.zeros(())
        self.u = jnp.zeros(())

    def bump(self, x):
        self.s = self.s + x
        return self.s


Late()


def late(self, x):
    self.s = self.s - x
    self.u = self.u * 3 + 1   # HERE: u is no state of Late
    return self.s


Late.late = late   # after the first instance: not rewritten
"""


def test_method_set_after_the_first_instance_writing_a_non_state(write_module: Loader) -> None:
    """Documented: a method added after the first instance is not rewritten;
    its write of a state goes through the descriptor, and its write of a
    non-state is refused inside a functionalized call, naming the line."""
    plain, dec = pair(write_module, LATE_SETATTR)
    check(plain, dec, "Late()", [("late", (X1,)), ("bump", (X2,))], modes=("eager",))
    f, states = dec.Late().functionalize()
    with pytest.raises(StateAccessError, match="Late.u is not state") as info:
        jax.jit(lambda f, s, x: f.late(s, x))(f, states, X1)
    assert "# HERE" in error_line(info.value)


CLASS_DECORATED = """
def make_inc(k):
    def inc(self, x):
        self.s = self.s + k * x
        self.hits = self.hits + 1
        return self.s
    return inc


def add_methods(cls):
    for k in (1, 2):
        setattr(cls, f"inc{k}", make_inc(k))
    return cls


@add_methods
@DECORATE
class Above:
    def __init__(self):
        self.s = jnp.zeros(())
        self.hits = jnp.zeros(())


@DECORATE
@add_methods
class Below:
    def __init__(self):
        self.s = jnp.zeros(())
        self.hits = jnp.zeros(())


@DECORATE
class Base:
    def __init__(self):
        self.s = jnp.zeros(())
        self.hits = jnp.zeros(3)

    def add(self, x, k):
        self.s = self.s + k * x
        return self.s


class LoopSub(Base):
    for _k in (1, 2, 3):
        def _m(self, x, _k=_k):
            self.hits = self.hits.at[_k - 1].add(1)
            return super().add(x, _k) * 2      # zero-argument super in a loop-made method
        locals()[f"add{_k}"] = _m
    del _m, _k
"""


@pytest.mark.parametrize(
    "build,calls",
    [
        ("Below()", [("inc2", (X1,)), ("inc1", (X2,))]),
        ("LoopSub()", [("add2", (X1,)), ("add3", (X2,)), ("add2", (X1,))]),
    ],
    ids=["class-decorator-below", "loop-methods-with-super"],
)
def test_methods_added_by_class_decorators_and_loops(
    write_module: Loader, build: str, calls: list
) -> None:
    plain, dec = pair(write_module, CLASS_DECORATED)
    check(plain, dec, build, calls)
    assert keys_of(dec, build)[:2] == (["hits", "s"], [])


ASSIGNED_LATE = """
@DECORATE
class Donor:
    def __init__(self):
        self.s = jnp.zeros(())

    def forward(self, x):
        self.s = self.s * 2 + x
        return self.s


@DECORATE
class Other:
    def __init__(self):
        self.s = jnp.ones(())      # a parameter of Other
        self.t = jnp.zeros(())

    def __call__(self, x):
        self.t = self.t + x
        return self.t


Donor()
Other()
Other.forward = Donor.forward     # Donor's rewritten function, set on a complete class
"""


def test_rewritten_method_set_on_another_class(write_module: Loader) -> None:
    """Eagerly the borrowed rewritten method writes a plain attribute, as plain
    Python; through f the write to what is a parameter of the complete class
    is the documented StateAccessError (a method added after the first use)."""
    plain, dec = pair(write_module, ASSIGNED_LATE)
    p, d = plain.Other(), dec.Other()
    assert_same(p.forward(X1), d.forward(X1), "eager output")
    assert_same(snapshot(p), snapshot(d), "attributes after one eager call")
    f, states = dec.Other().functionalize()
    with pytest.raises(StateAccessError, match="Other.s is not state") as info:
        f.forward(states, X1)
    assert_user_line(info.value, dec.__file__)  # Donor.forward's write


def test_instance_method_type_survives_freeze_and_deepcopy(write_module: Loader) -> None:
    """After jit and freeze, ``frozen.forward`` is bound to the frozen model
    (as a deep copy of plain Python's model would be) and keeps counting."""
    plain, dec = pair(write_module, REPLACED + "\n# freeze-method-type\n")
    ref = plain.build_instance_method()
    f, states = dec.build_instance_method().functionalize()
    expected = [ref.forward(X1), ref(X2)]
    out1, states = jax.jit(lambda f, s, x: f.forward(s, x))(f, states, X1)
    out2, states = jax.jit(lambda f, s, x: f(s, x))(f, states, X2)
    assert_same(expected, [out1, out2])
    frozen = autostate.freeze(f, states)
    assert frozen.forward.__self__ is frozen
    assert_same(ref.forward(X1), frozen.forward(X1))
    assert_same(snapshot(ref), snapshot(frozen))
    clone, ref_clone = copy.deepcopy(frozen), copy.deepcopy(ref)
    assert_same(ref_clone.forward(X2), clone.forward(X2))
    assert_same(snapshot(ref), snapshot(frozen), "the original is untouched by its copy")
    assert_same(snapshot(ref_clone), snapshot(clone))
