"""Differential bug hunt 34: JAX APIs that take a callable, handed a method or a
closure that reads or writes state, inside methods and around ``f``.

- Inside methods, a write that does not depend on the transformed input
  (``self.calls += 1``, a decay ``self.mean = self.mean * 0.5``, a key split,
  a sub-model's counter, a ``lax.pmean`` over the ``vmap`` axis, a threaded
  ``lax.scan`` / ``fori_loop`` / ``cond`` body's writes) in a callable handed
  to ``jax.vmap`` (bound methods), ``jax.jacrev`` (``has_aux=True``
  too), ``jax.jacfwd``, ``jax.hessian``, ``jnp.vectorize``, ``jax.grad`` of a
  scan, ``lax.associative_scan`` (its combine runs eagerly, several times),
  ``jax.named_call``; the primal of a ``custom_jvp`` / ``custom_vjp``
  function (eagerly, in ``f`` and under ``grad``; under ``jit`` the documented
  ``EscapedStateError``): plain JAX keeps a concrete value (the callable is
  traced once); autostate gives the same, eagerly, through ``f``, under
  ``jit`` and after ``freeze``, and under ``grad`` / ``vmap`` of ``f``.
- Reads in callables handed to ``jacrev`` / ``jnp.vectorize`` (scalar), ``associative_scan`` and ``lax.reduce`` with a bound method,
  ``lax.custom_root`` / ``custom_linear_solve`` closures, a ``custom_vjp``
  whose ``fwd`` keeps a state as residual and whose output is then assigned,
  ``pure_callback`` of a bound method, ``ensure_compile_time_eval`` with a
  Python branch on a state (under ``jit``: the documented
  ``TracedValueError``). A ``custom_vjp`` ``bwd`` reading a state under
  ``grad`` of ``f`` is a bug (xfail).
- Writes that depend on the transformed input (plain JAX leaves the tracer
  in the object): ``vmap`` (bound method and lambda), ``jacrev``, ``jacfwd``,
  ``hessian``, ``jnp.vectorize``, a ``custom_root`` function, a
  ``custom_linear_solve`` matvec: eagerly ``TracedEagerStateError`` at the
  write, the model unchanged; through ``f`` and ``jit(f)`` the documented
  ``EscapedStateError``, ``f`` left usable; the same write overwritten
  afterwards in the method matches plain Python through ``f`` (eagerly the
  stricter ``TracedEagerStateError``); the host fallback's documented
  per-example state. ``lax.reduce`` with a writing computation through ``f``
  and ``jax.checking_leaks()`` around those escapes are bugs (xfail).
- Host callbacks: ``jax.debug.callback(self.log_host, ...)`` appending to a
  list that is not state, and writing a state (``pure_callback`` too):
  plain values eagerly and in ``f``; under ``jit`` the documented
  ``UnhandledLocalStateError`` inside JAX's ``JaxRuntimeError``. A bound
  method of the model in a callback with ``f`` passed as a ``jit`` argument
  is a bug (xfail): the list entries are lost, the traced copy leaks, a
  parameter read is a raw ``TracerArrayConversionError``.
- Around ``f``: ``jax.disable_jit()`` and ``jax.checking_leaks()`` around a
  representative model (``lax`` bodies, key splits, ``vmap`` / ``grad`` /
  ``jit`` inside methods) eagerly, through ``f``, ``jit(f)`` and ``freeze``;
  ``grad`` / ``vmap`` of ``f`` and ``f`` / ``jit(f)`` / ``grad`` under
  ``disable_jit``; under ``checking_leaks``: ``eval_shape``, ``make_jaxpr``
  (evaluated), ``jvp`` with respect to the states, ``linearize`` / ``vjp``
  with respect to a state and ``x``, AOT ``lower().compile()`` of methods
  (one with ``static_argnames``), ``vmap(f, in_axes=(None, 0))`` against the
  plain per-example loop; ``donate_argnums`` (of a copy of the first states,
  as documented), ``jit`` with ``static_argnames`` and ``lax.map`` with
  ``batch_size`` over ``f``. A Python branch in a ``lax.scan`` body under
  ``disable_jit`` was a bug, fixed: under ``disable_jit`` the lax functions
  run JAX's own per-step loop, as plain JAX does. A ``custom_vjp`` whose
  backward rule reads a state through ``f`` is the ``UnhandledLocalStateError``
  whose fix now says to pass the state from ``fwd`` as a residual.

Each source is written plain and decorated (``differential.pair``; ``lax.*``
is a Python loop in the plain module); a case that shows a mismatch stays,
marked ``xfail(strict=True, reason="BUG: ...")`` with what differs.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from differential import (  # noqa: I001 - tests/ is on sys.path
    HEADER,
    X,
    assert_same,
    assert_user_line,
    check,
    check_transform,
    pair,
    snapshot,
    user_line,
)

import autostate
from autostate.errors import (
    EscapedStateError,
    TracedEagerStateError,
    TracedValueError,
    UnhandledLocalStateError,
)

Loader = Callable[..., types.ModuleType]

V3 = jnp.array([0.5, 1.0, -1.0])
XS = jnp.stack([V3, V3 * 2, -V3])


def no_tracer(model: Any) -> None:
    assert not autostate.lifetime.contains_tracer(snapshot(model)), "tracer leaked into the model"


# ======================================================================================
# 1. Callables handed to JAX inside methods: writes that do not depend on the input, reads
# ======================================================================================

INSIDE = """
@DECORATE
class Sub:
    def __init__(self):
        self.n = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.n += 1
        return x * 2


