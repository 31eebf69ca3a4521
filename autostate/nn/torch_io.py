"""PyTorch ``state_dict`` names for a model: ``load_torch_state_dict`` and ``torch_state_dict``.

A ``torch.nn.Module.state_dict()`` names every parameter and buffer by its
module path with dots: ``layers.0.weight``, ``transformer.h.1.ln_1.bias``,
``0.weight`` under a root ``Sequential``. autostate names the same arrays by
their Python path (``layers[0].weight``, ``transformer['h'][1].ln_1.bias``)
in ``param_dict`` and ``state_dict``. This module translates between the two
and loads through ``state_dicts.rebuild``, so every check and conversion of
``load_state_dict`` applies; it adds what PyTorch's convention needs:

* Names: ``.attr`` and ``['key']`` become ``attr`` and ``key``, ``[0]``
  becomes ``0``; a container class that keeps its layers in one list
  attribute names it in ``_torch_children`` and that attribute is left out
  (``Sequential``'s ``layers[0].weight`` is PyTorch's ``0.weight``).
* Every path to an array counts: PyTorch lists a tied weight (one tensor in
  two modules) and a shared module under each path, autostate once under
  its first path. Writing lists each path (``tied="both"``, as PyTorch) or
  the first (``tied="first"``); loading takes either, and a dict listing two
  paths of one array must give equal values.
* Integer buffers: PyTorch keeps ``num_batches_tracked`` as int64, JAX
  without x64 as int32; an integer array loads into a narrower integer
  array when its values fit.
* Random keys (a ``Dropout``'s key state) are in no PyTorch ``state_dict``:
  they are neither written nor expected, and keep the model's values.
* Stacks (``autostate.stack``): PyTorch keeps layers in a ``ModuleList``,
  so an array of a stack is one entry per layer, the layer's index after the
  stack's path (``blocks.0.weight``), written and loaded as a slice of the
  stacked array.

Nothing here imports torch; a tensor is read through its ``numpy()``.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import jax
import numpy as np

from autostate import graph as _graph
from autostate import stacks as _stacks
from autostate import state_dicts as _state_dicts
from autostate import values as _values
from autostate.effects.local_state import HandledLocalStateRef
from autostate.errors import InvalidTypeError, StateDictError, StateDictWarning, format_error
from autostate.functional import ConstantRef, FunctionalModel

_CALLER = "nn.load_torch_state_dict"

# One step of an autostate path: ``.attr``, ``[0]`` or ``['key']``.
_STEP = re.compile(r"\.([^.\[]+)|\[(-?\d+)\]|\[('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")\]")


@dataclasses.dataclass(frozen=True, slots=True)
class _Entry:
    """One array of the model under one PyTorch name.

    ``kind`` is ``"parameter"`` or ``"state"``, ``key`` its name in
    ``param_dict``/``state_dict`` (several entries share a key when the
    array is reachable from several paths); ``first`` marks the entry of
    the first path PyTorch names it by. Under a stack, ``layer`` is the
    index of the layer (one per stack it is under) and ``template`` that
    layer's slice.
    """

    name: str
    kind: str
    key: str
    template: Any
    first: bool
    layer: tuple[int, ...] = ()


def _is_target(x: Any) -> bool:
    return _values.is_array(x) or type(x) in (HandledLocalStateRef, ConstantRef)


def own_members(
    node: Any, caller: str, is_member: Callable[[Any], bool]
) -> Iterator[tuple[list[str], Any, bool]]:
    """What one instance holds itself, under PyTorch's names (relative to it):
    ``(name parts, value, persistent)``.

    A value is a member picked by ``is_member`` (an array, a state) or a
    sub-model (a decorated instance or a stack), where the walk stops; lists,
    dicts and tuples on the way are walked into (``layers[0]`` is
    ``layers.0``). A class that keeps its layers in one list attribute
    named in ``_torch_children`` (``Sequential``) has that attribute left out
    of the names, and its item ``i`` named ``_torch_names[i]`` when it has
    those (torch's named layers: ``conv0``). A path through a bound method (``self.act =
    self.sub.forward``) is no module path, as in PyTorch, and is not
    yielded. ``persistent`` is false for a state the instance or its class
    lists in ``_torch_not_persistent`` (a KV cache, a carried hidden state, a
    ``register_buffer(..., persistent=False)``): PyTorch's non-persistent
    buffers, in no ``state_dict``.

    This is the one step from an instance to its torch-named contents that
    ``torch_state_dict``, ``load_torch_state_dict`` and ``nn.Module``'s
    ``named_modules`` / ``named_parameters`` / ``named_buffers`` share.
    """

    def is_target(x: Any) -> bool:
        return x is not node and (
            is_member(x) or _graph.is_stateful_instance(x) or _stacks.is_stack(x)
        )

    skip = getattr(type(node), "_torch_children", None)
    not_persistent = getattr(node, "_torch_not_persistent", ())
    for path, value in _graph.iter_tree(node, is_target):
        parts = torch_parts(path, caller)
        if "__self__" in parts:
            continue
        persistent = parts[0] not in not_persistent
        if skip is not None and parts[:1] == [skip]:
            parts = parts[1:]
            names = getattr(node, "_torch_names", None)  # a Sequential's named layers
            if names and parts and parts[0].isdigit():
                parts = [names[int(parts[0])], *parts[1:]]
        yield parts, value, persistent


def _paths(
    node: Any, caller: str, ancestors: tuple[int, ...] = ()
) -> Iterator[tuple[list[str], Any, tuple[int, ...]]]:
    """Every path (as PyTorch name parts) to every array and state of ``node``,
    with the positions in the parts where the index of a layer goes (one per
    stack the path goes through, outermost first).

    ``own_members`` gives one instance's own arrays and states (every
    persistent one, on each path) and its sub-models. As PyTorch's
    ``state_dict``, an instance lists its parameters, then its buffers
    (states and constants), then its sub-models; each sub-model is walked
    again under every path that reaches it, as PyTorch recurses into a
    shared module once per parent. A path back to an enclosing instance is
    not followed.
    """
    members = [(p, v) for p, v, persistent in own_members(node, caller, _is_target) if persistent]

    def rank(value: Any) -> int:
        if _values.is_array(value):
            return 0  # a parameter (the constants of f.model are ConstantRefs)
        return 1 if type(value) in (HandledLocalStateRef, ConstantRef) else 2

    for parts, value in sorted(members, key=lambda m: rank(m[1])):  # stable: in order
        if _stacks.is_stack(value):
            for sub, leaf, at in _paths(value.stacked, caller, (*ancestors, id(node))):
                yield parts + sub, leaf, (len(parts), *(len(parts) + a for a in at))
        elif not _graph.is_stateful_instance(value):
            yield parts, value, ()
        elif id(value) not in ancestors:
            for sub, leaf, at in _paths(value, caller, (*ancestors, id(node))):
                yield parts + sub, leaf, tuple(len(parts) + a for a in at)


def torch_parts(path: str, caller: str) -> list[str]:
    """An autostate path as PyTorch's name parts: ``blocks[0].attn`` is
    ``["blocks", "0", "attn"]``, ``h['wte']`` is ``["h", "wte"]``.

    Raises:
        StateDictError: a step that is not an attribute, an index or a
            string/int mapping key (``caller`` names the function asked).
    """
    parts: list[str] = []
    at = 0
    text = path if not path or path[0] in ".[" else "." + path
    for match in _STEP.finditer(text):
        if match.start() != at:
            break
        attr, index, key = match.groups()
        parts.append(
            attr if attr is not None else index if index is not None else str(ast.literal_eval(key))
        )
        at = match.end()
    if at != len(text):
        raise StateDictError(
            format_error(
                f"autostate.{caller}: the model path {path!r} has no PyTorch name: a key "
                "that is not an attribute, an index or a string/int mapping key.",
                fix="keep a model ported from PyTorch in attributes, lists and dicts with "
                "string keys, as torch.nn.Module, ModuleList and ModuleDict hold them "
                "(docs/limitations.md).",
            )
        )
    return parts


def _entries(
    model: Any, caller: str, parameters_of_f: bool = False
) -> tuple[list[_Entry], dict[str, Any], dict[str, Any]]:
    """The model's arrays under their PyTorch names, in the model's order, and
    every parameter and (flat) state under its own name.

    With ``parameters_of_f``, ``model`` may also be shaped like an ``f`` (the
    gradients ``autostate.grad`` gives, ``jax.grad`` over ``f``): its leaves
    are the parameters, and it holds no states to list.
    """
    states: dict[str, Any]
    if parameters_of_f and isinstance(model, FunctionalModel):
        f, states = model, {}
    else:
        f, states = _state_dicts.handle_for_reading(model, caller)
    params = _state_dicts.parameters_of(f.model)
    param_key = {id(leaf): name for name, leaf in params.items()}
    flat, layout = _state_dicts.flatten_states(states)
    state_keys = {name: [k for k in keys if k in flat] for name, _, keys, _ in layout}
    entries: list[_Entry] = []
    seen: set[tuple[str, str, tuple[int, ...]]] = set()
    by_name: dict[str, str] = {}
    # PyTorch lists a ModuleList layer by layer: the entries of a stack are
    # ordered by layer, then as the model's attributes are (``order``).
    order: list[tuple[int, tuple[int, ...], int]] = []
    first_of_stack: dict[tuple[str, ...], int] = {}
    for parts, value, at in _paths(f.model, caller):
        run = first_of_stack.setdefault(tuple(parts[: at[0]]), len(order)) if at else len(order)
        if _values.is_array(value):
            key = param_key[id(value)]
            found = [("parameter", key, "", value)]
        else:
            found = [
                ("state", key, key[len(value.name) :], flat[key])
                for key in state_keys.get(value.name, ())
                if not _is_key(flat[key])
            ]
        for kind, key, suffix, whole in found:
            for layer in np.ndindex(*np.shape(whole)[: len(at)]):
                here = parts + torch_parts(suffix, caller)
                for position, i in sorted(zip(at, layer), reverse=True):
                    here.insert(position, str(i))
                name = ".".join(here)
                template = whole[layer] if layer else whole
                if name in by_name:
                    if by_name[name] == key:
                        continue
                    raise StateDictError(
                        format_error(
                            f"autostate.{caller}: {by_name[name]!r} and {key!r} both have the "
                            f"PyTorch name {name!r}.",
                            fix="give them paths that differ once written with dots (dict keys "
                            "1 and '1' in one dict collide); see docs/limitations.md.",
                        )
                    )
                by_name[name] = key
                first = (kind, key, layer) not in seen
                seen.add((kind, key, layer))
                order.append((run, layer[:1], len(order)))
                entries.append(_Entry(name, kind, key, template, first, layer))
    entries = [entries[i] for *_, i in sorted(order)]
    return entries, params, flat


def _is_key(x: Any) -> bool:
    """A typed PRNG key (``Dropout``'s): PyTorch keeps its generator outside
    modules, so a key is in no ``state_dict``; it keeps the model's value."""
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended)


