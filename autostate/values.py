"""The one table of value kinds: what kind of value is this, and what can be done with it.

Every question of the form "what kind of value is this" that autostate asks
goes through ``kind_of``: is it an array, a Python number, static data that is
never a pytree child, a container code can change in place, a container JAX
takes as one leaf. Each kind is one ``Kind`` record; what varies per kind (how
to copy it before an in-place operator, how to write or delete one item as a
functional update, how to take a container JAX does not flatten apart) hangs
off the record, not off ``isinstance`` branches at the call sites.

The kind of a value is the kind of its type: ``kind_of`` looks the type up in
a dict, and the first time it meets a type it classifies it by its method
resolution order (a ``Counter`` is a dict subclass, ``numpy.float64`` a numpy
scalar before it is a float) and remembers the answer. Tracers are arrays.

The questions, each asked in one place:

* ``Kind.array``: data JAX computes with -- a JAX array (concrete or traced),
  a numpy array or a numpy scalar (``is_array``); with ``jax.ShapeDtypeStruct``,
  ``is_array_or_spec``. ``Kind.numpy``: numpy data (``is_numpy``), which
  state converts to a JAX array.
* ``Kind.number``: a Python number (``bool``, ``int``, ``float``, ``complex``,
  an ``IntEnum`` member), which becomes an array where one is needed.
* ``foreign_leaf``: a leaf no traced program can return and no static
  data is (a function, a plain object): what ``f``'s states cannot carry.
* ``Kind.atom``: a number, ``str``, ``bytes`` or ``None``: it holds no other
  value, so no walk looks inside it (``holds_nothing`` adds arrays).
* ``Kind.static``: never a pytree child of a model -- atoms, enum members,
  classes, functions, methods, modules: static aux data wherever it sits.
* ``Kind.mutable``: a builtin container code changes in place (``list``,
  ``dict``, ``set``, ``bytearray``, ``deque`` and their subclasses): held
  outside states it is snapshotted around a traced call and copied, item by
  item, into each model a graphdef rebuilds.
* ``Kind.same`` / ``Kind.restore``: whether a container still holds what a
  snapshot of it (``Kind.copy``) held, and putting that back: every mutable
  kind, and a closure cell, which a nested function's ``nonlocal``
  statement rebinds (``is_watched``).
* ``Kind.copy``: a shallow copy of a container an in-place operator changes
  (the mutable kinds and ``UserDict``/``UserList``); state never changes in
  place, so ``self.x += v`` runs the operator on a copy.
* ``Kind.update`` / ``Kind.delete``: ``c[k] = v`` / ``del c[k]`` as a copy of
  the same type (``self.x[k] = v`` on a state).
* ``Kind.items``: a container JAX takes as one leaf (a dict or list subclass,
  a ``deque``, a ``UserDict``/``UserList``) as a plain dict or list of its
  items; whether JAX flattens the type after all (``OrderedDict``) is asked of
  JAX at the call, since a type may be registered after it was first met.
* ``opaque_items`` / ``leaves_within_opaque``: a container JAX takes as one
  leaf, as its items; ``CONCRETE_LEAF_TYPES``: the types met as leaves that
  are not tracers (no walk needed); ``is_iterator``: an iterator, a leaf.
* ``Kind.sealed``: a collection the model graph does not walk into (``set``,
  ``frozenset``, ``deque``): a sub-model inside one would not be functionalized.

This module imports nothing from autostate.

Example:
    >>> import collections
    >>> from autostate import values
    >>> values.kind_of(collections.Counter(a=1)) is values.DICT_SUBCLASS
    True
    >>> values.kind_of(jnp.zeros(3)).array, values.kind_of(3).static
    (True, True)
    >>> d = collections.deque([1, 2])
    >>> values.kind_of(d).update(d, 0, 9), d
    (deque([9, 2]), deque([1, 2]))
"""

from __future__ import annotations

import collections
import copy as _copy
import dataclasses
import enum
import operator
import types
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax._src.lax import lax as _lax_internal  # (a weakly typed array: no public spelling)

__all__ = [
    "Kind", "kind_of", "is_array", "is_array_or_spec", "is_numpy", "is_python_number",
    "foreign_leaf", "holds_nothing", "is_mutable", "is_watched", "is_mutable_static", "copy_static",
    "CONCRETE_LEAF_TYPES", "is_iterator", "TAKING_APART", "opaque_items", "leaves_within_opaque",
    "weakly_typed",
]


