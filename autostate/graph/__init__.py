"""The model graph: the one node-kind registry, the one walk and the change check.

A model is a graph: decorated instances hold arrays, static values, request
objects, other instances (directly or in lists, tuples, dicts and foreign
pytree nodes) and callables bound to instances (``self.act = self._gelu``).
This package owns how that graph is seen, in three modules:

* ``kinds``: the registry, one ``NodeKind`` record per node type (its
  children, rebuild, witness, stacked form, what code reaching it reaches),
  and path names;
* ``walk``: the one walk through those records: find and rebuild
  (``iter_tree``, ``map_tree``), reachability (``reachable_instances``,
  ``code_reaches``, ``mutable_statics``), the flatten and its exact change
  check (``flatten_graph``, ``graph_unchanged``, the rebuild);
* ``witness``: ``Witness``, the identity-only change check of a kept flatten.

Every name is read here, as ``graph.X``. The registry is imported with the
package (every layer registers its kinds at import, from the ground up); the
walk and the witness, which stand on it, are imported when one of their
names is first read (PEP 562), then are plain attributes of the package.

Example:
    >>> from autostate import graph
    >>> graph.node_kind(list).children([1, 2])
    [('[0]', 1), ('[1]', 2)]
    >>> [name for name, _ in graph.iter_tree({"a": [1, (2, 3)]}, lambda x: type(x) is int)]
    ["['a'][0]", "['a'][1][0]", "['a'][1][1]"]
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autostate.graph.kinds import (
    MUST_ROLL,
    OWN_VALUE_SLOTS,
    STACKS,
    STATEFUL_CLASSES,
    NodeKind,
    attr_name,
    held_parts,
    index_name,
    is_stateful_instance,
    key_name,
    mapping_name,
    materialized,
    node_kind,
    passing_key,
    path_name,
    register_node_kind,
)

if TYPE_CHECKING:
    from autostate.graph.walk import (
        GraphDef,
        attribute_value,
        changed_statics,
        children_of,
        code_reaches,
        flatten_graph,
        graph_unchanged,
        holds_instance,
        instance_ids,
        instance_paths,
        instances,
        instances_of,
        is_dynamic,
        is_model_child,
        is_pytree_node,
        is_static_leaf,
        iter_tree,
        lazy_attributes,
        leaf_attributes,
        map_tree,
        mutable_statics,
        on_jax_grad,
        plain_attributes,
        reachable_instances,
        rebuild_instances,
        register_stateful_class,
        restore_statics,
        rewrite_attributes,
        unflatten_graph,
    )
    from autostate.graph.witness import Witness

__all__ = [
    "MUST_ROLL",
    "OWN_VALUE_SLOTS",
    "STACKS",
    "STATEFUL_CLASSES",
    "GraphDef",
    "NodeKind",
    "Witness",
    "attr_name",
    "attribute_value",
    "changed_statics",
    "children_of",
    "code_reaches",
    "flatten_graph",
    "graph_unchanged",
    "held_parts",
    "holds_instance",
    "index_name",
    "instance_ids",
    "instance_paths",
    "instances",
    "instances_of",
    "is_dynamic",
    "is_model_child",
    "is_pytree_node",
    "is_static_leaf",
    "is_stateful_instance",
    "iter_tree",
    "key_name",
    "lazy_attributes",
    "leaf_attributes",
    "map_tree",
    "mapping_name",
    "materialized",
    "mutable_statics",
    "node_kind",
    "on_jax_grad",
    "passing_key",
    "path_name",
    "plain_attributes",
    "reachable_instances",
    "rebuild_instances",
    "register_node_kind",
    "register_stateful_class",
    "restore_statics",
    "rewrite_attributes",
    "unflatten_graph",
]


_SUBMODULES = ("walk", "witness")


def __getattr__(name: str) -> Any:
    """A name of ``walk`` or ``witness``, read for the first time: both are
    imported, and the names ``__all__`` lists become the package's own (a
    later read is a plain attribute's)."""
    if name.startswith("__") or name in _SUBMODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    space = globals()
    for submodule in _SUBMODULES:
        module = importlib.import_module(f"{__name__}.{submodule}")
        for public in __all__:
            if public not in space and hasattr(module, public):
                space[public] = getattr(module, public)
    if name not in space:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return space[name]
