"""``autostate/state_dicts.py``: state_dict, param_dict and loading them."""

from __future__ import annotations

import io
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from export_models import PARAM_KEYS, STATE_KEYS, XS, Net, Pairs, assert_same_arrays, bits, run
from semantics.harness import (
    OPTIMIZERS,
    assert_clear,
    assert_same,
    assert_step,
    assert_user_line,
    build_pair,
    check,
    data_for,
    f_loss,
    f_train_step,
    library,
    names_of,
    pair,
    raises_autostate,
    run_reference,
    snapshot,
)
from semantics.programs_eager_writes import SOURCE
from semantics.programs_escapes import TORCH_TRAINING as TORCH
from semantics.programs_functional import CATS, MODELS, NET, PACK, VARIANTS
from semantics.programs_numerics import DTYPES, ODD
from semantics.programs_shared import ONE, TORCH_HEADER, X_BATCH, XV2, Loader
from semantics.programs_shared import XV1 as X1
from semantics.programs_shared import Y_BATCH as Y
from semantics.references import assert_shared, trained_pair

import autostate
from autostate import errors
from autostate.errors import (
    AutostateError,
    StateDictError,
    StateDictWarning,
)

HERE = __file__


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


@pytest.mark.parametrize("compiled", [False, True])
def test_load_param_dict_copies_so_a_target_network_is_not_tied_to_its_source(compiled):
    # A DQN's sync: the target takes the online network's values, then only the
    # online one trains. Arrays tie by identity, so a loaded array must be a copy.
    import optax

    from autostate import nn

    class Agent(nn.Module):
        def __init__(self):
            self.q, self.target = nn.Linear(3, 2, key=0), nn.Linear(3, 2, key=1)

        def forward(self, x):
            return jnp.sum((self.q(x) - 1.0 - jax.lax.stop_gradient(self.target(x))) ** 2)

    agent = Agent()
    opt = autostate.Optimizer(agent, optax.sgd(0.1))

    def step(agent, opt, x):
        _, grads = autostate.value_and_grad(lambda a, x: a(x))(agent, x)
        opt.update(grads)

    step = autostate.jit(step) if compiled else step
    x = jnp.arange(6.0).reshape(2, 3)
    for _ in range(2):  # from the second sync on the arrays are committed: device_put aliased them
        step(agent, opt, x)
        agent.target = autostate.load_param_dict(agent.target, autostate.param_dict(agent.q))
    synced = np.asarray(agent.target.weight)
    assert sorted(autostate.param_dict(agent)) == [
        "q.bias", "q.weight", "target.bias", "target.weight"
    ]
    step(agent, opt, x + 1)
    np.testing.assert_array_equal(np.asarray(agent.target.weight), synced)
    assert not np.array_equal(np.asarray(agent.q.weight), synced)


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


def test_state_dict_round_trip_into_a_fresh_model(write_module: Loader) -> None:
    plain, dec = pair(write_module, DTYPES)
    for build in ("Trees()", "Keys(2)", "Typed(jnp.bfloat16)", "Py()"):
        d = eval(build, vars(dec))  # noqa: S307
        p = eval(build, vars(plain))  # noqa: S307
        arg = (1,) if "Typed" in build else (1.0,)
        name = "__call__" if "Keys" in build else "step"
        getattr(d, name)(*arg)
        getattr(p, name)(*arg)
        fresh = autostate.load_state_dict(eval(build, vars(dec)), autostate.state_dict(d))  # noqa: S307
        assert_same(snapshot(p), snapshot(fresh), build)
        assert_same(getattr(p, name)(*arg), getattr(fresh, name)(*arg), build)


