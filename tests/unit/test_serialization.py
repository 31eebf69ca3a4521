"""``autostate/serialization.py``: the .npz checkpoint format, and pickle."""

from __future__ import annotations

import json
import pickle
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from export_models import PARAM_KEYS, STATE_KEYS, XS, Net, assert_same_arrays, bits, run
from semantics.harness import (
    assert_bits,
    assert_clear,
    assert_same,
    pair,
    raises_autostate,
    snapshot,
)
from semantics.programs_eager_writes import SOURCE
from semantics.programs_functional import MODELS, NET, PACK
from semantics.programs_numerics import DTYPES
from semantics.programs_shared import XV1 as X1
from semantics.programs_shared import Loader
from semantics.references import assert_shared, trained_pair

import autostate
from autostate import errors
from autostate.errors import CheckpointError

HERE = __file__


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


def test_a_directory_or_a_missing_folder_is_named_as_given(tmp_path):
    """The path given, not the temporary file written beside it, is what the error
    names; a directory is a CheckpointError at the caller's line, for save and load."""
    folder = tmp_path / "run"
    folder.mkdir()
    for call in (lambda: autostate.save(folder, Net()), lambda: autostate.load(folder, like=Net())):
        with pytest.raises(CheckpointError, match="which is a directory") as info:
            call()
        assert str(folder) in str(info.value) and ".tmp" not in str(info.value)
        assert f"{__file__}:" in str(info.value) and "model.npz" in str(info.value)
    assert list(folder.iterdir()) == []
    missing = tmp_path / "nowhere" / "ckpt.npz"
    with pytest.raises(FileNotFoundError) as err:
        autostate.save(missing, Net())
    assert err.value.filename == str(missing) and str(missing) in str(err.value)
    assert list(tmp_path.iterdir()) == [folder]
    autostate.save(folder / "ckpt.npz", Net(seed=3))  # a file inside it, as the fix says
    assert_same_arrays(autostate.param_dict(autostate.load(folder / "ckpt.npz", like=Net())),
                       autostate.param_dict(Net(seed=3)))


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


def test_save_load_npz_then_continue(write_module: Loader, tmp_path: Path) -> None:
    plain, dec = pair(write_module, DTYPES)
    for build, name, arg in (("Keys(4)", "__call__", 1.0), ("Trees()", "step", 1.0),
                             ("Typed(jnp.float16)", "step", 1)):
        p = eval(build, vars(plain))  # noqa: S307
        d = eval(build, vars(dec))  # noqa: S307
        getattr(p, name)(arg)
        getattr(d, name)(arg)
        path = tmp_path / "m.npz"
        autostate.save(path, d)
        loaded = autostate.load(path, like=eval(build, vars(dec)))  # noqa: S307
        assert_same(snapshot(p), snapshot(loaded), build)
        assert_same(getattr(p, name)(arg), getattr(loaded, name)(arg), build)
        params, states = autostate.load_arrays(path)
        assert sorted(states) == sorted(autostate.state_dict(d))


def test_save_load_keeps_every_dtype_bit_exact(write_module: Loader, tmp_path: Path) -> None:
    _, dec = pair(write_module, PACK)
    model = dec.Mixed(9)
    model(jnp.ones(3))
    autostate.save(tmp_path / "m.npz", model)
    loaded = autostate.load(tmp_path / "m.npz", like=dec.Mixed(1))
    assert_bits(autostate.state_dict(model), autostate.state_dict(loaded), "states", bitwise=True)
    assert_bits(autostate.param_dict(model), autostate.param_dict(loaded), "params", bitwise=True)
    params, states = autostate.load_arrays(tmp_path / "m.npz")
    assert sorted(states) == sorted(autostate.state_dict(model))
    assert jnp.asarray(states["hb"]).dtype == jnp.bfloat16
    assert_bits(model(jnp.arange(3.0)), loaded(jnp.arange(3.0)), "continued", bitwise=True)


_LOW_PRECISION = """
@DECORATE
class Quantized:
    def __init__(self, dtype):
        self.q = jnp.arange(-2, 2).astype(dtype)  # a parameter
        self.acc = jnp.zeros(4, dtype)            # a state

    def __call__(self, x):
        self.acc = (self.acc.astype(jnp.float32) + x).astype(self.acc.dtype)
        return self.q.astype(jnp.float32) * x
"""


