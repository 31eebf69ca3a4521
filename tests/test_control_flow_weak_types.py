"""Weak types of states written inside ``lax`` control flow, against plain Python.

A weakly typed state (a Python float, ``jnp.asarray(0.0)``) takes the dtype of
what it meets (``0.0 + bfloat16`` is bfloat16); a strong float32 array does
not. Plain Python's loop or branch makes a weak state strong only when the
body that assigns it runs. So:

- a loop whose trip count is known when traced (``scan``, ``map``,
  ``fori_loop`` with concrete bounds) is exact: zero trips leave the state as
  it was, one or more give what the body assigned;
- where the type would depend on what happens at run time (which ``cond`` /
  ``switch`` branch runs; whether a ``while_loop`` or a ``fori_loop`` with
  traced bounds runs its body at all), a state weak on one path and strong
  on another comes out strong, as after the path that makes it strong: the
  values are plain Python's, and exact when that path runs (decided: an
  error would refuse the common ``self.total = 0.0`` accumulator); a state
  of one kind on every path is exact.

Each case runs the plain module (``lax.*`` is a Python loop or ``if``) and the
decorated one eagerly, through ``f`` and through a jitted ``f``, and compares
outputs and states by dtype, weak type, shape and bits.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from differential import pair  # noqa: I001 - tests/ is on sys.path

Loader = Callable[..., types.ModuleType]

X1 = jnp.float32(1.5)
XS = jnp.arange(1.0, 4.0)
EMPTY = jnp.zeros((0,))
MODES = ("eager", "f", "jit")

SOURCE = """
BF = jnp.asarray(0.1, jnp.bfloat16)


@DECORATE
class Acc:
    def __init__(self, total=0.0):
        self.total = total

    def _add(self, v):
        self.total = self.total + v        # strong float32 v: a weak total becomes strong
        return v

    def _bump(self, v):
        self.total = self.total + 1.0      # a Python float keeps the total's kind
        return v

    def _reset(self, v):
        self.total = 1.0                   # a Python float: the total becomes weak
        return v

    def scan_reset(self, xs):
        lax.scan(lambda c, x: (self._reset(c), None), 0.0, xs)
        return self.total + BF

    def while_reset(self, x):
        lax.while_loop(lambda v: v < 3.0, lambda v: self._reset(v) + 1.0, x)
        return self.total + BF

    def cond_one(self, x):
        lax.cond(x > 0, self._add, lambda v: v, x)
        return self.total + BF

    def cond_both(self, x):
        def sub(v):
            self.total = self.total - v
            return v
        lax.cond(x > 0, self._add, sub, x)
        return self.total + BF

    def cond_kept(self, x):
        lax.cond(x > 0, self._bump, lambda v: v, x)
        return self.total + BF

    def switch_one(self, i, x):
        lax.switch(i, [lambda v: v, self._add, self._add], x)
        return self.total + BF

    def switch_all(self, i, x):
        lax.switch(i, [self._add, self._add], x)
        return self.total + BF

    def scan_all(self, xs):
        def body(c, x):
            self._add(x)
            return c, None
        lax.scan(body, 0, xs)
        return self.total + BF

    def scan_length(self, x):
        def body(c, _):
            self._add(x)
            return c, None
        lax.scan(body, 0, None, length=0)
        return self.total + BF

    def map_all(self, xs):
        lax.map(self._add, xs)
        return self.total + BF

    def fori_static(self, x):
        lax.fori_loop(2, 2, lambda i, v: self._add(v), x)
        empty = self.total + BF
        lax.fori_loop(0, 2, lambda i, v: self._add(v), x)
        return empty, self.total + BF

    def fori_bounds(self, n, x):
        lax.fori_loop(0, n, lambda i, v: self._add(v), x)
        return self.total + BF

    def fori_bounds_kept(self, n, x):
        lax.fori_loop(0, n, lambda i, v: self._bump(v), x)
        return self.total + BF

    def while_add(self, x):
        lax.while_loop(lambda v: v < 3.0, lambda v: self._add(v) + 1.0, x)
        return self.total + BF

    def while_kept(self, x):
        lax.while_loop(lambda v: v < 3.0, lambda v: self._bump(v) + 1.0, x)
        return self.total + BF