@dataclasses.dataclass(frozen=True, eq=False)
class Kind:
    """One kind of value: the answers to the module docstring's questions
    (``spec``: a ``jax.ShapeDtypeStruct``) and its operations, ``None`` where it
    has none: ``copy`` (shallow, same type), ``update(c, key, v)`` and
    ``delete(c, key)`` (copies), ``items(c)`` (a plain dict or list of them),
    ``same(c, contents)`` (by identity: an item may be a tracer),
    ``restore(c, contents)`` (into ``c`` itself) and ``fill(empty, items,
    maxlen)`` (a new container of a subclass, made by ``cls.__new__``)."""

    name: str
    array: bool = False
    numpy: bool = False
    spec: bool = False
    number: bool = False
    atom: bool = False
    static: bool = False
    mutable: bool = False
    sealed: bool = False
    copy: Callable[[Any], Any] | None = None
    update: Callable[[Any, Any, Any], Any] | None = None
    delete: Callable[[Any, Any], Any] | None = None
    items: Callable[[Any], dict | list] | None = None
    same: Callable[[Any, Any], bool] | None = None
    restore: Callable[[Any, Any], None] | None = None
    fill: Callable[[Any, Any, int | None], None] | None = None

    def __repr__(self) -> str:
        return f"<value kind {self.name}>"


# --- per-kind operations ----------------------------------------------------------


def _array_update(a: Any, key: Any, v: Any) -> Any:
    # (Also another array type with JAX's ``.at``: the only objects taking item writes.)
    return a.at[key].set(v)


def _updated_with(copy: Callable[[Any], Any]) -> Callable[[Any, Any, Any], Any]:
    def update(c: Any, key: Any, v: Any) -> Any:
        new = copy(c)
        new[key] = v
        return new

    return update


def _deleted_with(copy: Callable[[Any], Any]) -> Callable[[Any, Any], Any]:
    def delete(c: Any, key: Any) -> Any:
        new = copy(c)
        del new[key]
        return new

    return delete


def _tuple_update(c: Any, key: Any, v: Any) -> Any:
    items = list(c)
    items[key] = v
    # (A tuple subclass with ``_fields`` is built from its items, as a named tuple is.)
    return type(c)(*items) if hasattr(c, "_fields") else tuple(items)


def _same_items(c: Any, contents: Any) -> bool:
    return len(c) == len(contents) and all(map(operator.is_, c, contents))


def _same_mapping(c: Any, contents: Any) -> bool:
    return list(c) == list(contents) and all(map(operator.is_, c.values(), contents.values()))


def _same_value(c: Any, contents: Any) -> bool:
    return bool(c == contents)  # (a set's or bytearray's items are hashable atoms)


def _restore_slice(c: Any, contents: Any) -> None:
    c[:] = contents


def _restore_deque(c: Any, contents: Any) -> None:
    c.clear()
    c.extend(contents)


def _restore_mapping(c: Any, contents: Any) -> None:
    # (Also a set's. The subclass's own methods: an OrderedDict keeps its order
    # apart from dict's.)
    c.clear()
    c.update(contents)


def _fill_user(new: Any, items: Any, maxlen: int | None) -> None:
    new.data = items


_EMPTY_CELL: Any = object()  # (what an empty cell holds, to ``same`` and ``restore``)


def _cell_contents(c: Any) -> Any:
    try:
        return c.cell_contents
    except ValueError:  # (a variable not yet assigned)
        return _EMPTY_CELL


def _restore_cell(c: Any, contents: Any) -> None:
    if contents is _EMPTY_CELL:
        del c.cell_contents
    else:
        c.cell_contents = contents


_same_type_copy = _copy.copy  # keeps the subclass (a defaultdict's factory, a deque's maxlen)
_same_type_update = _updated_with(_same_type_copy)
_same_type_delete = _deleted_with(_same_type_copy)


# --- the kinds ---------------------------------------------------------------------

ARRAY = Kind("array", array=True, update=_array_update)
"""A JAX array, concrete or traced."""
NUMPY_ARRAY = Kind("numpy array", array=True, numpy=True, update=_updated_with(np.ndarray.copy))
NUMPY_SCALAR = Kind("numpy scalar", array=True, numpy=True)
ARRAY_SPEC = Kind("array spec", spec=True)
"""``jax.ShapeDtypeStruct``: an array's shape and dtype, no data."""

