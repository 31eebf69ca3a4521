"""Fidelity of ``@stateful`` (DESIGN section 3): a decorated class is the same
class, its rewritten methods keep everything a function carries, and errors
point at the user's own lines.
"""

from __future__ import annotations

import functools
import inspect
import pickle
import sys
import traceback
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autostate

# --- the same class object ----------------------------------------------------------

BODY_RUNS: list[str] = []


class Plain:
    BODY_RUNS.append("Plain")

    def __init__(self):
        self.x = jnp.array(0.0)

    def step(self):
        self.x += 1
        return self.x


UNDECORATED = Plain
DECORATED = autostate.stateful(Plain)


def test_decorated_class_is_the_same_object():
    assert DECORATED is UNDECORATED
    assert Plain.__name__ == "Plain"
    assert Plain.__qualname__ == "Plain"
    assert Plain.__module__ == __name__
    assert isinstance(Plain(), Plain)
    assert Plain.__autostate_info__.state == {"x"}


def test_class_body_is_not_executed_again():
    assert BODY_RUNS == ["Plain"]
    autostate.stateful(Plain)  # decorating twice is a no-op
    assert BODY_RUNS == ["Plain"]


def test_rewritten_method_carries_the_original_metadata():
    step = Plain.__dict__["step"]
    assert step.__name__ == "step"
    assert step.__qualname__ == "Plain.step"
    assert step.__module__ == __name__
    assert step.__code__.co_filename == __file__


# --- closures, super(), defaults -------------------------------------------------------


def make_closure_class(offset: float):
    factor = 10.0

    @autostate.stateful
    class Closed:
        def __init__(self):
            self.x = jnp.array(offset)

        def step(self, v):
            self.x = self.x * factor + v + offset
            return self.x

    def set_factor(value):
        nonlocal factor
        factor = value

    return Closed, set_factor


def test_closures_of_the_enclosing_function_are_kept():
    Closed, set_factor = make_closure_class(1.0)
    assert Closed.__qualname__ == "make_closure_class.<locals>.Closed"
    model = Closed()
    assert float(model.x) == 1.0
    assert float(model.step(2.0)) == 13.0  # 1 * 10 + 2 + 1
    # The rewritten method shares the closure cells: rebinding is seen.
    set_factor(0.0)
    assert float(model.step(2.0)) == 3.0
    f, states = Closed().functionalize()
    out, _ = jax.jit(lambda f, s: f.step(s, 1.0))(f, states)
    assert float(out) == 2.0  # 1 * 0 + 1 + 1
    other, _ = make_closure_class(5.0)
    assert float(other().step(0.0)) == 55.0


@autostate.stateful
class Base:
    def __init__(self, start=0.0):
        self.x = jnp.array(start)

    def step(self, v):
        self.x += v
        return self.x

    def describe(self):
        return "base"


@autostate.stateful
class Child(Base):
    def __init__(self, start=1.0, *, extra=2.0):
        super().__init__(start)
        self.y = jnp.array(extra)

    def step(self, v):
        out = super().step(v)
        self.y = self.y + out
        return self.y

    def describe(self):
        return "child of " + super().describe()


def test_zero_argument_super_in_rewritten_methods():
    model = Child()
    assert float(model.x) == 1.0 and float(model.y) == 2.0
    assert float(model.step(1.0)) == 4.0  # x = 2, y = 2 + 2
    assert float(model.x) == 2.0
    assert model.describe() == "child of base"
    assert Child.__dict__["step"].__closure__ is not None


def test_subclass_adds_its_own_state_and_base_state_keeps_working():
    assert Base.__autostate_info__.state == {"x"}
    assert Child.__autostate_info__.state == {"x", "y"}
    base = Base(3.0)
    assert float(base.step(1.0)) == 4.0
    f, states = Child().functionalize()
    assert sorted(states) == ["x", "y"]
    out, states = jax.jit(lambda f, s: f.step(s, 1.0))(f, states)
    assert float(out) == 4.0
    assert float(states["x"]) == 2.0 and float(states["y"]) == 4.0
    # The base class's own instances are unaffected by the subclass.
    _, base_states = Base(3.0).functionalize()
    assert list(base_states) == ["x"]


@autostate.stateful
class Defaults:
    def __init__(self, start: float = 1.0, *, scale: float = 2.0) -> None:
        """Builds the model."""
        self.x = jnp.array(start * scale)

    def step(self, v: float = 3.0, *, times: int = 2) -> jax.Array:
        """Adds ``v`` ``times`` times."""
        for _ in range(times):
            self.x += v
        return self.x


