"""Python values in states: what is structure, what is a leaf, what is copied.

A state may hold Python values inside a container (``self.cfg = {"m":
jnp.zeros(2), "name": "relu"}``) and containers JAX takes as one leaf (a
``deque``, a ``Counter``). Python bools, ints, strings and enum members are
structure, as everywhere else in a model: a states dict (``States``) and a
frozen request keep them out of the leaves and put them back. This module
owns those rules: which values are static, the static state's slots
(``StaticState``, ``HandledStaticState``), splitting and joining a
container's Python values, and the states dict that keeps them. The engine
asks it through the slot hooks, registered below."""

from __future__ import annotations

import collections
import dataclasses
import enum
import types
from collections.abc import Hashable
from typing import Any

import jax
import numpy as np

from autostate import graph as _graph
from autostate import tree as _tree
from autostate import values as _values
from autostate.effects.local_state import Category, FrozenLocalStateRequest, StateSlot
from autostate.errors import (
    InvalidTypeError,
    StaticStateError,
    format_error,
    refused,
    user_location,
)
from autostate.slot_hooks import hooks as _hooks
from autostate.slot_hooks import register_slot_hooks
from autostate.unsortable import unsortable_keys_error
from autostate.values import CONCRETE_LEAF_TYPES, TAKING_APART, opaque_items


def _static_key(value: Any) -> tuple:
    # ``True == 1`` and they hash alike: the type keeps jit from mixing them up.
    return (type(value), value)


