"""The families behind hunt 12's analysis bugs (``test_fidelity_hunt12.py``).

- A method naming a global of its own name (``def relu(self, x): return
  relu(x)``), sync, async, static, private, or closing over a free variable
  of that name.
- Any indentation: one space, tabs, a form feed before a method or a
  statement, a body indented by a tab under a space-indented ``def``.
- Every form that binds the receiver's name in the method (``except ... as``,
  match captures of each kind, imports, ``del``, a nested ``def`` / ``class``
  of that name, ``nonlocal`` in a nested function) is a decoration error at
  its line; the same forms inside a nested function (or lambda, or class
  body) bind a name of that scope and work as in plain Python.
- A class-body helper used as a decorator is no method.
- ``__init__`` running a method through its class or a bound method.
- The ``__slots__`` error of a class without functions names its line.
"""

from __future__ import annotations

import asyncio
import re
import types
from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp
import pytest
from differential import assert_user_line, check, pair, raises_autostate  # noqa: I001

from autostate.errors import DecorationError
from autostate.transform import analysis, source
from autostate.transform.method import MethodSource

Loader = Callable[..., types.ModuleType]

X1 = jnp.float32(1.5)
X2 = jnp.float32(-2.0)
TWO_CALLS = [("__call__", (X1,)), ("__call__", (X2,))]


def assert_at(err: BaseException, marker: str) -> None:
    """The error names a line of the test's module holding ``marker``."""
    found = re.search(r"  at (\S+?):(\d+)", str(err))
    assert found, f"no file:line in: {err}"
    path = found.group(1)
    assert "autostate_testmod" in path, f"not the user's file: {path}"
    assert_user_line(err, path)
    text = Path(path).read_text().splitlines()[int(found.group(2)) - 1]
    assert marker in text, f"{marker!r} is not on the line the error names: {text!r}"


# --- 1. a global named like the method ------------------------------------------------

OWN_NAME_GLOBALS = """
from jax.nn import relu

async def later():
    return 7

def _Own__hidden(x):
    return x * 3

@DECORATE
class Own:
    def __init__(self):
        self.c = jnp.zeros(())
    def __call__(self, x):
        self.c = self.c + 1
        return self.relu(x) + self.c + self.scaled(x) + self.__hidden(x)
    def relu(self, x):
        return relu(x)
    @staticmethod
    def scaled(x):
        return scaled(x)
    def __hidden(self, x):
        return __hidden(x)
    async def later(self):
        return await later()

def scaled(x):
    return 2 * x
"""


def test_methods_calling_globals_of_their_own_names(write_module: Loader) -> None:
    plain, dec = pair(write_module, OWN_NAME_GLOBALS)
    check(plain, dec, "Own()", TWO_CALLS)
    assert asyncio.run(dec.Own().later()) == asyncio.run(plain.Own().later()) == 7


OWN_NAME_FREE_VARIABLE = """
def make():
    def step(x):
        return x + 10

    @DECORATE
    class Closed:
        def __init__(self):
            self.c = jnp.zeros(())
        def __call__(self, x):
            self.c = self.c + x
            return self.step(self.c)
        def step(self, x):
            return step(x)
    return Closed

Closed = make()
"""


def test_a_free_variable_named_like_the_method_stays_a_closure_variable(
    write_module: Loader,
) -> None:
    check(*pair(write_module, OWN_NAME_FREE_VARIABLE), "Closed()", TWO_CALLS)


def test_the_wrapper_declares_the_method_name_global_unless_it_is_free() -> None:
    def source(freevars: tuple[str, ...]) -> MethodSource:
        return MethodSource(
            key="relu",
            attr="relu",
            filename="m.py",
            first_line=10,
            text="    def relu(self, x):\n        return relu(x)\n",
            freevars=freevars,
            has_receiver=True,
            mangle_as="M",
            code_name="relu",
            global_names=("relu",),
        )

    text, shift = analysis.wrapper_source("M", source(()))
    assert "    global relu\n" in text
    assert text.splitlines()[10 - shift - 1] == "    def relu(self, x):"
    text, shift = analysis.wrapper_source("M", source(("relu",)))
    assert "global" not in text
    assert text.splitlines()[10 - shift - 1] == "    def relu(self, x):"


def test_only_a_method_reading_a_global_of_its_name_gets_the_declaration(
    write_module: Loader,
) -> None:
    module = write_module(
        """
relu = abs

class Plain:
    def relu(self, x):
        return [relu(v) for v in x]
    def __hidden(self):
        return __hidden
    def step(self, x):
        return self.relu(x)
"""
    )
    found = {
        s.key: source.method_source(module.Plain, s).global_names
        for s in source.find_methods(module.Plain)
    }
    assert found == {"relu": ("relu",), "_Plain__hidden": ("__hidden",), "step": ()}


