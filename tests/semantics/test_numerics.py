"""Numbers: dtypes, weak types, numpy arrays and scalars and Python numbers as
state, complex values, dtype promotion, traced values.

Each case runs a class as plain Python and decorated (the harness in
``tests/semantics/harness.py``, or a direct comparison) and asserts the
decorated program means what the plain one does: eagerly, through
``f(states, ...)``, under ``jax.jit`` and after ``autostate.freeze``, or that it
is refused with a clear error. A known difference stays as ``xfail(strict=True)``
with what differs.
"""

from __future__ import annotations

import copy
import pickle
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autostate
from autostate import errors
from autostate.errors import (
    TracedValueError,
)
from semantics.harness import (
    Loader,
    X,
    assert_bits,
    assert_same,
    assert_typed,
    assert_user_line,
    attrs,
    check,
    check_transform,
    class_pair,
    jit_counted,
    pair,
    plain_path,
    raises_autostate,
    snapshot,
    staged,
    user_line,
)
from semantics.programs_control_flow import FLOW, VARIATIONAL_RNN
from semantics.programs_escapes import TORCH_TRAINING as TORCH
from semantics.programs_functional import MODELS, REBUILD
from semantics.programs_numerics import CHANGES, DTYPES, ODD, OVER
from semantics.programs_numerics import KINDS as VALUE_KINDS
from semantics.programs_shared import TORCH_HEADER, X1, X_VRNN, XQ, XR, XS3, XV1, XV2
from semantics.programs_shared import TWO as X2
from semantics.programs_shared import XM_ROUTED as XM
from semantics.programs_state_inference import MOE_AUX_LOSS as MOE
from semantics.programs_static_state import ACCUM, QAT
from semantics.programs_transformations import DROPOUT
from semantics.programs_transformations import RNG as KEYED_NOISE
from semantics.references import (
    grads_of,
    jitted,
    lifecycle,
    module_file_name,
    params_of,
    ref_dropout,
    staged_method_call,
    step_jit,
)

XS = jnp.asarray([0.5, -1.0, 2.0])


# One class, a method per primitive: each body only reads ``self.rate`` (a
# Python float after ``set_rate``) and ``self.scale`` (a numpy scalar),
# with Python ``if``, ``math`` and ``numpy``, and assigns an array state.
READERS = """
import math

@DECORATE
class Reader:
    def __init__(self):
        self.w = jnp.ones(3)
        self.total = jnp.zeros(3)
        self.rate = 0.0
        self.scale = np.float32(2.0)

    def set_rate(self, rate):
        self.rate = rate
        self.scale = np.float32(self.scale * 1.5)

    def _step(self, h):
        factor = math.exp(self.rate) if self.rate > 0.25 else 1.0
        h = h * factor * np.float32(self.scale)
        self.total = self.total + h
        return h

    def scan(self, x):
        def body(h, _):
            return self._step(h), None
        return lax.scan(body, x, None, length=3)[0]

    def fori(self, x):
        return lax.fori_loop(0, 2, lambda i, h: self._step(h), x)

    def while_(self, x):
        def cond(c):
            return c[0] < (3 if self.rate > 0.25 else 1)
        def body(c):
            return c[0] + 1, self._step(c[1])
        return lax.while_loop(cond, body, (0, x))[1]

    def cond_(self, x):
        return lax.cond(x.sum() > 0, self._step, lambda h: h * float(self.rate), x)

    def switch(self, x):
        return lax.switch(1, [lambda h: h, self._step], x)

    def map_(self, x):
        return lax.map(lambda row: self._step(row), jnp.stack([x, x + 1.0]))

    def remat(self, x):
        return checkpoint(self._step)(x)
"""


METHODS = ("scan", "fori", "while_", "cond_", "switch", "map_", "remat")


@pytest.mark.parametrize("method", METHODS)
def test_a_body_reads_a_python_number_state_as_plain_python_does(
    write_module: Loader, method: str
) -> None:
    plain, dec = pair(write_module, READERS)
    # (``set_rate`` returns None: build a model, then set its rate.)
    build = "(lambda m: (m.set_rate(0.5), m)[1])(Reader())"
    check(plain, dec, build, [(method, (XS,)), (method, (XS,))], modes=("eager", "f"))


