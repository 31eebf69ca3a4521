"""Differential bug hunt 27: the public API round trips over a model's life.

- One model with sub-models in a list, a dict and a tuple and one sub-model
  shared by two parents, walked through: steps of ``f`` under ``jit``,
  ``freeze``, eager steps, ``functionalize`` again, ``pickle``,
  ``copy.deepcopy`` / ``copy.copy``, more steps; compared with the plain
  Python model run through the same steps at every stage.
- ``state_dict`` / ``param_dict`` / ``load_*`` round trips: into a fresh
  model, into one built with other init values, a missing / unexpected /
  mis-shaped / mis-typed key (``StateDictError`` naming the caller's line),
  ``strict=False``, after a sub-model was replaced by assignment.
- ``functionalize`` of a sub-model while its parent exists, twice in a row
  (the older ``f``/states still work), ``f`` after the model changed eagerly
  (``f`` is a copy: it does not see the change).
- ``jax.grad`` / ``value_and_grad`` over ``f`` with hand-written SGD against
  the plain model with the parameters injected; ``vmap`` over an ensemble of
  stacked ``f``/states; ``autostate.pack`` equal to unpacked, under ``grad``.
- ``jit`` with donated states; ``jax.tree_util`` over states; None, empty
  container, Python scalar, int/bool/uint8 states.

It found two bugs, both fixed: a Python-float state's ``state_dict`` entry
was float64 eagerly and float32 after ``f`` (the two did not load into each
other, nor a trained model's into a fresh one), and ``state_dict(f, states)``
with a state missing from ``states`` returned a dict without it.
"""

from __future__ import annotations

import copy
import pickle
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from differential import (  # noqa: I001 - tests/ is on sys.path
    _pair,
    assert_same,
    assert_user_line,
    check,
    pair,
    plain_path,
    snapshot,
)

import autostate
from autostate.errors import StateDictError, StateDictWarning

Loader = Callable[..., types.ModuleType]

# ======================================================================================
# The model
# ======================================================================================

NET = """
@DECORATE
class Leaf:
    def __init__(self, s):
        self.w = jnp.full((2,), s)
        self.count = jnp.zeros((), jnp.int32)
        self.mean = jnp.zeros(2)

    def __call__(self, x):
        self.count += 1
        self.mean = 0.5 * self.mean + 0.5 * x
        return x * self.w + self.mean

    def reset(self):
        self.count = jnp.zeros((), jnp.int32)
        self.mean = jnp.zeros(2)


@DECORATE
class Net:
    def __init__(self, scale=1.0):
        shared = Leaf(0.5 * scale)
        self.items = [Leaf(1.0 * scale), shared]
        self.by = {"a": Leaf(0.25 * scale), "b": shared}
        self.pair = (Leaf(0.75 * scale), Leaf(-0.5 * scale))
        self.bias = jnp.array([0.1, -0.2]) * scale
        self.total = jnp.zeros(2)
        self.seen = jnp.zeros((), jnp.int32)
        self.pos = jnp.array(False)

    def __call__(self, x):
        for leaf in self.items:
            x = jnp.tanh(leaf(x))
        x = self.by["a"](x) + self.by["b"](x)
        x = self.pair[0](x) - self.pair[1](x) + self.bias
        self.total = self.total + x
        self.seen += 1
        self.pos = x.sum() > 0
        return x

    def loss(self, x, y):
        return ((self(x) - y) ** 2).sum()

    def peek(self):
        return self.total + self.by["b"].mean
"""

X1 = jnp.array([0.3, -0.7])
X2 = jnp.array([1.1, 0.4])
Y = jnp.array([0.5, -0.5])


def step_jit() -> Callable[..., Any]:
    return jax.jit(lambda f, s, x: f(s, x))


def assert_shared(model: Any) -> None:
    assert model.items[1] is model.by["b"], "the shared sub-model was split"


