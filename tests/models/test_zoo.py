"""Every zoo model: N eager steps == N jitted functional steps; freeze round trips.

For each model the same inputs go through (a) the model called eagerly and
(b) ``f, states = model.functionalize()`` stepped by ``jax.jit`` with ``f``
as an argument. Outputs and final states must agree (floats to a tight
tolerance, ints and keys exactly), the final states must be what the eager
model shows as plain attributes, and ``freeze`` must give back a model of the
same class that runs on and functionalizes to the same states and leaves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autostate

from . import zoo
from .checks import (
    as_numpy,
    assert_states_close,
    assert_trees_close,
    eager_states,
    jit_call,
    read_path,
)

STEPS = 4


def _normal(seed: int, shape: tuple[int, ...]) -> jax.Array:
    return jax.random.normal(jax.random.PRNGKey(seed), shape)


@dataclasses.dataclass
class Case:
    build: Callable[[], Any]
    inputs: Callable[[int], tuple]
    names: list[str]  # the expected state names


def _ema_params(step: int) -> tuple:
    return ({"w": _normal(step, (2, 3)), "b": _normal(100 + step, (3,))},)


CASES = {
    "counter": Case(zoo.Counter, lambda i: (jnp.float32(i + 1),), ["count"]),
    "batchnorm": Case(lambda: zoo.BatchNorm(3), lambda i: (_normal(i, (8, 3)),), ["mean", "var"]),
    "mlp": Case(
        lambda: zoo.MLP(jax.random.PRNGKey(0), [3, 5, 4, 2]),
        lambda i: (_normal(i, (6, 3)),),
        [f"blocks[{b}].bn.{s}" for b in range(3) for s in ("mean", "var")],
    ),
    "stacked_mlp": Case(
        lambda: zoo.StackedMLP(jax.random.PRNGKey(5), 4, 3),
        lambda i: (_normal(i, (6, 4)),),
        ["blocks.bn.mean", "blocks.bn.var", "steps"],
    ),
    "decoder": Case(
        lambda: zoo.Decoder(jax.random.PRNGKey(1), 4, 6, batch=2),
        lambda i: (_normal(i, (2, 4)),),
        ["k_cache", "v_cache", "pos"],
    ),
    "rnn": Case(
        lambda: zoo.RNNCell(jax.random.PRNGKey(2), 2, 3), lambda i: (_normal(i, (2,)),), ["h"]
    ),
    "dropout": Case(
        lambda: zoo.Dropout(jax.random.PRNGKey(3)), lambda i: (_normal(i, (16,)),), ["key"]
    ),
    "dropout_typed_key": Case(
        lambda: zoo.Dropout(jax.random.key(4), rate=0.25),
        lambda i: (_normal(i, (16,)),),
        ["key"],
    ),
    "ema": Case(lambda: zoo.EMA(_ema_params(0)[0]), _ema_params, ["shadow", "updates"]),
}


@pytest.fixture(params=sorted(CASES))
def case(request) -> Case:
    return CASES[request.param]


def _run_eager(case: Case) -> tuple[Any, list[Any]]:
    model = case.build()
    outs = [model(*case.inputs(i)) for i in range(STEPS)]
    return model, outs


def _run_jitted(case: Case) -> tuple[Any, dict[str, Any], list[Any]]:
    f, states = case.build().functionalize()
    outs = []
    for i in range(STEPS):
        out, states = jit_call(f, states, *case.inputs(i))
        outs.append(out)
    return f, states, outs


def test_state_names(case: Case):
    _, states = case.build().functionalize()
    assert sorted(states) == sorted(case.names)


def test_eager_steps_equal_jitted_functional_steps(case: Case):
    model, eager_outs = _run_eager(case)
    _, states, jit_outs = _run_jitted(case)
    for eager_out, jit_out in zip(eager_outs, jit_outs):
        assert_trees_close(jit_out, eager_out)
    assert_states_close(states, eager_states(model, case.names))


def test_steps_change_state(case: Case):
    """Guards the comparison above against a model whose state never moves."""
    model, _ = _run_eager(case)
    _, initial = case.build().functionalize()
    for name in case.names:
        before, after = initial[name], read_path(model, name)
        leaves = zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(after))
        changed = any(not np.array_equal(as_numpy(a), as_numpy(b)) for a, b in leaves)
        assert changed, name


def test_freeze_gives_the_same_class_with_the_eager_state(case: Case):
    model, _ = _run_eager(case)
    f, states, _ = _run_jitted(case)
    frozen = autostate.freeze(f, states)
    assert type(frozen) is type(model)
    assert_states_close(eager_states(frozen, case.names), eager_states(model, case.names))

    f2, states2 = frozen.functionalize()
    assert_states_close(states2, states)
    assert_trees_close(jax.tree_util.tree_leaves(f2), jax.tree_util.tree_leaves(f))
    assert len(jax.tree_util.tree_leaves(f2)) == len(jax.tree_util.tree_leaves(f))


def test_frozen_model_keeps_running_like_the_eager_one(case: Case):
    model, _ = _run_eager(case)
    f, states, _ = _run_jitted(case)
    frozen = autostate.freeze(f, states)
    extra = case.inputs(STEPS)
    out_functional, states = jit_call(f, states, *extra)
    out_eager = model(*extra)
    assert_trees_close(frozen(*extra), out_eager)
    assert_trees_close(out_functional, out_eager)
    assert_states_close(eager_states(frozen, case.names), eager_states(model, case.names))
    assert_states_close(states, eager_states(model, case.names))


def test_a_stack_of_blocks_runs_as_the_list_of_blocks():
    # The same blocks held as a stack and as a list: outputs, states and parameter
    # gradients agree, eagerly and stepped by jax.jit.
    def build(stacked: bool) -> Any:
        return zoo.StackedMLP(jax.random.PRNGKey(5), 4, 3, stacked=stacked)

    listed, stack = build(False), build(True)
    for i in range(STEPS):
        assert_trees_close(stack(_normal(i, (6, 4))), listed(_normal(i, (6, 4))))
    for s in ("mean", "var"):
        assert_trees_close(
            getattr(stack.blocks.bn, s), jnp.stack([getattr(b.bn, s) for b in listed.blocks])
        )
    f_list, s_list = build(False).functionalize()
    f_stack, s_stack = build(True).functionalize()

    def loss(f: Any, s: Any, x: Any) -> Any:
        out, s = f(s, x)
        return (out**2).mean(), s

    step = jax.jit(jax.grad(loss, has_aux=True))
    for i in range(STEPS):
        g_list, s_list = step(f_list, s_list, _normal(i, (6, 4)))
        g_stack, s_stack = step(f_stack, s_stack, _normal(i, (6, 4)))
    per_layer = autostate.param_dict(g_stack, per_layer=True)
    assert_trees_close(per_layer, autostate.param_dict(g_list))
    assert_states_close(
        autostate.state_dict(f_stack, s_stack, per_layer=True), autostate.state_dict(f_list, s_list)
    )
