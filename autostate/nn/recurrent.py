"""Recurrent layers with PyTorch's semantics: ``LSTMCell``, ``GRUCell``, ``LSTM``, ``GRU``.

Parameters carry torch's names and layouts (``weight_ih_l0`` is
``[gates * hidden_size, input_size]``, gate order ``i, f, g, o`` for the LSTM
and ``r, z, n`` for the GRU, ``_reverse`` for the backward direction), so a
torch ``state_dict`` copies over without transposes, and the default
initialisation is torch's: every weight and bias uniform in
``±1/sqrt(hidden_size)``.

A sequence runs as one ``jax.lax.scan`` per layer and direction, written
plainly inside ``forward`` (``model(x)`` calls it, as in torch).

**State carried between calls.** With ``carry_state=True`` a layer keeps its
last hidden state (``h``, plus ``c`` for the LSTM) as state: a call without
``hx`` starts from it (zeros before the first call and after
``reset_state()``) and writes the new one back. It is the plain-Python
reading (``self.h = h_n``), so it holds eagerly, through
``model.functionalize()`` (the states carry ``h``) and after
``autostate.freeze``. The state starts as ``None``: the first call inside
``f`` gives it an array and the next call retraces once with it. Inside a
``lax`` loop body a state keeps its shape, so give it its array before the
loop: one call, or ``hx`` for the first call, outside it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from autostate.errors import InvalidArgumentError, format_error
from autostate.nn._init import uniform
from autostate.nn._precision import precision, promote
from autostate.nn.dropout import Dropout
from autostate.nn.module import Module
from autostate.nn.random import KeyLike, split_key

__all__ = ["GRU", "LSTM", "GRUCell", "LSTMCell", "gru_step", "lstm_step"]

Array = jax.Array


def _linear(x: Array, weight: Array, bias: Array | None) -> Array:
    y = x @ weight.T
    return y if bias is None else y + bias


def lstm_step(
    x: Array, h: Array, c: Array, weight_ih: Array, weight_hh: Array, bias_ih: Array | None, bias_hh: Array | None
) -> tuple[Array, Array]:
    """One LSTM step in torch's gate order ``i, f, g, o``; returns ``(h, c)``."""
    gates = _linear(x, weight_ih, bias_ih) + _linear(h, weight_hh, bias_hh)
    i, f, g, o = jnp.split(gates, 4, axis=-1)
    c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
    return jax.nn.sigmoid(o) * jnp.tanh(c), c


def gru_step(
    x: Array, h: Array, weight_ih: Array, weight_hh: Array, bias_ih: Array | None, bias_hh: Array | None
) -> Array:
    """One GRU step in torch's gate order ``r, z, n``; returns ``h``."""
    x_r, x_z, x_n = jnp.split(_linear(x, weight_ih, bias_ih), 3, axis=-1)
    h_r, h_z, h_n = jnp.split(_linear(h, weight_hh, bias_hh), 3, axis=-1)
    r = jax.nn.sigmoid(x_r + h_r)
    z = jax.nn.sigmoid(x_z + h_z)
    n = jnp.tanh(x_n + r * h_n)
    return (1 - z) * n + z * h


def _check_carried(layer: object, carried: Array | None, expected: tuple[int, ...]) -> Array:
    """The carried hidden state, if it fits this call's input."""
    if carried is None or carried.shape != expected:
        shape = None if carried is None else carried.shape
        raise InvalidArgumentError(
            format_error(
                f"{type(layer).__name__}: the carried hidden state has shape {shape}, but this input "
                f"needs {expected} (a batch of another size?).",
                fix="call reset_state() before a batch of another size, or pass hx explicitly.",
            )
        )
    return carried


