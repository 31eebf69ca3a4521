"""The programs the host fallback cases run (``test_host_fallback.py``): class
sources run plain and decorated, and their expected values. Other concept
files import some of them too.
"""

from __future__ import annotations

HOST = """
@DECORATE_HOST
class Stats:
    def __init__(self, d):
        self.mean = jnp.zeros(d)
        self.var = jnp.ones(d)
        self.count = jnp.zeros((), jnp.int32)
        self.seen = jnp.array(False)

    def __call__(self, x):
        m = 0.1
        self.mean = (1 - m) * self.mean + m * x.mean(0)
        self.var = (1 - m) * self.var + m * x.var(0)
        self.count = self.count + 1
        self.seen = self.seen | (x.sum() > 0)
        return (x - self.mean) / jnp.sqrt(self.var + 1e-5)


@DECORATE_HOST
class Noise:
    def __init__(self, seed):
        self.key = jax.random.key(seed)

    def __call__(self, x):
        self.key, sub = jax.random.split(self.key)
        return x + jax.random.normal(sub, x.shape)


@DECORATE_HOST
class RawNoise:
    def __init__(self, seed):
        self.key = jax.random.PRNGKey(seed)

    def __call__(self, x):
        self.key, sub = jax.random.split(self.key)
        return x + jax.random.uniform(sub, x.shape)


@DECORATE_HOST
class Ema:
    def __init__(self):
        self.acc = jnp.ones(())
        self.total = jnp.zeros(())

    def __call__(self, x):
        y = self.acc * x
        self.acc = self.acc * 0.5 + x
        self.total = self.total + y
        return y + self.total


@DECORATE_HOST
class Cache:
    def __init__(self, n):
        self.buf = {"k": jnp.zeros((n, 2)), "pos": jnp.zeros((), jnp.int32)}

    def __call__(self, x):
        pos = self.buf["pos"]
        self.buf = {"k": self.buf["k"].at[pos].set(x), "pos": pos + 1}
        return self.buf["k"].sum(0)


@DECORATE_HOST
class Looper:
    def __init__(self):
        self.total = jnp.zeros(())
        self.hits = jnp.zeros((), jnp.int32)

    def scanned(self, xs):
        def body(c, x):
            self.total = self.total + x
            return c + self.total, self.total * 2
        return lax.scan(body, jnp.zeros(()), xs)

    def branched(self, x):
        def yes(v):
            self.hits = self.hits + 1
            return v * 3
        def no(v):
            self.total = self.total - v
            return v
        return lax.cond(x > 0, yes, no, x)

    def until(self, limit):
        def cond(c):
            return self.total < limit
        def body(c):
            self.total = self.total + 1.5
            self.hits = self.hits + 1
            return c + 1
        return lax.while_loop(cond, body, 0)


@DECORATE_HOST
class Gate:
    def __init__(self):
        self.opened = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        def open_(v):
            self.opened = self.opened + 1
            return v * 2
        return lax.cond(x.sum() > 0, open_, lambda v: v, x)


@DECORATE
class Net:
    def __init__(self):
        self.stats = Stats(2)
        self.w = jnp.full(2, 0.5)
        self.steps = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.steps = self.steps + 1
        return self.stats(x) * self.w


@DECORATE_HOST
class HostOfFunctional:
    def __init__(self):
        self.inner = Inner()
        self.total = jnp.zeros(())

    def __call__(self, x):
        y = self.inner(x)
        self.total = self.total + y
        return self.total


@DECORATE
class Inner:
    def __init__(self):
        self.acc = jnp.ones(())

    def __call__(self, x):
        self.acc = self.acc * 0.5 + x
        return self.acc
"""


HOST_TALLY = """
@DECORATE_HOST
class Tally:
    def __init__(self):
        self.n = jnp.zeros(())

    def __call__(self, x):
        self.n += x
        return self.n

    def rename(self):
        self.n = "abc"
"""


HOST_COUNTERS = """
@DECORATE_HOST
class HostCounter:
    def __init__(self):
        self.n = jnp.zeros(())
        self.hist = jnp.zeros(3)

    def __call__(self, x):
        self.n = self.n + x
        self.hist = self.hist.at[1].add(x)
        return self.n * 2

    def looped(self, k):
        def tick(i, carry):
            self.n = self.n + i
            return carry + self.n
        return lax.fori_loop(0, k, tick, jnp.zeros(()))

    def scanned(self, xs):
        def body(c, x):
            self.hist = self.hist + x
            return c + x.sum(), self.n
        return lax.scan(body, jnp.zeros(()), xs)

    def branch(self, x):
        def yes(v):
            self.n = self.n + v
            return v * 2
        return lax.cond(x > 0, yes, lambda v: v, x)


@DECORATE
class Parent:
    def __init__(self):
        self.host = HostCounter()
        self.mine = jnp.zeros(())

    def __call__(self, x):
        self.mine = self.mine + self.host(x)
        return self.mine


@DECORATE_HOST
class HostParent:
    def __init__(self):
        self.child = Plain()
        self.t = jnp.zeros(())

    def __call__(self, x):
        self.t = self.t + self.child(x)
        return self.t


@DECORATE
class Plain:
    def __init__(self):
        self.s = jnp.ones(())

    def __call__(self, x):
        self.s = self.s * 2 + x
        return self.s
"""
