"""Scenario 5: cost of ``@autostate.stateful`` itself, as a ratio of ``compile()``.

Decoration reads a class's source, analyses and rewrites its methods with
libcst and compiles them; the result is cached by content. This measures, for
a few classes written to a temporary module file, the time of
``autostate.stateful(cls)``:

- uncached: a file autostate has never seen (a fresh file name each time);
- cached in memory: the same file decorated again in the same process (a
  class re-created by importing the file again);
- cached on disk: the same, with the in-process cache emptied first, as in a
  new Python process;

each divided by ``compile()`` of the same module source, the least a tool
that turns source into code can cost. Each decoration is timed once, right
after a fresh import of the file (a new class); the yardstick ``compile()``
is timed the same way, once right after a fresh import, so that both run
with the caches an import leaves. ``compile()`` repeated back to back (a
warmer, cheaper yardstick) is printed too. Decoration uses a private cache
directory while it runs, so the user's cache is untouched.

Run: ``python benchmarks/bench_decoration.py [--smoke]``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import os
import statistics
import sys
import tempfile
import textwrap
import types
from pathlib import Path

from _timing import (
    Report,
    Table,
    fmt_ratio,
    fmt_seconds,
    script_main,
    target_below,
    time_once,
)

import autostate
from autostate.transform import loader

SOURCES = {
    "BatchNorm (2 methods, 2 states)": '''
        import jax.numpy as jnp


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
        ''',
    "Attention with KV cache (6 methods, 3 states)": '''
        import jax
        import jax.numpy as jnp


        class CachedAttention:
            """Single-head attention that appends to a key/value cache."""

            def __init__(self, dim, max_len, key):
                k1, k2, k3 = jax.random.split(key, 3)
                self.wq = jax.random.normal(k1, (dim, dim)) / dim**0.5
                self.wk = jax.random.normal(k2, (dim, dim)) / dim**0.5
                self.wv = jax.random.normal(k3, (dim, dim)) / dim**0.5
                self.keys = jnp.zeros((max_len, dim))
                self.values = jnp.zeros((max_len, dim))
                self.length = jnp.zeros((), jnp.int32)
                self.max_len = max_len

            def reset(self):
                self.keys = jnp.zeros_like(self.keys)
                self.values = jnp.zeros_like(self.values)
                self.length = jnp.zeros((), jnp.int32)

            def append(self, k, v):
                self.keys = self.keys.at[self.length].set(k)
                self.values = self.values.at[self.length].set(v)
                self.length += 1

            def mask(self):
                return jnp.arange(self.max_len) < self.length

            def scores(self, q):
                s = self.keys @ q / q.shape[-1] ** 0.5
                return jnp.where(self.mask(), s, -jnp.inf)

            def __call__(self, x):
                q, k, v = x @ self.wq, x @ self.wk, x @ self.wv
                self.append(k, v)
                weights = jax.nn.softmax(self.scores(q))
                return weights @ self.values
        ''',
}


@dataclasses.dataclass(frozen=True)
class Config:
    repeats: int = 41
    compile_repeats: int = 328


FULL = Config()
SMOKE = Config(repeats=1, compile_repeats=2)

_counter = itertools.count()


def _import_class(path: Path) -> type:
    """Imports ``path`` as a fresh module and returns the class it defines."""
    name = f"autostate_bench_decoration_{next(_counter)}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return next(v for v in vars(module).values() if isinstance(v, type) and v.__module__ == name)


def _decorate_and_install(cls: type) -> None:
    # @stateful decides at the class statement and installs at the class's
    # first use: both are the decoration's cost (class_info completes it).
    autostate.tree.class_info(autostate.stateful(cls))


def _decoration_times(directory: Path, source: str, cfg: Config) -> dict[str, list[float]]:
    """Seconds of each kind of decoration, and of ``compile()`` of ``source``, per round."""
    # Fresh names: linecache would hand autostate the stale text of a reused one.
    cached_path = directory / f"cached_{next(_counter)}.py"
    cached_path.write_text(source)
    first = autostate.stateful(_import_class(cached_path))  # fills both caches
    expected_state = autostate.tree.class_info(first).state

    def check(cls: type) -> None:
        # A cache hit must give the same decoration as the first transformation.
        assert autostate.tree.class_info(cls).state == expected_state, cls
        assert callable(cls.functionalize)

    def uncached() -> float:
        path = directory / f"uncached_{next(_counter)}.py"
        path.write_text(source)
        cls = _import_class(path)
        seconds = time_once(lambda: _decorate_and_install(cls), gc_off=True)
        check(cls)
        return seconds

    def cached_memory() -> float:
        cls = _import_class(cached_path)
        seconds = time_once(lambda: _decorate_and_install(cls), gc_off=True)
        check(cls)
        return seconds

    def cached_disk() -> float:
        cls = _import_class(cached_path)
        # autostate keeps no public switch for its in-process cache; emptying
        # the dict is what a new process starts with.
        loader._MEMORY_CACHE.clear()
        seconds = time_once(lambda: _decorate_and_install(cls), gc_off=True)
        check(cls)
        return seconds

    def compiled_after_import() -> float:
        # Like for like with a decoration: one call, right after an import.
        _import_class(cached_path)
        return time_once(lambda: compile(source, "<bench>", "exec"), gc_off=True)

    def compiled_repeated() -> list[float]:
        per_round = max(1, cfg.compile_repeats // cfg.repeats)
        return [time_once(lambda: compile(source, "<bench>", "exec"), gc_off=True)
                for _ in range(per_round)]

    times: dict[str, list[float]] = {
        "uncached": [], "cached (memory)": [], "cached (disk)": [], "compile()": [],
        "compile() repeated": [],
    }
    for _ in range(cfg.repeats):
        # Interleaved, compile() too, so that a noisy moment (this machine's
        # speed drifts by 2x) does not land on one side of a ratio only.
        times["uncached"].append(uncached())
        times["compile()"].append(compiled_after_import())
        times["cached (memory)"].append(cached_memory())
        times["cached (disk)"].append(cached_disk())
        times["compile() repeated"].extend(compiled_repeated())
    return times


def run(smoke: bool = False) -> Report:
    cfg = SMOKE if smoke else FULL
    table = Table(
        "Scenario 5: decoration time as a ratio of compile() of the same source",
        ("class", "compile()", "kind", "@stateful", "vs compile()", "vs compile() repeated",
         "compile() repeated"),
    )
    report = Report(tables=[table])
    saved = os.environ.get("AUTOSTATE_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="autostate-bench-decoration-") as tmp:
        os.environ["AUTOSTATE_CACHE_DIR"] = str(Path(tmp) / "cache")
        try:
            for label, source in SOURCES.items():
                source = textwrap.dedent(source).lstrip()
                samples = _decoration_times(Path(tmp), source, cfg)
                times = {kind: statistics.median(ts) for kind, ts in samples.items()}
                compiled = times.pop("compile()")
                repeated = times.pop("compile() repeated")
                # Each round's decoration over the same round's compile(): this
                # machine's speed drifts, and a slow patch then lands on both.
                ratios = {
                    kind: statistics.median(
                        d / c for d, c in zip(samples[kind], samples["compile()"], strict=True)
                    )
                    for kind in times
                }
                for kind, seconds in times.items():
                    table.add(label, fmt_seconds(compiled), kind, fmt_seconds(seconds),
                              fmt_ratio(ratios[kind]), fmt_ratio(seconds / repeated),
                              fmt_seconds(repeated))
                report.targets.append(target_below(
                    "5", f"{label}: cached decoration within 2x of compile()",
                    ratios["cached (disk)"], 2.0,
                    f"in-memory cache {fmt_ratio(ratios['cached (memory)'])}, "
                    f"uncached {fmt_ratio(ratios['uncached'])}; "
                    f"{fmt_ratio(times['cached (disk)'] / repeated)} of compile() repeated",
                ))
        finally:
            if saved is None:
                os.environ.pop("AUTOSTATE_CACHE_DIR", None)
            else:
                os.environ["AUTOSTATE_CACHE_DIR"] = saved
            for name in [n for n in sys.modules if n.startswith("autostate_bench_decoration_")]:
                module = sys.modules.pop(name)
                if isinstance(module, types.ModuleType):
                    module.__dict__.clear()
    table.notes.append(
        f"median of {cfg.repeats} decorations of a freshly imported class, of {cfg.repeats} "
        "compile() calls each right after a fresh import of the file (the yardstick: the "
        f"conditions a decoration runs in) and of {cfg.compile_repeats} compile() calls "
        "repeated back to back (information), all interleaved, each with the collector paused "
        "(as timeit does); ratios are medians of per-round ratios to the round's compile(); "
        "import time is not counted; "
        "a decoration is @stateful and the install at the class's first use"
    )
    table.notes.append(
        "cached (disk) empties autostate's in-process cache first, as a new process would; "
        "the target (DESIGN section 7) uses it"
    )
    return report


def main(argv: list[str] | None = None) -> None:
    script_main(run, __doc__, argv)


if __name__ == "__main__":
    main()
