"""Differential bug hunt 24: model archetypes not covered by earlier hunts.

- A diffusion training step: a noise schedule computed in ``__init__``, a step
  counter, an EMA copy of the weights updated in a method (aliased to the
  weights in ``__init__`` and copied), a PRNG key state split per call,
  ancestral sampling in ``lax.scan``; training against hand-threaded JAX.
- A VAE: reparameterisation with a key state, the KL term, ``jax.grad`` of the
  loss through ``f`` against hand-threaded JAX, a sampling method.
- A GAN: generator and discriminator as two sub-models of one root,
  alternating updates with ``stop_gradient`` and two optax optimizers whose
  states are states of the root, a step counter.
- Mixture of experts: top-k routing (``lax.top_k`` / ``argsort``, gathers),
  per-expert usage counters updated with ``.at[idx].add(1)``, a
  load-balancing loss.
- RL: a replay buffer (fixed-size arrays, circular write index, size
  counter), sampling with a key state, a target network synced every N steps
  with ``jnp.where`` / ``lax.cond`` (and a ``cond`` branch that assigns).
- ActNorm with data-dependent initialisation: a Python-bool flag (eager
  works; through ``f`` it is the documented ``StaticStateError``) and an
  array flag with ``jnp.where`` / ``lax.cond``.
- A Trainer holding a model and an optimizer state, taking ``jax.grad`` of
  the model's loss method inside its own method, scanned over batches.
- ``jax.vmap`` inside a method over a sub-model method that writes state
  (the documented ``EscapedStateError``) and that does not, and
  ``jax.checkpoint`` around a block method.

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
import optax
import pytest
from differential import (  # noqa: I001 - tests/ is on sys.path
    assert_same,
    assert_user_line,
    check,
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


def run_modes(dec: types.ModuleType, build: str, calls: list[tuple[str, tuple[Any, ...]]],
              keys: list[str]) -> dict[str, tuple[list[Any], dict[str, Any]]]:
    """Outputs and the named states after ``calls``: eagerly, through ``f``, under ``jit``."""
    model = eval(build, vars(dec))  # noqa: S307
    outs = [(model if m == "__call__" else getattr(model, m))(*a) for m, a in calls]
    result = {"eager": (outs, {k: plain_path(model, k) for k in keys})}
    for jit in (False, True):
        outs, states, _ = run_f(dec, build, calls, jit)
        result["jit" if jit else "f"] = (outs, {k: states[k] for k in keys})
    return result


# ======================================================================================
# 1. Diffusion
# ======================================================================================

DIFFUSION = """
@DECORATE
class Diffusion:
    def __init__(self, seed, d=3, T=5, decay=0.5, alias=True):
        k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
        self.w = jax.random.normal(k1, (d + 1, d)) * 0.3
        betas = jnp.linspace(1e-3, 0.2, T)
        self.betas = STATE(betas)
        self.alphas = STATE(1.0 - betas)
        self.alphas_cumprod = STATE(jnp.cumprod(1.0 - betas))
        self.ema_w = self.w if alias else jnp.array(self.w)
        self.key = jax.random.key(seed + 7)
        self.step = jnp.zeros((), jnp.int32)
        self.decay = decay
        self.T = T

    def denoise(self, w, xt, t):
        tt = jnp.broadcast_to((t / self.T)[..., None], xt.shape[:-1] + (1,))
        return jnp.concatenate([xt, tt], -1) @ w

    def _loss(self, w, x0, t, noise):
        a = self.alphas_cumprod[t][:, None]
        xt = jnp.sqrt(a) * x0 + jnp.sqrt(1 - a) * noise
        return ((self.denoise(w, xt, t) - noise) ** 2).mean()

    def train_step(self, x0, lr):
        self.key, kt, kn = jax.random.split(self.key, 3)
        t = jax.random.randint(kt, (x0.shape[0],), 0, self.T)
        noise = jax.random.normal(kn, x0.shape)
        loss, g = jax.value_and_grad(self._loss)(self.w, x0, t, noise)
        self.w = self.w - lr * g
        self.step += 1
        self.ema_w = self.decay * self.ema_w + (1 - self.decay) * self.w
        return loss

    def sample(self, like):
        n = like.shape[0]
        self.key, k0 = jax.random.split(self.key)
        x = jax.random.normal(k0, (n, self.w.shape[1]))

        def body(x, t):
            self.key, k = jax.random.split(self.key)
            eps = self.denoise(self.ema_w, x, jnp.full((n,), t))
            a, ab = self.alphas[t], self.alphas_cumprod[t]
            x = (x - (1 - a) / jnp.sqrt(1 - ab) * eps) / jnp.sqrt(a)
            x = x + jnp.where(t > 0, jnp.sqrt(self.betas[t]), 0.0) * jax.random.normal(k, x.shape)
            return x, x.mean()

        x, means = lax.scan(body, x, jnp.arange(self.T)[::-1])
        return x, means
