"""The lifting every JAX function of ``autostate.lifting`` shares: binding
cells (``bound_to``), the four steps (``probed``, ``lift``'s ``pure_of``,
the family's placement, ``land``), eager models' states handed to a
temporary handler (``with_eager_states``), and the placement the mapping
families share (``members_of``, ``member_body``, ``with_layer_views``)."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax import lax

from autostate import graph as _graph
from autostate import tree as _tree
from autostate import values as _values
from autostate.effects.local_state import (
    HandledLocalStateRef,
    LocalStateEffectImpl,
    StateSlot,
    fresh_handler_id,
    handler_cells,
    run_with_states,
    running_cells,
)
from autostate.errors import (
    AutostateError,
    ControlFlowStateError,
    StateAccessError,
    StaticStateError,
    format_error,
    refused,
    user_location,
)
from autostate.guard import CAPTURED, Guard, after_probe, eager_lax_body, register_view
from autostate.lifetime import (
    MEMBER_CELLS,
    OWN_STATE_HANDLERS,
    LostValue,
    contains_tracer,
    lifted_body,
)
from autostate.state_values import StaticState, is_static_value, same_static

Cells = Sequence[LocalStateEffectImpl]
# Slots handed to a handler for a call: (instance, attribute, slot, state name)
Swapped = list[tuple[Any, str, StateSlot, str]]


# --- binding cells ------------------------------------------------------------


@contextlib.contextmanager
def bound_to(cells: Cells, chosen: Cells, values: Sequence[Any], what: str) -> Iterator[None]:
    """Binds ``chosen`` to ``values`` while a body is traced; restores every cell after.

    A body that raises leaves each cell it assigned a ``LostValue``: JAX keeps
    nothing it computed, while plain Python's loop would have kept the
    assignment. A refusal of autostate's ends the whole call instead, so the
    cells take their old values."""
    saved = [cell.value for cell in cells]
    for cell, value in zip(chosen, values):
        cell.value = value
    bound = [cell.value for cell in cells]
    try:
        with lifted_body():
            yield
    except BaseException as raised:
        written = [cell for cell, value in zip(cells, bound) if cell.value is not value]
        for cell, value in zip(cells, saved):
            cell.value = value
        if written and not isinstance(raised, AutostateError):
            # (A KeyboardInterrupt too: plain Python's loop kept what ran.)
            where = user_location()
            for cell in written:
                cell.value = LostValue(cell.name, what, raised, where)
        raise
    else:
        for cell, value in zip(cells, saved):
            cell.value = value


def settled(tree: Any) -> Any:
    """``tree`` rebuilt while the body's cells are still bound, so a model in
    what the body returns carries its states as the body left them."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def current_values(cells: Cells) -> list[Any]:
    values = [cell.value for cell in cells]
    for value in values:
        if type(value) is LostValue:
            raise value.error()  # a nested body raised and the outer one went on
    return values


def abstract_of(value: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda leaf: jax.ShapeDtypeStruct(
            jax.numpy.shape(leaf), jax.numpy.result_type(leaf), weak_type=weak_types(leaf)[0]
        ),
        value,
    )


def type_of(value: Any) -> tuple:
    leaves, treedef = jax.tree_util.tree_flatten(value)
    return treedef, tuple(
        (tuple(jax.numpy.shape(x)), jax.numpy.result_type(x)) for x in leaves
    )


def describe(value: Any) -> str:
    """``float32[3]``, or a tree of them."""
    treedef, leaves = type_of(value)
    parts = [f"{dtype}{list(shape)}" for shape, dtype in leaves]
    if treedef.num_leaves == 1 and jax.tree_util.treedef_is_leaf(treedef):
        return parts[0]
    return f"{treedef} of {', '.join(parts)}"


