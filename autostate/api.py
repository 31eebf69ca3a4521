"""The front door: ``@stateful``, ``state()``, ``functionalize`` and ``freeze``.

``@stateful`` asks ``transform`` which attributes are state and for rewritten
methods, puts the methods back on the *same* class object, installs a
descriptor per state attribute (so code outside the class sees plain
attributes) and registers the class as a pytree. Instances then hold request
slots that ``effects`` handles: ``functionalize`` is ``handle_local_states``
on the instance, ``freeze`` is ``freeze_local_states``.
"""

from __future__ import annotations

import builtins
import dataclasses
import sys
import types
from collections.abc import Callable, Hashable
from typing import Any, TypeVar, overload

import jax

from autostate import control as _control
from autostate import runtime as _runtime
from autostate import tree as _tree
from autostate.effects import (
    HandledLocalStateRef,
    WithFunctionalLocalState,
    contains_tracer,
    freeze_body,
    freeze_local_states,
    handle_local_states,
    run_with_states,
)
from autostate.effects.local_state import handler_running as _handler_running
from autostate.errors import (
    DecorationError,
    InvalidArgumentError,
    InvalidTypeError,
    MethodNotFoundError,
    SourceUnavailableError,
    StateAccessError,
    format_error,
)
from autostate.transform import analysis, loader, rewrite

T = TypeVar("T", bound=type)

DEFAULT_CATEGORY = "state"


@dataclasses.dataclass(frozen=True)
class StatefulInfo:
    """What decoration decided about a class (``cls.__autostate_info__``)."""

    state: frozenset[str]
    category: Hashable
    categories: dict[str, Hashable]
    fallback: str | None
    slot_factory: Callable[..., Any] | None = None


def state(value: Any, *, category: Hashable | None = None, name: str | None = None) -> Any:
    """Declares ``self.x`` as state in ``__init__``, even if no method assigns it.

    Example::

        @autostate.stateful
        class Cache:
            def __init__(self):
                self.kv = autostate.state(jnp.zeros(4), category="cache", name="kv")

    **Arguments:**
    - ``value``: the initial value.
    - ``category``: the state's category (default: the class's category).
    - ``name``: an explicit state name instead of the attribute path.

    **Returns:** a marker that ``@stateful`` turns into a state request.
    """
    return _runtime.StateDeclaration(value, category, name)


@overload
def stateful(cls: T) -> T: ...
@overload
def stateful(
    cls: None = None, *, category: Hashable = DEFAULT_CATEGORY, fallback: str | None = None
) -> Callable[[T], T]: ...


def stateful(cls=None, *, category=DEFAULT_CATEGORY, fallback=None):
    """Makes a plain class that mutates ``self`` usable as a pure JAX function.

    Example::

        @autostate.stateful
        class Counter:
            def __init__(self):
                self.count = jnp.zeros(())
            def __call__(self, x):
                self.count += 1
                return x * self.count

        c = Counter()
        c(2.0)                       # eager: c.count == 1
        f, states = c.functionalize()
        y, states = jax.jit(lambda f, s, x: f(s, x))(f, states, 2.0)

    **Arguments:**
    - ``category``: category of the class's states (default ``"state"``).
    - ``fallback``: ``"host"`` keeps state in a host-side store reached by
      ordered callbacks, for closures that mutate state inside ``lax``
      control flow.

    **Returns:** the same class, rewritten in place.
    """
    if fallback not in (None, "host"):
        raise InvalidArgumentError(
            format_error(
                f"Unknown fallback {fallback!r}.", fix='use fallback=None or fallback="host".'
            )
        )
    if cls is None:
        return lambda c: _decorate(c, category, fallback)
    return _decorate(cls, category, fallback)


def _resolves_to_state(globals_: dict[str, Any], dotted: str) -> bool:
    head, *rest = dotted.split(".")
    obj = globals_.get(head, getattr(builtins, head, None))
    for part in rest:
        obj = getattr(obj, part, None)
    return obj is state


def _resolve_dotted(globals_: dict[str, Any], dotted: str) -> Any:
    head, *rest = dotted.split(".")
    obj = globals_.get(head, getattr(builtins, head, None))
    for part in rest:
        obj = getattr(obj, part, None)
    return obj


