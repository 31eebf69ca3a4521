"""The programs, sources and helpers that cases of several concepts share:
class sources run plain and decorated, their expected values, and the small
harnesses some cases drive them with. Imported by the concept files.
"""

from __future__ import annotations

import itertools
import sys
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import optax
import pytest

Loader = Callable[..., types.ModuleType]


X1 = jnp.float32(1.5)


X2 = jnp.float32(-2.0)


TWO_CALLS = [("__call__", (X1,)), ("__call__", (X2,))]


Call = tuple[str, tuple[Any, ...]]


HEADER = """
from __future__ import annotations
import dataclasses
import functools
import jax
import jax.numpy as jnp
import autostate
"""


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


HIDDEN_METHODS = """
import functools
import jax.numpy as jnp


def logged(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


def twice(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


def external(self, x):
    self.count = self.count + 1
    return x * self.count


def make_method(step):
    def inc(self, x):
        self.count = self.count + step
        return x * self.count
    return inc


class CountMixin:
    def bump(self, x):
        self.count = self.count + 1
        return x * self.count


class Wrapped:
    def __init__(self):
        self.count = jnp.zeros(())

    @twice
    @logged
    def __call__(self, x):
        self.count = self.count + 1
        return x * self.count


class Assigned:
    def __init__(self):
        self.count = jnp.zeros(())

    __call__ = external


class Factory:
    def __init__(self):
        self.count = jnp.zeros(())

    __call__ = make_method(2)


class Mixed(CountMixin):
    def __init__(self):
        self.count = jnp.zeros(())

    def __call__(self, x):
        return self.bump(x)
"""


HELPER_WRITES = """
import jax.numpy as jnp


def bump(m):
    m.count = m.count + 1


class NoStates:
    def __init__(self):
        self.w = jnp.ones(())
        self.count = 0

    def __call__(self, x):
        bump(self)
        return x * self.w + self.count
"""


HOOKS = """
import dataclasses
import jax.numpy as jnp


class Clamped:
    def __init__(self):
        self.count = jnp.zeros(())

    def __setattr__(self, name, value):
        if name == "count":
            value = jnp.minimum(value, 10.0)
        super().__setattr__(name, value)

    def __call__(self, x):
        self.count = self.count + 55 * x
        return self.count


class Counted:
    reads = 0

    def __init__(self):
        self.count = jnp.zeros(())

    def __getattribute__(self, name):
        if name == "count":
            type(self).reads += 1
        return object.__getattribute__(self, name)

    def __call__(self, x):
        self.count = self.count + x
        return self.count


@dataclasses.dataclass(frozen=True)
class Frozen:
    count: object

    def __call__(self, x):
        self.count = self.count + x
        return self.count
"""


PLAIN_SUBMODEL = """
import jax.numpy as jnp


class Linear:
    def __init__(self):
        self.w = jnp.ones(3)


class Net:
    def __init__(self):
        self.blocks = [Linear()]
        self.steps = jnp.zeros(())

    def __call__(self, x):
        self.steps = self.steps + 1
        return self.blocks[0].w @ x
"""


CONSTRUCTS = """
import jax.numpy as jnp

CALLS = []


def k():
    CALLS.append("k")
    return "a"


def v():
    CALLS.append("v")
    return 2.0


class Constructs:
    def __init__(self):
        self.d = {"a": jnp.ones(())}
        self.count = jnp.zeros((), jnp.int32)
        self.target = 3
        self.seen = []
        self.opts = {"a": 1}
        self.tags = {"x"}
        self.µ = jnp.zeros(())

    def step(self, n):
        self.d[k()] *= v()
        self.count += 1
        shown = f"{self.count=}", f"{self.count = !s:>4}", f"{ self.count = :>4}"
        nested = f"outer {f'inner {self.count}'}"
        match 3:
            case self.target:
                hit = True
            case _:
                hit = False
        self.seen += range(n)
        self.seen += (n, n)
        self.opts |= [("b", 2)]
        self.tags |= {"y"}
        self.µ += 1
        self.target = self.target + 0
        return shown, nested, hit

    def ﬁt(self, others):
        return sum(self.target for self in others)
"""


BATCHNORM = """
@DECORATE
class BatchNorm:
    def __init__(self, n, momentum=0.9):
        self.scale = jnp.ones(n)
        self.bias = jnp.zeros(n)
        self.mean = jnp.zeros(n)
        self.var = jnp.ones(n)
        self.momentum = momentum
        self.training = True

    def train(self):
        self.training = True
        return self

    def eval(self):
        self.training = False
        return self

    def __call__(self, x):
        if self.training:
            mu = x.mean(0)
            var = x.var(0)
            self.mean = self.momentum * self.mean + (1 - self.momentum) * mu
            self.var = self.momentum * self.var + (1 - self.momentum) * var
        else:
            mu, var = self.mean, self.var
        return (x - mu) / jnp.sqrt(var + 1e-5) * self.scale + self.bias
"""


XB = jnp.arange(12.0).reshape(4, 3)


EMA = """
@DECORATE
class EMA:
    def __init__(self, decay=0.5):
        self.w = jnp.array([1.0, 2.0])
        self.ema = jnp.array([1.0, 2.0])
        self.decay = decay
        self.steps = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        y = jnp.dot(self.w, x)
        self.ema = self.decay * self.ema + (1 - self.decay) * self.w * x
        self.steps += 1
        return y + jnp.dot(self.ema, x)
"""


XS = jnp.arange(1.0, 5.0)


SYNTAX_FORMS = """
@DECORATE
class C:
    def __init__(self):
        self.x = jnp.zeros(3)
        self.a = jnp.zeros(())
        self.b = jnp.ones(())
        self.t = (jnp.zeros(()),)
        self.lst = [jnp.zeros(())]
        self.d = {"k": jnp.zeros(2)}
        self.i = jnp.zeros((), jnp.int32)
        self.rest = [jnp.zeros(())]

    def read_after_write(self, v):
        self.a = self.a + v
        y = self.a * 2
        self.a = y + self.a
        return y, self.a

    def aug_containers(self, v):
        self.t += (v,)
        self.lst += [v * 2]
        self.d |= {"j": v * jnp.ones(2)}
        return sum(self.t), sum(self.lst), self.d["j"]


    def setattr_dynamic(self, v):
        for name in ("a", "b"):
            setattr(self, name, getattr(self, name) + v)
        return self.a + self.b

    def for_target(self):
        total = jnp.zeros(())
        for self.a in jnp.arange(3.0):
            total = total + self.a
        return total

    def for_int_target(self):
        for self.i in jnp.arange(4, dtype=jnp.int32):
            pass
        return self.i

    def chained(self, v):
        self.a = self.b = v * 3
        self.a, self.b = self.b, self.a + 1
        return self.a - self.b

    def star(self, v):
        self.a, *self.rest = [v, v + 1, v + 2]
        return self.rest

    def annotated(self, v):
        self.a: jax.Array = v + 1
        return self.a

    def with_target(self, v):
        import contextlib
        with contextlib.nullcontext(v * 5) as self.b:
            inner = self.b
        return inner

    def comprehension(self, v):
        self.a = sum(self.x[i] * v for i in range(3))
        self.lst = [self.a + j for j in range(2)]
        return [self.b * k for k in range(2)]

    def lambdas(self, v):
        def bump():
            self.a += v
        bump()
        bump()
        get = lambda: self.a  # noqa: E731
        return get()

    def delete_item(self):
        self.d["tmp"] = jnp.ones(2)
        del self.d["tmp"]
        return self.d

    def fstring_len(self, v):
        self.a = self.a + v
        return jnp.float32(len(f"{self.a=}") > 0) + self.a

    def walrus(self, v):
        self.a = (y := self.a + v) * 2
        return y

    def pow_and_matmul(self, v):
        self.x **= 2
        self.x += v
        self.b //= 2.0
        self.b -= 1
        self.b *= -3
        self.b /= 2
        self.b %= 5.0
        return self.x
"""


MISC = """
def helper(model, x):
    model.n = model.n + x
    return model.n * 2


@DECORATE
class Leaf:
    def __init__(self, k=1.0):
        self.n = jnp.zeros(())
        self.k = jnp.asarray(k)

    def step(self, c, x):
        self.n = self.n + x * self.k
        return c + self.n, self.n

    def __call__(self, x):
        self.n = self.n + x
        return self.n * self.k


@DECORATE
class Misc:
    def __init__(self):
        self.n = jnp.zeros(())
        self.leaf = Leaf(2.0)
        self.leaves = {"a": Leaf(3.0)}
        self.opt = None
        self.scale = 1.5

    def make_inc(self):
        def inc(v):
            self.n += v
            return self.n
        return inc

    def use_closure(self, v):
        inc = self.make_inc()
        inc(v)
        return inc(v)

    def helper_in_scan(self, xs):
        return lax.scan(lambda c, x: (c + helper(self, x) + helper(self.leaf, x), None),
                        jnp.zeros(()), xs)[0]

    def sub_bound_scan(self, xs):
        return lax.scan(self.leaf.step, jnp.zeros(()), xs)

    def fori_sub_models(self, k):
        def body(i, c):
            return c + self.leaf(k) + self.leaves["a"](c)
        return lax.fori_loop(0, 3, body, jnp.zeros(()))

    def copies(self, v):
        twin = copy.copy(self.leaf)
        twin(v)
        deep = copy.deepcopy(self.leaves)
        deep["a"](v)
        return twin.n + deep["a"].n, self.leaf.n

    def values_gen(self, v):
        gen = (self.n * i for i in range(3))
        self.n = self.n + v
        return list(gen)

    def fluent(self, v):
        self.n += v
        return self

    def partial_write(self, v):
        self.n = self.n + v
        raise ValueError("boom")

    def float_state(self, v):
        self.scale = self.scale * 2
        return v * self.scale

    def swap_none(self, v):
        self.opt = v
        return self.opt
"""


STRUCT = """
@DECORATE
class Child:
    def __init__(self, parent=None):
        self.parent = parent
        self.n = jnp.zeros(())

    def __call__(self, x):
        self.n = self.n + x
        if self.parent is not None:
            self.parent.total = self.parent.total + x
        return self.n


@DECORATE
class Parent:
    def __init__(self):
        self.total = jnp.zeros(())
        self.kids = [Child(self), Child(self)]

    def __call__(self, x):
        return self.kids[0](x) + self.kids[1](2 * x) + self.total


class Hook:
    def __init__(self, owner):
        self.owner = owner

    def fire(self, x):
        self.owner.hits = self.owner.hits + x


@DECORATE
class Hooked:
    def __init__(self):
        self.hits = jnp.zeros(())
        self.hook = Hook(self)

    def __call__(self, x):
        self.hook.fire(x)
        self.hits = self.hits * 2
        return self.hits


@DECORATE
class Eq:
    def __init__(self, v):
        self.v = jnp.asarray(v)
        self.n = jnp.zeros(())

    def __eq__(self, other):
        return self.v == other.v

    __hash__ = None

    def __call__(self, x):
        self.n = self.n + x * self.v
        return self.n


@DECORATE
class EqNet:
    def __init__(self):
        self.a = Eq(1.0)
        self.b = Eq(1.0)

    def __call__(self, x):
        return self.a(x) + self.b(x)


@DECORATE
class Heads:
    def __init__(self):
        self.heads = {"a": Child()}

    def add(self, name):
        self.heads[name] = Child()

    def __call__(self, x):
        return sum(h(x) for h in self.heads.values())


@DECORATE
class Private:
    def __init__(self):
        self.__count = jnp.zeros(())

    def bump(me, x):
        me.__count += x
        return me.__count


@DECORATE
class PrivateChild(Private):
    def __init__(self):
        super().__init__()
        self.__count = jnp.ones(())

    def bump(self, x):
        self.__count = self.__count * 3
        return super().bump(x) + self.__count
"""


TRANSFORMS_INSIDE = """
import jax.lax as L
from jax.lax import scan as my_scan

if type(lax).__name__ == "_PyLax":  # the plain reference: Python loops
    L = lax
    my_scan = lax.scan


@DECORATE
class T:
    def __init__(self):
        self.n = jnp.zeros(())
        self.w = jnp.array([1.0, 2.0])

    def vmap_reads(self, xs):
        return jax.vmap(lambda x: x * self.w + self.n)(xs)

    def grad_reads(self, x):
        self.n = self.n + 1
        return jax.grad(lambda v: jnp.sum(jnp.sin(v * self.w)) * self.n)(x)

    def alias_scan(self, xs):
        def body(c, x):
            self.n = self.n + x
            return c, self.n
        a = L.scan(body, 0.0, xs)[1]
        b = my_scan(body, 0.0, xs, reverse=True)[1]
        return a, b

    def scan_length(self, k):
        def body(c, _):
            self.n = self.n + k
            return c + self.n, None
        return lax.scan(body, jnp.zeros(()), None, length=3)[0]

    def vmap_writes(self, xs):
        def one(x):
            self.n = self.n + x
            return x
        return jax.vmap(one)(xs)

    def grad_writes(self, x):
        def loss(v):
            self.n = v * 2
            return v ** 2
        return jax.grad(loss)(x)

    def jit_bound(self, x):
        return jax.jit(self.bump)(x)

    def bump(self, x):
        self.n = self.n + x
        return self.n

    def dynamic_scan(self, xs):
        def body(c, x):
            self.n = self.n + x
            return c, None
        getattr(jax.lax, "scan")(body, 0.0, xs)
        return self.n

    def gen(self, k):
        for i in range(k):
            yield self.bump(float(i))
"""


LAST = """
@DECORATE
class Loop:
    def __init__(self):
        self.i = jnp.zeros((), jnp.int32)
        self.acc = jnp.zeros(())
        self.w = jnp.full((2,), 2.0)

    def py_range(self):
        for self.i in range(3):
            self.acc = self.acc + self.i
        return self.acc

    @functools.cached_property
    def doubled(self):
        return self.w * 2

    def __call__(self, x):
        self.acc = self.acc + x
        return self.doubled * self.acc
"""


KEY = jax.random.PRNGKey(0)


LIBRARY = """
@BASEDEC
class Module:
    buffers = ()

    def __init__(self):
        self.training = True

    def children(self):
        out = []
        for v in vars(self).values():
            if isinstance(v, Module):
                out.append(v)
            elif isinstance(v, (list, tuple)):
                out.extend(c for c in v if isinstance(c, Module))
            elif isinstance(v, dict):
                out.extend(c for c in v.values() if isinstance(c, Module))
        return out

    def modules(self):
        found = [self]
        for c in self.children():
            found.extend(c.modules())
        return found

    def train(self, mode=True):
        self.training = mode
        for c in self.children():
            c.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def parameters(self):
        ps = []
        for m in self.modules():
            for name, v in vars(m).items():
                if (isinstance(v, jax.Array) and jnp.issubdtype(v.dtype, jnp.floating)
                        and name not in m.buffers):
                    ps.append(v)
        return ps

    def num_params(self):
        return sum(int(p.size) for p in self.parameters())

    def l2(self):
        return sum(jnp.sum(p ** 2) for p in self.parameters())

    def regularized(self, x, y):
        return jnp.mean((self(x) - y) ** 2) + 1e-2 * self.l2()

    def __repr__(self):
        inner = ", ".join(repr(c) for c in self.children())
        return f"{type(self).__name__}({inner})"


@DECORATE
class Linear(Module):
    def __init__(self, key, n_in, n_out, bias=True):
        super().__init__()
        k1, k2 = jax.random.split(key)
        self.w = jax.random.normal(k1, (n_in, n_out)) / np.sqrt(n_in)
        self.b = jax.random.normal(k2, (n_out,)) * 0.1 if bias else None

    def __call__(self, x):
        y = x @ self.w
        return y if self.b is None else y + self.b


@DECORATE
class BatchNorm(Module):
    momentum = 0.9
    eps = 1e-5
    buffers = ("mean", "var")

    def __init__(self, n):
        super().__init__()
        self.scale = jnp.ones(n)
        self.shift = jnp.zeros(n)
        self.mean = jnp.zeros(n)
        self.var = jnp.ones(n)
        self.count = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        if self.training:
            m, v = x.mean(0), x.var(0)
            self.mean = self.momentum * self.mean + (1 - self.momentum) * m
            self.var = self.momentum * self.var + (1 - self.momentum) * v
            self.count += 1
        else:
            m, v = self.mean, self.var
        return (x - m) / jnp.sqrt(v + self.eps) * self.scale + self.shift


@DECORATE
class Dropout(Module):
    def __init__(self, rate, key):
        super().__init__()
        self.rate = rate
        self.key = key

    def __call__(self, x):
        if not self.training or self.rate == 0:
            return x
        self.key, sub = jax.random.split(self.key)
        keep = jax.random.bernoulli(sub, 1 - self.rate, x.shape)
        return jnp.where(keep, x / (1 - self.rate), 0.0)


@DECORATE
class ReLU(Module):
    def __call__(self, x):
        return jax.nn.relu(x)


@DECORATE
class ModuleList(Module):
    def __init__(self, mods=()):
        super().__init__()
        self.mods = list(mods)

    def __getitem__(self, i):
        return self.mods[i]

    def __len__(self):
        return len(self.mods)

    def __iter__(self):
        return iter(self.mods)


@DECORATE
class Sequential(ModuleList):
    def __call__(self, x):
        for m in self:
            x = m(x)
        return x


class StepCounterMixin:
    def tick(self):
        self.steps = self.steps + 1
        return self.steps


@DECORATE
class MLP(StepCounterMixin, Module):
    hidden = 8

    def __init__(self, key, n_in, n_out, rate=0.0):
        super().__init__()
        k1, k2, k3 = jax.random.split(key, 3)
        self.body = Sequential(
            [Linear(k1, n_in, self.hidden), BatchNorm(self.hidden), ReLU(), Dropout(rate, k3)]
        )
        self.head = Linear(k2, self.hidden, n_out)
        self.steps = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.tick()
        return self.head(self.body(x))

    @classmethod
    def from_config(cls, cfg):
        return cls(jax.random.PRNGKey(cfg["seed"]), cfg["n_in"], cfg["n_out"], cfg.get("rate", 0.0))

    @staticmethod
    def default():
        return MLP.from_config(CFG)


CFG = {"seed": 0, "n_in": 3, "n_out": 2, "rate": 0.25}
SmallMLP = functools.partial(MLP, n_in=3, n_out=2)


@DECORATE
class ResidualMLP(MLP):
    hidden = 6

    def __init__(self, key, n, **kw):
        super().__init__(key, n, n, **kw)
        self.gate = jnp.asarray(0.5)

    def __call__(self, x):
        return x + self.gate * super().__call__(x)


@DECORATE
class TrackedResidual(ResidualMLP):
    def __init__(self, key, n):
        super().__init__(key, n, rate=0.5)
        self.out_mean = jnp.zeros(n)

    def __call__(self, x):
        y = super().__call__(x)
        self.out_mean = 0.5 * self.out_mean + 0.5 * y.mean(0)
        return y


@DECORATE
class Head(Module, abc.ABC):
    def __init__(self):
        super().__init__()
        self.seen = jnp.zeros((), jnp.int32)

    @abc.abstractmethod
    def score(self, h):
        ...

    def __call__(self, h):
        self.seen = self.seen + h.shape[0]
        return self.score(h)


@DECORATE
class LinearHead(Head):
    def __init__(self, key, n, k):
        super().__init__()
        self.proj = Linear(key, n, k)

    def score(self, h):
        return self.proj(h)


@DECORATE
class MultiHead(Module):
    def __init__(self, key, n_in):
        super().__init__()
        k1, k2, k3 = jax.random.split(key, 3)
        self.trunk = MLP(k1, n_in, 4)
        self.heads = {"a": LinearHead(k2, 4, 2), "b": LinearHead(k3, 4, 1)}
        self.pair = (ReLU(), BatchNorm(4))

    def __call__(self, x):
        h = self.pair[1](self.pair[0](self.trunk(x)))
        return self.heads["a"](h).sum(-1) + self.heads["b"](h)[:, 0]


def make_model(kind, key):
    table = {"mlp": lambda k: MLP(k, 3, 3), "res": lambda k: ResidualMLP(k, 3),
             "tracked": lambda k: TrackedResidual(k, 3)}
    return table[kind](key)
"""


BUILDS = {
    "mlp": ("MLP(KEY, 3, 2)", 2),
    "mlp_dropout": ("MLP(KEY, 3, 2, rate=0.5)", 2),
    "from_config": ("MLP.from_config(CFG)", 2),
    "default": ("MLP.default()", 2),
    "partial": ("SmallMLP(KEY, rate=0.25)", 2),
    "residual": ("ResidualMLP(KEY, 3)", 3),
    "tracked": ("TrackedResidual(KEY, 3)", 3),
    "factory": ("make_model('tracked', KEY)", 3),
    "multihead": ("MultiHead(KEY, 3)", None),
}


TRAINER = LIBRARY.replace("@BASEDEC\n", "@DECORATE\n") + """

@DECORATE
class MomentumState:
    def __init__(self, params, lr=0.05, beta=0.9):
        self.lr = lr
        self.beta = beta
        self.mu = jax.tree_util.tree_map(jnp.zeros_like, params)
        self.t = jnp.zeros((), jnp.int32)

    def update(self, params, grads):
        self.t += 1
        self.mu = jax.tree_util.tree_map(lambda m, g: self.beta * m + g, self.mu, grads)
        return jax.tree_util.tree_map(lambda p, m: p - self.lr * m, params, self.mu)


def mse(out, y):
    return jnp.mean((out - y) ** 2)


@DECORATE
class FTrainer:
    def __init__(self, model):
        self.f, self.states = model.functionalize()
        self.opt = MomentumState(self.f)
        self.loss = jnp.zeros(())

    def train_step(self, x, y):
        def loss_fn(f, states):
            out, states = f(states, x)
            return mse(out, y), states

        (self.loss, self.states), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            self.f, self.states)
        self.f = self.opt.update(self.f, grads)
        return self.loss

    def fit(self, xs, ys):
        def body(carry, batch):
            return carry + 1, self.train_step(*batch)

        _, losses = lax.scan(body, 0, (xs, ys))
        return losses


@DECORATE
class ModelTrainer:
    def __init__(self, model):
        self.model = model
        self.opt = MomentumState(model.functionalize()[0])
        self.loss = jnp.zeros(())

    def train_step(self, x, y):
        f, states = self.model.functionalize()

        def loss_fn(f):
            out, new = f(states, x)
            return mse(out, y), new

        (self.loss, states), grads = jax.value_and_grad(loss_fn, has_aux=True)(f)
        self.model = autostate.freeze(self.opt.update(f, grads), states)
        return self.loss
"""


MULTI = LIBRARY.replace("@BASEDEC\n", "@DECORATE\n") + """

@DECORATE
class Classifier(Module):
    def __init__(self, key, keep_backbone=True):
        super().__init__()
        k1, k2 = jax.random.split(key)
        backbone = MLP(k1, 3, 2)
        if keep_backbone:
            self.backbone = backbone
        self.features = backbone.__call__
        self.head = Linear(k2, 2, 1)

    def __call__(self, x):
        return self.head(self.features(x))[:, 0]


@DECORATE
class Siamese(Module):
    def __init__(self, key):
        super().__init__()
        enc = MLP(key, 3, 2)
        self.left = enc
        self.right = enc
        self.scale = jnp.ones(())

    def __call__(self, x):
        return (self.left(x) * self.right(x[::-1])).sum(-1) * self.scale


@DECORATE
class Teacher(Module):
    def __init__(self, key):
        super().__init__()
        self.net = MLP(key, 3, 2)
        self.calls = jnp.zeros((), jnp.int32)

    def distill(self, student, x):
        self.calls += 1
        t = self.net(x)
        s = student(x)
        return jnp.mean((t - s) ** 2)


@DECORATE
class Both(Module):
    def __init__(self, key):
        super().__init__()
        k1, k2 = jax.random.split(key)
        self.teacher = Teacher(k1)
        self.student = MLP(k2, 3, 2, rate=0.5)

    def __call__(self, x):
        return self.teacher.distill(self.student, x)
"""


HOST = """
@DECORATE_HOST
class Stats:
    def __init__(self, d):
        self.mean = jnp.zeros(d)
        self.var = jnp.ones(d)
        self.count = jnp.zeros((), jnp.int32)
        self.seen = jnp.array(False)

    def __call__(self, x):
        m = 0.1
        self.mean = (1 - m) * self.mean + m * x.mean(0)
        self.var = (1 - m) * self.var + m * x.var(0)
        self.count = self.count + 1
        self.seen = self.seen | (x.sum() > 0)
        return (x - self.mean) / jnp.sqrt(self.var + 1e-5)


@DECORATE_HOST
class Noise:
    def __init__(self, seed):
        self.key = jax.random.key(seed)

    def __call__(self, x):
        self.key, sub = jax.random.split(self.key)
        return x + jax.random.normal(sub, x.shape)


@DECORATE_HOST
class RawNoise:
    def __init__(self, seed):
        self.key = jax.random.PRNGKey(seed)

    def __call__(self, x):
        self.key, sub = jax.random.split(self.key)
        return x + jax.random.uniform(sub, x.shape)


@DECORATE_HOST
class Ema:
    def __init__(self):
        self.acc = jnp.ones(())
        self.total = jnp.zeros(())

    def __call__(self, x):
        y = self.acc * x
        self.acc = self.acc * 0.5 + x
        self.total = self.total + y
        return y + self.total


@DECORATE_HOST
class Cache:
    def __init__(self, n):
        self.buf = {"k": jnp.zeros((n, 2)), "pos": jnp.zeros((), jnp.int32)}

    def __call__(self, x):
        pos = self.buf["pos"]
        self.buf = {"k": self.buf["k"].at[pos].set(x), "pos": pos + 1}
        return self.buf["k"].sum(0)


@DECORATE_HOST
class Looper:
    def __init__(self):
        self.total = jnp.zeros(())
        self.hits = jnp.zeros((), jnp.int32)

    def scanned(self, xs):
        def body(c, x):
            self.total = self.total + x
            return c + self.total, self.total * 2
        return lax.scan(body, jnp.zeros(()), xs)

    def branched(self, x):
        def yes(v):
            self.hits = self.hits + 1
            return v * 3
        def no(v):
            self.total = self.total - v
            return v
        return lax.cond(x > 0, yes, no, x)

    def until(self, limit):
        def cond(c):
            return self.total < limit
        def body(c):
            self.total = self.total + 1.5
            self.hits = self.hits + 1
            return c + 1
        return lax.while_loop(cond, body, 0)


@DECORATE_HOST
class Gate:
    def __init__(self):
        self.opened = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        def open_(v):
            self.opened = self.opened + 1
            return v * 2
        return lax.cond(x.sum() > 0, open_, lambda v: v, x)


@DECORATE
class Net:
    def __init__(self):
        self.stats = Stats(2)
        self.w = jnp.full(2, 0.5)
        self.steps = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.steps = self.steps + 1
        return self.stats(x) * self.w


@DECORATE_HOST
class HostOfFunctional:
    def __init__(self):
        self.inner = Inner()
        self.total = jnp.zeros(())

    def __call__(self, x):
        y = self.inner(x)
        self.total = self.total + y
        return self.total


@DECORATE
class Inner:
    def __init__(self):
        self.acc = jnp.ones(())

    def __call__(self, x):
        self.acc = self.acc * 0.5 + x
        return self.acc
"""


XS_PAIRS = jnp.array([[1.0, 2.0], [3.0, -1.0], [0.5, 0.25]])


CONST_DEF = """
CONST = autostate.constant if STATE is autostate.state else (lambda v, **kw: v)
"""


PACK = CONST_DEF + """
@DECORATE
class Mixed:
    def __init__(self, seed):
        k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
        self.w = jax.random.normal(k1, (3, 3))
        self.b = jnp.full(3, 0.1)                         # weak-typed f32
        self.h = jax.random.normal(k2, (3,)).astype(jnp.bfloat16)
        self.table = CONST(jnp.arange(3.0))
        self.ids = jnp.array([2, 0, 1], jnp.int32)       # int: a constant without the marker
        self.mask = jnp.array([True, False, True])
        self.key = jax.random.key(seed)                   # typed key state
        self.raw = jax.random.PRNGKey(seed + 7)           # uint32 key state
        self.steps = jnp.zeros((), jnp.int32)
        self.flag = jnp.array(False)
        self.mean = jnp.zeros(3)
        self.hb = jnp.zeros(3, jnp.bfloat16)

    def __call__(self, x):
        self.key, sub = jax.random.split(self.key)
        self.raw, sub2 = jax.random.split(self.raw)
        noise = jax.random.normal(sub, (3,)) * 0.01 + jax.random.uniform(sub2, (3,)) * 0.01
        y = jnp.tanh(x @ self.w + self.b + self.table[self.ids] * 0.1 + noise)
        y = jnp.where(self.mask, y, -y)
        self.hb = (y * 4.0).astype(jnp.bfloat16)
        self.steps += 1
        self.flag = self.flag | (y.sum() > 0)
        self.mean = 0.9 * self.mean + 0.1 * y
        return (y * self.h.astype(jnp.float32)).sum() + self.hb.astype(jnp.float32).sum() + self.steps

    def peek(self, scale):
        return self.mean * scale + self.steps
"""


PACK_XS = [jnp.ones(3), jnp.arange(3.0), -jnp.ones(3)]


CATS = CONST_DEF + """
@DECORATE
class Decoder:
    def __init__(self):
        self.kv = STATE(jnp.zeros(3), category="cache", name="kv")
        self.pos = STATE(jnp.zeros((), jnp.int32), category="cache")
        self.steps = jnp.zeros((), jnp.int32)          # category "state"
        self.table = CONST(jnp.arange(3.0))
        self.w = jnp.full(3, 0.5)

    def __call__(self, x):
        self.kv = self.kv.at[self.pos % 3].set(x)
        self.pos += 1
        self.steps += 1
        return (self.kv * self.w + self.table).sum()

    def decode(self, x):
        self.kv = self.kv * 0.5 + x
        self.pos += 1
        return self.kv.sum()

    def retable(self):
        self.table = self.table + 1.0
        return self.table.sum()


@DECORATE
class Two:
    def __init__(self):
        self.a = Decoder()
        self.b = self.a            # one instance, two paths: one set of states

    def __call__(self, x):
        return self.a(x) + self.b(x * 2)
"""


TWO = jnp.float32(2.0)


POSITIVE_CALLS = [("__call__", (X1,)), ("__call__", (TWO,))]


SIGNATURES = """
@DECORATE
class Sig:
    def __init__(self):
        self.c = jnp.zeros(())
    def __call__(self, x, /, y=1.0, *args, scale, **kw):
        self.c = self.c + (x + y + sum(args)) * scale + sum(kw.values())
        return self.c
    def step(self, x, /, *, states=0.0):
        self.c = self.c * 2 + x + states
        return self.c
"""


CLASS_ATTRS = """
@DECORATE
class ClassAttrs:
    c = 5
    w = jnp.ones(())
    def __init__(self):
        self.w = jnp.zeros(())
    def __call__(self, x):
        self.w = self.w + x
        return self.w + self.c
    def count(self):
        self.c = self.c + 1  # HERE
        return self.c, type(self).c, ClassAttrs.c

@DECORATE
class ArrayDefault:
    c = jnp.zeros(())
    def __call__(self, x):
        self.c = self.c + x
        return self.c
    def cls_c(self):
        return ArrayDefault.c
"""


RUNTIME = (
    "\n@DECORATE\nclass Tabs:\n"
    "\tdef __init__(self):\n\t\tself.c = jnp.zeros(())\n\t\tself.mode = 'train'\n"
    "\tbump = lambda self, x: setattr(self, 'c', self.c + x)  # LAMBDA\n"
    "\tdef __call__(self, x): self.c = self.c + x; return self.c  # ONELINER\n"
    "\tdef eval(self):\n\t\tself.mode = 'eval'  # STATIC\n"
    "\tpoke = staticmethod(lambda m, x: setattr(m, 'c', m.c * x))  # STATICMETHOD\n"
)


XS3 = jnp.arange(1.0, 4.0)


Phase = tuple[str, list[tuple[str, tuple[Any, ...]]]]


KINDS = """
class Pt(typing.NamedTuple):
    a: typing.Any
    b: typing.Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Moments:
    m: typing.Any
    n: typing.Any


@DECORATE
class Kinds:
    def __init__(self):
        self.fl = 0.5
        self.cx = 1 + 1j
        self.wf = jnp.asarray(0.0)
        self.wi = jnp.asarray(0)
        self.i2f = jnp.zeros((), jnp.int32)
        self.bf = jnp.zeros(2, jnp.bfloat16)
        self.h = jnp.zeros(2, jnp.float16)
        self.c64 = jnp.ones(2, jnp.complex64)
        self.u8 = jnp.zeros(3, jnp.uint8)
        self.mask = jnp.zeros(3, bool)
        self.zero = jnp.zeros((0, 2))
        self.d0 = jnp.float32(0)
        self.key = jax.random.key(0)
        self.raw = jax.random.PRNGKey(1)
        self.pt = Pt(jnp.zeros(2), jnp.zeros((), jnp.int32))
        self.mom = Moments(jnp.zeros(2), jnp.zeros((), jnp.int32))
        self.nested = {"a": [jnp.zeros(1), (jnp.ones(()), {"z": jnp.zeros((), jnp.uint8)})]}
        self.w = jnp.ones(2)

    def step(self, x):
        self.fl = self.fl * 0.5 + 1.0
        self.cx = self.cx * 1j
        self.wf = self.wf + 1
        self.wi = self.wi + 1
        self.i2f = self.i2f + 0.5
        self.bf = self.bf + 0.25
        self.h += 1.5
        self.c64 = self.c64 * 1j + x
        self.u8 = self.u8 + 100
        self.mask = self.mask | (jnp.arange(3) < x)
        self.zero = self.zero * x
        self.d0 = self.d0 + x
        self.key, k = jax.random.split(self.key)
        self.raw, k2 = jax.random.split(self.raw)
        self.pt = self.pt._replace(a=self.pt.a + x, b=self.pt.b + 1)
        self.mom = Moments(self.mom.m * 0.5 + x, self.mom.n + 1)
        inner = self.nested["a"][1]
        self.nested = {"a": [self.nested["a"][0] + x, (inner[0] * 2, {"z": inner[1]["z"] + 1})]}
        return (
            jax.random.bits(k) ^ jax.random.bits(k2),
            self.fl * self.w,
            self.wf + self.wi,
            self.bf.sum(),
            self.u8,
        )

    def weak_only(self):
        self.wf = self.wf * 2
        self.wi = self.wi * 3
        self.fl = self.fl + 2.0
        return self.wf + self.fl, self.wi + 1
"""


STATIC = """
class Mode(enum.Enum):
    A = 1
    B = 2


@DECORATE
class Block:
    def __init__(self, act="relu", scale=2.0):
        self.act = act
        self.scale = scale
        self.training = True
        self.mode = Mode.A
        self.n = 0
        self.cache = None
        self.w = jnp.ones(2)
        self.s = jnp.zeros(2)

    def __call__(self, x):
        self.s = self.s + x
        y = self.s * self.w * self.scale
        y = jnp.maximum(y, 0.0) if self.act == "relu" else jnp.tanh(y)
        y = y if self.training else -y
        y = y * (3.0 if self.mode is Mode.A else 5.0) + self.n
        return y if self.cache is None else y + self.cache

    def eval(self):
        self.training = False

    def train(self):
        self.training = True

    def set_mode(self, m):
        self.mode = m

    def bump(self):
        self.n += 1

    def remember(self, v):
        self.cache = v

    def forget(self):
        self.cache = None


@DECORATE
class Stack:
    def __init__(self):
        self.blocks = [Block("relu", 2.0), Block("tanh", 0.5), Block("relu", 1.0)]
        self.blocks[1].eval()
        self.blocks[2].set_mode(Mode.B)
        self.blocks[2].bump()
        self.steps = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.steps += 1
        for b in self.blocks:
            x = b(x)
        return x
"""


