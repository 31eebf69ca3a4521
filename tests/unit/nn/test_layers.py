"""``autostate.nn`` layers: PyTorch's default initialisation, Sequential,
clear errors, and models built from the layers run eagerly, as ``f`` under
``jax.jit``, under ``jax.grad`` and after ``freeze`` with the same numbers."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autostate
from autostate import nn
from autostate.errors import InvalidArgumentError


def _spans_bound(w, bound):
    w = np.asarray(w)
    return np.abs(w).max() <= bound and np.abs(w).max() > 0.8 * bound


def test_default_initialisation_is_pytorchs():
    linear = nn.Linear(64, 32, key=0)
    assert linear.weight.shape == (32, 64) and linear.bias.shape == (32,)
    assert _spans_bound(linear.weight, 1 / 8) and _spans_bound(linear.bias, 1 / 8)
    assert nn.Linear(3, 2, bias=False, key=0).bias is None
    conv = nn.Conv2d(4, 8, 3, groups=2, key=0)
    assert conv.weight.shape == (8, 2, 3, 3)
    assert _spans_bound(conv.weight, 1 / math.sqrt(2 * 9))
    volume = nn.Conv3d(4, 6, (2, 3, 3), groups=2, key=0)
    assert volume.weight.shape == (6, 2, 2, 3, 3) and volume.bias.shape == (6,)
    assert _spans_bound(volume.weight, 1 / math.sqrt(2 * 18))
    assert _spans_bound(volume.bias, 1 / math.sqrt(2 * 18))
    up = nn.ConvTranspose2d(4, 6, 3, groups=2, key=0)
    assert up.weight.shape == (4, 3, 3, 3)  # [in, out / groups, kh, kw]
    assert _spans_bound(up.weight, 1 / math.sqrt(3 * 9)) and _spans_bound(up.bias, 1 / 3 / 3**0.5)
    table = nn.Embedding(200, 50, padding_idx=-1, key=0)
    assert table.padding_idx == 199 and not np.asarray(table.weight[199]).any()
    assert abs(float(table.weight[:199].std()) - 1.0) < 0.05
    bn = nn.BatchNorm2d(3)
    for name, value in [("weight", 1), ("bias", 0), ("running_mean", 0), ("running_var", 1)]:
        np.testing.assert_array_equal(getattr(bn, name), np.full(3, value, np.float32))
    assert bn.num_batches_tracked.dtype == jnp.int32 and int(bn.num_batches_tracked) == 0
    assert nn.LayerNorm(4, bias=False).bias is None and nn.RMSNorm((2, 3)).weight.shape == (2, 3)
    assert nn.Linear(2, 2, key=0, dtype=jnp.bfloat16).weight.dtype == jnp.bfloat16


def test_transformer_encoder_layer_is_torchs_names_shapes_and_initialisation():
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, key=0)
    shapes = {name: tuple(p.shape) for name, p in layer.named_parameters()}
    assert shapes == {  # torch.nn.TransformerEncoderLayer(16, 4, 32).named_parameters(), in order
        "self_attn.in_proj_weight": (48, 16),
        "self_attn.in_proj_bias": (48,),
        "self_attn.out_proj.weight": (16, 16),
        "self_attn.out_proj.bias": (16,),
        "linear1.weight": (32, 16),
        "linear1.bias": (32,),
        "linear2.weight": (16, 32),
        "linear2.bias": (16,),
        "norm1.weight": (16,),
        "norm1.bias": (16,),
        "norm2.weight": (16,),
        "norm2.bias": (16,),
    }
    assert list(shapes) == list(nn.torch_state_dict(layer))
    assert _spans_bound(layer.self_attn.in_proj_weight, math.sqrt(6 / (48 + 16)))
    assert _spans_bound(layer.self_attn.out_proj.weight, 1 / 4)
    assert _spans_bound(layer.linear1.weight, 1 / 4) and _spans_bound(layer.linear1.bias, 1 / 4)
    assert _spans_bound(layer.linear2.weight, 1 / math.sqrt(32))
    assert not np.asarray(layer.self_attn.in_proj_bias).any()
    assert not np.asarray(layer.self_attn.out_proj.bias).any()
    np.testing.assert_array_equal(layer.norm2.weight, np.ones(16, np.float32))
    assert (layer.dropout.p, layer.dropout1.p, layer.self_attn.dropout) == (0.1, 0.1, 0.1)
    assert nn.TransformerEncoderLayer(8, 2, bias=False, key=0).norm1.bias is None


def test_transformer_encoder_copies_the_layer_with_keys_of_its_own():
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, key=0)
    encoder = nn.TransformerEncoder(layer, 3, norm=nn.LayerNorm(8), key=1)
    assert len(encoder.layers) == 3 and encoder.num_layers == 3
    first, second = encoder.layers[0], encoder.layers[1]
    assert first is not layer and first.linear1 is not second.linear1
    np.testing.assert_array_equal(first.linear1.weight, layer.linear1.weight)
    np.testing.assert_array_equal(second.self_attn.in_proj_weight, layer.self_attn.in_proj_weight)
    data = [jax.random.key_data(m.dropout1.key) for m in (layer, first, second)]
    assert not np.array_equal(data[0], data[1]) and not np.array_equal(data[1], data[2])
    names = list(nn.torch_state_dict(encoder))
    assert names[0] == "layers.0.self_attn.in_proj_weight" and names[-1] == "norm.bias"
    assert len(names) == 3 * 12 + 2
    x = jax.random.normal(jax.random.key(0), (5, 2, 8))
    encoder.eval()
    expected = encoder.norm(encoder.layers[2](encoder.layers[1](encoder.layers[0](x))))
    np.testing.assert_allclose(encoder(x), expected, rtol=1e-6)
    causal = jnp.triu(jnp.ones((5, 5), bool), 1)
    np.testing.assert_allclose(  # is_causal without a mask applies the causal one
        encoder(x, is_causal=True), encoder(x, mask=causal), rtol=1e-6
    )


class StackedEncoder(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = autostate.stack(layers)

    def forward(self, x, padding):
        for layer in self.layers:
            x = layer(x, src_key_padding_mask=padding)
        return x


def test_a_stack_of_encoder_layers_rolls_and_means_the_list_of_them():
    def layers():
        keys = jax.random.split(jax.random.key(0), 3)
        return [nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, key=k) for k in keys]

    x = jax.random.normal(jax.random.key(1), (2, 5, 8))
    padding = jnp.arange(5)[None] >= jnp.array([[5], [3]])
    listed, f_model = layers(), StackedEncoder(layers())
    expected = x
    for layer in listed:  # training: each layer's own dropout masks
        expected = layer(expected, src_key_padding_mask=padding)
    f, states = f_model.functionalize()
    jaxpr = str(jax.make_jaxpr(lambda s: f(s, x, padding))(states))
    assert jaxpr.count("scan[") == 1  # one layer's program, whatever the depth
    out, _ = jax.jit(lambda f, s, x, p: f(s, x, p))(f, states, x, padding)
    compiled = StackedEncoder(layers())
    out_jit = autostate.jit(lambda m, x, p: m(x, p))(compiled, x, padding)
    for got in (StackedEncoder(layers())(x, padding), out, out_jit):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_sequential_indexes_iterates_and_names_its_layers():
    first, act, last = nn.Linear(3, 4, key=0), nn.ReLU(), nn.Linear(4, 2, key=1)
    net = nn.Sequential(first, act, last)
    assert len(net) == 3 and list(net) == [first, act, last]
    assert net[0] is first and net[-1] is last
    head = net[1:]
    assert isinstance(head, nn.Sequential) and head[1] is last
    x = jnp.ones((2, 3))
    np.testing.assert_allclose(net(x), last(act(first(x))))
    np.testing.assert_allclose(head(first(x)), net(x))
    assert sorted(autostate.param_dict(net)) == [
        "layers[0].bias",
        "layers[0].weight",
        "layers[2].bias",
        "layers[2].weight",
    ]


def test_sequential_changes_as_pytorchs():
    # Each step's names are what torch.nn.Sequential lists after the same step.
    seq = nn.Sequential(nn.Linear(2, 3, key=0), nn.ReLU(), nn.Linear(3, 1, key=1))
    assert seq.append(nn.Tanh()) is seq and seq.insert(0, nn.Identity()) is seq
    assert [name for name, _ in seq.named_modules()] == ["", "0", "1", "2", "3", "4"]
    assert type(seq.pop(0)).__name__ == "Identity"
    assert list(nn.torch_state_dict(seq)) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    del seq[1]
    seq[0] = nn.Linear(2, 5, key=2)
    assert list(nn.torch_state_dict(seq)) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert seq.extend([nn.ReLU()]) is seq and len(seq) == 4
    assert len(seq + seq) == len(seq * 2) == len(2 * seq) == 8
    seq.pop(-1)
    seq.pop(-1)
    seq[1] = nn.BatchNorm1d(5)
    out = autostate.jit(lambda m, x: m(x))(seq, jnp.ones((3, 2)))
    assert out.shape == (3, 5) and int(seq[1].num_batches_tracked) == 1
    with pytest.raises(IndexError):
        seq.insert(4, nn.ReLU())


def test_sequential_of_named_layers_runs_and_names_them_as_pytorchs():
    # torch: Sequential(OrderedDict(...)) and add_module add layers that forward
    # calls, named by their names; a slice keeps its layers' names.
    from collections import OrderedDict

    seq = nn.Sequential(OrderedDict([("conv0", nn.Conv2d(2, 3, 3, key=0)), ("norm0", nn.BatchNorm2d(3))]))
    seq.add_module("relu0", nn.ReLU())
    seq.add_module("flat", nn.Flatten())
    assert len(seq) == 4 and seq.conv0 is seq[0] and type(seq.flat).__name__ == "Flatten"
    assert list(nn.torch_state_dict(seq))[:3] == ["conv0.weight", "conv0.bias", "norm0.weight"]
    assert list(nn.torch_state_dict(seq[1:]))[0] == "norm0.weight"
    assert [name for name, _ in seq.named_modules()] == ["", "conv0", "norm0", "relu0", "flat"]
    x = jnp.ones((2, 2, 5, 5)).at[0].set(2.0)
    eager = seq(x)
    assert eager.shape == (2, 27)  # every layer ran, in order
    loaded = nn.load_torch_state_dict(seq, nn.torch_state_dict(seq))
    np.testing.assert_allclose(autostate.jit(lambda m, x: m(x))(loaded, x), eager, rtol=1e-6)
    with pytest.raises(AttributeError):
        _ = seq.conv1
    del seq[0]
    assert list(nn.torch_state_dict(seq))[0] == "0.weight"  # numbered anew, as torch does


def test_embedding_from_pretrained_and_torchs_signature():
    table = np.arange(12.0, dtype=np.float32).reshape(4, 3)
    emb = nn.Embedding.from_pretrained(table, freeze=False, padding_idx=1)
    assert (emb.num_embeddings, emb.embedding_dim, emb.padding_idx) == (4, 3, 1)
    np.testing.assert_array_equal(emb(jnp.array([[1, 3]])), table[[[1, 3]]])  # kept as given
    grad = autostate.grad(lambda m: m(jnp.array([0, 1, 1])).sum())(emb)
    np.testing.assert_array_equal(grad.weight, [[1.0] * 3, [0.0] * 3, [0.0] * 3, [0.0] * 3])
    # torch's positional arguments, defaults given explicitly
    dense = nn.Embedding(4, 3, None, None, 2.0, False, True, key=0)
    assert dense.weight.shape == (4, 3) and dense.sparse


def test_torchs_configuration_attributes():
    conv, up = nn.Conv2d(2, 4, 3, key=0), nn.ConvTranspose2d(2, 4, 3, key=0)
    assert (conv.transposed, conv.output_padding, conv.padding_mode) == (False, (0, 0), "zeros")
    assert up.transposed and up.padding_mode == "zeros"
    assert (nn.LSTM(3, 4, key=0).mode, nn.GRU(3, 4, key=0).mode, nn.GRU(3, 4, key=0).proj_size) == (
        "LSTM",
        "GRU",
        0,
    )


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: nn.Conv2d(4, 4, 3, stride=2, padding="same", key=0), "needs stride 1"),
        (lambda: nn.Conv2d(4, 4, 3, padding="full", key=0), "'same' or 'valid'"),
        (lambda: nn.Conv1d(4, 6, 3, groups=4, key=0), "must divide"),
        (lambda: nn.Conv2d(4, 4, (3, 3, 3), key=0), "2 ints"),
        (lambda: nn.Conv3d(4, 4, (3, 3), key=0), "3 ints"),
        (lambda: nn.Conv3d(2, 2, 3, key=0)(jnp.ones((5, 5, 5))), "5-d \\(batched\\)"),
        (lambda: nn.BatchNorm3d(2)(jnp.ones((2, 2, 4, 4))), "5-dimensional"),
        (lambda: nn.ConvTranspose2d(2, 2, 3, stride=2, output_padding=2, key=0), "output_padding"),
        (lambda: nn.Conv2d(2, 2, 3, padding_mode="mirror", key=0), "padding_mode='mirror'"),
        (lambda: nn.ConvTranspose2d(2, 2, 3, padding_mode="reflect", key=0), "padding_mode"),
        (lambda: nn.Conv2d(2, 2, 3, key=0)(jnp.ones((1, 1, 2, 5, 5))), "4-d \\(batched\\)"),
        (lambda: nn.GroupNorm(3, 4), "must divide"),
        (lambda: nn.GELU("fast"), "'none' or 'tanh'"),
        (lambda: nn.Embedding(4, 2, padding_idx=4, key=0), "outside"),
        (lambda: nn.Embedding(4, 2, max_norm=1.0, key=0), "max_norm"),
        (lambda: nn.Embedding(4, 2, scale_grad_by_freq=True, key=0), "scale_grad_by_freq"),
        (lambda: nn.Embedding.from_pretrained(jnp.ones((4, 2))), "freeze=True"),
        (lambda: nn.Embedding(4, 2, _weight=jnp.ones((3, 2))), "_weight has shape"),
        (lambda: nn.MaxPool2d(2, padding=2), "half of kernel_size"),
        (lambda: nn.MaxPool2d(2, return_indices=True), "return_indices"),
        (lambda: nn.AvgPool2d(2, divisor_override=0), "divisor_override=0"),
        (lambda: nn.AvgPool2d(2)(jnp.ones((4, 4))), "3-d \\(unbatched\\)"),
        (lambda: nn.BatchNorm2d(3)(jnp.ones((2, 3, 4))), "4-dimensional"),
        (lambda: nn.BatchNorm1d(3)(jnp.ones((1, 3))), "more than 1 value per channel"),
        (
            lambda: nn.BatchNorm1d(3, track_running_stats=False).eval()(jnp.ones((1, 3))),
            "more than 1 value per channel",
        ),
        (lambda: nn.BatchNorm1d(3)(jnp.ones((3, 5))), "got 5 channels"),
        (lambda: nn.Upsample(scale_factor=2, mode="bicubic"), "mode='bicubic'\\) is not built"),
        (lambda: nn.Upsample(), "either size or scale_factor"),
        (lambda: nn.Upsample(size=2, scale_factor=2), "either size or scale_factor"),
        (lambda: nn.Upsample(scale_factor=2, align_corners=True), "interpolating modes"),
        (
            lambda: nn.Upsample(scale_factor=2, mode="bilinear")(jnp.ones((2, 3, 4))),
            "takes a 4-d input",
        ),
        (lambda: nn.Upsample(size=(2, 3))(jnp.ones((1, 1, 4))), "has 2 entries"),
        (lambda: nn.Dropout2d(0.5, key=0)(jnp.ones((2, 3))), "3 or 4-d input"),
        (lambda: nn.Dropout1d(0.5, key=0)(jnp.ones((1, 2, 3, 3))), "2 or 3-d input"),
        (lambda: nn.MaxPool1d(2)(jnp.ones((1, 2, 3, 4))), "2-d \\(unbatched\\) or 3-d"),
        (lambda: nn.AvgPool1d(2, padding=2), "half of kernel_size"),
        (lambda: nn.MaxPool1d((2, 2)), "a 1-d pooling takes an int or a tuple of 1"),
        (lambda: nn.AdaptiveMaxPool2d(2, return_indices=True), "return_indices"),
        (lambda: nn.TransformerEncoderLayer(8, 2, activation="swish", key=0), "'relu' or 'gelu'"),
        (lambda: nn.TransformerEncoderLayer(8, 3, key=0), "divide by num_heads"),
        (  # a sequence-first model's padding mask is still [N, S]
            lambda: nn.TransformerEncoderLayer(8, 2, key=0)(
                jnp.ones((5, 2, 8)), src_key_padding_mask=jnp.zeros((5, 2), bool)
            ),
            r"key_padding_mask has shape \[5, 2\]; for these inputs it is \[2, 5\]",
        ),
        (
            lambda: nn.TransformerEncoderLayer(8, 2, key=0)(
                jnp.ones((5, 2, 8)), src_mask=jnp.zeros((2, 5, 5), bool)
            ),
            r"attn_mask has shape \[2, 5, 5\]; for these inputs it is \[5, 5\] or \[4, 5, 5\]",
        ),
    ],
)
def test_clear_errors(build, match):
    with pytest.raises(InvalidArgumentError, match=match):
        build()


@pytest.mark.parametrize(
    ("layer", "shape", "channel_axes"),
    [
        (nn.Dropout1d, (40, 16, 3), 2),
        (nn.Dropout1d, (300, 3), 1),  # unbatched [C, L]
        (nn.Dropout2d, (40, 16, 3, 2), 2),
        (nn.Dropout2d, (40, 16, 3), 2),  # PyTorch reads a 3-d input as [N, C, L]
    ],
)
def test_channel_dropout_zeroes_whole_channels(layer, shape, channel_axes):
    # torch's masks come from its own generator: what must match is the law,
    # whole channels kept (scaled by 1 / (1 - p)) or zeroed, and eval's identity.
    drop = layer(0.25, key=0)
    x = jnp.ones(shape)
    y = np.asarray(drop(x))
    per_channel = y.reshape(*shape[:channel_axes], -1)
    assert (per_channel.min(-1) == per_channel.max(-1)).all()
    np.testing.assert_allclose(np.unique(per_channel), [0.0, 1 / 0.75], rtol=1e-6)
    assert abs((per_channel[..., 0] == 0).mean() - 0.25) < 0.05
    assert not np.array_equal(drop(x), y)  # the key moved on
    f, states = layer(0.25, key=0).functionalize()
    out, _ = jax.jit(lambda f, s, x: f(s, x))(f, states, x)
    np.testing.assert_array_equal(out, y)  # the same draw in f under jax.jit
    np.testing.assert_array_equal(drop.eval()(x), x)


def test_batchnorm_of_one_sample_is_fine_in_eval():
    np.testing.assert_allclose(
        nn.BatchNorm1d(3).eval()(jnp.ones((1, 3))), np.ones((1, 3)), rtol=1e-5
    )


def cnn(key):
    # The layers with states (BatchNorm's statistics, Dropout's key) between a
    # few without, here and in TokenNet; every layer's own numbers, gradients
    # included, are PyTorch's in test_torch_parity.py, so more stateless layers
    # here would only add primitives to compile for the eager gradient.
    keys = nn.KeyStream(key)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1, key=keys),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Dropout(0.3, key=keys),
        nn.Linear(4, 3, key=keys),
    )


@autostate.stateful
class TokenNet:
    def __init__(self, key):
        keys = nn.KeyStream(key)
        self.embed = nn.Embedding(10, 4, padding_idx=0, key=keys)
        self.norm = nn.BatchNorm1d(4, momentum=None)
        self.conv = nn.Conv1d(4, 6, 3, padding=1, key=keys)
        self.drop = nn.Dropout(0.2, key=keys)
        self.head = nn.Linear(6, 10, key=keys)

    def __call__(self, tokens):
        x = self.embed(tokens).transpose(0, 2, 1)
        x = self.conv(self.norm(x)).transpose(0, 2, 1)
        return self.head(self.drop(x))


def upsampler(key):
    # Item by item, the layers a realistic decoder file adds: resizing,
    # channel dropout, smooth activations, log-probabilities.
    keys = nn.KeyStream(key)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1, key=keys),
        nn.BatchNorm2d(4),
        nn.Softplus(beta=2.0),
        nn.Dropout2d(0.3, key=keys),
        nn.Upsample(scale_factor=1.5, mode="bilinear"),
        nn.Upsample(size=(5, 4)),
        nn.Conv2d(4, 3, 1, key=keys),
        nn.AdaptiveMaxPool2d((3, None)),
        nn.LogSoftmax(dim=1),
    )


def signal(key):
    keys = nn.KeyStream(key)
    return nn.Sequential(
        nn.Conv1d(2, 4, 3, padding=1, key=keys),
        nn.BatchNorm1d(4),
        nn.ReLU(),
        nn.MaxPool1d(2, ceil_mode=True),
        nn.Dropout1d(0.2, key=keys),
        nn.AvgPool1d(3, stride=1, padding=1, count_include_pad=False),
        nn.AdaptiveAvgPool1d(4),
        nn.AdaptiveMaxPool1d(3),
        nn.Flatten(),
        nn.Linear(12, 3, key=keys),
    )


def volume(key):
    keys = nn.KeyStream(key)
    return nn.Sequential(
        nn.Conv3d(1, 2, 3, stride=2, padding=1, padding_mode="replicate", key=keys),
        nn.BatchNorm3d(2),
        nn.ReLU(),
        nn.Dropout(0.2, key=keys),
        nn.Flatten(),
        nn.Linear(16, 3, key=keys),
    )


@autostate.stateful
class Classifier:
    # A text classifier as a ported file writes it: padding masked in every
    # layer, dropout (attention included) and a norm with running statistics.
    def __init__(self, key):
        keys = nn.KeyStream(key)
        self.embed = nn.Embedding(10, 8, padding_idx=0, key=keys)
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1, batch_first=True, key=keys)
        self.encoder = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(8), key=keys)
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 3, key=keys)

    def __call__(self, tokens):
        padding = tokens == 0
        x = self.encoder(self.embed(tokens), src_key_padding_mask=padding)
        kept = (~padding)[..., None]
        pooled = (x * kept).sum(1) / jnp.maximum(kept.sum(1), 1)
        return self.head(self.norm(pooled))


CASES = {
    "cnn": (cnn, lambda k: jax.random.normal(k, (3, 1, 8, 8))),
    "upsampler": (upsampler, lambda k: jax.random.normal(k, (3, 2, 4, 3))),
    "signal": (signal, lambda k: jax.random.normal(k, (3, 2, 9))),
    "volume": (volume, lambda k: jax.random.normal(k, (3, 1, 4, 4, 4))),
    "classifier": (Classifier, lambda k: jax.random.randint(k, (3, 5), 0, 10).at[:, 0].set(1)),
    "tokens": (TokenNet, lambda k: jax.random.randint(k, (3, 5), 0, 10)),
}


def _assert_states_equal(model, states):
    frozen_states = autostate.state_dict(model)
    assert sorted(frozen_states) == sorted(states)
    for name, value in states.items():
        a, b = value, frozen_states[name]
        if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("case", sorted(CASES))
def test_eager_f_under_jit_grad_and_freeze_agree(case):
    build, data = CASES[case]
    inputs = [data(jax.random.key(i)) for i in range(2)]
    eager = build(1)
    f, states = build(1).functionalize()
    assert any(name.endswith("running_mean") for name in states)
    assert any(name.endswith("key") for name in states)
    step = jax.jit(lambda f, s, x: f(s, x))
    for x in inputs:
        out, states = step(f, states, x)
        np.testing.assert_allclose(out, eager(x), rtol=1e-5, atol=1e-6)
    _assert_states_equal(eager, states)

    def loss(f, states, x):
        out, states = f(states, x)
        return jnp.sum(out * jnp.arange(out.shape[-1])), states

    grads, after = jax.jit(jax.grad(loss, has_aux=True))(f, states, inputs[0])
    grads_eager, after_eager = jax.grad(loss, has_aux=True)(f, states, inputs[0])
    flat, flat_eager = jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(grads_eager)
    assert len(flat) == len(autostate.param_dict(eager)) and any(np.asarray(g).any() for g in flat)
    for g, h in zip(flat, flat_eager, strict=True):
        np.testing.assert_allclose(g, h, rtol=1e-4, atol=1e-6)
    frozen = autostate.freeze(f, states)
    out, after = step(f, states, inputs[0])
    np.testing.assert_allclose(frozen(inputs[0]), out, rtol=1e-5, atol=1e-6)
    _assert_states_equal(frozen, after)
    eager(inputs[0])
    _assert_states_equal(eager, after)
    frozen.eval()
    np.testing.assert_allclose(frozen(inputs[1]), eager.eval()(inputs[1]), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", sorted(CASES))
def test_autostate_jit_agrees_with_eager(case):
    build, data = CASES[case]
    eager, compiled = build(1), build(1)
    step = autostate.jit(lambda m, x: m(x))
    for i in range(2):
        x = data(jax.random.key(i))
        np.testing.assert_allclose(step(compiled, x), eager(x), rtol=1e-5, atol=1e-6)
    _assert_states_equal(eager, autostate.state_dict(compiled))
    x = data(jax.random.key(2))
    np.testing.assert_allclose(step(compiled.eval(), x), eager.eval()(x), rtol=1e-5, atol=1e-6)
