"""Data- and model-parallel training across several processes, checkpointed with orbax.

Run it on one machine as two processes of 4 virtual CPU devices each::

    python examples/multi_process.py --launch 2 --cpu-devices 4 --workdir /tmp/run

``--launch`` starts this script once per process on 127.0.0.1 (each in its
own directory under ``--workdir``, as if on its own host) and waits for them,
killing all of them if one fails or they outlive ``--timeout``. On a cluster,
start one process per host yourself instead::

    python examples/multi_process.py --process-id I --num-processes N \\
        --coordinator HOST0:PORT --workdir /shared/run

Every process builds the same model under the same mesh, feeds its own part
of each batch, and calls the same collectives in the same order: that is the
SPMD contract of ``jax.distributed``. The model annotates its arrays in
``__init__``; the first layer's weights are split over both mesh axes, so
each process holds only its half of them.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import autostate


@autostate.stateful
class BatchNorm:
    """Normalizes with the batch statistics and keeps their running averages."""

    def __init__(self, d, momentum=0.9):
        self.scale = autostate.sharded(jnp.ones(d), P("model"))
        self.mean = autostate.state(jnp.zeros(d), sharding=P("model"))
        self.var = autostate.state(jnp.ones(d), sharding=P("model"))
        self.momentum = momentum

    def __call__(self, x):
        mean = x.mean(0)  # under jit, the mean over the global batch, every process's rows
        var = ((x - mean) ** 2).mean(0)
        self.mean = self.momentum * self.mean + (1 - self.momentum) * mean
        self.var = self.momentum * self.var + (1 - self.momentum) * var
        return (x - mean) * jax.lax.rsqrt(var + 1e-5) * self.scale


@autostate.stateful
class MLP:
    def __init__(self, key, d_in, hidden, d_out):
        k1, k2 = jax.random.split(key)
        init = jax.nn.initializers.lecun_normal()
        self.w1 = autostate.sharded(init(k1, (d_in, hidden)), P("data", "model"))
        self.norm = BatchNorm(hidden)
        self.w2 = autostate.sharded(init(k2, (hidden, d_out)), P("model", None))
        self.steps = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.steps += 1
        return jax.nn.relu(self.norm(x @ self.w1)) @ self.w2


def init(key):
    return autostate.functionalize(MLP(key, 16, 32, 4))


optimizer = optax.adamw(1e-2)


def loss_fn(f, states, x, y):
    out, states = f(states, x)
    return jnp.mean((out - y) ** 2), states


def train_step(f, states, opt_state, x, y):
    (loss, states), grads = jax.value_and_grad(loss_fn, has_aux=True)(f, states, x, y)
    updates, opt_state = optimizer.update(grads, opt_state, f)
    return loss, optax.apply_updates(f, updates), states, opt_state


def global_batch(step, sharding, n=16):
    """Step ``step``'s batch as global arrays; this process supplies only its rows.

    Here every process can make the whole batch (same key); a real input
    pipeline reads only this process's files. ``rows`` is the part of the
    batch that lives on this process's devices.
    """
    kx, kw = jax.random.split(jax.random.key(100 + step))
    x = jax.random.normal(kx, (n, 16))
    y = jnp.sin(x[:, :4]) + 0.1 * jax.random.normal(kw, (n, 4))
    shards = sharding.addressable_devices_indices_map(x.shape).values()
    rows = slice(min(s[0].start or 0 for s in shards), max(s[0].stop or n for s in shards))
    return tuple(
        jax.make_array_from_process_local_data(sharding, a[rows], global_shape=a.shape)
        for a in (x, y)
    )


def train(args):
    """One process's program: the same in every process."""
    if args.num_processes > 1:
        jax.distributed.initialize(
            coordinator_address=args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
            # Where the coordinator (process 0) listens: the loopback for a
            # local run; by default it listens on every interface.
            coordinator_bind_address=args.coordinator if args.local else None,
        )
    say = print if jax.process_index() == 0 else (lambda *a: None)
    mesh = jax.make_mesh((jax.device_count() // 4, 4), ("data", "model"),
                         axis_types=(AxisType.Auto,) * 2)
    replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    say(f"{jax.process_count()} processes, {jax.device_count()} devices "
        f"({jax.local_device_count()} local), mesh {dict(mesh.shape)}")

    # Sharded init: shapes only, then the shardings, then each array built in its layout.
    key = jax.random.key(0)
    abstract_f, abstract_states = jax.eval_shape(init, key)
    f_sh, s_sh = autostate.shardings(abstract_f, abstract_states, mesh)
    sharded_init = jax.jit(init, out_shardings=(f_sh, s_sh))
    f, states = sharded_init(key)
    # The optimizer state: each copy of the parameters (adam's mu and nu) takes
    # the parameters' shardings, the rest (the step count) is replicated.
    abstract_opt = jax.eval_shape(optimizer.init, f)
    opt_sh = optax.tree_utils.tree_map_params(
        optimizer, lambda _, s: s, abstract_opt, f_sh, transform_non_params=lambda _: replicated
    )
    opt_init = jax.jit(optimizer.init, out_shardings=opt_sh)
    opt_state = opt_init(f)
    w1 = f.model.w1
    say(f"w1 {w1.shape} as {w1.sharding.spec}: this process holds "
        f"{sum(s.data.size for s in w1.addressable_shards)} of its {w1.size} values; "
        f"adam's mu of w1 as {opt_state[0].mu.model.w1.sharding.spec}")

    step = jax.jit(
        train_step,
        in_shardings=(f_sh, s_sh, opt_sh, batch, batch),
        out_shardings=(replicated, f_sh, s_sh, opt_sh),
        donate_argnums=(0, 1, 2),
    )
    ckpt = Path(args.workdir).absolute() / "shared" / "ckpt"
    for i in range(args.steps):
        if i == args.steps // 2:
            # Every process saves (each writes its own shards) and restores into
            # the abstract sharded model: shapes, dtypes and shardings, no arrays.
            with ocp.StandardCheckpointer() as ckptr:
                ckptr.save(ckpt, {"f": f, "states": states, "opt": opt_state})
            abstract_f, abstract_states = jax.eval_shape(sharded_init, key)
            target = {"f": abstract_f, "states": abstract_states,
                      "opt": jax.eval_shape(opt_init, abstract_f)}
            with ocp.StandardCheckpointer() as ckptr:
                restored = ckptr.restore(ckpt, target)
            f, states, opt_state = restored["f"], restored["states"], restored["opt"]
            say(f"restored step {int(states['steps'])} from orbax; "
                f"w1 as {f.model.w1.sharding.spec}")
        loss, f, states, opt_state = step(f, states, opt_state, *global_batch(i, batch))
        say(f"step {i + 1}  loss {float(loss):.6f}")

    # autostate.save gathers every array (a collective: every process calls it)
    # and only process 0 writes, here in its own directory.
    model = autostate.freeze(f, states)
    autostate.save("model.npz", model)
    say(f"process 0 wrote {Path('model.npz').absolute()}")
    if args.num_processes > 1:
        jax.distributed.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args) -> int:
    """Starts ``args.launch`` processes of this script on 127.0.0.1 and waits for them."""
    coordinator = f"127.0.0.1:{free_port()}"
    # The device count joins whatever XLA flags the caller set (it comes last, so it wins).
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.cpu_devices}"
    env = dict(os.environ, XLA_FLAGS=flags.strip(), JAX_PLATFORMS="cpu")
    procs = []
    for i in range(args.launch):
        cwd = Path(args.workdir).absolute() / f"process{i}"  # this process's "host"
        cwd.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, str(Path(__file__).absolute()), "--process-id", str(i),
               "--num-processes", str(args.launch), "--coordinator", coordinator, "--local",
               "--workdir", str(Path(args.workdir).absolute()), "--steps", str(args.steps)]
        procs.append(subprocess.Popen(cmd, cwd=cwd, env=env))
    deadline = time.monotonic() + args.timeout
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.poll() for p in procs):
                break  # out of time, or one failed: the others would wait for it forever
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    codes = [p.returncode for p in procs]
    if any(codes):
        print(f"processes ended with {codes}", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("--launch", type=int, help="start this many local processes")
    parser.add_argument("--cpu-devices", type=int, default=4, help="with --launch: per process")
    parser.add_argument("--timeout", type=float, default=120, help="with --launch: seconds")
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--coordinator", help="process 0's HOST:PORT")
    parser.add_argument("--local", action="store_true", help="the coordinator listens on the "
                        "loopback only (every process on this machine)")
    parser.add_argument("--workdir", required=True, help="shared by every process")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    if args.launch:
        return launch(args)
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