@DECORATE
class Net:
    def __init__(self):
        self.w = jnp.array([1.0, -2.0, 0.5])
        self.mean = jnp.ones(3)
        self.calls = jnp.zeros((), jnp.int32)
        self.key = jax.random.PRNGKey(3)
        self.sub = Sub()

    # --- writes that do not depend on the transformed input ---------------------------

    def count_step(self, x):
        self.calls += 1
        return x * self.w + self.mean

    def vmap_count(self, xs):
        return jax.vmap(self.count_step)(xs)

    def count_loss(self, x):
        self.calls += 1
        return (jnp.sin(x) * self.w).sum() + self.mean.sum()

    def jacrev_count(self, x):
        return jax.jacrev(lambda v: jnp.sin(v) * self.w + self.count_loss(v))(x)

    def jacfwd_count(self, x):
        return jax.jacfwd(self.count_loss)(x)

    def hessian_count(self, x):
        return jax.hessian(self.count_loss)(x)

    def vectorize_count(self, xs):
        return jnp.vectorize(self.count_step, signature="(n)->(n)")(xs)

    def decay_step(self, x):
        self.mean = self.mean * 0.5
        return x * self.mean

    def vmap_decay(self, xs):
        return jax.vmap(self.decay_step)(xs)

    def key_step(self, x):
        self.key, k = jax.random.split(self.key)
        return x + jax.random.normal(k, x.shape)

    def vmap_key(self, xs):
        return jax.vmap(self.key_step)(xs)

    def sub_step(self, x):
        return self.sub(x) + self.calls

    def vmap_sub(self, xs):
        return jax.vmap(self.sub_step)(xs)

    def scan_count(self, x):
        def body(c, v):
            self.calls += 1
            return c + v, c
        return lax.scan(body, 0.0, x)[0]

    def vmap_scan(self, xs):
        return jax.vmap(self.scan_count)(xs)

    def grad_scan(self, x):
        return jax.grad(self.scan_count)(x)

    def fori_count(self, x):
        def body(i, v):
            self.calls += 2
            self.mean = self.mean * 0.9
            return v * self.w
        return lax.fori_loop(0, 3, body, x)

    def vmap_fori(self, xs):
        return jax.vmap(self.fori_count)(xs)

    def jacfwd_fori(self, x):
        return jax.jacfwd(self.fori_count)(x)

    def _inc(self, v, k):
        self.calls += k
        return v * k

    def cond_count(self, x):
        return lax.cond(self.calls % 2 == 0, lambda v: self._inc(v, 1), lambda v: self._inc(v, 3), x)

    def vmap_cond(self, xs):
        return jax.vmap(self.cond_count)(xs)

    def count_combine(self, a, b):
        self.calls += 1
        return a + b * self.w

    def assoc_count(self, xs):
        return jax.lax.associative_scan(self.count_combine, xs)

    def jacrev_aux(self, x):
        def loss(v):
            self.calls += 1
            y = jnp.sin(v) * self.mean
            return y, y.sum()
        j, aux = jax.jacrev(loss, has_aux=True)(x)
        self.mean = self.mean + aux
        return j

    def pmean_step(self, x):
        m = jax.lax.pmean(x, "b")
        self.mean = 0.9 * self.mean + 0.1 * m
        return x - m

    def vmap_pmean(self, xs):
        return jax.vmap(self.pmean_step, axis_name="b")(xs)

    def count_write(self, x):
        self.mean = self.mean + x
        self.calls += 1
        return self.mean * self.w

    def named_call_write(self, x):
        return jax.named_call(self.count_write, name="cw")(x)

    def cjvp_primal_write(self, x):
        @jax.custom_jvp
        def g(v):
            self.mean = self.mean + v
            self.calls += 1
            return jnp.sin(v) * self.w
        @g.defjvp
        def g_jvp(p, t):
            return g(p[0]), jnp.cos(p[0]) * self.w * t[0]
        return g(x).sum()

    def cvjp_primal_write(self, x):
        @jax.custom_vjp
        def g(v):
            self.mean = self.mean + v
            return v * self.w
        def fwd(v):
            return g(v), v
        def bwd(res, ct):
            return (ct * self.w,)
        g.defvjp(fwd, bwd)
        return g(x).sum()

    def cvjp_bwd_reads_state(self, x):
        @jax.custom_vjp
        def g(v):
            return v * self.w
        def fwd(v):
            return g(v), None
        def bwd(res, ct):
            return (ct * self.mean,)  # <- bwd reads
        g.defvjp(fwd, bwd)
        y = g(x)
        self.mean = self.mean + 1.0
        return y.sum()

    # --- reads ---------------------------------------------------------------------------

    def read_step(self, x):
        return jnp.tanh(x * self.w + self.mean)

    def jacrev_read(self, x):
        self.mean = self.mean + x
        return jax.jacrev(self.read_step)(x)

    def vectorize_scalar(self, xs):
        self.mean = self.mean + 1.0
        return jnp.vectorize(lambda a, b: a * b + self.mean.sum())(xs, self.w)

    def combine(self, a, b):
        return a * self.w + b + self.mean

    def assoc_method(self, xs):
        self.mean = self.mean + 0.5
        return jax.lax.associative_scan(self.combine, xs)

    def add_pair(self, a, b):
        return a + b

    def reduce_method(self, xs):
        self.calls += 1
        return jax.lax.reduce(xs * self.w, 0.0, self.add_pair, (0,))

    def custom_root_read(self, x):
        self.mean = self.mean + 1.0
        def f(v):
            return v * v - self.mean - 2.0 - x * x
        def solve(g, v0):
            v = v0
            for _ in range(30):
                v = v - g(v) / (2 * v)
            return v
        return jax.lax.custom_root(f, jnp.ones(3), solve, lambda g, y: y / g(jnp.ones(3)))

    def linear_solve_read(self, b):
        self.mean = self.mean + 1.0
        diag = jnp.abs(self.w) + self.mean
        return jax.lax.custom_linear_solve(lambda v: diag * v, b, lambda mv, r: r / diag,
                                           symmetric=True)

    def cvjp_output_assigned(self, x):
        @jax.custom_vjp
        def g(v):
            return v * self.w + self.mean
        def fwd(v):
            return g(v), (v, self.mean)
        def bwd(res, ct):
            return (ct * self.w * 2 + res[1],)
        g.defvjp(fwd, bwd)
        y = g(x)
        self.mean = self.mean + y
        return y.sum()

    def host_double(self, v):
        return (np.asarray(v) * 2).astype(np.float32)

    def pure_cb_method(self, x):
        self.mean = self.mean + x
        return jax.pure_callback(self.host_double, jax.ShapeDtypeStruct((3,), jnp.float32),
                                 self.mean, vmap_method="sequential")

    def cte_branch(self, x):
        with jax.ensure_compile_time_eval():
            if self.mean.sum() > 3:
                y = x * 2
            else:
                y = x
        self.mean = self.mean + x
        return y