CHANGES = """
@DECORATE
class Changing:
    def __init__(self):
        self.n = jnp.zeros((), jnp.int32)
        self.buf = jnp.zeros((0, 2))
        self.hist = ()
        self.log = []
        self.seen = {}
        self.kv = jnp.zeros(2)
        self.lo = jnp.zeros(2, jnp.bfloat16)

    def promote(self, x):
        self.n = self.n + 0.5
        return self.n * x

    def demote(self):
        self.n = self.n.astype(jnp.int32)
        return self.n

    def to_bool(self):
        self.n = self.n > 0
        return self.n

    def widen(self, x):
        self.lo = self.lo + x
        return self.lo

    def narrow(self):
        self.lo = self.lo.astype(jnp.bfloat16)
        return self.lo

    def push(self, x):
        self.buf = jnp.concatenate([self.buf, jnp.stack([x, -x])[None]])
        self.hist = self.hist + (x,)
        self.log = self.log + [x * 2]
        self.seen = {**self.seen, f"k{len(self.seen)}": x}
        return self.buf.sum(0), len(self.hist)

    def drop(self):
        self.buf = self.buf[1:]
        self.hist = self.hist[1:]
        self.log = self.log[:-1]
        return self.buf.shape[0]

    def clear_kv(self):
        self.kv = None

    def fill_kv(self, x):
        self.kv = (jnp.zeros(2) if self.kv is None else self.kv) + x
        return self.kv
"""


OVER = """
@DECORATE
class Noisy:
    def __init__(self, seed=0):
        self.key = jax.random.key(seed)
        self.raw = jax.random.PRNGKey(seed + 7)
        self.fl = 0.5
        self.wi = jnp.asarray(0)
        self.bf = jnp.zeros(2, jnp.bfloat16)
        self.u8 = jnp.zeros(2, jnp.uint8)
        self.h = jnp.zeros((), jnp.float16)
        self.w = jnp.array([1.0, -2.0])

    def __call__(self, x):
        self.key, k = jax.random.split(self.key)
        self.raw, k2 = jax.random.split(self.raw)
        self.fl = self.fl * 0.5 + 1.0
        self.wi = self.wi + 1
        self.bf = self.bf + x.astype(jnp.bfloat16)
        self.u8 = self.u8 + 100
        self.h = self.h + 0.25
        noise = jax.random.uniform(k, (2,)) + jax.random.uniform(k2, (2,))
        return (x * self.w + noise) * self.fl + self.wi
"""


FLOW = """
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Moments:
    m: typing.Any
    n: typing.Any


@DECORATE
class Flow:
    def __init__(self):
        self.fl = 0.0
        self.wf = jnp.asarray(0.0)
        self.wi = jnp.asarray(0)
        self.u8 = jnp.zeros(2, jnp.uint8)
        self.mask = jnp.zeros(3, bool)
        self.zero = jnp.zeros((0, 2))
        self.c64 = jnp.ones((), jnp.complex64)
        self.key = jax.random.key(0)
        self.mom = Moments(jnp.zeros(2), jnp.zeros((), jnp.int32))
        self.bf = jnp.zeros((), jnp.bfloat16)
        self.cache = None

    def cond_py_float(self, x):
        def yes(v):
            self.fl = self.fl + v
            return v
        def no(v):
            return -v
        return lax.cond(x > 0, yes, no, x)

    def cond_weak(self, x):
        def yes(v):
            self.wf = self.wf + 1
            self.wi = self.wi + 2
            return v
        return lax.cond(x > 0, yes, lambda v: v * 2, x)

    def scan_weak_to_strong(self, xs):
        def body(c, x):
            self.wf = self.wf + x
            self.wi = self.wi + 1
            return c, self.wf
        return lax.scan(body, 0.0, xs)[1]

    def fori_wrap(self, n):
        def body(i, c):
            self.u8 = self.u8 + jnp.uint8(100)
            return c + 1
        lax.fori_loop(0, n, body, 0)
        return self.u8

    def while_mask(self, x):
        def cond(i):
            return i < 3
        def body(i):
            self.mask = self.mask.at[i].set(x > i)
            return i + 1
        lax.while_loop(cond, body, 0)
        return self.mask

    def scan_zero_and_complex(self, xs):
        def body(c, x):
            self.zero = self.zero * x
            self.c64 = self.c64 * 1j
            return c, self.zero.sum() + x
        return lax.scan(body, 0.0, xs)[1]

    def cond_key(self, x):
        def yes(v):
            self.key, k = jax.random.split(self.key)
            return v + jax.random.uniform(k)
        return lax.cond(x > 0, yes, lambda v: v, x)

    def scan_dataclass(self, xs):
        def body(c, x):
            self.mom = Moments(self.mom.m * 0.5 + x, self.mom.n + 1)
            return c, self.mom.m.sum()
        return lax.scan(body, 0.0, xs)[1]

    def scan_bf16(self, xs):
        def body(c, x):
            self.bf = self.bf + 1
            self.bf += 0.5
            return c, self.bf
        return lax.scan(body, 0.0, xs)[1]

    def cond_reads_none(self, x):
        def yes(v):
            return v if self.cache is None else v * 2
        return lax.cond(x > 0, yes, lambda v: v, x)

    def scan_int_to_float(self, xs):
        def body(c, x):
            self.wi = self.wi + x  # DTYPE
            return c, x
        return lax.scan(body, 0.0, xs)[1]
"""


CLOSURES = """
@DECORATE
class Acc:
    def __init__(self):
        self.w = jnp.asarray(2.0)
        self.n = jnp.zeros(())
        self.hist = jnp.zeros(3)

    def make_bumper(self, k):
        def bump(x):
            self.n = self.n + x * k
            self.hist = jnp.roll(self.hist, 1).at[0].set(self.n)
            return self.n * self.w
        return bump

    def make_lambda(self):
        return lambda x: self._add(x)

    def _add(self, x):
        self.n = self.n + x
        return self.n

    def use_now(self, x):
        b = self.make_bumper(2.0)
        return b(x) + b(x)

    def use_lambda(self, x):
        g = self.make_lambda()
        return g(x) * g(x)

    def closures_in_list(self, x):
        fs = [self.make_bumper(k) for k in (1.0, 2.0, 3.0)]
        return jnp.stack([f(x) for f in fs])

    def closure_in_scan(self, xs):
        b = self.make_bumper(0.5)
        return lax.scan(lambda c, x: (c + b(x), None), jnp.zeros(()), xs)[0]

    def closure_as_scan_body(self, xs):
        def outer(k):
            def body(c, x):
                self.n = self.n + x * k
                return c + self.n, self.n
            return body
        return lax.scan(outer(3.0), jnp.zeros(()), xs)

    def closure_in_cond(self, x):
        up, down = self.make_bumper(1.0), self.make_bumper(-1.0)
        return lax.cond(x > 1.6, up, down, x)

    def closure_in_checkpoint(self, x):
        return checkpoint(self.make_bumper(2.0))(x) + self.n
"""


FORWARD_HOOKS = """
import collections
import functools


@DECORATE
class Layer:
    def __init__(self):
        self.w = jnp.asarray(3.0)
        self.n = jnp.zeros(())
        self.seen = jnp.zeros(())
        self.hooks = []
        self.pre = collections.OrderedDict()

    def record(self, y):
        self.seen = self.seen + y
        return None

    def __call__(self, x):
        for h in self.pre.values():
            r = h(x)
            if r is not None:
                x = r
        self.n = self.n + 1
        y = x * self.w
        for h in self.hooks:
            r = h(self, y)
            if r is not None:
                y = r
        return y


@DECORATE
class Pair:
    def __init__(self):
        self.a = Layer()
        self.b = Layer()

    def __call__(self, x):
        return self.b(self.a(x))


def count_hook(m, y):
    m.seen = m.seen + y
    return None


def scale_hook(m, y):
    m.n = m.n * 2
    return y + m.n


def with_hooks(m, *hooks):
    m.hooks.extend(hooks)
    return m


def with_bound_pre(m):
    m.pre["rec"] = m.record
    return m


def with_lambda_pre(m):
    m.pre["lam"] = lambda x: x + m.n
    return m


def with_nested_pre(m):
    def make(model):
        def hook(x):
            model.seen = model.seen + 10 * x
            return None
        return hook
    m.pre["nested"] = make(m)
    return m


def weighted_hook(k, m, y):
    m.seen = m.seen + k * y
    return None


def with_partial_hook(m):
    m.hooks.append(functools.partial(weighted_hook, 3.0))
    return m


def with_foreign_hook(m, other):
    m.hooks.append(lambda mm, y: other.record(y))
    return m


def with_partial_over_model(m):
    m.pre["p"] = functools.partial(count_hook, m)
    return m


def hook_over(model, mm, y):
    model.seen = model.seen + y
    return None


def with_partial_in_list(m):
    m.hooks.append(functools.partial(hook_over, m))
    return m


def cross_hooked():
    p = Pair()
    p.b.pre["from_a"] = p.a.record
    p.a.hooks.append(lambda m, y: p.b.record(y))
    return p
"""


ONE_SHOT = (
    FORWARD_HOOKS
    + """

def one_shot(m, y):
    m.n = m.n + 100
    m.hooks.remove(one_shot)
    return None
"""
)


DISPATCH = """
import functools
import operator


@DECORATE
class Disp:
    def __init__(self):
        self.w = jnp.asarray(2.0)
        self.n = jnp.zeros(())
        self.calls = jnp.zeros((), jnp.int32)
        self.names = {"u": "up", "d": "down"}

    def up(self, x):
        self.n = self.n + x
        return self.n

    def down(self, x):
        self.n = self.n - x
        return self.n

    def scaled(self, x, k=1.0):
        self.n = self.n * k + x
        return self.n

    TABLE = {"up": up, "down": down}
    up2 = functools.partialmethod(scaled, k=2.0)

    def via_class_table(self, x):
        return self.TABLE["up"](self, x) + self.TABLE["down"](self, x * 0.5)

    def via_partialmethod(self, x):
        return self.up2(x) * self.w

    def via_getattr(self, x):
        out = jnp.zeros(())
        for key in ("u", "d", "u"):
            out = out + getattr(self, self.names[key])(x)
        return out

    def via_methodcaller(self, x):
        return operator.methodcaller("up", x)(self) + operator.methodcaller("scaled", x, k=3.0)(self)

    def via_attrgetter(self, x):
        self.up(x)
        return operator.attrgetter("n")(self) * self.w

    def via_map(self, xs):
        return jnp.stack(list(map(self.up, xs)))

    def score(self, x):
        self.calls = self.calls + 1
        self.n = self.n + x
        return float(x)

    def via_sorted(self, x):
        vals = [x, x * 3, x * 2]
        order = sorted(vals, key=self.score)
        return jnp.stack(order) + self.n

    def via_reduce(self, xs):
        return functools.reduce(lambda a, b: a + self.up(b), list(xs), jnp.zeros(()))

    def via_tree_map(self, x):
        return jax.tree_util.tree_map(self.up, {"a": x, "b": x * 2})

    def via_partial(self, x):
        return functools.partial(self.scaled, k=0.5)(x) + functools.partial(Disp.up, self)(x)

    def scan_getattr(self, xs):
        body = getattr(self, "body_" + "up")
        return lax.scan(body, jnp.zeros(()), xs)

    def body_up(self, c, x):
        self.n = self.n + x
        return c + self.n, self.n

    BODIES = {"up": body_up}

    def scan_class_table(self, xs):
        return lax.scan(functools.partial(self.BODIES["up"], self), jnp.zeros(()), xs)

    def scan_partial(self, xs):
        def body(k, c, x):
            self.n = self.n + x * k
            return c + self.n, None
        return lax.scan(functools.partial(body, 2.0), jnp.zeros(()), xs)[0]

    def scan_methodcaller(self, xs):
        return lax.scan(lambda c, x: (c + operator.methodcaller("up", x)(self), None),
                        jnp.zeros(()), xs)[0]

    def fori_dispatch(self, x):
        return lax.fori_loop(0, 3, lambda i, c: c + getattr(self, self.names["u"])(x), jnp.zeros(()))
"""


HELPER_MODULE = """
import jax
import jax.numpy as jnp
import autostate


def bump(model, x):
    model.n = model.n + x
    model.hist = model.hist.at[0].add(x)
    return model.n


def bump_list(model, x):
    model.items += [x]
    return len(model.items)


def scan_with(scan, model, xs):
    return scan(lambda c, x: (c + bump(model, x), None), jnp.zeros(()), xs)[0]


def scan_with_jax(model, xs):
    return jax.lax.scan(lambda c, x: (c + bump(model, x), None), jnp.zeros(()), xs)[0]
"""


OUTSIDE = """
import written_helpers as H


def local_bump(model, x):
    model.n = model.n * 2 + x
    return model.n


@DECORATE
class Out:
    def __init__(self):
        self.n = jnp.zeros(())
        self.hist = jnp.zeros(2)
        self.items = [jnp.zeros(())]
        self.sub = Leaf()

    def touch(self):
        self.n = self.n
        self.hist = self.hist
        self.items = self.items

    def local(self, x):
        return local_bump(self, x) + local_bump(self.sub, x)

    def other_module(self, x):
        return H.bump(self, x) + self.n

    def other_module_list(self, x):
        return H.bump_list(self, x) + 0 * x

    def other_module_autostate_scan(self, xs):
        return H.scan_with(LAXW.scan, self, xs)

    def other_module_jax_scan(self, xs):
        return H.scan_with_jax(self, xs)

    def method_alias_append(self, x):
        lst = self.items
        lst.append(x)
        return len(self.items) + 0 * x

    def duck_typed(self, x):
        return Leaf.grow(self, x) + Leaf.grow(self.sub, x)


@DECORATE
class Leaf:
    def __init__(self):
        self.n = jnp.ones(())

    def grow(self, x):
        self.n = self.n + x * 10
        return self.n
"""


NESTED = """
import functools


@DECORATE
class Nest:
    def __init__(self):
        self.w = jnp.asarray(2.0)
        self.n = jnp.zeros(())

    def step(self, x):
        self.n = self.n + x
        return self.n * self.w

    def read(self, x):
        return self.n * x + self.w

    def block(self, x, k=1.0):
        self.n = self.n + x * k
        return jnp.sin(x) * self.w * k

    def jit_write(self, x):
        return jax.jit(self.step)(x)

    def vmap_write(self, xs):
        return jax.vmap(self.step)(xs)

    def eval_shape_write(self, x):
        return jax.eval_shape(self.step, x).shape

    def jit_read(self, x):
        self.n = self.n + 1
        return jax.jit(self.read)(x)

    def vmap_read(self, xs):
        self.n = self.n + 1
        return jax.vmap(self.read)(xs)

    def checkpoint_partial(self, x):
        return checkpoint(functools.partial(self.block, k=2.0))(x) + self.n

    def checkpoint_static(self, x):
        return checkpoint(self.block, static_argnums=(1,))(x, 3.0) + self.n

    def associative(self, xs):
        def combine(a, b):
            self.n = self.n + 1
            return a + b
        return jax.lax.associative_scan(combine, xs)

    def named(self, x):
        return jax.named_call(self.step, name="my_step")(x) + self.n

    def aliased_scan(self, xs):
        scan = lax.scan
        return scan(lambda c, x: (c + self.step(x), None), jnp.zeros(()), xs)[0]
"""


GENS = """
def ticker(model, n):
    for i in range(n):
        model.n = model.n + i
        yield model.n


class Mode:
    def __init__(self, model, scale):
        self.model, self.scale = model, scale

    def __enter__(self):
        self.old = self.model.scale
        self.model.scale = self.scale
        self.model.entered = self.model.entered + 1
        return self.model

    def __exit__(self, *exc):
        self.model.scale = self.old
        return False


@DECORATE
class Gen:
    def __init__(self):
        self.n = jnp.zeros(())
        self.scale = jnp.ones(())
        self.entered = jnp.zeros(())

    def consume(self, x):
        vals = [v * x for v in ticker(self, 3)]
        return jnp.stack(vals)

    def zipped(self, xs):
        return sum(a * b for a, b in zip(ticker(self, 3), xs))

    def mode(self, scale):
        return Mode(self, scale)

    def reset(self):
        self.scale = jnp.ones(())
        self.entered = jnp.zeros(())

    def fwd(self, x):
        self.n = self.n + x * self.scale
        return self.n

    def with_mode(self, x):
        with self.mode(x * 2):
            y = self.fwd(x)
        return y + self.fwd(x)
"""


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


MODELS = """
@DECORATE
class Counter:
    def __init__(self):
        self.count = jnp.zeros(())
        self.w = jnp.ones(2)

    def __call__(self, x):
        self.count += 1
        return x * self.w * self.count

    def reset(self):
        self.count = jnp.zeros(())

    @property
    def doubled(self):
        return self.count * 2

    @staticmethod
    def helper(x):
        return x + 1

    @classmethod
    def make(cls):
        return cls()


@DECORATE
class WithPos:
    def __init__(self):
        self.count = jnp.zeros(())
        self.pos = jnp.arange(3)  # an int array: a constant, in the states dict

    def __call__(self, x):
        self.count += 1
        return x + self.pos.sum() + self.count


@DECORATE
class Parent:
    def __init__(self):
        self.c = Counter()
        self.n = jnp.zeros(())

    def __call__(self, x):
        self.n += 1
        return self.c(x)
"""


HOST_TALLY = """
@DECORATE_HOST
class Tally:
    def __init__(self):
        self.n = jnp.zeros(())

    def __call__(self, x):
        self.n += x
        return self.n

    def rename(self):
        self.n = "abc"
"""


GPT = """
@DECORATE
class LayerNorm:
    def __init__(self, d):
        self.scale = jnp.ones(d)
        self.bias = jnp.zeros(d)

    def __call__(self, x):
        m = x.mean(-1, keepdims=True)
        v = x.var(-1, keepdims=True)
        return (x - m) / jnp.sqrt(v + 1e-5) * self.scale + self.bias


@DECORATE
class Attention:
    def __init__(self, key, d, length):
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.wq = jax.random.normal(kq, (d, d)) / np.sqrt(d)
        self.wk = jax.random.normal(kk, (d, d)) / np.sqrt(d)
        self.wv = jax.random.normal(kv, (d, d)) / np.sqrt(d)
        self.wo = jax.random.normal(ko, (d, d)) / np.sqrt(d)
        self.k = jnp.zeros((length, d))
        self.v = jnp.zeros((length, d))

    def __call__(self, x, pos):
        q = x @ self.wq
        self.k = jax.lax.dynamic_update_slice_in_dim(self.k, x @ self.wk, pos, 0)
        self.v = jax.lax.dynamic_update_slice_in_dim(self.v, x @ self.wv, pos, 0)
        qpos = pos + jnp.arange(x.shape[0])
        mask = jnp.arange(self.k.shape[0])[None, :] <= qpos[:, None]
        s = jnp.where(mask, q @ self.k.T / np.sqrt(x.shape[-1]), -1e9)
        return jax.nn.softmax(s, axis=-1) @ self.v @ self.wo

    def reset(self):
        self.k = jnp.zeros_like(self.k)
        self.v = jnp.zeros_like(self.v)


@DECORATE
class MLP:
    def __init__(self, key, d):
        k1, k2 = jax.random.split(key)
        self.w1 = jax.random.normal(k1, (d, 2 * d)) / np.sqrt(d)
        self.b1 = jnp.zeros(2 * d)
        self.w2 = jax.random.normal(k2, (2 * d, d)) / np.sqrt(2 * d)
        self.b2 = jnp.zeros(d)

    def __call__(self, x):
        return jax.nn.gelu(x @ self.w1 + self.b1) @ self.w2 + self.b2


@DECORATE
class Block:
    def __init__(self, key, d, length):
        ka, km = jax.random.split(key)
        self.ln1 = LayerNorm(d)
        self.attn = Attention(ka, d, length)
        self.ln2 = LayerNorm(d)
        self.mlp = MLP(km, d)

    def __call__(self, x, pos):
        x = x + self.attn(self.ln1(x), pos)
        return x + self.mlp(self.ln2(x))


@DECORATE
class GPT:
    def __init__(self, seed, vocab=11, d=8, length=16, n_blocks=2):
        ke, kp, kh, *kb = jax.random.split(jax.random.PRNGKey(seed), 3 + n_blocks)
        self.embed = jax.random.normal(ke, (vocab, d)) * 0.5
        self.pos_embed = jax.random.normal(kp, (length, d)) * 0.1
        self.blocks = [Block(k, d, length) for k in kb]
        self.ln_f = LayerNorm(d)
        self.head = jax.random.normal(kh, (d, vocab)) / np.sqrt(d)
        self.pos = jnp.zeros((), jnp.int32)
        self.rng = jax.random.key(seed + 100)

    def __call__(self, tokens):
        pos = self.pos
        x = self.embed[tokens] + jax.lax.dynamic_slice_in_dim(self.pos_embed, pos, tokens.shape[0])
        for block in self.blocks:
            x = block(x, pos)
        self.pos = pos + tokens.shape[0]
        return self.ln_f(x) @ self.head

    def reset(self):
        for block in self.blocks:
            block.attn.reset()
        self.pos = jnp.zeros((), jnp.int32)

    def next_token(self, tokens):
        return jnp.argmax(self(tokens)[-1]).astype(jnp.int32)

    def greedy(self, prompt, steps):
        tok = self.next_token(prompt)
        out = [tok]
        for _ in range(steps - 1):
            tok = self.next_token(tok[None])
            out.append(tok)
        return jnp.stack(out)

    def greedy_fori(self, prompt, steps):
        tok = self.next_token(prompt)
        out = jnp.zeros(steps, jnp.int32).at[0].set(tok)

        def body(i, carry):
            tok, out = carry
            tok = self.next_token(tok[None])
            return tok, out.at[i].set(tok)

        return lax.fori_loop(1, steps, body, (tok, out))[1]

    def greedy_scan(self, prompt, steps):
        first = self.next_token(prompt)

        def body(tok, _):
            nxt = self.next_token(tok[None])
            return nxt, nxt

        _, rest = lax.scan(body, first, None, length=steps - 1)
        return jnp.concatenate([first[None], rest])

    def sample_fori(self, prompt, steps, temperature):
        logits = self(prompt)[-1]
        out = jnp.zeros(steps, jnp.int32)

        def body(i, carry):
            logits, out = carry
            self.rng, sub = jax.random.split(self.rng)
            tok = jax.random.categorical(sub, logits / temperature).astype(jnp.int32)
            return self(tok[None])[-1], out.at[i].set(tok)

        return lax.fori_loop(0, steps, body, (logits, out))[1]

    def loss(self, seq):
        logits = self(seq[:-1])
        logp = jax.nn.log_softmax(logits)
        return -jnp.take_along_axis(logp, seq[1:, None], axis=1).mean()
"""


N_BLOCKS = 2


PROMPT = jnp.array([3, 4, 5], jnp.int32)


CNN = """
@DECORATE
class BatchNorm:
    def __init__(self, c, momentum=0.9):
        self.scale = jnp.ones(c)
        self.bias = jnp.zeros(c)
        self.mean = jnp.zeros(c)
        self.var = jnp.ones(c)
        self.momentum = momentum
        self.training = True

    def __call__(self, x):
        if self.training:
            m = x.mean((0, 1, 2))
            v = x.var((0, 1, 2))
            self.mean = self.momentum * self.mean + (1 - self.momentum) * m
            self.var = self.momentum * self.var + (1 - self.momentum) * v
        else:
            m, v = self.mean, self.var
        return (x - m) / jnp.sqrt(v + 1e-5) * self.scale + self.bias

    def eval(self):
        self.training = False

    def train(self):
        self.training = True


@DECORATE
class CNN:
    def __init__(self, seed, c=4, classes=3):
        k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
        self.conv = jax.random.normal(k1, (3, 3, 1, c)) * 0.3
        self.bn = BatchNorm(c)
        self.head = jax.random.normal(k2, (c, classes)) * 0.3
        self.head_b = jnp.zeros(classes)
        self.steps = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        y = jax.lax.conv_general_dilated(x, self.conv, (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        y = jax.nn.relu(self.bn(y))
        if self.bn.training:
            self.steps += 1
        return y.mean((1, 2)) @ self.head + self.head_b

    def eval(self):
        self.bn.eval()

    def train(self):
        self.bn.train()

    def loss(self, x, labels):
        logits = self(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
"""


ADAM = optax.adam(3e-2)


DROPOUT = """
@DECORATE
class Dropout:
    def __init__(self, seed, rate=0.5, typed=True):
        self.key = jax.random.key(seed) if typed else jax.random.PRNGKey(seed)
        self.rate = rate

    def __call__(self, x):
        self.key, sub = jax.random.split(self.key)
        keep = jax.random.bernoulli(sub, 1 - self.rate, x.shape)
        return jnp.where(keep, x / (1 - self.rate), 0.0)


@DECORATE
class Split3:
    def __init__(self, seed, typed=True):
        self.key = jax.random.key(seed) if typed else jax.random.PRNGKey(seed)

    def __call__(self, x):
        self.key, k1, k2 = jax.random.split(self.key, 3)
        return x * jax.random.uniform(k1, x.shape) + jax.random.normal(k2, x.shape)


@DECORATE
class FoldIn:
    def __init__(self, seed, typed=True):
        self.key = jax.random.key(seed) if typed else jax.random.PRNGKey(seed)
        self.step = jnp.zeros((), jnp.uint32)

    def __call__(self, x):
        sub = jax.random.fold_in(self.key, self.step)
        self.step += 1
        return x + jax.random.normal(sub, x.shape)


@DECORATE
class NoisyScan:
    def __init__(self, seed, typed=True):
        self.drop = Dropout(seed, 0.25, typed)
        self.w = jnp.eye(4) * 0.5

    def __call__(self, xs):
        def body(h, x):
            h = jnp.tanh(self.drop(h @ self.w + x))
            return h, h
        return lax.scan(body, jnp.zeros(4), xs)[1]


@DECORATE
class DropMLP:
    def __init__(self, seed, typed=True):
        k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
        self.w1 = jax.random.normal(k1, (4, 8)) * 0.5
        self.w2 = jax.random.normal(k2, (8, 2)) * 0.5
        self.drop = Dropout(seed + 1, 0.5, typed)

    def __call__(self, x):
        return self.drop(jax.nn.relu(x @ self.w1)) @ self.w2
"""


STACKED = """
@DECORATE
class Layer:
    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.w = jax.random.normal(k1, (3,))
        self.mean = jax.random.normal(k2, (3,)) * 10

    def __call__(self, x):
        return x * self.w - self.mean

    def update(self, x):
        self.mean = self.mean + x
        return self.mean


@DECORATE
class Stack:
    def __init__(self, n_layers):
        self.layers = jax.vmap(Layer)(jax.random.split(jax.random.PRNGKey(0), n_layers))

    def members(self, x):
        return jax.vmap(lambda layer: layer(x))(self.layers)

    def scanned(self, x):
        return lax.scan(lambda c, layer: (c, layer(x)), 0.0, self.layers)[1]

    def deep(self, x):
        return lax.scan(lambda x, layer: (layer(x), None), x, self.layers)[0]

    def write_members(self, xs):
        return jax.vmap(lambda layer, x: layer.update(x))(self.layers, xs)

    def sliced(self, x):
        outs = []
        for i in range(2):
            layer = jax.tree_util.tree_map(lambda a: a[i], self.layers)
            outs.append(layer(x))
        return jnp.stack(outs)
"""


V3 = jnp.array([0.5, 1.0, -1.0])


STACK = jnp.stack([V3, V3 * 2])


INSIDE = """
LOG = []


def _record(m):
    LOG.append(np.asarray(m))


@DECORATE
class Net:
    def __init__(self):
        self.w = jnp.array([1.0, -2.0, 0.5])
        self.mean = jnp.zeros(3)
        self.calls = jnp.zeros((), jnp.int32)

    def helper_read(self, x):
        return x * self.w + self.mean

    def block(self, x):
        self.mean = 0.5 * self.mean + x
        return jnp.sin(x * self.w) * self.mean

    def bump(self, k, x):
        self.mean = self.mean + k * x
        self.calls += 1
        return self.mean.sum()

    def step(self, k, c, x):
        self.mean = self.mean * 0.5 + k * x
        self.calls += 1
        return c + self.mean.sum(), self.mean

    def fstep(self, k, i, v):
        self.mean = self.mean + v * k
        self.calls += 1
        return v * 0.5 + i

    def below(self, v):
        return v < self.mean.sum()

    def grow(self, v):
        self.calls += 1
        self.mean = self.mean + 0.5
        return v + 1.0

    # --- nested jax.jit -----------------------------------------------------------

    def jit_lambda_after_write(self, x):
        self.mean = self.mean + x
        self.calls += 1
        return jax.jit(lambda v: self.helper_read(v))(x)

    def jit_bound_twice(self, x):
        a = jax.jit(self.helper_read)(x)
        self.mean = self.mean + 1.0
        b = jax.jit(self.helper_read)(x)
        return a + b

    def jit_result_assigned(self, x):
        new = jax.jit(lambda m, v: m * 0.5 + v)(self.mean, x)
        self.mean = new
        return new.sum()

    def jit_static_arg(self, x):
        g = jax.jit(lambda v, k: v * k + self.mean, static_argnums=1)
        self.calls += 1
        return g(x, 3)

    # --- checkpoint / remat ---------------------------------------------------------

    def ckpt_bound(self, x):
        return jax.checkpoint(self.block)(x)

    def remat_policy(self, x):
        return jax.remat(self.block, policy=jax.checkpoint_policies.everything_saveable)(x)

    def ckpt_decorated_nested(self, x):
        @jax.checkpoint
        def inner(v):
            self.calls += 1
            return self.block(v) * 2
        return inner(x)

    # --- naming and compile-time evaluation ------------------------------------------

    def named_call_read(self, x):
        self.calls += 1
        return jax.named_call(self.helper_read, name="hr")(x)

    def named_scope_nested(self, x):
        with jax.named_scope("outer"):
            self.mean = self.mean + x
            with jax.named_scope("inner"):
                self.calls += 2
                y = self.mean * self.w
        return y

    def named_scope_scan(self, xs):
        def body(c, x):
            with jax.named_scope("step"):
                self.mean = self.mean * 0.5 + x
                self.calls += 1
            return c + 1.0, self.mean.sum()
        with jax.named_scope("loop"):
            return lax.scan(body, 0.0, xs)

    def cte_read(self, x):
        self.calls += 1
        with jax.ensure_compile_time_eval():
            k = jnp.arange(3.0)
            m = self.mean * 2
        self.mean = self.mean + x * k
        return m

    def cte_write(self, x):
        with jax.ensure_compile_time_eval():
            self.mean = self.mean + x
        return self.mean * self.w

    # --- lax primitives handed bound methods ---------------------------------------

    def lax_map_read(self, xs):
        return lax.map(self.helper_read, xs)

    def lax_map_partial_write(self, xs):
        return lax.map(functools.partial(self.bump, 2.0), xs)

    def assoc_read(self, xs):
        return jax.lax.associative_scan(lambda a, b: a + b * self.w, xs)

    def reduce_read(self, xs):
        self.calls += 1
        return jax.lax.reduce(xs * self.w, 0.0, jax.lax.add, (0,))

    def while_cond_method(self, x):
        self.mean = self.mean + x
        return lax.while_loop(self.below, lambda v: v + 1.0, 0.0)

    def while_cond_method_body_writes(self, x):
        return lax.while_loop(self.below, self.grow, 0.0)

    def scan_partial(self, xs):
        return lax.scan(functools.partial(self.step, 3.0), 0.0, xs)

    def fori_partial(self, x):
        return lax.fori_loop(0, 3, functools.partial(self.fstep, 2.0), x)

    # --- vmap / grad family of closures that only read state ------------------------

    def vmap_read(self, xs):
        self.calls += 1
        return jax.vmap(self.helper_read)(xs)

    def vmap_read_after_write(self, x):
        self.mean = self.mean + x
        return jax.vmap(lambda v, m: v * m + self.mean, in_axes=(0, None))(
            jnp.stack([x, 2 * x]), self.w)

    def grad_read_after_write(self, x):
        self.mean = self.mean + x
        return jax.grad(lambda v: (jnp.sin(v) * self.mean).sum())(x)

    def jvp_read_after_write(self, x):
        self.mean = self.mean + x
        return jax.jvp(lambda v: jnp.sin(v) * self.mean, (x,), (jnp.ones(3),))

    def linearize_read_after_write(self, x):
        self.mean = self.mean + x
        y, lin = jax.linearize(lambda v: jnp.sin(v) * self.mean, x)
        return y, lin(jnp.ones(3))

    def hessian_read(self, x):
        self.mean = self.mean + x
        return jax.hessian(lambda v: (jnp.sin(v) * self.mean).sum())(x)

    def jit_grad_read(self, x):
        self.mean = self.mean + x
        return jax.jit(jax.grad(lambda v: (v * self.mean * self.w).sum()))(x)

    def vg_has_aux_read(self, x):
        def loss(v):
            y = (v * self.w + self.mean) ** 2
            return y.sum(), y
        (l, aux), g = jax.value_and_grad(loss, has_aux=True)(x)
        self.mean = self.mean + g
        self.calls += 1
        return l, aux

    def cvjp_state_as_argument(self, x):
        self.mean = self.mean + x
        @jax.custom_vjp
        def g(v, m):
            return v * m
        def fwd(v, m):
            return v * m, (v, m)
        def bwd(res, ct):
            return (ct * res[1], ct * res[0])
        g.defvjp(fwd, bwd)
        return g(x, self.mean).sum()

    # --- callbacks -------------------------------------------------------------------

    def debug_print(self, x):
        self.mean = self.mean + x
        jax.debug.print("mean={m}", m=self.mean)
        return self.mean

    def debug_callback(self, x):
        self.mean = self.mean + x
        jax.debug.callback(_record, self.mean)
        self.calls += 1
        return self.mean

    def debug_callback_in_scan(self, xs):
        def body(c, x):
            self.mean = self.mean + x
            jax.debug.callback(_record, self.mean)
            self.calls += 1
            return c + self.mean.sum(), self.mean
        return lax.scan(body, 0.0, xs)

    def pure_cb(self, x):
        self.mean = self.mean + x
        y = jax.pure_callback(lambda m: (np.asarray(m) * 2).astype(np.float32),
                              jax.ShapeDtypeStruct((3,), jnp.float32), self.mean,
                              vmap_method="sequential")
        return y + self.w

    def pure_cb_in_cond(self, x):
        def yes(v):
            self.mean = self.mean + v
            return jax.pure_callback(lambda m: (np.asarray(m) + 1).astype(np.float32),
                                     jax.ShapeDtypeStruct((3,), jnp.float32), self.mean,
                                     vmap_method="sequential")
        def no(v):
            self.calls += 1
            return v
        return lax.cond(x.sum() > 0, yes, no, x)

    # --- custom derivatives of closures reading state ---------------------------------

    def cjvp_read(self, x):
        @jax.custom_jvp
        def g(v):
            return jnp.sin(v) * self.w + self.mean
        @g.defjvp
        def g_jvp(p, t):
            return g(p[0]), jnp.cos(p[0]) * self.w * t[0] * 3
        return g(x).sum()

    def cjvp_read_after_write(self, x):
        @jax.custom_jvp
        def g(v):
            return jnp.sin(v) * self.w + self.mean
        @g.defjvp
        def g_jvp(p, t):
            return g(p[0]), jnp.cos(p[0]) * self.w * t[0] * 3
        self.calls += 1
        self.mean = self.mean + 1.0
        return g(x).sum()

    def cvjp_read_after_write(self, x):
        @jax.custom_vjp
        def g(v):
            return v * self.w + self.mean
        def fwd(v):
            return g(v), v
        def bwd(res, ct):
            return (ct * self.w * 10,)
        g.defvjp(fwd, bwd)
        self.mean = self.mean + 1.0
        return g(x).sum()

    def custom_gradient_read(self, x):
        self.mean = self.mean + x
        @jax.custom_gradient
        def g(v):
            return (v * self.mean).sum(), lambda ct: ct * self.w
        return g(x)

    def cjvp_param_only(self, x):
        @jax.custom_jvp
        def g(v):
            return jnp.sin(v) * self.w
        @g.defjvp
        def g_jvp(p, t):
            return g(p[0]), jnp.cos(p[0]) * self.w * t[0] * 3
        self.mean = self.mean + 1.0
        return g(x).sum()

    # --- a transformation of a closure that writes state (the documented escape) ------

    def loss_writes(self, v):
        self.mean = self.mean + v
        return (v * self.w).sum() ** 2, self.mean

    def vg_has_aux_write(self, x):
        (l, aux), g = jax.value_and_grad(self.loss_writes, has_aux=True)(x)
        return l + g.sum()
"""


