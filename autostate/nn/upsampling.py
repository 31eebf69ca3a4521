"""Resizing channels-first inputs: ``Upsample``, ``UpsamplingNearest2d``,
``UpsamplingBilinear2d``, as in ``torch.nn``.

The output size and the source positions are computed as PyTorch computes
them, in float32: a ``scale_factor`` given is used for the positions
(``1 / scale_factor``), not the ratio of the sizes, unless
``recompute_scale_factor=True``. They depend only on shapes, so they are
Python values under a trace and a resize is a gather (and, for the linear
modes, one interpolation per spatial axis).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from autostate.errors import InvalidArgumentError, format_error
from autostate.nn.module import Module
from autostate.nn.pooling import adaptive_mean

__all__ = ["Upsample", "UpsamplingBilinear2d", "UpsamplingNearest2d"]

# mode -> the input ranks it takes ([N, C, *spatial]); None: any of 3, 4, 5.
_MODES: dict[str, int | None] = {
    "nearest": None,
    "nearest-exact": None,
    "linear": 3,
    "bilinear": 4,
    "trilinear": 5,
    "area": None,
}


def _refuse(message: str, fix: str) -> InvalidArgumentError:
    return InvalidArgumentError(format_error(message, fix=fix))


def _per_axis(value: float | Sequence[float], n: int, what: str) -> tuple[float, ...]:
    if isinstance(value, (int, float)):
        return (value,) * n
    value = tuple(value)
    if len(value) != n:
        raise _refuse(
            f"Upsample: {what}={value!r} has {len(value)} entries for an input with {n} "
            "spatial axes.",
            f"pass one {what} or {n} of them.",
        )
    return value


class Upsample(Module):
    """Resizes ``[N, C, L]``, ``[N, C, H, W]`` or ``[N, C, D, H, W]`` inputs
    to ``size`` or by ``scale_factor``, as ``torch.nn.Upsample``.

    ``'nearest'`` takes source index ``floor(i * scale)``, ``'nearest-exact'``
    ``floor((i + 0.5) * scale)``; ``'area'`` averages PyTorch's adaptive
    windows (``AdaptiveAvgPool``'s); ``'linear'`` (3-d input), ``'bilinear'``
    (4-d) and ``'trilinear'`` (5-d) interpolate between the two nearest
    inputs along each spatial axis, at ``i * (in - 1) / (out - 1)`` with
    ``align_corners=True`` and at ``(i + 0.5) * scale - 0.5`` (at least 0)
    otherwise. ``scale`` is ``1 / scale_factor`` when a factor is given
    (and ``recompute_scale_factor`` is not ``True``), else ``in / out``.

    Args:
        size: the output's spatial size: an int (every axis) or one per axis.
        scale_factor: the output is ``floor(in * scale_factor)`` per axis: a
            number or one per axis. Give ``size`` or ``scale_factor``, not both.
        mode: ``'nearest'``, ``'nearest-exact'``, ``'linear'``, ``'bilinear'``,
            ``'trilinear'`` or ``'area'``.
        align_corners: for the linear modes only: whether the corner pixels
            of input and output line up (``None`` is ``False``).
        recompute_scale_factor: with ``scale_factor``, place the sources by
            the sizes' ratio instead of the factor, as in PyTorch.

    Differences from PyTorch:
        ``mode='bicubic'`` is not built (a clear error); otherwise the
        arguments of ``torch.nn.Upsample``. There is no unbatched input: as PyTorch, a
        3-d input is ``[N, C, L]``.

    Examples:
        >>> import jax.numpy as jnp
        >>> import autostate.nn as nn
        >>> x = jnp.array([[[[1.0, 2.0], [3.0, 4.0]]]])
        >>> print(nn.Upsample(scale_factor=2)(x)[0, 0])
        [[1. 1. 2. 2.]
         [1. 1. 2. 2.]
         [3. 3. 4. 4.]
         [3. 3. 4. 4.]]
        >>> print(nn.Upsample(size=3, mode="bilinear", align_corners=True)(x)[0, 0])
        [[1.  1.5 2. ]
         [2.  2.5 3. ]
         [3.  3.5 4. ]]
    """

    def __init__(
        self,
        size: int | Sequence[int] | None = None,
        scale_factor: float | Sequence[float] | None = None,
        mode: str = "nearest",
        align_corners: bool | None = None,
        recompute_scale_factor: bool | None = None,
    ):
        if mode not in _MODES:
            raise _refuse(
                f"Upsample(mode={mode!r}) is not built: the modes are "
                f"{', '.join(repr(m) for m in _MODES)}.",
                "use one of those (for 'bicubic', jax.image.resize(..., 'cubic') is close "
                "to PyTorch's but not equal at the edges).",
            )
        if (size is None) == (scale_factor is None):
            raise _refuse(
                "Upsample: give either size or scale_factor (one of them, as PyTorch asks).",
                "pass size=... or scale_factor=....",
            )
        if align_corners is not None and not mode.endswith("linear"):
            raise _refuse(
                f"Upsample(mode={mode!r}, align_corners={align_corners}): align_corners is "
                "for the interpolating modes ('linear', 'bilinear', 'trilinear') only, as in "
                "PyTorch.",
                "leave align_corners out for the nearest modes.",
            )
        self.name = type(self).__name__
        self.size = size if size is None or isinstance(size, int) else tuple(size)
        self.scale_factor: float | tuple[float, ...] | None
        if scale_factor is None or isinstance(scale_factor, (int, float)):
            self.scale_factor = None if scale_factor is None else float(scale_factor)
        else:
            self.scale_factor = tuple(float(s) for s in scale_factor)
        self.mode = mode
        self.align_corners = align_corners
        self.recompute_scale_factor = recompute_scale_factor

    def forward(self, x: jax.Array) -> jax.Array:
        rank = _MODES[self.mode]
        if x.ndim not in ((3, 4, 5) if rank is None else (rank,)):
            wanted = "a 3-, 4- or 5-d" if rank is None else f"a {rank}-d"
            raise _refuse(
                f"Upsample(mode={self.mode!r}) takes {wanted} input [N, C, *spatial], got "
                f"shape {tuple(x.shape)}.",
                "add the batch axis (x[None]) to an unbatched input, or pick the mode of "
                "its rank.",
            )
        n = x.ndim - 2
        for axis, (size_in, size_out, factor) in enumerate(
            zip(x.shape[2:], *self._sizes_and_factors(x.shape[2:], n), strict=True)
        ):
            x = self._resize_axis(x, axis + 2, size_in, size_out, factor)
        return x

    def _sizes_and_factors(
        self, shape: tuple[int, ...], n: int
    ) -> tuple[tuple[int, ...], tuple[float | None, ...]]:
        """The output size of each spatial axis, and the factor its positions use."""
        if self.size is not None:
            sizes = tuple(int(s) for s in _per_axis(self.size, n, "size"))
            return sizes, (None,) * n
        assert self.scale_factor is not None
        factors = _per_axis(self.scale_factor, n, "scale_factor")
        sizes = tuple(math.floor(s * f) for s, f in zip(shape, factors, strict=True))
        if self.recompute_scale_factor:
            return sizes, (None,) * n
        return sizes, factors

    def _resize_axis(
        self, x: jax.Array, axis: int, size_in: int, size_out: int, factor: float | None
    ) -> jax.Array:
        # PyTorch's float32 arithmetic for the source positions (a factor's
        # reciprocal in double, then rounded).
        f32 = np.float32
        scale = f32(1.0 / factor) if factor is not None and factor > 0 else f32(size_in) / f32(size_out)
        out = np.arange(size_out, dtype=f32)
        if self.mode == "area":
            return adaptive_mean(x, axis, size_out)
        if self.mode.startswith("nearest"):
            # PyTorch's shortcuts for 'nearest' (not 'nearest-exact'), whatever the factor.
            if size_out == size_in and self.mode == "nearest":
                return x
            if size_out == 2 * size_in and self.mode == "nearest":
                source = np.arange(size_out) // 2
            else:
                position = (out + f32(0.5)) * scale if self.mode == "nearest-exact" else out * scale
                source = np.minimum(np.floor(position).astype(np.int64), size_in - 1)
            return jnp.take(x, jnp.asarray(source, jnp.int32), axis=axis)
        if self.align_corners:
            scale = f32(size_in - 1) / f32(size_out - 1) if size_out > 1 else f32(0)
            position = out * scale
        else:
            position = np.maximum(scale * (out + f32(0.5)) - f32(0.5), f32(0))
        low = np.minimum(np.floor(position).astype(np.int64), size_in - 1)
        high = np.minimum(low + 1, size_in - 1)
        weight = np.clip(position - low, 0, 1).astype(f32)
        shape = [1] * x.ndim
        shape[axis] = size_out
        weight_high = jnp.asarray(weight.reshape(shape), x.dtype)
        weight_low = jnp.asarray((f32(1) - weight).reshape(shape), x.dtype)
        below = jnp.take(x, jnp.asarray(low, jnp.int32), axis=axis)
        above = jnp.take(x, jnp.asarray(high, jnp.int32), axis=axis)
        return below * weight_low + above * weight_high


class UpsamplingNearest2d(Upsample):
    """``Upsample(size, scale_factor, mode='nearest')`` of ``[N, C, H, W]``
    inputs, as ``torch.nn.UpsamplingNearest2d``.

    Args:
        size: the output's ``(H, W)``, or an int for both.
        scale_factor: the output is ``floor(in * scale_factor)`` per axis.

    Differences from PyTorch:
        None: ``torch.nn.UpsamplingNearest2d``.
    """

    def __init__(
        self, size: int | Sequence[int] | None = None, scale_factor: float | Sequence[float] | None = None
    ):
        super().__init__(size, scale_factor, mode="nearest")


class UpsamplingBilinear2d(Upsample):
    """``Upsample(size, scale_factor, mode='bilinear', align_corners=True)``,
    as ``torch.nn.UpsamplingBilinear2d``.

    Args:
        size: the output's ``(H, W)``, or an int for both.
        scale_factor: the output is ``floor(in * scale_factor)`` per axis.

    Differences from PyTorch:
        None: ``torch.nn.UpsamplingBilinear2d`` (whose corners line up).
    """

    def __init__(
        self, size: int | Sequence[int] | None = None, scale_factor: float | Sequence[float] | None = None
    ):
        super().__init__(size, scale_factor, mode="bilinear", align_corners=True)