"""

INSIDE_CALLS: dict[str, Any] = {
    "vmap_count": XS,
    "jacrev_count": V3,
    "jacfwd_count": V3,
    "hessian_count": V3,
    "vectorize_count": XS,
    "vmap_decay": XS,
    "vmap_key": XS,
    "vmap_sub": XS,
    "vmap_scan": XS,
    "grad_scan": V3,
    "vmap_fori": XS,
    "jacfwd_fori": V3,
    "vmap_cond": XS,
    "vmap_pmean": XS,
    "assoc_count": XS,
    "jacrev_aux": V3,
    "named_call_write": V3,
    "jacrev_read": V3,
    "vectorize_scalar": XS,
    "assoc_method": XS,
    "reduce_method": XS,
    "custom_root_read": V3,
    "linear_solve_read": V3,
    "cvjp_output_assigned": V3,
    "pure_cb_method": V3,
}


@pytest.mark.parametrize("method", sorted(INSIDE_CALLS))
def test_callables_inside_methods(write_module: Loader, method: str) -> None:
    plain, dec = pair(write_module, INSIDE)
    arg = INSIDE_CALLS[method]
    check(plain, dec, "Net()", [(method, (arg,)), (method, (arg * 2,))])


UNDER_GRAD_AND_VMAP = ["vmap_scan", "jacrev_aux", "custom_root_read"]


@pytest.mark.parametrize("transform", ["grad", "vmap"])
@pytest.mark.parametrize("method", UNDER_GRAD_AND_VMAP)
def test_callables_inside_methods_under_grad_and_vmap_of_f(
    write_module: Loader, method: str, transform: str
) -> None:
    plain, dec = pair(write_module, INSIDE)
    arg = INSIDE_CALLS[method]
    x = arg if transform == "grad" else jnp.stack([arg, arg + 1])
    check_transform(plain, dec, "Net()", [(method, (X,))] * 2, x, transform)


@pytest.mark.parametrize("method", ["cjvp_primal_write", "cvjp_primal_write", "cte_branch"])
def test_custom_primals_writing_state_and_compile_time_eval_eagerly_and_in_f(
    write_module: Loader, method: str
) -> None:
    """Eagerly JAX runs a custom_jvp / custom_vjp primal (and an
    ``ensure_compile_time_eval`` block) on concrete values: a write there is plain."""
    plain, dec = pair(write_module, INSIDE)
    check(plain, dec, "Net()", [(method, (V3,)), (method, (V3 * 2,))], modes=("eager", "f"))


def test_grad_of_f_through_a_custom_vjp_primal_that_writes_state(write_module: Loader) -> None:
    """Under ``jax.grad`` (not jitted) the ``fwd`` rule runs the primal on concrete
    values: the state it writes comes out concrete, as plain Python's would."""
    plain, dec = pair(write_module, INSIDE)
    f, states = dec.Net().functionalize()

    def ref(x: Any) -> Any:
        m = plain.Net()
        return m.cvjp_primal_write(x), m.mean

    g, (out, new) = jax.grad(
        lambda x: (lambda o: (o[0], o))(f.cvjp_primal_write(states, x)), has_aux=True)(V3)
    assert_same(jax.grad(lambda x: ref(x)[0])(V3), g)
    assert_same(ref(V3), (out, new["mean"]))


def test_grad_of_f_through_a_custom_vjp_bwd_reading_state(write_module: Loader) -> None:
    plain, dec = pair(write_module, INSIDE)
    ref = plain.Net()
    expected = jax.grad(ref.cvjp_bwd_reads_state)(V3)
    model = dec.Net()
    assert_same(expected, jax.grad(model.cvjp_bwd_reads_state)(V3), "eager")
    assert_same(snapshot(ref), snapshot(model), "eager attributes")
    f, states = dec.Net().functionalize()
    # The backward pass runs after f returned: a clear error, naming the bwd
    # line and saying to pass the state from fwd as a residual.
    with pytest.raises(autostate.errors.UnhandledLocalStateError) as err:
        jax.grad(lambda x: f.cvjp_bwd_reads_state(states, x)[0])(V3)
    user_line(err.value, dec, "# <- bwd reads")
    assert "custom_vjp" in str(err.value) and "residual" in str(err.value)


@pytest.mark.parametrize("method", ["cjvp_primal_write", "cvjp_primal_write"])
def test_custom_primal_writing_state_under_jit_is_escaped_state_error(
    write_module: Loader, method: str
) -> None:
    """Under ``jit`` JAX traces the primal into its own jaxpr: plain JAX would leak
    that tracer into the model; autostate refuses, naming the call's line."""
    _, dec = pair(write_module, INSIDE)
    f, states = dec.Net().functionalize()
    with pytest.raises(EscapedStateError, match="State '(mean|calls)'") as info:
        jax.jit(getattr(f, method))(states, V3)
    assert_user_line(info.value, __file__)
    assert "fix" in str(info.value)
    out, _ = jax.jit(f.count_write)(states, V3)  # f is left usable
    assert_same(np.asarray((V3 + 1) * jnp.array([1.0, -2.0, 0.5])), out)


