"""``autostate/graph/witness.py``: the identity-only change check of a kept flatten.

A witness sees every change a new flatten would see (or gives up where
identity cannot tell one), and a patched witness sees what a new one sees."""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

import autostate
from autostate import graph


@autostate.stateful
class _Witnessed:
    def __init__(self) -> None:
        self.w = jnp.ones(2)
        self.count = jnp.zeros(())
        self.sizes = [2, (3, [4])]
        self.table = {"a": jnp.ones(1)}
        self.training = True

    def tick(self) -> None:
        self.count = self.count + 1
        self.table = dict(self.table)  # (a state: its first value is the dict above)

    def eval(self) -> None:
        self.training = False  # (a static state: its slot is replaced)


@dataclasses.dataclass
class _MutableConfig:  # an __eq__ of its own: the graphdef compares it by value
    scale: float


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m.tick(),  # a state written in place (its slot kept)
        lambda m: m.eval(),  # a static state (a Python bool) assigned
        lambda m: setattr(m, "w", m.w + 1),
        lambda m: m.sizes[1][1].append(5),  # a list inside a tuple inside a list
        lambda m: m.table.update(b=jnp.zeros(1)),
        lambda m: m.table.__setitem__("a", jnp.zeros(1)),
        lambda m: setattr(m, "extra", None),
        lambda m: m.__dict__.pop("sizes"),
    ],
)
def test_witness_sees_each_change(change: Any) -> None:
    model = _Witnessed()
    witness = graph.Witness.of([model])
    assert witness is not None and witness.unchanged()
    change(model)
    assert not witness.unchanged()


@pytest.mark.parametrize(
    "value", [np.ones(2), _MutableConfig(1.0), collections.deque([1]), {1, 2}]
)
def test_witness_gives_up_on_values_changed_in_place_unseen(value: Any) -> None:
    model = _Witnessed()
    model.extra = value
    assert graph.Witness.of([model]) is None
    model.extra = functools.partial(max, 1)  # compared by identity: witnessed
    assert graph.Witness.of([model]) is not None


def test_witness_sees_the_instance_replaced_around_its_dict() -> None:
    model = _Witnessed()
    witness = graph.Witness.of([model])
    assert witness is not None
    model.__dict__ = dict(model.__dict__)  # the same values, another dict
    assert not witness.unchanged()


def test_witness_sees_a_first_value_changed_in_place() -> None:
    model = _Witnessed()  # ``table`` is a state still holding its first value
    assert type(vars(model)["table"]).__name__ == "InitialLocalStateRequest"
    witness = graph.Witness.of([model])
    assert witness is not None
    model.table["a"] = jnp.zeros(1)
    assert not witness.unchanged()


@pytest.mark.parametrize(
    "change",
    [
        lambda m: m.tick(),
        lambda m: m.sizes[1][1].append(5),
        lambda m: m.table.update(b=jnp.zeros(1)),
        lambda m: setattr(m, "extra", None),
    ],
)
def test_a_patched_witness_sees_what_a_new_one_sees(change: Any) -> None:
    # A compiled call rewrites some attributes and patches the witness for them
    # alone: the patched witness stands where a new one would, and sees each
    # later change a new one sees.
    model = _Witnessed()
    witness = graph.Witness.of([model])
    assert witness is not None
    model.w = model.w + 1
    model.table = {"a": jnp.zeros(1), "c": jnp.ones(1)}
    assert not witness.unchanged()
    assert witness.patch([(0, "table"), (0, "w")])
    assert witness.unchanged()
    change(model)
    assert not witness.unchanged()
    model2 = _Witnessed()
    witness2 = graph.Witness.of([model2])
    assert witness2 is not None
    model2.table = {"a": np.ones(1)}  # a numpy array: nothing to witness by identity
    assert not witness2.patch([(0, "table")])
