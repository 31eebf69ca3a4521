"""``Sequential``: layers called one after another."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from autostate.nn.module import Module

__all__ = ["Sequential"]


class Sequential(Module):
    """Calls its layers in order, each on the previous one's output, as
    ``torch.nn.Sequential``.

    The layers live in the list ``layers``, so the state and parameter paths
    are ``layers[0].weight`` where PyTorch writes ``0.weight``. The model
    indexes (a slice gives a ``Sequential`` of the same layer objects),
    has a length and iterates over its layers.

    Args:
        *layers: callables, usually models.

    Differences from PyTorch:
        The layers live in the list ``layers``: autostate's paths are
        ``layers[0].weight`` where torch writes ``0.weight`` (``nn.torch_state_dict``
        writes torch's names). An ``OrderedDict`` of named layers is not taken.

    Examples:
        >>> import jax.numpy as jnp
        >>> import autostate.nn as nn
        >>> net = nn.Sequential(nn.Linear(3, 4, key=0), nn.ReLU(), nn.Linear(4, 1, key=1))
        >>> len(net), net[0].weight.shape, net(jnp.ones((2, 3))).shape
        (3, (4, 3), (2, 1))
        >>> import autostate
        >>> sorted(autostate.param_dict(net))
        ['layers[0].bias', 'layers[0].weight', 'layers[2].bias', 'layers[2].weight']
    """

    # PyTorch numbers the layers directly under the Sequential (``0.weight``):
    # ``load_torch_state_dict`` / ``torch_state_dict`` leave this attribute out.
    _torch_children = "layers"

    def __init__(self, *layers: Callable[..., Any]):
        self.layers = list(layers)

    def forward(self, x: Any) -> Any:
        for layer in self.layers:
            x = layer(x)
        return x

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return Sequential(*self.layers[index])
        return self.layers[index]

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.layers)
