"""Packed dispatch (``autostate/packing.py``): same numbers as ``f``, fewer buffers."""

from __future__ import annotations

import threading
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from semantics.harness import (
    Loader,
    assert_bits,
    assert_clear,
    assert_same,
    check,
    pair,
    raises_autostate,
    snapshot,
)
from semantics.programs_functional import MODELS, NET, PACK
from semantics.programs_host_fallback import HOST, HOST_COUNTERS
from semantics.programs_shared import PACK_XS, Y
from semantics.programs_shared import XS_PAIRS as XS
from semantics.programs_shared import XV1 as X1
from semantics.programs_shared import XV2 as X2

import autostate
from autostate import errors
from autostate.errors import InvalidTypeError

HERE = __file__


@autostate.stateful
class Tiny:
    def __init__(self, w, b):
        self.w = jnp.asarray(w)
        self.b = jnp.asarray(b)
        self.count = jnp.zeros((), jnp.int32)
        self.total = jnp.zeros(4)

    def __call__(self, x):
        self.count = self.count + 1
        self.total = self.total + x
        return x * self.w + self.b

    def peek(self, x):
        return self.total * x


@autostate.stateful
class Stack:
    def __init__(self, n):
        rng = np.random.default_rng(0)
        self.layers = [
            Tiny(rng.normal(size=4).astype(np.float32), rng.normal(size=(2, 4)).astype(np.float32))
            for _ in range(n)
        ]
        self.scale = jnp.asarray(2.0)  # weak-typed: a buffer of its own

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)[0]
        return x * self.scale


