"""Tutorial: checkpoint training with orbax's ``CheckpointManager`` and resume.

``f`` (the parameters), ``states`` (the running statistics) and the optax
state are pytrees, so one orbax checkpoint holds all three. The script trains
the tutorial classifier (``tutorial_train.py``) on the layer beneath the
model object, ``f, states = model.functionalize()``, saving every few steps with
``CheckpointManager``; then it builds the model under ``jax.eval_shape`` (an
abstract target: shapes and dtypes only, nothing allocated), restores the
latest step into it and finishes training. The resumed run must end exactly where an
uninterrupted run ends.

Run: ``python examples/tutorial_checkpoint.py`` (``--smoke`` for fewer steps).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from tutorial_train import Classifier, cross_entropy, load_data, make_optimizer

import autostate

BATCH = 64


def batches(x, y, steps, first):
    for step in range(first, first + steps):
        idx = np.random.default_rng(step).choice(len(x), BATCH, replace=False)
        yield step + 1, x[idx], y[idx]


def loss_fn(f, states, x, y):
    """The first tutorial's loss on ``f``: the new states come back with it."""
    logits, states = f(states, x)  # training mode: batch statistics, states updated
    return cross_entropy(logits, y), states


def make_train_step(optimizer):
    @jax.jit
    def train_step(f, states, opt_state, x, y):
        (loss, states), grads = jax.value_and_grad(loss_fn, has_aux=True)(f, states, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, f)
        return optax.apply_updates(f, updates), states, opt_state, loss

    return train_step


def abstract_target(optimizer, key):
    """The shapes and dtypes of a checkpoint, from a model built under ``jax.eval_shape``.

    Nothing is computed or allocated: the model, its ``functionalize()`` and the
    optimizer's ``init`` run on abstract values only.
    """

    def build(key):
        f, states = Classifier(key).functionalize()
        return {"params": f, "states": states, "opt_state": optimizer.init(f)}

    return jax.eval_shape(build, key)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="14 steps, saved every 4")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.save_every = 14, 4
    x_train, y_train, x_test, y_test = load_data(seed=0)
    half = args.steps // 2

    f, states = Classifier(jax.random.key(0)).functionalize()
    optimizer = make_optimizer()
    opt_state = optimizer.init(f)
    train_step = make_train_step(optimizer)

    with tempfile.TemporaryDirectory() as tmp:
        options = ocp.CheckpointManagerOptions(max_to_keep=2, save_interval_steps=args.save_every)
        with ocp.CheckpointManager(Path(tmp) / "run", options=options) as manager:
            # The first half of training, checkpointed every save_every steps.
            loss = loss2 = np.nan  # the last step's loss, of either job
            for step, x, y in batches(x_train, y_train, half, first=0):
                f, states, opt_state, loss = train_step(f, states, opt_state, x, y)
                tree = {"params": f, "states": states, "opt_state": opt_state}
                manager.save(step, args=ocp.args.StandardSave(tree))
            manager.wait_until_finished()
            print(f"trained {half} steps, loss {float(loss):.4f}; kept steps {manager.all_steps()}")

            # The job "crashes" here; the steps after the last checkpoint are lost. A
            # new job builds the model abstractly (shapes and dtypes only, no arrays)
            # and restores the latest checkpoint into it.
            resume_at = manager.latest_step()
            target = abstract_target(optimizer, jax.random.key(1))
            restored = manager.restore(resume_at, args=ocp.args.StandardRestore(target))
        f2, states2, opt_state2 = restored["params"], restored["states"], restored["opt_state"]
        print(f"restored step {resume_at} into a {type(f2).__name__} of {type(f2.model).__name__}")

    # Both jobs finish: the uninterrupted one from step `half`, the resumed one
    # from its checkpoint (batches depend only on the step number).
    for _, x, y in batches(x_train, y_train, args.steps - half, first=half):
        f, states, opt_state, loss = train_step(f, states, opt_state, x, y)
    for _, x, y in batches(x_train, y_train, args.steps - resume_at, first=resume_at):
        f2, states2, opt_state2, loss2 = train_step(f2, states2, opt_state2, x, y)
    gaps = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), (f, states), (f2, states2))
    gap = max(jax.tree.leaves(gaps))
    print(f"after {args.steps} steps: loss {float(loss2):.4f}, max |resumed - uninterrupted| = {gap:.1e}")
    assert gap < 1e-5, gap

    model = autostate.freeze(f2, states2).eval()
    acc = np.mean(np.asarray(model(x_test)).argmax(-1) == y_test)
    print(f"resumed model: test accuracy {acc:.1%}")
    print("ok")


if __name__ == "__main__":
    main()
