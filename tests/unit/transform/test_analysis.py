"""Tests for ``autostate/transform/analysis.py``: which attributes are state.

Inference runs on source text, so it is tested twice: through decorated
classes (``autostate.tree.class_info(Cls).state``) and directly on ``MethodSource``s
with ``collect_facts`` / ``analyze_class``, which need no JAX.
"""

from __future__ import annotations

import asyncio
import re
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from semantics.harness import assert_user_line, check, pair, raises_autostate
from semantics.programs_shared import TWO_CALLS, Loader

import autostate
from autostate.errors import DecorationError
from autostate.transform import analysis
from autostate.transform.method import MethodSource


@autostate.stateful
class Inferred:
    def __init__(self, n):
        self.plain = jnp.zeros(n)
        self.aug = jnp.zeros(n)
        self.item = jnp.zeros(n)
        self.left, self.right = jnp.zeros(()), jnp.zeros(())
        self.first = self.second = jnp.zeros(())
        self.param = jnp.ones(n)
        self.config = 3

    def __call__(self, x):
        self.plain = x
        self.aug += x
        self.item[0] = x[0]
        self.left, self.right = x[0], x[1]
        self.first = self.second = x[2]
        return x * self.param * self.config


def test_state_is_what_non_init_methods_assign():
    assert autostate.tree.class_info(Inferred).state == {
        "plain",
        "aug",
        "item",
        "left",
        "right",
        "first",
        "second",
    }


def test_parameters_and_config_are_not_state():
    model = Inferred(3)
    _, states = model.functionalize()
    assert "param" not in states and "config" not in states
    assert sorted(states) == sorted(autostate.tree.class_info(Inferred).state)


def test_inferred_state_is_updated_by_a_call():
    model = Inferred(3)
    model(jnp.array([1.0, 2.0, 3.0]))
    np.testing.assert_allclose(model.plain, [1.0, 2.0, 3.0])
    np.testing.assert_allclose(model.aug, [1.0, 2.0, 3.0])
    np.testing.assert_allclose(model.item, [1.0, 0.0, 0.0])
    assert float(model.left) == 1.0 and float(model.right) == 2.0
    assert float(model.first) == 3.0 and float(model.second) == 3.0


@autostate.stateful
class OtherReceiver:
    def __init__(this):
        this.count = jnp.zeros(())
        this.scale = 2.0

    def __call__(me, x):
        me.count += 1
        return x * me.scale


def test_receiver_is_the_first_parameter_whatever_its_name():
    assert autostate.tree.class_info(OtherReceiver).state == {"count"}
    model = OtherReceiver()
    assert model(3.0) == 6.0
    model(3.0)
    assert float(model.count) == 2.0


@autostate.stateful
class Private:
    def __init__(self):
        self.__hidden = jnp.zeros(())

    def step(self):
        self.__hidden += 1
        return self.__hidden


def test_private_names_are_mangled():
    assert autostate.tree.class_info(Private).state == {"_Private__hidden"}
    model = Private()
    assert float(model.step()) == 1.0
    assert float(model._Private__hidden) == 1.0
    _, states = model.functionalize()
    assert list(states) == ["_Private__hidden"]


@autostate.stateful
class WithProperty:
    def __init__(self):
        self.total = jnp.zeros(())
        self.value = 5.0

    @property
    def value(self):
        return self.total

    @value.setter
    def value(self, v):
        self.total = v


def test_property_setter_assigns_state():
    assert autostate.tree.class_info(WithProperty).state == {"total"}
    assert isinstance(WithProperty.__dict__["value"], property)
    model = WithProperty()
    # __init__ went through the setter, so the state holds the value.
    assert float(model.total) == 5.0
    model.value = 7.0
    assert float(model.total) == 7.0
    _, states = model.functionalize()
    assert list(states) == ["total"]
    assert float(states["total"]) == 7.0


