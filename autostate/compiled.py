"""Compiled calls that update models in place: ``autostate.jit``.

``autostate.jit(fn)(model, batch)`` runs ``fn`` as one compiled program and
leaves the model as the plain call ``fn(model, batch)`` would: its
parameters, states and static config (``model.eval()`` inside) changed in
place, sub-models and shared instances the same Python objects.

How one call goes:

1. the decorated instances among the arguments (at any depth of their
   pytrees) are flattened with the one walk (``graph.flatten_graph``), each
   instance once: their arrays are the leaves, everything else (classes,
   static config, the way instances hold one another) is the graphdef;
2. the compiled program (one ``jax.jit`` per graphdef: one compile per
   structure and mode) rebuilds copies of the instances from the leaves,
   living in its trace, runs ``fn`` on them, and flattens them again: the new
   leaves are its output, and the new graphdef (with which copy each
   instance is) is kept with the trace;
3. the new graphdef and leaves are written back into the same Python
   objects (``graph.rebuild_instances(..., into=...)``); an attribute whose
   small arrays changed gets a lazy value instead (``packing.LazyValue``,
   ``LazyState``) of the call's packed output buffers (``PackedValues``),
   made on the first eager read. The next call on the same models, when
   nothing changed them, passes those buffers on as they are and only
   swaps the ones the lazy values read (``PackedValues.renew``).

The model's old buffers are donated to the program; lazy values that a call
does not pass on are made for good first (``_release``). When ``fn`` raises,
nothing is written back: the models keep their values from before the call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Generic, ParamSpec, TypeVar, overload

import jax
import numpy as np
from jax._src import api_util as _api_util
from jax._src import traceback_util as _traceback_util

from autostate import graph as _graph
from autostate import tree as _tree
from autostate import values as _values
from autostate.effects.local_state import (
    FrozenLocalStateRequest,
    StateSlot,
    handler_running,
    running_cells,
)
from autostate.errors import (
    InvalidArgumentError,
    InvalidTypeError,
    StateAccessError,
    TracedEagerStateError,
    format_error,
    user_location,
)
from autostate.graph import Witness
from autostate.guard import Guard, object_boundary
from autostate.hidden import hidden_model_error
from autostate.lifetime import current_trace, held_tracers, under_staging_trace, with_home
from autostate.lifting.core import own_states, with_states_handled
from autostate.packing import (
    Layout,
    LazyState,
    LazyValue,
    PackedValues,
    lazy_attribute_allowed,
)
from autostate.state_values import StaticState
from autostate.tree import StaticLeaf

__all__ = ["Compiled", "jit"]

P = ParamSpec("P")
R = TypeVar("R")

# JAX's traceback filter (at ``jax.jit`` and at ``Compiled.__call__``) hides
# autostate's own frames, as it hides JAX's: an error raised inside a
# compiled function shows the user's lines, and JAX_TRACEBACK_FILTERING=off
# shows every frame. The layers (``autostate.nn``) are code a user reads, and
# stay.
_PACKAGE = os.path.dirname(os.path.abspath(__file__))
for _name in sorted(os.listdir(_PACKAGE)):
    _path = os.path.join(_PACKAGE, _name)
    if _name != "nn" and (_name.endswith(".py") or os.path.isfile(os.path.join(_path, "__init__.py"))):
        _traceback_util.register_exclusion(_path)

# Calls of compiled functions, one at a time: a call reads its models, runs,
# and writes them back; two threads interleaving those steps on one model
# would each write back what the other never saw.
_CALLS = threading.RLock()


class _Models:
    """The root the flatten walks: the models among a call's arguments."""

    def __init__(self, models: list[Any]):
        self.models = models


# Arrays of at most this many bytes, on one device, travel packed: one buffer
# per dtype in, one out. A step's dispatch cost is per buffer, and a model of
# many small arrays (biases, norm scales, counters) pays it per array; a big
# array's cost is its arithmetic. The packed buffers are kept between calls
# (a copy of the small arrays, next to the model's own).
_SMALL = 1 << 14


class _Key:
    """What one compiled program is for: hashed and compared by JAX's cache."""

    __slots__ = ("graphdef", "treedef", "where", "statics", "named", "shapes", "layout",
                 "packs", "shardings", "loose", "_hash")

    def __init__(
        self, graphdef: Any, treedef: Any, where: tuple[int, ...], statics: tuple,
        named: tuple, shapes: tuple, layout: Layout, packs: bool, shardings: tuple = (),
    ):
        self.graphdef = graphdef
        self.treedef = treedef
        self.where = where  # positions of the models among the flat arguments
        self.statics = statics  # (position, value) of each static argument
        self.named = named  # (name, value) of each static argument given by keyword
        # Every array's shape and dtype: JAX traces once per shapes, and what
        # the function leaves in the models (a Python value read from a
        # shape) is that trace's.
        self.shapes = shapes
        self.layout = layout  # which leaves travel packed, where
        self.packs = packs  # whether small arrays are packed (all on one device)
        # Across devices: each array's sharding, which its new value keeps.
        self.shardings = shardings
        self.loose = tuple(j for j, slot in enumerate(layout.slots) if slot is None)
        self._hash = hash((graphdef, treedef, where, statics, named, shapes, layout, shardings))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (
            type(other) is _Key
            and self._hash == other._hash
            and self.graphdef == other.graphdef
            and self.treedef == other.treedef
            and self.where == other.where
            and self.statics == other.statics
            and self.named == other.named
            and self.shapes == other.shapes
            and self.layout == other.layout
            and self.packs == other.packs
            and self.shardings == other.shardings
        )


class _Entry:
    """What a call left on its models, for the next call on the same models:
    the flatten (valid while ``witness`` says nothing changed), the packed
    buffers of its small arrays, and what its lazy attributes read them by."""

    __slots__ = ("key", "leaves", "buffers", "objects", "witness", "holder", "made_by")

    def __init__(
        self, key: _Key, leaves: list, buffers: list, objects: list, witness: Witness | None,
        holder: PackedValues | None = None, made_by: _After | None = None,
    ):
        self.key = key
        self.leaves = leaves  # (``_IN_BUFFERS`` for an array only lazy attributes hold)
        self.buffers = buffers
        self.objects = objects
        self.witness = witness
        # The ``PackedValues`` of the models' lazy attributes (whose buffers
        # are ``buffers``), and the call's ``_After`` that made them.
        self.holder = holder
        self.made_by = made_by


