"""Eager mode: decorated models behave like the plain Python they are.

Public methods mutate in place; ``model.x`` from outside is the current
value; code outside the class (a helper, a training loop) reads, assigns and
``+=``s ``model.x`` like plain Python, both eagerly and inside a
functionalized call. Under ``jax.jit`` / ``grad`` / ``vmap`` without
``functionalize()`` a model that would keep a tracer raises
``TracedEagerStateError`` and keeps its previous state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autostate
from autostate.errors import TracedEagerStateError

from . import zoo
from .checks import assert_trees_close, jit_call


def test_call_mutates_in_place_and_attributes_show_the_current_value():
    counter = zoo.Counter()
    assert int(counter.count) == 0
    assert float(counter(2.0)) == 2.0
    assert int(counter.count) == 1
    assert float(counter(2.0)) == 4.0
    assert int(counter.count) == 2


def test_every_public_method_mutates_in_place():
    rnn = zoo.RNNCell(jax.random.PRNGKey(0), 2, 3)
    h = rnn(jnp.ones(2))
    np.testing.assert_array_equal(rnn.h, h)
    assert np.abs(np.asarray(rnn.h)).sum() > 0
    rnn.reset()
    np.testing.assert_array_equal(rnn.h, np.zeros(3))
    rnn.reset(h=jnp.full(3, 0.5))
    np.testing.assert_array_equal(rnn.h, np.full(3, 0.5))

    decoder = zoo.Decoder(jax.random.PRNGKey(1), 4, 5)
    decoder(jnp.ones((1, 4)))
    decoder(jnp.ones((1, 4)))
    assert int(decoder.pos) == 2
    assert np.abs(np.asarray(decoder.k_cache[:, :2])).sum() > 0
    np.testing.assert_array_equal(decoder.k_cache[:, 2:], 0)
    decoder.reset()
    assert int(decoder.pos) == 0
    np.testing.assert_array_equal(decoder.k_cache, 0)

    ema = zoo.EMA({"w": jnp.zeros(2)})
    ema({"w": jnp.ones(2)})
    np.testing.assert_allclose(ema.shadow["w"], [0.1, 0.1], rtol=1e-6)
    np.testing.assert_allclose(ema.debiased()["w"], [1.0, 1.0], rtol=1e-6)
    assert int(ema.updates) == 1


def test_a_training_loop_reads_assigns_and_augments_state_from_outside():
    bn = zoo.BatchNorm(2)
    x = jnp.array([[1.0, 2.0], [3.0, 6.0]])
    for _ in range(2):
        bn(x)
    # Read: the running mean after two updates of momentum 0.9 toward [2, 4].
    np.testing.assert_allclose(bn.mean, np.array([2.0, 4.0]) * (1 - 0.9**2), rtol=1e-6)
    # Assign, then augmented-assign, from outside; the methods see it.
    bn.mean = jnp.array([10.0, 20.0])
    bn.mean += 1.0
    bn.var *= 4.0
    np.testing.assert_array_equal(bn.mean, [11.0, 21.0])
    out = bn(x, train=False)
    expected = (x - jnp.array([11.0, 21.0])) / jnp.sqrt(bn.var + bn.eps)
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    # Static config set from outside changes behaviour like plain Python.
    mlp = zoo.MLP(jax.random.PRNGKey(0), [2, 3])
    zoo.set_training(mlp, False)
    mean_before = mlp.blocks[0].bn.mean
    mlp(x)
    np.testing.assert_array_equal(mlp.blocks[0].bn.mean, mean_before)
    zoo.set_training(mlp, True)
    mlp(x)
    assert not np.array_equal(mlp.blocks[0].bn.mean, mean_before)


def test_a_helper_outside_the_class_behaves_like_plain_python_eagerly():
    counter = zoo.Counter()
    counter(1.0)
    before = zoo.bump_counter(counter, 2)
    assert int(before) == 1
    assert int(counter.count) == (1 + 2) * 2


def _uses_helper_reference(x_values):
    """``UsesHelper`` written without classes, as plain Python on ints."""
    inner, count, log, outs = 0, 0, 0.0, []
    for x in x_values:
        before_inner, inner = inner, (inner + 3) * 2
        before_self, count = count, (count + 1) * 2
        log += x * inner
        outs.append(before_inner + before_self + count)
    return outs, inner, count, log


def test_helpers_called_from_a_method_work_eagerly_and_functionalized():
    xs = [1.0, 2.0, 3.0]
    ref_outs, ref_inner, ref_count, ref_log = _uses_helper_reference(xs)

    model = zoo.UsesHelper()
    outs = [model(x) for x in xs]
    assert [int(o) for o in outs] == ref_outs
    assert (int(model.inner.count), int(model.count)) == (ref_inner, ref_count)
    assert float(model.log) == pytest.approx(ref_log)

    f, states = zoo.UsesHelper().functionalize()
    assert sorted(states) == ["count", "inner.count", "log"]
    for x, ref in zip(xs, ref_outs):
        out, states = jit_call(f, states, x)
        assert int(out) == ref
    assert (int(states["inner.count"]), int(states["count"])) == (ref_inner, ref_count)
    assert float(states["log"]) == pytest.approx(ref_log)


def test_a_sub_model_passed_to_a_helper_inside_a_functionalized_call():
    """``SharedModel.bump`` hands a sub-model reachable from two paths to a helper."""
    eager = zoo.SharedModel(jax.random.PRNGKey(0))
    f, states = zoo.SharedModel(jax.random.PRNGKey(0)).functionalize()
    bump = jax.jit(lambda f, s, by: f.bump(s, by=by))
    expected = 0
    for by in (2, 5):
        expected = (expected + by) * 2
        out, states = bump(f, states, by)
        assert int(out) == expected
        assert int(eager.bump(by=by)) == expected
    assert int(states["encoder.counter.count"]) == expected
    assert int(eager.steps.count) == expected


# --- transformations without functionalize ---------------------------------


def _rnn():
    return zoo.RNNCell(jax.random.PRNGKey(0), 2, 3)


TRANSFORMS = {
    "jit": lambda model: jax.jit(lambda x: model(x))(jnp.ones(2)),
    "grad": lambda model: jax.grad(lambda x: model(x).sum())(jnp.ones(2)),
    "vmap": lambda model: jax.vmap(lambda x: model(x))(jnp.ones((4, 2))),
    "jit_of_method": lambda model: jax.jit(lambda h: model.reset(h))(jnp.ones(3)),
    "jit_assign_from_outside": lambda model: jax.jit(lambda h: setattr(model, "h", h))(jnp.ones(3)),
    "jit_augment_from_outside": lambda model: jax.jit(_augment_h(model))(jnp.ones(3)),
}


def _augment_h(model):
    def augment(h):
        model.h += h

    return augment


@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
def test_transforms_without_functionalize_raise_a_clear_error(transform):
    model = _rnn()
    model(jnp.full(2, 0.5))
    h_before = np.asarray(model.h)
    with pytest.raises(TracedEagerStateError, match=r"functionalize\(\)") as info:
        TRANSFORMS[transform](model)
    assert isinstance(info.value, (autostate.AutostateError, RuntimeError))
    assert 'fallback="host"' in str(info.value)
    # No tracer leaked into the model: it still holds and runs on its old state.
    assert not isinstance(model.h, jax.core.Tracer)
    np.testing.assert_array_equal(model.h, h_before)
    model(jnp.ones(2))
    assert not isinstance(model.h, jax.core.Tracer)


@pytest.mark.parametrize(
    "make, arg",
    [
        (lambda: zoo.BatchNorm(3), jnp.ones((4, 3))),
        (lambda: zoo.Decoder(jax.random.PRNGKey(0), 3, 4), jnp.ones((1, 3))),
        (lambda: zoo.Dropout(jax.random.PRNGKey(0)), jnp.ones(3)),
        (lambda: zoo.MLP(jax.random.PRNGKey(0), [3, 2]), jnp.ones((4, 3))),
    ],
)
def test_jit_without_functionalize_raises_for_zoo_models(make, arg):
    model = make()
    f, before = model.functionalize()
    with pytest.raises(TracedEagerStateError, match=r"functionalize\(\)"):
        jax.jit(lambda x: model(x))(arg)
    _, after = model.functionalize()
    assert_trees_close(after, before)


def test_reading_state_under_jit_is_allowed():
    """Reads embed the current value as a constant; nothing is stored."""
    bn = zoo.BatchNorm(2)
    bn.mean = jnp.array([1.0, 2.0])
    out = jax.jit(lambda x: bn(x, train=False))(jnp.ones((3, 2)))
    np.testing.assert_allclose(out, bn(jnp.ones((3, 2)), train=False), rtol=1e-6)
    np.testing.assert_array_equal(bn.mean, [1.0, 2.0])
