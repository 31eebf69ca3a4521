"""Random keys of ``autostate.nn``: the default stream, explicit keys and
streams, Dropout's key state (once per call, in every context), ensembles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autostate
from autostate import nn
from autostate.errors import InvalidArgumentError, InvalidTypeError, StateAccessError


def _data(key):
    return np.asarray(jax.random.key_data(key))


def _advanced(key, calls):
    """Dropout's key after ``calls`` training calls: split once per call."""
    for _ in range(calls):
        key = jax.random.split(key)[0]
    return key


def _dropout(x, key, p):
    """What one training call with ``key`` gives, written out."""
    keep = jax.random.bernoulli(jax.random.split(key)[1], 1 - p, x.shape)
    return jnp.where(keep, x / (1 - p), 0.0)


def test_manual_seed_makes_the_default_stream_repeat():
    nn.manual_seed(7)
    a, b = nn.Linear(3, 3), nn.Dropout()
    nn.manual_seed(7)
    c, d = nn.Linear(3, 3), nn.Dropout()
    np.testing.assert_array_equal(a.weight, c.weight)
    np.testing.assert_array_equal(_data(b.key), _data(d.key))
    assert not np.array_equal(_data(b.key), _data(nn.Dropout().key))


def test_layers_without_a_key_never_share_one():
    first, second = nn.Dropout(0.5), nn.Dropout(0.5)
    assert not np.array_equal(_data(first.key), _data(second.key))
    x = jnp.ones(64)
    assert not np.array_equal(first(x), second(x))
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    assert not np.array_equal(a.weight, b.weight)


def test_a_key_a_seed_and_a_stream():
    key = jax.random.key(3)
    np.testing.assert_array_equal(_data(nn.Dropout(key=3).key), _data(key))
    np.testing.assert_array_equal(_data(nn.Dropout(key=key).key), _data(key))
    raw = jax.random.PRNGKey(3)  # a raw uint32[2] key
    np.testing.assert_array_equal(_data(nn.Dropout(key=raw).key), _data(key))
    stream = nn.KeyStream(3)
    keys = [_data(nn.Dropout(key=stream).key) for _ in range(3)]
    assert len({k.tobytes() for k in keys}) == 3
    np.testing.assert_array_equal(keys[1], _data(jax.random.fold_in(key, 1)))
    with pytest.raises(InvalidArgumentError, match="key= takes"):
        nn.Linear(2, 2, key="seed")


def test_building_without_a_key_inside_a_trace_is_refused():
    with pytest.raises(InvalidArgumentError, match="without a key"):
        jax.vmap(lambda k: nn.Linear(2, 2).weight)(jax.random.split(jax.random.key(0), 2))
    with pytest.raises(InvalidArgumentError, match="pass a key"):
        jax.jit(lambda: nn.Dropout().key)()


@autostate.stateful
class Member:
    def __init__(self, key):
        keys = nn.KeyStream(key)
        self.linear = nn.Linear(2, 4, key=keys)
        self.drop = nn.Dropout(0.5, key=keys)

    def __call__(self, x):
        return self.drop(self.linear(x))


@autostate.stateful
class _DrawsFromAStream(nn.Module):
    def __init__(self):
        super().__init__()
        self.keys = nn.KeyStream(0)
        self.fc = nn.Linear(3, 3, key=self.keys)

    def forward(self, x):
        return self.fc(x) + jax.random.normal(self.keys.next(), x.shape)


@autostate.stateful
class _DrawsFromAState(nn.Module):
    def __init__(self):
        super().__init__()
        keys = nn.KeyStream(0)
        self.fc = nn.Linear(3, 3, key=keys)
        self.key = jax.random.key(0)

    def forward(self, x):
        self.key, k = jax.random.split(self.key)
        return self.fc(x) + jax.random.normal(k, x.shape)


def test_a_stream_drawn_from_in_a_method_is_refused_with_the_key_as_a_state():
    # (the refusals said to decorate KeyStream, a class of autostate.nn)
    x = jnp.ones(3)
    with pytest.raises(InvalidTypeError, match="plain KeyStream") as err:
        _DrawsFromAStream().functionalize()
    with pytest.raises(StateAccessError, match="at _DrawsFromAStream.keys") as err2:
        autostate.jit(lambda m, x: m(x))(_DrawsFromAStream(), x)
    for refusal in (err.value, err2.value):
        assert "decorate" not in str(refusal), refusal
        assert "self.key, k = jax.random.split(self.key)" in str(refusal)
    # The way it names, in every mode.
    eager, twin = _DrawsFromAState(), _DrawsFromAState()
    f, states = _DrawsFromAState().functionalize()
    step = autostate.jit(lambda m, x: m(x))
    for _ in range(2):
        out, states = jax.jit(f)(states, x)
        np.testing.assert_allclose(out, eager(x), rtol=1e-6)
        np.testing.assert_allclose(step(twin, x), out, rtol=1e-6)


