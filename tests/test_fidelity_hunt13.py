"""Differential bug hunt 13: the values states hold and their life over many calls.

- Values of every kind: Python floats and complex numbers, weak-typed jax
  scalars (``jnp.asarray(0)``, ``+ 1`` vs ``+ 1.0``), int states promoted to
  float, bfloat16 / float16 / complex64 / uint8 (wrapping) / bool masks,
  zero-size arrays, 0-d arrays vs numpy scalars, typed and raw PRNG keys,
  ``None`` <-> array, empty containers that grow, NamedTuples and registered
  dataclasses, Python values (ints, strings, enums) inside container states.
  Every output and attribute is compared with plain Python by dtype,
  ``weak_type``, shape and bits, not only by value.
- Life over many calls: one instance used eagerly, then through ``f``, then
  jitted, then frozen, then eagerly again, in varied orders; two ``f``\\s of one
  model; states edited by hand between calls; several instances of a class
  with different static configs in one jitted function; ``jax.jit`` trace
  counts where plain Python's meaning implies a retrace (a static state
  changed eagerly, a dtype or shape change) or none (functionalize / freeze
  round trips, float values).
- Transformations over ``f`` with those kinds: ``jax.grad``, ``jax.vmap``
  (ensembles of states), ``jax.lax.scan`` over steps, ``jax.checkpoint``;
  ``lax`` control flow in methods writing them (weak -> strong carries,
  dtype changes as the documented ``ControlFlowStateError``).

Each source is written plain and decorated (``differential.pair``; ``lax.*``
is a Python loop in the plain module); the plain run is the reference. A
case that shows a mismatch stays, marked ``xfail(strict=True)`` with what
differs.
"""

from __future__ import annotations

import re
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from differential import (  # noqa: I001 - tests/ is on sys.path
    X,
    assert_user_line,
    check,
    pair,
    plain_path,
)

import autostate
from autostate.errors import ControlFlowStateError, StaticStateError

Loader = Callable[..., types.ModuleType]

X1 = jnp.float32(1.5)
X2 = jnp.float32(2.0)
XS = jnp.arange(1.0, 4.0)


# ======================================================================================
# Typed comparison: dtype, weak_type, shape and bits
# ======================================================================================


def _is_key(v: Any) -> bool:
    return isinstance(v, jax.Array) and jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key)


def _bits(a: np.ndarray) -> bytes:
    """The array's bytes, with -0.0 read as 0.0 (XLA folds ``x + 0`` under jit)."""
    if a.dtype.kind in "fc" or a.dtype.name == "bfloat16":
        a = np.where(a == 0, np.zeros_like(a), a)
    return a.tobytes()


def typed(v: Any, depth: int = 0) -> Any:
    """A value as a comparable structure that keeps dtype, weak type and bits."""
    if depth > 8:
        return "<deep>"
    if _is_key(v):
        return ("key", str(v.dtype), v.shape, np.asarray(jax.random.key_data(v)).tobytes())
    if isinstance(v, jax.Array):
        return ("arr", str(v.dtype), bool(v.weak_type), v.shape, _bits(np.asarray(v)))
    if isinstance(v, np.ndarray | np.generic):
        a = np.asarray(v)
        return ("arr", str(a.dtype), False, a.shape, _bits(a))
    if isinstance(v, bool | int | str | type(None)):
        return (type(v).__name__, v)
    if isinstance(v, float | complex):
        return ("py" + type(v).__name__, v)
    if isinstance(v, dict):
        return (type(v).__name__, [("item", k, typed(x, depth + 1)) for k, x in v.items()])
    if isinstance(v, list | tuple):
        return (type(v).__name__, [typed(x, depth + 1) for x in v])
    if hasattr(v, "__dict__") and type(v).__module__.startswith("autostate_testmod"):
        return (
            type(v).__name__,
            [("item", k, typed(getattr(v, k), depth + 1)) for k in sorted(vars(v))],
        )
    return ("obj", type(v).__name__)


def assert_typed(
    expected: Any,
    got: Any,
    where: str = "",
    jitted: bool = False,
    output: bool = False,
    exact: bool = True,
) -> None:
    """Same structure, types, dtypes, weak types, shapes and bits.

    ``jitted``: Python floats / complex numbers may have crossed a jit boundary,
    where JAX makes them weak-typed 0-d arrays; both sides are compared so.
    ``output``: the value is what a jitted function returned, where a Python int or
    bool is an array too (a static state stays a Python value).
    ``exact=False``: floating values within 1e-6 (a fused program may round
    differently), everything else still exact.
    """
    e, g = typed(expected), typed(got)
    if jitted:
        kinds = ("pyfloat", "pycomplex", "int", "bool") if output else ("pyfloat", "pycomplex")
        e, g = _jitted(e, kinds), _jitted(g, kinds)
    if not exact:
        e_vals: list[Any] = []
        g_vals: list[Any] = []
        e, g = _floats_out(e, e_vals), _floats_out(g, g_vals)
        assert e == g, f"{where}:\n expected {e}\n      got {g}"
        for a, b in zip(e_vals, g_vals):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6, err_msg=where)
        return
    assert e == g, f"{where}:\n expected {e}\n      got {g}"


def _floats_out(t: Any, vals: list[Any]) -> Any:
    """``t`` with each float array's bytes replaced by a marker, the values in ``vals``."""
    if t[0] == "arr" and jnp.issubdtype(jnp.dtype(t[1]), jnp.inexact):
        vals.append(np.frombuffer(t[4], jnp.dtype(t[1])).astype(np.complex128))
        return t[:4]
    if t[0] == "item":
        return ("item", t[1], _floats_out(t[2], vals))
    if len(t) == 2 and isinstance(t[1], list):
        return (t[0], [_floats_out(x, vals) for x in t[1]])
    return t


def _jitted(t: Any, kinds: tuple[str, ...]) -> Any:
    if t[0] in kinds:
        return typed(jnp.asarray(t[1]))
    if t[0] == "item":
        return ("item", t[1], _jitted(t[2], kinds))
    if len(t) == 2 and isinstance(t[1], list):
        return (t[0], [_jitted(x, kinds) for x in t[1]])
    return t


def attrs(model: Any) -> dict[str, Any]:
    """Every attribute of a model, read with getattr (values, never slots)."""
    return {k: getattr(model, k) for k in sorted(vars(model))}


