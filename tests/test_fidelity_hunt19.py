"""Differential bug hunt 19: concurrency, re-entrancy, suspended frames, recursion.

The engine keeps its run-time context (the running handlers' cells, the
guarded instances) in context variables, and an eager model's ``lax`` call
hands the instance's slots to a temporary handler; these cases look for
where that context leaks between calls, threads, models and frames.

- Threads: two models (and one model, turn by turn) called eagerly from two
  ``threading.Thread``s with a barrier inside the method, ``f`` of two models
  from two threads (eagerly and jitted), one ``f`` with two states dicts,
  one thread tracing ``jax.jit(f)`` while another runs the model eagerly, a
  ``ThreadPoolExecutor`` map over ``f`` calls, a host-fallback model from two
  threads, another thread reading / writing / copying an eager model while
  its ``lax.scan`` is being traced, a worker thread started inside a method.
- Re-entrancy: a method calling another model's ``f`` (and ``jax.jit`` of
  it), a callback into the outer model reached from inside the inner ``f``,
  ``self.functionalize()`` / ``autostate.freeze`` / a sub-model's
  ``functionalize()`` inside a method, a model holding itself
  (``self.me = self``), peers of one class calling each other, mutual
  recursion between two instances, a method recursing N levels deep, a tree
  of sub-models of one class, a memoising recursive method.
- Suspended frames: a generator method (that reaches state through a regular
  method) consumed partly, resumed after other calls, resumed inside another
  model's ``f``; ``async def`` methods run with ``asyncio.run`` (eagerly and
  inside ``f``), interleaved by ``asyncio.gather`` across two models, a
  coroutine returned by ``f``; a ``contextlib.contextmanager`` method exited
  after the call that entered it returned.
- Exceptions: a raise after a write (caught by the caller eagerly, raised out
  of ``f``), an exception of an inner ``f`` caught by the outer method,
  ``KeyboardInterrupt`` / ``BaseException`` subclasses through ``f`` and
  ``jax.jit(f)`` and the next call, no handler left running afterwards.
- Lifetime: ``f`` used after its model is garbage collected, ``copy.deepcopy``
  of ``self`` inside a method.

Each source is written plain and decorated (``differential.pair``; ``lax.*``
is a Python loop in the plain module); a case that shows a mismatch stays,
marked ``xfail(strict=True)`` with what differs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from differential import (  # noqa: I001 - tests/ is on sys.path
    X,
    assert_same,
    assert_user_line,
    check,
    check_transform,
    pair,
    snapshot,
)

import autostate
from autostate.effects import local_state as _engine
from autostate.errors import StateAccessError, UnhandledLocalStateError

Loader = Callable[..., types.ModuleType]

X1 = jnp.float32(1.5)
X2 = jnp.float32(2.0)
XS = jnp.arange(1.0, 4.0)
TIMEOUT = 20.0


def run_threads(*targets: Callable[[], Any]) -> list[Any]:
    """Runs each target in its own thread; their results (or the exception raised)."""
    results: list[Any] = [None] * len(targets)

    def wrap(i: int, target: Callable[[], Any]) -> None:
        try:
            results[i] = target()
        except BaseException as e:  # noqa: BLE001 - reported as a result
            results[i] = e

    threads = [threading.Thread(target=wrap, args=(i, t), daemon=True) for i, t in enumerate(targets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
        assert not t.is_alive(), "a thread hung"
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def floats(tree: Any) -> Any:
    """Numbers as floats, tuples as lists, dicts as dicts: comparable across modes."""
    if isinstance(tree, dict):
        return {k: floats(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return [floats(v) for v in tree]
    return float(tree)


def no_handler_left() -> None:
    assert not _engine.handler_running(), "a handler is still running after the call"
    assert not _engine._GUARDED.get(), "instances are still guarded after the call"


# ======================================================================================
# 1. Threads
# ======================================================================================

THREADS = """
@DECORATE
class Counter:
    def __init__(self, k):
        self.k = k
        self.x = jnp.zeros(())
        self.n = jnp.zeros((), jnp.int32)
        self.hook = None

    def step(self, v):
        self.x = self.x + v * self.k
        if self.hook is not None:
            self.hook(self)
        self.n = self.n + 1
        self.x = self.x * 2
        return self.x + self.n

    def read(self):
        return self.x + self.n
