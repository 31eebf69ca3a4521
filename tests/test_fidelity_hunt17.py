"""Differential bug hunt 17: realistic models trained and served end to end,
compared number for number with the same model written in hand-threaded JAX
(parameters and states passed explicitly as dicts) and with the plain class.

- A small GPT-style decoder (embedding, two blocks of causal attention + MLP
  with LayerNorm) whose KV cache and int32 position are states: prefill and
  greedy decoding in a Python loop eagerly, through ``f`` step by step under
  ``jax.jit``, inside ``lax.fori_loop`` / ``lax.scan`` over steps in a method,
  sampling with a PRNG key state split every step, decoding vmapped over
  prompts, next-token training with ``jax.value_and_grad`` over ``f``.
- A CNN with BatchNorm (``training`` a static Python-bool state; running
  statistics as states) trained with ``optax.adam`` through
  ``jax.value_and_grad`` over ``f``, eagerly and jitted, then evaluated after
  ``eval()``, and switched back to training.
- LSTM and GRU cells unrolled with ``lax.scan`` over bound methods (a step
  counter and a running mean of ``h`` as states), a stateful GRU carrying its
  hidden state across calls (truncated BPTT with ``stop_gradient``), reverse
  scans, trained with ``jax.grad``; vmapped over a batch.
- Dropout with a PRNG key state split every call: typed ``jax.random.key``
  and raw ``PRNGKey`` keys, ``split(key, 3)`` unpacked into targets,
  ``fold_in`` with a step counter, inside ``lax.scan``, under ``grad`` and
  ``vmap``; the exact random streams against hand-threaded code.
- Ensembles: ``jax.vmap`` of the constructor + ``functionalize`` and models
  stacked by hand, trained under ``vmap`` and taken apart with ``freeze``; a
  stacked sub-model (``jax.vmap(Layer)(keys)``) held by a model and used
  inside its methods through ``jax.vmap``, ``lax.scan`` over layers and
  ``tree_map`` slicing.
- Gradient checkpointing: ``jax.checkpoint`` of a sub-model and of a closure
  in a block, ``@autostate.checkpoint`` on a method, a ``policy``, remat
  inside a ``lax.scan`` body, with dropout keys written inside the remat.
- Saving mid-training (``state_dict`` / ``param_dict`` / ``freeze`` +
  ``pickle`` / ``autostate.save`` + ``load``, optimizer state kept) and
  resuming: results identical to an uninterrupted run.

Each source is written plain and decorated (``differential.pair``; ``lax.*``
is a Python loop in the plain module). The hand-threaded references are pure
functions of ``(params, states, ...)`` below, written with the same
initialization and op order. A case that shows a mismatch stays, marked
``xfail(strict=True)`` with what differs.
"""

from __future__ import annotations

import functools
import pickle
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from differential import (  # noqa: I001 - tests/ is on sys.path
    assert_same,
    assert_user_line,
    pair,
    plain_path,
    snapshot,
)

import autostate

Loader = Callable[..., types.ModuleType]


def assert_bits(expected: Any, got: Any, where: str = "") -> None:
    """Same structure, dtypes and bits (typed keys compared by their key data)."""
    e_leaves, e_tree = jax.tree_util.tree_flatten(expected)
    g_leaves, g_tree = jax.tree_util.tree_flatten(got)
    assert e_tree == g_tree, f"{where}: {e_tree} != {g_tree}"
    for i, (a, b) in enumerate(zip(e_leaves, g_leaves)):
        a, b = jnp.asarray(a), jnp.asarray(b)
        assert a.dtype == b.dtype, f"{where}[{i}]: dtype {a.dtype} != {b.dtype}"
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{where}[{i}]")


def read_plain(model: Any, keys: Any) -> dict[str, Any]:
    return {k: plain_path(model, k) for k in keys}


def params_of(f: Any) -> dict[str, Any]:
    return dict(autostate.param_dict(f))


@functools.cache
def jitted(method: str, *static: Any) -> Callable[..., Any]:
    """``f.<method>(states, *args, *static)`` under ``jax.jit``, one per method (shared by tests)."""

    def call(f: Any, s: Any, *a: Any) -> Any:
        return (f if method == "__call__" else getattr(f, method))(s, *a, *static)

    return jax.jit(call)


# ======================================================================================
# 1. A GPT-style decoder with a KV cache
# ======================================================================================

GPT = """
@DECORATE
class LayerNorm:
    def __init__(self, d):
        self.scale = jnp.ones(d)
        self.bias = jnp.zeros(d)

    def __call__(self, x):
        m = x.mean(-1, keepdims=True)
        v = x.var(-1, keepdims=True)
        return (x - m) / jnp.sqrt(v + 1e-5) * self.scale + self.bias


@DECORATE
class Attention:
    def __init__(self, key, d, length):
        kq, kk, kv, ko = jax.random.split(key, 4)
        self.wq = jax.random.normal(kq, (d, d)) / np.sqrt(d)
        self.wk = jax.random.normal(kk, (d, d)) / np.sqrt(d)
        self.wv = jax.random.normal(kv, (d, d)) / np.sqrt(d)
        self.wo = jax.random.normal(ko, (d, d)) / np.sqrt(d)
        self.k = jnp.zeros((length, d))
        self.v = jnp.zeros((length, d))

    def __call__(self, x, pos):
        q = x @ self.wq
        self.k = jax.lax.dynamic_update_slice_in_dim(self.k, x @ self.wk, pos, 0)
        self.v = jax.lax.dynamic_update_slice_in_dim(self.v, x @ self.wv, pos, 0)
        qpos = pos + jnp.arange(x.shape[0])
        mask = jnp.arange(self.k.shape[0])[None, :] <= qpos[:, None]
        s = jnp.where(mask, q @ self.k.T / np.sqrt(x.shape[-1]), -1e9)
        return jax.nn.softmax(s, axis=-1) @ self.v @ self.wo

    def reset(self):
        self.k = jnp.zeros_like(self.k)
        self.v = jnp.zeros_like(self.v)


@DECORATE
class MLP:
    def __init__(self, key, d):
        k1, k2 = jax.random.split(key)
        self.w1 = jax.random.normal(k1, (d, 2 * d)) / np.sqrt(d)
        self.b1 = jnp.zeros(2 * d)
        self.w2 = jax.random.normal(k2, (2 * d, d)) / np.sqrt(2 * d)
        self.b2 = jnp.zeros(d)

    def __call__(self, x):
        return jax.nn.gelu(x @ self.w1 + self.b1) @ self.w2 + self.b2


@DECORATE
class Block:
    def __init__(self, key, d, length):
        ka, km = jax.random.split(key)
        self.ln1 = LayerNorm(d)
        self.attn = Attention(ka, d, length)
        self.ln2 = LayerNorm(d)
        self.mlp = MLP(km, d)

    def __call__(self, x, pos):
        x = x + self.attn(self.ln1(x), pos)
        return x + self.mlp(self.ln2(x))


@DECORATE
class GPT:
    def __init__(self, seed, vocab=11, d=8, length=16, n_blocks=2):
        ke, kp, kh, *kb = jax.random.split(jax.random.PRNGKey(seed), 3 + n_blocks)
        self.embed = jax.random.normal(ke, (vocab, d)) * 0.5
        self.pos_embed = jax.random.normal(kp, (length, d)) * 0.1
        self.blocks = [Block(k, d, length) for k in kb]
        self.ln_f = LayerNorm(d)
        self.head = jax.random.normal(kh, (d, vocab)) / np.sqrt(d)
        self.pos = jnp.zeros((), jnp.int32)
        self.rng = jax.random.key(seed + 100)

    def __call__(self, tokens):
        pos = self.pos
        x = self.embed[tokens] + jax.lax.dynamic_slice_in_dim(self.pos_embed, pos, tokens.shape[0])
        for block in self.blocks:
            x = block(x, pos)
        self.pos = pos + tokens.shape[0]
        return self.ln_f(x) @ self.head

    def reset(self):
        for block in self.blocks:
            block.attn.reset()
        self.pos = jnp.zeros((), jnp.int32)

    def next_token(self, tokens):
        return jnp.argmax(self(tokens)[-1]).astype(jnp.int32)

    def greedy(self, prompt, steps):
        tok = self.next_token(prompt)
        out = [tok]
        for _ in range(steps - 1):
            tok = self.next_token(tok[None])
            out.append(tok)
        return jnp.stack(out)

    def greedy_fori(self, prompt, steps):
        tok = self.next_token(prompt)
        out = jnp.zeros(steps, jnp.int32).at[0].set(tok)

        def body(i, carry):
            tok, out = carry
            tok = self.next_token(tok[None])
            return tok, out.at[i].set(tok)

        return lax.fori_loop(1, steps, body, (tok, out))[1]

    def greedy_scan(self, prompt, steps):
        first = self.next_token(prompt)

        def body(tok, _):
            nxt = self.next_token(tok[None])
            return nxt, nxt

        _, rest = lax.scan(body, first, None, length=steps - 1)
        return jnp.concatenate([first[None], rest])

    def sample_fori(self, prompt, steps, temperature):
        logits = self(prompt)[-1]
        out = jnp.zeros(steps, jnp.int32)

        def body(i, carry):
            logits, out = carry
            self.rng, sub = jax.random.split(self.rng)
            tok = jax.random.categorical(sub, logits / temperature).astype(jnp.int32)
            return self(tok[None])[-1], out.at[i].set(tok)

        return lax.fori_loop(0, steps, body, (logits, out))[1]

    def loss(self, seq):
        logits = self(seq[:-1])
        logp = jax.nn.log_softmax(logits)
        return -jnp.take_along_axis(logp, seq[1:, None], axis=1).mean()
"""