def test_life_cycle_jit_freeze_eager_refunctionalize_pickle_copy(write_module: Loader) -> None:
    # Fresh modules (not the cached pair): pickling needs them in sys.modules.
    plain, dec = _pair(write_module, NET)
    ref = plain.Net()
    model = dec.Net()

    # 1. two jitted steps through f, then freeze
    f, states = model.functionalize()
    step = step_jit()
    for x in (X1, X2):
        want = ref(x)
        got, states = step(f, states, x)
        assert_same(want, got, "jit out")
    for key, value in states.items():
        assert_same(snapshot(plain_path(ref, key)), snapshot(value), f"state {key}")
    assert_same(snapshot(plain.Net()), snapshot(model), "the model itself changed")
    frozen = autostate.freeze(f, states)
    assert_shared(frozen)
    assert_same(snapshot(ref), snapshot(frozen), "frozen")

    # 2. eager steps on the frozen model
    for x in (X2, X1):
        assert_same(ref(x), frozen(x), "eager after freeze")
    assert_same(snapshot(ref), snapshot(frozen), "eager after freeze")

    # 3. functionalize again: f without jit, then a method through jit
    f2, states2 = frozen.functionalize()
    assert sorted(states2) == sorted(states)
    out, states2 = f2(states2, X1)
    assert_same(ref(X1), out, "second f")
    out, states2 = jax.jit(lambda f, s: f.peek(s))(f2, states2)
    assert_same(ref.peek(), out, "second f peek")
    frozen2 = autostate.freeze(f2, states2)
    assert_shared(frozen2)
    assert_same(snapshot(ref), snapshot(frozen2), "second freeze")

    # 4. pickle round trip, then steps
    ref_p = pickle.loads(pickle.dumps(ref))
    model_p = pickle.loads(pickle.dumps(frozen2))
    assert_shared(model_p)
    assert_same(snapshot(ref_p), snapshot(model_p), "unpickled")
    assert_same(ref_p(X2), model_p(X2), "eager after unpickle")
    f3, states3 = model_p.functionalize()
    out, states3 = step(f3, states3, X1)
    assert_same(ref_p(X1), out, "jit after unpickle")
    model_p = autostate.freeze(f3, states3)
    assert_same(snapshot(ref_p), snapshot(model_p), "after unpickle")

    # 5. deepcopy: the copy moves on, the original does not
    ref_d, model_d = copy.deepcopy(ref_p), copy.deepcopy(model_p)
    assert_shared(model_d)
    assert model_d.items[0] is not model_p.items[0]
    assert_same(ref_d(X2), model_d(X2), "eager after deepcopy")
    assert_same(snapshot(ref_d), snapshot(model_d), "deepcopy stepped")
    assert_same(snapshot(ref_p), snapshot(model_p), "deepcopy source")
    f4, states4 = model_d.functionalize()
    out, states4 = step(f4, states4, X1)
    assert_same(ref_d(X1), out, "jit after deepcopy")
    assert_same(snapshot(ref_d), snapshot(autostate.freeze(f4, states4)), "last freeze")


def test_shallow_copy_shares_sub_models_like_plain(write_module: Loader) -> None:
    plain, dec = pair(write_module, NET)
    ref, model = plain.Net(), dec.Net()
    ref(X1), model(X1)
    ref_c, model_c = copy.copy(ref), copy.copy(model)
    assert model_c.items is model.items
    assert_same(ref_c(X2), model_c(X2), "shallow copy out")
    # the copy's own total moved; the shared sub-models moved for both
    assert_same(snapshot(ref), snapshot(model), "shallow copy source")
    assert_same(snapshot(ref_c), snapshot(model_c), "shallow copy")


def test_freeze_of_a_copy_of_states_and_tree_map(write_module: Loader) -> None:
    plain, dec = pair(write_module, NET)
    ref = plain.Net()
    f, states = dec.Net().functionalize()
    _, states = f(states, X1)
    ref(X1)
    doubled = jax.tree_util.tree_map(lambda a: a * 2, states)
    assert type(doubled) is type(states)
    assert sorted(doubled) == sorted(states)
    copied = jax.tree_util.tree_map(jnp.copy, states)
    out, copied = step_jit()(f, copied, X2)
    assert_same(ref(X2), out, "after tree_map copy")
    leaves, treedef = jax.tree_util.tree_flatten(copied)
    rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
    assert_same(snapshot(ref), snapshot(autostate.freeze(f, rebuilt)), "unflattened states")
    # doubled states mean what doubled attributes mean
    frozen = autostate.freeze(f, doubled)
    assert_same(2 * np.asarray(states["total"]), frozen.total, "doubled total")
    assert_same(2 * np.asarray(states["by['a'].mean"]), frozen.by["a"].mean, "doubled mean")


# ======================================================================================
# state_dict / param_dict round trips
# ======================================================================================


def _trained(plain: types.ModuleType, dec: types.ModuleType, scale: float = 1.0) -> tuple[Any, Any]:
    ref, model = plain.Net(scale), dec.Net(scale)
    for x in (X1, X2, X1):
        ref(x)
        model(x)
    return ref, model


