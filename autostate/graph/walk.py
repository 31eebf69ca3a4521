"""The one walk of the model graph: find, rebuild, flatten, reach.

* ``map_tree`` (rebuild) and ``iter_tree`` (find) visit any pytree through
  the node-kind records (``graph.kinds``), falling back to JAX's own
  one-level flatten for other registered pytree nodes. A decorated instance
  is visited once, by identity, so one instance reachable from two paths
  stays one instance (aliasing follows Python) and is named by its first
  path. ``instances``, ``instances_of`` and ``holds_instance`` are built on
  it.
* ``reachable_instances`` follows what code reaches (each kind's
  ``reached`` step), ``code_reaches`` adds a function's globals, and
  ``mutable_statics`` finds the containers a model holds outside its states
  (the guard's snapshot).
* ``flatten_graph`` / ``unflatten_graph`` turn a model into
  ``(leaves, GraphDef)`` and back, and ``graph_unchanged``, defined next to
  the flatten as its declared mirror, says whether a flatten would give the
  same graphdef and the very same leaves, without building names. The
  per-instance pytree registration of decorated classes (how ``jax.jit``
  and ``jax.tree.map`` see one instance) is here too.

It knows nothing of the effect engine or of source code: the kinds of
values (arrays, static scalars, containers) come from ``autostate.values``.

Example:
    >>> from autostate import graph
    >>> [name for name, _ in graph.iter_tree({"a": [1, (2, 3)]}, lambda x: type(x) is int)]
    ["['a'][0]", "['a'][1][0]", "['a'][1][1]"]
"""

from __future__ import annotations

import collections
import collections.abc
import dis
import functools
import gc
import itertools
import sys
import types
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax

from autostate import values as _values
from autostate.errors import InvalidTypeError, format_error, user_location
from autostate.graph.kinds import (
    CALLABLES,
    CANONICAL,
    FROM_LEAVES,
    HELD,
    KINDS,
    LAZY,
    MODEL_CHILD,
    REACHED,
    REACHED_CONTAINER,
    REACHED_INSTANCE,
    RUNNING,
    SHARED_NODES,
    STATEFUL_CLASSES,
    BoundRef,
    attr_name,
    bound_ref,
    held_instances,
    index_name,
    is_stateful_instance,
    key_name,
    mapping_name,
    materialized,
    named_keys,
    path_name,
    reached_role,
    register_node_kind,
    set_after_copy,
)
from autostate.tree import INFO_ATTR, StaticLeaf
from autostate.values import copy_static, is_array_or_spec, is_mutable_static, kind_of


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
    if t is list or t is tuple or t is dict or t in MODEL_CHILD:
        return False
    return jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(value))


def is_model_child(value: Any) -> bool:
    """Whether ``value`` is a node a model holds as a child model (a decorated
    instance, a stack of layers), never a method to call."""
    return type(value) in MODEL_CHILD


def is_dynamic(value: Any) -> bool:
    """Whether an attribute value is a pytree child (else it is static aux data)."""
    t = type(value)
    vkind = kind_of(value)
    if vkind.static:
        return False
    if t in MODEL_CHILD or vkind.array or vkind.spec:
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
    out = []
    for k, v in items:
        if is_static_leaf(v):
            out.append((k, StaticLeaf(v)))
            positions.append((*path, k))
        else:
            new, sub = _wrap_statics(v, (*path, k))  # (``v`` itself where ``sub`` is empty)
            positions.extend(sub)
            out.append((k, new))
    if not positions:
        return value, ()
    if t is dict:
        return dict(out), tuple(positions)
    return t(v for _, v in out), tuple(positions)


def _replace_at(value: Any, path: tuple, fn: Callable[[Any], Any]) -> Any:
    if not path:
        return fn(value)
    head, rest = path[0], path[1:]
    items = dict(value) if type(value) is dict else list(value)
    items[head] = _replace_at(items[head], rest, fn)
    return items if type(value) is dict else type(value)(items)


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
    kinds = KINDS

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
    kind = KINDS.get(t)
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