"""

X0 = jnp.array([[0.5, -1.0, 0.2], [1.0, 0.3, -0.4]])


@pytest.mark.parametrize("alias", [True, False])
def test_diffusion_train_and_sample_plain_vs_decorated(write_module: Loader, alias: bool) -> None:
    plain, dec = pair(write_module, DIFFUSION)
    calls = [("train_step", (X0, 0.1)), ("train_step", (X0 * 2, 0.1)), ("sample", (jnp.zeros(2),)),
             ("train_step", (X0, 0.05))]
    check(plain, dec, f"Diffusion(0, alias={alias})", calls)


def _diffusion_hand(seed: int, x0s: list[Any], lr: float) -> dict[str, Any]:
    d, T, decay = 3, 5, 0.5
    k1, _ = jax.random.split(jax.random.PRNGKey(seed))
    w = jax.random.normal(k1, (d + 1, d)) * 0.3
    ac = jnp.cumprod(1.0 - jnp.linspace(1e-3, 0.2, T))
    s = {"w": w, "ema_w": w, "key": jax.random.key(seed + 7), "step": jnp.zeros((), jnp.int32)}

    def loss(w, x0, t, noise):
        a = ac[t][:, None]
        xt = jnp.sqrt(a) * x0 + jnp.sqrt(1 - a) * noise
        tt = (t / T)[:, None]
        return ((jnp.concatenate([xt, tt], -1) @ w - noise) ** 2).mean()

    @jax.jit
    def step(s, x0):
        key, kt, kn = jax.random.split(s["key"], 3)
        t = jax.random.randint(kt, (x0.shape[0],), 0, T)
        noise = jax.random.normal(kn, x0.shape)
        lval, g = jax.value_and_grad(loss)(s["w"], x0, t, noise)
        w = s["w"] - lr * g
        return lval, {"w": w, "ema_w": decay * s["ema_w"] + (1 - decay) * w, "key": key,
                      "step": s["step"] + 1}

    losses = []
    for x0 in x0s:
        lval, s = step(s, x0)
        losses.append(lval)
    s["losses"] = losses
    return s


@pytest.mark.parametrize("jit", [False, True])
def test_diffusion_training_matches_hand_threaded(write_module: Loader, jit: bool) -> None:
    _, dec = pair(write_module, DIFFUSION)
    x0s = [X0, X0 * 2, X0 - 1]
    outs, states, _ = run_f(dec, "Diffusion(0)", [("train_step", (x, 0.1)) for x in x0s], jit)
    ref = _diffusion_hand(0, x0s, 0.1)
    assert_same(ref["losses"], outs, "losses")
    for k in ("w", "ema_w", "step"):
        assert_same(np.asarray(ref[k]), np.asarray(states[k]), k)
    np.testing.assert_array_equal(jax.random.key_data(ref["key"]),
                                  jax.random.key_data(states["key"]))
    assert sorted(states) == ["alphas", "alphas_cumprod", "betas", "ema_w", "key", "step", "w"]


# ======================================================================================
# 2. VAE
# ======================================================================================

VAE = """
@DECORATE
class VAE:
    def __init__(self, seed, d=4, z=2):
        k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
        self.enc = jax.random.normal(k1, (d, 2 * z)) * 0.3
        self.dec = jax.random.normal(k2, (z, d)) * 0.3
        self.key = jax.random.PRNGKey(seed + 1)
        self.z = z

    def encode(self, x):
        h = x @ self.enc
        return h[:, : self.z], h[:, self.z :]

    def __call__(self, x):
        mu, logvar = self.encode(x)
        self.key, sub = jax.random.split(self.key)
        eps = jax.random.normal(sub, mu.shape)
        z = mu + jnp.exp(0.5 * logvar) * eps
        recon = jnp.tanh(z @ self.dec)
        kl = -0.5 * jnp.sum(1 + logvar - mu**2 - jnp.exp(logvar), -1).mean()
        return ((recon - x) ** 2).sum(-1).mean() + kl

    def sample(self, like):
        self.key, sub = jax.random.split(self.key)
        return jnp.tanh(jax.random.normal(sub, (like.shape[0], self.z)) @ self.dec)
"""

XV = jnp.array([[0.1, 0.2, -0.3, 0.4], [0.5, -0.6, 0.7, 0.0], [0.3, 0.3, 0.3, -0.3]])


def test_vae_plain_vs_decorated(write_module: Loader) -> None:
    plain, dec = pair(write_module, VAE)
    check(plain, dec, "VAE(3)", [("__call__", (XV,)), ("sample", (jnp.zeros(2),)), ("__call__", (XV * 2,))])


def _vae_hand(seed: int) -> tuple[dict[str, Any], Any, Callable[..., Any]]:
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    params = {"enc": jax.random.normal(k1, (4, 4)) * 0.3, "dec": jax.random.normal(k2, (2, 4)) * 0.3}

    def loss(p, key, x):
        h = x @ p["enc"]
        mu, logvar = h[:, :2], h[:, 2:]
        key, sub = jax.random.split(key)
        z = mu + jnp.exp(0.5 * logvar) * jax.random.normal(sub, mu.shape)
        recon = jnp.tanh(z @ p["dec"])
        kl = -0.5 * jnp.sum(1 + logvar - mu**2 - jnp.exp(logvar), -1).mean()
        return ((recon - x) ** 2).sum(-1).mean() + kl, key

    return params, jax.random.PRNGKey(seed + 1), loss


@pytest.mark.parametrize("jit", [False, True])
def test_vae_grad_through_f_trains_like_hand_threaded(write_module: Loader, jit: bool) -> None:
    _, dec = pair(write_module, VAE)
    f, states = dec.VAE(3).functionalize()
    p, key, hloss = _vae_hand(3)

    def step(f, states, x):
        (lval, states), g = jax.value_and_grad(lambda f: f(states, x), has_aux=True)(f)
        return lval, jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, f, g), states

    def hstep(p, key, x):
        (lval, key), g = jax.value_and_grad(hloss, has_aux=True)(p, key, x)
        return lval, jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, g), key

    if jit:
        step, hstep = jax.jit(step), jax.jit(hstep)
    for x in (XV, XV * 2, XV - 0.5):
        l1, f, states = step(f, states, x)
        l2, p, key = hstep(p, key, x)
        assert_same(np.asarray(l2), np.asarray(l1), "loss")
    got = autostate.param_dict(f)
    assert_same({k: np.asarray(v) for k, v in p.items()}, {k: np.asarray(v) for k, v in got.items()})
    np.testing.assert_array_equal(np.asarray(key), np.asarray(states["key"]))
    out, states = f.sample(states, jnp.zeros(3))
    _, sub = jax.random.split(key)
    assert_same(np.asarray(jnp.tanh(jax.random.normal(sub, (3, 2)) @ p["dec"])), np.asarray(out))


# ======================================================================================
# 3. GAN
# ======================================================================================

GAN = """
import optax


@DECORATE
class Gen:
    def __init__(self, key, z=2, d=3):
        self.w = jax.random.normal(key, (z, d)) * 0.5

    def __call__(self, z):
        return jnp.tanh(z @ self.w)


