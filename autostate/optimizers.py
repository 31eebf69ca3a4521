"""``autostate.Optimizer``: an optax-style transformation's state held like a model.

``Optimizer(model, tx)`` holds the transformation's state for one model and
updates the model's parameters in place, with the gradients ``autostate.grad``
gives (shaped like the model's ``f``), eagerly and inside ``autostate.jit``.
It is a ``@stateful`` class, decorated when this module is first imported
(``autostate.Optimizer``'s first use), not by every ``import autostate``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from autostate import graph as _graph
from autostate import sharding as _sharding
from autostate import tree as _tree
from autostate.api import functionalize, functionalize_as, stateful
from autostate.errors import InvalidArgumentError, format_error, user_location
from autostate.functional import ConstantRef, FunctionalModel, instance_pairs

__all__ = ["Optimizer"]


def _assign_params(model: Any, new: FunctionalModel) -> None:
    """Assigns the parameters of ``new`` (the model's ``f`` with new leaves) to
    ``model`` attribute by attribute; sub-models stay the same objects, and
    ``ConstantRef`` entries keep the model's value."""
    for obj, twin in instance_pairs(model, new):
        states = _tree.info_of(obj).state
        for attr, value in twin.__dict__.items():
            if attr in states or _graph.holds_instance(value):
                continue
            old = _graph.materialized(obj.__dict__.get(attr))  # (a compiled call's lazy value)
            if value is old:
                continue
            if _holds_constant(value):
                value = jax.tree_util.tree_map(
                    lambda n, o: o if type(n) is ConstantRef else n, value, old,
                    is_leaf=lambda x: type(x) is ConstantRef,
                )
                if value is old:
                    continue
            setattr(obj, attr, value)


def _holds_constant(value: Any) -> bool:
    return any(
        type(leaf) is ConstantRef
        for leaf in jax.tree_util.tree_leaves(value, is_leaf=lambda x: type(x) is ConstantRef)
    )


@stateful
class Optimizer:
    """An optax-style transformation's state for one model, updating the
    model's trainable parameters in place.

    ``tx`` is anything with optax's ``init(params)`` and ``update(grads,
    state, params)`` (an ``optax.GradientTransformation``); the parameters it
    sees are the model's ``f``, so masks written for ``f``'s paths apply.
    Eagerly and inside ``autostate.jit``. The state is made with every array
    that stands for a parameter (Adam's moments) in that parameter's
    sharding, shard by shard: on a model placed on devices, ``tx.init`` runs
    under ``jax.jit`` (``sharding.made_in_layout``), so it must be traceable,
    as optax's are.

    Args:
        model: the model to train.
        tx: the transformation.

    Examples:
        >>> import optax
        >>> @autostate.stateful
        ... class Scale:
        ...     def __init__(self):
        ...         self.w = jnp.full(2, 3.0)
        ...
        ...     def __call__(self, x):
        ...         return (self.w * x).sum()
        >>> model = Scale()
        >>> opt = autostate.Optimizer(model, optax.sgd(0.5))
        >>> opt.update(autostate.grad(lambda m, x: m(x))(model, jnp.ones(2)))
        >>> print(model.w, opt.step)
        [2.5 2.5] 1
    """

    def __init__(self, model: Any, tx: Any):
        self.model = model
        self.tx = tx
        f, _ = functionalize_as("autostate.Optimizer", model)
        # The structure the transformation's state follows: f's in the mode
        # the model had here (a mode is part of f's structure; the
        # parameters are the same in every mode).
        self.params_def = jax.tree_util.tree_structure(f)
        # Each moment made in its parameter's sharding, shard by shard: eagerly,
        # zeros_like of a weakly typed array lands on the default device.
        self.opt_state = _sharding.made_in_layout(tx.init, f)
        self.step = jnp.zeros((), jnp.int32)

    def update(self, grads: Any) -> None:
        """Applies ``grads`` (shaped like the model's ``f``, as ``autostate.grad``
        gives them) to the model's parameters."""
        f, _ = functionalize(self.model)
        _check_grads(grads, f, self.model)
        params, grads = (_as(self.params_def, tree, self.model) for tree in (f, grads))
        updates, self.opt_state = self.tx.update(grads, self.opt_state, params)
        new = jax.tree_util.tree_map(
            lambda p, u: jnp.asarray(p + u).astype(jnp.result_type(p)), params, updates
        )
        _assign_params(self.model, _as(jax.tree_util.tree_structure(f), new, self.model))
        self.step += 1


def _check_grads(grads: Any, f: FunctionalModel, model: Any) -> None:
    """Refuses gradients not shaped like ``model``'s ``f`` (in any mode): their
    arrays would be matched to its parameters by position alone."""
    count = len(jax.tree_util.tree_leaves(f))
    # What autostate.grad gives: its FunctionalModel, or a sub-model of it read
    # like the model's (``grads.backbone`` for an optimizer of ``model.backbone``).
    given_model = grads.model if isinstance(grads, FunctionalModel) else grads
    if isinstance(grads, FunctionalModel) or _graph.is_stateful_instance(grads):
        fits = type(given_model) is type(f.model) and len(jax.tree_util.tree_leaves(grads)) == count
    else:
        given: Any = jax.tree_util.tree_structure(grads)
        fits = given == jax.tree_util.tree_structure(f)
    if not fits:
        raise InvalidArgumentError(
            format_error(
                f"Optimizer.update was given gradients that are not shaped like the "
                f"{type(model).__name__}'s f (a {type(grads).__name__} of "
                f"{len(jax.tree_util.tree_leaves(grads))} arrays, for {count} trainable "
                "parameters): they would be matched to its parameters by position alone.",
                where=user_location(),
                fix="pass the gradients autostate.grad(loss)(model, ...) returns (or jax.grad "
                "with respect to f), transformed leaf by leaf if need be.",
            )
        )


def _as(treedef: Any, tree: Any, model: Any) -> Any:
    """``tree``'s leaves in the structure ``treedef`` (``f``'s in another mode)."""
    leaves = jax.tree_util.tree_leaves(tree)
    if len(leaves) != treedef.num_leaves:
        raise InvalidArgumentError(
            format_error(
                f"The optimizer of a {type(model).__name__} was made for "
                f"{treedef.num_leaves} trainable parameters, and the model now has "
                f"{len(leaves)}: its parameters were replaced or added since.",
                where=user_location(),
                fix="make a new autostate.Optimizer(model, tx) after changing which "
                "parameters the model holds.",
            )
        )
    return jax.tree_util.tree_unflatten(treedef, leaves)
