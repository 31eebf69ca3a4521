"""A traced value written to a parameter (an attribute that is not a state)
of an eager model made outside the running trace is refused, as a state
write is, instead of staying in the model as a tracer.

The roads: a closure under ``jax.jit`` (also around ``grad`` / ``vmap``), and
``f`` of another model under ``jit`` (an optimizer written PyTorch's way). A
model built inside the trace, or passed to the transformation as an
argument (its copy holds the trace's values), may take the trace's values.

What tells the model is older than the trace is the concrete array it held:
under ``jax.jit`` an array made inside is a tracer. Under ``grad`` or
``vmap`` alone an array made inside may be concrete too, so there a write of
this kind is not told apart (a state write is: its slot knows its trace).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import autostate
from autostate.errors import TracedEagerStateError


@autostate.stateful
class Linear:
    def __init__(self):
        self.w = jnp.ones(2)  # a parameter: no method assigns it

    def __call__(self, x):
        return x * self.w


@autostate.stateful
class Trainer:
    def __init__(self):
        self.steps = jnp.zeros((), jnp.int32)

    def step(self, model, g):
        model.w = model.w - 0.1 * g
        self.steps += 1
        return self.steps


def _sgd(model, g):
    model.w = model.w - 0.1 * g
    return model.w.sum()


ROADS = {
    "jit closure": lambda m: jax.jit(lambda g: _sgd(m, g))(jnp.ones(2)),
    "jit of grad": lambda m: jax.jit(jax.grad(lambda g: _sgd(m, g) * 1.0))(jnp.ones(2)),
    "jit of vmap": lambda m: jax.jit(jax.vmap(lambda g: _sgd(m, g)))(jnp.ones((3, 2))),
    "f of another model under jit": lambda m: jax.jit(
        lambda f, s, g: f.step(s, m, g)
    )(*Trainer().functionalize(), jnp.ones(2)),
}


@pytest.mark.parametrize("road", sorted(ROADS))
def test_a_traced_write_to_a_parameter_of_an_outside_model_is_refused(road: str) -> None:
    model = Linear()
    with pytest.raises(TracedEagerStateError, match="held a concrete array") as info:
        ROADS[road](model)
    assert "test_parameter_tracer_leaks.py" in str(info.value)  # the user's line
    assert "fix:" in str(info.value)
    assert type(model.w) is type(jnp.ones(2))  # no tracer left
    assert float(model(jnp.ones(2)).sum()) == 2.0


def test_a_model_built_inside_the_trace_takes_its_values() -> None:
    def inside(g):
        m = Linear()
        return _sgd(m, g)

    assert float(jax.jit(inside)(jnp.ones(2))) == pytest.approx(1.8)
    assert float(jax.grad(inside)(jnp.ones(2)).sum()) == pytest.approx(-0.2)


def test_a_model_passed_to_the_transformation_takes_its_values() -> None:
    model = Linear()
    out, new = jax.jit(lambda m, g: (_sgd(m, g), m))(model, jnp.ones(2))
    assert float(out) == pytest.approx(1.8)
    assert float(new.w[0]) == pytest.approx(0.9)
    assert float(model.w[0]) == 1.0  # the eager model keeps its own


def test_eager_writes_are_plain_python() -> None:
    model = Linear()
    assert float(_sgd(model, jnp.ones(2))) == pytest.approx(1.8)
    f, states = Trainer().functionalize()
    f.step(states, model, jnp.ones(2))  # an eager call of f: as plain Python
    assert float(model.w[0]) == pytest.approx(0.8)
