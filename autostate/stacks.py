"""Stacks of identical layers: ``autostate.stack`` and the ``Stack`` a model holds.

A stack is one model whose arrays carry a leading layer axis (what
``jax.vmap(Layer)(keys)`` builds), held as a sequence of its layers. Its
states and parameters are named as the stacked model's (``blocks.w``:
``graph.passing_key``); ``state_dict(..., per_layer=True)`` writes them per
layer. A layer (``stack[i]``, ``for layer in stack``) is a *view*: an
instance of the layer class whose states are ``LayerSlot``s, reading and
writing its slice of the stacked state through the stacked model's own
slot, so it means the same in every mode; assigning a layer's attribute
that is not state is refused (``guard.register_view``). Mapped over
(``lax.scan``'s ``xs``, ``jax.vmap``) a stack is its stacked model, and a
``for`` loop over it rolls into one scan (``lifting.loops``).

Everything the walks, the transformations and rolling know of a stack is one
record, its node kind (``graph.NodeKind``), registered here once; a layer's
state slot is another. This module knows the runtime's one write path and
the guard."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any, cast

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from autostate import graph as _graph
from autostate import guard as _guard
from autostate import lifetime as _lifetime
from autostate import runtime as _runtime
from autostate import sharding as _sharding
from autostate import tree as _tree
from autostate import values as _values
from autostate.effects.local_state import (
    FrozenLocalStateRequest,
    InitialLocalStateRequest,
    StateSlot,
)
from autostate.errors import (
    InvalidTypeError,
    StackError,
    StateAccessError,
    TracedEagerStateError,
    format_error,
    traced_value_error,
    user_location,
)
from autostate.state_values import StaticState, is_static_value, same_static

__all__ = ["LayerSlot", "Stack", "is_stack", "stack", "stacks_in"]


class Stack:
    """A sequence of layers held as one stacked model (``autostate.stack`` builds one).

    ``len(stack)`` is the number of layers, ``stack[i]`` (and ``for layer in
    stack``) one layer: an instance of the layer class that reads and writes
    its slice of the stacked states, as the i-th layer of a list would
    (a new view object on each access). ``stack.stacked`` is the stacked
    model itself, every array with the leading layer axis, and
    ``stack.<attribute>`` reads the stacked model's attributes (not its
    methods: those are called on a layer). A stack is a pytree; its states
    and parameters are named as the stacked model's (``blocks.w``, which
    ``model.blocks.w`` reads).

    Examples:
        >>> @autostate.stateful
        ... class Block:
        ...     def __init__(self, key):
        ...         self.w = jax.random.normal(key, (3,))
        ...         self.calls = jnp.zeros((), jnp.int32)
        ...
        ...     def __call__(self, x):
        ...         self.calls += 1
        ...         return jnp.tanh(x * self.w)
        >>> blocks = autostate.stack([Block(k) for k in jax.random.split(jax.random.key(0), 4)])
        >>> len(blocks), blocks.stacked.w.shape
        (4, (4, 3))
        >>> x = jnp.ones(3)
        >>> for block in blocks:
        ...     x = block(x)
        >>> print(blocks.calls, blocks[-1].calls)
        [1 1 1 1] 1
    """

    __slots__ = ("_stacked", "_depth", "_require_scan", "__weakref__")

    def __init__(self, stacked: Any, depth: int, require_scan: bool = False):
        self._stacked = stacked
        self._depth = depth
        self._require_scan = require_scan

    @property
    def stacked(self) -> Any:
        """The stacked model: one instance of the layer class, every array with the layer axis."""
        return self._stacked

    @property
    def depth(self) -> int:
        """The number of layers (``len(stack)``)."""
        return self._depth

    @property
    def require_scan(self) -> bool:
        """Whether a loop over the stack that cannot be rolled into one scan is an error."""
        return self._require_scan

    def __getattr__(self, name: str) -> Any:
        # The stacked model's attributes (its parameters, states, sub-models),
        # so that a state's name reads as a path: ``model.blocks.attention.k``.
        # Its methods are the layers': call them on a layer.
        stacked = self._stacked if not name.startswith("_") else None
        if stacked is not None and name in getattr(stacked, "__dict__", ()):
            return getattr(stacked, name)
        raise AttributeError(
            f"'Stack' object has no attribute {name!r}: a stack reads the attributes its "
            "stacked model holds (with the layer axis); call methods on a layer "
            "(`stack[0]`, `for layer in stack`)"
        )

    def train(self, mode: bool = True) -> Stack:
        """Sets ``training`` to ``mode`` on every layer, as a module list's
        ``train`` does (the stacked model's ``train``, or its class's own);
        returns the stack. A single layer (a view) cannot change mode alone:
        the layers share the stacked model's static config."""
        self._stacked.train(mode)
        return self

    def eval(self) -> Stack:
        """Evaluation mode on every layer: ``train(False)``; returns the stack."""
        return self.train(False)

    def __len__(self) -> int:
        return self._depth

    def __iter__(self) -> Iterator[Any]:
        return map(self._layer, range(self._depth))

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [self._layer(i) for i in range(self._depth)[index]]
        if isinstance(index, jax.core.Tracer):
            # (Also JAX's error for int() of a tracer, as every TracedValueError is.)
            jax_error = Exception.__new__(jax.errors.ConcretizationTypeError)
            raise traced_value_error(
                jax_error,
                format_error(
                    f"A layer of a stack of {self._depth} is chosen by a traced index: a "
                    "layer is a view whose position must be a Python int, and under a trace "
                    "the index is a value of the compiled program.",
                    where=user_location(),
                    fix="choose the layer inside the program: `jax.lax.switch(i, "
                    "[self.layers[k] for k in range(len(self.layers))], x)` runs layer i "
                    "(its state writes land), or index the stacked arrays directly "
                    "(`self.layers.w[i]`) to read one layer's parameter.",
                ),
            ) from None
        i = int(index)
        if not -self._depth <= i < self._depth:
            raise IndexError(f"stack index {index} out of range for a stack of {self._depth} layers")
        return self._layer(i % self._depth)

    def _layer(self, i: int) -> Any:
        return _view(self._stacked, i, self._depth, {}, "")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise InvalidTypeError(format_error(
            "A Stack is a sequence of layers, not a layer: it cannot be called.",
            fix="call its layers (`for layer in stack: x = layer(x)`); a stack sliced "
            "by jax.lax.scan or jax.vmap outside a @stateful method gives each step a "
            "Stack: call autostate.scan / autostate.vmap there (each step then gets one "
            "layer), or map over `stack.stacked`.",
        ))

    def __repr__(self) -> str:
        inner = repr(self._stacked)
        strict = ", require_scan=True" if self._require_scan else ""
        line = f"Stack(depth={self._depth}{strict}, stacked={inner})"
        if len(line) <= 80 and "\n" not in line:
            return line
        inner = inner.replace("\n", "\n  ")
        strict = "\n  require_scan=True," if self._require_scan else ""
        return f"Stack(\n  depth={self._depth},{strict}\n  stacked={inner},\n)"

    def __reduce__(self) -> tuple:
        return (Stack, (self._stacked, self._depth, self._require_scan))


