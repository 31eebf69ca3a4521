"""``vars(self)`` and ``self.__dict__`` inside methods of a decorated class.

A model keeps each state's slot in its instance dict; a method reading the
dict must see what plain Python's holds, the values, and what it writes
through the dict must reach the model as plain Python's write would. Every
case runs the plain class and the decorated one (``differential.pair``)
eagerly, through ``f``, under ``jax.jit`` and after ``freeze``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from differential import Loader, assert_same, check, pair  # noqa: I001 - tests/ is on sys.path

import autostate
from autostate.errors import StateAccessError

X1 = jnp.float32(1.5)

SOURCE = """
import builtins


def vars(obj):  # noqa: A001 - a module that shadows the builtin
    return {"shadowed": 1.0}


@DECORATE
class Buffers:
    def __init__(self):
        self.w = jnp.ones(3)            # a parameter
        self.mean = jnp.zeros(3)        # states
        self.count = jnp.zeros((), jnp.int32)
        self.training = True            # a static state
        self.name = "bn"

    def __call__(self, x):
        self.mean = 0.9 * self.mean + 0.1 * x
        self.count += 1
        return (x - self.mean) * self.w

    def train(self, on):
        self.training = on
        return 0.0

    def buffers(self):
        return {k: v for k, v in self.__dict__.items() if isinstance(v, jax.Array)}

    def arrays_sum(self, x):
        d = builtins.vars(self)
        return sum(jnp.sum(v) for v in d.values() if isinstance(v, jax.Array)) * x

    def protocol(self, x):
        d = self.__dict__
        return [
            len(d), "mean" in d, len(sorted(d)), d.get("count"), d["mean"] * x,
            dict(d)["count"], {**d}["mean"], d.copy()["count"], len(list(d.keys())[:2]),
            d == dict(d), d["training"], d["name"] == "bn", len(d.items()),
            jax.tree_util.tree_leaves(d)[0], jnp.sum(jnp.stack([v for v in d.values()
                                                                if isinstance(v, jax.Array)
                                                                and v.shape == (3,)])),
        ]

    def load(self, sd):
        self.__dict__.update(sd)
        return self.mean.sum()

    def set_item(self, x):
        self.__dict__["mean"] = self.__dict__["mean"] + x
        self.__dict__["count"] += 1
        return self.mean

    def set_default(self, x):
        got = self.__dict__.setdefault("mean", x)
        self.__dict__.setdefault("extra_default", 0)
        return got

    def ior(self, x):
        d = self.__dict__
        d |= {"mean": d["mean"] * x}
        return self.mean

    def shadowed(self):
        return vars(self)["shadowed"]

    def live(self, x):
        d = self.__dict__
        self.mean = self.mean + x
        return d["mean"]  # the dict is live: it sees the write


@DECORATE
class Outer:
    def __init__(self):
        self.inner = Buffers()
        self.scale = jnp.full((), 2.0)

    def __call__(self, x):
        out = self.inner(x)
        return out * self.scale

    def inner_buffers(self):
        return len([k for k, v in builtins.vars(self.inner).items() if isinstance(v, jax.Array)])

    def bump_inner(self, x):
        self.inner.__dict__["count"] = self.inner.count + 10
        return self.inner.count