N_BLOCKS = 2


def ref_ln(p: dict[str, Any], pre: str, x: Any) -> Any:
    m = x.mean(-1, keepdims=True)
    v = x.var(-1, keepdims=True)
    return (x - m) / jnp.sqrt(v + 1e-5) * p[pre + "scale"] + p[pre + "bias"]


def ref_gpt(p: dict[str, Any], s: dict[str, Any], tokens: Any) -> tuple[Any, dict[str, Any]]:
    """The decoder by hand: params and the cache threaded explicitly."""
    s = dict(s)
    pos = s["pos"]
    t = tokens.shape[0]
    x = p["embed"][tokens] + jax.lax.dynamic_slice_in_dim(p["pos_embed"], pos, t)
    for i in range(N_BLOCKS):
        b = f"blocks[{i}]."
        h = ref_ln(p, b + "ln1.", x)
        q = h @ p[b + "attn.wq"]
        k = jax.lax.dynamic_update_slice_in_dim(s[b + "attn.k"], h @ p[b + "attn.wk"], pos, 0)
        v = jax.lax.dynamic_update_slice_in_dim(s[b + "attn.v"], h @ p[b + "attn.wv"], pos, 0)
        s[b + "attn.k"], s[b + "attn.v"] = k, v
        qpos = pos + jnp.arange(t)
        mask = jnp.arange(k.shape[0])[None, :] <= qpos[:, None]
        sc = jnp.where(mask, q @ k.T / np.sqrt(h.shape[-1]), -1e9)
        x = x + jax.nn.softmax(sc, axis=-1) @ v @ p[b + "attn.wo"]
        h = ref_ln(p, b + "ln2.", x)
        m = b + "mlp."
        x = x + jax.nn.gelu(h @ p[m + "w1"] + p[m + "b1"]) @ p[m + "w2"] + p[m + "b2"]
    s["pos"] = pos + t
    return ref_ln(p, "ln_f.", x) @ p["head"], s


def ref_next(p: dict[str, Any], s: dict[str, Any], tokens: Any) -> tuple[Any, dict[str, Any]]:
    logits, s = ref_gpt(p, s, tokens)
    return jnp.argmax(logits[-1]).astype(jnp.int32), s


def ref_greedy(p: dict[str, Any], s: dict[str, Any], prompt: Any, steps: int) -> Any:
    tok, s = ref_next(p, s, prompt)
    out = [tok]
    for _ in range(steps - 1):
        tok, s = ref_next(p, s, tok[None])
        out.append(tok)
    return jnp.stack(out), s


def ref_greedy_fori(p: dict[str, Any], s: dict[str, Any], prompt: Any, steps: int) -> Any:
    tok, s = ref_next(p, s, prompt)
    out = jnp.zeros(steps, jnp.int32).at[0].set(tok)

    def body(i: Any, carry: Any) -> Any:
        tok, out, s = carry
        tok, s = ref_next(p, s, tok[None])
        return tok, out.at[i].set(tok), s

    _, out, s = jax.lax.fori_loop(1, steps, body, (tok, out, s))
    return out, s


def ref_sample(p: dict[str, Any], s: dict[str, Any], prompt: Any, steps: int, temp: float) -> Any:
    logits, s = ref_gpt(p, s, prompt)
    logits = logits[-1]
    out = jnp.zeros(steps, jnp.int32)

    def body(i: Any, carry: Any) -> Any:
        logits, out, s = carry
        s = dict(s)
        s["rng"], sub = jax.random.split(s["rng"])
        tok = jax.random.categorical(sub, logits / temp).astype(jnp.int32)
        logits, s = ref_gpt(p, s, tok[None])
        return logits[-1], out.at[i].set(tok), s

    _, out, s = jax.lax.fori_loop(0, steps, body, (logits, out, s))
    return out, s


def ref_gpt_loss(p: dict[str, Any], s: dict[str, Any], seq: Any) -> Any:
    logits, s = ref_gpt(p, s, seq[:-1])
    logp = jax.nn.log_softmax(logits)
    return -jnp.take_along_axis(logp, seq[1:, None], axis=1).mean(), s


PROMPT = jnp.array([3, 4, 5], jnp.int32)


def gpt(write_module: Loader, seed: int = 0) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
    """(plain model, decorated model, f, states, params by name) for one seed."""
    plain, dec = pair(write_module, GPT)
    ref = plain.GPT(seed)
    model = dec.GPT(seed)
    f, states = model.functionalize()
    p = params_of(f)
    assert_same(read_plain(ref, p), p, "initial params")
    assert_same(snapshot(read_plain(ref, states)), snapshot(states), "initial states")
    return ref, model, f, states, p


def test_gpt_state_and_param_names(write_module: Loader) -> None:
    _, model, f, states, p = gpt(write_module)
    assert sorted(states) == sorted(
        ["pos", "rng"] + [f"blocks[{i}].attn.{n}" for i in range(N_BLOCKS) for n in "kv"]
    )
    assert "embed" in p and "blocks[1].mlp.w2" in p and "pos" not in p
    assert_bits(states, autostate.state_dict(model))


def test_gpt_greedy_python_loop_eager_vs_plain_vs_hand_threaded(write_module: Loader) -> None:
    ref, model, _, states, p = gpt(write_module)
    want, want_s = ref_greedy(p, states, PROMPT, 5)
    assert_same(want, ref.greedy(PROMPT, 5), "plain vs hand-threaded")
    assert_same(want, model.greedy(PROMPT, 5), "eager decorated")
    assert_same(snapshot(want_s), snapshot(autostate.state_dict(model)), "eager states")
    assert_same(snapshot(ref), snapshot(model), "eager attributes")
    assert int(model.pos) == 3 + 4


def test_gpt_greedy_through_jitted_f_step_by_step(write_module: Loader) -> None:
    _, _, f, states, p = gpt(write_module)
    want, want_s = ref_greedy(p, states, PROMPT, 4)
    step = jitted("next_token")
    tok, states = step(f, states, PROMPT)
    out = [tok]
    for _ in range(3):
        tok, states = step(f, states, tok[None])
        out.append(tok)
    assert_bits(want, jnp.stack(out), "tokens")
    assert_same(snapshot(want_s), snapshot(states), "cache")