def is_stack(value: Any) -> bool:
    """Whether ``value`` is a ``Stack``."""
    return type(value) is Stack


_STACKED_KEY = _graph.passing_key("stacked")


def _stack_with_keys(s: Stack) -> tuple[list[tuple[Any, Any]], tuple[int, bool]]:
    return [(_STACKED_KEY, s._stacked)], (s._depth, s._require_scan)


jax.tree_util.register_pytree_with_keys(
    Stack,
    _stack_with_keys,
    lambda aux, children: Stack(next(iter(children)), *aux),
    lambda s: ([s._stacked], (s._depth, s._require_scan)),
)
_graph.register_node_kind(
    Stack,
    children=lambda s: [("", s._stacked)],
    rebuild=lambda s, children: Stack(children[0], s._depth, s._require_scan),
    model_child=True,
    # A stack never changes what it wraps; the stacked model is witnessed as an
    # instance of its own (``autostate.jit``'s kept flatten).
    immutable=True,
    stacked=lambda s: s._stacked,
    must_roll=lambda s: s._require_scan,
)


def stacks_in(tree: Any) -> dict[str, int]:
    """The stacks of a model, by path (``blocks``) -> depth, outermost first.

    A stack inside a stacked model's layers is listed under its path in the
    stacked model (``blocks.heads``): its arrays carry both layer axes.

    Example:
        >>> from autostate import stacks
        >>> @autostate.stateful
        ... class Net:
        ...     def __init__(self):
        ...         self.blocks = autostate.stack(jax.vmap(Leaf)(jnp.arange(3.0)))
        >>> @autostate.stateful
        ... class Leaf:
        ...     def __init__(self, v):
        ...         self.w = v * jnp.ones(2)
        >>> stacks.stacks_in(Net())
        {'blocks': 3}
    """
    return {name: s._depth for name, s in _graph.iter_tree(tree, is_stack, into_targets=True)}


