"""``autostate/graph/walk.py``: the one walk.

The walk (``map_tree`` / ``iter_tree`` / ``instances``) and the flatten
(``flatten_graph``) agree on order and path names; the change check
(``graph_unchanged``) says yes exactly when a new flatten would give the
same graphdef and the very same leaves; what code reaches follows each
kind's ``reached`` step, and a function's globals."""

from __future__ import annotations

import collections
import dataclasses
import functools
import types
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autostate
from autostate import graph
from autostate.graph import (
    is_dynamic,
    is_stateful_instance,
    iter_tree,
    key_name,
    map_tree,
    path_name,
    register_stateful_class,
)


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


def test_iter_tree_with_seen_visits_each_node_once_across_walks():
    shared = [1]
    seen: set[int] = set()
    first = list(iter_tree({"a": shared, "b": shared}, lambda x: type(x) is list, seen=seen))
    again = list(iter_tree((shared, [2]), lambda x: type(x) is list, seen=seen))
    assert [(name, node) for name, node in first] == [("['a']", [1])]
    assert again == [("[1]", [2])]  # the shared list was visited by the first walk


def test_iter_tree_follows_the_edges_of_a_children_step():
    # A walk with other edges than the model graph's: into a function's closure.
    inner = {"k": 3}

    def fn():
        return inner

    def step(node: Any) -> list[tuple[str, Any]]:
        if type(node) is type(fn):
            return [(f".__closure__[{i}]", c.cell_contents) for i, c in enumerate(node.__closure__)]
        return graph.children_of(node)

    assert list(iter_tree([fn], lambda x: type(x) is int)) == []  # a function is a leaf
    found = list(iter_tree([fn], lambda x: type(x) is int, children=step, seen=set()))
    assert found == [("[0].__closure__[0]['k']", 3)]


def test_iter_tree_with_seen_and_cycles_terminates():
    loop: list[Any] = []
    loop.append(loop)
    assert list(iter_tree(loop, lambda x: type(x) is list, into_targets=True, seen=set())) == [
        ("", loop)
    ]


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


class Marker:
    """A target node: not a pytree, compared by identity."""

    def __init__(self, tag: str):
        self.tag = tag


def is_marker(node: Any) -> bool:
    return isinstance(node, Marker)


def tag_with_name(node: Marker, name: str) -> str:
    return f"{node.tag}@{name}"


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Block:
    attn: Any
    mlp: Any


Pair = collections.namedtuple("Pair", ["left", "right"])


class Cell:
    """A plain class registered the way ``@stateful`` registers decorated classes."""

    def __init__(self, value: Any, scale: float, child: Any = None):
        self.value = value
        self.scale = scale
        self.child = child


register_stateful_class(Cell, info=None)





def sample_tree():
    return {
        "blocks": [Block(attn={"cache": {"k": Marker("a")}}, mlp=(Marker("b"), 1.0))],
        "pair": Pair(left=Marker("c"), right=[None, Marker("d")]),
        "leaf": jnp.ones(2),
    }


def test_map_tree_replaces_targets_with_their_path_names():
    out = map_tree(sample_tree(), tag_with_name, is_marker)
    assert out["blocks"][0].attn == {"cache": {"k": "a@['blocks'][0].attn['cache']['k']"}}
    assert out["blocks"][0].mlp == ("b@['blocks'][0].mlp[0]", 1.0)
    assert out["pair"] == Pair(left="c@['pair'].left", right=[None, "d@['pair'].right[1]"])
    assert type(out["pair"]) is Pair and type(out["blocks"][0]) is Block


def test_map_tree_names_have_no_leading_dot_from_an_attribute_root():
    root = Block(attn=[Marker("a")], mlp={"m": Marker("b")})
    out = map_tree(root, tag_with_name, is_marker)
    assert out.attn == ["a@attn[0]"] and out.mlp == {"m": "b@mlp['m']"}
    assert map_tree(Marker("r"), tag_with_name, is_marker) == "r@"


