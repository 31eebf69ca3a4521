"""Finding the functions a class body defines, and their source.

``find_methods`` lists the functions a class body defined (plain, through
``staticmethod``, ``classmethod``, ``property`` and ``functools.wraps``-style
wrappers), each with a way to put a rewritten function back in its place;
``method_source`` reads a function's source block from its file, located by
its code object. No JAX here.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import linecache
import sys
import tokenize
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from autostate.errors import DecorationError, SourceUnavailableError, format_error
from autostate.transform.method import MethodSource, mangle


@dataclasses.dataclass
class MethodSlot:
    """Where a function lives in the class dict, and how to put a new one there."""

    key: str
    attr: str
    function: types.FunctionType
    has_receiver: bool
    install: Callable[[types.FunctionType], None]
    # Not written in this class body (assigned, made by a factory): when its
    # source cannot be read it is left to the run-time guard, not rejected.
    foreign: bool = False
    # Raises the error ``install`` would raise (a wrapper it cannot reach
    # into), without installing: every refusal comes before anything is
    # installed, so that a failed decoration leaves the class as it was.
    check: Callable[[], None] | None = None


# Rewritten function -> the user's function it was rewritten from. A rewritten
# method borrowed by another class (``forward = Donor.forward`` once Donor
# is complete) is analysed and rewritten for that class from its original.
_ORIGINALS: weakref.WeakKeyDictionary[types.FunctionType, types.FunctionType] = (
    weakref.WeakKeyDictionary()
)


def remember_original(new: types.FunctionType, original: types.FunctionType) -> None:
    """Records that ``new`` is ``original`` rewritten."""
    _ORIGINALS[new] = _ORIGINALS.get(original, original)


def original_of(fn: types.FunctionType) -> types.FunctionType:
    """The user's function ``fn`` was rewritten from (``fn`` itself if none)."""
    return _ORIGINALS.get(fn, fn) if _ORIGINALS else fn


def _wrapped_function(obj: Any) -> types.FunctionType | None:
    """The innermost function of a ``__wrapped__`` chain (the user's method)."""
    innermost = None
    for _ in range(32):
        if isinstance(obj, types.FunctionType):
            innermost = obj
        obj = getattr(obj, "__wrapped__", None)
        if obj is None:
            break
    return innermost


def replace_in_wrapper(wrapper: Any, old: types.FunctionType, new: types.FunctionType) -> bool:
    """Points a ``functools.wraps``-style wrapper at ``new`` instead of ``old``."""
    replaced = False
    for holder in _wrapper_chain(wrapper):
        for cell in _cells_holding(holder, old):
            cell.cell_contents = new
            replaced = True
        if getattr(holder, "__wrapped__", None) is old:
            try:
                holder.__wrapped__ = new
            except AttributeError:
                pass
    return replaced


def _cells_holding(holder: Any, old: types.FunctionType) -> list[types.CellType]:
    cells = []
    for cell in getattr(holder, "__closure__", None) or ():
        try:
            if cell.cell_contents is old:
                cells.append(cell)
        except ValueError:
            continue
    return cells


def _wrapper_chain(obj: Any) -> Iterator[Any]:
    """``obj`` and what it wraps, down a ``__wrapped__`` chain, and through
    the functions a wrapper without ``__wrapped__`` closes over."""
    pending: list[Any] = [obj]
    seen: set[int] = set()
    while pending and len(seen) < 32:
        obj = pending.pop()
        if obj is None or id(obj) in seen:
            continue
        seen.add(id(obj))
        yield obj
        inner = getattr(obj, "__wrapped__", None)
        if inner is not None:
            pending.append(inner)
        elif isinstance(obj, types.FunctionType):
            pending.extend(reversed(_closure_functions(obj)))


def _closure_functions(fn: types.FunctionType) -> list[types.FunctionType]:
    """The functions in ``fn``'s closure cells (a decorator's ``fn``)."""
    found = []
    for cell in fn.__closure__ or ():
        try:
            held = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(held, types.FunctionType):
            found.append(held)
    return found