DECORATED_METHODS = """
@DECORATE
class Dm:
    def __init__(self):
        self.w = jnp.array([1.0, -2.0, 0.5])
        self.mean = jnp.zeros(3)
        self.calls = jnp.zeros((), jnp.int32)

    @jax.named_call
    def named(self, x):
        self.mean = self.mean + x
        self.calls += 1
        return self.mean * self.w

    @functools.partial(AUTOCKPT, policy=jax.checkpoint_policies.nothing_saveable)
    def remat_policy(self, x):
        self.mean = 0.5 * self.mean + jnp.sin(x * self.w)
        self.calls += 1
        return self.mean * x

    @functools.partial(AUTOCKPT, static_argnums=(2,))
    def remat_static(self, x, k=2):
        self.mean = 0.5 * self.mean + jnp.sin(x * self.w) * k
        self.calls += 1
        return self.mean * x if k > 1 else -x

    def inner(self, x, k):
        self.mean = 0.5 * self.mean + x * k
        return self.mean * x if k > 1 else -x

    def remat_static_keyword(self, x):
        return jax.checkpoint(self.inner, static_argnums=(1,))(x, k=3)
"""


TIMEOUT = 20.0


REENTRANT = """
@DECORATE
class Inner:
    def __init__(self):
        self.x = jnp.zeros(())
        self.y = jnp.full((), 7.0)

    def __call__(self, v):
        self.x = self.x * 3 + v
        return self.x

    def apply(self, fn, v):
        self.x = self.x + fn(v)
        return self.x

    def read_other(self, other):
        self.y = self.y + other.x
        return self.y

    def boom(self, v):
        self.x = self.x + v
        raise KeyError("inner")


@DECORATE
class Outer:
    def __init__(self):
        self.x = jnp.full((), 10.0)
        self.z = jnp.full((), 5.0)

    def bump(self, v):
        self.x = self.x + v
        return self.x

    def bumpz(self, v):
        self.z = self.z + v
        return self.z

    def use_f(self, fi, si, v):
        self.x = self.x + 1
        out, si = fi(si, v)
        self.x = self.x + out
        return self.x, si

    def use_jit_f(self, fi, si, v):
        out, si = jax.jit(lambda fi, si, v: fi(si, v))(fi, si, v)
        self.x = self.x * out
        return self.x, si

    def self_as_argument(self, fi, si):
        self.x = self.x + 1
        out, si = fi.read_other(si, self)
        return out, si

    def callback_x(self, fi, si, v):
        out, si = fi.apply(si, self.bump, v)
        return out, self.x, si

    def callback_z(self, fi, si, v):
        out, si = fi.apply(si, self.bumpz, v)
        return out, self.z, si

    def catches_inner(self, fi, si, v):
        self.x = self.x + 1
        try:
            fi.boom(si, v)
        except KeyError:
            self.x = self.x * 2
        out, si = fi(si, v)
        return self.x + out, si
"""


RECURSION = """
@DECORATE
class Node:
    def __init__(self, depth):
        self.w = jnp.asarray(float(depth + 1))
        self.count = jnp.zeros(())
        self.kids = [Node(depth - 1), Node(depth - 1)] if depth > 0 else []

    def __call__(self, x):
        self.count = self.count + 1
        y = x * self.w
        for k in self.kids:
            y = y + k(x + self.count)
        return y


@DECORATE
class Deep:
    def __init__(self, levels):
        self.levels = levels
        self.x = jnp.ones(())
        self.n = jnp.zeros(())
        self.trail = jnp.zeros(levels + 1)

    def rec(self, k, v):
        self.n = self.n + 1
        self.x = self.x + v * k
        self.trail = self.trail.at[k].set(self.x)
        if k > 0:
            return self.rec(k - 1, v) + self.x
        return self.x

    def __call__(self, v):
        return self.rec(self.levels, v)

    def two_levels(self, v):
        return self.rec(2, v)


@DECORATE
class Fib:
    def __init__(self, n):
        self.n = n
        self.calls = jnp.zeros((), jnp.int32)
        self.memo = {}

    def fib(self, n):
        self.calls = self.calls + 1
        if n in self.memo:
            return self.memo[n]
        out = jnp.asarray(float(n)) if n < 2 else self.fib(n - 1) + self.fib(n - 2)
        self.memo[n] = out
        return out

    def __call__(self, scale):
        self.memo = {}
        return self.fib(self.n) * scale


@DECORATE
class Peer:
    def __init__(self, with_peer):
        self.x = jnp.ones(())
        self.peer = Peer(False) if with_peer else None

    def __call__(self, v):
        self.x = self.x * 2 + v
        if self.peer is not None:
            return self.peer(self.x) + self.peer.poke(self) + self.x
        return self.x

    def poke(self, other):
        other.x = other.x + 100
        self.x = self.x + other.x
        return self.x

    def walk(self, other, depth):
        self.x = self.x + depth
        if depth > 0:
            return other.walk(self, depth - 1) * 2 + self.x
        return self.x

    def ping_pong(self, v):
        return self.walk(self.peer, 5) + v


@DECORATE
class Selfish:
    def __init__(self):
        self.me = self
        self.x = jnp.zeros(())

    def __call__(self, v):
        self.x = self.x + 1
        self.me.x = self.me.x * v
        return self.x + self.me.x


@DECORATE
class Lax:
    def __init__(self):
        self.x = jnp.ones(())
        self.n = jnp.zeros(())

    def rec_scan(self, k, xs):
        def body(c, v):
            self.x = self.x + v * k
            self.n = self.n + 1
            inner = self.rec_scan(k - 1, xs) if k > 0 else jnp.zeros(())
            return c + self.x + inner, None
        return lax.scan(body, jnp.zeros(()), xs)[0]

    def deep(self, xs):
        return self.rec_scan(2, xs)

    def rec_cond(self, k, v):
        def yes(v):
            self.x = self.x * 2 + v
            return self.rec_cond(k - 1, v) if k > 0 else self.x
        def no(v):
            self.n = self.n + k
            return self.x - v
        return lax.cond(v > 0, yes, no, v)

    def cond3(self, v):
        return self.rec_cond(3, v)


@DECORATE
class OnlyThroughAlias:
    def __init__(self):
        self.me = self
        self.x = jnp.zeros(())

    def __call__(self, v):
        self.me.x = self.me.x + v  # HERE
        return self.x
"""


FRAMES = """
import asyncio
import contextlib


@DECORATE
class Stream:
    def __init__(self):
        self.x = jnp.ones(())
        self.n = jnp.zeros(())

    def bump(self, v):
        self.x = self.x + v
        self.n = self.n + 1
        return self.x

    def gen(self, vs):
        for v in vs:
            yield self.bump(v)

    def start(self, vs):
        g = self.gen(vs)
        first = next(g)
        return g, first

    def resume(self, g):
        out = next(g)
        self.x = self.x * 2
        return out

    async def abump(self, v):
        await asyncio.sleep(0)
        out = self.bump(v)
        await asyncio.sleep(0)
        return out + self.bump(v)

    async def astep(self, v, go, ready):
        self.bump(v)
        ready.set()
        await go.wait()
        return self.bump(v)

    async def await_other(self, other, v):
        out = await other.abump(v)
        return out + self.bump(out)

    def run_async(self, v):
        return asyncio.run(self.abump(v))

    @contextlib.contextmanager
    def scope(self, v):
        self.bump(v)
        try:
            yield self.bump(v)
        finally:
            self.bump(v * 10)
"""


PROTO = """
@DECORATE
class Acc:
    k = 5.0

    def __init__(self, n=2):
        self.w = jnp.ones(n)
        self.n = jnp.zeros(n)
        self.k = jnp.zeros(())
        self.tag = "acc"

    def __call__(self, x):
        self.n = self.n + x * self.w
        self.k = self.k + 1
        return self.n.sum() + self.k

    def same(self, v):
        self.n = v
        return self.n is v

    def reset(self):
        self.__init__(self.n.shape[0])
        return self.n


@DECORATE
class Leaf:
    def __init__(self):
        self.n = jnp.zeros(())
        self.w = jnp.ones(())

    def __call__(self, x):
        self.n = self.n + x * self.w
        return self.n


@DECORATE
class Host:
    def __init__(self):
        self.n = jnp.zeros(())

    def call_extra(self, x):
        self.n = self.n + x
        return self.extra(x) + self.n

    def use_param(self, x):
        self.n = self.n + (x * self.added).sum()
        return self.n


@DECORATE
class Made:
    count = 0

    def __new__(cls, *args, **kwargs):
        obj = super().__new__(cls)
        obj.created = "yes"
        Made.count += 1
        return obj

    def __init__(self, scale):
        self.scale = scale
        self.n = jnp.zeros(())

    def __call__(self, x):
        self.n = self.n + x * self.scale
        return self.n


@DECORATE
class Base:
    def __init__(self):
        self.__v = jnp.zeros(())
        self.w = jnp.ones(())

    def bump(self):
        self.__v = self.__v + self.w
        return self.__v


class Sub(Base):
    def __init__(self):
        super().__init__()
        self.__v = jnp.full((), 10.0)

    def bump2(self):
        self.__v = self.__v * 2
        return self.__v + self._Base__v


class Fast(Leaf):
    def __call__(self, x):
        self.n = self.n + 100 * x
        return self.n


@DECORATE
class Buf:
    def __init__(self, n):
        self.items = jnp.zeros(n)
        self.pos = jnp.zeros((), jnp.int32)
        self.hits = jnp.zeros(())

    def __repr__(self):
        return f"Buf(n={len(self)})"

    def __len__(self):
        return self.items.shape[0]

    def __getitem__(self, i):
        return self.items[i]

    def __setitem__(self, i, v):
        self.items = self.items.at[i].set(v)

    def __iter__(self):
        return iter([self.items[i] for i in range(len(self))])

    def __iadd__(self, v):
        self.items = self.items + v
        return self

    def __add__(self, v):
        return self.items + v

    def __enter__(self):
        self.hits = self.hits + 1
        return self

    def __exit__(self, *exc):
        self.hits = self.hits * 10
        return False

    def push(self, v):
        self[self.pos] = v
        self.pos = self.pos + 1
        with self:
            s = sum(self)
        other = self
        other += 1.0
        return s + len(self) + self[0] + (self + 1.0).sum()

    def describe(self):
        return repr(self)


@DECORATE
class Kid:
    def __init__(self, parent):
        self._parent = weakref.ref(parent)
        self.n = jnp.zeros(())

    def __call__(self, x):
        self.n = self.n + x
        return self._parent().total + self.n


@DECORATE
class Par:
    def __init__(self):
        self.total = jnp.zeros(())
        self.kid = Kid(self)

    def __call__(self, x):
        self.total = self.total + 10 * x
        return self.kid(x)
"""


DTYPES = """
class Pt(NamedTuple):
    a: jax.Array
    b: jax.Array


class Mode(enum.Enum):
    A = 1
    B = 2


@DECORATE
class Typed:
    def __init__(self, dtype):
        self.x = jnp.zeros(3, dtype)
        self.dtype = dtype

    def step(self, v):
        self.x = self.x + jnp.asarray(v).astype(self.dtype)
        self.x = self.x.at[0].set(self.x[1] * 2)
        return self.x


@DECORATE
class Py:
    def __init__(self):
        self.fl = 1.5
        self.cx = 1 + 2j
        self.i = 3
        self.b = True
        self.w = jnp.ones(())

    def step(self, x):
        self.fl = self.fl * 2 + x
        self.cx = self.cx * 1j
        return self.fl * self.w + self.i * self.b

    def bump_int(self):
        self.i = self.i + 1

    def flip(self):
        self.b = not self.b


@DECORATE
class Np:
    def __init__(self):
        self.arr = np.ones(2, np.float32)
        self.sc = np.float32(2.0)
        self.ints = np.arange(3)
        self.lst = [np.zeros(1), {"k": np.ones(1)}]

    def step(self, x):
        self.arr = self.arr + x
        self.sc = self.sc * 2
        self.ints = self.ints + 1
        self.lst = [self.lst[0] + x, {"k": self.lst[1]["k"] * 2}]
        return self.arr.sum() + self.sc


@DECORATE
class Strs:
    def __init__(self):
        self.labels = np.array(["a", "b"])
        self.n = jnp.zeros(())

    def __call__(self, x):
        self.n = self.n + x
        self.labels = self.labels
        return self.n


@DECORATE
class Trees:
    def __init__(self):
        self.pt = Pt(jnp.zeros(2), jnp.ones(2))
        self.nested = {"a": [jnp.zeros(1), (jnp.zeros(1), {"z": jnp.ones(1)})]}
        self.empty_l = []
        self.empty_t = ()
        self.empty_d = {}
        self.t = (jnp.zeros(()), jnp.ones(()))

    def step(self, x):
        self.pt = self.pt._replace(a=self.pt.a + x)
        inner = self.nested["a"][1]
        self.nested = {"a": [self.nested["a"][0] * 2, (inner[0] + x, {"z": inner[1]["z"] * x})]}
        self.empty_l = []
        self.empty_t = ()
        self.empty_d = {}
        return self.pt.a.sum() + self.nested["a"][1][1]["z"].sum()

    def tolist(self):
        self.t = list(self.t)
        return self.t[1]

    def grow(self, x):
        self.t = tuple(self.t) + (x,)
        return sum(self.t)


@DECORATE
class Static:
    def __init__(self):
        self.mode = Mode.A
        self.name = "x"
        self.w = jnp.ones(())

    def set_b(self):
        self.mode = Mode.B

    def same(self):
        self.mode = Mode.A
        self.name = "x"
        return self.w

    def __call__(self, x):
        return x * self.w * (2.0 if self.mode is Mode.A else 3.0) + len(self.name)


@DECORATE
class Keys:
    def __init__(self, seed):
        self.key = jax.random.key(seed)
        self.raw = jax.random.PRNGKey(seed + 1)
        self.acc = jnp.zeros(())

    def __call__(self, x):
        self.key, sub = jax.random.split(self.key)
        self.raw, sub2 = jax.random.split(self.raw)
        self.acc = self.acc + jax.random.normal(sub, ()) + jax.random.uniform(sub2, ()) * x
        return self.acc


@DECORATE
class Ordered:
    def __init__(self):
        self.d = {"b": jnp.zeros(()), "a": jnp.ones(())}
        self.ik = {2: jnp.zeros(()), 1: jnp.ones(())}

    def first(self, x):
        self.d = {k: v + x for k, v in self.d.items()}
        return list(self.d.values())[0] + list(self.ik.values())[0] * 10

    def touch(self):
        self.ik = dict(self.ik)


@DECORATE
class Typed2:
    def __init__(self):
        self.od = collections.OrderedDict(b=jnp.zeros(()), a=jnp.ones(()))
        self.dd = collections.defaultdict(lambda: jnp.zeros(()))
        self.dd["x"] = jnp.ones(())

    def put(self, k, v):
        self.od[k] = v
        self.dd[k] += v
        return self.dd[k]
"""


VARIANTS = """
@DECORATE
class Mixed:
    def __init__(self):
        self.w = jnp.ones(2)
        self.n = jnp.zeros(2)
        self.kv = STATE(jnp.zeros(2), category="cache")

    def __call__(self, x):
        self.n = self.n + x
        self.kv = self.kv + 2 * x
        return (self.n * self.w + self.kv).sum()

    def only_cache(self, x):
        self.kv = self.kv * self.w + x
        return self.kv.sum()

    def fail(self, x, boom):
        self.n = self.n + x
        if boom:
            raise ValueError("boom")
        return self.n.sum()

    def bad_shape(self, x):
        self.n = self.n + x
        return self.n @ jnp.ones(3)


@DECORATE
class Inner:
    def __init__(self):
        self.w = jnp.ones(2)
        self.n = jnp.zeros(2)

    def __call__(self, x):
        self.n = self.n + x
        return (self.n * self.w).sum()


@DECORATE
class Outer:
    def __init__(self):
        self.inner = Inner()
        self.m = jnp.zeros(())

    def __call__(self, x):
        g, s = self.inner.functionalize()
        out, s = g(s, x)
        self.m = self.m + out
        return self.m


@DECORATE
class Tied:
    def __init__(self, shared):
        self.shared = shared
        self.own = jnp.zeros(())

    def __call__(self, x):
        self.own = self.own + x
        return self.shared(x) + self.own


@DECORATE
class Two:
    def __init__(self):
        s = Inner()
        self.p = Tied(s)
        self.q = Tied(s)
        self.alias = s

    def __call__(self, x):
        return self.p(x) + self.q(2 * x) + self.alias.n.sum()
"""


V2 = jnp.array([1.0, 2.0])


B3 = jnp.array([[1.0, 2.0], [3.0, -1.0], [0.5, 0.5]])


TORCH = """
import collections

REGISTRY = []


@DECORATE
class Sub:
    def __init__(self, k):
        self.w = jnp.full((2,), k)
        self.calls = jnp.zeros((), jnp.int32)
        self.training = True

    def __call__(self, x):
        self.calls += 1
        if self.training:
            return x * self.w
        return x + self.w


@DECORATE
class Layers:
    def __init__(self, n):
        self.n = n
        for i in range(n):
            setattr(self, f"layer{i}", Sub(float(i + 1)))
        self.acc = jnp.zeros(2)

    def __call__(self, x):
        for i in range(self.n):
            x = getattr(self, f"layer{i}")(x)
        self.acc = self.acc + x
        return x

    def zero(self):
        for name in ("acc",):
            setattr(self, name, jnp.zeros(2))
        return vars(self)["acc"]


@DECORATE
class ZeroGrad:
    def __init__(self):
        self.ga = jnp.ones(2)
        self.gb = jnp.ones(())
        self.gc = jnp.ones(3)
        self.steps = jnp.zeros((), jnp.int32)

    def accumulate(self, x):
        self.ga = self.ga + x
        self.gb = self.gb + x.sum()
        self.gc = self.gc + x.mean()
        self.steps += 1
        return self.ga.sum() + self.gb + self.gc.sum()

    def zero_grad(self):
        for name in ("ga", "gb", "gc"):
            setattr(self, name, jnp.zeros_like(getattr(self, name)))
        return self.steps

    def zero_by_dict(self):
        for name, v in list(vars(self).items()):
            if name.startswith("g"):
                self.__dict__[name] = v * 0
        return self.steps

    def total(self):
        return sum(vars(self)[k].sum() for k in ("ga", "gb", "gc"))


@DECORATE
class Net:
    def __init__(self):
        self.blocks = [Sub(1.0), Sub(2.0)]
        self.head = {"a": Sub(3.0)}
        self.last = Sub(4.0)
        self.training = True

    def train(self, mode=True):
        self.training = mode
        for v in vars(self).values():
            children = v if isinstance(v, list) else v.values() if isinstance(v, dict) else [v]
            for m in children:
                if hasattr(m, "train"):
                    m.train(mode)
                elif hasattr(m, "training"):
                    m.training = mode
        return self

    def eval(self):
        return self.train(False)

    def set_eval(self):
        self.eval()

    def __call__(self, x):
        for b in self.blocks:
            x = b(x)
        return self.last(self.head["a"](x))


@DECORATE
class TorchLike:
    def __init__(self):
        self.__dict__["_modules"] = collections.OrderedDict()
        self.enc = Sub(2.0)
        self.dec = Sub(3.0)
        self.count = jnp.zeros((), jnp.int32)

    def __setattr__(self, name, value):
        if isinstance(value, Sub):
            self.__dict__["_modules"][name] = value
        else:
            super().__setattr__(name, value)

    def __getattr__(self, name):
        modules = self.__dict__.get("_modules")
        if modules is not None and name in modules:
            return modules[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __call__(self, x):
        self.count += 1
        return self.dec(self.enc(x)) * self.count


@DECORATE
class Permissive:
    def __init__(self):
        self.w = jnp.ones(2)
        self.count = jnp.zeros((), jnp.int32)

    def __getattr__(self, name):
        return None

    def __call__(self, x):
        self.count += 1
        if self.scale is not None:
            x = x * self.scale
        return x * self.w * self.count


@DECORATE
class Recorder:
    def __init__(self):
        self.w = jnp.ones(2)
        self.mean = jnp.zeros(2)
        self.steps = jnp.zeros((), jnp.int32)

    def __setattr__(self, name, value):
        if name not in REGISTRY:
            REGISTRY.append(name)
        super().__setattr__(name, value)

    def __call__(self, x):
        self.mean = 0.5 * self.mean + 0.5 * x
        self.steps = self.steps + 1
        return x * self.w - self.mean


@DECORATE
class InstRecorder:
    def __init__(self):
        object.__setattr__(self, "_order", [])
        self.w = jnp.ones(2)
        self.mean = jnp.zeros(2)

    def __setattr__(self, name, value):
        if name not in self._order:
            self._order.append(name)
        object.__setattr__(self, name, value)

    def __call__(self, x):
        self.mean = 0.5 * self.mean + 0.5 * x
        return x * self.w - self.mean

    def order(self):
        return list(self._order)


@DECORATE
class Visit:
    def __init__(self, k):
        self.w = jnp.full((2,), k)
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.calls += 1
        return x * self.w

    def apply(self, fn):
        for v in list(vars(self).values()):
            for m in (v if isinstance(v, list) else [v]):
                if hasattr(m, "apply"):
                    m.apply(fn)
        fn(self)
        return self

    def named_parameters(self, prefix=""):
        for k, v in vars(self).items():
            if isinstance(v, jax.Array) and jnp.issubdtype(v.dtype, jnp.floating):
                yield prefix + k, v
            elif isinstance(v, list):
                for i, m in enumerate(v):
                    yield from m.named_parameters(f"{prefix}{k}.{i}.")
            elif hasattr(v, "named_parameters"):
                yield from v.named_parameters(prefix + k + ".")

    def named_buffers(self):
        for k, v in vars(self).items():
            if isinstance(v, jax.Array) and not jnp.issubdtype(v.dtype, jnp.floating):
                yield k, v


@DECORATE
class Tree(Visit):
    def __init__(self):
        super().__init__(1.0)
        self.inner = Visit(2.0)
        self.more = [Visit(3.0)]

    def __call__(self, x):
        self.calls += 1
        return self.more[0](self.inner(x)) * self.w

    def param_norm(self):
        return sum(jnp.sum(v ** 2) for _, v in self.named_parameters())

    def count_all(self):
        total = jnp.zeros((), jnp.int32)

        def visit(m):
            nonlocal total
            total = total + m.calls

        self.apply(visit)
        return total

    def reset_all(self):
        def zero(m):
            m.calls = m.calls * 0

        self.apply(zero)
        return self.calls

    def buffer_sum(self):
        return sum(v for _, v in self.named_buffers())


@DECORATE
class Sequential:
    def __init__(self, *layers):
        self.layers = list(layers)

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x

    def append(self, layer):
        self.layers.append(layer)
        return self


@DECORATE
class Heads:
    def __init__(self):
        self.heads = {}
        self.blocks = []
        self.seen = jnp.zeros((), jnp.int32)

    def add_head(self, name, k):
        self.heads[name] = Sub(k)

    def add_block(self, k):
        self.blocks.append(Sub(k))

    def __call__(self, x):
        self.seen += 1
        for b in self.blocks:
            x = b(x)
        return {k: h(x) for k, h in sorted(self.heads.items())}


def heads():
    h = Heads()
    h.add_head("a", 2.0)
    h.add_block(3.0)
    h.add_head("b", 4.0)
    h.add_block(0.5)
    return h


@DECORATE
class Ema:
    def __init__(self):
        self.w = jnp.ones(2) * 2.0
        self.avg = jnp.zeros(2)

    def __call__(self, x):
        y = x * self.w
        self.avg = jax.lax.stop_gradient(0.5 * self.avg + 0.5 * y)
        return (y * self.avg).sum()


def count_hook(module, args, out):
    module.hooked = module.hooked + out.sum()


@DECORATE
class Hooked:
    def __init__(self):
        self.inner = Sub(2.0)
        self.hooked = jnp.zeros(())
        self._forward_hooks = [count_hook]
        self._pre_hooks = [lambda m, args: (args[0] * 2,)]

    def forward(self, x):
        self.hooked = self.hooked * 0.5
        return self.inner(x)

    def __call__(self, *args):
        for hook in self._pre_hooks:
            args = hook(self, args)
        out = self.forward(*args)
        for hook in self._forward_hooks:
            hook(self, args, out)
        return out


@DECORATE
class Buffers:
    def __init__(self):
        self.a = Sub(1.0)
        self.b = [Sub(2.0)]
        self.total = jnp.zeros(())

    def __call__(self, x):
        y = self.b[0](self.a(x))
        self.total = self.total + y.sum()
        return y

    def buffers(self):
        out = {}
        for k, v in vars(self).items():
            for i, s in enumerate(v if isinstance(v, list) else [v]):
                if isinstance(s, Sub):
                    prefix = f"{k}.{i}." if isinstance(v, list) else f"{k}."
                    out[prefix + "calls"] = s.calls
        out["total"] = self.total
        return out

    def load_buffers(self, d):
        for key, value in d.items():
            obj = self
            *path, last = key.split(".")
            for p in path:
                obj = obj[int(p)] if p.isdigit() else getattr(obj, p)
            setattr(obj, last, value)
        return self.total

    def scale_buffers(self, s):
        return self.load_buffers({k: v * s if k == "total" else v + 1
                                  for k, v in self.buffers().items()})


@DECORATE
class Grow:
    def __init__(self):
        self.n = 0
        self.total = jnp.zeros(())

    def add_layer(self, k):
        setattr(self, f"layer{self.n}", Sub(k))
        self.n += 1

    def __call__(self, x):
        for i in range(self.n):
            x = getattr(self, f"layer{i}")(x)
        self.total = self.total + x.sum()
        return x


def grown(n):
    g = Grow()
    for i in range(n):
        g.add_layer(float(i + 2))
    return g


@DECORATE
class ModList:
    def __init__(self):
        self.layers = [Sub(1.0), Sub(2.0), Sub(3.0)]

    def drop_first(self):
        del self.layers[0]

    def insert(self, k):
        self.layers = self.layers[:1] + [Sub(k)] + self.layers[1:]

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def edited():
    m = ModList()
    m.drop_first()
    m.insert(5.0)
    return m


@DECORATE
class RegBuf:
    def __init__(self):
        self.w = jnp.ones(2)
        self.register_buffer("running", jnp.zeros(2))
        self.steps = jnp.zeros((), jnp.int32)

    def register_buffer(self, name, value):
        setattr(self, name, value)

    def __call__(self, x):
        self.steps += 1
        self.register_buffer("running", 0.9 * self.running + 0.1 * x)
        return x * self.w + self.running


CACHE = "cache"


@DECORATE
class LazyByName:
    def __init__(self):
        self.k = jnp.ones(())

    def __call__(self, x):
        if not hasattr(self, CACHE):
            setattr(self, CACHE, x * 0)
        setattr(self, CACHE, getattr(self, CACHE) + x)
        return getattr(self, CACHE) * self.k


@DECORATE
class Cache:
    def __init__(self):
        self.k = jnp.ones(())
        self.cache = jnp.zeros(())

    def __call__(self, x):
        if not hasattr(self, CACHE):
            self.cache = jnp.zeros(())
        self.cache = self.cache + x
        return self.cache * self.k

    def reset(self):
        delattr(self, CACHE)

    def reset_dict(self):
        del self.__dict__[CACHE]

    def reset_vars(self):
        vars(self).pop(CACHE)
"""


NNX = """
@DECORATE
class Variable:
    def __init__(self, value):
        self.value = value

    def update(self, value):
        self.value = value


class PlainVariable:
    def __init__(self, value):
        self.value = value


@DECORATE
class Param:
    def __init__(self, value):
        self.value = value


@DECORATE
class Counter:
    def __init__(self):
        self.w = Param(jnp.ones(2) * 2.0)
        self.count = Variable(jnp.zeros((), jnp.int32))
        self.mean = Variable(jnp.zeros(2))

    def __call__(self, x):
        self.count.value += 1
        self.mean.value = 0.5 * self.mean.value + 0.5 * x
        return x * self.w.value + self.mean.value


@DECORATE
class WritesParam:
    def __init__(self):
        self.w = Param(jnp.ones(2))

    def __call__(self, x):
        self.w.value = self.w.value + x
        return self.w.value


@DECORATE
class HoldsPlain:
    def __init__(self):
        self.count = PlainVariable(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        self.count.value = self.count.value + 1
        return x * self.count.value


@DECORATE
class Rngs:
    def __init__(self, seed):
        self.key = jax.random.key(seed)
        self.count = jnp.zeros((), jnp.uint32)

    def dropout(self):
        self.count += 1
        self.key, sub = jax.random.split(self.key)
        return sub

    def params(self):
        return jax.random.fold_in(self.key, self.count)


@DECORATE
class Dropout:
    def __init__(self, rate, rngs):
        self.rate = rate
        self.rngs = rngs

    def __call__(self, x, deterministic=False):
        if deterministic:
            return x
        keep = jax.random.bernoulli(self.rngs.dropout(), 1 - self.rate, x.shape)
        return jnp.where(keep, x / (1 - self.rate), 0.0)


@DECORATE
class Linear:
    def __init__(self, n_in, n_out, rngs):
        self.kernel = jax.random.normal(rngs.params(), (n_in, n_out))
        rngs.dropout()
        self.bias = jnp.zeros(n_out)

    def __call__(self, x):
        return x @ self.kernel + self.bias


@DECORATE
class Block:
    def __init__(self, rngs):
        self.rngs = rngs
        self.fc = Linear(2, 4, rngs)
        self.drop1 = Dropout(0.5, rngs)
        self.drop2 = Dropout(0.25, rngs)

    def __call__(self, x):
        return self.drop2(self.drop1(self.fc(x)))


@DECORATE
class PropVariable:
    def __init__(self, value):
        self._value = value

    @property
    def value(self):
        return self._value

    @value.setter
    def value(self, v):
        self._value = v

    def __getitem__(self, i):
        return self._value[i]

    def __mul__(self, other):
        return self._value * other


class BatchStat(PropVariable):
    pass


class PropParam(PropVariable):
    pass


@DECORATE
class RngStream:
    def __init__(self, seed):
        self.key = PropVariable(jax.random.key(seed))
        self.count = PropVariable(jnp.zeros((), jnp.uint32))

    def __call__(self):
        key = jax.random.fold_in(self.key.value, self.count.value)
        self.count.value += 1
        return key


@DECORATE
class StreamRngs:
    def __init__(self, **streams):
        for name, seed in streams.items():
            setattr(self, name, RngStream(seed))

    def __getattr__(self, name):
        return vars(self)["default"]


@DECORATE
class Noisy:
    def __init__(self, rngs):
        self.rngs = rngs
        self.w = PropParam(jax.random.normal(rngs.params(), (2,)))
        self.mean = BatchStat(jnp.zeros(2))

    def __call__(self, x):
        noise = jax.random.normal(self.rngs.dropout(), x.shape)
        self.mean.value = 0.9 * self.mean.value + 0.1 * x
        return self.w * x + noise * 0.01 + self.mean[0]


@DECORATE
class IVariable:
    def __init__(self, value):
        self.value = value

    def __iadd__(self, other):
        self.value = self.value + other
        return self

    def __imul__(self, other):
        self.value = self.value * other
        return self

    def __mul__(self, other):
        return self.value * other

    __rmul__ = __mul__


@DECORATE
class InPlace:
    def __init__(self):
        self.count = IVariable(jnp.zeros((), jnp.int32))
        self.decay = IVariable(jnp.ones(2))
        self.w = jnp.ones(2) * 3.0

    def __call__(self, x):
        self.count += 1
        self.decay *= 0.5
        return x * self.w * self.decay + self.count.value


@DECORATE
class BatchNorm:
    def __init__(self, n, *, use_running_average=False, momentum=0.9, epsilon=1e-5):
        self.scale = jnp.ones(n)
        self.bias = jnp.zeros(n)
        self.mean = jnp.zeros(n)
        self.var = jnp.ones(n)
        self.use_running_average = use_running_average
        self.momentum = momentum
        self.epsilon = epsilon

    def __call__(self, x, use_running_average=None):
        ura = self.use_running_average if use_running_average is None else use_running_average
        if ura:
            mean, var = self.mean, self.var
        else:
            mean, var = x.mean(0), x.var(0)
            self.mean = self.momentum * self.mean + (1 - self.momentum) * mean
            self.var = self.momentum * self.var + (1 - self.momentum) * var
        return (x - mean) / jnp.sqrt(var + self.epsilon) * self.scale + self.bias


@DECORATE
class NLinear:
    def __init__(self, k, n_in, n_out):
        self.kernel = jax.random.normal(jax.random.key(k), (n_in, n_out))
        self.bias = jnp.zeros(n_out)

    def __call__(self, x):
        return x @ self.kernel + self.bias


@DECORATE
class NSequential:
    def __init__(self, *layers):
        self.layers = list(layers)

    def __call__(self, x, **kw):
        for layer in self.layers:
            x = layer(x, **kw) if isinstance(layer, BatchNorm) else layer(x)
        return x


def make():
    return NSequential(NLinear(0, 2, 3), BatchNorm(3), jax.nn.relu, NLinear(1, 3, 1),
                       BatchNorm(1, momentum=0.5))


def set_eval(model):
    for layer in model.layers:
        if isinstance(layer, BatchNorm):
            layer.use_running_average = True


@DECORATE
class CatBN:
    def __init__(self):
        self.scale = jnp.ones(2)
        self.mean = STATE(jnp.zeros(2), category="batch_stats")
        self.steps = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.steps += 1
        self.mean = 0.5 * self.mean + 0.5 * x
        return (x - self.mean) * self.scale


@DECORATE
class Compact:
    def __init__(self, features):
        self.features = features
        self.params = {}
        self.batch_stats = {}

    def param(self, name, init, shape):
        if name not in self.params:
            self.params = {**self.params, name: init(shape)}
        return self.params[name]

    def variable(self, name, init, shape):
        if name not in self.batch_stats:
            self.batch_stats = {**self.batch_stats, name: init(shape)}
        return self.batch_stats[name]

    def __call__(self, x):
        kernel = self.param("kernel", lambda s: jnp.full(s, 0.5), (x.shape[-1], self.features))
        mean = self.variable("mean", jnp.zeros, (self.features,))
        y = x @ kernel
        self.batch_stats = {**self.batch_stats, "mean": 0.9 * mean + 0.1 * y}
        return y
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


ASSIGN = """
import contextlib


class Cfg:
    def __init__(self):
        self.lr = 1.0


@DECORATE
class Sub:
    def __init__(self):
        self.lr = jnp.ones(())

    def touch(self):
        self.lr = self.lr


