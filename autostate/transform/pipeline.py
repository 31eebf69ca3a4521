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
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from autostate.errors import DecorationError, SourceUnavailableError, format_error
from autostate.transform import loader, source

if TYPE_CHECKING:
    from autostate.transform import analysis

# Standard-library bases (abc.ABC, typing.Generic, ...) are not user code.
_STDLIB = frozenset(getattr(sys, "stdlib_module_names", ()))


@dataclasses.dataclass(frozen=True)
class ClassDecision:
    """What the transform decided for one class.

    ``state`` and ``initialized`` include what the bases contribute;
    ``originals`` maps each slot key (``"step"``, ``"value.fset"``) to the
    function as the user wrote it, so decorating again (other options, a
    subclass) starts from the user's code, never from rewritten code.
    """

    state: frozenset[str]
    initialized: frozenset[str]
    originals: Mapping[str, types.FunctionType]
    codes: Mapping[str, types.CodeType]


def decide_class(
    cls: type,
    *,
    fallback: str | None,
    bases: Sequence[ClassDecision],
    previous: ClassDecision | None,
    state_marker: Any,
    is_decorated: Callable[[type], bool],
    control_flow_name: Callable[[Any], str | None],
) -> tuple[ClassDecision, list[source.MethodSlot]]:
    """Decides which attributes of ``cls`` are state and rewrites its methods.

    **Arguments:**
    - ``fallback``: the class's fallback option (part of the cache key; closures
      that assign state).
    - ``bases``: the decisions of decorated base classes, nearest first.
    - ``previous``: this class's own earlier decision (re-decoration), whose
      original functions replace the rewritten ones found in the class.
    - ``state_marker``: the ``autostate.state`` function, recognised in
      ``__init__`` however the user imported it.
    - ``is_decorated``: whether a base class is itself decorated (its
      decision is in ``bases``; undecorated user bases are analysed here).
    - ``control_flow_name``: for an object a method's name resolves to, the
      runtime wrapper that replaces it (``jax.lax.scan`` -> ``"scan"``), or
      ``None``; calls to it are routed to ``__autostate__.control``.

    **Returns:** ``(decision, slots)``; ``slots`` say where each function
    lives, so the caller can install the rewritten ones.
    """
    slots = source.find_methods(cls)
    if previous is not None:
        slots = [
            dataclasses.replace(s, function=previous.originals.get(s.key, s.function))
            for s in slots
        ]
    inherited = frozenset().union(*(b.state for b in bases))
    inherited_init = frozenset().union(*(b.initialized for b in bases))
    extra = (fallback, sorted(inherited), sorted(inherited_init), _base_properties(cls), sys.version)
    key = loader.cache_key(cls, slots, extra)
    cached = loader.cache_load(key) if key else None
    if cached is not None:
        state_list, initialized_list, codes = cached
        state, initialized = frozenset(state_list), frozenset(initialized_list)
    else:
        user_bases = _undecorated_user_bases(cls, is_decorated)
        state, initialized, codes = _transform(
            cls, slots, inherited, inherited_init, state_marker, user_bases, control_flow_name
        )
        if key:
            loader.cache_store(key, (sorted(state), sorted(initialized), codes))
    originals = {s.key: s.function for s in slots}
    return ClassDecision(state, initialized, originals, codes), slots


