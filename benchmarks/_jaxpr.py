"""Scenario 4 (zero overhead): primitive counts of a traced step, side by side.

``jax.make_jaxpr`` of the jitted step gives the program XLA compiles; counting
its primitives, sub-jaxprs included (nested ``jit``, ``custom_jvp_call``, ...),
shows whether autostate's functionalized step traces to the same program as
the hand-written one.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.extend.core  # not imported by jax itself
from _timing import Table, Target


def primitive_counts(closed_jaxpr: Any) -> dict[str, int]:
    """Counts of every primitive in a jaxpr, sub-jaxprs included."""
    counts: dict[str, int] = {}

    def visit(jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            counts[eqn.primitive.name] = counts.get(eqn.primitive.name, 0) + 1
            for param in eqn.params.values():
                for sub in param if isinstance(param, (list, tuple)) else (param,):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        visit(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        visit(sub)

    visit(closed_jaxpr.jaxpr)
    return dict(sorted(counts.items()))


def zero_overhead_table(
    title: str, what: str, reference: Any, candidate: Any
) -> tuple[Table, Target]:
    """The autostate step's primitive counts next to the hand-written step's."""
    ref = primitive_counts(reference)
    got = primitive_counts(candidate)
    table = Table(title, ("primitive", "hand-written JAX", "autostate", "same"))
    for prim in sorted(set(ref) | set(got)):
        a, b = ref.get(prim, 0), got.get(prim, 0)
        table.add(prim, a, b, "yes" if a == b else "NO")
    total_ref, total_got = sum(ref.values()), sum(got.values())
    table.add("**total**", total_ref, total_got, "yes" if total_ref == total_got else "NO")
    same = ref == got
    target = Target(
        "4",
        f"{what}: jaxpr primitive counts equal hand-written",
        total_got / total_ref,
        same,
        f"{total_got} vs {total_ref} equations" + ("" if same else " (counts differ)"),
    )
    return table, target
