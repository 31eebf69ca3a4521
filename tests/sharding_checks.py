"""Multi-device checks of ``autostate.sharding``, run on 8 virtual CPU devices.

``tests/unit/test_sharding.py`` runs this file in its own process (the device
count is fixed when JAX starts, and the rest of the suite keeps one device):
``python tests/sharding_checks.py [NAME ...] [PROGRAM.py ...]`` runs the named
checks (all by default), then each program file as ``python PROGRAM.py`` would
but in this process, and prints one JSON object
``{"checks": {name: result}, "programs": {path: result}}``, each result
``{"error": None | traceback, "skipped": None | why, "stdout": what it printed}``
(skipped: it imports a library of the test extra, ``OPTIONAL``, that is not
installed). The programs are
the 8-device blocks of ``docs/scaling_out.md``: one process for all of them
pays for starting JAX once.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import runpy
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_file(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# The example asks XLA for 8 devices itself, before it imports JAX; loading it
# first is what gives this process its 8 devices (the test starts it without
# the flag, as a user runs the example).
example = load_file(ROOT / "examples" / "sharded_training.py", "sharded_training")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import autostate  # noqa: E402

CHECKS: dict[str, Callable[[], None]] = {}


def check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS[fn.__name__] = fn
    return fn


sys.path.insert(0, str(ROOT / "benchmarks"))
bench_donation = load_file(ROOT / "benchmarks" / "bench_donation.py", "bench_donation")

# The example's --smoke configuration: the programs of its run and of these
# checks are the same, and compile once (the persistent compilation cache).
CFG = example.Config(d=16, mlp=32, layers=1, steps=2)
RULES = example.RULES


def mesh_2x4():
    return example.make_mesh()


def leaves(tree):
    return jax.tree_util.tree_leaves(tree)


def assert_close(a, b, what, rtol=1e-5, atol=1e-6):
    la, lb = leaves(a), leaves(b)
    assert len(la) == len(lb), what
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b), what
    for x, y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol, err_msg=what)


def assert_shardings(tree, want, what):
    for leaf, sharding in zip(leaves(tree), leaves(want), strict=True):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), (
            f"{what}: {leaf.sharding} is not {sharding}"
        )


# --- item 1: annotations and the sharding trees ---------------------------------------


@check
def annotations_give_named_shardings():
    mesh = mesh_2x4()
    model = example.Transformer(jax.random.key(0), CFG)
    f, states = model.functionalize()
    f_specs, s_specs = autostate.partition_specs(f, states)
    assert f_specs.model.blocks[0].attn.wq == P("embed", "heads")
    assert s_specs["blocks[0].norm.mean"] == P("embed") and s_specs["step"] == P()
    f_sh, s_sh = autostate.shardings(f, states, mesh, rules=RULES)
    assert jax.tree_util.tree_structure(f_sh) == jax.tree_util.tree_structure(f)
    assert set(s_sh) == set(states)
    attn = f_sh.model.blocks[0].attn
    assert attn.wq == NamedSharding(mesh, P(None, "model"))
    assert attn.wo == NamedSharding(mesh, P("model", None))
    assert f_sh.model.blocks[0].mlp.b1 == NamedSharding(mesh, P("model"))
    assert s_sh["blocks[0].norm.var"] == NamedSharding(mesh, P(None))
    assert s_sh["step"] == NamedSharding(mesh, P())
    # The same trees work for device_put, and the arrays land where annotated.
    f2, s2 = jax.device_put((f, states), (f_sh, s_sh))
    assert f2.model.blocks[0].attn.wq.sharding.spec == P(None, "model")
    assert f2.model.blocks[0].attn.wq.addressable_shards[0].data.shape == (CFG.d, CFG.d // 4)
    # Annotations survive freeze, jit round trips and eval_shape.
    frozen = autostate.freeze(f2, s2)
    assert "wq=f32[16,16] sharded P('embed', 'heads')" in repr(frozen)
    again = autostate.shardings(*frozen.functionalize(), mesh, rules=RULES)
    assert again == (f_sh, s_sh)
    abstract = jax.eval_shape(lambda f, s: (f, s), f, states)
    assert autostate.shardings(*abstract, mesh, rules=RULES) == (f_sh, s_sh)


@check
def two_meshes_give_their_own_shardings():
    # flax #5127: the output sharding followed the wrong mesh with several meshes.
    model = example.Transformer(jax.random.key(0), CFG)
    f, states = model.functionalize()
    x = jnp.ones((CFG.batch, CFG.seq, CFG.d))
    for shape in ((2, 4), (4, 2)):
        mesh = jax.make_mesh(shape, ("data", "model"), axis_types=(AxisType.Auto,) * 2)
        f_sh, s_sh = autostate.shardings(f, states, mesh, rules=RULES)
        run = jax.jit(
            lambda f, s, x: f(s, x),
            in_shardings=(f_sh, s_sh, NamedSharding(mesh, P("data"))),
            out_shardings=(NamedSharding(mesh, P("data")), s_sh),
        )
        out, new = run(*jax.device_put((f, states), (f_sh, s_sh)), x)
        assert out.sharding.mesh.shape == mesh.shape
        assert_shardings(new, s_sh, f"mesh {shape}")


@check
def bad_annotations_are_clear_errors():
    mesh = mesh_2x4()
    model = example.Transformer(jax.random.key(0), CFG)
    f, states = model.functionalize()
    try:
        autostate.shardings(f, states, mesh)  # logical names without rules
    except autostate.AutostateError as e:
        assert isinstance(e, ValueError)
        assert "'embed'" in str(e) and "rules" in str(e), str(e)
    else:
        raise AssertionError("unknown axis name accepted")
    odd = example.Transformer(jax.random.key(0), example.Config(d=16, heads=4, mlp=30))
    try:
        autostate.shardings(*odd.functionalize(), mesh, rules=RULES)
    except autostate.AutostateError as e:
        assert "blocks[0].mlp.w1" in str(e) and "size 30" in str(e), str(e)
    else:
        raise AssertionError("indivisible dimension accepted")
    try:
        autostate.sharded(jnp.ones(3), ("model",))
    except TypeError as e:
        assert "PartitionSpec" in str(e)
    else:
        raise AssertionError("a tuple accepted as a spec")


# --- item 2: sharded init -------------------------------------------------------------


def transformer_init(key):
    return example.Transformer(key, CFG).functionalize()


def sharded_init(mesh):
    """``transformer_init`` under jit, out_shardings from the model's annotations."""
    abstract = jax.eval_shape(transformer_init, jax.random.key(0))
    f_sh, s_sh = autostate.shardings(*abstract, mesh, rules=RULES)
    return jax.jit(transformer_init, out_shardings=(f_sh, s_sh)), f_sh, s_sh


