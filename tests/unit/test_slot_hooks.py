"""``autostate.slot_hooks``: the questions the engine asks, answered by their owners.

The defaults are penzai's (nothing tracked, nothing refused); importing
``autostate`` registers the runtime's answers; a hook name the engine does not
ask is refused.
"""

from __future__ import annotations

import pytest

import autostate
from autostate import guard, lifetime, state_values, unsortable
from autostate.errors import InvalidArgumentError, UnhandledLocalStateError
from autostate.slot_hooks import SlotHooks, hooks, register_slot_hooks


def test_the_defaults_are_penzais():
    defaults = SlotHooks()
    value = {"a": 1}
    assert defaults.current_trace() is None
    request = autostate.FrozenLocalStateRequest(1.0, "state")
    with pytest.raises(UnhandledLocalStateError):
        defaults.eager_write(request, value, "a")
    assert defaults.lives_in(request, None) is request
    assert defaults.split_statics(value) is None
    assert defaults.own_value(value) is value
    assert defaults.states_dict(value) is value
    assert defaults.join_statics(value, None) is value
    assert defaults.states_flatten_error(value, "states", ValueError(), {}) is None


def test_the_default_unhandled_error_names_the_state_and_its_handler():
    ref = autostate.HandledLocalStateRef("h", "count", True, "state")
    error = SlotHooks().unhandled_ref_error(ref, "not running")
    assert type(error) is UnhandledLocalStateError
    assert "'count'" in str(error) and "'h'" in str(error)


def test_importing_autostate_registers_each_owners_answers():
    assert hooks.current_trace is lifetime.current_trace
    assert hooks.eager_write is lifetime.written_slot
    assert hooks.own_value is state_values._own_value
    assert hooks.value_flatten_error is unsortable.unsortable_keys_error
    assert hooks.unguard_call == guard._GUARDED.reset


def test_a_hook_the_engine_does_not_ask_is_refused():
    with pytest.raises(InvalidArgumentError, match="no slot hook named 'check_writes'"):
        register_slot_hooks(check_writes=lambda value, label, home: None)
