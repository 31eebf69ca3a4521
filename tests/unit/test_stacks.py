"""``autostate/stacks.py``: building a stack, its sequence protocol, names and pytree."""

from __future__ import annotations

import copy
import pickle
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autostate
from autostate import stacks
from autostate.errors import InvalidTypeError, StackError, TracedEagerStateError, TracedValueError

Loader = Callable[..., types.ModuleType]

LAYERS = """
import jax
import jax.numpy as jnp
import autostate


@autostate.stateful
class Norm:
    def __init__(self, n, act="tanh"):
        self.scale = jnp.ones(n)
        self.mean = jnp.zeros(n)
        self.act = act

    def __call__(self, x):
        self.mean = 0.9 * self.mean + 0.1 * x
        return (x - self.mean) * self.scale


@autostate.stateful
class Pair:
    def __init__(self, n):
        self.a = Norm(n)
        self.b = self.a  # one sub-model under two names

    def __call__(self, x):
        return self.b(self.a(x))


@autostate.stateful
class Model:
    def __init__(self, n, depth):
        self.blocks = autostate.stack([Norm(n) for _ in range(depth)])
        self.head = jnp.ones(n)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x @ self.head


@autostate.stateful
class Floating:
    def __init__(self):
        self.scale = 1.0

    def __call__(self, x):
        self.scale = self.scale * 0.5
        return x * self.scale
"""


def _with(layer: Any, **arrays: Any) -> Any:
    for name, value in arrays.items():
        setattr(layer, name, value)
    return layer


@pytest.fixture
def mod(write_module: Loader) -> types.ModuleType:
    return write_module(LAYERS)


def test_a_stack_of_layers_holds_their_arrays_on_a_leading_axis(mod: types.ModuleType) -> None:
    layers = [mod.Norm(3) for _ in range(4)]
    layers[2].mean = jnp.full(3, 2.0, jnp.float32)  # (strong, as the others' zeros)
    s = autostate.stack(layers)
    assert len(s) == s.depth == 4
    assert type(s.stacked) is mod.Norm
    np.testing.assert_array_equal(s.stacked.mean[2], jnp.full(3, 2.0))
    assert s.scale.shape == (4, 3) and s.act == "tanh"  # the stacked model's attributes
    layers[0].mean = jnp.ones(3)  # the layers given are not part of the stack
    np.testing.assert_array_equal(s.stacked.mean[0], jnp.zeros(3))


def test_a_stacked_model_is_taken_as_it_is(mod: types.ModuleType) -> None:
    stacked = jax.vmap(lambda _: mod.Norm(3))(jnp.arange(5))
    s = autostate.stack(stacked)
    assert s.stacked is stacked and len(s) == 5
    assert autostate.stack(s) is s


def test_a_stack_keeps_what_a_layer_shares_inside_itself(mod: types.ModuleType) -> None:
    s = autostate.stack([mod.Pair(2), mod.Pair(2)])
    assert s.stacked.a is s.stacked.b
    layer = s[1]
    assert layer.a is layer.b


@pytest.mark.parametrize(
    ("build", "pattern"),
    [
        (lambda m: [m.Norm(3), m.Norm(4)], "Layer 1 differs from layer 0 at scale: f32\\[4\\] against f32\\[3\\]"),
        (lambda m: [m.Norm(3), m.Norm(3, act="relu")], "Layer 1 differs from layer 0 at act: 'relu' against 'tanh'"),
        (lambda m: [m.Norm(2), m.Pair(2)], "Layer 1 differs from layer 0 at the layer: a Pair against a Norm"),
        # A weakly typed array takes its input's dtype: stacked with strong ones it
        # would not (x_bf16 * w is bfloat16 in the loop over the layers, float32 stacked).
        (lambda m: [m.Norm(3), _with(m.Norm(3), mean=jnp.full(3, 2.0))],
         r"Layer 1 differs from layer 0 at mean: f32\[3\] \(weakly typed\) against f32\[3\]"),
        (lambda m: [], "got no layers"),
        (lambda m: [m.Floating(), m.Floating()], "State 'scale' of layer 0 holds a Python float"),
    ],
)
def test_layers_that_cannot_be_one_stack_are_refused_with_the_first_difference(
    mod: types.ModuleType, build: Callable, pattern: str
) -> None:
    with pytest.raises(StackError, match=pattern):
        autostate.stack(build(mod))