"""


def typed(v: Any, jitted: bool = False) -> Any:
    """A value as a comparable structure that keeps dtype, weak type, shape and bits.

    ``jitted``: a Python float that crossed a jit boundary, or that a traced body
    assigned (``self.total = self.total + 1.0``), is a weak 0-d float32 array; the
    plain value is compared so.
    """
    if isinstance(v, tuple):
        return tuple(typed(x, jitted) for x in v)
    if isinstance(v, float) and jitted:
        v = jnp.asarray(v)
    if isinstance(v, float):
        return ("pyfloat", v)
    assert isinstance(v, jax.Array), type(v)
    return ("arr", str(v.dtype), bool(v.weak_type), v.shape, np.asarray(v).tobytes())


def run(
    plain: types.ModuleType,
    dec: types.ModuleType,
    mode: str,
    name: str,
    *args: Any,
    traced_float: bool = False,
) -> Any:
    """Calls ``name`` on a fresh plain and decorated ``Acc()`` in ``mode``; asserts equal
    outputs and totals (types included); returns the plain output. ``traced_float``:
    the body assigns the state a Python float, which a traced body gives back as a weak
    0-d array."""
    ref = plain.Acc()
    expected = getattr(ref, name)(*args)
    model = dec.Acc()
    if mode == "eager":
        got, total = getattr(model, name)(*args), model.total
    else:
        f, states = model.functionalize()
        call = getattr(f, name)
        if mode == "jit":
            call = jax.jit(call)
        got, states = call(states, *args)
        total = states["total"]
    jitted = mode == "jit" or traced_float
    assert typed(got, jitted) == typed(expected, jitted), f"{mode} {name} output"
    assert typed(total, jitted) == typed(ref.total, jitted), f"{mode} {name} state"
    return expected


def strong_after(
    plain: types.ModuleType,
    dec: types.ModuleType,
    mode: str,
    name: str,
    *args: Any,
    total: Any = 0.0,
    weak: bool = False,
) -> None:
    """``name`` in ``mode`` gives plain Python's values, and the state comes out a
    strong float32 whichever path ran (``weak``: a weak one, as the body leaves it)."""
    ref, model = plain.Acc(total), dec.Acc(total)
    expected = getattr(ref, name)(*args)
    if mode == "eager":
        got, after = getattr(model, name)(*args), model.total
    else:
        f, states = model.functionalize()
        call = getattr(f, name)
        got, states = (jax.jit(call) if mode == "jit" else call)(states, *args)
        after = states["total"]
    np.testing.assert_allclose(np.float32(got), np.float32(expected), rtol=1e-2)
    np.testing.assert_allclose(np.float32(after), np.float32(ref.total))
    assert jnp.asarray(after).dtype == jnp.float32 and jax.typeof(after).weak_type == weak


@pytest.fixture
def modules(write_module: Loader) -> tuple[types.ModuleType, types.ModuleType]:
    return pair(write_module, SOURCE)


# --- loops that run a known number of times: exact ------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_zero_trip_scan_map_and_fori_leave_a_python_float_alone(modules: Any, mode: str) -> None:
    plain, dec = modules
    for name, args in (("scan_all", (EMPTY,)), ("scan_length", (X1,))):
        out = run(plain, dec, mode, name, *args)
        assert out.dtype == jnp.bfloat16  # 0.0 + bf16: the state stayed weak
    empty, after = run(plain, dec, mode, "fori_static", X1)
    assert (empty.dtype, after.dtype) == (jnp.bfloat16, jnp.float32)
    model = dec.Acc()
    if mode == "eager":  # (the plain map cannot stack zero outputs)
        out = model.map_all(EMPTY)
        assert type(model.total) is float and model.total == 0.0
    else:
        f, states = model.functionalize()
        out, states = (jax.jit(f.map_all) if mode == "jit" else f.map_all)(states, EMPTY)
        assert typed(states["total"], True) == typed(0.0, True)
    assert typed(out) == typed(jnp.asarray(0.0) + jnp.asarray(0.1, jnp.bfloat16))


@pytest.mark.parametrize("mode", MODES)
def test_loops_that_run_make_a_python_float_strong_like_plain(modules: Any, mode: str) -> None:
    plain, dec = modules
    for name in ("scan_all", "map_all"):
        assert run(plain, dec, mode, name, XS).dtype == jnp.float32


@pytest.mark.parametrize("n", [0, 3])
def test_fori_with_concrete_bounds_is_exact(modules: Any, n: int) -> None:
    """A concrete ``jnp`` bound is known when traced (``lax.fori_loop`` itself then scans)."""
    plain, dec = modules
    for mode in ("eager", "f"):
        out = run(plain, dec, mode, "fori_bounds", jnp.int32(n), X1)
        assert out.dtype == (jnp.float32 if n else jnp.bfloat16)


# --- which path runs is known only at run time: one kind on every path, or an error ----


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("x", [X1, -X1])
def test_cond_weak_in_one_branch_strong_in_the_other_comes_out_strong(
    modules: Any, mode: str, x: Any
) -> None:
    plain, dec = modules
    strong_after(plain, dec, mode, "cond_one", x)
    strong_after(plain, dec, mode, "switch_one", jnp.int32(0), x)


def test_the_branch_that_makes_it_strong_is_exact(modules: Any) -> None:
    plain, dec = modules
    for mode in MODES:
        assert run(plain, dec, mode, "cond_one", X1).dtype == jnp.float32


@pytest.mark.parametrize("mode", MODES)
def test_branches_of_one_kind_are_exact(modules: Any, mode: str) -> None:
    plain, dec = modules
    for x in (X1, -X1):
        assert run(plain, dec, mode, "cond_both", x).dtype == jnp.float32
        assert run(plain, dec, mode, "cond_kept", x, traced_float=True).dtype == jnp.bfloat16
    for i in (0, 1):
        assert run(plain, dec, mode, "switch_all", jnp.int32(i), X1).dtype == jnp.float32


@pytest.mark.parametrize("mode", MODES)
def test_a_strong_state_up_front_works_in_every_branch(modules: Any, mode: str) -> None:
    """The fix the error gives: ``jnp.float32(0.0)`` instead of ``0.0``."""
    plain, dec = modules
    for name, args in (("cond_one", (X1,)), ("cond_one", (-X1,)), ("switch_one", (0, X1))):
        ref, model = plain.Acc(jnp.float32(0.0)), dec.Acc(jnp.float32(0.0))
        expected = getattr(ref, name)(*args)
        if mode == "eager":
            got, total = getattr(model, name)(*args), model.total
        else:
            f, states = model.functionalize()
            call = getattr(f, name)
            got, states = (jax.jit(call) if mode == "jit" else call)(states, *args)
            total = states["total"]
        assert typed(got) == typed(expected) and expected.dtype == jnp.float32
        assert typed(total) == typed(ref.total)


@pytest.mark.parametrize("mode", MODES)
def test_while_loop_that_makes_a_weak_state_strong(modules: Any, mode: str) -> None:
    plain, dec = modules
    strong_after(plain, dec, mode, "while_add", X1)


def test_fori_with_traced_bounds_that_makes_a_weak_state_strong(modules: Any) -> None:
    plain, dec = modules
    strong_after(plain, dec, "jit", "fori_bounds", jnp.int32(3), X1)


@pytest.mark.parametrize("mode", MODES)
def test_loops_of_unknown_length_that_keep_the_kind_are_exact(modules: Any, mode: str) -> None:
    plain, dec = modules
    for x in (X1, jnp.float32(5.0)):
        assert run(plain, dec, mode, "while_kept", x, traced_float=True).dtype == jnp.bfloat16
    for n in (0, 2):
        out = run(plain, dec, mode, "fori_bounds_kept", jnp.int32(n), X1, traced_float=True)
        assert out.dtype == jnp.bfloat16


@pytest.mark.parametrize("mode", MODES)
def test_a_strong_state_made_weak(modules: Any, mode: str) -> None:
    """The other direction: ``self.total = 1.0`` in a body, on a float32 state. A scan
    is exact (weak after it ran, strong after zero trips); a while_loop's carry takes
    the body's kind."""
    plain, dec = modules
    strong = jnp.float32(0.0)
    for xs, dtype in ((XS, jnp.bfloat16), (EMPTY, jnp.float32)):
        ref, model = plain.Acc(strong), dec.Acc(strong)
        expected = ref.scan_reset(xs)
        if mode == "eager":
            got, total = model.scan_reset(xs), model.total
        else:
            f, states = model.functionalize()
            call = jax.jit(f.scan_reset) if mode == "jit" else f.scan_reset
            got, states = call(states, xs)
            total = states["total"]
        jitted = True  # a Python float assigned in a traced body is a weak array
        assert expected.dtype == dtype
        assert typed(got, jitted) == typed(expected, jitted)
        assert typed(total, jitted) == typed(ref.total, jitted)
    # A while_loop carry takes the body's kind: weak, as after plain Python's trip.
    strong_after(plain, dec, mode, "while_reset", X1, total=strong, weak=True)