def writes_of(
    cells: Cells, body: Callable[..., Any], *args: Any, what: str
) -> tuple[list[int], list[Any]]:
    """Which cells ``body(*args)`` assigns, and their new abstract values.

    One abstract trace with every cell rebound to a fresh abstract value,
    except cells holding a concrete number or array: the real trace binds only
    the assigned cells to traced values, so a body that only reads one
    (``if self.p > 0:``) has it concrete there, as plain Python does."""
    written: list[int] = []
    current = current_values(cells)
    # (A value JAX cannot trace, a deque or a plain object, is kept as it is.)
    concrete = {
        i: v for i, v in enumerate(current) if _concrete_leaf(v) or not traceable(v)
    }

    def probe(abstract: list[Any], *inner: Any) -> Any:
        rest = iter(abstract)
        values = [concrete[i] if i in concrete else next(rest) for i in range(len(cells))]
        with bound_to(cells, cells, values, what):
            assigned = assigned_since(values)
            out = settled(body(*inner))
            after = current_values(cells)
        written[:] = assigned(after)
        check_returnable(cells, written, after, what, traceable)
        return out, [after[i] for i in written]

    abstract = [v for i, v in enumerate(current) if i not in concrete]
    _, new = jax.eval_shape(probe, abstract, *args)
    after_probe()
    return written, new


def traceable(value: Any) -> bool:
    """Whether every leaf of ``value`` is an array or a number, which JAX can trace."""
    for leaf in jax.tree_util.tree_leaves(value):
        kind = _values.kind_of(leaf)
        if not (kind.array or kind.number):
            return False
    return True


def _concrete_leaf(value: Any) -> bool:
    """A Python float or complex, a numpy number, or a JAX array that is not traced."""
    kind = _values.kind_of(value)
    if kind is _values.ARRAY:
        return not isinstance(value, jax.core.Tracer)
    return kind is _values.NUMPY_SCALAR or isinstance(value, (float, complex))


def assigned_since(before: Sequence[Any]) -> Callable[[Sequence[Any]], list[int]]:
    """Which of the values ``before`` a body then assigned, given the values
    after it: another object, or a container changed in place (its structure
    or a leaf, by identity: ``self.sub.items[0] = v``, ``d = self.d; d["k"] =
    v``), which plain Python's loop would keep as well. An array cannot change
    in place."""
    signatures: list[tuple[list[Any], Any] | None] = [
        None if _values.kind_of(v) is _values.ARRAY else jax.tree_util.tree_flatten(v)
        for v in before
    ]

    def assigned(after: Sequence[Any]) -> list[int]:
        found = []
        for i, (b, sig, a) in enumerate(zip(before, signatures, after)):
            if a is not b:
                found.append(i)
            elif sig is not None:
                leaves, treedef = jax.tree_util.tree_flatten(a)
                if treedef != sig[1] or any(x is not y for x, y in zip(leaves, sig[0])):
                    found.append(i)
        return found

    return assigned


def check_kept(cells: Cells, new: Sequence[Any], what: str) -> None:
    for cell, value in zip(cells, new):
        if type_of(cell.value) != type_of(value):
            raise ControlFlowStateError(
                format_error(
                    f"State {cell.name!r} changes from {describe(cell.value)} to "
                    f"{describe(value)} inside {what}; a state assigned there is threaded "
                    "as a loop carry (or a branch output), and loop carries and branch "
                    "outputs keep their shape, dtype and structure.",
                    where=user_location(),
                    fix="assign a value of the same shape and dtype (cast with "
                    ".astype(...), pad to a fixed size), or assign it outside the "
                    "control-flow call.",
                )
            )


def weak_types(value: Any) -> tuple[bool, ...]:
    """Which leaves of ``value`` are weakly typed (Python scalars, ``jnp.asarray(0.0)``):
    part of what a state means, as a weak value takes the dtype of what it meets."""

    def weak(leaf: Any) -> bool:
        try:
            return bool(getattr(jax.typeof(leaf), "weak_type", False))
        except TypeError:
            return False

    return tuple(weak(leaf) for leaf in jax.tree_util.tree_leaves(value))


def strong_where_mixed(outcomes: Sequence[Sequence[Any]]) -> list[bool]:
    """Per state, whether it is weak after one branch and strong after another
    (``outcomes[b][k]``): the traced call has one type, so such a state comes out
    strong, as a loop carry does."""
    kinds = [[weak_types(value) for value in branch] for branch in outcomes]
    return [len({branch[k] for branch in kinds}) > 1 for k in range(len(outcomes[0]))]


def strengthened(value: Any) -> Any:
    """``value`` with its weakly typed leaves made strong, of the same dtype."""
    return jax.tree_util.tree_map(
        lambda leaf: lax.convert_element_type(leaf, jax.numpy.result_type(leaf)), value
    )