@DECORATE
class Disc:
    def __init__(self, key, d=3):
        self.w = jax.random.normal(key, (d,)) * 0.5

    def __call__(self, x):
        return x @ self.w


@DECORATE
class GAN:
    def __init__(self, seed):
        kg, kd, kk = jax.random.split(jax.random.PRNGKey(seed), 3)
        self.G = Gen(kg)
        self.D = Disc(kd)
        self.g_opt = optax.adam(0.05)
        self.d_opt = optax.sgd(0.1, momentum=0.9)
        self.g_w = self.G.w
        self.d_w = self.D.w
        self.g_state = self.g_opt.init(self.g_w)
        self.d_state = self.d_opt.init(self.d_w)
        self.key = kk
        self.step = jnp.zeros((), jnp.int32)

    def d_loss(self, dw, real, z):
        fake = jax.lax.stop_gradient(jnp.tanh(z @ self.g_w))
        return jax.nn.softplus(-(real @ dw)).mean() + jax.nn.softplus(fake @ dw).mean()

    def g_loss(self, gw, z):
        return jax.nn.softplus(-(jnp.tanh(z @ gw) @ jax.lax.stop_gradient(self.d_w))).mean()

    def train_step(self, real):
        self.key, kd, kg = jax.random.split(self.key, 3)
        zd = jax.random.normal(kd, (real.shape[0], 2))
        ld, gd = jax.value_and_grad(self.d_loss)(self.d_w, real, zd)
        upd, self.d_state = self.d_opt.update(gd, self.d_state, self.d_w)
        self.d_w = optax.apply_updates(self.d_w, upd)
        zg = jax.random.normal(kg, (real.shape[0], 2))
        lg, gg = jax.value_and_grad(self.g_loss)(self.g_w, zg)
        upd, self.g_state = self.g_opt.update(gg, self.g_state, self.g_w)
        self.g_w = optax.apply_updates(self.g_w, upd)
        self.step += 1
        return ld, lg

    def generate(self, z):
        return jnp.tanh(z @ self.g_w), self.D(jnp.tanh(z @ self.g_w))
"""

GAN_SUB = """
import optax


@DECORATE
class Gen:
    def __init__(self, key, z=2, d=3):
        self.w = STATE(jax.random.normal(key, (z, d)) * 0.5)

    def __call__(self, z):
        return jnp.tanh(z @ self.w)

    def loss(self, z, disc):
        return jax.nn.softplus(-disc(self(z))).mean()


@DECORATE
class Disc:
    def __init__(self, key, d=3):
        self.w = STATE(jax.random.normal(key, (d,)) * 0.5)

    def __call__(self, x):
        return x @ self.w

    def loss(self, real, fake):
        return jax.nn.softplus(-self(real)).mean() + jax.nn.softplus(self(fake)).mean()


@DECORATE
class GAN:
    def __init__(self, seed):
        kg, kd, kk = jax.random.split(jax.random.PRNGKey(seed), 3)
        self.G = Gen(kg)
        self.D = Disc(kd)
        self.g_opt = optax.adam(0.05)
        self.d_opt = optax.sgd(0.1, momentum=0.9)
        self.g_state = self.g_opt.init(self.G.w)
        self.d_state = self.d_opt.init(self.D.w)
        self.key = kk
        self.step = jnp.zeros((), jnp.int32)

    def train_step(self, real):
        self.key, kd, kg = jax.random.split(self.key, 3)
        fake = jax.lax.stop_gradient(self.G(jax.random.normal(kd, (real.shape[0], 2))))
        ld, gd = jax.value_and_grad(lambda D: D.loss(real, fake))(self.D)
        upd, self.d_state = self.d_opt.update(gd.w, self.d_state, self.D.w)
        self.D.w = optax.apply_updates(self.D.w, upd)
        zg = jax.random.normal(kg, (real.shape[0], 2))
        frozen_d = jax.lax.stop_gradient(self.D)
        lg, gg = jax.value_and_grad(lambda G: G.loss(zg, frozen_d))(self.G)
        upd, self.g_state = self.g_opt.update(gg.w, self.g_state, self.G.w)
        self.G.w = optax.apply_updates(self.G.w, upd)
        self.step += 1
        return ld, lg