def torch_state_dict(model: Any, tied: Literal["both", "first"] = "both") -> dict[str, np.ndarray]:
    """The model's parameters and states as a PyTorch ``state_dict`` of numpy arrays.

    Names are PyTorch's: ``layers[0].weight`` is ``layers.0.weight``, a dict
    item ``h['wte'].weight`` is ``h.wte.weight``, a ``Sequential``'s layers
    are numbered directly under it (``0.weight``). Parameters and states
    (PyTorch's buffers: ``running_mean``, ``num_batches_tracked``, constants)
    are listed in PyTorch's order: a module's parameters, its buffers, then
    its sub-modules, each in attribute order. Static values are not listed.

    Gradients by PyTorch name: given a tree shaped like ``f`` (the gradients
    ``autostate.grad`` and ``autostate.value_and_grad`` return, or
    ``jax.grad``'s over ``f``), it lists the parameters only, as PyTorch's
    ``{n: p.grad for n, p in model.named_parameters()}``: no states (a
    BatchNorm's running statistics are not gradients). ``tied="first"`` lists
    a tied weight once, as ``named_parameters()`` does. Such a tree lists a
    dict's items in sorted key order (JAX's, which the tree keeps), where the
    model lists them in insertion order.

    Args:
        model: a ``@stateful`` model, or a tree shaped like its ``f`` (its
            parameters, or their gradients). For an ``f, states`` pair, pass
            ``autostate.freeze(f, states)`` to list the states too.
        tied: an array reachable from two paths (a tied weight, a shared
            sub-model) is listed under every path with ``"both"``, as
            PyTorch lists it, or once, under its first path, with ``"first"``.

    Returns:
        A new dict of new numpy arrays (copies): ``{k: torch.from_numpy(v)}``
        is a dict ``torch.nn.Module.load_state_dict`` takes. Integer arrays
        keep the model's dtype (PyTorch's ``load_state_dict`` casts them).

    Raises:
        StateDictError: two arrays would share one PyTorch name.

    Examples:
        >>> import jax.numpy as jnp, autostate
        >>> from autostate.nn.torch_io import torch_state_dict
        >>> @autostate.stateful
        ... class Norm:
        ...     def __init__(self):
        ...         self.weight = jnp.ones(2)
        ...         self.running_mean = autostate.state(jnp.zeros(2))
        >>> @autostate.stateful
        ... class Net:
        ...     def __init__(self):
        ...         self.h = [Norm(), Norm()]
        ...         self.head = {"norm": self.h[0]}
        >>> list(torch_state_dict(Net(), tied="first"))
        ['h.0.weight', 'h.0.running_mean', 'h.1.weight', 'h.1.running_mean']
        >>> sd = torch_state_dict(Net())  # the shared Norm under its second path too
        >>> len(sd), list(sd)[-1]
        (6, 'head.norm.running_mean')
        >>> grads = autostate.grad(lambda m: sum((n.weight ** 2).sum() for n in m.h))(Net())
        >>> {name: g.tolist() for name, g in torch_state_dict(grads, tied="first").items()}
        {'h.0.weight': [2.0, 2.0], 'h.1.weight': [2.0, 2.0]}
    """
    if tied not in ("both", "first"):
        raise InvalidTypeError(
            format_error(
                f"autostate.nn.torch_state_dict: tied={tied!r}.",
                fix='pass tied="both" (every path, as PyTorch) or tied="first".',
            )
        )
    entries, _, _ = _entries(model, "nn.torch_state_dict", parameters_of_f=True)
    return {e.name: np.array(e.template, copy=True) for e in entries if e.first or tied == "both"}