def jit_counted(fn: Callable[..., Any]) -> tuple[Callable[..., Any], list[int]]:
    """``jax.jit(fn)`` and a list that grows by one per trace."""
    traces: list[int] = []

    def traced(*a: Any) -> Any:
        traces.append(1)
        return fn(*a)

    return jax.jit(traced), traces


# ======================================================================================
# The lifecycle runner: one instance through eager, f, jit and freeze phases
# ======================================================================================

Phase = tuple[str, list[tuple[str, tuple[Any, ...]]]]


def lifecycle(
    plain: types.ModuleType, dec: types.ModuleType, build: str, phases: list[Phase]
) -> None:
    """Runs every call of ``phases`` on one plain model, and on one decorated model
    moved between modes: ``eager`` calls the model, ``f`` calls ``f(states, ...)``,
    ``jit`` calls a jitted ``f``; moving from ``f``/``jit`` to ``eager`` freezes,
    moving from ``eager`` to ``f``/``jit`` functionalizes. After each phase the
    outputs and every attribute must be the plain ones, dtypes and weak types
    included (a Python float is a weak 0-d array once it crossed jit)."""
    ref = eval(build, vars(plain))  # noqa: S307
    model = eval(build, vars(dec))  # noqa: S307
    f = states = None
    crossed_jit = False
    jitted: dict[str, Any] = {}
    for i, (mode, calls) in enumerate(phases):
        if mode == "eager" and f is not None:
            model, f, states = autostate.freeze(f, states), None, None
        if mode in ("f", "jit") and f is None:
            f, states = model.functionalize()
            model = None
        crossed_jit = crossed_jit or mode == "jit"
        for name, args in calls:
            expected = getattr(ref, name)(*args)
            if mode == "eager":
                got = getattr(model, name)(*args)
            elif mode == "f":
                fn = f if name == "__call__" else getattr(f, name)
                got, states = fn(states, *args)
            else:
                if name not in jitted:
                    jitted[name] = jax.jit(
                        lambda f, s, *a, n=name: (f if n == "__call__" else getattr(f, n))(s, *a)
                    )
                got, states = jitted[name](f, states, *args)
            # (A compiled program may round floats differently from eager ops.)
            assert_typed(
                expected, got, f"phase {i} ({mode}) {name} output", crossed_jit, mode == "jit",
                exact=mode != "jit",
            )
        if mode == "eager":
            assert_typed(attrs(ref), attrs(model), f"phase {i} attributes", crossed_jit)
        else:
            for key, value in states.items():
                assert_typed(
                    plain_path(ref, key), value, f"phase {i} ({mode}) state {key}", crossed_jit,
                    exact=mode != "jit",
                )
    if f is not None:
        model = autostate.freeze(f, states)
    assert_typed(attrs(ref), attrs(model), "final attributes", crossed_jit)


def transform_typed(
    plain: types.ModuleType,
    dec: types.ModuleType,
    build: str,
    calls: list[tuple[str, tuple[Any, ...]]],
    x: Any,
    transform: str,
) -> None:
    """``differential.check_transform`` with the typed comparison: the plain model
    built inside the transformed function vs ``f`` called from outside, under
    ``jax.grad`` (of the float leaves' sum) or ``jax.vmap`` over ``x``, plain
    and jitted."""
    keys = sorted(eval(build, vars(dec)).functionalize()[1])  # noqa: S307

    def plain_fn(xv: Any) -> Any:
        m = eval(build, vars(plain))  # noqa: S307
        outs = [getattr(m, n)(*[xv if v is X else v for v in a]) for n, a in calls]
        return outs, {k: getattr(m, k) for k in keys}

    f, states0 = eval(build, vars(dec)).functionalize()  # noqa: S307

    def dec_fn(xv: Any) -> Any:
        s, outs = states0, []
        for n, a in calls:
            out, s = (f if n == "__call__" else getattr(f, n))(s, *[xv if v is X else v for v in a])
            outs.append(out)
        return outs, s

    def scalar(fn: Callable[..., Any]) -> Callable[..., Any]:
        def g(xv: Any) -> Any:
            leaves = jax.tree_util.tree_leaves(fn(xv))
            return sum(
                jnp.sum(jnp.real(v).astype(jnp.float32))
                for v in leaves
                if isinstance(v, jax.Array | float)
                and jnp.issubdtype(jnp.result_type(v), jnp.inexact)
            )

        return g

    wrap = (lambda fn: jax.grad(scalar(fn))) if transform == "grad" else jax.vmap
    expected = wrap(plain_fn)(x)
    for name, fn in ((transform, wrap(dec_fn)), ("jit " + transform, jax.jit(wrap(dec_fn)))):
        assert_typed(expected, fn(x), name, jitted=True, output=True, exact=False)


# ======================================================================================
# 1. Values of every kind over a lifecycle
# ======================================================================================

KINDS = """
class Pt(typing.NamedTuple):
    a: typing.Any
    b: typing.Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Moments:
    m: typing.Any
    n: typing.Any


@DECORATE
class Kinds:
    def __init__(self):
        self.fl = 0.5
        self.cx = 1 + 1j
        self.wf = jnp.asarray(0.0)
        self.wi = jnp.asarray(0)
        self.i2f = jnp.zeros((), jnp.int32)
        self.bf = jnp.zeros(2, jnp.bfloat16)
        self.h = jnp.zeros(2, jnp.float16)
        self.c64 = jnp.ones(2, jnp.complex64)
        self.u8 = jnp.zeros(3, jnp.uint8)
        self.mask = jnp.zeros(3, bool)
        self.zero = jnp.zeros((0, 2))
        self.d0 = jnp.float32(0)
        self.key = jax.random.key(0)
        self.raw = jax.random.PRNGKey(1)
        self.pt = Pt(jnp.zeros(2), jnp.zeros((), jnp.int32))
        self.mom = Moments(jnp.zeros(2), jnp.zeros((), jnp.int32))
        self.nested = {"a": [jnp.zeros(1), (jnp.ones(()), {"z": jnp.zeros((), jnp.uint8)})]}
        self.w = jnp.ones(2)

    def step(self, x):
        self.fl = self.fl * 0.5 + 1.0
        self.cx = self.cx * 1j
        self.wf = self.wf + 1
        self.wi = self.wi + 1
        self.i2f = self.i2f + 0.5
        self.bf = self.bf + 0.25
        self.h += 1.5
        self.c64 = self.c64 * 1j + x
        self.u8 = self.u8 + 100
        self.mask = self.mask | (jnp.arange(3) < x)
        self.zero = self.zero * x
        self.d0 = self.d0 + x
        self.key, k = jax.random.split(self.key)
        self.raw, k2 = jax.random.split(self.raw)
        self.pt = self.pt._replace(a=self.pt.a + x, b=self.pt.b + 1)
        self.mom = Moments(self.mom.m * 0.5 + x, self.mom.n + 1)
        inner = self.nested["a"][1]
        self.nested = {"a": [self.nested["a"][0] + x, (inner[0] * 2, {"z": inner[1]["z"] + 1})]}
        return (
            jax.random.bits(k) ^ jax.random.bits(k2),
            self.fl * self.w,
            self.wf + self.wi,
            self.bf.sum(),
            self.u8,
        )

    def weak_only(self):
        self.wf = self.wf * 2
        self.wi = self.wi * 3
        self.fl = self.fl + 2.0
        return self.wf + self.fl, self.wi + 1
"""