@autostate.stateful
class PropertyAssignedInMethod:
    def __init__(self):
        self.total = jnp.zeros(())
        self.value = 1.0

    @property
    def value(self):
        return self.total

    @value.setter
    def value(self, v):
        self.total = v

    def step(self):
        self.value = self.value + 1
        return self.value


def test_property_assigned_in_a_method_is_not_state_itself():
    # Assigning a property calls its setter, as in plain Python; the
    # property stays a property and only what the setter assigns is state.
    assert autostate.tree.class_info(PropertyAssignedInMethod).state == {"total"}
    assert isinstance(PropertyAssignedInMethod.__dict__["value"], property)
    model = PropertyAssignedInMethod()
    assert float(model.total) == 1.0
    assert float(model.step()) == 2.0
    assert float(model.total) == 2.0
    f, states = model.functionalize()
    out, states = jax.jit(lambda f, s: f.step(s))(f, states)
    assert float(out) == 3.0 and float(states["total"]) == 3.0


@autostate.stateful
class Declared:
    def __init__(self):
        self.kv = autostate.state(jnp.zeros(2), category="cache", name="kv_cache")
        self.seen = autostate.state(jnp.zeros(()), category="stats")
        self.counter = autostate.state(jnp.asarray(0))  # a python int would be static state
        self.weight = jnp.ones(2)
        self.steps = jnp.zeros(())

    def __call__(self, x):
        self.steps += 1
        return x * self.weight + self.kv


def test_state_declaration_makes_state_without_a_method_assigning_it():
    assert autostate.tree.class_info(Declared).state == {"kv", "seen", "counter", "steps"}


def test_declared_category_and_explicit_name_show_in_functionalize():
    model = Declared()
    _, states = model.functionalize()
    assert sorted(states) == ["counter", "kv_cache", "seen", "steps"]
    np.testing.assert_array_equal(states["kv_cache"], [0.0, 0.0])
    assert states["counter"] == 0
    assert sorted(model.functionalize("cache")[1]) == ["kv_cache"]
    assert sorted(model.functionalize("stats")[1]) == ["seen"]
    # Undeclared categories default to the class's category.
    assert sorted(model.functionalize("state")[1]) == ["counter", "steps"]
    picked = model.functionalize(category_predicate=lambda c: c in ("cache", "stats"))[1]
    assert sorted(picked) == ["kv_cache", "seen"]


def test_declared_state_reads_as_its_value_eagerly_and_functionalized():
    model = Declared()
    np.testing.assert_array_equal(model.kv, [0.0, 0.0])
    np.testing.assert_array_equal(model(jnp.ones(2)), [1.0, 1.0])
    f, states = model.functionalize()
    states = {**states, "kv_cache": jnp.array([1.0, 2.0])}
    out, new_states = jax.jit(lambda f, s, x: f(s, x))(f, states, jnp.ones(2))
    np.testing.assert_array_equal(out, [2.0, 3.0])
    np.testing.assert_array_equal(new_states["kv_cache"], [1.0, 2.0])
    assert float(new_states["steps"]) == 2.0


@autostate.stateful(category="buffers")
class ClassCategory:
    def __init__(self):
        self.a = jnp.zeros(())
        self.b = autostate.state(jnp.zeros(()), category="other")

    def step(self):
        self.a += 1


def test_class_category_applies_to_undeclared_states():
    model = ClassCategory()
    assert sorted(model.functionalize("buffers")[1]) == ["a"]
    assert sorted(model.functionalize("other")[1]) == ["b"]
    assert model.functionalize("state")[1] == {}


@autostate.stateful
class Nothing:
    def __init__(self):
        self.w = jnp.ones(2)

    def __call__(self, x):
        return x * self.w


def test_class_without_state_has_empty_state_set():
    assert autostate.tree.class_info(Nothing).state == frozenset()
    _, states = Nothing().functionalize()
    assert states == {}