def test_compile_time_eval_branch_on_a_state_under_jit_is_traced_value_error(
    write_module: Loader,
) -> None:
    _, dec = pair(write_module, INSIDE)
    f, states = dec.Net().functionalize()
    with pytest.raises(TracedValueError) as info:
        jax.jit(f.cte_branch)(states, V3)
    user_line(info.value, dec, "if self.mean.sum() > 3:")


# ======================================================================================
# 2. Writes that depend on the transformed input: plain JAX leaves the tracer in the object
# ======================================================================================

ESCAPES = """
@DECORATE
class Esc:
    def __init__(self):
        self.w = jnp.array([1.0, -2.0, 0.5])
        self.mean = jnp.zeros(3)
        self.calls = jnp.zeros((), jnp.int32)

    def step(self, x):
        self.mean = self.mean + x  # <- step writes
        return x * self.w, self.mean

    def loss(self, x):
        self.mean = self.mean + x  # <- loss writes
        return (jnp.sin(x) * self.w).sum()

    def vmap_bound(self, xs):
        return jax.vmap(self.step)(xs)[0]

    def vmap_lambda(self, xs):
        return jax.vmap(lambda x: self.step(x)[0] * 2)(xs)

    def jacrev_write(self, x):
        return jax.jacrev(self.loss)(x)

    def jacfwd_write(self, x):
        return jax.jacfwd(self.loss)(x)

    def hessian_write(self, x):
        return jax.hessian(self.loss)(x)

    def vectorize_write(self, xs):
        return jnp.vectorize(lambda x: self.step(x)[0], signature="(n)->(n)")(xs)

    def root_write(self, x):
        def f(v):
            self.mean = self.mean + v  # <- root writes
            return v * v - 2.0 - x * x
        def solve(g, v0):
            v = v0
            for _ in range(20):
                v = v - g(v) / (2 * v)
            return v
        return jax.lax.custom_root(f, jnp.ones(3), solve, lambda g, y: y / g(jnp.ones(3)))

    def matvec_count(self, v):
        self.calls += 1  # <- matvec writes
        return v * jnp.abs(self.w)

    def linsolve_count(self, b):
        return jax.lax.custom_linear_solve(self.matvec_count, b,
                                           lambda mv, r: r / jnp.abs(self.w))

    def vmap_then_overwrite(self, xs):
        ys, means = jax.vmap(self.step)(xs)
        self.mean = means.mean(0)
        return ys

    def grad_then_overwrite(self, x):
        g, m = jax.grad(lambda v: (self.step(v)[0].sum(), self.mean), has_aux=True)(x)
        self.mean = m * 2
        return g

    def add_count(self, a, b):
        self.calls += 1  # <- reduce writes
        return a + b

    def reduce_write(self, xs):
        return jax.lax.reduce(xs, 0.0, self.add_count, (0,))
"""

ESCAPE_CASES: dict[str, tuple[Any, str]] = {
    "vmap_bound": (XS, "# <- step writes"),
    "vmap_lambda": (XS, "# <- step writes"),
    "jacrev_write": (V3, "# <- loss writes"),
    "jacfwd_write": (V3, "# <- loss writes"),
    "hessian_write": (V3, "# <- loss writes"),
    "vectorize_write": (XS, "# <- step writes"),
    "root_write": (V3, "# <- root writes"),
    "linsolve_count": (V3, "# <- matvec writes"),
}


@pytest.mark.parametrize("method", sorted(ESCAPE_CASES))
def test_input_dependent_write_in_a_transformed_callable_is_refused(
    write_module: Loader, method: str
) -> None:
    """Eagerly: ``TracedEagerStateError`` at the write, the model unchanged; through
    ``f`` and ``jit(f)``: ``EscapedStateError`` naming a user line, ``f`` still usable."""
    _, dec = pair(write_module, ESCAPES)
    arg, text = ESCAPE_CASES[method]
    model = dec.Esc()
    with pytest.raises(TracedEagerStateError) as info:
        getattr(model, method)(arg)
    user_line(info.value, dec, text)
    no_tracer(model)
    assert_same(snapshot(dec.Esc()), snapshot(model), "unchanged")
    f, states = dec.Esc().functionalize()
    for call in (getattr(f, method), jax.jit(getattr(f, method))):
        with pytest.raises(EscapedStateError) as info:
            call(states, arg)
        msg = str(info.value)
        assert f"{__file__}:" in msg or f"{dec.__file__}:" in msg, msg
        assert "fix" in msg
    out, new = jax.jit(f.step)(states, V3)  # f is left usable
    assert_same((V3 * jnp.array([1.0, -2.0, 0.5]), V3, V3), (*out, new["mean"]))
    no_tracer(autostate.freeze(f, new))


@pytest.mark.parametrize("method", ["vmap_then_overwrite", "grad_then_overwrite"])
def test_escaped_write_overwritten_in_the_method(write_module: Loader, method: str) -> None:
    """Plain Python leaves the tracer only until the method overwrites it: through
    ``f`` the result is plain Python's; eagerly the first write is refused (stricter)."""
    plain, dec = pair(write_module, ESCAPES)
    arg = XS if method.startswith("vmap") else V3
    check(plain, dec, "Esc()", [(method, (arg,)), (method, (arg * 2,))], modes=("f", "jit"))
    model = dec.Esc()
    with pytest.raises(TracedEagerStateError) as info:
        getattr(model, method)(arg)
    user_line(info.value, dec, "# <- step writes")
    no_tracer(model)


def test_reduce_computation_writing_state_eagerly_is_traced_eager_state_error(
    write_module: Loader,
) -> None:
    _, dec = pair(write_module, ESCAPES)
    model = dec.Esc()
    with pytest.raises(TracedEagerStateError) as info:
        model.reduce_write(XS)
    user_line(info.value, dec, "# <- reduce writes")
    no_tracer(model)