@DECORATE
class A:
    def __init__(self):
        self.a = jnp.zeros(())
        self.b = jnp.ones(())
        self.c = jnp.full((), 2.0)
        self.rest = [jnp.zeros(())]
        self.i = 0
        self.handle = jnp.zeros(())
        self.buf = [jnp.zeros(()), jnp.ones(())]
        self.stats = {"n": jnp.zeros(()), "m": jnp.ones(())}
        self.sub = Sub()
        self.cfg = Cfg()
        self.local_d = {"k": 0.0}
        self.x = jnp.arange(3.0)

    def chained_mixed(self, v):
        d = {}
        self.a = y = d["k"] = self.b = v * 2
        return y + d["k"] + self.a + self.b

    def nested_unpack(self, v):
        self.a, (self.b, *self.rest) = v, [v + 1, v + 2, v + 3]
        return self.rest

    def list_unpack(self, v):
        [self.a, [self.b, self.c]] = (v, (self.a + 1, self.b + 2))
        return self.a + self.b + self.c

    def star_first(self, v):
        *self.rest, self.a = [v, v * 2, v * 3]
        return self.a, self.rest

    def for_range(self):
        total = 0
        for self.i in range(3):
            total = total + self.i
        return total

    def with_handle(self, v):
        with contextlib.nullcontext(v * 3) as self.handle:
            self.a = self.handle + 1
        return self.handle

    def with_two(self, v):
        with contextlib.nullcontext(v) as self.a, contextlib.nullcontext(v * 2) as self.b:
            pass
        return self.a + self.b

    def walrus_comprehension(self, v):
        vals = [y for k in range(3) if (y := self.a + k) is not None and k != 1]
        self.a = self.a + v
        return vals, y

    def aug_list_item(self, v):
        self.buf[0] += v
        self.buf[-1] *= v
        return tuple(self.buf)

    def aug_dict_item(self, v):
        self.stats["n"] += 1
        self.stats["m"] -= self.stats["n"] * v
        return self.stats["n"] + self.stats["m"]

    def aug_sub_model_attr(self, v):
        self.sub.lr *= 0.5
        self.sub.lr += v
        return self.sub.lr

    def aug_self_self(self, v):
        self.a += self.a + v
        self.b *= self.b
        return self.a, self.b

    def swap(self, v):
        self.a = self.a + v
        self.a, self.b = self.b, self.a
        self.a, self.b, self.c = self.c, self.a, self.b
        return self.a - self.b

    def mixed_targets(self, v):
        d = {}
        self.a, d["k"], loc, self.stats["n"] = v, v + 1, v + 2, v + 3
        return d["k"] + loc

    def annotated(self, v):
        self.a: jax.Array = v * 2
        self.c: float = self.a + self.c
        return self.c

    def lambda_setattr(self, v):
        put = lambda w: self.__setattr__("a", w)  # noqa: E731
        put(v + self.a)
        return self.a

    def cond_expr_write(self, v):
        self.a = self.a + v if self.i == 0 else self.b - v
        self.b = (self.a if self.i else self.b) * 2
        self.c = self.c if self.i else (self.c + v if self.c is not None else self.c)
        return self.a, self.b
"""


PLAIN_SUB = """
class Cfg:
    def __init__(self):
        self.lr = 1.0


@DECORATE
class Opt:
    def __init__(self):
        self.cfg = Cfg()
        self.step = jnp.zeros(())

    def decay(self, v):
        self.cfg.lr *= 0.5
        self.step += v * self.cfg.lr
        return self.step
"""


RECEIVERS = """
class Plain:
    def __init__(self, x):
        self.x = x
        self.n = x


@DECORATE
class Rc:
    def __init__(this):
        this.n = jnp.zeros(())
        this.x = jnp.ones(())
        this.others = [Plain(1.0), Plain(2.0)]

    def step(this, v):
        this.n += v
        this.x = this.x * 2
        return this.n + this.x

    def shadow_comprehension(self, v):
        self.n = self.n + v
        vals = [self.x for self in self.others]
        total = sum(self.n for self in self.others)
        return vals, total, self.n

    def nested_param_self(self, v):
        def helper(self, k):
            return self.x * k
        lam = lambda self: self.n  # noqa: E731
        self.n = self.n + v
        return helper(self.others[0], 2.0), lam(self.others[1]), helper(self, 3.0)

    def nested_class_self(self, v):
        outer = self
        class Inner:
            def __init__(self):
                self.x = 10.0
            def get(self):
                return self.x + outer.x
        self.x = self.x + v
        return Inner().get()

    def lambda_default_self(self, v):
        get = lambda self=self: self.n  # noqa: E731
        self.n = self.n + v
        return get(), get(self.others[0])

    @staticmethod
    def bump(m, v):
        m.n += v
        return m.n

    def calls_static(self, v):
        return Rc.bump(self, v) + self.bump(self, v)

    @classmethod
    def fresh(cls, v):
        obj = cls()
        obj.n += v
        return obj

    def calls_class(self, v):
        other = type(self).fresh(v)
        self.n = self.n + other.n
        return self.n

    def global_self(self, v):
        def g():
            global self  # noqa: PLW0603
            self = Plain(v)
            return self.x
        r = g()
        self.n = self.n + v
        return r
"""


ONE = jnp.ones(2)


SOURCE = """

@DECORATE
class Block:
    def __init__(self, k=1.0):
        self.w = jnp.full((2,), k)
        self.n = jnp.zeros(())

    def __call__(self, x):
        self.n = self.n * 2 + 1          # order-sensitive: two uses are not one use
        return jnp.sin(x * self.w) + self.n


@DECORATE
class Paths:
    \"\"\"One Block on five paths: two attributes, a list, a dict, a tuple.\"\"\"

    def __init__(self):
        enc = Block(2.0)
        self.enc = enc
        self.dec_in = self.enc
        self.layers = [enc, enc]
        self.d = {"a": enc, "b": Block(3.0)}
        self.t = (enc,)

    def __call__(self, x):
        y = self.enc(x) + self.dec_in(x)
        y = y + self.layers[1](y) + self.d["a"](x) + self.d["b"](x) + self.t[0](x)
        return y

    def poke(self, v):
        self.layers[0].n = self.layers[0].n + v
        return self.dec_in.n


@DECORATE
class Twice:
    \"\"\"One stateful sub-model called twice per forward; the second use sees the first.\"\"\"

    def __init__(self):
        self.blk = Block(0.5)
        self.scale = jnp.full((2,), 3.0)

    def __call__(self, x):
        h = self.blk(x * self.scale)
        return self.blk(h) * self.scale


@DECORATE
class Diamond:
    \"\"\"A leaf reached at two depths; its first path is the deeper one.\"\"\"

    def __init__(self):
        leaf = Block(1.5)
        self.x = Twice()
        self.x.blk = leaf
        self.y = leaf

    def __call__(self, x):
        return self.x(x) + self.y(x)


@DECORATE
class Emb:
    def __init__(self):
        self.w = jnp.arange(4.0).reshape(2, 2) / 4 + 0.5

    def __call__(self, x):
        return x @ self.w


@DECORATE
class Head:
    def __init__(self):
        self.w = jnp.ones((2, 2))
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, h):
        self.calls += 1
        return h @ self.w.T


@DECORATE
class LM:
    \"\"\"PyTorch-style tying: the same array object in two attributes.\"\"\"

    def __init__(self):
        self.embed = Emb()
        self.head = Head()
        self.head.w = self.embed.w

    def __call__(self, x):
        return jnp.tanh(self.head(self.embed(x))).sum()


@DECORATE
class Norm:
    def __init__(self, mean):
        self.mean = mean

    def __call__(self, x):
        self.mean = 0.5 * self.mean + x
        return self.mean


@DECORATE
class TiedStat:
    \"\"\"Two modules start from one running-mean array object, then diverge.\"\"\"

    def __init__(self):
        init = jnp.zeros(2)
        self.a = Norm(init)
        self.b = Norm(init)

    def __call__(self, x):
        return self.a(x) + self.b(2 * x)


@DECORATE
class Child:
    def __init__(self):
        self.n = jnp.zeros(())
        self.parent = None

    def __call__(self, x):
        self.n = self.n + x
        return self.n * self.parent.scale


@DECORATE
class Parent:
    \"\"\"A cycle: the child holds its parent.\"\"\"

    def __init__(self):
        self.scale = jnp.full((), 2.0)
        self.child = Child()
        self.child.parent = self
        self.total = jnp.zeros(())

    def __call__(self, x):
        y = self.child(x)
        self.total = self.total + y
        return y + self.child.parent.total * self.scale

    def read(self, x):
        return self.scale * x + self.total


@DECORATE
class Selfish:
    \"\"\"A model in its own list and dict.\"\"\"

    def __init__(self):
        self.n = jnp.zeros(())
        self.w = jnp.full((), 3.0)
        self.me = [self]
        self.d = {"me": self}

    def __call__(self, x):
        self.n = self.me[0].n + x * self.d["me"].w
        return self.me[0].n + self.d["me"].n


@DECORATE
class A:
    def __init__(self):
        self.n = jnp.zeros(())
        self.w = jnp.full((), 1.5)
        self.other = None

    def __call__(self, x):
        self.n = self.n + x * self.w
        return self.other(x) + self.n

    def peek(self):
        return self.other.other.n + self.other.n


@DECORATE
class B:
    def __init__(self, a):
        self.n = jnp.zeros(())
        self.other = a

    def __call__(self, x):
        self.n = self.n + 2 * x * self.other.w
        return self.n


def mutual():
    a = A()
    a.other = B(a)
    return a


@DECORATE
class Act:
    def __init__(self, kind):
        self.kind = kind
        self.mode = "train"
        self.w = jnp.full((2,), 2.0)

    def __call__(self, x):
        y = jnp.tanh(x) if self.kind == "tanh" else jax.nn.relu(x)
        return y * self.w if self.mode == "train" else y

    def eval(self):
        self.mode = "eval"


@DECORATE
class Modes:
    \"\"\"A static str state on a shared sub-model; a str config shared by two.\"\"\"

    def __init__(self):
        act = Act("tanh")
        self.a = act
        self.b = act
        cfg = "relu"
        self.c = Act(cfg)
        self.d = Act(cfg)

    def __call__(self, x):
        return self.a(x) + self.b(x) + self.c(x) + self.d(x)

    def eval(self):
        self.b.eval()


@DECORATE
class Pool:
    \"\"\"A dict state (declared) holding a sub-model that is also an attribute.\"\"\"

    def __init__(self):
        blk = Block(3.0)
        self.pool = STATE({"a": blk})
        self.alias = blk

    def __call__(self, x):
        return self.pool["a"](x) + self.alias(x)


@DECORATE
class Rot:
    \"\"\"A list of sub-models reordered inside a call.\"\"\"

    def __init__(self):
        self.blocks = [Block(1.0), Block(2.0)]

    def __call__(self, x):
        y = self.blocks[0](x)
        self.blocks = self.blocks[::-1]
        return y


@DECORATE
class Bag:
    \"\"\"Array and container states, for aliasing across the f boundary.\"\"\"

    def __init__(self):
        self.n = jnp.zeros(2)
        self.items = [jnp.zeros(())]
        self.d = {"k": jnp.zeros(())}
        self.w = jnp.full((2,), 2.0)

    def __call__(self, x):
        self.n = self.n + x
        self.items = self.items + [jnp.asarray(x)]
        self.d["k"] = self.d["k"] + x
        return self.n * self.w + len(self.items)


@DECORATE
class KV:
    def __init__(self):
        self.kv = STATE(jnp.zeros(2), name="kv", category="cache")
        self.n = jnp.zeros(())

    def __call__(self, x):
        self.kv = self.kv + x
        self.n = self.n + 1
        return self.kv * self.n


@DECORATE
class SharedKV:
    \"\"\"A sub-model with an explicitly named state, on two paths.\"\"\"

    def __init__(self):
        k = KV()
        self.a = k
        self.b = [k]

    def __call__(self, x):
        return self.a(x) + self.b[0](x)


@DECORATE
class DictOrder:
    \"\"\"A shared sub-model under dict keys whose insertion order is not sorted.\"\"\"

    def __init__(self):
        blk = Block(1.0)
        self.d = {"z": blk, "a": blk}
        self.c = blk

    def __call__(self, x):
        return self.c(x) + self.d["a"](x)
"""


py312 = pytest.mark.skipif(sys.version_info < (3, 12), reason="Python 3.12 syntax")


py313 = pytest.mark.skipif(sys.version_info < (3, 13), reason="Python 3.13 semantics")


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


TRACEBACKS = '''
import functools
import sys


def passthrough(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


@DECORATE
class Tb[T]:
    """Class docstring.

        Indented.
    """

    def __init__(self):
        self.n = jnp.zeros(())
        self.count = 0

    @passthrough
    @functools.cache
    def cached(self):
        return 1

    @passthrough
    def fails[U](
        self,
        v: U,
        *,
        k: int = 2,
    ) -> U:
        """Docstring.

            With indented lines, which 3.13 strips.
        """
        self.n = self.n + v * k
        frame_line = sys._getframe().f_lineno
        if self.n is not None:
            raise ValueError(f"{self.n=}")  # RAISE
        return frame_line

    def fails_in_handler(self, v):
        """One line."""
        try:
            raise ExceptionGroup("g", [KeyError(1)])
        except* KeyError:
            self.n = self.n + v
            {}["missing"]  # RAISE

    def fails_in_comprehension(self, v):
        self.n = self.n + v
        return [1 / (k - 1) for k in range(3) if self.n is not None]  # RAISE

    def fails_in_fstring(self, v):
        self.n = self.n + v
        return f"{
            self.n
            :{self.count}d}"  # RAISE

    def static_write(self, v):
        """Writes a Python int state."""
        self.n = self.n + v
        self.count = self.count + 1  # HERE
        return self.n
'''


GAN = """
import optax


@DECORATE
class Gen:
    def __init__(self, key, z=2, d=3):
        self.w = jax.random.normal(key, (z, d)) * 0.5

    def __call__(self, z):
        return jnp.tanh(z @ self.w)


@DECORATE
class Disc:
    def __init__(self, key, d=3):
        self.w = jax.random.normal(key, (d,)) * 0.5

    def __call__(self, x):
        return x @ self.w


@DECORATE
class GAN:
    def __init__(self, seed):
        kg, kd, kk = jax.random.split(jax.random.PRNGKey(seed), 3)
        self.G = Gen(kg)
        self.D = Disc(kd)
        self.g_opt = optax.adam(0.05)
        self.d_opt = optax.sgd(0.1, momentum=0.9)
        self.g_w = self.G.w
        self.d_w = self.D.w
        self.g_state = self.g_opt.init(self.g_w)
        self.d_state = self.d_opt.init(self.d_w)
        self.key = kk
        self.step = jnp.zeros((), jnp.int32)

    def d_loss(self, dw, real, z):
        fake = jax.lax.stop_gradient(jnp.tanh(z @ self.g_w))
        return jax.nn.softplus(-(real @ dw)).mean() + jax.nn.softplus(fake @ dw).mean()

    def g_loss(self, gw, z):
        return jax.nn.softplus(-(jnp.tanh(z @ gw) @ jax.lax.stop_gradient(self.d_w))).mean()

    def train_step(self, real):
        self.key, kd, kg = jax.random.split(self.key, 3)
        zd = jax.random.normal(kd, (real.shape[0], 2))
        ld, gd = jax.value_and_grad(self.d_loss)(self.d_w, real, zd)
        upd, self.d_state = self.d_opt.update(gd, self.d_state, self.d_w)
        self.d_w = optax.apply_updates(self.d_w, upd)
        zg = jax.random.normal(kg, (real.shape[0], 2))
        lg, gg = jax.value_and_grad(self.g_loss)(self.g_w, zg)
        upd, self.g_state = self.g_opt.update(gg, self.g_state, self.g_w)
        self.g_w = optax.apply_updates(self.g_w, upd)
        self.step += 1
        return ld, lg

    def generate(self, z):
        return jnp.tanh(z @ self.g_w), self.D(jnp.tanh(z @ self.g_w))
"""


REAL = jnp.array([[1.0, 0.5, -0.5], [0.8, 0.4, -0.2]])


MOE = """
@DECORATE
class MoE:
    def __init__(self, seed, d=3, n=4, k=2, use_argsort=False):
        k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
        self.router = jax.random.normal(k1, (d, n))
        self.experts = jax.random.normal(k2, (n, d, d)) * 0.5
        self.usage = jnp.zeros(n, jnp.int32)
        self.aux = jnp.zeros(())
        self.k = k
        self.n = n
        self.use_argsort = use_argsort

    def __call__(self, x):
        logits = x @ self.router
        if self.use_argsort:
            idx = jnp.argsort(-logits, axis=-1)[:, : self.k]
            vals = jnp.take_along_axis(logits, idx, axis=-1)
        else:
            vals, idx = jax.lax.top_k(logits, self.k)
        gates = jax.nn.softmax(vals, -1)
        chosen = self.experts[idx]
        y = jnp.einsum("bd,bkde->bke", x, chosen)
        out = jnp.einsum("bk,bke->be", gates, y)
        self.usage = self.usage.at[idx.reshape(-1)].add(1)
        frac = jax.nn.one_hot(idx, self.n).sum(1).mean(0)
        probs = jax.nn.softmax(logits, -1).mean(0)
        self.aux = self.n * jnp.sum(frac * probs)
        return out, self.aux

    def loss(self, x, y):
        out, aux = self(x)
        return ((out - y) ** 2).mean() + 0.01 * aux
"""


XM = jnp.array([[0.5, -1.0, 0.2], [1.0, 0.3, -0.4], [-0.2, 0.1, 0.9], [0.0, 0.7, -0.7]])


DQN = """
@DECORATE
class DQN:
    def __init__(self, seed, obs=2, act=3, cap=4, sync_every=2, sync="where"):
        k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
        self.w = jax.random.normal(k1, (obs, act)) * 0.5
        self.target_w = self.w
        self.obs_buf = jnp.zeros((cap, obs))
        self.act_buf = jnp.zeros(cap, jnp.int32)
        self.rew_buf = jnp.zeros(cap)
        self.next_buf = jnp.zeros((cap, obs))
        self.ptr = jnp.zeros((), jnp.int32)
        self.size = jnp.zeros((), jnp.int32)
        self.step = jnp.zeros((), jnp.int32)
        self.key = jax.random.key(seed + 3)
        self.cap = cap
        self.sync_every = sync_every
        self.sync = sync
        self.batch = 3

    def add(self, o, a, r, o2):
        i = self.ptr
        self.obs_buf = self.obs_buf.at[i].set(o)
        self.act_buf = self.act_buf.at[i].set(a)
        self.rew_buf = self.rew_buf.at[i].set(r)
        self.next_buf = self.next_buf.at[i].set(o2)
        self.ptr = (self.ptr + 1) % self.cap
        self.size = jnp.minimum(self.size + 1, self.cap)

    def sample(self, n):
        self.key, sub = jax.random.split(self.key)
        idx = jax.random.randint(sub, (n,), 0, self.size)
        return self.obs_buf[idx], self.act_buf[idx], self.rew_buf[idx], self.next_buf[idx]

    def _sync(self):
        self.target_w = self.w

    def train_step(self, lr, gamma):
        n = self.batch
        o, a, r, o2 = self.sample(n)
        target = r + gamma * (o2 @ self.target_w).max(-1)

        def loss(w):
            q = jnp.take_along_axis(o @ w, a[:, None], 1)[:, 0]
            return ((q - target) ** 2).mean()

        l, g = jax.value_and_grad(loss)(self.w)
        self.w = self.w - lr * g
        self.step += 1
        due = self.step % self.sync_every == 0
        if self.sync == "where":
            self.target_w = jnp.where(due, self.w, self.target_w)
        elif self.sync == "cond":
            self.target_w = lax.cond(due, lambda: self.w, lambda: self.target_w)
        else:
            lax.cond(due, self._sync, lambda: None)
        return l
"""


TRANSITIONS = [
    (jnp.array([0.1, 0.2]), jnp.int32(0), jnp.float32(1.0), jnp.array([0.3, 0.1])),
    (jnp.array([0.3, 0.1]), jnp.int32(2), jnp.float32(-1.0), jnp.array([0.0, 0.5])),
    (jnp.array([0.0, 0.5]), jnp.int32(1), jnp.float32(0.5), jnp.array([0.2, -0.2])),
]


OPTAX_TRAINER = """
import optax


@DECORATE
class Model:
    def __init__(self, seed):
        k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
        self.w = jax.random.normal(k1, (3, 2)) * 0.5
        self.b = jnp.zeros(2)

    def __call__(self, x):
        return jnp.tanh(x @ self.w + self.b)

    def loss(self, x, y):
        return ((self(x) - y) ** 2).mean()


@DECORATE
class StateModel(Model):
    def __init__(self, seed):
        k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
        self.w = STATE(jax.random.normal(k1, (3, 2)) * 0.5)
        self.b = STATE(jnp.zeros(2))


@DECORATE
class Trainer:
    def __init__(self, seed, lr=0.1, cls=StateModel):
        self.model = cls(seed)
        self.opt = optax.adam(lr)
        self.opt_state = self.opt.init((self.model.w, self.model.b))
        self.step = jnp.zeros((), jnp.int32)

    def train_step(self, batch):
        x, y = batch
        loss, g = jax.value_and_grad(lambda m: m.loss(x, y))(self.model)
        grads = (g.w, g.b)
        upd, self.opt_state = self.opt.update(grads, self.opt_state)
        self.model.w = self.model.w + upd[0]
        self.model.b = self.model.b + upd[1]
        self.step += 1
        return loss

    def fit(self, xs, ys):
        _, losses = lax.scan(lambda c, b: (c, self.train_step(b)), None, (xs, ys))
        return losses


@DECORATE
class ParamTrainer:
    def __init__(self, seed, lr=0.1):
        self.model = Model(seed)
        self.opt = optax.sgd(lr)
        self.params = (self.model.w, self.model.b)
        self.opt_state = self.opt.init(self.params)
        self.step = jnp.zeros((), jnp.int32)

    def _loss(self, params, x, y):
        w, b = params
        return ((jnp.tanh(x @ w + b) - y) ** 2).mean()

    def train_step(self, batch):
        loss, g = jax.value_and_grad(self._loss)(self.params, *batch)
        upd, self.opt_state = self.opt.update(g, self.opt_state)
        self.params = optax.apply_updates(self.params, upd)
        self.step += 1
        return loss

    def fit(self, xs, ys):
        _, losses = lax.scan(lambda c, b: (c, self.train_step(b)), None, (xs, ys))
        return losses
"""


TRAIN_XS = jnp.arange(18.0).reshape(3, 2, 3) / 10.0


YS = jnp.sin(jnp.arange(12.0)).reshape(3, 2, 2)


VMAPCK = """
@DECORATE
class Counter:
    def __init__(self):
        self.w = jnp.array([1.0, 2.0])
        self.n = jnp.zeros((), jnp.int32)
        self.total = jnp.zeros(())

    def pure(self, x):
        return jnp.tanh(x * self.w)

    def counted(self, x):
        self.n += 1
        return x * self.w

    def summed(self, x):
        self.total = self.total + x.sum()
        return x * self.w


@DECORATE
class Block:
    def __init__(self, scale):
        self.w = jnp.eye(2) * scale
        self.mean = jnp.zeros(2)
        self.calls = jnp.zeros((), jnp.int32)

    def forward(self, x):
        self.mean = 0.5 * self.mean + 0.5 * x.mean(0)
        self.calls += 1
        return jnp.tanh(x @ self.w) + x


@DECORATE
class Net:
    def __init__(self):
        self.sub = Counter()
        self.blocks = [Block(0.5), Block(1.5)]

    def vmapped_pure(self, xs):
        return jax.vmap(self.sub.pure)(xs)

    def vmapped_writer(self, xs):
        return jax.vmap(self.sub.counted)(xs)

    def vmapped_batched_writer(self, xs):
        return jax.vmap(self.sub.summed)(xs)

    def __call__(self, x):
        for b in self.blocks:
            x = checkpoint(b.forward)(x)
        return x

    def loss(self, x):
        return (self(x) ** 2).sum()
"""


XB_VMAP = jnp.array([[0.1, 0.2], [0.3, -0.4], [1.0, 0.5]])


EMA_LR = """
import optax


@DECORATE
class EMA:
    def __init__(self):
        self.w = jnp.array([1.0, 2.0])
        self.ema_w = self.w
        self.step = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        return (x * self.w).sum()

    def update_ema(self):
        self.ema_w = 0.5 * self.ema_w + 0.5 * self.w
        self.step += 1


@DECORATE
class Scheduled:
    def __init__(self):
        self.w = jnp.array([1.0, 2.0])
        self.opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
        self.opt_state = self.opt.init(self.w)

    def step(self, x):
        hp = self.opt_state.hyperparams
        hp["learning_rate"] = hp["learning_rate"] * 0.5
        g = jax.grad(lambda w: (jnp.sin(w) * x).sum())(self.w)
        u, self.opt_state = self.opt.update(g, self.opt_state)
        self.w = self.w + u
        return self.w
"""


A1 = jnp.asarray(1.0)


A2 = jnp.asarray(2.0)


V2_RANGE = jnp.arange(2.0)


NESTED_GEN = """
@DECORATE
class G:
    def __init__(self):
        self.x = jnp.zeros(())
    def run(self, k):
        def gen():
            for i in range(3):
                self.x = self.x + k * i
                yield self.x
        return jnp.stack(list(gen()))
    def lazy(self, k):
        def gen():
            for i in range(3):
                self.x = self.x + k * i
                yield self.x
        return gen()
"""


NORMS = """
@DECORATE
class ActNorm:
    def __init__(self, d):
        self.logs = jnp.zeros(d)
        self.bias = jnp.zeros(d)
        self.initialized = False

    def initialize(self, x):
        self.bias = -x.mean(0)
        self.logs = -jnp.log(x.std(0) + 1e-6)
        self.initialized = True

    def __call__(self, x):
        if not self.initialized:
            self.initialize(x)
        y = (x + self.bias) * jnp.exp(self.logs)
        return y, jnp.sum(self.logs) * x.shape[0]


@DECORATE
class ActNormArr:
    def __init__(self, d):
        self.logs = jnp.zeros(d)
        self.bias = jnp.zeros(d)
        self.initialized = jnp.zeros((), bool)

    def __call__(self, x):
        first = ~self.initialized
        self.bias = jnp.where(first, -x.mean(0), self.bias)
        self.logs = jnp.where(first, -jnp.log(x.std(0) + 1e-6), self.logs)
        self.initialized = self.initialized | True
        return (x + self.bias) * jnp.exp(self.logs)


@DECORATE
class Glow:
    def __init__(self, d, n):
        self.norms = [ActNorm(d) for _ in range(n)]
        self.w = jnp.eye(d) * 0.7 + 0.05

    def __call__(self, x):
        logdet = 0.0
        for n in self.norms:
            x, ld = n(x)
            logdet = logdet + ld
            x = x @ self.w
        return x, logdet


@DECORATE
class SpectralNorm:
    def __init__(self, seed, din, dout, n_power=1, loop=False):
        k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
        self.w = jax.random.normal(k1, (dout, din))
        u = jax.random.normal(k2, (dout,))
        self.u = u / jnp.linalg.norm(u)
        self.n_power = n_power
        self.loop = loop
        self.training = True

    def train(self, mode=True):
        self.training = mode
        return self

    def eval(self):
        return self.train(False)

    def _power_step(self, i, v):
        v = self.w.T @ self.u
        v = v / jnp.linalg.norm(v)
        u = self.w @ v
        self.u = u / jnp.linalg.norm(u)
        return v

    def weight(self):
        if self.training:
            if self.loop:
                v = lax.fori_loop(0, self.n_power, self._power_step, jnp.zeros(self.w.shape[1]))
            else:
                for i in range(self.n_power):
                    v = self._power_step(i, None)
            self.u = jax.lax.stop_gradient(self.u)
        else:
            v = self.w.T @ self.u
            v = v / jnp.linalg.norm(v)
        sigma = self.u @ self.w @ v
        return self.w / sigma

    def __call__(self, x):
        return x @ self.weight().T


@DECORATE
class WeightNorm:
    def __init__(self, seed, din, dout):
        self.v = jax.random.normal(jax.random.PRNGKey(seed), (dout, din))
        self.g = jnp.linalg.norm(self.v, axis=1) * 0.5
        self.weight = self.g[:, None] * self.v / jnp.linalg.norm(self.v, axis=1, keepdims=True)

    def _recompute(self):
        self.weight = self.g[:, None] * self.v / jnp.linalg.norm(self.v, axis=1, keepdims=True)

    def __call__(self, x):
        self._recompute()
        return jnp.tanh(x @ self.weight.T)
"""


XA = jnp.array([[1.0, 2.0, 0.0], [3.0, -2.0, 1.0], [2.0, 0.0, 5.0], [0.5, 1.0, -1.0]])


RNN = """
@DECORATE
class GRUCell:
    def __init__(self, seed, din, dh, chunk=2):
        ks = jax.random.split(jax.random.PRNGKey(seed), 3)
        self.chunk = chunk
        self.wz = jax.random.normal(ks[0], (din + dh, dh)) * 0.4
        self.wr = jax.random.normal(ks[1], (din + dh, dh)) * 0.4
        self.wh = jax.random.normal(ks[2], (din + dh, dh)) * 0.4
        self.dh = dh
        self.h = jnp.zeros(dh)
        self.steps = jnp.zeros((), jnp.int32)

    def reset(self):
        self.h = jnp.zeros(self.dh)

    def step(self, x):
        hx = jnp.concatenate([x, self.h])
        z = jax.nn.sigmoid(hx @ self.wz)
        r = jax.nn.sigmoid(hx @ self.wr)
        hh = jnp.tanh(jnp.concatenate([x, r * self.h]) @ self.wh)
        self.h = (1 - z) * self.h + z * hh
        self.steps += 1
        return self.h

    def _body(self, carry, x):
        h = self.step(x)
        return carry + h.sum(), h

    def run_bound(self, xs):
        total, hs = lax.scan(self._body, 0.0, xs)
        return total, hs

    def run_closure(self, xs, scale):
        def body(carry, x):
            h = self.step(x * scale)
            return carry + 1, h * carry

        n, hs = lax.scan(body, jnp.zeros((), jnp.int32), xs)
        return n, hs

    def cell(self, h, x):
        self.h = h
        return self.step(x), self.h.sum()

    def run_carry(self, xs):
        return lax.scan(self.cell, self.h, xs)

    def run_remat(self, xs):
        return lax.scan(checkpoint(self._body), 0.0, xs)

    def run_step_direct(self, xs):
        def body(c, x):
            return c, self.step(x)
        return lax.scan(body, None, xs)[1]

    def tbptt(self, xs):
        loss = 0.0
        chunk = self.chunk
        for i in range(0, xs.shape[0], chunk):
            self.h = jax.lax.stop_gradient(self.h)
            _, hs = lax.scan(self._body, 0.0, xs[i:i + chunk])
            loss = loss + (hs ** 2).sum()
        return loss


@DECORATE
class Seq2:
    def __init__(self, seed, din, dh):
        self.enc = GRUCell(seed, din, dh)
        self.dec = GRUCell(seed + 1, dh, dh)

    def __call__(self, xs):
        self.enc.reset()
        self.dec.reset()
        hs = self.enc.run_step_direct(xs)
        self.dec.h = self.enc.h
        outs = lax.scan(lambda c, h: (c, self.dec.step(h)), None, hs)[1]
        return outs.sum(0)
"""


XS_SEQ = jnp.array([[0.5, -1.0], [1.0, 0.3], [-0.2, 0.8], [0.0, 1.5], [0.7, -0.4], [1.1, 0.2]])


KV = """
@DECORATE
class KVCache:
    def __init__(self, max_len, d, use_dus=False):
        self.k = jnp.zeros((max_len, d))
        self.v = jnp.zeros((max_len, d))
        self.pos = jnp.zeros((), jnp.int32)
        self.use_dus = use_dus

    def reset(self):
        self.k = jnp.zeros_like(self.k)
        self.v = jnp.zeros_like(self.v)
        self.pos = jnp.zeros((), jnp.int32)

    def append(self, k, v):
        if self.use_dus:
            self.k = jax.lax.dynamic_update_slice(self.k, k[None], (self.pos, 0))
            self.v = jax.lax.dynamic_update_slice(self.v, v[None], (self.pos, 0))
        else:
            self.k = self.k.at[self.pos].set(k)
            self.v = self.v.at[self.pos].set(v)
        self.pos = self.pos + 1

    def attend(self, q):
        mask = jnp.arange(self.k.shape[0]) < self.pos
        s = jnp.where(mask, self.k @ q, -1e9)
        return jax.nn.softmax(s) @ self.v


@DECORATE
class Decoder:
    def __init__(self, seed, d, max_len, use_dus=False):
        ks = jax.random.split(jax.random.PRNGKey(seed), 3)
        self.wq = jax.random.normal(ks[0], (d, d)) * 0.5
        self.wk = jax.random.normal(ks[1], (d, d)) * 0.5
        self.wv = jax.random.normal(ks[2], (d, d)) * 0.5
        self.cache = KVCache(max_len, d, use_dus)
        self.generated = jnp.zeros((max_len, d))

    def step(self, x):
        self.cache.append(x @ self.wk, x @ self.wv)
        y = jnp.tanh(self.cache.attend(x @ self.wq) + x)
        self.generated = self.generated.at[self.cache.pos - 1].set(y)
        return y

    def decode(self, x, n):
        def body(i, x):
            return self.step(x)
        return lax.fori_loop(0, n, body, x)

    def decode_bound(self, x, n):
        return lax.fori_loop(0, n, lambda i, x: self.step(x), x)

    def prefill_then_decode(self, xs, n):
        self.cache.reset()
        for t in range(xs.shape[0]):
            last = self.step(xs[t])
        return self.decode(last, n)
"""


XK = jnp.array([[0.5, -1.0, 0.2], [1.0, 0.3, -0.4], [-0.2, 0.8, 0.1]])


OPT = """
@DECORATE
class MLP:
    def __init__(self, seed, d):
        k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
        self.params = {"w": jax.random.normal(k1, (d, 1)) * 0.5, "b": jnp.zeros(1)}

    def apply(self, params, x):
        return (x @ params["w"] + params["b"])[:, 0]

    def loss(self, params, x, y):
        return ((self.apply(params, x) - y) ** 2).mean()

    def set_params(self, params):
        self.params = params


@DECORATE
class Adam:
    def __init__(self, params, lr=0.1, b1=0.9, b2=0.99, eps=1e-8):
        self.m = jax.tree_util.tree_map(jnp.zeros_like, params)
        self.v = jax.tree_util.tree_map(jnp.zeros_like, params)
        self.t = jnp.zeros((), jnp.int32)
        self.lr, self.b1, self.b2, self.eps = lr, b1, b2, eps

    def step(self, model, grads):
        self.t += 1
        tm = jax.tree_util.tree_map
        self.m = tm(lambda m, g: self.b1 * m + (1 - self.b1) * g, self.m, grads)
        self.v = tm(lambda v, g: self.b2 * v + (1 - self.b2) * g * g, self.v, grads)
        c1 = 1 - self.b1 ** self.t
        c2 = 1 - self.b2 ** self.t
        model.set_params(tm(lambda p, m, v: p - self.lr * (m / c1) / (jnp.sqrt(v / c2) + self.eps),
                            model.params, self.m, self.v))

    def step_direct(self, model, grads):
        self.t += 1
        model.params = jax.tree_util.tree_map(lambda p, g: p - self.lr * g, model.params, grads)


@DECORATE
class Trainer:
    def __init__(self, seed, d, direct=False):
        self.model = MLP(seed, d)
        self.opt = Adam(self.model.params)
        self.direct = direct
        self.losses = jnp.zeros(4)

    def train_step(self, x, y):
        loss, g = jax.value_and_grad(self.model.loss)(self.model.params, x, y)
        if self.direct:
            self.opt.step_direct(self.model, g)
        else:
            self.opt.step(self.model, g)
        self.losses = self.losses.at[self.opt.t % 4].set(loss)
        return loss

    def fit(self, xs, ys):
        def body(c, xy):
            return c, self.train_step(*xy)
        return lax.scan(body, 0, (xs, ys))[1]
"""


XO = jnp.array([[0.5, -1.0], [1.0, 0.3], [-0.2, 0.8]])


YO = jnp.array([1.0, -0.5, 0.25])


RNG = """
@DECORATE
class Noisy:
    def __init__(self, seed, p=0.3, new_style=False):
        self.key = jax.random.key(seed) if new_style else jax.random.PRNGKey(seed)
        self.p = p
        self.calls = jnp.zeros((), jnp.int32)

    def dropout(self, x):
        self.key, sub = jax.random.split(self.key)
        keep = jax.random.bernoulli(sub, 1 - self.p, x.shape)
        self.calls += 1
        return jnp.where(keep, x / (1 - self.p), 0.0)

    def __call__(self, x):
        return self.dropout(x) + 0.01 * self.noise(x.shape)

    def noise(self, shape):
        self.key, sub = jax.random.split(self.key)
        return jax.random.normal(sub, shape)

    def maybe_drop(self, x, flag):
        return lax.cond(flag, self.dropout, lambda x: x, x)

    def many(self, xs):
        return lax.scan(lambda c, x: (c, self.dropout(x)), None, xs)[1]

    def sample_while(self, thresh):
        def cond(c):
            return c[1] < thresh
        def body(c):
            return c[0] + 1, c[1] + jax.random.uniform(self.next_key())
        return lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), jnp.zeros(())))

    def next_key(self):
        self.key, sub = jax.random.split(self.key)
        return sub

    def fresh(self):
        return jax.random.uniform(self.next_key(), (2,))