"""


def _two_models(mod: types.ModuleType, mode: str) -> list[Any]:
    """Two models, each stepped three times in its own thread; both threads meet
    at a barrier inside every call (between the first and the second write)."""
    barrier = threading.Barrier(2, timeout=TIMEOUT)
    models = [mod.Counter(1.0), mod.Counter(10.0)]

    def work(m: Any) -> Any:
        m.hook = lambda _self: barrier.wait()
        if mode == "eager":
            outs = [m.step(float(j + 1)) for j in range(3)]
            return floats([outs, {"x": m.x, "n": m.n}])
        f, s = m.functionalize()
        if mode == "jit":
            call = jax.jit(lambda f, s, v: f.step(s, v))  # traces once: one barrier, in the trace
        else:
            def call(f: Any, s: Any, v: Any) -> Any:
                return f.step(s, v)
        outs = []
        for j in range(3):
            out, s = call(f, s, float(j + 1))
            outs.append(out)
        return floats([outs, dict(s)])

    return run_threads(*(lambda m=m: work(m) for m in models))


@pytest.mark.parametrize("mode", ["eager", "f", "jit"])
def test_two_models_in_two_threads_meeting_inside_the_method(
    write_module: Loader, mode: str
) -> None:
    plain, dec = pair(write_module, THREADS)
    expected = _two_models(plain, "eager")
    got = _two_models(dec, mode)
    assert_same(expected, got, mode)


def _one_model_turn_by_turn(mod: types.ModuleType) -> Any:
    """One model, two threads: A writes x, then B runs a whole step, then A ends."""
    m = mod.Counter(1.0)
    a_inside, b_done = threading.Event(), threading.Event()

    def hook(_self: Any) -> None:
        if threading.current_thread().name == "A":
            a_inside.set()
            assert b_done.wait(TIMEOUT)

    m.hook = hook
    results: dict[str, Any] = {}

    def a() -> None:
        results["a"] = m.step(1.0)

    def b() -> None:
        assert a_inside.wait(TIMEOUT)
        results["b"] = m.step(5.0)
        b_done.set()

    ta = threading.Thread(target=a, name="A", daemon=True)
    tb = threading.Thread(target=b, name="B", daemon=True)
    ta.start()
    tb.start()
    for t in (ta, tb):
        t.join(TIMEOUT)
        assert not t.is_alive()
    return floats([results["a"], results["b"], m.x, m.n])


def test_one_model_from_two_threads_turn_by_turn(write_module: Loader) -> None:
    plain, dec = pair(write_module, THREADS)
    assert_same(_one_model_turn_by_turn(plain), _one_model_turn_by_turn(dec))


def test_one_f_two_states_dicts_in_two_threads(write_module: Loader) -> None:
    """One f, two independent runs at once: each thread's states stay its own."""
    plain, dec = pair(write_module, THREADS)
    refs = [plain.Counter(3.0), plain.Counter(3.0)]
    expected = [floats([[r.step(v) for v in vs], {"x": r.x, "n": r.n}])
                for r, vs in zip(refs, ([1.0, 2.0], [7.0, -1.0]))]
    model = dec.Counter(3.0)
    barrier = threading.Barrier(2, timeout=TIMEOUT)
    model.hook = lambda _self: barrier.wait()
    f, states0 = model.functionalize()

    def work(vs: list[float]) -> Any:
        s, outs = states0, []
        for v in vs:
            out, s = f.step(s, v)
            outs.append(out)
        return floats([outs, dict(s)])

    got = run_threads(lambda: work([1.0, 2.0]), lambda: work([7.0, -1.0]))
    assert_same(expected, got)
    assert_same(np.float32(0.0), model.x, "the eager model is unchanged")


def test_jit_trace_in_one_thread_while_another_runs_the_model_eagerly(
    write_module: Loader,
) -> None:
    """Thread T traces jax.jit(f.step) and waits inside the trace; meanwhile the
    main thread steps the same (eager) model; then the trace finishes."""
    plain, dec = pair(write_module, THREADS)
    ref = plain.Counter(2.0)
    expected_eager = floats([ref.step(1.0), ref.step(2.0), ref.x, ref.n])
    ref2 = plain.Counter(2.0)
    expected_jit = floats([ref2.step(4.0), ref2.x, ref2.n])

    model = dec.Counter(2.0)
    in_trace, eager_done = threading.Event(), threading.Event()

    def hook(_self: Any) -> None:
        if threading.current_thread().name == "T":
            in_trace.set()
            assert eager_done.wait(TIMEOUT)

    model.hook = hook
    f, states = model.functionalize()
    result: dict[str, Any] = {}

    def tracer() -> None:
        out, s = jax.jit(lambda f, s, v: f.step(s, v))(f, states, 4.0)
        result["jit"] = floats([out, s["x"], s["n"]])

    t = threading.Thread(target=tracer, name="T", daemon=True)
    t.start()
    assert in_trace.wait(TIMEOUT)
    got_eager = floats([model.step(1.0), model.step(2.0), model.x, model.n])
    eager_done.set()
    t.join(TIMEOUT)
    assert not t.is_alive()
    assert_same(expected_eager, got_eager, "eager model")
    assert_same(expected_jit, result["jit"], "jit in the other thread")
    assert not autostate.lifetime.contains_tracer(snapshot(model)), "tracer leaked into the model"


@pytest.mark.parametrize("jit", [False, True])
def test_thread_pool_map_over_f_calls(write_module: Loader, jit: bool) -> None:
    plain, dec = pair(write_module, THREADS)
    vs = [float(v) for v in range(1, 9)]
    expected = []
    for v in vs:
        r = plain.Counter(0.5)
        out = r.step(v)
        expected.append(floats([out, {"x": r.x, "n": r.n}]))
    f, states = dec.Counter(0.5).functionalize()
    step = jax.jit(lambda f, s, v: f.step(s, v)) if jit else (lambda f, s, v: f.step(s, v))
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda v: floats(list(step(f, states, v))), vs))
    assert_same(expected, [[o, dict(s)] for o, s in got])


