"""Rewritten source in, code objects out: compile at the user's lines, rebuild, cache.

``compile_method`` compiles rewritten wrapper source with the original file
name so that line ``n`` of the result is line ``n`` of the user's file;
``build_function`` rebuilds a function from such a code object and the original function's globals, defaults and closure
cells (``__class__`` included). Results are cached in memory and on disk,
keyed by the file's content hash, the class, the Python version and a hash of
this package's transform code. No JAX here.
"""

from __future__ import annotations
import __future__

import functools
import hashlib
import marshal
import os
import sys
import tempfile
import time
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from autostate.transform.method import OUTER_NAME
from autostate.transform.source import MethodSlot, remember_original, source_lines

_FUTURE_FLAGS = functools.reduce(
    lambda acc, name: acc | getattr(__future__, name).compiler_flag, __future__.all_feature_names, 0
)


def _find_code(code: types.CodeType, name: str) -> types.CodeType:
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            if const.co_name == name:
                return const
            if const.co_name == f"<generic parameters of {name}>":
                # ``def go[T](self, ...)`` (Python 3.12+): the function's code
                # sits in the scope of its type parameters.
                return _find_code(const, name)
    raise LookupError(name)


def _shift_lines(code: types.CodeType, shift: int) -> types.CodeType:
    consts = tuple(
        _shift_lines(c, shift) if isinstance(c, types.CodeType) else c for c in code.co_consts
    )
    return code.replace(co_firstlineno=code.co_firstlineno + shift, co_consts=consts)


def _read_varint(table: bytes, i: int) -> tuple[int, int]:
    byte = table[i]
    value, bits = byte & 63, 6
    while byte & 64:
        i += 1
        byte = table[i]
        value |= (byte & 63) << bits
        bits += 6
    return value, i + 1


def _signed_varint(value: int) -> bytes:
    rest = (-value << 1) | 1 if value < 0 else value << 1
    out = bytearray()
    while rest >= 64:
        out.append(64 | (rest & 63))
        rest >>= 6
    out.append(rest)
    return bytes(out)


def _drop_columns(code: types.CodeType, lines: set[int]) -> types.CodeType:
    """``code`` without column positions on ``lines`` (3.11+ location table).

    A traceback underlines the columns of the failing expression; on a
    rewritten line those columns are the generated code's and would underline
    the wrong part of the user's line, so such lines keep only their number.
    """
    consts = tuple(
        _drop_columns(c, lines) if isinstance(c, types.CodeType) else c for c in code.co_consts
    )
    table, out, i, line = code.co_linetable, bytearray(), 0, code.co_firstlineno
    while i < len(table):
        start = i
        kind, length = (table[i] >> 3) & 15, table[i] & 7
        i += 1
        if kind == 15:  # no location
            out += table[start:i]
            continue
        if kind in (13, 14):  # line delta only / long form
            raw, i = _read_varint(table, i)
            delta = -(raw >> 1) if raw & 1 else raw >> 1
            if kind == 14:
                for _ in range(3):
                    _, i = _read_varint(table, i)
        elif kind >= 10:  # one-line form: the delta is in the kind
            delta, i = kind - 10, i + 2
        else:  # short form: same line
            delta, i = 0, i + 1
        line += delta
        if line in lines:
            out.append(0x80 | (13 << 3) | length)
            out += _signed_varint(delta)
        else:
            out += table[start:i]
    return code.replace(co_linetable=bytes(out), co_consts=consts)


