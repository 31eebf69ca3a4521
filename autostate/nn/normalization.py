"""Normalisation layers: ``BatchNorm1d``, ``BatchNorm2d``, ``BatchNorm3d``, ``LayerNorm``,
``GroupNorm``, ``RMSNorm``, as in ``torch.nn``.

BatchNorm follows PyTorch exactly: in training it normalises with the batch's
biased variance and updates ``running_mean`` / ``running_var`` (the latter
with the unbiased variance) by ``momentum``, or by the cumulative average
``1 / num_batches_tracked`` when ``momentum=None``; in evaluation (after
``model.eval()``) it normalises with the running statistics. With
``track_running_stats=False`` there are no running statistics and the batch's
are used in both modes. The running statistics and ``num_batches_tracked``
are states (``forward`` assigns them); ``weight`` and ``bias`` are
parameters.

Statistics (means, variances, mean squares) are computed in float32 at
least, also for bfloat16 or float16 inputs, and the output is cast back to
the dtype ``jnp`` promotion of the input and the parameters gives (``dtype``
with ``param_dtype``, see ``autostate.nn``'s mixed precision).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from autostate.errors import InvalidArgumentError, format_error
from autostate.nn._precision import precision, promote, statistics_dtype
from autostate.nn.module import Module

__all__ = ["BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "GroupNorm", "LayerNorm", "RMSNorm"]


class _BatchNorm(Module):
    """Batch normalisation over axis 1 (channels) of ``[N, C, *spatial]``."""

    input_ranks: tuple[int, ...] = ()
    weight: jax.Array | None
    bias: jax.Array | None
    # Arrays, or None without running statistics (``track_running_stats=False``).
    running_mean: Any
    running_var: Any
    num_batches_tracked: Any

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        *,
        bias: bool = True,
        dtype: Any = jnp.float32,
        param_dtype: Any = None,
    ):
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum
        self.affine = affine
        self.track_running_stats = track_running_stats
        self.training = True
        dtype = precision(self, dtype, param_dtype)
        self.weight = jnp.ones(num_features, dtype) if affine else None
        self.bias = jnp.zeros(num_features, dtype) if affine and bias else None
        if track_running_stats:
            self.running_mean = jnp.zeros(num_features, dtype)
            self.running_var = jnp.ones(num_features, dtype)
            self.num_batches_tracked = jnp.zeros((), jnp.int32)
        else:
            self.running_mean = self.running_var = self.num_batches_tracked = None

    def forward(self, x: jax.Array) -> jax.Array:
        if x.ndim not in self.input_ranks:
            raise InvalidArgumentError(
                format_error(
                    f"{type(self).__name__} expects a {' or '.join(map(str, self.input_ranks))}"
                    f"-dimensional input [N, C, ...], got shape {tuple(x.shape)}.",
                    fix="pass channels on axis 1 (use BatchNorm1d for [N, C] and [N, C, L], "
                    "BatchNorm2d for [N, C, H, W]).",
                )
            )
        axes = (0, *range(2, x.ndim))
        per_channel = (1, -1) + (1,) * (x.ndim - 2)
        x, weight, bias = promote(self, x, self.weight, self.bias)
        out = _result_type(x, weight, bias)
        x = x.astype(statistics_dtype(x))
        if x.shape[1] != self.num_features:
            raise InvalidArgumentError(
                format_error(
                    f"{type(self).__name__}({self.num_features}) got {x.shape[1]} channels on "
                    f"axis 1 (input shape {tuple(x.shape)}).",
                    fix=f"pass an input of {self.num_features} channels on axis 1 [N, C, ...].",
                )
            )
        if self.training or self.running_mean is None:
            # Batch statistics (also in evaluation without running statistics).
            count = x.size // x.shape[1]
            if count < 2:
                raise InvalidArgumentError(
                    format_error(
                        "BatchNorm with batch statistics needs more than 1 value per channel, "
                        f"got input shape {tuple(x.shape)}, as in PyTorch.",
                        fix="use a batch of 2 or more, or call model.eval() on a layer that "
                        "tracks running statistics.",
                    )
                )
            mean = x.mean(axes)
            var = x.var(axes)
            if self.training and self.running_mean is not None:
                self.num_batches_tracked += 1
                if self.momentum is None:  # a cumulative average
                    factor = 1.0 / self.num_batches_tracked
                else:
                    factor = jnp.asarray(self.momentum, x.dtype)
                unbiased = var * (count / (count - 1))
                # The running statistics keep their (storage) dtype.
                running_mean, running_var = self.running_mean, self.running_var
                new_mean = (1 - factor) * running_mean + factor * mean
                new_var = (1 - factor) * running_var + factor * unbiased
                self.running_mean = new_mean.astype(running_mean.dtype)
                self.running_var = new_var.astype(running_var.dtype)
        else:
            mean, var = self.running_mean.astype(x.dtype), self.running_var.astype(x.dtype)
        y = (x - mean.reshape(per_channel)) * jax.lax.rsqrt(var.reshape(per_channel) + self.eps)
        if weight is not None:
            y = y * weight.reshape(per_channel)
        if bias is not None:
            y = y + bias.reshape(per_channel)
        return y.astype(out)


class BatchNorm1d(_BatchNorm):
    """Batch normalisation of ``[N, C]`` or ``[N, C, L]`` inputs, as ``torch.nn.BatchNorm1d``.

    Args:
        num_features: ``C``.
        eps: added to the variance.
        momentum: the running statistics' update factor; ``None`` for a
            cumulative average.
        affine: whether to learn ``weight`` and ``bias``.
        track_running_stats: whether to keep running statistics (``False``:
            batch statistics in evaluation too).
        bias: whether to learn ``bias`` (with ``affine``), keyword-only as in PyTorch.
        dtype: the compute dtype, and the dtype of the parameters and running
            statistics when ``param_dtype`` is ``None`` (PyTorch's meaning).
        param_dtype: the storage dtype of the parameters and running statistics
            (Flax's meaning); given, each call casts the parameters and the input
            to ``dtype`` (mixed precision).

    Differences from PyTorch:
        The arguments of ``torch.nn.BatchNorm1d``, plus keyword-only ``dtype=`` and
        ``param_dtype=`` (mixed precision, which torch has not); no ``device=`` (JAX places
        arrays).

        The running statistics and ``num_batches_tracked`` are states: a compiled step
        (``autostate.jit``) or ``f(states, ...)`` returns their new values, and
        ``autostate.grad`` never differentiates them. ``num_batches_tracked`` is int32
        (torch's int64 loads into it when it fits).

    Examples:
        >>> import jax.numpy as jnp
        >>> import autostate.nn as nn
        >>> bn = nn.BatchNorm1d(2)
        >>> y = bn(jnp.array([[0.0, 1.0], [2.0, 3.0]]))
        >>> print(bn.running_mean, bn.running_var, int(bn.num_batches_tracked))
        [0.1 0.2] [1.1 1.1] 1
    """

    input_ranks = (2, 3)


class BatchNorm2d(_BatchNorm):
    """Batch normalisation of ``[N, C, H, W]`` inputs, as ``torch.nn.BatchNorm2d``.

    Args:
        num_features: ``C``.
        eps: added to the variance.
        momentum: the running statistics' update factor; ``None`` for a
            cumulative average.
        affine: whether to learn ``weight`` and ``bias``.
        track_running_stats: whether to keep running statistics (``False``:
            batch statistics in evaluation too).
        bias: whether to learn ``bias`` (with ``affine``), keyword-only as in PyTorch.
        dtype: the compute dtype, and the dtype of the parameters and running
            statistics when ``param_dtype`` is ``None`` (PyTorch's meaning).
        param_dtype: the storage dtype of the parameters and running statistics
            (Flax's meaning); given, each call casts the parameters and the input
            to ``dtype`` (mixed precision).

    Differences from PyTorch:
        As ``BatchNorm1d``: the arguments of ``torch.nn.BatchNorm2d``, plus keyword-only
        ``dtype=`` and ``param_dtype=`` (mixed precision, which torch has not); no
        ``device=`` (JAX places arrays).

        Running statistics and ``num_batches_tracked`` (int32) are states.

    Examples:
        >>> import jax.numpy as jnp
        >>> import autostate.nn as nn
        >>> bn = nn.BatchNorm2d(3).eval()
        >>> bn(jnp.ones((2, 3, 4, 4))).shape
        (2, 3, 4, 4)
    """

    input_ranks = (4,)


class BatchNorm3d(_BatchNorm):
    """Batch normalisation of ``[N, C, D, H, W]`` inputs, as ``torch.nn.BatchNorm3d``.

    Args:
        num_features: ``C``.
        eps: added to the variance.
        momentum: the running statistics' update factor; ``None`` for a
            cumulative average.
        affine: whether to learn ``weight`` and ``bias``.
        track_running_stats: whether to keep running statistics (``False``:
            batch statistics in evaluation too).
        bias: whether to learn ``bias`` (with ``affine``), keyword-only as in PyTorch.
        dtype: the compute dtype, and the dtype of the parameters and running
            statistics when ``param_dtype`` is ``None`` (PyTorch's meaning).
        param_dtype: the storage dtype of the parameters and running statistics
            (Flax's meaning); given, each call casts the parameters and the input
            to ``dtype`` (mixed precision).

    Differences from PyTorch:
        As ``BatchNorm1d``: the arguments of ``torch.nn.BatchNorm3d``, plus keyword-only
        ``dtype=`` and ``param_dtype=`` (mixed precision, which torch has not); no
        ``device=`` (JAX places arrays).

        Running statistics and ``num_batches_tracked`` (int32) are states.

    Examples:
        >>> import jax.numpy as jnp
        >>> import autostate.nn as nn
        >>> nn.BatchNorm3d(3)(jnp.ones((2, 3, 2, 4, 4))).shape
        (2, 3, 2, 4, 4)
    """

    input_ranks = (5,)


def _result_type(*arrays: jax.Array | None) -> Any:
    """The dtype of a normalisation's output: ``jnp`` promotion of its input and parameters."""
    return jnp.result_type(*(a for a in arrays if a is not None))


def _shape(normalized_shape: int | Sequence[int]) -> tuple[int, ...]:
    if isinstance(normalized_shape, int):
        return (normalized_shape,)
    return tuple(normalized_shape)


class LayerNorm(Module):
    """Normalises over the last ``len(normalized_shape)`` axes, as ``torch.nn.LayerNorm``.

    Args:
        normalized_shape: the trailing shape normalised over.
        eps: added to the variance.
        elementwise_affine: whether to learn ``weight`` (and ``bias``).
        bias: whether to learn ``bias`` (with ``elementwise_affine``).
        dtype: the compute dtype, and the parameters' dtype when ``param_dtype``
            is ``None`` (PyTorch's meaning).
        param_dtype: the parameters' storage dtype (Flax's meaning); given, each
            call casts the parameters and the input to ``dtype`` (mixed precision).

    Differences from PyTorch:
        The arguments of ``torch.nn.LayerNorm``, plus keyword-only ``dtype=`` and
        ``param_dtype=`` (mixed precision, which torch has not); no ``device=`` (JAX places
        arrays).

    Examples:
        >>> import jax.numpy as jnp
        >>> import autostate.nn as nn
        >>> [round(v, 4) for v in nn.LayerNorm(2)(jnp.array([1.0, 3.0])).tolist()]
        [-1.0, 1.0]
    """

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        *,
        dtype: Any = jnp.float32,
        param_dtype: Any = None,
    ):
        self.normalized_shape = _shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        affine = elementwise_affine
        dtype = precision(self, dtype, param_dtype)
        self.weight = jnp.ones(self.normalized_shape, dtype) if affine else None
        self.bias = jnp.zeros(self.normalized_shape, dtype) if affine and bias else None

    def forward(self, x: jax.Array) -> jax.Array:
        axes = tuple(range(x.ndim - len(self.normalized_shape), x.ndim))
        x, weight, bias = promote(self, x, self.weight, self.bias)
        out = _result_type(x, weight, bias)
        x = x.astype(statistics_dtype(x))
        mean = x.mean(axes, keepdims=True)
        var = x.var(axes, keepdims=True)
        y = (x - mean) * jax.lax.rsqrt(var + self.eps)
        if weight is not None:
            y = y * weight
        if bias is not None:
            y = y + bias
        return y.astype(out)


class GroupNorm(Module):
    """Normalises each of ``num_groups`` channel groups of ``[N, C, *]``
    inputs over the group's channels and positions, as ``torch.nn.GroupNorm``.

    Args:
        num_groups: groups; must divide ``num_channels``.
        num_channels: ``C``.
        eps: added to the variance.
        affine: whether to learn a per-channel ``weight`` and ``bias``.
        bias: whether to learn ``bias`` (with ``affine``), keyword-only as in PyTorch.
        dtype: the compute dtype, and the parameters' dtype when ``param_dtype``
            is ``None`` (PyTorch's meaning).
        param_dtype: the parameters' storage dtype (Flax's meaning); given, each
            call casts the parameters and the input to ``dtype`` (mixed precision).

    Differences from PyTorch:
        The arguments of ``torch.nn.GroupNorm``, plus keyword-only ``dtype=`` and
        ``param_dtype=`` (mixed precision, which torch has not); no ``device=`` (JAX places
        arrays).

    Examples:
        >>> import jax.numpy as jnp
        >>> import autostate.nn as nn
        >>> nn.GroupNorm(2, 4)(jnp.ones((3, 4, 5))).shape
        (3, 4, 5)
    """

    def __init__(
        self,
        num_groups: int,
        num_channels: int,
        eps: float = 1e-5,
        affine: bool = True,
        *,
        bias: bool = True,
        dtype: Any = jnp.float32,
        param_dtype: Any = None,
    ):
        if num_channels % num_groups:
            raise InvalidArgumentError(
                format_error(
                    f"GroupNorm: num_groups={num_groups} must divide num_channels={num_channels}.",
                    fix="pick a number of groups that divides the channels.",
                )
            )
        self.num_groups = num_groups
        self.num_channels = num_channels
        self.eps = eps
        self.affine = affine
        dtype = precision(self, dtype, param_dtype)
        self.weight = jnp.ones(num_channels, dtype) if affine else None
        self.bias = jnp.zeros(num_channels, dtype) if affine and bias else None

    def forward(self, x: jax.Array) -> jax.Array:
        n = x.shape[0]
        x, weight, bias = promote(self, x, self.weight, self.bias)
        out = _result_type(x, weight, bias)
        grouped = x.astype(statistics_dtype(x)).reshape(n, self.num_groups, -1)
        mean = grouped.mean(-1, keepdims=True)
        var = grouped.var(-1, keepdims=True)
        y = ((grouped - mean) * jax.lax.rsqrt(var + self.eps)).reshape(x.shape)
        per_channel = (1, -1) + (1,) * (x.ndim - 2)
        if weight is not None:
            y = y * weight.reshape(per_channel)
        if bias is not None:
            y = y + bias.reshape(per_channel)
        return y.astype(out)


class RMSNorm(Module):
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last
    ``len(normalized_shape)`` axes, as ``torch.nn.RMSNorm``.

    Args:
        normalized_shape: the trailing shape normalised over.
        eps: added to the mean square; ``None`` is the input dtype's machine
            epsilon, as in PyTorch.
        elementwise_affine: whether to learn ``weight``.
        dtype: the compute dtype, and the parameters' dtype when ``param_dtype``
            is ``None`` (PyTorch's meaning).
        param_dtype: the parameters' storage dtype (Flax's meaning); given, each
            call casts the parameters and the input to ``dtype`` (mixed precision).

    Differences from PyTorch:
        The arguments of ``torch.nn.RMSNorm``, plus keyword-only ``dtype=`` and
        ``param_dtype=`` (mixed precision, which torch has not); no ``device=`` (JAX places
        arrays).

    Examples:
        >>> import jax.numpy as jnp
        >>> import autostate.nn as nn
        >>> [round(v, 4) for v in nn.RMSNorm(2)(jnp.array([3.0, 4.0])).tolist()]
        [0.8485, 1.1314]
    """

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float | None = None,
        elementwise_affine: bool = True,
        *,
        dtype: Any = jnp.float32,
        param_dtype: Any = None,
    ):
        self.normalized_shape = _shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        dtype = precision(self, dtype, param_dtype)
        self.weight = jnp.ones(self.normalized_shape, dtype) if elementwise_affine else None

    def forward(self, x: jax.Array) -> jax.Array:
        axes = tuple(range(x.ndim - len(self.normalized_shape), x.ndim))
        x, weight = promote(self, x, self.weight)
        out = _result_type(x, weight)
        eps = jnp.finfo(x.dtype).eps if self.eps is None else self.eps
        x = x.astype(statistics_dtype(x))
        y = x * jax.lax.rsqrt(jnp.mean(x * x, axes, keepdims=True) + eps)
        if weight is not None:
            y = y * weight
        return y.astype(out)
