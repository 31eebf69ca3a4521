"""The loader: the decoration cache, and the map from rewritten code back to
the user's file and line (tracebacks).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import traceback
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from semantics.harness import (
    Loader,
    pair,
)
from semantics.programs_shared import X1, py312
from semantics.programs_static_state import TRACEBACKS

import autostate
from autostate.transform import analysis, loader


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty disk cache directory and an empty memory cache."""
    directory = tmp_path / "cache"
    monkeypatch.setenv("AUTOSTATE_CACHE_DIR", str(directory))
    _empty_memory_caches(monkeypatch)
    return directory


def _empty_memory_caches(monkeypatch) -> None:
    """What a new process starts with: an empty memory cache in the loader."""
    monkeypatch.setattr(loader, "_MEMORY_CACHE", {})


@pytest.fixture
def analysis_calls(monkeypatch):
    """Counts calls to ``analysis.collect_facts`` (one per analysed method)."""
    calls: list[str] = []
    original = analysis.collect_facts

    def counting(class_name, source):
        calls.append(f"{class_name}.{source.key}")
        return original(class_name, source)

    monkeypatch.setattr(analysis, "collect_facts", counting)
    return calls


def make_counter():
    """A new class object from the same source on every call."""

    @autostate.stateful
    class Counter:
        def __init__(self):
            self.count = jnp.zeros(())

        def __call__(self, x):
            self.count += 1
            return x * self.count

    return Counter


def check_counter(cls) -> None:
    model = cls()
    assert float(model(2.0)) == 2.0
    assert float(model(2.0)) == 4.0
    f, states = model.functionalize()
    out, states = jax.jit(lambda f, s: f(s, 2.0))(f, states)
    assert float(out) == 6.0 and float(states["count"]) == 3.0


def test_second_decoration_of_unchanged_source_hits_the_memory_cache(fresh_cache, analysis_calls):
    first = make_counter()
    assert sorted(analysis_calls) == ["Counter.__call__", "Counter.__init__"]
    analysis_calls.clear()
    second = make_counter()
    assert second is not first
    assert analysis_calls == []
    assert autostate.tree.class_info(second).state == {"count"}
    check_counter(first)
    check_counter(second)


def test_disk_cache_survives_a_cleared_memory_cache(fresh_cache, analysis_calls, monkeypatch):
    make_counter()
    assert len(analysis_calls) == 2
    files = list(fresh_cache.glob("*.bin"))
    assert len(files) == 1
    _empty_memory_caches(monkeypatch)
    analysis_calls.clear()
    cls = make_counter()
    assert analysis_calls == []
    check_counter(cls)
    # Rewritten code loaded from disk still points at the user's lines.
    call = cls.__dict__["__call__"]
    assert call.__code__.co_filename == __file__
    assert call.__code__.co_firstlineno == make_counter.__code__.co_firstlineno + 8


def test_a_fresh_cache_directory_misses(fresh_cache, analysis_calls, monkeypatch, tmp_path):
    make_counter()
    other = tmp_path / "other-cache"
    monkeypatch.setenv("AUTOSTATE_CACHE_DIR", str(other))
    _empty_memory_caches(monkeypatch)
    analysis_calls.clear()
    check_counter(make_counter())
    assert len(analysis_calls) == 2
    assert len(list(other.glob("*.bin"))) == 1


def test_empty_cache_dir_setting_disables_the_disk_cache(monkeypatch, analysis_calls, tmp_path):
    monkeypatch.setenv("AUTOSTATE_CACHE_DIR", "")
    _empty_memory_caches(monkeypatch)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    check_counter(make_counter())
    assert len(analysis_calls) == 2
    assert not (tmp_path / "xdg").exists() and not (tmp_path / "home").exists()
    analysis_calls.clear()
    make_counter()  # the memory cache still works
    assert analysis_calls == []


def test_corrupt_disk_entry_is_ignored(fresh_cache, analysis_calls, monkeypatch):
    make_counter()
    (entry,) = fresh_cache.glob("*.bin")
    entry.write_bytes(b"not a marshalled value")
    _empty_memory_caches(monkeypatch)
    analysis_calls.clear()
    check_counter(make_counter())
    assert len(analysis_calls) == 2


SOURCE = """
import jax.numpy as jnp
import autostate


@autostate.stateful
class Model:
    def __init__(self):
        self.x = jnp.zeros(())

    def step(self):
        self.x += {increment}
        return self.x
"""


