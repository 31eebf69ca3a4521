"""The host-callback engine behind ``@stateful(fallback="host")`` (DESIGN.md section 5).

The functional engine threads state through a call as values; it cannot
follow a closure that assigns ``self.x`` and is handed to a lax function or
another library. Under this fallback each state lives in a host-side store,
and every read or write is one ordered ``io_callback`` into it, so it works
wherever JAX can place a callback.

It owns the stores (one ``_Store`` per instance, owned by its ``HostSlot``s,
so a pytree copy of the model keeps the same store; programs hold it only
weakly), the ``host_get``/``host_set`` primitives (they carry each state's
per-example structure, touch the store eagerly, lower to one ordered
callback, and record per leaf which vmap levels it holds one value per
example for; a written value is a constant for differentiation),
``inference_mode`` (a view read once at the ``jit`` boundary) and
``restore_host_slots``. Host slots speak the one slot protocol, so
``functionalize()`` finds them in the same walk; no source code here."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import sys
import threading
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import dispatch as jax_dispatch  # no public way to drop a failed ordering token
from jax._src import effects as jax_effects  # no public registry of kept effects
from jax.experimental import io_callback
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir
from jax.interpreters import partial_eval as pe

from autostate import graph as _graph
from autostate import tree as _tree
from autostate import values as _values
from autostate.effects.local_state import FrozenLocalStateRequest, StateSlot
from autostate.errors import HostStateChangeError, HostStateError, HostStateTypeError, format_error
from autostate.lifetime import contains_tracer, under_staging_trace

__all__ = [
    "HostSlot", "callback_count", "inference_mode", "live_store_count", "make_host_slot",
    "restore_host_slots",
]

# --- per-example structure ----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Spec:
    """The fixed per-example structure of one state: what a traced read returns."""

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]
    # Per leaf, whether it is weakly typed (``jnp.asarray(1.0)``, a Python
    # number): it takes the dtype of what it meets, under a trace as eagerly.
    # The last value written decides, as plain Python's attribute would.
    weak: tuple[bool, ...] = ()

    def describe(self) -> str:
        parts = [_tree.format_spec(s, d) for s, d in zip(self.shapes, self.dtypes)]
        return parts[0] if len(parts) == 1 else "(" + ", ".join(parts) + ")"

    def __repr__(self) -> str:  # shown in jaxprs
        return self.describe()


def _non_array_error(label: str, value: Any, what: str) -> HostStateTypeError:
    return HostStateTypeError(format_error(
        f"State {label} {what} {type(value).__name__} value {value!r:.80}; a host-fallback "
        "state must be a JAX/NumPy array or a pytree of them, because every traced read "
        "needs a fixed shape and dtype.",
        fix="store an array (e.g. `jnp.asarray(...)`), or keep non-array values as "
        "ordinary attributes set only in __init__.",
    ))


def _array_leaves(value: Any, label: str, what: str) -> tuple[list[Any], Any]:
    """Leaves of ``value`` (python numbers made arrays) and its treedef; TypeError otherwise."""
    leaves, treedef = jax.tree_util.tree_flatten(value)
    if not leaves:
        raise _non_array_error(label, value, what)
    out = []
    for leaf in leaves:
        if _values.is_python_number(leaf):
            leaf = jnp.asarray(leaf)
        elif not _values.is_array(leaf):
            raise _non_array_error(label, leaf, what)
        elif jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.extended):
            raise _extended_dtype_error(label, leaf)
        out.append(leaf)
    return out, treedef


def _extended_dtype_error(label: str, leaf: Any) -> HostStateTypeError:
    attr = label.rsplit(".", 1)[-1]
    return HostStateTypeError(format_error(
        f"State {label} holds a {leaf.dtype} array (a typed PRNG key); host-fallback "
        "states travel through host callbacks, which carry plain dtypes only.",
        fix=f"keep the key's data (`self.{attr} = jax.random.key_data(key)`, and "
        "`jax.random.wrap_key_data(...)` where it is used), use a uint32 key "
        "(`jax.random.PRNGKey(seed)`), or drop fallback=\"host\" for this class.",
    ))


def _canonical_dtype(dtype: Any) -> np.dtype:
    return np.dtype(jax.dtypes.canonicalize_dtype(dtype))


def _weak_types(leaves: list[Any]) -> tuple[bool, ...]:
    return tuple(bool(getattr(leaf, "weak_type", False)) for leaf in leaves)


def _typed(leaves: list[Any], spec: _Spec) -> list[Any]:
    """``leaves`` (JAX arrays) weakly typed where ``spec`` says so."""
    return [_values.weakly_typed(leaf) if w else leaf for leaf, w in zip(leaves, spec.weak)]


# --- stores -----------------------------------------------------------------------


class _Entry:
    """One state: its structure, its value (``None`` until set) and its vmap axes."""

    __slots__ = ("label", "spec", "value", "dims", "staged_write")

    def __init__(self, label: str, spec: _Spec, value: tuple | None):
        self.label = label
        self.spec = spec
        # Leaves of shape _lead(dims) + per-example shape; None: declared, not set.
        self.value = value
        # Per leaf, the vmap axes it holds one value per example for (see Dims).
        self.dims: tuple[Dims, ...] = ((),) * len(spec.shapes)
        # A traced write exists, so a traced read may be legal although the
        # value is still unset (the write runs first at run time).
        self.staged_write = False


_store_ids = itertools.count()
_REGISTRY_LOCK = threading.Lock()
# store id -> store, for every live store; weak so that it never keeps one alive.
_LIVE: weakref.WeakValueDictionary[int, _Store] = weakref.WeakValueDictionary()


class _Store:
    """The host states of one model instance, guarded by one lock."""

    __slots__ = ("id", "owner", "lock", "entries", "callbacks", "__weakref__")

    def __init__(self, owner: str):
        self.owner = owner
        self.lock = threading.Lock()
        self.entries: dict[str, _Entry] = {}
        # Callbacks compiled programs ran into this store (see callback_count).
        self.callbacks = 0
        with _REGISTRY_LOCK:
            self.id = next(_store_ids)
            _LIVE[self.id] = self

    def __repr__(self) -> str:
        return f"<host store #{self.id} of {self.owner}: {sorted(self.entries)}>"

    # Pickling and deepcopy give a new, independent store holding the values.
    def __reduce__(self):
        _wait_for_dispatched_programs()
        with self.lock:
            saved = [
                (attr, e.label, _unflatten_value(e), e.dims, e.spec.weak)
                for attr, e in self.entries.items()
            ]
        return _restore_store, (self.owner, saved)


def _unflatten_value(entry: _Entry) -> Any:
    if entry.value is None:
        leaves = [jax.ShapeDtypeStruct(s, d) for s, d in zip(entry.spec.shapes, entry.spec.dtypes)]
    else:
        leaves = [np.asarray(v) for v in entry.value]  # type: ignore[misc]
    return jax.tree_util.tree_unflatten(entry.spec.treedef, leaves)


def _restore_store(owner: str, saved: list) -> _Store:
    store = _Store(owner)
    for attr, label, value, dims, *weak in saved:  # (weak types: absent in older pickles)
        entry = _new_entry(label, value)
        if weak:
            entry.spec = dataclasses.replace(entry.spec, weak=tuple(weak[0]))
        if entry.value is not None and any(dims):
            entry.spec = dataclasses.replace(
                entry.spec,
                shapes=tuple(s[len(_lead(d)) :] for s, d in zip(entry.spec.shapes, dims)),
            )
            entry.dims = tuple(dims)
        store.entries[attr] = entry
    return store


def _new_entry(label: str, value: Any) -> _Entry:
    """An entry for an initial value, or for a declared spec (pytree of ShapeDtypeStruct)."""
    leaves, treedef = jax.tree_util.tree_flatten(value)
    declared = leaves and all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves)
    if not declared:
        leaves, treedef = _array_leaves(value, label, "was given the")
        leaves = [jnp.asarray(leaf) for leaf in leaves]
    spec = _Spec(
        treedef,
        tuple(tuple(leaf.shape) for leaf in leaves),
        tuple(_canonical_dtype(leaf.dtype) for leaf in leaves),
        tuple(bool(getattr(leaf, "weak_type", False)) for leaf in leaves),
    )
    return _Entry(label, spec, None if declared else tuple(leaves))


def live_store_count() -> int:
    """How many host stores are alive (for leak checks in long-running processes)."""
    with _REGISTRY_LOCK:
        return len(_LIVE)


def callback_count(model: Any) -> int:
    """How many callbacks compiled programs have run into ``model``'s host states.

    Eager reads and writes are not counted: they touch the store directly.

    Args:
        model: a model (or any pytree) holding ``fallback="host"`` state.

    Returns:
        The number of host callbacks run so far, over all its host stores.

    Examples:
        >>> from autostate.host import callback_count
        >>> @autostate.stateful(fallback="host")
        ... class Counter:
        ...     def __init__(self):
        ...         self.n = jnp.zeros(())
        ...
        ...     def __call__(self, x):
        ...         self.n += x
        ...         return x
        >>> counter = Counter()
        >>> before = callback_count(counter)
        >>> _ = jax.jit(counter)(1.0)
        >>> callback_count(counter) - before  # one read and one write of self.n
        2
    """
    stores = {
        id(slot.store): slot.store
        for _, slot in _graph.iter_tree(model, lambda node: type(node) is HostSlot)
    }
    _wait_for_dispatched_programs()
    total = 0
    for store in stores.values():
        with store.lock:
            total += store.callbacks
    return total


class _StateKey:
    """Names one state in primitive parameters without keeping its store alive."""

    __slots__ = ("store_id", "attr", "label", "_store")

    def __init__(self, store: _Store, attr: str):
        self.store_id = store.id
        self.attr = attr
        self.label = f"{store.owner}.{attr}"
        self._store = weakref.ref(store)

    def resolve(self) -> tuple[_Store, _Entry]:
        store = self._store()
        if store is None:
            raise HostStateError(format_error(
                f"Host state {self.label} belongs to a model that was garbage-collected, "
                "but a compiled program still calls back into it.",
                fix="keep the model alive while calling functions traced with it.",
            ))
        return store, store.entries[self.attr]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _StateKey):
            return NotImplemented
        return self.store_id == other.store_id and self.attr == other.attr

    def __hash__(self) -> int:
        return hash((self.store_id, self.attr))

    def __repr__(self) -> str:  # shown in jaxprs
        return f"{self.label}#{self.store_id}"


# --- vmap axes ----------------------------------------------------------------------

# The batch axes of one leaf, tracked per leaf as equinox's StateIndex did: for
# each vmap level of the write that made it (outermost first), that vmap's axis
# size where the leaf holds one value per example, or None where every example
# holds the same value (a constant, a `pmean` over the axis). The stored array
# has the non-None sizes as leading axes, then the per-example shape. A leaf
# with no per-example level is () and fits any vmap nesting.
Dims = tuple[int | None, ...]


def _lead(dims: Dims) -> tuple[int, ...]:
    return tuple(size for size in dims if size is not None)


def _describe_dims(dims: tuple[Dims, ...]) -> str:
    if len(set(dims)) == 1:
        return str(dims[0])
    return "(" + ", ".join(str(d) for d in dims) + ") per leaf"


def _fits(axes: tuple[int, ...], dims: Dims) -> bool:
    """Whether a leaf with ``dims`` can be read or written under vmap ``axes``:
    as in the seed, plus inner vmaps may share it, and outside vmap it reads
    as the stack of its examples."""
    if not axes or not _lead(dims):
        return True
    if len(axes) < len(dims):
        return False
    return all(size is None or size == axes[level] for level, size in enumerate(dims))


def _conflicts(axes: tuple[int, ...], dims: tuple[Dims, ...]) -> bool:
    return not all(_fits(axes, d) for d in dims)


def _read_shape(axes: tuple[int, ...], dims: Dims, shape: tuple[int, ...]) -> tuple[int, ...]:
    # Under vmap a read is batched by every level (a shared leaf is broadcast),
    # so a compiled read stays valid when a later write makes the leaf
    # per-example; outside vmap it is the stack of the examples.
    return (tuple(axes) if axes else _lead(dims)) + tuple(shape)


def _broadcast_leaf(value: Any, dims: Dims, axes: tuple[int, ...], xp: Any) -> Any:
    if not axes:
        return value
    example = tuple(value.shape[len(_lead(dims)) :])
    keep = [
        axes[level] if level < len(dims) and dims[level] is not None else 1
        for level in range(len(axes))
    ]
    return xp.broadcast_to(xp.reshape(value, tuple(keep) + example), tuple(axes) + example)


def _reset_hint(label: str) -> str:
    attr = label.rsplit(".", 1)[-1]
    return f"reset it outside vmap first (`model.{attr} = value` with the per-example shape)"


def _vmap_mismatch(label: str, axes: tuple, dims: tuple[Dims, ...], write: bool = False) -> HostStateError:
    """A read (or ``write``) under vmap ``axes`` of a state whose leaves hold ``dims``."""
    how = (
        f"; a write under vmap axes of sizes {axes} does not match." if write
        else f", but it is read under vmap axes of sizes {axes}."
    )
    return HostStateError(format_error(
        f"State {label} holds per-example values for vmap axes of sizes "
        f"{_describe_dims(dims)}{how}",
        fix=f"{'write' if write else 'read'} it under the vmap nesting and sizes it was "
        f"written under, or {_reset_hint(label)}.",
    ))


def _new_dims(
    label: str, spec: _Spec, axes: tuple[int, ...], mapped: tuple[tuple[bool, ...], ...],
    extra: tuple[tuple[int, ...], ...], old: tuple[Dims, ...],
) -> list[Dims]:
    """Per-leaf batch axes of a write under vmap ``axes``: ``mapped[level][leaf]``
    whether that vmap batched it, ``extra[leaf]`` leading axes beyond the
    per-example shape (only the stacked examples of outer levels)."""
    if _conflicts(axes, old):
        raise _vmap_mismatch(label, axes, old, write=True)
    new = []
    for leaf, (before, stacked) in enumerate(zip(old, extra)):
        dims = tuple(axes[level] if mapped[level][leaf] else None for level in range(len(axes)))
        if stacked:
            outer = before[len(axes) :]
            if _lead(outer) != stacked:
                raise _shape_error(
                    label, spec, spec.shapes[leaf], stacked + tuple(spec.shapes[leaf])
                )
            dims += outer
        new.append(dims)
    return new


def _merge_equal_examples(value: Any, dims: Dims, before: Dims, xp: Any) -> tuple[Any, Dims]:
    """Stores one value for a vmap level whose examples all wrote the same value
    (``mean = m * mean + (1 - m) * pmean(x)`` is batched but equal), as the
    seed's per-leaf tracking did; per-example leaves stay so."""
    dims = list(dims)  # type: ignore[assignment]
    for level in reversed(range(len(dims))):
        # One example says nothing about whether examples agree: keep its axis.
        if dims[level] in (None, 1) or (level < len(before) and before[level] is not None):
            continue
        axis = sum(size is not None for size in dims[:level])
        first = value[(slice(None),) * axis + (slice(0, 1),)]
        if bool(xp.all(value == first)):
            value = xp.squeeze(first, axis=axis)
            dims[level] = None  # type: ignore[index]
    return value, (tuple(dims) if any(size is not None for size in dims) else ())