def _consumed_method(cls: type, wrapper: Any) -> types.FunctionType | None:
    """The function of ``cls``'s body that ``wrapper``, a function written
    elsewhere, wraps through closures (and ``__wrapped__`` links): what a
    decorator without ``functools.wraps`` made of a method (``@twice`` on
    ``def step``), alone or among other decorators. A function the class
    also binds (a helper the decorator was given) is that name's method,
    not the one consumed."""
    if isinstance(wrapper, types.FunctionType) and _defined_in(cls, wrapper):
        return None
    bound = {id(v) for v in vars(cls).values()}
    return next(
        (fn for fn in _wrapper_chain(wrapper)  # (functools.wraps copies a qualname)
         if isinstance(fn, types.FunctionType) and _defined_in(cls, fn)
         and not hasattr(fn, "__wrapped__") and id(fn) not in bound),
        None,
    )


def _defined_in(cls: type, fn: types.FunctionType) -> bool:
    return fn.__qualname__.rpartition(".")[0] == cls.__qualname__


_STDLIB = frozenset(getattr(sys, "stdlib_module_names", ()))


def _is_user_function(fn: types.FunctionType) -> bool:
    """Whether ``fn`` is user code that may run as a method (not a lambda,
    not the standard library's or autostate's own helpers; the layers of
    ``autostate.nn`` are written as user code and count as such)."""
    if fn.__name__ == "<lambda>":
        return False
    module = fn.__module__ or ""
    if module == "autostate.nn" or module.startswith("autostate.nn."):
        return True
    top = module.partition(".")[0]
    return top != "autostate" and top not in _STDLIB and top not in sys.builtin_module_names


def mangling_class(fn: types.FunctionType) -> str | None:
    """The class whose name Python mangled ``__x`` with in ``fn`` (innermost
    enclosing class statement), from its qualname; ``None`` outside classes."""
    parts = fn.__qualname__.split(".")[:-1]
    i = len(parts) - 1
    while i >= 0:
        if parts[i] == "<locals>":
            i -= 2  # skip the function owning the locals
            continue
        return parts[i]
    return None


# Exact types of class-dict values that are never callables wrapping a
# function (``__module__``, ``__doc__``, ``__dict__``, constants): no
# ``__wrapped__`` lookup for them, whose failed getattr was a tenth of a warm
# decoration.
_NEVER_METHODS = frozenset(
    {str, bytes, int, float, complex, bool, type(None), tuple, frozenset,
     type(type.__dict__["__dict__"]), type(type.__dict__["__weakrefoffset__"])}
)


class _InstallOnce:
    """Puts one rewritten function back for a class-dict object under every name
    the class binds it to (``__call__ = step``): installed once, so the names
    still share one object and a wrapper's closure is replaced once."""

    def __init__(self, install: Callable[[types.FunctionType], None]):
        self._install = install
        self._done = False

    def __call__(self, new: types.FunctionType) -> None:
        if not self._done:
            self._done = True
            self._install(new)


