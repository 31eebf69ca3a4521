"""The guard: a call changes nothing outside its states.

Inside a functionalized call (``f(states, ...)``) or the traced body of a
``lax`` call the model is not plain Python's one object: ``f``'s model is a
copy the call throws away (under a trace, a copy of that trace), and a
``lax`` body runs once per trace, not once per step. A change there that is
not a state write (``self.log.append(x)``, ``vars(self)["w"] = v``, a swapped
sub-model, a traced value in a plain attribute) would be lost when the call
returns, made once per trace instead of once per step, or leave a JAX tracer
behind. This module is the one mechanism that keeps every such call honest,
in four steps:

- **snapshot** before the call: the instances' ``__dict__`` (``f``), the
  lists, dicts, sets and deques they hold outside their states (under a
  trace, or on a copy of ``f``'s model; always for a ``lax`` body), and the
  flattened graph (``f`` under a trace): what changed is graph's to say
  (``graph.mutable_statics`` / ``changed_statics`` / ``restore_statics``,
  ``graph.graph_unchanged``);
- **refuse as it happens** a write that cannot be a state write
  (``check_write``, the setattr guard; ``refuse_submodel_swap``): it is
  recorded, so a refusal the user's code catches is raised again when the
  call returns (``errors.refused``);
- **compare** after the call: by identity, so a traced value is never
  compared with ``==``;
- **restore** what changed, and **refuse** with one clear error naming it
  (or explain JAX's error about a traced value used as a concrete one).

The guard knows which changes are refused and how they are worded; it does
not know how states are bound to a call (``effects``), how ``f`` is
flattened (``functional``) or how a ``lax`` body is threaded (``control``).

Example:
    >>> @autostate.stateful
    ... class Logger:
    ...     def __init__(self):
    ...         self.seen = []  # not a state: no method assigns it
    ...
    ...     def __call__(self, x):
    ...         self.seen.append(x)  # a change in place, outside the states
    ...         return x
    >>> model = Logger()
    >>> f, states = model.functionalize()
    >>> jax.jit(f)(states, 1.0)
    Traceback (most recent call last):
    ...
    autostate.errors.StateAccessError: A functionalized call changed Logger's attributes outside its states (at Logger.seen), ...
    >>> f.model.seen  # put back as it was
    []
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import operator
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax

from autostate import graph as _graph
from autostate import tree as _tree
from autostate.effects.local_state import StateSlot, in_running_body
from autostate.errors import (
    AutostateError,
    EscapedStateError,
    StateAccessError,
    TracedEagerStateError,
    TracedValueError,
    escaped_state_message,
    format_error,
    holder_fix,
    refusals_raised_again,
    refused,
    traced_value_error,
    user_location,
)

_ABSENT: Any = object()

COMPILED = "the function compiled by autostate.jit"
"""What ``Guard.for_compiled`` guards (named in its refusal)."""

CAPTURED = "a list, dict, object or variable it captures"
"""The label of what a ``lax`` body captures: a variable of the enclosing
function (its cell, which ``nonlocal`` rebinds) and the lists, dicts and
plain objects' attributes it holds."""


# --- which instances are guarded now --------------------------------------------

# (ids of the eager instances a lax call's body reaches, what the call is, ids
# of the instances at an object boundary): set while an eager model's lax call
# runs (``lifting``), whose body JAX traces, so that a traced value assigned to
# one of them that is not state is refused where it is written instead of
# staying in the model as a tracer; and while an object boundary's function
# runs (``autostate.jit``'s copies, a ``jax.jit`` inside a method), where a
# change of structure is written back as the plain call makes it (DESIGN.md
# section 8). A traced body inside ends the boundary for every instance.
_IN_LAX_BODY: contextvars.ContextVar[tuple[frozenset[int], str, frozenset[int]]] = (
    contextvars.ContextVar("autostate_eager_lax_instances", default=(frozenset(), "", frozenset()))
)


# Whether ``obj`` belongs to a body that a handler is running now: one of the
# instances its caller named (``run_with_states``'s ``instances``), whose
# non-state writes the run-time guard refuses. The engine knows which bodies
# run; what is refused there is this module's.
is_guarded = in_running_body


