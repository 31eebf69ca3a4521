"""``TransformerEncoderLayer`` and ``TransformerEncoder``, as in ``torch.nn``.

The layer is PyTorch's: self-attention (``self_attn``, a
``MultiheadAttention``) and a feed-forward block (``linear1``, the
activation, ``dropout``, ``linear2``), each added to its input after its
dropout (``dropout1``, ``dropout2``) and normalised (``norm1``, ``norm2``)
after the sum, or before the block with ``norm_first=True``. The parameter
names are PyTorch's (``self_attn.in_proj_weight``, ``linear1.weight``,
``norm2.bias``, and ``layers.0.…`` in an encoder), so a PyTorch checkpoint
loads as it is. Every sub-layer has its own default initialisation, as in
PyTorch (the layer adds none).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from autostate.errors import InvalidArgumentError, format_error
from autostate.nn.attention import MultiheadAttention
from autostate.nn.dropout import Dropout
from autostate.nn.linear import Linear
from autostate.nn.module import Module, ModuleList
from autostate.nn.normalization import LayerNorm
from autostate.nn.random import KeyLike, KeyStream, split_key

__all__ = ["TransformerEncoder", "TransformerEncoderLayer"]

Array = jax.Array


def _relu(x: Array) -> Array:
    """``torch.nn.functional.relu``: the activation ``'relu'`` names."""
    return jnp.maximum(x, 0)


def _gelu(x: Array) -> Array:
    """``torch.nn.functional.gelu``, the exact (``erf``) form: the activation ``'gelu'`` names."""
    return 0.5 * x * (1 + jax.lax.erf(x / math.sqrt(2)))


_ACTIVATIONS: dict[str, Callable[[Array], Array]] = {"relu": _relu, "gelu": _gelu}


class TransformerEncoderLayer(Module):
    """Self-attention and a feed-forward block, as ``torch.nn.TransformerEncoderLayer``.

    ``src`` is ``[S, N, E]`` (``[N, S, E]`` with ``batch_first=True``) or
    unbatched ``[S, E]``. With ``norm_first=False`` (PyTorch's default) a
    call computes ``x = norm1(x + sa(x)); x = norm2(x + ff(x))``; with
    ``norm_first=True``, ``x = x + sa(norm1(x)); x = x + ff(norm2(x))``,
    where ``sa`` is ``dropout1(self_attn(x, x, x))`` and ``ff`` is
    ``dropout2(linear2(dropout(activation(linear1(x)))))``.

    Args:
        d_model: the features ``E``.
        nhead: attention heads; ``d_model`` must divide by it.
        dim_feedforward: the feed-forward block's hidden size.
        dropout: the probability of every dropout (attention weights included).
        activation: ``'relu'``, ``'gelu'`` (exact), or a callable (a function
            or a module, such as ``nn.GELU(approximate='tanh')``).
        layer_norm_eps: ``eps`` of both norms.
        batch_first: inputs and outputs are ``[N, S, E]``.
        norm_first: normalise before each block (pre-norm) rather than after.
        bias: whether the projections, the linear layers and the norms have biases.
        key: where the initial weights and the dropout keys come from (see
            ``autostate.nn.random``).
        dtype: the compute dtype, and the parameters' dtype when ``param_dtype``
            is ``None`` (PyTorch's meaning).
        param_dtype: the parameters' storage dtype (Flax's meaning).

    A call takes ``src_mask`` (``[S, S]`` or ``[N * nhead, S, S]``) and
    ``src_key_padding_mask`` (``[N, S]``), each bool (``True`` = not
    attended) or float (added to the scores), and ``is_causal``: with a
    mask, a hint PyTorch may use in its place (the mask is what is applied
    here; give the causal mask); without one, the causal mask is applied
    (PyTorch raises there).

    Differences from PyTorch:
        The arguments of ``torch.nn.TransformerEncoderLayer``, plus keyword-only ``key=``,
        ``dtype=`` and ``param_dtype=``; no ``device=``. Each dropout (and the attention's,
        ``self_attn.attn_dropout``, when ``dropout > 0``) holds its own key, a state.

        In evaluation PyTorch may run a fused kernel (its "fast path"); the numbers are
        the same to float32 rounding.

    Examples:
        >>> import jax.numpy as jnp
        >>> import autostate.nn as nn
        >>> layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True, key=0)
        >>> layer.eval()(jnp.ones((3, 5, 8))).shape
        (3, 5, 8)
        >>> sorted(name for name, _ in layer.named_parameters())[:3]
        ['linear1.bias', 'linear1.weight', 'linear2.bias']
    """

    def __init__(
        self,
        d_model: int,
        nhead: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: str | Callable[[Array], Array] = "relu",
        layer_norm_eps: float = 1e-5,
        batch_first: bool = False,
        norm_first: bool = False,
        bias: bool = True,
        *,
        key: KeyLike = None,
        dtype: Any = jnp.float32,
        param_dtype: Any = None,
    ):
        if isinstance(activation, str):
            if activation not in _ACTIVATIONS:
                raise InvalidArgumentError(
                    format_error(
                        f"TransformerEncoderLayer(activation={activation!r}): a named "
                        "activation is 'relu' or 'gelu', as in PyTorch.",
                        fix="pass 'relu', 'gelu' or a callable (nn.GELU(approximate='tanh'), "
                        "jax.nn.silu, ...).",
                    )
                )
            activation = _ACTIVATIONS[activation]
        keys = KeyStream(split_key(key))
        precision = {"dtype": dtype, "param_dtype": param_dtype}
        self.self_attn = MultiheadAttention(
            d_model, nhead, dropout=dropout, bias=bias, batch_first=batch_first, key=keys, **precision
        )
        self.linear1 = Linear(d_model, dim_feedforward, bias=bias, key=keys, **precision)
        self.dropout = Dropout(dropout, key=keys)
        self.linear2 = Linear(dim_feedforward, d_model, bias=bias, key=keys, **precision)
        self.norm_first = norm_first
        self.norm1 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **precision)
        self.norm2 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **precision)
        self.dropout1 = Dropout(dropout, key=keys)
        self.dropout2 = Dropout(dropout, key=keys)
        self.activation = activation

    def forward(
        self,
        src: Array,
        src_mask: Array | None = None,
        src_key_padding_mask: Array | None = None,
        is_causal: bool = False,
    ) -> Array:
        x = src
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), src_mask, src_key_padding_mask, is_causal)
            return x + self._ff_block(self.norm2(x))
        x = self.norm1(x + self._sa_block(x, src_mask, src_key_padding_mask, is_causal))
        return self.norm2(x + self._ff_block(x))

    def _sa_block(
        self, x: Array, mask: Array | None, padding: Array | None, is_causal: bool
    ) -> Array:
        out, _ = self.self_attn(
            x,
            x,
            x,
            attn_mask=mask,
            key_padding_mask=padding,
            need_weights=False,
            is_causal=is_causal,
        )
        return self.dropout1(out)

    def _ff_block(self, x: Array) -> Array:
        x = self.linear2(self.dropout(self.activation(self.linear1(x))))
        return self.dropout2(x)


class TransformerEncoder(Module):
    """``num_layers`` copies of an encoder layer, called in turn, then an
    optional ``norm``, as ``torch.nn.TransformerEncoder``.

    The layers are deep copies of ``encoder_layer`` (as PyTorch's): they
    start with its parameters and are trained apart. Each copy's dropout
    layers get new keys from ``key``, so no two layers draw the same masks
    (PyTorch's layers draw from one global generator).

    Args:
        encoder_layer: the layer to copy (a ``TransformerEncoderLayer``, or
            any module taking ``(src, src_mask=, src_key_padding_mask=,
            is_causal=)``).
        num_layers: how many copies.
        norm: a module applied to the last layer's output, or ``None``.
        enable_nested_tensor: accepted for PyTorch's signature (see below).
        mask_check: accepted for PyTorch's signature.
        key: where the copies' dropout keys come from (see ``autostate.nn.random``).

    A call takes ``mask`` (the layers' ``src_mask``), ``src_key_padding_mask``
    and ``is_causal`` (``None`` is ``False``: the mask given is applied, so
    PyTorch's detection of a causal mask changes nothing).

    Differences from PyTorch:
        The arguments of ``torch.nn.TransformerEncoder``, plus keyword-only ``key=``. The
        layers are a ``ModuleList``, named ``layers.0.self_attn.in_proj_weight`` as in
        PyTorch.

        Outputs at the positions ``src_key_padding_mask`` pads: PyTorch's evaluation fast
        path (nested tensors: ``batch_first`` layers, no ``mask``, no gradient recorded)
        returns zeros there (before ``norm``), its other paths the computed values; here
        they are always the computed values. Every other output is PyTorch's.

    Examples:
        >>> import jax.numpy as jnp
        >>> import autostate.nn as nn
        >>> layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, key=0)
        >>> encoder = nn.TransformerEncoder(layer, num_layers=2, norm=nn.LayerNorm(8), key=1)
        >>> encoder.eval()(jnp.ones((5, 3, 8))).shape
        (5, 3, 8)
        >>> bool((encoder.layers[0].linear1.weight == encoder.layers[1].linear1.weight).all())
        True
        >>> list(nn.torch_state_dict(encoder))[0]
        'layers.0.self_attn.in_proj_weight'
    """

    def __init__(
        self,
        encoder_layer: Any,
        num_layers: int,
        norm: Any = None,
        enable_nested_tensor: bool = True,
        mask_check: bool = True,
        *,
        key: KeyLike = None,
    ):
        keys = KeyStream(split_key(key))
        layers = []
        for _ in range(num_layers):
            layer = copy.deepcopy(encoder_layer)
            for module in layer.modules():
                if isinstance(module, Dropout):
                    module.key = keys.next()
            layers.append(layer)
        self.layers = ModuleList(layers)
        self.num_layers = num_layers
        self.norm = norm
        self.enable_nested_tensor = enable_nested_tensor
        self.mask_check = mask_check

    def forward(
        self,
        src: Array,
        mask: Array | None = None,
        src_key_padding_mask: Array | None = None,
        is_causal: bool | None = None,
    ) -> Array:
        output = src
        for layer in self.layers:
            output = layer(
                output,
                src_mask=mask,
                src_key_padding_mask=src_key_padding_mask,
                is_causal=bool(is_causal),
            )
        if self.norm is not None:
            output = self.norm(output)
        return output
