"""The programs the containers cases run (``test_containers.py``): class
sources run plain and decorated, and their expected values. Other concept
files import some of them too.
"""

from __future__ import annotations

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
