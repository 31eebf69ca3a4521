"""``autostate.api``: what ``@stateful`` leaves behind at the class statement.

Decoration is complete when the class statement ends, from a cold cache (the
class analysed and rewritten) or a warm one (the decision read back): the
methods are rewritten, the states have their descriptors, the class is a
pytree, and everything else reads as the plain class does (signature,
arguments, a base's own ``__new__``, pickling by reference in another
process, ``@dataclass`` on either side). A class the rewrite cannot express
fails at its class statement, every time.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import itertools
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autostate
from autostate import tree as _tree
from autostate.errors import DecorationError

_names = itertools.count()

SOURCE = '''
import jax.numpy as jnp
import autostate


@autostate.stateful
class Block:
    def __init__(self, n):
        self.w = jnp.ones((n, n))
        self.mean = jnp.zeros(n)
        self.steps = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        y = x @ self.w
        self.mean = 0.9 * self.mean + 0.1 * y
        self.steps = self.steps + 1
        return y


class Scaled(Block):
    def __init__(self, n, k):
        super().__init__(n)
        self.k = k

    def __call__(self, x):
        self.mean = self.mean * self.k
        return super().__call__(x)


class Bare(Block):
    pass
'''


def _import(path: Path) -> types.ModuleType:
    """Imports ``path`` under a new module name (a second import of an
    unchanged file reads its classes' decisions from the cache: warm)."""
    name = f"autostate_api_{next(_names)}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _import_twice(path: Path) -> types.ModuleType:
    """``path`` imported cold, then again: the second, warm import's module."""
    _import(path)
    return _import(path)


@pytest.fixture
def source_file(tmp_path: Path):
    def write(text: str = SOURCE) -> Path:
        path = tmp_path / f"models_{next(_names)}.py"
        path.write_text(textwrap.dedent(text))
        return path

    return write


def _plain(text: str) -> types.ModuleType:
    module = types.ModuleType("plain")
    exec(compile(textwrap.dedent(text).replace("@autostate.stateful\n", ""), "<plain>", "exec"),
         module.__dict__)
    return module


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_the_class_is_complete_after_its_class_statement(source_file, warm):
    path = source_file()
    module = _import_twice(path) if warm else _import(path)
    for name in ("Block", "Scaled", "Bare"):  # subclasses: by the base's subclass hook
        cls = getattr(module, name)
        assert _tree.class_info(cls).state == {"mean", "steps"}
        assert cls.functionalize is module.Block.functionalize
    assert type(vars(module.Block)["mean"]).__name__ == "StateAttribute"
    # Rewritten: the method reaches state through the runtime.
    assert "__autostate__" in vars(module.Block)["__call__"].__code__.co_freevars
    assert "__new__" not in vars(module.Block)  # no hook left for a first use
    model = module.Block(2)
    f, states = module.Block.functionalize(model)
    assert set(states) == {"mean", "steps"}


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_a_decorated_class_means_what_plain_python_means(source_file, warm):
    path = source_file()
    module = _import_twice(path) if warm else _import(path)
    plain = _plain(SOURCE)
    x = jnp.arange(3.0)
    for name, args in (("Block", (3,)), ("Scaled", (3, 2.0)), ("Bare", (3,))):
        expected, got = getattr(plain, name)(*args), getattr(module, name)(*args)
        for _ in range(2):
            np.testing.assert_allclose(got(x), expected(x))
        np.testing.assert_allclose(got.mean, expected.mean)
        assert int(got.steps) == int(expected.steps) == 2
        f, states = got.functionalize()
        out, states = jax.jit(lambda s, v, f=f: f(s, v))(states, x)
        np.testing.assert_allclose(out, expected(x))
        np.testing.assert_allclose(states["mean"], expected.mean)
        assert int(states["steps"]) == 3


def test_signature_is_the_plain_classs(source_file):
    module = _import_twice(source_file())
    plain = _plain(SOURCE)
    for name in ("Block", "Scaled", "Bare"):
        assert inspect.signature(getattr(module, name)) == inspect.signature(getattr(plain, name))


def test_arguments_to_a_class_without_init_fail_as_in_plain_python():
    @autostate.stateful
    class NoInit:
        x = jnp.zeros(())

        def step(self):
            self.x = self.x + 1

    class PlainNoInit:
        pass

    with pytest.raises(TypeError) as plain_error:
        PlainNoInit(1)
    with pytest.raises(TypeError) as error:
        NoInit(1)
    assert str(error.value) == str(plain_error.value).replace("PlainNoInit", "NoInit")
    model = NoInit()
    model.step()
    assert float(model.x) == 1.0 and float(NoInit.x) == 0.0


def test_a_class_the_rewrite_cannot_express_fails_at_its_class_statement_every_time(
    source_file,
):
    bad = '''
    import jax.numpy as jnp
    import autostate

    @autostate.stateful
    class Slotted:
        __slots__ = ("x",)

        def __init__(self):
            self.x = jnp.zeros(())
    '''
    path = source_file(bad)
    for _ in range(2):  # a failed decision is never cached
        with pytest.raises(DecorationError, match="__slots__") as info:
            _import(path)
        assert str(path) in str(info.value)


def test_an_edited_file_is_decided_again_at_the_class_statement(source_file):
    path = source_file()
    _import(path)
    text = path.read_text().replace(
        "        self.steps = self.steps + 1\n", "        self.fresh = self.steps + 1\n"
    )
    path.write_text(text)
    os.utime(path, ns=(1, 1))  # another version of the file, whatever the clock
    with pytest.raises(DecorationError, match="fresh"):
        _import(path)


def test_dataclass_above_stateful_is_a_dataclass():
    # @stateful runs before @dataclass writes __init__ and __repr__: the
    # annotated fields are what that __init__ will assign.
    @dataclasses.dataclass
    @autostate.stateful
    class Point:
        x: jax.Array
        n: int = 0

        def bump(self):
            self.x = self.x + 1

    @dataclasses.dataclass
    class PlainPoint:
        x: jax.Array
        n: int = 0

        def bump(self):
            self.x = self.x + 1

    p, q = Point(jnp.zeros(())), PlainPoint(jnp.zeros(()))
    p.bump()
    q.bump()
    assert float(p.x) == float(q.x) == 1.0
    assert [f.name for f in dataclasses.fields(Point)] == ["x", "n"]
    assert inspect.signature(Point) == inspect.signature(PlainPoint)
    assert repr(p).replace(".Point(", ".X(") == repr(q).replace(".PlainPoint(", ".X(")
    f, states = p.functionalize()
    _, states = jax.jit(lambda s: f.bump(s))(states)
    assert float(states["x"]) == 2.0


def test_dataclass_above_stateful_with_a_post_init_state():
    @dataclasses.dataclass
    @autostate.stateful
    class Running:
        k: float = 2.0
        # @dataclass deletes a field's class attribute, the state's descriptor
        # here: the first write puts it back.
        total: jax.Array = dataclasses.field(init=False)

        def __post_init__(self):
            self.total = jnp.zeros(())

        def add(self, x):
            self.total = self.total + self.k * x
            return self.total

    model = Running(k=3.0)
    assert float(model.add(1.0)) == 3.0
    assert isinstance(model.total, jax.Array) and float(model.total) == 3.0  # read from outside
    f, states = model.functionalize()
    out, states = jax.jit(lambda s: f.add(s, 2.0))(states)
    assert float(out) == float(states["total"]) == 9.0


def test_a_decorator_above_that_rebuilds_the_class_with_slots_fails_at_the_class_statement():
    # @dataclass(slots=True) makes a new class from the decorated one's dict:
    # it is decorated as it is made, and slots cannot hold state.
    with pytest.raises(Exception) as info:  # noqa: PT011 - a RuntimeError before Python 3.12

        @dataclasses.dataclass(slots=True)
        @autostate.stateful
        class Slotted:
            c: jax.Array = dataclasses.field(default_factory=lambda: jnp.zeros(()))

            def bump(self):
                self.c = self.c + 1

    error = info.value if isinstance(info.value, DecorationError) else info.value.__cause__
    assert isinstance(error, DecorationError) and "__slots__" in str(error)


def test_a_frozen_dataclass_above_stateful_is_refused_at_the_class_statement():
    # Decoration installs the run-time guard as __setattr__, which a frozen
    # dataclass may not overwrite (docs/limitations.md); below, it is wrapped.
    with pytest.raises(TypeError, match="__setattr__"):

        @dataclasses.dataclass(frozen=True)
        @autostate.stateful
        class Above:
            w: float = 1.0

    @autostate.stateful
    @dataclasses.dataclass(frozen=True)
    class Below:
        w: jax.Array = dataclasses.field(default_factory=lambda: jnp.ones(2))

        def __call__(self, x):
            return self.w * x

    model = Below()
    with pytest.raises(dataclasses.FrozenInstanceError):
        model.w = jnp.zeros(2)
    f, states = model.functionalize()
    np.testing.assert_allclose(jax.jit(lambda f, x: f(states, x)[0])(f, 2.0), [2.0, 2.0])


GENERATED_INIT = '''
import dataclasses
import jax.numpy as jnp
import autostate


@autostate.stateful
class First:
    def __init__(self):
        self.count = jnp.zeros(())

    def tick(self):
        self.count = self.count + 1


@autostate.stateful
@dataclasses.dataclass
class Generated:
    total: object = None

    def add(self, x):
        self.total = self.total + x


namespace = {}
exec("def __init__(self):\\n    self.count = jnp.zeros(())", {"jnp": jnp}, namespace)


@autostate.stateful
class Assigned:
    __init__ = namespace["__init__"]

    def tick(self):
        self.count = self.count + 2
'''


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_an_init_without_source(source_file, warm):
    # A dataclass's generated __init__ and one made by exec have no source:
    # what the methods assign is taken as initialized.
    path = source_file(GENERATED_INIT)
    module = _import_twice(path) if warm else _import(path)
    g = module.Generated(jnp.zeros(()))
    g.add(2.0)
    a, first = module.Assigned(), module.First()
    a.tick()
    first.tick()
    assert (float(g.total), float(a.count), float(first.count)) == (2.0, 2.0, 1.0)
    f, states = g.functionalize()
    _, states = jax.jit(lambda s: f.add(s, 3.0))(states)
    assert float(states["total"]) == 5.0
    f, states = a.functionalize()
    _, states = jax.jit(lambda s: f.tick(s))(states)
    assert float(states["count"]) == 4.0


_PROCESS = '''
import pickle, sys
sys.path.insert(0, {folder!r})
import {module} as models
if sys.argv[1] == "save":
    model = models.Scaled(2, 3.0)
    model(models.jnp.ones(2))
    sys.stdout.buffer.write(pickle.dumps(model))
else:
    model = pickle.loads(sys.stdin.buffer.read())
    model(models.jnp.ones(2))
    f, states = model.functionalize()
    # Warm: every decision read from the cache, so libcst was never imported.
    print(int(model.steps), sorted(states), float(model.k), "libcst" in sys.modules)
'''


def test_pickling_by_reference_across_processes_from_a_warm_cache(source_file, tmp_path):
    path = source_file()
    package_root = str(Path(autostate.__file__).parents[1])  # this autostate, not another
    env = {**os.environ, "AUTOSTATE_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")])}
    script = _PROCESS.format(folder=str(path.parent), module=path.stem)

    def run(mode, data=b""):
        done = subprocess.run([sys.executable, "-c", script, mode], input=data, env=env,
                              capture_output=True, check=False, timeout=120)
        assert done.returncode == 0, done.stderr.decode()
        return done.stdout

    saved = run("save")  # (cold: fills the cache)
    assert run("load", saved).decode().split() == ["2", "['mean',", "'steps']", "3.0", "False"]


