"""The lift: state read and assigned inside JAX functions called in a method.

``@stateful`` routes every call in a method that resolves to ``jax.lax.scan``,
``cond``, ``switch``, ``while_loop``, ``fori_loop``, ``map``,
``jax.checkpoint`` / ``jax.remat``, a derivative (``jax.grad``,
``value_and_grad``, ``jacfwd``, ``jacrev``, ``jacobian``, ``hessian``,
``jvp``, ``vjp``, ``linearize``), ``jax.vmap``, ``jax.jit``,
``jax.shard_map``, ``jax.custom_vjp`` or ``jax.custom_jvp`` to the function
of the same name here (``routes``: the one table of them); the lax
functions, ``checkpoint`` and ``vmap`` are also public as ``autostate.scan``
and friends for code the decorator never saw.

Every one of them is the same lifting (``core``):

1. find the live states (the cells of the running handlers) the function
   assigns: one abstract trace (``core.probed``, so only those are threaded
   and the compiled program is the hand-threaded one), or, where JAX traces
   the function once anyway (jit, shard_map, vmap, a derivative), that trace;
2. make the function pure in them: their values in, their new values out
   (``core.lift``'s ``pure_of``; ``core.run_bound`` where step 1 is the same
   trace);
3. call the JAX function with those values placed by its own rules;
4. write the new values back (``core.land``).

Only step 3 differs from one function to the next, and each family's module
holds only that placement::

    JAX function             the states go                          module
    lax.scan, lax.map        into the carry; a stacked sub-model's   loops
                             into xs and ys
    lax.while_loop           into the carry (cond_fun only reads)    loops
    lax.fori_loop            into the carry                          loops
    a for loop over a stack  rolled into one lax.scan (``over``)     loops
    lax.cond, lax.switch     into every branch's operands, output    branches
    jax.checkpoint           into the arguments, output              autodiff
    derivatives              into the auxiliary output               autodiff
    custom_vjp, custom_jvp   nowhere: run as plain Python, or a      autodiff
                             write JAX traces away is refused
    jax.jit                  into the arguments, output              jit
    jax.vmap                 a stacked sub-model's: in/out axes;     mapping
                             any other: shared, out_axes None
    jax.shard_map            into the arguments (with their          mapping
                             partition specs), output

An eager model (no handler running) has the states of the instances
reachable from the function and operands handed to a temporary handler for
the call (``core.with_eager_states``), then written back as eager slots.

A stack of layers (``autostate.stack``) in a mapped argument of
``lax.scan``, ``lax.map`` or ``jax.vmap`` is its stacked model, so each
step gets one layer (its node kind's ``stacked``, ``graph.NodeKind``;
``core``).

This package knows the slot types of ``effects`` but nothing of source code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autostate.lifting.routes import routed, wrapper_name

if TYPE_CHECKING:
    from autostate.lifting.autodiff import checkpoint, remat
    from autostate.lifting.branches import cond, switch
    from autostate.lifting.core import jit_disabled
    from autostate.lifting.loops import fori_loop, map, scan, while_loop
    from autostate.lifting.mapping import vmap

__all__ = [
    "checkpoint",
    "cond",
    "fori_loop",
    "jit_disabled",
    "map",
    "remat",
    "routed",
    "scan",
    "switch",
    "vmap",
    "while_loop",
    "wrapper_name",
]

# name -> the family module that defines it: imported when the name is first
# read (PEP 562), as the routes import a family by the first call routed to it.
_FAMILIES = {
    "checkpoint": "autodiff",
    "remat": "autodiff",
    "cond": "branches",
    "switch": "branches",
    "jit_disabled": "core",
    "fori_loop": "loops",
    "map": "loops",
    "scan": "loops",
    "while_loop": "loops",
    "vmap": "mapping",
}


def __getattr__(name: str) -> Any:
    family = _FAMILIES.get(name)
    if family is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{family}"), name)
    globals()[name] = value
    return value
