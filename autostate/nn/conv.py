"""Convolutions: ``Conv1d``, ``Conv2d``, ``Conv3d``, ``ConvTranspose2d``, as in ``torch.nn``.

Inputs are channels-first (``NCL``, ``NCHW``, ``NCDHW``); weights have PyTorch's
layouts, so a PyTorch checkpoint's arrays copy over as they are:
``Conv`` weights are ``[out, in / groups, *kernel]``, ``ConvTranspose``
weights ``[in, out / groups, *kernel]``. Initialisation is PyTorch's:
``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` for weight and bias, with
``fan_in = weight.shape[1] * prod(kernel)`` (for a transposed convolution
that is ``out / groups * prod(kernel)``, as PyTorch computes it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from autostate.errors import InvalidArgumentError, format_error
from autostate.nn._init import fan_in_bound, uniform
from autostate.nn._inputs import with_batch_axis
from autostate.nn._precision import precision, promote
from autostate.nn.module import Module
from autostate.nn.random import KeyLike, split_key

__all__ = ["Conv1d", "Conv2d", "Conv3d", "ConvTranspose2d"]

IntOrTuple = int | Sequence[int]
_SPATIAL = {1: "H", 2: "HW", 3: "DHW"}


def _tuple(value: IntOrTuple, n: int, what: str) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,) * n
    value = tuple(value)
    if len(value) != n or not all(isinstance(v, int) for v in value):
        raise InvalidArgumentError(
            format_error(f"{what} takes an int or {n} ints, got {value!r}.", fix=None)
        )
    return value


def _dimension_numbers(n: int) -> tuple[str, str, str]:
    spatial = _SPATIAL[n]
    return (f"NC{spatial}", f"OI{spatial}", f"NC{spatial}")


# torch's padding_mode -> ``jnp.pad``'s mode (``"zeros"`` pads inside the convolution).
_PAD_MODES = {"zeros": "constant", "reflect": "reflect", "replicate": "edge", "circular": "wrap"}


def _check_padding_mode(padding_mode: str, allowed: tuple[str, ...]) -> str:
    if padding_mode not in allowed:
        raise InvalidArgumentError(
            format_error(
                f"padding_mode={padding_mode!r}: it is one of "
                f"{', '.join(repr(m) for m in allowed)}, as in PyTorch.",
                fix="pass one of those.",
            )
        )
    return padding_mode


def _check_groups(in_channels: int, out_channels: int, groups: int) -> None:
    if groups < 1 or in_channels % groups or out_channels % groups:
        raise InvalidArgumentError(
            format_error(
                f"groups={groups} must divide in_channels={in_channels} and "
                f"out_channels={out_channels}.",
                fix="pick groups that divides both channel counts.",
            )
        )


class _ConvNd(Module):
    """An ``n``-dimensional convolution (``Conv1d``, ``Conv2d`` and ``Conv3d`` fix ``n``)."""

    def __init__(
        self,
        n: int,
        in_channels: int,
        out_channels: int,
        kernel_size: IntOrTuple,
        stride: IntOrTuple = 1,
        padding: str | IntOrTuple = 0,
        dilation: IntOrTuple = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        *,
        key: KeyLike = None,
        dtype: Any = jnp.float32,
        param_dtype: Any = None,
    ):
        _check_groups(in_channels, out_channels, groups)
        self.padding_mode = _check_padding_mode(padding_mode, tuple(_PAD_MODES))
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size = _tuple(kernel_size, n, "kernel_size")
        self.stride = _tuple(stride, n, "stride")
        self.dilation = _tuple(dilation, n, "dilation")
        self.groups = groups
        self.transposed = False  # torch's attributes of a convolution
        self.output_padding = (0,) * n
        if isinstance(padding, str):
            if padding not in ("same", "valid"):
                raise InvalidArgumentError(
                    format_error(
                        f"padding={padding!r}: a string padding is 'same' or 'valid'.",
                        fix="pass 'same', 'valid', an int or a tuple of ints.",
                    )
                )
            if padding == "same" and any(s != 1 for s in self.stride):
                raise InvalidArgumentError(
                    format_error(
                        "padding='same' needs stride 1, as in PyTorch.",
                        fix="pass explicit padding for a strided convolution.",
                    )
                )
            self.padding: str | tuple[int, ...] = padding
        else:
            self.padding = _tuple(padding, n, "padding")
        weight_key, bias_key = jax.random.split(split_key(key))
        dtype = precision(self, dtype, param_dtype)
        bound = fan_in_bound(in_channels // groups * math.prod(self.kernel_size))
        shape = (out_channels, in_channels // groups, *self.kernel_size)
        self.weight = uniform(weight_key, shape, bound, dtype)
        self.bias = uniform(bias_key, (out_channels,), bound, dtype) if bias else None

    def _pads(self) -> list[tuple[int, int]]:
        if self.padding == "valid":
            return [(0, 0)] * len(self.kernel_size)
        if self.padding == "same":
            # PyTorch puts the odd padding element on the high side.
            totals = [d * (k - 1) for d, k in zip(self.dilation, self.kernel_size, strict=True)]
            return [(t // 2, t - t // 2) for t in totals]
        return [(p, p) for p in self.padding if isinstance(p, int)]

    def forward(self, x: jax.Array) -> jax.Array:
        n = len(self.kernel_size)
        x, batched = with_batch_axis(x, n, self)
        x, weight, bias = promote(self, x, self.weight, self.bias)
        pads = self._pads()
        if self.padding_mode != "zeros":  # padded first, as PyTorch does
            x = jnp.pad(x, [(0, 0), (0, 0), *pads], mode=_PAD_MODES[self.padding_mode])
            pads = [(0, 0)] * n
        y = jax.lax.conv_general_dilated(
            x,
            weight,
            window_strides=self.stride,
            padding=pads,
            rhs_dilation=self.dilation,
            dimension_numbers=_dimension_numbers(n),
            feature_group_count=self.groups,
        )
        if bias is not None:
            y = y + bias.reshape((-1,) + (1,) * n)
        return y if batched else y[0]


class Conv1d(_ConvNd):
    """A 1-d convolution over ``[N, C, L]`` inputs, as ``torch.nn.Conv1d``.

    Args:
        in_channels: input channels.
        out_channels: output channels.
        kernel_size: the kernel's length.
        stride: the step between windows.
        padding: zeros added at both ends (an int), or ``'same'`` / ``'valid'``.
        dilation: the spacing between kernel elements.
        groups: independent channel groups (``in_channels`` for depthwise).
        bias: whether to add a learned bias.
        padding_mode: what the padding holds: ``'zeros'``, ``'reflect'``,
            ``'replicate'`` or ``'circular'``.
        key: where the initial weights come from (see ``autostate.nn.random``).
        dtype: the compute dtype, and the parameters' dtype when ``param_dtype``
            is ``None`` (PyTorch's meaning).
        param_dtype: the parameters' storage dtype (Flax's meaning); given, each
            call casts the parameters and the input to ``dtype`` (mixed precision).

    Differences from PyTorch:
        The arguments of ``torch.nn.Conv1d``, plus
        keyword-only ``key=`` (where the initial weights come from: an int, a JAX key or a
        ``KeyStream``; omitted, the default stream ``manual_seed`` seeds), ``dtype=`` and
        ``param_dtype=`` (mixed precision, which torch has not); no ``device=`` (JAX places
        arrays).

    Examples:
        >>> import jax.numpy as jnp
        >>> import autostate.nn as nn
        >>> nn.Conv1d(2, 4, 3, padding="same", key=0)(jnp.ones((1, 2, 7))).shape
        (1, 4, 7)
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: IntOrTuple,
        stride: IntOrTuple = 1,
        padding: str | IntOrTuple = 0,
        dilation: IntOrTuple = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        *,
        key: KeyLike = None,
        dtype: Any = jnp.float32,
        param_dtype: Any = None,
    ):
        super().__init__(
            1,
            in_channels,
            out_channels,
            kernel_size,
            stride,
            padding,
            dilation,
            groups,
            bias,
            padding_mode,
            key=key,
            dtype=dtype,
            param_dtype=param_dtype,
        )


