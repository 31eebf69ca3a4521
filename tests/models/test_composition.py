"""Composition and aliasing: sub-models in attributes and containers; shared instances.

A sub-model may sit in an attribute, a list, a tuple or a dict; its states
are named by the path (``heads['a'].count``, ``stack[0][0].count``). One
instance reachable from two paths has one state, named by its first path,
and both paths see each other's writes, eagerly and under ``jax.jit``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import autostate

from . import zoo
from .checks import assert_states_close, assert_trees_close, eager_states, jit_call, read_path

HEADS_NAMES = [
    "heads['a'].count",
    "heads['b'].count",
    "pair[0].count",
    "pair[1].h",
    "single.count",
    "stack[0][0].count",
    "stack[1]['inner'].count",
]


def test_sub_models_in_containers_are_named_by_their_paths():
    f, states = zoo.Heads().functionalize()
    assert sorted(states) == sorted(HEADS_NAMES)
    mlp_states = zoo.MLP(jax.random.PRNGKey(0), [2, 3, 2]).functionalize()[1]
    assert sorted(mlp_states) == [
        "blocks[0].bn.mean",
        "blocks[0].bn.var",
        "blocks[1].bn.mean",
        "blocks[1].bn.var",
    ]


def test_sub_models_in_containers_eager_equals_jit():
    eager = zoo.Heads()
    f, states = zoo.Heads().functionalize()
    for x in (1.0, 2.0, -0.5):
        out, states = jit_call(f, states, jnp.float32(x))
        assert_trees_close(out, eager(jnp.float32(x)))
    assert_states_close(states, eager_states(eager, HEADS_NAMES))
    assert int(read_path(eager, "heads['b'].count")) == 3

    frozen = autostate.freeze(f, states)
    assert type(frozen.heads["a"]) is zoo.Counter
    assert type(frozen.pair) is tuple and type(frozen.stack[1]) is dict
    assert_states_close(eager_states(frozen, HEADS_NAMES), states)
    assert_states_close(frozen.functionalize()[1], states)


# --- a shared counter and a tied embedding -----------------------------------


def test_one_instance_on_several_paths_has_one_state_named_by_its_first_path():
    model = zoo.SharedModel(jax.random.PRNGKey(0))
    assert model.encoder.counter is model.decoder.counter is model.steps
    f, states = model.functionalize()
    assert sorted(states) == ["encoder.counter.count", "encoder.embed.uses"]
    assert f.model.encoder.counter is f.model.decoder.counter is f.model.steps
    assert f.model.encoder.embed is f.model.decoder.embed


def test_shared_instances_see_each_others_writes_eagerly_and_under_jit():
    x = jnp.array([1.0, -1.0, 0.5])
    eager = zoo.SharedModel(jax.random.PRNGKey(0))
    f, states = zoo.SharedModel(jax.random.PRNGKey(0)).functionalize()
    for step in range(1, 4):
        out, states = jit_call(f, states, x)
        eager_out = eager(x)
        assert_trees_close(out, eager_out)
        # Two counter calls and `steps.count += 10`, read back through `encoder`.
        assert int(out[1]) == 12 * step
        assert int(out[2]) == 2 * step
    assert int(states["encoder.counter.count"]) == 36
    assert int(states["encoder.embed.uses"]) == 6

    # Eagerly, a write from outside through one path shows through the others.
    eager.steps.count = jnp.int32(100)
    assert int(eager.encoder.counter.count) == 100
    eager.decoder.counter.count += 1
    assert int(eager.steps.count) == 101
    eager.encoder.embed.uses *= 3
    assert int(eager.decoder.embed.uses) == 18


def test_freeze_keeps_shared_instances_shared_even_after_sgd_steps():
    x = jnp.array([1.0, -1.0, 0.5])
    f, states = zoo.SharedModel(jax.random.PRNGKey(0)).functionalize()

    def loss(f, states):
        (y, _, _), states = f(states, x)
        return jnp.sum(y**2), states

    @jax.jit
    def train_step(f, states):
        grads, states = jax.grad(loss, has_aux=True)(f, states)
        return jax.tree_util.tree_map(lambda p, g: p - 0.01 * g, f, grads), states

    for _ in range(2):
        f, states = train_step(f, states)
    frozen = autostate.freeze(f, states)
    assert frozen.encoder.counter is frozen.decoder.counter is frozen.steps
    assert frozen.encoder.embed is frozen.decoder.embed
    assert int(frozen.steps.count) == 24
    frozen.decoder.counter.count += 1
    assert int(frozen.encoder.counter.count) == 25
    f2, states2 = frozen.functionalize()
    assert sorted(states2) == sorted(states)


def test_tied_weights_are_one_leaf_with_one_summed_gradient():
    model = zoo.SharedModel(jax.random.PRNGKey(0))
    f, states = model.functionalize()
    assert len(jax.tree_util.tree_leaves(f)) == 1
    x = jnp.array([1.0, -1.0, 0.5])

    def loss(f, states):
        (y, _, _), states = f(states, x)
        return jnp.sum(jnp.sin(y)), states

    grads, _ = jax.jit(jax.grad(loss, has_aux=True))(f, states)
    hand = jax.grad(lambda table: jnp.sum(jnp.sin((x @ table) @ table)))(model.encoder.embed.table)
    assert_trees_close(grads.model.encoder.embed.table, hand)
    assert grads.model.decoder.embed is grads.model.encoder.embed


def test_a_shared_weight_that_is_state_is_updated_through_both_paths():
    x = jax.random.normal(jax.random.PRNGKey(1), (8, 2))
    eager = zoo.TiedQuantizer(jax.random.PRNGKey(2))
    f, states = zoo.TiedQuantizer(jax.random.PRNGKey(2)).functionalize()
    assert list(states) == ["first.codes"]
    for _ in range(3):
        out, states = jit_call(f, states, x)
        eager_out = eager(x)
        assert_trees_close(out, eager_out)
        # The second path's write is what the first path reads back.
        assert_trees_close(out[1], states["first.codes"])
    np.testing.assert_allclose(states["first.codes"], eager.second["book"].codes, rtol=1e-5)
    frozen = autostate.freeze(f, states)
    assert frozen.first is frozen.second["book"]
    assert_trees_close(frozen(x), eager(x))