def test_state_and_param_dict_into_a_fresh_model(write_module: Loader) -> None:
    plain, dec = pair(write_module, NET)
    ref, model = _trained(plain, dec)
    sd, pd = autostate.state_dict(model), autostate.param_dict(model)
    assert "by['b'].count" not in sd and "items[1].count" in sd  # first path of the shared one
    assert "by['b'].w" not in pd and "items[1].w" in pd
    loaded = autostate.load_state_dict(autostate.load_param_dict(dec.Net(), pd), sd)
    assert_shared(loaded)
    assert_same(snapshot(ref), snapshot(loaded), "loaded")
    assert_same(ref(X2), loaded(X2), "loaded steps")
    assert_same(snapshot(ref), snapshot(loaded), "loaded stepped")
    # the dicts of f and states name the same arrays
    f, states = loaded.functionalize()
    assert_same(autostate.state_dict(loaded), autostate.state_dict(f, states), "sd of f")
    assert_same(autostate.param_dict(loaded), autostate.param_dict(f), "pd of f")


def test_state_dict_into_a_model_with_other_init_values(write_module: Loader) -> None:
    plain, dec = pair(write_module, NET)
    _, model = _trained(plain, dec)
    sd = autostate.state_dict(model)
    ref = plain.Net(3.0)  # other parameters; the states of the trained model
    for key, value in sd.items():
        exec("m." + key + " = v", {"m": ref, "v": value})  # noqa: S102
    loaded = autostate.load_state_dict(dec.Net(3.0), sd)
    assert_same(snapshot(ref), snapshot(loaded), "states loaded, params kept")
    assert_same(ref(X1), loaded(X1), "stepped")
    # and the parameters into a model with other states
    pd = autostate.param_dict(model)
    ref2 = plain.Net(3.0)
    ref2(X2)
    for key, value in pd.items():
        exec("m." + key + " = v", {"m": ref2, "v": value})  # noqa: S102
    fresh = dec.Net(3.0)
    fresh(X2)
    loaded2 = autostate.load_param_dict(fresh, pd)
    assert_same(snapshot(ref2), snapshot(loaded2), "params loaded, states kept")
    untouched = plain.Net(3.0)
    untouched(X2)
    assert_same(snapshot(untouched), snapshot(fresh), "load_param_dict changed its argument")


def test_load_state_dict_does_not_touch_its_argument(write_module: Loader) -> None:
    plain, dec = pair(write_module, NET)
    _, model = _trained(plain, dec)
    fresh = dec.Net()
    autostate.load_state_dict(fresh, autostate.state_dict(model))
    assert_same(snapshot(plain.Net()), snapshot(fresh), "argument changed")


@pytest.mark.parametrize("fault", ["missing", "extra", "shape", "dtype"])
def test_state_dict_that_does_not_fit_is_a_clear_error(write_module: Loader, fault: str) -> None:
    plain, dec = pair(write_module, NET)
    _, model = _trained(plain, dec)
    sd = dict(autostate.state_dict(model))
    if fault == "missing":
        del sd["pair[1].mean"]
    elif fault == "extra":
        sd["pair[2].mean"] = jnp.zeros(2)
    elif fault == "shape":
        sd["total"] = jnp.zeros(3)
    else:
        sd["seen"] = jnp.zeros((), jnp.float32)
    with pytest.raises(StateDictError) as info:
        autostate.load_state_dict(dec.Net(), sd)
    assert_user_line(info.value, "test_fidelity_hunt27.py")
    key = {"missing": "pair[1].mean", "extra": "pair[2].mean", "shape": "total", "dtype": "seen"}
    assert repr(key[fault]) in str(info.value)
    # strict=False: what fits is loaded, the rest keeps the model's values, with a warning
    with pytest.warns(StateDictWarning):
        loaded = autostate.load_state_dict(dec.Net(), sd, strict=False)
    fresh = dec.Net()
    for k, v in autostate.state_dict(loaded).items():
        expect = sd[k] if k != key[fault] else autostate.state_dict(fresh)[k]
        assert_same(expect, v, k)


@pytest.mark.parametrize("fault", ["missing", "extra", "shape"])
def test_param_dict_that_does_not_fit_is_a_clear_error(write_module: Loader, fault: str) -> None:
    plain, dec = pair(write_module, NET)
    pd = dict(autostate.param_dict(dec.Net(2.0)))
    if fault == "missing":
        del pd["bias"]
    elif fault == "extra":
        pd["items[2].w"] = jnp.zeros(2)
    else:
        pd["items[0].w"] = jnp.zeros((2, 1))
    with pytest.raises(StateDictError) as info:
        autostate.load_param_dict(dec.Net(), pd)
    assert_user_line(info.value, "test_fidelity_hunt27.py")


