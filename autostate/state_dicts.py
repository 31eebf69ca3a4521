"""The one flat naming of a model's arrays: ``state_dict`` and ``param_dict``.

* ``state_dict`` / ``load_state_dict``: every state under the name
  ``functionalize()`` gives it. A state whose value is one array is one
  entry under that name; a state whose value is a pytree (a dict, a tuple)
  is one entry per leaf, the name followed by the leaf's keypath
  (``kv['k']``, ``pair[0]``).
* ``param_dict`` / ``load_param_dict``: every other array leaf of the model,
  named by its path the same way (``blocks[0].w``); a sub-model reachable
  from two paths appears once, under its first path.
* Stacks (``autostate.stack``): an entry of a stacked model is one array
  with the layer axis under the stack's own path (``blocks.w``), or, with
  ``per_layer=True``, one entry per layer (``blocks[0].w``, as a list of
  layers names it). Loading takes either form, and a stacked entry loads
  into a list of layers (``_fit_layers``).

Loading never mutates the model it is given: everything is validated first,
then a new model is built with ``freeze``. Checkpoint files (``checkpoint``)
and ``jax.export`` programs (``export``) are built on these dicts.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from autostate import graph as _graph
from autostate import tree as _tree
from autostate import values as _values
from autostate.effects.local_state import HandledLocalStateRef, is_running
from autostate.errors import InvalidTypeError, StateDictError, StateDictWarning, format_error
from autostate.functional import FunctionalModel, check_state_keys
from autostate.packing import PackedModel, PackedStates
from autostate.state_values import is_static_value, states_dict

# Per state: its name, treedef, the flat keys of its leaves, and the Python
# values (bools, ints, strings, enums) among them, by key: structure, not data.
_Layout = list[tuple[str, Any, list[str], dict[str, Any]]]


# --- the flat view of a model ------------------------------------------------


def handle_for_reading(
    model: Any, caller: str, rebuilds: bool = False
) -> tuple[FunctionalModel, dict[str, Any]]:
    """``functionalize`` for reading: every category, shared names allowed
    (``rebuilds``: the model is then rebuilt from its ``f``, as a load does)."""
    if isinstance(model, FunctionalModel):
        raise InvalidTypeError(format_error(
            f"autostate.{caller} expects a model, and got a FunctionalModel: the f "
            "functionalize() returns, or a tree shaped like it (the gradients "
            "autostate.grad returns, or jax.grad's of f), which holds the parameters "
            "and no states.",
            fix="for a model, pass autostate.freeze(f, states); for the names of "
            "gradients, nn.torch_state_dict(grads) lists them by PyTorch's names "
            "(as `{n: p.grad for n, p in model.named_parameters()}`).",
        ))
    if isinstance(model, PackedModel):
        raise InvalidTypeError(format_error(
            f"autostate.{caller} expects a model, got the pf returned by autostate.pack.",
            fix="pass the model autostate.freeze(pf, pstates) returns instead of pf.",
        ))
    # Checked on the model given: handler ids can repeat across calls, so a
    # reference cannot be told apart from the ones functionalize adds below.
    # A reference of a call running now (``param_dict(self.model)`` in a
    # method) reads its current value, as functionalize inside a method does.
    handled = sorted({
        ref.name
        for _, ref in _graph.iter_tree(
            model, lambda x: type(x) is HandledLocalStateRef and not is_running(x.handler_id)
        )
    })
    if handled:
        raise StateDictError(format_error(
            f"autostate.{caller}: the model holds states handled by a functionalize() "
            f"call, whose values live in that call's states dict: {_quoted(handled)}.",
            fix="pass autostate.freeze(f, states) with that call's f and states.",
        ))
    # (The front door's functionalize and freeze, and stacks, are read when a
    # call needs them: state dicts are a feature those modules stand beside.)
    from autostate.api import functionalize_as

    # "allowed" only differs from the default by accepting models that a
    # sharing-enabled freeze produced; names are the same either way.
    return functionalize_as(
        f"autostate.{caller}", model, state_sharing="allowed", rebuilds=rebuilds
    )


def parameters_of(body: Any) -> dict[str, Any]:
    # One array in two places (tied weights) is one parameter, named by its
    # first path, as f has it as one leaf.
    params: dict[str, Any] = {}
    seen: set[int] = set()
    for name, leaf in _graph.iter_tree(body, _values.is_array):
        if id(leaf) not in seen:
            seen.add(id(leaf))
            params[name] = leaf
    return params


def flatten_states(states: Mapping[str, Any]) -> tuple[dict[str, Any], _Layout]:
    flat: dict[str, Any] = {}
    layout: _Layout = []
    for name, value in states.items():
        leaves, treedef = jax.tree_util.tree_flatten_with_path(value)
        if treedef.num_nodes == 1 and treedef.num_leaves == 1:  # type: ignore[attr-defined]
            keyed = [(name, leaves[0][1])]
        else:
            keyed = [
                (name + "".join(_graph.key_name(k) for k in path), leaf) for path, leaf in leaves
            ]
        statics = {key: leaf for key, leaf in keyed if is_static_value(leaf)}
        for key, leaf in keyed:
            if key in statics:
                continue
            if key in flat:
                raise StateDictError(format_error(
                    f"Two states flatten to the same key {key!r}: a pytree-valued state "
                    "and an explicitly named one collide.",
                    fix="rename the explicit state (autostate.state(..., name=...)).",
                ))
            flat[key] = leaf
        layout.append((name, treedef, [key for key, _ in keyed], statics))
    return flat, layout


def unflatten_states(layout: _Layout, flat: Mapping[str, Any]) -> dict[str, Any]:
    return states_dict({
        name: jax.tree_util.tree_unflatten(
            treedef, [statics[key] if key in statics else flat[key] for key in keys]
        )
        for name, treedef, keys, statics in layout
    })


def _as_array(value: Any, kind: str, key: str) -> Any:
    value_kind = _values.kind_of(value)
    if value_kind is _values.ARRAY or value_kind is _values.NUMPY_ARRAY:
        if value.dtype != object:
            return value
    elif value_kind is _values.NUMPY_SCALAR:
        return np.asarray(value)
    elif value_kind.number:
        return np.asarray(value, _python_scalar_dtype(value))
    raise StateDictError(format_error(
        f"The {kind} {key!r} holds a {type(value).__name__}, not an array.",
        fix="keep arrays (or pytrees of arrays) in parameters and states.",
    ))


def _python_scalar_dtype(value: Any) -> np.dtype:
    """The dtype JAX gives a Python number (float32 for a float unless x64 is
    on): a float state trained eagerly stays a float, through ``f`` it becomes
    that array, and the dicts of both must load into each other."""
    return np.dtype(jax.dtypes.canonicalize_dtype(np.result_type(type(value))))


def flat_dicts(model: Any, caller: str) -> tuple[dict[str, Any], dict[str, Any]]:
    f, states = handle_for_reading(model, caller)
    params = {k: _as_array(v, "parameter", k) for k, v in parameters_of(f.model).items()}
    flat, _ = flatten_states(states)
    return params, {k: _as_array(v, "state", k) for k, v in flat.items()}


# --- stacks: per-layer names -------------------------------------------------------


def _stacks_above(key: str, stacks: Mapping[str, int]) -> list[str]:
    """The stack paths ``key`` lies under, outermost first."""
    return sorted(
        (p for p in stacks if not p or key == p or key.startswith((p + ".", p + "["))), key=len
    )


def _layer_key(key: str, prefixes: Sequence[str], index: Sequence[int]) -> str:
    """``key`` with ``[i]`` after each stack path: ``blocks.w`` -> ``blocks[2].w``."""
    for prefix, i in sorted(zip(prefixes, index), key=lambda pair: -len(pair[0])):
        rest = key[len(prefix) :]
        # (Under a stack at the root, an attribute's name gets its dot: ``[0].w``.)
        dot = "." if not prefix and rest[:1] not in ("", "[", ".") else ""
        key = key[: len(prefix)] + f"[{i}]" + dot + rest
    return key


def split_layers(flat: Mapping[str, Any], stacks: Mapping[str, int]) -> dict[str, Any]:
    """``flat`` with each entry under a stack split into one entry per layer.

    Example:
        >>> from autostate.state_dicts import split_layers
        >>> split_layers({"blocks.w": jnp.zeros((2, 3)), "head": jnp.ones(3)}, {"blocks": 2})
        {'blocks[0].w': Array([0., 0., 0.], dtype=float32), 'blocks[1].w': Array([0., 0., 0.], dtype=float32), 'head': Array([1., 1., 1.], dtype=float32)}
    """
    if not stacks:
        return dict(flat)
    out: dict[str, Any] = {}
    for key, value in flat.items():
        prefixes = _stacks_above(key, stacks)
        if not prefixes:
            out[key] = value
            continue
        for index in np.ndindex(*np.shape(value)[: len(prefixes)]):
            out[_layer_key(key, prefixes, index)] = value[index]
    return out


_INDEX = re.compile(r"\[(\d+)\]")


def _stacked_key(key: str, stacks: Mapping[str, int]) -> tuple[str, tuple[int, ...]] | None:
    """``(stacked key, layer index)`` of a per-layer key (``blocks[2].w`` ->
    ``("blocks.w", (2,))``), or ``None`` when ``key`` is under no stack."""
    index: list[int] = []
    for prefix in sorted(stacks, key=len):
        if key.startswith(prefix + "["):
            found = _INDEX.match(key, len(prefix))
            if found is None:
                return None
            index.append(int(found.group(1)))
            rest = key[found.end() :]
            key = key[: len(prefix)] + (rest[1:] if not prefix and rest[:1] == "." else rest)
    return (key, tuple(index)) if index else None


def _stacked_values(values: list[Any], shape: tuple[int, ...]) -> Any:
    stack = jax.numpy.stack if any(isinstance(v, jax.Array) for v in values) else np.stack
    joined = stack(values)
    return joined.reshape(shape + joined.shape[1:])


def _fit_layers(
    template: Mapping[str, Any], given: Mapping[str, Any], stacks: Mapping[str, int]
) -> Mapping[str, Any]:
    """``given`` with layer entries joined or split to the form of ``template``:
    per-layer entries (``blocks[0].w``, ...) become the stack's ``blocks.w``
    when every layer is there; a stacked entry becomes the per-layer entries a
    list of layers has when its axis matches. Anything else is left for the
    report."""
    if all(key in template for key in given) and all(key in given for key in template):
        return given
    out = dict(given)
    # Per-layer entries into a stack's stacked entry.
    groups: dict[str, dict[tuple[int, ...], str]] = {}
    for key in given:
        if key in template or not stacks:
            continue
        parsed = _stacked_key(key, stacks)
        if parsed is not None and parsed[0] in template and parsed[0] not in given:
            stacked, index = parsed
            if len(index) == len(_stacks_above(stacked, stacks)):
                groups.setdefault(stacked, {})[index] = key
    for stacked, keys in groups.items():
        shape = tuple(np.shape(template[stacked])[: len(next(iter(keys)))])
        wanted = list(np.ndindex(*shape))
        if sorted(keys) == wanted:
            out[stacked] = _stacked_values([given[keys[i]] for i in wanted], shape)
            for key in keys.values():
                del out[key]
    # A stacked entry into the entries of a list of layers.
    splits: dict[str, dict[int, str]] = {}
    for key in template:
        if key in given:
            continue
        for found in _INDEX.finditer(key):
            stacked = key[: found.start()] + key[found.end() :]
            if stacked in given and stacked not in template:
                splits.setdefault(stacked, {})[int(found.group(1))] = key
    for stacked, layer_keys in splits.items():
        value = given[stacked]
        depth = np.shape(value)[0] if np.ndim(value) else -1
        if stacked in out and sorted(layer_keys) == list(range(depth)):
            for i, key in layer_keys.items():
                out[key] = value[i]
            del out[stacked]
    return out


def require_dict(given: Any, caller: str, expected: str, fix: str) -> Mapping[str, Any]:
    """``given`` if it is a ``Mapping``; otherwise an error naming the user's line,
    so ``None`` or a list is refused in one wording before anything reads it."""
    if isinstance(given, Mapping):
        return given
    raise InvalidTypeError(format_error(
        f"autostate.{caller}: expected {expected}, got {type(given).__name__}.", fix=fix
    ))


def _require_loadable(given: Any, kind: str, caller: str) -> Mapping[str, Any]:
    short = "state" if kind == "state" else "param"
    return require_dict(
        given, caller, f"a dict of {kind} name -> array",
        f"pass the dict autostate.{short}_dict(model) returns (or one with the same keys).",
    )


def state_dict(
    model: Any, states: Mapping[str, Any] | PackedStates | None = None, *, per_layer: bool = False
) -> dict[str, Any]:
    """Every state of ``model`` as a flat ``{name: array}`` dict.

    Names are the ones ``model.functionalize()`` gives: explicit names as
    given, other states by path (``blocks[0].bn.mean``); a sub-model reachable
    from two paths contributes its states once. A state whose value is a
    pytree rather than one array gives one entry per leaf, the name followed
    by the leaf's keypath (``kv['k']``).

    Args:
        model: a ``@stateful`` instance (or any pytree holding state
            requests), the ``f`` of ``functionalize()``, or the ``pf`` of
            ``autostate.pack``.
        states: with ``f``, its states dict (``f`` holds no states itself);
            with ``pf``, its ``PackedStates``. It works inside a jitted step.
        per_layer: a state of a stack (``autostate.stack``) as one entry per
            layer, ``blocks[0].mean``, as a list of layers names it, instead
            of one array with the layer axis, ``blocks.mean`` (the default,
            the names ``functionalize()`` gives). A state given an explicit
            name stays one entry.

    Returns:
        A new dict; the arrays are the model's own (not copied), or their
        slices with ``per_layer``.

    Raises:
        InvalidTypeError: ``f`` or ``pf`` without its states, or states with
            a model.
        StateDictError: ``states`` lacks some of ``f``'s states.

    Examples:
        >>> @autostate.stateful
        ... class Norm:
        ...     def __init__(self, n):
        ...         self.mean = jnp.zeros(n)  # a state
        ...         self.scale = jnp.ones(n)  # a parameter
        ...
        ...     def __call__(self, x):
        ...         self.mean = 0.9 * self.mean + 0.1 * x
        ...         return (x - self.mean) * self.scale
        >>> model = Norm(2)
        >>> _ = model(jnp.ones(2))
        >>> autostate.state_dict(model)
        {'mean': Array([0.1, 0.1], dtype=float32)}
        >>> f, states = model.functionalize()
        >>> autostate.state_dict(f, states)  # the same, from functionalize()'s pair
        {'mean': Array([0.1, 0.1], dtype=float32)}
        >>> norms = autostate.stack([Norm(2), Norm(2)])
        >>> list(autostate.state_dict(norms)), list(autostate.state_dict(norms, per_layer=True))
        (['mean'], ['[0].mean', '[1].mean'])
    """
    flat = _state_dict(model, states)
    return per_layer_of(model, flat) if per_layer else flat


def per_layer_of(model: Any, flat: Mapping[str, Any]) -> dict[str, Any]:
    """``flat`` (a dict of ``model``'s) with the entries of its stacks per layer."""
    if isinstance(model, PackedModel):
        model = model.unpack()
    body = model.model if isinstance(model, FunctionalModel) else model
    from autostate.stacks import stacks_in  # (see handle_for_reading)

    return split_layers(flat, stacks_in(body))


def _state_dict(model: Any, states: Mapping[str, Any] | PackedStates | None) -> dict[str, Any]:
    if isinstance(model, PackedModel):
        if states is None:
            raise InvalidTypeError(format_error(
                "autostate.state_dict(pf) needs the packed states: pf holds no states.",
                fix="call autostate.state_dict(pf, pstates) with the PackedStates of that pf.",
            ))
        model, states = model.unpack(states)  # type: ignore[arg-type]  # checked there
    if isinstance(model, FunctionalModel):
        if states is None:
            raise InvalidTypeError(format_error(
                "autostate.state_dict(f) needs the states dict: f holds no states.",
                fix="call autostate.state_dict(f, states) with the states of that f.",
            ))
        states = require_dict(
            states, "state_dict", "the states dict of f (name -> value)",
            "pass the states dict that functionalize() (or the last call of f) returned; "
            "PackedStates go with the pf of autostate.pack: state_dict(pf, pstates).",
        )
        names = model.state_names()
        check_state_keys(states, names, "autostate.state_dict")
        missing = sorted(names.difference(states))
        if missing:  # (as f, jit(f) and freeze refuse it: the dict would lack them silently)
            raise StateDictError(format_error(
                f"autostate.state_dict: the states dict lacks {_quoted(missing)}, "
                f"states of this f (it has {_quoted(sorted(states))}).",
                fix="pass the whole states dict that functionalize() (or the last call "
                "of f) returned.",
            ))
        flat, _ = flatten_states(states)
        return {k: _as_array(v, "state", k) for k, v in flat.items()}
    if states is not None:
        raise InvalidTypeError(format_error(
            "autostate.state_dict takes a states dict only with an f (or a packed pf).",
            fix="call autostate.state_dict(model), autostate.state_dict(f, states) or "
            "autostate.state_dict(pf, pstates).",
        ))
    return flat_dicts(model, "state_dict")[1]


def param_dict(model: Any, *, per_layer: bool = False) -> dict[str, Any]:
    """Every parameter (non-state array leaf) of ``model`` as ``{path: array}``.

    Paths are built as state names are: attributes joined by ``.``, ``[0]``
    for sequence items, ``['k']`` for mapping keys, no leading dot. A
    sub-model or an array reachable from two paths (tied weights:
    ``self.head.w = self.embed.w``) appears once, under its first path, and
    loading it sets every place that holds it. Python scalars and strings
    are static configuration, not parameters.

    Args:
        model: a ``@stateful`` instance (or any pytree holding one), or the
            ``f`` of ``functionalize()`` (then it works inside a jitted step:
            an EMA of the parameters needs no ``freeze``), or the ``pf`` of
            ``autostate.pack`` (the same names as its ``f``; the arrays are
            slices of the packed buffers).
        per_layer: a parameter of a stack (``autostate.stack``) as one entry
            per layer, ``blocks[0].w``, instead of one array with the layer
            axis, ``blocks.w`` (the default).

    Returns:
        A new dict; the arrays are the model's own (not copied), or their
        slices with ``per_layer``.

    Examples:
        >>> @autostate.stateful
        ... class Linear:
        ...     def __init__(self, n_in, n_out):
        ...         self.w = jnp.zeros((n_in, n_out))
        ...         self.b = jnp.zeros(n_out)
        ...
        ...     def __call__(self, x):
        ...         return x @ self.w + self.b
        >>> model = Linear(2, 3)
        >>> {k: v.shape for k, v in autostate.param_dict(model).items()}
        {'w': (2, 3), 'b': (3,)}
        >>> f, states = model.functionalize()
        >>> list(autostate.param_dict(f))  # the same names, from f (what is trained)
        ['w', 'b']
        >>> layers = autostate.stack([Linear(2, 3), Linear(2, 3)])
        >>> list(autostate.param_dict(layers, per_layer=True))
        ['[0].w', '[1].w', '[0].b', '[1].b']
    """
    if isinstance(model, PackedModel):
        model = model.unpack()
    if isinstance(model, FunctionalModel):
        leaves, graphdef = model._flattened()
        flat = dict(zip(graphdef.names, leaves))
    else:
        flat = flat_dicts(model, "param_dict")[0]
    return per_layer_of(model, flat) if per_layer else flat


# --- loading -----------------------------------------------------------------


def array_spec(x: Any) -> tuple[tuple[int, ...], Any] | None:
    """``(shape, dtype)`` of an array-like; typed PRNG keys keep their key dtype."""
    if (kind := _values.kind_of(x)).array or kind.spec or kind.number:
        dtype = getattr(x, "dtype", None)
        if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
            return tuple(x.shape), dtype
        if dtype is None:
            return (), _python_scalar_dtype(x)
        return tuple(np.shape(x)), np.dtype(dtype)
    return None


def format_spec(spec: tuple[tuple[int, ...], np.dtype] | None, value: Any = None) -> str:
    return type(value).__name__ if spec is None else _tree.format_spec(*spec)


def _quoted(keys: Sequence[str]) -> str:
    return ", ".join(repr(k) for k in keys)


class _Report:
    """Everything that does not fit, collected before anything is loaded."""

    def __init__(self) -> None:
        self.missing: list[tuple[str, str]] = []
        self.unexpected: list[tuple[str, str]] = []
        self.mismatched: list[tuple[str, str, str]] = []

    def match(self, kind: str, template: Mapping[str, Any], given: Mapping[str, Any]) -> dict:
        """The entries of ``given`` that fit ``template`` (not converted yet)."""
        fitting = {}
        for key, leaf in template.items():
            if key not in given:
                self.missing.append((kind, key))
                continue
            want, got = array_spec(leaf), array_spec(given[key])
            if want != got:
                detail = f"{key!r} (model {format_spec(want, leaf)}, given {format_spec(got, given[key])})"
                self.mismatched.append((kind, key, detail))
                continue
            fitting[key] = given[key]
        self.unexpected += [(kind, key) for key in given if key not in template]
        return fitting

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.mismatched)

    def lines(self) -> list[str]:
        out = []
        for kind in ("parameter", "state"):
            found = (
                (f"missing {kind} keys", [repr(k) for c, k in self.missing if c == kind]),
                (f"unexpected {kind} keys", [repr(k) for c, k in self.unexpected if c == kind]),
                (f"{kind} shape/dtype mismatches", [d for c, _, d in self.mismatched if c == kind]),
            )
            out += [f"  {what} ({len(items)}): {', '.join(items)}" for what, items in found if items]
        return out

    def warning(self, message: str) -> StateDictWarning:
        return StateDictWarning(
            message,
            missing=tuple(self.missing),
            unexpected=tuple(self.unexpected),
            mismatched=tuple((c, k) for c, k, _ in self.mismatched),
        )