def run_bound(
    cells: Cells, chosen: Cells, values: Sequence[Any], what: str, call: Callable[[], Any]
) -> tuple[Any, list[Any], set[int]]:
    """``call()`` traced with ``chosen`` bound to ``values``: its output, every
    cell's value after it, and which cells it assigned."""
    with bound_to(cells, chosen, values, what):
        assigned = assigned_since(current_values(cells))
        out = settled(call())
        after = current_values(cells)
    return out, after, set(assigned(after))


def probed(cells: Cells, what: str, body: Callable[..., Any], *args: Any) -> list[int]:
    """Step 1: which cells ``body(*args)`` assigns (``writes_of``), each checked
    to keep its type, as a carry or a branch output must."""
    written, new = writes_of(cells, body, *args, what=what)
    check_kept([cells[i] for i in written], new, what)
    return written


def _pure(
    cells: Cells, chosen: Cells, fun: Callable[..., Any], what: str, reads_only: bool = False
) -> Callable[..., tuple[Any, list[Any]]]:
    """Step 2: ``fun`` as ``(values, *args) -> (out, new values)`` of the ``chosen``
    states; ``reads_only`` (a ``cond_fun``) refuses an assignment."""

    def pure(values: list[Any], *args: Any, **kwargs: Any) -> tuple[Any, list[Any]]:
        with bound_to(cells, chosen, values, what):
            if not reads_only:
                return settled(fun(*args, **kwargs)), current_values(chosen)
            assigned = assigned_since(current_values(cells))
            out = fun(*args, **kwargs)
            for i in assigned([cell.value for cell in cells]):
                raise ControlFlowStateError(
                    format_error(
                        f"State {cells[i].name!r} is assigned in {what}, which must not change "
                        "state (it only decides; JAX may call it any number of times).",
                        where=user_location(),
                        fix="assign the state in the loop body instead.",
                    )
                )
            return out, values

    return pure


def lift(
    cells: Cells,
    written: Sequence[int],
    what: str,
    place: Callable[[Callable[..., Callable[..., Any]], list[Any]], tuple[Any, list[Any]]],
    plain: Callable[[], Any] | None = None,
) -> Any:
    """The one lifting of the loops, branches and ``checkpoint``: the states
    ``written`` (step 1) are threaded by ``place(pure_of, values)``, which
    calls the JAX function with them placed (step 3; ``pure_of`` is step 2) and
    returns the output and new values, which land (step 4). None written:
    ``plain()``, where given."""
    if not written and plain is not None:
        return plain()
    chosen = [cells[i] for i in written]

    def pure_of(fun: Callable[..., Any], inside: str = what, reads_only: bool = False) -> Any:
        return _pure(cells, chosen, fun, inside, reads_only)

    out, values = place(pure_of, current_values(chosen))
    land(chosen, dict(enumerate(values)))
    return out


def land(cells: Cells, new: dict[int, Any]) -> None:
    """Step 4: the states take the values the JAX function returned (by index)."""
    for i, value in new.items():
        cells[i].value = value


def argument_writes(
    cells: Cells, passed: Sequence[int], values: Sequence[Any], what: str, call: Callable[[], Any]
) -> tuple[Any, dict[int, Any]]:
    """``call()`` with the cells ``passed`` bound to ``values``: its output and the
    new values of those it assigned; an assigned cell not passed is refused."""
    out, after, changed = run_bound(cells, [cells[i] for i in passed], values, what, call)
    check_returnable(cells, [i for i in sorted(changed) if i not in passed], after, what)
    check_returnable(cells, [i for i in passed if i in changed], after, what, traceable)
    return out, {k: after[i] for k, i in enumerate(passed) if i in changed}


def check_returnable(
    cells: Cells, written: Sequence[int], after: Sequence[Any], what: str,
    returnable: Callable[[Any], bool] = lambda value: False,
) -> None:
    """Refuses a value that cells ``written`` took inside ``what`` and that
    JAX cannot return from the function it transforms (a Python value, a
    function): the assignment would happen once per trace."""
    for i in written:
        if returnable(after[i]):
            continue
        raise ControlFlowStateError(
            format_error(
                f"State {cells[i].name!r} is assigned {type(after[i]).__name__} inside {what}, "
                "a value JAX cannot return from the function it transforms: the assignment "
                "would happen when JAX traces the function, not each time it runs.",
                where=user_location(),
                fix="keep what changes there in arrays, or change the state outside the "
                "transformed function.",
            )
        )


