"""``autostate/lifetime.py``: which JAX values a model may keep, and for how long."""

from __future__ import annotations

import collections
import pickle

import jax
import jax.numpy as jnp
import pytest

import autostate
from autostate import lifetime
from autostate.effects.local_state import (
    FrozenLocalStateRequest,
    InitialLocalStateRequest,
    running_calls,
)
from autostate.errors import (
    ControlFlowStateError,
    EscapedStateError,
    TracedEagerStateError,
)
from autostate.state_values import StaticState


@autostate.stateful
class Counter:
    def __init__(self, start=None):
        self.n = jnp.zeros(()) if start is None else start
        self.k = jnp.ones(())

    def __call__(self, x):
        self.n = self.n + x
        return self.n


def _leaked_tracer():
    kept = []

    @jax.jit
    def f(x):
        kept.append(x)
        return x

    f(jnp.ones(()))
    return kept[0]


def test_current_trace_is_none_eagerly_and_the_running_trace_inside_one():
    assert lifetime.current_trace() is None
    seen = []
    jax.jit(lambda x: seen.append(lifetime.current_trace()) or x)(1.0)
    assert seen[0] is not None


def test_only_a_trace_that_stages_a_program_is_staging():
    seen = {}

    def probe(name):
        def f(x):
            seen[name] = lifetime.under_staging_trace()
            return x * 1.0
        return f

    probe("eager")(1.0)
    jax.jit(probe("jit"))(1.0)
    jax.vmap(probe("vmap"))(jnp.ones(2))
    jax.grad(probe("grad"))(1.0)
    jax.jit(jax.vmap(probe("vmap in jit")))(jnp.ones(2))
    jax.lax.fori_loop(0, 1, lambda i, x: probe("lax body")(x), 1.0)
    assert seen == {
        "eager": False, "jit": True, "vmap": False, "grad": False,
        "vmap in jit": True, "lax body": True,
    }


def test_a_tracer_of_a_finished_trace_is_escaped_a_live_one_is_not():
    leaked = _leaked_tracer()
    assert lifetime.is_escaped_tracer(leaked)
    assert lifetime.holds_escaped_tracer({"a": [1.0, leaked]})
    assert not lifetime.is_escaped_tracer(jnp.ones(()))
    assert not lifetime.holds_escaped_tracer({"a": jnp.ones(()), "b": 2})
    live = []
    jax.jit(lambda x: live.append(lifetime.is_escaped_tracer(x)) or x)(1.0)
    assert live == [False]


def test_contains_tracer_sees_tracers_inside_containers_jax_takes_as_one_leaf():
    assert not lifetime.contains_tracer(jnp.ones(2))
    assert not lifetime.contains_tracer({"a": [1.0, "s"], "b": collections.deque([jnp.ones(1)])})
    assert not lifetime.contains_tracer(iter([1]))  # (an iterator is a leaf)
    found = []

    def f(x):
        found.append(lifetime.contains_tracer({"a": [x]}))
        found.append(lifetime.contains_tracer(collections.deque([x])))
        found.append(lifetime.contains_tracer_in_opaque(collections.deque([1.0, x])))
        return x

    jax.jit(f)(1.0)
    assert found == [True, True, True]


def test_a_tracer_stored_in_an_eager_model_is_refused_and_the_model_kept():
    model = Counter()

    def leak(x):
        model.n = x
        return x

    with pytest.raises(TracedEagerStateError, match="State 'n' was assigned a JAX tracer"):
        jax.jit(leak)(jnp.ones(()))
    assert float(model.n) == 0.0


def test_check_not_traced_accepts_the_tracers_of_the_models_home_and_around_it():
    outcomes = []

    def inner(x):
        home = lifetime.current_trace()
        assert lifetime.check_not_traced(x, "s", home) is None

        def deeper(y):
            # A value of the trace the home runs inside lives as long as the model.
            assert lifetime.check_not_traced(x, "s", lifetime.current_trace()) is None
            with pytest.raises(TracedEagerStateError, match="applied to the model inside"):
                lifetime.check_not_traced(y, "s", home)  # (an inner transformation's)
            outcomes.append("checked")
            return y

        jax.vmap(deeper)(jnp.ones(2))
        return x

    jax.jit(inner)(1.0)
    assert outcomes == ["checked"]
    assert lifetime.check_not_traced(jnp.ones(()), "s") is None


def test_a_lax_loop_in_a_plain_function_inside_a_compiled_call_names_autostate_scan():
    # The plain function's jax.lax.scan is no transformation autostate lifts: the error
    # says which one does.
    def step(model, xs):
        return jax.lax.scan(lambda c, x: (c + model(x), None), 0.0, xs)[0]

    model = Counter()
    with pytest.raises(TracedEagerStateError, match="applied to the model inside") as err:
        autostate.jit(step)(model, jnp.ones(3))
    assert "autostate.scan" in str(err.value).split("fix:", 1)[1]
    assert float(model.n) == 0.0


def test_a_parameter_given_a_lax_branchs_value_inside_a_compiled_call_is_refused():
    # An optimizer step skipped on overflow by a plain jax.lax.cond: the parameter
    # would keep a tracer of the branch (JAX's UnexpectedTracerError at the next use).
    def step(model, x):
        jax.lax.cond(x > 0, lambda: setattr(model, "k", model.k * x), lambda: None)
        return x

    model = Counter()
    with pytest.raises(TracedEagerStateError, match="'Counter.k' was assigned a value of a"):
        autostate.jit(step)(model, jnp.ones(()))
    assert float(model.k) == 1.0
    autostate.jit(lambda m, x: setattr(m, "k", m.k * x))(model, 2 * jnp.ones(()))
    assert float(model.k) == 2.0  # (a value of the compiled call's own trace lands)


