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
from pathlib import Path
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
    assert autostate.tree.class_info(Plain).state == {"x"}


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
    assert autostate.tree.class_info(Base).state == {"x"}
    assert autostate.tree.class_info(Child).state == {"x", "y"}
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
    assert autostate.tree.class_info(Ordered).state == {"v"}


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
    assert autostate.tree.class_info(FirstPlugin).state == {"hits", "extra"}
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


# --- every function that can run as a method; the run-time guard (issue 11) ---------------

jit_call = jax.jit(lambda f, s, *a: f(s, *a))
jit_method = functools.partial(jax.jit, static_argnums=0)


def _twice(write_module, source: str, cls_name: str):
    """The classes of ``source`` twice: plain Python, and decorated."""
    plain = getattr(write_module(source), cls_name)
    module = write_module(source)
    return plain, autostate.stateful(getattr(module, cls_name)), module


HIDDEN_METHODS = """
import functools
import jax.numpy as jnp


def logged(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


def twice(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


def external(self, x):
    self.count = self.count + 1
    return x * self.count


def make_method(step):
    def inc(self, x):
        self.count = self.count + step
        return x * self.count
    return inc


class CountMixin:
    def bump(self, x):
        self.count = self.count + 1
        return x * self.count


class Wrapped:
    def __init__(self):
        self.count = jnp.zeros(())

    @twice
    @logged
    def __call__(self, x):
        self.count = self.count + 1
        return x * self.count


class Assigned:
    def __init__(self):
        self.count = jnp.zeros(())

    __call__ = external


class Factory:
    def __init__(self):
        self.count = jnp.zeros(())

    __call__ = make_method(2)


class Mixed(CountMixin):
    def __init__(self):
        self.count = jnp.zeros(())

    def __call__(self, x):
        return self.bump(x)
"""


@pytest.mark.parametrize("name", ["Wrapped", "Assigned", "Factory", "Mixed"])
def test_methods_analysis_reads_only_indirectly_still_write_state(write_module, name):
    plain_cls, cls, _ = _twice(write_module, HIDDEN_METHODS, name)
    plain = plain_cls()
    expected = [float(plain(1.0)) for _ in range(2)]
    assert "count" in autostate.tree.class_info(cls).state
    eager = cls()
    assert [float(eager(1.0)) for _ in range(2)] == expected
    f, states = cls().functionalize()
    outs = []
    for _ in range(2):
        out, states = jit_call(f, states, 1.0)
        outs.append(float(out))
    assert outs == expected
    assert float(states["count"]) == float(plain.count)


def test_an_assigned_function_outside_the_class_is_left_unchanged(write_module):
    _, cls, module = _twice(write_module, HIDDEN_METHODS, "Assigned")
    autostate.tree.class_info(cls)  # installed (at the class's first use)
    assert cls.__dict__["__call__"] is not module.external  # a rewritten copy
    assert module.external.__code__.co_filename == cls.__dict__["__call__"].__code__.co_filename


HELPER_WRITES = """
import jax.numpy as jnp


def bump(m):
    m.count = m.count + 1


class NoStates:
    def __init__(self):
        self.w = jnp.ones(())
        self.count = 0

    def __call__(self, x):
        bump(self)
        return x * self.w + self.count
"""


def test_a_helper_writing_a_non_state_is_refused_whatever_the_states(write_module):
    plain_cls, cls, _ = _twice(write_module, HELPER_WRITES, "NoStates")
    plain = plain_cls()
    assert [float(plain(1.0)) for _ in range(2)] == [2.0, 3.0]
    eager = cls()
    assert [float(eager(1.0)) for _ in range(2)] == [2.0, 3.0]  # eager is plain Python
    f, states = cls().functionalize()
    assert states == {}
    # Empty states, traced or concrete: refused, never a silently constant count.
    for call in (lambda: jit_call(f, states, 1.0), lambda: f(states, 1.0)):
        with pytest.raises(autostate.errors.StateAccessError) as info:
            call()
        message = str(info.value)
        assert "NoStates.count is not state" in message
        assert "self.count = autostate.state(...)" in message


def test_no_tracer_is_left_in_f_after_a_refused_write(write_module):
    _, cls, _ = _twice(write_module, HELPER_WRITES, "NoStates")
    f, states = cls().functionalize()
    with pytest.raises(autostate.errors.StateAccessError):
        jit_call(f, states, 1.0)
    leaves = jax.tree_util.tree_leaves(f)
    assert not any(isinstance(x, jax.core.Tracer) for x in leaves)
    assert f.model.count == 0


