"""``FunctionalModel``: the pure ``f`` that ``functionalize()`` returns.

This module owns what ``f`` is: a pytree whose leaves are the model's
parameters (flattened once as a graph, so tied weights stay one leaf), its
calling convention ``f(states, *args) -> (out, new_states)`` and
``f.<method>(...)`` (bind the states, call, guard, unbind: the guard, that a
call changed nothing outside its states, is ``guard``'s), and the handler
ids that make functionalizing a frozen model again give an equal ``f``. It
knows nothing of source code or of how a class is decorated.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import io
import pickle
from collections.abc import Callable, Hashable, Mapping
from typing import Any, Generic, ParamSpec, TypeVar

import jax
import jax.export
import numpy as np

from autostate import graph as _graph
from autostate import values as _values
from autostate.effects.local_state import (
    HandledLocalStateRef,
    HandlerId,
    StateSlot,
    run_with_states,
)
from autostate.errors import (
    InvalidTypeError,
    MethodNotFoundError,
    StateDictError,
    StateSharingError,
    UnhandledLocalStateError,
    format_error,
)
from autostate.guard import Guard
from autostate.lifetime import contains_tracer

_ABSENT: Any = object()

CONSTANT = "constant"
"""The category of non-trainable arrays: ``autostate.constant(...)`` and every
integer, bool or PRNG-key array a model holds outside its states."""


def is_trainable(leaf: Any) -> bool:
    """Whether an array leaf is trained: floating point (or complex), not a PRNG key."""
    dtype = getattr(leaf, "dtype", None)
    if dtype is None:
        return False
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return False
    return bool(jax.numpy.issubdtype(dtype, jax.numpy.inexact))  # bfloat16 and float8 too


@dataclasses.dataclass(frozen=True)
class ConstantRef:
    """Stands in ``f.model`` for a non-trainable array that is no state (a
    position table, a mask, a fixed key): it travels in the states dict under
    its path, so ``jax.grad`` and optax see only what is trained."""

    handler_id: Hashable
    name: str


jax.tree_util.register_pytree_node(
    ConstantRef, lambda r: ((), (r.handler_id, r.name)), lambda aux, _c: ConstantRef(*aux)
)
_graph.register_node_kind(ConstantRef, model_child=True)


def extract_constants(handler_id: Hashable, body: Any, taken: Any) -> tuple[Any, dict[str, Any]]:
    """``body`` with its non-trainable, non-state arrays replaced by
    ``ConstantRef``s, and ``{path: array}`` (``taken``: the states' names)."""

    def is_target(node: Any) -> bool:
        return isinstance(node, StateSlot) or (
            _values.is_array_or_spec(node) and not is_trainable(node)
        )

    found = [
        name for name, node in _graph.iter_tree(body, is_target) if not isinstance(node, StateSlot)
    ]
    if not found:
        return body, {}
    constants: dict[str, Any] = {}

    def replace(node: Any, name: str) -> Any:
        if isinstance(node, StateSlot):
            return node
        if name in taken or name in constants:
            raise StateSharingError(
                format_error(
                    f"The array at {name!r} is not trainable (dtype {node.dtype}), so it goes "
                    "into the states dict under its path, but a state already has that name.",
                    fix="give the state another explicit name (autostate.state(..., name=...)).",
                )
            )
        constants[name] = node
        return ConstantRef(handler_id, name)

    return _graph.map_tree(body, replace, is_target), constants


def embed_constants(handler_id: Hashable, body: Any, states: Mapping[str, Any]) -> Any:
    """``body`` with ``handler_id``'s ``ConstantRef``s replaced by their values."""

    def is_target(node: Any) -> bool:
        return type(node) is ConstantRef and node.handler_id == handler_id

    def replace(ref: ConstantRef, _name: str) -> Any:
        try:
            return states[ref.name]
        except KeyError:
            raise UnhandledLocalStateError(
                format_error(
                    f"Constant {ref.name!r} is missing from the states dict "
                    f"(it has {sorted(states)}).",
                    fix="pass the states dict returned by functionalize/the last call.",
                )
            ) from None

    return _graph.map_tree(body, replace, is_target)


def check_state_keys(
    given: Mapping[str, Any], expected: frozenset[str] | set[str], caller: str
) -> None:
    """Unknown keys in a states dict are an error naming them (and the nearest
    name); anything but a dict is an error too."""
    if not isinstance(given, Mapping):
        raise InvalidTypeError(
            format_error(
                f"States must be a dict of name -> value, got {type(given).__name__}.",
                fix="pass the dict returned by handle_local_states/functionalize.",
            )
        )
    unknown = [k for k in given if k not in expected]
    if not unknown:
        return
    hints = []
    for key in unknown[:5]:
        close = difflib.get_close_matches(str(key), sorted(map(str, expected)), n=1)
        hints.append(f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key))
    raise StateDictError(
        format_error(
            f"{caller}: the states dict has keys the model has no state for: "
            f"{', '.join(hints)}{' ...' if len(unknown) > 5 else ''}.",
            fix="pass the states dict that functionalize() (or the previous call) returned, "
            f"with the same keys; the model's states are {sorted(expected)}.",
        )
    )


