"""PyTorch's ``torch.nn.init``: initialisers that write the model in place.

PyTorch's ``nn.init.kaiming_normal_(m.weight)`` fills the tensor ``m.weight``
in place. A JAX array is a value that never changes, so here the function
draws a new array and puts it where the old one was: in **every attribute of
every constructed** ``nn.Module`` **that holds that very array** (found by
identity: ``nn.module.holders_of``), a parameter or a state. That is the
meaning of an in-place write, which every holder of a PyTorch tensor sees: a
tied weight (one array in two modules) is written in both. Each function
also returns the new array, as PyTorch's return the tensor, so

    for m in self.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

(torchvision's ResNet), ``nn.init.normal_(self.weight, std=0.02)`` in an
``__init__`` and ``self.apply(self._init_weights)`` port unchanged.

What is refused (``InvalidArgumentError``, with the fix): an array that no
constructed module holds (a local array, a model that ``autostate.freeze``
or ``load_state_dict`` made, where ``m.weight = nn.init.zeros_(m.weight)``
writes it), and the parameters of a model inside a functionalized call
(``f``, ``autostate.jit``), which are fixed there. A holder outside the
model (a local ``w = m.weight`` kept before the call) keeps the old array.

**Keys.** The random initialisers take ``key=`` as every layer does
(``autostate.nn.random``): nothing draws the next key of the default stream,
which ``nn.manual_seed`` reseeds (``torch.manual_seed``'s role), so a model
built twice after the same seed is the same; a ``KeyStream``, a JAX key or
an int seed pick the key explicitly (inside ``jax.jit`` or ``jax.vmap`` a
key must be given).

Examples:
    >>> import jax.numpy as jnp
    >>> import autostate.nn as nn
    >>> layer = nn.Linear(3, 2, key=0)
    >>> _ = nn.init.zeros_(layer.bias)
    >>> print(layer.bias)
    [0. 0.]
    >>> _ = nn.init.kaiming_normal_(layer.weight, mode="fan_out", key=1)
    >>> layer.weight.shape
    (2, 3)
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from autostate import values as _values
from autostate.errors import InvalidArgumentError, InvalidTypeError, format_error
from autostate.nn.module import holders_of
from autostate.nn.random import KeyLike, split_key

__all__ = [
    "calculate_gain",
    "constant_",
    "kaiming_normal_",
    "kaiming_uniform_",
    "normal_",
    "ones_",
    "trunc_normal_",
    "uniform_",
    "xavier_normal_",
    "xavier_uniform_",
    "zeros_",
]

_LINEAR = ("linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
           "conv_transpose3d", "sigmoid")  # fmt: skip


def calculate_gain(nonlinearity: str, param: float | None = None) -> float:
    """PyTorch's recommended gain for a nonlinearity (``relu``: ``sqrt(2)``).

    Examples:
        >>> import autostate.nn as nn
        >>> round(nn.init.calculate_gain("relu"), 4), nn.init.calculate_gain("linear")
        (1.4142, 1)
    """
    if nonlinearity in _LINEAR:
        return 1
    if nonlinearity == "tanh":
        return 5.0 / 3
    if nonlinearity == "relu":
        return math.sqrt(2.0)
    if nonlinearity == "leaky_relu":
        slope = 0.01 if param is None else param
        if isinstance(slope, bool) or not isinstance(slope, (int, float)):
            raise InvalidArgumentError(
                format_error(f"negative_slope {slope!r} is not a number.", fix="pass a float.")
            )
        return math.sqrt(2.0 / (1 + slope**2))
    if nonlinearity == "selu":
        return 3.0 / 4
    raise InvalidArgumentError(
        format_error(
            f"Unsupported nonlinearity {nonlinearity!r}.",
            fix="use one of linear, conv*, sigmoid, tanh, relu, leaky_relu, selu.",
        )
    )


def uniform_(tensor: Any, a: float = 0.0, b: float = 1.0, *, key: KeyLike = None) -> jax.Array:
    """Fills ``tensor`` (in every module holding it) from ``U(a, b)``."""
    old = _checked(tensor, "uniform_", random=True)
    new = jax.random.uniform(split_key(key), old.shape, old.dtype, a, b)
    return _write(old, new, "uniform_")


def normal_(
    tensor: Any, mean: float = 0.0, std: float = 1.0, *, key: KeyLike = None
) -> jax.Array:
    """Fills ``tensor`` (in every module holding it) from ``N(mean, std**2)``."""
    old = _checked(tensor, "normal_", random=True)
    new = mean + std * jax.random.normal(split_key(key), old.shape, old.dtype)
    return _write(old, new, "normal_")


def trunc_normal_(
    tensor: Any,
    mean: float = 0.0,
    std: float = 1.0,
    a: float = -2.0,
    b: float = 2.0,
    *,
    key: KeyLike = None,
) -> jax.Array:
    """Fills ``tensor`` from ``N(mean, std**2)`` truncated to ``[a, b]``
    (bounds in the values' units, as PyTorch's)."""
    old = _checked(tensor, "trunc_normal_", random=True)
    lower, upper = (a - mean) / std, (b - mean) / std
    draw = jax.random.truncated_normal(split_key(key), lower, upper, old.shape, old.dtype)
    return _write(old, jnp.clip(mean + std * draw, a, b).astype(old.dtype), "trunc_normal_")


def constant_(tensor: Any, val: float) -> jax.Array:
    """Fills ``tensor`` (in every module holding it) with ``val``."""
    old = _checked(tensor, "constant_")
    return _write(old, jnp.full(old.shape, val, old.dtype), "constant_")


def zeros_(tensor: Any) -> jax.Array:
    """Fills ``tensor`` with zeros."""
    old = _checked(tensor, "zeros_")
    return _write(old, jnp.zeros(old.shape, old.dtype), "zeros_")


def ones_(tensor: Any) -> jax.Array:
    """Fills ``tensor`` with ones."""
    old = _checked(tensor, "ones_")
    return _write(old, jnp.ones(old.shape, old.dtype), "ones_")


def xavier_uniform_(tensor: Any, gain: float = 1.0, *, key: KeyLike = None) -> jax.Array:
    """Glorot uniform: ``U(-b, b)``, ``b = gain * sqrt(6 / (fan_in + fan_out))``."""
    old = _checked(tensor, "xavier_uniform_", random=True)
    fan_in, fan_out = _fans(old, "xavier_uniform_")
    bound = gain * math.sqrt(6.0 / (fan_in + fan_out))
    new = jax.random.uniform(split_key(key), old.shape, old.dtype, -bound, bound)
    return _write(old, new, "xavier_uniform_")


def xavier_normal_(tensor: Any, gain: float = 1.0, *, key: KeyLike = None) -> jax.Array:
    """Glorot normal: ``N(0, std**2)``, ``std = gain * sqrt(2 / (fan_in + fan_out))``."""
    old = _checked(tensor, "xavier_normal_", random=True)
    fan_in, fan_out = _fans(old, "xavier_normal_")
    std = gain * math.sqrt(2.0 / (fan_in + fan_out))
    new = std * jax.random.normal(split_key(key), old.shape, old.dtype)
    return _write(old, new, "xavier_normal_")


def kaiming_uniform_(
    tensor: Any,
    a: float = 0,
    mode: str = "fan_in",
    nonlinearity: str = "leaky_relu",
    *,
    key: KeyLike = None,
) -> jax.Array:
    """He uniform: ``U(-b, b)``, ``b = gain * sqrt(3 / fan)``, ``fan`` by ``mode``
    (``"fan_in"`` or ``"fan_out"``), ``gain = calculate_gain(nonlinearity, a)``."""
    old = _checked(tensor, "kaiming_uniform_", random=True)
    bound = math.sqrt(3.0) * _kaiming_std(old, a, mode, nonlinearity, "kaiming_uniform_")
    new = jax.random.uniform(split_key(key), old.shape, old.dtype, -bound, bound)
    return _write(old, new, "kaiming_uniform_")


def kaiming_normal_(
    tensor: Any,
    a: float = 0,
    mode: str = "fan_in",
    nonlinearity: str = "leaky_relu",
    *,
    key: KeyLike = None,
) -> jax.Array:
    """He normal: ``N(0, std**2)``, ``std = gain / sqrt(fan)``, ``fan`` by ``mode``,
    ``gain = calculate_gain(nonlinearity, a)``.

    Examples:
        >>> import autostate.nn as nn
        >>> conv = nn.Conv2d(64, 64, 3, key=0)
        >>> w = nn.init.kaiming_normal_(conv.weight, mode="fan_out", nonlinearity="relu", key=1)
        >>> w is conv.weight, round(float(w.std()), 2)  # sqrt(2 / (64 * 9))
        (True, 0.06)
    """
    old = _checked(tensor, "kaiming_normal_", random=True)
    std = _kaiming_std(old, a, mode, nonlinearity, "kaiming_normal_")
    new = std * jax.random.normal(split_key(key), old.shape, old.dtype)
    return _write(old, new, "kaiming_normal_")


def _kaiming_std(old: Any, a: float, mode: str, nonlinearity: str, fn: str) -> float:
    if mode not in ("fan_in", "fan_out"):
        raise InvalidArgumentError(
            format_error(f"{fn}: mode={mode!r}.", fix='pass mode="fan_in" or mode="fan_out".')
        )
    fan_in, fan_out = _fans(old, fn)
    fan = fan_in if mode == "fan_in" else fan_out
    return calculate_gain(nonlinearity, a) / math.sqrt(fan) if fan else 0.0


def _fans(old: Any, fn: str) -> tuple[int, int]:
    """PyTorch's fans of a weight: ``[out, in, *kernel]`` is ``in * k`` and ``out * k``."""
    if old.ndim < 2:
        raise InvalidArgumentError(
            format_error(
                f"{fn}: fan in and fan out need an array of at least 2 dimensions, got shape "
                f"{tuple(old.shape)}.",
                fix="initialise a bias with uniform_, normal_, constant_ or zeros_.",
            )
        )
    receptive = math.prod(old.shape[2:])
    return old.shape[1] * receptive, old.shape[0] * receptive