"""

REAL = jnp.array([[1.0, 0.5, -0.5], [0.8, 0.4, -0.2]])


def test_gan_alternating_updates_plain_vs_decorated(write_module: Loader) -> None:
    plain, dec = pair(write_module, GAN)
    z = jnp.array([[0.1, -0.2]])
    check(plain, dec, "GAN(0)", [("train_step", (REAL,)), ("train_step", (REAL * 0.5,)),
                                  ("generate", (z,)), ("train_step", (REAL,))])


def _gan_hand(seed: int, steps: int) -> tuple[list[Any], dict[str, Any]]:
    kg, kd, kk = jax.random.split(jax.random.PRNGKey(seed), 3)
    gw, dw = jax.random.normal(kg, (2, 3)) * 0.5, jax.random.normal(kd, (3,)) * 0.5
    gopt, dopt = optax.adam(0.05), optax.sgd(0.1, momentum=0.9)
    gs, ds = gopt.init(gw), dopt.init(dw)
    outs = []
    for _ in range(steps):
        kk, k1, k2 = jax.random.split(kk, 3)
        zd = jax.random.normal(k1, (2, 2))
        fake = jnp.tanh(zd @ gw)
        ld, g = jax.value_and_grad(
            lambda dw: jax.nn.softplus(-(REAL @ dw)).mean() + jax.nn.softplus(fake @ dw).mean())(dw)  # noqa: B023
        u, ds = dopt.update(g, ds, dw)
        dw = optax.apply_updates(dw, u)
        zg = jax.random.normal(k2, (2, 2))
        lg, g = jax.value_and_grad(lambda gw: jax.nn.softplus(-(jnp.tanh(zg @ gw) @ dw)).mean())(gw)  # noqa: B023
        u, gs = gopt.update(g, gs, gw)
        gw = optax.apply_updates(gw, u)
        outs.append((np.asarray(ld), np.asarray(lg)))
    return outs, {"g_w": gw, "d_w": dw, "step": steps}


def test_gan_matches_hand_threaded(write_module: Loader) -> None:
    _, dec = pair(write_module, GAN)
    outs, states, _ = run_f(dec, "GAN(0)", [("train_step", (REAL,))] * 3, jit=True)
    ref_outs, ref = _gan_hand(0, 3)
    assert_same(ref_outs, [tuple(np.asarray(o) for o in out) for out in outs], "losses")
    assert_same(np.asarray(ref["g_w"]), np.asarray(states["g_w"]), "g_w")
    assert_same(np.asarray(ref["d_w"]), np.asarray(states["d_w"]), "d_w")
    assert int(states["step"]) == 3


def test_gan_grad_over_sub_models_inside_a_method(write_module: Loader) -> None:
    # jax.grad over a sub-model (a pytree only when decorated): no plain reference, so
    # eager / f / jit are compared with the hand-threaded GAN.
    _, dec = pair(write_module, GAN_SUB)
    ref_outs, ref = _gan_hand(1, 3)
    for mode, (outs, states) in run_modes(dec, "GAN(1)", [("train_step", (REAL,))] * 3,
                                          ["G.w", "D.w", "step"]).items():
        assert_same(ref_outs, [tuple(np.asarray(o) for o in out) for out in outs], mode)
        assert_same(np.asarray(ref["g_w"]), np.asarray(states["G.w"]), f"{mode} G.w")
        assert_same(np.asarray(ref["d_w"]), np.asarray(states["D.w"]), f"{mode} D.w")
        assert int(states["step"]) == 3, mode


# ======================================================================================
# 4. Mixture of experts
# ======================================================================================

MOE = """
@DECORATE
class MoE:
    def __init__(self, seed, d=3, n=4, k=2, use_argsort=False):
        k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
        self.router = jax.random.normal(k1, (d, n))
        self.experts = jax.random.normal(k2, (n, d, d)) * 0.5
        self.usage = jnp.zeros(n, jnp.int32)
        self.aux = jnp.zeros(())
        self.k = k
        self.n = n
        self.use_argsort = use_argsort

    def __call__(self, x):
        logits = x @ self.router
        if self.use_argsort:
            idx = jnp.argsort(-logits, axis=-1)[:, : self.k]
            vals = jnp.take_along_axis(logits, idx, axis=-1)
        else:
            vals, idx = jax.lax.top_k(logits, self.k)
        gates = jax.nn.softmax(vals, -1)
        chosen = self.experts[idx]
        y = jnp.einsum("bd,bkde->bke", x, chosen)
        out = jnp.einsum("bk,bke->be", gates, y)
        self.usage = self.usage.at[idx.reshape(-1)].add(1)
        frac = jax.nn.one_hot(idx, self.n).sum(1).mean(0)
        probs = jax.nn.softmax(logits, -1).mean(0)
        self.aux = self.n * jnp.sum(frac * probs)
        return out, self.aux

    def loss(self, x, y):
        out, aux = self(x)
        return ((out - y) ** 2).mean() + 0.01 * aux
"""

XM = jnp.array([[0.5, -1.0, 0.2], [1.0, 0.3, -0.4], [-0.2, 0.1, 0.9], [0.0, 0.7, -0.7]])


@pytest.mark.parametrize("use_argsort", [False, True])
def test_moe_routing_and_usage_counters(write_module: Loader, use_argsort: bool) -> None:
    plain, dec = pair(write_module, MOE)
    check(plain, dec, f"MoE(0, use_argsort={use_argsort})",
          [("__call__", (XM,)), ("__call__", (XM[:2] * 3,)), ("loss", (XM, XM * 0.5))])


def test_moe_grad_through_f_matches_hand_threaded(write_module: Loader) -> None:
    _, dec = pair(write_module, MOE)
    f, states = dec.MoE(0).functionalize()

    def hloss(p, x, y):
        logits = x @ p["router"]
        vals, idx = jax.lax.top_k(logits, 2)
        out = jnp.einsum("bk,bke->be", jax.nn.softmax(vals, -1),
                         jnp.einsum("bd,bkde->bke", x, p["experts"][idx]))
        frac = jax.nn.one_hot(idx, 4).sum(1).mean(0)
        aux = 4 * jnp.sum(frac * jax.nn.softmax(logits, -1).mean(0))
        return ((out - y) ** 2).mean() + 0.01 * aux, idx

    p = {k: jnp.asarray(v) for k, v in autostate.param_dict(f).items()}
    (l1, idx), g1 = jax.value_and_grad(hloss, has_aux=True)(p, XM, XM * 0.5)
    (l2, states2), g2 = jax.jit(jax.value_and_grad(lambda f: f.loss(states, XM, XM * 0.5),
                                                   has_aux=True))(f)
    assert_same(np.asarray(l1), np.asarray(l2))
    assert_same({k: np.asarray(v) for k, v in g1.items()},
                {k: np.asarray(v) for k, v in autostate.param_dict(g2).items()})
    np.testing.assert_array_equal(np.bincount(np.asarray(idx).ravel(), minlength=4),
                                  np.asarray(states2["usage"]))


# ======================================================================================
# 5. RL: replay buffer + target network
# ======================================================================================

DQN = """
@DECORATE
class DQN:
    def __init__(self, seed, obs=2, act=3, cap=4, sync_every=2, sync="where"):
        k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
        self.w = jax.random.normal(k1, (obs, act)) * 0.5
        self.target_w = self.w
        self.obs_buf = jnp.zeros((cap, obs))
        self.act_buf = jnp.zeros(cap, jnp.int32)
        self.rew_buf = jnp.zeros(cap)
        self.next_buf = jnp.zeros((cap, obs))
        self.ptr = jnp.zeros((), jnp.int32)
        self.size = jnp.zeros((), jnp.int32)
        self.step = jnp.zeros((), jnp.int32)
        self.key = jax.random.key(seed + 3)
        self.cap = cap
        self.sync_every = sync_every
        self.sync = sync
        self.batch = 3

    def add(self, o, a, r, o2):
        i = self.ptr
        self.obs_buf = self.obs_buf.at[i].set(o)
        self.act_buf = self.act_buf.at[i].set(a)
        self.rew_buf = self.rew_buf.at[i].set(r)
        self.next_buf = self.next_buf.at[i].set(o2)
        self.ptr = (self.ptr + 1) % self.cap
        self.size = jnp.minimum(self.size + 1, self.cap)

    def sample(self, n):
        self.key, sub = jax.random.split(self.key)
        idx = jax.random.randint(sub, (n,), 0, self.size)
        return self.obs_buf[idx], self.act_buf[idx], self.rew_buf[idx], self.next_buf[idx]

    def _sync(self):
        self.target_w = self.w

    def train_step(self, lr, gamma):
        n = self.batch
        o, a, r, o2 = self.sample(n)
        target = r + gamma * (o2 @ self.target_w).max(-1)

        def loss(w):
            q = jnp.take_along_axis(o @ w, a[:, None], 1)[:, 0]
            return ((q - target) ** 2).mean()

        l, g = jax.value_and_grad(loss)(self.w)
        self.w = self.w - lr * g
        self.step += 1
        due = self.step % self.sync_every == 0
        if self.sync == "where":
            self.target_w = jnp.where(due, self.w, self.target_w)
        elif self.sync == "cond":
            self.target_w = lax.cond(due, lambda: self.w, lambda: self.target_w)
        else:
            lax.cond(due, self._sync, lambda: None)
        return l
