"""``autostate/graph.py``: the node-kind registry and the one walk.

The registry holds one record per type, registered once; the walk
(``map_tree`` / ``iter_tree`` / ``instances``) and the flatten
(``flatten_graph``) agree on order and path names, and the change check
(``graph_unchanged``) says yes exactly when a new flatten would give the
same graphdef and the very same leaves.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import pytest

import autostate
from autostate import graph
from autostate.errors import InvalidArgumentError

# --- the registry --------------------------------------------------------------


def test_builtin_containers_and_callables_have_one_record_each():
    for cls in (list, tuple, dict, functools.partial, map, filter):
        kind = graph.node_kind(cls)
        assert kind is not None and kind.type is cls
    assert graph.node_kind(list).children(["a", "b"]) == [("[0]", "a"), ("[1]", "b")]
    assert graph.node_kind(dict).children({"k": 1, 2: 3}) == [("['k']", 1), ("[2]", 3)]
    assert graph.node_kind(tuple).rebuild((1, 2), [3, 4]) == (3, 4)
    assert graph.node_kind(int) is None
    # Exactly the type: a subclass is not its base's kind.
    assert graph.node_kind(type("MyList", (list,), {})) is None


def test_a_second_registration_of_a_type_is_refused():
    class Once:
        pass

    graph.register_node_kind(Once, model_child=True)
    with pytest.raises(InvalidArgumentError, match="registered as a node kind already"):
        graph.register_node_kind(Once, model_child=False)
    assert graph.node_kind(Once).model_child is True  # the first record stands


def test_engine_types_are_registered_once_with_all_their_fields():
    from autostate.effects import (
        FrozenLocalStateRequest,
        HandledLocalStateRef,
        InitialLocalStateRequest,
        WithFunctionalLocalState,
    )

    ref = graph.node_kind(HandledLocalStateRef)
    assert ref.model_child and ref.shared and ref.running is not None
    assert graph.node_kind(InitialLocalStateRequest).canonical is not None
    assert graph.node_kind(FrozenLocalStateRequest).model_child
    handler = graph.node_kind(WithFunctionalLocalState)
    assert handler.children is not None and handler.rebuild is not None


@autostate.stateful
class Leaf:
    def __init__(self, n: int):
        self.w = jnp.full((2,), float(n))
        self.count = jnp.zeros(())
        self.scale = 2.0

    def __call__(self, x):
        self.count = self.count + 1
        return x * self.w * self.scale


@autostate.stateful
class Net:
    def __init__(self):
        self.embed = Leaf(1)
        self.blocks = [Leaf(2), {"inner": Leaf(3), "tied": None}]
        self.head = self.embed  # aliasing: one instance, named by its first path
        self.act = self.embed.__call__  # a method bound to a sub-model

    def __call__(self, x):
        return self.head(self.blocks[1]["inner"](self.blocks[0](self.embed(x))))


def test_a_decorated_class_is_one_record_visited_by_identity():
    assert graph.is_stateful_instance(Leaf(1)) and not graph.is_stateful_instance(1)
    kind = graph.node_kind(Leaf)  # (installed by the class's first use at the latest)
    assert kind.by_identity and kind.model_child
    assert [name for name, _ in kind.children(Leaf(1))] == [".w", ".count", ".scale"]
    # Decorating again keeps the one record (and the one pytree registration).
    autostate.stateful(Leaf)
    assert graph.node_kind(Leaf).by_identity


# --- the walk -----------------------------------------------------------------


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array)


def test_instances_are_found_once_in_walk_order_by_first_path():
    net = Net()
    found = graph.instances(net)
    assert [path for path, _ in found] == ["", "embed", "blocks[0]", "blocks[1]['inner']"]
    assert [obj for _, obj in found] == [net, net.embed, net.blocks[0], net.blocks[1]["inner"]]
    assert graph.instances_of(net) == [obj for _, obj in found]
    assert graph.instance_ids(net) == frozenset(map(id, graph.instances_of(net)))


def test_iter_tree_yields_a_target_on_every_path_that_reaches_it():
    net = Net()
    paths = [p for p, _ in graph.iter_tree(net, lambda x: x is net.embed)]
    assert paths == ["embed", "head", "act.__self__"]


def test_map_tree_copies_each_instance_once_and_rebinds_methods():
    net = Net()
    copy = graph.map_tree(net, lambda x, name: name, _is_array)
    assert copy is not net and copy.head is copy.embed
    assert copy.embed.w == "embed.w" and copy.blocks[1]["inner"].w == "blocks[1]['inner'].w"
    assert copy.act.__self__ is copy.embed  # bound to the copy, not the original
    assert copy.blocks is not net.blocks and copy.blocks[1] is not net.blocks[1]
    assert net.embed.w.shape == (2,)  # the original is untouched


def test_map_tree_keeps_an_untouched_foreign_node():
    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class Node:
        a: Any

    untouched = Node(a="text")
    assert graph.map_tree([untouched], lambda x, n: x, _is_array)[0] is untouched
    changed = graph.map_tree([Node(a=jnp.ones(1))], lambda x, n: n, _is_array)[0]
    assert changed.a == "[0].a"


def test_a_registered_kind_is_walked_through_its_record():
    class Box:
        def __init__(self, item):
            self.item = item

    graph.register_node_kind(
        Box, children=lambda b: [(".item", b.item)], rebuild=lambda b, kids: Box(kids[0])
    )
    tree = {"box": Box([1, Box(2)])}
    assert [p for p, _ in graph.iter_tree(tree, lambda x: type(x) is int)] == [
        "['box'].item[0]",
        "['box'].item[1].item",
    ]
    rebuilt = graph.map_tree(tree, lambda x, name: name, lambda x: type(x) is int)
    assert rebuilt["box"].item[1].item == "['box'].item[1].item"


def test_holds_instance_looks_through_callables_and_partials():
    net = Net()
    assert graph.holds_instance(net.act) and graph.holds_instance([net.embed])
    assert graph.holds_instance(functools.partial(net.embed.__call__, 1))
    assert graph.holds_instance(weakref.ref(net.embed))
    assert not graph.holds_instance([1, "a", jnp.ones(1)])
    assert graph.held_parts(functools.partial(max, 1, key=None)) == [
        (".func", max),
        (".args[0]", 1),
        (".keywords['key']", None),
    ]


# --- the flatten and its mirror -------------------------------------------------


def test_flatten_order_and_names_follow_the_walk_and_jax_keypaths():
    net = Net()
    leaves, graphdef = graph.flatten_graph(net)
    # A state not handled by functionalize is a request: its value is at ``.state``.
    assert graphdef.names == (
        "embed.w",
        "embed.count.state",
        "blocks[0].w",
        "blocks[0].count.state",
        "blocks[1]['inner'].w",
        "blocks[1]['inner'].count.state",
    )
    assert [graph.path_name("".join(map(graph.key_name, k))) for k in graphdef.keys] == list(
        graphdef.names
    )
    assert leaves[0] is net.embed.w and leaves[-1] is net.blocks[1]["inner"].count
    f, _ = net.functionalize()  # handled: the states are in no leaf of f
    assert graph.flatten_graph(f.model)[1].names == (
        "embed.w",
        "blocks[0].w",
        "blocks[1]['inner'].w",
    )
    rebuilt = graph.unflatten_graph(graphdef, leaves)
    assert rebuilt.head is rebuilt.embed and rebuilt.act.__self__ is rebuilt.embed
    assert graph.flatten_graph(rebuilt)[1] == graphdef


def test_the_change_check_says_yes_exactly_when_a_flatten_is_the_same():
    net = Net()
    leaves, graphdef = graph.flatten_graph(net)

    def agrees() -> bool:
        again, again_def = graph.flatten_graph(net)
        same = again_def == graphdef and all(a is b for a, b in zip(again, leaves))
        assert graph.graph_unchanged(net, leaves, graphdef) is same
        return same

    assert agrees()
    changes = [
        lambda: setattr(net.embed, "scale", 3.0),  # a static value
        lambda: setattr(net.blocks[0], "w", jnp.ones(2)),  # a new leaf
        lambda: net.blocks[1].update(tied=jnp.ones(1)),  # a new leaf where None was
        lambda: setattr(net, "head", net.blocks[0]),  # an alias moved
        lambda: setattr(net, "act", net.blocks[0].__call__),  # a method rebound
        lambda: setattr(net, "extra", 1),  # an attribute added
    ]
    for change in changes:
        net = Net()
        leaves, graphdef = graph.flatten_graph(net)
        change()
        assert not agrees()
