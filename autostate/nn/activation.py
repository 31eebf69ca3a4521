"""Activations and shape helpers: ``ReLU``, ``GELU``, ``SiLU``, ``Tanh``,
``Sigmoid``, ``Softmax``, ``Identity``, ``Flatten``, as in ``torch.nn``.

They hold no arrays, only their configuration, so ``functionalize()`` gives
them no states and no parameters.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from autostate.api import Stateful
from autostate.errors import InvalidArgumentError, format_error

__all__ = ["GELU", "Flatten", "Identity", "ReLU", "SiLU", "Sigmoid", "Softmax", "Tanh"]


class ReLU(Stateful):
    """``max(x, 0)``.

    Differences from PyTorch:
        ``torch.nn.ReLU``. JAX arrays are immutable, so the output is always a new
        array, where torch's ``inplace=True`` overwrites the input.
    """

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.relu(x)


class GELU(Stateful):
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

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.approximate == "tanh":
            inner = math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)
            return 0.5 * x * (1 + jnp.tanh(inner))
        return 0.5 * x * (1 + jax.lax.erf(x / math.sqrt(2)))


class SiLU(Stateful):
    """``x * sigmoid(x)`` (swish).

    Differences from PyTorch:
        ``torch.nn.SiLU``. The output is always a new array (JAX arrays are
        immutable), where torch's ``inplace=True`` overwrites the input.
    """

    def __call__(self, x: jax.Array) -> jax.Array:
        return x * jax.nn.sigmoid(x)


class Tanh(Stateful):
    """``tanh(x)``.

    Differences from PyTorch:
        ``torch.nn.Tanh``.
    """

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.tanh(x)


class Sigmoid(Stateful):
    """``1 / (1 + exp(-x))``.

    Differences from PyTorch:
        ``torch.nn.Sigmoid``.
    """

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.sigmoid(x)


class Softmax(Stateful):
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

    def __call__(self, x: jax.Array) -> jax.Array:
        dim = self.dim
        if dim is None:
            dim = 0 if x.ndim in (0, 1, 3) else 1
        return jax.nn.softmax(x, axis=dim)


class Identity(Stateful):
    """Returns its input (a placeholder layer).

    Differences from PyTorch:
        ``torch.nn.Identity`` ignores any arguments it is built with; this one takes none.
    """

    def __call__(self, x: jax.Array) -> jax.Array:
        return x


class Flatten(Stateful):
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

    def __call__(self, x: jax.Array) -> jax.Array:
        if x.ndim == 0:
            return x.reshape(1)
        start, end = self.start_dim % x.ndim, self.end_dim % x.ndim
        return x.reshape(
            x.shape[:start] + (math.prod(x.shape[start : end + 1]),) + x.shape[end + 1 :]
        )
