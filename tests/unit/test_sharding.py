"""``autostate.sharding``: annotations, sharding trees, and the 8-device checks.

The single-device tests run here. The multi-device ones live in
``tests/sharding_checks.py``, which this file runs once in a separate process
on 8 virtual CPU devices (the device count is fixed when JAX starts, so the
rest of the suite keeps one device); each check is reported as its own test.
The same process runs ``examples/sharded_training.py --smoke`` and the Python
blocks of ``docs/scaling_out.md`` that ask for 8 devices, each as its own
``__main__``: one start of JAX for all of them. That each of these programs
asks for the devices itself, before it imports JAX, is what gives that process
its 8 devices (the example is loaded first) and, for the doc blocks, is read
from their text.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from semantics.harness import assert_same, check, pair, snapshot
from semantics.programs_shared import Loader

import autostate
from autostate import errors, sharding

ROOT = Path(__file__).resolve().parents[2]


CHECKS_SCRIPT = ROOT / "tests" / "sharding_checks.py"


DOC = ROOT / "docs" / "scaling_out.md"


EXAMPLE = ROOT / "examples" / "sharded_training.py"


EIGHT_DEVICES = "--xla_force_host_platform_device_count=8"


CHECK_NAMES = [
    "annotations_give_named_shardings",
    "two_meshes_give_their_own_shardings",
    "bad_annotations_are_clear_errors",
    "sharded_init_materializes_each_array_in_its_layout",
    "dp_tp_step_equals_single_device",
    "compiled_step_keeps_each_arrays_layout",
    "rolled_loop_over_a_sharded_stack",
    "jit_level_statistics_equal_full_batch",
    "shard_map_pmean_statistics_equal_full_batch",
    "shard_map_inside_a_method_writes_reduced_states",
    "donated_decode_updates_the_cache_in_place",
    "orbax_restores_into_the_sharded_abstract_model",
    "autostate_save_load_keep_the_like_models_shardings",
    "orbax_saves_a_stack_and_restores_it_in_another_layout",
    "optimizer_moments_take_their_parameters_shardings",
    "an_eager_cache_reset_keeps_the_caches_sharding",
    "example_trains_at_smoke_size",
]


_FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)


_PRINT = re.compile(r"^print\(.*\)\s*#\s*(?P<expected>.*)$")


def _doc_blocks() -> dict[str, str]:
    """The page's Python blocks that ask for 8 devices, by ``scaling_out.md:LINE``."""
    text = DOC.read_text()
    return {
        f"scaling_out.md:{text.count(chr(10), 0, m.start()) + 1}": m.group(2)
        for m in _FENCE.finditer(text)
        if m.group(1) == "python" and EIGHT_DEVICES in m.group(2)
    }


DOC_BLOCKS = _doc_blocks()


def _program_file(block: str) -> str:
    return block.replace(".md:", "_md_") + ".py"


def _asks_for_eight_devices_before_importing_jax(code: str) -> bool:
    lines = code.splitlines()
    flag = next(i for i, line in enumerate(lines) if EIGHT_DEVICES in line)
    first_jax = next(i for i, line in enumerate(lines) if re.match(r"(import|from) jax\b", line))
    return flag < first_jax


@pytest.fixture(scope="module")
def eight_device_results(once_per_session: Callable[..., Any]) -> dict[str, dict]:
    """The checks' and the doc programs' results from one process on 8 devices."""

    def run(folder: Path) -> dict[str, dict]:
        programs = []
        for block, code in DOC_BLOCKS.items():
            (folder / _program_file(block)).write_text(code)
            programs.append(str(folder / _program_file(block)))
        env = dict(os.environ, JAX_PLATFORMS="cpu")  # without the flag: the example sets it
        env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace(EIGHT_DEVICES, "").strip()
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        result = subprocess.run(
            [sys.executable, str(CHECKS_SCRIPT), *programs],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
        )
        assert result.returncode == 0, result.stderr
        results = json.loads(result.stdout.strip().splitlines()[-1])
        results["programs"] = {Path(p).name: r for p, r in results["programs"].items()}
        return results

    return once_per_session("eight_devices", run)