def _wait_for_dispatched_programs() -> None:
    # A jitted call may return before its callbacks ran (asynchronous dispatch);
    # an eager access must come after their writes, and a trace must see the
    # batch axes they leave. A thread Python did not start is XLA's own, running
    # a callback: waiting there would wait for the program it belongs to.
    if isinstance(threading.current_thread(), threading._DummyThread):
        return
    try:
        jax.effects_barrier()
    except jax.errors.JaxRuntimeError:
        # A program whose callback raised: CPU reports it at the call, an accelerator
        # (which runs it after the call returned) here. JAX keeps its failed ordering
        # token and hands it to every later ordered program, so every later access
        # would fail with the same error: report it once, then start a new order.
        jax_dispatch.runtime_tokens.clear()
        raise


# --- primitives ---------------------------------------------------------------------


@functools.cache
def _ordered_io_effect() -> Any:
    # io_callback's own ordered effect, found through the public API: our
    # primitives lower to io_callback, so they must declare the same effect for
    # jit and control flow to thread the ordering token through them.
    jaxpr = jax.make_jaxpr(
        lambda: io_callback(
            lambda: np.zeros((), np.int32), jax.ShapeDtypeStruct((), np.int32), ordered=True
        )
    )()
    (effect,) = jaxpr.effects
    return effect


