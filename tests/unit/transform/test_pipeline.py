"""The decision pipeline of ``autostate/transform/pipeline.py``, through ``@stateful``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import autostate
from autostate import tree
from autostate.transform.pipeline import ClassDecision


@autostate.stateful
class Counter:
    def __init__(self):
        self.n = jnp.zeros(())

    def __call__(self, x):
        self.n += 1.0
        return x * self.n


class Bumping(Counter):
    def bump(self):
        self.n += 10.0
        return self.n


def test_redecorating_a_subclass_with_other_options_rewrites_the_originals():
    # Bumping was decorated by Counter's subclass hook; decorating it again with
    # another category must start from the user's bump, not the rewritten one.
    auto = tree.class_info(Bumping)
    assert auto.category == "state"
    again = autostate.stateful(category="other")(Bumping)
    assert again is Bumping
    info = tree.class_info(Bumping)
    assert (info.category, info.state) == ("other", frozenset({"n"}))
    assert info.decision.originals["bump"] is auto.decision.originals["bump"]

    model = Bumping()
    assert float(model.bump()) == 10.0 and float(model(2.0)) == 22.0
    f, states = model.functionalize("other")
    assert list(states) == ["n"]
    out, states = jax.jit(lambda f, s: f.bump(s))(f, states)
    assert (float(out), float(states["n"])) == (21.0, 21.0)
    # Decorating again with the same options changes nothing.
    assert autostate.stateful(category="other")(Bumping) is Bumping
    assert tree.class_info(Bumping) is info


@autostate.stateful
class Scaled:
    def __init__(self, temperature):
        self.temperature = jnp.asarray(temperature)
        self.w = jnp.ones(2)

    def __call__(self, x):
        return x * self.w / self.temperature


class Annealed(Scaled):
    def __call__(self, x):
        self.temperature *= 0.5
        return super().__call__(x)


def test_a_subclass_may_make_a_parameter_of_its_base_state():
    base_f, base_states = Scaled(2.0).functionalize()
    assert base_states == {} and len(jax.tree.leaves(base_f)) == 2

    model = Annealed(2.0)
    np.testing.assert_allclose(model(jnp.ones(2)), [1.0, 1.0])
    assert float(model.temperature) == 1.0
    f, states = Annealed(2.0).functionalize()
    assert list(states) == ["temperature"] and len(jax.tree.leaves(f)) == 1
    out, states = jax.jit(lambda f, s, x: f(s, x))(f, states, jnp.ones(2))
    np.testing.assert_allclose(out, [1.0, 1.0])
    assert float(states["temperature"]) == 1.0
    _, states = f(states, jnp.ones(2))
    assert float(states["temperature"]) == 0.5


def test_the_decision_holds_what_later_decorations_need():
    decision = tree.class_info(Annealed).decision
    assert isinstance(decision, ClassDecision)
    assert decision.state == {"temperature"}
    assert {"temperature", "w"} <= decision.initialized
    # The original function, as written, and the rewritten code of the same method.
    assert decision.originals["__call__"] is not Annealed.__call__
    assert decision.codes["__call__"] is Annealed.__call__.__code__
    assert "__autostate__" not in decision.originals["__call__"].__code__.co_freevars
