"""Hand-written JAX references of the realistic models the semantics tests train.

A GPT, a CNN and dropout written as plain functions of their parameters and
states, with the builders that make the decorated models they are compared
with (``gpt``, ``cnn``), the training steps of both sides, and the helpers
several semantics files share around them (``lifecycle`` moves one model
between eager, ``f`` and jitted calls against a plain twin). A semantics
test checks autostate against these; what they compute is not under test.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import autostate
from semantics.harness import (
    Loader,
    assert_same,
    assert_typed,
    attrs,
    pair,
    plain_path,
    read_plain,
    snapshot,
    staged,
)
from semantics.programs_containers import GPT
from semantics.programs_functional import CNN
from semantics.programs_shared import ADAM, N_BLOCKS, X_BATCH, XV1, XV2, Y_BATCH, Phase
from semantics.programs_submodels import LIGHTNING
from semantics.programs_transformations import TRANSITIONS


def params_of(f: Any) -> dict[str, Any]:
    return dict(autostate.param_dict(f))


@functools.cache
def jitted(method: str, *static: Any) -> Callable[..., Any]:
    """``f.<method>(states, *args, *static)`` under ``jax.jit``, one per method (shared by tests)."""

    def call(f: Any, s: Any, *a: Any) -> Any:
        return (f if method == "__call__" else getattr(f, method))(s, *a, *static)

    return staged(call)


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


def f_step(f: Any, o: Any, s: Any, x: Any, y: Any) -> Any:
    (loss, s), g = jax.value_and_grad(lambda f, s: f.loss(s, x, y), has_aux=True)(f, s)
    u, o = ADAM.update(g, o, f)
    return loss, optax.apply_updates(f, u), o, s


def r_step(p: Any, o: Any, s: Any, x: Any, y: Any) -> Any:
    (loss, s), g = jax.value_and_grad(ref_cnn_loss, has_aux=True)(p, s, x, y)
    u, o = ADAM.update(g, o, p)
    return loss, optax.apply_updates(p, u), o, s


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


def ref_dropout(key: Any, x: Any, rate: float = 0.5) -> Any:
    key, sub = jax.random.split(key)
    keep = jax.random.bernoulli(sub, 1 - rate, x.shape)
    return jnp.where(keep, x / (1 - rate), 0.0), key


def dqn_calls() -> list[tuple[str, tuple[Any, ...]]]:
    calls: list[tuple[str, tuple[Any, ...]]] = []
    for i, t in enumerate(TRANSITIONS * 2):
        calls.append(("add", t))
        if i >= 1:
            calls.append(("train_step", (0.1, 0.9)))
    return calls


def assert_shared(model: Any) -> None:
    assert model.items[1] is model.by["b"], "the shared sub-model was split"


def trained_pair(plain: types.ModuleType, dec: types.ModuleType, scale: float = 1.0) -> tuple[Any, Any]:
    ref, model = plain.Net(scale), dec.Net(scale)
    for x in (XV1, XV2, XV1):
        ref(x)
        model(x)
    return ref, model


def grads_of(mod: types.ModuleType, n: int) -> list[Any]:
    return [mod.grads_at(i) for i in range(n)]


def lightning(write_module: Loader) -> tuple[types.ModuleType, types.ModuleType]:
    return pair(write_module, "import weakref\n" + LIGHTNING)


def has_tracer(tree: Any) -> bool:
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(tree))


def step_jit() -> Callable[..., Any]:
    return staged(lambda f, s, x: f(s, x))


def batch(i: int) -> tuple[Any, Any]:
    return X_BATCH * (1.0 + 0.25 * i) - 0.1 * i, Y_BATCH + 0.1 * i


def lifecycle(
    plain: types.ModuleType, dec: types.ModuleType, build: str, phases: list[Phase]
) -> None:
    """Runs every call of ``phases`` on one plain model, and on one decorated model
    moved between modes: ``eager`` calls the model, ``f`` calls ``f(states, ...)``,
    ``jit`` calls a jitted ``f``; moving from ``f``/``jit`` to ``eager`` freezes,
    moving from ``eager`` to ``f``/``jit`` functionalizes. After each phase the
    outputs and every attribute must be the plain ones, dtypes and weak types
    included (a Python float is a weak 0-d array once it crossed jit)."""
    ref = eval(build, vars(plain))  # noqa: S307
    model = eval(build, vars(dec))  # noqa: S307
    f = states = None
    crossed_jit = False
    jitted: dict[str, Any] = {}
    for i, (mode, calls) in enumerate(phases):
        if mode == "eager" and f is not None:
            model, f, states = autostate.freeze(f, states), None, None
        if mode in ("f", "jit") and f is None:
            f, states = model.functionalize()
            model = None
        crossed_jit = crossed_jit or mode == "jit"
        for name, args in calls:
            expected = getattr(ref, name)(*args)
            if mode == "eager":
                got = getattr(model, name)(*args)
            elif mode == "f":
                fn = f if name == "__call__" else getattr(f, name)
                got, states = fn(states, *args)
            else:
                if name not in jitted:
                    jitted[name] = staged(
                        lambda f, s, *a, n=name: (f if n == "__call__" else getattr(f, n))(s, *a)
                    )
                got, states = jitted[name](f, states, *args)
            # (A compiled program may round floats differently from eager ops.)
            assert_typed(
                expected, got, f"phase {i} ({mode}) {name} output", crossed_jit, mode == "jit",
                exact=mode != "jit",
            )
        if mode == "eager":
            assert_typed(attrs(ref), attrs(model), f"phase {i} attributes", crossed_jit)
        else:
            for key, value in states.items():
                assert_typed(
                    plain_path(ref, key), value, f"phase {i} ({mode}) state {key}", crossed_jit,
                    exact=mode != "jit",
                )
    if f is not None:
        model = autostate.freeze(f, states)
    assert_typed(attrs(ref), attrs(model), "final attributes", crossed_jit)


def module_file_name(mod: types.ModuleType) -> str:
    return mod.__file__.rsplit("/", 1)[-1]


def staged_method_call(f: Any, states: Any, *args: Any, method: str = "__call__") -> Any:
    return staged(lambda f, s, *a: (f if method == "__call__" else getattr(f, method))(s, *a))(
        f, states, *args
    )


JF_STEP, JR_STEP = staged(f_step), staged(r_step)
