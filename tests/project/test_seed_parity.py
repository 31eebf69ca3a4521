"""Seed parity (issue 15): the engine against penzai v1's local state, the host
fallback against equinox's experimental ``StateIndex``.

Each test translates a check of the seed (its values and messages) and runs it
against autostate.
"""

from __future__ import annotations

import copy
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autostate
from autostate import (
    FrozenLocalStateRequest,
    InitialLocalStateRequest,
    SharedLocalStateRequest,
    embed_shared_state_requests,
    handle_local_states,
    hoist_shared_state_requests,
    rename_local_states,
)
from autostate.errors import (
    AutostateError,
    HostStateChangeError,
    HostStateError,
    HostStateTypeError,
    StateSharingError,
)

# --- penzai v1: hoist / embed ---------------------------------------------------


def test_hoist_leaves_names_used_once_in_place():
    once = FrozenLocalStateRequest(1, "c", name="once")
    hoisted, bindings = hoist_shared_state_requests([once])
    assert hoisted == [once] and hoisted[0] is once
    assert bindings == {}


def test_penzai_hoist_and_embed_round_trip():
    # penzai v1's test_hoist_shared_state_requests, value for value.
    shared_initial = InitialLocalStateRequest(lambda: 10, name="foo", category="a")
    hoistable = [
        [
            shared_initial,
            shared_initial,
            FrozenLocalStateRequest(state=20, name="bar", category="b"),
            SharedLocalStateRequest(name="bar", category="b"),
            SharedLocalStateRequest(name="foo", category="a"),
        ],
        [
            SharedLocalStateRequest(name="foo", category="a"),
            SharedLocalStateRequest(name="bar", category="b"),
        ]
        * 3,
    ]
    hoisted, bindings = hoist_shared_state_requests(hoistable)
    assert hoisted[0] == [
        SharedLocalStateRequest("foo", "a"),
        SharedLocalStateRequest("foo", "a"),
        SharedLocalStateRequest("bar", "b"),
        SharedLocalStateRequest("bar", "b"),
        SharedLocalStateRequest("foo", "a"),
    ]
    assert bindings == {"foo": shared_initial, "bar": FrozenLocalStateRequest(20, "b", "bar")}
    re_embedded = embed_shared_state_requests(hoisted[1], bindings)
    assert re_embedded == [
        shared_initial,
        FrozenLocalStateRequest(state=20, name="bar", category="b"),
        SharedLocalStateRequest(name="foo", category="a"),
        SharedLocalStateRequest(name="bar", category="b"),
        SharedLocalStateRequest(name="foo", category="a"),
        SharedLocalStateRequest(name="bar", category="b"),
    ]


def test_hoist_rejects_one_frozen_request_used_twice():
    frozen = FrozenLocalStateRequest(jnp.ones(2), "c", name="kv")
    with pytest.raises(StateSharingError) as info:
        hoist_shared_state_requests([frozen, frozen])
    assert isinstance(info.value, ValueError)
    assert (
        "Detected two local states with the same explicit name 'kv' but different "
        "initializers or values! This is only allowed `unsafe` is set to `True`."
    ) in str(info.value)
    hoisted, bindings = hoist_shared_state_requests([frozen, frozen], unsafe=True)
    assert hoisted == [SharedLocalStateRequest("kv", "c")] * 2 and bindings["kv"] is frozen


def test_embed_rejects_mismatched_categories():
    hoisted = [SharedLocalStateRequest("kv", "cache")]
    with pytest.raises(ValueError) as info:
        embed_shared_state_requests(hoisted, {"kv": FrozenLocalStateRequest(1.0, "state", "kv")})
    assert isinstance(info.value, StateSharingError)
    assert "Tried to substitute values with mismatched categories! Got state, expected cache" in (
        str(info.value)
    )


# --- penzai v1: parameter renaming -------------------------------------------------


def test_requests_rename_their_explicit_names_only():
    def prefix(name):
        return "enc." + name

    def init():
        return 0.0

    named = InitialLocalStateRequest(init, "c", name="n")
    assert named.with_renamed_parameters(prefix) == InitialLocalStateRequest(init, "c", "enc.n")
    unnamed = InitialLocalStateRequest(init, "c")
    assert unnamed.with_renamed_parameters(prefix) is unnamed
    frozen = FrozenLocalStateRequest(jnp.ones(2), "c", name="k")
    renamed = frozen.with_renamed_parameters(prefix)
    assert renamed.name == "enc.k" and renamed.state is frozen.state and renamed.category == "c"
    unnamed_frozen = FrozenLocalStateRequest(jnp.ones(2), "c")
    assert unnamed_frozen.with_renamed_parameters(prefix) is unnamed_frozen
    assert SharedLocalStateRequest("k", "c").with_renamed_parameters(prefix) == (
        SharedLocalStateRequest("enc.k", "c")
    )
    with pytest.raises(TypeError, match="rename_fn returned int 3 for state 'n'"):
        named.with_renamed_parameters(lambda name: 3)


