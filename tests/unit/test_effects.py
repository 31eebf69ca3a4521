"""Tests for ``autostate/effects/local_state.py``: the penzai-v1 local-state engine.

Bodies are small callable pytree dataclasses whose fields hold requests; after
``handle_local_states`` those fields hold ``HandledLocalStateRef``s and the
body reads and writes them with ``ref.get()`` / ``ref.set(v)``.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from semantics.harness import (
    assert_bits,
    assert_same,
    pair,
    snapshot,
)
from semantics.programs_functional import CATS, PACK
from semantics.programs_shared import Loader

import autostate
from autostate import errors
from autostate.effects import (
    FrozenLocalStateRequest,
    HandledLocalStateRef,
    InitialLocalStateRequest,
    SharedLocalStateRequest,
    WithFunctionalLocalState,
    embed_shared_state_requests,
    freeze_local_states,
    handle_local_states,
    hoist_shared_state_requests,
    local_state,
)
from autostate.errors import CategoryArgumentError, StateSharingError, UnhandledLocalStateError

REQUESTS = (InitialLocalStateRequest, FrozenLocalStateRequest, SharedLocalStateRequest)


SLOTS = (*REQUESTS, HandledLocalStateRef)


def slots_of(tree: Any) -> list[Any]:
    """Every request or handled ref in ``tree``, in pytree order."""
    return [
        leaf
        for leaf in jax.tree_util.tree_leaves(tree, is_leaf=lambda n: isinstance(n, SLOTS))
        if isinstance(leaf, SLOTS)
    ]


def assert_trees_equal(a: Any, b: Any) -> None:
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def init(value: Any, category: Any = "state", name: str | None = None) -> InitialLocalStateRequest:
    return InitialLocalStateRequest(lambda: value, category, name)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ReadWriteReread:
    """Reads two states, writes both, re-reads them, writes again."""

    a: Any
    b: Any

    def __call__(self, x):
        a0, b0 = self.a.get(), self.b.get()
        self.a.set(a0 + x)
        self.b.set(b0 * 2)
        a1, b1 = self.a.get(), self.b.get()
        self.a.set(a1 + 1)
        return a0, b0, a1, b1, self.a.get()


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class IncrementEach:
    """Adds ``x`` once through every handled ref found in ``refs``."""

    refs: Any

    def __call__(self, x):
        for ref in slots_of(self.refs):
            ref.set(ref.get() + x)
        return x


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Affine:
    w: jax.Array
    count: Any
    total: Any

    def __call__(self, x):
        y = jnp.tanh(x @ self.w)
        self.count.set(self.count.get() + 1)
        self.total.set(self.total.get() + y.sum())
        return y


def affine_by_hand(w, states, x):
    y = jnp.tanh(x @ w)
    return y, {"count": states["count"] + 1, "total": states["total"] + y.sum()}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Inner:
    b: Any
    peek: Any  # a state of the *outer* handler, reached from the inner body

    def __call__(self, x):
        b, p = self.b.get(), self.peek.get()
        self.b.set(b + x)
        self.peek.set(p * 10)
        return b + p


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Outer:
    a: Any
    inner: Any

    def __call__(self, arg):
        x, inner_states = arg
        self.a.set(self.a.get() + 1)
        y, inner_states = self.inner((x, inner_states))
        return y + self.a.get(), inner_states


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Layer:
    some_state: Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Root:
    sublayers: list
    named: Any


Pair = collections.namedtuple("Pair", ["left", "right"])


def test_handle_returns_handler_and_initial_states():
    body = ReadWriteReread(a=init(1.0, name="a"), b=FrozenLocalStateRequest(3.0, "state", "b"))
    handler, states = handle_local_states(body, category="state")
    assert isinstance(handler, WithFunctionalLocalState)
    assert isinstance(handler.body, ReadWriteReread)
    assert states == {"a": 1.0, "b": 3.0}
    assert handler.body.a == HandledLocalStateRef(handler.handler_id, "a", True, "state")
    assert handler.body.b == HandledLocalStateRef(handler.handler_id, "b", True, "state")


def test_lazy_returns_thunk_and_defers_initializers():
    calls = []

    def make():
        calls.append(1)
        return jnp.arange(3.0)

    body = ReadWriteReread(a=InitialLocalStateRequest(make, "state", "a"), b=init(2.0, name="b"))
    handler, thunk = handle_local_states(body, category="state", lazy=True, handler_id="h")
    assert callable(thunk) and not isinstance(thunk, dict)
    assert calls == []
    states = thunk()
    assert calls == [1]
    assert sorted(states) == ["a", "b"]
    np.testing.assert_array_equal(states["a"], [0.0, 1.0, 2.0])
    assert states["b"] == 2.0
    eager_handler, eager_states = handle_local_states(body, category="state", handler_id="h")
    assert eager_handler.body == handler.body
    assert calls == [1, 1]
    assert eager_states.keys() == states.keys()


def test_body_sees_its_own_writes_and_handler_returns_new_states():
    body = ReadWriteReread(a=init(1.0, name="a"), b=init(5.0, name="b"))
    handler, states = handle_local_states(body, category="state")
    result, new_states = handler((10.0, states))
    # a0, b0, a1 (= a0 + x), b1 (= 2 * b0), final a (= a1 + 1)
    assert result == (1.0, 5.0, 11.0, 10.0, 12.0)
    assert new_states == {"a": 12.0, "b": 10.0}
    # The input dict is not mutated, and the handler is reusable.
    assert states == {"a": 1.0, "b": 5.0}
    result, newer = handler((1.0, new_states))
    assert result == (12.0, 10.0, 13.0, 20.0, 14.0)
    assert newer == {"a": 14.0, "b": 20.0}


def test_handled_body_is_not_rebuilt_per_call():
    body = ReadWriteReread(a=init(1.0, name="a"), b=init(5.0, name="b"))
    handler, states = handle_local_states(body, category="state")
    before = handler.body
    handler((1.0, states))
    assert handler.body is before
    assert isinstance(handler.body.a, HandledLocalStateRef)


def test_unnamed_states_are_named_by_path_from_handled_root():
    root = Root(
        sublayers=[Layer(some_state={"baz": {"qux": init(1.0)}}), Layer(some_state=(init(2.0),))],
        named=init(3.0, name="explicit"),
    )
    handler, states = handle_local_states(root, category="state")
    assert states == {
        "sublayers[0].some_state['baz']['qux']": 1.0,
        "sublayers[1].some_state[0]": 2.0,
        "explicit": 3.0,
    }
    ref = handler.body.sublayers[0].some_state["baz"]["qux"]
    assert ref.name == "sublayers[0].some_state['baz']['qux']"
    assert ref.was_explicitly_named is False
    assert handler.body.named.name == "explicit"
    assert handler.body.named.was_explicitly_named is True


@pytest.mark.parametrize(
    ("tree", "expected"),
    [
        ([init(0.0)], ["[0]"]),
        ((init(0.0), [init(0.0)]), ["[0]", "[1][0]"]),
        ({"k": init(0.0), "j": [init(0.0)]}, ["['k']", "['j'][0]"]),
        ({3: init(0.0), 1: init(0.0)}, ["[3]", "[1]"]),
        ({"outer": {"inner": [init(0.0)]}}, ["['outer']['inner'][0]"]),
        (Pair(left=init(0.0), right={"r": init(0.0)}), ["left", "right['r']"]),
        ([Pair(left=[init(0.0)], right=None)], ["[0].left[0]"]),
        (Layer(some_state=Layer(some_state=init(0.0))), ["some_state.some_state"]),
    ],
)
def test_path_names_on_every_container_kind(tree, expected):
    handler, states = handle_local_states(tree, category="state")
    assert sorted(states) == sorted(expected)
    assert sorted(ref.name for ref in slots_of(handler.body)) == sorted(expected)


def test_containers_keep_their_types():
    tree = {"l": [init(1.0)], "t": (init(2.0),), "n": Pair(init(3.0), 4), "d": {"x": init(5.0)}}
    handler, states = handle_local_states(tree, category="state")
    body = handler.body
    assert type(body["l"]) is list and type(body["t"]) is tuple and type(body["n"]) is Pair
    assert body["n"].right == 4
    assert states == {"['l'][0]": 1.0, "['t'][0]": 2.0, "['n'].left": 3.0, "['d']['x']": 5.0}
    expected = {
        "l": [FrozenLocalStateRequest(1.0, "state")],
        "t": (FrozenLocalStateRequest(2.0, "state"),),
        "n": Pair(FrozenLocalStateRequest(3.0, "state"), 4),
        "d": {"x": FrozenLocalStateRequest(5.0, "state")},
    }
    assert_trees_equal(freeze_local_states(handler, states), expected)


@pytest.mark.parametrize("kwargs", [{}, {"category": "a", "category_predicate": lambda c: True}])
def test_exactly_one_of_category_and_predicate(kwargs):
    with pytest.raises(
        ValueError, match="Exactly one of `category` and `category_predicate`"
    ) as info:
        handle_local_states([init(0.0)], **kwargs)
    assert isinstance(info.value, autostate.AutostateError)
    assert isinstance(info.value, CategoryArgumentError)


def test_only_matching_category_is_handled_others_untouched():
    other_initial = init(1.0, category="other")
    other_frozen = FrozenLocalStateRequest(jnp.ones(2), "other", "f")
    other_shared = SharedLocalStateRequest("f", "other")
    tree = [init(0.0, category="mine"), other_initial, other_frozen, other_shared]
    handler, states = handle_local_states(tree, category="mine")
    assert states == {"[0]": 0.0}
    assert isinstance(handler.body[0], HandledLocalStateRef)
    assert handler.body[1] is other_initial
    assert handler.body[2] is other_frozen
    assert handler.body[3] is other_shared


def test_category_predicate_selects_several_categories():
    keep = init(9.0, category="c")
    tree = {"a": init(1.0, category="a"), "b": init(2.0, category="b"), "c": keep}
    handler, states = handle_local_states(tree, category_predicate=lambda c: c in ("a", "b"))
    assert states == {"['a']": 1.0, "['b']": 2.0}
    assert handler.body["a"].category == "a" and handler.body["b"].category == "b"
    assert handler.body["c"] is keep


def test_category_predicate_can_select_category_none():
    handler, states = handle_local_states(
        [init(1.0, category=None), init(2.0, category="x")], category_predicate=lambda c: c is None
    )
    assert states == {"[0]": 1.0}
    assert isinstance(handler.body[1], InitialLocalStateRequest)


def test_unknown_state_sharing_mode_is_rejected():
    with pytest.raises(ValueError, match="Unknown state_sharing mode 'sometimes'"):
        handle_local_states([init(0.0)], category="state", state_sharing="sometimes")


def shared_uses():
    foo = init(0.0, name="foo")
    bar = init(0.0, name="bar")
    return IncrementEach(refs=[foo, bar, foo, {"x": foo, "y": bar}])


@pytest.mark.parametrize("mode", ["allowed", "unsafe"])
def test_same_request_object_is_shared(mode):
    handler, states = handle_local_states(shared_uses(), category="state", state_sharing=mode)
    assert states == {"foo": 0.0, "bar": 0.0}
    _, new_states = handler((1.0, states))
    assert new_states == {"foo": 3.0, "bar": 2.0}


def test_same_request_object_is_rejected_when_forbidden():
    with pytest.raises(
        ValueError, match="Detected two local states with the same explicit name"
    ) as info:
        handle_local_states(shared_uses(), category="state")
    assert isinstance(info.value, autostate.AutostateError)
    assert "'foo'" in str(info.value)


def test_shared_initializer_runs_once():
    calls = []

    def make():
        calls.append(1)
        return 0.0

    req = InitialLocalStateRequest(make, "state", "foo")
    handle_local_states([req, req, req], category="state", state_sharing="allowed")
    assert calls == [1]


@pytest.mark.parametrize("mode", ["forbidden", "allowed"])
def test_different_initializers_with_one_name_fail(mode):
    tree = IncrementEach(refs=[init(1.0, name="x"), init(2.0, name="x")])
    with pytest.raises(
        StateSharingError, match="Detected two local states with the same explicit name"
    ):
        handle_local_states(tree, category="state", state_sharing=mode)


def test_different_initializers_with_one_name_share_under_unsafe_last_wins():
    tree = IncrementEach(refs=[init(1.0, name="x"), init(2.0, name="x")])
    handler, states = handle_local_states(tree, category="state", state_sharing="unsafe")
    assert states == {"x": 2.0}
    _, new_states = handler((1.0, states))
    assert new_states == {"x": 4.0}
    frozen_first = [init(1.0, name="x"), FrozenLocalStateRequest(7.0, "state", "x")]
    assert handle_local_states(frozen_first, category="state", state_sharing="unsafe")[1] == {
        "x": 7.0
    }


def test_two_frozen_requests_with_one_name_fail_when_allowed():
    tree = [FrozenLocalStateRequest(1.0, "state", "x"), FrozenLocalStateRequest(1.0, "state", "x")]
    with pytest.raises(
        StateSharingError, match="Detected two local states with the same explicit name"
    ):
        handle_local_states(tree, category="state", state_sharing="allowed")


def test_shared_request_is_rejected_when_forbidden():
    tree = [init(0.0, name="foo"), SharedLocalStateRequest("foo", "state")]
    with pytest.raises(
        ValueError,
        match="SharedLocalStateRequest must only be used when state_sharing is set to "
        "'allowed' or 'unsafe'",
    ) as info:
        handle_local_states(tree, category="state")
    assert isinstance(info.value, autostate.AutostateError)


@pytest.mark.parametrize("mode", ["allowed", "unsafe"])
def test_shared_request_before_any_value_fails(mode):
    tree = [SharedLocalStateRequest("foo", "state"), init(0.0, name="foo")]
    with pytest.raises(
        StateSharingError,
        match="must appear after some other state request with the same name and an explicit value",
    ):
        handle_local_states(tree, category="state", state_sharing=mode)


def test_names_are_per_handler_not_per_category():
    # As in penzai: one handler has one namespace, whatever the categories.
    tree = IncrementEach(
        refs=[init(1.0, category="a", name="foo"), SharedLocalStateRequest("foo", "b")]
    )
    handler, states = handle_local_states(
        tree, category_predicate=lambda c: True, state_sharing="allowed"
    )
    assert states == {"foo": 1.0}
    assert handler((1.0, states))[1] == {"foo": 3.0}
    # Handling category "b" alone, the valued "foo" of category "a" is not seen.
    with pytest.raises(StateSharingError, match="must appear after"):
        handle_local_states(tree, category="b", state_sharing="allowed")


@pytest.mark.parametrize(
    "first", [init(5.0, name="foo"), FrozenLocalStateRequest(5.0, "state", "foo")]
)
@pytest.mark.parametrize("mode", ["allowed", "unsafe"])
def test_shared_request_after_valued_one_shares_its_state(first, mode):
    tree = IncrementEach(
        refs=[
            first,
            SharedLocalStateRequest("foo", "state"),
            {"s": SharedLocalStateRequest("foo", "state")},
        ]
    )
    handler, states = handle_local_states(tree, category="state", state_sharing=mode)
    assert states == {"foo": 5.0}
    refs = slots_of(handler.body)
    assert [r.name for r in refs] == ["foo"] * 3
    assert all(r.was_explicitly_named for r in refs)
    _, new_states = handler((1.0, states))
    assert new_states == {"foo": 8.0}


def test_freeze_gives_frozen_then_shared_and_rehandles_equal():
    foo = init(0.0, name="foo")
    tree = IncrementEach(refs=[foo, {"p": init(jnp.zeros(2))}, foo, init(1.0, name="bar"), foo])
    handler, states = handle_local_states(
        tree, category="state", state_sharing="allowed", handler_id="h"
    )
    assert sorted(states) == ["bar", "foo", "refs[1]['p']"]
    _, states = handler((1.0, states))
    assert states["foo"] == 3.0 and states["bar"] == 2.0
    np.testing.assert_array_equal(states["refs[1]['p']"], [1.0, 1.0])

    frozen = freeze_local_states(handler, states)
    expected = IncrementEach(
        refs=[
            FrozenLocalStateRequest(jnp.asarray(3.0), "state", "foo"),
            {"p": FrozenLocalStateRequest(jnp.ones(2), "state", None)},
            SharedLocalStateRequest("foo", "state"),
            FrozenLocalStateRequest(jnp.asarray(2.0), "state", "bar"),
            SharedLocalStateRequest("foo", "state"),
        ]
    )
    assert_trees_equal(frozen, expected)
    assert [type(s).__name__ for s in slots_of(frozen.refs)] == [
        "FrozenLocalStateRequest",
        "FrozenLocalStateRequest",
        "SharedLocalStateRequest",
        "FrozenLocalStateRequest",
        "SharedLocalStateRequest",
    ]

    handler2, states2 = handle_local_states(
        frozen, category="state", state_sharing="allowed", handler_id="h"
    )
    assert jax.tree_util.tree_structure(handler2) == jax.tree_util.tree_structure(handler)
    assert handler2.body.refs == handler.body.refs
    assert_trees_equal(states2, states)
    assert sorted(states2) == sorted(states)
    _, states3 = handler2((1.0, states2))
    assert states3["foo"] == 6.0 and states3["bar"] == 3.0


def test_freeze_leaves_other_handlers_refs_and_requests_alone():
    other = init(4.0, category="other")
    handler, states = handle_local_states([init(1.0), other], category="state")
    frozen = freeze_local_states(handler, {"[0]": 2.0})
    assert frozen[1] is other
    assert frozen[0] == FrozenLocalStateRequest(2.0, "state", None)
    assert frozen[0].get() == 2.0


def test_freeze_with_missing_state_names_it():
    handler, _ = handle_local_states([init(1.0, name="alpha")], category="state")
    with pytest.raises(UnhandledLocalStateError, match="'alpha' is missing from the states dict"):
        freeze_local_states(handler, {})


def test_freeze_rejects_non_handler():
    with pytest.raises(TypeError, match="expects a WithFunctionalLocalState"):
        freeze_local_states([init(1.0)], {})


def test_hoist_and_embed_round_trip():
    foo = init(0.0, name="foo")
    bar = FrozenLocalStateRequest(jnp.arange(2.0), "state", "bar")
    unnamed = init(1.0)
    tree = {"a": [foo, bar, unnamed], "b": (foo, SharedLocalStateRequest("bar", "state"))}
    hoisted, requests = hoist_shared_state_requests(tree)
    assert requests.keys() == {"foo", "bar"}
    assert requests["foo"] is foo and requests["bar"] is bar
    assert hoisted["a"][0] == SharedLocalStateRequest("foo", "state")
    assert hoisted["a"][1] == SharedLocalStateRequest("bar", "state")
    assert hoisted["a"][2] is unnamed
    assert hoisted["b"] == (
        SharedLocalStateRequest("foo", "state"),
        SharedLocalStateRequest("bar", "state"),
    )
    assert not any(
        isinstance(s, (InitialLocalStateRequest, FrozenLocalStateRequest)) and s.name is not None
        for s in slots_of(hoisted)
    )

    embedded = embed_shared_state_requests(hoisted, requests)
    assert embedded["a"][0] is foo and embedded["a"][1] is bar and embedded["a"][2] is unnamed
    assert embedded["b"] == (
        SharedLocalStateRequest("foo", "state"),
        SharedLocalStateRequest("bar", "state"),
    )
    # The embedded tree handles (with sharing) to the same states as the original would.
    _, states = handle_local_states(embedded, category="state", state_sharing="allowed")
    assert sorted(states) == ["['a'][2]", "bar", "foo"]
    np.testing.assert_array_equal(states["bar"], [0.0, 1.0])
    assert states["foo"] == 0.0 and states["['a'][2]"] == 1.0


def test_hoist_rejects_conflicting_values_unless_unsafe():
    first, second = init(1.0, name="x"), init(2.0, name="x")
    with pytest.raises(
        StateSharingError, match="Detected two local states with the same explicit name"
    ):
        hoist_shared_state_requests([first, second])
    hoisted, requests = hoist_shared_state_requests([first, second], unsafe=True)
    assert hoisted == [SharedLocalStateRequest("x", "state")] * 2
    assert requests["x"] is first


def nested(inner_id="inner", outer_id="outer"):
    inner_body = Inner(b=init(100.0, category="inner", name="x"), peek=init(1.0, category="outer"))
    inner_handler, inner_states = handle_local_states(
        inner_body, category="inner", handler_id=inner_id
    )
    outer_body = Outer(a=init(0.0, category="outer", name="x"), inner=inner_handler)
    outer_handler, outer_states = handle_local_states(
        outer_body, category="outer", handler_id=outer_id
    )
    return outer_handler, outer_states, inner_states


def test_nested_handlers_each_handle_their_own_refs():
    outer_handler, outer_states, inner_states = nested()
    assert inner_states == {"x": 100.0}
    # The same explicit name lives in both handlers without conflict; the outer
    # state inside the inner body is path-named through the inner handler.
    assert outer_states == {"x": 0.0, "inner.body.peek": 1.0}
    inner_body = outer_handler.body.inner.body
    assert inner_body.b.handler_id == "inner" and inner_body.peek.handler_id == "outer"
    assert outer_handler.body.a.handler_id == "outer"

    (y, inner_states), outer_states = outer_handler(((5.0, inner_states), outer_states))
    # inner returns b + peek = 100 + 1; outer adds its a (= 1 after the increment).
    assert y == 102.0
    assert inner_states == {"x": 105.0}
    assert outer_states == {"x": 1.0, "inner.body.peek": 10.0}


def test_ref_of_a_handler_that_is_not_running_is_unhandled():
    outer_handler, outer_states, inner_states = nested()

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class CallsInnerBodyDirectly:
        inner_body: Any

        def __call__(self, x):
            return self.inner_body(x)

    # Outer is running, inner is not: the inner ref is unhandled, the outer one works.
    sneaky = CallsInnerBodyDirectly(inner_body=outer_handler.body.inner.body)
    run = WithFunctionalLocalState("outer", sneaky)
    with pytest.raises(UnhandledLocalStateError) as info:
        run((1.0, outer_states))
    message = str(info.value)
    assert "'x'" in message and "unhandled" in message
    assert "'inner'" in message and "not running" in message
    assert "handler((arg, states))" in message
    assert isinstance(info.value, autostate.AutostateError)
    assert isinstance(info.value, RuntimeError)


def test_running_calls_are_seen_only_while_their_handler_runs():
    seen: dict[str, Any] = {}

    def body(x):
        seen["running"] = local_state.handler_running()
        seen["outer"] = local_state.is_running("outer")
        seen["inner"] = local_state.is_running("inner")
        seen["cells"] = dict(local_state.handler_cells("inner"))
        seen["all"] = sorted(cell.name for cell in local_state.running_cells())
        seen["ids"] = [call[0] for call in local_state.running_calls()]
        return x

    def outer(x):
        return local_state.run_with_states("inner", {"b": 2.0}, body, (x,), {})[0]

    out, states = local_state.run_with_states("outer", {"a": 1.0}, outer, (5.0,), {})
    assert (out, states) == (5.0, {"a": 1.0})
    assert seen["running"] and seen["outer"] and seen["inner"]
    assert {name: cell.value for name, cell in seen["cells"].items()} == {"b": 2.0}
    assert seen["all"] == ["a", "b"] and sorted(seen["ids"]) == ["inner", "outer"]
    assert local_state.running_call("inner") is None
    assert not local_state.handler_running() and local_state.handler_cells("inner") == {}
    assert list(local_state.running_calls()) == []


def test_handler_ids_are_honoured_and_fresh_ones_distinct():
    h1, _ = handle_local_states([init(0.0)], category="state", handler_id="mine")
    assert h1.handler_id == "mine" and h1.body[0].handler_id == "mine"
    h2, _ = handle_local_states([init(0.0)], category="state")
    h3, _ = handle_local_states([init(0.0)], category="state")
    assert h2.handler_id != h3.handler_id
    assert h2.handler_id != "mine"


def test_reusing_a_handler_id_already_in_the_body_is_rejected():
    inner, _ = handle_local_states([init(0.0)], category="state", handler_id="mine")
    with pytest.raises(ValueError, match="already holds state '\\[0\\]'") as caught:
        handle_local_states([inner.body, init(1.0)], category="state", handler_id="mine")
    assert isinstance(caught.value, autostate.AutostateError)
    assert "fix:" in str(caught.value)
    outer, states = handle_local_states(
        [inner.body, init(1.0)], category="state", handler_id="outer"
    )
    assert states == {"[1]": 1.0}
    assert outer.body[0][0].handler_id == "mine"


def affine_handler():
    w = jnp.asarray([[1.0, -2.0], [0.5, 0.25], [0.0, 1.0]])
    body = Affine(
        w=w,
        count=InitialLocalStateRequest(lambda: jnp.zeros((), jnp.int32), "state", "count"),
        total=InitialLocalStateRequest(lambda: jnp.zeros(()), "state", "total"),
    )
    handler, states = handle_local_states(body, category="state")
    return handler, states, w


def count_primitives(jaxpr: Any, counts: collections.Counter | None = None) -> collections.Counter:
    counts = collections.Counter() if counts is None else counts
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        counts[eqn.primitive.name] += 1
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    count_primitives(sub, counts)
    return counts


def test_jit_with_handler_as_argument_matches_eager_and_hand_written():
    handler, states, w = affine_handler()
    x = jnp.asarray([[1.0, 2.0, 3.0], [-1.0, 0.5, 2.0]])
    traces = []

    def run(h, s, x):
        traces.append(1)
        return h((x, s))

    jitted = jax.jit(run)
    y_jit, s_jit = jitted(handler, states, x)
    y_eager, s_eager = handler((x, states))
    y_hand, s_hand = affine_by_hand(w, states, x)
    np.testing.assert_allclose(y_jit, y_eager, rtol=1e-6)
    np.testing.assert_allclose(y_jit, y_hand, rtol=1e-6)
    assert sorted(s_jit) == ["count", "total"]
    assert int(s_jit["count"]) == 1 and int(s_eager["count"]) == 1
    np.testing.assert_allclose(s_jit["total"], s_hand["total"], rtol=1e-6)
    np.testing.assert_allclose(s_jit["total"], s_eager["total"], rtol=1e-6)

    # New parameter values and new states reuse the trace.
    handler2 = jax.tree_util.tree_map(lambda leaf: leaf * 2, handler)
    y2, s2 = jitted(handler2, s_jit, x)
    assert len(traces) == 1
    assert int(s2["count"]) == 2
    np.testing.assert_allclose(y2, jnp.tanh(x @ (2 * w)), rtol=1e-6)

    # The handler adds nothing to the traced program.
    jaxpr = jax.make_jaxpr(jax.jit(lambda h, s, x: h((x, s))))(handler, states, x)
    hand = jax.make_jaxpr(jax.jit(affine_by_hand))(w, states, x)
    counts = count_primitives(jaxpr)
    assert counts == count_primitives(hand)
    assert counts["tanh"] == 1 and counts["dot_general"] == 1
    assert len(jaxpr.jaxpr.invars) == len(hand.jaxpr.invars) == 4
    assert len(jaxpr.jaxpr.outvars) == len(hand.jaxpr.outvars) == 3


def test_handler_leaves_are_only_the_body_parameters():
    handler, _, w = affine_handler()
    leaves = jax.tree_util.tree_leaves(handler)
    assert len(leaves) == 1 and leaves[0] is w


def test_grad_through_handler_wrt_body_parameter():
    handler, states, w = affine_handler()
    x = jnp.asarray([[1.0, 2.0, 3.0], [-1.0, 0.5, 2.0]])

    def loss(h):
        y, new_states = h((x, states))
        return (y**2).sum() + 3.0 * new_states["total"]

    def loss_by_hand(w):
        y, new_states = affine_by_hand(w, states, x)
        return (y**2).sum() + 3.0 * new_states["total"]

    grads = jax.grad(loss)(handler)
    assert isinstance(grads, WithFunctionalLocalState)
    assert isinstance(grads.body.count, HandledLocalStateRef)
    expected = jax.grad(loss_by_hand)(w)
    np.testing.assert_allclose(grads.body.w, expected, rtol=1e-5)
    assert float(jnp.abs(expected).sum()) > 0.1
    np.testing.assert_allclose(jax.jit(jax.grad(loss))(handler).body.w, expected, rtol=1e-5)


def test_grad_through_handler_wrt_state():
    handler, states, _ = affine_handler()
    x = jnp.ones((1, 3))

    def loss(total):
        _, new_states = handler((x, {**states, "total": total}))
        return new_states["total"] ** 2

    total = jnp.asarray(1.5)
    y = jnp.tanh(x @ handler.body.w).sum()
    np.testing.assert_allclose(jax.grad(loss)(total), 2 * (total + y), rtol=1e-6)


def test_calling_handled_body_without_handler_says_what_to_call():
    handler, states = handle_local_states(
        ReadWriteReread(a=init(1.0, name="a"), b=init(2.0, name="b")), category="state"
    )
    with pytest.raises(UnhandledLocalStateError) as info:
        handler.body(1.0)
    message = str(info.value)
    assert "'a'" in message and "unhandled" in message
    assert handler.handler_id in message
    assert "handler((arg, states))" in message
    with pytest.raises(UnhandledLocalStateError, match="unhandled"):
        handler.body.b.set(3.0)


@pytest.mark.parametrize(
    "request_",
    [init(1.0, name="a"), SharedLocalStateRequest("a", "state")],
    ids=["initial", "shared"],
)
def test_calling_body_with_unhandled_request_says_what_to_call(request_):
    body = ReadWriteReread(a=request_, b=init(2.0, name="b"))
    with pytest.raises(UnhandledLocalStateError) as info:
        body(1.0)
    message = str(info.value)
    assert "'a'" in message and "unhandled" in message
    assert "handle_local_states" in message
    with pytest.raises(UnhandledLocalStateError, match="unhandled"):
        request_.set(3.0)


def test_frozen_request_reads_but_cannot_be_set_unhandled():
    req = FrozenLocalStateRequest(2.0, "state", "a")
    assert req.get() == 2.0
    with pytest.raises(UnhandledLocalStateError, match="handle_local_states"):
        req.set(3.0)


def test_missing_state_key_is_named():
    handler, states = handle_local_states(
        ReadWriteReread(a=init(1.0, name="alpha"), b=init(2.0, name="beta")), category="state"
    )
    with pytest.raises(UnhandledLocalStateError) as info:
        handler((1.0, {"alpha": 1.0}))
    message = str(info.value)
    assert "'beta' is missing from the states dict" in message
    assert "['alpha']" in message


def test_states_must_be_a_dict():
    handler, _ = handle_local_states([init(1.0)], category="state")
    with pytest.raises(TypeError, match="States must be a dict"):
        handler((1.0, [1.0]))


def test_handle_local_states_on_a_decorated_model_matches_plain(write_module: Loader) -> None:
    plain, dec = pair(write_module, CATS)
    ref = plain.Decoder()
    handler, states = autostate.handle_local_states(dec.Decoder(), category_predicate=lambda c: True)
    assert isinstance(handler, autostate.WithFunctionalLocalState)
    step = jax.jit(lambda h, s, x: h((x, s)))
    for x in (1.0, 2.0, 3.0, 4.0):
        expected = ref(x)
        out, states = step(handler, states, x)
        assert_same(expected, out)
    frozen = autostate.freeze_local_states(handler, states)
    assert_same(snapshot(ref), snapshot(frozen))
    assert_same(ref(5.0), frozen(5.0))
    assert_same(snapshot(ref), snapshot(frozen))


def test_nested_handlers_cache_inside_state_match_plain(write_module: Loader) -> None:
    plain, dec = pair(write_module, CATS)
    ref = plain.Decoder()
    inner, cache = autostate.handle_local_states(dec.Decoder(), category="cache", handler_id="c")
    outer, rest = autostate.handle_local_states(inner, category_predicate=lambda c: c != "cache")
    assert sorted(cache) == ["kv", "pos"] and sorted(rest) == ["body.steps", "body.table"]
    step = jax.jit(lambda h, c, r, x: h(((x, c), r)))
    for x in (1.0, 2.0, 3.0):
        expected = ref(x)
        (out, cache), rest = step(outer, cache, rest, x)
        assert_same(expected, out)
    model = autostate.freeze_local_states(autostate.freeze_local_states(outer, rest), cache)
    assert_same(snapshot(ref), snapshot(model))


def test_grad_through_a_handler_wrt_the_body_parameters(write_module: Loader) -> None:
    _, dec = pair(write_module, CATS)
    handler, states = autostate.handle_local_states(dec.Decoder(), category_predicate=lambda c: True)
    f, fstates = dec.Decoder().functionalize()
    g1 = jax.grad(lambda h: h((2.0, states))[0])(handler)
    g2 = jax.grad(lambda f: f(fstates, 2.0)[0])(f)
    assert_same(g2.model.w, g1.body.w)


def test_body_called_outside_its_handler_is_the_documented_error(write_module: Loader) -> None:
    _, dec = pair(write_module, CATS)
    handler, states = autostate.handle_local_states(dec.Decoder(), category="cache")
    with pytest.raises(errors.UnhandledLocalStateError) as info:
        handler.body(1.0)
    assert "kv" in str(info.value) and "fix" in str(info.value)
    # the inner handler's refs are not handled by an outer handler of another id
    outer, rest = autostate.handle_local_states(handler.body, category="state")
    with pytest.raises(errors.UnhandledLocalStateError):
        outer((1.0, rest))
    # a frozen model runs alone again, and the failed calls changed nothing
    frozen = autostate.freeze_local_states(handler, states)
    assert float(frozen(1.0)) == float(dec.Decoder()(1.0))


def test_lazy_handler_states_equal_eager_ones(write_module: Loader) -> None:
    _, dec = pair(write_module, PACK)
    _, states = dec.Mixed(3).functionalize()
    f, thunk = dec.Mixed(3).functionalize(lazy=True)
    assert callable(thunk)
    assert_bits(states, thunk(), bitwise=True)
    out, _ = f(thunk(), jnp.ones(3))
    assert_bits(dec.Mixed(3)(jnp.ones(3)), out, bitwise=True)


def test_a_reference_used_after_its_call_names_the_reason():
    ref = autostate.HandledLocalStateRef("h", "count", True, "state")
    with pytest.raises(UnhandledLocalStateError, match="handler 'h', which is not running"):
        ref.get()
    another = errors.unhandled_ref_error(ref, "another call")
    assert type(another) is UnhandledLocalStateError
    assert "another model's call" in str(another) and "'count'" in str(another)
