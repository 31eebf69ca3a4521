"""Example models for the end-to-end tests, written as a user would write them.

They live in a real module because ``@stateful`` reads class source from
files. Each model mutates ``self`` in plain Python; the tests run them
eagerly, functionalized under ``jax.jit``, frozen and functionalized again.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import autostate


@autostate.stateful
class Counter:
    """Counts its calls; scales its input by the count."""

    def __init__(self):
        self.count = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.count += 1
        return x * self.count


@autostate.stateful
class BatchNorm:
    """Batch normalization with running statistics and a train/eval flag."""

    def __init__(self, n, momentum=0.9, eps=1e-5):
        self.scale = jnp.ones(n)
        self.bias = jnp.zeros(n)
        self.mean = jnp.zeros(n)
        self.var = jnp.ones(n)
        self.momentum = momentum
        self.eps = eps
        self.training = True

    def __call__(self, x, *, train=None):
        train = self.training if train is None else train
        if train:
            m, v = x.mean(0), x.var(0)
            self.mean = self.momentum * self.mean + (1 - self.momentum) * m
            self.var = self.momentum * self.var + (1 - self.momentum) * v
        else:
            m, v = self.mean, self.var
        return (x - m) / jnp.sqrt(v + self.eps) * self.scale + self.bias


@autostate.stateful
class Linear:
    """A dense layer: parameters only, no state."""

    def __init__(self, key, n_in, n_out):
        self.w = jax.random.normal(key, (n_in, n_out)) / n_in**0.5
        self.b = jnp.zeros(n_out)

    def __call__(self, x):
        return x @ self.w + self.b


@autostate.stateful
class Block:
    """``Linear -> BatchNorm -> relu``."""

    def __init__(self, key, n_in, n_out):
        self.linear = Linear(key, n_in, n_out)
        self.bn = BatchNorm(n_out)

    def __call__(self, x, *, train=None):
        return jax.nn.relu(self.bn(self.linear(x), train=train))


@autostate.stateful
class MLP:
    """Blocks held in a list; each block's BatchNorm keeps running statistics."""

    def __init__(self, key, sizes):
        keys = jax.random.split(key, len(sizes) - 1)
        self.blocks = [Block(k, a, b) for k, a, b in zip(keys, sizes[:-1], sizes[1:])]

    def __call__(self, x, *, train=None):
        for block in self.blocks:
            x = block(x, train=train)
        return x


@autostate.stateful
class StackedMLP:
    """Equal blocks held as one stack (``autostate.stack``), run by a Python loop."""

    def __init__(self, key, width, depth, stacked=True):
        blocks = [Block(k, width, width) for k in jax.random.split(key, depth)]
        self.blocks = autostate.stack(blocks) if stacked else blocks
        self.steps = jnp.zeros((), jnp.int32)

    def __call__(self, x, *, train=None):
        self.steps += 1
        for block in self.blocks:
            x = x + block(x, train=train)
        return x


def set_training(model, flag):
    """A helper outside the class that flips every BatchNorm's (static) flag."""
    for block in model.blocks:
        block.bn.training = flag


@autostate.stateful
class Decoder:
    """Single-head attention decoding one token per call, with a KV cache."""

    def __init__(self, key, d, max_len, batch=1):
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.wq = jax.random.normal(kq, (d, d)) / d**0.5
        self.wk = jax.random.normal(kk, (d, d)) / d**0.5
        self.wv = jax.random.normal(kv, (d, d)) / d**0.5
        self.wo = jax.random.normal(ko, (d, d)) / d**0.5
        self.k_cache = jnp.zeros((batch, max_len, d))
        self.v_cache = jnp.zeros((batch, max_len, d))
        self.pos = jnp.zeros((), jnp.int32)
        self.max_len = max_len

    def __call__(self, x):
        q, k, v = x @ self.wq, x @ self.wk, x @ self.wv
        self.k_cache[:, self.pos] = k
        self.v_cache[:, self.pos] = v
        self.pos += 1
        scores = jnp.einsum("bd,btd->bt", q, self.k_cache) / q.shape[-1] ** 0.5
        visible = jnp.arange(self.max_len) < self.pos
        scores = jnp.where(visible, scores, -jnp.inf)
        attended = jnp.einsum("bt,btd->bd", jax.nn.softmax(scores, axis=-1), self.v_cache)
        return attended @ self.wo

    def reset(self):
        self.k_cache = jnp.zeros_like(self.k_cache)
        self.v_cache = jnp.zeros_like(self.v_cache)
        self.pos = jnp.zeros((), jnp.int32)


@autostate.stateful
class RNNCell:
    """An Elman cell carrying its hidden state between calls."""

    def __init__(self, key, n_in, n_hidden):
        k1, k2 = jax.random.split(key)
        self.w_in = jax.random.normal(k1, (n_in, n_hidden)) / n_in**0.5
        self.w_h = jax.random.normal(k2, (n_hidden, n_hidden)) / n_hidden**0.5
        self.h = jnp.zeros(n_hidden)

    def __call__(self, x):
        self.h = jnp.tanh(x @ self.w_in + self.h @ self.w_h)
        return self.h

    def reset(self, h=None):
        self.h = jnp.zeros_like(self.h) if h is None else h
        return self.h