@autostate.stateful
class Block:
    def __init__(self):
        self.kv = autostate.state(jnp.zeros(2), category="cache", name="kv")
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.kv = self.kv + x
        self.calls += 1
        return self.kv.sum()


@autostate.stateful
class Pair:
    def __init__(self, blocks):
        self.blocks = blocks

    def __call__(self, x):
        return self.blocks[1](self.blocks[0](x))


def test_rename_local_states_keeps_composed_parts_apart():
    blocks = [Block(), Block()]
    with pytest.raises(StateSharingError, match="same explicit name 'kv'"):
        handle_local_states(blocks, category="cache")
    renamed = [
        rename_local_states(blocks[0], lambda name: "enc." + name),
        rename_local_states(blocks[1], lambda name: "dec." + name),
    ]
    handler, states = handle_local_states(renamed, category="cache")
    assert sorted(states) == ["dec.kv", "enc.kv"]
    # The originals are untouched; path-named states keep their path names.
    assert blocks[0].__dict__["kv"].name == "kv"
    with pytest.raises(autostate.errors.InvalidTypeError, match="hold them in a model"):
        autostate.functionalize(renamed)  # a list: f's structure is one model's graph
    f, all_states = autostate.functionalize(Pair(renamed))
    assert sorted(all_states) == ["blocks[0].calls", "blocks[1].calls", "dec.kv", "enc.kv"]
    out, all_states = jax.jit(lambda f, s, x: f(s, x))(f, all_states, 1.0)
    assert float(out) == 4.0 and float(all_states["blocks[1].calls"]) == 1

    tree = {
        "a": FrozenLocalStateRequest(1.0, "c", "x"),
        "b": SharedLocalStateRequest("x", "c"),
        "c": FrozenLocalStateRequest(2.0, "c"),
    }
    out = rename_local_states(tree, str.upper)
    assert out == {
        "a": FrozenLocalStateRequest(1.0, "c", "X"),
        "b": SharedLocalStateRequest("X", "c"),
        "c": tree["c"],
    }
    assert autostate.rename_local_states is rename_local_states
    with pytest.raises(TypeError, match="rename_fn must be a function"):
        rename_local_states(tree, "enc.")


def test_every_new_error_is_an_autostate_error():
    with pytest.raises(AutostateError):
        embed_shared_state_requests(
            [SharedLocalStateRequest("kv", "a")], {"kv": FrozenLocalStateRequest(1.0, "b", "kv")}
        )


# --- equinox StateIndex: the host fallback ------------------------------------------

CALLBACK = re.compile(r"python_\w*callback")


@autostate.stateful(fallback="host")
class Index:
    """equinox's StateIndex with get_state/set_state, as a host-fallback model."""

    def __init__(self, like):
        self.value = autostate.state(like)

    def set(self, value):
        self.value = value

    def get(self):
        return self.value


def scalar_index():
    return Index(jax.ShapeDtypeStruct((), jnp.int32))


def test_shape_dtype_and_structure_changes_are_runtime_errors_as_in_the_seed():
    # equinox test_no_change_shape: both raise RuntimeError (inside jax.jit).
    index1 = scalar_index()
    index1.set(jnp.array(1))

    @jax.jit
    def set_state1():
        index1.set(jnp.array(1))
        index1.set(jnp.array([2]))

    with pytest.raises(RuntimeError) as info:
        set_state1()
    assert isinstance(info.value, HostStateChangeError) and isinstance(info.value, TypeError)
    assert "State Index.value changed shape from () to (1,)" in str(info.value)

    pair = Index({"a": jax.ShapeDtypeStruct((), jnp.int32)})
    with pytest.raises(RuntimeError, match="Index.value changed pytree structure"):
        jax.jit(lambda: pair.set([jnp.array(1)]))()
    with pytest.raises(RuntimeError, match="changed dtype from int32 to float32"):
        index1.set(jnp.array(1.0))
    # Not an array at all stays the seed's TypeError, and is not a RuntimeError.
    with pytest.raises(TypeError) as info:
        index1.set("one")
    assert isinstance(info.value, HostStateTypeError) and not isinstance(info.value, RuntimeError)
    # Every host error is an AutostateError that subclasses the seed's builtin.
    with pytest.raises(RuntimeError) as info:
        scalar_index().get()  # get before set
    assert isinstance(info.value, AutostateError)
    with pytest.raises(RuntimeError) as info:
        autostate.inference_mode(index1).set(jnp.array(3))  # set in inference mode
    assert isinstance(info.value, AutostateError)


