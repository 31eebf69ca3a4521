"""Stacks and stacked sub-models under the mapping transformations.

A sub-model handed to ``jax.vmap``'s mapped arguments, ``lax.scan``'s ``xs``
or ``lax.map`` is a list of members: each of its states is one slice per
member along the mapped axis, each member reads and writes its own slice,
and the slices written come back stacked. A stack of layers in such an
argument is its stacked model; a stack held by a layer of an outer stack is
a view whose states are parts of the outer one (``with_layer_views``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

from autostate import graph as _graph
from autostate import tree as _tree
from autostate.effects.local_state import (
    HandledLocalStateRef,
    StateSlot,
    handler_cells,
    running_cells,
)
from autostate.errors import ControlFlowStateError, format_error, user_location
from autostate.guard import Guard, eager_lax_body
from autostate.lifetime import MEMBER_CELLS
from autostate.lifting.core import (
    Cells,
    StandIn,
    Swapped,
    current_values,
    describe,
    guarded,
    run_handled,
    settled,
    signature_of,
    state_name,
    traceable,
    type_of,
    was_assigned,
    write_back,
)


def layers_mapped(tree: Any) -> Any:
    """``tree`` (a mapped argument) with each stack in it, and in the lists,
    tuples and dicts it holds, replaced by its stacked model; the same object
    when it holds none."""
    if not _graph.STACKS:
        return tree
    t = type(tree)
    stacked = _graph.STACKS.get(t)
    if stacked is not None:
        return stacked(tree)
    if t is tuple or t is list:
        items = [layers_mapped(v) for v in tree]
        return tree if all(a is b for a, b in zip(items, tree)) else t(items)
    if t is dict:
        mapped = {k: layers_mapped(v) for k, v in tree.items()}
        return tree if all(mapped[k] is v for k, v in tree.items()) else mapped
    return tree


def vmap_layers(in_axes: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``jax.vmap``'s arguments with the stacks of the mapped ones as their
    stacked models (``layers_mapped``); an argument with in_axes ``None`` keeps
    its stack whole (every example iterates all of its layers)."""
    if not _graph.STACKS:
        return args, kwargs
    axes = tuple(in_axes) if isinstance(in_axes, (tuple, list)) else (in_axes,) * len(args)
    if len(axes) != len(args):
        return args, kwargs  # (jax.vmap says what does not match)
    mapped = tuple(a if axis is None else layers_mapped(a) for axis, a in zip(axes, args))
    return mapped, layers_mapped(kwargs)


# --- stacked sub-models -------------------------------------------------------------
# A sub-model handed to a mapping transformation (``jax.vmap``'s mapped
# arguments, ``lax.scan``'s ``xs``, ``lax.map``) is a list of members: each
# of its states is one slice per member along the mapped axis, each member
# reads and writes its own slice, and the slices written come back stacked.


def with_layer_views(mapped: Any, what: str, call: Callable[[], Any]) -> Any:
    """``call()``, the states of the layer views in ``mapped`` (a mapped
    argument) handled as states of their own while it runs.

    A stack held by a layer of an outer stack (``self.sub`` of the view
    ``self.blocks[0]``) is a view too: its states are slots reading and
    writing their part of the outer stacked state (``StateSlot.part_of``).
    Mapped over, it is a stacked sub-model like any other: each member's
    slice comes from that part, and the slices written come back stacked
    and are written through the view, into the outer state. While the call
    runs, the outer state itself cannot be read by another path (it would
    read the value from before the call): that is refused.
    """
    swapped: Swapped = []
    names: set[str] = set()
    for obj in _graph.instances_of(mapped):
        for attr in _tree.info_of(obj).state:
            slot = obj.__dict__.get(attr)
            if not isinstance(slot, StateSlot) or slot.part_of() is None:
                continue
            swapped.append((obj, attr, slot, state_name(obj, attr, names)))
    if not swapped:
        return call()
    states = {name: slot.read() for _, _, slot, name in swapped}
    swapped = [entry for entry in swapped if traceable(states[entry[3]])]
    if not swapped:
        return call()
    wholes: dict[tuple[int, str], tuple[Any, str, Any]] = {}
    for _, _, slot, _ in swapped:
        owner, owner_attr = slot.part_of()  # type: ignore[misc]
        wholes.setdefault((id(owner), owner_attr), (owner, owner_attr, owner.__dict__[owner_attr]))
    for owner, owner_attr, held in wholes.values():
        owner.__dict__[owner_attr] = _WholeOfMappedViews(held, type(owner).__name__, owner_attr, what)
    try:
        out, new = run_handled(swapped, states, call)
    finally:
        for owner, owner_attr, held in wholes.values():
            owner.__dict__[owner_attr] = held
    write_back(swapped, states, new)
    return out


class _WholeOfMappedViews(StandIn):
    """A stacked state while a mapping transformation maps over a view of
    part of it (``with_layer_views``): refused to every other path."""

    __slots__ = ("slot", "owner", "attr", "what")
    handleable = False

    def __init__(self, slot: Any, owner: str, attr: str, what: str):
        self.slot = slot
        self.owner = owner
        self.attr = attr
        self.what = what

    def _refusal(self) -> Exception:
        return ControlFlowStateError(
            format_error(
                f"State {self.owner}.{self.attr} of a stack is used inside {self.what}, which "
                "maps over a layer of that stack (a stack held by a layer: its states are "
                "parts of this one): the mapped layer's slices and this state would be two "
                "values of one state.",
                where=user_location(),
                fix="use the stack through the layer alone inside the mapped function, or "
                "map over the whole outer stack (`for block in self.blocks`).",
            )
        )

    def read(self) -> Any:
        raise self._refusal()

    def write(self, value: Any, label: str | None = None) -> None:
        raise self._refusal()

    def as_request(self) -> Any:
        raise self._refusal()