def test_default_and_keyword_only_defaults_are_kept():
    model = Defaults()
    assert float(model.x) == 2.0
    assert float(model.step()) == 8.0
    assert float(model.step(1.0, times=1)) == 9.0
    assert float(Defaults(2.0, scale=3.0).x) == 6.0
    step = Defaults.__dict__["step"]
    assert step.__defaults__ == (3.0,)
    assert step.__kwdefaults__ == {"times": 2}


def test_docstrings_and_annotations_are_kept():
    step = Defaults.__dict__["step"]
    assert step.__doc__ == "Adds ``v`` ``times`` times."
    assert Defaults.__init__.__doc__ == "Builds the model."
    assert step.__annotations__ == {"v": "float", "times": "int", "return": "jax.Array"}
    assert str(inspect.signature(Defaults.step)) == (
        "(self, v: 'float' = 3.0, *, times: 'int' = 2) -> 'jax.Array'"
    )


# --- method decorators -------------------------------------------------------------------

CALLS: list[str] = []


def logged(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        CALLS.append(fn.__name__)
        return fn(*args, **kwargs)

    return wrapper


@autostate.stateful
class Decorated:
    def __init__(self):
        self.x = jnp.array(1.0)
        self.value = 2.0

    @property
    def value(self):
        """The value."""
        return self.x * 10

    @value.setter
    def value(self, v):
        self.x = jnp.asarray(v)

    @staticmethod
    def double(v):
        return v * 2

    @classmethod
    def make(cls, v):
        model = cls()
        model.value = v
        return model

    @logged
    def step(self, v):
        """Logged step."""
        self.x = self.x + self.double(v)
        return self.x


def test_property_with_setter_is_rewritten_and_still_a_property():
    assert isinstance(Decorated.__dict__["value"], property)
    assert Decorated.__dict__["value"].__doc__ == "The value."
    model = Decorated()
    assert float(model.x) == 2.0
    assert float(model.value) == 20.0
    model.value = 3.0
    assert float(model.x) == 3.0


def test_staticmethod_and_classmethod_still_work():
    assert isinstance(Decorated.__dict__["double"], staticmethod)
    assert isinstance(Decorated.__dict__["make"], classmethod)
    assert Decorated.double(2.0) == 4.0
    model = Decorated.make(5.0)
    assert type(model) is Decorated
    assert float(model.x) == 5.0


def test_wraps_style_decorator_wraps_the_rewritten_function():
    CALLS.clear()
    model = Decorated()
    assert float(model.step(1.0)) == 4.0
    assert float(model.x) == 4.0
    assert CALLS == ["step"]
    assert Decorated.step.__doc__ == "Logged step."
    assert Decorated.step.__wrapped__.__code__.co_filename == __file__
    f, states = Decorated().functionalize()
    out, states = jax.jit(lambda f, s: f.step(s, 1.0))(f, states)
    assert float(out) == 4.0 and float(states["x"]) == 4.0
    assert CALLS == ["step", "step"]


# --- pickling -------------------------------------------------------------------------------


def test_pickle_class_by_reference():
    assert pickle.loads(pickle.dumps(Base)) is Base
    assert pickle.loads(pickle.dumps(Child)) is Child


def test_pickle_instance_keeps_state_and_behaviour():
    model = Child()
    model.step(1.0)
    clone = pickle.loads(pickle.dumps(model))
    assert type(clone) is Child
    assert float(clone.x) == 2.0 and float(clone.y) == 4.0
    assert float(clone.step(1.0)) == 7.0  # x = 3, y = 4 + 3
    assert float(model.y) == 4.0  # the original is independent
    f, states = clone.functionalize()
    assert sorted(states) == ["x", "y"]


def test_pickle_frozen_model():
    f, states = Base(1.0).functionalize()
    _, states = f.step(states, 2.0)
    frozen = autostate.freeze(f, states)
    clone = pickle.loads(pickle.dumps(frozen))
    assert float(clone.x) == 3.0
    assert float(clone.step(1.0)) == 4.0


# --- tracebacks and source ---------------------------------------------------------------


@autostate.stateful
class Raises:
    def __init__(self):
        self.x = jnp.array(1.0)

    def explicit(self, v):
        self.x = self.x + v
        raise ValueError(f"bad value {v}")

    def name_error(self, v):
        self.x += v
        self.x = self.x * undefined_name  # noqa: F821
        return self.x

    def on_rewritten_line(self, v):
        self.x = self.x + v[0]
        return self.x


def source_line(fn, marker: str) -> tuple[int, str]:
    lines, start = inspect.getsourcelines(fn)
    for offset, line in enumerate(lines):
        if marker in line:
            return start + offset, line.strip()
    raise LookupError(marker)


@pytest.mark.parametrize(
    "method, arg, exc, marker",
    [
        ("explicit", 1.0, ValueError, "raise ValueError"),
        ("name_error", 1.0, NameError, "undefined_name"),
        ("on_rewritten_line", 1.0, TypeError, "v[0]"),
    ],
)
def test_traceback_shows_the_original_file_line_and_text(method, arg, exc, marker):
    model = Raises()
    with pytest.raises(exc) as info:
        getattr(model, method)(arg)
    frames = traceback.extract_tb(info.value.__traceback__)
    user = [fr for fr in frames if fr.name == method]
    assert len(user) == 1
    frame = user[0]
    line, text = source_line(getattr(Raises, method), marker)
    assert frame.filename == __file__
    assert frame.lineno == line
    assert frame.line == text
    if exc is not TypeError:
        assert frames[-1] == frame
    # No frame of the rewritten code points anywhere but the user's file.
    assert all("<" not in fr.filename for fr in frames)


def test_formatted_traceback_shows_no_rewritten_code():
    model = Raises()
    with pytest.raises(NameError) as info:
        model.name_error(1.0)
    text = "".join(traceback.format_exception(info.value))
    line, source = source_line(Raises.name_error, "undefined_name")
    # A rewritten line has no column markers: the generated code's columns
    # would underline the wrong part of the user's line.
    assert f'File "{__file__}", line {line}, in name_error\n    {source}\nNameError' in text
    assert "__autostate__" not in text


def failing_helper(v):
    raise RuntimeError(f"helper got {v}")


@autostate.stateful
class RaisesOnPlainLine:
    def __init__(self):
        self.x = jnp.array(1.0)

    def step(self, v):
        self.x += 1
        y = 2 * failing_helper(v)
        return y


class PlainRaisesOnPlainLine:  # the same method, undecorated: what Python itself shows
    def __init__(self):
        self.x = jnp.array(1.0)

    def step(self, v):
        self.x += 1
        y = 2 * failing_helper(v)
        return y


def _markers_under(line: str, text: str) -> str:
    return text.split(f"    {line}\n", 1)[1].split("\n", 1)[0]


# Python 3.13 marks the call's primary part: `~` under the callee, `^` under the arguments.
CALL_MARKERS = "~~~~~~~~~~~~~~^^^" if sys.version_info >= (3, 13) else "^^^^^^^^^^^^^^^^^"


@pytest.mark.skipif(sys.version_info < (3, 11), reason="column positions are new in 3.11")
def test_unchanged_lines_of_a_rewritten_method_keep_their_column_markers():
    assert RaisesOnPlainLine.__dict__["step"].__code__ is not None
    with pytest.raises(RuntimeError) as info:
        RaisesOnPlainLine().step(1.0)
    frame = [fr for fr in traceback.extract_tb(info.value.__traceback__) if fr.name == "step"][0]
    assert frame.line == "y = 2 * failing_helper(v)"
    assert (frame.colno, frame.end_colno) == (16, 33)  # `failing_helper(v)`
    text = "".join(traceback.format_exception(info.value))
    assert f"    y = 2 * failing_helper(v)\n            {CALL_MARKERS}\n" in text
    with pytest.raises(RuntimeError) as plain:
        PlainRaisesOnPlainLine().step(1.0)
    plain_text = "".join(traceback.format_exception(plain.value))
    line = "y = 2 * failing_helper(v)"
    assert _markers_under(line, text) == _markers_under(line, plain_text)


def test_inspect_getsource_returns_the_original_text():
    text = inspect.getsource(Raises.name_error)
    assert text.splitlines()[0].strip() == "def name_error(self, v):"
    assert "self.x += v" in text and "__autostate__" not in text
    assert inspect.getsource(Child.__init__).strip().startswith("def __init__(self, start=1.0")
    assert "super().step(v)" in inspect.getsource(Child.step)
    assert inspect.getsource(Decorated.step).lstrip().startswith("@logged")


# --- class decorators, metaclasses, __init_subclass__ --------------------------------------


@functools.total_ordering
@autostate.stateful
class Ordered:
    def __init__(self, v):
        self.v = jnp.array(v)

    def bump(self):
        self.v += 1

    def __eq__(self, other):
        return float(self.v) == float(other.v)

    def __lt__(self, other):
        return float(self.v) < float(other.v)

    __hash__ = None


def test_total_ordering_on_top_of_stateful():
    a, b = Ordered(1.0), Ordered(2.0)
    assert a < b and a <= b and b > a and b >= a and a != b
    a.bump()
    assert a == b and a >= b
    assert Ordered.__autostate_info__.state == {"v"}


REGISTRY: dict[str, type] = {}


def register(cls):
    REGISTRY[cls.__name__] = cls
    cls.registered = True
    return cls


def add_reset(cls):
    def reset(self):
        self.count = jnp.zeros(())

    cls.reset = reset
    return cls


@register
@autostate.stateful
@add_reset
class Registered:
    def __init__(self):
        self.count = jnp.zeros(())

    def __call__(self):
        self.count += 1
        return self.count


def test_custom_class_decorators_before_and_after():
    assert REGISTRY["Registered"] is Registered and Registered.registered
    model = Registered()
    model()
    model()
    assert float(model.count) == 2.0
    model.reset()  # added by a decorator outside the class body: not rewritten
    assert float(model.count) == 0.0
    f, states = model.functionalize()
    _, states = f(states)
    assert float(states["count"]) == 1.0


class CountingMeta(type):
    created: list[str] = []
    instances = 0

    def __new__(mcs, name, bases, namespace):
        mcs.created.append(name)
        return super().__new__(mcs, name, bases, namespace)

    def __call__(cls, *args, **kwargs):
        CountingMeta.instances += 1
        return super().__call__(*args, **kwargs)


@autostate.stateful
class WithMeta(metaclass=CountingMeta):
    def __init__(self):
        self.x = jnp.zeros(())

    def step(self):
        self.x += 2
        return self.x


def test_metaclass_keeps_working():
    assert type(WithMeta) is CountingMeta
    assert CountingMeta.created.count("WithMeta") == 1
    before = CountingMeta.instances
    model = WithMeta()
    assert CountingMeta.instances == before + 1
    assert float(model.step()) == 2.0
    f, states = model.functionalize()
    out, _ = jax.jit(lambda f, s: f.step(s))(f, states)
    assert float(out) == 4.0


SUBCLASSES: list[str] = []


@autostate.stateful
class Plugin:
    def __init_subclass__(cls, tag: str = "", **kwargs: Any):
        super().__init_subclass__(**kwargs)
        SUBCLASSES.append(f"{cls.__name__}:{tag}")

    def __init__(self):
        self.hits = jnp.zeros(())

    def hit(self):
        self.hits += 1
        return self.hits


@autostate.stateful
class FirstPlugin(Plugin, tag="first"):
    def __init__(self):
        super().__init__()
        self.extra = jnp.ones(())

    def hit(self):
        self.extra *= 2
        return super().hit() + self.extra


def test_init_subclass_runs_once_per_subclass():
    assert SUBCLASSES == ["FirstPlugin:first"]
    model = FirstPlugin()
    assert float(model.hit()) == 3.0
    assert FirstPlugin.__autostate_info__.state == {"hits", "extra"}
    f, states = model.functionalize()
    out, states = jax.jit(lambda f, s: f.hit(s))(f, states)
    assert float(out) == 6.0
    np.testing.assert_array_equal(states["hits"], 2.0)


TAB_SOURCE = (
    "import jax.numpy as jnp\n"
    "import autostate\n"
    "\n"
    "@autostate.stateful\n"
    "class Tabbed:\n"
    "\tdef __init__(self):\n"
    "\t\tself.x = jnp.zeros(())\n"
    "\n"
    "\tdef step(self, v):\n"
    "\t\tself.x += v\n"
    '\t\ttext = """first\n'
    "\tsecond\n"
    '\t\tthird"""\n'
    "\t\tif v < 0:\n"
    "\t\t\traise ValueError(text)\n"
    "\t\treturn self.x, text\n"
)


def test_tab_indented_class(write_module):
    module = write_module(TAB_SOURCE)
    model = module.Tabbed()
    out, text = model.step(2.0)
    assert float(out) == 2.0
    assert text == "first\n\tsecond\n\t\tthird"
    with pytest.raises(ValueError) as info:
        model.step(-1.0)
    frame = traceback.extract_tb(info.value.__traceback__)[-1]
    assert (frame.filename, frame.lineno) == (module.__file__, 15)
    assert frame.line == "raise ValueError(text)"
    f, states = model.functionalize()

    def step(f, states):
        (out, _text), states = f.step(states, 1.0)
        return out, states

    out, states = jax.jit(step)(f, states)
    assert float(out) == 2.0 and float(states["x"]) == 2.0  # 2 - 1 before the raise, + 1