@autostate.stateful(fallback="host")
class BatchNorm:
    """equinox.experimental.BatchNorm (v0.10), written with host-fallback state."""

    def __init__(self, input_size, axis_name, eps=1e-5, channelwise_affine=True, momentum=0.99):
        self.weight = jnp.ones((input_size,)) if channelwise_affine else None
        self.bias = jnp.zeros((input_size,)) if channelwise_affine else None
        self.first_time = jnp.array(True)
        self.running_mean = jnp.zeros((input_size,))
        self.running_var = jnp.ones((input_size,))
        self.axis_name = axis_name
        self.eps = eps
        self.channelwise_affine = channelwise_affine
        self.momentum = momentum

    def __call__(self, x, inference=False):
        def stats(y):
            mean = jax.lax.pmean(jnp.mean(y), self.axis_name)
            var = jax.lax.pmean(jnp.mean((y - mean) ** 2), self.axis_name)
            return mean, var

        batch_mean, batch_var = jax.vmap(stats)(x)
        if inference:
            running_mean, running_var = self.running_mean, self.running_var
        else:
            first = self.first_time
            running_mean = jnp.where(first, batch_mean, self.running_mean)
            running_var = jnp.where(first, batch_var, self.running_var)
            self.first_time = jnp.array(False)
            running_mean = (1 - self.momentum) * batch_mean + self.momentum * running_mean
            running_var = (1 - self.momentum) * batch_var + self.momentum * running_var
            self.running_mean = jax.lax.stop_gradient(running_mean)
            self.running_var = jax.lax.stop_gradient(running_var)

        def norm(y, m, v, w, b):
            out = (y - m) / jnp.sqrt(v + self.eps)
            if self.channelwise_affine:
                out = out * w + b
            return out

        if self.channelwise_affine:
            return jax.vmap(norm)(x, running_mean, running_var, self.weight, self.bias)
        return jax.vmap(lambda y, m, v: norm(y, m, v, None, None))(x, running_mean, running_var)


def test_equinox_batch_norm_keeps_shared_running_statistics_shared():
    # equinox's test_batch_norm (v0.10), shape for shape.
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    x1 = jax.random.uniform(keys[0], (10, 5))
    x2 = jax.random.uniform(keys[1], (10, 5, 6))
    x3 = jax.random.uniform(keys[2], (10, 5, 7, 8))

    bn = BatchNorm(5, "batch")
    for x in (x1, x2, x3):
        assert jax.vmap(bn, axis_name="batch")(x).shape == x.shape
        assert bn.running_mean.shape == (5,) and bn.running_var.shape == (5,)
    assert bn.first_time.shape == () and not bool(bn.first_time)

    bn = BatchNorm(5, "batch")
    inner = jax.vmap(bn, axis_name="batch", in_axes=1, out_axes=1)
    assert jax.vmap(inner)(x2).shape == x2.shape
    assert bn.running_mean.shape == (10, 5) and bn.running_var.shape == (10, 5)
    assert jax.vmap(inner, axis_name="not-batch")(x2).shape == x2.shape
    assert bn.running_mean.shape == (10, 5) and bn.running_var.shape == (10, 5)

    # Switching to a different amount of batching: the seed's RuntimeError.
    with pytest.raises(RuntimeError) as info:
        jax.vmap(bn, axis_name="batch")(x1)
    assert not isinstance(info.value, ValueError)
    assert "BatchNorm.running_mean holds per-example values for vmap axes of sizes (10, None)" in (
        str(info.value)
    )

    bn = BatchNorm(6, ("batch1", "batch2"))
    assert jax.vmap(jax.vmap(bn, axis_name="batch1"), axis_name="batch2")(x2).shape == x2.shape
    assert bn.running_mean.shape == (6,)

    x1alt = jax.random.normal(jax.random.PRNGKey(5678), (10, 5))
    bn = BatchNorm(5, "batch", channelwise_affine=False)
    out = jax.vmap(bn, axis_name="batch")(x1alt)
    true_out = (x1alt - jnp.mean(x1alt, axis=0)) / jnp.sqrt(jnp.var(x1alt, axis=0) + 1e-5)
    np.testing.assert_allclose(out, true_out, rtol=1e-5, atol=1e-5)

    bn = BatchNorm(5, "batch")
    jax.vmap(bn, axis_name="batch")(x1)
    mean1, var1 = bn.running_mean, bn.running_var
    jax.vmap(bn, axis_name="batch")(3 * x1 + 10)
    assert not np.allclose(mean1, bn.running_mean) and not np.allclose(var1, bn.running_var)
    mean2 = bn.running_mean
    jax.vmap(lambda x: bn(x, inference=True), axis_name="batch")(3 * x1 + 10)
    np.testing.assert_array_equal(mean2, bn.running_mean)

    bn = BatchNorm(5, "batch")
    grad = jax.grad(lambda x: jnp.sum(jax.vmap(bn, axis_name="batch")(x)))(
        jax.random.normal(keys[3], (1, 5))
    )
    assert grad.shape == (1, 5)
    # Under jax.jit the same, and a second call reuses the compiled program.
    bn = BatchNorm(5, "batch")
    step = jax.jit(jax.vmap(bn, axis_name="batch"))
    step(x1)
    step(x1)
    assert bn.running_mean.shape == (5,)


