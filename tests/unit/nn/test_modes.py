"""``model.train()`` / ``model.eval()``: every sub-model, static config, one
compile per mode, and the evaluation ``f`` of a trained one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autostate
from autostate import nn
from autostate.errors import InvalidArgumentError, StateAccessError, StaticStateError


@autostate.stateful
class Block:
    def __init__(self, key):
        keys = nn.KeyStream(key)
        self.conv = nn.Conv2d(2, 3, 3, padding=1, key=keys)
        self.norm = nn.BatchNorm2d(3)
        self.heads = {"a": nn.Dropout(0.5, key=keys), "b": [nn.Linear(3, 2, key=keys)]}

    def __call__(self, x):
        y = self.norm(self.conv(x)).mean((2, 3))
        return self.heads["b"][0](self.heads["a"](y))


class Plain(autostate.Stateful):
    def __init__(self):
        self.inner = nn.Dropout(0.2, key=0)

    def __call__(self, x):
        return self.inner(x)


def _modes(model):
    return [m.training for m in autostate.graph.instances_of(model)]


def test_eval_and_train_reach_every_sub_model_and_return_the_model():
    model = Block(0)
    assert model.eval() is model
    modes = _modes(model)
    assert len(modes) == 5 and not any(modes)
    assert model.train() is model and all(_modes(model))
    assert model.train(False) is model and not any(_modes(model))


def test_the_stateful_base_has_them_too():
    model = Plain()
    assert model.eval() is model
    assert model.training is False and model.inner.training is False
    np.testing.assert_array_equal(model(jnp.ones(4)), jnp.ones(4))


def test_a_class_of_its_own_keeps_its_train_and_eval():
    calls = []

    @autostate.stateful
    class Own:
        def __init__(self):
            self.mode = "train"
            self.drop = nn.Dropout(0.5, key=1)

        def train(self, mode=True):
            calls.append(mode)
            self.mode = "train" if mode else "eval"
            return "own"

    @autostate.stateful
    class Outer:
        def __init__(self):
            self.own = Own()

    outer = Outer()
    assert Own.train is not Outer.train and Own.eval is Outer.eval
    assert outer.eval() is outer
    # PyTorch's rule: a sub-model's own train() is what switches it.
    assert calls == [False] and outer.own.mode == "eval" and outer.training is False
    assert outer.own.drop.training is False  # still reached by the walk
    assert Own().train(False) == "own"


def test_mode_is_a_bool():
    with pytest.raises(InvalidArgumentError, match="takes a bool"):
        nn.Dropout(key=0).train(0)


def test_training_is_static_one_compile_per_mode():
    traces = []

    @jax.jit
    def step(f, states, x):
        traces.append(None)
        return f(states, x)

    model = nn.Dropout(0.5, key=0)
    x = jnp.ones(8)
    f, states = model.functionalize()
    assert sorted(states) == ["key"]  # training is structure, not a state
    y, states = step(f, states, x)
    y, states = step(f, states, x)
    f_eval, states = autostate.freeze(f, states).eval().functionalize()
    y_eval, states = step(f_eval, states, x)
    y_eval, states = step(f_eval, states, x)
    assert len(traces) == 2
    np.testing.assert_array_equal(y_eval, x)
    assert set(np.asarray(y).tolist()) <= {0.0, 2.0}


def test_f_eval_of_a_trained_model_is_a_clear_error_with_the_one_line_fix():
    f, states = Block(0).functionalize()
    with pytest.raises(StaticStateError) as info:
        f.eval(states)
    message = str(info.value)
    assert "Block.training" in message and "test_modes.py" in message
    assert "f_eval, states = autostate.freeze(f, states).eval().functionalize()" in message
    with pytest.raises(StaticStateError, match=r"\.train\(\)\.functionalize\(\)"):
        autostate.freeze(f, states).eval().functionalize()[0].train(states)


def test_f_train_of_a_model_already_training_changes_nothing():
    model = nn.Dropout(0.5, key=0)
    f, states = model.functionalize()
    _, new_states = f.train(states)
    assert jnp.array_equal(
        jax.random.key_data(new_states["key"]), jax.random.key_data(states["key"])
    )


def test_a_users_static_state_assigned_in_f_names_the_same_fix():
    @autostate.stateful
    class Flag:
        def __init__(self):
            self.training = True

        def eval(self):
            self.training = False

    f, states = Flag().functionalize()
    with pytest.raises(StaticStateError) as info:
        f.eval(states)
    assert "autostate.freeze(f, states).eval().functionalize()" in str(info.value)


def test_eval_of_the_frozen_trained_model_uses_its_running_statistics():
    model = Block(0)
    x = jax.random.normal(jax.random.key(1), (4, 2, 5, 5))
    f, states = model.functionalize()
    _, states = jax.jit(lambda f, s, x: f(s, x))(f, states, x)
    assert int(states["norm.num_batches_tracked"]) == 1
    f_eval, eval_states = autostate.freeze(f, states).eval().functionalize()
    out, after = f_eval(eval_states, x)
    frozen = autostate.freeze(f, states).eval()
    np.testing.assert_allclose(out, frozen(x), rtol=1e-6)
    np.testing.assert_array_equal(after["norm.running_mean"], states["norm.running_mean"])


class Tower(nn.Module):
    """nn layers under autostate.stack, looped over as a ModuleList would be."""

    def __init__(self, key, depth=3):
        super().__init__()
        keys = jax.random.split(jax.random.key(key), depth)
        self.blocks = autostate.stack([_block(k) for k in keys])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _block(key):
    return nn.Sequential(nn.Linear(4, 4, key=key), nn.BatchNorm1d(4), nn.Dropout(0.3, key=key))


def _listed(key, depth=3):
    return [_block(k) for k in jax.random.split(jax.random.key(key), depth)]


def _run_list(layers, x):
    for layer in layers:
        x = layer(x)
    return x


def test_a_stack_of_layers_switches_mode_as_a_module_list():
    tower = Tower(0)
    assert tower.blocks.eval() is tower.blocks
    assert all(not layer.training and not layer[2].training for layer in tower.blocks)
    assert tower.blocks.train() is tower.blocks and tower.blocks[1][1].training
    assert tower.eval() is tower and not tower.blocks.stacked.layers[1].training
    with pytest.raises(StateAccessError, match=r"stack\.train\(\)"):
        tower.blocks[0].train()  # one layer cannot switch alone
    tower.blocks.train(False)  # the stack's mode is a bool, as a module's
    with pytest.raises(InvalidArgumentError, match="takes a bool"):
        tower.blocks.train(1)


def test_a_stack_of_layers_trains_and_evaluates_as_the_list_of_them():
    x = jax.random.normal(jax.random.key(1), (5, 4))
    listed, eager, compiled = _listed(0), Tower(0), Tower(0)
    step = autostate.jit(lambda m, x: m(x))
    f, states = Tower(0).functionalize()
    out_f, states = jax.jit(lambda f, s, x: f(s, x))(f, states, x)
    expected = _run_list(listed, x)  # training: batch statistics, dropout
    for out in (eager(x), step(compiled, x), out_f):
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    for i, layer in enumerate(listed):
        for model in (eager, compiled, autostate.freeze(f, states)):
            np.testing.assert_allclose(
                model.blocks[i][1].running_var, layer[1].running_var, rtol=1e-6
            )
    for layer in listed:
        layer.eval()
    expected = _run_list(listed, x)  # evaluation: running statistics, no dropout
    f_eval, states = autostate.freeze(f, states).eval().functionalize()
    out_f, _ = jax.jit(lambda f, s, x: f(s, x))(f_eval, states, x)
    eager.blocks.eval()  # the stack's own eval(), as a ModuleList's
    for out in (eager(x), step(compiled.eval(), x), out_f):
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