def test_state_dict_after_a_sub_model_was_replaced(write_module: Loader) -> None:
    plain, dec = pair(write_module, NET)
    ref, model = _trained(plain, dec)
    ref.items[0] = plain.Leaf(9.0)
    model.items[0] = dec.Leaf(9.0)
    ref.pair = (ref.pair[0], plain.Leaf(-3.0))
    model.pair = (model.pair[0], dec.Leaf(-3.0))
    ref(X1), model(X1)
    sd, pd = autostate.state_dict(model), autostate.param_dict(model)
    assert_same(np.full(2, 9.0), pd["items[0].w"], "new sub-model's parameter")
    assert_same(np.asarray(1), sd["items[0].count"], "new sub-model's count")
    loaded = autostate.load_state_dict(autostate.load_param_dict(dec.Net(), pd), sd)
    assert_same(snapshot(ref), snapshot(loaded), "loaded after replacing")
    f, states = loaded.functionalize()
    out, states = step_jit()(f, states, X2)
    assert_same(ref(X2), out, "stepped after replacing")
    assert_same(snapshot(ref), snapshot(autostate.freeze(f, states)), "frozen after replacing")


def test_state_dict_of_f_inside_jit(write_module: Loader) -> None:
    plain, dec = pair(write_module, NET)
    ref, model = _trained(plain, dec)
    f, states = model.functionalize()

    @jax.jit
    def step(f: Any, states: Any, x: Any) -> Any:
        _, states = f(states, x)
        return autostate.state_dict(f, states), autostate.param_dict(f)

    sd, pd = step(f, states, X2)
    ref(X2)
    loaded = autostate.load_state_dict(autostate.load_param_dict(dec.Net(), pd), sd)
    assert_same(snapshot(ref), snapshot(loaded), "dicts made inside jit")


def test_save_load_round_trip_then_train(write_module: Loader, tmp_path: Any) -> None:
    plain, dec = pair(write_module, NET)
    ref, model = _trained(plain, dec)
    path = str(tmp_path / "net.npz")
    autostate.save(path, model)
    loaded = autostate.load(path, like=dec.Net(5.0))
    assert_shared(loaded)
    assert_same(snapshot(ref), snapshot(loaded), "loaded from file")
    f, states = loaded.functionalize()
    out, states = step_jit()(f, states, X1)
    assert_same(ref(X1), out, "jit after load")


# ======================================================================================
# functionalize: a sub-model alone, twice, after eager changes
# ======================================================================================


@pytest.mark.parametrize("path", ["items[0]", "items[1]", "by['b']", "pair[1]"])
def test_functionalize_a_sub_model_while_the_parent_exists(write_module: Loader, path: str) -> None:
    plain, dec = pair(write_module, NET)
    ref, model = _trained(plain, dec)
    sub = plain_path(model, path)
    f, states = sub.functionalize()
    assert sorted(states) == ["count", "mean"]
    ref_sub = copy.deepcopy(plain_path(ref, path))  # f is a copy: the parent does not move
    out, states = step_jit()(f, states, X2)
    assert_same(ref_sub(X2), out, "sub-model through f")
    assert_same(snapshot(ref_sub), snapshot(autostate.freeze(f, states)), "frozen sub-model")
    # the parent is untouched and still steps like plain
    assert_same(snapshot(ref), snapshot(model), "parent after the sub-model's f")
    assert_same(ref(X1), model(X1), "parent steps")
    assert_same(snapshot(ref), snapshot(model), "parent stepped")
    # and the parent functionalizes with the sub-model's names under its path
    pf, pstates = model.functionalize()
    out, pstates = pf(pstates, X2)
    assert_same(ref(X2), out, "parent f")
    assert_same(snapshot(ref), snapshot(autostate.freeze(pf, pstates)), "parent frozen")


def test_functionalize_twice_and_use_the_older_pair(write_module: Loader) -> None:
    plain, dec = pair(write_module, NET)
    ref, model = _trained(plain, dec)
    f1, s1 = model.functionalize()
    f2, s2 = model.functionalize()
    step = step_jit()
    ref_a, ref_b = copy.deepcopy(ref), copy.deepcopy(ref)
    out1, s1 = step(f1, s1, X1)
    out2, s2 = step(f2, s2, X2)
    assert_same(ref_a(X1), out1, "older f")
    assert_same(ref_b(X2), out2, "newer f")
    # the pairs are interchangeable: same names, same structure
    out, s_mixed = f1(s2, X1)
    assert_same(ref_b(X1), out, "older f on newer states")
    out, s1 = f2(s1, X2)
    assert_same(ref_a(X2), out, "newer f on older states")
    assert_same(snapshot(ref_a), snapshot(autostate.freeze(f1, s1)), "older frozen")
    assert_same(snapshot(ref_b), snapshot(autostate.freeze(f2, s_mixed)), "newer frozen")
    assert_same(snapshot(ref), snapshot(model), "the model moved")