COPIES = """
import copy
import jax.numpy as jnp


class Copier:
    def __init__(self):
        self.count = jnp.zeros(())
        self.sub = Leaf()

    def __call__(self, x):
        trial = copy.copy(self)
        trial.count = trial.count + 100
        deep = copy.deepcopy(self)
        deep.count = deep.count + 7
        deep.sub.n = deep.sub.n + 5
        self.count = self.count + x
        self.sub.n = self.sub.n + 1
        return trial.count + deep.count + deep.sub.n


class Leaf:
    def __init__(self):
        self.n = jnp.zeros(())

    def touch(self):
        self.n = self.n + 0


# A copy protocol of its own: copies start three counts ahead.
class AheadCopier(Copier):
    def __getstate__(self):
        return {"count": self.count + 3, "sub": self.sub}

    def __setstate__(self, state):
        self.__dict__.update(state)


# Another: a reduction whose copies start counting from zero.
class ZeroCountCopier(Copier):
    def __reduce__(self):
        return (type(self).__new__, (type(self),), {"count": self.count * 0, "sub": self.sub})
"""


@pytest.mark.parametrize("name", ["Copier", "AheadCopier", "ZeroCountCopier"])
def test_copies_inside_a_functionalized_call_own_their_state(write_module, name):
    plain_cls, cls, module = _twice(write_module, COPIES, name)
    autostate.stateful(module.Leaf)
    plain = plain_cls()
    expected = [float(plain(1.0)) for _ in range(2)]
    eager = cls()
    assert [float(eager(1.0)) for _ in range(2)] == expected
    f, states = cls().functionalize()
    outs = []
    for _ in range(2):
        out, states = jit_call(f, states, 1.0)
        outs.append(float(out))
    assert outs == expected
    assert {k: float(v) for k, v in states.items()} == {
        "count": float(plain.count), "sub.n": float(plain.sub.n)
    }


HOOKS = """
import dataclasses
import jax.numpy as jnp


class Clamped:
    def __init__(self):
        self.count = jnp.zeros(())

    def __setattr__(self, name, value):
        if name == "count":
            value = jnp.minimum(value, 10.0)
        super().__setattr__(name, value)

    def __call__(self, x):
        self.count = self.count + 55 * x
        return self.count


class Counted:
    reads = 0

    def __init__(self):
        self.count = jnp.zeros(())

    def __getattribute__(self, name):
        if name == "count":
            type(self).reads += 1
        return object.__getattribute__(self, name)

    def __call__(self, x):
        self.count = self.count + x
        return self.count


@dataclasses.dataclass(frozen=True)
class Frozen:
    count: object

    def __call__(self, x):
        self.count = self.count + x
        return self.count
"""


def test_a_user_setattr_is_honoured_eagerly_and_under_jit(write_module):
    plain_cls, cls, _ = _twice(write_module, HOOKS, "Clamped")
    assert float(plain_cls()(1.0)) == 10.0
    assert float(cls()(1.0)) == 10.0
    f, states = cls().functionalize()
    out, states = jit_call(f, states, 1.0)
    assert float(out) == 10.0 and float(states["count"]) == 10.0


def test_a_user_getattribute_sees_state_reads(write_module):
    plain_cls, cls, _ = _twice(write_module, HOOKS, "Counted")
    plain_cls()(1.0)
    model = cls()
    model(1.0)
    assert cls.reads == plain_cls.reads == 2  # the read in __call__, and the return


def test_a_frozen_dataclass_refuses_assignment_as_in_plain_python(write_module):
    plain_cls, cls, _ = _twice(write_module, HOOKS, "Frozen")
    with pytest.raises(dataclasses_frozen_error()):
        plain_cls(jnp.zeros(()))(1.0)
    model = cls(jnp.zeros(()))
    with pytest.raises(dataclasses_frozen_error()):
        model(1.0)
    assert float(model.count) == 0.0


def dataclasses_frozen_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


@pytest.mark.parametrize("slots", ['("w",)', '("w", "__dict__")', "()"])
def test_slots_are_rejected_at_decoration_with_their_names(write_module, slots):
    module = write_module(
        f"""
        import jax.numpy as jnp

        class Slotted:
            __slots__ = {slots}

            def __init__(self):
                self.w = jnp.zeros(())

            def step(self):
                self.w = self.w + 1
        """
    )
    with pytest.raises(autostate.errors.DecorationError) as info:
        autostate.stateful(module.Slotted)
    message = str(info.value)
    assert "Slotted" in message and "__slots__" in message
    assert "Slotted.w" in message or slots == "()"
    assert "fix: remove __slots__" in message


