"""Scenario 3: cost of turning a stateful model into pure pieces and back, by size.

Models of ``n`` tiny modules (the modules of scenario 2: two parameters and
two states each). For every library, the pair of operations that separates a
model into a pure part plus its state and puts it back together:

- autostate: ``model.functionalize()`` / ``autostate.freeze(f, states)``
- Flax NNX: ``nnx.split(model)`` / ``nnx.merge(graphdef, state)``
- Equinox: ``eqx.partition(model, eqx.is_array)`` / ``eqx.combine(params, static)``
- penzai v1: ``handle_local_states`` / ``freeze_local_states``

Each is checked to round-trip (the rebuilt model has the same leaves) before
it is timed. The run writes the data for a log-log plot of time against size.

Run: ``python benchmarks/bench_scaling.py [--smoke]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from _timing import (
    NOT_INSTALLED,
    PeerMissing,
    Report,
    Table,
    fmt_ratio,
    fmt_seconds,
    optional_import,
    target_ratio,
    time_interleaved,
)
from bench_dispatch import (
    AutostateDispatcher,
    EquinoxDispatcher,
    HandwrittenDispatcher,
    NNXSplitMergeDispatcher,
    autostate_model,
    canonical_init,
    handwritten_step,
    nnx_model,
    penzai_model,
)
from bench_dispatch import Config as DispatchConfig

import autostate

CONTROL = "plain Python (control)"


@dataclasses.dataclass(frozen=True)
class Config:
    sizes: tuple[int, ...] = (100, 1_000, 10_000)
    # rounds per size: large models take long enough that fewer rounds suffice
    rounds: tuple[int, ...] = (15, 7, 5)
    trace_rounds: tuple[int, ...] = (7, 5, 3)


FULL = Config()
SMOKE = Config(sizes=(4, 16), rounds=(1, 1), trace_rounds=(1, 1))


@dataclasses.dataclass
class Pair:
    """A library's split/join pair on one model: ``extract()`` then ``rebuild(parts)``."""

    extract: Callable[[], Any]
    rebuild: Callable[[Any], Any]
    original_leaves: Callable[[Any], list]
    rebuilt_leaves: Callable[[Any], list]


def autostate_pair(params) -> Pair:
    model = autostate_model(params)

    def leaves(m):
        return [x for layer in m.layers for x in (layer.w, layer.b, layer.count, layer.total)]

    return Pair(
        extract=lambda: model.functionalize(),
        rebuild=lambda parts: autostate.freeze(*parts),
        original_leaves=lambda: leaves(model),
        rebuilt_leaves=leaves,
    )


def nnx_pair(params) -> Pair:
    nnx, model = nnx_model(params)

    def leaves(m):
        return [v[...] for layer in m.layers for v in (layer.w, layer.b, layer.count, layer.total)]

    return Pair(
        extract=lambda: nnx.split(model),
        rebuild=lambda parts: nnx.merge(*parts),
        original_leaves=lambda: leaves(model),
        rebuilt_leaves=leaves,
    )


def equinox_pair(params) -> Pair:
    eqx = optional_import("equinox")
    model = EquinoxDispatcher(params, np.zeros(4, np.float32)).model
    return Pair(
        extract=lambda: eqx.partition(model, eqx.is_array),
        rebuild=lambda parts: eqx.combine(*parts),
        original_leaves=lambda: jax.tree_util.tree_leaves(model),
        rebuilt_leaves=jax.tree_util.tree_leaves,
    )


def penzai_pair(params) -> Pair:
    pz, model = penzai_model(params)

    def leaves(m):
        out = []
        for layer in m.sublayers:
            out += [layer.w.value, layer.b.value]
            out += [r.state_initializer() if hasattr(r, "state_initializer") else r.state
                    for r in (layer.count, layer.total)]
        return out

    return Pair(
        extract=lambda: pz.de.handle_local_states(model, category="tiny"),
        rebuild=lambda parts: pz.de.freeze_local_states(*parts),
        original_leaves=lambda: leaves(model),
        rebuilt_leaves=leaves,
    )