host_get_p = Primitive("host_get")
host_get_p.multiple_results = True
host_set_p = Primitive("host_set")
host_set_p.multiple_results = True


def _read_types(make: Callable[..., Any], spec: _Spec, axes: tuple, stored: tuple) -> list[Any]:
    """What a read under vmap ``axes`` of a state whose leaves hold ``stored``
    gives, each leaf's type made by ``make(shape, dtype, weak_type=...)``."""
    return [
        make(_read_shape(axes, d, s), t, weak_type=w)
        for d, s, t, w in zip(stored, spec.shapes, spec.dtypes, spec.weak)
    ]


def _get_abstract_eval(anchor, *, state, spec, axes, stored):
    del anchor
    if _conflicts(axes, stored):
        raise _vmap_mismatch(state.label, axes, stored)
    return _read_types(jax.core.ShapedArray, spec, axes, stored), {_ordered_io_effect()}


def _read_now(state: _StateKey, axes: tuple, expected: tuple | None, xp: Any) -> list[Any]:
    store, entry = state.resolve()
    with store.lock:
        value, dims = entry.value, entry.dims
        if expected is not None:
            store.callbacks += 1
    if value is None:
        raise _unset_error(entry.label)
    if _conflicts(axes, dims):
        raise _vmap_mismatch(entry.label, axes, dims)
    if expected is not None and not axes and [_lead(d) for d in dims] != [_lead(d) for d in expected]:
        raise HostStateError(format_error(
            f"State {entry.label} now holds values for vmap axes of sizes "
            f"{_describe_dims(dims)}; this compiled program was traced when it held "
            f"values for {_describe_dims(expected)}.",
            fix="jax.jit re-traces only for new argument shapes: call a freshly jitted "
            f"function after changing how a state is batched, or {_reset_hint(entry.label)}.",
        ))
    return [_broadcast_leaf(v, d, axes, xp) for v, d in zip(value, dims)]