@pytest.mark.parametrize("method", METHODS)
def test_a_body_reading_a_python_number_state_under_jit_names_it(
    write_module: Loader, method: str
) -> None:
    _, dec = pair(write_module, READERS)
    model = dec.Reader()
    model.set_rate(0.5)
    f, states = model.functionalize()
    with pytest.raises(TracedValueError) as raised:
        staged(lambda s, x: getattr(f, method)(s, x))(states, XS)
    err = raised.value
    assert isinstance(err, jax.errors.ConcretizationTypeError)
    assert "'rate' holds a Python number" in str(err)
    assert_user_line(err, dec.__file__)
    assert "fix:" in str(err)


CONCRETE_USES = """
import math
import operator

@DECORATE
class Uses:
    def __init__(self):
        self.w = jnp.ones(3)
        self.p = 0.0
        self.k = jnp.zeros((), jnp.int32)
        self.table = [1.0, 2.0, 3.0]

    def set(self, p):
        self.p = p
        self.k = self.k + 1

    def branch(self, x):
        if self.p == 0.0:
            return x * self.w
        return x * self.w * (1.0 - self.p)

    def math_(self, x):
        return x * math.exp(self.p)

    def numpy_(self, x):
        return x * np.exp(self.p)

    def index(self, x):
        return x * self.table[self.k]
"""


KINDS = [
    ("branch", jax.errors.TracerBoolConversionError, "'p' holds"),
    ("math_", jax.errors.ConcretizationTypeError, "'p' holds"),
    ("numpy_", jax.errors.TracerArrayConversionError, "'p' holds"),
    ("index", jax.errors.TracerIntegerConversionError, None),
]


# ``branch`` also covers a dropout rate read by ``if self.p == 0.0:`` (eagerly, through
# f, and refused under jit with the state's name).
@pytest.mark.parametrize(("method", "jax_type", "names"), KINDS)
def test_each_kind_works_eagerly_and_through_f(
    write_module: Loader, method: str, jax_type: type, names: str | None
) -> None:
    plain, dec = pair(write_module, CONCRETE_USES)
    build = "(lambda m: (m.set(0.25), m)[1])(Uses())"
    check(plain, dec, build, [(method, (XS,))], modes=("eager", "f"))


@pytest.mark.parametrize("transform", ["jit", "grad", "vmap"])  # grad under jit
@pytest.mark.parametrize(("method", "jax_type", "names"), KINDS)
def test_each_kind_under_a_transformation_is_a_traced_value_error(
    write_module: Loader, method: str, jax_type: type, names: str | None, transform: str
) -> None:
    _, dec = pair(write_module, CONCRETE_USES)
    model = dec.Uses()
    model.set(0.25)
    f, states = model.functionalize()

    def loss(s: dict, x: jax.Array) -> jax.Array:
        return getattr(f, method)(s, x)[0].sum()

    run = {
        "jit": staged(loss),
        "grad": staged(jax.grad(loss, allow_int=True)),
        "vmap": jax.vmap(loss, in_axes=(None, 0)),
    }[transform]
    x = jnp.stack([XS, XS]) if transform == "vmap" else XS
    if transform == "vmap":
        # Under vmap over x alone the states are not traced: the values are
        # concrete, as in plain Python.
        out = run(states, x)
        assert out.shape == (2,)
        return
    with pytest.raises(TracedValueError) as raised:
        run(states, x)
    err = raised.value
    assert isinstance(err, jax_type), type(err).__mro__
    assert isinstance(err, autostate.AutostateError)
    assert_user_line(err, dec.__file__)
    if names is not None:
        assert names in str(err)
    assert "JAX's error:" in str(err)


def test_an_error_that_is_not_about_a_traced_value_is_left_alone(write_module: Loader) -> None:
    dec = write_module(
        """
        import jax.numpy as jnp
        import autostate

        @autostate.stateful
        class Picky:
            def __init__(self):
                self.n = jnp.zeros(())

            def __call__(self, x):
                self.n = self.n + 1
                raise KeyError("mine")
        """
    )
    f, states = dec.Picky().functionalize()
    with pytest.raises(KeyError, match="mine") as raised:
        staged(lambda s, x: f(s, x))(states, XS)
    assert not isinstance(raised.value, autostate.AutostateError)


