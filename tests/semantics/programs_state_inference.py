"""The programs the state inference cases run (``test_state_inference.py``): class
sources run plain and decorated, and their expected values. Other concept
files import some of them too.
"""

from __future__ import annotations

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