class Conv2d(_ConvNd):
    """A 2-d convolution over ``[N, C, H, W]`` inputs, as ``torch.nn.Conv2d``.

    Args:
        in_channels: input channels.
        out_channels: output channels.
        kernel_size: an int or ``(kh, kw)``.
        stride: an int or ``(sh, sw)``.
        padding: zeros added on each side (an int or ``(ph, pw)``), or
            ``'same'`` / ``'valid'``.
        dilation: an int or ``(dh, dw)``.
        groups: independent channel groups (``in_channels`` for depthwise).
        bias: whether to add a learned bias.
        padding_mode: what the padding holds: ``'zeros'``, ``'reflect'``,
            ``'replicate'`` or ``'circular'``.
        key: where the initial weights come from (see ``autostate.nn.random``).
        dtype: the compute dtype, and the parameters' dtype when ``param_dtype``
            is ``None`` (PyTorch's meaning).
        param_dtype: the parameters' storage dtype (Flax's meaning); given, each
            call casts the parameters and the input to ``dtype`` (mixed precision).

    Differences from PyTorch:
        The arguments of ``torch.nn.Conv2d``, plus
        keyword-only ``key=`` (where the initial weights come from: an int, a JAX key or a
        ``KeyStream``; omitted, the default stream ``manual_seed`` seeds), ``dtype=`` and
        ``param_dtype=`` (mixed precision, which torch has not); no ``device=`` (JAX places
        arrays).

    Examples:
        >>> import jax.numpy as jnp
        >>> import autostate.nn as nn
        >>> conv = nn.Conv2d(3, 8, 3, stride=2, padding=1, key=0)
        >>> conv.weight.shape, conv(jnp.ones((1, 3, 8, 8))).shape
        ((8, 3, 3, 3), (1, 8, 4, 4))
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: IntOrTuple,
        stride: IntOrTuple = 1,
        padding: str | IntOrTuple = 0,
        dilation: IntOrTuple = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        *,
        key: KeyLike = None,
        dtype: Any = jnp.float32,
        param_dtype: Any = None,
    ):
        super().__init__(
            2,
            in_channels,
            out_channels,
            kernel_size,
            stride,
            padding,
            dilation,
            groups,
            bias,
            padding_mode,
            key=key,
            dtype=dtype,
            param_dtype=param_dtype,
        )


class Conv3d(_ConvNd):
    """A 3-d convolution over ``[N, C, D, H, W]`` inputs, as ``torch.nn.Conv3d``.

    Args:
        in_channels: input channels.
        out_channels: output channels.
        kernel_size: an int or ``(kd, kh, kw)``.
        stride: an int or ``(sd, sh, sw)``.
        padding: zeros added on each side (an int or ``(pd, ph, pw)``), or
            ``'same'`` / ``'valid'``.
        dilation: an int or ``(dd, dh, dw)``.
        groups: independent channel groups (``in_channels`` for depthwise).
        bias: whether to add a learned bias.
        padding_mode: what the padding holds: ``'zeros'``, ``'reflect'``,
            ``'replicate'`` or ``'circular'``.
        key: where the initial weights come from (see ``autostate.nn.random``).
        dtype: the compute dtype, and the parameters' dtype when ``param_dtype``
            is ``None`` (PyTorch's meaning).
        param_dtype: the parameters' storage dtype (Flax's meaning); given, each
            call casts the parameters and the input to ``dtype`` (mixed precision).

    Differences from PyTorch:
        The arguments of ``torch.nn.Conv3d``, plus
        keyword-only ``key=`` (where the initial weights come from: an int, a JAX key or a
        ``KeyStream``; omitted, the default stream ``manual_seed`` seeds), ``dtype=`` and
        ``param_dtype=`` (mixed precision, which torch has not); no ``device=`` (JAX places
        arrays).

    Examples:
        >>> import jax.numpy as jnp
        >>> import autostate.nn as nn
        >>> conv = nn.Conv3d(2, 4, 3, padding=(0, 1, 1), key=0)
        >>> conv.weight.shape, conv(jnp.ones((1, 2, 5, 6, 6))).shape
        ((4, 2, 3, 3, 3), (1, 4, 3, 6, 6))
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: IntOrTuple,
        stride: IntOrTuple = 1,
        padding: str | IntOrTuple = 0,
        dilation: IntOrTuple = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        *,
        key: KeyLike = None,
        dtype: Any = jnp.float32,
        param_dtype: Any = None,
    ):
        super().__init__(
            3,
            in_channels,
            out_channels,
            kernel_size,
            stride,
            padding,
            dilation,
            groups,
            bias,
            padding_mode,
            key=key,
            dtype=dtype,
            param_dtype=param_dtype,
        )