@pytest.fixture(scope="module")
def check_results(eight_device_results: dict[str, dict]) -> dict[str, dict]:
    return eight_device_results["checks"]


def _skip_without_its_library(result: dict) -> None:
    """A check or program that needs a library of the test extra (orbax, optax)
    the environment lacks is skipped, as ``pytest.importorskip`` would."""
    if result.get("skipped"):
        pytest.skip(result["skipped"])


@pytest.mark.parametrize("name", CHECK_NAMES)
def test_on_eight_devices(check_results: dict[str, dict], name: str) -> None:
    assert name in check_results, sorted(check_results)
    _skip_without_its_library(check_results[name])
    assert check_results[name]["error"] is None, check_results[name]["error"]


def test_every_check_is_listed(check_results: dict[str, dict]) -> None:
    assert sorted(check_results) == sorted(CHECK_NAMES)


def test_the_example_asks_for_eight_devices_and_trains_at_smoke_size(
    check_results: dict[str, dict],
) -> None:
    assert _asks_for_eight_devices_before_importing_jax(EXAMPLE.read_text())
    result = check_results["example_trains_at_smoke_size"]
    assert result["error"] is None, result["error"]
    lines = result["stdout"].splitlines()
    assert lines[0] == "mesh {'data': 2, 'model': 4}; blocks[0].attn.wq sharded as P(None, 'model')"
    assert [line.split("  loss")[0] for line in lines[1:3]] == ["step 1", "step 2"]
    assert all(0 < float(line.split("loss ")[1]) < 10 for line in lines[1:3])
    assert lines[3] == "step counter 2; states kept their shardings: True"


def test_the_docs_page_has_eight_device_programs() -> None:
    assert len(DOC_BLOCKS) >= 2


@pytest.mark.parametrize("block", sorted(DOC_BLOCKS))
def test_doc_program_on_eight_devices(eight_device_results: dict[str, dict], block: str) -> None:
    code = DOC_BLOCKS[block]
    assert _asks_for_eight_devices_before_importing_jax(code)
    result = eight_device_results["programs"][_program_file(block)]
    _skip_without_its_library(result)
    assert result["error"] is None, result["error"]
    prints = [_PRINT.match(line) for line in code.splitlines() if line.startswith("print(")]
    lines = result["stdout"].splitlines()
    assert len(lines) == len(prints), result["stdout"]
    for match, actual in zip(prints, lines):
        if match is not None:
            assert " ".join(match.group("expected").split()) in " ".join(actual.split())


@autostate.stateful
class Norm:
    def __init__(self, n):
        self.scale = autostate.sharded(jnp.ones(n), P("embed"))
        self.bias = jnp.zeros(n)
        self.mean = autostate.state(jnp.zeros(n), sharding=P("embed"))
        self.kv = autostate.state({"k": jnp.zeros((2, n)), "v": jnp.zeros((2, n))},
                                  sharding={"k": P(None, "embed"), "v": P()})
        self.count = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.count += 1
        self.mean = 0.9 * self.mean + 0.1 * x.mean(0)
        return (x - self.mean) * self.scale + self.bias


def test_annotations_show_in_the_repr_and_do_not_change_values():
    model = Norm(4)
    assert type(model.scale) is type(jnp.ones(1)) and model.scale.shape == (4,)
    text = repr(model)
    assert "scale=f32[4] sharded P('embed',)" in text
    assert "bias=f32[4]," in text and "__autostate" not in text
    assert "mean=<state 'mean' category='state' initial value: f32[4]> sharded P('embed',)" in text


def test_partition_specs_have_the_structure_of_f_and_states():
    f, states = Norm(4).functionalize()
    f_specs, s_specs = autostate.partition_specs(f, states)
    assert jax.tree_util.tree_structure(f_specs) == jax.tree_util.tree_structure(f)
    assert f_specs.model.scale == P("embed") and f_specs.model.bias == P()
    assert s_specs == {"mean": P("embed"), "kv": {"k": P(None, "embed"), "v": P()},
                       "count": P()}
    _, mapped = autostate.partition_specs(f, states, rules={"embed": "model"})
    assert mapped["kv"]["k"] == P(None, "model") and mapped["mean"] == P("model")