def same_static(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


@dataclasses.dataclass(frozen=True)
class _Rebuilt:
    """How a container ``opaque_items`` took apart is put together again
    (kept in aux data: compared by its type and attributes, not its items)."""

    cls: type
    attributes: tuple  # (name, _Static-like key) pairs of the instance's own attributes
    maxlen: int | None
    inner: Any  # ``split_static_values``'s second result for the items, or None

    @staticmethod
    def of(value: Any, items: Any) -> tuple[Any, _Rebuilt]:
        if id(value) in TAKING_APART:
            raise InvalidTypeError(
                format_error(
                    f"A state holds a {type(value).__name__} that holds itself; a states dict "
                    "carries such a container as its items, which would never end.",
                    fix="keep the container out of itself, or hold the state in a dict or "
                    "list of its own.",
                )
            )
        TAKING_APART.add(id(value))
        try:
            return _Rebuilt._of(value, items)
        finally:
            TAKING_APART.discard(id(value))

    @staticmethod
    def _of(value: Any, items: Any) -> tuple[Any, _Rebuilt]:
        own = getattr(value, "__dict__", {})
        attributes = tuple(
            (name, _static_key(v)) for name, v in own.items() if name != "data"
        )
        inner = None
        if holds_static_values(items):
            items, inner = split_static_values(items)
        maxlen = value.maxlen if isinstance(value, collections.deque) else None
        return items, _Rebuilt(type(value), attributes, maxlen, inner)

    def build(self, items: Any) -> Any:
        if self.inner is not None:
            items = join_static_values(items, self.inner)
        cls: Any = self.cls
        new = cls.__new__(cls)
        _values.kind_of(new).fill(new, items, self.maxlen)  # type: ignore[misc]
        for name, key in self.attributes:
            object.__setattr__(new, name, key[1])
        return new


def is_static_value(value: Any) -> bool:
    """Whether a state value is static (a Python bool, int, str, enum member or
    None, or a dtype, class or function: ``jnp.bfloat16``, ``jnp.dtype("float16")``,
    ``jax.nn.gelu``, which no array holds): part of a model's structure, so
    ``if self.training:``, ``x.astype(self.dtype)`` and ``self.act(x)`` work
    under jit."""
    t = type(value)
    static = _STATIC_BY_TYPE.get(t)
    if static is None:  # (decided by the type: remembered, as a dict look-up is cheap)
        static = _STATIC_BY_TYPE[t] = t in _STATIC_STATE_TYPES or issubclass(t, _STATIC_STATE_BASES)
    return static


_STATIC_STATE_TYPES = (bool, int, str, type(None))
# Functions (``jax.nn.gelu``, ``jnp.tanh``, a lambda): no array holds one, so
# a state holding one is structure too (a bound method is not: it is rebound).
_FUNCTION_TYPES = (
    types.FunctionType, types.BuiltinFunctionType, jax.custom_jvp, jax.custom_vjp,
    type(jax.jit(lambda: None)), type(jax.numpy.add), np.ufunc,
)
_STATIC_STATE_BASES = (enum.Enum, type, np.dtype, *_FUNCTION_TYPES)
_STATIC_BY_TYPE: dict[type, bool] = {}


def makes_static_state(value: Any) -> bool:
    """Whether a state given ``value`` is static. ``None`` is a placeholder, not a
    mode: the state stays an array state holding ``None``, and the first value
    that replaces it decides the kind (static again eagerly; refused in ``f``,
    whose structure a static value is)."""
    return value is not None and is_static_value(value)


def holds_static_values(value: Any) -> bool:
    """Whether a container state value holds a Python bool, int, str or enum
    member (one whole Python number stays a leaf, as under ``jax.jit``)."""
    t = type(value)
    if t in CONCRETE_LEAF_TYPES or isinstance(value, jax.core.Tracer):
        return False
    leaves = jax.tree_util.tree_leaves(value)
    if len(leaves) == 1 and leaves[0] is value:
        return opaque_items(value) is not None
    return any(is_static_value(leaf) or opaque_items(leaf) is not None for leaf in leaves)


def split_static_values(value: Any) -> tuple[Any, Any]:
    """``value`` with its Python values replaced by None, and what puts them back
    (the treedef counts None as a leaf, so positions stay whatever JAX puts at
    the others). A container JAX does not flatten becomes its items."""
    positions, treedef = jax.tree_util.tree_flatten(value, is_leaf=lambda x: x is None)
    held: list[tuple[int, Any]] = []
    for i, leaf in enumerate(positions):
        if leaf is None:
            continue
        if is_static_value(leaf):
            held.append((i, _static_key(leaf)))
            positions[i] = None
        elif (items := opaque_items(leaf)) is not None:
            positions[i], rebuilt = _Rebuilt.of(leaf, items)
            held.append((i, rebuilt))
    return jax.tree_util.tree_unflatten(treedef, positions), (treedef, tuple(held))


def join_static_values(stripped: Any, static: Any) -> Any:
    treedef, held = static
    positions = treedef.flatten_up_to(stripped)
    for i, key in held:
        positions[i] = key.build(positions[i]) if type(key) is _Rebuilt else key[1]
    return jax.tree_util.tree_unflatten(treedef, positions)


class States(dict):
    """A states dict whose container states hold Python values, kept as structure.

    ``self.shape = (2,)`` or ``self.cfg = {"m": jnp.zeros(2), "name": "relu"}``:
    Python bools, ints, strings and enum members inside a state's container
    are structure, as they are everywhere else in a model. This dict's pytree
    flatten keeps them in its aux data; only arrays (and Python floats) are
    leaves. So ``jax.jit(f)(states, x)`` sees ``(2,)`` as Python ints (one
    trace per value, as for a static state), and a call that assigns ``(3,)``
    returns Python ints, as plain Python does.

    Otherwise it is a plain dict; ``functionalize`` and ``f`` return one only
    when some state needs it. A dict rebuilt by hand (``{**states}``) is a
    plain one, whose Python values ``jax.jit`` would trace: wrap it in
    ``autostate.States(...)`` again.

    Examples:
        >>> @autostate.stateful
        ... class Shaped:
        ...     def __init__(self):
        ...         self.shape = (2,)
        ...
        ...     def __call__(self, x):
        ...         return jnp.zeros(self.shape) + x
        ...
        ...     def grow(self):
        ...         self.shape = (self.shape[0] + 1,)
        >>> f, states = Shaped().functionalize()
        >>> type(states).__name__, jax.tree_util.tree_leaves(states)  # (2,) is structure
        ('States', [])
        >>> _, states = jax.jit(f.grow)(states)
        >>> states
        {'shape': (3,)}
        >>> states = autostate.States({**states, "shape": (4,)})  # rebuilt by hand: wrap it
        >>> print(jax.jit(f)(states, 1.0)[0])
        [1. 1. 1. 1.]
    """

    __slots__ = ()

    def copy(self) -> States:
        return States(self)


def states_dict(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` as the states dict ``f`` takes: a ``States`` when a
    container state holds Python values, else ``values`` itself."""
    for value in values.values():
        if type(value) not in CONCRETE_LEAF_TYPES and holds_static_values(value):
            return States(values)
    return values


def _flatten_states(states: States) -> tuple[list[tuple[Any, Any]], tuple]:
    keyed = []
    statics = []
    for name, value in dict.items(states):
        static = None
        if holds_static_values(value):
            value, static = split_static_values(value)
        keyed.append((jax.tree_util.DictKey(name), value))
        statics.append(static)
    return keyed, (tuple(states), tuple(statics))


def _flatten_states_unkeyed(states: States) -> tuple[list[Any], tuple]:
    keyed, aux = _flatten_states(states)
    return [value for _, value in keyed], aux


def _unflatten_states(aux: tuple, children: Any) -> States:
    names, statics = aux
    new = States()
    for name, child, static in zip(names, children, statics):
        dict.__setitem__(new, name, child if static is None else join_static_values(child, static))
    return new


jax.tree_util.register_pytree_with_keys(
    States,
    _flatten_states,
    _unflatten_states,
    _flatten_states_unkeyed,
)


def _static_write_error(slot: Any, value: Any, label: str | None) -> StaticStateError:
    """A functionalized call assigned another value to static state ``slot``
    (a ``HandledStaticState``): its value is ``f``'s structure."""
    attr = label or slot.name
    # A traced value has no value to set on the model, and an array's
    # repr is no example to type: both are described, and "..." stands
    # for them in the fix.
    literal = is_static_value(value)  # (a bool, int, str or enum member holds no tracer)
    shown = repr(value) if literal else _tree.describe(value)
    example = repr(value) if literal else "..."
    return StaticStateError(
        format_error(
            f"A functionalized call assigned {shown} to static state {slot.name!r} "
            f"(attribute {attr!r}), which holds {slot.value!r}: a Python "
            f"{type(slot.value).__name__} is part of f's structure, fixed for the call.",
            where=user_location(),
            fix="set it on a model made from f's states, then functionalize that "
            f"(`model = autostate.freeze(f, states)`; `model.{attr} = {example}`; "
            "`f, states = model.functionalize()`; with a method that returns the model, "
            "as autostate's train()/eval() do: `f_eval, states = "
            "autostate.freeze(f, states).eval().functionalize()`; jax.jit traces once per "
            "value), or keep a value that changes inside jit in an array (`jnp.asarray(...)`).",
        )
    )


