"""One class in, one complete decision out: the whole transform pipeline.

``decide_class`` runs every step in order — find the functions the class body
defines and their source, collect facts (undecorated user bases included),
analyse, rewrite, compile — and returns a ``ClassDecision`` that holds all a
decoration needs and all a later decoration builds on: the state set, what
construction initializes, the functions as the user wrote them, and the
rewritten code. Results are cached (``loader``) by everything they depend on.
No JAX here.
"""

from __future__ import annotations

import builtins
import dataclasses
import inspect
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from autostate.errors import DecorationError, SourceUnavailableError, format_error
from autostate.transform import loader, source
from autostate.transform.method import ACCESS_BUILTINS, is_dunder

if TYPE_CHECKING:
    from autostate.transform import analysis

# Standard-library bases (abc.ABC, typing.Generic, ...) are not user code.
_STDLIB = frozenset(getattr(sys, "stdlib_module_names", ()))


@dataclasses.dataclass(frozen=True)
class ClassDecision:
    """What the transform decided for one class, bases included; ``originals``
    maps each slot key (``"step"``, ``"value.fset"``) to the user's function, so
    decorating again starts from the user's code."""

    state: frozenset[str]
    initialized: frozenset[str]
    originals: Mapping[str, types.FunctionType]
    codes: Mapping[str, types.CodeType]
    # States whose initial value is a class attribute (``training = True`` in
    # the class body, or a base's): each instance gets it when constructed.
    defaults: frozenset[str] = frozenset()
    # The names construction reaches on the receiver (``analysis.ClassAnalysis``).
    constructs: frozenset[str] = frozenset()


def decide_class(
    cls: type, *, fallback: str | None, bases: Sequence[ClassDecision],
    previous: ClassDecision | None, state_marker: Any, is_decorated: Callable[[type], bool],
    control_flow_name: Callable[[Any], str | None],
) -> tuple[ClassDecision, list[source.MethodSlot]]:
    """Decides which attributes of ``cls`` are state and rewrites its methods.

    Args:
        cls: the class being decorated.
        fallback: the class's fallback option (part of the cache key; closures
            that assign state).
        bases: the decisions of decorated base classes, nearest first.
        previous: this class's own earlier decision (re-decoration), whose
            original functions replace the rewritten ones found in the class.
        state_marker: the ``autostate.state`` function, recognised in
            ``__init__`` however the user imported it.
        is_decorated: whether a base class is itself decorated (its decision
            is in ``bases``; undecorated user bases are analysed here).
        control_flow_name: for an object a method's name resolves to, the
            runtime wrapper that replaces it (``jax.lax.scan`` -> ``"scan"``),
            or ``None``; calls to it are routed to ``__autostate__.lifting``.

    Returns:
        ``(decision, slots)``; ``slots`` say where each function lives, so the
        caller can install the rewritten ones.
    """
    user_bases = _undecorated_user_bases(cls, is_decorated)
    _copy_dict_readers(cls, user_bases)
    slots = source.find_methods(cls)
    if previous is not None:
        slots = [
            dataclasses.replace(s, function=previous.originals.get(s.key, s.function))
            for s in slots
        ]
    _check_layout(cls)
    inherited = frozenset().union(*(b.state for b in bases))
    inherited_init = frozenset().union(*(b.initialized for b in bases))
    inherited_constructs = frozenset().union(*(b.constructs for b in bases))
    class_defaults = _class_defaults(cls).union(*(b.defaults for b in bases))
    # Everything the decision depends on besides the class's own files: the
    # options, what decorated bases decided, every base (and its properties),
    # the undecorated bases' source files (their writes are state), which
    # global names are autostate.state in each function's module, and which
    # rebind ``setattr`` & co. (then no attribute statement by name).
    extra = (
        fallback,
        sorted(inherited),
        sorted(inherited_init),
        sorted(inherited_constructs),
        _base_properties(cls),
        [b.__qualname__ for b in cls.__mro__[1:]],
        _marker_names(slots, state_marker),
        sorted(set().union(*(_shadowed_builtins(s.function) for s in slots))),
        sorted(class_defaults),
        sorted(_dataclass_pending(cls)),
        sorted(declaring_methods(cls)),
        sys.version,
    )
    base_files = [f for f in (_module_file(b) for b in user_bases) if f]
    keys = loader.cache_key(cls, slots, extra, base_files)
    if keys is None and (own_file := _module_file(cls)):
        # Nothing of its own in a file (``class Leaf(Base): pass``, or generated
        # methods only): keyed by its module's file, so a warm start reads it back.
        keys = loader.cache_key(cls, slots, extra, [own_file, *base_files])
    cached = loader.cache_load(*keys) if keys else None
    if cached is not None:
        state_list, initialized_list, constructs_list, codes = cached
        state, initialized = frozenset(state_list), frozenset(initialized_list)
        constructs = frozenset(constructs_list)
    else:
        state, initialized, constructs, codes = _transform(
            cls, slots, inherited, inherited_init | class_defaults, inherited_constructs,
            state_marker, user_bases, control_flow_name,
        )
        if keys:
            loader.cache_store(
                keys[0], (sorted(state), sorted(initialized), sorted(constructs), codes), keys[1]
            )
    originals = {s.key: s.function for s in slots}
    decision = ClassDecision(
        state, initialized, originals, codes, state & class_defaults, constructs
    )
    return decision, slots


