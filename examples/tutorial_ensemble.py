"""Tutorial: an ensemble of models with ``jax.vmap``.

``jax.vmap`` over random keys builds the ensemble: ``Classifier(key)`` and
``functionalize()`` run once per key, and what comes out is one ``f`` and one
``states`` dict whose arrays have a leading ensemble axis. Training vmaps the
same step over that axis (each member sees its own shuffle of the data), the
optax state included; the members' BatchNorm statistics stay separate.
Averaging the members' probabilities beats the average member.

Run: ``python examples/tutorial_ensemble.py`` (``--smoke`` for fewer steps).
"""

from __future__ import annotations

import argparse

import jax
import numpy as np
import optax
from tutorial_train import Classifier, load_data, loss_fn

import autostate

MEMBERS, BATCH = 4, 64


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--smoke", action="store_true", help="40 steps")
    args = parser.parse_args()
    if args.smoke:
        args.steps = 40
    x_train, y_train, x_test, y_test = load_data(seed=0)

    keys = jax.random.split(jax.random.key(0), MEMBERS)
    f, states = jax.vmap(lambda key: Classifier(key).functionalize())(keys)
    print("stacked parameters:", {k: v.shape for k, v in autostate.param_dict(autostate.freeze(f, states)).items()})
    print("stacked states:", {k: v.shape for k, v in states.items()})

    optimizer = optax.adam(3e-3)
    opt_state = jax.vmap(optimizer.init)(f)

    def member_step(f, states, opt_state, x, y):
        (loss, states), grads = jax.value_and_grad(loss_fn, has_aux=True)(f, states, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, f)
        return optax.apply_updates(f, updates), states, opt_state, loss

    train_step = jax.jit(jax.vmap(member_step))  # every argument has the ensemble axis

    @jax.jit
    def probabilities(f, states, x):
        member = lambda f, states: jax.nn.softmax(f(states, x)[0])  # noqa: E731
        return jax.vmap(member)(f, states)  # (MEMBERS, N, classes)

    rng = np.random.default_rng(0)
    loss = np.full(MEMBERS, np.nan)  # each member's last loss
    for _ in range(args.steps):
        idx = np.stack([rng.choice(len(x_train), BATCH, replace=False) for _m in range(MEMBERS)])
        f, states, opt_state, loss = train_step(f, states, opt_state, x_train[idx], y_train[idx])
    print(f"trained {args.steps} steps, member losses {[round(v, 3) for v in np.asarray(loss).tolist()]}")

    # Evaluation mode for every member at once: training is static, shared by the stack.
    f_eval, states = autostate.freeze(f, states).eval().functionalize()
    probs = probabilities(f_eval, states, x_test)
    members = (probs.argmax(-1) == y_test).mean(-1)
    ensemble = float((probs.mean(0).argmax(-1) == y_test).mean())
    print("member test accuracies:", [f"{a:.1%}" for a in members.tolist()])
    print(f"ensemble test accuracy: {ensemble:.1%} (mean member {float(members.mean()):.1%})")
    assert len(set(np.round(np.asarray(members), 6).tolist())) > 1, "members must differ"
    assert ensemble >= float(members.mean()), (ensemble, members)

    # One member out of the ensemble is an ordinary Classifier again.
    first = autostate.freeze(*jax.tree.map(lambda a: a[0], (f_eval, states)))
    eager = float((np.asarray(first(x_test)).argmax(-1) == y_test).mean())
    print(f"member 0 frozen, called eagerly: test accuracy {eager:.1%}")
    assert abs(eager - float(members[0])) < 1e-6
    print("ok")


if __name__ == "__main__":
    main()