def close(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_packed_step_gives_the_numbers_of_the_unpacked_one():
    f, states = Stack(2).functionalize()
    pf, pstates = autostate.pack(f, states)
    # float32 and weak float32 parameters, float32 and int32 states.
    assert len(pf.buffers) == 2 and pf.loose == []
    assert len(pstates.buffers) == 2 and pstates.loose == []
    assert pf.f.model.scale.weak_type and not pf.f.model.layers[0].w.weak_type
    step = jax.jit(lambda f, s, x: f(s, x))
    x = jnp.arange(4.0)
    for _ in range(3):
        out, states = step(f, states, x)
        pout, pstates = step(pf, pstates, x)
        close(out, pout)
        close(states, pstates.unpack())
    assert pstates.unpack().keys() == states.keys()


def test_the_gradient_of_unpacking_is_one_concatenation_per_buffer():
    # Unpacking splits each buffer once: under jax.grad its transpose is one
    # concatenation, where a slice per leaf would pad each cotangent to the whole
    # buffer (a training step on packed state would grow with leaves x size).
    leaves = [jnp.full((3, 2), float(i)) for i in range(40)] + [jnp.ones(5, jnp.int32)]
    layout = autostate.packing.Layout.of(leaves, None)
    buffers, loose = layout.pack(leaves)
    assert len(buffers) == 2 and not loose
    back = layout.unpack(buffers, loose)
    for a, b in zip(leaves, back):
        assert_bits(a, b)

    def loss(buffer: Any) -> Any:
        floats = [x for x in layout.unpack([buffer, buffers[1]], []) if x.dtype == jnp.float32]
        return sum(((k + 1.0) * x).sum() for k, x in enumerate(floats))

    jaxpr = jax.make_jaxpr(jax.grad(loss))(buffers[0])
    counts: dict[str, int] = {}
    for eqn in jaxpr.jaxpr.eqns:
        counts[eqn.primitive.name] = counts.get(eqn.primitive.name, 0) + 1
    assert counts.get("pad", 0) == 0 and counts.get("dynamic_update_slice", 0) == 0, counts
    assert counts.get("concatenate", 0) == 1, counts
    grad = jax.grad(loss)(buffers[0])
    np.testing.assert_array_equal(grad, np.repeat(np.arange(1.0, 41.0), 6))


def test_repacking_writes_only_the_leaves_that_changed():
    # A compiled call's new buffers: one whose leaves are all the old ones is
    # the old buffer; one with a few changed gets those written over it (in
    # place when donated), not every leaf sliced out and concatenated back;
    # one all of whose leaves changed is packed anew. Each keeps its weak type
    # (the floats are weakly typed, as jnp.full makes them): the next call's layout.
    floats = [jnp.full((2, 2), float(i)) for i in range(6)]
    ints = [jnp.arange(3) + i for i in range(2)]
    halves = [jnp.ones(4, jnp.float16)]
    leaves = floats + ints + halves
    layout = autostate.packing.Layout.of(leaves, None)
    buffers, _ = layout.pack(leaves)

    def step(buffers: list[Any]) -> list[Any]:
        before = layout.unpack(buffers, [])
        after = list(before)
        after[1] = before[1] * 3.0  # (two of the six floats)
        after[4] = before[4] + 1.0
        after[6], after[7] = before[7], before[6]  # (every int)
        return layout.repack(buffers, after, before)

    jaxpr = jax.make_jaxpr(step)(buffers)
    counts: dict[str, int] = {}
    for eqn in jaxpr.jaxpr.eqns:
        counts[eqn.primitive.name] = counts.get(eqn.primitive.name, 0) + 1
    assert counts.get("scatter", 0) == 2, counts  # (a dynamic_update_slice once compiled)
    assert counts.get("concatenate", 0) == 1, counts  # (the ints, packed anew)
    new = jax.jit(step)(buffers)
    assert len(new) == 3
    assert [(b.dtype, b.weak_type) for b in new] == [(b.dtype, b.weak_type) for b in buffers]
    assert autostate.packing.Layout.of(layout.unpack(new, []), None) is layout
    expected = [*floats[:1], floats[1] * 3.0, *floats[2:4], floats[4] + 1.0, floats[5],
                ints[1], ints[0], halves[0]]
    for a, b in zip(expected, layout.unpack(new, []), strict=True):
        assert_bits(a, b)

    def unchanged(buffers: list[Any]) -> list[Any]:
        before = layout.unpack(buffers, [])
        return layout.repack(buffers, list(before), before)

    assert all(a is b for a, b in zip(unchanged(buffers), buffers, strict=True))


def test_eager_calls_of_the_packed_model():
    f, states = Stack(2).functionalize()
    pf, pstates = autostate.pack(f, states)
    x = jnp.ones(4)
    out, new = f(states, x)
    pout, pnew = pf(pstates, x)
    close(out, pout)
    close(new, pnew.unpack())


def test_freeze_takes_the_packed_pair():
    model = Stack(2)
    f, states = model.functionalize()
    pf, pstates = autostate.pack(f, states)
    _, pstates = jax.jit(lambda f, s, x: f(s, x))(pf, pstates, jnp.ones(4))
    frozen = autostate.freeze(pf, pstates)
    assert isinstance(frozen, Stack)
    assert int(frozen.layers[1].count) == 1
    np.testing.assert_array_equal(np.asarray(frozen.layers[0].w), np.asarray(model.layers[0].w))


def test_the_layout_of_returned_states_is_the_one_passed_in():
    f, states = Stack(2).functionalize()
    pf, pstates = autostate.pack(f, states)
    step = jax.jit(lambda f, s, x: f(s, x))
    _, new = step(pf, pstates, jnp.ones(4))
    assert new.layout is pstates.layout


def test_a_packed_model_refuses_an_unpacked_states_dict():
    f, states = Stack(1).functionalize()
    pf, _ = autostate.pack(f, states)
    with pytest.raises(InvalidTypeError, match="PackedStates"):
        pf(states, jnp.ones(4))


def test_other_methods_are_called_through_the_packed_model():
    f, states = Tiny(np.ones(4, np.float32), np.ones(4, np.float32)).functionalize()
    _, states = f(states, jnp.arange(4.0))
    pf, pstates = autostate.pack(f, states)
    out, new = jax.jit(lambda f, s: f.peek(s, 3.0))(pf, pstates)
    expected, expected_states = f.peek(states, 3.0)
    close(out, expected)
    close(new.unpack(), expected_states)


def test_leaves_that_are_not_arrays_travel_on_their_own():
    from autostate.packing import Layout

    leaves, treedef = jax.tree_util.tree_flatten([jnp.ones(2), 3, jnp.zeros((2, 2))])
    layout = Layout.of(leaves, treedef)
    buffers, loose = layout.pack(leaves)
    assert len(buffers) == 1 and loose == [3]
    close(layout.unpack(buffers, loose), leaves)


PACKED = """
@DECORATE
class Tiny:
    def __init__(self, w, with_key=False):
        self.w = jnp.full(3, w)
        self.b = jnp.asarray(0.5)
        self.count = jnp.zeros((), jnp.int32)
        self.ema = jnp.zeros(3, jnp.float32)
        self.half = jnp.zeros(2, jnp.float16)
        self.key = jax.random.key(0) if with_key else jax.random.PRNGKey(0)
        self.flag = True

    def __call__(self, x):
        self.count += 1
        self.ema = 0.9 * self.ema + 0.1 * x
        self.half = self.half + x[:2].astype(jnp.float16)
        self.key, sub = jax.random.split(self.key)
        noise = jax.random.normal(sub, x.shape) * 0.0
        return x * self.w + self.b + noise if self.flag else x

    def reset(self):
        self.ema = jnp.zeros(3, jnp.float32)
        return self.count


@DECORATE
class Stack:
    def __init__(self, n, with_key=False, steps0=None):
        self.layers = [Tiny(1.0 + i / 10, with_key) for i in range(n)]
        self.table = {"a": Tiny(2.0), "b": (jnp.ones(2), jnp.arange(3))}
        self.steps = jnp.zeros(()) if steps0 is None else steps0

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
        self.steps = self.steps + 1.0
        return self.table["a"](x) + self.table["b"][1]

    def reset_all(self):
        return [layer.reset() for layer in self.layers]
"""


def test_pack_equals_unpacked_under_jit(write_module: Loader) -> None:
    _, dec = pair(write_module, PACKED)
    f, states = dec.Stack(2, False, 0.0).functionalize()  # a Python float state too
    pf, pstates = autostate.pack(f, states)
    step = jax.jit(lambda f, s, x: f(s, x))
    x = jnp.arange(3.0)
    for _ in range(3):
        expected, states = step(f, states, x)
        got, pstates = step(pf, pstates, x)
        assert_same(np.asarray(expected), np.asarray(got))
        assert_same(snapshot(states), snapshot(pstates.unpack()))
    r1, states = jax.jit(lambda f, s: f.reset_all(s))(f, states)
    r2, pstates = jax.jit(lambda f, s: f.reset_all(s))(pf, pstates)
    assert_same(snapshot(r1), snapshot(r2))
    assert_same(snapshot(states), snapshot(pstates.unpack()))
    assert_same(snapshot(autostate.freeze(f, states)), snapshot(autostate.freeze(pf, pstates)))


def test_pack_of_host_and_category_models(write_module: Loader) -> None:
    _, dec = pair(write_module, HOST_COUNTERS)
    f, states = dec.Parent().functionalize()
    pf, pstates = autostate.pack(f, states)
    step = jax.jit(lambda f, s, x: f(s, x))
    for x in (1.0, 2.0):
        e, states = step(f, states, x)
        g, pstates = step(pf, pstates, x)
        assert_same(e, g)
    assert_same(snapshot(states), snapshot(pstates.unpack()))
    frozen = autostate.freeze(pf, pstates)
    assert_same(snapshot(autostate.freeze(f, states)), snapshot(frozen))


def test_pack_python_float_state_keeps_its_layout_in_scan(write_module: Loader) -> None:
    src = """
@DECORATE
class Steps:
    def __init__(self):
        self.steps = 0.0
        self.ema = jnp.zeros(3)

    def __call__(self, x):
        self.steps = self.steps + 1.0
        self.ema = self.ema + x
        return x.sum()
"""
    _, dec = pair(write_module, src)
    f, states = dec.Steps().functionalize()
    pf, pstates = autostate.pack(f, states)
    xs = jnp.ones((2, 3))
    s1, o1 = jax.lax.scan(lambda c, x: f(c, x)[::-1], states, xs)
    s2, o2 = jax.lax.scan(lambda c, x: pf(c, x)[::-1], pstates, xs)
    assert_same(np.asarray(o1), np.asarray(o2))
    assert_same(snapshot(s1), snapshot(s2.unpack()))


def _unpacked_states(pstates: Any) -> dict[str, Any]:
    return pstates.unpack()


# also covers a typed PRNG key state (Mixed.key) next to a uint32 one.
@pytest.mark.parametrize("jit", [False, True])
def test_packed_mixed_dtypes_bit_identical_to_unpacked(write_module: Loader, jit: bool) -> None:
    _, dec = pair(write_module, PACK)
    f, states = dec.Mixed(0).functionalize()
    pf, pstates = autostate.pack(f, states)
    wrap = jax.jit if jit else (lambda fn: fn)
    step = wrap(lambda f, s, x: f(s, x))
    for x in PACK_XS:
        out, states = step(f, states, x)
        pout, pstates = step(pf, pstates, x)
        assert_bits(out, pout, "out", bitwise=True)
        assert_bits(states, _unpacked_states(pstates), "states", bitwise=True)
    peek = wrap(lambda f, s, a: f.peek(s, a))
    assert_bits(peek(f, states, 2.0)[0], peek(pf, pstates, 2.0)[0], "peek", bitwise=True)


def test_packed_mixed_dtypes_match_plain_python(write_module: Loader) -> None:
    plain, dec = pair(write_module, PACK)
    check(plain, dec, "Mixed(1)", [("__call__", (x,)) for x in PACK_XS] + [("peek", (3.0,))])
    ref = plain.Mixed(1)
    expected = [ref(x) for x in PACK_XS]
    pf, pstates = autostate.pack(*dec.Mixed(1).functionalize())
    step = jax.jit(lambda f, s, x: f(s, x))
    got = []
    for x in PACK_XS:
        out, pstates = step(pf, pstates, x)
        got.append(out)
    assert_same(expected, got)
    assert_same(snapshot(ref), snapshot(autostate.freeze(pf, pstates)), "frozen packed")


# also covers PACKED's Stack under grad (the same packed f and states, other dtypes).
def test_grad_wrt_packed_f_equals_grad_wrt_f(write_module: Loader) -> None:
    _, dec = pair(write_module, PACK)
    f, states = dec.Mixed(2).functionalize()
    pf, pstates = autostate.pack(f, states)

    def loss(f: Any, s: Any, x: Any) -> Any:
        out, s = f(s, x)
        return out.astype(jnp.float32), s

    (l1, s1), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(f, states, jnp.ones(3))
    (l2, s2), pg = jax.jit(jax.value_and_grad(loss, has_aux=True))(pf, pstates, jnp.ones(3))
    assert_bits(l1, l2, "loss", bitwise=True)
    assert_bits(s1, s2.unpack(), "states", bitwise=True)
    assert isinstance(pg, autostate.PackedModel)
    g_unpacked, _ = pg.unpack(pstates)
    assert_same(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(g_unpacked), "grads")
    gx1 = jax.jit(jax.grad(lambda x: loss(f, states, x)[0]))(jnp.ones(3))
    gx2 = jax.jit(jax.grad(lambda x: loss(pf, pstates, x)[0]))(jnp.ones(3))
    assert_same(gx1, gx2, "grads with respect to the input")


# also covers an optax-style update of a packed f by tree_map with its packed gradient.
def test_sgd_by_tree_map_on_packed_f_tracks_unpacked_training(write_module: Loader) -> None:
    _, dec = pair(write_module, PACK)
    f, states = dec.Mixed(3).functionalize()
    pf, pstates = autostate.pack(f, states)

    def train_step(f: Any, s: Any, x: Any) -> Any:
        def loss(f: Any) -> Any:
            out, new = f(s, x)
            return out.astype(jnp.float32) ** 2, new
        (value, new), g = jax.value_and_grad(loss, has_aux=True)(f)
        f = jax.tree_util.tree_map(lambda p, gr: p - 0.01 * gr.astype(p.dtype)
                                   if jnp.issubdtype(p.dtype, jnp.floating) else p, f, g)
        return value, f, new

    step = jax.jit(train_step)
    for x in PACK_XS * 2:
        v1, f, states = step(f, states, x)
        v2, pf, pstates = step(pf, pstates, x)
        assert_same(v1, v2, "loss")
    f2, s2 = pf.unpack(pstates)
    assert_same(autostate.param_dict(autostate.freeze(f, states)),
                autostate.param_dict(autostate.freeze(f2, s2)), "params")
    assert_bits(states, s2, "states", bitwise=True)


# With test_scan_over_steps_with_packed_carry, also covers PACKED's Stack under
# vmap and scan: the same closed-over packed f and PackedStates carry.
def test_vmap_of_packed_f_over_inputs(write_module: Loader) -> None:
    _, dec = pair(write_module, PACK)
    f, states = dec.Mixed(4).functionalize()
    pf, pstates = autostate.pack(f, states)
    xs = jnp.stack(PACK_XS)
    out, new = jax.jit(jax.vmap(lambda f, s, x: f(s, x), in_axes=(None, None, 0)))(f, states, xs)

    def unpacked(f: Any, s: Any, x: Any) -> Any:
        out, s = f(s, x)
        return out, s.unpack()

    pout, pnew = jax.jit(jax.vmap(unpacked, in_axes=(None, None, 0)))(pf, pstates, xs)
    assert_same(out, pout, "vmap out")
    assert_same(snapshot(new), snapshot(pnew), "vmap states")


def test_scan_over_steps_with_packed_carry(write_module: Loader) -> None:
    plain, dec = pair(write_module, PACK)
    ref = plain.Mixed(5)
    xs = jnp.stack(PACK_XS * 2)
    expected = jnp.stack([ref(x) for x in xs])
    pf, pstates = autostate.pack(*dec.Mixed(5).functionalize())

    def run(pf: Any, pstates: Any, xs: Any) -> Any:
        def body(s: Any, x: Any) -> Any:
            out, s = pf(s, x)
            return s, out
        return jax.lax.scan(body, pstates, xs)

    pstates, outs = jax.jit(run)(pf, pstates, xs)
    assert_same(expected, outs)
    assert_same(snapshot(ref), snapshot(autostate.freeze(pf, pstates)))


def test_donated_packed_states_over_many_steps(write_module: Loader) -> None:
    plain, dec = pair(write_module, PACK)
    ref = plain.Mixed(6)
    pf, pstates = autostate.pack(*dec.Mixed(6).functionalize())
    step = jax.jit(lambda f, s, x: f(s, x), donate_argnums=(1,))
    for x in PACK_XS * 2:
        expected = ref(x)
        out, pstates = step(pf, pstates, x)
        assert_same(expected, out)
    assert_same(snapshot(ref), snapshot(autostate.freeze(pf, pstates)))
    # the eager model continues from the packed values like plain Python
    model = autostate.freeze(pf, pstates)
    assert_same(ref(jnp.ones(3)), model(jnp.ones(3)))
    assert_same(snapshot(ref), snapshot(model))


def test_pack_of_a_category_subset_keeps_the_rest_in_f(write_module: Loader) -> None:
    src = """
@DECORATE
class Dec:
    def __init__(self):
        self.cache = STATE(jnp.zeros(3), category="cache")
        self.pos = STATE(jnp.zeros((), jnp.int32), category="cache")
        self.w = jnp.full(3, 2.0)
        self.frozen_stat = jnp.ones(3)   # a state of category "state", not handled

    def __call__(self, x):
        self.cache = self.cache.at[self.pos % 3].set(x)
        self.pos += 1
        return (self.cache * self.w * self.frozen_stat).sum()

    def bump(self):
        self.frozen_stat = self.frozen_stat + 1
"""
    plain, dec = pair(write_module, src)
    ref = plain.Dec()
    expected = [ref(x) for x in (1.0, 2.0, 3.0, 4.0)]
    f, states = dec.Dec().functionalize("cache")
    assert sorted(states) == ["cache", "pos"]
    pf, pstates = autostate.pack(f, states)
    step = jax.jit(lambda f, s, x: f(s, x))
    got = []
    for x in (1.0, 2.0, 3.0, 4.0):
        out, pstates = step(pf, pstates, x)
        got.append(out)
    assert_same(expected, got)
    assert_same(snapshot(ref), snapshot(autostate.freeze(pf, pstates)))


def test_packed_states_of_another_layout_are_refused(write_module: Loader) -> None:
    _, dec = pair(write_module, PACK)
    pf, pstates = autostate.pack(*dec.Mixed(0).functionalize())
    f, states = dec.Mixed(0).functionalize()
    with pytest.raises(autostate.AutostateError):
        pf(states, jnp.ones(3))


def test_packed_host_model_functionalized_matches_plain(write_module: Loader) -> None:
    plain, dec = pair(write_module, HOST)
    ref = plain.Net()
    pf, pstates = autostate.pack(*dec.Net().functionalize())
    step = jax.jit(lambda f, s, x: f(s, x))
    for x in (XS, XS * 2, -XS):
        expected = ref(x)
        out, pstates = step(pf, pstates, x)
        assert_same(expected, out)
    assert_same(snapshot(ref), snapshot(autostate.freeze(pf, pstates)))


@pytest.mark.parametrize("nested", [False, True])
def test_unpack_of_packed_states_with_batched_states(write_module: Loader, nested: bool) -> None:
    """The family: packed states batched by vmap over the states themselves, and
    by two nested vmaps (two leading axes), unpack to what the unpacked f gives.
    Also covers states that come out batched from unbatched ones."""
    _, dec = pair(write_module, PACK)
    f, states = dec.Mixed(4).functionalize()
    pf, pstates = autostate.pack(f, states)
    xs = jnp.stack(PACK_XS)
    n = xs.shape[0]

    def batch(tree: Any, k: int = n) -> Any:
        return jax.tree_util.tree_map(lambda a: jnp.stack([a] * k), tree)

    step = jax.vmap(lambda f, s, x: f(s, x), in_axes=(None, 0, 0))
    if nested:
        step = jax.vmap(step, in_axes=(None, 0, 0))
        xs = jnp.stack([xs, xs])
        states, pstates = batch(batch(states), 2), batch(batch(pstates), 2)
    else:
        states, pstates = batch(states), batch(pstates)
    step = jax.jit(step)  # one compilation, not each batched primitive's
    _, new = step(f, states, xs)
    _, pnew = step(pf, pstates, xs)
    assert_same(snapshot(new), snapshot(pnew.unpack()), "vmap states")


@pytest.fixture
def mods(write_module: Loader) -> tuple[types.ModuleType, types.ModuleType]:
    return pair(write_module, MODELS)


def test_packed_and_unpacked_states_swapped(mods: Any) -> None:
    _, dec = mods
    f, states = dec.Counter().functionalize()
    pf, pstates = autostate.pack(f, states)
    with raises_autostate(errors.InvalidTypeError) as info:
        pf(states, 1.0)
    assert_clear(info.value, errors.InvalidTypeError, HERE, "PackedStates")
    with raises_autostate(errors.InvalidTypeError) as info:
        f(pstates, 1.0)
    assert_clear(info.value, errors.InvalidTypeError, HERE, "States must be a dict")
    with raises_autostate(errors.InvalidTypeError) as info:
        autostate.freeze(pf, states)
    assert_clear(info.value, errors.InvalidTypeError, HERE, "PackedStates")
    with raises_autostate(errors.MethodNotFoundError) as info:
        pf.nonexistent(pstates)
    assert_clear(info.value, errors.MethodNotFoundError, HERE, "'nonexistent'")


def test_pack_of_a_model_instead_of_f(mods: Any) -> None:
    _, dec = mods
    model = dec.Counter()
    _, states = model.functionalize()
    with raises_autostate(errors.InvalidTypeError) as info:
        pf, pstates = autostate.pack(model, states)
        pf(pstates, 1.0)
    assert_clear(info.value, errors.InvalidTypeError, HERE)


def test_param_dict_of_packed_f(mods: Any) -> None:
    _, dec = mods
    f, states = dec.Counter().functionalize()
    pf, _ = autostate.pack(f, states)
    try:
        got = autostate.param_dict(pf)
    except errors.InvalidTypeError as err:
        assert_clear(err, errors.InvalidTypeError, HERE, "pack")
        return
    assert sorted(got) == sorted(autostate.param_dict(f))


def _trained(plain: types.ModuleType, dec: types.ModuleType, scale: float = 1.0) -> tuple[Any, Any]:
    ref, model = plain.Net(scale), dec.Net(scale)
    for x in (X1, X2, X1):
        ref(x)
        model(x)
    return ref, model


def test_pack_equals_unpacked_under_jit_and_grad(write_module: Loader) -> None:
    plain, dec = pair(write_module, NET)
    ref, model = _trained(plain, dec)
    f, states = model.functionalize()
    pf, ps = autostate.pack(f, states)
    lr = 0.05

    def train(f: Any, s: Any, x: Any) -> Any:
        (loss, s), g = jax.value_and_grad(lambda f: f.loss(s, x, Y), has_aux=True)(f)
        return loss, jax.tree_util.tree_map(lambda p, g: p - lr * g, f, g), s

    train_j = jax.jit(train)
    for x in (X1, X2):
        loss, f, states = train_j(f, states, x)
        ploss, pf, ps = train_j(pf, ps, x)
        assert_same(loss, ploss, "packed loss")
        assert_same(autostate.param_dict(f), autostate.param_dict(pf), "packed params")
        assert_same(autostate.state_dict(f, states), autostate.state_dict(pf, ps), "packed states")
    assert_same(snapshot(autostate.freeze(f, states)), snapshot(autostate.freeze(pf, ps)), "frozen")
    f2, s2 = pf.unpack(ps)
    assert_same(autostate.param_dict(f), autostate.param_dict(f2), "unpacked f")
    assert_same(dict(states), dict(s2), "unpacked states")
    # a packed model of a frozen packed model, eagerly
    ref_model = autostate.freeze(f, states)
    assert_same(ref_model(X1), autostate.freeze(pf, ps)(X1), "eager after pack")


@autostate.stateful
class Counter:
    def __init__(self):
        self.count = jnp.zeros(())
        self.w = jnp.ones(2)

    def __call__(self, x):
        self.count += 1
        return x * self.w * self.count

    def scaled(self, x, k):
        self.count += 1
        return x * k


def assert_clear_api_misuse_fixes(err: BaseException, exc_type: type[BaseException], *needles: str) -> None:
    assert isinstance(err, exc_type), f"{type(err).__name__}: {err}"
    assert isinstance(err, autostate.AutostateError)
    text = str(err)
    assert f"{__file__}:" in text, f"no user line in: {text}"
    assert "fix:" in text, f"no fix in: {text}"
    for needle in needles:
        assert needle in text, f"{needle!r} not in: {text}"


def test_load_into_a_packed_f_is_refused() -> None:
    f, states = Counter().functionalize()
    pf, _ = autostate.pack(f, states)
    with pytest.raises(errors.InvalidTypeError) as info:
        autostate.load_state_dict(pf, {"count": jnp.ones(())})
    assert_clear_api_misuse_fixes(info.value, errors.InvalidTypeError, "got the pf", "autostate.freeze(pf")


def test_pack_of_a_model_is_refused() -> None:
    model = Counter()
    _, states = model.functionalize()
    with pytest.raises(errors.InvalidTypeError) as info:
        autostate.pack(model, states)
    assert_clear_api_misuse_fixes(info.value, errors.InvalidTypeError, "the model Counter", "functionalize()")


def test_pack_twice_and_pack_of_bad_states_are_refused() -> None:
    f, states = Counter().functionalize()
    pf, pstates = autostate.pack(f, states)
    for bad in (lambda: autostate.pack(pf, pstates), lambda: autostate.pack(f, pstates)):
        with pytest.raises(errors.InvalidTypeError) as info:
            bad()
        assert_clear_api_misuse_fixes(info.value, errors.InvalidTypeError, "packed already")
    with pytest.raises(errors.InvalidTypeError) as info:
        autostate.pack(f, list(states.values()))
    assert_clear_api_misuse_fixes(info.value, errors.InvalidTypeError, "got list")
    with pytest.raises(errors.InvalidTypeError) as info:
        autostate.pack([f], states)
    assert_clear_api_misuse_fixes(info.value, errors.InvalidTypeError, "got list")


def test_param_dict_and_state_dict_of_a_packed_f() -> None:
    f, states = Counter().functionalize()
    _, states = f(states, jnp.ones(2))
    pf, pstates = autostate.pack(f, states)
    got = autostate.param_dict(pf)
    want = autostate.param_dict(f)
    assert sorted(got) == sorted(want) == ["w"]
    for key in want:
        np.testing.assert_array_equal(got[key], want[key])
    got_states = autostate.state_dict(pf, pstates)
    assert sorted(got_states) == ["count"]
    np.testing.assert_array_equal(got_states["count"], 1.0)
    # inside a jitted step, as for f
    jitted = jax.jit(autostate.state_dict)(pf, pstates)
    np.testing.assert_array_equal(jitted["count"], 1.0)


def test_state_dict_of_a_packed_f_with_wrong_states() -> None:
    f, states = Counter().functionalize()
    pf, _ = autostate.pack(f, states)
    with pytest.raises(errors.InvalidTypeError) as info:
        autostate.state_dict(pf)
    assert_clear_api_misuse_fixes(info.value, errors.InvalidTypeError, "state_dict(pf, pstates)")
    with pytest.raises(errors.InvalidTypeError) as info:
        autostate.state_dict(pf, states)
    assert_clear_api_misuse_fixes(info.value, errors.InvalidTypeError, "PackedStates")


# --- lazy packed values (what autostate.jit leaves a model between calls) ----------


def test_unpacked_values_are_arrays_of_their_own_never_a_buffer():
    from autostate.packing import Layout, PackedValues

    one, two = jnp.arange(3.0), jnp.ones((2, 2))
    layout = Layout.of([one, two, 1.5], None)
    alone = Layout.of([one], None)  # (a buffer of one array unpacks to itself)
    for lay, leaves, at in ((layout, [one, two, 1.5], (0, 1)), (alone, [one], (0,))):
        buffers = lay.pack(leaves)[0]
        holder = PackedValues(lay, at, buffers, threading.RLock())
        values = holder.materialize()
        assert holder.materialize() is values  # (made once per buffers)
        assert all(v is not b for v in values for b in buffers)
        for b in buffers:
            b.delete()  # (a call donates them)
        assert [v.tolist() for v in values] == [x.tolist() for x in leaves[: len(at)]]


def test_a_lazy_attribute_reads_as_a_plain_attribute():
    from autostate.packing import LazyAttribute, lazy_attribute_allowed

    class Holder:
        w = 1.0

    class Sub(Holder):
        pass

    class Own:
        pass

    assert not lazy_attribute_allowed(Holder, "w")  # (the class has its own `w`)
    assert lazy_attribute_allowed(Own, "v") and type(vars(Own)["v"]) is LazyAttribute
    assert lazy_attribute_allowed(Own, "v")  # (installed once)
    obj = Own()
    with pytest.raises(AttributeError, match="'Own' object has no attribute 'v'"):
        _ = obj.v
    with pytest.raises(AttributeError, match="type object 'Own' has no attribute 'v'"):
        _ = Own.v
    assert not hasattr(Own, "v")
    obj.v = 3
    assert obj.v == 3 and vars(obj) == {"v": 3}
    del obj.v
    assert not hasattr(obj, "v")
    lazy_attribute_allowed(Holder, "u")
    assert lazy_attribute_allowed(Sub, "u") and "u" not in vars(Sub)  # (the base's serves)