HOST_THREADS = """
@DECORATE_HOST
class HostCounter:
    def __init__(self, k):
        self.k = k
        self.x = jnp.zeros(())
        self.hook = None

    def step(self, v):
        self.x = self.x + v * self.k
        if self.hook is not None:
            self.hook()
        self.x = self.x * 2
        return self.x
"""


def test_host_fallback_models_in_two_threads(write_module: Loader) -> None:
    plain, dec = pair(write_module, HOST_THREADS)

    def scenario(mod: types.ModuleType) -> list[Any]:
        barrier = threading.Barrier(2, timeout=TIMEOUT)
        models = [mod.HostCounter(1.0), mod.HostCounter(-3.0)]

        def work(m: Any) -> Any:
            m.hook = barrier.wait
            outs = [m.step(float(j + 1)) for j in range(3)]
            return floats([outs, m.x])

        return run_threads(*(lambda m=m: work(m) for m in models))

    assert_same(scenario(plain), scenario(dec))


LAX_THREADS = """
@DECORATE
class Scanner:
    def __init__(self):
        self.x = jnp.ones(())
        self.hook = None

    def scan_hooked(self, xs):
        def body(c, v):
            self.hook()
            self.x = self.x + v
            return c + self.x, None
        return lax.scan(body, jnp.zeros(()), xs)[0]

    def read(self):
        return self.x * 1

    def add(self, v):
        self.x = self.x + v
        return self.x
"""


def _during_scan(mod: types.ModuleType, op: Callable[[Any], Any]) -> dict[str, Any]:
    """Thread S runs ``scan_hooked`` and stops in its body (at the first step in
    plain Python, while the body is traced when decorated); the main thread runs
    ``op(model)`` then; S goes on."""
    m = mod.Scanner()
    inside, go = threading.Event(), threading.Event()
    fired: list[int] = []

    def hook() -> None:
        if not fired:
            fired.append(1)
            inside.set()
            assert go.wait(TIMEOUT)

    m.hook = hook
    res: dict[str, Any] = {}

    def scanner() -> None:
        res["scan"] = m.scan_hooked(XS)

    t = threading.Thread(target=scanner, daemon=True)
    t.start()
    assert inside.wait(TIMEOUT)
    try:
        res["other"] = op(m)
    finally:
        go.set()
        t.join(TIMEOUT)
    assert not t.is_alive()
    return res


@pytest.mark.parametrize(
    "op",
    [
        # (A read in the first trace of the body, which finds what it assigns,
        # has the state's value: that trace keeps concrete values.)
        "getattr",
        "method_read",
        pytest.param(
            "functionalize",
            marks=pytest.mark.xfail(
                strict=True,
                reason="BUG: an eager model's lax call swaps the instance's slots for refs "
                "of a temporary handler; another thread's functionalize() of the model "
                "meanwhile returns states without 'x' (KeyError)",
            ),
        ),
    ],
)
def test_other_thread_reads_an_eager_model_while_its_lax_call_runs(
    write_module: Loader, op: str
) -> None:
    plain, dec = pair(write_module, LAX_THREADS)

    def do(m: Any) -> Any:
        if op == "functionalize":
            if not hasattr(m, "functionalize"):  # plain: what f's states would hold
                return float(m.x)
            return float(m.functionalize()[1]["x"])
        return float(m.x) if op == "getattr" else float(m.read())

    expected = _during_scan(plain, do)
    got = _during_scan(dec, do)
    assert_same(floats(expected), floats(got))


@pytest.mark.xfail(
    strict=True,
    reason="BUG: copy.deepcopy of an eager model in another thread while its lax call "
    "runs copies the temporary handler's refs: the copy cannot be read",
)
def test_other_thread_deepcopies_an_eager_model_while_its_lax_call_runs(
    write_module: Loader,
) -> None:
    import copy

    plain, dec = pair(write_module, LAX_THREADS)
    got = []
    for mod in (plain, dec):
        res = _during_scan(mod, copy.deepcopy)
        clone = res["other"]
        got.append(floats([res["scan"], clone.add(10.0), clone.read()]))
    assert_same(got[0], got[1])


POOL_IN_METHOD = """
import concurrent.futures


@DECORATE
class Pooled:
    def __init__(self):
        self.x = jnp.zeros(())
        self.n = jnp.zeros(())

    def bump(self, v):
        self.x = self.x + v
        self.n = self.n + 1
        return self.x

    def pool(self, vs):
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            outs = list(ex.map(self.bump, vs))
        return sum(outs) + self.x
"""


def test_worker_thread_inside_a_method_eagerly(write_module: Loader) -> None:
    plain, dec = pair(write_module, POOL_IN_METHOD)
    check(plain, dec, "Pooled()", [("pool", ([1.0, 2.0],))], modes=("eager",))


def test_worker_thread_inside_a_method_through_f(write_module: Loader) -> None:
    plain, dec = pair(write_module, POOL_IN_METHOD)
    check(plain, dec, "Pooled()", [("pool", ([1.0, 2.0],))], modes=("f",))


def test_worker_thread_inside_a_method_under_jit_is_a_clear_error(
    write_module: Loader,
) -> None:
    _, dec = pair(write_module, POOL_IN_METHOD)
    f, states = dec.Pooled().functionalize()
    with pytest.raises(autostate.AutostateError, match=r"\bthread\b") as info:
        jax.jit(lambda f, s: f.pool(s, [1.0, 2.0]))(f, states)
    assert_user_line(info.value, dec.__file__)


