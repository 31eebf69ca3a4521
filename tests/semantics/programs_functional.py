"""The programs the functional cases run (``test_functional.py``): class
sources run plain and decorated, and their expected values. Other concept
files import some of them too.
"""

from __future__ import annotations

from semantics.programs_shared import CONST_DEF, LIBRARY

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
