"""Differential bug hunt 26: stateful idioms from real model code.

- Data-dependent init: ActNorm with a Python-bool ``initialized`` flipped in
  the first forward (eagerly, then ``functionalize``; through ``f`` the
  documented ``StaticStateError``), stacked in a list; an array-flag
  version with ``jnp.where``; spectral-norm power iteration updating a ``u``
  vector state on every training forward (a Python loop and
  ``lax.fori_loop`` over a bound method); weight norm recomputed from
  ``g`` / ``v`` into a ``weight`` state every forward (``grad`` flows to
  ``g`` / ``v``).
- Running statistics with momentum skipped in eval mode through a Python-bool
  ``training`` toggled by PyTorch-style ``train()`` / ``eval()`` returning
  ``self``, propagated from a parent to sub-modules in a list and a dict.
- A GRU cell whose hidden state lives on ``self`` between calls, reset by a
  method, stepped in ``lax.scan`` over a bound method and over a closure,
  truncated BPTT with ``stop_gradient`` under ``jax.grad``, an
  encoder/decoder handing the hidden state over.
- A KV cache with an integer position (``.at[].set`` and
  ``lax.dynamic_update_slice``), a decode loop in ``lax.fori_loop`` inside a
  method; an EMA teacher updated from a student sub-model.
- An optimizer holding a step count and moments as state and updating the
  parameters of a model passed to its method as an argument.
- RNG: a key state split on every call, dropout, under ``jit``, ``vmap`` and
  inside ``lax.scan`` / ``lax.while_loop``, ``lax.cond`` with a batched
  predicate under ``vmap``.
- A PyTorch-style undecorated ``Module`` base finding children through
  ``vars(self)`` (``train`` / ``eval`` / ``apply`` / ``modules``), a teacher
  made by ``copy.deepcopy``; a model returned from ``f`` (``train()``
  returning ``self``).
- A helper updating a sub-model's list state in place (``model.params[i] =
  ...``) in a Python loop and inside ``lax.scan`` (found not threaded inside
  ``lax``; fixed, its family in ``test_lax_in_place_state.py``).
- A Python-float state read by ``if`` under ``jit``: a ``TracedValueError``
  (also JAX's ``TracerBoolConversionError``) naming the state and the line.

Each source is written plain and decorated (``differential.pair``); a case
that shows a mismatch stays, marked ``xfail(strict=True)`` with what differs.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from differential import (  # noqa: I001 - tests/ is on sys.path
    X,
    assert_same,
    assert_user_line,
    check,
    check_transform,
    pair,
    plain_path,
    snapshot,
)

import autostate

Loader = Callable[..., types.ModuleType]


def run_f(dec: types.ModuleType, build: str, calls: list[tuple[str, tuple[Any, ...]]],
          jit: bool) -> tuple[list[Any], dict[str, Any], Any]:
    model = eval(build, vars(dec))  # noqa: S307
    f, states = model.functionalize()
    outs = []
    for m, a in calls:
        fn = (lambda f, s, *a, m=m: (f if m == "__call__" else getattr(f, m))(s, *a))  # noqa: E731
        if jit:
            fn = jax.jit(fn)
        out, states = fn(f, states, *a)
        outs.append(out)
    return outs, states, f


def _file(mod: types.ModuleType) -> str:
    return mod.__file__.rsplit("/", 1)[-1]


# ======================================================================================
# 1. Data-dependent init, spectral norm, weight norm
# ======================================================================================

NORMS = """
@DECORATE
class ActNorm:
    def __init__(self, d):
        self.logs = jnp.zeros(d)
        self.bias = jnp.zeros(d)
        self.initialized = False

    def initialize(self, x):
        self.bias = -x.mean(0)
        self.logs = -jnp.log(x.std(0) + 1e-6)
        self.initialized = True

    def __call__(self, x):
        if not self.initialized:
            self.initialize(x)
        y = (x + self.bias) * jnp.exp(self.logs)
        return y, jnp.sum(self.logs) * x.shape[0]


@DECORATE
class ActNormArr:
    def __init__(self, d):
        self.logs = jnp.zeros(d)
        self.bias = jnp.zeros(d)
        self.initialized = jnp.zeros((), bool)

    def __call__(self, x):
        first = ~self.initialized
        self.bias = jnp.where(first, -x.mean(0), self.bias)
        self.logs = jnp.where(first, -jnp.log(x.std(0) + 1e-6), self.logs)
        self.initialized = self.initialized | True
        return (x + self.bias) * jnp.exp(self.logs)


@DECORATE
class Glow:
    def __init__(self, d, n):
        self.norms = [ActNorm(d) for _ in range(n)]
        self.w = jnp.eye(d) * 0.7 + 0.05

    def __call__(self, x):
        logdet = 0.0
        for n in self.norms:
            x, ld = n(x)
            logdet = logdet + ld
            x = x @ self.w
        return x, logdet


@DECORATE
class SpectralNorm:
    def __init__(self, seed, din, dout, n_power=1, loop=False):
        k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
        self.w = jax.random.normal(k1, (dout, din))
        u = jax.random.normal(k2, (dout,))
        self.u = u / jnp.linalg.norm(u)
        self.n_power = n_power
        self.loop = loop
        self.training = True

    def train(self, mode=True):
        self.training = mode
        return self

    def eval(self):
        return self.train(False)

    def _power_step(self, i, v):
        v = self.w.T @ self.u
        v = v / jnp.linalg.norm(v)
        u = self.w @ v
        self.u = u / jnp.linalg.norm(u)
        return v

    def weight(self):
        if self.training:
            if self.loop:
                v = lax.fori_loop(0, self.n_power, self._power_step, jnp.zeros(self.w.shape[1]))
            else:
                for i in range(self.n_power):
                    v = self._power_step(i, None)
            self.u = jax.lax.stop_gradient(self.u)
        else:
            v = self.w.T @ self.u
            v = v / jnp.linalg.norm(v)
        sigma = self.u @ self.w @ v
        return self.w / sigma

    def __call__(self, x):
        return x @ self.weight().T


@DECORATE
class WeightNorm:
    def __init__(self, seed, din, dout):
        self.v = jax.random.normal(jax.random.PRNGKey(seed), (dout, din))
        self.g = jnp.linalg.norm(self.v, axis=1) * 0.5
        self.weight = self.g[:, None] * self.v / jnp.linalg.norm(self.v, axis=1, keepdims=True)

    def _recompute(self):
        self.weight = self.g[:, None] * self.v / jnp.linalg.norm(self.v, axis=1, keepdims=True)

    def __call__(self, x):
        self._recompute()
        return jnp.tanh(x @ self.weight.T)