@check
def sharded_init_materializes_each_array_in_its_layout():
    mesh = mesh_2x4()
    key = jax.random.key(0)
    abstract_f, abstract_states = jax.eval_shape(transformer_init, key)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves((abstract_f, abstract_states)))
    init, f_sh, s_sh = sharded_init(mesh)
    f, states = init(key)
    assert_shardings(f, f_sh, "parameters built under jit")
    assert_shardings(states, s_sh, "states built under jit")
    assert_close((f, states), transformer_init(key), "sharded init vs eager", rtol=0, atol=0)
    wq = f.model.blocks[0].attn.wq
    assert [s.data.shape for s in wq.addressable_shards] == [(CFG.d, CFG.d // 4)] * 8
    # Each device's output is its shards only: less than the whole model.
    full = sum(x.size * x.dtype.itemsize for x in leaves((f, states)))
    per_device = sum(s.data.nbytes for x in leaves((f, states)) for s in x.addressable_shards
                     if s.device == jax.devices()[0])
    compiled = init.lower(key).compile().memory_analysis()
    n = len(leaves((f, states)))  # the output tuple adds one 8-byte pointer per array
    assert per_device < 0.6 * full, (per_device, full)
    assert compiled.output_size_in_bytes <= per_device + 8 * n, (compiled, per_device)
    # eval_shape of the sharded init: abstract f and states carrying their shardings.
    abstract = jax.eval_shape(init, key)
    assert jax.tree_util.tree_structure(abstract) == jax.tree_util.tree_structure((f, states))
    for a, want in zip(leaves(abstract), leaves((f_sh, s_sh)), strict=True):
        assert isinstance(a, jax.ShapeDtypeStruct) and a.sharding == want, (a, want)
    model = autostate.freeze(*abstract)
    assert "sharded P('embed', 'heads')" in repr(model)


# --- item 3: DP + TP training step ---------------------------------------------------


@check
def dp_tp_step_equals_single_device():
    mesh = mesh_2x4()
    f1, s1 = example.Transformer(jax.random.key(0), CFG).functionalize()
    init, f_sh, s_sh = sharded_init(mesh)
    f8, s8 = init(jax.random.key(0))
    single = jax.jit(lambda f, s, x, y: example.train_step(f, s, x, y, CFG.lr))
    sharded = example.sharded_step(mesh, f_sh, s_sh, CFG.lr)
    data = example.batches(CFG, 3)
    # XLA's propagation alone keeps this model's layout (out_shardings guarantee it).
    batch = NamedSharding(mesh, P("data"))
    free = jax.jit(lambda f, s, x, y: example.train_step(f, s, x, y, CFG.lr),
                   in_shardings=(f_sh, s_sh, batch, batch))
    _, _, f_free, s_free = free(f8, s8, *data[0])
    assert_shardings((f_free, s_free), (f_sh, s_sh), "a step without out_shardings")
    for i, (x, y) in enumerate(data):
        loss1, g1, f1, s1 = single(f1, s1, x, y)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # "Some donated buffers were not usable"
            loss8, g8, f8, s8 = sharded(f8, s8, x, y)
        assert_close(loss8, loss1, f"loss, step {i}")
        assert_close(g8, g1, f"grads, step {i}")
        assert_close(f8, f1, f"new parameters, step {i}")
        assert_close(s8, s1, f"new states, step {i}")
        assert_shardings(s8, s_sh, f"states after step {i}")
        assert_shardings(f8, f_sh, f"parameters after step {i}")
        assert_shardings(g8, f_sh, f"grads after step {i}")
    assert int(s8["step"]) == 3
    assert len(s8["blocks[0].norm.mean"].addressable_shards) == 8


@check
def compiled_step_keeps_each_arrays_layout():
    # autostate.jit on a sharded model object: the numbers of the f path, and
    # every array keeps the layout its annotation gave it, call after call.
    import optax

    mesh = mesh_2x4()
    init, _, _ = sharded_init(mesh)
    model = autostate.freeze(*init(jax.random.key(0)))
    f1, s1 = example.Transformer(jax.random.key(0), CFG).functionalize()
    single = jax.jit(lambda f, s, x, y: example.train_step(f, s, x, y, CFG.lr))

    def loss_of(m, x, y):
        return jnp.mean((m(x) - y) ** 2)

    @autostate.jit
    def step(opt, x, y):
        loss, grads = autostate.value_and_grad(loss_of)(opt.model, x, y)
        opt.update(grads)
        return loss

    def arrays(m):
        return {**autostate.param_dict(m), **autostate.state_dict(m)}

    placed = {name: x.sharding for name, x in arrays(model).items()}
    assert any(len(sh.device_set) == 8 for sh in placed.values())
    opt = autostate.Optimizer(model, optax.sgd(CFG.lr))
    for i, (x, y) in enumerate(example.batches(CFG, 3)):
        loss1, _, f1, s1 = single(f1, s1, x, y)
        assert_close(step(opt, x, y), loss1, f"loss, step {i}")
        assert_close(model.functionalize(), (f1, s1), f"model after step {i}")
        for name, x8 in arrays(model).items():
            assert x8.sharding.is_equivalent_to(placed[name], x8.ndim), (i, name, x8.sharding)
    # A donated decode step on a sharded cache: in place, in its layout.
    cfg = bench_donation.DecodeConfig(batch=8, max_len=256, heads=4, head_dim=16, tokens=4)
    f, states = bench_donation.CachedAttention(jax.random.key(0), cfg).functionalize()
    shardings = autostate.shardings(f, states, mesh, rules={"batch": "data", "heads": "model"})
    decoder = autostate.freeze(*jax.device_put((f, states), shardings))
    decode = autostate.jit(lambda m, x: m(x))
    x = jnp.ones((cfg.batch, cfg.d))
    for _ in range(3):
        old = decoder.k_cache
        pointers = [s.data.unsafe_buffer_pointer() for s in old.addressable_shards]
        x = decode(decoder, x)
        assert old.is_deleted()
        new = decoder.k_cache
        assert [s.data.unsafe_buffer_pointer() for s in new.addressable_shards] == pointers
        assert new.sharding.is_equivalent_to(shardings[1]["k_cache"], new.ndim), new.sharding
    assert int(decoder.pos) == 3


# --- item 4: cross-device statistics ---------------------------------------------------


@check
def rolled_loop_over_a_sharded_stack():
    # A stack of annotated layers: each annotation gains the layer axis in front
    # (unsplit, or split over the mesh axis the stack names); a Python loop over it
    # rolls into one scan under jit, with the numbers of the eager loop, on the
    # 2x4 mesh, the layer axis unsplit and split over "data".
    mesh = mesh_2x4()
    norms = [example.RunningNorm(CFG.d) for _ in range(4)]

    @autostate.stateful
    class Stacked:
        def __init__(self, layer_axis):
            self.norms = autostate.stack(norms, layer_axis=layer_axis)

        def __call__(self, x):
            for norm in self.norms:
                x = jnp.tanh(norm(x))
            return x

    x = jax.random.normal(jax.random.key(3), (8, 4, CFG.d))
    for layer_axis in (None, "data"):
        model = Stacked(layer_axis)
        f, states = model.functionalize()
        shardings = autostate.shardings(f, states, mesh, rules=RULES)
        spec = shardings[1]["norms.mean"].spec  # (RunningNorm's P("embed"), "embed" unsplit)
        assert tuple(spec) == (layer_axis, None), spec
        eager = Stacked(layer_axis)
        expected = eager(x)
        f, states = jax.device_put((f, states), shardings)
        step = jax.jit(f)
        assert "while" in step.lower(states, x).as_text()
        out, new = step(states, x)
        assert_close(out, expected, f"output, layer axis {layer_axis}")
        assert_close(new["norms.mean"], eager.norms.mean, f"running mean, layer axis {layer_axis}")
        # The model object compiled (autostate.jit): rolled too, each array in its layout.
        model = autostate.freeze(f, new)  # (one step taken, as the eager model's)
        placed = model.norms.mean.sharding
        compiled = autostate.jit(lambda m, x: m(x))
        assert "while" in compiled.lower(model, x).as_text()
        for _ in range(2):
            out = compiled(model, x)
            expected = eager(x)
        assert_close(out, expected, f"autostate.jit output, layer axis {layer_axis}")
        assert_close(model.norms.mean, eager.norms.mean, f"autostate.jit mean, {layer_axis}")
        assert model.norms.mean.sharding.is_equivalent_to(placed, 2), model.norms.mean.sharding


def full_batch_stats(x, momentum=0.9):
    """Running mean and var after one update from their initial 0 and 1, in float64."""
    x = np.asarray(x, np.float64)
    mean, var = x.mean((0, 1)), x.var((0, 1))
    return (1 - momentum) * mean, momentum + (1 - momentum) * var


@check
def jit_level_statistics_equal_full_batch():
    mesh = mesh_2x4()
    norm = example.RunningNorm(CFG.d)
    f, states = norm.functionalize()
    f_sh, s_sh = autostate.shardings(f, states, mesh, rules=RULES)
    x = jax.random.normal(jax.random.key(3), (CFG.batch, CFG.seq, CFG.d)) * 3 + 1
    batch = NamedSharding(mesh, P("data"))
    run = jax.jit(lambda f, s, x: f(s, x), in_shardings=(f_sh, s_sh, batch),
                  out_shardings=(batch, s_sh))
    _, new = run(*jax.device_put((f, states), (f_sh, s_sh)), jax.device_put(x, batch))
    mean, var = full_batch_stats(x)
    np.testing.assert_allclose(new["mean"], mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new["var"], var, rtol=1e-5, atol=1e-6)
    _, single = jax.jit(lambda f, s, x: f(s, x))(f, states, x)
    assert_close(new, single, "jit-level statistics vs one device")


@check
def shard_map_pmean_statistics_equal_full_batch():
    mesh = mesh_2x4()
    x = jax.random.normal(jax.random.key(3), (CFG.batch, CFG.seq, CFG.d)) * 3 + 1
    model = example.Transformer(jax.random.key(0), CFG, axis_name="data")
    f, states = model.functionalize()
    f_specs, s_specs = autostate.partition_specs(f, states, rules={**RULES, "heads": None,
                                                                   "mlp": None})
    run = jax.jit(jax.shard_map(
        lambda f, s, x: f(s, x), mesh=mesh,
        in_specs=(f_specs, s_specs, P("data")), out_specs=(P("data"), s_specs),
    ))
    out, new = run(f, states, x)
    reference = example.Transformer(jax.random.key(0), CFG)  # no axis name: one device
    out1, new1 = jax.jit(lambda f, s, x: f(s, x))(*reference.functionalize(), x)
    assert_close(new, new1, "shard_map + pmean statistics vs one device, full batch")
    assert_close(out, out1, "shard_map output vs one device", rtol=1e-4, atol=1e-5)
    mean, var = full_batch_stats(x)
    np.testing.assert_allclose(new["blocks[0].norm.mean"], mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new["blocks[0].norm.var"], var, rtol=1e-5, atol=1e-6)
    # Without pmean, shard_map refuses replicated out_specs for per-shard statistics...
    local = example.RunningNorm(CFG.d)
    lf, ls = local.functionalize()
    try:
        jax.jit(jax.shard_map(
            lambda f, s, x: f(s, x), mesh=mesh, in_specs=(P(), P(), P("data")),
            out_specs=(P("data"), P()),
        ))(lf, ls, x)
    except ValueError as e:
        assert "data" in str(e), str(e)
    else:
        raise AssertionError("shard_map accepted unreduced statistics as replicated")
    # ... and with the check off each device keeps its own shard's statistics.
    local = example.RunningNorm(CFG.d)
    lf, ls = local.functionalize()
    _, per_shard = jax.jit(jax.shard_map(
        lambda f, s, x: f(s, x), mesh=mesh, in_specs=(P(), P(), P("data")),
        out_specs=(P("data"), P("data")), check_vma=False,
    ))(lf, ls, x)
    assert not np.allclose(np.asarray(per_shard["mean"])[: CFG.d], mean, rtol=1e-3)


MESH = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))


