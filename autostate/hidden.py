"""What ``functionalize()`` refuses among a model's plain objects.

An undecorated object a model holds is static pytree data: arrays inside it
would be baked into ``f`` as jit constants (no gradient, absent from
``param_dict`` and from checkpoints), and a model reached through it (a
back-reference, a closure, a ``functools.partial``, a generator) would not
be the copy ``f`` makes. ``check_no_hidden_arrays`` finds the first such
array or model and says how to hold it instead; it also makes a state an
instance holds as a plain array (made before its class was decorated) a
slot. ``api`` calls it when a model is functionalized.
"""

from __future__ import annotations

import builtins
import functools
import types
import weakref
from typing import Any

from autostate import graph as _graph
from autostate import tree as _tree
from autostate import values as _values
from autostate.errors import InvalidTypeError, format_error, holder_fix
from autostate.runtime import is_slot, make_slot

__all__ = ["check_no_hidden_arrays", "hidden_model_error"]


def _is_array_object(value: Any) -> bool:
    # (A numpy scalar in a plain object is a number there, as a Python float is.)
    kind = _values.kind_of(value)
    return kind is _values.ARRAY or kind is _values.NUMPY_ARRAY


class _Hidden(tuple):
    """``(what, holder, fix)`` that ``_hidden_array`` found: a fresh node, the walk's target."""


def _hidden_array(
    where: str, value: Any, arrays: bool = True
) -> tuple[str, str, Any, str | None] | None:
    """``(where, holder, what, fix)`` of the first array in a plain object, or
    model reached where ``functionalize()`` cannot follow it, in ``value``
    (``fix``: the holder's own, ``errors.holder_fix``).

    A sub-model in an attribute or container is a graph edge, and a method,
    closure or weak reference bound directly to one is rebound to f's copy;
    anything else reaching a model (a plain object, a ``functools.partial``, a
    closure through another function) would reach the original. The walk's
    ``step`` gives a find as a ``_Hidden`` child, and any other child its
    context ``(inside, holder, forced)``. It is no node kind's field: it sees
    what the graph does not follow, and depends on the path's holders.
    ``arrays=False``: models only (an array in a plain object is no find)."""
    root = (value,)
    context: dict[int, tuple[bool, str, str]] = {id(value): (False, "", "")}
    stateful = _graph.is_stateful_instance

    def step(node: Any) -> list[tuple[str, Any]]:
        if node is root:
            return [(where, value)]
        inside, default, forced = inner = context[id(node)]
        t = type(node)
        items: Any = ()
        hit = None  # (suffix, what, holder)
        holder = ""  # a plain holder, whose own models and arrays are finds
        if stateful(node):
            hit = ("", node, "") if inside else None
        elif t is list or t is tuple:
            items = [(f"[{k}]", v) for k, v in enumerate(node)]
        elif _values.kind_of(node).sealed:
            # A set or deque is not walked by functionalize(): a model in it
            # would be shared by f and the eager model, its states never handled.
            # (Arrays in it are static, as a deque of a replay buffer's samples
            # has always been.)
            _SEALED_CONTAINERS.add(t.__name__)
            items = [(f"[{k}]", v) for k, v in enumerate(node)]
            hit = next(((k, v, t.__name__) for k, v in items if stateful(v)), None)
            inner = (True, default, forced)
        elif t is dict:
            items = [(f"[{k!r}]", v) for k, v in node.items()]
        elif isinstance(node, (list, tuple, dict)):
            # A subclass (an OrderedDict, a defaultdict, a NamedTuple, a user's
            # list): its items as the builtin's. functionalize() walks a
            # registered pytree; any other is one leaf, shared by f and the eager
            # model: what it holds is below a holder.
            pairs = node.items() if isinstance(node, dict) else enumerate(node)
            items = [(f"[{k!r}]" if isinstance(node, dict) else f"[{k}]", v) for k, v in pairs]
            if not _graph.is_pytree_node(node):
                _UNWALKED_CONTAINERS.add(t.__name__)
                holder = t.__name__
        elif t is weakref.ProxyType or t is weakref.CallableProxyType:
            # A proxy gives no way to its referent: f's copy cannot be rebound.
            try:
                held = node.__class__ in _graph.STATEFUL_CLASSES
            except ReferenceError:  # its referent is gone
                held = False
            hit = ("", node, "weakref.proxy") if held else None
        elif t is types.BuiltinMethodType:
            if _values.is_mutable(node.__self__):
                hit = (".__self__", node.__self__, "builtin method")
        elif t is types.MethodType or t is weakref.ReferenceType or t is weakref.WeakMethod:
            target = node.__self__ if t is types.MethodType else node()
            if t is weakref.WeakMethod:
                target = getattr(target, "__self__", None)
            hit = ("", target, t.__name__) if inside and stateful(target) else None
        elif t is types.FunctionType:
            items = []
            for k, cell in enumerate(node.__closure__ or ()):
                try:
                    content = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                # A model in the function's own cell is rebound, unless the
                # function itself was reached through a holder.
                if inside or not stateful(content):
                    items.append((f".__closure__[{k}]", content))
            inner = (True, "closure", forced)
        elif (parts := _graph.held_parts(node)) is not None:
            # A functools.partial, a generator a method made (its frame holds
            # ``self``), a lazy map over a method: bound to a model that f's copy
            # cannot be put in (a method or a lambda is rebound).
            items = parts
            name = "functools.partial" if isinstance(node, functools.partial) else t.__name__
            inner = (True, default, forced or name)
        elif not _graph.is_dynamic(node) and (attrs := _graph.plain_attributes(node)) is not None:
            items = [(f".{k}", v) for k, v in attrs.items()]
            holder = t.__name__
        if (
            not holder and inside and default and default != "closure"
            and isinstance(node, (list, tuple, dict)) and not stateful(node)
        ):
            # A list, tuple or dict a plain object holds is that object's data,
            # static as the object is: its arrays and models are its finds.
            holder = default
        if hit is not None:
            return [(hit[0], _Hidden((hit[1], forced or hit[2] or default, None)))]
        if holder:
            inner = (True, holder, forced)
        out = []
        for suffix, v in items:
            if holder and (stateful(v) or (arrays and _is_array_object(v))):
                v = _Hidden((v, forced or holder, None if forced else holder_fix(node)))
            else:
                context[id(v)] = inner
            out.append((suffix, v))
        return out

    found = next(
        _graph.iter_tree(root, lambda n: type(n) is _Hidden, children=step, seen=builtins.set()),
        None,
    )
    return None if found is None else (found[0], found[1][1], found[1][0], found[1][2])