def shared_write(cell: LocalStateEffectImpl, inside: str, unit: str, fix: str) -> Exception:
    """A state every ``unit`` (example, shard) of a transformation shares,
    assigned a value that differs between them."""
    return ControlFlowStateError(
        format_error(
            f"State {cell.name!r} is assigned a value that differs from {unit} to {unit} inside "
            f"{inside}, but every {unit} shares the state: no single value means what the "
            "plain program would leave. The model keeps its value from before the call.",
            where=user_location(),
            fix=fix,
        )
    )


# --- the models a lax function returns --------------------------------------------


class PassedModels:
    """The models a lax function returns as they were passed in.

    JAX rebuilds every model in a lax function's output from leaves, a copy;
    plain Python's body returns the object it was handed (a loop's carry, a
    branch's operand), so a call on it afterwards writes the model itself.
    One rule for every lax function: the output holds, at a place, the
    original model ``X`` (the one passed in, or one the body reaches) where
    every body traced returned ``X`` there (the copy handed in for it, or
    ``X`` itself), and, for a loop (``loop``), its initial carry holds ``X``
    there too (what zero steps return). Anything else (a model built in the
    body, carried models swapped) stays JAX's copy.

    ``operands`` are what the call hands the body (its carry, its operands);
    ``received_at`` is the body's argument that receives them (``None``: all
    of its arguments, as a tuple); ``returned_at`` the item of the body's
    output, and of the call's, that returns them (``None``: all of it)."""

    def __init__(
        self, operands: Any, received_at: int | None, returned_at: int | None, loop: bool
    ):
        self.places = dict(_models_at(operands))
        self.received_at, self.returned_at, self.loop = received_at, returned_at, loop
        self.bodies: list[Callable[..., Any]] = []
        self.traces: list[list[dict[Any, Any] | None]] = []

    def body(self, fun: Callable[..., Any]) -> Callable[..., Any]:
        """``fun``, noting which originals each of its traces returns where."""
        traces: list[dict[Any, Any] | None] = []
        self.bodies.append(fun)
        self.traces.append(traces)

        def noting(*args: Any, **kwargs: Any) -> Any:
            out = fun(*args, **kwargs)
            traces.append(self._returned(args, out))
            return out

        functools.update_wrapper(noting, fun, updated=())
        return noting

    def _returned(self, args: tuple, out: Any) -> dict[Any, Any] | None:
        received = _item(args, self.received_at)
        returned = _item(out, self.returned_at)
        if received is _NO_ITEM or returned is _NO_ITEM:
            return None  # (JAX says what does not match)
        handed = {id(copy): self.places.get(path) for path, copy in _models_at(received)}
        return {
            path: handed[id(obj)] if id(obj) in handed else obj
            for path, obj in _models_at(returned)
        }

    def result(self, out: Any) -> Any:
        """The call's output ``out``, each model the rule maps as its original."""
        part = _item(out, self.returned_at)
        traces = [trace for body in self.traces for trace in body]
        if part is _NO_ITEM or not all(self.traces) or not any(traces):
            return out  # (a body not traced; or no model returned)
        found, treedef = jax.tree_util.tree_flatten_with_path(
            part, is_leaf=_graph.is_stateful_instance
        )
        leaves = [leaf for _, leaf in found]
        known: set[int] | None = None
        changed = False
        for k, (path, leaf) in enumerate(found):
            if not _graph.is_stateful_instance(leaf):
                continue
            outcomes = [trace.get(path) if trace is not None else None for trace in traces]
            if self.loop:
                outcomes.append(self.places.get(path))
            original = outcomes[0]
            if original is None or type(original) is not type(leaf) or any(
                o is not original for o in outcomes
            ):
                continue
            if not any(original is obj for obj in self.places.values()):
                if known is None:  # (not built in the body: one the bodies reach)
                    known = {id(obj) for obj in _graph.reachable_instances(self.bodies, [])}
                if id(original) not in known:
                    continue
            leaves[k] = original
            changed = True
        if not changed:
            return out
        part = jax.tree_util.tree_unflatten(treedef, leaves)
        if self.returned_at is None:
            return part
        items = list(out)
        items[self.returned_at] = part
        return type(out)(items)


_NO_ITEM: Any = object()


def _item(value: Any, index: int | None) -> Any:
    if index is None:
        return value
    if type(value) in (tuple, list) and len(value) > index:
        return value[index]
    return _NO_ITEM


