"""Threads, signal handlers, asyncio and re-entrant calls reaching a model.

Each case runs a class as plain Python and decorated (the harness in
``tests/semantics/harness.py``, or a direct comparison) and asserts the
decorated program means what the plain one does: eagerly, through
``f(states, ...)``, under ``jax.jit`` and after ``autostate.freeze``, or that it
is refused with a clear error. A known difference stays as ``xfail(strict=True)``
with what differs.
"""

from __future__ import annotations

import asyncio
import concurrent
import concurrent.futures
import copy
import inspect
import signal
import sys
import threading
import time
import types
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest

import autostate
from autostate import guard as _guard
from autostate import runtime
from semantics.harness import (
    Loader,
    assert_same,
    assert_user_line,
    check,
    floats,
    no_handler_left,
    no_tracers,
    pair,
    plain_path,
    same,
    snapshot,
    staged,
)
from semantics.programs_concurrency import RECURSION, REENTRANT
from semantics.programs_eager_writes import EAGER
from semantics.programs_escapes import HELPER_ESCAPES as ESCAPES
from semantics.programs_methods import FRAMES
from semantics.programs_python_protocols import ITER
from semantics.programs_shared import A1, A2, TIMEOUT, X1
from semantics.programs_shared import TWO as X2
from semantics.programs_shared import XS3 as XS
from semantics.twins import (
    Classes,
    filled,
    run_twins,
    written,
)


def full(v: float) -> Any:
    return jnp.full((2,), v, jnp.float32)


def differential(write_module: Loader, source: str, scenario: Callable[[Any], Any]) -> None:
    """Runs ``scenario(module)`` with the plain and the decorated module; same result."""
    plain, dec = pair(write_module, source, fresh=True)
    assert_same(scenario(plain), scenario(dec), "scenario")


def _written(k: Any, cls: str = "Model") -> Any:
    model = getattr(k, cls)()
    model.step(full(1.0))
    model.step(full(1.5))
    return model


def test_writes_from_another_thread_with_copies_in_main(write_module: Loader) -> None:
    def scenario(k: Any) -> Any:
        model = _written(k, "Shared")
        vals = [full(float(i)) for i in range(4)]
        old = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)
        stop = threading.Event()

        def writer() -> None:
            i = 0
            while not stop.is_set() and i < 3000:
                model.x = vals[i % 4]
                i += 1

        t = threading.Thread(target=writer)
        bad = 0
        try:
            t.start()
            copies = []
            for _ in range(300):
                c = copy.copy(model)
                copies.append((c, np.asarray(c.x).copy()))
            stop.set()
            t.join()
        finally:
            sys.setswitchinterval(old)
        for c, v in copies:
            bad += int(not np.array_equal(np.asarray(c.x), v))
        return bad

    differential(write_module, EAGER, scenario)


def _race(k: Any, seconds: float, arm: Callable[[Callable[[], None]], Callable[[], None]]) -> int:
    """Writes ``model.x`` in a loop while ``arm`` makes a hook take sharing copies."""
    model = _written(k, "Shared")
    vals = [full(float(i)) for i in range(8)]
    seen: list[tuple[Any, Any]] = []
    busy: list[bool] = []

    def take() -> None:
        # Not re-entered: a signal arriving while a copy is taken (a copy can take
        # longer than the timer's period on a slow machine) would otherwise nest
        # copies until the recursion limit.
        if busy:
            return
        busy.append(True)
        try:
            c = copy.copy(model)
            seen.append((c, np.asarray(c.x).copy()))
        finally:
            busy.clear()

    disarm = arm(take)
    try:
        t0, i = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            model.x = vals[i % 8]
            model.step(vals[(i + 3) % 8])
            i += 1
            if i % 256 == 0 and any(
                not np.array_equal(np.asarray(c.x), v) for c, v in seen
            ):
                break
    finally:
        disarm()
    return sum(not np.array_equal(np.asarray(c.x), v) for c, v in seen)


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs setitimer")
def test_signal_handler_copy_during_eager_writes(write_module: Loader) -> None:
    def arm(take: Callable[[], None]) -> Callable[[], None]:
        old = signal.signal(signal.SIGALRM, lambda *_: take())
        signal.setitimer(signal.ITIMER_REAL, 1e-4, 1e-4)

        def disarm() -> None:
            signal.setitimer(signal.ITIMER_REAL, 0, 0)
            signal.signal(signal.SIGALRM, old)

        return disarm

    plain, dec = pair(write_module, EAGER, fresh=True)
    assert _race(plain, 0.3, arm) == 0
    assert _race(dec, 2.0, arm) == 0, "a copy made before the store reads the later write"


