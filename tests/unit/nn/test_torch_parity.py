"""``autostate.nn`` layers against PyTorch's, from the fixtures torch wrote.

``tests/fixtures/torch/make_layers.py`` ran each layer configuration in
PyTorch and saved its parameters, inputs, outputs, gradients and buffers;
here the same configuration is built with ``autostate.nn``, the parameters
are copied over as they are (same layouts, no transposes) and every number
must equal PyTorch's to float32 rounding. torch is not imported.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerance import tolerance

import autostate
from autostate import nn

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "torch"
NAMES = sorted(p.stem.removeprefix("layer_") for p in FIXTURES.glob("layer_*.npz"))
TOL = tolerance(rtol=1e-5, atol=1e-5)


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def load(name: str) -> tuple[Any, dict[str, np.ndarray]]:
    """The fixture's arrays and its layer, built by autostate.nn with torch's parameters."""
    with np.load(FIXTURES / f"layer_{name}.npz") as data:
        arrays = dict(data)
    layer = _build(json.loads(str(arrays["config"])))
    for key, value in arrays.items():
        if key.startswith("param/"):
            *path, attr = key.removeprefix("param/").split(".")
            owner = layer
            for part in path:  # torch's dotted names: self_attn.out_proj, layers.0
                owner = owner[int(part)] if part.isdigit() else getattr(owner, part)
            assert getattr(owner, attr).shape == value.shape, key  # the same layout as torch
            setattr(owner, attr, jnp.asarray(value))
    return layer, arrays


def _build(config: dict[str, Any]) -> Any:
    """The layer a fixture's configuration names; a configured argument (the
    layer an encoder copies, its norm) is built first, as torch built it."""
    args = [_tuples(a) for a in config["args"]]
    kwargs = {
        k: _build(v) if isinstance(v, dict) and "cls" in v else _tuples(v)
        for k, v in config["kwargs"].items()
    }
    return getattr(nn, config["cls"])(*args, **kwargs, **_key(config["cls"]))


def _key(cls: str) -> dict[str, Any]:
    with_weights = (
        "Linear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose2d", "Embedding",
        "TransformerEncoderLayer", "TransformerEncoder",
    )  # fmt: skip
    return {"key": 0} if cls in with_weights else {}


def _call_kwargs(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """The keyword arguments every call of the fixture got: masks as arrays, flags as bools."""
    return {
        k.removeprefix("kwarg/"): bool(v) if v.ndim == 0 else jnp.asarray(v)
        for k, v in arrays.items()
        if k.startswith("kwarg/")
    }


def _eval_compared(arrays: dict[str, np.ndarray]) -> np.ndarray | bool:
    """Where the evaluation output is compared: everywhere, except the
    positions a key padding mask pads when torch ran its nested-tensor fast
    path (it writes zeros there; ``TransformerEncoder``'s docstring)."""
    padding = arrays.get("kwarg/src_key_padding_mask")
    config = json.loads(str(arrays["config"]))
    if padding is None or config["cls"] != "TransformerEncoder":
        return True
    if config["kwargs"]["encoder_layer"]["kwargs"].get("batch_first"):
        return ~padding[:, :, None]  # [N, S, E]
    return ~padding.T[:, :, None]  # [S, N, E]


def _inputs(arrays: dict[str, np.ndarray]) -> list[np.ndarray]:
    return [arrays[f"input/{i}"] for i in range(sum(k.startswith("input/") for k in arrays))]


def test_fixtures_are_there_and_small():
    assert len(NAMES) >= 40
    assert sum(p.stat().st_size for p in FIXTURES.glob("layer_*.npz")) < 512 * 1024


@pytest.mark.parametrize("name", NAMES)
def test_outputs_and_buffers_equal_torch(name: str):
    layer, arrays = load(name)
    kwargs = _call_kwargs(arrays)
    for i, x in enumerate(_inputs(arrays)):
        np.testing.assert_allclose(layer(jnp.asarray(x), **kwargs), arrays[f"output/{i}"], **TOL)
    for key, value in arrays.items():
        if key.startswith("buffer/"):
            got = getattr(layer, key.removeprefix("buffer/"))
            np.testing.assert_allclose(np.asarray(got), value, **TOL, err_msg=key)
    layer.eval()
    got = layer(jnp.asarray(arrays["eval_input"]), **kwargs)
    compared = np.broadcast_to(_eval_compared(arrays), got.shape)
    np.testing.assert_allclose(
        np.asarray(got)[compared], arrays["eval_output"][compared], **TOL
    )


@pytest.mark.parametrize("name", NAMES)
def test_gradients_equal_torch(name: str):
    layer, arrays = load(name)
    f, states = layer.functionalize()
    x = jnp.asarray(arrays["input/0"])
    cotangent = jnp.asarray(arrays["cotangent"])
    kwargs = _call_kwargs(arrays)

    def loss(f: Any, x: jax.Array) -> jax.Array:
        y, _ = f(states, x, **kwargs)
        return (y * cotangent).sum()

    # Compiled as one program: cheaper than running the backward pass op by op.
    if jnp.issubdtype(x.dtype, jnp.integer):
        grad_f, grad_x = jax.jit(jax.grad(loss))(f, x), None
    else:
        grad_f, grad_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(f, x)
        np.testing.assert_allclose(grad_x, arrays["grad/input"], **TOL)
    params = autostate.param_dict(autostate.freeze(grad_f, states))
    expected = {k.removeprefix("grad/"): v for k, v in arrays.items() if k.startswith("grad/")}
    expected.pop("input", None)
    assert sorted(params) == sorted(expected)
    for attr, value in expected.items():
        np.testing.assert_allclose(params[attr], value, **TOL, err_msg=attr)