def _checked(tensor: Any, fn: str, random: bool = False) -> Any:
    if not _values.is_array(tensor) or not hasattr(tensor, "shape"):
        raise InvalidTypeError(
            format_error(
                f"nn.init.{fn} takes a model's array (`m.weight`), got {type(tensor).__name__}.",
                fix=f"pass the attribute itself: `nn.init.{fn}(m.weight, ...)`.",
            )
        )
    if random and not jnp.issubdtype(tensor.dtype, jnp.inexact):
        raise InvalidTypeError(
            format_error(
                f"nn.init.{fn} draws floating-point values; the array is {tensor.dtype}.",
                fix="use constant_, zeros_ or ones_ for an integer array.",
            )
        )
    return tensor


def _write(old: Any, new: jax.Array, fn: str) -> jax.Array:
    """Puts ``new`` wherever a constructed module holds ``old``; returns ``new``."""
    # A traced value for a concrete array: the holders live outside the
    # running trace (a parameter closed over by a jitted f), fixed there.
    outside = isinstance(new, jax.core.Tracer) and not isinstance(old, jax.core.Tracer)
    holders = [] if outside else holders_of(old)
    if not holders:
        raise InvalidArgumentError(
            format_error(
                f"nn.init.{fn}: no module built here holds this array, so there is nothing to "
                "write in place (a JAX array never changes itself). It is a local array, an "
                "array of a model made from another (autostate.freeze, load_state_dict, what "
                "jax.vmap returns), or a parameter inside a functionalized call (f, "
                "autostate.jit), where parameters are fixed.",
                fix=f"assign the result where the array belongs: `m.weight = nn.init.{fn}("
                "m.weight, ...)`, outside the functionalized call.",
            )
        )
    for module, attr in holders:
        setattr(module, attr, new)
    return new