def _control_flow_names(globals_: dict[str, Any], facts: analysis.MethodFacts) -> dict[str, str]:
    """The method's dotted names that are jax.lax control flow: ``{"lax.scan": "scan"}``."""
    found = {}
    for dotted in facts.references:
        name = _control.wrapper_name(_resolve_dotted(globals_, dotted))
        if name is not None:
            found[dotted] = name
    return found


def _base_infos(cls: type) -> list[StatefulInfo]:
    return [b.__dict__["__autostate_info__"] for b in cls.__mro__[1:] if "__autostate_info__" in b.__dict__]


def _undecorated_user_bases(cls: type) -> list[type]:
    bases = []
    for base in cls.__mro__[1:]:
        if base is object or "__autostate_info__" in base.__dict__:
            continue
        module = sys.modules.get(base.__module__)
        top = base.__module__.partition(".")[0]
        if module is None or top in sys.builtin_module_names or top in _STDLIB:
            continue
        if not getattr(module, "__file__", None) and base.__module__ != "__main__":
            continue
        bases.append(base)
    return bases


# Standard-library bases (abc.ABC, typing.Generic, ...) are not user code.
_STDLIB = frozenset(getattr(sys, "stdlib_module_names", ()))


def _base_facts(base: type) -> list[analysis.MethodFacts]:
    facts = []
    for slot in loader.find_methods(base):
        try:
            source = loader.method_source(base, slot)
            facts.append(analysis.collect_facts(base.__name__, source))
        except (SourceUnavailableError, DecorationError, OSError):
            continue
    return facts


def _transform(cls: type, slots: list[loader.MethodSlot], fallback: str | None, inherited: frozenset[str]):
    """Analyses and rewrites; returns (state, declared, {key: code})."""
    sources, slots, skipped, unavailable = [], list(slots), [], None
    for slot in list(slots):
        try:
            sources.append(loader.method_source(cls, slot))
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
        return _resolves_to_state(globals_by_key[facts.source.key], dotted)

    facts = [analysis.collect_facts(cls.__name__, src) for src in sources]
    inherited_initialized: set[str] = set()
    bases = [(base, _base_facts(base)) for base in _undecorated_user_bases(cls)]
    for _base, base_facts_list in bases:
        for base_facts in base_facts_list:
            for assignment in base_facts.assignments:
                inherited_initialized.add(assignment.attr)
    for info in _base_infos(cls):
        inherited_initialized |= info.state
    # A generated __init__ (dataclass, attrs) has no source to check; it sets
    # every field, so treat what the methods assign as initialized.
    inherited_initialized |= set(getattr(cls, "__dataclass_fields__", ()))
    if any(slot.attr == "__init__" for slot in skipped):
        inherited_initialized |= {a.attr for f in facts for a in f.assignments}
    result = analysis.analyze_class(
        cls.__name__,
        facts,
        inherited_state=inherited,
        inherited_initialized=frozenset(inherited_initialized),
        is_state_declaration=is_state_declaration,
        allow_nested_writes=True,  # closures' writes are threaded (autostate.control)
        inherited_properties=frozenset(
            name for base in cls.__mro__[1:] for name, v in vars(base).items() if isinstance(v, property)
        ),
    )
    _check_undecorated_bases(cls, bases, result.state)
    codes: dict[str, types.CodeType] = {}
    for slot, method in zip(slots, result.methods):
        control = _control_flow_names(globals_by_key[slot.key], method)
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
    return result.state, result.declared, codes


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