class LSTMCell(Module):
    """One LSTM step, as ``torch.nn.LSTMCell``.

    Args:
        input_size: features of the input.
        hidden_size: features of ``h`` and ``c``.
        bias: whether the cell has ``bias_ih`` and ``bias_hh``.
        carry_state: keep ``(h, c)`` as state and start the next call
            without ``hx`` from it (see the module docstring).
        key: where the initial weights come from (see ``autostate.nn.random``).
        dtype: the compute dtype, and the parameters' dtype when ``param_dtype``
            is ``None`` (PyTorch's meaning).
        param_dtype: the parameters' storage dtype (Flax's meaning); given, each
            call casts the parameters and the input to ``dtype`` (mixed precision).

    Differences from PyTorch:
        The arguments and call of ``torch.nn.LSTMCell``, plus keyword-only ``key=`` (where
        the initial weights come from: an int, a JAX key or a ``KeyStream``; omitted, the
        default stream ``manual_seed`` seeds), ``dtype=`` and ``param_dtype=`` (mixed
        precision, which torch has not); no ``device=`` (JAX places arrays).

        ``carry_state=True`` keeps ``(h, c)`` as states for the next call.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> cell = LSTMCell(3, 4, key=jax.random.key(0))
        >>> h, c = cell(jnp.ones((2, 3)))
        >>> h.shape, cell.weight_ih.shape
        ((2, 4), (16, 3))
    """

    # The carried state is no part of a torch checkpoint (a non-persistent buffer).
    _torch_not_persistent = ("h", "c")

    def __init__(
        self, input_size: int, hidden_size: int, bias: bool = True, *, carry_state: bool = False, key: KeyLike = None,
        dtype: Any = jnp.float32,
        param_dtype: Any = None,
    ) -> None:
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.bias = bias
        self.carry_state = carry_state
        bound = 1 / math.sqrt(hidden_size)
        k_ih, k_hh, k_bih, k_bhh = jax.random.split(split_key(key), 4)
        dtype = precision(self, dtype, param_dtype)
        self.weight_ih = uniform(k_ih, (4 * hidden_size, input_size), bound, dtype)
        self.weight_hh = uniform(k_hh, (4 * hidden_size, hidden_size), bound, dtype)
        self.bias_ih = uniform(k_bih, (4 * hidden_size,), bound, dtype) if bias else None
        self.bias_hh = uniform(k_bhh, (4 * hidden_size,), bound, dtype) if bias else None
        self.h: Array | None = None
        self.c: Array | None = None

    def forward(self, input: Array, hx: tuple[Array, Array] | None = None) -> tuple[Array, Array]:
        """Returns ``(h, c)`` after one step; ``input`` is ``[batch, input_size]`` or ``[input_size]``."""
        if hx is None:
            shape = (*input.shape[:-1], self.hidden_size)
            if self.carry_state and self.h is not None:
                hx = (_check_carried(self, self.h, shape), _check_carried(self, self.c, shape))
            else:
                hx = (jnp.zeros(shape, input.dtype), jnp.zeros(shape, input.dtype))
        h, c = lstm_step(
            *promote(self, input, hx[0], hx[1], self.weight_ih, self.weight_hh, self.bias_ih, self.bias_hh)
        )
        if self.carry_state:
            self.h, self.c = h, c
        return h, c


    def reset_state(self) -> None:
        """Forgets the carried ``(h, c)``: the next call starts from zeros."""
        self.h = None
        self.c = None