# A state the body assigns is threaded through it as a traced carry, so a
# Python ``if`` on it cannot run there, eagerly or not: a clear error naming
# the lax call, with the eager model left as it was.
ASSIGNED_IN_BODY = """
@DECORATE
class Decay:
    def __init__(self):
        self.w = jnp.ones(3)
        self.lr = 0.5

    def run(self, x):
        def body(h, _):
            self.lr = self.lr * 0.5
            if self.lr > 0.1:
                h = h * self.w
            return h, None
        return jax.lax.scan(body, x, None, length=3)[0]
"""


def test_a_python_number_state_assigned_in_a_body_and_read_by_if(write_module: Loader) -> None:
    dec = write_module(
        "import jax\nimport jax.numpy as jnp\nimport autostate\n"
        + ASSIGNED_IN_BODY.replace("@DECORATE", "@autostate.stateful")
    )
    model = dec.Decay()
    with pytest.raises(TracedValueError) as raised:
        model.run(XS)
    err = raised.value
    assert isinstance(err, jax.errors.TracerBoolConversionError)
    assert "lax.scan" in str(err)
    assert_user_line(err, dec.__file__)
    assert model.w.shape == (3,)


def test_grad_through_a_body_that_reads_a_python_number_state(write_module: Loader) -> None:
    plain, dec = pair(write_module, READERS)
    build = "(lambda m: (m.set_rate(0.5), m)[1])(Reader())"
    # Under grad the states are not traced (only x is): the bodies still see the number.
    check_transform(plain, dec, build, [("scan", (X,)), ("fori", (X,))], XS, "grad")


