"""The node-kind registry: one ``NodeKind`` record per node type, and path names.

Every node type the walks treat specially is described by one record: which
children the walk descends into and how each child's path is named (``.w``,
``[0]``, ``['k']``), how the node is rebuilt around new children, whether a
value of the type is a pytree child of a decorated instance, the form the
flatten and the change check see it in, how the slot of a running call
flattens, how the witness sees it, its stacked form and what code reaching
it reaches. A type is registered once (``register_node_kind``; a second
registration is an error) and looked up by ``node_kind``. Builtin containers
and callables are registered here; decorated classes by
``graph.register_stateful_class``; the engine and the runtime register their
slot types.

The walks (``graph.walk``) and the change check (``graph.witness``) read the
records through the views below, one dict or set look-up per node. This
module stands on nothing of the package at import (its one error is
imported when raised), so that every layer may register its kinds.

Example:
    >>> from autostate import graph
    >>> graph.node_kind(list).children([1, 2])
    [('[0]', 1), ('[1]', 2)]
"""

from __future__ import annotations

import dataclasses
import functools
import types
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import jax

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
        lazy: the value stands for another, ``canonical(value)``, not made
            until read (an attribute a compiled call left in its packed
            buffers): every walk of an instance's attributes and every copy
            sees that one (``materialized``).
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
    lazy: bool = False


KINDS: dict[type, NodeKind] = {}

# Views of ``KINDS`` by field, for the hot loops of the flatten and the change
# check (one set or dict lookup per attribute). Only ``_install`` writes them.
STATEFUL_CLASSES: dict[type, Callable[[Any], None] | None] = {}  # decorated class -> after_copy
MODEL_CHILD: set[type] = set()
CANONICAL: dict[type, Callable[[Any], Any]] = {}
SHARED_NODES: set[type] = set()
RUNNING: dict[type, tuple[Callable[[Any], Any], Callable[[Any, Any], Any]]] = {}
HELD: dict[type, Callable[[Any], list[tuple[str, Any]]]] = {}
# ``Witness``'s: how to read what a value holds, or ``None`` for an immutable one.
WITNESSED: dict[type, Callable[[Any], Any] | None] = {}
# The transformations' and loop rolling's: a stack's stacked model, whether a
# loop over it must roll, what code reaching a node reaches, and the slots
# that hold their own value.
STACKS: dict[type, Callable[[Any], Any]] = {}
MUST_ROLL: dict[type, Callable[[Any], bool]] = {}
OWN_VALUE_SLOTS: set[type] = set()
# ``reachable_instances``': per type, its ``reached`` step and what a node of
# it is there (``REACHED_ONLY``, ``REACHED_INSTANCE``, ``REACHED_CONTAINER``).
REACHED: dict[type, tuple[Callable[[Any], Iterable[Any]], int]] = {}
REACHED_ONLY, REACHED_INSTANCE, REACHED_CONTAINER = range(3)
# The rebuild's: the kinds made straight from their leaves.
FROM_LEAVES: dict[type, Callable[[Any, list[Any]], Any]] = {}
# The values that stand for another until read (``lazy``).
LAZY: set[type] = set()


def node_kind(cls: type) -> NodeKind | None:
    """The registered kind of ``cls`` (exactly that type), or ``None``.

    Example:
        >>> from autostate import graph
        >>> graph.node_kind(dict).children({"k": 1})
        [("['k']", 1)]
        >>> graph.node_kind(int) is None
        True
    """
    return KINDS.get(cls)


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
    if cls in KINDS:
        from autostate.errors import InvalidArgumentError, format_error  # (raised: see above)

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


# The views that copy one field each: a set holds the types whose field is
# true, a dict maps a type to its field's value where it is set.
_FIELD_VIEWS: tuple[tuple[str, set[type] | dict[type, Any]], ...] = (
    ("model_child", MODEL_CHILD), ("canonical", CANONICAL), ("shared", SHARED_NODES),
    ("running", RUNNING), ("held", HELD), ("own_value", OWN_VALUE_SLOTS),
    ("from_leaves", FROM_LEAVES), ("lazy", LAZY),
)


def _install(kind: NodeKind) -> None:
    """Puts ``kind`` in the registry and its fields in the views."""
    cls = kind.type
    KINDS[cls] = kind
    for field, view in _FIELD_VIEWS:
        value = getattr(kind, field)
        if isinstance(view, set):
            if value:
                view.add(cls)
        elif value is not None:
            view[cls] = value
    if kind.by_identity:
        STATEFUL_CLASSES[cls] = kind.after_copy
    if kind.witnessed is not None or kind.immutable:
        WITNESSED[cls] = kind.witnessed
    reached = kind.reached
    if kind.stacked is not None:
        stacked = kind.stacked
        STACKS[cls] = stacked
        MUST_ROLL[cls] = kind.must_roll or (lambda node: False)
        if reached is None:
            reached = lambda node: [stacked(node)]  # noqa: E731
    if reached is not None:
        REACHED[cls] = (reached, reached_role(cls, kind.by_identity))


