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


@autostate.stateful
class Inner:
    def __init__(self):
        self.w = jnp.ones(2)
        self.count = jnp.zeros((), jnp.int32)
        self.training = True

    def __call__(self, x):
        self.count += 1
        return self.w * x


def _switch_off(inner, x):
    inner.training = False
    return inner(x)


def _rescale(inner, x):
    inner.w = inner.w * 2  # a parameter: not state
    return inner(x)


@autostate.stateful
class Outer:
    def __init__(self, fn):
        self.inner = Inner()
        self.fn = fn

    def __call__(self, x):
        return jax.jit(self.fn)(self.inner, x)  # the model as an argument


def test_a_model_passed_to_the_jit_is_the_same_object_inside():
    # JAX would flatten the argument into a copy, whose writes nothing reads back.
    model = Outer(_switch_off)
    model(jnp.ones(2))
    assert model.inner.training is False and int(model.inner.count) == 1
    f, states = Outer(_switch_off).functionalize()  # f is no object boundary: refused
    with pytest.raises(autostate.AutostateError, match="training"):
        f(states, jnp.ones(2))
    f, states = Outer(_rescale).functionalize()
    for call in (Outer(_rescale), lambda x: f(states, x)):  # a parameter: refused, never lost
        with pytest.raises(autostate.AutostateError, match="Inner.w is not state"):
            call(jnp.ones(2))