def test_a_numpy_float_state_is_concrete_in_an_eager_body() -> None:
    @autostate.stateful
    class Gate:
        def __init__(self) -> None:
            self.threshold = np.float64(0.5)
            self.count = jnp.zeros((), jnp.int32)

        def run(self, xs: jax.Array) -> jax.Array:
            def body(c: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
                if self.threshold > 0.25:
                    self.count = self.count + 1
                return c + x, None

            return jax.lax.scan(body, jnp.zeros(()), xs)[0]

    gate = Gate()
    out = gate.run(XS)
    assert float(out) == pytest.approx(float(XS.sum()))
    assert int(gate.count) == 3


jit_call = staged(lambda f, s, *a: f(s, *a))


NUMPY_STATE = """
import numpy as np


class Counts:
    def __init__(self):
        self.counts = np.zeros(4, np.float32)
        self.acc = np.zeros((), np.float32)

    def __call__(self, labels):
        self.counts[labels] += 1
        self.acc += np.float64(0.5)
        return self.counts
"""


def test_numpy_state_has_one_meaning_eagerly_and_under_jit(write_module):
    _, cls, _ = class_pair(write_module, NUMPY_STATE, "Counts")
    labels = jnp.array([0, 0, 1])
    eager = cls()
    eager_out = eager(labels)
    f, states = cls().functionalize()
    jit_out, states = jit_call(f, states, labels)
    np.testing.assert_array_equal(eager_out, [2.0, 1.0, 0.0, 0.0])  # jax scatter-add
    np.testing.assert_array_equal(jit_out, eager_out)
    assert isinstance(eager.counts, jax.Array)
    assert eager.acc.dtype == states["acc"].dtype == jnp.float32


NPITEMS = """
@DECORATE
class Items:
    def __init__(self):
        self.x = np.zeros(3, np.float32)
        self.d = {"k": np.zeros(2, np.float32)}
        self.lst = [np.zeros(2, np.float32), np.ones(2, np.float32)]
        self.tup = (np.zeros(2, np.float32),)

    def nested_item(self, v):
        self.d["k"][0] = v
        self.d["k"] += 1.0
        self.x[1:] = v
        self.x[0] += self.x[1]
        self.lst[1][0] = v * 3
        return self.d["k"].sum() + self.x.sum()

    def list_index_items(self, v):
        self.lst[0] = self.lst[0] + v
        self.lst[-1] *= 2
        self.d["new"] = np.ones(2, np.float32) * v
        return self.lst[0].sum()
"""


@pytest.mark.parametrize("method", ["nested_item", "list_index_items"])
def test_item_writes_on_numpy_states(write_module: Loader, method: str) -> None:
    plain, dec = pair(write_module, NPITEMS)
    calls = [(method, (np.float32(3.0),)), (method, (np.float32(1.0),))]
    modes = ("eager", "f", "jit", "freeze") if method == "nested_item" else ("eager", "f")
    check(plain, dec, "Items()", calls, modes=modes)


# One dtype per kind autostate tells apart (integer, inexact, bool): the other
# small dtypes take the same path (uint8, float16 and int32 states: ITEMS, KINDS).
# int8 steps by 100: it wraps, as in plain JAX.
SMALL_DTYPES = {"int8": 100, "bfloat16": 1, "bool": True}


@pytest.mark.parametrize("dtype", sorted(SMALL_DTYPES))
def test_small_dtype_states(write_module: Loader, dtype: str) -> None:
    plain, dec = pair(write_module, DTYPES)
    dt = jnp.dtype(dtype)
    v = SMALL_DTYPES[dtype]
    check(plain, dec, f"Typed(jnp.{dtype})", [("step", (v,)), ("step", (v,)), ("step", (v,))])
    f, states = dec.Typed(dt).functionalize()
    for _ in range(2):
        _, states = staged(f.step)(states, v)
        assert states["x"].dtype == dt


# Also covers a Python float state scaled by each call (``Misc.float_state``).
def test_python_float_and_complex_states(write_module: Loader) -> None:
    plain, dec = pair(write_module, DTYPES)
    check(plain, dec, "Py()", [("step", (1.0,)), ("step", (0.5,))])
    f, states = dec.Py().functionalize()
    assert sorted(states) == ["cx", "fl"]  # int and bool are static
    assert isinstance(states["fl"], float) and isinstance(states["cx"], complex)
    out, states = f.step(states, 1.0)
    assert_same(plain.Py().step(1.0), out)


def test_numpy_states_become_jax_arrays_as_documented(write_module: Loader) -> None:
    _, dec = pair(write_module, DTYPES)
    m = dec.Np()
    for v in (m.arr, m.sc, m.ints, m.lst[0], m.lst[1]["k"]):
        assert isinstance(v, jax.Array)
    assert m.sc.dtype == jnp.float32
    m.arr = np.zeros(2)
    assert isinstance(m.arr, jax.Array)
    m.step(1.0)
    f, states = dec.Np().functionalize()
    eager = dec.Np()
    expected = [eager.step(1.0), eager.step(2.0)]
    got = []
    for x in (1.0, 2.0):
        out, states = staged(f.step)(states, x)
        got.append(out)
    assert_same(expected, got)
    assert_same(snapshot(eager.lst), snapshot(states["lst"]))
    assert states["ints"].dtype == eager.ints.dtype


def test_numpy_string_array_state(write_module: Loader) -> None:
    plain, dec = pair(write_module, DTYPES)
    try:
        check(plain, dec, "Strs()", [("__call__", (1.0,))], modes=("eager",))
    except autostate.AutostateError as err:
        assert "labels" in str(err)  # a clear refusal naming the attribute would do


def test_prng_key_states(write_module: Loader) -> None:
    plain, dec = pair(write_module, DTYPES)
    check(plain, dec, "Keys(0)", [("__call__", (1.0,)), ("__call__", (2.0,))])
    f, states = dec.Keys(0).functionalize()
    assert jax.dtypes.issubdtype(states["key"].dtype, jax.dtypes.prng_key)


def test_python_number_states_eager_or_a_clear_refusal(write_module: Loader) -> None:
    plain, dec = pair(write_module, REBUILD, fresh=True)
    calls = [("__call__", (1.0,)), ("__call__", (2.0,))]
    check(plain, dec, "PyNumber()", calls, modes=("eager",))
    for mode in ("f", "jit"):
        with pytest.raises(autostate.AutostateError, match="static state 'k'"):
            check(plain, dec, "PyNumber()", calls, modes=(mode,))


NUMPY_BUFFER = """
@DECORATE
class Buffered:
    def __init__(self):
        self.w = jnp.ones(())
        self.buf = np.zeros(3)

    def __call__(self, x):
        b = self.buf
        b[0] += 1.0
        return x * self.w + b[0]
"""


@pytest.mark.xfail(
    strict=True,
    reason="a numpy parameter changed in place through a local alias: f(states) "
    "changes the eager model's array (f's copy shares the numpy leaf), and jax.jit(f) "
    "changes it once, at trace time, then never again (silently stale, no error)",
)
@pytest.mark.parametrize("mode", ["f", "jit"])
def test_numpy_parameter_changed_in_place_inside_f(write_module: Loader, mode: str) -> None:
    plain, dec = pair(write_module, NUMPY_BUFFER, fresh=True)
    ref = plain.Buffered()
    expected = [ref(jnp.float32(1.0)) for _ in range(3)]
    model = dec.Buffered()
    f, states = model.functionalize()
    call = f if mode == "f" else staged(f)
    got = []
    try:
        for _ in range(3):
            out, states = call(states, jnp.float32(1.0))
            got.append(out)
    except autostate.AutostateError:
        return  # a clear refusal is fine
    assert_same(expected, got, "outputs")
    assert_same(np.zeros(3), model.buf, "the eager model's buffer changed")


def transform_typed(
    plain: types.ModuleType,
    dec: types.ModuleType,
    build: str,
    calls: list[tuple[str, tuple[Any, ...]]],
    x: Any,
    transform: str,
    *,
    jitted: bool = True,
) -> None:
    """``differential.check_transform`` with the typed comparison: the plain model
    built inside the transformed function vs ``f`` called from outside, under
    ``jax.grad`` (of the float leaves' sum) or ``jax.vmap`` over ``x``, plain
    and (``jitted``) under ``jax.jit``."""
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
    runs = [(transform, wrap(dec_fn))]
    if jitted:
        runs.append(("jit " + transform, staged(wrap(dec_fn))))
    for name, fn in runs:
        assert_typed(expected, fn(x), name, jitted=True, output=True, exact=False)


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
    plain, dec = pair(write_module, VALUE_KINDS)
    lifecycle(plain, dec, "Kinds()", LIFECYCLES[order])


def test_value_kinds_eager_only_keep_python_types(write_module: Loader) -> None:
    """Eagerly nothing crosses jit: a Python float state stays a float."""
    plain, dec = pair(write_module, VALUE_KINDS)
    lifecycle(plain, dec, "Kinds()", [("eager", [STEP, WEAK, STEP]), ("f", [WEAK, STEP])])
    m = dec.Kinds()
    m.step(X1)
    assert type(m.fl) is float and type(m.cx) is complex


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_value_kinds_under_grad_and_vmap(write_module: Loader, transform: str) -> None:
    plain, dec = pair(write_module, VALUE_KINDS)
    x = X1 if transform == "grad" else jnp.arange(3.0)
    # (Only x is traced: the states never cross a jit boundary here. jit over grad and
    # vmap of f: test_grad_and_vmap_over_f_with_keys_and_low_precision.)
    transform_typed(
        plain, dec, "Kinds()", [("step", (X,)), ("weak_only", ()), ("step", (X,))], x, transform,
        jitted=False,
    )


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


def test_lax_scan_over_f_with_every_kind_of_state(write_module: Loader) -> None:
    """Hand-threaded steps in a ``lax.scan`` carry: the states keep their dtypes and
    weak types across steps (a Python float is a weak f32 carry)."""
    plain, dec = pair(write_module, OVER)
    xs = jnp.arange(8.0).reshape(4, 2)
    ref = plain.Noisy()
    expected = jnp.stack([ref(x) for x in xs])
    f, states = dec.Noisy().functionalize()

    @staged
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


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_grad_and_vmap_over_f_with_keys_and_low_precision(
    write_module: Loader, transform: str
) -> None:
    plain, dec = pair(write_module, OVER)
    x = jnp.array([0.5, 1.0]) if transform == "grad" else jnp.arange(6.0).reshape(3, 2)
    transform_typed(plain, dec, "Noisy()", [("__call__", (X,))] * 2, x, transform)


FLOW_CALLS = {
    "cond_weak": [("cond_weak", (X1,)), ("cond_weak", (-X1,))],
    "scan_weak_to_strong": [("scan_weak_to_strong", (XS3,))] * 2,
    "fori_wrap": [("fori_wrap", (3,)), ("fori_wrap", (2,))],
    "while_mask": [("while_mask", (X1,)), ("while_mask", (jnp.float32(0.5),))],
    "scan_zero_and_complex": [("scan_zero_and_complex", (XS3,))] * 2,
    "cond_key": [("cond_key", (X1,)), ("cond_key", (-X1,)), ("cond_key", (X2,))],
    "scan_dataclass": [("scan_dataclass", (XS3,))] * 2,
    "scan_bf16": [("scan_bf16", (XS3,))] * 2,
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
            ("eager", [("add_all", (XS3,))]),
            ("jit", [("add_all", (XS3,))]),
            ("eager", [("add_all", (XS3,))]),
        ],
    )