def _static_in_placeholder_error(
    name: str, label: str | None, value: Any, inside: str | None
) -> StaticStateError:
    attr = label or name
    if inside is not None:  # an eager model's state, in a traced body
        return StaticStateError(
            format_error(
                f"State {name!r} (attribute {attr!r}), which holds the placeholder None, is "
                f"assigned {value!r} inside {inside}: an array may replace None there, but a "
                f"Python {type(value).__name__} makes the state static, part of the model's "
                "structure, which JAX traces the body once for.",
                where=user_location(),
                fix=f"assign it before the call (`self.{attr} = {value!r}`), or keep a value "
                "that changes inside the body in an array (`jnp.asarray(...)`).",
            )
        )
    return StaticStateError(
        format_error(
            f"A functionalized call assigned {value!r} to state {name!r} (attribute "
            f"{attr!r}), which holds the placeholder None: an array may replace None "
            f"inside f, but a Python {type(value).__name__} makes the state static, part of "
            "f's structure, which a call cannot change.",
            where=user_location(),
            fix=f"assign it on the model before functionalizing (`model.{attr} = {value!r}`, "
            "then `f, states = model.functionalize()`; jax.jit traces once per value), or "
            "keep a value that changes inside jit in an array (`jnp.asarray(...)`).",
        )
    )


def check_placeholder_write(
    name: str, label: str | None, value: Any, returned: bool = True, inside: str | None = None
) -> None:
    """A Python value in place of the placeholder ``None`` inside a call would
    make the state static: refused (``makes_static_state``); so is, where the
    call ``returned`` its states (``f``'s), a value JAX cannot carry in them (a
    function, a plain object: ``values.foreign_leaf``). What a handled write
    checks (``lifetime``'s ``check_handled_write``); ``inside``: the traced body
    of an eager model's method the write is in (``"the body of a lax.scan"``)."""
    if makes_static_state(value):
        raise refused(_static_in_placeholder_error(name, label, value, inside))
    foreign = _values.foreign_leaf(value) if returned else None
    if foreign is not None:
        raise refused(_foreign_in_placeholder_error(name, label, value, foreign))


def _foreign_in_placeholder_error(
    name: str, label: str | None, value: Any, foreign: Any
) -> InvalidTypeError:
    attr = label or name
    what = "a function" if callable(foreign) else f"a {type(foreign).__name__}"
    return InvalidTypeError(
        format_error(
            f"A functionalized call assigned {what} ({foreign!r}) to state {name!r} (attribute "
            f"{attr!r}), which holds the placeholder None: the new states f returns carry "
            "arrays and Python values, and JAX cannot carry this one (jax.jit(f) would "
            "refuse it as no valid JAX type).",
            where=user_location(),
            fix=f"keep it out of the states: assign `self.{attr}` only in __init__ (a plain "
            "attribute, part of f's structure), or choose it by a static state "
            "(`self.act = 'relu'`, then `getattr(jax.nn, self.act)(x)`); keep what changes "
            "inside the call in arrays.",
        )
    )