"""


def _pair(write_module: Loader):
    return pair(write_module, SOURCE)


@pytest.mark.parametrize(
    "calls",
    [
        [("__call__", (X1,)), ("buffers", ()), ("__call__", (X1,)), ("buffers", ())],
        [("__call__", (X1,)), ("arrays_sum", (X1,))],
        [("__call__", (X1,)), ("protocol", (X1,))],
        [("set_item", (X1,)), ("set_item", (X1,)), ("__call__", (X1,))],
        [("set_default", (X1,)), ("__call__", (X1,))],
        [("__call__", (X1,)), ("ior", (X1,)), ("__call__", (X1,))],
        [("shadowed", ())],
        [("__call__", (X1,)), ("live", (X1,))],
    ],
    ids=["buffers", "vars", "protocol", "set_item", "setdefault", "ior", "shadowed", "live"],
)
def test_the_instance_dict_like_plain_python(write_module: Loader, calls: list) -> None:
    plain, dec = _pair(write_module)
    modes = ("eager",) if calls[0][0] == "set_default" else ("eager", "f", "jit", "freeze")
    check(plain, dec, "Buffers()", calls, modes=modes)


def test_setdefault_of_a_new_name_inside_f_is_refused(write_module: Loader) -> None:
    """A name that is not state, written into the dict inside ``f``, would be
    lost when the call returns: refused, as ``self.extra = ...`` is."""
    _, dec = _pair(write_module)
    f, states = dec.Buffers().functionalize()
    with pytest.raises(StateAccessError, match="extra_default"):
        f.set_default(states, X1)


def test_load_a_state_dict_through_the_instance_dict(write_module: Loader) -> None:
    plain, dec = _pair(write_module)
    sd = {"mean": jnp.full(3, 2.0), "count": jnp.asarray(7, jnp.int32)}
    check(plain, dec, "Buffers()", [("load", (sd,)), ("__call__", (X1,)), ("buffers", ())])


def test_a_static_state_read_through_the_instance_dict_follows_the_mode(
    write_module: Loader,
) -> None:
    plain, dec = _pair(write_module)
    check(plain, dec, "Buffers()", [("train", (False,)), ("protocol", (X1,))], modes=("eager",))
    model = dec.Buffers()
    model.train(False)
    f, states = model.functionalize()
    out, _ = jax.jit(lambda s, x: f.protocol(s, x))(states, X1)
    assert not bool(out[10])


def test_sub_models_through_the_instance_dict(write_module: Loader) -> None:
    plain, dec = _pair(write_module)
    check(plain, dec, "Outer()", [("__call__", (X1,)), ("inner_buffers", ()),
                                  ("bump_inner", (X1,)), ("__call__", (X1,))])


def test_grad_through_values_read_from_the_instance_dict(write_module: Loader) -> None:
    plain, dec = _pair(write_module)
    ref = plain.Buffers()
    ref(X1)
    expected = jax.grad(lambda x: ref.arrays_sum(x))(X1)
    model = dec.Buffers()
    model(X1)
    f, states = model.functionalize()
    got = jax.grad(lambda x: f.arrays_sum(states, x)[0])(X1)
    assert_same(expected, got, "grad")


def test_sharing_the_instance_dict_itself(write_module: Loader) -> None:
    """``new.__dict__ = self.__dict__`` (the Borg pattern) shares the dict
    object itself, as in plain Python: a write through one is seen by the other."""
    source = """
@DECORATE
class Borg:
    def __init__(self):
        self.x = jnp.zeros(())

    def twin(self):
        new = object.__new__(type(self))
        new.__dict__ = self.__dict__
        return new

    def step(self, v):
        self.x = self.x + v
        return self.x
"""
    plain, dec = pair(write_module, source)
    for module in (plain, dec):
        model = module.Borg()
        twin = model.twin()
        model.step(jnp.float32(2.0))
        twin.step(jnp.float32(3.0))
        assert float(model.x) == float(twin.x) == 5.0, module


def test_vars_from_outside_the_class_holds_the_slots() -> None:
    """Documented: code outside a decorated class (not rewritten) sees each
    state's slot in ``vars(model)``, and ``model.x`` the value."""

    @autostate.stateful
    class Counter:
        def __init__(self):
            self.n = jnp.zeros(())

        def step(self):
            self.n += 1

    model = Counter()
    model.step()
    assert not isinstance(vars(model)["n"], jax.Array)
    assert float(model.n) == 1.0
    np.testing.assert_allclose(np.asarray(vars(model)["n"].read()), 1.0)


BASE_SOURCE = """
class Module:  # an undecorated user base, as a PyTorch user writes one
    def buffers(self):
        return {k: v for k, v in vars(self).items() if isinstance(v, jax.Array)}

    def num_arrays(self):
        return len(self.__dict__) and sum(
            1 for v in self.__dict__.values() if isinstance(v, jax.Array))

    def l2(self):
        return sum(jnp.sum(v ** 2) for v in self.buffers().values())


class Middle(Module):
    pass


@DECORATE
class Net(Middle):
    def __init__(self):
        self.w = jnp.full(2, 2.0)
        self.mean = jnp.zeros(2)

    def __call__(self, x):
        self.mean = self.mean + x
        return self.w * x + self.l2()


class PlainChild(Module):
    def __init__(self):
        self.v = jnp.ones(3)
"""


def test_an_undecorated_base_method_reads_the_states_values(write_module: Loader) -> None:
    """A helper of an undecorated base that walks ``vars(self)`` sees the
    states' values on a decorated subclass (its copy is rewritten with the
    subclass), eagerly, in f, under jit and after freeze."""
    plain, dec = pair(write_module, BASE_SOURCE)
    calls = [("__call__", (X1,)), ("buffers", ()), ("num_arrays", ()), ("l2", ()),
             ("__call__", (X1,)), ("buffers", ())]
    check(plain, dec, "Net()", calls)


def test_the_undecorated_base_itself_is_left_as_written(write_module: Loader) -> None:
    plain, dec = pair(write_module, BASE_SOURCE)
    base_fn = vars(dec.Module)["buffers"]
    dec.Net()  # decorates Net (the first use)
    assert vars(dec.Module)["buffers"] is base_fn
    assert "buffers" not in vars(dec.Middle)
    child = dec.PlainChild()
    assert_same(plain.PlainChild().buffers(), child.buffers())
    assert child.num_arrays() == 1
