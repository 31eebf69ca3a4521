"""The host-callback engine behind ``@stateful(fallback="host")`` (DESIGN.md section 5).

The functional engine threads state through a call as values; it cannot follow
a closure that assigns ``self.x`` and is handed to ``lax.cond``/``scan``/
``while_loop`` or to another library. Under this fallback each state lives in a
host-side store instead, and every read or write is one ordered
``jax.experimental.io_callback`` into that store, so it works wherever JAX can
place a callback.

This module owns:

* the stores: one ``_Store`` per model instance (a dict of entries, one lock),
  owned by the model's ``HostSlot`` objects, so a pytree copy of the model
  (``jax.tree.map``, an optax update) keeps using the same store and the store
  is freed with the last of them. Compiled programs and the registry hold it
  only weakly;
* two primitives, ``host_get`` and ``host_set``. They carry the state's fixed
  per-example structure (treedef, shapes, dtypes) as parameters, so traced
  reads have known result shapes; run eagerly they touch the store directly;
  lowered they become one ordered ``io_callback`` each (whatever the number of
  leaves); under ``vmap`` their batching rules record the vmap axis sizes, so
  a state written under ``vmap`` holds one value per example (as the seed's
  ``StateIndex`` did); under differentiation the written value is
  ``stop_gradient``-ed: state is a constant;
* ``inference_mode``: a view whose state is read once, when the model is
  flattened at the ``jit`` boundary, and passed in as an input (no callbacks);
* ``restore_host_slots``: what a host-fallback instance does with frozen
  values when a walk (``freeze``, loading) copies it.

Host slots speak the one slot protocol (``effects.StateSlot``), so
``functionalize()`` finds them in the same walk as every other state and
takes each as the frozen request of its current value. It knows nothing
about source code: ``api`` creates slots through ``make_host_slot`` and
``runtime`` calls their ``read``/``write``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
import weakref
from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from autostate import tree as _tree
from autostate.effects import FrozenLocalStateRequest, StateSlot
from autostate.effects.local_state import contains_tracer
from autostate.errors import HostStateError, HostStateTypeError, format_error

__all__ = [
    "HostSlot",
    "callback_count",
    "inference_mode",
    "live_store_count",
    "make_host_slot",
    "restore_host_slots",
]

# --- per-example structure ----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Spec:
    """The fixed per-example structure of one state: what a traced read returns."""

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]

    def describe(self) -> str:
        parts = [_tree.format_spec(s, d) for s, d in zip(self.shapes, self.dtypes)]
        return parts[0] if len(parts) == 1 else "(" + ", ".join(parts) + ")"

    def __repr__(self) -> str:  # shown in jaxprs
        return self.describe()


_SCALARS = (bool, int, float, complex)


def _is_array(leaf: Any) -> bool:
    return isinstance(leaf, (jax.Array, np.ndarray, np.generic))


def _non_array_error(label: str, value: Any, what: str) -> HostStateTypeError:
    return HostStateTypeError(
        format_error(
            f"State {label} {what} {type(value).__name__} value {value!r:.80}; a host-fallback "
            "state must be a JAX/NumPy array or a pytree of them, because every traced read "
            "needs a fixed shape and dtype.",
            fix="store an array (e.g. `jnp.asarray(...)`), or keep non-array values as "
            "ordinary attributes set only in __init__.",
        )
    )


def _array_leaves(value: Any, label: str, what: str) -> tuple[list[Any], Any]:
    """Leaves of ``value`` (python numbers made arrays) and its treedef; TypeError otherwise."""
    leaves, treedef = jax.tree_util.tree_flatten(value)
    if not leaves:
        raise _non_array_error(label, value, what)
    out = []
    for leaf in leaves:
        if isinstance(leaf, _SCALARS):
            leaf = jnp.asarray(leaf)
        elif not _is_array(leaf):
            raise _non_array_error(label, leaf, what)
        out.append(leaf)
    return out, treedef


def _canonical_dtype(dtype: Any) -> np.dtype:
    return np.dtype(jax.dtypes.canonicalize_dtype(dtype))


# --- stores -----------------------------------------------------------------------


class _Entry:
    """One state: its structure, its value (``None`` until set) and its vmap axes."""

    __slots__ = ("label", "spec", "value", "batch_axes", "staged_write")

    def __init__(self, label: str, spec: _Spec, value: tuple | None):
        self.label = label
        self.spec = spec
        # Leaves of shape batch_axes + per-example shape; None: declared, not set.
        self.value = value
        # Sizes of the vmap axes the value holds one entry per example for,
        # outermost first; () for a value shared by every example.
        self.batch_axes: tuple[int, ...] = ()
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
                (attr, e.label, _unflatten_value(e), e.batch_axes)
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
    for attr, label, value, batch_axes in saved:
        entry = _new_entry(label, value)
        if entry.value is not None and batch_axes:
            n = len(batch_axes)
            entry.spec = dataclasses.replace(
                entry.spec, shapes=tuple(s[n:] for s in entry.spec.shapes)
            )
            entry.batch_axes = tuple(batch_axes)
        store.entries[attr] = entry
    return store


def _new_entry(label: str, value: Any) -> _Entry:
    """An entry for an initial value, or for a declared spec (pytree of ShapeDtypeStruct)."""
    leaves, treedef = jax.tree_util.tree_flatten(value)
    if leaves and all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves):
        spec = _Spec(
            treedef,
            tuple(tuple(leaf.shape) for leaf in leaves),
            tuple(_canonical_dtype(leaf.dtype) for leaf in leaves),
        )
        return _Entry(label, spec, None)
    leaves, treedef = _array_leaves(value, label, "was given the")
    arrays = tuple(jnp.asarray(leaf) for leaf in leaves)
    spec = _Spec(
        treedef,
        tuple(tuple(a.shape) for a in arrays),
        tuple(_canonical_dtype(a.dtype) for a in arrays),
    )
    return _Entry(label, spec, arrays)


def live_store_count() -> int:
    """How many host stores are alive (for leak checks in long-running processes)."""
    with _REGISTRY_LOCK:
        return len(_LIVE)


def callback_count(model: Any) -> int:
    """How many callbacks compiled programs have run into ``model``'s host states.

    Example::

        before = autostate.host.callback_count(model)
        step(model, x)
        autostate.host.callback_count(model) - before   # 2 per `self.n += x`

    Eager reads and writes are not counted: they touch the store directly.
    """
    stores = {
        id(slot.store): slot.store
        for _, slot in _tree.iter_tree(model, lambda node: type(node) is HostSlot)
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
            raise HostStateError(
                format_error(
                    f"Host state {self.label} belongs to a model that was garbage-collected, "
                    "but a compiled program still calls back into it.",
                    fix="keep the model alive while calling functions traced with it.",
                )
            )
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


def _read_axes(axes: tuple[int, ...], stored: tuple[int, ...]) -> tuple[int, ...] | None:
    """Leading axes a read under vmap ``axes`` returns, for a value stored with ``stored``.

    A value stored for fewer (outer) vmap axes is shared by the inner ones
    (broadcast); outside vmap, or under fewer axes than it was stored with, a
    per-example value reads as the stack of its examples. Anything else is a
    mismatch (``None``).
    """
    if axes[: len(stored)] == stored:
        return axes
    if stored[: len(axes)] == axes:
        return stored
    return None


def _written_axes(
    axes: tuple[int, ...], extra: tuple[int, ...], stored: tuple[int, ...]
) -> tuple[int, ...] | None:
    """Batch axes after a write under vmap ``axes`` of values with leading ``extra`` axes."""
    new = axes + extra
    if extra:
        return new if new == stored else None
    if not axes or axes[: len(stored)] == stored:
        return new
    return None


def _reset_hint(label: str) -> str:
    attr = label.rsplit(".", 1)[-1]
    return f"reset it outside vmap first (`model.{attr} = value` with the per-example shape)"


def _read_mismatch(label: str, axes: tuple, stored: tuple) -> HostStateError:
    return HostStateError(
        format_error(
            f"State {label} holds per-example values for vmap axes of sizes {stored}, but it "
            f"is read under vmap axes of sizes {axes}.",
            fix="read it under the vmap nesting and sizes it was written under, or "
            + _reset_hint(label)
            + ".",
        )
    )


def _write_mismatch(label: str, axes: tuple, extra: tuple, stored: tuple) -> HostStateError:
    return HostStateError(
        format_error(
            f"State {label} holds per-example values for vmap axes of sizes {stored}; a write "
            f"under vmap axes of sizes {axes} (with {len(extra)} stacked axes) does not match.",
            fix="write it under the vmap nesting and sizes it was written under, or "
            + _reset_hint(label)
            + ".",
        )
    )


def _broadcast_to_axes(leaf: Any, stored: tuple, view: tuple, xp: Any) -> Any:
    if stored == view:
        return leaf
    example = tuple(leaf.shape[len(stored) :])
    padded = xp.reshape(leaf, stored + (1,) * (len(view) - len(stored)) + example)
    return xp.broadcast_to(padded, view + example)


def _wait_for_dispatched_programs() -> None:
    # A jitted call may return before its callbacks ran (asynchronous dispatch);
    # an eager access must come after their writes, and a trace must see the
    # batch axes they leave. A thread Python did not start is XLA's own, running
    # a callback: waiting there would wait for the program it belongs to.
    if not isinstance(threading.current_thread(), threading._DummyThread):
        jax.effects_barrier()


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


def _get_abstract_eval(*, state, spec, axes, stored_axes):
    view = _read_axes(axes, stored_axes)
    if view is None:
        raise _read_mismatch(state.label, axes, stored_axes)
    avals = [jax.core.ShapedArray(view + s, d) for s, d in zip(spec.shapes, spec.dtypes)]
    return avals, {_ordered_io_effect()}


def _read_now(state: _StateKey, axes: tuple, expected: tuple | None, xp: Any) -> list[Any]:
    store, entry = state.resolve()
    with store.lock:
        value, stored = entry.value, entry.batch_axes
        if expected is not None:
            store.callbacks += 1
    if value is None:
        raise _unset_error(entry.label)
    view = _read_axes(axes, stored)
    if view is None:
        raise _read_mismatch(entry.label, axes, stored)
    if expected is not None and view != expected:
        raise HostStateError(
            format_error(
                f"State {entry.label} now holds values for vmap axes of sizes {stored}; this "
                f"compiled program was traced when a read here returned axes {expected}.",
                fix="jax.jit re-traces only for new argument shapes: call a freshly jitted "
                "function after changing how a state is batched, or "
                + _reset_hint(entry.label)
                + ".",
            )
        )
    return [_broadcast_to_axes(v, stored, view, xp) for v in value]


def _get_impl(*, state, spec, axes, stored_axes):
    del spec, stored_axes
    return [jnp.asarray(v) for v in _read_now(state, axes, None, jnp)]


def _get_lowering(*, state, spec, axes, stored_axes):
    view = _read_axes(axes, stored_axes)

    def callback():
        return tuple(np.asarray(v) for v in _read_now(state, axes, view, np))

    results = tuple(jax.ShapeDtypeStruct(view + s, d) for s, d in zip(spec.shapes, spec.dtypes))
    return list(io_callback(callback, results, ordered=True))


def _get_batching(axis_data, vals, dims, *, state, spec, axes, stored_axes):
    del vals, dims
    outs = host_get_p.bind(
        state=state, spec=spec, axes=(axis_data.size, *axes), stored_axes=stored_axes
    )
    return outs, [0] * len(outs)


def _set_abstract_eval(*avals, state, spec, axes, extra, stored_axes):
    del avals, spec
    if _written_axes(axes, extra, stored_axes) is None:
        raise _write_mismatch(state.label, axes, extra, stored_axes)
    try:
        _, entry = state.resolve()
        entry.staged_write = True
    except HostStateError:
        pass
    return [], {_ordered_io_effect()}


def _write_now(
    state: _StateKey, axes: tuple, extra: tuple, leaves: list[Any], *, callback: bool
) -> None:
    store, entry = state.resolve()
    with store.lock:
        if callback:
            store.callbacks += 1
        new_axes = _written_axes(axes, extra, entry.batch_axes)
        if new_axes is None:
            raise _write_mismatch(entry.label, axes, extra, entry.batch_axes)
        entry.value = tuple(leaves)
        entry.batch_axes = new_axes


def _set_impl(*leaves, state, spec, axes, extra, stored_axes):
    del spec, stored_axes
    _write_now(state, axes, extra, [jnp.asarray(leaf) for leaf in leaves], callback=False)
    return []


def _set_lowering(*leaves, state, spec, axes, extra, stored_axes):
    del spec, stored_axes

    def callback(*values):
        # io_callback hands us arrays it owns (copied to the host), safe to keep.
        _write_now(state, axes, extra, list(values), callback=True)

    io_callback(callback, None, *leaves, ordered=True)
    return []


def _set_batching(axis_data, vals, dims, *, state, spec, axes, extra, stored_axes):
    size = axis_data.size
    front = [
        jnp.broadcast_to(v, (size, *jnp.shape(v))) if d is None else jnp.moveaxis(v, d, 0)
        for v, d in zip(vals, dims)
    ]
    host_set_p.bind(
        *front, state=state, spec=spec, axes=(size, *axes), extra=extra, stored_axes=stored_axes
    )
    return [], []


def _set_jvp(primals, tangents, **params):
    # State is a constant for differentiation: write the primal, no tangent.
    del tangents
    return host_set_p.bind(*primals, **params), []


host_get_p.def_effectful_abstract_eval(_get_abstract_eval)
host_get_p.def_impl(_get_impl)
mlir.register_lowering(host_get_p, mlir.lower_fun(_get_lowering, multiple_results=True))
batching.fancy_primitive_batchers[host_get_p] = _get_batching

host_set_p.def_effectful_abstract_eval(_set_abstract_eval)
host_set_p.def_impl(_set_impl)
mlir.register_lowering(host_set_p, mlir.lower_fun(_set_lowering, multiple_results=True))
batching.fancy_primitive_batchers[host_set_p] = _set_batching
ad.primitive_jvps[host_set_p] = _set_jvp


def _unset_error(label: str) -> HostStateError:
    attr = label.rsplit(".", 1)[-1]
    return HostStateError(
        format_error(
            f"State {label} was read before it was set: it was declared with a shape only.",
            fix=f"assign it (`self.{attr} = value`) before the first read.",
        )
    )


# --- slots --------------------------------------------------------------------------


class HostSlot(StateSlot):
    """What a host-fallback state attribute holds in ``obj.__dict__``.

    It is a childless pytree node that is its own aux data, so every pytree
    copy of a model (inside ``jax.jit``, after ``jax.tree.map``) holds this
    same object: the same store, and no re-trace per call (it hashes and
    compares by identity).
    """

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
            stored = entry.batch_axes
        if unset:
            raise _unset_error(entry.label)
        leaves = host_get_p.bind(state=self.key, spec=entry.spec, axes=(), stored_axes=stored)
        return jax.tree_util.tree_unflatten(entry.spec.treedef, leaves)

    def as_request(self) -> FrozenLocalStateRequest:
        return FrozenLocalStateRequest(self.read(), self.category, self.name)

    def write(self, value: Any, label: str | None = None) -> None:
        entry = self._entry()
        _wait_for_dispatched_programs()
        with self.store.lock:
            stored = entry.batch_axes
        leaves, extra = _checked_leaves(entry, value, stored)
        leaves = [jax.lax.stop_gradient(leaf) for leaf in leaves]
        host_set_p.bind(
            *leaves, state=self.key, spec=entry.spec, axes=(), extra=extra, stored_axes=stored
        )


def _checked_leaves(entry: _Entry, value: Any, stored: tuple) -> tuple[list[Any], tuple]:
    """The leaves of a written value and its leading stacked axes, or the seed's TypeErrors."""
    spec, label = entry.spec, entry.label
    leaves, treedef = _array_leaves(value, label, "was assigned a")
    if treedef != spec.treedef:
        raise HostStateTypeError(
            format_error(
                f"State {label} changed pytree structure from {spec.treedef} to {treedef}.",
                fix="a host-fallback state keeps the structure of its first value; assign "
                "values with the same containers and keys.",
            )
        )
    extras: set[tuple[int, ...]] = set()
    for leaf, shape, dtype in zip(leaves, spec.shapes, spec.dtypes):
        got = tuple(jnp.shape(leaf))
        if _canonical_dtype(leaf.dtype) != dtype:
            raise HostStateTypeError(
                format_error(
                    f"State {label} changed dtype from {dtype} to {leaf.dtype}.",
                    fix=f"cast before assigning, e.g. `.astype(jnp.{dtype})`.",
                )
            )
        n = len(got) - len(shape)
        if n < 0 or got[n:] != shape:
            raise _shape_error(label, spec, shape, got)
        extras.add(got[:n])
    # Leading axes beyond the per-example shape are only the stacked examples
    # of a per-example state (written outside the vmap that batched it).
    extra = extras.pop()
    if extras or (extra and stored[len(stored) - len(extra) :] != extra):
        raise _shape_error(label, spec, spec.shapes[0], tuple(jnp.shape(leaves[0])))
    return leaves, extra