class GRUCell(Module):
    """One GRU step, as ``torch.nn.GRUCell``.

    Args:
        input_size: features of the input.
        hidden_size: features of ``h``.
        bias: whether the cell has ``bias_ih`` and ``bias_hh``.
        carry_state: keep ``h`` as state and start the next call without
            ``hx`` from it (see the module docstring).
        key: where the initial weights come from (see ``autostate.nn.random``).
        dtype: the compute dtype, and the parameters' dtype when ``param_dtype``
            is ``None`` (PyTorch's meaning).
        param_dtype: the parameters' storage dtype (Flax's meaning); given, each
            call casts the parameters and the input to ``dtype`` (mixed precision).

    Differences from PyTorch:
        The arguments and call of ``torch.nn.GRUCell``, plus keyword-only ``key=`` (where
        the initial weights come from: an int, a JAX key or a ``KeyStream``; omitted, the
        default stream ``manual_seed`` seeds), ``dtype=`` and ``param_dtype=`` (mixed
        precision, which torch has not); no ``device=`` (JAX places arrays).

        ``carry_state=True`` keeps ``h`` as a state for the next call.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> cell = GRUCell(3, 4, carry_state=True, key=jax.random.key(0))
        >>> h = cell(jnp.ones(3))
        >>> bool((cell(jnp.ones(3)) != h).any())  # the second step starts from h
        True
    """

    # The carried state is no part of a torch checkpoint (a non-persistent buffer).
    _torch_not_persistent = ("h",)

    def __init__(
        self, input_size: int, hidden_size: int, bias: bool = True, *, carry_state: bool = False, key: KeyLike = None,
        dtype: Any = jnp.float32,
        param_dtype: Any = None,
    ) -> None:
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.bias = bias
        self.carry_state = carry_state
        bound = 1 / math.sqrt(hidden_size)
        k_ih, k_hh, k_bih, k_bhh = jax.random.split(split_key(key), 4)
        dtype = precision(self, dtype, param_dtype)
        self.weight_ih = uniform(k_ih, (3 * hidden_size, input_size), bound, dtype)
        self.weight_hh = uniform(k_hh, (3 * hidden_size, hidden_size), bound, dtype)
        self.bias_ih = uniform(k_bih, (3 * hidden_size,), bound, dtype) if bias else None
        self.bias_hh = uniform(k_bhh, (3 * hidden_size,), bound, dtype) if bias else None
        self.h: Array | None = None

    def forward(self, input: Array, hx: Array | None = None) -> Array:
        """Returns ``h`` after one step; ``input`` is ``[batch, input_size]`` or ``[input_size]``."""
        if hx is None:
            shape = (*input.shape[:-1], self.hidden_size)
            if self.carry_state and self.h is not None:
                hx = _check_carried(self, self.h, shape)
            else:
                hx = jnp.zeros(shape, input.dtype)
        h = gru_step(*promote(self, input, hx, self.weight_ih, self.weight_hh, self.bias_ih, self.bias_hh))
        if self.carry_state:
            self.h = h
        return h


    def reset_state(self) -> None:
        """Forgets the carried ``h``: the next call starts from zeros."""
        self.h = None


def _init_layers(
    layer: Any,
    gates: int,
    input_size: int,
    hidden_size: int,
    num_layers: int,
    bias: bool,
    bidirectional: bool,
    key: Array,
    dtype: Any,
) -> None:
    """Sets torch's per-layer parameters (``weight_ih_l0``, ``bias_hh_l1_reverse``, ...) on ``layer``."""
    bound = 1 / math.sqrt(hidden_size)
    directions = 2 if bidirectional else 1
    for number in range(num_layers):
        layer_input = input_size if number == 0 else hidden_size * directions
        shapes = {
            "weight_ih": (gates * hidden_size, layer_input),
            "weight_hh": (gates * hidden_size, hidden_size),
            "bias_ih": (gates * hidden_size,),
            "bias_hh": (gates * hidden_size,),
        }
        for suffix in ("", "_reverse")[:directions]:
            for name, shape in shapes.items():
                key, draw = jax.random.split(key)
                if bias or name.startswith("weight"):
                    setattr(layer, f"{name}_l{number}{suffix}", uniform(draw, shape, bound, dtype))


def _suffixes(layer: Any) -> tuple[str, ...]:
    """The parameter-name suffix of each direction: ``("",)`` or ``("", "_reverse")``."""
    return ("", "_reverse") if layer.bidirectional else ("",)


def _layer_weights(layer: Any, number: int, suffix: str) -> tuple[Array, Array, Array | None, Array | None]:
    """``(weight_ih, weight_hh, bias_ih, bias_hh)`` of one layer and direction (biases ``None`` without bias)."""
    names = (f"weight_ih_l{number}", f"weight_hh_l{number}", f"bias_ih_l{number}", f"bias_hh_l{number}")
    return tuple(getattr(layer, name + suffix, None) for name in names)  # type: ignore[return-value]