def _tied_paths(body: Any, keys: set[str]) -> list[tuple[str, str]]:
    """``(key, first path)`` for each of ``keys`` that is a later path to a parameter."""
    first: dict[int, str] = {}
    tied = []
    for name, leaf in _graph.iter_tree(body, _values.is_array):
        first.setdefault(id(leaf), name)
        if name in keys and first[id(leaf)] != name:
            tied.append((name, first[id(leaf)]))
    return tied


def _converted_like(template: Any, value: Any, weak: bool = False) -> Any:
    """``value`` as the same kind of object as ``template`` (dtype already
    checked); ``weak``: a JAX array weakly typed, as ``value`` was saved."""
    kind = _values.kind_of(template)
    if kind is _values.ARRAY:
        if isinstance(template, jax.core.Tracer):
            array = jax.numpy.asarray(value)
        else:
            # A copy, as for numpy below: the loaded array is the model's own, so
            # an array another model holds is not tied to it (arrays tie by identity).
            array = jax.device_put(value, template.sharding, may_alias=False)
        return _values.weakly_typed(array) if weak else array
    if kind is _values.NUMPY_ARRAY:
        return np.array(value, copy=True)
    if kind is _values.NUMPY_SCALAR:
        return np.asarray(value)[()]
    return np.asarray(value).item()


