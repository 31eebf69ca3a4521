"""The programs the class shapes cases run (``test_class_shapes.py``): class
sources run plain and decorated, and their expected values. Other concept
files import some of them too.
"""

from __future__ import annotations

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


EQX = """
class EqxModule:
    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        dataclasses.dataclass(cls)


class Meta(type):
    def __new__(mcs, name, bases, ns):
        return dataclasses.dataclass(super().__new__(mcs, name, bases, ns))

    def __call__(cls, *args, **kwargs):
        obj = super().__call__(*args, **kwargs)
        check = getattr(obj, "__check_init__", None)
        if check is not None:
            check()
        return obj


class MetaModule(metaclass=Meta):
    pass


@DECORATE
@dataclasses.dataclass
class DUnder:
    weight: jax.Array
    bias: jax.Array = dataclasses.field(default_factory=lambda: jnp.zeros(2))
    count: jax.Array = dataclasses.field(default_factory=lambda: jnp.zeros((), jnp.int32))
    scale: float = 2.0
    n_layers: typing.ClassVar[int] = 3
    ema: jax.Array = dataclasses.field(init=False)

    def __post_init__(self):
        self.ema = jnp.zeros_like(self.weight)

    def __call__(self, x, *, key=None, inference=False):
        self.count += 1
        y = x * self.weight * self.scale + self.bias
        if not inference:
            self.ema = 0.5 * self.ema + 0.5 * y
        if key is not None:
            y = y + jax.random.normal(key, y.shape)
        return y * self.n_layers


@dataclasses.dataclass
@DECORATE
class DOver:
    weight: jax.Array
    count: jax.Array = dataclasses.field(default_factory=lambda: jnp.zeros((), jnp.int32))
    ema: jax.Array = dataclasses.field(init=False)

    def __post_init__(self):
        self.ema = jnp.zeros_like(self.weight)

    def __call__(self, x):
        self.count += 1
        self.ema = 0.5 * self.ema + 0.5 * x * self.weight
        return self.ema.sum()


@DECORATE
@dataclasses.dataclass(kw_only=True)
class KwOnly:
    weight: jax.Array
    momentum: float = 0.5
    mean: jax.Array = dataclasses.field(init=False, repr=False)
    history: list = dataclasses.field(default_factory=list)

    def __post_init__(self):
        self.mean = jnp.zeros_like(self.weight)

    def __call__(self, x):
        self.mean = self.momentum * self.mean + (1 - self.momentum) * x
        self.history = self.history + [self.mean.sum()]
        return self.weight * self.mean


@DECORATE
class SubclassHook(EqxModule):
    weight: jax.Array
    count: jax.Array = dataclasses.field(default_factory=lambda: jnp.zeros((), jnp.int32))
    scale: typing.ClassVar[float] = 2.0

    def __call__(self, x, *, double=False):
        self.count += 1
        y = x * self.weight * self.scale
        return y * 2 if double else y


@DECORATE
class MetaLinear(MetaModule):
    weight: jax.Array
    count: jax.Array = dataclasses.field(default_factory=lambda: jnp.zeros((), jnp.int32))

    def __check_init__(self):
        assert self.weight.shape == (2,)

    def __call__(self, x):
        self.count += 1
        return x * self.weight * self.count


@DECORATE
@dataclasses.dataclass(frozen=True)
class FrozenLin:
    weight: jax.Array
    bias: jax.Array

    def __call__(self, x):
        return x * self.weight + self.bias


@DECORATE
@dataclasses.dataclass(frozen=True)
class FrozenAssign:
    weight: jax.Array
    count: jax.Array = dataclasses.field(default_factory=lambda: jnp.zeros((), jnp.int32))

    def __call__(self, x):
        self.count = self.count + 1
        return x * self.weight


@DECORATE
@dataclasses.dataclass(frozen=True)
class FrozenObjectSetattr:
    weight: jax.Array
    count: jax.Array = dataclasses.field(default_factory=lambda: jnp.zeros((), jnp.int32))

    def __call__(self, x):
        object.__setattr__(self, "count", self.count + 1)
        return x * self.weight * self.count


@DECORATE
class ObjectSetattr:
    def __init__(self):
        self.weight = jnp.ones(2)
        self.ema = jnp.zeros(2)

    def __call__(self, x):
        object.__setattr__(self, "ema", 0.5 * self.ema + 0.5 * x)
        return x * self.weight + self.ema


@DECORATE
@dataclasses.dataclass
class Replaceable:
    weight: jax.Array
    count: jax.Array = dataclasses.field(default_factory=lambda: jnp.ones(()))

    def __call__(self, x):
        self.count = self.count + 1
        return x * self.weight * self.count

    def doubled(self, x):
        other = dataclasses.replace(self, weight=self.weight * 2)
        return other(x), other.count, self.count

    def copied(self, x):
        other = copy.copy(self)
        return other(x), other.count, self.count


@DECORATE
class HoldsReplaceable:
    def __init__(self):
        self.lin = Replaceable(jnp.ones(2))

    def __call__(self, x):
        other = dataclasses.replace(self.lin, weight=self.lin.weight * 2)
        return other(x), other.count, self.lin.count


@DECORATE
class WithFrozen:
    def __init__(self, weight=None):
        self.lin = FrozenLin(jnp.ones(2) if weight is None else weight, jnp.zeros(2))
        self.count = jnp.zeros((), jnp.int32)
        self.ema = jnp.zeros(2)

    def __call__(self, x):
        self.count += 1
        y = self.lin(x)
        self.ema = 0.5 * self.ema + 0.5 * y
        return y


@DECORATE
class EqxState:
    def __init__(self):
        self.lin = Replaceable(jnp.full((2,), 2.0))
        self.count = jnp.zeros((), jnp.int32)

    def __call__(self, x, state, *, scale=1.0, inference=False):
        self.count += 1
        state = dict(state)
        if not inference:
            state["mean"] = 0.9 * state["mean"] + 0.1 * x
        return self.lin(x) * scale + state["mean"], state


@DECORATE
class Counted:
    def __init__(self):
        self.w = jnp.ones(2)
        self.count = jnp.ones(())

    def __call__(self, x):
        self.count += 1
        return x * self.w


@DECORATE
class CopiesSub:
    def __init__(self):
        self.sub = Counted()

    def tree_map_copy(self, x):
        scaled = jax.tree_util.tree_map(lambda a: a * 2, self.sub)
        return scaled(x), scaled.count, self.sub.count

    def stop_gradient_copy(self, x):
        teacher = jax.lax.stop_gradient(self.sub)
        return teacher(x), teacher.count, self.sub.count


@DECORATE
@dataclasses.dataclass
class DeclaredField:
    weight: jax.Array
    mask: jax.Array = dataclasses.field(default_factory=lambda: STATE(jnp.ones(2) * 0.5))

    def __call__(self, x):
        return x * self.weight * self.mask


def declared(v):
    return STATE(v)


@DECORATE
class DeclaredByHelper:
    def __init__(self):
        self.weight = jnp.ones(2)
        self.mask = declared(jnp.ones(2) * 0.5)

    def __call__(self, x):
        return x * self.weight * self.mask
"""


