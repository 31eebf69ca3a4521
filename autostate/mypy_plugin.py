"""A mypy plugin: ``@autostate.stateful`` classes have the methods it adds.

Enable it in ``pyproject.toml``:

```toml
[tool.mypy]
plugins = ["autostate.mypy_plugin"]
```

or in ``mypy.ini`` / ``setup.cfg`` (``plugins = autostate.mypy_plugin``).

``@autostate.stateful`` adds ``functionalize``, ``train`` and ``eval`` to a
class at run time; no type annotation can say that a decorator adds methods,
so without the plugin mypy reports ``"Counter" has no attribute
"functionalize"``. The plugin gives a decorated class (``@autostate.stateful``
or ``@autostate.stateful(...)``) those methods with the signatures they have
on ``autostate.Stateful``, the base class that types them without a plugin:
``functionalize(...) -> tuple[FunctionalModel[Self], dict[str, Any]]``,
``train(mode=True) -> Self`` and ``eval() -> Self``. A method the class (or
a base) defines itself is left alone, as at run time.

It also types ``f.<method>(states, ...)`` from the model's method:
``f.generate(states, x)`` on a ``FunctionalModel[Net]`` takes
``Net.generate``'s arguments after ``states`` and returns
``tuple[<its return type>, dict[str, Any]]``; a parameter, sub-model or
config attribute has the model's type (``grads.norm`` on a gradient shaped
like ``f``); a name the class has neither for is an error, as it is at run
time. (``f(states, ...)`` is typed from
``Net.__call__`` without the plugin.)
"""

from __future__ import annotations

from collections.abc import Callable

from mypy.checker import TypeChecker
from mypy.errorcodes import ATTR_DEFINED
from mypy.expandtype import expand_type
from mypy.nodes import ARG_POS, Argument, TypeInfo, Var
from mypy.plugin import AttributeContext, ClassDefContext, Plugin
from mypy.plugins.common import add_method_to_class
from mypy.subtypes import find_member
from mypy.typeops import fill_typevars
from mypy.types import (
    AnyType,
    CallableType,
    Instance,
    Overloaded,
    TupleType,
    Type,
    TypeOfAny,
    TypeVarId,
    TypeVarType,
    get_proper_type,
)

STATEFUL = "autostate.api.stateful"
BASE = "autostate.api.Stateful"
FUNCTIONAL_MODEL = "autostate.functional.FunctionalModel"
# The methods ``@stateful`` installs, typed as ``autostate.Stateful`` declares them.
ADDED = ("functionalize", "train", "eval")


class AutostatePlugin(Plugin):
    """Adds ``@stateful``'s methods to decorated classes and types ``f.<method>``."""

    def get_class_decorator_hook_2(self, fullname: str) -> Callable[[ClassDefContext], bool] | None:
        return _add_methods if fullname == STATEFUL else None

    def get_attribute_hook(self, fullname: str) -> Callable[[AttributeContext], Type] | None:
        # Called for every name found through FunctionalModel.__getattr__.
        if fullname.startswith(FUNCTIONAL_MODEL + ".") and fullname.count(".") == 3:
            return _method_through_f
        return None


def plugin(version: str) -> type[Plugin]:
    """The entry point mypy calls when it loads ``autostate.mypy_plugin``.

    Args:
        version: the version of mypy loading it.

    Returns:
        The plugin class.
    """
    return AutostatePlugin


def _add_methods(ctx: ClassDefContext) -> bool:
    info = ctx.cls.info
    base = ctx.api.lookup_fully_qualified_or_none(BASE)
    if base is None or not isinstance(base.node, TypeInfo):
        return True  # autostate itself is not analyzed (follow_imports = skip)
    for name in ADDED:
        if _defined(info, name):
            continue
        declared = base.node.names.get(name)
        sig = get_proper_type(declared.type if declared is not None else None)
        if not isinstance(sig, CallableType) or base.node.self_type is None:
            return False  # Stateful is not analyzed yet: called again
        self_type = _self_type(info, name)
        sig = expand_type(sig, {base.node.self_type.id: self_type})
        assert isinstance(sig, CallableType)
        args = [
            Argument(Var(arg_name or f"__arg{i}", typ), typ, None, kind)
            for i, (arg_name, typ, kind) in enumerate(zip(sig.arg_names, sig.arg_types, sig.arg_kinds))
        ][1:]
        add_method_to_class(
            ctx.api, ctx.cls, name, args, sig.ret_type, self_type=self_type, tvar_def=self_type
        )
    return True


def _defined(info: TypeInfo, name: str) -> bool:
    """Whether the class or a base (not ``object``) defines ``name`` itself."""
    for klass in info.mro[:-1]:
        sym = klass.names.get(name)
        if sym is not None:
            return not (klass is info and sym.plugin_generated)
    return False


def _self_type(info: TypeInfo, method: str) -> TypeVarType:
    """A ``Self`` type variable of ``info``, bound in the added ``method``."""
    return TypeVarType(
        "Self",
        f"{info.fullname}.Self",
        id=TypeVarId(-1, namespace=f"{info.fullname}.{method}"),
        values=[],
        upper_bound=fill_typevars(info),
        default=AnyType(TypeOfAny.from_omitted_generics),
    )


def _method_through_f(ctx: AttributeContext) -> Type:
    """``f.name`` on a ``FunctionalModel[M]``: ``M.name`` with ``states`` first,
    returning ``(out, new_states)``."""
    f = get_proper_type(ctx.type)
    if not isinstance(f, Instance) or f.type.fullname != FUNCTIONAL_MODEL or not f.args:
        return ctx.default_attr_type
    model = get_proper_type(f.args[0])
    if not isinstance(model, Instance) or not isinstance(ctx.api, TypeChecker):
        return ctx.default_attr_type
    context = ctx.context
    name = getattr(context, "name", None)
    if not isinstance(name, str) or f.type.get(name) is not None:
        return ctx.default_attr_type  # (the hook sees f's own attributes too: f.model)
    found = find_member(name, model, model) if model.type.get(name) is not None else None
    method = get_proper_type(found)
    if method is not None and not isinstance(method, (CallableType, Overloaded, AnyType)):
        return method  # a parameter, sub-model or config: read as the model's
    if method is None:
        if model.type.get("__getattr__") is None:
            message = f'"{model.type.name}" has no method "{name}" to call functionally'
            ctx.api.fail(message, context, code=ATTR_DEFINED)
        return ctx.default_attr_type
    states = ctx.api.named_generic_type(
        "builtins.dict", [ctx.api.named_type("builtins.str"), AnyType(TypeOfAny.explicit)]
    )
    if isinstance(method, CallableType):
        return _with_states(method, states, ctx.api)
    if isinstance(method, Overloaded):
        return Overloaded([_with_states(item, states, ctx.api) for item in method.items])
    return ctx.default_attr_type


def _with_states(method: CallableType, states: Instance, api: TypeChecker) -> CallableType:
    out = TupleType([method.ret_type, states], api.named_type("builtins.tuple"))
    return method.copy_modified(
        arg_types=[states, *method.arg_types],
        arg_kinds=[ARG_POS, *method.arg_kinds],
        arg_names=[None, *method.arg_names],
        ret_type=out,
    )


__all__ = ["AutostatePlugin", "plugin"]
