"""``autostate.values``: the table of value kinds, each kind's answers and operations."""

from __future__ import annotations

import collections
import enum
import functools
import types
import typing
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autostate
from autostate import values
from autostate.errors import InvalidTypeError
from autostate.values import kind_of


class Mode(enum.Enum):
    TRAIN = "train"


class Level(enum.IntEnum):
    LOW = 1


class Pair(typing.NamedTuple):
    a: typing.Any
    b: typing.Any


class MyList(list):
    pass


class MyDict(dict):
    pass


class MyDeque(collections.deque):
    pass


class MyUserList(collections.UserList):
    pass


class Meta(type):
    pass


class WithMeta(metaclass=Meta):
    pass


_KINDS = [
    (jnp.ones(2), values.ARRAY),
    (np.ones(2), values.NUMPY_ARRAY),
    (np.float64(1.0), values.NUMPY_SCALAR),  # (a float subclass: numpy first)
    (np.int32(1), values.NUMPY_SCALAR),
    (jax.ShapeDtypeStruct((2,), jnp.float32), values.ARRAY_SPEC),
    (True, values.NUMBER),
    (3, values.NUMBER),
    (1.5, values.NUMBER),
    (1j, values.NUMBER),
    ("relu", values.TEXT),
    (b"x", values.TEXT),
    (None, values.NONE),
    (Mode.TRAIN, values.ENUM),
    (Level.LOW, values.NUMBER_ENUM),
    (int, values.CODE),
    (WithMeta, values.CODE),  # a class whose metaclass is not ``type``
    (len, values.CODE),
    (lambda: 0, values.CODE),
    (types, values.CODE),
    ([1], values.LIST),
    ({"a": 1}, values.DICT),
    ((1,), values.TUPLE),
    (Pair(1, 2), values.NAMED_TUPLE),
    ({1}, values.SET),
    (frozenset({1}), values.FROZENSET),
    (bytearray(b"ab"), values.BYTEARRAY),
    (collections.deque([1]), values.DEQUE),
    (MyDeque([1]), values.DEQUE),
    (MyList([1]), values.LIST_SUBCLASS),
    (collections.Counter(a=1), values.DICT_SUBCLASS),
    (collections.OrderedDict(a=1), values.DICT_SUBCLASS),
    (MyDict(a=1), values.DICT_SUBCLASS),
    (collections.UserDict(a=1), values.USER_DICT),
    (MyUserList([1]), values.USER_LIST),
    (functools.partial(print), values.OBJECT),
    (object(), values.OBJECT),
]


@pytest.mark.parametrize(
    ("value", "kind"), _KINDS, ids=[repr(k) + str(i) for i, (_, k) in enumerate(_KINDS)]
)
def test_each_value_has_its_kind(value, kind):
    assert kind_of(value) is kind
    assert kind_of(value) is kind  # (the second look-up is the remembered one)


def test_a_tracer_is_an_array():
    seen = []

    def f(x):
        seen.append((kind_of(x), values.is_array(x), values.holds_nothing(x)))
        return x

    jax.jit(f)(1.0)
    jax.grad(f)(1.0)
    assert seen == [(values.ARRAY, True, True)] * 2


def test_is_array_and_spec():
    assert values.is_array(jnp.ones(2)) and values.is_array(np.float32(1))
    assert not values.is_array(1.0) and not values.is_array([jnp.ones(2)])
    spec = jax.ShapeDtypeStruct((2,), jnp.float32)
    assert not values.is_array(spec) and values.is_array_or_spec(spec)


def test_python_numbers_are_not_numpy_scalars():
    assert [values.is_python_number(v) for v in (True, 2, 2.0, 2j, Level.LOW)] == [True] * 5
    assert not values.is_python_number(np.float64(2.0))
    assert not values.is_python_number(Mode.TRAIN) and not values.is_python_number("2")


def test_static_values_are_never_children():
    for value in (3, "s", None, Mode.TRAIN, Level.LOW, int, len, types):
        assert kind_of(value).static, value
    for value in (jnp.ones(2), [1], (1,), {"a": 1}, functools.partial(print)):
        assert not kind_of(value).static, value


def test_mutable_containers_include_subclasses_and_deque():
    mutable = [
        [1],
        {"a": 1},
        {1},
        bytearray(b"a"),
        collections.deque(),
        MyList(),
        MyDict(),
        collections.Counter(),
    ]
    assert all(values.is_mutable(v) for v in mutable)
    for value in ((1,), frozenset(), "s", collections.UserList(), jnp.ones(2)):
        assert not values.is_mutable(value)
    assert values.is_mutable_static((1, Pair([2], 3))) and not values.is_mutable_static((1, (2,)))


