"""lifting/jit.py: a jax.jit inside a method threads its states through its
arguments and output, and runs once per call as plain Python does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import autostate
from autostate.errors import StaticStateError
from tests.unit.lifting.placement import equation


@autostate.stateful
class Step:
    def __init__(self):
        self.count = jnp.zeros((), jnp.int32)
        self.mode = "train"  # static config: written back at this object boundary

    def _add(self, k):
        self.count = self.count + k
        return self.count

    def __call__(self, k):
        return jax.jit(self._add)(k)

    def _evaluate(self):
        self.mode = "eval"
        return self.count

    def evaluate(self):
        return jax.jit(self._evaluate)()


def test_the_jitted_function_takes_and_returns_its_states():
    model = Step()
    f, states = model.functionalize()
    eqn = equation(lambda s: f(s, 2), states, primitive="jit|pjit")
    assert len(eqn.outvars) == 2  # the count returned, and the state


def test_a_jit_inside_a_method_is_an_object_boundary():
    model = Step()
    assert int(model(2)) == 2 and int(model.count) == 2
    model.evaluate()
    assert model.mode == "eval"  # as the plain call leaves it
    f, states = Step().functionalize()
    with pytest.raises(StaticStateError, match="'mode'"):  # f is no object boundary
        f.evaluate(states)