def materialized(value: Any) -> Any:
    """``value`` as every walk and copy sees it: a ``lazy`` kind's value is
    made (its ``canonical``), any other is itself.

    Example:
        >>> materialized(3)
        3
    """
    if type(value) in LAZY:
        return CANONICAL[type(value)](value)
    return value


def set_after_copy(cls: type, after_copy: Callable[[Any], None] | None) -> None:
    """Replaces the ``after_copy`` of ``cls``'s kind (a decorated class decorated
    again, with other options): it stays one record."""
    _install(dataclasses.replace(KINDS[cls], after_copy=after_copy))


def reached_role(cls: type, by_identity: bool) -> int:
    """What ``reachable_instances`` takes a ``cls`` node it reaches for: an
    instance, a container a body may change in place (a list or dict, or a
    subclass of one; a tuple subclass too), or neither."""
    if by_identity:
        return REACHED_INSTANCE
    if cls is not tuple and issubclass(cls, (list, tuple, dict)) or cls is types.CellType:
        return REACHED_CONTAINER
    return REACHED_ONLY


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


def named_keys(path: tuple) -> tuple:
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


CALLABLES = (types.MethodType, types.FunctionType, weakref.ReferenceType, weakref.WeakMethod)


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
    how = HELD.get(type(value))
    if how is None and isinstance(value, functools.partial):
        how = _partial_parts
    return None if how is None else how(value)


def _function_reached(function: Any) -> list[Any]:
    """What a function's code holds: its cells (each reaching what it holds),
    defaults and ``__wrapped__``."""
    items: list[Any] = list(function.__closure__ or ())
    items.extend(function.__defaults__ or ())
    wrapped = getattr(function, "__wrapped__", None)
    if wrapped is not None:
        items.append(wrapped)
    return items


def _cell_reached(cell: Any) -> list[Any]:
    try:
        return [cell.cell_contents]
    except ValueError:  # (an empty cell)
        return []


class BoundRef:
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
        if type(other) is not BoundRef:
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


def held_instances(value: Any) -> list[Any] | None:
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


def bound_ref(value: Any, indices: list[int]) -> BoundRef:
    """The graphdef entry of ``value``, given its held instances' graph indices."""
    if type(value) is types.MethodType:
        return BoundRef(value.__func__, (indices[0],), "method")
    if type(value) is weakref.ReferenceType:
        return BoundRef(None, (indices[0],), "weakref")
    if type(value) is weakref.WeakMethod:
        method: Any = value()  # alive: it was found bound to an instance
        return BoundRef(method.__func__, (indices[0],), "weakmethod")
    return BoundRef(value, tuple(indices), "closure")


# --- the builtin kinds ----------------------------------------------------------


def _callable_children(value: Any) -> list[tuple[str, Any]]:
    """The instances a method, closure or weak reference is bound to, at
    ``.__self__`` (none for one bound to no decorated instance)."""
    held = held_instances(value)
    return [] if held is None else [(".__self__", h) for h in held if h is not None]


def _rebind_callable(value: Any, copies: list[Any]) -> Any:
    """``value`` bound to ``copies`` of its instances, as ``flatten_graph`` rebinds."""
    held = held_instances(value)
    assert held is not None  # it had children
    it = iter(copies)
    bound = [None if h is None else next(it) for h in held]
    return bound_ref(value, [-1 if h is None else k for k, h in enumerate(held)]).rebind(bound)


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
for _callable in CALLABLES:
    register_node_kind(
        _callable,
        children=_callable_children,
        rebuild=_rebind_callable,
        reached=_CALLABLE_REACHED.get(_callable),
    )
del _callable, _CALLABLE_REACHED
# A function's cell: the variable it captures, which a ``nonlocal`` statement
# may rebind (a container to watch), reaching what it holds.
register_node_kind(types.CellType, reached=_cell_reached)

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
        # Code reaching a partial reaches what it holds: its function and
        # arguments. (A generator's frame or a lazy map is not code a body runs.)
        reached=(lambda p: [part for _, part in _partial_parts(p)])
        if _type is functools.partial else None,
    )
del _held_by, _type, _held