def _decorate(cls: T, category: Hashable, fallback: str | None) -> T:
    if not isinstance(cls, type):
        raise InvalidTypeError(
            format_error(
                f"@stateful decorates classes, got {type(cls).__name__}.",
                fix="put @autostate.stateful on a class statement.",
            )
        )
    info = cls.__dict__.get("__autostate_info__")
    if info is not None:
        if (info.category, info.fallback) == (category, fallback):
            return cls
        # Decorated automatically as a subclass, now explicitly with other options.
        del cls.__autostate_info__
    bases = _base_infos(cls)
    inherited = frozenset().union(*(b.state for b in bases)) if bases else frozenset()
    inherited_categories: dict[str, Hashable] = {}
    for info in reversed(bases):
        inherited_categories.update(info.categories)
    slots = loader.find_methods(cls)
    key = loader.cache_key(cls, slots, (fallback, tuple(sorted(inherited)), sys.version))
    cached = loader.cache_load(key) if key else None
    if cached is not None:
        state_list, declared, codes = cached
        state_attrs = frozenset(state_list)
    else:
        state_attrs, declared, codes = _transform(cls, slots, fallback, inherited)
        if key:
            loader.cache_store(key, (sorted(state_attrs), dict(declared), codes))
    for slot in slots:
        code = codes.get(slot.key)
        if code is not None:
            slot.install(loader.build_function(code, slot.function, _runtime))
    for attr in state_attrs:
        existing = None
        for klass in cls.__mro__:
            if attr in klass.__dict__:
                existing = klass.__dict__[attr]
                break
        if not isinstance(existing, _runtime.StateAttribute):
            setattr(cls, attr, _runtime.StateAttribute(attr, existing))
    if cls.__setattr__ is object.__setattr__:
        cls.__setattr__ = _guarded_setattr
    slot_factory = None
    if fallback == "host":
        from autostate import host

        slot_factory = host.make_host_slot
    cls.__autostate_info__ = StatefulInfo(
        state=state_attrs,
        category=category,
        categories=inherited_categories,
        fallback=fallback,
        slot_factory=slot_factory,
    )
    if "functionalize" not in cls.__dict__ and not hasattr(cls, "functionalize"):
        cls.functionalize = _functionalize_method
    if cls.__repr__ is object.__repr__:  # keep a __repr__ the class or a base defines
        from autostate.export import model_repr

        cls.__repr__ = model_repr
    if not hasattr(cls, "__treescope_repr__"):  # keep one the class or a base defines
        from autostate.export import model_treescope_repr

        cls.__treescope_repr__ = model_treescope_repr
    _install_subclass_hook(cls, category, fallback)
    _tree.register_stateful_class(cls)
    return cls


def _install_subclass_hook(cls: type, category: Hashable, fallback: str | None) -> None:
    """Subclasses are decorated too, as an ``nn.Module`` subclass is a module.

    The class's own ``__init_subclass__`` (if it wrote one) still runs first.
    An explicit ``@stateful(...)`` on the subclass with other options
    re-decorates it.
    """
    own = cls.__dict__.get("__init_subclass__")

    def __init_subclass__(sub: type, **kwargs: Any) -> None:
        if own is not None:
            own.__get__(None, sub)(**kwargs)
        else:
            super(cls, sub).__init_subclass__(**kwargs)
        if "__autostate_info__" not in sub.__dict__:
            _decorate(sub, category, fallback)

    cls.__init_subclass__ = classmethod(__init_subclass__)


def _guarded_setattr(self: Any, name: str, value: Any) -> None:
    """``model.x = v`` for an attribute that is not state.

    Plain Python, except inside a functionalized call on a model whose states
    are handled: there such a write would land on a copy that the pure
    function throws away (or keep a tracer), so it is refused with the fix.
    """
    if (
        _handler_running()
        and name not in type(self).__autostate_info__.state
        and not hasattr(type(getattr(type(self), name, None)), "__set__")  # a property
        and any(type(v) is HandledLocalStateRef for v in self.__dict__.values())
    ):
        raise StateAccessError(
            format_error(
                f"{type(self).__name__}.{name} is not state, so assigning it inside a "
                "functionalized call would be lost when the call returns.",
                fix=f"make it state: assign `self.{name}` in a method of the class, or declare "
                f"it in __init__ with `self.{name} = autostate.state(...)`.",
            )
        )
    object.__setattr__(self, name, value)


def _check_unchanged(model_name: str, before: tuple, after: tuple) -> None:
    """Refuses a traced call that changed the model outside its states.

    Under a transformation the model inside ``f`` is a throwaway copy, so a
    change that is not a state write (``self.log.append(x)`` on a list that
    is not state) would vanish silently with the trace.
    """
    (old_leaves, old_def), (new_leaves, new_def) = before, after
    if old_def == new_def and all(a is b for a, b in zip(old_leaves, new_leaves)):
        return
    changed = [
        name
        for name, a, b in zip(new_def.names, old_leaves, new_leaves)
        if a is not b
    ]
    where = f" (at {', '.join(changed[:3])})" if changed and old_def == new_def else ""
    raise StateAccessError(
        format_error(
            f"A functionalized call changed {model_name}'s attributes outside its states"
            f"{where}, e.g. by mutating a list or dict in place; under jax.jit/grad/vmap "
            "that change would be lost when the call returns.",
            fix="make the attribute state and assign a new value "
            "(`self.log = self.log + [x]`), or keep such bookkeeping out of the jitted call.",
        )
    )


