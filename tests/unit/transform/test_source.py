"""Reading class source: indentation, byte-order marks, coding cookies.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import traceback
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import pytest
from semantics.harness import assert_same, check, pair
from semantics.programs_shared import POSITIVE_CALLS, TWO_CALLS, Loader

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


@pytest.fixture
def load_bytes(tmp_path: Path) -> Iterator[Callable[[str, bytes], types.ModuleType]]:
    """Imports a module written byte for byte (encodings ``write_module`` cannot write)."""
    added: list[str] = []

    def load(name: str, data: bytes) -> types.ModuleType:
        path = tmp_path / f"{name}.py"
        path.write_bytes(data)
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


TABS = (
    "\n@DECORATE\nclass Tabbed:\n"
    "\tdef __init__(self):\n\t\tself.c = jnp.zeros(())\n"
    "\tdef __call__(self, v):\n"
    "\t\tdoc = '''two\n\tlines'''\n"
    "\t\tself.c = self.c + v + len(doc)\n"
    "\t\treturn self.c * 2\n"
    "\nclass Outer:\n\t@DECORATE\n\tclass Inner:\n"
    "\t\tdef __init__(self):\n\t\t\tself.__c = jnp.ones(())\n"
    "\t\tdef __call__(self, v):\n"
    "\t\t\tself.__c = self.__c * 2 + \\\n\tv\n"
    "\t\t\treturn self.__c\n"
)


SEMICOLONS = """
@DECORATE
class Semi:
    def __init__(self): self.a = jnp.zeros(()); self.b = jnp.ones(())
    def __call__(self, v): self.a = self.a + v; self.b *= 2; return self.a + self.b
    def get(self): return self.a, self.b
"""


BACKSLASH = """
@DECORATE
class Cont:
    def __init__(self):
        self.a = \\
            jnp.zeros(())
    def __call__(self, \\
                 v):
        self.a = self.a + \\
v
        self.a \\
            += 1
        return self.a
"""


DECORATORS = """
def deco(*args, **kwargs):
    def wrap(fn):
        @functools.wraps(fn)
        def inner(*a, **k):
            return fn(*a, **k)
        return inner
    return wrap

@DECORATE
class Decorated:
    def __init__(self):
        self.c = jnp.zeros(())

    @deco(
        1,
        k=(
            2,
        ),
    )

    # a comment between two decorators, after a blank line
    @(lambda fn: fn)
    def __call__(self, v):
        self.c = self.c + v
# a comment at column 0 inside the body
        return self.c
"""


FORMFEED_LINE = (
    "\n@DECORATE\nclass Paged:\n    def __init__(self):\n        self.c = jnp.zeros(())\n"
    "\x0c\n    def __call__(self, v):\n        self.c = self.c + v\n        return self.c\n"
)


CRLF = (
    "\r\n@DECORATE\r\nclass Crlf:\r\n    def __init__(self):\r\n        self.c = jnp.zeros(())\r\n"
    "    def __call__(self, v):\r\n        self.c = self.c + v\r\n        return self.c\r\n"
)


CLASS_KEYWORDS = """
class Meta(type):
    pass

@DECORATE
class Spread(
    object,
    metaclass=Meta,
):
    def __init__(self): self.c = jnp.zeros(())

    def __call__(self, v): self.c = self.c + v; return self.c
"""


@pytest.mark.parametrize(
    ("source", "build", "calls"),
    [
        pytest.param(TABS, "Tabbed()", POSITIVE_CALLS, id="tabs"),
        pytest.param(TABS, "Outer.Inner()", POSITIVE_CALLS, id="tabs-nested-class-continuation"),
        pytest.param(SEMICOLONS, "Semi()", [*POSITIVE_CALLS, ("get", ())], id="semicolons-one-liners"),
        pytest.param(BACKSLASH, "Cont()", POSITIVE_CALLS, id="backslash-continuations"),
        pytest.param(DECORATORS, "Decorated()", POSITIVE_CALLS, id="multi-line-decorators"),
        pytest.param(FORMFEED_LINE, "Paged()", POSITIVE_CALLS, id="form-feed-line"),
        pytest.param(CRLF, "Crlf()", POSITIVE_CALLS, id="crlf"),
        pytest.param(CLASS_KEYWORDS, "Spread()", POSITIVE_CALLS, id="class-statement-spanning-lines"),
    ],
)
def test_source_layouts(write_module: Loader, source: str, build: str, calls: list[Any]) -> None:
    check(*pair(write_module, source), build, calls)


ONE_SPACE = """
@DECORATE
class Narrow:
 def __init__(self):
  self.c = jnp.zeros(())
 def __call__(self, v):
  self.c = self.c + v
  return self.c * 2