def _get_impl(anchor, *, state, spec, axes, stored):
    # Bound eagerly: from HostSlot.read, or one equation of a program that is
    # evaluated equation by equation (jax.core.eval_jaxpr), where the equation
    # before may be a dispatched program (a lax.cond) whose writes are pending.
    del anchor, stored
    _wait_for_dispatched_programs()
    return _typed([jnp.asarray(v) for v in _read_now(state, axes, None, jnp)], spec)


def _get_lowering(anchor, *, state, spec, axes, stored):
    del anchor

    def callback():
        return tuple(np.asarray(v) for v in _read_now(state, axes, stored, np))

    results = tuple(_read_types(jax.ShapeDtypeStruct, spec, axes, stored))
    return list(io_callback(callback, results, ordered=True))


def _get_batching(axis_data, vals, dims, *, state, spec, axes, stored):
    del vals, dims
    outs = host_get_p.bind(_anchor(), state=state, spec=spec, axes=(axis_data.size, *axes), stored=stored)
    return outs, [0] * len(outs)


def _set_abstract_eval(anchor, *avals, state, spec, axes, mapped, extra, stored):
    del anchor, avals
    _new_dims(state.label, spec, axes, mapped, extra, stored)
    try:
        _, entry = state.resolve()
        entry.staged_write = True
    except HostStateError:
        pass
    return [], {_ordered_io_effect()}