@pytest.mark.parametrize("method", ["greedy_fori", "greedy_scan"])
def test_gpt_greedy_loop_inside_a_method(write_module: Loader, method: str) -> None:
    ref, model, f, states, p = gpt(write_module)
    want, want_s = ref_greedy_fori(p, states, PROMPT, 4)
    assert_bits(want, ref_greedy(p, states, PROMPT, 4)[0], "hand-threaded fori vs loop")
    assert_same(want, getattr(ref, method)(PROMPT, 4), "plain")
    out, s1 = getattr(f, method)(states, PROMPT, 4)
    assert_bits(want, out, "f eager")
    assert_same(snapshot(want_s), snapshot(s1), "f states")
    out, s2 = jitted(method, 4)(f, states, PROMPT)
    assert_bits(want, out, "jit")
    assert_same(snapshot(want_s), snapshot(s2), "jit states")
    assert_same(want, getattr(model, method)(PROMPT, 4), "decorated eager")
    assert_same(snapshot(ref), snapshot(model), "eager attributes")


def test_gpt_sampling_with_a_key_state_in_fori_loop(write_module: Loader) -> None:
    ref, model, f, states, p = gpt(write_module, seed=1)
    want, want_s = ref_sample(p, states, PROMPT, 3, 0.7)
    out, s = jitted("sample_fori", 3, 0.7)(f, states, PROMPT)
    assert_bits(want, out, "sampled tokens")
    assert_bits(want_s["rng"], s["rng"], "key after sampling")
    assert_same(snapshot(want_s), snapshot(s), "states")
    assert_bits(out, model.sample_fori(PROMPT, 3, 0.7), "decorated eager")
    assert_bits(out, ref.sample_fori(PROMPT, 3, 0.7), "plain")
    assert_bits(want_s["rng"], model.rng, "eager key")


def test_gpt_reset_then_decode_again_through_f(write_module: Loader) -> None:
    _, _, f, states, p = gpt(write_module)
    run = jitted("greedy_fori", 4)
    first, s = run(f, states, PROMPT)
    _, s = jitted("reset")(f, s)
    assert_same(snapshot(states), snapshot(s), "reset gives the empty cache")
    again, s = run(f, s, PROMPT)
    assert_bits(first, again)
    assert_bits(ref_greedy(p, states, PROMPT, 4)[0], again)


def test_gpt_cached_decode_matches_full_recompute(write_module: Loader) -> None:
    _, _, f, states, _ = gpt(write_module)
    toks, s = jitted("greedy_scan", 4)(f, states, PROMPT)
    full = jnp.concatenate([PROMPT, toks[:-1]])
    logits, _ = jitted("__call__")(f, states, full)
    assert_bits(toks, jnp.argmax(logits[2:], -1).astype(jnp.int32))


def test_gpt_decoding_vmapped_over_prompts(write_module: Loader) -> None:
    _, _, f, states, p = gpt(write_module)
    prompts = jnp.array([[3, 4, 5], [1, 2, 3], [7, 0, 9]], jnp.int32)
    want, want_s = jax.vmap(lambda t: ref_greedy_fori(p, states, t, 4))(prompts)
    got, got_s = jax.jit(jax.vmap(lambda t: f.greedy_fori(states, t, 4)))(prompts)
    assert_bits(want, got, "tokens")
    assert_same(snapshot(want_s), snapshot(got_s), "batched caches")


def test_gpt_next_token_training_with_adam(write_module: Loader) -> None:
    _, _, f, empty, p = gpt(write_module)
    seqs = [jnp.arange(i, i + 7, dtype=jnp.int32) % 11 for i in range(3)]
    opt = optax.adam(1e-2)

    @jax.jit
    def step(f: Any, o: Any, seq: Any) -> Any:
        (loss, _), g = jax.value_and_grad(lambda f: f.loss(empty, seq), has_aux=True)(f)
        u, o = opt.update(g, o, f)
        return loss, optax.apply_updates(f, u), o

    @jax.jit
    def ref_step(p: Any, o: Any, seq: Any) -> Any:
        (loss, _), g = jax.value_and_grad(ref_gpt_loss, has_aux=True)(p, empty, seq)
        u, o = opt.update(g, o, p)
        return loss, optax.apply_updates(p, u), o

    o, ro = opt.init(f), opt.init(p)
    for i, seq in enumerate(seqs):
        loss, f, o = step(f, o, seq)
        rloss, p, ro = ref_step(p, ro, seq)
        assert_same(rloss, loss, f"loss {i}")
        assert_same(p, params_of(f), f"params {i}")
    want, _ = ref_greedy(p, empty, PROMPT, 4)
    trained = autostate.freeze(f, empty)
    assert_bits(want, jitted("greedy_fori", 4)(*trained.functionalize(), PROMPT)[0], "decodes")


# ======================================================================================
# 2. A CNN with BatchNorm trained with optax adam
# ======================================================================================

CNN = """
@DECORATE
class BatchNorm:
    def __init__(self, c, momentum=0.9):
        self.scale = jnp.ones(c)
        self.bias = jnp.zeros(c)
        self.mean = jnp.zeros(c)
        self.var = jnp.ones(c)
        self.momentum = momentum
        self.training = True

    def __call__(self, x):
        if self.training:
            m = x.mean((0, 1, 2))
            v = x.var((0, 1, 2))
            self.mean = self.momentum * self.mean + (1 - self.momentum) * m
            self.var = self.momentum * self.var + (1 - self.momentum) * v
        else:
            m, v = self.mean, self.var
        return (x - m) / jnp.sqrt(v + 1e-5) * self.scale + self.bias

    def eval(self):
        self.training = False

    def train(self):
        self.training = True


@DECORATE
class CNN:
    def __init__(self, seed, c=4, classes=3):
        k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
        self.conv = jax.random.normal(k1, (3, 3, 1, c)) * 0.3
        self.bn = BatchNorm(c)
        self.head = jax.random.normal(k2, (c, classes)) * 0.3
        self.head_b = jnp.zeros(classes)
        self.steps = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        y = jax.lax.conv_general_dilated(x, self.conv, (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        y = jax.nn.relu(self.bn(y))
        if self.bn.training:
            self.steps += 1
        return y.mean((1, 2)) @ self.head + self.head_b

    def eval(self):
        self.bn.eval()

    def train(self):
        self.bn.train()

    def loss(self, x, labels):
        logits = self(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
"""