PY313 = '''
import sys
import warnings
from typing import ReadOnly, TypedDict, TypeIs


class Opts(TypedDict):
    lr: ReadOnly[float]


@DECORATE
@dataclasses.dataclass
class Cell:
    w: jax.Array
    n: jax.Array = dataclasses.field(default_factory=lambda: jnp.zeros(()))

    def step(self, v):
        self.n = self.n + self.w * v
        return self.n

    def replaced(self, v):
        other = copy.replace(self, w=self.w * 2)
        self.n = self.n + other.w + v
        return other.w, other.n, self.n


@DECORATE
class Custom:
    def __init__(self):
        self.n = jnp.zeros(())
        self.w = jnp.ones(())

    def __replace__(self, /, **changes):
        new = copy.copy(self)
        for k, val in changes.items():
            setattr(new, k, val)
        return new

    def step(self, v):
        self.n = self.n + self.w * v
        return self.n

    def replaced(self, v):
        other = copy.replace(self, w=self.w + v)
        other.n = other.n + 10
        self.n = self.n + other.w
        return other.n, self.n


@DECORATE
class Old:
    """A model whose methods carry 3.13 decorators and annotations.

        Indented text: 3.13 strips it at compile time.
    """

    def __init__(self):
        self.n = jnp.zeros(())
        self.opts: Opts = {"lr": 0.5}

    @warnings.deprecated("use step")
    def old_step(self, v: float) -> jax.Array:
        """Deprecated.

            Keeps its indentation in __doc__ only before 3.13.
        """
        self.n = self.n + v * self.opts["lr"]
        return self.n

    def is_big(self, v: object) -> TypeIs[float]:
        self.n = self.n + 1
        return v > 1

    def step(self, v: ReadOnly[float]) -> jax.Array:
        """Adds v.

        More text.
        """
        self.n = self.n + v
        return self.n, sys._getframe().f_lineno - sys._getframe().f_code.co_firstlineno
'''