def _write_now(
    state: _StateKey, axes: tuple, mapped: tuple, extra: tuple, leaves: list[Any], *,
    callback: bool, xp: Any,
) -> None:
    store, entry = state.resolve()
    with store.lock:
        if callback:
            store.callbacks += 1
        written = _new_dims(entry.label, entry.spec, axes, mapped, extra, entry.dims)
        merged = [
            _merge_equal_examples(leaf, d, before, xp)
            for leaf, d, before in zip(leaves, written, entry.dims)
        ]
        entry.value = tuple(leaf for leaf, _ in merged)
        entry.dims = tuple(d for _, d in merged)


def _set_impl(anchor, *leaves, state, spec, axes, mapped, extra, stored):
    del anchor, spec, stored
    _wait_for_dispatched_programs()  # after the writes of dispatched programs, as _get_impl
    leaves = [jnp.asarray(leaf) for leaf in leaves]
    _write_now(state, axes, mapped, extra, leaves, callback=False, xp=jnp)
    return []


def _set_lowering(anchor, *leaves, state, spec, axes, mapped, extra, stored):
    del anchor, spec, stored

    def callback(*values):
        # io_callback hands us arrays it owns (copied to the host), safe to keep.
        _write_now(state, axes, mapped, extra, [np.asarray(v) for v in values], callback=True, xp=np)

    io_callback(callback, None, *leaves, ordered=True)
    return []


def _set_batching(axis_data, vals, dims, *, state, spec, axes, mapped, extra, stored):
    # An unbatched leaf stays unbatched: a write that is the same for every
    # example (a constant, a pmean over the axis) stores one shared value.
    vals, dims = vals[1:], dims[1:]
    front = [v if d is None else jnp.moveaxis(v, d, 0) for v, d in zip(vals, dims)]
    host_set_p.bind(
        _anchor(), *front, state=state, spec=spec, axes=(axis_data.size, *axes),
        mapped=(tuple(d is not None for d in dims), *mapped), extra=extra, stored=stored,
    )
    return [], []


def _anchor() -> np.ndarray:
    """The first operand of every host primitive: no data, see ``_stay_in_scan_loops``."""
    return np.zeros((), np.bool_)


