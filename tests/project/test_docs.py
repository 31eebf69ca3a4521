"""The documentation's code runs and says what it prints or raises.

Conventions in ``README.md`` and ``docs/*.md``:

* a ```` ```python ```` block that imports autostate is a complete program; it
  is saved as ``example.py`` (decoration reads source files) and run;
* its top-level ``print(...)`` lines print one line each, and a trailing
  ``# comment`` on such a line must contain what it printed (whitespace
  collapsed);
* a ```` ```text ```` block right after it that starts with ``SomeError:`` is
  the exception the program must raise, message included (handler ids and
  memory addresses aside).

A block may be indented (inside a ``=== "tab"`` of the side-by-side
migration guides); it is dedented first. Blocks of other libraries' code
(PyTorch, Flax, ...) do not import autostate, so they are shown, never run:
those libraries are not test dependencies.

A block that asks XLA for 8 devices (``xla_force_host_platform_device_count``)
runs in its own process, in ``tests/unit/test_sharding.py``. Other blocks (shell commands, generated code) are not run; the generated code
in ``docs/rewrite_rules.md`` is compared with what the rewrite produces for the
example class above it.
"""

from __future__ import annotations

import contextlib
import io
import linecache
import re
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>\w*)\n(?P<code>.*?)^(?P=indent)```$", re.M | re.S)
_PRINT = re.compile(r"^print\(.*\)\s*#\s*(?P<expected>.*)$")
_ERROR = re.compile(r"^\w+: ")


def _blocks(text: str) -> list[tuple[str, str, int]]:
    """``(language, code, offset)`` of every fenced block, less its fence's indent."""
    blocks = []
    for m in _FENCE.finditer(text):
        indent = re.compile(f"^{m['indent']}", re.M)
        blocks.append((m["lang"], indent.sub("", m["code"]), m.start()))
    return blocks


def _examples():
    for doc in DOCS:
        blocks = _blocks(doc.read_text())
        for i, (lang, code, start) in enumerate(blocks):
            if lang != "python" or not re.search(r"^(import|from) autostate\b", code, re.M):
                continue
            if "xla_force_host_platform_device_count" in code:
                continue  # needs a fresh process with 8 devices: tests/unit/test_sharding.py
            nxt = blocks[i + 1] if i + 1 < len(blocks) else None
            error = nxt[1].strip() if nxt and nxt[0] == "text" and _ERROR.match(nxt[1]) else None
            line = doc.read_text().count("\n", 0, start) + 1
            yield pytest.param(code, error, id=f"{doc.relative_to(ROOT)}:{line}")


def _normalize(text: str) -> str:
    text = re.sub(r"local_state_\d+", "local_state_N", text)
    return re.sub(r"0x[0-9a-f]+", "0x...", text)


def _squash(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize(("code", "error"), list(_examples()))
def test_doc_example(code: str, error: str | None, tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "example.py").write_text(code)
    linecache.clearcache()  # every example is "example.py"; never reuse another's lines
    out = io.StringIO()
    raised = None
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_path("example.py", run_name="__main__")
        except Exception as exc:  # noqa: BLE001 - compared with the documented error
            raised = exc
    if error is not None:
        assert raised is not None, "the example was documented to raise, but did not"
        assert _normalize(f"{type(raised).__name__}: {raised}") == _normalize(error)
        return
    if raised is not None:
        raise raised
    prints = [_PRINT.match(line) for line in code.splitlines() if line.startswith("print(")]
    lines = out.getvalue().splitlines()
    assert len(lines) == len(prints), out.getvalue()
    for match, actual in zip(prints, lines):
        if match is not None:
            assert _squash(actual) in _squash(match.group("expected")), (actual, match.group(0))


def test_rewrite_rules_show_the_generated_code(tmp_path: Path, monkeypatch):
    """docs/rewrite_rules.md shows what the rewrite really generates for its example."""
    from autostate.transform import analysis, rewrite, source

    blocks = _blocks((ROOT / "docs" / "rewrite_rules.md").read_text())
    index = next(i for i, (_, code, _) in enumerate(blocks) if "class Example:" in code)
    text, documented = blocks[index][1], blocks[index + 1][1]
    # The class undecorated, so that the pure analysis and rewrite can be called directly.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "example.py").write_text(text.replace("@autostate.stateful\n", ""))
    linecache.clearcache()
    cls = runpy.run_path("example.py")["Example"]
    slots = source.find_methods(cls)
    facts = [analysis.collect_facts("Example", source.method_source(cls, s)) for s in slots]
    result = analysis.analyze_class("Example", facts)
    methods = []
    for slot, method in zip(slots, result.methods):
        text = rewrite.rewrite_method(
            method.module,
            method.function,
            method.receiver,
            result.state,
            "Example",
            is_init=slot.attr == "__init__",
        )
        methods.append(text.split(f"def {analysis.OUTER_NAME}(", 1)[1].split("\n", 1)[1].rstrip())
    assert "\n\n".join(methods) == documented.rstrip()


def test_every_public_layer_has_a_reference_entry():
    """``docs/nn.md`` has one ``::: autostate.nn.<name>`` entry per public name
    of ``autostate.nn`` (and none for a name it does not export); every layer
    class says what differs from PyTorch, in a section the reference renders."""
    import inspect

    import autostate.nn as nn

    text = (ROOT / "docs" / "nn.md").read_text()
    entries = re.findall(r"^::: autostate\.nn\.(\w+)$", text, re.M)
    assert sorted(entries) == sorted(nn.__all__)
    assert len(entries) == len(set(entries))
    for name in nn.__all__:
        value = getattr(nn, name)
        if inspect.isclass(value):
            assert "\nDifferences from PyTorch:\n" in inspect.getdoc(value), name
