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
    config = json.loads(str(arrays["config"]))
    args = [_tuples(a) for a in config["args"]]
    kwargs = {k: _tuples(v) for k, v in config["kwargs"].items()}
    layer = getattr(nn, config["cls"])(*args, **kwargs, **_key(config["cls"]))
    for key, value in arrays.items():
        if key.startswith("param/"):
            attr = key.removeprefix("param/")
            assert getattr(layer, attr).shape == value.shape, attr  # the same layout as torch
            setattr(layer, attr, jnp.asarray(value))
    return layer, arrays


def _key(cls: str) -> dict[str, Any]:
    return (
        {"key": 0}
        if cls in ("Linear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose2d", "Embedding")
        else {}
    )


def _inputs(arrays: dict[str, np.ndarray]) -> list[np.ndarray]:
    return [arrays[f"input/{i}"] for i in range(sum(k.startswith("input/") for k in arrays))]


def test_fixtures_are_there_and_small():
    assert len(NAMES) >= 40
    assert sum(p.stat().st_size for p in FIXTURES.glob("layer_*.npz")) < 512 * 1024


@pytest.mark.parametrize("name", NAMES)
def test_outputs_and_buffers_equal_torch(name: str):
    layer, arrays = load(name)
    for i, x in enumerate(_inputs(arrays)):
        np.testing.assert_allclose(layer(jnp.asarray(x)), arrays[f"output/{i}"], **TOL)
    for key, value in arrays.items():
        if key.startswith("buffer/"):
            got = getattr(layer, key.removeprefix("buffer/"))
            np.testing.assert_allclose(np.asarray(got), value, **TOL, err_msg=key)
    layer.eval()
    np.testing.assert_allclose(
        layer(jnp.asarray(arrays["eval_input"])), arrays["eval_output"], **TOL
    )


@pytest.mark.parametrize("name", NAMES)
def test_gradients_equal_torch(name: str):
    layer, arrays = load(name)
    f, states = layer.functionalize()
    x = jnp.asarray(arrays["input/0"])
    cotangent = jnp.asarray(arrays["cotangent"])

    def loss(f: Any, x: jax.Array) -> jax.Array:
        y, _ = f(states, x)
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