def test_state_dict_of_f_and_mismatch(write_module: Loader) -> None:
    _, dec = pair(write_module, VARIANTS)
    f, states = dec.Mixed().functionalize()
    _, states = f(states, 1.0)
    sd = autostate.state_dict(f, states)
    assert sorted(sd) == ["kv", "n"]
    model = autostate.load_state_dict(dec.Mixed(), sd)
    assert_same(np.ones(2), model.n)
    with pytest.raises(errors.StateDictError, match="'n'"):
        autostate.load_state_dict(dec.Mixed(), {**sd, "n": jnp.ones(2, jnp.int32)})
    with pytest.raises(errors.StateDictError, match="missing"):
        autostate.load_state_dict(dec.Mixed(), {"n": sd["n"]})


def test_param_dict_round_trip(write_module: Loader) -> None:
    plain, dec = pair(write_module, VARIANTS)
    pd = autostate.param_dict(dec.Two())
    assert sorted(pd) == ["p.shared.w"]  # the tied weight appears once
    model = autostate.load_param_dict(dec.Two(), {"p.shared.w": jnp.full(2, 3.0)})
    assert model.q.shared.w is model.p.shared.w
    p = plain.Two()
    p.p.shared.w = jnp.full(2, 3.0)
    assert_same(p(1.0), model(1.0))


def train_some(f: Any, states: Any, data: Any, opt: str = "sgd") -> tuple[Any, Any, Any]:
    opt_state = OPTIMIZERS[opt][0](f)
    step = f_train_step(opt)
    losses = []
    for x, y in data:
        loss, f, opt_state, states = step(f, opt_state, states, x, y)
        losses.append(loss)
    return f, states, losses


@pytest.mark.parametrize("restore", ["tree_map_with_path", "load_dicts", "save_load"])
def test_numpy_dicts_restored_into_a_fresh_model(write_module: Loader, restore: str,
                                                 tmp_path: Any) -> None:
    plain, dec = library(write_module)
    template, model, n_out = build_pair(plain, dec, "mlp_dropout")
    data = data_for(n_out, 6)
    f, states = model.functionalize()
    ref = run_reference(template, names_of(f), dict(states), "adam", data)
    f, states, _ = train_some(f, states, data[:3], "adam")
    buf = io.BytesIO()
    np.savez(buf, **{"p:" + k: np.asarray(v) for k, v in names_of(f).items()},
             **{"s:" + k: np.asarray(v) for k, v in states.items()})
    buf.seek(0)
    loaded = dict(np.load(buf))
    params = {k[2:]: v for k, v in loaded.items() if k.startswith("p:")}
    saved_states = {k[2:]: v for k, v in loaded.items() if k.startswith("s:")}
    fresh = dec.MLP(jax.random.PRNGKey(7), 3, 2, rate=0.5)
    if restore == "tree_map_with_path":
        f2, _ = fresh.functionalize()
        f2 = jax.tree_util.tree_map_with_path(
            lambda p, _: jnp.asarray(params[jax.tree_util.keystr(p)[len(".model."):]]), f2)
        s2 = {k: jnp.asarray(v) for k, v in saved_states.items()}
    elif restore == "load_dicts":
        fresh = autostate.load_param_dict(fresh, params)
        fresh = autostate.load_state_dict(fresh, saved_states)
        f2, s2 = fresh.functionalize()
    else:
        autostate.save(tmp_path / "ckpt.npz", autostate.freeze(f, states))
        f2, s2 = autostate.load(tmp_path / "ckpt.npz", like=fresh).functionalize()
    # Opt state restarts: compare the next step with a fresh-opt reference from step 3.
    r_params, r_states = ref[2][1], ref[2][2]
    ref2 = run_reference(template, r_params, r_states, "sgd", data[3:])
    step = f_train_step("sgd")
    for i, (x, y) in enumerate(data[3:]):
        loss, f2, _, s2 = step(f2, (), s2, x, y)
        assert_step(ref2[i], loss, f2, s2, f"{restore} step {i}")


