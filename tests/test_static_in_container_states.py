"""Python values inside container states are structure, not leaves of ``states``.

``self.shape = (2,)``, ``self.cfg = {"m": jnp.zeros(2), "name": "relu"}``,
``self.both = (Mode.A, jnp.zeros(()))``: the bools, ints, strings and enum
members inside such a state travel in the states dict's pytree structure
(``States``), so under ``jax.jit`` they are the Python values plain Python
sees (one trace per value), and a jitted call that assigns new ones returns
Python values. Python floats stay dynamic (weak float32 under jit), as does a
state whose whole value is a Python number.
"""

from __future__ import annotations

import pickle
import sys
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from differential import pair  # noqa: I001 - tests/ is on sys.path

import autostate

Loader = Callable[..., types.ModuleType]

SOURCE = """
import enum


class Mode(enum.Enum):
    A = 1
    B = 2


@DECORATE
class Shaped:
    def __init__(self):
        self.shape = (2,)
        self.w = jnp.ones(())

    def __call__(self, x):
        return jnp.zeros(self.shape) + x * self.w

    def grow(self):
        self.shape = (self.shape[0] + 1,)

    def measure(self, x):
        self.shape = (self.shape[0], x.sum())


@DECORATE
class Config:
    def __init__(self):
        self.cfg = {
            "m": jnp.zeros(2),
            "name": "relu",
            "scale": 0.5,
            "flags": [True, 1, None],
            "mode": (Mode.A, "x"),
        }

    def __call__(self, x):
        c = self.cfg
        act = jax.nn.relu if c["name"] == "relu" else jnp.tanh
        y = act(c["m"] + x) * c["scale"] * (2.0 if c["mode"][0] is Mode.A else 3.0)
        y = y + (1.0 if c["flags"][0] is True else 0.0) + c["flags"][1]
        self.cfg = {**c, "m": c["m"] + x, "scale": c["scale"] * 2}
        return y

    def switch(self):
        self.cfg = {**self.cfg, "name": "tanh", "mode": (Mode.B, "y"), "flags": [1, True, None]}
"""


@pytest.fixture
def mods(write_module: Loader) -> tuple[types.ModuleType, types.ModuleType]:
    return pair(write_module, SOURCE)


def same(expected: Any, got: Any) -> None:
    """Same structure, Python types and values; arrays by value."""
    e_leaves, e_def = jax.tree_util.tree_flatten(expected)
    g_leaves, g_def = jax.tree_util.tree_flatten(got)
    assert e_def == g_def, (expected, got)
    for a, b in zip(e_leaves, g_leaves):
        if isinstance(a, bool | int | str):
            assert type(a) is type(b) and a == b, (expected, got)
        else:
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


def python_values(value: Any) -> list[Any]:
    return [
        leaf
        for leaf in jax.tree_util.tree_leaves(dict(value) if isinstance(value, dict) else value)
        if isinstance(leaf, bool | int | str)
    ]


def counted_jit(fn: Callable[..., Any]) -> tuple[Callable[..., Any], list[int]]:
    traces: list[int] = []

    def traced(*a: Any) -> Any:
        traces.append(1)
        return fn(*a)

    return jax.jit(traced), traces


def test_a_tuple_of_ints_is_structure_under_jit_and_retraces_per_value(mods) -> None:
    plain, dec = mods
    ref, model = plain.Shaped(), dec.Shaped()
    f, states = model.functionalize()
    assert states == {"shape": (2,)} and isinstance(states, dict)
    assert jax.tree_util.tree_leaves(states) == []
    step, traces = counted_jit(lambda f, s, x: f(s, x))
    grow = jax.jit(lambda f, s: f.grow(s))
    for i in range(3):
        out, states = step(f, states, 1.5)
        same(ref(1.5), out)
        out, states = step(f, states, 2.5)  # same value: no new trace
        same(ref(2.5), out)
        _, states = grow(f, states)
        ref.grow()
        assert states["shape"] == ref.shape and type(states["shape"][0]) is int
        assert len(traces) == i + 1
    frozen = autostate.freeze(f, states)
    assert frozen.shape == (5,) and type(frozen.shape[0]) is int
    same(ref(1.0), frozen(1.0))


def test_a_tuple_of_ints_through_f_without_jit_and_eagerly(mods) -> None:
    plain, dec = mods
    ref, model = plain.Shaped(), dec.Shaped()
    model.grow()
    ref.grow()
    f, states = model.functionalize()
    _, states = f.grow(states)
    ref.grow()
    out, states = f(states, 1.0)
    same(ref(1.0), out)
    same(ref.shape, states["shape"])
    model = autostate.freeze(f, states)
    model.grow()
    ref.grow()
    same(ref.shape, model.shape)


