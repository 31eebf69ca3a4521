"""Pure-JAX reproduction of the eager ``lax.cond``/``lax.switch`` autostate emits
for a branch over aliased or copied sub-models (issue 54).

autostate threads the states a branch writes through the branch as extra
operands and outputs. For ``lax.cond(v > 0, sub2.bump, self.sub.bump, v)``,
with ``bump`` doing ``self.s = self.s + x * self.k; return self.s``, the
branches it binds are (operands: the user's ``v``, both copies' ``k``, both
copies' ``s``; outputs: the branch's return value, then both ``s``)::

    false: (a, b, c, d, e) -> h = d + c * b; (h, h, e)
    true:  (a, b, c, d, e) -> h = e + c * a; (h, d, h)

with ``a``, ``b``, ``c`` weakly typed float32 scalars and ``d``, ``e`` float32
scalars, bound eagerly (JAX compiles the one ``cond`` primitive by itself).

Each variant runs in its own try block and prints ``ok`` or the error's first
line, so one run on a machine tells which feature of the program its compiler
rejects. Run: ``python benchmarks/tpu_cond_repro.py`` (exit status 1 where a
variant fails).

On one TPU v5e (JAX and jaxlib 0.10.2, 2026-12-06) the program as emitted
failed eagerly, and as a ``switch`` on a traced index, with ``INTERNAL:
RET_CHECK failure (xla/service/layout_assignment.cc:2753)
ShapeUtil::Compatible(entry_computation_layout_->result_shape(),
entry->root_instruction()->shape())``, with weakly and with strongly typed
operands alike; inside ``jax.jit`` it compiled. Every ``minimal`` variant
(one value returned twice at the same positions in both branches, an operand
passed through) compiled, and so did the program with the return value read
outside the ``cond`` or passed through ``lax.optimization_barrier``. On CPU
every variant compiles. So the TPU compiler rejects a valid program: an
eagerly compiled conditional whose branches return one value at two result
positions that differ from branch to branch. autostate passes each branch's
results through an optimization barrier in every ``cond``/``switch`` that
threads state (``autostate/lifting/branches.py``, ``_branches``; the variant ``all
results behind an optimization barrier``); with it the three failing tests of
the suite passed on that TPU.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def weak(x: float) -> jax.Array:
    return jnp.asarray(x)  # a Python float: weakly typed


def strong(x: float) -> jax.Array:
    return jnp.asarray(x, jnp.float32)


def false_branch(a: Any, b: Any, c: Any, d: Any, e: Any) -> tuple[Any, Any, Any]:
    h = d + lax.convert_element_type(c * b, jnp.float32)
    return h, h, e


def true_branch(a: Any, b: Any, c: Any, d: Any, e: Any) -> tuple[Any, Any, Any]:
    h = e + lax.convert_element_type(c * a, jnp.float32)
    return h, d, h


def distinct_false(a: Any, b: Any, c: Any, d: Any, e: Any) -> tuple[Any, Any]:
    h = d + lax.convert_element_type(c * b, jnp.float32)
    return h, e


def distinct_true(a: Any, b: Any, c: Any, d: Any, e: Any) -> tuple[Any, Any]:
    h = e + lax.convert_element_type(c * a, jnp.float32)
    return d, h


def operands(make: Callable[[float], jax.Array]) -> tuple[jax.Array, ...]:
    return make(1.0), make(2.0), make(1.0), strong(0.0), strong(0.0)


EXPECTED = {True: (1.0, 0.0, 1.0), False: (2.0, 2.0, 0.0)}


def variants() -> dict[str, Callable[[bool], Any]]:
    def as_emitted(pred: Any, ops: tuple[jax.Array, ...] | None = None) -> Any:
        return lax.cond(jnp.asarray(pred), true_branch, false_branch, *(ops or operands(weak)))

    def deduplicated(pred: bool) -> Any:
        # the return value read back from the states outside the cond
        d, e = lax.cond(jnp.asarray(pred), distinct_true, distinct_false, *operands(weak))
        return (e if pred else d), d, e

    def output_copied(pred: bool) -> Any:
        def copy_first(branch: Callable[..., Any]) -> Callable[..., Any]:
            def run(*ops: Any) -> Any:
                out, *states = branch(*ops)
                return (lax.optimization_barrier(out), *states)
            return run
        return lax.cond(jnp.asarray(pred), copy_first(true_branch), copy_first(false_branch),
                        *operands(weak))

    def minimal(outputs: Callable[[Any, Any], tuple[Any, ...]], make: Callable[[float], jax.Array]
                ) -> Callable[[bool], Any]:
        # one operand written, one passed through: expected from plain Python
        def run(pred: bool) -> Any:
            x, y = make(1.0), strong(5.0)
            got = lax.cond(jnp.asarray(pred), lambda x, y: outputs(x + 1.0, y),
                           lambda x, y: outputs(x - 1.0, y), x, y)
            want = outputs(2.0 if pred else 0.0, 5.0)
            np.testing.assert_allclose([float(g) for g in got], want)
            return got
        return run

    def all_behind_barrier(pred: bool) -> Any:
        def barrier(branch: Callable[..., Any]) -> Callable[..., Any]:
            return lambda *ops: lax.optimization_barrier(branch(*ops))
        return lax.cond(jnp.asarray(pred), barrier(true_branch), barrier(false_branch),
                        *operands(weak))

    return {
        "minimal: a value returned twice, strong": minimal(lambda h, y: (h, h), strong),
        "minimal: a value returned twice, weak": minimal(lambda h, y: (h, h), weak),
        "minimal: a value returned twice and an operand passed through, weak":
            minimal(lambda h, y: (h, h, y), weak),
        "minimal: an operand passed through, weak": minimal(lambda h, y: (h, y), weak),
        "as emitted, eager": as_emitted,
        "as emitted, jit": jax.jit(as_emitted, static_argnums=()),
        "as emitted, switch on a traced index": lambda p: lax.switch(
            jnp.asarray(int(p)), [false_branch, true_branch], *operands(weak)),
        "strong operands, eager": lambda p: as_emitted(p, operands(strong)),
        "return value read outside the cond, eager": deduplicated,
        "return value behind an optimization barrier, eager": output_copied,
        "all results behind an optimization barrier, eager (autostate's)": all_behind_barrier,
    }


def main() -> None:
    print("jax", jax.__version__, "backend", jax.default_backend(), jax.devices())
    failed = []
    for name, run in variants().items():
        for pred in (True, False):
            try:
                got = tuple(float(x) for x in run(pred))
                if not name.startswith("minimal"):
                    np.testing.assert_allclose(got, EXPECTED[pred])
                print(f"ok      {name} (pred={pred})")
            except Exception as e:  # noqa: BLE001 - each variant reports its own failure
                failed.append(name)
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                print(f"FAILED  {name} (pred={pred}): {type(e).__name__}: {first[:300]}")
                if len(failed) == 1:
                    traceback.print_exc(limit=3)
    print("lowered text of the emitted program:")
    print(jax.jit(lambda p, *ops: lax.cond(p, true_branch, false_branch, *ops)).lower(
        True, *operands(weak)).as_text())
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