# ======================================================================================
# 2. Re-entrancy: f inside methods, models calling models, recursion
# ======================================================================================

REENTRANT = """
@DECORATE
class Inner:
    def __init__(self):
        self.x = jnp.zeros(())
        self.y = jnp.full((), 7.0)

    def __call__(self, v):
        self.x = self.x * 3 + v
        return self.x

    def apply(self, fn, v):
        self.x = self.x + fn(v)
        return self.x

    def read_other(self, other):
        self.y = self.y + other.x
        return self.y

    def boom(self, v):
        self.x = self.x + v
        raise KeyError("inner")


@DECORATE
class Outer:
    def __init__(self):
        self.x = jnp.full((), 10.0)
        self.z = jnp.full((), 5.0)

    def bump(self, v):
        self.x = self.x + v
        return self.x

    def bumpz(self, v):
        self.z = self.z + v
        return self.z

    def use_f(self, fi, si, v):
        self.x = self.x + 1
        out, si = fi(si, v)
        self.x = self.x + out
        return self.x, si

    def use_jit_f(self, fi, si, v):
        out, si = jax.jit(lambda fi, si, v: fi(si, v))(fi, si, v)
        self.x = self.x * out
        return self.x, si

    def self_as_argument(self, fi, si):
        self.x = self.x + 1
        out, si = fi.read_other(si, self)
        return out, si

    def callback_x(self, fi, si, v):
        out, si = fi.apply(si, self.bump, v)
        return out, self.x, si

    def callback_z(self, fi, si, v):
        out, si = fi.apply(si, self.bumpz, v)
        return out, self.z, si

    def catches_inner(self, fi, si, v):
        self.x = self.x + 1
        try:
            fi.boom(si, v)
        except KeyError:
            self.x = self.x * 2
        out, si = fi(si, v)
        return self.x + out, si
"""


def _inner_states(dec: types.ModuleType) -> tuple[Any, Any]:
    return dec.Inner().functionalize()


def _outer_modes(dec: types.ModuleType, method: str, *args: Any) -> dict[str, Any]:
    """``Outer().<method>(*args)`` eagerly, through f and under jax.jit(f):
    (output, the outer model's x and z afterwards)."""
    res = {}
    m = dec.Outer()
    out = getattr(m, method)(*args)
    res["eager"] = floats([out, m.x, m.z])
    f, s = dec.Outer().functionalize()
    out, s = getattr(f, method)(s, *args)
    res["f"] = floats([out, s["x"], s["z"]])
    f, s = dec.Outer().functionalize()
    out, s = jax.jit(lambda f, s, *a: getattr(f, method)(s, *a))(f, s, *args)
    res["jit"] = floats([out, s["x"], s["z"]])
    return res


def test_method_calls_another_models_f(write_module: Loader) -> None:
    _, dec = pair(write_module, REENTRANT)
    fi, si = _inner_states(dec)
    # plain meaning: x = 10 + 1; inner x = 0 * 3 + 2 = 2; x = 11 + 2
    expected = [[13.0, {"x": 2.0, "y": 7.0}], 13.0, 5.0]
    for mode, got in _outer_modes(dec, "use_f", fi, si, 2.0).items():
        assert_same(expected, got, mode)
    assert_same(np.float32(0.0), si["x"], "the inner states given are unchanged")


def test_method_calls_jit_of_another_models_f(write_module: Loader) -> None:
    _, dec = pair(write_module, REENTRANT)
    fi, si = _inner_states(dec)
    expected = [[30.0, {"x": 3.0, "y": 7.0}], 30.0, 5.0]
    for mode, got in _outer_modes(dec, "use_jit_f", fi, si, 3.0).items():
        assert_same(expected, got, mode)


def test_exception_of_an_inner_f_caught_by_the_outer_method(write_module: Loader) -> None:
    """Inner f raises (its states are dropped, as f returned nothing); the outer
    method catches, keeps writing its own state and calls inner f again."""
    _, dec = pair(write_module, REENTRANT)
    fi, si = _inner_states(dec)
    # x = (10 + 1) * 2 = 22; inner: 0 * 3 + 4 = 4; out = 22 + 4
    expected = [[26.0, {"x": 4.0, "y": 7.0}], 22.0, 5.0]
    for mode, got in _outer_modes(dec, "catches_inner", fi, si, 4.0).items():
        assert_same(expected, got, mode)
    no_handler_left()


def test_outer_model_passed_into_inner_f_reads_its_own_state(write_module: Loader) -> None:
    plain, dec = pair(write_module, REENTRANT)
    fi, si = _inner_states(dec)
    po, pi = plain.Outer(), plain.Inner()
    po.x = po.x + 1
    expected = floats([[pi.read_other(po), {"x": pi.x, "y": pi.y}], po.x, po.z])
    for mode, got in _outer_modes(dec, "self_as_argument", fi, si).items():
        assert_same(expected, got, mode)


