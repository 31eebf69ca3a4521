"""Scenario 2 (and half of 4): per-call dispatch of a jitted step on many tiny modules.

The model: ``n`` stacked tiny modules, each with two parameters (``w``, ``b``)
and two states (``count``, ``total``) of shape ``(4,)``; a call updates both
states of every module and returns ``x * w + b`` chained through the stack.
The compiled program is trivial, so the per-call time is what each library's
Python side costs around ``jax.jit``: flattening the model and the states into
leaves, checking the cache, and unflattening the outputs.

Each implementation is checked against the hand-written step (output and
every state after two calls) before it is timed.

Run: ``python benchmarks/bench_dispatch.py [--smoke]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from _jaxpr import zero_overhead_table
from _timing import (
    NOT_INSTALLED,
    PeerMissing,
    Report,
    Table,
    fmt_ratio,
    fmt_seconds,
    optional_import,
    paired_ratio,
    script_main,
    target_below,
    time_interleaved,
)

import autostate

SIZE = 4


@dataclasses.dataclass(frozen=True)
class Config:
    modules: int = 100
    rounds: int = 30
    number: int = 50


FULL = Config()
SMOKE = Config(modules=3, rounds=1, number=1)


def canonical_init(cfg: Config, seed: int = 0) -> tuple[list[dict[str, np.ndarray]], np.ndarray]:
    rng = np.random.default_rng(seed)
    params = [
        {
            "w": (1 + 0.01 * rng.standard_normal(SIZE)).astype(np.float32),
            "b": (0.01 * rng.standard_normal(SIZE)).astype(np.float32),
        }
        for _ in range(cfg.modules)
    ]
    return params, rng.standard_normal(SIZE).astype(np.float32)


class Dispatcher:
    """One implementation: ``call()`` runs the jitted step once and returns its output."""

    def call(self) -> jax.Array:
        raise NotImplementedError

    def states(self) -> list[dict[str, Any]]:
        """``[{"count": ..., "total": ...}]`` per module, in stack order."""
        raise NotImplementedError

    def jaxpr(self) -> Any:
        raise NotImplementedError

    def jit_io(self) -> tuple[tuple, Any] | None:
        """``(arguments, outputs)`` of the last call, where the row calls ``jax.jit`` itself.

        ``None`` where the library wraps ``jax.jit`` (``nnx.jit``, ``filter_jit``)
        and its own Python work cannot be told apart from the pytree work.
        """
        return None


# --- hand-written JAX -------------------------------------------------------


def handwritten_step(params, states, x):
    new_states = {}
    for i in range(len(params)):
        p, s = params[f"layer_{i}"], states[f"layer_{i}"]
        new_states[f"layer_{i}"] = {"count": s["count"] + 1.0, "total": s["total"] + x}
        x = x * p["w"] + p["b"]
    return x, new_states


class HandwrittenDispatcher(Dispatcher):
    def __init__(self, params, x):
        self.params = {f"layer_{i}": jax.tree.map(jnp.asarray, p) for i, p in enumerate(params)}
        self._states = {
            f"layer_{i}": {"count": jnp.zeros(SIZE), "total": jnp.zeros(SIZE)}
            for i in range(len(params))
        }
        self._step = jax.jit(handwritten_step)
        self.x = jnp.asarray(x)

    def call(self):
        self._out = self._step(self.params, self._states, self.x)
        y, self._states = self._out
        return y

    def jit_io(self):
        return (self.params, self._states, self.x), self._out

    def states(self):
        return [self._states[f"layer_{i}"] for i in range(len(self.params))]

    def jaxpr(self):
        return jax.make_jaxpr(self._step)(self.params, self._states, self.x)


# --- autostate --------------------------------------------------------------


@autostate.stateful
class Tiny:
    def __init__(self, w, b):
        self.w = jnp.asarray(w)
        self.b = jnp.asarray(b)
        self.count = jnp.zeros(SIZE)
        self.total = jnp.zeros(SIZE)

    def __call__(self, x):
        self.count = self.count + 1.0
        self.total = self.total + x
        return x * self.w + self.b


@autostate.stateful
class Stack:
    def __init__(self, layers):
        self.layers = layers

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def autostate_model(params) -> Stack:
    return Stack([Tiny(p["w"], p["b"]) for p in params])


class AutostateDispatcher(Dispatcher):
    def __init__(self, params, x):
        self.f, self._states = autostate_model(params).functionalize()
        self._step = jax.jit(lambda f, s, x: f(s, x))
        self.x = jnp.asarray(x)
        self.n = len(params)

    def call(self):
        self._out = self._step(self.f, self._states, self.x)
        y, self._states = self._out
        return y

    def jit_io(self):
        return (self.f, self._states, self.x), self._out

    def states(self):
        s = self._states
        return [
            {"count": s[f"layers[{i}].count"], "total": s[f"layers[{i}].total"]}
            for i in range(self.n)
        ]

    def jaxpr(self):
        return jax.make_jaxpr(self._step)(self.f, self._states, self.x)


# --- Flax NNX ---------------------------------------------------------------


def nnx_model(params):
    nnx = optional_import("flax.nnx")

    class NNXTiny(nnx.Module):
        def __init__(self, w, b):
            self.w = nnx.Param(jnp.asarray(w))
            self.b = nnx.Param(jnp.asarray(b))
            self.count = nnx.BatchStat(jnp.zeros(SIZE))
            self.total = nnx.BatchStat(jnp.zeros(SIZE))

        def __call__(self, x):
            self.count[...] += 1.0
            self.total[...] += x
            return x * self.w[...] + self.b[...]

    class NNXStack(nnx.Module):
        def __init__(self, params):
            self.layers = nnx.List([NNXTiny(p["w"], p["b"]) for p in params])

        def __call__(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    return nnx, NNXStack(params)


def _nnx_states(model):
    return [{"count": m.count[...], "total": m.total[...]} for m in model.layers]


class NNXJitDispatcher(Dispatcher):
    def __init__(self, params, x):
        nnx, self.model = nnx_model(params)
        self._step = nnx.jit(lambda model, x: model(x))
        self.x = jnp.asarray(x)

    def call(self):
        return self._step(self.model, self.x)

    def states(self):
        return _nnx_states(self.model)


class NNXSplitMergeDispatcher(Dispatcher):
    def __init__(self, params, x):
        self.nnx, self.model = nnx_model(params)
        nnx = self.nnx
        self.graphdef, self.state = nnx.split(self.model)

        @jax.jit
        def step(graphdef, state, x):
            model = nnx.merge(graphdef, state)
            y = model(x)
            return y, nnx.state(model)

        self._step = step
        self.x = jnp.asarray(x)

    def call(self):
        self._out = self._step(self.graphdef, self.state, self.x)
        y, self.state = self._out
        return y

    def jit_io(self):
        return (self.graphdef, self.state, self.x), self._out

    def states(self):
        self.nnx.update(self.model, self.state)
        return _nnx_states(self.model)


# --- Equinox ----------------------------------------------------------------


class EquinoxDispatcher(Dispatcher):
    def __init__(self, params, x):
        eqx = optional_import("equinox")

        class EqxTiny(eqx.Module):
            w: jax.Array
            b: jax.Array
            count: eqx.nn.StateIndex
            total: eqx.nn.StateIndex

            def __init__(self, w, b):
                self.w, self.b = jnp.asarray(w), jnp.asarray(b)
                self.count = eqx.nn.StateIndex(jnp.zeros(SIZE))
                self.total = eqx.nn.StateIndex(jnp.zeros(SIZE))

            def __call__(self, x, state):
                state = state.set(self.count, state.get(self.count) + 1.0)
                state = state.set(self.total, state.get(self.total) + x)
                return x * self.w + self.b, state

        class EqxStack(eqx.Module):
            layers: list

            def __init__(self, params):
                self.layers = [EqxTiny(p["w"], p["b"]) for p in params]

            def __call__(self, x, state):
                for layer in self.layers:
                    x, state = layer(x, state)
                return x, state

        self.model, self.state = eqx.nn.make_with_state(EqxStack)(params)
        self._step = eqx.filter_jit(lambda model, state, x: model(x, state))
        self.x = jnp.asarray(x)

    def call(self):
        y, self.state = self._step(self.model, self.state, self.x)
        return y

    def states(self):
        return [
            {"count": self.state.get(m.count), "total": self.state.get(m.total)}
            for m in self.model.layers
        ]


# --- Haiku ------------------------------------------------------------------


class HaikuDispatcher(Dispatcher):
    def __init__(self, params, x):
        hk = optional_import("haiku")

        class HkTiny(hk.Module):
            def __call__(self, x):
                w = hk.get_parameter("w", [SIZE], init=jnp.ones)
                b = hk.get_parameter("b", [SIZE], init=jnp.zeros)
                count = hk.get_state("count", [SIZE], init=jnp.zeros)
                total = hk.get_state("total", [SIZE], init=jnp.zeros)
                hk.set_state("count", count + 1.0)
                hk.set_state("total", total + x)
                return x * w + b

        def forward(x):
            for i in range(len(params)):
                x = HkTiny(name=f"tiny_{i}")(x)
            return x

        model = hk.transform_with_state(forward)
        hk_params, self.state = model.init(jax.random.PRNGKey(0), jnp.asarray(x))
        self.params = {
            f"tiny_{i}": {"w": jnp.asarray(p["w"]), "b": jnp.asarray(p["b"])}
            for i, p in enumerate(params)
        }
        assert set(self.params) == set(hk_params)
        self._step = jax.jit(model.apply)
        self.x = jnp.asarray(x)
        self.n = len(params)

    def call(self):
        self._out = self._step(self.params, self.state, None, self.x)
        y, self.state = self._out
        return y

    def jit_io(self):
        return (self.params, self.state, None, self.x), self._out

    def states(self):
        return [dict(self.state[f"tiny_{i}"]) for i in range(self.n)]


# --- penzai v1 --------------------------------------------------------------


def penzai_model(params):
    optional_import("penzai")
    pz = optional_import("penzai.deprecated.v1.pz")

    @pz.pytree_dataclass
    class PzTiny(pz.Layer):
        w: pz.nn.ParameterLike
        b: pz.nn.ParameterLike
        count: pz.de.LocalStateEffect
        total: pz.de.LocalStateEffect

        @classmethod
        def from_config(cls, name, w, b):
            return cls(
                w=pz.nn.Parameter(jnp.asarray(w), f"{name}.w"),
                b=pz.nn.Parameter(jnp.asarray(b), f"{name}.b"),
                count=pz.de.InitialLocalStateRequest(
                    lambda: jnp.zeros(SIZE), category="tiny", name=f"{name}.count"
                ),
                total=pz.de.InitialLocalStateRequest(
                    lambda: jnp.zeros(SIZE), category="tiny", name=f"{name}.total"
                ),
            )

        def __call__(self, x):
            self.count.set(self.count.get() + 1.0)
            self.total.set(self.total.get() + x)
            return x * self.w.value + self.b.value

    model = pz.nn.Sequential(
        [PzTiny.from_config(f"tiny_{i}", p["w"], p["b"]) for i, p in enumerate(params)]
    )
    return pz, model


class PenzaiDispatcher(Dispatcher):
    def __init__(self, params, x):
        pz, model = penzai_model(params)
        self.handled, self._states = pz.de.handle_local_states(model, category="tiny")
        self._step = jax.jit(lambda handled, states, x: handled((x, states)))
        self.x = jnp.asarray(x)
        self.n = len(params)

    def call(self):
        self._out = self._step(self.handled, self._states, self.x)
        y, self._states = self._out
        return y

    def jit_io(self):
        return (self.handled, self._states, self.x), self._out

    def states(self):
        s = self._states
        return [{"count": s[f"tiny_{i}.count"], "total": s[f"tiny_{i}.total"]} for i in range(self.n)]


# --- the scenario -----------------------------------------------------------

IMPLEMENTATIONS: dict[str, Callable[..., Dispatcher]] = {
    "hand-written JAX (dicts)": HandwrittenDispatcher,
    "autostate": AutostateDispatcher,
    "Flax NNX (nnx.jit)": NNXJitDispatcher,
    "Flax NNX (split/merge + jax.jit)": NNXSplitMergeDispatcher,
    "Equinox (make_with_state, filter_jit)": EquinoxDispatcher,
    "Haiku (transform_with_state)": HaikuDispatcher,
    "penzai v1 (local-state effect)": PenzaiDispatcher,
}
REFERENCE = "hand-written JAX (dicts)"
MUST_BEAT = (
    "Flax NNX (nnx.jit)",
    "Flax NNX (split/merge + jax.jit)",
    "Equinox (make_with_state, filter_jit)",
    "Haiku (transform_with_state)",
)


def check_same_numbers(name: str, d: Dispatcher, expected: tuple, calls: int = 2) -> None:
    outputs = [np.asarray(d.call()) for _ in range(calls)]
    exp_outputs, exp_states = expected
    np.testing.assert_allclose(outputs, exp_outputs, rtol=1e-6, err_msg=f"{name}: output")
    got = d.states()
    assert len(got) == len(exp_states), f"{name}: number of modules"
    for i, (g, w) in enumerate(zip(got, exp_states)):
        for key in ("count", "total"):
            np.testing.assert_allclose(
                np.asarray(g[key]), w[key], rtol=1e-6, err_msg=f"{name}: layer {i} {key}"
            )


def pytree_work(d: Dispatcher) -> Callable[[], Any] | None:
    """What jax.jit does to the arguments and outputs of one call, without running it."""
    io = d.jit_io()
    if io is None:
        return None
    args, outputs = io
    out_leaves, out_def = jax.tree_util.tree_flatten(outputs)

    def work() -> None:
        jax.tree_util.tree_flatten(args)
        jax.tree_util.tree_unflatten(out_def, out_leaves)

    return work


def run(smoke: bool = False) -> Report:
    cfg = SMOKE if smoke else FULL
    params, x = canonical_init(cfg)
    reference = HandwrittenDispatcher(params, x)
    expected_outputs = [np.asarray(reference.call()) for _ in range(2)]
    expected = (expected_outputs, jax.tree.map(np.asarray, reference.states()))

    dispatchers: dict[str, Dispatcher] = {}
    missing: dict[str, str] = {}
    for name, make in IMPLEMENTATIONS.items():
        try:
            dispatcher = make(params, x)
        except PeerMissing as e:
            missing[name] = str(e)
            continue
        check_same_numbers(name, dispatcher, expected)
        dispatchers[name] = dispatcher

    timings = time_interleaved(
        {name: (lambda d=d: jax.block_until_ready(d.call())) for name, d in dispatchers.items()},
        rounds=cfg.rounds,
        number=cfg.number,
    )
    pytree_fns = {name: pytree_work(d) for name, d in dispatchers.items()}
    pytree = time_interleaved(
        {name: fn for name, fn in pytree_fns.items() if fn is not None},
        rounds=cfg.rounds,
        number=cfg.number * 4,
    )
    base = timings[REFERENCE]
    mine = timings["autostate"]
    table = Table(
        f"Scenario 2: dispatch of a jitted step, {cfg.modules} tiny modules "
        f"(2 params + 2 states of shape ({SIZE},) each, {jax.default_backend()})",
        ("implementation", "per call", "± IQR", "vs hand-written", "autostate vs it",
         "pytree work", "vs hand-written"),
    )
    for name in IMPLEMENTATIONS:
        if name in missing:
            table.add(name, NOT_INSTALLED, "-", "-", "-", "-", "-")
            continue
        t = timings[name]
        p = pytree[name].median if name in pytree else None
        table.add(name, fmt_seconds(t.median), fmt_seconds(t.iqr),
                  fmt_ratio(paired_ratio(t, base)), fmt_ratio(paired_ratio(mine, t)),
                  fmt_seconds(p) if p is not None else "n/a (own jit wrapper)",
                  fmt_ratio(p / pytree[REFERENCE].median) if p is not None else "-")
    table.notes.append(
        f"per call: median of {cfg.rounds} interleaved rounds of {cfg.number} calls, each call "
        "blocked on (execution of the compiled program included); ratios are medians of "
        "per-round ratios"
    )
    table.notes.append(
        "pytree work: the Python side of a jax.jit call alone, flattening the arguments "
        "and unflattening the outputs (jax.tree_util), for rows that call jax.jit themselves"
    )
    table.notes.append("outputs and all states checked against hand-written JAX over 2 calls")
    for name, why in missing.items():
        table.notes.append(f"{name}: {NOT_INSTALLED} ({why})")

    report = Report(tables=[table])
    report.targets.append(
        target_below("2", "per call within 1.2x of hand-written JAX",
                     paired_ratio(mine, base), 1.2,
                     f"pytree work {fmt_ratio(pytree['autostate'].median / pytree[REFERENCE].median)}")
    )
    for peer in MUST_BEAT:
        ratio = paired_ratio(mine, timings[peer]) if peer in timings else None
        report.targets.append(target_below("2", f"per call faster than {peer}", ratio, 1.0))
    zo_table, zo_target = zero_overhead_table(
        "Scenario 4b: jaxpr primitives of the dispatch step",
        "dispatch step",
        reference.jaxpr(),
        dispatchers["autostate"].jaxpr(),
    )
    report.tables.append(zo_table)
    report.targets.append(zo_target)
    return report


def main(argv: list[str] | None = None) -> None:
    script_main(run, __doc__, argv)


if __name__ == "__main__":
    main()
