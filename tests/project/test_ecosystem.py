"""Build, train and ship like a JAX user: construction under transforms, what is
trained, ``f`` as a first-class pytree, stable model structure, typed keys,
strict state keys, and interop with optax, orbax, Equinox and Flax NNX.

Equinox and Flax are not test dependencies: their tests skip without them.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import autostate
from autostate.errors import StateDictError


@autostate.stateful
class Linear:
    def __init__(self, key, n_in, n_out):
        self.w = jax.random.normal(key, (n_in, n_out)) / n_in**0.5
        self.b = jnp.zeros(n_out)

    def __call__(self, x):
        return x @ self.w + self.b


@autostate.stateful
class Net:
    """Parameters, a running mean, a dropout key, int positions and a bool mask."""

    def __init__(self, key, n=4):
        k1, k2, k3 = jax.random.split(key, 3)
        self.blocks = [Linear(k1, n, n), Linear(k2, n, n)]
        self.mean = jnp.zeros(n)
        self.key = jax.random.fold_in(k3, 0)
        self.dropout_key = jax.random.key(7)
        self.pos = jnp.arange(n)
        self.mask = jnp.arange(n) % 2 == 0
        self.table = autostate.constant(jnp.sin(jnp.arange(n, dtype=jnp.float32)))
        self.training = True

    def __call__(self, x):
        self.key, sub = jax.random.split(self.key)
        for block in self.blocks:
            x = jax.nn.relu(block(x))
        if self.training:
            x = x * jax.random.bernoulli(sub, 0.9, x.shape) / 0.9
        self.mean = 0.9 * self.mean + 0.1 * x.mean(0)
        return (jnp.where(self.mask, x, 0.0) + self.table + self.pos).sum()

    def eval(self):
        self.training = False


def loss(f, states, x):
    return f(states, x)


KEY = jax.random.PRNGKey(0)
X = jnp.ones((2, 4))


# --- 1. construction under transformations ------------------------------------------


def test_eval_shape_gives_an_abstract_model_with_no_computation():
    f, states = jax.eval_shape(lambda k: Net(k).functionalize(), KEY)
    leaves = jax.tree_util.tree_leaves((f, states))
    assert leaves and all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves)
    assert sorted(states) == ["dropout_key", "key", "mask", "mean", "pos", "table"]
    assert states["pos"].dtype == jnp.int32 and states["mask"].dtype == jnp.bool_
    assert len(jax.tree_util.tree_leaves(f)) == 4
    concrete = Net(KEY).functionalize()
    assert jax.tree_util.tree_structure(f) == jax.tree_util.tree_structure(concrete[0])


def test_jit_with_out_shardings_builds_a_sharded_model():
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    abstract = jax.eval_shape(lambda k: Net(k).functionalize(), KEY)
    shardings = jax.tree.map(lambda _: NamedSharding(mesh, P()), abstract)
    f, states = jax.jit(lambda k: Net(k).functionalize(), out_shardings=shardings)(KEY)
    for leaf in jax.tree_util.tree_leaves((f, states)):
        assert isinstance(leaf.sharding, NamedSharding)
    eager_f, eager_states = Net(KEY).functionalize()
    for a, b in zip(jax.tree_util.tree_leaves(f), jax.tree_util.tree_leaves(eager_f)):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    out, _ = jax.jit(loss)(f, states, X)
    ref, _ = loss(eager_f, eager_states, X)
    np.testing.assert_allclose(out, ref, rtol=1e-5)


def test_an_ensemble_of_dropout_models_comes_from_vmap_over_keys():
    keys = jax.random.split(KEY, 3)
    f, states = jax.vmap(lambda k: Net(k).functionalize())(keys)
    assert jax.tree_util.tree_leaves(f)[0].shape == (3, 4, 4)
    outs, new_states = jax.vmap(loss, in_axes=(0, 0, None))(f, states, X)
    assert outs.shape == (3,)
    assert new_states["mean"].shape == (3, 4)
    assert len(set(np.asarray(outs).round(5).tolist())) == 3  # three different members


def test_orbax_restores_a_checkpoint_into_the_abstract_model(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    f, states = Net(KEY).functionalize()
    _, states = loss(f, states, X)
    checkpointer = ocp.StandardCheckpointer()
    path = os.fspath(tmp_path / "ckpt")
    checkpointer.save(path, (f, states))
    checkpointer.wait_until_finished()
    abstract = jax.eval_shape(lambda k: Net(k).functionalize(), KEY)
    restored_f, restored_states = checkpointer.restore(path, abstract)
    assert restored_f == f
    for name in states:
        a, b = restored_states[name], states[name]
        if jax.dtypes.issubdtype(b.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(a, b)
    model = autostate.freeze(restored_f, restored_states)
    np.testing.assert_array_equal(model.mean, states["mean"])


# --- 3. what is trained ---------------------------------------------------------------


def test_grad_and_optax_work_on_f_with_int_bool_key_and_constant_arrays():
    optax = pytest.importorskip("optax")
    f, states = Net(KEY).functionalize()
    trained = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(f)]
    assert trained == [
        ".model.blocks[0].w",
        ".model.blocks[0].b",
        ".model.blocks[1].w",
        ".model.blocks[1].b",
    ]
    opt = optax.adam(1e-2)
    opt_state = opt.init(f)

    @jax.jit
    def step(f, opt_state, states, x):
        grads, states = jax.grad(loss, has_aux=True)(f, states, x)
        updates, opt_state = opt.update(grads, opt_state, f)
        return optax.apply_updates(f, updates), opt_state, states

    before = states
    for _ in range(2):
        f, opt_state, states = step(f, opt_state, states, X)
    # Nothing that is not trained was lost or changed.
    for name in ("pos", "mask", "table"):
        np.testing.assert_array_equal(states[name], before[name])
    assert states["dropout_key"].dtype == before["dropout_key"].dtype
    model = autostate.freeze(f, states)
    assert model.pos.dtype == jnp.int32 and model.mask.dtype == jnp.bool_
    assert sorted(autostate.param_dict(model)) == [
        "blocks[0].b",
        "blocks[0].w",
        "blocks[1].b",
        "blocks[1].w",
    ]
    assert {"table", "pos", "mask", "dropout_key"} <= set(autostate.state_dict(model))


def test_a_constant_is_visible_in_the_repr():
    model = Net(KEY)
    assert "constant 'table' initial value: f32[4]" in repr(model)
    f, _ = model.functionalize()
    assert "constant 'pos' handled by" in repr(f)


def test_an_equinox_module_inside_a_model_works_under_jit_and_grad():
    eqx = pytest.importorskip("equinox")

    @autostate.stateful
    class Wrapper:
        def __init__(self, key):
            self.mlp = eqx.nn.MLP(3, 2, 4, 1, key=key)  # holds activation functions
            self.calls = jnp.zeros((), jnp.int32)

        def __call__(self, x):
            self.calls += 1
            return self.mlp(x).sum()

    f, states = Wrapper(KEY).functionalize()
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree_util.tree_leaves(f))
    grads, states = jax.jit(jax.grad(loss, has_aux=True))(f, states, jnp.ones(3))
    assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(f)
    assert int(states["calls"]) == 1


# --- 4. f is a first-class pytree -------------------------------------------------------


def test_jit_of_f_itself():
    f, states = Net(KEY).functionalize()
    out, new_states = jax.jit(f)(states, X)
    ref, ref_states = f(states, X)
    np.testing.assert_allclose(out, ref, rtol=1e-6)
    np.testing.assert_allclose(new_states["mean"], ref_states["mean"], rtol=1e-6)


def test_keypaths_are_per_level():
    f, _ = Net(KEY).functionalize()
    path, _ = jax.tree_util.tree_leaves_with_path(f)[0]
    assert path == (
        jax.tree_util.GetAttrKey("model"),
        jax.tree_util.GetAttrKey("blocks"),
        jax.tree_util.SequenceKey(0),
        jax.tree_util.GetAttrKey("w"),
    )


@autostate.stateful
class ScaledNorm:
    def __init__(self, n):
        self.scale = jnp.full(n, 1.5)  # weakly typed
        self.mean = jnp.zeros(n)

    def __call__(self, x):
        self.mean = 0.9 * self.mean + 0.1 * x.mean(0)
        return jnp.tanh((x - self.mean) * self.scale)


@autostate.stateful
class Deep:
    """Layers as a stack (or a list), a stack inside a list, a state of the model's own."""

    def __init__(self, key, stacked=True):
        layers = [Linear(k, 4, 4) for k in jax.random.split(key, 3)]
        self.layers = autostate.stack(layers) if stacked else layers
        self.norms = [autostate.stack([ScaledNorm(4), ScaledNorm(4)])]
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.calls += 1
        for layer in self.layers:
            x = layer(x)
        for norm in self.norms[0]:
            x = norm(x)
        return x.sum()