def method(text: str, key: str | None = None, *, first_line: int = 10, freevars=()):
    """A MethodSource for ``text`` (a method written at class-body indentation)."""
    text = textwrap.indent(textwrap.dedent(text).lstrip("\n"), "    ")
    name = text.split("def ", 1)[1].split("(", 1)[0]
    key = key or name
    return analysis.MethodSource(
        key=key,
        attr=key.split(".")[0],
        filename="model.py",
        first_line=first_line,
        text=text,
        freevars=tuple(freevars),
        has_receiver=True,
    )


def analyze(class_name: str, *texts: str, **kwargs) -> analysis.ClassAnalysis:
    facts = [analysis.collect_facts(class_name, method(t)) for t in texts]
    return analysis.analyze_class(class_name, facts, **kwargs)


INIT_XYZ = """
def __init__(self):
    self.x = 0
    self.y = 0
    self.z = 0
"""


def test_collect_facts_records_assignment_kinds_and_lines():
    facts = analysis.collect_facts(
        "M",
        method(
            """
            def step(self, v):
                self.a = v
                self.b += v
                self.c[0] = v
                self.d[0] += v
                return self.e
            """,
            first_line=20,
        ),
    )
    assert facts.receiver == "self"
    kinds = [(a.attr, a.kind, a.line) for a in facts.assignments]
    assert kinds == [("a", "set", 21), ("b", "aug", 22), ("c", "item", 23), ("d", "item", 24)]
    assert facts.reads["e"] == 25
    assert not any(a.nested for a in facts.assignments)


def test_tuple_starred_chained_and_loop_targets_are_assignments():
    facts = analysis.collect_facts(
        "M",
        method(
            """
            def step(self, v):
                self.a, (self.b, self.c) = v
                self.d, *self.e = v
                self.f = self.g = v
                for self.i in v:
                    pass
                with v as self.w:
                    pass
            """
        ),
    )
    assert [a.attr for a in facts.assignments] == ["a", "b", "c", "d", "e", "f", "g", "i", "w"]


def test_analyze_class_infers_state_from_non_init_methods():
    result = analyze(
        "M",
        INIT_XYZ,
        """
        def step(self, v):
            self.x = v
            self.y += v
            self.z[0] = v
        """,
    )
    assert result.state == {"x", "y", "z"}


def test_init_only_assignments_are_not_state():
    result = analyze("M", INIT_XYZ, "def __call__(self, v):\n    return self.x + v\n")
    assert result.state == frozenset()


def test_receiver_named_differently_in_each_method():
    result = analyze(
        "M",
        "def __init__(me):\n    me.x = 0\n    me.y = 0\n",
        "def step(this, v):\n    this.x = v\n    self = v\n",
    )
    assert result.state == {"x"}


def test_other_names_than_the_receiver_are_not_state():
    result = analyze(
        "M",
        INIT_XYZ,
        """
        def step(self, other):
            other.x = 1
            self.y = other
        """,
    )
    assert result.state == {"y"}


def test_nested_function_shadowing_the_receiver_is_not_state():
    result = analyze(
        "M",
        INIT_XYZ,
        """
        def step(self, v):
            def helper(self):
                self.x = 1
            self.y = helper
        """,
    )
    assert result.state == {"y"}


def test_private_names_are_mangled_with_the_class_name():
    result = analyze(
        "_Model",
        "def __init__(self):\n    self.__x = 0\n",
        "def step(self):\n    self.__x += 1\n",
    )
    assert result.state == {"_Model__x"}
    assert analysis.mangle("_Model", "__x") == "_Model__x"
    assert analysis.mangle("Model", "__dunder__") == "__dunder__"
    assert analysis.mangle("___", "__x") == "__x"