def declaring_methods(cls: type) -> frozenset[str]:
    """The methods of ``cls`` that declare a state by a literal name, as its
    class attribute ``_autostate_declaring_methods`` lists them
    (``autostate.nn.Module``: ``("register_buffer",)``)."""
    return frozenset(getattr(cls, "_autostate_declaring_methods", ()))


def _is_plain_value(value: Any) -> bool:
    """Whether a class attribute is a value an instance may hold as its state:
    not a function, property or other descriptor, and not a
    ``dataclasses.field(...)`` (the dataclass ``__init__`` makes that value)."""
    return not hasattr(type(value), "__get__") and not isinstance(value, dataclasses.Field)


def _class_defaults(cls: type) -> frozenset[str]:
    """Names a class attribute gives a value (in the class body or a base's),
    which a state of that name starts from, as an instance attribute that
    shadows it would in plain Python. Python's own names (``__doc__``) are not."""
    names: set[str] = set()
    shadowed: set[str] = set()
    for k in cls.__mro__:
        if k is object:
            continue
        for name, value in vars(k).items():
            if name in shadowed or is_dunder(name):
                continue
            shadowed.add(name)  # the nearest class's attribute is the one read
            if _is_plain_value(value):
                names.add(name)
    return frozenset(names)


def awaits_generated_init(cls: type) -> bool:
    """Whether ``cls`` declares fields but no ``__init__``: a class decorated
    before a decorator above ``@stateful`` (``@dataclass``) writes the
    ``__init__`` that assigns its fields and calls its ``__post_init__``."""
    own = vars(cls)
    return "__init__" not in own and bool(own.get("__annotations__"))


def _dataclass_pending(cls: type) -> frozenset[str]:
    """Fields ``@dataclass``'s ``__init__`` has yet to write will assign (a class
    decorated before ``@dataclass`` runs): those given ``dataclasses.field(...)``
    and, in a class awaiting its ``__init__``, every annotated name."""
    own = vars(cls)
    fields = {k for k, v in own.items() if isinstance(v, dataclasses.Field)}
    if awaits_generated_init(cls):
        fields.update(own["__annotations__"])
    return frozenset(fields)


def _check_layout(cls: type) -> None:
    """Instances must keep their attributes in ``__dict__`` (where slots live)."""
    slotted = [
        (k.__name__, name)
        for k in cls.__mro__[:-1]
        for name in _slot_names(k)
        if name not in ("__dict__", "__weakref__")
    ]
    if slotted or cls.__dictoffset__ == 0:
        names = ", ".join(f"{k}.{n}" for k, n in slotted) or "no __dict__"
        raise DecorationError(format_error(
            f"@stateful cannot decorate class {cls.__name__}: it declares __slots__ "
            f"({names}); autostate keeps every attribute (parameters, states, sub-models) "
            "in the instance __dict__.",
            where=class_location(cls),
            fix="remove __slots__ from the class (and its bases), or keep the slotted "
            "values on an undecorated object outside the model.",
        ))