def test_ema_of_param_dict_inside_the_jitted_step(write_module: Loader) -> None:
    """docs/ecosystem.md: ``autostate.param_dict(f)`` works inside a jitted step."""
    plain, dec = library(write_module)
    template, model, n_out = build_pair(plain, dec, "multihead")
    data = data_for(n_out, 3)
    f, states = model.functionalize()
    ema = {k: jnp.copy(v) for k, v in autostate.param_dict(f).items()}
    assert_same(names_of(f), ema)
    ref = run_reference(template, names_of(f), dict(states), "sgd", data)
    _, update = OPTIMIZERS["sgd"]

    @jax.jit
    def step(f: Any, ema: Any, states: Any, x: Any, y: Any) -> Any:
        (loss, states), g = jax.value_and_grad(f_loss, has_aux=True)(f, states, x, y)
        f, _ = update(f, g, ())
        pd = autostate.param_dict(f)
        ema = {k: 0.5 * ema[k] + 0.5 * pd[k] for k in ema}
        return loss, f, ema, states

    ref_ema = dict(ema)
    for i, (x, y) in enumerate(data):
        loss, f, ema, states = step(f, ema, states, x, y)
        assert_step(ref[i], loss, f, states, f"step {i}")
        ref_ema = {k: 0.5 * ref_ema[k] + 0.5 * ref[i][1][k] for k in ref_ema}
        assert_same(ref_ema, ema, f"ema {i}")


def test_loading_into_another_structure_is_a_clear_error(write_module: Loader, tmp_path: Path) -> None:
    src = PACK + CATS
    _, dec = pair(write_module, src)
    model = dec.Mixed(0)
    with pytest.raises(errors.StateDictError) as info:
        autostate.load_state_dict(dec.Decoder(), autostate.state_dict(model))
    message = str(info.value)
    assert "missing" in message and "unexpected" in message and "'steps'" not in message.split(
        "unexpected")[0].split("missing")[0]
    assert "kv" in message and "key" in message and "fix" in message
    autostate.save(tmp_path / "m.npz", model)
    with pytest.raises(autostate.AutostateError) as info2:
        autostate.load(tmp_path / "m.npz", like=dec.Decoder())
    assert "fix" in str(info2.value)
    with pytest.raises(errors.StateDictError) as info3:
        autostate.load_param_dict(dec.Mixed(0), {"w": jnp.zeros((3, 4))}, strict=True)
    assert "'w'" in str(info3.value)


def test_load_state_dict_with_a_wrong_dtype_is_refused_not_cast(write_module: Loader) -> None:
    _, dec = pair(write_module, PACK)
    sd = dict(autostate.state_dict(dec.Mixed(0)))
    sd["hb"] = sd["hb"].astype(jnp.float32)
    sd["steps"] = sd["steps"].astype(jnp.float32)
    with pytest.raises(errors.StateDictError) as info:
        autostate.load_state_dict(dec.Mixed(0), sd)
    assert "'hb'" in str(info.value) and "'steps'" in str(info.value)


@pytest.fixture
def mods(write_module: Loader) -> tuple[types.ModuleType, types.ModuleType]:
    return pair(write_module, MODELS)


@pytest.mark.parametrize(
    "load", ["state_shape", "state_unexpected", "param_shape", "param_is_state"]
)
def test_load_dict_errors_name_the_user_line(mods: Any, load: str) -> None:
    _, dec = mods
    model = dec.Counter()
    calls: dict[str, Callable[[], Any]] = {
        "state_shape": lambda: autostate.load_state_dict(model, {"count": jnp.ones(3)}),
        "state_unexpected": lambda: autostate.load_state_dict(
            model, {"count": jnp.ones(()), "cnt": jnp.ones(())}
        ),
        "param_shape": lambda: autostate.load_param_dict(model, {"w": jnp.ones(3)}),
        "param_is_state": lambda: autostate.load_param_dict(model, {"count": jnp.ones(())}),
    }
    with raises_autostate(errors.StateDictError) as info:
        calls[load]()
    assert "does not fit Counter" in str(info.value)
    assert_clear(info.value, errors.StateDictError, HERE)


