"""A user's keyword argument may have any name, even one autostate's own
wrappers use for their parameters (``states``, ``cls``, ``sub``, ``klass``,
``flat_states``): each wrapper takes its own parameters positionally only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import autostate


@autostate.stateful
class Named:
    def __init__(self, *, cls=1.0, klass=2.0, states=3.0, sub=4.0):
        self.w = jnp.asarray(cls + klass + states + sub)
        self.n = jnp.zeros(())

    def __call__(self, x, *, states=0.0, cls=0.0):
        self.n = self.n + 1
        return x * self.w + states + cls

    def step(self, x, /, *, states=0.0, flat_states=0.0):
        self.n = self.n + states
        return x + flat_states


def _plain_call(x, states=0.0, cls=0.0):
    return x * 10.0 + states + cls


def test_constructor_keywords_named_like_autostate_parameters() -> None:
    model = Named(cls=2.0, klass=3.0, states=4.0, sub=5.0)
    np.testing.assert_allclose(model.w, 14.0)


def test_f_and_its_methods_take_a_keyword_named_states() -> None:
    model = Named()
    f, states = model.functionalize()
    out, new = f(states, 1.0, states=2.0, cls=3.0)
    np.testing.assert_allclose(out, _plain_call(1.0, states=2.0, cls=3.0))
    out, new = f.step(new, 1.0, states=5.0, flat_states=7.0)
    np.testing.assert_allclose(out, 8.0)
    np.testing.assert_allclose(new["n"], 6.0)
    out, _ = jax.jit(lambda f, s, x: f(s, x, states=2.0))(f, states, 1.0)
    np.testing.assert_allclose(out, _plain_call(1.0, states=2.0))


def test_packed_f_takes_a_keyword_named_states() -> None:
    f, states = Named().functionalize()
    pf, packed = autostate.pack(f, states)
    out, _ = pf(packed, 1.0, states=2.0)
    np.testing.assert_allclose(out, _plain_call(1.0, states=2.0))
    out, _ = pf.step(packed, 1.0, states=1.0, flat_states=2.0)
    np.testing.assert_allclose(out, 3.0)


def test_init_subclass_keywords_named_like_autostate_parameters() -> None:
    seen = {}

    @autostate.stateful
    class Base:
        def __init_subclass__(cls, /, sub=None, cls_=None, **kwargs):
            super().__init_subclass__(**kwargs)
            seen[cls.__name__] = sub

        def __init__(self):
            self.w = jnp.ones(())

    class Child(Base, sub="given"):
        pass

    assert seen["Child"] == "given"
    assert Child().w == 1.0


def test_pending_subclass_hook_passes_a_keyword_named_sub_on() -> None:
    seen = {}

    class Registry:
        def __init_subclass__(cls, /, sub=None, **kwargs):
            super().__init_subclass__(**kwargs)
            seen[cls.__name__] = sub

    @autostate.stateful
    class Base(Registry):
        def __init__(self):
            self.w = jnp.ones(())

    class Child(Base, sub="given"):
        pass

    assert seen["Child"] == "given"
    assert Child().w == 1.0
