"""Differential bug hunt 30: stateful idioms of real training / inference code.

- Quantization-aware training: min/max observers with ``observer_enabled`` /
  ``fake_quant_enabled`` Python-bool flags toggled by PyTorch-style methods
  (``disable_observer()`` returning ``self``), per-channel scales and zero
  points recomputed from the running min/max, a moving-average observer (a
  ``jnp.where`` first-batch rule, and the PyTorch ``if`` on the state: exact
  eagerly and in ``f``, the documented ``TracedValueError`` under ``jit``), a
  straight-through fake-quant under ``jax.grad``; toggling a flag through
  ``f`` is the documented ``StaticStateError``.
- LoRA: adapters merged in place (``self.w = self.w + self.a @ self.b``;
  ``self.merged = True``) and unmerged, eagerly and before ``functionalize``;
  an array-flag version merged inside ``f`` under ``jit``.
- Beam search: a KV cache *list* appended and reordered by beam indices
  (``self.cache = [c[idx] for c in self.cache]``), a step counter, a
  ``finished`` mask; greedy decoding with a Python loop and with
  ``lax.while_loop`` whose ``cond_fun`` reads state.
- RNG: a key state split per call for dropout (raw and typed keys), a
  variational mask drawn once per sequence and reused by a ``lax.scan`` body,
  ``vmap`` of ``f`` over per-example keys.
- Mixture of experts: a router with load counters, capacity / dropped-token
  tracking, an auxiliary loss stored on ``self`` and read by the trainer
  after the call (also as a Python-float and Python-int initial value).
- Gradient accumulation in an optimizer-like object with a Python-int ``k``
  (eager; ``StaticStateError`` through ``f``), an array ``k`` with a Python
  ``if`` (``f`` without ``jit``; ``TracedValueError`` under ``jit``), and
  ``lax.cond`` / ``jnp.where`` versions, scanned over a stream of gradients.
- Stored activations (``self.last_hidden``, ``self.attn_maps`` list reset
  each call) and forward hooks kept as a list of callables on ``self``.
- ``reset_parameters()`` between steps; ``train()`` / ``eval()``.

Training loops run as a ``jax.lax.scan`` over ``(f, states)`` with
``jax.value_and_grad`` against the plain model stepped in Python (parameters
set on a deep copy, states read back from it). Each source is written plain
and decorated (``differential.pair``); a case that shows a mismatch stays,
marked ``xfail(strict=True)`` with what differs.
"""

from __future__ import annotations

import copy
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


def _file(mod: types.ModuleType) -> str:
    return mod.__file__.rsplit("/", 1)[-1]


def _set(model: Any, path: str, value: Any) -> None:
    exec(
        ("m." + path if not path.startswith("[") else "m" + path) + " = v",  # noqa: S102
        {"m": model, "v": value},
    )


def train_compare(
    plain: types.ModuleType,
    dec: types.ModuleType,
    build: str,
    xs: Any,
    loss_fn: Callable[[Any, Callable[[str], Any]], Any],
    lr: float = 0.1,
    method: str = "__call__",
) -> None:
    """SGD over ``xs``: plain model stepped in Python vs ``lax.scan`` over ``(f, states)``."""
    model = eval(build, vars(dec))  # noqa: S307
    f0, states0 = model.functionalize()
    pnames = sorted(autostate.param_dict(f0))
    ref = eval(build, vars(plain))  # noqa: S307
    ref_losses = []
    for i in range(len(jax.tree_util.tree_leaves(xs)[0])):
        x = jax.tree_util.tree_map(lambda a, i=i: a[i], xs)
        params = {k: plain_path(ref, k) for k in pnames}

        def loss(params: dict[str, Any], x: Any = x) -> Any:
            m = copy.deepcopy(ref)
            for k, v in params.items():
                _set(m, k, v)
            out = getattr(m, method)(x)
            return loss_fn(out, lambda k: plain_path(m, k)), {k: plain_path(m, k) for k in states0}

        (val, st), g = jax.value_and_grad(loss, has_aux=True)(params)
        for k in pnames:
            _set(ref, k, params[k] - lr * g[k])
        for k, v in st.items():
            _set(ref, k, v)
        ref_losses.append(val)

    def step(carry: Any, x: Any) -> Any:
        f, s = carry

        def loss(f: Any) -> Any:
            out, s2 = (f if method == "__call__" else getattr(f, method))(s, x)
            return loss_fn(out, lambda k: s2[k]), s2

        (val, s2), g = jax.value_and_grad(loss, has_aux=True)(f)
        return (jax.tree_util.tree_map(lambda p, d: p - lr * d, f, g), s2), val

    for run in (jax.jit(jax.lax.scan, static_argnums=0),):
        (f, s), losses = run(step, (f0, states0), xs)
        assert_same(np.stack(ref_losses), losses, "losses")
        got = autostate.param_dict(f)
        for k in pnames:
            assert_same(np.asarray(plain_path(ref, k)), got[k], f"param {k}")
        for k in s:
            assert_same(snapshot(plain_path(ref, k)), snapshot(s[k]), f"state {k}")
        assert_same(snapshot(ref), snapshot(autostate.freeze(f, s)), "frozen")


def jit_call(f: Any, states: Any, *args: Any, method: str = "__call__") -> Any:
    return jax.jit(lambda f, s, *a: (f if method == "__call__" else getattr(f, method))(s, *a))(
        f, states, *args
    )


# ======================================================================================
# 1. Quantization-aware training observers
# ======================================================================================