# The guard of the innermost ``lax`` body being traced now (``after_probe``).
_LAX_GUARD: contextvars.ContextVar[Guard | None] = contextvars.ContextVar(
    "autostate_lax_guard", default=None
)


def after_probe() -> None:
    """Refuses, before the body is traced again, what the abstract trace of a
    ``lax`` body (the probe that finds the states it assigns) left where the
    guard watches: a value of that trace, which the next trace of the body
    would read (a captured list's last item, a ``nonlocal`` variable) and bake
    into the program as a constant of a trace that has ended."""
    guard = _LAX_GUARD.get()
    if guard is not None and guard.containers:
        changed = guard._changed_containers()
        if changed:
            raise guard._container_error(changed)


def lax_body_of(obj: Any) -> str | None:
    """The lax call (``"the body of a lax.scan"``) whose traced body may write
    eager ``obj`` now, or ``None``."""
    ids, what, _ = _IN_LAX_BODY.get()
    return what if ids and id(obj) in ids else None


def at_object_boundary(obj: Any) -> bool:
    """Whether ``obj`` is a model of an object boundary's function running now
    (``autostate.jit``'s copies, a ``jax.jit`` inside a method), outside any
    traced body inside it: a sub-model it is assigned is written back."""
    boundary = _IN_LAX_BODY.get()[2]
    return bool(boundary) and id(obj) in boundary and not is_guarded(obj)


@contextlib.contextmanager
def eager_lax_body(
    instances: Sequence[Any], what: str, *, boundary: bool = False
) -> Iterator[None]:
    """Marks ``instances`` as reached by the traced body of ``what`` while it
    runs; ``boundary``: ``what`` is an object boundary (``object_boundary``)."""
    ids, _, at_boundary = _IN_LAX_BODY.get()
    marked = frozenset(map(id, instances))
    token = _IN_LAX_BODY.set(
        (ids | marked, what, at_boundary | marked if boundary else frozenset())
    )
    rebound_token = _REBOUND.set({} if boundary else None)
    try:
        yield
    finally:
        _REBOUND.reset(rebound_token)
        _IN_LAX_BODY.reset(token)


# The attributes of the models a ``jax.jit`` inside a method runs on that it
# rebound (a sub-model replaced), each ``(obj, name, entry before)``: the
# value they hold after the call, which no output of the program carries,
# must hold no value of its trace (``check_rebound``, as its guard is left).
_REBOUND: contextvars.ContextVar[dict[tuple[int, str], tuple[Any, str, Any]] | None] = (
    contextvars.ContextVar("autostate_rebound", default=None)
)


def _check_rebound(what: str) -> None:
    rebound = _REBOUND.get()
    for obj, name, before in (rebound or {}).values():
        _check_rebound_kept(obj, name, before, what)


def _check_rebound_kept(obj: Any, name: str, before: Any, what: str) -> None:
    """Refuses (putting back ``before``) a value of the trace left in ``obj.name``."""
    from autostate.lifetime import holds_escaped_tracer  # (see check_write)

    value = obj.__dict__.get(name)
    if isinstance(value, StateSlot):
        if value.part_of() is not None:
            return
        value = value.read()
    elif _graph.holds_instance(value):
        return  # (a sub-model: checked when assigned)
    if holds_escaped_tracer(value):
        obj.__dict__[name] = before
        raise StateAccessError(format_error(
            f"{type(obj).__name__}.{name} held a sub-model and was assigned a traced value "
            f"inside {what} inside a method: the call writes back the states of the "
            "models it reached when it started, and this attribute became a new state "
            "there, so it would keep a value of the trace.",
            where=user_location(),
            fix=f"assign `self.{name}` a value before the jax.jit call (its state is then "
            "threaded through it), or compile the whole step with autostate.jit.",
        ))


@contextlib.contextmanager
def object_boundary(instances: Sequence[Any]) -> Iterator[None]:
    """Marks ``instances`` (models living in a compiled call's trace) as at an
    object boundary while its function runs (``at_object_boundary``)."""
    ids, what, at_boundary = _IN_LAX_BODY.get()
    token = _IN_LAX_BODY.set((ids, what, at_boundary | frozenset(map(id, instances))))
    try:
        yield
    finally:
        _IN_LAX_BODY.reset(token)


