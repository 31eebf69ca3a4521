"""loops.py: what a rewritten loop iterates, and when it rolls."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import autostate
from autostate import loops
from autostate.errors import StackError


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
    # logged with its name; the body's own error reaches the caller as raised.
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
        with pytest.raises(ZeroDivisionError):
            run(lambda b, v: 1 / 0, x)
        out, last = run(lambda b, v: b(v), x)
        return out[0]

    with caplog.at_level("DEBUG", logger="autostate.loops"):
        assert jnp.allclose(jax.jit(traced)(jnp.ones(2)), 6.0)
    found = [r.getMessage().rpartition("[")[2].rstrip("]") for r in caplog.records]
    assert found == ["concrete-value", "concrete-value", "carry-changes", "python-value"]