def test_annotations_survive_calls_freeze_jit_and_pickle():
    import pickle

    f, states = Norm(4).functionalize()
    _, states = jax.jit(lambda f, s, x: f(s, x))(f, states, jnp.ones((3, 4)))
    f2, s2 = jax.jit(lambda f, s: (f, s))(f, states)
    want = autostate.partition_specs(f, states)
    assert autostate.partition_specs(f2, s2) == want
    model = pickle.loads(pickle.dumps(autostate.freeze(f2, s2)))
    assert autostate.partition_specs(*model.functionalize()) == want
    assert autostate.partition_specs(*jax.eval_shape(lambda: (f, states))) == want


def test_shardings_on_a_one_device_mesh_are_ready_for_jit():
    mesh = jax.make_mesh((1, 1), ("data", "model"))
    f, states = Norm(4).functionalize()
    f_sh, s_sh = autostate.shardings(f, states, mesh, rules={"embed": "model"})
    step = jax.jit(lambda f, s, x: f(s, x), in_shardings=(f_sh, s_sh, None),
                   out_shardings=(None, s_sh))
    _, new = step(*jax.device_put((f, states), (f_sh, s_sh)), jnp.ones((3, 4)))
    assert int(new["count"]) == 1


def test_a_spec_that_does_not_fit_the_value_is_a_clear_error():
    with pytest.raises(TypeError, match="PartitionSpec"):
        autostate.sharded(jnp.ones(3), "model")

    @autostate.stateful
    class Bad:
        def __init__(self):
            self.kv = autostate.state({"k": jnp.zeros(2)}, sharding={"q": P()})

    with pytest.raises(autostate.AutostateError, match="does not match its value's structure"):
        autostate.partition_specs(*Bad().functionalize())

    @autostate.stateful
    class WrongRank:
        def __init__(self):
            self.w = autostate.sharded(jnp.ones(4), P(None, "data"))

    mesh = jax.make_mesh((1,), ("data",))
    with pytest.raises(ValueError, match="of 'w' has 2 entries, but the array has 1"):
        autostate.shardings(*WrongRank().functionalize(), mesh)
    # (a mesh of another type raised AttributeError "'str' object has no attribute 'size'")
    with pytest.raises(errors.InvalidTypeError, match="places on a jax.sharding.Mesh, got str"):
        autostate.shardings(*Norm(4).functionalize(), "data")


def test_states_of_other_categories_keep_their_annotation_as_leaves_of_f():
    @autostate.stateful
    class TwoKinds:
        def __init__(self):
            self.mean = autostate.state(jnp.zeros(4), sharding=P("model"))
            self.cache = autostate.state(jnp.zeros((3, 4)), category="cache",
                                         sharding=P(None, "model"))

        def __call__(self, x):
            self.mean = self.mean + 1
            self.cache = self.cache + x
            return x

    model = TwoKinds()
    model = autostate.freeze(*model.functionalize())  # both states hold values now
    f, states = model.functionalize("cache")
    f_specs, s_specs = autostate.partition_specs(f, states)
    assert s_specs == {"cache": P(None, "model")}
    assert jax.tree_util.tree_leaves(f_specs, is_leaf=lambda x: isinstance(x, P)) == [P("model")]


def test_a_marker_stored_by_a_custom_setattr_is_a_clear_error():
    @autostate.stateful
    class OwnSetattr:
        def __init__(self):
            self.w = autostate.sharded(jnp.ones(2), P("model"))

        def __setattr__(self, name, value):
            object.__setattr__(self, name, value)

    with pytest.raises(TypeError, match="defines its own __setattr__"):
        autostate.partition_specs(*OwnSetattr().functionalize())