STEP = ("step", (X1,))
WEAK = ("weak_only", ())

LIFECYCLES = {
    "eager-f-jit-freeze-eager": [
        ("eager", [STEP]),
        ("f", [STEP, WEAK]),
        ("jit", [STEP, STEP]),
        ("eager", [STEP, WEAK]),
    ],
    "jit-eager-jit": [("jit", [STEP, WEAK]), ("eager", [STEP]), ("jit", [WEAK, STEP])],
    "f-jit-f-eager": [("f", [WEAK]), ("jit", [STEP]), ("eager", [STEP]), ("f", [STEP])],
    "weak-only-everywhere": [("eager", [WEAK]), ("jit", [WEAK, WEAK]), ("eager", [WEAK])],
}


@pytest.mark.parametrize("order", sorted(LIFECYCLES))
def test_value_kinds_over_a_lifecycle(write_module: Loader, order: str) -> None:
    plain, dec = pair(write_module, KINDS)
    lifecycle(plain, dec, "Kinds()", LIFECYCLES[order])


def test_value_kinds_eager_only_keep_python_types(write_module: Loader) -> None:
    """Eagerly nothing crosses jit: a Python float state stays a float."""
    plain, dec = pair(write_module, KINDS)
    lifecycle(plain, dec, "Kinds()", [("eager", [STEP, WEAK, STEP]), ("f", [WEAK, STEP])])
    m = dec.Kinds()
    m.step(X1)
    assert type(m.fl) is float and type(m.cx) is complex


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_value_kinds_under_grad_and_vmap(write_module: Loader, transform: str) -> None:
    plain, dec = pair(write_module, KINDS)
    x = X1 if transform == "grad" else jnp.arange(3.0)
    transform_typed(
        plain, dec, "Kinds()", [("step", (X,)), ("weak_only", ()), ("step", (X,))], x, transform
    )


# ======================================================================================
# 2. Python values inside container states ("wherever they sit ... are static")
# ======================================================================================

PYINSIDE = """
class Mode(enum.Enum):
    A = 1
    B = 2


@DECORATE
class Shaped:
    def __init__(self):
        self.shape = (2,)
        self.w = jnp.ones(())

    def __call__(self, x):
        return jnp.zeros(self.shape) + x * self.w

    def grow(self):
        self.shape = (self.shape[0] + 1,)


@DECORATE
class Tagged:
    def __init__(self):
        self.cfg = {"m": jnp.zeros(2), "name": "relu"}

    def __call__(self, x):
        self.cfg = {"m": self.cfg["m"] + x, "name": self.cfg["name"]}
        return self.cfg["m"] * (2.0 if self.cfg["name"] == "relu" else 3.0)


@DECORATE
class Moded:
    def __init__(self):
        self.both = (Mode.A, jnp.zeros(()))

    def __call__(self, x):
        self.both = (self.both[0], self.both[1] + x)
        return self.both[1] * (2.0 if self.both[0] is Mode.A else 3.0)
"""


def test_tuple_of_ints_state_eagerly_and_through_f(write_module: Loader) -> None:
    plain, dec = pair(write_module, "import enum\n" + PYINSIDE)
    lifecycle(
        plain,
        dec,
        "Shaped()",
        [
            ("eager", [("grow", ()), ("__call__", (X1,))]),
            ("f", [("grow", ()), ("__call__", (X2,))]),
        ],
    )


def test_tuple_of_ints_state_under_jit(write_module: Loader) -> None:
    plain, dec = pair(write_module, "import enum\n" + PYINSIDE)
    lifecycle(plain, dec, "Shaped()", [("eager", [("grow", ())]), ("jit", [("__call__", (X1,))])])


def test_tuple_of_ints_state_written_under_jit_keeps_python_ints(write_module: Loader) -> None:
    plain, dec = pair(write_module, "import enum\n" + PYINSIDE)
    ref = plain.Shaped()
    ref.grow()
    f, states = dec.Shaped().functionalize()
    _, states = jax.jit(f.grow)(states)
    frozen = autostate.freeze(f, states)
    assert_typed(attrs(ref), attrs(frozen), "frozen after a jitted grow")


def test_str_inside_a_dict_state_under_jit(write_module: Loader) -> None:
    plain, dec = pair(write_module, "import enum\n" + PYINSIDE)
    lifecycle(plain, dec, "Tagged()", [("jit", [("__call__", (X1,)), ("__call__", (X2,))])])


def test_str_inside_a_dict_state_eagerly_and_through_f(write_module: Loader) -> None:
    plain, dec = pair(write_module, "import enum\n" + PYINSIDE)
    lifecycle(
        plain, dec, "Tagged()", [("eager", [("__call__", (X1,))]), ("f", [("__call__", (X2,))])]
    )


def test_enum_inside_a_tuple_state_under_jit(write_module: Loader) -> None:
    plain, dec = pair(write_module, "import enum\n" + PYINSIDE)
    lifecycle(plain, dec, "Moded()", [("jit", [("__call__", (X1,))])])


# ======================================================================================
# 3. Static states and configs: retraces where plain Python implies them, none elsewhere
# ======================================================================================

