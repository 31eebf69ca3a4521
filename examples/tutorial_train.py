"""Tutorial: a first model, trained with optax, evaluated with running statistics.

A small classifier for scikit-learn's bundled 8x8 digits (no download), written
as a plain Python class of ``autostate.nn`` layers, PyTorch's way:
``BatchNorm1d`` updates its running mean and variance in ``__call__``. The
steps:

1. write the model and call it eagerly, like PyTorch;
2. ``f, states = model.functionalize()``: ``f`` is a pytree of the parameters,
   ``states`` a dict of the running statistics;
3. train with ``optax.adamw``, weight decay masked by path (Linear weights
   only, not biases or BatchNorm scales);
4. evaluate under ``jit`` with the running statistics: ``model.eval()``, as
   in PyTorch, and from a trained ``f``:
   ``autostate.freeze(f, states).eval().functionalize()``;
5. ``autostate.freeze(f, states)`` gives the trained model back as an object.

Run: ``python examples/tutorial_train.py`` (``--smoke`` for a short run).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import autostate
from autostate import nn


# --- 1. The model: plain classes that mutate self ------------------------------
# autostate.nn's layers follow PyTorch (initialisation, weight layouts, names,
# BatchNorm's momentum and running statistics), and each is itself a plain
# @autostate.stateful class: BatchNorm1d assigns self.running_mean in __call__.
# Subclassing autostate.Stateful decorates Classifier the same way, and lets
# mypy and pyright see the functionalize(), train() and eval() it gains.
class Classifier(autostate.Stateful):
    def __init__(self, key, n_in=64, n_hidden=64, n_classes=10):
        k1, k2 = jax.random.split(key)
        self.hidden = nn.Linear(n_in, n_hidden, key=k1)
        self.norm = nn.BatchNorm1d(n_hidden)
        self.head = nn.Linear(n_hidden, n_classes, key=k2)

    def __call__(self, x):
        return self.head(jax.nn.relu(self.norm(self.hidden(x))))


# --- 2. Pure functions of (f, states) ----------------------------------------------
def loss_fn(f, states, x, y):
    logits, states = f(states, x)  # training mode: batch statistics, states updated
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), states


def weight_decay_mask(f):
    """True for the Linear weights: paths ending in ``.weight`` with two axes.

    BatchNorm's scale is a ``.weight`` too, with one axis: no decay on it.
    """
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: jax.tree_util.keystr(path).endswith(".weight") and leaf.ndim == 2, f
    )


def make_optimizer(f, learning_rate=3e-3):
    return optax.adamw(learning_rate, weight_decay=1e-2, mask=weight_decay_mask(f))


@jax.jit
def predict(f, states, x):
    return f(states, x)[0].argmax(-1)


def accuracy(f, states, x, y):
    """Test accuracy in evaluation mode: the running statistics, not updated.

    ``training`` is static, part of ``f``'s structure: the evaluation ``f`` is
    made from the trained values, and ``predict`` compiles once per mode.
    """
    f_eval, states = autostate.freeze(f, states).eval().functionalize()
    return float(jnp.mean(predict(f_eval, states, x) == y))


def load_data(seed):
    x, y = load_digits(return_X_y=True)
    split = train_test_split(x.astype(np.float32), y, test_size=0.25, random_state=seed)
    x_train, x_test, y_train, y_test = (np.asarray(a) for a in split)
    mean, std = x_train.mean(0), x_train.std(0) + 1e-6
    return (x_train - mean) / std, y_train, (x_test - mean) / std, y_test


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--smoke", action="store_true", help="2 epochs")
    args = parser.parse_args()
    if args.smoke:
        args.epochs = 2
    x_train, y_train, x_test, y_test = load_data(seed=0)

    model = Classifier(jax.random.key(0))
    model(x_train[:8])  # eager, plain Python: the running mean moves in place
    print(f"eager call moved the running mean: {bool(jnp.any(model.norm.running_mean != 0))}")

    f, states = model.functionalize()
    print("states:", sorted(states))
    print("parameters:", sorted(autostate.param_dict(model)))
    mask = weight_decay_mask(f)
    leaves = jax.tree_util.tree_flatten_with_path(mask)[0]
    print("weight decay on:", [jax.tree_util.keystr(path) for path, decay in leaves if decay])

    optimizer = make_optimizer(f)
    opt_state = optimizer.init(f)  # f is a pytree: optax takes it as it is

    @jax.jit
    def train_step(f, states, opt_state, x, y):
        (loss, states), grads = jax.value_and_grad(loss_fn, has_aux=True)(f, states, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, f)
        return optax.apply_updates(f, updates), states, opt_state, loss

    rng = np.random.default_rng(0)
    before = acc = accuracy(f, states, x_test, y_test)
    for epoch in range(1, args.epochs + 1):
        order = rng.permutation(len(x_train))
        losses = []
        for i in range(len(x_train) // args.batch_size):
            idx = order[i * args.batch_size : (i + 1) * args.batch_size]
            f, states, opt_state, loss = train_step(f, states, opt_state, x_train[idx], y_train[idx])
            losses.append(float(loss))
        acc = accuracy(f, states, x_test, y_test)
        print(f"epoch {epoch}  loss {np.mean(losses):.4f}  test accuracy {acc:.1%}")
    assert acc > max(before, 0.8), (before, acc)

    # Training returned new f and states; the model object it started from is unchanged.
    trained = autostate.freeze(f, states)
    print(f"original model unchanged: {bool(jnp.all(model.head.weight != trained.head.weight))}")
    trained.eval()  # PyTorch's idiom: every sub-model now uses its running statistics
    eager = float(np.mean(np.asarray(trained(x_test)).argmax(-1) == y_test))
    print(f"frozen {type(trained).__name__}, called eagerly: test accuracy {eager:.1%}")
    assert abs(eager - acc) < 1e-6
    print("ok")


if __name__ == "__main__":
    main()
