"""Sharding annotations on parameters and states, and the shardings of ``f`` and ``states``.

A model says where its arrays should live in its own ``__init__``, without
knowing the mesh::

    self.w = autostate.sharded(w, P(None, "model"))                # a parameter
    self.cache = autostate.state(zeros, sharding=P("data", None))  # a state

An annotation is a ``PartitionSpec`` of mesh or *logical* axis names (which
``rules`` map to mesh axes), kept on the instance in a static table
(``ANNOTATIONS``): part of the model's structure, so it survives
``functionalize``, ``freeze``, ``jax.jit``, copies and pickling.
``partition_specs`` and ``shardings`` read those tables into trees of exactly
the structure of ``f`` and ``states``, matching leaves by identity (``f.model``
is rebuilt around ``f``'s own leaves). No source code here: ``runtime`` calls
``split_annotation``/``record`` when ``__init__`` assigns an annotated value."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar, Union, cast

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from autostate import graph as _graph
from autostate import tree as _tree
from autostate.effects.local_state import FrozenLocalStateRequest, HandledLocalStateRef, StateSlot
from autostate.errors import InvalidArgumentError, InvalidTypeError, format_error
from autostate.functional import FunctionalModel
from autostate.state_values import (
    States,
    holds_static_values,
    join_static_values,
    split_static_values,
)

# The instance attribute holding {attribute name: spec}; static aux data.
ANNOTATIONS = "__autostate_sharding__"

T = TypeVar("T")

# What ``rules`` map a logical axis name to: a mesh axis, several, or None.
AxisRule = Union[str, tuple[str, ...], None]


class Annotated:
    """What ``autostate.sharded(value, spec)`` returns; ``__init__`` unwraps it."""

    __slots__ = ("value", "spec")

    def __init__(self, value: Any, spec: Any):
        self.value = value
        self.spec = spec

    def __repr__(self) -> str:
        return f"sharded({_tree.describe(self.value)}, {self.spec!r})"


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def check_spec(spec: Any, where: str) -> Any:
    """``spec`` if it is a PartitionSpec or a pytree of them, else a clear error."""
    leaves = jax.tree_util.tree_leaves(spec, is_leaf=_is_spec)
    if not leaves or not all(_is_spec(leaf) for leaf in leaves):
        raise InvalidTypeError(format_error(
            f"{where}: a sharding annotation is a jax.sharding.PartitionSpec "
            f"(or a pytree of them for a pytree value), got {spec!r}.",
            fix='write `P(None, "model")` with `from jax.sharding import PartitionSpec as '
            "P`; P() means replicated.",
        ))
    return spec


def sharded(value: T, spec: PartitionSpec) -> T:
    """Annotates a parameter (or state) with where it lives on a mesh.

    Use it on the right of ``self.x = ...`` in ``__init__``: the attribute
    holds ``value`` itself (eager code sees a plain array) and the instance
    records ``spec`` for ``autostate.partition_specs``/``shardings``. For
    states, ``autostate.state(value, sharding=spec)`` says the same.

    Args:
        value: the array (or pytree of arrays).
        spec: a ``PartitionSpec`` of mesh axis names or logical axis names
            (mapped by the ``rules`` given to ``shardings``); for a pytree
            value, one spec for every leaf or a pytree of specs matching
            ``value``.

    Returns:
        A marker that ``__init__``'s assignment unwraps (typed as ``value``'s
        type, which is what the attribute then holds).

    Raises:
        InvalidTypeError: ``spec`` is not a ``PartitionSpec``.

    Examples:
        >>> from jax.sharding import PartitionSpec as P
        >>> @autostate.stateful
        ... class Linear:
        ...     def __init__(self, n_in, n_out):
        ...         self.w = autostate.sharded(jnp.zeros((n_in, n_out)), P(None, "model"))
        ...
        ...     def __call__(self, x):
        ...         return x @ self.w
        >>> model = Linear(4, 8)
        >>> print(type(model.w).__name__, model.w.shape)  # eagerly, the array itself
        ArrayImpl (4, 8)
        >>> f, states = model.functionalize()
        >>> mesh = jax.make_mesh((1,), ("model",))
        >>> f_sh, s_sh = autostate.shardings(f, states, mesh)
        >>> f_sh.model.w.spec == P(None, "model")
        True
    """
    return cast(T, Annotated(value, check_spec(spec, "autostate.sharded")))


def split_annotation(value: Any) -> tuple[Any, Any]:
    """``(value, spec)`` for a ``sharded(...)`` marker, ``(value, None)`` otherwise."""
    return (value.value, value.spec) if type(value) is Annotated else (value, None)


def record(obj: Any, attr: str, spec: Any) -> None:
    """Records ``spec`` as the annotation of ``obj.attr``; the table is replaced,
    never changed in place, as copies of an instance share it."""
    d = obj.__dict__
    d[ANNOTATIONS] = {**d.get(ANNOTATIONS, {}), attr: check_spec(spec, f"{attr!r}")}


# --- reading the annotations of a functionalized model --------------------------


def _broadcast(spec: Any, value: Any, where: str) -> Any:
    """One spec per leaf of ``value``: ``spec`` itself, or the leaf of a spec pytree."""
    if _is_spec(spec):
        return jax.tree_util.tree_map(lambda _: spec, value)
    try:
        return jax.tree_util.tree_map(
            lambda s, sub: jax.tree_util.tree_map(lambda _: s, sub), spec, value, is_leaf=_is_spec
        )
    except ValueError as e:
        raise InvalidArgumentError(format_error(
            f"The sharding annotation of {where} does not match its value's structure: {e}",
            fix="give one PartitionSpec for all leaves, or a pytree of them with the "
            "value's structure.",
        )) from None


def _check_unwrapped(obj: Any, prefix: str) -> None:
    """A marker left in an attribute (a ``__setattr__`` of the user's own) hid an array."""
    for attr, value in vars(obj).items():
        if type(value) is Annotated:
            where = _graph.path_name(prefix + _graph.attr_name(attr))
            raise InvalidTypeError(format_error(
                f"{where} holds autostate.sharded(...) itself, not its array: "
                f"{type(obj).__name__} defines its own __setattr__, which stored the marker.",
                fix="remove the class's own __setattr__ (the one @stateful installs "
                "unwraps the marker), or assign the plain array and leave it unannotated.",
            ))


class _Resolved:
    """The annotations of one functionalized model: per leaf id and per state name."""

    def __init__(self, f: Any):
        if not isinstance(f, FunctionalModel):
            raise InvalidTypeError(format_error(
                f"Expected the f returned by functionalize(), got {type(f).__name__}.",
                fix="call `f, states = model.functionalize()` and pass both.",
            ))
        self.by_leaf: dict[int, tuple[Any, str]] = {}
        self.by_state: dict[str, Any] = {}
        for prefix, obj in _graph.instances(f.model):
            _check_unwrapped(obj, prefix)
            for attr, spec in vars(obj).get(ANNOTATIONS, {}).items():
                where = _graph.path_name(prefix + _graph.attr_name(attr)) or attr
                value = vars(obj).get(attr)
                if type(value) is HandledLocalStateRef:
                    self.by_state.setdefault(value.name, spec)
                elif isinstance(value, FrozenLocalStateRequest):
                    # A state of a category this f does not handle: its value is a leaf of f.
                    self._add_param(value.state, spec, where)
                elif isinstance(value, StateSlot):
                    continue  # no array: neither among f's leaves nor in states
                else:
                    self._add_param(value, spec, where)

    def _add_param(self, value: Any, spec: Any, where: str) -> None:
        leaves, treedef = jax.tree_util.tree_flatten(value, is_leaf=_graph.is_stateful_instance)
        if any(_graph.is_stateful_instance(leaf) for leaf in leaves):
            raise InvalidTypeError(format_error(
                f"{where} holds decorated models, so it cannot be given a sharding.",
                fix="annotate the arrays inside the sub-models, in their own __init__.",
            ))
        specs = jax.tree_util.tree_leaves(_broadcast(spec, value, where), is_leaf=_is_spec)
        for leaf, leaf_spec in zip(leaves, specs):
            self.by_leaf.setdefault(id(leaf), (leaf_spec, where))


def _state_specs(resolved: _Resolved, states: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(states, Mapping):
        raise InvalidTypeError(format_error(
            f"Expected the states dict returned by functionalize(), got "
            f"{type(states).__name__}.",
            fix="call `f, states = model.functionalize()` and pass both.",
        ))
    specs = {}
    for name, value in states.items():
        spec = resolved.by_state.get(name, PartitionSpec())
        if holds_static_values(value):
            # Its Python values are structure (see ``States``): the specs keep
            # them in their places, so the two trees have one structure.
            stripped, static = split_static_values(value)
            specs[name] = join_static_values(_broadcast(spec, stripped, repr(name)), static)
        else:
            specs[name] = _broadcast(spec, value, repr(name))
    return States(specs) if isinstance(states, States) else specs


def partition_specs(
    f: Any, states: Mapping[str, Any], *, rules: Mapping[str, AxisRule] | None = None
) -> tuple[Any, dict[str, Any]]:
    """The ``PartitionSpec`` trees of ``f`` and ``states``, as the model annotates them.

    An array without annotation gets ``P()`` (replicated). The trees fit
    ``jax.shard_map``'s ``in_specs`` and ``out_specs``.

    Args:
        f: the ``f`` that ``functionalize()`` returned (or a ``jax.jit`` or
            ``jax.eval_shape`` of it).
        states: its states.
        rules: maps logical axis names to mesh axes, as for ``shardings``;
            without it, specs are returned as annotated.

    Returns:
        ``(f_specs, state_specs)``: ``f_specs`` has ``f``'s pytree structure,
        ``state_specs`` is a dict with the keys and value structures of
        ``states``.

    Examples:
        >>> from jax.sharding import PartitionSpec as P
        >>> @autostate.stateful
        ... class Linear:
        ...     def __init__(self):
        ...         self.w = autostate.sharded(jnp.zeros((4, 8)), P(None, "mlp"))
        ...         self.b = jnp.zeros(8)
        ...         self.mean = autostate.state(jnp.zeros(8), sharding=P("mlp"))
        >>> f, states = Linear().functionalize()
        >>> f_specs, s_specs = autostate.partition_specs(f, states, rules={"mlp": "model"})
        >>> f_specs.model.w == P(None, "model"), f_specs.model.b == P(), s_specs["mean"] == P("model")
        (True, True, True)
    """
    resolved = _Resolved(f)
    leaves, treedef = jax.tree_util.tree_flatten(f)
    specs = [resolved.by_leaf.get(id(leaf), (PartitionSpec(), ""))[0] for leaf in leaves]
    state_specs = _state_specs(resolved, states)
    if rules is not None:
        specs = [resolve_spec(s, None, rules) for s in specs]
        state_specs = jax.tree_util.tree_map(
            lambda s: resolve_spec(s, None, rules), state_specs, is_leaf=_is_spec
        )
    return jax.tree_util.tree_unflatten(treedef, specs), state_specs


def _shape(x: Any) -> tuple[int, ...]:
    shape = getattr(x, "shape", None)  # ShapeDtypeStructs too
    return tuple(shape) if shape is not None else np.shape(x)


def _mesh_axes(entry: Any, rules: Mapping[str, AxisRule] | None) -> tuple[str, ...]:
    names = entry if isinstance(entry, tuple) else (entry,)
    out: list[str] = []
    for name in names:
        mapped = rules.get(name, name) if rules is not None else name
        if mapped is None:
            continue
        out.extend(mapped if isinstance(mapped, tuple) else (mapped,))
    return tuple(out)


def resolve_spec(
    spec: PartitionSpec, mesh: jax.sharding.Mesh | None,
    rules: Mapping[str, AxisRule] | None = None, *, shape: tuple[int, ...] | None = None,
    where: str = "an array",
) -> PartitionSpec:
    """``spec`` with logical names mapped by ``rules``, checked against ``mesh``
    and ``shape`` (without a mesh, only mapped)."""
    entries: list[Any] = []
    for dim, entry in enumerate(spec):
        if entry is None or entry is PartitionSpec.UNCONSTRAINED:
            entries.append(entry)
            continue
        axes = _mesh_axes(entry, rules)
        unknown = [a for a in axes if a not in mesh.axis_names] if mesh is not None else []
        if unknown and mesh is not None:
            raise InvalidArgumentError(format_error(
                f"The sharding {spec} of {where} names {unknown[0]!r}, which is neither an "
                f"axis of the mesh {tuple(mesh.axis_names)} nor mapped by the rules.",
                fix=f"add {unknown[0]!r} to `rules` (logical name -> mesh axis or None), "
                "or build the mesh with that axis.",
            ))
        if mesh is not None and shape is not None and dim < len(shape):
            parts = int(np.prod([mesh.shape[a] for a in axes], dtype=np.int64))
            if shape[dim] % parts:
                raise InvalidArgumentError(format_error(
                    f"The sharding {spec} of {where} splits dimension {dim} "
                    f"(size {shape[dim]}) into {parts} parts, which does not divide it.",
                    fix="choose sizes divisible by the mesh axes, or shard another "
                    "dimension.",
                ))
        entries.append(axes[0] if len(axes) == 1 else (axes or None))
    if shape is not None and len(entries) > len(shape):
        raise InvalidArgumentError(format_error(
            f"The sharding {spec} of {where} has {len(entries)} entries, but the array has "
            f"{len(shape)} dimension(s).",
            fix="give at most one entry per dimension.",
        ))
    return PartitionSpec(*entries)


def shardings(
    f: Any, states: Mapping[str, Any], mesh: jax.sharding.Mesh, *,
    rules: Mapping[str, AxisRule] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """The ``NamedSharding`` trees of ``f`` and ``states`` on ``mesh``.

    Every spec is checked against the mesh and the array's shape first, with
    an error that names the attribute or state. The trees fit
    ``jax.device_put`` and ``jax.jit``'s ``in_shardings`` and
    ``out_shardings``.

    Args:
        f: the ``f`` that ``functionalize()`` returned (or a ``jax.jit`` or
            ``jax.eval_shape`` of it).
        states: its states.
        mesh: a ``jax.sharding.Mesh``.
        rules: maps logical axis names used in annotations to a mesh axis,
            a tuple of mesh axes, or ``None`` (not sharded); names not in it
            must be mesh axes.

    Returns:
        ``(f_shardings, state_shardings)`` with the structures of ``f`` and
        ``states``; unannotated arrays are replicated.

    Raises:
        InvalidArgumentError: a spec names an axis that is neither the mesh's
            nor mapped by ``rules``, splits a dimension into parts that do not
            divide it, or has more entries than the array has dimensions.

    Examples:
        >>> from jax.sharding import PartitionSpec as P
        >>> @autostate.stateful
        ... class Linear:
        ...     def __init__(self):
        ...         self.w = autostate.sharded(jnp.ones((4, 8)), P(None, "mlp"))
        ...
        ...     def __call__(self, x):
        ...         return x @ self.w
        >>> f, states = Linear().functionalize()
        >>> mesh = jax.make_mesh((1,), ("model",))
        >>> f_sh, s_sh = autostate.shardings(f, states, mesh, rules={"mlp": "model"})
        >>> f, states = jax.device_put((f, states), (f_sh, s_sh))
        >>> f.model.w.sharding.spec == P(None, "model")
        True
    """
    resolved = _Resolved(f)
    if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
        raise InvalidTypeError(format_error(
            f"autostate.shardings places on a jax.sharding.Mesh, got {type(mesh).__name__} "
            f"{mesh!r}.",
            fix="make one with `jax.make_mesh(shape, axis_names)` and pass it third: "
            "`autostate.shardings(f, states, mesh)`.",
        ))
    leaves, treedef = jax.tree_util.tree_flatten(f)
    out = []
    for leaf in leaves:
        spec, where = resolved.by_leaf.get(id(leaf), (PartitionSpec(), "a parameter"))
        spec = resolve_spec(spec, mesh, rules, shape=_shape(leaf), where=repr(where))
        out.append(NamedSharding(mesh, spec))
    f_shardings = jax.tree_util.tree_unflatten(treedef, out)
    state_shardings = {
        name: jax.tree_util.tree_map(
            lambda s, v, name=name: NamedSharding(
                mesh, resolve_spec(s, mesh, rules, shape=_shape(v), where=f"state {name!r}")
            ),
            specs, states[name], is_leaf=_is_spec,
        )
        for name, specs in _state_specs(resolved, states).items()
    }
    return f_shardings, state_shardings


# --- arrays made from the parameters, in the parameters' layout -----------------------


def _own_sharding(leaf: Any) -> Any:
    """The sharding ``leaf`` was placed with, or ``None``: a tracer (its layout
    is its program's), a NumPy array, or an array left on the default device
    (not committed: JAX moves it where it is used)."""
    if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer) and leaf.committed:
        return leaf.sharding
    return None


def made_in_layout(fn: Callable[[T], Any], params: T) -> Any:
    """``fn(params)``, each array of the result that stands for a parameter
    made directly in that parameter's sharding.

    An optimizer's state (``tx.init(f)``) holds, for each parameter, arrays
    shaped like it (Adam's moments) in trees shaped like ``params``. Made
    eagerly, they land where JAX's defaults put them: ``jnp.zeros_like`` of
    a weakly typed array (``jnp.full(n, 0.01)``), or ``jnp.zeros(p.shape)``,
    is on the default device whatever the parameter's sharding, so a large
    model's moments would gather on one device. Here ``fn`` runs under
    ``jax.jit`` with ``out_shardings``: a leaf of the result at a parameter's
    place in a subtree shaped like ``params``, with that parameter's shape,
    is made with its sharding, shard by shard; every other leaf (a step
    count, a factored moment) is left to XLA, on the parameters' devices.
    Parameters with no sharding of their own (``_own_sharding``) place
    nothing; when no parameter has one, ``fn(params)`` just runs.

    Example:
        >>> w = jax.device_put(jnp.full(4, 0.5), jax.devices()[0])  # weakly typed
        >>> eager = jnp.zeros_like(w)
        >>> made = made_in_layout(lambda p: {"m": jnp.zeros_like(p)}, w)["m"]
        >>> eager.committed, made.committed, made.sharding == w.sharding
        (False, True, True)
    """
    leaves, treedef_ = jax.tree_util.tree_flatten(params)
    treedef: Any = treedef_
    owned = [_own_sharding(leaf) for leaf in leaves]
    if all(s is None for s in owned):
        return fn(params)
    shapes = [_shape(leaf) for leaf in leaves]

    def parts(node: Any) -> list[Any] | None:
        """``node``'s subtrees at the parameters' places, if it is shaped like ``params``."""
        if jax.tree_util.treedef_is_leaf(treedef):  # one array: only a leaf stands for it
            return [node] if isinstance(node, jax.ShapeDtypeStruct) else None
        try:
            return treedef.flatten_up_to(node)
        except (ValueError, TypeError):
            return None

    def out_sharding(node: Any) -> Any:
        found = parts(node)
        if found is None:
            return None
        return jax.tree_util.tree_unflatten(treedef, [
            s if isinstance(part, jax.ShapeDtypeStruct) and part.shape == shape else None
            for part, s, shape in zip(found, owned, shapes)
        ])

    result = jax.eval_shape(fn, params)
    out_shardings = jax.tree_util.tree_map(
        out_sharding, result, is_leaf=lambda node: parts(node) is not None
    )
    return jax.jit(fn, out_shardings=out_shardings)(params)
