"""Train a few steps, save, resume in a new process, export, call the export.

Run it with ``python examples/save_load_export.py``. This process trains a
small regressor for three steps and saves it; a second Python process loads
the checkpoint into a freshly built model, trains three more steps, saves
again and writes a serialized ``jax.export`` program; back here, the exported
program is called on the saved states and checked against the live model.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import autostate

N_IN, N_HIDDEN, BATCH = 4, 16, 64


@autostate.stateful
class RunningNorm:
    def __init__(self, n):
        self.mean = jnp.zeros(n)
        self.count = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.count += 1
        self.mean = self.mean + (x.mean(0) - self.mean) / self.count
        return x - self.mean


@autostate.stateful
class Regressor:
    def __init__(self, n_in, n_hidden, seed=0):
        k1, k2 = jax.random.split(jax.random.key(seed))
        self.norm = RunningNorm(n_in)
        self.w1 = jax.random.normal(k1, (n_in, n_hidden)) / jnp.sqrt(n_in)
        self.w2 = jax.random.normal(k2, (n_hidden,)) / jnp.sqrt(n_hidden)
        self.steps = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.steps += 1
        return jnp.tanh(self.norm(x) @ self.w1) @ self.w2


def batch(seed):
    x = jax.random.normal(jax.random.key(seed), (BATCH, N_IN))
    return x, jnp.sin(x).sum(1)


@jax.jit
def train_step(f, states, x, y):
    def loss(f):
        pred, new_states = f(states, x)
        return jnp.mean((pred - y) ** 2), new_states

    (value, states), grads = jax.value_and_grad(loss, has_aux=True)(f)
    f = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, f, grads)
    return f, states, value


def train(model, steps, first_batch):
    f, states = autostate.functionalize(model)
    for i in range(steps):
        f, states, value = train_step(f, states, *batch(first_batch + i))
        print(f"  step {int(states['steps'])}: loss {float(value):.4f}")
    return autostate.freeze(f, states)


def resume(folder: Path, platforms: list[str], precision: str | None) -> None:
    """The second process: load, continue training, save, export."""
    if precision is not None:
        # An export keeps the matrix-product precision it was traced at: the
        # first process's, which the live model it is checked against runs at.
        jax.config.update("jax_default_matmul_precision", precision)
    print("[new process] loading the checkpoint into a fresh Regressor")
    model = autostate.load(folder / "ckpt.npz", like=Regressor(N_IN, N_HIDDEN, seed=123))
    model = train(model, steps=3, first_batch=3)
    autostate.save(folder / "resumed.npz", model)
    spec = jax.ShapeDtypeStruct((BATCH, N_IN), jnp.float32)
    exported = autostate.export(model, spec, platforms=platforms)
    blob = exported.serialize()
    (folder / "regressor.jax").write_bytes(blob)
    print(f"[new process] saved resumed.npz and regressor.jax ({len(blob)} bytes)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--resume", type=Path, help="(used by the second process)")
    parser.add_argument("--platforms", nargs="+", help="(used by the second process)")
    parser.add_argument("--precision", help="(used by the second process)")
    args = parser.parse_args()
    if args.resume is not None:
        resume(args.resume, args.platforms, args.precision)
        return

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        print("training 3 steps")
        model = train(Regressor(N_IN, N_HIDDEN), steps=3, first_batch=0)
        print(model)
        autostate.save(folder / "ckpt.npz", model)
        # One process at a time can hold a TPU: on an accelerator the second
        # process runs on the CPU, and exports for both platforms.
        here = jax.default_backend()
        env = None if here == "cpu" else {**os.environ, "JAX_PLATFORMS": "cpu"}
        platforms = sorted({"cpu", here})
        command = [sys.executable, __file__, "--resume", str(folder), "--platforms", *platforms]
        precision = jax.config.jax_default_matmul_precision
        if precision is not None:
            command += ["--precision", precision]
        subprocess.run(command, check=True, env=env)

        # The exported program needs neither the Regressor class nor its
        # parameters: they are baked in. The states come from the checkpoint.
        exported = jax.export.deserialize(bytearray((folder / "regressor.jax").read_bytes()))
        _, states = autostate.load_arrays(folder / "resumed.npz")
        live = autostate.load(folder / "resumed.npz", like=Regressor(N_IN, N_HIDDEN))
        f, live_states = autostate.functionalize(live)
        for seed in (100, 101):
            x, _ = batch(seed)
            out, states = exported.call(states, x)
            want, live_states = f(live_states, x)
            gap = float(np.max(np.abs(np.asarray(out) - np.asarray(want))))
            print(f"exported call: steps={int(states['steps'])}, max |export - live| = {gap:.2e}")
            assert gap < 1e-5 and int(states["steps"]) == int(live_states["steps"])
    print("ok")


if __name__ == "__main__":
    main()