@pytest.mark.xfail(strict=True, reason=(
    "BUG: a jax.lax.reduce computation (a bound method) that assigns state, through f: "
    "a bare AssertionError from JAX's reduce (message '[Array(0, dtype=int32)]'); with f "
    "and states as jit arguments NotImplementedError \"Reduction computations can't close "
    "over Tracers. Please open an issue\"; expected EscapedStateError naming the user's "
    "line, as eagerly (TracedEagerStateError) and for vmap/custom_root/custom_linear_solve"))
def test_reduce_computation_writing_state_through_f_is_an_autostate_error(
    write_module: Loader,
) -> None:
    _, dec = pair(write_module, ESCAPES)
    f, states = dec.Esc().functionalize()
    with pytest.raises(autostate.AutostateError):
        f.reduce_write(states, XS)
    with pytest.raises(autostate.AutostateError):
        jax.jit(lambda f, s, x: f.reduce_write(s, x))(f, states, XS)


@pytest.mark.xfail(strict=True, reason=(
    "BUG: under jax.checking_leaks(), jax.vmap(self.step)(xs) inside a method, where step "
    "assigns state from its input, called through f: JAX's 'Exception: Leaked trace "
    "BatchTrace' instead of the EscapedStateError the same call raises without "
    "checking_leaks (eagerly: TracedEagerStateError at the write). The same for "
    "jnp.vectorize, a custom_linear_solve matvec, a custom_root function and, under "
    "jax.jit(f.m), a custom_vjp / custom_jvp primal ('Leaked trace DynamicJaxprTrace ... "
    "referred to by <LocalStateEffectImpl>'): the functional write keeps the inner trace's "
    "tracer in the state cell until f returns"))
def test_escaping_write_through_f_under_checking_leaks(write_module: Loader) -> None:
    _, dec = pair(write_module, ESCAPES)
    f, states = dec.Esc().functionalize()
    with jax.checking_leaks(), pytest.raises(EscapedStateError):
        f.vmap_bound(states, XS)


def test_vmap_of_a_writing_method_with_the_host_fallback_gives_per_example_state(
    write_module: Loader,
) -> None:
    """Documented (host_fallback.md, "vmap: per-example state"): an input-dependent
    write under ``vmap`` is per-example (stacked when read outside), a constant one shared."""
    src = ESCAPES.replace("@DECORATE", "@DECORATE_HOST")
    _, dec = pair(write_module, src)
    model = dec.Esc()
    with jax.checking_leaks():
        out = model.vmap_bound(XS)
    assert_same(np.asarray(XS * jnp.array([1.0, -2.0, 0.5])), out)
    assert_same(np.asarray(XS), model.mean, "per-example means, stacked")
    no_tracer(model)


# ======================================================================================
# 3. Host callbacks handed bound methods
# ======================================================================================

CALLBACKS = """
@DECORATE
class Cb:
    def __init__(self):
        self.w = jnp.array([1.0, -2.0, 0.5])
        self.mean = jnp.zeros(3)
        self.last = jnp.zeros(3)
        self.log = []

    def log_host(self, v):
        self.log.append(np.asarray(v))

    def debug_log(self, x):
        self.mean = self.mean + x
        jax.debug.callback(self.log_host, self.mean)
        return self.mean.sum()

    def set_last(self, v):
        self.last = jnp.asarray(v) * 2  # <- host write

    def debug_write(self, x):
        self.mean = self.mean + x
        jax.debug.callback(self.set_last, self.mean)
        return self.mean.sum()

    def set_last_ret(self, v):
        self.last = jnp.asarray(v) * 2  # <- pure host write
        return np.asarray(v, np.float32) + 1

    def pure_write(self, x):
        self.mean = self.mean + x
        return jax.pure_callback(self.set_last_ret, jax.ShapeDtypeStruct((3,), jnp.float32),
                                 self.mean)

    def times_w(self, v):
        return (np.asarray(v) * np.asarray(self.w)).astype(np.float32)

    def pure_reads_param(self, x):
        self.mean = self.mean + x
        return jax.pure_callback(self.times_w, jax.ShapeDtypeStruct((3,), jnp.float32), self.mean)
"""


def _cb_pair(write_module: Loader) -> tuple[types.ModuleType, types.ModuleType]:
    return pair(write_module, CALLBACKS)


def test_debug_callback_method_appending_to_a_list_eagerly_in_f_and_jit_of_f(
    write_module: Loader,
) -> None:
    plain, dec = _cb_pair(write_module)
    ref = plain.Cb()
    expected = [ref.debug_log(V3), ref.debug_log(V3 * 2)]
    assert len(ref.log) == 2
    model = dec.Cb()
    got = [model.debug_log(V3), model.debug_log(V3 * 2)]
    assert_same(expected, got, "eager")
    assert_same(snapshot(ref), snapshot(model), "eager attributes")
    for how in ("f", "jit(f)"):
        m = dec.Cb()
        f, states = m.functionalize()
        call = f.debug_log if how == "f" else jax.jit(f.debug_log)
        outs = []
        for v in (V3, V3 * 2):
            out, states = call(states, v)
            outs.append(out)
        jax.effects_barrier()
        assert_same(expected, outs, how)
        assert_same(snapshot(ref), snapshot(autostate.freeze(f, states)), f"{how}: frozen")
        assert m.log == [], f"{how}: the eager model changed"


@pytest.mark.xfail(strict=True, reason=(
    "BUG: jax.debug.callback(self.log_host, ...) where log_host appends to a list that is "
    "not state, in a call of f under jax.jit with f passed as an argument "
    "(jax.jit(lambda f, s, x: f.m(s, x))(f, states, x)): the callback is bound to the copy "
    "of the model unflattened inside the trace, so the entries are silently lost: "
    "freeze(f, states).log == [] (expected 2 entries, as eagerly and with jax.jit(f.m), or "
    "the documented StateAccessError)"))
