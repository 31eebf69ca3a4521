"""States held in containers JAX does not flatten.

A ``collections.Counter``, a ``deque``, a ``UserDict`` / ``UserList`` and a
subclass of dict or list are one leaf to JAX, which ``jax.jit`` cannot take.
A state holding one (or holding one inside a dict) travels through the states
dict and a frozen model as its items, and comes back as the same type, with
its ``maxlen`` and its own attributes; an item write copies it as it copies
a dict. Each case is compared with plain Python eagerly, through ``f``, under
``jax.jit`` and ``jax.grad``, and after ``freeze``; a tracer inside such a
container is refused as it is inside a dict.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from differential import Loader, pair

import autostate
import autostate.errors

SOURCE = """
import collections


class Tagged(dict):
    pass


class Items(list):
    pass


def make(kind):
    zero = jnp.zeros(2)
    if kind == "counter":
        return collections.Counter(a=zero, n=0)
    if kind == "dict_subclass":
        box = Tagged(a=zero, n=0)
        box.tag = "kept"
        return box
    if kind == "user_dict":
        return collections.UserDict(a=zero, n=0)
    if kind == "list_subclass":
        return Items([zero, 0])
    if kind == "user_list":
        return collections.UserList([zero, 0])
    if kind == "deque":
        return collections.deque([zero, 0], maxlen=2)
    if kind == "nested":
        return {"inner": collections.Counter(a=zero, n=0), "w": zero}


@DECORATE
class Model:
    def __init__(self, kind):
        self.kind = kind
        self.box = make(kind)
        self.scale = jnp.full(2, 2.0)

    def __call__(self, x):
        if self.kind == "nested":
            inner = self.box["inner"]
            self.box["inner"] = collections.Counter(a=inner["a"] + x * self.scale, n=inner["n"] + 1)
            return self.box["inner"]["a"].sum()
        key_a, key_n = ("a", "n") if isinstance(self.box, (dict, collections.UserDict)) else (0, 1)
        self.box[key_a] = self.box[key_a] + x * self.scale
        self.box[key_n] = self.box[key_n] + 1
        return self.box[key_a].sum()
"""

KINDS = ["counter", "dict_subclass", "user_dict", "list_subclass", "user_list", "deque", "nested"]


def _same_box(expected, got, where: str) -> None:
    """Same type (by name: the plain and decorated modules define their own),
    same items, same ``maxlen`` and own attributes."""
    assert type(expected).__name__ == type(got).__name__, f"{where}: {type(got)}"
    if isinstance(expected, collections.deque):
        assert expected.maxlen == got.maxlen, where
    own = {k: v for k, v in getattr(expected, "__dict__", {}).items() if k != "data"}
    assert own == {k: v for k, v in getattr(got, "__dict__", {}).items() if k != "data"}, where
    items = dict(expected) if hasattr(expected, "keys") else dict(enumerate(expected))
    got_items = dict(got) if hasattr(got, "keys") else dict(enumerate(got))
    assert sorted(items, key=str) == sorted(got_items, key=str), where
    for key, value in items.items():
        if isinstance(value, int):
            assert type(got_items[key]) is int and got_items[key] == value, f"{where}[{key!r}]"
        elif hasattr(value, "keys"):
            _same_box(value, got_items[key], f"{where}[{key!r}]")
        else:
            np.testing.assert_allclose(got_items[key], value, err_msg=f"{where}[{key!r}]")


def _models(write_module: Loader, kind: str):
    plain, dec = pair(write_module, SOURCE)
    return plain.Model(kind), dec.Model(kind)


@pytest.mark.parametrize("kind", KINDS)
def test_eager_f_jit_and_freeze_keep_the_container(write_module: Loader, kind: str) -> None:
    ref, model = _models(write_module, kind)
    xs = [jnp.float32(1.0), jnp.float32(0.5)]
    expected = [float(ref(x)) for x in xs]

    assert [float(model(x)) for x in xs] == pytest.approx(expected)
    _same_box(ref.box, model.box, "eager")

    _, fresh = _models(write_module, kind)
    f, states = fresh.functionalize()
    jitted = jax.jit(lambda f, s, x: f(s, x))
    for mode in ("f", "jit"):
        s = states
        outs = []
        for x in xs:
            out, s = (f if mode == "f" else lambda *a: jitted(f, *a))(s, x)
            outs.append(float(out))
        assert outs == pytest.approx(expected), mode
        _same_box(ref.box, s["box"], f"{mode} states")
    _same_box(fresh.box, _models(write_module, kind)[1].box, "the eager model is unchanged")
    frozen = autostate.freeze(f, s)
    _same_box(ref.box, frozen.box, "frozen")
    assert float(frozen(xs[0])) == pytest.approx(float(ref(xs[0])))


@pytest.mark.parametrize("kind", ["counter", "deque", "nested"])
def test_a_frozen_model_passes_through_jit_as_a_pytree(write_module: Loader, kind: str) -> None:
    _, model = _models(write_module, kind)
    f, states = model.functionalize()
    frozen = autostate.freeze(f, states)
    again = jax.jit(lambda m: m)(frozen)
    _same_box(frozen.box, again.box, "through jit")


@pytest.mark.parametrize("kind", ["counter", "user_list", "nested"])
def test_grad_through_a_state_in_the_container(write_module: Loader, kind: str) -> None:
    ref, model = _models(write_module, kind)
    f, states = model.functionalize()

    def loss(x):
        out, s = f(states, x)
        box = s["box"]["inner"] if kind == "nested" else s["box"]
        first = box["a"] if hasattr(box, "keys") else box[0]
        return out + first.sum()

    # d/dx of 2 * sum(x * scale): the output and the state each give 4.
    assert float(jax.grad(loss)(jnp.float32(1.0))) == pytest.approx(8.0)
    assert float(jax.jit(jax.grad(loss))(jnp.float32(1.0))) == pytest.approx(8.0)


@pytest.mark.parametrize("kind", ["counter", "dict_subclass", "deque"])
def test_a_tracer_in_the_container_of_an_eager_model_is_refused(
    write_module: Loader, kind: str
) -> None:
    _, model = _models(write_module, kind)
    with pytest.raises(autostate.errors.TracedEagerStateError) as info:
        jax.jit(lambda x: model(x))(jnp.float32(1.0))
    assert "test_opaque_containers" not in str(info.value)  # the user's module, not ours
    assert not any(
        isinstance(leaf, jax.core.Tracer)
        for leaf in (model.box.values() if hasattr(model.box, "values") else model.box)
    )


DELETING = """
import collections


class Items(list):
    pass


@DECORATE
class Shrinking:
    def __init__(self, kind):
        zero = jnp.zeros(2)
        if kind == "counter":
            self.box = collections.Counter(a=zero, b=zero + 1)
        elif kind == "user_dict":
            self.box = collections.UserDict(a=zero, b=zero + 1)
        else:
            self.box = Items([zero, zero + 1])

    def drop(self, x):
        del self.box["a" if hasattr(self.box, "keys") else 0]
        return x
"""


@pytest.mark.parametrize("kind", ["counter", "user_dict", "list_subclass"])
def test_del_of_an_item_keeps_the_type(write_module: Loader, kind: str) -> None:
    plain, dec = pair(write_module, DELETING)
    ref = plain.Shrinking(kind)
    ref.drop(1.0)
    model = dec.Shrinking(kind)
    model.drop(1.0)
    _same_box(ref.box, model.box, "eager")
    f, states = dec.Shrinking(kind).functionalize()
    _, after = jax.jit(f.drop)(states, 1.0)
    _same_box(ref.box, after["box"], "jit")