"""

TRANSITIONS = [
    (jnp.array([0.1, 0.2]), jnp.int32(0), jnp.float32(1.0), jnp.array([0.3, 0.1])),
    (jnp.array([0.3, 0.1]), jnp.int32(2), jnp.float32(-1.0), jnp.array([0.0, 0.5])),
    (jnp.array([0.0, 0.5]), jnp.int32(1), jnp.float32(0.5), jnp.array([0.2, -0.2])),
]


def _dqn_calls() -> list[tuple[str, tuple[Any, ...]]]:
    calls: list[tuple[str, tuple[Any, ...]]] = []
    for i, t in enumerate(TRANSITIONS * 2):
        calls.append(("add", t))
        if i >= 1:
            calls.append(("train_step", (0.1, 0.9)))
    return calls


@pytest.mark.parametrize("sync", ["where", "cond", "cond_assigns"])
def test_dqn_replay_buffer_and_target_sync(write_module: Loader, sync: str) -> None:
    plain, dec = pair(write_module, DQN)
    check(plain, dec, f"DQN(0, sync={sync!r})", _dqn_calls())


def test_dqn_matches_hand_threaded(write_module: Loader) -> None:
    _, dec = pair(write_module, DQN)
    outs, states, _ = run_f(dec, "DQN(0)", _dqn_calls(), jit=True)
    k1, _ = jax.random.split(jax.random.PRNGKey(0))
    w = jax.random.normal(k1, (2, 3)) * 0.5
    s = {"w": w, "target_w": w, "obs": jnp.zeros((4, 2)), "act": jnp.zeros(4, jnp.int32),
         "rew": jnp.zeros(4), "next": jnp.zeros((4, 2)), "ptr": 0, "size": 0, "step": 0,
         "key": jax.random.key(3)}
    losses = []
    for i, (o, a, r, o2) in enumerate(TRANSITIONS * 2):
        p = s["ptr"]
        s["obs"], s["act"] = s["obs"].at[p].set(o), s["act"].at[p].set(a)
        s["rew"], s["next"] = s["rew"].at[p].set(r), s["next"].at[p].set(o2)
        s["ptr"], s["size"] = (p + 1) % 4, min(s["size"] + 1, 4)
        if i >= 1:
            s["key"], sub = jax.random.split(s["key"])
            idx = jax.random.randint(sub, (3,), 0, s["size"])
            bo, ba, br, bn = s["obs"][idx], s["act"][idx], s["rew"][idx], s["next"][idx]
            tgt = br + 0.9 * (bn @ s["target_w"]).max(-1)
            lval, g = jax.value_and_grad(
                lambda w: ((jnp.take_along_axis(bo @ w, ba[:, None], 1)[:, 0] - tgt) ** 2).mean()  # noqa: B023
            )(s["w"])
            s["w"] = s["w"] - 0.1 * g
            s["step"] += 1
            if s["step"] % 2 == 0:
                s["target_w"] = s["w"]
            losses.append(lval)
    got = [o for o in outs if o is not None]
    assert_same([np.asarray(v) for v in losses], [np.asarray(v) for v in got], "losses")
    for k, sk in (("w", "w"), ("target_w", "target_w"), ("obs", "obs_buf"), ("act", "act_buf"),
                  ("ptr", "ptr"), ("size", "size"), ("step", "step")):
        assert_same(np.asarray(s[k]), np.asarray(states[sk]), k)


# ======================================================================================
# 6. ActNorm
# ======================================================================================

ACTNORM = """
@DECORATE
class ActNormPy:
    def __init__(self, d):
        self.scale = jnp.ones(d)
        self.bias = jnp.zeros(d)
        self.initialized = False

    def __call__(self, x):
        if not self.initialized:
            self.bias = -x.mean(0)
            self.scale = 1.0 / (x.std(0) + 1e-6)
            self.initialized = True
        return (x + self.bias) * self.scale


@DECORATE
class ActNormArr:
    def __init__(self, d, use_cond=False):
        self.scale = jnp.ones(d)
        self.bias = jnp.zeros(d)
        self.initialized = jnp.array(False)
        self.use_cond = use_cond

    def _init(self, x):
        self.bias = -x.mean(0)
        self.scale = 1.0 / (x.std(0) + 1e-6)

    def __call__(self, x):
        if self.use_cond:
            lax.cond(self.initialized, lambda x: None, self._init, x)
        else:
            first = jnp.logical_not(self.initialized)
            self.bias = jnp.where(first, -x.mean(0), self.bias)
            self.scale = jnp.where(first, 1.0 / (x.std(0) + 1e-6), self.scale)
        self.initialized = jnp.array(True)
        return (x + self.bias) * self.scale


