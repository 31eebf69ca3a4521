"""Dicts whose keys do not sort: a state eager Python keeps, JAX cannot flatten.

JAX flattens a dict in the sorted order of its keys, so a dict keyed by
values that do not sort (a plain ``Enum``, ``{1: a, "x": b}``) is a state
plain Python keeps but that ``f``'s states, a frozen model or a ``lax`` call
cannot carry. Eagerly such a state is kept as it is; where it must be
flattened, the error says so in autostate's words and names the line that
assigned it. This module owns that: finding such dicts, walking a value's
leaves in their own order, and the errors. The engine asks through the
slot protocol's hooks, registered below.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any

import jax

from autostate.errors import InvalidTypeError, format_error, user_location
from autostate.slot_hooks import register_slot_hooks
from autostate.values import is_iterator

# (state name, the user's line that assigned it): where a state was given a
# value holding a dict whose keys do not sort.
Unsortable = tuple[str, "str | None"]


# The dicts JAX flattens in the sorted order of their keys (an OrderedDict
# keeps its own order, a dict subclass that is no pytree is a leaf).
_SORTED_DICTS = (dict, collections.defaultdict)


def unsortable_dicts(value: Any) -> tuple[list[Any], list[Any]]:
    """``value``'s leaves, walking its dicts in their own order, and the dicts
    in it whose keys do not sort (``{Split.TRAIN: ...}`` with a plain Enum,
    ``{1: a, "x": b}``), which JAX cannot flatten: it orders a dict by its keys.
    """
    leaves: list[Any] = []
    unsortable: list[Any] = []

    def visit(node: Any) -> None:
        if type(node) in _SORTED_DICTS:
            try:
                sorted(node)
            except Exception:  # whatever the keys' ``<`` raises
                unsortable.append(node)
            for child in node.values():
                visit(child)
            return
        for leaf in jax.tree_util.tree_leaves(
            node, is_leaf=lambda v: v is not node and (type(v) in _SORTED_DICTS or is_iterator(v))
        ):
            if type(leaf) in _SORTED_DICTS:
                visit(leaf)
            else:
                leaves.append(leaf)

    visit(value)
    return leaves, unsortable


def leaves_in_own_order(value: Any, error: Exception) -> list[Any]:
    """The leaves of a ``value`` JAX failed to flatten with ``error``, when a
    dict in it whose keys do not sort is why; else ``error`` again."""
    leaves, unsortable = unsortable_dicts(value)
    if not unsortable:
        raise error
    return leaves


# What needs a state flattened, for the message of ``unsortable_keys_error``.
_MODEL_FLATTENED = (
    "so the model cannot be flattened: functionalize() cannot make the dict one of the "
    "states f takes and returns, and jax.jit or jax.tree_util cannot take the model "
    "(eagerly the model keeps the dict, as plain Python does)"
)


def unsortable_keys_error(
    value: Any, recorded: Unsortable | None, name: str | None, problem: str = _MODEL_FLATTENED
) -> InvalidTypeError | None:
    """The error for a state holding a dict whose keys do not sort, or ``None``
    when it holds none. ``recorded`` (what the slot kept: the state's name and
    the user's line) names them; without it, ``name`` and the line now."""
    try:
        _, unsortable = unsortable_dicts(value)
    except Exception:
        return None
    if not unsortable:
        return None
    label, where = recorded if recorded is not None else (name, user_location())
    subject = f"State {label!r}" if label else "A state"
    kinds = sorted({type(key).__name__ for d in unsortable for key in d})
    return InvalidTypeError(format_error(
        f"{subject} holds a dict whose keys cannot be sorted (keys of "
        f"type{'s' if len(kinds) > 1 else ''} {', '.join(kinds)}); JAX flattens a dict "
        f"in the sorted order of its keys, {problem}.",
        where=where,
        fix="key the dict by str, int or IntEnum values (an enum member's value: "
        "`{split.value: ...}`, `self.counts[split.value] += 1`; or make the enum a "
        "StrEnum or IntEnum), or keep these keys in a collections.OrderedDict, which "
        "JAX flattens in insertion order.",
    ))


# What a states dict cannot be, by the context it is flattened in.
_PROBLEMS = {
    "states": "so it cannot be one of the states a functionalized call takes and returns",
    "threaded": "so it cannot be one of the states a functionalized call or a lax call (scan, "
    "cond, while_loop, ...) threads",
}


def _states_flatten_error(
    values: Mapping[str, Any], context: str, err: BaseException, notes: Mapping[str, Unsortable]
) -> InvalidTypeError | None:
    """``unsortable_keys_error`` for the first of ``values`` holding such a dict,
    naming the line ``notes`` recorded, else the line now; None if there is none
    or ``err`` is not about sorting keys."""
    if "dictionary keys" not in str(err):
        return None
    for name, value in values.items():
        where = notes.get(name)
        error = unsortable_keys_error(value, where and (name, where[1]), name, _PROBLEMS[context])
        if error is not None:
            return error
    return None


register_slot_hooks(states_flatten_error=_states_flatten_error)
