"""The programs the transformations cases run (``test_transformations.py``): class
sources run plain and decorated, and their expected values. Other concept
files import some of them too.
"""

from __future__ import annotations

import jax.numpy as jnp

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


TRANSITIONS = [
    (jnp.array([0.1, 0.2]), jnp.int32(0), jnp.float32(1.0), jnp.array([0.3, 0.1])),
    (jnp.array([0.3, 0.1]), jnp.int32(2), jnp.float32(-1.0), jnp.array([0.0, 0.5])),
    (jnp.array([0.0, 0.5]), jnp.int32(1), jnp.float32(0.5), jnp.array([0.2, -0.2])),
]


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