CONTROL = """
@DECORATE
class Leaf:
    __match_args__ = ("w", "n")

    def __init__(self, w):
        self.w = w
        self.n = jnp.zeros(())

    def step(self, v):
        self.n = self.n + self.w * v
        return self.n


@DECORATE
class Ctl:
    def __init__(self):
        self.n = jnp.zeros(())
        self.mode = 1
        self.modes = {"train": 1, "eval": 2}
        self.leaf = Leaf(jnp.full((), 2.0))
        self.log = [jnp.zeros(())]
        self.errors = jnp.zeros((), jnp.int32)

    def set_mode(self, m):
        self.mode = m

    def groups(self, v):
        try:
            try:
                self.n = self.n + v
                raise ExceptionGroup("outer", [ValueError("a"), ExceptionGroup("inner", [KeyError("b"), TypeError("c")])])
            except* ValueError as eg:
                self.log = self.log + [self.n * len(eg.exceptions)]
            except* KeyError:
                self.n = self.n * 3
                raise RuntimeError("from handler")
            finally:
                self.n = self.n + 1
        except* TypeError as eg:
            self.errors = self.errors + len(eg.exceptions)
        except* RuntimeError:
            self.n = self.n - 0.5
        return self.n, self.log[-1]

    def match_value(self, v):
        match self.mode:
            case 0:
                self.n = self.n - v
            case self.mode if self.mode > 5:
                self.n = self.n * 100
            case 1 | 2 as m if self.n is not None:
                self.n = self.n + v * m
            case _:
                self.n = jnp.zeros(())
        match 2:
            case self.mode:
                hit = 1.0
            case _:
                hit = 0.0
        return self.n, hit

    def match_class(self, v):
        match self.leaf:
            case Leaf(w, n) if n is not None:
                self.leaf.step(v)
                out = w + n
            case Leaf():
                out = jnp.zeros(())
        match {"leaf": self.leaf, "log": self.log}:
            case {"leaf": Leaf(w=w), "log": [first, *rest]}:
                self.log = [first + w, *rest]
        return out, self.leaf.n, self.log[0]

    def match_capture_from_state(self, v):
        match (self.n, self.log):
            case (n, [*items]) if len(items) == 1:
                self.n = n + items[0] + v
            case (n, _):
                self.n = n
        match self.modes:
            case {"train": self.mode}:
                same = True
            case _:
                same = False
        return self.n, same
"""


