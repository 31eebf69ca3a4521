"""Activations and shape helpers: ``ReLU``, ``ReLU6``, ``LeakyReLU``, ``ELU``,
``SELU``, ``CELU``, ``Hardtanh``, ``Hardsigmoid``, ``Hardswish``, ``Mish``,
``GELU``, ``SiLU``, ``Softplus``, ``Tanh``, ``Sigmoid``, ``Softmax``,
``LogSoftmax``, ``Identity``, ``Flatten``, as in ``torch.nn``.

They hold no arrays, only their configuration, so ``functionalize()`` gives
them no states and no parameters. ``inplace=`` is accepted wherever PyTorch
accepts it (by keyword or position) and changes nothing: JAX arrays are
values, so the result is the same array PyTorch's in-place call leaves in
the input, and the input a caller still holds is unchanged. PyTorch code that
relies on ``inplace=True`` changing a tensor the caller still reads
afterwards (rare: autograd refuses most of it) sees the old value here.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from autostate.errors import InvalidArgumentError, format_error
from autostate.nn.module import Module

__all__ = [
    "CELU",
    "ELU",
    "GELU",
    "Flatten",
    "Hardsigmoid",
    "Hardswish",
    "Hardtanh",
    "Identity",
    "LeakyReLU",
    "LogSoftmax",
    "Mish",
    "ReLU",
    "ReLU6",
    "SELU",
    "SiLU",
    "Sigmoid",
    "Softmax",
    "Softplus",
    "Tanh",
]


class ReLU(Module):
    """``max(x, 0)``.

    Differences from PyTorch:
        ``torch.nn.ReLU``. JAX arrays are immutable: the output is always a new
        array, and ``inplace=True`` is accepted and changes nothing.

    Args:
        inplace: accepted for PyTorch's signature; changes nothing.

    Examples:
        >>> import jax.numpy as jnp
        >>> import autostate.nn as nn
        >>> print(nn.ReLU(inplace=True)(jnp.array([-1.0, 2.0])))
        [0. 2.]
    """

    def __init__(self, inplace: bool = False):
        self.inplace = inplace

    def forward(self, x: jax.Array) -> jax.Array:
        return jax.nn.relu(x)


class ReLU6(Module):
    """``min(max(x, 0), 6)``.

    Differences from PyTorch:
        ``torch.nn.ReLU6``; ``inplace=True`` is accepted and changes nothing (JAX
        arrays are values).

    Args:
        inplace: accepted for PyTorch's signature; changes nothing.
    """

    def __init__(self, inplace: bool = False):
        self.inplace = inplace

    def forward(self, x: jax.Array) -> jax.Array:
        return jnp.clip(x, 0.0, 6.0)


class LeakyReLU(Module):
    """``x`` where positive, ``negative_slope * x`` elsewhere.

    Differences from PyTorch:
        ``torch.nn.LeakyReLU``; ``inplace=True`` is accepted and changes nothing.

    Args:
        negative_slope: the slope below zero.
        inplace: accepted for PyTorch's signature; changes nothing.
    """

    def __init__(self, negative_slope: float = 1e-2, inplace: bool = False):
        self.negative_slope = negative_slope
        self.inplace = inplace

    def forward(self, x: jax.Array) -> jax.Array:
        return jnp.where(x >= 0, x, x * self.negative_slope)


class ELU(Module):
    """``x`` where positive, ``alpha * (exp(x) - 1)`` elsewhere.

    Differences from PyTorch:
        ``torch.nn.ELU``; ``inplace=True`` is accepted and changes nothing.

    Args:
        alpha: the scale below zero.
        inplace: accepted for PyTorch's signature; changes nothing.
    """

    def __init__(self, alpha: float = 1.0, inplace: bool = False):
        self.alpha = alpha
        self.inplace = inplace

    def forward(self, x: jax.Array) -> jax.Array:
        return jnp.where(x > 0, x, self.alpha * jnp.expm1(jnp.minimum(x, 0.0)))


class Hardtanh(Module):
    """``x`` clipped to ``[min_val, max_val]``.

    Differences from PyTorch:
        ``torch.nn.Hardtanh``; ``inplace=True`` is accepted and changes nothing.

    Args:
        min_val: the lower bound.
        max_val: the upper bound.
        inplace: accepted for PyTorch's signature; changes nothing.
    """

    def __init__(self, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False):
        if max_val <= min_val:
            raise InvalidArgumentError(
                format_error(
                    f"Hardtanh(min_val={min_val}, max_val={max_val}): max_val must be greater "
                    "than min_val.",
                    fix="pass min_val < max_val.",
                )
            )
        self.min_val = min_val
        self.max_val = max_val
        self.inplace = inplace

    def forward(self, x: jax.Array) -> jax.Array:
        return jnp.clip(x, self.min_val, self.max_val)


class SELU(Module):
    """``scale * (x if x > 0 else alpha * (exp(x) - 1))`` with PyTorch's constants.

    Differences from PyTorch:
        ``torch.nn.SELU``; ``inplace=True`` is accepted and changes nothing.

    Args:
        inplace: accepted for PyTorch's signature; changes nothing.
    """

    def __init__(self, inplace: bool = False):
        self.inplace = inplace

    def forward(self, x: jax.Array) -> jax.Array:
        alpha, scale = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946
        return scale * jnp.where(x > 0, x, alpha * jnp.expm1(jnp.minimum(x, 0.0)))


class CELU(Module):
    """``x`` where positive, ``alpha * (exp(x / alpha) - 1)`` elsewhere.

    Differences from PyTorch:
        ``torch.nn.CELU``; ``inplace=True`` is accepted and changes nothing.

    Args:
        alpha: the scale below zero.
        inplace: accepted for PyTorch's signature; changes nothing.
    """

    def __init__(self, alpha: float = 1.0, inplace: bool = False):
        self.alpha = alpha
        self.inplace = inplace

    def forward(self, x: jax.Array) -> jax.Array:
        return jnp.where(x > 0, x, self.alpha * jnp.expm1(jnp.minimum(x, 0.0) / self.alpha))


class Hardsigmoid(Module):
    """``relu6(x + 3) / 6``.

    Differences from PyTorch:
        ``torch.nn.Hardsigmoid``; ``inplace=True`` is accepted and changes nothing.

    Args:
        inplace: accepted for PyTorch's signature; changes nothing.
    """

    def __init__(self, inplace: bool = False):
        self.inplace = inplace

    def forward(self, x: jax.Array) -> jax.Array:
        return jnp.clip(x + 3.0, 0.0, 6.0) / 6.0


class Hardswish(Module):
    """``x * relu6(x + 3) / 6`` (MobileNetV3's activation).

    Differences from PyTorch:
        ``torch.nn.Hardswish``; ``inplace=True`` is accepted and changes nothing.

    Args:
        inplace: accepted for PyTorch's signature; changes nothing.
    """

    def __init__(self, inplace: bool = False):
        self.inplace = inplace

    def forward(self, x: jax.Array) -> jax.Array:
        return x * jnp.clip(x + 3.0, 0.0, 6.0) / 6.0


class Mish(Module):
    """``x * tanh(softplus(x))``.

    Differences from PyTorch:
        ``torch.nn.Mish``; ``inplace=True`` is accepted and changes nothing.

    Args:
        inplace: accepted for PyTorch's signature; changes nothing.
    """

    def __init__(self, inplace: bool = False):
        self.inplace = inplace

    def forward(self, x: jax.Array) -> jax.Array:
        return x * jnp.tanh(jax.nn.softplus(x))


class GELU(Module):
    """The Gaussian error linear unit, exact (``erf``) or ``approximate='tanh'``.

    Args:
        approximate: ``'none'`` (PyTorch's default) or ``'tanh'``.

    Differences from PyTorch:
        ``approximate`` as in ``torch.nn.GELU`` (``'none'``, the exact ``erf`` form, by
        default). Hugging Face's ``gelu_new`` and ``gelu_pytorch_tanh`` are
        ``GELU(approximate='tanh')``; ``jax.nn.gelu`` defaults to the tanh form.

    Examples:
        >>> import jax.numpy as jnp
        >>> import autostate.nn as nn
        >>> [round(v, 4) for v in nn.GELU()(jnp.array([0.0, 1.0])).tolist()]
        [0.0, 0.8413]
    """

    def __init__(self, approximate: str = "none"):
        if approximate not in ("none", "tanh"):
            raise InvalidArgumentError(
                format_error(
                    f"GELU(approximate={approximate!r}): it is 'none' or 'tanh'.",
                    fix="use GELU() or GELU(approximate='tanh').",
                )
            )
        self.approximate = approximate

    def forward(self, x: jax.Array) -> jax.Array:
        if self.approximate == "tanh":
            inner = math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)
            return 0.5 * x * (1 + jnp.tanh(inner))
        return 0.5 * x * (1 + jax.lax.erf(x / math.sqrt(2)))


class SiLU(Module):
    """``x * sigmoid(x)`` (swish).

    Differences from PyTorch:
        ``torch.nn.SiLU``. The output is always a new array (JAX arrays are
        immutable); ``inplace=True`` is accepted and changes nothing.

    Args:
        inplace: accepted for PyTorch's signature; changes nothing.
    """

    def __init__(self, inplace: bool = False):
        self.inplace = inplace

    def forward(self, x: jax.Array) -> jax.Array:
        return x * jax.nn.sigmoid(x)


class Softplus(Module):
    """``log(1 + exp(beta * x)) / beta``, and ``x`` itself where ``beta * x > threshold``.

    Args:
        beta: the sharpness.
        threshold: above this value of ``beta * x`` the result is ``x``
            (PyTorch's switch for numerical stability; its gradient there is 1).

    Differences from PyTorch:
        None: ``torch.nn.Softplus``, its ``threshold`` switch included.

    Examples:
        >>> import jax.numpy as jnp
        >>> import autostate.nn as nn
        >>> [round(v, 4) for v in nn.Softplus(beta=2.0)(jnp.array([0.0, 30.0])).tolist()]
        [0.3466, 30.0]
    """

    def __init__(self, beta: float = 1.0, threshold: float = 20.0):
        self.beta = beta
        self.threshold = threshold

    def forward(self, x: jax.Array) -> jax.Array:
        scaled = x * self.beta
        # The branch not taken is finite (logaddexp does not overflow), so its
        # zero gradient stays zero.
        return jnp.where(scaled > self.threshold, x, jnp.logaddexp(scaled, 0.0) / self.beta)


class Tanh(Module):
    """``tanh(x)``.

    Differences from PyTorch:
        ``torch.nn.Tanh``.
    """

    def forward(self, x: jax.Array) -> jax.Array:
        return jnp.tanh(x)


class Sigmoid(Module):
    """``1 / (1 + exp(-x))``.

    Differences from PyTorch:
        ``torch.nn.Sigmoid``.
    """

    def forward(self, x: jax.Array) -> jax.Array:
        return jax.nn.sigmoid(x)


class Softmax(Module):
    """``softmax`` along ``dim``.

    Args:
        dim: the axis; ``None`` picks PyTorch's legacy choice (axis 0 for 0-,
            1- and 3-dimensional inputs, else axis 1).

    Differences from PyTorch:
        ``torch.nn.Softmax``, the implicit ``dim=None`` choice included (PyTorch warns
        about it; pass ``dim``).
    """

    def __init__(self, dim: int | None = None):
        self.dim = dim

    def forward(self, x: jax.Array) -> jax.Array:
        return jax.nn.softmax(x, axis=_softmax_dim(self.dim, x))


class LogSoftmax(Module):
    """``log(softmax(x))`` along ``dim``, computed stably (``x - logsumexp(x)``).

    Args:
        dim: the axis; ``None`` picks PyTorch's legacy choice (axis 0 for 0-,
            1- and 3-dimensional inputs, else axis 1).

    Differences from PyTorch:
        ``torch.nn.LogSoftmax``, the implicit ``dim=None`` choice included (PyTorch warns
        about it; pass ``dim``).

    Examples:
        >>> import jax.numpy as jnp
        >>> import autostate.nn as nn
        >>> [round(v, 4) for v in nn.LogSoftmax(dim=-1)(jnp.array([0.0, 0.0])).tolist()]
        [-0.6931, -0.6931]
    """

    def __init__(self, dim: int | None = None):
        self.dim = dim

    def forward(self, x: jax.Array) -> jax.Array:
        return jax.nn.log_softmax(x, axis=_softmax_dim(self.dim, x))


def _softmax_dim(dim: int | None, x: jax.Array) -> int:
    """``dim``, or PyTorch's legacy implicit choice for ``None``."""
    if dim is None:
        return 0 if x.ndim in (0, 1, 3) else 1
    return dim


class Identity(Module):
    """Returns its input (a placeholder layer).

    Differences from PyTorch:
        ``torch.nn.Identity``: any arguments it is built with are ignored, as
        torch ignores them.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def forward(self, x: jax.Array) -> jax.Array:
        return x


class Flatten(Module):
    """Flattens axes ``start_dim`` to ``end_dim`` (both included) into one.

    Differences from PyTorch:
        ``torch.nn.Flatten``; a 0-d input becomes 1-d, as in torch.

    Examples:
        >>> import jax.numpy as jnp
        >>> import autostate.nn as nn
        >>> nn.Flatten()(jnp.zeros((2, 3, 4, 5))).shape
        (2, 60)
    """

    def __init__(self, start_dim: int = 1, end_dim: int = -1):
        self.start_dim = start_dim
        self.end_dim = end_dim

    def forward(self, x: jax.Array) -> jax.Array:
        if x.ndim == 0:
            return x.reshape(1)
        start, end = self.start_dim % x.ndim, self.end_dim % x.ndim
        return x.reshape(
            x.shape[:start] + (math.prod(x.shape[start : end + 1]),) + x.shape[end + 1 :]
        )