def test_deepcopy_mid_life_keeps_dtypes_and_weak_types(write_module: Loader) -> None:
    """(Not pickle: unpickling a weak-typed jax array and adding to it poisons JAX's
    own dispatch cache in jax 0.10, after which ``jnp.zeros((), jnp.float32) + 1`` is
    weak-typed in every later test. That is JAX's, with or without autostate.)"""
    import copy

    plain, dec = pair(write_module, VALUE_KINDS)
    ref, model = plain.Kinds(), dec.Kinds()
    f, states = model.functionalize()
    _, states = staged(f.step)(states, X1)
    ref.step(X1)
    frozen = autostate.freeze(f, states)
    r, m = copy.deepcopy(ref), copy.deepcopy(frozen)
    assert_typed(attrs(r), attrs(m), "attributes", jitted=True)
    assert_typed(r.step(X2), m.step(X2), "eager step", jitted=True)
    g, s = m.functionalize()
    out, s = staged(g.weak_only)(s)
    assert_typed(r.weak_only(), out, "jitted weak_only", jitted=True, output=True)
    assert_typed(attrs(r), attrs(autostate.freeze(g, s)), "frozen again", jitted=True)
    assert_typed(attrs(ref), attrs(frozen), "the originals are untouched", jitted=True)
    ref.step(X1)
    frozen.step(X1)
    assert_typed(attrs(ref), attrs(frozen), "the originals go on", jitted=True)


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
            fn = staged(f.update, static_argnums=1) if mode == "jit" else f.update
            got = []
            for _, a in calls:
                out, states = fn(states, *a)
                got.append(out)
            model = autostate.freeze(f, states)
        assert_typed(attrs(ref), attrs(model), f"{mode}: attributes")
        for e, g in zip(expected, got):
            assert [np.asarray(v).dtype for v in e] == [np.asarray(v).dtype for v in g], mode
            np.testing.assert_array_equal(np.asarray(e[0]), np.asarray(g[0]), err_msg=mode)


