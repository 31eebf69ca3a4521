"""Freeze for export: flat dicts of arrays, ``.npz`` checkpoints, ``jax.export``.

This module owns the one flat naming of a model's arrays, and what is built
on it:

* ``state_dict`` / ``load_state_dict``: every state under the name
  ``functionalize()`` gives it. A state whose value is one array is one
  entry under that name; a state whose value is a pytree (a dict, a tuple)
  is one entry per leaf, the name followed by the leaf's keypath
  (``kv['k']``, ``pair[0]``).
* ``param_dict`` / ``load_param_dict``: every other array leaf of the model,
  named by its path the same way (``blocks[0].w``); a sub-model reachable
  from two paths appears once, under its first path.
* ``save`` / ``load`` / ``load_arrays``: both dicts in one ``.npz`` with a
  JSON manifest. Dtypes numpy cannot store portably (bfloat16, float8, int4)
  go in as their raw bits, and every array carries a SHA-256, so a damaged
  file is an error, never a half-loaded model. Nothing is pickled.
* ``export``: a ``jax.export.Exported`` of one method with the parameters
  baked in, taking and returning the flat state dict.
* ``model_repr``: the ``repr`` ``@stateful`` gives classes that have none.
* ``model_treescope_repr``: their ``__treescope_repr__`` (``treescope`` optional).

Loading never mutates the model it is given: everything is validated first,
then a new model is built with ``freeze``. The module sits on top of ``api``
and the engine; it knows nothing of source code.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import os
import uuid
import warnings
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np

from autostate import api as _api
from autostate import tree as _tree
from autostate.effects import (
    SLOT_TYPES,
    FrozenLocalStateRequest,
    HandledLocalStateRef,
    InitialLocalStateRequest,
    InitialValue,
)
from autostate.errors import CheckpointError, StateDictError, StateDictWarning, format_error

_FORMAT = "autostate-checkpoint"
_VERSION = 1
_MANIFEST = "__autostate_manifest__"
_PYTHON_SCALARS = (bool, int, float, complex)

# state name -> (treedef of its value, the flat keys of its leaves)
_Layout = list[tuple[str, Any, list[str]]]


# --- the flat view of a model ------------------------------------------------


def _handle(model: Any, caller: str) -> tuple[_api.FunctionalModel, dict[str, Any]]:
    """``functionalize`` for reading: every category, shared names allowed."""
    if isinstance(model, _api.FunctionalModel):
        raise TypeError(
            format_error(
                f"autostate.{caller} expects a model, got the f returned by functionalize().",
                fix="pass the model autostate.freeze(f, states) returns instead of f.",
            )
        )
    # Checked on the model given: handler ids can repeat across calls, so a
    # reference cannot be told apart from the ones functionalize adds below.
    handled = sorted(
        {ref.name for _, ref in _tree.iter_tree(model, lambda x: type(x) is HandledLocalStateRef)}
    )
    if handled:
        raise StateDictError(
            format_error(
                f"autostate.{caller}: the model holds states handled by a functionalize() "
                f"call, whose values live in that call's states dict: {_quoted(handled)}.",
                fix="pass autostate.freeze(f, states) with that call's f and states.",
            )
        )
    # "allowed" only differs from the default by accepting models that a
    # sharing-enabled freeze produced; names are the same either way.
    return _api.functionalize(model, state_sharing="allowed")


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _params(body: Any) -> dict[str, Any]:
    return dict(_tree.iter_tree(body, _is_array))


def _flatten_states(states: Mapping[str, Any]) -> tuple[dict[str, Any], _Layout]:
    flat: dict[str, Any] = {}
    layout: _Layout = []
    for name, value in states.items():
        leaves, treedef = jax.tree_util.tree_flatten_with_path(value)
        if treedef.num_nodes == 1 and treedef.num_leaves == 1:
            keyed = [(name, leaves[0][1])]
        else:
            keyed = [
                (name + "".join(_tree.key_name(k) for k in path), leaf) for path, leaf in leaves
            ]
        for key, leaf in keyed:
            if key in flat:
                raise StateDictError(
                    format_error(
                        f"Two states flatten to the same key {key!r}: a pytree-valued state "
                        "and an explicitly named one collide.",
                        fix="rename the explicit state (autostate.state(..., name=...)).",
                    )
                )
            flat[key] = leaf
        layout.append((name, treedef, [key for key, _ in keyed]))
    return flat, layout


def _unflatten_states(layout: _Layout, flat: Mapping[str, Any]) -> dict[str, Any]:
    return {
        name: jax.tree_util.tree_unflatten(treedef, [flat[key] for key in keys])
        for name, treedef, keys in layout
    }


def _as_array(value: Any, kind: str, key: str) -> Any:
    if isinstance(value, (jax.Array, np.ndarray)) and value.dtype != object:
        return value
    if isinstance(value, (np.generic, *_PYTHON_SCALARS)):
        return np.asarray(value)
    raise StateDictError(
        format_error(
            f"The {kind} {key!r} holds a {type(value).__name__}, not an array.",
            fix="keep arrays (or pytrees of arrays) in parameters and states.",
        )
    )


def _flat_dicts(model: Any, caller: str) -> tuple[dict[str, Any], dict[str, Any]]:
    f, states = _handle(model, caller)
    params = {k: _as_array(v, "parameter", k) for k, v in _params(f.model).items()}
    flat, _ = _flatten_states(states)
    return params, {k: _as_array(v, "state", k) for k, v in flat.items()}


def state_dict(model: Any) -> dict[str, Any]:
    """Every state of ``model`` as a flat ``{name: array}`` dict.

    Example::

        sd = autostate.state_dict(model)       # {'bn.mean': Array(...), ...}
        model = autostate.load_state_dict(model, sd)

    Names are the ones ``model.functionalize()`` gives: explicit names as
    given, other states by path (``blocks[0].bn.mean``); a sub-model reachable
    from two paths contributes its states once. A state whose value is a
    pytree rather than one array gives one entry per leaf, the name followed
    by the leaf's keypath (``kv['k']``).

    **Arguments:**
    - ``model``: a ``@stateful`` instance (or any pytree holding state requests).

    **Returns:** a new dict; the arrays are the model's own (not copied).
    """
    return _flat_dicts(model, "state_dict")[1]


def param_dict(model: Any) -> dict[str, Any]:
    """Every parameter (non-state array leaf) of ``model`` as ``{path: array}``.

    Example::

        pd = autostate.param_dict(model)       # {'blocks[0].w': Array(...), ...}
        model = autostate.load_param_dict(model, pd)

    Paths are built as state names are: attributes joined by ``.``, ``[0]``
    for sequence items, ``['k']`` for mapping keys, no leading dot. A
    sub-model reachable from two paths (tied weights) appears once, under its
    first path. Python scalars and strings are static configuration, not
    parameters.

    **Arguments:**
    - ``model``: a ``@stateful`` instance (or any pytree holding one).

    **Returns:** a new dict; the arrays are the model's own (not copied).
    """
    return _flat_dicts(model, "param_dict")[0]


# --- loading -----------------------------------------------------------------


def _spec(x: Any) -> tuple[tuple[int, ...], np.dtype] | None:
    if _is_array(x) or isinstance(x, (*_PYTHON_SCALARS, jax.ShapeDtypeStruct)):
        dtype = getattr(x, "dtype", None)
        return tuple(np.shape(x)), np.dtype(dtype if dtype is not None else np.asarray(x).dtype)
    return None


def _short_dtype(dtype: Any) -> str:
    name = np.dtype(dtype).name
    for long, short in (("bfloat", "bf"), ("float", "f"), ("uint", "u"), ("int", "i")):
        if name.startswith(long):
            return short + name[len(long) :]
    return name.replace("complex", "c")


def _format_spec(spec: tuple[tuple[int, ...], np.dtype] | None, value: Any = None) -> str:
    if spec is None:
        return type(value).__name__
    shape, dtype = spec
    return f"{_short_dtype(dtype)}[{','.join(map(str, shape))}]"


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
        if not isinstance(given, Mapping):
            raise TypeError(
                format_error(
                    f"Expected a dict of {kind} name -> array, got {type(given).__name__}.",
                    fix=f"pass the dict autostate.{'state' if kind == 'state' else 'param'}"
                    "_dict(model) returns (or one with the same keys).",
                )
            )
        fitting = {}
        for key, leaf in template.items():
            if key not in given:
                self.missing.append((kind, key))
                continue
            want, got = _spec(leaf), _spec(given[key])
            if want != got:
                detail = f"{key!r} (model {_format_spec(want, leaf)}, given {_format_spec(got, given[key])})"
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
            missing = [k for c, k in self.missing if c == kind]
            unexpected = [k for c, k in self.unexpected if c == kind]
            mismatched = [d for c, _, d in self.mismatched if c == kind]
            if missing:
                out.append(f"  missing {kind} keys ({len(missing)}): {_quoted(missing)}")
            if unexpected:
                out.append(f"  unexpected {kind} keys ({len(unexpected)}): {_quoted(unexpected)}")
            if mismatched:
                out.append(
                    f"  {kind} shape/dtype mismatches ({len(mismatched)}): {', '.join(mismatched)}"
                )
        return out

    def warning(self, message: str) -> StateDictWarning:
        return StateDictWarning(
            message,
            missing=tuple(self.missing),
            unexpected=tuple(self.unexpected),
            mismatched=tuple((c, k) for c, k, _ in self.mismatched),
        )


def _converted_like(template: Any, value: Any) -> Any:
    """``value`` as the same kind of object as ``template`` (dtype already checked)."""
    if isinstance(template, jax.Array):
        if isinstance(template, jax.core.Tracer):
            return jax.numpy.asarray(value)
        return jax.device_put(value, template.sharding)
    if isinstance(template, np.ndarray):
        return np.array(value, copy=True)
    if isinstance(template, np.generic):
        return np.asarray(value)[()]
    return np.asarray(value).item()


def _rebuild(
    model: Any,
    params: Mapping[str, Any] | None,
    states: Mapping[str, Any] | None,
    *,
    strict: bool,
    caller: str,
    error: type[Exception],
    where: str | None = None,
    saved_from: str | None = None,
) -> Any:
    f, nested = _handle(model, caller)
    report = _Report()
    param_leaves: dict[str, Any] = {}
    new_params: dict[str, Any] = {}
    if params is not None:
        param_leaves = _params(f.model)
        new_params = report.match("parameter", param_leaves, params)
    if states is not None:
        flat, layout = _flatten_states(nested)
        new_states = report.match("state", flat, states)
    if report:
        given = "checkpoint" if where else ("state" if params is None else "parameter") + " dict"
        what = f"autostate.{caller}: the {given} does not fit {type(model).__name__}"
        if saved_from:
            what += f" (it was saved from {saved_from})"
        if strict:
            raise error(
                format_error(
                    what + ":\n" + "\n".join(report.lines()),
                    where=where,
                    fix="load into a model built with the same configuration as the saved one, "
                    "or pass strict=False to load only the keys that fit (the rest keep the "
                    "model's values).",
                )
            )
        warnings.warn(
            report.warning(what + "; strict=False skipped:\n" + "\n".join(report.lines())),
            stacklevel=3,
        )
    if states is not None:
        flat.update({k: _converted_like(flat[k], v) for k, v in new_states.items()})
        nested = _unflatten_states(layout, flat)
    body = f.model
    if new_params:
        new_params = {k: _converted_like(param_leaves[k], v) for k, v in new_params.items()}
        body = _tree.map_tree(f.model, lambda leaf, name: new_params.get(name, leaf), _is_array)
    return _api.freeze(_api.FunctionalModel(f.handler_id, body), nested)


def load_state_dict(model: Any, state_dict: Mapping[str, Any], strict: bool = True) -> Any:
    """A copy of ``model`` holding the states of ``state_dict``.

    Example::

        sd = autostate.state_dict(trained)
        fresh = autostate.load_state_dict(Model(), sd)

    **Arguments:**
    - ``model``: the model to load into; it is not modified.
    - ``state_dict``: ``{name: array}`` as ``state_dict`` returns.
    - ``strict``: if true, missing keys, unexpected keys and shape or dtype
      mismatches raise one ``StateDictError`` listing every offending key. If
      false, only fitting keys are loaded and a ``StateDictWarning`` lists the
      skipped ones (states not loaded keep the model's values).

    **Returns:** a new model (states embedded as with ``autostate.freeze``);
    parameters are shared with ``model``.
    """
    return _rebuild(
        model, None, state_dict, strict=strict, caller="load_state_dict", error=StateDictError
    )


def load_param_dict(model: Any, param_dict: Mapping[str, Any], strict: bool = True) -> Any:
    """A copy of ``model`` holding the parameters of ``param_dict``.

    Example::

        pd = autostate.param_dict(trained)
        fresh = autostate.load_param_dict(Model(), pd)

    **Arguments:**
    - ``model``: the model to load into; it is not modified.
    - ``param_dict``: ``{path: array}`` as ``param_dict`` returns.
    - ``strict``: as for ``load_state_dict``.

    **Returns:** a new model; its states are ``model``'s, embedded as with
    ``autostate.freeze``.
    """
    return _rebuild(
        model, param_dict, None, strict=strict, caller="load_param_dict", error=StateDictError
    )


# --- .npz checkpoints ----------------------------------------------------------


def _dtype_named(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        return np.dtype(getattr(ml_dtypes, name))


def _bytes_of(array: np.ndarray) -> np.ndarray:
    return array.reshape(-1).view(np.uint8)


def _encode(value: Any) -> tuple[np.ndarray, dict[str, Any]]:
    array = np.asarray(value)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    if not array.flags.c_contiguous:
        array = array.copy(order="C")
    dtype = array.dtype
    # numpy writes ml_dtypes (bfloat16, float8, int4) as opaque void records
    # that other readers cannot interpret; their raw bits are portable.
    stored = array if dtype.kind in "biufc" else array.view(f"<u{dtype.itemsize}")
    entry = {
        "dtype": dtype.name,
        "shape": list(array.shape),
        "stored": stored.dtype.str,
        "sha256": hashlib.sha256(_bytes_of(stored)).hexdigest(),
    }
    return stored, entry


def _write_atomically(path: Path, arrays: dict[str, np.ndarray]) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "xb") as fh:
            np.savez(fh, **arrays)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save(path: str | os.PathLike[str], model: Any) -> None:
    """Writes every parameter and state of ``model`` to ``path`` (``.npz``).

    Example::

        autostate.save("ckpt.npz", model)
        model = autostate.load("ckpt.npz", like=Model())

    The file is a plain numpy ``.npz`` (readable with ``allow_pickle=False``):
    one member per array plus a JSON manifest giving each array's kind,
    name, dtype, shape and SHA-256. bfloat16 and other ml_dtypes are stored
    as unsigned integers of the same width, so the round trip is bit-exact.
    The file is written to a temporary name and renamed, so ``path`` holds
    either the previous file or the complete new one.

    **Arguments:**
    - ``path``: the file to write, used as given (no suffix is added).
    - ``model``: a ``@stateful`` instance.
    """
    params, states = _flat_dicts(model, "save")
    arrays: dict[str, np.ndarray] = {}
    entries = []
    for kind, flat in (("params", params), ("states", states)):
        for name, value in flat.items():
            member = f"a{len(entries)}"
            arrays[member], entry = _encode(value)
            entries.append({"kind": kind, "name": name, "member": member, **entry})
    manifest = {
        "format": _FORMAT,
        "version": _VERSION,
        "model": f"{type(model).__module__}.{type(model).__qualname__}",
        "arrays": entries,
    }
    arrays[_MANIFEST] = np.array(json.dumps(manifest))
    _write_atomically(Path(path), arrays)


def _corrupt(path: Path, what: str) -> CheckpointError:
    return CheckpointError(
        format_error(
            f"Checkpoint is corrupted: {what}.",
            where=str(path),
            fix="load an intact copy; autostate.save writes atomically, so a file it "
            "wrote is complete unless something changed it afterwards.",
        )
    )


def _decode(npz: Any, entry: Mapping[str, Any], path: Path) -> np.ndarray:
    raw = npz[entry["member"]]
    dtype, stored = _dtype_named(entry["dtype"]), np.dtype(entry["stored"])
    shape = tuple(entry["shape"])
    if raw.dtype != stored or raw.shape != shape:
        raise _corrupt(
            path,
            f"{entry['kind']} {entry['name']!r} is {raw.dtype}{list(raw.shape)}, "
            f"the manifest says {stored}{list(shape)}",
        )
    if hashlib.sha256(_bytes_of(raw)).hexdigest() != entry["sha256"]:
        raise _corrupt(path, f"checksum mismatch in {entry['kind']} {entry['name']!r}")
    return raw if stored == dtype else raw.view(dtype)


def _read(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, Any], str | None]:
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as npz:
            if not isinstance(npz, np.lib.npyio.NpzFile) or _MANIFEST not in npz.files:
                raise CheckpointError(
                    format_error(
                        "Not an autostate checkpoint: the file has no autostate manifest.",
                        where=str(path),
                        fix="load files written by autostate.save; for a bare .npz of a "
                        "flat dict use numpy.load and autostate.load_state_dict.",
                    )
                )
            manifest = json.loads(npz[_MANIFEST].item())
            if manifest.get("format") != _FORMAT or manifest.get("version") != _VERSION:
                raise _corrupt(
                    path, f"unknown format {manifest.get('format')!r} v{manifest.get('version')}"
                )
            out: dict[str, dict[str, Any]] = {"params": {}, "states": {}}
            for entry in manifest["arrays"]:
                if entry["name"] in out[entry["kind"]]:
                    raise _corrupt(path, f"{entry['kind']} {entry['name']!r} appears twice")
                out[entry["kind"]][entry["name"]] = _decode(npz, entry, path)
    except (CheckpointError, FileNotFoundError):
        raise
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, KeyError, TypeError) as e:
        raise _corrupt(path, f"{type(e).__name__}: {e}") from e
    return out["params"], out["states"], manifest.get("model")


def load(path: str | os.PathLike[str], *, like: Any, strict: bool = True) -> Any:
    """Reads a checkpoint written by ``save`` into a copy of ``like``.

    Example::

        autostate.save("ckpt.npz", model)
        model = autostate.load("ckpt.npz", like=Model())

    The whole file is read and checked (checksums, then every key, shape and
    dtype against ``like``) before a model is built, so a truncated or
    corrupted file raises ``CheckpointError`` and nothing is half loaded.

    **Arguments:**
    - ``path``: a file written by ``autostate.save``.
    - ``like``: a model of the same structure (freshly constructed is fine);
      it is not modified.
    - ``strict``: as for ``load_state_dict``.

    **Returns:** a new model holding the saved parameters and states.
    """
    params, states, saved_from = _read(path)
    return _rebuild(
        like,
        params,
        states,
        strict=strict,
        caller="load",
        error=CheckpointError,
        where=str(path),
        saved_from=saved_from,
    )


def load_arrays(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``(param_dict, state_dict)`` stored by ``save``, without a model.

    Example::

        params, states = autostate.load_arrays("ckpt.npz")
        out, states = exported.call(states, x)   # an autostate.export program

    **Returns:** two dicts of numpy arrays, checked as ``load`` checks them.
    """
    params, states, _ = _read(path)
    return params, states


# --- jax.export ------------------------------------------------------------------


def _shape_dtype(x: Any) -> jax.ShapeDtypeStruct:
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    spec = _spec(x)
    if spec is None:
        raise TypeError(
            format_error(
                f"autostate.export takes arrays or jax.ShapeDtypeStruct as example "
                f"arguments, got a {type(x).__name__}.",
                fix="pass arrays (or pytrees of them); bind other arguments in a method.",
            )
        )
    return jax.ShapeDtypeStruct(spec[0], jax.dtypes.canonicalize_dtype(spec[1]))


def export(
    model: Any,
    *example_args: Any,
    method: str = "__call__",
    platforms: Sequence[str] | None = None,
) -> jax.export.Exported:
    """``model.<method>`` as a ``jax.export.Exported`` that threads states.

    Example::

        exp = autostate.export(model, x)
        blob = exp.serialize()                        # bytes for another process
        exp = jax.export.deserialize(blob)
        out, states = exp.call(autostate.state_dict(model), x)

    The program's call is ``(states, *args) -> (out, new_states)`` where
    ``states`` is the flat dict ``state_dict(model)`` returns. Parameters are
    baked in as constants. Serialization needs the ``flatbuffers`` package
    (``pip install autostate[export]``).

    **Arguments:**
    - ``model``: a ``@stateful`` instance.
    - ``example_args``: arrays or ``jax.ShapeDtypeStruct``s (or pytrees of
      them) giving the shapes and dtypes the program accepts.
    - ``method``: the method to export (default ``"__call__"``).
    - ``platforms``: lowering platforms (default: the current backend).

    **Returns:** the ``jax.export.Exported``.
    """
    f, states = _handle(model, "export")
    flat, layout = _flatten_states(states)
    call = f if method == "__call__" else getattr(f, method)

    def step(flat_states: dict[str, Any], *args: Any) -> tuple[Any, dict[str, Any]]:
        out, new_states = call(_unflatten_states(layout, flat_states), *args)
        return out, _flatten_states(new_states)[0]

    step.__name__ = f"{type(model).__name__}_{method.strip('_') or 'call'}"
    specs = jax.tree_util.tree_map(_shape_dtype, (flat, example_args))
    return jax.export.export(jax.jit(step), platforms=platforms)(specs[0], *specs[1])


# --- repr ---------------------------------------------------------------------------

_WIDTH = 80
_STATIC_WIDTH = 40


def _clip(text: str, width: int = _STATIC_WIDTH) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _layout(open_: str, items: list[str], close: str) -> str:
    line = open_ + ", ".join(items) + close
    if len(line) <= _WIDTH and "\n" not in line:
        return line
    body = "".join("  " + item.replace("\n", "\n  ") + ",\n" for item in items)
    return f"{open_}\n{body}{close}"


class _ReprWriter:
    """Formats one model graph: parameters by shape, states by name and kind."""

    def __init__(self, root: Any):
        self.seen: dict[int, str] = {}
        self.slot_names: dict[int, str] = {}
        for name, slot in _tree.iter_tree(root, lambda x: type(x) in SLOT_TYPES):
            self.slot_names.setdefault(id(slot), name)

    def node(self, value: Any, path: str) -> str:
        t = type(value)
        if _tree.is_stateful_instance(value):
            return self.instance(value, path)
        if t in SLOT_TYPES:
            return self.state(value)
        if _is_array(value) or isinstance(value, jax.ShapeDtypeStruct):
            return _format_spec(_spec(value))
        if t is list or t is tuple:
            items = [
                self.node(v, path + _tree.key_name(jax.tree_util.SequenceKey(i)))
                for i, v in enumerate(value)
            ]
            if t is list:
                return _layout("[", items, "]")
            return _layout("(", items, ",)" if len(items) == 1 else ")")
        if t is dict:
            items = [
                f"{k!r}: {self.node(v, path + _tree.key_name(jax.tree_util.DictKey(k)))}"
                for k, v in value.items()
            ]
            return _layout("{", items, "}")
        if _tree.is_dynamic(value):
            try:
                shown = jax.tree_util.tree_map(_Shown.of, value)
            except Exception:  # an unflatten that validates its children
                return f"{type(value).__name__}(...)"
            return _clip(repr(shown), _WIDTH)
        return _clip(repr(value))

    def instance(self, obj: Any, path: str) -> str:
        cls = type(obj).__name__
        if id(obj) in self.seen:
            return f"<{cls}, same as {self.seen[id(obj)]!r}>"
        self.seen[id(obj)] = _tree.path_name(path) or "self"
        state_attrs = type(obj).__autostate_info__.state
        items = []
        for attr, value in vars(obj).items():
            sub = path + _tree.key_name(jax.tree_util.GetAttrKey(attr))
            if attr in state_attrs and type(value) not in SLOT_TYPES:
                # Another engine's slot (the host fallback): its value lives elsewhere.
                name = getattr(value, "name", None) or _tree.path_name(sub)
                category = getattr(value, "category", None)
                items.append(
                    f"{attr}=<{type(value).__name__} state {name!r} category={category!r}>"
                )
                continue
            items.append(f"{attr}={self.node(value, sub)}")
        return _layout(f"{cls}(", items, ")")

    def state(self, slot: Any) -> str:
        name = slot.name if slot.name is not None else self.slot_names.get(id(slot), "?")
        head = f"state {name!r} category={slot.category!r}"
        if isinstance(slot, InitialLocalStateRequest):
            init = slot.state_initializer
            if isinstance(init, InitialValue):
                return f"<initial {head}: {self.node(init.value, '')}>"
            return f"<initial {head}: {_clip(repr(init))}>"
        if isinstance(slot, FrozenLocalStateRequest):
            return f"<frozen {head}: {self.node(slot.state, '')}>"
        if isinstance(slot, HandledLocalStateRef):
            return f"<handled {head} by {slot.handler_id!r}>"
        return f"<shared {head}>"


class _Shown:
    """A leaf standing for an array in the repr of a foreign pytree node."""

    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text

    @classmethod
    def of(cls, leaf: Any) -> Any:
        return cls(_format_spec(_spec(leaf))) if _spec(leaf) is not None else leaf

    def __repr__(self) -> str:
        return self.text


def model_repr(obj: Any) -> str:
    """``repr`` of a ``@stateful`` instance: class, parameters, states.

    Example::

        >>> BatchNorm(3)
        BatchNorm(scale=f32[3], mean=<initial state 'mean' category='state': f32[3]>, ...)

    Parameters show as ``dtype[shape]``; each state shows whether it is
    ``initial`` (as constructed), ``frozen`` (embedded by ``freeze``/``load``),
    ``handled`` (inside a functionalized model) or ``shared``, with its
    name, category and value's shape. A sub-model reachable from two paths is
    written out once. ``@stateful`` installs this as ``__repr__`` on classes
    that do not define their own.
    """
    return _ReprWriter(obj).node(obj, "")


# --- treescope ----------------------------------------------------------------------

# Background of a state's box and color of its label in treescope's HTML view.
TREESCOPE_STATE_COLOR = "#ffd966"
_TREESCOPE_LABEL_STYLE = "color: #9c5700; font-weight: bold"

# (treescope path of the outermost model being rendered, its slots' state names)
_treescope_root: contextvars.ContextVar[tuple[str, dict[int, str]] | None] = (
    contextvars.ContextVar("autostate_treescope_root", default=None)
)


class _TreescopeState:
    """One state attribute as treescope shows it: a highlighted, labelled box."""

    __slots__ = ("label", "value", "has_value")

    def __init__(self, label: str, value: Any = None, has_value: bool = False):
        self.label = label
        self.value = value
        self.has_value = has_value

    @classmethod
    def of(cls, slot: Any, name: str) -> _TreescopeState:
        head = f"state {name!r} category={getattr(slot, 'category', None)!r}"
        if isinstance(slot, InitialLocalStateRequest):
            init = slot.state_initializer
            value = init.value if isinstance(init, InitialValue) else init
            return cls(f"initial {head}", value, True)
        if isinstance(slot, FrozenLocalStateRequest):
            return cls(f"frozen {head}", slot.state, True)
        if isinstance(slot, HandledLocalStateRef):
            return cls(f"handled {head} by {slot.handler_id!r}")
        if type(slot) in SLOT_TYPES:
            return cls(f"shared {head}")
        # Another engine's slot (the host fallback): its value lives elsewhere.
        return cls(f"{type(slot).__name__} {head}")

    def __treescope_repr__(self, path: str | None, subtree_renderer: Any) -> Any:
        from treescope import rendering_parts as parts

        label = parts.custom_style(parts.text(self.label), _TREESCOPE_LABEL_STYLE)
        if not self.has_value:
            return parts.build_one_line_tree_node(
                parts.siblings("<", label, ">"), path, background_color=TREESCOPE_STATE_COLOR
            )
        return parts.build_foldable_tree_node_from_children(
            prefix=parts.siblings("<", label, ": "),
            children=[subtree_renderer(self.value, path=path)],
            suffix=">",
            path=path,
            background_color=TREESCOPE_STATE_COLOR,
        )


def model_treescope_repr(obj: Any, path: str | None, subtree_renderer: Any) -> Any:
    """``__treescope_repr__`` of a ``@stateful`` instance (needs ``treescope``).

    ``treescope.render_to_text(model)`` and treescope's HTML view show the
    class with its parameters and sub-models as children; each state is a box
    highlighted in ``TREESCOPE_STATE_COLOR`` labelled like the plain repr,
    e.g. ``<initial state 'blocks[0].norm.mean' category='state': ...>``, with
    names relative to the outermost model rendered. ``@stateful`` installs
    this on classes that define no ``__treescope_repr__`` of their own.
    """
    from treescope import repr_lib  # optional: pip install autostate[treescope]

    root = _treescope_root.get()
    token = None
    if root is None:
        names: dict[int, str] = {}
        for name, slot in _tree.iter_tree(obj, lambda x: type(x) in SLOT_TYPES):
            names.setdefault(id(slot), name)
        root = (path or "", names)
        token = _treescope_root.set(root)
    try:
        root_path, slot_names = root
        state_attrs = type(obj).__autostate_info__.state
        attributes: dict[str, Any] = {}
        for attr, value in vars(obj).items():
            if attr not in state_attrs:
                attributes[attr] = value
                continue
            name = getattr(value, "name", None) or slot_names.get(id(value))
            if name is None:  # a host slot: named by its path from the root
                here = f"{path}.{attr}" if path is not None else attr
                relative = here[len(root_path) :] if here.startswith(root_path) else attr
                name = _tree.path_name(relative)
            attributes[attr] = _TreescopeState.of(value, name)
        return repr_lib.render_object_constructor(
            object_type=type(obj),
            attributes=attributes,
            path=path,
            subtree_renderer=subtree_renderer,
        )
    finally:
        if token is not None:
            _treescope_root.reset(token)