STATIC = """
class Mode(enum.Enum):
    A = 1
    B = 2


@DECORATE
class Block:
    def __init__(self, act="relu", scale=2.0):
        self.act = act
        self.scale = scale
        self.training = True
        self.mode = Mode.A
        self.n = 0
        self.cache = None
        self.w = jnp.ones(2)
        self.s = jnp.zeros(2)

    def __call__(self, x):
        self.s = self.s + x
        y = self.s * self.w * self.scale
        y = jnp.maximum(y, 0.0) if self.act == "relu" else jnp.tanh(y)
        y = y if self.training else -y
        y = y * (3.0 if self.mode is Mode.A else 5.0) + self.n
        return y if self.cache is None else y + self.cache

    def eval(self):
        self.training = False

    def train(self):
        self.training = True

    def set_mode(self, m):
        self.mode = m

    def bump(self):
        self.n += 1

    def remember(self, v):
        self.cache = v

    def forget(self):
        self.cache = None


@DECORATE
class Stack:
    def __init__(self):
        self.blocks = [Block("relu", 2.0), Block("tanh", 0.5), Block("relu", 1.0)]
        self.blocks[1].eval()
        self.blocks[2].set_mode(Mode.B)
        self.blocks[2].bump()
        self.steps = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.steps += 1
        for b in self.blocks:
            x = b(x)
        return x
"""


def _static_pair(write_module: Loader) -> tuple[types.ModuleType, types.ModuleType]:
    return pair(write_module, "import enum\n" + STATIC)


def test_instances_with_different_static_configs_in_one_jitted_function(
    write_module: Loader,
) -> None:
    plain, dec = _static_pair(write_module)
    check(plain, dec, "Stack()", [("__call__", (jnp.array([0.5, -1.0]),))] * 3)
    lifecycle(
        plain,
        dec,
        "Stack()",
        [
            ("jit", [("__call__", (jnp.array([0.5, -1.0]),))] * 2),
            ("eager", [("__call__", (jnp.array([1.0, 1.0]),))]),
            ("jit", [("__call__", (jnp.array([0.25, 2.0]),))]),
        ],
    )


def test_static_changes_eagerly_retrace_once_per_structure(write_module: Loader) -> None:
    """Changing a static state eagerly is a new structure (one trace per value);
    going back to a value seen before, or functionalizing / freezing again, is not."""
    plain, dec = _static_pair(write_module)
    step, traces = jit_counted(lambda f, s, x: f(s, x))
    ref, model = plain.Block(), dec.Block()
    x = jnp.array([0.5, -1.0])
    script = [
        ("eval", (), 2),
        ("train", (), 2),
        ("eval", (), 2),
        ("train", (), 2),
        ("set_mode", ("B",), 3),
        ("set_mode", ("A",), 3),
        ("bump", (), 4),
        # `cache` starts as the placeholder None, a state (`states["cache"] is None`):
        # an array is one more structure; None again is the one seen before.
        ("remember", (jnp.ones(2),), 5),
        ("forget", (), 5),
        ("remember", (jnp.zeros(2),), 5),
        ("forget", (), 5),
    ]
    f, states = model.functionalize()
    out, states = step(f, states, x)
    assert_typed(ref(x), out, "first call")
    model = autostate.freeze(f, states)
    for name, args, expected_traces in script:
        getattr(ref, name)(*[getattr(plain.Mode, a) if isinstance(a, str) else a for a in args])
        getattr(model, name)(*[getattr(dec.Mode, a) if isinstance(a, str) else a for a in args])
        f, states = model.functionalize()
        out, states = step(f, states, x)
        assert_typed(ref(x), out, f"after {name}{args}")
        assert len(traces) == expected_traces, (name, args, len(traces), expected_traces)
        model = autostate.freeze(f, states)
    assert_typed(attrs(ref), attrs(model), "attributes")


def test_functionalize_and_freeze_round_trips_never_retrace(write_module: Loader) -> None:
    plain, dec = _static_pair(write_module)
    step, traces = jit_counted(lambda f, s, x: f(s, x))
    ref, model = plain.Stack(), dec.Stack()
    x = jnp.array([0.5, -1.0])
    for i in range(4):
        f, states = model.functionalize()
        f2, states = model.functionalize()  # a second f of the same model: the same structure
        out, states = step(f2 if i % 2 else f, states, x)
        assert_typed(ref(x), out, f"round {i}")
        model = autostate.freeze(f, states)
        if i == 2:
            assert_typed(ref(x), model(x), "eager in between")
    assert len(traces) == 1
    assert_typed(attrs(ref), attrs(model), "attributes")


# ======================================================================================
# 4. Dtype, shape and structure changes between calls
# ======================================================================================

CHANGES = """
@DECORATE
class Changing:
    def __init__(self):
        self.n = jnp.zeros((), jnp.int32)
        self.buf = jnp.zeros((0, 2))
        self.hist = ()
        self.log = []
        self.seen = {}
        self.kv = jnp.zeros(2)
        self.lo = jnp.zeros(2, jnp.bfloat16)

    def promote(self, x):
        self.n = self.n + 0.5
        return self.n * x

    def demote(self):
        self.n = self.n.astype(jnp.int32)
        return self.n

    def to_bool(self):
        self.n = self.n > 0
        return self.n

    def widen(self, x):
        self.lo = self.lo + x
        return self.lo

    def narrow(self):
        self.lo = self.lo.astype(jnp.bfloat16)
        return self.lo

    def push(self, x):
        self.buf = jnp.concatenate([self.buf, jnp.stack([x, -x])[None]])
        self.hist = self.hist + (x,)
        self.log = self.log + [x * 2]
        self.seen = {**self.seen, f"k{len(self.seen)}": x}
        return self.buf.sum(0), len(self.hist)

    def drop(self):
        self.buf = self.buf[1:]
        self.hist = self.hist[1:]
        self.log = self.log[:-1]
        return self.buf.shape[0]

    def clear_kv(self):
        self.kv = None

    def fill_kv(self, x):
        self.kv = (jnp.zeros(2) if self.kv is None else self.kv) + x
        return self.kv
"""