# --- building a stack ---------------------------------------------------------------


def stack(
    layers: Iterable[Any] | Any, *, require_scan: bool = False, layer_axis: str | None = None
) -> Stack:
    """One stack of layers: a model whose arrays carry a leading layer axis.

    From a list of layers of one class and one structure, their parameters and
    states are stacked along a new leading axis into one model of that class
    (the layers given are copied, not kept); from a model stacked already
    (``jax.vmap(Layer)(keys)``), the stack holds it. Iterating it, ``stack[i]``
    and ``len`` mean what they mean for the list of layers in every mode, and a
    ``for`` loop over it in a ``@stateful`` method under a JAX trace is rolled
    into one ``lax.scan`` (``docs/scaling_depth.md``).

    Args:
        layers: a list (or any iterable) of ``@stateful`` instances of one
            class, or one ``@stateful`` instance stacked already.
        require_scan: make a loop over the stack that cannot be rolled a
            ``StackError`` naming the reason and the loop's line, rather
            than a loop that runs layer by layer.
        layer_axis: the mesh axis (or logical axis name, which ``rules``
            map) the layer axis is split over; ``None``, the default, keeps
            every layer on every device that holds its shard. The layers'
            sharding annotations (``autostate.sharded``, ``state(...,
            sharding=)``) gain this entry in front, for the layer axis.

    Returns:
        The ``Stack``.

    Raises:
        StackError: no layers; layers that differ in class, static
            configuration or array shapes (the first difference is named);
            layers that share a sub-model or a parameter array; a stacked
            model whose arrays disagree on the leading axis.
        InvalidTypeError: a layer that is not a ``@stateful`` instance, or
            one whose states are not eager (a ``fallback="host"`` model, a
            model of a running ``functionalize`` call).

    Examples:
        >>> @autostate.stateful
        ... class Norm:
        ...     def __init__(self, n):
        ...         self.scale = jnp.ones(n)
        ...         self.mean = jnp.zeros(n)
        ...
        ...     def __call__(self, x):
        ...         self.mean = 0.9 * self.mean + 0.1 * x
        ...         return (x - self.mean) * self.scale
        >>> norms = autostate.stack([Norm(3) for _ in range(2)])
        >>> print(len(norms), norms.stacked.mean.shape)
        2 (2, 3)
        >>> autostate.stack([Norm(3), Norm(4)])
        Traceback (most recent call last):
        ...
        autostate.errors.StackError: Layer 1 differs from layer 0 at scale: f32[4] against f32[3]...
    """
    if isinstance(layers, Stack):
        if layers._require_scan == require_scan:
            return layers
        return Stack(layers._stacked, layers._depth, require_scan)
    if _graph.is_stateful_instance(layers):
        _check_eager(layers, 0)
        return Stack(_with_layer_axis(layers, layer_axis), _stacked_depth(layers), require_scan)
    if not isinstance(layers, Iterable):
        raise InvalidTypeError(format_error(
            f"autostate.stack takes a list of layers or one stacked model, got "
            f"{type(layers).__name__}.",
            fix="pass a list of @stateful instances of one class: "
            "`autostate.stack([Block(k) for k in keys])`.",
        ))
    given = list(layers)
    if not given:
        raise StackError(format_error(
            "autostate.stack got no layers: a stack takes its structure from them.",
            fix="pass at least one layer.",
        ))
    for k, layer in enumerate(given):
        if not _graph.is_stateful_instance(layer):
            raise InvalidTypeError(format_error(
                f"Layer {k} given to autostate.stack is a {type(layer).__name__}, not an "
                "instance of a @stateful class.",
                fix="stack instances of one @stateful class.",
            ))
        _check_eager(layer, k)
    _check_unshared(given)
    flats = [_graph.flatten_graph(layer) for layer in given]
    first_leaves, graphdef = flats[0]
    first_specs = [_spec(leaf) for leaf in first_leaves]
    for k, (leaves, other) in enumerate(flats[1:], 1):
        if other != graphdef or [_spec(leaf) for leaf in leaves] != first_specs:
            found = _difference(given[0], given[k], "", set())
            raise StackError(format_error(
                f"Layer {k} differs from layer 0 "
                + (f"at {found}" if found else "in its structure")
                + ": a stack holds layers of one class and one structure (static "
                "configuration, array shapes, dtypes and weak types).",
                fix="build every layer with the same configuration; keep layers that "
                "differ in a list, or in stacks of their own."
                + (" An array made from a Python number is weakly typed "
                   "(`jnp.full(n, 0.5)`), one given a dtype is not "
                   "(`jnp.full(n, 0.5, jnp.float32)`)." if found and "weakly typed" in found else ""),
            ))
    stacked = [jnp.stack(column) for column in zip(*(leaves for leaves, _ in flats))]
    model = _with_layer_axis(_graph.unflatten_graph(graphdef, stacked), layer_axis)
    return Stack(model, len(given), require_scan)


