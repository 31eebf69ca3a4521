"""Shared helpers for the benchmark scripts: fair timing, peer imports, tables.

Timing is the median of repeated rounds, and each round runs every
implementation once in a rotated order, so that a slow patch of the machine
(another process, a frequency change) is spread over all implementations
instead of landing on one. Callables passed in must block until their result
is ready (``jax.block_until_ready``), so that what is timed is one complete
step, dispatch and compute together.

Peer libraries are optional: ``optional_import`` turns a missing one into a
``PeerMissing`` that the scripts report as a "not installed" row.
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import importlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

# The pre-checks (each implementation's result against the reference before
# it is timed) follow the suite's one tolerance policy, tests/tolerance.py.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tolerance import tolerance, use_backend_precision  # noqa: E402

# Every benchmark script imports this module: their decorations cache in a
# temp dir, never in the user's home (bench_decoration sets its own per run),
# removed when the process exits.
if "AUTOSTATE_CACHE_DIR" not in os.environ:
    os.environ["AUTOSTATE_CACHE_DIR"] = tempfile.mkdtemp(prefix="autostate-bench-cache-")
    atexit.register(shutil.rmtree, os.environ["AUTOSTATE_CACHE_DIR"], ignore_errors=True)

NOT_INSTALLED = "not installed"


def assert_close(got: Any, want: Any, *, rtol: float = 1e-5, atol: float = 1e-6,
                 err_msg: str = "") -> None:
    """A pre-check: ``np.testing.assert_allclose`` at ``rtol``/``atol`` on CPU,
    at the accelerator's tolerance elsewhere (``tests/tolerance.py``)."""
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), **tolerance(rtol, atol),
                               err_msg=err_msg)


def checked_precision() -> None:
    """Full float32 matrix products on an accelerator (the suite's policy): a
    scenario whose pre-check compares float32 programs calls this first; on
    CPU it changes nothing."""
    use_backend_precision()


class PeerMissing(Exception):
    """A peer library a benchmark row needs is not installed."""


def optional_import(name: str) -> Any:
    """``importlib.import_module(name)``, or ``PeerMissing`` when it is absent."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise PeerMissing(f"{name} ({e})") from None


@dataclasses.dataclass
class Timing:
    """Median and spread (interquartile range) of one implementation's rounds, in seconds."""

    median: float
    iqr: float
    rounds: int
    samples: list[float] = dataclasses.field(default_factory=list, repr=False)


def paired_ratio(a: Timing, b: Timing) -> float:
    """Median over rounds of ``a``'s time divided by ``b``'s time in the same round.

    Both ran in the same round, close together, so a slow patch of the machine
    mostly cancels out of each ratio; the median then drops the rounds where
    it did not. Steadier than ``a.median / b.median`` on a shared machine.
    """
    return statistics.median(x / y for x, y in zip(a.samples, b.samples, strict=True))