@dataclasses.dataclass(slots=True)
class _After:
    """What one trace of the program left, for every call of it: how to write
    its results back, and the next call's key."""

    graphdef: Any  # the models after the call, with every instance it started with
    origin: list[int | None]  # per instance of ``graphdef``: its index before the call
    rebound: frozenset  # (index before the call, attribute) the function rebound
    sources: list[int | None]  # per leaf: the unchanged packed leaf it is, or an output
    next_key: _Key  # the next call's key, on the models as the call leaves them
    fresh_leaves: list[int]  # the next call's leaves, as indices into ``graphdef``'s
    fresh_objects: list[int]  # the next call's instances, likewise
    steady: bool  # the same structure after as before: only ``touched`` is rewritten
    touched: list[tuple[int, int]]  # (instance, attribute) indices to rewrite
    # (instance, name) of each rewritten attribute whose container object is
    # kept (``_kept``: a list the call changed stays the same list)
    kept: frozenset = frozenset()
    # ``touched`` as the witness names them: (instance index among the
    # models', attribute name); the walk's root, instance 0, is not witnessed.
    patched: tuple[tuple[int, str], ...] = ()
    inputs: int = 0  # how many leaves the call started with
    # The attributes left in the packed buffers (``_lazy_plan``): each
    # ``(instance, name, state, index, build)``, the packed slots of their
    # arrays, and the new leaves only they hold (no output of the program).
    lazy: tuple = ()
    lazy_at: tuple[int, ...] = ()
    lazy_only: frozenset[int] = frozenset()
    # ``touched`` but for the lazy attributes; and of those, what a call that
    # keeps the last one's lazy values rewrites, with its ``patched``.
    eager: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    renewed: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    renewed_patched: tuple[tuple[int, str], ...] = ()
    # The gathers of a call, made once: each new leaf's index in the old
    # leaves followed by the outputs and ``_IN_BUFFERS`` (``sources``), and
    # each of the next call's leaves' in the new (``None``: the new leaves as
    # they are).
    merge: tuple[int, ...] = dataclasses.field(init=False)
    fresh: tuple[int, ...] | None = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        count = sum(j is None and i not in self.lazy_only for i, j in enumerate(self.sources))
        outputs = iter(range(self.inputs, self.inputs + count))
        in_buffers = self.inputs + count
        self.merge = tuple(
            in_buffers if i in self.lazy_only else next(outputs) if j is None else j
            for i, j in enumerate(self.sources)
        )
        identity = self.fresh_leaves == list(range(len(self.sources)))
        self.fresh = None if identity else tuple(self.fresh_leaves)


