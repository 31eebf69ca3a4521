"""Scenario 9: stacked sub-models inside methods: an ensemble and a scanned decoder.

A sub-model built by ``jax.vmap(Layer)(keys)`` handed to ``jax.vmap`` or to
``lax.scan`` inside a method is a list of members, each reading and writing
its own slice of the stacked states. Two models, each against the same step
with the states threaded by hand (stacked states as ``vmap`` in/out axes, or
as scan ``xs``/``ys``):

* **ensemble**: ``MEMBERS`` MLPs with batch norm (running mean and variance
  written by each member), ``jax.vmap`` over the members in ``__call__``; a
  jitted SGD training step (``value_and_grad`` of ``f``).
* **scanned decoder**: ``LAYERS`` layers, each with a KV cache written at the
  decoded position; a jitted decode of ``TOKENS`` tokens, a ``fori_loop`` over
  positions around a ``lax.scan`` over the stacked layers.

Both are checked against the hand-threaded step (outputs and every state over
two calls) before they are timed, and their traced programs are compared
primitive by primitive. The decoder's trace + compile time is also measured
at 12 and 96 layers against the same model written as a Python loop over a
list of layers (one unrolled program).

Run: ``python benchmarks/bench_stacked.py [--smoke]``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from _jaxpr import primitive_counts
from _timing import (
    Report,
    Table,
    Target,
    assert_close,
    checked_precision,
    fmt_ratio,
    fmt_seconds,
    paired_ratio,
    script_main,
    target_below,
    time_interleaved,
)

import autostate

REFERENCE = "hand-threaded JAX"


@dataclasses.dataclass(frozen=True)
class Config:
    members: int = 8
    d_in: int = 32
    hidden: int = 64
    batch: int = 64
    layers: int = 12
    dim: int = 64
    tokens: int = 16
    compile_depths: tuple[int, ...] = (12, 96)
    rounds: int = 30
    number: int = 10


FULL = Config()
SMOKE = Config(members=2, d_in=3, hidden=4, batch=2, layers=2, dim=4, tokens=2,
               compile_depths=(2,), rounds=1, number=1)


# --- the ensemble ---------------------------------------------------------------------


@autostate.stateful
class BatchNormMLP:
    def __init__(self, key: Any, d_in: int, hidden: int):
        k1, k2 = jax.random.split(key)
        self.w1 = jax.random.normal(k1, (d_in, hidden)) / math.sqrt(d_in)
        self.w2 = jax.random.normal(k2, (hidden,)) / math.sqrt(hidden)
        self.mean = jnp.zeros(hidden)
        self.var = jnp.ones(hidden)

    def __call__(self, x: Any) -> Any:
        h = x @ self.w1
        m, v = h.mean(0), h.var(0)
        self.mean = 0.9 * self.mean + 0.1 * m
        self.var = 0.9 * self.var + 0.1 * v
        return jax.nn.relu((h - m) / jnp.sqrt(v + 1e-5)) @ self.w2


@autostate.stateful
class Ensemble:
    def __init__(self, key: Any, cfg: Config):
        keys = jax.random.split(key, cfg.members)
        self.members = jax.vmap(lambda k: BatchNormMLP(k, cfg.d_in, cfg.hidden))(keys)

    def __call__(self, x: Any) -> Any:
        return jax.vmap(lambda m: m(x))(self.members)


def _training(
    loss: Callable, params: Any, states: Any, data: tuple, read: Callable[[Any], tuple]
) -> tuple[Callable[[], Any], Callable, tuple]:
    """A jitted SGD step on ``loss(params, states, x, y) -> (value, states)``:
    a runner returning the loss and ``read(states)``, the step, its arguments."""

    def step(p: Any, s: Any, x: Any, y: Any) -> Any:
        (value, s), g = jax.value_and_grad(loss, has_aux=True)(p, s, x, y)
        return jax.tree.map(lambda p, g: p - 0.01 * g, p, g), s, value

    jitted = jax.jit(step)
    box = [params, states]

    def run() -> Any:
        box[0], box[1], value = jitted(box[0], box[1], *data)
        return (value, *read(box[1]))

    return run, step, (params, states, *data)


def ensemble_autostate(cfg: Config, data: tuple) -> tuple[Callable[[], Any], Callable, tuple]:
    f, states = autostate.functionalize(Ensemble(jax.random.key(0), cfg))

    def loss(f: Any, s: Any, x: Any, y: Any) -> Any:
        out, s = f(s, x)
        return jnp.mean((out - y) ** 2), s

    return _training(loss, f, states, data, lambda s: (s["members.mean"], s["members.var"]))


def ensemble_by_hand(cfg: Config, data: tuple) -> tuple[Callable[[], Any], Callable, tuple]:
    model = Ensemble(jax.random.key(0), cfg)  # the same initial values
    params = {"w1": model.members.w1, "w2": model.members.w2}
    stats = {"mean": model.members.mean, "var": model.members.var}

    def member(p: Any, s: Any, x: Any) -> Any:
        h = x @ p["w1"]
        m, v = h.mean(0), h.var(0)
        s = {"mean": 0.9 * s["mean"] + 0.1 * m, "var": 0.9 * s["var"] + 0.1 * v}
        return jax.nn.relu((h - m) / jnp.sqrt(v + 1e-5)) @ p["w2"], s

    def loss(p: Any, s: Any, x: Any, y: Any) -> Any:
        out, s = jax.vmap(member, in_axes=(0, 0, None))(p, s, x)
        return jnp.mean((out - y) ** 2), s

    return _training(loss, params, stats, data, lambda s: (s["mean"], s["var"]))


# --- the scanned decoder ----------------------------------------------------------------


@autostate.stateful
class DecoderLayer:
    def __init__(self, key: Any, dim: int, tokens: int):
        k1, k2 = jax.random.split(key)
        self.wqkv = jax.random.normal(k1, (dim, 3 * dim)) / math.sqrt(dim)
        self.wo = jax.random.normal(k2, (dim, dim)) / math.sqrt(dim)
        self.k_cache = jnp.zeros((tokens, dim))
        self.v_cache = jnp.zeros((tokens, dim))

    def __call__(self, h: Any, pos: Any) -> Any:
        q, k, v = jnp.split(h @ self.wqkv, 3)
        self.k_cache = self.k_cache.at[pos].set(k)
        self.v_cache = self.v_cache.at[pos].set(v)
        seen = jnp.arange(self.k_cache.shape[0]) <= pos
        scores = jnp.where(seen, self.k_cache @ q / math.sqrt(q.shape[0]), -1e9)
        return h + jnp.tanh(jax.nn.softmax(scores) @ self.v_cache @ self.wo)


@autostate.stateful
class ScannedDecoder:
    def __init__(self, key: Any, layers: int, dim: int, tokens: int):
        keys = jax.random.split(key, layers)
        self.layers = jax.vmap(lambda k: DecoderLayer(k, dim, tokens))(keys)
        self.tokens = tokens

    def step(self, h: Any, pos: Any) -> Any:
        return jax.lax.scan(lambda h, layer: (layer(h, pos), None), h, self.layers)[0]

    def __call__(self, h: Any) -> Any:
        return jax.lax.fori_loop(0, self.tokens, lambda pos, h: self.step(h, pos), h)


@autostate.stateful
class ListDecoder:
    """The same decoder as a Python loop over a list of layers (unrolled when traced)."""

    def __init__(self, key: Any, layers: int, dim: int, tokens: int):
        self.layers = [DecoderLayer(k, dim, tokens) for k in jax.random.split(key, layers)]
        self.tokens = tokens

    def step(self, h: Any, pos: Any) -> Any:
        for layer in self.layers:
            h = layer(h, pos)
        return h

    def __call__(self, h: Any) -> Any:
        return jax.lax.fori_loop(0, self.tokens, lambda pos, h: self.step(h, pos), h)


def decoder_autostate(cfg: Config, h: Any) -> tuple[Callable[[], Any], Callable, tuple]:
    f, states = autostate.functionalize(ScannedDecoder(jax.random.key(1), cfg.layers, cfg.dim, cfg.tokens))
    jitted = jax.jit(lambda f, s, h: f(s, h))
    box = [states]

    def run() -> Any:
        out, box[0] = jitted(f, box[0], h)
        return out, box[0]["layers.k_cache"], box[0]["layers.v_cache"]

    return run, (lambda f, s, h: f(s, h)), (f, states, h)


def decoder_by_hand(cfg: Config, h: Any) -> tuple[Callable[[], Any], Callable, tuple]:
    model = ScannedDecoder(jax.random.key(1), cfg.layers, cfg.dim, cfg.tokens)
    weights = {"wqkv": model.layers.wqkv, "wo": model.layers.wo}
    caches = {"k": model.layers.k_cache, "v": model.layers.v_cache}

    def layer(h: Any, w: Any, c: Any, pos: Any) -> Any:
        q, k, v = jnp.split(h @ w["wqkv"], 3)
        c = {"k": c["k"].at[pos].set(k), "v": c["v"].at[pos].set(v)}
        seen = jnp.arange(c["k"].shape[0]) <= pos
        scores = jnp.where(seen, c["k"] @ q / math.sqrt(q.shape[0]), -1e9)
        return h + jnp.tanh(jax.nn.softmax(scores) @ c["v"] @ w["wo"]), c

    def decode(weights: Any, caches: Any, h: Any) -> Any:
        def token(pos: Any, carry: Any) -> Any:
            h, caches = carry
            return jax.lax.scan(lambda h, wc: layer(h, *wc, pos), h, (weights, caches))

        return jax.lax.fori_loop(0, cfg.tokens, token, (h, caches))

    jitted = jax.jit(decode)
    box = [caches]

    def run() -> Any:
        out, box[0] = jitted(weights, box[0], h)
        return out, box[0]["k"], box[0]["v"]

    return run, decode, (weights, caches, h)


def _compile_seconds(model: Any, h: Any) -> float:
    f, states = autostate.functionalize(model)
    start = time.perf_counter()
    jax.jit(lambda f, s, h: f(s, h)).lower(f, states, h).compile()
    return time.perf_counter() - start


# --- the report ---------------------------------------------------------------------------


def _check(name: str, got: Callable[[], Any], want: Callable[[], Any]) -> None:
    for _ in range(2):
        for g, w in zip(got(), want()):
            assert_close(g, w, rtol=2e-4, atol=2e-5, err_msg=name)


def run(smoke: bool = False) -> Report:
    cfg = SMOKE if smoke else FULL
    checked_precision()
    rng = np.random.default_rng(0)
    data = (jnp.asarray(rng.normal(size=(cfg.batch, cfg.d_in)), jnp.float32),
            jnp.asarray(rng.normal(size=(cfg.batch,)), jnp.float32))
    h = jnp.asarray(rng.normal(size=(cfg.dim,)), jnp.float32)
    cases = {
        "ensemble": (ensemble_autostate, ensemble_by_hand, data,
                     f"{cfg.members} members with batch norm, a jitted SGD step"),
        "scanned decoder": (decoder_autostate, decoder_by_hand, h,
                            f"{cfg.layers} layers with a KV cache, {cfg.tokens}-token decode"),
    }
    report = Report()
    table = Table(
        f"Scenario 9: stacked sub-models inside methods ({jax.default_backend()})",
        ("model", "autostate per step", "hand-threaded per step", "ratio", "primitives"),
    )
    for name, (mine, by_hand, arg, what) in cases.items():
        _check(name, mine(cfg, arg)[0], by_hand(cfg, arg)[0])
        my_run, my_step, my_args = mine(cfg, arg)
        ref_run, ref_step, ref_args = by_hand(cfg, arg)
        timings = time_interleaved(
            {"autostate": lambda run=my_run: jax.block_until_ready(run()),
             REFERENCE: lambda run=ref_run: jax.block_until_ready(run())},
            rounds=cfg.rounds, number=cfg.number,
        )
        ratio = paired_ratio(timings["autostate"], timings[REFERENCE])
        mine_counts = primitive_counts(jax.make_jaxpr(my_step)(*my_args))
        ref_counts = primitive_counts(jax.make_jaxpr(ref_step)(*ref_args))
        equal = mine_counts == ref_counts
        shown = (f"{sum(mine_counts.values())} = {sum(ref_counts.values())}" if equal
                 else f"{sum(mine_counts.values())} vs {sum(ref_counts.values())}")
        table.add(f"{name}: {what}", fmt_seconds(timings["autostate"].median),
                  fmt_seconds(timings[REFERENCE].median), fmt_ratio(ratio), shown)
        report.targets.append(target_below("9", f"{name}: per step within 1.05x of hand-threaded",
                                           ratio, 1.05))
        detail = "" if equal else f"differ: {set(mine_counts.items()) ^ set(ref_counts.items())}"
        report.targets.append(Target("9", f"{name}: traced program equals hand-threaded "
                                     "(primitive counts)", None, equal, detail))
    table.notes.append(
        f"median of {cfg.rounds} interleaved rounds of {cfg.number} jitted calls, blocked on; "
        "outputs and states checked against hand-threaded JAX over 2 calls first"
    )
    compile_table = Table(
        "Scenario 9: trace + compile of the decode step, stacked layers scanned vs a Python "
        "loop over a list of layers",
        ("layers", "scanned (autostate)", "Python loop over a list", "ratio"),
    )
    _compile_seconds(ListDecoder(jax.random.key(1), 1, cfg.dim, cfg.tokens), h)  # (warm-up)
    for depth in cfg.compile_depths:
        scanned = _compile_seconds(ScannedDecoder(jax.random.key(1), depth, cfg.dim, cfg.tokens), h)
        looped = _compile_seconds(ListDecoder(jax.random.key(1), depth, cfg.dim, cfg.tokens), h)
        compile_table.add(str(depth), fmt_seconds(scanned), fmt_seconds(looped),
                          fmt_ratio(scanned / looped))
        report.targets.append(target_below(
            "9", f"decoder trace + compile at {depth} layers below the Python loop's",
            scanned / looped, 1.0))
    compile_table.notes.append("one lower + compile each, after a warm-up of JAX itself")
    report.tables.extend([table, compile_table])
    return report


def main(argv: list[str] | None = None) -> None:
    script_main(run, __doc__, argv)


if __name__ == "__main__":
    main()
