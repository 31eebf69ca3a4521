"""Packaging facts a release depends on: one version, a licence, links that work on PyPI."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

import pytest

import autostate

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def installed_metadata() -> importlib.metadata.PackageMetadata:
    """The installed package's metadata; skips where the checkout is imported from
    ``PYTHONPATH`` without an install (``make test-accel`` on an offline machine)."""
    try:
        return importlib.metadata.metadata("autostate")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("autostate is imported from the checkout, not installed: no package metadata")


def test_the_version_is_written_once_and_the_metadata_reads_it():
    """pyproject.toml holds the version; ``autostate.__version__`` is the
    installed package's metadata (an editable install's too), never a copy."""
    assert re.fullmatch(r"\d+\.\d+\.\d+", PYPROJECT["version"])
    assert "version" not in PYPROJECT.get("dynamic", [])
    source = (ROOT / "autostate" / "__init__.py").read_text()
    assert PYPROJECT["version"] not in source
    assert installed_metadata()["Version"] == autostate.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", autostate.__version__)


def test_the_licence_is_apache_2_and_ships_with_the_package():
    assert PYPROJECT["license"] == "Apache-2.0"
    assert PYPROJECT["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
    assert installed_metadata()["License-Expression"] == "Apache-2.0"


def test_every_runtime_dependency_has_a_lower_bound():
    for requirement in PYPROJECT["dependencies"]:
        assert re.fullmatch(r"[A-Za-z0-9_.-]+>=[0-9.]+", requirement), requirement
    assert PYPROJECT["requires-python"] == ">=3.11"


def test_readme_links_are_absolute_so_they_work_on_pypi():
    links = re.findall(r"\]\(([^)]+)\)", (ROOT / "README.md").read_text())
    assert links
    assert [link for link in links if not link.startswith("https://")] == []


def test_the_api_reference_shows_every_public_name_with_a_runnable_example():
    text = (ROOT / "docs" / "api.md").read_text()
    for name in autostate.__all__:
        assert getattr(autostate, name).__doc__, f"{name} has no docstring"
        # The defining module's path where a submodule shadows the name
        # (none today: the file-format module is autostate.serialization).
        directive = re.search(rf"^::: autostate\.(\w+\.)?{name}\n", text, re.M)
        assert directive, f"docs/api.md does not render {name}"
        after = text[directive.end() :]
        example = re.search(r"^```python\n(.*?)^```$", after, re.M | re.S)
        assert example and re.search(r"^(import|from) autostate\b", example.group(1), re.M)
        assert name in example.group(1), f"the example after {name} does not use it"
