"""The front door: ``@stateful``, ``state()``, ``functionalize`` and ``freeze``.

``@stateful`` asks ``transform`` for a class's decision (which attributes are
state, and rewritten methods), puts the methods back on the *same* class
object, installs a descriptor per state attribute (so code outside the class
sees plain attributes) and registers the class as a pytree. Instances then
hold slots that ``effects`` handles: ``functionalize`` is
``handle_local_states`` on the instance, ``freeze`` is ``freeze_local_states``.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Hashable, Mapping
from typing import TYPE_CHECKING, Any, Self, TypeGuard, TypeVar, overload

import jax

from autostate import graph as _graph
from autostate import runtime as _runtime
from autostate import tree as _tree
from autostate.effects.local_state import (
    FrozenLocalStateRequest,
    HandledLocalStateRef,
    StateSharing,
    WithFunctionalLocalState,
    freeze_body,
    freeze_local_states,
    handle_local_states,
    handler_running,
    is_running,
)
from autostate.errors import (
    DecorationError,
    InvalidArgumentError,
    InvalidTypeError,
    StaticStateError,
    format_error,
    refused,
)
from autostate.functional import (
    CONSTANT,
    FunctionalModel,
    all_categories,
    check_state_keys,
    embed_constants,
    extract_constants,
    handler_id_for,
)
from autostate.lifting import routes as _routes
from autostate.state_values import HandledStaticState, states_dict
from autostate.transform import loader
from autostate.transform.pipeline import (
    ClassDecision,
    awaits_generated_init,
    class_location,
    decide_class,
)
from autostate.tree import INFO_ATTR

if TYPE_CHECKING:
    from autostate.packing import PackedModel

T = TypeVar("T", bound=type)
M = TypeVar("M")
V = TypeVar("V")  # a declared value: state() and constant() return its type

DEFAULT_CATEGORY = "state"


@dataclasses.dataclass(frozen=True)
class StatefulInfo:
    """What decoration decided about a class (``autostate.tree.class_info(cls)``)."""

    decision: ClassDecision
    category: Hashable
    fallback: str | None
    slot_factory: Callable[..., Any] | None = None

    @property
    def state(self) -> frozenset[str]:
        return self.decision.state

    def __set_name__(self, owner: type, name: str) -> None:
        # Python calls this when a class is made from a namespace holding
        # this info: a decorator above ``@stateful`` rebuilt the decorated
        # class (``@dataclass(slots=True)``). The new class is decorated as
        # it is made, so that what it cannot hold is refused there.
        _decorate(owner, self.category, self.fallback)


def state(
    value: V, *, category: Hashable | None = None, name: str | None = None, sharding: Any = None,
) -> V:
    """Declares ``self.x`` as state in ``__init__``, even if no method assigns it.

    Args:
        value: the initial value.
        category: the state's category (default: the class's category).
        name: an explicit state name instead of the attribute path.
        sharding: a ``jax.sharding.PartitionSpec`` (mesh or logical axis
            names) saying how the state is laid out on a mesh; read by
            ``autostate.partition_specs`` and ``autostate.shardings``.

    Returns:
        A marker that ``@stateful`` turns into a state request (typed as
        ``value``'s type, which is what the attribute then holds).

    Examples:
        >>> @autostate.stateful
        ... class Cache:
        ...     def __init__(self):
        ...         self.kv = autostate.state(jnp.zeros(2), category="cache", name="kv")
        ...
        ...     def __call__(self, x):
        ...         return self.kv + x
        >>> f, states = Cache().functionalize(category="cache")
        >>> states
        {'kv': Array([0., 0.], dtype=float32)}
    """
    if isinstance(value, _runtime.StateDeclaration):  # ``state(state(v))``: the outer options win
        category = value.category if category is None else category
        name = value.name if name is None else name
        sharding = value.sharding if sharding is None else sharding
        value = value.value
    # Typed as the value: the marker is the value once ``__init__`` has run.
    return _runtime.StateDeclaration(value, category, name, sharding)  # type: ignore[return-value]


def constant(value: V, *, name: str | None = None) -> V:
    """Marks ``self.x`` in ``__init__`` as a non-trainable constant.

    A constant travels in the states dict (category ``"constant"``), like a
    PyTorch buffer: ``jax.grad`` and optax over ``f`` never see it, and it is
    in ``state_dict``, not ``param_dict``. Integer, bool and PRNG-key arrays
    are constants without the marker.

    Args:
        value: the array (or pytree of arrays).
        name: an explicit name instead of the attribute path.

    Returns:
        A marker that ``@stateful`` turns into a constant.

    Examples:
        >>> @autostate.stateful
        ... class Encoder:
        ...     def __init__(self):
        ...         self.table = autostate.constant(jnp.arange(3.0))  # not trained
        ...         self.w = jnp.ones(3)  # trained
        ...
        ...     def __call__(self, x):
        ...         return (x + self.table) * self.w
        >>> f, states = Encoder().functionalize()
        >>> states
        {'table': Array([0., 1., 2.], dtype=float32)}
        >>> list(autostate.param_dict(f))
        ['w']
    """
    # Typed as the value: the marker is the value once ``__init__`` has run.
    return _runtime.StateDeclaration(value, CONSTANT, name, marker="constant")  # type: ignore[return-value]


@overload
def stateful(cls: T, *, category: Hashable = DEFAULT_CATEGORY, fallback: str | None = None) -> T: ...
@overload
def stateful(
    cls: None = None, *, category: Hashable = DEFAULT_CATEGORY, fallback: str | None = None
) -> Callable[[T], T]: ...


def stateful(cls=None, *, category=DEFAULT_CATEGORY, fallback=None):
    """Makes a plain class that mutates ``self`` usable as a pure JAX function.

    The class is rewritten in place: its methods read and assign state as the
    plain Python does, eagerly, and ``functionalize()`` turns an instance into
    a pure ``f(states, *args) -> (out, new_states)`` for ``jax.jit``,
    ``jax.grad`` and ``jax.vmap``. Used bare (``@autostate.stateful``) or
    with options (``@autostate.stateful(category="cache")``).

    Args:
        cls (type | None): the class to decorate; omitted when options are
            given.
        category (Hashable): the category of the class's states (default
            ``"state"``).
        fallback (str | None): ``"host"`` keeps state in a host-side store
            reached by ordered callbacks, for closures that mutate state
            inside ``lax`` control flow.

    Returns:
        (type | Callable[[type], type]): The same class, rewritten in place
            (or, without ``cls``, a decorator).

    Raises:
        InvalidArgumentError: ``fallback`` is neither ``None`` nor ``"host"``.
        DecorationError: the class's source is unavailable, or it uses a
            construct the rewrite cannot express (``del self.x`` on a state,
            for one).

    Examples:
        >>> @autostate.stateful
        ... class Counter:
        ...     def __init__(self):
        ...         self.count = jnp.zeros((), jnp.int32)
        ...
        ...     def __call__(self, x):
        ...         self.count += 1
        ...         return x * self.count
        >>> counter = Counter()
        >>> print(counter(2.0), counter.count)  # eagerly, as plain Python
        2.0 1
        >>> f, states = counter.functionalize()
        >>> out, states = jax.jit(lambda f, s, x: f(s, x))(f, states, 2.0)
        >>> print(out, states["count"])
        4.0 2
    """
    if fallback is not None and fallback != "host":
        raise InvalidArgumentError(format_error(
            f"Unknown fallback {fallback!r}.", fix='use fallback=None or fallback="host".'
        ))
    if cls is None:
        return lambda c: stateful(c, category=category, fallback=fallback)
    return _decorate(cls, category, fallback)


def _decorate(cls: T, category: Hashable, fallback: str | None) -> T:
    _check_is_class(cls)
    previous = _tree.class_info(cls)
    if (
        previous is not None
        and (previous.category, previous.fallback) == (category, fallback)
        and _state_descriptors_in_place(cls, previous.state)
    ):
        return cls
    decision, slots = decide_class(
        cls,
        fallback=fallback,
        bases=[info.decision for k in cls.__mro__[1:] if (info := _tree.class_info(k)) is not None],
        previous=previous.decision if previous is not None else None,
        state_marker=(state, constant),
        is_decorated=lambda base: _tree.class_info(base) is not None,
        control_flow_name=_routes.wrapper_name,
    )
    _check_state_descriptors(cls, decision.state)
    _install_methods(slots, decision)
    _install_state_descriptors(cls, decision.state)
    _runtime.install_class_defaults(cls, decision.defaults)
    _install_defaults(cls)
    _install_subclass_hook(cls, category, fallback)
    slot_factory = after_copy = None
    if fallback == "host":
        # Imported only when a class asks for it: the host engine's JAX
        # imports (jax.extend) were a fifth of ``import autostate``.
        from autostate import host

        slot_factory, after_copy = host.make_host_slot, host.restore_host_slots
    _graph.register_stateful_class(
        cls, StatefulInfo(decision, category, fallback, slot_factory), after_copy=after_copy
    )
    return cls


def _check_is_class(cls: Any) -> None:
    if not isinstance(cls, type):
        raise InvalidTypeError(format_error(
            f"@stateful decorates classes, got {type(cls).__name__}.",
            fix="put @autostate.stateful on a class statement.",
        ))
    builtin = next(
        (b for b in cls.__mro__[1:-1] if b.__module__ == "builtins" and b is not object), None
    )
    if builtin is not None:
        # A model is copied and rebuilt from its __dict__ (functionalize, jit,
        # freeze); an int, a tuple, a dict or an exception keeps its data
        # elsewhere, and object.__new__ cannot make one.
        raise DecorationError(format_error(
            f"@stateful cannot decorate {cls.__qualname__}: it subclasses the builtin "
            f"{builtin.__name__}, whose data lives outside the instance's attributes, so "
            "f's copy of the model could not be rebuilt.",
            where=class_location(cls),
            fix=f"hold the {builtin.__name__} in an attribute of a plain class "
            f"(`self.data = {builtin.__name__}(...)`) instead of subclassing it.",
        ))


def _install_methods(slots: list, decision: ClassDecision) -> None:
    # Every refusal first (a wrapper it cannot reach into): a decoration that
    # fails leaves the class as it was, so that the next use fails the same way.
    for slot in slots:
        if slot.check is not None and slot.key in decision.codes:
            slot.check()
    for slot in slots:
        code = decision.codes.get(slot.key)
        if code is not None:
            slot.install(loader.build_function(code, slot.function, _runtime))


def _check_state_descriptors(cls: type, state_attrs: frozenset[str]) -> None:
    """Refuses a state whose name a data descriptor of the user's holds (a clamp,
    a validator): autostate's descriptor takes its place, so its code would
    silently never run."""
    for attr in state_attrs:
        found = next((k.__dict__[attr] for k in cls.__mro__ if attr in k.__dict__), None)
        kind = type(found)
        if (
            found is None
            or kind is _runtime.StateAttribute
            or kind in (types.MemberDescriptorType, types.GetSetDescriptorType)
            or not (hasattr(kind, "__set__") or hasattr(kind, "__delete__"))
        ):
            continue
        owner = next(k for k in cls.__mro__ if attr in k.__dict__)
        raise DecorationError(format_error(
            f"{owner.__qualname__}.{attr} is a data descriptor ({kind.__qualname__}, "
            f"which defines __set__), and {cls.__qualname__} assigns self.{attr} as a "
            "state: autostate keeps a state's value itself, so the descriptor's "
            "__get__ and __set__ would never run.",
            where=class_location(owner),
            fix=f"keep the value in a plain attribute and make {attr} a property: "
            f"`@property def {attr}(self): return self._{attr}`, with a setter that "
            f"does what {kind.__qualname__}.__set__ does and assigns `self._{attr} = ...` "
            f"(autostate tracks _{attr} as the state).",
        ))


def _install_state_descriptors(cls: type, state_attrs: frozenset[str]) -> None:
    for attr in state_attrs:
        found = [k.__dict__[attr] for k in cls.__mro__ if attr in k.__dict__]
        if not found:
            setattr(cls, attr, _runtime.StateAttribute(attr))
        elif not isinstance(found[0], _runtime.StateAttribute):
            setattr(cls, attr, _runtime.StateAttribute(attr, found[0]))


def _state_descriptors_in_place(cls: type, state_attrs: frozenset[str]) -> bool:
    """Whether a decorated class still has its states' descriptors (a class
    decorator applied after decoration may have replaced them: then it is
    decorated again)."""
    return all(_runtime.state_descriptor(cls, a) is not None for a in state_attrs)


def _install_defaults(cls: type) -> None:
    """What every decorated class has unless it (or a base) defines its own."""
    # The run-time guard wraps whatever __setattr__ the class has; a user's own
    # __setattr__/__getattribute__ then also sees the rewritten state accesses.
    setter = cls.__setattr__
    if setter is object.__setattr__:
        cls.__setattr__ = _runtime.guarded_setattr  # type: ignore[method-assign, assignment]
    elif setter is not _runtime.guarded_setattr and not hasattr(setter, "_autostate_guarded"):
        cls.__setattr__ = _runtime.guard_setattr(setter)  # type: ignore[method-assign]
    _runtime.register_access_hooks(
        cls,
        getattribute=cls.__getattribute__ is not object.__getattribute__,
        setattr_=cls.__setattr__ is not _runtime.guarded_setattr,
    )
    for name, default in (
        ("__copy__", _copy_method), ("__deepcopy__", _deepcopy_method),
        ("functionalize", _functionalize_method), ("train", _train_method),
        ("eval", _eval_method), ("__treescope_repr__", _treescope_repr_method),
    ):
        if not hasattr(cls, name):
            setattr(cls, name, default)
    if cls.__repr__ is object.__repr__ and not awaits_generated_init(cls):
        cls.__repr__ = _repr_method  # type: ignore[method-assign, assignment]


# A decorated class's copies and repr: ``copies`` and ``render`` are imported
# by the first copy or repr, not by every ``import autostate``.
def _copy_method(self: Any) -> Any:
    from autostate.copies import copy_instance

    return copy_instance(self)


def _deepcopy_method(self: Any, memo: dict[int, Any]) -> Any:
    from autostate.copies import deepcopy_instance

    return deepcopy_instance(self, memo)


def _repr_method(self: Any) -> str:
    from autostate.render import model_repr

    return model_repr(self)


def _treescope_repr_method(self: Any, path: str | None, subtree_renderer: Any) -> Any:
    from autostate.render import model_treescope_repr

    return model_treescope_repr(self, path, subtree_renderer)


def _install_subclass_hook(cls: type, category: Hashable, fallback: str | None) -> None:
    """Subclasses are decorated too, as an ``nn.Module`` subclass is a module; the
    class's own ``__init_subclass__`` runs first, and an explicit
    ``@stateful(...)`` with other options re-decorates."""
    own: Any = cls.__dict__.get("__init_subclass__")
    if getattr(getattr(own, "__func__", None), "_autostate_hook", False):
        own = own.__func__._autostate_own  # re-decoration: wrap what the user wrote

    def __init_subclass__(sub: type, /, **kwargs: Any) -> None:
        if own is not None:
            own.__get__(None, sub)(**kwargs)
        else:
            super(cls, sub).__init_subclass__(**kwargs)  # type: ignore[arg-type]
        if INFO_ATTR not in sub.__dict__:
            stateful(sub, category=category, fallback=fallback)

    __init_subclass__._autostate_hook = True  # type: ignore[attr-defined]
    __init_subclass__._autostate_own = own  # type: ignore[attr-defined]
    cls.__init_subclass__ = classmethod(__init_subclass__)  # type: ignore[method-assign, assignment]


def _train_method(self: M, mode: bool = True) -> M:
    """Sets ``training`` to ``mode`` on this model and every sub-model, as
    PyTorch's ``Module.train``; returns the model.

    ``training`` is static config: part of ``f``'s structure, so a jitted
    step compiles once per mode. A sub-model whose class defines its own
    ``train`` is switched by calling it. Inside a functionalized call the
    mode is fixed; ``autostate.freeze(f, states).eval().functionalize()``
    gives the evaluation ``f`` from a trained one.

    Args:
        mode: ``True`` for training, ``False`` for evaluation.

    Returns:
        The model itself.

    Raises:
        InvalidArgumentError: ``mode`` is not a bool.
        StaticStateError: called inside a functionalized call (``f.eval(states)``)
            where it would change a mode.
    """
    if not isinstance(mode, bool):
        raise InvalidArgumentError(format_error(
            f"train(mode) takes a bool, got {mode!r}.",
            fix="call `model.train()`, `model.train(False)` or `model.eval()`.",
        ))
    for model in _graph.instances_of(self):
        if model is not self and type(model).train is not _train_method:
            model.train(mode)  # a sub-model's own train(), as PyTorch calls it
        elif getattr(model, "training", None) is not mode:
            if _runtime.is_guarded(model):
                _refuse_mode_change(model, mode)
            model.training = mode
    return self


def _eval_method(self: M) -> M:
    """Sets evaluation mode on this model and every sub-model: ``train(False)``.

    Returns:
        The model itself, so that ``autostate.freeze(f, states).eval().functionalize()``
        gives the evaluation ``f`` in one line.
    """
    return self.train(False)  # type: ignore[attr-defined]


def _refuse_mode_change(model: Any, mode: bool) -> None:
    method = "train()" if mode else "eval()"
    raise refused(StaticStateError(format_error(
        f"{method} inside a functionalized call would switch "
        f"{type(model).__name__}.training to {mode}: `training` is static config, part "
        "of f's structure (one compile per mode), fixed for the call.",
        fix=f"switch the mode on a model made from f's states: `f_{method[:-2]}, states = "
        f"autostate.freeze(f, states).{method[:-1]}).functionalize()`.",
    )))


def _undecorated_arrays(model: Any) -> list[str]:
    """The array attributes of an instance of a plain class that JAX sees as one
    opaque leaf (no @stateful, no pytree registration): what a walk would miss."""
    if _graph.is_dynamic(model) or not isinstance(getattr(model, "__dict__", None), dict):
        return []
    return [
        k for k, v in vars(model).items()
        if any(isinstance(leaf, jax.Array) for leaf in jax.tree_util.tree_leaves(v))
    ]


def _check_functionalize_arguments(
    model: Any, category: Any, category_predicate: Any, caller: str, rebuilds: bool = True
) -> None:
    """Refuses what cannot be functionalized, before anything walks it
    (``caller``: what the user called, as its refusals name it; ``rebuilds``:
    its ``f`` is run, jitted or frozen, not only read)."""
    what = None
    fix = (
        "build the model first (`Model(...)`, its class decorated with @autostate.stateful) "
        "and pass that instance"
    )
    if model is None:
        what = "None"
    elif isinstance(model, type):
        what = f"the class {model.__name__} itself"
        fix = f"build the model first and pass that instance (`{model.__name__}(...)`)"
    elif isinstance(model, FunctionalModel) or _is_packed(model):
        what = f"a {type(model).__name__} (what functionalize() returned)"
        fix = "pass the model: autostate.freeze(f, states) gives it back (an f is functional already)"
    elif _undecorated_arrays(model):
        what = (
            f"a {type(model).__name__}, whose class is not decorated: its arrays "
            f"({', '.join(_undecorated_arrays(model))}) are invisible to autostate and would "
            "be left out silently"
        )
        fix = f"decorate {type(model).__name__} with @autostate.stateful"
    elif type(model) in _graph.STACKS and rebuilds:
        # (Its f is read by state_dict, param_dict, summary; rebuilt, the
        # stack has no instance dict for the graph to fill.)
        what = "a bare stack"
        fix = (
            "hold the stack in a model (`self.blocks = autostate.stack([...])` in its "
            "__init__) and pass the model, or pass the stacked model, `stack.stacked`"
        )
    elif not _graph.is_stateful_instance(model) and type(model) not in _graph.STACKS:
        # (A list, an array, a number: f's structure is a model's graph, so
        # such an f ran eagerly and broke under jax.jit.)
        what = f"a value of type {type(model).__name__}"
        fix = (
            "pass one model; for several, hold them in a model of their own (a "
            "@stateful class whose __init__ keeps them as attributes, or a list attribute)"
        )
    if what is not None:
        raise InvalidTypeError(format_error(
            f"{caller} expects a model (an instance of a @stateful class), got {what}.",
            fix=fix + ".",
        ))
    if category_predicate is not None and not callable(category_predicate):
        raise InvalidTypeError(format_error(
            f"category_predicate must be a function of a category, got "
            f"{type(category_predicate).__name__} {category_predicate!r}.",
            fix=f"pass category={category_predicate!r} to select one category, or "
            "category_predicate=lambda c: ... to select several.",
        ))
    try:
        hash(category)
    except TypeError:
        raise InvalidTypeError(format_error(
            f"A category is a hashable value (a string), got {type(category).__name__} "
            f"{category!r}.",
            fix="pass one category (category='state'), or category_predicate=lambda c: "
            "c in (...) to select several.",
        )) from None


def _functionalize_method(
    self: M, category: Hashable | None = None, *,
    category_predicate: Callable[[Hashable], bool] | None = None, lazy: bool = False,
    state_sharing: StateSharing = "forbidden",
) -> tuple[FunctionalModel[M], Any]:
    """Returns ``(f, states)``: a pure function of the model's states.

    Args:
        category: handle only states of this category (``None``: all).
        category_predicate: alternatively, a predicate on categories.
        lazy: return a thunk computing the states instead of the dict.
        state_sharing: ``"forbidden"``, ``"allowed"`` or ``"unsafe"``.

    Returns:
        ``(f, states)``; ``f(states, *args)`` and ``f.<method>(states, *args)``
        return ``(out, new_states)``.

    Examples:
        >>> class Counter(autostate.Stateful):
        ...     def __init__(self):
        ...         self.count = jnp.zeros((), jnp.int32)
        ...
        ...     def __call__(self, x):
        ...         self.count += 1
        ...         return x * self.count
        >>> f, states = Counter().functionalize()
        >>> out, states = jax.jit(lambda f, s, x: f(s, x))(f, states, 3.0)
        >>> print(out, autostate.freeze(f, states).count)
        3.0 1
    """
    return functionalize_as(
        "functionalize()", self, category, category_predicate=category_predicate, lazy=lazy,
        state_sharing=state_sharing,
    )


def functionalize_as(
    caller: str, model: M, category: Hashable | None = None, *,
    category_predicate: Callable[[Hashable], bool] | None = None, lazy: bool = False,
    state_sharing: StateSharing = "forbidden", rebuilds: bool = True,
) -> tuple[FunctionalModel[M], Any]:
    """``functionalize`` as a step of ``caller`` (what the user called:
    ``autostate.save``), whose name its refusals give (``rebuilds=False``: its
    ``f`` is only read, as a reader of names and arrays does)."""
    self = model
    _check_functionalize_arguments(self, category, category_predicate, caller, rebuilds)
    if category is not None and category_predicate is not None:
        handle_local_states(self, category=category, category_predicate=category_predicate)
    if category is None and category_predicate is None:
        category_predicate = all_categories
    from autostate.hidden import check_no_hidden_arrays  # (above runtime: imported on first use)

    check_no_hidden_arrays(self, caller)
    handler_id = handler_id_for(category, category_predicate)
    selected = category_predicate or (lambda c: c == category)
    handler, initial = handle_local_states(
        _with_running_states_read(self),
        # Constants are never trained, so whatever is selected they go with the states.
        category_predicate=lambda c: c == CONSTANT or selected(c),
        lazy=lazy,
        state_sharing=state_sharing,
        handler_id=handler_id,
    )
    states: Any
    if callable(initial):
        refs = _graph.iter_tree(handler.body, lambda x: type(x) is HandledLocalStateRef)
        names = frozenset(ref.name for _, ref in refs if ref.handler_id == handler.handler_id)
        body, constants = extract_constants(handler.handler_id, handler.body, names)
        thunk = initial

        def states() -> dict[str, Any]:
            return states_dict({**thunk(), **constants})

    else:
        body, constants = extract_constants(handler.handler_id, handler.body, initial)
        states = states_dict({**initial, **constants}) if constants else initial
    return FunctionalModel(handler.handler_id, body), states


def _with_running_states_read(model: Any) -> Any:
    """``model``, or inside a running functionalized call a copy whose states that
    call handles hold their current values: the new ``f`` starts from them, and
    the running call's states are left alone."""
    def running(node: Any) -> bool:
        t = type(node)
        return (t is HandledLocalStateRef or t is HandledStaticState) and is_running(node.handler_id)

    def current(ref: Any, _name: str) -> Any:
        if type(ref) is HandledStaticState:  # a static state: its value is f's structure
            return ref.frozen()
        explicit = ref.name if ref.was_explicitly_named else None
        return FrozenLocalStateRequest(ref.read(), ref.category, explicit)

    if not handler_running() or next(_graph.iter_tree(model, running), None) is None:
        return model  # (outside every functionalized call: no walk)
    return _graph.map_tree(model, current, running)


