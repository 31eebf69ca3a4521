"""Shared test setup: a private decoration cache, and modules built from source text."""

from __future__ import annotations

import importlib.util
import itertools
import os
import sys
import tempfile
import textwrap
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# Decoration caches to disk by default; tests must never write to the home dir.
os.environ.setdefault("AUTOSTATE_CACHE_DIR", tempfile.mkdtemp(prefix="autostate-test-cache-"))

_module_counter = itertools.count()


@pytest.fixture
def write_module(tmp_path: Path) -> Iterator[Callable[..., types.ModuleType]]:
    """Writes source text to a ``.py`` file under ``tmp_path`` and imports it.

    ``write_module(source, name=None)`` returns the imported module; it is in
    ``sys.modules`` while the test runs (so pickling by reference works) and
    removed afterwards.
    """
    added: list[str] = []

    def load(source: str, name: str | None = None) -> types.ModuleType:
        name = name or f"autostate_testmod_{next(_module_counter)}"
        path = tmp_path / f"{name}.py"
        path.write_text(textwrap.dedent(source))
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        added.append(name)
        spec.loader.exec_module(module)
        return module

    yield load
    for name in added:
        sys.modules.pop(name, None)