CHANGE_SCRIPTS = {
    "promote-demote": [
        ("eager", [("promote", (X1,))]),
        ("jit", [("promote", (X2,)), ("demote", ())]),
        ("eager", [("promote", (X1,))]),
        ("jit", [("to_bool", ()), ("promote", (X1,))]),
    ],
    "bf16-widen-narrow": [
        ("jit", [("widen", (X1,)), ("narrow", ()), ("widen", (X2,))]),
        ("eager", [("narrow", ()), ("widen", (X1,))]),
        ("f", [("narrow", ())]),
    ],
    "grow-shrink": [
        ("eager", [("push", (X1,))]),
        ("jit", [("push", (X2,)), ("push", (X1,)), ("drop", ())]),
        ("eager", [("drop", ()), ("drop", ())]),
        ("jit", [("push", (X2,))]),
    ],
    "none-array-none": [
        ("jit", [("clear_kv", ()), ("fill_kv", (X1,))]),
        ("eager", [("clear_kv", ())]),
        ("jit", [("fill_kv", (X2,)), ("clear_kv", ())]),
        ("eager", [("fill_kv", (X1,))]),
        ("f", [("clear_kv", ()), ("fill_kv", (X2,))]),
    ],
}


@pytest.mark.parametrize("script", sorted(CHANGE_SCRIPTS))
def test_dtype_shape_and_structure_changes_over_a_lifecycle(
    write_module: Loader, script: str
) -> None:
    plain, dec = pair(write_module, CHANGES)
    lifecycle(plain, dec, "Changing()", CHANGE_SCRIPTS[script])


def test_dtype_change_retraces_once_per_dtype(write_module: Loader) -> None:
    """`n` int32 -> float32 (weak) -> float32: the state's type is part of the jit
    signature, so a second trace and no more, with plain Python's values."""
    plain, dec = pair(write_module, CHANGES)
    step, traces = jit_counted(lambda f, s, x: f.promote(s, x))
    ref = plain.Changing()
    f, states = dec.Changing().functionalize()
    kinds = []
    for x in (X1, X2, X1, X2):
        out, states = step(f, states, x)
        assert_typed(ref.promote(x), out, "output")
        assert_typed(ref.n, states["n"], "state n")
        kinds.append((str(states["n"].dtype), states["n"].weak_type))
    assert kinds == [("float32", True)] * 4
    assert len(traces) == 2


def test_shape_change_retraces_once_per_shape(write_module: Loader) -> None:
    plain, dec = pair(write_module, CHANGES)
    step, traces = jit_counted(lambda f, s, x: f.push(s, x))
    drop, _ = jit_counted(lambda f, s: f.drop(s))
    ref = plain.Changing()
    f, states = dec.Changing().functionalize()
    for x in (X1, X2):
        out, states = step(f, states, x)
        assert_typed(ref.push(x), out, "push", jitted=True, output=True)
    assert len(traces) == 2
    out, states = drop(f, states)
    assert_typed(ref.drop(), out, "drop", jitted=True, output=True)
    out, states = step(f, states, X1)  # back to the first shape: a cache hit
    assert_typed(ref.push(X1), out, "push again", jitted=True, output=True)
    for key in states:
        assert_typed(getattr(ref, key), states[key], key, jitted=True)
    assert len(traces) == 3  # hist/log/seen lengths differ from the first call's


# ======================================================================================
# 5. Transformations over f with states of every kind
# ======================================================================================

OVER = """
@DECORATE
class Noisy:
    def __init__(self, seed=0):
        self.key = jax.random.key(seed)
        self.raw = jax.random.PRNGKey(seed + 7)
        self.fl = 0.5
        self.wi = jnp.asarray(0)
        self.bf = jnp.zeros(2, jnp.bfloat16)
        self.u8 = jnp.zeros(2, jnp.uint8)
        self.h = jnp.zeros((), jnp.float16)
        self.w = jnp.array([1.0, -2.0])

    def __call__(self, x):
        self.key, k = jax.random.split(self.key)
        self.raw, k2 = jax.random.split(self.raw)
        self.fl = self.fl * 0.5 + 1.0
        self.wi = self.wi + 1
        self.bf = self.bf + x.astype(jnp.bfloat16)
        self.u8 = self.u8 + 100
        self.h = self.h + 0.25
        noise = jax.random.uniform(k, (2,)) + jax.random.uniform(k2, (2,))
        return (x * self.w + noise) * self.fl + self.wi
"""


def test_lax_scan_over_f_with_every_kind_of_state(write_module: Loader) -> None:
    """Hand-threaded steps in a ``lax.scan`` carry: the states keep their dtypes and
    weak types across steps (a Python float is a weak f32 carry)."""
    plain, dec = pair(write_module, OVER)
    xs = jnp.arange(8.0).reshape(4, 2)
    ref = plain.Noisy()
    expected = jnp.stack([ref(x) for x in xs])
    f, states = dec.Noisy().functionalize()

    @jax.jit
    def run(f: Any, states: Any, xs: Any) -> Any:
        def body(s: Any, x: Any) -> Any:
            out, s = f(s, x)
            return s, out

        return jax.lax.scan(body, states, xs)

    states, outs = run(f, states, xs)
    np.testing.assert_allclose(outs, expected, rtol=1e-6)
    assert outs.dtype == expected.dtype
    frozen = autostate.freeze(f, states)
    assert_typed(attrs(ref), attrs(frozen), "frozen after the scan", jitted=True)


def test_vmap_over_an_ensemble_of_states_of_every_kind(write_module: Loader) -> None:
    plain, dec = pair(write_module, OVER)
    refs = [plain.Noisy(seed) for seed in range(3)]
    x = jnp.array([0.5, 1.0])
    expected = [[r(x) for r in refs] for _ in range(2)]
    models = [dec.Noisy(seed) for seed in range(3)]
    f, _ = models[0].functionalize()
    stacked = jax.tree.map(lambda *v: jnp.stack(v), *[m.functionalize()[1] for m in models])
    step = jax.jit(jax.vmap(lambda s, x: f(s, x), in_axes=(0, None)))
    for i in range(2):
        out, stacked = step(stacked, x)
        np.testing.assert_allclose(out, jnp.stack(expected[i]), rtol=1e-6)
    for j, r in enumerate(refs):
        one = jax.tree.map(lambda v, j=j: v[j], stacked)
        assert_typed(attrs(r), attrs(autostate.freeze(f, one)), f"member {j}", jitted=True)


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_grad_and_vmap_over_f_with_keys_and_low_precision(
    write_module: Loader, transform: str
) -> None:
    plain, dec = pair(write_module, OVER)
    x = jnp.array([0.5, 1.0]) if transform == "grad" else jnp.arange(6.0).reshape(3, 2)
    transform_typed(plain, dec, "Noisy()", [("__call__", (X,))] * 2, x, transform)


