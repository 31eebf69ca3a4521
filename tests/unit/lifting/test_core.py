"""lifting/core.py: binding cells, the steps of the lift, eager models' states."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import autostate
from autostate import graph
from autostate.effects import LocalStateEffectImpl
from autostate.errors import ControlFlowStateError
from autostate.lifetime import LostValue
from autostate.lifting import core


def cells(*values):
    return [LocalStateEffectImpl(v, name=f"s{i}") for i, v in enumerate(values)]


def test_a_binding_gives_the_chosen_cells_values_and_restores_every_cell():
    a, b = cells(1.0, 2.0)
    with core.bound_to([a, b], [b], [5.0], "a body"):
        assert (a.value, b.value) == (1.0, 5.0)
        a.value = 7.0
    assert (a.value, b.value) == (1.0, 2.0)


def test_a_body_that_raises_leaves_what_it_assigned_lost():
    a, b = cells(1.0, 2.0)
    with pytest.raises(ZeroDivisionError), core.bound_to([a, b], [], [], "a body"):
        a.value = 3.0
        raise ZeroDivisionError
    assert type(a.value) is LostValue and b.value == 2.0
    with pytest.raises(ControlFlowStateError, match="s0"):
        core.current_values([a])


def test_a_refusal_of_autostates_leaves_the_cells_as_before():
    (a,) = cells(1.0)
    with pytest.raises(ControlFlowStateError), core.bound_to([a], [], [], "a body"):
        a.value = 3.0
        raise ControlFlowStateError("refused")
    assert a.value == 1.0


def test_one_abstract_trace_finds_the_cells_a_body_assigns():
    a, b, c = cells(jnp.zeros(2), jnp.ones(2), [jnp.zeros(())])

    def body(x):
        b.value = b.value + x
        c.value.append(x.sum())  # a change in place is a write too
        return x

    written, new = core.writes_of([a, b, c], body, jnp.ones(2), what="a body")
    assert written == [1, 2]
    assert new[0].shape == (2,) and len(new[1]) == 2
    assert len(c.value) == 1  # (the probe changed a copy)


def test_a_threaded_state_keeps_its_type():
    (a,) = cells(jnp.zeros(2))
    core.check_kept([a], [jnp.ones(2)], "the body of a lax.scan")
    with pytest.raises(ControlFlowStateError, match=r"'s0' changes from float32\[2\] to int32\[2\]"):
        core.check_kept([a], [jnp.ones(2, jnp.int32)], "the body of a lax.scan")


def test_weak_types_are_told_from_strong_ones():
    assert core.weak_types(1.0) == (True,)
    assert core.weak_types(jnp.asarray(1.0)) == (True,)
    assert core.weak_types((jnp.ones(2), 2)) == (False, True)
    assert core.strengthened(jnp.asarray(1.0)).weak_type is False


def test_the_lift_threads_only_what_was_written():
    a, b = cells(jnp.zeros(()), jnp.zeros(()))
    assert core.lift([a, b], [], "a body", lambda *_: pytest.fail("placed"), lambda: "plain") == "plain"

    def place(pure_of, values):
        pure = pure_of(lambda: a.set(a.get() + 1.0))
        _, new = pure(values)
        return "out", new

    assert core.lift([a, b], [0], "a body", place) == "out"
    assert (float(a.value), float(b.value)) == (1.0, 0.0)


@autostate.stateful
class Counter:
    def __init__(self):
        self.n = jnp.zeros(())
        self.label = "counter"

    def bump(self):
        self.n = self.n + 1.0


def test_an_eager_models_states_are_handled_for_the_call_and_written_back():
    counter = Counter()
    seen = []

    def call():
        seen.append(type(counter.__dict__["n"]).__name__)
        counter.bump()
        return "done"

    assert core.with_eager_states((counter.bump,), call, "a body") == "done"
    assert seen == ["HandledLocalStateRef"]
    # (written back as an eager write: the slot holds its value itself again)
    assert float(counter.n) == 1.0
    assert type(counter.__dict__["n"]) in graph.OWN_VALUE_SLOTS


def test_jit_disabled_is_jaxs_switch():
    assert not core.jit_disabled()
    with jax.disable_jit():
        assert core.jit_disabled()


@autostate.stateful
class _Counter:
    def __init__(self):
        self.n = jnp.zeros(())

    def step(self):
        self.n = self.n + 1.0
        return self.n


def test_a_lax_call_returns_the_model_passed_in_where_every_body_returns_it():
    model = _Counter()
    assert autostate.cond(jnp.asarray(True), lambda m: m, lambda m: m, model) is model
    i, same = autostate.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1]), (0, model))
    assert same is model and int(i) == 2
    (same, total), _ = autostate.scan(
        lambda c, x: ((c[0], c[1] + c[0].step()), None), (model, 0.0), None, length=3
    )
    assert same is model and float(total) == 6.0 and float(model.n) == 3.0
    same.step()
    assert float(model.n) == 4.0


def test_a_model_the_body_builds_stays_the_copy_jax_returns():
    model = _Counter()
    model.step()
    built = autostate.cond(jnp.asarray(True), lambda m: _Counter(), lambda m: _Counter(), model)
    assert type(built) is _Counter and built is not model and float(built.n) == 0.0
    built = autostate.switch(0, [lambda m: _Counter()], model)  # (one branch, one trace)
    assert built is not model and float(built.n) == 0.0


@autostate.stateful
class _Settings:
    def __init__(self):
        self.scale = 2


def test_a_loop_returns_the_model_only_where_its_initial_carry_holds_it():
    # (Models with states at one place of a carry flatten alike only if they
    # are one model; these hold none.)
    model, other = _Settings(), _Settings()
    out = autostate.fori_loop(0, 2, lambda i, c: (c[1], c[1]), (model, other))
    # Plain Python's carry is (other, other) after a step; before it, the first
    # place holds ``model``, so JAX's copy stays there.
    assert out[1] is other and out[0] is not model and out[0] is not other
