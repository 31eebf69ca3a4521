"""Seed parity (issue 15): the engine against penzai v1's local state, the host
fallback against equinox's experimental ``StateIndex``.

Each test translates a check of the seed (its values and messages) and runs it
against autostate.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autostate
from autostate import (
    FrozenLocalStateRequest,
    InitialLocalStateRequest,
    SharedLocalStateRequest,
    embed_shared_state_requests,
    handle_local_states,
    hoist_shared_state_requests,
    rename_local_states,
)
from autostate.errors import AutostateError, StateSharingError

# --- penzai v1: hoist / embed ---------------------------------------------------


def test_hoist_leaves_names_used_once_in_place():
    once = FrozenLocalStateRequest(1, "c", name="once")
    hoisted, bindings = hoist_shared_state_requests([once])
    assert hoisted == [once] and hoisted[0] is once
    assert bindings == {}


def test_penzai_hoist_and_embed_round_trip():
    # penzai v1's test_hoist_shared_state_requests, value for value.
    shared_initial = InitialLocalStateRequest(lambda: 10, name="foo", category="a")
    hoistable = [
        [
            shared_initial,
            shared_initial,
            FrozenLocalStateRequest(state=20, name="bar", category="b"),
            SharedLocalStateRequest(name="bar", category="b"),
            SharedLocalStateRequest(name="foo", category="a"),
        ],
        [
            SharedLocalStateRequest(name="foo", category="a"),
            SharedLocalStateRequest(name="bar", category="b"),
        ]
        * 3,
    ]
    hoisted, bindings = hoist_shared_state_requests(hoistable)
    assert hoisted[0] == [
        SharedLocalStateRequest("foo", "a"),
        SharedLocalStateRequest("foo", "a"),
        SharedLocalStateRequest("bar", "b"),
        SharedLocalStateRequest("bar", "b"),
        SharedLocalStateRequest("foo", "a"),
    ]
    assert bindings == {"foo": shared_initial, "bar": FrozenLocalStateRequest(20, "b", "bar")}
    re_embedded = embed_shared_state_requests(hoisted[1], bindings)
    assert re_embedded == [
        shared_initial,
        FrozenLocalStateRequest(state=20, name="bar", category="b"),
        SharedLocalStateRequest(name="foo", category="a"),
        SharedLocalStateRequest(name="bar", category="b"),
        SharedLocalStateRequest(name="foo", category="a"),
        SharedLocalStateRequest(name="bar", category="b"),
    ]


def test_hoist_rejects_one_frozen_request_used_twice():
    frozen = FrozenLocalStateRequest(jnp.ones(2), "c", name="kv")
    with pytest.raises(StateSharingError) as info:
        hoist_shared_state_requests([frozen, frozen])
    assert isinstance(info.value, ValueError)
    assert (
        "Detected two local states with the same explicit name 'kv' but different "
        "initializers or values! This is only allowed `unsafe` is set to `True`."
    ) in str(info.value)
    hoisted, bindings = hoist_shared_state_requests([frozen, frozen], unsafe=True)
    assert hoisted == [SharedLocalStateRequest("kv", "c")] * 2 and bindings["kv"] is frozen


def test_embed_rejects_mismatched_categories():
    hoisted = [SharedLocalStateRequest("kv", "cache")]
    with pytest.raises(ValueError) as info:
        embed_shared_state_requests(hoisted, {"kv": FrozenLocalStateRequest(1.0, "state", "kv")})
    assert isinstance(info.value, StateSharingError)
    assert "Tried to substitute values with mismatched categories! Got state, expected cache" in (
        str(info.value)
    )


# --- penzai v1: parameter renaming -------------------------------------------------


def test_requests_rename_their_explicit_names_only():
    def prefix(name):
        return "enc." + name

    def init():
        return 0.0

    named = InitialLocalStateRequest(init, "c", name="n")
    assert named.with_renamed_parameters(prefix) == InitialLocalStateRequest(init, "c", "enc.n")
    unnamed = InitialLocalStateRequest(init, "c")
    assert unnamed.with_renamed_parameters(prefix) is unnamed
    frozen = FrozenLocalStateRequest(jnp.ones(2), "c", name="k")
    renamed = frozen.with_renamed_parameters(prefix)
    assert renamed.name == "enc.k" and renamed.state is frozen.state and renamed.category == "c"
    unnamed_frozen = FrozenLocalStateRequest(jnp.ones(2), "c")
    assert unnamed_frozen.with_renamed_parameters(prefix) is unnamed_frozen
    assert SharedLocalStateRequest("k", "c").with_renamed_parameters(prefix) == (
        SharedLocalStateRequest("enc.k", "c")
    )
    with pytest.raises(TypeError, match="rename_fn returned int 3 for state 'n'"):
        named.with_renamed_parameters(lambda name: 3)


@autostate.stateful
class Block:
    def __init__(self):
        self.kv = autostate.state(jnp.zeros(2), category="cache", name="kv")
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.kv = self.kv + x
        self.calls += 1
        return self.kv.sum()


def test_rename_local_states_keeps_composed_parts_apart():
    blocks = [Block(), Block()]
    with pytest.raises(StateSharingError, match="same explicit name 'kv'"):
        handle_local_states(blocks, category="cache")
    renamed = [
        rename_local_states(blocks[0], lambda name: "enc." + name),
        rename_local_states(blocks[1], lambda name: "dec." + name),
    ]
    handler, states = handle_local_states(renamed, category="cache")
    assert sorted(states) == ["dec.kv", "enc.kv"]
    # The originals are untouched; path-named states keep their path names.
    assert blocks[0].__dict__["kv"].name == "kv"
    f, all_states = autostate.functionalize(renamed)
    assert sorted(all_states) == ["[0].calls", "[1].calls", "dec.kv", "enc.kv"]

    tree = {
        "a": FrozenLocalStateRequest(1.0, "c", "x"),
        "b": SharedLocalStateRequest("x", "c"),
        "c": FrozenLocalStateRequest(2.0, "c"),
    }
    out = rename_local_states(tree, str.upper)
    assert out == {
        "a": FrozenLocalStateRequest(1.0, "c", "X"),
        "b": SharedLocalStateRequest("X", "c"),
        "c": tree["c"],
    }
    assert autostate.rename_local_states is rename_local_states
    with pytest.raises(TypeError, match="rename_fn must be a function"):
        rename_local_states(tree, "enc.")


def test_every_new_error_is_an_autostate_error():
    with pytest.raises(AutostateError):
        embed_shared_state_requests(
            [SharedLocalStateRequest("kv", "a")], {"kv": FrozenLocalStateRequest(1.0, "b", "kv")}
        )
