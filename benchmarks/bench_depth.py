"""Scenario 11: depth: a Python loop over a stack of layers against a hand-written scan.

A model holds its layers as ``autostate.stack([...], require_scan=True)``
and runs them with a plain ``for block in self.blocks: x = block(x)`` in a
method. Traced (here: ``jax.jit`` of ``model.functionalize()``'s ``f``),
the loop is one ``lax.scan`` over the stacked layers (loop rolling;
``require_scan`` makes a loop that would unroll an error, so no row
measures one by mistake): trace + compile time stays flat with depth and
the step costs what a hand-written scan costs. Three implementations of
each model:

* **hand-written scan**: ``lax.scan`` over the stacked weights and states,
  the states threaded by hand (the reference);
* **loop over a stack**: the ``@stateful`` model, its layers a stack;
* **loop over a list**: the same class, its layers a plain list (unrolled
  when traced, one copy of the layer per layer).

Two models:

* **GPT decoder**: pre-norm blocks (causal self-attention whose KV cache is a
  state written at the decoded position, a GELU MLP, two layer norms) at
  12, 48 and 96 layers; a jitted decode step of one token, the states
  donated.
* **residual tanh stack**: 1,000 small layers (``x + tanh(x @ w)``, a
  running mean of the activations as state); a jitted forward step and a
  jitted SGD training step (``jax.value_and_grad`` of a loss of ``f``).

Trace + compile is ``jax.jit(step).lower(...).compile()`` of a new function
each time (the median of a few rounds); that executable is then checked
and timed: two steps of each give the stack model's outputs, states and
updated parameters (``np.testing.assert_allclose``), the stack model's
gradients equal the list model's (at a smaller depth), and per step is
``time_interleaved`` with the hand-written step, the ratio the median of
the per-round ratios. The HLO instructions of each compiled program are
counted: the rolled loop's are the hand-written scan's.

Run: ``python benchmarks/bench_depth.py [--smoke]``.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
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

REFERENCE = "hand-written scan"
STACK = "loop over a stack"
LIST = "loop over a list"


@dataclasses.dataclass(frozen=True)
class Config:
    gpt_depths: tuple[int, ...] = (12, 48, 96)
    dim: int = 64
    heads: int = 4
    context: int = 32
    batch: int = 2
    small_depth: int = 1000
    small_dim: int = 16
    small_batch: int = 8
    # Gradients are checked with a jitted jax.grad of each model at this
    # depth (the training steps at full depth are checked by their updates).
    small_grad_depth: int = 100
    compile_rounds: int = 3
    compile_once_above: float = 3.0
    rounds: int = 15
    number: int = 10


FULL = Config()
SMOKE = Config(gpt_depths=(2,), dim=8, heads=2, context=4, batch=1, small_depth=4,
               small_dim=3, small_batch=2, compile_rounds=1, rounds=1, number=1)


# --- shared pieces ---------------------------------------------------------------------


def _layer_norm(x: Any, scale: Any, bias: Any) -> Any:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + 1e-5) * scale + bias


def _attend(q: Any, k_cache: Any, v_cache: Any, pos: Any) -> Any:
    """One query per sequence against the cache's positions up to ``pos``.

    ``q``: (batch, heads, head_dim); the caches (batch, context, heads, head_dim).
    """
    scores = jnp.einsum("bhd,bthd->bht", q, k_cache) / math.sqrt(q.shape[-1])
    seen = jnp.arange(k_cache.shape[1]) <= pos
    weights = jax.nn.softmax(jnp.where(seen, scores, -1e9), axis=-1)
    return jnp.einsum("bht,bthd->bhd", weights, v_cache)


# --- the GPT decoder ----------------------------------------------------------------------


@autostate.stateful
class GPTBlock:
    """A pre-norm decoder block decoding one position; its KV cache is state."""

    def __init__(self, key: Any, dim: int, heads: int, context: int, batch: int):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.ln1_scale = jnp.ones(dim)
        self.ln1_bias = jnp.zeros(dim)
        self.wqkv = jax.random.normal(k1, (dim, 3 * dim)) / math.sqrt(dim)
        self.wo = jax.random.normal(k2, (dim, dim)) / math.sqrt(dim)
        self.ln2_scale = jnp.ones(dim)
        self.ln2_bias = jnp.zeros(dim)
        self.w1 = jax.random.normal(k3, (dim, 4 * dim)) / math.sqrt(dim)
        self.w2 = jax.random.normal(k4, (4 * dim, dim)) / math.sqrt(4 * dim)
        self.k_cache = jnp.zeros((batch, context, heads, dim // heads))
        self.v_cache = jnp.zeros((batch, context, heads, dim // heads))
        self.heads = heads

    def __call__(self, x: Any, pos: Any) -> Any:
        b, d = x.shape
        h = _layer_norm(x, self.ln1_scale, self.ln1_bias)
        q, k, v = (t.reshape(b, self.heads, d // self.heads)
                   for t in jnp.split(h @ self.wqkv, 3, axis=-1))
        self.k_cache = self.k_cache.at[:, pos].set(k)
        self.v_cache = self.v_cache.at[:, pos].set(v)
        x = x + _attend(q, self.k_cache, self.v_cache, pos).reshape(b, d) @ self.wo
        h = _layer_norm(x, self.ln2_scale, self.ln2_bias)
        return x + jax.nn.gelu(h @ self.w1) @ self.w2


@autostate.stateful
class Decoder:
    """Its blocks as a stack or as a list: the same loop."""

    def __init__(self, blocks: Any):
        self.blocks = blocks

    def __call__(self, x: Any, pos: Any) -> Any:
        for block in self.blocks:
            x = block(x, pos)
        return x


def gpt_layers(cfg: Config, depth: int) -> list[Any]:
    keys = jax.random.split(jax.random.key(1), depth)
    return [GPTBlock(k, cfg.dim, cfg.heads, cfg.context, cfg.batch) for k in keys]


def gpt_by_hand(cfg: Config, stacked: Any) -> tuple[Callable, dict, dict]:
    """The decode step over stacked weights and caches, a ``lax.scan``."""
    names = ("ln1_scale", "ln1_bias", "wqkv", "wo", "ln2_scale", "ln2_bias", "w1", "w2")
    weights = {n: getattr(stacked, n) for n in names}
    caches = {"k": stacked.k_cache, "v": stacked.v_cache}
    heads = cfg.heads

    def block(x: Any, w: Any, c: Any, pos: Any) -> tuple[Any, Any]:
        b, d = x.shape
        h = _layer_norm(x, w["ln1_scale"], w["ln1_bias"])
        q, k, v = (t.reshape(b, heads, d // heads) for t in jnp.split(h @ w["wqkv"], 3, axis=-1))
        c = {"k": c["k"].at[:, pos].set(k), "v": c["v"].at[:, pos].set(v)}
        x = x + _attend(q, c["k"], c["v"], pos).reshape(b, d) @ w["wo"]
        h = _layer_norm(x, w["ln2_scale"], w["ln2_bias"])
        return x + jax.nn.gelu(h @ w["w1"]) @ w["w2"], c

    def step(weights: Any, caches: Any, x: Any, pos: Any) -> Any:
        return jax.lax.scan(lambda x, wc: block(x, *wc, pos), x, (weights, caches))

    return step, weights, caches


def _stack(layers: list[Any]) -> Any:
    """The layers as a stack whose loops must roll: a loop that would unroll
    is an error, so that no row measures an unrolled loop by mistake."""
    return autostate.stack(layers, require_scan=True)


def _functional_step(f: Any, states: Any, *args: Any) -> Any:
    return f(states, *args)


# --- the residual tanh stack --------------------------------------------------------------


@autostate.stateful
class TanhLayer:
    """``x + tanh(x @ w)``, with a running mean of its activations as state."""

    def __init__(self, key: Any, dim: int):
        self.w = jax.random.normal(key, (dim, dim)) / math.sqrt(dim)
        self.mean = jnp.zeros(dim)

    def __call__(self, x: Any) -> Any:
        h = jnp.tanh(x @ self.w)
        self.mean = 0.99 * self.mean + 0.01 * jax.lax.stop_gradient(h.mean(0))
        return x + h


@autostate.stateful
class Residual:
    def __init__(self, layers: Any):
        self.layers = layers

    def __call__(self, x: Any) -> Any:
        for layer in self.layers:
            x = layer(x)
        return x


def small_layers(cfg: Config, depth: int) -> list[Any]:
    keys = jax.random.split(jax.random.key(2), depth)
    return [TanhLayer(k, cfg.small_dim) for k in keys]


def _small_layer(w: Any, mean: Any, x: Any) -> tuple[Any, Any]:
    h = jnp.tanh(x @ w)
    return x + h, 0.99 * mean + 0.01 * jax.lax.stop_gradient(h.mean(0))


def small_forward_by_hand(w: Any, means: Any, x: Any) -> Any:
    return jax.lax.scan(lambda x, wm: _small_layer(*wm, x), x, (w, means))


def _loss(forward: Callable, params: Any, states: Any, x: Any, y: Any) -> Any:
    out, states = forward(params, states, x)
    return jnp.mean((out - y) ** 2), states


def _sgd(forward: Callable) -> Callable:
    """A training step of ``forward(params, states, x) -> (out, states)``."""

    def step(params: Any, states: Any, x: Any, y: Any) -> Any:
        (value, states), grads = jax.value_and_grad(
            lambda p, s: _loss(forward, p, s, x, y), has_aux=True)(params, states)
        return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads), states, value

    return step


# --- measuring ----------------------------------------------------------------------------

# An implementation: (step, parameters, states, canonical); ``canonical(out,
# params, states)`` names what a step returns as the stack model names it
# (``blocks.k_cache`` with the layer axis), for the checks.
Impl = tuple[Callable, Any, Any, Callable[[Any, Any, Any], dict[str, Any]]]


def _per_layer(flat: dict[str, Any], prefix: str) -> dict[str, Any]:
    """A list model's ``prefix[i].name`` entries stacked as the stack's ``prefix.name``."""
    found: dict[str, dict[int, Any]] = {}
    for key, value in flat.items():
        head, _, name = key.partition("].")
        index = head[len(prefix) + 1:]
        if not (head.startswith(prefix + "[") and index.isdigit()):
            raise AssertionError(f"{key}: not an entry of the list {prefix!r}")
        found.setdefault(f"{prefix}.{name}", {})[int(index)] = np.asarray(value)
    return {key: np.stack([layers[i] for i in range(len(layers))])
            for key, layers in found.items()}


def _copy(tree: Any) -> Any:
    """Fresh buffers (a donated step consumes its arguments)."""
    return jax.tree.map(lambda a: jnp.array(a, copy=True) if isinstance(a, jax.Array) else a, tree)


def _check(results: dict[str, dict[str, Any]], what: str) -> None:
    want = results[STACK]
    for name, got in results.items():
        if set(got) != set(want):
            raise AssertionError(f"{what}: {name} gives {sorted(got)}, the stack {sorted(want)}")
        for key, value in got.items():
            assert_close(value, want[key], err_msg=f"{what}: {name} against {STACK}: {key}")


def _measure(impls: dict[str, Impl], args: tuple, *, train: bool, donate: tuple[int, ...],
             cfg: Config, what: str) -> tuple[dict[str, float], dict[str, Any], dict[str, Any]]:
    """Trace + compile seconds, step timings and HLO instruction counts of
    each implementation.

    Each is compiled ``cfg.compile_rounds`` times, interleaved, from a fresh
    ``jax.jit`` (the median kept; once, when that takes over
    ``cfg.compile_once_above`` seconds); the executable is checked (two
    steps from the same initial values, every output, state and, training,
    updated parameter equal to the stack model's) and timed.
    """
    seconds: dict[str, list[float]] = {name: [] for name in impls}
    executables: dict[str, Any] = {}
    for _ in range(cfg.compile_rounds):
        for name, (step, params, states, _) in impls.items():
            if seconds[name] and seconds[name][0] > cfg.compile_once_above:
                continue
            # A new function each time: jax.jit caches the trace of a function it saw.
            fresh = jax.jit(lambda *a, step=step: step(*a), donate_argnums=donate)
            start = time.perf_counter()
            executables[name] = fresh.lower(params, states, *args).compile()
            seconds[name].append(time.perf_counter() - start)
    compiled = {name: statistics.median(s) for name, s in seconds.items()}
    programs = {name: _hlo_ops(executable.as_text()) for name, executable in executables.items()}

    def call(name: str, params: Any, states: Any) -> tuple[Any, Any, Any]:
        if train:
            params, states, out = executables[name](params, states, *args)
        else:
            out, states = executables[name](params, states, *args)
        return out, params, states

    boxes = {name: [_copy(params), _copy(states)] for name, (_, params, states, _) in impls.items()}
    for i in range(2):
        results = {}
        for name, box in boxes.items():
            out, box[0], box[1] = call(name, *box)
            results[name] = impls[name][3](out, box[0], box[1])
        _check(results, f"{what}, step {i + 1}")

    def runner(name: str) -> Callable[[], Any]:
        box = boxes[name]

        def run() -> Any:
            out, box[0], box[1] = call(name, *box)
            return jax.block_until_ready((out, box[1]))

        return run

    timings = time_interleaved({name: runner(name) for name in impls}, rounds=cfg.rounds,
                               number=cfg.number)
    return compiled, timings, programs


_HLO_INSTRUCTION = re.compile(r"\s*(?:ROOT )?%\S+ = .*? ([a-z][\w-]*)\(")


def _hlo_ops(text: str) -> collections.Counter[str]:
    """How many of each instruction a compiled program's HLO holds."""
    found = (_HLO_INSTRUCTION.match(line) for line in text.splitlines())
    return collections.Counter(m.group(1) for m in found if m)


def _rows(table: Table, report: Report, label: Any, impls: dict[str, Impl],
          measured: tuple[dict[str, float], dict[str, Any], dict[str, Any]], what: str) -> None:
    compiled, timings, programs = measured
    ratios = {name: paired_ratio(timings[name], timings[REFERENCE]) for name in impls}
    for name in impls:
        table.add(label, name, fmt_seconds(compiled[name]),
                  fmt_ratio(compiled[name] / compiled[REFERENCE]),
                  fmt_seconds(timings[name].median), fmt_ratio(ratios[name]),
                  f"{sum(programs[name].values()):,}")
    report.targets.append(target_below(
        "11", f"{what}: loop over a stack's trace + compile within 1.2x of a hand-written scan",
        compiled[STACK] / compiled[REFERENCE], 1.2))
    report.targets.append(target_below(
        "11", f"{what}: loop over a stack's step within 1.05x of a hand-written scan",
        ratios[STACK], 1.05))
    same = programs[STACK] == programs[REFERENCE]
    differ = (programs[STACK] - programs[REFERENCE]) + (programs[REFERENCE] - programs[STACK])
    report.targets.append(Target(
        "11", f"{what}: loop over a stack compiles to the hand-written scan's program (HLO "
        "instruction counts)", None, same, "" if same else f"differ: {dict(differ)}"))


def _plotted(report: Report, depth: int, measured: tuple) -> None:
    """Keeps one depth's trace + compile seconds and HLO instruction counts
    for ``plot`` (``report.plot``: ``{"compile"|"hlo": {implementation: {depth:
    value}}, "backend": ...}``)."""
    compiled, _, programs = measured
    data = report.plot if report.plot is not None else {"backend": jax.default_backend()}
    report.plot = data
    for name, seconds in compiled.items():
        data.setdefault("compile", {}).setdefault(name, {})[depth] = seconds
        data.setdefault("hlo", {}).setdefault(name, {})[depth] = sum(programs[name].values())


def plot(data: dict[str, Any], path: str) -> str | None:
    """Writes the depth figure (trace + compile time and program size against
    the number of layers, one panel above the other); returns why not when
    matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"matplotlib is not installed ({e})"
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 9), sharex=True)
    styles = {REFERENCE: {"color": "black", "linestyle": "--"},
              STACK: {"color": "tab:blue"}, LIST: {"color": "tab:red"}}
    for ax, key, ylabel in ((top, "compile", "trace + compile (s)"),
                            (bottom, "hlo", "HLO instructions")):
        for name, by_depth in data[key].items():
            depths = sorted(by_depth)
            ax.plot(depths, [by_depth[d] for d in depths], marker="o", linewidth=2,
                    label=name, **styles.get(name, {}))
        ax.set_ylabel(ylabel, fontsize=12)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=11, loc="upper left")
        ax.tick_params(labelsize=11)
    top.set_title(f"A jitted GPT decode step against its depth ({data['backend']})",
                  fontsize=13)
    bottom.set_xlabel("layers", fontsize=12)
    bottom.set_xticks(sorted(next(iter(data["compile"].values()))))
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return None


def _check_gradients(loss: Callable[[Any, Any], Any], stack_model: Any, list_model: Any,
                     prefix: str, what: str) -> None:
    """The gradients of ``loss(f, states)`` with respect to the parameters of
    the stack model equal the list model's."""
    grads = {}
    for name, model in ((STACK, stack_model), (LIST, list_model)):
        f, states = autostate.functionalize(model)
        flat = autostate.param_dict(jax.jit(jax.grad(loss))(f, states))
        grads[name] = flat if name == STACK else _per_layer(flat, prefix)
    _check(grads, f"{what}: gradients")


# --- the report ---------------------------------------------------------------------------


def _gpt_table(cfg: Config, rng: np.random.Generator, report: Report) -> Table:
    table = Table(
        f"Scenario 11: depth, a jitted decode step of a GPT decoder ({cfg.dim} wide, "
        f"{cfg.heads} heads, KV cache of {cfg.context} positions, batch {cfg.batch}; "
        f"{jax.default_backend()})",
        ("layers", "implementation", "trace + compile", f"vs {REFERENCE}", "per step",
         f"vs {REFERENCE}", "HLO instructions"),
    )
    x = jnp.asarray(rng.normal(size=(cfg.batch, cfg.dim)), jnp.float32)
    pos = jnp.asarray(cfg.context // 2, jnp.int32)
    check_depth = min(cfg.gpt_depths)
    layers = gpt_layers(cfg, check_depth)
    _check_gradients(lambda f, s: f(s, x, pos)[0].sum(), Decoder(_stack(layers)),
                     Decoder(layers), "blocks", f"GPT {check_depth} layers")

    def named_caches(out: Any, weights: Any, caches: Any) -> dict[str, Any]:
        return {"out": out, "blocks.k_cache": caches["k"], "blocks.v_cache": caches["v"]}

    for depth in cfg.gpt_depths:
        layers = gpt_layers(cfg, depth)
        stack_model = Decoder(_stack(layers))
        step, weights, caches = gpt_by_hand(cfg, stack_model.blocks.stacked)
        impls: dict[str, Impl] = {
            REFERENCE: (step, weights, caches, named_caches),
            STACK: (_functional_step, *autostate.functionalize(stack_model),
                    lambda out, f, s: {"out": out, **s}),
            LIST: (_functional_step, *autostate.functionalize(Decoder(layers)),
                   lambda out, f, s: {"out": out, **_per_layer(s, "blocks")}),
        }
        del layers, stack_model
        measured = _measure(impls, (x, pos), train=False, donate=(1,), cfg=cfg,
                            what=f"GPT {depth} layers")
        _rows(table, report, depth, impls, measured, f"GPT {depth} layers")
        _plotted(report, depth, measured)
    table.notes.append(
        f"trace + compile: `jax.jit(step).lower(...).compile()`, median of {cfg.compile_rounds} "
        f"interleaved rounds (one when it took over {cfg.compile_once_above:g} s), a fresh "
        f"function each time; per step: that executable, median of {cfg.rounds} interleaved "
        f"rounds of {cfg.number} calls (the states donated and threaded, blocked on), the ratio "
        "the median of the per-round ratios")
    table.notes.append(
        "checked first: two decode steps of each executable give the stack model's outputs and "
        "KV caches; parameter gradients of the stack model equal the list model's (at "
        f"{check_depth} layers)")
    return table


def _small_table(cfg: Config, rng: np.random.Generator, report: Report) -> Table:
    table = Table(
        f"Scenario 11: depth, {cfg.small_depth:,} residual tanh layers ({cfg.small_dim} wide, "
        f"a running mean each; batch {cfg.small_batch}; {jax.default_backend()})",
        ("step", "implementation", "trace + compile", f"vs {REFERENCE}", "per step",
         f"vs {REFERENCE}", "HLO instructions"),
    )
    x = jnp.asarray(rng.normal(size=(cfg.small_batch, cfg.small_dim)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(cfg.small_batch, cfg.small_dim)), jnp.float32)
    check_depth = min(cfg.small_depth, cfg.small_grad_depth)
    layers = small_layers(cfg, check_depth)
    _check_gradients(lambda f, s: _loss(_functional_step, f, s, x, y)[0],
                     Residual(_stack(layers)), Residual(layers), "layers",
                     f"{check_depth} residual layers")

    layers = small_layers(cfg, cfg.small_depth)
    stack_model = Residual(_stack(layers))
    w, means = stack_model.layers.stacked.w, stack_model.layers.stacked.mean
    models = {STACK: autostate.functionalize(stack_model),
              LIST: autostate.functionalize(Residual(layers))}
    del layers, stack_model

    def named(out: Any, params: Any, states: Any) -> dict[str, Any]:
        return {"out": out, "layers.mean": states, "layers.w": params}

    def named_stack(out: Any, f: Any, states: Any) -> dict[str, Any]:
        return {"out": out, **states, **autostate.param_dict(f)}

    def named_list(out: Any, f: Any, states: Any) -> dict[str, Any]:
        return {"out": out, **_per_layer({**states, **autostate.param_dict(f)}, "layers")}

    canonical = {STACK: named_stack, LIST: named_list}
    for kind, train in (("forward", False), ("training (SGD)", True)):
        impls: dict[str, Impl] = {
            REFERENCE: (_sgd(small_forward_by_hand) if train else small_forward_by_hand,
                        w, means, named)}
        for name, (f, states) in models.items():
            impls[name] = (_sgd(_functional_step) if train else _functional_step, f, states,
                           canonical[name])
        what = f"{cfg.small_depth:,} residual layers, {kind}"
        measured = _measure(impls, (x, y) if train else (x,), train=train,
                            donate=(0, 1) if train else (1,), cfg=cfg, what=what)
        _rows(table, report, kind, impls, measured, what)
    table.notes.append("measured as the decode step (table above)")
    table.notes.append("the training step: `jax.value_and_grad` of a mean squared error of the "
                       "output, an SGD update of the parameters; parameters and states donated")
    table.notes.append(
        "checked first: two steps of each executable give the stack model's outputs, states "
        "and updated parameters; parameter gradients of the stack model equal the list "
        f"model's (at {check_depth} layers)")
    return table


def run(smoke: bool = False) -> Report:
    cfg = SMOKE if smoke else FULL
    checked_precision()
    rng = np.random.default_rng(0)
    report = Report()
    jax.jit(lambda a: jnp.tanh(a) @ a).lower(jnp.ones((4, 4))).compile()  # (warm-up of JAX)
    report.tables.append(_gpt_table(cfg, rng, report))
    report.tables.append(_small_table(cfg, rng, report))
    return report


def main(argv: list[str] | None = None) -> None:
    script_main(run, __doc__, argv)


if __name__ == "__main__":
    main()
