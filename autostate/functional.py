"""``FunctionalModel``: the pure ``f`` that ``functionalize()`` returns.

This module owns what ``f`` is: a pytree whose leaves are the model's
parameters (flattened once as a graph, so tied weights stay one leaf), its
calling convention ``f(states, *args) -> (out, new_states)`` and
``f.<method>(...)``, the check that a traced call changed nothing outside the
states, and the handler ids that make functionalizing a frozen model again
give an equal ``f``. It knows nothing of source code or of how a class is
decorated.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import jax
import numpy as np

from autostate import control as _control
from autostate import tree as _tree
from autostate.effects import contains_tracer, run_with_states
from autostate.errors import MethodNotFoundError, StateAccessError, format_error


def _check_unchanged(model_name: str, before: tuple, after: tuple) -> None:
    """Refuses a traced call that changed the model outside its states.

    Under a transformation the model inside ``f`` is a throwaway copy, so a
    change that is not a state write (``self.log.append(x)`` on a list that
    is not state) would vanish silently with the trace.
    """
    (old_leaves, old_def), (new_leaves, new_def) = before, after
    if old_def == new_def and all(a is b for a, b in zip(old_leaves, new_leaves)):
        return
    changed = [
        name
        for name, a, b in zip(new_def.names, old_leaves, new_leaves)
        if a is not b
    ]
    where = f" (at {', '.join(changed[:3])})" if changed and old_def == new_def else ""
    raise StateAccessError(
        format_error(
            f"A functionalized call changed {model_name}'s attributes outside its states"
            f"{where}, e.g. by mutating a list or dict in place; under jax.jit/grad/vmap "
            "that change would be lost when the call returns.",
            fix="make the attribute state and assign a new value "
            "(`self.log = self.log + [x]`), or keep such bookkeeping out of the jitted call.",
        )
    )


class FunctionalModel:
    """A functionalized model: ``f(states, *args)`` returns ``(out, new_states)``.

    ``f.<method>(states, *args, **kwargs)`` calls any other method the same
    way. It is a pytree whose leaves are the model's parameters, so it can be
    passed into ``jax.jit``, differentiated with ``jax.grad`` and updated
    with ``jax.tree_util.tree_map`` or optax.

    ``f`` is immutable: make a new one with ``tree_map`` rather than
    assigning into ``f.model``. That is what lets it flatten once and reuse
    the result on every call of a jitted step (per-call dispatch then costs
    what a dict of arrays costs), and what keeps tied weights (one instance
    on two paths) one leaf.
    """

    __slots__ = ("handler_id", "_model", "_flat")

    def __init__(self, handler_id: Hashable, model: Any = None, flat: tuple | None = None):
        self.handler_id = handler_id
        self._model = model
        self._flat = flat  # (leaves, graphdef), computed on first flatten

    @property
    def model(self) -> Any:
        """The handled model (its states are ``HandledLocalStateRef``s)."""
        if self._model is None:
            leaves, graphdef = self._flat
            self._model = _tree.unflatten_graph(graphdef, leaves)
        return self._model

    def _flattened(self) -> tuple:
        if self._flat is None:
            self._flat = _tree.flatten_graph(self._model)
        return self._flat

    def __call__(self, states: dict[str, Any], *args: Any, **kwargs: Any):
        return self._run(states, self.model, args, kwargs)

    def _run(self, states: dict[str, Any], fn: Callable[..., Any], args: tuple, kwargs: dict):
        before = None
        if contains_tracer(states):
            # Under jit the model was rebuilt from ``_flat``, so that is the
            # flatten before the call; flattening again (with path names)
            # cost a tenth of the trace at 1,000 modules.
            before = self._flat if self._flat is not None else _tree.flatten_graph(self.model)
        try:
            result = run_with_states(self.handler_id, states, fn, args, kwargs)
        finally:
            # States of categories left unhandled live in the model itself; an
            # eager call may have replaced them, so the cached flatten is stale.
            self._flat = None
        _control.check_no_escaped(result[1])
        if before is not None and not _tree.graph_unchanged(self.model, *before):
            _check_unchanged(type(self.model).__name__, before, _tree.flatten_graph(self.model))
        return result

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_"):
            raise AttributeError(name)
        model = self.model
        method = getattr(type(model), name, None)
        if method is None or not callable(method):
            raise MethodNotFoundError(
                format_error(
                    f"{type(model).__name__} has no method {name!r} to call functionally.",
                    fix="call f.<method>(states, ...) with a method the class defines.",
                )
            )

        def call(states: dict[str, Any], *args: Any, **kwargs: Any):
            return self._run(states, getattr(model, name), args, kwargs)

        call.__name__ = name
        return call

    def __repr__(self) -> str:
        return f"FunctionalModel({self.model!r})"

    def __treescope_repr__(self, path: str | None, subtree_renderer: Any) -> Any:
        """Treescope shows the handled model, its states highlighted as handled."""
        from treescope import repr_lib

        return repr_lib.render_object_constructor(
            FunctionalModel,
            {"handler_id": self.handler_id, "model": self.model},
            path,
            subtree_renderer,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FunctionalModel):
            return NotImplemented
        return self.handler_id == other.handler_id and _trees_equal(self, other)

    __hash__ = None  # type: ignore[assignment]


def _trees_equal(a: Any, b: Any) -> bool:
    leaves_a, def_a = jax.tree_util.tree_flatten(a)
    leaves_b, def_b = jax.tree_util.tree_flatten(b)
    if def_a != def_b:
        return False
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(leaves_a, leaves_b))


def _flatten_functional(f: FunctionalModel):
    leaves, graphdef = f._flattened()
    return leaves, (f.handler_id, graphdef)


def _flatten_functional_with_keys(f: FunctionalModel):
    leaves, graphdef = f._flattened()
    keys = [jax.tree_util.GetAttrKey(f"model.{n}") for n in graphdef.names]
    return list(zip(keys, leaves)), (f.handler_id, graphdef)


def _unflatten_functional(aux: tuple, leaves) -> FunctionalModel:
    handler_id, graphdef = aux
    leaves = list(leaves)
    return FunctionalModel(handler_id, None, (leaves, graphdef))


jax.tree_util.register_pytree_with_keys(
    FunctionalModel, _flatten_functional_with_keys, _unflatten_functional, _flatten_functional
)
_tree.register_dynamic_type(FunctionalModel)


def all_categories(_category: Hashable) -> bool:
    return True


def handler_id_for(
    category: Hashable | None, category_predicate: Callable[[Hashable], bool] | None
) -> Hashable | None:
    """A handler id that depends only on which states are handled.

    So functionalizing a frozen model again gives an *equal* ``f`` (and a
    jitted step sees the same pytree structure: no recompilation), while
    functionalizing one category inside another's call still nests: their
    ids differ. A custom predicate cannot be named; it gets a fresh id.
    """
    if category_predicate is all_categories:
        return "autostate:*"
    if category_predicate is None:
        return f"autostate:{category!r}"
    return None
