"""``autostate.nn.attention``: MultiheadAttention against PyTorch, and its KV cache."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autostate
from autostate import nn
from autostate.errors import InvalidArgumentError
from tests.unit.nn.sequence_fixtures import TOLERANCE, Fixture, assert_close


@pytest.mark.parametrize("name", ["mha_self_causal", "mha_cross_masks", "mha_kvdim_unbatched"])
def test_outputs_and_gradients_equal_torch(name: str) -> None:
    fixture = Fixture(name)
    layer = fixture.load(nn.MultiheadAttention(**fixture.config, key=0))
    given = {k: jnp.asarray(v) for k, v in fixture.kind("input").items()}
    masks = {k: given.pop(k) for k in ("attn_mask", "key_padding_mask") if k in given}

    outputs, param_grads, input_grads = fixture.loss_and_grads(layer, given, masks)

    assert_close(outputs, fixture.kind("output"))
    assert_close(param_grads, fixture.kind("grad.param"))
    expected = fixture.kind("grad.input")
    if name == "mha_self_causal":  # torch's query, key and value were one tensor: its gradient is the sum
        total = input_grads["query"] + input_grads["key"] + input_grads["value"]
        input_grads = {k: total for k in input_grads}
    assert_close(input_grads, expected)


def test_default_initialisation_is_torchs() -> None:
    layer = nn.MultiheadAttention(8, 2, key=0)
    assert float(jnp.abs(layer.in_proj_weight).max()) <= math.sqrt(6 / (8 + 24))  # Xavier-uniform
    assert float(jnp.abs(layer.out_proj.weight).max()) <= 1 / math.sqrt(8)  # a Linear's
    assert not bool(layer.in_proj_bias.any()) and not bool(layer.out_proj.bias.any())
    separate = nn.MultiheadAttention(6, 3, kdim=4, vdim=5, bias=False, key=0)
    assert sorted(autostate.param_dict(separate)) == ["k_proj_weight", "out_proj.weight", "q_proj_weight", "v_proj_weight"]


@autostate.stateful
class Decoder:
    """A causal self-attention decoder that generates with a ``fori_loop`` over its cache."""

    def __init__(self, max_len: int) -> None:
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True, max_len=max_len, cache_batch_size=2, key=0)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.attn(x, x, x, need_weights=False)[0]

    def decode(self, xs: jax.Array) -> jax.Array:
        """Feeds ``xs[:, t]`` one position per step; returns every step's output."""

        def step(t: jax.Array, outs: jax.Array) -> jax.Array:
            x = jax.lax.dynamic_slice_in_dim(xs, t, 1, axis=1)
            return jax.lax.dynamic_update_slice_in_dim(outs, self(x), t, axis=1)

        return jax.lax.fori_loop(0, xs.shape[1], step, jnp.zeros_like(xs))


def _causal_reference(x: jax.Array) -> jax.Array:
    full = nn.MultiheadAttention(8, 2, batch_first=True, key=0)  # the same weights, no cache
    return full(x, x, x, is_causal=True)[0]


def test_cache_decoding_one_token_at_a_time_equals_the_causal_forward_eagerly() -> None:
    x = jax.random.normal(jax.random.key(1), (2, 5, 8))
    expected = _causal_reference(x)
    decoder = Decoder(max_len=6)
    steps = [decoder(x[:, t : t + 1]) for t in range(5)]
    np.testing.assert_allclose(jnp.concatenate(steps, axis=1), expected, **TOLERANCE)
    assert int(decoder.attn.cache_pos) == 5

    decoder.attn.reset_cache()  # a prompt of 3, then one token
    prompt = decoder(x[:, :3])
    token = decoder(x[:, 3:4])
    np.testing.assert_allclose(jnp.concatenate([prompt, token], axis=1), expected[:, :4], **TOLERANCE)
    weights = decoder.attn(x[:, 4:5], x[:, 4:5], x[:, 4:5])[1]
    assert weights.shape == (2, 1, 6)
    assert not bool(weights[..., 5].any())  # nothing attends past the positions written


def test_cache_decoding_in_a_fori_loop_through_f_under_jit() -> None:
    x = jax.random.normal(jax.random.key(1), (2, 5, 8))
    expected = _causal_reference(x)
    f, states = Decoder(max_len=5).functionalize()
    assert sorted(states) == ["attn.cache_pos", "attn.k_cache", "attn.v_cache"]

    out, new_states = jax.jit(f.decode)(states, x)
    np.testing.assert_allclose(out, expected, **TOLERANCE)
    assert int(new_states["attn.cache_pos"]) == 5

    # f itself inside a fori_loop written outside the model: the states are the carry.
    def decode_outside(states: dict[str, Any], xs: jax.Array) -> tuple[jax.Array, dict[str, Any]]:
        def step(t: jax.Array, carry: tuple[jax.Array, dict[str, Any]]) -> tuple[jax.Array, dict[str, Any]]:
            outs, states = carry
            out, states = f(states, jax.lax.dynamic_slice_in_dim(xs, t, 1, axis=1))
            return jax.lax.dynamic_update_slice_in_dim(outs, out, t, axis=1), states

        return jax.lax.fori_loop(0, xs.shape[1], step, (jnp.zeros_like(xs), states))

    out, new_states = jax.jit(decode_outside)(states, x)
    np.testing.assert_allclose(out, expected, **TOLERANCE)
    np.testing.assert_allclose(new_states["attn.k_cache"], jax.jit(f.decode)(states, x)[1]["attn.k_cache"])