@pytest.mark.parametrize(
    "dtype", ["float8_e5m2", "float8_e4m3fn", "float4_e2m1fn", "int4", "uint4", "bfloat16"]
)
def test_save_load_round_trips_every_low_precision_dtype(
    write_module: Loader, tmp_path: Path, dtype: str
) -> None:
    # (float8_e5m2, whose numpy descriptor '<f1' numpy cannot read back, was
    # written as is: its checkpoint loaded as "corrupted")
    _, dec = pair(write_module, _LOW_PRECISION)
    model = dec.Quantized(getattr(jnp, dtype))
    model(jnp.full(4, 1.0))
    autostate.save(tmp_path / "q.npz", model)
    loaded = autostate.load(tmp_path / "q.npz", like=dec.Quantized(getattr(jnp, dtype)))
    assert_bits(autostate.state_dict(model), autostate.state_dict(loaded), "states", bitwise=True)
    assert_bits(autostate.param_dict(model), autostate.param_dict(loaded), "params", bitwise=True)
    assert loaded.acc.dtype == loaded.q.dtype == getattr(jnp, dtype)
    params, states = autostate.load_arrays(tmp_path / "q.npz")
    assert np.asarray(states["acc"]).dtype == np.dtype(getattr(jnp, dtype))


_WEAK = """
@DECORATE
class Scaled:
    def __init__(self):
        self.w = jnp.full(2, 0.5)        # a weakly typed parameter
        self.scale = jnp.asarray(1.0)    # a weakly typed state, weak after each call
        self.total = jnp.asarray(0.0)    # weak at first, strong once it adds x

    def __call__(self, x):
        self.scale = self.scale * 0.5
        self.total = self.total + x.sum().astype(jnp.float32)
        return x * self.w * self.scale
"""


def test_save_load_keeps_weak_types(write_module: Loader, tmp_path: Path) -> None:
    """A weakly typed array takes the dtype of what it meets: loaded strong, a
    bfloat16 input would give float32 where the saved model gives bfloat16."""
    _, dec = pair(write_module, _WEAK)
    model = dec.Scaled()
    x = jnp.ones(2, jnp.bfloat16)
    model(x)
    autostate.save(tmp_path / "m.npz", model)
    loaded = autostate.load(tmp_path / "m.npz", like=dec.Scaled())
    for name in ("w", "scale", "total"):
        saved, got = getattr(model, name), getattr(loaded, name)
        assert (got.dtype, got.weak_type) == (saved.dtype, saved.weak_type), name
    assert (model.w.weak_type, model.scale.weak_type, model.total.weak_type) == (True, True, False)
    want, out = model(x), loaded(x)
    assert out.dtype == want.dtype == jnp.bfloat16
    assert_bits(want, out, "continued", bitwise=True)


@pytest.fixture
def mods(write_module: Loader) -> tuple[types.ModuleType, types.ModuleType]:
    return pair(write_module, MODELS)


def test_save_f_and_load_like_f(mods: Any, tmp_path: Path) -> None:
    _, dec = mods
    f, _ = dec.Counter().functionalize()
    with raises_autostate(errors.InvalidTypeError) as info:
        autostate.save(tmp_path / "f.npz", f)
    assert_clear(info.value, errors.InvalidTypeError, HERE, "autostate.save expects a model")
    autostate.save(tmp_path / "m.npz", dec.Counter())
    with raises_autostate(errors.InvalidTypeError) as info:
        autostate.load(tmp_path / "m.npz", like=f)
    assert_clear(info.value, errors.InvalidTypeError, HERE, "autostate.load expects a model")


def test_an_undecorated_model_is_refused_not_saved_empty(mods: Any, tmp_path: Path) -> None:
    # (its arrays were invisible: save wrote an empty checkpoint, param_dict gave {})
    plain, dec = mods
    for use in (
        lambda m: autostate.save(tmp_path / "p.npz", m),
        autostate.param_dict,
        autostate.state_dict,
        lambda m: m.functionalize() if hasattr(m, "functionalize") else autostate.functionalize(m),
    ):
        with raises_autostate(errors.InvalidTypeError) as info:
            use(plain.Counter())
        assert_clear(info.value, errors.InvalidTypeError, HERE, "whose class is not decorated")
    autostate.save(tmp_path / "m.npz", dec.Counter())
    with raises_autostate(errors.InvalidTypeError) as info:
        autostate.load(tmp_path / "m.npz", like=plain.Counter())
    assert_clear(info.value, errors.InvalidTypeError, HERE, "whose class is not decorated")


def test_a_class_given_for_a_model_is_refused_naming_the_call(mods: Any, tmp_path: Path) -> None:
    # (load(like=Cls) and save(Cls) said "functionalize() expects a model")
    _, dec = mods
    autostate.save(tmp_path / "m.npz", dec.Counter())
    for use, caller in (
        (lambda: autostate.load(tmp_path / "m.npz", like=dec.Counter), "autostate.load"),
        (lambda: autostate.save(tmp_path / "c.npz", dec.Counter), "autostate.save"),
        (lambda: autostate.param_dict(dec.Counter), "autostate.param_dict"),
    ):
        with raises_autostate(errors.InvalidTypeError) as info:
            use()
        assert_clear(info.value, errors.InvalidTypeError, HERE, f"{caller} expects a model")
        assert "functionalize()" not in str(info.value)
        assert "got the class Counter itself" in str(info.value)
        assert "(`Counter(...)`)" in str(info.value)
    loaded = autostate.load(tmp_path / "m.npz", like=dec.Counter())  # the way it names
    assert sorted(autostate.state_dict(loaded)) == sorted(autostate.state_dict(dec.Counter()))