def _time_major(input: Array, batch_first: bool) -> tuple[Array, Callable[[Array], Array]]:
    """``input`` as ``[seq, batch, features]``, and the function that puts an output back in its layout."""
    if input.ndim == 2:  # unbatched [seq, features]
        return input[:, None], lambda y: y[:, 0]
    if input.ndim != 3:
        raise ValueError(f"expected a [seq, batch, features] or [seq, features] input, got shape {input.shape}")
    if batch_first:
        return jnp.swapaxes(input, 0, 1), lambda y: jnp.swapaxes(y, 0, 1)
    return input, lambda y: y


def _state_shape(layer: Any, input: Array) -> tuple[int, ...]:
    """The shape of ``h_0`` / ``h_n`` for ``input``, in the caller's layout."""
    batch = () if input.ndim == 2 else (input.shape[0 if layer.batch_first else 1],)
    return (layer.num_layers * len(_suffixes(layer)), *batch, layer.hidden_size)


def _stack_states(states: list[Array], input_ndim: int) -> Array:
    """Per-layer-and-direction ``[batch, hidden]`` states as torch's ``h_n`` (no batch axis when unbatched)."""
    stacked = jnp.stack(states)
    return stacked if input_ndim == 3 else stacked[:, 0]


def _check_proj_size(proj_size: int) -> None:
    if proj_size:
        raise InvalidArgumentError(
            format_error(
                f"autostate.nn.LSTM(proj_size={proj_size}): projections of h are not built.",
                fix="apply an autostate.nn.Linear to the output instead (its h_n is then not projected).",
            )
        )