def _slot_names(k: type) -> list[str]:
    declared = k.__dict__.get("__slots__", ())
    return [declared] if isinstance(declared, str) else list(declared)


def class_location(cls: type) -> str | None:
    """``file:line`` of the class statement, else of the first function of
    its body, else its file."""
    code = next(
        (
            fn.__code__
            for value in vars(cls).values()
            for fn in (getattr(value, "__func__", value),)
            if isinstance(fn, types.FunctionType)
            and fn.__qualname__.rpartition(".")[0] == cls.__qualname__
            # Not generated (a NamedTuple's __new__), nor another module's
            # (collections' ``_make``, qualified as the class's own).
            and fn.__code__.co_filename[:1] != "<"
            and fn.__module__ == cls.__module__
        ),
        None,
    )
    filename = code.co_filename if code is not None else _module_file(cls)
    line = _class_statement_line(cls, filename, code.co_firstlineno if code else None)
    if line is None:
        line = getattr(cls, "__firstlineno__", None)  # Python 3.13+: its first decorator's
    if filename and line is not None:
        return f"{filename}:{line}"
    return f"{code.co_filename}:{code.co_firstlineno}" if code is not None else filename


def _class_statement_line(cls: type, filename: str | None, before: int | None) -> int | None:
    """The line of ``class <Name>`` in ``filename`` with ``cls``'s qualname (the
    last one above line ``before``, for a class written in several branches)."""
    import ast

    text = "".join(source.source_lines(filename)) if filename else ""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return None
    qualname = tuple(cls.__qualname__.split("."))
    lines: list[int] = []
    pending: list[tuple[ast.AST, tuple[str, ...]]] = [(tree, ())]
    while pending:
        node, path = pending.pop()
        for child in ast.iter_child_nodes(node):
            inner = path
            if isinstance(child, ast.ClassDef):
                inner = (*path, child.name)
                if inner == qualname:
                    lines.append(child.lineno)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                inner = (*path, getattr(child, "name", "<lambda>"), "<locals>")
            pending.append((child, inner))
    lines = sorted(n for n in lines if before is None or n <= before)
    return lines[-1] if lines and (before is not None or len(lines) == 1) else None


def _module_globals(cls: type) -> dict[str, Any] | None:
    """The globals of the module that defined ``cls``: its functions' own,
    else its module's in ``sys.modules`` (a module being imported, or one
    that has left ``sys.modules``: a test harness's clean-up, a reload)."""
    for value in vars(cls).values():
        fn = getattr(value, "__func__", value)
        if isinstance(fn, types.FunctionType) and fn.__module__ == cls.__module__:
            return fn.__globals__
    module = sys.modules.get(cls.__module__)
    return None if module is None else vars(module)


def _module_file(cls: type) -> str | None:
    found = _module_globals(cls)
    return None if found is None else found.get("__file__")


def _marker_names(slots: list[source.MethodSlot], marker: Any) -> list[str]:
    names: set[str] = set()
    seen: set[int] = set()
    for slot in slots:
        g = slot.function.__globals__
        if id(g) in seen:
            continue
        seen.add(id(g))
        for name, value in list(g.items()):
            # A module's own dict, not getattr: a module's __getattr__ (jax.numpy's
            # deprecation shim) made this scan most of a warm decoration.
            if value is marker or (
                type(value) is types.ModuleType and value.__dict__.get("state") is marker
            ):
                names.add(name)
    return sorted(names)


def _shadowed_builtins(fn: types.FunctionType) -> frozenset[str]:
    """The names ``setattr(self, "x", v)`` and its kin use that ``fn``'s module
    binds to something else than the builtin: there they write no attribute."""
    g = fn.__globals__
    return frozenset(
        n for n in ACCESS_BUILTINS if n in g and g[n] is not getattr(builtins, n)
    )


