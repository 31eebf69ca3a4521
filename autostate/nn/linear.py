"""``Linear``: an affine map, with PyTorch's layout and initialisation."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from autostate.nn._init import fan_in_bound, uniform
from autostate.nn._precision import precision, promote
from autostate.nn.module import Module
from autostate.nn.random import KeyLike, split_key

__all__ = ["Linear"]


class Linear(Module):
    """``y = x @ weight.T + bias``, as ``torch.nn.Linear``.

    ``weight`` is ``[out_features, in_features]`` and both it and ``bias``
    are drawn from ``U(-1/sqrt(in_features), 1/sqrt(in_features))``.

    Args:
        in_features: size of the last axis of the input.
        out_features: size of the last axis of the output.
        bias: whether to add a learned bias.
        key: where the initial weights come from (see ``autostate.nn.random``).
        dtype: the compute dtype, and the parameters' dtype when ``param_dtype``
            is ``None`` (PyTorch's meaning).
        param_dtype: the parameters' storage dtype (Flax's meaning); given, each
            call casts the parameters and the input to ``dtype`` (mixed precision).

    Differences from PyTorch:
        The arguments of ``torch.nn.Linear``, plus keyword-only ``key=`` (where the
        initial weights come from: an int, a JAX key or a ``KeyStream``; omitted, the
        default stream ``manual_seed`` seeds), ``dtype=`` and ``param_dtype=`` (mixed
        precision, which torch has not); no ``device=`` (JAX places arrays).

        ``bias=False`` leaves ``self.bias`` as ``None``, as torch does.

    Examples:
        >>> import jax.numpy as jnp
        >>> import autostate.nn as nn
        >>> layer = nn.Linear(3, 2, key=0)
        >>> layer.weight.shape, layer(jnp.ones((4, 3))).shape
        ((2, 3), (4, 2))
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        key: KeyLike = None,
        dtype: Any = jnp.float32,
        param_dtype: Any = None,
    ):
        weight_key, bias_key = jax.random.split(split_key(key))
        bound = fan_in_bound(in_features)
        dtype = precision(self, dtype, param_dtype)
        self.in_features = in_features
        self.out_features = out_features
        self.weight = uniform(weight_key, (out_features, in_features), bound, dtype)
        self.bias = uniform(bias_key, (out_features,), bound, dtype) if bias else None

    def forward(self, x: jax.Array) -> jax.Array:
        x, weight, bias = promote(self, x, self.weight, self.bias)
        y = x @ weight.T
        if bias is not None:
            y = y + bias
        return y