def control_pair(params) -> Pair:
    """Not a library: a shallow copy of every module, the least any rebuild costs.

    Its growth from one size to the next shows what the machine itself (caches,
    allocator) adds to a walk over more objects.
    """
    model = autostate_model(params)

    def copy_modules(layers: list) -> list:
        out = []
        for layer in layers:
            new = object.__new__(type(layer))
            new.__dict__.update(layer.__dict__)
            out.append(new)
        return out

    def leaves(layers):
        return [v for layer in layers for v in layer.__dict__.values()]

    return Pair(
        extract=lambda: copy_modules(model.layers),
        rebuild=copy_modules,
        original_leaves=lambda: leaves(model.layers),
        rebuilt_leaves=leaves,
    )


IMPLEMENTATIONS: dict[str, tuple[str, str, Callable[..., Pair]]] = {
    "autostate": ("functionalize()", "freeze()", autostate_pair),
    "Flax NNX": ("nnx.split", "nnx.merge", nnx_pair),
    "Equinox": ("eqx.partition", "eqx.combine", equinox_pair),
    "penzai v1": ("handle_local_states", "freeze_local_states", penzai_pair),
    CONTROL: ("copy each module", "copy each module", control_pair),
}
# Also timed with the garbage collector on, as a program runs them.
GC_ON = ("autostate", "Flax NNX")


# --- trace time by size -------------------------------------------------------

TRACE_REFERENCE = "hand-written JAX (dicts)"


def trace_fns(params) -> dict[str, Callable[[], Any]]:
    """``jax.jit(step).trace(...)`` of each library's step, with a fresh jit per call."""
    x = np.zeros(4, np.float32)
    hand = HandwrittenDispatcher(params, x)
    mine = AutostateDispatcher(params, x)
    fns: dict[str, Callable[[], Any]] = {
        TRACE_REFERENCE: lambda: jax.jit(lambda p, s, x: handwritten_step(p, s, x)).trace(
            hand.params, hand._states, hand.x),
        "autostate": lambda: jax.jit(lambda f, s, x: f(s, x)).trace(mine.f, mine._states, mine.x),
    }
    try:
        nnx = NNXSplitMergeDispatcher(params, x)
        step = nnx._step.__wrapped__
        # A new function per call, as for the rows above: jax.jit of the same
        # function object reuses its cached trace, which is not a trace.
        fns["Flax NNX"] = lambda: jax.jit(lambda g, s, x: step(g, s, x)).trace(
            nnx.graphdef, nnx.state, nnx.x)
    except PeerMissing:
        pass
    try:
        eqx = optional_import("equinox")
        d = EquinoxDispatcher(params, x)
        dynamic, static = eqx.partition((d.model, d.state), eqx.is_array)

        def eqx_step(dynamic, x):
            model, state = eqx.combine(dynamic, static)
            return model(x, state)

        fns["Equinox"] = lambda: jax.jit(lambda dyn, x: eqx_step(dyn, x)).trace(dynamic, d.x)
    except PeerMissing:
        pass
    return fns


# A peer whose traces would take longer than this at the next size is not
# traced there; the table says so, with the projection. The growth is the one
# measured between the last two sizes, quadratic before there are two (Flax
# NNX's trace grows faster than linearly).
PEER_TRACE_BUDGET_S = 240.0
# Observed: NNX's trace at 10,000 modules did not finish within 20 minutes.
NNX_TRACE_MAX_MODULES = 1_000