def test_debug_callback_method_appending_to_a_list_with_f_as_a_jit_argument(
    write_module: Loader,
) -> None:
    plain, dec = _cb_pair(write_module)
    ref = plain.Cb()
    expected = [ref.debug_log(V3), ref.debug_log(V3 * 2)]
    f, states = dec.Cb().functionalize()
    step = jax.jit(lambda f, s, x: f.debug_log(s, x))
    outs = []
    for v in (V3, V3 * 2):
        out, states = step(f, states, v)
        outs.append(out)
    jax.effects_barrier()
    assert_same(expected, outs)
    assert_same(snapshot(ref), snapshot(autostate.freeze(f, states)), "frozen")


@pytest.mark.xfail(strict=True, reason=(
    "BUG: a host callback given a bound method of the model (jax.debug.callback("
    "self.log_host, ...), jax.pure_callback(self.times_w, ...)) in a call of f under "
    "jax.jit with f passed as an argument: the callback keeps the traced copy of the model "
    "alive; jax.checking_leaks() reports 'Exception: Leaked trace DynamicJaxprTrace ... "
    "<Net>.w is referred to by <method> ... _FlatCallback' (jax.jit(f.m) does not leak)"))
def test_host_callback_bound_method_with_f_as_a_jit_argument_does_not_leak(
    write_module: Loader,
) -> None:
    _, dec = _cb_pair(write_module)
    f, states = dec.Cb().functionalize()
    with jax.checking_leaks():
        jax.jit(lambda f, s, x: f.debug_log(s, x))(f, states, V3)
        jax.effects_barrier()


@pytest.mark.xfail(strict=True, reason=(
    "BUG: jax.pure_callback(self.times_w, ...) whose host function reads a parameter "
    "(self.w), in a call of f under jax.jit with f passed as an argument: a raw "
    "TracerArrayConversionError inside JAX's JaxRuntimeError ('INTERNAL: CpuCallback "
    "error'); expected the value (as eagerly, through f and with jax.jit(f.m)) or an "
    "autostate error naming the line"))
def test_pure_callback_method_reading_a_parameter_with_f_as_a_jit_argument(
    write_module: Loader,
) -> None:
    plain, dec = _cb_pair(write_module)
    expected = plain.Cb().pure_reads_param(V3)
    f, states = dec.Cb().functionalize()
    assert_same(expected, jax.jit(f.pure_reads_param)(states, V3)[0], "jit(f.m)")
    try:
        out, _ = jax.jit(lambda f, s, x: f.pure_reads_param(s, x))(f, states, V3)
    except autostate.AutostateError as err:
        user_line(err, dec, "np.asarray(self.w)")
    else:
        assert_same(expected, out)


def test_pure_callback_method_reading_a_parameter_eagerly_in_f_and_jit_of_f(
    write_module: Loader,
) -> None:
    plain, dec = _cb_pair(write_module)
    check(plain, dec, "Cb()", [("pure_reads_param", (V3,)), ("pure_reads_param", (V3 * 2,))],
          modes=("eager", "f"))
    f, states = dec.Cb().functionalize()
    ref = plain.Cb()
    for v in (V3, -V3):
        out, states = jax.jit(f.pure_reads_param)(states, v)
        assert_same(ref.pure_reads_param(v), out)


@pytest.mark.parametrize("method", ["debug_write", "pure_write"])
def test_host_callback_method_writing_a_state(write_module: Loader, method: str) -> None:
    """Eagerly and through ``f`` the callback runs during the call: plain values. Under
    ``jit`` it runs after the call: the documented ``UnhandledLocalStateError``, wrapped
    by JAX in its ``JaxRuntimeError``, naming the line."""
    plain, dec = _cb_pair(write_module)
    check(plain, dec, "Cb()", [(method, (V3,)), (method, (V3 * 2,))], modes=("eager", "f"))
    f, states = dec.Cb().functionalize()
    with pytest.raises(jax.errors.JaxRuntimeError) as info:
        jax.jit(getattr(f, method))(states, V3)
        jax.effects_barrier()
    msg = str(info.value)
    assert UnhandledLocalStateError.__name__ in msg
    text = "# <- host write" if method == "debug_write" else "# <- pure host write"
    lines = open(dec.__file__).read().splitlines()
    number = next(i + 1 for i, line in enumerate(lines) if text in line)
    assert f"{dec.__file__}:{number}" in msg


# ======================================================================================
# 4. Around f: disable_jit and checking_leaks
# ======================================================================================

AROUND = """
@DECORATE
class Rnn:
    def __init__(self):
        self.w = jnp.array([[0.5, -0.2, 0.1], [0.3, 0.4, -0.6], [0.0, 0.2, 0.9]])
        self.h = jnp.zeros(3)
        self.steps = jnp.zeros((), jnp.int32)
        self.mean = jnp.zeros(3)
        self.key = jax.random.PRNGKey(0)

    def cell(self, c, x):
        self.h = jnp.tanh(self.h @ self.w + x)
        self.steps += 1
        return c + self.h.sum(), self.h

    def __call__(self, xs):
        return lax.scan(self.cell, 0.0, xs)

    def fori(self, x):
        def body(i, v):
            self.mean = self.mean * 0.5 + v
            self.steps += 1
            return v * 0.9
        return lax.fori_loop(0, 3, body, x)

    def loop(self, x):
        def cond(v):
            return v.sum() < 4.0
        def body(v):
            self.steps += 1
            self.mean = self.mean + 0.25
            return v + 1.0
        return lax.while_loop(cond, body, x)

    def branch(self, x):
        def yes(v):
            self.mean = self.mean + v
            return v * 2
        def no(v):
            self.steps += 5
            return -v
        return lax.cond(x.sum() > 0, yes, no, x)

    def noisy(self, x):
        self.key, sub = jax.random.split(self.key)
        self.mean = self.mean + jax.random.normal(sub, (3,)) * 0.1
        self.steps += 1
        return x + self.mean

    def vm(self, xs):
        self.steps += 1
        return jax.vmap(lambda v: jnp.tanh(v @ self.w + self.h))(xs)

    def gr(self, x):
        self.mean = self.mean + x
        return jax.grad(lambda v: (jnp.sin(v @ self.w) * self.mean).sum())(x)

    def jitted_read(self, x):
        self.h = self.h + x
        return jax.jit(lambda v: v @ self.w + self.h)(x)

    def scaled(self, x, k):
        self.steps += k
        return lax.scan(self.cell, 0.0, x * k)[0] if k > 1 else -x.sum()

    def sign_body(self, c, x):
        if x.sum() > 0:
            self.mean = self.mean + x
        else:
            self.steps += 1
        return c + 1.0, x * 2

    def python_branch_scan(self, xs):
        return lax.scan(self.sign_body, 0.0, xs)
"""

