"""PyTorch files ported by changing their imports: torchvision's ResNet and
Hugging Face's GPT-2, against the numbers PyTorch computed.

``tests/fixtures/torch/ports/*_torch.py`` are the PyTorch files (condensed
copies of upstream's); ``port_resnet.py`` and ``port_gpt2.py`` are the same
files with their imports and tensor-op spellings changed. The first test
counts and classifies every edited line, so that the port claim stays true;
the others load the ``state_dict`` PyTorch saved (``make_ports.py``) and
compare names, outputs, running statistics, gradients and the key/value
cache decode. torch is not imported.
"""

from __future__ import annotations

import ast
import difflib
import json
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autostate
import autostate.nn as nn
from tests.models import port_gpt2, port_resnet

HERE = Path(__file__).resolve().parent
FIXTURES = HERE.parent / "fixtures" / "torch"
TOL = {"rtol": 1e-4, "atol": 1e-5}

# A tensor op spelled for JAX: a ``torch.`` name, a tensor method JAX spells
# otherwise, a ``device=`` argument (JAX places arrays itself).
_OP = re.compile(
    r"torch\.|nn\.functional\.|\.(view|size|permute|split|contiguous|type|to|unsqueeze)\("
    r"|\.transpose\(-|device"
)
# A type annotation naming a tensor class (``Optional[torch.FloatTensor]``).
_ANNOTATION = re.compile(r"torch\.(Float|Long)?Tensor")


def _code_lines(path: Path) -> list[str]:
    """The file's lines after its module docstring."""
    text = path.read_text()
    first = ast.parse(text).body[0]
    return text.splitlines()[first.end_lineno :]