def import_file(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_changed_source_is_analysed_again(fresh_cache, analysis_calls, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    path = tmp_path / "edited_model.py"
    path.write_text(SOURCE.format(increment="1"))
    first = import_file(path, "edited_model_v1")
    assert len(analysis_calls) == 2
    assert float(first.Model().step()) == 1.0

    # Same file, same content, imported again: a cache hit.
    analysis_calls.clear()
    again = import_file(path, "edited_model_v1_again")
    assert analysis_calls == []
    assert float(again.Model().step()) == 1.0

    # The user edits the file and imports it again: analysed and rewritten anew.
    path.write_text(SOURCE.format(increment="100"))
    analysis_calls.clear()
    second = import_file(path, "edited_model_v2")
    assert len(analysis_calls) == 2
    assert float(second.Model().step()) == 100.0
    assert float(first.Model().step()) == 1.0
    assert len(list(fresh_cache.glob("*.bin"))) == 2


def test_different_options_do_not_share_a_cache_entry(fresh_cache, analysis_calls):
    def make(category):
        @autostate.stateful(category=category)
        class Tagged:
            def __init__(self):
                self.n = jnp.zeros(())

            def step(self):
                self.n += 1

        return Tagged

    a = make("a")
    analysis_calls.clear()
    b = make("b")
    # The category does not change the rewrite, so the entry is reused...
    assert analysis_calls == []
    # ...but each class keeps its own category.
    assert list(a().functionalize("a")[1]) == ["n"]
    assert list(b().functionalize("b")[1]) == ["n"]
    assert b().functionalize("a")[1] == {}


def test_disk_cache_evicts_the_least_recently_used_entries(tmp_path):
    import os

    directory = tmp_path / "cache"
    directory.mkdir()
    for i, name in enumerate(["old", "used", "new"]):
        path = directory / f"{name}.bin"
        path.write_bytes(b"x" * 100)
        os.utime(path, (1_000 + i, 1_000 + i))
    os.utime(directory / "used.bin", (5_000, 5_000))  # a hit touches its entry
    loader.evict(directory, limit=250)
    assert sorted(p.stem for p in directory.glob("*.bin")) == ["new", "used"]
    loader.evict(directory, limit=100)
    assert [p.stem for p in directory.glob("*.bin")] == ["used"]


def test_storing_keeps_the_disk_cache_under_its_limit(fresh_cache, monkeypatch):
    monkeypatch.setenv("AUTOSTATE_CACHE_MAX_BYTES", "1")
    loader.cache_store("a" * 64, (["x"], [], {}))
    loader.cache_store("b" * 64, (["y"], [], {}))
    # A 1-byte limit holds no entry at all.
    assert list(fresh_cache.glob("*.bin")) == []
    assert loader.cache_load("b" * 64) == (["y"], [], {})  # the memory cache still has it


def test_memory_cache_is_bounded(monkeypatch):
    _empty_memory_caches(monkeypatch)
    monkeypatch.setattr(loader, "MEMORY_CACHE_ENTRIES", 3)
    monkeypatch.setenv("AUTOSTATE_CACHE_DIR", "")
    for key in "abcd":
        loader.cache_store(key, key)
    # Each store also remembers its bundle: the bound counts both.
    assert len(loader._MEMORY_CACHE) == 3
    assert "d" in loader._MEMORY_CACHE and "a" not in loader._MEMORY_CACHE


THREE_CLASSES = """
import jax.numpy as jnp
import autostate

@autostate.stateful
class A:
    def __init__(self):
        self.x = jnp.zeros(())

    def step(self):
        self.x += 1

@autostate.stateful
class B(A):
    def step(self):
        self.x += 2

@autostate.stateful
class C:
    def __init__(self):
        self.y = jnp.ones(())

    def step(self):
        self.y *= 2
"""


def test_a_module_s_classes_are_read_from_disk_with_one_open(
    fresh_cache, analysis_calls, monkeypatch, tmp_path
):
    path = tmp_path / "three_classes.py"
    path.write_text(THREE_CLASSES)
    _import(path)
    assert len(list(fresh_cache.glob("*.bin"))) == 1  # one bundle for the file
    reads: list[str] = []
    original = loader._read_bundle
    monkeypatch.setattr(loader, "_read_bundle", lambda name: reads.append(name) or original(name))
    _empty_memory_caches(monkeypatch)  # as in a new process
    analysis_calls.clear()
    module = _import(path)
    assert analysis_calls == [] and len(reads) == 1  # every class decided from one read
    b = module.B()
    b.step()
    assert float(b.x) == 2.0 and autostate.tree.class_info(module.C).state == {"y"}
    assert analysis_calls == [] and len(reads) == 1


def test_each_class_of_a_file_adds_its_own_record_to_the_bundle(fresh_cache, monkeypatch):
    """A store writes one record, not the whole bundle again (a file of n classes
    wrote n bundles of up to n entries: quadratic); a torn tail, as a reader may
    see while another process appends, ends the bundle; a bundle that did not
    read whole is written anew by the next store."""
    written: list[int] = []
    original_write = loader.os.write
    monkeypatch.setattr(loader.os, "write", lambda fd, data: written.append(len(data))
                        or original_write(fd, data))
    values = {f"{i:064x}": ([f"state{i}"], [], {"x": i}) for i in range(20)}
    for key, value in values.items():
        loader.cache_store(key, value, "bundle")
    path = fresh_cache / "bundle.bin"
    assert len(written) == 20 and path.stat().st_size == sum(written)  # each record written once
    _empty_memory_caches(monkeypatch)
    assert all(loader.cache_load(key, "bundle") == value for key, value in values.items())

    whole = path.read_bytes()
    path.write_bytes(whole + whole[:7])  # another process's record, half written
    _empty_memory_caches(monkeypatch)
    assert loader.cache_load(f"{3:064x}", "bundle") == values[f"{3:064x}"]
    loader.cache_store("e" * 64, (["late"], [], {}), "bundle")
    # Written anew: the torn record dropped.
    assert path.stat().st_size == len(whole) + len(loader._record("e" * 64, (["late"], [], {})))
    _empty_memory_caches(monkeypatch)
    assert loader.cache_load("e" * 64, "bundle") == (["late"], [], {})
    assert all(loader.cache_load(key, "bundle") == value for key, value in values.items())


def _import(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def test_the_cache_folder_follows_each_variable_it_depends_on(monkeypatch, tmp_path):
    # The folder is remembered with the raw values of the three variables it
    # is made from; a change of any one of them is a new folder.
    monkeypatch.delenv("AUTOSTATE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert loader._cache_dir_name() == str(tmp_path / "xdg" / "autostate")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg2"))
    assert loader._cache_dir_name() == str(tmp_path / "xdg2" / "autostate")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert loader._cache_dir_name() == str(tmp_path / "home" / ".cache" / "autostate")
    monkeypatch.setenv("AUTOSTATE_CACHE_DIR", str(tmp_path / "mine"))
    assert loader._cache_dir_name() == str(tmp_path / "mine")
    monkeypatch.setenv("AUTOSTATE_CACHE_DIR", "")
    assert loader._cache_dir_name() is None


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
    # (PYTHONPATH extended, not replaced: where JAX lives on it, the child needs it too)
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "AUTOSTATE_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": path}

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


@pytest.mark.parametrize("offset", [0, 1, 3, 7])
def test_a_class_compiled_from_other_text_under_a_file_name(
    tmp_path: Any, offset: int
) -> None:
    """Code compiled under the name of a file that holds other text (the file
    was rewritten after the import, or ``compile(src, existing_path, ...)``):
    a DecorationError naming the file and line, never an internal traceback,
    whatever the file holds at the function's line."""
    path = tmp_path / "other.py"
    path.write_text("\n" * offset + "x = 1\n\n\nclass Other:\n    pass\n\n\ny = [\n    1,\n]\n")
    source = (
        "import jax.numpy as jnp\n\n\nclass Model:\n    def __init__(self):\n"
        "        self.n = jnp.zeros(())\n\n    def step(self):\n        self.n += 1\n"
    )
    namespace: dict[str, Any] = {}
    exec(compile(source, str(path), "exec"), namespace)  # noqa: S102
    with pytest.raises(autostate.errors.DecorationError, match="other.py") as info:
        autostate.tree.class_info(autostate.stateful(namespace["Model"]))
    assert "fix:" in str(info.value)


def _where(exc: BaseException) -> list[tuple[str, str]]:
    """(function, line text) of each traceback entry in the user's module."""
    import traceback

    entries = traceback.extract_tb(exc.__traceback__)
    return [(e.name, (e.line or "").strip()) for e in entries if "autostate_testmod" in e.filename]


@py312
@pytest.mark.parametrize(
    ("method", "exc"),
    [("fails", ValueError), ("fails_in_handler", KeyError),
     ("fails_in_comprehension", ZeroDivisionError), ("fails_in_fstring", ValueError)],
)
def test_traceback_lines_in_rewritten_methods(write_module: Loader, method: str, exc: type) -> None:
    plain, dec = pair(write_module, TRACEBACKS)
    got = []
    for mod in (plain, dec):
        with pytest.raises(exc) as err:
            getattr(mod.Tb(), method)(X1)
        # (and where the group the handler caught was raised)
        context = err.value.__context__
        got.append((_where(err.value), context and _where(context)))
    assert got[0] == got[1]
    marker = 'return f"{' if method == "fails_in_fstring" else "# RAISE"
    assert marker in got[1][0][-1][1]


@py312
def test_frame_line_after_a_docstring_and_a_long_signature(write_module: Loader) -> None:
    plain, dec = pair(write_module, TRACEBACKS)
    lines = []
    for mod in (plain, dec):
        model = mod.Tb()
        code = mod.Tb.fails.__wrapped__.__code__
        try:
            model.fails(X1)
        except ValueError as e:
            tb = e.__traceback__
            while tb.tb_next is not None:
                tb = tb.tb_next
            lines.append((tb.tb_lineno - code.co_firstlineno, tb.tb_frame.f_lineno - code.co_firstlineno))
    assert lines[0] == lines[1]
