"""A sub-model handed to ``lax`` control flow as its carry or operand.

Plain Python's loop (``lax`` read as a Python loop, the harness's reference)
passes the one object around: what the body writes to the model is on the
sub-model after the call, and the carry the call returns is that model.
JAX flattens the carry and rebuilds a copy of the model in the body; its
states are threaded like the sub-model's own. The copy the body returns was
flattened after autostate had put the states back as they were before the
body (so a loop's carry kept the first value, and a later trip read it: the
state came out after one trip's write, and the returned model held the old
value); it is now flattened while the body's states are still bound.

Each primitive, with the model as the carry (or the operand a branch or a
checkpointed function returns), compared with plain Python eagerly, through
``f``, under ``jit`` and after ``freeze``; also under ``grad`` and ``vmap``.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import jax.numpy as jnp
import pytest
from differential import X, check, check_transform, pair  # noqa: I001 - tests/ is on sys.path

Loader = Callable[..., types.ModuleType]

XS = jnp.asarray([[0.5, -1.0, 2.0], [1.0, 0.25, -0.5], [0.1, 0.2, 0.3]])
X0 = jnp.asarray([0.5, -1.0, 2.0])

SOURCE = """
@DECORATE
class Sub:
    def __init__(self):
        self.w = jnp.asarray([1.0, 0.5, -0.5])
        self.n = jnp.zeros(())
        self.h = jnp.zeros(3)

    def step(self, x):
        self.n = self.n + 1.0
        self.h = jnp.tanh(self.h * self.w + x)
        return self.h.sum()


@DECORATE
class Model:
    def __init__(self):
        self.sub = Sub()
        self.calls = jnp.zeros(())

    def scan_carry(self, xs):
        def body(m, x):
            return m, m.step(x)
        m, ys = lax.scan(body, self.sub, xs)
        self.calls = self.calls + 1.0
        return ys, m.n, m.h

    def scan_carry_tuple(self, xs):
        def body(c, x):
            m, total = c
            return (m, total + m.step(x)), None
        (m, total), _ = lax.scan(body, (self.sub, 0.0), xs)
        return total, m.n

    def fori_init(self, x):
        m = lax.fori_loop(0, 3, lambda i, m: (m.step(x * i), m)[1], self.sub)
        return m.n, m.h

    def while_init(self, x):
        def body(c):
            i, m = c
            m.step(x)
            return i + 1, m
        _, m = lax.while_loop(lambda c: c[0] < 2, body, (0, self.sub))
        return m.n, m.h

    def cond_operand(self, x):
        def yes(m):
            m.step(x)
            return m
        m = lax.cond(x.sum() > 0, yes, lambda m: m, self.sub)
        return m.n, m.h

    def switch_operand(self, x):
        def once(m):
            m.step(x)
            return m
        def twice(m):
            m.step(x)
            m.step(-x)
            return m
        m = lax.switch(1, [once, twice], self.sub)
        return m.n, m.h

    def checkpointed(self, x):
        def run(m):
            m.step(x)
            return m
        m = checkpoint(run)(self.sub)
        return m.n, m.h
"""

CASES = {
    "scan_carry": (XS,),
    "scan_carry_tuple": (XS,),
    "fori_init": (X0,),
    "while_init": (X0,),
    "cond_operand": (X0,),
    "switch_operand": (X0,),
    "checkpointed": (X0,),
}


@pytest.mark.parametrize("method", sorted(CASES))
def test_a_model_in_the_carry_is_the_one_model(write_module: Loader, method: str) -> None:
    plain, dec = pair(write_module, SOURCE)
    args = CASES[method]
    check(plain, dec, "Model()", [(method, args), (method, args)])


@pytest.mark.parametrize(
    ("method", "transform"),
    [
        ("scan_carry", "grad"),
        ("scan_carry", "vmap"),
        ("fori_init", "grad"),
        ("fori_init", "vmap"),
        # (The plain reference's Python ``if`` cannot take a batched predicate.)
        ("cond_operand", "grad"),
    ],
)
def test_a_model_in_the_carry_under_a_transformation(
    write_module: Loader, method: str, transform: str
) -> None:
    plain, dec = pair(write_module, SOURCE)
    x = CASES[method][0]
    if transform == "vmap":
        x = jnp.stack([x, -x])
    check_transform(plain, dec, "Model()", [(method, (X,))], x, transform)
