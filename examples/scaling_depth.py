"""Trace and compile time of a deep model: a rolled loop, an unrolled one, a hand-written scan.

One small residual block (a ``d x d`` matmul, a ``tanh`` and a running mean,
a state) is stacked ``depth`` times and run five ways under ``jax.jit``:

* ``stack, for loop``: ``for block in self.blocks: x = block(x)`` over an
  ``autostate.stack``; autostate rolls the loop into one ``lax.scan``;
* ``stack, lax.scan``: the same model, the scan written in the method;
* ``stack, not rolled``: the loop over the stack with Python branching on
  the layer index (``if i < 0:``), which cannot roll: the attempt is undone
  and the loop runs layer by layer;
* ``list, for loop``: the same loop over a Python list of blocks, which
  ``jax.jit`` unrolls (one copy of the block per layer);
* ``pure JAX, lax.scan``: no autostate; the stacked arrays and the states
  threaded by hand.

For each, the seconds to trace (``jax.jit(f).trace``), to lower and to
compile (``.lower().compile()``), the best of ``--repeat`` runs with JAX's
caches cleared in between, and the number of ``while`` loops in the
compiled program's text (1: one scan). All five give the same output.

Run: ``python examples/scaling_depth.py --depths 64 256``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import autostate

WIDTH = 64


@autostate.stateful
class Block:
    def __init__(self, key, d=WIDTH):
        self.w = jax.random.normal(key, (d, d)) / jnp.sqrt(d)
        self.mean = jnp.zeros(d)  # a state: a running mean of the inputs

    def __call__(self, x):
        self.mean = 0.9 * self.mean + 0.1 * x
        return x + jnp.tanh(x @ self.w)


@autostate.stateful
class Deep:
    def __init__(self, keys, stacked=True):
        blocks = [Block(k) for k in keys]
        self.blocks: Any = autostate.stack(blocks) if stacked else blocks

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x

    def scanned(self, x):
        return jax.lax.scan(lambda x, block: (block(x), None), x, self.blocks)[0]

    def branching(self, x):
        for i, block in enumerate(self.blocks):
            if i < 0:  # Python branching on the layer index: the loop cannot roll
                x = -x
            x = block(x)
        return x


def pure(params, states, x):
    """The same model in pure JAX: the scan and the states written by hand."""

    def step(x, layer):
        w, mean = layer
        return x + jnp.tanh(x @ w), 0.9 * mean + 0.1 * x

    x, means = jax.lax.scan(step, x, (params["w"], states["blocks.mean"]))
    return x, {"blocks.mean": means}


def variants(depth):
    keys = jax.random.split(jax.random.key(0), depth)
    f_stack, s_stack = autostate.functionalize(Deep(keys))
    f_list, s_list = autostate.functionalize(Deep(keys, stacked=False))
    params = {"w": jnp.stack([Block(k).w for k in keys])}
    return {
        "stack, for loop": (lambda s, x: f_stack(s, x), s_stack),
        "stack, lax.scan": (lambda s, x: f_stack.scanned(s, x), s_stack),
        "stack, not rolled": (lambda s, x: f_stack.branching(s, x), s_stack),
        "list, for loop": (lambda s, x: f_list(s, x), s_list),
        "pure JAX, lax.scan": (lambda s, x: pure(params, s, x), s_stack),
    }


def measure(fn, states, x, repeat):
    best = [np.inf, np.inf, np.inf]
    compiled: Any = None
    for _ in range(repeat):
        jax.clear_caches()
        t0 = time.perf_counter()
        traced = jax.jit(fn).trace(states, x)
        t1 = time.perf_counter()
        lowered = traced.lower()
        t2 = time.perf_counter()
        compiled = lowered.compile()
        t3 = time.perf_counter()
        best = [min(b, t) for b, t in zip(best, (t1 - t0, t2 - t1, t3 - t2))]
    loops = str(compiled.as_text()).count(" while(")
    out = compiled(states, x)[0]
    return best, loops, out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    x = jnp.ones(WIDTH)
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, width {WIDTH}")
    print(f"{'depth':>5}  {'variant':<20} {'trace':>7} {'lower':>7} {'compile':>8} {'total':>7}  loops")
    for depth in args.depths:
        reference = None
        for name, (fn, states) in variants(depth).items():
            (trace, lower, compile_), loops, out = measure(fn, states, x, args.repeat)
            if reference is None:
                reference = out
            np.testing.assert_allclose(out, reference, rtol=1e-4, atol=1e-4)
            total = trace + lower + compile_
            print(f"{depth:>5}  {name:<20} {trace:7.3f} {lower:7.3f} {compile_:8.3f} {total:7.3f}  {loops}")


if __name__ == "__main__":
    main()