def test_callback_into_the_outer_model_from_inner_f_same_state_name(
    write_module: Loader,
) -> None:
    plain, dec = pair(write_module, REENTRANT)
    fi, si = _inner_states(dec)
    po, pi = plain.Outer(), plain.Inner()
    out = pi.apply(po.bump, 1.0)
    expected = floats([[out, po.x, {"x": pi.x, "y": pi.y}], po.x, po.z])
    for mode, got in _outer_modes(dec, "callback_x", fi, si, 1.0).items():
        assert_same(expected, got, mode)


def test_callback_into_the_outer_model_from_inner_f_other_state_name(
    write_module: Loader,
) -> None:
    plain, dec = pair(write_module, REENTRANT)
    fi, si = _inner_states(dec)
    po, pi = plain.Outer(), plain.Inner()
    out = pi.apply(po.bumpz, 1.0)
    expected = floats([[out, po.z, {"x": pi.x, "y": pi.y}], po.x, po.z])
    for mode, got in _outer_modes(dec, "callback_z", fi, si, 1.0).items():
        assert_same(expected, got, mode)


SELF_F = """
@DECORATE
class Probe:
    def __init__(self):
        self.x = jnp.ones(())
        self.n = jnp.zeros(())

    def step(self, v):
        self.x = self.x * 2 + v
        self.n = self.n + 1
        return self.x

    def probe_self(self, v):
        self.x = self.x + 1
        f, s = self.functionalize()
        out, s = f.step(s, v)
        return out + self.x, s["x"], self.n

    def freeze_self(self, v):
        self.x = self.x + 1
        f, s = self.functionalize()
        out, s = f.step(s, v)
        ahead = autostate.freeze(f, s)
        return ahead.x + self.x, ahead.n, self.n

    def deepcopy_self(self, v):
        c = copy.deepcopy(self)
        c.step(v)
        self.x = self.x + c.x
        return c.x, c.n, self.x


@DECORATE
class Holder:
    def __init__(self):
        self.sub = Probe()
        self.y = jnp.zeros(())

    def probe_sub(self, v):
        self.sub.x = self.sub.x + 1
        fs, ss = self.sub.functionalize()
        out, ss = fs.step(ss, v)
        self.y = self.y + out
        return out, ss["x"], self.sub.x
"""


@pytest.mark.parametrize(
    "method,expected",
    [
        # x = 2; f's copy: 2 * 2 + 3 = 7 (self untouched): 7 + 2, its x, n 0
        ("probe_self", [9.0, 7.0, 0.0]),
        ("freeze_self", [9.0, 1.0, 0.0]),
    ],
)
def test_functionalize_and_freeze_self_inside_a_method(
    write_module: Loader, method: str, expected: list[float]
) -> None:
    _, dec = pair(write_module, SELF_F)
    m = dec.Probe()
    got = {"eager": floats([getattr(m, method)(3.0), m.x, m.n])}
    f, s = dec.Probe().functionalize()
    out, s1 = getattr(f, method)(s, 3.0)
    got["f"] = floats([out, s1["x"], s1["n"]])
    out, s2 = jax.jit(lambda f, s: getattr(f, method)(s, 3.0))(f, s)
    got["jit"] = floats([out, s2["x"], s2["n"]])
    for mode, g in got.items():
        assert_same([expected, 2.0, 0.0], g, mode)
    no_handler_left()


def test_deepcopy_self_inside_a_method(write_module: Loader) -> None:
    plain, dec = pair(write_module, SELF_F)
    check(plain, dec, "Probe()", [("deepcopy_self", (X1,)), ("step", (X2,)), ("deepcopy_self", (X2,))])


def test_functionalize_a_sub_model_inside_the_outer_call(write_module: Loader) -> None:
    _, dec = pair(write_module, SELF_F)
    # sub.x = 2; its f: 2 * 2 + 3 = 7 (the sub-model untouched); y = 7
    expected = [[7.0, 7.0, 2.0], 2.0, 7.0]
    m = dec.Holder()
    assert_same(expected, floats([m.probe_sub(3.0), m.sub.x, m.y]), "eager")
    f, s = dec.Holder().functionalize()
    for mode, call in (("f", f.probe_sub), ("jit", jax.jit(f.probe_sub))):
        out, s1 = call(s, 3.0)
        assert_same(expected, floats([out, s1["sub.x"], s1["y"]]), mode)