class MomentumSGD:
    """An optax-style transformation written out, so this test needs no optax."""

    def init(self, params):
        return {"trace": jax.tree.map(jnp.zeros_like, params), "count": jnp.zeros((), jnp.int32)}

    def update(self, grads, state, params=None):
        trace = jax.tree.map(lambda t, g: 0.9 * t + g, state["trace"], grads)
        updates = jax.tree.map(lambda t: -0.1 * t, trace)
        return updates, {"trace": trace, "count": state["count"] + 1}


STANDARD_KEYS = (
    jax.tree_util.DictKey,
    jax.tree_util.GetAttrKey,
    jax.tree_util.SequenceKey,
    jax.tree_util.FlattenedIndexKey,
)


def keystrs(tree):
    """Each leaf's keystr, after checking every entry is one of JAX's own."""
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    for path in paths:
        assert all(type(k) in STANDARD_KEYS for k in path), path
    return [jax.tree_util.keystr(path) for path in paths]


@pytest.mark.parametrize("stacked", [True, False])
def test_every_keypath_is_one_of_jaxs_key_entries(stacked):
    # f, the states, the gradients, an optimizer's state and the model object:
    # orbax, keystr and other tree tools take every keypath. f's read as the
    # parameters' names (a stack adds nothing to them: blocks.w, with the layer
    # axis, as state_dict names it); the model object's name the stacked model
    # under the stack's attribute that holds it.
    model = Deep(KEY, stacked)
    f, states = model.functionalize()
    names = keystrs(f)
    assert names == [".model." + n for n in autostate.param_dict(model)]
    assert names[:2] == ([".model.layers.w", ".model.layers.b"] if stacked
                         else [".model.layers[0].w", ".model.layers[0].b"])
    assert ".model.norms[0].scale" in names
    assert keystrs(states) == [f"['{n}']" for n in sorted(states)]
    assert "norms[0].mean" in states
    grads = autostate.grad(lambda m, x: m(x))(model, X)
    assert keystrs(grads) == names
    opt = autostate.Optimizer(model, MomentumSGD())
    assert keystrs(opt.opt_state) == ["['count']"] + [f"['trace']{n}" for n in names]
    opt.update(grads)
    model_names = keystrs(model)
    stacked_w = ".layers.stacked.w" if stacked else ".layers[0].w"
    assert stacked_w in model_names and ".norms[0].stacked.scale" in model_names
    assert ".norms[0].stacked.mean.state" in model_names
    assert keystrs(autostate.freeze(f, states)) == model_names
    pf, pstates = autostate.pack(f, states)
    assert keystrs(pf) and keystrs(pstates)
    assert keystrs(opt) == [
        *(".model" + n for n in model_names),
        ".opt_state['count']",
        *(".opt_state['trace']" + n for n in names),
        ".step",
    ]


