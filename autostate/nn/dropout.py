"""``Dropout``, ``Dropout1d``, ``Dropout2d``: random zeroing in training,
with the layer's own key as state."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from autostate.errors import InvalidArgumentError, format_error
from autostate.nn.module import Module
from autostate.nn.random import KeyLike, split_key

__all__ = ["Dropout", "Dropout1d", "Dropout2d"]


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
        keep = jax.random.bernoulli(mask_key, 1 - self.p, self._mask_shape(x))
        scale = 0.0 if self.p == 1 else 1 / (1 - self.p)
        return jnp.where(keep, x * scale, jnp.zeros((), x.dtype))

    def _mask_shape(self, x: jax.Array) -> tuple[int, ...]:
        """The shape of the mask drawn, which broadcasts over ``x``: one
        draw per element here, one per channel for the channel-wise layers."""
        return tuple(x.shape)


class _ChannelDropout(Dropout):
    """Dropout of whole channels: ``[N, C, *spatial]`` (or unbatched
    ``[C, *spatial]``) gets one draw per ``(n, c)``, broadcast over the
    ``spatial`` trailing axes."""

    # The input ranks taken, each with the number of trailing axes a draw covers.
    _spatial_axes: dict[int, int] = {}

    def _mask_shape(self, x: jax.Array) -> tuple[int, ...]:
        spatial = self._spatial_axes.get(x.ndim)
        if spatial is None:
            ranks = " or ".join(str(r) for r in sorted(self._spatial_axes))
            raise InvalidArgumentError(
                format_error(
                    f"{type(self).__name__} expects a {ranks}-d input (channels first), "
                    f"got shape {tuple(x.shape)}.",
                    fix="pass [N, C, ...] or unbatched [C, ...], as PyTorch takes them.",
                )
            )
        return tuple(x.shape[: x.ndim - spatial]) + (1,) * spatial


class Dropout1d(_ChannelDropout):
    """Zeroes whole channels of ``[N, C, L]`` (or unbatched ``[C, L]``) with
    probability ``p`` and scales the rest by ``1 / (1 - p)`` in training, as
    ``torch.nn.Dropout1d``.

    The key is a state, as ``Dropout``'s.

    Args:
        p: the probability of zeroing a channel.
        inplace: accepted for PyTorch's signature; changes nothing.
        key: where the layer's key comes from (see ``autostate.nn.random``).

    Differences from PyTorch:
        As ``Dropout``: the layer holds its own key (keyword-only ``key=``).

    Examples:
        >>> import jax.numpy as jnp
        >>> import autostate.nn as nn
        >>> y = nn.Dropout1d(0.5, key=0)(jnp.ones((2, 4, 3)))
        >>> bool((y.min(-1) == y.max(-1)).all())  # each channel kept or zeroed whole
        True
    """

    _spatial_axes = {2: 1, 3: 1}


class Dropout2d(_ChannelDropout):
    """Zeroes whole channels of ``[N, C, H, W]`` with probability ``p`` and
    scales the rest by ``1 / (1 - p)`` in training, as ``torch.nn.Dropout2d``.

    A 3-d input is read as PyTorch reads it today: ``[N, C, L]``, one draw
    per ``(n, c)`` (PyTorch warns that this will change to an unbatched
    ``[C, H, W]``; ``Dropout1d`` says the same without the warning).

    Args:
        p: the probability of zeroing a channel.
        inplace: accepted for PyTorch's signature; changes nothing.
        key: where the layer's key comes from (see ``autostate.nn.random``).

    Differences from PyTorch:
        As ``Dropout``: the layer holds its own key (keyword-only ``key=``). A
        3-d input gets no warning.

    Examples:
        >>> import jax.numpy as jnp
        >>> import autostate.nn as nn
        >>> y = nn.Dropout2d(0.5, key=0)(jnp.ones((2, 4, 3, 3)))
        >>> bool((y.min((-2, -1)) == y.max((-2, -1))).all())
        True
    """

    _spatial_axes = {3: 1, 4: 2}