def _models_at(tree: Any) -> list[tuple[Any, Any]]:
    """``(key path, model)`` of each decorated instance in ``tree`` (not inside another)."""
    found, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_graph.is_stateful_instance)
    return [(path, leaf) for path, leaf in found if _graph.is_stateful_instance(leaf)]


# --- eager models ---------------------------------------------------------------

# A body that reaches a slot holding its own value (an eager model's, a copy's:
# ``graph.OWN_VALUE_SLOTS``) has it threaded like an eager model's.


def with_eager_states(
    roots: Sequence[Any], call: Callable[[], Any], what: str, once: bool = False,
    boundary: bool = False,
) -> Any:
    """Runs ``call`` with eager instances' states (reachable from ``roots``) handled.

    Their slots become references of a temporary handler, so the body's writes
    are threaded like a functionalized model's, then written back as eager
    writes. JAX traces the body rather than running it per step, so a static
    state takes no new value there and a traced value in a plain attribute is
    refused (as ``f`` does). ``once``: the body runs once per call (a
    derivative's function), so a static state may change; ``boundary``: the
    call is an object boundary (a ``jax.jit`` inside a method), where a
    sub-model assigned is written back as the plain call makes it."""
    captured: list[Any] = []
    instances = _graph.reachable_instances(roots, captured)
    swapped, statics = own_states(instances)
    once = once or boundary  # (an object boundary's function runs once per call)
    # What a change in place inside the body must not reach: it is made once
    # per trace, and a traced value put there outlives the trace. The
    # containers the instances hold outside their states; those of the
    # states themselves as they are before the call (the body changes
    # threaded copies, never these, unless it holds a reference taken before
    # the call); and the lists and dicts the body captures.
    cells = running_cells()
    if not instances and not cells and not captured:
        return call()
    guard = Guard.for_lax_body(
        what,
        instances,
        [(f"state {cell.name!r}", cell.value) for cell in cells]
        + [(f"state {name!r}", slot.read()) for _, _, slot, name in swapped]
        + [(CAPTURED, c) for c in captured],
        lambda: ((cell.name, cell.value) for cell in running_cells()),
    )
    call = functools.partial(guarded, guard, call)
    if not instances:
        return call()
    # A body run once per call (``once``) may give a static state another
    # Python value, as plain Python does; a traced value it may not hold.
    stand_in = _StaticOnce if once else _StaticInBody
    standing = [
        (obj, attr, slot, stand_in(slot, f"{type(obj).__name__}.{attr}", what))
        for obj, attr, slot in statics
    ]
    for obj, attr, _, standin in standing:
        obj.__dict__[attr] = standin
    try:
        with eager_lax_body(instances, what, boundary=boundary):
            return with_states_handled(swapped, call, None if boundary else what)
    finally:
        for obj, attr, slot, standin in standing:
            if obj.__dict__.get(attr) is standin:  # (else assigned: the new slot stays)
                obj.__dict__[attr] = slot


def own_states(instances: Sequence[Any]) -> tuple[Swapped, list[tuple[Any, str, Any]]]:
    """The states ``instances`` hold themselves, each ``(instance, attribute,
    slot, name)``, and their static states ``(instance, attribute, slot)``,
    which a handler does not take."""
    found: list[tuple[Any, str, Any]] = []
    statics: list[tuple[Any, str, Any]] = []
    for obj in instances:
        for attr in _tree.info_of(obj).state:
            slot = obj.__dict__.get(attr)
            if type(slot) is StaticState:
                statics.append((obj, attr, slot))
                continue
            if type(slot) is LostState:
                # (An earlier body raised after assigning it: it has no value
                # for this one, as reading it says; JAX would meet the slot.)
                raise slot.lost.error()
            if type(slot) not in _graph.OWN_VALUE_SLOTS:
                continue
            found.append((obj, attr, slot))
    return named_states(found, instances), statics


def named_states(found: list[tuple[Any, str, Any]], instances: Sequence[Any]) -> Swapped:
    """``found`` (``(instance, attribute, slot)``) with the name a handler gives
    each state for one call, as its errors show it: ``Linear.w``, or, where two
    instances of a class are handled, the path from the first of ``instances``
    that reaches it (``Net.enc.w``, ``Net.dec.w``)."""
    plain = [f"{type(obj).__name__}.{attr}" for obj, attr, _ in found]
    names = set(plain)
    if len(names) == len(plain):
        return [(obj, attr, slot, name) for (obj, attr, slot), name in zip(found, plain)]
    paths = _graph.instance_paths(instances)
    names = set()
    swapped: Swapped = []
    for (obj, attr, slot), name in zip(found, plain):
        path = paths.get(id(obj))
        swapped.append((obj, attr, slot, state_name(f"{path}.{attr}" if path else name, names)))
    return swapped