def trace_scaling(cfg: Config, report: Report) -> dict[str, dict[int, float]]:
    results: dict[str, dict[int, float]] = {}
    skipped: list[str] = []
    for size, rounds in zip(cfg.sizes, cfg.trace_rounds):
        params, _ = canonical_init(DispatchConfig(modules=size))
        fns = trace_fns(params)
        if size > NNX_TRACE_MAX_MODULES and "Flax NNX" in fns:
            del fns["Flax NNX"]
            skipped.append(
                f"Flax NNX not traced at {size:,} modules: one trace there ran for over 20 min "
                "in two runs (stack in JAX's tracer-origin message, reached from "
                "nnx Variable.set_value), so it is left out"
            )
        for peer in ("Flax NNX", "Equinox"):
            measured = results.get(peer)
            if peer not in fns or not measured:
                continue
            sizes = sorted(measured)
            last = sizes[-1]
            power = 2.0
            if len(sizes) > 1:
                before = sizes[-2]
                power = math.log(measured[last] / measured[before]) / math.log(last / before)
            projected = measured[last] * (size / last) ** power * (rounds + 1)
            if projected > PEER_TRACE_BUDGET_S:
                del fns[peer]
                skipped.append(
                    f"{peer} not traced at {size:,} modules: {fmt_seconds(measured[last])} per trace "
                    f"at {last:,}, so about {projected / 60:.0f} min for {rounds + 1} traces if it "
                    f"grows as size^{power:.1f} (budget {PEER_TRACE_BUDGET_S / 60:.0f} min)"
                )
        timings = time_interleaved(fns, rounds=rounds, number=1, warmup=1, gc_off=False)
        for name, t in timings.items():
            results.setdefault(name, {})[size] = t.median
        for peer in ("Flax NNX", "Equinox"):
            versus = fmt_ratio(timings["autostate"].median / timings[TRACE_REFERENCE].median)
            gone = peer in results and peer not in timings
            report.targets.append(target_ratio(
                "3", f"trace faster than {peer} at {size:,} modules",
                timings["autostate"].median, timings[peer].median if peer in timings else None,
                1.0, f"vs hand-written {versus}"
                + ("; peer not traced at this size (over the budget, table 3c)" if gone else ""),
            ))
    table = Table(
        "Scenario 3c: trace-only time of the jitted step by size (garbage collector on)",
        ("implementation", "modules", "trace", "vs hand-written", "vs autostate", "per module"),
    )
    for name, by_size in results.items():
        for size, seconds in by_size.items():
            table.add(name, f"{size:,}", fmt_seconds(seconds),
                      fmt_ratio(seconds / results[TRACE_REFERENCE][size]),
                      fmt_ratio(seconds / results["autostate"][size]), fmt_seconds(seconds / size))
    table.notes.append(
        "jax.jit(step).trace(...) with a fresh jit per call (nothing cached), median of "
        + ", ".join(f"{r} at {s:,}" for s, r in zip(cfg.sizes, cfg.trace_rounds))
        + " interleaved rounds; NNX traces split/merge + jax.jit, Equinox partition/combine "
        "+ jax.jit (what filter_jit traces)"
    )
    table.notes.extend(skipped)
    report.tables.append(table)
    return results


def check_round_trip(name: str, pair: Pair) -> Any:
    parts = pair.extract()
    rebuilt = pair.rebuild(parts)
    want, got = pair.original_leaves(), pair.rebuilt_leaves(rebuilt)
    assert len(want) == len(got), f"{name}: {len(got)} leaves after the round trip, not {len(want)}"
    for w, g in zip(want, got):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)
    return parts


class FullCollections:
    """Counts CPython's full (generation 2) collections that start inside a timed call."""

    def __init__(self, names) -> None:
        self.counts = dict.fromkeys(names, 0)
        self.current: str | None = None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2 and self.current is not None:
            self.counts[self.current] += 1

    def wrap(self, name: str, fn: Callable[[], Any]) -> Callable[[], Any]:
        def counted() -> Any:
            self.current = name
            try:
                return fn()
            finally:
                self.current = None

        return counted


Results = dict[str, dict[int, tuple[float, float]]]  # name -> size -> (extract s, rebuild s)


