"""A state written inside a JAX transformation a method runs itself.

``jax.grad(loss)(x)`` inside a method, with ``loss`` writing ``self.n``,
leaves the state holding a tracer of that finished transformation: in plain
Python it is a leaked tracer. Whatever the transformation (grad,
value_and_grad, jvp, jacrev, linearize), ``f(states, ...)`` and
``jax.jit(f)`` refuse it with ``EscapedStateError`` at the user's line, and
never return such a tracer. Transformations of ``f`` from outside (grad,
jacfwd, vmap, checkpoint, linearize) are not escapes and keep working.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import autostate


@autostate.stateful
class Inner:
    def __init__(self) -> None:
        self.n = jnp.zeros(())

    def _loss(self, v):
        self.n = v * 2
        return v**2

    def grad(self, x):
        return jax.grad(self._loss)(x)

    def value_and_grad(self, x):
        return jax.value_and_grad(self._loss)(x)[1]

    def jvp(self, x):
        return jax.jvp(self._loss, (x,), (jnp.ones(()),))[1]

    def jacrev(self, x):
        return jax.jacrev(self._loss)(x)

    def linearize(self, x):
        return jax.linearize(self._loss, x)[0]

    def step(self, x):
        self.n = self.n + x
        return self.n**2


@pytest.mark.parametrize("jit", [False, True], ids=["f", "jit"])
@pytest.mark.parametrize("method", ["grad", "value_and_grad", "jvp", "jacrev", "linearize"])
def test_a_state_written_inside_a_transformation_of_a_method_is_refused(
    method: str, jit: bool
) -> None:
    f, states = Inner().functionalize()
    call = getattr(f, method)
    if jit:
        call = jax.jit(call)
    with pytest.raises(autostate.errors.EscapedStateError, match="State 'n'") as info:
        call(states, jnp.float32(1.5))
    assert __file__ in str(info.value)
    out, new = jax.jit(f.step)(states, 1.0)  # f is left usable
    assert float(out) == 1.0 and float(new["n"]) == 1.0


def test_transformations_of_f_from_outside_are_not_escapes() -> None:
    f, states = Inner().functionalize()

    def loss(states: dict) -> jax.Array:
        return f.step(states, 1.0)[0]

    assert float(jax.grad(loss)(states)["n"]) == 2.0
    assert float(jax.jacfwd(loss)(states)["n"]) == 2.0
    assert float(jax.grad(jax.checkpoint(loss))(states)["n"]) == 2.0
    assert float(jax.linearize(loss, states)[0]) == 1.0
    out, new = jax.vmap(lambda s: f.step(s, 1.0))({"n": jnp.arange(3.0)})
    assert new["n"].tolist() == [1.0, 2.0, 3.0]
    out, new = jax.checkpoint(lambda s: f.step(s, 1.0))(states)
    assert float(new["n"]) == 1.0