NUMBER = Kind("number", number=True, atom=True, static=True)
"""``bool``, ``int``, ``float``, ``complex`` (and subclasses)."""
TEXT = Kind("text", atom=True, static=True)
"""``str``, ``bytes`` (and subclasses)."""
NONE = Kind("None", atom=True, static=True)
ENUM = Kind("enum member", static=True)
NUMBER_ENUM = Kind("number enum member", number=True, static=True)
"""An ``IntEnum``/``IntFlag`` member: an enum member that is also an ``int``."""
CODE = Kind("code", static=True)
"""A class, function, method, builtin function or module."""

LIST = Kind(
    "list", mutable=True, copy=list, update=_updated_with(list), delete=_deleted_with(list),
    same=_same_items, restore=_restore_slice,
)
DICT = Kind(
    "dict", mutable=True, copy=dict, update=_updated_with(dict), delete=_deleted_with(dict),
    same=_same_mapping, restore=_restore_mapping,
)
SET = Kind(
    "set", mutable=True, sealed=True, copy=_same_type_copy, same=_same_value,
    restore=_restore_mapping,
)
BYTEARRAY = Kind(
    "bytearray", mutable=True, copy=_same_type_copy, same=_same_value, restore=_restore_slice
)
# The operations of a container copied as its own type (a subclass keeps its class).
_SAME_TYPE: dict[str, Any] = dict(
    copy=_same_type_copy, update=_same_type_update, delete=_same_type_delete
)
DEQUE = Kind(
    "deque", mutable=True, sealed=True, **_SAME_TYPE, items=list, same=_same_items,
    restore=_restore_deque,
    fill=lambda new, items, maxlen: collections.deque.__init__(new, items, maxlen),
)
LIST_SUBCLASS = Kind(
    "list subclass", mutable=True, **_SAME_TYPE, items=list, same=_same_items,
    restore=_restore_slice, fill=lambda new, items, maxlen: list.extend(new, items),
)
"""A subclass of ``list``: JAX takes one as one leaf unless it is registered."""
DICT_SUBCLASS = Kind(
    "dict subclass", mutable=True, **_SAME_TYPE, items=lambda c: dict(dict.items(c)),
    same=_same_mapping, restore=_restore_mapping,
    # (The subclass's own ``update``: an OrderedDict keeps its order apart.)
    fill=lambda new, items, maxlen: new.update(items),
)
"""A subclass of ``dict`` (``Counter``; ``OrderedDict`` and ``defaultdict``, which JAX flattens)."""
USER_DICT = Kind("UserDict", **_SAME_TYPE, items=lambda c: dict(c.data), fill=_fill_user)
USER_LIST = Kind("UserList", **_SAME_TYPE, items=lambda c: list(c.data), fill=_fill_user)
TUPLE = Kind("tuple", update=_tuple_update)
NAMED_TUPLE = Kind("named tuple", update=_tuple_update)
"""A tuple subclass with ``_fields`` and ``_make`` (``typing.NamedTuple``: optax's states)."""
TUPLE_SUBCLASS = Kind("tuple subclass", update=_tuple_update)
FROZENSET = Kind("frozenset", sealed=True)
CELL = Kind(
    "closure cell", copy=_cell_contents, same=lambda c, held: _cell_contents(c) is held,
    restore=_restore_cell,
    items=lambda c: [] if _cell_contents(c) is _EMPTY_CELL else [c.cell_contents],
)
"""A variable of a function that a nested function holds (``types.CellType``):
one a ``nonlocal`` statement rebinds, watched (``is_watched``) as a container is."""
OBJECT = Kind("object", update=None)
"""Anything else: a decorated instance, a plain object, a registered pytree node."""
ARRAY_LIKE_OBJECT = Kind("object with .at", update=_array_update)

_CODE_TYPES = (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType)

# Base type -> kind, most specific first: the first base a type subclasses decides.
_BASES: tuple[tuple[type | tuple[type, ...], Kind], ...] = (
    ((jax.Array, jax.core.Tracer), ARRAY),
    (np.ndarray, NUMPY_ARRAY),
    (np.generic, NUMPY_SCALAR),
    (jax.ShapeDtypeStruct, ARRAY_SPEC),
    (type(None), NONE),
    ((int, float, complex), NUMBER),  # (enum members are sorted out before)
    ((str, bytes), TEXT),
    (_CODE_TYPES, CODE),
    (collections.deque, DEQUE),
    (bytearray, BYTEARRAY),
    (set, SET),
    (frozenset, FROZENSET),
    (collections.UserDict, USER_DICT),
    (collections.UserList, USER_LIST),
)

