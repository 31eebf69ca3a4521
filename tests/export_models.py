"""Models and helpers shared by the tests of state_dicts, checkpoint, export and render."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import autostate


@autostate.stateful
class Norm:
    def __init__(self, n):
        self.scale = jnp.linspace(0.5, 1.5, n)
        self.mean = jnp.zeros(n)
        self.var = jnp.ones(n)

    def __call__(self, x):
        m, v = x.mean(0), x.var(0)
        self.mean = 0.9 * self.mean + 0.1 * m
        self.var = 0.9 * self.var + 0.1 * v
        return (x - m) / jnp.sqrt(v + 1e-5) * self.scale


@autostate.stateful
class Block:
    def __init__(self, n, seed):
        self.w = jax.random.normal(jax.random.key(seed), (n, n)) / n
        self.b = jnp.full((n,), 0.1 * seed)
        self.norm = Norm(n)
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.calls += 1
        return self.norm(jnp.tanh(x @ self.w + self.b))


@autostate.stateful
class Net:
    def __init__(self, n=3, seed=0):
        self.blocks = [Block(n, seed + 1), Block(n, seed + 2)]
        self.first = self.blocks[0]  # one sub-model, two paths
        self.kv = autostate.state(
            {"k": jnp.zeros(n), "t": jnp.zeros((), jnp.int32)}, category="cache", name="cache"
        )
        self.ema = jnp.zeros(n, jnp.bfloat16)
        self.half = jnp.full((n,), 0.5 + seed, jnp.bfloat16)
        self.table = {"ids": jnp.arange(n, dtype=jnp.int32) + seed}
        self.gain = jnp.asarray(2.0 + seed)
        self.act = "tanh"

    def __call__(self, x):
        h = self.blocks[1](self.first(x)) * self.gain
        self.ema = (0.5 * self.ema + 0.5 * h.mean(0)).astype(jnp.bfloat16)
        self.kv = {"k": self.kv["k"] + h.sum(0), "t": self.kv["t"] + 1}
        return h + self.half.astype(h.dtype) + self.table["ids"]

    def peek(self, x):
        self.kv = {"k": self.kv["k"] * 0.5, "t": self.kv["t"]}
        return x + self.kv["k"]


@autostate.stateful
class Pairs:
    def __init__(self):
        self.pair = (jnp.zeros(2), {"a": jnp.ones(1, jnp.int32)})
        self.log = autostate.state({})

    def __call__(self, x):
        self.pair = (self.pair[0] + x, {"a": self.pair[1]["a"] * 2})
        return x


@autostate.stateful
class Counter:
    def __init__(self):
        self.count = jnp.zeros((), jnp.int32)

    def __call__(self):
        self.count += 1


@autostate.stateful
class Labelled:
    def __init__(self):
        self.count = jnp.zeros(())

    def __repr__(self):
        return "Labelled!"

    def __call__(self):
        self.count += 1


@autostate.stateful
class LabelledChild(Labelled):
    def __call__(self):
        self.count += 2


@autostate.stateful(fallback="host")
class HostCounter:
    def __init__(self):
        self.w = jnp.ones(2)
        self.count = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        def body(i, carry):
            self.count += 1
            return carry

        jax.lax.fori_loop(0, 3, body, 0)
        return x * self.w


STATE_KEYS = [
    "blocks[0].norm.mean",
    "blocks[0].norm.var",
    "blocks[0].calls",
    "blocks[1].norm.mean",
    "blocks[1].norm.var",
    "blocks[1].calls",
    "cache['k']",
    "cache['t']",
    "ema",
    "table['ids']",  # an int array: a constant, in the states (never trained)
]
PARAM_KEYS = [
    "blocks[0].w",
    "blocks[0].b",
    "blocks[0].norm.scale",
    "blocks[1].w",
    "blocks[1].b",
    "blocks[1].norm.scale",
    "half",
    "gain",
]


def batches(count, n=3):
    keys = jax.random.split(jax.random.key(42), count)
    return [jax.random.normal(k, (4, n)) for k in keys]


XS = batches(5)


def run(model, xs, method="__call__"):
    """Steps the model functionally under jit; returns (outputs, frozen model)."""
    f, states = model.functionalize()
    step = jax.jit(lambda f, s, x: getattr(f, method)(s, x))
    outs = []
    for x in xs:
        out, states = step(f, states, x)
        outs.append(out)
    return outs, autostate.freeze(f, states)


def bits(a):
    a = np.asarray(a)
    return a.dtype, a.shape, a.tobytes()


def assert_same_arrays(got, want):
    assert list(got) == list(want)
    for key in want:
        assert bits(got[key]) == bits(want[key]), key
