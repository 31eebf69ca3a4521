"""``autostate.slot_hooks``: the questions the engine asks, answered by their owners.

The defaults are penzai's (nothing tracked, nothing refused); importing
``autostate`` registers the runtime's answers; a hook name the engine does not
ask is refused. What can be an argument or a method is one, and asks no hook.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import autostate
from autostate import guard, lifetime, state_values, unsortable
from autostate.effects import local_state
from autostate.errors import InvalidArgumentError, UnhandledLocalStateError
from autostate.slot_hooks import SlotHooks, hooks, register_slot_hooks


def test_the_defaults_are_penzais():
    defaults = SlotHooks()
    value = {"a": 1}
    request = autostate.FrozenLocalStateRequest(1.0, "state")
    with pytest.raises(UnhandledLocalStateError):
        defaults.eager_write(request, value, "a")
    assert defaults.made_here([request]) is None and request._home is None
    assert defaults.check_read("a", value, None) is None
    assert defaults.check_handled_write(object(), None, None, 1) is None
    assert defaults.cells_elsewhere(None) is None
    defaults.call_started("h", {})()  # nothing recorded, nothing to end
    assert defaults.states_dict(value) is value
    assert defaults.states_flatten_error(value, "states", ValueError(), {}) is None


def test_importing_autostate_registers_each_owners_answers():
    assert hooks.eager_write is lifetime.written_slot
    assert hooks.made_here is lifetime.made_here
    assert hooks.states_dict is state_values.states_dict
    assert hooks.states_flatten_error.__module__ == unsortable.__name__


def test_eight_questions_are_left():
    # Each is reached from penzai's front door or through the slot protocol on
    # a slot type the engine defines: no caller of the runtime's can pass it.
    assert SlotHooks.__slots__ == (
        "eager_write",
        "made_here",
        "check_read",
        "check_handled_write",
        "call_started",
        "cells_elsewhere",
        "states_dict",
        "states_flatten_error",
    )


def test_a_hook_the_engine_does_not_ask_is_refused():
    with pytest.raises(InvalidArgumentError, match="no slot hook named 'guard_call'"):
        register_slot_hooks(guard_call=lambda ids: None)


def test_the_guard_asks_the_engine_which_instances_run_in_a_body():
    body = {"x": 1}
    seen = []

    def call(x):
        seen.append(guard.is_guarded(body))
        return x

    local_state.run_with_states("h", {}, call, (1.0,), {}, frozenset({id(body)}))
    local_state.run_with_states("h", {}, call, (1.0,), {})
    assert seen == [True, False]
    assert not local_state.in_running_body(body)


def test_a_model_frozen_inside_a_trace_lives_there():
    @jax.jit
    def step(x):
        handler, states = autostate.handle_local_states(
            [autostate.FrozenLocalStateRequest(x, "c")], category="c"
        )
        frozen = autostate.freeze_local_states(handler, states)
        assert lifetime.home_of(frozen[0]) is lifetime.current_trace() is not None
        return frozen[0].state

    assert step(jnp.ones(())) == 1.0