"""

XA = jnp.array([[1.0, 2.0, 0.0], [3.0, -2.0, 1.0], [2.0, 0.0, 5.0], [0.5, 1.0, -1.0]])


def test_actnorm_python_flag_first_forward_eager(write_module: Loader) -> None:
    plain, dec = pair(write_module, NORMS)
    calls = [("__call__", (XA,)), ("__call__", (XA * 2 + 1,)), ("__call__", (XA,))]
    check(plain, dec, "ActNorm(3)", calls, modes=("eager",))
    check(plain, dec, "Glow(3, 2)", calls, modes=("eager",))


@pytest.mark.parametrize("build", ["ActNorm(3)", "Glow(3, 2)"])
def test_actnorm_python_flag_initialised_eagerly_then_f_jit_grad(write_module: Loader,
                                                                 build: str) -> None:
    plain, dec = pair(write_module, NORMS)
    ref, model = eval(build, vars(plain)), eval(build, vars(dec))  # noqa: S307
    assert_same(ref(XA), model(XA), "init call")
    f, states = model.functionalize()
    assert "initialized" not in " ".join(states)  # a static state: part of f's structure
    call = jax.jit(lambda f, s, x: f(s, x))
    for x in (XA * 2, XA - 1):
        out, states = call(f, states, x)
        assert_same(ref(x), out, "jit outputs")
    assert_same(snapshot(ref), snapshot(autostate.freeze(f, states)), "frozen")
    # grad through the initialised flow wrt its input
    g_ref = jax.grad(lambda x: sum(jnp.sum(v) for v in jax.tree_util.tree_leaves(ref(x))))(XA)
    g = jax.grad(lambda x: sum(jnp.sum(v) for v in
                               jax.tree_util.tree_leaves(f(states, x)[0])))(XA)
    assert_same(g_ref, g, "grad")


@pytest.mark.parametrize("jit", [False, True])
def test_actnorm_python_flag_uninitialised_through_f_is_documented_error(
        write_module: Loader, jit: bool) -> None:
    _, dec = pair(write_module, NORMS)
    f, states = dec.Glow(3, 2).functionalize()
    call = (lambda f, s, x: f(s, x))  # noqa: E731
    with pytest.raises(autostate.errors.StaticStateError) as err:
        (jax.jit(call) if jit else call)(f, states, XA)
    assert "initialized" in str(err.value)
    assert_user_line(err.value, _file(dec))


def test_actnorm_array_flag(write_module: Loader) -> None:
    plain, dec = pair(write_module, NORMS)
    calls = [("__call__", (XA,)), ("__call__", (XA * 2 + 1,)), ("__call__", (XA,))]
    check(plain, dec, "ActNormArr(3)", calls)
    check_transform(plain, dec, "ActNormArr(3)", [("__call__", (X,)), ("__call__", (XA,))], XA,
                    "grad")


@pytest.mark.parametrize("build", ["SpectralNorm(0, 3, 4)", "SpectralNorm(0, 3, 4, n_power=3)",
                                   "SpectralNorm(0, 3, 4, n_power=2, loop=True)"])
def test_spectral_norm_power_iteration_updates_u(write_module: Loader, build: str) -> None:
    plain, dec = pair(write_module, NORMS)
    calls = [("__call__", (XA,)), ("__call__", (XA * 2,)), ("__call__", (XA,)),
             ("weight", ())]
    check(plain, dec, build, calls)
    if "loop" in build:
        check_transform(plain, dec, build, [("__call__", (X,)), ("__call__", (X,))], XA, "grad")


def test_spectral_norm_eval_mode_freezes_u(write_module: Loader) -> None:
    plain, dec = pair(write_module, NORMS)
    build = "SpectralNorm(1, 3, 4, n_power=2, loop=True)"
    ref, model = eval(build, vars(plain)), eval(build, vars(dec))  # noqa: S307
    for m in (ref, model):
        m(XA)
        assert m.eval() is m
    f, states = model.functionalize()
    out, states2 = jax.jit(lambda f, s, x: f(s, x))(f, states, XA)
    assert_same(ref(XA), out, "eval output")
    assert_same(np.asarray(ref.u), np.asarray(states2["u"]), "u unchanged in eval")
    model.train()
    ref.train()
    f, states = model.functionalize()
    out, states = jax.jit(lambda f, s, x: f(s, x))(f, states, XA)
    assert_same(ref(XA), out, "train output")
    assert_same(np.asarray(ref.u), np.asarray(states["u"]), "u after train")


def test_weight_norm_recomputed_state(write_module: Loader) -> None:
    plain, dec = pair(write_module, NORMS)
    check(plain, dec, "WeightNorm(0, 3, 2)", [("__call__", (XA,)), ("__call__", (XA * 2,))])
    check_transform(plain, dec, "WeightNorm(0, 3, 2)", [("__call__", (X,))], XA, "grad")


@pytest.mark.parametrize("jit", [False, True])
def test_weight_norm_grad_reaches_g_and_v(write_module: Loader, jit: bool) -> None:
    plain, dec = pair(write_module, NORMS)
    ref = plain.WeightNorm(0, 3, 2)

    def ref_loss(g: Any, v: Any) -> Any:
        w = g[:, None] * v / jnp.linalg.norm(v, axis=1, keepdims=True)
        return jnp.tanh(XA @ w.T).sum()

    gg, gv = jax.grad(ref_loss, argnums=(0, 1))(ref.g, ref.v)
    f, states = dec.WeightNorm(0, 3, 2).functionalize()
    grad = jax.grad(lambda f, s: f(s, XA)[0].sum())
    gf = (jax.jit(grad) if jit else grad)(f, states)
    params = autostate.param_dict(gf)
    assert sorted(params) == ["g", "v"]
    assert_same(np.asarray(gg), np.asarray(params["g"]), "dg")
    assert_same(np.asarray(gv), np.asarray(params["v"]), "dv")


# ======================================================================================
# 2. Running statistics and train()/eval()
# ======================================================================================

BN = """
@DECORATE
class BatchNorm:
    def __init__(self, d, momentum=0.1):
        self.gamma = jnp.ones(d)
        self.beta = jnp.zeros(d)
        self.running_mean = jnp.zeros(d)
        self.running_var = jnp.ones(d)
        self.num_batches_tracked = jnp.zeros((), jnp.int32)
        self.momentum = momentum
        self.training = True

    def train(self, mode=True):
        self.training = mode
        return self

    def eval(self):
        return self.train(False)

    def __call__(self, x):
        if self.training:
            mean, var = x.mean(0), x.var(0)
            n = x.shape[0]
            self.running_mean = (1 - self.momentum) * self.running_mean + self.momentum * mean
            self.running_var = ((1 - self.momentum) * self.running_var
                                + self.momentum * var * n / (n - 1))
            self.num_batches_tracked += 1
        else:
            mean, var = self.running_mean, self.running_var
        return (x - mean) / jnp.sqrt(var + 1e-5) * self.gamma + self.beta


