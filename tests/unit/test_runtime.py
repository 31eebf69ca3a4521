"""autostate.runtime's write path: one table of slot kinds, one fast path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerance import tolerance

import autostate
from autostate import runtime
from autostate.effects import (
    FrozenLocalStateRequest,
    HandledLocalStateRef,
    InitialLocalStateRequest,
    StateSlot,
)
from autostate.errors import StateAccessError, TracedEagerStateError
from autostate.state_values import HandledStaticState


@autostate.stateful
class Counter:
    def __init__(self):
        self.n = jnp.zeros(())
        self.sub = None

    def step(self, v):
        self.n = v
        return self.n

    def attach(self, sub):
        self.sub = sub


class _OtherSlot(StateSlot):
    """A slot of another engine (as a host store is): a foreign slot."""

    __slots__ = ("value", "category")

    def __init__(self, value):
        self.value, self.category = value, "state"

    def read(self):
        return self.value

    def write(self, value, label=None):
        self.value = value


def test_each_slot_type_has_one_kind():
    kind = runtime.slot_kind
    assert kind(InitialLocalStateRequest) is kind(FrozenLocalStateRequest)
    assert kind(FrozenLocalStateRequest).eager_request and kind(FrozenLocalStateRequest).jax_values
    assert kind(HandledLocalStateRef).handled and kind(HandledLocalStateRef).jax_values
    assert kind(HandledStaticState).handled and not kind(HandledStaticState).jax_values
    foreign = kind(_OtherSlot)
    assert foreign.is_slot and not (foreign.handled or foreign.eager_request or foreign.jax_values)
    assert not kind(type(None)).is_slot and not kind(Counter).is_slot
    assert runtime.is_slot(FrozenLocalStateRequest(1.0, "state")) and not runtime.is_slot(3)


def test_an_eager_write_changes_a_sole_request_in_place_and_a_shared_one_by_copy():
    m = Counter()
    m.step(jnp.ones(()))  # the first write makes a FrozenLocalStateRequest
    request = m.__dict__["n"]
    assert type(request) is FrozenLocalStateRequest
    rid = id(request)
    del request
    m.step(jnp.full((), 2.0))
    assert id(m.__dict__["n"]) == rid  # nothing else held it: changed in place
    held = m.__dict__["n"]
    m.step(jnp.full((), 3.0))  # another holder: a new request, the old one keeps its value
    assert m.__dict__["n"] is not held and float(held.state) == 2.0
    assert float(m.n) == 3.0


def test_eager_writes_from_a_method_and_from_outside_take_one_path():
    m = Counter()
    m.step(jnp.ones(()))
    m.n = jnp.full((), 5.0)  # guarded_setattr -> store_state
    assert float(m.n) == 5.0
    m.n = np.float32(2.0)  # numpy becomes a jax array, as under jax.jit
    assert isinstance(m.__dict__["n"].state, jax.Array) and float(m.n) == 2.0


def test_a_tracer_is_refused_on_an_eager_model():
    m = Counter()
    m.step(jnp.ones(()))
    with pytest.raises(TracedEagerStateError):
        jax.jit(m.step)(jnp.ones(()))
    assert float(m.n) == 1.0


def test_a_foreign_slot_takes_its_own_write():
    m = Counter()
    slot = _OtherSlot(jnp.zeros(()))
    dict.__setitem__(m.__dict__, "n", slot)
    m.step(jnp.full((), 4.0))
    assert m.__dict__["n"] is slot and float(slot.value) == 4.0


def test_a_sub_model_replaces_a_placeholder_eagerly_and_is_refused_in_f():
    m = Counter()
    f, states = m.functionalize()
    with pytest.raises(StateAccessError):
        f.attach(states, Counter())
    m.attach(Counter())
    assert isinstance(m.sub, Counter)


def test_handled_writes_land_in_the_call_and_its_states():
    m = Counter()
    f, states = m.functionalize()
    out, new = jax.jit(f.step)(states, jnp.full((), 7.0))
    assert float(out) == 7.0 and float(new["n"]) == 7.0 and float(m.n) == 0.0


# --- PyTorch's in-place tensor methods: one table, compiled once ---

# Arguments for each row of ``INPLACE_TENSOR_METHODS`` and the value it gives
# ``x = [1, 4, 9]`` (what PyTorch's method leaves in ``x``).
_INPLACE_CASES = {
    "add_": ((jnp.ones(3),), {"alpha": 2}, [3.0, 6.0, 11.0]),
    "sub_": ((1.0,), {}, [0.0, 3.0, 8.0]),
    "mul_": ((2.0,), {}, [2.0, 8.0, 18.0]),
    "div_": ((2.0,), {}, [0.5, 2.0, 4.5]),
    "pow_": ((2,), {}, [1.0, 16.0, 81.0]),
    "neg_": ((), {}, [-1.0, -4.0, -9.0]),
    "abs_": ((), {}, [1.0, 4.0, 9.0]),
    "sqrt_": ((), {}, [1.0, 2.0, 3.0]),
    "exp_": ((), {}, list(np.exp([1.0, 4.0, 9.0]))),
    "clamp_": ((), {"min": 2.0, "max": 5.0}, [2.0, 4.0, 5.0]),
    "clamp_min_": ((3.0,), {}, [3.0, 4.0, 9.0]),
    "clamp_max_": ((3.0,), {}, [1.0, 3.0, 3.0]),
    "lerp_": ((jnp.zeros(3), 0.5), {}, [0.5, 2.0, 4.5]),
    "addcmul_": ((jnp.ones(3), jnp.full(3, 2.0)), {"value": 0.5}, [2.0, 5.0, 10.0]),
    "addcdiv_": ((jnp.ones(3), jnp.full(3, 2.0)), {}, [1.5, 4.5, 9.5]),
    "copy_": ((jnp.array([7, 8, 9]),), {}, [7.0, 8.0, 9.0]),
    "zero_": ((), {}, [0.0, 0.0, 0.0]),
    "fill_": ((2,), {}, [2.0, 2.0, 2.0]),
    "masked_fill_": ((jnp.array([True, False, True]), -1.0), {}, [-1.0, 4.0, -1.0]),
}


def test_every_inplace_method_of_the_table_is_a_method_of_the_target() -> None:
    from autostate.transform.method import INPLACE_TENSOR_METHODS

    assert set(_INPLACE_CASES) == set(INPLACE_TENSOR_METHODS)

    class Holder:
        x = jnp.array([1.0, 4.0, 9.0])

    for method, (args, kwargs, expected) in _INPLACE_CASES.items():
        holder = Holder()
        target = runtime.inplace_attribute(holder, "x")
        assert getattr(target, method).__name__ == method
        value = getattr(target, method)(*args, **kwargs).value
        np.testing.assert_allclose(holder.x, expected, **tolerance(rtol=1e-6, atol=0.0), err_msg=method)
        assert value is holder.x and holder.x.dtype == jnp.float32 and holder.x.shape == (3,)


def test_a_leaf_jax_does_not_flatten_is_held_as_state_as_is():
    # (a ShapeDtypeStruct recursed in as_state_value until RecursionError)
    spec = jax.ShapeDtypeStruct((2,), jnp.float32)

    @autostate.stateful
    class Declared:
        def __init__(self):
            self.kv = autostate.state(spec, category="cache")

        def __call__(self, x):
            self.kv = x
            return x

    model = Declared()
    assert model.kv == spec  # what the plain class holds
    _, states = model.functionalize()
    assert states["kv"] == spec
    model(jnp.ones(2))
    np.testing.assert_array_equal(model.kv, np.ones(2))