class LSTM(Module):
    """A multi-layer LSTM over a sequence, as ``torch.nn.LSTM``.

    ``input`` is ``[seq, batch, input_size]`` (``[batch, seq, input_size]``
    with ``batch_first=True``) or unbatched ``[seq, input_size]``; ``hx`` is
    ``(h_0, c_0)``, each ``[num_layers * directions, batch, hidden_size]``
    (no batch axis when unbatched). A call returns ``(output, (h_n, c_n))``
    with ``output`` ``[seq, batch, directions * hidden_size]``.

    Args:
        input_size: features of the input.
        hidden_size: features of ``h`` and ``c``.
        num_layers: stacked layers; layer ``k > 0`` reads layer ``k - 1``'s output.
        bias: whether each layer has ``bias_ih_l<k>`` and ``bias_hh_l<k>``.
        batch_first: inputs and outputs are ``[batch, seq, feature]``.
        dropout: dropout probability on each layer's output but the last's, in training.
        bidirectional: add a backward direction (``..._reverse`` parameters).
        proj_size: must be 0 (projections are not built).
        carry_state: keep ``(h_n, c_n)`` as state and start the next call
            without ``hx`` from it (see the module docstring).
        key: where the initial weights come from (see ``autostate.nn.random``).
        dtype: the compute dtype, and the parameters' dtype when ``param_dtype``
            is ``None`` (PyTorch's meaning).
        param_dtype: the parameters' storage dtype (Flax's meaning); given, each
            call casts the parameters and the input to ``dtype`` (mixed precision).

    Differences from PyTorch:
        ``proj_size`` must be 0 (not built); otherwise the arguments and call of
        ``torch.nn.LSTM``, plus keyword-only ``key=`` (where the initial weights come from:
        an int, a JAX key or a ``KeyStream``; omitted, the default stream ``manual_seed``
        seeds), ``dtype=`` and ``param_dtype=`` (mixed precision, which torch has not);
        no ``device=`` (JAX places arrays).

        ``carry_state=True`` keeps ``(h_n, c_n)`` as states for the next call (a
        stateful RNN), which torch leaves to the caller; they are no part of the PyTorch
        ``state_dict``.

        With ``dropout > 0`` the dropout between layers is a sub-model,
        ``inter_layer_dropout`` (an ``nn.Dropout`` holding its key), which
        ``named_modules()`` and ``modules()`` list; torch's layer has none. It holds no
        parameter or buffer, so parameter and ``state_dict`` names are torch's.

    Raises:
        InvalidArgumentError: for ``proj_size > 0`` (not built).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> lstm = LSTM(3, 4, num_layers=2, key=jax.random.key(0))
        >>> output, (h_n, c_n) = lstm(jnp.ones((5, 2, 3)))
        >>> output.shape, h_n.shape, lstm.weight_ih_l1.shape
        ((5, 2, 4), (2, 2, 4), (16, 4))
    """

    # The carried state is no part of a torch checkpoint (a non-persistent buffer).
    _torch_not_persistent = ("h", "c")

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        proj_size: int = 0,
        *,
        carry_state: bool = False,
        key: KeyLike = None,
        dtype: Any = jnp.float32,
        param_dtype: Any = None,
    ) -> None:
        _check_proj_size(proj_size)
        self.mode = "LSTM"
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.bias = bias
        self.batch_first = batch_first
        self.dropout = dropout
        self.bidirectional = bidirectional
        self.proj_size = proj_size
        self.carry_state = carry_state
        init_key, dropout_key = jax.random.split(split_key(key))
        dtype = precision(self, dtype, param_dtype)
        _init_layers(self, 4, input_size, hidden_size, num_layers, bias, bidirectional, init_key, dtype)
        # Dropout on each layer's output but the last's, in training (no layer when p = 0).
        self.inter_layer_dropout = Dropout(dropout, key=dropout_key) if dropout > 0 else None
        self.h: Array | None = None
        self.c: Array | None = None

    def forward(self, input: Array, hx: tuple[Array, Array] | None = None) -> tuple[Array, tuple[Array, Array]]:
        """Runs the sequence; returns ``(output, (h_n, c_n))`` as torch does."""
        x, restore = _time_major(input, self.batch_first)
        if hx is None:
            shape = _state_shape(self, input)
            if self.carry_state and self.h is not None:
                hx = (_check_carried(self, self.h, shape), _check_carried(self, self.c, shape))
            else:
                hx = (jnp.zeros(shape, x.dtype), jnp.zeros(shape, x.dtype))
        x, h_0, c_0 = promote(self, x, *hx)
        h_0, c_0 = (h if input.ndim == 3 else h[:, None] for h in (h_0, c_0))
        h_n, c_n = [], []
        for number in range(self.num_layers):
            outputs = []
            for direction, suffix in enumerate(_suffixes(self)):
                weights = promote(self, *_layer_weights(self, number, suffix))

                def step(carry: tuple[Array, Array], x_t: Array) -> tuple[tuple[Array, Array], Array]:
                    h, c = lstm_step(x_t, carry[0], carry[1], *weights)  # noqa: B023 (scanned in this iteration)
                    return (h, c), h

                index = number * len(_suffixes(self)) + direction
                (h, c), ys = jax.lax.scan(step, (h_0[index], c_0[index]), x, reverse=direction == 1)
                outputs.append(ys)
                h_n.append(h)
                c_n.append(c)
            x = jnp.concatenate(outputs, axis=-1)
            if self.inter_layer_dropout is not None and number < self.num_layers - 1:
                x = self.inter_layer_dropout(x)
        final = (_stack_states(h_n, input.ndim), _stack_states(c_n, input.ndim))
        if self.carry_state:
            self.h, self.c = final
        return restore(x), final


    def reset_state(self) -> None:
        """Forgets the carried ``(h_n, c_n)``: the next call starts from zeros."""
        self.h = None
        self.c = None

    def flatten_parameters(self) -> None:
        """Does nothing, as torch's does off cuDNN: ported code calls it before a
        call, and the weights are already the arrays a call reads."""


