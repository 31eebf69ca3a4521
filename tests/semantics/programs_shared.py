"""What the programs of several concepts share: the inputs they are called
with, the library the harness builds models from, and the types of the
small helpers the cases drive them with.
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


XB = jnp.arange(12.0).reshape(4, 3)


XS = jnp.arange(1.0, 5.0)


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


XS_PAIRS = jnp.array([[1.0, 2.0], [3.0, -1.0], [0.5, 0.25]])


CONST_DEF = """
CONST = autostate.constant if STATE is autostate.state else (lambda v, **kw: v)
"""


PACK_XS = [jnp.ones(3), jnp.arange(3.0), -jnp.ones(3)]


TWO = jnp.float32(2.0)


POSITIVE_CALLS = [("__call__", (X1,)), ("__call__", (TWO,))]


XS3 = jnp.arange(1.0, 4.0)


Phase = tuple[str, list[tuple[str, tuple[Any, ...]]]]


N_BLOCKS = 2


PROMPT = jnp.array([3, 4, 5], jnp.int32)


ADAM = optax.adam(3e-2)


V3 = jnp.array([0.5, 1.0, -1.0])


STACK = jnp.stack([V3, V3 * 2])


TIMEOUT = 20.0


V2 = jnp.array([1.0, 2.0])


B3 = jnp.array([[1.0, 2.0], [3.0, -1.0], [0.5, 0.5]])


ONE = jnp.ones(2)


py312 = pytest.mark.skipif(sys.version_info < (3, 12), reason="Python 3.12 syntax")


py313 = pytest.mark.skipif(sys.version_info < (3, 13), reason="Python 3.13 semantics")


REAL = jnp.array([[1.0, 0.5, -0.5], [0.8, 0.4, -0.2]])


XM = jnp.array([[0.5, -1.0, 0.2], [1.0, 0.3, -0.4], [-0.2, 0.1, 0.9], [0.0, 0.7, -0.7]])


TRAIN_XS = jnp.arange(18.0).reshape(3, 2, 3) / 10.0


YS = jnp.sin(jnp.arange(12.0)).reshape(3, 2, 2)


XB_VMAP = jnp.array([[0.1, 0.2], [0.3, -0.4], [1.0, 0.5]])


A1 = jnp.asarray(1.0)


A2 = jnp.asarray(2.0)


V2_RANGE = jnp.arange(2.0)


XA = jnp.array([[1.0, 2.0, 0.0], [3.0, -2.0, 1.0], [2.0, 0.0, 5.0], [0.5, 1.0, -1.0]])


XS_SEQ = jnp.array([[0.5, -1.0], [1.0, 0.3], [-0.2, 0.8], [0.0, 1.5], [0.7, -0.4], [1.1, 0.2]])


XK = jnp.array([[0.5, -1.0, 0.2], [1.0, 0.3, -0.4], [-0.2, 0.8, 0.1]])


XO = jnp.array([[0.5, -1.0], [1.0, 0.3], [-0.2, 0.8]])


YO = jnp.array([1.0, -0.5, 0.25])


XR = jnp.array([[0.5, -1.0, 0.2, 1.0], [1.0, 0.3, -0.4, 2.0]])


XO2 = jnp.stack([XO, XO * 2, -XO])


YO2 = jnp.stack([YO, YO, YO * 2])


XV1 = jnp.array([0.3, -0.7])


XV2 = jnp.array([1.1, 0.4])


Y = jnp.array([0.5, -0.5])


_COUNTER = itertools.count()


V3_RANGE = jnp.arange(3.0)


XS_SIGNED = jnp.array([0.5, -1.0, 2.0, 1.5])


X1_WEAK = jnp.asarray(1.5)


XQ = jnp.array([[1.0, 2.0, 0.0], [3.0, -2.0, 1.0], [2.0, 0.5, 5.0], [0.5, 1.0, -1.0]])


XL = jnp.array([[1.0, -0.5, 0.25], [0.5, 2.0, -1.0]])


X_VRNN = jnp.arange(12.0).reshape(4, 3) / 7.0 - 0.5


XM_ROUTED = jnp.array(
    [[1.0, 0.0, -1.0], [0.5, 2.0, 0.1], [-1.0, 1.0, 0.3], [0.2, -0.4, 1.5], [1.2, 0.3, 0.3]]
)


XP = jnp.array([[1.0, 0.0, -1.0], [0.5, 2.0, 0.1], [-1.0, 1.0, 0.3]])


X23 = jnp.arange(6.0).reshape(2, 3) / 6.0


X23_STACK = jnp.stack([X23, -2.0 * X23, X23 + 0.5])


V2_SIGNED = jnp.array([1.0, -2.0])


X2_WEAK = jnp.asarray(-0.5)


V3_STACK = jnp.stack([V3, V3 * 2, -V3])


X_BATCH = jnp.array([[1.0, 2.0, 0.5], [0.0, -1.0, 2.0], [1.5, 0.5, -0.5], [-1.0, 1.0, 1.0]])


Y_BATCH = jnp.array([[0.5, -0.5], [1.0, 0.0], [-0.5, 0.5], [0.0, 1.0]])


TORCH_HEADER = "import collections\nimport functools\n"


YL = X_BATCH.sum(-1)


LIT_STEPS = [("fit_step", (X_BATCH * (1 + 0.5 * i), YL)) for i in range(3)]


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


X3 = jnp.arange(6.0).reshape(2, 3) / 6


Z = jnp.ones((4, 2)) * 0.5


REAL_ONES = jnp.ones((4, 3))
