"""Data- and tensor-parallel training of a small transformer on a 2x4 mesh.

Run it with ``python examples/sharded_training.py [--smoke]``. Without 8
devices it asks XLA for 8 virtual CPU devices (the flag must be set before
JAX is imported, hence the first lines). The model annotates its arrays with
*logical* axis names in ``__init__`` (``autostate.sharded``,
``autostate.state(..., sharding=...)``); ``RULES`` maps them to the mesh's
``data`` and ``model`` axes; ``autostate.shardings`` turns the annotations
into the ``NamedSharding`` trees of ``f`` and ``states`` that ``jax.jit``
takes, and the model is built directly in that layout by constructing it
under ``jax.jit`` with those ``out_shardings``. Each step is jitted with ``f`` and ``states`` donated, and the new
states come back in the layout they went in.
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import autostate  # noqa: E402

# Logical axis -> mesh axis: heads and the MLP's hidden units are split over
# "model", the embedding is not split. (The batch is split over "data" by
# the step's in_shardings.)
RULES = {"embed": None, "heads": "model", "mlp": "model"}


@dataclasses.dataclass(frozen=True)
class Config:
    d: int = 32
    heads: int = 4
    mlp: int = 64
    layers: int = 2
    batch: int = 8
    seq: int = 8
    steps: int = 5
    lr: float = 0.05


@autostate.stateful
class RunningNorm:
    """Normalizes with batch statistics and keeps their running averages (BatchNorm).

    ``axis_name`` names the mapped axis to average the statistics over when
    the model runs per device under ``shard_map``; under ``jax.jit`` with a
    batch sharded over devices the mean over the batch is already global.
    """

    def __init__(self, d, momentum=0.9, axis_name=None):
        self.scale = autostate.sharded(jnp.ones(d), P("embed"))
        self.mean = autostate.state(jnp.zeros(d), sharding=P("embed"))
        self.var = autostate.state(jnp.ones(d), sharding=P("embed"))
        self.momentum = momentum
        self.axis_name = axis_name

    def __call__(self, x):
        mean = x.mean(axis=(0, 1))
        if self.axis_name is not None:
            mean = jax.lax.pmean(mean, self.axis_name)
        var = ((x - mean) ** 2).mean(axis=(0, 1))
        if self.axis_name is not None:
            var = jax.lax.pmean(var, self.axis_name)
        self.mean = self.momentum * self.mean + (1 - self.momentum) * mean
        self.var = self.momentum * self.var + (1 - self.momentum) * var
        return (x - mean) * jax.lax.rsqrt(var + 1e-5) * self.scale


@autostate.stateful
class Attention:
    def __init__(self, key, d, heads):
        kq, kk, kv, ko = jax.random.split(key, 4)
        init = jax.nn.initializers.lecun_normal()
        self.wq = autostate.sharded(init(kq, (d, d)), P("embed", "heads"))
        self.wk = autostate.sharded(init(kk, (d, d)), P("embed", "heads"))
        self.wv = autostate.sharded(init(kv, (d, d)), P("embed", "heads"))
        self.wo = autostate.sharded(init(ko, (d, d)), P("heads", "embed"))
        self.heads = heads

    def __call__(self, x):
        b, s, d = x.shape

        def split(y):
            return y.reshape(b, s, self.heads, d // self.heads)

        q, k, v = split(x @ self.wq), split(x @ self.wk), split(x @ self.wv)
        logits = jnp.einsum("bqhc,bkhc->bhqk", q, k) / jnp.sqrt(d // self.heads)
        causal = jnp.tril(jnp.ones((s, s), bool))
        weights = jax.nn.softmax(jnp.where(causal, logits, -1e9), axis=-1)
        out = jnp.einsum("bhqk,bkhc->bqhc", weights, v).reshape(b, s, d)
        return out @ self.wo


@autostate.stateful
class MLP:
    def __init__(self, key, d, hidden):
        k1, k2 = jax.random.split(key)
        init = jax.nn.initializers.lecun_normal()
        self.w1 = autostate.sharded(init(k1, (d, hidden)), P("embed", "mlp"))
        self.b1 = autostate.sharded(jnp.zeros(hidden), P("mlp"))
        self.w2 = autostate.sharded(init(k2, (hidden, d)), P("mlp", "embed"))

    def __call__(self, x):
        return jax.nn.gelu(x @ self.w1 + self.b1) @ self.w2


@autostate.stateful
class Block:
    def __init__(self, key, cfg, axis_name=None):
        k1, k2 = jax.random.split(key)
        self.norm = RunningNorm(cfg.d, axis_name=axis_name)
        self.attn = Attention(k1, cfg.d, cfg.heads)
        self.mlp = MLP(k2, cfg.d, cfg.mlp)

    def __call__(self, x):
        x = self.norm(x)
        x = x + self.attn(x)
        return x + self.mlp(x)


@autostate.stateful
class Transformer:
    def __init__(self, key, cfg, axis_name=None):
        keys = jax.random.split(key, cfg.layers)
        self.blocks = [Block(k, cfg, axis_name) for k in keys]
        self.step = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.step += 1
        for block in self.blocks:
            x = block(x)
        return x


def loss_fn(f, states, x, y):
    out, states = f(states, x)
    return jnp.mean((out - y) ** 2), states


def train_step(f, states, x, y, lr):
    """One SGD step: ``(loss, grads, new_f, new_states)``."""
    (loss, states), grads = jax.value_and_grad(loss_fn, has_aux=True)(f, states, x, y)
    f = jax.tree_util.tree_map(lambda p, g: p - lr * g, f, grads)
    return loss, grads, f, states


def make_mesh() -> jax.sharding.Mesh:
    """The 2x4 (data, model) mesh; explicit ``Auto`` axes: XLA propagates shardings."""
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def batches(cfg: Config, n: int) -> list[tuple[jax.Array, jax.Array]]:
    key = jax.random.key(1)
    out = []
    for k in jax.random.split(key, n):
        kx, ky = jax.random.split(k)
        x = jax.random.normal(kx, (cfg.batch, cfg.seq, cfg.d))
        out.append((x, jnp.roll(x, 1, axis=1) + 0.1 * jax.random.normal(ky, x.shape)))
    return out


def sharded_step(mesh, f_sh, s_sh, lr):
    """``train_step`` jitted for ``mesh``; ``f`` and ``states`` are donated."""
    batch_sh = NamedSharding(mesh, P("data"))
    replicated = NamedSharding(mesh, P())
    return jax.jit(
        lambda f, s, x, y: train_step(f, s, x, y, lr),
        in_shardings=(f_sh, s_sh, batch_sh, batch_sh),
        out_shardings=(replicated, f_sh, f_sh, s_sh),
        donate_argnums=(0, 1),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny model, two steps")
    args = parser.parse_args(argv)
    cfg = Config(d=16, mlp=32, layers=1, steps=2) if args.smoke else Config()
    if jax.device_count() < 8:
        raise SystemExit(
            f"needs 8 devices, found {jax.device_count()} ({jax.default_backend()}): "
            "JAX_PLATFORMS=cpu runs it on 8 virtual CPU devices"
        )
    mesh = make_mesh()

    def init(key):
        return autostate.functionalize(Transformer(key, cfg))

    # Sharded init: the shapes (no computation), then their shardings, then the
    # model built under jit with those out_shardings, each array in its layout.
    key = jax.random.key(0)
    abstract_f, abstract_states = jax.eval_shape(init, key)
    f_sh, s_sh = autostate.shardings(abstract_f, abstract_states, mesh, rules=RULES)
    f, states = jax.jit(init, out_shardings=(f_sh, s_sh))(key)
    print(f"mesh {dict(mesh.shape)}; blocks[0].attn.wq sharded as "
          f"{f.model.blocks[0].attn.wq.sharding.spec}")

    step = sharded_step(mesh, f_sh, s_sh, cfg.lr)
    for i, (x, y) in enumerate(batches(cfg, cfg.steps)):
        loss, _, f, states = step(f, states, x, y)
        print(f"step {i + 1}  loss {float(loss):.4f}")
    kept = all(
        leaf.sharding.is_equivalent_to(want, leaf.ndim)
        for leaf, want in zip(jax.tree_util.tree_leaves(states), jax.tree_util.tree_leaves(s_sh))
    )
    print(f"step counter {int(states['step'])}; states kept their shardings: {kept}")


if __name__ == "__main__":
    main()