def _with_layer_axis(model: Any, axis: str | None) -> Any:
    """``model`` (stacked) with each sharding annotation of its instances given
    the layer axis's entry in front: ``P(None, "model")`` of a layer's ``w``
    is ``P(axis, None, "model")`` of the stacked ``w``."""
    for obj in _graph.instances_of(model):
        specs = obj.__dict__.get(_sharding.ANNOTATIONS)
        if specs:
            obj.__dict__[_sharding.ANNOTATIONS] = {  # (a new table: copies share the old one)
                attr: jax.tree_util.tree_map(
                    lambda spec: PartitionSpec(axis, *spec), spec,
                    is_leaf=lambda x: isinstance(x, PartitionSpec),
                )
                for attr, spec in specs.items()
            }
    return model


def _spec(leaf: Any) -> tuple[tuple[int, ...], Any, bool]:
    """Shape, dtype and weak type: a weakly typed array (``jnp.full(n, 0.5)``, a
    Python float) takes the dtype of what it meets, so a layer holding one
    computes ``x_bf16 * w`` in bfloat16, where a strong one stacked with it
    would make every layer compute in float32."""
    weak = _values.is_python_number(leaf) or bool(getattr(leaf, "weak_type", False))
    return tuple(jnp.shape(leaf)), jnp.result_type(leaf), weak


def _described(leaf: Any) -> str:
    return _tree.describe(leaf) + (" (weakly typed)" if _spec(leaf)[2] else "")


_EAGER_SLOTS = (InitialLocalStateRequest, FrozenLocalStateRequest, StaticState)


def _check_eager(layer: Any, k: int) -> None:
    """Every state of ``layer`` is an eager model's (its value held in the model)."""
    for path, obj in _graph.instances(layer):
        states = _tree.info_of(obj).state
        for attr, slot in obj.__dict__.items():
            slot = _graph.materialized(slot)
            if attr not in states or not _runtime.is_slot(slot):
                continue
            where = f"{path}.{attr}" if path else attr
            if not isinstance(slot, _EAGER_SLOTS):
                raise InvalidTypeError(format_error(
                    f"State {where!r} of layer {k} is held by a {type(slot).__name__}, "
                    "not by the model: autostate.stack stacks eager models, whose "
                    "states hold their values.",
                    fix="stack layers built eagerly (not a fallback=\"host\" model, nor "
                    "sub-models of a model a functionalized call is running).",
                ))
            for leaf in jax.tree_util.tree_leaves(slot.read()):
                if _values.kind_of(leaf).number and not is_static_value(leaf):
                    raise StackError(format_error(
                        f"State {where!r} of layer {k} holds a Python "
                        f"{type(leaf).__name__}: a stack holds each state as an array "
                        "with the layer axis.",
                        fix=f"make it an array in __init__ (`jnp.asarray({leaf!r})`).",
                    ))