def load_torch_state_dict(model: Any, state_dict: Mapping[str, Any], strict: bool = True) -> Any:
    """A copy of ``model`` holding the arrays of a PyTorch ``state_dict``.

    The model must have PyTorch's structure and names (``autostate.nn``
    layers do): ``layers.0.weight`` loads into ``layers[0].weight``,
    ``h.wte.weight`` into ``h['wte'].weight``, ``0.weight`` into a root
    ``Sequential``'s first layer (a container class of one's own that keeps
    its layers in one list attribute names it as ``Sequential`` does:
    ``_torch_children = "layers"``). As ``autostate.load_state_dict``, the model
    given is not modified: everything is checked first, then a new model is
    built (its states embedded as ``autostate.freeze`` embeds them, arrays
    not loaded shared with ``model``).

    A tied weight or shared module may be listed under one of its paths or
    several (PyTorch lists each); values listed twice must be equal. Dtypes
    must match, except that an integer array (PyTorch's int64
    ``num_batches_tracked``) loads into the model's narrower integer array
    when its values fit. Random keys (a ``Dropout``'s) are not expected and
    keep the model's values.

    Args:
        model: the model to load into.
        state_dict: ``{name: array}``: numpy or JAX arrays, or CPU tensors
            (``module.state_dict()`` as is; read through ``.numpy()``).
        strict: if true, missing, unexpected and mis-shaped keys raise one
            ``StateDictError`` naming each (and, for an unexpected key, the
            model's name it most likely means). If false, the keys that fit
            are loaded, the others keep the model's values, and a
            ``StateDictWarning`` lists the skipped ones: its ``missing``,
            ``unexpected`` and ``mismatched`` hold ``(kind, name)`` pairs in
            PyTorch names (torch's ``missing_keys`` / ``unexpected_keys``).

    Returns:
        A new model with the loaded parameters and states.

    Raises:
        StateDictError: keys that do not fit (``strict=True``), or one array
            listed under two names with different values.

    Examples:
        >>> import jax.numpy as jnp, numpy as np, autostate
        >>> from autostate.nn.torch_io import load_torch_state_dict
        >>> @autostate.stateful
        ... class Linear:
        ...     def __init__(self):
        ...         self.weight = jnp.zeros((1, 2))
        >>> @autostate.stateful
        ... class Net:
        ...     def __init__(self):
        ...         self.layers = [Linear(), Linear()]
        >>> sd = {"layers.0.weight": np.ones((1, 2), np.float32),
        ...       "layers.1.weight": np.full((1, 2), 2.0, np.float32)}
        >>> load_torch_state_dict(Net(), sd).layers[1].weight
        Array([[2., 2.]], dtype=float32)
        >>> load_torch_state_dict(Net(), {"layer.0.weight": sd["layers.0.weight"]})
        Traceback (most recent call last):
        ...
        autostate.errors.StateDictError: autostate.nn.load_torch_state_dict: the state_dict does not fit Net:
          missing keys (2): 'layers.0.weight', 'layers.1.weight'
          unexpected keys (1): 'layer.0.weight' (did you mean 'layers.0.weight'?)
        ...
    """
    state_dict = _state_dicts.require_dict(
        state_dict,
        _CALLER,
        "a dict of PyTorch name -> array",
        "pass module.state_dict() (or a dict of numpy arrays with its keys).",
    )
    entries, all_params, all_states = _entries(model, _CALLER)
    by_name = {e.name: e for e in entries}
    report = _TorchReport()
    # (kind, key, layer) -> (name, value)
    chosen: dict[tuple[str, str, tuple[int, ...]], tuple[str, Any]] = {}
    for name, given in state_dict.items():
        entry = by_name.get(name)
        if entry is None:
            report.unexpected.append(name)
            continue
        value = _fitted(entry, _as_array(given, name), report)
        if value is None:
            continue
        slot = (entry.kind, entry.key, entry.layer)
        if slot in chosen:
            other, before = chosen[slot]
            if not np.array_equal(np.asarray(before), np.asarray(value)):
                raise StateDictError(
                    format_error(
                        f"autostate.{_CALLER}: {other!r} and {name!r} name one array of "
                        f"the model ({entry.kind} {entry.key!r}, tied), but the state_dict "
                        "gives them different values.",
                        fix="give the tied weight one value (list it under one name, or the "
                        "same array under both), or untie it in the model.",
                    )
                )
            continue
        chosen[slot] = (name, value)
    listed = {(e.kind, e.key, e.layer) for e in entries if e.name in state_dict}
    report.missing = [
        (e.kind, e.name) for e in entries if e.first and (e.kind, e.key, e.layer) not in listed
    ]
    if report:
        what = f"autostate.{_CALLER}: the state_dict does not fit {type(model).__name__}"
        lines = report.lines(sorted(by_name))
        if strict:
            raise StateDictError(
                format_error(
                    what + ":\n" + "\n".join(lines),
                    fix="build the model with the configuration the checkpoint was saved "
                    "from and the same attribute names as the PyTorch module, or pass "
                    "strict=False to load only the keys that fit.",
                )
            )
        warnings.warn(
            StateDictWarning(
                what + "; strict=False skipped:\n" + "\n".join(lines),
                missing=tuple(report.missing),
                unexpected=tuple(("unknown", k) for k in report.unexpected),
                mismatched=tuple(report.mismatched),
            ),
            stacklevel=2,
        )
    # What is not loaded keeps the model's values: rebuild sees complete dicts.
    params, states = dict(all_params), dict(all_states)
    for (kind, key, layer), (_, value) in chosen.items():
        into = params if kind == "parameter" else states
        into[key] = _with_layer(into[key], layer, value) if layer else value
    return _state_dicts.rebuild(
        model, params, states, strict=True, caller=_CALLER, error=StateDictError
    )