@DECORATE
class Dropout:
    def __init__(self, seed, p=0.5):
        self.key = jax.random.PRNGKey(seed)
        self.p = p
        self.training = True

    def train(self, mode=True):
        self.training = mode
        return self

    def eval(self):
        return self.train(False)

    def __call__(self, x):
        if not self.training:
            return x
        self.key, sub = jax.random.split(self.key)
        keep = jax.random.bernoulli(sub, 1 - self.p, x.shape)
        return jnp.where(keep, x / (1 - self.p), 0.0)


@DECORATE
class Net:
    def __init__(self, d):
        self.training = True
        self.layers = [BatchNorm(d), Dropout(1), BatchNorm(d, momentum=0.3)]
        self.heads = {"a": BatchNorm(d), "b": Dropout(2, p=0.25)}
        self.w = jnp.eye(d) + 0.1

    def train(self, mode=True):
        self.training = mode
        for m in self.layers:
            m.train(mode)
        for m in self.heads.values():
            m.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x) @ self.w
        return {k: h(x) for k, h in self.heads.items()}

    def evaluate(self, x):
        was = self.training
        self.eval()
        out = self(x)
        self.train(was)
        return out
"""

XB = jnp.array([[1.0, 2.0, 0.0], [3.0, -2.0, 1.0], [2.0, 0.0, 5.0], [0.5, 1.0, -1.0]])


def test_batchnorm_running_stats_train_mode(write_module: Loader) -> None:
    plain, dec = pair(write_module, BN)
    calls = [("__call__", (XB,)), ("__call__", (XB * 2 - 1,)), ("__call__", (XB,))]
    check(plain, dec, "BatchNorm(3)", calls)
    check_transform(plain, dec, "BatchNorm(3)", [("__call__", (X,)), ("__call__", (X,))], XB,
                    "grad")


def test_eval_returns_self_and_propagates_to_list_and_dict(write_module: Loader) -> None:
    plain, dec = pair(write_module, BN)
    ref, model = plain.Net(3), dec.Net(3)
    for m in (ref, model):
        m(XB)
        assert m.eval() is m
    assert_same(snapshot(ref), snapshot(model), "after eval()")
    assert model.layers[0].training is False and model.heads["a"].training is False
    assert model.heads["b"].training is False and model.layers[1].training is False
    f, states = model.functionalize()
    call = jax.jit(lambda f, s, x: f(s, x))
    for x in (XB * 2, XB - 3):
        out, states2 = call(f, states, x)
        assert_same(ref(x), out, "eval outputs")
        assert_same(snapshot({k: plain_path(ref, k) for k in states}), snapshot(states2),
                    "eval leaves states unchanged")
        states = states2
    model.train()
    ref.train()
    f, states = model.functionalize()
    for x in (XB * 2, XB - 3):
        out, states = call(f, states, x)
        assert_same(ref(x), out, "train outputs")
    for k, v in states.items():
        assert_same(snapshot(plain_path(ref, k)), snapshot(v), k)


def test_net_train_mode_through_check(write_module: Loader) -> None:
    plain, dec = pair(write_module, BN)
    calls = [("__call__", (XB,)), ("__call__", (XB * 2,))]
    check(plain, dec, "Net(3).eval()", calls)


def test_evaluate_toggling_mode_eager_like_plain(write_module: Loader) -> None:
    plain, dec = pair(write_module, BN)
    calls = [("__call__", (XB,)), ("evaluate", (XB * 2,)), ("__call__", (XB,))]
    check(plain, dec, "Net(3)", calls, modes=("eager",))


@pytest.mark.parametrize("jit", [False, True])
def test_evaluate_toggling_mode_through_f_is_documented_error(write_module: Loader,
                                                              jit: bool) -> None:
    _, dec = pair(write_module, BN)
    f, states = dec.Net(3).functionalize()
    call = (lambda f, s, x: f.evaluate(s, x))  # noqa: E731
    with pytest.raises(autostate.errors.StaticStateError) as err:
        (jax.jit(call) if jit else call)(f, states, XB)
    assert "training" in str(err.value)
    assert_user_line(err.value, _file(dec))


@pytest.mark.parametrize("jit", [False, True])
def test_f_eval_on_train_model_is_documented_error(write_module: Loader, jit: bool) -> None:
    _, dec = pair(write_module, BN)
    f, states = dec.Net(3).functionalize()
    call = (lambda f, s: f.eval(s)[1])  # noqa: E731
    with pytest.raises(autostate.errors.StaticStateError) as err:
        (jax.jit(call) if jit else call)(f, states)
    assert_user_line(err.value, _file(dec))


def test_f_train_on_train_model_keeps_states(write_module: Loader) -> None:
    # assigning the value a static state already holds is no change: the states come back
    _, dec = pair(write_module, BN)
    f, states = dec.Net(3).functionalize()
    new = jax.jit(lambda f, s: f.train(s)[1])(f, states)
    assert sorted(new) == sorted(states)
    for k in states:
        assert_same(snapshot(states[k]), snapshot(new[k]), k)


# ======================================================================================
# 3. A GRU cell with its hidden state on self
# ======================================================================================

RNN = """
@DECORATE
class GRUCell:
    def __init__(self, seed, din, dh, chunk=2):
        ks = jax.random.split(jax.random.PRNGKey(seed), 3)
        self.chunk = chunk
        self.wz = jax.random.normal(ks[0], (din + dh, dh)) * 0.4
        self.wr = jax.random.normal(ks[1], (din + dh, dh)) * 0.4
        self.wh = jax.random.normal(ks[2], (din + dh, dh)) * 0.4
        self.dh = dh
        self.h = jnp.zeros(dh)
        self.steps = jnp.zeros((), jnp.int32)

    def reset(self):
        self.h = jnp.zeros(self.dh)

    def step(self, x):
        hx = jnp.concatenate([x, self.h])
        z = jax.nn.sigmoid(hx @ self.wz)
        r = jax.nn.sigmoid(hx @ self.wr)
        hh = jnp.tanh(jnp.concatenate([x, r * self.h]) @ self.wh)
        self.h = (1 - z) * self.h + z * hh
        self.steps += 1
        return self.h

    def _body(self, carry, x):
        h = self.step(x)
        return carry + h.sum(), h

    def run_bound(self, xs):
        total, hs = lax.scan(self._body, 0.0, xs)
        return total, hs

    def run_closure(self, xs, scale):
        def body(carry, x):
            h = self.step(x * scale)
            return carry + 1, h * carry

        n, hs = lax.scan(body, jnp.zeros((), jnp.int32), xs)
        return n, hs

    def cell(self, h, x):
        self.h = h
        return self.step(x), self.h.sum()

    def run_carry(self, xs):
        return lax.scan(self.cell, self.h, xs)

    def run_remat(self, xs):
        return lax.scan(checkpoint(self._body), 0.0, xs)

    def run_step_direct(self, xs):
        def body(c, x):
            return c, self.step(x)
        return lax.scan(body, None, xs)[1]

    def tbptt(self, xs):
        loss = 0.0
        chunk = self.chunk
        for i in range(0, xs.shape[0], chunk):
            self.h = jax.lax.stop_gradient(self.h)
            _, hs = lax.scan(self._body, 0.0, xs[i:i + chunk])
            loss = loss + (hs ** 2).sum()
        return loss


