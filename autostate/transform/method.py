"""What the transform knows about one function before parsing it, libcst-free.

``MethodSource`` (where a function sits and its text) and the names the
generated wrapper uses. They live apart from ``analysis`` so that a warm
start, where every class is a cache hit, finds the methods and loads their
code without importing libcst (a third of ``import jax``).
"""

from __future__ import annotations

import dataclasses

OUTER_NAME = "__autostate_outer__"
RUNTIME_NAME = "__autostate__"
# The builtins whose call with a literal name is an attribute statement
# (``setattr(self, "x", v)``), unless the method's module or closure rebinds
# them. Here, libcst-free, so that a warm decoration can check them too.
ACCESS_BUILTINS = frozenset({"setattr", "getattr", "delattr", "hasattr", "object", "super"})
# Builtins that, called with no argument, list the calling function's locals
# by name (the rewrite drops the runtime's own name from what they give); with
# ``eval`` and ``exec`` (without namespaces of their own), the calls that see
# the running function's scope, around which a loop stays unrolled
# (``loop_facts.reads_scope``: the one list of them).
SCOPE_LISTERS = frozenset({"locals", "vars", "dir"})
SCOPE_READERS = SCOPE_LISTERS | {"eval", "exec"}
# Methods that change their object in place (``outs.append(x)``, ``d.__setitem__(k, v)``),
# the one list of them: on state the analysis refuses the named ones (a name
# is no type: a sub-model may have an ``update`` too, so only where no value
# of the attribute can be such an object, ``analysis.holds_plain_values``;
# ``__setitem__`` / ``__delitem__`` called by name on a state the run time
# threads), and a loop whose body changes a local by one is not rolled
# (``loop_facts``).
IN_PLACE_METHODS = frozenset(
    {"append", "extend", "insert", "pop", "remove", "clear", "update", "setdefault", "popitem",
     "sort", "reverse", "add", "discard", "fill", "resize", "itemset", "__setitem__", "__delitem__"}
)
# The runtime function of each in-place operator (``iadd`` for ``+=``): it
# follows ``__iadd__`` like Python, on a copy of a list, dict or set state.
INPLACE_OPERATORS = {
    "+": "iadd", "-": "isub", "*": "imul", "/": "itruediv", "//": "ifloordiv",
    "%": "imod", "**": "ipow", "@": "imatmul", "<<": "ilshift", ">>": "irshift",
    "&": "iand", "|": "ior", "^": "ixor",
}
# PyTorch's in-place tensor methods (the trailing underscore), each with what
# it means: name -> (its parameters after the tensor ``x``, the new value of
# ``x`` as a functional expression, how that value may be cast into ``x``'s
# dtype). The one table of the rule: the analysis makes ``self.x.<name>(...)``
# a write of state ``x``, the rewrite routes every call of one through the
# runtime, which compiles each expression once (``jnp`` is jax.numpy) and keeps
# ``x``'s shape and dtype as an in-place update does; errors and docs show the
# expression as the functional spelling. Casting ``"same_kind"`` refuses what
# PyTorch refuses (a float result into an int tensor); ``"unsafe"`` converts.
# What makes a view or an iterator of a container: a name bound to one
# (``vals = self.d.values()``, ``it = iter(self.lst)``) sees the container's
# later changes in place, as a name bound to the container itself does.
VIEW_METHODS = frozenset({"keys", "values", "items", "__iter__", "__reversed__"})
VIEW_BUILTINS = frozenset({"iter", "reversed", "enumerate", "zip", "map", "filter"})

INPLACE_TENSOR_METHODS: dict[str, tuple[str, str, str]] = {
    "add_": ("other, *, alpha=1", "x + alpha * other", "same_kind"),
    "sub_": ("other, *, alpha=1", "x - alpha * other", "same_kind"),
    "mul_": ("other", "x * other", "same_kind"),
    "div_": ("other", "x / other", "same_kind"),
    "pow_": ("exponent", "x ** exponent", "same_kind"),
    "neg_": ("", "-x", "same_kind"),
    "abs_": ("", "jnp.abs(x)", "same_kind"),
    "sqrt_": ("", "jnp.sqrt(x)", "same_kind"),
    "exp_": ("", "jnp.exp(x)", "same_kind"),
    "clamp_": ("min=None, max=None", "jnp.clip(x, min, max)", "same_kind"),
    "clamp_min_": ("min", "jnp.maximum(x, min)", "same_kind"),
    "clamp_max_": ("max", "jnp.minimum(x, max)", "same_kind"),
    "lerp_": ("end, weight", "x + weight * (end - x)", "same_kind"),
    "addcmul_": ("tensor1, tensor2, *, value=1", "x + value * tensor1 * tensor2", "same_kind"),
    "addcdiv_": ("tensor1, tensor2, *, value=1", "x + value * tensor1 / tensor2", "same_kind"),
    "copy_": ("src, non_blocking=False", "src", "unsafe"),
    "zero_": ("", "jnp.zeros_like(x)", "unsafe"),
    "fill_": ("value", "jnp.full_like(x, value)", "unsafe"),
    "masked_fill_": ("mask, value", "jnp.where(mask, value, x)", "unsafe"),
}


@dataclasses.dataclass(frozen=True)
class MethodSource:
    """One function defined in the class body, as found in its file.

    ``key`` says where the function sits in the class dict (``"step"``,
    ``"value.fset"``); ``attr`` is the class-dict name it belongs to.
    """

    key: str
    attr: str
    filename: str
    first_line: int
    text: str
    freevars: tuple[str, ...]
    has_receiver: bool
    # The class statement whose name private names were mangled with where the
    # function was written ("_": none), and the function's code name.
    mangle_as: str = ""
    code_name: str = ""
    # Names the function's code reads as globals that the wrapper would bind
    # as its locals (its own name, ``analysis.wrapper_source``).
    global_names: tuple[str, ...] = ()


def runtime_name(text: str) -> str:
    """The closure variable a rewritten function reaches the runtime through.

    ``RUNTIME_NAME``, unless the function's text spells it (a user's global,
    parameter or local of that name): then ``__autostate_1__``, ``_2__``, ...,
    the first it does not spell, so the runtime never hides a name of the
    user's. Identifiers are compared as Python reads them (NFKC); a match in
    a string or comment costs only the plainer name.
    """
    if not text.isascii():
        import unicodedata  # (rare: kept off the import of a warm start)

        text = unicodedata.normalize("NFKC", text)
    name, n = RUNTIME_NAME, 0
    while name in text:
        n += 1
        name = f"__autostate_{n}__"
    return name


def mangle(class_name: str, attr: str) -> str:
    """Python's private-name mangling of ``attr`` inside ``class_name``."""
    if not attr.startswith("__") or attr.endswith("__"):
        return attr
    stripped = class_name.lstrip("_")
    return f"_{stripped}{attr}" if stripped else attr


def is_dunder(attr: str) -> bool:
    """``__dict__``, ``__class__``, ...: Python's own attributes, never state.

    ``self.__dict__[k] = v`` writes the instance dict and ``self.__class__ =
    C`` changes the type; neither is a value the model holds, so neither
    becomes state (the run-time guard still watches what such code does
    inside a functionalized call).
    """
    return len(attr) > 4 and attr.startswith("__") and attr.endswith("__")