MIXED = '''
import jax.numpy as jnp
import autostate


class Tagged:
    made = 0

    def __new__(cls, *args, **kwargs):
        Tagged.made += 1
        self = super().__new__(cls)
        self.tag = "new"
        return self


class Counting:
    def bump(self):
        self.extra = self.extra + 1
        return self.extra


@autostate.stateful
class Block:
    def __init__(self, n):
        self.v = jnp.zeros(n)
        self.extra = jnp.zeros(())

    def step(self):
        self.v = self.v + 1
        return self.v


class Both(Block, Tagged, Counting):
    pass
'''


def test_a_base_s_own_new_runs_as_in_plain_python(source_file):
    module = _import_twice(source_file(MIXED))
    plain = _plain(MIXED)
    expected, got = plain.Both(3), module.Both(3)
    assert plain.Tagged.made == module.Tagged.made == 1
    assert got.tag == expected.tag == "new"
    np.testing.assert_allclose(got.step(), expected.step())
    f, states = got.functionalize()
    out, states = jax.jit(lambda s, f=f: f.bump(s))(states)
    assert float(out) == float(expected.bump()) == 1.0
    assert set(states) == {"v", "extra"}


EDITED = '''
import jax.numpy as jnp
import autostate


@autostate.stateful
class Model:
    scale = 2.0

    def __init__(self):
        self.x = jnp.zeros(())

    def step(self, v):
        self.x = self.x + v * self.scale
        return self.x

    def unused(self):
        return 0


def times10(method):
    def step(self, v):
        return method(self, v) * 10

    return step


EDIT
'''

_EDITS = {
    # A method wrapped by assignment: the wrapper calls the rewritten method.
    "wrapped": "Model.step = times10(Model.step)",
    "deleted": "del Model.unused",
    "class attribute replaced": "Model.scale = 3.0",
}


@pytest.mark.parametrize("edit", list(_EDITS))
def test_the_class_dict_edited_after_the_class_statement(source_file, edit):
    text = EDITED.replace("EDIT", _EDITS[edit])
    module = _import_twice(source_file(text))
    plain = _plain(text)
    expected, got = plain.Model(), module.Model()
    assert hasattr(module.Model, "unused") == hasattr(plain.Model, "unused")
    for v in (1.0, 2.0):
        np.testing.assert_allclose(got.step(v), expected.step(v))
    np.testing.assert_allclose(got.x, expected.x)
    f, states = got.functionalize()
    out, states = jax.jit(lambda s, v, f=f: f.step(s, v))(states, 1.0)
    np.testing.assert_allclose(out, expected.step(1.0))
    np.testing.assert_allclose(states["x"], expected.x)