def _check_unshared(layers: list[Any]) -> None:
    """No sub-model or parameter array belongs to two layers: a stack copies each
    layer's values, so what the list shares would be one copy per layer."""
    owner: dict[int, tuple[int, str]] = {}
    for k, layer in enumerate(layers):
        for path, obj in _graph.instances(layer):
            parts = [(path or "the layer", obj)]
            states = _tree.info_of(obj).state
            for attr, value in obj.__dict__.items():
                if attr in states:
                    continue
                value = _graph.materialized(value)
                for sub, leaf in _graph.iter_tree(value, _param_or_model):
                    if _values.is_array(leaf):
                        where = _graph.path_name(f"{'.' + path if path else ''}.{attr}{sub}")
                        parts.append((where, leaf))
            for where, item in parts:
                seen = owner.setdefault(id(item), (k, where))
                if seen[0] != k:
                    what = "sub-model" if _graph.is_stateful_instance(item) else "array"
                    raise StackError(format_error(
                        f"Layers {seen[0]} and {k} share one {what} ({seen[1]!r} of layer "
                        f"{seen[0]}, {where!r} of layer {k}): a stack holds each layer's "
                        "own copy, so what the layers share would no longer be shared.",
                        fix="give each layer its own, or keep the shared part outside the "
                        "stack (an attribute of the model that holds the stack).",
                    ))


def _param_or_model(value: Any) -> bool:
    return _values.is_array(value) or _graph.is_stateful_instance(value)


_REQUEST_KEY = re.compile(r"\.state(?=$|\[|\.)")


def _stacked_depth(model: Any) -> int:
    """The leading axis every array of a stacked ``model`` shares."""
    leaves, graphdef = _graph.flatten_graph(model)
    depth: int | None = None
    for path, leaf in zip(graphdef.names, leaves):
        name = _REQUEST_KEY.sub("", path)  # (a state's request adds ``.state``)
        shape = jnp.shape(leaf)
        n = shape[0] if shape else None
        if n is None or (depth is not None and n != depth):
            raise StackError(format_error(
                f"{type(model).__name__} is not stacked: its array {name!r} is "
                f"{_tree.describe(leaf)}"
                + ("" if depth is None else f", where the others have {depth} layers")
                + ". A stacked model has every array on one leading layer axis.",
                fix="build it with one call, `jax.vmap(Layer)(keys)`, or pass the list "
                "of layers: `autostate.stack([Layer(k) for k in keys])`.",
            ))
        depth = n
    if depth is None:
        raise StackError(format_error(
            f"{type(model).__name__} holds no array, so its number of layers is unknown.",
            fix="pass the list of layers: `autostate.stack([Layer(k) for k in keys])`.",
        ))
    return depth


def _difference(a: Any, b: Any, path: str, seen: set[int]) -> str | None:
    """Where layer ``b`` first differs from layer ``a`` (``path: a's against b's``),
    both walked in step by the graph's one step (``graph.children_of``)."""
    here = path or "the layer"
    if type(a) is not type(b):
        return f"{here}: a {type(b).__name__} against a {type(a).__name__}"
    instance = _graph.is_stateful_instance(a)
    if instance:
        if id(a) in seen:
            return None
        seen.add(id(a))
    elif _values.is_array_or_spec(a):
        if _spec(a) != _spec(b):
            return f"{here}: {_described(b)} against {_described(a)}"
        return None
    kids_a, kids_b = _graph.children_of(a), _graph.children_of(b)
    if instance or kids_a or kids_b:
        if [s for s, _ in kids_a] != [s for s, _ in kids_b]:
            if instance:
                return f"{here}: attributes {list(vars(b))} against {list(vars(a))}"
            return f"{here}: {_shown(b)} against {_shown(a)}"
        for (sub, x), (_, y) in zip(kids_a, kids_b):
            found = _difference(_value_of(x), _value_of(y), _graph.path_name(path + sub), seen)
            if found:
                return found
        return None
    try:
        same = a is b or bool(a == b)
    except Exception:
        same = False
    return None if same else f"{here}: {_shown(b)} against {_shown(a)}"


def _value_of(attribute: Any) -> Any:
    return attribute.read() if _runtime.is_slot(attribute) else attribute


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# --- layers: views of the stacked model ---------------------------------------------


