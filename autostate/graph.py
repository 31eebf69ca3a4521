"""The model graph: the one node-kind registry and the one walk.

A model is a graph: decorated instances hold arrays, static values, request
objects, other instances (directly or in lists, tuples, dicts and foreign
pytree nodes) and callables bound to instances (``self.act = self._gelu``).
This module owns how that graph is seen, in two parts.

* **The registry.** Every node type the walks treat specially is described
  by one ``NodeKind`` record: which children the walk descends into and how
  each child's path is named (``.w``, ``[0]``, ``['k']``), how the node is
  rebuilt around new children, whether a value of the type is a pytree child
  of a decorated instance, the form the flatten and the change check see it
  in, and how the slot of a running call flattens. A type is registered once
  (``register_node_kind``; a second registration is an error) and looked up
  by ``node_kind``. Builtin containers and callables are registered here;
  decorated classes by ``register_stateful_class``; the engine and the
  runtime register their slot types.
* **The walk.** ``map_tree`` (rebuild) and ``iter_tree`` (find) visit any
  pytree through the registry, falling back to JAX's own one-level flatten
  for other registered pytree nodes. A decorated instance is visited once,
  by identity, so one instance reachable from two paths stays one instance
  (aliasing follows Python) and is named by its first path. ``instances``,
  ``instances_of`` and ``holds_instance`` are built on it.
  ``flatten_graph`` / ``unflatten_graph`` turn a model into
  ``(leaves, GraphDef)`` and back, and ``graph_unchanged``, defined next to
  the flatten as its declared mirror, says whether a flatten would give the
  same graphdef and the very same leaves, without building names. The
  per-instance pytree registration of decorated classes (how ``jax.jit``
  and ``jax.tree.map`` see one instance) is here too.

It knows nothing of the effect engine or of source code: the kinds of
values (arrays, static scalars, containers) come from ``autostate.tree``.

Example:
    >>> from autostate import graph
    >>> graph.node_kind(list).children([1, 2])
    [('[0]', 1), ('[1]', 2)]
    >>> [name for name, _ in graph.iter_tree({"a": [1, (2, 3)]}, lambda x: type(x) is int)]
    ["['a'][0]", "['a'][1][0]", "['a'][1][1]"]
"""

from __future__ import annotations

import contextlib
import dataclasses
import dis
import functools
import gc
import itertools
import operator
import sys
import types
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax

from autostate import values as _values
from autostate.errors import InvalidArgumentError, InvalidTypeError, format_error, user_location
from autostate.tree import INFO_ATTR, StaticLeaf
from autostate.values import copy_static, is_array_or_spec, is_mutable_static, kind_of

# --- the registry -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NodeKind:
    """How the walks, the flatten and the change check see one node type.

    One record per type; every field but ``type`` is optional: a kind says
    only what differs from a plain value.

    Attributes:
        type: the node type (exactly: a subclass is a kind of its own).
        children: ``node -> [(path suffix, child)]``: what the walk descends
            into, each child with its path suffix (``.w``, ``[0]``,
            ``['k']``, ``.__self__``). ``None``: the walk treats the node as
            JAX flattens it (one level of its pytree registration).
        rebuild: ``(node, new children) -> node``: ``node`` around new
            children, in ``children``'s order (``map_tree``).
        copied: the walk's copy of such a node is always a new object, even
            when no child changed (a list: a copy never shares it).
        by_identity: visited once per object (a decorated instance): the
            walk's copy is ``empty(node)``, remembered before its children
            are walked (cycles, aliasing), then ``fill(copy, node, children)``.
        empty: see ``by_identity``.
        fill: see ``by_identity``.
        model_child: a value of this type in a decorated instance's
            attribute is a pytree child of the instance (else static aux data).
        canonical: ``value -> value``: the form in which the flatten and
            the change check see an attribute value (a fresh state is
            flattened as it will be after its first write).
        shared: frozen and childless: one object per graphdef entry serves
            every model rebuilt from it, and the change check compares it by
            identity.
        running: ``(split, join)`` for a slot of a running call: JAX's
            flatten of an instance gives the state's current value as a
            leaf. ``split(slot)`` is ``(value, key)``, or ``None`` when not
            running (the slot is then flattened as usual); ``join(key,
            value)`` is the rebuilt copy's slot.
        held: ``value -> [(where, value)]``: what an object JAX takes as one
            leaf holds (a ``functools.partial``'s function and arguments, a
            generator's frame locals), for ``holds_instance``.
        after_copy: a decorated class's hook, run on every copy ``map_tree``
            makes of an instance once its attributes are in place.
        witnessed: ``value -> held``: how ``Witness`` sees a value that may
            change in place (a state slot): what it holds now, compared by
            identity and looked into.
        immutable: ``Witness`` takes such a value as it is: it never changes
            in place, and what it holds is witnessed apart.
        stacked: ``node -> model``: the node is a stack of layers held as one
            stacked model; in a mapped argument (``lax.scan``'s ``xs``,
            ``lax.map``'s, a ``jax.vmap`` argument) it is that model, so each
            step or example gets one layer; a ``for`` loop over it is rolled.
        must_roll: ``node -> bool``: whether a loop over such a stack that
            cannot be rolled into one scan is an error.
        reached: ``node -> [object]``: what code that holds the node reaches
            through it, the step of ``reachable_instances``' walk (a list's
            items, a function's cells and defaults, a method's instance and
            function, an instance's attributes, a layer's state slot: the
            stacked model it reads; a stack: its stacked model). ``None``:
            code reaches nothing through it.
        own_value: a state slot holding its own value: the eager states a
            ``lax`` body reaches in it are threaded through the body.
        from_leaves: ``(aux, leaves) -> node``: the node made straight from
            its leaves (in JAX's flatten order) and its node data, without
            the subtree its flatten gives (a ``FunctionalModel``, whose view
            is made when asked): a rebuild of an attribute holding one makes
            none of that subtree's nodes.
    """

    type: type
    children: Callable[[Any], list[tuple[str, Any]]] | None = None
    rebuild: Callable[[Any, list[Any]], Any] | None = None
    copied: bool = False
    by_identity: bool = False
    empty: Callable[[Any], Any] | None = None
    fill: Callable[[Any, Any, list[Any]], None] | None = None
    model_child: bool = False
    canonical: Callable[[Any], Any] | None = None
    shared: bool = False
    running: tuple[Callable[[Any], Any], Callable[[Any, Any], Any]] | None = None
    held: Callable[[Any], list[tuple[str, Any]]] | None = None
    after_copy: Callable[[Any], None] | None = None
    witnessed: Callable[[Any], Any] | None = None
    immutable: bool = False
    stacked: Callable[[Any], Any] | None = None
    must_roll: Callable[[Any], bool] | None = None
    reached: Callable[[Any], list[Any]] | None = None
    own_value: bool = False
    from_leaves: Callable[[Any, list[Any]], Any] | None = None


_KINDS: dict[type, NodeKind] = {}

# Views of ``_KINDS`` by field, for the hot loops of the flatten and the change
# check (one set or dict lookup per attribute). Only ``_install`` writes them.
STATEFUL_CLASSES: dict[type, Callable[[Any], None] | None] = {}  # decorated class -> after_copy
_MODEL_CHILD: set[type] = set()
_CANONICAL: dict[type, Callable[[Any], Any]] = {}
_SHARED_NODES: set[type] = set()
_RUNNING: dict[type, tuple[Callable[[Any], Any], Callable[[Any, Any], Any]]] = {}
_HELD: dict[type, Callable[[Any], list[tuple[str, Any]]]] = {}
# ``Witness``'s: how to read what a value holds, or ``None`` for an immutable one.
_WITNESSED: dict[type, Callable[[Any], Any] | None] = {}
# The transformations' and loop rolling's: a stack's stacked model, whether a
# loop over it must roll, what code reaching a node reaches, and the slots
# that hold their own value.
STACKS: dict[type, Callable[[Any], Any]] = {}
MUST_ROLL: dict[type, Callable[[Any], bool]] = {}
OWN_VALUE_SLOTS: set[type] = set()
# ``reachable_instances``': per type, its ``reached`` step and what a node of
# it is there (``_REACHED_ONLY``, ``_REACHED_INSTANCE``, ``_REACHED_CONTAINER``).
_REACHED: dict[type, tuple[Callable[[Any], Iterable[Any]], int]] = {}
_REACHED_ONLY, _REACHED_INSTANCE, _REACHED_CONTAINER = range(3)
# The rebuild's: the kinds made straight from their leaves.
_FROM_LEAVES: dict[type, Callable[[Any, list[Any]], Any]] = {}