AROUND_CALLS: dict[str, Any] = {
    "__call__": XS, "fori": V3, "loop": V3, "branch": V3, "noisy": V3, "vm": XS, "gr": V3,
    "jitted_read": V3,
}
RNN_KEYS = ("h", "steps", "mean", "key")


@contextlib.contextmanager
def _context(name: str) -> Iterator[None]:
    if name == "disable_jit":
        with jax.disable_jit():
            yield
    elif name == "checking_leaks":
        with jax.checking_leaks():
            yield
    else:
        raise AssertionError(name)


# (jax.checking_leaks() turns JAX's tracing caches off: a few calls each, kept short)
UNDER_CONTEXT = {
    "disable_jit": ["__call__", "branch", "loop", "vm"],
    "checking_leaks": ["__call__", "gr"],
}


@pytest.mark.parametrize("ctx", sorted(UNDER_CONTEXT))
def test_representative_model_under_context(write_module: Loader, ctx: str) -> None:
    plain, dec = pair(write_module, AROUND)
    with _context(ctx):
        for method in UNDER_CONTEXT[ctx]:
            arg = AROUND_CALLS[method]
            calls = [(method, (arg,)), (method, (-arg * 2,))]
            check(plain, dec, "Rnn()", calls[:1] if ctx == "checking_leaks" else calls)


def test_grad_and_vmap_of_f_under_disable_jit(write_module: Loader) -> None:
    """(Under ``checking_leaks``, ``grad`` inside a method, ``jvp`` / ``linearize`` /
    ``vjp`` and ``vmap`` of ``f`` are covered below.)"""
    plain, dec = pair(write_module, AROUND)
    with jax.disable_jit():
        check_transform(plain, dec, "Rnn()", [("gr", (X,))], V3, "grad")
        check_transform(plain, dec, "Rnn()", [("__call__", (X,))], jnp.stack([XS, XS * 2]), "vmap")


def _pstates(model: Any) -> dict[str, Any]:
    return snapshot({k: getattr(model, k) for k in RNN_KEYS})


def _around_f_eval_shape(plain: types.ModuleType, f: Any, s: Any) -> None:
    out, new = jax.eval_shape(f, s, XS)
    ref = jax.eval_shape(lambda xs: (lambda m: (m(xs), {k: getattr(m, k) for k in RNN_KEYS}))(
        plain.Rnn()), XS)
    shape = lambda t: jax.tree.map(lambda a: (a.shape, a.dtype), t)  # noqa: E731
    assert shape((out, new)) == shape(ref)
    for method, arg in AROUND_CALLS.items():
        if method != "__call__":
            assert shape(jax.eval_shape(getattr(f, method), s, arg)[1]) == shape(s)


def _around_f_make_jaxpr(plain: types.ModuleType, f: Any, s: Any) -> None:
    for method in ("__call__", "gr"):
        call = f if method == "__call__" else getattr(f, method)
        arg = AROUND_CALLS[method]
        closed = jax.make_jaxpr(call)(s, arg)
        assert "callback" not in str(closed)
        got = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *jax.tree.leaves((s, arg)))
        ref = plain.Rnn()
        expected = (getattr(ref, method)(arg), {k: getattr(ref, k) for k in sorted(s)})
        assert_same(snapshot(jax.tree.leaves(expected)), snapshot(got), method)


def _around_f_jvp_states(plain: types.ModuleType, f: Any, s: Any) -> None:
    def pl(h: Any, mean: Any) -> Any:
        m = plain.Rnn()
        m.h, m.mean = h, mean
        return m.fori(V3), m(XS), m.h, m.mean

    def dl(h: Any, mean: Any) -> Any:
        out, s2 = f.fori(dict(s, h=h, mean=mean), V3)
        y, s2 = f(s2, XS)
        return out, y, s2["h"], s2["mean"]

    args = (jnp.ones(3) * 0.1, jnp.ones(3) * 0.2)
    tangents = (jnp.ones(3), -jnp.ones(3))
    assert_same(jax.jvp(pl, args, tangents),
                jax.jit(lambda a, t: jax.jvp(dl, a, t))(args, tangents))


def _around_f_linearize_vjp(plain: types.ModuleType, f: Any, s: Any) -> None:
    def pl(mean: Any, x: Any) -> Any:
        m = plain.Rnn()
        m.mean = mean
        return m.fori(x), m.mean

    def dl(mean: Any, x: Any) -> Any:
        y, s2 = f.fori(dict(s, mean=mean), x)
        return y, s2["mean"]

    args = (jnp.ones(3) * 0.1, V3)
    py, plin = jax.linearize(pl, *args)
    dy, dlin = jax.linearize(dl, *args)
    assert_same(py, dy)
    assert_same(plin(jnp.ones(3), V3), dlin(jnp.ones(3), V3))
    _, pback = jax.vjp(pl, *args)
    _, dback = jax.vjp(dl, *args)
    ct = (jnp.ones(3), -jnp.ones(3))
    assert_same(pback(ct), dback(ct))


