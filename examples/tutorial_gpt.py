"""Tutorial: a GPT-style decoder with a KV cache, greedy decoding, ``jax.export``.

The decoder is written for one sequence, the way one writes it in PyTorch:
each attention layer appends the new keys and values to its cache
(``self.k``, ``self.v``) and the decoder advances its position
(``self.length``). Its blocks are an ``autostate.stack`` (``jax.vmap`` of the
constructor) run by a plain ``for`` loop, which autostate rolls into one
``lax.scan`` under a trace, each layer writing its own cache. Those
attributes are states, so ``functionalize()`` turns the model into
``f(states, tokens) -> (logits, new_states)``. Then:

1. train it (batched with ``jax.vmap``, optax adam) to continue counting
   modulo the vocabulary: after ``3 4 5`` comes ``6 7 8 ...``;
2. decode greedily under ``jax.jit`` with the ``generate`` method: one
   prefill call for the prompt, then a ``jax.lax.fori_loop`` of one-token
   steps that write the cache (autostate threads it through the loop);
3. check the cached decoding against recomputing the whole sequence;
4. export the decoding loop with ``jax.export`` (parameters baked in),
   serialize it, and run the deserialized program; export ``generate`` with
   ``autostate.export`` too.

With ``--bf16`` the model computes in bfloat16 while its parameters, the
optimizer's moments and the KV cache stay float32 (mixed precision): each
weight is cast to the activations' dtype where it is used, the norms and the
softmax compute in float32, and the logits come back in float32 for the loss.

Run: ``python examples/tutorial_gpt.py`` (``--smoke`` for a shorter training,
``--bf16`` for bfloat16 compute).
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

import autostate

VOCAB, SEQ, MAX_LEN = 16, 12, 32


def rms_norm(x):
    """Normalises in float32 (at least), returns ``x``'s dtype."""
    y = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    return (y * jax.lax.rsqrt(jnp.mean(y * y, -1, keepdims=True) + 1e-6)).astype(x.dtype)