def test_load_state_dict_not_a_dict(mods: Any) -> None:
    _, dec = mods
    with raises_autostate(errors.InvalidTypeError) as info:
        autostate.load_state_dict(dec.Counter(), [jnp.ones(())])
    assert_clear(info.value, errors.InvalidTypeError, HERE, "got list")
    f, _ = dec.Counter().functionalize()
    with raises_autostate(errors.InvalidTypeError) as info:
        autostate.load_state_dict(f, {"count": jnp.ones(())})
    assert_clear(info.value, errors.InvalidTypeError, HERE, "got a FunctionalModel", "autostate.freeze(f, states)")


@pytest.mark.parametrize("load", ["load_state_dict", "load_param_dict"])
def test_load_dict_none(mods: Any, load: str) -> None:
    _, dec = mods
    with raises_autostate(errors.InvalidTypeError) as info:
        getattr(autostate, load)(dec.Counter(), None)
    assert_clear(info.value, errors.InvalidTypeError, HERE, "NoneType")


def test_state_dict_of_f_without_states(mods: Any) -> None:
    _, dec = mods
    f, _ = dec.Counter().functionalize()
    with raises_autostate(errors.InvalidTypeError) as info:
        autostate.state_dict(f)
    assert_clear(info.value, errors.InvalidTypeError, HERE, "state_dict(f, states)")
    with raises_autostate(errors.InvalidTypeError) as info:
        autostate.state_dict(dec.Counter(), {"count": jnp.zeros(())})
    assert_clear(info.value, errors.InvalidTypeError, HERE, "only with an f")


def test_state_dict_of_f_with_a_list(mods: Any) -> None:
    _, dec = mods
    f, states = dec.Counter().functionalize()
    with raises_autostate(errors.InvalidTypeError) as info:
        autostate.state_dict(f, list(states.values()))
    assert_clear(info.value, errors.InvalidTypeError, HERE)


def source_modules(write_module: Loader) -> tuple[types.ModuleType, types.ModuleType]:
    return pair(write_module, SOURCE)


def test_param_dict_and_load_param_dict_of_a_shared_entry(write_module: Loader) -> None:
    plain, dec = source_modules(write_module)
    pd = autostate.param_dict(dec.Paths())
    assert sorted(pd) == ["d['b'].w", "enc.w"]
    loaded = autostate.load_param_dict(dec.Paths(), {"enc.w": jnp.full((2,), 5.0), "d['b'].w": ONE})
    assert loaded.enc is loaded.dec_in is loaded.layers[1] is loaded.d["a"] is loaded.t[0]
    assert_same(np.full((2,), 5.0), loaded.t[0].w)
    p = plain.Paths()
    p.enc.w, p.d["b"].w = jnp.full((2,), 5.0), ONE
    assert_same(p(ONE), loaded(ONE))
    assert_same(snapshot(p), snapshot(loaded))


def test_load_state_dict_of_a_shared_entry_and_of_an_alias_path(write_module: Loader) -> None:
    plain, dec = source_modules(write_module)
    sd = {"enc.n": jnp.full((), 7.0), "d['b'].n": jnp.full((), 1.0)}
    loaded = autostate.load_state_dict(dec.Paths(), sd)
    assert loaded.enc is loaded.layers[0] is loaded.d["a"]
    assert_same(np.full((), 7.0), loaded.layers[1].n)
    p = plain.Paths()
    p.enc.n, p.d["b"].n = sd["enc.n"], sd["d['b'].n"]
    assert_same(p(ONE), loaded(ONE))
    # The alias path is not a key: a clear error naming the key the model has.
    with raises_autostate(errors.StateDictError) as err:
        autostate.load_state_dict(dec.Paths(), {"dec_in.n": jnp.ones(()), "d['b'].n": jnp.ones(())})
    assert "dec_in.n" in str(err.value) and "enc.n" in str(err.value)
    assert_user_line(err.value, __file__.rpartition("/")[2])


def test_tied_initial_state_loaded_separately(write_module: Loader) -> None:
    plain, dec = source_modules(write_module)
    sd = {"a.mean": jnp.full(2, 1.0), "b.mean": jnp.full(2, 4.0)}
    loaded = autostate.load_state_dict(dec.TiedStat(), sd)
    p = plain.TiedStat()
    p.a.mean, p.b.mean = sd["a.mean"], sd["b.mean"]
    assert_same(p(ONE), loaded(ONE))
    assert_same(snapshot(p), snapshot(loaded))