class Compiled(Generic[P, R]):
    """A function compiled by ``autostate.jit``: call it as the function.

    ``lower(*args)`` lowers the program one call with these arguments runs
    (its inputs are the models' arrays in an internal layout: use it to read
    the compiled program, its cost and memory; export a model with
    ``autostate.export``).

    Examples:
        >>> @autostate.stateful
        ... class Counter:
        ...     def __init__(self):
        ...         self.n = jnp.zeros((), jnp.int32)
        ...
        ...     def tick(self):
        ...         self.n += 1
        ...         return self.n
        >>> counter = Counter()
        >>> tick = autostate.jit(counter.tick)  # a method: the model is its first argument
        >>> isinstance(tick, autostate.Compiled), int(tick()), int(tick()), int(counter.n)
        (True, 1, 2, 2)
        >>> tick.lower().compile().memory_analysis() is not None
        True
    """

    def __init__(self, fn: Callable[P, R], options: dict[str, Any]):
        self._self: Any = None
        if not callable(fn):
            raise InvalidTypeError(format_error(
                f"autostate.jit compiles a function, got {type(fn).__name__} {fn!r}.",
                fix="pass the function (`autostate.jit(step)`, or `@autostate.jit` above "
                "its def), a model's method (`autostate.jit(model.step)`) or a model.",
            ))
        if _graph.is_stateful_instance(fn):  # ``autostate.jit(model)``: its ``__call__``
            fn = types.MethodType(type(fn).__call__, fn)
        if isinstance(fn, types.MethodType) and _graph.is_stateful_instance(fn.__self__):
            # ``autostate.jit(model.step)``: the model is the first argument.
            self._self, fn = fn.__self__, fn.__func__
        self.fn = fn
        static = options.pop("static_argnums", ())
        self._static = (static,) if isinstance(static, int) else tuple(static)
        if self._self is not None:  # (numbered as the bound method's: the model comes first)
            self._static = tuple(i + 1 if i >= 0 else i for i in self._static)
        names = options.pop("static_argnames", ())
        self._static_names = {names} if isinstance(names, str) else set(names)
        with contextlib.suppress(TypeError, ValueError):  # (no signature: positions only)
            params = list(inspect.signature(fn).parameters.values())
            for i in self._static:
                if -len(params) <= i < len(params) and params[i].kind in (
                    params[i].POSITIONAL_OR_KEYWORD, params[i].KEYWORD_ONLY
                ):
                    self._static_names.add(params[i].name)
        donate = options.pop("donate_models", True)
        for name in ("donate_argnums", "donate_argnames"):
            if name in options:
                raise InvalidArgumentError(
                    format_error(
                        f"autostate.jit does not take {name}.",
                        where=user_location(),
                        fix="the models' arrays are donated (donate_models=False keeps "
                        "them).",
                    )
                )
        # (key, shapes of the other arguments) -> what its trace left
        self._after: dict[tuple, _After] = {}
        # The last calls' models (by the arguments' structure and the models'
        # identities) -> what the call left on them.
        self._entries: dict[tuple, _Entry] = {}
        self._watched: set[tuple] = set()  # (model id, cache id) with a finalizer
        # What the call being traced was given, for the names JAX's errors print.
        # (args, kwargs, key, how many arrays the program takes)
        self._tracing: tuple[tuple, dict, _Key, int] | None = None
        program = _Program(self)
        # A call made while a functionalized call runs (a method of ``f``'s
        # model calls it) is a ``jax.jit`` inside a method: the one ``jit``
        # that threads the running states (``lifting.jit``), made on first use.
        self._in_call_options = {
            **options, "static_argnums": self._static, "static_argnames": tuple(self._static_names)
        }
        self._in_call: Callable[..., Any] | None = None
        self._jitted = jax.jit(
            program, static_argnums=(0,), donate_argnums=(1, 2) if donate else (), **options
        )
        # (For a call whose other arguments hold one of the models' arrays,
        # which XLA cannot take donated and passed at once.)
        self._kept_jitted = (
            jax.jit(program, static_argnums=(0,), donate_argnums=(1,), **options)
            if donate else None
        )
        functools.update_wrapper(self, fn)

    @_traceback_util.api_boundary
    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        if self._self is not None:
            args = (self._self, *args)  # type: ignore[assignment]
        if under_staging_trace():
            return self.fn(*args, **kwargs)  # (see _call)
        if handler_running() and running_cells():
            if self._in_call is None:
                from autostate.lifting.jit import jit as _jit_in_method  # (above this module)

                self._in_call = _jit_in_method(self.fn, **self._in_call_options)
            return self._in_call(*args, **kwargs)
        with _CALLS:
            return self._call(args, kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """The program a call with these arguments runs, lowered (``jax.jit``'s ``Lowered``).

        Its arguments are the models' arrays in the call's internal layout:
        read it (``.as_text()``, ``.compile().memory_analysis()``), do not
        call it.
        """
        if self._self is not None:
            args = (self._self, *args)
        with _CALLS:
            call = self._arguments(args, kwargs)
            entry = None if call is None else self._flattened(*call[:5])
            if call is None or entry is None:
                raise InvalidArgumentError(
                    format_error(
                        "Compiled.lower was given traced arguments.",
                        where=user_location(),
                        fix="lower with concrete arrays, outside any transformation.",
                    )
                )
            others = call[5]
            shapes = tuple(_shape_of(x) for x in others)
            loose = [entry.leaves[j] for j in entry.key.loose]
            self._tracing = (args, kwargs, entry.key, len(entry.buffers) + len(loose) + len(others))
            try:
                return self._jitted.lower((entry.key, shapes), entry.buffers, loose, others)
            finally:
                self._tracing = None

    def _arguments(self, args: tuple, kwargs: dict) -> tuple | None:
        """``(models, treedef, where, statics, named, others, kwargs)`` of a
        call, or ``None`` when an argument is traced."""
        statics = tuple((i, args[i]) for i in self._static if -len(args) <= i < len(args))
        static_at = {i % len(args) for i, _ in statics}
        dynamic = tuple(a for i, a in enumerate(args) if i not in static_at)
        named = tuple(sorted((k, v) for k, v in kwargs.items() if k in self._static_names))
        if named:
            kwargs = {k: v for k, v in kwargs.items() if k not in self._static_names}
        if statics or named:
            _check_static(statics, named)
        flat, treedef = jax.tree_util.tree_flatten(
            (dynamic, kwargs), is_leaf=_graph.is_stateful_instance
        )
        where = tuple(i for i, x in enumerate(flat) if _graph.is_stateful_instance(x))
        taken = set(where)
        others = [x for i, x in enumerate(flat) if i not in taken]
        if any(isinstance(x, jax.core.Tracer) for x in others):
            return None
        return [flat[i] for i in where], treedef, where, statics, named, others

    def _flattened(
        self, models: list, treedef: Any, where: tuple, statics: tuple, named: tuple
    ) -> _Entry | None:
        """The models flattened by the one walk, their small arrays packed
        (``None`` when one of their arrays is traced)."""
        objects: list[Any] = []
        leaves, graphdef = _graph.flatten_graph(_Models(models), objects)
        if any(isinstance(x, jax.core.Tracer) for x in leaves):
            return None
        _check_concrete(leaves, graphdef)
        for obj in objects:
            for value in obj.__dict__.values():
                if isinstance(value, StateSlot) and value.part_of() is not None:
                    # (A layer of a stack: its states are a part of the stack's,
                    # which the program would not hold. The slot says why.)
                    value.as_request()
        packs = _one_device(leaves)
        layout = Layout.of(leaves, None, _small if packs else _never)
        shardings = () if packs else tuple(getattr(x, "sharding", None) for x in leaves)
        key = _Key(graphdef, treedef, where, statics, named,
                   tuple(_shape_of(x) for x in leaves), layout, packs, shardings)
        buffers = _packer(layout)(leaves) if layout.dtypes else []
        return _Entry(key, leaves, buffers, objects, None)

    def _call(self, args: tuple, kwargs: dict) -> Any:
        call = self._arguments(args, kwargs)
        if call is None:
            # Inside a transformation (JAX would inline a nested jit): the
            # function runs as it is, under that transformation's rules.
            return self.fn(*args, **kwargs)
        models, treedef, where, statics, named, others = call
        cache_id = (treedef, where, statics, named, *[id(m) for m in models])
        entry = self._kept_entry(cache_id)
        if entry is not None:
            _check_alive(entry, entry.key.loose)  # (the small ones travel in the kept buffers)
        else:
            entry = self._flattened(models, treedef, where, statics, named)
            if entry is None:
                return self.fn(*args, **kwargs)
            _check_alive(entry, range(len(entry.leaves)))
        key = entry.key
        shapes = tuple(_shape_of(x) for x in others)
        loose = list(map(entry.leaves.__getitem__, key.loose))
        jitted = self._jitted
        if self._kept_jitted is not None and others and loose:
            held_ids = {id(x) for x in loose}
            if any(id(x) in held_ids for x in others):
                jitted = self._kept_jitted
        after = self._after.get((key, shapes))
        holder = entry.holder
        if holder is not None and not (after is not None and after.steady
                                       and after is entry.made_by):
            # Another program than the one that left the lazy values: they are
            # made for good before their buffers are donated.
            _release(entry)
            holder = None
        if after is not None:
            out, buffers, changed = jitted((key, shapes), entry.buffers, loose, others)
        else:
            self._tracing = (args, kwargs, key, len(entry.buffers) + len(loose) + len(others))
            try:
                with warnings.catch_warnings():
                    # (Where the call changes the models' structure, the old buffers
                    # cannot all be reused; donating them is this module's choice.)
                    warnings.filterwarnings("ignore", "Some donated buffers were not usable")
                    out, buffers, changed = jitted((key, shapes), entry.buffers, loose, others)
            finally:
                self._tracing = None
            after = self._after[(key, shapes)]
        objs = entry.objects
        witness = entry.witness if after.steady else None
        if holder is not None:
            # The models hold this program's lazy values of ``holder``, as the
            # last call left them: they now stand for this call's buffers.
            holder.renew(buffers)
            fresh = entry.leaves
            if after.renewed:
                new_leaves = list(map([*entry.leaves, *changed, _IN_BUFFERS].__getitem__,
                                      after.merge))
                self._rewrite(after, after.renewed, new_leaves, objs)
                if witness is not None and not witness.patch(after.renewed_patched):
                    witness = None
                fresh = new_leaves if after.fresh is None else list(
                    map(new_leaves.__getitem__, after.fresh))
        else:
            if after.lazy:
                holder = PackedValues(after.next_key.layout, after.lazy_at, buffers, _CALLS)
            new_leaves = list(map([*entry.leaves, *changed, _IN_BUFFERS].__getitem__,
                                  after.merge))
            if after.steady:
                self._rewrite(after, after.eager, new_leaves, objs)
                if holder is not None:
                    _lazy_values(after.lazy, holder, objs)
                # The same instances and structure: what the last call's witness saw
                # stands but for the attributes rewritten (instance 0 is the walk's root).
                if witness is not None and not witness.patch(after.patched):
                    witness = None
            else:
                targets = [None if i is None else entry.objects[i] for i in after.origin]
                held = [None if obj is None else dict(obj.__dict__) for obj in targets]
                objs = _graph.rebuild_instances(after.graphdef, new_leaves, targets)
                for k, (obj, before) in enumerate(zip(targets, held)):
                    if before:
                        d = obj.__dict__
                        for name, value in d.items():
                            if name in before and (after.origin[k], name) not in after.rebound:
                                d[name] = _kept(before[name], value)
                if holder is not None:
                    _lazy_values(after.lazy, holder, objs)
                objs = [objs[i] for i in after.fresh_objects]
            fresh = new_leaves if after.fresh is None else list(
                map(new_leaves.__getitem__, after.fresh))
        objs[0].__dict__["models"] = []  # (the root of the walk holds no model between calls)
        self._keep(cache_id, models, _Entry(after.next_key, fresh, buffers, objs, witness,
                                            holder, after if holder is not None else None))
        return out

    @staticmethod
    def _rewrite(after: _After, at: list[tuple[int, int]], leaves: list, objs: list) -> None:
        """Rewrites the attributes ``at`` of ``objs`` (the same structure as
        before the call) from the new ``leaves``, keeping the containers ``after`` says."""
        rewritten = _graph.rewrite_attributes(after.graphdef, leaves, objs, at)
        if after.kept:
            for i, name, before in rewritten:
                if (i, name) in after.kept:
                    d = objs[i].__dict__
                    d[name] = _kept(before, d[name])

    def _keep(self, cache_id: tuple, models: list, entry: _Entry) -> None:
        """Keeps what a call left for the next one on the same models, holding
        the models' instances weakly, in its witness (a model deleted is
        forgotten); the witness is made where the call did not bring one up
        to date."""
        if entry.witness is None:
            entry.witness = Witness.of(entry.objects[1:])
        if entry.witness is None:
            return
        entry.objects = entry.objects[:1]  # (the walk's root; the witness has the rest)
        try:
            for model in models:
                if (id(model), cache_id) not in self._watched:
                    self._watched.add((id(model), cache_id))
                    weakref.finalize(model, _forget, weakref.ref(self), id(model), cache_id)
        except TypeError:  # (an instance that takes no weak reference)
            return
        if len(self._entries) >= _ENTRIES:
            self._entries.pop(next(iter(self._entries)))
        self._entries[cache_id] = entry

    def _kept_entry(self, cache_id: tuple) -> _Entry | None:
        """What the last call on these models left, if nothing changed them since."""
        kept = self._entries.pop(cache_id, None)
        if kept is None or kept.witness is None:
            return None
        objects = kept.witness.instances()
        if objects is None:
            return None
        kept.objects = [kept.objects[0], *objects]
        return kept

    def _pure(
        self, key_shapes: tuple, buffers: list[Any], loose: list[Any], others: list[Any]
    ) -> tuple[Any, list[Any], list[Any]]:
        """The compiled program: ``fn`` on copies of the models, living in this trace."""
        key = key_shapes[0]
        leaves = key.layout.unpack(buffers, loose)
        copies = _graph.rebuild_instances(key.graphdef, leaves)
        home = current_trace()
        for obj in copies:
            d = obj.__dict__
            for attr, value in list(d.items()):
                if type(value) is StaticState:
                    # (The graphdef's own slot, shared by every call: the copy
                    # gets one of its own, so that a static state given a
                    # traced value, `self.correct = 0` then `self.correct +=
                    # (y == t).sum()`, becomes an array state as eagerly.)
                    d[attr] = with_home(dataclasses.replace(value), home)
                elif isinstance(value, StateSlot) and hasattr(value, "_home"):
                    with_home(value, home)
        started = [dict(obj.__dict__) for obj in copies]
        root = copies[key.graphdef.root]
        flat = list(others)
        for position, model in zip(key.where, root.models):
            flat.insert(position, model)
        dynamic, kwargs = jax.tree_util.tree_unflatten(key.treedef, flat)
        kwargs = {**kwargs, **dict(key.named)}
        args = list(dynamic)
        for i, value in sorted((i % (len(args) + len(key.statics)), v) for i, v in key.statics):
            args.insert(i, value)
        _check_reached(self.fn, copies)
        _check_static_models(key.statics, key.named)
        # The one lift (``lifting.core``): the copies' states are a handler's
        # cells while ``fn`` runs, as a functionalized call's and an eager
        # model's in a lax body are, and the states it assigned are written back.
        models = [c for c in copies if c is not root]
        swapped, _ = own_states(models)
        # (A placeholder None stays the copy's own, as a static state does: at
        # this object boundary it may become static, `self.mode = "fast"`, as
        # eagerly, where a handler's cell refuses a Python value.)
        swapped = [entry for entry in swapped if entry[2].read() is not None]
        try:
            # (An object boundary: a sub-model assigned is written back.)
            with Guard.for_compiled(models), object_boundary(models):
                out = with_states_handled(swapped, functools.partial(self.fn, *args, **kwargs))
        except TracedEagerStateError:
            # A model the copies reach where the graph does not (inside a plain
            # object): its refusal names the holder, where the tracer's
            # advises autostate.jit, the call running now.
            hidden = hidden_model_error(copies, "autostate.jit", "the compiled function")
            if hidden is None:
                raise
            raise hidden from None
        _check_plain_output(out)
        after, treedef = jax.tree_util.tree_flatten(
            (dynamic, {k: v for k, v in kwargs.items() if k not in dict(key.named)}),
            is_leaf=_graph.is_stateful_instance,
        )
        if treedef != key.treedef or any(a is not b for a, b in zip(after, flat)):
            raise InvalidArgumentError(
                format_error(
                    "A function compiled by autostate.jit changed a list, dict or other "
                    "container passed to it in place: the compiled program gets copies of "
                    "its arguments' containers, so the change would be lost.",
                    where=user_location(),
                    fix="return the new value from the function and assign it after the "
                    "call, or keep it in a model (a model passed in is updated in place).",
                )
            )
        # The models as the next call will find them.
        fresh_objects: list[Any] = []
        fresh_leaves, fresh_graphdef = _graph.flatten_graph(root, fresh_objects)
        swap = _keep_layouts(key, fresh_leaves, fresh_graphdef) if key.shardings else {}
        # Every instance the call started with is written back, the ones the
        # function detached (a sub-model replaced: the caller may hold it) too.
        root.__dict__["detached"] = [c for c in copies if c is not root]
        objects: list[Any] = []
        new_leaves, new_graphdef = _graph.flatten_graph(root, objects)
        del root.__dict__["detached"]
        _check_no_value_of_the_trace(new_graphdef, objects)
        if swap:
            fresh_leaves = [swap.get(id(x), x) for x in fresh_leaves]
            new_leaves = [swap.get(id(x), x) for x in new_leaves]
        index = {id(obj): i for i, obj in enumerate(copies)}
        origin = [index.get(id(obj)) for obj in objects]
        # The attributes the function rebound to another object: they are the
        # new one after the call, where one changed in place stays the same.
        rebound = frozenset(
            (i, name) for i, (obj, before) in enumerate(zip(copies, started))
            for name, value in obj.__dict__.items() if before.get(name, _UNSET) is not value
        )
        # Each new array: a packed one unchanged is the model's own (the
        # caller's array, not donated); any other is an output, or stays in the
        # next call's packed buffers where only lazy attributes hold it.
        packed_in = {id(x): j for j, x in enumerate(leaves) if key.layout.slots[j] is not None}
        sources = [packed_in.get(id(x)) for x in new_leaves]
        at = {id(x): i for i, x in enumerate(new_leaves)}
        at_object = {id(obj): i for i, obj in enumerate(objects)}
        next_layout = Layout.of(
            [jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=bool(getattr(x, "weak_type", False)))
             for x in fresh_leaves],
            None, _small if key.packs else _never,
        )
        # (What the function rebound, by instance and attribute of the new flatten.)
        rebound_at: set[tuple[int, int]] = set()
        for i, name in rebound:
            n = at_object.get(id(copies[i]))
            if n is not None:
                found = [k for k, entry in enumerate(new_graphdef.instances[n][1])
                         if entry[0] == name]
                rebound_at.update((n, k) for k in found)
        lazy, lazy_at, lazy_only = _lazy_plan(
            new_graphdef, objects, fresh_objects, new_leaves, sources, fresh_leaves, next_layout,
            rebound_at,
        )
        changed = [x for i, (x, j) in enumerate(zip(new_leaves, sources))
                   if j is None and i not in lazy_only]
        next_key = _Key(
            fresh_graphdef, key.treedef, key.where, key.statics, key.named,
            tuple(_shape_of(x) for x in fresh_leaves), next_layout, key.packs,
            key.shardings if next_layout == key.layout and fresh_graphdef == key.graphdef
            else (),
        )
        steady = (
            next_key == key
            and len(objects) == len(copies) == len(fresh_objects)
            and all(a is b for a, b in zip(objects, copies))
            and len(new_leaves) == len(fresh_leaves)
        )
        touched: list[tuple[int, int]] = []
        kept: set[tuple[int, str]] = set()
        if steady:
            next_key = key
            steps = _graph.leaf_attributes(key.graphdef)
            names = [
                {name: k for k, (name, *_) in enumerate(entries)}
                for _, entries in key.graphdef.instances
            ]
            touched = sorted(
                {at for i, j in enumerate(sources) if j != i for at in steps[i]}
                | {(i, names[i][name]) for i, name in rebound if name in names[i]}
            )
            # The rewritten attributes whose old container stays (see
            # ``_kept``): by type, which the structure fixes for every call.
            for i, k in touched:
                name = key.graphdef.instances[i][1][k][0]
                before, value = started[i].get(name), copies[i].__dict__.get(name)
                if ((i, name) not in rebound and type(before) is type(value)
                        and _values.kind_of(before).restore is not None):
                    kept.add((i, name))
        lazy_names = {(i, name) for i, name, *_ in lazy}
        eager = [(i, k) for i, k in touched
                 if (i, key.graphdef.instances[i][1][k][0]) not in lazy_names]
        # Of those, the ones a call after the first rewrites: an attribute
        # rebound to an immutable Python value (an optimizer's empty state)
        # holds the structure's own object since the first.
        renewed = [(i, k) for i, k in eager if not _static_entry(key.graphdef, i, k)]
        self._after[key_shapes] = _After(
            graphdef=new_graphdef,
            origin=origin,
            rebound=rebound,
            sources=sources,
            next_key=next_key,
            fresh_leaves=[at[id(x)] for x in fresh_leaves],
            fresh_objects=[at_object[id(obj)] for obj in fresh_objects],
            steady=steady,
            touched=touched,
            kept=frozenset(kept),
            patched=tuple((i - 1, key.graphdef.instances[i][1][k][0]) for i, k in touched if i),
            inputs=len(leaves),
            lazy=lazy,
            lazy_at=lazy_at,
            lazy_only=lazy_only,
            eager=eager,
            renewed=renewed,
            renewed_patched=tuple(
                (i - 1, key.graphdef.instances[i][1][k][0]) for i, k in renewed if i
            ),
        )
        if not next_layout.dtypes:
            new_buffers = []
        elif next_layout == key.layout and len(fresh_leaves) == len(leaves):
            # Only what changed is written into the (donated) buffers: those
            # of the parameters of a forward step are returned as they came.
            new_buffers = key.layout.repack(buffers, fresh_leaves, leaves)
        else:
            new_buffers = next_layout.pack(fresh_leaves)[0]
        return out, new_buffers, changed