# --- 2. indentation -----------------------------------------------------------------------

ONE_SPACE_BLOCKS = (
    "\n@DECORATE\nclass Narrow:\n"
    " def __init__(self):\n"
    "  self.c = jnp.zeros(())\n"
    " def __call__(self, v):\n"
    "  '''a docstring\n kept as written'''\n"
    "  for i in range(2):\n"
    "   if i:\n"
    "    self.c = self.c + v\n"
    "   else:\n"
    "   \tself.c = self.c * 2\n"
    "  return self.c, len(Narrow.__call__.__doc__)\n"
)

FORM_FEEDS = (
    "\n@DECORATE\nclass Paged:\n"
    "\x0c    def __init__(self):\n"
    "        self.c = jnp.zeros(())\n"
    "    def __call__(self, v):\n"
    "\x0c        self.c = self.c + v\n"
    "        if True:\n"
    "  \x0c          self.c = self.c * 2\n"
    "        return self.c\n"
)

TAB_BODY_UNDER_SPACES = (
    "\n@DECORATE\nclass Mixed:\n"
    "  def __init__(self):\n"
    "  \tself.c = jnp.zeros(())\n"
    "  def __call__(self, v):\n"
    "  \tfor i in range(2):\n"
    "  \t  self.c = self.c + v\n"
    "  \treturn self.c\n"
)

MODULE_LEVEL_FUNCTION = """
def step(self, v):
    self.c = self.c + v
    return self.c

@DECORATE
class Assigned:
    def __init__(self):
        self.c = jnp.zeros(())
    __call__ = step
"""


@pytest.mark.parametrize(
    ("source", "build"),
    [
        pytest.param(ONE_SPACE_BLOCKS, "Narrow()", id="one-space-nested-blocks"),
        pytest.param(FORM_FEEDS, "Paged()", id="form-feeds"),
        pytest.param(TAB_BODY_UNDER_SPACES, "Mixed()", id="tab-body-under-spaces"),
        pytest.param(MODULE_LEVEL_FUNCTION, "Assigned()", id="module-level-function"),
    ],
)
def test_indentations(write_module: Loader, source: str, build: str) -> None:
    check(*pair(write_module, source), build, TWO_CALLS)


# --- 3. binding the receiver's name ----------------------------------------------------

REBIND_HEAD = """
class Box:
    def __init__(self):
        self.c = 100.0

@DECORATE
class Rebind:
    def __init__(self):
        self.c = jnp.zeros(())
    def __call__(self, x):
        self.c = self.c + x
        return self.c
    def poke(self, v):
        y = self.c
"""


@pytest.mark.parametrize(
    "statement",
    [
        "try:\n            raise ValueError()\n        except ValueError as self:  # HERE\n"
        "            pass",
        "try:\n            raise ValueError()\n        except* ValueError as self:  # HERE\n"
        "            pass",
        "match v:\n            case self:  # HERE\n                pass",
        "match Box():\n            case Box() as self:  # HERE\n                pass",
        "match [v]:\n            case [*self]:  # HERE\n                pass",
        "match {}:\n            case {**self}:  # HERE\n                pass",
        "match Box():\n            case Box(c=self):  # HERE\n                pass",
        "import math as self  # HERE",
        "from math import pi as self  # HERE",
        "import self  # HERE",
        "del self  # HERE",
        "def self(): pass  # HERE",
        "class self: pass  # HERE",
        "def inner():\n            nonlocal self\n            self = Box()  # HERE",
        "(lambda: 0) if (self := v) else 0  # HERE",
    ],
    ids=[
        "except-as",
        "except-star-as",
        "match-capture",
        "match-as",
        "match-star",
        "match-mapping-rest",
        "match-class-keyword",
        "import-as",
        "from-import-as",
        "import",
        "del",
        "nested-def",
        "nested-class",
        "nonlocal-in-nested",
        "walrus",
    ],
)
def test_each_form_rebinding_the_receiver_is_an_error_at_its_line(
    write_module: Loader, statement: str
) -> None:
    with raises_autostate(DecorationError) as info:
        pair(write_module, REBIND_HEAD + "        " + statement + "\n")
    assert "rebound" in str(info.value)
    assert "fix:" in str(info.value)
    assert_at(info.value, "# HERE")