def test_a_traced_value_assigned_into_the_container_is_an_array_as_in_plain_python(mods) -> None:
    plain, dec = mods
    ref = plain.Shaped()
    ref.measure(jnp.ones(3))
    f, states = dec.Shaped().functionalize()
    _, states = jax.jit(lambda f, s, x: f.measure(s, x))(f, states, jnp.ones(3))
    assert type(states["shape"][0]) is int and isinstance(states["shape"][1], jax.Array)
    same(ref.shape, states["shape"])
    same(ref.shape, autostate.freeze(f, states).shape)


def test_python_values_in_a_mixed_dict_state_under_jit(mods) -> None:
    plain, dec = mods
    ref, model = plain.Config(), dec.Config()
    f, states = model.functionalize()
    step, traces = counted_jit(lambda f, s, x: f(s, x))
    switch = jax.jit(lambda f, s: f.switch(s))
    x = jnp.array([0.5, -1.0])
    for _ in range(2):
        out, states = step(f, states, x)
        same(ref(x), out)
    assert len(traces) == 1
    # The Python float is a leaf (a weak float32 once it crossed jit), the rest structure.
    scale = states["cfg"]["scale"]
    assert isinstance(scale, jax.Array) and scale.weak_type and float(scale) == ref.cfg["scale"]
    assert python_values(states) == python_values(ref.cfg)
    _, states = switch(f, states)
    ref.switch()
    assert python_values(states) == python_values(ref.cfg)
    assert type(states["cfg"]["flags"][0]) is int and type(states["cfg"]["flags"][1]) is bool
    same(ref(x), step(f, states, x)[0])
    assert len(traces) == 2
    frozen = autostate.freeze(f, states)
    assert frozen.cfg["mode"][0] is dec.Mode.B and frozen.cfg["name"] == "tanh"


def test_true_and_one_inside_a_container_are_different_structures(mods) -> None:
    _, dec = mods
    a, b = dec.Config(), dec.Config()
    a.switch()
    b.switch()
    b.cfg = {**b.cfg, "flags": [True, True, None]}
    sa, sb = a.functionalize()[1], b.functionalize()[1]
    assert jax.tree_util.tree_structure(sa) != jax.tree_util.tree_structure(sb)


def test_an_eager_model_passed_to_jit_keeps_its_python_values(mods) -> None:
    plain, dec = mods
    model, ref = dec.Shaped(), plain.Shaped()
    model.grow()
    ref.grow()
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree_util.tree_leaves(model))
    same(ref(2.0), jax.jit(lambda m, x: m(x))(model, 2.0))
    doubled = jax.tree.map(lambda v: v * 2, model)
    assert doubled.shape == (3,) and float(doubled.w) == 2.0


def test_pickling_and_tree_maps_keep_the_python_values(mods, monkeypatch) -> None:
    _, dec = mods
    monkeypatch.setitem(sys.modules, dec.__name__, dec)  # (pair caches modules across tests)
    model = dec.Config()
    f, states = model.functionalize()
    back = pickle.loads(pickle.dumps(states))
    assert type(back) is type(states) and python_values(back) == python_values(states)
    mapped = jax.tree.map(lambda v: v + 1, states)
    assert type(mapped) is type(states) and mapped["cfg"]["name"] == "relu"
    assert float(mapped["cfg"]["scale"]) == 1.5
    copied = states.copy()
    assert type(copied) is type(states) and copied == states
    frozen = pickle.loads(pickle.dumps(autostate.freeze(f, states)))
    assert frozen.cfg["mode"] == (dec.Mode.A, "x") and frozen.cfg["flags"] == [True, 1, None]


def test_vmap_over_states_with_python_values(mods) -> None:
    plain, dec = mods
    f, states = dec.Config().functionalize()
    batch = jax.tree.map(lambda v: jnp.stack([v, v]), states)
    xs = jnp.array([[0.5, -1.0], [1.0, 2.0]])
    outs, new = jax.vmap(lambda s, x: f(s, x))(batch, xs)
    for i in range(2):
        ref = plain.Config()
        same(ref(xs[i]), outs[i])
    assert new["cfg"]["name"] == "relu" and new["cfg"]["mode"][0] is dec.Mode.A


def test_a_whole_python_number_in_an_array_state_stays_dynamic(write_module: Loader) -> None:
    _, dec = pair(
        write_module,
        """
@DECORATE
class Count:
    def __init__(self):
        self.n = jnp.zeros((), jnp.int32)
        self.pair = (0.5, jnp.ones(()))

    def __call__(self):
        self.n = self.n + 1
        self.pair = (self.pair[0] * 2, self.pair[1])
        return self.n
""",
    )
    model = dec.Count()
    model.n = 3  # an array state assigned a Python int keeps being a leaf
    f, states = model.functionalize()
    assert type(states) is dict  # no Python values inside containers: a plain dict
    step, traces = counted_jit(lambda f, s: f(s))
    _, states = step(f, states)
    _, states = step(f, states)
    assert int(states["n"]) == 5 and isinstance(states["n"], jax.Array) and len(traces) == 1
    assert isinstance(states["pair"][0], jax.Array) and float(states["pair"][0]) == 2.0
