"""Pytree registration of ``@stateful`` classes and the one tree walk.

This module owns two things everything else builds on:

* how a decorated instance is a pytree: array-valued attributes, sub-models,
  request objects and containers holding any of those are children; every
  other value (python scalars, strings, callables, ``None``) is static aux data,
  so ``jax.jit`` takes a model as an argument without filters;
* ``map_tree``: walk any pytree (plain containers, registered nodes, decorated
  instances), find the nodes a predicate picks, and replace them, knowing the
  path name of each. Decorated instances are visited once each, by identity,
  so one instance reachable from two paths stays one instance (aliasing
  follows Python) and is named by its first path.

It also owns the few things every layer needs to say about a value: whether
it is a decorated instance, the decoration info of its class
(``class_info``), and how an array is written in messages (``describe``).

It knows nothing of the effect engine or of source code; the engine registers
its request types here with ``register_dynamic_type``.
"""

from __future__ import annotations

import collections
import copy as _copy
import enum
import functools
import gc
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from autostate.errors import InvalidTypeError, format_error, user_location

# decorated class -> what to do with each copy map_tree makes of an instance
# (None: nothing). Kept here, not on the class, so membership is one lookup.
_STATEFUL_CLASSES: dict[type, Callable[[Any], None] | None] = {}
_DYNAMIC_TYPES: set[type] = set()
# slot type -> the form it takes in a pytree (so a state is flattened the same
# way before and after its first write).
_CANONICAL: dict[type, Callable[[Any], Any]] = {}

INFO_ATTR = "__autostate_info__"

# Values of these types are never pytree children of a decorated instance.
_STATIC_TYPES = (
    int,
    float,
    complex,
    bool,
    str,
    bytes,
    type(None),
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.ModuleType,
)


def is_stateful_instance(value: Any) -> bool:
    """True for instances of ``@stateful`` classes."""
    return type(value) in _STATEFUL_CLASSES


def class_info(cls: type) -> Any:
    """What ``@stateful`` decided for ``cls`` itself (not a base), or ``None``."""
    return cls.__dict__.get(INFO_ATTR)


def info_of(obj: Any) -> Any:
    """The decoration info of a decorated instance's class."""
    return getattr(type(obj), INFO_ATTR)


def describe(value: Any) -> str:
    """An array as messages write it, ``f32[3,4]``; other values by ``repr``."""
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None or dtype is None:
        return repr(value)
    return format_spec(shape, dtype)


def format_spec(shape: Any, dtype: Any) -> str:
    """``dtype[shape]`` in short form: ``f32[3,4]``, ``bf16[]``, ``key<fry>[2]``."""
    try:
        name = np.dtype(dtype).name
    except TypeError:  # extended dtypes (typed PRNG keys)
        name = str(dtype)
    for long, short in (("bfloat", "bf"), ("float", "f"), ("uint", "u"), ("int", "i")):
        if name.startswith(long):
            name = short + name[len(long) :]
            break
    name = name.replace("complex", "c")
    return f"{name}[{','.join(map(str, shape))}]"


# node type -> (children(node) -> [(path, child)], rebuild(node, children)):
# how the walks below see a node whose pytree flattening is not one level
# (a handler flattens its body as one graph).
_WALK_CHILDREN: dict[type, tuple[Callable[[Any], list], Callable[[Any, list], Any]]] = {}


def register_walk(
    cls: type, children: Callable[[Any], list], rebuild: Callable[[Any, list], Any]
) -> None:
    """How ``map_tree``/``iter_tree`` descend into ``cls`` nodes."""
    _WALK_CHILDREN[cls] = (children, rebuild)


def register_dynamic_type(cls: type) -> None:
    """Marks ``cls`` (a pytree node with static-only fields) as a model child."""
    _DYNAMIC_TYPES.add(cls)


# Childless pytree nodes that never change once made (the handled slot): one
# object per graphdef entry stands in every model rebuilt from the graphdef.
_IMMUTABLE_NODES: set[type] = set()


def register_immutable_node(cls: type) -> None:
    """Marks ``cls`` (a frozen, childless pytree node) as shareable between rebuilds."""
    _IMMUTABLE_NODES.add(cls)


def register_canonical_form(cls: type, canonical: Callable[[Any], Any]) -> None:
    """Flattens attribute values of type ``cls`` as ``canonical(value)`` would be.

    The engine registers its initial-state request here, so that a fresh
    model and the same model after one eager call (whose states then hold
    values) have one pytree structure.
    """
    _CANONICAL[cls] = canonical


def is_array_leaf(value: Any) -> bool:
    """Arrays (concrete, traced or abstract): the only leaves ``f`` and models have."""
    return isinstance(value, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def is_static_leaf(value: Any) -> bool:
    """A value that would be a pytree leaf but is not an array (``3``, ``"relu"``, a function).

    Such values, wherever they sit in a model (inside lists, dicts or a
    foreign pytree node), are static aux data, never leaves.
    """
    if value is None or is_array_leaf(value):
        return False
    t = type(value)
    if t in _STATIC_TYPES or isinstance(value, enum.Enum):
        return True
    if t is list or t is tuple or t is dict or t in _STATEFUL_CLASSES or t in _DYNAMIC_TYPES:
        return False
    return jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(value))


def is_dynamic(value: Any) -> bool:
    """Whether an attribute value is a pytree child (else it is static aux data)."""
    t = type(value)
    if t in _STATIC_TYPES:
        return False
    if t in _STATEFUL_CLASSES or t in _DYNAMIC_TYPES:
        return True
    if is_array_leaf(value):
        return True
    if t is list or t is tuple:
        return any(is_dynamic(v) for v in value)
    if t is dict:
        return any(is_dynamic(v) for v in value.values())
    if isinstance(value, _STATIC_TYPES):
        return False
    children, treedef = _flatten_one_level(value)
    if treedef is None:
        return False
    return any(is_dynamic(c) for _, c in children)