def time_interleaved(
    fns: dict[str, Callable[[], Any]],
    *,
    rounds: int,
    number: int,
    warmup: int = 2,
    gc_off: bool = True,
) -> dict[str, Timing]:
    """Times each callable: ``rounds`` rounds of ``number`` calls, interleaved.

    Round ``r`` runs the implementations starting at index ``r mod n``, so each
    one runs first, in the middle and last equally often. By default garbage
    is collected before each sample and the collector is off while it runs,
    as ``timeit`` does; ``gc_off=False`` leaves the collector alone, so that
    collections land where they would in a program.

    **Returns:** ``{name: Timing}`` with the median time of one call.
    """
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    gc_was_enabled = gc.isenabled()
    try:
        for r in range(rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                fn = fns[name]
                if gc_off:
                    gc.collect()
                    gc.disable()
                start = time.perf_counter()
                for _ in range(number):
                    fn()
                samples[name].append((time.perf_counter() - start) / number)
                gc.enable()
    finally:
        if gc_was_enabled:
            gc.enable()
    return {name: _summarize(s) for name, s in samples.items()}


def time_once(fn: Callable[[], Any], *, gc_off: bool = False) -> float:
    """Wall time of one call (for first-call / compile measurements).

    ``gc_off=True`` pauses the collector during the call, as ``timeit`` does
    (without its ``gc.collect()`` first, which would leave a single call
    running on caches the full collection emptied): a pass that the
    allocations before it set off does not land on this call's time.
    """
    if not gc_off:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    finally:
        if was_enabled:
            gc.enable()


def median_of(fn: Callable[[], Any], repeats: int) -> float:
    """Median wall time of ``repeats`` separate calls (each timed alone)."""
    return statistics.median(time_once(fn) for _ in range(repeats))


def _summarize(samples: list[float]) -> Timing:
    if len(samples) >= 4:
        q = statistics.quantiles(samples, n=4)
        iqr = q[2] - q[0]
    else:
        iqr = max(samples) - min(samples)
    return Timing(statistics.median(samples), iqr, len(samples), samples)


# --- formatting -------------------------------------------------------------


def fmt_seconds(seconds: float | None) -> str:
    """``1.23 ms``, ``45.6 µs``, ``2.10 s``; ``-`` for None."""
    if seconds is None:
        return "-"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"


def fmt_ratio(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


@dataclasses.dataclass
class Table:
    """One result table: printed to the terminal and written to results.md."""

    title: str
    headers: Sequence[str]
    rows: list[Sequence[str]] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    def add(self, *cells: Any) -> None:
        self.rows.append([str(c) for c in cells])

    def to_markdown(self) -> str:
        lines = [f"### {self.title}", ""]
        lines.append("| " + " | ".join(self.headers) + " |")
        lines.append("|" + "|".join("---" for _ in self.headers) + "|")
        for row in self.rows:
            lines.append("| " + " | ".join(row) + " |")
        if self.notes:
            lines.append("")
            lines.extend(f"- {note}" for note in self.notes)
        return "\n".join(lines) + "\n"

    def to_text(self) -> str:
        widths = [len(h) for h in self.headers]
        for row in self.rows:
            widths = [max(w, len(c)) for w, c in zip(widths, row)]
        out = [self.title, "=" * len(self.title)]
        out.append("  ".join(h.ljust(w) for h, w in zip(self.headers, widths)))
        out.append("  ".join("-" * w for w in widths))
        for row in self.rows:
            out.append("  ".join(c.ljust(w) for c, w in zip(row, widths)))
        out.extend(f"  * {note}" for note in self.notes)
        return "\n".join(out) + "\n"


@dataclasses.dataclass
class Target:
    """A performance target: what was asked, the measured ratio, met or not."""

    scenario: str
    goal: str
    ratio: float | None
    met: bool | None
    detail: str = ""

    def cells(self) -> list[str]:
        status = "n/a" if self.met is None else ("met" if self.met else "NOT MET")
        return [self.scenario, self.goal, fmt_ratio(self.ratio), status, self.detail]


TARGET_HEADERS = ("scenario", "target", "ratio", "status", "detail")


def targets_table(targets: list[Target], title: str = "Targets") -> Table:
    table = Table(title, TARGET_HEADERS)
    for t in targets:
        table.rows.append(t.cells())
    return table


@dataclasses.dataclass
class Report:
    """What one scenario script returns: its tables, targets and plot data."""

    tables: list[Table] = dataclasses.field(default_factory=list)
    targets: list[Target] = dataclasses.field(default_factory=list)
    plot: dict[str, Any] | None = None

    def print(self) -> None:
        for table in self.tables:
            print(table.to_text())
        if self.targets:
            print(targets_table(self.targets).to_text())


def target_ratio(
    scenario: str, goal: str, numerator: float | None, denominator: float | None, limit: float,
    detail: str = "",
) -> Target:
    """A ``numerator / denominator < limit`` target (n/a when a side is missing)."""
    if numerator is None or denominator is None:
        return target_below(scenario, goal, None, limit, detail)
    return target_below(scenario, goal, numerator / denominator, limit, detail)


def target_below(
    scenario: str, goal: str, ratio: float | None, limit: float, detail: str = ""
) -> Target:
    """A ``ratio < limit`` target (n/a when the ratio could not be measured)."""
    if ratio is None:
        return Target(scenario, goal, None, None, detail or NOT_INSTALLED)
    return Target(scenario, goal, ratio, ratio < limit, detail)


def script_main(
    run: Callable[[bool], Report], doc: str, argv: list[str] | None = None
) -> None:
    """Command line of one scenario script: ``python bench_x.py [--smoke]``."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one round")
    run(parser.parse_args(argv).smoke).print()