class ConvTranspose2d(Module):
    """A transposed 2-d convolution (the gradient of ``Conv2d`` with respect
    to its input), as ``torch.nn.ConvTranspose2d``.

    The output's size is ``(in - 1) * stride - 2 * padding + dilation *
    (kernel - 1) + output_padding + 1`` per spatial axis; ``weight`` is
    ``[in_channels, out_channels / groups, kh, kw]``.

    Args:
        in_channels: input channels.
        out_channels: output channels.
        kernel_size: an int or ``(kh, kw)``.
        stride: an int or ``(sh, sw)``.
        padding: an int or ``(ph, pw)``: ``dilation * (kernel - 1) - padding``
            zeros are added around the dilated input.
        output_padding: extra size added on the high side of each axis.
        groups: independent channel groups.
        bias: whether to add a learned bias.
        dilation: an int or ``(dh, dw)``.
        padding_mode: ``'zeros'``, the only mode PyTorch builds for it.
        key: where the initial weights come from (see ``autostate.nn.random``).
        dtype: the compute dtype, and the parameters' dtype when ``param_dtype``
            is ``None`` (PyTorch's meaning).
        param_dtype: the parameters' storage dtype (Flax's meaning); given, each
            call casts the parameters and the input to ``dtype`` (mixed precision).

    Differences from PyTorch:
        The arguments of ``torch.nn.ConvTranspose2d`` (whose ``padding_mode`` is
        ``'zeros'`` only, as in PyTorch), plus
        keyword-only ``key=`` (where the initial weights come from: an int, a JAX key or a
        ``KeyStream``; omitted, the default stream ``manual_seed`` seeds), ``dtype=`` and
        ``param_dtype=`` (mixed precision, which torch has not); no ``device=`` (JAX places
        arrays).

        A call takes no ``output_size``: give ``output_padding`` when building it.

    Examples:
        >>> import jax.numpy as jnp
        >>> import autostate.nn as nn
        >>> up = nn.ConvTranspose2d(4, 2, 3, stride=2, padding=1, output_padding=1, key=0)
        >>> up.weight.shape, up(jnp.ones((1, 4, 5, 5))).shape
        ((4, 2, 3, 3), (1, 2, 10, 10))
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: IntOrTuple,
        stride: IntOrTuple = 1,
        padding: IntOrTuple = 0,
        output_padding: IntOrTuple = 0,
        groups: int = 1,
        bias: bool = True,
        dilation: IntOrTuple = 1,
        padding_mode: str = "zeros",
        *,
        key: KeyLike = None,
        dtype: Any = jnp.float32,
        param_dtype: Any = None,
    ):
        _check_groups(in_channels, out_channels, groups)
        self.padding_mode = _check_padding_mode(padding_mode, ("zeros",))
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size = _tuple(kernel_size, 2, "kernel_size")
        self.stride = _tuple(stride, 2, "stride")
        self.padding = _tuple(padding, 2, "padding")
        self.output_padding = _tuple(output_padding, 2, "output_padding")
        self.dilation = _tuple(dilation, 2, "dilation")
        self.groups = groups
        self.transposed = True
        for op, s, d in zip(self.output_padding, self.stride, self.dilation, strict=True):
            if op >= max(s, d):
                raise InvalidArgumentError(
                    format_error(
                        f"output_padding={self.output_padding} must be smaller than stride "
                        "or dilation, as in PyTorch.",
                        fix="lower output_padding.",
                    )
                )
        weight_key, bias_key = jax.random.split(split_key(key))
        dtype = precision(self, dtype, param_dtype)
        bound = fan_in_bound(out_channels // groups * math.prod(self.kernel_size))
        shape = (in_channels, out_channels // groups, *self.kernel_size)
        self.weight = uniform(weight_key, shape, bound, dtype)
        self.bias = uniform(bias_key, (out_channels,), bound, dtype) if bias else None

    def _forward_kernel(self) -> jax.Array:
        """The weight as an ordinary convolution's ``[out, in / groups, kh, kw]``
        kernel, spatially flipped: a transposed convolution is that
        convolution over the input dilated by ``stride``."""
        g = self.groups
        i, o, kh, kw = self.weight.shape
        w = self.weight.reshape(g, i // g, o, kh, kw).transpose(0, 2, 1, 3, 4)
        return w.reshape(g * o, i // g, kh, kw)[:, :, ::-1, ::-1]

    def forward(self, x: jax.Array) -> jax.Array:
        pads = []
        for k, p, op, d in zip(
            self.kernel_size, self.padding, self.output_padding, self.dilation, strict=True
        ):
            edge = d * (k - 1) - p
            pads.append((edge, edge + op))
        x, batched = with_batch_axis(x, 2, self)
        x, kernel, bias = promote(self, x, self._forward_kernel(), self.bias)
        y = jax.lax.conv_general_dilated(
            x,
            kernel,
            window_strides=(1, 1),
            padding=pads,
            lhs_dilation=self.stride,
            rhs_dilation=self.dilation,
            dimension_numbers=_dimension_numbers(2),
            feature_group_count=self.groups,
        )
        if bias is not None:
            y = y + bias.reshape(-1, 1, 1)
        return y if batched else y[0]
