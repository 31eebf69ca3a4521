"""The programs the exceptions cases run (``test_exceptions.py``): class
sources run plain and decorated, and their expected values. Other concept
files import some of them too.
"""

from __future__ import annotations

RAISE_IN_LAX = """
def _body(self, c, x):
    self.t = self.t + x
    if c is None:
        raise ArithmeticError("body")
    return c + self.t, None


@DECORATE
class Base:
    def __init__(self):
        self.t = jnp.zeros(())

    body = (lambda fn: functools.wraps(fn)(lambda self, *a: fn(self, *a)))(_body)


class M(Base):
    def run(self, xs):
        try:
            lax.scan(lambda c, x: self.body(None, x), 0.0, xs)
        except ArithmeticError:
            pass
        return self.t

    def run_then_assign(self, xs):
        try:
            lax.scan(self.body, None, xs)
        except ArithmeticError:
            self.t = jnp.asarray(-1.0)
        return self.t
"""


BRANCH_EXCEPTIONS = """
class Boom(Exception):
    pass


@DECORATE
class Branchy:
    def __init__(self):
        self.s = jnp.zeros(())
        self.t = jnp.zeros(())

    def cond(self, x, pred):
        def taken(v):
            self.s = self.s + v
            return v
        def untaken(v):
            self.t = self.t + v
            raise Boom("a branch plain Python never runs")
        return lax.cond(pred, taken, untaken, x)

    def switch(self, x):
        def taken(v):
            self.s = self.s + v
            return v
        def untaken(v):
            self.t = self.t + v
            raise Boom("a branch plain Python never runs")
        return lax.switch(0, [taken, untaken], x)

    def empty_scan(self, x):
        def body(c, v):
            self.t = self.t + v
            raise Boom("a body plain Python never runs")
        self.s = self.s + x
        return lax.scan(body, x, jnp.zeros((0,)))[0]

    def zero_fori(self, x):
        def body(i, c):
            self.t = self.t + c
            raise Boom("a body plain Python never runs")
        self.s = self.s + x
        return lax.fori_loop(0, 0, body, x)

    def false_while(self, x):
        def body(c):
            self.t = self.t + c
            raise Boom("a body plain Python never runs")
        self.s = self.s + x
        return lax.while_loop(lambda c: c > 100.0, body, x)

    def step(self, x, fail):
        self.s = self.s * 2 + x
        if fail:
            raise Boom("step")
        self.t = self.t + jnp.sin(x)
        return self.s * self.t


@DECORATE_HOST
class Host:
    def __init__(self):
        self.a = jnp.zeros(())
        self.s = jnp.zeros(())

    def direct(self, x, fail):
        self.a = self.a + x
        if fail:
            raise Boom("direct")
        self.s = self.s + x
        return self.a

    def in_scan(self, xs, fail):
        self.a = self.a + 1.0
        def body(c, x):
            self.s = self.s + x
            if fail:
                raise Boom("body")
            return c, None
        lax.scan(body, 0.0, xs)
        return self.s

    def caught(self, xs):
        def body(c, x):
            self.s = self.s + x
            raise Boom("body")
        try:
            lax.scan(body, 0.0, xs)
        except Boom:
            pass
        return self.s
"""
