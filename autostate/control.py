"""State read and assigned inside ``lax`` control flow and JAX transformations.

``@stateful`` routes every call in a method that resolves to ``jax.lax.scan``,
``cond``, ``switch``, ``while_loop``, ``fori_loop``, ``map``,
``jax.checkpoint`` / ``jax.remat``, a derivative (``jax.grad``,
``value_and_grad``, ``jacfwd``, ``jacrev``, ``jacobian``, ``hessian``,
``jvp``, ``vjp``, ``linearize``), ``jax.vmap``, ``jax.jit``,
``jax.shard_map``, ``jax.custom_vjp`` or ``jax.custom_jvp`` to the function
of the same name here (the rewritten line reads
``__autostate__.control.routed(lax.scan)(...)``); the lax functions,
``checkpoint`` and ``vmap`` are also public as ``autostate.scan`` and friends
for code the decorator never saw.

Every one of them is the same lifting:

1. find the live states (the cells of the running handlers) the function
   assigns: one abstract trace (``_probed``, so only those are threaded and
   the compiled program is the hand-threaded one), or, where JAX traces the
   function once anyway (jit, shard_map, vmap, a derivative), that trace;
2. make the function pure in them: their values in, their new values out
   (``_pure``; ``_run_bound`` where step 1 is the same trace);
3. call the JAX function with those values placed by its own rules;
4. write the new values back (``_land``).

Only step 3 differs from one function to the next; ``_lift`` runs steps 1,
2 and 4 around it for the loops, the branches and ``checkpoint``. The
placements::

    JAX function             the states go                          step 3 is in
    lax.scan, lax.map        into the carry; a stacked sub-model's   _scan_threaded,
                             into xs and ys                          _member_body
    lax.while_loop           into the carry (cond_fun only reads)    _while_loop
    lax.fori_loop            into the carry                          _fori_loop
    lax.cond, lax.switch     into every branch's operands, output    _branches
    jax.checkpoint           into the arguments, output              _checkpoint_call
    jax.jit                  into the arguments, output              _jit_call
    jax.shard_map            into the arguments (with their          _shard_map_call
                             partition specs), output
    jax.vmap                 a stacked sub-model's: in/out axes;     _vmap_call
                             any other: shared, out_axes None
    derivatives              into the auxiliary output               _with_aux_states
    custom_vjp, custom_jvp   nowhere: run as plain Python, or a      _custom_call
                             write JAX traces away is refused

An eager model (no handler running) has the states of the instances
reachable from the function and operands handed to a temporary handler for
the call (``_with_eager_states``), then written back as eager slots.

A stack of layers (``autostate.stack``) registers here: code reaching it
reaches its stacked model, and a stack in a mapped argument of ``lax.scan``,
``lax.map`` or ``jax.vmap`` is its stacked model, so each step gets one layer
(its node kind's ``stacked``, ``graph.NodeKind``).

This module knows the slot types of ``effects`` but nothing of source code.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
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
    running_call,
    running_calls,
    running_cells,
)
from autostate.errors import (
    AutostateError,
    ControlFlowStateError,
    EscapedStateError,
    StaticStateError,
    format_error,
    refused,
    user_location,
)
from autostate.guard import CAPTURED, Guard, eager_lax_body
from autostate.lifetime import (
    MEMBER_CELLS,
    LostValue,
    contains_tracer,
    current_trace,
    holds_escaped_tracer,
    with_home,
)
from autostate.state_values import StaticState, is_static_value, same_static

__all__ = [
    "checkpoint",
    "cond",
    "fori_loop",
    "map",
    "remat",
    "routed",
    "scan",
    "switch",
    "vmap",
    "while_loop",
    "wrapper_name",
]

Cells = Sequence[LocalStateEffectImpl]


# --- binding cells ------------------------------------------------------------


@contextlib.contextmanager
def _bound(cells: Cells, chosen: Cells, values: Sequence[Any], what: str) -> Iterator[None]:
    """Binds ``chosen`` to ``values`` while a body is traced; restores every cell after.

    A body that raises leaves each cell it assigned holding a ``LostValue``
    (reading it says what happened) instead of its value before the call: JAX
    keeps nothing that body computed, and plain Python's loop would have kept
    the assignment, so the old value would be silently wrong. A refusal of
    autostate's (an ``AutostateError``) ends the whole call instead, which
    leaves the model as it was before it: the cells take their old values.
    """
    saved = [cell.value for cell in cells]
    for cell, value in zip(chosen, values):
        cell.value = value
    bound = [cell.value for cell in cells]
    try:
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


def _settled(tree: Any) -> Any:
    """``tree`` rebuilt from its leaves while the body's cells are still
    bound: a model in what the body returns (its carry, a branch's output)
    then carries its states as the body left them, as plain Python's one
    object would, rather than as they are once the cells are restored."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _current(cells: Cells) -> list[Any]:
    values = [cell.value for cell in cells]
    for value in values:
        if type(value) is LostValue:
            raise value.error()  # a nested body raised and the outer one went on
    return values


def _abstract(value: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda leaf: jax.ShapeDtypeStruct(
            jax.numpy.shape(leaf), jax.numpy.result_type(leaf), weak_type=weak_types(leaf)[0]
        ),
        value,
    )


def _type_of(value: Any) -> tuple:
    leaves, treedef = jax.tree_util.tree_flatten(value)
    return treedef, tuple(
        (tuple(jax.numpy.shape(x)), jax.numpy.result_type(x)) for x in leaves
    )


def _describe(value: Any, weak: bool = False) -> str:
    """``float32[3]``, or a tree of them; ``weak`` marks weakly typed leaves ``weak float32[]``."""
    treedef, leaves = _type_of(value)
    parts = [f"{dtype}{list(shape)}" for shape, dtype in leaves]
    if weak:
        parts = [f"weak {p}" if w else p for p, w in zip(parts, weak_types(value))]
    if treedef.num_leaves == 1 and jax.tree_util.treedef_is_leaf(treedef):
        return parts[0]
    return f"{treedef} of {', '.join(parts)}"


def _writes(
    cells: Cells, body: Callable[..., Any], *args: Any, what: str
) -> tuple[list[int], list[Any]]:
    """Which cells ``body(*args)`` assigns, and their new abstract values.

    One abstract trace with every cell rebound to a fresh abstract value: a
    cell whose value is another object afterwards was assigned. A cell holding
    a concrete number or array (an eager model's, or ``f``'s outside ``jit``)
    keeps it: the real trace binds only the assigned cells to traced values,
    so a body that only reads it (``if self.p > 0:``, ``float(self.scale)``)
    has it concrete there, as plain Python's loop does. (A container is
    still rebuilt abstract: the body may change it in place.)
    """
    written: list[int] = []
    current = _current(cells)
    # (A value JAX cannot trace, a deque or a plain object, is kept as it is.)
    concrete = {
        i: v for i, v in enumerate(current) if _concrete_leaf(v) or not _traceable(v)
    }

    def probe(abstract: list[Any], *inner: Any) -> Any:
        rest = iter(abstract)
        values = [concrete[i] if i in concrete else next(rest) for i in range(len(cells))]
        with _bound(cells, cells, values, what):
            signatures = [_signature(v) for v in values]
            out = _settled(body(*inner))
            after = _current(cells)
        written[:] = [
            i for i, (a, b, sig) in enumerate(zip(values, after, signatures)) if _assigned(a, sig, b)
        ]
        return out, [after[i] for i in written]

    abstract = [v for i, v in enumerate(current) if i not in concrete]
    _, new = jax.eval_shape(probe, abstract, *args)
    return written, new


def _traceable(value: Any) -> bool:
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


def _signature(value: Any) -> tuple[Any, list[Any]] | None:
    """A state value's structure and leaves (by identity), to tell a change in
    place (``self.sub.items[0] = v``, ``d = self.d; d["k"] = v``) from none;
    ``None`` for an array, which cannot change in place."""
    if _values.kind_of(value) is _values.ARRAY:
        return None
    leaves, treedef = jax.tree_util.tree_flatten(value)
    return treedef, leaves


def _assigned(before: Any, signature: tuple[Any, list[Any]] | None, after: Any) -> bool:
    """Whether a cell that held ``before`` (with ``signature``) now holding
    ``after`` was written: assigned another value, or its container changed
    in place, which plain Python's loop would keep as well."""
    if after is not before:
        return True
    if signature is None:
        return False
    leaves, treedef = jax.tree_util.tree_flatten(after)
    return treedef != signature[0] or any(a is not b for a, b in zip(leaves, signature[1]))


def _check_kept(cells: Cells, new: Sequence[Any], what: str) -> None:
    for cell, value in zip(cells, new):
        if _type_of(cell.value) != _type_of(value):
            raise ControlFlowStateError(
                format_error(
                    f"State {cell.name!r} changes from {_describe(cell.value)} to "
                    f"{_describe(value)} inside {what}; a state assigned there is threaded "
                    "as a loop carry (or a branch output), and loop carries and branch "
                    "outputs keep their shape, dtype and structure.",
                    where=user_location(),
                    fix="assign a value of the same shape and dtype (cast with "
                    ".astype(...), pad to a fixed size), or assign it outside the "
                    "control-flow call.",
                )
            )


def weak_types(value: Any) -> tuple[bool, ...]:
    """Which leaves of ``value`` are weakly typed: Python scalars, ``jnp.asarray(0.0)``.

    ``_type_of``, like JAX's check of a carry or branch output, does not tell them from
    arrays of their dtype; but a weak value takes the dtype of what it meets
    (``0.0 + bfloat16`` is bfloat16) and a strong one does not, so it is part of what a
    state means.
    """

    def weak(leaf: Any) -> bool:
        try:
            return bool(getattr(jax.typeof(leaf), "weak_type", False))
        except TypeError:
            return False

    return tuple(weak(leaf) for leaf in jax.tree_util.tree_leaves(value))


def _strong_where_mixed(outcomes: Sequence[Sequence[Any]]) -> list[bool]:
    """Per state, whether it is weakly typed after one branch and strongly after another.

    ``outcomes[b][k]`` is state ``k`` after branch ``b``. The state after the
    call has one type, fixed when it is traced, while plain Python's depends on
    which branch runs: such a state comes out strong, as after the branch that
    makes it strong (a loop carry does the same, as JAX promotes it).
    """
    kinds = [[weak_types(value) for value in branch] for branch in outcomes]
    return [len({branch[k] for branch in kinds}) > 1 for k in range(len(outcomes[0]))]


def _strong(value: Any) -> Any:
    """``value`` with its weakly typed leaves made strong, of the same dtype."""
    return jax.tree_util.tree_map(
        lambda leaf: lax.convert_element_type(leaf, jax.numpy.result_type(leaf)), value
    )


def _check_untouched(
    cells: Cells, before: Sequence[Any], signatures: Sequence[Any], chosen: Cells, what: str
) -> None:
    chosen_ids = {id(c) for c in chosen}
    for cell, value, signature in zip(cells, before, signatures):
        if id(cell) not in chosen_ids and _assigned(value, signature, cell.value):
            raise ControlFlowStateError(
                format_error(
                    f"State {cell.name!r} is assigned in {what}, which must not change "
                    "state (it only decides; JAX may call it any number of times).",
                    where=user_location(),
                    fix="assign the state in the loop body instead.",
                )
            )


def _run_bound(
    cells: Cells, chosen: Cells, values: Sequence[Any], what: str, call: Callable[[], Any]
) -> tuple[Any, list[Any], set[int]]:
    """``call()`` traced with ``chosen`` bound to ``values``: its output, every
    cell's value after it, and which cells it assigned."""
    with _bound(cells, chosen, values, what):
        before = _current(cells)
        signatures = [_signature(v) for v in before]
        out = _settled(call())
        after = _current(cells)
    changed = {
        i for i, (b, sig, a) in enumerate(zip(before, signatures, after)) if _assigned(b, sig, a)
    }
    return out, after, changed


def _probed(cells: Cells, what: str, body: Callable[..., Any], *args: Any) -> list[int]:
    """Step 1 of the lifting: which cells ``body(*args)`` assigns (one abstract
    trace, ``_writes``), each checked to keep its type, as a carry or a branch
    output must."""
    written, new = _writes(cells, body, *args, what=what)
    _check_kept([cells[i] for i in written], new, what)
    return written


def _pure(
    cells: Cells, chosen: Cells, fun: Callable[..., Any], what: str, reads_only: bool = False
) -> Callable[..., tuple[Any, list[Any]]]:
    """Step 2 of the lifting: ``fun`` as a pure function of the ``chosen``
    states' values, ``(values, *args) -> (out, new values)``. ``reads_only``:
    a function that decides and must not assign (a ``while_loop``'s
    ``cond_fun``), refused where it does."""

    def pure(values: list[Any], *args: Any, **kwargs: Any) -> tuple[Any, list[Any]]:
        with _bound(cells, chosen, values, what):
            if not reads_only:
                return _settled(fun(*args, **kwargs)), _current(chosen)
            before = _current(cells)
            signatures = [_signature(v) for v in before]
            out = fun(*args, **kwargs)
            _check_untouched(cells, before, signatures, (), what)
            return out, values

    return pure


def _lift(
    cells: Cells,
    written: Sequence[int],
    what: str,
    place: Callable[[Callable[..., Callable[..., Any]], list[Any]], tuple[Any, list[Any]]],
    plain: Callable[[], Any] | None = None,
) -> Any:
    """The one lifting of the loops, branches and ``checkpoint``: the states
    ``written`` (step 1, ``_probed``) are threaded (none: ``plain()``, the
    JAX function as it is, where given). ``place(pure_of, values)`` calls
    the JAX function with the states placed by its rules (step 3: carry,
    operands, arguments), ``pure_of(fn)`` being ``fn`` as a pure function of
    them (step 2, ``_pure``), and returns the output and the states' new
    values, which land (step 4)."""
    if not written and plain is not None:
        return plain()
    chosen = [cells[i] for i in written]

    def pure_of(fun: Callable[..., Any], inside: str = what, reads_only: bool = False) -> Any:
        return _pure(cells, chosen, fun, inside, reads_only)

    out, values = place(pure_of, _current(chosen))
    _land(chosen, dict(enumerate(values)))
    return out


def _land(cells: Cells, new: dict[int, Any]) -> None:
    """Step 4 of every lifting: the states take the values the JAX function
    returned (``new``: by index into ``cells``)."""
    for i, value in new.items():
        cells[i].value = value


def _argument_writes(
    cells: Cells, passed: Sequence[int], values: Sequence[Any], what: str, call: Callable[[], Any]
) -> tuple[Any, dict[int, Any]]:
    """``call()`` with the cells ``passed`` (those JAX can trace, handed to a
    transformation as arguments) bound to ``values``: its output and the new
    values of those it assigned, by position; one that is not passed is refused."""
    out, after, changed = _run_bound(cells, [cells[i] for i in passed], values, what, call)
    for i in sorted(changed - set(passed)):
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
    return out, {k: after[i] for k, i in enumerate(passed) if i in changed}


def _shared_write(cell: LocalStateEffectImpl, inside: str, unit: str, fix: str) -> Exception:
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


# --- eager models ---------------------------------------------------------------

# The slots that hold their state's value themselves (an eager model's, and
# those of a copy made inside a running call: ``copy.copy(self)``, a
# ``tree_map`` copy), whose writes stay the copy's, the stacks and what code
# reaches through a node are fields of the node kinds (``graph.NodeKind``:
# ``own_value``, ``stacked``, ``reached``). A body that reaches an own-value
# slot has it threaded like an eager model's.


def _layers_mapped(tree: Any) -> Any:
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
        items = [_layers_mapped(v) for v in tree]
        return tree if all(a is b for a, b in zip(items, tree)) else t(items)
    if t is dict:
        mapped = {k: _layers_mapped(v) for k, v in tree.items()}
        return tree if all(mapped[k] is v for k, v in tree.items()) else mapped
    return tree


def _vmap_layers(in_axes: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``jax.vmap``'s arguments with the stacks of the mapped ones as their
    stacked models (``_layers_mapped``); an argument with in_axes ``None`` keeps
    its stack whole (every example iterates all of its layers)."""
    if not _graph.STACKS:
        return args, kwargs
    axes = tuple(in_axes) if isinstance(in_axes, (tuple, list)) else (in_axes,) * len(args)
    if len(axes) != len(args):
        return args, kwargs  # (jax.vmap says what does not match)
    mapped = tuple(a if axis is None else _layers_mapped(a) for axis, a in zip(axes, args))
    return mapped, _layers_mapped(kwargs)


def reachable_instances(roots: Sequence[Any], containers: list[Any]) -> list[Any]:
    """Decorated instances reachable from a body: closures, bound methods,
    operands; the lists and dicts met on the way into ``containers``."""
    found: list[Any] = []
    for _, node in _graph.iter_tree(
        tuple(roots), _reached_object, into_targets=True, children=_reached_by_code, seen=set()
    ):
        (found if _graph.is_stateful_instance(node) else containers).append(node)
    return found


def _reached_object(obj: Any) -> bool:
    """A decorated instance, or a list or dict (not a tuple) a body reaches."""
    t = type(obj)
    return t in _graph.STATEFUL_CLASSES or (t is not tuple and isinstance(obj, (list, tuple, dict)))


def _reached_by_code(obj: Any) -> list[tuple[str, Any]]:
    """The step of ``reachable_instances``'s walk: an instance's attributes, a
    function's cells, defaults and ``__wrapped__``, a method's instance and
    function, a partial's parts, a list's, tuple's or dict's items. Last first:
    the order that names two instances' states ``Linear.w``, ``Linear.w'``."""
    items: Any
    if type(obj) in _graph.STATEFUL_CLASSES:
        items = obj.__dict__.values()
    elif isinstance(obj, types.FunctionType):
        items = []
        for cell in obj.__closure__ or ():
            with contextlib.suppress(ValueError):  # an empty cell
                items.append(cell.cell_contents)
        items.extend(obj.__defaults__ or ())
        wrapped = getattr(obj, "__wrapped__", None)
        if wrapped is not None:
            items.append(wrapped)
    elif isinstance(obj, types.MethodType):
        items = [obj.__self__, obj.__func__]
    elif isinstance(obj, functools.partial):
        items = [obj.func, *obj.args, *obj.keywords.values()]
    elif isinstance(obj, (list, tuple)):
        items = obj
    elif isinstance(obj, dict):
        items = obj.values()
    elif (through := _graph.REACHED.get(type(obj))) is not None:
        items = through(obj)
    else:
        return []
    holds_nothing = _values.holds_nothing  # (an atom or an array: no node)
    return [("", item) for item in reversed(items) if not holds_nothing(item)]


def _with_eager_states(
    roots: Sequence[Any], call: Callable[[], Any], what: str, once: bool = False
) -> Any:
    """Runs ``call`` with eager instances' states (reachable from ``roots``) handled.

    Their slots become references of a temporary handler for the call, so the
    body's writes are threaded like a functionalized model's; afterwards the
    slots are put back and assigned the final values, as eager writes.

    JAX traces the body of ``what`` rather than running it once per step, so
    while it runs, a static state (a Python value) of these instances takes
    no new value, and a traced value assigned to one of their attributes
    that is not state is refused (``guard.check_write``): plain
    Python's loop would change them every step, and a trace would leave a
    count of traces or a tracer. An ``f`` refuses both the same way.
    ``once``: the body runs once per call, as plain Python's does (a
    derivative's function), so a static state takes the Python values it
    is assigned there.
    """
    captured: list[Any] = []
    instances = reachable_instances(roots, captured)
    swapped: list[tuple[Any, str, Any, str]] = []
    statics: list[tuple[Any, str, Any]] = []
    names: set[str] = set()
    for obj in instances:
        for attr in _tree.info_of(obj).state:
            slot = obj.__dict__.get(attr)
            if type(slot) is StaticState:
                if not once:
                    statics.append((obj, attr, slot))
                continue
            if type(slot) is LostState:
                # (An earlier body raised after assigning it: it has no value
                # for this one, as reading it says; JAX would meet the slot.)
                raise slot.lost.error()
            if type(slot) not in _graph.OWN_VALUE_SLOTS:
                continue
            name = f"{type(obj).__name__}.{attr}"
            while name in names:
                name += "'"
            names.add(name)
            swapped.append((obj, attr, slot, name))
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
    call = functools.partial(_guarded, guard, call)
    if not instances:
        return call()
    for obj, attr, slot in statics:
        obj.__dict__[attr] = _StaticInBody(slot, f"{type(obj).__name__}.{attr}", what)
    try:
        with eager_lax_body(instances, what):
            if not swapped:
                return call()
            handler_id = fresh_handler_id()
            states = {name: slot.read() for _, _, slot, name in swapped}
            for obj, attr, slot, name in swapped:
                obj.__dict__[attr] = HandledLocalStateRef(handler_id, name, False, slot.category)
            lost: dict[str, LostValue] = {}
            try:
                out, new = run_with_states(
                    handler_id, states, _keeping_lost, (call, handler_id, lost), {}
                )
            finally:
                for obj, attr, slot, name in swapped:
                    obj.__dict__[attr] = LostState(slot, lost[name]) if name in lost else slot
    finally:
        for obj, attr, slot in statics:
            obj.__dict__[attr] = slot
    for obj, attr, slot, name in swapped:
        if new[name] is not states[name]:
            replacement = slot.write(new[name], attr)
            if replacement is not None:
                obj.__dict__[attr] = replacement
    return out


def _guarded(guard: Guard, call: Callable[[], Any]) -> Any:
    """``call()`` under ``guard``; also when it raised the guard looks: JAX
    may meet the body's escaped tracer first (a later trace of the body, or
    where the value is used)."""
    with guard:
        return call()


def _transformed(
    fun: Callable[..., Any], what: str, call: Callable[[tuple, dict], Any], once: bool = False
) -> Callable[..., Any]:
    """What stands for a JAX transformation of ``fun``: each call runs
    ``call(args, kwargs)`` with eager models' states handled
    (``_with_eager_states``; ``once``: ``fun`` runs once per call)."""

    def transformed(*args: Any, **kwargs: Any) -> Any:
        return _with_eager_states((fun, args, kwargs), lambda: call(args, kwargs), what, once)

    functools.update_wrapper(transformed, fun, updated=())
    return transformed


def _with_states_first(threaded: Callable[..., Any], fun: Callable[..., Any]) -> None:
    """Gives ``threaded`` (``(values, *args, **kwargs)``) ``fun``'s signature
    after its first argument, so that JAX matches ``static_argnames`` and
    static arguments given by keyword as it would for ``fun``."""
    try:
        signature = inspect.signature(fun)
    except (TypeError, ValueError):
        return
    first = inspect.Parameter("__autostate_states", inspect.Parameter.POSITIONAL_ONLY)
    threaded.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[first, *signature.parameters.values()]
    )


def _after_states(numbers: Any) -> tuple[int, ...]:
    """Argument numbers (``static_argnums``, ``donate_argnums``) of a function
    that now takes the states first: a non-negative one moves up by one."""
    numbers = (numbers,) if isinstance(numbers, int) else tuple(numbers)
    return tuple(i + 1 if i >= 0 else i for i in numbers)


def _keeping_lost(call: Callable[[], Any], handler_id: Any, lost: dict[str, LostValue]) -> Any:
    """``call()``; if it raises, the states its body lost (see ``_bound``) into ``lost``."""
    try:
        return call()
    except BaseException:
        for name, cell in handler_cells(handler_id).items():
            if type(cell.value) is LostValue:
                lost[name] = cell.value
        raise


class _StandIn(StateSlot):
    """A slot standing in for another (``slot``) while a call runs: the state
    keeps that slot's category."""

    __slots__ = ()
    slot: Any

    @property
    def category(self) -> Any:  # type: ignore[override]
        return self.slot.category


class LostState(_StandIn):
    """An eager state whose lax body raised after assigning it (``_bound``):
    reading it raises what happened; assigning it gives it a value again."""

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


class _StaticInBody(_StandIn):
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


# --- stacked sub-models -------------------------------------------------------------
# A sub-model handed to a mapping transformation (``jax.vmap``'s mapped
# arguments, ``lax.scan``'s ``xs``, ``lax.map``) is a list of members: each
# of its states is one slice per member along the mapped axis, each member
# reads and writes its own slice, and the slices written come back stacked.


def _with_layer_views(mapped: Any, what: str, call: Callable[[], Any]) -> Any:
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
    swapped: list[tuple[Any, str, StateSlot, str]] = []
    names: set[str] = set()
    for obj in _graph.instances_of(mapped):
        for attr in _tree.info_of(obj).state:
            slot = obj.__dict__.get(attr)
            if not isinstance(slot, StateSlot) or slot.part_of() is None:
                continue
            name = f"{type(obj).__name__}.{attr}"
            while name in names:
                name += "'"
            names.add(name)
            swapped.append((obj, attr, slot, name))
    if not swapped:
        return call()
    states = {name: slot.read() for _, _, slot, name in swapped}
    swapped = [entry for entry in swapped if _traceable(states[entry[3]])]
    if not swapped:
        return call()
    handler_id = fresh_handler_id()
    wholes: dict[tuple[int, str], tuple[Any, str, Any]] = {}
    for obj, attr, slot, name in swapped:
        owner, owner_attr = slot.part_of()  # type: ignore[misc]
        wholes.setdefault((id(owner), owner_attr), (owner, owner_attr, owner.__dict__[owner_attr]))
        obj.__dict__[attr] = HandledLocalStateRef(handler_id, name, False, slot.category)
    for owner, owner_attr, held in wholes.values():
        owner.__dict__[owner_attr] = _WholeOfMappedViews(held, type(owner).__name__, owner_attr, what)
    try:
        out, new = run_with_states(handler_id, states, call, (), {})
    finally:
        for owner, owner_attr, held in wholes.values():
            owner.__dict__[owner_attr] = held
        for obj, attr, slot, _ in swapped:
            obj.__dict__[attr] = slot
    for obj, attr, slot, name in swapped:
        if new[name] is not states[name]:
            replacement = slot.write(new[name], attr)
            if replacement is not None:
                obj.__dict__[attr] = replacement
    return out


class _WholeOfMappedViews(_StandIn):
    """A stacked state while a mapping transformation maps over a view of
    part of it (``_with_layer_views``): refused to every other path."""

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


def _members(cells: Cells, tree: Any) -> list[int]:
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
            if cell is not None and i is not None and _traceable(cell.value):
                found[i] = None
    return list(found)


def _check_stacked(cells: Cells, axes: Sequence[int], size: int | None, what: str) -> int | None:
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
                        f"State {cell.name!r} holds {_describe(cell.value)}, but it belongs to "
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


def _guarding_copies(tree: Any, what: str, call: Callable[[], Any]) -> Any:
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
        return _guarded(guard, call)


@contextlib.contextmanager
def _member_slices(chosen: Cells) -> Iterator[None]:
    """While the cells ``chosen`` hold one member's slice of a stacked
    sub-model: read only through the members (``lifetime.MEMBER_CELLS``)."""
    token = MEMBER_CELLS.set(MEMBER_CELLS.get() | {id(cell) for cell in chosen})
    try:
        yield
    finally:
        MEMBER_CELLS.reset(token)


def _member_body(
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
        signatures = [_signature(v) for v in slices]
        ok = False
        try:
            with _member_slices(chosen):
                carry, y = _settled(body(carry, x))
            after = _current(chosen)
            ok = True
        finally:
            # (When it raised, a slice it assigned stays: the caller marks it lost.)
            for cell, value, old in zip(chosen, slices, saved):
                if ok or cell.value is value:
                    cell.value = old
        written = {
            k: v for k, (v, b, sig) in enumerate(zip(after, slices, signatures))
            if _assigned(b, sig, v)
        }
        for k, value in written.items():
            if _type_of(value) != _type_of(slices[k]):
                raise ControlFlowStateError(
                    format_error(
                        f"State {chosen[k].name!r} of one member of a stacked sub-model is "
                        f"assigned {_describe(value)} inside {what}, but its slice of the "
                        f"stacked state is {_describe(slices[k])}: the slices a scan stacks "
                        "keep their shape, dtype and structure.",
                        where=user_location(),
                        fix="assign a value of the slice's shape and dtype.",
                    )
                )
        return carry, (y, written)

    return run


# --- the primitives ---------------------------------------------------------------


def jit_disabled() -> bool:
    """Under ``jax.disable_jit()`` JAX runs a loop's body once per step, and
    only the branch taken, with concrete values, as plain Python would: a
    body's assignments are then eager writes, and nothing is threaded."""
    return bool(jax.config.jax_disable_jit)  # type: ignore[attr-defined]  # (not in its stubs)


def scan(
    f: Callable[[Any, Any], tuple[Any, Any]],
    init: Any,
    xs: Any = None,
    length: int | None = None,
    reverse: bool = False,
    unroll: int | bool = 1,
    **kwargs: Any,
) -> tuple[Any, Any]:
    """``jax.lax.scan`` whose body may read and assign model state.

    Inside a ``@stateful`` method a plain ``jax.lax.scan`` call does the same;
    code the decorator never saw (a helper function outside any class) calls
    this one.

    Args:
        f: the body, ``(carry, x) -> (carry, y)``, as for ``jax.lax.scan``.
        init: the initial carry.
        xs: the sequence scanned over (or ``None`` with ``length``).
        length: the number of iterations when ``xs`` is ``None``.
        reverse: scan from the end, as ``jax.lax.scan``.
        unroll: how many iterations each loop step runs, as ``jax.lax.scan``.
        **kwargs: any other option of ``jax.lax.scan``.

    Returns:
        ``(carry, ys)``, as ``jax.lax.scan``; the states the body assigned hold
        their values after the last iteration.

    Examples:
        >>> @autostate.stateful
        ... class Cell:
        ...     def __init__(self):
        ...         self.steps = jnp.zeros((), jnp.int32)
        ...
        ...     def __call__(self, h, x):
        ...         self.steps += 1
        ...         return jnp.tanh(h + x)
        >>> def unroll(cell, h, xs):  # a helper outside any class
        ...     h, _ = autostate.scan(lambda h, x: (cell(h, x), None), h, xs)
        ...     return h
        >>> cell = Cell()
        >>> h = unroll(cell, 0.0, jnp.ones(5))
        >>> print(cell.steps)
        5
    """
    xs = _layers_mapped(xs)
    if jit_disabled():
        return lax.scan(f, init, xs, length=length, reverse=reverse, unroll=unroll, **kwargs)
    options = dict(length=length, reverse=reverse, unroll=unroll, **kwargs)
    return _with_eager_states(
        (f, init, xs), lambda: _scan(f, init, xs, options), "the body of a lax.scan"
    )


def _scan(
    f: Callable, init: Any, xs: Any, options: dict[str, Any], what: str = "the body of a lax.scan"
) -> tuple[Any, Any]:
    return _with_layer_views(xs, what, lambda: _scan_members(f, init, xs, options, what))


def _scan_members(
    f: Callable, init: Any, xs: Any, options: dict[str, Any], what: str
) -> tuple[Any, Any]:
    if _graph.holds_instance(xs):  # a sub-model scanned over: each step's copy guarded
        step = f

        def f(carry: Any, x: Any) -> Any:
            return _guarding_copies(x, what, lambda: step(carry, x))

    cells = running_cells()
    members = _members(cells, xs) if cells else []
    if not members:
        return _scan_threaded(cells, f, init, xs, options, what)
    # A stacked sub-model in ``xs``: its states are scanned over with it.
    chosen = [cells[i] for i in members]
    _check_stacked(chosen, [0] * len(chosen), _scan_length(xs, options.get("length")), what)
    body = _member_body(cells, members, f, what)
    carry, (ys, written) = _scan_threaded(
        cells, body, init, (xs, _current(chosen)), options, what
    )
    _land(chosen, written)
    return carry, ys


def _scan_threaded(
    cells: Cells, f: Callable, init: Any, xs: Any, options: dict[str, Any], what: str
) -> tuple[Any, Any]:
    """``lax.scan``, the states ``f`` assigns threaded as carry."""
    if not cells:
        return lax.scan(f, init, xs, **options)
    if _scan_length(xs, options.get("length")) == 0:
        return lax.scan(_never_run(cells, f, what), init, xs, **options)

    def as_carry(pure_of: Callable, values: list[Any]) -> tuple[Any, list[Any]]:
        step = pure_of(f)

        def body(carry: tuple[Any, list[Any]], x: Any) -> tuple[tuple[Any, list[Any]], Any]:
            (inner, y), values = step(carry[1], carry[0], x)
            return (inner, values), y

        (carry, values), ys = lax.scan(body, (init, values), xs, **options)
        return (carry, ys), values

    written = _probed(cells, what, f, _abstract(init), _step_slice(xs))
    return _lift(cells, written, what, as_carry, lambda: lax.scan(f, init, xs, **options))


def _step_slice(xs: Any) -> Any:
    """The abstract value of one step's slice of ``xs`` (its leading axis dropped)."""
    return jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(
            jax.numpy.shape(a)[1:], jax.numpy.result_type(a), weak_type=weak_types(a)[0]
        ),
        xs,
    )


def _scan_length(xs: Any, length: int | None) -> int | None:
    """How many times a ``lax.scan`` runs its body (always known when it is traced)."""
    if length is not None:
        return int(length)
    leaves = jax.tree_util.tree_leaves(xs)
    return int(jax.numpy.shape(leaves[0])[0]) if leaves else None


def _never_run(cells: Cells, body: Callable[..., Any], what: str) -> Callable[..., Any]:
    """``body`` for a loop that runs it zero times, as JAX still traces it: what it assigns
    is dropped, so every state keeps its value and its type (a Python float stays one,
    where a carry would come out a strong array) as after plain Python's empty loop."""

    def run(*args: Any) -> Any:
        with _bound(cells, (), (), what):
            return body(*args)

    return run


def _static_int(value: Any) -> int | None:
    """``value`` as an int where it is known when traced, as ``lax.fori_loop`` decides."""
    if isinstance(value, jax.core.Tracer):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def while_loop(cond_fun: Callable[[Any], Any], body_fun: Callable[[Any], Any], init_val: Any) -> Any:
    """``jax.lax.while_loop`` whose body may assign state and whose ``cond_fun`` may read it.

    Args:
        cond_fun: ``value -> bool``; it may read state.
        body_fun: ``value -> value``; it may read and assign state.
        init_val: the initial loop value.

    Returns:
        The final loop value; assigned states hold their final values.

    Examples:
        >>> @autostate.stateful
        ... class Counter:
        ...     def __init__(self):
        ...         self.n = jnp.zeros((), jnp.int32)
        ...
        ...     def run(self, limit):
        ...         def body(i):
        ...             self.n += 1
        ...             return i + 1
        ...
        ...         return jax.lax.while_loop(lambda i: self.n < limit, body, 0)
        >>> counter = Counter()
        >>> print(counter.run(3), counter.n)
        3 3
    """
    if jit_disabled():
        return lax.while_loop(cond_fun, body_fun, init_val)
    roots = (cond_fun, body_fun, init_val)
    return _with_eager_states(
        roots, lambda: _while_loop(cond_fun, body_fun, init_val), "a lax.while_loop"
    )


def _while_loop(cond_fun: Callable, body_fun: Callable, init_val: Any) -> Any:
    cells = running_cells()
    if not cells:
        return lax.while_loop(cond_fun, body_fun, init_val)
    what = "the body of a lax.while_loop"

    def as_carry(pure_of: Callable, values: list[Any]) -> tuple[Any, list[Any]]:
        test = pure_of(cond_fun, "the cond_fun of a lax.while_loop", reads_only=True)
        step = pure_of(body_fun)
        return lax.while_loop(
            lambda carry: test(carry[1], carry[0])[0],
            lambda carry: step(carry[1], carry[0]),
            (init_val, values),
        )

    # (No plain call when the body assigns nothing: cond_fun is checked all the same.)
    return _lift(cells, _probed(cells, what, body_fun, _abstract(init_val)), what, as_carry)


def fori_loop(
    lower: Any, upper: Any, body_fun: Callable[[Any, Any], Any], init_val: Any, **kwargs: Any
) -> Any:
    """``jax.lax.fori_loop`` whose body may read and assign state.

    Args:
        lower: the first index.
        upper: the index the loop stops before.
        body_fun: ``(i, value) -> value``; it may read and assign state.
        init_val: the initial loop value.
        **kwargs: any other option of ``jax.lax.fori_loop`` (``unroll``).

    Returns:
        The final loop value; assigned states hold their final values.

    Examples:
        >>> @autostate.stateful
        ... class Decoder:
        ...     def __init__(self):
        ...         self.cache = jnp.zeros(4)
        ...
        ...     def fill(self):
        ...         def body(i, token):
        ...             self.cache = self.cache.at[i].set(token)  # a traced index
        ...             return token + 1.0
        ...
        ...         return jax.lax.fori_loop(0, 4, body, 1.0)
        >>> decoder = Decoder()
        >>> print(decoder.fill(), decoder.cache)
        5.0 [1. 2. 3. 4.]
    """
    if jit_disabled():
        return lax.fori_loop(lower, upper, body_fun, init_val, **kwargs)
    roots = (body_fun, init_val)
    return _with_eager_states(
        roots,
        lambda: _fori_loop(lower, upper, body_fun, init_val, kwargs),
        "the body of a lax.fori_loop",
    )


def _fori_loop(lower: Any, upper: Any, body_fun: Callable, init_val: Any, options: dict) -> Any:
    cells = running_cells()
    if not cells:
        return lax.fori_loop(lower, upper, body_fun, init_val, **options)
    what = "the body of a lax.fori_loop"
    low, high = _static_int(lower), _static_int(upper)
    if low is not None and high is not None and high <= low:
        return lax.fori_loop(lower, upper, _never_run(cells, body_fun, what), init_val, **options)
    index = jax.ShapeDtypeStruct((), jax.numpy.result_type(lower, upper))

    def as_carry(pure_of: Callable, values: list[Any]) -> tuple[Any, list[Any]]:
        step = pure_of(body_fun)
        return lax.fori_loop(
            lower, upper, lambda i, carry: step(carry[1], i, carry[0]), (init_val, values),
            **options,
        )

    return _lift(
        cells, _probed(cells, what, body_fun, index, _abstract(init_val)), what, as_carry,
        lambda: lax.fori_loop(lower, upper, body_fun, init_val, **options),
    )


def map(f: Callable[[Any], Any], xs: Any, **kwargs: Any) -> Any:  # noqa: A001 - jax's name
    """``jax.lax.map`` whose function may read and assign state, element after element.

    Args:
        f: ``x -> y``, applied to each element of ``xs`` in order.
        xs: the elements, stacked along the leading axis.
        **kwargs: any other option of ``jax.lax.map``; a ``batch_size`` needs
            a function that assigns no state (batched elements run at once,
            not in order).

    Returns:
        The stacked outputs, as ``jax.lax.map``.

    Examples:
        >>> @autostate.stateful
        ... class Total:
        ...     def __init__(self):
        ...         self.sum = jnp.zeros(())
        ...
        ...     def __call__(self, x):
        ...         self.sum += x
        ...         return self.sum  # the running total: every element in order
        >>> total = Total()
        >>> print(autostate.map(total, jnp.arange(4.0)), total.sum)
        [0. 1. 3. 6.] 6.0
    """
    xs = _layers_mapped(xs)
    if jit_disabled():
        return lax.map(f, xs, **kwargs)
    return _with_eager_states((f, xs), lambda: _map(f, xs, kwargs), "the function of a lax.map")


def _map(f: Callable, xs: Any, options: dict[str, Any]) -> Any:
    cells = running_cells()
    what = "the function of a lax.map"
    if not cells:
        return lax.map(f, xs, **options)
    if options.get("batch_size") is None:
        _, ys = _scan(lambda carry, x: (carry, f(x)), None, xs, {}, what)
        return ys
    members = _members(cells, xs)
    if members:
        raise ControlFlowStateError(
            format_error(
                f"A lax.map with batch_size maps over a stacked sub-model (state "
                f"{cells[members[0]].name!r}); its batched elements run under jax.vmap, "
                "which lax.map does not give the members' states to.",
                where=user_location(),
                fix="drop batch_size, or call jax.vmap over the sub-model for each batch.",
            )
        )
    written, _ = _writes(cells, f, _step_slice(xs), what=what)
    if written:
        raise ControlFlowStateError(
            format_error(
                f"The function of a lax.map with batch_size assigns state "
                f"{cells[written[0]].name!r}; batched elements run at once, so there is no "
                "order in which to apply the writes.",
                where=user_location(),
                fix="drop batch_size (elements then run one after another), or assign the "
                "state outside the map.",
            )
        )
    return lax.map(f, xs, **options)


def _branches(
    call: Callable[[Sequence[Callable], tuple], Any],
    branches: Sequence[Callable[..., Any]],
    operands: tuple,
    what: str,
) -> Any:
    cells = running_cells()
    if not cells:
        return call(branches, operands)
    written: set[int] = set()
    news: list[tuple[list[int], list[Any]]] = []
    for branch in branches:
        indices, new = _writes(cells, lambda branch=branch: branch(*operands), what=f"a branch of {what}")
        written.update(indices)
        news.append((indices, new))
    order = sorted(written)
    for indices, new in news:
        _check_kept([cells[i] for i in indices], new, f"a branch of {what}")

    def as_operands(pure_of: Callable, values: list[Any]) -> tuple[Any, list[Any]]:
        outcomes = [
            [dict(zip(indices, new)).get(i, value) for i, value in zip(order, values)]
            for indices, new in news
        ]
        strong = _strong_where_mixed(outcomes)

        def threaded(branch: Callable[..., Any]) -> Callable[..., Any]:
            pure = pure_of(branch, f"a branch of {what}")

            def run(inner: tuple, values: list[Any]) -> tuple[Any, list[Any]]:
                out, values = pure(values, *inner)
                result = out, [_strong(v) if s else v for v, s in zip(values, strong)]
                # The TPU compiler (jaxlib 0.10) fails on a conditional compiled
                # on its own (eagerly, under eager grad or vmap) whose branches
                # return one value at two positions that differ from branch to
                # branch (a state and the output; two aliases): a RET_CHECK in
                # its layout assignment, reproduced without autostate by
                # benchmarks/tpu_cond_repro.py. It accepts the program whose
                # branch results pass an optimization barrier, which changes
                # no value and, inside a larger jitted program, no instruction
                # that computes.
                return lax.optimization_barrier(result)

            return run

        return call([threaded(b) for b in branches], (operands, values))

    return _lift(cells, order, what, as_operands, lambda: call(branches, operands))


# ``operand=`` not given (``None`` is an operand).
_NO_OPERAND: Any = object()


def _operands(operands: tuple, operand: Any, what: str) -> tuple:
    """The operands of a ``cond``/``switch`` call, JAX's ``operand=`` keyword included."""
    if operand is _NO_OPERAND:
        return operands
    if operands:
        raise TypeError(
            f"{what}: if the 'operand' keyword is passed, no operands can be passed "
            f"positionally (got {len(operands)})."
        )
    return (operand,)


def cond(
    pred: Any,
    true_fun: Callable[..., Any],
    false_fun: Callable[..., Any],
    *operands: Any,
    operand: Any = _NO_OPERAND,
) -> Any:
    """``jax.lax.cond`` whose branches may read and assign state.

    Under ``jax.vmap`` with a batched ``pred`` each example keeps the state
    of the branch it took.

    Args:
        pred: a boolean scalar choosing ``true_fun`` or ``false_fun``.
        true_fun: the branch taken when ``pred`` is true.
        false_fun: the branch taken otherwise.
        *operands: the branches' arguments.
        operand: a single operand, as ``jax.lax.cond``'s old keyword.

    Returns:
        The taken branch's output; its assignments hold after.

    Examples:
        >>> @autostate.stateful
        ... class Block:
        ...     def __init__(self):
        ...         self.calls = jnp.zeros((), jnp.int32)
        ...
        ...     def __call__(self, x):
        ...         self.calls += 1
        ...         return 2 * x
        >>> block = Block()
        >>> y = autostate.cond(True, block, lambda x: x, 1.0)
        >>> y = autostate.cond(False, block, lambda x: x, y)  # statistics only when run
        >>> print(y, block.calls)
        2.0 1
    """
    operands = _operands(operands, operand, "lax.cond")
    if jit_disabled():
        return lax.cond(pred, true_fun, false_fun, *operands)
    roots = (true_fun, false_fun, operands)
    return _with_eager_states(
        roots,
        lambda: _branches(
            lambda bs, ops: lax.cond(pred, bs[0], bs[1], *ops),
            (true_fun, false_fun),
            operands,
            "a lax.cond",
        ),
        "a branch of a lax.cond",
    )


def switch(
    index: Any, branches: Sequence[Callable[..., Any]], *operands: Any, operand: Any = _NO_OPERAND
) -> Any:
    """``jax.lax.switch`` whose branches may read and assign state.

    Args:
        index: which branch runs (clamped into range, as ``jax.lax.switch``).
        branches: the functions to choose from.
        *operands: the branches' arguments.
        operand: a single operand, as ``jax.lax.switch``'s old keyword.

    Returns:
        The chosen branch's output; its assignments hold after.

    Examples:
        >>> @autostate.stateful
        ... class Block:
        ...     def __init__(self):
        ...         self.calls = jnp.zeros((), jnp.int32)
        ...
        ...     def __call__(self, x):
        ...         self.calls += 1
        ...         return 2 * x
        >>> block = Block()
        >>> print(autostate.switch(1, [lambda x: x, block], 3.0), block.calls)
        6.0 1
    """
    operands = _operands(operands, operand, "lax.switch")
    branches = list(branches)
    if jit_disabled():
        return lax.switch(index, branches, *operands)
    return _with_eager_states(
        (branches, operands),
        lambda: _branches(
            lambda bs, ops: lax.switch(index, list(bs), *ops), branches, operands, "a lax.switch"
        ),
        "a branch of a lax.switch",
    )


def checkpoint(fun: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    """``jax.checkpoint`` (``jax.remat``) of a function that may read and assign state.

    Loss, gradients and new states equal those without remat; only what is
    saved for the backward pass changes. ``autostate.remat`` is the same
    function, under JAX's other name.

    Args:
        fun: the function to rematerialize.
        **options: those of ``jax.checkpoint`` (``prevent_cse``, ``policy``,
            ``static_argnums``).

    Returns:
        The checkpointed function.

    Examples:
        >>> @autostate.stateful
        ... class Block:
        ...     def __init__(self):
        ...         self.calls = jnp.zeros((), jnp.int32)
        ...         self.w = jnp.full(2, 3.0)
        ...
        ...     def __call__(self, x):
        ...         self.calls += 1
        ...         return jnp.sin(self.w * x).sum()
        >>> f, states = Block().functionalize()
        >>> loss = lambda f, s, x: autostate.checkpoint(f)(s, x)
        >>> (y, states), grads = jax.value_and_grad(loss, has_aux=True)(f, states, 0.0)
        >>> print(y, states["calls"], grads.model.w)
        0.0 1 [0. 0.]
    """
    static = options.pop("static_argnums", None) or ()
    static = (static,) if isinstance(static, int) else tuple(static)

    return _transformed(
        fun,
        "a jax.checkpoint",
        lambda args, kwargs: _checkpoint_call(fun, args, kwargs, static, options),
    )


remat = checkpoint


def _checkpoint_call(
    fun: Callable, args: tuple, kwargs: dict, static: tuple[int, ...], options: dict
) -> Any:
    cells = running_cells()
    plain = functools.partial(jax.checkpoint, static_argnums=static, **options)
    if not cells:
        return plain(fun)(*args, **kwargs)  # type: ignore[call-arg]
    what = "a jax.checkpoint"
    written = _probed(cells, what, lambda: fun(*args, **kwargs))
    if any(i >= len(args) or i < -len(args) for i in static):
        written = []  # a static argument given by keyword: JAX's own error, its numbers the user's

    def as_arguments(pure_of: Callable, values: list[Any]) -> tuple[Any, list[Any]]:
        rematted = jax.checkpoint(pure_of(fun), static_argnums=_after_states(static), **options)
        return rematted(values, *args, **kwargs)

    return _lift(
        cells, written, what, as_arguments,
        lambda: plain(fun)(*args, **kwargs),  # type: ignore[call-arg]
    )


# --- vmap ---------------------------------------------------------------------------
# ``jax.vmap``'s placement: the states of a sub-model in a mapped argument
# are mapped with it (in and out axes its argument's), each example reading
# and writing its own member; any other state is broadcast: read as it is,
# and assigned only with a value every example agrees on (``out_axes=None``,
# a statistic reduced over the ``axis_name``), which plain Python's loop
# over the examples would leave.


def vmap(fun: Callable[..., Any], in_axes: Any = 0, out_axes: Any = 0, **options: Any) -> Callable[..., Any]:
    """``jax.vmap`` of a function that may read and assign state (what a
    method's ``jax.vmap(...)`` calls).

    A sub-model in a mapped argument is a stack of members (one built by
    ``jax.vmap(Layer)(keys)``): each example reads and writes its own
    member, as a loop over the members would. A state reached any other way
    is shared by every example: reading it is free, and it may be assigned
    a value that does not vary over the examples (reduced with
    ``lax.pmean``/``psum`` over the ``axis_name``); a per-example value is
    refused, as no single value means what the loop would leave.

    Args:
        fun: the function to vectorize.
        in_axes: as ``jax.vmap``'s; the states of a sub-model in an argument
            share that argument's axis.
        out_axes: as ``jax.vmap``'s; the states of a mapped sub-model come back
            on their argument's axis.
        **options: the other options of ``jax.vmap`` (``axis_name``, ``axis_size``,
            ``spmd_axis_name``).

    Returns:
        The vectorized function.

    Examples:
        >>> @autostate.stateful
        ... class Member:
        ...     def __init__(self, key):
        ...         self.w = jax.random.normal(key, (2,))
        ...         self.calls = jnp.zeros((), jnp.int32)
        ...
        ...     def __call__(self, x):
        ...         self.calls += 1
        ...         return x @ self.w
        >>> members = jax.vmap(Member)(jax.random.split(jax.random.key(0), 3))
        >>> ys = autostate.vmap(lambda m, x: m(x))(members, jnp.ones((3, 2)))
        >>> print(ys.shape, members.calls)
        (3,) [1 1 1]
    """

    def call(args: tuple, kwargs: dict) -> Any:
        args, kwargs = _vmap_layers(in_axes, args, kwargs)
        axes = tuple(in_axes) if isinstance(in_axes, (tuple, list)) else (in_axes,) * len(args)
        mapped = ([a for a, axis in zip(args, axes) if axis is not None], kwargs)
        return _living_here(_with_layer_views(
            mapped, "a jax.vmap",
            lambda: _vmap_call(fun, in_axes, out_axes, options, args, kwargs),
        ))

    return _transformed(fun, "a jax.vmap", call)


def _living_here(out: Any) -> Any:
    """``out``, the models in it (a stack ``jax.vmap(Layer)(keys)`` built)
    living in the trace the ``vmap`` was called in: JAX made them there from
    the batched values, as a model built in that trace is (``lifetime``)."""
    if not _graph.holds_instance(out):
        return out
    home = current_trace()
    for obj in _graph.instances_of(out):
        for value in obj.__dict__.values():
            if isinstance(value, StateSlot) and hasattr(value, "_home"):
                with_home(value, home)
    return out


def _vmap_call(
    fun: Callable, in_axes: Any, out_axes: Any, options: dict, args: tuple, kwargs: dict
) -> Any:
    if _graph.holds_instance((args, kwargs)):  # a mapped sub-model: the copies guarded
        mapped = fun

        def fun(*inner: Any, **inner_kwargs: Any) -> Any:
            return _guarding_copies(
                (inner, inner_kwargs), "a jax.vmap", lambda: mapped(*inner, **inner_kwargs)
            )

    cells = running_cells()
    if not cells:
        return jax.vmap(fun, in_axes=in_axes, out_axes=out_axes, **options)(*args, **kwargs)
    what = "a jax.vmap"
    if isinstance(in_axes, list):
        in_axes = tuple(in_axes)  # (as jax.vmap reads a list)
    if not isinstance(in_axes, tuple):
        in_axes = (in_axes,) * len(args)
    axis_of: dict[int, int] = {}

    def visit(axis: Any, part: Any) -> None:
        if isinstance(axis, int):
            for i in _members(cells, part):
                axis_of.setdefault(i, axis)

    with contextlib.suppress(ValueError, TypeError):  # (jax.vmap says what does not match)
        jax.tree_util.tree_map(visit, in_axes, args, is_leaf=lambda a: a is None)
    visit(0, kwargs)
    members = list(axis_of)
    chosen = [cells[i] for i in members]
    axes = [axis_of[i] for i in members]
    _check_stacked(chosen, axes, options.get("axis_size"), what)
    groups = sorted(set(axes))
    assigned: list[int] = []

    def inner(values: list[Any], args: tuple, kwargs: dict) -> Any:
        with _member_slices(chosen):
            out, after, changed = _run_bound(
                cells, chosen, values, what, lambda: fun(*args, **kwargs)
            )
        stacked: dict[int, dict[int, Any]] = {axis: {} for axis in groups}
        for k, i in enumerate(members):
            if i in changed:
                stacked[axes[k]][k] = after[i]
        shared = {i: after[i] for i in sorted(changed) if i not in axis_of}
        assigned[:] = list(shared)
        return out, stacked, shared

    vmapped = functools.partial(jax.vmap, inner, in_axes=(axes, in_axes, 0), **options)
    values = _current(chosen)
    try:
        out, stacked, shared = vmapped(out_axes=(out_axes, {a: a for a in groups}, None))(
            values, args, kwargs
        )
    except ValueError as error:
        if "out_axes" not in str(error) or not assigned:
            raise
        for i in list(assigned):
            only_i = {j: None if j == i else 0 for j in assigned}  # (the others batched)
            try:
                jax.eval_shape(vmapped(out_axes=(0, 0, only_i)), values, args, kwargs)
            except ValueError:
                raise _shared_write(cells[i], what, "example", _REDUCE_EXAMPLES) from None
        raise
    for axis in groups:
        _land(chosen, stacked[axis])
    _land(cells, shared)
    return out


_REDUCE_EXAMPLES = (
    "reduce the value over the vmap's axis (`jax.vmap(fn, axis_name='batch')` and "
    "`lax.pmean(value, 'batch')`), or make the state part of a stacked sub-model "
    "(`jax.vmap(Layer)(keys)`) passed as a mapped argument, so each example keeps its own."
)


# --- jit ----------------------------------------------------------------------------
# ``jax.jit``'s placement: the live states JAX can trace are extra arguments
# of the jitted function and the ones it assigns extra outputs, so a write
# inside lands with its value, as if the function ran eagerly, and a read is
# the state's value at the call, never a constant of an earlier trace.


def jit(fun: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    """``jax.jit`` of a function that may read and assign state (what a
    method's ``jax.jit(...)`` calls).

    The states are arguments and outputs of the compiled function: a read is
    the state's value at the call, and a write lands, as if the function ran
    eagerly. A static state (a Python value) may not be assigned there.

    Args:
        fun: the function to compile.
        **options: those of ``jax.jit`` (``static_argnums``, ``donate_argnums``, ...),
            numbered as the arguments of ``fun``.

    Returns:
        The compiled function.

    Examples:
        >>> @autostate.stateful
        ... class Counter:
        ...     def __init__(self):
        ...         self.n = jnp.zeros((), jnp.int32)
        ...
        ...     def _add(self, k):
        ...         self.n += k
        ...         return self.n
        ...
        ...     def step(self, k):
        ...         return jax.jit(self._add)(k)  # routed here
        >>> counter = Counter()
        >>> print(counter.step(2), counter.step(3), counter.n)
        2 5 5
    """
    for name in ("in_shardings", "out_shardings"):
        if options.get(name) is not None:
            raise ControlFlowStateError(
                format_error(
                    f"jax.jit with {name} inside a method: the states the function reads "
                    "and assigns are extra arguments and outputs of the compiled function, "
                    f"so {name} given for the function's own would not line up with them.",
                    where=user_location(),
                    fix="annotate the states with autostate.sharded(value, spec) and jit the "
                    "outer step (f) with the shardings autostate.shardings gives, or "
                    "constrain values inside with jax.lax.with_sharding_constraint.",
                )
            )
    # Donation is left out: a donated state would delete the caller's states
    # dict (through f) or the model's old arrays, which plain Python keeps.
    options = {k: v for k, v in options.items() if k not in ("donate_argnums", "donate_argnames")}
    shifted = dict(options)
    if options.get("static_argnums") is not None:
        shifted["static_argnums"] = _after_states(options["static_argnums"])
    # An object boundary (DESIGN.md section 8): the function is traced on every
    # call, once, so a static config it switches (``self.training = False``) is
    # written back as the plain call leaves it.
    return _transformed(
        fun, "a jax.jit", lambda args, kwargs: _jit_call(fun, options, shifted, args, kwargs),
        once=True,
    )


def _jit_call(
    fun: Callable, options: dict, shifted: dict, args: tuple, kwargs: dict
) -> Any:
    cells = running_cells()
    if not cells:
        if _graph.holds_instance((fun, args, kwargs)):
            # (Traced afresh, as below: a static config the function assigns
            # is assigned on every call, never skipped by JAX's cache.)
            fun = functools.wraps(fun)(functools.partial(fun))
        return jax.jit(fun, **options)(*args, **kwargs)
    what = "a jax.jit"
    passed = [i for i, cell in enumerate(cells) if _traceable(cell.value)]
    chosen = [cells[i] for i in passed]

    def threaded(values: list[Any], *inner: Any, **inner_kwargs: Any) -> Any:
        return _argument_writes(cells, passed, values, what, lambda: fun(*inner, **inner_kwargs))

    threaded.__name__ = getattr(fun, "__name__", threaded.__name__)  # (the jaxpr's name)
    _with_states_first(threaded, fun)
    out, new = jax.jit(threaded, **shifted)(_current(chosen), *args, **kwargs)
    _land(chosen, new)
    return out


# --- shard_map -----------------------------------------------------------------------
# ``jax.shard_map``'s placement: the live states JAX can trace are extra
# arguments, each with the partition spec its annotation gives (replicated
# without one), and come back with it. A replicated state assigned there
# lands only with a value every shard agrees on (reduced with
# ``lax.pmean``/``psum`` over the mesh axes); a per-shard value is refused,
# as a per-example one under ``jax.vmap`` is.


def shard_map(f: Callable[..., Any] | None = None, /, **options: Any) -> Any:
    """``jax.shard_map`` of a function that may read and assign state (what a
    method's ``jax.shard_map`` calls). A state enters every shard with the
    partition spec its annotation gives (``autostate.sharded``), replicated
    otherwise, and leaves the same way: a replicated one the function assigns
    must have a value every shard agrees on (reduced over the mesh axes), or
    it is refused.

    Args:
        f: the per-shard function (or ``None``: ``shard_map`` used as a decorator
            factory, as ``jax.shard_map(mesh=..., ...)``).
        **options: those of ``jax.shard_map`` (``mesh``, ``in_specs``, ``out_specs``, ...).

    Returns:
        The mapped function.
    """
    if f is None:
        return functools.partial(shard_map, **options)
    fun = f
    return _transformed(
        fun, "a jax.shard_map", lambda args, kwargs: _shard_map_call(fun, options, args, kwargs)
    )


def _shard_map_call(f: Callable, options: dict, args: tuple, kwargs: dict) -> Any:
    cells = running_cells()
    if not cells or kwargs:  # (jax.shard_map takes no keywords: its own error)
        return jax.shard_map(f, **options)(*args, **kwargs)
    what = "a jax.shard_map"
    passed = [i for i, cell in enumerate(cells) if _traceable(cell.value)]
    chosen = [cells[i] for i in passed]
    replicated = jax.sharding.PartitionSpec()
    annotated = _annotated_specs(cells, (f, args))
    specs = [annotated.get(i, replicated) for i in passed]
    sharded = [k for k, i in enumerate(passed) if i in annotated]
    lifted = dict(options)
    if "in_specs" in options:
        given = options["in_specs"]
        per_arg = given if isinstance(given, tuple) else (given,) * len(args)
        lifted["in_specs"] = (specs, *per_arg)
    assigned: list[int] = []

    def threaded(values: list[Any], *inner: Any) -> Any:
        out, written = _argument_writes(cells, passed, values, what, lambda: f(*inner))
        assigned[:] = [k for k in written if k not in sharded]
        # An annotated state leaves with its own spec, assigned or not; the
        # others replicated, only those assigned.
        return out, (
            {k: written.get(k, values[k]) for k in sharded},
            {k: v for k, v in written.items() if k not in sharded},
        )

    out_specs = (options.get("out_specs"), ({k: specs[k] for k in sharded}, replicated))
    values = _current(chosen)
    try:
        out, (kept, new) = jax.shard_map(threaded, **{**lifted, "out_specs": out_specs})(
            values, *args
        )
    except ValueError:
        for k in list(assigned):
            one = functools.partial(lambda k, *a: threaded(*a)[1][1][k], k)
            try:
                jax.eval_shape(
                    jax.shard_map(one, **{**lifted, "out_specs": replicated}), values, *args
                )
            except ValueError:
                raise _shared_write(chosen[k], what, "shard", _REDUCE_SHARDS) from None
        raise
    _land(chosen, {**kept, **new})
    return out


def _annotated_specs(cells: Cells, roots: tuple) -> dict[int, Any]:
    """The partition specs the models reachable from ``roots`` annotate their
    states with (``autostate.sharded``), by index into ``cells``."""
    from autostate.sharding import ANNOTATIONS

    index = {id(cell): i for i, cell in enumerate(cells)}
    found: dict[int, Any] = {}
    for obj in reachable_instances(roots, []):
        for attr, spec in vars(obj).get(ANNOTATIONS, {}).items():
            slot = obj.__dict__.get(attr)
            if type(slot) is HandledLocalStateRef:
                i = index.get(id(handler_cells(slot.handler_id).get(slot.name)))
                if i is not None:
                    found.setdefault(i, spec)
    return found


_REDUCE_SHARDS = (
    "reduce the value over the mesh axes (`lax.pmean(value, 'data')`) before assigning "
    "it, or return the per-shard values and assign their reduction after the call."
)


# --- derivatives --------------------------------------------------------------------
# A derivative's placement: the states the function assigns leave it as
# auxiliary outputs and are assigned after, so each keeps its primal value;
# one it only reads is a constant of the derivative. ``apply(g, has_aux)``
# takes the derivative of ``g``; ``split`` takes the states' values out of
# what it gave with ``has_aux=True``.


def _with_aux_states(
    fun: Callable, has_aux: bool, what: str,
    apply: Callable[[Callable, bool], Any], split: Callable[[Any, bool], tuple[Any, dict[int, Any]]],
) -> Any:
    """``fun``'s derivative, ``apply(fun, has_aux)``, with the states ``fun``
    assigns leaving it as auxiliary outputs. It runs ``fun`` once, as plain
    Python does, and sees what was assigned when it returns: only those
    states travel (a state holding a value that is not a JAX type, a deque or
    a plain object, would be refused as an output of ``jacfwd``'s batching)."""
    cells = running_cells()
    if not cells:
        return apply(fun, has_aux)
    before = _current(cells)

    def threaded(*inner: Any, **inner_kwargs: Any) -> tuple[Any, tuple[Any, dict[int, Any]]]:
        # A container of arrays is the body's own copy, so a change in place
        # (``d = self.stats; d["m"] = ...``) is seen, and leaves it as an
        # assignment does, with its primal value.
        values = [_settled(v) if _traceable(v) else v for v in before]
        signatures = [_signature(v) for v in values]
        with _bound(cells, cells, values, what):
            out = _settled(fun(*inner, **inner_kwargs))
            after = _current(cells)
        out, aux = out if has_aux else (out, None)
        written = {
            i: v for i, (v, b, sig) in enumerate(zip(after, values, signatures))
            if _assigned(b, sig, v)
        }
        return out, (aux, written)

    result, assigned = split(apply(threaded, True), has_aux)
    _land(cells, assigned)
    return result


def _split_pair(raw: Any, has_aux: bool) -> tuple[Any, dict[int, Any]]:
    """``(derivative, aux)``: grad, jacfwd, jacrev, jacobian, hessian."""
    found, (aux, values) = raw
    return ((found, aux) if has_aux else found), values


def _split_value(raw: Any, has_aux: bool) -> tuple[Any, dict[int, Any]]:
    """``((value, aux), grad)``: value_and_grad."""
    (value, (aux, values)), grads = raw
    return (((value, aux) if has_aux else value), grads), values


def _split_last(raw: Any, has_aux: bool) -> tuple[Any, dict[int, Any]]:
    """``(..., aux)``: jvp, vjp, linearize."""
    *rest, (aux, values) = raw
    return ((*rest, aux) if has_aux else tuple(rest)), values


def _lifted(
    name: str, roots: tuple, fun: Callable, has_aux: bool,
    apply: Callable[[Callable, bool], Any], split: Callable[[Any, bool], tuple[Any, dict[int, Any]]],
) -> Any:
    """``jax.<name>`` of ``fun`` (``apply``), eager models' states handled for the call."""
    what = f"a jax.{name}"
    return _with_eager_states(
        roots, lambda: _with_aux_states(fun, has_aux, what, apply, split), what, once=True
    )


def _derivative(
    jax_fn: Callable[..., Any], split: Callable[[Any, bool], tuple[Any, dict[int, Any]]]
) -> Callable[..., Any]:
    """What stands for ``jax_fn``, a transformation of ``fun`` taking ``argnums``."""
    name = jax_fn.__name__

    def derivative(fun: Callable[..., Any], argnums: Any = 0, has_aux: bool = False,
                   **options: Any) -> Callable[..., Any]:
        def differentiated(*args: Any, **kwargs: Any) -> Any:
            def apply(g: Callable, aux: bool) -> Any:
                return jax_fn(g, argnums=argnums, has_aux=aux, **options)(*args, **kwargs)

            return _lifted(name, (fun, args, kwargs), fun, has_aux, apply, split)

        functools.update_wrapper(differentiated, fun, updated=())
        return differentiated

    return _documented(derivative, name)


def _at_primals(jax_fn: Callable[..., Any]) -> Callable[..., Any]:
    """What stands for ``jax_fn``, applied at ``*primals`` (vjp, linearize)."""
    name = jax_fn.__name__

    def derivative(fun: Callable[..., Any], *primals: Any, has_aux: bool = False,
                   **options: Any) -> Any:
        def apply(g: Callable, aux: bool) -> Any:
            return jax_fn(g, *primals, has_aux=aux, **options)

        return _lifted(name, (fun, primals), fun, has_aux, apply, _split_last)

    return _documented(derivative, name)


def jvp(fun: Callable[..., Any], primals: Any, tangents: Any, has_aux: bool = False) -> Any:
    def apply(g: Callable, aux: bool) -> Any:
        return jax.jvp(g, primals, tangents, has_aux=aux)

    return _lifted("jvp", (fun, primals, tangents), fun, has_aux, apply, _split_last)


def _documented(derivative: Callable[..., Any], name: str) -> Callable[..., Any]:
    derivative.__name__ = derivative.__qualname__ = name
    derivative.__doc__ = (
        f"``jax.{name}`` of a function that may read and assign state (what a "
        f"method's ``jax.{name}(...)`` calls).\n\nA state is never differentiated: "
        "read inside, it is a constant; assigned inside, it keeps the primal value, "
        "as the same function with the state passed in by hand would give it."
    )
    return derivative


grad = _derivative(jax.grad, _split_pair)
value_and_grad = _derivative(jax.value_and_grad, _split_value)
jacfwd = _derivative(jax.jacfwd, _split_pair)
jacrev = _derivative(jax.jacrev, _split_pair)
jacobian = _derivative(jax.jacobian, _split_pair)
hessian = _derivative(jax.hessian, _split_pair)
vjp = _at_primals(jax.vjp)
linearize = _at_primals(jax.linearize)
jvp = _documented(jvp, "jvp")


# --- custom derivatives ------------------------------------------------------------
# A function with a custom derivative runs as plain Python where JAX calls it
# on concrete values (eagerly, ``f`` outside ``jit``), so a state it assigns
# there lands. Where JAX traces it into its own sub-program (under ``jit``)
# no placement can return the write: a state left holding a tracer of that
# finished trace is refused at the call, naming the state and the line, and
# the states are put back.


def _custom_call(call: Callable[[], Any], roots: tuple, what: str) -> Any:
    def checked() -> Any:
        cells = running_cells()
        before = [cell.value for cell in cells]
        out = call()
        for cell, value in zip(cells, before):
            if cell.value is not value and holds_escaped_tracer(cell.value):
                name = cell.name
                for c, v in zip(cells, before):
                    c.value = v
                raise EscapedStateError(
                    format_error(
                        f"State {name!r} is assigned inside {what} (or its rules) that JAX "
                        "traced into its own program, so the state would hold a tracer of "
                        "that finished program.",
                        where=user_location(),
                        fix="assign the state outside the function with the custom "
                        "derivative: return the new value from it and assign it after the "
                        "call.",
                    )
                )
        return out

    return _with_eager_states(roots, checked, what)


def _reentering(fn: Callable[..., Any], calls: list[tuple[Any, dict[str, Any]]],
                what: str) -> Callable[..., Any]:
    """``fn``, a function with a custom derivative or its forward rule, which
    JAX may trace after the call that called it has ended (a forward rule
    traced lazily for an outer ``jax.grad`` of a ``jax.checkpoint``): then it
    reads the states of the handlers running at the call (``calls``), with
    the values they had there, as it would have run at that line. It cannot
    assign them any more (the call is over): refused."""

    def run(*args: Any, **kwargs: Any) -> Any:
        gone = [(hid, values) for hid, values in calls if running_call(hid) is None]

        def within(k: int) -> Any:
            if k == len(gone):
                return fn(*args, **kwargs)
            cells = handler_cells(gone[k][0])
            before = {name: cell.value for name, cell in cells.items()}
            out = within(k + 1)
            for name, cell in cells.items():
                if cell.value is not before[name]:
                    raise EscapedStateError(
                        format_error(
                            f"State {name!r} is assigned inside {what}, which JAX traced "
                            "after the call that called it had ended (under jax.checkpoint), "
                            "so the write has no call to land in.",
                            where=user_location(),
                            fix="assign the state outside the function with the custom "
                            "derivative: return the new value from it and assign it after "
                            "the call.",
                        )
                    )
            return out

        if not gone:
            return fn(*args, **kwargs)
        run_in = within
        for hid, values in reversed(gone):
            run_in = functools.partial(_run_states, hid, values, run_in)
        return run_in(0)

    functools.update_wrapper(run, fn)
    return run


def _run_states(handler_id: Any, values: dict[str, Any], call: Callable[[int], Any],
                k: int) -> Any:
    return run_with_states(handler_id, values, call, (k,), {})[0]


class _StateChecked:
    """The call of a function with a custom derivative, its states checked
    (``_custom_call``); the function and the rules JAX may trace after the
    call has ended read the states as they were at the call (``_reentering``)."""

    fun: Callable[..., Any]
    _deferred: tuple[str, ...] = ()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        what = f"a jax.{type(self).__name__} function"

        def call() -> Any:
            calls = [(entry[0], {name: cell.value for name, cell in entry[1].items()})
                     for entry in running_calls()]
            target = self
            if calls:
                target = object.__new__(type(self))  # (custom_vjp's __new__ takes fun)
                target.__dict__.update(self.__dict__)
                for name in self._deferred:
                    rule = getattr(self, name, None)
                    if rule is not None:
                        setattr(target, name, _reentering(rule, calls, what))
            return super(_StateChecked, target).__call__(*args, **kwargs)  # type: ignore[misc]

        return _custom_call(call, (self.fun, args, kwargs), what)


class custom_vjp(_StateChecked, jax.custom_vjp):  # noqa: N801 - jax's name
    """``jax.custom_vjp`` whose function may assign state where JAX runs it on
    concrete values (what a method's ``jax.custom_vjp`` calls); a write JAX
    traces away is refused at the call."""

    _deferred = ("fun", "fwd")


class custom_jvp(_StateChecked, jax.custom_jvp):  # noqa: N801 - jax's name
    """``jax.custom_jvp`` whose function may assign state where JAX runs it on
    concrete values (what a method's ``jax.custom_jvp`` calls); a write JAX
    traces away is refused at the call."""

    _deferred = ("fun", "jvp")


# --- what the decorator routes here -------------------------------------------------


def _targets() -> dict[Any, str]:
    targets: dict[Any, str] = {
        lax.scan: "scan",
        lax.cond: "cond",
        lax.switch: "switch",
        lax.while_loop: "while_loop",
        lax.fori_loop: "fori_loop",
        lax.map: "map",
        jax.checkpoint: "checkpoint",
        jax.remat: "checkpoint",
        jax.grad: "grad",
        jax.value_and_grad: "value_and_grad",
        jax.jacfwd: "jacfwd",
        jax.jacrev: "jacrev",
        jax.jacobian: "jacobian",
        jax.hessian: "hessian",
        jax.jvp: "jvp",
        jax.vjp: "vjp",
        jax.linearize: "linearize",
        jax.vmap: "vmap",
        jax.jit: "jit",
        jax.custom_vjp: "custom_vjp",
        jax.custom_jvp: "custom_jvp",
    }
    with contextlib.suppress(AttributeError):
        targets[jax.shard_map] = "shard_map"
    with contextlib.suppress(ImportError, AttributeError):
        from jax import ad_checkpoint

        targets[ad_checkpoint.checkpoint] = "checkpoint"  # type: ignore[attr-defined]
    return targets


_TARGETS = _targets()
# id(JAX function) -> (the function, the one here that stands for it)
_ROUTES: dict[int, tuple[Any, Callable[..., Any]]] = {}


def routed(obj: Any) -> Any:
    """What a rewritten method calls where its source named a JAX
    control-flow function (``lax.scan(...)`` reads
    ``__autostate__.control.routed(lax.scan)(...)``): the function here that
    threads state when ``obj``, evaluated where the method runs, is that JAX
    function; ``obj`` itself otherwise. So a local or a parameter of the same
    name (``def run(self, x, checkpoint=False)``, ``cond = x > 0``), or a
    global rebound since the decoration, means what plain Python says."""
    found = _ROUTES.get(id(obj))
    if found is not None and found[0] is obj:
        return found[1]
    return obj


def wrapper_name(obj: Any) -> str | None:
    """The name of the function here that stands for ``obj`` (``jax.lax.scan`` -> ``"scan"``)."""
    try:
        return _TARGETS.get(obj)
    except TypeError:  # unhashable
        return None


_ROUTES.update(
    (id(target), (target, globals()[name])) for target, name in _TARGETS.items()
)