class _Static:
    """Hashable wrapper for a static value kept in pytree aux data.

    Used so that unhashable python values (lists of ints, dicts of config)
    can sit in aux data: equality is the value's own ``==``; the hash falls
    back to the type when the value is unhashable. It is also a pytree node
    without children: a static value inside a list of a model (``[Sub(), 3]``)
    stands there as one, so it is structure, not a leaf.
    """

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Static):
            return NotImplemented
        if self.value is other.value:
            return True
        if type(self.value) is not type(other.value):
            return False
        try:
            return bool(self.value == other.value)
        except Exception:
            return False

    def __hash__(self) -> int:
        try:
            return hash(self.value)
        except TypeError:
            return hash(type(self.value))

    def __repr__(self) -> str:
        return f"static({self.value!r})"


jax.tree_util.register_pytree_node(_Static, lambda s: ((), s), lambda aux, _children: aux)


# --- mutable static values ------------------------------------------------------

# The builtin containers a static value may be that code can change in place.
MUTABLE_CONTAINERS = (list, dict, set, bytearray, collections.deque)


# Objects with a ``__dict__`` that is not data they hold.
_NOT_HOLDERS = (type, types.ModuleType, types.FunctionType, types.MethodType, functools.partial)


def plain_attributes(value: Any) -> dict[str, Any] | None:
    """The ``__dict__`` of an undecorated object that keeps its data there
    (not a class, module, function, method or partial); ``None`` otherwise."""
    attrs = getattr(value, "__dict__", None)
    if (
        not isinstance(attrs, dict)
        or isinstance(value, _NOT_HOLDERS)
        or type(value) in _STATEFUL_CLASSES
    ):
        return None
    return attrs


def _is_plain_tuple(value: Any) -> bool:
    """A tuple or a named tuple (``typing.NamedTuple``: optax's states)."""
    t = type(value)
    return t is tuple or (issubclass(t, tuple) and hasattr(t, "_fields") and hasattr(t, "_make"))


def is_mutable_static(value: Any) -> bool:
    """Whether ``value`` is, or a tuple or named tuple holds, a list, dict,
    set, deque or bytearray."""
    if isinstance(value, MUTABLE_CONTAINERS):
        return True
    return _is_plain_tuple(value) and any(map(is_mutable_static, value))


def copy_static(value: Any, memo: dict[int, Any]) -> Any:
    """``value`` with its builtin containers copied, at any depth (``memo``
    keeps two references to one container one); other objects are shared.

    A graphdef keeps the copy a flatten made, and each model rebuilt from it
    gets copies of its own: a static list then means its value when the
    graphdef was made (jit's cache compares graphdefs), and a change in place
    inside one model (an eager call, a trace) reaches no other.
    """
    if not isinstance(value, MUTABLE_CONTAINERS) and not _is_plain_tuple(value):
        return value
    found = memo.get(id(value))
    if found is not None:
        return found
    new: Any
    if isinstance(value, tuple):
        items = tuple(copy_static(v, memo) for v in value)
        if all(a is b for a, b in zip(items, value)):
            new = value
        else:
            new = items if type(value) is tuple else type(value)._make(items)  # type: ignore[attr-defined]
    elif isinstance(value, (set, bytearray)):
        new = _copy.copy(value)  # hashable or int items: nothing inside to copy
    else:
        container: Any = value
        new = _copy.copy(container)  # keeps the subclass (a defaultdict's factory)
        memo[id(value)] = new
        if isinstance(container, dict):
            for k, v in container.items():
                dict.__setitem__(new, k, copy_static(v, memo))
        else:
            items_list = [copy_static(v, memo) for v in container]
            new.clear()
            new.extend(items_list)
    memo[id(value)] = new
    return new


# --- static values inside containers ------------------------------------------


def _wrap_statics(value: Any, path: tuple = ()) -> tuple[Any, tuple]:
    """``value`` with the static leaves of its plain containers wrapped; their positions."""
    t = type(value)
    if t is dict:
        items: list[tuple[Any, Any]] = list(value.items())
    elif t is list or t is tuple:
        items = list(enumerate(value))
    else:
        return value, ()
    positions: list[tuple] = []
    changed = False
    out = []
    for k, v in items:
        if is_static_leaf(v):
            out.append((k, _Static(v)))
            positions.append((*path, k))
            changed = True
            continue
        new, sub = _wrap_statics(v, (*path, k))
        positions.extend(sub)
        changed = changed or new is not v
        out.append((k, new))
    if not changed:
        return value, ()
    if t is dict:
        return {k: v for k, v in out}, tuple(positions)
    return t(v for _, v in out), tuple(positions)


def _replace_at(value: Any, path: tuple, fn: Callable[[Any], Any]) -> Any:
    if not path:
        return fn(value)
    head, rest = path[0], path[1:]
    if type(value) is dict:
        out = dict(value)
        out[head] = _replace_at(value[head], rest, fn)
        return out
    items = list(value)
    items[head] = _replace_at(items[head], rest, fn)
    return type(value)(items)


def _wrap_at(value: Any, positions: tuple) -> Any:
    for path in positions:
        value = _replace_at(value, path, _Static)
    return value


def _unwrap_at(value: Any, positions: tuple) -> Any:
    for path in positions:
        value = _replace_at(value, path, lambda s: s.value if type(s) is _Static else s)
    return value


