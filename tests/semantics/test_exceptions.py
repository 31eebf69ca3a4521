"""Exceptions raised in methods after partial writes: what the model holds
afterwards, eagerly and through ``f``, and recovery.

Each case runs a class as plain Python and decorated (the harness in
``tests/semantics/harness.py``, or a direct comparison) and asserts the
decorated program means what the plain one does: eagerly, through
``f(states, ...)``, under ``jax.jit`` and after ``autostate.freeze``, or that it
is refused with a clear error. A known difference stays as ``xfail(strict=True)``
with what differs.
"""

from __future__ import annotations

import copy
import gc
import traceback
import types
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autostate
from autostate import guard as _guard
from autostate.errors import (
    ControlFlowStateError,
)
from semantics.harness import (
    Call,
    Loader,
    _fcall,
    assert_same,
    floats,
    modes_of,
    no_handler_left,
    no_tracers,
    pair,
    pair_with_helpers,
    plain_path,
    run_case,
    same,
    snapshot,
    staged,
    user_line,
)
from semantics.programs_attribute_access import CONTEXT_CONSTRUCTS as CONSTRUCTS
from semantics.programs_concurrency import REENTRANT
from semantics.programs_control_flow import EVERY_LAX_BODY, HELPER_MOD, HELPER_MODEL
from semantics.programs_exceptions import BRANCH_EXCEPTIONS as MORE
from semantics.programs_exceptions import RAISE_IN_LAX
from semantics.programs_functional import VARIANTS
from semantics.programs_methods import MISC
from semantics.programs_python_protocols import CMS
from semantics.programs_shared import A1, A2, V3_RANGE, X1, X1_WEAK, X2_WEAK, XS_SIGNED
from semantics.programs_shared import TWO as X2
from semantics.programs_shared import XS3 as XS
from semantics.twins import (
    DECORATED,
    PLAIN,
    Classes,
    filled,
    same_observations,
    written,
)


def test_exception_after_a_write_keeps_the_write_eagerly(write_module: Loader) -> None:
    plain, dec = pair(write_module, MISC)
    p, d = plain.Misc(), dec.Misc()
    for m in (p, d):
        with pytest.raises(ValueError, match="boom"):
            m.partial_write(3.0)
    assert_same(snapshot(p), snapshot(d))
    f, states = dec.Misc().functionalize()
    with pytest.raises(ValueError, match="boom"):
        f.partial_write(states, 3.0)
    out, states2 = f.use_closure(states, 1.0)  # f still works after the exception
    assert float(states2["n"]) == 2.0


def test_f_reused_after_exceptions(write_module: Loader) -> None:
    _, dec = pair(write_module, VARIANTS)
    f, states = dec.Mixed().functionalize()
    with pytest.raises(ValueError, match="boom"):
        f.fail(states, 1.0, True)
    with pytest.raises(ValueError, match="boom"):
        staged(f.fail, static_argnums=2)(states, 1.0, True)
    with pytest.raises(TypeError):
        staged(f.bad_shape)(states, 1.0)
    out, s = f.fail(states, 1.0, False)
    assert float(out) == 2.0
    out, s = staged(f)(states, 1.0)
    assert float(out) == 6.0
    assert f == dec.Mixed().functionalize()[0]


@pytest.mark.parametrize("method,arg", [("scan_raises", XS), ("cond_raises", X1)])
def test_exception_raised_inside_a_lax_body_after_a_write(
    write_module: Loader, method: str, arg: Any
) -> None:
    """Plain Python's loop keeps the write made before the raise; JAX keeps
    nothing a body that raises computed. The state is not silently rolled
    back: reading it is a ControlFlowStateError naming it and the lax call,
    eagerly, through f and under jit (it was the old value, silently)."""
    _, dec = pair(write_module, CONSTRUCTS)
    model = dec.Ctx()
    with pytest.raises(ControlFlowStateError, match=r"State 'Ctx\.s' has no value.*ValueError"):
        getattr(model, method)(arg)
    with pytest.raises(ControlFlowStateError, match="has no value"):
        model.s  # noqa: B018 - the read is the test
    with pytest.raises(ControlFlowStateError, match="has no value"):
        model.functionalize()
    model.s = jnp.full((), 5.0)  # assigning it gives it a value again
    assert_same(np.float32(5.0), model.s, "assigned again")
    f, states = dec.Ctx().functionalize()
    for call in modes_of(f, method):
        with pytest.raises(ControlFlowStateError, match=r"State 's' has no value.*ValueError"):
            call(states, arg)
    assert_same(np.float32(0.0), states["s"], "the states given to f are unchanged")


LAX_CALLS = ["scan_", "cond_", "switch_", "while_", "fori_", "map_", "checkpoint_"]


@pytest.mark.parametrize("method", LAX_CALLS)
def test_every_lax_body_that_raises_after_a_write_loses_the_state_loudly(
    write_module: Loader, method: str
) -> None:
    """A body that raises after assigning a state, caught around the lax call:
    reading the state is a ControlFlowStateError (plain Python kept the write;
    JAX keeps nothing), eagerly, through f and under jit; a new assignment
    gives it a value again."""
    _, dec = pair(write_module, EVERY_LAX_BODY)
    model = dec.Q()
    with pytest.raises(ControlFlowStateError, match=r"has no value.*raised ValueError"):
        model.caught(method, X1)
    model.a = jnp.full((), 2.0)
    assert_same(np.float32(3.0), model.caught.__self__.a + 1, "assigned again")
    f, states = dec.Q().functionalize()
    call = _fcall(f, "caught")
    for mode in (call, staged(lambda s, x: call(s, method, x))):
        with pytest.raises(ControlFlowStateError, match=r"State 'a' has no value"):
            mode(states, method, X1) if mode is call else mode(states, X1)



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
    raising = staged(f.write_then_raise, static_argnums=2) if jit else f.write_then_raise
    step = staged(f.step) if jit else f.step
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


GUARD = """
@DECORATE
class Guard:
    def __init__(self):
        self.errors = jnp.zeros((), jnp.int32)
        self.entered = jnp.zeros((), jnp.int32)
    def __enter__(self):
        self.entered += 1
        return self
    def __exit__(self, et, ev, tb):
        if et is not None:
            self.errors += 1
        return et is ZeroDivisionError

@DECORATE
class M:
    def __init__(self, k):
        self.g = Guard()
        self.total = jnp.zeros(())
        self.k = k
    def __call__(self, x):
        with self.g as g:
            self.total = self.total + x
            if self.k == 0:
                raise ZeroDivisionError("k")
            self.total = self.total + 100.0
        return self.total + g.entered
"""


def test_exit_suppresses_exception_after_partial_writes(write_module: Loader) -> None:
    plain, dec = pair(write_module, GUARD)
    calls = [("__call__", (A1,)), ("__call__", (A2,))]
    run_case(plain, dec, "M(0)", calls, extra=("__call__", (A1,)))
    run_case(plain, dec, "M(1)", calls, extra=("__call__", (A1,)))


CHILD_RAISES = """
@DECORATE
class Child:
    def __init__(self):
        self.n = jnp.zeros((), jnp.int32)
        self.last = jnp.zeros(())
    def step(self, x, fail):
        self.n += 1
        self.last = x
        if fail:
            raise RuntimeError("fail")
        self.n += 10
        return x

@DECORATE
class Parent:
    def __init__(self):
        self.c = Child()
        self.caught = jnp.zeros((), jnp.int32)
    def __call__(self, x):
        outs = []
        for i, fail in enumerate((False, True, False)):
            try:
                outs.append(self.c.step(x + i, fail))
            except RuntimeError:
                self.caught += 1
        return sum(outs)
"""


def test_child_raises_after_writes_caught_by_parent(write_module: Loader) -> None:
    plain, dec = pair(write_module, CHILD_RAISES)
    run_case(plain, dec, "Parent()", [("__call__", (A1,)), ("__call__", (A2,))],
             extra=("__call__", (A1,)))


MID_RAISE = """
@DECORATE
class M:
    def __init__(self):
        self.a = jnp.zeros(())
        self.b = jnp.zeros(())
    def step(self, x, fail):
        self.a = self.a + x
        if fail:
            raise ValueError("mid-method")
        self.b = self.b + x
        return self.a + self.b
"""


def test_raise_mid_method_after_writes(write_module: Loader) -> None:
    plain, dec = pair(write_module, MID_RAISE)
    ref, model = plain.M(), dec.M()
    for m in (ref, model):
        m.step(A1, False)
        with pytest.raises(ValueError, match="mid-method"):
            m.step(A2, True)
    same(snapshot(ref), snapshot(model), "eager keeps the partial write")
    f, states = dec.M().functionalize()
    _, states = f.step(states, A1, False)
    given = dict(states)
    with pytest.raises(ValueError, match="mid-method"):
        f.step(states, A2, True)
    same(given, states, "f leaves the given states alone")
    jitted = staged(lambda f, s, x: f.step(s, x, True))
    with pytest.raises(ValueError, match="mid-method"):
        jitted(f, states, A2)
    out, states = f.step(states, A2, False)
    same({"a": jnp.asarray(3.0), "b": jnp.asarray(3.0)}, states, "f usable after the raise")
    same(jnp.asarray(6.0), out, "output after the raise")