def find_methods(cls: type) -> list[MethodSlot]:
    """Every user function that can run as a method of ``cls``, each with a way to
    replace it: written in the body, assigned there (``log = external_log``),
    made by a factory, or the innermost of a ``functools.wraps`` chain; one slot
    per name an object is bound to."""
    items = [(a, v) for a, v in list(vars(cls).items()) if type(v) not in _NEVER_METHODS]
    names: dict[int, tuple[str, ...]] = {}
    for attr, value in items:
        names[id(value)] = (*names.get(id(value), ()), attr)
    once: dict[tuple[int, str], _InstallOnce] = {}

    def installer(value: Any, part: str, install: Callable[..., None]) -> _InstallOnce:
        key = (id(value), part)
        if key not in once:
            once[key] = _InstallOnce(lambda new: install(names[id(value)], new))
        return once[key]

    def set_all(aliases: tuple[str, ...], obj: Any) -> None:
        for a in aliases:
            setattr(cls, a, obj)

    slots: list[MethodSlot] = []

    def add(
        attr: str, value: Any, fn: Any, put: Callable[..., None] | None, *, key: str = "",
        part: str = "", receiver: bool = True,
    ) -> None:
        """A slot for ``fn`` (if it is a function), put back by ``put(aliases, new)``;
        ``put=None``: ``fn`` is the innermost function of the wrapper ``value``."""
        if not isinstance(fn, types.FunctionType):
            return
        check = None
        if put is None:
            put = functools.partial(_install_in_wrapper, cls, value, fn)
            check = functools.partial(_check_in_wrapper, cls, value, fn)
        slots.append(MethodSlot(key or attr, attr, fn, receiver, installer(value, part, put), check=check))

    for attr, value in items:
        if isinstance(value, types.FunctionType) and hasattr(value, "__wrapped__"):
            fn = _wrapped_function(value.__wrapped__)
            if fn is not None and not _defined_in(cls, fn):
                fn = _consumed_method(cls, fn) or fn  # (a wrapper without wraps inside)
            if fn is not None:
                add(attr, value, fn, None)
                # The wrapper runs as the method too (``self.calls += 1`` around
                # the call): analysed and rewritten as well, sharing its cells,
                # so it calls the rewritten function above.
                add(attr, value, value, set_all, key=f"{attr}.<wrapper>", part="wrapper")
        elif isinstance(value, types.FunctionType) and (inner := _consumed_method(cls, value)):
            # A decorator written without functools.wraps: the method the body
            # wrote is in its wrapper's closure, rewritten there as above.
            add(attr, value, inner, None)
            add(attr, value, value, set_all, key=f"{attr}.<wrapper>", part="wrapper")
        elif isinstance(value, types.FunctionType):
            add(attr, value, value, set_all)
        elif isinstance(value, (staticmethod, classmethod)):
            kind = type(value)
            add(attr, value, value.__func__, lambda aliases, new, k=kind: set_all(aliases, k(new)),
                receiver=False)
        elif isinstance(value, functools.partialmethod):
            add(attr, value, value.func, lambda aliases, new, p=value: set_all(
                aliases, functools.partialmethod(new, *p.args, **p.keywords)))
        elif isinstance(value, functools.cached_property):
            add(attr, value, value.func, lambda aliases, new: _set_cached(cls, aliases, new))
        elif isinstance(value, functools.singledispatchmethod):
            # The function per registered type (``object``: the undecorated
            # one); each rewritten one is registered again for its type.
            for klass, fn in value.dispatcher.registry.items():  # type: ignore[assignment]
                key = attr if klass is object else f"{attr}[{klass.__module__}.{klass.__qualname__}]"
                add(attr, value, fn, lambda _a, new, d=value, k=klass: _register(d, k, new), key=key, part=key)
        elif isinstance(value, property):
            for part in ("fget", "fset", "fdel"):
                add(attr, value, getattr(value, part), key=f"{attr}.{part}", part=part,
                    put=lambda aliases, new, p=part: _replace_property_part(cls, aliases, p, new))
        else:
            add(attr, value, _wrapped_function(value), None)
    found = []
    for slot in slots:
        slot.function = original_of(slot.function)
        if _is_user_function(slot.function):
            slot.foreign = not _defined_in(cls, slot.function)
            found.append(slot)
    return found


class CachedProperty(functools.cached_property):
    """The ``functools.cached_property`` around a rewritten function: its value
    goes through ``on_cached_compute``, which refuses one computed from a state
    under a trace (it could not be kept, as plain Python keeps it)."""

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None or _compute_cached is None:
            return super().__get__(instance, owner)
        return _compute_cached(
            lambda: super(CachedProperty, self).__get__(instance, owner), instance, str(self.attrname)
        )


_compute_cached: Callable[[Callable[[], Any], Any, str], Any] | None = None


def on_cached_compute(compute: Callable[[Callable[[], Any], Any, str], Any]) -> None:
    """Sets the function ``CachedProperty`` computes its value through (the runtime's)."""
    global _compute_cached
    _compute_cached = compute


def _set_cached(cls: type, aliases: tuple[str, ...], fn: types.FunctionType) -> None:
    for attr in aliases:
        prop = CachedProperty(fn)
        prop.__set_name__(cls, attr)
        setattr(cls, attr, prop)


def _register(method: functools.singledispatchmethod, klass: type, fn: types.FunctionType) -> None:
    method.dispatcher.register(klass, fn)
    if klass is object:
        method.func = fn