# --- per-instance pytree ------------------------------------------------------

# id(instance) -> (weakref, attribute names, aux) for instances built by unflatten:
# flattening them again gives the same structure whatever their values became
# (``tree.map(lambda _: None, model)`` used as a vmap prefix).
_LAYOUTS: dict[int, tuple[Any, tuple[str, ...], tuple]] = {}


def _remember_layout(obj: Any, aux: tuple) -> None:
    key = id(obj)
    try:
        ref = weakref.ref(obj, lambda _r: _LAYOUTS.pop(key, None))
    except TypeError:  # no __weakref__ slot: inferred from values every time
        return
    _LAYOUTS[key] = (ref, tuple(obj.__dict__), aux)


def _entry_name(entry: Any) -> str:
    return entry if type(entry) is str else entry[1]


# Slot type -> (split, join) for the states of a running call: JAX's flatten
# of an instance inside ``f`` (``jax.vmap`` / ``lax.scan`` / ``tree_map``
# over a sub-model) gives the state's current value as a leaf, so a copy JAX
# rebuilds from sliced leaves reads its slice. ``split(slot)`` is
# ``(value, key)`` or None (not running: the slot stays static);
# ``join(key, value)`` is the rebuilt copy's slot (see the engine).
_RUNNING_SLOTS: dict[type, tuple[Callable[[Any], Any], Callable[[Any, Any], Any]]] = {}


def register_running_slot(
    cls: type, split: Callable[[Any], Any], join: Callable[[Any, Any], Any]
) -> None:
    """Flattens ``cls`` slots of a running call as leaves (see ``_RUNNING_SLOTS``)."""
    _RUNNING_SLOTS[cls] = (split, join)


def _running_part(value: Any) -> Any:
    how = _RUNNING_SLOTS.get(type(value))
    return None if how is None else how[0](value)


def _flatten_instance(obj: Any) -> tuple[list[Any], tuple]:
    d = obj.__dict__
    remembered = _LAYOUTS.get(id(obj))
    if remembered is not None and remembered[0]() is obj and remembered[1] == tuple(d):
        return _flatten_as(obj, d, remembered[2])
    aux: list[Any] = []
    children: list[Any] = []
    for name, value in d.items():
        canonical = _CANONICAL.get(type(value))
        if canonical is not None:
            value = canonical(value)
        bound = _bound_to_self(obj, value)
        if bound is not None:
            aux.append(("m", name, bound))  # rebound to the rebuilt instance
        elif _RUNNING_SLOTS and (running := _running_part(value)) is not None:
            aux.append(("r", name, (type(value), running[1])))
            children.append(running[0])
        elif is_dynamic(value):
            if type(value) in _STATEFUL_CLASSES and _leads_back(value, obj):
                raise _cycle_error(obj, name, value)
            value, positions = _wrap_statics(value)
            aux.append(("c", name, positions) if positions else name)
            children.append(value)
        else:
            aux.append(("s", name, _Static(value)))
    return children, tuple(aux)


def _leads_back(child: Any, obj: Any) -> bool:
    """Whether ``child`` (a sub-model of ``obj``) refers back to ``obj``, as an
    attribute or an item of a list, tuple or dict attribute: a cycle JAX's
    flatten, which follows a pytree's children, would never leave."""
    if child is obj:
        return True
    for v in child.__dict__.values():
        if v is obj:
            return True
        t = type(v)
        if (t is list or t is tuple) and any(i is obj for i in v):
            return True
        if t is dict and any(i is obj for i in v.values()):
            return True
    return False


def _cycle_error(obj: Any, name: str, child: Any) -> Exception:
    what = "itself" if child is obj else f"a {type(child).__name__} that refers back to it"
    return InvalidTypeError(
        format_error(
            f"{type(obj).__name__}.{name} holds {what}: a model whose attributes form a cycle "
            "cannot be a JAX pytree (passed to jax.jit, jax.tree.map, ...), whose flatten "
            "would follow the cycle forever.",
            where=user_location(),
            fix="pass `f, states = model.functionalize()` to the transformation instead "
            "(functionalize follows shared and cyclic references), or keep the "
            "back-reference as `weakref.ref(parent)` (call it to reach the parent).",
        )
    )


def _bound_to_self(obj: Any, value: Any) -> _BoundRef | None:
    """A method of, closure over or weak reference to ``obj`` alone, as the
    per-instance flatten keeps it (rebound to each rebuilt instance)."""
    if type(value) not in _CALLABLES:
        return None
    held = _held_instances(value)
    if held is None or any(h is not None and h is not obj for h in held):
        return None
    return _bound_ref(value, [-1 if h is None else 0 for h in held])


def _flatten_as(obj: Any, d: dict, layout: tuple) -> tuple[list[Any], tuple]:
    aux: list[Any] = []
    children: list[Any] = []
    for entry in layout:
        name = _entry_name(entry)
        value = d[name]
        canonical = _CANONICAL.get(type(value))
        if canonical is not None:
            value = canonical(value)
        if _RUNNING_SLOTS and (running := _running_part(value)) is not None:
            aux.append(("r", name, (type(value), running[1])))
            children.append(running[0])
        elif type(entry) is str:
            aux.append(entry)
            children.append(value)
        elif entry[0] == "c":
            aux.append(entry)
            children.append(_wrap_at(value, entry[2]))
        elif (bound := _bound_to_self(obj, value)) is not None:
            aux.append(("m", name, bound))
        else:
            aux.append(("s", name, _Static(value)))
    return children, tuple(aux)