RECURSION = """
@DECORATE
class Node:
    def __init__(self, depth):
        self.w = jnp.asarray(float(depth + 1))
        self.count = jnp.zeros(())
        self.kids = [Node(depth - 1), Node(depth - 1)] if depth > 0 else []

    def __call__(self, x):
        self.count = self.count + 1
        y = x * self.w
        for k in self.kids:
            y = y + k(x + self.count)
        return y


@DECORATE
class Deep:
    def __init__(self, levels):
        self.levels = levels
        self.x = jnp.ones(())
        self.n = jnp.zeros(())
        self.trail = jnp.zeros(levels + 1)

    def rec(self, k, v):
        self.n = self.n + 1
        self.x = self.x + v * k
        self.trail = self.trail.at[k].set(self.x)
        if k > 0:
            return self.rec(k - 1, v) + self.x
        return self.x

    def __call__(self, v):
        return self.rec(self.levels, v)

    def two_levels(self, v):
        return self.rec(2, v)


@DECORATE
class Fib:
    def __init__(self, n):
        self.n = n
        self.calls = jnp.zeros((), jnp.int32)
        self.memo = {}

    def fib(self, n):
        self.calls = self.calls + 1
        if n in self.memo:
            return self.memo[n]
        out = jnp.asarray(float(n)) if n < 2 else self.fib(n - 1) + self.fib(n - 2)
        self.memo[n] = out
        return out

    def __call__(self, scale):
        self.memo = {}
        return self.fib(self.n) * scale


@DECORATE
class Peer:
    def __init__(self, with_peer):
        self.x = jnp.ones(())
        self.peer = Peer(False) if with_peer else None

    def __call__(self, v):
        self.x = self.x * 2 + v
        if self.peer is not None:
            return self.peer(self.x) + self.peer.poke(self) + self.x
        return self.x

    def poke(self, other):
        other.x = other.x + 100
        self.x = self.x + other.x
        return self.x

    def walk(self, other, depth):
        self.x = self.x + depth
        if depth > 0:
            return other.walk(self, depth - 1) * 2 + self.x
        return self.x

    def ping_pong(self, v):
        return self.walk(self.peer, 5) + v


@DECORATE
class Selfish:
    def __init__(self):
        self.me = self
        self.x = jnp.zeros(())

    def __call__(self, v):
        self.x = self.x + 1
        self.me.x = self.me.x * v
        return self.x + self.me.x


@DECORATE
class Lax:
    def __init__(self):
        self.x = jnp.ones(())
        self.n = jnp.zeros(())

    def rec_scan(self, k, xs):
        def body(c, v):
            self.x = self.x + v * k
            self.n = self.n + 1
            inner = self.rec_scan(k - 1, xs) if k > 0 else jnp.zeros(())
            return c + self.x + inner, None
        return lax.scan(body, jnp.zeros(()), xs)[0]

    def deep(self, xs):
        return self.rec_scan(2, xs)

    def rec_cond(self, k, v):
        def yes(v):
            self.x = self.x * 2 + v
            return self.rec_cond(k - 1, v) if k > 0 else self.x
        def no(v):
            self.n = self.n + k
            return self.x - v
        return lax.cond(v > 0, yes, no, v)

    def cond3(self, v):
        return self.rec_cond(3, v)


@DECORATE
class OnlyThroughAlias:
    def __init__(self):
        self.me = self
        self.x = jnp.zeros(())

    def __call__(self, v):
        self.me.x = self.me.x + v  # HERE
        return self.x
"""

RECURSION_CASES = {
    "tree": ("Node(2)", [("__call__", (X1,)), ("__call__", (X2,))]),
    "deep": ("Deep(6)", [("__call__", (X1,)), ("two_levels", (X2,))]),
    "fib_memo": ("Fib(7)", [("__call__", (X1,)), ("__call__", (X2,))]),
    "peers": ("Peer(True)", [("__call__", (X1,)), ("__call__", (X2,))]),
    "mutual": ("Peer(True)", [("ping_pong", (X1,)), ("__call__", (X2,))]),
    "self_alias": ("Selfish()", [("__call__", (X1,)), ("__call__", (X2,))]),
}


RECURSION_CASES |= {
    "scan_in_scan": ("Lax()", [("deep", (XS[:2],)), ("deep", (XS[1:],))]),
    "cond_in_cond": ("Lax()", [("cond3", (X2,)), ("cond3", (-X1,))]),
}


@pytest.mark.parametrize("case", sorted(RECURSION_CASES))
def test_recursion_and_instances_of_one_class(write_module: Loader, case: str) -> None:
    plain, dec = pair(write_module, RECURSION)
    build, calls = RECURSION_CASES[case]
    check(plain, dec, build, calls)


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_recursive_tree_under_grad_and_vmap(write_module: Loader, transform: str) -> None:
    plain, dec = pair(write_module, RECURSION)
    x = X1 if transform == "grad" else jnp.arange(3.0)
    check_transform(plain, dec, "Node(2)", [("__call__", (X,)), ("__call__", (X,))], x, transform)


def test_state_written_only_through_a_self_alias(write_module: Loader) -> None:
    """``self.me.x = ...`` is not seen as a write of state ``x``: eagerly it is
    plain Python; through f the documented refusal names the line."""
    plain, dec = pair(write_module, RECURSION)
    check(plain, dec, "OnlyThroughAlias()", [("__call__", (X1,)), ("__call__", (X2,))],
          modes=("eager",))
    f, s = dec.OnlyThroughAlias().functionalize()
    with pytest.raises(StateAccessError, match="OnlyThroughAlias.x is not state") as info:
        f(s, X1)
    assert_user_line(info.value, dec.__file__)
    no_handler_left()


# ======================================================================================
# 3. Suspended frames: generators, coroutines, context managers
# ======================================================================================

FRAMES = """
import asyncio
import contextlib


@DECORATE
class Stream:
    def __init__(self):
        self.x = jnp.ones(())
        self.n = jnp.zeros(())

    def bump(self, v):
        self.x = self.x + v
        self.n = self.n + 1
        return self.x

    def gen(self, vs):
        for v in vs:
            yield self.bump(v)

    def start(self, vs):
        g = self.gen(vs)
        first = next(g)
        return g, first

    def resume(self, g):
        out = next(g)
        self.x = self.x * 2
        return out

    async def abump(self, v):
        await asyncio.sleep(0)
        out = self.bump(v)
        await asyncio.sleep(0)
        return out + self.bump(v)

    async def astep(self, v, go, ready):
        self.bump(v)
        ready.set()
        await go.wait()
        return self.bump(v)

    async def await_other(self, other, v):
        out = await other.abump(v)
        return out + self.bump(out)

    def run_async(self, v):
        return asyncio.run(self.abump(v))

    @contextlib.contextmanager
    def scope(self, v):
        self.bump(v)
        try:
            yield self.bump(v)
        finally:
            self.bump(v * 10)
"""