def _lazy_plan(
    graphdef: Any, objects: list[Any], fresh_objects: list[Any], new_leaves: list[Any],
    sources: list[int | None], fresh_leaves: list[Any], layout: Layout,
    rebound: set[tuple[int, int]],
) -> tuple[tuple, tuple[int, ...], frozenset[int]]:
    """Which attributes the call changed (or ``rebound``) stay in its packed buffers after it
    (``(lazy, at, only)``): each ``(instance, name, state, index, build)``
    of ``lazy`` gets a lazy value of the call's ``PackedValues`` (a state a
    ``LazyState``, any other attribute a ``LazyValue``: ``index`` of one
    array, or ``build`` of a tree), ``at`` are the packed slots of its
    arrays, ``only`` the new leaves no other attribute holds, which are no
    output of the program.

    An attribute stays packed where its value can be made again from its
    arrays alone (``graph.lazy_attributes``: no list or dict a user could
    change in place, no sub-model), every array of it travels packed in the
    next call, its instance is one the next call is given (not one the call
    detached), and, for an attribute that is not state, its class reads it
    through a ``LazyAttribute``.
    """
    if not layout.dtypes:
        return (), (), frozenset()
    fresh_at = {id(x): f for f, x in enumerate(fresh_leaves)}
    fresh_ids = {id(obj) for obj in fresh_objects}
    holds = _graph.lazy_attributes(graphdef)
    steps = _graph.leaf_attributes(graphdef)
    chosen: dict[tuple[int, int], tuple[str, bool, tuple[int, ...]]] = {}
    changed = {at for p, j in enumerate(sources) if j is None for at in steps[p]}
    for i, k in sorted(changed | rebound):
        obj, held = objects[i], holds[i][k]
        if held is None or id(obj) not in fresh_ids or not _graph.is_stateful_instance(obj):
            continue
        slots = [fresh_at.get(id(new_leaves[p])) for p in held]
        if any(f is None or layout.slots[f] is None for f in slots):
            continue
        name, treedef, _ = graphdef.instances[i][1][k]
        state = name in _tree.info_of(obj).state
        if state:
            data = treedef.node_data()
            if data is None or data[0] is not FrozenLocalStateRequest:
                continue
        elif not lazy_attribute_allowed(type(obj), name):
            continue
        chosen[(i, k)] = (name, state, held)
    only = frozenset(
        p for p, j in enumerate(sources)
        if j is None and steps[p] and all(at in chosen for at in steps[p])
    )
    packed = sorted({p for _, _, held in chosen.values() for p in held})
    index = {p: k for k, p in enumerate(packed)}
    lazy: list[tuple[int, str, bool, int, Callable[[list[Any]], Any] | None]] = []
    for (i, k), (name, state, held) in chosen.items():
        treedef = graphdef.instances[i][1][k][1]
        if not state and treedef.num_nodes == 1:
            lazy.append((i, name, False, index[held[0]], None))
        else:
            build = functools.partial(
                _attribute_of, graphdef, (i, k), tuple((p, index[p]) for p in held)
            )
            lazy.append((i, name, state, -1, build))
    return tuple(lazy), tuple(fresh_at[id(new_leaves[p])] for p in packed), only


