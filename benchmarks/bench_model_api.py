"""Scenario 10: the model object as the API, the per-call cost of ``autostate.jit``.

A model of ``N`` tiny modules (a 4x4 weight and a call counter each) and two
jitted steps that call it:

* **10a, forward**: the forward pass updates every counter;
* **10b, training**: a loss, the gradient of the weights, an AdamW update of
  them (two moments per weight and a step count, carried from call to call),
  and the counters updated by the forward pass.

Per call, against hand-written ``jax.jit`` of a function of dicts (parameters
and states in; new states, and for training new parameters, out; the
training step's inputs, the optimizer state among them, donated; AdamW as
``optax.adamw`` computes it, written by hand on the pytree):

* ``autostate.jit(step)(model, ...)``: the model updated in place (flattened,
  called, written back, old arrays donated); the training step with
  ``autostate.value_and_grad`` and ``autostate.Optimizer`` (``optax.adamw``);
* ``jax.jit`` of ``f(states, ...)``: the explicit layer beneath;
* ``jax.jit`` of ``pf(pstates, ...)``: ``autostate.pack``'s buffers;
* the floor: hand-written ``jax.jit`` of the same step over one flat float32
  buffer of the weights and counters (for training, and AdamW's moments and
  step), in and out, donated, split inside with ``jnp.split`` (for
  training, inside the differentiated function), computed module by module
  as the other paths compute it, and concatenated back;
* where installed, the same model and step written as their users write
  them in Flax NNX (``nnx.jit``; tree mode ``nnx.jit(graph=False)`` and
  ``nnx.jit_partial(graph=False)`` where the installed flax has them;
  ``nnx.Optimizer``) and in Equinox (``eqx.filter_jit`` of a step returning
  the new model; ``optax.adamw``).

Every path's output is checked equal to the reference's before it is timed.
Each module multiplies by its weight matrix rather than elementwise: XLA:CPU
fuses a chain of elementwise modules whole, and the compile of its gradient
grows faster than the square of the depth (10 s at 100 modules, 70 s at 200);
a ``dot`` ends each fusion, and the compile grows linearly.
The issue's goals for ``autostate.jit`` are 0.5x hand-written at 100 and 1,000
modules in both tables, and within 1.3x of the floor at the smallest size.

**10c** is the peak memory of a donated decode step: one attention layer whose
key/value cache is a state, compiled by ``autostate.jit`` (its
``Compiled.lower``) and by hand-written ``jax.jit`` with the cache donated,
from ``compiled.memory_analysis()``: peak
= arguments + outputs + temporaries - aliased bytes, as a multiple of the
cache's size (goal: about 1x).

Run: ``python benchmarks/bench_model_api.py [--smoke]``. Where one command may
run only so long (an accelerator lent for minutes), ``AUTOSTATE_BENCH_MODEL_API``
overrides the full run's sizes, rounds and calls per round, e.g.
``AUTOSTATE_BENCH_MODEL_API="sizes=100,1000 rounds=3 number=10"``; the tables'
notes say what was used. Each path's row is printed to stderr as it is measured,
with the seconds since the scenario started.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import inspect
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from _timing import (
    NOT_INSTALLED,
    PeerMissing,
    Report,
    Table,
    Target,
    assert_close,
    checked_precision,
    fmt_ratio,
    fmt_seconds,
    optional_import,
    paired_ratio,
    script_main,
    target_below,
    time_interleaved,
)

import autostate

REFERENCE = "hand-written jax.jit"
AUTOSTATE = "autostate.jit (in place)"
FLOOR = "floor: one flat donated buffer"
LR = 0.1


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    batch: int = 4
    max_len: int = 1024
    heads: int = 4
    head_dim: int = 32

    @property
    def d(self) -> int:
        return self.heads * self.head_dim


@dataclasses.dataclass(frozen=True)
class Config:
    sizes: tuple[int, ...] = (100, 1000)
    rounds: int = 7
    number: int = 30
    decode: DecodeConfig = DecodeConfig()


FULL = Config()
OVERRIDE = "AUTOSTATE_BENCH_MODEL_API"
SMOKE = Config(sizes=(10,), rounds=2, number=3,
               decode=DecodeConfig(batch=1, max_len=1024, heads=2, head_dim=16))


@autostate.stateful
class Tiny:
    def __init__(self, key: Any):
        self.w = jax.random.normal(key, (4, 4)) / 2
        self.count = jnp.zeros(())

    def __call__(self, x: Any) -> Any:
        self.count = self.count + 1.0
        return jnp.tanh(x @ self.w)


@autostate.stateful
class Stack:
    def __init__(self, n: int):
        self.layers = [Tiny(k) for k in jax.random.split(jax.random.key(0), n)]

    def __call__(self, x: Any) -> Any:
        for layer in self.layers:
            x = layer(x)
        return x


def _inputs() -> tuple[Any, Any]:
    return jnp.ones(4), jnp.full(4, 0.5)


def _weights(n: int) -> list[Any]:
    """The weights every path starts from (``Stack(n)``'s: one key)."""
    return [layer.w for layer in Stack(n).layers]


def _dicts(n: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A fresh ``Stack(n)``'s parameters and states as the hand-written step takes them."""
    layers = Stack(n).layers
    params = {f"layers[{i}].w": layer.w for i, layer in enumerate(layers)}
    return params, {f"layers[{i}].count": layer.count for i, layer in enumerate(layers)}


def _hand_forward(n: int, params: dict, states: dict, x: Any) -> tuple[Any, dict]:
    new = {}
    for i in range(n):
        new[f"layers[{i}].count"] = states[f"layers[{i}].count"] + 1.0
        x = jnp.tanh(x @ params[f"layers[{i}].w"])
    return x, new


def _flat(n: int) -> Any:
    """A fresh ``Stack(n)``'s weights, then its counters, as one flat buffer."""
    return jnp.concatenate([w.ravel() for w in _weights(n)] + [jnp.zeros(n)])


def _floor_forward(n: int, weights: Any, counts: Any, x: Any) -> tuple[Any, Any]:
    """The hand-written forward on the flat buffer's parts, module by module
    as the model computes it: the output, the new counters."""
    new = []
    for w, count in zip(jnp.split(weights, n), jnp.split(counts, n), strict=True):
        new.append(count + 1.0)
        x = jnp.tanh(x @ w.reshape(4, 4))
    return x, jnp.concatenate(new)


def _sq_error(out: Any, y: Any) -> Any:
    return jnp.sum((out - y) ** 2)


# AdamW's constants (optax's defaults but the learning rate), for every path.
B1, B2, EPS, WD = 0.9, 0.999, 1e-8, 1e-4


def _optax_adamw(optax: Any) -> Any:
    return optax.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD)


def _adamw_init(params: Any) -> tuple[Any, Any, Any]:
    """AdamW's state ``(step, mu, nu)``: two moments of their own (both are donated)."""
    mu, nu = (jax.tree_util.tree_map(jnp.zeros_like, params) for _ in range(2))
    return jnp.zeros((), jnp.int32), mu, nu


def _adamw(params: Any, grads: Any, state: tuple[Any, Any, Any]) -> tuple[Any, Any]:
    """AdamW written by hand (``optax.adamw``'s arithmetic) on any pytree:
    the new parameters and state ``(step, mu, nu)``."""
    step, mu, nu = state
    step = step + 1
    tree_map = jax.tree_util.tree_map
    mu = tree_map(lambda m, g: B1 * m + (1 - B1) * g, mu, grads)
    nu = tree_map(lambda v, g: B2 * v + (1 - B2) * g * g, nu, grads)

    def new(p: Any, m: Any, v: Any) -> Any:
        m_hat, v_hat = m / (1 - B1**step), v / (1 - B2**step)
        return p - LR * (m_hat / (jnp.sqrt(v_hat) + EPS) + WD * p)

    return tree_map(new, params, mu, nu), (step, mu, nu)


# --- 10a: the forward step ---------------------------------------------------


def _forward_cases(n: int) -> dict[str, Callable[[], Any]]:
    x, _ = _inputs()
    model = Stack(n)
    step = autostate.jit(lambda m, x: m(x).sum())

    params, states = _dicts(n)  # (the model's own arrays are donated by its calls)
    hand_states = [states]

    @jax.jit
    def by_hand(params: dict, states: dict, x: Any) -> Any:
        out, new = _hand_forward(n, params, states, x)
        return out.sum(), new

    def hand() -> Any:
        out, hand_states[0] = by_hand(params, hand_states[0], x)
        return out

    f, states = Stack(n).functionalize()
    f_states = [states]
    jitted = jax.jit(lambda f, s, x: (lambda o: (o[0].sum(), o[1]))(f(s, x)))

    def through_f() -> Any:
        out, f_states[0] = jitted(f, f_states[0], x)
        return out

    pf, pstates = autostate.pack(*Stack(n).functionalize())
    p_states = [pstates]

    def packed() -> Any:
        out, p_states[0] = jitted(pf, p_states[0], x)
        return out

    @functools.partial(jax.jit, donate_argnums=0)
    def floor_step(flat: Any, x: Any) -> tuple[Any, Any]:
        weights, counts = jnp.split(flat, [16 * n])
        out, counts = _floor_forward(n, weights, counts, x)
        return out.sum(), jnp.concatenate([weights, counts])

    flat = [_flat(n)]

    def floor() -> Any:
        out, flat[0] = floor_step(flat[0], x)
        return out

    return {
        AUTOSTATE: lambda: step(model, x),
        REFERENCE: hand,
        "jax.jit of f": through_f,
        "jax.jit of pack": packed,
        FLOOR: floor,
    }


# --- 10b: the training step --------------------------------------------------


def _training_cases(n: int) -> dict[str, Callable[[], Any]]:
    x, y = _inputs()
    cases: dict[str, Callable[[], Any]] = {}

    def loss_fn(model: Stack, x: Any, y: Any) -> Any:
        return _sq_error(model(x), y)

    try:
        optax = optional_import("optax")
    except PeerMissing:
        optax = None  # (the autostate.Optimizer row needs it: left out, noted)
    if optax is not None:
        model = Stack(n)
        opt = autostate.Optimizer(model, _optax_adamw(optax))

        @autostate.jit
        def train_step(model: Stack, opt: autostate.Optimizer, x: Any, y: Any) -> Any:
            loss, grads = autostate.value_and_grad(loss_fn)(model, x, y)
            opt.update(grads)
            return loss

        cases[AUTOSTATE] = lambda: train_step(model, opt, x, y)

    @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
    def by_hand(params: dict, states: dict, opt_state: Any, x: Any, y: Any) -> Any:
        def loss(params: dict) -> Any:
            out, new = _hand_forward(n, params, states, x)
            return _sq_error(out, y), new

        (value, new), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return value, *_adamw(params, grads, opt_state), new

    params, states = _dicts(n)
    hand_io = [params, states, _adamw_init(params)]

    def hand() -> Any:
        loss, hand_io[0], hand_io[2], hand_io[1] = by_hand(*hand_io, x, y)
        return loss

    cases[REFERENCE] = hand

    # The f path (and pack's buffers): f is the pytree of the trainable
    # parameters, so jax.value_and_grad and the AdamW step take it as it is.
    @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
    def train_f(f: Any, states: Any, opt_state: Any, x: Any, y: Any) -> Any:
        def loss(f: Any) -> Any:
            out, new = f(states, x)
            return _sq_error(out, y), new

        (value, new), grads = jax.value_and_grad(loss, has_aux=True)(f)
        return value, *_adamw(f, grads, opt_state), new

    f, states = Stack(n).functionalize()
    f_io = [f, states, _adamw_init(f)]
    pf, pstates = autostate.pack(*Stack(n).functionalize())
    p_io = [pf, pstates, _adamw_init(pf)]

    def through_f() -> Any:
        loss, f_io[0], f_io[2], f_io[1] = train_f(*f_io, x, y)
        return loss

    def packed() -> Any:
        loss, p_io[0], p_io[2], p_io[1] = train_f(*p_io, x, y)
        return loss

    # The floor's one buffer: the weights, the counters, AdamW's two moments
    # of the weights and its step count (a float).
    @functools.partial(jax.jit, donate_argnums=0)
    def floor_step(flat: Any, x: Any, y: Any) -> tuple[Any, Any]:
        weights, counts, mu, nu, step = jnp.split(flat, [16 * n, 17 * n, 33 * n, 49 * n])

        def loss(weights: Any) -> Any:
            out, new = _floor_forward(n, weights, counts, x)
            return _sq_error(out, y), new

        (value, counts), grads = jax.value_and_grad(loss, has_aux=True)(weights)
        # (AdamW module by module, as on the model's tree of weights.)
        parts = [jnp.split(a, n) for a in (weights, grads, mu, nu)]
        new, (step, mu, nu) = _adamw(parts[0], parts[1], (step, parts[2], parts[3]))
        return value, jnp.concatenate([*new, counts, *mu, *nu, step])

    flat = [jnp.concatenate([_flat(n), jnp.zeros(32 * n + 1)])]

    def floor() -> Any:
        loss, flat[0] = floor_step(flat[0], x, y)
        return loss

    cases["jax.jit of f"] = through_f
    cases["jax.jit of pack"] = packed
    cases[FLOOR] = floor
    return cases


# --- the peers ---------------------------------------------------------------


def _nnx(mode: str) -> Any:
    """``flax.nnx``, or ``PeerMissing`` when flax (or the mode) is not there."""
    nnx = optional_import("flax.nnx")
    version = optional_import("flax").__version__
    if mode != "graph" and "graph" not in inspect.signature(nnx.jit).parameters:
        raise PeerMissing(f"flax {version} has no nnx.jit(graph=False)")
    if mode == "partial" and not hasattr(nnx, "jit_partial"):
        raise PeerMissing(f"flax {version} has no nnx.jit_partial")
    return nnx


def _nnx_model(nnx: Any, weights: list[Any]) -> Any:
    class NNXTiny(nnx.Module):
        def __init__(self, w: Any):
            self.w = nnx.Param(jnp.asarray(w))
            self.count = nnx.BatchStat(jnp.zeros(()))

        def __call__(self, x: Any) -> Any:
            self.count[...] += 1.0
            return jnp.tanh(x @ self.w[...])

    class NNXStack(nnx.Module):
        def __init__(self, weights: list[Any]):
            self.layers = nnx.List([NNXTiny(w) for w in weights])

        def __call__(self, x: Any) -> Any:
            for layer in self.layers:
                x = layer(x)
            return x

    return NNXStack(weights)


def _nnx_jit(nnx: Any, mode: str, step: Callable[..., Any], *bound: Any) -> Callable[..., Any]:
    """``step`` compiled in ``mode``, called with the arguments after ``bound``."""
    if mode == "graph":
        jitted = nnx.jit(step)
    elif mode == "tree":
        jitted = nnx.jit(step, graph=False)
    else:
        return nnx.jit_partial(step, *bound, graph=False)
    return functools.partial(jitted, *bound)


def _nnx_forward(mode: str) -> Callable[[int], Callable[[], Any]]:
    def make(n: int) -> Callable[[], Any]:
        nnx = _nnx(mode)
        x, _ = _inputs()
        step = _nnx_jit(nnx, mode, lambda model, x: model(x).sum(), _nnx_model(nnx, _weights(n)))
        return lambda: step(x)

    return make


def _nnx_training(mode: str) -> Callable[[int], Callable[[], Any]]:
    def make(n: int) -> Callable[[], Any]:
        nnx = _nnx(mode)
        optax = optional_import("optax")
        x, y = _inputs()
        model = _nnx_model(nnx, _weights(n))
        optimizer = nnx.Optimizer(model, _optax_adamw(optax), wrt=nnx.Param)

        def train_step(model: Any, optimizer: Any, x: Any, y: Any) -> Any:
            loss, grads = nnx.value_and_grad(lambda model: _sq_error(model(x), y))(model)
            optimizer.update(model, grads)
            return loss

        step = _nnx_jit(nnx, mode, train_step, model, optimizer)
        return lambda: step(x, y)

    return make


def _eqx_model(eqx: Any, weights: list[Any]) -> Any:
    """An Equinox model whose call returns the output and the new model."""

    class EqxTiny(eqx.Module):
        w: Any
        count: Any

        def __call__(self, x: Any) -> tuple[Any, Any]:
            new = eqx.tree_at(lambda m: m.count, self, self.count + 1.0)
            return jnp.tanh(x @ self.w), new

    class EqxStack(eqx.Module):
        layers: list

        def __call__(self, x: Any) -> tuple[Any, Any]:
            layers = []
            for layer in self.layers:
                x, layer = layer(x)
                layers.append(layer)
            return x, eqx.tree_at(lambda m: m.layers, self, layers)

    return EqxStack([EqxTiny(jnp.asarray(w), jnp.zeros(())) for w in weights])


def _eqx_forward(n: int) -> Callable[[], Any]:
    eqx = optional_import("equinox")
    x, _ = _inputs()
    model = [_eqx_model(eqx, _weights(n))]

    @eqx.filter_jit
    def step(model: Any, x: Any) -> tuple[Any, Any]:
        out, model = model(x)
        return out.sum(), model

    def call() -> Any:
        out, model[0] = step(model[0], x)
        return out

    return call


def _eqx_training(n: int) -> Callable[[], Any]:
    eqx = optional_import("equinox")
    optax = optional_import("optax")
    x, y = _inputs()
    optim = _optax_adamw(optax)

    def trainable(model: Any) -> Any:
        """The filter spec of the weights (the counters are not trained)."""
        spec = jax.tree_util.tree_map(lambda _: False, model)
        return eqx.tree_at(lambda m: [layer.w for layer in m.layers], spec,
                           replace=[True] * len(model.layers))

    @eqx.filter_jit
    def step(model: Any, opt_state: Any, x: Any, y: Any) -> tuple[Any, Any, Any]:
        params, rest = eqx.partition(model, trainable(model))

        def loss_fn(params: Any) -> tuple[Any, Any]:
            out, new = eqx.combine(params, rest)(x)
            return _sq_error(out, y), new

        (loss, new), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = optim.update(grads, opt_state, params)
        return loss, eqx.apply_updates(new, updates), opt_state

    model = _eqx_model(eqx, _weights(n))
    io = [model, optim.init(eqx.filter(model, trainable(model)))]

    def call() -> Any:
        loss, io[0], io[1] = step(*io, x, y)
        return loss

    return call


FORWARD_PEERS: dict[str, Callable[[int], Callable[[], Any]]] = {
    "Flax NNX (nnx.jit)": _nnx_forward("graph"),
    "Flax NNX (nnx.jit, graph=False)": _nnx_forward("tree"),
    "Flax NNX (nnx.jit_partial, graph=False)": _nnx_forward("partial"),
    "Equinox (eqx.filter_jit)": _eqx_forward,
}
TRAINING_PEERS: dict[str, Callable[[int], Callable[[], Any]]] = {
    "Flax NNX (nnx.jit)": _nnx_training("graph"),
    "Flax NNX (nnx.jit, graph=False)": _nnx_training("tree"),
    "Flax NNX (nnx.jit_partial, graph=False)": _nnx_training("partial"),
    "Equinox (eqx.filter_jit)": _eqx_training,
}


# --- the per-call tables -----------------------------------------------------


_START = time.perf_counter()


def _progress(line: str) -> None:
    """One measured row on stderr, with the seconds since the scenario's import."""
    print(f"[{time.perf_counter() - _START:6.0f} s] {line}", file=sys.stderr, flush=True)


def _blocked(fn: Callable[[], Any]) -> Callable[[], Any]:
    return lambda: jax.block_until_ready(fn())


def _per_call_table(
    title: str, what: str, cfg: Config, report: Report,
    cases_of: Callable[[int], dict[str, Callable[[], Any]]],
    peers: dict[str, Callable[[int], Callable[[], Any]]],
    calls_checked: int,
) -> Table:
    """Each path checked against the reference, then timed interleaved with
    it, one path at a time: its compiled program is let go before the next
    path compiles (at 1,000 modules the programs of every path at once
    exceed a process's memory mappings on XLA:CPU)."""
    table = Table(title, ("modules", "path", "per call", f"vs {REFERENCE}"))
    missing: dict[str, str] = {}
    for n in cfg.sizes:
        cases = cases_of(n)
        for name, make in peers.items():
            try:
                cases[name] = make(n)
            except PeerMissing as e:
                missing[name] = str(e)
        order = list(cases)
        reference = cases.pop(REFERENCE)
        # (A training step's second loss reads the first step's update.)
        expected = [np.asarray(reference()) for _ in range(calls_checked)]
        _progress(f"{title.split(':')[0]}, {n} modules: the paths built, {REFERENCE} called")
        rows: dict[str, tuple[float, float]] = {}
        reference_medians = []
        for name in list(cases):
            fn = cases.pop(name)
            got = [np.asarray(fn()) for _ in range(calls_checked)]
            assert_close(got, expected, err_msg=name)
            timings = time_interleaved(
                {name: _blocked(fn), REFERENCE: _blocked(reference)},
                rounds=cfg.rounds, number=cfg.number,
            )
            del fn
            gc.collect()
            rows[name] = timings[name].median, paired_ratio(timings[name], timings[REFERENCE])
            reference_medians.append(timings[REFERENCE].median)
            _progress(f"{title.split(':')[0]}, {n} modules, {name}: "
                      f"{fmt_seconds(rows[name][0])} ({fmt_ratio(rows[name][1])})")
        rows[REFERENCE] = statistics.median(reference_medians), 1.0
        for name in order:
            table.add(str(n), name, fmt_seconds(rows[name][0]), fmt_ratio(rows[name][1]))
        ratio = rows[AUTOSTATE][1] if AUTOSTATE in rows else None
        missing_optax = "" if ratio is not None else f"{NOT_INSTALLED}: optax"
        report.targets.append(target_below(
            "10", f"autostate.jit{what} at {n} modules within 0.5x of hand-written jax.jit",
            ratio, 0.5, missing_optax,
        ))
        if n == min(cfg.sizes):
            # Both ratios are to hand-written jax.jit, each paired with it.
            floor = rows[FLOOR][1]
            report.targets.append(target_below(
                "10", f"autostate.jit{what} at {n} modules within 1.3x of the floor "
                f"(one flat donated buffer)", None if ratio is None else ratio / floor, 1.3,
                missing_optax or f"of hand-written: autostate.jit {fmt_ratio(ratio)}, the floor "
                f"{fmt_ratio(floor)}",
            ))
    table.notes.append(
        f"each path timed interleaved with {REFERENCE}, one path at a time: median of "
        f"{cfg.rounds} rounds of {cfg.number} calls, blocked on; the ratio is the median of "
        f"the per-round ratios, {REFERENCE}'s per call the median over the pairs; every "
        f"path's output checked equal to {REFERENCE}'s first"
        + (f" (over {calls_checked} calls: the second loss reads the first update)"
           if calls_checked > 1 else "")
    )
    for name, why in missing.items():
        table.notes.append(f"{name}: left out, {why}")
    return table


# --- 10c: peak memory of a donated decode step --------------------------------


@autostate.stateful
class Decoder:
    """One attention layer over a key/value cache held as state, a token per call."""

    def __init__(self, key: Any, cfg: DecodeConfig):
        init = jax.nn.initializers.lecun_normal()
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.wq = init(kq, (cfg.d, cfg.d))
        self.wk = init(kk, (cfg.d, cfg.d))
        self.wv = init(kv, (cfg.d, cfg.d))
        self.wo = init(ko, (cfg.d, cfg.d))
        shape = (cfg.batch, cfg.heads, cfg.max_len, cfg.head_dim)
        self.k_cache = jnp.zeros(shape)
        self.v_cache = jnp.zeros(shape)
        self.pos = jnp.zeros((), jnp.int32)

    def __call__(self, x: Any) -> Any:
        params = {"wq": self.wq, "wk": self.wk, "wv": self.wv, "wo": self.wo}
        out, new = attend(params, {"k": self.k_cache, "v": self.v_cache, "pos": self.pos}, x)
        self.k_cache = new["k"]
        self.v_cache = new["v"]
        self.pos = new["pos"]
        return out


def attend(params: dict, cache: dict, x: Any) -> tuple[Any, dict]:
    """One token's attention: its keys and values written at ``pos``, then read."""
    b, d = x.shape
    heads = cache["k"].shape[1]
    pos = cache["pos"]

    def split(y: Any) -> Any:
        return y.reshape(b, heads, d // heads)

    q, k, v = (split(x @ params[w]) for w in ("wq", "wk", "wv"))
    k_cache = cache["k"].at[:, :, pos].set(k)
    v_cache = cache["v"].at[:, :, pos].set(v)
    logits = jnp.einsum("bhc,bhtc->bht", q, k_cache) / jnp.sqrt(d // heads)
    seen = jnp.arange(k_cache.shape[2]) <= pos
    weights = jax.nn.softmax(jnp.where(seen, logits, -1e9), axis=-1)
    out = jnp.einsum("bht,bhtc->bhc", weights, v_cache).reshape(b, d) @ params["wo"]
    return out, {"k": k_cache, "v": v_cache, "pos": pos + 1}


def _memory(compiled: Any) -> dict[str, int]:
    m = compiled.memory_analysis()
    sizes = {
        "arguments": m.argument_size_in_bytes,
        "outputs": m.output_size_in_bytes,
        "aliased": m.alias_size_in_bytes,
        "temporaries": m.temp_size_in_bytes,
    }
    sizes["peak"] = sizes["arguments"] + sizes["outputs"] + sizes["temporaries"] - sizes["aliased"]
    return sizes


def _copy(tree: Any) -> Any:
    return jax.tree_util.tree_map(jnp.copy, tree)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def decode_memory(cfg: DecodeConfig, report: Report) -> Table:
    model = Decoder(jax.random.key(0), cfg)
    x = jax.random.normal(jax.random.key(1), (cfg.batch, cfg.d))
    params = {w: getattr(model, w) for w in ("wq", "wk", "wv", "wo")}
    cache = {"k": model.k_cache, "v": model.v_cache, "pos": model.pos}
    cache_size = model.k_cache.nbytes + model.v_cache.nbytes
    f, states = model.functionalize()

    def decode_f(f: Any, states: Any, x: Any) -> Any:
        return f(states, x)

    by_hand = jax.jit(attend, donate_argnums=1)
    through_f = jax.jit(decode_f, donate_argnums=1)
    step = autostate.jit(lambda model, x: model(x))
    # Lowered before any call: a call donates the arrays these share.
    compiled = {
        "hand-written jax.jit (cache donated)": by_hand.lower(params, cache, x).compile(),
        "jax.jit of f (states donated)": through_f.lower(f, states, x).compile(),
        "jax.jit of f, not donated": jax.jit(decode_f).lower(f, states, x).compile(),
        AUTOSTATE: step.lower(model, x).compile(),
    }

    # The same output from each, and the model's cache updated in place.
    expected, _ = by_hand(params, _copy(cache), x)
    got_f, _ = through_f(f, _copy(states), x)
    before = model.k_cache
    pointer = before.unsafe_buffer_pointer()
    got = step(model, x)
    in_place = before.is_deleted() and model.k_cache.unsafe_buffer_pointer() == pointer
    for name, out in (("jax.jit of f", got_f), (AUTOSTATE, got)):
        assert_close(out, expected, err_msg=name)

    table = Table(
        "Scenario 10c: peak memory of a donated decode step "
        f"(compiled.memory_analysis(), {jax.default_backend()})",
        ("path", "arguments", "outputs", "aliased", "temporaries", "peak", "peak / KV cache"),
    )
    peaks = {}
    for name, c in compiled.items():
        m = _memory(c)
        peaks[name] = m["peak"]
        table.add(name, *(_mib(m[k]) for k in ("arguments", "outputs", "aliased", "temporaries",
                                                 "peak")), fmt_ratio(m["peak"] / cache_size))
    params_size = sum(p.nbytes for p in params.values())
    table.notes += [
        f"KV cache (k and v): {_mib(cache_size)}: batch {cfg.batch}, {cfg.max_len} positions, "
        f"{cfg.heads} heads of {cfg.head_dim}; the arguments include the parameters "
        f"({_mib(params_size)}, {params_size / cache_size:.2f}x the cache)",
        "peak = arguments + outputs + temporaries - aliased bytes of the compiled step; every "
        "path's output checked equal to the hand-written step's first",
        f"autostate.jit's call updated the model's cache in place (the same buffer, the old "
        f"one donated): {in_place}",
    ]
    hand = peaks["hand-written jax.jit (cache donated)"]
    ratio = peaks[AUTOSTATE] / cache_size
    detail = (f"hand-written {hand / cache_size:.2f}x; autostate.jit's peak "
              f"{(peaks[AUTOSTATE] - hand) / 2**20:+.2f} MiB from it"
              + ("" if in_place else "; not in place"))
    report.targets.append(Target(
        "10", "peak of autostate.jit's donated decode step about 1x the KV cache (< 1.1x)",
        ratio, ratio < 1.1 and in_place, detail,
    ))
    return table


def config(smoke: bool) -> Config:
    """SMOKE, or FULL with the fields ``AUTOSTATE_BENCH_MODEL_API`` names
    (``"sizes=100,1000 rounds=3 number=10"``)."""
    if smoke:
        return SMOKE
    fields: dict[str, Any] = {}
    for item in os.environ.get(OVERRIDE, "").split():
        key, _, value = item.partition("=")
        if key == "sizes":
            fields[key] = tuple(int(n) for n in value.split(","))
        elif key in ("rounds", "number"):
            fields[key] = int(value)
        else:
            raise ValueError(f"{OVERRIDE}: {item!r} is not sizes=N,M, rounds=N or number=N")
    return dataclasses.replace(FULL, **fields)


def run(smoke: bool = False) -> Report:
    cfg = config(smoke)
    checked_precision()
    report = Report()
    backend = jax.default_backend()
    report.tables.append(_per_call_table(
        f"Scenario 10: per-call cost of a jitted step on a model object ({backend})",
        "", cfg, report, _forward_cases, FORWARD_PEERS, calls_checked=1,
    ))
    report.tables.append(_per_call_table(
        f"Scenario 10b: per-call cost of a jitted training step on a model object (loss, "
        f"gradient, AdamW update, counters; {backend})",
        " training step", cfg, report, _training_cases, TRAINING_PEERS, calls_checked=2,
    ))
    report.tables.append(decode_memory(cfg.decode, report))
    return report


def main(argv: list[str] | None = None) -> None:
    script_main(run, __doc__, argv)


if __name__ == "__main__":
    main()