SHARD = """
SHARDED = autostate.sharded if STATE is autostate.state else (lambda v, spec: v)


@DECORATE
class Block:
    def __init__(self, seed):
        k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
        self.w1 = SHARDED(jax.random.normal(k1, (4, 8)) / 2, P("embed", "mlp"))
        self.w2 = SHARDED(jax.random.normal(k2, (8, 4)) / 3, P("mlp", None))
        self.mean = STATE(jnp.zeros(4), sharding=P("embed"))
        self.cache = STATE({"k": jnp.zeros((2, 8)), "n": jnp.zeros((), jnp.int32)},
                           sharding={"k": P(None, "mlp"), "n": P()})
        self.step = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.step += 1
        self.mean = 0.9 * self.mean + 0.1 * x.mean(0)
        h = jax.nn.gelu((x - self.mean) @ self.w1)
        self.cache = {"k": self.cache["k"].at[self.cache["n"] % 2].set(h.mean(0)),
                      "n": self.cache["n"] + 1}
        return x + h @ self.w2 + self.cache["k"].sum()
"""


SHARD_HEADER = "from jax.sharding import PartitionSpec as P\n"


SX = jnp.arange(8.0).reshape(2, 4) / 8


def test_annotated_model_matches_plain_everywhere(write_module: Loader) -> None:
    plain, dec = pair(write_module, SHARD_HEADER + SHARD)
    calls = [("__call__", (SX,)), ("__call__", (SX * 2,)), ("__call__", (-SX,))]
    check(plain, dec, "Block(0)", calls, modes=("f", "jit"))
    ref, model = plain.Block(0), dec.Block(0)
    assert_same([ref(*a) for _, a in calls], [model(*a) for _, a in calls], "eager outputs")
    for name in ("w1", "w2", "mean", "cache", "step"):
        assert_same(snapshot(getattr(ref, name)), snapshot(getattr(model, name)), name)


def test_vars_of_an_annotated_model_are_the_plain_ones(write_module: Loader) -> None:
    src = SHARD_HEADER + SHARD + """
    def names(self):
        return sorted(vars(self))

    def arrays(self):
        return [v for v in vars(self).values() if isinstance(v, jax.Array)]
"""
    plain, dec = pair(write_module, src)
    ref, model = plain.Block(0), dec.Block(0)
    assert ref.names() == model.names()
    assert_same(ref.arrays(), model.arrays())


def test_sharded_jitted_training_on_a_one_device_mesh_matches_plain(write_module: Loader) -> None:
    plain, dec = pair(write_module, SHARD_HEADER + SHARD)
    ref = plain.Block(1)
    f, states = dec.Block(1).functionalize()
    mesh = jax.make_mesh((1,), ("model",), axis_types=(AxisType.Auto,))
    rules = {"embed": None, "mlp": "model"}
    f_sh, s_sh = autostate.shardings(f, states, mesh, rules=rules)
    assert f_sh.model.w1.spec == P(None, "model") and s_sh["cache"]["k"].spec == P(None, "model")
    f, states = jax.device_put((f, states), (f_sh, s_sh))
    step = jax.jit(lambda f, s, x: f(s, x), in_shardings=(f_sh, s_sh, None),
                   out_shardings=(None, s_sh), donate_argnums=(1,))
    for x in (SX, SX * 2, -SX):
        expected = ref(x)
        out, states = step(f, states, x)
        assert_same(expected, out)
    frozen = autostate.freeze(f, states)
    for name in ("w1", "w2", "mean", "cache", "step"):
        assert_same(snapshot(getattr(ref, name)), snapshot(getattr(frozen, name)), name)
    f_specs, s_specs = autostate.partition_specs(f, states, rules=rules)
    assert s_specs["mean"] == P(None) and s_specs["step"] == P()


def test_annotations_survive_pack_and_eval_shape(write_module: Loader) -> None:
    plain, dec = pair(write_module, SHARD_HEADER + SHARD)
    abstract = jax.eval_shape(lambda: dec.Block(2).functionalize())
    _, s_specs = autostate.partition_specs(*abstract, rules={"embed": None, "mlp": "model"})
    assert s_specs["cache"] == {"k": P(None, "model"), "n": P()}
    ref = plain.Block(2)
    pf, pstates = autostate.pack(*dec.Block(2).functionalize())
    for x in (SX, -SX):
        expected = ref(x)
        out, pstates = jax.jit(lambda f, s, x: f(s, x))(pf, pstates, x)
        assert_same(expected, out)