def _attribute_of(
    graphdef: Any, at: tuple[int, int], places: tuple[tuple[int, int], ...], values: list[Any]
) -> Any:
    """The value of attribute ``at`` made from a ``PackedValues``' ``values``
    (``places``: each of its leaves' index there)."""
    return _graph.attribute_value(graphdef, at, {p: values[k] for p, k in places})


def _static_entry(graphdef: Any, i: int, k: int) -> bool:
    """Whether attribute ``k`` of instance ``i`` holds an immutable static
    value in ``graphdef`` (the rebuild puts the graphdef's own object there)."""
    _, treedef, parts = graphdef.instances[i][1][k]
    return (treedef is None and type(parts) is StaticLeaf
            and not _values.is_mutable_static(parts.value))


# What the leaves of a call's flatten hold for an array only lazy attributes
# hold: it is in the packed buffers, and no attribute is rebuilt from it.
_IN_BUFFERS: Any = object()


def _release(entry: _Entry) -> None:
    """The lazy values of ``entry``'s models made for good (``PackedValues.release``),
    and its leaves with them, before its buffers are donated."""
    holder = entry.holder
    assert holder is not None
    values = holder.release()
    leaves = list(entry.leaves)
    for k, f in enumerate(holder.at):
        leaves[f] = values[k]
    entry.leaves, entry.holder, entry.made_by = leaves, None, None