def ref_cnn(p: dict[str, Any], s: dict[str, Any], x: Any, training: bool) -> Any:
    s = dict(s)
    y = jax.lax.conv_general_dilated(
        x, p["conv"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    if training:
        m = y.mean((0, 1, 2))
        v = y.var((0, 1, 2))
        s["bn.mean"] = 0.9 * s["bn.mean"] + (1 - 0.9) * m
        s["bn.var"] = 0.9 * s["bn.var"] + (1 - 0.9) * v
        s["steps"] = s["steps"] + 1
    else:
        m, v = s["bn.mean"], s["bn.var"]
    y = jax.nn.relu((y - m) / jnp.sqrt(v + 1e-5) * p["bn.scale"] + p["bn.bias"])
    return y.mean((1, 2)) @ p["head"] + p["head_b"], s


def ref_cnn_loss(p: dict[str, Any], s: dict[str, Any], x: Any, labels: Any) -> Any:
    logits, s = ref_cnn(p, s, x, True)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), s


def images(i: int, n: int = 4) -> tuple[Any, Any]:
    kx, ky = jax.random.split(jax.random.PRNGKey(50 + i))
    return jax.random.normal(kx, (n, 5, 5, 1)), jax.random.randint(ky, (n,), 0, 3)


def cnn(write_module: Loader) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
    plain, dec = pair(write_module, "import optax\n" + CNN)
    ref, model = plain.CNN(0), dec.CNN(0)
    f, states = model.functionalize()
    p = params_of(f)
    assert_same(read_plain(ref, p), p, "initial params")
    return ref, model, f, states, p


ADAM = optax.adam(3e-2)


def f_step(f: Any, o: Any, s: Any, x: Any, y: Any) -> Any:
    (loss, s), g = jax.value_and_grad(lambda f, s: f.loss(s, x, y), has_aux=True)(f, s)
    u, o = ADAM.update(g, o, f)
    return loss, optax.apply_updates(f, u), o, s


def r_step(p: Any, o: Any, s: Any, x: Any, y: Any) -> Any:
    (loss, s), g = jax.value_and_grad(ref_cnn_loss, has_aux=True)(p, s, x, y)
    u, o = ADAM.update(g, o, p)
    return loss, optax.apply_updates(p, u), o, s


JF_STEP, JR_STEP = jax.jit(f_step), jax.jit(r_step)


def train_both(
    f: Any, s: Any, p: Any, steps: range, jit: bool = True, o: Any = None, ro: Any = None
) -> Any:
    fs, rs = (JF_STEP, JR_STEP) if jit else (f_step, r_step)
    rsd = dict(s)
    o = ADAM.init(f) if o is None else o
    ro = ADAM.init(p) if ro is None else ro
    for i in steps:
        x, y = images(i)
        loss, f, o, s = fs(f, o, s, x, y)
        rloss, p, ro, rsd = rs(p, ro, rsd, x, y)
        assert_same(rloss, loss, f"loss {i}")
        assert_same(p, params_of(f), f"params {i}")
        assert_same(rsd, dict(s), f"states {i}")
    return f, s, p, o, ro


@pytest.mark.parametrize("jit", [True, False])
def test_cnn_adam_training_matches_hand_threaded(write_module: Loader, jit: bool) -> None:
    _, _, f, s, p = cnn(write_module)
    f, s, p, _, _ = train_both(f, s, p, range(3 if jit else 2), jit=jit)
    assert int(s["steps"]) == (3 if jit else 2)


def test_cnn_eval_after_training_uses_running_stats(write_module: Loader) -> None:
    ref, _, f, s, p = cnn(write_module)
    f, s, p, _, _ = train_both(f, s, p, range(3))
    trained = autostate.freeze(f, s)
    trained.eval()
    assert trained.bn.training is False
    fe, se = trained.functionalize()
    x, _ = images(9)
    want, want_s = ref_cnn(p, dict(s), x, False)
    out, s2 = jitted("__call__")(fe, se, x)
    assert_same(want, out, "jitted eval")
    assert_bits(dict(s), dict(s2), "eval leaves the states alone")
    assert_same(want, trained(x), "eager eval")
    # the plain class holding the trained values, run eagerly
    for k, v in {**p, **dict(s)}.items():
        exec(f"m.{k} = v", {"m": ref, "v": v})  # noqa: S102
    ref.eval()
    assert_same(want, ref(x), "plain eval")


def test_cnn_train_eval_train_switches_continue_like_hand_threaded(write_module: Loader) -> None:
    _, model, f, s, p = cnn(write_module)
    f, s, p, o, ro = train_both(f, s, p, range(2))
    m = autostate.freeze(f, s)
    m.eval()
    fe, se = m.functionalize()
    x, _ = images(7)
    out, se = jitted("__call__")(fe, se, x)
    assert_same(ref_cnn(p, dict(s), x, False)[0], out)
    m.train()
    f2, s2 = m.functionalize()
    assert jax.tree_util.tree_structure(f2) == jax.tree_util.tree_structure(f)
    train_both(f2, s2, p, range(2, 4), o=o, ro=ro)


def test_cnn_eval_mode_is_a_new_structure_of_f(write_module: Loader) -> None:
    _, model, f, s, _ = cnn(write_module)
    model.eval()
    fe, _ = model.functionalize()
    assert jax.tree_util.tree_structure(fe) != jax.tree_util.tree_structure(f)
    traces = []

    @jax.jit
    def run(f: Any, s: Any, x: Any) -> Any:
        traces.append(1)
        return f(s, x)

    x, _ = images(0)
    run(f, s, x)
    run(fe, s, x)
    run(f, s, x)
    run(fe, s, x)
    assert len(traces) == 2


# ======================================================================================
# 3. LSTM / GRU cells unrolled with lax.scan over bound methods
# ======================================================================================

RNN = """
@DECORATE
class LSTM:
    def __init__(self, seed, n_in=3, n=4):
        k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
        self.wx = jax.random.normal(k1, (n_in, 4 * n)) * 0.4
        self.wh = jax.random.normal(k2, (n, 4 * n)) * 0.4
        self.b = jnp.zeros(4 * n)
        self.n = n
        self.steps = jnp.zeros((), jnp.int32)
        self.hmean = jnp.zeros(n)

    def _step(self, carry, x):
        h, c = carry
        z = x @ self.wx + h @ self.wh + self.b
        i, f, g, o = jnp.split(z, 4)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        self.steps += 1
        self.hmean = 0.9 * self.hmean + 0.1 * h
        return (h, c), h

    def __call__(self, xs):
        zero = jnp.zeros(self.n)
        (h, c), hs = lax.scan(self._step, (zero, zero), xs)
        return hs

    def backward(self, xs):
        zero = jnp.zeros(self.n)
        return lax.scan(self._step, (zero, zero), xs, reverse=True)[1]


@DECORATE
class GRU:
    def __init__(self, seed, n_in=3, n=4):
        k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
        self.wx = jax.random.normal(k1, (n_in, 3 * n)) * 0.4
        self.wh = jax.random.normal(k2, (n, 2 * n)) * 0.4
        self.wc = jax.random.normal(k3, (n, n)) * 0.4
        self.h = jnp.zeros(n)

    def cell(self, h, x):
        zx, rx, cx = jnp.split(x @ self.wx, 3)
        zh, rh = jnp.split(h @ self.wh, 2)
        z = jax.nn.sigmoid(zx + zh)
        r = jax.nn.sigmoid(rx + rh)
        return (1 - z) * h + z * jnp.tanh(cx + (r * h) @ self.wc)

    def __call__(self, xs):
        h = jax.lax.stop_gradient(self.h)
        h, hs = lax.scan(lambda h, x: (self.cell(h, x),) * 2, h, xs)
        self.h = h
        return hs


@DECORATE
class BiLSTM:
    def __init__(self, seed):
        self.fwd = LSTM(seed)
        self.bwd = LSTM(seed + 1)
        self.head = jnp.ones((8, 1)) * 0.3

    def __call__(self, xs):
        hs = jnp.concatenate([self.fwd(xs), self.bwd.backward(xs)], -1)
        return (hs @ self.head)[:, 0]
"""


def ref_lstm(
    p: dict[str, Any], s: dict[str, Any], xs: Any, pre: str = "", reverse: bool = False
) -> Any:
    def step(carry: Any, x: Any) -> Any:
        h, c, steps, hmean = carry
        z = x @ p[pre + "wx"] + h @ p[pre + "wh"] + p[pre + "b"]
        i, f, g, o = jnp.split(z, 4)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (h, c, steps + 1, 0.9 * hmean + 0.1 * h), h

    zero = jnp.zeros(4)
    (_, _, steps, hmean), hs = jax.lax.scan(
        step, (zero, zero, s[pre + "steps"], s[pre + "hmean"]), xs, reverse=reverse
    )
    return hs, {**s, pre + "steps": steps, pre + "hmean": hmean}


def ref_gru(p: dict[str, Any], s: dict[str, Any], xs: Any) -> Any:
    def cell(h: Any, x: Any) -> Any:
        zx, rx, cx = jnp.split(x @ p["wx"], 3)
        zh, rh = jnp.split(h @ p["wh"], 2)
        z = jax.nn.sigmoid(zx + zh)
        r = jax.nn.sigmoid(rx + rh)
        h = (1 - z) * h + z * jnp.tanh(cx + (r * h) @ p["wc"])
        return h, h

    h, hs = jax.lax.scan(cell, jax.lax.stop_gradient(s["h"]), xs)
    return hs, {"h": h}


def ref_bilstm(p: dict[str, Any], s: dict[str, Any], xs: Any) -> Any:
    hf, s = ref_lstm(p, s, xs, "fwd.")
    hb, s = ref_lstm(p, s, xs, "bwd.", reverse=True)
    return (jnp.concatenate([hf, hb], -1) @ p["head"])[:, 0], s


def seqs(i: int, t: int = 5) -> tuple[Any, Any]:
    kx, ky = jax.random.split(jax.random.PRNGKey(70 + i))
    return jax.random.normal(kx, (t, 3)), jax.random.normal(ky, (t,))


def rnn_pair(write_module: Loader) -> tuple[types.ModuleType, types.ModuleType]:
    return pair(write_module, RNN)


@pytest.mark.parametrize("cls", ["BiLSTM"])
def test_lstm_forward_eager_f_jit_vs_plain_and_hand_threaded(
    write_module: Loader, cls: str
) -> None:
    plain, dec = rnn_pair(write_module)
    ref, model = getattr(plain, cls)(0), getattr(dec, cls)(0)
    f, s = model.functionalize()
    p = params_of(f)
    assert_same(read_plain(ref, p), p)
    ref_fn = ref_lstm if cls == "LSTM" else ref_bilstm
    xs = seqs(0)[0]
    want, want_s = ref_fn(p, dict(s), xs)
    want2, want_s2 = ref_fn(p, want_s, xs * 2)
    assert_same(want, ref(xs), "plain")
    assert_same(want2, ref(xs * 2), "plain 2")
    assert_same(want, model(xs), "eager")
    assert_same(want2, model(xs * 2), "eager 2")
    assert_same(want_s2, read_plain(model, want_s2), "eager states")
    run = jitted("__call__")
    out, s = run(f, s, xs)
    out2, s = run(f, s, xs * 2)
    assert_same(want2, out2, "jit")
    assert_same(want_s2, dict(s), "jit states")


@pytest.mark.parametrize("cls", ["LSTM", "BiLSTM"])
def test_lstm_trained_with_jax_grad_matches_hand_threaded(write_module: Loader, cls: str) -> None:
    _, dec = rnn_pair(write_module)
    f, s = getattr(dec, cls)(0).functionalize()
    p = params_of(f)
    ref_fn = ref_lstm if cls == "LSTM" else ref_bilstm

    def f_loss(f: Any, s: Any, xs: Any, y: Any) -> Any:
        out, s = f(s, xs)
        return jnp.mean((out.sum(-1) if out.ndim > 1 else out) - y) ** 2, s

    def r_loss(p: Any, s: Any, xs: Any, y: Any) -> Any:
        out, s = ref_fn(p, s, xs)
        return jnp.mean((out.sum(-1) if out.ndim > 1 else out) - y) ** 2, s

    fg = jax.jit(jax.grad(f_loss, has_aux=True))
    rg = jax.jit(jax.grad(r_loss, has_aux=True))
    rs = dict(s)
    for i in range(3):
        xs, y = seqs(i)
        g, s = fg(f, s, xs, y)
        rgrad, rs = rg(p, rs, xs, y)
        assert_same(rgrad, params_of(g), f"grads {i}")
        assert_same(rs, dict(s), f"states {i}")
        f = jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, f, g)
        p = jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, rgrad)
    assert int(s["steps" if cls == "LSTM" else "fwd.steps"]) == 15


