"""Scenario 10: the model object as the API, the per-call cost of ``autostate.jit``.

A model of ``N`` tiny modules (a weight and a call counter each) and a jitted
step that calls it: the forward pass updates every counter. Per call, against
hand-written ``jax.jit`` of a function of dicts (parameters in, states in and
out):

* ``autostate.jit(step)(model, x)``: the model updated in place (flattened,
  called, written back, old arrays donated);
* ``jax.jit`` of ``f(states, x)``: the explicit layer beneath;
* ``jax.jit`` of ``pf(pstates, x)``: ``autostate.pack``'s buffers.

The issue's goal for ``autostate.jit`` is 0.5x hand-written at 100 and 1,000
modules; today it flattens the Python objects at every call, and the rows
say how far that is.

Run: ``python benchmarks/bench_model_api.py [--smoke]``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from _timing import (
    Report,
    Table,
    fmt_ratio,
    fmt_seconds,
    paired_ratio,
    script_main,
    target_below,
    time_interleaved,
)

import autostate

REFERENCE = "hand-written jax.jit"


@dataclasses.dataclass(frozen=True)
class Config:
    sizes: tuple[int, ...] = (100, 1000)
    rounds: int = 7
    number: int = 30


FULL = Config()
SMOKE = Config(sizes=(10,), rounds=2, number=3)


@autostate.stateful
class Tiny:
    def __init__(self, key: Any):
        self.w = jax.random.normal(key, (4,))
        self.count = jnp.zeros(())

    def __call__(self, x: Any) -> Any:
        self.count = self.count + 1.0
        return jnp.tanh(x * self.w)


@autostate.stateful
class Stack:
    def __init__(self, n: int):
        self.layers = [Tiny(k) for k in jax.random.split(jax.random.key(0), n)]

    def __call__(self, x: Any) -> Any:
        for layer in self.layers:
            x = layer(x)
        return x


def _cases(n: int) -> dict[str, Any]:
    x = jnp.ones(4)
    model = Stack(n)
    step = autostate.jit(lambda m, x: m(x).sum())

    ref = Stack(n)  # (the model's own arrays are donated by its calls)
    params = {f"layers[{i}].w": layer.w for i, layer in enumerate(ref.layers)}
    hand_states = [{f"layers[{i}].count": layer.count for i, layer in enumerate(ref.layers)}]

    @jax.jit
    def by_hand(params: dict, states: dict, x: Any) -> Any:
        new = {}
        for i in range(n):
            new[f"layers[{i}].count"] = states[f"layers[{i}].count"] + 1.0
            x = jnp.tanh(x * params[f"layers[{i}].w"])
        return x.sum(), new

    def hand() -> Any:
        out, hand_states[0] = by_hand(params, hand_states[0], x)
        return out

    f, states = Stack(n).functionalize()
    f_states = [states]
    jitted = jax.jit(lambda f, s, x: (lambda o: (o[0].sum(), o[1]))(f(s, x)))

    def through_f() -> Any:
        out, f_states[0] = jitted(f, f_states[0], x)
        return out

    pf, pstates = autostate.pack(*Stack(n).functionalize())
    p_states = [pstates]

    def packed() -> Any:
        out, p_states[0] = jitted(pf, p_states[0], x)
        return out

    # The same numbers first: every path's output after one call.
    outs = [float(fn()) for fn in (lambda: step(model, x), hand, through_f, packed)]
    assert max(outs) - min(outs) < 1e-5, outs
    return {
        "autostate.jit (in place)": lambda: step(model, x),
        REFERENCE: hand,
        "jax.jit of f": through_f,
        "jax.jit of pack": packed,
    }


def run(smoke: bool = False) -> Report:
    cfg = SMOKE if smoke else FULL
    report = Report()
    table = Table(
        f"Scenario 10: per-call cost of a jitted step on a model object ({jax.default_backend()})",
        ("modules", "path", "per call", f"vs {REFERENCE}"),
    )
    for n in cfg.sizes:
        cases = _cases(n)
        timings = time_interleaved(
            {name: (lambda fn=fn: jax.block_until_ready(fn())) for name, fn in cases.items()},
            rounds=cfg.rounds, number=cfg.number,
        )
        for name in cases:
            ratio = paired_ratio(timings[name], timings[REFERENCE])
            table.add(str(n), name, fmt_seconds(timings[name].median), fmt_ratio(ratio))
        ratio = paired_ratio(timings["autostate.jit (in place)"], timings[REFERENCE])
        report.targets.append(target_below(
            "10", f"autostate.jit at {n} modules within 0.5x of hand-written jax.jit", ratio, 0.5
        ))
    table.notes.append(
        f"median of {cfg.rounds} interleaved rounds of {cfg.number} calls, blocked on; every "
        "path's output checked equal first"
    )
    report.tables.append(table)
    return report


def main(argv: list[str] | None = None) -> None:
    script_main(run, __doc__, argv)


if __name__ == "__main__":
    main()