FINALLY_LOOP = """
@DECORATE
class M:
    def __init__(self):
        self.ticks = jnp.zeros((), jnp.int32)
        self.acc = jnp.zeros(())
    def __call__(self, x):
        i = 0
        while True:
            try:
                i += 1
                if i == 2:
                    continue
                self.acc = self.acc + x * i
                if i >= 4:
                    break
            finally:
                self.ticks += 1
        try:
            return self.acc
        finally:
            self.acc = self.acc * 0.5
"""


def test_try_finally_with_break_continue_and_return(write_module: Loader) -> None:
    plain, dec = pair(write_module, FINALLY_LOOP)
    run_case(plain, dec, "M()", [("__call__", (A1,)), ("__call__", (A2,))],
             extra=("__call__", (A1,)))


def test_helper_module_raises_after_write_caught_in_method(write_module: Loader) -> None:
    plain, dec, _, _ = pair_with_helpers(write_module, HELPER_MOD, HELPER_MODEL)
    run_case(
        plain,
        dec,
        "M()",
        [("guarded", (V3_RANGE[:2],)), ("guarded", (V3_RANGE,)), ("guarded", (V3_RANGE[:1],))],
        extra=("guarded", (V3_RANGE,)),
    )


RAISES = """
def guard(fn):
    @functools.wraps(fn)
    def wrapper(self, x, *rest):
        try:
            return fn(self, x, *rest)
        except FloatingPointError:
            self.errors += 1
            return -1.0 * self.a
    return wrapper


def _risky(self, x, limit):
    self.a = self.a + x
    if limit < 0:
        raise FloatingPointError("limit")
    self.b = self.b + x * limit
    return self.a + self.b


@DECORATE
class Inner:
    def __init__(self):
        self.a = jnp.zeros(())
        self.b = jnp.zeros(())
        self.errors = jnp.zeros((), jnp.int32)

    risky = guard(_risky)
    raw = _risky


class Outer(Inner):
    def __init__(self):
        super().__init__()
        self.kid = Inner()
        self.caught = jnp.zeros((), jnp.int32)

    def __call__(self, x, limit):
        out = self.risky(x, limit) + self.kid.risky(x * 2.0, limit)
        try:
            out = out + self.kid.raw(x, limit)
        except FloatingPointError:
            self.caught = self.caught + 1
        return out, self.kid.a, self.kid.b
"""


def test_raise_after_writes_caught_by_wrapper_and_caller(write_module: Loader) -> None:
    plain, dec = pair(write_module, RAISES)
    calls = [("__call__", (A1, 2.0)), ("__call__", (A2, -1.0)), ("__call__", (A1, 3.0))]
    run_case(plain, dec, "Outer()", calls, modes=("eager", "f"), extra=calls[1])
    # under jit the Python `limit` must be static
    ref = plain.Outer()
    f, states = dec.Outer().functionalize()
    step = staged(lambda f, s, x, limit: f(s, x, limit), static_argnums=3)
    for _, (x, limit) in calls:
        out, states = step(f, states, x, limit)
        same(ref(x, limit), out, "jit output")
    for key, value in states.items():
        same(snapshot(plain_path(ref, key)), snapshot(value), f"jit state {key}")


def test_raise_after_writes_out_of_f_leaves_states(write_module: Loader) -> None:
    plain, dec = pair(write_module, RAISES)
    ref, model = plain.Outer(), dec.Outer()
    for m in (ref, model):
        m(A1, 2.0)
        with pytest.raises(FloatingPointError):
            m.raw(A2, -1.0)
    same(snapshot(ref), snapshot(model), "eager keeps the partial write")
    f, states = dec.Outer().functionalize()
    _, states = f(states, A1, 2.0)
    given = {k: np.asarray(v) for k, v in states.items()}
    for fn in (f.raw, staged(f.raw, static_argnums=2)):
        with pytest.raises(FloatingPointError):
            fn(states, A2, -1.0)
        same(given, {k: np.asarray(v) for k, v in states.items()}, "states unchanged")
    out, _ = f(states, A1, 2.0)
    ref2 = plain.Outer()
    ref2(A1, 2.0)
    same(ref2(A1, 2.0), out, "f usable after the raise")


def test_lax_body_raising_after_write_through_inherited_lambda(write_module: Loader) -> None:
    plain, dec = pair(write_module, RAISE_IN_LAX)
    run_case(plain, dec, "M()", [("run_then_assign", (XS_SIGNED,))], extra=("run_then_assign", (XS_SIGNED,)))
    # the documented ControlFlowStateError when the lost value is read
    f, states = dec.M().functionalize()
    for fn in (lambda: dec.M().run(XS_SIGNED), lambda: f.run(states, XS_SIGNED)):
        with pytest.raises(autostate.errors.ControlFlowStateError) as e:
            fn()
        user_line(e.value, dec, "return self.t")

    assert not _guard._IN_LAX_BODY.get()[0], "instances still marked as in a lax body"


def _static(args: Sequence[Any]) -> tuple[int, ...]:
    """Positions (in ``fn(f, states, *args)``) of the arguments that are not arrays."""
    return tuple(i + 2 for i, a in enumerate(args) if not isinstance(a, jax.Array | np.ndarray))


_JITTED: dict[tuple[str, tuple[int, ...]], Callable[..., Any]] = {}


def fcall(f: Any, name: str, states: Any, args: Sequence[Any], jit: bool) -> Any:
    """``f.name(states, *args)``; ``jit``: under ``jax.jit`` with ``f`` an argument
    (one jitted function per method name, so a second call is not traced again)."""
    fn = lambda f, s, *a: (f if name == "__call__" else getattr(f, name))(s, *a)  # noqa: E731
    if jit:
        key = (name, _static(args))
        if key not in _JITTED:
            _JITTED[key] = staged(fn, static_argnums=key[1])
        fn = _JITTED[key]
    return fn(f, states, *args)


def ecall(model: Any, name: str, args: Sequence[Any]) -> Any:
    return (model if name == "__call__" else getattr(model, name))(*args)


def build(mod: types.ModuleType, text: str) -> Any:
    return eval(text, vars(mod))  # noqa: S307


def states_snapshot(states: dict[str, Any]) -> dict[str, Any]:
    return {k: snapshot(v) for k, v in states.items()}


def compare_states(ref: Any, states: dict[str, Any], where: str) -> None:
    for key, value in states.items():
        same(snapshot(plain_path(ref, key)), snapshot(value), f"{where} state {key}")


def run_modes(
    plain: types.ModuleType,
    dec: types.ModuleType,
    build_text: str,
    calls: Sequence[Call],
    modes: Sequence[str] = ("eager", "f", "jit"),
) -> None:
    """The calls on the plain model are the reference: eagerly, through ``f``
    and ``jax.jit(f)`` (arguments that are not arrays static), then
    ``freeze``, one more call on the frozen model and a new ``functionalize``."""
    ref = build(plain, build_text)
    expected = [snapshot(ecall(ref, m, a)) for m, a in calls]
    expected_snap = snapshot(ref)
    if "eager" in modes:
        model = build(dec, build_text)
        got = [snapshot(ecall(model, m, a)) for m, a in calls]
        same(expected, got, "eager outputs")
        same(expected_snap, snapshot(model), "eager attributes")
        no_tracers(model)
    for jit in (False, True):
        if ("jit" if jit else "f") not in modes:
            continue
        model = build(dec, build_text)
        before = snapshot(model)
        f, states = model.functionalize()
        got = []
        for m, a in calls:
            out, states = fcall(f, m, states, a, jit)
            got.append(snapshot(out))
        same(expected, got, f"jit={jit} outputs")
        compare_states(ref, states, f"jit={jit}")
        same(before, snapshot(model), f"jit={jit}: the eager model changed")
        frozen = autostate.freeze(f, states)
        same(expected_snap, snapshot(frozen), f"jit={jit} frozen")
        no_tracers(model, f, frozen)
    no_handler_left()


