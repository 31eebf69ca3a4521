"""autostate.copies: a copy of a decorated instance is another model, with its own states."""

from __future__ import annotations

import copy

import jax.numpy as jnp
import numpy as np

import autostate
from autostate.copies import DetachedState


@autostate.stateful
class Counter:
    def __init__(self):
        self.n = jnp.zeros(())
        self.log = [jnp.ones(2)]

    def bump(self):
        self.n = self.n + 1
        return copy.copy(self)


@autostate.stateful
class Reduced:
    """A class with its own copy protocol: ``copy`` follows it."""

    def __init__(self):
        self.n = jnp.zeros(())
        self.copied = 0

    def __getstate__(self):
        return {**self.__dict__, "copied": self.copied + 1}


def test_an_eager_copy_has_states_of_its_own():
    model = Counter()
    twin = copy.copy(model)
    model.n = model.n + 5
    twin.n = twin.n + 1
    assert float(model.n) == 5.0 and float(twin.n) == 1.0
    assert twin.log is model.log  # (shallow: what a state holds is shared, as in Python)


def test_a_deep_copy_copies_what_the_states_hold():
    model = Counter()
    twin = copy.deepcopy(model)
    assert twin.log is not model.log
    np.testing.assert_array_equal(twin.log[0], model.log[0])


def test_a_copy_made_inside_a_call_holds_the_running_value_detached():
    model = Counter()
    f, states = model.functionalize()
    twin, new = f.bump(states)
    assert type(twin.__dict__["n"]) is DetachedState
    assert float(twin.n) == 1.0 and float(new["n"]) == 1.0
    twin.n = twin.n + 1  # the copy's own: the states dict is unchanged
    assert float(twin.n) == 2.0 and float(new["n"]) == 1.0


def test_a_class_copy_protocol_is_followed():
    model = Reduced()
    assert copy.copy(model).copied == 1
    assert copy.deepcopy(model).copied == 1
    assert model.copied == 0