def test_checkpointed_f_under_grad(write_module: Loader) -> None:
    plain, dec = pair(write_module, OVER)
    x = jnp.array([0.5, 1.0])

    def plain_loss(x: Any) -> Any:
        m = plain.Noisy()
        return (m(x) + m(x * 2)).sum()

    f, states = dec.Noisy().functionalize()
    step = jax.checkpoint(lambda s, x: f(s, x))

    def dec_loss(x: Any) -> Any:
        out, s = step(states, x)
        out2, s = step(s, x * 2)
        return (out + out2).sum()

    assert_typed(jax.grad(plain_loss)(x), jax.jit(jax.grad(dec_loss))(x), "grad")


# ======================================================================================
# 6. lax control flow in methods writing states of every kind
# ======================================================================================

FLOW = """
@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Moments:
    m: typing.Any
    n: typing.Any


@DECORATE
class Flow:
    def __init__(self):
        self.fl = 0.0
        self.wf = jnp.asarray(0.0)
        self.wi = jnp.asarray(0)
        self.u8 = jnp.zeros(2, jnp.uint8)
        self.mask = jnp.zeros(3, bool)
        self.zero = jnp.zeros((0, 2))
        self.c64 = jnp.ones((), jnp.complex64)
        self.key = jax.random.key(0)
        self.mom = Moments(jnp.zeros(2), jnp.zeros((), jnp.int32))
        self.bf = jnp.zeros((), jnp.bfloat16)
        self.cache = None

    def cond_py_float(self, x):
        def yes(v):
            self.fl = self.fl + v
            return v
        def no(v):
            return -v
        return lax.cond(x > 0, yes, no, x)

    def cond_weak(self, x):
        def yes(v):
            self.wf = self.wf + 1
            self.wi = self.wi + 2
            return v
        return lax.cond(x > 0, yes, lambda v: v * 2, x)

    def scan_weak_to_strong(self, xs):
        def body(c, x):
            self.wf = self.wf + x
            self.wi = self.wi + 1
            return c, self.wf
        return lax.scan(body, 0.0, xs)[1]

    def fori_wrap(self, n):
        def body(i, c):
            self.u8 = self.u8 + jnp.uint8(100)
            return c + 1
        lax.fori_loop(0, n, body, 0)
        return self.u8

    def while_mask(self, x):
        def cond(i):
            return i < 3
        def body(i):
            self.mask = self.mask.at[i].set(x > i)
            return i + 1
        lax.while_loop(cond, body, 0)
        return self.mask

    def scan_zero_and_complex(self, xs):
        def body(c, x):
            self.zero = self.zero * x
            self.c64 = self.c64 * 1j
            return c, self.zero.sum() + x
        return lax.scan(body, 0.0, xs)[1]

    def cond_key(self, x):
        def yes(v):
            self.key, k = jax.random.split(self.key)
            return v + jax.random.uniform(k)
        return lax.cond(x > 0, yes, lambda v: v, x)

    def scan_dataclass(self, xs):
        def body(c, x):
            self.mom = Moments(self.mom.m * 0.5 + x, self.mom.n + 1)
            return c, self.mom.m.sum()
        return lax.scan(body, 0.0, xs)[1]

    def scan_bf16(self, xs):
        def body(c, x):
            self.bf = self.bf + 1
            self.bf += 0.5
            return c, self.bf
        return lax.scan(body, 0.0, xs)[1]

    def cond_reads_none(self, x):
        def yes(v):
            return v if self.cache is None else v * 2
        return lax.cond(x > 0, yes, lambda v: v, x)

    def scan_int_to_float(self, xs):
        def body(c, x):
            self.wi = self.wi + x  # DTYPE
            return c, x
        return lax.scan(body, 0.0, xs)[1]
"""

FLOW_CALLS = {
    "cond_weak": [("cond_weak", (X1,)), ("cond_weak", (-X1,))],
    "scan_weak_to_strong": [("scan_weak_to_strong", (XS,))] * 2,
    "fori_wrap": [("fori_wrap", (3,)), ("fori_wrap", (2,))],
    "while_mask": [("while_mask", (X1,)), ("while_mask", (jnp.float32(0.5),))],
    "scan_zero_and_complex": [("scan_zero_and_complex", (XS,))] * 2,
    "cond_key": [("cond_key", (X1,)), ("cond_key", (-X1,)), ("cond_key", (X2,))],
    "scan_dataclass": [("scan_dataclass", (XS,))] * 2,
    "scan_bf16": [("scan_bf16", (XS,))] * 2,
    "cond_reads_none": [("cond_reads_none", (X1,))],
}


@pytest.mark.parametrize("method", sorted(FLOW_CALLS))
def test_lax_bodies_in_methods_keep_dtypes_and_weak_types(
    write_module: Loader, method: str
) -> None:
    plain, dec = pair(write_module, FLOW)
    calls = FLOW_CALLS[method]
    half = len(calls) // 2 or 1
    lifecycle(
        plain, dec, "Flow()", [("eager", calls[:half]), ("jit", calls), ("eager", calls[half:])]
    )


def test_dtype_change_in_a_scan_body_is_the_documented_control_flow_error(
    write_module: Loader,
) -> None:
    plain, dec = pair(write_module, FLOW)
    plain.Flow().scan_int_to_float(XS)  # plain Python's loop just promotes
    f, states = dec.Flow().functionalize()
    for call in (dec.Flow().scan_int_to_float, lambda xs: jax.jit(f.scan_int_to_float)(states, xs)):
        with pytest.raises(ControlFlowStateError, match="wi") as info:
            call(XS)
        assert_user_line(info.value, dec.__file__)


WEAKFLOW = """
@DECORATE
class Acc:
    def __init__(self):
        self.total = 0.0

    def add_if_positive(self, x):
        def yes(v):
            self.total = self.total + v
            return v
        lax.cond(x > 0, yes, lambda v: v, x)
        return self.total + jnp.asarray(0.1, jnp.bfloat16)

    def add_all(self, xs):
        def body(c, x):
            self.total = self.total + x
            return c, None
        lax.scan(body, 0, xs)
        return self.total + jnp.asarray(0.1, jnp.bfloat16)
"""


