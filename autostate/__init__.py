"""autostate: plain Python classes that mutate ``self``, as pure JAX functions."""

from __future__ import annotations

from typing import TYPE_CHECKING

from autostate.api import (
    Stateful,
    constant,
    freeze,
    functionalize,
    inference_mode,
    state,
    stateful,
)
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
from autostate.sharding import partition_specs, sharded, shardings
from autostate.state_values import States
from autostate.summary import summary
from autostate.training import grad, value_and_grad

if TYPE_CHECKING:
    from autostate.compiled import Compiled, jit
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
    from autostate.optimizers import Optimizer
    from autostate.packing import PackedModel, PackedStates, pack
    from autostate.serialization import load, load_arrays, save
    from autostate.stacks import Stack, stack
    from autostate.state_dicts import load_param_dict, load_state_dict, param_dict, state_dict

    __version__: str

# What a call needs, imported by its first use rather than by every ``import
# autostate``: the layers (forty classes to decorate), the optimizer (a class
# to decorate), compiled calls, the lift's families (scan, cond, vmap, ...),
# packed calls, stacks, state dicts and saving to files.
# (A module whose name is also a public function's, ``summary``, ``export``,
# stays above: importing the module would set the package's attribute. Each
# imports what its call needs in the call.)
_ON_FIRST_USE = {
    "nn": ("autostate.nn", None),
    "optimizers": ("autostate.optimizers", None),
    "Optimizer": ("autostate.optimizers", "Optimizer"),
    "compiled": ("autostate.compiled", None),
    "Compiled": ("autostate.compiled", "Compiled"),
    "jit": ("autostate.compiled", "jit"),
    "lifting": ("autostate.lifting", None),
    "checkpoint": ("autostate.lifting", "checkpoint"),
    "cond": ("autostate.lifting", "cond"),
    "fori_loop": ("autostate.lifting", "fori_loop"),
    "map": ("autostate.lifting", "map"),
    "remat": ("autostate.lifting", "remat"),
    "scan": ("autostate.lifting", "scan"),
    "switch": ("autostate.lifting", "switch"),
    "vmap": ("autostate.lifting", "vmap"),
    "while_loop": ("autostate.lifting", "while_loop"),
    "packing": ("autostate.packing", None),
    "PackedModel": ("autostate.packing", "PackedModel"),
    "PackedStates": ("autostate.packing", "PackedStates"),
    "pack": ("autostate.packing", "pack"),
    "stacks": ("autostate.stacks", None),
    "Stack": ("autostate.stacks", "Stack"),
    "stack": ("autostate.stacks", "stack"),
    "state_dicts": ("autostate.state_dicts", None),
    "load_param_dict": ("autostate.state_dicts", "load_param_dict"),
    "load_state_dict": ("autostate.state_dicts", "load_state_dict"),
    "param_dict": ("autostate.state_dicts", "param_dict"),
    "state_dict": ("autostate.state_dicts", "state_dict"),
    "serialization": ("autostate.serialization", None),
    "load": ("autostate.serialization", "load"),
    "load_arrays": ("autostate.serialization", "load_arrays"),
    "save": ("autostate.serialization", "save"),
    "copies": ("autostate.copies", None),
    "render": ("autostate.render", None),
}


def __getattr__(name: str) -> object:
    if name in _ON_FIRST_USE:
        import importlib

        module_name, attribute = _ON_FIRST_USE[name]
        module = importlib.import_module(module_name)
        value = module if attribute is None else getattr(module, attribute)
        globals()[name] = value
        return value
    if name == "__version__":
        from importlib import metadata

        try:  # The version is written once, in pyproject.toml; installing records it.
            version = metadata.version("autostate")
        except metadata.PackageNotFoundError:  # (a source tree on sys.path, never installed)
            version = "0+unknown"
        globals()["__version__"] = version
        return version
    raise AttributeError(f"module 'autostate' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_ON_FIRST_USE, "__version__"})


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
