"""``autostate/state_dicts.py``: state_dict, param_dict and loading them."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from differential import check, pair  # noqa: I001 - tests/ is on sys.path
from export_models import (  # noqa: I001 - tests/ is on sys.path
    PARAM_KEYS,
    STATE_KEYS,
    XS,
    Net,
    Pairs,
    assert_same_arrays,
    bits,
    run,
)

import autostate
from autostate.errors import AutostateError, StateDictError, StateDictWarning

render_module = sys.modules["autostate.render"]


# --- state_dict / load_state_dict ------------------------------------------------


def test_state_dict_names_follow_functionalize():
    model = Net()
    sd = autostate.state_dict(model)
    assert list(sd) == STATE_KEYS
    _, states = model.functionalize()
    assert list(states) == [k for k in STATE_KEYS[:6]] + ["cache", "ema", "table['ids']"]
    assert sd["blocks[0].norm.var"] is states["blocks[0].norm.var"]
    assert sd["cache['t']"] is states["cache"]["t"]
    assert sd["ema"].dtype == jnp.bfloat16


def test_state_dict_flattens_pytree_states_by_keypath():
    model = Pairs()
    model(jnp.full((2,), 3.0))
    sd = autostate.state_dict(model)
    assert list(sd) == ["pair[0]", "pair[1]['a']"]  # the empty dict state has no leaves
    np.testing.assert_array_equal(sd["pair[0]"], [3.0, 3.0])
    np.testing.assert_array_equal(sd["pair[1]['a']"], [2])
    loaded = autostate.load_state_dict(Pairs(), sd)
    assert_same_arrays(autostate.state_dict(loaded), sd)
    f, states = loaded.functionalize()
    assert states["log"] == {}
    assert isinstance(states["pair"], tuple) and isinstance(states["pair"][1], dict)


def test_state_dict_after_steps_counts_aliased_state_once():
    _, trained = run(Net(), XS[:3])
    sd = autostate.state_dict(trained)
    assert list(sd) == STATE_KEYS
    assert int(sd["blocks[0].calls"]) == 3  # `first` and `blocks[0]` are one block
    assert int(sd["blocks[1].calls"]) == 3
    assert int(sd["cache['t']"]) == 3


def test_load_state_dict_round_trips_and_leaves_the_model_alone():
    _, trained = run(Net(), XS[:2])
    fresh = Net()
    before = autostate.state_dict(fresh)
    loaded = autostate.load_state_dict(fresh, autostate.state_dict(trained))
    assert type(loaded) is Net and loaded.act == "tanh"
    assert loaded.first is loaded.blocks[0]
    assert_same_arrays(autostate.state_dict(loaded), autostate.state_dict(trained))
    assert_same_arrays(autostate.state_dict(fresh), before)
    want, _ = run(trained, XS[2:])
    got, _ = run(loaded, XS[2:])
    for a, b in zip(got, want):
        assert bits(a) == bits(b)


def test_load_state_dict_strict_lists_every_offending_key():
    bad = dict(autostate.state_dict(Net()))
    del bad["ema"], bad["blocks[1].calls"]
    bad["emma"] = jnp.zeros(3)
    bad["blocks[0].norm.mean"] = jnp.zeros(4)
    bad["cache['t']"] = jnp.zeros((), jnp.float32)
    model = Net()
    with pytest.raises(StateDictError) as info:
        autostate.load_state_dict(model, bad)
    message = str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, AutostateError)
    assert "missing state keys (2): 'blocks[1].calls', 'ema'" in message
    assert "unexpected state keys (1): 'emma'" in message
    assert "'blocks[0].norm.mean' (model f32[3], given f32[4])" in message
    assert "\"cache['t']\" (model i32[], given f32[])" in message
    assert "Net" in message and "fix: " in message and "strict=False" in message


def test_load_state_dict_non_strict_loads_what_fits_and_reports_the_rest():
    _, trained = run(Net(), XS[:1])
    sd = autostate.state_dict(trained)
    partial = {k: v for k, v in sd.items() if k != "ema"}
    partial["blocks[0].norm.var"] = jnp.zeros(5)
    partial["extra"] = jnp.zeros(1)
    fresh = Net()
    with pytest.warns(StateDictWarning, match="strict=False skipped") as record:
        loaded = autostate.load_state_dict(fresh, partial, strict=False)
    warning = record[0].message
    assert warning.missing == (("state", "ema"),)
    assert warning.unexpected == (("state", "extra"),)
    assert warning.mismatched == (("state", "blocks[0].norm.var"),)
    got, kept = autostate.state_dict(loaded), autostate.state_dict(fresh)
    assert bits(got["ema"]) == bits(kept["ema"])
    assert bits(got["blocks[0].norm.var"]) == bits(kept["blocks[0].norm.var"])
    assert bits(got["blocks[0].norm.mean"]) == bits(sd["blocks[0].norm.mean"])
    assert int(got["cache['t']"]) == 1


def test_functionalized_model_is_rejected_with_a_fix():
    f, states = Net().functionalize()
    with pytest.raises(TypeError, match=r"state_dict\(f, states\)"):
        autostate.state_dict(f)
    assert list(autostate.state_dict(f, states)) == STATE_KEYS
    with pytest.raises(StateDictError, match="handled by a functionalize"):
        autostate.state_dict(f.model)
    assert list(autostate.state_dict(autostate.freeze(f, states))) == STATE_KEYS


# --- param_dict / load_param_dict -----------------------------------------------


def test_param_dict_names_every_non_state_array_once():
    model = Net()
    pd = autostate.param_dict(model)
    assert list(pd) == PARAM_KEYS
    assert pd["blocks[0].w"] is model.blocks[0].w
    assert pd["half"].dtype == jnp.bfloat16
    assert autostate.state_dict(model)["table['ids']"].dtype == jnp.int32  # not trained
    assert pd["gain"].shape == ()


def test_load_param_dict_round_trips_and_checks():
    source, target = Net(seed=0), Net(seed=5)
    loaded = autostate.load_param_dict(target, autostate.param_dict(source))
    assert_same_arrays(autostate.param_dict(loaded), autostate.param_dict(source))
    assert loaded.first is loaded.blocks[0]
    assert_same_arrays(autostate.state_dict(loaded), autostate.state_dict(target))
    assert float(target.gain) == 7.0  # untouched

    bad = dict(autostate.param_dict(source))
    bad["half"] = bad["half"].astype(jnp.float32)
    del bad["gain"]
    with pytest.raises(StateDictError) as info:
        autostate.load_param_dict(target, bad)
    message = str(info.value)
    assert "missing parameter keys (1): 'gain'" in message
    assert "'half' (model bf16[3], given f32[3])" in message


def test_whole_model_round_trips_through_flat_dicts():
    _, trained = run(Net(seed=0), XS[:2])
    flat = {"params": autostate.param_dict(trained), "states": autostate.state_dict(trained)}
    clone = autostate.load_state_dict(
        autostate.load_param_dict(Net(seed=7), flat["params"]), flat["states"]
    )
    want, _ = run(trained, XS[2:])
    got, _ = run(clone, XS[2:])
    for a, b in zip(got, want):
        assert bits(a) == bits(b)


# --- the flat dicts inside a method --------------------------------------------------

IN_METHODS = """
@DECORATE
class Net:
    def __init__(self, w):
        self.w = w
        self.count = jnp.zeros(())       # a state: the sub-model is handled inside f

    def __call__(self, x):
        self.count = self.count + 1
        return x * self.w


