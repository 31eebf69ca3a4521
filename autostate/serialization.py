"""The checkpoint file format: ``save``, ``load`` and ``load_arrays``.

Both flat dicts of ``state_dicts`` in one ``.npz`` with a JSON manifest.
Dtypes numpy cannot store portably (bfloat16, float8, int4) go in as their
raw bits, and every array carries a SHA-256, so a damaged file is an error,
never a half-loaded model. Nothing is pickled.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import uuid
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import jax
import ml_dtypes
import numpy as np
from jax.experimental import multihost_utils

from autostate.errors import CheckpointError, InvalidTypeError, format_error, user_location
from autostate.state_dicts import flat_dicts, rebuild

T = TypeVar("T")
P = ParamSpec("P")

_FORMAT = "autostate-checkpoint"
_VERSION = 1
_MANIFEST = "__autostate_manifest__"


def _dtype_named(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        return np.dtype(getattr(ml_dtypes, name))


def _bytes_of(array: np.ndarray) -> np.ndarray:
    return array.reshape(-1).view(np.uint8)


def _is_key(value: Any) -> bool:
    dtype = getattr(value, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _readable(dtype: np.dtype) -> bool:
    """Whether numpy reads ``dtype``'s descriptor (``dtype.str``) back as ``dtype``."""
    try:
        return dtype.kind in "biufc" and np.dtype(dtype.str) == dtype
    except TypeError:
        return False


def _encode(value: Any) -> tuple[np.ndarray, dict[str, Any]]:
    if _is_key(value):
        # A typed PRNG key is stored as its raw key data plus the name of its
        # implementation, so load rebuilds the same key bit for bit.
        stored, entry = _encode(jax.random.key_data(value))
        return stored, {**entry, "key_impl": str(jax.random.key_impl(value))}
    array = _host_copy(value)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    if not array.flags.c_contiguous:
        array = array.copy(order="C")
    dtype = array.dtype
    # numpy writes ml_dtypes (bfloat16, float8, int4) as opaque void records
    # that other readers cannot interpret, or (float8_e5m2) as a descriptor
    # numpy cannot read back ('<f1'); their raw bits are portable.
    stored = array if _readable(dtype) else array.view(f"<u{dtype.itemsize}")
    entry = {
        "dtype": dtype.name,
        "shape": list(array.shape),
        "stored": stored.dtype.str,
        "sha256": hashlib.sha256(_bytes_of(stored)).hexdigest(),  # type: ignore[arg-type]
    }
    if getattr(value, "weak_type", False):
        # (``jnp.full(n, 0.5)``, ``jnp.asarray(1.0)``: it takes the dtype of what
        # it meets, so a bfloat16 input stays bfloat16 after the round trip.)
        entry["weak_type"] = True
    return stored, entry


def _host_copy(value: Any) -> np.ndarray:
    """``value`` whole in host memory, gathered from every process it spans.

    An array split over several processes' devices is not readable by one
    process alone; ``process_allgather`` is a collective, so every process
    reaches it, in the same order (the arrays' order and shardings are the
    same in every process of an SPMD program).
    """
    if isinstance(value, jax.Array) and not value.is_fully_addressable and not value.is_fully_replicated:
        return np.asarray(multihost_utils.process_allgather(value, tiled=True))
    return np.asarray(value)


def _write_from_process_zero(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Writes ``arrays`` from process 0 only; the others wait until it is done.

    Process 0's outcome is broadcast (a collective, so also a barrier): when
    ``save`` returns in any process the file is complete, and a failed write
    is an error in every process rather than a hang in the others.
    """
    error: Exception | None = None
    if jax.process_index() == 0:
        try:
            _write_atomically(path, arrays)
        except Exception as e:  # noqa: BLE001 - re-raised below, after the others know
            error = e
    written = multihost_utils.broadcast_one_to_all(np.int32(error is None))
    if error is not None:
        raise error
    if not written:
        raise CheckpointError(format_error(
            f"autostate.save: process 0 failed to write {path}; see its error.",
            fix="make the path writable by process 0 (the one process that writes it), "
            "then save again from every process.",
        ))


def _write_atomically(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Writes ``arrays`` to a temporary file beside ``path`` and renames it; an
    error names ``path``, the file the user gave, not the temporary one."""
    if path.is_dir():
        raise _directory_error(path, "save")
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "xb") as fh:
            np.savez(fh, **arrays)  # type: ignore[arg-type]
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        if path.is_dir():  # (made a directory meanwhile)
            raise _directory_error(path, "save") from None
        if str(tmp) not in (err.filename, err.filename2):
            raise
        # (The same kind of error -- no such directory, permission denied --
        # about the user's path.)
        raise type(err)(err.errno, err.strerror, os.fspath(path)) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _directory_error(path: Path, verb: str) -> CheckpointError:
    return CheckpointError(format_error(
        f"autostate.{verb} was given {path}, which is a directory: a checkpoint is one file.",
        where=user_location(),
        fix=f"give a file's path, for example inside it: "
        f"`autostate.{verb}(os.path.join({str(path)!r}, 'model.npz'), ...)`.",
    ))