@autostate.stateful
class Dropout:
    """Carries its own PRNG key and splits it on every call."""

    def __init__(self, key, rate=0.5):
        self.key = key
        self.rate = rate

    def __call__(self, x):
        self.key, sub = jax.random.split(self.key)
        keep = jax.random.bernoulli(sub, 1 - self.rate, x.shape)
        return jnp.where(keep, x / (1 - self.rate), 0.0)


@autostate.stateful
class EMA:
    """Exponential moving average of a parameter dict, with bias correction."""

    def __init__(self, params, decay=0.9):
        self.decay = decay
        self.shadow = jax.tree_util.tree_map(jnp.zeros_like, params)
        self.updates = jnp.zeros((), jnp.int32)

    def __call__(self, params):
        self.shadow = jax.tree_util.tree_map(
            lambda s, p: self.decay * s + (1 - self.decay) * p, self.shadow, params
        )
        self.updates += 1
        return self.debiased()

    def debiased(self):
        correction = 1 - self.decay**self.updates
        return jax.tree_util.tree_map(lambda s: s / correction, self.shadow)


# --- models for functionalize/freeze and composition tests -------------------


@autostate.stateful(category="stats")
class Tracker:
    """States in two categories: its class's ("stats") and an explicit one ("cache")."""

    def __init__(self, n):
        self.calls = jnp.zeros((), jnp.int32)
        self.total = autostate.state(jnp.zeros(n), category="cache")

    def __call__(self, x):
        self.calls += 1
        self.total = self.total + x
        return self.total / self.calls


@autostate.stateful
class Heads:
    """Sub-models in a dict, a tuple, an attribute and a list."""

    def __init__(self):
        self.heads = {"a": Counter(), "b": Counter()}
        self.pair = (Counter(), RNNCell(jax.random.PRNGKey(7), 2, 3))
        self.single = Counter()
        self.stack = [[Counter()], {"inner": Counter()}]

    def __call__(self, x):
        out = self.heads["a"](x) + self.heads["b"](2 * x)
        out = out + self.pair[0](x) + self.single(x)
        h = self.pair[1](jnp.full(2, x))
        out = out + self.stack[0][0](x) + self.stack[1]["inner"](x)
        return out, h


@autostate.stateful
class Stage:
    """Holds a (possibly shared) counter and a (possibly tied) embedding."""

    def __init__(self, counter, embed):
        self.counter = counter
        self.embed = embed

    def __call__(self, x):
        self.counter(1)
        return self.embed(x)


@autostate.stateful
class Embedding:
    """A weight matrix and a usage counter (state)."""

    def __init__(self, key, n, d):
        self.table = jax.random.normal(key, (n, d))
        self.uses = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.uses += 1
        return x @ self.table


@autostate.stateful
class SharedModel:
    """One counter and one embedding reachable from several paths."""

    def __init__(self, key, n=3):
        counter = Counter()
        embed = Embedding(key, n, n)
        self.encoder = Stage(counter, embed)
        self.decoder = Stage(counter, embed)
        self.steps = counter

    def __call__(self, x):
        y = self.decoder(self.encoder(x))
        self.steps.count += 10
        return y, self.encoder.counter.count, self.decoder.embed.uses

    def bump(self, by=1):
        bump_counter(self.decoder.counter, by)
        return self.encoder.counter.count


def bump_counter(counter, by=1):
    """A helper outside any class: reads, assigns and ``+=``s a model's state."""
    before = counter.count
    counter.count += by
    counter.count = counter.count * 2
    return before


@autostate.stateful
class UsesHelper:
    """Calls a helper outside the class with ``self`` and with a sub-model."""

    def __init__(self):
        self.inner = Counter()
        # Only the helper assigns it, so no method shows it is state: declare it.
        self.count = autostate.state(jnp.zeros((), jnp.int32))
        self.log = jnp.zeros(())

    def __call__(self, x):
        before_inner = bump_counter(self.inner, 3)
        before_self = bump_counter(self, 1)
        self.log += x * self.inner.count
        return before_inner + before_self + self.count


@autostate.stateful
class Codebook:
    """A weight that is state (updated in place), reachable from two paths."""

    def __init__(self, key, n, d, decay=0.5):
        self.codes = jax.random.normal(key, (n, d))
        self.decay = decay

    def __call__(self, x):
        nearest = jnp.argmin(((x[:, None] - self.codes[None]) ** 2).sum(-1), axis=1)
        hits = jax.nn.one_hot(nearest, self.codes.shape[0])
        counts = hits.sum(0)[:, None]
        means = (hits.T @ x) / jnp.maximum(counts, 1.0)
        self.codes = jnp.where(counts > 0, self.decay * self.codes + (1 - self.decay) * means, self.codes)
        return self.codes[nearest]


@autostate.stateful
class TiedQuantizer:
    """Two stages sharing one codebook (tied weights that are also state)."""

    def __init__(self, key):
        book = Codebook(key, 4, 2)
        self.first = book
        self.second = {"book": book}

    def __call__(self, x):
        y = self.first(x)
        return self.second["book"](y + 0.1), self.first.codes