def _base_properties(cls: type) -> list[str]:
    return sorted(
        name for base in cls.__mro__[1:] for name, v in vars(base).items() if isinstance(v, property)
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
        module = sys.modules.get(base.__module__)
        top = base.__module__.partition(".")[0]
        if module is None or top in sys.builtin_module_names or top in _STDLIB:
            continue
        if not getattr(module, "__file__", None) and base.__module__ != "__main__":
            continue
        bases.append(base)
    return bases


def _base_facts(base: type) -> list[analysis.MethodFacts]:
    from autostate.transform import analysis

    facts = []
    for slot in source.find_methods(base):
        try:
            text = source.method_source(base, slot)
            facts.append(analysis.collect_facts(base.__name__, text))
        except (SourceUnavailableError, DecorationError, OSError):
            continue
    return facts


def _transform(
    cls: type,
    slots: list[source.MethodSlot],
    inherited: frozenset[str],
    inherited_init: frozenset[str],
    state_marker: Any,
    user_bases: list[type],
    control_flow_name: Callable[[Any], str | None],
) -> tuple[frozenset[str], frozenset[str], dict[str, types.CodeType]]:
    """Analyses and rewrites: ``(state, initialized, {slot key: code})``."""
    # Only a cache miss parses: libcst's import is a third of jax's, and a
    # warm start (every class cached) never pays it.
    from autostate.transform import analysis, rewrite

    sources, slots, skipped, unavailable = [], list(slots), [], None
    for slot in list(slots):
        try:
            sources.append(source.method_source(cls, slot))
        except SourceUnavailableError as exc:
            # Generated methods (a dataclass __init__) have no source; they still
            # reach state through the class's descriptors. Only a class with no
            # source at all cannot be decorated.
            unavailable = exc
            slots.remove(slot)
            skipped.append(slot)
    if unavailable is not None and not sources:
        raise unavailable
    globals_by_key = {s.key: s.function.__globals__ for s in slots}

    def is_state_declaration(facts: analysis.MethodFacts, dotted: str) -> bool:
        return _resolve(globals_by_key[facts.source.key], dotted) is state_marker

    facts = [analysis.collect_facts(cls.__name__, src) for src in sources]
    initialized: set[str] = set(inherited_init)
    bases = [(base, _base_facts(base)) for base in user_bases]
    for _base, base_facts_list in bases:
        for base_facts in base_facts_list:
            initialized.update(a.attr for a in base_facts.assignments)
    # A generated __init__ (dataclass, attrs) has no source to check; it sets
    # every field, so treat what the methods assign as initialized.
    initialized |= set(getattr(cls, "__dataclass_fields__", ()))
    if any(slot.attr == "__init__" for slot in skipped):
        initialized |= {a.attr for f in facts for a in f.assignments}
    result = analysis.analyze_class(
        cls.__name__,
        facts,
        inherited_state=inherited,
        inherited_initialized=frozenset(initialized),
        is_state_declaration=is_state_declaration,
        allow_nested_writes=True,  # closures' writes are threaded (autostate.control)
        inherited_properties=frozenset(_base_properties(cls)),
    )
    _check_undecorated_bases(cls, bases, result.state)
    codes: dict[str, types.CodeType] = {}
    for slot, method in zip(slots, result.methods):
        globals_ = globals_by_key[slot.key]
        control = {
            dotted: name
            for dotted in sorted(method.references)
            if (name := control_flow_name(_resolve(globals_, dotted))) is not None
        }
        if not control and (method.receiver is None or not (method.touched() & result.state)):
            continue
        text = rewrite.rewrite_method(
            method.module,
            method.function,
            method.receiver,
            result.state,
            cls.__name__,
            is_init=slot.attr == "__init__",
            control=control,
        )
        _, shift = analysis.wrapper_source(cls.__name__, method.source)
        codes[slot.key] = loader.compile_method(
            text,
            method.source.filename,
            cls.__name__,
            method.function.name.value,
            shift,
            slot.function.__code__.co_flags,
        )
    return result.state, result.initialized | initialized, codes


def _check_undecorated_bases(
    cls: type, bases: list[tuple[type, list[analysis.MethodFacts]]], state_attrs: frozenset[str]
) -> None:
    for base, base_facts in bases:
        for facts in base_facts:
            if facts.source.attr == "__init__" or facts.receiver is None:
                continue
            for assignment in facts.assignments:
                if assignment.attr in state_attrs:
                    raise DecorationError(
                        format_error(
                            f"@stateful cannot rewrite class {cls.__name__}: its undecorated base "
                            f"class {base.__name__} assigns state {assignment.attr!r} in "
                            f"{base.__name__}.{facts.source.key}, which would not be rewritten.",
                            where=f"{facts.source.filename}:{assignment.line}",
                            fix=f"decorate {base.__name__} with @autostate.stateful too.",
                        )
                    )
