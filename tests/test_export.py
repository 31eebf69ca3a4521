"""``autostate/export.py``: ``jax.export`` programs that thread states."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from export_models import (  # noqa: I001 - tests/ is on sys.path
    STATE_KEYS,
    XS,
    Net,
    run,
)

import autostate

render_module = sys.modules["autostate.render"]


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