def with_states_handled(
    swapped: Swapped, call: Callable[[], Any], what: str | None = None
) -> Any:
    """The one lift of a call on models that hold their states: bind them to a
    handler's cells, run ``call`` (the traced body of ``what``, where it is
    one), write back what it assigned."""
    if not swapped:
        return call()
    states = {name: slot.read() for _, _, slot, name in swapped}
    out, new = run_handled(swapped, states, call, what)
    write_back(swapped, states, new)
    return out


def state_name(name: str, names: set[str]) -> str:
    """``name``, made unique among ``names`` (``Linear.w``, then ``Linear.w'``
    for another instance's that no path tells apart), added to them."""
    while name in names:
        name += "'"
    names.add(name)
    return name


def run_handled(
    swapped: Swapped, states: dict[str, Any], call: Callable[[], Any], what: str | None = None
) -> tuple[Any, dict[str, Any]]:
    """``call()`` with the slots ``swapped`` made references of a fresh handler
    holding ``states``: its output and the new values (for ``write_back``).
    A state the call rebound to a sub-model at an object boundary
    (``guard.check_structure_change``) keeps it, and has no new value.
    A call that raises leaves each state its body assigned a ``LostState``.
    ``what``: the traced body the call is (the handler's errors name it)."""
    handler_id = fresh_handler_id()
    refs = []
    for obj, attr, slot, name in swapped:
        ref = HandledLocalStateRef(handler_id, name, False, slot.category)
        refs.append(ref)
        obj.__dict__[attr] = ref
    lost: dict[str, LostValue] = {}
    rebound: list[str] = []
    OWN_STATE_HANDLERS[handler_id] = what
    try:
        out, new = run_with_states(handler_id, states, _keeping_lost, (call, handler_id, lost), {})
    finally:
        OWN_STATE_HANDLERS.pop(handler_id, None)
        for (obj, attr, slot, name), ref in zip(swapped, refs):
            if obj.__dict__.get(attr) is not ref:
                rebound.append(name)
                continue
            obj.__dict__[attr] = LostState(slot, lost[name]) if name in lost else slot
    for name in rebound:
        new.pop(name, None)
    return out, new


def write_back(swapped: Swapped, states: dict[str, Any], new: dict[str, Any]) -> None:
    """Each slot of ``swapped`` whose state has a new value is assigned it, as an eager write."""
    for obj, attr, slot, name in swapped:
        if name in new and new[name] is not states[name]:
            replacement = slot.write(new[name], attr)
            if replacement is not None:
                obj.__dict__[attr] = replacement


def guarded(guard: Guard, call: Callable[[], Any]) -> Any:
    """``call()`` under ``guard``, which also looks when it raised: JAX may meet an
    escaped tracer first."""
    with guard:
        return call()


def transformation(
    fun: Callable[..., Any], what: str, call: Callable[[tuple, dict], Any], once: bool = False,
    boundary: bool = False,
) -> Callable[..., Any]:
    """A JAX transformation of ``fun`` whose calls run ``call(args, kwargs)``
    with eager models' states handled (``once``: ``fun`` runs once per call;
    ``boundary``: it is an object boundary, see ``with_eager_states``)."""

    def transformed(*args: Any, **kwargs: Any) -> Any:
        return with_eager_states(
            (fun, args, kwargs), lambda: call(args, kwargs), what, once, boundary
        )

    functools.update_wrapper(transformed, fun, updated=())
    return transformed


def with_states_first(threaded: Callable[..., Any], fun: Callable[..., Any]) -> None:
    """Gives ``threaded`` ``fun``'s signature after a first states argument, so
    JAX matches ``static_argnames`` as it would for ``fun``."""
    try:
        signature = inspect.signature(fun)
    except (TypeError, ValueError):
        return
    first = inspect.Parameter("__autostate_states", inspect.Parameter.POSITIONAL_ONLY)
    threaded.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[first, *signature.parameters.values()]
    )