def _lazy_values(lazy: tuple, holder: PackedValues, objs: list[Any]) -> None:
    """Gives the attributes ``lazy`` (``_lazy_plan``) of ``objs`` their lazy values of ``holder``."""
    for i, name, state, index, build in lazy:
        objs[i].__dict__[name] = (
            LazyState(holder, build) if state else LazyValue(holder, index, build)
        )


def _keep_layouts(key: _Key, leaves: list[Any], graphdef: Any) -> dict[int, Any]:
    """Each new array of a sharded model constrained to the sharding its path
    had when the call began (where its shape is the same), by the id of the
    array: a model keeps its arrays' layouts across calls."""
    before = {
        name: (sharding, shape)
        for name, sharding, shape in zip(key.graphdef.names, key.shardings, key.shapes)
        if isinstance(sharding, jax.sharding.NamedSharding)
    }
    swap = {}
    for name, x in zip(graphdef.names, leaves):
        found = before.get(name)
        if found is not None and found[1] == _shape_of(x):
            swap[id(x)] = jax.lax.with_sharding_constraint(x, found[0])
    return swap


class _Program:
    """What ``jax.jit`` compiles for a ``Compiled``: its ``_pure``, named in
    the user's words.

    JAX names the traced function and its arguments in its errors ("while
    tracing the function ... it depends on the values of the arguments
    ...") and in the compiled program. Here that is the user's function, its
    arguments' names, and the path of each model array (``model.fc.weight``),
    where JAX would name ``_pure`` and its ``buffers[0]``.
    """

    def __init__(self, compiled: Compiled):
        self._compiled = weakref.ref(compiled)

    def __call__(
        self, key_shapes: tuple, buffers: list[Any], loose: list[Any], others: list[Any]
    ) -> tuple[Any, list[Any], list[Any]]:
        compiled = self._compiled()
        assert compiled is not None  # (the Compiled holds its jitted program)
        return compiled._pure(key_shapes, buffers, loose, others)

    def __repr__(self) -> str:  # (JAX's errors name the function by it)
        compiled = self._compiled()
        return object.__repr__(self) if compiled is None else repr(compiled.fn)

    @property
    def __fun_debug_info__(self) -> Any:
        compiled = self._compiled()
        tracing = None if compiled is None else compiled._tracing
        if compiled is None or tracing is None:
            return None
        fn = compiled.fn
        try:
            args, kwargs, key, count = tracing
            names = _argument_names(fn, args, kwargs, key, compiled._static, compiled._static_names)
        except Exception:  # (names are a courtesy: JAX's own stand where they fail)
            names = None
        if names is not None and len(names) != count:  # (one name per array argument, or none)
            names = None
        return _api_util.debug_info(
            "autostate.jit", fn, (), {}, sourceinfo=_api_util.fun_sourceinfo(fn),
        )._replace(arg_names=names)


