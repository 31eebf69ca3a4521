"""Mixed precision in ``autostate.nn``: ``dtype`` computes, ``param_dtype`` stores.

Every layer with parameters, built with ``dtype=bfloat16, param_dtype=float32``,
keeps its parameters (and running statistics) in float32, returns bfloat16,
agrees with the float32 layer within bfloat16's precision, and its gradients
with respect to the float32 parameters are float32. ``dtype=bfloat16`` alone
keeps PyTorch's meaning: bfloat16 parameters.

The tolerances are bfloat16's (8 significant bits, a few 1e-2 after a layer),
on every backend: they are far wider than any backend's float32 difference,
so ``tests/tolerance.py``'s policy (which is about float32) has nothing to add.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autostate
from autostate import nn
from autostate.errors import InvalidArgumentError

BF16, F32 = jnp.bfloat16, jnp.float32


def _first(out: Any) -> jax.Array:
    """The main output of a layer's call (the output of ``(output, extra)``)."""
    return out[0] if isinstance(out, tuple) else out


def _normal(*shape: int) -> Callable[[], jax.Array]:
    return lambda: jax.random.normal(jax.random.key(1), shape)


# name: (build(**dtypes), input, call(layer, x) -> output array)
LAYERS: dict[str, tuple[Callable[..., Any], Callable[[], jax.Array], Callable[[Any, jax.Array], jax.Array]]] = {
    "Linear": (lambda **d: nn.Linear(6, 5, key=0, **d), _normal(4, 6), lambda m, x: m(x)),
    "Conv1d": (lambda **d: nn.Conv1d(3, 4, 3, padding=1, key=0, **d), _normal(2, 3, 7), lambda m, x: m(x)),
    "Conv2d": (lambda **d: nn.Conv2d(3, 4, 3, stride=2, key=0, **d), _normal(2, 3, 8, 8), lambda m, x: m(x)),
    "ConvTranspose2d": (
        lambda **d: nn.ConvTranspose2d(3, 2, 3, stride=2, key=0, **d), _normal(1, 3, 4, 4), lambda m, x: m(x)
    ),
    "Embedding": (
        lambda **d: nn.Embedding(10, 4, padding_idx=0, key=0, **d),
        lambda: jnp.array([[0, 3, 9]]),
        lambda m, x: m(x),
    ),
    "BatchNorm1d": (lambda **d: nn.BatchNorm1d(3, **d), _normal(8, 3), lambda m, x: m(x * 3 + 1)),
    "BatchNorm2d": (lambda **d: nn.BatchNorm2d(3, **d), _normal(4, 3, 5, 5), lambda m, x: m(x * 3 + 1)),
    "BatchNorm2d-eval": (
        lambda **d: nn.BatchNorm2d(3, **d).eval(), _normal(4, 3, 5, 5), lambda m, x: m(x * 3 + 1)
    ),
    "LayerNorm": (lambda **d: nn.LayerNorm(6, **d), _normal(4, 6), lambda m, x: m(x * 3 + 1)),
    "GroupNorm": (lambda **d: nn.GroupNorm(2, 4, **d), _normal(3, 4, 5), lambda m, x: m(x * 3 + 1)),
    "RMSNorm": (lambda **d: nn.RMSNorm(6, eps=1e-6, **d), _normal(4, 6), lambda m, x: m(x * 3)),
    "MultiheadAttention": (
        lambda **d: nn.MultiheadAttention(8, 2, batch_first=True, key=0, **d),
        _normal(2, 5, 8),
        lambda m, x: m(x, x, x, is_causal=True)[0],
    ),
    "MultiheadAttention-cache": (
        lambda **d: nn.MultiheadAttention(8, 2, batch_first=True, max_len=6, key=0, **d),
        _normal(1, 5, 8),
        lambda m, x: m(x, x, x)[0],
    ),
    "LSTMCell": (lambda **d: nn.LSTMCell(4, 5, key=0, **d), _normal(3, 4), lambda m, x: m(x)[0]),
    "GRUCell": (lambda **d: nn.GRUCell(4, 5, key=0, **d), _normal(3, 4), lambda m, x: m(x)),
    "LSTM": (
        lambda **d: nn.LSTM(4, 5, num_layers=2, bidirectional=True, key=0, **d),
        _normal(6, 2, 4),
        lambda m, x: m(x)[0],
    ),
    "GRU": (lambda **d: nn.GRU(4, 5, batch_first=True, key=0, **d), _normal(2, 6, 4), lambda m, x: m(x)[0]),
}