def test_orbax_saves_and_restores_a_model_holding_a_stack(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    f, states = Deep(KEY).functionalize()
    _, states = f(states, X)
    path = os.fspath(tmp_path / "ckpt")
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, {"f": f, "states": states})  # docs/scaling_out.md's recipe
    abstract_f, abstract_states = jax.eval_shape(lambda k: Deep(k).functionalize(), KEY)
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(path, {"f": abstract_f, "states": abstract_states})
    assert restored["f"] == f
    for name in states:
        np.testing.assert_array_equal(restored["states"][name], states[name])
    model = autostate.freeze(restored["f"], restored["states"])
    assert type(model.layers) is autostate.Stack and int(model.calls) == 1
    with ocp.StandardCheckpointer() as checkpointer:  # and the model object itself
        checkpointer.save(os.fspath(tmp_path / "model"), model)
    with ocp.StandardCheckpointer() as checkpointer:
        again = checkpointer.restore(os.fspath(tmp_path / "model"), jax.eval_shape(lambda: model))
    assert type(again.layers) is autostate.Stack
    np.testing.assert_array_equal(again.norms[0].mean, model.norms[0].mean)


def test_optax_masks_by_path_and_multi_transform():
    optax = pytest.importorskip("optax")
    f, states = Net(KEY).functionalize()

    def decay_mask(f):
        return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].name != "b", f)

    def labels(f):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: "frozen" if path[2].idx == 0 else "train", f
        )

    opt = optax.chain(
        optax.add_decayed_weights(0.1, mask=decay_mask),
        optax.multi_transform({"train": optax.sgd(0.1), "frozen": optax.set_to_zero()}, labels),
    )
    opt_state = opt.init(f)
    grads, _ = jax.grad(loss, has_aux=True)(f, states, X)
    updates, _ = opt.update(grads, opt_state, f)
    new = optax.apply_updates(f, updates)
    np.testing.assert_array_equal(new.model.blocks[0].w, f.model.blocks[0].w)
    assert not np.allclose(new.model.blocks[1].w, f.model.blocks[1].w)