def test_property_setter_key_counts_as_state_assignment():
    facts = [
        analysis.collect_facts("M", method("def __init__(self):\n    self.v = 1\n")),
        analysis.collect_facts("M", method("def v(self):\n    return self.h\n", key="v.fget")),
        analysis.collect_facts("M", method("def v(self, x):\n    self.h = x\n", key="v.fset")),
    ]
    result = analysis.analyze_class("M", facts)
    # __init__ assigns the property, whose setter initializes `h`.
    assert result.state == {"h"}


def test_state_declarations_are_resolved_by_the_caller():
    facts = [
        analysis.collect_facts(
            "M",
            method(
                """
                def __init__(self):
                    self.kv = autostate.state(0, name="kv")
                    self.other = make(0)
                """
            ),
        )
    ]
    assert facts[0].declarations == {
        "kv": ("autostate.state", facts[0].source.first_line + 1),
        "other": ("make", facts[0].source.first_line + 2),
    }
    result = analysis.analyze_class(
        "M", facts, is_state_declaration=lambda _facts, dotted: dotted == "autostate.state"
    )
    assert result.state == {"kv"}
    assert result.declared == {"kv": "autostate.state"}


def test_register_buffer_with_a_literal_name_declares_state():
    facts = [
        analysis.collect_facts(
            "M",
            method(
                """
                def __init__(self):
                    self.register_buffer("mask", make(), persistent=False)
                    self.register_buffer(name="scale", tensor=make())
                    self.register_buffer(computed, make())
                    self.weight = make()
                """
            ),
        )
    ]
    line = facts[0].source.first_line
    assert facts[0].buffers == {"mask": line + 1, "scale": line + 2}
    result = analysis.analyze_class("M", facts, declaring_methods=frozenset({"register_buffer"}))
    # Declared wherever the call is, as ``self.x = autostate.constant(v)``;
    # a computed name is checked at run time by ``Module.register_buffer``.
    assert result.state == {"mask", "scale"}
    assert {"mask", "scale", "weight"} <= result.initialized
    # A class whose register_buffer is its own: a plain call.
    assert analysis.analyze_class("M", facts).state == frozenset()


def test_inherited_state_and_initialization():
    result = analyze(
        "Child",
        "def step(self):\n    self.x += 1\n    self.y = 2\n",
        inherited_state=frozenset({"base"}),
        inherited_initialized=frozenset({"x", "y"}),
    )
    assert result.state == {"base", "x", "y"}


def test_state_initialized_by_a_method_called_from_init():
    result = analyze(
        "M",
        "def __init__(self):\n    self.reset()\n",
        "def reset(self):\n    self.x = 0\n",
        "def step(self):\n    self.x += 1\n",
    )
    assert result.state == {"x"}


def test_analysis_error_carries_the_method_line():
    with pytest.raises(DecorationError) as info:
        analyze("M", "def __init__(self):\n    pass\n", "def step(self):\n    self.x = 1\n")
    # method() puts the def on line 10, so the assignment is on line 11.
    assert "model.py:11" in str(info.value)
    assert "'x'" in str(info.value)


def test_wrapper_source_keeps_the_method_on_its_line():
    src = method("def step(self):\n    return 1\n", first_line=7)
    text, shift = analysis.wrapper_source("M", src)
    assert shift == 4
    assert text.splitlines()[7 - shift - 1] == "    def step(self):"
    early = method("def step(self):\n    return 1\n", first_line=1)
    text, shift = analysis.wrapper_source("M", early)
    assert shift == -2
    assert text.splitlines()[2] == "    def step(self):"


def test_wrapper_source_does_not_grow_with_the_line_number():
    # libcst parses every line it is given; padding made decoration slower
    # the further down its file a class sits.
    near = analysis.wrapper_source("M", method("def step(self):\n    return 1\n", first_line=7))
    far = analysis.wrapper_source("M", method("def step(self):\n    return 1\n", first_line=3007))
    assert near[0] == far[0]
    assert far[1] - near[1] == 3000


