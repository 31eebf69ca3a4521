"""The programs the static state cases run (``test_static_state.py``): class
sources run plain and decorated, and their expected values. Other concept
files import some of them too.
"""

from __future__ import annotations

from semantics.programs_methods import FORWARD_HOOKS

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


ONE_SHOT = (
    FORWARD_HOOKS
    + """

def one_shot(m, y):
    m.n = m.n + 100
    m.hooks.remove(one_shot)
    return None
"""
)


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