QAT = """
@DECORATE
class MinMaxObserver:
    def __init__(self, n=1, ch_axis=None):
        self.ch_axis = ch_axis
        shape = () if ch_axis is None else (n,)
        self.min_val = jnp.full(shape, jnp.inf)
        self.max_val = jnp.full(shape, -jnp.inf)
        self.scale = jnp.ones(shape)
        self.zero_point = jnp.zeros(shape, jnp.int32)
        self.observer_enabled = True
        self.fake_quant_enabled = True

    def disable_observer(self):
        self.observer_enabled = False
        return self

    def enable_observer(self):
        self.observer_enabled = True
        return self

    def disable_fake_quant(self):
        self.fake_quant_enabled = False
        return self

    def _reduce_axes(self, x):
        if self.ch_axis is None:
            return None
        return tuple(i for i in range(x.ndim) if i != self.ch_axis)

    def observe(self, x):
        axes = self._reduce_axes(x)
        self.min_val = jnp.minimum(self.min_val, x.min(axis=axes))
        self.max_val = jnp.maximum(self.max_val, x.max(axis=axes))

    def calculate_qparams(self):
        lo = jnp.minimum(self.min_val, 0.0)
        hi = jnp.maximum(self.max_val, 0.0)
        self.scale = jnp.maximum((hi - lo) / 255.0, 1e-8)
        self.zero_point = jnp.clip(jnp.round(-lo / self.scale), 0, 255).astype(jnp.int32)
        return self.scale, self.zero_point

    def _bshape(self, x, v):
        if self.ch_axis is None:
            return v
        shape = [1] * x.ndim
        shape[self.ch_axis] = -1
        return v.reshape(shape)

    def __call__(self, x):
        if self.observer_enabled:
            self.observe(jax.lax.stop_gradient(x))
            self.calculate_qparams()
        if self.fake_quant_enabled:
            s = self._bshape(x, self.scale)
            z = self._bshape(x, self.zero_point)
            q = jnp.clip(jnp.round(x / s) + z, 0, 255)
            xq = (q - z) * s
            x = x + jax.lax.stop_gradient(xq - x)
        return x


@DECORATE
class MovingAverageObserver(MinMaxObserver):
    def __init__(self, c=0.25):
        super().__init__()
        self.c = c

    def observe(self, x):
        lo, hi = x.min(), x.max()
        first = jnp.isinf(self.min_val)
        self.min_val = jnp.where(first, lo, self.min_val + self.c * (lo - self.min_val))
        self.max_val = jnp.where(first, hi, self.max_val + self.c * (hi - self.max_val))


@DECORATE
class TorchStyleMovingAverage(MinMaxObserver):
    def __init__(self, c=0.25):
        super().__init__()
        self.c = c

    def observe(self, x):
        lo, hi = x.min(), x.max()
        if self.min_val == float("inf"):
            self.min_val, self.max_val = lo, hi
        else:
            self.min_val = self.min_val + self.c * (lo - self.min_val)
            self.max_val = self.max_val + self.c * (hi - self.max_val)


@DECORATE
class QATLinear:
    def __init__(self, seed, din, dout, moving=False):
        k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
        self.w = jax.random.normal(k1, (dout, din)) * 0.5
        self.b = jax.random.normal(k2, (dout,)) * 0.1
        self.act_obs = MovingAverageObserver() if moving else MinMaxObserver()
        self.w_obs = MinMaxObserver(dout, ch_axis=0)

    def observers(self):
        return [self.act_obs, self.w_obs]

    def freeze_observers(self):
        for o in self.observers():
            o.disable_observer()
        return self

    def __call__(self, x):
        x = self.act_obs(x)
        w = self.w_obs(self.w)
        return jnp.tanh(x @ w.T + self.b)


def frozen_qat(seed, x, moving=False):
    m = QATLinear(seed, 3, 4, moving)
    m(x)
    return m.freeze_observers()
"""

XQ = jnp.array([[1.0, 2.0, 0.0], [3.0, -2.0, 1.0], [2.0, 0.5, 5.0], [0.5, 1.0, -1.0]])
XQS = jnp.stack([XQ, XQ * 1.5 - 1, XQ * 0.5 + 2])


@pytest.mark.parametrize(
    "build",
    [
        "MinMaxObserver()",
        "MinMaxObserver(3, ch_axis=1)",
        "MovingAverageObserver()",
        "TorchStyleMovingAverage()",
        "QATLinear(0, 3, 4)",
        "QATLinear(1, 3, 4, moving=True)",
    ],
)
def test_observers_track_and_fake_quantize(write_module: Loader, build: str) -> None:
    plain, dec = pair(write_module, QAT)
    calls = [("__call__", (XQ,)), ("__call__", (XQ * 2 - 1,)), ("__call__", (XQ * 0.5,))]
    modes = ("eager", "f") if "Torch" in build else ("eager", "f", "jit", "freeze")
    check(plain, dec, build, calls, modes=modes)


def test_observer_calculate_qparams_method_through_f(write_module: Loader) -> None:
    plain, dec = pair(write_module, QAT)
    calls = [("__call__", (XQ,)), ("calculate_qparams", ()), ("__call__", (XQ + 4,))]
    check(plain, dec, "MinMaxObserver(3, ch_axis=1)", calls)


def test_torch_style_moving_average_if_under_jit_is_traced_value_error(
    write_module: Loader,
) -> None:
    _, dec = pair(write_module, QAT)
    f, states = dec.TorchStyleMovingAverage().functionalize()
    with pytest.raises(autostate.errors.TracedValueError) as err:
        jit_call(f, states, XQ)
    assert_user_line(err.value, _file(dec))
    assert isinstance(err.value, jax.errors.TracerBoolConversionError)


@pytest.mark.parametrize("moving", [False, True])
def test_observers_disabled_after_calibration(write_module: Loader, moving: bool) -> None:
    plain, dec = pair(write_module, QAT)
    calls = [("__call__", (XQ * 3,)), ("__call__", (XQ - 2,))]
    check(plain, dec, f"frozen_qat(0, XQ, {moving})".replace("XQ", "jnp.ones((2, 3))"), calls)


def test_disable_fake_quant_and_reenable_observer_eagerly(write_module: Loader) -> None:
    plain, dec = pair(write_module, QAT)
    build = "MinMaxObserver(3, ch_axis=1).disable_fake_quant()"
    ref, model = eval(build, vars(plain)), eval(build, vars(dec))  # noqa: S307
    for m in (ref, model):
        outs = [m(XQ)]
        assert m.disable_observer() is m and m.observer_enabled is False
        outs.append(m(XQ * 9))
        m.enable_observer()
        outs.append(m(XQ * 2))
        m.outs = outs
    assert_same(snapshot(ref), snapshot(model), "eager toggles")
    model.disable_observer()
    ref.disable_observer()
    f, states = model.functionalize()
    out, states = jit_call(f, states, XQ * 7)
    assert_same(ref(XQ * 7), out, "jit with observer disabled")
    assert_same(snapshot(ref), snapshot(autostate.freeze(f, states)), "frozen")