_ITERATOR_HOLDERS = frozenset({"generator", "coroutine", "async_generator", "map", "filter"})
# Names of the list, tuple and dict subclasses met that are no registered pytree.
_UNWALKED_CONTAINERS: builtins.set[str] = builtins.set()
# Names of the sets, frozensets and deques met (which the graph does not walk).
_SEALED_CONTAINERS: builtins.set[str] = builtins.set()

# The fix for a model found below a holder of each kind (``{holder}``: its name).
_DECORATE_HOLDER = (
    "decorate {holder} with @autostate.stateful (its reference is then followed like any "
    "sub-model's), or pass the model to its methods as an argument instead of storing it."
)
_MODEL_FIXES = (
    (_UNWALKED_CONTAINERS, "hold the model in a plain list, tuple or dict, or register {holder} "
     "as a JAX pytree (jax.tree_util.register_pytree_node), which functionalize() follows."),
    (_SEALED_CONTAINERS, "hold the model in a list, tuple or dict, which functionalize() follows."),
    (_ITERATOR_HOLDERS, "make the iterator inside the call that uses it, or keep what it iterates "
     "over on the model (a counter state, a list) and step through it in a method."),
    (("functools.partial", "closure", "method", "weakref"), "store the method itself or a lambda "
     "that names the model directly (`self.fn = lambda x: self.method(x, k=2)`), which f's copy "
     "rebinds to itself."),
)


