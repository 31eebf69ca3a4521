"""PyTorch ``state_dict`` names (``autostate.nn.torch_io``), against checkpoints torch wrote.

The ``.npz`` fixtures come from ``tests/fixtures/torch/make_checkpoints.py``:
each holds a module's ``state_dict()`` (``sd/<name>``), an input and the
module's eval-mode output. The models below have the same structure and
attribute names, built from ``autostate.nn`` layers the way the PyTorch
modules are built from ``torch.nn``.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autostate
import autostate.nn as nn
from autostate.errors import StateDictError, StateDictWarning
from autostate.nn.torch_io import load_torch_state_dict, torch_state_dict

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "torch"


def _fixture(name: str) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    with np.load(FIXTURES / f"{name}.npz") as z:
        sd = {k[3:]: z[k] for k in z.files if k.startswith("sd/")}
        return sd, z["input"], z["output"]


# --- models with PyTorch's structure and names, from autostate.nn ------------------


@autostate.stateful
class BasicBlock:
    def __init__(self, n_in, n_out, stride=1, downsample=None):
        self.conv1 = nn.Conv2d(n_in, n_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(n_out)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(n_out, n_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(n_out)
        self.downsample = downsample

    def __call__(self, x):
        shortcut = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(y)) + shortcut)


@autostate.stateful
class TinyResNet:
    def __init__(self):
        self.conv1 = nn.Conv2d(3, 8, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.layer1 = nn.Sequential(BasicBlock(8, 8), BasicBlock(8, 8))
        down = nn.Sequential(nn.Conv2d(8, 16, 1, 2, bias=False), nn.BatchNorm2d(16))
        self.layer2 = nn.Sequential(BasicBlock(8, 16, 2, down))
        self.fc = nn.Linear(16, 10)

    def __call__(self, x):
        x = self.layer2(self.layer1(self.relu(self.bn1(self.conv1(x)))))
        return self.fc(x.mean((2, 3)))


@autostate.stateful
class Embedding:
    def __init__(self, n, d):
        self.weight = jnp.zeros((n, d))

    def __call__(self, idx):
        return self.weight[idx]


@autostate.stateful
class LayerNorm:
    def __init__(self, d):
        self.weight = jnp.ones(d)
        self.bias = jnp.zeros(d)

    def __call__(self, x):
        m, v = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - m) / jnp.sqrt(v + 1e-5) * self.weight + self.bias


@autostate.stateful
class CausalSelfAttention:
    def __init__(self, d, heads):
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.n_head = heads

    def __call__(self, x):
        b, t, c = x.shape
        q, k, v = jnp.split(self.c_attn(x), 3, axis=-1)
        q, k, v = (z.reshape(b, t, self.n_head, -1).transpose(0, 2, 1, 3) for z in (q, k, v))
        att = q @ k.transpose(0, 1, 3, 2) / math.sqrt(k.shape[-1])
        att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -jnp.inf)
        y = jax.nn.softmax(att, -1) @ v
        return self.c_proj(y.transpose(0, 2, 1, 3).reshape(b, t, c))


@autostate.stateful
class MLP:
    def __init__(self, d):
        self.c_fc = nn.Linear(d, 4 * d)
        self.c_proj = nn.Linear(4 * d, d)

    def __call__(self, x):
        return self.c_proj(jax.nn.gelu(self.c_fc(x), approximate=False))


@autostate.stateful
class Block:
    def __init__(self, d, heads):
        self.ln_1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = MLP(d)

    def __call__(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


@autostate.stateful
class TinyGPT:
    def __init__(self, vocab=32, block=8, layers=2, heads=2, d=16, stacked=False):
        blocks = [Block(d, heads) for _ in range(layers)]
        self.transformer = {
            "wte": nn.Embedding(vocab, d),
            "wpe": nn.Embedding(block, d),
            "h": autostate.stack(blocks) if stacked else blocks,
            "ln_f": nn.LayerNorm(d),
        }
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.transformer["wte"].weight  # tied, as nanoGPT ties them

    def __call__(self, idx):
        t = self.transformer
        x = t["wte"](idx) + t["wpe"](jnp.arange(idx.shape[1]))
        for block in t["h"]:
            x = block(x)
        return self.lm_head(t["ln_f"](x))


def _forward(model, x):
    """The model's output, compiled once (eager JAX compiles every op on its own)."""
    f, states = model.functionalize()
    return jax.jit(lambda f, s, x: f(s, x)[0])(f, states, jnp.asarray(x))


