"""``jax.vmap`` and ``jax.shard_map``: a stacked sub-model's states go in
and out along the mapped axes; any other state is shared (``out_axes``
``None``), and shard_map's go in with their partition specs."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import jax

from autostate import graph as _graph
from autostate.effects.local_state import (
    HandledLocalStateRef,
    StateSlot,
    handler_cells,
    running_cells,
)
from autostate.lifetime import current_trace, with_home
from autostate.lifting.core import (
    Cells,
    argument_writes,
    check_stacked,
    current_values,
    guarding_copies,
    land,
    member_slices,
    members_of,
    run_bound,
    shared_write,
    traceable,
    transformation,
    vmap_layers,
    with_layer_views,
)

# --- vmap ---------------------------------------------------------------------------
# ``jax.vmap``'s placement: the states of a sub-model in a mapped argument
# are mapped with it (in and out axes its argument's), each example reading
# and writing its own member; any other state is broadcast: read as it is,
# and assigned only with a value every example agrees on (``out_axes=None``,
# a statistic reduced over the ``axis_name``), which plain Python's loop
# over the examples would leave.


def vmap(fun: Callable[..., Any], in_axes: Any = 0, out_axes: Any = 0, **options: Any) -> Callable[..., Any]:
    """``jax.vmap`` of a function that may read and assign state (what a
    method's ``jax.vmap(...)`` calls).

    A sub-model in a mapped argument is a stack of members (one built by
    ``jax.vmap(Layer)(keys)``): each example reads and writes its own
    member, as a loop over the members would. A state reached any other way
    is shared by every example: reading it is free, and it may be assigned
    a value that does not vary over the examples (reduced with
    ``lax.pmean``/``psum`` over the ``axis_name``); a per-example value is
    refused, as no single value means what the loop would leave.

    Args:
        fun: the function to vectorize.
        in_axes: as ``jax.vmap``'s; the states of a sub-model in an argument
            share that argument's axis.
        out_axes: as ``jax.vmap``'s; the states of a mapped sub-model come back
            on their argument's axis.
        **options: the other options of ``jax.vmap`` (``axis_name``, ``axis_size``,
            ``spmd_axis_name``).

    Returns:
        The vectorized function.

    Examples:
        >>> @autostate.stateful
        ... class Member:
        ...     def __init__(self, key):
        ...         self.w = jax.random.normal(key, (2,))
        ...         self.calls = jnp.zeros((), jnp.int32)
        ...
        ...     def __call__(self, x):
        ...         self.calls += 1
        ...         return x @ self.w
        >>> members = jax.vmap(Member)(jax.random.split(jax.random.key(0), 3))
        >>> ys = autostate.vmap(lambda m, x: m(x))(members, jnp.ones((3, 2)))
        >>> print(ys.shape, members.calls)
        (3,) [1 1 1]
    """

    def call(args: tuple, kwargs: dict) -> Any:
        args, kwargs = vmap_layers(in_axes, args, kwargs)
        axes = tuple(in_axes) if isinstance(in_axes, (tuple, list)) else (in_axes,) * len(args)
        mapped = ([a for a, axis in zip(args, axes) if axis is not None], kwargs)
        return _living_here(with_layer_views(
            mapped, "a jax.vmap",
            lambda: _vmap_call(fun, in_axes, out_axes, options, args, kwargs),
        ))

    return transformation(fun, "a jax.vmap", call)


def _living_here(out: Any) -> Any:
    """``out``, the models in it (a stack ``jax.vmap(Layer)(keys)`` built)
    living in the trace the ``vmap`` was called in: JAX made them there from
    the batched values, as a model built in that trace is (``lifetime``)."""
    if not _graph.holds_instance(out):
        return out
    home = current_trace()
    for obj in _graph.instances_of(out):
        for value in obj.__dict__.values():
            if isinstance(value, StateSlot) and hasattr(value, "_home"):
                with_home(value, home)
    return out


def _vmap_call(
    fun: Callable, in_axes: Any, out_axes: Any, options: dict, args: tuple, kwargs: dict
) -> Any:
    if _graph.holds_instance((args, kwargs)):  # a mapped sub-model: the copies guarded
        mapped = fun

        def fun(*inner: Any, **inner_kwargs: Any) -> Any:
            return guarding_copies(
                (inner, inner_kwargs), "a jax.vmap", lambda: mapped(*inner, **inner_kwargs)
            )

    cells = running_cells()
    if not cells:
        return jax.vmap(fun, in_axes=in_axes, out_axes=out_axes, **options)(*args, **kwargs)
    what = "a jax.vmap"
    if isinstance(in_axes, list):
        in_axes = tuple(in_axes)  # (as jax.vmap reads a list)
    if not isinstance(in_axes, tuple):
        in_axes = (in_axes,) * len(args)
    axis_of: dict[int, int] = {}

    def visit(axis: Any, part: Any) -> None:
        if isinstance(axis, int):
            for i in members_of(cells, part):
                axis_of.setdefault(i, axis)

    with contextlib.suppress(ValueError, TypeError):  # (jax.vmap says what does not match)
        jax.tree_util.tree_map(visit, in_axes, args, is_leaf=lambda a: a is None)
    visit(0, kwargs)
    members = list(axis_of)
    chosen = [cells[i] for i in members]
    axes = [axis_of[i] for i in members]
    check_stacked(chosen, axes, options.get("axis_size"), what)
    groups = sorted(set(axes))
    assigned: list[int] = []

    def inner(values: list[Any], args: tuple, kwargs: dict) -> Any:
        with member_slices(chosen):
            out, after, changed = run_bound(
                cells, chosen, values, what, lambda: fun(*args, **kwargs)
            )
        stacked: dict[int, dict[int, Any]] = {axis: {} for axis in groups}
        for k, i in enumerate(members):
            if i in changed:
                stacked[axes[k]][k] = after[i]
        shared = {i: after[i] for i in sorted(changed) if i not in axis_of}
        assigned[:] = list(shared)
        return out, stacked, shared

    vmapped = functools.partial(jax.vmap, inner, in_axes=(axes, in_axes, 0), **options)
    values = current_values(chosen)
    try:
        out, stacked, shared = vmapped(out_axes=(out_axes, {a: a for a in groups}, None))(
            values, args, kwargs
        )
    except ValueError as error:
        if "out_axes" not in str(error) or not assigned:
            raise
        for i in list(assigned):
            only_i = {j: None if j == i else 0 for j in assigned}  # (the others batched)
            try:
                jax.eval_shape(vmapped(out_axes=(0, 0, only_i)), values, args, kwargs)
            except ValueError:
                raise shared_write(cells[i], what, "example", _REDUCE_EXAMPLES) from None
        raise
    for axis in groups:
        land(chosen, stacked[axis])
    land(cells, shared)
    return out


_REDUCE_EXAMPLES = (
    "reduce the value over the vmap's axis (`jax.vmap(fn, axis_name='batch')` and "
    "`lax.pmean(value, 'batch')`), or make the state part of a stacked sub-model "
    "(`jax.vmap(Layer)(keys)`) passed as a mapped argument, so each example keeps its own."
)


# --- shard_map -----------------------------------------------------------------------
# ``jax.shard_map``'s placement: the live states JAX can trace are extra
# arguments, each with the partition spec its annotation gives (replicated
# without one), and come back with it. A replicated state assigned there
# lands only with a value every shard agrees on (reduced with
# ``lax.pmean``/``psum`` over the mesh axes); a per-shard value is refused,
# as a per-example one under ``jax.vmap`` is.


def shard_map(f: Callable[..., Any] | None = None, /, **options: Any) -> Any:
    """``jax.shard_map`` of a function that may read and assign state (what a
    method's ``jax.shard_map`` calls). A state enters every shard with the
    partition spec its annotation gives (``autostate.sharded``), replicated
    otherwise, and leaves the same way: a replicated one the function assigns
    must have a value every shard agrees on (reduced over the mesh axes), or
    it is refused.

    Args:
        f: the per-shard function (or ``None``: ``shard_map`` used as a decorator
            factory, as ``jax.shard_map(mesh=..., ...)``).
        **options: those of ``jax.shard_map`` (``mesh``, ``in_specs``, ``out_specs``, ...).

    Returns:
        The mapped function.
    """
    if f is None:
        return functools.partial(shard_map, **options)
    fun = f
    return transformation(
        fun, "a jax.shard_map", lambda args, kwargs: _shard_map_call(fun, options, args, kwargs)
    )


def _shard_map_call(f: Callable, options: dict, args: tuple, kwargs: dict) -> Any:
    cells = running_cells()
    if not cells or kwargs:  # (jax.shard_map takes no keywords: its own error)
        return jax.shard_map(f, **options)(*args, **kwargs)
    what = "a jax.shard_map"
    passed = [i for i, cell in enumerate(cells) if traceable(cell.value)]
    chosen = [cells[i] for i in passed]
    replicated = jax.sharding.PartitionSpec()
    annotated = _annotated_specs(cells, (f, args))
    specs = [annotated.get(i, replicated) for i in passed]
    sharded = [k for k, i in enumerate(passed) if i in annotated]
    lifted = dict(options)
    if "in_specs" in options:
        given = options["in_specs"]
        per_arg = given if isinstance(given, tuple) else (given,) * len(args)
        lifted["in_specs"] = (specs, *per_arg)
    assigned: list[int] = []

    def threaded(values: list[Any], *inner: Any) -> Any:
        out, written = argument_writes(cells, passed, values, what, lambda: f(*inner))
        assigned[:] = [k for k in written if k not in sharded]
        # An annotated state leaves with its own spec, assigned or not; the
        # others replicated, only those assigned.
        return out, (
            {k: written.get(k, values[k]) for k in sharded},
            {k: v for k, v in written.items() if k not in sharded},
        )

    out_specs = (options.get("out_specs"), ({k: specs[k] for k in sharded}, replicated))
    values = current_values(chosen)
    try:
        out, (kept, new) = jax.shard_map(threaded, **{**lifted, "out_specs": out_specs})(
            values, *args
        )
    except ValueError:
        for k in list(assigned):
            one = functools.partial(lambda k, *a: threaded(*a)[1][1][k], k)
            try:
                jax.eval_shape(
                    jax.shard_map(one, **{**lifted, "out_specs": replicated}), values, *args
                )
            except ValueError:
                raise shared_write(chosen[k], what, "shard", _REDUCE_SHARDS) from None
        raise
    land(chosen, {**kept, **new})
    return out


def _annotated_specs(cells: Cells, roots: tuple) -> dict[int, Any]:
    """The partition specs the models reachable from ``roots`` annotate their
    states with (``autostate.sharded``), by index into ``cells``."""
    from autostate.sharding import ANNOTATIONS

    index = {id(cell): i for i, cell in enumerate(cells)}
    found: dict[int, Any] = {}
    for obj in _graph.reachable_instances(roots, []):
        for attr, spec in vars(obj).get(ANNOTATIONS, {}).items():
            slot = obj.__dict__.get(attr)
            if type(slot) is HandledLocalStateRef:
                i = index.get(id(handler_cells(slot.handler_id).get(slot.name)))
                if i is not None:
                    found.setdefault(i, spec)
    return found


_REDUCE_SHARDS = (
    "reduce the value over the mesh axes (`lax.pmean(value, 'data')`) before assigning "
    "it, or return the per-shard values and assign their reduction after the call."
)