@DECORATE
class Seq2:
    def __init__(self, seed, din, dh):
        self.enc = GRUCell(seed, din, dh)
        self.dec = GRUCell(seed + 1, dh, dh)

    def __call__(self, xs):
        self.enc.reset()
        self.dec.reset()
        hs = self.enc.run_step_direct(xs)
        self.dec.h = self.enc.h
        outs = lax.scan(lambda c, h: (c, self.dec.step(h)), None, hs)[1]
        return outs.sum(0)
"""

XS = jnp.array([[0.5, -1.0], [1.0, 0.3], [-0.2, 0.8], [0.0, 1.5], [0.7, -0.4], [1.1, 0.2]])


@pytest.mark.parametrize("method", ["run_bound", "run_step_direct"])
def test_gru_hidden_state_across_calls_scan_bound(write_module: Loader, method: str) -> None:
    plain, dec = pair(write_module, RNN)
    calls = [(method, (XS[:3],)), ("step", (XS[3],)), (method, (XS[3:],)), ("reset", ()),
             (method, (XS[:2],))]
    check(plain, dec, "GRUCell(0, 2, 3)", calls)


@pytest.mark.parametrize("method", ["run_carry", "run_remat"])
def test_gru_scan_carry_bound_method_and_checkpoint(write_module: Loader, method: str) -> None:
    plain, dec = pair(write_module, RNN)
    check(plain, dec, "GRUCell(3, 2, 3)", [(method, (XS[:4],)), ("step", (XS[4],)),
                                            (method, (XS,))])
    if method == "run_remat":
        check_transform(plain, dec, "GRUCell(3, 2, 3)", [(method, (X,))], XS, "grad")


def test_gru_step_scanned_from_outside_over_f(write_module: Loader) -> None:
    plain, dec = pair(write_module, RNN)
    ref = plain.GRUCell(0, 2, 3)
    expected = [ref.step(x) for x in XS]
    f, states = dec.GRUCell(0, 2, 3).functionalize()
    body = jax.checkpoint(lambda s, x: f.step(s, x)[::-1])
    new, hs = jax.jit(lambda s: jax.lax.scan(body, s, XS))(states)
    assert_same(expected, list(hs), "hs")
    assert_same(np.asarray(ref.h), np.asarray(new["h"]), "h")
    assert int(new["steps"]) == len(XS)

    def ref_loss(wz: Any) -> Any:
        m = plain.GRUCell(0, 2, 3)
        m.wz = wz
        return sum(m.step(x).sum() for x in XS)

    g = jax.grad(lambda f: jax.lax.scan(lambda s, x: f.step(s, x)[::-1], states, XS)[1].sum())(f)
    assert_same(np.asarray(jax.grad(ref_loss)(ref.wz)), np.asarray(autostate.param_dict(g)["wz"]))


def test_gru_scan_closure(write_module: Loader) -> None:
    plain, dec = pair(write_module, RNN)
    calls = [("run_closure", (XS, 0.5)), ("run_closure", (XS[:2], 2.0)), ("reset", ()),
             ("run_closure", (XS[1:], 1.0))]
    check(plain, dec, "GRUCell(1, 2, 3)", calls)


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_gru_scan_transforms(write_module: Loader, transform: str) -> None:
    plain, dec = pair(write_module, RNN)
    calls = [("run_bound", (X,)), ("run_closure", (X, 0.5))]
    x = XS if transform == "grad" else jnp.stack([XS, XS * -1, XS + 1])
    check_transform(plain, dec, "GRUCell(0, 2, 3)", calls, x, transform)


def test_gru_truncated_bptt(write_module: Loader) -> None:
    plain, dec = pair(write_module, RNN)
    check(plain, dec, "GRUCell(2, 2, 3, chunk=4)",
          [("tbptt", (XS,)), ("step", (XS[0],)), ("tbptt", (XS * 2,))])
    check_transform(plain, dec, "GRUCell(2, 2, 3)", [("tbptt", (X,)), ("tbptt", (X,))], XS,
                    "grad")


@pytest.mark.parametrize("jit", [False, True])
def test_gru_tbptt_param_grad_matches_plain(write_module: Loader, jit: bool) -> None:
    plain, dec = pair(write_module, RNN)
    ref = plain.GRUCell(2, 2, 3)
    ref.step(XS[0])  # a hidden state carried in from an earlier call

    def ref_loss(wz: Any, wr: Any, wh: Any) -> Any:
        m = plain.GRUCell(2, 2, 3)
        m.h, m.wz, m.wr, m.wh = ref.h, wz, wr, wh
        return m.tbptt(XS)

    expected = jax.grad(ref_loss, argnums=(0, 1, 2))(ref.wz, ref.wr, ref.wh)
    model = dec.GRUCell(2, 2, 3)
    model.step(XS[0])
    f, states = model.functionalize()
    grad = jax.grad(lambda f, s: f.tbptt(s, XS)[0])
    g = autostate.param_dict((jax.jit(grad) if jit else grad)(f, states))
    for name, e in zip(("wz", "wr", "wh"), expected):
        assert_same(np.asarray(e), np.asarray(g[name]), name)


def test_encoder_decoder_hidden_handover(write_module: Loader) -> None:
    plain, dec = pair(write_module, RNN)
    check(plain, dec, "Seq2(0, 2, 3)", [("__call__", (XS,)), ("__call__", (XS[::-1],))],
          modes=("eager", "jit"))


# ======================================================================================
# 4. A KV cache decoded in lax.fori_loop
# ======================================================================================

KV = """
@DECORATE
class KVCache:
    def __init__(self, max_len, d, use_dus=False):
        self.k = jnp.zeros((max_len, d))
        self.v = jnp.zeros((max_len, d))
        self.pos = jnp.zeros((), jnp.int32)
        self.use_dus = use_dus

    def reset(self):
        self.k = jnp.zeros_like(self.k)
        self.v = jnp.zeros_like(self.v)
        self.pos = jnp.zeros((), jnp.int32)

    def append(self, k, v):
        if self.use_dus:
            self.k = jax.lax.dynamic_update_slice(self.k, k[None], (self.pos, 0))
            self.v = jax.lax.dynamic_update_slice(self.v, v[None], (self.pos, 0))
        else:
            self.k = self.k.at[self.pos].set(k)
            self.v = self.v.at[self.pos].set(v)
        self.pos = self.pos + 1

    def attend(self, q):
        mask = jnp.arange(self.k.shape[0]) < self.pos
        s = jnp.where(mask, self.k @ q, -1e9)
        return jax.nn.softmax(s) @ self.v