@autostate.stateful
class Attention:
    def __init__(self, key, d, heads, max_len):
        k1, k2 = jax.random.split(key)
        self.qkv = jax.random.normal(k1, (d, 3 * d)) / jnp.sqrt(d)
        self.out = jax.random.normal(k2, (d, d)) / jnp.sqrt(d)
        self.heads = heads
        self.k = jnp.zeros((max_len, heads, d // heads))  # the KV cache: states,
        self.v = jnp.zeros((max_len, heads, d // heads))  # assigned in __call__

    def __call__(self, x, start):
        """``x``: the ``(T, d)`` activations of positions ``start .. start+T-1``."""
        (t, d), h, dtype = x.shape, self.heads, x.dtype  # compute in x's dtype
        q, k, v = (a.reshape(t, h, d // h) for a in jnp.split(x @ self.qkv.astype(dtype), 3, axis=-1))
        self.k = jax.lax.dynamic_update_slice(self.k, k.astype(self.k.dtype), (start, 0, 0))
        self.v = jax.lax.dynamic_update_slice(self.v, v.astype(self.v.dtype), (start, 0, 0))
        scores = jnp.einsum("thd,shd->hts", q, self.k.astype(dtype)) / jnp.sqrt(d // h)
        causal = jnp.arange(self.k.shape[0])[None, :] <= (start + jnp.arange(t))[:, None]
        scores = jnp.where(causal, scores, -jnp.inf).astype(jnp.float32)  # softmax in float32
        weights = jax.nn.softmax(scores, axis=-1).astype(dtype)
        attended = jnp.einsum("hts,shd->thd", weights, self.v.astype(dtype)).reshape(t, d)
        return attended @ self.out.astype(dtype)


@autostate.stateful
class Block:
    def __init__(self, key, d, heads, max_len):
        k1, k2, k3 = jax.random.split(key, 3)
        self.attention = Attention(k1, d, heads, max_len)
        self.up = jax.random.normal(k2, (d, 4 * d)) / jnp.sqrt(d)
        self.down = jax.random.normal(k3, (4 * d, d)) / jnp.sqrt(4 * d)

    def __call__(self, x, start):
        x = x + self.attention(rms_norm(x), start)
        up, down = self.up.astype(x.dtype), self.down.astype(x.dtype)
        return x + jax.nn.gelu(rms_norm(x) @ up) @ down


@autostate.stateful
class Decoder:
    def __init__(self, key, vocab=VOCAB, d=32, heads=4, layers=2, max_len=MAX_LEN, dtype=jnp.float32):
        keys = jax.random.split(key, layers + 2)
        self.dtype = dtype  # the compute dtype; the parameters are float32
        self.embed = jax.random.normal(keys[0], (vocab, d)) * 0.1
        self.positions = jax.random.normal(keys[1], (max_len, d)) * 0.1
        # The blocks are a stack: one Block whose arrays carry a leading layer
        # axis, built by jax.vmap of the constructor. Each layer has its own
        # weights and its own KV cache (``blocks.attention.k``: layers, max_len, ...).
        self.blocks = autostate.stack(jax.vmap(lambda k: Block(k, d, heads, max_len))(keys[2:]))
        self.length = jnp.zeros((), jnp.int32)  # tokens seen so far: a state

    def __call__(self, tokens):
        """Logits ``(T, vocab)`` for the next token after each of ``tokens``."""
        start = self.length
        x = self.embed[tokens] + jax.lax.dynamic_slice_in_dim(self.positions, start, len(tokens))
        x = x.astype(self.dtype)
        # A plain loop over the stack: under a trace it runs as one lax.scan, each
        # step one layer writing its own cache rows; the program does not grow
        # with depth.
        for block in self.blocks:
            x = block(x, start)
        self.length += len(tokens)
        return (rms_norm(x) @ self.embed.T.astype(x.dtype)).astype(jnp.float32)

    def generate(self, prompt, n_new):
        """Greedy decoding: prefill ``prompt``, then ``n_new`` one-token steps.

        The ``fori_loop`` body calls the model, which writes the cache and the
        length: those states are threaded through the loop's carry for us.
        """
        logits = self(prompt)

        def step(i, carry):
            token, out = carry
            out = out.at[i].set(token)
            logits = self(token[None])
            return logits[-1].argmax().astype(jnp.int32), out

        first = logits[-1].argmax().astype(jnp.int32)
        _, out = jax.lax.fori_loop(0, n_new, step, (first, jnp.zeros(n_new, jnp.int32)))
        return out


def counting_batch(key, batch):
    """Sequences ``r, r+1, r+2, ...`` modulo ``VOCAB`` from random starts ``r``."""
    starts = jax.random.randint(key, (batch, 1), 0, VOCAB)
    return (starts + jnp.arange(SEQ)) % VOCAB


def train(f, empty, steps):
    """Next-token training; every sequence starts from the empty cache ``empty``.

    Returns the trained ``f``, the last loss and the loss curve ``{step: loss}``
    (read every 10 steps).
    """

    def loss_fn(f, seqs):
        logits = jax.vmap(lambda seq: f(empty, seq[:-1])[0])(seqs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, seqs[:, 1:]).mean()

    optimizer = optax.adam(1e-2)

    @jax.jit
    def step(f, opt_state, key):
        loss, grads = jax.value_and_grad(loss_fn)(f, counting_batch(key, 32))
        updates, opt_state = optimizer.update(grads, opt_state, f)
        return optax.apply_updates(f, updates), opt_state, loss

    opt_state = optimizer.init(f)
    loss, curve = np.nan, {}  # the last step's loss, and the losses read
    # A progress bar (on stderr): sequences per second and the loss, read
    # every 10 steps (reading it waits for the step to finish).
    with tqdm(total=steps * 32, desc="training", unit=" seqs", unit_scale=True) as bar:
        for i in range(steps):
            f, opt_state, loss = step(f, opt_state, jax.random.key(i))
            bar.update(32)
            if i % 10 == 0 or i == steps - 1:
                curve[i] = float(loss)
                bar.set_postfix(loss=f"{curve[i]:.4f}")
    return f, float(loss), curve


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--smoke", action="store_true", help="120 training steps")
    parser.add_argument("--bf16", action="store_true", help="bfloat16 compute, float32 parameters")
    args = parser.parse_args()
    if args.smoke:
        args.steps = 120

    model = Decoder(jax.random.key(0), dtype=jnp.bfloat16 if args.bf16 else jnp.float32)
    f, empty = autostate.functionalize(model)
    print(f"{len(empty)} states:", ", ".join(sorted(empty)))
    # Under a trace the loop over the blocks is one lax.scan, whatever the depth.
    jaxpr = str(jax.make_jaxpr(f)(empty, jnp.arange(4)))
    print("the loop over the blocks is one scan:", jaxpr.count("scan[") == 1)
    f, loss, curve = train(f, empty, args.steps)
    print(f"trained {args.steps} steps, loss {loss:.4f}")
    shown = [i for i in curve if i % 30 == 0 or i == args.steps - 1]
    print("loss by step:", ", ".join(f"{i}: {curve[i]:.4f}" for i in shown))
    dtypes = {a.dtype.name for a in jax.tree_util.tree_leaves((f, empty)) if a.dtype != jnp.int32}
    print(f"compute {jnp.dtype(model.dtype).name}, parameters and states {sorted(dtypes)}")

    prompt, n_new = jnp.array([3, 4, 5], jnp.int32), 10
    decode = jax.jit(lambda f, states, prompt: f.generate(states, prompt, n_new))
    out, states = decode(f, empty, prompt)
    print("prompt", prompt.tolist(), "-> greedy", out.tolist())
    print("cache length after decoding:", int(states["length"]))
    assert out.tolist() == [(6 + i) % VOCAB for i in range(n_new)], out
    assert int(states["length"]) == len(prompt) + n_new

    # The cache changes nothing but the cost: the whole sequence at once, from an
    # empty cache, predicts the same tokens.
    full, _ = f(empty, jnp.concatenate([prompt, out[:-1]]))
    assert full[len(prompt) - 1 :].argmax(-1).tolist() == out.tolist()
    print("cached decoding == full recompute: True")

    # Export the decoding loop: the parameters become constants of the program,
    # the states (the empty cache) stay an input.
    loop = jax.jit(functools.partial(f.generate, n_new=n_new))
    blob = jax.export.export(loop)(empty, prompt).serialize()
    program = jax.export.deserialize(blob)
    exported_out, exported_states = program.call(empty, jnp.array([9, 10, 11], jnp.int32))
    print(f"exported ({len(blob)} bytes): [9, 10, 11] ->", exported_out.tolist())
    assert exported_out.tolist() == [(12 + i) % VOCAB for i in range(n_new)], exported_out
    np.testing.assert_array_equal(exported_states["blocks.attention.k"].shape, (2, MAX_LEN, 4, 8))

    # The trained model exported with autostate.export: the program takes and
    # returns the flat state_dict. One prefill step, then the generate method.
    trained = autostate.freeze(f, empty)
    spec = jax.ShapeDtypeStruct((len(prompt),), jnp.int32)
    step = autostate.export(trained, spec)
    logits, new_states = step.call(autostate.state_dict(trained), prompt)
    print("autostate.export prefill: next token", int(logits[-1].argmax()), "length", int(new_states["length"]))
    program = autostate.export(trained, spec, n_new, method="generate", static_argnums=1)
    out, new_states = program.call(autostate.state_dict(trained), prompt)
    print("autostate.export generate:", out.tolist(), "length", int(new_states["length"]))
    assert out.tolist() == [(6 + i) % VOCAB for i in range(n_new)], out
    print("ok")


if __name__ == "__main__":
    main()