@DECORATE
class Flow:
    def __init__(self, d):
        self.norms = [ActNormArr(d), ActNormArr(d, use_cond=True)]
        self.w = jnp.eye(d) * 0.5 + 0.1

    def __call__(self, x):
        for n in self.norms:
            x = n(x) @ self.w
        return x
"""

XA = jnp.array([[1.0, 2.0, 0.0], [3.0, -2.0, 1.0], [2.0, 0.0, 5.0]])


def test_actnorm_python_flag_eager_like_plain(write_module: Loader) -> None:
    plain, dec = pair(write_module, ACTNORM)
    check(plain, dec, "ActNormPy(3)", [("__call__", (XA,)), ("__call__", (XA * 2,))],
          modes=("eager",))


def test_actnorm_python_flag_after_eager_init_through_f(write_module: Loader) -> None:
    plain, dec = pair(write_module, ACTNORM)
    ref, model = plain.ActNormPy(3), dec.ActNormPy(3)
    ref(XA)
    model(XA)
    f, states = model.functionalize()
    out, states = jax.jit(lambda f, s, x: f(s, x))(f, states, XA * 2)
    assert_same(np.asarray(ref(XA * 2)), np.asarray(out))
    frozen = autostate.freeze(f, states)
    assert_same(snapshot(ref), snapshot(frozen))


@pytest.mark.parametrize("jit", [False, True])
def test_actnorm_python_flag_through_f_is_the_documented_error(write_module: Loader,
                                                              jit: bool) -> None:
    _, dec = pair(write_module, ACTNORM)
    f, states = dec.ActNormPy(3).functionalize()
    call = (lambda f, s, x: f(s, x))  # noqa: E731
    with pytest.raises(autostate.errors.StaticStateError) as err:
        (jax.jit(call) if jit else call)(f, states, XA)
    assert "initialized" in str(err.value)
    assert_user_line(err.value, dec.__file__.rsplit("/", 1)[-1])


@pytest.mark.parametrize("build", ["ActNormArr(3)", "ActNormArr(3, use_cond=True)", "Flow(3)"])
def test_actnorm_array_flag(write_module: Loader, build: str) -> None:
    plain, dec = pair(write_module, ACTNORM)
    check(plain, dec, build, [("__call__", (XA,)), ("__call__", (XA * 2,)), ("__call__", (XA,))])


def test_actnorm_array_flag_grad_after_init(write_module: Loader) -> None:
    _, dec = pair(write_module, ACTNORM)
    f, states = dec.ActNormArr(3).functionalize()
    _, states = f(states, XA)
    g = jax.jit(jax.grad(lambda f: f(states, XA * 2)[0].sum()))(f)
    # after initialisation scale and bias are the states; a plain (x + b) * s has no params
    assert autostate.param_dict(g) == {}
    bias, scale = -XA.mean(0), 1.0 / (XA.std(0) + 1e-6)
    out, _ = f(states, XA * 2)
    assert_same(np.asarray((XA * 2 + bias) * scale), np.asarray(out))


# ======================================================================================
# 7. Trainer
# ======================================================================================

TRAINER = """
import optax


@DECORATE
class Model:
    def __init__(self, seed):
        k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
        self.w = jax.random.normal(k1, (3, 2)) * 0.5
        self.b = jnp.zeros(2)

    def __call__(self, x):
        return jnp.tanh(x @ self.w + self.b)

    def loss(self, x, y):
        return ((self(x) - y) ** 2).mean()


@DECORATE
class StateModel(Model):
    def __init__(self, seed):
        k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
        self.w = STATE(jax.random.normal(k1, (3, 2)) * 0.5)
        self.b = STATE(jnp.zeros(2))


@DECORATE
class Trainer:
    def __init__(self, seed, lr=0.1, cls=StateModel):
        self.model = cls(seed)
        self.opt = optax.adam(lr)
        self.opt_state = self.opt.init((self.model.w, self.model.b))
        self.step = jnp.zeros((), jnp.int32)

    def train_step(self, batch):
        x, y = batch
        loss, g = jax.value_and_grad(lambda m: m.loss(x, y))(self.model)
        grads = (g.w, g.b)
        upd, self.opt_state = self.opt.update(grads, self.opt_state)
        self.model.w = self.model.w + upd[0]
        self.model.b = self.model.b + upd[1]
        self.step += 1
        return loss

    def fit(self, xs, ys):
        _, losses = lax.scan(lambda c, b: (c, self.train_step(b)), None, (xs, ys))
        return losses


@DECORATE
class ParamTrainer:
    def __init__(self, seed, lr=0.1):
        self.model = Model(seed)
        self.opt = optax.sgd(lr)
        self.params = (self.model.w, self.model.b)
        self.opt_state = self.opt.init(self.params)
        self.step = jnp.zeros((), jnp.int32)

    def _loss(self, params, x, y):
        w, b = params
        return ((jnp.tanh(x @ w + b) - y) ** 2).mean()

    def train_step(self, batch):
        loss, g = jax.value_and_grad(self._loss)(self.params, *batch)
        upd, self.opt_state = self.opt.update(g, self.opt_state)
        self.params = optax.apply_updates(self.params, upd)
        self.step += 1
        return loss

    def fit(self, xs, ys):
        _, losses = lax.scan(lambda c, b: (c, self.train_step(b)), None, (xs, ys))
        return losses
