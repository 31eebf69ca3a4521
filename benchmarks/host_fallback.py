"""Scenario 5: what the host-callback fallback costs per state update.

One jitted step makes ``K`` updates of a scalar state, ``n = n * 0.5 + x``:

* **unrolled**: a Python loop in the method, run by the functional engine
  (``functionalize()``, the baseline), by ``fallback="host"`` (one ordered
  callback per read and per write) and by ``inference_mode`` (reads only);
* **fori_loop closure**: a closure that assigns ``self.n`` inside
  ``lax.fori_loop``, which only the fallback can run; its baseline is the same
  loop written by hand in pure JAX with the state as the carry.

A third unrolled row makes the same two ``io_callback``s per update by hand,
without autostate: the floor any callback design pays.

Printed per row: time per update, the ratio to the baseline, the Python
callbacks in the compiled program (``custom_call`` to XLA's Python callback)
and the callbacks run per update (counted as they run). The target is at most
one callback per state access: two per update (one read, one write). Every row
is checked against the baseline's numbers before it is timed.

Run: ``python benchmarks/host_fallback.py [--smoke]``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from _timing import Report, Table, Target, fmt_ratio, fmt_seconds, script_main, time_interleaved
from jax.experimental import io_callback

import autostate
from autostate import host


@dataclasses.dataclass(frozen=True)
class Config:
    updates: int = 100
    rounds: int = 11
    number: int = 10


FULL = Config()
SMOKE = Config(updates=4, rounds=1, number=1)

_CALLBACK = re.compile(r"custom_call_target=\"\w*python_\w*callback\"")


@autostate.stateful
class Functional:
    def __init__(self, updates):
        self.n = jnp.zeros(())
        self.updates = updates

    def run(self, x):
        for _ in range(self.updates):
            self.n = self.n * 0.5 + x
        return self.n


@autostate.stateful(fallback="host")
class Host:
    def __init__(self, updates):
        self.n = jnp.zeros(())
        self.updates = updates

    def run(self, x):
        for _ in range(self.updates):
            self.n = self.n * 0.5 + x
        return self.n

    def run_loop(self, x):
        def body(_i, carry):
            self.n = self.n * 0.5 + x
            return carry

        jax.lax.fori_loop(0, self.updates, body, 0)
        return self.n

    def predict(self, x):
        total = x
        for _ in range(self.updates):
            total = total * 0.5 + self.n
        return total


def compiled_callbacks(fn: Callable[..., Any], *args: Any) -> int:
    """Python callbacks in the compiled program of ``jax.jit(fn)(*args)``."""
    return len(_CALLBACK.findall(jax.jit(fn).lower(*args).compile().as_text()))


def _blocking(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    return lambda: jax.block_until_ready(fn(*args))


def _check(name: str, got: Any, want: Any) -> None:
    if not np.allclose(np.asarray(got), np.asarray(want), rtol=1e-5):
        raise AssertionError(f"{name} computed {got}, the baseline {want}")


def _callbacks_run(model: Any, call: Callable[[], Any]) -> int:
    before = host.callback_count(model)
    jax.block_until_ready(call())
    return host.callback_count(model) - before


def _raw_io_callback_step(k: int) -> Callable[..., Any]:
    """The floor: the same updates as two bare ``io_callback``s into a dict, no autostate."""
    store = {"n": np.zeros((), np.float32)}
    spec = jax.ShapeDtypeStruct((), np.float32)

    def write(value):
        store["n"] = value

    @jax.jit
    def step(x):
        for _ in range(k):
            n = io_callback(lambda: store["n"], spec, ordered=True)
            io_callback(write, None, n * 0.5 + x, ordered=True)
        return io_callback(lambda: store["n"], spec, ordered=True)

    return step


def run(smoke: bool = False) -> Report:
    cfg = SMOKE if smoke else FULL
    k = cfg.updates
    x = jnp.float32(1.0)

    # Unrolled: functional baseline, host fallback, inference mode.
    f, states = Functional(k).functionalize()
    functional_step = jax.jit(lambda f, s, x: f.run(s, x))
    model = Host(k)
    host_step = jax.jit(lambda m, x: m.run(x))
    raw_step = _raw_io_callback_step(k)
    frozen = autostate.inference_mode(model)
    predict_f, predict_states = Host(k).functionalize()
    functional_predict = jax.jit(lambda f, s, x: f.predict(s, x)[0])
    frozen_predict = jax.jit(lambda m, x: m.predict(x))

    want, states_after = functional_step(f, states, x)
    _check("host fallback (unrolled)", host_step(model, x), want)
    _check("host state after one step", model.n, states_after["n"])
    _check("bare io_callback", raw_step(x), want)
    model.n = jnp.zeros(())
    _check(
        "inference mode",
        frozen_predict(frozen, x),
        functional_predict(predict_f, predict_states, x),
    )

    # fori_loop closure: host fallback against the same loop with a carry.
    loop_model = Host(k)
    host_loop = jax.jit(lambda m, x: m.run_loop(x))

    @jax.jit
    def handwritten_loop(n, x):
        return jax.lax.fori_loop(0, k, lambda _i, n: n * 0.5 + x, n)

    _check(
        "host fallback (fori_loop)", host_loop(loop_model, x), handwritten_loop(jnp.zeros(()), x)
    )

    steps = {
        "functional": (functional_step, f, states, x),
        "host": (host_step, model, x),
        "raw": (raw_step, x),
        "functional predict": (functional_predict, predict_f, predict_states, x),
        "inference": (frozen_predict, frozen, x),
        "handwritten loop": (handwritten_loop, jnp.zeros(()), x),
        "host loop": (host_loop, loop_model, x),
    }
    times = time_interleaved(
        {name: _blocking(*step) for name, step in steps.items()},
        rounds=cfg.rounds,
        number=cfg.number,
    )
    in_program = {
        "functional": compiled_callbacks(lambda f, s, x: f.run(s, x), f, states, x),
        "host": compiled_callbacks(lambda m, x: m.run(x), model, x),
        "raw": compiled_callbacks(raw_step, x),
        "functional predict": compiled_callbacks(
            lambda f, s, x: f.predict(s, x)[0], predict_f, predict_states, x
        ),
        "inference": compiled_callbacks(lambda m, x: m.predict(x), frozen, x),
        "handwritten loop": compiled_callbacks(handwritten_loop, jnp.zeros(()), x),
        "host loop": compiled_callbacks(lambda m, x: m.run_loop(x), loop_model, x),
    }
    # Counted as they run; the step's final read of the state is not an update.
    run_per_update = {name: 0.0 for name in steps}
    run_per_update["raw"] = (in_program["raw"] - 1) / k
    run_per_update["host"] = (_callbacks_run(model, _blocking(*steps["host"])) - 1) / k
    run_per_update["inference"] = _callbacks_run(model, _blocking(*steps["inference"])) / k
    run_per_update["host loop"] = (
        _callbacks_run(loop_model, _blocking(*steps["host loop"])) - 1
    ) / k

    table = Table(
        f"Host-callback fallback: {k} state updates per jitted step",
        (
            "step",
            "engine",
            "time / update",
            "ratio to baseline",
            "callbacks in program",
            "callbacks run / update",
        ),
    )
    rows = [
        ("unrolled", "functional (baseline)", "functional", "functional"),
        ("unrolled", 'fallback="host"', "host", "functional"),
        ("unrolled", "bare io_callback, no autostate (floor)", "raw", "functional"),
        ("read-only", "functional (baseline)", "functional predict", "functional predict"),
        ("read-only", "inference_mode", "inference", "functional predict"),
        ("fori_loop closure", "pure JAX carry (baseline)", "handwritten loop", "handwritten loop"),
        ("fori_loop closure", 'fallback="host"', "host loop", "handwritten loop"),
    ]
    for step, engine, name, baseline in rows:
        table.add(
            step,
            engine,
            fmt_seconds(times[name].median / k),
            fmt_ratio(times[name].median / times[baseline].median),
            in_program[name],
            f"{run_per_update[name]:g}",
        )
    overhead = times["host"].median / times["raw"].median
    table.notes.append(
        "callbacks run / update: counted by autostate.host.callback_count as they run, minus "
        "the step's final read; one read and one write per update is 2. A fori_loop body "
        "appears once in the program and runs once per update."
    )
    table.notes.append(
        f"host fallback / bare io_callback = {overhead:.2f}x: nearly all of the cost is "
        "JAX's own io_callback (host transfer and Python dispatch per callback)."
    )
    worst = max(run_per_update["host"], run_per_update["host loop"])
    target = Target(
        "5",
        "host fallback: at most one callback per state access (2 per update)",
        worst / 2,
        worst <= 2,
        f"{worst:g} callbacks per update; inference mode {run_per_update['inference']:g}; "
        f"host / functional {times['host'].median / times['functional'].median:.0f}x",
    )
    return Report(tables=[table], targets=[target])


def main(argv: list[str] | None = None) -> None:
    script_main(run, __doc__, argv)


if __name__ == "__main__":
    main()