@pytest.mark.parametrize("jit", [False, True])
def test_disable_observer_through_f_is_static_state_error(write_module: Loader, jit: bool) -> None:
    _, dec = pair(write_module, QAT)
    f, states = dec.QATLinear(0, 3, 4).functionalize()
    call = lambda f, s: f.freeze_observers(s)  # noqa: E731
    with pytest.raises(autostate.errors.StaticStateError) as err:
        (jax.jit(call) if jit else call)(f, states)
    assert "observer_enabled" in str(err.value)
    assert_user_line(err.value, _file(dec))


def test_qat_straight_through_grad(write_module: Loader) -> None:
    plain, dec = pair(write_module, QAT)
    check_transform(
        plain, dec, "QATLinear(0, 3, 4)", [("__call__", (X,)), ("__call__", (X,))], XQ, "grad"
    )


@pytest.mark.parametrize("moving", [False, True])
def test_qat_training_loop_in_scan(write_module: Loader, moving: bool) -> None:
    plain, dec = pair(write_module, QAT)
    train_compare(
        plain,
        dec,
        f"QATLinear(2, 3, 4, moving={moving})",
        XQS,
        lambda out, get: jnp.mean((out - 0.3) ** 2),
        lr=0.2,
    )


# ======================================================================================
# 2. LoRA adapters merged and unmerged in place
# ======================================================================================

LORA = """
@DECORATE
class LoRALinear:
    def __init__(self, seed, din, dout, r=2, alpha=4.0):
        k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
        self.w = jax.random.normal(k1, (din, dout)) * 0.4
        self.a = jax.random.normal(k2, (din, r)) * 0.4
        self.b = jax.random.normal(k3, (r, dout)) * 0.4
        self.scaling = alpha / r
        self.merged = False

    def delta(self):
        return self.a @ self.b * self.scaling

    def merge(self):
        if not self.merged:
            self.w = self.w + self.delta()
            self.merged = True
        return self

    def unmerge(self):
        if self.merged:
            self.w = self.w - self.delta()
            self.merged = False
        return self

    def __call__(self, x):
        y = x @ self.w
        if not self.merged:
            y = y + (x @ self.a) @ self.b * self.scaling
        return y


@DECORATE
class LoRANet:
    def __init__(self, seed, d, depth):
        self.layers = [LoRALinear(seed + i, d, d) for i in range(depth)]

    def merge_all(self):
        for layer in self.layers:
            layer.merge()
        return self

    def unmerge_all(self):
        for layer in self.layers:
            layer.unmerge()
        return self

    def __call__(self, x):
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return x


@DECORATE
class LoRAArrayFlag:
    def __init__(self, seed, din, dout, r=2):
        k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
        self.w = jax.random.normal(k1, (din, dout)) * 0.4
        self.a = jax.random.normal(k2, (din, r)) * 0.4
        self.b = jax.random.normal(k3, (r, dout)) * 0.4
        self.merged = jnp.zeros((), bool)

    def merge(self):
        self.w = jnp.where(self.merged, self.w, self.w + self.a @ self.b)
        self.merged = jnp.ones((), bool)
        return self.merged

    def unmerge(self):
        self.w = jnp.where(self.merged, self.w - self.a @ self.b, self.w)
        self.merged = jnp.zeros((), bool)
        return self.merged

    def __call__(self, x):
        lora = (x @ self.a) @ self.b
        return x @ self.w + jnp.where(self.merged, 0.0, lora)
"""

XL = jnp.array([[1.0, -0.5, 0.25], [0.5, 2.0, -1.0]])


@pytest.mark.parametrize(
    "build",
    [
        "LoRALinear(0, 3, 3)",
        "LoRALinear(0, 3, 3).merge()",
        "LoRANet(1, 3, 2).merge_all()",
        "LoRANet(1, 3, 2).merge_all().unmerge_all()",
    ],
)
def test_lora_merged_before_functionalize(write_module: Loader, build: str) -> None:
    plain, dec = pair(write_module, LORA)
    check(plain, dec, build, [("__call__", (XL,)), ("__call__", (XL * 3,))])