def _view(obj: Any, i: int, depth: int, memo: dict[int, Any], where: str) -> Any:
    """Layer ``i`` of the stacked instance ``obj``: an instance of its class whose
    states are ``LayerSlot``s and other arrays slices; sub-models are views too
    (``memo``). Made here, not by ``graph.map_tree``, since a ``LayerSlot`` needs
    its owner and attribute."""
    seen = memo.get(id(obj))
    if seen is not None:
        return seen
    cls = type(obj)
    view = object.__new__(cls)
    memo[id(obj)] = view
    states = _tree.info_of(obj).state
    here = where or cls.__name__
    attributes = {}
    for attr, value in obj.__dict__.items():
        value = _graph.materialized(value)  # (a value a compiled call left packed: made)
        if attr in states and not _graph.holds_instance(value):
            attributes[attr] = LayerSlot(obj, attr, i, depth)
        else:
            attributes[attr] = _sliced(value, i, depth, memo, f"{here}.{attr}")
    view.__dict__.update(attributes)
    try:
        _guard.register_view(view, _attribute_refusal)
    except TypeError:
        raise InvalidTypeError(format_error(
            f"{cls.__name__} has __slots__ without '__weakref__', so a layer of a stack "
            "of it cannot be tracked.",
            fix="add '__weakref__' to its __slots__.",
        )) from None
    return view


def _sliced(value: Any, i: int, depth: int, memo: dict[int, Any], where: str) -> Any:
    def replace(node: Any, name: str) -> Any:
        if _graph.is_stateful_instance(node):
            return _view(node, i, depth, memo, f"{where}{'.' if name[:1] not in '[' else ''}{name}")
        return _slice(node, i, depth, f"{where}{name}")

    return _unchangeable(_graph.map_tree(value, replace, _param_or_model), where)


def _slice(array: Any, i: int, depth: int, where: str) -> Any:
    shape = jnp.shape(array)
    if not shape or shape[0] != depth:
        raise StackError(format_error(
            f"{where} is {_tree.describe(array)}: it lacks the layer axis of a stack of "
            f"{depth} layers.",
            fix="keep every array of a stacked model on its leading layer axis; a stack "
            "sliced by jax.lax.scan or jax.vmap outside a @stateful method is one "
            "layer's arrays: call autostate.scan / autostate.vmap there, which give "
            "each step one layer.",
        ))
    return array[i]


def _attribute_refusal(obj: Any, name: str) -> StateAccessError:
    if name == "training":  # static config every layer shares: switched on the stack
        return StateAccessError(format_error(
            f"{type(obj).__name__}.training is switched on one layer of a stack (by "
            "train(), eval() or an assignment): the layers share the stacked model's "
            "mode, so one layer cannot switch alone.",
            fix="switch every layer at once: `stack.train()` / `stack.eval()`, or "
            "`model.train()` / `model.eval()` on the model holding the stack.",
        ))
    return StateAccessError(format_error(
        f"{type(obj).__name__}.{name} is not state, and this {type(obj).__name__} is a "
        "layer of a stack: its attributes that are not state are slices of the stacked "
        "model's, so assigning one would change this view alone, where a list of layers "
        "changes the layer.",
        fix=f"make {name} state (assign `self.{name}` in a method, or declare it with "
        "autostate.state(...) in __init__): each layer then writes its own slice; or "
        f"assign every layer's value at once on `stack.stacked.{name}` (with the layer "
        "axis).",
    ))