@pytest.mark.parametrize("make", [Net, Deep], ids=["list", "stack"])
def test_jax_export_serializes_a_step_that_takes_f(make):
    pytest.importorskip("flatbuffers")
    f, states = make(KEY).functionalize()
    exported = jax.export.export(jax.jit(loss))(f, states, X)
    again = jax.export.deserialize(exported.serialize())
    out, new_states = again.call(f, states, X)
    ref, _ = loss(f, states, X)
    np.testing.assert_allclose(out, ref, rtol=1e-5)
    assert sorted(new_states) == sorted(states)


def test_autostate_export_with_static_args_and_kwargs():
    pytest.importorskip("flatbuffers")

    @autostate.stateful
    class Scaled:
        def __init__(self):
            self.w = jnp.ones(3)
            self.n = jnp.zeros(())

        def __call__(self, x, k, *, train=True, shift=None):
            self.n += 1
            y = x * self.w * k + (1.0 if train else 0.0)
            return y if shift is None else y + shift

    model = Scaled()
    exported = autostate.export(
        model, jnp.ones(3), 4, static_argnums=1, train=False, shift=jnp.zeros(3)
    )
    again = jax.export.deserialize(exported.serialize())
    out, states = again.call(autostate.state_dict(model), jnp.ones(3), shift=jnp.ones(3))
    np.testing.assert_array_equal(out, [5.0, 5.0, 5.0])
    assert float(states["n"]) == 1.0


# --- 5. structure depends on the class and kinds of attributes only -----------------