def test_profile_hook_copy_during_eager_writes(write_module: Loader) -> None:
    def scenario(k: Any) -> Any:
        model = _written(k, "Shared")
        seen: list[tuple[Any, Any]] = []

        def prof(frame: Any, event: str, arg: Any) -> None:
            # A hook acting on some C calls only (here: the refcount's return).
            if event == "c_return" and arg is sys.getrefcount and len(seen) < 200:
                c = copy.copy(model)
                seen.append((c, np.asarray(c.x).copy()))

        five, seven = full(5.0), full(7.0)
        sys.setprofile(prof)
        try:
            model.x = five
            model.step(seven)
        finally:
            sys.setprofile(None)
        return sum(not np.array_equal(np.asarray(c.x), v) for c, v in seen)

    plain, dec = pair(write_module, EAGER, fresh=True)
    assert scenario(plain) == 0
    assert scenario(dec) == 0, "a copy made before the store reads the later write"


@pytest.mark.parametrize("method", ["threaded_helper"])
def test_threaded_helper_writes_pytree_states(write_module: Loader, method: str) -> None:
    plain, dec = pair(write_module, ESCAPES, fresh=True)
    check(plain, dec, "M()", [(method, (XS,)), (method, (XS,))])


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
            call = staged(lambda f, s, v: f.step(s, v))  # traces once: one barrier, in the trace
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
        out, s = staged(lambda f, s, v: f.step(s, v))(f, states, 4.0)
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
    step = staged(lambda f, s, v: f.step(s, v)) if jit else (lambda f, s, v: f.step(s, v))
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda v: floats(list(step(f, states, v))), vs))
    assert_same(expected, [[o, dict(s)] for o, s in got])


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
        staged(lambda f, s: f.pool(s, [1.0, 2.0]))(f, states)
    assert_user_line(info.value, dec.__file__)


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
    out, s = staged(lambda f, s, *a: getattr(f, method)(s, *a))(f, s, *args)
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

    assert not _guard._IN_LAX_BODY.get()[0], "instances still marked as in a lax body"


def compare_states(ref: Any, states: dict[str, Any], where: str) -> None:
    for key, value in states.items():
        same(snapshot(plain_path(ref, key)), snapshot(value), f"{where} state {key}")


RAISING_THREADS = """
import threading


MEET = []  # the test's barrier, passed once by each thread


class Boom(Exception):
    pass


@DECORATE
class Worker:
    def __init__(self, scale):
        self.s = jnp.zeros(())
        self.n = jnp.zeros(())
        self.scale = scale

    def scan(self, xs, fail):
        self.n = self.n + 1
        def body(c, x):
            self.s = self.s + x * self.scale
            for meet in MEET:
                meet.wait()
            if fail == "body":
                raise Boom("body")
            return c + self.s, None
        out = lax.scan(body, 0.0, xs)[0]
        if fail == "after":
            raise Boom("after the scan")
        return out

    def reset(self):
        self.s = jnp.zeros(())
"""


class Meet:
    """A barrier each thread passes once (a body may be traced more than once)."""

    def __init__(self, n: int):
        self.barrier = threading.Barrier(n)
        self.passed: set[int] = set()

    def wait(self) -> None:
        me = threading.get_ident()
        if me not in self.passed:
            self.passed.add(me)
            self.barrier.wait(timeout=20)


def _in_threads(*fns: Callable[[], Any]) -> list[Any]:
    results: list[Any] = [None] * len(fns)

    def run(i: int, fn: Callable[[], Any]) -> None:
        try:
            results[i] = fn()
        except BaseException as raised:  # noqa: BLE001 - handed to the test thread
            results[i] = raised

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a thread hung"
    return results