def run(smoke: bool = False) -> Report:
    cfg = SMOKE if smoke else FULL
    results: Results = {name: {} for name in IMPLEMENTATIONS}
    gc_results: Results = {name: {} for name in GC_ON}
    full_collections: dict[str, dict[int, float]] = {name: {} for name in GC_ON}
    missing: dict[str, str] = {}
    for size, rounds in zip(cfg.sizes, cfg.rounds):
        params, _ = canonical_init(DispatchConfig(modules=size))
        fns: dict[str, Callable[[], Any]] = {}
        for name, (_, _, make) in IMPLEMENTATIONS.items():
            if name in missing:
                continue
            try:
                pair = make(params)
            except PeerMissing as e:
                missing[name] = str(e)
                continue
            parts = check_round_trip(name, pair)
            fns[f"{name}/extract"] = pair.extract
            fns[f"{name}/rebuild"] = lambda pair=pair, parts=parts: pair.rebuild(parts)
        # The round-trip check above is the warm-up.
        timings = time_interleaved(fns, rounds=rounds, number=1, warmup=0)
        for name in results:
            if name not in missing:
                results[name][size] = (
                    timings[f"{name}/extract"].median,
                    timings[f"{name}/rebuild"].median,
                )
        counter = FullCollections(n for n in fns if n.split("/")[0] in GC_ON)
        gc.callbacks.append(counter)
        try:
            gc_timings = time_interleaved(
                {n: counter.wrap(n, fns[n]) for n in counter.counts},
                rounds=rounds, number=1, warmup=0, gc_off=False,
            )
        finally:
            gc.callbacks.remove(counter)
        for name in GC_ON:
            if name not in missing:
                gc_results[name][size] = (
                    gc_timings[f"{name}/extract"].median,
                    gc_timings[f"{name}/rebuild"].median,
                )
                full_collections[name][size] = (
                    counter.counts[f"{name}/extract"] + counter.counts[f"{name}/rebuild"]
                ) / rounds

    table = Table(
        "Scenario 3: structure at scale (modules with 2 params + 2 states each)",
        ("implementation", "operations", "modules", "extract", "rebuild", "total",
         "vs autostate", "per module"),
    )
    for name, (op_extract, op_rebuild, _) in IMPLEMENTATIONS.items():
        if name in missing:
            table.add(name, f"{op_extract} / {op_rebuild}", "-", NOT_INSTALLED, "-", "-", "-", "-")
            continue
        for size, (ext, reb) in results[name].items():
            mine = sum(results["autostate"][size])
            table.add(name, f"{op_extract} / {op_rebuild}", f"{size:,}", fmt_seconds(ext),
                      fmt_seconds(reb), fmt_seconds(ext + reb), fmt_ratio((ext + reb) / mine),
                      fmt_seconds((ext + reb) / size))
    table.notes.append(
        "median of interleaved rounds (" + ", ".join(
            f"{r} at {s:,}" for s, r in zip(cfg.sizes, cfg.rounds))
        + "), garbage collector off while timing (as timeit); each pair round-trip checked"
    )
    table.notes.append(f"{CONTROL}: {control_pair.__doc__.splitlines()[0]}")
    for name, why in missing.items():
        table.notes.append(f"{name}: {NOT_INSTALLED} ({why})")

    report = Report(tables=[table])
    small, large = cfg.sizes[-2], cfg.sizes[-1]
    growth = large / small
    mine = results["autostate"]
    report.targets.append(target_ratio(
        "3", f"linear growth: time({large:,}) / time({small:,}) below {1.5 * growth:g}",
        sum(mine[large]), sum(mine[small]), 1.5 * growth,
        f"functionalize {fmt_ratio(mine[large][0] / mine[small][0])}, "
        f"freeze {fmt_ratio(mine[large][1] / mine[small][1])}; control "
        f"{fmt_ratio(sum(results[CONTROL][large]) / sum(results[CONTROL][small]))}",
    ))
    for size in cfg.sizes:
        nnx_total = sum(results["Flax NNX"][size]) if "Flax NNX" not in missing else None
        report.targets.append(target_ratio(
            "3", f"functionalize+freeze faster than nnx.split+nnx.merge at {size:,} modules",
            sum(mine[size]), nnx_total, 1.0,
        ))
    for size in cfg.sizes:
        eqx_total = sum(results["Equinox"][size]) if "Equinox" not in missing else None
        report.targets.append(target_ratio(
            "3", f"functionalize+freeze faster than eqx.partition+eqx.combine at {size:,} modules",
            sum(mine[size]), eqx_total, 1.0,
        ))
    report.tables.append(growth_table(results, missing, small, large))
    report.tables.append(gc_table(gc_results, full_collections, missing, small, large))
    traces = trace_scaling(cfg, report)
    report.plot = {"sizes": list(cfg.sizes), "results": results, "traces": traces, "operations": {
        name: (ops[0], ops[1]) for name, ops in IMPLEMENTATIONS.items()}}
    return report


