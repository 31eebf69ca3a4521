"""What every layer says about a decorated class, and how a value is shown.

* ``StaticLeaf``, the hashable wrapper that keeps a python value in pytree aux
  data (what kind of value a value is: ``autostate.values``);
* the decoration info of a class (``class_info``, ``info_of``);
* how an array is written in messages (``describe``).

The node-kind registry and the walk over a model (flatten, rebuild, change
check, reachable instances, path names) are ``autostate.graph``'s.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

INFO_ATTR = "__autostate_info__"

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


class StaticLeaf:
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
        if not isinstance(other, StaticLeaf):
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


jax.tree_util.register_pytree_node(StaticLeaf, lambda s: ((), s), lambda aux, _children: aux)
