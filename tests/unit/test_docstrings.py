"""Every ``>>>`` example in autostate's docstrings runs as a doctest.

As doctest runs them by default, an example sees its module's globals, plus
``jax``, ``jnp`` and ``autostate``; its ``__name__`` is ``__main__``, so the
functions and classes it defines are user code, not autostate's own. A class
an example decorates is read from the example's own lines, which doctest
serves through ``linecache``.
"""

from __future__ import annotations

import doctest
import importlib
import io
import pkgutil

import jax
import jax.numpy as jnp
import pytest

import autostate

_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _modules() -> list[str]:
    found = pkgutil.walk_packages(autostate.__path__, "autostate.")
    return ["autostate", *sorted(info.name for info in found)]


# Modules that import a tool the machine lacks (``autostate.mypy_plugin``
# without mypy, as on an accelerator machine with only the test wheels):
# their examples are not collected, and a test says so.
_UNIMPORTABLE: list[str] = []


def _docstring_tests() -> list[doctest.DocTest]:
    finder = doctest.DocTestFinder(exclude_empty=True)
    tests = []
    for name in _modules():
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if (e.name or "autostate").partition(".")[0] == "autostate":
                raise
            _UNIMPORTABLE.append(f"{name} needs {e.name}, which is not installed")
            continue
        globs = {
            **vars(module),
            "__name__": "__main__",
            "jax": jax,
            "jnp": jnp,
            "autostate": autostate,
        }
        tests += [t for t in finder.find(module, globs=globs) if t.examples]
    return sorted(tests, key=lambda t: t.name)


_TESTS = _docstring_tests()


@pytest.mark.parametrize("test", _TESTS, ids=[t.name for t in _TESTS])
def test_docstring_examples_run(test: doctest.DocTest):
    out = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=_FLAGS)
    result = runner.run(test, out=out.write, clear_globs=True)
    assert result.failed == 0, out.getvalue()


def test_every_module_imports():
    if _UNIMPORTABLE:
        pytest.skip("; ".join(_UNIMPORTABLE))


def test_every_public_name_shows_an_example():
    without = [
        name for name in autostate.__all__ if ">>>" not in (getattr(autostate, name).__doc__ or "")
    ]
    assert without == []