def test_state_weak_in_one_cond_branch_strong_in_the_other(write_module: Loader) -> None:
    plain, dec = pair(write_module, WEAKFLOW)
    lifecycle(plain, dec, "Acc()", [("eager", [("add_if_positive", (X1,))])])


def test_zero_trip_scan_leaves_a_python_float_state_alone(write_module: Loader) -> None:
    plain, dec = pair(write_module, WEAKFLOW)
    lifecycle(plain, dec, "Acc()", [("eager", [("add_all", (jnp.zeros((0,)),))])])


def test_nonempty_scan_promotes_a_python_float_state_like_plain(write_module: Loader) -> None:
    plain, dec = pair(write_module, WEAKFLOW)
    lifecycle(
        plain,
        dec,
        "Acc()",
        [
            ("eager", [("add_all", (XS,))]),
            ("jit", [("add_all", (XS,))]),
            ("eager", [("add_all", (XS,))]),
        ],
    )


# ======================================================================================
# 7. One instance, many lives: copies, two fs, hand-edited states, outside writes
# ======================================================================================


def test_eager_model_and_its_f_live_independent_lives(write_module: Loader) -> None:
    """``functionalize`` is a snapshot: the eager model and ``f`` go on separately,
    as a ``copy.deepcopy`` taken at that moment would in plain Python."""
    import copy

    plain, dec = pair(write_module, KINDS)
    ref = plain.Kinds()
    model = dec.Kinds()
    for m in (ref, model):
        m.step(X1)
    snap = copy.deepcopy(ref)
    f, states = model.functionalize()
    f2, states2 = model.functionalize()
    step = jax.jit(lambda f, s, x: f.step(s, x))
    for i in range(2):
        assert_typed(ref.weak_only(), model.weak_only(), f"eager {i}")
        expected = snap.step(X2)
        out, states = step(f, states, X2)
        assert_typed(expected, out, f"jit {i}", jitted=True, output=True)
        out2, states2 = f2.step(states2, X2)  # a second f of the same model, not jitted
        snap2 = _replay(plain, [("step", (X1,))] + [("step", (X2,))] * (i + 1))
        assert_typed(attrs(snap2), attrs(autostate.freeze(f2, states2)), f"second f {i}")
    assert_typed(attrs(ref), attrs(model), "the eager model")
    assert_typed(attrs(snap), attrs(autostate.freeze(f, states)), "f's model", jitted=True)


def _replay(plain: types.ModuleType, calls: list[tuple[str, tuple[Any, ...]]]) -> Any:
    ref = plain.Kinds()
    for name, args in calls:
        getattr(ref, name)(*args)
    return ref


def test_deepcopy_mid_life_keeps_dtypes_and_weak_types(write_module: Loader) -> None:
    """(Not pickle: unpickling a weak-typed jax array and adding to it poisons JAX's
    own dispatch cache in jax 0.10, after which ``jnp.zeros((), jnp.float32) + 1`` is
    weak-typed in every later test. That is JAX's, with or without autostate.)"""
    import copy

    plain, dec = pair(write_module, KINDS)
    ref, model = plain.Kinds(), dec.Kinds()
    f, states = model.functionalize()
    _, states = jax.jit(f.step)(states, X1)
    ref.step(X1)
    frozen = autostate.freeze(f, states)
    r, m = copy.deepcopy(ref), copy.deepcopy(frozen)
    assert_typed(attrs(r), attrs(m), "attributes", jitted=True)
    assert_typed(r.step(X2), m.step(X2), "eager step", jitted=True)
    g, s = m.functionalize()
    out, s = jax.jit(g.weak_only)(s)
    assert_typed(r.weak_only(), out, "jitted weak_only", jitted=True, output=True)
    assert_typed(attrs(r), attrs(autostate.freeze(g, s)), "frozen again", jitted=True)
    assert_typed(attrs(ref), attrs(frozen), "the originals are untouched", jitted=True)
    ref.step(X1)
    frozen.step(X1)
    assert_typed(attrs(ref), attrs(frozen), "the originals go on", jitted=True)


def test_states_edited_by_hand_between_calls(write_module: Loader) -> None:
    """A value the user puts into ``states`` is the state's value, with its dtype and
    weak type, as assigning it to the plain model's attribute is."""
    plain, dec = pair(write_module, KINDS)
    ref = plain.Kinds()
    f, states = dec.Kinds().functionalize()
    step = jax.jit(lambda f, s, x: f.step(s, x))
    edits = {
        "wf": lambda v: jnp.float32(v),  # weak -> strong
        "i2f": lambda v: v.astype(jnp.int8),  # another int width
        "bf": lambda v: v.astype(jnp.float32),  # bf16 -> f32
        "fl": lambda v: 3.0,  # back to a Python float
        "key": lambda v: jax.random.key(5),  # a fresh key
        "u8": lambda v: jnp.full(3, 250, jnp.uint8),
    }
    for name, edit in edits.items():
        setattr(ref, name, edit(getattr(ref, name)))
        states = {**states, name: edit(states[name])}
        out, states = step(f, states, X1)
        assert_typed(ref.step(X1), out, f"after editing {name}", jitted=True, output=True)
        for key in states:
            assert_typed(getattr(ref, key), states[key], f"{name}: state {key}", jitted=True)


def test_values_assigned_from_outside_between_jitted_calls(write_module: Loader) -> None:
    """``model.x = v`` from a training loop, between functionalize/freeze rounds."""
    plain, dec = pair(write_module, KINDS)
    ref, model = plain.Kinds(), dec.Kinds()
    step = jax.jit(lambda f, s, x: f.step(s, x))
    writes = [
        ("wi", jnp.asarray(7)),
        ("wf", 2.5),
        ("h", jnp.ones(2, jnp.float16)),
        ("mask", jnp.array([True, False, True])),
        ("c64", jnp.zeros(2, jnp.complex64)),
        ("zero", jnp.zeros((0, 2))),
        ("d0", np.float32(4.0)),
        ("raw", jax.random.PRNGKey(9)),
    ]
    for name, value in writes:
        setattr(ref, name, value)
        setattr(model, name, value)
        f, states = model.functionalize()
        out, states = step(f, states, X2)
        assert_typed(ref.step(X2), out, f"after model.{name} = ...", jitted=True, output=True)
        model = autostate.freeze(f, states)
        assert_typed(attrs(ref), attrs(model), f"after model.{name} = ...", jitted=True)


