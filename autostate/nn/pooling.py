"""Pooling over ``[N, C, H, W]`` inputs: ``MaxPool2d``, ``AvgPool2d``,
``AdaptiveAvgPool2d``, as in ``torch.nn``."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from autostate.errors import InvalidArgumentError, format_error
from autostate.nn.module import Module

__all__ = ["AdaptiveAvgPool2d", "AvgPool2d", "MaxPool2d"]

IntOrPair = int | tuple[int, int]


def _pair(value: IntOrPair) -> tuple[int, int]:
    if isinstance(value, int):
        return (value, value)
    first, second = value
    return (first, second)


def _window(kernel: tuple[int, int], stride: tuple[int, int], pads: list[tuple[int, int]]) -> dict:
    return {
        "window_dimensions": (1, 1, *kernel),
        "window_strides": (1, 1, *stride),
        "padding": ((0, 0), (0, 0), *pads),
    }


def _pads(
    layer: MaxPool2d | AvgPool2d, shape: tuple[int, ...], dilation: tuple[int, int] = (1, 1)
) -> list[tuple[int, int]]:
    """``(low, high)`` padding of each spatial axis: ``padding`` on both sides,
    plus, with ``ceil_mode``, what PyTorch's last partial window reaches past
    the high side (a window that starts in the high padding is dropped)."""
    pads = []
    for size, k, s, p, d in zip(
        shape[-2:], layer.kernel_size, layer.stride, layer.padding, dilation, strict=True
    ):
        span = size + 2 * p - d * (k - 1) - 1
        out = (span + (s - 1 if layer.ceil_mode else 0)) // s + 1
        if layer.ceil_mode and (out - 1) * s >= size + p:
            out -= 1
        pads.append((p, p + max(0, (out - 1) * s + d * (k - 1) + 1 - size - 2 * p)))
    return pads


def _batched(x: jax.Array, layer: object) -> tuple[jax.Array, bool]:
    """``x`` as ``[N, C, H, W]``, and whether it had the batch axis (PyTorch
    takes an unbatched ``[C, H, W]`` too)."""
    if x.ndim == 4:
        return x, True
    if x.ndim == 3:
        return x[None], False
    raise InvalidArgumentError(
        format_error(
            f"{type(layer).__name__} expects a 3-d (unbatched) or 4-d (batched) input "
            f"[N, C, H, W], got shape {tuple(x.shape)}.",
            fix="pass [C, H, W] or [N, C, H, W].",
        )
    )


def _check_padding(kernel: tuple[int, int], padding: tuple[int, int]) -> None:
    if any(2 * p > k for p, k in zip(padding, kernel, strict=True)):
        raise InvalidArgumentError(
            format_error(
                f"padding={padding} is more than half of kernel_size={kernel}, which "
                "PyTorch refuses too.",
                fix="use padding at most kernel_size // 2.",
            )
        )


class MaxPool2d(Module):
    """The maximum of each window; padding counts as ``-inf``.

    Args:
        kernel_size: an int or ``(kh, kw)``.
        stride: an int or ``(sh, sw)``; ``None`` is ``kernel_size``.
        padding: an int or ``(ph, pw)``, at most half the kernel.
        dilation: an int or ``(dh, dw)``.
        return_indices: must be ``False`` (not built).
        ceil_mode: round the output size up, as PyTorch: a last, partial
            window that starts inside the input (or its low padding) counts.

    Differences from PyTorch:
        ``return_indices`` is not built; otherwise the arguments of
        ``torch.nn.MaxPool2d``. The input is ``[N, C, H, W]`` or unbatched ``[C, H, W]``.

    Examples:
        >>> import jax.numpy as jnp
        >>> import autostate.nn as nn
        >>> print(nn.MaxPool2d(2)(jnp.arange(16.0).reshape(1, 1, 4, 4))[0, 0])
        [[ 5.  7.]
         [13. 15.]]
    """

    def __init__(
        self,
        kernel_size: IntOrPair,
        stride: IntOrPair | None = None,
        padding: IntOrPair = 0,
        dilation: IntOrPair = 1,
        return_indices: bool = False,
        ceil_mode: bool = False,
    ):
        if return_indices:
            raise InvalidArgumentError(
                format_error(
                    "MaxPool2d(return_indices=True) is not built.",
                    fix="compute the indices with jnp.argmax over the windows yourself.",
                )
            )
        self.kernel_size = _pair(kernel_size)
        self.stride = self.kernel_size if stride is None else _pair(stride)
        self.padding = _pair(padding)
        self.dilation = _pair(dilation)
        self.return_indices = return_indices
        self.ceil_mode = ceil_mode
        _check_padding(self.kernel_size, self.padding)

    def forward(self, x: jax.Array) -> jax.Array:
        x, batched = _batched(x, self)
        pads = _pads(self, x.shape, self.dilation)
        if self.dilation != (1, 1):
            y = self._dilated(x, pads)
        else:
            y = jax.lax.reduce_window(
                x, -jnp.inf, jax.lax.max, **_window(self.kernel_size, self.stride, pads)
            )
        return y if batched else y[0]

    def _dilated(self, x: jax.Array, pads: list[tuple[int, int]]) -> jax.Array:
        """The maximum over the window's strided slices (JAX has no gradient
        for a dilated ``reduce_window`` maximum)."""
        (kh, kw), (sh, sw), (dh, dw) = self.kernel_size, self.stride, self.dilation
        padded = jnp.pad(x, ((0, 0), (0, 0), *pads), constant_values=-jnp.inf)
        out_h = (padded.shape[2] - dh * (kh - 1) - 1) // sh + 1
        out_w = (padded.shape[3] - dw * (kw - 1) - 1) // sw + 1
        result = None
        for i in range(kh):
            for j in range(kw):
                rows = slice(i * dh, i * dh + (out_h - 1) * sh + 1, sh)
                cols = slice(j * dw, j * dw + (out_w - 1) * sw + 1, sw)
                window = padded[:, :, rows, cols]
                result = window if result is None else jnp.maximum(result, window)
        assert result is not None
        return result


class AvgPool2d(Module):
    """The mean of each window.

    Args:
        kernel_size: an int or ``(kh, kw)``.
        stride: an int or ``(sh, sw)``; ``None`` is ``kernel_size``.
        padding: zeros added on each side, at most half the kernel.
        ceil_mode: round the output size up, as PyTorch: a last, partial
            window that starts inside the input (or its low padding) counts.
        count_include_pad: whether padded zeros count in the mean's divisor
            (the ``ceil_mode`` part past the padding never does, as in PyTorch).
        divisor_override: divide each window's sum by this instead.

    Differences from PyTorch:
        None: the arguments of ``torch.nn.AvgPool2d``. The input is ``[N, C, H, W]`` or
        unbatched ``[C, H, W]``.

    Examples:
        >>> import jax.numpy as jnp
        >>> import autostate.nn as nn
        >>> print(nn.AvgPool2d(2)(jnp.arange(16.0).reshape(1, 1, 4, 4))[0, 0])
        [[ 2.5  4.5]
         [10.5 12.5]]
    """

    def __init__(
        self,
        kernel_size: IntOrPair,
        stride: IntOrPair | None = None,
        padding: IntOrPair = 0,
        ceil_mode: bool = False,
        count_include_pad: bool = True,
        divisor_override: int | None = None,
    ):
        if divisor_override is not None and divisor_override == 0:
            raise InvalidArgumentError(
                format_error(
                    "AvgPool2d(divisor_override=0): the divisor must not be zero.",
                    fix="pass a nonzero divisor, or None.",
                )
            )
        self.kernel_size = _pair(kernel_size)
        self.stride = self.kernel_size if stride is None else _pair(stride)
        self.padding = _pair(padding)
        self.ceil_mode = ceil_mode
        self.count_include_pad = count_include_pad
        self.divisor_override = divisor_override
        _check_padding(self.kernel_size, self.padding)

    def forward(self, x: jax.Array) -> jax.Array:
        x, batched = _batched(x, self)
        pads = _pads(self, x.shape)
        window = _window(self.kernel_size, self.stride, pads)
        total = jax.lax.reduce_window(x, 0.0, jax.lax.add, **window)
        past = [high - low for low, high in pads]  # the ceil_mode part past the padding
        if self.divisor_override is not None:
            y = total / self.divisor_override
        elif all(e == 0 for e in past) and (self.count_include_pad or self.padding == (0, 0)):
            y = total / (self.kernel_size[0] * self.kernel_size[1])
        else:
            # Each window's divisor: the positions it covers in the input, and
            # in the padding with count_include_pad (never the ceil_mode part).
            ones = jnp.ones((1, 1, *x.shape[2:]), x.dtype)
            fill = 1 if self.count_include_pad else 0
            ones = jnp.pad(
                ones, ((0, 0), (0, 0), *((p, p) for p in self.padding)), constant_values=fill
            )
            counted = _window(self.kernel_size, self.stride, [(0, e) for e in past])
            y = total / jax.lax.reduce_window(ones, 0.0, jax.lax.add, **counted)
        return y if batched else y[0]


def _adaptive_weights(size_in: int, size_out: int) -> jax.Array:
    """``[size_out, size_in]``: row ``i`` averages PyTorch's window
    ``[floor(i * in / out), ceil((i + 1) * in / out))``."""
    rows = []
    for i in range(size_out):
        start, end = (i * size_in) // size_out, -(-(i + 1) * size_in // size_out)
        rows.append([1.0 / (end - start) if start <= j < end else 0.0 for j in range(size_in)])
    return jnp.array(rows)


class AdaptiveAvgPool2d(Module):
    """Averages to a fixed ``output_size``, whatever the input's size.

    An output size that divides the input's averages equal blocks; any other
    uses PyTorch's overlapping windows.

    Args:
        output_size: an int or ``(oh, ow)``; ``None`` in either place keeps
            the input's size there.

    Differences from PyTorch:
        None: the argument of ``torch.nn.AdaptiveAvgPool2d``, and its windows.

    Examples:
        >>> import jax.numpy as jnp
        >>> import autostate.nn as nn
        >>> nn.AdaptiveAvgPool2d(1)(jnp.ones((2, 8, 5, 5))).shape
        (2, 8, 1, 1)
    """

    def __init__(self, output_size: int | tuple[int | None, int | None]):
        if isinstance(output_size, int):
            output_size = (output_size, output_size)
        self.output_size = tuple(output_size)

    def forward(self, x: jax.Array) -> jax.Array:
        *batch, height, width = x.shape
        out_h, out_w = (
            size if out is None else out
            for size, out in zip((height, width), self.output_size, strict=True)
        )
        if height % out_h == 0 and width % out_w == 0:
            blocks = x.reshape(*batch, out_h, height // out_h, out_w, width // out_w)
            return blocks.mean((-3, -1))
        rows = _adaptive_weights(height, out_h).astype(x.dtype)
        cols = _adaptive_weights(width, out_w).astype(x.dtype)
        return jnp.einsum("...hw,oh,pw->...op", x, rows, cols)
