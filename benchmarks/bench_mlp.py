"""Scenario 1 (and half of 4): one training step of a BatchNorm MLP.

The model: ``depth`` hidden layers ``Linear -> BatchNorm (momentum 0.9,
training mode) -> relu``, then a ``Linear`` to ``classes`` logits; the step
computes softmax cross-entropy on one batch, its gradient, and an SGD update,
all inside one jitted function. Every implementation starts from the same
parameters (``canonical_init``), is run for two steps and compared with the
hand-written JAX step (loss, parameters and running statistics) before it is
timed.

Each peer is written the way its documentation writes it: Flax NNX with
``nnx.jit`` + ``nnx.Optimizer`` (and with ``nnx.split``/``nnx.merge`` around
``jax.jit``, the NNX performance guide's pattern), Equinox with
``make_with_state`` + ``vmap(axis_name="batch")`` + ``filter_jit``, Haiku with
``transform_with_state``, penzai v1 with a local-state effect and named axes.
Two peers need their own BatchNorm to compute the same thing: ``hk.BatchNorm``
keeps zero-debiased moving averages, so the Haiku row uses
``hk.get_state``/``hk.set_state`` (Haiku's documented state API); penzai v1 has
no BatchNorm layer.

Run: ``python benchmarks/bench_mlp.py [--smoke]``.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from _jaxpr import zero_overhead_table
from _timing import (
    NOT_INSTALLED,
    PeerMissing,
    Report,
    Table,
    fmt_ratio,
    fmt_seconds,
    optional_import,
    paired_ratio,
    script_main,
    target_below,
    time_interleaved,
    time_once,
)

import autostate


@dataclasses.dataclass(frozen=True)
class Config:
    in_features: int = 784
    width: int = 256
    depth: int = 4
    classes: int = 10
    batch: int = 128
    momentum: float = 0.9
    eps: float = 1e-5
    lr: float = 0.1
    # timing
    rounds: int = 25
    number: int = 10
    first_call_repeats: int = 3


FULL = Config()
SMOKE = Config(in_features=6, width=8, depth=2, classes=3, batch=4, rounds=1, number=1,
               first_call_repeats=1)

Canonical = dict[str, Any]


def canonical_init(cfg: Config, seed: int = 0) -> tuple[Canonical, Canonical, np.ndarray, np.ndarray]:
    """Parameters, running statistics and one batch, as numpy, shared by every implementation."""
    rng = np.random.default_rng(seed)
    sizes = [cfg.in_features] + [cfg.width] * cfg.depth
    hidden = []
    for din, dout in zip(sizes[:-1], sizes[1:]):
        hidden.append(
            {
                "w": (rng.standard_normal((din, dout)) / np.sqrt(din)).astype(np.float32),
                "b": (0.1 * rng.standard_normal(dout)).astype(np.float32),
                "scale": np.ones(dout, np.float32),
                "bias": np.zeros(dout, np.float32),
            }
        )
    out = {
        "w": (rng.standard_normal((cfg.width, cfg.classes)) / np.sqrt(cfg.width)).astype(np.float32),
        "b": np.zeros(cfg.classes, np.float32),
    }
    states = {
        "hidden": [
            {"mean": np.zeros(cfg.width, np.float32), "var": np.ones(cfg.width, np.float32)}
            for _ in range(cfg.depth)
        ]
    }
    x = rng.standard_normal((cfg.batch, cfg.in_features)).astype(np.float32)
    y = rng.integers(0, cfg.classes, cfg.batch).astype(np.int32)
    return {"hidden": hidden, "out": out}, states, x, y


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    log_probs = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(log_probs, labels[:, None], axis=1))


def sgd(params: Any, grads: Any, lr: float) -> Any:
    return jax.tree.map(lambda p, g: p - lr * g, params, grads)


class Trainer:
    """One implementation, ready to run: ``step()`` returns the loss of one step.

    ``export()`` returns ``(params, states)`` in the canonical layout, for the
    numerical check; ``jaxpr()`` the traced step, for the rows that take part
    in the zero-overhead check (hand-written JAX and autostate).
    """

    def step(self) -> jax.Array:
        raise NotImplementedError

    def export(self) -> tuple[Canonical, Canonical]:
        raise NotImplementedError

    def jaxpr(self) -> Any:
        raise NotImplementedError


# --- hand-written JAX -------------------------------------------------------


def handwritten_forward(params, states, x, *, momentum, eps):
    new_hidden = []
    for p, s in zip(params["hidden"], states["hidden"]):
        h = x @ p["w"] + p["b"]
        m, v = h.mean(0), h.var(0)
        new_hidden.append(
            {
                "mean": momentum * s["mean"] + (1 - momentum) * m,
                "var": momentum * s["var"] + (1 - momentum) * v,
            }
        )
        x = jax.nn.relu((h - m) / jnp.sqrt(v + eps) * p["scale"] + p["bias"])
    return x @ params["out"]["w"] + params["out"]["b"], {"hidden": new_hidden}


class HandwrittenTrainer(Trainer):
    def __init__(self, cfg: Config, params, states, x, y):
        forward = functools.partial(handwritten_forward, momentum=cfg.momentum, eps=cfg.eps)

        def train_step(params, states, x, y):
            def loss_fn(params):
                logits, new_states = forward(params, states, x)
                return cross_entropy(logits, y), new_states

            (loss, states), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
            return sgd(params, grads, cfg.lr), states, loss

        self._step = jax.jit(train_step)
        self.params = jax.tree.map(jnp.asarray, params)
        self.states = jax.tree.map(jnp.asarray, states)
        self.x, self.y = jnp.asarray(x), jnp.asarray(y)

    def step(self):
        self.params, self.states, loss = self._step(self.params, self.states, self.x, self.y)
        return loss

    def export(self):
        return self.params, self.states

    def jaxpr(self):
        return jax.make_jaxpr(self._step)(self.params, self.states, self.x, self.y)


# --- autostate --------------------------------------------------------------


@autostate.stateful
class Linear:
    def __init__(self, w, b):
        self.w = jnp.asarray(w)
        self.b = jnp.asarray(b)

    def __call__(self, x):
        return x @ self.w + self.b


@autostate.stateful
class BatchNorm:
    def __init__(self, n, momentum=0.9, eps=1e-5):
        self.scale = jnp.ones(n)
        self.bias = jnp.zeros(n)
        self.mean = jnp.zeros(n)
        self.var = jnp.ones(n)
        self.momentum = momentum
        self.eps = eps

    def __call__(self, x):
        m, v = x.mean(0), x.var(0)
        self.mean = self.momentum * self.mean + (1 - self.momentum) * m
        self.var = self.momentum * self.var + (1 - self.momentum) * v
        return (x - m) / jnp.sqrt(v + self.eps) * self.scale + self.bias


@autostate.stateful
class MLP:
    def __init__(self, linears, norms, out):
        self.linears = linears
        self.norms = norms
        self.out = out

    def __call__(self, x):
        for linear, norm in zip(self.linears, self.norms):
            x = jax.nn.relu(norm(linear(x)))
        return self.out(x)


class AutostateTrainer(Trainer):
    def __init__(self, cfg: Config, params, states, x, y):
        model = MLP(
            [Linear(p["w"], p["b"]) for p in params["hidden"]],
            [BatchNorm(cfg.width, cfg.momentum, cfg.eps) for _ in params["hidden"]],
            Linear(params["out"]["w"], params["out"]["b"]),
        )
        self.f, self.states = model.functionalize()

        def loss_fn(f, states, x, y):
            logits, states = f(states, x)
            return cross_entropy(logits, y), states

        def train_step(f, states, x, y):
            (loss, states), grads = jax.value_and_grad(loss_fn, has_aux=True)(f, states, x, y)
            return sgd(f, grads, cfg.lr), states, loss

        self._step = jax.jit(train_step)
        self.x, self.y = jnp.asarray(x), jnp.asarray(y)
        self.depth = cfg.depth

    def step(self):
        self.f, self.states, loss = self._step(self.f, self.states, self.x, self.y)
        return loss

    def export(self):
        m = self.f.model
        params = {
            "hidden": [
                {"w": lin.w, "b": lin.b, "scale": bn.scale, "bias": bn.bias}
                for lin, bn in zip(m.linears, m.norms)
            ],
            "out": {"w": m.out.w, "b": m.out.b},
        }
        states = {
            "hidden": [
                {"mean": self.states[f"norms[{i}].mean"], "var": self.states[f"norms[{i}].var"]}
                for i in range(self.depth)
            ]
        }
        return params, states

    def jaxpr(self):
        return jax.make_jaxpr(self._step)(self.f, self.states, self.x, self.y)


# --- Flax NNX ---------------------------------------------------------------


def _nnx_model(cfg: Config, params):
    nnx = optional_import("flax.nnx")

    class NNXMLP(nnx.Module):
        def __init__(self, cfg: Config, rngs: nnx.Rngs):
            sizes = [cfg.in_features] + [cfg.width] * cfg.depth
            self.linears = nnx.List(
                [nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes[:-1], sizes[1:])]
            )
            self.norms = nnx.List(
                [
                    nnx.BatchNorm(cfg.width, momentum=cfg.momentum, epsilon=cfg.eps,
                                  use_running_average=False, rngs=rngs)
                    for _ in range(cfg.depth)
                ]
            )
            self.out = nnx.Linear(cfg.width, cfg.classes, rngs=rngs)

        def __call__(self, x):
            for linear, norm in zip(self.linears, self.norms):
                x = nnx.relu(norm(linear(x)))
            return self.out(x)

    model = NNXMLP(cfg, nnx.Rngs(0))
    for linear, p in zip(model.linears, params["hidden"]):
        linear.kernel[...] = jnp.asarray(p["w"])
        linear.bias[...] = jnp.asarray(p["b"])
    model.out.kernel[...] = jnp.asarray(params["out"]["w"])
    model.out.bias[...] = jnp.asarray(params["out"]["b"])
    return nnx, model


def _nnx_export(model, depth):
    params = {
        "hidden": [
            {"w": lin.kernel[...], "b": lin.bias[...], "scale": bn.scale[...], "bias": bn.bias[...]}
            for lin, bn in zip(model.linears, model.norms)
        ],
        "out": {"w": model.out.kernel[...], "b": model.out.bias[...]},
    }
    states = {"hidden": [{"mean": bn.mean[...], "var": bn.var[...]} for bn in model.norms]}
    return params, states


class NNXJitTrainer(Trainer):
    def __init__(self, cfg: Config, params, states, x, y):
        nnx, self.model = _nnx_model(cfg, params)
        optax = optional_import("optax")
        self.optimizer = nnx.Optimizer(self.model, optax.sgd(cfg.lr), wrt=nnx.Param)

        @nnx.jit
        def train_step(model, optimizer, x, y):
            def loss_fn(model):
                return cross_entropy(model(x), y)

            loss, grads = nnx.value_and_grad(loss_fn)(model)
            optimizer.update(model, grads)
            return loss

        self._step = train_step
        self.x, self.y = jnp.asarray(x), jnp.asarray(y)
        self.depth = cfg.depth

    def step(self):
        return self._step(self.model, self.optimizer, self.x, self.y)

    def export(self):
        return _nnx_export(self.model, self.depth)


class NNXSplitMergeTrainer(Trainer):
    def __init__(self, cfg: Config, params, states, x, y):
        nnx, self.model = _nnx_model(cfg, params)
        optax = optional_import("optax")
        self.nnx = nnx
        self.optimizer = nnx.Optimizer(self.model, optax.sgd(cfg.lr), wrt=nnx.Param)
        self.graphdef, self.state = nnx.split((self.model, self.optimizer))

        @jax.jit
        def train_step(graphdef, state, x, y):
            model, optimizer = nnx.merge(graphdef, state)

            def loss_fn(model):
                return cross_entropy(model(x), y)

            loss, grads = nnx.value_and_grad(loss_fn)(model)
            optimizer.update(model, grads)
            return loss, nnx.state((model, optimizer))

        self._step = train_step
        self.x, self.y = jnp.asarray(x), jnp.asarray(y)
        self.depth = cfg.depth

    def step(self):
        loss, self.state = self._step(self.graphdef, self.state, self.x, self.y)
        return loss

    def export(self):
        self.nnx.update((self.model, self.optimizer), self.state)
        return _nnx_export(self.model, self.depth)


# --- Equinox ----------------------------------------------------------------


class EquinoxTrainer(Trainer):
    def __init__(self, cfg: Config, params, states, x, y):
        eqx = optional_import("equinox")
        optax = optional_import("optax")

        class EqxMLP(eqx.Module):
            linears: list
            norms: list
            out: eqx.nn.Linear

            def __init__(self, cfg: Config, key):
                sizes = [cfg.in_features] + [cfg.width] * cfg.depth
                keys = jax.random.split(key, cfg.depth + 1)
                self.linears = [
                    eqx.nn.Linear(a, b, key=k) for a, b, k in zip(sizes[:-1], sizes[1:], keys)
                ]
                self.norms = [
                    eqx.nn.BatchNorm(cfg.width, axis_name="batch", momentum=cfg.momentum,
                                     eps=cfg.eps, mode="batch")
                    for _ in range(cfg.depth)
                ]
                self.out = eqx.nn.Linear(cfg.width, cfg.classes, key=keys[-1])

            def __call__(self, x, state):
                for linear, norm in zip(self.linears, self.norms):
                    x, state = norm(linear(x), state)
                    x = jax.nn.relu(x)
                return self.out(x), state

        model, state = eqx.nn.make_with_state(EqxMLP)(cfg, jax.random.PRNGKey(0))
        model = eqx.tree_at(
            lambda m: [leaf for lin in (*m.linears, m.out) for leaf in (lin.weight, lin.bias)],
            model,
            [
                jnp.asarray(v)
                for p in (*params["hidden"], params["out"])
                for v in (p["w"].T, p["b"])
            ],
        )
        optim = optax.sgd(cfg.lr)

        @eqx.filter_jit
        def train_step(model, state, opt_state, x, y):
            def loss_fn(model, state):
                batch_model = jax.vmap(
                    model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
                )
                logits, state = batch_model(x, state)
                return cross_entropy(logits, y), state

            (loss, state), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(model, state)
            updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
            model = eqx.apply_updates(model, updates)
            return model, state, opt_state, loss

        self._step = train_step
        self.model, self.state = model, state
        self.opt_state = optim.init(eqx.filter(model, eqx.is_array))
        self.x, self.y = jnp.asarray(x), jnp.asarray(y)

    def step(self):
        self.model, self.state, self.opt_state, loss = self._step(
            self.model, self.state, self.opt_state, self.x, self.y
        )
        return loss

    def export(self):
        m = self.model
        params = {
            "hidden": [
                {"w": lin.weight.T, "b": lin.bias, "scale": bn.weight, "bias": bn.bias}
                for lin, bn in zip(m.linears, m.norms)
            ],
            "out": {"w": m.out.weight.T, "b": m.out.bias},
        }
        stats = [self.state.get(bn.batch_state_index) for bn in m.norms]
        return params, {"hidden": [{"mean": mean, "var": var} for mean, var in stats]}


# --- Haiku ------------------------------------------------------------------


class HaikuTrainer(Trainer):
    def __init__(self, cfg: Config, params, states, x, y):
        hk = optional_import("haiku")
        optax = optional_import("optax")

        class HkBatchNorm(hk.Module):
            """BatchNorm with plain moving averages (hk.BatchNorm's are zero-debiased)."""

            def __init__(self, momentum, eps, name=None):
                super().__init__(name=name)
                self.momentum, self.eps = momentum, eps

            def __call__(self, x):
                n = x.shape[-1]
                scale = hk.get_parameter("scale", [n], init=jnp.ones)
                offset = hk.get_parameter("offset", [n], init=jnp.zeros)
                mean_ema = hk.get_state("mean", [n], init=jnp.zeros)
                var_ema = hk.get_state("var", [n], init=jnp.ones)
                m, v = x.mean(0), x.var(0)
                hk.set_state("mean", self.momentum * mean_ema + (1 - self.momentum) * m)
                hk.set_state("var", self.momentum * var_ema + (1 - self.momentum) * v)
                return (x - m) / jnp.sqrt(v + self.eps) * scale + offset

        def forward(x):
            for i in range(cfg.depth):
                x = hk.Linear(cfg.width, name=f"linear_{i}")(x)
                x = HkBatchNorm(cfg.momentum, cfg.eps, name=f"norm_{i}")(x)
                x = jax.nn.relu(x)
            return hk.Linear(cfg.classes, name="out")(x)

        model = hk.transform_with_state(forward)
        hk_params, hk_state = model.init(jax.random.PRNGKey(0), jnp.asarray(x))
        hk_params = dict(hk_params)
        for i, p in enumerate(params["hidden"]):
            hk_params[f"linear_{i}"] = {"w": jnp.asarray(p["w"]), "b": jnp.asarray(p["b"])}
        hk_params["out"] = {"w": jnp.asarray(params["out"]["w"]), "b": jnp.asarray(params["out"]["b"])}
        optim = optax.sgd(cfg.lr)

        @jax.jit
        def train_step(params, state, opt_state, x, y):
            def loss_fn(params, state):
                logits, state = model.apply(params, state, None, x)
                return cross_entropy(logits, y), state

            (loss, state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, state)
            updates, opt_state = optim.update(grads, opt_state)
            return optax.apply_updates(params, updates), state, opt_state, loss

        self._step = train_step
        self.params, self.state = hk_params, hk_state
        self.opt_state = optim.init(hk_params)
        self.x, self.y = jnp.asarray(x), jnp.asarray(y)
        self.depth = cfg.depth

    def step(self):
        self.params, self.state, self.opt_state, loss = self._step(
            self.params, self.state, self.opt_state, self.x, self.y
        )
        return loss

    def export(self):
        p, s = self.params, self.state
        params = {
            "hidden": [
                {
                    "w": p[f"linear_{i}"]["w"],
                    "b": p[f"linear_{i}"]["b"],
                    "scale": p[f"norm_{i}"]["scale"],
                    "bias": p[f"norm_{i}"]["offset"],
                }
                for i in range(self.depth)
            ],
            "out": dict(p["out"]),
        }
        states = {
            "hidden": [
                {"mean": s[f"norm_{i}"]["mean"], "var": s[f"norm_{i}"]["var"]}
                for i in range(self.depth)
            ]
        }
        return params, states


# --- penzai v1 --------------------------------------------------------------


class PenzaiTrainer(Trainer):
    def __init__(self, cfg: Config, params, states, x, y):
        optional_import("penzai")
        pz = optional_import("penzai.deprecated.v1.pz")

        @pz.pytree_dataclass
        class PzBatchNorm(pz.Layer):
            """Batch norm over the "batch" axis; running statistics are local states."""

            scale: pz.nn.ParameterLike
            offset: pz.nn.ParameterLike
            mean: pz.de.LocalStateEffect
            var: pz.de.LocalStateEffect
            momentum: float = dataclasses.field(metadata={"pytree_node": False})
            eps: float = dataclasses.field(metadata={"pytree_node": False})

            @classmethod
            def from_config(cls, name, n, momentum, eps):
                return cls(
                    scale=pz.nn.UninitializedParameter(
                        lambda _: pz.nx.ones({"features": n}), f"{name}.scale"
                    ),
                    offset=pz.nn.UninitializedParameter(
                        lambda _: pz.nx.zeros({"features": n}), f"{name}.offset"
                    ),
                    mean=pz.de.InitialLocalStateRequest(
                        lambda: pz.nx.zeros({"features": n}), category="batch_stats",
                        name=f"{name}.mean",
                    ),
                    var=pz.de.InitialLocalStateRequest(
                        lambda: pz.nx.ones({"features": n}), category="batch_stats",
                        name=f"{name}.var",
                    ),
                    momentum=momentum,
                    eps=eps,
                )

            def __call__(self, x):
                m = pz.nx.nmap(jnp.mean)(x.untag("batch"))
                v = pz.nx.nmap(jnp.var)(x.untag("batch"))
                self.mean.set(self.momentum * self.mean.get() + (1 - self.momentum) * m)
                self.var.set(self.momentum * self.var.get() + (1 - self.momentum) * v)
                normed = (x - m) / pz.nx.nmap(jnp.sqrt)(v + self.eps)
                return normed * self.scale.value + self.offset.value

        sizes = [cfg.in_features] + [cfg.width] * cfg.depth
        layers = []
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers += [
                pz.nn.add_parameter_prefix(
                    f"affine_{i}",
                    pz.nn.Affine.from_config(input_axes={"features": a},
                                             output_axes={"features": b}),
                ),
                PzBatchNorm.from_config(f"norm_{i}", b, cfg.momentum, cfg.eps),
                pz.nn.Elementwise(jax.nn.relu),
            ]
        layers.append(
            pz.nn.add_parameter_prefix(
                "out",
                pz.nn.Affine.from_config(input_axes={"features": cfg.width},
                                         output_axes={"features": cfg.classes}),
            )
        )
        model = pz.nn.initialize_parameters(pz.nn.Sequential(layers), jax.random.PRNGKey(0))
        values = {}
        for i, p in enumerate(params["hidden"]):
            values[f"affine_{i}.Linear.weights"] = pz.nx.wrap(jnp.asarray(p["w"])).tag(
                "features", "features_out")
            values[f"affine_{i}.AddBias.bias"] = pz.nx.wrap(jnp.asarray(p["b"])).tag("features")
        values["out.Linear.weights"] = pz.nx.wrap(jnp.asarray(params["out"]["w"])).tag(
            "features", "features_out")
        values["out.AddBias.bias"] = pz.nx.wrap(jnp.asarray(params["out"]["b"])).tag("features")
        model = (
            pz.select(model)
            .at_instances_of(pz.nn.Parameter)
            .apply(lambda p: dataclasses.replace(p, value=values.get(p.name, p.value)))
        )
        unknown = set(values) - {p.name for p in pz.select(model).at_instances_of(
            pz.nn.Parameter).get_sequence()}
        if unknown:
            raise RuntimeError(f"penzai parameter names changed: {sorted(unknown)}")
        self.handled, self.states = pz.de.handle_local_states(model, category="batch_stats")

        def train_step(handled, states, x, y):
            def loss_fn(handled, states):
                logits, states = handled((pz.nx.wrap(x).tag("batch", "features"), states))
                return cross_entropy(logits.unwrap("batch", "features"), y), states

            (loss, states), grads = jax.value_and_grad(loss_fn, has_aux=True)(handled, states)
            return sgd(handled, grads, cfg.lr), states, loss

        self._step = jax.jit(train_step)
        self.pz = pz
        self.x, self.y = jnp.asarray(x), jnp.asarray(y)
        self.depth = cfg.depth

    def step(self):
        self.handled, self.states, loss = self._step(self.handled, self.states, self.x, self.y)
        return loss

    def export(self):
        pz = self.pz
        values = {
            p.name: p.value
            for p in pz.select(self.handled).at_instances_of(pz.nn.Parameter).get_sequence()
        }

        def positional(name, *axes):
            return values[name].unwrap(*axes)

        params = {
            "hidden": [
                {
                    "w": positional(f"affine_{i}.Linear.weights", "features", "features_out"),
                    "b": positional(f"affine_{i}.AddBias.bias", "features"),
                    "scale": positional(f"norm_{i}.scale", "features"),
                    "bias": positional(f"norm_{i}.offset", "features"),
                }
                for i in range(self.depth)
            ],
            "out": {
                "w": positional("out.Linear.weights", "features", "features_out"),
                "b": positional("out.AddBias.bias", "features"),
            },
        }
        states = {
            "hidden": [
                {
                    "mean": self.states[f"norm_{i}.mean"].unwrap("features"),
                    "var": self.states[f"norm_{i}.var"].unwrap("features"),
                }
                for i in range(self.depth)
            ]
        }
        return params, states


# --- the scenario -----------------------------------------------------------

IMPLEMENTATIONS: dict[str, Callable[..., Trainer]] = {
    "hand-written JAX (dicts)": HandwrittenTrainer,
    "autostate": AutostateTrainer,
    "Flax NNX (nnx.jit)": NNXJitTrainer,
    "Flax NNX (split/merge + jax.jit)": NNXSplitMergeTrainer,
    "Equinox (make_with_state, filter_jit)": EquinoxTrainer,
    "Haiku (transform_with_state)": HaikuTrainer,
    "penzai v1 (local-state effect)": PenzaiTrainer,
}
REFERENCE = "hand-written JAX (dicts)"


def check_same_numbers(name: str, losses: list[float], trainer: Trainer, expected: tuple) -> None:
    """Compares the losses of the first steps, then parameters and statistics, with the reference."""
    params, states = trainer.export()
    exp_losses, exp_params, exp_states = expected
    tol = {"rtol": 2e-4, "atol": 2e-5}
    np.testing.assert_allclose(losses, exp_losses, **tol, err_msg=f"{name}: loss")
    for what, got, want in (("params", params, exp_params), ("states", states, exp_states)):
        got_leaves = jax.tree_util.tree_leaves_with_path(got)
        want_leaves = jax.tree_util.tree_leaves_with_path(want)
        assert [p for p, _ in got_leaves] == [p for p, _ in want_leaves], f"{name}: {what} layout"
        for (path, g), (_, w) in zip(got_leaves, want_leaves):
            np.testing.assert_allclose(
                np.asarray(g), np.asarray(w), **tol,
                err_msg=f"{name}: {what}{jax.tree_util.keystr(path)}",
            )


def run(smoke: bool = False) -> Report:
    cfg = SMOKE if smoke else FULL
    params, states, x, y = canonical_init(cfg)
    reference = HandwrittenTrainer(cfg, params, states, x, y)
    expected_losses = [float(reference.step()) for _ in range(2)]
    expected = (expected_losses, *jax.tree.map(np.asarray, reference.export()))

    trainers: dict[str, Trainer] = {}
    first_call: dict[str, float] = {}
    missing: dict[str, str] = {}
    for name, make in IMPLEMENTATIONS.items():
        try:
            trainer = make(cfg, params, states, x, y)
        except PeerMissing as e:
            missing[name] = str(e)
            continue
        losses: list[float] = []
        # The checked trainer's first step is also its first-call measurement.
        times = [time_once(lambda t=trainer, out=losses: out.append(float(t.step())))]
        losses.append(float(trainer.step()))
        check_same_numbers(name, losses, trainer, expected)
        for _ in range(cfg.first_call_repeats - 1):
            fresh = make(cfg, params, states, x, y)
            times.append(time_once(lambda t=fresh: jax.block_until_ready(t.step())))
        first_call[name] = statistics.median(times)
        trainers[name] = trainer

    def runner(trainer: Trainer) -> Callable[[], None]:
        return lambda: jax.block_until_ready(trainer.step())

    timings = time_interleaved(
        {name: runner(t) for name, t in trainers.items()}, rounds=cfg.rounds, number=cfg.number
    )
    base = timings[REFERENCE]
    base_first = first_call[REFERENCE]
    table = Table(
        f"Scenario 1: BatchNorm-MLP training step ({cfg.depth}x{cfg.width}, batch {cfg.batch}, "
        f"{jax.default_backend()})",
        ("implementation", "per step", "± IQR", "vs hand-written", "first call", "vs hand-written",
         "same numbers"),
    )
    for name in IMPLEMENTATIONS:
        if name in missing:
            table.add(name, NOT_INSTALLED, "-", "-", "-", "-", "-")
            continue
        t = timings[name]
        table.add(name, fmt_seconds(t.median), fmt_seconds(t.iqr), fmt_ratio(paired_ratio(t, base)),
                  fmt_seconds(first_call[name]), fmt_ratio(first_call[name] / base_first), "yes")
    table.notes.append(
        f"median of {cfg.rounds} interleaved rounds of {cfg.number} steps, each step blocked on; "
        "vs hand-written: median of the per-round ratios; first call = trace + compile + one step, median of "
        f"{cfg.first_call_repeats} fresh jits"
    )
    table.notes.append(
        "numbers checked over 2 steps against hand-written JAX: losses, parameters, running "
        "mean/var (rtol 2e-4); Haiku and penzai use their own BatchNorm (see bench_mlp.py)"
    )
    table.notes.append(
        "SGD: jax.tree.map(p - lr * g) for hand-written JAX, autostate and penzai; optax.sgd "
        "(as their docs do) for NNX, Equinox and Haiku"
    )
    for name, why in missing.items():
        table.notes.append(f"{name}: {NOT_INSTALLED} ({why})")

    report = Report(tables=[table])
    report.targets.append(
        target_below("1", "per step within 1.05x of hand-written JAX",
                     paired_ratio(timings["autostate"], base), 1.05,
                     f"ratio of medians {timings['autostate'].median / base.median:.3f}")
    )
    zo_table, zo_target = zero_overhead_table(
        "Scenario 4a: jaxpr primitives of the MLP training step",
        "MLP step",
        reference.jaxpr(), trainers["autostate"].jaxpr(),
    )
    report.tables.append(zo_table)
    report.targets.append(zo_target)
    return report


def main(argv: list[str] | None = None) -> None:
    script_main(run, __doc__, argv)


if __name__ == "__main__":
    main()