@autostate.stateful
class ShardedNorm:
    """Running statistics written inside a jax.shard_map in its own method."""

    def __init__(self):
        self.mean = jnp.zeros(CFG.d)
        self.calls = jnp.zeros((), jnp.int32)
        self.rows = autostate.sharded(jnp.zeros((CFG.batch, CFG.d)), P("data"))

    def __call__(self, x):
        def shard(x):
            self.mean = 0.9 * self.mean + 0.1 * jax.lax.pmean(x.mean((0, 1)), "data")
            self.calls += 1  # the same on every shard
            self.rows = self.rows + x.mean(1)  # each shard its own rows
            return x - self.mean
        return jax.shard_map(shard, mesh=MESH, in_specs=P("data"), out_specs=P("data"))(x)

    def per_shard(self, x):
        def shard(x):
            self.mean = x.mean((0, 1))
            return x
        return jax.shard_map(shard, mesh=MESH, in_specs=P("data"), out_specs=P("data"))(x)


@check
def shard_map_inside_a_method_writes_reduced_states():
    x = jax.random.normal(jax.random.key(3), (CFG.batch, CFG.seq, CFG.d)) * 3 + 1
    expected_mean = 0.1 * x.mean((0, 1))
    model = ShardedNorm()
    out = model(x)
    np.testing.assert_allclose(model.mean, expected_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out, x - expected_mean, rtol=1e-5, atol=1e-6)
    assert int(model.calls) == 1
    np.testing.assert_allclose(model.rows, x.mean(1), rtol=1e-5, atol=1e-6)
    f, states = autostate.functionalize(ShardedNorm())
    for call in (f, jax.jit(f)):
        out, new = call(states, x)
        np.testing.assert_allclose(new["mean"], expected_mean, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(new["rows"], x.mean(1), rtol=1e-5, atol=1e-6)
        assert int(new["calls"]) == 1
        assert tuple(new["rows"].sharding.spec)[:1] == ("data",), new["rows"].sharding
    # A per-shard value: refused, naming the state, the model unchanged.
    for run in (lambda: model.per_shard(x), lambda: jax.jit(f.per_shard)(states, x)):
        try:
            run()
        except autostate.errors.ControlFlowStateError as e:
            assert "'mean'" in str(e) or "'ShardedNorm.mean'" in str(e), str(e)
            assert "differs from shard to shard" in str(e) and "sharding_checks.py:" in str(e)
        else:
            raise AssertionError("a per-shard write to a shared state was accepted")
    np.testing.assert_allclose(model.mean, expected_mean, rtol=1e-5, atol=1e-6)


# --- item 5: donation ------------------------------------------------------------------


@check
def donated_decode_updates_the_cache_in_place():
    cfg = bench_donation.DecodeConfig(batch=8, max_len=256, heads=4, head_dim=16, tokens=4)
    r = bench_donation.measure(cfg)
    assert r["in_place"] and r["pos"] == 4, r
    assert r["alias"] >= r["cache"], r
    assert r["donated"] < 1.15 * r["cache"] + r["params"], r
    assert r["plain"] > 1.9 * r["cache"], r
    # Sharded over the mesh too: the donated cache keeps its layout step after step.
    mesh = mesh_2x4()
    f, states = bench_donation.CachedAttention(jax.random.key(0), cfg).functionalize()
    rules = {"batch": "data", "heads": "model"}
    f_sh, s_sh = autostate.shardings(f, states, mesh, rules=rules)
    f, states = jax.device_put((f, states), (f_sh, s_sh))
    x_sh = NamedSharding(mesh, P("data"))
    step = jax.jit(bench_donation.decode_step, in_shardings=(f_sh, s_sh, x_sh),
                   out_shardings=(x_sh, s_sh), donate_argnums=1)
    x = jnp.ones((cfg.batch, cfg.d))
    for _ in range(3):
        old = states["k_cache"]
        pointers = [s.data.unsafe_buffer_pointer() for s in old.addressable_shards]
        x, states = step(f, states, x)
        assert old.is_deleted()
        assert [s.data.unsafe_buffer_pointer() for s in states["k_cache"].addressable_shards] \
            == pointers
        assert_shardings(states, s_sh, "donated decode states")


# --- item 6: checkpoints ----------------------------------------------------------------


@check
def orbax_restores_into_the_sharded_abstract_model():
    import orbax.checkpoint as ocp

    mesh = mesh_2x4()
    f, states = example.Transformer(jax.random.key(0), CFG).functionalize()
    _, states = jax.jit(lambda f, s, x: f(s, x))(f, states, jnp.ones((8, CFG.seq, CFG.d)))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt"
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(path, {"f": f, "states": states})  # saved from one device
        init, f_sh, s_sh = sharded_init(mesh)
        abstract_f, abstract_states = jax.eval_shape(init, jax.random.key(5))
        target = {"f": abstract_f, "states": abstract_states}
        with ocp.StandardCheckpointer() as ckptr:
            restored = ckptr.restore(path, target)
    assert_shardings(restored["f"], f_sh, "restored parameters")
    assert_shardings(restored["states"], s_sh, "restored states")
    assert_close(restored, {"f": f, "states": states}, "restored values", rtol=0, atol=0)
    model = autostate.freeze(restored["f"], restored["states"])
    assert type(model) is example.Transformer


@check
def autostate_save_load_keep_the_like_models_shardings():
    mesh = mesh_2x4()
    f, states = example.Transformer(jax.random.key(0), CFG).functionalize()
    f_sh, s_sh = autostate.shardings(f, states, mesh, rules=RULES)
    trained = autostate.freeze(*jax.device_put((f, states), (f_sh, s_sh)))
    with tempfile.TemporaryDirectory() as tmp:
        autostate.save(Path(tmp) / "ckpt.npz", trained)  # gathers each array to the host
        fresh = example.Transformer(jax.random.key(1), CFG).functionalize()
        like = autostate.freeze(*jax.device_put(fresh, (f_sh, s_sh)))
        loaded = autostate.load(Path(tmp) / "ckpt.npz", like=like)
    lf, ls = loaded.functionalize()
    assert_shardings(lf, f_sh, "loaded parameters")
    assert_shardings(ls, s_sh, "loaded states")
    assert_close((lf, ls), (f, states), "loaded values", rtol=0, atol=0)


# --- a stack and an optimizer on the mesh: keypaths, checkpoints, moments ---------------------


@autostate.stateful
class MLPBlock:
    """A weakly typed bias (``jnp.full``), a bf16 weight and a running mean, annotated.

    Smooth (``tanh``, not ``relu``): eight devices and one round the bf16 product
    differently, and a kink would turn that rounding into a different gradient."""

    def __init__(self, key, d=8, hidden=16):
        k1, k2 = jax.random.split(key)
        self.w1 = autostate.sharded(jax.random.normal(k1, (d, hidden)) / d**0.5, P("embed", "mlp"))
        self.b1 = autostate.sharded(jnp.full(hidden, 0.01), P("mlp"))
        w2 = jax.random.normal(k2, (hidden, d)) / hidden**0.5
        self.w2 = autostate.sharded(w2.astype(jnp.bfloat16), P("mlp", "embed"))
        self.mean = autostate.state(jnp.zeros(d), sharding=P("embed"))

    def __call__(self, x):
        self.mean = 0.9 * self.mean + 0.1 * x.mean(0)
        h = jnp.tanh(x @ self.w1 + self.b1)  # (smooth: bf16 rounding moves no kink)
        return x + (h.astype(jnp.bfloat16) @ self.w2).astype(jnp.float32)


@autostate.stateful
class MLPStack:
    """Four blocks: a stack (``layer_axis`` as given) or, with ``stacked=False``, a list."""

    def __init__(self, key, stacked=True, layer_axis=None):
        blocks = [MLPBlock(k) for k in jax.random.split(key, 4)]
        self.blocks = autostate.stack(blocks, layer_axis=layer_axis) if stacked else blocks

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def mlp_init(stacked, layer_axis=None):
    return lambda key: MLPStack(key, stacked, layer_axis).functionalize()


def built_in_layout(init, mesh, rules):
    """``init`` jitted to build in the layout its annotations and ``rules`` give."""
    shardings = autostate.shardings(*jax.eval_shape(init, jax.random.key(0)), mesh, rules=rules)
    return jax.jit(init, out_shardings=shardings), shardings


def assert_standard_keypaths(tree, what):
    standard = (jax.tree_util.DictKey, jax.tree_util.GetAttrKey, jax.tree_util.SequenceKey,
                jax.tree_util.FlattenedIndexKey)
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        assert all(type(k) in standard for k in path), (what, path)
        jax.tree_util.keystr(path)


@check
def orbax_saves_a_stack_and_restores_it_in_another_layout():
    import orbax.checkpoint as ocp

    mesh = mesh_2x4()
    saved_rules = {"embed": None, "mlp": "model"}
    target_rules = {"embed": "model", "mlp": "data"}
    # (stacked, the saved stack's layer axis, the target's)
    for stacked, layer_axis, target_axis in (
        (True, None, None), (True, "data", "data"), (True, None, "data"), (False, None, None),
    ):
        init = mlp_init(stacked, layer_axis)
        rules = {**target_rules, "mlp": None} if target_axis == "data" else target_rules
        build, _ = built_in_layout(init, mesh, saved_rules)
        f, states = build(jax.random.key(0))
        assert_standard_keypaths({"f": f, "states": states}, "saved")
        names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(f)]
        want = (".model.blocks.w1" if stacked else ".model.blocks[0].w1")
        assert names[0] == want, names  # the names of param_dict, after f's ".model"
        assert names == [".model." + n for n in autostate.param_dict(autostate.freeze(f, states))]
        what = f"stacked={stacked}, layer axis {layer_axis} into {target_axis}"
        target_build, (f_sh, s_sh) = built_in_layout(mlp_init(stacked, target_axis), mesh, rules)
        abstract_f, abstract_states = jax.eval_shape(target_build, jax.random.key(1))
        moved = [x.sharding.spec != sh.spec for x, sh in zip(leaves(f), leaves(f_sh), strict=True)]
        assert all(moved), what  # every parameter restored into another layout
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "ckpt"
            with ocp.StandardCheckpointer() as ckptr:
                ckptr.save(path, {"f": f, "states": states})
            with ocp.StandardCheckpointer() as ckptr:
                restored = ckptr.restore(path, {"f": abstract_f, "states": abstract_states})
        assert_shardings(restored["f"], f_sh, f"restored parameters, {what}")
        assert_shardings(restored["states"], s_sh, f"restored states, {what}")
        saved = leaves({"f": f, "states": states})
        assert_close(leaves(restored), saved, f"restored, {what}", rtol=0, atol=0)
        model = autostate.freeze(restored["f"], restored["states"])
        assert type(model.blocks) is (autostate.Stack if stacked else list), what
        # The per-layer names load into the stack (or the list), in the like model's layout.
        like = autostate.freeze(*target_build(jax.random.key(2)))
        loaded = autostate.load_param_dict(like, autostate.param_dict(model, per_layer=True))
        loaded = autostate.load_state_dict(loaded, autostate.state_dict(model, per_layer=True))
        assert_shardings(loaded.functionalize(), (f_sh, s_sh), f"loaded per layer, {what}")
        assert_close(leaves(loaded.functionalize()), leaves((f, states)), f"loaded per layer, {what}",
                     rtol=0, atol=0)