def after_states(numbers: Any) -> tuple[int, ...]:
    """Argument numbers of a function that now takes the states first: a
    non-negative one moves up by one."""
    numbers = (numbers,) if isinstance(numbers, int) else tuple(numbers)
    return tuple(i + 1 if i >= 0 else i for i in numbers)


def _keeping_lost(call: Callable[[], Any], handler_id: Any, lost: dict[str, LostValue]) -> Any:
    """``call()``; if it raises, the states its body lost (see ``bound_to``) into ``lost``."""
    try:
        return call()
    except BaseException:
        for name, cell in handler_cells(handler_id).items():
            if type(cell.value) is LostValue:
                lost[name] = cell.value
        raise


class StandIn(StateSlot):
    """A slot standing in for another (``slot``) while a call runs: the state
    keeps that slot's category."""

    __slots__ = ()
    slot: Any

    @property
    def category(self) -> Any:  # type: ignore[override]
        return self.slot.category


class LostState(StandIn):
    """An eager state whose lax body raised after assigning it: reading it raises
    what happened; assigning it gives it a value again."""

    __slots__ = ("slot", "lost")
    handleable = True

    def __init__(self, slot: Any, lost: LostValue):
        self.slot = slot
        self.lost = lost

    def read(self) -> Any:
        raise self.lost.error()

    def write(self, value: Any, label: str | None = None) -> Any:
        replacement = self.slot.write(value, label)
        return self.slot if replacement is None else replacement

    def as_request(self) -> Any:
        raise self.lost.error()


class _StaticInBody(StandIn):
    """An eager static state while a lax body that reaches it is traced:
    readable, and assignable only to the value it holds."""

    __slots__ = ("slot", "label", "what")
    handleable = False

    def __init__(self, slot: StaticState, label: str, what: str):
        self.slot = slot
        self.label = label
        self.what = what

    def read(self) -> Any:
        return self.slot.value

    def write(self, value: Any, label: str | None = None) -> None:
        held = self.slot.value
        if is_static_value(value) and same_static(value, held):
            return None
        shown = _tree.describe(value) if contains_tracer(value) else repr(value)
        raise refused(StaticStateError(
            format_error(
                f"Static state {self.label} (a Python {type(held).__name__}, holding {held!r}) "
                f"is assigned {shown} inside {self.what}: JAX traces that function instead "
                "of running it as plain Python does (a loop body once per step), so a Python "
                "value assigned there would change once per trace.",
                fix="keep a value that changes there in an array "
                f"(`self.{self.label.rpartition('.')[2]} = jnp.asarray(...)` in __init__): "
                "array states assigned inside are threaded through the call; or assign it "
                "outside the call.",
            )
        ))

    def as_request(self) -> Any:
        raise NotImplementedError


class _StaticOnce(_StaticInBody):
    """An eager static state while a function that runs once per call (a
    ``jax.jit`` or a derivative inside a method) is traced: it may take
    another Python value, as plain Python's would; a traced value, which would
    outlive the trace in a Python value's place, is refused."""

    __slots__ = ()

    def write(self, value: Any, label: str | None = None) -> Any:
        if not contains_tracer(value):
            return self.slot.write(value, label)
        held = self.slot.value
        attr = self.label.rpartition(".")[2]
        raise refused(StaticStateError(
            format_error(
                f"Static state {self.label} (a Python {type(held).__name__}, holding "
                f"{held!r}) is assigned {_tree.describe(value)} inside {self.what}: a value "
                "of that trace, which the state, part of the model's structure, cannot "
                "hold once the trace is over.",
                fix=f"keep it in an array (`self.{attr} = jnp.asarray({held!r})` in __init__): "
                "array states assigned inside are threaded through the call; or compile "
                "the whole step with autostate.jit, where the state becomes an array.",
            )
        ))


def jit_disabled() -> bool:
    """Under ``jax.disable_jit()`` JAX runs bodies as plain Python would: their
    assignments are eager writes, and nothing is threaded."""
    return bool(jax.config.jax_disable_jit)  # type: ignore[attr-defined]  # (not in its stubs)

