"""The input shapes the layers take: channels first, with or without a batch axis."""

from __future__ import annotations

import jax

from autostate.errors import InvalidArgumentError, format_error

_SPATIAL = {1: "L", 2: "H, W", 3: "D, H, W"}


def with_batch_axis(x: jax.Array, n: int, layer: object) -> tuple[jax.Array, bool]:
    """``x`` as ``[N, C, *spatial]`` (``n`` spatial axes), and whether it had the
    batch axis: PyTorch takes an unbatched ``[C, *spatial]`` input too."""
    if x.ndim == n + 2:
        return x, True
    if x.ndim == n + 1:
        return x[None], False
    spatial = _SPATIAL.get(n, "...")
    raise InvalidArgumentError(
        format_error(
            f"{type(layer).__name__} expects a {n + 1}-d (unbatched) or {n + 2}-d (batched) "
            f"input [N, C, {spatial}], got shape {tuple(x.shape)}.",
            fix=f"pass [C, {spatial}] or [N, C, {spatial}].",
        )
    )