@DECORATE
class Decoder:
    def __init__(self, seed, d, max_len, use_dus=False):
        ks = jax.random.split(jax.random.PRNGKey(seed), 3)
        self.wq = jax.random.normal(ks[0], (d, d)) * 0.5
        self.wk = jax.random.normal(ks[1], (d, d)) * 0.5
        self.wv = jax.random.normal(ks[2], (d, d)) * 0.5
        self.cache = KVCache(max_len, d, use_dus)
        self.generated = jnp.zeros((max_len, d))

    def step(self, x):
        self.cache.append(x @ self.wk, x @ self.wv)
        y = jnp.tanh(self.cache.attend(x @ self.wq) + x)
        self.generated = self.generated.at[self.cache.pos - 1].set(y)
        return y

    def decode(self, x, n):
        def body(i, x):
            return self.step(x)
        return lax.fori_loop(0, n, body, x)

    def decode_bound(self, x, n):
        return lax.fori_loop(0, n, lambda i, x: self.step(x), x)

    def prefill_then_decode(self, xs, n):
        self.cache.reset()
        for t in range(xs.shape[0]):
            last = self.step(xs[t])
        return self.decode(last, n)
"""

XK = jnp.array([[0.5, -1.0, 0.2], [1.0, 0.3, -0.4], [-0.2, 0.8, 0.1]])


@pytest.mark.parametrize("use_dus", [False, True])
def test_kv_cache_decode_fori_loop(write_module: Loader, use_dus: bool) -> None:
    plain, dec = pair(write_module, KV)
    calls = [("step", (XK[0],)), ("decode", (XK[1], 2)), ("decode_bound", (XK[2], 2))]
    check(plain, dec, f"Decoder(0, 3, 6, use_dus={use_dus})", calls)


@pytest.mark.parametrize("use_dus", [False, True])
def test_kv_cache_prefill_reset_decode(write_module: Loader, use_dus: bool) -> None:
    plain, dec = pair(write_module, KV)
    calls = [("prefill_then_decode", (XK[:2], 3)), ("prefill_then_decode", (XK, 2))]
    check(plain, dec, f"Decoder(1, 3, 5, use_dus={use_dus})", calls)


@pytest.mark.parametrize("transform", ["vmap"])
def test_kv_cache_decode_transforms(write_module: Loader, transform: str) -> None:
    plain, dec = pair(write_module, KV)
    calls = [("decode", (X, 2))]
    x = XK[0] if transform == "grad" else XK
    check_transform(plain, dec, "Decoder(0, 3, 4, use_dus=True)", calls, x, transform)


def test_kv_cache_jit_traced_decode_length(write_module: Loader) -> None:
    # the number of decode steps is a traced argument of fori_loop under jit
    plain, dec = pair(write_module, KV)
    ref = plain.Decoder(0, 3, 6)
    expected = [ref.step(XK[0]), ref.decode(XK[1], 3)]
    f, states = dec.Decoder(0, 3, 6).functionalize()
    o1, states = jax.jit(lambda f, s, x: f.step(s, x))(f, states, XK[0])
    o2, states = jax.jit(lambda f, s, x, n: f.decode(s, x, n))(f, states, XK[1], 3)
    assert_same(expected, [o1, o2], "outputs")
    for k, v in states.items():
        assert_same(snapshot(plain_path(ref, k)), snapshot(v), k)
    assert int(states["cache.pos"]) == 4


# ======================================================================================
# 5. An EMA teacher from a student sub-model
# ======================================================================================

EMA = """
@DECORATE
class Net:
    def __init__(self, seed, d):
        k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
        self.w = jax.random.normal(k1, (d, d)) * 0.5
        self.b = jax.random.normal(k2, (d,)) * 0.1

    def __call__(self, x):
        return jnp.tanh(x @ self.w + self.b)

    def ema_from(self, other, decay):
        self.w = decay * self.w + (1 - decay) * other.w
        self.b = decay * self.b + (1 - decay) * other.b

    def sgd(self, gw, gb, lr):
        self.w = self.w - lr * gw
        self.b = self.b - lr * gb


@DECORATE
class BYOL:
    def __init__(self, seed, d, decay=0.9):
        self.student = Net(seed, d)
        self.teacher = Net(seed, d)
        self.teacher.ema_from(self.student, 0.0)
        self.decay = decay
        self.step = jnp.zeros((), jnp.int32)

    def _loss(self, w, b, x):
        s = jnp.tanh(x @ w + b)
        t = jax.lax.stop_gradient(self.teacher(x * 1.5))
        return ((s - t) ** 2).mean()

    def train_step(self, x, lr):
        loss, (gw, gb) = jax.value_and_grad(self._loss, argnums=(0, 1))(
            self.student.w, self.student.b, x)
        self.student.sgd(gw, gb, lr)
        self.teacher.ema_from(self.student, self.decay)
        self.step += 1
        return loss

    def train_scan(self, xs, lr):
        return lax.scan(lambda c, x: (c + self.train_step(x, lr), None), 0.0, xs)[0]
