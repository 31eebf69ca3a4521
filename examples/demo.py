"""A BatchNorm MLP written as plain Python classes, trained with jitted SGD.

The model mutates ``self`` the way a PyTorch module does (BatchNorm updates its
running mean and variance in ``__call__``); ``@autostate.stateful`` turns it
into a pure function ``f(states, x) -> (logits, new_states)`` that ``jax.jit``
and ``jax.grad`` accept. Data: scikit-learn's bundled 8x8 digits (no download).

Run: ``make demo`` (or ``.venv/bin/python examples/demo.py [--epochs N] [--smoke]``).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import autostate

LEARNING_RATE = 0.05


@autostate.stateful
class Linear:
    def __init__(self, key, n_in, n_out):
        self.w = jax.random.normal(key, (n_in, n_out)) * jnp.sqrt(2.0 / n_in)
        self.b = jnp.zeros(n_out)

    def __call__(self, x):
        return x @ self.w + self.b


@autostate.stateful
class BatchNorm:
    def __init__(self, n, momentum=0.9, eps=1e-5):
        self.scale = jnp.ones(n)  # parameters: only assigned in __init__
        self.shift = jnp.zeros(n)
        self.mean = jnp.zeros(n)  # state: __call__ assigns it
        self.var = jnp.ones(n)
        self.momentum = momentum  # static config: python floats
        self.eps = eps
        self.training = True  # static config too: model.train()/model.eval() set it

    def __call__(self, x):
        if self.training:
            m, v = x.mean(0), x.var(0)
            self.mean = self.momentum * self.mean + (1 - self.momentum) * m
            self.var = self.momentum * self.var + (1 - self.momentum) * v
        else:
            m, v = self.mean, self.var
        return (x - m) / jnp.sqrt(v + self.eps) * self.scale + self.shift


class MLP(autostate.Stateful):  # the same as @autostate.stateful, typed
    def __init__(self, key, sizes=(64, 128, 128), n_classes=10):
        keys = jax.random.split(key, len(sizes))
        self.blocks = [
            (Linear(k, n_in, n_out), BatchNorm(n_out))
            for k, n_in, n_out in zip(keys, sizes[:-1], sizes[1:])
        ]
        self.head = Linear(keys[-1], sizes[-1], n_classes)

    def __call__(self, x):
        for linear, norm in self.blocks:
            x = jax.nn.relu(norm(linear(x)))
        return self.head(x)


def loss_fn(f, states, x, y):
    logits, states = f(states, x)
    loss = -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(len(y)), y])
    return loss, states


@jax.jit
def train_step(f, states, x, y):
    (loss, states), grads = jax.value_and_grad(loss_fn, has_aux=True)(f, states, x, y)
    f = jax.tree_util.tree_map(lambda p, g: p - LEARNING_RATE * g, f, grads)
    return f, states, loss


@jax.jit
def accuracy(f, states, x, y):
    logits, _ = f(states, x)
    return jnp.mean(logits.argmax(-1) == y)


def evaluate(f, states, x, y):
    # As PyTorch's model.eval(): the trained model, switched to its running statistics.
    # `training` is static config, so the eval f compiles once and is reused.
    eval_f, eval_states = autostate.freeze(f, states).eval().functionalize()
    return accuracy(eval_f, eval_states, x, y)


def load_data(seed):
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data.astype(np.float32), digits.target, test_size=0.2, random_state=seed
    )
    mean, std = x_train.mean(0), x_train.std(0) + 1e-6
    return (x_train - mean) / std, y_train, (x_test - mean) / std, y_test


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="1 epoch on 256 examples")
    args = parser.parse_args()
    start = time.perf_counter()

    x_train, y_train, x_test, y_test = load_data(args.seed)
    if args.smoke:
        args.epochs, x_train, y_train = 1, x_train[:256], y_train[:256]
    print(f"digits: {len(x_train)} train / {len(x_test)} test, 8x8 pixels, 10 classes")

    model = MLP(jax.random.PRNGKey(args.seed))
    f, states = autostate.functionalize(model)
    rng = np.random.default_rng(args.seed)
    n_batches = len(x_train) // args.batch_size
    for epoch in range(1, args.epochs + 1):
        order = rng.permutation(len(x_train))
        losses = []
        for i in range(n_batches):
            idx = order[i * args.batch_size : (i + 1) * args.batch_size]
            f, states, loss = train_step(f, states, x_train[idx], y_train[idx])
            losses.append(loss)
        acc = evaluate(f, states, x_test, y_test)
        print(f"epoch {epoch:2d}  loss {np.mean(losses):.4f}  test accuracy {acc:.1%}")

    model = autostate.freeze(f, states).eval()  # an MLP again, trained, in eval mode
    eager_acc = np.mean(np.asarray(model(x_test)).argmax(-1) == y_test)
    print(f"frozen {type(model).__name__}, called eagerly: test accuracy {eager_acc:.1%}")
    print(f"{len(states)} states:")
    for name, value in states.items():
        print(f"  {name:20s} {value.shape}")
    print(f"done in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