class Guard:
    """One call's guard: the snapshot is taken when it is made (``for_call``,
    ``for_lax_body``); leaving ``with guard:`` re-raises a caught write refusal,
    then compares, puts back and refuses a change. Leaving with an error, it
    puts back, explains JAX's concrete-value error (``explain_traced_value``),
    and refuses a lax body's tracer left in a container in place of the error."""

    __slots__ = (
        "what", "model", "ids", "dicts", "containers", "graph", "traced", "on_copy",
        "lax_body", "traced_states", "states", "instances", "_refusals", "_token",
    )

    def __init__(
        self,
        what: str,
        model: Any,
        ids: frozenset[int],
        dicts: list[tuple[Any, dict[str, Any]]],
        containers: Sequence[tuple[Any, Any, str]],
        graph: tuple | None,
        *,
        traced: bool,
        on_copy: bool = False,
        lax_body: bool = False,
        traced_states: Callable[[], Iterable[tuple[str, Any]]] | None = None,
    ):
        self.what = what
        self.model = model  # f's model (named in a refusal), or None
        self.ids = ids  # the ids of the guarded instances (``is_guarded``)
        self.dicts = dicts  # (instance, copy of its __dict__)
        self.containers = containers  # (container, shallow copy, "Class.attr")
        self.graph = graph  # (leaves, graphdef) of the model before the call
        self.traced = traced
        self.on_copy = on_copy  # f's model is a copy (constants embedded)
        self.lax_body = lax_body
        self.traced_states = traced_states  # the states a traced-value error may name
        self.states: dict[str, Any] | None = None  # what the call returned (``returned``)
        self.instances: list[Any] = []  # a compiled call's models (``for_compiled``)

    @classmethod
    def for_call(
        cls,
        model: Any,
        instances: list[Any],
        ids: frozenset[int],
        *,
        traced: bool,
        on_copy: bool,
        graph: tuple | None,
        states: dict[str, Any],
    ) -> Guard:
        """The guard of one call of ``f`` on ``model``. Eagerly only the ``__dict__``s
        are copied (a container changed in place is plain Python's change to ``f``'s
        model); under a trace or on a copy the containers too, and under a trace
        ``graph`` is compared."""
        return cls(
            "the call of f",
            model,
            ids,
            [(obj, obj.__dict__.copy()) for obj in instances],
            _graph.mutable_statics(instances) if traced or on_copy else (),
            graph,
            traced=traced,
            on_copy=on_copy,
            traced_states=states.items if traced else None,
        )

    @classmethod
    def for_lax_body(
        cls,
        what: str,
        instances: list[Any],
        values: Sequence[tuple[str, Any]],
        traced_states: Callable[[], Iterable[tuple[str, Any]]],
    ) -> Guard:
        """The guard of the traced body of ``what``: the containers ``instances`` hold
        outside their states and those in ``values`` (``(label, value)``) stay free
        of the body's tracers; attribute writes are guarded as they happen."""
        containers = _graph.mutable_statics(instances, values)
        return cls(
            what, None, frozenset(), [], containers, None,
            traced=True, lax_body=True, traced_states=traced_states,
        )

    @classmethod
    def for_compiled(cls, instances: list[Any]) -> Guard:
        """The guard of the trace of a function ``autostate.jit`` compiles, on
        ``instances``, the models rebuilt in it: what they hold that the call
        does not write back (a plain object's attributes, a class's list) stays
        as it was, since the compiled program changes it once per trace, not
        once per call."""
        guard = cls(
            COMPILED, None, frozenset(), [], _graph.mutable_statics(instances, shared=True),
            None, traced=True,
        )
        guard.instances = instances
        return guard

    # --- the block -------------------------------------------------------------

    def __enter__(self) -> Guard:
        self._refusals = refusals_raised_again(self.what)
        self._refusals.__enter__()
        self._token = _LAX_GUARD.set(self) if self.lax_body else None
        return self

    def __exit__(self, kind: Any, raised: BaseException | None, tb: Any) -> None:
        if self._token is not None:
            _LAX_GUARD.reset(self._token)
        error = raised
        try:
            self._refusals.__exit__(kind, raised, tb)
            if raised is None:
                if self.states is not None:
                    _check_states(self.states)
                self._compare()
                if self.lax_body:
                    _check_rebound(self.what)
        except BaseException as refusal:  # noqa: BLE001 - a caught refusal raised again
            error = refusal
        if error is None:
            return
        error = self._restore(error)
        explained = self._explained(error)
        if explained is not None:
            raise explained.with_traceback(error.__traceback__) from None
        if error is not raised:
            raise error

    def returned(self, states: dict[str, Any]) -> None:
        """Records the new states the call returned, checked when the block is left."""
        self.states = states

    # --- compare, restore, refuse ------------------------------------------------

    def _changed_containers(self) -> list[str]:
        """Where a container changed: for a ``lax`` body, only a change that
        holds a tracer (a Python value it appends is appended once per trace,
        as JAX runs the body, and stays)."""
        from autostate.lifetime import contains_tracer  # (the layer above: see check_write)

        return list(dict.fromkeys(
            where
            for value, where in _graph.changed_statics(self.containers)
            if not self.lax_body or contains_tracer(value)
        ))

    def _compare(self) -> None:
        """Refuses (after putting it back) a change outside the states."""
        for obj, before in self.dicts:
            d = obj.__dict__
            if not _dict_kept(d, before):
                _check_attributes_kept(obj, before, self.traced)
        if self.containers:
            changed = self._changed_containers()
            if changed:
                raise self._container_error(changed)
        if self.graph is not None and not _graph.graph_unchanged(self.model, *self.graph):
            moved = _changed_in_graph(self.graph, _graph.flatten_graph(self.model))
            if moved is not None:
                raise self._change_error(moved)

    def _restore(self, error: BaseException) -> BaseException:
        """Puts back what the call changed; returns the error to raise: a
        ``lax`` body's tracer in a container stands in for a plain error."""
        changed = self._changed_containers() if self.containers else []
        if changed or not self.lax_body:
            _graph.restore_statics(self.containers)
        for obj, before in self.dicts:
            d = obj.__dict__
            if not _dict_kept(d, before):
                d.clear()
                d.update(before)
        if (
            changed
            and self.lax_body
            and isinstance(error, Exception)
            and not isinstance(error, AutostateError)
        ):
            return self._container_error(changed)
        return error

    def _explained(self, error: BaseException) -> TracedValueError | None:
        if self.traced_states is None:
            return None
        if self.lax_body:
            where = (
                f"{self.what}: JAX traces it instead of running it as plain Python does, so "
                "its carry, operands or arguments are traced values, and so is each state it assigns "
                "(threaded through it), and in a call of f under jax.jit every state"
            )
        else:
            where = (
                "a call of f under a JAX transformation (jax.jit, grad, vmap), where every "
                "state is traced"
            )
        return explain_traced_value(error, where, traced_numbers(self.traced_states()))

    def _container_error(self, changed: list[str]) -> AutostateError:
        if not self.lax_body:
            return self._change_error(changed)
        what = self.what.capitalize()
        if all(where == CAPTURED for where in changed):
            return EscapedStateError(format_error(
                f"{what} changed {CAPTURED} (from the enclosing function: a list or dict "
                "changed in place, an object's attribute assigned, a variable rebound by "
                "`nonlocal`; or a state read before the call): JAX traces the body instead of "
                "running it as plain Python does, so the change would hold the body's traced "
                "value after the call.",
                where=user_location(),
                fix="return the value from the body (a loop's carry, a branch's output, a "
                "derivative's auxiliary output with has_aux=True); for a model's state, read "
                "it inside the body (`self.items[0] = v`), where its changes are threaded.",
            ))
        names = ", ".join(changed)
        if all(where.startswith("state ") for where in changed):
            return EscapedStateError(format_error(
                f"{what} changed {names} in place through a reference taken before the call "
                "(`items = self.items` outside the body): autostate threads a copy of the "
                "state through the body, so the change would hold the body's traced value "
                "after the call.",
                where=user_location(),
                fix="read the state inside the body (`self.items[0] = v`, or "
                "`items = self.items` there), where its changes are threaded.",
            ))
        return EscapedStateError(format_error(
            f"{what} changed {names} in place, an attribute that is not state: JAX traces "
            "the body instead of running it as plain Python does, so the change would hold the "
            "body's traced value after the call.",
            where=user_location(),
            fix="make it state (assign the attribute in one of its class's methods, or wrap "
            "its value in autostate.state(...) in __init__); a state changed in place there "
            "is threaded through the body.",
        ))

    def _holder_fix(self, changed: list[str]) -> str | None:
        """The fix the class of a changed attribute's object gives (``holder_fix``)."""
        for obj in self.instances:
            for name, value in obj.__dict__.items():
                if f"{type(obj).__name__}.{name}" in changed and holder_fix(value):
                    return holder_fix(value)
        return None

    def _change_error(self, changed: list[str]) -> StateAccessError:
        where = f" (at {', '.join(changed[:3])})" if changed else ""
        if self.what == COMPILED:
            return StateAccessError(format_error(
                f"A function compiled by autostate.jit changed an object its models hold{where} "
                "in place, one that is neither a model nor a list or dict of one (a plain "
                "object's attribute, a class's list): the compiled call writes back only the "
                "models, so the change would be made once when the function is traced, not at "
                "every call, and would hold the trace's values.",
                where=user_location(),
                fix=self._holder_fix(changed) or "decorate the object's class with "
                "@autostate.stateful (a change to a model's attributes is written back at "
                "every call), assign the model a new object, or keep such bookkeeping out "
                "of the compiled call.",
            ))
        lost = (
            "this call runs on a copy of f's model (its integer, bool and key arrays that are "
            "not states travel in the states dict and are put into a copy), so the change "
            "would be lost when the call returns, as under jax.jit/grad/vmap"
            if self.on_copy and not self.traced
            else "under jax.jit/grad/vmap that change would be lost when the call returns"
        )
        return StateAccessError(format_error(
            f"A functionalized call changed {type(self.model).__name__}'s attributes outside "
            f"its states{where}, e.g. by mutating a list or dict in place; {lost}.",
            fix="make the attribute state and assign a new value "
            "(`self.log = self.log + [x]`), or keep such bookkeeping out of the jitted call.",
        ))


