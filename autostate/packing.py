"""Packed dispatch: a functionalized model whose arrays travel as one buffer per dtype.

A jitted step on a model of many small arrays spends its dispatch time in
JAX handling each input and output buffer one by one (401 in, 201 out for
the 100-module model of ``benchmarks/bench_dispatch.py``), not in the
arithmetic. ``pack(f, states)`` lays the parameters (the leaves of ``f``)
and the states out in one flat buffer per dtype; inside the program the
buffers are sliced back into the original arrays, the model runs unchanged,
and the new states are concatenated into buffers again. The program does the
same arithmetic plus the slices and concatenations, which XLA fuses.

This module owns the layout and the two pytrees that carry it. It knows
nothing of how ``f`` was built: it uses only ``jax.tree_util`` on ``f`` and
on the states (and ``tree.is_stateful_instance``, to refuse a model given in
place of ``f``).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from autostate.effects.local_state import StateSlot
from autostate.errors import InvalidTypeError, format_error
from autostate.graph import is_stateful_instance, register_node_kind


class Layout:
    """Where each leaf of a flattened tree sits: in which buffer, at which offset.

    ``slots[i]`` is ``(buffer, offset, shape)`` for a packed leaf and
    ``None`` for a leaf that travels on its own (not an array). There is one
    buffer per dtype and weak-typedness (``jnp.full(4, 1.0)`` is weak): a
    concatenation of weak arrays stays weak, a mixed one would not, and the
    model's type promotion must not change.
    Hashed once and compared by identity first, since ``jax.jit`` compares
    the layout of its arguments on every call.
    """

    __slots__ = ("treedef", "dtypes", "slots", "_hash", "_ends")

    def __init__(self, treedef: Any, dtypes: tuple, slots: tuple):
        self.treedef = treedef
        self.dtypes = dtypes
        self.slots = slots
        self._hash = hash((treedef, dtypes, slots))
        # Per buffer, where each of its leaves ends (in order): how unpack splits it.
        self._ends: list[list[int]] = [[] for _ in dtypes]
        for slot in slots:
            if slot is not None:
                self._ends[slot[0]].append(slot[1] + int(np.prod(slot[2], dtype=np.int64)))

    @classmethod
    def of(
        cls, leaves: Sequence[Any], treedef: Any, packable: Callable[[Any], bool] | None = None
    ) -> Layout:
        """The layout of ``leaves``; ``packable``, where given, says which arrays
        may be packed (the others travel on their own)."""
        dtypes: list[Any] = []
        sizes: list[int] = []
        slots: list[tuple | None] = []
        for leaf in leaves:
            dtype, shape = getattr(leaf, "dtype", None), getattr(leaf, "shape", None)
            if dtype is None or shape is None or jax.dtypes.issubdtype(
                dtype, jax.dtypes.extended
            ) or (packable is not None and not packable(leaf)):
                # Not an array (a Python number), a typed PRNG key, or one the
                # caller keeps apart: on its own.
                slots.append(None)
                continue
            dtype = (np.dtype(dtype), bool(getattr(leaf, "weak_type", False)))
            if dtype not in dtypes:
                dtypes.append(dtype)
                sizes.append(0)
            b = dtypes.index(dtype)
            slots.append((b, sizes[b], tuple(shape)))
            sizes[b] += int(np.prod(shape, dtype=np.int64))
        layout = cls(treedef, tuple(dtypes), tuple(slots))
        # One object per distinct layout: the states a step returns then carry
        # the very layout they came in with, and jit's per-call comparison of
        # its arguments' structure stops at identity.
        return _LAYOUTS.setdefault(layout, layout)

    def fits(self, leaves: Sequence[Any], treedef: Any) -> bool:
        """Whether ``leaves`` can travel in this layout: the same structure, and
        each packed leaf of its slot's dtype and shape (a loose one may be
        anything: a Python number in, its traced array out)."""
        if treedef != self.treedef or len(leaves) != len(self.slots):
            return False
        for leaf, slot in zip(leaves, self.slots):
            if slot is None:
                continue
            dtype, weak = self.dtypes[slot[0]]
            if (
                getattr(leaf, "shape", None) != slot[2]
                or getattr(leaf, "dtype", None) != dtype
                or bool(getattr(leaf, "weak_type", False)) != weak
            ):
                return False
        return True

    def pack(self, leaves: Sequence[Any]) -> tuple[list[Any], list[Any]]:
        """``(buffers, loose)``: the packed leaves concatenated per dtype, and the others."""
        parts: list[list[Any]] = [[] for _ in self.dtypes]
        loose = []
        for leaf, slot in zip(leaves, self.slots):
            if slot is None:
                loose.append(leaf)
            else:
                parts[slot[0]].append(jnp.ravel(leaf))
        return [_joined(p) for p in parts], loose

    def repack(
        self, buffers: Sequence[Any], leaves: Sequence[Any], before: Sequence[Any]
    ) -> list[Any]:
        """The buffers of ``leaves``, given ``buffers`` that packed ``before``
        in this layout: a buffer none of whose leaves changed is returned as
        it came; one some of whose leaves changed gets those written over it
        (a dynamic_update_slice once compiled, in place where it is donated: the
        unchanged ones are neither sliced out nor copied back); one all of
        whose leaves changed is packed anew."""
        members: list[list[int]] = [[] for _ in self.dtypes]
        for j, slot in enumerate(self.slots):
            if slot is not None:
                members[slot[0]].append(j)
        new = []
        for buffer, js in zip(buffers, members, strict=True):
            changed = [j for j in js if leaves[j] is not before[j]]
            if len(changed) == len(js):
                buffer = _joined([jnp.ravel(leaves[j]) for j in js])
            else:
                for j in changed:
                    part, at = jnp.ravel(leaves[j]), self.slots[j][1]
                    # (A scatter of a static slice, which XLA compiles to a
                    # dynamic_update_slice: lax's own would make a weakly typed
                    # buffer strongly typed, another layout than the next call's.)
                    buffer = buffer.at[at:at + part.size].set(part)
            new.append(buffer)
        return new

    def unpack(self, buffers: Sequence[Any], loose: Sequence[Any]) -> list[Any]:
        """The leaves again: each buffer split into its leaves, reshaped, and the
        loose leaves in place.

        One split per buffer, not a slice per leaf: the transpose of a split
        (under ``jax.grad``) is one concatenation, where each slice's would pad
        its cotangent to the whole buffer (a training step on packed state
        would cost the number of leaves times the buffer's size).
        A buffer with leading axes (packed states returned by ``jax.vmap``, one
        row per example) gives leaves with the same leading axes.
        """
        parts: list[list[Any]] = []
        for b, buffer in enumerate(buffers):
            ends = self._ends[b]
            parts.append([buffer] if len(ends) == 1 else jnp.split(buffer, ends[:-1], axis=-1))
        taken = [0] * len(parts)
        leaves = []
        it = iter(loose)
        for slot in self.slots:
            if slot is None:
                leaves.append(next(it))
                continue
            b, _, shape = slot
            part = parts[b][taken[b]]
            taken[b] += 1
            leaves.append(jnp.reshape(part, (*jnp.shape(part)[:-1], *shape)))
        return leaves

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, Layout):
            return NotImplemented
        return self._hash == other._hash and (self.treedef, self.dtypes, self.slots) == (
            other.treedef, other.dtypes, other.slots
        )

    def __repr__(self) -> str:
        return f"Layout({len(self.slots)} leaves in {len(self.dtypes)} buffers)"


_LAYOUTS: dict[Layout, Layout] = {}


def _joined(parts: list[Any]) -> Any:
    """One buffer of flat ``parts`` (a single part as it is)."""
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def _pack_tree(tree: Any, like: Layout | None = None) -> tuple[Layout, list[Any], list[Any]]:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    # The states a call returns keep the layout they came in with when they
    # fit it, so a carry (lax.scan over pf) keeps one structure.
    layout = like if like is not None and like.fits(leaves, treedef) else None
    if layout is None:
        layout = Layout.of(leaves, treedef)
    buffers, loose = layout.pack(leaves)
    return layout, buffers, loose


class _Packed:
    """A tree laid out by ``layout``: its packed ``buffers`` and its ``loose`` leaves."""

    __slots__ = ("layout", "buffers", "loose")

    def __init__(self, layout: Layout, buffers: Sequence[Any], loose: Sequence[Any] = ()):
        self.layout = layout
        self.buffers = list(buffers)
        self.loose = list(loose)

    def _children(self) -> tuple[tuple[Any, ...], tuple[Layout, int]]:
        return (*self.buffers, *self.loose), (self.layout, len(self.buffers))

    @classmethod
    def _rebuilt(cls, aux: tuple[Layout, int], children: Sequence[Any]) -> Any:
        return cls(aux[0], children[: aux[1]], children[aux[1] :])

    def _tree(self) -> Any:
        leaves = self.layout.unpack(self.buffers, self.loose)
        return jax.tree_util.tree_unflatten(self.layout.treedef, leaves)


class PackedStates(_Packed):
    """The states of a ``PackedModel``: one buffer per dtype (a pytree of them).

    ``.unpack()`` gives the states dict back; ``.buffers`` are the arrays
    that travel.

    Examples:
        >>> @autostate.stateful
        ... class Stats:
        ...     def __init__(self):
        ...         self.mean = jnp.zeros(2)
        ...         self.var = jnp.ones(2)
        ...
        ...     def __call__(self, x):
        ...         self.mean = 0.5 * (self.mean + x)
        ...         self.var = 0.5 * (self.var + (x - self.mean) ** 2)
        ...         return x - self.mean
        >>> pf, pstates = autostate.pack(*Stats().functionalize())
        >>> print(len(pstates.buffers), pstates.buffers[0].shape)  # mean and var, one buffer
        1 (4,)
        >>> _, pstates = pf(pstates, jnp.ones(2))
        >>> pstates.unpack()
        {'mean': Array([0.5, 0.5], dtype=float32), 'var': Array([0.625, 0.625], dtype=float32)}
    """

    __slots__ = ()

    @classmethod
    def of(cls, states: dict[str, Any], like: Layout | None = None) -> PackedStates:
        return cls(*_pack_tree(states, like))

    def unpack(self) -> dict[str, Any]:
        """The states dict, as the unpacked ``f`` takes and returns it."""
        return self._tree()

    def __repr__(self) -> str:
        return f"PackedStates({self.layout!r})"


class PackedModel(_Packed):
    """A functionalized model whose parameters travel as one buffer per dtype.

    ``pf(packed_states, *args)`` returns ``(out, new_packed_states)`` and
    computes what ``f(states, *args)`` computes; ``pf.<method>(...)`` calls
    another method the same way. It is a pytree whose leaves are the
    buffers, so ``jax.jit``, ``jax.grad`` and optax take it as they take
    ``f`` (a gradient is a ``PackedModel`` of gradient buffers).

    Examples:
        >>> @autostate.stateful
        ... class Affine:
        ...     def __init__(self):
        ...         self.w = 2 * jnp.ones(2)
        ...         self.b = jnp.ones(2)
        ...         self.calls = jnp.zeros((), jnp.int32)
        ...
        ...     def __call__(self, x):
        ...         self.calls += 1
        ...         return self.w * x + self.b
        >>> pf, pstates = autostate.pack(*Affine().functionalize())
        >>> print(len(jax.tree_util.tree_leaves(pf)))  # w and b: one float32 buffer
        1
        >>> step = jax.jit(lambda pf, s, x: pf(s, x))
        >>> out, pstates = step(pf, pstates, jnp.ones(2))
        >>> f, states = pf.unpack(pstates)  # or autostate.freeze(pf, pstates)
        >>> print(out, f.model.w, states["calls"])
        [3. 3.] [2. 2.] 1
    """

    __slots__ = ()

    @property
    def f(self) -> Any:
        """The unpacked functional model (its arrays are slices of the buffers)."""
        return self._tree()

    def unpack(self, states: PackedStates | None = None) -> Any:
        """``(f, states)`` as ``functionalize`` gave them (``f`` alone without states)."""
        return self.f if states is None else (self.f, _unpacked_states(states))

    def _run(self, method: Callable[[Any], Callable[..., Any]], states: Any, args, kwargs):
        out, new_states = method(self.f)(_unpacked_states(states), *args, **kwargs)
        return out, PackedStates.of(new_states, states.layout)

    def __call__(self, states: PackedStates, /, *args: Any, **kwargs: Any):
        return self._run(lambda f: f, states, args, kwargs)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_"):
            raise AttributeError(name)

        def call(states: PackedStates, /, *args: Any, **kwargs: Any):
            return self._run(lambda f: getattr(f, name), states, args, kwargs)

        call.__name__ = name
        return call

    def __repr__(self) -> str:
        return f"PackedModel({self.layout!r})"


for _cls in (PackedStates, PackedModel):
    jax.tree_util.register_pytree_node(_cls, _cls._children, _cls._rebuilt)


def _unpacked_states(states: Any) -> dict[str, Any]:
    if isinstance(states, PackedStates):
        return states.unpack()
    raise InvalidTypeError(format_error(
        f"A PackedModel takes PackedStates, got {type(states).__name__}.",
        fix="pass the states returned by autostate.pack(f, states) (or by the last call).",
    ))


def pack(f: Any, states: dict[str, Any]) -> tuple[PackedModel, PackedStates]:
    """Packs a functionalized model and its states into one buffer per dtype.

    Worth it when a jitted step's time is dispatch, not arithmetic: many
    small arrays (hundreds of modules of a few numbers each) on a fast
    device. Large arrays gain nothing (and pay a copy on the way in).

    Args:
        f: the ``f`` of ``functionalize()`` (any pytree callable as
            ``f(states, ...)``).
        states: its states dict.

    Returns:
        ``(pf, packed_states)``; ``pf(packed_states, *args)`` returns
        ``(out, new_packed_states)``, the same numbers as ``f``.

    Raises:
        InvalidTypeError: ``f`` is a model rather than its ``f``, or ``f`` and
            its states are packed already.

    Examples:
        >>> @autostate.stateful
        ... class Counter:
        ...     def __init__(self):
        ...         self.count = jnp.zeros(())
        ...         self.scale = jnp.ones(3)
        ...
        ...     def __call__(self, x):
        ...         self.count += 1.0
        ...         return x * self.scale * self.count
        >>> f, states = Counter().functionalize()
        >>> pf, pstates = autostate.pack(f, states)
        >>> out, pstates = jax.jit(lambda pf, s, x: pf(s, x))(pf, pstates, jnp.ones(3))
        >>> print(out, pstates.unpack()["count"])
        [1. 1. 1.] 1.0
    """
    # Refused here, not at the first call: a model, an f packed twice or
    # packed states would otherwise pack without complaint and fail later
    # with a raw TypeError from inside the packed call.
    if isinstance(f, PackedModel) or isinstance(states, PackedStates):
        raise InvalidTypeError(format_error(
            "autostate.pack: this f and its states are packed already.",
            fix="pass the pf and packed states as they are (pf.unpack(pstates) gives "
            "f and states back).",
        ))
    if is_stateful_instance(f) or not callable(f):
        got = f"the model {type(f).__name__}" if is_stateful_instance(f) else type(f).__name__
        raise InvalidTypeError(format_error(
            f"autostate.pack expects the f that functionalize() returned, got {got}.",
            fix="call f, states = model.functionalize() and pass "
            "autostate.pack(f, states).",
        ))
    if not isinstance(states, Mapping):
        raise InvalidTypeError(format_error(
            f"autostate.pack expects the states dict of f, got {type(states).__name__}.",
            fix="pass the states dict that functionalize() (or the last call of f) "
            "returned.",
        ))
    return PackedModel(*_pack_tree(f)), PackedStates.of(states)


# --- lazy packed values ---------------------------------------------------------
# Between compiled calls (``autostate.jit``, DESIGN.md section 8) the arrays a
# call changed stay in its packed output buffers: the model's attributes hold
# lazy values of one ``PackedValues``, which the next call on the same models
# passes on as its buffers, swapping them for the new ones. The first eager
# read of any of them unpacks that call's values in one batched call; every
# walk and copy sees them made (their node kind's ``canonical``).


class PackedValues:
    """The packed buffers a compiled call left its models, and the arrays of
    them that its lazy attributes stand for (``at``: their slots in ``layout``).

    ``values`` is ``None`` until an eager read asks for them (``materialize``);
    the next compiled call on the same models swaps ``buffers`` for its own
    (``renew``). ``lock`` is the one its compiled calls hold: a read on
    another thread never meets buffers a call is donating.
    """

    __slots__ = ("layout", "at", "buffers", "values", "lock", "__weakref__")

    def __init__(self, layout: Layout, at: tuple[int, ...], buffers: list[Any], lock: Any):
        self.layout = layout
        self.at = at
        self.buffers: list[Any] | None = buffers
        self.values: list[Any] | None = None
        self.lock = lock

    def materialize(self) -> list[Any]:
        """The arrays, unpacked from the buffers in one call the first time."""
        with self.lock:
            if self.values is None:
                assert self.buffers is not None  # (given up only once materialized)
                self.values = _unpacker(self.layout, self.at)(self.buffers)
            return self.values

    def renew(self, buffers: list[Any]) -> None:
        """The next call's buffers: what they hold is read when asked."""
        self.buffers = buffers
        self.values = None

    def release(self) -> list[Any]:
        """The arrays, made for good: the buffers go (a call donates them)."""
        values = self.materialize()
        self.buffers = None
        return values


@functools.lru_cache(maxsize=64)
def _unpacker(layout: Layout, at: tuple[int, ...]) -> Callable[[list[Any]], list[Any]]:
    """A compiled function giving the arrays of ``layout``'s slots ``at`` from its buffers.

    Each is an array of its own, never one of the buffers (a buffer of one
    array unpacks to itself, which JAX would return as it came): the buffers
    are donated to the next call, and what a user holds must outlive it.
    """
    loose = [None] * sum(slot is None for slot in layout.slots)

    def unpack(buffers: list[Any]) -> list[Any]:
        leaves = layout.unpack(buffers, loose)
        held = {id(b) for b in buffers}
        return [jnp.copy(leaves[j]) if id(leaves[j]) in held else leaves[j] for j in at]

    return jax.jit(unpack)


def _itself(value: Any) -> Any:
    """What a lazy value pickles as: the value it stands for."""
    return value


def _built(lazy: LazyValue | LazyState, build: Callable[[list[Any]], Any]) -> Any:
    """``build`` (``lazy.build``) of its call's values (unpacked on the first read), made
    once per call's values: the same object on each read."""
    values = lazy.holder.values
    if values is None:
        values = lazy.holder.materialize()
    if lazy._seen is not values:
        lazy._made, lazy._seen = build(values), values
    return lazy._made


class LazyValue:
    """An attribute that is not state (a parameter, an optimizer's moments)
    whose value is in a ``PackedValues``: ``index`` of its arrays, or, for a
    tree of them, ``build(values)``. Reading the attribute gives the value
    (``LazyAttribute``, the class's descriptor)."""

    __slots__ = ("holder", "index", "build", "_seen", "_made")

    def __init__(self, holder: PackedValues, index: int, build: Callable[[list[Any]], Any] | None):
        self.holder = holder
        self.index = index
        self.build = build
        self._seen: list[Any] | None = None
        self._made: Any = None

    def value(self) -> Any:
        if self.build is not None:
            return _built(self, self.build)
        values = self.holder.values
        return (self.holder.materialize() if values is None else values)[self.index]

    def __copy__(self) -> Any:
        return self.value()

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return copy.deepcopy(self.value(), memo)

    def __reduce__(self) -> Any:
        return _itself, (self.value(),)

    def __repr__(self) -> str:
        return f"LazyValue({self.value()!r})"


class LazyState(StateSlot):
    """A state whose value is in a ``PackedValues``: the slot ``build(values)``
    makes (a ``FrozenLocalStateRequest``) stands in its place until then; a
    write replaces it, as one of that slot."""

    __slots__ = ("holder", "build", "_seen", "_made")
    handleable = True
    # ``runtime.slot_kind``: an eager write treats it as the request it stands for.
    written_as_request = True

    def __init__(self, holder: PackedValues, build: Callable[[list[Any]], Any]):
        self.holder = holder
        self.build = build
        self._seen: list[Any] | None = None
        self._made: Any = None

    def made(self) -> Any:
        """The slot this one stands for, made from this call's values."""
        return _built(self, self.build)

    @property
    def category(self) -> Any:  # type: ignore[override]
        return self.made().category

    @property
    def name(self) -> Any:
        return self.made().name

    def read(self) -> Any:
        return self.made().read()

    def write(self, value: Any, label: str | None = None) -> Any:
        replacement = self.made().write(value, label)
        return self.made() if replacement is None else replacement

    def as_request(self) -> Any:
        return self.made()

    def __copy__(self) -> Any:
        return copy.copy(self.made())

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return copy.deepcopy(self.made(), memo)

    def __reduce__(self) -> Any:
        return _itself, (self.made(),)

    def __repr__(self) -> str:
        return f"LazyState({self.made()!r})"


# Every walk and copy sees a lazy value made: a parameter's array (tree), a
# state's slot. Immutable for the witness: only the compiled call that made it
# changes what it stands for, and it does so for the models it keeps.
register_node_kind(LazyValue, canonical=LazyValue.value, lazy=True, immutable=True)
register_node_kind(
    LazyState, canonical=LazyState.made, lazy=True, immutable=True, model_child=True,
    own_value=True,
)


class LazyAttribute:
    """The class-level descriptor of an attribute that is not state, once a
    compiled call leaves it a ``LazyValue``: reading it gives the value
    (made on the first read), assigning and deleting it are plain Python's.
    An attribute holding anything else reads as it is."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        try:
            value = obj.__dict__[self.name]
        except (KeyError, AttributeError):  # (no such attribute; read from the class)
            raise self._missing(obj, owner) from None
        if type(value) is not LazyValue:
            return value
        values = value.holder.values
        if values is None or value.build is not None:
            return value.value()
        return values[value.index]

    def _missing(self, obj: Any, owner: type | None) -> AttributeError:
        if obj is None:
            owner_name = owner.__name__ if owner is not None else "object"
            return AttributeError(f"type object {owner_name!r} has no attribute {self.name!r}")
        return AttributeError(f"{type(obj).__name__!r} object has no attribute {self.name!r}")

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[self.name] = value

    def __delete__(self, obj: Any) -> None:
        try:
            del obj.__dict__[self.name]
        except KeyError:
            raise AttributeError(self.name) from None


def lazy_attribute_allowed(cls: type, name: str) -> bool:
    """Whether attribute ``name`` of ``cls``'s instances may hold a
    ``LazyValue``: read through a ``LazyAttribute`` of the class (installed
    here, or a base's), which no class of its MRO has another attribute of
    that name for."""
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return type(klass.__dict__[name]) is LazyAttribute  # (a base's serves a subclass)
    try:
        setattr(cls, name, LazyAttribute(name))
    except (TypeError, AttributeError):
        return False
    return True