"""

XS = jnp.arange(18.0).reshape(3, 2, 3) / 10.0
YS = jnp.sin(jnp.arange(12.0)).reshape(3, 2, 2)


def _hand_fit(seed: int, opt: Any) -> tuple[Any, Any]:
    k1, _ = jax.random.split(jax.random.PRNGKey(seed))
    p = (jax.random.normal(k1, (3, 2)) * 0.5, jnp.zeros(2))
    s = opt.init(p)

    def body(c, b):
        p, s = c
        lval, g = jax.value_and_grad(lambda p: ((jnp.tanh(b[0] @ p[0] + p[1]) - b[1]) ** 2).mean())(p)
        u, s = opt.update(g, s, p)
        return (optax.apply_updates(p, u), s), lval

    (p, s), losses = jax.lax.scan(body, (p, s), (XS, YS))
    return p, losses


def test_param_trainer_scan_over_batches(write_module: Loader) -> None:
    plain, dec = pair(write_module, TRAINER)
    check(plain, dec, "ParamTrainer(0)", [("fit", (XS, YS)), ("train_step", ((XS[0], YS[0]),))])
    outs, states, _ = run_f(dec, "ParamTrainer(0)", [("fit", (XS, YS))], jit=True)
    p, losses = _hand_fit(0, optax.sgd(0.1))
    assert_same(np.asarray(losses), np.asarray(outs[0]))
    assert_same([np.asarray(v) for v in p], [np.asarray(v) for v in states["params"]])


# ``jax.grad`` over the sub-model (a pytree only when decorated): no plain reference, so
# eager / f / jit are compared with the hand-threaded training loop.


def test_trainer_grad_over_sub_model_inside_a_method(write_module: Loader) -> None:
    _, dec = pair(write_module, TRAINER)
    p, losses = _hand_fit(0, optax.adam(0.1))
    calls = [("train_step", ((XS[i], YS[i]),)) for i in range(3)]
    for mode, (outs, states) in run_modes(dec, "Trainer(0)", calls,
                                          ["model.w", "model.b", "step"]).items():
        assert_same(np.asarray(losses), np.asarray(outs), f"{mode} losses")
        assert_same(np.asarray(p[0]), np.asarray(states["model.w"]), f"{mode} w")
        assert_same(np.asarray(p[1]), np.asarray(states["model.b"]), f"{mode} b")
        assert int(states["step"]) == 3, mode


def test_trainer_writing_sub_model_parameters_is_the_documented_error(write_module: Loader) -> None:
    # Model.w is a parameter (no method of Model assigns it); the Trainer assigning it
    # inside a functionalized call is the documented StateAccessError at the user's line
    _, dec = pair(write_module, TRAINER)
    p, losses = _hand_fit(0, optax.adam(0.1))
    model = dec.Trainer(0, cls=dec.Model)
    got = [model.train_step((XS[i], YS[i])) for i in range(3)]
    assert_same(np.asarray(losses), np.asarray(got), "eager losses")
    assert_same(np.asarray(p[0]), np.asarray(model.model.w), "eager w")
    f, states = dec.Trainer(0, cls=dec.Model).functionalize()
    with pytest.raises(autostate.errors.StateAccessError) as err:
        f.train_step(states, (XS[0], YS[0]))
    assert "Model.w is not state" in str(err.value)
    assert_user_line(err.value, dec.__file__.rsplit("/", 1)[-1])


def test_trainer_scan_over_batches_matches_hand_threaded(write_module: Loader) -> None:
    _, dec = pair(write_module, TRAINER)
    p, losses = _hand_fit(0, optax.adam(0.1))
    for mode, (outs, states) in run_modes(dec, "Trainer(0)", [("fit", (XS, YS))],
                                          ["model.w", "model.b", "step"]).items():
        assert_same(np.asarray(losses), np.asarray(outs[0]), f"{mode} losses")
        assert_same(np.asarray(p[0]), np.asarray(states["model.w"]), f"{mode} w")
        assert_same(np.asarray(p[1]), np.asarray(states["model.b"]), f"{mode} b")
        assert int(states["step"]) == 3, mode


# ======================================================================================
# 8. vmap over a sub-model method, jax.checkpoint around a block method
# ======================================================================================

VMAPCK = """
@DECORATE
class Counter:
    def __init__(self):
        self.w = jnp.array([1.0, 2.0])
        self.n = jnp.zeros((), jnp.int32)
        self.total = jnp.zeros(())

    def pure(self, x):
        return jnp.tanh(x * self.w)

    def counted(self, x):
        self.n += 1
        return x * self.w

    def summed(self, x):
        self.total = self.total + x.sum()
        return x * self.w


@DECORATE
class Block:
    def __init__(self, scale):
        self.w = jnp.eye(2) * scale
        self.mean = jnp.zeros(2)
        self.calls = jnp.zeros((), jnp.int32)

    def forward(self, x):
        self.mean = 0.5 * self.mean + 0.5 * x.mean(0)
        self.calls += 1
        return jnp.tanh(x @ self.w) + x


@DECORATE
class Net:
    def __init__(self):
        self.sub = Counter()
        self.blocks = [Block(0.5), Block(1.5)]

    def vmapped_pure(self, xs):
        return jax.vmap(self.sub.pure)(xs)

    def vmapped_writer(self, xs):
        return jax.vmap(self.sub.counted)(xs)

    def vmapped_batched_writer(self, xs):
        return jax.vmap(self.sub.summed)(xs)

    def __call__(self, x):
        for b in self.blocks:
            x = checkpoint(b.forward)(x)
        return x

    def loss(self, x):
        return (self(x) ** 2).sum()