def functionalize(
    model: M, category: Hashable | None = None, *,
    category_predicate: Callable[[Hashable], bool] | None = None, lazy: bool = False,
    state_sharing: StateSharing = "forbidden",
) -> tuple[FunctionalModel[M], dict[str, Any]]:
    """Function form of ``model.functionalize(...)``, typed for any model class.

    Args:
        model: a ``@stateful`` instance.
        category: handle only states of this category (``None``: all).
        category_predicate: alternatively, a predicate on categories.
        lazy: return a thunk computing the states instead of the dict.
        state_sharing: ``"forbidden"``, ``"allowed"`` or ``"unsafe"``.

    Returns:
        ``(f, states)``: ``f`` is a ``FunctionalModel[type(model)]``, so
        ``autostate.freeze(f, states)`` is typed as the model's class.

    Examples:
        >>> @autostate.stateful
        ... class Counter:
        ...     def __init__(self):
        ...         self.count = jnp.zeros((), jnp.int32)
        ...
        ...     def __call__(self):
        ...         self.count += 1
        ...         return self.count
        ...
        ...     def reset(self):
        ...         self.count = jnp.zeros((), jnp.int32)
        >>> f, states = autostate.functionalize(Counter())
        >>> out, states = f(states)
        >>> out, states = f(states)
        >>> print(out)
        2
        >>> _, states = f.reset(states)  # any other method: f.<method>(states, ...)
        >>> print(states["count"])
        0
    """
    return _functionalize_method(
        model, category, category_predicate=category_predicate, lazy=lazy, state_sharing=state_sharing
    )