def members_of(cells: Cells, tree: Any) -> list[int]:
    """The cells (indices into ``cells``) of the states of the decorated
    instances in ``tree`` that hold JAX values: those a mapping transformation
    slices, one slice per member (a deque or a plain object is not sliced)."""
    index = {id(cell): i for i, cell in enumerate(cells)}
    found: dict[int, None] = {}
    for obj in _graph.instances_of(tree):
        for attr in _tree.info_of(obj).state:
            slot = obj.__dict__.get(attr)
            if type(slot) is not HandledLocalStateRef:
                continue
            cell = handler_cells(slot.handler_id).get(slot.name)
            i = index.get(id(cell))
            if cell is not None and i is not None and traceable(cell.value):
                found[i] = None
    return list(found)


def check_stacked(cells: Cells, axes: Sequence[int], size: int | None, what: str) -> int | None:
    """Every array of the member states ``cells`` has the mapped axis (its entry
    of ``axes``), of one size (``size`` where the call fixes it): the members
    agree, as a stack ``jax.vmap(Layer)(keys)`` builds does. The size, or ``None``."""
    for cell, axis in zip(cells, axes):
        for leaf in jax.tree_util.tree_leaves(cell.value):
            shape = jax.numpy.shape(leaf)
            n = shape[axis] if -len(shape) <= axis < len(shape) else None
            if n is None or (size is not None and n != size):
                count = f" ({size} here)" if size is not None else ""
                raise ControlFlowStateError(
                    format_error(
                        f"State {cell.name!r} holds {describe(cell.value)}, but it belongs to "
                        f"a sub-model passed to {what} as a mapped argument, which makes the "
                        f"sub-model a stack of members: each of its states needs axis {axis}, "
                        f"one entry per member{count}, and this one "
                        + ("lacks it." if n is None else f"has {n}: the members disagree."),
                        where=user_location(),
                        fix="build the stack with one call, `jax.vmap(Layer)(keys)`, so every "
                        "state has the members' axis; or pass the sub-model unmapped (in_axes "
                        "None) if it is one model every example shares.",
                    )
                )
            size = n
    return size


def guarding_copies(tree: Any, what: str, call: Callable[[], Any]) -> Any:
    """``call()``, the copies JAX made of the models in ``tree`` (a mapped
    argument's members, a scan step's slice) guarded as a lax body's eager
    models are: a traced value assigned to an attribute that is not state,
    or put in a list or dict they hold, would be lost with the copy, where
    plain Python's loop keeps one per member; it is refused."""
    copies = _graph.instances_of(tree)
    if not copies:
        return call()
    guard = Guard.for_lax_body(
        what, copies, [], lambda: ((cell.name, cell.value) for cell in running_cells())
    )
    with eager_lax_body(copies, what):
        return guarded(guard, call)


@contextlib.contextmanager
def member_slices(chosen: Cells) -> Iterator[None]:
    """While the cells ``chosen`` hold one member's slice of a stacked
    sub-model: read only through the members (``lifetime.MEMBER_CELLS``)."""
    token = MEMBER_CELLS.set(MEMBER_CELLS.get() | {id(cell) for cell in chosen})
    try:
        yield
    finally:
        MEMBER_CELLS.reset(token)


def member_body(
    cells: Cells, members: Sequence[int], body: Callable[[Any, Any], Any], what: str
) -> Callable[[Any, tuple[Any, list[Any]]], Any]:
    """``body(carry, x)`` of a scan whose ``x`` is ``(x, member slices)``: the
    member cells hold this step's slices while it runs, and the slices it
    assigned leave as part of its ``y`` (stacked by the scan), so they are
    never a carry. The other cells are left to the caller's threading."""
    chosen = [cells[i] for i in members]

    def run(carry: Any, x: tuple[Any, list[Any]]) -> Any:
        x, slices = x
        saved = [cell.value for cell in chosen]
        for cell, value in zip(chosen, slices):
            cell.value = value
        signatures = [signature_of(v) for v in slices]
        ok = False
        try:
            with member_slices(chosen):
                carry, y = settled(body(carry, x))
            after = current_values(chosen)
            ok = True
        finally:
            # (When it raised, a slice it assigned stays: the caller marks it lost.)
            for cell, value, old in zip(chosen, slices, saved):
                if ok or cell.value is value:
                    cell.value = old
        written = {
            k: v for k, (v, b, sig) in enumerate(zip(after, slices, signatures))
            if was_assigned(b, sig, v)
        }
        for k, value in written.items():
            if type_of(value) != type_of(slices[k]):
                raise ControlFlowStateError(
                    format_error(
                        f"State {chosen[k].name!r} of one member of a stacked sub-model is "
                        f"assigned {describe(value)} inside {what}, but its slice of the "
                        f"stacked state is {describe(slices[k])}: the slices a scan stacks "
                        "keep their shape, dtype and structure.",
                        where=user_location(),
                        fix="assign a value of the slice's shape and dtype.",
                    )
                )
        return carry, (y, written)

    return run