def _hoisting_a_scan_body() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "_scan_known_hoisting":
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _stay_in_scan_loops(primitive: Primitive) -> Callable[..., Any]:
    # Under jax.grad, scan's partial evaluation moves every part of the primal
    # loop body that does not depend on the carry out of the loop, effects
    # included: a host access that does not depend on the carry
    # (`self.steps += 1`) would run once instead of once per step, and later
    # writes would be lost (a bare ordered io_callback is moved the same way).
    # While scan does that, the anchor operand counts as unknown (loop
    # dependent), so every host access stays in the loop and runs exactly once
    # per primal step; everywhere else partial evaluation is the default one.
    # A staged access feeds no output of the loop body, so JAX must be told to
    # keep the callback's effect (as it keeps jax.debug.callback's) or it drops
    # the access altogether.
    def partial_eval(trace, anchor, *tracers, **params):
        if _hoisting_a_scan_body():
            jax_effects.partial_eval_kept_effects.add_type(type(_ordered_io_effect()))
            anchor = trace.instantiate_const(anchor)
        return trace.default_process_primitive(primitive, (anchor, *tracers), params)

    return partial_eval


host_get_p.def_effectful_abstract_eval(_get_abstract_eval)
pe.custom_partial_eval_rules[host_get_p] = _stay_in_scan_loops(host_get_p)
host_get_p.def_impl(_get_impl)
mlir.register_lowering(host_get_p, mlir.lower_fun(_get_lowering, multiple_results=True))
batching.fancy_primitive_batchers[host_get_p] = _get_batching

host_set_p.def_effectful_abstract_eval(_set_abstract_eval)
pe.custom_partial_eval_rules[host_set_p] = _stay_in_scan_loops(host_set_p)
host_set_p.def_impl(_set_impl)
mlir.register_lowering(host_set_p, mlir.lower_fun(_set_lowering, multiple_results=True))
batching.fancy_primitive_batchers[host_set_p] = _set_batching


# Reading an inference view under vmap: its value entered as one stacked array,
# so each vmap level indexes the examples it holds per-example values for.
# Pure JAX (no callback): the primitive only exists for its batching rule,
# which must see every vmap level although its inputs are not batched.
_view_p = Primitive("host_inference_view")
_view_p.multiple_results = True


def _view_abstract_eval(*avals, label, dims, axes):
    if _conflicts(axes, dims):
        raise _vmap_mismatch(label, axes, dims)
    return [
        jax.core.ShapedArray(_read_shape(axes, d, a.shape[len(_lead(d)) :]), a.dtype)
        for a, d in zip(avals, dims)
    ]


def _view_impl(*leaves, label, dims, axes):
    if _conflicts(axes, dims):
        raise _vmap_mismatch(label, axes, dims)
    return [_broadcast_leaf(leaf, d, axes, jnp) for leaf, d in zip(leaves, dims)]


def _view_batching(axis_data, vals, in_dims, *, label, dims, axes):
    if any(d is not None for d in in_dims):
        raise HostStateError(format_error(
            f"Inference-mode state {label} was mapped over by vmap (in_axes); its "
            "per-example values are chosen by the vmaps it was written under.",
            fix="pass the inference view to vmap unmapped (in_axes=None) or capture it.",
        ))
    outs = _view_p.bind(*vals, label=label, dims=dims, axes=(axis_data.size, *axes))
    return outs, [0] * len(outs)


_view_p.def_abstract_eval(_view_abstract_eval)
_view_p.def_impl(_view_impl)
mlir.register_lowering(_view_p, mlir.lower_fun(_view_impl, multiple_results=True))
batching.fancy_primitive_batchers[_view_p] = _view_batching


def _unset_error(label: str) -> HostStateError:
    attr = label.rsplit(".", 1)[-1]
    return HostStateError(format_error(
        f"State {label} was read before it was set: it was declared with a shape only.",
        fix=f"assign it (`self.{attr} = value`) before the first read.",
    ))


# --- slots --------------------------------------------------------------------------


