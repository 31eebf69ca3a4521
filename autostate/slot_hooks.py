"""What the runtime answers when the local-state engine asks.

The engine (``autostate.effects``) is penzai v1's local-state effect: it
knows requests, handled references, handlers and the slot protocol, and
nothing of tracer lifetime, Python values that are structure, dicts JAX cannot
flatten, threads or the guard. Where its semantics meet those questions, it
asks them here: each is one field of ``hooks``, which the modules that own
the answer fill in with ``register_slot_hooks`` when they are imported:

* ``autostate.lifetime``: ``current_trace``, ``eager_write``, ``lives_in``,
  ``check_read``, ``call_started`` / ``call_ended``, ``cells_elsewhere``,
  ``unhandled_ref_error``;
* ``autostate.state_values``: ``split_statics`` / ``join_statics``,
  ``own_value``, ``states_dict``, ``check_handled_write``;
* ``autostate.unsortable``: ``value_flatten_error``, ``states_flatten_error``;
* ``autostate.guard``: ``guard_call`` / ``unguard_call``.

The defaults are penzai's: no trace is tracked, an unhandled request cannot
be written, nothing else is refused, a value is kept as it is given. This module imports nothing of autostate's but its
errors, so the engine may read ``hooks`` with no cycle.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any

from autostate.errors import (
    InvalidArgumentError,
    UnhandledLocalStateError,
    unhandled_request_error,
)

# What the runtime noted about a state's value when it was assigned: kept with
# the request that holds it (``_note``), for the runtime's errors (the engine
# does not look inside).
WriteNote = Any


class SlotHooks:
    """What the runtime decides about the values a slot holds: the engine asks.

    * ``current_trace()``: the JAX trace running now, or ``None``; a call
      started now records it, and slots frozen now live in it (``lives_in``);
    * ``eager_write(slot, value, label)``: the ``write`` of a slot outside
      every handler (an unhandled request, a static state): the slot that
      takes ``slot``'s place once it holds ``value`` (raises for a value it
      cannot keep); ``label`` names an unnamed state in errors;
    * ``lives_in(slot, trace)``: ``slot``, made by freezing while ``trace``
      (what ``current_trace`` said) ran, living there;
    * ``check_read(name, value, cell)``: called by a handled reference's
      ``read`` of ``cell``; raises for a value with no plain meaning;
    * ``value_flatten_error(value, note, name)`` / ``states_flatten_error(values,
      context, err, notes)``: the error to raise instead of ``err``, what JAX
      raised flattening a state's value (``context`` says where: ``"states"``,
      a states dict; ``"threaded"``, states a running call threads), or
      ``None`` to raise ``err``; ``note`` is the request's ``_note``;
    * ``split_statics(value)`` -> ``(stripped, statics)`` or ``None``: the
      Python values inside a container value, kept out of the pytree leaves of
      a ``FrozenLocalStateRequest``; ``join_statics(stripped, statics)`` puts
      them back;
    * ``own_value(value)``: the value a call or a frozen model keeps of a
      states dict's entry (its own copy of what the caller may change);
    * ``states_dict(values)``: the states dict a call returns;
    * ``check_handled_write(name, label, old, value)``: called by a handled
      reference's ``write``; raises for a value the running call cannot take
      (a Python value in place of the placeholder ``None``, which would make
      the state static);
    * ``call_started(handler_id, cells, trace)`` -> token /
      ``call_ended(token)``: a handler starts running its body with ``cells``
      (``{name: LocalStateEffectImpl}``) in ``trace``, and ends;
    * ``cells_elsewhere(ref)``: the cells a handled reference reaches when no
      call of its handler runs in this context (a call ``call_started``
      recorded elsewhere), or ``None``;
    * ``unhandled_ref_error(ref, reason)``: the error of a handled reference
      used while its handler is not running (``reason``: ``"not running"``,
      or ``"another call"`` with an equal id is running);
    * ``guard_call(ids)`` / ``unguard_call(token)``: called when a call starts
      running a body whose decorated instances have ``ids``, and with what
      ``guard_call`` returned when it ends: while it runs, their writes that
      are not state writes are refused (``autostate.guard``).
    """

    __slots__ = (
        "current_trace",
        "eager_write",
        "lives_in",
        "check_read",
        "value_flatten_error",
        "states_flatten_error",
        "split_statics",
        "join_statics",
        "own_value",
        "states_dict",
        "check_handled_write",
        "call_started",
        "call_ended",
        "cells_elsewhere",
        "unhandled_ref_error",
        "guard_call",
        "unguard_call",
    )

    def __init__(self) -> None:
        self.current_trace: Callable[[], Any] = lambda: None
        self.eager_write: Callable[[Any, Any, str | None], Any] = _unhandled_write
        self.lives_in: Callable[[Any, Any], Any] = lambda slot, trace: slot
        self.check_read: Callable[[str, Any, Any], None] = lambda name, value, cell: None
        self.value_flatten_error: Callable[[Any, Any, str | None], Exception | None] = (
            lambda value, note, name: None
        )
        self.states_flatten_error: Callable[
            [Mapping[str, Any], str, BaseException, Mapping[str, Any]], Exception | None
        ] = lambda values, context, err, notes: None
        self.split_statics: Callable[[Any], tuple[Any, Any] | None] = lambda value: None
        self.join_statics: Callable[[Any, Any], Any] = lambda stripped, statics: stripped
        self.own_value: Callable[[Any], Any] = lambda value: value
        self.states_dict: Callable[[dict[str, Any]], dict[str, Any]] = lambda values: values
        self.check_handled_write: Callable[[str, str | None, Any, Any], None] = (
            lambda name, label, old, value: None
        )
        self.call_started: Callable[[Hashable, dict[str, Any], Any], Any] = (
            lambda handler_id, cells, trace: None
        )
        self.call_ended: Callable[[Any], None] = lambda token: None
        self.cells_elsewhere: Callable[[Any], Any] = lambda ref: None
        self.unhandled_ref_error: Callable[[Any, str], UnhandledLocalStateError] = (
            lambda ref, reason: UnhandledLocalStateError(
                f"State {ref.name!r} is unhandled: handler {ref.handler_id!r} is not running."
            )
        )
        self.guard_call: Callable[[frozenset[int]], Any] = lambda ids: None
        self.unguard_call: Callable[[Any], None] = lambda token: None


def _unhandled_write(slot: Any, value: Any, label: str | None) -> Any:
    raise unhandled_request_error(slot)


# The one set of answers the engine reads.
hooks = SlotHooks()


def register_slot_hooks(**answers: Callable[..., Any]) -> None:
    """Registers the runtime's answers to the engine's questions (``SlotHooks``),
    by name: ``register_slot_hooks(current_trace=...)``."""
    for name, answer in answers.items():
        if name not in SlotHooks.__slots__:
            raise InvalidArgumentError(f"no slot hook named {name!r}: {SlotHooks.__slots__}")
        setattr(hooks, name, answer)