def test_stateful_gru_truncated_bptt_matches_hand_threaded(write_module: Loader) -> None:
    plain, dec = rnn_pair(write_module)
    ref, model = plain.GRU(3), dec.GRU(3)
    f, s = model.functionalize()
    p = params_of(f)
    assert list(s) == ["h"]

    def f_loss(f: Any, s: Any, xs: Any, y: Any) -> Any:
        out, s = f(s, xs)
        return jnp.mean((out.sum(-1) - y) ** 2), s

    def r_loss(p: Any, s: Any, xs: Any, y: Any) -> Any:
        out, s = ref_gru(p, s, xs)
        return jnp.mean((out.sum(-1) - y) ** 2), s

    fg = jax.jit(jax.value_and_grad(f_loss, has_aux=True))
    rg = jax.jit(jax.value_and_grad(r_loss, has_aux=True))
    rs = dict(s)
    for i in range(3):
        xs, y = seqs(i)
        (loss, s), g = fg(f, s, xs, y)
        (rloss, rs), rgrad = rg(p, rs, xs, y)
        assert_same(rloss, loss, f"loss {i}")
        assert_same(rgrad, params_of(g), f"grads {i}")
        assert_same(rs, dict(s), f"hidden {i}")
        f = jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, f, g)
        p = jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, rgrad)
    # the plain and decorated classes carry the hidden state eagerly alike
    for i in range(3):
        assert_same(ref(seqs(i)[0]), model(seqs(i)[0]), f"eager segment {i}")
    assert_same(ref.h, model.h)


def test_lstm_vmapped_over_a_batch_of_sequences(write_module: Loader) -> None:
    _, dec = rnn_pair(write_module)
    f, s = dec.LSTM(0).functionalize()
    p = params_of(f)
    xs = jnp.stack([seqs(i)[0] for i in range(3)])
    want, want_s = jax.vmap(lambda x: ref_lstm(p, dict(s), x))(xs)
    got, got_s = jax.jit(jax.vmap(lambda x: f(s, x)))(xs)
    assert_same(want, got)
    assert_same(want_s, dict(got_s))
    # per-example states in, batched too
    bs = jax.tree_util.tree_map(lambda a: jnp.stack([a] * 3), dict(got_s))
    want, want_s = jax.vmap(lambda s, x: ref_lstm(p, s, x))(dict(bs), xs)
    got, got_s = jax.vmap(lambda s, x: f(s, x))(bs, xs)
    assert_same(want, got)
    assert_same(want_s, dict(got_s))


# ======================================================================================
# 4. Dropout with a PRNG key state
# ======================================================================================

DROPOUT = """
@DECORATE
class Dropout:
    def __init__(self, seed, rate=0.5, typed=True):
        self.key = jax.random.key(seed) if typed else jax.random.PRNGKey(seed)
        self.rate = rate

    def __call__(self, x):
        self.key, sub = jax.random.split(self.key)
        keep = jax.random.bernoulli(sub, 1 - self.rate, x.shape)
        return jnp.where(keep, x / (1 - self.rate), 0.0)


@DECORATE
class Split3:
    def __init__(self, seed, typed=True):
        self.key = jax.random.key(seed) if typed else jax.random.PRNGKey(seed)

    def __call__(self, x):
        self.key, k1, k2 = jax.random.split(self.key, 3)
        return x * jax.random.uniform(k1, x.shape) + jax.random.normal(k2, x.shape)


@DECORATE
class FoldIn:
    def __init__(self, seed, typed=True):
        self.key = jax.random.key(seed) if typed else jax.random.PRNGKey(seed)
        self.step = jnp.zeros((), jnp.uint32)

    def __call__(self, x):
        sub = jax.random.fold_in(self.key, self.step)
        self.step += 1
        return x + jax.random.normal(sub, x.shape)


@DECORATE
class NoisyScan:
    def __init__(self, seed, typed=True):
        self.drop = Dropout(seed, 0.25, typed)
        self.w = jnp.eye(4) * 0.5

    def __call__(self, xs):
        def body(h, x):
            h = jnp.tanh(self.drop(h @ self.w + x))
            return h, h
        return lax.scan(body, jnp.zeros(4), xs)[1]


@DECORATE
class DropMLP:
    def __init__(self, seed, typed=True):
        k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
        self.w1 = jax.random.normal(k1, (4, 8)) * 0.5
        self.w2 = jax.random.normal(k2, (8, 2)) * 0.5
        self.drop = Dropout(seed + 1, 0.5, typed)

    def __call__(self, x):
        return self.drop(jax.nn.relu(x @ self.w1)) @ self.w2
"""


def kd(typed: bool, seed: int) -> Any:
    return jax.random.key(seed) if typed else jax.random.PRNGKey(seed)


def ref_dropout(key: Any, x: Any, rate: float = 0.5) -> Any:
    key, sub = jax.random.split(key)
    keep = jax.random.bernoulli(sub, 1 - rate, x.shape)
    return jnp.where(keep, x / (1 - rate), 0.0), key