_KIND_BY_TYPE: dict[type, Kind] = {
    bool: NUMBER, int: NUMBER, float: NUMBER, complex: NUMBER, str: TEXT, bytes: TEXT,
    type(None): NONE, list: LIST, dict: DICT, tuple: TUPLE, set: SET, frozenset: FROZENSET,
    bytearray: BYTEARRAY, collections.deque: DEQUE, types.CellType: CELL,
}


def _classify(t: type) -> Kind:
    """The kind of values of type ``t`` (first met: remembered for the type)."""
    kind: Kind
    if issubclass(t, enum.Enum):
        kind = NUMBER_ENUM if issubclass(t, (int, float, complex)) else ENUM
    elif issubclass(t, tuple):
        kind = NAMED_TUPLE if hasattr(t, "_fields") and hasattr(t, "_make") else TUPLE_SUBCLASS
    elif issubclass(t, list):
        kind = LIST_SUBCLASS
    elif issubclass(t, dict):
        kind = DICT_SUBCLASS
    else:
        kind = next((k for base, k in _BASES if issubclass(t, base)), OBJECT)
        if kind is OBJECT and hasattr(t, "at"):
            kind = ARRAY_LIKE_OBJECT
    _KIND_BY_TYPE[t] = kind
    return kind


def kind_of(value: Any) -> Kind:
    """The kind of ``value``, decided by its type (one dict look-up once the type is known).

    Args:
        value: any Python value.

    Returns:
        Its ``Kind`` record.

    Example:
        >>> import collections, enum
        >>> from autostate.values import kind_of
        >>> kind_of([1]).name, kind_of(collections.deque()).name, kind_of(3.0).name
        ('list', 'deque', 'number')
        >>> class Mode(enum.IntEnum):
        ...     TRAIN = 1
        >>> kind_of(Mode.TRAIN).name
        'number enum member'
    """
    t = type(value)
    return _KIND_BY_TYPE.get(t) or _classify(t)


def is_array(value: Any) -> bool:
    """Whether ``value`` is array data: a JAX array (concrete or traced), a numpy array or scalar.

    Example:
        >>> from autostate.values import is_array
        >>> is_array(jnp.ones(2)), is_array(np.float32(1)), is_array(1.0)
        (True, True, False)
    """
    return (_KIND_BY_TYPE.get(type(value)) or _classify(type(value))).array


def is_array_or_spec(value: Any) -> bool:
    """``is_array``, or an abstract array (``jax.ShapeDtypeStruct``).

    Example:
        >>> from autostate.values import is_array_or_spec
        >>> is_array_or_spec(jax.ShapeDtypeStruct((2,), jnp.float32))
        True
    """
    kind = _KIND_BY_TYPE.get(type(value)) or _classify(type(value))
    return kind.array or kind.spec


def is_numpy(value: Any) -> bool:
    """Whether ``value`` is a numpy array or a numpy scalar.

    Example:
        >>> from autostate.values import is_numpy
        >>> is_numpy(np.float32(1)), is_numpy(np.ones(2)), is_numpy(jnp.ones(2))
        (True, True, False)
    """
    return (_KIND_BY_TYPE.get(type(value)) or _classify(type(value))).numpy


def is_python_number(value: Any) -> bool:
    """Whether ``value`` is a Python ``bool``, ``int``, ``float`` or ``complex``
    (a subclass too, ``IntEnum`` members included; numpy scalars are arrays).

    Example:
        >>> from autostate.values import is_python_number
        >>> is_python_number(True), is_python_number(np.float64(1)), is_python_number("1")
        (True, False, False)
    """
    return (_KIND_BY_TYPE.get(type(value)) or _classify(type(value))).number


