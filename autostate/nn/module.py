"""``nn.Module``, ``ModuleList``, ``ModuleDict`` and ``Parameter``: what a
PyTorch module file names, so that it ports by changing its imports.

``Module`` is ``autostate.Stateful`` (a base class is ``@stateful``) with
PyTorch's module protocol on top:

* ``model(x)`` calls ``forward``; ``super().__init__()`` sets ``training``
  to ``True`` (a class attribute gives it to a module that skips the call);
* ``register_buffer(name, value, persistent=True)`` declares a buffer as
  ``self.name = autostate.constant(value)`` does (the rewrite reads the
  literal name, so a float buffer is never trained); ``persistent=False``
  leaves it out of PyTorch state dicts; ``register_parameter`` and
  ``add_module`` assign;
* ``modules``, ``named_modules``, ``children``, ``named_children``,
  ``parameters``, ``named_parameters``, ``buffers``, ``named_buffers`` and
  ``apply`` with PyTorch's names and order.

The iteration is PyTorch's recursion (a module, then its children in the
order they were assigned; a shared module or array listed once) over one
step, ``torch_io.own_members``: what one instance holds itself, found by the
model graph's walk (``graph.iter_tree``) and named as PyTorch names it
(``layers.0.weight``). A parameter is a trainable array that is not a state
(what ``autostate.param_dict`` lists); a buffer is a state (running
statistics, ``register_buffer``) or a non-trainable array (an int or bool
mask); a PRNG key (``Dropout``'s) is neither, as PyTorch keeps its generator
outside modules. A stack (``autostate.stack``) is one module whose arrays
have the layer axis in front, listed under the stack's name.

``Module`` keeps a weak set of the instances its subclasses construct: the
modules ``nn.init`` writes into (see ``autostate.nn.init``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Self

import jax

from autostate import graph as _graph
from autostate import runtime as _runtime
from autostate import stacks as _stacks
from autostate import tree as _tree
from autostate import values as _values
from autostate.api import Stateful
from autostate.errors import InvalidArgumentError, InvalidTypeError, format_error
from autostate.functional import CONSTANT, is_trainable
from autostate.nn import torch_io as _torch_io
from autostate.packing import LazyAttribute

__all__ = ["Module", "ModuleDict", "ModuleList", "Parameter", "holders_of"]

_CALLER = "nn.Module"
_NOT_PERSISTENT = "_torch_not_persistent"  # read by torch_io.own_members

# Every instance a Module subclass constructed (``Model(...)``, not the copies
# functionalize, freeze and jax make of one), for ``holders_of``.
_BUILT: weakref.WeakSet[Any] = weakref.WeakSet()


class Module(Stateful):
    """The base class of a ported PyTorch module: ``class Net(nn.Module)``.

    A subclass is an ``autostate.Stateful`` class (its methods that assign
    ``self`` are rewritten, ``functionalize``, ``train``/``eval``) that also
    speaks PyTorch's module protocol: calling the model calls ``forward``,
    ``super().__init__()`` is accepted, and ``register_buffer``,
    ``named_parameters``, ``modules``, ``apply`` and their kin mean what they
    mean in PyTorch. Every layer of ``autostate.nn`` is a ``Module``.

    Differences from PyTorch:
        Sub-models, parameters and buffers are found by walking the attributes
        (registration is optional); a parameter is a JAX array (immutable: an
        in-place method on a state is a write of it, ``t.data`` does not exist);
        ``.to(device)``, hooks and ``state_dict()`` as a method are not provided
        (use ``autostate.state_dict`` and ``nn.torch_state_dict``).

    Examples:
        >>> import jax.numpy as jnp
        >>> import autostate.nn as nn
        >>> class MLP(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.fc = nn.Linear(3, 4, key=0)
        ...         self.act = nn.ReLU(inplace=True)
        ...         self.register_buffer("scale", jnp.full(4, 2.0))
        ...
        ...     def forward(self, x):
        ...         return self.act(self.fc(x)) * self.scale
        >>> model = MLP()
        >>> model(jnp.ones((2, 3))).shape
        (2, 4)
        >>> [name for name, _ in model.named_parameters()]
        ['fc.weight', 'fc.bias']
        >>> [name for name, _ in model.named_buffers()]
        ['scale']
        >>> [name for name, _ in model.named_modules()]
        ['', 'fc', 'act']
    """

    # ``self.register_buffer("x", v)`` in a subclass declares ``x``, as
    # ``self.x = autostate.constant(v)`` does (read by the decoration).
    _autostate_declaring_methods = ("register_buffer",)

    # PyTorch's mode flag, readable before any train()/eval() (a layer that
    # never calls ``super().__init__()`` reads this one); static config.
    training: bool = True

    if TYPE_CHECKING:
        # As PyTorch types its Module: an attribute set by name
        # (``register_buffer("scale", ...)``, a ``ModuleDict`` entry) is known.
        def __getattr__(self, name: str) -> Any: ...

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        obj = super().__new__(cls)
        _BUILT.add(obj)
        return obj

    def __init__(self) -> None:
        self.training = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """What calling the model computes: a subclass defines it (or ``__call__``)."""
        return _forward_of_call(self, args, kwargs)

    def register_buffer(self, name: str, tensor: Any, persistent: bool = True) -> None:
        """Declares a buffer: ``self.<name>`` holds ``tensor``, never trained.

        As ``self.<name> = autostate.constant(tensor)``: a state of category
        ``"constant"`` (in ``state_dict`` and the states, not in
        ``param_dict`` or gradients); a method may assign it too. The name
        must be a string literal where the call is written
        (``self.register_buffer("mask", m)``), which the rewrite reads;
        ``persistent=False`` leaves it out of ``nn.torch_state_dict`` and
        ``nn.load_torch_state_dict``, as PyTorch leaves it out of its
        ``state_dict``.
        """
        _register_buffer(self, name, tensor, persistent)

    def register_parameter(self, name: str, param: Any) -> None:
        """``self.<name> = param``: a parameter (a floating-point array) or ``None``."""
        _check_name(self, name, "register_parameter")
        setattr(self, name, Parameter(param) if param is not None else None)

    def add_module(self, name: str, module: Any) -> None:
        """``self.<name> = module``, a sub-model (or ``None``)."""
        _check_name(self, name, "add_module")
        setattr(self, name, module)

    def register_module(self, name: str, module: Any) -> None:
        """``add_module``."""
        _check_name(self, name, "register_module")
        setattr(self, name, module)

    def named_modules(
        self, memo: set[Any] | None = None, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[tuple[str, Any]]:
        """``(name, module)`` for this model (named ``prefix``) and every
        sub-model, depth first in the order they were assigned; a module
        reachable twice is listed once (with ``remove_duplicate``)."""
        return _named_modules(self, memo, prefix, remove_duplicate)

    def modules(self) -> Iterator[Any]:
        """This model and every sub-model, as ``named_modules`` lists them."""
        return (m for _, m in _named_modules(self, None, "", True))

    def named_children(self) -> Iterator[tuple[str, Any]]:
        """``(name, module)`` for the direct sub-models, each once."""
        return _named_children(self)

    def children(self) -> Iterator[Any]:
        """The direct sub-models, each once."""
        return (m for _, m in _named_children(self))

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, Any]]:
        """``(name, array)`` for every parameter, module by module as
        ``named_modules`` orders them; a tied array is listed once, under its
        first name (with ``remove_duplicate``)."""
        return _named_arrays(self, "parameter", prefix, recurse, remove_duplicate)

    def parameters(self, recurse: bool = True) -> Iterator[Any]:
        """Every parameter (trainable array that is not a state), each once."""
        return (p for _, p in _named_arrays(self, "parameter", "", recurse, True))

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, Any]]:
        """``(name, array)`` for every buffer: states (running statistics,
        ``register_buffer``, persistent or not) and non-trainable arrays."""
        return _named_arrays(self, "buffer", prefix, recurse, remove_duplicate)

    def buffers(self, recurse: bool = True) -> Iterator[Any]:
        """Every buffer, each once."""
        return (b for _, b in _named_arrays(self, "buffer", "", recurse, True))

    def apply(self, fn: Callable[[Any], Any]) -> Self:
        """Calls ``fn`` on every sub-model (children first, recursively), then
        on this model, as PyTorch's ``Module.apply``; returns the model."""
        _apply(self, fn)
        return self


def Parameter(data: Any = None, requires_grad: bool = True) -> Any:  # noqa: N802 (torch's name)
    """PyTorch's ``nn.Parameter(data)``: ``data`` itself.

    An array assigned in ``__init__`` is a parameter when it is a
    floating-point array, so ``self.weight = nn.Parameter(w)`` needs no
    wrapper. ``requires_grad=False`` (a frozen array) is a buffer here:
    ``self.register_buffer("w", w)`` or ``autostate.constant(w)``.

    Examples:
        >>> import jax.numpy as jnp
        >>> import autostate.nn as nn
        >>> nn.Parameter(jnp.zeros(2))
        Array([0., 0.], dtype=float32)
    """
    if data is None:
        raise InvalidArgumentError(
            format_error(
                "nn.Parameter() needs its array: JAX has no empty tensor to fill later.",
                fix="pass the array: `nn.Parameter(jnp.zeros(shape))`.",
            )
        )
    if not requires_grad:
        raise InvalidArgumentError(
            format_error(
                "nn.Parameter(..., requires_grad=False): an array that is not trained is a "
                "buffer here.",
                fix='`self.register_buffer("name", array)` (or `self.name = '
                "autostate.constant(array)`) in __init__.",
            )
        )
    if not _values.is_array(data) or not is_trainable(data):
        what = getattr(data, "dtype", type(data).__name__)
        raise InvalidTypeError(
            format_error(
                f"nn.Parameter takes a floating-point array, got {what}: only those are "
                "trained (PyTorch: only floating point tensors can require gradients).",
                fix="pass a float array, or register an integer array as a buffer.",
            )
        )
    return data


class ModuleList(Module):
    """Sub-models in a list, as ``torch.nn.ModuleList``: indexed, iterated,
    appended to.

    Layer ``i`` is the attribute ``"i"`` of the list, so its names are
    PyTorch's in ``param_dict``, ``state_dict`` and ``torch_state_dict``
    alike: ``h.0.attn.weight``.

    Differences from PyTorch:
        ``torch.nn.ModuleList``; a plain Python list of layers works too (named
        ``layers[0].w`` in ``param_dict``).

    Args:
        modules: the initial sub-models.

    Examples:
        >>> import autostate, autostate.nn as nn
        >>> layers = nn.ModuleList([nn.Linear(2, 2, key=0) for _ in range(2)])
        >>> layers = layers.append(nn.ReLU())  # returns the list, as in PyTorch
        >>> len(layers), type(layers[-1]).__name__
        (3, 'ReLU')
        >>> sorted(autostate.param_dict(layers))
        ['0.bias', '0.weight', '1.bias', '1.weight']
    """

    def __init__(self, modules: Iterable[Any] | None = None):
        if modules is not None:
            _set_items(self, [*_items(self), *modules])

    def __getitem__(self, index: int | slice) -> Any:
        items = _items(self)
        if isinstance(index, slice):
            return type(self)(items[index])
        return items[_index(self, index, len(items))]

    def __setitem__(self, index: int, module: Any) -> None:
        items = _items(self)
        items[_index(self, index, len(items))] = module
        _set_items(self, items)

    def __delitem__(self, index: int | slice) -> None:
        items = _items(self)
        if isinstance(index, slice):
            del items[index]
        else:
            del items[_index(self, index, len(items))]
        _set_items(self, items)

    def __len__(self) -> int:
        return len(_items(self))

    def __iter__(self) -> Iterator[Any]:
        return iter(_items(self))

    def __iadd__(self, modules: Iterable[Any]) -> Self:
        return self.extend(modules)

    def __add__(self, other: Iterable[Any]) -> ModuleList:
        return ModuleList([*_items(self), *other])

    def append(self, module: Any) -> Self:
        """Adds ``module`` at the end; returns the list."""
        _set_items(self, [*_items(self), module])
        return self

    def extend(self, modules: Iterable[Any]) -> Self:
        """Adds ``modules`` at the end; returns the list."""
        _set_items(self, [*_items(self), *modules])
        return self

    def insert(self, index: int, module: Any) -> None:
        """Inserts ``module`` before ``index``."""
        items = _items(self)
        items.insert(index, module)
        _set_items(self, items)

    def pop(self, index: int = -1) -> Any:
        """Removes and returns the module at ``index``."""
        items = _items(self)
        module = items.pop(_index(self, index, len(items)))
        _set_items(self, items)
        return module


class ModuleDict(Module):
    """Sub-models by name, as ``torch.nn.ModuleDict``: ``d["wte"]`` and ``d.wte``.

    Each entry is an attribute of the dict, so its names are PyTorch's
    (``transformer.wte.weight``). Keys are strings that are not names the
    class uses (``keys``, ``training``), as PyTorch requires.

    Differences from PyTorch:
        ``torch.nn.ModuleDict``; a plain dict of layers works too (named
        ``layers['k'].w`` in ``param_dict``).

    Args:
        modules: a mapping (or pairs) of name to sub-model.

    Examples:
        >>> import autostate.nn as nn
        >>> d = nn.ModuleDict({"wte": nn.Embedding(4, 2, key=0), "ln": nn.LayerNorm(2)})
        >>> list(d), d.wte is d["wte"], len(d)
        (['wte', 'ln'], True, 2)
        >>> [name for name, _ in d.named_parameters()]
        ['wte.weight', 'ln.weight', 'ln.bias']
    """

    def __init__(self, modules: Mapping[str, Any] | Iterable[tuple[str, Any]] | None = None):
        if modules is not None:
            self.update(modules)

    def __getitem__(self, key: str) -> Any:
        entries = _entries(self)
        if key not in entries:
            raise KeyError(key)
        return entries[key]

    def __setitem__(self, key: str, module: Any) -> None:
        _check_name(self, key, "ModuleDict[key] = module", entry=True)
        setattr(self, key, module)

    def __delitem__(self, key: str) -> None:
        if key not in _entries(self):
            raise KeyError(key)
        delattr(self, key)

    def __len__(self) -> int:
        return len(_entries(self))

    def __iter__(self) -> Iterator[str]:
        return iter(_entries(self))

    def __contains__(self, key: object) -> bool:
        return key in _entries(self)

    def keys(self) -> Iterable[str]:
        """The names, in insertion order."""
        return _entries(self).keys()

    def items(self) -> Iterable[tuple[str, Any]]:
        """``(name, module)`` pairs, in insertion order."""
        return _entries(self).items()

    def values(self) -> Iterable[Any]:
        """The modules, in insertion order."""
        return _entries(self).values()

    def update(self, modules: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> None:
        """Adds or replaces entries from a mapping or ``(name, module)`` pairs."""
        pairs = modules.items() if isinstance(modules, Mapping) else modules
        for key, module in pairs:
            self[key] = module

    def pop(self, key: str) -> Any:
        """Removes the entry ``key`` and returns its module."""
        module = self[key]
        del self[key]
        return module

    def clear(self) -> None:
        """Removes every entry."""
        for key in list(_entries(self)):
            del self[key]


# --- what the methods do (plain functions: nothing here is rewritten) ----------


def _forward_of_call(model: Any, args: tuple, kwargs: dict) -> Any:
    """``Module.forward`` of a class that defines ``__call__`` instead (a model
    written the autostate way on the ``nn.Module`` base): its ``__call__``;
    neither is an error, as in PyTorch."""
    if type(model).__call__ is not Module.__call__:
        return model(*args, **kwargs)
    raise NotImplementedError(
        format_error(
            f'Module [{type(model).__name__}] is missing the required "forward" function.',
            fix=f"define `def forward(self, ...)` in {type(model).__name__}.",
        )
    )


def _check_name(model: Any, name: Any, what: str, entry: bool = False) -> None:
    """PyTorch's rules for a module, parameter, buffer or entry name."""
    problem = None
    if not isinstance(name, str):
        problem = f"a name is a string, got {type(name).__name__}"
    elif not name or "." in name:
        problem = "a name is not empty and has no '.'"
    elif _class_attribute(type(model), name) or name == "training":
        problem = f"{type(model).__name__} has a class attribute {name!r}"
    elif entry and name in vars(model) and not _is_module(vars(model)[name]):
        problem = f"attribute {name!r} already exists"
    if problem is not None:
        raise InvalidArgumentError(
            format_error(f"{what}: {name!r}: {problem}.", fix="pick another name.")
        )


def _class_attribute(cls: type, name: str) -> bool:
    """Whether ``cls`` has an attribute ``name`` (a method, a property, a
    value) other than the descriptors autostate reads a state's value, or a
    value a compiled call left packed, through."""
    held = any(
        name in k.__dict__ and type(k.__dict__[name]) is not LazyAttribute for k in cls.__mro__
    )
    return held and _runtime.state_descriptor(cls, name) is None


def _register_buffer(model: Any, name: str, tensor: Any, persistent: bool) -> None:
    _check_name(model, name, "register_buffer")
    if tensor is not None and not _values.is_array(tensor):
        raise InvalidTypeError(
            format_error(
                f"register_buffer({name!r}, ...) takes an array or None, got "
                f"{type(tensor).__name__}.",
                fix="pass a JAX array (`jnp.asarray(value)`).",
            )
        )
    if name in _tree.info_of(model).state:
        # The rewrite read the literal name: a state, declared as a constant.
        _runtime.init(
            model, name, _runtime.StateDeclaration(tensor, CONSTANT, None, marker="constant")
        )
    elif tensor is not None and is_trainable(tensor):
        raise InvalidArgumentError(
            format_error(
                f"register_buffer({name!r}, ...) in {type(model).__name__}: the rewrite did "
                "not see this name (it is computed, or the call is outside the class), so a "
                "floating-point buffer would be trained as a parameter.",
                fix=f'write the name as a string literal in a method of the class '
                f'(`self.register_buffer("{name}", value)`), or assign '
                f"`self.{name} = autostate.constant(value)` in __init__.",
            )
        )
    else:
        setattr(model, name, tensor)  # an int, bool or key array: never trained anyway
    names = getattr(model, _NOT_PERSISTENT, ())
    if not persistent and name not in names:
        setattr(model, _NOT_PERSISTENT, (*names, name))
    elif persistent and name in vars(model).get(_NOT_PERSISTENT, ()):
        setattr(model, _NOT_PERSISTENT, tuple(n for n in names if n != name))


def _is_module(value: Any) -> bool:
    return _graph.is_stateful_instance(value) or _stacks.is_stack(value)


def _items(model: ModuleList) -> list[Any]:
    """A ``ModuleList``'s modules: its attributes ``"0"``, ``"1"``, ..."""
    attrs = vars(model)
    items: list[Any] = []
    while (key := str(len(items))) in attrs:
        items.append(getattr(model, key))
    return items


def _set_items(model: ModuleList, items: list[Any]) -> None:
    attrs = vars(model)
    i = len(items)
    while str(i) in attrs:
        delattr(model, str(i))
        i += 1
    for i, module in enumerate(items):
        setattr(model, str(i), module)


def _index(model: Any, index: Any, size: int) -> int:
    if not isinstance(index, int) or not -size <= index < size:
        raise IndexError(f"index {index!r} is out of range for {type(model).__name__} of {size}")
    return index % size


def _entries(model: ModuleDict) -> dict[str, Any]:
    """A ``ModuleDict``'s entries: its attributes that hold modules."""
    return {k: v for k, v in vars(model).items() if _is_module(v)}


def _direct_children(model: Any) -> list[tuple[str, Any]]:
    """``(torch name, sub-model)`` for what ``model`` holds itself, on every
    path (a stack stands as its stacked layer)."""
    out = []
    for parts, value, _ in _torch_io.own_members(model, _CALLER, lambda x: False):
        out.append((".".join(parts), value.stacked if _stacks.is_stack(value) else value))
    return out


def _named_children(model: Any) -> Iterator[tuple[str, Any]]:
    seen: set[int] = set()
    for name, child in _direct_children(model):
        if id(child) not in seen:
            seen.add(id(child))
            yield name, child


def _named_modules(
    model: Any, memo: set[Any] | None, prefix: str, remove_duplicate: bool
) -> Iterator[tuple[str, Any]]:
    if memo is None:
        memo = set()
    if model in memo:
        return
    if remove_duplicate:
        memo.add(model)
    yield prefix, model
    for name, child in _direct_children(model):
        yield from _named_modules(child, memo, f"{prefix}.{name}" if prefix else name, remove_duplicate)


def _apply(model: Any, fn: Callable[[Any], Any]) -> None:
    for _, child in list(_named_children(model)):
        _apply(child, fn)
    fn(model)


def _is_member(value: Any) -> bool:
    return _values.is_array(value) or _runtime.is_slot(value)


def _own_arrays(model: Any, kind: str) -> list[tuple[str, Any]]:
    """``(torch name, array)`` for the parameters (``kind="parameter"``) or
    buffers a model holds itself."""
    out = []
    for parts, value, _ in _torch_io.own_members(model, _CALLER, _is_member):
        if _is_module(value):
            continue
        if not _runtime.is_slot(value):  # a plain array: trained when it is float
            if not _is_key(value) and (kind == "parameter") == is_trainable(value):
                out.append((".".join(parts), value))
            continue
        if kind == "parameter" or len(parts) != 1:
            continue
        current = getattr(model, parts[0])  # a state: a buffer, whatever it holds
        for path, leaf in _graph.iter_tree(current, _values.is_array):
            if not _is_key(leaf):
                out.append((".".join([*parts, *_torch_io.torch_parts(path, _CALLER)]), leaf))
    return out


def _is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended)


def _named_arrays(
    model: Any, kind: str, prefix: str, recurse: bool, remove_duplicate: bool
) -> Iterator[tuple[str, Any]]:
    modules = _named_modules(model, None, prefix, remove_duplicate) if recurse else [(prefix, model)]
    seen: set[int] = set()
    for module_prefix, module in list(modules):
        for name, array in _own_arrays(module, kind):
            if remove_duplicate:
                if id(array) in seen:
                    continue
                seen.add(id(array))
            yield (f"{module_prefix}.{name}" if module_prefix else name), array


def holders_of(array: Any) -> list[tuple[Any, str]]:
    """``(module, attribute)`` for every attribute of a constructed ``Module``
    (still alive) that holds ``array`` itself: a parameter, or a state whose
    value it is. What ``nn.init`` writes a new value into."""
    found = []
    for module in list(_BUILT):
        for attr, value in list(vars(module).items()):
            value = _graph.materialized(value)  # (what a compiled call left packed: made)
            if value is array or (_runtime.is_slot(value) and getattr(module, attr) is array):
                found.append((module, attr))
    return found