class FunctionalModel:
    """A functionalized model: ``f(states, *args)`` returns ``(out, new_states)``.

    ``f.<method>(states, *args, **kwargs)`` calls any other method the same
    way. It is a pytree whose leaves are the model's parameters, so it can be
    passed into ``jax.jit``, differentiated with ``jax.grad`` and updated
    with ``jax.tree_util.tree_map`` or optax.

    ``f`` is immutable: make a new one with ``tree_map`` rather than
    assigning into ``f.model``. That is what lets it flatten once and reuse
    the result on every call of a jitted step (per-call dispatch then costs
    what a dict of arrays costs), and what keeps tied weights (one instance
    on two paths) one leaf.
    """

    __slots__ = ("handler_id", "_model", "_flat")

    def __init__(self, handler_id: Hashable, model: Any = None, flat: tuple | None = None):
        self.handler_id = handler_id
        self._model = model
        self._flat = flat  # (leaves, graphdef), computed on first flatten

    @property
    def model(self) -> Any:
        """The handled model (its states are ``HandledLocalStateRef``s)."""
        if self._model is None:
            leaves, graphdef = self._flat
            self._model = _tree.unflatten_graph(graphdef, leaves)
        return self._model

    def _flattened(self) -> tuple:
        if self._flat is None:
            self._flat = _tree.flatten_graph(self._model)
        return self._flat

    def __call__(self, states: dict[str, Any], *args: Any, **kwargs: Any):
        return self._run(states, self.model, args, kwargs)

    def _run(self, states: dict[str, Any], fn: Callable[..., Any], args: tuple, kwargs: dict):
        traced = contains_tracer(states)
        before = _tree.flatten_graph(self.model) if traced else None
        try:
            result = run_with_states(self.handler_id, states, fn, args, kwargs)
        finally:
            # States of categories left unhandled live in the model itself; an
            # eager call may have replaced them, so the cached flatten is stale.
            self._flat = None
        _control.check_no_escaped(result[1])
        if before is not None:
            _check_unchanged(type(self.model).__name__, before, _tree.flatten_graph(self.model))
        return result

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_"):
            raise AttributeError(name)
        model = self.model
        method = getattr(type(model), name, None)
        if method is None or not callable(method):
            raise MethodNotFoundError(
                format_error(
                    f"{type(model).__name__} has no method {name!r} to call functionally.",
                    fix="call f.<method>(states, ...) with a method the class defines.",
                )
            )

        def call(states: dict[str, Any], *args: Any, **kwargs: Any):
            return self._run(states, getattr(model, name), args, kwargs)

        call.__name__ = name
        return call

    def __repr__(self) -> str:
        return f"FunctionalModel({self.model!r})"

    def __treescope_repr__(self, path: str | None, subtree_renderer: Any) -> Any:
        """Treescope shows the handled model, its states highlighted as handled."""
        from treescope import repr_lib

        return repr_lib.render_object_constructor(
            FunctionalModel,
            {"handler_id": self.handler_id, "model": self.model},
            path,
            subtree_renderer,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FunctionalModel):
            return NotImplemented
        return self.handler_id == other.handler_id and _trees_equal(self, other)

    __hash__ = None  # type: ignore[assignment]


def _trees_equal(a: Any, b: Any) -> bool:
    leaves_a, def_a = jax.tree_util.tree_flatten(a)
    leaves_b, def_b = jax.tree_util.tree_flatten(b)
    if def_a != def_b:
        return False
    import numpy as np

    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(leaves_a, leaves_b))


def _flatten_functional(f: FunctionalModel):
    leaves, graphdef = f._flattened()
    return leaves, (f.handler_id, graphdef)


def _flatten_functional_with_keys(f: FunctionalModel):
    leaves, graphdef = f._flattened()
    keys = [jax.tree_util.GetAttrKey(f"model.{n}") for n in graphdef.names]
    return list(zip(keys, leaves)), (f.handler_id, graphdef)