@pytest.mark.parametrize(
    "container",
    [
        [1, 2],
        MyList([1, 2]),
        collections.deque([1, 2]),
        collections.UserList([1, 2]),
        {0: 1, 1: 2},
        collections.OrderedDict({0: 1, 1: 2}),
        collections.UserDict({0: 1, 1: 2}),
        collections.defaultdict(list, {0: 1, 1: 2}),
    ],
    ids=lambda c: type(c).__name__,
)
def test_copy_update_delete_keep_the_type_and_leave_the_original(container):
    kind = kind_of(container)
    before = list(container.items()) if hasattr(container, "items") else list(container)
    copied = kind.copy(container)
    assert type(copied) is type(container) and copied == container and copied is not container
    updated = kind.update(container, 0, 9)
    assert type(updated) is type(container) and updated[0] == 9
    deleted = kind.delete(container, 0)
    assert type(deleted) is type(container) and len(deleted) == 1
    after = list(container.items()) if hasattr(container, "items") else list(container)
    assert after == before  # the original is unchanged
    if isinstance(container, collections.defaultdict):
        assert updated.default_factory is list


def test_tuples_update_as_new_tuples():
    assert kind_of((1, 2)).update((1, 2), 0, 9) == (9, 2)
    new = kind_of(Pair(1, 2)).update(Pair(1, 2), 1, 9)
    assert type(new) is Pair and new == Pair(1, 9)
    assert kind_of((1, 2)).delete is None and kind_of((1, 2)).copy is None


def test_arrays_update_functionally():
    a = jnp.zeros(3)
    assert list(kind_of(a).update(a, 1, 5.0)) == [0.0, 5.0, 0.0] and list(a) == [0.0] * 3
    n = np.zeros(3)
    out = kind_of(n).update(n, 1, 5.0)
    assert list(out) == [0.0, 5.0, 0.0] and list(n) == [0.0] * 3
    assert kind_of(np.float32(1)).update is None and kind_of({1}).update is None


def test_items_of_containers_jax_takes_as_one_leaf():
    assert values.DICT_SUBCLASS.items(collections.Counter(a=2)) == {"a": 2}
    assert type(values.DICT_SUBCLASS.items(collections.Counter(a=2))) is dict
    assert values.DEQUE.items(collections.deque([1, 2])) == [1, 2]
    assert values.USER_DICT.items(collections.UserDict(a=1)) == {"a": 1}
    assert values.USER_LIST.items(MyUserList([3])) == [3]
    assert kind_of([1]).items is None and kind_of({"a": 1}).items is None  # JAX flattens these
    assert kind_of({1}).items is None


def test_sealed_collections_are_the_ones_the_graph_does_not_walk():
    sealed = [
        v
        for v in ({1}, frozenset(), collections.deque(), MyDeque(), [1], (1,), {})
        if kind_of(v).sealed
    ]
    assert [type(v) for v in sealed] == [set, frozenset, collections.deque, MyDeque]


def test_holds_nothing():
    for value in (1, 2.0, "s", b"b", None, jnp.ones(2), np.ones(2)):
        assert values.holds_nothing(value), value
    for value in ([1], (1,), Mode.TRAIN, object(), functools.partial(print)):
        assert not values.holds_nothing(value), value


# --- the decisions that used to disagree, seen through a model ----------------------


@autostate.stateful
class _Log:
    def __init__(self, make):
        self.items = make([1.0])

    def __call__(self, x):
        self.items += [x]  # an in-place operator on a container state
        return x


class _PlainLog:
    def __init__(self, make):
        self.items = make([1.0])

    def __call__(self, x):
        self.items += [x]
        return x


_CONTAINERS = [list, MyList, collections.deque, MyDeque, collections.UserList]


@pytest.mark.parametrize("make", _CONTAINERS, ids=lambda m: m.__name__)
def test_in_place_operator_on_any_container_state_leaves_states_dicts_alone(make):
    # Every kind with a ``copy`` is copied before ``+=`` (a list always was; a
    # deque, a list subclass or a UserList was changed in place, and with it a
    # states dict handed out before, or the states given to ``freeze``).
    model, plain = _Log(make), _PlainLog(make)
    f, states = model.functionalize()
    kept = list(states["items"])
    model(2.0)
    plain(2.0)
    assert list(model.items) == list(plain.items) == [1.0, 2.0]
    assert type(model.items) is make
    assert list(states["items"]) == kept  # the eager call did not reach f's states
    _, new = f(states, 3.0)
    assert list(new["items"]) == [1.0, 3.0] and list(states["items"]) == kept
    frozen = autostate.freeze(f, new)
    frozen(4.0)
    assert list(frozen.items) == [1.0, 3.0, 4.0]
    assert list(new["items"]) == [1.0, 3.0]  # freeze's states are values too