def _argument_names(
    fn: Callable[..., Any], args: tuple, kwargs: dict, key: _Key,
    static: tuple[int, ...], static_names: set[str],
) -> tuple[str, ...]:
    """The names of the compiled program's array arguments, in its order
    (the packed buffers, the loose model arrays, the other arguments' leaves):
    each model array by its path from the argument that holds it, each other
    leaf as ``jax.jit`` names it."""
    is_model = _graph.is_stateful_instance
    model = object()  # (stands for a model: one leaf, as ``_arguments`` flattens it)
    marked_args, marked_kwargs = jax.tree_util.tree_map(
        lambda x: model if is_model(x) else x, (args, kwargs), is_leaf=is_model
    )
    try:
        signature: inspect.Signature | None = inspect.signature(fn)
    except (TypeError, ValueError):
        signature = None
    flat = _api_util._non_static_arg_names(
        signature, marked_args, marked_kwargs, static, tuple(static_names)
    )
    models = [flat[i] for i in key.where]
    taken = set(key.where)
    others = [name for i, name in enumerate(flat) if i not in taken]

    def leaf_name(name: str) -> str:  # ``models[k].fc.weight`` -> ``model.fc.weight``
        k, _, rest = name.removeprefix("models[").partition("]")
        return models[int(k)] + rest

    leaves = [leaf_name(name) for name in key.graphdef.names]
    packed: list[list[str]] = [[] for _ in key.layout.dtypes]
    for name, slot in zip(leaves, key.layout.slots):
        if slot is not None:
            packed[slot[0]].append(name)
    buffers = [
        names[0] if len(names) == 1
        else f"{names[0]} (packed with {len(names) - 1} more small array"
        f"{'s' if len(names) > 2 else ''})"
        for names in packed
    ]
    return (*buffers, *(leaves[j] for j in key.loose), *others)


def _forget(compiled: Any, model_id: int, cache_id: tuple) -> None:
    """A model was deleted: what its compiled calls kept goes with it."""
    compiled = compiled()
    if compiled is not None:
        compiled._entries.pop(cache_id, None)
        compiled._watched.discard((model_id, cache_id))


def _check_alive(entry: _Entry, indices: Any) -> None:
    """Refuses a call whose models hold an array an earlier call donated (a
    copy of the model, or another model sharing the array, was compiled
    with): a clear error instead of XLA's."""
    for j in indices:
        x = entry.leaves[j]
        if isinstance(x, jax.Array) and x.is_deleted():
            raise InvalidArgumentError(
                format_error(
                    f"The array {_user_path(entry.key.graphdef.names[j])} of a model passed to "
                    "a function compiled by autostate.jit was deleted: an earlier compiled call "
                    "donated it while this model held it too. That call was given another "
                    "model holding the same array (a copy.copy of this one, a model it was "
                    "loaded from, or one its array was assigned to) and not this one, so only "
                    "the other model received the new value.",
                    where=user_location(),
                    fix="give each model arrays of its own (copy.deepcopy), or compile with "
                    "donate_models=False.",
                )
            )


def _check_concrete(leaves: list[Any], graphdef: Any) -> None:
    """Refuses a model holding an abstract array (a ``jax.ShapeDtypeStruct``),
    which no compiled program takes: a clear error instead of JAX's."""
    for j, x in enumerate(leaves):
        if _values.kind_of(x).spec:
            raise InvalidArgumentError(
                format_error(
                    f"The array {_user_path(graphdef.names[j])} of a model passed to a "
                    f"function compiled by autostate.jit is abstract, a jax.ShapeDtypeStruct "
                    f"({_tree.describe(x)}) with no data: a state declared with "
                    "autostate.state(jax.ShapeDtypeStruct(...)) and not assigned yet, or a "
                    "model built under jax.eval_shape. A compiled program takes arrays.",
                    where=user_location(),
                    fix="assign the state before the compiled call (call a method that "
                    "assigns it eagerly, or give it an array in __init__: "
                    "`jnp.zeros(shape, dtype)`), and build the model outside jax.eval_shape.",
                )
            )


def _user_path(name: str) -> str:
    """A leaf's path from the walk's root (``models[0].norm.mean.state``) as
    the user names it: ``norm.mean`` (of the first model argument)."""
    head, _, rest = name.partition("].")
    path = rest.removesuffix(".state")
    which = int(head.removeprefix("models[")) + 1 if head.startswith("models[") else 1
    return f"`{path}` (of model argument {which})"


def _one_device(leaves: list[Any]) -> bool:
    """Whether the arrays among ``leaves`` all live on one device (then the
    small ones are packed; a sharded model keeps every array's layout)."""
    found = None
    for x in leaves:
        sharding = getattr(x, "sharding", None)
        if sharding is None:
            continue
        if found is None:
            if len(sharding.device_set) != 1:
                return False
            found = sharding
        elif type(sharding) is not type(found) or sharding != found:
            return False
    return True


def _small(x: Any) -> bool:
    return int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize <= _SMALL


def _never(x: Any) -> bool:
    return False


@functools.lru_cache(maxsize=64)
def _packer(layout: Layout) -> Callable[[list[Any]], list[Any]]:
    """A compiled function packing a flatten's small arrays into ``layout``'s buffers."""
    return jax.jit(lambda leaves: layout.pack(leaves)[0])


# Models remembered per compiled function (the last ones called).
_ENTRIES = 8


def _kept(old: Any, new: Any) -> Any:
    """``new``, in ``old``'s container object where both are of one mutable
    type (its kind's ``restore``): a list an attribute holds, changed in place
    or not, stays the same list, as plain Python's call leaves it."""
    if type(old) is not type(new):
        return new
    restore = _values.kind_of(old).restore
    if restore is None:
        return new
    restore(old, new)
    return old


def _shape_of(x: Any) -> Any:
    shape = getattr(x, "shape", None)
    if shape is None:
        return type(x)
    return shape, getattr(x, "dtype", None), getattr(x, "weak_type", False)