@DECORATE
class Stack:
    def __init__(self, seed, new_style=True):
        self.drops = [Noisy(seed), Noisy(seed + 1, new_style=new_style)]
        self.key = jax.random.PRNGKey(seed + 100)

    def __call__(self, x):
        self.key, k = jax.random.split(self.key)
        x = x + jax.random.normal(k, x.shape) * 0.1
        for d in self.drops:
            x = d(x)
        return x
"""


XR = jnp.array([[0.5, -1.0, 0.2, 1.0], [1.0, 0.3, -0.4, 2.0]])


TORCHLIKE = """
class Module:
    def children(self):
        out = []
        for v in vars(self).values():
            if isinstance(v, Module):
                out.append(v)
            elif isinstance(v, (list, tuple)):
                out.extend(c for c in v if isinstance(c, Module))
            elif isinstance(v, dict):
                out.extend(c for c in v.values() if isinstance(c, Module))
        return out

    def modules(self):
        yield self
        for c in self.children():
            yield from c.modules()

    def train(self, mode=True):
        self.training = mode
        for c in self.children():
            c.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def apply(self, fn):
        for c in self.children():
            c.apply(fn)
        fn(self)
        return self

    def buffers(self):
        return [v for k, v in sorted(vars(self).items()) if isinstance(v, jax.Array)]


@DECORATE
class BN(Module):
    def __init__(self, d):
        self.training = True
        self.mean = jnp.zeros(d)
        self.nbt = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        if self.training:
            self.mean = 0.9 * self.mean + 0.1 * x.mean(0)
            self.nbt += 1
            return x - x.mean(0)
        return x - self.mean


@DECORATE
class Net(Module):
    def __init__(self, d):
        self.training = True
        self.layers = [BN(d), BN(d)]
        self.head = {"h": BN(d)}
        self.teacher = copy.deepcopy(self.layers[0])
        self.w = jnp.ones((d, d)) * 0.3

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x) @ self.w
        self.teacher.mean = 0.5 * self.teacher.mean + 0.5 * self.layers[0].mean
        return self.head["h"](x)

    def count(self):
        return sum(m.nbt for m in self.modules() if isinstance(m, BN))

    def all_buffers(self):
        return [b for m in self.modules() for b in m.buffers()]

    def scan_calls(self, xs):
        return lax.scan(lambda c, x: (c + self(x).sum(), None), 0.0, xs)[0]
"""


INPLACE = """
def sgd_(model, grads, lr):
    for i, (p, g) in enumerate(zip(model.params, grads)):
        model.params[i] = p - lr * g


@DECORATE
class Lin:
    def __init__(self, seed, d):
        self.params = [jax.random.normal(jax.random.PRNGKey(seed), (d, 1)) * 0.5, jnp.zeros(1)]

    def loss(self, params, x, y):
        return (((x @ params[0] + params[1])[:, 0] - y) ** 2).mean()

    def load(self, params):
        self.params = list(params)


@DECORATE
class Fit:
    def __init__(self, seed, d, lr=0.1):
        self.model = Lin(seed, d)
        self.lr = lr
        self.t = jnp.zeros((), jnp.int32)

    def train_step(self, x, y):
        loss, g = jax.value_and_grad(self.model.loss)(self.model.params, x, y)
        sgd_(self.model, g, self.lr)
        self.t += 1
        return loss

    def loop(self, xs, ys):
        return jnp.stack([self.train_step(x, y) for x, y in zip(xs, ys)])

    def scan(self, xs, ys):
        return lax.scan(lambda c, xy: (c, self.train_step(*xy)), 0, (xs, ys))[1]
"""


XO2 = jnp.stack([XO, XO * 2, -XO])


YO2 = jnp.stack([YO, YO, YO * 2])


NET = """
@DECORATE
class Leaf:
    def __init__(self, s):
        self.w = jnp.full((2,), s)
        self.count = jnp.zeros((), jnp.int32)
        self.mean = jnp.zeros(2)

    def __call__(self, x):
        self.count += 1
        self.mean = 0.5 * self.mean + 0.5 * x
        return x * self.w + self.mean

    def reset(self):
        self.count = jnp.zeros((), jnp.int32)
        self.mean = jnp.zeros(2)


@DECORATE
class Net:
    def __init__(self, scale=1.0):
        shared = Leaf(0.5 * scale)
        self.items = [Leaf(1.0 * scale), shared]
        self.by = {"a": Leaf(0.25 * scale), "b": shared}
        self.pair = (Leaf(0.75 * scale), Leaf(-0.5 * scale))
        self.bias = jnp.array([0.1, -0.2]) * scale
        self.total = jnp.zeros(2)
        self.seen = jnp.zeros((), jnp.int32)
        self.pos = jnp.array(False)

    def __call__(self, x):
        for leaf in self.items:
            x = jnp.tanh(leaf(x))
        x = self.by["a"](x) + self.by["b"](x)
        x = self.pair[0](x) - self.pair[1](x) + self.bias
        self.total = self.total + x
        self.seen += 1
        self.pos = x.sum() > 0
        return x

    def loss(self, x, y):
        return ((self(x) - y) ** 2).sum()

    def peek(self):
        return self.total + self.by["b"].mean
"""


XV1 = jnp.array([0.3, -0.7])


XV2 = jnp.array([1.1, 0.4])


Y = jnp.array([0.5, -0.5])


ODD = """
@DECORATE
class Odd:
    def __init__(self):
        self.w = jnp.array([1.0, -2.0])
        self.gain = 0.5
        self.cache = {"k": None, "v": jnp.zeros(2)}
        self.empty_l = []
        self.empty_d = {}
        self.empty_t = ()
        self.hits = jnp.zeros((), jnp.int32)
        self.flag = jnp.array(False)
        self.bytes = jnp.array([250, 3], jnp.uint8)
        self.small = jnp.array([120, -3], jnp.int8)
        self.nothing = None

    def __call__(self, x):
        self.gain = self.gain * 1.5
        self.cache = {"k": None, "v": self.cache["v"] + x}
        self.empty_l = list(self.empty_l)
        self.empty_d = dict(self.empty_d)
        self.empty_t = tuple(self.empty_t)
        self.hits += 1
        self.flag = ~self.flag
        self.bytes = self.bytes + jnp.uint8(4)
        self.small = self.small + jnp.int8(5)
        self.nothing = None
        return x * self.w * self.gain + jnp.where(self.flag, 1.0, 0.0)

    def peek(self):
        return self.cache["v"] * self.gain + self.hits
"""


TWO_PARENTS = """
@DECORATE
class Norm:
    def __init__(self):
        self.scale = jnp.array([1.0, 0.5])
        self.mean = jnp.zeros(2)
        self.n = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.n += 1
        self.mean = self.mean + (x - self.mean) / self.n
        return (x - self.mean) * self.scale


@DECORATE
class Block:
    def __init__(self, norm, w):
        self.norm = norm
        self.w = jnp.full((2,), w)
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.calls += 1
        return jnp.tanh(self.norm(x) * self.w)


@DECORATE
class Root:
    def __init__(self):
        norm = Norm()
        self.enc = Block(norm, 1.5)
        self.dec = Block(norm, -0.5)

    def __call__(self, x):
        return self.dec(self.enc(x))

    def loss(self, x, y):
        return ((self(x) - y) ** 2).sum()
"""


_COUNTER = itertools.count()


V3_RANGE = jnp.arange(3.0)


XS_SIGNED = jnp.array([0.5, -1.0, 2.0, 1.5])


OUTSIDE_WRAPPED = """
def logged(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


def counting(fn):
    @functools.wraps(fn)
    def wrapper(self, *args):
        self.calls = self.calls + 1
        return fn(self, *args)
    return wrapper


def _step(self, carry, x):
    self.total = self.total + x * self.w
    self.n += 1
    return carry + self.total, self.total * 2.0


def _body(self, i, c):
    self.total = self.total * 0.5 + i
    return c + self.total


def _up(self, x):
    self.total = self.total + x
    return x * 2.0


def _down(self, x):
    self.n -= 1
    return x - self.total


@DECORATE
class Base:
    def __init__(self):
        self.w = jnp.asarray(1.5)
        self.total = jnp.zeros(())
        self.n = jnp.zeros((), jnp.int32)
        self.calls = jnp.zeros((), jnp.int32)

    step = logged(_step)
    body = counting(_body)
    up = logged(_up)
    down = counting(_down)


class Child(Base):
    def scan(self, xs):
        c, ys = lax.scan(self.step, 0.0, xs)
        return c, ys

    def fori(self, x):
        return lax.fori_loop(0, 3, self.body, x)

    def branch(self, x):
        return lax.cond(x > 0, self.up, self.down, x)

    def pick(self, i, x):
        return lax.switch(i, [self.up, self.down, self.step.__get__(self)
                              and (lambda v: self.step(0.0, v)[1])], x)


class GrandChild(Child):
    def __call__(self, xs):
        c, ys = self.scan(xs)
        return self.fori(c) + self.branch(ys[0]) + self.branch(-ys[-1])
"""


HELPER_MOD = """
def accumulate(model, x):
    model.total = model.total + jnp.sin(x) * model.w
    model.hits = model.hits + 1
    return model.total * x


def call_named(model, name, *args):
    return getattr(model, name)(*args)


def bump_all(model, names, v):
    for n in names:
        setattr(model, n, getattr(model, n) + v)


def scan_with_jax(model, xs):
    return jax.lax.scan(lambda c, x: (c + accumulate(model, x), None), 0.0, xs)[0]


def scan_with_autostate(model, xs):
    return LAXW.scan(lambda c, x: (c + accumulate(model, x), None), 0.0, xs)[0]


def failing(model, x):
    model.total = model.total + x.sum()
    if x.shape[0] > 2:
        raise KeyError("too long")
    model.hits = model.hits + 1
    return x.sum()
"""


HELPER_MODEL = """
import HELPERS as helpers


@DECORATE
class M:
    def __init__(self):
        self.w = jnp.asarray(0.75)
        self.total = jnp.zeros(())
        self.hits = jnp.zeros((), jnp.int32)
        self.a = jnp.zeros(())
        self.b = jnp.zeros(())

    def _touch(self):
        self.total = self.total
        self.hits = self.hits
        self.a = self.a
        self.b = self.b

    def ckpt(self, x):
        g = checkpoint(lambda v: helpers.accumulate(self, v) * self.w)
        return g(x) + self.total

    def scanned(self, xs):
        def body(c, x):
            return c + helpers.accumulate(self, x), self.total
        return lax.scan(body, 0.0, xs)

    def named(self, xs):
        kind = "scan" + "ned"
        c, ys = helpers.call_named(self, kind, xs)
        return c + ys.sum()

    def loop_names(self, x):
        def body(i, c):
            helpers.bump_all(self, ["a", "b"], x * i)
            return c + self.a - self.b * 0.5
        return lax.fori_loop(0, 3, body, x)

    def via_jax_scan(self, xs):
        return helpers.scan_with_jax(self, xs)

    def via_autostate_scan(self, xs):
        return helpers.scan_with_autostate(self, xs)

    def guarded(self, x):
        try:
            return helpers.failing(self, x)
        except KeyError:
            self.b = self.b + 1
            return -self.total
"""


COPIES = """
@DECORATE
class Sub:
    def __init__(self, k):
        self.k = jnp.asarray(k)
        self.s = jnp.zeros(())

    def bump(self, x):
        self.s = self.s + x * self.k
        return self.s


@DECORATE
class M:
    def __init__(self):
        self.x = jnp.zeros(())
        self.sub = Sub(2.0)

    def _inc(self, v):
        self.x = self.x + v
        return self.x

    def shallow_scan(self, xs):
        other = copy.copy(self)
        def body(c, v):
            return c + other._inc(v), other.x
        c, ys = lax.scan(body, 0.0, xs)
        self.x = self.x + 100.0
        return c, ys, other.x, self.x

    def deep_fori(self, v):
        twin = copy.deepcopy(self)
        def body(i, c):
            twin.sub.bump(v)
            return c + twin._inc(i * v)
        c = lax.fori_loop(0, 3, body, 0.0)
        return c, twin.sub.s, self.sub.s, twin.x, self.x

    def shallow_sub_shared(self, v):
        other = copy.copy(self)
        other.sub.bump(v)          # a shallow copy shares the sub-model
        other._inc(v)
        return self.sub.s, other.x, self.x

    def deep_sub_in_cond(self, v):
        sub2 = copy.deepcopy(self.sub)
        out = lax.cond(v > 0, sub2.bump, self.sub.bump, v)
        return out, sub2.s, self.sub.s

    def ckpt_copy(self, v):
        other = copy.copy(self)
        g = checkpoint(lambda a: other._inc(a) * 2.0)
        return g(v) + self._inc(v)

    def copy_as_cond_operand(self, v):
        o = copy.deepcopy(self)
        out = lax.cond(v > 0, lambda m: m._inc(v), lambda m: m.x, o)
        return out, o.x, self.x

    def snapshot_copy(self, v):
        self._inc(v)
        saved = copy.deepcopy(self)
        self._inc(v)
        return saved
"""


CLOSURE_HOOKS = """
@DECORATE
class M:
    def __init__(self):
        self.x = jnp.zeros(())
        self.y = jnp.zeros(())
        self.hooks = []
        def init_hook(v):
            self.y = self.y + v * 3.0
            return self.y
        self.init_hook = init_hook
        self.hooks.append(self.make(2.0))
        self.hooks.append(self.make(-1.0))

    def make(self, k):
        def hook(v):
            self.x = self.x + k * v
            return self.x
        return hook

    def scan_hooks(self, xs):
        def body(c, v):
            for h in self.hooks:
                c = c + h(v)
            return c, self.x + self.y
        return lax.scan(body, 0.0, xs)

    def ckpt_hook(self, v):
        return checkpoint(self.hooks[0])(v) * checkpoint(self.hooks[1])(v)

    def cond_hooks(self, v):
        return lax.cond(v > 0, self.hooks[1], self.hooks[0], v)

    def init_hook_in_cond(self, v):
        return lax.cond(v > 0, self.hooks[1], self.init_hook, v)

    def init_hook_direct(self, v):
        return self.init_hook(v)

    def fresh_closure_in_fori(self, v):
        bump = self.make(v)
        return lax.fori_loop(0, 4, lambda i, c: c + bump(i * 1.0), 0.0)
"""


DYNAMIC = """
import operator


@DECORATE
class M:
    def __init__(self):
        self.acc0 = jnp.zeros(())
        self.acc1 = jnp.zeros(())
        self.acc2 = jnp.zeros(())
        self.scale = jnp.asarray(1.5)
        self.names = ("acc0", "acc1", "acc2")

    def _touch(self):
        self.acc0 = self.acc0
        self.acc1 = self.acc1
        self.acc2 = self.acc2

    def step(self, c, x, k=1.0):
        self.acc0 = self.acc0 + x * k
        return c + self.acc0, self.acc0

    def partial_scan(self, xs):
        return lax.scan(functools.partial(self.step, k=self.scale), 0.0, xs)

    def methodcaller_fori(self, x):
        call = operator.methodcaller("step", 0.0, x, k=2.0)
        return lax.fori_loop(0, 3, lambda i, c: c + call(self)[0], 0.0)

    def getattr_cond(self, x, which):
        name = ["ste", "p"]
        fn = getattr(self, "".join(name))
        other = getattr(type(self), "st" + "ep")
        return lax.cond(which, lambda v: fn(0.0, v)[0], lambda v: other(self, 1.0, v, 3.0)[1], x)

    def setattr_loop(self, xs):
        def body(c, x):
            for i, n in enumerate(self.names):
                setattr(self, n, getattr(self, n) + x * (i + 1))
            total = sum(v for k, v in vars(self).items() if k.startswith("acc"))
            return c + total, self.__dict__["acc2"]
        return lax.scan(body, 0.0, xs)

    def dict_write_in_body(self, x):
        def body(i, c):
            vars(self)["acc1"] = self.acc1 + x
            self.__dict__.update(acc2=self.acc2 - x)
            return c + self.acc1 * self.acc2
        return lax.fori_loop(0, 3, body, 0.0)

    def tree_partial_scan(self, xs):
        return lax.scan(jax.tree_util.Partial(self.step, k=0.5), 0.0, xs)
"""


DESCRIPTORS = """
def _get_shift(self):
    return self._shift


def _set_shift(self, v):
    self._shift = jnp.tanh(v)


@DECORATE
class M:
    def __init__(self):
        self._scale = jnp.asarray(1.0)
        self.count = jnp.zeros((), jnp.int32)
        self.total = jnp.zeros(())
        self._shift = jnp.zeros(())

    shift = property(_get_shift, _set_shift)  # accessors defined outside the class

    def clear(self):  # makes `total` state: the static / class methods have no receiver
        self.total = self.total * 0.0

    @property
    def scale(self):
        return self._scale

    @scale.setter
    def scale(self, v):
        self._scale = jnp.clip(v, 0.25, 4.0)
        self.count += 1

    @staticmethod
    def bump(m, x):
        m.total = m.total + x * m.scale
        return m.total

    @classmethod
    def reset(cls, m):
        m.total = jnp.zeros(())
        return cls.bump(m, 1.0)

    def set_in_scan(self, xs):
        def body(c, x):
            self.scale = self.scale * (1.0 + x)
            return c + M.bump(self, x), self.scale
        return lax.scan(body, 0.0, xs)

    def static_in_cond(self, x):
        return lax.cond(x > 0, functools.partial(type(self).bump, self),
                        lambda v: type(self).reset(self) * v, x)

    def set_plain(self, x):
        self.scale += x
        self.shift = self.shift + x
        return self.bump(self, x) + self.scale + self.shift

    def shift_in_fori(self, x):
        def body(i, c):
            self.shift = self.shift - x * i
            return c + self.shift
        return lax.fori_loop(0, 3, body, 0.0)
"""


RAISE_IN_LAX = """
def _body(self, c, x):
    self.t = self.t + x
    if c is None:
        raise ArithmeticError("body")
    return c + self.t, None


@DECORATE
class Base:
    def __init__(self):
        self.t = jnp.zeros(())

    body = (lambda fn: functools.wraps(fn)(lambda self, *a: fn(self, *a)))(_body)


class M(Base):
    def run(self, xs):
        try:
            lax.scan(lambda c, x: self.body(None, x), 0.0, xs)
        except ArithmeticError:
            pass
        return self.t

    def run_then_assign(self, xs):
        try:
            lax.scan(self.body, None, xs)
        except ArithmeticError:
            self.t = jnp.asarray(-1.0)
        return self.t
"""


LATE_METHODS = """
def logged(fn):
    @functools.wraps(fn)
    def wrapper(self, *a):
        return fn(self, *a)
    return wrapper


@DECORATE
class M:
    def __init__(self):
        self.w = jnp.asarray(1.5)
        self.h = jnp.zeros(())
        self.extra = 0.0

    def _touch(self):
        self.h = self.h


def _cell(self, c, x):
    self.h = jnp.tanh(self.h * self.w + x)
    return c + self.h, self.h


M.cell = logged(_cell)
setattr(M, "run", lambda self, xs: LAXW.scan(LAXW.checkpoint(self.cell), 0.0, xs))
M.run_jax = lambda self, xs: lax.scan(self.cell, 0.0, xs)  # a lambda is not rewritten
M.named = logged(lambda self, name, v: setattr(self, name, v))
"""


X1_WEAK = jnp.asarray(1.5)


CLOSURE_TRANSFORMS = """
@DECORATE
class Inside:
    def __init__(self):
        self.w = jnp.asarray(1.5)
        self.s = jnp.asarray(0.5)
        self.hist = jnp.zeros(3)

    def reduce_read(self, xs):
        self.s = self.s + 1.0
        return jax.lax.reduce(xs * self.s, 0.0, jax.lax.add, (0,)) + jax.lax.associative_scan(
            lambda a, b: a * self.w + b, xs).sum()

    def grads_of_carry(self, xs):
        def body(c, x):
            self.s = self.s * 0.5 + x
            g = jax.grad(lambda v: jnp.sin(v * self.s) * self.w)(x)
            h = jax.hessian(lambda v: (v * self.s) ** 3)(x)
            _, t = jax.jvp(lambda v: v * self.s ** 2, (x,), (1.0,))
            _, lin = jax.linearize(lambda v: jnp.exp(v * self.s), x)
            _, vjp = jax.vjp(lambda v: v * v * self.s, x)
            return c + g + h + t + lin(1.0) + vjp(1.0)[0], g
        return lax.scan(body, 0.0, xs)

    def value_and_grad_aux(self, x):
        self.s = self.s + x
        def loss(w):
            return (w * self.s) ** 2, self.s * 2.0
        (v, aux), g = jax.value_and_grad(loss, has_aux=True)(self.w)
        return v + aux + g

    def tree_map_in_body(self, xs):
        def bump(v):
            self.hist = self.hist + v
            return v * 2.0
        def body(c, x):
            out = jax.tree_util.tree_map(bump, {"a": x, "b": x * 2.0})
            return c + out["a"] + out["b"], None
        return lax.scan(body, 0.0, xs)[0]

    def compile_time_eval_in_body(self, xs):
        def body(c, x):
            with jax.ensure_compile_time_eval():
                k = jnp.float32(2.0) * 3.0
            self.s = self.s + x * k
            return c + self.s, None
        return lax.fori_loop(0, 2, lambda i, c: lax.scan(body, c, xs)[0], 0.0)

    def jvp_write(self, x):
        def fn(v):
            self.s = v * 2.0  # jvp-write
            return v * self.w
        return jax.jvp(fn, (x,), (1.0,))[1]

    def callback_reads_state(self, x):
        self.s = self.s + 1.0
        seen = []
        jax.debug.callback(lambda v: seen.append(float(v) + float(self.s)), x)
        return x * self.s
"""


SYNTAX = """
CALLS = 0


@DECORATE
class Syntax:
    table = {k: k * 2 for k in range(3)}
    scales = [i + 0.5 for i in range(3)]
    act = staticmethod(lambda v: v * 3)
    read = lambda self: self.s * 2

    def __init__(self):
        self.s = jnp.zeros(())
        self.mode = "add"
        self.hist = jnp.zeros(3)

    def matcher(self, cmd, x):
        match cmd:
            case "add":
                self.s = self.s + x
            case ("mul", k):
                self.s = self.s * k
            case {"set": v}:
                self.s = jnp.asarray(v, jnp.float32)
            case [a, b, *rest]:
                self.s = self.s + a + b + len(rest)
            case _:
                self.s = self.s - 1
        return self.s

    def match_self_state(self, x):
        match self.mode:
            case "add":
                self.s = self.s + x
            case _:
                pass
        return self.s

    def walrus(self, x):
        if (n := self.s + x) > -100:
            self.s = n
        ys = [(y := self.s * i) for i in range(3)]
        self.hist = jnp.stack(ys) + y
        return self.hist

    def comprehension(self, x):
        self.hist = jnp.stack([self.s * k + x for k in self.scales])
        self.s = sum(self.hist[i] for i in range(3))
        return {k: self.s * v for k, v in self.table.items()}

    def lambdas(self, x):
        add = lambda v: self.s + v
        self.s = add(x) + self.act(x) + self.read()
        return self.s

    def with_global(self, x):
        global CALLS
        CALLS += 1
        self.s = self.s + x
        return self.s


def make_counter():
    count = 0

    @DECORATE
    class Nonlocal:
        def __init__(self):
            self.s = jnp.zeros(())

        def __call__(self, x):
            nonlocal count
            count += 1
            self.s = self.s + x * count
            return self.s

    return Nonlocal
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


HOST_COUNTERS = """
@DECORATE_HOST
class HostCounter:
    def __init__(self):
        self.n = jnp.zeros(())
        self.hist = jnp.zeros(3)

    def __call__(self, x):
        self.n = self.n + x
        self.hist = self.hist.at[1].add(x)
        return self.n * 2

    def looped(self, k):
        def tick(i, carry):
            self.n = self.n + i
            return carry + self.n
        return lax.fori_loop(0, k, tick, jnp.zeros(()))

    def scanned(self, xs):
        def body(c, x):
            self.hist = self.hist + x
            return c + x.sum(), self.n
        return lax.scan(body, jnp.zeros(()), xs)

    def branch(self, x):
        def yes(v):
            self.n = self.n + v
            return v * 2
        return lax.cond(x > 0, yes, lambda v: v, x)


@DECORATE
class Parent:
    def __init__(self):
        self.host = HostCounter()
        self.mine = jnp.zeros(())

    def __call__(self, x):
        self.mine = self.mine + self.host(x)
        return self.mine


@DECORATE_HOST
class HostParent:
    def __init__(self):
        self.child = Plain()
        self.t = jnp.zeros(())

    def __call__(self, x):
        self.t = self.t + self.child(x)
        return self.t


@DECORATE
class Plain:
    def __init__(self):
        self.s = jnp.ones(())

    def __call__(self, x):
        self.s = self.s * 2 + x
        return self.s
"""


HELPERS = """
@DECORATE
class Counter:
    def __init__(self):
        self.n = jnp.zeros((), jnp.int32)
        self.total = jnp.zeros(())

    def __call__(self, x):
        self.n += 1
        self.total = self.total + x
        return x * 2.0


def run_scan(model, xs):
    return LAXW.scan(lambda c, x: (c + model(x), model.total), 0.0, xs)


def run_scan_reverse(model, xs):
    return LAXW.scan(lambda c, x: (c + model(x) * c, model.n), 1.0, xs, reverse=True)


def run_fori(model, k):
    return LAXW.fori_loop(0, k, lambda i, c: c + model(c), 1.0)


def run_while(model):
    return LAXW.while_loop(lambda c: c < 50.0, lambda c: c + model(c) + 1.0, jnp.asarray(1.0))


def run_cond(model, x):
    return LAXW.cond(x > 0, lambda v: model(v), lambda v: -v, x)


def run_switch(model, i, x):
    return LAXW.switch(i, [lambda v: v, model, lambda v: model(model(v))], x)


def run_map(model, xs):
    return LAXW.map(lambda x: model(x) + model.total, xs)


def run_checkpoint(model, x):
    return LAXW.checkpoint(lambda v: model(v) * model.total)(x)


def run_nested(model, xs):
    def outer(c, x):
        inner = LAXW.cond(x > 1, lambda v: model(v), lambda v: v, x)
        return c + inner, None
    return LAXW.scan(outer, 0.0, xs)[0]


@DECORATE
class Driver:
    def __init__(self):
        self.c = Counter()
        self.calls = jnp.zeros(())

    def go(self, name, *args):
        self.calls = self.calls + 1
        return HELPER_FNS[name](self.c, *args)


HELPER_FNS = {
    "run_scan": run_scan, "run_scan_reverse": run_scan_reverse, "run_fori": run_fori,
    "run_while": run_while, "run_cond": run_cond, "run_switch": run_switch, "run_map": run_map,
    "run_checkpoint": run_checkpoint, "run_nested": run_nested,
}
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


QAT = """
@DECORATE
class MinMaxObserver:
    def __init__(self, n=1, ch_axis=None):
        self.ch_axis = ch_axis
        shape = () if ch_axis is None else (n,)
        self.min_val = jnp.full(shape, jnp.inf)
        self.max_val = jnp.full(shape, -jnp.inf)
        self.scale = jnp.ones(shape)
        self.zero_point = jnp.zeros(shape, jnp.int32)
        self.observer_enabled = True
        self.fake_quant_enabled = True

    def disable_observer(self):
        self.observer_enabled = False
        return self

    def enable_observer(self):
        self.observer_enabled = True
        return self

    def disable_fake_quant(self):
        self.fake_quant_enabled = False
        return self

    def _reduce_axes(self, x):
        if self.ch_axis is None:
            return None
        return tuple(i for i in range(x.ndim) if i != self.ch_axis)

    def observe(self, x):
        axes = self._reduce_axes(x)
        self.min_val = jnp.minimum(self.min_val, x.min(axis=axes))
        self.max_val = jnp.maximum(self.max_val, x.max(axis=axes))

    def calculate_qparams(self):
        lo = jnp.minimum(self.min_val, 0.0)
        hi = jnp.maximum(self.max_val, 0.0)
        self.scale = jnp.maximum((hi - lo) / 255.0, 1e-8)
        self.zero_point = jnp.clip(jnp.round(-lo / self.scale), 0, 255).astype(jnp.int32)
        return self.scale, self.zero_point

    def _bshape(self, x, v):
        if self.ch_axis is None:
            return v
        shape = [1] * x.ndim
        shape[self.ch_axis] = -1
        return v.reshape(shape)

    def __call__(self, x):
        if self.observer_enabled:
            self.observe(jax.lax.stop_gradient(x))
            self.calculate_qparams()
        if self.fake_quant_enabled:
            s = self._bshape(x, self.scale)
            z = self._bshape(x, self.zero_point)
            q = jnp.clip(jnp.round(x / s) + z, 0, 255)
            xq = (q - z) * s
            x = x + jax.lax.stop_gradient(xq - x)
        return x


@DECORATE
class MovingAverageObserver(MinMaxObserver):
    def __init__(self, c=0.25):
        super().__init__()
        self.c = c

    def observe(self, x):
        lo, hi = x.min(), x.max()
        first = jnp.isinf(self.min_val)
        self.min_val = jnp.where(first, lo, self.min_val + self.c * (lo - self.min_val))
        self.max_val = jnp.where(first, hi, self.max_val + self.c * (hi - self.max_val))


@DECORATE
class TorchStyleMovingAverage(MinMaxObserver):
    def __init__(self, c=0.25):
        super().__init__()
        self.c = c

    def observe(self, x):
        lo, hi = x.min(), x.max()
        if self.min_val == float("inf"):
            self.min_val, self.max_val = lo, hi
        else:
            self.min_val = self.min_val + self.c * (lo - self.min_val)
            self.max_val = self.max_val + self.c * (hi - self.max_val)


@DECORATE
class QATLinear:
    def __init__(self, seed, din, dout, moving=False):
        k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
        self.w = jax.random.normal(k1, (dout, din)) * 0.5
        self.b = jax.random.normal(k2, (dout,)) * 0.1
        self.act_obs = MovingAverageObserver() if moving else MinMaxObserver()
        self.w_obs = MinMaxObserver(dout, ch_axis=0)

    def observers(self):
        return [self.act_obs, self.w_obs]

    def freeze_observers(self):
        for o in self.observers():
            o.disable_observer()
        return self

    def __call__(self, x):
        x = self.act_obs(x)
        w = self.w_obs(self.w)
        return jnp.tanh(x @ w.T + self.b)


def frozen_qat(seed, x, moving=False):
    m = QATLinear(seed, 3, 4, moving)
    m(x)
    return m.freeze_observers()
"""


XQ = jnp.array([[1.0, 2.0, 0.0], [3.0, -2.0, 1.0], [2.0, 0.5, 5.0], [0.5, 1.0, -1.0]])


LORA = """
@DECORATE
class LoRALinear:
    def __init__(self, seed, din, dout, r=2, alpha=4.0):
        k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
        self.w = jax.random.normal(k1, (din, dout)) * 0.4
        self.a = jax.random.normal(k2, (din, r)) * 0.4
        self.b = jax.random.normal(k3, (r, dout)) * 0.4
        self.scaling = alpha / r
        self.merged = False

    def delta(self):
        return self.a @ self.b * self.scaling

    def merge(self):
        if not self.merged:
            self.w = self.w + self.delta()
            self.merged = True
        return self

    def unmerge(self):
        if self.merged:
            self.w = self.w - self.delta()
            self.merged = False
        return self

    def __call__(self, x):
        y = x @ self.w
        if not self.merged:
            y = y + (x @ self.a) @ self.b * self.scaling
        return y


@DECORATE
class LoRANet:
    def __init__(self, seed, d, depth):
        self.layers = [LoRALinear(seed + i, d, d) for i in range(depth)]

    def merge_all(self):
        for layer in self.layers:
            layer.merge()
        return self

    def unmerge_all(self):
        for layer in self.layers:
            layer.unmerge()
        return self

    def __call__(self, x):
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return x


@DECORATE
class LoRAArrayFlag:
    def __init__(self, seed, din, dout, r=2):
        k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
        self.w = jax.random.normal(k1, (din, dout)) * 0.4
        self.a = jax.random.normal(k2, (din, r)) * 0.4
        self.b = jax.random.normal(k3, (r, dout)) * 0.4
        self.merged = jnp.zeros((), bool)

    def merge(self):
        self.w = jnp.where(self.merged, self.w, self.w + self.a @ self.b)
        self.merged = jnp.ones((), bool)
        return self.merged

    def unmerge(self):
        self.w = jnp.where(self.merged, self.w - self.a @ self.b, self.w)
        self.merged = jnp.zeros((), bool)
        return self.merged

    def __call__(self, x):
        lora = (x @ self.a) @ self.b
        return x @ self.w + jnp.where(self.merged, 0.0, lora)
"""


XL = jnp.array([[1.0, -0.5, 0.25], [0.5, 2.0, -1.0]])


BEAM = """
EOS = 0


@DECORATE
class BeamDecoder:
    def __init__(self, seed, vocab, d, beams, max_len=6):
        k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
        self.emb = jax.random.normal(k1, (vocab, d))
        self.wo = jax.random.normal(k2, (d, vocab))
        self.vocab = vocab
        self.beams = beams
        self.cache = []
        self.step = jnp.zeros((), jnp.int32)
        self.scores = jnp.zeros(beams)
        self.finished = jnp.zeros(beams, bool)
        self.tokens = jnp.zeros(beams, jnp.int32)
        self.kv = jnp.zeros((max_len, d))
        self.out = jnp.full((max_len,), -1, jnp.int32)
        self.pos = jnp.zeros((), jnp.int32)
        self.max_len = max_len

    def reset(self, tokens):
        self.cache = []
        self.step = jnp.zeros((), jnp.int32)
        self.scores = jnp.zeros(self.beams)
        self.finished = jnp.zeros(self.beams, bool)
        self.tokens = tokens

    def decode_step(self):
        self.cache = self.cache + [self.emb[self.tokens]]
        ctx = jnp.stack(self.cache).mean(0)
        logp = jax.nn.log_softmax(ctx @ self.wo)
        eos_only = jnp.where(jnp.arange(self.vocab) == EOS, 0.0, -1e9)
        logp = jnp.where(self.finished[:, None], eos_only, logp)
        total = (self.scores[:, None] + logp).reshape(-1)
        top, idx = jax.lax.top_k(total, self.beams)
        beam_idx, tok = idx // self.vocab, idx % self.vocab
        self.cache = [c[beam_idx] for c in self.cache]
        self.scores = top
        self.finished = self.finished[beam_idx] | (tok == EOS)
        self.tokens = tok
        self.step += 1
        return tok, beam_idx

    def search(self, tokens, n=4):
        self.reset(tokens)
        toks = []
        for _ in range(n):
            tok, beam_idx = self.decode_step()
            toks = [t[beam_idx] for t in toks] + [tok]
        return jnp.stack(toks, 1), self.scores

    def search2(self, tokens):
        return self.search(tokens, 2)

    def search5(self, tokens):
        return self.search(tokens, 5)

    def _greedy_body(self, tok):
        self.kv = self.kv.at[self.pos].set(self.emb[tok])
        ctx = self.kv.sum(0) / (self.pos + 1)
        nxt = jnp.argmax(ctx @ self.wo).astype(jnp.int32)
        self.out = self.out.at[self.pos].set(nxt)
        self.pos += 1
        return nxt

    def greedy(self, tok):
        self.pos = jnp.zeros((), jnp.int32)
        self.kv = jnp.zeros_like(self.kv)
        self.out = jnp.full_like(self.out, -1)
        lax.while_loop(lambda t: (self.pos < self.max_len) & (t != EOS), self._greedy_body, tok)
        return self.out, self.pos

    def greedy_python(self, tok):
        self.pos = jnp.zeros((), jnp.int32)
        self.kv = jnp.zeros_like(self.kv)
        self.out = jnp.full_like(self.out, -1)
        for _ in range(self.max_len):
            tok = self._greedy_body(tok)
        return self.out, self.pos
"""


VARIATIONAL_RNN = """
@DECORATE
class Dropout:
    def __init__(self, seed, p=0.5, typed=False):
        self.key = jax.random.key(seed) if typed else jax.random.PRNGKey(seed)
        self.p = p
        self.training = True

    def train(self, mode=True):
        self.training = mode
        return self

    def eval(self):
        return self.train(False)

    def __call__(self, x):
        if not self.training or self.p == 0.0:
            return x
        self.key, sub = jax.random.split(self.key)
        keep = jax.random.bernoulli(sub, 1.0 - self.p, x.shape)
        return jnp.where(keep, x / (1.0 - self.p), 0.0)


@DECORATE
class VariationalRNN:
    def __init__(self, seed, d, typed=False):
        k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
        self.w = jax.random.normal(k1, (d, d)) * 0.5
        self.key = jax.random.key(seed + 1) if typed else k2
        self.mask = jnp.ones(d)
        self.h = jnp.zeros(d)
        self.drop = Dropout(seed + 7, p=0.25, typed=typed)

    def new_mask(self):
        self.key, sub = jax.random.split(self.key)
        self.mask = jax.random.bernoulli(sub, 0.75, self.mask.shape) / 0.75

    def _step(self, h, x):
        h = jnp.tanh((h * self.mask) @ self.w + self.drop(x))
        self.h = h
        return h, h.sum()

    def __call__(self, xs):
        self.new_mask()
        h, ys = lax.scan(self._step, jnp.zeros_like(self.h), xs)
        return ys
"""


X_VRNN = jnp.arange(12.0).reshape(4, 3) / 7.0 - 0.5


MOE_AUX_LOSS = """
@DECORATE
class Router:
    def __init__(self, seed, d, n_experts, capacity, py_init=False):
        self.w = jax.random.normal(jax.random.PRNGKey(seed), (d, n_experts))
        self.n_experts = n_experts
        self.capacity = capacity
        self.expert_counts = jnp.zeros(n_experts)
        self.dropped = 0 if py_init else jnp.zeros((), jnp.int32)
        self.aux_loss = 0.0 if py_init else jnp.zeros(())
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        probs = jax.nn.softmax(x @ self.w)
        one_hot = jax.nn.one_hot(jnp.argmax(probs, -1), self.n_experts)
        self.expert_counts += one_hot.sum(0)
        position = jnp.cumsum(one_hot, 0) * one_hot
        keep = (position <= self.capacity) & (one_hot > 0)
        self.dropped += (one_hot.sum() - keep.sum()).astype(jnp.int32)
        self.aux_loss = self.n_experts * jnp.sum(one_hot.mean(0) * probs.mean(0))
        self.calls += 1
        return keep * probs

    def usage(self):
        return self.expert_counts / jnp.maximum(self.expert_counts.sum(), 1.0)


@DECORATE
class MoE:
    def __init__(self, seed, d, n_experts=3, capacity=2, py_init=False):
        self.router = Router(seed, d, n_experts, capacity, py_init)
        keys = jax.random.split(jax.random.PRNGKey(seed + 1), n_experts)
        self.experts = [jax.random.normal(k, (d, d)) * 0.5 for k in keys]

    def __call__(self, x):
        gates = self.router(x)
        outs = jnp.stack([jnp.tanh(x @ w) for w in self.experts], 1)
        return jnp.einsum("te,ted->td", gates, outs)


def train_moe(model, xs):
    losses = []
    for x in xs:
        y = model(x)
        losses.append(jnp.mean((y - x) ** 2) + 0.01 * model.router.aux_loss)
    return losses
"""


XM_ROUTED = jnp.array(
    [[1.0, 0.0, -1.0], [0.5, 2.0, 0.1], [-1.0, 1.0, 0.3], [0.2, -0.4, 1.5], [1.2, 0.3, 0.3]]
)


ACCUM = """
add = lambda a, b: a + b


@DECORATE
class AccumSGD:
    def __init__(self, params, n, lr=0.5, array_k=False):
        self.params = params
        self.accum = jax.tree_util.tree_map(jnp.zeros_like, params)
        self.k = jnp.zeros((), jnp.int32) if array_k else 0
        self.n = n
        self.lr = lr
        self.applied = jnp.zeros((), jnp.int32)

    def _apply(self):
        self.params = jax.tree_util.tree_map(lambda p, g: p - self.lr * g / self.n,
                                             self.params, self.accum)
        self.accum = jax.tree_util.tree_map(jnp.zeros_like, self.accum)
        self.k = self.k * 0
        self.applied += 1

    def update(self, grads):
        self.accum = jax.tree_util.tree_map(add, self.accum, grads)
        self.k += 1
        if self.k == self.n:
            self._apply()
        return self.params

    def update_scaled(self, s):
        return self.update(jax.tree_util.tree_map(lambda g: g * s, grads_at(1)))


@DECORATE
class AccumSGDCond(AccumSGD):
    def update(self, grads):
        self.accum = jax.tree_util.tree_map(add, self.accum, grads)
        self.k += 1
        lax.cond(self.k == self.n, self._apply, lambda: None)
        return self.params


@DECORATE
class AccumSGDWhere(AccumSGD):
    def update(self, grads):
        self.accum = jax.tree_util.tree_map(add, self.accum, grads)
        self.k += 1
        ready = self.k == self.n
        new = jax.tree_util.tree_map(lambda p, g: p - self.lr * g / self.n, self.params,
                                     self.accum)
        self.params = jax.tree_util.tree_map(lambda a, b: jnp.where(ready, a, b), new,
                                             self.params)
        self.accum = jax.tree_util.tree_map(lambda a: jnp.where(ready, 0.0, a), self.accum)
        self.applied += ready.astype(jnp.int32)
        self.k = jnp.where(ready, 0, self.k)
        return self.params


def init_params():
    return {"w": jnp.array([1.0, -2.0, 0.5]), "b": [jnp.array(0.25), jnp.ones((2, 2))]}


def grads_at(i):
    return {"w": jnp.array([0.1, 0.2, -0.3]) * (i + 1), "b": [jnp.array(0.5) - i,
                                                              jnp.eye(2) * i]}
"""


PROBE = """
def double_hook(module, x):
    return x * 2.0


def count_hook(module, x):
    module.hook_calls = module.hook_calls + 1
    return None


@DECORATE
class Probe:
    def __init__(self, seed, d, depth, none_init=False):
        keys = jax.random.split(jax.random.PRNGKey(seed), depth)
        self.layers = [jax.random.normal(k, (d, d)) * 0.5 for k in keys]
        self.last_hidden = None if none_init else jnp.zeros((d, d))
        self.attn_maps = []
        self.hooks = []
        self.hook_calls = jnp.zeros((), jnp.int32)

    def register_forward_hook(self, fn):
        self.hooks.append(fn)
        return self

    def clear_hook_calls(self):
        self.hook_calls = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.attn_maps = []
        for w in self.layers:
            a = jax.nn.softmax(x @ x.T / x.shape[-1])
            self.attn_maps = self.attn_maps + [a]
            x = jnp.tanh(a @ x @ w)
            for fn in self.hooks:
                r = fn(self, x)
                if r is not None:
                    x = r
        self.last_hidden = x
        return x.sum()


@DECORATE
class Logger:
    def __init__(self):
        self.log = []
        self.w = jnp.ones(3)

    def __call__(self, x):
        self.log.append(x.sum())
        return x * self.w


def hooked(seed):
    return Probe(seed, 3, 2).register_forward_hook(count_hook).register_forward_hook(double_hook)


def warmed(seed):
    m = hooked(seed)
    m(jnp.ones((3, 3)))
    return m
"""


XP = jnp.array([[1.0, 0.0, -1.0], [0.5, 2.0, 0.1], [-1.0, 1.0, 0.3]])


RESET = """
@DECORATE
class Linear:
    def __init__(self, seed, din, dout):
        self.key = jax.random.PRNGKey(seed)
        self.din = din
        self.w = jnp.zeros((din, dout))
        self.b = jnp.zeros(dout)
        self.reset_parameters()

    def reset_parameters(self):
        self.key, k = jax.random.split(self.key)
        bound = 1.0 / self.din**0.5
        self.w = jax.random.uniform(k, self.w.shape, minval=-bound, maxval=bound)
        self.b = jnp.zeros_like(self.b)

    def __call__(self, x):
        return x @ self.w + self.b


@DECORATE
class Head:
    def __init__(self, seed, d):
        self.body = Linear(seed, d, d)
        self.out = Linear(seed + 1, d, 2)
        self.bn_mean = jnp.zeros(d)
        self.training = True
        self.resets = jnp.zeros((), jnp.int32)

    def train(self, mode=True):
        self.training = mode
        return self

    def eval(self):
        return self.train(False)

    def reset_head(self):
        self.out.reset_parameters()
        self.resets += 1

    def __call__(self, x):
        h = jnp.tanh(self.body(x))
        if self.training:
            self.bn_mean = 0.9 * self.bn_mean + 0.1 * h.mean(0)
        return self.out(h - self.bn_mean)
"""


X23 = jnp.arange(6.0).reshape(2, 3) / 6.0


X23_STACK = jnp.stack([X23, -2.0 * X23, X23 + 0.5])


LAZY = """
@DECORATE
class LazyLinear:
    def __init__(self, seed, out):
        self.key = jax.random.key(seed)
        self.out = out
        self.w = None
        self.b = None
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        if self.w is None:
            self.key, sub = jax.random.split(self.key)
            self.w = jax.random.normal(sub, (x.shape[-1], self.out))  # lazy w
            self.b = jnp.zeros(self.out)
        self.calls += 1
        return x @ self.w + self.b

    def reset(self):
        self.w = None
        self.b = None


@DECORATE
class LazyMLP:
    def __init__(self, seed, sizes):
        self.layers = [LazyLinear(seed + i, n) for i, n in enumerate(sizes)]

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


@DECORATE
class Head:
    def __init__(self, n):
        self.w = jnp.linspace(-1.0, 1.0, n)
        self.count = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.count += 1
        return x @ self.w * self.count


@DECORATE
class LazyHead:
    def __init__(self):
        self.scale = jnp.asarray(2.0)
        self.head = None

    def __call__(self, x):
        if self.head is None:
            self.head = Head(x.shape[-1])  # lazy head
        return self.head(x) * self.scale


@DECORATE
class LazyStack:
    def __init__(self, n):
        self.n = n
        self.layers = []

    def __call__(self, x):
        if not self.layers:
            self.layers = [Head(x.shape[-1]) for _ in range(self.n)]  # lazy layers
        return sum(layer(x) for layer in self.layers)


@DECORATE
class AppendStack:
    def __init__(self, n):
        self.n = n
        self.layers = []

    def __call__(self, x):
        while len(self.layers) < self.n:
            self.layers.append(Head(x.shape[-1]))
        return sum(layer(x) for layer in self.layers)


@DECORATE
class Compact:
    def __init__(self, seed, out):
        self.key = jax.random.key(seed)
        self.out = out
        self.params = {}
        self.steps = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        if "w" not in self.params:
            self.key, sub = jax.random.split(self.key)
            w = jax.random.normal(sub, (x.shape[-1], self.out))
            self.params = {**self.params, "w": w, "b": jnp.zeros(self.out)}
        self.steps += 1
        return x @ self.params["w"] + self.params["b"]


def primed(model, *args):
    model(*args)
    return model


def reset_after(model, *args):
    model(*args)
    model.reset()
    return model
"""


LAYERS = """
@DECORATE
class Layer:
    def __init__(self, key):
        self.w = jax.random.normal(key, (3, 3)) * 0.5
        self.b = jnp.zeros(3)
        self.mean = jnp.zeros(3)
        self.n = jnp.zeros((), jnp.int32)

    def __call__(self, h):
        y = jnp.tanh(h @ self.w + self.b)
        self.mean = 0.9 * self.mean + 0.1 * y.mean(0)  # layer mean
        self.n += 1
        return y - self.mean

    def forward(self, h):
        return jnp.tanh(h @ self.w + self.b) - self.mean


def layer_keys(seed, n):
    return jax.random.split(jax.random.key(seed), n)


@DECORATE
class Stack:
    \"\"\"Holds the stacked (f, states) of its layers and scans f over them.\"\"\"

    def __init__(self, seed, n):
        self.F, self.S = jax.vmap(lambda k: Layer(k).functionalize())(layer_keys(seed, n))
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        def body(h, fs):
            f, s = fs
            h, s = f(s, h)
            self.calls += 1
            return h, s

        h, self.S = lax.scan(body, x, (self.F, self.S))
        return h


@DECORATE
class ListStack:
    \"\"\"The plain reference of Stack: a Python list of layers.\"\"\"

    def __init__(self, seed, n):
        self.layers = [Layer(k) for k in layer_keys(seed, n)]
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
            self.calls += 1
        return x


@DECORATE
class EqxStack:
    \"\"\"Equinox's idiom: one sub-model with stacked leaves.\"\"\"

    def __init__(self, seed, n):
        self.layers = jax.vmap(Layer)(layer_keys(seed, n))

    def read(self, x):
        return lax.scan(lambda h, layer: (layer.forward(h), None), x, self.layers)[0]

    def write(self, x):
        return lax.scan(lambda h, layer: (layer(h), None), x, self.layers)[0]
"""


BUILT = """
@DECORATE
class Member:
    def __init__(self, key):
        self.w = jax.random.normal(key, (3,))
        self.mean = jnp.zeros(())
        self.n = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        y = x @ self.w
        self.mean = 0.5 * self.mean + 0.5 * y.mean()  # built mean
        self.n += 1
        return y * self.n


@DECORATE
class Outer:
    def __init__(self, seed):
        self.key = jax.random.key(seed)
        self.scale = jnp.asarray(2.0)
        self.total = jnp.zeros(())

    def __call__(self, x):
        self.key, sub = jax.random.split(self.key)
        tmp = Member(sub)
        y = tmp(x) + tmp(x)
        self.total = self.total + tmp.mean + tmp.n
        return y * self.scale

    def scanned(self, xs):
        def body(c, x):
            self.key, sub = jax.random.split(self.key)
            tmp = Member(sub)
            y = tmp(x)
            self.total = self.total + tmp.n
            return c + y.sum(), tmp.mean
        return lax.scan(body, jnp.zeros(()), xs)


@DECORATE
class Cell:
    def __init__(self, w):
        self.w = jnp.asarray(w)
        self.steps = jnp.zeros((), jnp.int32)

    def __call__(self, h):
        self.steps += 1
        return h * self.w


@DECORATE
class Swap:
    def __init__(self):
        self.cell = Cell(0.5)

    def scan(self, x):
        def body(h, _):
            self.cell = Cell(2.0)  # swap in scan
            return self.cell(h), None
        return lax.scan(body, x, None, length=2)[0]

    def cond(self, x):
        def t(x):
            self.cell = Cell(2.0)  # swap in cond
            return self.cell(x)
        return lax.cond(x > 0, t, lambda x: x, x)

    def ckpt(self, x):
        def t(x):
            self.cell = Cell(2.0)  # swap in checkpoint
            return self.cell(x)
        return checkpoint(t)(x)
"""


GROW = """
@DECORATE
class Cache:
    def __init__(self):
        self.kv = jnp.zeros((0, 2))
        self.hist = []
        self.seen = ()

    def __call__(self, x):
        self.kv = jnp.concatenate([self.kv, x[None]])
        self.hist = self.hist + [x.sum()]
        self.seen = self.seen + (x[0],)
        return self.kv.sum(0)

    def shrink(self):
        self.hist = self.hist[1:]
        self.kv = self.kv[1:]
        return self.kv.mean(0)

    def reset(self):
        self.kv = jnp.zeros((0, 2))
        self.hist = []
        self.seen = ()
        return self.kv.sum()

    def grow_in_scan(self, xs):
        def body(c, x):
            self.kv = jnp.concatenate([self.kv, x[None]])
            return c, None
        return lax.scan(body, jnp.zeros(()), xs)[0]  # grow in scan

    def append_in_scan(self, xs):
        def body(c, x):
            self.hist = self.hist + [x.sum()]
            return c, None
        return lax.scan(body, jnp.zeros(()), xs)[0]  # append in scan


@DECORATE
class Toggle:
    def __init__(self):
        self.cache = jnp.zeros(2)
        self.n = jnp.zeros((), jnp.int32)

    def clear(self):
        self.cache = None
        return self.n

    def __call__(self, x):
        self.n += 1
        if self.cache is None:
            self.cache = x
        else:
            self.cache = self.cache + x
        return self.cache * self.n


def cleared():
    t = Toggle()
    t.clear()
    return t
"""


V2_SIGNED = jnp.array([1.0, -2.0])


X2_WEAK = jnp.asarray(-0.5)


BRANCH_EXCEPTIONS = """
class Boom(Exception):
    pass


@DECORATE
class Branchy:
    def __init__(self):
        self.s = jnp.zeros(())
        self.t = jnp.zeros(())

    def cond(self, x, pred):
        def taken(v):
            self.s = self.s + v
            return v
        def untaken(v):
            self.t = self.t + v
            raise Boom("a branch plain Python never runs")
        return lax.cond(pred, taken, untaken, x)

    def switch(self, x):
        def taken(v):
            self.s = self.s + v
            return v
        def untaken(v):
            self.t = self.t + v
            raise Boom("a branch plain Python never runs")
        return lax.switch(0, [taken, untaken], x)

    def empty_scan(self, x):
        def body(c, v):
            self.t = self.t + v
            raise Boom("a body plain Python never runs")
        self.s = self.s + x
        return lax.scan(body, x, jnp.zeros((0,)))[0]

    def zero_fori(self, x):
        def body(i, c):
            self.t = self.t + c
            raise Boom("a body plain Python never runs")
        self.s = self.s + x
        return lax.fori_loop(0, 0, body, x)

    def false_while(self, x):
        def body(c):
            self.t = self.t + c
            raise Boom("a body plain Python never runs")
        self.s = self.s + x
        return lax.while_loop(lambda c: c > 100.0, body, x)

    def step(self, x, fail):
        self.s = self.s * 2 + x
        if fail:
            raise Boom("step")
        self.t = self.t + jnp.sin(x)
        return self.s * self.t


@DECORATE_HOST
class Host:
    def __init__(self):
        self.a = jnp.zeros(())
        self.s = jnp.zeros(())

    def direct(self, x, fail):
        self.a = self.a + x
        if fail:
            raise Boom("direct")
        self.s = self.s + x
        return self.a

    def in_scan(self, xs, fail):
        self.a = self.a + 1.0
        def body(c, x):
            self.s = self.s + x
            if fail:
                raise Boom("body")
            return c, None
        lax.scan(body, 0.0, xs)
        return self.s

    def caught(self, xs):
        def body(c, x):
            self.s = self.s + x
            raise Boom("body")
        try:
            lax.scan(body, 0.0, xs)
        except Boom:
            pass
        return self.s
"""


GENERATOR_METHODS = """
import itertools


@DECORATE
class Sub:
    def __init__(self):
        self.n = jnp.zeros(())

    def bump(self, v):
        self.n = self.n + v
        return self.n

    def gen(self, xs):
        for x in xs:
            yield self.bump(x)
        return len(xs) * 10.0


@DECORATE
class M:
    def __init__(self):
        self.sub = Sub()
        self.acc = jnp.zeros(())
        self.closed = jnp.zeros(())
        self.length = 3

    def add(self, v):
        self.acc = self.acc + v
        return self.acc

    def close_mark(self):
        self.closed = self.closed + 1
        return self.closed

    def gen(self, xs):
        r = yield from self.sub.gen(xs)
        yield self.add(r)

    def consume(self, xs):
        return jnp.stack(list(self.gen(xs)))

    def accumulator(self):
        total = jnp.zeros(())
        while True:
            v = yield total
            total = self.add(v) + total

    def drive(self, xs):
        g = self.accumulator()
        next(g)
        outs = [g.send(x) for x in xs]
        g.close()
        return jnp.stack(outs)

    def islice(self, xs):
        return jnp.stack(list(itertools.islice(self.gen(xs), 2)))

    def accumulate(self, xs):
        return jnp.stack(list(itertools.accumulate(map(self.add, xs))))

    def chained(self, xs):
        return jnp.stack(list(itertools.chain(self.sub.gen(xs), self.gen(xs))))

    def zipped(self, xs):
        return jnp.stack([a * b for a, b in zip(self.sub.gen(xs), self.gen(xs))])

    def gen_finally(self, xs):
        try:
            for v in xs:
                yield self.add(v)
        finally:
            self.close_mark()

    def partial_consume(self, xs):
        g = self.gen_finally(xs)
        a = next(g)
        return a + next(g)

    def partial_close(self, xs):
        g = self.gen_finally(xs)
        a = next(g)
        g.close()
        return a + self.closed

    def throw_in(self, xs):
        g = self.gen_finally(xs)
        a = next(g)
        try:
            g.throw(ValueError("t"))
        except ValueError:
            a = a + 100
        return a + self.closed

    def map_once(self, xs):
        m = map(self.add, xs)
        return next(m) + next(m)

    def comprehension_mixed(self, xs):
        return jnp.stack([self.add(v) + self.acc for v in xs])

    def walrus(self, xs):
        ys = [(y := self.add(v)) * 2 for v in xs]
        return jnp.stack(ys) + y

    def setattr_comp(self, xs):
        [setattr(self, "acc", self.acc + v) for v in xs]
        return self.acc

    def dict_comp(self, xs):
        d = {i: self.sub.bump(v) for i, v in enumerate(xs)}
        return d[len(xs) - 1] + sum(self.add(v) for v in xs)

    def __iter__(self):
        for i in range(self.length):
            yield self.add(float(i))

    def iterate(self):
        return sum(v for v in self)

    def scan_inner_gen(self, xs):
        def body(c, x):
            def local():
                for i in range(2):
                    self.acc = self.acc + x * i
                    yield self.acc
            g = self.gen_finally([x, x * 2])
            return c + next(g) + sum(local()), c
        return lax.scan(body, jnp.zeros(()), xs)
"""


ESCAPES = """
import weakref
BOX = []


@DECORATE
class E:
    def __init__(self):
        self.x = jnp.zeros(())
        self.closed = jnp.zeros(())

    def bump(self, v):
        self.x = self.x + v
        return self.x

    def close_mark(self):
        self.closed = self.closed + 1
        return self.closed

    def gen(self, vs):
        try:
            for v in vs:
                yield self.bump(v)
        finally:
            self.close_mark()

    def lazy_calls(self, xs):
        return (self.bump(v) for v in xs)

    def lazy_reads(self, xs):
        return (self.x * v for v in xs)

    def lazy_map(self, xs):
        return map(self.bump, xs)

    def start(self, vs):
        g = self.gen(vs)
        BOX.append(g)
        return next(g)

    def resume(self):
        return next(BOX[-1])

    def finish(self):
        BOX.pop().close()
        return self.closed

    def start_return(self, vs):
        g = self.gen(vs)
        next(g)
        return g

    def stash(self, xs):
        BOX.append(self.gen(xs))
        return self.x

    def register_later(self, v):
        BOX.append(functools.partial(self.bump, v))
        BOX.append(weakref.WeakMethod(self.bump))
        return self.x
"""


ITER = """
import asyncio


class _ACursor:
    def __init__(self, model, n):
        self.model, self.i, self.n = model, 0, n

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.i >= self.n:
            raise StopAsyncIteration
        self.i += 1
        await asyncio.sleep(0)
        return self.model.bump(float(self.i) * 10)


@DECORATE
class Counter:
    def __init__(self, n=3):
        self.i = jnp.zeros((), jnp.int32)
        self.x = jnp.zeros(())
        self.length = n

    def bump(self, v):
        self.x = self.x + v
        return self.x

    def __iter__(self):
        self.i = jnp.zeros((), jnp.int32)
        return self

    def __next__(self):
        if int(self.i) >= self.length:  # HERE
            raise StopIteration
        self.i = self.i + 1
        return self.bump(1.0)

    def for_self(self):
        return sum(v for v in self) + self.i

    def __aiter__(self):
        return _ACursor(self, self.length)

    async def _adrain(self):
        return [v async for v in self]

    def adrain(self):
        return jnp.stack(asyncio.run(self._adrain()))
"""


CMS = """
import contextlib


@DECORATE
class Flag:
    def __init__(self):
        self.training = jnp.asarray(True)
        self.entered = jnp.zeros(())
        self.exits = jnp.zeros(())

    def __enter__(self):
        self.entered = self.entered + 1
        self.training = jnp.asarray(False)
        return self

    def __exit__(self, et, ev, tb):
        self.training = jnp.asarray(True)
        self.exits = self.exits + 1
        return False

    def set(self, v):
        old = self.training
        self.training = jnp.asarray(v)
        return old


@DECORATE
class Unit:
    def __init__(self, k):
        self.training = jnp.asarray(True)
        self.k = k
        self.uses = jnp.zeros(())
        self.closes = jnp.zeros(())

    def set(self, v):
        old = self.training
        self.training = jnp.asarray(v)
        return old

    @contextlib.contextmanager
    def mode(self, v):
        old = self.set(v)
        try:
            yield self
        finally:
            self.set(old)

    def close(self):
        self.closes = self.closes + 1

    def __call__(self, x):
        self.uses = self.uses + 1
        return jnp.where(self.training, x * self.k, x)


@DECORATE
class Net:
    def __init__(self):
        self.flag = Flag()
        self.a = Unit(2.0)
        self.b = Unit(3.0)
        self.w = jnp.asarray(2.0)
        self.n = jnp.zeros(())
        self.errs = jnp.zeros(())

    @contextlib.contextmanager
    def train_mode(self, v):
        old = self.flag.set(v)
        try:
            yield self.flag
        finally:
            self.flag.set(old)

    def fwd(self, x):
        self.n = self.n + 1
        return jnp.where(self.flag.training, x * 0.5, x) * self.w

    def with_self_flag(self, x):
        with self.flag as fl:
            y = self.fwd(x) + fl.entered
        return y + self.fwd(x)

    def with_raise(self, x):
        try:
            with self.flag:
                self.fwd(x)
                raise ValueError("boom")
        except ValueError:
            self.errs = self.errs + 1
        return self.fwd(x) + self.flag.training

    def nested(self, x):
        with self.train_mode(False):
            a = self.fwd(x)
            with self.flag:
                b = self.fwd(x)
                with self.train_mode(True):
                    c = self.fwd(x)
            d = self.fwd(x)
        return jnp.stack([a, b, c, d, self.fwd(x)])

    def in_scan(self, xs):
        def body(c, x):
            with self.train_mode(False):
                y = self.fwd(x)
            with self.flag:
                z = self.fwd(x)
            return c + y + z + self.fwd(x), y
        return lax.scan(body, jnp.zeros(()), xs)

    def raise_through_cm(self, x):
        with self.train_mode(False):
            self.fwd(x)
            raise KeyError("k")

    def both(self, x):
        with self.a.mode(False), self.b.mode(False) as b:
            y = self.a(x) + b(x)
        return y + self.a(x) + self.b(x)

    def in_cond(self, x):
        def yes(x):
            with self.a.mode(False):
                return self.a(x) + self.b(x)

        def no(x):
            with self.b.mode(False):
                return self.a(x) - self.b(x)

        return lax.cond(x > 1.5, yes, no, x)

    def in_fori(self, x):
        def body(i, c):
            with self.a.mode(i % 2 == 0):
                return c + self.a(c)
        return lax.fori_loop(0, 3, body, x)

    def scan_raise(self, xs):
        def body(c, x):
            try:
                with self.a.mode(False):
                    c = c + self.a(x)
                    raise ValueError("x")
            except ValueError:
                pass
            return c + self.a(x), None
        return lax.scan(body, jnp.zeros(()), xs)[0]

    def closing(self, x):
        with contextlib.closing(self.a) as a:
            y = a(x)
        with contextlib.suppress(KeyError):
            self.b(x)
            raise KeyError("k")
        return y + self.b(x)

    def exit_stack(self, x):
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.a.mode(False))
            stack.callback(self.b.close)
            y = self.a(x)
        return y + self.b.closes

    def scan_cm_raise_out(self, xs):
        def body(c, x):
            with self.train_mode(False):
                self.fwd(x)
                raise ValueError("v")
        try:
            lax.scan(body, jnp.zeros(()), xs)  # SCAN
        except ValueError:
            pass
        return self.flag.training