@autostate.stateful
class PropertyChild(WithProperty):
    def step(self):
        self.value = self.value * 2
        return self.value


def test_inherited_property_assigned_in_a_subclass_method_is_not_state():
    assert autostate.tree.class_info(PropertyChild).state == {"total"}
    assert "value" not in PropertyChild.__dict__
    model = PropertyChild()
    assert float(model.step()) == 10.0
    assert float(model.total) == 10.0
    f, states = model.functionalize()
    out, states = jax.jit(lambda f, s: f.step(s))(f, states)
    assert float(out) == 20.0 and float(states["total"]) == 20.0


def test_a_comprehension_binding_the_receiver_name_does_not_rebind_it():
    facts = analysis.collect_facts(
        "M",
        method(
            """
            def total(self, others):
                self.n = self.n + 1
                return sum(self.n for self in others)
            """
        ),
    )
    assert facts.rebinds == []
    result = analysis.analyze_class("M", [analysis.collect_facts("M", method(INIT_XYZ.replace("x", "n"))), facts])
    assert result.state == {"n"}


def test_identifiers_are_nfkc_normalized_as_python_binds_them():
    facts = analysis.collect_facts(
        "M",
        method(
            """
            def ﬁt(ſelf):
                ſelf.µ = ſelf.µ + 1
            """
        ),
    )
    assert facts.receiver == "self"
    assert [a.attr for a in facts.assignments] == ["μ"]  # U+00B5 -> U+03BC


def test_private_names_mangle_with_the_class_the_function_was_written_in():
    source = method(
        """
        def bump(self):
            self.__n = 1
        """
    )
    inside = analysis.collect_facts("M", source)
    outside = analysis.collect_facts("M", dataclasses_replace(source, mangle_as="_"))
    assert [a.attr for a in inside.assignments] == ["_M__n"]
    assert [a.attr for a in outside.assignments] == ["__n"]


def dataclasses_replace(source, **changes):
    import dataclasses

    return dataclasses.replace(source, **changes)


def test_a_module_level_function_is_wrapped_at_its_own_indentation():
    source = analysis.MethodSource(
        key="log", attr="log", filename="helpers.py", first_line=3,
        text="def external(self, x):\n    self.count = x\n", freevars=(), has_receiver=True,
        mangle_as="_",
    )
    facts = analysis.collect_facts("M", source)
    assert [(a.attr, a.line) for a in facts.assignments] == [("count", 4)]


def assert_at(err: BaseException, marker: str) -> None:
    """The error names a line of the test's module holding ``marker``."""
    found = re.search(r"  at (\S+?):(\d+)", str(err))
    assert found, f"no file:line in: {err}"
    path = found.group(1)
    assert "autostate_testmod" in path, f"not the user's file: {path}"
    assert_user_line(err, path)
    text = Path(path).read_text().splitlines()[int(found.group(2)) - 1]
    assert marker in text, f"{marker!r} is not on the line the error names: {text!r}"


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


# ---------------------------------------------------------------------------
# PyTorch's in-place tensor methods (``method.INPLACE_TENSOR_METHODS``)


def test_inplace_tensor_methods_are_writes_of_their_attribute():
    facts = analysis.collect_facts(
        "M",
        method(
            """
            def step(self, v, h):
                self.a.mul_(v)
                self.b[0].add_(v, alpha=2)
                self.c.mul_(v).add_(v)
                y = self.d.zero_() + self.e.sum()
                self.sub.f.fill_(1.0)
                h.copy_(v)
            """,
            first_line=20,
        ),
    )
    kinds = [(a.attr, a.kind, a.line) for a in facts.assignments]
    assert kinds == [
        ("a", "inplace", 21), ("b", "inplace", 22), ("c", "inplace", 23), ("c", "inplace", 23),
        ("d", "inplace", 24),
    ]
    assert facts.updates_in_place and facts.alias_problem is None
    assert facts.mutating_calls == []  # (not a container's in-place method)