def _shape_error(label: str, spec: _Spec, shape: tuple, got: tuple) -> HostStateTypeError:
    return HostStateTypeError(
        format_error(
            f"State {label} changed shape from {shape} to {got} (it holds {spec.describe()}).",
            fix="a host-fallback state keeps the shape of its first value, because traced "
            "reads need it; keep the shape, or use the functional engine (no fallback).",
        )
    )


def make_host_slot(
    obj: Any, name: str, value: Any, category: Hashable, explicit: str | None
) -> HostSlot:
    """The slot for state ``name`` of ``obj``, first assigned ``value`` in ``__init__``.

    All host states of one instance share one store; two instances never do.
    ``value`` may also be a pytree of ``jax.ShapeDtypeStruct``: the state is
    then declared with that structure and reading it before a write is an
    error.
    """
    store = next((v.store for v in obj.__dict__.values() if type(v) is HostSlot), None)
    if store is None:
        store = _Store(type(obj).__name__)
    with store.lock:
        store.entries[name] = _new_entry(f"{type(obj).__name__}.{name}", value)
    return HostSlot(store, name, category, explicit)


# --- inference mode -------------------------------------------------------------------


_UNREAD = object()


class _InferenceSlot(StateSlot):
    """A host state seen read-only: its value is a pytree child, read at flattening.

    Flattening happens at the ``jax.jit`` boundary, so the state is read once
    per call, on the host, and enters the program as an ordinary input.
    """

    __slots__ = ("slot", "value")
    handleable = False

    def __init__(self, slot: HostSlot, value: Any = _UNREAD):
        self.slot = slot
        self.value = value

    def current(self) -> Any:
        if self.value is not _UNREAD:
            return self.value
        entry = self.slot._entry()
        _wait_for_dispatched_programs()
        leaves = _read_now(self.slot.key, (), None, jnp)
        return jax.tree_util.tree_unflatten(entry.spec.treedef, leaves)

    def read(self) -> Any:
        if self.value is not _UNREAD:
            return self.value
        leaves = _inference_read_p.bind(state=self.slot.key)
        return jax.tree_util.tree_unflatten(self.slot._entry().spec.treedef, leaves)

    @property
    def category(self) -> Hashable:  # type: ignore[override]
        return self.slot.category

    def write(self, value: Any, label: str | None = None) -> None:
        raise HostStateError(
            format_error(
                f"State {self.slot._entry().label} was set in inference mode, where host "
                "state is read-only.",
                fix="call the original model (not autostate.inference_mode(model)) to update "
                "its state.",
            )
        )

    def __reduce__(self):
        return _InferenceSlot, (self.slot,) if self.value is _UNREAD else (self.slot, self.value)

    def __repr__(self) -> str:
        return f"InferenceSlot({self.slot!r})"