def test_map_tree_keeps_non_targets_and_untouched_registered_nodes():
    tree = sample_tree()
    untouched = Block(attn=jnp.zeros(1), mlp=None)
    tree["other"] = untouched
    out = map_tree(tree, tag_with_name, is_marker)
    assert out["leaf"] is tree["leaf"]
    assert out["other"] is untouched
    assert out is not tree and out["blocks"] is not tree["blocks"]
    assert out["blocks"][0] is not tree["blocks"][0]
    # The input is not modified.
    assert isinstance(tree["blocks"][0].attn["cache"]["k"], Marker)


def test_iter_tree_yields_names_in_walk_order():
    found = list(iter_tree(sample_tree(), is_marker))
    assert [(name, node.tag) for name, node in found] == [
        ("['blocks'][0].attn['cache']['k']", "a"),
        ("['blocks'][0].mlp[0]", "b"),
        ("['pair'].left", "c"),
        ("['pair'].right[1]", "d"),
    ]


def test_walk_names_agree_with_jax_keypaths():
    # One naming scheme: the walk's names are jax's keypaths through key_name.
    tree = {"a": [Block(attn=jnp.ones(1), mlp=(jnp.ones(2),))], "b": Pair(jnp.ones(3), None)}
    from_jax = sorted(
        path_name("".join(key_name(k) for k in path))
        for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
    )
    from_walk = sorted(name for name, _ in iter_tree(tree, lambda n: isinstance(n, jax.Array)))
    assert (
        from_walk
        == from_jax
        == [
            "['a'][0].attn",
            "['a'][0].mlp[0]",
            "['b'].left",
        ]
    )


def test_aliased_instance_is_copied_once_and_named_by_first_path():
    shared = Cell(Marker("s"), 2.0)
    tree = {"first": shared, "second": [shared]}
    out = map_tree(tree, tag_with_name, is_marker)
    assert out["first"] is out["second"][0]
    assert out["first"] is not shared
    assert out["first"].value == "s@['first'].value"
    assert out["first"].scale == 2.0
    assert isinstance(shared.value, Marker)
    found = list(iter_tree(tree, is_marker))
    assert [name for name, _ in found] == ["['first'].value"]


def test_instance_pytree_children_are_dynamic_attributes_only():
    cell = Cell(jnp.arange(3.0), 0.5, child=Cell(jnp.ones(1), 2.0, child="config"))
    assert is_stateful_instance(cell) and not is_stateful_instance(Block(1, 2))
    leaves, treedef = jax.tree_util.tree_flatten(cell)
    assert len(leaves) == 2
    np.testing.assert_array_equal(leaves[0], [0.0, 1.0, 2.0])
    rebuilt = jax.tree_util.tree_unflatten(treedef, [leaf * 2 for leaf in leaves])
    assert type(rebuilt) is Cell and rebuilt.scale == 0.5 and rebuilt.child.child == "config"
    np.testing.assert_array_equal(rebuilt.value, [0.0, 2.0, 4.0])
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(cell)[0]]
    assert paths == [".value", ".child.value"]

    out = jax.jit(lambda c: c.value * c.scale + c.child.value)(cell)
    np.testing.assert_allclose(out, [1.0, 1.5, 2.0])


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1.0, False),
        ("name", False),
        (None, False),
        (len, False),
        ([1, 2], False),
        ({"a": 1}, False),
        (jnp.ones(1), True),
        (np.ones(1), True),
        (np.float32(1.0), True),
        ([1, jnp.ones(1)], True),
        ({"a": (None, np.ones(1))}, True),
        (Pair(1, 2), False),
        (Pair(1, jnp.ones(1)), True),
        (Block(attn=1, mlp=jnp.ones(1)), True),
    ],
)
def test_is_dynamic(value, expected):
    assert is_dynamic(value) is expected