def _replace_property_part(
    cls: type, aliases: tuple[str, ...], part: str, fn: types.FunctionType
) -> None:
    prop = vars(cls)[aliases[0]]
    setter = {"fget": prop.getter, "fset": prop.setter, "fdel": prop.deleter}[part]
    new = setter(fn)
    for attr in aliases:
        setattr(cls, attr, new)


def _install_in_wrapper(cls: type, wrapper: Any, old: Any, _aliases: Any, new: types.FunctionType) -> None:
    _check_in_wrapper(cls, wrapper, old)  # before changing anything: a failure changes nothing
    replace_in_wrapper(wrapper, old, new)


def _check_in_wrapper(cls: type, wrapper: Any, old: Any) -> None:
    if not any(_cells_holding(holder, old) for holder in _wrapper_chain(wrapper)):
        raise _unreachable_wrapper(cls, old)


def _unreachable_wrapper(cls: type, old: Any) -> DecorationError:
    return DecorationError(format_error(
        f"@stateful cannot reach the function inside the decorator wrapping "
        f"{cls.__name__}.{old.__name__}, which uses state.",
        where=f"{old.__code__.co_filename}:{old.__code__.co_firstlineno}",
        fix="write the decorator with functools.wraps and a closure over the wrapped "
        "function, or apply it outside @stateful; for @jax.checkpoint / @jax.remat on "
        "a method, use @autostate.checkpoint; for @jax.jit on a method, compile it "
        "from outside with `autostate.jit(model.method)`, or call `jax.jit(...)` "
        "inside the method.",
    ))


def source_lines(filename: str) -> list[str]:
    """The current lines of ``filename``, checked against the file first, as
    ``inspect.getsource`` does (a module edited and imported again)."""
    linecache.checkcache(filename)
    return linecache.getlines(filename)


def read_block(code: types.CodeType) -> list[str] | None:
    """The source lines of the block that starts at ``code``'s first line;
    ``None`` when the file has none there. ``tokenize.TokenError`` /
    ``SyntaxError`` when the lines there are no complete block."""
    lines = source_lines(code.co_filename)
    first = code.co_firstlineno
    if not lines or first > len(lines):
        return None
    return inspect.getblock(lines[first - 1 :])


def method_source(cls: type, slot: MethodSlot) -> MethodSource:
    """Reads the source block of one method (decorators included)."""
    code = slot.function.__code__
    first = code.co_firstlineno
    try:
        block = read_block(code)
    except (tokenize.TokenError, SyntaxError):
        raise DecorationError(format_error(
            f"@stateful could not read the source of {cls.__qualname__}.{slot.key}: "
            f"{code.co_filename!r} no longer holds a complete definition there.",
            where=f"{code.co_filename}:{first}",
            fix="make sure the file on disk matches the code that was imported "
            "(reload the module after editing it).",
        )) from None
    if block is None:
        raise SourceUnavailableError(format_error(
            f"@stateful needs the source of {cls.__qualname__}.{slot.key}, but "
            f"{code.co_filename!r} has none (a class built by exec/eval or in an "
            "interactive session without source).",
            where=f"{code.co_filename}:{first}",
            fix="define the class in a .py file (or a notebook cell), so its source "
            "can be read.",
        ))
    text = "".join(block)
    if not text.endswith("\n"):
        text += "\n"
    mangle_as = mangling_class(slot.function) or "_"
    return MethodSource(
        key=slot.key, attr=slot.attr, filename=code.co_filename, first_line=first, text=text,
        freevars=code.co_freevars, has_receiver=slot.has_receiver, mangle_as=mangle_as,
        code_name=code.co_name,
        global_names=(code.co_name,) if _reads_global(code, mangle(mangle_as, code.co_name)) else (),
    )


def _reads_global(code: types.CodeType, name: str) -> bool:
    """Whether ``code`` (or code nested in it) may read the global ``name``
    (``co_names`` also holds attribute names: a superset)."""
    return name in code.co_names or any(
        isinstance(c, types.CodeType) and _reads_global(c, name) for c in code.co_consts
    )