def test_generator_consumed_partly_then_resumed_after_other_calls(write_module: Loader) -> None:
    plain, dec = pair(write_module, FRAMES)
    got = []
    for mod in (plain, dec):
        m = mod.Stream()
        g = m.gen([1.0, 2.0, 3.0])
        first = next(g)
        middle = m.bump(100.0)
        rest = list(g)
        got.append(floats([first, middle, rest, m.x, m.n]))
    assert_same(got[0], got[1])


@pytest.mark.filterwarnings("ignore:Python iterable type 'generator':DeprecationWarning")
def test_generator_started_in_one_f_call_resumed_in_the_next(write_module: Loader) -> None:
    """The generator made in call 1 holds f's handled copy; resumed inside call 2
    it reaches call 2's states, which plain Python's one model also has."""
    plain, dec = pair(write_module, FRAMES)
    p = plain.Stream()
    g, first = p.start([1.0, 2.0])
    expected = floats([first, p.resume(g), p.x, p.n])
    f, s = dec.Stream().functionalize()
    (gd, first_d), s = f.start(s, [1.0, 2.0])
    out, s = f.resume(s, gd)
    assert_same(expected, floats([first_d, out, s["x"], s["n"]]))


@pytest.mark.filterwarnings("ignore:Python iterable type 'generator':DeprecationWarning")
def test_generator_of_one_models_f_resumed_inside_another_models_f(
    write_module: Loader,
) -> None:
    plain, dec = pair(write_module, FRAMES)
    pa, pb = plain.Stream(), plain.Stream()
    g = pa.gen([1.0, 2.0])
    expected_out = floats(pb.resume(g))
    fa, sa = dec.Stream().functionalize()
    fb, sb = dec.Stream().functionalize()
    gd, _ = fa.gen(sa, [1.0, 2.0])
    try:
        out, sb2 = fb.resume(sb, gd)
    except UnhandledLocalStateError as e:  # a clear error is an acceptable answer
        assert_user_line(e, dec.__file__)
        return
    # otherwise: plain meaning for B (A's writes must not land in B's states)
    assert_same([expected_out, floats(pb.x), floats(pb.n)], floats([out, sb2["x"], sb2["n"]]))


@pytest.mark.filterwarnings("error::DeprecationWarning")
def test_a_generator_argument_of_f_raises_no_jax_deprecation(write_module: Loader) -> None:
    plain, dec = pair(write_module, FRAMES)
    p = plain.Stream()
    expected = floats([p.resume(p.gen([1.0, 2.0])), p.x])
    f, s = dec.Stream().functionalize()
    helper = dec.Stream()  # an eager generator handed to f (its model is another one)
    out, s = f.resume(s, helper.gen([1.0, 2.0]))
    assert_same(expected[0], floats(out), "output")
    assert_same(np.float32(2.0), s["x"], "f's x: its own 1 * 2")


def test_async_method_run_eagerly_and_inside_f(write_module: Loader) -> None:
    plain, dec = pair(write_module, FRAMES)
    p, d = plain.Stream(), dec.Stream()
    assert_same(floats(asyncio.run(p.abump(X1))), floats(asyncio.run(d.abump(X1))), "eager")
    assert_same(snapshot(p), snapshot(d), "eager attributes")
    check(plain, dec, "Stream()", [("run_async", (X1,)), ("run_async", (X2,))])


def test_async_methods_of_two_models_interleaved_by_gather(write_module: Loader) -> None:
    plain, dec = pair(write_module, FRAMES)

    async def two(mod: types.ModuleType) -> Any:
        a, b = mod.Stream(), mod.Stream()
        ea, eb = asyncio.Event(), asyncio.Event()
        outs = await asyncio.gather(a.astep(1.0, eb, ea), b.astep(10.0, ea, eb))
        nested = await a.await_other(b, 2.0)
        return floats([outs, nested, a.x, a.n, b.x, b.n])

    assert_same(asyncio.run(two(plain)), asyncio.run(two(dec)))


def test_coroutine_returned_by_f_refuses_to_run_after_the_call(write_module: Loader) -> None:
    _, dec = pair(write_module, FRAMES)
    f, s = dec.Stream().functionalize()
    coro, new = f.abump(s, X1)
    with pytest.raises(UnhandledLocalStateError, match="State 'x'") as info:
        asyncio.run(coro)
    assert_user_line(info.value, dec.__file__)
    assert_same(floats(s), floats(new), "the states are unchanged")
    no_handler_left()