"""

XE = jnp.array([[0.5, -1.0, 0.2], [1.0, 0.3, -0.4]])


def test_ema_teacher_from_student(write_module: Loader) -> None:
    plain, dec = pair(write_module, EMA)
    calls = [("train_step", (XE, 0.1)), ("train_step", (XE * 2, 0.1)),
             ("train_scan", (jnp.stack([XE, -XE, XE + 1]), 0.05))]
    check(plain, dec, "BYOL(0, 3)", calls)


def test_ema_teacher_matches_hand_threaded(write_module: Loader) -> None:
    _, dec = pair(write_module, EMA)
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    sw, sb = jax.random.normal(k1, (3, 3)) * 0.5, jax.random.normal(k2, (3,)) * 0.1
    tw, tb = sw, sb
    losses = []
    for x in (XE, XE * 2):
        def loss(w: Any, b: Any, x: Any = x, tw: Any = tw, tb: Any = tb) -> Any:
            return ((jnp.tanh(x @ w + b) - jnp.tanh(1.5 * x @ tw + tb)) ** 2).mean()
        lv, (gw, gb) = jax.value_and_grad(loss, argnums=(0, 1))(sw, sb)
        sw, sb = sw - 0.1 * gw, sb - 0.1 * gb
        tw, tb = 0.9 * tw + 0.1 * sw, 0.9 * tb + 0.1 * sb
        losses.append(lv)
    outs, states, _ = run_f(dec, "BYOL(0, 3)", [("train_step", (XE, 0.1)),
                                              ("train_step", (XE * 2, 0.1))], jit=True)
    assert_same(np.asarray(losses), np.asarray(outs), "losses")
    for k, v in (("student.w", sw), ("student.b", sb), ("teacher.w", tw), ("teacher.b", tb)):
        assert_same(np.asarray(v), np.asarray(states[k]), k)
    assert int(states["step"]) == 2


# ======================================================================================
# 6. An optimizer updating a model passed as an argument
# ======================================================================================

OPT = """
@DECORATE
class MLP:
    def __init__(self, seed, d):
        k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
        self.params = {"w": jax.random.normal(k1, (d, 1)) * 0.5, "b": jnp.zeros(1)}

    def apply(self, params, x):
        return (x @ params["w"] + params["b"])[:, 0]

    def loss(self, params, x, y):
        return ((self.apply(params, x) - y) ** 2).mean()

    def set_params(self, params):
        self.params = params


@DECORATE
class Adam:
    def __init__(self, params, lr=0.1, b1=0.9, b2=0.99, eps=1e-8):
        self.m = jax.tree_util.tree_map(jnp.zeros_like, params)
        self.v = jax.tree_util.tree_map(jnp.zeros_like, params)
        self.t = jnp.zeros((), jnp.int32)
        self.lr, self.b1, self.b2, self.eps = lr, b1, b2, eps

    def step(self, model, grads):
        self.t += 1
        tm = jax.tree_util.tree_map
        self.m = tm(lambda m, g: self.b1 * m + (1 - self.b1) * g, self.m, grads)
        self.v = tm(lambda v, g: self.b2 * v + (1 - self.b2) * g * g, self.v, grads)
        c1 = 1 - self.b1 ** self.t
        c2 = 1 - self.b2 ** self.t
        model.set_params(tm(lambda p, m, v: p - self.lr * (m / c1) / (jnp.sqrt(v / c2) + self.eps),
                            model.params, self.m, self.v))

    def step_direct(self, model, grads):
        self.t += 1
        model.params = jax.tree_util.tree_map(lambda p, g: p - self.lr * g, model.params, grads)


@DECORATE
class Trainer:
    def __init__(self, seed, d, direct=False):
        self.model = MLP(seed, d)
        self.opt = Adam(self.model.params)
        self.direct = direct
        self.losses = jnp.zeros(4)

    def train_step(self, x, y):
        loss, g = jax.value_and_grad(self.model.loss)(self.model.params, x, y)
        if self.direct:
            self.opt.step_direct(self.model, g)
        else:
            self.opt.step(self.model, g)
        self.losses = self.losses.at[self.opt.t % 4].set(loss)
        return loss

    def fit(self, xs, ys):
        def body(c, xy):
            return c, self.train_step(*xy)
        return lax.scan(body, 0, (xs, ys))[1]
"""

XO = jnp.array([[0.5, -1.0], [1.0, 0.3], [-0.2, 0.8]])
YO = jnp.array([1.0, -0.5, 0.25])


@pytest.mark.parametrize("direct", [False, True])
def test_optimizer_updates_model_passed_as_argument(write_module: Loader, direct: bool) -> None:
    plain, dec = pair(write_module, OPT)
    calls = [("train_step", (XO, YO)), ("train_step", (XO * 2, YO)),
             ("fit", (jnp.stack([XO, -XO]), jnp.stack([YO, YO * 2])))]
    check(plain, dec, f"Trainer(0, 2, direct={direct})", calls)


def test_optimizer_grad_over_inputs(write_module: Loader) -> None:
    plain, dec = pair(write_module, OPT)
    check_transform(plain, dec, "Trainer(0, 2)", [("train_step", (X, YO))], XO, "grad")


def test_optimizer_matches_hand_adam(write_module: Loader) -> None:
    _, dec = pair(write_module, OPT)
    import optax

    k1, _ = jax.random.split(jax.random.PRNGKey(0))
    p = {"w": jax.random.normal(k1, (2, 1)) * 0.5, "b": jnp.zeros(1)}
    opt = optax.adam(0.1, b1=0.9, b2=0.99, eps=1e-8)
    s = opt.init(p)
    losses = []
    for x in (XO, XO * 2, XO - 1):
        lv, g = jax.value_and_grad(lambda p, x=x: (((x @ p["w"] + p["b"])[:, 0] - YO) ** 2)
                                   .mean())(p)
        u, s = opt.update(g, s, p)
        p = optax.apply_updates(p, u)
        losses.append(lv)
    outs, states, _ = run_f(dec, "Trainer(0, 2)", [("train_step", (x, YO))
                                                   for x in (XO, XO * 2, XO - 1)], jit=True)
    assert_same(np.asarray(losses), np.asarray(outs), "losses")
    assert_same(np.asarray(p["w"]), np.asarray(states["model.params"]["w"]), "w")
    assert_same(np.asarray(p["b"]), np.asarray(states["model.params"]["b"]), "b")
    assert int(states["opt.t"]) == 3


@pytest.mark.parametrize("jit", [False, True])
def test_optimizer_functionalized_alone_model_as_f_argument(write_module: Loader,
                                                            jit: bool) -> None:
    # the optimizer functionalized on its own and an eager model passed to f.step: the model
    # is not part of f, so its write is either plain Python (eagerly) or a clear error
    plain, dec = pair(write_module, OPT)
    ref, model = plain.MLP(0, 2), dec.MLP(0, 2)
    g = jax.grad(ref.loss)(ref.params, XO, YO)
    ref_opt = plain.Adam(ref.params)
    ref_opt.step(ref, g)
    opt = dec.Adam(model.params)
    f, states = opt.functionalize()
    call = (lambda f, s, m, g: f.step(s, m, g))  # noqa: E731
    if jit:
        with pytest.raises(autostate.AutostateError) as err:
            jax.jit(call, static_argnums=2)(f, states, model, g)
        assert_user_line(err.value, _file(dec))
        assert_same(snapshot(plain.MLP(0, 2).params), snapshot(model.params), "model untouched")
    else:
        _, states = call(f, states, model, g)
        assert_same(snapshot(ref.params), snapshot(model.params), "model params")
        assert_same(snapshot(ref_opt.m), snapshot(states["m"]), "m")


# ======================================================================================
# 7. A PRNG key state split on every call
# ======================================================================================

RNG = """
@DECORATE
class Noisy:
    def __init__(self, seed, p=0.3, new_style=False):
        self.key = jax.random.key(seed) if new_style else jax.random.PRNGKey(seed)
        self.p = p
        self.calls = jnp.zeros((), jnp.int32)

    def dropout(self, x):
        self.key, sub = jax.random.split(self.key)
        keep = jax.random.bernoulli(sub, 1 - self.p, x.shape)
        self.calls += 1
        return jnp.where(keep, x / (1 - self.p), 0.0)

    def __call__(self, x):
        return self.dropout(x) + 0.01 * self.noise(x.shape)

    def noise(self, shape):
        self.key, sub = jax.random.split(self.key)
        return jax.random.normal(sub, shape)

    def maybe_drop(self, x, flag):
        return lax.cond(flag, self.dropout, lambda x: x, x)

    def many(self, xs):
        return lax.scan(lambda c, x: (c, self.dropout(x)), None, xs)[1]

    def sample_while(self, thresh):
        def cond(c):
            return c[1] < thresh
        def body(c):
            return c[0] + 1, c[1] + jax.random.uniform(self.next_key())
        return lax.while_loop(cond, body, (jnp.zeros((), jnp.int32), jnp.zeros(())))

    def next_key(self):
        self.key, sub = jax.random.split(self.key)
        return sub

    def fresh(self):
        return jax.random.uniform(self.next_key(), (2,))


