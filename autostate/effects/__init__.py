"""The local-state effect engine (DESIGN.md section 2); no libcst here."""

from __future__ import annotations

from autostate.effects.local_state import (
    REQUEST_TYPES,
    FrozenLocalStateRequest,
    HandledLocalStateRef,
    InitialLocalStateRequest,
    InitialValue,
    LocalStateEffect,
    LocalStateEffectImpl,
    SharedLocalStateRequest,
    StateSlot,
    WithFunctionalLocalState,
    contains_tracer,
    embed_shared_state_requests,
    freeze_body,
    freeze_local_states,
    fresh_handler_id,
    handle_local_states,
    hoist_shared_state_requests,
    rename_local_states,
    run_with_states,
)

__all__ = [
    "REQUEST_TYPES",
    "FrozenLocalStateRequest",
    "HandledLocalStateRef",
    "InitialLocalStateRequest",
    "InitialValue",
    "LocalStateEffect",
    "LocalStateEffectImpl",
    "SharedLocalStateRequest",
    "StateSlot",
    "WithFunctionalLocalState",
    "contains_tracer",
    "embed_shared_state_requests",
    "freeze_body",
    "freeze_local_states",
    "fresh_handler_id",
    "handle_local_states",
    "hoist_shared_state_requests",
    "rename_local_states",
    "run_with_states",
]
