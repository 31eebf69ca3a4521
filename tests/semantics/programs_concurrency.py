"""The programs the concurrency cases run (``test_concurrency.py``): class
sources run plain and decorated, and their expected values. Other concept
files import some of them too.
"""

from __future__ import annotations

REENTRANT = """
@DECORATE
class Inner:
    def __init__(self):
        self.x = jnp.zeros(())
        self.y = jnp.full((), 7.0)

    def __call__(self, v):
        self.x = self.x * 3 + v
        return self.x

    def apply(self, fn, v):
        self.x = self.x + fn(v)
        return self.x

    def read_other(self, other):
        self.y = self.y + other.x
        return self.y

    def boom(self, v):
        self.x = self.x + v
        raise KeyError("inner")


@DECORATE
class Outer:
    def __init__(self):
        self.x = jnp.full((), 10.0)
        self.z = jnp.full((), 5.0)

    def bump(self, v):
        self.x = self.x + v
        return self.x

    def bumpz(self, v):
        self.z = self.z + v
        return self.z

    def use_f(self, fi, si, v):
        self.x = self.x + 1
        out, si = fi(si, v)
        self.x = self.x + out
        return self.x, si

    def use_jit_f(self, fi, si, v):
        out, si = jax.jit(lambda fi, si, v: fi(si, v))(fi, si, v)
        self.x = self.x * out
        return self.x, si

    def self_as_argument(self, fi, si):
        self.x = self.x + 1
        out, si = fi.read_other(si, self)
        return out, si

    def callback_x(self, fi, si, v):
        out, si = fi.apply(si, self.bump, v)
        return out, self.x, si

    def callback_z(self, fi, si, v):
        out, si = fi.apply(si, self.bumpz, v)
        return out, self.z, si

    def catches_inner(self, fi, si, v):
        self.x = self.x + 1
        try:
            fi.boom(si, v)
        except KeyError:
            self.x = self.x * 2
        out, si = fi(si, v)
        return self.x + out, si
"""


RECURSION = """
@DECORATE
class Node:
    def __init__(self, depth):
        self.w = jnp.asarray(float(depth + 1))
        self.count = jnp.zeros(())
        self.kids = [Node(depth - 1), Node(depth - 1)] if depth > 0 else []

    def __call__(self, x):
        self.count = self.count + 1
        y = x * self.w
        for k in self.kids:
            y = y + k(x + self.count)
        return y


@DECORATE
class Deep:
    def __init__(self, levels):
        self.levels = levels
        self.x = jnp.ones(())
        self.n = jnp.zeros(())
        self.trail = jnp.zeros(levels + 1)

    def rec(self, k, v):
        self.n = self.n + 1
        self.x = self.x + v * k
        self.trail = self.trail.at[k].set(self.x)
        if k > 0:
            return self.rec(k - 1, v) + self.x
        return self.x

    def __call__(self, v):
        return self.rec(self.levels, v)

    def two_levels(self, v):
        return self.rec(2, v)


@DECORATE
class Fib:
    def __init__(self, n):
        self.n = n
        self.calls = jnp.zeros((), jnp.int32)
        self.memo = {}

    def fib(self, n):
        self.calls = self.calls + 1
        if n in self.memo:
            return self.memo[n]
        out = jnp.asarray(float(n)) if n < 2 else self.fib(n - 1) + self.fib(n - 2)
        self.memo[n] = out
        return out

    def __call__(self, scale):
        self.memo = {}
        return self.fib(self.n) * scale


@DECORATE
class Peer:
    def __init__(self, with_peer):
        self.x = jnp.ones(())
        self.peer = Peer(False) if with_peer else None

    def __call__(self, v):
        self.x = self.x * 2 + v
        if self.peer is not None:
            return self.peer(self.x) + self.peer.poke(self) + self.x
        return self.x

    def poke(self, other):
        other.x = other.x + 100
        self.x = self.x + other.x
        return self.x

    def walk(self, other, depth):
        self.x = self.x + depth
        if depth > 0:
            return other.walk(self, depth - 1) * 2 + self.x
        return self.x

    def ping_pong(self, v):
        return self.walk(self.peer, 5) + v


@DECORATE
class Selfish:
    def __init__(self):
        self.me = self
        self.x = jnp.zeros(())

    def __call__(self, v):
        self.x = self.x + 1
        self.me.x = self.me.x * v
        return self.x + self.me.x


@DECORATE
class Lax:
    def __init__(self):
        self.x = jnp.ones(())
        self.n = jnp.zeros(())

    def rec_scan(self, k, xs):
        def body(c, v):
            self.x = self.x + v * k
            self.n = self.n + 1
            inner = self.rec_scan(k - 1, xs) if k > 0 else jnp.zeros(())
            return c + self.x + inner, None
        return lax.scan(body, jnp.zeros(()), xs)[0]

    def deep(self, xs):
        return self.rec_scan(2, xs)

    def rec_cond(self, k, v):
        def yes(v):
            self.x = self.x * 2 + v
            return self.rec_cond(k - 1, v) if k > 0 else self.x
        def no(v):
            self.n = self.n + k
            return self.x - v
        return lax.cond(v > 0, yes, no, v)

    def cond3(self, v):
        return self.rec_cond(3, v)


@DECORATE
class OnlyThroughAlias:
    def __init__(self):
        self.me = self
        self.x = jnp.zeros(())

    def __call__(self, v):
        self.me.x = self.me.x + v  # HERE
        return self.x
"""