@check
def optimizer_moments_take_their_parameters_shardings():
    # Adam's moments of a weakly typed, a bf16 and a stacked parameter: each in its
    # parameter's sharding when the optimizer is made (never gathered on one device),
    # and after each compiled step; the numbers those of one device.
    import optax

    mesh = mesh_2x4()
    rules = {"embed": None, "mlp": "model"}

    def loss_of(m, x):
        return jnp.mean(m(x) ** 2)

    @autostate.jit
    def step(opt, x):
        loss, grads = autostate.value_and_grad(loss_of)(opt.model, x)
        opt.update(grads)
        return loss

    def check_moments(opt, f_sh, what):
        params = leaves(opt.model.functionalize()[0])
        assert_shardings(params, f_sh, f"parameters, {what}")  # as annotated
        moments = [t for t in jax.tree_util.tree_leaves(
            opt.opt_state, is_leaf=lambda t: isinstance(t, autostate.FunctionalModel))
            if isinstance(t, autostate.FunctionalModel)]
        assert len(moments) == 2, what  # mu and nu
        for moment in moments:
            assert_standard_keypaths(moment, what)
            for m, p in zip(leaves(moment), params, strict=True):
                assert m.shape == p.shape and m.dtype == p.dtype, (what, m, p)
                assert m.sharding.is_equivalent_to(p.sharding, p.ndim), (
                    f"{what}: moment {m.sharding} of a parameter {p.sharding}")
        (count,) = [x for x in leaves(opt.opt_state) if x.ndim == 0]
        assert count.sharding.is_fully_replicated, (what, count.sharding)

    x = jax.random.normal(jax.random.key(2), (8, 8))
    for stacked, layer_axis in ((True, None), (True, "data"), (False, None)):
        what = f"stacked={stacked}, layer_axis={layer_axis}"
        init = mlp_init(stacked, layer_axis)
        build, (f_sh, _) = built_in_layout(init, mesh, rules)
        model = autostate.freeze(*build(jax.random.key(0)))
        params = leaves(model.functionalize()[0])
        assert any(p.weak_type for p in params) and any(p.dtype == jnp.bfloat16 for p in params)
        single = autostate.freeze(*init(jax.random.key(0)))
        opt = autostate.Optimizer(model, optax.adam(1e-2))
        opt1 = autostate.Optimizer(single, optax.adam(1e-2))
        check_moments(opt, f_sh, f"made, {what}")
        for i in range(3):
            loss, loss1 = step(opt, x), step(opt1, x)
            assert_close(loss, loss1, f"loss, step {i}, {what}", rtol=1e-2, atol=1e-3)
            assert_close(opt.opt_state, opt1.opt_state, f"moments, step {i}, {what}",
                         rtol=2e-2, atol=1e-3)
            check_moments(opt, f_sh, f"after step {i}, {what}")