def ref_split3(key: Any, x: Any) -> Any:
    key, k1, k2 = jax.random.split(key, 3)
    return x * jax.random.uniform(k1, x.shape) + jax.random.normal(k2, x.shape), key


def ref_fold(s: dict[str, Any], x: Any) -> Any:
    sub = jax.random.fold_in(s["key"], s["step"])
    return x + jax.random.normal(sub, x.shape), {"key": s["key"], "step": s["step"] + 1}


def ref_noisy_scan(p: Any, s: dict[str, Any], xs: Any) -> Any:
    def body(carry: Any, x: Any) -> Any:
        h, key = carry
        h, key = ref_dropout(key, h @ p["w"] + x, 0.25)
        h = jnp.tanh(h)
        return (h, key), h

    (_, key), hs = jax.lax.scan(body, (jnp.zeros(4), s["drop.key"]), xs)
    return hs, {"drop.key": key}


def ref_drop_mlp(p: Any, s: dict[str, Any], x: Any) -> Any:
    h, key = ref_dropout(s["drop.key"], jax.nn.relu(x @ p["w1"]))
    return h @ p["w2"], {"drop.key": key}


def rng_calls(cls: str, typed: bool) -> tuple[str, Callable[..., Any], list[Any]]:
    xs = [jnp.arange(8.0).reshape(2, 4) + i for i in range(2)]
    if cls == "Dropout":
        return f"Dropout(0, 0.5, {typed})", lambda s, x: _k(ref_dropout(s["key"], x)), xs
    if cls == "Split3":
        return f"Split3(0, {typed})", lambda s, x: _k(ref_split3(s["key"], x)), xs
    if cls == "FoldIn":
        return f"FoldIn(0, {typed})", ref_fold, xs
    return f"NoisyScan(0, {typed})", None, xs


def _k(out_key: tuple[Any, Any]) -> tuple[Any, dict[str, Any]]:
    return out_key[0], {"key": out_key[1]}


RNG_CASES = [(c, t) for c in ("Dropout", "Split3", "FoldIn") for t in (True, False)]


@pytest.mark.parametrize("cls,typed", [*RNG_CASES, ("NoisyScan", True)])
def test_random_streams_match_hand_threaded_bit_for_bit(
    write_module: Loader, cls: str, typed: bool
) -> None:
    plain, dec = pair(write_module, DROPOUT)
    build, ref_fn, xs = rng_calls(cls, typed)
    ref, model = eval(build, vars(plain)), eval(build, vars(dec))  # noqa: S307
    f, s = model.functionalize()
    if cls == "NoisyScan":
        p = params_of(f)
        xs = [jnp.ones((3, 4)) * i for i in range(2)]

        def ref_fn(s: Any, x: Any) -> Any:
            return ref_noisy_scan(p, s, x)

    rs, js, fs = dict(s), s, s
    run = jitted("__call__")
    for i, x in enumerate(xs):
        want, rs = ref_fn(rs, x)
        assert_bits(want, ref(x), f"plain {i}")
        assert_bits(want, model(x), f"eager {i}")
        out, fs = f(fs, x)
        assert_bits(want, out, f"f {i}")
        out, js = run(f, js, x)
        assert_same(want, out, f"jit {i}")  # XLA may fuse a multiply-add
    assert_bits(rs, dict(js), "jit states")
    assert_bits(rs, dict(fs), "f states")
    assert_bits(rs, {k: plain_path(model, k) for k in rs}, "eager states")
    assert_bits(rs, {k: plain_path(ref, k) for k in rs}, "plain states")
    assert_bits(rs, autostate.state_dict(autostate.freeze(f, js)), "frozen states")


@pytest.mark.parametrize("typed", [True, False], ids=["typed", "raw"])
def test_dropout_mlp_trained_with_value_and_grad(write_module: Loader, typed: bool) -> None:
    _, dec = pair(write_module, DROPOUT)
    f, s = dec.DropMLP(0, typed).functionalize()
    p = params_of(f)
    assert sorted(p) == ["w1", "w2"] and list(s) == ["drop.key"]

    def f_loss(f: Any, s: Any, x: Any) -> Any:
        out, s = f(s, x)
        return jnp.sum(out**2), s

    def r_loss(p: Any, s: Any, x: Any) -> Any:
        out, s = ref_drop_mlp(p, s, x)
        return jnp.sum(out**2), s

    fg = jax.jit(jax.value_and_grad(f_loss, has_aux=True))
    rg = jax.jit(jax.value_and_grad(r_loss, has_aux=True))
    rs = dict(s)
    for i in range(3):
        x = jnp.ones((2, 4)) * (i + 1)
        (loss, s), g = fg(f, s, x)
        (rloss, rs), rgrad = rg(p, rs, x)
        assert_same(rloss, loss, f"loss {i}")
        assert_same(rgrad, params_of(g), f"grads {i}")
        assert_bits(rs, dict(s), f"key {i}")
        f = jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, f, g)
        p = jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, rgrad)


@pytest.mark.parametrize("typed", [True, False], ids=["typed", "raw"])
def test_dropout_vmapped_over_an_ensemble_of_keys(write_module: Loader, typed: bool) -> None:
    _, dec = pair(write_module, DROPOUT)
    f, s = dec.Dropout(0, 0.5, typed).functionalize()
    if typed:
        keys = jax.random.split(jax.random.key(5), 3)
    else:
        keys = jax.random.split(jax.random.PRNGKey(5), 3)
    x = jnp.arange(8.0).reshape(2, 4)
    want, want_k = jax.vmap(lambda k: ref_dropout(k, x))(keys)
    out, s2 = jax.jit(jax.vmap(lambda k: f({"key": k}, x)))(keys)
    assert_bits(want, out)
    assert_bits(want_k, s2["key"])


# ======================================================================================
# 5. Gradient checkpointing inside a block
# ======================================================================================

REMAT = """
@DECORATE
class Stats:
    def __init__(self, n):
        self.w = jnp.eye(n) * 0.7 + 0.1
        self.mean = jnp.zeros(n)
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.mean = 0.9 * self.mean + 0.1 * x.mean(0)
        self.calls += 1
        return jnp.tanh(x @ self.w)


@DECORATE
class RematBlock:
    def __init__(self, n, how):
        self.inner = Stats(n)
        self.key = jax.random.key(3)
        self.how = how
        self.scale = jnp.ones(n)

    def _noisy(self, x):
        self.key, sub = jax.random.split(self.key)
        return self.inner(x) * self.scale + 0.1 * jax.random.normal(sub, x.shape)

    @AUTOCHECKPOINT
    def decorated(self, x):
        return self._noisy(x)

    def __call__(self, x):
        if self.how == "submodel":
            y = checkpoint(self.inner)(x) * self.scale
            return y + 0.1 * jax.random.normal(self._next(), x.shape)
        if self.how == "closure":
            return checkpoint(lambda x: self._noisy(x))(x)
        if self.how == "policy":
            f = checkpoint(self._noisy, policy=jax.checkpoint_policies.nothing_saveable)
            return f(x)
        if self.how == "partial_decorator":
            @functools.partial(checkpoint, policy=jax.checkpoint_policies.dots_saveable)
            def g(x):
                return self._noisy(x)
            return g(x)
        if self.how == "method":
            return self.decorated(x)
        if self.how == "in_scan":
            def body(h, x):
                return checkpoint(self._noisy)(h + x), None
            return lax.scan(body, jnp.zeros_like(x[0]), x)[0]
        return self._noisy(x)

    def _next(self):
        self.key, sub = jax.random.split(self.key)
        return sub
"""

REMAT_HOWS = ["submodel", "closure", "policy", "partial_decorator", "method", "in_scan"]