@pytest.mark.parametrize("bad", ["too-many-dims", "unknown-axis", "spec-tree-mismatch", "not-a-spec"])
def test_bad_annotations_are_clear_errors_naming_the_attribute(write_module: Loader, bad: str) -> None:
    value, spec, attr = {
        "too-many-dims": ("jnp.zeros(4)", 'P("mlp", None)', "w"),
        "unknown-axis": ("jnp.zeros((4, 8))", 'P("data", "mlp")', "w"),
        "spec-tree-mismatch": ('{"a": jnp.zeros(2), "b": jnp.zeros(2)}', '{"a": P()}', "s"),
        "not-a-spec": ("jnp.zeros(4)", '("mlp",)', "w"),
    }[bad]
    if attr == "w":
        line = f"self.w = autostate.sharded({value}, {spec})"
    else:
        line = f"self.s = autostate.state({value}, sharding={spec})"
    src = SHARD_HEADER + f"""
@DECORATE
class Bad:
    def __init__(self):
        {line}

    def __call__(self, x):
        return x
"""
    _, dec = pair(write_module, src)
    mesh = jax.make_mesh((1,), ("model",))
    with pytest.raises(autostate.AutostateError) as info:
        f, states = dec.Bad().functionalize()
        autostate.shardings(f, states, mesh, rules={"mlp": "model"})
    assert isinstance(info.value, errors.InvalidArgumentError | errors.InvalidTypeError)
    if bad == "not-a-spec":  # raised by autostate.sharded itself, on the user's line
        assert "('mlp',)" in str(info.value) and "fix" in str(info.value)
        return
    assert repr(attr) in str(info.value) or f".{attr}" in str(info.value), str(info.value)
    assert "fix" in str(info.value)


class FactoredTx:
    """An optimizer state with a moment per parameter, a factored (other-shaped)
    one, a masked-out place and a count: what ``made_in_layout`` must tell apart."""

    def init(self, params):
        leaves, treedef = jax.tree_util.tree_flatten(params)
        moment = jax.tree.map(jnp.zeros_like, params)
        rows = treedef.unflatten([jnp.zeros(leaf.shape[:1]) for leaf in leaves])
        masked = treedef.unflatten([jnp.zeros_like(leaf) if leaf.ndim == 2 else None
                                    for leaf in leaves])
        return {"moment": moment, "rows": rows, "masked": masked,
                "count": jnp.zeros((), jnp.int32)}


def test_made_in_layout_places_what_stands_for_a_parameter() -> None:
    params = {"w": jnp.ones((4, 3)), "b": jnp.full(4, 0.5)}  # b weakly typed
    # Nothing placed: init runs as it is (nothing committed, nothing compiled).
    eager = sharding.made_in_layout(FactoredTx().init, params)
    assert not any(x.committed for x in jax.tree_util.tree_leaves(eager))
    # Placed on a device: each parameter-shaped array made there, values unchanged.
    device = jax.devices()[-1]
    placed = jax.device_put(params, device)
    made = sharding.made_in_layout(FactoredTx().init, placed)
    assert jax.tree_util.tree_structure(made) == jax.tree_util.tree_structure(eager)
    for x, y in zip(jax.tree_util.tree_leaves(made), jax.tree_util.tree_leaves(eager)):
        assert x.shape == y.shape and x.dtype == y.dtype and x.weak_type == y.weak_type
        np.testing.assert_array_equal(x, y)
    for name in ("moment", "masked"):
        for x in jax.tree_util.tree_leaves(made[name]):
            assert x.committed and x.sharding == jax.sharding.SingleDeviceSharding(device)
    assert made["moment"]["b"].weak_type and made["masked"]["b"] is None
    assert made["rows"]["w"].shape == (4,) and made["count"].dtype == jnp.int32
    # Under a trace (an optimizer made inside a compiled step): as it is.
    traced = jax.jit(lambda p: sharding.made_in_layout(FactoredTx().init, p))(placed)
    assert jax.tree_util.tree_structure(traced) == jax.tree_util.tree_structure(eager)
