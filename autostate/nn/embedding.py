"""``Embedding``: a lookup table, as ``torch.nn.Embedding``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from autostate.errors import InvalidArgumentError, format_error
from autostate.nn._precision import precision, promote
from autostate.nn.module import Module
from autostate.nn.random import KeyLike, split_key

__all__ = ["Embedding"]


class Embedding(Module):
    """Rows of ``weight`` (``[num_embeddings, embedding_dim]``, drawn from
    ``N(0, 1)``) picked by integer indices.

    The row ``padding_idx`` starts at zero and gets no gradient, as in PyTorch.

    Args:
        num_embeddings: the table's rows.
        embedding_dim: the size of each row.
        padding_idx: a row that stays zero and is not trained (negative
            counts from the end).
        key: where the initial weights come from (see ``autostate.nn.random``).
        dtype: the compute dtype, and the table's dtype when ``param_dtype``
            is ``None`` (PyTorch's meaning).
        param_dtype: the table's storage dtype (Flax's meaning); given, each
            call casts the table and the input to ``dtype`` (mixed precision).

    Differences from PyTorch:
        ``max_norm``, ``norm_type``, ``scale_grad_by_freq`` and ``sparse`` are not built
        (``optax`` and ``jnp`` do their jobs); otherwise the arguments of
        ``torch.nn.Embedding``, plus keyword-only ``key=`` (where the initial weights come
        from: an int, a JAX key or a ``KeyStream``; omitted, the default stream
        ``manual_seed`` seeds), ``dtype=`` and ``param_dtype=`` (mixed precision, which
        torch has not); no ``device=`` (JAX places arrays).

    Examples:
        >>> import jax.numpy as jnp
        >>> import autostate.nn as nn
        >>> table = nn.Embedding(10, 3, padding_idx=0, key=0)
        >>> print(table(jnp.array([[0, 2]])).shape, table.weight[0])
        (1, 2, 3) [0. 0. 0.]
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        *,
        key: KeyLike = None,
        dtype: Any = jnp.float32,
        param_dtype: Any = None,
    ):
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise InvalidArgumentError(
                    format_error(
                        f"padding_idx={padding_idx} is outside the table's {num_embeddings} rows.",
                        fix="pass an index in [-num_embeddings, num_embeddings).",
                    )
                )
            padding_idx %= num_embeddings
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        dtype = precision(self, dtype, param_dtype)
        weight = jax.random.normal(split_key(key), (num_embeddings, embedding_dim), dtype)
        if padding_idx is not None:
            weight = weight.at[padding_idx].set(0)
        self.weight = weight

    def forward(self, indices: jax.Array) -> jax.Array:
        (weight,) = promote(self, self.weight)
        if self.padding_idx is not None:
            # The padding row keeps its value but passes no gradient back.
            row = jax.lax.stop_gradient(weight[self.padding_idx])
            weight = weight.at[self.padding_idx].set(row)
        return jnp.take(weight, indices, axis=0)
