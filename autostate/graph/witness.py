"""The change check of a kept flatten: ``Witness``.

``autostate.jit`` keeps the flatten of the models a call was given; the next
call may reuse it when nothing in those models changed. ``Witness`` says so
by identity alone (each instance's attributes, and the lists, dicts and state
slots they hold, at any depth, read through each kind's ``witnessed`` field),
cheaper than ``graph.graph_unchanged``, the flatten's exact mirror, which the
guard of a traced ``f`` runs.

Example:
    >>> from autostate import graph
    >>> graph.Witness.of([]).unchanged()
    True
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import jax

from autostate import values as _values
from autostate.graph.kinds import STATEFUL_CLASSES, WITNESSED
from autostate.values import kind_of


class Witness:
    """What a set of instances held, by identity: ``unchanged()`` says whether
    they still hold it, so that an earlier ``flatten_graph`` of them still stands.

    The cheap, conservative sibling of ``graph_unchanged``: it compares
    identities only (each instance's attributes, the lists, dicts and state
    slots they hold, at any depth), builds no graphdef and flattens nothing.
    What it saw is kept flat (every instance's keys and values in one list,
    every list's items in another, ...), so that a check is a few
    comparisons of whole lists in C, whatever the number of instances. A
    value whose equality the graphdef compares but whose identity cannot tell
    a change (a numpy array, which changes in place; a mutable object with an
    ``__eq__`` of its own; a foreign pytree node) makes ``of`` give ``None``:
    no witness, the caller flattens again.

    Example:
        >>> @autostate.stateful
        ... class Layer:
        ...     def __init__(self):
        ...         self.w = jnp.ones(2)
        ...         self.sizes = [2]
        >>> layer = Layer()
        >>> witness = Witness.of([layer])
        >>> witness.unchanged()
        True
        >>> layer.sizes.append(3)
        >>> witness.unchanged()
        False
    """

    __slots__ = ("refs", "types", "dicts", "lens", "keys", "values", "starts", "held", "_plans")

    def __init__(self, objects: Sequence[Any], held: _Held):
        # Per instance: a weak reference to it, its class, its __dict__, the
        # dict's length and where its keys and values start in the flat lists.
        self.refs = [weakref.ref(obj) for obj in objects]
        self.types = list(map(type, objects))
        self.dicts = [obj.__dict__ for obj in objects]
        self.lens = list(map(len, self.dicts))
        self.starts = list(itertools.accumulate(self.lens, initial=0))
        self.keys = list(itertools.chain.from_iterable(self.dicts))
        self.values = list(itertools.chain.from_iterable(map(dict.values, self.dicts)))
        self.held = held  # what the attributes hold that can change in place
        # Per set of attributes a call rewrites (by id): it, and how ``patch`` takes them.
        self._plans: dict[int, tuple[tuple, _Patch]] = {}

    @classmethod
    def of(cls, objects: Sequence[Any]) -> Witness | None:
        held = _Held.of([obj.__dict__ for obj in objects])
        if held is None:
            return None
        try:
            return cls(objects, held)
        except TypeError:  # (an instance that takes no weak reference)
            return None

    def patch(self, touched: Iterable[tuple[int, str]]) -> bool:
        """Witnesses anew the attributes ``touched`` (``(instance index, name)``:
        what a call rewrote), the rest as it was: whether it still can (else
        the caller makes a new one with ``of``).

        One call's rewrites are many (a state per layer) and alike (a new
        array, or a new slot holding one): each is written over what was
        witnessed for it in whole lists, and only an attribute whose value
        is another shape is witnessed anew on its own.
        """
        # (By identity: a compiled call gives the same tuple each time.)
        found = self._plans.get(id(touched))
        if found is not None and found[0] is touched:
            plan = found[1]
        else:
            touched = tuple(touched)
            made = _Patch.of(self, touched)
            if made is None:
                return False
            plan = made
            self._plans[id(touched)] = (touched, plan)
        if list(map(len, self.dicts)) != self.lens:
            return False
        new = list(map(dict.get, map(self.dicts.__getitem__, plan.instances), plan.names))
        set_value = self.values.__setitem__
        for _ in map(set_value, plan.positions, new):
            pass
        held = self.held
        others = list(plan.others)
        # Values holding nothing to witness (a new array): nothing held before either.
        plain = list(map(new.__getitem__, plan.plain))
        if not all(map(_PLAIN.__contains__, map(type, plain))):
            others += plan.plain
        # A new slot of the kind before, holding a value of its own (a state's).
        slots = list(map(new.__getitem__, plan.slots))
        inner = None
        if list(map(type, slots)) == plan.slot_types:
            inner = list(map(operator.call, map(held.reads.__getitem__, plan.slot_at), slots))
            if not all(map(_PLAIN.__contains__, map(type, inner))):
                inner = None
        if inner is None:
            others += plan.slots
        else:
            for _ in map(held.slots.__setitem__, plan.slot_at, slots):
                pass
            for _ in map(held.inner.__setitem__, plan.slot_at, inner):
                pass
        for k in others:  # (anything else, one by one)
            record: tuple[list, list, list] = ([], [], [])
            if not _witnessed(new[k], record):
                return False
            if not held.replace(touched[k], record):
                # Another shape (a dict with a key more): all held, anew.
                anew = _Held.of(self.dicts)
                if anew is None:
                    return False
                self.held, self._plans = anew, {}
                break
        return True

    def instances(self) -> list[Any] | None:
        """The instances witnessed, where they still hold what they held (else ``None``)."""
        objs = list(map(operator.call, self.refs))
        if list(map(type, objs)) != self.types:  # (a dead instance reads as None)
            return None
        dicts = self.dicts
        if not all(map(operator.is_, map(_DICT_OF, objs), dicts)):
            return None
        if list(map(len, dicts)) != self.lens:
            return None
        # (Keys by equality, which a list compares by identity first: the
        # same names are the same attributes.)
        if list(itertools.chain.from_iterable(dicts)) != self.keys:
            return None
        if not all(map(operator.is_, itertools.chain.from_iterable(map(dict.values, dicts)),
                       self.values)):
            return None
        return objs if self.held.unchanged() else None

    def unchanged(self) -> bool:
        return self.instances() is not None


_DICT_OF = operator.attrgetter("__dict__")


class _Held:
    """What a ``Witness``'s attributes hold that can change in place, flat:
    every list, dict and state slot in one list each, their contents in
    another (records ``(dict, keys, values)``, ``(list, items)``, ``(slot,
    read, value)``), so that a check compares whole lists; ``spans`` says
    where each attribute's records start, and their shape, so that a record
    of the same shape is written over them in place."""

    __slots__ = ("lists", "list_lens", "items", "dicts", "dict_lens", "dict_keys",
                 "dict_values", "slots", "reads", "inner", "spans")

    def __init__(self) -> None:
        self.lists: list = []
        self.list_lens: list[int] = []
        self.items: list = []
        self.dicts: list = []
        self.dict_lens: list[int] = []
        self.dict_keys: list = []
        self.dict_values: list = []
        self.slots: list = []
        self.reads: list = []
        self.inner: list = []
        # (instance, name) -> (starts in dicts, dict_keys, lists, items, slots; shape)
        self.spans: dict[tuple[int, str], tuple[int, int, int, int, int, tuple]] = {}

    @classmethod
    def of(cls, dicts: Sequence[dict]) -> _Held | None:
        """What the attributes in ``dicts`` hold (``None``: one can change unseen)."""
        held = cls()
        for i, d in enumerate(dicts):
            for name, v in d.items():
                record: tuple[list, list, list] = ([], [], [])
                if not _witnessed(v, record):
                    return None
                if record[0] or record[1] or record[2]:
                    held.add((i, name), record)
        return held

    def add(self, at: tuple[int, str], record: tuple[list, list, list]) -> None:
        self.spans[at] = (len(self.dicts), len(self.dict_keys), len(self.lists),
                          len(self.items), len(self.slots), _shape(record))
        for c, keys, values in record[0]:
            self.dicts.append(c)
            self.dict_lens.append(len(keys))
            self.dict_keys.extend(keys)
            self.dict_values.extend(values)
        for c, items in record[1]:
            self.lists.append(c)
            self.list_lens.append(len(items))
            self.items.extend(items)
        for slot, read, value in record[2]:
            self.slots.append(slot)
            self.reads.append(read)
            self.inner.append(value)

    def replace(self, at: tuple[int, str], record: tuple[list, list, list]) -> bool:
        """Writes ``record`` over the attribute's, where both have one shape."""
        span = self.spans.get(at)
        if span is None:
            return not (record[0] or record[1] or record[2])
        d, k, lst, it, s, shape = span
        if _shape(record) != shape:
            return False
        for c, keys, values in record[0]:
            self.dicts[d] = c
            self.dict_keys[k:k + len(keys)] = keys
            self.dict_values[k:k + len(keys)] = values
            d, k = d + 1, k + len(keys)
        for c, items in record[1]:
            self.lists[lst] = c
            self.items[it:it + len(items)] = items
            lst, it = lst + 1, it + len(items)
        for slot, read, value in record[2]:
            self.slots[s], self.reads[s], self.inner[s] = slot, read, value
            s += 1
        return True

    def unchanged(self) -> bool:
        is_, chain = operator.is_, itertools.chain.from_iterable
        return (
            list(map(len, self.lists)) == self.list_lens
            and all(map(is_, chain(self.lists), self.items))
            and list(map(len, self.dicts)) == self.dict_lens
            and all(map(is_, chain(self.dicts), self.dict_keys))
            and all(map(is_, chain(map(dict.values, self.dicts)), self.dict_values))
            and all(map(is_, map(operator.call, self.reads, self.slots), self.inner))
        )