def _held_instances_step(node: Any) -> list[tuple[str, Any]]:
    """The children that may lead to a decorated instance: an instance's
    attributes, a list's, tuple's or dict's items (a state's value is not walked)."""
    t = type(node)
    if t in STATEFUL_CLASSES:
        items = node.__dict__.items()
        return [(attr_name(k), v) for k, v in items if type(v) in _HOLDERS or type(v) in STATEFUL_CLASSES]
    if t is list or t is tuple:
        return [(index_name(i), v) for i, v in enumerate(node)]
    if t is dict:
        return [(mapping_name(k), v) for k, v in node.items()]
    return []


_HOLDERS = (list, tuple, dict)


def instance_paths(tops: Sequence[Any]) -> dict[int, str]:
    """``id -> "Class.path"`` of the decorated instances ``tops`` hold in their
    attributes, lists, tuples and dicts, each named from the first top that
    reaches it (``Net.blocks[1].norm``): how an error tells apart two
    instances of one class.

    Example:
        >>> import jax.numpy as jnp
        >>> @autostate.stateful
        ... class Leaf:
        ...     def __init__(self):
        ...         self.w = jnp.ones(2)
        >>> @autostate.stateful
        ... class Pair:
        ...     def __init__(self):
        ...         self.leaves = [Leaf(), Leaf()]
        >>> pair = Pair()
        >>> instance_paths([pair])[id(pair.leaves[1])]
        'Pair.leaves[1]'
    """
    paths: dict[int, str] = {}
    for top in tops:
        if id(top) in paths:
            continue
        for path, sub in iter_tree(top, is_stateful_instance, into_targets=True,
                                   children=_held_instances_step):
            if path and id(sub) not in paths:
                paths[id(sub)] = f"{type(top).__name__}.{path}"
    return paths


def instances_of(tree: Any) -> list[Any]:
    """Every decorated instance reachable in ``tree``, once each."""
    return [obj for _, obj in iter_tree(tree, is_stateful_instance, into_targets=True)]


def instance_ids(tree: Any) -> frozenset[int]:
    """Ids of every decorated instance reachable in ``tree``."""
    return frozenset(map(id, instances_of(tree)))


def holds_instance(value: Any) -> bool:
    """Whether ``value`` is, or contains, a decorated instance (a sub-model) or
    a method bound to one (``self._eval``)."""
    t = type(value)
    if t in STATEFUL_CLASSES:
        return True
    if t in CALLABLES:
        return held_instances(value) is not None
    if (vkind := kind_of(value)).static or vkind.array:
        return False
    return next(iter_tree(value, _instance_or_bound), None) is not None


def _instance_or_bound(value: Any) -> bool:
    t = type(value)
    if t in STATEFUL_CLASSES:
        return True
    held = HELD.get(t)
    if held is not None:
        return any(holds_instance(v) for _, v in held(value))
    return _bound_to_instance(value)


# --- the containers a model holds outside its states ----------------------------
# Inside a traced call (a jitted ``f``, a ``lax`` body) a list or dict that is
# not state cannot change in place as plain Python would change it: the change
# is made once per trace, and a traced value put there outlives the trace. The
# guard snapshots these containers before such a call (``mutable_statics``),
# and refuses and undoes a change after it (``changed_statics``,
# ``restore_statics``: each container's value kind compares and restores it,
# ``values.Kind.same`` / ``restore``). They are not nodes of the model graph
# (a list of numbers is static data there): the walk follows the value kinds
# (a container's items, a tuple's, a plain object's ``__dict__``) with the one
# loop of ``iter_tree``.


