"""``autostate/state_values.py``: Python values in states, what is structure,
what is a leaf, what a states dict keeps and what a call copies."""

from __future__ import annotations

import collections
import enum

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autostate
from autostate import state_values as sv
from autostate import values
from autostate.errors import InvalidTypeError, StaticStateError


class Queue(collections.deque):
    """A deque subclass with attributes of its own (kept as structure)."""


class Mode(enum.Enum):
    TRAIN = "train"
    EVAL = "eval"


@pytest.mark.parametrize(
    "value, static",
    [
        (True, True),
        (3, True),
        ("relu", True),
        (Mode.TRAIN, True),
        (None, True),
        (1.5, False),
        (jnp.zeros(()), False),
        (np.int32(3), False),
        ((1, 2), False),
    ],
)
def test_static_values_are_python_scalars_strings_enums_and_none(value, static):
    assert sv.is_static_value(value) is static


def test_none_is_a_placeholder_not_a_mode():
    assert sv.is_static_value(None) and not sv.makes_static_state(None)
    assert sv.makes_static_state(False) and sv.makes_static_state(Mode.EVAL)
    assert sv.static_slot(None, "state", "h") is None
    assert sv.static_slot(jnp.zeros(()), "state", "h") is None
    slot = sv.static_slot(True, "state", "training")
    assert slot == sv.StaticState(True, "state", "training")


def test_static_states_compare_by_type_as_well_as_value():
    # ``True == 1`` and they hash alike: a slot holding one is not the other's.
    assert sv.StaticState(True, "state") != sv.StaticState(1, "state")
    assert sv.StaticState(1, "state") == sv.StaticState(1, "state")
    assert hash(sv.StaticState(1, "state")) == hash(sv.StaticState(1, "state"))
    assert not sv.same_static(True, 1) and sv.same_static("a", "a")


def test_a_static_state_is_structure_with_no_leaves():
    slot = sv.StaticState(Mode.TRAIN, "state", "mode")
    leaves, treedef = jax.tree_util.tree_flatten(slot)
    assert leaves == []
    assert jax.tree_util.tree_unflatten(treedef, []) == slot
    other = jax.tree_util.tree_structure(sv.StaticState(Mode.EVAL, "state", "mode"))
    assert treedef != other  # (another value: another trace of jit)


def test_a_handled_static_state_takes_its_own_value_and_refuses_another():
    slot = sv.StaticState(True, "state").handled_in_structure("h", "training")
    assert type(slot) is sv.HandledStaticState
    assert slot.read() is True and slot.name == "training" and not slot.was_explicitly_named
    assert slot.write(True) is None
    with pytest.raises(StaticStateError, match="static state 'training'"):
        slot.write(False, "training")
    with pytest.raises(StaticStateError, match="static state 'training'"):
        slot.write(1, "training")  # (the same number, another type)
    assert slot.frozen() == sv.StaticState(True, "state", None)
    named = sv.StaticState(True, "state", "mode").handled_in_structure("h", "path")
    assert named.name == "mode" and named.frozen().name == "mode"
    leaves, treedef = jax.tree_util.tree_flatten(slot)
    assert leaves == [] and jax.tree_util.tree_unflatten(treedef, []) == slot


def test_a_static_write_error_shows_a_traced_value_without_its_repr():
    slot = sv.StaticState(3, "state", "n").handled_in_structure("h", "n")

    def write(x):
        slot.write(x, "n")
        return x

    with pytest.raises(StaticStateError) as info:
        jax.jit(write)(jnp.ones(2))
    message = str(info.value)
    assert "model.n = ..." in message and "Traced" not in message


def test_a_python_value_in_place_of_the_placeholder_none_is_refused_inside_a_call():
    sv.check_placeholder_write("h", "hidden", jnp.zeros(2))  # an array may replace None
    with pytest.raises(StaticStateError, match="placeholder None"):
        sv.check_placeholder_write("h", "hidden", 3)


def test_holds_static_values_looks_inside_containers_only():
    assert not sv.holds_static_values(jnp.zeros(2))
    assert not sv.holds_static_values(3)  # (one number: a leaf, as under jit)
    assert not sv.holds_static_values({"m": jnp.zeros(2), "s": 1.5})
    assert sv.holds_static_values({"m": jnp.zeros(2), "name": "relu"})
    assert sv.holds_static_values((2, 3))
    assert sv.holds_static_values([collections.deque([jnp.zeros(1)])])


def test_split_and_join_static_values_round_trip():
    value = {"shape": (2, 3), "m": jnp.arange(2.0), "act": "relu", "mode": Mode.EVAL, "h": None}
    stripped, static = sv.split_static_values(value)
    assert stripped["shape"] == (None, None) and stripped["act"] is None
    assert jax.tree_util.tree_leaves(stripped) == [stripped["m"]]
    # JAX may put anything at the array's position; the Python values come back.
    doubled = jax.tree_util.tree_map(lambda x: x * 2, stripped)
    back = sv.join_static_values(doubled, static)
    assert back["shape"] == (2, 3) and back["act"] == "relu" and back["mode"] is Mode.EVAL
    assert back["h"] is None
    np.testing.assert_array_equal(back["m"], [0.0, 2.0])


def test_a_container_jax_takes_as_one_leaf_travels_as_its_items():
    queue = Queue([jnp.ones(1), 2], maxlen=3)
    queue.tag = "q"
    assert values.opaque_items(queue) is not None
    assert values.opaque_items([1]) is None and values.opaque_items({"a": 1}) is None
    assert values.opaque_items(collections.OrderedDict(a=1)) is None  # (a pytree JAX flattens)
    stripped, static = sv.split_static_values({"q": queue})
    assert jax.tree_util.tree_leaves(stripped) == [queue[0]]
    back = sv.join_static_values(stripped, static)["q"]
    assert type(back) is Queue and back.maxlen == 3 and back is not queue
    assert back[1] == 2 and back.tag == "q"
    assert values.leaves_within_opaque([queue, 5]) == [queue[0], 2, 5]


def test_a_container_that_holds_itself_is_refused_not_walked_forever():
    queue: collections.deque = collections.deque([1])
    queue.append(queue)
    with pytest.raises(InvalidTypeError, match="holds itself"):
        sv.split_static_values({"q": queue})
    assert values.leaves_within_opaque([queue]) == [1, queue]  # (taken apart once)


def test_states_keeps_python_values_as_structure():
    states = sv.states_dict({"cfg": {"m": jnp.zeros(2), "name": "relu"}, "w": jnp.ones(1)})
    assert type(states) is sv.States is autostate.States
    leaves, treedef = jax.tree_util.tree_flatten(states)
    assert len(leaves) == 2
    back = jax.tree_util.tree_unflatten(treedef, leaves)
    assert type(back) is sv.States and back["cfg"]["name"] == "relu"
    assert type(states.copy()) is sv.States
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(states)[0]]
    assert paths == ["['cfg']['m']", "['w']"]
    plain = {"w": jnp.ones(1)}
    assert sv.states_dict(plain) is plain  # (a plain dict when no state needs more)


def test_jit_traces_once_per_python_value_in_a_states_dict():
    traces = []

    def f(states):
        traces.append(states["shape"])
        return jnp.zeros(states["shape"])

    jitted = jax.jit(f)
    assert jitted(sv.States({"shape": (2,)})).shape == (2,)
    assert jitted(sv.States({"shape": (2,)})).shape == (2,)
    assert jitted(sv.States({"shape": (3,)})).shape == (3,)
    assert traces == [(2,), (3,)]