@pytest.mark.parametrize("make", _CONTAINERS, ids=lambda m: m.__name__)
def test_in_place_operator_copies_every_container_kind_alike(make):
    model = _Log(make)
    before = model.items
    model(2.0)
    assert list(before) == [1.0]  # as a list state always kept it
    assert model.items is not before


@autostate.stateful
class _Pusher:
    def __init__(self, log):
        self.log = log
        self.push = log.append

    def __call__(self, x):
        self.push(x)
        return x


@pytest.mark.parametrize(
    "make", [list, MyList, collections.deque, MyDeque], ids=lambda m: m.__name__
)
def test_a_builtin_method_of_any_mutable_container_is_refused_alike(make):
    # f's copy of the model gets its own copy of the container; the method
    # would still append to the original's.
    with pytest.raises(InvalidTypeError, match="is a method of a"):
        _Pusher(make()).functionalize()


@autostate.stateful
class _Leaf:
    def __init__(self):
        self.w = jnp.ones(2)


@autostate.stateful
class _Holder:
    def __init__(self, held):
        self.held = held

    def __call__(self, x):
        return x


@pytest.mark.parametrize("make", [collections.deque, MyDeque], ids=lambda m: m.__name__)
def test_a_model_in_any_sealed_collection_is_refused_alike(make):
    with pytest.raises(InvalidTypeError, match="which functionalize\\(\\) follows"):
        _Holder(make([_Leaf()])).functionalize()


@pytest.mark.parametrize(
    ("make", "change"),
    [
        (lambda: [1, 2], lambda c: c.append(3)),
        (lambda: {"a": 1}, lambda c: c.update(b=2)),
        (lambda: collections.OrderedDict(a=1, c=3), lambda c: c.move_to_end("a")),
        (lambda: collections.defaultdict(list, a=[1]), lambda c: c["b"].append(2)),
        (lambda: collections.Counter("aab"), lambda c: c.update("b")),
        (lambda: {1, 2}, lambda c: c.add(3)),
        (lambda: bytearray(b"ab"), lambda c: c.extend(b"c")),
        (lambda: collections.deque([1, 2], maxlen=3), lambda c: c.appendleft(0)),
        (lambda: type("L", (list,), {})([1]), lambda c: c.insert(0, 5)),
    ],
)
def test_a_mutable_kind_compares_and_restores_its_contents_in_place(
    make: Callable[[], Any], change: Callable[[Any], None]
) -> None:
    c = make()
    kind = values.kind_of(c)
    contents = kind.copy(c)
    assert kind.same(c, contents)
    change(c)
    assert not kind.same(c, contents)
    kind.restore(c, contents)
    assert kind.same(c, contents) and c == make() and list(c) == list(make())


@pytest.mark.parametrize(
    "value",
    [
        collections.deque([1, 2], maxlen=2),
        collections.UserDict(a=1),
        collections.UserList([1]),
        collections.OrderedDict(a=1),
        type("L", (list,), {})([1, 2]),
    ],
)
def test_a_container_subclass_is_filled_by_its_kind(value: Any) -> None:
    kind = values.kind_of(value)
    new = type(value).__new__(type(value))
    kind.fill(new, kind.items(value), getattr(value, "maxlen", None))
    assert type(new) is type(value) and new == value
    assert getattr(new, "maxlen", None) == getattr(value, "maxlen", None)


def test_is_iterator_is_decided_per_type():
    assert values.is_iterator(iter([1])) and values.is_iterator(x for x in ())
    assert not values.is_iterator([1]) and not values.is_iterator(jnp.zeros(1))


def test_own_value_copies_containers_and_makes_numpy_arrays_jax_arrays():
    array = jnp.ones(2)
    assert values.own_value(array) is array
    got = values.own_value(np.ones(2))
    assert isinstance(got, jax.Array)
    inner = [array]
    value = {"xs": inner}
    copy = values.own_value(value)
    assert copy == value and copy is not value and copy["xs"] is not inner
    assert copy["xs"][0] is array
    frozen = (1, 2)
    assert values.own_value(frozen) is frozen