def mutable_statics(
    instances: list[Any], values: Sequence[tuple[str, Any]] = (), *, shared: bool = False
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

    ``shared``: only those every rebuild of the instances shares
    (``rebuild_instances``): the instances' own lists and dicts, at any depth,
    are copied into each rebuild (``values.copy_static``), but what a plain
    object or a class holds is not: a change to it outlives the call.

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
        for root in _shared_parts(value) if shared else (value,):
            walk = iter_tree(
                root, _values.is_watched, into_targets=True, children=_held_outside_states, seen=seen
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


def changed_statics(saved: Sequence[tuple[Any, Any, str]]) -> list[tuple[Any, str]]:
    """``(container, where)`` for each container of ``saved`` (``mutable_statics``)
    that no longer holds what its copy holds (its value kind's ``same``)."""
    return [(c, where) for c, contents, where in saved if not kind_of(c).same(c, contents)]  # type: ignore[misc]


def restore_statics(saved: Sequence[tuple[Any, Any, str]]) -> None:
    """Puts back the contents of each container of ``saved`` (``mutable_statics``)
    that changed (its value kind's ``restore``)."""
    for c, contents, _where in saved:
        kind = kind_of(c)
        if not kind.same(c, contents):  # type: ignore[misc]
            kind.restore(c, contents)  # type: ignore[misc]


def _may_hold_containers(value: Any) -> bool:
    """Not a leaf, a decorated instance (visited as one of the instances) or a
    ``shared`` node (a handled slot: frozen and childless)."""
    t, kind = type(value), kind_of(value)
    return not (kind.atom or kind.array or t in STATEFUL_CLASSES or t in SHARED_NODES)


def _is_plain_holder(value: Any) -> bool:
    """An object ``_held_outside_states`` steps into through its ``__dict__``."""
    kind = kind_of(value)
    return not (kind.mutable or kind is _values.TUPLE) and plain_attributes(value) is not None


def _shared_parts(value: Any) -> list[Any]:
    """The ``__dict__``s of the plain objects ``value`` holds through its lists,
    dicts and tuples (which a rebuild copies; a plain object it shares)."""
    holders = iter_tree(value, _is_plain_holder, children=_held_outside_states, seen=set())
    return [plain_attributes(obj) for _, obj in holders]


def _held_outside_states(value: Any) -> list[tuple[str, Any]]:
    """The step of ``mutable_statics``'s walk: a container's items (a set's or
    bytearray's aside), a tuple's, a closure cell's value, a plain object's
    ``__dict__`` (a dict)."""
    kind = kind_of(value)
    if kind is _values.SET or kind is _values.BYTEARRAY:
        return []
    if kind is _values.CELL:
        return [("", item) for item in kind.items(value) if _may_hold_containers(item)]  # type: ignore[misc]
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
    steps = REACHED
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
        if role == REACHED_INSTANCE:
            found.append(node)
        elif role == REACHED_CONTAINER:
            containers.append(node)
        push([item for item in reached(node) if not holds_nothing(item)])
    return found


def _reached_by_base(node: Any) -> tuple[Callable[[Any], Iterable[Any]], int] | None:
    """The ``reached`` step of a subclass of a list, tuple, dict or partial
    (none of its own): its base's."""
    for base in (list, dict, tuple, functools.partial):
        if isinstance(node, base):
            return REACHED[base][0], reached_role(type(node), False)
    return None


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
    how = RUNNING.get(type(value))
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
        canonical = CANONICAL.get(type(value))
        if canonical is not None:
            value = canonical(value)
        bound = _bound_to_self(obj, value)
        if bound is not None:
            aux.append(("m", name, bound))  # rebound to the rebuilt instance
        elif RUNNING and (running := _running_part(value)) is not None:
            aux.append(("r", name, (type(value), running[1])))
            children.append(running[0])
        elif is_dynamic(value):
            if type(value) in STATEFUL_CLASSES and _leads_back(value, obj):
                raise _cycle_error(obj, name, value)
            value, positions = _wrap_statics(value)
            kept = _in_order(value, sorted_too=False)
            if kept is not value:  # (a dict whose keys do not sort: JAX's flatten raised)
                aux.append(("o", name, positions))
                children.append(kept)
                continue
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


def _bound_to_self(obj: Any, value: Any) -> BoundRef | None:
    """A method of, closure over or weak reference to ``obj`` alone, as the
    per-instance flatten keeps it (rebound to each rebuilt instance)."""
    if type(value) not in CALLABLES:
        return None
    held = held_instances(value)
    if held is None or any(h is not None and h is not obj for h in held):
        return None
    return bound_ref(value, [-1 if h is None else 0 for h in held])


def _flatten_as(obj: Any, d: dict, layout: tuple) -> tuple[list[Any], tuple]:
    aux: list[Any] = []
    children: list[Any] = []
    for entry in layout:
        name = _entry_name(entry)
        value = d[name]
        canonical = CANONICAL.get(type(value))
        if canonical is not None:
            value = canonical(value)
        if RUNNING and (running := _running_part(value)) is not None:
            aux.append(("r", name, (type(value), running[1])))
            children.append(running[0])
        elif type(entry) is str:
            aux.append(entry)
            children.append(value)
        elif entry[0] == "c":
            aux.append(entry)
            children.append(_wrap_at(value, entry[2]))
        elif entry[0] == "o":
            aux.append(entry)
            children.append(_in_order(_wrap_at(value, entry[2]), sorted_too=False))
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
        if type(entry) is str or entry[0] in "cor"
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
            elif entry[0] == "c" or entry[0] == "o":
                d[entry[1]] = _unwrap_at(next(it), entry[2])
            elif entry[0] == "m":
                d[entry[1]] = entry[2].rebind([obj])
            elif entry[0] == "r":
                slot_type, key = entry[2]
                d[entry[1]] = RUNNING[slot_type][1](key, next(it))
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
    kind = KINDS.get(cls)
    if kind is None:
        jax.tree_util.register_pytree_with_keys(
            cls, _flatten_instance_with_keys, _make_unflatten(cls), _flatten_instance
        )
        register_node_kind(
            cls,
            # (A lazy attribute as the value it stands for: see ``materialized``.)
            children=lambda obj: [
                ("." + k, materialized(v) if type(v) in LAZY else v)
                for k, v in obj.__dict__.items()
            ],
            by_identity=True,
            empty=lambda obj: object.__new__(type(obj)),
            fill=_fill_instance,
            model_child=True,
            after_copy=after_copy,
            reached=lambda obj: obj.__dict__.values(),
        )
    elif kind.after_copy is not after_copy:
        set_after_copy(cls, after_copy)


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


def _bound_to_instance(value: Any) -> bool:
    """Whether ``value`` is a method of, or a closure over, a decorated instance."""
    return held_instances(value) is not None


def _same_function(value: Any, ref: BoundRef) -> bool:
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


class _InOrder(dict):
    """A dict whose keys are not in sorted order, as the graph flattens it:
    JAX orders a dict by its keys, so a dict rebuilt from a treedef (the copy a
    compiled call's program runs on) would iterate in another order than the
    model's (``for block in self.blocks.values()``). This node keeps the keys
    in their own order in the treedef, and its rebuild is a plain dict in
    that order. It lives only inside treedefs; the model never holds one."""


def _plain_dict(keys: tuple, children: Iterable[Any]) -> Any:
    return dict(zip(keys, children))


jax.tree_util.register_pytree_with_keys(
    _InOrder,
    lambda d: ([(jax.tree_util.DictKey(k), v) for k, v in d.items()], tuple(d)),
    _plain_dict,
    flatten_func=lambda d: (list(d.values()), tuple(d)),
)


def _in_order(value: Any, sorted_too: bool = True) -> Any:
    """``value`` with each dict (in its lists, tuples and dicts) whose keys are
    not in sorted order, or do not sort (``{1: a, (2, 'x'): b}``: JAX's
    flatten sorts them, and raises), made an ``_InOrder``, for the graph's
    flatten; the value itself when there is none. ``sorted_too=False``: only
    the dicts whose keys do not sort (the per-instance flatten, where JAX's
    order of the others is the pytree's). (A state's value is not walked
    here: a states dict holding such a dict is refused where JAX must flatten
    it, ``unsortable``.)"""
    t = type(value)
    if t is dict:
        children = {k: _in_order(v, sorted_too) for k, v in value.items()}
        keys = list(value)
        try:
            ordered = keys == sorted(keys) or not sorted_too
        except TypeError:
            ordered = False
        if not ordered:
            return _InOrder(children)
        if any(children[k] is not v for k, v in value.items()):
            return children
        return value
    if t is list or t is tuple:
        items = [_in_order(v, sorted_too) for v in value]
        if any(a is not b for a, b in zip(items, value)):
            return t(items)
    return value


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
            canonical = CANONICAL.get(type(value))
            if canonical is not None:
                value = canonical(value)
            if not is_dynamic(value):
                held = held_instances(value) if type(value) in CALLABLES else None
                if held is not None:
                    here = prefix + attr_name(name) + ".__self__"
                    here_keys = (*prefix_keys, attr_key(name))
                    indices = [-1 if h is None else visit(h, here, here_keys) for h in held]
                    entries.append((name, None, bound_ref(value, indices)))
                else:
                    entries.append((name, None, StaticLeaf(copy_static(value, statics))))
                continue
            flat, treedef = jax.tree_util.tree_flatten_with_path(
                _in_order(value), is_leaf=_graph_leaf
            )
            parts: list[Any] = []
            here = prefix + attr_name(name)
            here_keys = (*prefix_keys, attr_key(name))
            for path, leaf in flat:
                sub = here + "".join(key_name(k) for k in path)
                if type(leaf) in STATEFUL_CLASSES:
                    parts.append(-1 - visit(leaf, sub, (*here_keys, *named_keys(path))))
                elif is_array_or_spec(leaf):
                    # One array in two places (``self.head.w = self.embed.w``)
                    # is one leaf, as a shared sub-model is.
                    at = arrays.get(id(leaf))
                    if at is None:
                        at = arrays[id(leaf)] = len(leaves)
                        leaves.append(leaf)
                        names.append(path_name(sub))
                        keys.append((*here_keys, *named_keys(path)))
                    parts.append(at)
                elif type(leaf) in CALLABLES and (held := held_instances(leaf)) is not None:
                    where, where_keys = f"{sub}.__self__", (*here_keys, *named_keys(path))
                    indices = [-1 if h is None else visit(h, where, where_keys) for h in held]
                    parts.append(bound_ref(leaf, indices))
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
            canonical = CANONICAL.get(type(value))
            if canonical is not None:
                value = canonical(value)
            if treedef is None:
                if type(parts) is BoundRef:
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
            flat, new_def = jax.tree_util.tree_flatten(_in_order(value), is_leaf=_graph_leaf)
            if new_def != treedef or len(flat) != len(parts):
                return False
            for leaf, p in zip(flat, parts):
                if type(p) is BoundRef:
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

    def _same_instance(value: Any, ref: BoundRef) -> bool:
        """A method or closure in the place of ``ref``: its code, its instances' indices."""
        held = held_instances(value) if _same_function(value, ref) else None
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
                    if type(parts) is BoundRef:
                        steps.append((name, _BOUND, parts))
                    else:
                        how = _STATIC_COPY if is_mutable_static(parts.value) else _STATIC
                        steps.append((name, how, parts.value))
                elif not parts and type(shared := treedef.unflatten([])) in SHARED_NODES:
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


def attribute_value(graphdef: GraphDef, at: tuple[int, int], leaves: Any) -> Any:
    """The value ``rebuild_instances`` gives attribute ``at`` (``(instance,
    attribute)`` indices) from ``leaves`` (anything indexed by leaf number);
    for an attribute holding no sub-model and no bound method."""
    _, how, what = _rebuild_plan(graphdef)[at[0]][1][at[1]]
    return _rebuilt(how, what, leaves, [], {})


def lazy_attributes(graphdef: GraphDef) -> list[list[tuple[int, ...] | None]]:
    """Per instance of ``graphdef``, per attribute: the leaves it holds where
    its value may stand in a lazy slot (one array, or a tree of arrays in
    tuples and other nodes that never change in place, with static values
    that do not either), else ``None``: nothing in it but its leaves can
    change, so a value made from the leaves later is the same value."""
    found = graphdef.cache.get("lazy")
    if found is None:
        found = []
        for _, steps in _rebuild_plan(graphdef):
            row: list[tuple[int, ...] | None] = []
            for _, how, what in steps:
                if how == _LEAF:
                    row.append((what,))
                elif how == _GENERAL and _immutable_tree(what[0]) and all(
                    (type(p) is int and p >= 0)
                    or (type(p) is StaticLeaf and not is_mutable_static(p.value))
                    for p in what[1]
                ):
                    row.append(tuple(p for p in what[1] if type(p) is int))
                else:
                    row.append(None)
            found.append(row)
        graphdef.cache["lazy"] = found
    return found


def _immutable_tree(treedef: Any) -> bool:
    """Whether no node of ``treedef`` is a list or a dict (or another mutable container)."""
    data = treedef.node_data()
    if data is None:
        return True
    t = data[0]
    if _mutable_node(t):
        return False
    return all(_immutable_tree(child) for child in treedef.children())


def _mutable_node(t: type) -> bool:
    """Whether a pytree node of type ``t`` is a container changed in place (a
    list, a dict, a subclass of one, a deque, another mutable mapping or
    sequence)."""
    return issubclass(t, (list, dict, collections.deque, collections.abc.MutableMapping,
                          collections.abc.MutableSequence))


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
        if type(p) is BoundRef
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
    if data[0] in FROM_LEAVES:
        make, aux, count = FROM_LEAVES[data[0]], data[1], treedef.num_leaves
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