def weakly_typed(array: Any) -> Any:
    """``array`` (a JAX array) weakly typed, as a Python scalar is: it takes the
    dtype of what it meets (``x_bf16 * weakly_typed(jnp.float32(2))`` is bfloat16).
    The same array where JAX has no internal spelling for it.

    Example:
        >>> from autostate.values import weakly_typed
        >>> w = weakly_typed(jnp.ones(2))
        >>> w.weak_type, (jnp.ones(2, jnp.bfloat16) * w).dtype
        (True, dtype(bfloat16))
    """
    convert = getattr(_lax_internal, "_convert_element_type", None)
    return array if convert is None else convert(array, weak_type=True)


def foreign_leaf(value: Any) -> Any:
    """The first leaf of ``value`` that is no value JAX computes with or a
    traced program can return (an array, a Python number, a
    ``ShapeDtypeStruct``) nor an atom or enum member (static data): a function,
    a ``jax.jit``-compiled one, a plain object; ``None`` when there is none.
    A container JAX takes as one leaf is looked into.

    Example:
        >>> from autostate.values import foreign_leaf
        >>> foreign_leaf({"a": jnp.ones(2), "b": 1.0, "c": "x"}) is None
        True
        >>> foreign_leaf([jnp.ones(2), jnp.sin]) is jnp.sin
        True
    """
    kind = _KIND_BY_TYPE.get(type(value)) or _classify(type(value))
    if kind.array or kind.atom:
        return None
    for leaf in leaves_within_opaque(jax.tree_util.tree_leaves(value)):
        kind = _KIND_BY_TYPE.get(type(leaf)) or _classify(type(leaf))
        if not (kind.array or kind.spec or kind.atom or kind is ENUM or kind is NUMBER_ENUM):
            return leaf
    return None


def holds_nothing(value: Any) -> bool:
    """Whether ``value`` holds no other value: an atom (number, ``str``,
    ``bytes``, ``None``) or an array. Walks looking for containers or
    sub-models stop at it.

    Example:
        >>> from autostate.values import holds_nothing
        >>> holds_nothing("relu"), holds_nothing(jnp.ones(2)), holds_nothing([1])
        (True, True, False)
    """
    kind = _KIND_BY_TYPE.get(type(value)) or _classify(type(value))
    return kind.atom or kind.array


def is_mutable(value: Any) -> bool:
    """Whether ``value`` is a builtin container code can change in place:
    a ``list``, ``dict``, ``set``, ``bytearray`` or ``deque`` (or a subclass).

    Example:
        >>> import collections
        >>> from autostate.values import is_mutable
        >>> is_mutable(collections.OrderedDict()), is_mutable((1, 2)), is_mutable(frozenset())
        (True, False, False)
    """
    return (_KIND_BY_TYPE.get(type(value)) or _classify(type(value))).mutable


def is_watched(value: Any) -> bool:
    """Whether code may change ``value`` in place, so that a snapshot of it
    (``Kind.copy``) can tell a change (``Kind.same``) and undo it
    (``Kind.restore``): a mutable container (``is_mutable``), or a closure
    cell, which a nested function's ``nonlocal`` statement rebinds.

    Example:
        >>> from autostate.values import is_watched
        >>> def outer():
        ...     n = 0
        ...     return (lambda: n).__closure__[0]
        >>> is_watched([1]), is_watched(outer()), is_watched((1,))
        (True, True, False)
    """
    return (_KIND_BY_TYPE.get(type(value)) or _classify(type(value))).same is not None


def is_mutable_static(value: Any) -> bool:
    """Whether ``value`` is, or a tuple or named tuple holds (at any depth),
    a mutable builtin container.

    Example:
        >>> from autostate.values import is_mutable_static
        >>> is_mutable_static((1, [2])), is_mutable_static((1, (2,)))
        (True, False)
    """
    kind = _KIND_BY_TYPE.get(type(value)) or _classify(type(value))
    if kind.mutable:
        return True
    return (kind is TUPLE or kind is NAMED_TUPLE) and any(map(is_mutable_static, value))