NESTED_SCOPES = """
import math

class Box:
    def __init__(self):
        self.c = 100.0

self = Box()

@DECORATE
class Scoped:
    def __init__(self):
        self.c = jnp.zeros(())
    def __call__(self, v):
        self.c = self.c + v
        return self.c + self.peeks()
    def peeks(self):
        def assigned():
            self = Box()
            return self.c
        def looped():
            for self in [Box()]:
                return self.c
        def caught():
            try:
                raise ValueError()
            except ValueError as self:
                return len(self.args)
        def matched():
            match Box():
                case Box() as self:
                    return self.c
        def imported():
            import math as self
            return self.pi
        def declared_global():
            global self
            return self.c
        def deleted():
            self = Box()
            del self
            return 1.0
        class Body:
            self = Box()
            c = self.c
        walrus = lambda: (self := Box()).c
        return (
            assigned() + looped() + caught() + matched() + imported() + declared_global()
            + deleted() + Body.c + walrus() + self.c
        )
"""


def test_binding_forms_in_nested_scopes_bind_their_own_names(write_module: Loader) -> None:
    check(*pair(write_module, NESTED_SCOPES), "Scoped()", TWO_CALLS)


def test_a_nested_class_body_binding_the_name_hides_the_receiver_only_in_its_body() -> None:
    source = MethodSource(
        key="step",
        attr="step",
        filename="m.py",
        first_line=10,
        text=(
            "    def step(self):\n"
            "        class Body:\n"
            "            self = 1\n"
            "            def read(other):\n"
            "                return self.c\n"
            "        self.c = self.c + 1\n"
        ),
        freevars=(),
        has_receiver=True,
    )
    facts = analysis.collect_facts("M", source)
    assert facts.rebinds == []
    assert [(a.attr, int(a.line), a.nested) for a in facts.assignments] == [("c", 15, False)]
    # ``self.c`` in the method of the nested class reads the receiver (line 14).
    assert int(facts.reads["c"]) == 14


# --- 4. class-body helpers used as decorators ----------------------------------------------

HELPERS = """
@DECORATE
class Tagged:
    def _tag(fn):
        fn.tagged = True
        return fn

    def _label(text):
        def apply(fn):
            fn.label = text
            return fn
        return apply

    def __init__(self):
        self.c = jnp.zeros(())

    @_tag
    @_label("step")
    def __call__(self, x):
        self.c = self.c + x
        return self.c

    def labels(self):
        return Tagged.__call__.tagged, Tagged.__call__.label
"""


def test_class_body_helpers_used_as_decorators_are_not_methods(write_module: Loader) -> None:
    plain, dec = pair(write_module, HELPERS)
    check(plain, dec, "Tagged()", TWO_CALLS)
    check(plain, dec, "Tagged()", [("labels", ())], modes=("eager",))
    assert dec.Tagged().functionalize()[1].keys() == {"c"}


HELPER_IN_BASE = """
class Base:
    def _tag(fn):
        fn.tagged = True
        return fn

    @_tag
    def double(self):
        return self.c * 2

@DECORATE
class Child(Base):
    def __init__(self):
        self.c = jnp.ones(())
    def __call__(self, x):
        self.c = self.c + x
        return self.double()
"""


def test_a_helper_decorator_of_an_undecorated_base_is_not_a_method(write_module: Loader) -> None:
    check(*pair(write_module, HELPER_IN_BASE), "Child()", TWO_CALLS)


# --- 5. __init__ running a method through its class or a bound method -----------------------


@pytest.mark.parametrize(
    "call",
    [
        "type(self).reset(self)",
        "Resettable.reset(self)",
        "self.__class__.reset(self)",
        "r = self.reset; r()",
        "functools.partial(self.reset)()",
        "[f() for f in (self.reset,)]",
    ],
)
def test_init_running_a_method_however_it_is_reached(write_module: Loader, call: str) -> None:
    source = f"""
@DECORATE
class Resettable:
    def __init__(self):
        {call}
    def reset(self):
        self.c = jnp.zeros(())
    def __call__(self, x):
        self.c = self.c + x
        return self.c
"""
    check(*pair(write_module, source), "Resettable()", TWO_CALLS)


def test_a_state_no_method_run_by_init_assigns_is_still_an_error(write_module: Loader) -> None:
    source = """
@DECORATE
class Late:
    def __init__(self):
        self.reset  # read, so followed: it assigns only `d`
    def reset(self):
        self.d = jnp.zeros(())
    def __call__(self, x):
        self.c = x  # HERE
        self.d = self.d + x
        return self.c
"""
    with raises_autostate(DecorationError) as info:
        pair(write_module, source)
    assert "first assigned outside __init__" in str(info.value)
    assert_at(info.value, "# HERE")


# --- 6. the __slots__ error names the class statement -----------------------------------------


def test_slots_error_of_a_decorated_class_without_functions_names_its_line(
    write_module: Loader,
) -> None:
    source = """
@DECORATE
class OnlySlots:  # HERE
    __slots__ = ("c",)
"""
    with raises_autostate(DecorationError) as info:
        pair(write_module, source)
    assert "__slots__" in str(info.value)
    assert_at(info.value, "# HERE")