def raise_and_recover(
    plain: types.ModuleType,
    dec: types.ModuleType,
    build_text: str,
    before: Sequence[Call],
    raising: Call,
    exc: type[BaseException],
    after: Sequence[Call],
    lost: Sequence[tuple[str, str]] = (),
    repair: Call | None = None,
    modes: Sequence[str] = ("eager", "f", "jit"),
) -> None:
    """``before`` calls, then ``raising`` raising ``exc``, then ``after`` calls.

    Eagerly: every attribute is plain Python's after the catch, except the
    ``lost`` states (``(attribute path, text of the line that assigned it)``),
    whose read is the documented ``ControlFlowStateError`` naming that line;
    then ``repair`` (plain and decorated) assigns them again. No tracer is
    left in the model, no handler left running. The ``after`` calls, a new
    ``functionalize()``, ``jax.jit(f)`` and ``freeze`` agree with plain Python.

    Through ``f`` (and ``jax.jit(f)``): the exception propagates, the states
    given are untouched, the eager model is unchanged, and ``f`` called again
    with them agrees with a plain model on which ``raising`` never ran.
    """
    if "eager" in modes:
        ref, model = build(plain, build_text), build(dec, build_text)
        for m, a in before:
            same(snapshot(ecall(ref, m, a)), snapshot(ecall(model, m, a)), f"eager {m}")
        for obj in (ref, model):
            with pytest.raises(exc):
                ecall(obj, *raising)
        no_handler_left()
        no_tracers(model)
        lost_paths = [p for p, _ in lost]
        for path, text in lost:
            with pytest.raises(autostate.errors.ControlFlowStateError) as err:
                plain_path(model, path)
            user_line(err.value, dec, text)
        got, want = snapshot_except(model, lost_paths), snapshot_except(ref, lost_paths)
        same(want, got, "eager attributes after the raise")
        if lost:
            # functionalize() reads every state: the lost one refuses, loudly
            with pytest.raises(autostate.errors.ControlFlowStateError) as err:
                model.functionalize()
            user_line(err.value, dec, lost[0][1])
            no_handler_left()
        if repair is not None:
            for obj in (ref, model):
                ecall(obj, *repair)
            same(snapshot(ref), snapshot(model), "eager attributes after the repair")
        if not lost or repair is not None:
            for m, a in after:
                same(snapshot(ecall(ref, m, a)), snapshot(ecall(model, m, a)), f"eager {m} after")
            same(snapshot(ref), snapshot(model), "eager attributes after")
            f, states = model.functionalize()
            compare_states(ref, states, "functionalize after the raise")
            for m, a in _through_f(after):
                out, states = fcall(f, m, states, a, True)
                same(snapshot(ecall(ref, m, a)), snapshot(out), f"jit {m} after the raise")
            same(snapshot(ref), snapshot(autostate.freeze(f, states)), "frozen after the raise")
            no_tracers(model, f)
        no_handler_left()

    for jit in (False, True):
        if ("jit" if jit else "f") not in modes:
            continue
        ref, model = build(plain, build_text), build(dec, build_text)
        eager_before = snapshot(model)
        f, states = model.functionalize()
        for m, a in before:
            out, states = fcall(f, m, states, a, jit)
            same(snapshot(ecall(ref, m, a)), snapshot(out), f"jit={jit} {m}")
        given = states_snapshot(states)
        with pytest.raises(exc):
            fcall(f, *raising[:1], states, raising[1], jit)
        no_handler_left()
        same(given, states_snapshot(states), f"jit={jit}: the states given changed")
        same(eager_before, snapshot(model), f"jit={jit}: the eager model changed")
        no_tracers(model, f, states)
        for m, a in _through_f(after):
            out, states = fcall(f, m, states, a, jit)
            same(snapshot(ecall(ref, m, a)), snapshot(out), f"jit={jit} {m} after the raise")
        compare_states(ref, states, f"jit={jit} after the raise")
        same(snapshot(ref), snapshot(autostate.freeze(f, states)), f"jit={jit} frozen")
        if jit:
            # the eager model and a new functionalize() are as good as new
            ref2 = build(plain, build_text)
            for m, a in after:
                same(snapshot(ecall(ref2, m, a)), snapshot(ecall(model, m, a)), f"eager {m} after")
            f2, s2 = model.functionalize()
            compare_states(ref2, s2, "functionalize again")
            no_tracers(model, f, f2)
        no_handler_left()


EAGER_ONLY = {"set_mode"}  # a static state's change: the documented StaticStateError in f


def _through_f(calls: Sequence[Call]) -> list[Call]:
    return [c for c in calls if c[0] not in EAGER_ONLY]


def snapshot_except(model: Any, lost: Sequence[str]) -> Any:
    """``snapshot`` of the model without the ``lost`` attribute paths (``a``, ``kid.k``)."""
    if not lost:
        return snapshot(model)
    out = {"__class__": type(model).__name__}
    for name in sorted(vars(model)):
        inner = [p.split(".", 1)[1] for p in lost if p.startswith(name + ".")]
        if name in lost:
            continue
        value = getattr(model, name)
        out[name] = snapshot_except(value, inner) if inner else snapshot(value)
    return out


PARTIAL = """
class Boom(Exception):
    pass


def helper(m, x, fail):
    m.a = m.a + x
    if fail:
        raise Boom("helper")
    m.b = m.b + x


@DECORATE
class Kid:
    def __init__(self, scale=1.0, fail=False):
        self.k = jnp.zeros(())
        if fail:
            raise Boom("Kid.__init__")
        self.j = jnp.zeros((2,)) + scale

    def bump(self, x, fail):
        self.k = self.k + x
        if fail:
            raise Boom("kid")
        self.j = self.j + x
        return self.k


@DECORATE
class Model:
    def __init__(self):
        self.a = jnp.zeros(())
        self.b = jnp.zeros((2,))
        self.n = jnp.zeros((), jnp.int32)
        self.kid = Kid()
        self.kids = [Kid(2.0), Kid(3.0)]
        self.stats = {"m": jnp.zeros(()), "v": jnp.ones(())}

    @property
    def level(self):
        return self.a

    @level.setter
    def level(self, v):
        self.a = v
        self.n = self.n + 10
        if jnp.ndim(v) != 0:
            raise Boom("level must be a scalar")

    def direct(self, x, fail):
        self.a = self.a + x
        self.stats["m"] = self.stats["m"] + x
        self.n += 1
        if fail:
            raise Boom("direct")
        self.b = self.b + x
        return self.a

    def via_kid(self, x, fail):
        self.n = self.n + 1
        out = self.kid.bump(x, False)
        out = out + self.kids[1].bump(x * 2, fail)
        self.a = self.a + out
        return self.a

    def via_helper(self, x, fail):
        self.n = self.n + 1
        helper(self, x, fail)
        return self.a

    def via_closure(self, x, fail):
        def inner(v):
            self.stats["v"] = self.stats["v"] * v
            if fail:
                raise Boom("closure")
            self.a = self.a + v

        self.n = self.n + 1
        inner(x)
        return self.a

    def via_getattr(self, x, fail):
        return getattr(self, "via_" + "kid")(x, fail)

    def via_jax_error(self, x, fail):
        self.a = self.a + x
        self.kid.k = self.kid.k - x
        y = jnp.ones((3, 3)) if fail else jnp.ones((2, 2))
        self.b = self.b @ y
        return self.a

    def build_kid_fails(self, x, fail):
        try:
            Kid(x, fail=fail)
        except Boom:
            self.n = self.n - 1
        tmp = Kid(x)
        self.a = self.a + tmp.bump(x, False) + tmp.j.sum()
        return self.a

    def via_setter(self, v):
        self.b = self.b * 2
        self.level = v
        return self.a

    def deep(self, x, depth, fail):
        self.n = self.n + 1
        self.kids[depth % 2].k = self.kids[depth % 2].k + x
        if depth == 0:
            if fail:
                raise Boom("deep")
            return self.a
        return self.deep(x * 2, depth - 1, fail)

    def __call__(self, x):
        self.a = self.a * 0.5 + x
        self.b = self.b + self.kid.bump(x, False)
        self.n = self.n + 1
        self.stats["v"] = self.stats["v"] + self.kids[0].bump(x, False)
        return self.a + self.b.sum() + self.kids[1].k
"""


ROADS = [
    ("direct", (X1_WEAK, True)),
    ("via_kid", (X1_WEAK, True)),
    ("via_helper", (X1_WEAK, True)),
    ("via_closure", (X1_WEAK, True)),
    ("via_getattr", (X1_WEAK, True)),
    ("via_setter", (XS,)),
    ("via_jax_error", (X1_WEAK, True)),
    ("deep", (X1_WEAK, 3, True)),
]


@pytest.mark.parametrize("raising", ROADS, ids=[r[0] for r in ROADS])
def test_partial_writes_then_raise(write_module: Loader, raising: Call) -> None:
    plain, dec = pair(write_module, PARTIAL)
    ok = (raising[0], tuple(False if a is True else a for a in raising[1]))
    if raising[0] == "via_setter":
        ok = ("via_setter", (X2_WEAK,))
    raise_and_recover(
        plain, dec, "Model()",
        before=[("__call__", (X1_WEAK,)), ok],
        raising=raising,
        exc=Exception,  # plain.Boom and dec.Boom are two classes
        after=[("__call__", (X2_WEAK,)), ok, ("__call__", (X1_WEAK,))],
    )


def test_sub_model_init_raising_inside_the_method(write_module: Loader) -> None:
    """A decorated sub-model whose ``__init__`` raises midway, built and
    caught inside a method (the method goes on with another instance)."""
    plain, dec = pair(write_module, PARTIAL)
    run_modes(plain, dec, "Model()", [("build_kid_fails", (X1_WEAK, True)), ("__call__", (X2_WEAK,)),
                                      ("build_kid_fails", (X2_WEAK, False))])


def test_partial_writes_raise_class_is_the_users(write_module: Loader) -> None:
    """The exception that comes out is the user's own (its class, message and
    traceback through the user's lines), eagerly and through ``f``."""
    _, dec = pair(write_module, PARTIAL)
    model = dec.Model()
    f, states = model.functionalize()
    for call in (lambda: model.via_helper(X1_WEAK, True), lambda: f.via_helper(states, X1_WEAK, True),
                 lambda: staged(f.via_helper, static_argnums=2)(states, X1_WEAK, True)):
        with pytest.raises(dec.Boom, match="helper") as err:
            call()
        assert type(err.value) is dec.Boom
        frames = [fr.f_code.co_filename for fr, _ in traceback.walk_tb(err.value.__traceback__)]
        assert dec.__file__ in frames, frames