def check_no_hidden_arrays(model: Any, caller: str = "functionalize()") -> None:
    """Refuses a model holding arrays inside plain objects (static pytree data:
    baked into ``f`` as constants, with no gradient and absent from
    checkpoints), and makes a state held as a plain array a slot
    (``caller``: what the user called, which functionalizes the model)."""
    if not _graph.is_stateful_instance(model):
        return
    by = caller if caller == "functionalize()" else f"{caller} (which functionalizes the model)"
    _refuse_hidden(model, arrays=True, by=by, inside="f")


def hidden_model_error(models: Any, by: str, inside: str) -> InvalidTypeError | None:
    """The refusal of the first model found among ``models`` (or below them) that
    is held where ``by`` cannot follow it (inside a plain object, a closure, a
    ``functools.partial``), or None: ``autostate.jit`` asks it of its models when
    a call through such a model wrote a tracer into the original."""
    try:
        for model in models:
            if _graph.is_stateful_instance(model):
                _refuse_hidden(model, arrays=False, by=by, inside=inside)
    except InvalidTypeError as err:
        return err
    return None


def _refuse_hidden(model: Any, arrays: bool, by: str, inside: str) -> None:
    for path, obj in _graph.instances(model):
        adopt = None
        for name, value in obj.__dict__.items():
            value = _graph.materialized(value)  # (a value a compiled call left packed)
            kind = _values.kind_of(value)
            if kind.atom:
                continue  # the common attributes: nothing hidden in them
            if is_slot(value):
                continue
            if kind is _values.ARRAY:
                if name in _tree.info_of(obj).state:
                    adopt = [*(adopt or ()), name]
                continue
            found = _hidden_array(f".{path}.{name}" if path else f".{name}", value, arrays)
            if found is None:
                continue
            where = found[0]
            holder = found[1] or "plain"
            if holder == "builtin method":
                if not arrays:
                    continue
                raise InvalidTypeError(format_error(
                    f"{type(obj).__name__}.{name} is a method of a "
                    f"{type(found[2]).__name__} the model holds (at {where}); f's copy "
                    "of the model has its own copy of that container, so calls through "
                    "it inside f would change the original model's.",
                    fix="call the container's method where it is needed "
                    "(`self.log.append(v)`), or keep a method of the model instead.",
                ))
            if holder == "weakref.proxy":
                raise InvalidTypeError(format_error(
                    f"{type(obj).__name__}.{name} holds a weakref.proxy to a @stateful "
                    f"model (at {where}); a proxy gives no way to its model, so {inside}'s "
                    "copy could not be pointed at {inside}'s copy of that model: calls through it "
                    f"inside {inside} would read and write the original model instead of "
                    f"{inside}'s states.",
                    fix="keep a weakref.ref(model) (call it to reach the model), which "
                    "f's copy rebinds to itself, or the model itself.",
                ))
            if _graph.is_stateful_instance(found[2]):
                # A back-reference (``self.hook = Hook(self)``): f's copy of the
                # model would still reach the original through it.
                fix = found[3] or next(
                    (f for holders, f in _MODEL_FIXES if holder in holders), _DECORATE_HOLDER
                ).format(holder=holder)
                raise InvalidTypeError(format_error(
                    f"{type(obj).__name__}.{name} holds a @stateful model inside a plain "
                    f"{holder} object (at {where}); {by} copies the model "
                    f"but not the {holder}, so calls through it inside {inside} would read "
                    f"and write the original model instead of {inside}'s states.",
                    fix=fix,
                ))
            if not arrays:
                continue
            raise InvalidTypeError(format_error(
                f"{type(obj).__name__}.{name} holds an array inside a plain "
                f"{holder} object (at {where}); {by} would bake it into "
                "f as a constant: no gradient, not in param_dict, not saved.",
                fix=found[3] or f"decorate {holder} with @autostate.stateful (or "
                f"register it as a JAX pytree), or store the array on "
                f"{type(obj).__name__} itself.",
            ))
        # A state held as a plain array: the instance was made before its class
        # was decorated (``object.__new__`` of a class waiting for its first
        # use, or ``__class__`` set to one). Its value becomes the state's.
        for name in adopt or () if arrays else ():
            dict.__setitem__(obj.__dict__, name, make_slot(obj, name, obj.__dict__[name]))