def test_structure_is_the_same_before_and_after_the_first_call():
    model = Net(KEY)
    before = jax.tree_util.tree_structure(model)
    leaves_before = len(jax.tree_util.tree_leaves(model))
    model(X)
    assert jax.tree_util.tree_structure(model) == before
    assert len(jax.tree_util.tree_leaves(model)) == leaves_before
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(model)]
    assert ".mean.state" in names  # states are visible in a fresh model too


def test_tree_map_with_a_second_tree_and_a_none_prefix_for_vmap():
    model, other = Net(KEY), Net(jax.random.PRNGKey(1))
    other(X)
    summed = jax.tree.map(
        lambda a, b: a + b if jnp.issubdtype(a.dtype, jnp.floating) else a, model, other
    )
    np.testing.assert_allclose(
        summed.blocks[0].w, model.blocks[0].w + other.blocks[0].w, rtol=1e-6
    )
    nones = jax.tree.map(lambda _: None, model)
    assert jax.tree_util.tree_structure(
        nones, is_leaf=lambda x: x is None
    ) == jax.tree_util.tree_structure(model)
    axes = jax.tree_util.tree_map_with_path(
        lambda path, _: 0 if jax.tree_util.keystr(path).startswith(".blocks") else None, model
    )
    stacked = jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.stack([x, x]) if jax.tree_util.keystr(path).startswith(".blocks") else x,
        model,
    )
    sums = jax.vmap(lambda m: m.blocks[0].w.sum(), in_axes=(axes,))(stacked)
    np.testing.assert_allclose(sums, [model.blocks[0].w.sum()] * 2, rtol=1e-6)


def test_a_bf16_cast_before_the_first_call_keeps_the_structure():
    traces = []

    @jax.jit
    def run(model, x):
        traces.append(1)
        return model.blocks[0](x)

    model = Net(KEY)
    cast = jax.tree.map(
        lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x, model
    )
    assert jax.tree_util.tree_structure(cast) == jax.tree_util.tree_structure(model)
    assert cast.blocks[0].w.dtype == jnp.bfloat16
    run(cast, X.astype(jnp.bfloat16))
    run(jax.tree.map(lambda x: x, cast), X.astype(jnp.bfloat16))
    assert len(traces) == 1