LAX = """
class Boom(Exception):
    pass


def helper_scan(m, xs, fail):
    def body(c, x):
        if fail == "before":
            raise Boom("helper before")
        m.h = m.h + x
        if fail == "after":
            raise Boom("helper body")
        return c + m.h, None
    return LAXW.scan(body, 0.0, xs)[0]


@DECORATE
class Kid:
    def __init__(self, fail=None):
        self.k = jnp.zeros(())
        self.fail = fail

    def step(self, c, x):
        if self.fail == "before":
            raise Boom("kid before")
        self.k = self.k + x
        if self.fail == "after":
            raise Boom("kid after")
        return c + self.k, self.k


@DECORATE
class Lax:
    def __init__(self, kid_fail=None):
        self.pre = jnp.zeros(())
        self.s = jnp.zeros(())
        self.h = jnp.zeros(())
        self.t = jnp.zeros((2,))
        self.kid = Kid(kid_fail)
        self.mode = "plain"

    def set_mode(self, mode):
        self.mode = mode

    def reset(self):
        self.s = jnp.asarray(-1.0)
        self.h = jnp.asarray(-2.0)
        self.t = jnp.full((2,), 0.5)
        self.kid.k = jnp.asarray(0.25)

    def scan(self, xs, fail):
        self.pre = self.pre + 1.0
        def body(c, x):
            if fail == "before":
                raise Boom("before")
            self.s = self.s + (x * 2 if self.mode == "double" else x)
            if fail == "after":
                raise Boom("after")
            return c + self.s, self.s
        return lax.scan(body, 0.0, xs)

    def carry(self, xs, fail):
        self.pre = self.pre + 1.0
        def body(kid, x):
            if fail == "before":
                raise Boom("before")
            kid.k = kid.k + x
            if fail == "after":
                raise Boom("after")
            return kid, None
        kid, _ = lax.scan(body, self.kid, xs)
        return kid.k

    def fori(self, xs, fail):
        self.pre = self.pre + 1.0
        def body(i, c):
            if fail == "before":
                raise Boom("before")
            self.t = self.t + xs[i]
            if fail == "after":
                raise Boom("after")
            return c + self.t.sum()
        return lax.fori_loop(0, 3, body, 0.0)

    def while_body(self, x, fail):
        self.pre = self.pre + 1.0
        def cond(c):
            if fail == "cond":
                raise Boom("cond")
            return c < 3
        def body(c):
            if fail == "before":
                raise Boom("before")
            self.s = self.s + x
            if fail == "after":
                raise Boom("after")
            return c + 1
        return lax.while_loop(cond, body, 0)

    def cond(self, x, fail):
        self.pre = self.pre + 1.0
        def yes(v):
            if fail == "before":
                raise Boom("before")
            self.s = self.s + v
            if fail == "after":
                raise Boom("after")
            return v * 2
        def no(v):
            self.t = self.t - v
            return v
        return lax.cond(x > 0, yes, no, x)

    def switch(self, x, fail):
        self.pre = self.pre + 1.0
        def b0(v):
            self.t = self.t + v
            return v
        def b1(v):
            if fail == "before":
                raise Boom("before")
            self.s = self.s * v
            if fail == "after":
                raise Boom("after")
            return v + 1
        return lax.switch(1, [b0, b1], x)

    def map(self, xs, fail):
        self.pre = self.pre + 1.0
        def fn(x):
            if fail == "before":
                raise Boom("before")
            self.s = self.s + x
            if fail == "after":
                raise Boom("after")
            return x * self.s
        return lax.map(fn, xs)

    def ckpt(self, x, fail):
        self.pre = self.pre + 1.0
        def g(v):
            if fail == "before":
                raise Boom("before")
            self.s = self.s + v
            if fail == "after":
                raise Boom("after")
            return v * self.s
        return checkpoint(g)(x)

    def bound(self, xs, fail):
        self.pre = self.pre + 1.0
        return lax.scan(self.kid.step, 0.0, xs)

    @AUTOCHECKPOINT
    def _block(self, x):
        if self.kid.fail == "before":
            raise Boom("before")
        self.s = self.s + x
        if self.kid.fail == "after":
            raise Boom("after")
        return x * self.s

    def ckpt_method(self, x, fail):
        self.pre = self.pre + 1.0
        return self._block(x)

    def helper(self, xs, fail):
        self.pre = self.pre + 1.0
        return helper_scan(self, xs, fail)

    def __call__(self, x):
        self.pre = self.pre * 2
        self.s = self.s + x
        self.t = self.t * x
        self.h = self.h - x
        self.kid.k = self.kid.k + 1
        return self.pre + self.s + self.t.sum() + self.h + self.kid.k
"""


# method -> (argument, attribute the body writes before the raise, text of the
# lax call's line, which the documented error names)
LAX_ROADS = {
    "scan": (XS, "s", "return lax.scan(body, 0.0, xs)"),
    "fori": (XS, "t", "return lax.fori_loop(0, 3, body, 0.0)"),
    "while_body": (X1_WEAK, "s", "return lax.while_loop(cond, body, 0)"),
    "cond": (X1_WEAK, "s", "return lax.cond(x > 0, yes, no, x)"),
    "switch": (X1_WEAK, "s", "return lax.switch(1, [b0, b1], x)"),
    "map": (XS, "s", "return lax.map(fn, xs)"),
    "ckpt": (X1_WEAK, "s", "return checkpoint(g)(x)"),
    "bound": (XS, "kid.k", "return lax.scan(self.kid.step, 0.0, xs)"),
    "helper": (XS, "h", "return LAXW.scan(body, 0.0, xs)[0]"),
    "carry": (XS, "kid.k", "kid, _ = lax.scan(body, self.kid, xs)"),
    "ckpt_method": (X1_WEAK, "s", "return self._block(x)"),
}


def _lax_build(method: str, fail: str | None) -> str:
    return f"Lax({fail!r})" if method in ("bound", "ckpt_method") else "Lax()"


# A body that raises before its first write is refused by the one abstract trace that
# finds what it assigns, the same for every lax call: a loop with a carry, branches, a
# cond/body pair, a sub-model's bound method, the decorator, a helper outside the class.
# (fori, switch, map, checkpoint(g) and a model as the carry take that path too.)
BEFORE_ROADS = ["bound", "cond", "ckpt_method", "helper", "scan", "while_body"]


@pytest.mark.parametrize("method", BEFORE_ROADS)
def test_lax_body_raises_before_any_write(write_module: Loader, method: str) -> None:
    """Plain Python's loop raised on its first trip before the write: the
    model is exactly plain Python's (the write made before the lax call
    kept), and everything works afterwards."""
    plain, dec = pair(write_module, LAX)
    arg, _, _ = LAX_ROADS[method]
    raise_and_recover(
        plain, dec, _lax_build(method, "before"),
        before=[("__call__", (X1_WEAK,))],
        raising=(method, (arg, "before")),
        exc=Exception,
        after=_lax_after(method, arg),
    )


def _lax_after(method: str, arg: Any) -> list[Call]:
    """What runs after the raise: a plain call, the method again; after the scan, a
    static state changed eagerly (read by the scan body) first."""
    again = [] if method in ("bound", "ckpt_method") else [(method, (arg, None))]
    mode = [("set_mode", ("double",))] if method == "scan" else []
    return [*mode, ("__call__", (X2_WEAK,)), *again]


@pytest.mark.parametrize("method", sorted(LAX_ROADS))
def test_lax_body_raises_after_a_write(write_module: Loader, method: str) -> None:
    """Plain Python's loop kept the write made before the raise; JAX keeps
    nothing the traced body computed: the documented ControlFlowStateError
    on reading that state (naming the body's line), every other attribute
    (the write before the lax call too) plain Python's, no tracer left, and
    assigning the state again (``reset``) makes the model whole."""
    plain, dec = pair(write_module, LAX)
    arg, attr, text = LAX_ROADS[method]
    raise_and_recover(
        plain, dec, _lax_build(method, "after"),
        before=[("__call__", (X1_WEAK,))],
        raising=(method, (arg, "after")),
        exc=Exception,
        lost=[(attr, text)],
        repair=("reset", ()),
        after=_lax_after(method, arg),
    )


def test_while_cond_raises(write_module: Loader) -> None:
    """``cond_fun`` raising: plain Python's loop raised before its body ran."""
    plain, dec = pair(write_module, LAX)
    raise_and_recover(
        plain, dec, "Lax()",
        before=[("__call__", (X1_WEAK,))],
        raising=("while_body", (X1_WEAK, "cond")),
        exc=Exception,
        after=[("__call__", (X2_WEAK,)), ("while_body", (X1_WEAK, None))],
    )