def test_f_after_the_model_changed_eagerly_is_a_snapshot(write_module: Loader) -> None:
    plain, dec = pair(write_module, NET)
    ref, model = _trained(plain, dec)
    at_functionalize = copy.deepcopy(ref)
    f, states = model.functionalize()
    # eager changes after functionalize: a step, a replaced sub-model, a new parameter
    ref(X2), model(X2)
    ref.items[0] = plain.Leaf(7.0)
    model.items[0] = dec.Leaf(7.0)
    ref.bias = jnp.array([5.0, 5.0])
    model.bias = jnp.array([5.0, 5.0])
    ref.items[1].w = jnp.array([2.0, 3.0])
    model.items[1].w = jnp.array([2.0, 3.0])
    out, states = step_jit()(f, states, X1)
    assert_same(at_functionalize(X1), out, "f sees the model as it was")
    assert_same(snapshot(at_functionalize), snapshot(autostate.freeze(f, states)), "frozen")
    assert_same(ref(X1), model(X1), "the model keeps going eagerly")
    assert_same(snapshot(ref), snapshot(model), "the model")
    f2, s2 = model.functionalize()
    out, s2 = step_jit()(f2, s2, X2)
    assert_same(ref(X2), out, "functionalized again after the changes")


def test_functionalize_after_an_eager_reset_of_a_sub_model(write_module: Loader) -> None:
    plain, dec = pair(write_module, NET)
    ref, model = _trained(plain, dec)
    ref.by["b"].reset()
    model.by["b"].reset()
    f, states = model.functionalize()
    out, states = f(states, X1)
    assert_same(ref(X1), out, "after reset")
    _, states = jax.jit(lambda f, s: f.peek(s))(f, states)
    assert_same(snapshot(ref), snapshot(autostate.freeze(f, states)), "after reset, frozen")


# ======================================================================================
# grad / value_and_grad with hand-written SGD, vmap ensembles, pack
# ======================================================================================


def _set(model: Any, key: str, value: Any) -> None:
    exec("m." + key + " = v", {"m": model, "v": value})  # noqa: S102


def _plain_loss(ref: Any, params: dict[str, Any], x: Any, y: Any) -> tuple[Any, Any]:
    """The plain model's loss with ``params`` injected; its states after, as aux."""
    m = copy.deepcopy(ref)
    for key, value in params.items():
        _set(m, key, value)
    loss = m.loss(x, y)
    return loss, m


def test_grad_sgd_over_params_only_matches_plain(write_module: Loader) -> None:
    plain, dec = pair(write_module, NET)
    ref, model = _trained(plain, dec)
    f, states = model.functionalize()
    keys = list(autostate.param_dict(f))
    lr = 0.1

    @jax.jit
    def train(f: Any, states: Any, x: Any, y: Any) -> Any:
        (loss, states), grads = jax.value_and_grad(
            lambda f: f.loss(states, x, y), has_aux=True)(f)
        return loss, jax.tree_util.tree_map(lambda p, g: p - lr * g, f, grads), states

    params = autostate.param_dict(model)
    for x in (X1, X2, X1):
        g = jax.grad(lambda p, x=x: _plain_loss(ref, p, x, Y)[0])(params)
        want = ref.loss(x, Y)  # the plain model's states move as f's do
        loss, f, states = train(f, states, x, Y)
        assert_same(want, loss, "loss")
        params = {k: params[k] - lr * g[k] for k in keys}
        for k in keys:
            _set(ref, k, params[k])
        assert_same(params, autostate.param_dict(f), "params after sgd")
    frozen = autostate.freeze(f, states)
    assert_shared(frozen)
    assert_same(snapshot(ref), snapshot(frozen), "trained model")
    # grad alone (no aux) through f: the same gradient as plain
    g_f = jax.grad(lambda f: f.loss(states, X2, Y)[0])(f)
    g_plain = jax.grad(lambda p: _plain_loss(ref, p, X2, Y)[0])(params)
    assert_same(g_plain, autostate.param_dict(g_f), "grad")


def test_grad_wrt_params_does_not_differentiate_states(write_module: Loader) -> None:
    plain, dec = pair(write_module, NET)
    _, model = _trained(plain, dec)
    f, states = model.functionalize()
    g_states = jax.grad(
        lambda s: f.loss(s, X1, Y)[0], allow_int=True)(states)
    assert sorted(g_states) == sorted(states)
    ints = [k for k, v in states.items() if not jnp.issubdtype(v.dtype, jnp.floating)]
    assert ints and all(g_states[k].dtype == jax.dtypes.float0 for k in ints)