def step_jit() -> Callable[..., Any]:
    return jax.jit(lambda f, s, x: f(s, x))


def test_state_and_param_dict_into_a_fresh_model(write_module: Loader) -> None:
    plain, dec = pair(write_module, NET)
    ref, model = trained_pair(plain, dec)
    sd, pd = autostate.state_dict(model), autostate.param_dict(model)
    assert "by['b'].count" not in sd and "items[1].count" in sd  # first path of the shared one
    assert "by['b'].w" not in pd and "items[1].w" in pd
    loaded = autostate.load_state_dict(autostate.load_param_dict(dec.Net(), pd), sd)
    assert_shared(loaded)
    assert_same(snapshot(ref), snapshot(loaded), "loaded")
    assert_same(ref(XV2), loaded(XV2), "loaded steps")
    assert_same(snapshot(ref), snapshot(loaded), "loaded stepped")
    # the dicts of f and states name the same arrays
    f, states = loaded.functionalize()
    assert_same(autostate.state_dict(loaded), autostate.state_dict(f, states), "sd of f")
    assert_same(autostate.param_dict(loaded), autostate.param_dict(f), "pd of f")


def test_state_dict_into_a_model_with_other_init_values(write_module: Loader) -> None:
    plain, dec = pair(write_module, NET)
    _, model = trained_pair(plain, dec)
    sd = autostate.state_dict(model)
    ref = plain.Net(3.0)  # other parameters; the states of the trained model
    for key, value in sd.items():
        exec("m." + key + " = v", {"m": ref, "v": value})  # noqa: S102
    loaded = autostate.load_state_dict(dec.Net(3.0), sd)
    assert_same(snapshot(ref), snapshot(loaded), "states loaded, params kept")
    assert_same(ref(X1), loaded(X1), "stepped")
    # and the parameters into a model with other states
    pd = autostate.param_dict(model)
    ref2 = plain.Net(3.0)
    ref2(XV2)
    for key, value in pd.items():
        exec("m." + key + " = v", {"m": ref2, "v": value})  # noqa: S102
    fresh = dec.Net(3.0)
    fresh(XV2)
    loaded2 = autostate.load_param_dict(fresh, pd)
    assert_same(snapshot(ref2), snapshot(loaded2), "params loaded, states kept")
    untouched = plain.Net(3.0)
    untouched(XV2)
    assert_same(snapshot(untouched), snapshot(fresh), "load_param_dict changed its argument")


def test_load_state_dict_does_not_touch_its_argument(write_module: Loader) -> None:
    plain, dec = pair(write_module, NET)
    _, model = trained_pair(plain, dec)
    fresh = dec.Net()
    autostate.load_state_dict(fresh, autostate.state_dict(model))
    assert_same(snapshot(plain.Net()), snapshot(fresh), "argument changed")


@pytest.mark.parametrize("fault", ["missing", "extra", "shape", "dtype"])
def test_state_dict_that_does_not_fit_is_a_clear_error(write_module: Loader, fault: str) -> None:
    plain, dec = pair(write_module, NET)
    _, model = trained_pair(plain, dec)
    sd = dict(autostate.state_dict(model))
    if fault == "missing":
        del sd["pair[1].mean"]
    elif fault == "extra":
        sd["pair[2].mean"] = jnp.zeros(2)
    elif fault == "shape":
        sd["total"] = jnp.zeros(3)
    else:
        sd["seen"] = jnp.zeros((), jnp.float32)
    with pytest.raises(StateDictError) as info:
        autostate.load_state_dict(dec.Net(), sd)
    assert_user_line(info.value, __file__.rpartition("/")[2])
    key = {"missing": "pair[1].mean", "extra": "pair[2].mean", "shape": "total", "dtype": "seen"}
    assert repr(key[fault]) in str(info.value)
    # strict=False: what fits is loaded, the rest keeps the model's values, with a warning
    with pytest.warns(StateDictWarning):
        loaded = autostate.load_state_dict(dec.Net(), sd, strict=False)
    fresh = dec.Net()
    for k, v in autostate.state_dict(loaded).items():
        expect = sd[k] if k != key[fault] else autostate.state_dict(fresh)[k]
        assert_same(expect, v, k)