@DECORATE
class Stack:
    def __init__(self, seed, new_style=True):
        self.drops = [Noisy(seed), Noisy(seed + 1, new_style=new_style)]
        self.key = jax.random.PRNGKey(seed + 100)

    def __call__(self, x):
        self.key, k = jax.random.split(self.key)
        x = x + jax.random.normal(k, x.shape) * 0.1
        for d in self.drops:
            x = d(x)
        return x
"""

XR = jnp.array([[0.5, -1.0, 0.2, 1.0], [1.0, 0.3, -0.4, 2.0]])


@pytest.mark.parametrize("new_style", [False, True])
def test_key_split_per_call_dropout(write_module: Loader, new_style: bool) -> None:
    plain, dec = pair(write_module, RNG)
    calls = [("dropout", (XR,)), ("__call__", (XR,)), ("many", (jnp.stack([XR, XR * 2]),)),
             ("sample_while", (2.0,)), ("fresh", ())] if new_style else [("dropout", (XR,)),
                                                                         ("fresh", ())]
    check(plain, dec, f"Noisy(0, new_style={new_style})", calls)


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_key_split_dropout_transforms(write_module: Loader, transform: str) -> None:
    plain, dec = pair(write_module, RNG)
    calls = [("dropout", (X,)), ("__call__", (X,)), ("many", (jnp.stack([XR, XR]),))]
    x = XR if transform == "grad" else jnp.stack([XR, XR * 2, -XR])
    check_transform(plain, dec, "Noisy(3)", calls, x, transform)


def test_key_state_in_sub_models(write_module: Loader) -> None:
    plain, dec = pair(write_module, RNG)
    check(plain, dec, "Stack(0)", [("__call__", (XR,)), ("__call__", (XR,))])
    check_transform(plain, dec, "Stack(0, new_style=False)", [("__call__", (X,))],
                    jnp.stack([XR, -XR]), "vmap")


def test_dropout_in_cond_with_batched_predicate_under_vmap(write_module: Loader) -> None:
    # vmap turns the cond into a select: the key state comes out batched, one per flag
    plain, dec = pair(write_module, RNG)
    flags = jnp.array([True, False, True])
    expected = []
    for fl in flags:
        m = plain.Noisy(0)
        expected.append((m.maybe_drop(XR, fl), m.key, m.calls))
    f, states = dec.Noisy(0).functionalize()
    outs, new = jax.jit(jax.vmap(lambda fl: f.maybe_drop(states, XR, fl)))(flags)
    for i, (out, key, calls) in enumerate(expected):
        assert_same(out, outs[i], f"out {i}")
        assert_same(np.asarray(key), np.asarray(new["key"][i]), f"key {i}")
        assert int(calls) == int(new["calls"][i])


def test_vmap_over_batched_key_states(write_module: Loader) -> None:
    # an ensemble: vmap over the states themselves (one key per member)
    plain, dec = pair(write_module, RNG)
    seeds = [0, 1, 2]
    refs = [plain.Noisy(s) for s in seeds]
    expected = [[r.dropout(XR), r.dropout(XR)] for r in refs]
    f, _ = dec.Noisy(0).functionalize()
    stacked = jax.tree_util.tree_map(lambda *v: jnp.stack(v),
                                     *[dec.Noisy(s).functionalize()[1] for s in seeds])

    def two(s: Any) -> Any:
        a, s = f.dropout(s, XR)
        b, s = f.dropout(s, XR)
        return [a, b], s

    outs, states = jax.jit(jax.vmap(two))(stacked)
    for i, r in enumerate(refs):
        assert_same(expected[i], [outs[0][i], outs[1][i]], f"member {i}")
        assert_same(np.asarray(r.key), np.asarray(states["key"][i]), f"key {i}")
        assert int(states["calls"][i]) == 2


# ======================================================================================
# 8. A PyTorch-style undecorated Module base: children found through vars(self)
# ======================================================================================

TORCHLIKE = """
class Module:
    def children(self):
        out = []
        for v in vars(self).values():
            if isinstance(v, Module):
                out.append(v)
            elif isinstance(v, (list, tuple)):
                out.extend(c for c in v if isinstance(c, Module))
            elif isinstance(v, dict):
                out.extend(c for c in v.values() if isinstance(c, Module))
        return out

    def modules(self):
        yield self
        for c in self.children():
            yield from c.modules()

    def train(self, mode=True):
        self.training = mode
        for c in self.children():
            c.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def apply(self, fn):
        for c in self.children():
            c.apply(fn)
        fn(self)
        return self

    def buffers(self):
        return [v for k, v in sorted(vars(self).items()) if isinstance(v, jax.Array)]


