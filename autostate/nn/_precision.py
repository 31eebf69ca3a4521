"""Mixed precision: a layer's compute dtype (``dtype``) and storage dtype (``param_dtype``).

``dtype`` alone keeps PyTorch's meaning: the parameters' dtype, and the
layer computes with whatever ``jnp`` promotion gives. Given ``param_dtype``
(Flax's meaning), parameters and buffers are stored in ``param_dtype`` and
each call casts them and its inputs to ``dtype``, so the output is in
``dtype``. Normalisation statistics are computed in float32 at least.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from autostate.errors import InvalidArgumentError, format_error


def precision(layer: Any, dtype: Any, param_dtype: Any) -> Any:
    """Records ``dtype`` and ``param_dtype`` on ``layer``; returns the storage dtype.

    ``dtype=None`` is float32; ``param_dtype=None`` stores in ``dtype`` and casts nothing.
    """
    layer.dtype = _floating(type(layer).__name__, "dtype", jnp.float32 if dtype is None else dtype)
    layer.param_dtype = None if param_dtype is None else _floating(type(layer).__name__, "param_dtype", param_dtype)
    return layer.dtype if layer.param_dtype is None else layer.param_dtype


def _floating(layer: str, name: str, value: Any) -> Any:
    """``value`` as a floating dtype, or a clear error."""
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise InvalidArgumentError(
            format_error(
                f"{layer}({name}={value!r}): {name} must be a floating dtype.",
                fix=f"pass e.g. {name}=jnp.float32 or jnp.bfloat16.",
            )
        )
    return dtype


def promote(layer: Any, *arrays: Any) -> tuple[Any, ...]:
    """``arrays`` cast to ``layer.dtype`` when the layer has a ``param_dtype`` (``None`` stays ``None``)."""
    if getattr(layer, "param_dtype", None) is None:
        return arrays
    return tuple(None if a is None else jnp.asarray(a, layer.dtype) for a in arrays)


def statistics_dtype(x: jax.Array) -> Any:
    """The dtype normalisation statistics of ``x`` are computed in: float32 at least."""
    return jnp.promote_types(x.dtype, jnp.float32)