def test_lora_merge_unmerge_eagerly_same_outputs(write_module: Loader) -> None:
    plain, dec = pair(write_module, LORA)
    for mod in (plain, dec):
        m = mod.LoRANet(2, 3, 2)
        y0 = m(XL)
        assert m.merge_all() is m and m.layers[1].merged is True
        y1 = m(XL)
        m.merge_all()  # idempotent
        y2 = m(XL)
        m.unmerge_all()
        mod.result = (y0, y1, y2, m(XL), snapshot(m))
    assert_same(plain.result, dec.result, "merge / unmerge eagerly")
    np.testing.assert_allclose(dec.result[0], dec.result[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("jit", [False, True])
def test_lora_merge_through_f_is_static_state_error(write_module: Loader, jit: bool) -> None:
    _, dec = pair(write_module, LORA)
    f, states = dec.LoRANet(0, 3, 2).functionalize()
    call = lambda f, s: f.merge_all(s)  # noqa: E731
    with pytest.raises(autostate.errors.StaticStateError) as err:
        (jax.jit(call) if jit else call)(f, states)
    assert "merged" in str(err.value)
    assert_user_line(err.value, _file(dec))


def test_lora_merge_of_merged_model_through_f_is_noop(write_module: Loader) -> None:
    plain, dec = pair(write_module, LORA)
    check(plain, dec, "LoRANet(0, 3, 2).merge_all()", [("merge_all", ()), ("__call__", (XL,))][1:])
    f, states = dec.LoRANet(0, 3, 2).merge_all().functionalize()
    out, new = jit_call(f, states, method="merge_all")
    for k in states:
        assert_same(snapshot(states[k]), snapshot(new[k]), k)


def test_lora_array_flag_merge_inside_f(write_module: Loader) -> None:
    plain, dec = pair(write_module, LORA)
    calls = [
        ("__call__", (XL,)),
        ("merge", ()),
        ("__call__", (XL,)),
        ("merge", ()),
        ("__call__", (XL * 2,)),
        ("unmerge", ()),
        ("__call__", (XL,)),
    ]
    check(plain, dec, "LoRAArrayFlag(3, 3, 2)", calls)


def test_lora_training_only_adapters_in_scan(write_module: Loader) -> None:
    # w is assigned by merge(): a state, so only a and b are trained through f, as a
    # frozen base weight should be; the scan loop against the plain model.
    plain, dec = pair(write_module, LORA)
    f, _ = dec.LoRANet(0, 3, 2).functionalize()
    assert sorted(autostate.param_dict(f)) == [
        "layers[0].a",
        "layers[0].b",
        "layers[1].a",
        "layers[1].b",
    ]
    xs = jnp.stack([XL, XL * 2, -XL])
    train_compare(plain, dec, "LoRANet(0, 3, 2)", xs, lambda out, get: jnp.mean(out**2))
    check_transform(plain, dec, "LoRANet(0, 3, 2)", [("__call__", (X,))], XL, "grad")


# ======================================================================================
# 3. Beam search and greedy decoding
# ======================================================================================

BEAM = """
EOS = 0


@DECORATE
class BeamDecoder:
    def __init__(self, seed, vocab, d, beams, max_len=6):
        k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
        self.emb = jax.random.normal(k1, (vocab, d))
        self.wo = jax.random.normal(k2, (d, vocab))
        self.vocab = vocab
        self.beams = beams
        self.cache = []
        self.step = jnp.zeros((), jnp.int32)
        self.scores = jnp.zeros(beams)
        self.finished = jnp.zeros(beams, bool)
        self.tokens = jnp.zeros(beams, jnp.int32)
        self.kv = jnp.zeros((max_len, d))
        self.out = jnp.full((max_len,), -1, jnp.int32)
        self.pos = jnp.zeros((), jnp.int32)
        self.max_len = max_len

    def reset(self, tokens):
        self.cache = []
        self.step = jnp.zeros((), jnp.int32)
        self.scores = jnp.zeros(self.beams)
        self.finished = jnp.zeros(self.beams, bool)
        self.tokens = tokens

    def decode_step(self):
        self.cache = self.cache + [self.emb[self.tokens]]
        ctx = jnp.stack(self.cache).mean(0)
        logp = jax.nn.log_softmax(ctx @ self.wo)
        eos_only = jnp.where(jnp.arange(self.vocab) == EOS, 0.0, -1e9)
        logp = jnp.where(self.finished[:, None], eos_only, logp)
        total = (self.scores[:, None] + logp).reshape(-1)
        top, idx = jax.lax.top_k(total, self.beams)
        beam_idx, tok = idx // self.vocab, idx % self.vocab
        self.cache = [c[beam_idx] for c in self.cache]
        self.scores = top
        self.finished = self.finished[beam_idx] | (tok == EOS)
        self.tokens = tok
        self.step += 1
        return tok, beam_idx

    def search(self, tokens, n=4):
        self.reset(tokens)
        toks = []
        for _ in range(n):
            tok, beam_idx = self.decode_step()
            toks = [t[beam_idx] for t in toks] + [tok]
        return jnp.stack(toks, 1), self.scores

    def search2(self, tokens):
        return self.search(tokens, 2)

    def search5(self, tokens):
        return self.search(tokens, 5)

    def _greedy_body(self, tok):
        self.kv = self.kv.at[self.pos].set(self.emb[tok])
        ctx = self.kv.sum(0) / (self.pos + 1)
        nxt = jnp.argmax(ctx @ self.wo).astype(jnp.int32)
        self.out = self.out.at[self.pos].set(nxt)
        self.pos += 1
        return nxt

    def greedy(self, tok):
        self.pos = jnp.zeros((), jnp.int32)
        self.kv = jnp.zeros_like(self.kv)
        self.out = jnp.full_like(self.out, -1)
        lax.while_loop(lambda t: (self.pos < self.max_len) & (t != EOS), self._greedy_body, tok)
        return self.out, self.pos

    def greedy_python(self, tok):
        self.pos = jnp.zeros((), jnp.int32)
        self.kv = jnp.zeros_like(self.kv)
        self.out = jnp.full_like(self.out, -1)
        for _ in range(self.max_len):
            tok = self._greedy_body(tok)
        return self.out, self.pos
"""

TOK = jnp.array([3, 1, 2], jnp.int32)


def test_beam_search_list_cache_reordered(write_module: Loader) -> None:
    plain, dec = pair(write_module, BEAM)
    calls = [("search", (TOK,)), ("decode_step", ()), ("search2", (TOK[::-1],))]
    check(plain, dec, "BeamDecoder(0, 5, 4, 3)", calls)


def test_beam_search_eos_finishes_beams(write_module: Loader) -> None:
    plain, dec = pair(write_module, BEAM)
    ref = plain.BeamDecoder(4, 3, 2, 3)
    ref.search5(TOK % 3)
    assert bool(ref.finished.any())  # the case exercises the finished mask
    check(plain, dec, "BeamDecoder(4, 3, 2, 3)", [("search5", (TOK % 3,))])


@pytest.mark.parametrize("method", ["greedy", "greedy_python"])
def test_greedy_decode_fixed_cache(write_module: Loader, method: str) -> None:
    plain, dec = pair(write_module, BEAM)
    for seed in (0, 2):
        calls = [(method, (jnp.int32(2),)), (method, (jnp.int32(4),))]
        check(plain, dec, f"BeamDecoder({seed}, 5, 4, 3)", calls)


def test_greedy_while_loop_vmapped_over_prompts(write_module: Loader) -> None:
    # plain Python's while cannot run under vmap: the reference is one prompt at a time
    plain, dec = pair(write_module, BEAM)
    prompts = jnp.array([1, 2, 3, 4], jnp.int32)
    expected = []
    for p in prompts:
        ref = plain.BeamDecoder(1, 5, 4, 3)
        expected.append((ref.greedy(p), ref.kv, ref.out, ref.pos))
    expected = jax.tree_util.tree_map(lambda *v: jnp.stack(v), *expected)
    f, states = dec.BeamDecoder(1, 5, 4, 3).functionalize()

    def run(p: Any) -> Any:
        out, s = f.greedy(states, p)
        return out, s["kv"], s["out"], s["pos"]

    assert_same(expected, jax.vmap(run)(prompts), "vmap")
    assert_same(expected, jax.jit(jax.vmap(run))(prompts), "jit vmap")


BEAM_APPEND = """
@DECORATE
class Cache:
    def __init__(self):
        self.cache = []

    def reset(self):
        self.cache = []

    def __call__(self, h, idx):
        self.cache.append(h)
        self.cache = [c[idx] for c in self.cache]
        return jnp.stack(self.cache).sum(0)
"""


def test_cache_list_append_is_decoration_error(write_module: Loader) -> None:
    with pytest.raises(autostate.errors.DecorationError) as err:
        pair(write_module, BEAM_APPEND)
    msg = str(err.value)
    assert "self.cache.append" in msg and "self.cache = self.cache + [item]" in msg
    assert ".py:" in msg and "Cache.__call__" in msg


# ======================================================================================
# 4. RNG: key states for dropout, in scan over time, vmapped per example
# ======================================================================================

RNG = """
@DECORATE
class Dropout:
    def __init__(self, seed, p=0.5, typed=False):
        self.key = jax.random.key(seed) if typed else jax.random.PRNGKey(seed)
        self.p = p
        self.training = True

    def train(self, mode=True):
        self.training = mode
        return self

    def eval(self):
        return self.train(False)

    def __call__(self, x):
        if not self.training or self.p == 0.0:
            return x
        self.key, sub = jax.random.split(self.key)
        keep = jax.random.bernoulli(sub, 1.0 - self.p, x.shape)
        return jnp.where(keep, x / (1.0 - self.p), 0.0)


@DECORATE
class VariationalRNN:
    def __init__(self, seed, d, typed=False):
        k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
        self.w = jax.random.normal(k1, (d, d)) * 0.5
        self.key = jax.random.key(seed + 1) if typed else k2
        self.mask = jnp.ones(d)
        self.h = jnp.zeros(d)
        self.drop = Dropout(seed + 7, p=0.25, typed=typed)

    def new_mask(self):
        self.key, sub = jax.random.split(self.key)
        self.mask = jax.random.bernoulli(sub, 0.75, self.mask.shape) / 0.75

    def _step(self, h, x):
        h = jnp.tanh((h * self.mask) @ self.w + self.drop(x))
        self.h = h
        return h, h.sum()

    def __call__(self, xs):
        self.new_mask()
        h, ys = lax.scan(self._step, jnp.zeros_like(self.h), xs)
        return ys
"""

XR = jnp.arange(12.0).reshape(4, 3) / 7.0 - 0.5


@pytest.mark.parametrize("typed", [False, True])
def test_dropout_key_split_each_call(write_module: Loader, typed: bool) -> None:
    plain, dec = pair(write_module, RNG)
    calls = [("__call__", (XR,)), ("__call__", (XR,)), ("__call__", (XR * 2,))]
    check(plain, dec, f"Dropout(3, typed={typed})", calls)
    check(plain, dec, f"Dropout(3, typed={typed}).eval()", calls)
    check_transform(
        plain,
        dec,
        f"Dropout(3, typed={typed})",
        [("__call__", (X,)), ("__call__", (X,))],
        XR,
        "grad",
    )


@pytest.mark.parametrize("typed", [False, True])
def test_variational_mask_and_dropout_in_scan(write_module: Loader, typed: bool) -> None:
    plain, dec = pair(write_module, RNG)
    calls = [("__call__", (XR,)), ("__call__", (XR[::-1],))]
    check(plain, dec, f"VariationalRNN(0, 3, typed={typed})", calls)
    if not typed:
        check_transform(
            plain,
            dec,
            f"VariationalRNN(0, 3, typed={typed})",
            [("__call__", (X,)), ("__call__", (X,))],
            XR,
            "grad",
        )


@pytest.mark.parametrize("typed", [False, True])
def test_vmap_over_per_example_keys(write_module: Loader, typed: bool) -> None:
    plain, dec = pair(write_module, RNG)
    f, states = dec.VariationalRNN(0, 3, typed=typed).functionalize()
    n = 3
    seeds = jnp.arange(n)
    make = jax.random.key if typed else jax.random.PRNGKey
    keys = jax.vmap(make)(seeds)
    dkeys = jax.vmap(make)(seeds + 100)
    xs = jnp.stack([XR * (i + 1) for i in range(n)])
    expected = []
    for i in range(n):
        ref = plain.VariationalRNN(0, 3, typed=typed)
        ref.key, ref.drop.key = keys[i], dkeys[i]
        ys = [ref(xs[i]), ref(xs[i] * 0.5)]
        expected.append((ys, {k: plain_path(ref, k) for k in states}))
    batched = dict(states, key=keys, **{"drop.key": dkeys})
    axes = {k: (0 if k in ("key", "drop.key") else None) for k in states}

    def two(s: Any, x: Any) -> Any:
        y1, s = f(s, x)
        y2, s = f(s, x * 0.5)
        return [y1, y2], s

    for fn in (jax.vmap(two, in_axes=(axes, 0)), jax.jit(jax.vmap(two, in_axes=(axes, 0)))):
        got_ys, got_s = fn(batched, xs)
        for i in range(n):
            assert_same(expected[i][0], [y[i] for y in got_ys], f"outputs {i}")
            for k in states:
                assert_same(
                    snapshot(expected[i][1][k]),
                    snapshot(jax.tree_util.tree_map(lambda a, i=i: a[i], got_s[k])),
                    f"state {k} {i}",
                )


def test_rnn_with_dropout_training_in_scan(write_module: Loader) -> None:
    plain, dec = pair(write_module, RNG)
    xs = jnp.stack([XR, XR * 2, XR[::-1]])
    train_compare(
        plain,
        dec,
        "VariationalRNN(1, 3)",
        xs,
        lambda out, get: jnp.mean(out**2) + jnp.mean(get("h") ** 2),
    )


# ======================================================================================
# 5. Mixture of experts: counters, capacity, an auxiliary loss on self
# ======================================================================================

MOE = """
@DECORATE
class Router:
    def __init__(self, seed, d, n_experts, capacity, py_init=False):
        self.w = jax.random.normal(jax.random.PRNGKey(seed), (d, n_experts))
        self.n_experts = n_experts
        self.capacity = capacity
        self.expert_counts = jnp.zeros(n_experts)
        self.dropped = 0 if py_init else jnp.zeros((), jnp.int32)
        self.aux_loss = 0.0 if py_init else jnp.zeros(())
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        probs = jax.nn.softmax(x @ self.w)
        one_hot = jax.nn.one_hot(jnp.argmax(probs, -1), self.n_experts)
        self.expert_counts += one_hot.sum(0)
        position = jnp.cumsum(one_hot, 0) * one_hot
        keep = (position <= self.capacity) & (one_hot > 0)
        self.dropped += (one_hot.sum() - keep.sum()).astype(jnp.int32)
        self.aux_loss = self.n_experts * jnp.sum(one_hot.mean(0) * probs.mean(0))
        self.calls += 1
        return keep * probs

    def usage(self):
        return self.expert_counts / jnp.maximum(self.expert_counts.sum(), 1.0)


@DECORATE
class MoE:
    def __init__(self, seed, d, n_experts=3, capacity=2, py_init=False):
        self.router = Router(seed, d, n_experts, capacity, py_init)
        keys = jax.random.split(jax.random.PRNGKey(seed + 1), n_experts)
        self.experts = [jax.random.normal(k, (d, d)) * 0.5 for k in keys]

    def __call__(self, x):
        gates = self.router(x)
        outs = jnp.stack([jnp.tanh(x @ w) for w in self.experts], 1)
        return jnp.einsum("te,ted->td", gates, outs)


def train_moe(model, xs):
    losses = []
    for x in xs:
        y = model(x)
        losses.append(jnp.mean((y - x) ** 2) + 0.01 * model.router.aux_loss)
    return losses
"""

XM = jnp.array(
    [[1.0, 0.0, -1.0], [0.5, 2.0, 0.1], [-1.0, 1.0, 0.3], [0.2, -0.4, 1.5], [1.2, 0.3, 0.3]]
)


def test_moe_counters_capacity_aux_loss(write_module: Loader) -> None:
    plain, dec = pair(write_module, MOE)
    calls = [("__call__", (XM,)), ("__call__", (XM * 2,)), ("__call__", (-XM,))]
    check(plain, dec, "MoE(0, 3)", calls)
    ref = plain.MoE(0, 3)
    for x in (XM, XM * 2, -XM):
        ref(x)
    assert int(ref.router.dropped) > 0  # capacity is exercised
    check(plain, dec, "MoE(0, 3).router", [("__call__", (XM,)), ("usage", ())])


def test_moe_trainer_reads_aux_loss_after_call_eagerly(write_module: Loader) -> None:
    plain, dec = pair(write_module, MOE)
    xs = [XM, XM * 2, -XM]
    assert_same(plain.train_moe(plain.MoE(0, 3), xs), dec.train_moe(dec.MoE(0, 3), xs), "losses")


def test_moe_aux_loss_in_grad_training_scan(write_module: Loader) -> None:
    plain, dec = pair(write_module, MOE)
    xs = jnp.stack([XM, XM * 2, -XM, XM[::-1]])
    train_compare(
        plain,
        dec,
        "MoE(0, 3)",
        xs,
        lambda out, get: jnp.mean(out**2) + 0.1 * get("router.aux_loss"),
    )
    check_transform(plain, dec, "MoE(0, 3)", [("__call__", (X,)), ("__call__", (X,))], XM, "grad")


def test_moe_python_float_aux_loss_init(write_module: Loader) -> None:
    # aux_loss = 0.0 (a weakly typed float state) becomes an array in the call
    plain, dec = pair(write_module, MOE)
    ref, model = plain.MoE(0, 3, py_init=True), dec.MoE(0, 3, py_init=True)
    assert_same(ref(XM), model(XM), "eager")
    assert_same(snapshot(ref), snapshot(model), "eager attributes")


@pytest.mark.parametrize("jit", [False, True])
def test_moe_python_int_dropped_counter_through_f(write_module: Loader, jit: bool) -> None:
    # dropped = 0 is a static Python int: adding an array to it inside f cannot be static
    _, dec = pair(write_module, MOE)
    f, states = dec.MoE(0, 3, py_init=True).functionalize()
    call = lambda f, s, x: f(s, x)  # noqa: E731
    with pytest.raises(autostate.errors.StaticStateError) as err:
        (jax.jit(call) if jit else call)(f, states, XM)
    assert "dropped" in str(err.value)
    assert_user_line(err.value, _file(dec))


# ======================================================================================
# 6. Gradient accumulation inside an optimizer-like object
# ======================================================================================

ACCUM = """
add = lambda a, b: a + b


@DECORATE
class AccumSGD:
    def __init__(self, params, n, lr=0.5, array_k=False):
        self.params = params
        self.accum = jax.tree_util.tree_map(jnp.zeros_like, params)
        self.k = jnp.zeros((), jnp.int32) if array_k else 0
        self.n = n
        self.lr = lr
        self.applied = jnp.zeros((), jnp.int32)

    def _apply(self):
        self.params = jax.tree_util.tree_map(lambda p, g: p - self.lr * g / self.n,
                                             self.params, self.accum)
        self.accum = jax.tree_util.tree_map(jnp.zeros_like, self.accum)
        self.k = self.k * 0
        self.applied += 1

    def update(self, grads):
        self.accum = jax.tree_util.tree_map(add, self.accum, grads)
        self.k += 1
        if self.k == self.n:
            self._apply()
        return self.params

    def update_scaled(self, s):
        return self.update(jax.tree_util.tree_map(lambda g: g * s, grads_at(1)))


@DECORATE
class AccumSGDCond(AccumSGD):
    def update(self, grads):
        self.accum = jax.tree_util.tree_map(add, self.accum, grads)
        self.k += 1
        lax.cond(self.k == self.n, self._apply, lambda: None)
        return self.params


@DECORATE
class AccumSGDWhere(AccumSGD):
    def update(self, grads):
        self.accum = jax.tree_util.tree_map(add, self.accum, grads)
        self.k += 1
        ready = self.k == self.n
        new = jax.tree_util.tree_map(lambda p, g: p - self.lr * g / self.n, self.params,
                                     self.accum)
        self.params = jax.tree_util.tree_map(lambda a, b: jnp.where(ready, a, b), new,
                                             self.params)
        self.accum = jax.tree_util.tree_map(lambda a: jnp.where(ready, 0.0, a), self.accum)
        self.applied += ready.astype(jnp.int32)
        self.k = jnp.where(ready, 0, self.k)
        return self.params


def init_params():
    return {"w": jnp.array([1.0, -2.0, 0.5]), "b": [jnp.array(0.25), jnp.ones((2, 2))]}


def grads_at(i):
    return {"w": jnp.array([0.1, 0.2, -0.3]) * (i + 1), "b": [jnp.array(0.5) - i,
                                                              jnp.eye(2) * i]}
"""


def _grads(mod: types.ModuleType, n: int) -> list[Any]:
    return [mod.grads_at(i) for i in range(n)]


def test_accum_python_int_k_eager(write_module: Loader) -> None:
    plain, dec = pair(write_module, ACCUM)
    calls = [("update", (g,)) for g in _grads(plain, 7)]
    check(plain, dec, "AccumSGD(init_params(), 3)", calls, modes=("eager",))


@pytest.mark.parametrize("jit", [False, True])
def test_accum_python_int_k_through_f_is_static_state_error(
    write_module: Loader, jit: bool
) -> None:
    plain, dec = pair(write_module, ACCUM)
    f, states = dec.AccumSGD(dec.init_params(), 3).functionalize()
    call = lambda f, s, g: f.update(s, g)  # noqa: E731
    with pytest.raises(autostate.errors.StaticStateError) as err:
        (jax.jit(call) if jit else call)(f, states, plain.grads_at(0))
    assert "'k'" in str(err.value) or "k" in str(err.value).split()
    assert_user_line(err.value, _file(dec))


def test_accum_array_k_python_if(write_module: Loader) -> None:
    plain, dec = pair(write_module, ACCUM)
    calls = [("update", (g,)) for g in _grads(plain, 7)]
    check(plain, dec, "AccumSGD(init_params(), 3, array_k=True)", calls, modes=("eager", "f"))
    f, states = dec.AccumSGD(dec.init_params(), 3, array_k=True).functionalize()
    with pytest.raises(autostate.errors.TracedValueError) as err:
        jit_call(f, states, plain.grads_at(0), method="update")
    assert_user_line(err.value, _file(dec))


@pytest.mark.parametrize("cls", ["AccumSGDCond", "AccumSGDWhere"])
def test_accum_array_k_traceable(write_module: Loader, cls: str) -> None:
    plain, dec = pair(write_module, ACCUM)
    calls = [("update", (g,)) for g in _grads(plain, 7)]
    check(plain, dec, f"{cls}(init_params(), 3, array_k=True)", calls)


@pytest.mark.parametrize("cls", ["AccumSGDCond", "AccumSGDWhere"])
def test_accum_scanned_over_gradient_stream(write_module: Loader, cls: str) -> None:
    plain, dec = pair(write_module, ACCUM)
    gs = _grads(plain, 8)
    ref = getattr(plain, cls)(plain.init_params(), 3, array_k=True)
    expected = [ref.update(g) for g in gs]
    f, states = getattr(dec, cls)(dec.init_params(), 3, array_k=True).functionalize()
    stacked = jax.tree_util.tree_map(lambda *v: jnp.stack(v), *gs)

    def body(s: Any, g: Any) -> Any:
        out, s = f.update(s, g)
        return s, out

    for run in (jax.lax.scan, jax.jit(jax.lax.scan, static_argnums=0)):
        s, outs = run(body, states, stacked)
        assert_same(jax.tree_util.tree_map(lambda *v: jnp.stack(v), *expected), outs, "outs")
        for k in s:
            assert_same(snapshot(plain_path(ref, k)), snapshot(s[k]), k)
        assert_same(snapshot(ref), snapshot(autostate.freeze(f, s)), "frozen")
    check_transform(
        plain,
        dec,
        f"{cls}(init_params(), 2, array_k=True)",
        [("update_scaled", (X,))] * 3,
        jnp.array(1.5),
        "grad",
    )


# ======================================================================================
# 7. Stored activations and forward hooks
# ======================================================================================

PROBE = """
def double_hook(module, x):
    return x * 2.0


def count_hook(module, x):
    module.hook_calls = module.hook_calls + 1
    return None


@DECORATE
class Probe:
    def __init__(self, seed, d, depth, none_init=False):
        keys = jax.random.split(jax.random.PRNGKey(seed), depth)
        self.layers = [jax.random.normal(k, (d, d)) * 0.5 for k in keys]
        self.last_hidden = None if none_init else jnp.zeros((d, d))
        self.attn_maps = []
        self.hooks = []
        self.hook_calls = jnp.zeros((), jnp.int32)

    def register_forward_hook(self, fn):
        self.hooks.append(fn)
        return self

    def clear_hook_calls(self):
        self.hook_calls = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.attn_maps = []
        for w in self.layers:
            a = jax.nn.softmax(x @ x.T / x.shape[-1])
            self.attn_maps = self.attn_maps + [a]
            x = jnp.tanh(a @ x @ w)
            for fn in self.hooks:
                r = fn(self, x)
                if r is not None:
                    x = r
        self.last_hidden = x
        return x.sum()


@DECORATE
class Logger:
    def __init__(self):
        self.log = []
        self.w = jnp.ones(3)

    def __call__(self, x):
        self.log.append(x.sum())
        return x * self.w


def hooked(seed):
    return Probe(seed, 3, 2).register_forward_hook(count_hook).register_forward_hook(double_hook)


def warmed(seed):
    m = hooked(seed)
    m(jnp.ones((3, 3)))
    return m
"""

XP = jnp.array([[1.0, 0.0, -1.0], [0.5, 2.0, 0.1], [-1.0, 1.0, 0.3]])


@pytest.mark.parametrize("build", ["Probe(0, 3, 2)", "hooked(0)"])
def test_stored_activations_and_hooks(write_module: Loader, build: str) -> None:
    plain, dec = pair(write_module, PROBE)
    calls = [
        ("__call__", (XP,)),
        ("__call__", (XP * 2,)),
        ("clear_hook_calls", ()),
        ("__call__", (-XP,)),
    ]
    check(plain, dec, build, calls)
    check_transform(plain, dec, build, [("__call__", (X,)), ("__call__", (X,))], XP, "grad")


def test_trainer_reads_last_hidden_and_attn_maps_after_f(write_module: Loader) -> None:
    plain, dec = pair(write_module, PROBE)
    xs = jnp.stack([XP, XP * 2, -XP])
    train_compare(
        plain,
        dec,
        "warmed(1)",
        xs,
        lambda out, get: (
            out + jnp.mean(get("last_hidden") ** 2) + sum(jnp.sum(a**2) for a in get("attn_maps"))
        ),
    )


def test_hook_registered_after_functionalize_is_not_seen_by_f(write_module: Loader) -> None:
    # f is a copy: a hook registered on the model afterwards changes the model only
    plain, dec = pair(write_module, PROBE)
    model = dec.Probe(0, 3, 2)
    f, states = model.functionalize()
    model.register_forward_hook(dec.double_hook)
    out, _ = jit_call(f, states, XP)
    assert_same(plain.Probe(0, 3, 2)(XP), out, "f without the hook")
    assert_same(
        plain.Probe(0, 3, 2).register_forward_hook(plain.double_hook)(XP),
        model(XP),
        "eager model with the hook",
    )


def test_last_hidden_none_init(write_module: Loader) -> None:
    # PyTorch's `self.last_hidden = None`: None is a placeholder, so the first write
    # means plain Python eagerly, through f and under jit (tests/test_static_state.py).
    plain, dec = pair(write_module, PROBE)
    calls = [("__call__", (XP,)), ("__call__", (XP * 2,))]
    check(plain, dec, "Probe(0, 3, 2, none_init=True)", calls)
    m = dec.Probe(0, 3, 2, none_init=True)
    m(XP)  # set eagerly first: then f works
    ref = plain.Probe(0, 3, 2, none_init=True)
    ref(XP)
    f, states = m.functionalize()
    out, states = jit_call(f, states, XP * 3)
    assert_same(ref(XP * 3), out, "after the eager first call")
    assert_same(snapshot(ref), snapshot(autostate.freeze(f, states)), "frozen")


def test_list_appended_in_forward_not_state(write_module: Loader) -> None:
    # log is only appended (never assigned outside __init__): not state. Eagerly and through
    # f without jit it collects like plain Python; under jit a clear error, no tracer.
    plain, dec = pair(write_module, PROBE)
    calls = [("__call__", (XP,)), ("__call__", (XP * 2,))]
    check(plain, dec, "Logger()", calls, modes=("eager", "f"))
    model = dec.Logger()
    f, states = model.functionalize()
    with pytest.raises(autostate.errors.StateAccessError) as err:
        jit_call(f, states, XP)
    assert "Logger.log" in str(err.value) and "fix:" in str(err.value)
    assert "test_fidelity_hunt30.py:" in str(err.value)
    assert model.log == []


# ======================================================================================
# 8. reset_parameters() and train()/eval() between steps
# ======================================================================================

RESET = """
@DECORATE
class Linear:
    def __init__(self, seed, din, dout):
        self.key = jax.random.PRNGKey(seed)
        self.din = din
        self.w = jnp.zeros((din, dout))
        self.b = jnp.zeros(dout)
        self.reset_parameters()

    def reset_parameters(self):
        self.key, k = jax.random.split(self.key)
        bound = 1.0 / self.din**0.5
        self.w = jax.random.uniform(k, self.w.shape, minval=-bound, maxval=bound)
        self.b = jnp.zeros_like(self.b)

    def __call__(self, x):
        return x @ self.w + self.b


@DECORATE
class Head:
    def __init__(self, seed, d):
        self.body = Linear(seed, d, d)
        self.out = Linear(seed + 1, d, 2)
        self.bn_mean = jnp.zeros(d)
        self.training = True
        self.resets = jnp.zeros((), jnp.int32)

    def train(self, mode=True):
        self.training = mode
        return self

    def eval(self):
        return self.train(False)

    def reset_head(self):
        self.out.reset_parameters()
        self.resets += 1

    def __call__(self, x):
        h = jnp.tanh(self.body(x))
        if self.training:
            self.bn_mean = 0.9 * self.bn_mean + 0.1 * h.mean(0)
        return self.out(h - self.bn_mean)
"""


def test_reset_parameters_between_steps(write_module: Loader) -> None:
    plain, dec = pair(write_module, RESET)
    calls = [
        ("__call__", (XP,)),
        ("reset_head", ()),
        ("__call__", (XP,)),
        ("reset_head", ()),
        ("__call__", (XP * 2,)),
    ]
    check(plain, dec, "Head(0, 3)", calls)
    check(plain, dec, "Head(0, 3).eval()", calls)


def test_reset_parameters_makes_weights_states(write_module: Loader) -> None:
    # w and b are assigned by reset_parameters(): states, not parameters of f. jax.grad over
    # the states dict reaches them; the plain model's gradient w.r.t. the same arrays agrees.
    plain, dec = pair(write_module, RESET)
    f, states = dec.Head(0, 3).functionalize()
    assert autostate.param_dict(f) == {}
    assert {"body.w", "body.b", "out.w", "out.b"} <= set(states)

    floats = {k: v for k, v in states.items() if jnp.issubdtype(v.dtype, jnp.floating)}

    def loss(fl: Any) -> Any:
        y, _ = f({**states, **fl}, XP)
        return jnp.sum(y**2)

    g = jax.jit(jax.grad(loss))(floats)
    ref = plain.Head(0, 3)

    def ref_loss(w: Any) -> Any:
        m = copy.deepcopy(ref)
        m.body.w, m.out.w = w
        return jnp.sum(m(XP) ** 2)

    gw = jax.grad(ref_loss)((ref.body.w, ref.out.w))
    assert_same(np.asarray(gw[0]), g["body.w"], "d body.w")
    assert_same(np.asarray(gw[1]), g["out.w"], "d out.w")


def test_eval_then_train_toggle_between_jitted_steps(write_module: Loader) -> None:
    plain, dec = pair(write_module, RESET)
    ref, model = plain.Head(2, 3), dec.Head(2, 3)
    call = jax.jit(lambda f, s, x: f(s, x))
    for mode, x in (("train", XP), ("eval", XP * 2), ("train", -XP), ("eval", XP)):
        getattr(ref, mode)()
        getattr(model, mode)()
        f, states = model.functionalize()
        out, states = call(f, states, x)
        model = autostate.freeze(f, states)
        assert_same(ref(x), out, f"{mode} output")
        assert_same(snapshot(ref), snapshot(model), f"{mode} attributes")
