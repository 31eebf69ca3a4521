"""lifting/loops.py: a loop's assigned states go into its carry, and only those;
what a rewritten loop iterates, and when it rolls."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import autostate
from autostate.errors import StackError
from autostate.lifting import loops
from tests.unit.lifting.placement import equation


@autostate.stateful
class Running:
    def __init__(self):
        self.total = jnp.zeros(())
        self.scale = jnp.full((), 2.0)  # read, never assigned: no carry
        self.steps = jnp.zeros((), jnp.int32)

    def scan(self, xs):
        def body(h, x):
            self.total = self.total + x * self.scale
            return h + x, h

        return lax.scan(body, 0.0, xs)

    def fori(self, n):
        def body(i, h):
            self.steps += 1
            return h + self.scale

        return lax.fori_loop(0, n, body, 0.0)

    def until(self, limit):
        def body(h):
            self.steps += 1
            return h + 1.0

        return lax.while_loop(lambda h: self.steps < limit, body, 0.0)


def carries(eqn: Any) -> int:
    """How many carries a scan equation threads: its ``num_carry`` (jax < 0.11);
    later jax keeps no count, so its outputs that are not stacked over the
    scan's length (this file's carries are scalars)."""
    if "num_carry" in eqn.params:
        return eqn.params["num_carry"]
    return sum(v.aval.shape[:1] != (eqn.params["length"],) for v in eqn.outvars)


def test_scan_threads_the_assigned_state_as_carry():
    model = Running()
    f, states = model.functionalize()
    xs = jnp.arange(3.0)
    eqn = equation(lambda s: f.scan(s, xs), states, primitive="scan")
    assert carries(eqn) == 2  # the user's h, and total
    (_, ys), new = f.scan(states, xs)
    assert float(new["total"]) == 6.0 and list(ys) == [0.0, 0.0, 1.0]
    assert new["steps"] is states["steps"]


def test_fori_and_while_thread_their_body_states():
    model = Running()
    assert float(model.fori(3)) == 6.0 and int(model.steps) == 3
    f, states = model.functionalize()
    eqn = equation(lambda s: f.until(s, 5), states, primitive="while")
    assert len(eqn.outvars) == 2  # the user's h, and steps
    out, new = jax.jit(f.until)(states, 5)
    assert float(out) == 2.0 and int(new["steps"]) == 5


def test_map_is_a_scan_of_its_function():
    model = Running()
    ys = autostate.map(lambda x: model.scan(x[None])[0], jnp.arange(3.0))
    assert list(ys) == [0.0, 1.0, 2.0] and float(model.total) == 6.0


@autostate.stateful
class Layer:
    def __init__(self, w):
        self.w = w

    def __call__(self, x):
        return x * self.w


def layers(n=3, **options):
    return autostate.stack([Layer(jnp.full(2, i + 1.0)) for i in range(n)], **options)


def test_outside_a_trace_a_loop_iterates_what_it_names() -> None:
    stack = layers()
    assert loops.over(stack) is stack
    pairs = loops.over(loops.Deferred(enumerate, (stack,), {"start": 1}))
    assert [i for i, _ in pairs] == [1, 2, 3]
    assert loops.unrolled([1, 2], "a `break`") == [1, 2]


def test_under_a_trace_a_stack_and_its_spellings_roll() -> None:
    stack = layers()

    def kind(source):
        return type(loops.over(source)).__name__

    def traced(x):
        found = {
            "stack": kind(stack),
            "enumerate": kind(loops.Deferred(enumerate, (stack,), {})),
            "zip arrays": kind(loops.Deferred(zip, (stack, x), {})),
            "zip list": kind(loops.Deferred(zip, (stack, [x[0], x[1], x[2]]), {})),
            "reversed": kind(loops.Deferred(reversed, (stack,), {})),
            # (the plain loop: no stack; zip stops at the shorter; reversed inside)
            "array": kind(x),
            "zip shorter": kind(loops.Deferred(zip, (stack, x[:2]), {})),
            "enumerate reversed": kind(loops.Deferred(enumerate, (loops.Deferred(reversed, (stack,), {}),), {})),
            "list of layers": kind([Layer(x[0])]),
        }
        assert found.pop("array") != "Rolling"  # (the tracer itself)
        assert found == {
            "stack": "Rolling", "enumerate": "Rolling", "zip arrays": "Rolling",
            "zip list": "Rolling", "reversed": "Rolling", "zip shorter": "zip",
            "enumerate reversed": "enumerate", "list of layers": "list",
        }, found
        return x

    jax.jit(traced)(jnp.ones((3, 2)))


def test_a_strict_stack_names_what_is_not_one_stack() -> None:
    stack = layers(require_scan=True)

    def traced(x):
        with pytest.raises(StackError, match="is not one stack"):
            loops.over(loops.Deferred(zip, (stack, x[:2]), {}))
        with pytest.raises(StackError, match="a `break` or `continue`"):
            loops.unrolled(stack, "a `break` or `continue` in its body")
        return x

    jax.jit(traced)(jnp.ones((3, 2)))


def test_deferred_calls_in_the_order_python_would() -> None:
    called = []

    def spy(name, value):
        called.append(name)
        return value

    deferred = loops.Deferred(lambda *a: spy("outer", list(a)), (loops.Deferred(lambda: spy("inner", 1), (), {}),), {})
    assert deferred.plain() == [1] and called == ["inner", "outer"]


def test_only_the_named_reasons_fall_back_to_the_plain_loop(caplog: pytest.LogCaptureFixture) -> None:
    # Each reason of FALLBACKS makes ``run`` give None (the plain loop runs),
    # logged with its name; after the body's own error the plain loop runs too
    # (it raises the error where plain Python does), and raises it at its end
    # if it did not.
    stack = layers()
    assert set(loops.FALLBACKS) == {
        "python-value", "carry-changes", "concrete-value", "state-structure", "outside-states",
    }

    def run(body, value):
        return loops.over(stack).run(lambda item, values: (body(item, values[0]),), (value,), ("v",), (True,), False)

    def traced(x):
        assert run(lambda b, v: v * int(v.sum()), x) is None  # concrete-value (JAX's error)
        assert run(lambda b, v: v * {0: 1.0}[v.sum()], x) is None  # concrete-value (Python's)
        assert run(lambda b, v: jnp.concatenate([v, v]), x) is None  # carry-changes
        assert run(lambda b, v: v + b.w.sum(), 0) is not None  # a number becoming an array: carried
        assert run(lambda b, v: v + 1, 0) is None  # python-value
        rolling = loops.over(stack)
        assert rolling.run(lambda b, values: (1 / 0,), (x,), ("v",), (True,), False) is None
        with pytest.raises(ZeroDivisionError):
            list(rolling.plain())  # (the plain loop here runs no body: raised at its end)
        out, last = run(lambda b, v: b(v), x)
        return out[0]

    with caplog.at_level("DEBUG", logger="autostate.lifting.loops"):
        assert jnp.allclose(jax.jit(traced)(jnp.ones(2)), 6.0)
    found = [r.getMessage().rpartition("[")[2].rstrip("]") for r in caplog.records]
    assert found == ["concrete-value", "concrete-value", "carry-changes", "python-value"]