def _around_f_donate(plain: types.ModuleType, f: Any, s: Any) -> None:
    step = jax.jit(f, donate_argnums=0)
    s = jax.tree.map(jnp.copy, s)  # the first states share the model's arrays (documented)
    ref = plain.Rnn()
    outs, expected = [], []
    for xs in (XS, -XS):
        out, s = step(s, xs)
        outs.append(out)
        expected.append(ref(xs))
    assert_same(expected, outs)
    assert_same(snapshot(ref), snapshot(autostate.freeze(f, s)))


def _around_f_aot(plain: types.ModuleType, f: Any, s: Any) -> None:
    fori = jax.jit(f.fori).lower(s, V3).compile()
    call = jax.jit(f).lower(s, XS).compile()
    scaled = jax.jit(f.scaled, static_argnames="k").lower(s, XS, k=3).compile()
    ref = plain.Rnn()
    outs = []
    for fn, a in ((fori, V3), (call, XS), (scaled, XS), (fori, -V3)):
        out, s = fn(s, a)  # (k=3 is baked into the compiled `scaled`)
        outs.append(out)
    assert_same([ref.fori(V3), ref(XS), ref.scaled(XS, 3), ref.fori(-V3)], outs)
    assert_same(_pstates(ref), snapshot(s))


def _around_f_static_argnames(plain: types.ModuleType, f: Any, s: Any) -> None:
    step = jax.jit(f.scaled, static_argnames="k")
    ref = plain.Rnn()
    outs = []
    for k in (3, 1, 2):
        out, s = step(s, XS, k=k)
        outs.append(out)
    assert_same([ref.scaled(XS, k) for k in (3, 1, 2)], outs)
    assert_same(_pstates(ref), snapshot(s))


def _around_f_vmap_shared_states(plain: types.ModuleType, f: Any, s: Any) -> None:
    xss = jnp.stack([XS, XS * 2])
    out, new = jax.jit(jax.vmap(f, in_axes=(None, 0)))(s, xss)
    if True:
        for i in range(2):
            ref = plain.Rnn()  # each example starts from the same states
            assert_same(ref(xss[i]), jax.tree.map(lambda a, i=i: a[i], out))
            assert_same(_pstates(ref), snapshot(jax.tree.map(lambda a, i=i: a[i], new)))


def _around_f_lax_map(plain: types.ModuleType, f: Any, s: Any) -> None:
    xss = jnp.stack([XS, XS * 2, -XS])
    for kw in ({"batch_size": 2},):
        out, new = jax.lax.map(lambda x: f(s, x), xss, **kw)
        for i in range(3):
            ref = plain.Rnn()
            assert_same(ref(xss[i]), jax.tree.map(lambda a, i=i: a[i], out))
            assert_same(_pstates(ref), snapshot(jax.tree.map(lambda a, i=i: a[i], new)))


# (name: (check, under jax.checking_leaks()); the last three repeat jitted calls, each a
# fresh compilation with the leak checker on: run plainly, to keep the file fast)
AROUND_F = {
    "eval_shape": (_around_f_eval_shape, True),
    "make_jaxpr": (_around_f_make_jaxpr, True),
    "jvp-states": (_around_f_jvp_states, True),
    "linearize-vjp": (_around_f_linearize_vjp, True),
    "aot": (_around_f_aot, True),
    "vmap-shared-states": (_around_f_vmap_shared_states, True),
    "donate": (_around_f_donate, False),
    "static_argnames": (_around_f_static_argnames, False),
    "lax.map-batch_size": (_around_f_lax_map, False),
}


@pytest.mark.parametrize("how", sorted(AROUND_F))
def test_transformations_of_f(write_module: Loader, how: str) -> None:
    plain, dec = pair(write_module, AROUND)
    model = dec.Rnn()
    f, states = model.functionalize()
    run, leaks = AROUND_F[how]
    with jax.checking_leaks() if leaks else contextlib.nullcontext():
        run(plain, f, states)
    assert_same(_pstates(plain.Rnn()), snapshot(model.functionalize()[1]), "model unchanged")


def test_disable_jit_around_f_jit_of_f_and_grad(write_module: Loader) -> None:
    plain, dec = pair(write_module, AROUND)
    f, s = dec.Rnn().functionalize()
    ref = plain.Rnn()
    with jax.disable_jit():
        outs = []
        for call, method, a in ((f, "__call__", XS), (jax.jit(f.fori), "fori", V3),
                                (jax.jit(f.loop), "loop", V3), (f.branch, "branch", -V3),
                                (jax.jit(f.noisy), "noisy", V3)):
            out, s = call(s, a)
            outs.append((out, getattr(ref, method)(a)))
        for got, expected in outs:
            assert_same(expected, got)
        assert_same(_pstates(ref), snapshot(s))
        g = jax.grad(lambda x: f.gr(s, x)[0].sum())(V3)
        assert_same(jax.grad(lambda x: ref.gr(x).sum())(V3), g)


def test_python_branch_in_a_scan_body_under_disable_jit(write_module: Loader) -> None:
    plain, dec = pair(write_module, AROUND)
    jax_plain = write_module(HEADER + "from jax import lax\n" + AROUND.replace("@DECORATE", ""))
    calls = [("python_branch_scan", (XS,)), ("python_branch_scan", (-XS,))]
    with jax.disable_jit():
        ref = jax_plain.Rnn()  # JAX's own scan, run per step
        expected = [ref.python_branch_scan(*a) for _, a in calls]
        loop = plain.Rnn()  # the harness's Python loop
        assert_same([loop.python_branch_scan(*a) for _, a in calls], expected)
        assert_same(snapshot(loop), snapshot(ref))
        check(plain, dec, "Rnn()", calls, modes=("eager", "f"))