class LayerSlot(StateSlot):
    """A state of a layer of a stack: the layer's slice of the stacked state.

    ``read()`` is the slice at the layer's index; ``write(v)`` writes the stacked
    state with the slice replaced, through the stacked model's own slot, so it
    means the same in every mode. A value the slice cannot hold is refused (a
    list of layers could hold it, a stack cannot); a layer held by a model
    cannot be functionalized (its state belongs to the stack)."""

    __slots__ = ("owner", "attr", "index", "depth")
    handleable = True

    def __init__(self, owner: Any, attr: str, index: int, depth: int):
        self.owner = owner
        self.attr = attr
        self.index = index
        self.depth = depth

    @property
    def category(self) -> Any:  # type: ignore[override]
        return getattr(self.owner.__dict__.get(self.attr), "category", None)

    def label(self) -> str:
        return f"{type(self.owner).__name__}.{self.attr} of layer {self.index}"

    def read(self) -> Any:
        full = _runtime.read_state(self.owner, self.attr)
        if full is None or is_static_value(full):
            return full  # (one static value: every layer's)
        label = self.label()
        return _unchangeable(jax.tree_util.tree_map(lambda a: _slice(a, self.index, self.depth, label), full), label)

    def write(self, value: Any, label: str | None = None) -> None:
        full = _runtime.read_state(self.owner, self.attr)
        value = jax.tree_util.tree_map(lambda leaf: leaf, value)  # (plain dicts and lists)
        new = _with_layer(full, value, self.index, self.depth, self.label())
        if new is not full:
            try:
                _runtime.store_state(self.owner, self.attr, new)
            except TracedEagerStateError:
                slot = self.owner.__dict__.get(self.attr)
                if getattr(slot, "handled", False) or _lifetime.eager_home(slot) is not None:
                    raise  # (a transformation applied inside a call or trace)
                # The stacked state's own refusal advises functionalizing the
                # model it reached, which a layer cannot be.
                raise self._traced_refusal() from None

    def _traced_refusal(self) -> TracedEagerStateError:
        return TracedEagerStateError(format_error(
            f"{self.label()} was assigned a JAX tracer, but the stack holding it is not "
            "functionalized and was built outside the running transformation (jax.jit, "
            "grad, vmap, eval_shape): the stack would keep a value that only exists "
            "inside its trace.",
            fix="apply autostate's transformation to the model (or the stack) that holds "
            "the layer, and take the layer inside the function: "
            "`autostate.jit(lambda m, x: m.blocks[0](x))(model, x)` (a layer itself "
            "cannot be given to autostate.jit or functionalize(): its states are the "
            "stack's); or call `f, states = model.functionalize()` and use "
            "`out, states = f(states, ...)` inside the transformation.",
        ))

    def as_request(self) -> Any:
        raise StackError(format_error(
            f"The model holds a layer of a stack ({type(self.owner).__name__}, layer "
            f"{self.index}): a layer is a view of the stack, whose states are the "
            "stack's, so it cannot be functionalized, compiled by autostate.jit, saved "
            "or frozen on its own.",
            fix="keep the stack in the model and take the layer from it when it is "
            "used (`self.blocks[0]`; to compile a call of one layer, pass the model: "
            "`autostate.jit(lambda m, x: m.blocks[0](x))(model, x)`), or keep the layer "
            "as a model of its own (`copy.deepcopy(layer)`).",
        ))

    def part_of(self) -> tuple[Any, str]:
        return self.owner, self.attr

    def __eq__(self, other: object) -> bool:
        if type(other) is not LayerSlot:
            return NotImplemented
        return (self.owner, self.attr, self.index) == (other.owner, other.attr, other.index)

    def __hash__(self) -> int:
        return hash((id(self.owner), self.attr, self.index))


# --- a layer's dicts and lists ------------------------------------------------------
# A layer's state read through its view, and a dict or list attribute of the
# view, are new values made of slices; a dict or list in them changed in place
# would change that copy alone, where a list of layers changes the layer. So
# it is refused: a layer's dicts and lists are ``_LayerDict`` / ``_LayerList``,
# whose copies (a state write of ``self.cache['k'] = v`` copies, then
# assigns) and pytree rebuilds are plain.


def _in_place_refusal(container: Any, label: str) -> StackError:
    kind = "dict" if isinstance(container, dict) else "list"
    return StackError(format_error(
        f"A {kind} of {label} is changed in place, but a layer of a stack holds its "
        f"dicts and lists as new ones, made of slices of the stacked model's: the change "
        "would not reach the stack, where a list of layers changes the layer.",
        fix="make it state and assign it: `layer.cache = {**layer.cache, 'k': v}` "
        "(inside the layer's own methods, `self.cache['k'] = v` is such an "
        "assignment of a state).",
    ))


def _refuse_in_place(name: str) -> Any:
    def refuse(self: Any, *_args: Any, **_kwargs: Any) -> Any:
        raise _in_place_refusal(self, self._label)

    refuse.__name__ = name
    return refuse


