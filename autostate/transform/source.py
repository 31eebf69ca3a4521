"""Finding the functions a class body defines, and their source.

``find_methods`` lists the functions a class body defined (plain, through
``staticmethod``, ``classmethod``, ``property`` and ``functools.wraps``-style
wrappers), each with a way to put a rewritten function back in its place;
``method_source`` reads a function's source block from its file, located by
its code object. No JAX here.
"""

from __future__ import annotations

import dataclasses
import inspect
import linecache
import tokenize
import types
from collections.abc import Callable, Iterator
from typing import Any

from autostate.errors import DecorationError, SourceUnavailableError, format_error
from autostate.transform.method import MethodSource


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