PLAIN_SUBMODEL = """
import jax.numpy as jnp


class Linear:
    def __init__(self):
        self.w = jnp.ones(3)


class Net:
    def __init__(self):
        self.blocks = [Linear()]
        self.steps = jnp.zeros(())

    def __call__(self, x):
        self.steps = self.steps + 1
        return self.blocks[0].w @ x
"""


def test_arrays_in_a_plain_object_are_refused_at_functionalize(write_module):
    _, cls, _ = _twice(write_module, PLAIN_SUBMODEL, "Net")
    model = cls()
    for entry in (model.functionalize, lambda: autostate.param_dict(model)):
        with pytest.raises(autostate.errors.InvalidTypeError) as info:
            entry()
        message = str(info.value)
        assert "Net.blocks" in message and "blocks[0].w" in message
        assert "decorate Linear with @autostate.stateful" in message


def test_arrays_in_a_decorated_object_are_parameters(write_module):
    _, cls, module = _twice(write_module, PLAIN_SUBMODEL, "Net")
    autostate.stateful(module.Linear)
    f, states = cls().functionalize()
    grads = jax.grad(lambda f: jit_call(f, states, jnp.ones(3))[0])(f)
    assert [float(g.sum()) for g in jax.tree_util.tree_leaves(grads)] == [3.0]
    assert set(autostate.param_dict(cls())) == {"blocks[0].w"}


NUMPY_STATE = """
import numpy as np


class Counts:
    def __init__(self):
        self.counts = np.zeros(4, np.float32)
        self.acc = np.zeros((), np.float32)

    def __call__(self, labels):
        self.counts[labels] += 1
        self.acc += np.float64(0.5)
        return self.counts
"""


def test_numpy_state_has_one_meaning_eagerly_and_under_jit(write_module):
    _, cls, _ = _twice(write_module, NUMPY_STATE, "Counts")
    labels = jnp.array([0, 0, 1])
    eager = cls()
    eager_out = eager(labels)
    f, states = cls().functionalize()
    jit_out, states = jit_call(f, states, labels)
    np.testing.assert_array_equal(eager_out, [2.0, 1.0, 0.0, 0.0])  # jax scatter-add
    np.testing.assert_array_equal(jit_out, eager_out)
    assert isinstance(eager.counts, jax.Array)
    assert eager.acc.dtype == states["acc"].dtype == jnp.float32


# --- Python semantics of each construct --------------------------------------------------

CONSTRUCTS = """
import jax.numpy as jnp

CALLS = []


def k():
    CALLS.append("k")
    return "a"


def v():
    CALLS.append("v")
    return 2.0


class Constructs:
    def __init__(self):
        self.d = {"a": jnp.ones(())}
        self.count = jnp.zeros((), jnp.int32)
        self.target = 3
        self.seen = []
        self.opts = {"a": 1}
        self.tags = {"x"}
        self.µ = jnp.zeros(())

    def step(self, n):
        self.d[k()] *= v()
        self.count += 1
        shown = f"{self.count=}", f"{self.count = !s:>4}", f"{ self.count = :>4}"
        nested = f"outer {f'inner {self.count}'}"
        match 3:
            case self.target:
                hit = True
            case _:
                hit = False
        self.seen += range(n)
        self.seen += (n, n)
        self.opts |= [("b", 2)]
        self.tags |= {"y"}
        self.µ += 1
        self.target = self.target + 0
        return shown, nested, hit

    def ﬁt(self, others):
        return sum(self.target for self in others)
"""


def test_each_construct_means_what_plain_python_means(write_module):
    plain_mod = write_module(CONSTRUCTS)
    module = write_module(CONSTRUCTS)
    cls = autostate.stateful(module.Constructs)
    plain, model = plain_mod.Constructs(), cls()
    assert str(model.step(2)) == str(plain.step(2))
    assert module.CALLS == plain_mod.CALLS == ["k", "v"]
    assert model.seen == plain.seen == [0, 1, 2, 2]
    assert model.opts == plain.opts and model.tags == plain.tags
    assert float(model.μ) == float(plain.μ) == 1.0
    assert "μ" in autostate.tree.class_info(cls).state  # stored under the normalized name
    assert model.fit([plain, plain]) == plain.fit([plain, plain]) == 6