def compile_method(
    source: str, filename: str, class_name: str, function_name: str, shift: int, flags: int,
    runtime: str | None = None, loops: Sequence[Any] = (), state: frozenset[str] = frozenset(),
) -> types.CodeType:
    """Compiles wrapper source and returns the code of the method inside it.

    Line ``n`` of ``source`` is line ``n + shift`` of ``filename``; blank lines
    in front put it there (when the header leaves room), so the code objects
    carry the user's line numbers from the compiler itself. With ``runtime``
    (the name the method reaches the runtime by) and ``loops`` (the
    analysis's facts of its ``for`` statements), its loops are given their
    rolled form (``loops.roll_loops``, in a class whose states are ``state``)
    on the way.
    """
    pad = max(shift, 0)
    text = "\n" * pad + source
    module_code = None
    if runtime is not None and loops:
        import ast

        from autostate.transform import loops as rolling

        tree = ast.parse(text, filename)
        if rolling.roll_loops(tree, function_name, runtime, loops, state):
            try:
                module_code = compile(
                    tree, filename, "exec", flags=flags & _FUTURE_FLAGS, dont_inherit=True
                )
            except (SyntaxError, ValueError, TypeError):
                # (A loop form the rolling does not know how to write: its loops
                # then run as written, layer by layer, as plain Python's do.)
                module_code = None
    if module_code is None:
        module_code = compile(
            text, filename, "exec", flags=flags & _FUTURE_FLAGS, dont_inherit=True
        )
    outer = _find_code(_find_code(module_code, class_name), OUTER_NAME)
    code = _find_code(outer, function_name)
    original = source_lines(filename)
    changed = {
        number + pad
        for number, text in enumerate(source.splitlines(keepends=True), start=1)
        if not 0 < number + shift <= len(original) or original[number + shift - 1] != text
    }
    code = _drop_columns(code, changed)
    return _shift_lines(code, shift - pad) if shift != pad else code


def _same_code(a: types.CodeType, b: types.CodeType) -> bool:
    # Names, not bytecode: the same source compiled another way (from an AST,
    # as pytest's assertion rewriting does) gives other instructions.
    def signature(c: types.CodeType) -> tuple:
        return (c.co_name, c.co_varnames, frozenset(c.co_names), c.co_argcount,
                c.co_kwonlyargcount, c.co_freevars)

    if signature(a) != signature(b):
        return False
    nested_a = [c for c in a.co_consts if isinstance(c, types.CodeType)]
    nested_b = [c for c in b.co_consts if isinstance(c, types.CodeType)]
    return len(nested_a) == len(nested_b) and all(map(_same_code, nested_a, nested_b))


def compiles_to(wrapper_source: str, source: Any, code: types.CodeType) -> bool:
    """Whether the (unrewritten) wrapper source of ``source`` compiles to ``code``
    (line numbers are not compared).

    The check that the block found in the file at ``code``'s first line is the
    function that was imported, not another one edited or moved there since.
    """
    try:
        module_code = compile(
            wrapper_source, source.filename, "exec",
            flags=code.co_flags & _FUTURE_FLAGS, dont_inherit=True,
        )
        outer = _find_code(_find_code(module_code, source.mangle_as), OUTER_NAME)
        found = _find_code(outer, code.co_name)
    except (SyntaxError, LookupError, ValueError):
        return False
    return _same_code(found, code)


def named_as(code: types.CodeType, qualname: str) -> types.CodeType:
    """``code`` (a method compiled inside the wrapper) named ``qualname``, the
    original method's, and so the functions, lambdas and classes defined in
    it: ``M.__init__.<locals>.<lambda>``, as plain Python names them, not
    ``M.__autostate_outer__.<locals>.__init__.<locals>.<lambda>``."""
    return _with_qualname(code, code.co_qualname, qualname)


def _with_qualname(code: types.CodeType, old: str, new: str) -> types.CodeType:
    consts = tuple(
        _with_qualname(c, old, new) if isinstance(c, types.CodeType)
        # (A class body stores its ``__qualname__`` from a constant.)
        else new + c[len(old):] if isinstance(c, str) and c.startswith(old + ".") else c
        for c in code.co_consts
    )
    qualname = code.co_qualname
    if qualname == old or qualname.startswith(old + "."):
        qualname = new + qualname[len(old):]
    return code.replace(co_qualname=qualname, co_consts=consts)


