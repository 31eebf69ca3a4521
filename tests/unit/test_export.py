"""``autostate/export.py``: ``jax.export`` programs that thread states."""

from __future__ import annotations

import os
import pickle
import runpy
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from export_models import STATE_KEYS, XS, Net, run
from semantics.harness import (
    assert_bits,
    assert_clear,
    assert_same,
    pair,
    raises_autostate,
    snapshot,
)
from semantics.programs_functional import MODELS, PACK
from semantics.programs_host_fallback import HOST
from semantics.programs_numerics import DTYPES
from semantics.programs_shared import PACK_XS, XS_PAIRS, Loader
from tolerance import tolerance

import autostate
from autostate import errors

HERE = __file__

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
    # The fresh process runs on the CPU where this one holds an accelerator
    # (tests/conftest.py): the program is lowered for both, and the live
    # model's steps it is compared with run on the CPU too.
    exported = autostate.export(model, XS[0], platforms=sorted({"cpu", jax.default_backend()}))
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

    cpu = jax.devices("cpu")[0]
    f, states = jax.device_put(model.functionalize(), cpu)
    step = jax.jit(lambda f, s, x: f(s, x))
    assert len(results) == 3
    for x, (out, flat_states) in zip(XS[1:4], results):
        want_out, states = step(f, states, jax.device_put(x, cpu))
        np.testing.assert_allclose(out, want_out, **tolerance(rtol=1e-6, atol=1e-6))
        want_states = autostate.state_dict(autostate.freeze(f, states))
        assert list(flat_states) == sorted(STATE_KEYS)
        for key, value in want_states.items():
            assert flat_states[key].dtype == value.dtype, key
            np.testing.assert_allclose(
                flat_states[key].astype(np.float32), np.asarray(value, np.float32),
                **tolerance(rtol=1e-6, atol=0.0),
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


def test_save_load_export_example_runs(capfd: pytest.CaptureFixture[str], monkeypatch) -> None:
    # This process is the example's first one (as ``python examples/save_load_export.py``
    # would be); the second, which resumes and exports, is a new process as always.
    example = Path(__file__).resolve().parents[2] / "examples" / "save_load_export.py"
    monkeypatch.setattr(sys, "argv", [str(example)])
    runpy.run_path(str(example), run_name="__main__")
    lines = capfd.readouterr().out.splitlines()
    steps = [int(line.split()[1].rstrip(":")) for line in lines if line.startswith("  step ")]
    assert steps == [1, 2, 3, 4, 5, 6]  # the second process resumed where the first stopped
    assert [line.split(",")[0] for line in lines if line.startswith("exported call")] == [
        "exported call: steps=7",
        "exported call: steps=8",
    ]
    assert lines[-1] == "ok"


def test_export_round_trip_with_prng_state(write_module: Loader) -> None:
    pytest.importorskip("flatbuffers")
    plain, dec = pair(write_module, DTYPES)
    m = dec.Keys(5)
    exp = jax.export.deserialize(autostate.export(m, jnp.float32(1.0)).serialize())
    states = autostate.state_dict(m)
    p = plain.Keys(5)
    for x in (1.0, 2.0):
        out, states = exp.call(states, jnp.float32(x))
        assert_same(p(x), out)
    assert_same(snapshot(p.key), snapshot(states["key"]))


def test_export_of_a_host_model_threads_its_states(write_module: Loader) -> None:
    plain, dec = pair(write_module, HOST)
    ref = plain.Stats(2)
    ref(XS_PAIRS)
    model = dec.Stats(2)
    model(XS_PAIRS)
    program = autostate.export(model, XS_PAIRS)
    program = jax.export.deserialize(program.serialize())
    states = autostate.state_dict(model)
    for k in range(2):
        expected = ref(XS_PAIRS + k)
        out, states = program.call(states, XS_PAIRS + k)
        assert_same(expected, out)
    assert_same({k: snapshot(getattr(ref, k)) for k in states}, {k: np.asarray(v) for k, v in states.items()})
    assert int(model.count) == 1  # the model's store is untouched


# also covers a model with a typed key and bfloat16 states: PACK's Mixed has both.
def test_exported_program_over_steps_matches_plain(write_module: Loader) -> None:
    plain, dec = pair(write_module, PACK)
    ref = plain.Mixed(10)
    ref(jnp.ones(3))
    model = dec.Mixed(10)
    model(jnp.ones(3))
    program = jax.export.deserialize(autostate.export(model, jnp.ones(3)).serialize())
    states = autostate.state_dict(model)
    for x in PACK_XS:
        expected = ref(x)
        out, states = program.call(states, x)
        assert_same(expected, out)
    frozen = autostate.load_state_dict(dec.Mixed(10), states)
    assert_bits(states["key"], frozen.key, bitwise=True)  # a typed key, next to bf16 states
    assert_same(snapshot(ref), snapshot(frozen))


_WEAK = """
@DECORATE
class Scaled:
    def __init__(self):
        self.scale = jnp.asarray(1.0)  # weakly typed: x_bf16 * scale stays bfloat16
        self.gain = 2.0                # a Python float state: weak when traced

    def __call__(self, x):
        self.scale = self.scale * 0.5
        self.gain = self.gain * 0.5
        return x * self.scale * self.gain
"""


def test_exported_program_promotes_weak_states_as_the_model_does(write_module: Loader) -> None:
    """The states' example specs keep their weak types, as ``jax.export`` of
    ``jax.jit(f)`` keeps them: a bfloat16 input gives a bfloat16 output, as
    the model and ``f`` give (it was float32)."""
    plain, dec = pair(write_module, _WEAK)
    ref, model = plain.Scaled(), dec.Scaled()
    x = jnp.ones(2, jnp.bfloat16)
    ref(x)
    model(x)
    program = autostate.export(model, x)
    states = autostate.state_dict(model)
    f, f_states = model.functionalize()
    for _ in range(2):
        expected = ref(x)
        out, states = program.call(states, x)
        want, f_states = jax.jit(lambda f, s, x: f(s, x))(f, f_states, x)
        assert out.dtype == expected.dtype == want.dtype == jnp.bfloat16
        assert_same(expected, out)
    assert bool(states["scale"].weak_type)


def test_exported_other_method_reads_the_passed_states(write_module: Loader) -> None:
    plain, dec = pair(write_module, PACK)
    ref = plain.Mixed(11)
    model = dec.Mixed(11)
    for x in PACK_XS:
        ref(x)
        model(x)
    program = autostate.export(model, 2.0, method="peek")
    out, states = program.call(autostate.state_dict(model), 2.0)
    assert_same(ref.peek(2.0), out)
    assert_bits(autostate.state_dict(model), states, bitwise=True)


@pytest.fixture
def mods(write_module: Loader) -> tuple[types.ModuleType, types.ModuleType]:
    return pair(write_module, MODELS)


def test_export_unknown_method_and_bad_argument(mods: Any) -> None:
    _, dec = mods
    with raises_autostate(errors.MethodNotFoundError) as info:
        autostate.export(dec.Counter(), jnp.ones(()), method="forward")
    assert_clear(info.value, errors.MethodNotFoundError, HERE, "'forward'")
    with raises_autostate(errors.InvalidTypeError) as info:
        autostate.export(dec.Counter(), "x")
    assert_clear(info.value, errors.InvalidTypeError, HERE, "got a str")


def test_export_static_argnums_out_of_range(mods: Any) -> None:
    _, dec = mods
    with raises_autostate(errors.InvalidArgumentError) as info:
        autostate.export(dec.Counter(), jnp.ones(2), static_argnums=1)
    assert_clear(info.value, errors.InvalidArgumentError, HERE, "static_argnums")


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
    ("args", "static_argnums"),
    [((jnp.ones(2),), 1), ((jnp.ones(2),), -2), ((jnp.ones(2), 3.0), (0, 2)), ((), 0)],
)
def test_export_static_argnums_out_of_range_api_misuse_fixes(args: tuple, static_argnums: object) -> None:
    with pytest.raises(errors.InvalidArgumentError) as info:
        autostate.export(Counter(), *args, static_argnums=static_argnums)
    assert_clear_api_misuse_fixes(info.value, errors.InvalidArgumentError, "static_argnums", "position")


def test_export_static_argnums_not_an_int() -> None:
    with pytest.raises(errors.InvalidTypeError) as info:
        autostate.export(Counter(), jnp.ones(2), static_argnums="0")  # type: ignore[arg-type]
    assert_clear_api_misuse_fixes(info.value, errors.InvalidTypeError, "static_argnums", "str")


@pytest.mark.parametrize("static_argnums", [1, -1])
def test_export_negative_static_argnums_counts_from_the_end(static_argnums: int) -> None:
    model = Counter()
    exported = autostate.export(
        model, jnp.ones(2), 3.0, method="scaled", static_argnums=static_argnums
    )
    out, states = exported.call(autostate.state_dict(model), jnp.full(2, 2.0))
    ref = Counter()
    np.testing.assert_array_equal(out, ref.scaled(jnp.full(2, 2.0), 3.0))
    np.testing.assert_array_equal(states["count"], ref.count)