def ref_remat(p: dict[str, Any], s: dict[str, Any], x: Any, how: str) -> Any:
    s = dict(s)

    def stats(x: Any) -> Any:
        s["inner.mean"] = 0.9 * s["inner.mean"] + 0.1 * x.mean(0)
        s["inner.calls"] = s["inner.calls"] + 1
        return jnp.tanh(x @ p["inner.w"])

    def noisy(x: Any) -> Any:
        s["key"], sub = jax.random.split(s["key"])
        return stats(x) * p["scale"] + 0.1 * jax.random.normal(sub, x.shape)

    if how == "submodel":
        y = stats(x) * p["scale"]
        s["key"], sub = jax.random.split(s["key"])
        return y + 0.1 * jax.random.normal(sub, x.shape), s
    if how == "in_scan":

        def body(carry: Any, xi: Any) -> Any:
            h, st = carry
            s.update(st)
            h = noisy(h + xi)
            return (h, dict(s)), None

        (h, st), _ = jax.lax.scan(body, (jnp.zeros_like(x[0]), dict(s)), x)
        return h, st
    return noisy(x), s


def remat_loss(out: Any) -> Any:
    return jnp.sum(out**2)


@pytest.mark.parametrize("how", REMAT_HOWS)
def test_remat_in_a_block_matches_hand_threaded_and_no_remat(
    write_module: Loader, how: str
) -> None:
    plain, dec = pair(write_module, REMAT)
    ref, model = plain.RematBlock(3, how), dec.RematBlock(3, how)
    x = jnp.arange(6.0).reshape(2, 3) / 6
    f, s = model.functionalize()
    p = params_of(f)
    want, want_s = ref_remat(p, dict(s), x, how)
    assert_same(want, ref(x), "plain")
    out, s1 = f(s, x)
    assert_same(want, out, "f")
    assert_bits(want_s["key"], s1["key"], "f key")
    assert_same(snapshot(want_s), snapshot(dict(s1)), "f states")

    def f_loss(f: Any, s: Any) -> Any:
        out, s = f(s, x)
        return remat_loss(out), s

    def r_loss(p: Any, s: Any) -> Any:
        out, s = ref_remat(p, s, x, how)
        return remat_loss(out), s

    g, s2 = jax.jit(jax.grad(f_loss, has_aux=True))(f, s)
    rg, rs2 = jax.grad(r_loss, has_aux=True)(p, dict(s))
    assert_same(rg, params_of(g), "grads")
    assert_same(snapshot(rs2), snapshot(dict(s2)), "grad states")
    assert_same(want, model(x), "eager")
    assert_same(snapshot(ref), snapshot(model), "eager attributes")


# ======================================================================================
# 6. Ensembles with vmap
# ======================================================================================

ENSEMBLE = """
@DECORATE
class Member:
    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.w1 = jax.random.normal(k1, (3, 6)) * 0.5
        self.w2 = jax.random.normal(k2, (6, 2)) * 0.5
        self.mean = jnp.zeros(6)
        self.count = jnp.zeros((), jnp.int32)
        self.key = k3
        self.training = True

    def __call__(self, x):
        h = jax.nn.relu(x @ self.w1)
        if self.training:
            self.mean = 0.8 * self.mean + 0.2 * h.mean(0)
            self.count += 1
            self.key, sub = jax.random.split(self.key)
            h = jnp.where(jax.random.bernoulli(sub, 0.75, h.shape), h / 0.75, 0.0)
        else:
            h = h - self.mean
        return h @ self.w2

    def eval(self):
        self.training = False
"""


def ref_member_init(key: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    k1, k2, k3 = jax.random.split(key, 3)
    p = {"w1": jax.random.normal(k1, (3, 6)) * 0.5, "w2": jax.random.normal(k2, (6, 2)) * 0.5}
    return p, {"count": jnp.zeros((), jnp.int32), "key": k3, "mean": jnp.zeros(6)}


def ref_member_train(p: Any, s: Any, x: Any) -> Any:
    h = jax.nn.relu(x @ p["w1"])
    key, sub = jax.random.split(s["key"])
    new = {"mean": 0.8 * s["mean"] + 0.2 * h.mean(0), "count": s["count"] + 1, "key": key}
    h = jnp.where(jax.random.bernoulli(sub, 0.75, h.shape), h / 0.75, 0.0)
    return h @ p["w2"], new


def member_batches(i: int) -> tuple[Any, Any]:
    kx, ky = jax.random.split(jax.random.PRNGKey(90 + i))
    return jax.random.normal(kx, (4, 3)), jax.random.normal(ky, (4, 2))


SGD = optax.sgd(0.1, momentum=0.9)


def test_ensemble_built_under_vmap_and_trained_under_vmap(write_module: Loader) -> None:
    _, dec = pair(write_module, ENSEMBLE)
    keys = jax.random.split(jax.random.key(0), 3)
    f, s = jax.vmap(lambda k: dec.Member(k).functionalize())(keys)
    p, rs = jax.vmap(ref_member_init)(keys)
    assert_same(p, params_of(f), "stacked params")
    assert_bits(rs, dict(s), "stacked states")

    def f_step(f: Any, o: Any, s: Any, x: Any, y: Any) -> Any:
        def loss(f: Any, s: Any) -> Any:
            out, s = f(s, x)
            return jnp.mean((out - y) ** 2), s

        (lv, s), g = jax.value_and_grad(loss, has_aux=True)(f, s)
        u, o = SGD.update(g, o, f)
        return lv, optax.apply_updates(f, u), o, s

    def r_step(p: Any, o: Any, s: Any, x: Any, y: Any) -> Any:
        def loss(p: Any, s: Any) -> Any:
            out, s = ref_member_train(p, s, x)
            return jnp.mean((out - y) ** 2), s

        (lv, s), g = jax.value_and_grad(loss, has_aux=True)(p, s)
        u, o = SGD.update(g, o, p)
        return lv, optax.apply_updates(p, u), o, s

    fstep = jax.jit(jax.vmap(f_step, in_axes=(0, 0, 0, None, None)))
    rstep = jax.jit(jax.vmap(r_step, in_axes=(0, 0, 0, None, None)))
    o, ro = jax.vmap(SGD.init)(f), jax.vmap(SGD.init)(p)
    for i in range(3):
        x, y = member_batches(i)
        loss, f, o, s = fstep(f, o, s, x, y)
        rloss, p, ro, rs = rstep(p, ro, rs, x, y)
        assert_same(rloss, loss, f"loss {i}")
        assert_same(p, params_of(f), f"params {i}")
        assert_bits(rs["key"], s["key"], f"keys {i}")
        assert_same(snapshot(rs), snapshot(dict(s)), f"states {i}")
    # one member out, evaluated eagerly
    x, _ = member_batches(9)
    for i in range(3):
        member = autostate.freeze(*jax.tree_util.tree_map(lambda a, i=i: a[i], (f, s)))
        member.eval()
        pi = jax.tree_util.tree_map(lambda a, i=i: a[i], p)
        si = jax.tree_util.tree_map(lambda a, i=i: a[i], rs)
        want = (jax.nn.relu(x @ pi["w1"]) - si["mean"]) @ pi["w2"]
        assert_same(want, member(x), f"member {i}")


def test_ensemble_stacked_by_hand_from_separate_models(write_module: Loader) -> None:
    plain, dec = pair(write_module, ENSEMBLE)
    keys = jax.random.split(jax.random.key(1), 3)
    pairs = [dec.Member(k).functionalize() for k in keys]
    f = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *[fp[0] for fp in pairs])
    s = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *[fp[1] for fp in pairs])
    x, _ = member_batches(0)
    out, s2 = jax.jit(jax.vmap(lambda f, s: f(s, x)))(f, s)
    for i, k in enumerate(keys):
        ref = plain.Member(k)
        assert_same(ref(x), out[i], f"member {i} output")
        assert_bits(ref.key, s2["key"][i], f"member {i} key")
        assert_same(ref.mean, s2["mean"][i], f"member {i} mean")


# ======================================================================================
# 7. Saving mid-training and resuming
# ======================================================================================


def train_f(f: Any, s: Any, steps: range, o: Any = None) -> tuple[Any, Any, Any]:
    o = ADAM.init(f) if o is None else o
    for i in steps:
        x, y = images(i)
        _, f, o, s = JF_STEP(f, o, s, x, y)
    return f, s, o


_UNINTERRUPTED: dict[int, Any] = {}