def build_function(
    code: types.CodeType, original: types.FunctionType, runtime: types.ModuleType
) -> types.FunctionType:
    """A function with ``code`` and everything else of ``original``.

    The wrapper's parameters are ``original``'s free variables and the
    runtime's name (``method.runtime_name``, which varies by method), so a
    free variable of ``code`` that ``original`` lacks is the runtime's.
    """
    cells = dict(zip(original.__code__.co_freevars, original.__closure__ or ()))
    runtime_cell = types.CellType(runtime)
    closure = tuple(cells.get(name, runtime_cell) for name in code.co_freevars)
    fn = types.FunctionType(
        code, original.__globals__, original.__name__, original.__defaults__, closure
    )
    fn.__kwdefaults__ = original.__kwdefaults__
    fn.__qualname__ = original.__qualname__
    fn.__module__ = original.__module__
    fn.__doc__ = original.__doc__
    fn.__annotations__ = original.__annotations__
    if getattr(original, "__type_params__", ()):
        fn.__type_params__ = original.__type_params__  # type: ignore[attr-defined]  # (3.12+)
    fn.__dict__.update(original.__dict__)
    remember_original(fn, original)
    return fn


# --- cache ----------------------------------------------------------------


@functools.cache
def _fingerprint() -> bytes:
    """What the cache's keys depend on besides a class's own source: Python's
    version and the code that makes and runs a decision. Read by the first
    class's key, not by ``import autostate`` (a dozen files read and hashed)."""
    digest = hashlib.sha256(sys.version.encode())
    here = Path(__file__).parent
    for name in sorted(os.listdir(here)):
        if name.endswith(".py"):
            digest.update((here / name).read_bytes())
    # The runtime the rewritten code calls (loops.py: a rolled loop's), and
    # lifting/routes.py, whose table says which JAX functions a method's
    # calls are routed from.
    for name in ("runtime.py", "loops.py", "lifting/routes.py"):
        path = here.parent / name
        if path.exists():
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16].encode()


_MEMORY_CACHE: dict[str, Any] = {}
# Bounds of the two caches: entries kept in this process, bytes kept on disk
# (``AUTOSTATE_CACHE_MAX_BYTES``). One entry is a class's code objects, a few
# kB; an edited file leaves its old entries behind, so without a bound the
# disk cache only grows (6 MB after one ``make test``).
MEMORY_CACHE_ENTRIES = 4096
DEFAULT_DISK_CACHE_BYTES = 32 * 2**20


# filename -> (its lines as linecache holds them, their digest). linecache
# gives a new list when the file changes, so the list's identity says whether
# the digest is current; a 30-class file is then hashed once, not 30 times.
_CONTENT_DIGESTS: dict[str, tuple[list[str], bytes]] = {}
# A file content's digest -> the name of the bundle its classes are stored in.
_BUNDLE_NAMES: dict[bytes, str] = {}


def _content_digest(filename: str, lines: list[str]) -> bytes:
    known = _CONTENT_DIGESTS.get(filename)
    if known is not None and known[0] is lines:
        return known[1]
    digest = hashlib.sha256("".join(lines).encode()).digest()
    _CONTENT_DIGESTS[filename] = (lines, digest)
    return digest


