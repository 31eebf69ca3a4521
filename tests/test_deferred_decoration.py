"""Decoration deferred to a class's first use (``api._stateful``, ``_FirstUse``).

A class statement only marks the class; its first instance (or unpickling, or
autostate reading its decision) installs the decoration. These tests pin the
contract: a warm class statement installs nothing else, a new decision is
still made (and fails) at the class statement, and a class completed late
behaves as one decorated at once: eagerly, in ``f`` and under ``jit``, for
subclasses written before the first use, with the plain class's signature,
across threads and across processes.
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
import threading
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autostate
from autostate import api
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
    unchanged file finds its classes' decisions in the cache: warm)."""
    name = f"autostate_deferred_{next(_names)}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _import_twice(path: Path) -> types.ModuleType:
    """``path`` imported cold (decided at its class statements), then again:
    the second, warm import's module."""
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


def test_a_warm_class_statement_only_marks_the_class(source_file):
    path = source_file()
    _import(path)  # cold: decided at the class statements (Scaled's needs Block's)
    warm = _import(path)
    cls = warm.Block
    assert cls in _tree.PENDING
    assert api.INFO_ATTR not in cls.__dict__
    # Nothing but two markers: the class dict is the plain class's, plus the
    # __new__ that completes it and the subclass hook of a pending class.
    plain = _plain(SOURCE).Block
    # (and functionalize, which a class decorated at once has too).
    assert set(vars(cls)) - set(vars(plain)) == {"__new__", "__init_subclass__", "functionalize"}
    assert "__autostate__" not in vars(cls)["__call__"].__code__.co_freevars  # not rewritten yet
    model = cls(3)
    assert cls not in _tree.PENDING and autostate.tree.class_info(cls).state == {"mean", "steps"}
    assert "functionalize" in vars(cls)
    np.testing.assert_allclose(model(jnp.ones(3)), 3.0)


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_a_class_completed_late_means_what_plain_python_means(source_file, warm):
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


def test_a_subclass_instantiated_before_its_base_completes_both(source_file):
    path = source_file()
    _import(path)
    module = _import(path)  # warm: no subclass hook until Block's first use
    assert module.Block in _tree.PENDING
    model = module.Scaled(3, 2.0)
    assert module.Block not in _tree.PENDING and module.Scaled not in _tree.PENDING
    assert autostate.tree.class_info(module.Scaled).state == {"mean", "steps"}
    # Bare, written before the first use too, is decorated on its own first use.
    assert module.Bare in _tree.PENDING
    bare = module.Bare(3)
    assert autostate.tree.class_info(module.Bare) is not None
    f, states = bare.functionalize()
    assert set(states) == {"mean", "steps"}
    model(jnp.ones(3))
    assert int(model.steps) == 1


def test_signature_is_the_plain_classs(source_file):
    path = source_file()
    _import(path)
    module = _import(path)
    plain = _plain(SOURCE)
    for name in ("Block", "Scaled", "Bare"):
        assert inspect.signature(getattr(module, name)) == inspect.signature(getattr(plain, name))
    module.Scaled(2, 1.0)  # completed: the same
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


def test_a_new_decision_fails_at_the_class_statement_every_time(source_file):
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
    for _ in range(2):  # a failed decision is never recorded as decided
        with pytest.raises(DecorationError, match="__slots__"):
            _import(path)


def test_an_edited_file_is_decided_again_at_the_class_statement(source_file):
    path = source_file()
    _import(path)
    text = path.read_text().replace(
        "        self.steps = self.steps + 1\n", "        self.fresh = self.steps + 1\n"
    )
    path.write_text(text)
    os.utime(path, ns=(1, 1))  # another version of the file, whatever the clock
    with pytest.raises(DecorationError):
        _import(path)


def test_dataclass_above_stateful_is_completed_as_a_dataclass():
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
    f, states = p.functionalize()
    _, states = jax.jit(lambda s: f.bump(s))(states)
    assert float(states["x"]) == 2.0


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
def test_an_init_generated_from_a_string_takes_its_site_from_another_function(source_file, warm):
    # Its file name is "<string>": the class is known by its first function of
    # the file, and a class after a real file's is not taken for one of it.
    path = source_file(GENERATED_INIT)
    module = _import_twice(path) if warm else _import(path)
    if warm:
        assert {module.First, module.Generated, module.Assigned} <= set(_tree.PENDING)
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


def test_threads_instantiating_a_pending_class_see_it_complete(source_file):
    path = source_file()
    _import(path)
    module = _import(path)
    models, errors = [], []
    barrier = threading.Barrier(8)

    def make():
        try:
            barrier.wait()
            model = module.Scaled(2, 1.0)
            model(jnp.ones(2))
            models.append(model)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=make) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors
    assert [int(m.steps) for m in models] == [1] * 8
    assert all(set(m.functionalize()[1]) == {"mean", "steps"} for m in models)


