"""``autostate.nn.recurrent``: LSTMCell, GRUCell, LSTM, GRU against PyTorch, and carried state."""

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
from tests.unit.nn.sequence_fixtures import TOLERANCE, Fixture, assert_close, flatten_outputs


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("lstm_cell", nn.LSTMCell),
        ("gru_cell", nn.GRUCell),
        ("lstm_2layer_bidirectional", nn.LSTM),
        ("lstm_default_state", nn.LSTM),
        ("gru_2layer_unbatched", nn.GRU),
        ("gru_bidirectional", nn.GRU),
    ],
)
def test_outputs_and_gradients_equal_torch(name: str, cls: Any) -> None:
    fixture = Fixture(name)
    layer = fixture.load(cls(**fixture.config, key=0))
    given = fixture.kind("input")
    inputs: dict[str, Any] = {"input": jnp.asarray(given["input"])}
    if "hx0" in given:  # an LSTM's (h_0, c_0)
        inputs["hx"] = (jnp.asarray(given["hx0"]), jnp.asarray(given["hx1"]))
    elif "hx" in given:
        inputs["hx"] = jnp.asarray(given["hx"])

    outputs, param_grads, input_grads = fixture.loss_and_grads(layer, inputs)

    assert_close(outputs, fixture.kind("output"))
    assert_close(param_grads, fixture.kind("grad.param"))
    flat_input_grads = {"input": input_grads["input"]}
    if "hx" in input_grads:
        flat_input_grads.update(flatten_outputs(input_grads["hx"], "hx"))
    assert_close(flat_input_grads, fixture.kind("grad.input"))


def test_default_initialisation_is_torch_uniform() -> None:
    layer = nn.LSTM(3, 16, num_layers=2, bidirectional=True, key=0)  # GRU's shares the code
    params = autostate.param_dict(layer)
    assert params["weight_ih_l0"].shape == (4 * 16, 3)
    assert params["weight_ih_l1_reverse"].shape == (4 * 16, 32)
    assert len(params) == 2 * 2 * 4
    bound = 1 / math.sqrt(16)
    for value in params.values():
        assert float(jnp.abs(value).max()) <= bound
        assert float(jnp.abs(value).max()) > 0.8 * bound  # spread over the interval
    assert not bool((params["weight_hh_l0"] == params["weight_hh_l0_reverse"]).all())


def assert_tree_close(actual: Any, expected: Any) -> None:
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOLERANCE), actual, expected)


@pytest.mark.parametrize(
    ("cls", "shape"),
    [(nn.LSTM, (2, 5, 3)), (nn.GRUCell, (3,))],  # a sequence layer's (h, c), a cell's unbatched h
)
def test_carried_state_eagerly_through_jit_and_after_freeze(cls: Any, shape: tuple[int, ...]) -> None:
    options = {"batch_first": True} if cls in (nn.LSTM, nn.GRU) else {}
    x1, x2 = jax.random.normal(jax.random.key(1), (2, *shape))
    reference = cls(3, 4, **options, key=0)
    first = reference(x1)
    final = first[1] if cls in (nn.LSTM, nn.GRU) else first  # (output, state) or the state
    expected = reference(x2, final)  # the second call, started from the first's final state by hand

    eager = cls(3, 4, **options, carry_state=True, key=0)
    eager(x1)
    assert_tree_close(eager(x2), expected)

    model = cls(3, 4, **options, carry_state=True, key=0)
    f, states = model.functionalize()
    step = jax.jit(lambda f, states, x: f(states, x))
    _, states = step(f, states, x1)
    assert states["h"].shape == eager.h.shape
    out, states = step(f, states, x2)
    assert_tree_close(out, expected)

    frozen = autostate.freeze(f, states)
    assert_tree_close(frozen.h, eager.h)
    assert_tree_close(frozen(x1), eager(x1))  # both continue from the same state
    assert sorted(nn.torch_state_dict(frozen)) == sorted(autostate.param_dict(frozen))  # h is not persistent
    frozen.reset_state()
    assert frozen.h is None
    assert_tree_close(frozen(x1), reference(x1))  # from zeros again


def test_carried_state_of_another_batch_size_is_refused() -> None:
    lstm = nn.LSTM(3, 4, carry_state=True, key=0)
    lstm(jnp.ones((5, 2, 3)))
    with pytest.raises(InvalidArgumentError, match=r"reset_state\(\)"):
        lstm(jnp.ones((5, 3, 3)))
    lstm.reset_state()
    output, (h_n, _) = lstm(jnp.ones((5, 3, 3)))
    assert h_n.shape == (1, 3, 4)


@autostate.stateful
class ChunkedReader:
    """Feeds a long sequence to a carrying GRU chunk by chunk, in a ``lax.scan``."""

    def __init__(self) -> None:
        self.gru = nn.GRU(3, 4, carry_state=True, key=0)

    def __call__(self, chunks: jax.Array) -> jax.Array:
        first, _ = self.gru(chunks[0])  # gives the carried state its array before the scan
        _, rest = jax.lax.scan(lambda carry, chunk: (carry, self.gru(chunk)[0]), 0, chunks[1:])
        return jnp.concatenate([first, *rest])


def test_carried_state_threads_through_a_scan_in_a_method() -> None:
    chunks = jax.random.normal(jax.random.key(2), (3, 4, 2, 3))  # 3 chunks of [seq 4, batch 2, 3]
    whole, h_n = nn.GRU(3, 4, key=0)(chunks.reshape(12, 2, 3))
    reader = ChunkedReader()
    np.testing.assert_allclose(reader(chunks), whole, **TOLERANCE)
    np.testing.assert_allclose(reader.gru.h, h_n, **TOLERANCE)

    f, states = ChunkedReader().functionalize()
    out, states = jax.jit(lambda f, states, x: f(states, x))(f, states, chunks)
    np.testing.assert_allclose(out, whole, **TOLERANCE)
    np.testing.assert_allclose(states["gru.h"], h_n, **TOLERANCE)


def test_dropout_between_layers_in_training_only() -> None:
    x = jnp.ones((4, 2, 3))
    plain = nn.LSTM(3, 8, num_layers=2, key=0)
    dropping = nn.LSTM(3, 8, num_layers=2, dropout=0.5, key=0)
    f, states = dropping.functionalize()
    step = jax.jit(lambda f, states, x: f(states, x))
    (out_1, _), states_1 = step(f, states, x)
    (out_2, _), _ = step(f, states_1, x)
    expected, _ = plain(x)
    assert not np.allclose(out_1, expected)
    assert not np.allclose(out_1, out_2)  # the key advanced: another mask
    assert not bool((states_1["inter_layer_dropout.key"] == states["inter_layer_dropout.key"]).all())
    np.testing.assert_allclose(dropping.eval()(x)[0], expected, **TOLERANCE)


def test_projection_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="proj_size"):
        nn.LSTM(3, 4, proj_size=2, key=0)


def test_flatten_parameters_is_accepted_and_changes_nothing():
    # torch code calls it before each call (a cuDNN layout step there).
    for layer in (nn.LSTM(3, 4, key=0), nn.GRU(3, 4, key=0)):
        before = autostate.param_dict(layer)
        assert layer.flatten_parameters() is None
        assert autostate.param_dict(layer).keys() == before.keys()
        assert all(autostate.param_dict(layer)[k] is v for k, v in before.items())
