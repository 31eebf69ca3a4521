"""``functionalize`` / ``freeze`` on the zoo: methods, kwargs, grad, SGD, vmap, categories, lazy.

Gradients and SGD steps are checked against the same computation written by
hand in pure JAX on plain arrays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autostate
from autostate.effects import InitialLocalStateRequest
from autostate.errors import CategoryArgumentError, TracedEagerStateError

from . import zoo
from .checks import assert_states_close, assert_trees_close, jit_call

SIZES = [3, 5, 2]
MOMENTUM, EPS = 0.9, 1e-5


def _data(seed: int, batch: int = 6):
    kx, kt = jax.random.split(jax.random.PRNGKey(seed))
    return jax.random.normal(kx, (batch, SIZES[0])), jax.random.normal(kt, (batch, SIZES[-1]))


# --- the MLP by hand --------------------------------------------------------


def _hand_params(model: zoo.MLP) -> list[dict[str, jax.Array]]:
    return [
        {"w": b.linear.w, "b": b.linear.b, "scale": b.bn.scale, "bias": b.bn.bias}
        for b in model.blocks
    ]


def _hand_states(model: zoo.MLP) -> list[dict[str, jax.Array]]:
    return [{"mean": b.bn.mean, "var": b.bn.var} for b in model.blocks]


def _hand_mlp(params, states, x, train=True):
    new_states = []
    for p, s in zip(params, states):
        h = x @ p["w"] + p["b"]
        if train:
            m, v = h.mean(0), h.var(0)
            new_states.append(
                {
                    "mean": MOMENTUM * s["mean"] + (1 - MOMENTUM) * m,
                    "var": MOMENTUM * s["var"] + (1 - MOMENTUM) * v,
                }
            )
        else:
            m, v = s["mean"], s["var"]
            new_states.append(s)
        x = jax.nn.relu((h - m) / jnp.sqrt(v + EPS) * p["scale"] + p["bias"])
    return x, new_states


def _hand_loss(params, states, x, target):
    y, states = _hand_mlp(params, states, x)
    return jnp.mean((y - target) ** 2), states


def _loss(f, states, x, target):
    y, states = f(states, x)
    return jnp.mean((y - target) ** 2), states


def _as_named_states(hand_states) -> dict[str, jax.Array]:
    return {
        f"blocks[{i}].bn.{k}": v for i, s in enumerate(hand_states) for k, v in s.items()
    }


def _params_of(f) -> list[dict[str, jax.Array]]:
    return _hand_params(f.model)


# --- methods and kwargs -------------------------------------------------------


def test_calling_a_non_call_method_functionally():
    rnn = zoo.RNNCell(jax.random.PRNGKey(0), 2, 3)
    f, states = rnn.functionalize()
    _, states = jit_call(f, states, jnp.ones(2))
    assert np.abs(np.asarray(states["h"])).sum() > 0

    out, cleared = jax.jit(lambda f, s: f.reset(s))(f, states)
    np.testing.assert_array_equal(out, np.zeros(3))
    np.testing.assert_array_equal(cleared["h"], np.zeros(3))

    out, chosen = jax.jit(lambda f, s, h: f.reset(s, h=h))(f, states, jnp.full(3, 0.25))
    np.testing.assert_array_equal(chosen["h"], np.full(3, 0.25))
    # The model f came from is untouched.
    np.testing.assert_array_equal(rnn.h, np.zeros(3))

    ema = zoo.EMA({"w": jnp.zeros(2)})
    f, states = ema.functionalize()
    _, states = jit_call(f, states, {"w": jnp.ones(2)})
    debiased, same = jax.jit(lambda f, s: f.debiased(s))(f, states)
    np.testing.assert_allclose(debiased["w"], [1.0, 1.0], rtol=1e-6)
    assert_states_close(same, states)


def test_kwargs_reach_the_method():
    model = zoo.MLP(jax.random.PRNGKey(0), SIZES)
    x, _ = _data(0)
    f, states = model.functionalize()
    _, trained = jit_call(f, states, x)
    out, unchanged = jax.jit(lambda f, s, x: f(s, x, train=False))(f, trained, x)
    assert_states_close(unchanged, trained)
    hand_trained = [
        {"mean": trained[f"blocks[{i}].bn.mean"], "var": trained[f"blocks[{i}].bn.var"]}
        for i in range(len(SIZES) - 1)
    ]
    expected, _ = _hand_mlp(_hand_params(model), hand_trained, x, train=False)
    assert_trees_close(out, expected)


def test_function_form_of_functionalize():
    model = zoo.RNNCell(jax.random.PRNGKey(0), 2, 3)
    f1, s1 = autostate.functionalize(model)
    f2, s2 = model.functionalize()
    assert_states_close(s1, s2)
    assert_trees_close(jax.tree_util.tree_leaves(f1), jax.tree_util.tree_leaves(f2))


# --- grad and SGD -------------------------------------------------------------


def test_parameters_are_the_leaves_of_f_named_by_their_paths():
    f, _ = zoo.MLP(jax.random.PRNGKey(0), SIZES).functionalize()
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(f)[0]]
    for i in range(len(SIZES) - 1):
        for name in (f"blocks[{i}].linear.w", f"blocks[{i}].bn.scale"):
            assert any(name in p for p in paths), (name, paths)
    assert not any("mean" in p or "var" in p for p in paths)


def test_grad_with_respect_to_f_matches_hand_written_jax():
    model = zoo.MLP(jax.random.PRNGKey(0), SIZES)
    x, target = _data(1)
    f, states = model.functionalize()
    grads, new_states = jax.jit(jax.grad(_loss, has_aux=True))(f, states, x, target)
    assert type(grads) is type(f)

    hand_grads, hand_states = jax.grad(_hand_loss, has_aux=True)(
        _hand_params(model), _hand_states(model), x, target
    )
    assert_trees_close(_params_of(grads), hand_grads)
    assert_states_close(new_states, _as_named_states(hand_states))
    assert any(np.abs(np.asarray(g["w"])).sum() > 0 for g in hand_grads)


def test_sgd_loop_with_tree_map_matches_hand_written_jax():
    lr = 0.1
    model = zoo.MLP(jax.random.PRNGKey(0), SIZES)

    @jax.jit
    def train_step(f, states, x, target):
        (loss, states), grads = jax.value_and_grad(_loss, has_aux=True)(f, states, x, target)
        f = jax.tree_util.tree_map(lambda p, g: p - lr * g, f, grads)
        return f, states, loss

    @jax.jit
    def hand_step(params, states, x, target):
        (loss, states), grads = jax.value_and_grad(_hand_loss, has_aux=True)(
            params, states, x, target
        )
        params = jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads)
        return params, states, loss

    f, states = model.functionalize()
    params, hand_states = _hand_params(model), _hand_states(model)
    losses = []
    for step in range(5):
        x, target = _data(10 + step)
        f, states, loss = train_step(f, states, x, target)
        params, hand_states, hand_loss = hand_step(params, hand_states, x, target)
        np.testing.assert_allclose(loss, hand_loss, rtol=1e-5)
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    assert_trees_close(_params_of(f), params)
    assert_states_close(states, _as_named_states(hand_states))

    trained = autostate.freeze(f, states)
    assert type(trained) is zoo.MLP
    assert_trees_close(_hand_params(trained), params)
    assert_trees_close(_hand_states(trained), hand_states)
    # The original model was not trained.
    assert not np.allclose(model.blocks[0].linear.w, trained.blocks[0].linear.w)


# --- vmap -------------------------------------------------------------------------


def test_vmap_over_a_batch_axis_of_the_inputs():
    rnn = zoo.RNNCell(jax.random.PRNGKey(0), 2, 3)
    f, states = rnn.functionalize()
    _, states = jit_call(f, states, jnp.ones(2))
    xs = jax.random.normal(jax.random.PRNGKey(1), (5, 2))
    batched = jax.jit(jax.vmap(lambda f, s, x: f(s, x), in_axes=(None, None, 0)))
    outs, new_states = batched(f, states, xs)
    assert outs.shape == (5, 3) and new_states["h"].shape == (5, 3)
    for i in range(5):
        out_i, states_i = f(states, xs[i])
        assert_trees_close(outs[i], out_i)
        assert_trees_close(new_states["h"][i], states_i["h"])

    decoder = zoo.Decoder(jax.random.PRNGKey(2), 4, 3)
    f, states = decoder.functionalize()
    xs = jax.random.normal(jax.random.PRNGKey(3), (6, 1, 4))
    outs, new_states = jax.vmap(lambda f, s, x: f(s, x), in_axes=(None, None, 0))(f, states, xs)
    assert new_states["k_cache"].shape == (6, 1, 3, 4)
    for i in range(6):
        out_i, states_i = jit_call(f, states, xs[i])
        assert_trees_close(outs[i], out_i)
        assert_trees_close(new_states["pos"][i], states_i["pos"])
        assert_trees_close(new_states["k_cache"][i], states_i["k_cache"])


# --- categories ---------------------------------------------------------------


def test_categories_select_which_states_are_handled():
    tracker = zoo.Tracker(2)
    assert sorted(tracker.functionalize()[1]) == ["calls", "total"]
    assert sorted(tracker.functionalize("cache")[1]) == ["total"]
    assert sorted(tracker.functionalize("stats")[1]) == ["calls"]
    assert sorted(tracker.functionalize(category_predicate=lambda c: c != "cache")[1]) == [
        "calls"
    ]
    assert tracker.functionalize("state")[1] == {}
    # A plain class's states have the default category "state".
    counter = zoo.Counter()
    assert sorted(counter.functionalize("state")[1]) == ["count"]
    assert counter.functionalize("stats")[1] == {}


def test_unhandled_categories_stay_requests_and_keep_working_eagerly():
    eager = zoo.Tracker(2)
    f, states = zoo.Tracker(2).functionalize("cache")
    assert isinstance(f.model.__dict__["calls"], InitialLocalStateRequest)
    xs = [jnp.array([1.0, 2.0]), jnp.array([3.0, 0.0]), jnp.array([-1.0, 4.0])]
    for x in xs:
        out, states = f(states, x)
        assert_trees_close(out, eager(x))
    assert int(f.model.calls) == 3
    np.testing.assert_allclose(states["total"], eager.total, rtol=1e-6)

    frozen = autostate.freeze(f, states)
    assert type(frozen) is zoo.Tracker
    assert int(frozen.calls) == 3
    all_states = frozen.functionalize()[1]
    assert sorted(all_states) == ["calls", "total"]
    assert int(all_states["calls"]) == 3


def test_jit_with_an_unhandled_category_that_is_written_raises():
    f, states = zoo.Tracker(2).functionalize("cache")
    with pytest.raises(TracedEagerStateError, match=r"functionalize\(\)"):
        jit_call(f, states, jnp.ones(2))


def test_category_and_predicate_together_are_rejected():
    with pytest.raises(CategoryArgumentError):
        zoo.Tracker(2).functionalize("cache", category_predicate=lambda c: True)


# --- lazy ---------------------------------------------------------------------


def test_lazy_returns_a_thunk_of_the_same_states():
    model = zoo.MLP(jax.random.PRNGKey(0), SIZES)
    f_lazy, thunk = model.functionalize(lazy=True)
    f, states = model.functionalize()
    assert callable(thunk) and not isinstance(thunk, dict)
    assert_states_close(thunk(), states)
    x, _ = _data(2)
    out_lazy, states_lazy = jit_call(f_lazy, thunk(), x)
    out, states = jit_call(f, states, x)
    assert_trees_close(out_lazy, out)
    assert_states_close(states_lazy, states)