def test_traced_rebuilds_share_handled_slots_but_never_mutable_attributes():
    """The rebuild plan (``graph.walk._rebuild_plan``): a handled slot is one frozen
    object per graphdef entry, so every trace's model may hold the same one;
    a list or dict attribute is copied for each model, so a change in place
    reaches no other model and the change check sees it."""
    import autostate
    from autostate.effects import HandledLocalStateRef
    from autostate.graph import graph_unchanged, rebuild_instances

    @autostate.stateful
    class Leaf:
        def __init__(self):
            self.w = jnp.ones(2)
            self.n = jnp.zeros(())
            self.log = []
            self.seen = {}

        def __call__(self, x):
            self.n = self.n + 1
            return x * self.w

    @autostate.stateful
    class Root:
        def __init__(self):
            self.blocks = [Leaf(), Leaf()]

        def __call__(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    f, states = Root().functionalize()
    leaves, graphdef = f._flattened()
    one, two = (rebuild_instances(graphdef, leaves) for _ in range(2))
    for a, b in zip(one, two):
        if type(a) is not Leaf:
            continue
        assert type(a.__dict__["n"]) is HandledLocalStateRef
        assert a.__dict__["n"] is b.__dict__["n"]
        assert a.log is not b.log and a.seen is not b.seen
        b.log.append(1)
        assert a.log == []
    root = one[graphdef.root]
    assert graph_unchanged(root, leaves, graphdef)
    assert not graph_unchanged(two[graphdef.root], leaves, graphdef)  # its log changed
    root.blocks[1].__dict__["n"] = HandledLocalStateRef("other", "n", False, "state")
    assert not graph_unchanged(root, leaves, graphdef)
    # Equal but not the same slot still counts as unchanged (compared by value).
    root.blocks[1].__dict__["n"] = dataclasses.replace(two[2].__dict__["n"])
    assert graph_unchanged(root, leaves, graphdef)
    out, new_states = jax.jit(lambda f, s, x: f(s, x))(f, states, jnp.ones(2))
    np.testing.assert_allclose(out, jnp.ones(2))
    assert all(float(v) == 1.0 for v in new_states.values())


def test_iter_tree_and_map_tree_reach_the_same_states_through_every_holder() -> None:
    """The stored-callable family: ``functionalize()`` named
    states through ``map_tree`` (which follows bound methods and closures)
    while ``f`` checked the states dict against ``iter_tree`` (which did not).
    Both walks must reach every state by the same path, whatever holds the
    sub-model: an attribute, a container, a bound method, a closure."""
    import weakref

    import autostate

    @autostate.stateful
    class Counter:
        def __init__(self):
            self.n = jnp.zeros(())

        def __call__(self, x):
            self.n = self.n + x
            return self.n

    @autostate.stateful
    class Holder:
        def __init__(self):
            a, b, c, d, e = Counter(), Counter(), Counter(), Counter(), Counter()
            self.sub = a
            self.method = b.__call__
            self.closure = lambda x: c(x)
            self.in_list = [d.__call__]
            self.in_dict = {"k": e.__call__}
            self.keep = e  # also reachable as an attribute, after the dict
            self.ref = weakref.ref(a)

        def __call__(self, x):
            out = self.sub(x) + self.method(x) + self.closure(x)
            return out + self.in_list[0](x) + self.in_dict["k"](x)

    model = Holder()
    f, states = model.functionalize()
    assert f.state_names() == frozenset(states)
    assert len(states) == 5
    out, new = f(states, 1.0)
    assert float(out) == 5.0
    out, new = jax.jit(lambda s, x: f(s, x))(new, 1.0)
    assert float(out) == 10.0
    frozen = autostate.freeze(f, new)
    assert float(frozen(1.0)) == 15.0



# --- what code reaches -----------------------------------------------------------


def test_reachable_instances_follow_code_last_first_and_collect_containers() -> None:
    first, second = Leaf(1), Leaf(2)
    log: list[Any] = []
    table = {"k": second}
    ordered = collections.OrderedDict(k=first)  # (a dict subclass: walked as a dict)

    def body(x: Any, scale: Any = table) -> Any:  # a cell and a default
        return first(x) * len(log)

    containers: list[Any] = []
    found = graph.reachable_instances((functools.partial(body, 1.0),), containers)
    # Last first: the default (the dict) before the cells.
    assert found == [second, first]
    assert table in containers and log in containers
    assert graph.reachable_instances((second.__call__, ordered), []) == [first, second]
    assert graph.reachable_instances((weakref.ref(first), 3, jnp.ones(2)), []) == []


def test_code_reaches_closures_globals_called_functions_and_module_attributes() -> None:
    model, other = Leaf(1), Leaf(2)
    module = types.ModuleType("user_module")
    module.MODEL = other  # type: ignore[attr-defined]
    namespace: dict[str, Any] = {"MODEL": model, "jnp": jnp, "mod": module}
    exec(  # (functions of a user module: globals of their own)
        "def helper(x):\n    return MODEL.w * x\n\n"
        "def step(x):\n    return helper(x) + mod.MODEL.w + jnp.ones(2)\n",
        namespace,
    )
    found = graph.code_reaches(namespace["step"])
    assert ("the global 'MODEL'", model) in found  # through the function it calls
    assert ("the module attribute mod.MODEL", other) in found
    assert graph.code_reaches(lambda x: model(x)) == [("its closure", model)]

    class Evaluator:
        def __init__(self) -> None:
            self.model = model

        def run(self, x: Any) -> Any:
            return x

    evaluator = Evaluator()
    assert graph.code_reaches(evaluator.run) == [
        ("the object its method is bound to", evaluator.__dict__)
    ]


def test_global_names_and_libraries_of_a_function() -> None:
    def outer():
        def inner():
            return np.zeros(1) + jnp.ones(1)

        return inner

    assert {"np", "jnp"} <= graph.walk._global_names(outer.__code__)
    assert graph.walk._library(np.zeros) and graph.walk._library(jnp)
    assert graph.walk._library(autostate.jit)
    assert not graph.walk._library(outer)
    assert not graph.walk._library(types.ModuleType("user_module"))


# --- the containers outside states -------------------------------------------------


def test_mutable_statics_finds_each_container_outside_states_once_and_puts_it_back() -> None:
    @autostate.stateful
    class Holder:
        registry: Any = []  # (a class attribute: shared by every instance)

        def __init__(self) -> None:
            self.log = [[1], (2, {3: 4})]
            self.again = self.log  # (one container, saved once)
            self.tags = {"a"}  # (a set: saved, its items not walked)
            self.plain = types.SimpleNamespace(items=[5])

    holder = Holder()
    saved = graph.mutable_statics([holder], [("captured", [6])])
    found = [(c, where) for c, _, where in saved]
    assert found == [
        (holder.log, "Holder.log"),
        (holder.log[0], "Holder.log"),
        (holder.log[1][1], "Holder.log"),
        (holder.tags, "Holder.tags"),
        (vars(holder.plain), "Holder.plain"),
        (holder.plain.items, "Holder.plain"),
        (Holder.registry, "Holder.registry"),
        ([6], "captured"),
    ]
    assert graph.changed_statics(saved) == []
    holder.log[0].append(2)
    holder.tags.add("b")
    assert graph.changed_statics(saved) == [(holder.log[0], "Holder.log"), (holder.tags, "Holder.tags")]
    graph.restore_statics(saved)
    assert holder.log == [[1], (2, {3: 4})] and holder.tags == {"a"}
    assert graph.changed_statics(saved) == []


def test_lazy_attributes_are_those_made_again_from_their_leaves_alone():
    @autostate.stateful
    class Holder:
        def __init__(self):
            self.w = jnp.ones(2)
            self.pair = (jnp.zeros(2), 3)
            self.items = [jnp.ones(1)]
            self.n = jnp.zeros(())

        def tick(self):
            self.n = self.n + 1

    leaves, graphdef = graph.flatten_graph(Holder())
    (row,) = graph.lazy_attributes(graphdef)
    assert row == [(0,), (1,), None, (3,)]  # (a list can change in place unseen)
    values = {0: "w", 1: "p", 3: "n"}
    assert graph.attribute_value(graphdef, (0, 1), values) == ("p", 3)
    assert graph.attribute_value(graphdef, (0, 0), values) == "w"
    assert graph.materialized(leaves[0]) is leaves[0]
