"""Tutorial: an ensemble of models as one model.

``jax.vmap`` over the constructor builds the ensemble inside a model:
``self.members = jax.vmap(Classifier)(keys)`` is one stacked sub-model whose
arrays have a leading member axis. A plain ``jax.vmap`` over it in a method
runs each member on its own batch (each member sees its own shuffle of the
data); each member reads and writes its own BatchNorm statistics, as a loop
over a list of members would. Training is the single-model step on the whole
ensemble, the optax state included (Adam's updates are elementwise, so the
members train apart). Averaging the members' probabilities beats the average
member.

Run: ``python examples/tutorial_ensemble.py`` (``--smoke`` for fewer steps).
"""

from __future__ import annotations

import argparse

import jax
import numpy as np
import optax
from tqdm import tqdm
from tutorial_train import Classifier, load_data

import autostate

MEMBERS, BATCH = 4, 64


class Ensemble(autostate.Stateful):
    def __init__(self, key, members):
        self.members = jax.vmap(Classifier)(jax.random.split(key, members))

    def __call__(self, x):  # x: (members, batch, features), one batch per member
        return jax.vmap(lambda member, x: member(x))(self.members, x)

    def probabilities(self, x):  # the same x for every member: (members, N, classes)
        return jax.vmap(lambda member: jax.nn.softmax(member(x)))(self.members)


def member_losses(f, states, x, y):
    logits, states = f(states, x)  # training mode: each member's batch statistics
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(-1)
    return losses.sum(), (losses, states)  # the members' losses are independent


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--smoke", action="store_true", help="40 steps")
    args = parser.parse_args()
    if args.smoke:
        args.steps = 40
    x_train, y_train, x_test, y_test = load_data(seed=0)

    f, states = Ensemble(jax.random.key(0), MEMBERS).functionalize()
    print("stacked parameters:", {k: v.shape for k, v in autostate.param_dict(f).items()})
    print("stacked states:", {k: v.shape for k, v in states.items()})

    optimizer = optax.adam(3e-3)
    opt_state = optimizer.init(f)

    @jax.jit
    def train_step(f, states, opt_state, x, y):
        grads, (losses, states) = jax.grad(member_losses, has_aux=True)(f, states, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, f)
        return optax.apply_updates(f, updates), states, opt_state, losses

    rng = np.random.default_rng(0)
    loss = np.full(MEMBERS, np.nan)  # each member's last loss
    # A progress bar (on stderr): examples per second over all members, and
    # the members' mean loss, read every 10 steps.
    with tqdm(total=args.steps * MEMBERS * BATCH, desc="training", unit=" examples",
              unit_scale=True) as bar:
        for i in range(args.steps):
            idx = np.stack(
                [rng.choice(len(x_train), BATCH, replace=False) for _m in range(MEMBERS)]
            )
            f, states, opt_state, loss = train_step(
                f, states, opt_state, x_train[idx], y_train[idx]
            )
            bar.update(MEMBERS * BATCH)
            if i % 10 == 0 or i == args.steps - 1:
                bar.set_postfix(mean_loss=f"{float(np.mean(loss)):.4f}")
    print(f"trained {args.steps} steps, member losses {[round(v, 3) for v in np.asarray(loss).tolist()]}")

    # Evaluation mode for every member at once: training is static, shared by the stack.
    model = autostate.freeze(f, states).eval()
    f_eval, states = model.functionalize()
    probs, _ = jax.jit(f_eval.probabilities)(states, x_test)
    members = (probs.argmax(-1) == y_test).mean(-1)
    ensemble = float((probs.mean(0).argmax(-1) == y_test).mean())
    print("member test accuracies:", [f"{a:.1%}" for a in members.tolist()])
    print(f"ensemble test accuracy: {ensemble:.1%} (mean member {float(members.mean()):.1%})")
    assert len(set(np.round(np.asarray(members), 6).tolist())) > 1, "members must differ"
    assert ensemble >= float(members.mean()), (ensemble, members)

    # One member out of the stack is an ordinary Classifier again.
    first = jax.tree.map(lambda a: a[0], model.members)
    eager = float((np.asarray(first(x_test)).argmax(-1) == y_test).mean())
    print(f"member 0 taken out of the stack, called eagerly: test accuracy {eager:.1%}")
    assert abs(eager - float(members[0])) < 1e-6
    print("ok")


if __name__ == "__main__":
    main()