# Covariant: a FunctionalModel[Net] is one of its __call__ type too (the
# self-type of ``__call__`` below draws its signature from there).
M = TypeVar("M", covariant=True)
P = ParamSpec("P")
R = TypeVar("R")


class FunctionalModel(Generic[M]):
    """A functionalized model: ``f(states, *args)`` returns ``(out, new_states)``.

    ``f.<method>(states, *args, **kwargs)`` calls any other method the same
    way. It is a pytree whose leaves are the model's parameters, so it can be
    passed into ``jax.jit``, differentiated with ``jax.grad`` and updated
    with ``jax.tree_util.tree_map`` or optax. Its keypaths follow the model,
    one key per level under ``.model`` (``.model.blocks[0].w``), so path-based
    optax masks, ``flax.traverse_util`` and orbax see the model's names.

    ``f`` is immutable: make a new one with ``tree_map`` rather than
    assigning into ``f.model``. That is what lets it flatten once and reuse
    the result on every call of a jitted step (per-call dispatch then costs
    what a dict of arrays costs), and what keeps tied weights (one instance
    on two paths) one leaf, under its first path.

    Examples:
        >>> @autostate.stateful
        ... class Scale:
        ...     def __init__(self):
        ...         self.w = 2 * jnp.ones(2)  # a parameter: a leaf of f
        ...         self.calls = jnp.zeros((), jnp.int32)  # a state
        ...
        ...     def __call__(self, x):
        ...         self.calls += 1
        ...         return self.w * x
        >>> f, states = Scale().functionalize()
        >>> out, states = jax.jit(f)(states, jnp.ones(2))  # f itself is jit-able
        >>> print(out, states["calls"])
        [2. 2.] 1
        >>> [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(f)]
        ['.model.w']
        >>> grads = jax.grad(lambda f: f(states, jnp.ones(2))[0].sum())(f)
        >>> f = jax.tree_util.tree_map(lambda p, g: p - 0.5 * g, f, grads)  # a new f
        >>> print(f.model.w)
        [1.5 1.5]
    """

    __slots__ = (
        "handler_id", "_model", "_flat", "_children", "_guard_ids", "_instances", "__weakref__"
    )

    def __init__(
        self,
        handler_id: Hashable,
        model: Any = None,
        flat: tuple | None = None,
        children: Any = None,
    ):
        self.handler_id = handler_id
        self._model = model
        self._flat = flat  # (leaves in graph order, graphdef), computed on first flatten
        self._children = children  # (keyed view of the leaves, graphdef)
        self._guard_ids: frozenset[int] | None = None  # ids of the model's instances
        self._instances: list[Any] | None = None  # and the instances themselves

    @property
    def model(self) -> M:
        """The handled model (its states are ``HandledLocalStateRef``s)."""
        if self._model is None:
            leaves, graphdef = self._flattened()
            instances = _graph.rebuild_instances(graphdef, leaves)
            self._model = instances[graphdef.root]
            # The ids the call's guard needs, without walking the new graph
            # again (a walk of every instance on every trace).
            self._instances = instances
            self._guard_ids = frozenset(map(id, instances))
        return self._model

    def _flattened(self) -> tuple:
        if self._flat is None:
            if self._children is not None:
                view, graphdef = self._children
                self._flat = (_leaves_in_graph_order(graphdef, view), graphdef)
            else:
                self._flat = _graph.flatten_graph(self._model)
        return self._flat

    def _keyed(self) -> tuple:
        if self._children is None:
            leaves, graphdef = self._flattened()
            self._children = (_keyed_view(graphdef, leaves), graphdef)
        return self._children

    def __call__(
        self: FunctionalModel[Callable[P, R]],
        states: dict[str, Any],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> tuple[R, dict[str, Any]]:
        return self._run(states, None, args, kwargs)

    def state_names(self) -> frozenset[str]:
        """The keys the states dict of this ``f`` has (its states and constants).

        Examples:
            >>> @autostate.stateful
            ... class Norm:
            ...     def __init__(self):
            ...         self.mean = jnp.zeros(2)
            ...         self.table = autostate.constant(jnp.ones(2))
            ...
            ...     def __call__(self, x):
            ...         self.mean = 0.9 * self.mean + 0.1 * x
            ...         return x - self.mean + self.table
            >>> f, states = Norm().functionalize()
            >>> sorted(f.state_names())
            ['mean', 'table']
        """
        graphdef = self._flattened()[1]
        names = graphdef.cache.get("state_names")
        if names is None:
            names = graphdef.cache["state_names"] = frozenset(
                node.name
                for _, node in _graph.iter_tree(self.model, self._is_own_ref)
            )
        return names

    def _is_own_ref(self, node: Any) -> bool:
        t = type(node)
        return (t is HandledLocalStateRef or t is ConstantRef) and node.handler_id == self.handler_id

    def _has_constants(self) -> bool:
        graphdef = self._flattened()[1]
        has = graphdef.cache.get("has_constants")
        if has is None:
            has = graphdef.cache["has_constants"] = any(
                type(node) is ConstantRef
                for _, node in _graph.iter_tree(self.model, self._is_own_ref)
            )
        return has

    def _run(
        self, states: dict[str, Any], method: str | Callable[..., Any] | None, args: tuple,
        kwargs: dict,
    ) -> tuple[Any, dict[str, Any]]:
        """Calls ``method`` of the model (``__call__`` for None; a function:
        ``method(model, *args)``) with ``states``: bind (check the keys, put the
        constants into a copy: ``_bind``), guard (``_guard``), call with the states
        bound to this handler, check (no escaped tracer, nothing else changed:
        ``guard.Guard``), unbind (``(out, new_states)``; the cached flatten is
        dropped, as states of unhandled categories may have changed)."""
        model = self._bind(states)
        if method is None:
            fn = model
        elif isinstance(method, str):
            fn = getattr(model, method)
        else:
            fn = functools.partial(method, model)
        guard = self._guard(model, states, args, kwargs)
        try:
            with guard:
                result = run_with_states(self.handler_id, states, fn, args, kwargs, guard.ids)
                guard.returned(result[1])
        finally:
            self._flat = None
            self._children = None
        return result

    def _bind(self, states: dict[str, Any]) -> Any:
        """The model to call with ``states``: ``f``'s own, or a copy holding the constants."""
        check_state_keys(states, self.state_names(), "f(states, ...)")
        model = self.model
        if self._has_constants():
            model = embed_constants(self.handler_id, model, states)
        return model

    def _guard(self, model: Any, states: dict[str, Any], args: tuple, kwargs: dict) -> Guard:
        """The guard of one call on ``model``: traced when anything the call sees
        is (the states, the arguments, or ``f``'s own leaves: ``f`` passed into
        ``jax.jit``), a model with no states too."""
        flat = self._flat
        traced = (
            contains_tracer(states)
            or (flat is not None and any(isinstance(x, jax.core.Tracer) for x in flat[0]))
            or contains_tracer((args, kwargs))
        )
        own = model is self._model
        graph = None
        if traced:
            # Under jit the model was rebuilt from ``_flat``, so that is the
            # flatten before the call; flattening again (with path names)
            # cost a tenth of the trace at 1,000 modules.
            graph = flat if flat is not None and own else _graph.flatten_graph(model)
        instances, ids = self._instances, self._guard_ids
        if instances is None or not own:
            # The instance graph cannot change inside a call (the guard refuses
            # it), so its instances are collected once per model (per call when
            # constants were embedded into a copy).
            instances = _graph.instances_of(model)
            ids = frozenset(map(id, instances))
            if own:
                self._instances, self._guard_ids = instances, ids
        # (A call on a copy, the constants embedded, keeps nothing it changes
        # in place either: refused as under a trace.)
        return Guard.for_call(
            model, instances, ids,  # type: ignore[arg-type]
            traced=traced, on_copy=not own, graph=graph, states=states,
        )

    def __getattr__(self, name: str) -> Any:
        # (``Any``: a method called through f, or a parameter, sub-model or
        # config read like the model's, as on a gradient shaped like f:
        # ``grads.norm.scale``. The mypy plugin types each from the model.)
        if name in FunctionalModel.__slots__ or name == "model":
            # A slot not set yet (unpickling), or the model property failing:
            # its own error, not this lookup again.
            raise AttributeError(name)
        if name.startswith("__") and name.endswith("__"):
            # A protocol lookup (``__array__``, ``__len__``...) finds only a
            # special method the model's class itself defines
            # (``f.__setitem__(states, i, v)``), never one autostate installs.
            if name in _NOT_CALLED_THROUGH_F or not _user_defines(type(self.model), name):
                raise AttributeError(name)
        model = self.model
        method = getattr(type(model), name, None)
        held = model.__dict__.get(name, _ABSENT)
        if method is None and held is not _ABSENT and not isinstance(held, StateSlot) and (
            _graph.is_model_child(held) or not callable(held)
        ):
            # A parameter, a sub-model or static config: read as the model's
            # (``grads.norm.scale`` on a gradient shaped like f).
            return held
        if method is None:
            # A callable the instance holds (``model.forward = types.MethodType(fn,
            # model)``, PyTorch's way of replacing one model's method): called as
            # plain Python calls ``model.forward(...)``, on f's copy.
            if (
                callable(held)
                and not isinstance(held, (StateSlot, type))
                and not _graph.is_model_child(held)  # a sub-model (a stack) is no method
            ):
                method = held
        if name.startswith("_") and (method is None or not callable(method)):
            # A private name the class has no method for (``_repr_html_``
            # probed by a notebook): not found, as plain attribute lookup says.
            raise AttributeError(name)
        if method is None or not callable(method):
            raise MethodNotFoundError(
                format_error(
                    f"{type(model).__name__} has no method {name!r} to call functionally.",
                    fix="call f.<method>(states, ...) with a method the class defines.",
                )
            )

        def call(states: dict[str, Any], /, *args: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
            return self._run(states, name, args, kwargs)

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

    def __hash__(self) -> int:
        # Equal fs have one structure, so hashing the structure keeps the
        # contract; ``jax.jit(f)`` needs f hashable (and weak-referenceable).
        return hash((self.handler_id, self._flattened()[1]))


# Special methods f never calls for the model: construction, copying and
# attribute access are f's own (or autostate's), not a call with states.
_NOT_CALLED_THROUGH_F = frozenset({
    "__init__", "__new__", "__init_subclass__", "__class_getitem__", "__copy__",
    "__deepcopy__", "__reduce__", "__reduce_ex__", "__getstate__", "__setstate__",
    "__getattr__", "__getattribute__", "__setattr__", "__delattr__", "__dir__",
    "__repr__", "__str__", "__format__", "__hash__", "__eq__", "__ne__", "__sizeof__",
    "__subclasshook__", "__set_name__", "__get__", "__set__", "__delete__",
    "__post_init__", "__treescope_repr__", "__rich_repr__",
})


def _user_defines(cls: type, name: str) -> bool:
    """Whether a class of ``cls``'s MRO, other than ``object``, defines function ``name``."""
    for klass in cls.__mro__[:-1]:
        value = klass.__dict__.get(name)
        if value is not None:
            return callable(value) and not isinstance(value, (type, staticmethod, classmethod))
    return False


def _trees_equal(a: Any, b: Any) -> bool:
    leaves_a, def_a = jax.tree_util.tree_flatten(a)
    leaves_b, def_b = jax.tree_util.tree_flatten(b)
    if def_a != def_b:  # type: ignore[operator]
        return False
    # A traced leaf has no value to compare (JAX's caches compare a traced f
    # with a concrete one of the same structure): equal only to itself.
    return all(
        x is y
        or not (isinstance(x, jax.core.Tracer) or isinstance(y, jax.core.Tracer))
        and np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(leaves_a, leaves_b)
    )


# --- the keyed view: one pytree level per model level --------------------------

class Fields:
    """One attribute level of ``f``'s keyed view: a class per set of names,
    registered as a JAX dataclass node so flattening ``f`` runs in JAX's C++."""

    _fields: tuple[str, ...] = ()

    def __init__(self, **children: Any):
        self.__dict__.update(children)

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={getattr(self, k)!r}" for k in self._fields)
        return f"Fields({inner})"

    def __reduce__(self) -> tuple:
        # The class is made at run time (one per set of names), so a pickle
        # names the function that makes it again.
        return _fields_of, (self._fields, tuple(getattr(self, k) for k in self._fields))


def _fields_of(names: tuple[str, ...], values: tuple) -> Fields:
    """A ``Fields`` node with ``names`` holding ``values`` (the unpickler's)."""
    return fields_class(names)(**dict(zip(names, values)))


_FIELDS_CLASSES: dict[tuple[str, ...], type] = {}


def fields_class(names: tuple[str, ...]) -> type:
    """The ``Fields`` node class for one tuple of attribute names (made once)."""
    cls = _FIELDS_CLASSES.get(names)
    if cls is None:
        cls = type("Fields", (Fields,), {"_fields": names, "__module__": __name__})
        jax.tree_util.register_dataclass(cls, data_fields=list(names), meta_fields=[])
        jax.export.register_pytree_node_serialization(
            cls,
            serialized_name=f"autostate.Fields{list(names)!r}",
            serialize_auxdata=lambda _aux: b"",
            deserialize_auxdata=lambda _data: (),
        )
        _FIELDS_CLASSES[names] = cls
    return cls


class _Keyed:
    """A level whose keys are of no kind JAX builds natively (a foreign node's
    keys), or dict keys that do not sort."""

    __slots__ = ("keys", "children")

    def __init__(self, keys: tuple, children: list):
        self.keys = keys
        self.children = children


jax.tree_util.register_pytree_with_keys(
    _Keyed,
    lambda n: (list(zip(n.keys, n.children)), n.keys),
    lambda keys, children: _Keyed(keys, list(children)),
    lambda n: (n.children, n.keys),
)


class _Index:
    """Stands for leaf ``i`` (in graph order) while a view's layout is computed."""

    __slots__ = ("i",)

    def __init__(self, i: int):
        self.i = i


def _build_level(trie: dict) -> Any:
    keys = list(trie)
    children = [v if isinstance(v, _Index) else _build_level(v) for v in trie.values()]
    kinds = {type(k) for k in keys}
    if kinds == {jax.tree_util.GetAttrKey}:
        names = tuple(k.name for k in keys)
        return fields_class(names)(**dict(zip(names, children)))
    if kinds == {jax.tree_util.SequenceKey}:
        by_index = {k.idx: c for k, c in zip(keys, children)}
        # Holes (an element without leaves) stay holes, so indices stay the model's.
        return tuple(by_index.get(i) for i in range(max(by_index) + 1))
    if kinds == {jax.tree_util.DictKey} and _sortable(k.key for k in keys):
        return {k.key: c for k, c in zip(keys, children)}
    # (Also a dict whose keys do not sort, `{1: a, (2, 'x'): b}`: JAX's dict
    # sorts them; this level keeps them, under the same keys.)
    return _Keyed(tuple(keys), children)


def _sortable(keys: Any) -> bool:
    try:
        sorted(keys)
    except TypeError:
        return False
    return True


def _view_layout(graphdef: _graph.GraphDef) -> tuple:
    """``(treedef of the keyed view, graph index of each of its leaves)``, once per graphdef."""
    layout = graphdef.cache.get("keyed")
    if layout is None:
        trie: dict = {}
        for i, path in enumerate(graphdef.keys):
            node = trie
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = _Index(i)
        view = _build_level(trie) if trie else None
        marks, view_def = jax.tree_util.tree_flatten(view, is_leaf=lambda x: isinstance(x, _Index))
        layout = graphdef.cache["keyed"] = (view_def, tuple(m.i for m in marks))
    return layout


def _keyed_view(graphdef: _graph.GraphDef, leaves: list[Any]) -> Any:
    view_def, order = _view_layout(graphdef)
    return view_def.unflatten([leaves[i] for i in order])


def _leaves_in_graph_order(graphdef: _graph.GraphDef, view: Any) -> list[Any]:
    view_def, order = _view_layout(graphdef)
    in_view = view_def.flatten_up_to(view)
    leaves: list[Any] = [None] * len(order)
    for i, leaf in zip(order, in_view):
        leaves[i] = leaf
    return leaves


def _flatten_functional(f: FunctionalModel):
    view, graphdef = f._keyed()
    return (view,), (f.handler_id, graphdef)


def _flatten_functional_with_keys(f: FunctionalModel):
    view, graphdef = f._keyed()
    return ((jax.tree_util.GetAttrKey("model"), view),), (f.handler_id, graphdef)


def _unflatten_functional(aux: tuple, children) -> FunctionalModel:
    handler_id, graphdef = aux
    (view,) = children
    return FunctionalModel(handler_id, None, None, (view, graphdef))


jax.tree_util.register_pytree_with_keys(
    FunctionalModel, _flatten_functional_with_keys, _unflatten_functional, _flatten_functional
)
def _functional_from_leaves(aux: tuple, leaves: list[Any]) -> FunctionalModel:
    """An ``f`` from its leaves in its flatten's order: its keyed view is made
    when it is flattened (a compiled call writing an optimizer's moments back
    makes none of the view's nodes)."""
    handler_id, graphdef = aux
    inverse = graphdef.cache.get("keyed_inverse")
    if inverse is None:
        _, order = _view_layout(graphdef)
        at = {i: k for k, i in enumerate(order)}
        inverse = graphdef.cache["keyed_inverse"] = tuple(at[i] for i in range(len(order)))
    return FunctionalModel(handler_id, None, (list(map(leaves.__getitem__, inverse)), graphdef))


# Never changed in place (a new f is a new object): an optimizer's moments
# held as an f are witnessed by identity (``autostate.jit``'s kept flatten).
_graph.register_node_kind(
    FunctionalModel, model_child=True, immutable=True, from_leaves=_functional_from_leaves
)


def _by_name(obj: Any) -> tuple[str, str] | None:
    """``(module, qualname)`` of a function-like object importable under that name."""
    if isinstance(obj, type) or not callable(obj):
        return None
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname:
        return None
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return None
    return (module, qualname) if found is obj else None


class _AuxPickler(pickle.Pickler):
    # Functions in a model's static attributes (``jax.nn.relu``, a custom_jvp
    # object) are written by name: pickling them by value fails or is wrong.
    def persistent_id(self, obj: Any) -> Any:
        return _by_name(obj)


class _AuxUnpickler(pickle.Unpickler):
    def persistent_load(self, pid: Any) -> Any:
        module, qualname = pid
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
        return found


def _serialize_aux(aux: tuple) -> bytes:
    buffer = io.BytesIO()
    try:
        _AuxPickler(buffer).dump(aux)
    except Exception as exc:
        raise InvalidTypeError(
            format_error(
                f"Cannot serialize f's structure for jax.export: {exc}.",
                fix="keep static attributes of the model picklable or importable by name "
                "(module-level functions and classes, not lambdas or local functions).",
            )
        ) from exc
    return buffer.getvalue()


jax.export.register_pytree_node_serialization(
    FunctionalModel,
    serialized_name="autostate.FunctionalModel",
    serialize_auxdata=_serialize_aux,
    deserialize_auxdata=lambda data: _AuxUnpickler(io.BytesIO(data)).load(),
)


def all_categories(_category: Hashable) -> bool:
    return True


def handler_id_for(
    category: Hashable | None, category_predicate: Callable[[Hashable], bool] | None
) -> Hashable | None:
    """A handler id that depends only on which states are handled: functionalizing
    a frozen model again gives an equal ``f`` (no recompilation), while nested
    categories still differ. A custom predicate gets a fresh id."""
    if category_predicate is all_categories:
        return HandlerId("autostate:*")
    if category_predicate is None:
        return HandlerId(f"autostate:{category!r}")
    return None


def instance_pairs(model: Any, f: FunctionalModel) -> list[tuple[Any, Any]]:
    """Each instance of ``model`` with its twin in ``f``'s model (the same walk)."""
    return list(zip(_graph.instances_of(model), _graph.instances_of(f.model)))
