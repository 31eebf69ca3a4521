"""autostate: plain Python classes that mutate ``self``, as pure JAX functions."""

from __future__ import annotations

from importlib import metadata as _metadata

from autostate.api import (
    Stateful,
    constant,
    freeze,
    functionalize,
    inference_mode,
    state,
    stateful,
)
from autostate.compiled import Compiled, jit
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
    rename_local_states,
)
from autostate.errors import AutostateError
from autostate.export import export
from autostate.functional import FunctionalModel
from autostate.lifting import (
    checkpoint,
    cond,
    fori_loop,
    map,
    remat,
    scan,
    switch,
    vmap,
    while_loop,
)
from autostate.packing import PackedModel, PackedStates, pack
from autostate.serialization import load, load_arrays, save
from autostate.sharding import partition_specs, sharded, shardings
from autostate.stacks import Stack, stack
from autostate.state_dicts import load_param_dict, load_state_dict, param_dict, state_dict
from autostate.state_values import States
from autostate.summary import summary
from autostate.training import Optimizer, grad, value_and_grad

try:  # The version is written once, in pyproject.toml; installing records it.
    __version__ = _metadata.version("autostate")
except _metadata.PackageNotFoundError:  # (a source tree on sys.path, never installed)
    __version__ = "0+unknown"


def __getattr__(name: str) -> object:
    # ``autostate.nn`` (the layers) is imported on first use: its forty
    # classes would otherwise be decorated by every ``import autostate``.
    if name == "nn":
        import importlib

        return importlib.import_module("autostate.nn")
    raise AttributeError(f"module 'autostate' has no attribute {name!r}")


__all__ = [
    "AutostateError",
    "Compiled",
    "jit",
    "Optimizer",
    "grad",
    "value_and_grad",
    "checkpoint",
    "cond",
    "fori_loop",
    "map",
    "remat",
    "scan",
    "switch",
    "vmap",
    "while_loop",
    "FunctionalModel",
    "Stateful",
    "constant",
    "freeze",
    "functionalize",
    "inference_mode",
    "pack",
    "PackedModel",
    "PackedStates",
    "States",
    "state",
    "stateful",
    "nn",
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
    "rename_local_states",
    "export",
    "load",
    "load_arrays",
    "load_param_dict",
    "load_state_dict",
    "param_dict",
    "save",
    "state_dict",
    "summary",
    "partition_specs",
    "sharded",
    "shardings",
    "Stack",
    "stack",
]
