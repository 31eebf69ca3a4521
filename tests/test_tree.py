"""Tests for ``autostate/tree.py``: path names, ``map_tree`` / ``iter_tree``, instance pytrees."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autostate.graph import (
    is_dynamic,
    is_stateful_instance,
    iter_tree,
    key_name,
    map_tree,
    path_name,
    register_stateful_class,
)


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


# --- key and path names ------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        (jax.tree_util.GetAttrKey("attn"), ".attn"),
        (jax.tree_util.SequenceKey(3), "[3]"),
        (jax.tree_util.DictKey("k"), "['k']"),
        (jax.tree_util.DictKey(7), "[7]"),
        (jax.tree_util.FlattenedIndexKey(2), "[2]"),
    ],
)
def test_key_name(key, expected):
    assert key_name(key) == expected


@pytest.mark.parametrize(
    ("prefix", "expected"),
    [(".blocks[0].attn", "blocks[0].attn"), ("[0].a", "[0].a"), ("['k'].v", "['k'].v"), ("", "")],
)
def test_path_name_drops_only_a_leading_dot(prefix, expected):
    assert path_name(prefix) == expected


# --- map_tree / iter_tree ----------------------------------------------------------


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


# --- instances registered like @stateful classes ---------------------------------


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
    """The rebuild plan (``graph._rebuild_plan``): a handled slot is one frozen
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
    """The family of hunt 10's stored-callable bug: ``functionalize()`` named
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