def test_inplace_update_makes_state_as_an_assignment_does():
    result = analyze(
        "M", INIT_XYZ, "def step(self, v):\n    self.x.mul_(v)\n    self.y[0].clamp_(min=0)\n"
    )
    assert result.state == {"x", "y"}
    # In __init__ (a parameter set up in place) it makes no state.
    init = "def __init__(self):\n    self.x = 0\n    self.x.zero_()\n"
    assert analyze("M", init, "def f(self):\n    return self.x\n").state == frozenset()


def test_one_table_names_the_inplace_methods_and_no_container_method():
    from autostate.transform.method import IN_PLACE_METHODS, INPLACE_TENSOR_METHODS

    assert {"mul_", "add_", "sub_", "div_", "copy_", "zero_", "fill_", "clamp_"} <= set(
        INPLACE_TENSOR_METHODS
    )
    assert all(name.endswith("_") and not name.startswith("_") for name in INPLACE_TENSOR_METHODS)
    assert not set(INPLACE_TENSOR_METHODS) & IN_PLACE_METHODS
    assert {"append", "update", "__setitem__", "__delitem__"} <= IN_PLACE_METHODS
    from autostate.transform import loops

    # One list: the rolling keeps none of its own (it reads the analysis's loop facts).
    assert not any(isinstance(v, frozenset) and "append" in v for v in vars(loops).values())


@pytest.mark.parametrize(
    ("body", "line", "needle"),
    [
        ("m = self.x\nself.x.mul_(2)\nreturn m", 12, "local `m` is bound to it"),
        ("m = self.x[0]\nself.x.mul_(2).add_(1)\nreturn m", 12, "local `m`"),
        ("m = self.x.mul_(2)\nself.x.add_(1)\nreturn m", 12, "local `m`"),
        ("n = self.x\nm = n\nself.x.mul_(2)\nreturn m", 13, "local `m`"),
        ("m = self.x\nm.mul_(2)", 12, "call it on the attribute: `self.x.mul_(...)`"),
        ("m = self.x\nfor i in range(3):\n    y = m + i\n    self.x.mul_(2)", 14, "local `m`"),
        ("m = self.sub.x\nself.sub.x.zero_()\nreturn m", 12, "`self.sub.x.zero_(...)`"),
        # An item assignment changes a list, a dict or a tensor in place too.
        ("m = self.x\nself.x[0] = 1\nreturn m", 12, "Assigning an item of `self.x`"),
        ("m = self.x\nself.x['k'] += 1\nreturn m", 12, "local `m` is bound to it"),
        ("m = self.x\nself.x[0], self.y = 1, 2\nreturn m", 12, "local `m`"),
        ("m = self.x\nfor i in range(3):\n    y = m[0]\n    self.x[0] = i", 14, "local `m`"),
        ("m, n = self.x, 1\nself.x.mul_(2)\nreturn m", 12, "local `m`"),  # unpacked
        ("m = self.x[0]\nself.x[0][1] = 1\nreturn m", 12, "(to a container within it)"),
        ("m = self.x[i]\nself.x[0]['k'] = 1\nreturn m", 12, "local `m`"),  # may be the same
        ("m = self.x.values()\nself.x['k'] = 1\nreturn list(m)", 12, "local `m`"),  # a view
        ("m = iter(self.x)\nself.x[1] = 1\nreturn next(m)", 12, "local `m`"),  # an iterator
        ("m = enumerate(self.x)\nself.x[1] += 1\nreturn list(m)", 12, "local `m`"),
        # A loop's own iterator, read at every step.
        ("for v in self.x:\n    self.x[0] = v", 12, "inside the `for` loop (line 11)"),
        ("for k, v in self.x.items():\n    self.x['b'] = v", 12, "`list(self.x.items())`"),
        ("m = self.x\ndel self.x[0]\nreturn m", 12, "Deleting an item of `self.x`"),
        ("for i, v in enumerate(self.x):\n    del self.x[i]", 12, "inside the `for` loop"),
    ],
)
def test_inplace_update_seen_by_a_local_alias_is_refused_at_its_line(body, line, needle):
    text = "def step(self):\n" + textwrap.indent(body, "    ") + "\n"
    with pytest.raises(DecorationError) as info:
        analyze("M", INIT_XYZ, text)
    message = str(info.value)
    assert f"model.py:{line} (in M.step)" in message, message
    assert needle in message and "fix:" in message