def _flatten_frozen(r: FrozenLocalStateRequest) -> tuple[tuple[Any], tuple]:
    """A frozen request's value is its child, its Python values structure (as in
    ``States``); an unsortable dict is said in autostate's words."""
    value = r.state
    try:
        if type(value) in CONCRETE_LEAF_TYPES or not holds_static_values(value):
            return (value,), (r.category, r.name, None)
        stripped, static = split_static_values(value)
    except (ValueError, TypeError):
        error = unsortable_keys_error(value, getattr(r, "_note", None), r.name)
        if error is None:
            raise
        raise error from None
    return (stripped,), (r.category, r.name, static)


def _flatten_frozen_with_keys(r: FrozenLocalStateRequest) -> tuple[tuple[Any], tuple]:
    (value,), aux = _flatten_frozen(r)
    return ((jax.tree_util.GetAttrKey("state"), value),), aux


def _unflatten_frozen(aux: tuple, children: Any) -> FrozenLocalStateRequest:
    category, name, static = aux
    value = children[0] if static is None else join_static_values(children[0], static)
    return FrozenLocalStateRequest(value, category, name)


# The engine's frozen request is a pytree whose child is its value; which
# values inside it are structure is this module's rule, so its flatten is
# registered here, beside the states dict's.
jax.tree_util.register_pytree_with_keys(
    FrozenLocalStateRequest, _flatten_frozen_with_keys, _unflatten_frozen, _flatten_frozen
)


@dataclasses.dataclass(frozen=True, eq=False)
class StaticState(StateSlot):
    """A state holding a Python bool, int, str, enum member, dtype, class,
    function or None.

    Its value is part of the model's structure (pytree aux data), not of the
    states dict: ``model.eval()`` then ``functionalize()`` gives an ``f`` that
    ``jax.jit`` traces once per mode, and ``if self.training:`` is a plain
    Python branch inside the trace.

    Examples:
        >>> from autostate.state_values import StaticState
        >>> slot = StaticState(True, category="state")
        >>> slot.read()
        True
        >>> slot.write(False)  # a new slot: this one is unchanged
        StaticState(value=False, category='state', name=None)
    """

    value: Any
    category: Category
    name: str | None = None

    def read(self) -> Any:
        return self.value

    def write(self, value: Any, label: str | None = None) -> Any:
        # The slot the value makes, where the model lives: ``lifetime.written_slot``.
        return _hooks.eager_write(self, value, label)

    def as_request(self) -> StaticState:
        return self

    def handled_in_structure(self, handler_id: Hashable, path: str) -> HandledStaticState:
        explicit = self.name is not None
        name = self.name if explicit else path
        return HandledStaticState(handler_id, name, self.value, explicit, self.category)  # type: ignore[arg-type]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StaticState):
            return NotImplemented
        return same_static(self.value, other.value) and (self.category, self.name) == (
            other.category,
            other.name,
        )

    def __hash__(self) -> int:
        return hash((_static_key(self.value), self.category, self.name))


jax.tree_util.register_pytree_node(
    StaticState,
    lambda s: ((), (_static_key(s.value), s.category, s.name)),
    lambda aux, _children: StaticState(aux[0][1], aux[1], aux[2]),
)
_graph.register_node_kind(StaticState, model_child=True, immutable=True)


@dataclasses.dataclass(frozen=True, eq=False)
class HandledStaticState(StateSlot):
    """A static state inside a functionalized model: readable, and assignable only
    its own value (``f``'s structure holds it)."""

    handler_id: Hashable
    name: str
    value: Any
    was_explicitly_named: bool
    category: Category
    handleable = False
    handled = True

    def read(self) -> Any:
        return self.value

    def write(self, value: Any, label: str | None = None) -> None:
        if same_static(value, self.value):
            return None
        raise refused(_static_write_error(self, value, label))

    def as_request(self) -> Any:
        raise NotImplementedError

    def frozen(self) -> StaticState:
        return StaticState(self.value, self.category, self.name if self.was_explicitly_named else None)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, HandledStaticState):
            return NotImplemented
        return same_static(self.value, other.value) and (
            self.handler_id,
            self.name,
            self.was_explicitly_named,
            self.category,
        ) == (other.handler_id, other.name, other.was_explicitly_named, other.category)

    def __hash__(self) -> int:
        return hash((self.handler_id, self.name, _static_key(self.value), self.category))


jax.tree_util.register_pytree_node(
    HandledStaticState,
    lambda s: (
        (),
        (s.handler_id, s.name, _static_key(s.value), s.was_explicitly_named, s.category),
    ),
    lambda aux, _children: HandledStaticState(aux[0], aux[1], aux[2][1], aux[3], aux[4]),
)
_graph.register_node_kind(HandledStaticState, model_child=True, immutable=True)


def static_slot(value: Any, category: Category, name: str | None) -> StaticState | None:
    """The slot of a state given ``value`` when that makes it static (``makes_static_state``)."""
    return StaticState(value, category, name) if makes_static_state(value) else None


register_slot_hooks(states_dict=states_dict)
