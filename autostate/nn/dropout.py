"""``Dropout``: random zeroing in training, with its own key as state."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from autostate.errors import InvalidArgumentError, format_error
from autostate.nn.module import Module
from autostate.nn.random import KeyLike, split_key

__all__ = ["Dropout"]


class Dropout(Module):
    """Zeroes each element with probability ``p`` and scales the rest by
    ``1 / (1 - p)`` in training; the identity in evaluation, as ``torch.nn.Dropout``.

    The layer holds its own key, ``key``, a state: each training call splits
    it once, keeps one half and draws the mask from the other, eagerly, in
    ``f(states, ...)`` (the new key is in the new states), and inside
    ``lax.scan`` or ``jax.checkpoint`` bodies alike. Layers built without a key
    draw theirs from the default stream, so no two share a mask.

    Args:
        p: the probability of zeroing an element.
        inplace: accepted for PyTorch's signature; changes nothing (JAX
            arrays are values).
        key: where the layer's key comes from (see ``autostate.nn.random``).

    Differences from PyTorch:
        ``torch.nn.Dropout`` draws from a global generator; here the layer holds its own
        key as a state (keyword-only ``key=``), split once per training call, so
        ``f(states, ...)`` returns the next key and a compiled step draws new masks each
        call. The output is always a new array (torch's ``inplace=True`` overwrites the
        input).

    Examples:
        >>> import jax.numpy as jnp
        >>> import autostate.nn as nn
        >>> drop = nn.Dropout(0.5, key=0)
        >>> y = drop(jnp.ones(6))
        >>> sorted(set(y.tolist())) == [0.0, 2.0]
        True
        >>> print(drop.eval()(jnp.ones(3)))
        [1. 1. 1.]
    """

    def __init__(self, p: float = 0.5, inplace: bool = False, *, key: KeyLike = None):
        if not 0 <= p <= 1:
            raise InvalidArgumentError(
                format_error(
                    f"Dropout(p={p}): p is a probability, between 0 and 1.",
                    fix="pass p in [0, 1].",
                )
            )
        self.p = p
        self.inplace = inplace
        self.training = True
        self.key = split_key(key)

    def forward(self, x: jax.Array) -> jax.Array:
        if not self.training:
            return x
        self.key, mask_key = jax.random.split(self.key)
        keep = jax.random.bernoulli(mask_key, 1 - self.p, x.shape)
        scale = 0.0 if self.p == 1 else 1 / (1 - self.p)
        return jnp.where(keep, x * scale, jnp.zeros((), x.dtype))
