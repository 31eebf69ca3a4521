"""``autostate.nn.init``: PyTorch's initialisers, writing the model in place."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autostate
import autostate.nn as nn
from autostate.errors import InvalidArgumentError, InvalidTypeError


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32, key=0)
        self.head = nn.Linear(32, 64, bias=False, key=1)
        self.head.weight = self.embed.weight  # one array, two modules
        self.register_buffer("scale", jnp.ones(3))


def test_a_write_reaches_every_holder_and_returns_the_array():
    model = Tied()
    new = nn.init.normal_(model.head.weight, mean=1.0, std=0.5, key=0)
    assert model.embed.weight is new and model.head.weight is new
    assert abs(float(new.mean()) - 1.0) < 0.05 and abs(float(new.std()) - 0.5) < 0.05
    # A buffer (a state) is written as a state.
    nn.init.constant_(model.scale, 7.0)
    f, states = model.functionalize()
    np.testing.assert_array_equal(states["scale"], 7.0)


def test_a_write_reaches_the_holders_a_compiled_call_left_packed():
    model = Tied()

    @autostate.jit
    def step(model):
        model.head.weight = model.embed.weight = model.head.weight * 2  # (still tied)
        model.scale = model.scale + 1

    step(model)  # small arrays: left in the call's packed buffers
    new = nn.init.zeros_(model.head.weight)
    assert model.embed.weight is new and model.head.weight is new
    nn.init.constant_(model.scale, 7.0)
    step(model)
    assert float(jnp.abs(model.embed.weight).sum()) == 0.0
    np.testing.assert_array_equal(model.scale, 8.0)


@pytest.mark.parametrize(
    ("fn", "kwargs", "std"),
    [
        ("kaiming_normal_", {"mode": "fan_out", "nonlinearity": "relu"}, math.sqrt(2 / (32 * 9))),
        ("kaiming_normal_", {}, math.sqrt(2 / (1 + 0.01**2) / (16 * 9))),
        ("kaiming_uniform_", {"a": math.sqrt(5)}, 1 / math.sqrt(16 * 9) / math.sqrt(3)),
        ("xavier_normal_", {"gain": 2.0}, 2.0 * math.sqrt(2 / (16 * 9 + 32 * 9))),
        ("xavier_uniform_", {}, math.sqrt(2 / (16 * 9 + 32 * 9))),
        ("normal_", {"std": 0.02}, 0.02),
        ("uniform_", {"a": -1.0, "b": 1.0}, 1 / math.sqrt(3)),
        ("trunc_normal_", {"std": 0.02, "a": -0.04, "b": 0.04}, 0.02 * 0.8796),
    ],
)
def test_random_initialisers_have_pytorchs_scale(fn, kwargs, std):
    conv = nn.Conv2d(16, 32, 3, key=0)
    new = getattr(nn.init, fn)(conv.weight, **kwargs, key=1)
    assert conv.weight is new and new.shape == (32, 16, 3, 3) and new.dtype == jnp.float32
    assert abs(float(new.std()) / std - 1) < 0.05, (float(new.std()), std)
    if fn == "trunc_normal_":
        assert float(jnp.abs(new).max()) <= 0.04


def test_constant_initialisers_keep_shape_and_dtype():
    layer = nn.Linear(3, 2, key=0)
    assert bool((nn.init.zeros_(layer.bias) == 0).all()) and layer.bias.dtype == jnp.float32
    assert bool((nn.init.ones_(layer.weight) == 1).all()) and layer.weight.shape == (2, 3)
    norm = nn.BatchNorm1d(2)
    assert int(nn.init.constant_(norm.num_batches_tracked, 5)) == 5
    assert int(norm.num_batches_tracked) == 5 and norm.num_batches_tracked.dtype == jnp.int32


def test_keys_come_from_the_default_stream_or_key():
    layer = nn.Linear(3, 2, key=0)

    def draw(seed: int, **kwargs) -> jax.Array:
        nn.manual_seed(seed)
        return nn.init.normal_(layer.weight, **kwargs)

    np.testing.assert_array_equal(draw(4), draw(4))
    assert not np.array_equal(draw(4), draw(5))
    np.testing.assert_array_equal(draw(4, key=9), draw(5, key=9))
    stream = nn.KeyStream(0)
    assert not np.array_equal(
        nn.init.normal_(layer.weight, key=stream), nn.init.normal_(layer.weight, key=stream)
    )


def test_calculate_gain():
    assert nn.init.calculate_gain("conv2d") == 1
    assert nn.init.calculate_gain("tanh") == pytest.approx(5 / 3)
    assert nn.init.calculate_gain("leaky_relu", 0.2) == pytest.approx(math.sqrt(2 / 1.04))
    with pytest.raises(InvalidArgumentError):
        nn.init.calculate_gain("swish")


def test_what_cannot_be_written_is_refused():
    with pytest.raises(InvalidArgumentError, match="no module built here holds this array"):
        nn.init.zeros_(jnp.ones(3))
    layer = nn.Linear(3, 2, key=0)
    loaded = nn.load_torch_state_dict(layer, {"weight": np.ones((2, 3), np.float32),
                                              "bias": np.ones(2, np.float32)})
    # A model autostate made (load, freeze) is written by assigning the result.
    with pytest.raises(InvalidArgumentError, match="assign the result"):
        nn.init.zeros_(loaded.bias)
    nn.init.zeros_(layer.bias)  # the model it came from is written, not the copy
    np.testing.assert_array_equal(loaded.bias, 1.0)
    with pytest.raises(InvalidArgumentError, match="2 dimensions"):
        nn.init.kaiming_normal_(layer.bias)
    with pytest.raises(InvalidArgumentError, match="mode"):
        nn.init.kaiming_normal_(layer.weight, mode="fan")
    norm = nn.BatchNorm1d(2)
    with pytest.raises(InvalidTypeError, match="floating-point"):
        nn.init.normal_(norm.num_batches_tracked)
    with pytest.raises(InvalidTypeError, match="model's array"):
        nn.init.zeros_([1.0, 2.0])


def test_inside_a_functionalized_call_parameters_are_fixed():
    class Reset(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2, key=0)

        def forward(self, x):
            nn.init.zeros_(self.fc.bias)
            return self.fc(x)

    model = Reset()
    f, states = model.functionalize()
    with pytest.raises(InvalidArgumentError, match="functionalized call"):
        jax.jit(f)(states, jnp.ones(2))


def test_an_ensemble_built_under_vmap_initialises_each_member():
    class Member(nn.Module):
        def __init__(self, key):
            super().__init__()
            self.fc = nn.Linear(4, 4, key=key)
            nn.init.normal_(self.fc.weight, std=0.1, key=key)
            nn.init.zeros_(self.fc.bias)

    members = jax.vmap(Member)(jax.random.split(jax.random.key(0), 3))
    assert members.fc.weight.shape == (3, 4, 4)
    assert not np.array_equal(members.fc.weight[0], members.fc.weight[1])
    np.testing.assert_array_equal(members.fc.bias, 0.0)
    assert abs(float(members.fc.weight.std()) - 0.1) < 0.03
