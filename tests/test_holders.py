"""What a model holds outside plain containers: each holder is either
followed by ``functionalize()`` (f's copy then reads and writes f's states, as
plain Python's model reads and writes its own) or refused with an error that
names the path — never a silent write to the eager model.

- Weak references: ``weakref.ref`` and ``weakref.WeakMethod`` are rebound to
  f's copy; ``weakref.proxy`` cannot be (a proxy gives no way to its
  referent) and is refused.
- Containers: subclasses of list, tuple and dict that are registered pytrees
  (``OrderedDict``, ``defaultdict``, a ``NamedTuple``) are walked like the
  builtins; any other subclass is one opaque leaf, so a model or an array in
  it is refused, like one inside a plain object.
- A list or dict *state* changed in place (by a helper outside the class,
  through an alias) never changes the states dict a call was given, the
  dict ``functionalize()`` returned, or the one ``freeze`` was given.
"""

from __future__ import annotations

import collections
import typing
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autostate
from autostate.errors import InvalidTypeError


@autostate.stateful
class Stats:
    def __init__(self):
        self.mean = jnp.zeros(())

    def observe(self, x):
        self.mean = self.mean + x
        return self.mean


def _stats_of(model):
    return model.stats


@autostate.stateful
class Observer:
    def __init__(self, how):
        self.stats = Stats()
        if how == "ref":
            self.reach = weakref.ref(self.stats)
        elif how == "method":
            self.reach = weakref.WeakMethod(self.stats.observe)
        else:
            self.reach = weakref.proxy(self.stats)
        self.how = how

    def __call__(self, x):
        if self.how == "ref":
            return self.reach().observe(x)
        if self.how == "method":
            return self.reach()(x)
        return self.reach.observe(x)


@pytest.mark.parametrize("how", ["ref", "method"])
def test_weak_references_follow_fs_copy(how: str) -> None:
    model = Observer(how)
    f, states = model.functionalize()
    out, new = f(states, 2.0)
    assert float(out) == 2.0 and float(new["stats.mean"]) == 2.0
    out, new = jax.jit(lambda f, s, x: f(s, x))(f, new, 3.0)
    assert float(out) == 5.0 and float(new["stats.mean"]) == 5.0
    assert float(model.stats.mean) == 0.0  # the eager model is its own
    frozen = autostate.freeze(f, new)
    assert float(frozen(1.0)) == 6.0 and float(frozen.stats.mean) == 6.0
    assert float(model(1.0)) == 1.0


def test_a_weak_proxy_to_a_model_is_refused_with_the_path() -> None:
    model = Observer("proxy")
    assert float(model(1.0)) == 1.0  # eagerly it is plain Python
    with pytest.raises(InvalidTypeError, match=r"weakref.proxy.*\(at reach\)") as info:
        model.functionalize()
    assert f"{__file__}:" in str(info.value) and "weakref.ref" in str(info.value)


class Plain:
    def __init__(self, held):
        self.held = held


class MyDict(dict):
    pass


class MyList(list):
    pass


class Pair(typing.NamedTuple):
    a: typing.Any
    b: typing.Any


HOLDERS = {
    "OrderedDict": lambda v: collections.OrderedDict(a=v),
    "defaultdict": lambda v: collections.defaultdict(int, a=v),
    "NamedTuple": lambda v: Pair(v, 0),
    "MyDict": lambda v: MyDict(a=v),
    "MyList": lambda v: MyList([v]),
}
WALKED = {"OrderedDict", "defaultdict", "NamedTuple"}


@autostate.stateful
class Holding:
    def __init__(self, holder, what):
        self.n = jnp.zeros(())
        inner = {"model": Stats(), "array": jnp.ones(()), "plain": Plain(jnp.ones(()))}[what]
        self.extra = HOLDERS[holder](inner)

    def first(self):
        extra = self.extra
        return extra["a"] if isinstance(extra, dict) else extra[0]

    def __call__(self, x):
        first = self.first()
        if isinstance(first, Stats):
            return first.observe(x)
        self.n = self.n + x
        return self.n


@pytest.mark.parametrize("holder", list(HOLDERS))
def test_a_sub_model_in_a_container_subclass(holder: str) -> None:
    model = Holding(holder, "model")
    if holder in WALKED:
        f, states = model.functionalize()
        out, new = jax.jit(lambda f, s, x: f(s, x))(f, states, 2.0)
        assert float(out) == 2.0 and float(model.first().mean) == 0.0
        assert sorted(float(v) for v in new.values()) == [0.0, 2.0]
    else:
        with pytest.raises(InvalidTypeError, match=rf"{holder}.*register") as info:
            model.functionalize()
        assert f"{__file__}:" in str(info.value)


@pytest.mark.parametrize("holder", list(HOLDERS))
@pytest.mark.parametrize("what", ["array", "plain"])
def test_an_array_in_a_container_subclass(holder: str, what: str) -> None:
    model = Holding(holder, what)
    if holder in WALKED and what == "array":
        f, states = model.functionalize()  # a parameter, as in a dict
        assert len(jax.tree_util.tree_leaves(f)) == 1
        return
    with pytest.raises(InvalidTypeError, match="holds an array inside") as info:
        model.functionalize()
    assert f"{__file__}:" in str(info.value)


def grow(model, x):
    model.items += [x]  # outside the class: the list changed in place


def alias_append(model, x):
    items = model.items
    items.append(x)


@autostate.stateful
class Growing:
    def __init__(self):
        self.items = [jnp.zeros(())]

    def reset(self):
        self.items = [jnp.zeros(())]

    def add(self, x, helper):
        helper(self, x)
        return len(self.items)


@pytest.mark.parametrize("helper", [grow, alias_append], ids=["iadd", "alias"])
def test_list_states_changed_in_place_never_change_a_callers_dict(helper) -> None:
    model = Growing()
    f, states = model.functionalize()
    helper(model, 1.0)  # the eager model's list: not the states dict's
    assert len(model.items) == 2 and len(states["items"]) == 1
    out1, new1 = f.add(states, 2.0, helper)
    out2, _ = f.add(states, 2.0, helper)
    assert out1 == out2 == 2 and len(states["items"]) == 1 and len(new1["items"]) == 2
    frozen = autostate.freeze(f, new1)
    helper(frozen, 3.0)
    assert len(frozen.items) == 3 and len(new1["items"]) == 2
    np.testing.assert_allclose(jnp.stack(new1["items"]), [0.0, 2.0])