"""


def test_one_space_indentation(write_module: Loader) -> None:
    check(*pair(write_module, ONE_SPACE), "Narrow()", POSITIVE_CALLS)


ONE_SPACE_IN_FUNCTION = """
def make():
    @DECORATE
    class Narrow:
     def __init__(self):
      self.c = jnp.zeros(())
     def __call__(self, v):
      self.c = self.c + v
      return self.c * 2
    return Narrow

Narrow = make()
"""


def test_one_space_indentation_inside_a_function(write_module: Loader) -> None:
    check(*pair(write_module, ONE_SPACE_IN_FUNCTION), "Narrow()", POSITIVE_CALLS)


FORMFEED_INDENT = (
    "\n@DECORATE\nclass Paged:\n    def __init__(self):\n        self.c = jnp.zeros(())\n"
    "\x0c    def __call__(self, v):\n        self.c = self.c + v\n        return self.c\n"
)


def test_form_feed_before_indentation(write_module: Loader) -> None:
    check(*pair(write_module, FORMFEED_INDENT), "Paged()", POSITIVE_CALLS)


LATIN1 = (
    "# -*- coding: latin-1 -*-\nimport jax.numpy as jnp\nimport autostate\n\n\n"
    "@autostate.stateful\nclass Cafe:\n    def __init__(self):\n        self.c = jnp.zeros(())\n"
    "    def __call__(self, x):\n        # r\xe9sum\xe9\n"
    "        self.c = self.c + x + len('\xe9t\xe9')\n        return self.c\n"
)


def test_latin1_coding_cookie(load_bytes: Callable[[str, bytes], types.ModuleType]) -> None:
    module = load_bytes("autostate_testmod_latin1", LATIN1.encode("latin-1"))
    model = module.Cafe()
    assert_same([4.0, 8.0], [model(1.0), model(1.0)])
    f, states = module.Cafe().functionalize()
    out, states = jax.jit(lambda f, s, x: f(s, x))(f, states, 1.0)
    out, states = jax.jit(lambda f, s, x: f(s, x))(f, states, 1.0)
    assert_same(8.0, out)


def test_utf8_bom(load_bytes: Callable[[str, bytes], types.ModuleType]) -> None:
    source = (
        "import jax.numpy as jnp\nimport autostate\n\n\n@autostate.stateful\nclass Bom:\n"
        "    def __init__(self):\n        self.c = jnp.zeros(())\n"
        "    def __call__(self, x):\n        self.c = self.c + x\n        return self.c\n"
    )
    module = load_bytes("autostate_testmod_bom", b"\xef\xbb\xbf" + source.encode())
    f, states = module.Bom().functionalize()
    _, states = f(states, 1.0)
    out, _ = jax.jit(lambda f, s, x: f(s, x))(f, states, 2.0)
    assert_same(3.0, out)


ONE_SPACE_BLOCKS = (
    "\n@DECORATE\nclass Narrow:\n"
    " def __init__(self):\n"
    "  self.c = jnp.zeros(())\n"
    " def __call__(self, v):\n"
    "  '''a docstring\n kept as written'''\n"
    "  for i in range(2):\n"
    "   if i:\n"
    "    self.c = self.c + v\n"
    "   else:\n"
    "   \tself.c = self.c * 2\n"
    "  return self.c, len(Narrow.__call__.__doc__)\n"
)


FORM_FEEDS = (
    "\n@DECORATE\nclass Paged:\n"
    "\x0c    def __init__(self):\n"
    "        self.c = jnp.zeros(())\n"
    "    def __call__(self, v):\n"
    "\x0c        self.c = self.c + v\n"
    "        if True:\n"
    "  \x0c          self.c = self.c * 2\n"
    "        return self.c\n"
)


TAB_BODY_UNDER_SPACES = (
    "\n@DECORATE\nclass Mixed:\n"
    "  def __init__(self):\n"
    "  \tself.c = jnp.zeros(())\n"
    "  def __call__(self, v):\n"
    "  \tfor i in range(2):\n"
    "  \t  self.c = self.c + v\n"
    "  \treturn self.c\n"
)


MODULE_LEVEL_FUNCTION = """
def step(self, v):
    self.c = self.c + v
    return self.c

@DECORATE
class Assigned:
    def __init__(self):
        self.c = jnp.zeros(())
    __call__ = step
"""


@pytest.mark.parametrize(
    ("source", "build"),
    [
        pytest.param(ONE_SPACE_BLOCKS, "Narrow()", id="one-space-nested-blocks"),
        pytest.param(FORM_FEEDS, "Paged()", id="form-feeds"),
        pytest.param(TAB_BODY_UNDER_SPACES, "Mixed()", id="tab-body-under-spaces"),
        pytest.param(MODULE_LEVEL_FUNCTION, "Assigned()", id="module-level-function"),
    ],
)
def test_indentations(write_module: Loader, source: str, build: str) -> None:
    check(*pair(write_module, source), build, TWO_CALLS)