def gc_table(gc_results: Results, full_collections, missing, small: int, large: int) -> Table:
    table = Table(
        "Scenario 3b: the same with the garbage collector on",
        ("implementation", "modules", "extract", "rebuild", "total", "full collections",
         f"growth {small:,} -> {large:,}"),
    )
    for name, by_size in gc_results.items():
        if name in missing:
            continue
        for size, (ext, reb) in by_size.items():
            grows = "-"
            if size == large:
                grows = fmt_ratio((ext + reb) / sum(by_size[small]))
            table.add(name, f"{size:,}", fmt_seconds(ext), fmt_seconds(reb),
                      fmt_seconds(ext + reb), f"{full_collections[name][size]:.1f}", grows)
    table.notes.append(
        "full collections: CPython generation-2 collections started inside the timed pair, "
        "per round. One starts when the objects that survived younger collections exceed a "
        "quarter of all tracked objects, and it scans every tracked object in the process, so "
        "whether a pair pays for one depends on the rest of the heap, not only on the pair"
    )
    return table


def growth_table(results, missing, small: int, large: int) -> Table:
    table = Table(
        f"Scenario 3: growth from {small:,} to {large:,} modules (linear = {large / small:g}x)",
        ("implementation", "extract", "rebuild", "total"),
    )
    for name in results:
        if name in missing:
            continue
        (e0, r0), (e1, r1) = results[name][small], results[name][large]
        table.add(name, fmt_ratio(e1 / e0), fmt_ratio(r1 / r0), fmt_ratio((e1 + r1) / (e0 + r0)))
    return table


def plot(data: dict[str, Any], path: str) -> str | None:
    """Writes the log-log plot; returns why not when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"matplotlib {NOT_INSTALLED} ({e})"
    # The panels stacked, each the page's width: the docs show the figure
    # at the width of their text column, where four side by side were
    # unreadable.
    fig, axes = plt.subplots(4, 1, figsize=(8, 17), sharex=True)
    for name, by_size in data["results"].items():
        if not by_size:
            continue
        sizes = sorted(by_size)
        op_extract, op_rebuild = data["operations"][name]
        for ax, values, label in (
            (axes[0], [by_size[s][0] for s in sizes], f"{name}: {op_extract}"),
            (axes[1], [by_size[s][1] for s in sizes], f"{name}: {op_rebuild}"),
            (axes[2], [sum(by_size[s]) for s in sizes], name),
        ):
            style = {"linestyle": "--", "color": "gray"} if name == CONTROL else {}
            ax.loglog(sizes, values, marker="o", label=label, **style)
    for name, by_size in data.get("traces", {}).items():
        sizes = sorted(by_size)
        style = {"linestyle": "--", "color": "black"} if name == TRACE_REFERENCE else {}
        axes[3].loglog(sizes, [by_size[s] for s in sizes], marker="o", label=name, **style)
    for ax, title in zip(axes, ("extract (functionalize / split / partition / handle)",
                                "rebuild (freeze / merge / combine / freeze)", "total",
                                "trace of the jitted step (jax.jit(...).trace)")):
        ax.set_title(title, fontsize=12)
        ax.set_ylabel("seconds (median)")
        ax.grid(True, which="both", alpha=0.3)
        # Outside the axes: the lines are not hidden, and the labels not cut.
        ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    axes[-1].set_xlabel("modules (2 params + 2 states each)")
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one round")
    parser.add_argument("--plot", metavar="PNG", help="also write the log-log plot here")
    args = parser.parse_args(argv)
    report = run(args.smoke)
    report.print()
    if args.plot:
        why_not = plot(report.plot, args.plot)
        print(why_not or f"wrote {args.plot}")


if __name__ == "__main__":
    main()
