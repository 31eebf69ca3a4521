"""``Sequential``: layers called one after another."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Self

from autostate.errors import InvalidArgumentError, format_error
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
        writes torch's names). Layers with names (an ``OrderedDict``, ``add_module``,
        a slice, which keeps its layers' names as torch's does) are in the list too
        (``layers[0].weight``), and torch's names use theirs (``conv0.weight``).

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
    layers: list[Any]
    # torch's names of the layers when they are not 0, 1, ... (an OrderedDict's).
    _torch_names: tuple[str, ...] | None

    def __init__(self, *layers: Any):
        if len(layers) == 1 and isinstance(layers[0], Mapping):  # an OrderedDict of named layers
            _set_layers(self, list(layers[0].values()), [_name(k) for k in layers[0]])
        else:
            _set_layers(self, list(layers))

    def forward(self, x: Any) -> Any:
        for layer in self.layers:
            x = layer(x)
        return x

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):  # the layers keep their names, as in torch
            names = _names(self)[index]
            return Sequential(dict(zip(names, self.layers[index], strict=True)))
        return _layers(self)[_index(self, index)]

    def __getattr__(self, name: str) -> Any:
        # A named layer (``seq.conv0``), as torch's; nothing else is looked up here.
        names = self.__dict__.get("_torch_names") or ()
        if name in names:
            return self.__dict__["layers"][names.index(name)]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setitem__(self, index: int, layer: Callable[..., Any]) -> None:
        layers = _layers(self)
        layers[_index(self, index)] = layer
        _set_layers(self, layers, _names(self))

    def __delitem__(self, index: int | slice) -> None:
        layers = _layers(self)
        del layers[index if isinstance(index, slice) else _index(self, index)]
        _set_layers(self, layers)  # numbered anew, as torch does

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[Any]:
        return iter(_layers(self))

    def add_module(self, name: str, module: Any) -> None:
        """Adds ``module`` at the end under ``name`` (a layer of that name is
        replaced where it is), as torch's ``Sequential.add_module``: it is
        called in ``forward``."""
        names, layers = _names(self), _layers(self)
        if name in names:
            layers[names.index(name)] = module
        else:
            names, layers = [*names, _name(name)], [*layers, module]
        _set_layers(self, layers, names)

    register_module = add_module

    def __add__(self, other: Sequential) -> Sequential:
        return Sequential(*_layers(self), *other)

    def __iadd__(self, other: Iterable[Any]) -> Self:
        return self.extend(other)

    def __mul__(self, times: int) -> Sequential:
        return Sequential(*(_layers(self) * _times(times)))

    __rmul__ = __mul__

    def __imul__(self, times: int) -> Self:
        _set_layers(self, _layers(self) * _times(times))
        return self

    def append(self, layer: Callable[..., Any]) -> Self:
        """Adds ``layer`` at the end (named ``str(len(self))``); returns the model."""
        _set_layers(self, [*_layers(self), layer], [*_names(self), str(len(self))])
        return self

    def extend(self, layers: Iterable[Any]) -> Self:
        """Adds ``layers`` at the end; returns the model."""
        for layer in layers:
            self.append(layer)
        return self

    def insert(self, index: int, layer: Callable[..., Any]) -> Self:
        """Inserts ``layer`` before ``index`` (``-len`` to ``len``); returns the model
        (the layers numbered anew)."""
        size = len(self.layers)
        if not isinstance(index, int) or not -size <= index <= size:
            raise IndexError(f"index {index!r} is out of range for Sequential of {size}")
        layers = _layers(self)
        layers.insert(index % (size + 1) if index < 0 else index, layer)
        _set_layers(self, layers)
        return self

    def pop(self, index: int | slice) -> Any:
        """Removes and returns the layer at ``index`` (a ``Sequential`` for a slice)."""
        layer = self[index]
        del self[index]
        return layer


# Plain functions (nothing here is rewritten), as ModuleList's.


def _layers(model: Sequential) -> list[Any]:
    return list(model.layers)


def _names(model: Sequential) -> list[str]:
    names = model.__dict__.get("_torch_names")
    return list(names) if names else [str(i) for i in range(len(model.layers))]


def _set_layers(model: Sequential, layers: list[Any], names: list[str] | None = None) -> None:
    """The list ``layers``, and torch's names of its layers in the static
    ``_torch_names`` when they are not 0, 1, ... (read by ``torch_io``)."""
    model.layers = list(layers)
    numbered = names is None or names == [str(i) for i in range(len(layers))]
    model._torch_names = None if numbered else tuple(names or ())


def _name(name: Any) -> str:
    if not isinstance(name, str) or not name or "." in name:
        raise InvalidArgumentError(
            format_error(
                f"Sequential: a layer's name is a string without '.', got {name!r}.",
                fix="name the layers with strings, as torch's OrderedDict of layers does.",
            )
        )
    return name


def _index(model: Sequential, index: Any) -> int:
    size = len(model.layers)
    if not isinstance(index, int) or not -size <= index < size:
        raise IndexError(f"index {index!r} is out of range for Sequential of {size}")
    return index % size


def _times(times: Any) -> int:
    if not isinstance(times, int) or isinstance(times, bool) or times < 1:
        raise ValueError(f"a Sequential repeats a positive int of times, got {times!r}")
    return times