@pytest.fixture
def mods(write_module: Loader) -> tuple[types.ModuleType, types.ModuleType]:
    return pair(write_module, MODELS)


@pytest.mark.parametrize("value", ["numpy", "int32", "float16"])
def test_f_state_value_of_other_array_kind_as_plain_python(mods: Any, value: str) -> None:
    """A numpy array (converted to jax, as documented) or another dtype means what plain does."""
    plain, dec = mods

    def given() -> Any:
        return {
            "numpy": np.full((), 2.0),
            "int32": jnp.full((), 2, jnp.int32),
            "float16": jnp.full((), 2, jnp.float16),
        }[value]

    ref = plain.Counter()
    ref.count = jnp.asarray(given())
    expected = (ref(3.0), ref.count)
    f, _ = dec.Counter().functionalize()
    out, states = f({"count": given()}, 3.0)
    assert_same(snapshot(expected), snapshot((out, states["count"])))
    assert states["count"].dtype == expected[1].dtype
    out, states = staged(lambda f, s: f(s, 3.0))(f, {"count": given()})
    assert_same(snapshot(expected), snapshot((out, states["count"])))


def test_f_does_not_mutate_a_numpy_state_it_is_given(mods: Any) -> None:
    plain, dec = mods
    arr = np.full((), 2.0)
    model = dec.Counter()
    model.count = arr
    model(3.0)
    assert float(arr) == 2.0  # eagerly: converted on assignment, the caller's array untouched
    f, _ = dec.Counter().functionalize()
    given = np.full((), 2.0)
    states = {"count": given}
    out1, _ = f(states, 3.0)
    out2, _ = f(states, 3.0)  # the same states again: the same result (f is pure)
    ref = plain.Counter()
    ref.count = jnp.asarray(np.full((), 2.0))
    expected = ref(3.0)
    assert_same(snapshot(expected), snapshot(out1))
    assert_same(snapshot(expected), snapshot(out2))
    assert float(given) == 2.0


def ref_split3(key: Any, x: Any) -> Any:
    key, k1, k2 = jax.random.split(key, 3)
    return x * jax.random.uniform(k1, x.shape) + jax.random.normal(k2, x.shape), key


def ref_fold(s: dict[str, Any], x: Any) -> Any:
    sub = jax.random.fold_in(s["key"], s["step"])
    return x + jax.random.normal(sub, x.shape), {"key": s["key"], "step": s["step"] + 1}