def test_layers_sharing_a_sub_model_or_an_array_are_refused(mod: types.ModuleType) -> None:
    shared = mod.Norm(3)
    with pytest.raises(StackError, match="Layers 0 and 1 share one sub-model"):
        autostate.stack([shared, shared])
    a, b = mod.Norm(3), mod.Norm(3)
    b.__dict__["scale"] = a.scale  # one parameter array in both (tied)
    with pytest.raises(StackError, match="Layers 0 and 1 share one array .*'scale'"):
        autostate.stack([a, b])


def test_what_is_not_a_layer_or_not_stacked_is_refused(mod: types.ModuleType) -> None:
    with pytest.raises(InvalidTypeError, match="Layer 1 .* is a int"):
        autostate.stack([mod.Norm(2), 3])
    with pytest.raises(InvalidTypeError, match="takes a list of layers"):
        autostate.stack(3)
    unstacked = mod.Norm(3)
    unstacked.mean = jnp.zeros(4)
    with pytest.raises(StackError, match="Norm is not stacked: its array 'mean' is f32\\[4\\], where"):
        autostate.stack(unstacked)


def test_indexing_a_stack_is_indexing_its_list_of_layers(mod: types.ModuleType) -> None:
    s = autostate.stack([mod.Norm(3) for _ in range(3)])
    for i in range(3):
        s.stacked.mean = s.stacked.mean.at[i].set(i)
    assert [float(layer.mean[0]) for layer in s] == [0.0, 1.0, 2.0]
    assert float(s[-1].mean[0]) == 2.0
    assert [float(layer.mean[0]) for layer in s[1:]] == [1.0, 2.0]
    assert [float(layer.mean[0]) for layer in reversed(s)] == [2.0, 1.0, 0.0]
    with pytest.raises(IndexError, match="out of range"):
        s[3]
    with pytest.raises(AttributeError, match="call methods on a layer"):
        s.missing  # noqa: B018
    with pytest.raises(InvalidTypeError, match="not a layer: it cannot be called"):
        s(jnp.ones(3))


def test_a_layer_chosen_by_a_traced_index_is_refused_with_the_ways_that_work(
    mod: types.ModuleType,
) -> None:
    model = mod.Model(3, 3)
    model.blocks.stacked.scale = jnp.arange(9.0).reshape(3, 3)
    f, states = model.functionalize()
    x = jnp.ones(3)

    def traced_index(f: Any, states: Any, i: Any) -> Any:
        return f.blocks[i](x)

    with pytest.raises(TracedValueError, match="chosen by a traced index") as err:
        jax.jit(traced_index)(f, states, 1)
    assert isinstance(err.value, jax.errors.ConcretizationTypeError)
    assert "jax.lax.switch" in str(err.value) and "self.layers.w[i]" in str(err.value)
    # The two ways the error names: lax.switch over the layers, the stacked arrays indexed.
    expected = copy.deepcopy(model)
    switched = autostate.jit(lambda m, i: autostate.switch(i, list(m.blocks), x))
    np.testing.assert_allclose(switched(model, 1), expected.blocks[1](x))
    np.testing.assert_allclose(model.blocks.mean, expected.blocks.mean)  # layer 1's write
    np.testing.assert_allclose(jax.jit(lambda i: model.blocks.scale[i])(2), [6.0, 7.0, 8.0])


def test_a_layer_reads_and_writes_its_slice(mod: types.ModuleType) -> None:
    s = autostate.stack([mod.Norm(3) for _ in range(2)])
    layer = s[1]
    assert type(layer) is mod.Norm and layer.scale.shape == (3,)
    layer(jnp.ones(3))
    np.testing.assert_allclose(s.stacked.mean, [[0, 0, 0], [0.1, 0.1, 0.1]])
    layer.mean = jnp.full(3, 5.0)  # from outside the class: a state write
    np.testing.assert_allclose(s.stacked.mean[1], [5, 5, 5])
    with pytest.raises(StackError, match="assigned i32\\[3\\], but its slice .* f32\\[3\\]"):
        layer.mean = jnp.zeros(3, jnp.int32)
    with pytest.raises(autostate.errors.StateAccessError, match="layer of a stack"):
        layer.act = "relu"


