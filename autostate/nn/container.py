"""``Sequential``: layers called one after another."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Self

from autostate.nn.module import Module

__all__ = ["Sequential"]


class Sequential(Module):
    """Calls its layers in order, each on the previous one's output, as
    ``torch.nn.Sequential``.

    The layers live in the list ``layers``, so the state and parameter paths
    are ``layers[0].weight`` where PyTorch writes ``0.weight``. The model
    indexes (a slice gives a ``Sequential`` of the same layer objects),
    has a length, iterates over its layers and changes as PyTorch's does:
    ``append``, ``extend``, ``insert``, ``pop``, ``seq[i] = layer``,
    ``del seq[i]``, ``+`` and ``*``.

    Args:
        *layers: callables, usually models.

    Differences from PyTorch:
        The layers live in the list ``layers``: autostate's paths are
        ``layers[0].weight`` where torch writes ``0.weight`` (``nn.torch_state_dict``
        writes torch's names). An ``OrderedDict`` of named layers is not taken.
        A slice numbers its layers from 0 (``seq[1:]`` lists ``0.weight``), where
        torch's slice keeps the layers' names (``1.weight``).

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
        return self.layers[_index(self, index)]

    def __setitem__(self, index: int, layer: Callable[..., Any]) -> None:
        layers = list(self.layers)
        layers[_index(self, index)] = layer
        _set_layers(self, layers)

    def __delitem__(self, index: int | slice) -> None:
        layers = list(self.layers)
        del layers[index if isinstance(index, slice) else _index(self, index)]
        _set_layers(self, layers)

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.layers)

    def __add__(self, other: Sequential) -> Sequential:
        return Sequential(*self.layers, *other)

    def __iadd__(self, other: Iterable[Any]) -> Self:
        return self.extend(other)

    def __mul__(self, times: int) -> Sequential:
        return Sequential(*(list(self.layers) * _times(times)))

    __rmul__ = __mul__

    def __imul__(self, times: int) -> Self:
        _set_layers(self, list(self.layers) * _times(times))
        return self

    def append(self, layer: Callable[..., Any]) -> Self:
        """Adds ``layer`` at the end; returns the model."""
        _set_layers(self, [*self.layers, layer])
        return self

    def extend(self, layers: Iterable[Any]) -> Self:
        """Adds ``layers`` at the end; returns the model."""
        _set_layers(self, [*self.layers, *layers])
        return self

    def insert(self, index: int, layer: Callable[..., Any]) -> Self:
        """Inserts ``layer`` before ``index`` (``-len`` to ``len``); returns the model."""
        size = len(self.layers)
        if not isinstance(index, int) or not -size <= index <= size:
            raise IndexError(f"index {index!r} is out of range for Sequential of {size}")
        layers = list(self.layers)
        layers.insert(index % (size + 1) if index < 0 else index, layer)
        _set_layers(self, layers)
        return self

    def pop(self, index: int | slice) -> Any:
        """Removes and returns the layer at ``index`` (a ``Sequential`` for a slice)."""
        layer = self[index]
        del self[index]
        return layer


# Plain functions (nothing here is rewritten), as ModuleList's.


def _set_layers(model: Sequential, layers: list[Any]) -> None:
    model.layers = layers


def _index(model: Sequential, index: Any) -> int:
    size = len(model.layers)
    if not isinstance(index, int) or not -size <= index < size:
        raise IndexError(f"index {index!r} is out of range for Sequential of {size}")
    return index % size


def _times(times: Any) -> int:
    if not isinstance(times, int) or isinstance(times, bool) or times < 1:
        raise ValueError(f"a Sequential repeats a positive int of times, got {times!r}")
    return times
