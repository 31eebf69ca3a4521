"""Lists, dicts and sets a model holds as static data, changed in place.

Such a container is not state: it is part of ``f``'s structure, shared by
every copy of ``f`` (the one ``jax.jit`` rebuilds each trace too). Changed
in place inside a traced call (``self.log.append(x)``), the change would
happen once per trace instead of once per call, and a tracer appended would
leak into the caller's ``f``. The call is refused, naming the attribute, and
the container is put back; an eager call of ``f`` changes ``f``'s own copy,
as plain Python would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autostate


@autostate.stateful
class Keeps:
    def __init__(self):
        self.w = jnp.ones(2)
        self.log = []
        self.seen = {}
        self.tags = set()
        self.nested = {"inner": [0]}

    def append(self, x):
        self.log.append(x)
        return x * self.w

    def item(self, x):
        self.seen.update(k=1)
        return x * self.w

    def add(self, x):
        self.tags.add("t")
        return x * self.w

    def deep(self, x):
        self.nested["inner"].append(1)
        return x * self.w

    def fine(self, x):
        _ = len(self.log) + len(self.seen)
        return x * self.w


@autostate.stateful
class Leaf:
    def __init__(self):
        self.n = jnp.zeros(())

    def __call__(self, x):
        self.n = self.n + 1
        return x


@autostate.stateful
class Holder:
    """A static container next to a sub-model in one attribute."""

    def __init__(self):
        self.parts = [Leaf(), []]

    def __call__(self, x):
        self.parts[1].append(0)
        return self.parts[0](x)


TRANSFORMS: dict[str, Callable[[Any, Any, Any, str], Any]] = {
    "jit": lambda f, s, x, m: jax.jit(lambda f, s, x: getattr(f, m)(s, x))(f, s, x),
    "grad": lambda f, s, x, m: jax.grad(lambda x: getattr(f, m)(s, x)[0].sum())(x),
    "vmap": lambda f, s, x, m: jax.vmap(lambda x: getattr(f, m)(s, x)[0])(jnp.stack([x, x])),
}

CHANGES = {"append": "Keeps.log", "item": "Keeps.seen", "add": "Keeps.tags", "deep": "Keeps.nested"}


@pytest.mark.parametrize("how", list(TRANSFORMS))
@pytest.mark.parametrize("method", list(CHANGES))
def test_an_in_place_change_inside_a_traced_call_is_refused(method: str, how: str) -> None:
    f, states = Keeps().functionalize()
    before = (list(f.model.log), dict(f.model.seen), set(f.model.tags), {"inner": [0]})
    with pytest.raises(autostate.AutostateError, match=CHANGES[method]):
        TRANSFORMS[how](f, states, jnp.ones(2), method)
    # Put back, and f still works.
    m = f.model
    assert (m.log, m.seen, m.tags, m.nested) == before
    out, _ = jax.jit(lambda f, s, x: f.fine(s, x))(f, states, jnp.full(2, 3.0))
    np.testing.assert_allclose(out, jnp.full(2, 3.0))


def test_reading_static_containers_under_jit_is_fine() -> None:
    f, states = Keeps().functionalize()
    out, _ = jax.jit(lambda f, s, x: f.fine(s, x))(f, states, jnp.ones(2))
    np.testing.assert_allclose(out, jnp.ones(2))


def test_an_eager_call_of_f_changes_its_own_copy_as_python_would() -> None:
    model = Keeps()
    f, states = model.functionalize()
    f.append(states, 1.0)
    f.append(states, 2.0)
    assert f.model.log == [1.0, 2.0]
    assert model.log == []  # f holds a copy of the model
    plain = Keeps.__new__(Keeps)
    plain.__dict__.update(log=[])
    plain.log.append(1.0)
    plain.log.append(2.0)
    assert plain.log == f.model.log


def test_a_static_container_beside_a_sub_model_is_checked_too() -> None:
    f, states = Holder().functionalize()
    with pytest.raises(autostate.AutostateError, match="Holder.parts"):
        jax.jit(lambda f, s, x: f(s, x))(f, states, jnp.ones(2))
    assert f.model.parts[1] == []


def test_a_traced_value_never_stays_in_a_static_list() -> None:
    f, states = Keeps().functionalize()
    with pytest.raises(autostate.AutostateError):
        jax.jit(lambda f, s, x: f.append(s, x))(f, states, jnp.ones(2))
    assert f.model.log == []
    assert not any(isinstance(v, jax.core.Tracer) for v in f.model.log)
