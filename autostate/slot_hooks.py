"""What the runtime answers when the local-state engine asks, and why it must ask.

The engine (``autostate.effects``) is penzai v1's local-state effect and
knows nothing of tracer lifetime, static values, unsortable dicts, threads
or the guard. Where a question can be an argument or a method, it is one
(``run_with_states``'s ``instances``, ``values.own_value``, the frozen
request's flatten registered by ``state_values``, ``errors``' wording,
``lifetime.trace_of_call``). What is left is asked here, one field of
``hooks`` each (``SlotHooks``), filled in by its owner at import
(``register_slot_hooks``): ``lifetime``, ``state_values`` and
``unsortable``, which stand on the engine, so it cannot import them. Each
question is reached where no caller of the runtime's stands between the user
and the engine (penzai's front door, or the slot protocol on the engine's
own slot types), so no argument can carry the answer. The defaults are
penzai's; this module imports nothing of autostate's but its errors.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any

from autostate.errors import InvalidArgumentError, unhandled_request_error

# What the runtime noted about a state's value when it was assigned: kept with
# the request that holds it (``_note``), for the runtime's errors (the engine
# does not look inside).
WriteNote = Any


class SlotHooks:
    """What the runtime decides about the values a slot holds: the engine asks.

    * ``eager_write(slot, value, label)``: the ``write`` of an engine request
      outside every handler: the slot that takes ``slot``'s place once it
      holds ``value`` (raises for a value it cannot keep); ``label`` names an
      unnamed state in errors;
    * ``made_here(slots)``: the slots a freeze just made (they live where it
      ran);
    * ``check_read(name, value, cell)``: called by a handled reference's
      ``read`` of ``cell``; raises for a value with no plain meaning;
    * ``check_handled_write(ref, label, old, value)``: called by a handled
      reference ``ref``'s ``write``; raises for a value the running call cannot take;
    * ``call_started(handler_id, cells)`` -> ``ended()``: a handler starts
      running its body with ``cells`` (``{name: LocalStateEffectImpl}``);
      calling what it returns says the call ended;
    * ``cells_elsewhere(ref)``: the cells a handled reference reaches when no
      call of its handler runs in this context (a call ``call_started``
      recorded in another thread), or ``None``;
    * ``states_dict(values)``: the states dict a call or handling returns;
    * ``states_flatten_error(values, context, err, notes)``: the error to
      raise instead of ``err``, what JAX raised flattening states
      (``context``: ``"states"``, a states dict; ``"threaded"``, the states a
      running call threads), or ``None`` to raise ``err``; ``notes`` are the
      requests' ``_note``.
    """

    __slots__ = (
        "eager_write",
        "made_here",
        "check_read",
        "check_handled_write",
        "call_started",
        "cells_elsewhere",
        "states_dict",
        "states_flatten_error",
    )

    def __init__(self) -> None:
        self.eager_write: Callable[[Any, Any, str | None], Any] = _unhandled_write
        self.made_here: Callable[[Iterable[Any]], None] = lambda slots: None
        self.check_read: Callable[[str, Any, Any], None] = lambda name, value, cell: None
        self.check_handled_write: Callable[[Any, str | None, Any, Any], None] = (
            lambda ref, label, old, value: None
        )
        self.call_started: Callable[[Hashable, dict[str, Any]], Callable[[], None]] = (
            lambda handler_id, cells: _nothing
        )
        self.cells_elsewhere: Callable[[Any], Any] = lambda ref: None
        self.states_dict: Callable[[dict[str, Any]], dict[str, Any]] = lambda values: values
        self.states_flatten_error: Callable[
            [Mapping[str, Any], str, BaseException, Mapping[str, Any]], Exception | None
        ] = lambda values, context, err, notes: None


def _unhandled_write(slot: Any, value: Any, label: str | None) -> Any:
    raise unhandled_request_error(slot)


def _nothing() -> None:
    return None


# The one set of answers the engine reads.
hooks = SlotHooks()


def register_slot_hooks(**answers: Callable[..., Any]) -> None:
    """Registers the runtime's answers to the engine's questions (``SlotHooks``),
    by name: ``register_slot_hooks(check_read=...)``."""
    for name, answer in answers.items():
        if name not in SlotHooks.__slots__:
            raise InvalidArgumentError(f"no slot hook named {name!r}: {SlotHooks.__slots__}")
        setattr(hooks, name, answer)
