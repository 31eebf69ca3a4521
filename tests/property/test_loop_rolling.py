"""Property test: a loop over a stack of layers means what the loop over the list means.

Hypothesis writes a ``Net`` whose method runs one ``for`` loop over its
layers, with a header drawn from ``for b in self.blocks``, ``enumerate``
(with a start), ``zip`` with a list of per-layer arrays and ``reversed``,
and a body of statements drawn from the idioms of real layer loops: the
residual stream carried (``x = b(x)``), a layer's parameter read and its
state assigned from the loop (``b.mean = ...``), a layer run twice in a
nested ``range`` loop, a state of the model threaded (``self.steps +=
1``), accumulators that start as Python numbers, a local assigned first
and read after the loop, the index in arithmetic, Python branching on
static config; and the constructs that keep the loop unrolled: Python
branching on the index, a Python int that changes at every step, a list
appended to, a ``break``. Code after the loop reads what the loop left,
the loop variable included.

The source is imported twice: plain Python with a list of layers (the
reference), and decorated with ``autostate.stack`` of the same layers. The
decorated model runs eagerly, as ``f`` and under one ``jax.jit`` (where the
loop rolls); outputs and every state must agree with plain Python, and the
compiled program must hold a loop exactly when the generator says the body
rolls. Size with ``AUTOSTATE_PROPERTY_EXAMPLES`` (default 5, a few seconds).
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib.util
import itertools
import os
import shutil
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from models.checks import assert_generated_close

import autostate

pytestmark = pytest.mark.property

EXAMPLES = int(os.environ.get("AUTOSTATE_PROPERTY_EXAMPLES", "5"))
DEPTH = 3
RTOL, ATOL = 1e-4, 1e-5

HEADER = """
import jax
import jax.numpy as jnp


def stateful(cls):
    return cls


def stack(layers):
    return layers


@stateful
class Block:
    def __init__(self, k):
        self.w = jnp.linspace(-1.0, 1.0, 3) * (k + 1) / 3
        self.mean = jnp.zeros(3)
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.calls = self.calls + 1
        self.mean = 0.9 * self.mean + 0.1 * x
        return jnp.tanh(x * self.w) + self.mean


@stateful
class Net:
    def __init__(self):
        self.blocks = stack([Block(k) for k in range({depth})])
        self.scales = [jnp.full(3, 1.0 + k / 4) for k in range({depth})]
        self.steps = jnp.zeros((), jnp.int32)
        self.wide = {wide}

    def __call__(self, x):
"""

# Body statements: (text, rolls). ``{i}`` needs the index, ``{s}`` the zipped scale.
STATEMENTS: list[tuple[str, bool]] = [
    ("x = b(x)", True),
    ("x = b(x * {s})", True),
    ("x = x + 0.1 * {i}", True),
    ("acc = acc + x.sum()", True),
    ("count = count + x.mean()", True),
    ("h = x * 2", True),
    ("tmp = b(x)\nx = x + 0.5 * tmp", True),
    ("b.mean = b.mean * 0.5", True),
    ("x = x + b.w", True),
    ("for _ in range(2):\n    x = b(x)", True),
    ("self.steps = self.steps + 1", True),
    ("if self.wide:\n    x = x * 1.5", True),
    ("if {i} == 1:\n    x = -x", False),
    ("n = n + 1", False),
    ("outs.append(x.sum())", False),
    ("if x.ndim > 1:\n    break", False),
]
HEADERS = {
    "plain": ("for b in self.blocks:", None, None),
    "enumerate": ("for i, b in enumerate(self.blocks, {start}):", "i", None),
    "zip": ("for b, s in zip(self.blocks, self.scales):", None, "s"),
    "enumerate-zip": ("for i, (b, s) in enumerate(zip(self.blocks, self.scales)):", "i", "s"),
    "reversed": ("for b in reversed(self.blocks):", None, None),
}


@dataclasses.dataclass
class Program:
    source: str
    rolls: bool


@st.composite
def programs(draw: Any) -> Program:
    kind = draw(st.sampled_from(sorted(HEADERS)))
    header, index, scale = HEADERS[kind]
    usable = [
        (text, rolls) for text, rolls in STATEMENTS
        if ("{i}" not in text or index) and ("{s}" not in text or scale)
    ]
    body = draw(st.lists(st.sampled_from(usable), min_size=1, max_size=5))
    body = [("x = b(x)", True), *body]  # (every layer runs)
    lines = ["acc, count, n, outs, h = 0.0, 0, 0, [], x"]
    lines.append(header.format(start=draw(st.integers(0, 2))))
    for text, _ in body:
        lines += ["    " + line for line in text.format(i=index, s=scale).splitlines()]
    lines.append("return x + acc + count + n + len(outs) + h.sum() + b.w")
    source = HEADER.format(depth=DEPTH, wide=draw(st.booleans())) + "".join(
        f"        {line}\n" for line in lines
    )
    return Program(source, all(rolls for _, rolls in body))


_directory: Path | None = None
_names = itertools.count()


def _load(source: str, decorated: bool) -> types.ModuleType:
    global _directory
    if _directory is None:
        _directory = Path(tempfile.mkdtemp(prefix="autostate-property-roll-"))
        atexit.register(shutil.rmtree, _directory, True)
    name = f"autostate_prop_roll_{os.getpid()}_{next(_names)}"
    path = _directory / f"{name}.py"
    if decorated:
        source = source.replace(
            "def stateful(cls):\n    return cls\n\n\ndef stack(layers):\n    return layers\n",
            "from autostate import stateful, stack\n",
        )
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _states(model: Any) -> dict[str, Any]:
    blocks = model.blocks
    if isinstance(blocks, autostate.Stack):
        per_layer = {a: np.asarray(getattr(blocks, a)) for a in ("mean", "calls")}
    else:
        per_layer = {a: np.stack([np.asarray(getattr(b, a)) for b in blocks]) for a in ("mean", "calls")}
    return {**per_layer, "steps": np.asarray(model.steps)}


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(programs())
def test_a_loop_over_a_stack_means_the_loop_over_the_list(program: Program) -> None:
    plain, decorated = _load(program.source, False), _load(program.source, True)
    source = program.source
    x = jnp.array([0.3, -0.7, 1.1])
    reference = plain.Net()
    expected = [reference(x), reference(-x)]

    def check(outs: list[Any], model: Any, what: str) -> None:
        assert_generated_close(outs, expected, f"{what} outputs", source, rtol=RTOL, atol=ATOL)
        assert_generated_close(
            _states(model), _states(reference), f"{what} states", source, rtol=RTOL, atol=ATOL
        )

    eager = decorated.Net()
    check([eager(x), eager(-x)], eager, "eager")
    for step in (lambda f: f, jax.jit):
        f, states = decorated.Net().functionalize()
        call = step(lambda s, v, f=f: f(s, v))
        outs = []
        for v in (x, -x):
            out, states = call(states, v)
            outs.append(out)
        check(outs, autostate.freeze(f, states), "jit" if step is jax.jit else "f")
    f, states = decorated.Net().functionalize()
    compiled = jax.jit(lambda s, v: f(s, v)).lower(states, x).as_text()
    assert ("while" in compiled) == program.rolls, f"rolled: expected {program.rolls}\n{source}"