class HostSlot(StateSlot):
    """What a host-fallback state attribute holds: a childless pytree node that
    is its own aux data, so every pytree copy of a model holds the same store
    (hashed by identity: no re-trace per call)."""

    __slots__ = ("store", "attr", "category", "name", "key")

    def __init__(self, store: _Store, attr: str, category: Hashable, name: str | None):
        self.store = store
        self.attr = attr
        self.category = category
        self.name = name
        self.key = _StateKey(store, attr)

    def __reduce__(self):
        return HostSlot, (self.store, self.attr, self.category, self.name)

    def __repr__(self) -> str:
        return f"HostSlot({self.store.owner}.{self.attr}, category={self.category!r})"

    def _entry(self) -> _Entry:
        return self.store.entries[self.attr]

    def read(self) -> Any:
        entry = self._entry()
        _wait_for_dispatched_programs()
        with self.store.lock:
            unset = entry.value is None and not entry.staged_write
            stored = entry.dims
        if unset:
            raise _unset_error(entry.label)
        leaves = host_get_p.bind(_anchor(), state=self.key, spec=entry.spec, axes=(), stored=stored)
        return jax.tree_util.tree_unflatten(entry.spec.treedef, leaves)

    def as_request(self) -> FrozenLocalStateRequest:
        return FrozenLocalStateRequest(self.read(), self.category, self.name)

    def write(self, value: Any, label: str | None = None) -> None:
        entry = self._entry()
        _wait_for_dispatched_programs()
        with self.store.lock:
            stored = entry.dims
        leaves, extra = _checked_leaves(entry, value)
        leaves = [jax.lax.stop_gradient(leaf) for leaf in leaves]
        weak = _weak_types(leaves)
        if weak != entry.spec.weak:
            with self.store.lock:
                entry.spec = dataclasses.replace(entry.spec, weak=weak)
        host_set_p.bind(
            _anchor(), *leaves, state=self.key, spec=entry.spec, axes=(), mapped=(), extra=extra,
            stored=stored,
        )


def _checked_leaves(entry: _Entry, value: Any) -> tuple[list[Any], tuple]:
    """The leaves of a written value and each one's leading stacked axes, or the seed's errors."""
    spec, label = entry.spec, entry.label
    leaves, treedef = _array_leaves(value, label, "was assigned a")
    if treedef != spec.treedef:
        raise HostStateChangeError(format_error(
            f"State {label} changed pytree structure from {spec.treedef} to {treedef}.",
            fix="a host-fallback state keeps the structure of its first value; assign "
            "values with the same containers and keys.",
        ))
    extras: list[tuple[int, ...]] = []
    for leaf, shape, dtype in zip(leaves, spec.shapes, spec.dtypes):
        got = tuple(jnp.shape(leaf))
        if _canonical_dtype(leaf.dtype) != dtype:
            raise HostStateChangeError(format_error(
                f"State {label} changed dtype from {dtype} to {leaf.dtype}.",
                fix=f"cast before assigning, e.g. `.astype(jnp.{dtype})`.",
            ))
        n = len(got) - len(shape)
        if n < 0 or got[n:] != shape:
            raise _shape_error(label, spec, shape, got)
        extras.append(got[:n])
    # Leading axes beyond the per-example shape are only the stacked examples
    # of a per-example leaf (written outside the vmap that batched it); the
    # write checks them once it knows the vmap levels around it.
    return leaves, tuple(extras)


def _shape_error(label: str, spec: _Spec, shape: tuple, got: tuple) -> HostStateTypeError:
    return HostStateChangeError(format_error(
        f"State {label} changed shape from {shape} to {got} (it holds {spec.describe()}).",
        fix="a host-fallback state keeps the shape of its first value, because traced "
        "reads need it; keep the shape, or use the functional engine (no fallback).",
    ))


def make_host_slot(
    obj: Any, name: str, value: Any, category: Hashable, explicit: str | None
) -> HostSlot:
    """The slot for state ``name`` of ``obj``, first assigned ``value``. One store
    per instance; ``value`` may be a tree of ``jax.ShapeDtypeStruct`` (declared,
    unreadable before a write)."""
    store = next((v.store for v in obj.__dict__.values() if type(v) is HostSlot), None)
    if store is None:
        store = _Store(type(obj).__name__)
    with store.lock:
        store.entries[name] = _new_entry(f"{type(obj).__name__}.{name}", value)
    return HostSlot(store, name, category, explicit)


# --- inference mode -------------------------------------------------------------------


_UNREAD = object()


class _ViewValue:
    """An inference view's value as read at flattening: leaves are children, batch
    axes aux data (a change of batching re-traces)."""

    __slots__ = ("label", "treedef", "leaves", "dims")

    def __init__(self, label: str, treedef: Any, leaves: tuple, dims: tuple[Dims, ...]):
        self.label = label
        self.treedef = treedef
        self.leaves = tuple(leaves)
        self.dims = dims

    def resolve(self) -> Any:
        """The value seen here: per-example under the vmaps it was written under."""
        leaves = list(self.leaves)
        if any(_lead(d) for d in self.dims):
            leaves = _view_p.bind(*leaves, label=self.label, dims=self.dims, axes=())
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