TRY = """
import contextlib


class Boom(Exception):
    pass


@DECORATE
class Kid:
    def __init__(self):
        self.k = jnp.zeros(())

    def bump(self, x, fail):
        self.k = self.k + x
        if fail:
            raise Boom("kid")
        return self.k


@DECORATE
class Guard:
    def __init__(self, model):
        self.model = model
        self.exits = jnp.zeros(())

    def __enter__(self):
        self.model.a = self.model.a + 100.0
        return self

    def __exit__(self, kind, value, tb):
        self.exits = self.exits + (1.0 if kind is None else -1.0)
        self.model.b = self.model.b * 3
        return False


@DECORATE
class Try:
    def __init__(self):
        self.a = jnp.zeros(())
        self.b = jnp.ones(())
        self.c = jnp.zeros(())
        self.errors = jnp.zeros((), jnp.int32)
        self.kid = Kid()

    def clauses(self, x, fail):
        try:
            self.a = self.a + x
            if fail:
                raise Boom("x")
            self.b = self.b + x
        except Boom:
            self.errors = self.errors + 1
            self.c = self.c - x
        else:
            self.c = self.c + 10 * x
        finally:
            self.b = self.b * 2
        return self.a + self.b + self.c

    def return_in_finally(self, x, fail):
        try:
            self.a = self.a + x
            if fail:
                raise KeyError("swallowed by the return")
            return self.a
        finally:
            self.b = self.b + 1
            return self.b  # noqa: B012

    def suppress(self, x, fail):
        with contextlib.suppress(ZeroDivisionError):
            self.a = self.a + x
            if fail:
                raise ZeroDivisionError
            self.b = self.b + x
        self.c = self.c + 1
        return self.a

    def raise_from(self, x, fail):
        try:
            try:
                self.a = self.a + x
                if fail:
                    raise KeyError("inner")
            except KeyError as e:
                self.b = self.b + 1
                raise RuntimeError("outer") from e
        except RuntimeError as e:
            self.c = self.c + (1.0 if isinstance(e.__cause__, KeyError) else -1.0)
        return self.c

    def groups(self, x, fail):
        try:
            self.a = self.a + x
            if fail:
                raise ExceptionGroup("g", [ValueError("v"), KeyError("k")])
        except* ValueError:
            self.b = self.b + 1
        except* KeyError:
            self.c = self.c + 1
        return self.a

    def kid_caught(self, x, fail):
        try:
            self.kid.bump(x, fail)
        except Boom:
            self.errors = self.errors + 1
            self.kid.k = self.kid.k * 2
        return self.kid.k

    def reraise(self, x, fail):
        try:
            self.a = self.a + x
            if fail:
                raise Boom("again")
        except Boom:
            self.errors = self.errors + 1
            raise
        finally:
            self.c = self.c + 0.5

    def with_exit(self, x, fail):
        with Guard(self) as g:
            self.c = self.c + x
            if fail:
                raise Boom("in with")
        return g.exits

    def with_exit_caught(self, x, fail):
        try:
            return self.with_exit(x, fail)
        except Boom:
            return self.c

    def in_scan(self, xs, fail):
        def body(carry, x):
            try:
                self.a = self.a + x
                if fail:
                    raise ValueError("in body")
                self.c = self.c - x
            except ValueError:
                self.errors = self.errors + 1
            finally:
                self.b = self.b + 1
            try:
                self.kid.bump(x, fail)
            except Boom:
                self.kid.k = self.kid.k + 100.0
            return carry + self.a, self.a
        return lax.scan(body, 0.0, xs)

    def loop_continue(self, xs, fail):
        for i in range(3):
            try:
                self.a = self.a + xs[i]
                if fail and i == 1:
                    raise Boom("skip")
                self.b = self.b + 1
            except Boom:
                continue
            finally:
                self.c = self.c + 1
        return self.a
"""


TRY_CALLS = {
    "clauses": X1_WEAK,
    "return_in_finally": X1_WEAK,
    "suppress": X1_WEAK,
    "raise_from": X1_WEAK,
    "groups": X1_WEAK,
    "kid_caught": X1_WEAK,
    "with_exit_caught": X1_WEAK,
    "in_scan": XS,
    "loop_continue": XS,
}


@pytest.mark.parametrize("method", sorted(TRY_CALLS))
def test_try_forms(write_module: Loader, method: str) -> None:
    plain, dec = pair(write_module, TRY)
    x = TRY_CALLS[method]
    run_modes(plain, dec, "Try()", [(method, (x, False)), (method, (x, True)), (method, (x, False))])


def test_reraise_after_except_and_finally_wrote(write_module: Loader) -> None:
    plain, dec = pair(write_module, TRY)
    raise_and_recover(
        plain, dec, "Try()",
        before=[("clauses", (X1_WEAK, True))],
        raising=("reraise", (X1_WEAK, True)),
        exc=Exception,
        after=[("clauses", (X2_WEAK, False)), ("reraise", (X2_WEAK, False))],
    )


def test_exit_writes_while_the_exception_passes(write_module: Loader) -> None:
    """``__exit__`` of a decorated context manager writes state while the
    exception passes through it and on out of the method."""
    plain, dec = pair(write_module, TRY)
    raise_and_recover(
        plain, dec, "Try()",
        before=[("with_exit", (X1_WEAK, False))],
        raising=("with_exit", (X1_WEAK, True)),
        exc=Exception,
        after=[("with_exit", (X2_WEAK, False))],
    )


CAUGHT = """
@DECORATE
class Caught:
    def __init__(self):
        self.a = jnp.zeros(())
        self.flag = jnp.zeros(())
        self.mode = "train"
        self.count = 0

    def set_mode(self, x):
        try:
            self.mode = "eval"
        except Exception:
            self.a = self.a - 100.0
        self.a = self.a + x
        return self.a

    def count_up(self, x):
        try:
            self.count = self.count + 1
        except ValueError:
            self.a = self.a - 100.0
        self.a = self.a + x
        return self.a

    def note(self, x):
        try:
            setattr(self, "no" + "te", x)
        except AttributeError:
            self.a = self.a - 100.0
        self.a = self.a + x
        return self.a

    def mode_in_scan(self, xs):
        def body(c, x):
            try:
                self.mode = "eval"
            except Exception:
                pass
            self.a = self.a + x
            return c, None
        lax.scan(body, 0.0, xs)
        return self.a

    def if_on_state(self, x):
        try:
            if self.flag > 0:
                self.a = self.a + 10.0
        except TypeError:
            self.a = self.a - 100.0
        self.a = self.a + x
        return self.a

    def lost_then_caught(self, xs):
        def body(c, x):
            self.flag = self.flag + x
            raise KeyError("body")
        try:
            lax.scan(body, 0.0, xs)
        except KeyError:
            pass
        try:
            seen = self.flag
        except autostate.AutostateError:
            self.flag = jnp.asarray(-1.0)
            seen = self.flag
        self.a = self.a + seen
        return self.a

    def mode_unguarded(self, x):
        self.mode = "eval"
        self.a = self.a + x
        return self.a

    def step(self, x):
        self.a = self.a * 2 + x
        self.flag = self.flag + 1
        return self.a
"""


@pytest.mark.parametrize("method", ["set_mode", "count_up", "note"])
@pytest.mark.parametrize("jit", [False, True])
def test_refusal_swallowed_by_the_users_except_through_f(
    write_module: Loader, method: str, jit: bool
) -> None:
    """Eagerly the method means what plain Python means; through ``f`` the
    change cannot be made, and the promise is an autostate error, not a
    result plain Python never gives."""
    plain, dec = pair(write_module, CAUGHT)
    ref, model = plain.Caught(), dec.Caught()
    same(snapshot(ecall(ref, method, (X1_WEAK,))), snapshot(ecall(model, method, (X1_WEAK,))), "eager")
    same(snapshot(ref), snapshot(model), "eager attributes")
    f, states = dec.Caught().functionalize()
    # The refusal the method caught is raised again when the call returns.
    with pytest.raises((autostate.errors.StaticStateError, autostate.errors.StateAccessError)) as err:
        fcall(f, method, states, (X1_WEAK,), jit)
    assert "code there caught it" in "".join(getattr(err.value, "__notes__", ()))
    no_handler_left()
    no_tracers(f)
    same(snapshot(plain.Caught().if_on_state(X1_WEAK)),
         snapshot(fcall(f, "if_on_state", states, (X1_WEAK,), False)[0]), "f works afterwards")


def test_static_write_refused_in_an_eager_lax_body_swallowed(write_module: Loader) -> None:
    plain, dec = pair(write_module, CAUGHT)
    ref, model = plain.Caught(), dec.Caught()
    with pytest.raises(autostate.errors.StaticStateError) as err:
        model.mode_in_scan(XS)
    assert "code there caught it" in "".join(getattr(err.value, "__notes__", ()))
    assert model.mode == ref.mode == "train"
    no_tracers(model)