def node_kind(cls: type) -> NodeKind | None:
    """The registered kind of ``cls`` (exactly that type), or ``None``.

    Example:
        >>> from autostate import graph
        >>> graph.node_kind(dict).children({"k": 1})
        [("['k']", 1)]
        >>> graph.node_kind(int) is None
        True
    """
    return _KINDS.get(cls)


def register_node_kind(cls: type, **fields: Any) -> NodeKind:
    """Registers how the walks see ``cls`` nodes (the fields of ``NodeKind``).

    Args:
        cls: the node type.
        **fields: ``NodeKind``'s fields other than ``type``.

    Returns:
        The new record.

    Raises:
        InvalidArgumentError: ``cls`` is registered already (one record per type).

    Example:
        >>> from autostate import graph
        >>> class Holder:
        ...     def __init__(self, item):
        ...         self.item = item
        >>> kind = graph.register_node_kind(
        ...     Holder,
        ...     children=lambda h: [(".item", h.item)],
        ...     rebuild=lambda h, new: Holder(new[0]),
        ... )
        >>> graph.map_tree(Holder(1), lambda x, name: name, lambda x: x == 1).item
        'item'
        >>> graph.register_node_kind(Holder)
        Traceback (most recent call last):
        ...
        autostate.errors.InvalidArgumentError: Holder is registered as a node kind already...
    """
    if cls in _KINDS:
        raise InvalidArgumentError(
            format_error(
                f"{cls.__name__} is registered as a node kind already: a type has one record.",
                where=None,
                fix="register every field of the type's kind in one register_node_kind call.",
            )
        )
    kind = NodeKind(cls, **fields)
    _install(kind)
    return kind


def _install(kind: NodeKind) -> None:
    """Puts ``kind`` in the registry and its fields in the views."""
    cls = kind.type
    _KINDS[cls] = kind
    if kind.by_identity:
        STATEFUL_CLASSES[cls] = kind.after_copy
    if kind.model_child:
        _MODEL_CHILD.add(cls)
    if kind.canonical is not None:
        _CANONICAL[cls] = kind.canonical
    if kind.shared:
        _SHARED_NODES.add(cls)
    if kind.running is not None:
        _RUNNING[cls] = kind.running
    if kind.held is not None:
        _HELD[cls] = kind.held
    if kind.witnessed is not None or kind.immutable:
        _WITNESSED[cls] = kind.witnessed
    reached = kind.reached
    if kind.stacked is not None:
        stacked = kind.stacked
        STACKS[cls] = stacked
        MUST_ROLL[cls] = kind.must_roll or (lambda node: False)
        if reached is None:
            reached = lambda node: [stacked(node)]  # noqa: E731
    if reached is not None:
        _REACHED[cls] = (reached, _reached_role(cls, kind.by_identity))
    if kind.own_value:
        OWN_VALUE_SLOTS.add(cls)
    if kind.from_leaves is not None:
        _FROM_LEAVES[cls] = kind.from_leaves


def _reached_role(cls: type, by_identity: bool) -> int:
    """What ``reachable_instances`` takes a ``cls`` node it reaches for: an
    instance, a container a body may change in place (a list or dict, or a
    subclass of one; a tuple subclass too), or neither."""
    if by_identity:
        return _REACHED_INSTANCE
    if cls is not tuple and issubclass(cls, (list, tuple, dict)):
        return _REACHED_CONTAINER
    return _REACHED_ONLY


def is_stateful_instance(value: Any) -> bool:
    """True for instances of ``@stateful`` classes."""
    return type(value) in STATEFUL_CLASSES


# --- path names -----------------------------------------------------------


def attr_name(attr: str) -> str:
    """An attribute as a path suffix: ``.w``."""
    return "." + attr


def index_name(index: int) -> str:
    """A sequence index as a path suffix: ``[0]``."""
    return f"[{index}]"


def mapping_name(key: Any) -> str:
    """A mapping key as a path suffix: ``['k']``."""
    return f"[{key!r}]"


_PASSING: dict[str, jax.tree_util.GetAttrKey] = {}


def passing_key(attr: str) -> jax.tree_util.GetAttrKey:
    """The keypath entry of a node that adds nothing to the names under it.

    A stack (``autostate.stack``) holds one stacked model whose states and
    parameters keep the names they would have in its place: ``blocks.w``,
    not ``blocks.stacked.w``. JAX's flatten of such a node gives its one
    child under this entry: one of JAX's own ``GetAttrKey``, naming the
    attribute that holds the child (``keystr`` reads it as Python, orbax and
    other tree tools take it), made once per ``attr``. The names, and ``f``'s
    keypaths (``graphdef.keys``), skip exactly this object: a
    ``GetAttrKey(attr)`` of anyone else's is an ordinary entry.

    Example:
        >>> key = passing_key("stacked")
        >>> key is passing_key("stacked"), key_name(key), key_name(jax.tree_util.GetAttrKey("stacked"))
        (True, '', '.stacked')
    """
    key = _PASSING.get(attr)
    if key is None:
        key = _PASSING[attr] = jax.tree_util.GetAttrKey(attr)
    return key


def _is_passing(key: Any) -> bool:
    return type(key) is jax.tree_util.GetAttrKey and _PASSING.get(key.name) is key


def _named_keys(path: tuple) -> tuple:
    """``path`` without the entries that add nothing to names (``passing_key``)."""
    if any(map(_is_passing, path)):
        return tuple(k for k in path if not _is_passing(k))
    return path


def key_name(key: Any) -> str:
    """One keypath entry as it appears in a state name (``.a``, ``[0]``, ``['k']``)."""
    if isinstance(key, jax.tree_util.GetAttrKey):
        return "" if _is_passing(key) else attr_name(key.name)
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


# --- what is a child of a model -------------------------------------------------


def is_static_leaf(value: Any) -> bool:
    """A value that would be a pytree leaf but is not an array (``3``, ``"relu"``, a function).

    Such values, wherever they sit in a model (inside lists, dicts or a
    foreign pytree node), are static aux data, never leaves.
    """
    vkind = kind_of(value)
    if vkind is _values.NONE or vkind.array or vkind.spec:
        return False
    if vkind.static:
        return True
    t = type(value)
    if t is list or t is tuple or t is dict or t in _MODEL_CHILD:
        return False
    return jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(value))


def is_model_child(value: Any) -> bool:
    """Whether ``value`` is a node a model holds as a child model (a decorated
    instance, a stack of layers), never a method to call."""
    return type(value) in _MODEL_CHILD


def is_dynamic(value: Any) -> bool:
    """Whether an attribute value is a pytree child (else it is static aux data)."""
    t = type(value)
    vkind = kind_of(value)
    if vkind.static:
        return False
    if t in _MODEL_CHILD:
        return True
    if vkind.array or vkind.spec:
        return True
    if t is list or t is tuple:
        return any(is_dynamic(v) for v in value)
    if t is dict:
        return any(is_dynamic(v) for v in value.values())
    children, treedef = _flatten_one_level(value)
    if treedef is None:
        return False
    return any(is_dynamic(c) for _, c in children)


# Objects with a ``__dict__`` that is not data they hold.
_NOT_HOLDERS = (type, types.ModuleType, types.FunctionType, types.MethodType, functools.partial)