class Stateful:
    """A base class: its subclasses are ``@stateful`` classes, typed as such.

    ``@autostate.stateful`` on a plain class does the same at run time, but
    a type checker cannot see the ``functionalize`` method it adds; with this
    base class mypy and pyright do. Decorate the subclass explicitly to pick
    a category or a fallback (``@autostate.stateful(category="cache")``).

    Examples:
        >>> class Counter(autostate.Stateful):
        ...     def __init__(self):
        ...         self.count = jnp.zeros(())
        ...
        ...     def __call__(self, x):
        ...         self.count += 1
        ...         return x * self.count
        >>> f, states = Counter().functionalize()  # f: FunctionalModel[Counter]
        >>> out, states = jax.jit(f)(states, 2.0)
        >>> print(out, states["count"])
        2.0 1.0
    """

    def __init_subclass__(cls, /, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if INFO_ATTR not in cls.__dict__:
            stateful(cls)

    if TYPE_CHECKING:

        def functionalize(
            self, category: Hashable | None = None, *,
            category_predicate: Callable[[Hashable], bool] | None = None, lazy: bool = False,
            state_sharing: StateSharing = "forbidden",
        ) -> tuple[FunctionalModel[Self], dict[str, Any]]: ...

        def train(self, mode: bool = True) -> Self: ...

        def eval(self) -> Self: ...


def _is_packed(value: Any) -> TypeGuard[PackedModel]:
    """Whether ``value`` is a ``PackedModel`` (``packing`` is imported by the
    first packed call: before it, nothing is one)."""
    from autostate.packing import PackedModel

    return isinstance(value, PackedModel)


@overload
def freeze(f: FunctionalModel[M], states: Mapping[str, Any]) -> M: ...
@overload
def freeze(f: PackedModel, states: Any) -> Any: ...
@overload
def freeze(f: WithFunctionalLocalState, states: Mapping[str, Any]) -> Any: ...


def freeze(f: Any, states: Mapping[str, Any]) -> Any:
    """Inverse of ``functionalize``: the model with ``states`` embedded.

    Args:
        f: a ``FunctionalModel`` (or an engine ``WithFunctionalLocalState``,
            or a ``PackedModel`` with its ``PackedStates``).
        states: the states dict to embed.

    Returns:
        The model (or body) holding ``FrozenLocalStateRequest``s; instances of
        ``fallback="host"`` classes get fresh host stores instead.

    Raises:
        InvalidTypeError: ``f`` is none of the above.
        StateDictError: ``states`` does not have ``f``'s keys.

    Examples:
        >>> @autostate.stateful
        ... class Counter:
        ...     def __init__(self):
        ...         self.count = jnp.zeros((), jnp.int32)
        ...
        ...     def __call__(self):
        ...         self.count += 1
        ...         return self.count
        >>> f, states = Counter().functionalize()
        >>> _, states = f(states)
        >>> counter = autostate.freeze(f, states)  # a Counter again, the new state inside
        >>> print(type(counter).__name__, counter.count)
        Counter 1
        >>> print(counter())
        2
    """
    if _is_packed(f):
        f, states = f.unpack(states)  # type: ignore[arg-type]
    if isinstance(f, FunctionalModel):
        check_state_keys(states, f.state_names(), "autostate.freeze")
        body = f.model
        if f._has_constants():
            body = embed_constants(f.handler_id, body, states)
        frozen = freeze_body(f.handler_id, body, dict(states))
    elif isinstance(f, WithFunctionalLocalState):
        frozen = freeze_local_states(f, dict(states))
    else:
        raise InvalidTypeError(format_error(
            f"freeze expects the f returned by functionalize(), got {type(f).__name__}.",
            fix="call `f, states = model.functionalize()` and pass both to freeze.",
        ))
    return frozen


def inference_mode(model: Any) -> Any:
    """A view of a host-fallback model whose state is read once, at the jit boundary.

    Each call reads the current value of every host state on the host while
    flattening the view and passes it into the program as an ordinary
    argument: the compiled program contains no callbacks. Setting a state of
    the view is an error. The original ``model`` is unchanged and keeps its
    store; the view follows later updates to it.

    Args:
        model: a model (or any pytree) holding ``fallback="host"`` state.

    Returns:
        A copy of ``model`` whose host states are read-only inputs.

    Examples:
        >>> @autostate.stateful(fallback="host")
        ... class Counter:
        ...     def __init__(self):
        ...         self.count = jnp.zeros((), jnp.int32)
        ...
        ...     def __call__(self, x):
        ...         self.count += 1
        ...         return x * self.count
        ...
        ...     def scale(self, x):  # reads the state only
        ...         return x * self.count
        >>> counter = Counter()
        >>> print(jax.jit(counter)(2.0), counter.count)
        2.0 1
        >>> frozen = autostate.inference_mode(counter)
        >>> print(jax.jit(lambda m, x: m.scale(x))(frozen, 3.0))
        3.0
    """
    from autostate import host  # only a host-fallback model needs the host engine

    return host.inference_mode(model)