_PROCESS = '''
import pickle, sys
sys.path.insert(0, {folder!r})
import {module} as models
if sys.argv[2] == "warm":
    assert models.Block in __import__("autostate").tree.PENDING, "warm: pending at import"
if sys.argv[1] == "save":
    model = models.Scaled(2, 3.0)
    model(models.jnp.ones(2))
    sys.stdout.buffer.write(pickle.dumps(model))
else:
    model = pickle.loads(sys.stdin.buffer.read())  # the first use of the classes
    model(models.jnp.ones(2))
    f, states = model.functionalize()
    # Warm: nothing was analysed, so libcst was never imported.
    print(int(model.steps), sorted(states), float(model.k), "libcst" in sys.modules)
'''


def test_unpickling_in_a_new_process_completes_the_classes(source_file, tmp_path):
    path = source_file()
    env = {**os.environ, "AUTOSTATE_CACHE_DIR": str(tmp_path / "cache")}
    script = _PROCESS.format(folder=str(path.parent), module=path.stem)

    def run(mode, data=b"", cache="warm"):
        done = subprocess.run([sys.executable, "-c", script, mode, cache], input=data, env=env,
                              capture_output=True, check=False, timeout=120)
        assert done.returncode == 0, done.stderr.decode()
        return done.stdout

    run("save", cache="cold")  # fills the cache: the later processes start warm
    saved = run("save")
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


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_a_base_s_own_new_runs_as_in_plain_python(source_file, warm):
    # The completing __new__ sits first in the MRO; plain Python would call a
    # later base's __new__ (a mixin's), so the hook hands over to it.
    path = source_file(MIXED)
    module = _import_twice(path) if warm else _import(path)
    plain = _plain(MIXED)
    expected, got = plain.Both(3), module.Both(3)
    assert plain.Tagged.made == module.Tagged.made == 1
    assert got.tag == expected.tag == "new"
    np.testing.assert_allclose(got.step(), expected.step())
    f, states = got.functionalize()
    out, states = jax.jit(lambda s, f=f: f.bump(s))(states)
    assert float(out) == float(expected.bump()) == 1.0
    assert set(states) == {"v", "extra"}


def test_functionalize_is_on_the_class_before_its_first_instance(source_file):
    path = source_file()
    _import(path)
    module = _import(path)
    assert module.Block in _tree.PENDING
    assert module.Block.functionalize is module.Scaled.functionalize
    model = module.Block(2)
    f, states = module.Block.functionalize(model)
    assert set(states) == {"mean", "steps"}


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_a_module_gone_from_sys_modules_before_the_first_instance(source_file, warm):
    # What the class statement saw decides, not what sys.modules holds at the
    # first instance: an undecorated mixin's writes are still state.
    path = source_file(MIXED)
    module = _import_twice(path) if warm else _import(path)
    del sys.modules[module.__name__]
    model = module.Both(3)
    assert autostate.tree.class_info(module.Both).state >= {"v", "extra"}
    f, states = model.functionalize()
    out, states = jax.jit(lambda s, f=f: f.bump(s))(states)
    assert float(out) == 1.0 and float(states["extra"]) == 1.0


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
    # A method wrapped by assignment: the decision is made on the method as
    # written, which the wrapper calls.
    "wrapped": "Model.step = times10(Model.step)",
    # ... and an attribute added after it (the dict's keys keep their order).
    "wrapped, then added": "Model.step = times10(Model.step)\nModel.extra = 1",
    # An attribute deleted: the keys of the values kept no longer line up,
    # and the class is decided as it is (here, what it was).
    "deleted": "del Model.unused",
    "class attribute replaced": "Model.scale = 3.0",
}


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
@pytest.mark.parametrize("edit", list(_EDITS))
def test_the_class_dict_edited_before_the_first_instance(source_file, warm, edit):
    # What the class statement wrote is kept as its dict's values; their keys
    # are found again at the first use.
    text = EDITED.replace("EDIT", _EDITS[edit])
    path = source_file(text)
    module = _import_twice(path) if warm else _import(path)
    assert module.Model in _tree.PENDING
    plain = _plain(text)
    expected, got = plain.Model(), module.Model()
    assert hasattr(module.Model, "unused") == hasattr(plain.Model, "unused")
    assert hasattr(module.Model, "extra") == hasattr(plain.Model, "extra")
    for v in (1.0, 2.0):
        np.testing.assert_allclose(got.step(v), expected.step(v))
    np.testing.assert_allclose(got.x, expected.x)
    f, states = got.functionalize()
    out, states = jax.jit(lambda s, v, f=f: f.step(s, v))(states, 1.0)
    np.testing.assert_allclose(out, expected.step(1.0))
    np.testing.assert_allclose(states["x"], expected.x)


def test_the_values_kept_are_found_again_under_their_keys(source_file):
    path = source_file(EDITED.replace("EDIT", "Model.step = times10(Model.step)"))
    _import(path)
    module = _import(path)
    values = _tree.PENDING[module.Model]  # the values its statement wrote
    written = api._as_written(module.Model, values)
    assert written is not None
    assert written["step"] is not module.Model.__dict__["step"]  # the method as written
    assert written["step"].__name__ == "step" and "__new__" not in written
    assert written["unused"] is module.Model.__dict__["unused"]
    del module.Model.unused
    assert api._as_written(module.Model, values) is None