def _assert_same_dict(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for key, value in want.items():
        assert np.asarray(got[key]).shape == value.shape, key
        np.testing.assert_array_equal(got[key], value, err_msg=key)


# --- round trips of the PyTorch checkpoints -------------------------------------------


def test_resnet_blocks_load_and_match_torch():
    sd, x, y = _fixture("resnet_blocks")
    model = load_torch_state_dict(TinyResNet(), sd).eval()
    np.testing.assert_allclose(_forward(model, x), y, rtol=1e-5, atol=1e-5)
    assert model.layer2.layers[0].downsample.layers[1].num_batches_tracked == 3
    _assert_same_dict(torch_state_dict(model), sd)


def test_nanogpt_loads_with_its_tied_head_and_matches_torch():
    sd, idx, y = _fixture("nanogpt")
    model = load_torch_state_dict(TinyGPT(), sd)
    assert model.lm_head.weight is model.transformer["wte"].weight
    np.testing.assert_allclose(_forward(model, idx), y, rtol=1e-5, atol=1e-5)
    _assert_same_dict(torch_state_dict(model), sd)


def test_a_stacked_nanogpt_loads_the_torch_checkpoint_layer_by_layer():
    # PyTorch's ModuleList names each layer (``transformer.h.1.attn.c_attn.weight``);
    # a stack of the blocks takes and writes those entries as slices of its arrays.
    sd, idx, y = _fixture("nanogpt")
    model = load_torch_state_dict(TinyGPT(stacked=True), sd)
    assert model.transformer["h"].attn.c_attn.weight.shape == (2, 48, 16)
    np.testing.assert_array_equal(
        model.transformer["h"].attn.c_attn.weight[1], sd["transformer.h.1.attn.c_attn.weight"]
    )
    np.testing.assert_allclose(_forward(model, idx), y, rtol=1e-5, atol=1e-5)
    _assert_same_dict(torch_state_dict(model), sd)  # PyTorch's names, in its order
    listed = torch_state_dict(load_torch_state_dict(TinyGPT(), sd))
    _assert_same_dict(torch_state_dict(load_torch_state_dict(TinyGPT(stacked=True), listed)), sd)
    del sd["transformer.h.1.mlp.c_fc.bias"]
    with pytest.raises(StateDictError, match="missing keys .*'transformer.h.1.mlp.c_fc.bias'"):
        load_torch_state_dict(TinyGPT(stacked=True), sd)


def test_a_tied_weight_is_written_under_one_or_every_path_and_loads_from_either():
    sd, _, _ = _fixture("nanogpt")
    model = load_torch_state_dict(TinyGPT(), sd)
    first = torch_state_dict(model, tied="first")
    assert list(first) == [k for k in sd if k != "lm_head.weight"]
    for listed in (first, {k: v for k, v in sd.items() if k != "transformer.wte.weight"}):
        loaded = load_torch_state_dict(TinyGPT(), listed)
        assert loaded.lm_head.weight is loaded.transformer["wte"].weight
        np.testing.assert_array_equal(loaded.lm_head.weight, sd["lm_head.weight"])


def test_a_tied_weight_listed_twice_with_different_values_names_both_keys():
    sd, _, _ = _fixture("nanogpt")
    sd["lm_head.weight"] = sd["lm_head.weight"] + 1
    with pytest.raises(StateDictError, match="'transformer.wte.weight' and 'lm_head.weight'"):
        load_torch_state_dict(TinyGPT(), sd)


def test_a_root_sequential_numbers_its_layers_directly():
    sd, x, y = _fixture("sequential")
    assert list(sd) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    model = load_torch_state_dict(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)), sd)
    np.testing.assert_allclose(_forward(model, x), y, rtol=1e-5, atol=1e-6)
    _assert_same_dict(torch_state_dict(model), sd)


def test_a_shared_module_is_written_under_each_path_as_torch_does():
    @autostate.stateful
    class Twice:
        def __init__(self):
            self.a = nn.BatchNorm2d(2)
            self.b = self.a

    sd = torch_state_dict(Twice())
    assert [k for k in sd if k.startswith("b.")] == [
        "b.weight",
        "b.bias",
        "b.running_mean",
        "b.running_var",
        "b.num_batches_tracked",
    ]
    sd = {k: v + 1 for k, v in sd.items()}
    loaded = load_torch_state_dict(Twice(), sd)
    assert loaded.a is loaded.b
    np.testing.assert_array_equal(loaded.b.running_var, [2.0, 2.0])