def _check_states(states: dict[str, Any]) -> None:
    """Refuses new states holding a tracer of a ``lax`` body that has ended."""
    from autostate.lifetime import LostValue, holds_escaped_tracer  # (see check_write)

    for name, value in states.items():
        if holds_escaped_tracer(value):
            raise EscapedStateError(escaped_state_message(name, user_location()))
        if type(value) is LostValue:
            raise value.error()


def _dict_kept(d: dict[str, Any], before: dict[str, Any]) -> bool:
    """Whether ``d`` holds exactly the objects ``before`` (its copy) held."""
    return d.keys() == before.keys() and all(map(operator.is_, d.values(), before.values()))


def _check_attributes_kept(obj: Any, before: dict[str, Any], traced: bool) -> None:
    """Refuses a call that changed ``obj``'s ``__dict__`` behind its descriptors
    (``vars(self)["x"] = v``, a key added or removed): the states returned would
    miss it. A ``cached_property`` is cached or cleared as Python does, except
    a value computed under a trace, dropped afterwards."""
    d = obj.__dict__
    for name in [*before, *(k for k in d if k not in before)]:
        old, new = before.get(name, _ABSENT), d.get(name, _ABSENT)
        if old is new or (isinstance(old, StateSlot) and isinstance(new, StateSlot)):
            continue
        cached = getattr(type(obj), name, None)
        if isinstance(cached, functools.cached_property):
            # Filled, cleared (``del self.inv``, to recompute it after a
            # write) or both: the cache's own business.
            if traced and new is not _ABSENT:
                # Cached for this trace only: the value may be a tracer,
                # so the next call computes it again.
                del d[name]
            continue  # eagerly, cached in f's model as plain Python caches it
        change = "added" if old is _ABSENT else "removed" if new is _ABSENT else "replaced"
        raise StateAccessError(format_error(
            f"A functionalized call {change} {type(obj).__name__}.{name} in the instance "
            "__dict__ directly (`vars(self)[...] = v`, `self.__dict__.update(...)`), "
            "bypassing its state: the states the call returns would not have the change.",
            fix=f"assign the attribute (`self.{name} = v`), which autostate threads as state, "
            "or make that change outside the functionalized call.",
        ))


