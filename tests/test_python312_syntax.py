"""Syntax new in Python 3.12 and 3.13, plain against decorated.

- PEP 695 type parameters: a generic class (``class Box[T]:``), a generic
  method (``def go[U](self, x: U)``, whose code Python compiles inside a
  scope of its own), a generic static method and class method, a bound
  (``[T: float]``), a ``type`` alias statement in the module.
- PEP 701 f-strings: the quotes of the f-string reused inside a replacement
  field that reads a state (``f"{self.d["k"]}"``), nested f-strings, a
  field that spans lines.

The sources are text (``differential.pair``), so this file imports on 3.11,
where the cases are skipped: ``make test-all`` runs them on 3.12 and 3.13.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable

import jax
import jax.numpy as jnp
import pytest
from differential import check, pair  # noqa: I001 - tests/ is on sys.path

import autostate

pytestmark = pytest.mark.skipif(
    sys.version_info < (3, 12), reason="PEP 695 and PEP 701 syntax needs Python 3.12"
)

Loader = Callable[..., types.ModuleType]

X = jnp.float32(1.5)

GENERICS = """
type Scale = float


@DECORATE
class Box[T]:
    def __init__(self, scale: T):
        self.scale = scale
        self.n = jnp.zeros(())

    def __call__(self, x: T) -> T:
        self.n = self.n + x * self.scale
        return self.n

    def go[U](self, x: U, times: int = 2) -> U:
        assert U.__name__ == "U" and T.__name__ == "T"
        for _ in range(times):
            self.n += x
        return x * self.n

    @staticmethod
    def twice[V](v: V) -> V:
        return v * 2

    @classmethod
    def build[S: float](cls, scale: S) -> Box[S]:
        return cls(scale)

    def bounded[N: (int, float)](self, k: N) -> N:
        self.n = self.n * k
        return self.n


@DECORATE
class Holder:
    def __init__(self):
        self.box = Box.build(0.5)
        self.steps = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.steps += 1
        return self.box.go(x) + Box.twice(self.box(x))
"""


FSTRINGS = '''
@DECORATE
class Talk:
    def __init__(self):
        self.d = {"k": jnp.zeros(())}
        self.n = jnp.ones(())

    def __call__(self, x):
        self.d["k"] = self.d["k"] + x
        self.n = self.n * 2
        return x + self.n

    def say(self, x):
        self.n = self.n + x
        return f"{self.d["k"]:.1f}|{f"{self.n:.1f}"}|{
            self.n
            + 1:.1f}|{self.n=:.1f}"
'''


@pytest.mark.parametrize(
    ("build", "calls"),
    [
        ("Box(2.0)", [("__call__", (X,)), ("go", (X,)), ("go", (X,)), ("bounded", (2.0,))]),
        ("Box.build(0.5)", [("go", (X,)), ("__call__", (X,))]),
        ("Holder()", [("__call__", (X,)), ("__call__", (X,))]),
    ],
    ids=["generic_class_and_method", "generic_classmethod", "nested"],
)
def test_type_parameters(write_module: Loader, build: str, calls: list) -> None:
    plain, dec = pair(write_module, GENERICS)
    check(plain, dec, build, calls)


def test_type_parameters_stay_on_the_rewritten_methods(write_module: Loader) -> None:
    plain, dec = pair(write_module, GENERICS)
    dec.Box(1.0)  # completes the class
    for name in ("go", "bounded"):
        got = [p.__name__ for p in getattr(dec.Box, name).__type_params__]
        assert got == [p.__name__ for p in getattr(plain.Box, name).__type_params__]
    assert [p.__name__ for p in dec.Box.__type_params__] == ["T"]
    assert dec.Box.twice(3) == plain.Box.twice(3) == 6
    assert autostate.tree.class_info(dec.Box).state == {"n"}


def test_generic_method_under_jit_and_grad(write_module: Loader) -> None:
    plain, dec = pair(write_module, GENERICS)
    ref, model = plain.Box(2.0), dec.Box(2.0)
    f, states = model.functionalize()

    def loss(s, x):
        out, _ = f.go(s, x)
        return out

    got = jax.jit(jax.grad(loss, argnums=1))(states, X)
    ref_grad = jax.grad(lambda x: plain.Box(2.0).go(x))(X)
    assert jnp.allclose(got, ref_grad)
    assert jnp.allclose(jax.jit(lambda s, x: f.go(s, x)[0])(states, X), ref.go(X))


@pytest.mark.parametrize("method", ["__call__", "say"])
def test_pep701_fstrings_reading_state(write_module: Loader, method: str) -> None:
    plain, dec = pair(write_module, FSTRINGS)
    if method == "say":
        ref, model = plain.Talk(), dec.Talk()
        for x in (1.0, 2.5):
            assert model.say(x) == ref.say(x)
        f, states = dec.Talk().functionalize()
        out, states = f.say(states, 1.0)
        assert out == plain.Talk().say(1.0)
        return
    check(plain, dec, "Talk()", [(method, (X,)), (method, (X,))])
