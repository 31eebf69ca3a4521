"""``MultiheadAttention`` with PyTorch's semantics, plus an optional KV cache for decoding.

The parameters carry torch's names and layouts: ``in_proj_weight``
``[3 * embed_dim, embed_dim]`` and ``in_proj_bias``, or
``q_proj_weight`` / ``k_proj_weight`` / ``v_proj_weight`` when ``kdim`` or
``vdim`` differ from ``embed_dim``, and ``out_proj.weight`` /
``out_proj.bias``; so a torch ``state_dict`` copies over without transposes.
Initialisation is torch's: Xavier-uniform projections, zero biases, and
``out_proj.weight`` as a ``Linear``'s.

**KV cache.** ``MultiheadAttention(..., max_len=n)`` builds a decoder layer:
it keeps the projected keys and values of every call in two state arrays,
``k_cache`` and ``v_cache`` (``[cache_batch_size, max_len, embed_dim]``),
and the number of positions written in ``cache_pos``. Each call writes its
keys and values at ``cache_pos`` (one token, or a whole prompt), advances
it, and attends over the cache with causal masking by absolute position, so
decoding one token at a time gives the outputs of one causal forward over
the whole sequence. It is plain Python (``self.k_cache = ...``), so it holds
eagerly, in ``f(states, ...)`` under ``jax.jit``, and inside
``jax.lax.fori_loop`` / ``scan`` bodies. ``reset_cache()`` starts over.
"""

from __future__ import annotations

import math
from typing import Any, cast

import jax
import jax.numpy as jnp

from autostate.errors import InvalidArgumentError, format_error
from autostate.nn._init import uniform
from autostate.nn._precision import precision, promote, statistics_dtype
from autostate.nn.dropout import Dropout
from autostate.nn.linear import Linear
from autostate.nn.module import Module
from autostate.nn.random import KeyLike, split_key

__all__ = ["MultiheadAttention"]

Array = jax.Array


def _xavier_uniform(key: Array, shape: tuple[int, int], dtype: Any) -> Array:
    """torch's ``xavier_uniform_`` of a ``[fan_out, fan_in]`` matrix."""
    return uniform(key, shape, math.sqrt(6 / (shape[0] + shape[1])), dtype)


def _additive(mask: Array | None, dtype: Any) -> Array | None:
    """A mask as torch reads it: ``True`` (or a bool mask's set entries) is
    ``-inf``, a float mask is added as it is."""
    if mask is None or mask.dtype != jnp.bool_:
        return mask
    return jnp.where(mask, jnp.array(-jnp.inf, dtype), jnp.array(0, dtype))


def _check_mask_shape(name: str, mask: Array | None, shapes: list[tuple[int, ...]]) -> None:
    """Refuses a mask of another shape than PyTorch takes (a ``[S, N]`` padding
    mask of a sequence-first model, say), which would otherwise broadcast or fail
    deep inside the scores."""
    if mask is None or tuple(mask.shape) in shapes:
        return
    wanted = " or ".join(str(list(shape)) for shape in shapes)
    raise _refuse(
        f"MultiheadAttention: {name} has shape {list(mask.shape)}; for these inputs it is "
        f"{wanted}, as PyTorch takes it.",
        f"pass {name} as {wanted} ([N, S] for a padding mask, also with batch_first=False).",
    )


def _refuse(message: str, fix: str) -> InvalidArgumentError:
    return InvalidArgumentError(format_error(message, fix=fix))


