"""PyTorch's default initialisers, as the layers here use them."""

from __future__ import annotations

import math
from typing import Any

import jax


def fan_in_bound(fan_in: int) -> float:
    """``1/sqrt(fan_in)``: the bound of PyTorch's default uniform initialisation.

    ``kaiming_uniform_(a=sqrt(5))`` of a weight whose fan-in is ``fan_in``
    draws from ``U(-b, b)`` with ``b = sqrt(6 / ((1 + 5) * fan_in))``, which is
    this bound; the bias is drawn from the same interval.
    """
    return 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0


def uniform(key: jax.Array, shape: tuple[int, ...], bound: float, dtype: Any) -> jax.Array:
    """Draws from ``U(-bound, bound)``."""
    return jax.random.uniform(key, shape, dtype, -bound, bound)
