"""Python-number states read where Python needs a concrete value.

A state that holds a Python number (``self.rate = 0.5`` in a method) is a
leaf of ``states``: under ``jax.jit`` it is traced like an array, so that it
can take traced values (``self.total += loss``). Two consequences, each
pinned here for every road to the value:

- Where plain Python has the number, autostate has it too: an eager model's
  ``lax`` body (or ``f`` called without ``jit``) that only *reads* it sees the
  number, so ``if self.rate > 0:``, ``math.exp(self.rate)`` and
  ``np.float32(self.rate)`` work as in plain Python's loop, in every
  primitive. (The abstract trace that finds what a body assigns used to
  make every state abstract, so these raised JAX's raw
  ``TracerBoolConversionError`` from inside autostate.)
- Where the value is traced (``f`` under ``jit``, ``grad`` or ``vmap``, or a
  state the body assigns), the error is a ``TracedValueError`` naming the
  state and the user's line, and it is still JAX's own type
  (``TracerBoolConversionError``, ``ConcretizationTypeError``,
  ``TracerArrayConversionError``, ``TracerIntegerConversionError``), so
  ``except`` clauses written for JAX keep working.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from differential import X, assert_user_line, check, check_transform, pair  # noqa: I001

import autostate
from autostate.errors import TracedValueError

Loader = Callable[..., types.ModuleType]

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
    for build in ("Reader()", "Reader().set_rate(0.5) or None"):
        # (``set_rate`` returns None: build a model, then set its rate.)
        build = "(lambda m: (m.set_rate(0.5), m)[1])(Reader())" if "set_rate" in build else build
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
        jax.jit(lambda s, x: getattr(f, method)(s, x))(states, XS)
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
        "jit": jax.jit(loss),
        "grad": jax.jit(jax.grad(loss, allow_int=True)),
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
        jax.jit(lambda s, x: f(s, x))(states, XS)
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