class _LayerContainer:
    """A dict or list of a layer's state: read-only, copied and rebuilt as a
    plain one (``_plain``)."""

    __slots__ = ()
    _label: str
    _plain: Any

    def __copy__(self) -> Any:
        return self._plain(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        import copy

        return copy.deepcopy(self._plain(self), memo)

    def __reduce__(self) -> Any:
        return (self._plain, (self._plain(self),))


class _LayerDict(_LayerContainer, dict):
    __slots__ = ("_label",)
    _plain = dict


class _LayerList(_LayerContainer, list):
    __slots__ = ("_label",)
    _plain = list


for _name in ("__setitem__", "__delitem__", "__ior__", "update", "pop", "popitem", "setdefault", "clear"):
    setattr(_LayerDict, _name, _refuse_in_place(_name))
for _name in (
    "__setitem__", "__delitem__", "__iadd__", "__imul__", "append", "extend", "insert",
    "pop", "remove", "clear", "sort", "reverse",
):
    setattr(_LayerList, _name, _refuse_in_place(_name))

def _plain(value: Any) -> Any:
    return value  # (typed Any: a layer's dict or list rebuilds as a plain one)


jax.tree_util.register_pytree_with_keys(
    _LayerDict,
    lambda d: ([(jax.tree_util.DictKey(k), d[k]) for k in sorted(d)], tuple(sorted(d))),
    lambda keys, values: _plain(dict(zip(keys, values))),
    lambda d: ([d[k] for k in sorted(d)], tuple(sorted(d))),
)
jax.tree_util.register_pytree_with_keys(
    _LayerList,
    lambda items: ([(jax.tree_util.SequenceKey(i), v) for i, v in enumerate(items)], None),
    lambda _, values: _plain(list(values)),
    lambda items: (list(items), None),
)


def _unchangeable(value: Any, label: str) -> Any:
    """``value`` with its dicts and lists (inside tuples too) as a layer's, read-only."""
    t = type(value)
    if t is dict:
        out: Any = _LayerDict((k, _unchangeable(v, label)) for k, v in value.items())
    elif t is list:
        out = _LayerList(_unchangeable(v, label) for v in value)
    elif t is tuple:
        return tuple(_unchangeable(v, label) for v in value)
    else:
        return value
    out._label = label
    return out


def _with_layer(full: Any, value: Any, i: int, depth: int, label: str) -> Any:
    """The stacked state ``full`` with layer ``i``'s slice replaced by ``value``."""
    if full is None or is_static_value(full):
        if same_static(value, full):
            return full
        what = "is None" if full is None else f"is {full!r} for every layer"
        raise StackError(format_error(
            f"{label} is assigned {_tree.describe(value)}, but the stacked state {what}: "
            "a stack holds one such value for all its layers, so one layer cannot "
            "take another.",
            fix="give the state an array value in __init__ (it then has a slice per "
            "layer), or assign every layer the same value through the stacked model "
            "(`stack.stacked`).",
        ))
    leaves, treedef = jax.tree_util.tree_flatten(full)
    given, given_def = jax.tree_util.tree_flatten(value)
    if cast(Any, given_def) != treedef:  # (jax's stubs leave PyTreeDef untyped)
        raise _slice_error(label, f"a {given_def}", f"a {treedef}")
    new = []
    for a, v in zip(leaves, given):
        shape = jnp.shape(a)
        if not shape or shape[0] != depth:
            _slice(a, i, depth, label)  # (raises)
        want, got = (shape[1:], jnp.result_type(a)), (jnp.shape(v), _dtype(v))
        if want != got:
            raise _slice_error(label, _tree.format_spec(*got), _tree.format_spec(*want))
        new.append(a.at[i].set(v))
    return jax.tree_util.tree_unflatten(treedef, new)


def _dtype(value: Any) -> Any:
    dtype = getattr(value, "dtype", None)
    return dtype if dtype is not None else jnp.asarray(value).dtype


def _slice_error(label: str, got: str, want: str) -> StackError:
    return StackError(format_error(
        f"{label} is assigned {got}, but its slice of the stacked state is {want}: a "
        "stack holds one shape, dtype and structure per state for all its layers.",
        fix="assign a value of the slice's shape and dtype (`.astype(...)`, a reshape), "
        "or keep layers whose states change shape in a list.",
    ))


# Code reaching a layer's state reaches the stacked model whose state it slices.
_graph.register_node_kind(LayerSlot, reached=lambda slot: [slot.owner])
