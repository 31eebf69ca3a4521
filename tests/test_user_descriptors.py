"""A state whose name a user's data descriptor holds (a clamp, a validator, a
unit conversion: a class with ``__set__``) is refused at decoration with a
clear error: autostate's own descriptor would take its place and its code
would silently never run. The fix the error gives (a property over a plain
attribute) works like plain Python eagerly, through ``f``, under ``jit`` and
after ``freeze``; descriptors without ``__set__`` and properties are left
as they were."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from differential import check, pair  # noqa: I001 - tests/ is on sys.path

from autostate import errors

CLAMPED = """
class Clamped:
    def __set_name__(self, owner, name):
        self.key = "_" + name
    def __get__(self, obj, cls=None):
        return self if obj is None else obj.__dict__[self.key]
    def __set__(self, obj, value):
        obj.__dict__[self.key] = jnp.clip(value, 0.0, 1.0)

"""

REFUSED = {
    "on_the_class": """
@DECORATE
class M:
    scale = Clamped()
    def __init__(self):
        self.scale = jnp.asarray(0.5)
    def __call__(self, x):
        self.scale = self.scale + x
        return self.scale * 2
""",
    "on_an_undecorated_base": """
class Base:
    scale = Clamped()

@DECORATE
class M(Base):
    def __init__(self):
        self.scale = jnp.asarray(0.5)
    def __call__(self, x):
        self.scale = self.scale + x
        return self.scale
""",
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_state_held_by_a_user_data_descriptor_is_refused_at_the_class(write_module, case):
    with pytest.raises(errors.DecorationError) as info:
        pair(write_module, CLAMPED + REFUSED[case])
    message = str(info.value)
    assert "data descriptor" in message and "would never run" in message
    assert ".py:" in message  # the class statement's file:line
    assert "fix: keep the value in a plain attribute and make" in message


FIXED = """
@DECORATE
class M:
    def __init__(self):
        self.scale = jnp.asarray(0.5)
        self.calls = jnp.zeros((), jnp.int32)
    @property
    def scale(self):
        return self._scale
    @scale.setter
    def scale(self, value):
        self._scale = jnp.clip(value, 0.0, 1.0)
    def __call__(self, x):
        self.scale = self.scale + x
        self.calls = self.calls + 1
        return self.scale * 2
"""


def test_the_fix_it_gives_means_what_the_descriptor_meant(write_module):
    plain, dec = pair(write_module, FIXED)
    calls = [("__call__", (jnp.asarray(0.3),)), ("__call__", (jnp.asarray(0.4),)),
             ("__call__", (jnp.asarray(-2.0),))]
    check(plain, dec, "M()", calls)


KEPT = """
class Doc:
    def __get__(self, obj, cls=None):
        return "a non-data descriptor"

@DECORATE
class M:
    doc = Doc()
    def __init__(self):
        self.w = jnp.ones(2)
        self.n = jnp.zeros(())
    @staticmethod
    def twice_of(v):
        return 2 * v
    def __call__(self, x):
        self.n = self.n + self.twice_of(1.0)
        return x * self.w + len(self.doc)
"""


def test_descriptors_without_set_are_left_alone(write_module):
    plain, dec = pair(write_module, KEPT)
    check(plain, dec, "M()", [("__call__", (jnp.arange(2.0),)), ("__call__", (jnp.ones(2),))])


# --- functools.cached_property: plain Python's cache, or a clear error --------------

CACHED = """
@DECORATE
class Cached:
    def __init__(self):
        self.w = jnp.array([1.0, 2.0])   # a parameter
        self.s = jnp.array(1.0)          # a state

    @functools.cached_property
    def norm(self):                      # over a parameter: the same value every time
        return jnp.sum(self.w ** 2)

    @functools.cached_property
    def snap(self):                      # over a state: the first value, kept
        return self.s * 3

    def __call__(self):
        self.s = self.s + 2
        return self.norm * self.s

    def read_snap(self):
        out = self.snap  # the cached read
        self.s = self.s + 2
        return out
"""

SNAPS = [("read_snap", ()), ("read_snap", ()), ("__call__", ())]


def test_a_cached_property_means_plain_python_eagerly_and_through_f(write_module):
    plain, dec = pair(write_module, CACHED)
    check(plain, dec, "Cached()", SNAPS, modes=("eager", "f"))


def test_a_cached_property_over_parameters_means_plain_python_under_jit(write_module):
    plain, dec = pair(write_module, CACHED)
    check(plain, dec, "Cached()", [("__call__", ()), ("__call__", ())], modes=("jit",))


def test_a_cached_property_first_computed_from_a_state_under_jit_is_refused(write_module):
    _, dec = pair(write_module, CACHED)
    f, states = dec.Cached().functionalize()
    step = jax.jit(lambda f, s: f.read_snap(s))
    with pytest.raises(errors.StateAccessError, match=r"cached_property Cached.snap") as info:
        step(f, states)
    message = str(info.value)
    assert "state 's'" in message and "model.snap" in message
    assert f"{dec.__file__}:" in message  # the line that read it
    assert "snap" not in vars(f.model)  # nothing of the trace kept
    # The fix it gives: computed once before functionalizing, f keeps the value.
    plain, _ = pair(write_module, CACHED)
    check(plain, dec, "(lambda m: (m.snap, m)[1])(Cached())", SNAPS, modes=("jit",))
