"""Smoke runs of ``benchmarks/``: every scenario at tiny sizes, so that none can rot.

Each script checks that its implementations compute the same numbers before
timing them, so a smoke run exercises those checks for autostate and
hand-written JAX (and for whichever peer libraries happen to be installed).
Nothing here asserts a timing: the numbers of a smoke run mean nothing.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

SCENARIOS = {
    "bench_mlp": ["Scenario 1: BatchNorm-MLP training step", "Scenario 4a"],
    "bench_dispatch": ["Scenario 2: dispatch of a jitted step", "Scenario 4b"],
    "bench_scaling": ["Scenario 3: structure at scale", "functionalize() / freeze()", "Scenario 3c"],
    "bench_decoration": ["Scenario 5: decoration time", "cached (memory)"],
    "bench_control_flow": ["Scenario 6: state written inside lax.scan", "hand-threaded JAX"],
    "bench_donation": ["Scenario 7: donated KV-cache decode step", "states donated"],
    "bench_perf": ["Scenario 7a: trace-only time", "Scenario 7e: dispatch", "packed"],
    "bench_nn": ["Scenario 8a: ResNet-18-style training step", "Scenario 8b: GPT block training step"],
    "bench_stacked": ["Scenario 9: stacked sub-models inside methods", "scanned decoder"],
    "bench_model_api": ["Scenario 10: per-call cost of a jitted step", "autostate.jit (in place)",
                        "Scenario 10b: per-call cost of a jitted training step",
                        "Scenario 10c: peak memory of a donated decode step"],
    "bench_depth": ["Scenario 11: depth, a jitted decode step of a GPT decoder",
                    "Scenario 11: depth, 4 residual tanh layers", "loop over a stack"],
}


# ``run_all.py --only`` groups, each one smoke run (the scenarios of a group
# in processes of their own, one after another, as ``make bench`` runs them):
# three tests that the suite's workers share rather than one that holds a
# worker for every scenario in a row.
GROUPS = {
    "steps": ["mlp", "dispatch", "scaling", "decoration", "control_flow", "nn"],
    "depth": ["stacked", "depth"],
    "calls": ["donation", "perf", "model_api"],
}


def test_the_groups_cover_every_scenario_once() -> None:
    groups = [key for keys in GROUPS.values() for key in keys]
    assert len(groups) == len(set(groups)) == len(SCENARIOS)


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_every_scenario_runs_at_smoke_size_and_writes_results(group: str, tmp_path: Path) -> None:
    """A ``run_all.py --smoke --only ...`` of ``group``: its scripts' tables,
    the summary, results.md, and the plot of the scaling or depth scenario."""
    keys = GROUPS[group]
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "run_all.py"), "--smoke", "--out", str(tmp_path),
         "--only", *keys],
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = result.stdout
    assert result.returncode == 0, f"run_all.py failed:\n{out}\n{result.stderr}"
    for key in keys:
        scenario = f"bench_{key}"
        assert f"[{scenario}: " in out, scenario
        for text in SCENARIOS[scenario]:
            assert text in out, (scenario, text)
    assert "Targets (summary)" in out
    results = (tmp_path / "results.md").read_text()
    assert results.startswith("# autostate benchmarks")
    assert "mode: smoke" in results
    plotted = importlib.util.find_spec("matplotlib") is not None
    if group == "steps":
        for title in ("### Targets (summary)", "### Scenario 1:", "### Scenario 2:",
                      "### Scenario 4b:", "### Scenario 5:", "### Scenario 8a:"):
            assert title in results
        # The host fallback rows follow the decoration scenario, with their target.
        assert "host fallback: at most one callback per state access" in results
        assert "callbacks run / update" in results
        assert not plotted or (tmp_path / "scaling.png").stat().st_size > 0
    if group == "depth":
        assert not plotted or (tmp_path / "depth.png").stat().st_size > 0


def test_a_scenario_script_runs_on_its_own() -> None:
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_dispatch.py"), "--smoke"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"bench_dispatch.py failed:\n{result.stdout}\n{result.stderr}"
    for text in (*SCENARIOS["bench_dispatch"], "autostate", "Targets"):
        assert text in result.stdout


def test_run_all_smoke_writes_nothing_without_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """A smoke run without ``--out`` writes no file (the scenarios themselves
    are stood in for: what is checked is where the results go)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        run_all = importlib.import_module("run_all")
        timing = importlib.import_module("_timing")
    finally:
        sys.path.remove(str(BENCHMARKS))
    monkeypatch.setattr(run_all, "_in_this_process", lambda module, smoke: (
        (None, "no host fallback here") if module == "host_fallback" else timing.Report()
    ))
    outputs = [BENCHMARKS / "results.md", BENCHMARKS / "scaling.png", BENCHMARKS / "depth.png"]

    def stamps() -> list[float | None]:
        return [p.stat().st_mtime if p.exists() else None for p in outputs]

    before = stamps()
    assert run_all.main(["--smoke"]) == 0
    assert stamps() == before