def _arrays(layer: Any) -> dict[str, jax.Array]:
    """Every floating array the layer holds: parameters and states (running statistics, caches)."""
    everything = {**autostate.param_dict(layer), **autostate.state_dict(layer)}
    return {k: v for k, v in everything.items() if jnp.issubdtype(v.dtype, jnp.floating)}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_bf16_compute_with_float32_parameters(name):
    build, data, call = LAYERS[name]
    x = data()
    reference = build()
    mixed = build(dtype=BF16, param_dtype=F32)
    assert mixed.dtype == BF16 and mixed.param_dtype == F32
    for key, value in autostate.param_dict(mixed).items():
        assert value.dtype == F32, key
        np.testing.assert_array_equal(value, autostate.param_dict(reference)[key])  # the same init
    expected = call(reference, x)
    out = call(mixed, x)
    assert out.dtype == BF16
    np.testing.assert_allclose(np.asarray(out, np.float32), expected, rtol=5e-2, atol=5e-2)
    # Running statistics stay float32 after a call (the KV cache holds bf16 activations).
    for key, value in _arrays(mixed).items():
        assert value.dtype == (BF16 if key.endswith("_cache") else F32), key
    for key, value in autostate.state_dict(reference).items():
        if jnp.issubdtype(value.dtype, jnp.floating) and not key.endswith("_cache"):
            np.testing.assert_allclose(autostate.state_dict(mixed)[key], value, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_gradients_of_float32_parameters_are_float32(name):
    build, data, call = LAYERS[name]
    x = data()

    def loss(layer, x):
        out = call(layer, x).astype(F32)
        return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape)))

    # Compiled: the dtypes are JAX's in both modes, and one program per model
    # costs a fraction of eager JAX's one per primitive (an LSTM: 7 against 18 s).
    grad = autostate.jit(autostate.grad(loss))
    grads = autostate.param_dict(grad(build(dtype=BF16, param_dtype=F32), x))
    expected = autostate.param_dict(grad(build(), x))
    assert sorted(grads) == sorted(expected)
    for key, g in grads.items():
        assert g.dtype == F32, key
        scale = float(jnp.abs(expected[key]).max()) + 1e-3
        np.testing.assert_allclose(g, expected[key], atol=0.1 * scale, err_msg=key)


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_dtype_alone_is_the_parameters_dtype_as_in_pytorch(name):
    build, data, call = LAYERS[name]
    layer = build(dtype=BF16)
    assert layer.param_dtype is None
    for key, value in _arrays(layer).items():
        assert value.dtype == BF16, key
    x = data()
    out = call(layer, x.astype(BF16) if jnp.issubdtype(x.dtype, jnp.floating) else x)
    assert out.dtype == BF16
    for key, value in _arrays(layer).items():  # running statistics keep their dtype
        assert value.dtype == BF16, key


@pytest.mark.parametrize("dtypes", [{"dtype": "float33"}, {"param_dtype": jnp.int32}, {"dtype": object}])
def test_a_dtype_that_is_not_floating_is_a_clear_error(dtypes):
    with pytest.raises(InvalidArgumentError, match=r"Linear\((param_)?dtype=.*must be a floating dtype"):
        nn.Linear(2, 3, key=0, **dtypes)


def test_norm_statistics_are_computed_in_float32():
    # A bf16 mean of these values loses the offset; float32 statistics keep it.
    x = (1000.0 + jnp.arange(8.0)).astype(BF16)
    out = nn.LayerNorm(8, dtype=BF16, param_dtype=F32)(x)
    expected = nn.LayerNorm(8)(x.astype(F32))
    np.testing.assert_allclose(np.asarray(out, np.float32), expected, rtol=2e-2, atol=2e-2)


class Net(nn.Module):
    def __init__(self, **dtypes: Any):
        self.embed = nn.Embedding(10, 8, key=0, **dtypes)
        self.batch_norm = nn.BatchNorm1d(8, **dtypes)
        self.norm = nn.LayerNorm(8, **dtypes)
        self.head = nn.Linear(8, 10, key=1, **dtypes)

    def forward(self, tokens: jax.Array) -> jax.Array:
        return self.head(self.norm(self.batch_norm(self.embed(tokens))))


def test_a_jit_training_step_keeps_parameters_and_adam_moments_float32():
    model = Net(dtype=BF16, param_dtype=F32)
    optimizer = autostate.Optimizer(model, optax.adam(1e-2))
    tokens = jnp.arange(10) % 7

    def loss_fn(model, tokens):
        logits = model(tokens).astype(F32)  # the loss in float32
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()

    @autostate.jit
    def step(model, optimizer, tokens):
        loss, grads = autostate.value_and_grad(loss_fn)(model, tokens)
        optimizer.update(grads)
        return loss

    losses = [float(step(model, optimizer, tokens)) for _ in range(30)]
    assert losses[-1] < losses[0] / 2
    for key, value in autostate.param_dict(model).items():
        assert value.dtype == F32, key
    moments = [leaf for leaf in jax.tree_util.tree_leaves(optimizer.opt_state) if leaf.ndim > 0]
    assert len(moments) == 2 * len(autostate.param_dict(model))  # mu and nu per parameter
    assert all(leaf.dtype == F32 for leaf in moments)
    states = autostate.state_dict(model)  # running statistics written back by the compiled step
    assert states["batch_norm.running_mean"].dtype == F32 and int(states["batch_norm.num_batches_tracked"]) == 30
    assert model(tokens).dtype == BF16