def test_a_model_built_inside_a_trace_keeps_that_traces_values():
    def build_and_call(x):
        model = Counter(start=x)
        return model(x)

    assert float(jax.jit(build_and_call)(2.0)) == 4.0
    seen = []

    def initial(x):
        seen.append(lifetime.check_initial_value({"v": x}, "v"))
        return x

    jax.jit(initial)(1.0)
    assert seen == [None]
    with pytest.raises(TracedEagerStateError):
        lifetime.check_initial_value(_leaked_tracer(), "v")


def test_initial_slot_is_static_for_structure_and_a_request_for_values():
    static = lifetime.initial_slot(True, "state", "training", None)
    assert static == StaticState(True, "state", "training")
    assert lifetime.home_of(static) is None
    request = lifetime.initial_slot(jnp.ones(2), "state", None, "w")
    assert type(request) is InitialLocalStateRequest
    init = request.state_initializer
    assert type(init) is lifetime.InitialValue and init() is init.value and init.home is None
    assert repr(init).startswith("InitialValue(")
    homes = []

    def inside(x):
        homes.append((lifetime.initial_slot(x, "state", None, "w").state_initializer.home,
                      lifetime.current_trace()))
        return x

    jax.jit(inside)(1.0)
    assert homes[0][0] is homes[0][1] is not None


def test_an_initial_value_pickles_without_its_home():
    init = lifetime.InitialValue([1, 2], home="some trace")
    back = pickle.loads(pickle.dumps(init))
    assert back.value == [1, 2] and back.home is None and back() == [1, 2]
    assert init != lifetime.InitialValue([1, 2])  # (compared by identity)
    for falsy in (None, 0, ()):  # (a state declared None: nn.LSTM's carried h)
        back = pickle.loads(pickle.dumps(lifetime.InitialValue(falsy, home="some trace")))
        assert back() == falsy and back.home is None


def test_written_slot_takes_its_kind_from_the_value_where_the_state_was_a_placeholder():
    frozen = FrozenLocalStateRequest(jnp.zeros(()), "state", "n")
    new = lifetime.written_slot(frozen, jnp.ones(()), None)
    assert type(new) is FrozenLocalStateRequest and float(new.state) == 1.0
    assert float(frozen.state) == 0.0  # (never changed where anyone could see it)
    placeholder = FrozenLocalStateRequest(None, "state", "h")
    assert lifetime.written_slot(placeholder, 3, None) == StaticState(3, "state", "h")
    static = StaticState(True, "state", "training")
    assert lifetime.written_slot(static, False, None) == StaticState(False, "state", "training")
    array = lifetime.written_slot(static, jnp.ones(2), None)
    assert type(array) is FrozenLocalStateRequest and array.state.shape == (2,)
    initial = lifetime.initial_slot(jnp.zeros(()), "state", "n", None)
    counted = lifetime.written_slot(initial, 0, None)  # (an array state given a number stays one)
    assert type(counted) is FrozenLocalStateRequest and counted.state == 0


def test_with_home_sets_where_a_slot_lives():
    slot = FrozenLocalStateRequest(1.0, "state")
    assert lifetime.home_of(slot) is None
    assert lifetime.with_home(slot, None) is slot and lifetime.home_of(slot) is None
    assert lifetime.home_of(lifetime.with_home(slot, "trace")) == "trace"


def test_a_lost_value_raises_where_it_is_read_naming_what_raised():
    lost = lifetime.LostValue("mean", "a lax.scan body", ValueError("bad"), "model.py:3")
    error = lost.error()
    assert type(error) is ControlFlowStateError
    assert "'mean' has no value" in str(error) and "ValueError" in str(error)
    assert "model.py:3" in str(error)
    with pytest.raises(ControlFlowStateError, match="'mean' has no value"):
        lifetime._check_read("mean", lost, None)
    with pytest.raises(EscapedStateError):
        lifetime._check_read("mean", _leaked_tracer(), None)
    lifetime._check_read("mean", jnp.ones(()), None)  # (a plain value is read as it is)


def test_recording_state_reads_collects_the_handled_states_read_in_nested_blocks():
    f, states = Counter().functionalize()
    with lifetime.recording_state_reads() as outer:
        with lifetime.recording_state_reads() as inner:
            f(states, 1.0)
        assert inner == ["n", "n"]  # (``self.n + x``, then ``return self.n``)
        f(states, 1.0)
    assert outer == ["n"] * 4
    f(states, 1.0)  # (nothing records outside the blocks)
    assert outer == ["n"] * 4


def test_the_calls_running_are_tracked_and_forgotten_when_they_end():
    seen = []

    @autostate.stateful
    class Probe:
        def __init__(self):
            self.n = jnp.zeros(())

        def __call__(self, x):
            seen.append((len(lifetime._CALLS), lifetime.trace_of_call(next(running_calls()))))
            self.n = self.n + x
            return self.n

    before = len(lifetime._CALLS)
    f, states = Probe().functionalize()
    f(states, 1.0)
    assert seen == [(before + 1, None)]
    assert len(lifetime._CALLS) == before
    traces = []
    jax.jit(lambda s, x: traces.append(lifetime.current_trace()) or f(s, x))(states, 1.0)
    assert seen[-1][1] is traces[0] is not None  # the trace the call started in
