"""Runs every benchmark scenario and writes the results (``make bench``).

Each scenario module has ``run(smoke) -> Report``; this prints each report,
collects every target into one summary, and writes ``results.md``, the
scaling plot ``scaling.png`` and the depth plot ``depth.png`` into ``--out``
(default: this directory for a full run; a ``--smoke`` run writes files
only when ``--out`` is given, so that the test suite never overwrites real
results).

Each scenario runs in a fresh process of its own: the heap one scenario
leaves (the 10,000-module models of the scaling scenario) would otherwise be
walked by every garbage collection of the scenarios after it, and land in
their timings. A ``--smoke`` run, whose numbers mean nothing, runs them in
its own process, one after another: it pays for starting Python and JAX
once, not once per scenario.

Run: ``python benchmarks/run_all.py [--smoke] [--out DIR] [--only NAME ...]``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import os
import pickle
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import jax  # noqa: E402
from _timing import Report, Table, targets_table  # noqa: E402

SCENARIOS = {
    "mlp": "bench_mlp",
    "dispatch": "bench_dispatch",
    "scaling": "bench_scaling",
    "decoration": "bench_decoration",
    "control_flow": "bench_control_flow",
    "donation": "bench_donation",
    "perf": "bench_perf",
    "nn": "bench_nn",
    "stacked": "bench_stacked",
    "model_api": "bench_model_api",
    "depth": "bench_depth",
}
PACKAGES = ("autostate", "jax", "jaxlib", "flax", "equinox", "dm-haiku", "penzai", "optax")


# --- HOOK: host fallback rows (scenario 5) -----------------------------------
# benchmarks/host_fallback.py is written separately. When it exists, run_all
# imports it and calls ``run(smoke=...)``, which may return a Report, a Table
# or a list of Tables; its rows are added after the decoration scenario. Until
# it exists, results.md says so instead of inventing rows.
def host_fallback_report(smoke: bool) -> tuple[Report | None, str]:
    if not (HERE / "host_fallback.py").exists():
        return None, "host fallback rows: benchmarks/host_fallback.py is not there yet (hook)"
    module = importlib.import_module("host_fallback")
    result = module.run(smoke=smoke)
    if isinstance(result, Report):
        return result, ""
    if isinstance(result, Table):
        return Report(tables=[result]), ""
    if isinstance(result, list) and all(isinstance(t, Table) for t in result):
        return Report(tables=result), ""
    raise TypeError(
        f"host_fallback.run returned {type(result).__name__}; "
        "return a _timing.Report, a Table or a list of Tables"
    )


def autostate_revision() -> str:
    """The commit benchmarked, and whether autostate/ had uncommitted changes."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE,
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "../autostate"], cwd=HERE,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git)"
    return head + (" + uncommitted changes in autostate/" if dirty else "")


def environment(smoke: bool) -> list[str]:
    versions = []
    for package in PACKAGES:
        try:
            versions.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{package} not installed")
    device = jax.devices()[0]
    return [
        f"date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"mode: {'smoke (tiny sizes, one round: the numbers mean nothing)' if smoke else 'full'}",
        f"python {platform.python_version()} on {platform.platform()}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        "load average at start " + ", ".join(f"{x:.1f}" for x in os.getloadavg()),
        f"jax backend: {jax.default_backend()} ({device.device_kind}, {jax.device_count()} device(s))",
        "packages: " + ", ".join(versions),
        f"autostate revision: {autostate_revision()}",
    ]


def write_markdown(path: Path, env: list[str], reports: list[Report], notes: list[str]) -> None:
    parts = ["# autostate benchmarks", "", "Written by `benchmarks/run_all.py` (`make bench`).", ""]
    parts += [f"- {line}" for line in env]
    parts.append("")
    targets = [t for r in reports for t in r.targets]
    parts.append(targets_table(targets, "Targets (summary)").to_markdown())
    for report in reports:
        for table in report.tables:
            parts.append(table.to_markdown())
    if notes:
        parts.append("### Notes\n")
        parts += [f"- {note}" for note in notes]
        parts.append("")
    path.write_text("\n".join(parts))


def _in_fresh_process(module_name: str, smoke: bool) -> object:
    """What ``module_name``'s ``run(smoke)`` returns, run in a process of its own
    (``host_fallback``: what ``host_fallback_report`` returns)."""
    with tempfile.TemporaryDirectory(prefix="autostate-bench-run-") as tmp:
        result = Path(tmp) / "result.pickle"
        command = [sys.executable, str(Path(__file__).resolve()), "--child", module_name, str(result)]
        subprocess.run(command + (["--smoke"] if smoke else []), check=True)
        return pickle.loads(result.read_bytes())


def _in_this_process(module_name: str, smoke: bool) -> object:
    """What ``module_name``'s ``run(smoke)`` returns (``host_fallback``: what
    ``host_fallback_report`` returns), run here."""
    if module_name == "host_fallback":
        return host_fallback_report(smoke)
    return importlib.import_module(module_name).run(smoke=smoke)


def _child(module_name: str, result: Path, smoke: bool) -> int:
    result.write_bytes(pickle.dumps(_in_this_process(module_name, smoke)))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one round each")
    parser.add_argument("--out", type=Path, help="directory for results.md, scaling.png and depth.png")
    parser.add_argument("--only", nargs="+", choices=sorted(SCENARIOS), help="run only these")
    parser.add_argument("--child", nargs=2, metavar=("MODULE", "RESULT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return _child(args.child[0], Path(args.child[1]), args.smoke)
    out = args.out if args.out is not None else (None if args.smoke else HERE)
    run_scenario = _in_this_process if args.smoke else _in_fresh_process

    reports: list[Report] = []
    notes: list[str] = []
    scaling: Report | None = None
    depth: Report | None = None
    for key, module_name in SCENARIOS.items():
        if args.only and key not in args.only:
            continue
        start = time.perf_counter()
        report = run_scenario(module_name, args.smoke)
        assert isinstance(report, Report), module_name
        report.print()
        print(f"[{module_name}: {time.perf_counter() - start:.1f} s]\n", flush=True)
        reports.append(report)
        if key == "scaling":
            scaling = report
        if key == "depth":
            depth = report
        if key == "decoration":
            host, why_not = run_scenario("host_fallback", args.smoke)  # type: ignore[misc]
            if host is not None:
                host.print()
                reports.append(host)
            else:
                notes.append(why_not)
                print(why_not, "\n")

    targets = [t for r in reports for t in r.targets]
    print(targets_table(targets, "Targets (summary)").to_text())
    if out is None:
        return 0
    out.mkdir(parents=True, exist_ok=True)
    if scaling is not None and scaling.plot is not None:
        import bench_scaling

        png = out / "scaling.png"
        why_not = bench_scaling.plot(scaling.plot, str(png))
        notes.append(f"scaling plot not written: {why_not}" if why_not else
                     f"scaling plot: [{png.name}]({png.name})")
    if depth is not None and depth.plot is not None:
        import bench_depth

        png = out / "depth.png"
        why_not = bench_depth.plot(depth.plot, str(png))
        notes.append(f"depth plot not written: {why_not}" if why_not else
                     f"depth plot: [{png.name}]({png.name})")
    write_markdown(out / "results.md", environment(args.smoke), reports, notes)
    print(f"wrote {out / 'results.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
