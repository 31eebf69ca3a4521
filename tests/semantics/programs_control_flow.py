"""The programs the control flow cases run (``test_control_flow.py``): class
sources run plain and decorated, and their expected values. Other concept
files import some of them too.
"""

from __future__ import annotations

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


class Interrupt(Exception):
    pass


class Tally:  # a plain object, no model
    def __init__(self):
        self.total = jnp.zeros(3)
        self.seen = []

    def push(self, v):
        self.seen.append(v)


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

    def observed_after(self, x):
        total = lambda: x.sum()  # made before the loop, reading x; called after it only
        for block in self.blocks:
            x = block(x)
        return x * total()

    def consumed_first(self, x):
        size = sum(block.w.sum() for block in self.blocks)  # read at once, before the loop
        for block in self.blocks:
            x = block(x) * size
        return x

    # Not rolled: they run layer by layer, as written.
    def called_in_body(self, x):
        peek = lambda: x.sum()  # reads x, which the loop assigns
        for block in self.blocks:
            x = block(x) + peek()  # called in the body: each step's x
        return x

    def grown(self, x):
        for block in self.blocks:
            x = jnp.concatenate([block(x[:3]), x[:1]])  # a carried local that changes shape
        return x

    def keyed(self, x):
        weights = {0: 1.0, 1: 0.5, 2: 2.0}
        for i, block in enumerate(self.blocks):
            x = block(x) * weights[i]  # a dict looked up by the layer index
        return x

    def failing(self, x):
        for block in self.blocks:
            x = block(x).reshape(4)  # an error of the body's own
        return x

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

    def summed_in_place(self, x):
        total = [jnp.zeros(3)]
        def add(v):  # a nested helper reading back what it appended
            total.append(total[-1] + v)
        for block in self.blocks:
            x = block(x)
            add(x)
        return x + total[-1]

    def summed_nonlocal(self, x):
        total = jnp.zeros(3)
        def add(v):  # a nested helper rebinding a local of the method
            nonlocal total
            total = total + v
        for block in self.blocks:
            x = block(x)
            add(x)
        return x + total

    def lazily_read(self, x):
        scaled = (x * k for k in range(1, 9))  # reads x when next() asks, each step's x
        for block in self.blocks:
            x = block(x) + next(scaled)
        return x

    def generated(self, x):
        def scaled():  # a generator function: its generator reads x at each next()
            k = 1
            while True:
                yield x * k
                k += 1
        it = scaled()
        for block in self.blocks:
            x = block(x) + next(it)
        return x

    def local_class(self, x):
        class Probe:  # its method reads x when called: each step's x
            def total(self):
                return x.sum()
        probe = Probe()
        for block in self.blocks:
            x = block(x) + probe.total()
        return x

    def pushed(self, x):
        log = Tally()
        for block in self.blocks:
            x = block(x)
            log.push(x)  # a plain object's method changing its list
        return x + sum(log.seen)

    def interrupted(self, x):
        try:
            for block in self.blocks:
                x = block(x)  # the first layer runs, and its write lands
                if x.ndim == 1:
                    raise Interrupt()  # the body's own error, caught around the loop
        except Interrupt:
            pass
        return x

    def summed_on_object(self, x):
        box = Tally()
        def add(v):  # a nested helper assigning a plain object's attribute
            box.total = box.total + v
        for block in self.blocks:
            x = block(x)
            add(x)
        return x + box.total

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
