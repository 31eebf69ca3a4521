"""How a decorated model shows itself: ``repr`` and treescope.

``model_repr`` is the ``repr`` ``@stateful`` gives classes that define none;
``model_treescope_repr`` their ``__treescope_repr__`` (``treescope`` is
optional). Both write parameters as ``dtype[shape]`` and each state with one
label (``state_label``): its name, category and whether it holds an initial
value, a value, is handled by a running ``functionalize`` or lives in a host
store. Nothing here changes a model.
"""

from __future__ import annotations

import contextvars
import types
from typing import Any

import jax

from autostate import graph as _graph
from autostate import sharding as _sharding
from autostate import tree as _tree
from autostate import values as _values
from autostate.effects.local_state import (
    FrozenLocalStateRequest,
    HandledLocalStateRef,
    InitialLocalStateRequest,
    SharedLocalStateRequest,
    StateSlot,
)
from autostate.functional import CONSTANT, ConstantRef
from autostate.lifetime import InitialValue
from autostate.state_values import HandledStaticState, StaticState

# --- labels -------------------------------------------------------------------------

_NO_VALUE = object()


def state_label(slot: Any, name: str) -> tuple[str, Any]:
    """A state's label and the value to show after it (``_NO_VALUE``: none), such
    as ``state 'mean' category='state' initial value``, ``... value``, ``...
    handled by <id>``, ``constant 'table' ...``, ``... static``, ``... shared``
    or ``... in a host store``."""
    category = getattr(slot, "category", None)
    if type(slot) is ConstantRef:
        return f"constant {name!r} handled by {slot.handler_id!r}", _NO_VALUE
    head = f"constant {name!r}" if category == CONSTANT else f"state {name!r} category={category!r}"
    if isinstance(slot, InitialLocalStateRequest):
        init = slot.state_initializer
        return f"{head} initial value", init.value if isinstance(init, InitialValue) else init
    if isinstance(slot, FrozenLocalStateRequest):
        return f"{head} value", slot.state
    if isinstance(slot, HandledLocalStateRef):
        return f"{head} handled by {slot.handler_id!r}", _NO_VALUE
    if isinstance(slot, SharedLocalStateRequest):
        return f"{head} shared", _NO_VALUE
    if isinstance(slot, StaticState):
        return f"{head} static", slot.value
    if isinstance(slot, HandledStaticState):
        return f"{head} static, fixed in {slot.handler_id!r}", slot.value
    from autostate.stacks import LayerSlot  # (a feature this rendering names: read when asked)

    if isinstance(slot, LayerSlot):
        return f"{head} of layer {slot.index} of a stack", slot.read()
    if getattr(slot, "lost", None) is not None:  # (``control``'s: its body raised)
        return f"{head} with no value (assigned in a body that raised)", _NO_VALUE
    # Another engine's slot (the host fallback): its value lives elsewhere.
    return f"{head} in a host store", _NO_VALUE


def _slot_names(root: Any) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, slot in _graph.iter_tree(root, lambda x: isinstance(x, StateSlot)):
        names.setdefault(id(slot), name)
    return names


# --- repr ---------------------------------------------------------------------------

_WIDTH = 80
_STATIC_WIDTH = 40


def _clip(text: str, width: int = _STATIC_WIDTH) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _layout(open_: str, items: list[str], close: str) -> str:
    line = open_ + ", ".join(items) + close
    if len(line) <= _WIDTH and "\n" not in line:
        return line
    body = "".join("  " + item.replace("\n", "\n  ") + ",\n" for item in items)
    return f"{open_}\n{body}{close}"


class _ReprWriter:
    """Formats one model graph: parameters by shape, states by name and kind."""

    def __init__(self, root: Any):
        self.seen: dict[int, str] = {}
        self.slot_names = _slot_names(root)

    def node(self, value: Any, path: str) -> str:
        t = type(value)
        if _graph.is_stateful_instance(value):
            return self.instance(value, path)
        if isinstance(value, StateSlot) or type(value) is ConstantRef:
            return self.state(value, path)
        from autostate.stacks import Stack  # (see state_label)

        if t is Stack:  # (adds nothing to the names under it)
            strict = ["require_scan=True"] if value.require_scan else []
            parts = [f"depth={len(value)}", *strict, f"stacked={self.node(value.stacked, path)}"]
            return _layout("Stack(", parts, ")")
        if _values.is_array_or_spec(value):
            return _tree.describe(value)
        if t is list or t is tuple:
            items = [self.node(v, path + sub) for sub, v in _graph.children_of(value)]
            if t is list:
                return _layout("[", items, "]")
            return _layout("(", items, ",)" if len(items) == 1 else ")")
        if t is dict:
            children = zip(value, _graph.children_of(value))
            items = [f"{k!r}: {self.node(v, path + sub)}" for k, (sub, v) in children]
            return _layout("{", items, "}")
        if t is types.MethodType and _graph.is_stateful_instance(value.__self__):
            # (Its own repr is the model's: a method of the model kept by
            # the model, `self.fn = self._a`, recursed without end.)
            name = getattr(value.__func__, "__qualname__", "?")
            return f"<bound method {name} of {self.node(value.__self__, path + '.__self__')}>"
        if _graph.is_dynamic(value):
            try:
                shown = jax.tree_util.tree_map(_Shown.of, value)
            except Exception:  # an unflatten that validates its children
                return f"{type(value).__name__}(...)"
            return _clip(repr(shown), _WIDTH)
        return _clip(repr(value))

    def instance(self, obj: Any, path: str) -> str:
        cls = type(obj).__name__
        if id(obj) in self.seen:
            return f"<{cls}, same as {self.seen[id(obj)]!r}>"
        self.seen[id(obj)] = _graph.path_name(path) or "self"
        specs = vars(obj).get(_sharding.ANNOTATIONS, {})
        items = [
            f"{attr}={self.node(_graph.materialized(value), path + _graph.attr_name(attr))}"
            + (f" sharded {specs[attr]}" if attr in specs else "")
            for attr, value in vars(obj).items()
            if attr != _sharding.ANNOTATIONS
        ]
        return _layout(f"{cls}(", items, ")")

    def state(self, slot: Any, path: str) -> str:
        name = getattr(slot, "name", None) or self.slot_names.get(id(slot))
        label, value = state_label(slot, name or _graph.path_name(path))
        if value is _NO_VALUE:
            return f"<{label}>"
        if callable(value) and not _graph.is_dynamic(value):
            return f"<{label}: {_clip(repr(value))}>"
        return f"<{label}: {self.node(value, '')}>"