class MultiheadAttention(Module):
    """Multi-head attention, as ``torch.nn.MultiheadAttention``, with an optional KV cache.

    ``query`` is ``[L, N, E]`` (``[N, L, E]`` with ``batch_first=True``) or
    unbatched ``[L, E]``; ``key`` and ``value`` are ``[S, N, kdim]`` and
    ``[S, N, vdim]`` likewise. A call returns ``(output, weights)``:
    ``output`` shaped like ``query``, ``weights`` ``[N, L, S]`` averaged over
    heads (``[N, num_heads, L, S]`` with ``average_attn_weights=False``), or
    ``None`` with ``need_weights=False``. ``attn_mask`` (``[L, S]`` or
    ``[N * num_heads, L, S]``) and ``key_padding_mask`` (``[N, S]``) are bool
    (``True`` = not attended) or float (added to the scores), as in torch.
    ``is_causal=True`` without ``attn_mask`` applies the causal mask (torch
    asks for the mask too, as a hint; given one, the mask is used).

    With ``max_len`` the layer keeps a KV cache (see the module docstring):
    ``key`` and ``value`` of each call are appended at ``cache_pos`` and the
    query attends causally to every position written so far; ``weights``
    are then ``[N, L, max_len]``, zero past the positions seen. Writing past
    ``max_len`` is a ``ValueError`` eagerly; under ``jax.jit``, where the
    position is not known, the outputs of such a call are NaN.

    Args:
        embed_dim: features of the query and of the output.
        num_heads: heads; ``embed_dim`` must divide by it.
        dropout: dropout probability on the attention weights, in training.
        bias: whether the projections have biases.
        add_bias_kv: must be ``False`` (not built).
        add_zero_attn: must be ``False`` (not built).
        kdim: features of ``key`` (default ``embed_dim``).
        vdim: features of ``value`` (default ``embed_dim``).
        batch_first: inputs and outputs are ``[N, L, E]``.
        max_len: keep a KV cache of this many positions (``None``: no cache).
        cache_batch_size: the batch size ``N`` the cache holds.
        key: where the initial weights come from (see ``autostate.nn.random``).
        dtype: the compute dtype, and the parameters' dtype when ``param_dtype``
            is ``None`` (PyTorch's meaning).
        param_dtype: the parameters' storage dtype (Flax's meaning); given, each
            call casts the parameters and the input to ``dtype`` (mixed precision).

    Differences from PyTorch:
        ``add_bias_kv``, ``add_zero_attn`` must be ``False`` (not built); otherwise the
        arguments and call of ``torch.nn.MultiheadAttention``, plus keyword-only ``key=``
        (where the initial weights come from: an int, a JAX key or a ``KeyStream``; omitted,
        the default stream ``manual_seed`` seeds), ``dtype=`` and ``param_dtype=`` (mixed
        precision, which torch has not); no ``device=`` (JAX places arrays).

        ``max_len`` and ``cache_batch_size`` add a KV cache (states) for decoding, which
        torch leaves to the model; its arrays are no part of the PyTorch ``state_dict``.

        With ``dropout > 0`` the attention weights' dropout is a sub-model, ``attn_dropout``
        (an ``nn.Dropout`` holding its key), which ``named_modules()`` and ``modules()`` list
        after ``out_proj``; torch's layer has no such sub-model. It holds no parameter or
        buffer, so parameter and ``state_dict`` names are torch's.

    Raises:
        InvalidArgumentError: ``embed_dim`` does not divide by ``num_heads``,
            or an option that is not built.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> import autostate.nn as nn
        >>> mha = nn.MultiheadAttention(8, 2, batch_first=True, key=0)
        >>> x = jnp.ones((1, 3, 8))
        >>> out, weights = mha(x, x, x, is_causal=True)
        >>> out.shape, weights.shape
        ((1, 3, 8), (1, 3, 3))

        Decoding with a cache, one token per call:

        >>> decoder = nn.MultiheadAttention(8, 2, batch_first=True, max_len=4, key=0)
        >>> steps = [decoder(x[:, i:i + 1], x[:, i:i + 1], x[:, i:i + 1])[0] for i in range(3)]
        >>> bool(jnp.allclose(jnp.concatenate(steps, 1), out, atol=1e-5))
        True
        >>> int(decoder.cache_pos)
        3
    """

    # The cache is no part of a torch checkpoint (a non-persistent buffer).
    _torch_not_persistent = ("k_cache", "v_cache", "cache_pos")
    # One layout is built, the other is None (as torch registers it).
    in_proj_weight: Array | None
    q_proj_weight: Array | None
    k_proj_weight: Array | None
    v_proj_weight: Array | None

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        *,
        max_len: int | None = None,
        cache_batch_size: int = 1,
        key: KeyLike = None,
        dtype: Any = jnp.float32,
        param_dtype: Any = None,
    ):
        if embed_dim % num_heads:
            raise _refuse(
                f"MultiheadAttention(embed_dim={embed_dim}, num_heads={num_heads}): embed_dim must "
                "divide by num_heads.",
                "pick num_heads among the divisors of embed_dim.",
            )
        if add_bias_kv or add_zero_attn:
            raise _refuse(
                "MultiheadAttention(add_bias_kv=True / add_zero_attn=True) is not built.",
                "append the extra key/value position to `key` and `value` yourself.",
            )
        self.embed_dim = embed_dim
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        keys = jax.random.split(split_key(key), 5)
        compute = dtype
        dtype = precision(self, dtype, param_dtype)
        # torch's layout: one packed matrix, or one per input when kdim/vdim differ.
        # The layout not used is None, as torch registers it.
        if self._qkv_same_embed_dim:
            self.in_proj_weight = _xavier_uniform(keys[0], (3 * embed_dim, embed_dim), dtype)
            self.q_proj_weight = self.k_proj_weight = self.v_proj_weight = None
        else:
            self.q_proj_weight = _xavier_uniform(keys[0], (embed_dim, embed_dim), dtype)
            self.k_proj_weight = _xavier_uniform(keys[1], (embed_dim, self.kdim), dtype)
            self.v_proj_weight = _xavier_uniform(keys[2], (embed_dim, self.vdim), dtype)
            self.in_proj_weight = None
        self.in_proj_bias = jnp.zeros(3 * embed_dim, dtype) if bias else None
        self.bias_k = self.bias_v = None  # add_bias_kv is not built
        self.add_zero_attn = add_zero_attn
        self.out_proj = Linear(
            embed_dim, embed_dim, bias=bias, key=keys[3], dtype=compute, param_dtype=param_dtype
        )
        if bias:
            self.out_proj.bias = jnp.zeros(embed_dim, dtype)
        # Dropout on the attention weights, with its own key (no layer when p = 0).
        self.attn_dropout = Dropout(dropout, key=keys[4]) if dropout > 0 else None
        self.max_len = max_len
        if max_len is not None:
            # The cache holds activations: it is kept in the compute dtype.
            self.k_cache = jnp.zeros((cache_batch_size, max_len, embed_dim), self.dtype)
            self.v_cache = jnp.zeros((cache_batch_size, max_len, embed_dim), self.dtype)
            self.cache_pos = jnp.zeros((), jnp.int32)

    def forward(
        self,
        query: Array,
        key: Array,
        value: Array,
        key_padding_mask: Array | None = None,
        need_weights: bool = True,
        attn_mask: Array | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Array, Array | None]:
        batched = query.ndim == 3
        if not batched:  # one sequence: a batch of one
            query, key, value = query[None], key[None], value[None]
            key_padding_mask = None if key_padding_mask is None else key_padding_mask[None]
        elif not self.batch_first:  # [L, N, E] -> [N, L, E]
            query, key, value = (jnp.swapaxes(x, 0, 1) for x in (query, key, value))
        q, k, v = self._project(query, key, value)
        if self.max_len is None:
            bias = self._mask(q, key, key_padding_mask, attn_mask, is_causal)
        else:
            if key_padding_mask is not None or attn_mask is not None:
                raise _refuse(
                    "MultiheadAttention with a KV cache (max_len) takes no key_padding_mask or "
                    "attn_mask: it masks causally by position.",
                    "build the layer without max_len to pass masks.",
                )
            k, v, bias = self._append_to_cache(k, v, self.max_len)
        output, weights = self._attend(q, k, v, bias)
        if self.max_len is not None:  # NaN once a traced call has written past the end
            output = jnp.where(self.cache_pos > self.max_len, jnp.nan, output)
        if not batched:
            output, weights = output[0], weights[0]
        elif not self.batch_first:
            output = jnp.swapaxes(output, 0, 1)
        if not need_weights:
            return output, None
        return output, weights.mean(-3) if average_attn_weights else weights

    def _project(self, query: Array, key: Array, value: Array) -> tuple[Array, Array, Array]:
        """The input projections: ``[N, L, E]`` queries, ``[N, S, E]`` keys and values."""
        if self._qkv_same_embed_dim:
            w_q, w_k, w_v = jnp.split(cast(Array, self.in_proj_weight), 3)
        else:
            separate = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)
            w_q, w_k, w_v = cast("tuple[Array, Array, Array]", separate)
        query, key, value, w_q, w_k, w_v, in_proj_bias = promote(
            self, query, key, value, w_q, w_k, w_v, self.in_proj_bias
        )
        q, k, v = query @ w_q.T, key @ w_k.T, value @ w_v.T
        if in_proj_bias is None:
            return q, k, v
        b_q, b_k, b_v = jnp.split(in_proj_bias, 3)
        return q + b_q, k + b_k, v + b_v

    def _mask(
        self, query: Array, key: Array, key_padding_mask: Array | None, attn_mask: Array | None, is_causal: bool
    ) -> Array | None:
        """One additive mask, broadcastable to ``[N, num_heads, L, S]``, or ``None``."""
        n, length, source = query.shape[0], query.shape[1], key.shape[1]
        heads = n * self.num_heads
        _check_mask_shape("attn_mask", attn_mask, [(length, source), (heads, length, source)])
        _check_mask_shape("key_padding_mask", key_padding_mask, [(n, source)])
        if is_causal and attn_mask is None:
            attn_mask = jnp.triu(jnp.ones((length, source), jnp.bool_), 1)
        bias = _additive(attn_mask, query.dtype)
        if bias is not None and bias.ndim == 3:  # [N * num_heads, L, S]
            bias = bias.reshape(n, self.num_heads, length, source)
        padding = _additive(key_padding_mask, query.dtype)
        if padding is not None:
            padding = padding[:, None, None, :]
            bias = padding if bias is None else bias + padding
        return bias

    def _append_to_cache(self, k: Array, v: Array, max_len: int) -> tuple[Array, Array, Array]:
        """Writes ``k`` and ``v`` at ``cache_pos``; returns the caches and the causal mask over them."""
        batch, length = k.shape[:2]
        if batch != self.k_cache.shape[0]:
            raise _refuse(
                f"MultiheadAttention KV cache: the cache holds {self.k_cache.shape[0]} sequences and "
                f"this call gives {batch}.",
                f"build the layer with cache_batch_size={batch}, or call reset_cache(batch_size={batch}).",
            )
        position = self.cache_pos
        known = not isinstance(position, jax.core.Tracer)  # eagerly; under jit, NaN in forward
        if length > max_len or known and int(position) + length > max_len:
            written = int(position) if known else "some"
            raise _refuse(
                f"MultiheadAttention KV cache: {written} positions are written and this call "
                f"adds {length}, past max_len={max_len}.",
                "call reset_cache() to start a new sequence, or build the layer with a larger max_len.",
            )
        start = (jnp.zeros((), jnp.int32), position, jnp.zeros((), jnp.int32))
        self.k_cache = jax.lax.dynamic_update_slice(self.k_cache, k.astype(self.k_cache.dtype), start)
        self.v_cache = jax.lax.dynamic_update_slice(self.v_cache, v.astype(self.v_cache.dtype), start)
        self.cache_pos = position + length
        visible = jnp.arange(max_len) <= position + jnp.arange(length)[:, None]
        return self.k_cache, self.v_cache, jnp.where(visible, 0.0, -jnp.inf).astype(k.dtype)

    def _attend(self, q: Array, k: Array, v: Array, bias: Array | None) -> tuple[Array, Array]:
        """Scaled dot-product attention per head; returns the output and ``[N, heads, L, S]`` weights."""
        n, length = q.shape[:2]

        def heads(x: Array) -> Array:  # [N, T, E] -> [N, heads, T, head_dim]
            return x.reshape(x.shape[0], x.shape[1], self.num_heads, self.head_dim).swapaxes(1, 2)

        scores = (heads(q) * math.sqrt(1.0 / self.head_dim)) @ heads(k).swapaxes(-1, -2)
        if bias is not None:
            scores = scores + bias
        # The softmax in float32 at least (its sum), in the scores' dtype after.
        weights = jax.nn.softmax(scores.astype(statistics_dtype(scores)), axis=-1).astype(scores.dtype)
        if self.attn_dropout is not None:
            weights = self.attn_dropout(weights)
        attended = (weights @ heads(v)).swapaxes(1, 2).reshape(n, length, self.embed_dim)
        return self.out_proj(attended), weights

    def reset_cache(self, batch_size: int | None = None) -> None:
        """Empties the KV cache: zeros, position 0, for ``batch_size`` sequences if given.

        A cache of the same size keeps its sharding (also eagerly, on a model
        placed on a mesh); one of another batch size is made where JAX
        puts new arrays.

        Raises:
            InvalidArgumentError: the layer has no cache (built without ``max_len``).
        """
        if self.max_len is None:
            raise _refuse(
                "MultiheadAttention.reset_cache(): this layer has no KV cache.",
                "build it with max_len=... to decode with a cache.",
            )
        n = self.k_cache.shape[0] if batch_size is None else batch_size
        # zeros_like: a cache of the same shape keeps its sharding, eagerly too.
        self.k_cache = jnp.zeros_like(self.k_cache, shape=(n, *self.k_cache.shape[1:]))
        self.v_cache = jnp.zeros_like(self.v_cache, shape=(n, *self.v_cache.shape[1:]))
        self.cache_pos = jnp.zeros_like(self.cache_pos)