@autostate.stateful(fallback="host")
class Totals:
    def __init__(self):
        self.seen = jnp.array(False)
        self.total = jnp.zeros(())
        self.per_example = jnp.zeros(())

    def __call__(self, x):
        self.seen = jnp.array(True)  # the same constant for every example
        self.total = self.total + jax.lax.pmean(x, "i")  # the same for every example
        self.per_example = self.per_example + x
        return x


def test_a_write_that_is_the_same_for_every_example_stays_shared():
    for run in (jax.vmap, lambda f, **kw: jax.jit(jax.vmap(f, **kw))):
        t = Totals()
        run(t, axis_name="i")(jnp.arange(4.0))
        assert t.seen.shape == () and bool(t.seen)
        assert t.total.shape == () and float(t.total) == 1.5
        np.testing.assert_allclose(t.per_example, [0.0, 1.0, 2.0, 3.0])
        # Per-example stays per-example even when every example writes one value.
        run(lambda x, t=t: t(x * 0.0), axis_name="i")(jnp.arange(4.0))
        np.testing.assert_allclose(t.per_example, [0.0, 1.0, 2.0, 3.0])


def test_seed_multi_vmap_round_trip_and_mismatched_nesting():
    # equinox test_multi_vmap.
    index = scalar_index()
    set_state = jax.vmap(jax.vmap(index.set))
    get_state = jax.vmap(jax.vmap(lambda y: index.get()))
    get_state_bad = jax.vmap(jax.vmap(lambda y: index.get(), in_axes=0), in_axes=1)
    a = jnp.array([[1, 2]])
    set_state(a)
    np.testing.assert_array_equal(get_state(jnp.array([[3, 4]])), a)
    np.testing.assert_array_equal(jax.jit(get_state)(jnp.array([[3, 4]])), a)
    with pytest.raises(RuntimeError, match=r"vmap axes of sizes \(1, 2\), but it is read under"):
        get_state_bad(jnp.array([[3, 4]]))


@pytest.mark.parametrize("with_jit", [False, True])
def test_inference_view_reads_per_example_state_per_example(with_jit):
    # equinox test_inference_vmap / test_inference_multi_vmap.
    index = scalar_index()
    jax.vmap(index.set)(jnp.array([1, 2]))
    view = autostate.inference_mode(index)
    vmap_get = jax.vmap(lambda m, x: m.get(), in_axes=(None, 0))
    if with_jit:
        vmap_get = jax.jit(vmap_get)
    out = vmap_get(view, jnp.array([3, 4]))
    assert out.shape == (2,)
    np.testing.assert_array_equal(out, [1, 2])
    # A captured view, too.
    np.testing.assert_array_equal(jax.vmap(lambda x: view.get() + 0 * x)(jnp.array([3, 4])), [1, 2])

    nested = scalar_index()
    jax.vmap(jax.vmap(nested.set))(jnp.array([[1, 2]]))
    nested_view = autostate.inference_mode(nested)
    get = jax.vmap(jax.vmap(lambda m, y: m.get(), in_axes=(None, 0)), in_axes=(None, 0))
    bad = jax.vmap(jax.vmap(lambda m, y: m.get(), in_axes=(None, 0)), in_axes=(None, 1))
    if with_jit:
        get, bad = jax.jit(get), jax.jit(bad)
    np.testing.assert_array_equal(get(nested_view, jnp.array([[3, 4]])), [[1, 2]])
    with pytest.raises(RuntimeError) as info:
        bad(nested_view, jnp.array([[3, 4]]))
    assert isinstance(info.value, HostStateError)
    assert "Index.value holds per-example values for vmap axes of sizes (1, 2)" in str(info.value)