def test_writing_past_max_len_is_an_error_eagerly_and_nan_under_jit() -> None:
    decoder = Decoder(max_len=2)
    x = jnp.ones((2, 3, 8))
    with pytest.raises(InvalidArgumentError, match=r"past max_len=2.*\n.*\n.*reset_cache\(\)"):
        decoder(x)
    f, states = decoder.functionalize()
    step = jax.jit(f)
    for _ in range(2):
        out, states = step(states, x[:, :1])
        assert not bool(jnp.isnan(out).any())
    out, states = step(states, x[:, :1])  # the position is traced: no error, NaN
    assert bool(jnp.isnan(out).all())
    decoder.attn.reset_cache(batch_size=1)
    assert decoder.attn.k_cache.shape == (1, 2, 8)
    assert not bool(jnp.isnan(decoder(x[:1, :2])).any())


def test_refusals() -> None:
    with pytest.raises(InvalidArgumentError, match="divide by num_heads"):
        nn.MultiheadAttention(8, 3, key=0)
    with pytest.raises(InvalidArgumentError, match="add_bias_kv"):
        nn.MultiheadAttention(8, 2, add_bias_kv=True, key=0)
    with pytest.raises(InvalidArgumentError, match="no KV cache"):
        nn.MultiheadAttention(8, 2, key=0).reset_cache()
    cached = nn.MultiheadAttention(8, 2, max_len=4, key=0)
    x = jnp.ones((1, 1, 8))
    with pytest.raises(InvalidArgumentError, match="masks causally"):
        cached(x, x, x, attn_mask=jnp.zeros((1, 1), bool))
    x = jnp.ones((1, 2, 8))  # [L, N, E]: two sequences
    with pytest.raises(InvalidArgumentError, match=r"holds 1 sequences.*\n.*\n.*reset_cache\(batch_size=2\)"):
        cached(x, x, x)


def test_attention_dropout_in_training_only() -> None:
    x = jax.random.normal(jax.random.key(1), (3, 2, 8))
    plain = nn.MultiheadAttention(8, 2, key=0)
    dropping = nn.MultiheadAttention(8, 2, dropout=0.5, key=0)
    expected, expected_weights = plain(x, x, x, average_attn_weights=False)
    out, weights = dropping(x, x, x, average_attn_weights=False)
    # torch's weights are returned after dropout: zeros, and the rest scaled by 2
    kept = weights != 0
    assert 0 < float(kept.mean()) < 1
    np.testing.assert_allclose(weights[kept], 2 * expected_weights[kept], **TOLERANCE)
    assert not np.allclose(out, expected)
    dropping.eval()
    np.testing.assert_allclose(dropping(x, x, x)[0], expected, **TOLERANCE)


def test_a_torch_checkpoint_loads_into_a_cached_decoder() -> None:
    """The cache is a non-persistent buffer: in no torch state_dict, and not expected by the loader."""
    fixture = Fixture("mha_self_causal")
    cached = nn.MultiheadAttention(**fixture.config, max_len=5, cache_batch_size=2, key=0)
    decoder = nn.load_torch_state_dict(cached, fixture.kind("param"))
    assert sorted(nn.torch_state_dict(decoder)) == sorted(fixture.kind("param"))
    x = jnp.asarray(fixture.kind("input")["query"])  # [L, N, E]
    steps = [decoder(x[t : t + 1], x[t : t + 1], x[t : t + 1])[0] for t in range(2)]
    expected, _ = fixture.load(nn.MultiheadAttention(**fixture.config, key=0))(x[:2], x[:2], x[:2], is_causal=True)
    np.testing.assert_allclose(jnp.concatenate(steps), expected, **TOLERANCE)


def test_torchs_attributes_of_the_unused_layout_are_none():
    # torch registers the layout it does not use, and bias_k / bias_v, as None:
    # ported init code tests them (`if m.in_proj_weight is not None`).
    packed = nn.MultiheadAttention(8, 2, key=0)
    split = nn.MultiheadAttention(8, 2, kdim=4, key=0)
    assert packed.q_proj_weight is packed.k_proj_weight is packed.v_proj_weight is None
    assert split.in_proj_weight is None and split.q_proj_weight.shape == (8, 8)
    assert packed.bias_k is packed.bias_v is None and packed.add_zero_attn is False
    names = ["q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias"]
    assert list(nn.torch_state_dict(split))[:4] == names