def test_refusal_through_f_not_caught_then_everything_works(write_module: Loader) -> None:
    """The documented StaticStateError escapes f; f, the model, a new
    functionalize() and freeze work afterwards."""
    plain, dec = pair(write_module, CAUGHT)
    model = dec.Caught()
    f, states = model.functionalize()
    given = states_snapshot(states)
    for jit in (False, True):
        with pytest.raises(autostate.errors.StaticStateError) as err:
            fcall(f, "mode_unguarded", states, (X1_WEAK,), jit)
        user_line(err.value, dec, 'self.mode = "eval"')
        same(given, states_snapshot(states), "states given")
        no_handler_left()
        no_tracers(model, f)
    ref = plain.Caught()
    for x in (X1_WEAK, X2_WEAK):
        out, states = fcall(f, "step", states, (x,), True)
        same(snapshot(ref.step(x)), snapshot(out), "f after the refusal")
    same(snapshot(ref), snapshot(autostate.freeze(f, states)), "frozen")
    ref2 = plain.Caught()
    same(snapshot(ref2.mode_unguarded(X1_WEAK)), snapshot(model.mode_unguarded(X1_WEAK)), "eager after")
    same(snapshot(ref2), snapshot(model), "eager attributes after")
    f2, s2 = model.functionalize()
    compare_states(ref2, s2, "functionalize again")
    out, s2 = fcall(f2, "step", s2, (X2_WEAK,), True)
    same(snapshot(ref2.step(X2_WEAK)), snapshot(out), "new f")


def test_traced_value_error_caught_by_except_type_error_under_jit(write_module: Loader) -> None:
    """``if`` on a state under jit: the TracedValueError is JAX's
    TracerBoolConversionError (a TypeError); the method's ``except TypeError``
    runs, as it does in hand-written JAX, and the state it then writes is
    threaded. Eagerly and through f without jit the ``if`` is plain Python's."""
    plain, dec = pair(write_module, CAUGHT)
    run_modes(plain, dec, "Caught()", [("if_on_state", (X1_WEAK,)), ("step", (X2_WEAK,)),
                                        ("if_on_state", (X1_WEAK,))], modes=("eager", "f"))
    f, states = dec.Caught().functionalize()
    out, states = fcall(f, "if_on_state", states, (X1_WEAK,), True)
    same(np.float32(-100.0 + 1.5), np.asarray(out), "the except clause ran under jit")
    ref = plain.Caught()
    ref.a = jnp.asarray(-98.5)
    out, states = fcall(f, "step", states, (X2_WEAK,), True)
    same(snapshot(ref.step(X2_WEAK)), snapshot(out), "jit after the caught error")
    compare_states(ref, states, "jit")
    no_handler_left()


def test_lost_state_error_caught_then_assigned(write_module: Loader) -> None:
    """Reading a state a raising lax body lost is a ControlFlowStateError;
    caught by the method, which assigns the state and goes on: eagerly,
    through f and under jit the result is that of the method's fallback."""
    plain, dec = pair(write_module, CAUGHT)
    ref = plain.Caught()
    ref.lost_then_caught(XS)  # plain Python reads the loop's value instead: no error
    want = np.float32(-1.0)
    model = dec.Caught()
    same(want, np.asarray(model.lost_then_caught(XS)), "eager")
    same(want, np.asarray(model.flag), "eager flag")
    no_tracers(model)
    for jit in (False, True):
        f, states = dec.Caught().functionalize()
        out, states = fcall(f, "lost_then_caught", states, (XS,), jit)
        same(want, np.asarray(out), f"jit={jit}")
        same(want, np.asarray(states["flag"]), f"jit={jit} flag")
        out, states = fcall(f, "step", states, (X1_WEAK,), jit)
        same(np.float32(-2.0 + 1.5), np.asarray(out), f"jit={jit} step after")
    no_handler_left()


BASE = """
class Stop(BaseException):
    pass


KINDS = {"kb": KeyboardInterrupt, "exit": SystemExit, "gen": GeneratorExit, "stop": Stop,
         "value": ValueError}


def set_first(obj, v):
    obj.items[0] = v


@DECORATE
class Leaf:
    def __init__(self):
        self.items = [jnp.zeros(())]


@DECORATE
class Kid:
    def __init__(self):
        self.k = jnp.zeros(())

    def bump(self, x, kind):
        self.k = self.k + x
        if kind is not None:
            raise KINDS[kind]()
        return self.k


@DECORATE
class Base:
    def __init__(self):
        self.a = jnp.zeros(())
        self.s = jnp.zeros(())
        self.kid = Kid()
        self.leaf = Leaf()

    def method(self, x, kind):
        self.a = self.a + x
        return self.kid.bump(x * 2, kind)

    def in_scan(self, xs, kind):
        def body(c, x):
            self.s = self.s + x
            if kind is not None:
                raise KINDS[kind]()
            return c, None
        lax.scan(body, 0.0, xs)
        return self.s

    def in_checkpoint(self, x, kind):
        def g(v):
            self.s = self.s + v
            if kind is not None:
                raise KINDS[kind]()
            return v
        return checkpoint(g)(x)

    def captured(self, xs, kind):
        seen = []
        def body(c, x):
            seen.append(x)
            if kind is not None:
                raise KINDS[kind]()
            return c, None
        try:
            lax.scan(body, 0.0, xs)
        except (KeyboardInterrupt, Stop, ValueError):
            pass
        return seen

    def leaf_items(self, xs, kind):
        def body(c, x):
            set_first(self.leaf, x)
            raise KINDS[kind]()
        lax.scan(body, 0.0, xs)

    def reset(self):
        self.s = jnp.asarray(0.5)

    def __call__(self, x):
        self.a = self.a * 2 + x
        self.s = self.s + self.kid.bump(x, None)
        return self.a + self.s + self.leaf.items[0]
"""


BASE_KINDS = {"kb": KeyboardInterrupt, "exit": SystemExit, "gen": GeneratorExit,
              "stop": BaseException}


@pytest.mark.parametrize("kind", sorted(BASE_KINDS))
def test_base_exception_from_a_method_after_writes(write_module: Loader, kind: str) -> None:
    plain, dec = pair(write_module, BASE)
    raise_and_recover(
        plain, dec, "Base()",
        before=[("__call__", (X1_WEAK,))],
        raising=("method", (X1_WEAK, kind)),
        exc=BASE_KINDS[kind],
        after=[("__call__", (X2_WEAK,)), ("method", (X2_WEAK, None))],
    )


def test_custom_base_exception_in_an_eager_lax_body_loses_the_state(write_module: Loader) -> None:
    plain, dec = pair(write_module, BASE)
    for method, text in (("in_scan", "lax.scan(body, 0.0, xs)"),
                         ("in_checkpoint", "return checkpoint(g)(x)")):
        raise_and_recover(
            plain, dec, "Base()",
            before=[("__call__", (X1_WEAK,))],
            raising=(method, (XS if method == "in_scan" else X1_WEAK, "stop")),
            exc=BaseException,
            lost=[("s", text)],
            repair=("reset", ()),
            after=[("__call__", (X2_WEAK,))],
        )


@pytest.mark.parametrize("kind", ["kb", "exit", "gen"])
@pytest.mark.parametrize("method", ["in_scan", "in_checkpoint"])
def test_interrupt_in_an_eager_lax_body_after_a_write(
    write_module: Loader, kind: str, method: str
) -> None:
    plain, dec = pair(write_module, BASE)
    ref, model = plain.Base(), dec.Base()
    arg = XS if method == "in_scan" else X1_WEAK
    for obj in (ref, model):
        with pytest.raises(BASE_KINDS[kind]):
            ecall(obj, method, (arg, kind))
    no_handler_left()
    no_tracers(model)
    with pytest.raises(autostate.errors.ControlFlowStateError):
        model.s  # noqa: B018 - not silently wrong: what a ValueError gets


@pytest.mark.parametrize("kind", ["kb", "stop"])
def test_interrupt_in_a_lax_body_through_f(write_module: Loader, kind: str) -> None:
    plain, dec = pair(write_module, BASE)
    raise_and_recover(
        plain, dec, "Base()",
        before=[("__call__", (X1_WEAK,))],
        raising=("in_scan", (XS, kind)),
        exc=BASE_KINDS[kind],
        after=[("__call__", (X2_WEAK,)), ("in_scan", (XS, None))],
        modes=("f", "jit"),
    )


@pytest.mark.parametrize("kind", [None, "value"])
def test_captured_and_non_state_list_changed_in_a_body_is_refused(
    write_module: Loader, kind: str | None
) -> None:
    """The documented EscapedStateError (a list changed in place would hold the
    body's tracer), also when the body then raises; the list is put back, and
    the model and f work afterwards."""
    plain, dec = pair(write_module, BASE)
    model = dec.Base()
    f, states = model.functionalize()
    calls = [lambda: model.captured(XS, kind), lambda: f.captured(states, XS, kind),
             lambda: staged(f.captured, static_argnums=2)(states, XS, kind)]
    if kind is not None:
        calls += [lambda: model.leaf_items(XS, kind), lambda: f.leaf_items(states, XS, kind),
                  lambda: staged(f.leaf_items, static_argnums=2)(states, XS, kind)]
    for call in calls:
        with pytest.raises(autostate.errors.EscapedStateError) as err:
            call()
        user_line(err.value, dec, "lax.scan(body, 0.0, xs)")
        no_tracers(model, f)
        no_handler_left()
    ref = plain.Base()
    same(snapshot(ref(X1_WEAK)), snapshot(model(X1_WEAK)), "eager after")
    same(snapshot(ref), snapshot(model), "eager attributes after")
    ref = plain.Base()
    out, states = fcall(f, "__call__", states, (X2_WEAK,), True)
    same(snapshot(ref(X2_WEAK)), snapshot(out), "jit after")