def test_vmap_over_an_ensemble_of_models(write_module: Loader) -> None:
    plain, dec = pair(write_module, NET)
    scales = (0.5, 1.0, 2.0)
    refs = [plain.Net(s) for s in scales]
    pairs = [dec.Net(s).functionalize() for s in scales]
    fs = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *[p[0] for p in pairs])
    ss = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *[p[1] for p in pairs])
    xs = jnp.stack([X1, X2, -X1])
    step = jax.jit(jax.vmap(lambda f, s, x: f(s, x)))
    for _ in range(2):
        out, ss = step(fs, ss, xs)
        assert_same(np.stack([r(x) for r, x in zip(refs, xs)]), out, "ensemble out")
    for i, r in enumerate(refs):
        member = autostate.freeze(jax.tree_util.tree_map(lambda a, i=i: a[i], fs),
                                  jax.tree_util.tree_map(lambda a, i=i: a[i], ss))
        assert_shared(member)
        assert_same(snapshot(r), snapshot(member), f"member {i}")
    # a shared batch of inputs, states batched; value_and_grad of the mean loss under vmap
    grads = jax.vmap(lambda f, s: jax.grad(lambda f: f.loss(s, X1, Y)[0])(f))(fs, ss)
    for i in range(len(scales)):
        gi = jax.grad(lambda f, i=i: f.loss(jax.tree_util.tree_map(lambda a: a[i], ss), X1, Y)[0])(
            jax.tree_util.tree_map(lambda a, i=i: a[i], fs))
        assert_same(autostate.param_dict(gi),
                    {k: v[i] for k, v in autostate.param_dict(grads).items()}, f"grad {i}")


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


# ======================================================================================
# donation, odd states
# ======================================================================================


def test_donated_states_copy_then_continue(write_module: Loader) -> None:
    plain, dec = pair(write_module, NET)
    ref, model = _trained(plain, dec)
    f, states = model.functionalize()
    states = jax.tree_util.tree_map(jnp.copy, states)  # documented: keep the model's arrays
    step = jax.jit(lambda f, s, x: f(s, x), donate_argnums=1)
    for x in (X1, X2, X1):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "donated buffers were not usable" on some backends
            out, states = step(f, states, x)
        assert_same(ref(x), out, "donated step")
    frozen = autostate.freeze(f, states)
    assert_same(snapshot(ref), snapshot(frozen), "frozen after donation")
    assert_same(ref(X2), frozen(X2), "eager after donation")
    # the model itself still works (its arrays were not donated)
    assert not any(v.is_deleted() for v in autostate.state_dict(model).values())


ODD = """
@DECORATE
class Odd:
    def __init__(self):
        self.w = jnp.array([1.0, -2.0])
        self.gain = 0.5
        self.cache = {"k": None, "v": jnp.zeros(2)}
        self.empty_l = []
        self.empty_d = {}
        self.empty_t = ()
        self.hits = jnp.zeros((), jnp.int32)
        self.flag = jnp.array(False)
        self.bytes = jnp.array([250, 3], jnp.uint8)
        self.small = jnp.array([120, -3], jnp.int8)
        self.nothing = None

    def __call__(self, x):
        self.gain = self.gain * 1.5
        self.cache = {"k": None, "v": self.cache["v"] + x}
        self.empty_l = list(self.empty_l)
        self.empty_d = dict(self.empty_d)
        self.empty_t = tuple(self.empty_t)
        self.hits += 1
        self.flag = ~self.flag
        self.bytes = self.bytes + jnp.uint8(4)
        self.small = self.small + jnp.int8(5)
        self.nothing = None
        return x * self.w * self.gain + jnp.where(self.flag, 1.0, 0.0)

    def peek(self):
        return self.cache["v"] * self.gain + self.hits
"""


def test_odd_states_plain_vs_decorated(write_module: Loader) -> None:
    plain, dec = pair(write_module, ODD)
    check(plain, dec, "Odd()", [("__call__", (X1,)), ("peek", ()), ("__call__", (X2,)),
                                ("__call__", (X1,))])


def test_odd_states_life_cycle(write_module: Loader) -> None:
    plain, dec = _pair(write_module, ODD)
    ref, model = plain.Odd(), dec.Odd()
    f, states = model.functionalize()
    assert states["nothing"] is None  # None is a placeholder state (tests/test_static_state.py)
    step = step_jit()
    for x in (X1, X2):
        out, states = step(f, states, x)
        assert_same(ref(x), out, "jit")
    states = jax.tree_util.tree_map(lambda a: a, states)
    frozen = autostate.freeze(f, states)
    assert_same(snapshot(ref), snapshot(frozen), "frozen")
    again = pickle.loads(pickle.dumps(copy.deepcopy(frozen)))
    assert_same(ref(X1), again(X1), "eager after pickle")
    assert_same(snapshot(ref), snapshot(again), "after pickle")
    assert again.nothing is None and again.empty_l == [] and again.cache["k"] is None