class GRU(Module):
    """A multi-layer GRU over a sequence, as ``torch.nn.GRU``.

    Shapes as ``LSTM``'s, with ``hx`` a single ``h_0``; a call returns
    ``(output, h_n)``.

    Args:
        input_size: features of the input.
        hidden_size: features of ``h``.
        num_layers: stacked layers; layer ``k > 0`` reads layer ``k - 1``'s output.
        bias: whether each layer has ``bias_ih_l<k>`` and ``bias_hh_l<k>``.
        batch_first: inputs and outputs are ``[batch, seq, feature]``.
        dropout: dropout probability on each layer's output but the last's, in training.
        bidirectional: add a backward direction (``..._reverse`` parameters).
        carry_state: keep ``h_n`` as state and start the next call without
            ``hx`` from it (see the module docstring).
        key: where the initial weights come from (see ``autostate.nn.random``).
        dtype: the compute dtype, and the parameters' dtype when ``param_dtype``
            is ``None`` (PyTorch's meaning).
        param_dtype: the parameters' storage dtype (Flax's meaning); given, each
            call casts the parameters and the input to ``dtype`` (mixed precision).

    Differences from PyTorch:
        The arguments and call of ``torch.nn.GRU``, plus keyword-only ``key=`` (where the
        initial weights come from: an int, a JAX key or a ``KeyStream``; omitted, the
        default stream ``manual_seed`` seeds), ``dtype=`` and ``param_dtype=`` (mixed
        precision, which torch has not); no ``device=`` (JAX places arrays).

        ``carry_state=True`` keeps ``h_n`` as a state for the next call.

        With ``dropout > 0`` the dropout between layers is a sub-model,
        ``inter_layer_dropout`` (an ``nn.Dropout`` holding its key), which
        ``named_modules()`` and ``modules()`` list; torch's layer has none. It holds no
        parameter or buffer, so parameter and ``state_dict`` names are torch's.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> gru = GRU(3, 4, batch_first=True, carry_state=True, key=jax.random.key(0))
        >>> output, h_n = gru(jnp.ones((2, 5, 3)))
        >>> output.shape, gru.h.shape
        ((2, 5, 4), (1, 2, 4))
        >>> gru.reset_state(); print(gru.h)
        None
    """

    # The carried state is no part of a torch checkpoint (a non-persistent buffer).
    _torch_not_persistent = ("h",)

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        *,
        carry_state: bool = False,
        key: KeyLike = None,
        dtype: Any = jnp.float32,
        param_dtype: Any = None,
    ) -> None:
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.bias = bias
        self.batch_first = batch_first
        self.dropout = dropout
        self.bidirectional = bidirectional
        self.proj_size = 0
        self.mode = "GRU"
        self.carry_state = carry_state
        init_key, dropout_key = jax.random.split(split_key(key))
        dtype = precision(self, dtype, param_dtype)
        _init_layers(self, 3, input_size, hidden_size, num_layers, bias, bidirectional, init_key, dtype)
        # Dropout on each layer's output but the last's, in training (no layer when p = 0).
        self.inter_layer_dropout = Dropout(dropout, key=dropout_key) if dropout > 0 else None
        self.h: Array | None = None

    def forward(self, input: Array, hx: Array | None = None) -> tuple[Array, Array]:
        """Runs the sequence; returns ``(output, h_n)`` as torch does."""
        x, restore = _time_major(input, self.batch_first)
        if hx is None:
            shape = _state_shape(self, input)
            if self.carry_state and self.h is not None:
                hx = _check_carried(self, self.h, shape)
            else:
                hx = jnp.zeros(shape, x.dtype)
        x, hx = promote(self, x, hx)
        h_0 = hx if input.ndim == 3 else hx[:, None]
        h_n = []
        for number in range(self.num_layers):
            outputs = []
            for direction, suffix in enumerate(_suffixes(self)):
                weights = promote(self, *_layer_weights(self, number, suffix))

                def step(h: Array, x_t: Array) -> tuple[Array, Array]:
                    h = gru_step(x_t, h, *weights)  # noqa: B023 (scanned in this iteration)
                    return h, h

                index = number * len(_suffixes(self)) + direction
                h, ys = jax.lax.scan(step, h_0[index], x, reverse=direction == 1)
                outputs.append(ys)
                h_n.append(h)
            x = jnp.concatenate(outputs, axis=-1)
            if self.inter_layer_dropout is not None and number < self.num_layers - 1:
                x = self.inter_layer_dropout(x)
        final = _stack_states(h_n, input.ndim)
        if self.carry_state:
            self.h = final
        return restore(x), final


    def reset_state(self) -> None:
        """Forgets the carried ``h_n``: the next call starts from zeros."""
        self.h = None

    def flatten_parameters(self) -> None:
        """Does nothing, as torch's does off cuDNN: ported code calls it before a
        call, and the weights are already the arrays a call reads."""
