"""The local-state effect engine (DESIGN.md section 2); no libcst here.

What this package exports is the engine's own surface: penzai v1's requests
and references, handling, freezing, hoisting, embedding and renaming, the
handler ids and the slot protocol. The helpers the rest of autostate uses
(the running calls and their cells) are internal: import them from
``autostate.effects.local_state``. What the engine asks but does not decide
(``autostate.slot_hooks``) lives with its owner: static states in
``autostate.state_values``, tracer lifetime, initial values and eager
writes in ``autostate.lifetime``; the guard asks the engine which instances
run in a body (``in_running_body``).
"""

from __future__ import annotations

from autostate.effects.local_state import (
    REQUEST_TYPES,
    FrozenLocalStateRequest,
    HandledLocalStateRef,
    HandlerId,
    InitialLocalStateRequest,
    LocalStateEffect,
    LocalStateEffectImpl,
    SharedLocalStateRequest,
    StateSlot,
    WithFunctionalLocalState,
    embed_shared_state_requests,
    freeze_body,
    freeze_local_states,
    fresh_handler_id,
    handle_local_states,
    handler_running,
    hoist_shared_state_requests,
    is_running,
    rename_local_states,
    run_with_states,
)

__all__ = [
    "REQUEST_TYPES",
    "FrozenLocalStateRequest",
    "HandledLocalStateRef",
    "HandlerId",
    "InitialLocalStateRequest",
    "LocalStateEffect",
    "LocalStateEffectImpl",
    "SharedLocalStateRequest",
    "StateSlot",
    "WithFunctionalLocalState",
    "embed_shared_state_requests",
    "freeze_body",
    "freeze_local_states",
    "fresh_handler_id",
    "handle_local_states",
    "hoist_shared_state_requests",
    "handler_running",
    "is_running",
    "rename_local_states",
    "run_with_states",
]