@pytest.mark.parametrize("fault", ["missing", "extra", "shape"])
def test_param_dict_that_does_not_fit_is_a_clear_error(write_module: Loader, fault: str) -> None:
    plain, dec = pair(write_module, NET)
    pd = dict(autostate.param_dict(dec.Net(2.0)))
    if fault == "missing":
        del pd["bias"]
    elif fault == "extra":
        pd["items[2].w"] = jnp.zeros(2)
    else:
        pd["items[0].w"] = jnp.zeros((2, 1))
    with pytest.raises(StateDictError) as info:
        autostate.load_param_dict(dec.Net(), pd)
    assert_user_line(info.value, __file__.rpartition("/")[2])


def test_state_dict_after_a_sub_model_was_replaced(write_module: Loader) -> None:
    plain, dec = pair(write_module, NET)
    ref, model = trained_pair(plain, dec)
    ref.items[0] = plain.Leaf(9.0)
    model.items[0] = dec.Leaf(9.0)
    ref.pair = (ref.pair[0], plain.Leaf(-3.0))
    model.pair = (model.pair[0], dec.Leaf(-3.0))
    ref(X1), model(X1)
    sd, pd = autostate.state_dict(model), autostate.param_dict(model)
    assert_same(np.full(2, 9.0), pd["items[0].w"], "new sub-model's parameter")
    assert_same(np.asarray(1), sd["items[0].count"], "new sub-model's count")
    loaded = autostate.load_state_dict(autostate.load_param_dict(dec.Net(), pd), sd)
    assert_same(snapshot(ref), snapshot(loaded), "loaded after replacing")
    f, states = loaded.functionalize()
    out, states = step_jit()(f, states, XV2)
    assert_same(ref(XV2), out, "stepped after replacing")
    assert_same(snapshot(ref), snapshot(autostate.freeze(f, states)), "frozen after replacing")


def test_state_dict_of_f_inside_jit(write_module: Loader) -> None:
    plain, dec = pair(write_module, NET)
    ref, model = trained_pair(plain, dec)
    f, states = model.functionalize()

    @jax.jit
    def step(f: Any, states: Any, x: Any) -> Any:
        _, states = f(states, x)
        return autostate.state_dict(f, states), autostate.param_dict(f)

    sd, pd = step(f, states, XV2)
    ref(XV2)
    loaded = autostate.load_state_dict(autostate.load_param_dict(dec.Net(), pd), sd)
    assert_same(snapshot(ref), snapshot(loaded), "dicts made inside jit")


def test_odd_states_state_dict_round_trip_of_an_eager_model(write_module: Loader) -> None:
    plain, dec = pair(write_module, ODD)
    ref, model = plain.Odd(), dec.Odd()
    ref(X1), model(X1)
    sd = autostate.state_dict(model)
    assert not any(k.startswith(("empty", "nothing")) for k in sd)
    loaded = autostate.load_state_dict(dec.Odd(), sd)
    assert_same(snapshot(ref), snapshot(loaded), "loaded")
    assert_same(ref(XV2), loaded(XV2), "stepped")


def test_python_float_state_state_dict_after_jit_loads_into_a_fresh_model(
        write_module: Loader) -> None:
    plain, dec = pair(write_module, ODD)
    ref = plain.Odd()
    f, states = dec.Odd().functionalize()
    out, states = step_jit()(f, states, X1)
    ref(X1)
    sd = autostate.state_dict(autostate.freeze(f, states))
    loaded = autostate.load_state_dict(dec.Odd(), sd)
    assert_same(snapshot(ref), snapshot(loaded), "loaded")