def layers_mapped(tree: Any) -> Any:
    """``tree`` with each stack in it (and in its lists, tuples and dicts) as its
    stacked model; the same object when it holds none."""
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
    stacked models; one with in_axes ``None`` keeps its stack whole."""
    if not _graph.STACKS:
        return args, kwargs
    axes = tuple(in_axes) if isinstance(in_axes, (tuple, list)) else (in_axes,) * len(args)
    if len(axes) != len(args):
        return args, kwargs  # (jax.vmap says what does not match)
    mapped = tuple(a if axis is None else layers_mapped(a) for axis, a in zip(axes, args))
    return mapped, layers_mapped(kwargs)


# --- stacked sub-models -------------------------------------------------------------
# A sub-model in a mapped argument is a list of members: each reads and writes
# its own slice of every state, and the slices written come back stacked.


def with_layer_views(mapped: Any, what: str, call: Callable[[], Any]) -> Any:
    """``call()``, the states of the layer views in ``mapped`` handled as states
    of their own while it runs.

    A stack held by a layer of an outer stack is a view: its states read and
    write their part of the outer stacked state (``StateSlot.part_of``). Mapped
    over, the slices written come back stacked and are written through the
    view. Meanwhile the outer state cannot be read by another path (it would be
    stale): refused."""
    found: list[tuple[Any, str, Any]] = []
    instances = _graph.instances_of(mapped)
    for obj in instances:
        for attr in _tree.info_of(obj).state:
            slot = obj.__dict__.get(attr)
            if not isinstance(slot, StateSlot) or slot.part_of() is None:
                continue
            found.append((obj, attr, slot))
    swapped = named_states(found, instances)
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
    """The cells of the states of the decorated instances in ``tree`` that hold
    JAX values: those a mapping transformation slices, one slice per member."""
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
    """Every array of the member states ``cells`` has the mapped axis, of one
    size (``size`` where the call fixes it). The size, or ``None``."""
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
    """``call()``, the copies JAX made of the models in ``tree`` guarded as a lax
    body's eager models: a change outside their states would be lost with the copy.
    Each copy stands for a model's data, as a layer view does: an attribute that
    is not state, assigned any value, is refused at the line."""
    copies = _graph.instances_of(tree)
    if not copies:
        return call()
    for copy in copies:
        register_view(copy, functools.partial(_copy_attribute_refusal, what))
    guard = Guard.for_lax_body(
        what, copies, [], lambda: ((cell.name, cell.value) for cell in running_cells())
    )
    with eager_lax_body(copies, what):
        return guarded(guard, call)


def _copy_attribute_refusal(what: str, obj: Any, name: str) -> AutostateError:
    kind = type(obj).__name__
    return StateAccessError(format_error(
        f"{kind}.{name} is not state, and this {kind} is the copy JAX made of a sub-model "
        f"handed to {what} (one member of a stack, or the sub-model itself): assigning it "
        "would change the copy alone, lost when the step ends, where plain Python's loop "
        "changes each member.",
        where=user_location(),
        fix=f"make {name} state (assign `self.{name}` in a method of {kind}, or declare it "
        "with autostate.state(...) in __init__): each member then writes its own slice; "
        "or assign it outside the call.",
    ))


@contextlib.contextmanager
def member_slices(chosen: Cells) -> Iterator[None]:
    """While ``chosen`` hold one member's slice: read only through the members."""
    token = MEMBER_CELLS.set(MEMBER_CELLS.get() | {id(cell) for cell in chosen})
    try:
        yield
    finally:
        MEMBER_CELLS.reset(token)


def member_body(
    cells: Cells, members: Sequence[int], body: Callable[[Any, Any], Any], what: str
) -> Callable[[Any, tuple[Any, list[Any]]], Any]:
    """``body(carry, x)`` of a scan whose ``x`` is ``(x, member slices)``: the
    member cells hold this step's slices, and the slices it assigned leave in
    its ``y`` (stacked by the scan), never as a carry."""
    chosen = [cells[i] for i in members]

    def run(carry: Any, x: tuple[Any, list[Any]]) -> Any:
        x, slices = x
        saved = [cell.value for cell in chosen]
        for cell, value in zip(chosen, slices):
            cell.value = value
        assigned = assigned_since(slices)
        ok = False
        try:
            with member_slices(chosen), lifted_body():
                carry, y = settled(body(carry, x))
            after = current_values(chosen)
            ok = True
        finally:
            # (When it raised, a slice it assigned stays: the caller marks it lost.)
            for cell, value, old in zip(chosen, slices, saved):
                if ok or cell.value is value:
                    cell.value = old
        written = {k: after[k] for k in assigned(after)}
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


