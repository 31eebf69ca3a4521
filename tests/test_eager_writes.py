"""Eager state writes: the old value stays wherever something else holds it.

An eager ``self.x = v`` of a concrete array takes a fast path that skips the
tracer checks. When nothing but the instance's ``__dict__`` holds the
state's ``FrozenLocalStateRequest``, the write changes it in place (no one
can tell); otherwise it puts a new request in. Every other holder of the old
request (a user's ``__copy__`` that shares ``__dict__`` entries, a saved
``vars()``, a reference kept by hand) must keep seeing the old value, as it
would in plain Python. Each case is checked against the same class
undecorated.
"""

from __future__ import annotations

import copy
import sys
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autostate
from autostate import runtime


class Plain:
    def __init__(self) -> None:
        self.x = jnp.zeros(3)
        self.n = jnp.array(0)

    def step(self, v: Any) -> Any:
        self.x = v
        self.n = self.n + 1
        return self.x * 2


@autostate.stateful
class Decorated:
    def __init__(self) -> None:
        self.x = jnp.zeros(3)
        self.n = jnp.array(0)

    def step(self, v: Any) -> Any:
        self.x = v
        self.n = self.n + 1
        return self.x * 2


@autostate.stateful
class SharesDict:
    """A user ``__copy__`` that shares every ``__dict__`` entry."""

    def __init__(self) -> None:
        self.x = jnp.zeros(3)

    def step(self, v: Any) -> None:
        self.x = v

    def __copy__(self) -> SharesDict:
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new


def _value(holder: Any) -> np.ndarray:
    """The value a second holder sees: a model's ``x`` or a raw slot's."""
    if isinstance(holder, (Plain, Decorated, SharesDict)):
        return np.asarray(holder.x)
    if isinstance(holder, dict):
        slot = holder["x"]
        return np.asarray(slot.read() if runtime.is_slot(slot) else slot)
    return np.asarray(holder.read() if runtime.is_slot(holder) else holder)


# Ways a second holder of the model's state comes to exist; each returns it.
SECOND_HOLDERS: dict[str, Callable[[Any], Any]] = {
    "copy.copy": copy.copy,
    "copy.deepcopy": copy.deepcopy,
    "a saved vars()": lambda m: dict(vars(m)),
    "vars().copy()": lambda m: vars(m).copy(),
    "the slot kept by hand": lambda m: m.__dict__["x"],
    "a list of the dict's values": lambda m: {"x": list(m.__dict__.values())[0]},
    "__dict__ shared into a new instance": lambda m: _shared_instance(m),
}


def _shared_instance(m: Any) -> Any:
    new = type(m).__new__(type(m))
    new.__dict__.update(m.__dict__)
    return new


WRITES: dict[str, Callable[[Any, Any], Any]] = {
    "inside a method": lambda m, v: m.step(v),
    "from outside": lambda m, v: setattr(m, "x", v),
}


@pytest.mark.parametrize("write", list(WRITES), ids=list(WRITES))
@pytest.mark.parametrize("holder", list(SECOND_HOLDERS), ids=list(SECOND_HOLDERS))
def test_a_second_holder_keeps_the_old_value_as_in_plain_python(holder: str, write: str) -> None:
    seen = {}
    for cls in (Plain, Decorated):
        model = cls()
        model.step(jnp.full(3, 1.0))  # a frozen (written) state, not the initial one
        other = SECOND_HOLDERS[holder](model)
        WRITES[write](model, jnp.full(3, 7.0))
        WRITES[write](model, jnp.full(3, 9.0))
        seen[cls.__name__] = (np.asarray(model.x), _value(other))
    np.testing.assert_array_equal(seen["Decorated"][0], seen["Plain"][0])
    np.testing.assert_array_equal(seen["Decorated"][1], seen["Plain"][1])
    np.testing.assert_array_equal(seen["Decorated"][1], np.full(3, 1.0))


@pytest.mark.parametrize("write", list(WRITES), ids=list(WRITES))
def test_a_user_copy_that_shares_dict_entries_stays_independent(write: str) -> None:
    model = SharesDict()
    model.step(jnp.ones(3))
    twin = copy.copy(model)
    WRITES[write](model, jnp.full(3, 5.0))
    WRITES[write](twin, jnp.full(3, 6.0))
    np.testing.assert_array_equal(np.asarray(model.x), np.full(3, 5.0))
    np.testing.assert_array_equal(np.asarray(twin.x), np.full(3, 6.0))