@check
def an_eager_cache_reset_keeps_the_caches_sharding():
    # nn.MultiheadAttention.reset_cache() on a sharded model, eagerly: new zeros in
    # the cache's own layout (never gathered on the default device).
    from autostate import nn

    mesh = mesh_2x4()
    layer = nn.MultiheadAttention(16, 4, batch_first=True, max_len=8, cache_batch_size=4,
                                  key=jax.random.key(0))
    f, states = layer.functionalize()
    specs = {"k_cache": P("data", None, "model"), "v_cache": P("data", None, "model"),
             "cache_pos": P()}
    placed = {name: NamedSharding(mesh, spec) for name, spec in specs.items()}
    layer = autostate.freeze(f, jax.device_put(states, placed))
    layer(jnp.ones((4, 1, 16)), jnp.ones((4, 1, 16)), jnp.ones((4, 1, 16)))
    assert int(layer.cache_pos) == 1
    layer.reset_cache()
    for name, sharding in placed.items():
        value = getattr(layer, name)
        assert value.sharding.is_equivalent_to(sharding, value.ndim), (name, value.sharding)
        assert not value.any(), name


# --- the example, as ``python examples/sharded_training.py --smoke`` runs it --------------


@check
def example_trains_at_smoke_size():
    assert jax.device_count() == 8, jax.devices()
    example.main(["--smoke"])  # what it prints is compared by test_sharding.py