def ref_noisy_scan(p: Any, s: dict[str, Any], xs: Any) -> Any:
    def body(carry: Any, x: Any) -> Any:
        h, key = carry
        h, key = ref_dropout(key, h @ p["w"] + x, 0.25)
        h = jnp.tanh(h)
        return (h, key), h

    (_, key), hs = jax.lax.scan(body, (jnp.zeros(4), s["drop.key"]), xs)
    return hs, {"drop.key": key}


def rng_calls(cls: str, typed: bool) -> tuple[str, Callable[..., Any], list[Any]]:
    xs = [jnp.arange(8.0).reshape(2, 4) + i for i in range(2)]
    if cls == "Dropout":
        return f"Dropout(0, 0.5, {typed})", lambda s, x: _k(ref_dropout(s["key"], x)), xs
    if cls == "Split3":
        return f"Split3(0, {typed})", lambda s, x: _k(ref_split3(s["key"], x)), xs
    if cls == "FoldIn":
        return f"FoldIn(0, {typed})", ref_fold, xs
    return f"NoisyScan(0, {typed})", None, xs


def _k(out_key: tuple[Any, Any]) -> tuple[Any, dict[str, Any]]:
    return out_key[0], {"key": out_key[1]}


# Both key kinds (a typed key is an extended dtype, a raw one uint32 data) on one
# class; each other way of drawing with one kind.
RNG_CASES = [("Dropout", True), ("Dropout", False), ("Split3", False), ("FoldIn", True),
             ("NoisyScan", True)]


# With test_prng_key_states, also covers a model that splits a raw and a typed key in
# one call (bernoulli and normal draws) in every mode.
@pytest.mark.parametrize("cls,typed", RNG_CASES)
def test_random_streams_match_hand_threaded_bit_for_bit(
    write_module: Loader, cls: str, typed: bool
) -> None:
    plain, dec = pair(write_module, DROPOUT)
    build, ref_fn, xs = rng_calls(cls, typed)
    ref, model = eval(build, vars(plain)), eval(build, vars(dec))  # noqa: S307
    f, s = model.functionalize()
    if cls == "NoisyScan":
        p = params_of(f)
        xs = [jnp.ones((3, 4)) * i for i in range(2)]

        def ref_fn(s: Any, x: Any) -> Any:
            return ref_noisy_scan(p, s, x)

    rs, js, fs = dict(s), s, s
    run = jitted("__call__")
    for i, x in enumerate(xs):
        want, rs = ref_fn(rs, x)
        assert_bits(want, ref(x), f"plain {i}")
        assert_bits(want, model(x), f"eager {i}")
        out, fs = f(fs, x)
        assert_bits(want, out, f"f {i}")
        out, js = run(f, js, x)
        assert_same(want, out, f"jit {i}")  # XLA may fuse a multiply-add
    assert_bits(rs, dict(js), "jit states")
    assert_bits(rs, dict(fs), "f states")
    assert_bits(rs, {k: plain_path(model, k) for k in rs}, "eager states")
    assert_bits(rs, {k: plain_path(ref, k) for k in rs}, "plain states")
    assert_bits(rs, autostate.state_dict(autostate.freeze(f, js)), "frozen states")


@pytest.mark.parametrize("new_style", [False, True])
def test_key_split_per_call_dropout(write_module: Loader, new_style: bool) -> None:
    plain, dec = pair(write_module, KEYED_NOISE)
    calls = [("dropout", (XR,)), ("__call__", (XR,)), ("many", (jnp.stack([XR, XR * 2]),)),
             ("sample_while", (2.0,)), ("fresh", ())] if new_style else [("dropout", (XR,)),
                                                                         ("fresh", ())]
    check(plain, dec, f"Noisy(0, new_style={new_style})", calls)


def test_odd_states_plain_vs_decorated(write_module: Loader) -> None:
    plain, dec = pair(write_module, ODD)
    check(plain, dec, "Odd()", [("__call__", (XV1,)), ("peek", ()), ("__call__", (XV2,)),
                                ("__call__", (XV1,))])