def _base_properties(cls: type) -> list[str]:
    # object has none (and most of the entries to scan: a tenth of a warm hit).
    return sorted(
        name
        for base in cls.__mro__[1:]
        if base is not object
        for name, v in vars(base).items()
        if isinstance(v, property)
    )


def _resolve(globals_: dict[str, Any], dotted: str) -> Any:
    head, *rest = dotted.split(".")
    obj = globals_.get(head, getattr(builtins, head, None))
    for part in rest:
        obj = getattr(obj, part, None)
    return obj


def _undecorated_user_bases(cls: type, is_decorated: Callable[[type], bool]) -> list[type]:
    bases = []
    for base in cls.__mro__[1:]:
        if base is object or is_decorated(base):
            continue
        module = _module_globals(base)
        top = base.__module__.partition(".")[0]
        if module is None or top in sys.builtin_module_names or top in _STDLIB:
            continue
        if not module.get("__file__") and base.__module__ != "__main__":
            continue
        bases.append(base)
    return bases


def _copy_dict_readers(cls: type, user_bases: list[type]) -> None:
    """Puts into ``cls``'s dict each method of an undecorated user base that
    reads an instance dict and that ``cls`` would run, so it is rewritten as
    ``cls``'s own and reads the states' values; the base keeps its function,
    and dunder methods stay where they are."""
    for base in user_bases:
        for name, fn in list(vars(base).items()):
            if type(fn) is not types.FunctionType or is_dunder(name):
                continue
            if not _names_instance_dict(fn.__code__) or inspect.getattr_static(cls, name, None) is not fn:
                continue  # (or overridden nearer to cls, or copied already)
            text = _function_text(fn)
            if text is not None and _reads_instance_dict(text):
                setattr(cls, name, fn)


def _names_instance_dict(code: types.CodeType) -> bool:
    """Whether ``code`` (or code nested in it) names ``vars`` or ``__dict__``: a
    look at its names, so that a warm decoration reads no base's source."""
    if "vars" in code.co_names or "__dict__" in code.co_names:
        return True
    return any(isinstance(c, types.CodeType) and _names_instance_dict(c) for c in code.co_consts)


def _function_text(fn: types.FunctionType) -> str | None:
    """The source block of ``fn`` (``None`` if it cannot be read)."""
    import tokenize

    try:
        block = source.read_block(fn.__code__)
    except (tokenize.TokenError, SyntaxError):
        return None
    return None if block is None else "".join(block)


def _collect_facts(
    class_name: str, text: source.MethodSource, fn: types.FunctionType
) -> analysis.MethodFacts:
    """``analysis.collect_facts`` for ``fn``, told which of ``setattr`` & co. its
    module rebinds (rarely any: then the call keeps its two-argument shape,
    which wrappers of ``collect_facts`` rely on)."""
    from autostate.transform import analysis

    shadowed = _shadowed_builtins(fn)
    if shadowed:
        return analysis.collect_facts(class_name, text, shadowed)
    return analysis.collect_facts(class_name, text)


def _base_facts(base: type) -> list[analysis.MethodFacts]:
    from autostate.transform import analysis

    facts = []
    for slot in source.find_methods(base):
        try:
            text = source.method_source(base, slot)
            facts.append(_collect_facts(base.__name__, text, slot.function))
        except (SourceUnavailableError, DecorationError, OSError):
            continue
    return analysis.without_decorator_helpers(base.__name__, facts)