@pytest.mark.parametrize("fail", ["body", "after"])
def test_eager_raise_in_one_thread_while_another_scans(write_module: Loader, fail: str) -> None:
    plain, dec = pair(write_module, RAISING_THREADS)
    refs = [plain.Worker(1.0), plain.Worker(10.0)]
    with pytest.raises(Exception, match="body|after"):
        refs[0].scan(XS, fail)
    want_b = snapshot(refs[1].scan(XS, None))
    models = [dec.Worker(1.0), dec.Worker(10.0)]
    dec.MEET.append(Meet(2))
    try:
        got_a, got_b = _in_threads(lambda: models[0].scan(XS, fail),
                                   lambda: models[1].scan(XS, None))
    finally:
        dec.MEET.clear()
    assert isinstance(got_a, dec.Boom), repr(got_a)
    assert not isinstance(got_b, BaseException), repr(got_b)
    same(want_b, snapshot(got_b), "the other thread's output")
    no_tracers(*models)
    no_handler_left()
    same(snapshot(refs[1]), snapshot(models[1]), "the other thread's model")
    if fail == "body":
        with pytest.raises(autostate.errors.ControlFlowStateError):
            models[0].s  # noqa: B018 - the documented lost state
        for obj in (refs[0], models[0]):
            obj.reset()
    same(snapshot(refs[0]), snapshot(models[0]), "the raising thread's model")
    for ref, model in zip(refs, models, strict=True):
        same(snapshot(ref.scan(XS, None)), snapshot(model.scan(XS, None)), "afterwards")


def test_f_raise_in_one_thread_while_another_runs_jit(write_module: Loader) -> None:
    plain, dec = pair(write_module, RAISING_THREADS)
    models = [dec.Worker(1.0), dec.Worker(10.0)]
    (fa, sa), (fb, sb) = (m.functionalize() for m in models)
    dec.MEET.append(Meet(2))
    try:
        got_a, got_b = _in_threads(lambda: fa.scan(sa, XS, "body"),
                                   lambda: staged(fb.scan, static_argnums=2)(sb, XS, None))
    finally:
        dec.MEET.clear()
    assert isinstance(got_a, dec.Boom), repr(got_a)
    assert not isinstance(got_b, BaseException), repr(got_b)
    ref = plain.Worker(10.0)
    same(snapshot(ref.scan(XS, None)), snapshot(got_b[0]), "the other thread's output")
    compare_states(ref, got_b[1], "the other thread's states")
    no_tracers(fa, fb, *models)
    no_handler_left()


@pytest.mark.filterwarnings(
    "ignore:Python iterable type:DeprecationWarning"
)
def test_async_iteration_through_a_cursor(write_module: Loader) -> None:
    plain, dec = pair(write_module, ITER)
    check(plain, dec, "Counter()", [("adrain", ()), ("adrain", ())])


ASYNC = """
import asyncio
import contextlib


@DECORATE
class Aio:
    def __init__(self):
        self.x = jnp.zeros(())
        self.closed = jnp.zeros(())
        self.mode = jnp.asarray(1.0)

    def bump(self, v):
        self.x = self.x + v * self.mode
        return self.x

    def close_mark(self):
        self.closed = self.closed + 1

    def set_mode(self, v):
        old = self.mode
        self.mode = jnp.asarray(v)
        return old

    async def agen(self, xs):
        try:
            for v in xs:
                await asyncio.sleep(0)
                yield self.bump(v)
        finally:
            self.close_mark()

    async def _drain(self, xs):
        return [v async for v in self.agen(xs)]

    def run_agen(self, xs):
        return jnp.stack(asyncio.run(self._drain(xs)))

    async def _first(self, xs):
        g = self.agen(xs)
        a = await g.__anext__()
        await g.aclose()
        return a

    def run_agen_partly(self, xs):
        return asyncio.run(self._first(xs)) + self.closed

    async def __aenter__(self):
        self.bump(1000.0)
        return self

    async def __aexit__(self, *exc):
        self.close_mark()
        return False

    async def _with_async(self, v):
        async with self as m:
            return m.bump(v)

    def run_async_with(self, v):
        return asyncio.run(self._with_async(v))

    @contextlib.asynccontextmanager
    async def amode(self, v):
        old = self.set_mode(v)
        try:
            await asyncio.sleep(0)
            yield self
        finally:
            self.set_mode(old)

    async def _use(self, v):
        async with self.amode(3.0) as m:
            a = m.bump(v)
        return a + self.bump(v)

    def run_amode(self, v):
        return asyncio.run(self._use(v))

    def in_scan(self, xs):
        def body(c, x):
            return c + asyncio.run(self._use(x)), c
        return lax.scan(body, jnp.zeros(()), xs)
"""