def cache_key(
    cls: type, slots: list[MethodSlot], extra: tuple, other_files: list[str] = ()  # type: ignore[assignment]
) -> tuple[str, str] | None:
    """Key of a class's transformation (file contents, class, methods, options),
    and the bundle it is stored in: one per file, so that a module's classes
    are read from disk with one open, not one each.

    ``other_files`` are further files the decision reads (undecorated bases).
    """
    filenames = sorted({s.function.__code__.co_filename for s in slots})
    contents = [source_lines(name) for name in filenames]
    if not any(contents):
        # No method in a file: keyed by the files the decision reads.
        filenames = sorted(set(other_files))
        contents = [source_lines(name) for name in filenames]
        if not any(contents):
            return None
    others = sorted(set(other_files) - set(filenames)) if other_files else []
    digests = [_content_digest(name, lines) for name, lines in zip(filenames, contents)]
    digests += [_content_digest(name, source_lines(name)) for name in others]
    # One text of everything else, hashed with the fixed-size file digests in
    # one call: a warm hit computes this key in a process's first use of the
    # class, where each extra hash object and repr call costs microseconds.
    described = repr((
        filenames, others, cls.__qualname__, extra,
        [
            (s.key, c.co_filename, c.co_firstlineno, c.co_freevars, c.co_name, c.co_flags,
             c.co_names, c.co_varnames, s.foreign)
            for s in slots
            for c in (s.function.__code__,)
        ],
    ))
    fingerprint = _fingerprint()
    key = hashlib.sha256(b"".join((fingerprint, *digests, described.encode()))).hexdigest()
    bundle = _BUNDLE_NAMES.get(digests[0])
    if bundle is None:
        bundle = _BUNDLE_NAMES[digests[0]] = hashlib.sha256(fingerprint + digests[0]).hexdigest()
    return key, bundle


# The variables the cache's folder depends on, as keys of os.environ's own
# mapping (``_data``: encoded names to encoded values), so that a module's
# first class statement reads them without decoding each (a tenth of it).
_FOLDER_VARIABLES: tuple[Any, ...] = ()
_RAW_ENVIRON: Any = None
try:
    _FOLDER_VARIABLES = tuple(
        map(os.environ.encodekey, ("AUTOSTATE_CACHE_DIR", "XDG_CACHE_HOME", "HOME"))
    )
    _RAW_ENVIRON = os.environ._data  # type: ignore[attr-defined]
except AttributeError:  # not CPython's os.environ: read it each time
    pass
_folder_for: tuple[Any, str | None] = (None, None)  # (raw variables, folder)


def _cache_dir_name() -> str | None:
    """The disk cache's folder, as a string (a warm hit builds no ``Path``)."""
    global _folder_for
    if _RAW_ENVIRON is not None:
        raw = tuple(map(_RAW_ENVIRON.get, _FOLDER_VARIABLES))
        if raw == _folder_for[0]:
            return _folder_for[1]
        _folder_for = (raw, _cache_dir_from_environment())
        return _folder_for[1]
    return _cache_dir_from_environment()


def _cache_dir_from_environment() -> str | None:
    configured = os.environ.get("AUTOSTATE_CACHE_DIR")
    if configured == "":
        return None
    if configured:
        return configured
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "autostate")


def cache_load(key: str, bundle: str | None = None) -> Any:
    """The cached value of ``key`` (stored in ``bundle``, by default its own), or ``None``."""
    hit = _MEMORY_CACHE.get(key)
    if hit is not None:
        return hit
    value = _bundle(bundle or key).get(key)
    if value is not None:
        _remember(key, value)
    return value


def _bundle(name: str) -> dict[str, Any]:
    """A bundle's entries, read from disk once per process (the memory cache holds it)."""
    memo_key = "bundle:" + name
    entries = _MEMORY_CACHE.get(memo_key)
    if entries is None:
        entries = _read_bundle(name)
        _remember(memo_key, entries)
    return entries


# A bundle on disk is a sequence of records, one per entry: the length of
# ``marshal.dumps((key, value))`` (4 bytes, little-endian), then those bytes.
# A store appends its record (one write), so that decorating a file of n
# classes writes n records, not n bundles of up to n entries each. A reader
# keeps the whole records; a corrupt one, or a tail another process is still
# writing, ends the bundle there, and the next store in that bundle rewrites it.
_LENGTH = 4
# Bundle name -> whether the last read found it whole (or absent), so that a
# store may append to it.
_APPENDABLE: dict[str, bool] = {}


