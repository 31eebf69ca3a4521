"""autostate: plain Python classes that mutate ``self``, as pure JAX functions."""

from __future__ import annotations

from autostate.api import FunctionalModel, freeze, functionalize, state, stateful
from autostate.control import checkpoint, cond, fori_loop, map, remat, scan, switch, while_loop
from autostate.effects import (
    FrozenLocalStateRequest,
    HandledLocalStateRef,
    InitialLocalStateRequest,
    LocalStateEffect,
    LocalStateEffectImpl,
    SharedLocalStateRequest,
    WithFunctionalLocalState,
    embed_shared_state_requests,
    freeze_local_states,
    handle_local_states,
    hoist_shared_state_requests,
)
from autostate.errors import AutostateError
from autostate.export import (
    export,
    load,
    load_arrays,
    load_param_dict,
    load_state_dict,
    param_dict,
    save,
    state_dict,
)
from autostate.host import inference_mode

__version__ = "0.1.0"

__all__ = [
    "AutostateError",
    "checkpoint",
    "cond",
    "fori_loop",
    "map",
    "remat",
    "scan",
    "switch",
    "while_loop",
    "FunctionalModel",
    "freeze",
    "functionalize",
    "inference_mode",
    "state",
    "stateful",
    "FrozenLocalStateRequest",
    "HandledLocalStateRef",
    "InitialLocalStateRequest",
    "LocalStateEffect",
    "LocalStateEffectImpl",
    "SharedLocalStateRequest",
    "WithFunctionalLocalState",
    "embed_shared_state_requests",
    "freeze_local_states",
    "handle_local_states",
    "hoist_shared_state_requests",
    "export",
    "load",
    "load_arrays",
    "load_param_dict",
    "load_state_dict",
    "param_dict",
    "save",
    "state_dict",
]