ASYNC_CASES: dict[str, list[tuple[str, tuple[Any, ...]]]] = {
    "async_generator": [("run_agen", (XS,))] * 2,
    "async_generator_closed_early": [("run_agen_partly", (XS,))] * 2,
    "aenter_aexit": [("run_async_with", (A1,))] * 2,
    "asynccontextmanager": [("run_amode", (A2,))] * 2,
    "asyncio_run_in_scan_body": [("in_scan", (XS,))],
}


@pytest.mark.filterwarnings(
    "ignore:Python iterable type:DeprecationWarning"
)
@pytest.mark.parametrize("case", sorted(ASYNC_CASES))
def test_async_code_reaching_state_through_methods(write_module: Loader, case: str) -> None:
    plain, dec = pair(write_module, ASYNC)
    check(plain, dec, "Aio()", ASYNC_CASES[case])


@pytest.mark.filterwarnings(
    "ignore:Python iterable type:DeprecationWarning"
)
def test_async_with_model_from_outside_eagerly(write_module: Loader) -> None:
    plain, dec = pair(write_module, ASYNC)

    async def use(m: Any) -> Any:
        async with m:
            out = [v async for v in m.agen([1.0, 2.0])]
        return out

    got = []
    for mod in (plain, dec):
        m = mod.Aio()
        got.append((asyncio.run(use(m)), snapshot(m)))
    same(got[0], got[1])


def test_a_write_from_another_thread() -> None:
    def scenario(k: Classes) -> Any:
        model = written(k)
        twin = copy.copy(model)
        thread = threading.Thread(target=lambda: (model.step(filled(2.0)), twin.add(filled(5.0))))
        thread.start()
        thread.join()
        return [model.x, model.n, twin.x, twin.n]

    run_twins(scenario)


def _lines(fn: Callable[..., Any], *texts: str) -> set[int]:
    source, start = inspect.getsourcelines(fn)
    return {start + i for i, line in enumerate(source) if any(t in line for t in texts)}


# The last step of an eager write: the new request going into the instance's dict,
# or the new value into a request nothing else holds.
_LAST_STEP = {
    fn.__code__: _lines(fn, "d[name] = slot.replaced(value)", "slot.state = value")
    for fn in (runtime.set, runtime.store_state, runtime.guarded_setattr)
}


def _copy_during_a_write(k: Classes, write: Callable[[Any, Any], Any], threaded: bool) -> Any:
    """Copies the model while a write is at its last step.

    ``threaded``: the main thread copies while the writer thread is paused there,
    as a thread switch after any call may pause it.
    Otherwise the trace function copies in the writer's own thread, as a user
    would at a debugger's prompt stopped on that line. The plain class's write
    is one bytecode, with no such point: its writer pauses just before it.
    """
    model = written(k)
    model.step(filled(1.0))
    at_write, copied = threading.Event(), threading.Event()
    taken: list[Any] = []

    def writer() -> None:
        write(model, filled(7.0))

    hooks = _LAST_STEP if k.decorated else {writer.__code__: None}

    def take_copy() -> None:
        twin = copy.copy(model)
        taken.extend([twin, twin.x])

    def trace(frame: types.FrameType, event: str, arg: Any) -> Any:
        if event == "call":
            return trace if frame.f_code in hooks else None
        lines = hooks[frame.f_code]
        if event == "line" and not at_write.is_set() and (lines is None or frame.f_lineno in lines):
            at_write.set()
            if threaded:
                copied.wait(10)
            else:
                take_copy()
        return trace

    def traced_writer() -> None:
        sys.settrace(trace)
        try:
            writer()
        finally:
            sys.settrace(None)

    if threaded:
        thread = threading.Thread(target=traced_writer)
        thread.start()
        reached = at_write.wait(10)
        if reached:
            take_copy()
        copied.set()
        thread.join()
    else:
        traced_writer()
        reached = at_write.is_set()
    if not reached:
        raise RuntimeError("the writer never reached the hooked line")
    twin, at_copy = taken
    return [at_copy, twin.x, model.x]


RACING_WRITES: dict[str, Callable[[Any, Any], Any]] = {
    "inside a method": lambda m, v: m.step(v),
    "from outside": lambda m, v: setattr(m, "x", v),
}


@pytest.mark.parametrize("write", list(RACING_WRITES), ids=list(RACING_WRITES))
def test_a_copy_taken_by_another_thread_during_a_write(write: str) -> None:
    """A thread switch inside the write: the copy keeps the value it was taken with."""
    run_twins(lambda k: _copy_during_a_write(k, RACING_WRITES[write], threaded=True))
