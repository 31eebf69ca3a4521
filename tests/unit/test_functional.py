"""FunctionalModel as a pytree: graph flatten, tied weights, no retrace; subclassing."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autostate


@autostate.stateful
class Linear:
    def __init__(self, n):
        self.w = jnp.arange(n * n, dtype=jnp.float32).reshape(n, n) / 10
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.calls += 1
        return x @ self.w


@autostate.stateful
class Tied:
    def __init__(self):
        self.encoder = Linear(3)
        self.decoder = self.encoder

    def __call__(self, x):
        return self.decoder(self.encoder(x)).sum()


def _loss(f, states, x):
    out, states = f(states, x)
    return out, states


def test_tied_weights_are_one_leaf_with_summed_gradient():
    f, states = Tied().functionalize()
    assert list(states) == ["encoder.calls"] and int(states["encoder.calls"]) == 0
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(f)]
    assert names == [".model.encoder.w"]
    x = jnp.array([1.0, 2.0, 3.0])
    grads, new_states = jax.grad(_loss, has_aux=True)(f, states, x)
    (g,) = jax.tree_util.tree_leaves(grads)
    w = Linear(3).w

    def by_hand(w):
        return ((x @ w) @ w).sum()

    np.testing.assert_allclose(g, jax.grad(by_hand)(w), rtol=1e-6)
    assert int(new_states["encoder.calls"]) == 2


def test_sgd_keeps_tied_weights_tied_through_jit():
    f, states = Tied().functionalize()
    x = jnp.array([1.0, -1.0, 0.5])

    @jax.jit
    def step(f, states, x):
        grads, states = jax.grad(_loss, has_aux=True)(f, states, x)
        return jax.tree_util.tree_map(lambda p, g: p - 0.01 * g, f, grads), states

    for _ in range(3):
        f, states = step(f, states, x)
    model = autostate.freeze(f, states)
    assert model.encoder is model.decoder
    assert int(model.encoder.calls) == 6


def test_jitted_step_does_not_retrace_and_reuses_structure():
    traces = []

    def body(f, states, x):
        traces.append(1)
        return f(states, x)

    step = jax.jit(body)
    f, states = Tied().functionalize()
    for i in range(4):
        out, states = step(f, states, jnp.ones(3) * i)
    assert len(traces) == 1
    assert int(states["encoder.calls"]) == 8
    # Rebuilt from its leaves (as jit does), f is a model again: the same leaves
    # (tied weights once), the same calls and results, and no further trace.
    leaves, treedef = jax.tree_util.tree_flatten(f)
    again = jax.tree_util.tree_unflatten(treedef, [leaf * 2 for leaf in leaves])
    assert again.model.encoder is again.model.decoder
    assert len(jax.tree_util.tree_leaves(again)) == len(leaves)
    for new, old in zip(jax.tree_util.tree_leaves(again), leaves):
        np.testing.assert_array_equal(new, old * 2)
    out_again, states_again = step(again, states, jnp.ones(3))
    assert len(traces) == 1
    w = leaves[0] * 2
    np.testing.assert_allclose(out_again, ((jnp.ones(3) @ w) @ w).sum(), rtol=1e-6)
    assert int(states_again["encoder.calls"]) == 10


def test_functional_model_method_access_and_equality():
    f, states = Tied().functionalize()
    g, again = autostate.freeze(f, states).functionalize()
    # The handler id depends only on the category selection: equal f, no recompile.
    assert f == g
    assert again == states
    assert jax.tree_util.tree_structure(f) == jax.tree_util.tree_structure(g)
    h, _ = Tied().functionalize(category="state")
    assert jax.tree_util.tree_structure(h) != jax.tree_util.tree_structure(f)
    leaves_f = jax.tree_util.tree_leaves(f)
    leaves_g = jax.tree_util.tree_leaves(g)
    np.testing.assert_array_equal(leaves_f[0], leaves_g[0])
    # A sub-model (or a parameter) reads as the model's: a gradient shaped like f
    # reads ``grads.encoder.w``; a name that is neither is no method.
    assert f.encoder is f.model.encoder
    with pytest.raises(AttributeError, match="no method 'missing'"):
        getattr(f, "missing")  # noqa: B009 - the attribute access is what is tested


@autostate.stateful
class Base:
    def __init__(self):
        self.n = jnp.zeros(())

    def __call__(self, x):
        self.n += 1
        return x


class Undecorated(Base):
    def __init__(self):
        super().__init__()
        self.buf = jnp.zeros(3)

    def __call__(self, x):
        self.buf[0] = x
        return super().__call__(x) * 2


def test_subclass_is_decorated_automatically():
    assert autostate.tree.class_info(Undecorated).state == {"n", "buf"}
    model = Undecorated()
    assert float(model(3.0)) == 6.0
    np.testing.assert_array_equal(model.buf, [3.0, 0.0, 0.0])
    f, states = model.functionalize()
    out, states = jax.jit(lambda f, s, x: f(s, x))(f, states, 2.0)
    assert float(out) == 4.0
    assert float(states["n"]) == 2.0
    np.testing.assert_array_equal(states["buf"], [2.0, 0.0, 0.0])


@autostate.stateful(category="other")
class Recategorized(Base):
    pass


def test_explicit_decoration_of_subclass_with_other_options_wins():
    assert autostate.tree.class_info(Recategorized).category == "other"
    f, states = Recategorized().functionalize(category="other")
    assert set(states) == {"n"}


@autostate.stateful
@dataclasses.dataclass
class Accumulator:
    total: jax.Array
    scale: float = 2.0

    def add(self, x):
        self.total += self.scale * x
        return self.total


def test_dataclass_generated_init_is_accepted():
    acc = Accumulator(jnp.zeros(2))
    acc.add(jnp.ones(2))
    np.testing.assert_array_equal(acc.total, [2.0, 2.0])
    f, states = acc.functionalize()
    out, states = jax.jit(lambda f, s, x: f.add(s, x))(f, states, jnp.ones(2))
    np.testing.assert_array_equal(states["total"], [4.0, 4.0])


@autostate.stateful
class Scaled:
    gain = 3.0  # a class-level value of the same name as a state

    def __init__(self):
        self.gain = jnp.ones(())
        self.bias = jnp.zeros(())

    def __call__(self, x):
        self.gain *= 2
        return x * self.gain + self.bias


def _set_bias_from_outside(model, value):
    model.bias = value


@autostate.stateful
class CallsHelper(Scaled):
    def __call__(self, x):
        _set_bias_from_outside(self, x)
        return super().__call__(x)


def test_class_level_value_of_a_state_name_stays_readable_on_the_class():
    assert Scaled.gain == 3.0
    model = Scaled()
    model(1.0)
    assert float(model.gain) == 2.0


def test_assigning_a_non_state_attribute_inside_a_functionalized_call_is_refused():
    model = CallsHelper()
    model(2.0)  # eagerly: plain Python
    assert float(model.bias) == 2.0
    f, states = model.functionalize()
    with pytest.raises(autostate.errors.StateAccessError, match="CallsHelper.bias is not state"):
        f(states, 3.0)
    with pytest.raises(autostate.errors.StateAccessError, match="autostate.state"):
        jax.jit(lambda f, s, x: f(s, x))(f, states, 3.0)


def test_eager_call_with_unhandled_category_refreshes_the_cached_flatten():
    @autostate.stateful
    class TwoKinds:
        def __init__(self):
            self.count = autostate.state(jnp.zeros(()), category="count")
            self.total = jnp.zeros(())

        def __call__(self, x):
            self.count += 1
            self.total += x
            return self.total

    f, states = TwoKinds().functionalize(category="state")
    jax.tree_util.tree_leaves(f)  # caches the flatten
    _, states = f(states, 5.0)  # eager: the unhandled "count" lives in f.model
    leaves = jax.tree_util.tree_leaves(f)
    assert [float(v) for v in leaves] == [1.0]
    assert float(states["total"]) == 5.0


@autostate.stateful
class KeepsALog:
    def __init__(self):
        self.log = []
        self.n = jnp.zeros(())

    def __call__(self, x):
        self.n += 1
        self.log.append(x)
        return x


def test_in_place_mutation_of_a_non_state_container_is_refused_under_jit():
    model = KeepsALog()
    model(1.0)
    assert model.log == [1.0]  # eagerly: plain Python
    f, states = model.functionalize()
    _, states = f(states, 2.0)  # an eager call of f mutates f's own model, like Python
    assert f.model.log == [1.0, 2.0]
    with pytest.raises(
        autostate.errors.StateAccessError, match=r"outside its states \(at KeepsALog\.log\)"
    ):
        jax.jit(lambda f, s, x: f(s, x))(f, states, 3.0)