class _TorchReport:
    """What does not fit, in PyTorch names."""

    def __init__(self) -> None:
        self.missing: list[tuple[str, str]] = []
        self.unexpected: list[str] = []
        self.mismatched: list[tuple[str, str]] = []
        self.details: list[str] = []

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.mismatched)

    def lines(self, names: list[str]) -> list[str]:
        out = []
        if self.missing:
            out.append(
                f"  missing keys ({len(self.missing)}): "
                + ", ".join(repr(k) for _, k in self.missing)
            )
        if self.unexpected:
            shown = []
            for key in self.unexpected:
                near = difflib.get_close_matches(key, names, n=1)
                shown.append(f"{key!r} (did you mean {near[0]!r}?)" if near else repr(key))
            out.append(f"  unexpected keys ({len(self.unexpected)}): " + ", ".join(shown))
        if self.mismatched:
            out.append(
                f"  shape/dtype mismatches ({len(self.mismatched)}): " + ", ".join(self.details)
            )
        return out


def _with_layer(whole: Any, layer: tuple[int, ...], value: Any) -> Any:
    """A stacked array with one layer's slice replaced (a new array)."""
    if isinstance(whole, jax.Array):
        return whole.at[layer].set(value)
    whole = np.array(whole, copy=True)
    whole[layer] = np.asarray(value)
    return whole