def rebuild(
    model: Any, params: Mapping[str, Any] | None, states: Mapping[str, Any] | None, *, strict: bool,
    caller: str, error: type[Exception], checkpoint: str | None = None,
    saved_from: str | None = None, weak: tuple[Collection[str], Collection[str]] = ((), ()),
) -> Any:
    """A copy of ``model`` holding ``params`` and ``states`` (``None``: keep the
    model's); ``checkpoint`` is the path named in errors; ``weak``: the
    parameters and the states given as numpy arrays that are weakly typed
    (a checkpoint records it)."""
    from autostate.api import freeze  # (see handle_for_reading)
    from autostate.stacks import stacks_in

    f, nested = handle_for_reading(model, caller, rebuilds=True)
    report = _Report()
    param_leaves: dict[str, Any] = {}
    new_params: dict[str, Any] = {}
    stacks = stacks_in(f.model)
    if params is not None:
        param_leaves = parameters_of(f.model)
        params = _fit_layers(param_leaves, params, stacks)
        new_params = report.match("parameter", param_leaves, params)
    if states is not None:
        flat, layout = flatten_states(nested)
        states = _fit_layers(flat, states, stacks)
        new_states = report.match("state", flat, states)
    if report:
        given = f"checkpoint {checkpoint}" if checkpoint else (
            ("state" if params is None else "parameter") + " dict"
        )
        what = f"autostate.{caller}: the {given} does not fit {type(model).__name__}"
        if saved_from:
            what += f" (it was saved from {saved_from})"
        if strict:
            fix = (
                "load into a model built with the same configuration as the saved one, "
                "or pass strict=False to load only the keys that fit (the rest keep the "
                "model's values)."
            )
            # A PyTorch-style dict lists a tied weight under each of its paths.
            tied = _tied_paths(f.model, {k for c, k in report.unexpected if c == "parameter"})
            if tied:
                fix = (
                    "a tied array is one parameter, named by its first path: drop "
                    + ", ".join(f"{k!r} (the same array as {first!r})" for k, first in tied)
                    + " from the dict (autostate.nn.load_torch_state_dict takes a PyTorch "
                    "state_dict that lists it under both)."
                )
            raise error(format_error(what + ":\n" + "\n".join(report.lines()), fix=fix))
        warnings.warn(
            report.warning(what + "; strict=False skipped:\n" + "\n".join(report.lines())),
            stacklevel=3,
        )
    if states is not None:
        flat.update({k: _converted_like(flat[k], v, k in weak[1]) for k, v in new_states.items()})
        nested = unflatten_states(layout, flat)
    body = f.model
    if new_params:
        # By the array replaced, so that every place of a tied one takes its new value.
        by_id = {
            id(param_leaves[k]): _converted_like(param_leaves[k], v, k in weak[0])
            for k, v in new_params.items()
        }
        body = _graph.map_tree(f.model, lambda leaf, _name: by_id.get(id(leaf), leaf), _values.is_array)
    return freeze(FunctionalModel(f.handler_id, body), nested)


