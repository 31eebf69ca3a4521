"""The examples run and print what the README says they print.

The full demo (10 epochs) is too slow for the suite; ``--smoke`` runs one
epoch on a subset, which exercises the same code.

Every example runs as ``__main__`` with its command line, one after another
in one fresh process (one start of JAX for all of them, with ``examples/`` on
``sys.path`` as ``python examples/NAME.py`` puts it there); each test reads
its example's output.
"""

from __future__ import annotations

import json
import re
import runpy
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

# Each example's arguments, in the order the process runs them.
RUNS: dict[str, list[str]] = {
    "counter.py": [],
    "demo.py": ["--smoke"],
    "tutorial_train.py": ["--smoke"],
    "tutorial_checkpoint.py": ["--smoke"],
    "tutorial_gpt.py": ["--smoke"],
    "tutorial_ensemble.py": ["--smoke"],
    "scaling_depth.py": ["--depths", "4", "--repeat", "1"],
}

# Runs each example as ``python examples/NAME.py ARGS`` would (``sys.argv``,
# ``__main__``, its folder first on ``sys.path``), its stdout captured; prints
# ``{name: {"out": ..., "error": traceback or None}}`` as JSON, last.
_RUNNER = """
import contextlib, io, json, runpy, sys, traceback
folder, runs = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, folder)
results = {}
for name, args in runs.items():
    out, error = io.StringIO(), None
    sys.argv = [f"{folder}/{name}", *args]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as e:
        error = None if e.code in (None, 0) else f"SystemExit({e.code!r})"
    except BaseException:
        error = traceback.format_exc()
    results[name] = {"out": out.getvalue(), "error": error}
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def example_outputs(once_per_session: Callable[..., Any]) -> dict[str, dict[str, str | None]]:
    def run(folder: Path) -> dict[str, dict[str, str | None]]:
        result = subprocess.run(
            [sys.executable, "-c", _RUNNER, str(EXAMPLES), json.dumps(RUNS)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout.strip().splitlines()[-1])

    return once_per_session("examples", run)


@pytest.fixture
def run_example(example_outputs: dict[str, dict[str, str | None]]) -> Callable[[str], str]:
    """What ``python examples/NAME`` with its ``RUNS`` arguments printed."""

    def output(name: str) -> str:
        result = example_outputs[name]
        assert result["error"] is None, result["error"]
        return result["out"]

    return output


def test_counter_prints_eager_functional_and_frozen_counts(run_example):
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


def test_demo_smoke_trains_and_lists_the_states(run_example):
    out = run_example("demo.py")
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


def test_tutorial_train_updates_one_model_with_masked_adamw_and_evaluates_it_with_running_statistics(run_example):
    out = run_example("tutorial_train.py")
    assert "eager call moved the running mean: True" in out
    assert "states: ['norm.num_batches_tracked', 'norm.running_mean', 'norm.running_var']" in out
    decayed = re.search(r"^weight decay on: \[(.*)\]$", out, re.M).group(1)
    assert "hidden.weight" in decayed and "head.weight" in decayed
    assert "norm" not in decayed and ".bias" not in decayed
    accuracies = [float(a) for a in re.findall(r"^epoch \d  loss \S+  test accuracy (\S+)%$", out, re.M)]
    assert len(accuracies) == 2 and accuracies[-1] > 80
    steps = 2 * (1347 // 64)  # two epochs of full batches of the 1,347 training digits
    assert f"steps: {steps}, the same sub-models: True" in out
    assert f"loaded Classifier, called eagerly: test accuracy {accuracies[-1]}%" in out
    assert out.endswith("ok\n")


def test_tutorial_checkpoint_resumes_exactly_from_an_abstract_target(run_example):
    out = run_example("tutorial_checkpoint.py")
    assert "kept steps [1, 4]" in out
    assert "restored step 4 into a FunctionalModel of Classifier" in out
    assert "max |resumed - uninterrupted| = 0.0e+00" in out
    assert out.endswith("ok\n")


def test_tutorial_gpt_decodes_greedily_with_the_cache_and_exports_the_loop(run_example):
    out = run_example("tutorial_gpt.py")
    assert "the loop over the blocks is one scan: True" in out
    assert re.search(r"^loss by step: 0: \d\.\d+, 30: .*, 119: 0\.0\d+$", out, re.M), out
    assert "compute float32, parameters and states ['float32']" in out
    assert "prompt [3, 4, 5] -> greedy [6, 7, 8, 9, 10, 11, 12, 13, 14, 15]" in out
    assert "cache length after decoding: 13" in out
    assert "cached decoding == full recompute: True" in out
    assert re.search(r"^exported \(\d+ bytes\): \[9, 10, 11\] -> \[12, 13, 14, 15, 0, 1, 2, 3, 4, 5\]$", out, re.M)
    assert "autostate.export prefill: next token 6 length 3" in out
    assert out.endswith("ok\n")


def test_tutorial_gpt_bf16_computes_in_bfloat16_and_keeps_float32_parameters():
    # `--smoke --bf16` takes about 40 s on CPU (bfloat16 is emulated there); the same
    # code for a few steps here. The option only picks Decoder's dtype.
    import jax
    import jax.numpy as jnp

    import autostate

    gpt = runpy.run_path(str(EXAMPLES / "tutorial_gpt.py"))  # defines; main() does not run
    f, empty = autostate.functionalize(gpt["Decoder"](jax.random.key(0), dtype=jnp.bfloat16))
    assert "bf16" in str(jax.make_jaxpr(f)(empty, jnp.arange(4)))
    f32, f32_empty = autostate.functionalize(gpt["Decoder"](jax.random.key(0)))
    logits, states = f(empty, jnp.arange(4))
    assert logits.dtype == jnp.float32 and states["blocks.attention.k"].dtype == jnp.float32
    reference, _ = f32(f32_empty, jnp.arange(4))
    assert 0 < float(jnp.abs(logits - reference).max()) < 0.05  # bf16 compute, close to float32
    trained, loss, curve = gpt["train"](f, empty, 12)
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(trained)} == {jnp.dtype(jnp.float32)}
    assert loss < curve[0] / 2  # it trains


def test_tutorial_ensemble_trains_members_apart_and_the_average_wins(run_example):
    out = run_example("tutorial_ensemble.py")
    assert "'members.hidden.weight': (4, 64, 64)" in out
    assert "'members.norm.running_mean': (4, 64)" in out
    members = [float(a) for a in re.findall(r"'(\d+\.\d)%'", out)]
    ensemble = float(re.search(r"^ensemble test accuracy: (\S+)%", out, re.M).group(1))
    assert len(members) == 4 and ensemble >= sum(members) / 4 - 0.05
    assert f"member 0 taken out of the stack, called eagerly: test accuracy {members[0]}%" in out
    assert out.endswith("ok\n")


def test_scaling_depth_times_five_forms_that_agree(run_example):
    # Every variant gives the same output (the script checks it); the loop over a
    # stack and both scans compile one loop, the list and the loop that cannot
    # roll none.
    out = run_example("scaling_depth.py")
    loops = dict(re.findall(r"^ +4  (.+?) +\S+ +\S+ +\S+ +\S+  (\d+)$", out, re.M))
    assert loops == {
        "stack, for loop": "1",
        "stack, lax.scan": "1",
        "stack, not rolled": "0",
        "list, for loop": "0",
        "pure JAX, lax.scan": "1",
    }, out