def test_inference_view_captured_by_jit_bakes_the_value_in():
    # equinox test_inference_jit_closure.
    index = scalar_index()
    index.set(jnp.array(1))
    view = autostate.inference_mode(index)
    traces = []

    @jax.jit
    def f():
        traces.append(1)
        return view.get() + 1

    assert int(f()) == 2
    index.set(jnp.array(2))
    assert int(f()) == 2  # not updated: passed in via closure
    assert len(traces) == 1
    assert not CALLBACK.findall(f.lower().compile().as_text())
    # Passed as an argument, the view follows the store.
    g = jax.jit(lambda m: m.get() + 1)
    assert int(g(view)) == 3
    assert not CALLBACK.findall(g.lower(view).compile().as_text())


# --- host writes in loops under jax.grad -----------------------------------------


@autostate.stateful(fallback="host")
class Router:
    """Routes each token to its best expert inside a scan, counting the wins."""

    def __init__(self, n_experts):
        self.wins = jnp.zeros((n_experts,), jnp.int32)
        self.steps = jnp.zeros((), jnp.int32)

    def __call__(self, scale, tokens):
        def body(carry, token):
            self.steps += 1
            self.wins = self.wins.at[jnp.argmax(token)].add(1)
            return carry + scale * token.max(), None

        return jax.lax.scan(body, 0.0, tokens)[0]

    def fori(self, scale, k):
        def body(i, carry):
            self.steps += 1
            return carry * scale

        return jax.lax.fori_loop(0, k, body, 1.0)


TOKENS = jnp.eye(3)[jnp.array([0, 1, 2, 0, 1, 0, 2, 0, 1, 2, 0, 1])]  # wins: [5, 4, 3]


@pytest.mark.parametrize(
    "differentiate",
    [jax.grad, lambda f: jax.jit(jax.grad(f)), lambda f: jax.value_and_grad(f)],
    ids=["grad", "jit-grad", "value_and_grad"],
)
def test_host_writes_in_scan_happen_once_per_step_under_grad(differentiate):
    router = Router(3)
    out = differentiate(lambda scale: router(scale, TOKENS))(2.0)
    grad = out[1] if isinstance(out, tuple) else out
    assert float(grad) == 12.0
    np.testing.assert_array_equal(router.wins, [5, 4, 3])
    assert int(router.steps) == 12

    counter = Router(3)
    out = differentiate(lambda scale: counter.fori(scale, 6))(1.0)
    assert float(out[1] if isinstance(out, tuple) else out) == 6.0
    assert int(counter.steps) == 6


@autostate.stateful(fallback="host")
class Stats:
    def __init__(self):
        self.s = {"count": jnp.zeros((), jnp.int32), "sum": jnp.zeros(())}

    def __call__(self, x):
        self.s = {"count": self.s["count"] + 1, "sum": self.s["sum"] + x}
        return x


def test_batch_axes_are_tracked_per_leaf_of_one_state():
    stats = Stats()
    jax.jit(jax.vmap(stats))(jnp.arange(4.0))
    assert stats.s["count"].shape == () and int(stats.s["count"]) == 1
    np.testing.assert_allclose(stats.s["sum"], [0.0, 1.0, 2.0, 3.0])
    twin = copy.deepcopy(stats)  # a new store with the same per-leaf batch axes
    jax.vmap(twin)(jnp.arange(4.0))
    assert int(twin.s["count"]) == 2
    np.testing.assert_allclose(twin.s["sum"], [0.0, 2.0, 4.0, 6.0])
    np.testing.assert_allclose(stats.s["sum"], [0.0, 1.0, 2.0, 3.0])
    with pytest.raises(HostStateError) as info:
        jax.vmap(stats)(jnp.arange(5.0))
    assert "Stats.s holds per-example values for vmap axes of sizes ((), (4,)) per leaf" in str(
        info.value
    )