def _as_array(value: Any, name: str) -> Any:
    if _values.is_array(value):
        return value
    numpy = getattr(value, "numpy", None)
    if callable(numpy) and hasattr(value, "detach"):  # a torch tensor, without importing torch
        return value.detach().cpu().numpy()
    if _values.is_python_number(value):
        return np.asarray(value)
    raise StateDictError(
        format_error(
            f"autostate.{_CALLER}: the entry {name!r} holds a {type(value).__name__}, "
            "not an array.",
            fix="pass a dict of arrays: {k: v.numpy() for k, v in module.state_dict().items()}.",
        )
    )


def _fitted(entry: _Entry, value: Any, report: _TorchReport) -> Any:
    """``value`` ready for ``entry`` (an int64 counter narrowed), or ``None``
    after recording a mismatch."""
    want = _state_dicts.array_spec(entry.template)
    got = _state_dicts.array_spec(value)
    if (
        want is not None
        and got is not None
        and want[0] == got[0]
        and want[1] != got[1]
        and np.issubdtype(got[1], np.integer)
        and np.issubdtype(want[1], np.integer)
    ):
        limits = np.iinfo(want[1])
        host = np.asarray(value)
        if host.size == 0 or (host.min() >= limits.min and host.max() <= limits.max):
            value, got = host.astype(want[1]), want
    if want == got:
        return value
    report.mismatched.append((entry.kind, entry.name))
    report.details.append(
        f"{entry.name!r} (model {_state_dicts.format_spec(want, entry.template)}, "
        f"given {_state_dicts.format_spec(got, value)})"
    )
    return None