@pytest.mark.parametrize("kind", ["kb", "stop"])
@pytest.mark.parametrize("road", ["eager", "f", "jit"])
def test_interrupt_after_a_list_changed_in_a_body_leaks_no_tracer(
    write_module: Loader, kind: str, road: str
) -> None:
    _, dec = pair(write_module, BASE)
    model = dec.Base()
    f, states = model.functionalize()
    for method in ("captured", "leaf_items"):
        try:
            if road == "eager":
                out = ecall(model, method, (XS, kind))
            else:
                out, _ = fcall(f, method, states, (XS, kind), road == "jit")
        except autostate.AutostateError:
            out = None  # a clear refusal would do
        except BaseException as raised:  # noqa: BLE001 - KeyboardInterrupt is the case
            if isinstance(raised, Exception):
                raise AssertionError(f"not an autostate error: {raised!r}") from raised
            out = None
        no_tracers(out, model, f)
    out, _ = fcall(f, "__call__", states, (X1_WEAK,), road == "jit")
    model(X1_WEAK)


INIT = """
import enum


class Split(enum.Enum):
    TRAIN = "train"
    EVAL = "eval"


LAST = []


class Table:
    def __init__(self):
        self.w = jnp.ones(2)


@DECORATE
class Kid:
    def __init__(self, fail=False):
        self.k = jnp.zeros(())
        if fail:
            raise ValueError("kid __init__")
        self.j = jnp.ones(())

    def bump(self, x):
        self.k = self.k + x
        self.j = self.j * 2
        return self.k


@DECORATE
class Model:
    def __init__(self, fail=None):
        LAST.append(self)
        self.a = jnp.zeros(())
        self.kid = Kid(fail == "kid")
        if fail == "model":
            raise ValueError("model __init__")
        self.b = jnp.ones((2,))
        self.counts = {"train": jnp.zeros(()), "eval": jnp.zeros(())}
        self.extra = None

    def use_enum_keys(self):
        self.counts = {Split.TRAIN: jnp.zeros(()), Split.EVAL: jnp.ones(())}

    def use_str_keys(self):
        self.counts = {"train": jnp.ones(()), "eval": jnp.zeros(())}

    def attach_table(self):
        self.extra = Table()

    def detach_table(self):
        self.extra = None

    def scan(self, xs):
        self.a = self.a + 100.0
        def body(c, x):
            self.a = self.a + x
            return c + self.a, None
        return lax.scan(body, 0.0, xs)[0]

    def half(self, x):
        self.a = self.a + x
        return self.a

    def __call__(self, x):
        self.a = self.a + x
        self.b = self.b * self.kid.bump(x)
        self.counts["train"] = self.counts["train"] + 1
        return self.a + self.b.sum()


class Sub(Model):
    def __init__(self, fail=None):
        self.c = jnp.ones(())
        if fail == "sub":
            raise ValueError("sub __init__ before super")
        super().__init__(fail)
        self.d = self.c + 1
"""


@pytest.mark.parametrize(("cls", "fail"), [("Model", "model"), ("Model", "kid"),
                                           ("Sub", "model"), ("Sub", "kid"), ("Sub", "sub")])
def test_init_raising_midway_then_built_again(write_module: Loader, cls: str, fail: str) -> None:
    plain, dec = pair(write_module, INIT)
    for mod in (plain, dec):
        with pytest.raises(ValueError, match="__init__"):
            getattr(mod, cls)(fail)
    no_handler_left()
    run_modes(plain, dec, f"{cls}()", [("__call__", (X1_WEAK,)), ("scan", (XS,)), ("__call__", (X2_WEAK,))])


def test_half_built_instance_used(write_module: Loader) -> None:
    """The instance an ``__init__`` that raised left behind (kept by the user)
    works as plain Python's does: eagerly, through ``f`` and under ``jit``."""
    plain, dec = pair(write_module, INIT)
    halves = []
    for mod in (plain, dec):
        with pytest.raises(ValueError):
            mod.Model("model")
        halves.append(mod.LAST[-1])
    ref, model = halves
    same(snapshot(ref.half(X1_WEAK)), snapshot(model.half(X1_WEAK)), "eager")
    same(snapshot(ref), snapshot(model), "eager attributes")
    f, states = model.functionalize()
    compare_states(ref, states, "functionalize")
    out, states = fcall(f, "half", states, (X2_WEAK,), True)
    same(snapshot(ref.half(X2_WEAK)), snapshot(out), "jit")
    same(snapshot(ref), snapshot(autostate.freeze(f, states)), "frozen")
    no_tracers(model, f)


def test_functionalize_refused_then_fixed(write_module: Loader) -> None:
    """functionalize() refuses a dict state whose keys do not sort (the
    documented ``InvalidTypeError``, twice); the model stays usable eagerly,
    and once fixed it functionalizes."""
    plain, dec = pair(write_module, INIT)
    ref, model = plain.Model(), dec.Model()
    for obj in (ref, model):
        obj(X1_WEAK)
        obj.use_enum_keys()
    for _ in range(2):
        with pytest.raises(autostate.errors.InvalidTypeError) as err:
            model.functionalize()
        user_line(err.value, dec, "self.counts = {Split.TRAIN")
    no_handler_left()
    no_tracers(model)
    same(snapshot(ref.half(X2_WEAK)), snapshot(model.half(X2_WEAK)), "eager after the refusal")
    for obj in (ref, model):
        obj.use_str_keys()
    f, states = model.functionalize()
    compare_states(ref, states, "functionalize after the fix")
    for x in (X1_WEAK, X2_WEAK):
        out, states = fcall(f, "__call__", states, (x,), True)
        same(snapshot(ref(x)), snapshot(out), "jit after the fix")
    same(snapshot(ref), snapshot(autostate.freeze(f, states)), "frozen")


@pytest.mark.xfail(strict=True, reason=(
    "BUG (open): a state holding an undecorated object with arrays (`self.extra = Table()` in "
    "a method) goes into `states` (eagerly and through f it works, as plain Python), and "
    "jax.jit(f) fails with JAX's own TypeError 'Error interpreting argument ... as an "
    "abstract array' naming s['extra']. Refusing it at functionalize() breaks the eager f "
    "carrying its attributes breaks pytrees JAX rebuilt with objects "
    "for leaves (orbax's restore arguments)"
))
def test_state_holding_an_undecorated_object_with_arrays(write_module: Loader) -> None:
    _, dec = pair(write_module, INIT)
    model = dec.Model()
    model.attach_table()
    try:
        f, states = model.functionalize()
        fcall(f, "__call__", states, (X1_WEAK,), True)
    except autostate.AutostateError as err:
        user_line(err, dec, "self.extra = Table()")


def test_undecorated_object_with_arrays_in_an_attribute_is_refused(write_module: Loader) -> None:
    """The documented refusal, then the model is used eagerly as before."""
    plain, dec = pair(write_module, INIT)
    ref, model = plain.Model(), dec.Model()
    ref.table, model.table = plain.Table(), dec.Table()
    with pytest.raises(autostate.errors.InvalidTypeError, match="Table"):
        model.functionalize()
    no_handler_left()
    same(snapshot(ref(X1_WEAK)), snapshot(model(X1_WEAK)), "eager after the refusal")
    del ref.table, model.table
    f, states = model.functionalize()
    out, states = fcall(f, "__call__", states, (X2_WEAK,), True)
    same(snapshot(ref(X2_WEAK)), snapshot(out), "jit after the attribute is gone")


def test_eager_lax_call_refused_then_fixed(write_module: Loader) -> None:
    """An eager lax call that must thread a dict state whose keys do not sort
    is refused (documented); the write before it stays, the model's slots are
    back (no handler left, no tracer), and once fixed the call works."""
    plain, dec = pair(write_module, INIT)
    ref, model = plain.Model(), dec.Model()
    for obj in (ref, model):
        obj.use_enum_keys()
    with pytest.raises(autostate.errors.InvalidTypeError) as err:
        model.scan(XS)
    user_line(err.value, dec, "return lax.scan(body, 0.0, xs)[0]")
    no_handler_left()
    no_tracers(model)
    same(np.float32(100.0), np.asarray(model.a), "the write before the lax call")
    model.a = jnp.zeros(())
    for obj in (ref, model):
        obj.use_str_keys()
    same(snapshot(ref.scan(XS)), snapshot(model.scan(XS)), "scan after the fix")
    same(snapshot(ref), snapshot(model), "attributes after the fix")