class _Shown:
    """A leaf standing for an array in the repr of a foreign pytree node."""

    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text

    @classmethod
    def of(cls, leaf: Any) -> Any:
        return cls(_tree.describe(leaf)) if _values.is_array_or_spec(leaf) else leaf

    def __repr__(self) -> str:
        return self.text


def model_repr(obj: Any) -> str:
    """``repr`` of a ``@stateful`` instance: class, parameters, states.

    Parameters show as ``dtype[shape]``; each state shows its name and
    category and whether it holds an ``initial value`` (as constructed), a
    ``value`` (embedded by ``freeze``/``load``), is ``handled`` (inside a
    functionalized model), ``shared`` or ``in a host store``. A sub-model
    reachable from two paths is written out once. ``@stateful`` installs this
    as ``__repr__`` on classes that do not define their own.

    Args:
        obj: the instance.

    Returns:
        The text.

    Examples:
        >>> @autostate.stateful
        ... class BatchNorm:
        ...     def __init__(self, n):
        ...         self.scale = jnp.ones(n)
        ...         self.mean = jnp.zeros(n)
        ...
        ...     def __call__(self, x):
        ...         self.mean = 0.9 * self.mean + 0.1 * x.mean(0)
        ...         return (x - self.mean) * self.scale
        >>> BatchNorm(3)
        BatchNorm(
          scale=f32[3],
          mean=<state 'mean' category='state' initial value: f32[3]>,
        )
    """
    return _ReprWriter(obj).node(obj, "")


# --- treescope ----------------------------------------------------------------------

# Background of a state's box and color of its label in treescope's HTML view.
TREESCOPE_STATE_COLOR = "#ffd966"
_TREESCOPE_LABEL_STYLE = "color: #9c5700; font-weight: bold"

# (treescope path of the outermost model being rendered, its slots' state names)
_treescope_root: contextvars.ContextVar[tuple[str, dict[int, str]] | None] = (
    contextvars.ContextVar("autostate_treescope_root", default=None)
)


class _TreescopeState:
    """One state attribute as treescope shows it: a highlighted, labelled box."""

    __slots__ = ("label", "value")

    def __init__(self, slot: Any, name: str):
        self.label, self.value = state_label(slot, name)

    def __treescope_repr__(self, path: str | None, subtree_renderer: Any) -> Any:
        from treescope import rendering_parts as parts

        label = parts.custom_style(parts.text(self.label), _TREESCOPE_LABEL_STYLE)
        if self.value is _NO_VALUE:
            return parts.build_one_line_tree_node(
                parts.siblings("<", label, ">"), path, background_color=TREESCOPE_STATE_COLOR
            )
        return parts.build_foldable_tree_node_from_children(
            prefix=parts.siblings("<", label, ": "), children=[subtree_renderer(self.value, path=path)],
            suffix=">", path=path, background_color=TREESCOPE_STATE_COLOR,
        )


def model_treescope_repr(obj: Any, path: str | None, subtree_renderer: Any) -> Any:
    """``__treescope_repr__`` of a ``@stateful`` instance (needs ``treescope``):
    parameters and sub-models as children, each state a box in
    ``TREESCOPE_STATE_COLOR`` labelled like the plain repr, named relative to
    the outermost model rendered."""
    from treescope import repr_lib  # optional: pip install autostate[treescope]

    root = _treescope_root.get()
    token = None
    if root is None:
        root = (path or "", _slot_names(obj))
        token = _treescope_root.set(root)
    try:
        root_path, slot_names = root
        attributes: dict[str, Any] = {}
        for attr, value in vars(obj).items():
            value = _graph.materialized(value)
            if not isinstance(value, StateSlot) and type(value) is not ConstantRef:
                attributes[attr] = value
                continue
            name = getattr(value, "name", None) or slot_names.get(id(value))
            if name is None:  # not found from the root: named by its path from it
                here = f"{path}.{attr}" if path is not None else attr
                relative = here[len(root_path) :] if here.startswith(root_path) else attr
                name = _graph.path_name(relative)
            attributes[attr] = _TreescopeState(value, name)
        return repr_lib.render_object_constructor(
            object_type=type(obj), attributes=attributes, path=path, subtree_renderer=subtree_renderer
        )
    finally:
        if token is not None:
            _treescope_root.reset(token)