def test_dict_keys_and_pytree_states_take_dotted_names():
    @autostate.stateful
    class Cache:
        def __init__(self):
            self.heads = {"q": nn.Linear(2, 2), "k": nn.Linear(2, 2, bias=False)}
            self.kv = autostate.state({"k": jnp.zeros(3), "v": jnp.ones(3)}, name="cache")

    sd = torch_state_dict(Cache())
    # PyTorch's order: a module's own buffers before its sub-modules' entries.
    assert list(sd) == ["kv.k", "kv.v", "heads.q.weight", "heads.q.bias", "heads.k.weight"]
    sd["kv.v"] = np.full(3, 7.0, np.float32)
    np.testing.assert_array_equal(load_torch_state_dict(Cache(), sd).kv["v"], [7.0] * 3)


# --- what does not fit -------------------------------------------------------------------


def test_missing_unexpected_and_misshaped_keys_are_named_with_a_likely_match():
    sd, _, _ = _fixture("resnet_blocks")
    sd["layer1.0.bn1.runing_mean"] = sd.pop("layer1.0.bn1.running_mean")
    sd["fc.weight"] = sd["fc.weight"][:5]
    with pytest.raises(StateDictError) as caught:
        load_torch_state_dict(TinyResNet(), sd)
    message = str(caught.value)
    assert "missing keys (1): 'layer1.0.bn1.running_mean'" in message
    assert "'layer1.0.bn1.runing_mean' (did you mean 'layer1.0.bn1.running_mean'?)" in message
    assert "'fc.weight' (model f32[10,16], given f32[5,16])" in message
    assert "test_torch_io.py" in message  # the user's line


def test_strict_false_loads_what_fits_and_reports_the_rest():
    sd, _, _ = _fixture("sequential")
    sd["extra.weight"] = sd.pop("2.bias")
    sd["0.bias"] = sd["0.bias"][:3]
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_torch_state_dict(model, sd, strict=False)
    (warning,) = [w.message for w in caught if isinstance(w.message, StateDictWarning)]
    assert warning.missing == (("parameter", "2.bias"),)
    assert warning.unexpected == (("unknown", "extra.weight"),)
    assert warning.mismatched == (("parameter", "0.bias"),)
    np.testing.assert_array_equal(loaded.layers[2].weight, sd["2.weight"])
    np.testing.assert_array_equal(loaded.layers[0].bias, model.layers[0].bias)  # kept
    assert loaded is not model  # a copy; the model given keeps its values
    assert not np.array_equal(model.layers[2].weight, sd["2.weight"])


def test_an_int64_counter_narrows_only_when_it_fits():
    model = nn.BatchNorm2d(2)
    sd = torch_state_dict(model)
    sd["num_batches_tracked"] = np.asarray(7, np.int64)
    loaded = load_torch_state_dict(model, sd)
    assert loaded.num_batches_tracked.dtype == model.num_batches_tracked.dtype
    assert loaded.num_batches_tracked == 7
    sd["num_batches_tracked"] = np.asarray(2**40, np.int64)
    with pytest.raises(StateDictError, match="'num_batches_tracked' .model i32\\[\\], given i64"):
        load_torch_state_dict(model, sd)
    sd["num_batches_tracked"] = np.asarray(7.0, np.float32)  # floats are never cast
    with pytest.raises(StateDictError, match="num_batches_tracked"):
        load_torch_state_dict(model, sd)


def test_a_tensor_is_read_through_numpy():
    class Tensor:  # what load_torch_state_dict needs of a torch.Tensor
        def __init__(self, array):
            self.array = array

        def detach(self):
            return self

        def cpu(self):
            return self

        def numpy(self):
            return self.array

    sd = {"weight": Tensor(np.ones((1, 2), np.float32)), "bias": Tensor(np.ones(1, np.float32))}
    np.testing.assert_array_equal(load_torch_state_dict(nn.Linear(2, 1), sd).bias, [1.0])
    with pytest.raises(StateDictError, match="'bias' holds a str"):
        load_torch_state_dict(nn.Linear(2, 1), {"weight": np.ones((1, 2), np.float32), "bias": "x"})


def test_load_param_dict_names_a_tied_key_listed_twice():
    pd = {k: np.asarray(v) for k, v in autostate.param_dict(TinyGPT()).items()}
    pd["lm_head.weight"] = pd["transformer['wte'].weight"]
    with pytest.raises(StateDictError) as caught:
        autostate.load_param_dict(TinyGPT(), pd)
    assert "drop 'lm_head.weight' (the same array as \"transformer['wte'].weight\")" in str(
        caught.value
    )
    assert "same configuration" not in str(caught.value)