# Libraries of the test extra that the package does not need: a check or a
# program that imports one reports itself skipped where it is not installed.
OPTIONAL = ("orbax", "optax")


def _run(fn: Callable[[], object]) -> dict[str, str | None]:
    out = io.StringIO()
    error = skipped = None
    try:
        with contextlib.redirect_stdout(out):
            fn()
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in OPTIONAL:
            error = traceback.format_exc()
        skipped = f"{e.name} is not installed"
    except (Exception, SystemExit):  # noqa: BLE001 - reported to the pytest side
        error = traceback.format_exc()
    return {"error": error, "skipped": skipped, "stdout": out.getvalue()}


def _run_program(path: Path) -> None:
    """``python path`` from its folder, in this process; the environment is restored after."""
    environ = dict(os.environ)
    try:
        with contextlib.chdir(path.parent):
            runpy.run_path(str(path), run_name="__main__")
    finally:
        os.environ.clear()
        os.environ.update(environ)


def main(argv: list[str]) -> int:
    programs = [arg for arg in argv if arg.endswith(".py")]
    names = [arg for arg in argv if not arg.endswith(".py")] or list(CHECKS)
    results = {
        "checks": {name: _run(CHECKS[name]) for name in names},
        "programs": {p: _run(lambda p=p: _run_program(Path(p))) for p in programs},
    }
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