def test_python_float_state_state_dict_eager_loads_into_a_jit_trained_model(
        write_module: Loader) -> None:
    plain, dec = pair(write_module, ODD)
    ref, eager = plain.Odd(), dec.Odd()
    for x in (X1, XV2):
        ref(x), eager(x)
    f, states = dec.Odd().functionalize()
    _, states = step_jit()(f, states, X1)
    loaded = autostate.load_state_dict(autostate.freeze(f, states), autostate.state_dict(eager))
    assert_same(snapshot(ref), snapshot(loaded), "loaded")


def test_state_dict_of_f_with_a_missing_state_is_an_error(write_module: Loader) -> None:
    plain, dec = pair(write_module, NET)
    f, states = dec.Net().functionalize()
    partial = {k: v for k, v in states.items() if k != "total"}
    with pytest.raises(autostate.AutostateError):
        autostate.freeze(f, partial)
    with pytest.raises(autostate.AutostateError):
        autostate.state_dict(f, partial)


def batch(i: int) -> tuple[Any, Any]:
    return X_BATCH * (1.0 + 0.25 * i) - 0.1 * i, Y + 0.1 * i


def torch(write_module: Loader) -> tuple[types.ModuleType, types.ModuleType]:
    return pair(write_module, TORCH_HEADER + TORCH)


def test_lazily_filled_optimizer_state_does_not_load_into_a_fresh_one(
    write_module: Loader, tmp_path: Path
) -> None:
    """The checkpoint has moments a fresh LazyAdam has not created yet: a clear
    CheckpointError naming them (errors.md: load into a model of the same configuration)."""
    _, dec = torch(write_module)
    trainer = dec.adam_trainer("LazyAdam")
    trainer.fit_step(*batch(0))
    autostate.save(tmp_path / "t.npz", trainer)
    with raises_autostate(errors.CheckpointError) as err:
        autostate.load(tmp_path / "t.npz", like=dec.adam_trainer("LazyAdam"))
    assert "opt.state['l1.b']['m']" in str(err.value)


@autostate.stateful
class Counter:
    def __init__(self):
        self.count = jnp.zeros(())
        self.w = jnp.ones(2)

    def __call__(self, x):
        self.count += 1
        return x * self.w * self.count

    def scaled(self, x, k):
        self.count += 1
        return x * k


def assert_clear_api_misuse_fixes(err: BaseException, exc_type: type[BaseException], *needles: str) -> None:
    assert isinstance(err, exc_type), f"{type(err).__name__}: {err}"
    assert isinstance(err, autostate.AutostateError)
    text = str(err)
    assert f"{__file__}:" in text, f"no user line in: {text}"
    assert "fix:" in text, f"no fix in: {text}"
    for needle in needles:
        assert needle in text, f"{needle!r} not in: {text}"


@pytest.mark.parametrize(
    ("load", "given", "needle"),
    [
        ("load_state_dict", {"count": jnp.ones(3)}, "state shape/dtype mismatches"),
        ("load_state_dict", {"count": jnp.ones(()), "cnt": jnp.ones(())}, "unexpected state"),
        ("load_state_dict", {}, "missing state keys"),
        ("load_param_dict", {"w": jnp.ones(3)}, "parameter shape/dtype mismatches"),
        ("load_param_dict", {"count": jnp.ones(())}, "unexpected parameter"),
        ("load_param_dict", {}, "missing parameter keys"),
    ],
)
def test_strict_load_errors_name_the_user_line(load: str, given: dict, needle: str) -> None:
    with pytest.raises(errors.StateDictError) as info:
        getattr(autostate, load)(Counter(), given)
    assert_clear_api_misuse_fixes(info.value, errors.StateDictError, "does not fit Counter", needle)