def test_each_member_of_a_vmapped_ensemble_has_its_own_keys():
    keys = jax.random.split(jax.random.key(0), 3)
    ensemble = jax.vmap(Member)(keys)
    assert ensemble.linear.weight.shape == (3, 4, 2)
    weights = np.asarray(ensemble.linear.weight)
    drop_keys = _data(ensemble.drop.key)
    assert drop_keys.shape[0] == 3
    for i in range(3):
        for j in range(i):
            assert not np.array_equal(weights[i], weights[j])
            assert not np.array_equal(drop_keys[i], drop_keys[j])
    # Each member is the model built with its own key.
    second = Member(keys[1])
    np.testing.assert_array_equal(weights[1], second.linear.weight)
    np.testing.assert_array_equal(drop_keys[1], _data(second.drop.key))
    f, states = ensemble.functionalize()
    x = jnp.ones((5, 2))
    out, new = jax.vmap(lambda f, s: f(s, x))(f, states)
    np.testing.assert_array_equal(out[1], second(x))
    np.testing.assert_array_equal(_data(new["drop.key"])[1], _data(second.drop.key))


def test_dropout_eagerly_splits_its_key_once_per_training_call():
    drop = nn.Dropout(0.25, key=5)
    x = jnp.arange(1.0, 33.0)
    key = jax.random.key(5)
    for _ in range(2):
        y = drop(x)
        # (x * (1 / 0.75) and x / 0.75 may differ in the last bit, as jax 0.12 runs them)
        np.testing.assert_allclose(y, _dropout(x, key, 0.25), rtol=1e-6)
        key = _advanced(key, 1)
        np.testing.assert_array_equal(_data(drop.key), _data(key))
    drop.eval()
    np.testing.assert_array_equal(drop(x), x)
    np.testing.assert_array_equal(_data(drop.key), _data(key))  # evaluation draws nothing


def test_dropout_in_f_under_jit_returns_the_advanced_key():
    f, states = nn.Dropout(0.5, key=2).functionalize()
    step = jax.jit(lambda f, s, x: f(s, x))
    x = jnp.ones(16)
    y, states = step(f, states, x)
    np.testing.assert_allclose(y, _dropout(x, jax.random.key(2), 0.5))
    _, states = step(f, states, x)
    np.testing.assert_array_equal(_data(states["key"]), _data(_advanced(jax.random.key(2), 2)))


@autostate.stateful
class Scanned:
    def __init__(self):
        self.drop = nn.Dropout(0.5, key=4)

    def __call__(self, x):
        def body(carry, _):
            return self.drop(carry), None

        y, _ = jax.lax.scan(body, x, None, length=3)
        return y


@autostate.stateful
class Checkpointed:
    def __init__(self):
        self.drop = nn.Dropout(0.5, key=4)

    def __call__(self, x):
        return jax.checkpoint(lambda v: self.drop(v) * 3.0)(x)


def _three_calls(x):
    key = jax.random.key(4)
    for _ in range(3):
        x = _dropout(x, key, 0.5)
        key = _advanced(key, 1)
    return x


def test_dropout_in_a_scan_body_splits_once_per_step():
    x = jnp.arange(1.0, 17.0)
    model = Scanned()
    np.testing.assert_allclose(model(x), _three_calls(x))
    np.testing.assert_array_equal(_data(model.drop.key), _data(_advanced(jax.random.key(4), 3)))
    f, states = Scanned().functionalize()
    y, states = jax.jit(lambda f, s, x: f(s, x))(f, states, x)
    np.testing.assert_allclose(y, _three_calls(x))
    np.testing.assert_array_equal(_data(states["drop.key"]), _data(_advanced(jax.random.key(4), 3)))


def test_dropout_in_a_checkpoint_body_splits_once_even_under_grad():
    x = jnp.arange(1.0, 9.0)
    model = Checkpointed()
    np.testing.assert_allclose(model(x), 3.0 * _dropout(x, jax.random.key(4), 0.5))
    np.testing.assert_array_equal(_data(model.drop.key), _data(_advanced(jax.random.key(4), 1)))
    f, states = Checkpointed().functionalize()

    def loss(x, states):
        y, states = f(states, x)
        return y.sum(), states

    grad, states = jax.jit(jax.grad(loss, has_aux=True))(x, states)
    kept = np.asarray(_dropout(jnp.ones(8), jax.random.key(4), 0.5)) != 0
    np.testing.assert_allclose(grad, np.where(kept, 6.0, 0.0))
    np.testing.assert_array_equal(_data(states["drop.key"]), _data(_advanced(jax.random.key(4), 1)))


@pytest.mark.parametrize("p", [0.0, 1.0])
def test_dropout_edges(p):
    drop = nn.Dropout(p, key=0)
    x = jnp.arange(1.0, 5.0)
    y = drop(x)
    np.testing.assert_array_equal(y, x if p == 0 else jnp.zeros(4))
    f, states = drop.functionalize()
    grad = jax.grad(lambda x: f(states, x)[0].sum())(x)
    np.testing.assert_array_equal(grad, jnp.full(4, 1.0 - p))
    with pytest.raises(InvalidArgumentError, match="between 0 and 1"):
        nn.Dropout(1.5)
