"""Names routed to ``autostate.control`` mean what plain Python says.

The decorator finds, at decoration, the dotted names a method calls or passes
on that resolve in its globals to a JAX control-flow function (``lax.scan``,
``cond``, ``jax.checkpoint``, ...). The rewritten line still evaluates the
name where the method runs (``__autostate__.control.routed(scan)(...)``),
and only the JAX function itself is swapped for the threaded one. Before,
the name was replaced outright, so each binding below that shadows the
global, and a global rebound after the decoration, was silently the JAX
function (wrong results, or a raw ``TypeError``).

Every routed name is shadowed in every way a function binds a name, and
compared with plain Python eagerly, through ``f``, under ``jit`` and after
``freeze``.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import jax
import jax.numpy as jnp
import pytest
from differential import check  # noqa: I001 - tests/ is on sys.path

import autostate

Loader = Callable[..., types.ModuleType]

XS = jnp.asarray([0.5, -1.0, 2.0])

HEADER = """
import functools
import jax
import jax.numpy as jnp
import autostate
from jax.lax import scan, cond, switch, while_loop, fori_loop, map
from jax import checkpoint, remat
"""

# Each binding kind: a method of ``Shadow`` whose local ``NAME`` is a Python
# value or function (never JAX's), used as plain Python would use it.
BINDINGS = {
    "parameter": """
    def run(self, x, NAME=2.0):
        self.n = self.n + 1.0
        return x * NAME + self.n
""",
    "assignment": """
    def run(self, x):
        NAME = x > 0
        self.n = self.n + 1.0
        return jnp.where(NAME, x, -x) * self.n
""",
    "local_function": """
    def run(self, x):
        def NAME(*args):
            return len(args)
        self.n = self.n + NAME(x, x)
        return x * self.n
""",
    "for_target": """
    def run(self, x):
        total = 0.0
        for NAME in (1.0, 2.0):
            total = total + NAME
        self.n = self.n + total
        return x * self.n
""",
    "with_target": """
    def run(self, x):
        import contextlib
        with contextlib.nullcontext(3.0) as NAME:
            self.n = self.n + NAME
        return x * self.n
""",
    "lambda_parameter": """
    def run(self, x):
        twice = lambda NAME: NAME * 2.0
        self.n = self.n + twice(1.5)
        return x * self.n
""",
    "passed_on": """
    def _scale(self, x, factor):
        return x * factor
    def run(self, x, NAME=0.5):
        self.n = self.n + 1.0
        return self._scale(x, NAME) + self.n
""",
    "import_inside": """
    def run(self, x):
        from operator import add as NAME
        self.n = NAME(self.n, 1.0)
        return x * self.n
""",
}

NAMES = ["scan", "cond", "switch", "while_loop", "fori_loop", "map", "checkpoint", "remat"]


def _source(binding: str, name: str) -> str:
    method = BINDINGS[binding].replace("NAME", name)
    return (
        HEADER
        + "\n\nclass Shadow:\n"
        + "    def __init__(self):\n"
        + "        self.n = jnp.zeros(())\n"
        + method
    )


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("binding", sorted(BINDINGS))
def test_a_local_binding_of_a_routed_name_is_itself(
    write_module: Loader, binding: str, name: str
) -> None:
    source = _source(binding, name)
    plain = write_module(source)
    dec = write_module(source.replace("class Shadow:", "@autostate.stateful\nclass Shadow:"))
    check(plain, dec, "Shadow()", [("run", (XS,)), ("run", (XS,))])


REBOUND = (
    HEADER
    + """
loop = jax.lax.fori_loop


class Looper:
    def __init__(self):
        self.n = jnp.zeros(())

    def run(self, x):
        def body(i, c):
            self.n = self.n + 1.0
            return c + self.n
        return loop(0, 3, body, x)
"""
)


def test_a_global_rebound_after_the_decoration_is_called(write_module: Loader) -> None:
    plain = write_module(REBOUND)
    dec = write_module(REBOUND.replace("class Looper:", "@autostate.stateful\nclass Looper:"))
    for module in (plain, dec):
        module.loop = lambda lo, hi, body, init: body(lo, init)  # one trip, in Python
    check(plain, dec, "Looper()", [("run", (XS,))])


def test_a_global_rebound_to_jax_again_is_routed_again(write_module: Loader) -> None:
    dec = write_module(REBOUND.replace("class Looper:", "@autostate.stateful\nclass Looper:"))
    dec.loop = lambda lo, hi, body, init: body(lo, init)
    dec.loop = jax.lax.fori_loop
    model = dec.Looper()
    out = model.run(XS)
    assert float(model.n) == 3.0
    assert jnp.allclose(out, XS + 6.0)
    f, states = dec.Looper().functionalize()
    out, states = jax.jit(lambda s, x: f.run(s, x))(states, XS)
    assert float(states["n"]) == 3.0


def test_the_routing_is_evaluated_where_the_method_runs() -> None:
    assert autostate.control.routed(jax.lax.scan) is autostate.control.scan
    assert autostate.control.routed(jax.checkpoint) is autostate.control.checkpoint
    assert autostate.control.routed(jax.remat) is autostate.control.checkpoint
    flag = jnp.ones(3) > 0  # unhashable: returned as it is
    assert autostate.control.routed(flag) is flag
    assert autostate.control.routed(False) is False
