"""``autostate.guard``: a call changes nothing outside its states.

Each case changes a small model outside its states inside ``f`` (eagerly and
under ``jax.jit``) or inside the traced body of a ``lax`` call, and checks
that the guard refuses it with the right error and puts the model back as it
was before the call; and that what plain Python keeps (an eager ``f`` that
appends to a list) is kept.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import autostate
from autostate.errors import EscapedStateError, StateAccessError, TracedValueError


def _assign(obj, name, value):
    """``obj.<name> = value`` from a helper the decorator never saw."""
    setattr(obj, name, value)


@autostate.stateful
class Sub:
    def __init__(self) -> None:
        self.v = jnp.ones(2)


@autostate.stateful
class Model:
    def __init__(self) -> None:
        self.w = jnp.full(2, 2.0)  # a parameter
        self.count = jnp.zeros(())  # a state
        self.log: list = []  # a mutable static: no method assigns it
        self.sub = Sub()

    def __call__(self, x):
        self.count = self.count + 1.0
        return x * self.w

    def add_attribute(self, x):
        vars(self)["extra"] = x
        return x

    def replace_attribute(self, x):
        self.__dict__["w"] = self.w * 0
        return x

    def delete_attribute(self, x):
        del vars(self)["log"]
        return x

    def append(self, x):
        self.log.append(x)
        return x

    def swap_submodel(self, x):
        _assign(self, "sub", Sub())
        return x

    def catch_refusal(self, x):
        try:
            _assign(self, "log", [x])  # not a state: refused as it happens
        except StateAccessError:
            pass  # caught: raised again when the call returns
        return x

    def branch(self, x):
        if self.count > 0:  # a traced state used where Python needs a bool
            return x
        return -x


def _calls(f):
    """``f``'s method caller eagerly and under ``jax.jit``."""
    return {"f": f, "jit": jax.jit(f)}


def _snapshot(model):
    return dict(vars(model)), list(model.log), model.sub


def _assert_put_back(f, before):
    d, log, sub = before
    assert dict(vars(f.model)).keys() == d.keys()
    assert all(vars(f.model)[k] is v for k, v in d.items())
    assert f.model.log == log
    assert f.model.sub is sub


@pytest.mark.parametrize("mode", ["f", "jit"])
@pytest.mark.parametrize(
    ("method", "change"),
    [
        ("add_attribute", "added Model.extra"),
        ("replace_attribute", "replaced Model.w"),
        ("delete_attribute", "removed Model.log"),
    ],
)
def test_an_attribute_changed_in_the_instance_dict_is_refused_and_put_back(mode, method, change):
    f, states = Model().functionalize()
    before = _snapshot(f.model)
    call = getattr(f, method)
    if mode == "jit":
        call = jax.jit(call)
    with pytest.raises(StateAccessError, match=change):
        call(states, jnp.ones(2))
    _assert_put_back(f, before)
    out, new = f(states, jnp.ones(2))  # f goes on as before
    assert jnp.array_equal(out, jnp.full(2, 2.0)) and float(new["count"]) == 1.0


def test_a_mutable_static_changed_under_jit_is_refused_and_put_back():
    f, states = Model().functionalize()
    before = _snapshot(f.model)
    with pytest.raises(StateAccessError, match=r"outside its states \(at Model.log\)"):
        jax.jit(f.append)(states, jnp.ones(2))
    _assert_put_back(f, before)


def test_a_mutable_static_changed_eagerly_is_kept_as_plain_python_keeps_it():
    f, states = Model().functionalize()
    out, _ = f.append(states, jnp.ones(2))
    assert len(f.model.log) == 1 and f.model.log[0] is out


@autostate.stateful
class WithIndex:
    def __init__(self) -> None:
        self.positions = jnp.arange(2)  # an int array: travels in the states dict
        self.log: list = []

    def __call__(self, x):
        self.log.append(x)
        return x + self.positions


def test_a_mutable_static_changed_on_a_copy_of_the_model_is_refused_eagerly():
    f, states = WithIndex().functionalize()
    with pytest.raises(StateAccessError, match="runs on a copy of f's model"):
        f(states, jnp.ones(2))
    assert f.model.log == []


@pytest.mark.parametrize("mode", ["f", "jit"])
def test_a_swapped_submodel_is_refused_and_put_back(mode):
    f, states = Model().functionalize()
    before = _snapshot(f.model)
    with pytest.raises(StateAccessError, match="Model.sub holds .* a sub-model"):
        _calls(f.swap_submodel)[mode](states, jnp.ones(2))
    _assert_put_back(f, before)


@pytest.mark.parametrize("mode", ["f", "jit"])
def test_a_caught_write_refusal_is_raised_again_when_the_call_returns(mode):
    f, states = Model().functionalize()
    before = _snapshot(f.model)
    with pytest.raises(StateAccessError, match="Model.log is not state") as info:
        _calls(f.catch_refusal)[mode](states, jnp.ones(2))
    assert any("raised again" in note for note in info.value.__notes__)
    _assert_put_back(f, before)


def test_a_traced_value_used_as_a_bool_is_explained_under_jit():
    f, states = Model().functionalize()
    with pytest.raises(TracedValueError, match="A traced value is used where Python needs"):
        jax.jit(f.branch)(states, jnp.ones(2))
    out, _ = f.branch(states, jnp.ones(2))  # eagerly the value is concrete
    assert jnp.array_equal(out, -jnp.ones(2))


def _raw_scan_writes(model, xs):
    """A helper the decorator never saw: a raw lax.scan whose body assigns state."""

    def body(carry, x):
        model.count = model.count + x
        return carry, x

    jax.lax.scan(body, 0.0, xs)


@autostate.stateful
class Escapes:
    def __init__(self) -> None:
        self.count = jnp.zeros(())

    def __call__(self, xs):
        self.count = self.count + 0
        _raw_scan_writes(self, xs)
        return xs


@pytest.mark.parametrize("mode", ["f", "jit"])
def test_a_state_holding_a_tracer_of_a_finished_body_is_refused(mode):
    f, states = Escapes().functionalize()
    with pytest.raises(EscapedStateError, match="State 'count'"):
        _calls(f)[mode](states, jnp.ones(3))


@autostate.stateful
class Looped:
    def __init__(self) -> None:
        self.items = [jnp.zeros(())]  # not a state: no method assigns self.items
        self.total = jnp.zeros(())

    def __call__(self, xs):
        def body(carry, x):
            self.items.append(x)  # a tracer of the body into a container outside the states
            self.total = self.total + x
            return carry, x

        jax.lax.scan(body, 0.0, xs)
        return self.total


@pytest.mark.parametrize("mode", ["eager", "f", "jit"])
def test_a_lax_body_putting_its_tracer_in_a_container_is_refused_and_put_back(mode):
    model = Looped()
    held = model.items[0]
    if mode == "eager":
        call, target = (lambda: model(jnp.ones(3))), model
    else:
        f, states = model.functionalize()
        target = f.model
        held = target.items[0]
        run = f if mode == "f" else jax.jit(f)
        call = lambda: run(states, jnp.ones(3))  # noqa: E731
    with pytest.raises(EscapedStateError, match=r"changed Looped.items in place"):
        call()
    assert len(target.items) == 1 and target.items[0] is held