@pytest.mark.parametrize("load", ["load_state_dict", "load_param_dict"])
@pytest.mark.parametrize(
    ("given", "name"), [(None, "NoneType"), ([jnp.ones(())], "list"), (jnp.ones(()), "ArrayImpl")]
)
def test_load_of_something_not_a_dict(load: str, given: object, name: str) -> None:
    with pytest.raises(errors.InvalidTypeError) as info:
        getattr(autostate, load)(Counter(), given)
    assert_clear_api_misuse_fixes(info.value, errors.InvalidTypeError, f"got {name}", f"autostate.{load}")


def test_load_still_loads() -> None:
    model = autostate.load_state_dict(Counter(), {"count": jnp.full((), 3.0)})
    model = autostate.load_param_dict(model, {"w": jnp.full(2, 2.0)})
    ref = Counter()
    ref.count, ref.w = jnp.full((), 3.0), jnp.full(2, 2.0)
    np.testing.assert_array_equal(model(jnp.ones(2)), ref(jnp.ones(2)))
    np.testing.assert_array_equal(model.count, ref.count)


@pytest.mark.parametrize("kind", ["list", "tuple", "array", "packed"])
def test_state_dict_of_f_with_states_not_a_dict(kind: str) -> None:
    f, states = Counter().functionalize()
    given = {
        "list": list(states.values()),
        "tuple": tuple(states.values()),
        "array": jnp.zeros(()),
        "packed": autostate.pack(f, states)[1],
    }[kind]
    with pytest.raises(errors.InvalidTypeError) as info:
        autostate.state_dict(f, given)
    assert_clear_api_misuse_fixes(info.value, errors.InvalidTypeError, "autostate.state_dict", "states dict")


# --- stacks: per-layer entries ------------------------------------------------------------

STACKED_MODEL = """
import jax
import jax.numpy as jnp
import autostate


@autostate.stateful
class Norm:
    def __init__(self, n):
        self.scale = jnp.ones(n)
        self.mean = jnp.zeros(n)

    def __call__(self, x):
        self.mean = 0.9 * self.mean + 0.1 * x
        return (x - self.mean) * self.scale


@autostate.stateful
class Net:
    def __init__(self, depth, stacked=True):
        norms = [Norm(3) for _ in range(depth)]
        self.blocks = autostate.stack(norms) if stacked else norms
        self.head = jnp.ones(3)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x @ self.head
"""


def test_a_stack_gives_its_entries_per_layer_and_loads_either_form(write_module: Loader) -> None:
    mod = write_module(STACKED_MODEL)
    listed = mod.Net(3, stacked=False)
    listed(jnp.arange(3.0))
    listed.blocks[2].scale = jnp.full(3, 2.0)
    stacked = mod.Net(3)
    assert list(autostate.param_dict(stacked)) == ["blocks.scale", "head"]
    assert list(autostate.param_dict(stacked, per_layer=True)) == [
        "blocks[0].scale", "blocks[1].scale", "blocks[2].scale", "head",
    ]
    # The list's per-layer dicts load into the stack, and the stack's into the list.
    loaded = autostate.load_param_dict(
        autostate.load_state_dict(stacked, autostate.state_dict(listed)), autostate.param_dict(listed)
    )
    np.testing.assert_array_equal(loaded.blocks.scale[2], jnp.full(3, 2.0))
    for kind in ("state_dict", "param_dict"):
        assert_same(getattr(autostate, kind)(listed), getattr(autostate, kind)(loaded, per_layer=True))
    back = autostate.load_param_dict(
        autostate.load_state_dict(mod.Net(3, stacked=False), autostate.state_dict(loaded)),
        autostate.param_dict(loaded),
    )
    assert_same(snapshot(listed), snapshot(back))
    f, states = loaded.functionalize()
    assert list(autostate.state_dict(f, states, per_layer=True)) == [
        "blocks[0].mean", "blocks[1].mean", "blocks[2].mean",
    ]
    # A layer missing is named (the stacked entry is not assembled from part of its layers).
    partial = {k: v for k, v in autostate.param_dict(listed).items() if k != "blocks[1].scale"}
    with pytest.raises(StateDictError, match="missing parameter keys \\(1\\): 'blocks.scale'"):
        autostate.load_param_dict(stacked, partial)
