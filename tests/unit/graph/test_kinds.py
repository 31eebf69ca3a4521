"""``autostate/graph/kinds.py``: the node-kind registry and path names.

One record per type, registered once, read by every walk, the witness, the
transformations and loop rolling; path names follow JAX's keypaths, a
stack's own entry aside."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import pytest

import autostate
from autostate import graph
from autostate.errors import InvalidArgumentError
from autostate.graph import (
    key_name,
    path_name,
)


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


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class HasStacked:
    stacked: Any


def test_only_the_passing_key_itself_adds_nothing_to_names():
    # A stack's entry is JAX's own GetAttrKey("stacked") (orbax and keystr take
    # it); names and graphdef.keys skip that object, not a user's field of that name.
    @autostate.stateful
    class Layer:
        def __init__(self):
            self.w = jnp.ones(2)

    @autostate.stateful
    class Holder:
        def __init__(self):
            self.blocks = autostate.stack([Layer(), Layer()])
            self.mine = HasStacked(Layer())

    leaves, graphdef = graph.flatten_graph(Holder())
    assert graphdef.names == ("blocks.w", "mine.stacked.w")
    assert [jax.tree_util.keystr(k) for k in graphdef.keys] == [".blocks.w", ".mine.stacked.w"]
    standard = (jax.tree_util.GetAttrKey, jax.tree_util.SequenceKey, jax.tree_util.DictKey)
    assert all(type(k) in standard for path in graphdef.keys for k in path)
    assert graph.passing_key("stacked") is graph.passing_key("stacked")
    assert key_name(jax.tree_util.GetAttrKey("stacked")) == ".stacked"



@pytest.mark.parametrize(
    ("prefix", "expected"),
    [(".blocks[0].attn", "blocks[0].attn"), ("[0].a", "[0].a"), ("['k'].v", "['k'].v"), ("", "")],
)
def test_path_name_drops_only_a_leading_dot(prefix, expected):
    assert path_name(prefix) == expected


@autostate.stateful
class _Holder:
    def __init__(self) -> None:
        self.w = jnp.ones(2)


def test_a_node_kind_is_one_record_every_walk_and_transformation_reads() -> None:
    # A stack-like wrapper: one register_node_kind call tells the walks its
    # child, the witness that it never changes, the transformations its stacked
    # model, loop rolling its strictness.
    class Wrapped:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

    kind = graph.register_node_kind(
        Wrapped,
        children=lambda w: [(".inner", w.inner)],
        rebuild=lambda w, children: Wrapped(children[0]),
        immutable=True,
        stacked=lambda w: w.inner,
        must_roll=lambda w: True,
    )
    assert graph.node_kind(Wrapped) is kind
    node = Wrapped(jnp.ones(2))
    assert graph.STACKS[Wrapped](node) is node.inner
    assert graph.MUST_ROLL[Wrapped](node) is True
    model = _Holder()
    assert graph.reachable_instances((Wrapped(model),), []) == [model]  # (through its stacked model)
    model.extra = node
    witness = graph.Witness.of([model])
    assert witness is not None and witness.unchanged()  # (immutable: taken as it is)
    assert graph.children_of(node) == [(".inner", node.inner)]