def test_a_layer_given_a_tracer_by_jax_jit_names_the_way_that_works(
    mod: types.ModuleType,
) -> None:
    # (the refusal advised autostate.jit of the layer, which refuses it too)
    model, x = mod.Model(3, 2), jnp.ones(3)
    for traced in (
        lambda: jax.jit(lambda layer, x: layer(x))(model.blocks[1], x),
        lambda: jax.jit(lambda x: model.blocks[1](x))(x),
    ):
        with pytest.raises(TracedEagerStateError, match="Norm.mean of layer 1") as err:
            traced()
        assert "autostate.jit(lambda m, x: m.blocks[0](x))(model, x)" in str(err.value)
    np.testing.assert_allclose(model.blocks.mean, np.zeros((2, 3)))
    autostate.jit(lambda m, x: m.blocks[1](x))(model, x)  # the way it names
    np.testing.assert_allclose(model.blocks.mean, [[0, 0, 0], [0.1, 0.1, 0.1]], rtol=1e-6)


def test_state_names_pass_through_the_stack(mod: types.ModuleType) -> None:
    model = mod.Model(3, 4)
    f, states = model.functionalize()
    assert sorted(states) == ["blocks.mean"] and states["blocks.mean"].shape == (4, 3)
    assert list(autostate.param_dict(model)) == ["blocks.scale", "head"]
    assert stacks.stacks_in(model) == {"blocks": 4}
    frozen = autostate.freeze(f, states)
    assert type(frozen.blocks) is autostate.Stack and len(frozen.blocks) == 4


def test_a_stack_is_a_pytree_and_pickles(mod: types.ModuleType) -> None:
    s = autostate.stack([mod.Norm(3) for _ in range(2)])
    doubled = jax.tree.map(lambda a: 2 * a, s)
    assert type(doubled) is autostate.Stack and len(doubled) == 2
    np.testing.assert_array_equal(doubled.scale, 2 * s.scale)
    def paths(tree: object) -> list[str]:
        return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]

    # JAX's own key entries: the stack's one child is its attribute ``stacked``
    # (names, and f's keypaths, skip it: ``blocks.scale``).
    assert paths(s) == [".stacked" + p for p in paths(s.stacked)]
    back = pickle.loads(pickle.dumps(s))
    assert len(back) == 2 and back.act == "tanh"
    np.testing.assert_array_equal(back.scale, s.scale)


def test_a_stack_sliced_outside_a_decorated_method_says_what_to_call(mod: types.ModuleType) -> None:
    # Plain jax.lax.scan gives each step a Stack of one layer's arrays: iterating it
    # says so (autostate.scan gives each step one layer).
    s = autostate.stack([mod.Norm(3) for _ in range(2)])

    def body(x, step):
        return list(step)[0](x), None

    with pytest.raises(StackError, match="(?s)lacks the layer axis .* autostate.scan"):
        jax.lax.scan(body, jnp.ones(3), s)
    out, _ = autostate.scan(lambda x, layer: (layer(x), None), jnp.ones(3), s)
    assert out.shape == (3,) and s.stacked.mean.shape == (2, 3)


def test_a_gradient_reads_a_stack_as_the_model_does(mod: types.ModuleType) -> None:
    # f (and a gradient shaped like it) reads a stack attribute as the stack, not as
    # a method to call: grads.blocks.scale has the layer axis.
    f, states = mod.Model(3, 4).functionalize()
    grads = jax.grad(lambda f: f(states, jnp.ones(3))[0])(f)
    assert type(grads.blocks) is autostate.Stack and grads.blocks.scale.shape == (4, 3)


def test_stacking_gives_each_annotation_the_layer_axis(mod: types.ModuleType) -> None:
    # A layer's spec is written for the layer; the stack's arrays have the layer axis
    # in front, unsplit or split over the axis the stack names.
    from jax.sharding import PartitionSpec as P

    layers = [mod.Norm(3) for _ in range(2)]
    for layer in layers:
        layer.scale = autostate.sharded(layer.scale, P("model"))
    for axis in (None, "stage"):
        s = autostate.stack(layers, layer_axis=axis)
        specs, _ = autostate.partition_specs(*autostate.functionalize(s.stacked))
        assert specs.model.scale == P(axis, "model")
    assert autostate.partition_specs(*autostate.functionalize(layers[0]))[0].model.scale == P("model")