MORE_DEFS = """
REGISTRY = []


def register(cls):
    REGISTRY.append(cls.__name__)
    return cls


def bump_twice(self, x):
    self.s = self.s + 2 * x
    return self.s


def add_bump(cls):
    cls.bump_twice = bump_twice
    return cls


def add_reader(cls):
    def doubled(self):
        return self.s * 2
    cls.doubled = doubled
    return cls


@register
@DECORATE
@add_bump
class Stacked:
    def __init__(self):
        self.s = jnp.zeros(())

    def __call__(self, x):
        self.s = self.s + x
        return self.s


@add_reader
@add_bump
@DECORATE
@register
class StackedAbove:
    def __init__(self):
        self.s = jnp.ones(())

    def __call__(self, x):
        self.s = self.s * x
        return self.s


@DECORATE
@DECORATE
class Twice:
    def __init__(self):
        self.s = jnp.zeros(())
        self.n = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.s = self.s + x
        self.n += 1
        return self.s


SCALE = 4.0


@DECORATE
class Sig:
    FACTOR = 2.0

    def __init__(self):
        self.s = jnp.zeros(())
        self.log = jnp.zeros(3)

    def pos_only(self, a, b=FACTOR, /, c=SCALE):
        self.s = self.s + a * b + c
        return self.s

    def kw_only(self, x, *, scale=FACTOR * 3, shift=-1.0):
        self.s = self.s * scale + x + shift
        return self.s

    def varargs(self, *xs, **named):
        for v in xs:
            self.s = self.s + v
        for k in sorted(named):
            self.s = self.s * named[k]
        return self.s, len(xs), len(named)

    def forward(self, *args, **kwargs):
        return self.kw_only(*args, **kwargs)

    def default_is_a_class_attr(self, x, factor=None):
        factor = type(self).FACTOR if factor is None else factor
        self.log = self.log.at[0].set(x * factor)
        return self.log

    def rec(self, n):
        if n == 0:
            return self.s
        self.s = self.s + n
        return self.rec(n - 1)

    def even(self, n):
        if n == 0:
            return self.s
        self.s = self.s * 2
        return self.odd(n - 1)

    def odd(self, n):
        if n == 0:
            return self.s
        self.s = self.s + 1
        return self.even(n - 1)


@DECORATE
class Grand:
    def __init__(self):
        self.s = jnp.zeros(())

    def step(self, x):
        self.s = self.s + x
        return self.s


@DECORATE
class Parent(Grand):
    def step(self, x):
        self.s = self.s * 3
        return super(Parent, self).step(x)


@DECORATE
class Kid(Parent):
    def step(self, x):
        skip = super(Parent, self).step(x)   # skips Parent.step
        both = super(Kid, self).step(x)
        return skip + both

    def unbound(self, x):
        return Grand.step(self, x) + Parent.step(self, x)


@DECORATE
class Unicodé:
    def __init__(self):
        self.größe = jnp.zeros(())
        self.λ = jnp.ones(())

    def schritt(self, δ):
        self.größe = self.größe + δ * self.λ
        self.λ = self.λ * 2
        return self.größe
"""


LATE = """
GAIN = 1.0


def make_late():
    k = 1.0

    @DECORATE
    class Late:
        K = 2.0

        def __init__(self):
            self.s = jnp.zeros(())

        def __call__(self, x):
            self.s = self.s + x * k * Late.K * GAIN
            return self.s

        def make_sibling(self):
            return Late()

    k = 5.0
    return Late


def make_with_super():
    @DECORATE
    class B:
        def __init__(self):
            self.s = jnp.zeros(())

        def __call__(self, x):
            self.s = self.s + x
            return self.s

    @DECORATE
    class C(B):
        def __init__(self):
            super().__init__()
            self.t = jnp.ones(())

        def __call__(self, x):
            self.t = self.t * 2
            return super().__call__(x) + self.t

    return C


def make_many():
    out = []
    for i in range(3):
        @DECORATE
        class Step:
            def __init__(self):
                self.s = jnp.zeros(())

            def __call__(self, x, i=i):
                self.s = self.s + x * (i + 1)
                return self.s
        out.append(Step)
    return out


def make_late_loop():
    out = []
    for i in range(3):
        @DECORATE
        class Step:
            def __init__(self):
                self.s = jnp.zeros(())

            def __call__(self, x):
                self.s = self.s + x * (i + 1)   # late binding: the loop's last i
                return self.s
        out.append(Step)
    return out


LATE_CLS = make_late()
GAIN = 3.0
"""
