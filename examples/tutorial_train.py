"""Tutorial: a first model, trained with optax, evaluated with running statistics.

A small classifier for scikit-learn's bundled 8x8 digits (no download), written
as a plain Python class of ``autostate.nn`` layers, PyTorch's way:
``BatchNorm1d`` updates its running mean and variance in ``__call__``. One
model object, from start to finish:

1. write the model and call it eagerly, like PyTorch;
2. a training step compiled with ``autostate.jit``: ``autostate.value_and_grad``
   of the loss and ``autostate.Optimizer(model, optax.adamw(...))``, weight
   decay masked by path (Linear weights only, not biases or BatchNorm scales),
   update the model in place;
3. ``model.train()`` / ``model.eval()`` between epochs, as in PyTorch: the
   evaluation runs on the same object with the running statistics;
4. ``autostate.save`` / ``autostate.load`` the trained model.

Run: ``python examples/tutorial_train.py`` (``--smoke`` for a short run).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

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


# --- 2. The loss, the optimizer, the compiled steps ------------------------------
def cross_entropy(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def loss_fn(model, x, y):
    return cross_entropy(model(x), y)  # in training mode the running statistics move


def decays(path: str, leaf) -> bool:
    """Weight decay on the Linear weights: paths ending in ``.weight`` with two axes.

    BatchNorm's scale is a ``.weight`` too, with one axis: no decay on it.
    """
    return path.endswith(".weight") and leaf.ndim == 2


def weight_decay_mask(params):
    """optax's mask: a tree of booleans shaped like the parameters it is given."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: decays(jax.tree_util.keystr(path), leaf), params
    )


def make_optimizer(learning_rate=3e-3):
    return optax.adamw(learning_rate, weight_decay=1e-2, mask=weight_decay_mask)


@autostate.jit
def train_step(model, opt, x, y):
    loss, grads = autostate.value_and_grad(loss_fn)(model, x, y)  # grads.head.weight, ...
    opt.update(grads)  # the model's parameters change in place
    return loss


@autostate.jit
def predict(model, x):
    return model(x).argmax(-1)


def accuracy(model, x, y):
    return float(jnp.mean(predict(model, x) == y))


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
    print("states:", sorted(autostate.state_dict(model)))
    params = autostate.param_dict(model)
    print("parameters:", sorted(params))
    print("weight decay on:", [name for name, leaf in params.items() if decays(name, leaf)])

    opt = autostate.Optimizer(model, make_optimizer())
    norm = model.norm
    rng = np.random.default_rng(0)
    before = acc = accuracy(model.eval(), x_test, y_test)
    steps = len(x_train) // args.batch_size
    for epoch in range(1, args.epochs + 1):
        model.train()  # batch statistics; the running ones move
        order = rng.permutation(len(x_train))
        losses = []
        # A progress bar (on stderr): examples per second and the running loss.
        with tqdm(total=steps * args.batch_size, desc=f"epoch {epoch}", unit=" examples",
                  unit_scale=True, leave=False) as bar:
            for i in range(steps):
                idx = order[i * args.batch_size : (i + 1) * args.batch_size]
                losses.append(float(train_step(model, opt, x_train[idx], y_train[idx])))
                bar.update(args.batch_size)
                bar.set_postfix(loss=f"{np.mean(losses[-10:]):.4f}", refresh=False)
        model.eval()  # the running statistics, not updated
        acc = accuracy(model, x_test, y_test)
        print(f"epoch {epoch}  loss {np.mean(losses):.4f}  test accuracy {acc:.1%}")
    assert acc > max(before, 0.8), (before, acc)
    print(f"steps: {int(opt.step)}, the same sub-models: {model.norm is norm}")

    # --- 3. Save the trained model, load it into a fresh one ------------------------
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "classifier.npz"
        autostate.save(path, model)  # parameters and states; the path comes first
        loaded = autostate.load(path, like=Classifier(jax.random.key(1))).eval()
    eager = float(np.mean(np.asarray(loaded(x_test)).argmax(-1) == y_test))
    print(f"loaded {type(loaded).__name__}, called eagerly: test accuracy {eager:.1%}")
    assert abs(eager - acc) < 1e-6
    print("ok")


if __name__ == "__main__":
    main()
