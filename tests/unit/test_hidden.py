"""autostate.hidden: what functionalize() refuses among a model's plain objects."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import pytest

import autostate
from autostate.errors import InvalidTypeError
from autostate.hidden import check_no_hidden_arrays


class Box:
    """A plain (undecorated) object."""

    def __init__(self, value):
        self.value = value


@autostate.stateful
class Holder:
    def __init__(self, held):
        self.w = jnp.ones(2)
        self.held = held

    def __call__(self, x):
        return self.w * x


def test_an_array_in_a_plain_object_is_refused_with_its_path():
    with pytest.raises(InvalidTypeError, match=r"holds an array inside a plain Box object \(at held\.value\)"):
        check_no_hidden_arrays(Holder(Box(jnp.zeros(3))))


@pytest.mark.parametrize(("value", "at"), [
    ([jnp.zeros(3)], r"held\.value\[0\]"),
    ((1, {"k": jnp.zeros(3)}), r"held\.value\[1\]\['k'\]"),
    ({"w": [jnp.zeros(3)]}, r"held\.value\['w'\]\[0\]"),
])
def test_an_array_in_a_container_of_a_plain_object_is_refused_with_its_path(value, at):
    """The plain object's list is as static as the object: its arrays would be
    baked into f as constants, as one held directly would."""
    with pytest.raises(InvalidTypeError, match=rf"inside a plain Box object \(at {at}\)"):
        check_no_hidden_arrays(Holder(Box(value)))


def test_a_model_behind_a_partial_is_refused_with_the_fix_for_partials():
    inner = Holder(None)
    with pytest.raises(InvalidTypeError) as info:
        check_no_hidden_arrays(Holder(functools.partial(inner, 2.0)))
    assert "functools.partial" in str(info.value)
    assert "lambda that names the model directly" in str(info.value)


def test_what_the_graph_follows_passes():
    check_no_hidden_arrays(Holder([Holder(None), {"k": jnp.zeros(2)}, (1, "a")]))
    check_no_hidden_arrays(Holder(Box(3)))  # no array in it: static data
    check_no_hidden_arrays(Box(jnp.zeros(2)))  # not a model: nothing to check


def test_functionalize_refuses_through_it():
    with pytest.raises(InvalidTypeError, match="Box"):
        Holder(Box(jnp.zeros(3))).functionalize()