def _read_facts(
    cls: type, slot: source.MethodSlot
) -> tuple[analysis.MethodFacts | None, Exception | None]:
    """Facts of one function, located by its code object. The block must compile
    to that very code (a file edited since import would install another body);
    a function whose source cannot be read is skipped (the guard meets it)."""
    try:
        text = source.method_source(cls, slot)
        facts = _collect_facts(cls.__name__, text, slot.function)
        same = loader.compiles_to(facts.text, text, slot.function.__code__)
    except (SourceUnavailableError, DecorationError) as exc:
        return None, exc
    if not same:
        code = slot.function.__code__
        return None, DecorationError(format_error(
            f"@stateful could not find the source of {cls.__qualname__}.{slot.key}: "
            f"{code.co_filename!r} no longer holds the code that was imported at line "
            f"{code.co_firstlineno} (the file was edited or the function moved).",
            where=f"{code.co_filename}:{code.co_firstlineno}",
            fix="reload the module after editing it (importlib.reload), or restart.",
        ))
    return facts, None


def _transform(
    cls: type, slots: list[source.MethodSlot], inherited: frozenset[str],
    inherited_init: frozenset[str], inherited_constructs: frozenset[str], state_marker: Any,
    user_bases: list[type], control_flow_name: Callable[[Any], str | None],
) -> tuple[frozenset[str], frozenset[str], frozenset[str], dict[str, types.CodeType]]:
    """Analyses and rewrites: ``(state, initialized, constructs, {slot key: code})``."""
    # Only a cache miss parses: libcst's import is a third of jax's, and a
    # warm start (every class cached) never pays it.
    from autostate.transform import analysis, loop_facts, rewrite

    facts, slots, skipped, unavailable = [], list(slots), [], None
    for slot in list(slots):
        found, error = _read_facts(cls, slot)
        if found is not None:
            facts.append(found)
            continue
        slots.remove(slot)
        skipped.append(slot)
        if slot.foreign:
            continue
        if not isinstance(error, SourceUnavailableError):
            raise error  # type: ignore[misc]
        # Generated methods (a dataclass __init__) have no source; they still
        # reach state through the class's descriptors. Only a class with no
        # source at all cannot be decorated.
        unavailable = error
    if unavailable is not None and not facts:
        raise unavailable
    facts = analysis.without_decorator_helpers(cls.__name__, facts)
    globals_by_key = {s.key: s.function.__globals__ for s in slots}

    def is_state_declaration(facts: analysis.MethodFacts, dotted: str) -> bool:
        found = _resolve(globals_by_key[facts.source.key], dotted)
        # ``state_marker`` may be a tuple of markers (``autostate.state``, ``autostate.constant``).
        markers = state_marker if type(state_marker) is tuple else (state_marker,)
        return any(found is marker for marker in markers)

    initialized: set[str] = set(inherited_init)
    constructs: set[str] = set(inherited_constructs)
    bases = [(base, _base_facts(base)) for base in user_bases]
    base_writes: set[str] = set()
    for _base, base_facts_list in bases:
        for base_facts in base_facts_list:
            if base_facts.receiver is None:
                continue
            initialized.update(a.attr for a in base_facts.assignments)
            if base_facts.source.attr == "__init__":  # (what it calls may be overridden here)
                constructs.update(base_facts.self_calls)
            if base_facts.source.attr != "__init__":
                base_writes.update(
                    a.attr for a in base_facts.assignments if a.kind not in ("item", "inplace")
                )
    # A generated __init__ (dataclass, attrs) has no source to check; it sets
    # every field, so treat what the methods assign as initialized.
    initialized |= set(getattr(cls, "__dataclass_fields__", ()))
    initialized |= _dataclass_pending(cls)
    own = vars(cls)
    if any(slot.attr == "__init__" for slot in skipped) or (
        "__post_init__" in own and "__init__" not in own  # the __init__ to come calls it
    ):
        initialized |= {a.attr for f in facts for a in f.assignments}
    properties = frozenset(_base_properties(cls))
    result = analysis.analyze_class(
        cls.__name__, facts,
        # What an undecorated base or mixin assigns is state too: its methods
        # are not rewritten, but reach state through the class's descriptors.
        inherited_state=inherited | (
            base_writes - properties - {n for n, v in vars(cls).items() if isinstance(v, property)}
        ),
        inherited_initialized=frozenset(initialized),
        is_state_declaration=is_state_declaration,
        inherited_properties=properties,
        declaring_methods=declaring_methods(cls),
        inherited_constructs=frozenset(constructs),
    )
    _check_undecorated_bases(cls, bases, result.state, facts)
    codes: dict[str, types.CodeType] = {}
    for slot, method in zip(slots, result.methods):
        globals_ = globals_by_key[slot.key]
        control = {
            dotted: name
            for dotted in sorted(method.references)
            if (name := control_flow_name(_resolve(globals_, dotted))) is not None
        }
        class_name = method.source.mangle_as or cls.__name__
        loops = (
            loop_facts.loop_facts(method.function, method.receiver, class_name)
            if loop_facts.may_hold_loops(method.source.text) else ()
        )
        rolls = any(loop.may_roll for loop in loops)
        if (
            not control
            and not rolls
            and (method.receiver is None or not (method.touched() & result.state))
            and not method.updates_in_place  # (``h.mul_(m)`` on a local: a clear error)
            and not _reads_instance_dict(method.source.text)
        ):
            continue
        text = rewrite.rewrite_method(
            method.module, method.function, method.receiver, result.state, class_name,
            is_init=slot.attr == "__init__", control=control, shadowed=method.shadowed_outside,
            runtime=method.runtime,
        )
        code = slot.function.__code__
        codes[slot.key] = loader.named_as(loader.compile_method(
            text, method.source.filename, class_name, code.co_name, method.shift, code.co_flags,
            runtime=method.runtime if rolls else None, loops=loops, state=result.state,
        ), slot.function.__qualname__)
    return result.state, result.initialized | initialized, result.constructs | constructs, codes