"""


V3_STACK = jnp.stack([V3, V3 * 2, -V3])


TRANSFORMED_WRITES = """
@DECORATE
class Esc:
    def __init__(self):
        self.w = jnp.array([1.0, -2.0, 0.5])
        self.mean = jnp.zeros(3)
        self.calls = jnp.zeros((), jnp.int32)

    def step(self, x):
        self.mean = self.mean + x  # <- step writes
        return x * self.w, self.mean

    def loss(self, x):
        self.mean = self.mean + x  # <- loss writes
        return (jnp.sin(x) * self.w).sum()

    def vmap_bound(self, xs):
        return jax.vmap(self.step)(xs)[0]

    def vmap_lambda(self, xs):
        return jax.vmap(lambda x: self.step(x)[0] * 2)(xs)

    def jacrev_write(self, x):
        return jax.jacrev(self.loss)(x)

    def jacfwd_write(self, x):
        return jax.jacfwd(self.loss)(x)

    def hessian_write(self, x):
        return jax.hessian(self.loss)(x)

    def vectorize_write(self, xs):
        return jnp.vectorize(lambda x: self.step(x)[0], signature="(n)->(n)")(xs)

    def root_write(self, x):
        def f(v):
            self.mean = self.mean + v  # <- root writes
            return v * v - 2.0 - x * x
        def solve(g, v0):
            v = v0
            for _ in range(20):
                v = v - g(v) / (2 * v)
            return v
        return jax.lax.custom_root(f, jnp.ones(3), solve, lambda g, y: y / g(jnp.ones(3)))

    def matvec_count(self, v):
        self.calls += 1  # <- matvec writes
        return v * jnp.abs(self.w)

    def linsolve_count(self, b):
        return jax.lax.custom_linear_solve(self.matvec_count, b,
                                           lambda mv, r: r / jnp.abs(self.w))

    def vmap_then_overwrite(self, xs):
        ys, means = jax.vmap(self.step)(xs)
        self.mean = means.mean(0)
        return ys

    def grad_then_overwrite(self, x):
        g, m = jax.grad(lambda v: (self.step(v)[0].sum(), self.mean), has_aux=True)(x)
        self.mean = m * 2
        return g

    def add_count(self, a, b):
        self.calls += 1  # <- reduce writes
        return a + b

    def reduce_write(self, xs):
        return jax.lax.reduce(xs, 0.0, self.add_count, (0,))
"""


AROUND = """
@DECORATE
class Rnn:
    def __init__(self):
        self.w = jnp.array([[0.5, -0.2, 0.1], [0.3, 0.4, -0.6], [0.0, 0.2, 0.9]])
        self.h = jnp.zeros(3)
        self.steps = jnp.zeros((), jnp.int32)
        self.mean = jnp.zeros(3)
        self.key = jax.random.PRNGKey(0)

    def cell(self, c, x):
        self.h = jnp.tanh(self.h @ self.w + x)
        self.steps += 1
        return c + self.h.sum(), self.h

    def __call__(self, xs):
        return lax.scan(self.cell, 0.0, xs)

    def fori(self, x):
        def body(i, v):
            self.mean = self.mean * 0.5 + v
            self.steps += 1
            return v * 0.9
        return lax.fori_loop(0, 3, body, x)

    def loop(self, x):
        def cond(v):
            return v.sum() < 4.0
        def body(v):
            self.steps += 1
            self.mean = self.mean + 0.25
            return v + 1.0
        return lax.while_loop(cond, body, x)

    def branch(self, x):
        def yes(v):
            self.mean = self.mean + v
            return v * 2
        def no(v):
            self.steps += 5
            return -v
        return lax.cond(x.sum() > 0, yes, no, x)

    def noisy(self, x):
        self.key, sub = jax.random.split(self.key)
        self.mean = self.mean + jax.random.normal(sub, (3,)) * 0.1
        self.steps += 1
        return x + self.mean

    def vm(self, xs):
        self.steps += 1
        return jax.vmap(lambda v: jnp.tanh(v @ self.w + self.h))(xs)

    def gr(self, x):
        self.mean = self.mean + x
        return jax.grad(lambda v: (jnp.sin(v @ self.w) * self.mean).sum())(x)

    def jitted_read(self, x):
        self.h = self.h + x
        return jax.jit(lambda v: v @ self.w + self.h)(x)

    def scaled(self, x, k):
        self.steps += k
        return lax.scan(self.cell, 0.0, x * k)[0] if k > 1 else -x.sum()

    def sign_body(self, c, x):
        if x.sum() > 0:
            self.mean = self.mean + x
        else:
            self.steps += 1
        return c + 1.0, x * 2

    def python_branch_scan(self, xs):
        return lax.scan(self.sign_body, 0.0, xs)
"""


X_BATCH = jnp.array([[1.0, 2.0, 0.5], [0.0, -1.0, 2.0], [1.5, 0.5, -0.5], [-1.0, 1.0, 1.0]])


Y_BATCH = jnp.array([[0.5, -0.5], [1.0, 0.0], [-0.5, 0.5], [0.0, 1.0]])


TORCH_TRAINING = """
def get_param(model, name):
    *path, leaf = name.split(".")
    for p in path:
        model = getattr(model, p)
    return getattr(model, leaf)


def set_param(model, name, value):
    *path, leaf = name.split(".")
    for p in path:
        model = getattr(model, p)
    setattr(model, leaf, value)


def init_wb(n_in, n_out, scale):
    w = scale * jnp.linspace(-1.0, 1.0, n_in * n_out).reshape(n_in, n_out)
    return w, jnp.linspace(0.0, 0.2, n_out)


class LinearOps:
    \"\"\"An undecorated base that only reads.\"\"\"

    def named_parameters(self, prefix=""):
        return {prefix + "w": self.w, prefix + "b": self.b}

    def apply(self, params, x, prefix=""):
        return jnp.tanh(x @ params[prefix + "w"] + params[prefix + "b"])


@DECORATE
class Linear(LinearOps):
    \"\"\"The optimizer's writes make w and b states: declared as such.\"\"\"

    def __init__(self, n_in, n_out, scale=1.0):
        w, b = init_wb(n_in, n_out, scale)
        self.w = STATE(w)
        self.b = STATE(b)
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.calls += 1
        return self.apply(self.named_parameters(), x)


@DECORATE
class ParamLinear(LinearOps):
    \"\"\"w and b are parameters: no method of the class assigns them.\"\"\"

    def __init__(self, n_in, n_out, scale=1.0):
        self.w, self.b = init_wb(n_in, n_out, scale)
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.calls += 1
        return self.apply(self.named_parameters(), x)


@DECORATE
class MLP:
    def __init__(self, as_state=True, int_buffer=False):
        cls = Linear if as_state else ParamLinear
        self.l1 = cls(3, 4, 1.0)
        self.l2 = cls(4, 2, 0.5)
        # A non-trainable integer buffer (an output permutation), never assigned again.
        self.perm = jnp.array([1, 0]) if int_buffer else None

    def named_parameters(self):
        return {**self.l1.named_parameters("l1."), **self.l2.named_parameters("l2.")}

    def _permute(self, y):
        return y if self.perm is None else y[:, self.perm]

    def apply(self, params, x):
        return self._permute(self.l2.apply(params, self.l1.apply(params, x, "l1."), "l2."))

    def __call__(self, x):
        return self._permute(self.l2(self.l1(x)))


def sgd_update(opt, grads):
    buf = dict(opt.buf)
    for name in sorted(grads):
        buf[name] = opt.momentum * buf[name] + grads[name]
        set_param(opt.model, name, get_param(opt.model, name) - opt.lr * buf[name])
    return buf


