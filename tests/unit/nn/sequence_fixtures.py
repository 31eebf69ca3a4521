"""Reads the PyTorch fixtures of the sequence layers (``tests/fixtures/torch/make_sequence.py``).

A fixture holds torch's weights, inputs, outputs, the cotangents of the
scalar loss ``sum(output * cotangent)`` and that loss's gradients; this
module loads the weights into an autostate layer (strictly: every torch name
must be a parameter of the layer, and every parameter a torch name) and
computes the same loss and gradients with JAX.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tolerance import tolerance

import autostate

FIXTURES = Path(__file__).parents[2] / "fixtures" / "torch"
TOLERANCE = tolerance(rtol=1e-5, atol=1e-5)


class Fixture:
    """One ``.npz`` file: ``config`` (constructor arguments), ``call`` (keyword
    arguments of the call), and its arrays by kind (``param``, ``input``,
    ``output``, ``cotangent``, ``grad.param``, ``grad.input``)."""

    def __init__(self, name: str):
        with np.load(FIXTURES / f"{name}.npz") as data:
            arrays = {key: data[key] for key in data.files}
        self.config: dict[str, Any] = json.loads(str(arrays.pop("config")))
        self.call: dict[str, Any] = self.config.pop("call")
        self.arrays = arrays

    def kind(self, prefix: str) -> dict[str, np.ndarray]:
        return {k[len(prefix) + 1 :]: v for k, v in self.arrays.items() if k.startswith(prefix + ".")}

    def load(self, layer: Any) -> Any:
        """``layer`` holding torch's weights."""
        return autostate.load_param_dict(layer, self.kind("param"))

    def loss_and_grads(
        self, layer: Any, inputs: dict[str, Any], constants: dict[str, Any] | None = None
    ) -> tuple[Any, Any, Any]:
        """``(outputs, parameter gradients, input gradients)`` of the fixture's loss.

        Outputs are flattened as the fixture names them (``out0``, ``out10``
        for a nested tuple); ``inputs`` are differentiated, ``constants``
        (masks) are not.
        """
        f, states = layer.functionalize()
        cotangents = self.kind("cotangent")

        def loss(f: Any, inputs: dict[str, Any]) -> tuple[jax.Array, dict[str, jax.Array]]:
            out, _ = f(states, **inputs, **(constants or {}), **self.call)
            flat = flatten_outputs(out)
            return sum((flat[k] * cotangents[k]).sum() for k in cotangents), flat

        grads = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))  # one compile, not one per op
        (param_grads, input_grads), outputs = grads(f, inputs)
        return outputs, autostate.param_dict(param_grads), input_grads


def flatten_outputs(out: Any, prefix: str = "out") -> dict[str, Any]:
    """A call's outputs under the fixture's names: ``out``, or ``out0``, ``out10``, ... for tuples."""
    if out is None:
        return {}
    if not isinstance(out, tuple):
        return {prefix: out}
    flat: dict[str, Any] = {}
    for i, item in enumerate(out):
        flat.update(flatten_outputs(item, f"{prefix}{i}"))
    return flat


def assert_close(actual: dict[str, Any], expected: dict[str, np.ndarray]) -> None:
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        np.testing.assert_allclose(np.asarray(actual[key]), value, err_msg=key, **TOLERANCE)