def _reads_instance_dict(text: str) -> bool:
    """Whether a method may read a model's instance dict (``vars(self)``,
    ``self.__dict__``), which the rewrite gives the states' values."""
    return "__dict__" in text or "vars(" in text


def _check_undecorated_bases(
    cls: type, bases: list[tuple[type, list[analysis.MethodFacts]]], state_attrs: frozenset[str],
    own: list[analysis.MethodFacts],
) -> None:
    from autostate.transform import analysis

    for base, base_facts in bases:
        for facts in base_facts:
            if facts.source.attr == "__init__" or facts.receiver is None:
                continue
            # Whole-attribute writes reach state through the descriptors; an item
            # write or an in-place method call would change the value in place.
            every = [f for _, fs in bases for f in fs]
            # An item write is refused on a state, and on a JAX array that is
            # not state (its only write): JAX's arrays do not change in place,
            # and only the rewrite makes it a functional update.
            # So is a PyTorch in-place method (``self.x.mul_(m)``), which only
            # the rewrite makes a write.
            spelled = {"item": "[...] = ...", "inplace": ".<method>_(...)"}
            changes = [
                (a.attr, a.line, f"{facts.receiver}.{a.attr}{spelled[kind]}", True)
                for kind in spelled
                for a in facts.assignments
                if a.kind == kind
            ]
            # A method's name is no type (``self.ema.update(x)`` on a sub-model):
            # a call is refused as in a decorated class, where no value
            # assigned to the attribute may be an object with its own methods.
            changes += [
                (attr, line, f"{facts.receiver}.{attr}.{method}(...)", False)
                for (attr, method, line), depth in zip(
                    facts.mutating_calls, facts.mutating_depths, strict=True
                )
                if analysis.holds_plain_values(attr, [*every, *own], depth)
            ]
            for attr, line, what, is_item in changes:
                array = is_item and attr not in state_attrs and analysis.holds_jax_arrays(
                    attr, [*every, *own]
                )
                if attr in state_attrs or array:
                    kind = "the JAX array" if array else "state"
                    raise DecorationError(format_error(
                        f"@stateful cannot rewrite class {cls.__name__}: its undecorated base "
                        f"class {base.__name__} changes {kind} {attr!r} in place "
                        f"(`{what}` in {base.__name__}.{facts.source.key}), which would not "
                        "be rewritten.",
                        where=f"{facts.source.filename}:{line}",
                        fix=f"decorate {base.__name__} with @autostate.stateful too.",
                    ))
