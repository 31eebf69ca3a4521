"""``autostate/serialization.py``: the .npz checkpoint format, and pickle."""

from __future__ import annotations

import json
import pickle
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from export_models import (  # noqa: I001 - tests/ is on sys.path
    PARAM_KEYS,
    STATE_KEYS,
    XS,
    Net,
    assert_same_arrays,
    bits,
    run,
)

import autostate
from autostate.errors import CheckpointError

render_module = sys.modules["autostate.render"]


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
    assert dtypes == {"float32", "bfloat16"}  # int arrays are constants, in the states
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
