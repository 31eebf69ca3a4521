"""lifting/autodiff.py: checkpoint's states are arguments and outputs; a
derivative's come out of its auxiliary output; custom rules run as Python."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import autostate
from tests.unit.lifting.placement import equation


@autostate.stateful
class Tracked:
    def __init__(self):
        self.w = jnp.full((), 3.0)
        self.calls = jnp.zeros(())

    def loss(self, x):
        self.calls = self.calls + 1.0
        return self.w * x * x

    def slope(self, x):
        return jax.grad(self.loss)(x)

    def remat(self, x):
        return jax.checkpoint(self.loss)(x)


def test_a_derivative_writes_back_what_its_function_assigned():
    model = Tracked()
    assert float(model.slope(2.0)) == 12.0 and float(model.calls) == 1.0
    f, states = model.functionalize()
    g, new = jax.jit(f.slope)(states, 2.0)
    assert float(g) == 12.0 and float(new["calls"]) == 2.0  # (one call each)


def test_checkpoint_threads_the_state_through_its_arguments_and_output():
    model = Tracked()
    f, states = model.functionalize()
    eqn = equation(lambda s, x: f.remat(s, x), states, 2.0, primitive="remat2")
    assert len(eqn.outvars) == 2  # the loss, and calls
    out, new = f.remat(states, 2.0)
    assert float(out) == 12.0 and float(new["calls"]) == 1.0


def test_a_custom_vjp_reads_state_in_its_primal():
    model = Tracked()

    @autostate.lifting.routes.routed(jax.custom_vjp)
    def scaled(x):
        return model.w * x

    scaled.defvjp(lambda x: (scaled(x), None), lambda _, g: (2.0 * g,))
    assert float(scaled(2.0)) == 6.0
    assert float(jax.grad(scaled)(2.0)) == 2.0
