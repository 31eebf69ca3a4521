"""Packed dispatch (``autostate/packing.py``): same numbers as ``f``, fewer buffers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autostate
from autostate.errors import InvalidTypeError


@autostate.stateful
class Tiny:
    def __init__(self, w, b):
        self.w = jnp.asarray(w)
        self.b = jnp.asarray(b)
        self.count = jnp.zeros((), jnp.int32)
        self.total = jnp.zeros(4)

    def __call__(self, x):
        self.count = self.count + 1
        self.total = self.total + x
        return x * self.w + self.b

    def peek(self, x):
        return self.total * x


@autostate.stateful
class Stack:
    def __init__(self, n):
        rng = np.random.default_rng(0)
        self.layers = [
            Tiny(rng.normal(size=4).astype(np.float32), rng.normal(size=(2, 4)).astype(np.float32))
            for _ in range(n)
        ]
        self.scale = jnp.asarray(2.0)  # weak-typed: a buffer of its own

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)[0]
        return x * self.scale


def close(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_packed_step_gives_the_numbers_of_the_unpacked_one():
    f, states = Stack(5).functionalize()
    pf, pstates = autostate.pack(f, states)
    # float32 and weak float32 parameters, float32 and int32 states.
    assert len(pf.buffers) == 2 and pf.loose == []
    assert len(pstates.buffers) == 2 and pstates.loose == []
    assert pf.f.model.scale.weak_type and not pf.f.model.layers[0].w.weak_type
    step = jax.jit(lambda f, s, x: f(s, x))
    x = jnp.arange(4.0)
    for _ in range(3):
        out, states = step(f, states, x)
        pout, pstates = step(pf, pstates, x)
        close(out, pout)
        close(states, pstates.unpack())
    assert pstates.unpack().keys() == states.keys()


def test_eager_calls_of_the_packed_model():
    f, states = Stack(2).functionalize()
    pf, pstates = autostate.pack(f, states)
    x = jnp.ones(4)
    out, new = f(states, x)
    pout, pnew = pf(pstates, x)
    close(out, pout)
    close(new, pnew.unpack())


def test_grad_and_optax_style_updates_work_on_the_packed_model():
    f, states = Stack(3).functionalize()
    pf, pstates = autostate.pack(f, states)
    x = jnp.arange(4.0)

    def loss(f, s):
        out, _ = f(s, x)
        return jnp.sum(out**2)

    g = jax.jit(jax.grad(loss))(f, states)
    pg = jax.jit(jax.grad(loss))(pf, pstates)
    assert isinstance(pg, autostate.PackedModel)
    np.testing.assert_allclose(
        np.concatenate([np.ravel(v) for v in jax.tree_util.tree_leaves(pg.unpack())]),
        np.concatenate([np.ravel(v) for v in jax.tree_util.tree_leaves(g)]),
        rtol=1e-6,
    )
    updated = jax.tree_util.tree_map(lambda p, d: p - 0.1 * d, pf, pg)
    expected = jax.tree_util.tree_map(lambda p, d: p - 0.1 * d, f, g)
    close(updated.unpack(), expected)


def test_freeze_takes_the_packed_pair():
    model = Stack(2)
    f, states = model.functionalize()
    pf, pstates = autostate.pack(f, states)
    _, pstates = jax.jit(lambda f, s, x: f(s, x))(pf, pstates, jnp.ones(4))
    frozen = autostate.freeze(pf, pstates)
    assert isinstance(frozen, Stack)
    assert int(frozen.layers[1].count) == 1
    np.testing.assert_array_equal(np.asarray(frozen.layers[0].w), np.asarray(model.layers[0].w))


def test_the_layout_of_returned_states_is_the_one_passed_in():
    f, states = Stack(2).functionalize()
    pf, pstates = autostate.pack(f, states)
    step = jax.jit(lambda f, s, x: f(s, x))
    _, new = step(pf, pstates, jnp.ones(4))
    assert new.layout is pstates.layout


def test_a_packed_model_refuses_an_unpacked_states_dict():
    f, states = Stack(1).functionalize()
    pf, _ = autostate.pack(f, states)
    with pytest.raises(InvalidTypeError, match="PackedStates"):
        pf(states, jnp.ones(4))


def test_other_methods_are_called_through_the_packed_model():
    f, states = Tiny(np.ones(4, np.float32), np.ones(4, np.float32)).functionalize()
    _, states = f(states, jnp.arange(4.0))
    pf, pstates = autostate.pack(f, states)
    out, new = jax.jit(lambda f, s: f.peek(s, 3.0))(pf, pstates)
    expected, expected_states = f.peek(states, 3.0)
    close(out, expected)
    close(new.unpack(), expected_states)


def test_leaves_that_are_not_arrays_travel_on_their_own():
    from autostate.packing import Layout

    leaves, treedef = jax.tree_util.tree_flatten([jnp.ones(2), 3, jnp.zeros((2, 2))])
    layout = Layout.of(leaves, treedef)
    buffers, loose = layout.pack(leaves)
    assert len(buffers) == 1 and loose == [3]
    close(layout.unpack(buffers, loose), leaves)
