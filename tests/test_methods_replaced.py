"""Methods replaced after the class statement, on the class or on one
instance, as PyTorch code does (``model.forward = types.MethodType(fn,
model)``), mean what plain Python means eagerly, through ``f`` (including
``f.<name>`` for a callable the instance holds) and under ``jax.jit``; the
replacement is not rewritten, so its state reads and writes go through the
run-time descriptors.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np

import autostate


def _make():
    @autostate.stateful
    class Counter:
        def __init__(self):
            self.n = jnp.zeros(())
            self.w = jnp.ones(())

        def __call__(self, x):
            self.n = self.n + 1
            return x * self.w

    return Counter


def _plain(make):
    """The same class undecorated: the reference."""

    class Counter:
        def __init__(self):
            self.n = jnp.zeros(())
            self.w = jnp.ones(())

        def __call__(self, x):
            self.n = self.n + 1
            return x * self.w

    return Counter


def forward10(self, x):
    self.n = self.n + 10
    return x * 2 * self.w


def _run_all(model, name, calls):
    """Eager outputs and n; f's and jit's, from a fresh functionalize each."""
    f, states = model.functionalize()
    jitted = jax.jit(lambda f, s, x: getattr(f, name)(s, x) if name else f(s, x))
    call = getattr(f, name) if name else f
    f_out, s = [], states
    for x in calls:
        out, s = call(s, x)
        f_out.append(float(out))
    j_out, js = [], states
    for x in calls:
        out, js = jitted(f, js, x)
        j_out.append(float(out))
    eager = [float((getattr(model, name) if name else model)(x)) for x in calls]
    return eager, float(model.n), f_out, float(s["n"]), j_out, float(js["n"])


def _plain_run(model, name, calls):
    outs = [float((getattr(model, name) if name else model)(x)) for x in calls]
    return outs, float(model.n)


def test_a_class_method_replaced_after_the_first_instance() -> None:
    Counter, Plain = _make(), _plain(None)
    model, ref = Counter(), Plain()
    model(1.0), ref(1.0)
    Counter.__call__ = forward10
    Plain.__call__ = forward10
    eager, n, f_out, f_n, j_out, j_n = _run_all(model, None, [1.0, 2.0])
    ref_out, ref_n = _plain_run(ref, None, [1.0, 2.0])
    assert f_out == j_out == eager == ref_out and f_n == j_n == n == ref_n == 21.0


def test_a_class_method_replaced_before_the_first_instance() -> None:
    Counter = _make()
    Counter.__call__ = forward10
    model = Counter()
    eager, n, f_out, f_n, j_out, j_n = _run_all(model, None, [1.0, 3.0])
    assert f_out == j_out == [2.0, 6.0] and f_n == j_n == 20.0
    assert eager == [2.0, 6.0] and n == 20.0


def test_one_instance_method_replaced_with_types_method_type() -> None:
    Counter = _make()
    model, other = Counter(), Counter()
    model.forward = types.MethodType(forward10, model)
    eager, n, f_out, f_n, j_out, j_n = _run_all(model, "forward", [1.0, 2.0])
    assert f_out == j_out == [2.0, 4.0] and f_n == j_n == 20.0
    assert eager == [2.0, 4.0] and n == 20.0
    assert float(other.n) == 0.0 and "forward" not in vars(other)
    # frozen: the method is bound to the frozen model, not the eager one
    f, states = model.functionalize()
    _, states = f.forward(states, 1.0)
    frozen = autostate.freeze(f, states)
    frozen.forward(1.0)
    assert float(frozen.n) == 40.0 and float(model.n) == 20.0


def test_a_closure_over_the_model_held_by_the_instance() -> None:
    Counter = _make()
    model = Counter()
    model.twice = lambda x: model(x) + model(x)
    eager, n, f_out, f_n, j_out, j_n = _run_all(model, "twice", [1.0])
    assert f_out == j_out == eager == [2.0] and f_n == j_n == n == 2.0


def test_a_plain_function_held_by_the_instance() -> None:
    Counter = _make()
    model = Counter()
    model.act = jnp.tanh
    f, states = model.functionalize()
    out, new = f.act(states, 0.5)
    np.testing.assert_allclose(out, np.tanh(0.5), rtol=1e-6)
    assert new == states
