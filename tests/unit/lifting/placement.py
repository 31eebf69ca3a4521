"""What the family tests read: the one equation of a primitive in a traced call."""

from __future__ import annotations

from typing import Any

import jax


def equation(fun: Any, *args: Any, primitive: str) -> Any:
    """The only top-level equation of ``primitive`` (a name, or names joined by
    ``|`` where JAX versions differ) in ``fun(*args)``'s jaxpr."""
    names = primitive.split("|")
    found = [e for e in jax.make_jaxpr(fun)(*args).jaxpr.eqns if e.primitive.name in names]
    assert len(found) == 1, [e.primitive.name for e in jax.make_jaxpr(fun)(*args).jaxpr.eqns]
    return found[0]