def test_orbax_on_the_model_object(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    model = Net(KEY)
    model.eval()
    checkpointer = ocp.StandardCheckpointer()
    path = os.fspath(tmp_path / "model")
    checkpointer.save(path, model)
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(path, jax.eval_shape(lambda: model))
    assert type(restored) is Net and restored.training is False
    f, states = model.functionalize()
    g, restored_states = restored.functionalize()
    assert f == g
    np.testing.assert_array_equal(restored_states["pos"], states["pos"])


# --- 6. typed PRNG keys -------------------------------------------------------------------


def test_typed_keys_round_trip_through_save_and_load(tmp_path):
    model = Net(KEY)
    model(X)
    path = tmp_path / "ckpt.npz"
    autostate.save(path, model)
    loaded = autostate.load(path, like=Net(jax.random.PRNGKey(5)))
    for name in ("key", "dropout_key"):
        a, b = getattr(loaded, name), getattr(model, name)
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(jax.random.key_data(a), jax.random.key_data(b))
    np.testing.assert_array_equal(loaded.mean, model.mean)


def test_typed_keys_round_trip_through_export():
    pytest.importorskip("flatbuffers")
    model = Net(KEY)
    model.eval()
    exported = jax.export.deserialize(autostate.export(model, X).serialize())
    states = autostate.state_dict(model)
    out, new_states = exported.call(states, X)
    assert new_states["dropout_key"].dtype == states["dropout_key"].dtype
    np.testing.assert_array_equal(
        jax.random.key_data(new_states["dropout_key"]), jax.random.key_data(states["dropout_key"])
    )
    ref = model(X)
    np.testing.assert_allclose(out, ref, rtol=1e-5)
    np.testing.assert_array_equal(
        jax.random.key_data(new_states["key"]), jax.random.key_data(model.key)
    )


# --- 7. state dicts from f; unknown keys ---------------------------------------------------


def test_param_dict_and_state_dict_accept_f_inside_jit():
    model = Net(KEY)
    f, states = model.functionalize()
    assert autostate.param_dict(f).keys() == autostate.param_dict(model).keys()
    assert autostate.state_dict(f, states).keys() == autostate.state_dict(model).keys()

    @jax.jit
    def ema(avg, f):
        return jax.tree.map(lambda a, p: 0.9 * a + 0.1 * p, avg, autostate.param_dict(f))

    avg = ema(autostate.param_dict(f), f)
    np.testing.assert_allclose(avg["blocks[0].w"], model.blocks[0].w, rtol=1e-6)
    with pytest.raises(TypeError, match="states"):
        autostate.state_dict(f)


def test_unknown_state_keys_are_an_error_with_a_close_match():
    f, states = Net(KEY).functionalize()
    bad = {**states, "maen": states["mean"]}
    with pytest.raises(StateDictError, match=r"'maen' \(did you mean 'mean'\?\)"):
        f(bad, X)
    with pytest.raises(StateDictError, match="'maen'"):
        autostate.freeze(f, bad)
    with pytest.raises(StateDictError, match="'maen'"):
        jax.jit(loss)(f, bad, X)


# --- 9. interop -------------------------------------------------------------------------


def test_an_autostate_model_inside_an_equinox_module():
    eqx = pytest.importorskip("equinox")

    class Head(eqx.Module):
        body: autostate.FunctionalModel
        scale: jax.Array

        def __call__(self, states, x):
            out, states = self.body(states, x)
            return out * self.scale, states

    f, states = Net(KEY).functionalize()
    head = Head(f, jnp.asarray(2.0))
    out, states2 = eqx.filter_jit(lambda h, s, x: h(s, x))(head, states, X)
    ref, _ = f(states, X)
    np.testing.assert_allclose(out, 2 * ref, rtol=1e-5)
    grads = eqx.filter_grad(lambda h, s, x: h(s, x)[0])(head, states, X)
    assert jax.tree_util.tree_structure(grads.body) == jax.tree_util.tree_structure(f)


def test_an_autostate_model_inside_a_flax_nnx_module():
    nnx = pytest.importorskip("flax.nnx")

    class Head(nnx.Module):
        def __init__(self, model):
            f, states = model.functionalize()
            # autostate's parameters as nnx Params, its states as nnx BatchStats.
            self.params = nnx.Param(f)
            self.states = nnx.BatchStat(states)

        def __call__(self, x):
            out, new_states = self.params.get_value()(self.states.get_value(), x)
            self.states.set_value(new_states)
            return out

    head = Head(Net(KEY))
    before = np.asarray(head.states.get_value()["mean"])

    @nnx.jit
    def run(head, x):
        return head(x)

    out = run(head, X)
    assert np.isfinite(float(out))
    assert not np.allclose(head.states.get_value()["mean"], before)
    grads = nnx.grad(lambda h, x: h(x))(head, X)
    assert "params" in dict(grads)


def test_an_nnx_module_inside_an_autostate_model():
    nnx = pytest.importorskip("flax.nnx")

    @autostate.stateful
    class UsesNNX:
        """NNX modules are graphs, not pytrees: keep nnx.split's pair and merge per call."""

        def __init__(self):
            graphdef, params = nnx.split(nnx.Linear(3, 2, rngs=nnx.Rngs(0)))
            self.graphdef = graphdef
            self.params = params
            self.calls = jnp.zeros(())

        def __call__(self, x):
            self.calls += 1
            return nnx.merge(self.graphdef, self.params)(x).sum()

    f, states = UsesNNX().functionalize()
    grads, states = jax.jit(jax.grad(loss, has_aux=True))(f, states, jnp.ones(3))
    assert float(states["calls"]) == 1.0
    assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(f)