def _flatten_instance_with_keys(obj: Any):
    children, aux = _flatten_instance(obj)
    keys = [
        jax.tree_util.GetAttrKey(_entry_name(entry))
        for entry in aux
        if type(entry) is str or entry[0] in "cr"
    ]
    return list(zip(keys, children)), aux


def _make_unflatten(cls: type) -> Callable[[tuple, Any], Any]:
    new = object.__new__

    def unflatten(aux: tuple, children: Any) -> Any:
        obj: Any = new(cls)
        d = obj.__dict__
        it = iter(children)
        for entry in aux:
            if type(entry) is str:
                d[entry] = next(it)
            elif entry[0] == "c":
                d[entry[1]] = _unwrap_at(next(it), entry[2])
            elif entry[0] == "m":
                d[entry[1]] = entry[2].rebind([obj])
            elif entry[0] == "r":
                slot_type, key = entry[2]
                d[entry[1]] = _RUNNING_SLOTS[slot_type][1](key, next(it))
            else:
                d[entry[1]] = entry[2].value
        _remember_layout(obj, aux)
        return obj

    return unflatten


def register_stateful_class(
    cls: type, info: Any, after_copy: Callable[[Any], None] | None = None
) -> None:
    """Records ``cls`` as decorated with ``info`` and registers it as a pytree node.

    ``after_copy(new)`` runs on every copy ``map_tree`` makes of an instance,
    once its attributes are in place. Registering again (re-decoration with
    other options) replaces both.
    """
    setattr(cls, INFO_ATTR, info)
    if cls not in _STATEFUL_CLASSES:
        jax.tree_util.register_pytree_with_keys(
            cls, _flatten_instance_with_keys, _make_unflatten(cls), _flatten_instance
        )
    _STATEFUL_CLASSES[cls] = after_copy


# --- path names -----------------------------------------------------------


def attr_name(attr: str) -> str:
    return "." + attr


def index_name(index: int) -> str:
    return f"[{index}]"


def mapping_name(key: Any) -> str:
    return f"[{key!r}]"


def key_name(key: Any) -> str:
    """One keypath entry as it appears in a state name (``.a``, ``[0]``, ``['k']``)."""
    if isinstance(key, jax.tree_util.GetAttrKey):
        return attr_name(key.name)
    if isinstance(key, jax.tree_util.SequenceKey):
        return index_name(key.idx)
    if isinstance(key, jax.tree_util.DictKey):
        return mapping_name(key.key)
    if isinstance(key, jax.tree_util.FlattenedIndexKey):
        return index_name(key.key)
    return mapping_name(key)


def path_name(prefix: str) -> str:
    """A state name from an accumulated path string: no leading dot."""
    return prefix[1:] if prefix.startswith(".") else prefix


