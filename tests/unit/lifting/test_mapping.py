"""lifting/mapping.py: vmap maps a stacked sub-model's states along its axes and
shares every other state; a shared state written per example is refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import autostate
from autostate.errors import ControlFlowStateError


@autostate.stateful
class Member:
    def __init__(self, w):
        self.w = w
        self.seen = jnp.zeros(())

    def __call__(self, x):
        self.seen = self.seen + x
        return self.w * x


@autostate.stateful
class Ensemble:
    def __init__(self):
        self.members = jax.vmap(Member)(jnp.arange(1.0, 4.0))
        self.shared = jnp.zeros(())

    def __call__(self, x):
        return jax.vmap(lambda m: m(x))(self.members)

    def per_example(self, xs):
        def each(x):
            self.shared = self.shared + x
            return x

        return jax.vmap(each)(xs)


def test_a_mapped_sub_models_states_come_back_stacked():
    model = Ensemble()
    assert list(model(2.0)) == [2.0, 4.0, 6.0]
    assert list(model.members.seen) == [2.0, 2.0, 2.0]
    f, states = model.functionalize()
    out, new = jax.jit(f)(states, 1.0)
    assert list(out) == [1.0, 2.0, 3.0] and list(new["members.seen"]) == [3.0, 3.0, 3.0]


def test_a_shared_state_written_per_example_is_refused():
    model = Ensemble()
    with pytest.raises(ControlFlowStateError, match="differs from example to example"):
        model.per_example(jnp.arange(3.0))
    assert float(model.shared) == 0.0