def uninterrupted(write_module: Loader, n: int) -> tuple[Any, Any, Any]:
    if n not in _UNINTERRUPTED:
        _, _, f, s, p = cnn(write_module)
        f, s, p, o, ro = train_both(f, s, p, range(n))
        _UNINTERRUPTED[n] = (f, s, o)
    return _UNINTERRUPTED[n]


def resume_and_compare(f: Any, s: Any, o: Any, want: tuple[Any, Any, Any], n: int) -> None:
    f, s, o = train_f(f, s, range(3, n), o)
    wf, ws, wo = want
    assert_bits(params_of(wf), params_of(f), "params after resuming")
    assert_bits(dict(ws), dict(s), "states after resuming")
    assert_bits(wo, o, "optimizer state after resuming")


RESUMES = ["dicts", "freeze_pickle", "f_states_pickle", "save_load", "freeze_eager_refunctionalize"]


@pytest.mark.parametrize("how", RESUMES)
def test_resume_mid_training_is_identical_to_an_uninterrupted_run(
    write_module: Loader, how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    want = uninterrupted(write_module, 5)
    _, dec = pair(write_module, "import optax\n" + CNN)
    monkeypatch.setitem(sys.modules, dec.__name__, dec)
    _, _, f, s, _ = cnn(write_module)
    f, s, o = train_f(f, s, range(3))
    o_saved = pickle.loads(pickle.dumps(o))
    if how == "dicts":
        fresh = dec.CNN(7)
        fresh = autostate.load_param_dict(fresh, autostate.param_dict(f))
        fresh = autostate.load_state_dict(fresh, autostate.state_dict(f, s))
        f2, s2 = fresh.functionalize()
    elif how == "freeze_pickle":
        f2, s2 = pickle.loads(pickle.dumps(autostate.freeze(f, s))).functionalize()
    elif how == "f_states_pickle":
        f2, s2 = pickle.loads(pickle.dumps((f, s)))
    elif how == "save_load":
        autostate.save(tmp_path / "ckpt.npz", autostate.freeze(f, s))
        f2, s2 = autostate.load(tmp_path / "ckpt.npz", like=dec.CNN(7)).functionalize()
    else:
        m = autostate.freeze(f, s)
        m(images(99)[0][: 0 + 4] * 0)  # an eager call in training mode moves the stats ...
        m = autostate.load_state_dict(m, autostate.state_dict(f, s))  # ... put them back
        f2, s2 = m.functionalize()
    assert jax.tree_util.tree_structure(f2) == jax.tree_util.tree_structure(f)
    resume_and_compare(f2, s2, o_saved, want, 5)


@pytest.mark.parametrize("how", ["freeze_pickle", "save_load", "dicts"])
def test_resume_a_sampler_with_a_typed_key_state(
    write_module: Loader, how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, _, f, s, p = gpt(write_module, seed=2)
    plain, dec = pair(write_module, GPT)
    monkeypatch.setitem(sys.modules, dec.__name__, dec)
    run = jitted("sample_fori", 3, 0.7)
    first, s1 = run(f, s, PROMPT)
    want, _ = run(f, s1, PROMPT[:1])
    model = autostate.freeze(f, s1)
    if how == "freeze_pickle":
        back = pickle.loads(pickle.dumps(model))
    elif how == "save_load":
        autostate.save(tmp_path / "gpt.npz", model)
        back = autostate.load(tmp_path / "gpt.npz", like=dec.GPT(5))
    else:
        back = autostate.load_state_dict(
            autostate.load_param_dict(dec.GPT(5), autostate.param_dict(model)),
            autostate.state_dict(model),
        )
    assert jax.dtypes.issubdtype(back.rng.dtype, jax.dtypes.prng_key)
    assert_bits(s1["rng"], back.rng, "key restored")
    f2, s2 = back.functionalize()
    got, _ = run(f2, s2, PROMPT[:1])
    assert_bits(want, got, "resumed sampling")
    ref_out, _ = ref_sample(p, dict(s1), PROMPT[:1], 3, 0.7)
    assert_bits(ref_out, got, "hand-threaded")


STACKED = """
@DECORATE
class Layer:
    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.w = jax.random.normal(k1, (3,))
        self.mean = jax.random.normal(k2, (3,)) * 10

    def __call__(self, x):
        return x * self.w - self.mean

    def update(self, x):
        self.mean = self.mean + x
        return self.mean


@DECORATE
class Stack:
    def __init__(self, n_layers):
        self.layers = jax.vmap(Layer)(jax.random.split(jax.random.PRNGKey(0), n_layers))

    def members(self, x):
        return jax.vmap(lambda layer: layer(x))(self.layers)

    def scanned(self, x):
        return lax.scan(lambda c, layer: (c, layer(x)), 0.0, self.layers)[1]

    def deep(self, x):
        return lax.scan(lambda x, layer: (layer(x), None), x, self.layers)[0]

    def write_members(self, xs):
        return jax.vmap(lambda layer, x: layer.update(x))(self.layers, xs)

    def sliced(self, x):
        outs = []
        for i in range(2):
            layer = jax.tree_util.tree_map(lambda a: a[i], self.layers)
            outs.append(layer(x))
        return jnp.stack(outs)
"""


def stack(write_module: Loader) -> tuple[Any, Any, Any]:
    _, dec = pair(write_module, STACKED)
    model = dec.Stack(2)
    assert model.layers.w.shape == (2, 3) and model.layers.mean.shape == (2, 3)
    return dec, model, (model.layers.w, model.layers.mean)


@pytest.mark.parametrize("method", ["members", "sliced"])
def test_stacked_sub_model_member_read_eagerly(write_module: Loader, method: str) -> None:
    _, model, (w, mean) = stack(write_module)
    x = jnp.ones(3)
    assert_same(x * w - mean, getattr(model, method)(x))


def test_stacked_sub_model_sliced_by_tree_map_through_f(write_module: Loader) -> None:
    _, model, (w, mean) = stack(write_module)
    x = jnp.ones(3)
    f, s = model.functionalize()
    out, _ = f.sliced(s, x)
    assert_same(x * w - mean, out)


@pytest.mark.parametrize("jit", [False, True])
def test_stacked_sub_model_member_read_under_vmap_through_f(
    write_module: Loader, jit: bool
) -> None:
    _, model, (w, mean) = stack(write_module)
    x = jnp.ones(3)
    f, s = model.functionalize()
    run = jitted("members") if jit else f.members
    out, s2 = run(f, s, x) if jit else run(s, x)
    assert_same(x * w - mean, out)
    assert_bits(dict(s), dict(s2))


@pytest.mark.parametrize("mode", ["eager", "f", "jit"])
def test_scan_over_a_stacked_sub_model_reads_its_layer_state(
    write_module: Loader, mode: str
) -> None:
    _, model, (w, mean) = stack(write_module)
    x = jnp.ones(3)
    if mode == "eager":
        out = model.scanned(x)
    else:
        f, s = model.functionalize()
        out, _ = jitted("scanned")(f, s, x) if mode == "jit" else f.scanned(s, x)
    assert_same(x * w - mean, out)


def test_scan_over_layers_of_a_stacked_sub_model_deep(write_module: Loader) -> None:
    _, model, (w, mean) = stack(write_module)
    x = jnp.ones(3)
    want = (x * w[0] - mean[0]) * w[1] - mean[1]
    f, s = model.functionalize()
    assert_same(want, f.deep(s, x)[0])


def test_stacked_sub_model_written_under_in_method_vmap_is_the_documented_error(
    write_module: Loader,
) -> None:
    dec, model, _ = stack(write_module)
    f, s = model.functionalize()
    with pytest.raises(autostate.errors.EscapedStateError) as err:
        f.write_members(s, jnp.ones((2, 3)))
    assert_user_line(err.value, __file__.rsplit("/", 1)[-1])
    with pytest.raises(autostate.errors.TracedEagerStateError) as err:
        model.write_members(jnp.ones((2, 3)))
    assert_user_line(err.value, Path(dec.__file__).name)
