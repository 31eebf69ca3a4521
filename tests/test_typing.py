"""Typing: the documented usage type-checks with useful types (mypy), and
``autostate.Stateful`` works at run time as ``@stateful`` does."""

from __future__ import annotations

import textwrap

import jax
import jax.numpy as jnp
import pytest

import autostate

USAGE = textwrap.dedent(
    """
    from typing import Any

    import jax
    import jax.numpy as jnp

    import autostate


    class Counter(autostate.Stateful):
        def __init__(self) -> None:
            self.count = jnp.zeros(())

        def __call__(self, x: jax.Array) -> jax.Array:
            self.count += 1
            return x * self.count


    @autostate.stateful
    class Plain:
        def __init__(self) -> None:
            self.w = jnp.ones(2)


    f, states = Counter().functionalize()
    out, states = f(states, jnp.ones(2))
    model = autostate.freeze(f, states)
    reveal_type(f)
    reveal_type(model)
    reveal_type(states)
    g, plain_states = autostate.functionalize(Plain())
    reveal_type(autostate.freeze(g, plain_states))
    reveal_type(autostate.load("ckpt.npz", like=Plain()))
    reveal_type(jax.jit(f))
    """
)


def test_documented_usage_type_checks_with_mypy(tmp_path):
    api = pytest.importorskip("mypy.api")
    (tmp_path / "usage.py").write_text(USAGE)
    stdout, stderr, status = api.run(
        [
            str(tmp_path / "usage.py"),
            "--cache-dir",
            str(tmp_path / "cache"),
            "--no-error-summary",
            "--follow-imports=silent",
        ]
    )
    notes = [line for line in stdout.splitlines() if "error" in line]
    assert status == 0, stdout + stderr
    assert not notes, stdout
    revealed = [line.split("Revealed type is ")[1] for line in stdout.splitlines() if "Revealed" in line]
    assert revealed[0] == "\"autostate.functional.FunctionalModel[usage.Counter]\""
    assert revealed[1] == "\"usage.Counter\""
    assert revealed[2] in ("\"dict[str, Any]\"", "\"builtins.dict[builtins.str, Any]\"")
    assert revealed[3] == "\"usage.Plain\""
    assert revealed[4] == "\"usage.Plain\""


class Counter(autostate.Stateful):
    def __init__(self):
        self.count = jnp.zeros(())

    def __call__(self, x):
        self.count += 1
        return x * self.count


class Child(Counter):
    def __call__(self, x):
        self.count += 2
        return x


@autostate.stateful(category="cache")
class Cached(autostate.Stateful):
    def __init__(self):
        self.kv = jnp.zeros(2)

    def write(self, x):
        self.kv = x


def test_stateful_base_class_decorates_subclasses():
    model = Counter()
    model(jnp.ones(2))
    assert float(model.count) == 1.0
    f, states = model.functionalize()
    out, states = jax.jit(lambda f, s, x: f(s, x))(f, states, jnp.ones(2))
    assert float(states["count"]) == 2.0
    child = Child()
    child(1.0)
    assert float(child.count) == 2.0
    assert autostate.tree.class_info(Child).state == {"count"}
    _, cached = Cached().functionalize("cache")
    assert sorted(cached) == ["kv"]