# Reading an inference-mode state that did not cross a jit boundary as an
# argument (a model captured by a closure): fine eagerly, an error when traced,
# where its value would be frozen into the program as a stale constant.
_inference_read_p = Primitive("host_inference_read")
_inference_read_p.multiple_results = True


def _inference_read_abstract_eval(*, state):
    raise HostStateError(
        format_error(
            f"Inference-mode state {state.label} was read inside a traced function that "
            "captured the model instead of taking it as an argument; its value would be "
            "frozen into the program.",
            fix="pass the model in: `jax.jit(lambda m, x: m(x))(autostate.inference_mode(model), x)`.",
        )
    )


def _inference_read_impl(*, state):
    _wait_for_dispatched_programs()
    return _read_now(state, (), None, jnp)


_inference_read_p.def_abstract_eval(_inference_read_abstract_eval)
_inference_read_p.def_impl(_inference_read_impl)


def inference_mode(model: Any) -> Any:
    """A view of a host-fallback model whose state is read once, at the jit boundary.

    Example::

        frozen = autostate.inference_mode(model)
        y = jax.jit(lambda m, x: m(x))(frozen, x)   # state enters as an input

    Each call reads the current value of every host state on the host while
    flattening ``frozen`` and passes it into the program as an ordinary
    argument: the compiled program contains no callbacks. Setting a state of
    the view is an error. The original ``model`` is unchanged and keeps its
    store; the view follows later updates to it.

    **Arguments:**
    - ``model``: a model (or any pytree) holding ``fallback="host"`` state.

    **Returns:** a copy of ``model`` whose host states are read-only inputs.
    """
    found = False

    def replace(slot: HostSlot, _path: str) -> _InferenceSlot:
        nonlocal found
        found = True
        return _InferenceSlot(slot)

    view = _tree.map_tree(model, replace, lambda node: type(node) is HostSlot)
    if not found:
        raise HostStateTypeError(
            format_error(
                f"inference_mode expects a model with host-fallback state; "
                f"{type(model).__name__} has none.",
                fix='decorate the class with @autostate.stateful(fallback="host").',
            )
        )
    return view


# --- freeze ---------------------------------------------------------------------------


def restore_host_slots(owner: Any) -> None:
    """Gives a copied host-fallback instance host slots for its frozen states.

    ``owner`` is a copy that a walk (``freeze``, loading) just built, so its
    slots are swapped in place. Its frozen states share one new store (host
    slots it still holds, of categories ``functionalize`` did not handle, keep
    the original model's store). A traced value (``freeze`` called inside a
    transformation) stays a frozen request: a store must not keep a tracer.
    """
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
        fresh.__dict__[name] = make_host_slot(
            fresh, name, request.state, request.category, request.name
        )
    owner.__dict__.update(fresh.__dict__)


def _register() -> None:
    jax.tree_util.register_pytree_node(HostSlot, lambda s: ((), s), lambda s, _: s)
    jax.tree_util.register_pytree_node(
        _InferenceSlot,
        lambda s: ((s.current(),), s.slot),
        lambda slot, children: _InferenceSlot(slot, children[0]),
    )
    for cls in (HostSlot, _InferenceSlot):
        _tree.register_dynamic_type(cls)


_register()
