"""lifting/loops.py: a loop's assigned states go into its carry, and only those."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

import autostate
from tests.unit.lifting.placement import equation


@autostate.stateful
class Running:
    def __init__(self):
        self.total = jnp.zeros(())
        self.scale = jnp.full((), 2.0)  # read, never assigned: no carry
        self.steps = jnp.zeros((), jnp.int32)

    def scan(self, xs):
        def body(h, x):
            self.total = self.total + x * self.scale
            return h + x, h

        return lax.scan(body, 0.0, xs)

    def fori(self, n):
        def body(i, h):
            self.steps += 1
            return h + self.scale

        return lax.fori_loop(0, n, body, 0.0)

    def until(self, limit):
        def body(h):
            self.steps += 1
            return h + 1.0

        return lax.while_loop(lambda h: self.steps < limit, body, 0.0)


def carries(eqn: Any) -> int:
    """How many carries a scan equation threads: its ``num_carry`` (jax < 0.11);
    later jax keeps no count, so its outputs that are not stacked over the
    scan's length (this file's carries are scalars)."""
    if "num_carry" in eqn.params:
        return eqn.params["num_carry"]
    return sum(v.aval.shape[:1] != (eqn.params["length"],) for v in eqn.outvars)


def test_scan_threads_the_assigned_state_as_carry():
    model = Running()
    f, states = model.functionalize()
    xs = jnp.arange(3.0)
    eqn = equation(lambda s: f.scan(s, xs), states, primitive="scan")
    assert carries(eqn) == 2  # the user's h, and total
    (_, ys), new = f.scan(states, xs)
    assert float(new["total"]) == 6.0 and list(ys) == [0.0, 0.0, 1.0]
    assert new["steps"] is states["steps"]


def test_fori_and_while_thread_their_body_states():
    model = Running()
    assert float(model.fori(3)) == 6.0 and int(model.steps) == 3
    f, states = model.functionalize()
    eqn = equation(lambda s: f.until(s, 5), states, primitive="while")
    assert len(eqn.outvars) == 2  # the user's h, and steps
    out, new = jax.jit(f.until)(states, 5)
    assert float(out) == 2.0 and int(new["steps"]) == 5


def test_map_is_a_scan_of_its_function():
    model = Running()
    ys = autostate.map(lambda x: model.scan(x[None])[0], jnp.arange(3.0))
    assert list(ys) == [0.0, 1.0, 2.0] and float(model.total) == 6.0