_UNSET: Any = object()


def _check_reached(fn: Callable[..., Any], copies: Sequence[Any]) -> None:
    """Refuses a model ``fn`` reaches by its closure, defaults or globals, or
    through those of the functions it calls by a global name
    (``graph.code_reaches``): the program would read it as constants and
    leave it unchanged (a silent copy)."""
    ids = {id(c) for c in copies}
    for how, value in _graph.code_reaches(fn):
        for obj in _graph.instances_of(value):
            if id(obj) not in ids:
                raise InvalidArgumentError(
                    format_error(
                        f"{getattr(fn, '__qualname__', fn)!r}, compiled by autostate.jit, reaches "
                        f"a {type(obj).__name__} model through {how} instead of an argument: "
                        "the compiled program would read it as constants and leave every "
                        "change to it out.",
                        where=user_location(),
                        fix="pass the model as an argument of the compiled function "
                        "(`step(model, batch)`), or compile a method of it "
                        "(`autostate.jit(model.step)`).",
                    )
                )


def _check_no_value_of_the_trace(graphdef: Any, objects: list[Any]) -> None:
    """Refuses a static value the models will hold after the call that keeps a
    value of the compiled trace (a function closing over one, an object holding
    one: ``self.fn = lambda: x * 2``), in an attribute or a static state of
    ``objects`` (the instances of ``graphdef``): written back, it would be a
    leaked tracer."""
    for (cls, entries), obj in zip(graphdef.instances, objects, strict=True):
        for name, _treedef, parts in entries:
            kept = [p.value for p in (parts if type(parts) is tuple else (parts,))
                    if type(p) is StaticLeaf]
            slot = obj.__dict__.get(name)
            if type(slot) is StaticState:
                kept.append(slot.value)
            if kept and held_tracers(kept):
                raise StateAccessError(format_error(
                    f"A function compiled by autostate.jit assigned {cls.__name__}.{name} a "
                    "value that keeps a value of the compiled program (a function closing "
                    "over an array of the call, an object holding one): after the call the "
                    "model would hold a tracer of a finished trace.",
                    where=user_location(),
                    fix="keep arrays in states (`self.scale = x * 2`, and the function "
                    "reads the state), or make the function or object outside the compiled "
                    "call from the arrays it returns.",
                ))


def _check_static(statics: tuple, named: tuple) -> None:
    """Refuses a static argument that cannot be hashed: it is part of the
    program's cache key (as for ``jax.jit``)."""
    for value in (*(v for _, v in statics), *(v for _, v in named)):
        try:
            hash(value)
        except TypeError:
            shown = repr(value)
            raise InvalidArgumentError(
                format_error(
                    f"The static argument {shown if len(shown) <= 40 else shown[:37] + '...'} "
                    f"of a function compiled by autostate.jit is a {type(value).__name__}, "
                    "which cannot be hashed: a static argument "
                    "is part of the compiled program's cache key.",
                    where=user_location(),
                    fix="pass a hashable value (a tuple for a list, a frozen dataclass), or "
                    "leave the argument out of static_argnums/static_argnames.",
                )
            ) from None


def _check_static_models(statics: tuple, named: tuple) -> None:
    """Refuses a model given as a static argument: the program would read its
    arrays as constants of the trace, stale at the next call, and leave every
    change to it out."""
    for value in (*(v for _, v in statics), *(v for _, v in named)):
        if _graph.holds_instance(value):
            raise InvalidArgumentError(
                format_error(
                    f"A static argument of a function compiled by autostate.jit holds a "
                    f"{type(_graph.instances_of(value)[0]).__name__} model: the compiled "
                    "program would read its arrays as constants (stale at the next call) and "
                    "leave every change to it out.",
                    where=user_location(),
                    fix="pass the model as an argument that is not static (leave it out of "
                    "static_argnums/static_argnames).",
                )
            )


def _check_plain_output(out: Any) -> None:
    if _graph.holds_instance(out):
        raise InvalidArgumentError(
            format_error(
                "A function compiled by autostate.jit returns a model: the values it "
                "returns leave the compiled program as plain arrays.",
                where=user_location(),
                fix="change the model passed in (it is updated in place) and return "
                "arrays, or build the model outside the compiled function.",
            )
        )


@overload
def jit(fn: Callable[P, R], /, **options: Any) -> Compiled[P, R]: ...


@overload
def jit(fn: None = None, /, **options: Any) -> Callable[[Callable[P, R]], Compiled[P, R]]: ...


def jit(fn: Callable[P, R] | None = None, /, **options: Any) -> Any:
    """Compiles ``fn``, a function of models and pytrees, and updates the models in place.

    ``fn`` may call the methods of the models it is given, assign their
    attributes and switch their mode (``model.eval()``). After each call every
    change is in the same Python objects, as the plain call ``fn(...)`` would
    leave them: sub-models and instances shared between arguments stay the
    same objects. ``fn`` is traced once per structure and mode of its models
    (and per shape of its other arguments, as ``jax.jit``); the models' old
    arrays are donated to the program. When ``fn`` raises, the models keep
    their values from before the call.

    Args:
        fn: the function; a method of a model (``model.step``) takes the model
            as its first argument, and a model itself compiles its ``__call__``. Used bare as ``@autostate.jit`` or with
            options as ``@autostate.jit(static_argnums=...)``.
        **options: those of ``jax.jit`` (``static_argnums`` by position, and
            not ``donate_argnums``); ``donate_models=False`` keeps the
            models' old arrays valid.

    Returns:
        The compiled function: it returns what ``fn`` returns, as arrays.

    Examples:
        >>> @autostate.stateful
        ... class Counter:
        ...     def __init__(self):
        ...         self.w = jnp.ones(2)
        ...         self.calls = jnp.zeros((), jnp.int32)
        ...
        ...     def __call__(self, x):
        ...         self.calls += 1
        ...         return self.w * x
        >>> @autostate.jit
        ... def step(model, x):
        ...     y = model(x)
        ...     model.w = model.w - 0.5  # a parameter assigned from outside
        ...     return y.sum()
        >>> model = Counter()
        >>> print(step(model, jnp.ones(2)), step(model, jnp.ones(2)))
        2.0 1.0
        >>> print(model.calls, model.w)
        2 [0. 0.]
    """
    if fn is None:
        return functools.partial(jit, **options)
    return Compiled(fn, dict(options))