@DECORATE
class SGD:
    def __init__(self, model, lr=0.1, momentum=0.9):
        self.model = model
        self.lr = STATE(lr)
        self.momentum = momentum
        self.buf = {k: jnp.zeros_like(v) for k, v in model.named_parameters().items()}
        self.steps = jnp.zeros((), jnp.int32)
        self.grad_norm = jnp.zeros(())

    def zero_grad(self):
        self.grad_norm = jnp.zeros(())

    def step(self, grads):
        self.steps += 1
        self.grad_norm = self.grad_norm + sum(jnp.sum(g * g) for g in grads.values())
        self.buf = sgd_update(self, grads)


@DECORATE
class FixedLrSGD:
    \"\"\"The same, with the lr a Python float no method of the class assigns.\"\"\"

    def __init__(self, model, lr=0.1, momentum=0.9):
        self.model = model
        self.lr = lr
        self.momentum = momentum
        self.buf = {k: jnp.zeros_like(v) for k, v in model.named_parameters().items()}

    def zero_grad(self):
        pass

    def step(self, grads):
        self.buf = sgd_update(self, grads)


def adam_update(opt, name, g, st):
    st["step"] = st["step"] + 1
    st["m"] = opt.b1 * st["m"] + (1 - opt.b1) * g
    st["v"] = opt.b2 * st["v"] + (1 - opt.b2) * g * g
    mh = st["m"] / (1 - opt.b1 ** st["step"])
    vh = st["v"] / (1 - opt.b2 ** st["step"])
    p = get_param(opt.model, name)
    set_param(opt.model, name, p - opt.lr * mh / (jnp.sqrt(vh) + opt.eps))


def moments(model):
    return {
        k: {"m": jnp.zeros_like(v), "v": jnp.zeros_like(v), "step": jnp.zeros((), jnp.int32)}
        for k, v in model.named_parameters().items()
    }


@DECORATE
class Adam:
    \"\"\"``self.state[name]`` changed through a local alias, then stored back.\"\"\"

    def __init__(self, model, lr=0.05, betas=(0.9, 0.99), eps=1e-8):
        self.model = model
        self.lr = STATE(lr)
        self.b1, self.b2 = betas
        self.eps = eps
        self.state = moments(model)

    def zero_grad(self):
        pass

    def step(self, grads):
        for name, g in grads.items():
            st = self.state[name]
            adam_update(self, name, g, st)
            self.state[name] = st


@DECORATE
class AliasAdam(Adam):
    \"\"\"A state dict changed through the alias only (the base's step makes it a state).\"\"\"

    def step(self, grads):
        for name, g in grads.items():
            st = self.state[name]
            adam_update(self, name, g, st)


@DECORATE
class TorchAdam:
    \"\"\"PyTorch's layout exactly: no method assigns ``self.state``, each step changes
    ``self.state[name]`` in place through a local alias.\"\"\"

    def __init__(self, model, lr=0.05, betas=(0.9, 0.99), eps=1e-8):
        self.model = model
        self.lr = STATE(lr)
        self.b1, self.b2 = betas
        self.eps = eps
        self.state = moments(model)

    def zero_grad(self):
        pass

    def step(self, grads):
        for name, g in grads.items():
            st = self.state[name]
            adam_update(self, name, g, st)


@DECORATE
class LazyAdam(Adam):
    \"\"\"Moments created on the first step, PyTorch's ``defaultdict(dict)``.\"\"\"

    def __init__(self, model, lr=0.05):
        super().__init__(model, lr)
        self.state = collections.defaultdict(dict)

    def step(self, grads):
        for name in grads:
            if "m" not in self.state[name]:
                p = get_param(self.model, name)
                self.state[name] = {
                    "m": jnp.zeros_like(p), "v": jnp.zeros_like(p), "step": jnp.zeros((), jnp.int32)
                }
        super().step(grads)


@DECORATE
class StepLR:
    def __init__(self, opt, gamma=0.5, every=2):
        self.opt = opt
        self.gamma = gamma
        self.every = every
        self.base_lr = opt.lr
        self.epoch = jnp.zeros((), jnp.int32)

    def step(self):
        self.epoch += 1
        self.opt.lr = self.base_lr * self.gamma ** (self.epoch // self.every)


@DECORATE
class EarlyStopping:
    def __init__(self, patience=2, min_delta=0.0):
        self.patience = patience
        self.min_delta = min_delta
        self.best = jnp.asarray(jnp.inf)
        self.bad = jnp.zeros((), jnp.int32)
        self.stop = jnp.asarray(False)

    def update(self, loss):
        improved = loss < self.best - self.min_delta
        self.best = jnp.where(improved, loss, self.best)
        self.bad = jnp.where(improved, 0, self.bad + 1)
        self.stop = self.stop | (self.bad >= self.patience)
        return self.stop


@DECORATE
class MeanMetric:
    def __init__(self):
        self.total = 0.0
        self.count = jnp.zeros((), jnp.int32)

    def update(self, v):
        self.total = self.total + v
        self.count += 1

    def compute(self):
        return self.total / self.count

    def reset(self):
        self.total = 0.0
        self.count = jnp.zeros((), jnp.int32)


@DECORATE
class Trainer:
    def __init__(self, model, opt, sched=None, stopper=None, metric=None):
        self.model = model
        self.opt = opt
        self.sched = sched
        self.stopper = stopper
        self.metric = metric
        self.global_step = jnp.zeros((), jnp.int32)

    def loss_fn(self, params, x, y):
        return jnp.mean((self.model.apply(params, x) - y) ** 2)

    def fit_step(self, x, y):
        loss, grads = jax.value_and_grad(self.loss_fn)(self.model.named_parameters(), x, y)
        self.opt.zero_grad()
        self.opt.step(grads)
        if self.sched is not None:
            self.sched.step()
        if self.metric is not None:
            self.metric.update(loss)
        if self.stopper is not None:
            self.stopper.update(loss)
        self.global_step += 1
        return loss, self.model(x)

    def evaluate(self, x, y):
        return self.loss_fn(self.model.named_parameters(), x, y)


def sgd_trainer(as_state=True, lr_state=True, sched=True):
    model = MLP(as_state)
    opt = SGD(model) if lr_state else FixedLrSGD(model)
    return Trainer(model, opt, StepLR(opt) if sched else None, EarlyStopping(), MeanMetric())


@DECORATE
class GroupSGD:
    \"\"\"PyTorch's ``param_groups``: a list of dicts no method of the class assigns.\"\"\"

    def __init__(self, model, lr=0.1):
        self.model = model
        self.param_groups = [{"params": sorted(model.named_parameters()), "lr": lr}]

    def zero_grad(self):
        pass

    def step(self, grads):
        for group in self.param_groups:
            for name in group["params"]:
                set_param(self.model, name, get_param(self.model, name) - group["lr"] * grads[name])


@DECORATE
class GroupStepLR:
    \"\"\"PyTorch's scheduler: ``group["lr"] = ...`` on the optimizer's param_groups.\"\"\"

    def __init__(self, opt, gamma=0.5):
        self.opt = opt
        self.gamma = gamma

    def step(self):
        for group in self.opt.param_groups:
            group["lr"] = group["lr"] * self.gamma


@DECORATE
class TorchEarlyStopping:
    \"\"\"The usual PyTorch recipe: Python numbers and an ``if`` on the loss.\"\"\"

    def __init__(self, patience=1):
        self.patience = patience
        self.best = float("inf")
        self.counter = 0
        self.early_stop = False

    def __call__(self, loss):
        if loss < self.best:
            self.best = loss
            self.counter = 0
        else:
            self.counter += 1
            if self.counter >= self.patience:
                self.early_stop = True
        return self.early_stop


@DECORATE
class BNNet:
    \"\"\"Input statistics updated by the forward pass (from x only) and, optionally, the
    last output kept on the model, PyTorch's forward-hook habit.\"\"\"

    def __init__(self, keep_output=False):
        self.w = STATE(jnp.array([[0.5, -1.0], [2.0, 0.5], [-0.5, 1.0]]))
        self.running_mean = jnp.zeros(3)
        self.seen = jnp.zeros((), jnp.int32)
        self.keep_output = keep_output
        self.last_out = jnp.zeros((4, 2))

    def forward(self, w, x):
        self.seen += 1
        self.running_mean = 0.9 * self.running_mean + 0.1 * x.mean(0)
        out = jnp.tanh((x - self.running_mean) @ w)
        if self.keep_output:
            self.last_out = out
        return out


@DECORATE
class ForwardTrainer:
    \"\"\"``jax.value_and_grad`` of a loss whose forward pass writes the model's states.\"\"\"

    def __init__(self, keep_output=False, lr=0.2):
        self.model = BNNet(keep_output)
        self.lr = lr
        self.loss = jnp.zeros(())

    def fit_step(self, x, y):
        def loss_fn(w):
            return jnp.mean((self.model.forward(w, x) - y) ** 2)

        self.loss, g = jax.value_and_grad(loss_fn)(self.model.w)
        self.model.w = self.model.w - self.lr * g
        return self.loss


@DECORATE
class AccumSGD:
    \"\"\"Gradient accumulation with PyTorch's ``zero_grad(set_to_none=...)``.\"\"\"

    def __init__(self, model, lr=0.1, set_to_none=False):
        self.model = model
        self.lr = lr
        self.micro = jnp.zeros((), jnp.int32)
        self.zero_grad(set_to_none)

    def zero_grad(self, set_to_none=False):
        if set_to_none:
            self.grads = None
        else:
            self.grads = {k: jnp.zeros_like(v) for k, v in self.model.named_parameters().items()}

    def accumulate(self, grads):
        self.micro += 1
        if self.grads is None:
            self.grads = grads
        else:
            self.grads = {k: self.grads[k] + g for k, g in grads.items()}

    def step(self):
        for k, g in self.grads.items():
            set_param(self.model, k, get_param(self.model, k) - self.lr * g / self.micro)
        self.micro = jnp.zeros((), jnp.int32)


@DECORATE
class AccumTrainer:
    def __init__(self, set_to_none=False):
        self.model = MLP()
        self.opt = AccumSGD(self.model, set_to_none=set_to_none)
        self.set_to_none = set_to_none

    def fit_step(self, x, y):
        losses = []
        for xb, yb in ((x[:2], y[:2]), (x[2:], y[2:])):
            def loss_fn(p, xb=xb, yb=yb):
                return jnp.mean((self.model.apply(p, xb) - yb) ** 2)

            loss, g = jax.value_and_grad(loss_fn)(self.model.named_parameters())
            self.opt.accumulate(g)
            losses.append(loss)
        self.opt.step()
        self.opt.zero_grad(self.set_to_none)
        return jnp.stack(losses)


@DECORATE
class PatchingScheduler:
    \"\"\"PyTorch's LRScheduler wraps ``optimizer.step`` to count its calls.\"\"\"

    def __init__(self, opt):
        self.opt = opt
        self.opt_calls = jnp.zeros((), jnp.int32)
        orig = opt.step
        sched = self

        @functools.wraps(orig)
        def patched(*args, **kwargs):
            sched.opt_calls += 1
            return orig(*args, **kwargs)

        opt.step = patched

    def step(self):
        self.opt_calls = self.opt_calls + 0


def patched_trainer():
    model = MLP()
    opt = SGD(model)
    return Trainer(model, opt, PatchingScheduler(opt))


@DECORATE
class ArgTrainer:
    \"\"\"Holds no model: ``fit_step(model, x, y)`` steps the model it is given.\"\"\"

    def __init__(self, lr=0.1):
        self.lr = lr
        self.steps = jnp.zeros((), jnp.int32)

    def fit_step(self, model, x, y):
        def loss_fn(p):
            return jnp.mean((model.apply(p, x) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(model.named_parameters())
        for name, g in grads.items():
            set_param(model, name, get_param(model, name) - self.lr * g)
        self.steps += 1
        return loss


def group_trainer(int_buffer=False):
    model = MLP(int_buffer=int_buffer)
    opt = GroupSGD(model)
    return Trainer(model, opt, GroupStepLR(opt))


def adam_trainer(kind="Adam"):
    model = MLP()
    opt = globals()[kind](model)
    return Trainer(model, opt, StepLR(opt, 0.7, 1), EarlyStopping(1, 0.01), MeanMetric())
"""


TORCH_HEADER = "import collections\nimport functools\n"


LIGHTNING = """
@DECORATE
class LitModel:
    \"\"\"LightningModule style: the trainer sets ``model.trainer = self``; the model's
    ``log`` writes the trainer's metrics, its step reads the trainer's step.\"\"\"

    def __init__(self):
        self.w = STATE(jnp.array([0.5, -0.5, 1.0]))
        self.trainer = None

    def _trainer(self):
        t = self.trainer
        return t() if isinstance(t, weakref.ref) else t

    def log(self, name, value):
        trainer = self._trainer()
        trainer.logged = {**trainer.logged, name: value}

    def training_step(self, x, y):
        def loss_fn(w):
            return jnp.mean((x @ w - y) ** 2)

        loss, g = jax.value_and_grad(loss_fn)(self.w)
        self.w = self.w - self._trainer().lr * g
        self.log("train_loss", loss)
        self.log("step", self._trainer().global_step)
        return loss


@DECORATE
class LitTrainer:
    def __init__(self, model, lr=0.1, weak=False):
        self.model = model
        model.trainer = weakref.ref(self) if weak else self
        self.lr = lr
        self.logged = {}
        self.global_step = jnp.zeros((), jnp.int32)

    def reset_logs(self):
        self.logged = {}

    def fit_step(self, x, y):
        loss = self.model.training_step(x, y)
        self.global_step += 1
        return loss, self.model._trainer() is self


def lit(weak=False):
    return LitTrainer(LitModel(), weak=weak)


def lit_model():
    return LitTrainer(LitModel()).model


@DECORATE
class Manager:
    \"\"\"A registry dict of models, filled by ``register``.\"\"\"

    def __init__(self):
        self.models = {}
        self.calls = jnp.zeros((), jnp.int32)

    def register(self, name, model):
        self.models[name] = model
        return self

    def __call__(self, name, x):
        self.calls += 1
        return self.models[name](x)

    def all(self, x):
        return {k: m(x) for k, m in self.models.items()}

    def bump(self, name):
        self.models[name].n += 10
        return self.models["c"].n


@DECORATE
class Scaled:
    def __init__(self, k):
        self.w = jnp.full((3,), k)
        self.n = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.n += 1
        return x @ self.w * self.n


def registry():
    shared = Scaled(3.0)
    return Manager().register("a", Scaled(1.0)).register("b", shared).register("c", shared)
"""


YL = X_BATCH.sum(-1)


LIT_STEPS = [("fit_step", (X_BATCH * (1 + 0.5 * i), YL)) for i in range(3)]


CROSS = """
@DECORATE
class Tally:
    def __init__(self):
        self.count = jnp.zeros((), jnp.int32)
        self.total = jnp.zeros(())

    def reset(self):
        self.count = jnp.zeros((), jnp.int32)
        self.total = jnp.zeros(())


TALLY = Tally()


@DECORATE
class Writer:
    def __init__(self, other=None):
        self.n = jnp.zeros(())
        self.other = other

    def write_arg(self, x, other):
        self.n = self.n + x
        other.count += 1
        other.total = other.total + self.n
        return self.n * other.count

    def write_global(self, x):
        self.n = self.n + x
        TALLY.count += 1
        TALLY.total = TALLY.total + self.n
        return self.n * TALLY.count

    def write_attr(self, x):
        self.n = self.n + x
        self.other.count += 1
        self.other.total = self.other.total + self.n
        return self.n * self.other.count

    def read_global_alias(self, x):
        self.other.count += 1
        return x * TALLY.count

    def write_arg_read_attr(self, x, other):
        other.count += 1
        return x * self.other.count


@DECORATE
class Both:
    def __init__(self):
        self.tally = Tally()
        self.writer = Writer(self.tally)

    def via_arg(self, x):
        return self.writer.write_arg(x, self.tally)

    def via_attr(self, x):
        return self.writer.write_attr(x)

    def __call__(self, x):
        return self.via_arg(x) + self.via_attr(2.0 * x), self.tally.count


def global_writer():
    return Writer(TALLY)


@DECORATE
class Recorder:
    def __init__(self):
        self.calls = jnp.zeros((), jnp.int32)
        self.last = jnp.zeros(())

    def hook(self, module, out):
        self.calls += 1
        self.last = out.sum() * module.scale


@DECORATE
class Hooked:
    def __init__(self):
        self.scale = jnp.asarray(2.0)
        self.hooks = []
        self.n = jnp.zeros((), jnp.int32)

    def register_forward_hook(self, fn):
        self.hooks.append(fn)
        return self

    def __call__(self, x):
        self.n += 1
        out = jnp.tanh(x * self.scale)
        for h in self.hooks:
            h(self, out)
        return out


@DECORATE
class HookTrainer:
    \"\"\"A recorder's bound method registered as the model's forward hook: the recorder
    is reached through the trainer and through the hook.\"\"\"

    def __init__(self):
        self.model = Hooked()
        self.recorder = Recorder()
        self.model.register_forward_hook(self.recorder.hook)

    def __call__(self, x):
        return self.model(x), self.recorder.last, self.recorder.calls


def hooked_model():
    return Hooked().register_forward_hook(Recorder().hook)


@DECORATE
class KVCache:
    def __init__(self, n=4, d=2):
        self.k = jnp.zeros((n, d))
        self.pos = jnp.zeros((), jnp.int32)

    def reset(self):
        self.k = jnp.zeros_like(self.k)
        self.pos = jnp.zeros((), jnp.int32)


@DECORATE
class Attn:
    def __init__(self):
        self.wk = jnp.array([[1.0, 0.5], [0.0, -1.0], [0.5, 0.5]])
        self.wq = jnp.array([[0.5, 0.0], [1.0, 1.0], [-0.5, 0.5]])
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, x, cache):
        self.calls += 1
        cache.k = cache.k.at[cache.pos].set(x @ self.wk)
        cache.pos += 1
        scores = cache.k @ (x @ self.wq)
        mask = jnp.arange(cache.k.shape[0]) < cache.pos
        return jnp.sum(jnp.where(mask, scores, 0.0))


@DECORATE
class CachedDecoder:
    def __init__(self):
        self.attn = Attn()
        self.cache = KVCache()

    def __call__(self, x):
        return self.attn(x, self.cache)

    def generate(self, x, n=3):
        self.cache.reset()
        return jnp.stack([self.attn(x * (i + 1), self.cache) for i in range(n)])
"""


CALLABLES = """
@DECORATE
class Sub:
    def __init__(self, w=2.0):
        self.w = jnp.asarray(w)
        self.c = jnp.zeros(())

    def fwd(self, x):
        self.c = self.c + 1
        return self.w * x


@DECORATE
class MultiCell:
    def __init__(self):
        self.n = jnp.zeros(())
        self.a = Sub(2.0)
        self.b = Sub(3.0)
        a, b, k, box = self.a, self.b, 1.5, [10.0]
        self.fn = lambda x: a.fwd(x) + b.fwd(x) * k + box[0] + self._bump(x)

    def _bump(self, x):
        self.n = self.n + x
        return self.n

    def __call__(self, x):
        return self.fn(x)


@DECORATE
class Nested:
    def __init__(self):
        self.n = jnp.zeros(())
        self.make = lambda s: (lambda x: self._bump(x * s))

    def _bump(self, x):
        self.n = self.n + x
        return self.n

    def __call__(self, x):
        return self.make(2.0)(x)


@DECORATE
class Defaults:
    def __init__(self, s=2.0, t=3.0):
        self.n = jnp.zeros(())
        self.fn = lambda x, s=s, *, t=t: self._bump(x * s + t)

    def _bump(self, x):
        self.n = self.n + x
        return self.n

    def __call__(self, x):
        return self.fn(x)


@DECORATE
class KwOnly:
    def __init__(self, k):
        self.n = jnp.zeros(())
        self.fn = lambda x, *, k=k: self._bump(x) * k

    def _bump(self, x):
        self.n = self.n + x
        return self.n

    def __call__(self, x):
        return self.fn(x)


@DECORATE
class Counting:
    def __init__(self):
        self.n = jnp.zeros(())
        count = 0

        def fn(x):
            nonlocal count
            count += 1
            return self._bump(x) * count

        self.fn = fn

    def _bump(self, x):
        self.n = self.n + x
        return self.n

    def __call__(self, x):
        return self.fn(x)


@DECORATE
class BoundBefore:
    def __init__(self):
        head = Sub(4.0)
        self.score = head.fwd
        self.head = head

    def __call__(self, x):
        return self.score(x)


@DECORATE
class Tied:
    def __init__(self):
        s = Sub(2.0)
        self.a = s
        self.b = s
        self.fa = self.a.fwd
        self.fb = self.b.fwd

    def __call__(self, x):
        return self.fa(x) + self.fb(x) + self.a.c


@DECORATE
class Foreign:
    def __init__(self):
        self.n = jnp.zeros(())
        self.score = Sub(5.0).fwd

    def __call__(self, x):
        self.n = self.n + 1
        return self.score(x) + self.n


@DECORATE
class DeadRef:
    def __init__(self):
        self.n = jnp.zeros(())
        self.ref = weakref.ref(Sub(1.0))

    def __call__(self, x):
        self.n = self.n + x
        r = self.ref()
        return self.n if r is None else r.fwd(x)


@DECORATE
class Child:
    def __init__(self, parent):
        self._parent = weakref.ref(parent)
        self.k = jnp.ones(())

    def fwd(self, x):
        return self._parent().scale * x * self.k


@DECORATE
class Parent:
    def __init__(self):
        self.scale = jnp.asarray(3.0)
        self.n = jnp.zeros(())
        self.child = Child(self)

    def __call__(self, x):
        self.n = self.n + self.child.fwd(x)
        return self.n


def _helper(x):
    return x * 7


@DECORATE
class StaticObjs:
    def __init__(self):
        self.n = jnp.zeros(())
        self.sfn = staticmethod(_helper)
        self.cfn = type(self).scale_of

    @classmethod
    def scale_of(cls, x):
        return x * 0.5

    def __call__(self, x):
        self.n = self.n + self.sfn(x) + self.cfn(x)
        return self.n


@DECORATE
class TreePartial:
    def __init__(self):
        self.n = jnp.zeros(())
        self.fn = jax.tree_util.Partial(self._bump)

    def _bump(self, x):
        self.n = self.n + x
        return self.n

    def __call__(self, x):
        return self.fn(x)


@DECORATE
class InList:
    def __init__(self):
        self.n = jnp.zeros(())
        self.sub = Sub(3.0)
        self.fns = ([self._bump, lambda x: self.sub.fwd(x)], {"r": weakref.ref(self.sub)})

    def _bump(self, x):
        self.n = self.n + x
        return self.n

    def __call__(self, x):
        return self.fns[0][0](x) + self.fns[0][1](x) + self.fns[1]["r"]().fwd(x)


def _outer_of(model):
    return lambda: model.n


@DECORATE
class ViaFunction:
    def __init__(self):
        self.n = jnp.zeros(())
        get = _outer_of(self)
        self.fn = lambda x: get() + x

    def __call__(self, x):
        self.n = self.n + x
        return self.fn(x)


@DECORATE
class ViaBox:
    def __init__(self):
        self.n = jnp.zeros(())
        box = [self]
        self.fn = lambda x: box[0].n + x

    def __call__(self, x):
        self.n = self.n + x
        return self.fn(x)


@DECORATE
class Appender:
    def __init__(self):
        self.n = jnp.zeros(())
        self.log = [jnp.zeros(())]
        self.push = self.log.append

    def __call__(self, x):
        self.n = self.n + x
        self.push(self.n)
        return self.n
"""


SUBMODELS = """
@DECORATE
class Sub:
    def __init__(self, w=2.0):
        self.w = jnp.asarray(w)
        self.c = jnp.zeros(())

    def fwd(self, x):
        self.c = self.c + 1
        return self.w * x


@DECORATE
class Blocks:
    def __init__(self):
        self.blocks = [Sub(1.0), Sub(2.0)]
        self.a = Sub(3.0)
        self.b = Sub(4.0)
        self.lazy = None
        self.pair = (Sub(5.0), jnp.zeros(()))
        self.score = self.a.fwd

    def relist(self, x):
        self.blocks = list(self.blocks)
        return self.blocks[0].fwd(x) + self.blocks[1].fwd(x)

    def same(self, x):
        self.a = self.a
        return self.a.fwd(x)

    def swap(self, x):
        self.a, self.b = self.b, self.a
        return self.a.fwd(x)

    def build(self):
        self.lazy = Sub(6.0)

    def use_lazy(self, x):
        return self.lazy.fwd(x)

    def build_inside(self, x):
        if self.lazy is None:
            self.lazy = Sub(6.0)
        return self.lazy.fwd(x)

    def bump_pair(self, x):
        self.pair = (self.pair[0], self.pair[1] + x)
        return self.pair[0].fwd(x) + self.pair[1]

    def bind_inside(self, x):
        self.score = self.b.fwd
        return self.score(x)

    def __call__(self, x):
        return self.a.fwd(x) + self.b.fwd(x)


@DECORATE
class Reset:
    def __init__(self):
        self.reset()

    def reset(self):
        self.head = Sub(3.0)
        self.n = jnp.zeros(())

    def __call__(self, x):
        self.n = self.n + 1
        return self.head.fwd(x) + self.n
"""


BEHIND = """
@DECORATE
class Sub:
    def __init__(self):
        self.w = jnp.asarray(2.0)
        self.c = jnp.zeros(())

    def fwd(self, x):
        self.c = self.c + 1
        return self.w * x


@DECORATE
class Behind:
    def __init__(self):
        self.w = jnp.asarray(3.0)
        self.n = jnp.zeros(())
        self.cfg = 1
        self.sub = Sub()

    def via_vars(self, x):
        vars(self)["n"] = x
        return x

    def via_update(self, x):
        self.__dict__.update(n=x)
        return x

    def via_object_state(self, x):
        object.__setattr__(self, "n", x)
        return x

    def via_object_param(self, x):
        object.__setattr__(self, "w", x)
        return x

    def via_sub_vars(self, x):
        vars(self.sub)["w"] = x
        return x

    def add_attr(self, x):
        vars(self)["extra"] = 1
        return x

    def del_attr(self, x):
        self.__dict__.pop("cfg")
        return x

    def set_static(self, x):
        vars(self)["cfg"] = 2
        return x

    def dunder_setattr(self, x):
        self.__setattr__("n", self.n + x)
        return self.n

    @functools.cached_property
    def doubled(self):
        return self.w * 2

    def use_cached(self, x):
        return self.doubled * x

    def __call__(self, x):
        self.n = self.n + x
        return self.n * self.w + self.sub.fwd(x)
"""


EAGER = """
import collections
import threading
import weakref


@DECORATE
class Model:
    def __init__(self):
        self.x = jnp.zeros(2)
        self.n = jnp.zeros((), jnp.int32)

    def step(self, v):
        self.x = v
        self.n = self.n + 1
        return self.x


@DECORATE
class Shared:
    \"\"\"A user __copy__ whose copy shares every __dict__ entry.\"\"\"

    def __init__(self):
        self.x = jnp.zeros(2)

    def step(self, v):
        self.x = v

    def __copy__(self):
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new


@DECORATE
class ByState:
    def __init__(self):
        self.x = jnp.zeros(2)

    def step(self, v):
        self.x = v

    def __getstate__(self):
        return self.__dict__

    def __setstate__(self, state):
        self.__dict__.update(state)


@DECORATE
class ByReduce:
    def __init__(self):
        self.x = jnp.zeros(2)

    def step(self, v):
        self.x = v

    def __reduce__(self):
        return (_rebuild, (type(self), self.__dict__))


def _rebuild(cls, d):
    new = object.__new__(cls)
    new.__dict__.update(d)
    return new


@DECORATE
class Hooked:
    \"\"\"Writes through a user __setattr__ and a property setter.\"\"\"

    def __init__(self):
        object.__setattr__(self, "log", [])
        self.x = jnp.zeros(2)

    def __setattr__(self, name, value):
        self.log.append(name)
        object.__setattr__(self, name, value)

    @property
    def xv(self):
        return self.x

    @xv.setter
    def xv(self, v):
        self.x = v

    def step(self, v):
        self.x = v


@DECORATE
class Tied:
    def __init__(self):
        self.a = jnp.zeros(2)
        self.b = self.a
        self.s1 = Model()
        self.s2 = self.s1

    def step(self, v):
        self.a = v
        self.s1.step(v * 2)
        return self.b


@DECORATE
class Numbers:
    def __init__(self):
        self.x = jnp.zeros(2)
        self.k = 0.0

    def step(self, v):
        self.x = v
        self.k = self.k + 1.0
"""


REBUILD = """
import enum


class Mode(enum.Enum):
    A = 1
    B = 2


@dataclasses.dataclass(frozen=True)
class Conf:
    k: int = 2
    name: str = "c"


def _scale(x):
    return x * 3.0


@DECORATE
class Leaf:
    def __init__(self, w=1.0):
        self.w = jnp.asarray(w)
        self.n = jnp.zeros(())

    def __call__(self, x):
        self.n = self.n + 1
        return self.w * x + self.n


@DECORATE
class TwoPaths:
    def __init__(self):
        self.a = Leaf(2.0)
        self.b = self.a
        self.items = [self.a, Leaf(3.0)]
        self.table = {"p": self.a, "q": (self.items[1], Leaf(4.0))}

    def __call__(self, x):
        y = self.a(x) + self.b(x)
        for m in self.items:
            y = y + m(x)
        y = y + self.table["q"][1](x) + self.table["p"].n
        return y


@DECORATE
class Callables:
    def __init__(self):
        self.leaf = Leaf(2.0)
        self.fwd = self.leaf.__call__
        self.fn = lambda x: self.leaf(x) * 2
        self.scale = _scale
        self.n = jnp.zeros(())

    def __call__(self, x):
        self.n = self.n + self.fwd(x) + self.fn(x) + self.scale(x)
        return self.n


@DECORATE
class Statics:
    def __init__(self):
        self.w = jnp.ones(2)
        self.s = "name"
        self.i = 3
        self.f = 0.5
        self.t = (1, 2, "x")
        self.none = None
        self.mode = Mode.B
        self.conf = Conf()
        self.fs = frozenset({1, 2})
        self.cplx = 1 + 2j
        self.rng = range(3)
        self.dt = jnp.float32
        self.shape = (2,)

    def __call__(self, x):
        self.w = self.w * self.f + self.i + len(self.s) + self.t[1] + self.conf.k
        if self.mode is Mode.B and self.none is None:
            self.w = self.w + sum(self.rng) + len(self.fs) + self.cplx.real
        return jnp.zeros(self.shape, self.dt) + self.w * x


@DECORATE
class OneElement:
    def __init__(self):
        self.t = (jnp.ones(2),)
        self.l = [jnp.zeros(2)]
        self.d = {"only": jnp.ones(())}
        self.opt = None

    def __call__(self, x):
        self.t = (self.t[0] * 2,)
        self.l = [self.l[0] + x]
        self.d = {"only": self.d["only"] + 1}
        extra = 0.0 if self.opt is None else 1.0
        return self.t[0] + self.l[0] + self.d["only"] + extra


@DECORATE
class PyNumber:
    def __init__(self):
        self.w = jnp.ones(())
        self.k = 0
        self.scal = 1.5

    def __call__(self, x):
        self.k = self.k + 1
        self.scal = self.scal * 2
        return self.w * x + self.k + self.scal


@DECORATE
class CopiesSelf:
    def __init__(self):
        self.k = jnp.ones(())
        self.sub = Leaf(2.0)

    def __call__(self, x):
        c = copy.copy(self)
        c.k = c.k + 100.0
        self.k = self.k + x
        return c.k + self.k + c.sub.w


@DECORATE
class Scanned:
    def __init__(self):
        self.leaf = Leaf(1.5)
        self.acc = jnp.zeros(())

    def step(self, c, x):
        self.acc = self.acc + self.leaf(x)
        return c + x, self.acc

    def __call__(self, xs):
        c, ys = lax.scan(self.step, jnp.zeros(()), xs)
        return c + ys.sum()
"""


FILE_HEADER = """\
import abc
import copy
import dataclasses
import functools
import typing
import jax
import jax.numpy as jnp
import autostate
"""


Build = Callable[[str], tuple[types.ModuleType, types.ModuleType]]


HELPER_ESCAPES = """
def raw_scan(model, xs):
    def body(c, x):
        model.s = model.s + x
        model.d = {"a": model.d["a"] + x, "b": model.d["b"]}
        model.t = (model.t[0] + x, model.t[1])
        return c, x
    jax.lax.scan(body, 0.0, xs)


def threaded_scan(model, xs):
    def body(c, x):
        model.s = model.s + x
        model.d = {"a": model.d["a"] + x, "b": model.d["b"]}
        model.t = (model.t[0] + x, model.t[1])
        return c, x
    LAXW.scan(body, 0.0, xs)


@DECORATE
class M:
    def __init__(self):
        self.s = jnp.zeros(())
        self.d = {"a": jnp.zeros(()), "b": jnp.ones(())}
        self.t = (jnp.zeros(()), jnp.ones(()))

    def reset(self):
        self.s = jnp.zeros(())
        self.d = {"a": jnp.zeros(()), "b": jnp.ones(())}
        self.t = (jnp.zeros(()), jnp.ones(()))

    def helper_then_read_array(self, xs):
        raw_scan(self, xs)
        y = self.s * 2
        self.reset()
        return y

    def helper_then_read_dict(self, xs):
        raw_scan(self, xs)
        y = self.d["a"] * 2
        self.reset()
        return y

    def helper_then_read_tuple(self, xs):
        raw_scan(self, xs)
        y = self.t[0] * 2
        self.reset()
        return y

    def helper_then_overwrite(self, xs):
        raw_scan(self, xs)
        self.reset()
        return xs * 2

    def threaded_helper(self, xs):
        threaded_scan(self, xs)
        return self.s + self.d["a"] + self.t[0]

    def grad_then_read_dict(self, x):
        def loss(v):
            self.d = {"a": v * 2, "b": v}
            return v ** 2
        g = jax.grad(loss)(x)
        return self.d["a"] + g

    def grad_then_return_dict(self, x):
        def loss(v):
            self.d = {"a": v * 2, "b": v}
            return v ** 2
        jax.grad(loss)(x)
        out = self.d
        self.reset()
        return out

    def vmap_then_read_tuple(self, xs):
        def one(v):
            self.t = (v, v)
            return v
        jax.vmap(one)(xs)
        return self.t[0] + 1

    def jit_then_read_dict(self, x):
        @jax.jit
        def inner(v):
            self.d = {"a": v * 3, "b": v}
            return v
        inner(x)
        return self.d["a"] + 1

    def grad_then_overwrite(self, x):
        def loss(v):
            self.s = v * 2
            return v ** 2 + self.s
        g = jax.grad(loss)(x)
        self.s = g
        return g
"""


HELD = """
import collections


class Box:
    def __init__(self):
        self.items = []
        self.inner = {"k": [1]}


@DECORATE
class Sub:
    def __init__(self):
        self.n = jnp.zeros(())
        self.log = []

    def __call__(self, x):
        self.n = self.n + x
        return self.n

    def logged(self, x):
        self.log.append(1)
        return self(x)


@DECORATE
class M:
    def __init__(self):
        self.w = jnp.ones(())
        self.subs = [Sub(), Sub()]
        self.named = {"a": Sub()}
        self.pair = (Sub(),)
        self.box = Box()
        self.boxes = [Box()]
        self.tagged = {"t": [Box()]}

    def list_subs(self, x):
        return self.subs[0](x) + self.subs[1](2 * x) * self.w

    def dict_sub(self, x):
        return self.named["a"](x) * self.w

    def tuple_sub(self, x):
        return self.pair[0](x) * self.w

    def logged_in_list(self, x):
        return self.subs[1].logged(x)

    def logged_in_dict(self, x):
        return self.named["a"].logged(x)

    def logged_in_tuple(self, x):
        return self.pair[0].logged(x)

    def box_in_list(self, x):
        self.boxes[0].items.append(1)
        return x * self.w

    def nested_box_dict(self, x):
        self.box.inner["k"].append(2)
        return x * self.w

    def box_in_dict_of_lists(self, x):
        self.tagged["t"][0].inner["k"][0] = 5
        return x * self.w
"""


COMMON_LAYERS = """
@DECORATE
class Dropout:
    def __init__(self, rate, seed=0):
        self.rate = rate
        self.key = jax.random.key(seed)

    def __call__(self, x):
        self.key, sub = jax.random.split(self.key)
        keep = jax.random.bernoulli(sub, 1 - self.rate, x.shape)
        return jnp.where(keep, x / (1 - self.rate), 0.0)


@DECORATE
class BatchNorm:
    def __init__(self, n, momentum=0.9):
        self.scale = jnp.ones(n)
        self.mean = jnp.zeros(n)
        self.var = jnp.ones(n)
        self.momentum = momentum
        self.training = True

    def __call__(self, x):
        if self.training:
            m, v = x.mean(0), x.var(0)
            self.mean = self.momentum * self.mean + (1 - self.momentum) * m
            self.var = self.momentum * self.var + (1 - self.momentum) * v
        else:
            m, v = self.mean, self.var
        return (x - m) / jnp.sqrt(v + 1e-5) * self.scale

    def eval(self):
        self.training = False
        return self


@DECORATE
class Linear:
    def __init__(self, n, m, seed=0):
        self.w = jax.random.normal(jax.random.key(seed), (n, m)) * 0.1
        self.b = jnp.zeros(m)

    def __call__(self, x):
        return x @ self.w + self.b


@DECORATE
class Net:
    def __init__(self):
        self.layers = [Linear(3, 4, 1), Linear(4, 4, 2)]
        self.norms = {"bn": BatchNorm(4)}
        self.drop = Dropout(0.5, 3)
        self.head = self.layers[0]          # tied: one instance, two paths
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.calls += 1
        h = jnp.tanh(self.layers[0](x))
        h = self.norms["bn"](self.layers[1](h))
        return self.drop(h).sum() + self.head.b.sum()


@DECORATE
class EMA:
    def __init__(self, model, decay=0.9):
        self.model = model
        self.shadow = jax.tree_util.tree_map(jnp.copy, {"w": model.w, "b": model.b})
        self.decay = decay

    def update(self):
        self.shadow = jax.tree_util.tree_map(
            lambda s, p: self.decay * s + (1 - self.decay) * p,
            self.shadow, {"w": self.model.w, "b": self.model.b})
        return self.shadow["w"].sum()


@DECORATE
class Adam:
    def __init__(self, params, lr=0.1, b1=0.9, b2=0.999):
        self.m = jax.tree_util.tree_map(jnp.zeros_like, params)
        self.v = jax.tree_util.tree_map(jnp.zeros_like, params)
        self.t = jnp.zeros((), jnp.int32)
        self.lr, self.b1, self.b2 = lr, b1, b2

    def __call__(self, params, grads):
        self.t += 1
        self.m = jax.tree_util.tree_map(lambda m, g: self.b1 * m + (1 - self.b1) * g, self.m, grads)
        self.v = jax.tree_util.tree_map(
            lambda v, g: self.b2 * v + (1 - self.b2) * g * g, self.v, grads)
        mh = jax.tree_util.tree_map(lambda m: m / (1 - self.b1 ** self.t), self.m)
        vh = jax.tree_util.tree_map(lambda v: v / (1 - self.b2 ** self.t), self.v)
        return jax.tree_util.tree_map(
            lambda p, m, v: p - self.lr * m / (jnp.sqrt(v) + 1e-8), params, mh, vh)


@DECORATE
class KVCache:
    def __init__(self, n, d):
        self.k = jnp.zeros((n, d))
        self.v = jnp.zeros((n, d))
        self.pos = jnp.zeros((), jnp.int32)

    def __call__(self, k, v):
        self.k = jax.lax.dynamic_update_slice(self.k, k[None], (self.pos, 0))
        self.v = self.v.at[self.pos].set(v)
        self.pos += 1
        mask = jnp.arange(self.k.shape[0]) < self.pos
        att = jnp.where(mask, self.k @ k, -jnp.inf)
        return jax.nn.softmax(att) @ self.v


@DECORATE
class Cell:
    def __init__(self, d):
        self.w = jnp.eye(d) * 0.5
        self.steps = jnp.zeros((), jnp.int32)

    def __call__(self, h, x):
        self.steps += 1
        h = jnp.tanh(h @ self.w + x)
        return h, h.sum()


@DECORATE
class RNN:
    def __init__(self, d):
        self.cell = Cell(d)
        self.h = jnp.zeros(d)

    def bound(self, xs):
        self.h, ys = lax.scan(self.cell, self.h, xs)
        return ys

    def by_lambda(self, xs):
        self.h, ys = lax.scan(lambda h, x: self.cell(h, x), self.h, xs)
        return ys

    def checkpointed(self, xs):
        step = checkpoint(lambda h, x: self.cell(h, x))
        self.h, ys = lax.scan(step, self.h, xs)
        return ys

    def remat_call(self, x):
        self.h, y = checkpoint(self.cell)(self.h, x)
        return y
"""


X3 = jnp.arange(6.0).reshape(2, 3) / 6


CONTEXT_CONSTRUCTS = """
import contextlib


@DECORATE
class Ctx:
    __match_args__ = ("s",)

    def __init__(self):
        self.w = jnp.ones(3)
        self.depth = jnp.zeros(())
        self.s = jnp.zeros(())
        self.log = jnp.zeros(())

    def __enter__(self):
        self.depth = self.depth + 1
        return self

    def __exit__(self, *exc):
        self.depth = self.depth - 1
        self.log = self.log + 10
        return False

    def with_self(self, x):
        with self:
            self.s = self.s + x * self.depth
        return self.s + self.depth

    def nested_cm(self, x):
        @contextlib.contextmanager
        def scope():
            self.depth = self.depth + 1
            try:
                yield self.s
            finally:
                self.depth = self.depth - 1
                self.s = self.s * 2
        with scope() as v:
            self.s = self.s + x + v
        return self.s

    def try_finally(self, x):
        try:
            self.s = self.s + x
            raise ValueError("boom")
        except ValueError:
            self.log = self.log + 1
        finally:
            self.depth = self.depth + 2
        return self.s

    def raising_inner(self, x):
        self.s = self.s + x
        raise KeyError("inner")

    def catches(self, x):
        try:
            self.raising_inner(x)
        except KeyError:
            self.log = self.log + 100
        return self.s + self.log

    def lambda_default(self, x):
        f = lambda v, base=self.s: v + base
        self.s = self.s + 1
        return f(x) + self.s

    def closure_nonlocal(self, x):
        total = jnp.zeros(())
        def add(v):
            nonlocal total
            total = total + v * self.s
            self.s = self.s + 1
        add(x)
        add(x)
        return total

    def genexpr_writes(self, x):
        def bump(i):
            self.s = self.s + i * x
            return self.s
        vals = list(bump(i) for i in range(3))
        d = {i: bump(i) for i in range(2)}
        return jnp.stack(vals), d

    def fstring(self, x):
        self.s = self.s + x
        msg = f"depth={self.depth} s={self.s!r}"
        return self.s, len(msg) > 0

    def assert_eagerly(self, x):
        self.s = self.s + x
        assert self.log.shape == ()
        return self.s

    def lazy_gen(self, n):
        def gen():
            for i in range(n):
                self.s = self.s + i
                yield self.s
        return gen()

    def consume_lazy(self, x):
        out = [v for v in self.lazy_gen(3)]
        return jnp.stack(out) + x

    def class_pattern(self, x):
        self.s = self.s + x
        match self:
            case Ctx(s):
                return s * 2
        return x

    def match_shape(self, x):
        match self.w.shape:
            case (3,):
                self.s = self.s + x
            case _:
                self.s = self.s - x
        return self.s

    def sum_over_vars_keys(self, x):
        self.s = self.s + x
        return sum(jnp.sum(getattr(self, k)) for k in sorted(vars(self)))

    def scan_raises(self, xs):
        def body(c, x):
            self.s = self.s + x
            if c.ndim == 0:
                raise ValueError("stop")
            return c, x
        try:
            lax.scan(body, jnp.zeros(()), xs)
        except ValueError:
            pass
        return self.s

    def cond_raises(self, x):
        def yes(v):
            self.s = self.s + v
            raise ValueError("stop")
        def no(v):
            return v
        try:
            lax.cond(x > 0, yes, no, x)
        except ValueError:
            pass
        return self.s + 1

    def count_arrays(self):
        return sum(1 for v in vars(self).values() if isinstance(v, jax.Array))

    def buffers(self):
        return {k: v for k, v in self.__dict__.items() if isinstance(v, jax.Array)}
"""


TORCH_IDIOMS = """
@DECORATE
class LazyLinear:
    def __init__(self, out):
        self.out = out
        self.w = None

    def __call__(self, x):
        if self.w is None:
            self.w = jnp.ones((x.shape[-1], self.out)) * 0.5  # LAZY
        return x @ self.w


@DECORATE
class Dyn:
    def __init__(self, n):
        self.n = n
        for i in range(n):
            setattr(self, f"layer{i}", jnp.full((), float(i + 1)))
        self.acc = jnp.zeros(())

    def __call__(self, x):
        for i in range(self.n):
            x = x * getattr(self, f"layer{i}")
        self.acc = self.acc + x
        return x


@DECORATE
class Sub:
    def __init__(self, k):
        self.w = jnp.full((2,), k)
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.calls += 1
        return x * self.w


@DECORATE
class NamedLayers:
    def __init__(self, n):
        self.n = n
        for i in range(n):
            setattr(self, f"layer{i}", Sub(float(i + 1)))

    def __call__(self, x):
        for i in range(self.n):
            x = getattr(self, f"layer{i}")(x)
        return x


@DECORATE
class DictUpdate:
    def __init__(self):
        self.__dict__.update(a=jnp.ones(()), b=jnp.zeros(()))
        self.c = jnp.zeros(())

    def __call__(self, x):
        self.c = self.c + x * self.a + self.b
        return self.c


@DECORATE
class Buffers:
    def __init__(self):
        self._buffers = {}
        self.register_buffer("mean", jnp.zeros(2))
        self.steps = jnp.zeros((), jnp.int32)

    def register_buffer(self, name, value):
        self._buffers[name] = value

    def __call__(self, x):
        self._buffers = {**self._buffers, "mean": 0.9 * self._buffers["mean"] + 0.1 * x}
        self.steps += 1
        return self._buffers["mean"]


@DECORATE
class Mode:
    def __init__(self):
        self.training = True
        self.mean = jnp.zeros(())

    def train(self, mode=True):
        self.training = mode
        return self

    def eval(self):
        return self.train(False)

    def set_eval(self):
        self.eval()

    def __call__(self, x):
        if self.training:
            self.mean = 0.5 * self.mean + 0.5 * x
            return x - x
        return x - self.mean

    def predict_in_eval(self, x):
        old = self.training
        self.training = False  # TOGGLE
        y = self(x)
        self.training = old
        return y


@DECORATE
class PyCounter:
    def __init__(self):
        self.step = 0
        self.acc = jnp.zeros(())

    def __call__(self, x):
        self.step += 1  # STEP
        self.acc = self.acc + x * self.step
        return self.acc


@DECORATE
class ShapeChange:
    def __init__(self):
        self.hist = jnp.zeros((0,))

    def __call__(self, x):
        self.hist = jnp.concatenate([self.hist, x[None]])
        return self.hist.sum()


@DECORATE
class DtypeChange:
    def __init__(self):
        self.v = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.v = self.v + x
        return self.v


@DECORATE
class ResetCache:
    def __init__(self):
        self.cache = jnp.zeros(())

    def reset(self):
        self.cache = None

    def __call__(self, x):
        if self.cache is None:
            self.cache = x
        else:
            self.cache = self.cache + x
        return self.cache
"""


BODIES = """
@DECORATE
class Other:
    def __init__(self):
        self.n = jnp.zeros(())

    def bump(self, x):
        self.n = self.n + x
        return self.n


OTHER = Other()


@DECORATE
class B:
    def __init__(self):
        self.a = jnp.zeros(())
        self.b = jnp.ones(())
        self.key = jax.random.PRNGKey(0)
        self.tkey = jax.random.key(1)
        self.step = 0
        self.trace_log = []
        self.lr = 0.5
        self.sub = Other()
        self.subs = [self.sub, self.sub]

    def global_model_in_scan(self, xs):
        def body(c, x):
            return c, OTHER.bump(x)
        return lax.scan(body, 0.0, xs)[1]

    def reset(self):
        self.b = jnp.ones(())

    def dyn_setattr_in_scan(self, xs):
        def body(c, x):
            for name in ("a", "b"):
                setattr(self, name, getattr(self, name) + x)
            return c, self.a * self.b
        return lax.scan(body, 0.0, xs)[1]

    def tied_in_scan(self, xs):
        def body(c, x):
            return c, self.subs[0].bump(x) + self.subs[1].bump(x)
        return lax.scan(body, 0.0, xs)[1]

    def keys_in_scan(self, xs):
        def body(c, x):
            self.key, sub = jax.random.split(self.key)
            self.tkey, tsub = jax.random.split(self.tkey)
            return c, jax.random.uniform(sub) + jax.random.uniform(tsub) + x
        return lax.scan(body, 0.0, xs)[1]

    def float_lr_in_scan(self, xs):
        def body(c, x):
            self.lr = self.lr * 0.9
            return c, x * self.lr
        return lax.scan(body, 0.0, xs)[1]

    def python_int_in_scan(self, xs):
        def body(c, x):
            self.a = 0  # INT
            return c, x
        lax.scan(body, 0.0, xs)
        return self.a

    def static_counter_in_scan(self, xs):
        def body(c, x):
            self.step += 1  # STATIC
            return c, x * 2
        return lax.scan(body, 0.0, xs)[1]

    def log_in_scan(self, xs):
        def body(c, x):
            self.trace_log.append(1)
            return c, x * 2
        return lax.scan(body, 0.0, xs)[1]
"""


# The family: every routed lax call (and jax.checkpoint) traces its body, so
# in each one, eagerly as under f and jit, a traced value assigned to an
# attribute that is not state, and a new Python value assigned to a static
# state, are refused at the assignment; the model is left as it was.
EVERY_LAX_BODY = """
def set_b(m, v):
    m.b = v


@DECORATE
class Q:
    def __init__(self):
        self.a = jnp.zeros(())
        self.b = jnp.ones(())  # a parameter: no method assigns `self.b`
        self.step = 0          # a static state

    def touch(self):
        self.a = self.a + 1
        self.step = self.step + 0

    def write(self, what, v):
        if what == "param":
            set_b(self, self.b + v)
        elif what == "raise":
            self.a = self.a + v
            raise ValueError("stop")
        else:
            self.step += 1
        return v

    def caught(self, method, x):
        try:
            getattr(self, method)("raise", x)
        except ValueError:
            pass
        return self.a + 1

    def scan_(self, what, x):
        return lax.scan(lambda c, v: (c + self.write(what, v), None), 0.0, x * jnp.ones(3))[0]

    def cond_(self, what, x):
        return lax.cond(x > 0, lambda v: self.write(what, v), lambda v: v, x)

    def switch_(self, what, x):
        return lax.switch(1, [lambda v: v, lambda v: self.write(what, v)], x)

    def while_(self, what, x):
        return lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, self.write(what, c[1])),
                              (0, x))[1]

    def fori_(self, what, x):
        return lax.fori_loop(0, 3, lambda i, v: self.write(what, v), x)

    def map_(self, what, x):
        return lax.map(lambda v: self.write(what, v), x * jnp.ones(3))

    def checkpoint_(self, what, x):
        return jax.checkpoint(lambda v: self.write(what, v))(x)
