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

import gc
import types
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

# decorated class -> what to do with each copy map_tree makes of an instance
# (None: nothing). Kept here, not on the class, so membership is one lookup.
_STATEFUL_CLASSES: dict[type, Callable[[Any], None] | None] = {}
_DYNAMIC_TYPES: set[type] = set()

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


def register_dynamic_type(cls: type) -> None:
    """Marks ``cls`` (a pytree node with static-only fields) as a model child."""
    _DYNAMIC_TYPES.add(cls)


def is_dynamic(value: Any) -> bool:
    """Whether an attribute value is a pytree child (else it is static aux data)."""
    t = type(value)
    if t in _STATIC_TYPES:
        return False
    if t in _STATEFUL_CLASSES or t in _DYNAMIC_TYPES:
        return True
    if isinstance(value, (jax.Array, np.ndarray, np.generic)):
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
    """Hashable wrapper for a static attribute value kept in pytree aux data.

    Used so that unhashable python values (lists of ints, dicts of config)
    can sit in aux data: equality is the value's own ``==``; the hash falls
    back to the type when the value is unhashable.
    """

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Static):
            return NotImplemented
        if self.value is other.value:
            return True
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


def _flatten_instance(obj: Any):
    aux = []
    children = []
    for name, value in obj.__dict__.items():
        if is_dynamic(value):
            aux.append(name)
            children.append(value)
        else:
            aux.append((name, _Static(value)))
    return children, tuple(aux)


def _flatten_instance_with_keys(obj: Any):
    children, aux = _flatten_instance(obj)
    keys = [jax.tree_util.GetAttrKey(entry) for entry in aux if type(entry) is str]
    return list(zip(keys, children)), aux


def _make_unflatten(cls: type) -> Callable[[tuple, Any], Any]:
    new = object.__new__

    def unflatten(aux: tuple, children) -> Any:
        obj = new(cls)
        d = obj.__dict__
        it = iter(children)
        for entry in aux:
            if type(entry) is str:
                d[entry] = next(it)
            else:
                d[entry[0]] = entry[1].value
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
        if t in _STATIC_TYPES or isinstance(node, (jax.Array, np.ndarray, np.generic)):
            return node
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
        elif t in _STATIC_TYPES or isinstance(node, (jax.Array, np.ndarray, np.generic)):
            continue
        else:
            flat, treedef = _flatten_one_level(node)
            if treedef is None:
                continue
            children = [(prefix + sub, child) for sub, child in flat]
        stack.extend(reversed(children))


# --- graph flatten ----------------------------------------------------------


class GraphDef:
    """Static structure of a model graph: which instance holds what, and where.

    Hashing walks the nested treedefs, so the hash is computed once; equality
    checks identity first because ``jax.jit`` compares the same object on
    every call of a step.
    """

    __slots__ = ("instances", "root", "names", "_hash")

    def __init__(self, instances: tuple, root: int, names: tuple[str, ...]):
        self.instances = instances
        self.root = root
        self.names = names  # path name of each leaf; derived, so not compared
        self._hash = hash((instances, root))

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


def flatten_graph(root: Any) -> tuple[list[Any], GraphDef]:
    """Flattens a model graph with each instance once: ``(leaves, graphdef)``.

    Unlike the per-instance pytree registration, an instance reachable from
    two paths contributes its leaves once (named by its first path), so tied
    weights stay tied through ``jax.jit`` and get one summed gradient.
    """
    leaves: list[Any] = []
    names: list[str] = []
    index: dict[int, int] = {}
    instances: list[Any] = []

    def visit(obj: Any, prefix: str) -> int:
        seen = index.get(id(obj))
        if seen is not None:
            return seen
        i = len(instances)
        index[id(obj)] = i
        instances.append(None)
        entries = []
        for name, value in obj.__dict__.items():
            if not is_dynamic(value):
                entries.append((name, None, _Static(value)))
                continue
            flat, treedef = jax.tree_util.tree_flatten_with_path(value, is_leaf=is_stateful_instance)
            parts = []
            for path, leaf in flat:
                sub = prefix + attr_name(name) + "".join(key_name(k) for k in path)
                if type(leaf) in _STATEFUL_CLASSES:
                    parts.append(-1 - visit(leaf, sub))
                else:
                    parts.append(len(leaves))
                    leaves.append(leaf)
                    names.append(path_name(sub))
            entries.append((name, treedef, tuple(parts)))
        instances[i] = (type(obj), tuple(entries))
        return i

    root_index = visit(root, "")
    return leaves, GraphDef(tuple(instances), root_index, tuple(names))


def unflatten_graph(graphdef: GraphDef, leaves: list[Any]) -> Any:
    """Rebuilds the model graph of ``flatten_graph`` around new leaves."""
    objs = [object.__new__(cls) for cls, _ in graphdef.instances]
    for obj, (_, entries) in zip(objs, graphdef.instances):
        d = obj.__dict__
        for name, treedef, parts in entries:
            if treedef is None:
                d[name] = parts.value
            else:
                d[name] = treedef.unflatten(
                    [objs[-1 - p] if p < 0 else leaves[p] for p in parts]
                )
    return objs[graphdef.root]


def graph_unchanged(root: Any, leaves: list[Any], graphdef: GraphDef) -> bool:
    """Whether ``flatten_graph(root)`` would give ``graphdef`` and exactly ``leaves``.

    The check a traced call runs on every trace, so it builds no path names
    (``flatten_graph`` builds them, for the message, only when this says no):
    it walks the graph in ``flatten_graph``'s order and compares each leaf by
    identity, flattening an attribute only when its value is not the very
    leaf it held.
    """
    instances = graphdef.instances
    index: dict[int, int] = {}

    def same(obj: Any) -> bool:
        i = index[id(obj)] = len(index)
        cls, entries = instances[i]
        d = obj.__dict__
        if type(obj) is not cls or len(d) != len(entries):
            return False
        for (name, value), (expected, treedef, parts) in zip(d.items(), entries):
            if name != expected:
                return False
            if treedef is None:
                if is_dynamic(value) or not (value is parts.value or _Static(value) == parts):
                    return False
                continue
            if len(parts) == 1 and parts[0] >= 0 and value is leaves[parts[0]]:
                continue
            flat, new_def = jax.tree_util.tree_flatten(value, is_leaf=is_stateful_instance)
            if new_def != treedef or len(flat) != len(parts):
                return False
            for leaf, p in zip(flat, parts):
                if type(leaf) in _STATEFUL_CLASSES:
                    seen = index.get(id(leaf))
                    if p >= 0 or (seen if seen is not None else len(index)) != -1 - p:
                        return False
                    if seen is None and not same(leaf):
                        return False
                elif p < 0 or leaf is not leaves[p]:
                    return False
        return True

    return same(root) and len(index) == len(instances) and graphdef.root == 0