def _path_first(fn: Callable[P, T]) -> Callable[P, T]:
    """``fn`` (``save`` or ``load``), refusing torch's argument order in words.

    ``torch.save(obj, path)`` takes the object first, and a model is loaded
    into with ``model.load_state_dict(torch.load(path))``; here the path comes
    first and ``load`` takes the model to fill as ``like=``. Without this,
    ``save(model, path)`` fails inside ``pathlib``.
    """
    name = fn.__name__
    usage = {
        "save": "`autostate.save(path, model)`",
        "load": "`model = autostate.load(path, like=model)` (a new model; the one given "
        "is not changed)",
    }[name]

    @functools.wraps(fn)
    def checked(*args: P.args, **kwargs: P.kwargs) -> T:
        first = args[0] if args else kwargs.get("path")
        if not isinstance(first, (str, os.PathLike)):
            problem = f"autostate.{name} takes the file's path first, and got a {type(first).__name__}"
            if name == "save" and len(args) > 1 and isinstance(args[1], (str, os.PathLike)):
                problem += " (torch.save takes the object first; autostate.save the path)"
            raise InvalidTypeError(
                format_error(problem + ".", where=user_location(), fix=f"call {usage}.")
            )
        if name == "load" and len(args) > 1:
            raise InvalidTypeError(format_error(
                f"autostate.load takes the model to load into as the keyword `like=`, "
                f"and got a {type(args[1]).__name__} as a second positional argument.",
                where=user_location(),
                fix=f"call {usage}.",
            ))
        return fn(*args, **kwargs)

    return checked


@_path_first
def save(path: str | os.PathLike[str], model: Any) -> None:
    """Writes every parameter and state of ``model`` to ``path`` (``.npz``).

    The file is a plain numpy ``.npz`` (readable with ``allow_pickle=False``):
    one member per array plus a JSON manifest giving each array's kind,
    name, dtype, shape and SHA-256. bfloat16 and other ml_dtypes are stored
    as unsigned integers of the same width, and typed PRNG keys as their key
    data with the name of their implementation, so the round trip is
    bit-exact. The file is written to a temporary name and renamed, so
    ``path`` holds either the previous file or the complete new one.

    With several JAX processes, every process must call ``save``: arrays
    that span processes are gathered from all of them (a collective), process
    0 alone writes ``path`` and the others return once it has; if it cannot,
    every process raises. See the multi-process guide; for large models use
    orbax, which writes each process's shards without gathering.

    Args:
        path: the file to write, used as given (no suffix is added).
        model: a ``@stateful`` instance.

    Examples:
        >>> import os, tempfile
        >>> @autostate.stateful
        ... class Counter:
        ...     def __init__(self):
        ...         self.count = jnp.zeros((), jnp.int32)
        ...         self.w = jnp.ones(2)
        ...
        ...     def __call__(self, x):
        ...         self.count += 1
        ...         return self.w * x
        >>> model = Counter()
        >>> _ = model(1.0)
        >>> path = os.path.join(tempfile.mkdtemp(), "counter.npz")
        >>> autostate.save(path, model)
        >>> print(autostate.load(path, like=Counter()).count)
        1
    """
    params, states = flat_dicts(model, "save")
    arrays: dict[str, np.ndarray] = {}
    entries: list[dict[str, Any]] = []
    for kind, flat in (("params", params), ("states", states)):
        for name, value in flat.items():
            member = f"a{len(entries)}"
            arrays[member], entry = _encode(value)
            entries.append({"kind": kind, "name": name, "member": member, **entry})
    model_name = f"{type(model).__module__}.{type(model).__qualname__}"
    manifest = {"format": _FORMAT, "version": _VERSION, "model": model_name, "arrays": entries}
    arrays[_MANIFEST] = np.array(json.dumps(manifest))
    (_write_from_process_zero if jax.process_count() > 1 else _write_atomically)(Path(path), arrays)