"""


CUSTOM_DERIVATIVES = """
@jax.custom_jvp
def softplus(x):
    return jnp.log1p(jnp.exp(x))


@softplus.defjvp
def _softplus_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return softplus(x), jax.nn.sigmoid(x) * t


@jax.custom_vjp
def clip_grad(x):
    return x


def _clip_fwd(x):
    return x, None


def _clip_bwd(_, g):
    return (jnp.clip(g, -0.1, 0.1),)


clip_grad.defvjp(_clip_fwd, _clip_bwd)


@DECORATE
class Net:
    def __init__(self):
        self.w = jnp.array([1.0, -2.0, 0.5])
        self.mean = jnp.zeros(3)
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.calls += 1
        self.mean = 0.9 * self.mean + 0.1 * x
        h = softplus(x * self.w) + self.mean * x
        return jnp.sum(h * h)

    def clipped(self, x):
        self.calls += 1
        self.mean = 0.9 * self.mean + 0.1 * x
        return jnp.sum(clip_grad(self.mean * x) * self.w)

    def bump(self, x):
        self.mean = self.mean + x
        return x * 2

    def custom_vjp_writes(self, x):
        @jax.custom_vjp
        def g(v):
            return self.bump(v)
        def fwd(v):
            return self.bump(v), None
        def bwd(_, ct):
            return (ct,)
        g.defvjp(fwd, bwd)
        return g(x).sum() + self.mean.sum()  # READ

    def custom_jvp_writes(self, x):
        @jax.custom_jvp
        def g(v):
            return self.bump(v)
        @g.defjvp
        def g_jvp(p, t):
            return g(p[0]), t[0]
        return g(x).sum() + self.mean.sum()  # READ


@DECORATE
class Last:
    def __init__(self):
        self.last = jnp.zeros(3)
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.calls += 1
        self.last = x * 2
        return jnp.sum(x ** 2)


@DECORATE
class BN:
    def __init__(self, n, axis_name=None):
        self.axis_name = axis_name
        self.mean = jnp.zeros(n)
        self.var = jnp.ones(n)
        self.scale = jnp.ones(n) * 2

    def __call__(self, x):
        m, v = x, x * 0
        if self.axis_name is not None:
            m = jax.lax.pmean(x, self.axis_name)
            v = jax.lax.pmean((x - m) ** 2, self.axis_name)
        self.mean = 0.9 * self.mean + 0.1 * m
        self.var = 0.9 * self.var + 0.1 * v
        return (x - m) * self.scale
"""


REALISTIC_MODELS = """
@DECORATE
class SpectralLinear:
    def __init__(self, n, m, key):
        self.w = jax.random.normal(key, (n, m)) * 0.5
        self.u = jnp.ones(n) / jnp.sqrt(n)
        self.sigma = jnp.ones(())

    def __call__(self, x):
        w = jax.lax.stop_gradient(self.w)
        v = w.T @ self.u
        v = v / (jnp.linalg.norm(v) + 1e-12)
        u = w @ v
        self.u = u / (jnp.linalg.norm(u) + 1e-12)
        self.sigma = self.u @ self.w @ v
        return x @ (self.w / self.sigma)


@DECORATE
class Body:
    def __init__(self, key):
        self.w = jax.random.normal(key, (3, 3)) * 0.3
        self.seen = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.seen += 1
        return jnp.tanh(x @ self.w)


@DECORATE
class TeacherStudent:
    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.shared = Body(k1)
        self.student = [self.shared, Body(k2)]
        self.teacher_head = copy.deepcopy(self.student[1])
        self.decay = 0.5

    def __call__(self, x):
        h = x
        for layer in self.student:
            h = layer(h)
        t = self.teacher_head(self.shared(x))
        self.teacher_head.seen = self.teacher_head.seen * 0
        return jnp.sum((h - t) ** 2)


@DECORATE
class EMATeacher:
    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.shared = Body(k1)
        self.student = [self.shared, Body(k2)]
        self.teacher_w = self.student[1].w * 1.0
        self.decay = 0.5

    def __call__(self, x):
        h = x
        for layer in self.student:
            h = layer(h)
        t = jnp.tanh(self.shared(x) @ self.teacher_w)
        self.teacher_w = self.decay * self.teacher_w + (1 - self.decay) * self.student[1].w
        return jnp.sum((h - t) ** 2)


@DECORATE
class Opt:
    def __init__(self, params, lr):
        self.lr = lr
        self.m = jax.tree_util.tree_map(jnp.zeros_like, params)
        self.t = jnp.zeros((), jnp.int32)

    def update(self, grads, params):
        self.t += 1
        self.m = jax.tree_util.tree_map(lambda m, g: 0.9 * m + g, self.m, grads)
        return jax.tree_util.tree_map(lambda p, m: p - self.lr * m, params, self.m)


@DECORATE
class GAN:
    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        g = {"w": jax.random.normal(k1, (2, 3)) * 0.3}
        d = {"w": jax.random.normal(k2, (3,)) * 0.3}
        self.g_opt = Opt(g, 0.1)
        self.d_opt = Opt(d, 0.05)
        self.g_params = g
        self.d_params = d

    def step(self, z, real):
        def d_loss(dp):
            fake = jnp.tanh(z @ self.g_params["w"])
            return (jnp.mean(jax.nn.softplus(-(real @ dp["w"])))
                    + jnp.mean(jax.nn.softplus(fake @ dp["w"])))
        def g_loss(gp):
            fake = jnp.tanh(z @ gp["w"])
            return jnp.mean(jax.nn.softplus(-(fake @ self.d_params["w"])))
        ld, gd = jax.value_and_grad(d_loss)(self.d_params)
        self.d_params = self.d_opt.update(gd, self.d_params)
        lg, gg = jax.value_and_grad(g_loss)(self.g_params)
        self.g_params = self.g_opt.update(gg, self.g_params)
        return ld, lg


@DECORATE
class Accum:
    def __init__(self, every):
        self.every = every
        self.w = jnp.array([0.5, -0.5])
        self.buf = jnp.zeros(2)
        self.count = jnp.zeros((), jnp.int32)
        self.applied = jnp.zeros(2)

    def __call__(self, x):
        g = jax.grad(lambda w: jnp.sum((x * w) ** 2))(self.w + self.applied)
        self.buf = self.buf + g
        self.count += 1
        full = self.count % self.every == 0
        self.applied = jnp.where(full, self.applied - 0.1 * self.buf / self.every, self.applied)
        self.buf = jnp.where(full, jnp.zeros_like(self.buf), self.buf)
        return self.applied


@DECORATE
class Sched:
    def __init__(self, base, warmup):
        self.base = base
        self.warmup = warmup
        self.step = jnp.zeros((), jnp.int32)

    def __call__(self):
        self.step += 1
        return self.base * jnp.minimum(1.0, self.step / self.warmup)


@DECORATE
class WithSched:
    def __init__(self):
        self.sched = Sched(0.1, 3)
        self.wv = jnp.ones(2)

    def __call__(self, x):
        lr = self.sched()
        self.wv = self.wv - lr * 2 * x * self.wv
        return lr, self.wv


@DECORATE
class Attn:
    def __init__(self, d, length, key):
        k1, k2 = jax.random.split(key)
        self.wq = jax.random.normal(k1, (d, d)) * 0.3
        self.wkv = jax.random.normal(k2, (d, 2 * d)) * 0.3
        self.k = jnp.zeros((length, d))
        self.v = jnp.zeros((length, d))
        self.pos = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        q = x @ self.wq
        kv = x @ self.wkv
        d = x.shape[-1]
        self.k = self.k.at[self.pos].set(kv[:d])
        self.v = jax.lax.dynamic_update_slice(self.v, kv[d:][None], (self.pos, 0))
        mask = jnp.arange(self.k.shape[0]) <= self.pos
        p = jax.nn.softmax(jnp.where(mask, self.k @ q, -1e9))
        self.pos += 1
        return x + p @ self.v

    def decode(self, x, n):
        return lax.fori_loop(0, n, lambda i, h: self(h), x)

    def decode_scan(self, xs):
        return lax.scan(lambda c, x: (c, self(x)), 0.0, xs)[1]
"""


Z = jnp.ones((4, 2)) * 0.5


REAL_ONES = jnp.ones((4, 3))


# A stack of members (``jax.vmap(Member)(keys)``) handed to jax.vmap, lax.scan
# and lax.map in methods, and ``ListEnsemble``, its plain reference: the same
# members built one by one in a list, run by Python loops.
STACKED_MEMBERS = """
@DECORATE
class Member:
    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.w = jax.random.normal(k1, (3,))
        self.mean = jnp.zeros(())
        self.calls = jnp.zeros((), jnp.int32)
        self.key = k2

    def __call__(self, x):
        self.key, sub = jax.random.split(self.key)
        keep = jax.random.bernoulli(sub, 0.7, jnp.shape(x)[:-1])  # each member its own mask
        y = (x @ self.w) * keep
        self.mean = 0.9 * self.mean + 0.1 * y.mean()
        self.calls += 1
        return y + 0.0 * self.calls  # (a state read after the member wrote it)


def member_keys(n):
    return jax.random.split(jax.random.key(0), n)


@DECORATE
class Ensemble:
    def __init__(self, n):
        self.members = jax.vmap(Member)(member_keys(n))
        self.shared = jnp.zeros(())
        self.steps = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.steps += 1
        return jax.vmap(lambda m: m(x))(self.members)

    def per_member(self, xs):
        return jax.vmap(lambda m, x: m(x))(self.members, xs)

    def member_axis_1(self, xs):
        return jax.vmap(lambda x, m: m(x), in_axes=(1, 0))(xs, self.members)

    def scanned(self, h):
        return lax.scan(lambda h, m: (jnp.tanh(m(h) + h), None), h, self.members)[0]

    def mapped(self, x):
        return lax.map(lambda m: m(x), self.members)

    def decode(self, h):
        return lax.fori_loop(0, 2, lambda i, h: self.scanned(h), h)

    def jit_of_vmap(self, xs):
        return jax.jit(jax.vmap(lambda m, x: m(x)))(self.members, xs)

    def remat_scanned(self, h):
        body = jax.checkpoint(lambda h, m: (jnp.tanh(m(h) + h), None))
        return lax.scan(body, h, self.members)[0]

    def vmap_of_scan(self, xs):
        def run(m, seq):
            return lax.scan(lambda c, x: (c + m(x).sum(), None), jnp.zeros(()), seq)[0]
        return jax.vmap(run)(self.members, xs)

    def reduced(self, xs):
        def one(x):
            self.shared = lax.pmean(x.mean(), "batch")
            return 2 * x
        return jax.vmap(one, axis_name="batch")(xs)

    def per_example(self, xs):
        def one(x):
            self.shared = x.mean()
            return 2 * x
        return jax.vmap(one)(xs)  # per-example write

    def per_example_steps(self, xs):
        def one(x):
            self.shared = jnp.zeros(())  # the same for every example
            self.steps = self.steps + (x.sum() > 0)
            return 2 * x
        return jax.vmap(one)(xs)  # per-example steps

    def unstacked(self, xs):
        one = Member(jax.random.key(1))
        return jax.vmap(lambda m, x: m(x))(one, xs)  # unstacked member

    def stack_read(self, xs):
        def one(m, x):
            return m(x) + self.members.mean.sum()  # the stack read inside
        return jax.vmap(one)(self.members, xs)

    def twice(self, xs):  # the stack passed twice: each member called twice
        return jax.vmap(lambda a, b, x: b(x + a(x)[..., None]))(self.members, self.members, xs)

    def local_stack(self, xs):  # a stack built in the method (under jit: in its trace)
        local = jax.vmap(Member)(member_keys(3))
        return jax.vmap(lambda m, x: m(x))(local, xs) + local.calls[:, None]

    def boom(self, xs):
        def one(m, x):
            m(x)
            raise RuntimeError("a member failed")
        return jax.vmap(one)(self.members, xs)

    def scanned_twice(self, h):
        def step(h, ab):
            return jnp.tanh(h + ab[1](h + ab[0](h))), None
        return lax.scan(step, h, (self.members, self.members))[0]


class ListEnsemble:
    def __init__(self, n):
        self.members = [Member(k) for k in member_keys(n)]
        self.shared = jnp.zeros(())
        self.steps = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.steps += 1
        return jnp.stack([m(x) for m in self.members])

    def per_member(self, xs):
        return jnp.stack([m(x) for m, x in zip(self.members, xs)])

    def member_axis_1(self, xs):
        return jnp.stack([m(xs[:, i]) for i, m in enumerate(self.members)])

    def scanned(self, h):
        for m in self.members:
            h = jnp.tanh(m(h) + h)
        return h

    def mapped(self, x):
        return jnp.stack([m(x) for m in self.members])

    def decode(self, h):
        for _ in range(2):
            h = self.scanned(h)
        return h

    jit_of_vmap = per_member
    remat_scanned = scanned

    def vmap_of_scan(self, xs):
        outs = []
        for m, seq in zip(self.members, xs):
            c = jnp.zeros(())
            for x in seq:
                c = c + m(x).sum()
            outs.append(c)
        return jnp.stack(outs)

    def reduced(self, xs):
        outs = []
        for x in xs:
            self.shared = jnp.mean(jnp.stack([e.mean() for e in xs]))
            outs.append(2 * x)
        return jnp.stack(outs)

    def twice(self, xs):
        return jnp.stack([m(x + m(x)[..., None]) for m, x in zip(self.members, xs)])

    def local_stack(self, xs):
        local = [Member(k) for k in member_keys(3)]
        out = jnp.stack([m(x) for m, x in zip(local, xs)])
        return out + jnp.stack([m.calls for m in local])[:, None]

    def scanned_twice(self, h):
        for m in self.members:
            h = jnp.tanh(h + m(h + m(h)))
        return h
"""


# A stack of layers (``autostate.stack``) iterated by Python loops (and scanned
# over: each step one layer): each layer a view reading and writing its slice
# of the stacked states. The plain reference is the same source with
# ``autostate.stack(`` read as ``list(`` (the layers built one by one in a
# list) and the scan as the loop over them.
STACK_LOOP = """
@DECORATE
class Block:
    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.w = jax.random.normal(k1, (3,))
        self.mean = jnp.zeros(3)
        self.calls = jnp.zeros((), jnp.int32)
        self.key = k2
        self.cache = {"last": jnp.zeros(3)}
        self.act = "tanh"

    def __call__(self, x):
        self.key, sub = jax.random.split(self.key)
        keep = jax.random.bernoulli(sub, 0.8, jnp.shape(x))  # each layer its own mask
        self.mean = 0.9 * self.mean + 0.1 * x
        self.calls += 1
        self.cache["last"] = x
        y = jnp.tanh(x * self.w) * keep + self.mean
        return lax.cond(y.sum() > 0, lambda: y, lambda: -y)

    def bump(self, by):
        self.calls += by
        return self.calls


def block_keys(n):
    return jax.random.split(jax.random.key(0), n)


def scale_layers(blocks, by):  # a helper outside any class
    for block in blocks:
        block.mean = block.mean * by
        block.calls += 1


@DECORATE
class Net:
    def __init__(self, n):
        self.blocks = autostate.stack([Block(k) for k in block_keys(n)])
        self.steps = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.steps += 1
        for block in self.blocks:
            x = block(x)
        return x

    def counted(self, x):
        outs = []
        for i, block in enumerate(self.blocks):
            outs.append(block(x * (i + 1)))
        return jnp.stack(outs) + len(self.blocks)

    def zipped(self, xs):
        return jnp.stack([block(x) for block, x in zip(self.blocks, xs)])

    def backwards(self, x):
        for block in reversed(self.blocks):
            x = block(x)
        return x

    def indexed(self, x):
        return self.blocks[-1](self.blocks[0](x)) + self.blocks[1].bump(2)

    def sliced(self, x):
        for block in self.blocks[1:]:
            x = block(x)
        return x

    def written(self, x):
        for block in self.blocks:
            block.mean = block.mean + x  # a layer's state assigned from outside its class
            block.cache = {"last": block.cache["last"] - x}
        scale_layers(self.blocks, 0.5)
        return self.blocks[0].mean.sum() + self.blocks[2].calls

    def repeated(self, x):
        return lax.fori_loop(0, 2, lambda i, x: self(x), x)

    def scanned(self, x):
        return lax.scan(lambda x, block: (block(x), None), x, self.blocks)[0]

    def taken(self, x):
        layers = list(self.blocks)  # layers kept, then used
        first = layers[0]
        for block in layers:
            x = block(x)
        return x + first.mean
"""


STACK_ROLL = """
@DECORATE
class Block:
    def __init__(self, key):
        self.w = jax.random.normal(key, (3,))
        self.mean = jnp.zeros(3)
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.calls += 1
        self.mean = 0.9 * self.mean + 0.1 * x
        return jnp.tanh(x * self.w) + self.mean


def block_keys(n):
    return jax.random.split(jax.random.key(1), n)


def remember(log, x):  # a helper outside any class, changing a list in place
    log.append(x)


@DECORATE
class Net:
    def __init__(self, n):
        self.blocks = autostate.stack([Block(k) for k in block_keys(n)])
        self.scales = [jnp.full(3, 1.0 + i) for i in range(n)]
        self.gates = autostate.stack([Block(k) for k in block_keys(n + 1)[1:]])
        self.steps = jnp.zeros((), jnp.int32)
        self.mode = "sum"

    # Rolled under a trace: one lax.scan.
    def carried(self, x):
        aux, count, mode = 0.0, 0, self.mode
        for block in self.blocks:
            x = block(x)
            aux = aux + x.sum()  # a Python float, an array from the first step on
            count = count + x.mean()  # a Python int, a float array from the first step on
            h = x * 2  # read after the loop only
            mode = self.mode  # a string, the same at every step
        return (x + aux + count + h.sum() + block.w) * len(mode)  # (block: the last layer)

    def enumerated(self, x):
        small = jnp.zeros(3, jnp.int8)
        for i, block in enumerate(self.blocks, 1):
            x = block(x) * i
            small = small + jnp.ones(3, jnp.int8) * i  # (an int8 array times an int: int8)
        return x, small

    def zipped(self, x):
        for block, scale in zip(self.blocks, self.scales):
            x = block(x * scale)
        return x

    def two_stacks(self, x):
        for block, gate in zip(self.blocks, self.gates):  # two stacks, one step each
            x = block(x) * jax.nn.sigmoid(gate(x))
        return x

    def typed(self, x, type="tanh"):  # a local named as a builtin the rolled form needs not
        for block in self.blocks:
            x = block(x)
        return x if type == "tanh" else -x

    def threaded(self, x):
        for block in self.blocks:
            self.steps += 1  # a state of the model, threaded through the loop
            x = block(x) + self.steps
        return x

    def nested(self, x):
        for block in self.blocks:
            for _ in range(2):
                x = block(x)
        return x

    def checkpointed(self, x):
        for block in self.blocks:
            x = jax.checkpoint(block, policy=jax.checkpoint_policies.nothing_saveable)(x)
        return x

    def assigned_first(self, x):
        h = None
        for block in self.blocks:
            h = block(x)  # assigned before the body reads it: not carried
            x = x + h
        h += 1  # (read after the loop by an augmented assignment)
        return x + h

    def backwards(self, x):
        for block in reversed(self.blocks):
            x = block(x)
        else:
            x = x + 1
        return x

    # Not rolled: they run layer by layer, as written.
    def first_differs(self, x):
        for i, block in enumerate(self.blocks):
            if i == 0:  # Python branching on the layer index
                x = x * 2
            x = block(x)
        return x

    def early(self, x):
        for block in self.blocks:
            x = block(x)
            if x.ndim == 1:
                return x * 3
        return x

    def stops(self, x):
        for block in self.blocks:
            x = block(x)
            if x.ndim > 1:
                break
        return x

    def counted(self, x):
        n = 0
        for block in self.blocks:
            x = block(x)
            n += 1  # a Python int that changes at every step
        return jnp.tile(x, n)

    def remembered(self, x):
        log = []
        for block in self.blocks:
            x = block(x)
            remember(log, x)
        return x + len(log)

    def previous(self, x):
        last = self.blocks[0]
        for block in self.blocks:
            x = block(x) + last.w  # a layer carried from one step to the next
            last = block
        return x + last.w
"""

STACK_ROLL_STRICT = """
@DECORATE
class Block:
    def __init__(self, w):
        self.w = w
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.calls += 1
        return jnp.tanh(x * self.w)


@DECORATE
class Net:
    def __init__(self):
        self.blocks = autostate.stack([Block(jnp.full(3, i + 1.0)) for i in range(3)], require_scan=True)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x

    def first_differs(self, x):
        for i, block in enumerate(self.blocks):
            if i == 0:
                x = x * 2
            x = block(x)
        return x

    def stops(self, x):
        for block in self.blocks:
            x = block(x)
            if x.ndim > 1:
                break
        return x
"""
