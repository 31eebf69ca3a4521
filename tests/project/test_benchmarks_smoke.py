"""Smoke runs of ``benchmarks/``: every script at tiny sizes, so that none can rot.

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

SCRIPTS = {
    "bench_mlp.py": ["Scenario 1: BatchNorm-MLP training step", "Scenario 4a"],
    "bench_dispatch.py": ["Scenario 2: dispatch of a jitted step", "Scenario 4b"],
    "bench_scaling.py": ["Scenario 3: structure at scale", "functionalize() / freeze()", "Scenario 3c"],
    "bench_decoration.py": ["Scenario 5: decoration time", "cached (memory)"],
    "bench_control_flow.py": ["Scenario 6: state written inside lax.scan", "hand-threaded JAX"],
    "bench_donation.py": ["Scenario 7: donated KV-cache decode step", "states donated"],
    "bench_perf.py": ["Scenario 7a: trace-only time", "Scenario 7e: dispatch", "packed"],
    "bench_nn.py": ["Scenario 8a: ResNet-18-style training step", "Scenario 8b: GPT block training step"],
}


def run_script(script: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--smoke", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"{script} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_script_runs_at_smoke_size(script: str, tmp_path: Path) -> None:
    args: list[str] = []
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    if script == "bench_scaling.py" and has_matplotlib:
        args = ["--plot", str(tmp_path / "scaling.png")]
    out = run_script(script, *args)
    for expected in SCRIPTS[script]:
        assert expected in out
    assert "autostate" in out
    assert "Targets" in out
    if args:
        assert (tmp_path / "scaling.png").stat().st_size > 0


def test_run_all_writes_results(tmp_path: Path) -> None:
    out = run_script("run_all.py", "--out", str(tmp_path), "--only", "dispatch", "decoration")
    assert "Targets (summary)" in out
    results = (tmp_path / "results.md").read_text()
    assert results.startswith("# autostate benchmarks")
    assert "mode: smoke" in results
    for title in ("### Targets (summary)", "### Scenario 2:", "### Scenario 4b:", "### Scenario 5:"):
        assert title in results
    # The host fallback rows follow the decoration scenario, with their target.
    assert "host fallback: at most one callback per state access" in results
    assert "callbacks run / update" in results


def test_run_all_smoke_writes_nothing_without_out() -> None:
    outputs = [BENCHMARKS / "results.md", BENCHMARKS / "scaling.png"]

    def stamps() -> list[float | None]:
        return [p.stat().st_mtime if p.exists() else None for p in outputs]

    before = stamps()
    run_script("run_all.py", "--only", "decoration")
    assert stamps() == before
