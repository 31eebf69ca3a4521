"""The programs the python protocols cases run (``test_python_protocols.py``): class
sources run plain and decorated, and their expected values. Other concept
files import some of them too.
"""

from __future__ import annotations

ITER = """
import asyncio


class _ACursor:
    def __init__(self, model, n):
        self.model, self.i, self.n = model, 0, n

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.i >= self.n:
            raise StopAsyncIteration
        self.i += 1
        await asyncio.sleep(0)
        return self.model.bump(float(self.i) * 10)


@DECORATE
class Counter:
    def __init__(self, n=3):
        self.i = jnp.zeros((), jnp.int32)
        self.x = jnp.zeros(())
        self.length = n

    def bump(self, v):
        self.x = self.x + v
        return self.x

    def __iter__(self):
        self.i = jnp.zeros((), jnp.int32)
        return self

    def __next__(self):
        if int(self.i) >= self.length:  # HERE
            raise StopIteration
        self.i = self.i + 1
        return self.bump(1.0)

    def for_self(self):
        return sum(v for v in self) + self.i

    def __aiter__(self):
        return _ACursor(self, self.length)

    async def _adrain(self):
        return [v async for v in self]

    def adrain(self):
        return jnp.stack(asyncio.run(self._adrain()))
"""


CMS = """
import contextlib


@DECORATE
class Flag:
    def __init__(self):
        self.training = jnp.asarray(True)
        self.entered = jnp.zeros(())
        self.exits = jnp.zeros(())

    def __enter__(self):
        self.entered = self.entered + 1
        self.training = jnp.asarray(False)
        return self

    def __exit__(self, et, ev, tb):
        self.training = jnp.asarray(True)
        self.exits = self.exits + 1
        return False

    def set(self, v):
        old = self.training
        self.training = jnp.asarray(v)
        return old


@DECORATE
class Unit:
    def __init__(self, k):
        self.training = jnp.asarray(True)
        self.k = k
        self.uses = jnp.zeros(())
        self.closes = jnp.zeros(())

    def set(self, v):
        old = self.training
        self.training = jnp.asarray(v)
        return old

    @contextlib.contextmanager
    def mode(self, v):
        old = self.set(v)
        try:
            yield self
        finally:
            self.set(old)

    def close(self):
        self.closes = self.closes + 1

    def __call__(self, x):
        self.uses = self.uses + 1
        return jnp.where(self.training, x * self.k, x)


@DECORATE
class Net:
    def __init__(self):
        self.flag = Flag()
        self.a = Unit(2.0)
        self.b = Unit(3.0)
        self.w = jnp.asarray(2.0)
        self.n = jnp.zeros(())
        self.errs = jnp.zeros(())

    @contextlib.contextmanager
    def train_mode(self, v):
        old = self.flag.set(v)
        try:
            yield self.flag
        finally:
            self.flag.set(old)

    def fwd(self, x):
        self.n = self.n + 1
        return jnp.where(self.flag.training, x * 0.5, x) * self.w

    def with_self_flag(self, x):
        with self.flag as fl:
            y = self.fwd(x) + fl.entered
        return y + self.fwd(x)

    def with_raise(self, x):
        try:
            with self.flag:
                self.fwd(x)
                raise ValueError("boom")
        except ValueError:
            self.errs = self.errs + 1
        return self.fwd(x) + self.flag.training

    def nested(self, x):
        with self.train_mode(False):
            a = self.fwd(x)
            with self.flag:
                b = self.fwd(x)
                with self.train_mode(True):
                    c = self.fwd(x)
            d = self.fwd(x)
        return jnp.stack([a, b, c, d, self.fwd(x)])

    def in_scan(self, xs):
        def body(c, x):
            with self.train_mode(False):
                y = self.fwd(x)
            with self.flag:
                z = self.fwd(x)
            return c + y + z + self.fwd(x), y
        return lax.scan(body, jnp.zeros(()), xs)

    def raise_through_cm(self, x):
        with self.train_mode(False):
            self.fwd(x)
            raise KeyError("k")

    def both(self, x):
        with self.a.mode(False), self.b.mode(False) as b:
            y = self.a(x) + b(x)
        return y + self.a(x) + self.b(x)

    def in_cond(self, x):
        def yes(x):
            with self.a.mode(False):
                return self.a(x) + self.b(x)

        def no(x):
            with self.b.mode(False):
                return self.a(x) - self.b(x)

        return lax.cond(x > 1.5, yes, no, x)

    def in_fori(self, x):
        def body(i, c):
            with self.a.mode(i % 2 == 0):
                return c + self.a(c)
        return lax.fori_loop(0, 3, body, x)

    def scan_raise(self, xs):
        def body(c, x):
            try:
                with self.a.mode(False):
                    c = c + self.a(x)
                    raise ValueError("x")
            except ValueError:
                pass
            return c + self.a(x), None
        return lax.scan(body, jnp.zeros(()), xs)[0]

    def closing(self, x):
        with contextlib.closing(self.a) as a:
            y = a(x)
        with contextlib.suppress(KeyError):
            self.b(x)
            raise KeyError("k")
        return y + self.b(x)

    def exit_stack(self, x):
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.a.mode(False))
            stack.callback(self.b.close)
            y = self.a(x)
        return y + self.b.closes

    def scan_cm_raise_out(self, xs):
        def body(c, x):
            with self.train_mode(False):
                self.fwd(x)
                raise ValueError("v")
        try:
            lax.scan(body, jnp.zeros(()), xs)  # SCAN
        except ValueError:
            pass
        return self.flag.training
"""