def _changed_in_graph(before: tuple, after: tuple) -> list[str] | None:
    """``Class.attr`` (or the leaf's path) of what differs between two flattens
    of a model (``tree.flatten_graph``); None when nothing does."""
    (old_leaves, old_def), (new_leaves, new_def) = before, after
    if old_def == new_def:
        changed = [name for name, a, b in zip(new_def.names, old_leaves, new_leaves) if a is not b]
        return changed or None
    changed = []
    for (cls, old_entries), (_, new_entries) in zip(old_def.instances, new_def.instances):
        old_by_name = {entry[0]: entry[1:] for entry in old_entries}
        new_by_name = {entry[0]: entry[1:] for entry in new_entries}
        for name in [*old_by_name, *(k for k in new_by_name if k not in old_by_name)]:
            if not _same_entry(old_by_name.get(name), new_by_name.get(name)):
                changed.append(f"{cls.__name__}.{name}")
    return changed


def _same_entry(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    try:
        return all(x is y or (type(x) is type(y) and bool(x == y)) for x, y in zip(a, b))
    except Exception:  # noqa: BLE001 - an uncomparable value is a change
        return False


# --- refusing as it happens: the setattr guard ------------------------------------


# id -> the refusal of an attribute write, for objects that stand for another's
# data (a layer of a stack, ``autostate.stacks``): a write to an attribute
# that is not state would change the stand-in alone, where plain Python
# changes the one object. Dropped when the object is.
_VIEWS: dict[int, Callable[[Any, str], AutostateError]] = {}


def register_view(obj: Any, refusal: Callable[[Any, str], AutostateError]) -> None:
    """Refuses every write to an attribute of ``obj`` that is not state, with
    ``refusal(obj, name)``, for as long as ``obj`` lives."""
    key = id(obj)
    _VIEWS[key] = refusal
    weakref.finalize(obj, _VIEWS.pop, key, None)


def check_write(obj: Any, name: str, value: Any = _ABSENT) -> None:
    """The setattr guard: refuses a write to ``obj.name`` that cannot be a state write.

    Inside a functionalized call the model is ``f``'s own copy, so such a write
    would be lost or keep a tracer, whatever analysis saw. An eager model is
    guarded while a lax body that reaches it runs: a traced value in a plain
    attribute would stay a tracer. The refusal is recorded
    (``errors.refused``), so catching it does not hide it."""
    if _VIEWS and id(obj) in _VIEWS and not _state_or_descriptor(obj, name):
        raise refused(_VIEWS[id(obj)](obj, name))
    if not is_guarded(obj):
        if value is not _ABSENT:
            what = lax_body_of(obj)
            if what is not None:
                # (``lifetime``'s tracer questions stand on the slots a guard
                # sees, so they are the layer above: imported when asked.)
                from autostate.lifetime import contains_tracer

                if contains_tracer(value):
                    _check_lax_body_write(obj, name, what)
            elif isinstance(value, jax.core.Tracer):
                # (One array: the parameter a PyTorch-style optimizer steps.
                # Containers are not walked here: a model may hold itself.)
                _check_concrete_kept(obj, name, value)
        return
    if _state_or_descriptor(obj, name):
        return
    if value is not _ABSENT and _graph.holds_instance(value):
        refuse_submodel_swap(obj, name)  # (no declaration makes a sub-model state)
    raise refused(StateAccessError(format_error(
        f"{type(obj).__name__}.{name} is not state, so assigning it inside a functionalized "
        "call would be lost when the call returns (or leave a JAX tracer in the model).",
        where=user_location(),
        fix=f"make it state: declare it in __init__ with `self.{name} = "
        f"autostate.state(...)` (or assign `self.{name}` in a method of the class), or "
        "assign it outside the functionalized call.",
    )))


def _state_or_descriptor(obj: Any, name: str) -> bool:
    """Whether writing ``obj.name`` is a state write, or goes through a property
    or other data descriptor (whose setter decides): what the guard lets pass."""
    return name in _tree.info_of(obj).state or hasattr(
        type(getattr(type(obj), name, None)), "__set__"
    )


def _check_concrete_kept(obj: Any, name: str, value: Any) -> None:
    """A traced value assigned over a concrete array in a plain attribute of a
    model made outside the trace (``model.w = model.w - lr * g`` under
    ``jax.jit``): the model would keep the tracer."""
    old = obj.__dict__.get(name, _ABSENT)
    if isinstance(old, jax.core.Tracer):
        # A model living in a trace (the copy autostate.jit traces): a value of
        # a transformation applied inside it (a jax.lax branch of a plain
        # function, jax.vmap) would outlive that transformation.
        from autostate.lifetime import check_not_traced, trace_of  # (see check_write)

        check_not_traced(value, f"{type(obj).__name__}.{name}", trace_of(old))
        return
    # (A concrete jax array, under jax.jit: made outside it, where a model
    # built inside holds its tracers. Nothing else says the model is older;
    # under grad or vmap alone an array made inside may be concrete.)
    if not isinstance(old, jax.Array):
        return
    from autostate.lifetime import under_staging_trace  # (see check_write)

    if not under_staging_trace():
        return
    raise refused(TracedEagerStateError(format_error(
        f"{type(obj).__name__}.{name} (not a state) held a concrete array and is assigned "
        "a JAX tracer: the model was made outside the running jax.jit/grad/vmap trace, "
        "so it would keep a value that only exists inside that trace.",
        where=user_location(),
        fix="compile the step with `autostate.jit` instead of jax.jit (it threads the "
        "model's arrays and writes them back), return the new value from the transformed "
        "function and assign it outside, or make the model part of what is functionalized "
        "(an attribute of the model whose f is called, or its own "
        "`f, states = model.functionalize()`).",
    )))


def _check_lax_body_write(obj: Any, name: str, what: str) -> None:
    if _state_or_descriptor(obj, name):
        return
    raise refused(StateAccessError(format_error(
        f"{type(obj).__name__}.{name} is not state, so a traced value assigned to it "
        f"inside {what} would stay in the model as a JAX tracer; plain Python's loop "
        "would have changed it every step.",
        fix=f"make it state: assign `self.{name} = ...` in a method of the class (the "
        "decorator does not see a name computed at run time, as in setattr(self, name, "
        "v), or an assignment in a helper outside the class), or declare it in __init__ "
        f"with `self.{name} = autostate.state(...)`; or assign it outside the lax call.",
    )))


def check_structure_change(obj: Any, name: str, value: Any, handled: bool) -> None:
    """A sub-model assigned to ``obj.name``, or one it held replaced
    (``self.cur = self.b``, ``for self.cur in self.layers``): plain Python's
    rebinding eagerly and at an object boundary (DESIGN.md section 8), where
    the call writes it back; refused in ``f`` and in a traced body
    (``handled``: ``obj.name`` is a running call's state)."""
    if at_object_boundary(obj):
        what = lax_body_of(obj)
        if what is None:
            return  # (a compiled call's copy: every instance it holds is flattened out)
        rebound = _REBOUND.get()
        if rebound is not None:
            rebound.setdefault((id(obj), name), (obj, name, obj.__dict__.get(name)))
        # A jax.jit inside a method runs on the models themselves: a sub-model
        # it did not reach when it started, built or changed inside, would
        # keep the values of its trace.
        marked = _IN_LAX_BODY.get()[0]
        for held in _graph.instances_of(value):
            if id(held) not in marked and _holds_own_tracer(held):
                raise refused(StateAccessError(format_error(
                    f"{type(obj).__name__}.{name} is assigned a {type(held).__name__} made "
                    f"inside {what} inside a method (built there, or a layer taken from a "
                    "stack there): the call runs on the model itself and writes back the "
                    "states of the models it reached when it started, so the new sub-model "
                    "would keep values of the trace.",
                    where=user_location(),
                    fix=f"make the sub-model before the jax.jit call and assign `self.{name}` "
                    "inside it, keep a stack's layer in a local (`for block in self.blocks`), "
                    "or compile the whole step with autostate.jit (whose models live in the "
                    "trace and are written back, new sub-models included).",
                )))
        return
    if handled or is_guarded(obj) or lax_body_of(obj):
        refuse_submodel_swap(obj, name)


def _holds_own_tracer(obj: Any) -> bool:
    """Whether ``obj`` holds a JAX tracer itself: a sub-model it holds
    answers for its own, and a layer view's states are its stack's."""
    from autostate.lifetime import contains_tracer  # (see check_write)

    for value in obj.__dict__.values():
        if isinstance(value, StateSlot):
            if value.part_of() is None and contains_tracer(value.read()):
                return True
        elif not _graph.holds_instance(value) and contains_tracer(value):
            return True
    return False


def refuse_submodel_swap(obj: Any, name: str) -> None:
    """Refuses adding, replacing or dropping a sub-model of ``obj`` inside a
    functionalized call (or the traced body of an eager model's lax call)."""
    what = lax_body_of(obj)
    if what is not None and not is_guarded(obj):
        raise refused(StateAccessError(format_error(
            f"{type(obj).__name__}.{name} would hold a new sub-model (a @stateful "
            f"instance, or a method bound to one) assigned inside {what}; JAX traces "
            "that body instead of running it per step, so the sub-model would be built "
            "from traced values and outlive the trace, or be lost when the call returns.",
            where=user_location(),
            fix=f"assign `self.{name}` before the lax call (`if self.{name} is None: "
            f"self.{name} = ...` above it) and use it inside the body; to reset the "
            f"sub-model inside the body, assign its states instead (`self.{name}.x = ...`).",
        )))
    raise refused(StateAccessError(format_error(
        f"{type(obj).__name__}.{name} holds (or would hold) a sub-model, a @stateful "
        "instance (or a method bound to one, or a functools.partial, generator or map "
        "reaching one); assigning it inside a functionalized call "
        "would change the model's structure, so the states f takes and returns would no "
        "longer match the model.",
        where=user_location(),
        fix=f"assign `{name}` on the model itself, outside f (for example call the "
        "method eagerly: `model.reset()`), then call `model.functionalize()` again; "
        f"to reset the sub-model inside the call, assign its states instead "
        f"(`self.{name}.x = ...`); to run it with other weights inside the call (a target "
        "network's copy, merged adapters), keep them in a state "
        f"(`self.{name}_params = autostate.param_dict(...)`) and build the model from them "
        f"where it is used (`autostate.load_param_dict(self.{name}, "
        f"self.{name}_params)(x)`).",
    )))


# --- JAX's error about a traced value, explained ------------------------------------


def traced_numbers(states: Iterable[tuple[str, Any]]) -> list[str]:
    """The names of the states traced as weakly typed scalars: those that
    held Python numbers (``self.rate = 0.5``)."""
    found = []
    for name, value in states:
        if isinstance(value, jax.core.Tracer):
            aval = getattr(value, "aval", None)
            if getattr(aval, "weak_type", False) and not getattr(aval, "shape", ()):
                found.append(name)
    return found


_CONCRETE_NEEDED = (
    jax.errors.ConcretizationTypeError,  # and TracerBoolConversionError
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
)


def explain_traced_value(
    raised: BaseException, where_traced: str, numbers: Sequence[str] = ()
) -> TracedValueError | None:
    """JAX's error for a traced value used where Python needs a concrete one, as a
    ``TracedValueError`` (of the same JAX type) saying why it is traced and
    what to write instead; None for another error. ``numbers``: the states
    holding Python numbers."""
    if isinstance(raised, AutostateError) or not isinstance(raised, _CONCRETE_NEEDED):
        return None
    what = f"A traced value is used where Python needs a concrete one, in {where_traced}."
    if numbers:
        shown = ", ".join(repr(name) for name in numbers)
        what += (
            f" The state{'s' if len(numbers) > 1 else ''} {shown} "
            f"{'hold Python numbers' if len(numbers) > 1 else 'holds a Python number'} (or a "
            "weakly typed scalar), traced like an array: a state (an attribute a method "
            "assigns) is a leaf of `states`, so that it can take traced values."
        )
    jax_lines = []
    for line in str(raised).strip().splitlines():
        if line.startswith("See https://"):
            break
        jax_lines.append(f"    {line}")
    message = format_error(
        what,
        where=user_location(raised.__traceback__),
        fix="branch on a traced value with jnp.where or jax.lax.cond (switch, while_loop) "
        "instead of `if`/`while`, and compute with jnp instead of math or numpy; keep a "
        "setting Python must read (a flag, a mode) as a bool, int or str, which autostate "
        "keeps static (one compilation per value), or pass it as a static argument.",
    )
    return traced_value_error(raised, "\n".join([message, "  JAX's error:", *jax_lines]))
