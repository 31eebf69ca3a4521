"""Source in, code objects out: find method source, compile it at its lines, cache.

``find_methods`` lists the functions a class body defined (through
``staticmethod``, ``classmethod``, ``property`` and ``functools.wraps``-style
wrappers) with their source blocks; ``compile_method`` compiles rewritten
wrapper source with the original file name so that line ``n`` of the result
is line ``n`` of the user's file; ``build_function`` rebuilds a function from
such a code object and the original function's globals, defaults and closure
cells (``__class__`` included). Results are cached in memory and on disk,
keyed by the file's content hash, the class, the Python version and a hash of
this package's transform code. No JAX here.
"""

from __future__ import annotations
import __future__

import dataclasses
import functools
import hashlib
import inspect
import linecache
import marshal
import os
import sys
import tempfile
import tokenize
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from autostate.errors import DecorationError, SourceUnavailableError, format_error
from autostate.transform.analysis import OUTER_NAME, RUNTIME_NAME, MethodSource

_FUTURE_FLAGS = functools.reduce(
    lambda acc, name: acc | getattr(__future__, name).compiler_flag, __future__.all_feature_names, 0
)


@dataclasses.dataclass
class MethodSlot:
    """Where a function lives in the class dict, and how to put a new one there."""

    key: str
    attr: str
    function: types.FunctionType
    has_receiver: bool
    install: Callable[[types.FunctionType], None]


def _wrapped_function(obj: Any) -> types.FunctionType | None:
    seen = 0
    # A functools.wraps wrapper is a function too; the method is what it wraps.
    while (not isinstance(obj, types.FunctionType) or hasattr(obj, "__wrapped__")) and seen < 32:
        obj = getattr(obj, "__wrapped__", None)
        if obj is None:
            return None
        seen += 1
    return obj if isinstance(obj, types.FunctionType) else None


def _replace_in_wrapper(wrapper: Any, old: types.FunctionType, new: types.FunctionType) -> bool:
    """Points a ``functools.wraps``-style wrapper at ``new`` instead of ``old``."""
    replaced = False
    for holder in _wrapper_chain(wrapper):
        for cell in getattr(holder, "__closure__", None) or ():
            try:
                if cell.cell_contents is old:
                    cell.cell_contents = new
                    replaced = True
            except ValueError:
                continue
        if getattr(holder, "__wrapped__", None) is old:
            try:
                holder.__wrapped__ = new
            except AttributeError:
                pass
    return replaced


def _wrapper_chain(obj: Any) -> Iterator[Any]:
    for _ in range(32):
        if obj is None or isinstance(obj, types.FunctionType) and not hasattr(obj, "__wrapped__"):
            if obj is not None:
                yield obj
            return
        yield obj
        obj = getattr(obj, "__wrapped__", None)


def _defined_in(cls: type, fn: types.FunctionType) -> bool:
    return fn.__qualname__.rpartition(".")[0] == cls.__qualname__ and fn.__name__ != "<lambda>"


def find_methods(cls: type) -> list[MethodSlot]:
    """Functions defined in ``cls``'s body, each with a way to replace it."""
    slots: list[MethodSlot] = []
    for attr, value in list(vars(cls).items()):
        if isinstance(value, types.FunctionType) and not hasattr(value, "__wrapped__"):
            slots.append(
                MethodSlot(attr, attr, value, True, lambda fn, a=attr: setattr(cls, a, fn))
            )
        elif isinstance(value, (staticmethod, classmethod)):
            fn = value.__func__
            if isinstance(fn, types.FunctionType):
                kind = type(value)
                slots.append(
                    MethodSlot(
                        attr, attr, fn, False, lambda fn, a=attr, k=kind: setattr(cls, a, k(fn))
                    )
                )
        elif isinstance(value, property):
            for part in ("fget", "fset", "fdel"):
                fn = getattr(value, part)
                if isinstance(fn, types.FunctionType):
                    slots.append(
                        MethodSlot(
                            f"{attr}.{part}", attr, fn, True,
                            lambda fn, a=attr, p=part: _replace_property_part(cls, a, p, fn),
                        )
                    )
        else:
            fn = _wrapped_function(value)
            if fn is not None:
                slots.append(
                    MethodSlot(
                        attr, attr, fn, True,
                        lambda new, w=value, old=fn: _install_in_wrapper(cls, w, old, new),
                    )
                )
    return [s for s in slots if _defined_in(cls, s.function)]


def _replace_property_part(cls: type, attr: str, part: str, fn: types.FunctionType) -> None:
    prop = vars(cls)[attr]
    setter = {"fget": prop.getter, "fset": prop.setter, "fdel": prop.deleter}[part]
    setattr(cls, attr, setter(fn))


def _install_in_wrapper(cls: type, wrapper: Any, old: Any, new: types.FunctionType) -> None:
    if not _replace_in_wrapper(wrapper, old, new):
        raise DecorationError(
            format_error(
                f"@stateful cannot reach the function inside the decorator wrapping "
                f"{cls.__name__}.{old.__name__}, which uses state.",
                where=f"{old.__code__.co_filename}:{old.__code__.co_firstlineno}",
                fix="write the decorator with functools.wraps and a closure over the wrapped "
                "function, or apply it outside @stateful; for @jax.checkpoint / @jax.remat on "
                "a method, use @autostate.checkpoint.",
            )
        )