@DECORATE
class BN(Module):
    def __init__(self, d):
        self.training = True
        self.mean = jnp.zeros(d)
        self.nbt = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        if self.training:
            self.mean = 0.9 * self.mean + 0.1 * x.mean(0)
            self.nbt += 1
            return x - x.mean(0)
        return x - self.mean


@DECORATE
class Net(Module):
    def __init__(self, d):
        self.training = True
        self.layers = [BN(d), BN(d)]
        self.head = {"h": BN(d)}
        self.teacher = copy.deepcopy(self.layers[0])
        self.w = jnp.ones((d, d)) * 0.3

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x) @ self.w
        self.teacher.mean = 0.5 * self.teacher.mean + 0.5 * self.layers[0].mean
        return self.head["h"](x)

    def count(self):
        return sum(m.nbt for m in self.modules() if isinstance(m, BN))

    def all_buffers(self):
        return [b for m in self.modules() for b in m.buffers()]

    def scan_calls(self, xs):
        return lax.scan(lambda c, x: (c + self(x).sum(), None), 0.0, xs)[0]
"""

XT = jnp.array([[1.0, 2.0], [3.0, -1.0], [0.0, 5.0]])


@pytest.mark.parametrize("build", [
    "Net(2).eval().train()", "Net(2).apply(lambda m: setattr(m, 'training', False))"])
def test_torch_like_module_base_train_eval(write_module: Loader, build: str) -> None:
    plain, dec = pair(write_module, TORCHLIKE)
    calls = [("__call__", (XT,)), ("scan_calls", (jnp.stack([XT, XT * 2]),)), ("count", ()),
             ("all_buffers", ())]
    check(plain, dec, build, calls)


@pytest.mark.parametrize("jit", [False, True])
def test_torch_like_eval_through_f_is_documented_error(write_module: Loader, jit: bool) -> None:
    _, dec = pair(write_module, TORCHLIKE)
    f, states = dec.Net(2).functionalize()
    call = (lambda f, s: f.eval(s)[1])  # noqa: E731
    with pytest.raises(autostate.errors.StaticStateError) as err:
        (jax.jit(call) if jit else call)(f, states)
    assert "training" in str(err.value)
    assert_user_line(err.value, _file(dec))


def test_model_returned_from_f_is_a_clear_unhandled_error(write_module: Loader) -> None:
    # train() returns self: f.train gives back f's model, whose states are f's refs
    _, dec = pair(write_module, TORCHLIKE)
    f, states = dec.BN(2).functionalize()
    out, _ = f.train(states)
    assert isinstance(out, dec.BN)
    with pytest.raises(autostate.errors.UnhandledLocalStateError):
        _ = out.mean
    assert out.training is True


# ======================================================================================
# 9. A sub-model's container state changed in place inside a lax body
# ======================================================================================

INPLACE = """
def sgd_(model, grads, lr):
    for i, (p, g) in enumerate(zip(model.params, grads)):
        model.params[i] = p - lr * g


@DECORATE
class Lin:
    def __init__(self, seed, d):
        self.params = [jax.random.normal(jax.random.PRNGKey(seed), (d, 1)) * 0.5, jnp.zeros(1)]

    def loss(self, params, x, y):
        return (((x @ params[0] + params[1])[:, 0] - y) ** 2).mean()

    def load(self, params):
        self.params = list(params)


@DECORATE
class Fit:
    def __init__(self, seed, d, lr=0.1):
        self.model = Lin(seed, d)
        self.lr = lr
        self.t = jnp.zeros((), jnp.int32)

    def train_step(self, x, y):
        loss, g = jax.value_and_grad(self.model.loss)(self.model.params, x, y)
        sgd_(self.model, g, self.lr)
        self.t += 1
        return loss

    def loop(self, xs, ys):
        return jnp.stack([self.train_step(x, y) for x, y in zip(xs, ys)])

    def scan(self, xs, ys):
        return lax.scan(lambda c, xy: (c, self.train_step(*xy)), 0, (xs, ys))[1]
"""

XO2 = jnp.stack([XO, XO * 2, -XO])
YO2 = jnp.stack([YO, YO, YO * 2])


def test_in_place_list_update_of_sub_model_in_python_loop(write_module: Loader) -> None:
    plain, dec = pair(write_module, INPLACE)
    check(plain, dec, "Fit(0, 2)", [("train_step", (XO, YO)), ("loop", (XO2, YO2))])


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_in_place_list_update_of_sub_model_in_scan(write_module: Loader, mode: str) -> None:
    plain, dec = pair(write_module, INPLACE)
    check(plain, dec, "Fit(0, 2)", [("scan", (XO2, YO2))], modes=(mode,))


# ======================================================================================
# 10. A Python-float state read by Python control flow
# ======================================================================================

FLOATRATE = """
@DECORATE
class Drop:
    def __init__(self, seed, p=0.5):
        self.key = jax.random.PRNGKey(seed)
        self.p = p

    def set_rate(self, p):
        self.p = p
        return self

    def __call__(self, x):
        if self.p == 0.0:
            return x
        self.key, sub = jax.random.split(self.key)
        return jnp.where(jax.random.bernoulli(sub, 1 - self.p, x.shape), x / (1 - self.p), 0.0)
"""


def test_float_rate_state_eager_and_f(write_module: Loader) -> None:
    plain, dec = pair(write_module, FLOATRATE)
    for build in ("Drop(0)", "Drop(0).set_rate(0.0)"):
        check(plain, dec, build, [("__call__", (XR,)), ("__call__", (XR,))], modes=("eager", "f"))


def test_float_rate_state_under_jit(write_module: Loader) -> None:
    # A Python-float state (`self.p = p` in set_rate) is a traced leaf under
    # jit, so `if self.p == 0.0:` cannot work there; the error is autostate's,
    # naming the state and the line, and still JAX's type.
    plain, dec = pair(write_module, FLOATRATE)
    with pytest.raises(autostate.errors.TracedValueError) as raised:
        check(plain, dec, "Drop(0).set_rate(0.0)", [("__call__", (XR,))], modes=("jit",))
    assert isinstance(raised.value, jax.errors.TracerBoolConversionError)
    assert "'p' holds a Python number" in str(raised.value)
    assert_user_line(raised.value, _file(dec))