# ======================================================================================
# 8. Item updates on small dtypes (numpy in plain Python, jax arrays decorated)
# ======================================================================================

ITEMS = """
@DECORATE
class Items:
    def __init__(self):
        self.u8 = np.full(3, 100, np.uint8)
        self.mask = np.zeros(3, bool)
        self.h = np.ones(3, np.float16)
        self.i32 = np.zeros(3, np.int32)
        self.c64 = np.ones(2, np.complex64)
        self.rbg = jax.random.key(3, impl="rbg")

    def update(self, i):
        self.u8[i] += 200
        self.u8[i + 1] = 7
        self.mask[i] |= True
        self.mask[i + 1] = True
        self.h[i] *= 3
        self.h[1:] = self.h[1:] + 0.5
        self.i32[i] = 2
        self.i32[i + 1] -= 5
        self.c64[i] *= 1j
        self.rbg, k = jax.random.split(self.rbg)
        return self.u8.sum(dtype=np.uint8), self.mask.any(), jax.random.bits(k, (), np.uint8)
"""


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy's uint8 wrap
def test_item_updates_on_small_dtypes_keep_the_state_dtype(write_module: Loader) -> None:
    plain, dec = pair(write_module, ITEMS)
    calls = [("update", (0,)), ("update", (1,))]
    ref = plain.Items()
    expected = [ref.update(*a) for _, a in calls]
    for mode in ("eager", "f", "jit"):
        model = dec.Items()
        if mode == "eager":
            got = [model.update(*a) for _, a in calls]
        else:
            f, states = model.functionalize()
            fn = jax.jit(f.update, static_argnums=1) if mode == "jit" else f.update
            got = []
            for _, a in calls:
                out, states = fn(states, *a)
                got.append(out)
            model = autostate.freeze(f, states)
        assert_typed(attrs(ref), attrs(model), f"{mode}: attributes")
        for e, g in zip(expected, got):
            assert [np.asarray(v).dtype for v in e] == [np.asarray(v).dtype for v in g], mode
            np.testing.assert_array_equal(np.asarray(e[0]), np.asarray(g[0]), err_msg=mode)


# ======================================================================================
# 9. States holding Python objects
# ======================================================================================

OBJECTS = """
@dataclasses.dataclass
class Box:
    a: typing.Any
    label: str


@DECORATE
class Holder:
    def __init__(self):
        self.box = Box(jnp.zeros(2), "b")
        self.log = []

    def __call__(self, x):
        self.box = Box(self.box.a + x, self.box.label + "!")
        self.log = self.log + [self.box.label]
        return self.box.a.sum(), len(self.log)
"""


def test_plain_objects_and_growing_lists_as_state_eagerly_and_through_f(
    write_module: Loader,
) -> None:
    plain, dec = pair(write_module, OBJECTS)
    ref, model = plain.Holder(), dec.Holder()
    for x in (X1, X2):
        assert_typed(ref(x), model(x), "eager")
    f, states = model.functionalize()
    for x in (X1, X2):
        out, states = f(states, x)
        assert_typed(ref(x), out, "f")
    assert (states["box"].label, states["log"]) == (ref.box.label, ref.log)
    np.testing.assert_array_equal(states["box"].a, ref.box.a)
    frozen = autostate.freeze(f, states)
    assert_typed(ref(X1), frozen(X1), "frozen")
    assert frozen.log == ref.log and type(frozen.box) is dec.Box


def test_append_to_a_list_state_is_the_documented_decoration_error(write_module: Loader) -> None:
    source = """
@DECORATE
class History:
    def __init__(self):
        self.losses = []

    def record(self, loss):
        self.losses.append(loss)

    def reset(self):
        self.losses = []
"""
    with pytest.raises(autostate.errors.DecorationError, match="mutates state 'losses'") as info:
        pair(write_module, source)
    where = re.search(r"at (\S+autostate_testmod_\d+\.py):(\d+)", str(info.value))
    assert where, str(info.value)
    line = Path(where[1]).read_text().splitlines()[int(where[2]) - 1]
    assert "self.losses.append(loss)" in line
    assert "fix:" in str(info.value)


ARRAY_TO_INT = """
@DECORATE
class Steps:
    def __init__(self):
        self.n = jnp.zeros((), jnp.int32)

    def step(self, x):
        self.n = self.n + 1
        return x * self.n

    def reset(self):
        self.n = 0

    def scaled(self, x):
        return x if self.n == 0 else x * self.n
"""


def test_array_state_reset_to_a_python_int_eagerly(write_module: Loader) -> None:
    plain, dec = pair(write_module, ARRAY_TO_INT)
    lifecycle(
        plain,
        dec,
        "Steps()",
        [
            ("jit", [("step", (X1,))]),
            ("eager", [("reset", ()), ("scaled", (X1,)), ("step", (X1,)), ("reset", ())]),
        ],
    )


@pytest.mark.xfail(
    strict=True,
    raises=jax.errors.TracerBoolConversionError,
    reason="BUG: an array state set to a Python int eagerly (`self.n = 0` in reset()) stays "
    "a leaf of `states` (`{'n': 0}`) instead of becoming static as an int state is (docs: "
    "a state holding a Python int is static), so `if self.n == 0:` in the jitted f raises "
    "JAX's TracerBoolConversionError; plain Python runs",
)
def test_array_state_reset_to_a_python_int_is_static_under_jit(write_module: Loader) -> None:
    plain, dec = pair(write_module, ARRAY_TO_INT)
    lifecycle(
        plain,
        dec,
        "Steps()",
        [
            ("eager", [("step", (X1,)), ("reset", ())]),
            ("jit", [("scaled", (X1,))]),
        ],
    )


def test_int_state_from_init_is_static_and_a_traced_increment_names_the_line(
    write_module: Loader,
) -> None:
    source = ARRAY_TO_INT.replace("self.n = jnp.zeros((), jnp.int32)", "self.n = 0")
    plain, dec = pair(write_module, source)
    lifecycle(plain, dec, "Steps()", [("eager", [("step", (X1,))]), ("jit", [("scaled", (X2,))])])
    f, states = dec.Steps().functionalize()
    assert "n" not in states
    with pytest.raises(StaticStateError, match="'n'") as info:
        jax.jit(f.step)(states, X1)
    assert_user_line(info.value, dec.__file__)
    assert "Tracer" not in str(info.value)
