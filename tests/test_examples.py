"""The examples run and print what the README says they print.

The full demo (10 epochs) is too slow for the suite; ``--smoke`` runs one
epoch on a subset, which exercises the same code.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def run_example(name: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_counter_prints_eager_functional_and_frozen_counts():
    assert run_example("counter.py").splitlines() == [
        "2.0 1",
        "4.0 {'count': Array(2, dtype=int32)}",
        "2",
    ]


def test_counter_is_the_readme_snippet():
    source = (EXAMPLES / "counter.py").read_text()
    code = source.split('"""', 2)[2].strip()  # without the module docstring
    readme = (ROOT / "README.md").read_text()
    assert f"```python\n{code}\n```" in readme


def test_demo_smoke_trains_and_lists_the_states():
    out = run_example("demo.py", "--smoke")
    assert re.search(r"^digits: 256 train / 360 test", out, re.M)
    match = re.search(r"^epoch  1  loss (\d+\.\d+)  test accuracy (\d+\.\d)%$", out, re.M)
    assert match, out
    assert 0 < float(match.group(1)) < 5
    assert re.search(r"^frozen MLP, called eagerly: test accuracy \d+\.\d%$", out, re.M)
    names = re.findall(r"^  (\S+) +\(128,\)$", out, re.M)
    assert names == [
        "blocks[0][1].mean",
        "blocks[0][1].var",
        "blocks[1][1].mean",
        "blocks[1][1].var",
    ]