def test_odd_states_ensemble_vmap(write_module: Loader) -> None:
    plain, dec = pair(write_module, ODD)
    refs = [plain.Odd() for _ in range(3)]
    f, states = dec.Odd().functionalize()
    ss = jax.tree_util.tree_map(lambda a: jnp.stack([jnp.asarray(a)] * 3), states)
    xs = jnp.stack([X1, X2, -X1])
    out, ss = jax.jit(jax.vmap(lambda s, x: f(s, x)))(ss, xs)
    assert_same(np.stack([r(x) for r, x in zip(refs, xs)]), out, "vmap")
    for i, r in enumerate(refs):
        member = autostate.freeze(f, jax.tree_util.tree_map(lambda a, i=i: a[i], ss))
        assert_same(snapshot(r), snapshot(member), f"member {i}")


def test_odd_states_state_dict_round_trip_of_an_eager_model(write_module: Loader) -> None:
    plain, dec = pair(write_module, ODD)
    ref, model = plain.Odd(), dec.Odd()
    ref(X1), model(X1)
    sd = autostate.state_dict(model)
    assert not any(k.startswith(("empty", "nothing")) for k in sd)
    loaded = autostate.load_state_dict(dec.Odd(), sd)
    assert_same(snapshot(ref), snapshot(loaded), "loaded")
    assert_same(ref(X2), loaded(X2), "stepped")


def test_python_float_state_state_dict_after_jit_loads_into_a_fresh_model(
        write_module: Loader) -> None:
    plain, dec = pair(write_module, ODD)
    ref = plain.Odd()
    f, states = dec.Odd().functionalize()
    out, states = step_jit()(f, states, X1)
    ref(X1)
    sd = autostate.state_dict(autostate.freeze(f, states))
    loaded = autostate.load_state_dict(dec.Odd(), sd)
    assert_same(snapshot(ref), snapshot(loaded), "loaded")


def test_python_float_state_state_dict_eager_loads_into_a_jit_trained_model(
        write_module: Loader) -> None:
    plain, dec = pair(write_module, ODD)
    ref, eager = plain.Odd(), dec.Odd()
    for x in (X1, X2):
        ref(x), eager(x)
    f, states = dec.Odd().functionalize()
    _, states = step_jit()(f, states, X1)
    loaded = autostate.load_state_dict(autostate.freeze(f, states), autostate.state_dict(eager))
    assert_same(snapshot(ref), snapshot(loaded), "loaded")


def test_state_dict_of_f_with_a_missing_state_is_an_error(write_module: Loader) -> None:
    plain, dec = pair(write_module, NET)
    f, states = dec.Net().functionalize()
    partial = {k: v for k, v in states.items() if k != "total"}
    with pytest.raises(autostate.AutostateError):
        autostate.freeze(f, partial)
    with pytest.raises(autostate.AutostateError):
        autostate.state_dict(f, partial)


def test_states_missing_or_extra_keys_in_f_are_clear_errors(write_module: Loader) -> None:
    plain, dec = pair(write_module, NET)
    f, states = dec.Net().functionalize()
    partial = {k: v for k, v in states.items() if k != "total"}
    for bad in (partial, {**states, "totl": jnp.zeros(2)}):
        for call in (lambda s: f(s, X1), lambda s: step_jit()(f, s, X1),
                     lambda s: autostate.freeze(f, s)):
            with pytest.raises(autostate.AutostateError) as info:
                call(bad)
            assert "total" in str(info.value) or "totl" in str(info.value)


def test_python_int_state_through_f_is_the_documented_error(write_module: Loader) -> None:
    _, dec = pair(write_module, """
@DECORATE
class Steps:
    def __init__(self):
        self.n = 0
        self.w = jnp.ones(2)

    def __call__(self, x):
        self.n += 1
        return x * self.w * self.n
""")
    model = dec.Steps()
    assert_same(np.ones(2), model(jnp.ones(2)), "eager")
    assert model.n == 1
    f, states = model.functionalize()
    assert dict(states) == {}
    with pytest.raises(autostate.errors.StaticStateError) as info:
        step_jit()(f, states, jnp.ones(2))
    assert_user_line(info.value, Path(dec.__file__).name)


# ======================================================================================
# A sub-model shared by two parents; f inside lax.scan and jax.checkpoint
# ======================================================================================

TWO_PARENTS = """
@DECORATE
class Norm:
    def __init__(self):
        self.scale = jnp.array([1.0, 0.5])
        self.mean = jnp.zeros(2)
        self.n = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.n += 1
        self.mean = self.mean + (x - self.mean) / self.n
        return (x - self.mean) * self.scale


@DECORATE
class Block:
    def __init__(self, norm, w):
        self.norm = norm
        self.w = jnp.full((2,), w)
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.calls += 1
        return jnp.tanh(self.norm(x) * self.w)


@DECORATE
class Root:
    def __init__(self):
        norm = Norm()
        self.enc = Block(norm, 1.5)
        self.dec = Block(norm, -0.5)

    def __call__(self, x):
        return self.dec(self.enc(x))

    def loss(self, x, y):
        return ((self(x) - y) ** 2).sum()
"""