def test_functionalize_states_and_frozen_models_keep_their_values() -> None:
    model = Decorated()
    model.step(jnp.ones(3))
    f, states = model.functionalize()
    frozen = autostate.freeze(f, states)
    model.step(jnp.full(3, 4.0))
    model.x = jnp.full(3, 8.0)
    assert all(np.asarray(v).tolist() in ([1.0] * 3, 1) for v in jax.tree_util.tree_leaves(states))
    np.testing.assert_array_equal(np.asarray(frozen.x), np.ones(3))
    np.testing.assert_array_equal(np.asarray(model.x), np.full(3, 8.0))


def test_leaves_taken_before_a_write_are_unchanged() -> None:
    model = Decorated()
    model.step(jnp.ones(3))
    leaves = jax.tree_util.tree_leaves(model)
    model.step(jnp.full(3, 2.0))
    assert [np.asarray(leaf).tolist() for leaf in leaves] == [[1.0] * 3, 1]


def test_a_write_never_changes_a_request_something_else_holds() -> None:
    """Why no holder can see a later write: a held request is replaced, not updated."""
    model = Decorated()
    model.step(jnp.ones(3))
    for write in WRITES.values():
        before = model.__dict__["x"]
        write(model, jnp.full(3, 3.0))
        assert model.__dict__["x"] is not before
        np.testing.assert_array_equal(np.asarray(before.read()), np.ones(3))
        model.step(jnp.ones(3))
    np.testing.assert_array_equal(np.asarray(model.x), np.ones(3))


def test_a_traced_value_is_still_refused_by_an_eager_model() -> None:
    model = Decorated()
    model.step(jnp.ones(3))
    with pytest.raises(autostate.AutostateError):
        jax.jit(lambda v: model.step(v))(jnp.ones(3))
    np.testing.assert_array_equal(np.asarray(model.x), np.ones(3))
    with pytest.raises(autostate.AutostateError):
        jax.jit(lambda v: setattr(model, "x", v))(jnp.ones(3))
    np.testing.assert_array_equal(np.asarray(model.x), np.ones(3))


@pytest.mark.parametrize("write", list(WRITES), ids=list(WRITES))
def test_a_request_nothing_else_holds_takes_the_write_in_place(write: str) -> None:
    """The allocation-free write: what makes an eager write cost a few hundred ns."""
    assert sys.implementation.name != "cpython" or runtime._SOLE_HOLDER > 0
    model = Decorated()
    model.step(jnp.ones(3))
    model.step(jnp.ones(3))  # the first write of a concrete array teaches its type
    before = id(model.__dict__["x"])
    WRITES[write](model, jnp.full(3, 3.0))
    assert id(model.__dict__["x"]) == before
    np.testing.assert_array_equal(np.asarray(model.x), np.full(3, 3.0))
    held = model.__dict__["x"]
    WRITES[write](model, jnp.full(3, 4.0))
    assert model.__dict__["x"] is not held
    np.testing.assert_array_equal(np.asarray(held.read()), np.full(3, 3.0))


def test_a_shallow_copy_has_its_own_requests() -> None:
    """So a copy made at any moment of a write (another thread, a debugger) keeps its value."""
    model = Decorated()
    model.step(jnp.ones(3))
    twin = copy.copy(model)
    assert twin.__dict__["x"] is not model.__dict__["x"]
    model.step(jnp.full(3, 2.0))
    np.testing.assert_array_equal(np.asarray(twin.x), np.ones(3))


def test_a_copy_sharing_entries_in_another_thread_never_sees_a_later_write() -> None:
    """No thread switch falls between the reference count and the in-place
    store (the count is an attribute read computed from C): a thread that
    copies the model, sharing its requests, never sees a later write. With
    the count as a call of ``sys.getrefcount`` this failed within a second."""
    model = SharesDict()
    model.step(jnp.zeros(3))
    values = [jnp.full(3, float(i)) for i in range(50)]
    done = threading.Event()
    changed: list[str] = []

    def copier() -> None:
        while not done.is_set():
            twin = copy.copy(model)
            first = twin.x
            for _ in range(20):
                if twin.x is not first:
                    changed.append("a copy saw a write made after it")
                    return

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # a thread switch at (nearly) every chance
    thread = threading.Thread(target=copier)
    thread.start()
    try:
        for _ in range(100):
            for v in values:
                model.step(v)
                model.x = v
    finally:
        done.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert changed == []