def test_odd_states_life_cycle(write_module: Loader) -> None:
    plain, dec = pair(write_module, ODD, fresh=True)
    ref, model = plain.Odd(), dec.Odd()
    f, states = model.functionalize()
    assert states["nothing"] is None  # None is a placeholder state (tests/test_static_state.py)
    step = step_jit()
    for x in (XV1, XV2):
        out, states = step(f, states, x)
        assert_same(ref(x), out, "jit")
    states = jax.tree_util.tree_map(lambda a: a, states)
    frozen = autostate.freeze(f, states)
    assert_same(snapshot(ref), snapshot(frozen), "frozen")
    again = pickle.loads(pickle.dumps(copy.deepcopy(frozen)))
    assert_same(ref(XV1), again(XV1), "eager after pickle")
    assert_same(snapshot(ref), snapshot(again), "after pickle")
    assert again.nothing is None and again.empty_l == [] and again.cache["k"] is None


def test_odd_states_ensemble_vmap(write_module: Loader) -> None:
    plain, dec = pair(write_module, ODD)
    refs = [plain.Odd() for _ in range(3)]
    f, states = dec.Odd().functionalize()
    ss = jax.tree_util.tree_map(lambda a: jnp.stack([jnp.asarray(a)] * 3), states)
    xs = jnp.stack([XV1, XV2, -XV1])
    out, ss = staged(jax.vmap(lambda s, x: f(s, x)))(ss, xs)
    assert_same(np.stack([r(x) for r, x in zip(refs, xs)]), out, "vmap")
    for i, r in enumerate(refs):
        member = autostate.freeze(f, jax.tree_util.tree_map(lambda a, i=i: a[i], ss))
        assert_same(snapshot(r), snapshot(member), f"member {i}")


def test_torch_style_moving_average_if_under_jit_is_traced_value_error(
    write_module: Loader,
) -> None:
    _, dec = pair(write_module, QAT)
    f, states = dec.TorchStyleMovingAverage().functionalize()
    with pytest.raises(autostate.errors.TracedValueError) as err:
        staged_method_call(f, states, XQ)
    assert_user_line(err.value, module_file_name(dec))
    assert isinstance(err.value, jax.errors.TracerBoolConversionError)


@pytest.mark.parametrize("typed", [False, True])
def test_dropout_key_split_each_call(write_module: Loader, typed: bool) -> None:
    plain, dec = pair(write_module, VARIATIONAL_RNN)
    calls = [("__call__", (X_VRNN,)), ("__call__", (X_VRNN,)), ("__call__", (X_VRNN * 2,))]
    check(plain, dec, f"Dropout(3, typed={typed})", calls)
    check(plain, dec, f"Dropout(3, typed={typed}).eval()", calls)
    check_transform(
        plain,
        dec,
        f"Dropout(3, typed={typed})",
        [("__call__", (X,)), ("__call__", (X,))],
        X_VRNN,
        "grad",
    )


def test_moe_python_float_aux_loss_init(write_module: Loader) -> None:
    # aux_loss = 0.0 (a weakly typed float state) becomes an array in the call
    plain, dec = pair(write_module, MOE)
    ref, model = plain.MoE(0, 3, py_init=True), dec.MoE(0, 3, py_init=True)
    assert_same(ref(XM), model(XM), "eager")
    assert_same(snapshot(ref), snapshot(model), "eager attributes")


def test_accum_array_k_python_if(write_module: Loader) -> None:
    plain, dec = pair(write_module, ACCUM)
    calls = [("update", (g,)) for g in grads_of(plain, 4)]
    check(plain, dec, "AccumSGD(init_params(), 3, array_k=True)", calls, modes=("eager", "f"))
    f, states = dec.AccumSGD(dec.init_params(), 3, array_k=True).functionalize()
    with pytest.raises(autostate.errors.TracedValueError) as err:
        staged_method_call(f, states, plain.grads_at(0), method="update")
    assert_user_line(err.value, module_file_name(dec))


def torch(write_module: Loader) -> tuple[types.ModuleType, types.ModuleType]:
    return pair(write_module, TORCH_HEADER + TORCH)


def jit_steps(f: Any, states: Any, method: str, calls: list[tuple[Any, ...]]) -> Any:
    step = staged(lambda f, s, *a: getattr(f, method)(s, *a))
    out = None
    for args in calls:
        out, states = step(f, states, *args)
    return out, states


def test_torch_early_stopping_under_jit_is_traced_value_error(write_module: Loader) -> None:
    _, dec = torch(write_module)
    f, states = dec.TorchEarlyStopping().functionalize()
    with raises_autostate(errors.TracedValueError) as err:
        jit_steps(f, states, "__call__", [(jnp.float32(1.0),)])
    user_line(err.value, dec, "if loss < self.best:")
    assert "best" in str(err.value)