def copy_static(value: Any, memo: dict[int, Any]) -> Any:
    """``value`` with its mutable builtin containers copied, at any depth
    (``memo`` keeps two references to one container one); tuples and named
    tuples are rebuilt only around a copy; other objects are shared.

    A graphdef keeps the copy a flatten made, and each model rebuilt from it
    gets copies of its own: a static list then means its value when the
    graphdef was made (jit's cache compares graphdefs), and a change in place
    inside one model (an eager call, a trace) reaches no other.

    Example:
        >>> from autostate.values import copy_static
        >>> inner = [1]
        >>> out = copy_static((inner, "a", inner), {})
        >>> out == (inner, "a", inner), out[0] is inner, out[0] is out[2]
        (True, False, True)
    """
    kind = _KIND_BY_TYPE.get(type(value)) or _classify(type(value))
    if not kind.mutable and kind is not TUPLE and kind is not NAMED_TUPLE:
        return value
    found = memo.get(id(value))
    if found is not None:
        return found
    new: Any
    if kind is TUPLE or kind is NAMED_TUPLE:
        items = tuple(copy_static(v, memo) for v in value)
        if all(a is b for a, b in zip(items, value)):
            new = value
        else:
            new = items if kind is TUPLE else type(value)._make(items)
    elif kind is SET or kind is BYTEARRAY:
        new = _copy.copy(value)  # hashable or int items: nothing inside to copy
    else:
        new = _copy.copy(value)  # keeps the subclass (a defaultdict's factory)
        memo[id(value)] = new
        if kind is DICT or kind is DICT_SUBCLASS:
            for k, v in value.items():
                dict.__setitem__(new, k, copy_static(v, memo))
        else:
            items_list = [copy_static(v, memo) for v in value]
            new.clear()
            new.extend(items_list)
    memo[id(value)] = new
    return new


# Types whose instances are pytree leaves and not tracers (a concrete array,
# a float). Leafness is decided per type, so one leaf instance vouches for its
# type; an eager state write then skips ``tree_leaves``, most of its cost.
CONCRETE_LEAF_TYPES: set[type] = set()


def own_value(value: Any) -> Any:
    """``value`` as a state's holder keeps it: its mutable containers copied
    (``copy_static``), so code changing the caller's list in place (a
    helper's ``append``) leaves it alone, and a numpy array made a jax array,
    as an assignment makes it (numpy's ``+=`` would change the caller's
    array in place). A call binding a states dict, and a model frozen from
    one, keep this of each entry.

    Example:
        >>> from autostate.values import own_value
        >>> inner = [1]
        >>> out = own_value({"a": inner})
        >>> out == {"a": inner}, out["a"] is inner, type(own_value(np.ones(2))).__name__
        (True, False, 'ArrayImpl')
    """
    t = type(value)
    if t is np.ndarray:
        return jax.numpy.asarray(value)
    if t in CONCRETE_LEAF_TYPES or isinstance(value, jax.core.Tracer):
        return value  # the common state, decided by one look-up: a call is per state
    return copy_static(value, {}) if is_mutable_static(value) else value


_ITERATOR_TYPES: dict[type, bool] = {}


def is_iterator(value: Any) -> bool:
    """Whether ``value`` is an iterator (a generator): a leaf no walk looks into."""
    t = type(value)
    found = _ITERATOR_TYPES.get(t)
    if found is None:
        found = _ITERATOR_TYPES[t] = hasattr(t, "__next__") and hasattr(t, "__iter__")
    return found


# Ids of the containers ``opaque_items`` is taking apart now: one that holds
# itself is taken apart once.
TAKING_APART: set[int] = set()


def opaque_items(value: Any) -> dict | list | None:
    """A container JAX takes as one leaf (``values.Kind.items``), as a plain
    dict or list of its items; None for anything else."""
    t = type(value)
    if t is dict or t is list or t in CONCRETE_LEAF_TYPES:
        return None
    items = kind_of(value).items
    if items is None:
        # (Not a plain object's attributes: JAX keeps any object as a leaf,
        # and a pytree JAX rebuilt with objects for leaves, as orbax's
        # restore arguments, must keep them.)
        return None
    if not jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(value)):
        return None  # (registered with JAX: an OrderedDict, a defaultdict)
    return items(value)


def leaves_within_opaque(leaves: list[Any]) -> list[Any]:
    """``leaves``, with the leaves of the containers JAX took as one leaf
    (``opaque_items``) in their place."""
    out: list[Any] = []
    for leaf in leaves:
        items = None if isinstance(leaf, jax.core.Tracer) else opaque_items(leaf)
        if items is None or id(leaf) in TAKING_APART:
            out.append(leaf)
            continue
        TAKING_APART.add(id(leaf))
        try:
            out.extend(leaves_within_opaque(jax.tree_util.tree_leaves(items)))
        finally:
            TAKING_APART.discard(id(leaf))
    return out