def _read_bundle(name: str) -> dict[str, Any]:
    directory = _cache_dir_name()
    if directory is None:
        return {}
    try:
        # Plain os calls on a descriptor: pathlib's object building was a third
        # of a warm hit, and a buffered file object a fifth of what was left.
        fd = os.open(os.path.join(directory, name + ".bin"), _READ_FLAGS)
        try:
            info = os.fstat(fd)
            data = os.read(fd, info.st_size)
            while len(data) < info.st_size:  # a short read: the rest
                more = os.read(fd, info.st_size - len(data))
                if not more:
                    break
                data += more
            # The modification time is the last use, so eviction drops the
            # entries unused the longest; refreshed at most hourly, as the
            # extra system call is a tenth of a hit.
            if time.time() - info.st_mtime > 3600:
                os.utime(fd)
        finally:
            os.close(fd)
    except FileNotFoundError:
        _APPENDABLE[name] = True
        return {}
    except OSError:
        _APPENDABLE[name] = False
        return {}
    entries, whole = _records(data)
    _APPENDABLE[name] = whole
    return entries


def _records(data: bytes) -> tuple[dict[str, Any], bool]:
    """The entries of a bundle's bytes, and whether every byte was a whole record."""
    entries: dict[str, Any] = {}
    at = 0
    while at < len(data):
        end = at + _LENGTH + int.from_bytes(data[at : at + _LENGTH], "little")
        if end > len(data):
            return entries, False
        try:
            key, value = marshal.loads(data[at + _LENGTH : end])
        except (ValueError, EOFError, TypeError):
            return entries, False
        entries[key] = value
        at = end
    return entries, True


def _record(key: str, value: Any) -> bytes:
    payload = marshal.dumps((key, value))
    return len(payload).to_bytes(_LENGTH, "little") + payload


_READ_FLAGS = os.O_RDONLY | getattr(os, "O_BINARY", 0)


def _remember(key: str, value: Any) -> None:
    if key not in _MEMORY_CACHE and len(_MEMORY_CACHE) >= MEMORY_CACHE_ENTRIES:
        del _MEMORY_CACHE[next(iter(_MEMORY_CACHE))]
    _MEMORY_CACHE[key] = value


def _disk_cache_limit() -> int:
    try:
        return int(os.environ.get("AUTOSTATE_CACHE_MAX_BYTES", DEFAULT_DISK_CACHE_BYTES))
    except ValueError:
        return DEFAULT_DISK_CACHE_BYTES


def evict(directory: Path, limit: int) -> None:
    """Deletes the least recently used entries of ``directory`` until it holds ``limit`` bytes."""
    try:
        entries = []
        for entry in os.scandir(directory):
            if entry.name.endswith((".bin", ".idx")):
                stat = entry.stat()
                entries.append((stat.st_mtime, stat.st_size, entry.path))
    except OSError:
        return
    total = sum(size for _, size, _ in entries)
    for _, size, path in sorted(entries):
        if total <= limit:
            break
        try:
            os.remove(path)
        except OSError:
            continue
        total -= size


def cache_store(key: str, value: Any, bundle: str | None = None) -> None:
    """Caches ``value`` under ``key``, in memory and in ``bundle`` (by default its own) on disk."""
    _remember(key, value)
    name = bundle or key
    entries = _bundle(name)  # (read from disk once per process: whether it is whole)
    entries[key] = value
    _remember("bundle:" + name, entries)
    folder = _cache_dir_name()
    if folder is None:
        return
    path = os.path.join(folder, name + ".bin")
    try:
        os.makedirs(folder, exist_ok=True)
        if _APPENDABLE.get(name):
            # Appended in one write: another process's records stay, before or after it.
            fd = os.open(path, _APPEND_FLAGS, 0o644)
            try:
                os.write(fd, _record(key, value))
            finally:
                os.close(fd)
        else:  # corrupt or unreadable: written anew, whole
            fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(b"".join(_record(k, v) for k, v in entries.items()))
            os.replace(tmp, path)
            _APPENDABLE[name] = True
    except (OSError, ValueError):
        return
    # Only a miss stores, and a miss parses for milliseconds: the scan is cheap here.
    evict(Path(folder), _disk_cache_limit())


_APPEND_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_BINARY", 0)