def _shape(record: tuple[list, list, list]) -> tuple:
    return (tuple(len(keys) for _, keys, _ in record[0]),
            tuple(len(items) for _, items in record[1]), len(record[2]))


@dataclasses.dataclass(slots=True)
class _Patch:
    """How ``Witness.patch`` takes one set of rewritten attributes, by their
    order in it: each one's instance, name and place among the witness's
    values; which held nothing to witness (``plain``), which held one slot
    and nothing else (``slots``, of ``slot_types``, at ``slot_at``), and the
    rest."""

    instances: list[int]
    names: list[str]
    positions: list[int]
    plain: list[int]
    slots: list[int]
    slot_types: list[type]
    slot_at: list[int]
    others: list[int]

    @classmethod
    def of(cls, witness: Witness, touched: tuple[tuple[int, str], ...]) -> _Patch | None:
        plan = cls([], [], [], [], [], [], [], [])
        held = witness.held
        for k, (i, name) in enumerate(touched):
            start, end = witness.starts[i], witness.starts[i + 1]
            try:
                position = witness.keys.index(name, start, end)
            except ValueError:
                return None
            plan.instances.append(i)
            plan.names.append(name)
            plan.positions.append(position)
            span = held.spans.get((i, name))
            if span is None:
                plan.plain.append(k)
            elif span[5] == ((), (), 1):
                plan.slots.append(k)
                plan.slot_types.append(type(held.slots[span[4]]))
                plan.slot_at.append(span[4])
            else:
                plan.others.append(k)
        return plan