@DECORATE
class EMA:
    def __init__(self, model, decay=0.5):
        self.model = model
        self.decay = decay
        self.ema = autostate.state(jax.tree.map(jnp.zeros_like, autostate.param_dict(model)))

    def __call__(self, x):
        y = self.model(x)
        d = self.decay
        self.ema = jax.tree.map(
            lambda e, p: d * e + (1 - d) * p, self.ema, autostate.param_dict(self.model)
        )
        return y


@DECORATE
class TargetNet:
    def __init__(self):
        self.online = Net(jnp.array([1.0, 2.0]))
        self.target = Net(jnp.zeros(2))
        self.target_params = autostate.state(autostate.param_dict(self.target))

    def __call__(self, x):
        target = autostate.load_param_dict(self.target, self.target_params)
        return self.online(x) + target(x), target.count

    def sync(self):
        self.target_params = autostate.param_dict(self.online)

    def swap(self):
        self.target = autostate.load_param_dict(self.target, autostate.param_dict(self.online))
"""

X2 = jnp.array([1.0, 3.0])


def test_param_dict_of_a_sub_model_in_a_method_means_what_it_means_eagerly(write_module):
    # (The eager model is the reference: param_dict is autostate's own function.)
    _, dec = pair(write_module, IN_METHODS)
    check(dec, dec, "EMA(Net(jnp.array([2.0, 4.0])))", [("__call__", (X2,))] * 3)


def test_param_dict_in_a_jitted_method_follows_the_trained_parameters(write_module):
    _, dec = pair(write_module, IN_METHODS)
    f, states = dec.EMA(dec.Net(jnp.array([2.0, 4.0]))).functionalize()
    step = jax.jit(lambda f, s, x: f(s, x))
    _, states = step(f, states, X2)
    f = jax.tree.map(lambda p: p * 3, f)  # an optimizer step on f's parameters
    _, states = step(f, states, X2)
    # (ema starts at 0: after step 1 it is 0.5 * [2, 4], after step 2 it takes in [6, 12].)
    np.testing.assert_allclose(states["ema"]["w"], [0.5 * 1.0 + 0.5 * 6.0, 0.5 * 2.0 + 0.5 * 12.0])
    assert float(states["model.count"]) == 2.0


def test_load_param_dict_in_a_method_builds_a_model_of_the_call(write_module):
    _, dec = pair(write_module, IN_METHODS)
    calls = [("__call__", (X2,)), ("sync", ()), ("__call__", (X2,))]
    check(dec, dec, "TargetNet()", calls)
    f, states = dec.TargetNet().functionalize()
    _, states = f.sync(states)
    (out, count), _ = jax.jit(lambda f, s, x: f(s, x))(f, states, X2)
    np.testing.assert_array_equal(out, 2 * X2 * jnp.array([1.0, 2.0]))
    assert float(count) == 1.0  # the temporary model's own state, written inside the trace


def test_assigning_a_loaded_sub_model_in_a_method_says_how_to_do_it_there(write_module):
    _, dec = pair(write_module, IN_METHODS)
    f, states = dec.TargetNet().functionalize()
    with pytest.raises(AutostateError) as info:
        jax.jit(lambda f, s: f.swap(s))(f, states)
    message = str(info.value)
    assert "autostate.load_param_dict(self.target, self.target_params)(x)" in message
    assert f"{dec.__file__}:" in message