"""

XB = jnp.array([[0.1, 0.2], [0.3, -0.4], [1.0, 0.5]])


def test_vmap_over_a_pure_sub_model_method(write_module: Loader) -> None:
    plain, dec = pair(write_module, VMAPCK)
    check(plain, dec, "Net()", [("vmapped_pure", (XB,)), ("vmapped_pure", (XB * 2,))])


def test_vmap_over_a_sub_model_method_writing_an_unbatched_value(write_module: Loader) -> None:
    # plain Python traces the method once; n + 1 is concrete, so n becomes 1 per call
    plain, dec = pair(write_module, VMAPCK)
    check(plain, dec, "Net()", [("vmapped_writer", (XB,)), ("vmapped_writer", (XB * 2,))])


@pytest.mark.parametrize("mode", ["eager", "f", "jit"])
def test_vmap_over_a_writing_sub_model_method_is_documented_error(write_module: Loader,
                                                                  mode: str) -> None:
    _, dec = pair(write_module, VMAPCK)
    model = dec.Net()
    with pytest.raises(autostate.AutostateError) as err:
        if mode == "eager":
            model.vmapped_batched_writer(XB)
            model.sub.total + 0  # noqa: B018
        else:
            f, states = model.functionalize()
            call = lambda f, s: f.vmapped_batched_writer(s, XB)  # noqa: E731
            out, states = (jax.jit(call) if mode == "jit" else call)(f, states)
            states["sub.total"] + 0  # noqa: B018
    assert type(err.value).__name__ in ("EscapedStateError", "TracedEagerStateError"), err.value
    assert "total" in str(err.value)


def test_checkpoint_around_block_methods(write_module: Loader) -> None:
    plain, dec = pair(write_module, VMAPCK)
    check(plain, dec, "Net()", [("__call__", (XB,)), ("loss", (XB * 2,))])


def test_checkpoint_grad_matches_without_remat(write_module: Loader) -> None:
    _, dec = pair(write_module, VMAPCK)
    f, states = dec.Net().functionalize()
    g, s2 = jax.jit(jax.grad(lambda f: f.loss(states, XB), has_aux=True))(f)

    def hand(ws, x):
        means = []
        for w in ws:
            means.append(0.5 * x.mean(0))
            x = jnp.tanh(x @ w) + x
        return (x**2).sum(), means

    ws = [jnp.eye(2) * 0.5, jnp.eye(2) * 1.5]
    hg, means = jax.grad(hand, has_aux=True)(ws, XB)
    assert_same(np.asarray(hg[0]), np.asarray(g.model.blocks[0].w) if hasattr(g, "model")
                else np.asarray(autostate.param_dict(g)["blocks[0].w"]))
    assert_same(np.asarray(hg[1]), np.asarray(autostate.param_dict(g)["blocks[1].w"]))
    assert_same(np.asarray(means[1]), np.asarray(s2["blocks[1].mean"]))
    assert int(s2["blocks[0].calls"]) == 1


# ======================================================================================
# 9. An EMA state aliased to a parameter; an LR schedule written into optax's state
# ======================================================================================

EMA_LR = """
import optax


@DECORATE
class EMA:
    def __init__(self):
        self.w = jnp.array([1.0, 2.0])
        self.ema_w = self.w
        self.step = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        return (x * self.w).sum()

    def update_ema(self):
        self.ema_w = 0.5 * self.ema_w + 0.5 * self.w
        self.step += 1


@DECORATE
class Scheduled:
    def __init__(self):
        self.w = jnp.array([1.0, 2.0])
        self.opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
        self.opt_state = self.opt.init(self.w)

    def step(self, x):
        hp = self.opt_state.hyperparams
        hp["learning_rate"] = hp["learning_rate"] * 0.5
        g = jax.grad(lambda w: (jnp.sin(w) * x).sum())(self.w)
        u, self.opt_state = self.opt.update(g, self.opt_state)
        self.w = self.w + u
        return self.w
"""


def test_ema_state_aliased_to_a_parameter_trained_through_f(write_module: Loader) -> None:
    _, dec = pair(write_module, EMA_LR)
    f, states = dec.EMA().functionalize()
    assert sorted(states) == ["ema_w", "step"] and list(autostate.param_dict(f)) == ["w"]
    w, ema = jnp.array([1.0, 2.0]), jnp.array([1.0, 2.0])
    step = jax.jit(lambda f, s, x: (jax.tree_util.tree_map(
        lambda a, b: a - 0.1 * b, f, jax.grad(lambda f: f(s, x)[0])(f)), s))
    for x in (jnp.ones(2), jnp.array([2.0, -1.0])):
        f, states = step(f, states, x)
        _, states = jax.jit(lambda f, s: f.update_ema(s))(f, states)
        w = w - 0.1 * x
        ema = 0.5 * ema + 0.5 * w
    assert_same(np.asarray(w), np.asarray(autostate.param_dict(f)["w"]), "w")
    assert_same(np.asarray(ema), np.asarray(states["ema_w"]), "ema_w")
    frozen = autostate.freeze(f, states)
    assert frozen.w is not frozen.ema_w and int(frozen.step) == 2


def test_lr_schedule_written_into_optax_state_in_place(write_module: Loader) -> None:
    plain, dec = pair(write_module, EMA_LR)
    check(plain, dec, "Scheduled()", [("step", (jnp.ones(2),)), ("step", (jnp.array([2.0, -1.0]),)),
                                     ("step", (jnp.ones(2),))])


NT_STATE = """
class Hyper(typing.NamedTuple):
    count: typing.Any
    hp: dict


@DECORATE
class Holder:
    def __init__(self, named):
        d = {"lr": jnp.array(0.1)}
        self.s = Hyper(jnp.zeros((), jnp.int32), d) if named else (jnp.zeros((), jnp.int32), d)

    def step(self):
        hp = self.s[1]
        hp["lr"] = hp["lr"] * 0.5
        self.s = self.s
        return hp["lr"]
"""


@pytest.mark.parametrize("named", [False, True], ids=["tuple", "named_tuple"])
def test_dict_in_a_tuple_state_changed_in_place_leaves_callers_states(write_module: Loader,
                                                                     named: bool) -> None:
    _, dec = pair(write_module, NT_STATE)
    model = dec.Holder(named)
    f, states = model.functionalize()
    out, new = f.step(states)
    np.testing.assert_allclose(np.asarray(out), 0.05)
    np.testing.assert_allclose(np.asarray(new["s"][1]["lr"]), 0.05)
    np.testing.assert_allclose(np.asarray(states["s"][1]["lr"]), 0.1, err_msg="caller's states")
    np.testing.assert_allclose(np.asarray(model.s[1]["lr"]), 0.1, err_msg="eager model")