def load_state_dict(model: Any, state_dict: Mapping[str, Any], strict: bool = True) -> Any:
    """A copy of ``model`` holding the states of ``state_dict``.

    Args:
        model: the model to load into; it is not modified.
        state_dict: ``{name: array}`` as ``state_dict`` returns.
        strict: if true, missing keys, unexpected keys and shape or dtype
            mismatches raise one ``StateDictError`` listing every offending
            key. If false, only fitting keys are loaded and a
            ``StateDictWarning`` lists the skipped ones (states not loaded keep
            the model's values).

    Returns:
        A new model (states embedded as with ``autostate.freeze``); parameters
        are shared with ``model``.

    Raises:
        StateDictError: with ``strict``, ``state_dict`` does not fit ``model``.

    Examples:
        >>> @autostate.stateful
        ... class Norm:
        ...     def __init__(self):
        ...         self.mean = jnp.zeros(2)
        ...
        ...     def __call__(self, x):
        ...         self.mean = 0.9 * self.mean + 0.1 * x
        ...         return x - self.mean
        >>> trained = Norm()
        >>> _ = trained(jnp.ones(2))
        >>> fresh = autostate.load_state_dict(Norm(), autostate.state_dict(trained))
        >>> print(fresh.mean)
        [0.1 0.1]
    """
    state_dict = _require_loadable(state_dict, "state", "load_state_dict")
    return rebuild(model, None, state_dict, strict=strict, caller="load_state_dict", error=StateDictError)


