"""``Embedding``: a lookup table, as ``torch.nn.Embedding``."""

from __future__ import annotations

from typing import Any, Self

import jax
import jax.numpy as jnp

from autostate.errors import InvalidArgumentError, format_error
from autostate.nn._precision import precision, promote
from autostate.nn.module import Module
from autostate.nn.random import KeyLike, split_key

__all__ = ["Embedding"]

_FREEZE_FIX = (
    "pass freeze=False (_freeze=False) and keep the table out of the optimizer's update "
    "(optax.masked), or apply jax.lax.stop_gradient to the lookup"
)


class Embedding(Module):
    """Rows of ``weight`` (``[num_embeddings, embedding_dim]``, drawn from
    ``N(0, 1)``) picked by integer indices.

    The row ``padding_idx`` starts at zero and gets no gradient, as in PyTorch.

    Args:
        num_embeddings: the table's rows.
        embedding_dim: the size of each row.
        padding_idx: a row that stays zero and is not trained (negative
            counts from the end).
        max_norm: must be ``None`` (not built).
        norm_type: accepted for PyTorch's signature (used with ``max_norm`` only).
        scale_grad_by_freq: must be ``False`` (not built).
        sparse: accepted for PyTorch's signature; gradients are dense arrays.
        _weight: the initial table, ``[num_embeddings, embedding_dim]``, as
            PyTorch's (``from_pretrained`` passes it); its ``padding_idx`` row is
            kept as given.
        _freeze: must be ``False`` (see ``from_pretrained``).
        key: where the initial weights come from (see ``autostate.nn.random``).
        dtype: the compute dtype, and the table's dtype when ``param_dtype``
            is ``None`` (PyTorch's meaning).
        param_dtype: the table's storage dtype (Flax's meaning); given, each
            call casts the table and the input to ``dtype`` (mixed precision).

    Differences from PyTorch:
        ``max_norm`` (a renormalisation of the table in place, at lookup) and
        ``scale_grad_by_freq`` are not built and raise ``InvalidArgumentError`` when set;
        ``sparse=True`` gives dense gradients (the same numbers). Otherwise the arguments
        of ``torch.nn.Embedding``, plus keyword-only ``key=`` (where the initial weights come
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
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: Any = None,
        _freeze: bool = False,
        *,
        key: KeyLike = None,
        dtype: Any = jnp.float32,
        param_dtype: Any = None,
    ):
        for name, value, fix in (
            ("max_norm", max_norm is not None, "renormalise the rows yourself, or drop max_norm"),
            ("scale_grad_by_freq", scale_grad_by_freq, "scale the gradients yourself"),
            ("_freeze", _freeze, _FREEZE_FIX),
        ):
            if value:
                raise InvalidArgumentError(
                    format_error(f"Embedding({name}=...) is not built.", fix=fix + ".")
                )
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
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.scale_grad_by_freq = scale_grad_by_freq
        self.sparse = sparse
        dtype = precision(self, dtype, param_dtype)
        if _weight is not None:
            weight = jnp.asarray(_weight, dtype)
            if weight.shape != (num_embeddings, embedding_dim):
                raise InvalidArgumentError(
                    format_error(
                        f"Embedding: _weight has shape {weight.shape}, not "
                        f"{(num_embeddings, embedding_dim)}.",
                        fix="pass a [num_embeddings, embedding_dim] table.",
                    )
                )
        else:
            weight = jax.random.normal(split_key(key), (num_embeddings, embedding_dim), dtype)
            if padding_idx is not None:
                weight = weight.at[padding_idx].set(0)
        self.weight = weight

    @classmethod
    def from_pretrained(
        cls,
        embeddings: Any,
        freeze: bool = True,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        *,
        dtype: Any = None,
        param_dtype: Any = None,
    ) -> Self:
        """An ``Embedding`` whose table is ``embeddings`` (``[rows, dim]``), as
        ``torch.nn.Embedding.from_pretrained``.

        ``freeze=True`` (PyTorch's default: a table that is not trained) raises
        ``InvalidArgumentError``: a parameter here is trained by what the
        optimizer is given. Pass ``freeze=False``, and keep the table out of
        the update (``optax.masked``) or stop its gradient, to freeze it.

        Examples:
            >>> import jax.numpy as jnp
            >>> import autostate.nn as nn
            >>> table = nn.Embedding.from_pretrained(jnp.eye(3), freeze=False)
            >>> print(table(jnp.array([2])))
            [[0. 0. 1.]]
        """
        if freeze:
            raise InvalidArgumentError(
                format_error(
                    "Embedding.from_pretrained(freeze=True) is not built.", fix=_FREEZE_FIX + "."
                )
            )
        embeddings = jnp.asarray(embeddings)
        if embeddings.ndim != 2:
            raise InvalidArgumentError(
                format_error(
                    f"Embedding.from_pretrained takes a 2-d table, got shape {embeddings.shape}.",
                    fix="pass a [num_embeddings, embedding_dim] array.",
                )
            )
        rows, dim = embeddings.shape
        return cls(
            rows,
            dim,
            padding_idx,
            max_norm,
            norm_type,
            scale_grad_by_freq,
            sparse,
            _weight=embeddings,
            dtype=embeddings.dtype if dtype is None else dtype,
            param_dtype=param_dtype,
        )

    def forward(self, indices: jax.Array) -> jax.Array:
        (weight,) = promote(self, self.weight)
        if self.padding_idx is not None:
            # The padding row keeps its value but passes no gradient back.
            row = jax.lax.stop_gradient(weight[self.padding_idx])
            weight = weight.at[self.padding_idx].set(row)
        return jnp.take(weight, indices, axis=0)