def _witnessed(value: Any, record: tuple[list, list, list]) -> bool:
    """Whether a ``Witness`` can see every change of ``value`` by identity; the
    dicts, lists and slots it holds into ``record``."""
    t = type(value)
    if t in _PLAIN or t in STATEFUL_CLASSES:
        return True  # (an instance is among the witnessed objects: witnessed on its own)
    kind = kind_of(value)
    if kind.static or kind.array:
        if kind.numpy:
            return False  # (a numpy array changes in place)
        _PLAIN.add(t)  # (by type: the next one is taken at the first look)
        return True
    if t is list:
        record[1].append((value, tuple(value)))
        return all(_witnessed(v, record) for v in value)
    if t is dict:
        record[0].append((value, tuple(value), tuple(value.values())))
        return all(_witnessed(v, record) for v in value.values())
    if kind is _values.TUPLE or kind is _values.NAMED_TUPLE or kind is _values.FROZENSET:
        return all(_witnessed(v, record) for v in value)
    if t in WITNESSED:
        read = WITNESSED[t]
        if read is None:
            return True  # (immutable, what it holds witnessed apart)
        inner = read(value)
        record[2].append((value, read, inner))
        return _witnessed(inner, record)
    return _identity_is_value(t, value)


# Types a ``Witness`` takes as they are, first (immutable); an array's kind
# says the same, one look-up later.
_PLAIN: set[type] = {int, float, bool, str, type(None), type(jax.tree_util.tree_structure(0))}

def _identity_is_value(t: type, value: Any) -> bool:
    """Whether values of type ``t`` are static values the graphdef compares by
    identity and holding no arrays: the default ``__eq__``, not a pytree node
    (decided by the first value met, for the type)."""
    found = _IDENTITY_IS_VALUE.get(t)
    if found is None:
        found = _IDENTITY_IS_VALUE[t] = t.__eq__ is object.__eq__ and (
            jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(value))
        )
    return found


_IDENTITY_IS_VALUE: dict[type, bool] = {}