def test_shared_by_two_parents_life_cycle(write_module: Loader) -> None:
    plain, dec = _pair(write_module, TWO_PARENTS)
    ref, model = plain.Root(), dec.Root()
    f, states = model.functionalize()
    assert sorted(states) == ["dec.calls", "enc.calls", "enc.norm.mean", "enc.norm.n"]
    for x in (X1, X2):
        out, states = step_jit()(f, states, x)
        assert_same(ref(x), out, "jit")
    frozen = autostate.freeze(f, states)
    assert frozen.enc.norm is frozen.dec.norm
    assert_same(ref(X1), frozen(X1), "eager")
    back = pickle.loads(pickle.dumps(frozen))
    assert back.enc.norm is back.dec.norm
    copied = copy.deepcopy(back)
    assert copied.enc.norm is copied.dec.norm and copied.enc.norm is not back.enc.norm
    assert_same(ref(X2), copied(X2), "eager after pickle and deepcopy")
    assert_same(snapshot(ref), snapshot(copied), "after pickle and deepcopy")
    loaded = autostate.load_state_dict(
        autostate.load_param_dict(dec.Root(), autostate.param_dict(copied)),
        autostate.state_dict(copied))
    assert loaded.enc.norm is loaded.dec.norm
    assert_same(snapshot(ref), snapshot(loaded), "loaded")
    # the shared sub-model alone
    nf, ns = loaded.dec.norm.functionalize()
    ref_norm = copy.deepcopy(ref.dec.norm)
    out, ns = nf(ns, X1)
    assert_same(ref_norm(X1), out, "shared sub-model alone")
    assert_same(snapshot(ref), snapshot(loaded), "parent untouched")


def test_shared_by_two_parents_grad_one_summed_gradient(write_module: Loader) -> None:
    plain, dec = pair(write_module, TWO_PARENTS)
    ref = plain.Root()
    f, states = dec.Root().functionalize()
    assert "dec.norm.scale" not in autostate.param_dict(f)
    g = jax.grad(lambda f: f.loss(states, X1, Y)[0])(f)
    g_plain = jax.grad(lambda p: _plain_loss(ref, p, X1, Y)[0])(autostate.param_dict(f))
    assert_same(g_plain, autostate.param_dict(g), "grad")


def test_training_loop_in_lax_scan_over_f(write_module: Loader) -> None:
    plain, dec = pair(write_module, TWO_PARENTS)
    ref = plain.Root()
    f, states = dec.Root().functionalize()
    xs = jnp.stack([X1, X2, -X1, X2 * 0.5])
    lr = 0.2

    def body(carry: Any, x: Any) -> Any:
        f, s = carry
        (loss, s), g = jax.value_and_grad(lambda f: f.loss(s, x, Y), has_aux=True)(f)
        return (jax.tree_util.tree_map(lambda p, g: p - lr * g, f, g), s), loss

    (f, states), losses = jax.jit(lambda c, xs: jax.lax.scan(body, c, xs))((f, states), xs)
    keys = list(autostate.param_dict(f))
    params = {k: plain_path(ref, k) for k in keys}
    want = []
    for x in xs:
        g = jax.grad(lambda p, x=x: _plain_loss(ref, p, x, Y)[0])(params)
        want.append(ref.loss(x, Y))
        params = {k: params[k] - lr * g[k] for k in keys}
        for k in keys:
            _set(ref, k, params[k])
    assert_same(np.stack(want), losses, "losses")
    assert_same(snapshot(ref), snapshot(autostate.freeze(f, states)), "trained in scan")


def test_f_under_jax_checkpoint_and_grad(write_module: Loader) -> None:
    plain, dec = pair(write_module, TWO_PARENTS)
    ref = plain.Root()
    f, states = dec.Root().functionalize()
    g_ck = jax.jit(jax.grad(lambda f: jax.checkpoint(lambda f, s: f.loss(s, X1, Y))(f, states)[0]))(f)
    g_plain = jax.grad(lambda p: _plain_loss(ref, p, X1, Y)[0])(autostate.param_dict(f))
    assert_same(g_plain, autostate.param_dict(g_ck), "checkpointed grad")
    _, s_ck = jax.checkpoint(lambda f, s: f.loss(s, X1, Y))(f, states)
    ref.loss(X1, Y)
    assert_same(snapshot(ref), snapshot(autostate.freeze(f, s_ck)), "checkpointed states")