def test_context_manager_exited_after_the_entering_call_returned(write_module: Loader) -> None:
    plain, dec = pair(write_module, FRAMES)
    got = []
    for mod in (plain, dec):
        m = mod.Stream()
        cm = m.scope(1.0)
        entered = cm.__enter__()
        middle = m.bump(5.0)
        cm.__exit__(None, None, None)
        got.append(floats([entered, middle, m.x, m.n]))
    assert_same(got[0], got[1])


def test_context_manager_returned_by_f_refuses_to_enter_after_the_call(
    write_module: Loader,
) -> None:
    _, dec = pair(write_module, FRAMES)
    f, s = dec.Stream().functionalize()
    cm, _ = f.scope(s, 1.0)
    with pytest.raises(UnhandledLocalStateError, match="State 'x'") as info:
        cm.__enter__()
    assert_user_line(info.value, dec.__file__)


# ======================================================================================
# 4. Exceptions through calls and handlers
# ======================================================================================

RAISING = """
class Stop(BaseException):
    pass


@DECORATE
class Raiser:
    def __init__(self):
        self.x = jnp.zeros(())
        self.n = jnp.zeros(())
        self.hook = None

    def write_then_raise(self, v, kind):
        self.x = self.x + v
        if kind == "value":
            raise ValueError("after the write")
        if kind == "keyboard":
            raise KeyboardInterrupt
        raise Stop()

    def step(self, v):
        self.x = self.x * 2 + v
        self.n = self.n + 1
        return self.x

    def scan_hooked(self, xs):
        def body(c, v):
            if self.hook is not None:
                self.hook()
            self.x = self.x + v
            return c + self.x, None
        return lax.scan(body, jnp.zeros(()), xs)[0]

    def scan_then_raise(self, xs):
        def body(c, v):
            self.n = self.n + 1
            return c + v, None
        out = lax.scan(body, jnp.zeros(()), xs)[0]
        raise ValueError("after the scan")
"""

KINDS = {"value": ValueError, "keyboard": KeyboardInterrupt, "base": BaseException}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_raise_after_a_write_caught_by_the_caller_eagerly(write_module: Loader, kind: str) -> None:
    plain, dec = pair(write_module, RAISING)
    got = []
    for mod in (plain, dec):
        m = mod.Raiser()
        with pytest.raises(KINDS[kind]):
            m.write_then_raise(X1, kind)
        out = m.step(X2)
        got.append(snapshot(m) | {"out": np.asarray(out)})
    assert_same(got[0], got[1])
    no_handler_left()


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("jit", [False, True])
def test_f_raising_then_called_again(write_module: Loader, kind: str, jit: bool) -> None:
    plain, dec = pair(write_module, RAISING)
    p = plain.Raiser()
    expected = floats([p.step(X1), p.step(X2), p.x, p.n])
    f, s = dec.Raiser().functionalize()
    raising = jax.jit(f.write_then_raise, static_argnums=2) if jit else f.write_then_raise
    step = jax.jit(f.step) if jit else f.step
    with pytest.raises(KINDS[kind]):
        raising(s, X1, kind)
    no_handler_left()
    out1, s = step(s, X1)
    with pytest.raises(KINDS[kind]):
        raising(s, X1, kind)
    out2, s = step(s, X2)
    assert_same(expected, floats([out1, out2, s["x"], s["n"]]))
    no_handler_left()


def test_raise_after_an_eager_lax_call_keeps_its_writes(write_module: Loader) -> None:
    """The scan ended before the raise: plain Python kept its writes, and the
    eager model's slots are back (not the temporary handler's refs)."""
    plain, dec = pair(write_module, RAISING)
    got = []
    for mod in (plain, dec):
        m = mod.Raiser()
        with pytest.raises(ValueError, match="after the scan"):
            m.scan_then_raise(XS)
        got.append(floats([m.n, m.step(X1), m.x]))
    assert_same(got[0], got[1])
    no_handler_left()


def test_keyboard_interrupt_inside_an_eager_lax_body_before_any_write(
    write_module: Loader,
) -> None:
    """Ctrl-C in the body before it assigns anything: the model is as it was
    (its slots back, no handler left), and the next call works."""
    plain, dec = pair(write_module, RAISING)

    def interrupt() -> None:
        raise KeyboardInterrupt

    got = []
    for mod in (plain, dec):
        m = mod.Raiser()
        m.hook = interrupt
        with pytest.raises(KeyboardInterrupt):
            m.scan_hooked(XS)
        m.hook = None
        got.append(floats([m.x, m.scan_hooked(XS), m.x, m.step(X1)]))
        no_handler_left()
    assert_same(got[0], got[1])


# ======================================================================================
# 5. Lifetime: f after its model is collected
# ======================================================================================


def test_f_used_after_its_model_is_garbage_collected(write_module: Loader) -> None:
    plain, dec = pair(write_module, SELF_F)
    p = plain.Probe()
    expected = floats([p.step(X1), p.step(X2), p.x, p.n])
    model = dec.Probe()
    model.step(X1)  # the model's own value is not f's business after functionalize
    model = dec.Probe()
    f, s = model.functionalize()
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None, "f keeps the eager model alive"
    out1, s = f.step(s, X1)
    out2, s = jax.jit(f.step)(s, X2)
    assert_same(expected, floats([out1, out2, s["x"], s["n"]]))
    frozen = autostate.freeze(f, s)
    assert_same(expected[2:], floats([frozen.x, frozen.n]), "frozen")
