"""Pooling over channels-first inputs, as in ``torch.nn``: ``MaxPool1d``,
``MaxPool2d``, ``AvgPool1d``, ``AvgPool2d``, ``AdaptiveAvgPool1d``,
``AdaptiveAvgPool2d``, ``AdaptiveMaxPool1d``, ``AdaptiveMaxPool2d``.

One mechanism per kind serves every rank: a layer pools the last ``n``
axes of ``[N, C, *spatial]`` (or unbatched ``[C, *spatial]``), ``n`` fixed
by its class."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from autostate.errors import InvalidArgumentError, format_error
from autostate.nn._inputs import with_batch_axis
from autostate.nn.module import Module

__all__ = [
    "AdaptiveAvgPool1d",
    "AdaptiveAvgPool2d",
    "AdaptiveMaxPool1d",
    "AdaptiveMaxPool2d",
    "AvgPool1d",
    "AvgPool2d",
    "MaxPool1d",
    "MaxPool2d",
]

IntOrTuple = int | Sequence[int]
IntOrPair = int | tuple[int, int]


def _tuple(value: IntOrTuple, n: int) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,) * n
    value = tuple(value)
    if len(value) != n:
        raise InvalidArgumentError(
            format_error(
                f"a {n}-d pooling takes an int or a tuple of {n} per size, got {value!r}.",
                fix=f"pass an int or {n} ints.",
            )
        )
    return value


def _window(kernel: tuple[int, ...], stride: tuple[int, ...], pads: list[tuple[int, int]]) -> dict:
    return {
        "window_dimensions": (1, 1, *kernel),
        "window_strides": (1, 1, *stride),
        "padding": ((0, 0), (0, 0), *pads),
    }


def _pads(
    layer: _MaxPoolNd | _AvgPoolNd, shape: tuple[int, ...], dilation: tuple[int, ...]
) -> list[tuple[int, int]]:
    """``(low, high)`` padding of each spatial axis: ``padding`` on both sides,
    plus, with ``ceil_mode``, what PyTorch's last partial window reaches past
    the high side (a window that starts in the high padding is dropped)."""
    pads = []
    n = len(layer.kernel_size)
    for size, k, s, p, d in zip(
        shape[-n:], layer.kernel_size, layer.stride, layer.padding, dilation, strict=True
    ):
        span = size + 2 * p - d * (k - 1) - 1
        out = (span + (s - 1 if layer.ceil_mode else 0)) // s + 1
        if layer.ceil_mode and (out - 1) * s >= size + p:
            out -= 1
        pads.append((p, p + max(0, (out - 1) * s + d * (k - 1) + 1 - size - 2 * p)))
    return pads


def _check_padding(kernel: tuple[int, ...], padding: tuple[int, ...]) -> None:
    if any(2 * p > k for p, k in zip(padding, kernel, strict=True)):
        raise InvalidArgumentError(
            format_error(
                f"padding={padding} is more than half of kernel_size={kernel}, which "
                "PyTorch refuses too.",
                fix="use padding at most kernel_size // 2.",
            )
        )


def _no_indices(layer: str, return_indices: bool) -> None:
    if return_indices:
        raise InvalidArgumentError(
            format_error(
                f"{layer}(return_indices=True) is not built.",
                fix="compute the indices with jnp.argmax over the windows yourself.",
            )
        )


class _MaxPoolNd(Module):
    """The maximum of each window over the last ``n`` axes (``n`` from the subclass)."""

    _dims = 0

    def __init__(
        self,
        kernel_size: IntOrTuple,
        stride: IntOrTuple | None = None,
        padding: IntOrTuple = 0,
        dilation: IntOrTuple = 1,
        return_indices: bool = False,
        ceil_mode: bool = False,
    ):
        _no_indices(type(self).__name__, return_indices)
        self.kernel_size = _tuple(kernel_size, self._dims)
        self.stride = self.kernel_size if stride is None else _tuple(stride, self._dims)
        self.padding = _tuple(padding, self._dims)
        self.dilation = _tuple(dilation, self._dims)
        self.return_indices = return_indices
        self.ceil_mode = ceil_mode
        _check_padding(self.kernel_size, self.padding)

    def forward(self, x: jax.Array) -> jax.Array:
        x, batched = with_batch_axis(x, self._dims, self)
        pads = _pads(self, x.shape, self.dilation)
        if any(d != 1 for d in self.dilation):
            y = self._dilated(x, pads)
        else:
            y = jax.lax.reduce_window(
                x, -jnp.inf, jax.lax.max, **_window(self.kernel_size, self.stride, pads)
            )
        return y if batched else y[0]

    def _dilated(self, x: jax.Array, pads: list[tuple[int, int]]) -> jax.Array:
        """The maximum over the window's strided slices (JAX has no gradient
        for a dilated ``reduce_window`` maximum)."""
        padded = jnp.pad(x, ((0, 0), (0, 0), *pads), constant_values=-jnp.inf)
        outs = [
            (size - d * (k - 1) - 1) // s + 1
            for size, k, s, d in zip(
                padded.shape[2:], self.kernel_size, self.stride, self.dilation, strict=True
            )
        ]
        result = None
        for offsets in itertools.product(*(range(k) for k in self.kernel_size)):
            index = tuple(
                slice(i * d, i * d + (out - 1) * s + 1, s)
                for i, d, out, s in zip(offsets, self.dilation, outs, self.stride, strict=True)
            )
            window = padded[(slice(None), slice(None), *index)]
            result = window if result is None else jnp.maximum(result, window)
        assert result is not None
        return result


class _AvgPoolNd(Module):
    """The mean of each window over the last ``n`` axes (``n`` from the subclass)."""

    _dims = 0

    def __init__(
        self,
        kernel_size: IntOrTuple,
        stride: IntOrTuple | None = None,
        padding: IntOrTuple = 0,
        ceil_mode: bool = False,
        count_include_pad: bool = True,
        divisor_override: int | None = None,
    ):
        if divisor_override is not None and divisor_override == 0:
            raise InvalidArgumentError(
                format_error(
                    f"{type(self).__name__}(divisor_override=0): the divisor must not be zero.",
                    fix="pass a nonzero divisor, or None.",
                )
            )
        self.kernel_size = _tuple(kernel_size, self._dims)
        self.stride = self.kernel_size if stride is None else _tuple(stride, self._dims)
        self.padding = _tuple(padding, self._dims)
        self.ceil_mode = ceil_mode
        self.count_include_pad = count_include_pad
        self.divisor_override = divisor_override
        _check_padding(self.kernel_size, self.padding)

    def forward(self, x: jax.Array) -> jax.Array:
        x, batched = with_batch_axis(x, self._dims, self)
        pads = _pads(self, x.shape, (1,) * self._dims)
        window = _window(self.kernel_size, self.stride, pads)
        total = jax.lax.reduce_window(x, 0.0, jax.lax.add, **window)
        past = [high - low for low, high in pads]  # the ceil_mode part past the padding
        no_padding = all(p == 0 for p in self.padding)
        if self.divisor_override is not None:
            y = total / self.divisor_override
        elif all(e == 0 for e in past) and (self.count_include_pad or no_padding):
            y = total / math.prod(self.kernel_size)
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


def _adaptive_windows(size_in: int, size_out: int) -> list[tuple[int, int]]:
    """PyTorch's windows ``[floor(i * in / out), ceil((i + 1) * in / out))``."""
    return [
        ((i * size_in) // size_out, -(-(i + 1) * size_in // size_out)) for i in range(size_out)
    ]


def adaptive_mean(x: jax.Array, axis: int, size_out: int) -> jax.Array:
    """The mean of each adaptive window along ``axis``: equal blocks when
    ``size_out`` divides the size, else one weighted sum per window."""
    size_in = x.shape[axis]
    if size_in % size_out == 0:
        blocks = x.reshape(*x.shape[:axis], size_out, size_in // size_out, *x.shape[axis + 1 :])
        return blocks.mean(axis + 1)
    weights = np.zeros((size_out, size_in), np.float32)
    for i, (start, end) in enumerate(_adaptive_windows(size_in, size_out)):
        weights[i, start:end] = 1.0 / (end - start)
    moved = jnp.tensordot(x, jnp.asarray(weights, x.dtype), axes=([axis], [1]))
    return jnp.moveaxis(moved, -1, axis)


def _adaptive_max(x: jax.Array, axis: int, size_out: int) -> jax.Array:
    """The maximum of each adaptive window along ``axis``: every window
    gathered to the longest one's length by repeating its last index (which
    changes no maximum, and a repeated element's gradient adds up to one)."""
    size_in = x.shape[axis]
    if size_in % size_out == 0:
        blocks = x.reshape(*x.shape[:axis], size_out, size_in // size_out, *x.shape[axis + 1 :])
        return blocks.max(axis + 1)
    windows = _adaptive_windows(size_in, size_out)
    longest = max(end - start for start, end in windows)
    index = np.array([[min(start + j, end - 1) for j in range(longest)] for start, end in windows])
    gathered = jnp.take(x, jnp.asarray(index, jnp.int32), axis=axis)  # [..., out, longest, ...]
    return gathered.max(axis + 1)


class _AdaptivePoolNd(Module):
    """Pools the last ``n`` axes to a fixed ``output_size``, whatever the input's size."""

    _dims = 0
    _reduce: Callable[[jax.Array, int, int], jax.Array]

    def __init__(self, output_size: int | None | Sequence[int | None]):
        if output_size is None or isinstance(output_size, int):
            output_size = (output_size,) * self._dims
        self.output_size = tuple(output_size)

    def forward(self, x: jax.Array) -> jax.Array:
        n = self._dims
        for axis, out in zip(range(x.ndim - n, x.ndim), self.output_size, strict=True):
            if out is not None:
                x = type(self)._reduce(x, axis, out)
        return x


class MaxPool1d(_MaxPoolNd):
    """The maximum of each window of ``[N, C, L]`` (or unbatched ``[C, L]``);
    padding counts as ``-inf``.

    Args:
        kernel_size: the window's length.
        stride: the step; ``None`` is ``kernel_size``.
        padding: added at both ends, at most half the kernel.
        dilation: the spacing inside a window.
        return_indices: must be ``False`` (not built).
        ceil_mode: round the output size up, as PyTorch.

    Differences from PyTorch:
        ``return_indices`` is not built; otherwise the arguments of ``torch.nn.MaxPool1d``.

    Examples:
        >>> import jax.numpy as jnp
        >>> import autostate.nn as nn
        >>> print(nn.MaxPool1d(2)(jnp.arange(6.0).reshape(1, 6)))
        [[1. 3. 5.]]
    """

    _dims = 1

    def __init__(
        self,
        kernel_size: IntOrTuple,
        stride: IntOrTuple | None = None,
        padding: IntOrTuple = 0,
        dilation: IntOrTuple = 1,
        return_indices: bool = False,
        ceil_mode: bool = False,
    ):
        super().__init__(kernel_size, stride, padding, dilation, return_indices, ceil_mode)


class MaxPool2d(_MaxPoolNd):
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

    _dims = 2

    def __init__(
        self,
        kernel_size: IntOrPair,
        stride: IntOrPair | None = None,
        padding: IntOrPair = 0,
        dilation: IntOrPair = 1,
        return_indices: bool = False,
        ceil_mode: bool = False,
    ):
        super().__init__(kernel_size, stride, padding, dilation, return_indices, ceil_mode)


class AvgPool1d(_AvgPoolNd):
    """The mean of each window of ``[N, C, L]`` (or unbatched ``[C, L]``).

    Args:
        kernel_size: the window's length.
        stride: the step; ``None`` is ``kernel_size``.
        padding: zeros added at both ends, at most half the kernel.
        ceil_mode: round the output size up, as PyTorch.
        count_include_pad: whether padded zeros count in the mean's divisor.

    Differences from PyTorch:
        None: the arguments of ``torch.nn.AvgPool1d`` (which has no ``divisor_override``).

    Examples:
        >>> import jax.numpy as jnp
        >>> import autostate.nn as nn
        >>> print(nn.AvgPool1d(3, stride=2, padding=1, count_include_pad=False)(jnp.arange(5.0)[None]))
        [[0.5 2.  3.5]]
    """

    _dims = 1

    def __init__(
        self,
        kernel_size: IntOrTuple,
        stride: IntOrTuple | None = None,
        padding: IntOrTuple = 0,
        ceil_mode: bool = False,
        count_include_pad: bool = True,
    ):
        super().__init__(kernel_size, stride, padding, ceil_mode, count_include_pad)


class AvgPool2d(_AvgPoolNd):
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

    _dims = 2

    def __init__(
        self,
        kernel_size: IntOrPair,
        stride: IntOrPair | None = None,
        padding: IntOrPair = 0,
        ceil_mode: bool = False,
        count_include_pad: bool = True,
        divisor_override: int | None = None,
    ):
        super().__init__(
            kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override
        )


class AdaptiveAvgPool1d(_AdaptivePoolNd):
    """Averages ``[N, C, L]`` (or ``[C, L]``) to a fixed length ``output_size``.

    Args:
        output_size: the output's length.

    Differences from PyTorch:
        None: the argument of ``torch.nn.AdaptiveAvgPool1d``, and its windows.

    Examples:
        >>> import jax.numpy as jnp
        >>> import autostate.nn as nn
        >>> print(nn.AdaptiveAvgPool1d(2)(jnp.arange(5.0)[None]))
        [[1. 3.]]
    """

    _dims = 1
    _reduce = staticmethod(adaptive_mean)

    def __init__(self, output_size: int):
        super().__init__(output_size)


class AdaptiveAvgPool2d(_AdaptivePoolNd):
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

    _dims = 2
    _reduce = staticmethod(adaptive_mean)

    def __init__(self, output_size: int | tuple[int | None, int | None]):
        super().__init__(output_size)


class AdaptiveMaxPool1d(_AdaptivePoolNd):
    """The maximum over PyTorch's adaptive windows of ``[N, C, L]`` (or
    ``[C, L]``), to a fixed length ``output_size``.

    Args:
        output_size: the output's length.
        return_indices: must be ``False`` (not built).

    Differences from PyTorch:
        ``return_indices`` is not built; otherwise ``torch.nn.AdaptiveMaxPool1d``.

    Examples:
        >>> import jax.numpy as jnp
        >>> import autostate.nn as nn
        >>> print(nn.AdaptiveMaxPool1d(2)(jnp.array([[3.0, 1.0, 4.0, 1.0, 5.0]])))
        [[4. 5.]]
    """

    _dims = 1
    _reduce = staticmethod(_adaptive_max)

    def __init__(self, output_size: int, return_indices: bool = False):
        _no_indices(type(self).__name__, return_indices)
        super().__init__(output_size)
        self.return_indices = return_indices


class AdaptiveMaxPool2d(_AdaptivePoolNd):
    """The maximum over PyTorch's adaptive windows of ``[N, C, H, W]`` (or
    ``[C, H, W]``), to a fixed ``output_size``.

    Args:
        output_size: an int or ``(oh, ow)``; ``None`` in either place keeps
            the input's size there.
        return_indices: must be ``False`` (not built).

    Differences from PyTorch:
        ``return_indices`` is not built; otherwise ``torch.nn.AdaptiveMaxPool2d``, and
        its windows.

    Examples:
        >>> import jax.numpy as jnp
        >>> import autostate.nn as nn
        >>> nn.AdaptiveMaxPool2d((1, 2))(jnp.ones((2, 8, 5, 5))).shape
        (2, 8, 1, 2)
    """

    _dims = 2
    _reduce = staticmethod(_adaptive_max)

    def __init__(
        self, output_size: int | tuple[int | None, int | None], return_indices: bool = False
    ):
        _no_indices(type(self).__name__, return_indices)
        super().__init__(output_size)
        self.return_indices = return_indices