def test_a_dropout_key_is_neither_written_nor_expected():
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5))
    sd = torch_state_dict(model)
    assert list(sd) == ["0.weight", "0.bias"]  # as torch.nn.Sequential(Linear, Dropout)
    loaded = load_torch_state_dict(model, {k: v + 1 for k, v in sd.items()})
    np.testing.assert_array_equal(loaded.layers[0].bias, sd["0.bias"] + 1)
    assert "layers[1].key" in autostate.state_dict(loaded)


def test_a_path_without_one_pytorch_name_is_refused():
    @autostate.stateful
    class TupleKey:
        def __init__(self):
            self.d = {("a", 1): jnp.ones(2)}

    @autostate.stateful
    class Collide:
        def __init__(self):
            self.d = {1: jnp.ones(2), "1": jnp.zeros(2)}

    with pytest.raises(StateDictError, match=r"path \"d\[\('a', 1\)\]\" has no PyTorch name"):
        torch_state_dict(TupleKey())
    with pytest.raises(StateDictError, match=r"'d\[1\]' and \"d\['1'\]\" both have .* 'd.1'"):
        load_torch_state_dict(Collide(), {"d.1": np.ones(2, np.float32)})


def test_a_bound_method_is_no_module_path():
    @autostate.stateful
    class Holder:
        def __init__(self):
            self.act = None
            self.sub = nn.Linear(2, 2)
            self.act = self.sub.__call__  # autostate's first path is act.__self__

    sd = torch_state_dict(Holder())
    assert list(sd) == ["sub.weight", "sub.bias"]
    loaded = load_torch_state_dict(Holder(), {k: v + 1 for k, v in sd.items()})
    np.testing.assert_array_equal(loaded.sub.bias, sd["sub.bias"] + 1)


# --- gradients by PyTorch name -------------------------------------------------------

_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def test_gradients_take_torchs_parameter_names_without_states():
    """``nn.torch_state_dict(grads)``: PyTorch's ``named_parameters()`` names, in its
    order (the checkpoint's keys less the buffers), each the gradient at that path;
    no running statistics. The same for ``value_and_grad`` and ``jax.grad`` over f."""
    sd, x, _ = _fixture("resnet_blocks")
    model = load_torch_state_dict(TinyResNet(), sd)
    x = jnp.asarray(x)

    def loss(m):
        return (m(x) ** 2).mean()

    grads = autostate.grad(loss)(model)
    named = torch_state_dict(grads)
    assert list(named) == [k for k in sd if k.rsplit(".", 1)[-1] not in _BUFFERS]
    np.testing.assert_array_equal(named["conv1.weight"], grads.conv1.weight)
    np.testing.assert_array_equal(
        named["layer2.0.downsample.1.weight"], grads.layer2.layers[0].downsample.layers[1].weight
    )
    assert np.abs(named["layer1.1.conv2.weight"]).sum() > 0
    _, again = autostate.value_and_grad(loss)(model)
    assert list(torch_state_dict(again)) == list(named)
    f, states = model.functionalize()
    by_jax = jax.grad(lambda f: (f(states, x)[0] ** 2).mean())(f)
    assert list(torch_state_dict(by_jax)) == list(named)


def test_a_tied_weights_gradient_is_listed_under_each_path_or_once():
    sd, idx, _ = _fixture("nanogpt")
    model = load_torch_state_dict(TinyGPT(), sd)
    grads = autostate.grad(lambda m: m(jnp.asarray(idx)).sum())(model)
    both, first = torch_state_dict(grads), torch_state_dict(grads, tied="first")
    # nanoGPT has no buffers: state_dict's names, in its order (its ``transformer``
    # is a plain dict, listed in its own order, not JAX's sorted key order).
    assert list(both) == list(sd)
    assert "lm_head.weight" in both and "lm_head.weight" not in first  # (named_parameters)
    np.testing.assert_array_equal(both["lm_head.weight"], both["transformer.wte.weight"])


def test_a_gradient_tree_given_where_a_model_is_expected_says_what_it_is():
    model = nn.Sequential(nn.Linear(2, 2, key=jax.random.key(0)), nn.BatchNorm1d(2))
    grads = autostate.grad(lambda m: m(jnp.ones((3, 2))).sum())(model)
    with pytest.raises(autostate.errors.InvalidTypeError) as info:
        load_torch_state_dict(grads, {})
    message = str(info.value)
    assert "gradients autostate.grad returns" in message
    assert "nn.torch_state_dict(grads)" in message.split("fix:", 1)[1]
    assert "expects a model, got the f" not in message