def source_lines(filename: str) -> list[str]:
    """The current lines of ``filename``.

    Checked against the file first, as ``inspect.getsource`` does: a module
    edited and imported again must not be rewritten from stale cached lines.
    """
    linecache.checkcache(filename)
    return linecache.getlines(filename)


def method_source(cls: type, slot: MethodSlot) -> MethodSource:
    """Reads the source block of one method (decorators included)."""
    code = slot.function.__code__
    lines = source_lines(code.co_filename)
    first = code.co_firstlineno
    if not lines or first > len(lines):
        raise SourceUnavailableError(
            format_error(
                f"@stateful needs the source of {cls.__qualname__}.{slot.key}, but "
                f"{code.co_filename!r} has none (a class built by exec/eval or in an "
                "interactive session without source).",
                where=f"{code.co_filename}:{first}",
                fix="define the class in a .py file (or a notebook cell), so its source "
                "can be read.",
            )
        )
    try:
        block = inspect.getblock(lines[first - 1 :])
    except (tokenize.TokenError, SyntaxError):
        raise DecorationError(
            format_error(
                f"@stateful could not read the source of {cls.__qualname__}.{slot.key}: "
                f"{code.co_filename!r} no longer holds a complete definition there.",
                where=f"{code.co_filename}:{first}",
                fix="make sure the file on disk matches the code that was imported "
                "(reload the module after editing it).",
            )
        ) from None
    text = "".join(block)
    if not text.endswith("\n"):
        text += "\n"
    return MethodSource(
        key=slot.key,
        attr=slot.attr,
        filename=code.co_filename,
        first_line=first,
        text=text,
        freevars=code.co_freevars,
        has_receiver=slot.has_receiver,
    )


def _find_code(code: types.CodeType, name: str) -> types.CodeType:
    for const in code.co_consts:
        if isinstance(const, types.CodeType) and const.co_name == name:
            return const
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
    source: str, filename: str, class_name: str, function_name: str, shift: int, flags: int
) -> types.CodeType:
    """Compiles wrapper source and returns the code of the method inside it."""
    module_code = compile(source, filename, "exec", flags=flags & _FUTURE_FLAGS, dont_inherit=True)
    outer = _find_code(_find_code(module_code, class_name), OUTER_NAME)
    code = _find_code(outer, function_name)
    if sys.version_info >= (3, 11):
        original = source_lines(filename)
        changed = {
            number
            for number, text in enumerate(source.splitlines(keepends=True), start=1)
            if not 0 < number + shift <= len(original) or original[number + shift - 1] != text
        }
        code = _drop_columns(code, changed)
    return _shift_lines(code, shift) if shift else code


def build_function(
    code: types.CodeType, original: types.FunctionType, runtime: types.ModuleType
) -> types.FunctionType:
    """A function with ``code`` and everything else of ``original``."""
    cells = dict(zip(original.__code__.co_freevars, original.__closure__ or ()))
    cells[RUNTIME_NAME] = types.CellType(runtime)
    closure = tuple(cells[name] for name in code.co_freevars)
    fn = types.FunctionType(
        code, original.__globals__, original.__name__, original.__defaults__, closure
    )
    fn.__kwdefaults__ = original.__kwdefaults__
    fn.__qualname__ = original.__qualname__
    fn.__module__ = original.__module__
    fn.__doc__ = original.__doc__
    fn.__annotations__ = original.__annotations__
    fn.__dict__.update(original.__dict__)
    return fn


# --- cache ----------------------------------------------------------------


def _transform_fingerprint() -> str:
    digest = hashlib.sha256(sys.version.encode())
    here = Path(__file__).parent
    for name in sorted(os.listdir(here)):
        if name.endswith(".py"):
            digest.update((here / name).read_bytes())
    runtime = here.parent / "runtime.py"
    if runtime.exists():
        digest.update(runtime.read_bytes())
    return digest.hexdigest()[:16]


_FINGERPRINT = _transform_fingerprint()
_MEMORY_CACHE: dict[str, Any] = {}


def cache_key(cls: type, slots: list[MethodSlot], extra: tuple) -> str | None:
    """Key of a class's transformation: file content, class, methods, options."""
    filenames = sorted({s.function.__code__.co_filename for s in slots})
    contents = [source_lines(name) for name in filenames]
    if not any(contents):
        return None
    digest = hashlib.sha256(_FINGERPRINT.encode())
    for lines in contents:
        digest.update("".join(lines).encode())
    digest.update(repr((filenames, cls.__qualname__, extra)).encode())
    for s in slots:
        code = s.function.__code__
        digest.update(
            repr((s.key, code.co_filename, code.co_firstlineno, code.co_freevars)).encode()
        )
    return digest.hexdigest()


def _cache_dir() -> Path | None:
    configured = os.environ.get("AUTOSTATE_CACHE_DIR")
    if configured == "":
        return None
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "autostate"


def cache_load(key: str) -> Any:
    hit = _MEMORY_CACHE.get(key)
    if hit is not None:
        return hit
    directory = _cache_dir()
    if directory is None:
        return None
    try:
        data = (directory / f"{key}.bin").read_bytes()
        value = marshal.loads(data)
    except (OSError, ValueError, EOFError, TypeError):
        return None
    _MEMORY_CACHE[key] = value
    return value


def cache_store(key: str, value: Any) -> None:
    _MEMORY_CACHE[key] = value
    directory = _cache_dir()
    if directory is None:
        return
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(marshal.dumps(value))
        os.replace(tmp, directory / f"{key}.bin")
    except (OSError, ValueError):
        pass
