"""What every layer says about a value and about a decorated class.

* the kinds of values: arrays (``is_array_leaf``, ``learn_array_type``),
  the static scalar types, the builtin containers code may change in place
  and their copies (``copy_static``), and ``_Static``, the hashable wrapper
  that keeps a python value in pytree aux data;
* the decoration info of a class (``class_info``, ``info_of``);
* how an array is written in messages (``describe``).

The node-kind registry and the walk over a model (flatten, rebuild, change
check, reachable instances, path names) are ``autostate.graph``'s.
"""

from __future__ import annotations

import collections
import copy as _copy
import types
from typing import Any

import jax
import numpy as np

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


def is_array_leaf(value: Any) -> bool:
    """Arrays (concrete, traced or abstract): the only leaves ``f`` and models have."""
    return isinstance(value, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


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


def learn_array_type(value: Any) -> bool:
    """Whether ``value`` is an array (a tracer is one); its type is then
    remembered in ``ARRAY_TYPES``, since being an array is the type's: hot
    loops test the set instead (most of a traced state write, once)."""
    if isinstance(value, (jax.Array, np.ndarray, np.generic)):
        _ARRAY_TYPES.add(type(value))
        return True
    return False


# Types found to be arrays by learn_array_type (concrete arrays, tracers, numpy).
_ARRAY_TYPES: set[type] = set()
# The same set under the name other modules read in their hot loops.
ARRAY_TYPES = _ARRAY_TYPES