def _corrupt(path: Path, what: str) -> CheckpointError:
    return CheckpointError(format_error(
        f"Checkpoint {path} is corrupted: {what}.",
        fix="load an intact copy; autostate.save writes atomically, so a file it "
        "wrote is complete unless something changed it afterwards.",
    ))


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
    if hashlib.sha256(_bytes_of(raw)).hexdigest() != entry["sha256"]:  # type: ignore[arg-type]
        raise _corrupt(path, f"checksum mismatch in {entry['kind']} {entry['name']!r}")
    data = raw if stored == dtype else raw.view(dtype)
    return jax.random.wrap_key_data(data, impl=entry["key_impl"]) if "key_impl" in entry else data


def _read(
    path: str | os.PathLike[str], weak: dict[str, set[str]] | None = None
) -> tuple[dict[str, Any], dict[str, Any], str | None]:
    """The parameters and states of the checkpoint at ``path``, and the model it
    names; ``weak`` (by kind) gets the names of the weakly typed arrays."""
    path = Path(path)
    if path.is_dir():
        raise _directory_error(path, "load")
    try:
        with np.load(path, allow_pickle=False) as npz:
            if not isinstance(npz, np.lib.npyio.NpzFile) or _MANIFEST not in npz.files:
                raise CheckpointError(format_error(
                    f"Not an autostate checkpoint: {path} has no autostate manifest.",
                    fix="load files written by autostate.save; for a bare .npz of a "
                    "flat dict use numpy.load and autostate.load_state_dict.",
                ))
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
                if weak is not None and entry.get("weak_type"):
                    weak.setdefault(entry["kind"], set()).add(entry["name"])
    except (CheckpointError, FileNotFoundError):
        raise
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, KeyError, TypeError) as e:
        raise _corrupt(path, f"{type(e).__name__}: {e}") from e
    return out["params"], out["states"], manifest.get("model")


@_path_first
def load(path: str | os.PathLike[str], *, like: T, strict: bool = True) -> T:
    """Reads a checkpoint written by ``save`` into a copy of ``like``.

    The whole file is read and checked (checksums, then every key, shape and
    dtype against ``like``) before a model is built, so a truncated or
    corrupted file raises ``CheckpointError`` and nothing is half loaded.

    Each array is placed with the sharding of the matching array of
    ``like``. With several JAX processes, every process calls ``load`` and
    reads the whole file (it must be readable on every host); placing arrays
    whose sharding spans processes takes all of them.

    Args:
        path: a file written by ``autostate.save``.
        like: a model of the same structure (freshly constructed is fine);
            it is not modified.
        strict: as for ``load_state_dict``.

    Returns:
        A new model holding the saved parameters and states.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CheckpointError: the file is not an autostate checkpoint, is
            truncated or corrupted, or does not fit ``like``.

    Examples:
        >>> import os, tempfile
        >>> @autostate.stateful
        ... class Linear:
        ...     def __init__(self, w):
        ...         self.w = w
        ...
        ...     def __call__(self, x):
        ...         return self.w * x
        >>> path = os.path.join(tempfile.mkdtemp(), "linear.npz")
        >>> autostate.save(path, Linear(jnp.full(2, 3.0)))
        >>> model = autostate.load(path, like=Linear(jnp.zeros(2)))
        >>> print(model(jnp.ones(2)))
        [3. 3.]
    """
    weak: dict[str, set[str]] = {}
    params, states, saved_from = _read(path, weak)
    return rebuild(
        like, params, states, strict=strict, caller="load", error=CheckpointError,
        checkpoint=str(path), saved_from=saved_from,
        weak=(weak.get("params", set()), weak.get("states", set())),
    )


def load_arrays(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``(param_dict, state_dict)`` stored by ``save``, without a model.

    Args:
        path: a file written by ``autostate.save``.

    Returns:
        Two dicts of numpy arrays, checked as ``load`` checks them (an
        ``autostate.export`` program takes the second as its states).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CheckpointError: the file is not an autostate checkpoint, or is
            truncated or corrupted.

    Examples:
        >>> import os, tempfile
        >>> @autostate.stateful
        ... class Counter:
        ...     def __init__(self):
        ...         self.count = jnp.zeros((), jnp.int32)
        ...         self.w = jnp.ones(2)
        ...
        ...     def __call__(self, x):
        ...         self.count += 1
        ...         return self.w * x
        >>> path = os.path.join(tempfile.mkdtemp(), "counter.npz")
        >>> autostate.save(path, Counter())
        >>> params, states = autostate.load_arrays(path)  # no model needed
        >>> print(sorted(params), sorted(states))
        ['w'] ['count']
    """
    params, states, _ = _read(path)
    return params, states
