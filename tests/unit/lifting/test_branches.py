"""lifting/branches.py: a state any branch assigns is every branch's operand and output."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

import autostate
from tests.unit.lifting.placement import equation


@autostate.stateful
class Gate:
    def __init__(self):
        self.hits = jnp.zeros(())
        self.bias = jnp.ones(())

    def __call__(self, x):
        def hit(x):
            self.hits = self.hits + 1.0
            return x + self.bias

        return lax.cond(x > 0, hit, lambda x: x - self.bias, x)

    def pick(self, i, x):
        def add(x):
            self.hits += 1.0
            return x

        return lax.switch(i, [add, lambda x: x, lambda x: -x], x)


def test_cond_threads_the_state_one_branch_assigns_through_both():
    model = Gate()
    f, states = model.functionalize()
    eqn = equation(lambda s, x: f(s, x), states, 1.0, primitive="cond")
    assert len(eqn.outvars) == 2  # the output, and hits (from the branch that keeps it too)
    out, new = jax.jit(f)(states, -1.0)
    assert float(out) == -2.0 and float(new["hits"]) == 0.0
    out, new = jax.jit(f)(states, 1.0)
    assert float(out) == 2.0 and float(new["hits"]) == 1.0


def test_switch_threads_it_through_every_branch():
    model = Gate()
    assert float(model.pick(2, 3.0)) == -3.0 and float(model.hits) == 0.0
    assert float(model.pick(0, 3.0)) == 3.0 and float(model.hits) == 1.0