def test_in_place_operators_never_change_a_state_value_in_place(write_module):
    module = write_module(CONSTRUCTS)
    cls = autostate.stateful(module.Constructs)
    model = cls()
    before = model.seen
    model.step(1)
    assert before == [] and model.seen == [0, 1, 1]


MOVED = """
import jax.numpy as jnp


class Moved:
    def __init__(self):
        self.x = jnp.zeros(())

    def step(self):
        self.x = self.x + 1
        return self.x
"""


def test_source_edited_after_import_is_refused_not_misread(write_module, tmp_path):
    module = write_module(MOVED)
    path = Path(module.__file__)
    path.write_text(path.read_text().replace("    def step(self):", "    def other(self, y):"))
    with pytest.raises(autostate.errors.DecorationError) as info:
        autostate.stateful(module.Moved)
    assert "no longer holds the code that was imported" in str(info.value)


BASE_V1 = """
class Mixin:
    def bump(self):
        return self.count * 1
"""
BASE_V2 = """
class Mixin:
    def bump(self):
        self.count = self.count + 1
        return self.count
"""
CHILD = """
import jax.numpy as jnp
import autostate
from cache_base_mod import Mixin


@autostate.stateful
class Child(Mixin):
    def __init__(self):
        self.count = jnp.zeros(())
        self.k = 1

    def __call__(self):
        return self.bump()


print(sorted(autostate.tree.class_info(Child).state))
"""


def test_editing_a_base_in_another_file_changes_the_decision_in_a_fresh_process(tmp_path):
    import os
    import subprocess

    (tmp_path / "cache_base_mod.py").write_text(BASE_V1)
    (tmp_path / "cache_child_mod.py").write_text(CHILD)
    env = {**os.environ, "AUTOSTATE_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(tmp_path)}

    def decision() -> str:
        run = subprocess.run(
            [sys.executable, "-c", "import cache_child_mod"],
            env=env, cwd=tmp_path, capture_output=True, text=True, check=True,
        )
        return run.stdout.strip()

    assert decision() == "[]"
    assert decision() == "[]"  # from the disk cache
    (tmp_path / "cache_base_mod.py").write_text(BASE_V2)
    assert decision() == "['count']"


# --- a tied sub-model through every entry point --------------------------------------------


@autostate.stateful
class TiedLinear:
    def __init__(self):
        self.w = jnp.ones(())
        self.n = jnp.zeros(())

    def __call__(self, x):
        self.n = self.n + 1
        return self.w * x


@autostate.stateful
class TiedBlock:
    def __init__(self, linear):
        self.linear = linear

    def __call__(self, x):
        return self.linear(x)


@autostate.stateful
class TiedNet:
    def __init__(self):
        linear = TiedLinear()
        self.block1, self.block2 = TiedBlock(linear), TiedBlock(linear)

    def __call__(self, x):
        return self.block2(self.block1(x) * 3)


def test_a_tied_sub_model_is_one_leaf_through_handle_and_freeze_local_states():
    handler, states = autostate.handle_local_states(TiedNet(), category="state")
    assert list(states) == ["block1.linear.n"]
    grads = jax.grad(lambda h: h((1.0, states))[0])(handler)
    assert [float(g) for g in jax.tree_util.tree_leaves(grads)] == [6.0]  # d(3 w^2)/dw
    (_, new_states) = jax.jit(lambda h, s: h((1.0, s)))(handler, states)
    assert float(new_states["block1.linear.n"]) == 2.0
    through_jit = jax.jit(lambda h: h)(handler)
    frozen = autostate.freeze_local_states(through_jit, new_states)
    assert frozen.block1.linear is frozen.block2.linear
    f, states = frozen.functionalize()
    assert float(states["block1.linear.n"]) == 2.0
    f_grads = jax.grad(lambda f: f(states, 1.0)[0])(f)
    assert [float(g) for g in jax.tree_util.tree_leaves(f_grads)] == [6.0]


LOGGING = """
import jax.numpy as jnp


class Logging:
    def __init__(self):
        self.w = jnp.ones(())
        self.log = []

    def __call__(self, x):
        self.log.append(x)
        return x * self.w
"""


def test_an_in_place_change_of_a_model_without_states_is_refused_and_undone(write_module):
    _, cls, _ = _twice(write_module, LOGGING, "Logging")
    f, states = cls().functionalize()
    assert states == {}
    with pytest.raises(autostate.errors.StateAccessError, match="outside its states"):
        jit_call(f, states, 1.0)
    assert f.model.log == []  # no tracer left behind in f's static data
