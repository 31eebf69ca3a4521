"""Two processes of 4 CPU devices train as one process of 8 devices does.

``examples/multi_process.py`` (the program ``docs/multi_process.md`` shows)
runs twice, at the same time: launched as 2 processes x 4 virtual CPU devices
on 127.0.0.1 (``jax.distributed``, gloo collectives), and as one process with
8 devices. Both train the same sharded model (a BatchNorm's running
statistics, adamw) on a 2x4 mesh, save and restore with orbax half way, and
end with ``autostate.save``. Losses and every saved array must agree, and in
the two-process run only process 0 may have written the file (each process
runs in its own directory, as on its own host), gathered from both: its first
layer is split over the processes. A smaller program checks the rest of
``autostate.save`` and ``autostate.load`` across processes: a write that
fails in process 0 raises in both, and ``load`` in every process places each
array like ``like``'s, split over the processes.

Every process is bounded: the launcher kills its processes after
``--timeout`` or as soon as one fails, and this test kills what is left
after ``_TIMEOUT``.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import autostate

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "multi_process.py"
_TIMEOUT = 240


def _loopback_refused() -> str | None:
    """Why no TCP socket opens on 127.0.0.1 here (a sandbox that lets none), or None."""
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    return None


_REFUSED = _loopback_refused()
pytestmark = pytest.mark.skipif(
    _REFUSED is not None,
    reason=f"needs TCP sockets on 127.0.0.1 for jax.distributed, and this machine refuses them ({_REFUSED})",
)


def _env(devices: int, cache: Path) -> dict[str, str]:
    """The session's environment (its XLA flags too), with ``devices``, and the
    test's own caches: on jax 0.12 a process that reads an executable another
    test's processes compiled into the session's XLA cache waits in its
    collectives forever."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    return dict(os.environ, AUTOSTATE_CACHE_DIR=str(cache), XLA_FLAGS=flags.strip(),
                JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(cache / "xla"))


def _start(args: list[str], cwd: Path, devices: int, cache: Path) -> subprocess.Popen[str]:
    env = _env(devices, cache)
    return subprocess.Popen(
        [sys.executable, str(EXAMPLE), *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen[str]) -> str:
    try:
        out, err = proc.communicate(timeout=_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"still running after {_TIMEOUT}s:\n{out}\n{err[-3000:]}") from None
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{out}\n{err[-3000:]}"
    return out


def _finish_all(procs: list[subprocess.Popen[str]]) -> list[str]:
    """Every process's output; if one fails or hangs, the others are killed too."""
    try:
        return [_finish(p) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()


def _losses(out: str) -> list[float]:
    return [float(x) for x in re.findall(r"^step \d+  loss (\S+)$", out, re.M)]


def test_two_processes_of_four_devices_equal_one_process_of_eight(tmp_path: Path):
    cache, one, two = tmp_path / "cache", tmp_path / "one", tmp_path / "two"
    one.mkdir()
    reference = _start(["--workdir", str(one)], one, 8, cache)
    launched = _start(
        ["--launch", "2", "--cpu-devices", "4", "--timeout", "200", "--workdir", str(two)],
        tmp_path,
        4,
        cache,
    )
    out_two, out_one = _finish_all([launched, reference])

    assert "2 processes, 8 devices (4 local), mesh {'data': 2, 'model': 4}" in out_two
    assert "1 processes, 8 devices (8 local), mesh {'data': 2, 'model': 4}" in out_one
    # w1 is split over both processes: each holds half, and adam's moments follow it.
    assert "this process holds 256 of its 512 values; adam's mu of w1 as P('data', 'model')" in out_two
    assert "restored step 2 from orbax; w1 as P('data', 'model')" in out_two
    assert (two / "shared" / "ckpt").is_dir()
    losses_two, losses_one = _losses(out_two), _losses(out_one)
    assert len(losses_two) == len(losses_one) == 4
    np.testing.assert_allclose(losses_two, losses_one, atol=2e-6)
    assert losses_two[-1] < losses_two[0]

    # autostate.save: gathered across processes, written by process 0 alone.
    assert sorted(p.name for p in (two / "process0").iterdir()) == ["model.npz"]
    assert list((two / "process1").iterdir()) == []
    params_two, states_two = autostate.load_arrays(two / "process0" / "model.npz")
    params_one, states_one = autostate.load_arrays(one / "model.npz")
    assert sorted(params_two) == ["norm.scale", "w1", "w2"]
    assert sorted(states_two) == ["norm.mean", "norm.var", "steps"]
    for two_d, one_d in ((params_two, params_one), (states_two, states_one)):
        assert two_d.keys() == one_d.keys()
        for name in two_d:
            assert two_d[name].shape == one_d[name].shape, name
            np.testing.assert_allclose(two_d[name], one_d[name], atol=1e-6, err_msg=name)
    assert int(states_two["steps"]) == 4


# Each process: a model with an array split over both processes, saved where
# process 0 cannot write, then saved and loaded back by every process.
_SAVE_AND_LOAD = textwrap.dedent(
    """
    import sys

    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    import autostate

    process_id, coordinator, shared = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=2,
                               process_id=process_id, coordinator_bind_address=coordinator)


    @autostate.stateful
    class Model:
        def __init__(self, key):
            self.w = autostate.sharded(jax.random.normal(key, (4, 8)), P("data", "model"))
            self.mean = autostate.state(jnp.arange(8.0), sharding=P("model"))


    def init(key):
        return Model(key).functionalize()


    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    f_sh, s_sh = autostate.shardings(*jax.eval_shape(init, jax.random.key(0)), mesh)
    sharded_init = jax.jit(init, out_shardings=(f_sh, s_sh))
    model = autostate.freeze(*sharded_init(jax.random.key(0)))
    try:
        autostate.save(shared + "/missing/model.npz", model)
    except Exception as e:
        print("save raised", type(e).__name__)
    autostate.save(shared + "/model.npz", model)
    like = autostate.freeze(*sharded_init(jax.random.key(1)))
    f, states = autostate.load(shared + "/model.npz", like=like).functionalize()
    print("loaded as", f.model.w.sharding.spec, states["mean"].sharding.spec)
    same = jax.jit(lambda a, b: jnp.stack([(x == y).all() for x, y in zip(
        jax.tree.leaves(a), jax.tree.leaves(b))]).all())(
        (f, states), model.functionalize())
    print("equal", bool(same))
    jax.distributed.shutdown()
    """
)


def test_save_and_load_are_called_by_every_process(tmp_path: Path):
    """save: process 0's failure to write raises in both; load: both read, arrays placed like ``like``."""
    (tmp_path / "program.py").write_text(_SAVE_AND_LOAD)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        coordinator = f"127.0.0.1:{s.getsockname()[1]}"
    env = _env(4, tmp_path / "cache")
    procs = [
        subprocess.Popen(
            [sys.executable, "program.py", str(i), coordinator, str(tmp_path)],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = _finish_all(procs)
    for i, out in enumerate(outs):
        error = "FileNotFoundError" if i == 0 else "CheckpointError"
        assert f"save raised {error}" in out, out
        assert "loaded as P('data', 'model') P('model',)" in out, out
        assert "equal True" in out, out
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".npz") == ["model.npz"]
