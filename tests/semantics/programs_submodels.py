"""The programs the submodels cases run (``test_submodels.py``): class
sources run plain and decorated, and their expected values. Other concept
files import some of them too.
"""

from __future__ import annotations

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