def plain_attributes(value: Any) -> dict[str, Any] | None:
    """The ``__dict__`` of an undecorated object that keeps its data there
    (not a class, module, function, method or partial); ``None`` otherwise."""
    attrs = getattr(value, "__dict__", None)
    if (
        not isinstance(attrs, dict)
        or isinstance(value, _NOT_HOLDERS)
        or type(value) in STATEFUL_CLASSES
    ):
        return None
    return attrs


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
            out.append((k, StaticLeaf(v)))
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
        value = _replace_at(value, path, StaticLeaf)
    return value


def _unwrap_at(value: Any, positions: tuple) -> Any:
    for path in positions:
        value = _replace_at(value, path, lambda s: s.value if type(s) is StaticLeaf else s)
    return value


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
    instance gets the same copy. Lists, tuples and dicts are rebuilt; another
    node is rebuilt when something under it changed and kept as the same
    object otherwise; everything else is returned as is.

    Example:
        >>> from autostate import graph
        >>> graph.map_tree({"a": [1, "x"]}, lambda x, name: name, lambda x: type(x) is int)
        {'a': ["['a'][0]", 'x']}
    """
    memo: dict[int, Any] = {}
    kinds = _KINDS

    def walk(node: Any, prefix: str) -> Any:
        if is_target(node):
            return replace(node, path_name(prefix))
        t = type(node)
        kind = kinds.get(t)
        if kind is not None and kind.children is not None:
            if kind.by_identity:
                seen = memo.get(id(node))
                if seen is not None:
                    return seen
                new = memo[id(node)] = kind.empty(node)  # type: ignore[misc]
                kids = [walk(child, prefix + sub) for sub, child in kind.children(node)]
                kind.fill(new, node, kids)  # type: ignore[misc]
                return new
            old = kind.children(node)
            kids = [walk(child, prefix + sub) for sub, child in old]
            # An untouched node (a method bound to nothing the walk copied) is
            # kept as the same object, not an equal rebuild.
            if not kind.copied and all(a is b for a, (_, b) in zip(kids, old)):
                return node
            return kind.rebuild(node, kids)  # type: ignore[misc]
        if (vkind := kind_of(node)).static or vkind.array:
            return node
        children, treedef = _flatten_one_level(node)
        if treedef is None:
            return node
        new_children = [walk(child, prefix + sub) for sub, child in children]
        # An untouched registered node (a request of another category, another
        # handler's ref) is kept as the same object, not an equal rebuild.
        if all(a is b for a, (_, b) in zip(new_children, children)):
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


def children_of(node: Any) -> list[tuple[str, Any]]:
    """One step of the walk: ``node``'s children, each with its path suffix.

    Through the node's registered kind, else JAX's flatten of it one level
    down (a registered pytree node); none for a leaf (an array, a static
    value, an object JAX takes as one leaf).

    Example:
        >>> from autostate import graph
        >>> graph.children_of({"k": [1]}), graph.children_of(3)
        ([("['k']", [1])], [])
    """
    t = type(node)
    kind = _KINDS.get(t)
    if kind is not None and kind.children is not None:
        return kind.children(node)
    if (vkind := kind_of(node)).static or vkind.array:
        return []
    flat, treedef = _flatten_one_level(node)
    return [] if treedef is None else flat


def iter_tree(
    tree: Any,
    is_target: Callable[[Any], bool],
    *,
    into_targets: bool = False,
    children: Callable[[Any], list[tuple[str, Any]]] = children_of,
    seen: set[int] | None = None,
) -> Iterator[tuple[str, Any]]:
    """Yields ``(path_name, node)`` for every target, copying nothing.

    The walk of ``map_tree`` without the rebuild: each decorated instance is
    walked into once (by its first path). A target is yielded on every path
    that reaches it and not descended into; with ``into_targets`` it is
    descended into, and a decorated instance is yielded once.

    A walk that follows other edges than the model graph's (what a ``lax``
    body's code reaches, the containers a model holds outside its states)
    passes its own ``children`` step (``children_of``'s signature); with
    ``seen``, every node is visited once by identity, its id recorded there
    (a set shared by walks from several roots visits a node once in all).

    Example:
        >>> from autostate import graph
        >>> list(graph.iter_tree([1, {"k": 2}], lambda x: type(x) is int))
        [('[0]', 1), ("[1]['k']", 2)]
        >>> shared = [3]
        >>> list(graph.iter_tree([shared, shared], lambda x: type(x) is int, seen=set()))
        [('[0][0]', 3)]
    """
    every = seen is not None
    visited: set[int] = set() if seen is None else seen
    stateful = STATEFUL_CLASSES
    stack: list[tuple[str, Any]] = [("", tree)]
    pop, push = stack.pop, stack.extend
    while stack:
        prefix, node = pop()
        if every:
            if id(node) in visited:
                continue
            visited.add(id(node))
        hit = is_target(node)
        if hit and not into_targets:
            # A target is yielded on every path that reaches it, a shared
            # instance too (``nn.torch_io`` names tied weights by each path).
            yield path_name(prefix), node
            continue
        if not every and type(node) in stateful:  # visited once, by identity
            if id(node) in visited:
                continue
            visited.add(id(node))
        if hit:
            yield path_name(prefix), node
        kids = children(node)
        if kids:
            push([(prefix + sub, child) for sub, child in reversed(kids)])


def instances(tree: Any) -> list[tuple[str, Any]]:
    """``(path name, instance)`` for every decorated instance reachable in
    ``tree``, once each (named by its first path), in walk order."""
    return list(iter_tree(tree, is_stateful_instance, into_targets=True))


def instances_of(tree: Any) -> list[Any]:
    """Every decorated instance reachable in ``tree``, once each."""
    return [obj for _, obj in iter_tree(tree, is_stateful_instance, into_targets=True)]


def instance_ids(tree: Any) -> frozenset[int]:
    """Ids of every decorated instance reachable in ``tree``."""
    return frozenset(map(id, instances_of(tree)))


_CALLABLES = (types.MethodType, types.FunctionType, weakref.ReferenceType, weakref.WeakMethod)


def holds_instance(value: Any) -> bool:
    """Whether ``value`` is, or contains, a decorated instance (a sub-model) or
    a method bound to one (``self._eval``)."""
    t = type(value)
    if t in STATEFUL_CLASSES:
        return True
    if t in _CALLABLES:
        return _held_instances(value) is not None
    if (vkind := kind_of(value)).static or vkind.array:
        return False
    return next(iter_tree(value, _instance_or_bound), None) is not None


def _instance_or_bound(value: Any) -> bool:
    t = type(value)
    if t in STATEFUL_CLASSES:
        return True
    held = _HELD.get(t)
    if held is not None:
        return any(holds_instance(v) for _, v in held(value))
    return _bound_to_instance(value)


def _frame_locals(attribute: str) -> Callable[[Any], list[tuple[str, Any]]]:
    def parts(value: Any) -> list[tuple[str, Any]]:
        frame = getattr(value, attribute)  # (None once finished: it holds nothing)
        return (
            [] if frame is None else [(f" (its local {k!r})", v) for k, v in frame.f_locals.items()]
        )

    return parts


def _partial_parts(p: Any) -> list[tuple[str, Any]]:
    return [
        (".func", p.func),
        *((f".args[{i}]", a) for i, a in enumerate(p.args)),
        *((f".keywords[{k!r}]", a) for k, a in p.keywords.items()),
    ]


def _lazy_parts(m: Any) -> list[tuple[str, Any]]:
    return [
        (" (its function)" if i == 0 else " (its iterable)", v)
        for i, v in enumerate(m.__reduce__()[1])
    ]


def held_parts(value: Any) -> list[tuple[str, Any]] | None:
    """``(where, value)`` for what a ``functools.partial`` (or a subclass), a
    suspended generator or coroutine, or a lazy ``map`` / ``filter`` holds;
    None for anything else."""
    how = _HELD.get(type(value))
    if how is None and isinstance(value, functools.partial):
        how = _partial_parts
    return None if how is None else how(value)


# --- the containers a model holds outside its states ----------------------------
# Inside a traced call (a jitted ``f``, a ``lax`` body) a list or dict that is
# not state cannot change in place as plain Python would change it: the change
# is made once per trace, and a traced value put there outlives the trace. The
# guard snapshots these containers before such a call (``mutable_statics``),
# and each container's value kind compares and restores it
# (``values.Kind.same`` / ``restore``). They are not nodes of the model graph
# (a list of numbers is static data there): the walk follows the value kinds
# (a container's items, a tuple's, a plain object's ``__dict__``) with the one
# loop of ``iter_tree``.


def mutable_statics(
    instances: list[Any], values: Sequence[tuple[str, Any]] = ()
) -> list[tuple[Any, Any, str]]:
    """``(container, shallow copy, "Class.attr")`` for every list, dict, set,
    deque or bytearray the model's instances hold outside their states, at
    any depth of containers, tuples and plain objects (whose ``__dict__`` is
    taken as one), and for those of the instances' classes (``shared = []``
    in a class body); and for those in ``values`` (``(label, value)``: the
    states a ``lax`` body may reach through a reference taken outside it).

    Inside a traced call such a container is a copy the call throws away
    (or, for ``f``'s own model, one a later call starts from): a change in
    place (``self.log.append(x)``) would be lost with the trace, or keep a
    tracer. The guard refuses it; a refused call puts the old contents back.

    Example:
        >>> @autostate.stateful
        ... class Logged:
        ...     def __init__(self):
        ...         self.log = [[1], (2, {3: 4})]
        >>> [(c, where) for c, _, where in mutable_statics([Logged()])]
        [([[1], (2, {3: 4})], 'Logged.log'), ([1], 'Logged.log'), ({3: 4}, 'Logged.log')]
    """
    saved: list[tuple[Any, Any, str]] = []
    seen: set[int] = set()  # shared by the walks from every root: a container is saved once

    def visit(value: Any, where: str) -> None:
        walk = iter_tree(
            value, _values.is_mutable, into_targets=True, children=_held_outside_states, seen=seen
        )
        for _, c in walk:
            saved.append((c, kind_of(c).copy(c), where))  # type: ignore[misc]

    classes: dict[type, None] = {}
    for obj in instances:
        cls = type(obj)
        classes[cls] = None
        for name, value in obj.__dict__.items():
            if _may_hold_containers(value):  # (most attributes: no walk)
                visit(value, f"{cls.__name__}.{name}")
    for cls in classes:
        for klass in cls.__mro__[:-1]:
            for name, value in list(vars(klass).items()):
                if _values.is_mutable(value) and not name.startswith("__"):
                    visit(value, f"{klass.__name__}.{name}")
    for label, value in values:
        if _may_hold_containers(value):
            visit(value, label)
    return saved


def _may_hold_containers(value: Any) -> bool:
    """Not a leaf, a decorated instance (visited as one of the instances) or a
    ``shared`` node (a handled slot: frozen and childless)."""
    t, kind = type(value), kind_of(value)
    return not (kind.atom or kind.array or t in STATEFUL_CLASSES or t in _SHARED_NODES)


def _held_outside_states(value: Any) -> list[tuple[str, Any]]:
    """The step of ``mutable_statics``'s walk: a container's items (a set's or
    bytearray's aside), a tuple's, a plain object's ``__dict__`` (a dict)."""
    kind = kind_of(value)
    if kind is _values.SET or kind is _values.BYTEARRAY:
        return []
    if kind.mutable or kind is _values.TUPLE:
        items = value.values() if isinstance(value, dict) else value
        return [("", item) for item in items if _may_hold_containers(item)]
    d = plain_attributes(value)
    return [] if d is None else [("", d)]


# --- what code reaches ----------------------------------------------------------
# A ``lax`` body, or a function ``autostate.jit`` compiles, reaches models through
# what its code holds: its closure cells and defaults, a bound method's
# instance, a partial's arguments, and what those hold in turn. The step from
# a node is its kind's ``reached`` field (one dict look-up per node); a
# subclass of a list, tuple, dict or ``functools.partial`` is walked as its
# base is.


def reachable_instances(roots: Sequence[Any], containers: list[Any]) -> list[Any]:
    """Decorated instances code holding ``roots`` reaches (closures, bound
    methods, operands), once each; the lists and dicts met on the way go into
    ``containers``. Last first: the order that names two instances' states
    ``Linear.w``, ``Linear.w'``.

    Example:
        >>> @autostate.stateful
        ... class Scale:
        ...     def __init__(self):
        ...         self.w = jnp.ones(2)
        >>> model, log = Scale(), []
        >>> body = lambda x, m=model: m.w * x  # (reaches its defaults and cells)
        >>> found = reachable_instances((body, [log]), containers := [])
        >>> found == [model], containers == [[log], log]
        (True, True)
    """
    found: list[Any] = []
    visited: set[int] = set()
    steps = _REACHED
    holds_nothing = _values.holds_nothing  # (an atom or an array: no node)
    stack = [root for root in roots if not holds_nothing(root)]
    pop, push = stack.pop, stack.extend
    while stack:
        node = pop()
        if id(node) in visited:
            continue
        visited.add(id(node))
        step = steps.get(type(node)) or _reached_by_base(node)
        if step is None:
            continue
        reached, role = step
        if role == _REACHED_INSTANCE:
            found.append(node)
        elif role == _REACHED_CONTAINER:
            containers.append(node)
        push([item for item in reached(node) if not holds_nothing(item)])
    return found


def _reached_by_base(node: Any) -> tuple[Callable[[Any], Iterable[Any]], int] | None:
    """The ``reached`` step of a subclass of a list, tuple, dict or partial
    (none of its own): its base's."""
    for base in (list, dict, tuple, functools.partial):
        if isinstance(node, base):
            return _REACHED[base][0], _reached_role(type(node), False)
    return None


def _function_reached(function: Any) -> list[Any]:
    """What a function's code holds: its cells, defaults and ``__wrapped__``."""
    items = []
    for cell in function.__closure__ or ():
        with contextlib.suppress(ValueError):  # an empty cell
            items.append(cell.cell_contents)
    items.extend(function.__defaults__ or ())
    wrapped = getattr(function, "__wrapped__", None)
    if wrapped is not None:
        items.append(wrapped)
    return items


def code_reaches(fn: Callable[..., Any]) -> list[tuple[str, Any]]:
    """``(how, value)`` for what ``fn``'s code reaches that may hold a model:
    what its closure and defaults reach (``reachable_instances``), the
    globals it and the functions it calls by a global name load (to a depth
    of four, libraries aside), the attributes of a global module its code
    reads, and the ``__dict__`` of the plain object it is a method of (or of
    a callable object). ``autostate.jit`` refuses a model found there that is
    not an argument.

    Example:
        >>> @autostate.stateful
        ... class Scale:
        ...     def __init__(self):
        ...         self.w = jnp.ones(2)
        >>> MODEL = Scale()
        >>> [how for how, _ in code_reaches(lambda x: MODEL.w * x)]
        ["the global 'MODEL'"]
    """
    found: list[tuple[str, Any]] = []
    seen: set[int] = set()

    def visit(function: Any, depth: int) -> None:
        if id(function) in seen or depth > 4:
            return
        seen.add(id(function))
        found.extend(("its closure", obj) for obj in reachable_instances((function,), []))
        code = getattr(function, "__code__", None)
        if code is None:
            return
        globals_ = getattr(function, "__globals__", {})
        for name in _global_names(code):
            value = globals_.get(name)
            if value is None:
                continue
            if holds_instance(value):
                found.append((f"the global {name!r}", value))
            elif isinstance(value, types.FunctionType) and not _library(value):
                visit(value, depth + 1)
            elif isinstance(value, types.ModuleType) and not _library(value):
                # ``module.MODEL`` read by the code: an attribute of a global module.
                for attr in code.co_names:
                    held = getattr(value, attr, None)
                    if held is not None and holds_instance(held):
                        found.append((f"the module attribute {name}.{attr}", held))

    owner = getattr(fn, "__self__", None)
    if owner is not None and not isinstance(owner, types.ModuleType):
        # A method of a plain object (``autostate.jit(evaluator.run)``): the
        # models that object holds are read through ``self``.
        held = getattr(owner, "__dict__", None)
        if held is not None:
            found.append(("the object its method is bound to", held))
    elif not isinstance(fn, types.FunctionType | types.MethodType):
        held = getattr(fn, "__dict__", None)  # (a callable object's)
        if held is not None:
            found.append(("the callable object", held))
    visit(getattr(fn, "__func__", fn), 0)
    return found


def _library(function: Any) -> bool:
    """A function (or module) of JAX, NumPy, autostate or another library the walk skips."""
    if isinstance(function, types.ModuleType):
        module = function.__name__
    else:
        module = getattr(function, "__module__", None) or ""
    return module.split(".")[0] in _LIBRARIES


_LIBRARIES = frozenset({"jax", "jaxlib", "numpy", "autostate", "optax", "flax", "equinox",
                        "haiku", "functools", "typing", "builtins"})


def _global_names(code: types.CodeType) -> set[str]:
    """The global names ``code`` and the functions nested in it load (not the
    attribute names, which ``co_names`` holds too)."""
    names = {
        str(op.argval) for op in dis.get_instructions(code)
        if op.opname in ("LOAD_GLOBAL", "LOAD_NAME")
    }
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


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


def _running_part(value: Any) -> Any:
    """``(value, key)`` of a slot of a running call (a ``running`` kind), else None."""
    how = _RUNNING.get(type(value))
    return None if how is None else how[0](value)


# ``jax.grad`` / ``jax.value_and_grad`` take their arguments' leaves (through
# ``jax.tree_util.tree_leaves``) in this function of JAX's, then refuse an
# integer or key leaf in words that name neither the model nor its state.
# The flatten of an instance seen from there calls the hook
# ``autostate.training`` (which owns ``autostate.grad``) sets, to say it in
# the model's words first.
_JAX_GRAD = ("value_and_grad_f", jax._src.api.__file__)
_JAX_TREE_UTIL = jax._src.tree_util.__file__
_on_jax_grad: Callable[[Any, types.FrameType], None] | None = None


def on_jax_grad(hook: Callable[[Any, types.FrameType], None]) -> None:
    """Sets what a decorated instance flattened by ``jax.grad`` for its
    argument check calls: ``hook(instance, jax's frame)``."""
    global _on_jax_grad
    _on_jax_grad = hook


def _flatten_instance(obj: Any) -> tuple[list[Any], tuple]:
    caller = sys._getframe(1)
    if caller.f_code.co_filename == _JAX_TREE_UTIL:  # (``jax.tree_util.tree_leaves``)
        caller = caller.f_back  # type: ignore[assignment]
        if caller.f_code.co_name == _JAX_GRAD[0] and caller.f_code.co_filename == _JAX_GRAD[1]:
            if _on_jax_grad is not None:
                _on_jax_grad(obj, caller)
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
        elif _RUNNING and (running := _running_part(value)) is not None:
            aux.append(("r", name, (type(value), running[1])))
            children.append(running[0])
        elif is_dynamic(value):
            if type(value) in STATEFUL_CLASSES and _leads_back(value, obj):
                raise _cycle_error(obj, name, value)
            value, positions = _wrap_statics(value)
            aux.append(("c", name, positions) if positions else name)
            children.append(value)
        else:
            aux.append(("s", name, StaticLeaf(value)))
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
        if _RUNNING and (running := _running_part(value)) is not None:
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
            aux.append(("s", name, StaticLeaf(value)))
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
                d[entry[1]] = _RUNNING[slot_type][1](key, next(it))
            else:
                d[entry[1]] = entry[2].value
        _remember_layout(obj, aux)
        return obj

    return unflatten


def register_stateful_class(
    cls: type, info: Any, after_copy: Callable[[Any], None] | None = None
) -> None:
    """Records ``cls`` as decorated with ``info``: its node kind and its pytree.

    A decorated instance is a node visited once by identity; its children
    are its attributes (``.name``); ``after_copy(new)`` runs on every copy
    ``map_tree`` makes of an instance, once its attributes are in place.
    Decorating a class again (other options) replaces its info and its
    kind's ``after_copy``: it stays one record, and one pytree registration.
    """
    setattr(cls, INFO_ATTR, info)
    kind = _KINDS.get(cls)
    if kind is None:
        jax.tree_util.register_pytree_with_keys(
            cls, _flatten_instance_with_keys, _make_unflatten(cls), _flatten_instance
        )
        register_node_kind(
            cls,
            children=_instance_children,
            by_identity=True,
            empty=_empty_instance,
            fill=_fill_instance,
            model_child=True,
            after_copy=after_copy,
            reached=_instance_reached,
        )
    elif kind.after_copy is not after_copy:
        _install(dataclasses.replace(kind, after_copy=after_copy))


def _instance_reached(obj: Any) -> Iterable[Any]:
    return obj.__dict__.values()


def _instance_children(obj: Any) -> list[tuple[str, Any]]:
    return [("." + k, v) for k, v in obj.__dict__.items()]


def _empty_instance(obj: Any) -> Any:
    return object.__new__(type(obj))


def _fill_instance(new: Any, obj: Any, children: list[Any]) -> None:
    new.__dict__.update(zip(obj.__dict__, children))
    after_copy = STATEFUL_CLASSES[type(obj)]
    if after_copy is not None:
        after_copy(new)


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
        return [value.__self__] if type(value.__self__) in STATEFUL_CLASSES else None
    if t is weakref.ReferenceType:
        target = value()
        return [target] if type(target) in STATEFUL_CLASSES else None
    if t is weakref.WeakMethod:
        method = value()
        target = getattr(method, "__self__", None)
        return [target] if type(target) in STATEFUL_CLASSES else None
    if t is types.FunctionType and value.__closure__ is not None:
        held = []
        for cell in value.__closure__:
            try:
                content = cell.cell_contents
            except ValueError:  # an empty cell
                content = None
            held.append(content if type(content) in STATEFUL_CLASSES else None)
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
    return type(x) in STATEFUL_CLASSES or is_static_leaf(x)


def flatten_graph(root: Any, objects: list[Any] | None = None) -> tuple[list[Any], GraphDef]:
    """Flattens a model graph with each instance once: ``(leaves, graphdef)``.

    Unlike the per-instance pytree registration, an instance (or an array)
    reachable from two paths contributes its leaves once (named by its first
    path), so tied weights stay tied through ``jax.jit`` and get one summed
    gradient. The leaves are arrays only: every other value (a python scalar
    in a list, a function or a string inside a foreign pytree node) is
    static, in the graphdef. ``graphdef.keys`` holds each leaf's keypath from
    the root, in JAX's own key entries, which reads as its name (a stack's
    own entry, ``passing_key``, is in neither). ``graph_unchanged``, next,
    is its mirror. ``objects``, where given, receives the instances in
    graphdef order (the root first).

    Example:
        >>> @autostate.stateful
        ... class Tied:
        ...     def __init__(self):
        ...         self.w = jnp.ones(2)
        ...         self.blocks = [self.w, {"scale": 2.0, "b": jnp.zeros(3)}]
        >>> model = Tied()
        >>> leaves, graphdef = flatten_graph(model)
        >>> graphdef.names
        ('w', "blocks[1]['b']")
        >>> graph_unchanged(model, leaves, graphdef)
        True
        >>> model.blocks[1]["scale"] = 3.0
        >>> graph_unchanged(model, leaves, graphdef)
        False
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
        if objects is not None:
            objects.append(obj)
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
                    entries.append((name, None, StaticLeaf(copy_static(value, statics))))
                continue
            flat, treedef = jax.tree_util.tree_flatten_with_path(value, is_leaf=_graph_leaf)
            parts: list[Any] = []
            here = prefix + attr_name(name)
            here_keys = (*prefix_keys, attr_key(name))
            for path, leaf in flat:
                sub = here + "".join(key_name(k) for k in path)
                if type(leaf) in STATEFUL_CLASSES:
                    parts.append(-1 - visit(leaf, sub, (*here_keys, *_named_keys(path))))
                elif is_array_or_spec(leaf):
                    # One array in two places (``self.head.w = self.embed.w``)
                    # is one leaf, as a shared sub-model is.
                    at = arrays.get(id(leaf))
                    if at is None:
                        at = arrays[id(leaf)] = len(leaves)
                        leaves.append(leaf)
                        names.append(path_name(sub))
                        keys.append((*here_keys, *_named_keys(path)))
                    parts.append(at)
                elif type(leaf) in _CALLABLES and (held := _held_instances(leaf)) is not None:
                    where, where_keys = f"{sub}.__self__", (*here_keys, *_named_keys(path))
                    indices = [-1 if h is None else visit(h, where, where_keys) for h in held]
                    parts.append(_bound_ref(leaf, indices))
                else:
                    parts.append(StaticLeaf(copy_static(leaf, statics)))
            entries.append((name, treedef, tuple(parts)))
        instances[i] = (type(obj), tuple(entries))
        return i

    root_index = visit(root, "", ())
    return leaves, GraphDef(tuple(instances), root_index, tuple(names), tuple(keys))


def graph_unchanged(root: Any, leaves: list[Any], graphdef: GraphDef) -> bool:
    """Whether ``flatten_graph(root)`` would give ``graphdef`` and exactly ``leaves``.

    The declared mirror of ``flatten_graph``, entry for entry: an attribute
    the flatten keeps as a leaf is compared by identity, one kept as static
    aux data by value (``StaticLeaf``'s ``==``), a bound method or closure by
    its code and the graph indices of its instances, a ``shared`` node by
    identity with the one the rebuild put there, a sub-model by its index in
    the walk order; values are seen in their ``canonical`` form, as the
    flatten sees them. A change to one must be made to the other.

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
                if is_dynamic(value) or not (value is parts.value or StaticLeaf(value) == parts):
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
                elif type(p) is StaticLeaf:
                    # A python value inside a container: structure, compared by value.
                    if type(leaf) in STATEFUL_CLASSES or is_array_or_spec(leaf):
                        return False
                    if not (leaf is p.value or StaticLeaf(leaf) == p):
                        return False
                elif type(leaf) in STATEFUL_CLASSES:
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


class Witness:
    """What a set of instances held, by identity: ``unchanged()`` says whether
    they still hold it, so that an earlier ``flatten_graph`` of them still stands.

    The cheap, conservative sibling of ``graph_unchanged``: it compares
    identities only (each instance's attributes, the lists, dicts and state
    slots they hold, at any depth), builds no graphdef and flattens nothing.
    What it saw is kept flat (every instance's keys and values in one list,
    every list's items in another, ...), so that a check is a few
    comparisons of whole lists in C, whatever the number of instances. A
    value whose equality the graphdef compares but whose identity cannot tell
    a change (a numpy array, which changes in place; a mutable object with an
    ``__eq__`` of its own; a foreign pytree node) makes ``of`` give ``None``:
    no witness, the caller flattens again.

    Example:
        >>> @autostate.stateful
        ... class Layer:
        ...     def __init__(self):
        ...         self.w = jnp.ones(2)
        ...         self.sizes = [2]
        >>> layer = Layer()
        >>> witness = Witness.of([layer])
        >>> witness.unchanged()
        True
        >>> layer.sizes.append(3)
        >>> witness.unchanged()
        False
    """

    __slots__ = ("refs", "types", "dicts", "lens", "keys", "values", "starts", "held", "_plans")

    def __init__(self, objects: Sequence[Any], held: _Held):
        # Per instance: a weak reference to it, its class, its __dict__, the
        # dict's length and where its keys and values start in the flat lists.
        self.refs = [weakref.ref(obj) for obj in objects]
        self.types = list(map(type, objects))
        self.dicts = [obj.__dict__ for obj in objects]
        self.lens = list(map(len, self.dicts))
        self.starts = list(itertools.accumulate(self.lens, initial=0))
        self.keys = list(itertools.chain.from_iterable(self.dicts))
        self.values = list(itertools.chain.from_iterable(map(dict.values, self.dicts)))
        self.held = held  # what the attributes hold that can change in place
        # Per set of attributes a call rewrites (by id): it, and how ``patch`` takes them.
        self._plans: dict[int, tuple[tuple, _Patch]] = {}

    @classmethod
    def of(cls, objects: Sequence[Any]) -> Witness | None:
        held = _Held.of([obj.__dict__ for obj in objects])
        if held is None:
            return None
        try:
            return cls(objects, held)
        except TypeError:  # (an instance that takes no weak reference)
            return None

    def patch(self, touched: Iterable[tuple[int, str]]) -> bool:
        """Witnesses anew the attributes ``touched`` (``(instance index, name)``:
        what a call rewrote), the rest as it was: whether it still can (else
        the caller makes a new one with ``of``).

        One call's rewrites are many (a state per layer) and alike (a new
        array, or a new slot holding one): each is written over what was
        witnessed for it in whole lists, and only an attribute whose value
        is another shape is witnessed anew on its own.
        """
        # (By identity: a compiled call gives the same tuple each time.)
        found = self._plans.get(id(touched))
        if found is not None and found[0] is touched:
            plan = found[1]
        else:
            touched = tuple(touched)
            made = _Patch.of(self, touched)
            if made is None:
                return False
            plan = made
            self._plans[id(touched)] = (touched, plan)
        if list(map(len, self.dicts)) != self.lens:
            return False
        new = list(map(dict.get, map(self.dicts.__getitem__, plan.instances), plan.names))
        set_value = self.values.__setitem__
        for _ in map(set_value, plan.positions, new):
            pass
        held = self.held
        others = list(plan.others)
        # Values holding nothing to witness (a new array): nothing held before either.
        plain = list(map(new.__getitem__, plan.plain))
        if not all(map(_PLAIN.__contains__, map(type, plain))):
            others += plan.plain
        # A new slot of the kind before, holding a value of its own (a state's).
        slots = list(map(new.__getitem__, plan.slots))
        inner = None
        if list(map(type, slots)) == plan.slot_types:
            inner = list(map(operator.call, map(held.reads.__getitem__, plan.slot_at), slots))
            if not all(map(_PLAIN.__contains__, map(type, inner))):
                inner = None
        if inner is None:
            others += plan.slots
        else:
            for _ in map(held.slots.__setitem__, plan.slot_at, slots):
                pass
            for _ in map(held.inner.__setitem__, plan.slot_at, inner):
                pass
        for k in others:  # (anything else, one by one)
            record: tuple[list, list, list] = ([], [], [])
            if not _witnessed(new[k], record):
                return False
            if not held.replace(touched[k], record):
                # Another shape (a dict with a key more): all held, anew.
                anew = _Held.of(self.dicts)
                if anew is None:
                    return False
                self.held, self._plans = anew, {}
                break
        return True

    def instances(self) -> list[Any] | None:
        """The instances witnessed, where they still hold what they held (else ``None``)."""
        objs = list(map(operator.call, self.refs))
        if list(map(type, objs)) != self.types:  # (a dead instance reads as None)
            return None
        dicts = self.dicts
        if not all(map(operator.is_, map(_DICT_OF, objs), dicts)):
            return None
        if list(map(len, dicts)) != self.lens:
            return None
        if not all(map(operator.is_, itertools.chain.from_iterable(dicts), self.keys)):
            return None
        if not all(map(operator.is_, itertools.chain.from_iterable(map(dict.values, dicts)),
                       self.values)):
            return None
        return objs if self.held.unchanged() else None

    def unchanged(self) -> bool:
        return self.instances() is not None


_DICT_OF = operator.attrgetter("__dict__")


class _Held:
    """What a ``Witness``'s attributes hold that can change in place, flat:
    every list, dict and state slot in one list each, their contents in
    another (records ``(dict, keys, values)``, ``(list, items)``, ``(slot,
    read, value)``), so that a check compares whole lists; ``spans`` says
    where each attribute's records start, and their shape, so that a record
    of the same shape is written over them in place."""

    __slots__ = ("lists", "list_lens", "items", "dicts", "dict_lens", "dict_keys",
                 "dict_values", "slots", "reads", "inner", "spans")

    def __init__(self) -> None:
        self.lists: list = []
        self.list_lens: list[int] = []
        self.items: list = []
        self.dicts: list = []
        self.dict_lens: list[int] = []
        self.dict_keys: list = []
        self.dict_values: list = []
        self.slots: list = []
        self.reads: list = []
        self.inner: list = []
        # (instance, name) -> (starts in dicts, dict_keys, lists, items, slots; shape)
        self.spans: dict[tuple[int, str], tuple[int, int, int, int, int, tuple]] = {}

    @classmethod
    def of(cls, dicts: Sequence[dict]) -> _Held | None:
        """What the attributes in ``dicts`` hold (``None``: one can change unseen)."""
        held = cls()
        for i, d in enumerate(dicts):
            for name, v in d.items():
                record: tuple[list, list, list] = ([], [], [])
                if not _witnessed(v, record):
                    return None
                if record[0] or record[1] or record[2]:
                    held.add((i, name), record)
        return held

    def add(self, at: tuple[int, str], record: tuple[list, list, list]) -> None:
        self.spans[at] = (len(self.dicts), len(self.dict_keys), len(self.lists),
                          len(self.items), len(self.slots), _shape(record))
        for c, keys, values in record[0]:
            self.dicts.append(c)
            self.dict_lens.append(len(keys))
            self.dict_keys.extend(keys)
            self.dict_values.extend(values)
        for c, items in record[1]:
            self.lists.append(c)
            self.list_lens.append(len(items))
            self.items.extend(items)
        for slot, read, value in record[2]:
            self.slots.append(slot)
            self.reads.append(read)
            self.inner.append(value)

    def replace(self, at: tuple[int, str], record: tuple[list, list, list]) -> bool:
        """Writes ``record`` over the attribute's, where both have one shape."""
        span = self.spans.get(at)
        if span is None:
            return not (record[0] or record[1] or record[2])
        d, k, lst, it, s, shape = span
        if _shape(record) != shape:
            return False
        for c, keys, values in record[0]:
            self.dicts[d] = c
            self.dict_keys[k:k + len(keys)] = keys
            self.dict_values[k:k + len(keys)] = values
            d, k = d + 1, k + len(keys)
        for c, items in record[1]:
            self.lists[lst] = c
            self.items[it:it + len(items)] = items
            lst, it = lst + 1, it + len(items)
        for slot, read, value in record[2]:
            self.slots[s], self.reads[s], self.inner[s] = slot, read, value
            s += 1
        return True

    def unchanged(self) -> bool:
        is_, chain = operator.is_, itertools.chain.from_iterable
        return (
            list(map(len, self.lists)) == self.list_lens
            and all(map(is_, chain(self.lists), self.items))
            and list(map(len, self.dicts)) == self.dict_lens
            and all(map(is_, chain(self.dicts), self.dict_keys))
            and all(map(is_, chain(map(dict.values, self.dicts)), self.dict_values))
            and all(map(is_, map(operator.call, self.reads, self.slots), self.inner))
        )


def _shape(record: tuple[list, list, list]) -> tuple:
    return (tuple(len(keys) for _, keys, _ in record[0]),
            tuple(len(items) for _, items in record[1]), len(record[2]))


@dataclasses.dataclass(slots=True)
class _Patch:
    """How ``Witness.patch`` takes one set of rewritten attributes, by their
    order in it: each one's instance, name and place among the witness's
    values; which held nothing to witness (``plain``), which held one slot
    and nothing else (``slots``, of ``slot_types``, at ``slot_at``), and the
    rest."""

    instances: list[int]
    names: list[str]
    positions: list[int]
    plain: list[int]
    slots: list[int]
    slot_types: list[type]
    slot_at: list[int]
    others: list[int]

    @classmethod
    def of(cls, witness: Witness, touched: tuple[tuple[int, str], ...]) -> _Patch | None:
        plan = cls([], [], [], [], [], [], [], [])
        held = witness.held
        for k, (i, name) in enumerate(touched):
            start, end = witness.starts[i], witness.starts[i + 1]
            try:
                position = witness.keys.index(name, start, end)
            except ValueError:
                return None
            plan.instances.append(i)
            plan.names.append(name)
            plan.positions.append(position)
            span = held.spans.get((i, name))
            if span is None:
                plan.plain.append(k)
            elif span[5] == ((), (), 1):
                plan.slots.append(k)
                plan.slot_types.append(type(held.slots[span[4]]))
                plan.slot_at.append(span[4])
            else:
                plan.others.append(k)
        return plan


def _witnessed(value: Any, record: tuple[list, list, list]) -> bool:
    """Whether a ``Witness`` can see every change of ``value`` by identity; the
    dicts, lists and slots it holds into ``record``."""
    t = type(value)
    if t in _PLAIN or t in STATEFUL_CLASSES:
        return True  # (an instance is among the witnessed objects: witnessed on its own)
    kind = kind_of(value)
    if kind.static or kind.array:
        if kind.numpy:
            return False  # (a numpy array changes in place)
        _PLAIN.add(t)  # (by type: the next one is taken at the first look)
        return True
    if t is list:
        record[1].append((value, tuple(value)))
        return all(_witnessed(v, record) for v in value)
    if t is dict:
        record[0].append((value, tuple(value), tuple(value.values())))
        return all(_witnessed(v, record) for v in value.values())
    if kind is _values.TUPLE or kind is _values.NAMED_TUPLE or kind is _values.FROZENSET:
        return all(_witnessed(v, record) for v in value)
    if t in _WITNESSED:
        read = _WITNESSED[t]
        if read is None:
            return True  # (immutable, what it holds witnessed apart)
        inner = read(value)
        record[2].append((value, read, inner))
        return _witnessed(inner, record)
    return _identity_is_value(t, value)


# Types a ``Witness`` takes as they are, first (immutable); an array's kind
# says the same, one look-up later.
_PLAIN: set[type] = {int, float, bool, str, type(None), type(jax.tree_util.tree_structure(0))}

def _identity_is_value(t: type, value: Any) -> bool:
    """Whether values of type ``t`` are static values the graphdef compares by
    identity and holding no arrays: the default ``__eq__``, not a pytree node
    (decided by the first value met, for the type)."""
    found = _IDENTITY_IS_VALUE.get(t)
    if found is None:
        found = _IDENTITY_IS_VALUE[t] = t.__eq__ is object.__eq__ and (
            jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(value))
        )
    return found


_IDENTITY_IS_VALUE: dict[type, bool] = {}


def unflatten_graph(graphdef: GraphDef, leaves: list[Any]) -> Any:
    """Rebuilds the model graph of ``flatten_graph`` around new leaves."""
    return rebuild_instances(graphdef, leaves)[graphdef.root]


# How rebuild_instances fills one attribute (see _rebuild_plan).
_LEAF, _SHARED, _STATIC, _STATIC_COPY, _BOUND, _GENERAL = range(6)


def _rebuild_plan(graphdef: GraphDef) -> list[tuple[type, tuple]]:
    """Per instance of ``graphdef``: its class and, per attribute, ``(name, how, what)``.

    Derived once per graphdef, so that a rebuild (one per trace of ``f``)
    unflattens only what needs it: an attribute that is one leaf takes the
    leaf, and a handled slot is one object made once (a ``shared`` kind),
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
                elif not parts and type(shared := treedef.unflatten([])) in _SHARED_NODES:
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
                    steps.append((name, _GENERAL, (treedef, parts, _short_unflatten(treedef))))
            plan.append((cls, tuple(steps)))
        graphdef.cache["rebuild"] = plan
    return plan


def rebuild_instances(
    graphdef: GraphDef, leaves: list[Any], into: Sequence[Any | None] = ()
) -> list[Any]:
    """``unflatten_graph``, giving every instance of the graph (in graphdef order).

    ``into``: existing objects to fill instead of new ones, by graphdef index
    (``None``, or past its end: a new one). Each keeps its identity, and its
    attributes become exactly the graphdef's.
    """
    plan = _rebuild_plan(graphdef)
    objs: list[Any] = [object.__new__(cls) for cls, _ in plan[len(into):]]
    if into:
        objs = [
            obj if obj is not None else object.__new__(cls)
            for obj, (cls, _) in zip(into, plan)
        ] + objs
        for obj, _ in zip(into, plan):
            if obj is not None:
                obj.__dict__.clear()
    statics: dict[int, Any] = {}  # this model's own copies of static containers
    for obj, (_, steps) in zip(objs, plan):
        d = obj.__dict__
        for name, how, what in steps:
            d[name] = _rebuilt(how, what, leaves, objs, statics)
    return objs


def rewrite_attributes(
    graphdef: GraphDef, leaves: list[Any], objs: list[Any], at: Sequence[tuple[int, int]]
) -> list[tuple[Any, str, Any]]:
    """Rebuilds only the attributes ``at`` (``(instance, attribute)`` indices in
    ``graphdef``) of ``objs``, which already hold the rest of ``graphdef``.

    Returns ``(instance index, name, old value)`` for each attribute rewritten.
    """
    plan = _rebuild_plan(graphdef)
    statics: dict[int, Any] = {}
    done = []
    for i, k in at:
        name, how, what = plan[i][1][k]
        d = objs[i].__dict__
        done.append((i, name, d.get(name)))
        d[name] = _rebuilt(how, what, leaves, objs, statics)
    return done


def leaf_attributes(graphdef: GraphDef) -> list[list[tuple[int, int]]]:
    """Per leaf of ``graphdef``, the ``(instance, attribute)`` indices of every
    attribute holding it (what ``rewrite_attributes`` takes): a tied weight
    (``head.weight = emb.weight``) is one leaf held by two attributes, and a
    new value of it is written to both."""
    found: list[list[tuple[int, int]]] = [[] for _ in graphdef.names]
    for i, (_, steps) in enumerate(_rebuild_plan(graphdef)):
        for k, (_, how, what) in enumerate(steps):
            if how == _LEAF:
                found[what].append((i, k))
            elif how == _GENERAL:
                for p in sorted({p for p in what[1] if type(p) is int and p >= 0}):
                    found[p].append((i, k))
    return found


def _rebuilt(how: int, what: Any, leaves: list[Any], objs: list[Any], statics: dict) -> Any:
    """One attribute's value, as the rebuild plan says."""
    if how == _LEAF:
        return leaves[what]
    if how == _SHARED or how == _STATIC:
        return what
    if how == _STATIC_COPY:
        return copy_static(what, statics)
    if how == _BOUND:
        return what.rebind(objs)
    treedef, parts, short = what
    children = [
        (objs[-1 - p] if p < 0 else leaves[p])
        if type(p) is int
        else p.rebind(objs)
        if type(p) is _BoundRef
        else copy_static(p.value, statics)
        for p in parts
    ]
    return treedef.unflatten(children) if short is None else short(iter(children))


def _short_unflatten(treedef: Any) -> Callable[[Iterator[Any]], Any] | None:
    """``treedef.unflatten`` of the leaves an iterator gives, making each node of
    a ``from_leaves`` kind straight from its leaves (``None``: the tree holds
    no such node, and ``unflatten`` itself is the shortest)."""
    data = treedef.node_data()
    if data is None:  # (a leaf)
        return None
    if data[0] in _FROM_LEAVES:
        make, aux, count = _FROM_LEAVES[data[0]], data[1], treedef.num_leaves
        return lambda leaves: make(aux, list(itertools.islice(leaves, count)))
    children = treedef.children()
    inner = [_short_unflatten(child) for child in children]
    if all(b is None for b in inner):
        return None
    builders = [
        b if b is not None
        else functools.partial(_unflatten_next, child, child.num_leaves)
        for b, child in zip(inner, children)
    ]
    level = jax.tree_util.PyTreeDef.from_node_data_and_children(
        jax.tree_util.default_registry, data, [_LEAF_DEF] * len(children)
    )
    return lambda leaves: level.unflatten([build(leaves) for build in builders])


def _unflatten_next(treedef: Any, count: int, leaves: Iterator[Any]) -> Any:
    return treedef.unflatten(list(itertools.islice(leaves, count)))


_LEAF_DEF = jax.tree_util.tree_structure(0)


# --- the builtin kinds ----------------------------------------------------------


def _callable_children(value: Any) -> list[tuple[str, Any]]:
    """The instances a method, closure or weak reference is bound to, at
    ``.__self__`` (none for one bound to no decorated instance)."""
    held = _held_instances(value)
    return [] if held is None else [(".__self__", h) for h in held if h is not None]


def _rebind_callable(value: Any, copies: list[Any]) -> Any:
    """``value`` bound to ``copies`` of its instances, as ``flatten_graph`` rebinds."""
    held = _held_instances(value)
    assert held is not None  # it had children
    it = iter(copies)
    bound = [None if h is None else next(it) for h in held]
    return _bound_ref(value, [-1 if h is None else k for k, h in enumerate(held)]).rebind(bound)


register_node_kind(
    list,
    children=lambda v: [(f"[{i}]", x) for i, x in enumerate(v)],
    rebuild=lambda _v, children: children,
    copied=True,
    reached=iter,
)
register_node_kind(
    tuple,
    children=lambda v: [(f"[{i}]", x) for i, x in enumerate(v)],
    rebuild=lambda _v, children: tuple(children),
    copied=True,
    reached=iter,
)
register_node_kind(
    dict,
    children=lambda v: [(f"[{k!r}]", x) for k, x in v.items()],
    rebuild=lambda v, children: dict(zip(v, children)),
    copied=True,
    reached=dict.values,
)
# Code reaching a method reaches its instance and its function; one reaching a
# function, its cells, defaults and ``__wrapped__`` (a weak reference: nothing).
_CALLABLE_REACHED: dict[type, Callable[[Any], Iterable[Any]]] = {
    types.MethodType: lambda m: (m.__self__, m.__func__),
    types.FunctionType: _function_reached,
}
for _callable in _CALLABLES:
    register_node_kind(
        _callable,
        children=_callable_children,
        rebuild=_rebind_callable,
        reached=_CALLABLE_REACHED.get(_callable),
    )
del _callable, _CALLABLE_REACHED

# What reaches a model through another object JAX takes as one leaf, which
# f's copy cannot be rebound through: a ``functools.partial`` of a method, a
# generator a method made (its frame holds ``self``), a lazy ``map`` /
# ``filter`` over a method. The walks do not go into them; ``holds_instance``
# and ``held_parts`` look through them (``where`` is a path suffix for messages).
_held_by: tuple[tuple[type, Callable[[Any], list[tuple[str, Any]]]], ...] = (
    (functools.partial, _partial_parts),
    (types.GeneratorType, _frame_locals("gi_frame")),
    (types.CoroutineType, _frame_locals("cr_frame")),
    (types.AsyncGeneratorType, _frame_locals("ag_frame")),
    (map, _lazy_parts),
    (filter, _lazy_parts),
)
for _type, _held in _held_by:
    register_node_kind(
        _type,
        held=_held,
        # Code reaching a partial reaches its function and arguments.
        reached=(lambda p: (p.func, *p.args, *p.keywords.values()))
        if _type is functools.partial else None,
    )
del _held_by, _type, _held