def _unflatten_functional(aux: tuple, leaves) -> FunctionalModel:
    handler_id, graphdef = aux
    leaves = list(leaves)
    return FunctionalModel(handler_id, None, (leaves, graphdef))


jax.tree_util.register_pytree_with_keys(
    FunctionalModel, _flatten_functional_with_keys, _unflatten_functional, _flatten_functional
)
_tree.register_dynamic_type(FunctionalModel)


def _functionalize_method(
    self: Any,
    category: Hashable | None = None,
    *,
    category_predicate: Callable[[Hashable], bool] | None = None,
    lazy: bool = False,
    state_sharing: str = "forbidden",
) -> tuple[FunctionalModel, Any]:
    """Returns ``(f, states)``: a pure function of the model's states.

    Example::

        f, states = model.functionalize()
        out, states = jax.jit(lambda f, s, x: f(s, x))(f, states, x)
        model = autostate.freeze(f, states)

    **Arguments:**
    - ``category``: handle only states of this category (``None``: all).
    - ``category_predicate``: alternatively, a predicate on categories.
    - ``lazy``: return a thunk computing the states instead of the dict.
    - ``state_sharing``: ``"forbidden"``, ``"allowed"`` or ``"unsafe"``.

    **Returns:** ``(f, states)``; ``f(states, *args)`` and
    ``f.<method>(states, *args)`` return ``(out, new_states)``.
    """
    if category is None and category_predicate is None:
        category_predicate = _all_categories
    prepared = (
        _prepare_hook(self, category, category_predicate) if _prepare_hook is not None else self
    )
    handler, states = handle_local_states(
        prepared,
        category=category,
        category_predicate=category_predicate,
        lazy=lazy,
        state_sharing=state_sharing,
        handler_id=_handler_id_for(category, category_predicate),
    )
    return FunctionalModel(handler.handler_id, handler.body), states


# Set by autostate.host: turns host-store slots of the requested categories
# into frozen requests first; called as hook(model, category, category_predicate).
_prepare_hook: Callable[..., Any] | None = None


def _all_categories(_category: Hashable) -> bool:
    return True


def _handler_id_for(
    category: Hashable | None, category_predicate: Callable[[Hashable], bool] | None
) -> Hashable | None:
    """A handler id that depends only on which states are handled.

    So functionalizing a frozen model again gives an *equal* ``f`` (and a
    jitted step sees the same pytree structure: no recompilation), while
    functionalizing one category inside another's call still nests: their
    ids differ. A custom predicate cannot be named; it gets a fresh id.
    """
    if category_predicate is _all_categories:
        return "autostate:*"
    if category_predicate is None:
        return f"autostate:{category!r}"
    return None


def functionalize(model: Any, *args: Any, **kwargs: Any) -> tuple[FunctionalModel, Any]:
    """Function form of ``model.functionalize(...)``."""
    return _functionalize_method(model, *args, **kwargs)


def freeze(f: Any, states: dict[str, Any]) -> Any:
    """Inverse of ``functionalize``: the model with ``states`` embedded.

    Example::

        f, states = model.functionalize()
        _, states = f(states, x)
        model = autostate.freeze(f, states)   # an instance of model's class

    **Arguments:**
    - ``f``: a ``FunctionalModel`` (or an engine ``WithFunctionalLocalState``).
    - ``states``: the states dict to embed.

    **Returns:** the model (or body) holding ``FrozenLocalStateRequest``s;
    instances of ``fallback="host"`` classes get fresh host stores instead.
    """
    if isinstance(f, FunctionalModel):
        frozen = freeze_body(f.handler_id, f.model, states)
    elif isinstance(f, WithFunctionalLocalState):
        frozen = freeze_local_states(f, states)
    else:
        raise InvalidTypeError(
            format_error(
                f"freeze expects the f returned by functionalize(), got {type(f).__name__}.",
                fix="call `f, states = model.functionalize()` and pass both to freeze.",
            )
        )
    return _freeze_hook(frozen) if _freeze_hook is not None else frozen


# Set by autostate.host: gives the instances of host-fallback classes in a
# freshly frozen model host slots holding their frozen values; hook(model).
_freeze_hook: Callable[[Any], Any] | None = None