def test_freeze_with_wrong_states_then_right(write_module: Loader) -> None:
    """``freeze`` refused (a missing key, an extra key), ``f`` refused (those,
    ``None``, a list); f and a freeze with the right states work afterwards."""
    plain, dec = pair(write_module, INIT)
    ref, model = plain.Model(), dec.Model()
    f, states = model.functionalize()
    out, states = fcall(f, "__call__", states, (X1_WEAK,), True)
    ref(X1_WEAK)
    missing = {k: v for k, v in states.items() if k != "a"}
    extra = {**states, "zzz": jnp.zeros(())}
    wrong_shape = {**states, "b": jnp.zeros((3,))}
    for bad in (missing, extra, wrong_shape):
        try:
            frozen = autostate.freeze(f, bad)
        except autostate.AutostateError:
            continue
        except Exception as raised:  # noqa: BLE001
            raise AssertionError(f"freeze raised a non-autostate error: {raised!r}") from raised
        if bad is wrong_shape:
            continue  # a state may change shape between calls (eagerly it can)
        raise AssertionError(f"freeze accepted {sorted(bad)}: {snapshot(frozen)}")
    for bad in (missing, extra, None, list(states.values())):
        for jit in (False, True):
            with pytest.raises(autostate.AutostateError):
                fcall(f, "__call__", bad, (X2_WEAK,), jit)
    no_handler_left()
    out, states = fcall(f, "__call__", states, (X2_WEAK,), True)
    same(snapshot(ref(X2_WEAK)), snapshot(out), "f after the refused freeze")
    same(snapshot(ref), snapshot(autostate.freeze(f, states)), "frozen")
    no_tracers(model, f)


NEVER_RUN = {
    "cond": (X1_WEAK, True),
    "switch": (X1_WEAK,),
    "empty_scan": (X1_WEAK,),
    "zero_fori": (X1_WEAK,),
    "false_while": (X1_WEAK,),
}


@pytest.mark.xfail(strict=True, reason=(
    "KNOWN (documented in docs/control_flow.md; JAX traces what plain Python never runs): a lax.cond / switch branch "
    "that is not taken (concrete index), a lax.scan over zero elements, a fori_loop(0, 0), a "
    "while_loop whose cond is false at once: if that body raises, the call raises the user's "
    "Boom where plain Python returns (eagerly, through f, under jit); eagerly the state the "
    "body assigned (which plain Python never touched) then reads as ControlFlowStateError"
))
@pytest.mark.parametrize("method", sorted(NEVER_RUN))
def test_a_body_plain_python_never_runs_raises(write_module: Loader, method: str) -> None:
    plain, dec = pair(write_module, MORE)
    run_modes(plain, dec, "Branchy()", [(method, NEVER_RUN[method]), ("step", (X2_WEAK, False))])


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_raise_under_grad_or_vmap_of_f_then_again(write_module: Loader, transform: str) -> None:
    """A raise while ``jax.grad`` / ``jax.vmap`` traces f: it propagates, and
    the same transformation of f afterwards agrees with plain Python."""
    plain, dec = pair(write_module, MORE)
    f, states = dec.Branchy().functionalize()

    def run(fn: Callable[..., Any], xv: Any, fail: bool) -> Any:
        out, s = fn(xv, fail)
        return jnp.sum(out) + sum(jnp.sum(v) for v in s.values())

    def dec_fn(xv: Any, fail: bool) -> Any:
        s = states
        out, s = f.step(s, xv, False)
        return f.step(s, xv * 2, fail)

    def plain_fn(xv: Any, fail: bool) -> Any:
        m = plain.Branchy()
        m.step(xv, False)
        out = m.step(xv * 2, fail)
        return out, {"s": m.s, "t": m.t}

    xs = jnp.asarray([0.5, 1.0])
    if transform == "grad":
        trans = lambda fn, fail: jax.grad(lambda xv: run(fn, xv, fail))  # noqa: E731
        arg = X1_WEAK
    else:
        trans = lambda fn, fail: jax.vmap(lambda xv: fn(xv, fail))  # noqa: E731
        arg = xs
    for _ in range(2):
        with pytest.raises(Exception, match="step"):
            trans(dec_fn, True)(arg)
        no_handler_left()
        no_tracers(f, states)
        same(snapshot(trans(plain_fn, False)(arg)), snapshot(trans(dec_fn, False)(arg)), transform)
        same(snapshot(trans(plain_fn, False)(arg)),
             snapshot(staged(trans(dec_fn, False))(arg)), f"jit {transform}")


GEN = """
class Boom(Exception):
    pass


@DECORATE
class Gen:
    def __init__(self):
        self.a = jnp.zeros(())
        self.c = jnp.zeros(())

    def closed(self, x):
        def g():
            try:
                while True:
                    self.a = self.a + x
                    yield self.a
            finally:
                self.c = self.c + 1
        it = g()
        next(it)
        next(it)
        it.close()
        return self.a

    def thrown(self, x):
        def g():
            try:
                while True:
                    self.a = self.a + x
                    yield self.a
            except ValueError:
                self.c = self.c - 1
                yield self.c
        it = g()
        next(it)
        return it.throw(ValueError("into the generator"))

    def alive_after_raise(self, x):
        def g():
            try:
                while True:
                    self.a = self.a + x
                    yield self.a
            finally:
                self.c = self.c + 10
        it = g()
        next(it)
        raise Boom("with a live generator")

    def step(self, x):
        self.a = self.a * 2 + x
        return self.a + self.c


@DECORATE
class Countdown:
    def __init__(self, n):
        self.n = n
        self.pos = 0
        self.total = jnp.zeros(())

    def __iter__(self):
        return self

    def __next__(self):
        self.total = self.total + 1.0
        if self.pos >= self.n:
            raise StopIteration
        self.pos += 1
        return self.total * self.pos
"""


@pytest.mark.parametrize("method", ["closed", "thrown"])
def test_generator_closed_or_thrown_into(write_module: Loader, method: str) -> None:
    """GeneratorExit from ``close()`` runs the generator's ``finally``, a
    ``throw()`` its ``except``: both write state, in every mode."""
    plain, dec = pair(write_module, GEN)
    run_modes(plain, dec, "Gen()", [(method, (X1_WEAK,)), ("step", (X2_WEAK,)), (method, (X2_WEAK,))])


@pytest.mark.usefixtures("young_gc")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_generator_kept_alive_by_the_exception(write_module: Loader) -> None:
    """The raise keeps the generator alive (its frame is in the traceback);
    its ``finally`` writes state when the exception is freed. Eagerly that is
    plain Python's; through f it runs after the call ended (an unraisable
    UnhandledLocalStateError), and f, its states, the model are untouched."""
    plain, dec = pair(write_module, GEN)
    ref, model = plain.Gen(), dec.Gen()
    for obj in (ref, model):
        with pytest.raises(Exception, match="live generator"):
            obj.alive_after_raise(X1_WEAK)
    gc.collect()
    same(snapshot(ref), snapshot(model), "eager, after the generator's finally")
    for jit in (False, True):
        ref, model = plain.Gen(), dec.Gen()
        f, states = model.functionalize()
        given = states_snapshot(states)
        with pytest.raises(Exception, match="live generator"):
            fcall(f, "alive_after_raise", states, (X1_WEAK,), jit)
        gc.collect()
        same(given, states_snapshot(states), "states given")
        no_tracers(f, model)
        no_handler_left()
        out, states = fcall(f, "step", states, (X2_WEAK,), jit)
        same(snapshot(ref.step(X2_WEAK)), snapshot(out), "f after")
        same(snapshot(ref), snapshot(autostate.freeze(f, states)), "frozen")


def test_stop_iteration_from_a_decorated_iterator(write_module: Loader) -> None:
    """``__next__`` writes state, then raises StopIteration: ``list(it)``,
    a ``for`` loop and ``next(it, default)`` see plain Python's values."""
    plain, dec = pair(write_module, GEN)
    got = []
    for mod in (plain, dec):
        it = mod.Countdown(3)
        first = list(it)
        again = [v for v in it]
        tail = next(it, "done")
        got.append(snapshot([first, again, tail, it]))
    same(got[0], got[1])


@pytest.mark.filterwarnings(
    "ignore:Python iterable type:DeprecationWarning"
)
def test_exception_through_contextmanager_restores_eagerly_and_f_keeps_states(
    write_module: Loader,
) -> None:
    plain, dec = pair(write_module, CMS)
    got = []
    for mod in (plain, dec):
        m = mod.Net()
        with pytest.raises(KeyError):
            m.raise_through_cm(A1)
        got.append(snapshot(m))
    same(got[0], got[1], "eager: the flag restored, the write kept")
    f, s = dec.Net().functionalize()
    for fn in (f.raise_through_cm, staged(f.raise_through_cm)):
        with pytest.raises(KeyError):
            fn(s, A1)
    out, s2 = f.with_self_flag(s, A1)
    ref = plain.Net()
    same(ref.with_self_flag(A1), out)


def differential(scenario: Callable[[Classes], Any], *, dtypes: bool = True) -> Any:
    """Runs ``scenario`` with the plain and the decorated classes; the observations match."""
    plain = scenario(PLAIN)
    decorated = scenario(DECORATED)
    same_observations(plain, decorated, "observation", dtypes)
    return decorated


def test_an_exception_after_a_write_keeps_it() -> None:
    def scenario(k: Classes) -> Any:
        model = written(k)
        twin = copy.copy(model)

        def fail(m: Any) -> None:
            raise ValueError("boom")

        with pytest.raises(ValueError, match="boom"):
            model.step_with_callback(filled(2.0), filled(3.0), fail)
        return [model.x, twin.x]

    differential(scenario)