@pytest.mark.parametrize(
    "body",
    [
        "m = self.x\ny = m + 1\nself.x.mul_(2)\nreturn y",  # read before the update
        "m = self.x\nself.x.mul_(2)\nm = self.x\nreturn m",  # rebound after it
        "m = self.x.sum()\nself.x.mul_(2)\nreturn m",  # a new value, no alias
        "for i in range(3):\n    m = self.x\n    y = m + i\nself.x.mul_(2)",  # loop before it
        "m = self.x\nself.x = self.x * 2\nreturn m",  # a functional write
        "m = self.x[0]\nself.x[0] = 1\nreturn m",  # a list's old item, not the list
        "m = self.x[1]\nself.x[0][0] = 1\nreturn m",  # another item's container
        "m = list(self.x.values())\nself.x['k'] = 1\nreturn m",  # a new list of them
        "for i, v in enumerate(self.x):\n    self.x[i] = v",  # the step's own index
        "for k, v in self.x.items():\n    self.x[k] += v",  # the step's own key
        "for v in list(self.x):\n    self.x[0] = v",  # a copy
        "m = self.x\ny = m[0]\nself.x[0] = 1\nreturn y",  # read before the item assignment
        "m = self.x\nself.x.mul_(2)\nreturn [m for m in range(2)], (lambda m: m)(1)",  # own names
    ],
)
def test_inplace_update_with_no_alias_reading_it_is_accepted(body):
    text = "def step(self):\n" + textwrap.indent(body, "    ") + "\n"
    assert analyze("M", INIT_XYZ, text).state == {"x"}


@pytest.mark.parametrize(
    ("init", "step", "needle"),
    [
        ("self.y = self.x", "self.x[0] = 1", "`self.y` would see every such update"),
        ("self.y = self.x", "self.y[0] = 1", "`self.x` would see every such update"),
        ("self.y = self.x[0]", "self.x[0][1] = 1", "`self.y = self.x[0]` keeps a second"),
    ],
)
def test_item_assignment_of_a_state_another_attribute_keeps_is_refused(init, step, needle):
    text = f"def __init__(self):\n    self.x = [0]\n    {init}\n    self.z = 0\n"
    with pytest.raises(DecorationError) as info:
        analyze("M", text, f"def step(self):\n    {step}\n")
    message = str(info.value)
    assert needle in message and "model.py:12 (in M.__init__)" in message, message
    assert "list(self.x)" in message


@pytest.mark.parametrize("step", ["self.x[0] = 1", "self.x[1][0] = 1"])
def test_item_assignment_of_a_state_an_attribute_keeps_an_item_of_is_accepted(step):
    init = "def __init__(self):\n    self.x = [0]\n    self.y = self.x[0]\n    self.z = 0\n"
    assert analyze("M", init, f"def step(self):\n    {step}\n").state == {"x"}


def test_inplace_update_of_a_state_another_attribute_keeps_is_refused():
    init = "def __init__(self):\n    self.x = 0\n    self.y = self.x\n    self.z = 0\n"
    with pytest.raises(DecorationError) as info:
        analyze("M", init, "def step(self):\n    self.x.mul_(2)\n")
    message = str(info.value)
    assert "`self.y = self.x` keeps a second reference to state 'x'" in message
    assert "model.py:12 (in M.__init__)" in message and "jnp.array(self.x)" in message
