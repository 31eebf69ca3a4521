"""Freeze for export: flat dicts, .npz checkpoints, pickle, jax.export, repr."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autostate
from autostate.errors import AutostateError, CheckpointError, StateDictError, StateDictWarning
from autostate.render import model_repr

render_module = sys.modules["autostate.render"]


@autostate.stateful
class Norm:
    def __init__(self, n):
        self.scale = jnp.linspace(0.5, 1.5, n)
        self.mean = jnp.zeros(n)
        self.var = jnp.ones(n)

    def __call__(self, x):
        m, v = x.mean(0), x.var(0)
        self.mean = 0.9 * self.mean + 0.1 * m
        self.var = 0.9 * self.var + 0.1 * v
        return (x - m) / jnp.sqrt(v + 1e-5) * self.scale


@autostate.stateful
class Block:
    def __init__(self, n, seed):
        self.w = jax.random.normal(jax.random.key(seed), (n, n)) / n
        self.b = jnp.full((n,), 0.1 * seed)
        self.norm = Norm(n)
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.calls += 1
        return self.norm(jnp.tanh(x @ self.w + self.b))


@autostate.stateful
class Net:
    def __init__(self, n=3, seed=0):
        self.blocks = [Block(n, seed + 1), Block(n, seed + 2)]
        self.first = self.blocks[0]  # one sub-model, two paths
        self.kv = autostate.state(
            {"k": jnp.zeros(n), "t": jnp.zeros((), jnp.int32)}, category="cache", name="cache"
        )
        self.ema = jnp.zeros(n, jnp.bfloat16)
        self.half = jnp.full((n,), 0.5 + seed, jnp.bfloat16)
        self.table = {"ids": jnp.arange(n, dtype=jnp.int32) + seed}
        self.gain = jnp.asarray(2.0 + seed)
        self.act = "tanh"

    def __call__(self, x):
        h = self.blocks[1](self.first(x)) * self.gain
        self.ema = (0.5 * self.ema + 0.5 * h.mean(0)).astype(jnp.bfloat16)
        self.kv = {"k": self.kv["k"] + h.sum(0), "t": self.kv["t"] + 1}
        return h + self.half.astype(h.dtype) + self.table["ids"]

    def peek(self, x):
        self.kv = {"k": self.kv["k"] * 0.5, "t": self.kv["t"]}
        return x + self.kv["k"]


@autostate.stateful
class Pairs:
    def __init__(self):
        self.pair = (jnp.zeros(2), {"a": jnp.ones(1, jnp.int32)})
        self.log = autostate.state({})

    def __call__(self, x):
        self.pair = (self.pair[0] + x, {"a": self.pair[1]["a"] * 2})
        return x


@autostate.stateful
class Counter:
    def __init__(self):
        self.count = jnp.zeros((), jnp.int32)

    def __call__(self):
        self.count += 1


@autostate.stateful
class Labelled:
    def __init__(self):
        self.count = jnp.zeros(())

    def __repr__(self):
        return "Labelled!"

    def __call__(self):
        self.count += 1


@autostate.stateful
class LabelledChild(Labelled):
    def __call__(self):
        self.count += 2


@autostate.stateful(fallback="host")
class HostCounter:
    def __init__(self):
        self.w = jnp.ones(2)
        self.count = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        def body(i, carry):
            self.count += 1
            return carry

        jax.lax.fori_loop(0, 3, body, 0)
        return x * self.w


STATE_KEYS = [
    "blocks[0].norm.mean",
    "blocks[0].norm.var",
    "blocks[0].calls",
    "blocks[1].norm.mean",
    "blocks[1].norm.var",
    "blocks[1].calls",
    "cache['k']",
    "cache['t']",
    "ema",
]
PARAM_KEYS = [
    "blocks[0].w",
    "blocks[0].b",
    "blocks[0].norm.scale",
    "blocks[1].w",
    "blocks[1].b",
    "blocks[1].norm.scale",
    "half",
    "table['ids']",
    "gain",
]


def batches(count, n=3):
    keys = jax.random.split(jax.random.key(42), count)
    return [jax.random.normal(k, (4, n)) for k in keys]


XS = batches(5)


def run(model, xs, method="__call__"):
    """Steps the model functionally under jit; returns (outputs, frozen model)."""
    f, states = model.functionalize()
    step = jax.jit(lambda f, s, x: getattr(f, method)(s, x))
    outs = []
    for x in xs:
        out, states = step(f, states, x)
        outs.append(out)
    return outs, autostate.freeze(f, states)


def bits(a):
    a = np.asarray(a)
    return a.dtype, a.shape, a.tobytes()


def assert_same_arrays(got, want):
    assert list(got) == list(want)
    for key in want:
        assert bits(got[key]) == bits(want[key]), key


# --- state_dict / load_state_dict ------------------------------------------------


def test_state_dict_names_follow_functionalize():
    model = Net()
    sd = autostate.state_dict(model)
    assert list(sd) == STATE_KEYS
    _, states = model.functionalize()
    assert list(states) == [k for k in STATE_KEYS[:6]] + ["cache", "ema"]
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
    with pytest.raises(TypeError, match="autostate.freeze"):
        autostate.state_dict(f)
    with pytest.raises(StateDictError, match="handled by a functionalize"):
        autostate.state_dict(f.model)
    assert list(autostate.state_dict(autostate.freeze(f, states))) == STATE_KEYS


# --- param_dict / load_param_dict -----------------------------------------------


def test_param_dict_names_every_non_state_array_once():
    model = Net()
    pd = autostate.param_dict(model)
    assert list(pd) == PARAM_KEYS
    assert pd["blocks[0].w"] is model.blocks[0].w
    assert pd["half"].dtype == jnp.bfloat16 and pd["table['ids']"].dtype == jnp.int32
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


# --- save / load ------------------------------------------------------------------


def _trained_with_odd_values():
    _, trained = run(Net(), XS[:2])
    sd = dict(autostate.state_dict(trained))
    # NaN, -0.0 and a subnormal: bit-exactness, not just equality.
    sd["ema"] = jnp.array([jnp.nan, -0.0, 1e-40], jnp.bfloat16)
    return autostate.load_state_dict(trained, sd)


def test_save_load_is_bit_exact(tmp_path):
    trained = _trained_with_odd_values()
    path = tmp_path / "ckpt.npz"
    autostate.save(path, trained)
    loaded = autostate.load(path, like=Net(seed=3))
    assert_same_arrays(autostate.param_dict(loaded), autostate.param_dict(trained))
    assert_same_arrays(autostate.state_dict(loaded), autostate.state_dict(trained))
    dtypes = {np.asarray(v).dtype.name for v in autostate.param_dict(loaded).values()}
    assert dtypes == {"float32", "bfloat16", "int32"}
    want, _ = run(trained, XS[2:])
    got, _ = run(loaded, XS[2:])
    for a, b in zip(got, want):
        assert bits(a) == bits(b)

    params, states = autostate.load_arrays(path)
    assert_same_arrays(params, autostate.param_dict(trained))
    assert_same_arrays(states, autostate.state_dict(trained))


def test_checkpoint_is_a_plain_npz_without_pickle(tmp_path):
    path = tmp_path / "ckpt"
    autostate.save(path, Net())
    assert path.exists()  # the path is used as given
    with np.load(path, allow_pickle=False) as npz:
        manifest = json.loads(npz["__autostate_manifest__"].item())
        entries = {(e["kind"], e["name"]): e for e in manifest["arrays"]}
        half = entries[("params", "half")]
        assert half["dtype"] == "bfloat16" and npz[half["member"]].dtype == np.uint16
        gain = entries[("params", "gain")]
        assert npz[gain["member"]].dtype == np.float32 and npz[gain["member"]].shape == ()
    assert set(entries) == {("params", k) for k in PARAM_KEYS} | {("states", k) for k in STATE_KEYS}
    assert manifest["model"].endswith("Net")


@pytest.mark.parametrize("keep", [0, 10, 0.5, -1])
def test_truncated_checkpoint_is_a_clear_error(tmp_path, keep):
    path = tmp_path / "ckpt.npz"
    autostate.save(path, _trained_with_odd_values())
    data = path.read_bytes()
    size = int(len(data) * keep) if isinstance(keep, float) else keep % len(data)
    path.write_bytes(data[:size])
    like = Net(seed=1)
    before = autostate.state_dict(like), autostate.param_dict(like)
    with pytest.raises(CheckpointError, match="corrupted") as info:
        autostate.load(path, like=like)
    assert str(path) in str(info.value)
    assert_same_arrays(autostate.state_dict(like), before[0])
    assert_same_arrays(autostate.param_dict(like), before[1])


def test_flipped_byte_in_array_data_is_detected(tmp_path):
    model = Net()
    path = tmp_path / "ckpt.npz"
    autostate.save(path, model)
    data = bytearray(path.read_bytes())
    where = bytes(data).find(np.asarray(model.blocks[1].w).tobytes())
    assert where > 0
    data[where + 5] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupted"):
        autostate.load(path, like=Net())


def test_checksum_catches_changes_the_zip_does_not(tmp_path):
    path = tmp_path / "ckpt.npz"
    autostate.save(path, Net())
    with np.load(path, allow_pickle=False) as npz:
        members = {k: npz[k] for k in npz.files}
    manifest = json.loads(members["__autostate_manifest__"].item())
    entry = next(e for e in manifest["arrays"] if e["name"] == "gain")
    members[entry["member"]] = np.asarray(3.0, np.float32)
    with open(path, "wb") as fh:
        np.savez(fh, **members)
    with pytest.raises(CheckpointError, match="checksum mismatch in params 'gain'"):
        autostate.load(path, like=Net())


def test_foreign_npz_is_not_a_checkpoint(tmp_path):
    path = tmp_path / "plain.npz"
    np.savez(path, **{"ema": np.zeros(3)})
    with pytest.raises(CheckpointError, match="no autostate manifest"):
        autostate.load(path, like=Net())


def test_checkpoint_of_another_configuration_lists_every_key(tmp_path):
    path = tmp_path / "ckpt.npz"
    autostate.save(path, Net(n=3))
    with pytest.raises(CheckpointError) as info:
        autostate.load(path, like=Net(n=4))
    message = str(info.value)
    assert f"parameter shape/dtype mismatches ({len(PARAM_KEYS) - 1})" in message  # gain is 0-d
    assert f"state shape/dtype mismatches ({len(STATE_KEYS) - 3})" in message  # 3 are 0-d
    assert "saved from" in message and str(path) in message


def test_failed_save_keeps_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.npz"
    autostate.save(path, Net(seed=0))

    def broken_savez(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(np, "savez", broken_savez)
    with pytest.raises(RuntimeError, match="disk full"):
        autostate.save(path, Net(seed=9))
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == [path]
    loaded = autostate.load(path, like=Net(seed=9))
    assert_same_arrays(autostate.param_dict(loaded), autostate.param_dict(Net(seed=0)))


def test_flat_dicts_work_with_orbax_without_glue(tmp_path):
    import orbax.checkpoint as ocp  # in the test extra, so this runs in `make test`
    trained = _trained_with_odd_values()
    tree = {"params": autostate.param_dict(trained), "states": autostate.state_dict(trained)}
    checkpointer = ocp.PyTreeCheckpointer()
    checkpointer.save(tmp_path / "orbax", tree)
    restored = checkpointer.restore(tmp_path / "orbax")
    loaded = autostate.load_state_dict(
        autostate.load_param_dict(Net(seed=4), restored["params"]), restored["states"]
    )
    assert_same_arrays(autostate.param_dict(loaded), autostate.param_dict(trained))
    assert_same_arrays(autostate.state_dict(loaded), autostate.state_dict(trained))


# --- pickle ---------------------------------------------------------------------------


def test_pickle_round_trips_frozen_fresh_and_loaded_models(tmp_path):
    _, trained = run(Net(), XS[:2])
    autostate.save(tmp_path / "ckpt.npz", trained)
    loaded = autostate.load(tmp_path / "ckpt.npz", like=Net())
    for model in (trained, Net(seed=2), loaded):
        clone = pickle.loads(pickle.dumps(model))
        assert type(clone) is Net and clone.first is clone.blocks[0]
        assert_same_arrays(autostate.param_dict(clone), autostate.param_dict(model))
        assert_same_arrays(autostate.state_dict(clone), autostate.state_dict(model))
        want, _ = run(model, XS[2:4])
        got, _ = run(clone, XS[2:4])
        for a, b in zip(got, want):
            assert bits(a) == bits(b)
    eager = pickle.loads(pickle.dumps(Net()))
    eager(XS[0])
    assert int(eager.blocks[0].calls) == 1 and int(eager.kv["t"]) == 1


# --- jax.export ------------------------------------------------------------------------

_FRESH_PROCESS = textwrap.dedent(
    """
    import pickle, sys
    import jax, numpy as np
    import autostate

    folder = sys.argv[1]
    with open(folder + "/net.jax", "rb") as fh:
        exported = jax.export.deserialize(bytearray(fh.read()))
    _, states = autostate.load_arrays(folder + "/ckpt.npz")
    results = []
    for x in np.load(folder + "/xs.npy"):
        out, states = exported.call(states, x)
        results.append((np.asarray(out), {k: np.asarray(v) for k, v in states.items()}))
    assert not any("test_export" in name for name in sys.modules)
    with open(folder + "/results.pkl", "wb") as fh:
        pickle.dump(results, fh)
    """
)


def test_export_runs_in_a_fresh_process_like_the_live_model(tmp_path):
    _, model = run(Net(), XS[:1])
    exported = autostate.export(model, XS[0])
    assert isinstance(exported, jax.export.Exported)
    (tmp_path / "net.jax").write_bytes(exported.serialize())
    autostate.save(tmp_path / "ckpt.npz", model)
    np.save(tmp_path / "xs.npy", np.stack(XS[1:4]))
    root = str(Path(autostate.__file__).parent.parent)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
    }
    subprocess.run(
        [sys.executable, "-c", _FRESH_PROCESS, str(tmp_path)], check=True, env=env, timeout=240
    )
    with open(tmp_path / "results.pkl", "rb") as fh:
        results = pickle.load(fh)

    f, states = model.functionalize()
    step = jax.jit(lambda f, s, x: f(s, x))
    assert len(results) == 3
    for x, (out, flat_states) in zip(XS[1:4], results):
        want_out, states = step(f, states, x)
        np.testing.assert_allclose(out, want_out, rtol=1e-6, atol=1e-6)
        want_states = autostate.state_dict(autostate.freeze(f, states))
        assert list(flat_states) == sorted(STATE_KEYS)
        for key, value in want_states.items():
            assert flat_states[key].dtype == value.dtype, key
            np.testing.assert_allclose(
                flat_states[key].astype(np.float32), np.asarray(value, np.float32), rtol=1e-6
            )


def test_export_of_another_method_threads_states():
    _, model = run(Net(), XS[:1])
    exported = jax.export.deserialize(autostate.export(model, XS[0], method="peek").serialize())
    out, new_states = exported.call(autostate.state_dict(model), XS[0])
    want_out, want_model = Net.peek(model, XS[0]), model  # eager, on the frozen model
    np.testing.assert_allclose(out, want_out, rtol=1e-6)
    np.testing.assert_allclose(new_states["cache['k']"], want_model.kv["k"], rtol=1e-6)
    with pytest.raises(AttributeError, match="no method 'nope'"):
        autostate.export(model, XS[0], method="nope")


# --- repr ----------------------------------------------------------------------------------


def test_repr_shows_parameters_and_states_with_their_kind():
    text = repr(Net())
    assert text.startswith("Net(\n")
    for line in [
        "w=f32[3,3]",
        "half=bf16[3]",
        "gain=f32[]",
        "table={'ids': i32[3]}",
        "act='tanh'",
        "mean=<state 'blocks[0].norm.mean' category='state' initial value: f32[3]>",
        "kv=<state 'cache' category='cache' initial value: {'k': f32[3], 't': i32[]}>",
        "first=<Block, same as 'blocks[0]'>",
    ]:
        assert line in text, line
    _, trained = run(Net(), XS[:1])
    assert "ema=<state 'ema' category='state' value: bf16[3]>" in repr(trained)
    f, _ = trained.functionalize()
    assert f"calls=<state 'blocks[1].calls' category='state' handled by {f.handler_id!r}>" in repr(
        f
    )
    assert repr(Counter()) == "Counter(count=<state 'count' category='state' initial value: i32[]>)"
    # Names are relative to the model given.
    assert model_repr(trained.blocks[1].norm) == (
        "Norm(\n"
        "  scale=f32[3],\n"
        "  mean=<state 'mean' category='state' value: f32[3]>,\n"
        "  var=<state 'var' category='state' value: f32[3]>,\n"
        ")"
    )


def test_repr_keeps_a_repr_the_class_or_a_base_defines():
    assert repr(Labelled()) == "Labelled!"
    assert repr(LabelledChild()) == "Labelled!"
    assert (
        model_repr(Labelled()) == "Labelled(count=<state 'count' category='state' initial value: f32[]>)"
    )


def test_host_fallback_states_are_read_from_their_store(tmp_path):
    model = HostCounter()
    model(jnp.ones(2))
    assert {k: int(v) for k, v in autostate.state_dict(model).items()} == {"count": 3}
    assert list(autostate.param_dict(model)) == ["w"]
    autostate.save(tmp_path / "host.npz", model)
    params, states = autostate.load_arrays(tmp_path / "host.npz")
    assert int(states["count"]) == 3 and list(params) == ["w"]
    assert repr(model) == "HostCounter(w=f32[2], count=<state 'count' category='state' in a host store>)"


def test_save_load_export_example_runs():
    example = Path(__file__).resolve().parents[1] / "examples" / "save_load_export.py"
    result = subprocess.run(
        [sys.executable, str(example)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    steps = [int(line.split()[1].rstrip(":")) for line in lines if line.startswith("  step ")]
    assert steps == [1, 2, 3, 4, 5, 6]  # the second process resumed where the first stopped
    assert [line.split(",")[0] for line in lines if line.startswith("exported call")] == [
        "exported call: steps=7",
        "exported call: steps=8",
    ]
    assert lines[-1] == "ok"


# --- treescope -----------------------------------------------------------------------------


def test_treescope_shows_parameters_submodels_and_highlighted_states():
    treescope = pytest.importorskip("treescope")
    text = treescope.render_to_text(Net())
    assert text.startswith("Net(\n")
    for part in [
        "blocks=[",
        "Block(w=",
        "Norm(scale=",
        "half=",
        "table={'ids': ",
        "act='tanh'",
        "mean=<state 'blocks[0].norm.mean' category='state' initial value: ",
        "calls=<state 'blocks[1].calls' category='state' initial value: ",
        "kv=<state 'cache' category='cache' initial value:",
        "ema=<state 'ema' category='state' initial value: ",
    ]:
        assert part in text, part
    _, trained = run(Net(), XS[:1])
    assert "ema=<state 'ema' category='state' value: " in treescope.render_to_text(trained)
    f, _ = trained.functionalize()
    handled = treescope.render_to_text(f.model)
    assert f"calls=<state 'blocks[1].calls' category='state' handled by {f.handler_id!r}>" in handled
    # Names are relative to the outermost model rendered, as in the plain repr.
    norm = treescope.render_to_text({"m": trained.blocks[1].norm})
    assert "mean=<state 'mean' category='state' value:" in norm
    assert "scale=" in norm
    host = HostCounter()
    host(jnp.ones(2))
    assert "count=<state 'count' category='state' in a host store>" in treescope.render_to_text([host])
    # The HTML view puts each state in a box of the highlight color: the 8 states, and
    # the 3 of blocks[0] again under `first` (treescope marks it a repeated object).
    html = treescope.render_to_html(Net(), compressed=False)
    assert html.count(f"--block-color: {render_module.TREESCOPE_STATE_COLOR};") == 8 + 3
    assert "state &#x27;blocks[0].norm.mean&#x27; category=&#x27;state&#x27; initial value" in html


def test_treescope_keeps_a_treescope_repr_the_class_defines():
    treescope = pytest.importorskip("treescope")

    @autostate.stateful
    class Own:
        def __init__(self):
            self.count = jnp.zeros(())

        def __call__(self):
            self.count += 1

        def __treescope_repr__(self, path, subtree_renderer):
            return treescope.rendering_parts.text("Own!")

    assert treescope.render_to_text(Own()) == "Own!"
    assert "Counter(" in treescope.render_to_text(Counter())


def test_functional_model_renders_its_handled_model_in_treescope():
    import treescope

    f, _ = autostate.stateful(_TreescopeCounter)().functionalize()
    text = treescope.render_to_text(f)
    assert text.startswith("FunctionalModel(")
    assert "handler_id='autostate:*'" in text
    assert "<state 'n' category='state' handled by 'autostate:*'>" in text


class _TreescopeCounter:
    def __init__(self):
        self.n = jnp.zeros(())

    def __call__(self, x):
        self.n += 1
        return x