def edits(torch_file: str, port_file: str) -> dict[str, list[str]]:
    """The PyTorch file's lines the port changed or removed, by kind: ``import``,
    ``annotation`` (a tensor type: ``torch.FloatTensor`` is ``jax.Array``),
    ``op`` (a tensor op spelled for JAX), ``init`` (an in-place
    ``.data.<op>_()`` written with ``nn.init``) and ``other``."""
    before = _code_lines(FIXTURES / "ports" / torch_file)
    after = _code_lines(HERE / port_file)
    kinds: dict[str, list[str]] = {"import": [], "annotation": [], "op": [], "init": [], "other": []}
    matcher = difflib.SequenceMatcher(a=before, b=after, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        changed = before[i1:i2] or after[j1:j2]  # an insertion counts the new lines
        for line in changed:
            stripped = line.strip()
            if not stripped:
                continue
            if stripped.startswith(("import ", "from ")):
                kinds["import"].append(stripped)
            elif _ANNOTATION.search(stripped) and not _OP.search(_ANNOTATION.sub("", stripped)):
                kinds["annotation"].append(stripped)
            elif ".data" in stripped:
                kinds["init"].append(stripped)
            elif _OP.search(stripped):
                kinds["op"].append(stripped)
            else:
                kinds["other"].append(stripped)
    return kinds


def test_resnet_port_changes_imports_and_one_op():
    kinds = edits("resnet_torch.py", "port_resnet.py")
    assert kinds["import"] == ["import torch", "import torch.nn as nn", "from torch import Tensor"]
    assert kinds["op"] == ["x = torch.flatten(x, 1)"]
    assert kinds["annotation"] == kinds["init"] == kinds["other"] == []
    # What stayed: super().__init__(), forward, inplace=True, the init loop.
    port = (HERE / "port_resnet.py").read_text()
    for kept in (
        "super().__init__()",
        "def forward(self, x: Tensor) -> Tensor:",
        "nn.ReLU(inplace=True)",
        "for m in self.modules():",
        'nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")',
        "nn.init.constant_(m.bn3.weight, 0)",
    ):
        assert kept in port


def test_gpt2_port_changes_imports_ops_and_data_inits():
    kinds = edits("gpt2_torch.py", "port_gpt2.py")
    assert kinds["import"] == ["import torch", "from torch import nn"]
    assert len(kinds["annotation"]) == 15
    assert len(kinds["op"]) == 39
    # ``module.weight.data.normal_(...)``: JAX arrays have no ``.data`` to fill
    # in place; ``nn.init.normal_(module.weight, ...)`` writes the model.
    assert len(kinds["init"]) == 7
    assert kinds["other"] == []
    port = (HERE / "port_gpt2.py").read_text()
    for kept in (
        'self.register_buffer("masked_bias", jnp.array(-1e4), persistent=False)',
        "self.h = nn.ModuleList([GPT2Block(config, layer_idx=i)",
        "self.apply(self._init_weights)",
        "output_embeddings.weight = self.get_input_embeddings().weight",
        "for name, p in module.named_parameters():",
    ):
        assert kept in port


# --- ResNet ----------------------------------------------------------------------


def _fixture(name: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    with np.load(FIXTURES / f"port_{name}.npz") as data:
        arrays = dict(data)
    return json.loads(str(arrays.pop("config"))), arrays


def _prefixed(arrays: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    return {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}


def _resnet(config: dict[str, Any], **extra: Any) -> Any:
    kwargs = dict(config["kwargs"])
    block = getattr(port_resnet, kwargs.pop("block"))
    return port_resnet.ResNet(block, **kwargs, **extra)


def _names(model: Any) -> dict[str, list[str]]:
    return {
        "state_dict": list(nn.torch_state_dict(model)),
        "named_modules": [n for n, _ in model.named_modules()],
        "named_parameters": [n for n, _ in model.named_parameters()],
        "named_buffers": [n for n, _ in model.named_buffers()],
        "named_children": [n for n, _ in model.named_children()],
    }


@pytest.fixture(scope="module", params=["basic", "bottleneck"])
def resnet(request: Any) -> tuple[Any, dict[str, Any], dict[str, np.ndarray]]:
    config, arrays = _fixture(f"resnet_{request.param}")
    nn.manual_seed(0)
    return _resnet(config), config, arrays


def test_resnet_names_are_torchs(resnet):
    model, config, _ = resnet
    got = _names(model)
    for what, names in got.items():
        assert names == config[what], what


def test_resnet_init_loop_writes_the_model(resnet):
    model, _, _ = resnet
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert len(convs) == len(norms) > 5
    weights = np.concatenate([np.asarray(c.weight).ravel() / _kaiming_std(c) for c in convs])
    assert abs(weights.std() - 1) < 0.05 and abs(weights.mean()) < 0.05  # N(0, 2 / fan_out)
    for norm in norms:
        np.testing.assert_array_equal(norm.weight, 1.0)
        np.testing.assert_array_equal(norm.bias, 0.0)


def _kaiming_std(conv: Any) -> float:
    out_channels, _, kh, kw = conv.weight.shape
    return float(np.sqrt(2.0 / (out_channels * kh * kw)))


def test_resnet_zero_init_residual_and_seed():
    config, _ = _fixture("resnet_basic")
    nn.manual_seed(3)
    a = _resnet(config, zero_init_residual=True)
    nn.manual_seed(3)
    b = _resnet(config, zero_init_residual=True)
    blocks = [m for m in a.modules() if isinstance(m, port_resnet.BasicBlock)]
    assert len(blocks) == 5
    for block in blocks:
        np.testing.assert_array_equal(block.bn2.weight, 0.0)
        np.testing.assert_array_equal(block.bn1.weight, 1.0)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        np.testing.assert_array_equal(p, q, err_msg=name)


def test_resnet_matches_torch_in_training_and_eval(resnet):
    model, _, arrays = resnet
    loaded = nn.load_torch_state_dict(model, _prefixed(arrays, "sd/"))
    x, cotangent = jnp.asarray(arrays["train_input"]), jnp.asarray(arrays["cotangent"])

    def loss(m: Any, x: jax.Array, c: jax.Array) -> jax.Array:
        return (m(x) * c).sum()

    grads = autostate.grad(loss)(loaded, x, cotangent)  # one training call: BN statistics move
    got_grads = dict(grads.model.named_parameters())
    expected_grads = _prefixed(arrays, "grad/")
    assert list(got_grads) == list(expected_grads)
    for name, g in expected_grads.items():
        # Through five batch norms in float32: rounding relative to the largest entry.
        atol = 2e-5 * max(1.0, float(np.abs(g).max()))
        np.testing.assert_allclose(got_grads[name], g, rtol=1e-3, atol=atol, err_msg=name)
    after = nn.torch_state_dict(loaded)
    for name, value in _prefixed(arrays, "after/").items():
        np.testing.assert_allclose(after[name], value, **TOL, err_msg=name)
    loaded.eval()
    x = jnp.asarray(arrays["eval_input"])
    np.testing.assert_allclose(loaded(x), arrays["eval_output"], **TOL)
    np.testing.assert_allclose(autostate.jit(lambda m, x: m(x))(loaded, x), arrays["eval_output"], **TOL)
    f, states = loaded.functionalize()
    out, _ = jax.jit(f)(states, x)
    np.testing.assert_allclose(out, arrays["eval_output"], **TOL)


def test_resnet_training_output_matches_torch():
    config, arrays = _fixture("resnet_basic")
    nn.manual_seed(0)
    loaded = nn.load_torch_state_dict(_resnet(config), _prefixed(arrays, "sd/"))
    f, states = loaded.functionalize()
    out, states = jax.jit(f)(states, jnp.asarray(arrays["train_input"]))
    np.testing.assert_allclose(out, arrays["train_output"], **TOL)
    after = nn.torch_state_dict(autostate.freeze(f, states))
    for name, value in _prefixed(arrays, "after/").items():
        np.testing.assert_allclose(after[name], value, **TOL, err_msg=name)


# --- GPT-2 -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2() -> tuple[Any, dict[str, Any], dict[str, np.ndarray]]:
    config, arrays = _fixture("gpt2")
    nn.manual_seed(0)
    model = port_gpt2.GPT2LMHeadModel(port_gpt2.GPT2Config(**config["kwargs"]))
    return model, config, arrays


def test_gpt2_names_are_torchs(gpt2):
    model, config, _ = gpt2
    got = _names(model)
    for what, names in got.items():
        assert names == config[what], what
    # The causal mask and masked_bias are non-persistent buffers: listed by
    # named_buffers, in no state_dict.
    assert "transformer.h.0.attn.bias" in got["named_buffers"]
    assert "transformer.h.0.attn.bias" not in got["state_dict"]


def test_gpt2_init_and_tied_head(gpt2):
    model, config, _ = gpt2
    assert model.lm_head.weight is model.transformer.wte.weight
    assert "lm_head.weight" not in autostate.param_dict(model)  # one array, two names
    block = model.transformer.h[0]
    np.testing.assert_array_equal(block.ln_1.weight, 1.0)
    np.testing.assert_array_equal(block.attn.c_attn.bias, 0.0)
    n_layer = config["kwargs"]["n_layer"]
    proj = np.concatenate([np.asarray(b.attn.c_proj.weight).ravel() for b in model.transformer.h])
    other = np.concatenate([np.asarray(b.attn.c_attn.weight).ravel() for b in model.transformer.h])
    assert abs(other.std() - 0.02) < 0.003  # normal_(std=initializer_range)
    assert abs(proj.std() - 0.02 / np.sqrt(2 * n_layer)) < 0.002  # the scaled c_proj
    # A float buffer is no parameter: never trained.
    assert not any("masked_bias" in k for k in autostate.param_dict(model))


def test_gpt2_matches_torch_with_padding_and_cache(gpt2):
    model, _, arrays = gpt2
    loaded = nn.load_torch_state_dict(model, _prefixed(arrays, "sd/")).eval()
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    ids, mask = jnp.asarray(arrays["ids"]), jnp.asarray(arrays["mask"])
    (logits,) = loaded(ids, attention_mask=mask)
    np.testing.assert_allclose(logits, arrays["logits"], **TOL)
    jitted = autostate.jit(lambda m, ids, mask: m(ids, attention_mask=mask)[0])
    np.testing.assert_allclose(jitted(loaded, ids, mask), arrays["logits"], **TOL)

    step = autostate.jit(lambda m, ids, past: m(ids, past_key_values=past, use_cache=True))
    prompt, past = loaded(ids[:, :5], use_cache=True)
    steps = [prompt[:, -1]]
    for t in (5, 6):
        out, past = step(loaded, ids[:, t : t + 1], past)
        steps.append(out[:, -1])
    np.testing.assert_allclose(jnp.stack(steps, 1), arrays["decode_logits"], **TOL)
    assert past[0][0].shape == (2, 2, 7, 8)  # (batch, head, positions, head size)