jax.tree_util.register_pytree_node(
    _ViewValue,
    lambda v: (v.leaves, (v.label, v.treedef, v.dims)),
    lambda aux, leaves: _ViewValue(aux[0], aux[1], leaves, aux[2]),
)


class _InferenceSlot(StateSlot):
    """A host state seen read-only: read once per call at the ``jax.jit`` boundary
    and passed as an input; captured by a closure, it is baked in (as the seed)."""

    __slots__ = ("slot", "value")
    handleable = False

    def __init__(self, slot: HostSlot, value: Any = _UNREAD):
        self.slot = slot
        self.value = value

    def current(self) -> _ViewValue:
        if self.value is not _UNREAD:
            return self.value
        entry = self.slot._entry()
        _wait_for_dispatched_programs()
        with self.slot.store.lock:
            value, dims = entry.value, entry.dims
        if value is None:
            raise _unset_error(entry.label)
        leaves = _typed([jnp.asarray(leaf) for leaf in value], entry.spec)
        return _ViewValue(entry.label, entry.spec.treedef, leaves, dims)  # type: ignore[arg-type]

    def read(self) -> Any:
        return self.current().resolve()

    @property
    def category(self) -> Hashable:  # type: ignore[override]
        return self.slot.category

    def write(self, value: Any, label: str | None = None) -> None:
        raise HostStateError(format_error(
            f"State {self.slot._entry().label} was set in inference mode, where host "
            "state is read-only.",
            fix="call the original model (not autostate.inference_mode(model)) to update "
            "its state.",
        ))

    def __reduce__(self):
        return _InferenceSlot, (self.slot,) if self.value is _UNREAD else (self.slot, self.value)

    def __repr__(self) -> str:
        return f"InferenceSlot({self.slot!r})"


def inference_mode(model: Any) -> Any:
    """The body of ``autostate.inference_mode``. Made inside a staged trace there
    is no boundary left to read the state at, so the value would be baked in
    and reused by every later call: refused."""
    if under_staging_trace():
        raise HostStateError(format_error(
            "autostate.inference_mode(model) was called inside a jax.jit trace (or a "
            "lax body): the view's host state enters a program where the view is passed "
            "into jax.jit, so a view made inside would bake the value read while "
            "tracing into the program, and later calls would not see the host state change.",
            fix="make the view outside and pass it in: `view = "
            "autostate.inference_mode(model)`, then `jax.jit(lambda v, x: v(x))(view, x)`; "
            "or call the model itself inside the trace (its host state is read by a "
            "callback on every call).",
        ))
    found = False

    def replace(slot: HostSlot, _path: str) -> _InferenceSlot:
        nonlocal found
        found = True
        return _InferenceSlot(slot)

    view = _graph.map_tree(model, replace, lambda node: type(node) is HostSlot)
    if not found:
        raise HostStateTypeError(format_error(
            f"inference_mode expects a model with host-fallback state; "
            f"{type(model).__name__} has none.",
            fix='decorate the class with @autostate.stateful(fallback="host").',
        ))
    return view


# --- freeze ---------------------------------------------------------------------------


def restore_host_slots(owner: Any) -> None:
    """Gives a copy a walk just built (``freeze``, loading) host slots for its
    frozen states, sharing one new store; a traced value stays a frozen request
    (a store must not keep a tracer)."""
    frozen = {
        name: request
        for name, request in owner.__dict__.items()
        if type(request) is FrozenLocalStateRequest and not contains_tracer(request.state)
    }
    if not frozen:
        return
    # A blank instance of the class collects the new slots, so they share a
    # new store rather than the store of a host slot `owner` still holds.
    fresh = object.__new__(type(owner))
    for name, request in frozen.items():
        fresh.__dict__[name] = make_host_slot(fresh, name, request.state, request.category, request.name)
    owner.__dict__.update(fresh.__dict__)


def _register() -> None:
    jax.tree_util.register_pytree_node(HostSlot, lambda s: ((), s), lambda s, _: s)
    jax.tree_util.register_pytree_node(
        _InferenceSlot,
        lambda s: ((s.current(),), s.slot),
        lambda slot, children: _InferenceSlot(slot, children[0]),
    )
    for cls in (HostSlot, _InferenceSlot):
        _graph.register_node_kind(cls, model_child=True)


_register()