def test_load_a_plain_npz(mods: Any, tmp_path: Path) -> None:
    _, dec = mods
    path = tmp_path / "plain.npz"
    np.savez(path, count=np.zeros(()))
    for load in (
        lambda: autostate.load(path, like=dec.Counter()),
        lambda: autostate.load_arrays(path),
    ):
        with raises_autostate(errors.CheckpointError) as info:
            load()
        text = str(info.value)
        assert "no autostate manifest" in text and "fix:" in text
        assert str(path) in text  # a checkpoint error names the file (documented)


def source_modules(write_module: Loader) -> tuple[types.ModuleType, types.ModuleType]:
    return pair(write_module, SOURCE)


def test_save_load_keeps_a_tied_array_tied(write_module: Loader, tmp_path: Path) -> None:
    _, dec = source_modules(write_module)
    m = dec.LM()
    autostate.save(tmp_path / "lm.npz", m)
    loaded = autostate.load(tmp_path / "lm.npz", like=dec.LM())
    assert_same(m.embed.w, loaded.head.w)
    assert loaded.head.w is loaded.embed.w


def step_jit() -> Callable[..., Any]:
    return jax.jit(lambda f, s, x: f(s, x))


def test_save_load_round_trip_then_train(write_module: Loader, tmp_path: Any) -> None:
    plain, dec = pair(write_module, NET)
    ref, model = trained_pair(plain, dec)
    path = str(tmp_path / "net.npz")
    autostate.save(path, model)
    loaded = autostate.load(path, like=dec.Net(5.0))
    assert_shared(loaded)
    assert_same(snapshot(ref), snapshot(loaded), "loaded from file")
    f, states = loaded.functionalize()
    out, states = step_jit()(f, states, X1)
    assert_same(ref(X1), out, "jit after load")


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


def test_checkpoint_errors_name_the_file_and_the_user_line(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.npz"
    autostate.save(path, Counter())
    with pytest.raises(errors.CheckpointError) as info:
        autostate.load(path, like=_Wider())
    assert_clear_api_misuse_fixes(info.value, errors.CheckpointError, str(path), "saved from")
    plain = tmp_path / "plain.npz"
    np.savez(plain, count=np.zeros(()))
    with pytest.raises(errors.CheckpointError) as info:
        autostate.load(plain, like=Counter())
    assert_clear_api_misuse_fixes(info.value, errors.CheckpointError, str(plain), "no autostate manifest")
    broken = tmp_path / "broken.npz"
    broken.write_bytes(path.read_bytes()[:100])
    with pytest.raises(errors.CheckpointError) as info:
        autostate.load_arrays(broken)
    assert_clear_api_misuse_fixes(info.value, errors.CheckpointError, str(broken), "corrupted")


@autostate.stateful
class _Wider:
    def __init__(self):
        self.count = jnp.zeros(3)
        self.w = jnp.ones(2)

    def __call__(self, x):
        self.count += 1
        return x * self.w


def test_torch_argument_order_is_refused_in_words(tmp_path: Path) -> None:
    """``save(model, path)`` (torch.save's order), ``load(model, path)`` and
    ``load(path, model)``: an error naming the order, at the user's line, and
    nothing written; the documented spelling round-trips."""
    model = Net()
    path = tmp_path / "ckpt.npz"
    with pytest.raises(errors.InvalidTypeError) as info:
        autostate.save(model, path)  # SAVE_SWAPPED
    assert_clear(info.value, errors.InvalidTypeError, HERE, "path first", "torch.save",
                 "autostate.save(path, model)")
    assert not path.exists()
    with pytest.raises(errors.InvalidTypeError) as info:
        autostate.load(model, path)
    assert_clear(info.value, errors.InvalidTypeError, HERE, "path first", "like=model")
    autostate.save(str(path), model)
    with pytest.raises(errors.InvalidTypeError) as info:
        autostate.load(path, model)
    assert_clear(info.value, errors.InvalidTypeError, HERE, "`like=`", "like=model")
    loaded = autostate.load(path=path, like=Net(seed=3))
    assert_same_arrays(autostate.param_dict(loaded), autostate.param_dict(model))


def test_a_pickle_naming_the_optimizers_old_module_loads_the_optimizer_class() -> None:
    # Pickles made before ``Optimizer`` moved to ``autostate.optimizers`` name
    # ``autostate.training.Optimizer``.
    old = b"\x80\x04\x8c\x12autostate.training\x94\x8c\tOptimizer\x94\x93\x94."
    assert pickle.loads(old) is autostate.Optimizer