def _flatten_one_level(node: Any):
    """Children (with their path strings) of a registered pytree node, or None."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    if jax.tree_util.treedef_is_leaf(treedef) and len(leaves) == 1 and leaves[0][1] is node:
        return [], None
    return [("".join(key_name(k) for k in path), child) for path, child in leaves], treedef


def is_pytree_node(value: Any) -> bool:
    """Whether ``value`` is a registered pytree node (a walk goes into it)."""
    return _flatten_one_level(value)[1] is not None


# --- the walk -------------------------------------------------------------


def map_tree(
    tree: Any,
    replace: Callable[[Any, str], Any],
    is_target: Callable[[Any], bool],
) -> Any:
    """Rebuilds ``tree`` with every node picked by ``is_target`` replaced.

    ``replace(node, name)`` gets the node and its path name from the root
    (``blocks[0].attn.cache['k']``). Decorated instances are copied once each
    (a shallow copy holding the mapped attributes); a second path to the same
    instance gets the same copy. Containers are rebuilt; a registered pytree
    node is rebuilt when something under it changed and kept as the same
    object otherwise; everything else is returned as is.
    """
    memo: dict[int, Any] = {}

    def walk(node: Any, prefix: str) -> Any:
        if is_target(node):
            return replace(node, path_name(prefix))
        t = type(node)
        if t in _STATEFUL_CLASSES:
            seen = memo.get(id(node))
            if seen is not None:
                return seen
            new = object.__new__(t)
            memo[id(node)] = new
            nd = new.__dict__
            for k, v in node.__dict__.items():
                nd[k] = walk(v, prefix + attr_name(k))
            after_copy = _STATEFUL_CLASSES[t]
            if after_copy is not None:
                after_copy(new)
            return new
        if t is list:
            return [walk(v, prefix + index_name(i)) for i, v in enumerate(node)]
        if t is tuple:
            return tuple(walk(v, prefix + index_name(i)) for i, v in enumerate(node))
        if t is dict:
            return {k: walk(v, prefix + mapping_name(k)) for k, v in node.items()}
        if t in _CALLABLES:
            held = _held_instances(node)
            if held is not None:
                # ``self.act = self._gelu``: bound to the copies, as flatten_graph rebinds.
                copies = [None if h is None else walk(h, prefix + ".__self__") for h in held]
                indices = [-1 if h is None else k for k, h in enumerate(held)]
                return _bound_ref(node, indices).rebind(copies)
        if t in _STATIC_TYPES or isinstance(node, (jax.Array, np.ndarray, np.generic)):
            return node
        custom = _WALK_CHILDREN.get(t)
        if custom is not None:
            kids = custom[0](node)
            rebuilt = [walk(child, prefix + sub) for sub, child in kids]
            if all(new is old for new, (_, old) in zip(rebuilt, kids)):
                return node
            return custom[1](node, rebuilt)
        children, treedef = _flatten_one_level(node)
        if treedef is None:
            return node
        new_children = [walk(child, prefix + sub) for sub, child in children]
        # An untouched registered node (a request of another category, another
        # handler's ref) is kept as the same object, not an equal rebuild.
        if all(new is old for new, (_, old) in zip(new_children, children)):
            return node
        return jax.tree_util.tree_unflatten(treedef, new_children)

    # The walk allocates a copy and a dict per instance and a request or ref
    # per state; with the collector on, a large model triggers a full
    # collection mid-walk that scans the whole process and costs more than the
    # walk (benchmarks/bench_scaling.py, table 3b). Cycles made here are found
    # by the next collection; a collector that was off stays off.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return walk(tree, "")
    finally:
        if was_enabled:
            gc.enable()


def iter_tree(tree: Any, is_target: Callable[[Any], bool]) -> Iterator[tuple[str, Any]]:
    """Yields ``(path_name, node)`` for every target, copying nothing.

    The walk of ``map_tree`` without the rebuild: each decorated instance is
    visited once (by its first path), targets are not descended into.
    """
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = [("", tree)]
    while stack:
        prefix, node = stack.pop()
        if is_target(node):
            yield path_name(prefix), node
            continue
        t = type(node)
        if t in _STATEFUL_CLASSES:
            if id(node) in seen:
                continue
            seen.add(id(node))
            children = [(prefix + attr_name(k), v) for k, v in node.__dict__.items()]
        elif t is list or t is tuple:
            children = [(prefix + index_name(i), v) for i, v in enumerate(node)]
        elif t is dict:
            children = [(prefix + mapping_name(k), v) for k, v in node.items()]
        elif t in _CALLABLES and (held := _held_instances(node)) is not None:
            # A method of, or a closure over, an instance: map_tree's path to it.
            children = [(prefix + ".__self__", h) for h in held if h is not None]
        elif t in _STATIC_TYPES or isinstance(node, (jax.Array, np.ndarray, np.generic)):
            continue
        elif t in _WALK_CHILDREN:
            children = [(prefix + sub, child) for sub, child in _WALK_CHILDREN[t][0](node)]
        else:
            flat, treedef = _flatten_one_level(node)
            if treedef is None:
                continue
            children = [(prefix + sub, child) for sub, child in flat]
        stack.extend(reversed(children))


# What may be bound to an instance of the model (see _BoundRef).
_CALLABLES = (types.MethodType, types.FunctionType, weakref.ReferenceType, weakref.WeakMethod)


def holds_instance(value: Any) -> bool:
    """Whether ``value`` is, or contains, a decorated instance (a sub-model) or
    a method bound to one (``self._eval``)."""
    t = type(value)
    if t in _STATEFUL_CLASSES:
        return True
    if t in _CALLABLES:
        return _held_instances(value) is not None
    if t in _STATIC_TYPES or t in _ARRAY_TYPES:
        return False
    if learn_array_type(value):
        return False
    return next(iter_tree(value, _instance_or_bound), None) is not None


def learn_array_type(value: Any) -> bool:
    """Whether ``value`` is an array (a tracer is one); its type is then
    remembered in ``ARRAY_TYPES``, since being an array is the type's: hot
    loops test the set instead (most of a traced state write, once)."""
    if isinstance(value, (jax.Array, np.ndarray, np.generic)):
        _ARRAY_TYPES.add(type(value))
        return True
    return False


# Types found to be arrays by holds_instance (concrete arrays, tracers, numpy).
_ARRAY_TYPES: set[type] = set()
# The same sets under names other modules read in their hot loops.
ARRAY_TYPES = _ARRAY_TYPES
STATEFUL_CLASSES = _STATEFUL_CLASSES


def _instance_or_bound(value: Any) -> bool:
    t = type(value)
    if t in _STATEFUL_CLASSES:
        return True
    if t in _INDIRECT:
        return any(holds_instance(v) for _, v in _INDIRECT[t](value))
    return _bound_to_instance(value)


def _frame_locals(attribute: str) -> Callable[[Any], list[tuple[str, Any]]]:
    def parts(value: Any) -> list[tuple[str, Any]]:
        frame = getattr(value, attribute)  # (None once finished: it holds nothing)
        return [] if frame is None else [(f" (its local {k!r})", v) for k, v in frame.f_locals.items()]

    return parts


def _partial_parts(p: Any) -> list[tuple[str, Any]]:
    return [
        (".func", p.func),
        *((f".args[{i}]", a) for i, a in enumerate(p.args)),
        *((f".keywords[{k!r}]", a) for k, a in p.keywords.items()),
    ]


def _lazy_parts(m: Any) -> list[tuple[str, Any]]:
    return [(" (its function)" if i == 0 else " (its iterable)", v)
            for i, v in enumerate(m.__reduce__()[1])]


# What reaches a model through another object JAX takes as one leaf, which
# f's copy cannot be rebound through: a ``functools.partial`` of a method, a
# generator a method made (its frame holds ``self``), a lazy ``map`` /
# ``filter`` over a method. Type -> what it holds, each with where (a path
# suffix for messages).
_INDIRECT: dict[type, Callable[[Any], list[tuple[str, Any]]]] = {
    functools.partial: _partial_parts,
    types.GeneratorType: _frame_locals("gi_frame"),
    types.CoroutineType: _frame_locals("cr_frame"),
    types.AsyncGeneratorType: _frame_locals("ag_frame"),
    map: _lazy_parts,
    filter: _lazy_parts,
}


def held_parts(value: Any) -> list[tuple[str, Any]] | None:
    """``(where, value)`` for what a ``functools.partial`` (or a subclass), a
    suspended generator or coroutine, or a lazy ``map`` / ``filter`` holds;
    None for anything else."""
    how = _INDIRECT.get(type(value))
    if how is None and isinstance(value, functools.partial):
        how = _partial_parts
    return None if how is None else how(value)


def instances_of(tree: Any) -> list[Any]:
    """Every decorated instance reachable in ``tree``, once each."""
    found: list[Any] = []

    def record(node: Any) -> bool:
        if type(node) in _STATEFUL_CLASSES:
            found.append(node)
        return False

    for _ in iter_tree(tree, record):
        pass
    return found


def instance_ids(tree: Any) -> frozenset[int]:
    """Ids of every decorated instance reachable in ``tree``."""
    return frozenset(map(id, instances_of(tree)))


# --- graph flatten ----------------------------------------------------------


class GraphDef:
    """Static structure of a model graph: which instance holds what, and where.

    Hashing walks the nested treedefs, so the hash is computed once; equality
    checks identity first because ``jax.jit`` compares the same object on
    every call of a step.
    """

    __slots__ = ("instances", "root", "names", "keys", "_hash", "cache")

    def __init__(self, instances: tuple, root: int, names: tuple[str, ...], keys: tuple = ()):
        self.instances = instances
        self.root = root
        # Path name and keypath of each leaf; derived, so not compared.
        self.names = names
        self.keys = keys
        self._hash = hash((instances, root))
        # What users of the graphdef derive from it once (FunctionalModel's keyed view).
        self.cache: dict[str, Any] = {}

    def __getstate__(self) -> tuple:
        return (self.instances, self.root, self.names, self.keys)

    def __setstate__(self, state: tuple) -> None:
        self.instances, self.root, self.names, self.keys = state
        self._hash = hash((self.instances, self.root))
        self.cache = {}

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, GraphDef):
            return NotImplemented
        return self._hash == other._hash and (self.instances, self.root) == (
            other.instances,
            other.root,
        )

    def __repr__(self) -> str:
        return f"GraphDef({len(self.instances)} instances)"


class _BoundRef:
    """A callable bound to instances of the model, in a graphdef.

    A method bound to a decorated instance (``self.act = self._gelu``), a
    function closing over one (``self.score = lambda x: self.w @ x``) or a
    weak reference to one (``self._parent = weakref.ref(parent)``, or a
    ``weakref.WeakMethod`` of one's method) is kept
    as its function and the graph indices of those instances, so the rebuilt
    model's one reads and writes the rebuilt instances, never the original
    ones. Equal for the same code bound to the same places.
    """

    __slots__ = ("func", "index", "kind")

    def __init__(self, func: Any, index: tuple[int, ...], kind: str):
        # A method's function (a weak method's too), the closure itself (its
        # other cells kept), or None for a weak reference.
        self.func = func
        # Per instance held: a method's one, or a closure's per cell (-1: none).
        self.index = index
        self.kind = kind  # "method", "closure", "weakref" or "weakmethod"

    def rebind(self, objs: list[Any]) -> Any:
        func = self.func
        if self.kind == "method":
            return types.MethodType(func, objs[self.index[0]])
        if self.kind == "weakref":
            return weakref.ref(objs[self.index[0]])
        if self.kind == "weakmethod":
            return weakref.WeakMethod(types.MethodType(func, objs[self.index[0]]))
        cells = tuple(
            cell if i < 0 else types.CellType(objs[i])
            for cell, i in zip(func.__closure__, self.index)
        )
        new = types.FunctionType(
            func.__code__, func.__globals__, func.__name__, func.__defaults__, cells
        )
        new.__kwdefaults__ = func.__kwdefaults__
        new.__qualname__ = func.__qualname__
        new.__dict__.update(func.__dict__)
        return new

    def _key(self) -> tuple:
        func = self.func
        if self.kind == "closure":
            # The code and what its other cells hold, by identity: a rebuilt
            # closure shares those cells, so it compares equal to its template.
            others = tuple(
                id(cell.cell_contents) if i < 0 else None
                for cell, i in zip(func.__closure__, self.index)
            )
            return (func.__code__, id(func.__defaults__), id(func.__kwdefaults__), others)
        return (func,)

    def __eq__(self, other: object) -> bool:
        if type(other) is not _BoundRef:
            return NotImplemented
        if self.index != other.index or self.kind != other.kind:
            return False
        if self.func is other.func:
            return True
        try:
            return bool(self._key() == other._key())
        except Exception:
            return False

    def __hash__(self) -> int:
        try:
            return hash((self._key(), self.index))
        except TypeError:
            return hash(self.index)


def _held_instances(value: Any) -> list[Any] | None:
    """The decorated instances a method, closure or weak reference is bound to
    (None: not one).

    A method: its ``__self__``; a weak reference: its referent; a closure:
    each cell's value (``None`` in the place of a cell holding no instance).
    """
    t = type(value)
    if t is types.MethodType:
        return [value.__self__] if type(value.__self__) in _STATEFUL_CLASSES else None
    if t is weakref.ReferenceType:
        target = value()
        return [target] if type(target) in _STATEFUL_CLASSES else None
    if t is weakref.WeakMethod:
        method = value()
        target = getattr(method, "__self__", None)
        return [target] if type(target) in _STATEFUL_CLASSES else None
    if t is types.FunctionType and value.__closure__ is not None:
        held = []
        for cell in value.__closure__:
            try:
                content = cell.cell_contents
            except ValueError:  # an empty cell
                content = None
            held.append(content if type(content) in _STATEFUL_CLASSES else None)
        return held if any(h is not None for h in held) else None
    return None


def _bound_to_instance(value: Any) -> bool:
    """Whether ``value`` is a method of, or a closure over, a decorated instance."""
    return _held_instances(value) is not None


def _bound_ref(value: Any, indices: list[int]) -> _BoundRef:
    """The graphdef entry of ``value``, given its held instances' graph indices."""
    if type(value) is types.MethodType:
        return _BoundRef(value.__func__, (indices[0],), "method")
    if type(value) is weakref.ReferenceType:
        return _BoundRef(None, (indices[0],), "weakref")
    if type(value) is weakref.WeakMethod:
        method: Any = value()  # alive: it was found bound to an instance
        return _BoundRef(method.__func__, (indices[0],), "weakmethod")
    return _BoundRef(value, tuple(indices), "closure")


def _same_function(value: Any, ref: _BoundRef) -> bool:
    if ref.kind == "method":
        return type(value) is types.MethodType and (
            value.__func__ is ref.func or value.__func__ == ref.func
        )
    if ref.kind == "weakref":
        return type(value) is weakref.ReferenceType
    if ref.kind == "weakmethod":
        method = value() if type(value) is weakref.WeakMethod else None
        return method is not None and (method.__func__ is ref.func or method.__func__ == ref.func)
    func = ref.func
    if type(value) is not types.FunctionType or type(func) is not types.FunctionType:
        return False
    if value is func:
        return True
    return (
        value.__code__ is func.__code__
        and value.__defaults__ is func.__defaults__
        and value.__kwdefaults__ is func.__kwdefaults__
        and value.__closure__ is not None
        and func.__closure__ is not None
        and all(
            i >= 0 or a is b or a.cell_contents is b.cell_contents
            for a, b, i in zip(value.__closure__, func.__closure__, ref.index)
        )
    )


def _graph_leaf(x: Any) -> bool:
    return type(x) in _STATEFUL_CLASSES or is_static_leaf(x)


def flatten_graph(root: Any) -> tuple[list[Any], GraphDef]:
    """Flattens a model graph with each instance once: ``(leaves, graphdef)``.

    Unlike the per-instance pytree registration, an instance (or an array)
    reachable from two paths contributes its leaves once (named by its first
    path), so tied weights stay tied through ``jax.jit`` and get one summed
    gradient. The leaves are arrays only: every other value (a python scalar
    in a list, a function or a string inside a foreign pytree node) is
    static, in the graphdef. ``graphdef.keys`` holds each leaf's keypath from
    the root.
    """
    leaves: list[Any] = []
    names: list[str] = []
    keys: list[tuple] = []
    index: dict[int, int] = {}
    instances: list[Any] = []
    attr_key = jax.tree_util.GetAttrKey
    statics: dict[int, Any] = {}  # copy_static's memo: one copy per container
    arrays: dict[int, int] = {}  # id of an array leaf -> its index in leaves

    def visit(obj: Any, prefix: str, prefix_keys: tuple) -> int:
        seen = index.get(id(obj))
        if seen is not None:
            return seen
        i = len(instances)
        index[id(obj)] = i
        instances.append(None)
        entries: list[Any] = []
        for name, value in obj.__dict__.items():
            canonical = _CANONICAL.get(type(value))
            if canonical is not None:
                value = canonical(value)
            if not is_dynamic(value):
                held = _held_instances(value) if type(value) in _CALLABLES else None
                if held is not None:
                    here = prefix + attr_name(name) + ".__self__"
                    here_keys = (*prefix_keys, attr_key(name))
                    indices = [-1 if h is None else visit(h, here, here_keys) for h in held]
                    entries.append((name, None, _bound_ref(value, indices)))
                else:
                    entries.append((name, None, _Static(copy_static(value, statics))))
                continue
            flat, treedef = jax.tree_util.tree_flatten_with_path(value, is_leaf=_graph_leaf)
            parts: list[Any] = []
            here = prefix + attr_name(name)
            here_keys = (*prefix_keys, attr_key(name))
            for path, leaf in flat:
                sub = here + "".join(key_name(k) for k in path)
                if type(leaf) in _STATEFUL_CLASSES:
                    parts.append(-1 - visit(leaf, sub, (*here_keys, *path)))
                elif is_array_leaf(leaf):
                    # One array in two places (``self.head.w = self.embed.w``)
                    # is one leaf, as a shared sub-model is.
                    at = arrays.get(id(leaf))
                    if at is None:
                        at = arrays[id(leaf)] = len(leaves)
                        leaves.append(leaf)
                        names.append(path_name(sub))
                        keys.append((*here_keys, *path))
                    parts.append(at)
                elif type(leaf) in _CALLABLES and (held := _held_instances(leaf)) is not None:
                    where, where_keys = f"{sub}.__self__", (*here_keys, *path)
                    indices = [-1 if h is None else visit(h, where, where_keys) for h in held]
                    parts.append(_bound_ref(leaf, indices))
                else:
                    parts.append(_Static(copy_static(leaf, statics)))
            entries.append((name, treedef, tuple(parts)))
        instances[i] = (type(obj), tuple(entries))
        return i

    root_index = visit(root, "", ())
    return leaves, GraphDef(tuple(instances), root_index, tuple(names), tuple(keys))


def unflatten_graph(graphdef: GraphDef, leaves: list[Any]) -> Any:
    """Rebuilds the model graph of ``flatten_graph`` around new leaves."""
    return rebuild_instances(graphdef, leaves)[graphdef.root]


# How rebuild_instances fills one attribute (see _rebuild_plan).
_LEAF, _SHARED, _STATIC, _STATIC_COPY, _BOUND, _GENERAL = range(6)


def _rebuild_plan(graphdef: GraphDef) -> list[tuple[type, tuple]]:
    """Per instance of ``graphdef``: its class and, per attribute, ``(name, how, what)``.

    Derived once per graphdef, so that a rebuild (one per trace of ``f``)
    unflattens only what needs it: an attribute that is one leaf takes the
    leaf, and a handled slot is one object made once (``_IMMUTABLE_NODES``),
    which also lets ``graph_unchanged`` compare it by identity.
    """
    plan = graphdef.cache.get("rebuild")
    if plan is None:
        plan = []
        for cls, entries in graphdef.instances:
            steps: list[tuple[str, int, Any]] = []
            for name, treedef, parts in entries:
                if treedef is None:
                    if type(parts) is _BoundRef:
                        steps.append((name, _BOUND, parts))
                    else:
                        how = _STATIC_COPY if is_mutable_static(parts.value) else _STATIC
                        steps.append((name, how, parts.value))
                elif not parts and type(shared := treedef.unflatten([])) in _IMMUTABLE_NODES:
                    steps.append((name, _SHARED, shared))
                elif (
                    len(parts) == 1
                    and type(parts[0]) is int
                    and parts[0] >= 0
                    and treedef.num_nodes == 1
                    and treedef.num_leaves == 1
                ):
                    steps.append((name, _LEAF, parts[0]))
                else:
                    steps.append((name, _GENERAL, (treedef, parts)))
            plan.append((cls, tuple(steps)))
        graphdef.cache["rebuild"] = plan
    return plan


def rebuild_instances(graphdef: GraphDef, leaves: list[Any]) -> list[Any]:
    """``unflatten_graph``, giving every instance of the graph (in graphdef order)."""
    plan = _rebuild_plan(graphdef)
    objs: list[Any] = [object.__new__(cls) for cls, _ in plan]
    statics: dict[int, Any] = {}  # this model's own copies of static containers
    for obj, (_, steps) in zip(objs, plan):
        d = obj.__dict__
        for name, how, what in steps:
            if how == _LEAF:
                d[name] = leaves[what]
            elif how == _SHARED or how == _STATIC:
                d[name] = what
            elif how == _STATIC_COPY:
                d[name] = copy_static(what, statics)
            elif how == _BOUND:
                d[name] = what.rebind(objs)
            else:
                treedef, parts = what
                d[name] = treedef.unflatten(
                    [
                        (objs[-1 - p] if p < 0 else leaves[p])
                        if type(p) is int
                        else p.rebind(objs)
                        if type(p) is _BoundRef
                        else copy_static(p.value, statics)
                        for p in parts
                    ]
                )
    return objs


def graph_unchanged(root: Any, leaves: list[Any], graphdef: GraphDef) -> bool:
    """Whether ``flatten_graph(root)`` would give ``graphdef`` and exactly ``leaves``.

    The check a traced call runs on every trace, so it builds no path names
    (``flatten_graph`` builds them, for the message, only when this says no):
    it walks the graph in ``flatten_graph``'s order and compares each leaf by
    identity, flattening an attribute only when its value is not the very
    leaf it held.
    """
    instances = graphdef.instances
    plan = _rebuild_plan(graphdef)
    index: dict[int, int] = {}

    def same(obj: Any) -> bool:
        i = index[id(obj)] = len(index)
        cls, entries = instances[i]
        d = obj.__dict__
        if type(obj) is not cls or len(d) != len(entries):
            return False
        for (name, value), (expected, treedef, parts), (_, how, what) in zip(
            d.items(), entries, plan[i][1]
        ):
            if name != expected:
                return False
            if how == _SHARED and value is what:
                continue  # the handled slot the rebuild put there
            canonical = _CANONICAL.get(type(value))
            if canonical is not None:
                value = canonical(value)
            if treedef is None:
                if type(parts) is _BoundRef:
                    if not _same_instance(value, parts):
                        return False
                    continue
                if is_dynamic(value) or not (value is parts.value or _Static(value) == parts):
                    return False
                continue
            if (
                len(parts) == 1
                and type(parts[0]) is int
                and parts[0] >= 0
                and value is leaves[parts[0]]
            ):
                continue
            flat, new_def = jax.tree_util.tree_flatten(value, is_leaf=_graph_leaf)
            if new_def != treedef or len(flat) != len(parts):
                return False
            for leaf, p in zip(flat, parts):
                if type(p) is _BoundRef:
                    if not _same_instance(leaf, p):
                        return False
                elif type(p) is _Static:
                    # A python value inside a container: structure, compared by value.
                    if type(leaf) in _STATEFUL_CLASSES or is_array_leaf(leaf):
                        return False
                    if not (leaf is p.value or _Static(leaf) == p):
                        return False
                elif type(leaf) in _STATEFUL_CLASSES:
                    seen = index.get(id(leaf))
                    if p >= 0 or (seen if seen is not None else len(index)) != -1 - p:
                        return False
                    if seen is None and not same(leaf):
                        return False
                elif p < 0 or leaf is not leaves[p]:
                    return False
        return True

    def _same_instance(value: Any, ref: _BoundRef) -> bool:
        """A method or closure in the place of ``ref``: its code, its instances' indices."""
        held = _held_instances(value) if _same_function(value, ref) else None
        if held is None or len(held) != len(ref.index):
            return False
        for instance, expected in zip(held, ref.index):
            if (instance is None) != (expected < 0):
                return False
            if instance is None:
                continue
            seen = index.get(id(instance))
            if seen is None:
                if len(index) != expected or not same(instance):
                    return False
            elif seen != expected:
                return False
        return True

    return same(root) and len(index) == len(instances) and graphdef.root == 0
