"""The decoration cache of ``autostate/transform/loader.py``.

Decoration results are cached in memory and on disk, keyed by the file's
content, the class and the options. A hit must skip analysis entirely
(``analysis.collect_facts`` is not called); a changed source must miss.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

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
