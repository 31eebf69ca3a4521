"""Where one call of ``autostate.jit`` spends its host time, by part (issue 53's table).

Scenario 10's model (``bench_model_api``: ``N`` tiny modules, a weight and a
counter each) and its steps: forward, training with ``autostate.Optimizer``
(optax ``sgd``) and training with ``adamw`` (the moments are two trees shaped
like the model). Each part of ``Compiled._call`` is wrapped with a timer of
the calling thread's CPU time (a machine shared with other work moves wall
time far more): the arguments' flatten, the kept flatten's witness check, the
dispatch of the compiled program, the write-back of the rewritten attributes,
the witness's patch, keeping the entry, and the rest of the call (the per-leaf
gathers). Microseconds per call, the minimum over rounds. A profile, not a
benchmark row: no goal, nothing asserted.

Run: ``python benchmarks/profile_compiled_call.py [N]`` (default 100); run it
on two checkouts back to back to compare them.
"""

from __future__ import annotations

import collections
import gc
import sys
import time
from collections.abc import Callable
from typing import Any

import bench_model_api as scenario
import jax

import autostate
from autostate import compiled, graph

PARTS = ("arguments", "witness check", "dispatch", "write-back", "witness patch", "keep")
_spent: collections.Counter[str] = collections.Counter()


def _timed(part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            _spent[part] += time.thread_time_ns() - start

    return timed


def _instrument() -> None:
    compiled.Compiled._arguments = _timed("arguments", compiled.Compiled._arguments)  # type: ignore[method-assign]
    compiled.Compiled._kept_entry = _timed("witness check", compiled.Compiled._kept_entry)  # type: ignore[method-assign]
    graph.rewrite_attributes = _timed("write-back", graph.rewrite_attributes)
    graph.Witness.patch = _timed("witness patch", graph.Witness.patch)  # type: ignore[method-assign]
    compiled.Compiled._keep = _timed("keep", compiled.Compiled._keep)  # type: ignore[method-assign]
    compiled.Compiled._call = _timed("total", compiled.Compiled._call)  # type: ignore[method-assign]


def _profile(name: str, call: Callable[[], Any], step: compiled.Compiled,
             rounds: int = 15, number: int = 200) -> None:
    for _ in range(30):
        call()
    step._jitted = _timed("dispatch", step._jitted)  # type: ignore[assignment]
    found: dict[str, list[float]] = collections.defaultdict(list)
    for _ in range(rounds):
        _spent.clear()
        gc.disable()
        for _ in range(number):
            out = call()
        jax.block_until_ready(out)
        gc.enable()
        for part, ns in _spent.items():
            found[part].append(ns / number / 1000)
    best = {part: min(times) for part, times in found.items()}
    rest = best["total"] - sum(best.get(part, 0.0) for part in PARTS)
    row = "  ".join(f"{part} {best.get(part, 0.0):.0f}" for part in PARTS)
    print(f"{name}: {row}  rest {rest:.0f}  total {best['total']:.0f} (us per call)")


def _compiled_of(call: Callable[[], Any]) -> compiled.Compiled:
    cells = call.__closure__ or ()
    return next(c.cell_contents for c in cells if isinstance(c.cell_contents, compiled.Compiled))


def main(n: int) -> None:
    import optax  # type: ignore[import-untyped]

    _instrument()
    forward = scenario._forward_cases(n)[scenario.AUTOSTATE]
    _profile(f"forward, {n} modules", forward, _compiled_of(forward))
    training = scenario._training_cases(n)[scenario.AUTOSTATE]
    _profile(f"training (sgd), {n} modules", training, _compiled_of(training))

    model = scenario.Stack(n)
    opt = autostate.Optimizer(model, optax.adamw(scenario.LR))

    @autostate.jit
    def train_step(model: Any, opt: Any, x: Any, y: Any) -> Any:
        loss, grads = autostate.value_and_grad(
            lambda m, x, y: scenario._sq_error(m(x), y)
        )(model, x, y)
        opt.update(grads)
        return loss

    x, y = scenario._inputs()
    _profile(f"training (adamw), {n} modules", lambda: train_step(model, opt, x, y), train_step)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 100)