def load_param_dict(model: Any, param_dict: Mapping[str, Any], strict: bool = True) -> Any:
    """A copy of ``model`` holding the parameters of ``param_dict``.

    Args:
        model: the model to load into; it is not modified.
        param_dict: ``{path: array}`` as ``param_dict`` returns.
        strict: as for ``load_state_dict``.

    Returns:
        A new model; its states are ``model``'s, embedded as with
        ``autostate.freeze``.

    Raises:
        StateDictError: with ``strict``, ``param_dict`` does not fit ``model``.

    Examples:
        >>> @autostate.stateful
        ... class Linear:
        ...     def __init__(self, n_in, n_out):
        ...         self.w = jnp.zeros((n_in, n_out))
        ...         self.b = jnp.zeros(n_out)
        ...
        ...     def __call__(self, x):
        ...         return x @ self.w + self.b
        >>> params = {"w": jnp.ones((2, 3)), "b": jnp.ones(3)}
        >>> model = autostate.load_param_dict(Linear(2, 3), params)
        >>> print(model(jnp.ones(2)))
        [3. 3. 3.]
    """
    param_dict = _require_loadable(param_dict, "parameter", "load_param_dict")
    return rebuild(model, param_dict, None, strict=strict, caller="load_param_dict", error=StateDictError)


