"""autostate.copies: a copy of a decorated instance is another model, with its own states."""

from __future__ import annotations

import copy
import pickle

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


@autostate.stateful
class Pickling:
    def __init__(self):
        self.counter = Counter()
        self.total = jnp.zeros(())

    def __call__(self):
        self.counter.bump()
        self.total = self.total + 2
        whole, part = pickle.loads(pickle.dumps(self)), pickle.loads(pickle.dumps(self.counter))
        part.n = part.n + 10  # the unpickled model's own
        return whole.total, whole.counter.n, part.n, self.counter.n


def test_a_pickle_made_inside_a_call_holds_the_running_values():
    # (a running state pickled as its reference: the unpickled model raised
    # UnhandledLocalStateError, where copy.deepcopy there works)
    model = Pickling()
    eager = [float(v) for v in model()]
    f, states = model.functionalize()
    out, new = f(states)
    assert [float(v) for v in out] == [4.0, 2.0, 12.0, 2.0]
    assert eager == [2.0, 1.0, 11.0, 1.0]
    assert float(new["counter.n"]) == 2.0 and float(new["total"]) == 4.0


@autostate.stateful
class Logged:
    def __init__(self):
        self.hist = [jnp.zeros(())]

    def step(self, x):
        self.hist = self.hist + [x]
        for twin in (copy.deepcopy(self), copy.deepcopy(copy.deepcopy(self))):
            twin.hist.append(jnp.full((), 100.0))  # the copy's own list
            twin.hist[0] = jnp.full((), 7.0)
        return sum(self.hist) + len(self.hist)


def test_a_deep_copy_made_inside_a_call_copies_what_the_state_holds():
    # (the copy held the running state's own list: its changes were the call's,
    # and f returned them: 113 where plain Python gives 5)
    eager = Logged()
    assert float(eager.step(jnp.float32(3.0))) == 5.0
    f, states = Logged().functionalize()
    out, new = f.step(states, jnp.float32(3.0))
    assert float(out) == 5.0 and [float(v) for v in new["hist"]] == [0.0, 3.0]
    model = Logged()
    assert float(autostate.jit(lambda m, x: m.step(x))(model, jnp.float32(3.0))) == 5.0
    assert [float(v) for v in model.hist] == [0.0, 3.0]


def test_a_class_copy_protocol_is_followed():
    model = Reduced()
    assert copy.copy(model).copied == 1
    assert copy.deepcopy(model).copied == 1
    assert model.copied == 0


@autostate.stateful(fallback="host")
class HostCounter:
    def __init__(self):
        self.n = jnp.zeros(())
        self.m = jnp.zeros(())

    def bump(self):
        self.n = self.n + 1
        self.m = self.m + 2


class PlainCounter:
    def __init__(self):
        self.n = jnp.zeros(())
        self.m = jnp.zeros(())

    def bump(self):
        self.n = self.n + 1
        self.m = self.m + 2


def test_a_shallow_copy_of_a_host_model_writes_a_store_of_its_own():
    # (a shared store wrote the copy's bumps into the original, silently)
    for make in (PlainCounter, HostCounter):
        model = make()
        model.bump()
        twin = copy.copy(model)
        twin.bump()
        model.bump()
        model.bump()
        assert (float(model.n), float(model.m)) == (3.0, 6.0), make
        assert (float(twin.n), float(twin.m)) == (2.0, 4.0), make
    twin_slots = copy.copy(HostCounter()).__dict__
    assert twin_slots["n"].store is twin_slots["m"].store  # one store per copy
