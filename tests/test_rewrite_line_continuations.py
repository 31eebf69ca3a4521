"""Line continuations inside rewritten statements keep every line where it was.

A rewrite leaves out source (``self.x`` and ``=`` become ``set(self, "x", …)``);
where that source spanned lines (a backslash after ``=`` or before ``.x``, a
newline inside a target's brackets or an annotation's parentheses), the new
call must hold the same line breaks, or every later line of the method moves
up: ``f_lineno``, tracebacks and errors that name the user's line.

Each method below writes or reads a state across a continuation, then reports
its own line (``report``); ``boom="value"`` raises inside the continued
statement, ``boom="after"`` on the line after it. The plain class (undecorated)
is the reference: outputs and attributes eagerly and through
``functionalize()``, and the line a traceback gives for the method's frame
(and its column, where the loader keeps one). The generated source is also
checked directly, for each kind of left-out source, in methods and ``__init__``.
"""

from __future__ import annotations

import textwrap
import traceback
import types
from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp
import pytest
from differential import Loader, check, pair  # noqa: I001 - tests/ is on sys.path

from autostate.transform import analysis, rewrite

X1 = jnp.float32(1.5)

SOURCE = r'''
import sys


def report(value, boom=False):
    """``value`` and the caller's line (from its ``def``); raises there if ``boom``."""
    caller = sys._getframe(1)
    line = caller.f_lineno - caller.f_code.co_firstlineno
    if boom:
        raise ValueError(f"boom after, line {line}")
    return value, line


def raise_if(boom, value):
    if boom:
        raise ValueError("boom in the value")
    return value


@DECORATE
class Cont:
    def __init__(self, boom=None):
        self.x = \
            raise_if(boom == "value", jnp.zeros(()))
        self \
            .items = [jnp.zeros(()), jnp.ones(()), jnp.full((), 2.0)]
        self.d: dict = \
            {"a": jnp.ones(())}
        self.n = jnp.ones(())
        self.n \
            += 1
        self.init_line = report(0, boom == "after")[1]

    def assign_after_eq(self, v, boom=None):
        self.x = \
            raise_if(boom == "value", v)
        return report(self.x, boom == "after")

    def assign_before_eq(self, v, boom=None):
        self.x \
            = raise_if(boom == "value", self.x + v)
        return report(self.x, boom == "after")

    def assign_value_continues(self, v, boom=None):
        self.x = \
            raise_if(boom == "value",
                     v)
        return report(self.x, boom == "after")

    def assign_dot(self, v, boom=None):
        self \
            .x = raise_if(boom == "value", v)
        return report(self.x, boom == "after")

    def assign_parenthesized_target(self, v, boom=None):
        (self.x  # a comment
         ) = raise_if(boom == "value", v)
        return report(self.x, boom == "after")

    def assign_then_semicolon(self, v, boom=None):
        self.x = v \
            ; y = raise_if(boom == "value", 1)
        return report(self.x + y, boom == "after")

    def aug_after_op(self, v, boom=None):
        self.x += \
            raise_if(boom == "value", v)
        return report(self.x, boom == "after")

    def aug_before_op(self, v, boom=None):
        self.x \
            *= raise_if(boom == "value", v)
        return report(self.x, boom == "after")

    def aug_dot(self, v, boom=None):
        self \
            .x -= raise_if(boom == "value", v)
        return report(self.x, boom == "after")

    def aug_inside_value(self, v, boom=None):
        self.x += v + \
            raise_if(boom == "value", v)
        return report(self.x, boom == "after")

    def read_dot(self, v, boom=None):
        y = self \
            .x + raise_if(boom == "value", v)
        self.x = y
        return report(self.x, boom == "after")

    def read_in_condition(self, v, boom=None):
        if self \
                .x < v:
            self.x = v
        return report(self.x, boom == "after")

    def setitem_after_eq(self, v, boom=None):
        self.items[0] = \
            raise_if(boom == "value", v)
        return report(list(self.items), boom == "after")

    def setitem_dot(self, v, boom=None):
        self \
            .items[1] = raise_if(boom == "value", v)
        return report(list(self.items), boom == "after")

    def setitem_key_lines(self, v, boom=None):
        self.items[
            2
        ] = v
        return report(list(self.items), boom == "after")

    def setitem_key_spans_lines(self, v, boom=None):
        self.items[int(
            1)] = v
        return report(list(self.items), boom == "after")

    def setitem_dict(self, v, boom=None):
        self.d["a"] \
            = raise_if(boom == "value", v)
        return report(dict(self.d), boom == "after")

    def augitem_after_op(self, v, boom=None):
        self.items[0] += \
            raise_if(boom == "value", v)
        return report(list(self.items), boom == "after")

    def augitem_key_lines(self, v, boom=None):
        self.items[
            1] *= raise_if(boom == "value", v)
        return report(list(self.items), boom == "after")

    def augitem_dict(self, v, boom=None):
        self.d \
            ["a"] += raise_if(boom == "value", v)
        return report(dict(self.d), boom == "after")

    def annassign_after_eq(self, v, boom=None):
        self.x: jax.Array = \
            raise_if(boom == "value", v)
        return report(self.x, boom == "after")

    def annassign_annotation_lines(self, v, boom=None):
        self.x: (jax.Array
                 | None) = raise_if(boom == "value", v)
        return report(self.x, boom == "after")

    def annassign_item(self, v, boom=None):
        self.items[0]: float = \
            raise_if(boom == "value", v)
        return report(list(self.items), boom == "after")

    def chain_local_and_state(self, v, boom=None):
        a = self.x = \
            raise_if(boom == "value", v)
        return report(a + self.x, boom == "after")

    def chain_two_states(self, v, boom=None):
        self.x = self.items[2] = \
            raise_if(boom == "value", v)
        return report((self.x, list(self.items)), boom == "after")

    def tuple_targets(self, v, boom=None):
        self.x, self \
            .items = raise_if(boom == "value", v), [a + v for a in self.items]
        return report((self.x, list(self.items)), boom == "after")

    def for_target(self, v, boom=None):
        for self \
                .x in [v, v + 1]:
            pass
        return report(self.x, boom == "after")

    def del_item(self, v, boom=None):
        self.d["b"] = v
        del self \
            .d["b"]
        return report(dict(self.d), boom == "after")

    def setattr_call(self, v, boom=None):
        setattr(self, "x",
                raise_if(boom == "value", v))
        return report(self.x, boom == "after")

    def object_setattr_dot(self, v, boom=None):
        object \
            .__setattr__(self, "x", raise_if(boom == "value", v))
        return report(self.x, boom == "after")

    def getattr_call(self, v, boom=None):
        y = getattr(
            self, "x") + raise_if(boom == "value", v)
        return report(y, boom == "after")

    def object_getattribute_dot(self, v, boom=None):
        y = object \
            .__getattribute__(self, "x") + raise_if(boom == "value", v)
        return report(y, boom == "after")

    def instance_dict_dot(self, v, boom=None):
        y = self \
            .__dict__["x"] + raise_if(boom == "value", v)
        return report(y, boom == "after")

    def vars_call(self, v, boom=None):
        y = vars(
            self)["x"] + raise_if(boom == "value", v)
        return report(y, boom == "after")

    def fstring_fields(self, v, boom=None):
        self.x = v
        s = f"""{self
                 .x}"""
        t = f"""{self.x
                 = }"""
        return report((self.x, s, t.count("\n")), boom == "after")

    def control_flow_dot(self, v, boom=None):
        self.x = lax \
            .fori_loop(0, 2, lambda i, c: c + v, raise_if(boom == "value", self.x))
        return report(self.x, boom == "after")
'''

METHODS = [
    line.strip()[4:].split("(")[0]
    for line in SOURCE.splitlines()
    if line.startswith("    def ") and not line.startswith("    def __")
]
# Methods whose continued statement calls ``raise_if`` (``boom="value"``). In
# ``setitem_key_*`` the keys span lines and ``setitem`` takes them after the
# value, so only the statement's number of lines is kept, not the value's line.
RAISES_IN_VALUE = [
    name for name in METHODS
    if name not in ("read_in_condition", "setitem_key_lines", "setitem_key_spans_lines",
                    "for_target", "del_item", "fstring_fields")
]
BOOMS = [(name, "after") for name in METHODS] + [(name, "value") for name in RAISES_IN_VALUE]


@pytest.fixture
def modules(write_module: Loader) -> tuple[types.ModuleType, types.ModuleType]:
    return pair(write_module, SOURCE)


def test_every_method_is_listed(modules: tuple[types.ModuleType, types.ModuleType]) -> None:
    plain, _ = modules
    assert sorted(METHODS) == sorted(n for n in vars(plain.Cont) if not n.startswith("__"))


@pytest.mark.parametrize("method", METHODS)
def test_values_and_lines_match_plain_python(
    modules: tuple[types.ModuleType, types.ModuleType], method: str
) -> None:
    plain, dec = modules
    # The outputs hold the line ``report`` saw: eagerly and through ``f``.
    check(plain, dec, "Cont()", [(method, (X1,)), (method, (X1,))], modes=("eager", "f"))


def test_init_lines_match_plain_python(modules: tuple[types.ModuleType, types.ModuleType]) -> None:
    plain, dec = modules
    assert dec.Cont().init_line == plain.Cont().init_line == 10


def _method_frame(err: BaseException, name: str) -> tuple[int, str, int | None]:
    """Where the traceback of ``err`` has the frame of ``name``: the line from
    the ``def``, that line's text in the file and the column (None where the
    loader dropped the columns of a rewritten line)."""
    tb = err.__traceback__
    frames = [
        (frame, summary)
        for (frame, _), summary in zip(traceback.walk_tb(tb), traceback.extract_tb(tb))
        if frame.f_code.co_name == name
    ]
    assert frames, f"no frame of {name} in the traceback"
    frame, summary = frames[-1]
    assert summary.lineno is not None
    text = Path(frame.f_code.co_filename).read_text().splitlines()[summary.lineno - 1]
    return summary.lineno - frame.f_code.co_firstlineno, text.strip(), summary.colno


def _raise(call: Callable[[], object]) -> BaseException:
    with pytest.raises(ValueError) as info:
        call()
    return info.value


@pytest.mark.parametrize(("method", "boom"), BOOMS)
def test_traceback_points_at_the_users_line(
    modules: tuple[types.ModuleType, types.ModuleType], method: str, boom: str
) -> None:
    plain, dec = modules
    expected = _method_frame(_raise(lambda: getattr(plain.Cont(), method)(X1, boom)), method)
    assert ("raise_if(" if boom == "value" else "report(") in expected[1]
    eager = _method_frame(_raise(lambda: getattr(dec.Cont(), method)(X1, boom)), method)
    f, states = dec.Cont().functionalize()
    through_f = _method_frame(_raise(lambda: getattr(f, method)(states, X1, boom)), method)
    for got in (eager, through_f):
        assert got[:2] == expected[:2]
        assert got[2] in (None, expected[2])


def test_a_line_the_rewrite_left_as_written_keeps_its_columns(
    modules: tuple[types.ModuleType, types.ModuleType],
) -> None:
    # ``raise_if(boom == "value",`` is the user's line, character for
    # character: the traceback underlines it as in plain Python.
    plain, dec = modules
    expected = _method_frame(_raise(lambda: plain.Cont().assign_value_continues(X1, "value")),
                             "assign_value_continues")
    got = _method_frame(_raise(lambda: dec.Cont().assign_value_continues(X1, "value")),
                        "assign_value_continues")
    assert got == expected
    assert got[2] is not None


@pytest.mark.parametrize("boom", ["value", "after"])
def test_init_traceback_points_at_the_users_line(
    modules: tuple[types.ModuleType, types.ModuleType], boom: str
) -> None:
    plain, dec = modules
    expected = _method_frame(_raise(lambda: plain.Cont(boom)), "__init__")
    got = _method_frame(_raise(lambda: dec.Cont(boom)), "__init__")
    assert got[:2] == expected[:2]
    assert got[2] in (None, expected[2])


# --- the generated source ----------------------------------------------------------------


def _rewritten(
    body: str, state: frozenset[str], *, is_init: bool = False, control: dict[str, str] | None = None
) -> tuple[list[str], list[str]]:
    """(original, rewritten) lines of the wrapper source of one method."""
    text = textwrap.indent(textwrap.dedent(body).lstrip("\n"), "    ")
    source = analysis.MethodSource(
        key="m", attr="m", filename="model.py", first_line=10, text=text, freevars=(),
        has_receiver=True, mangle_as="M",
    )
    facts = analysis.collect_facts("M", source)
    new = rewrite.rewrite_method(
        facts.module, facts.function, "self", state, "M", is_init=is_init, control=control
    )
    return analysis.wrapper_source("M", source)[0].splitlines(), new.splitlines()


def _line_of(lines: list[str], marker: str) -> int:
    found = [n for n, line in enumerate(lines) if marker in line]
    assert len(found) == 1, (marker, lines)
    return found[0]


STATEMENTS = {
    "assign": "self.x = \\\n    mark()",
    "assign_before_eq": "self.x \\\n    = mark()",
    "assign_dot": "self \\\n    .x = mark()",
    "aug": "self.x += \\\n    mark()",
    "aug_dot": "self \\\n  .x \\\n    += mark()",
    "read": "y = self \\\n    .x + mark()",
    "read_parenthesized_receiver": "y = (self\n     ).x + mark()",
    "setitem": "self.a[0] = \\\n    mark()",
    "setitem_subscript_continued": "self.a \\\n    [0] = mark()",
    "augitem_key_lines": "self.a[\n    0][\n    1] += mark()",
    "annassign": "self.x: (int\n         | None) = \\\n    mark()",
    "annassign_item": "self.a[0]: int \\\n    = mark()",
    "chain": "y = self.x = \\\n    mark()",
    "setattr_object": "object \\\n    .__setattr__(self, 'x', mark())",
    "getattr_object": "y = object \\\n    .__getattribute__(self, 'x'), mark()",
    "for_target": "for self \\\n        .x in mark():\n    pass",
    "dict_read": "y = self \\\n    .__dict__, mark()",
    "vars_read": "y = vars \\\n    (self), mark()",
    "proxy_parenthesized_receiver": "del (self\n     ).a[0]; mark()",
    "semicolon": "self.x = 1 \\\n    ; mark()",
    # Inside an f-string's braces a backslash is a syntax error before 3.12.
    "fstring_read": 'y = f"""{self\n    .x}""", mark()',
    "fstring_self_documenting": 'y = f"""{self\n    .x\n    = }""", mark()',
    "fstring_getattribute": 'y = f"""{object\n    .__getattribute__(self, "x")}""", mark()',
}


@pytest.mark.parametrize("statement", STATEMENTS.values(), ids=list(STATEMENTS))
@pytest.mark.parametrize("is_init", [False, True], ids=["method", "init"])
def test_generated_source_keeps_the_lines(statement: str, is_init: bool) -> None:
    body = "def m(self):\n" + textwrap.indent(statement, "    ") + "\n    return after()\n"
    old, new = _rewritten(body, frozenset({"x", "a"}), is_init=is_init)
    assert new != old
    compile("\n".join(new), "model.py", "exec")
    assert len(new) == len(old)
    # The code the statement continues to, and what follows it, stay on their line.
    assert _line_of(new, "mark()") == _line_of(old, "mark()")
    assert _line_of(new, "after()") == _line_of(old, "after()")


@pytest.mark.parametrize(
    "statement",
    ["self.x = \\\n    mark()", "self.x \\\n    += mark()", "self \\\n    .x = mark()",
     "y = lax \\\n    .scan(mark())"],
)
def test_generated_source_keeps_the_column_after_a_backslash(statement: str) -> None:
    body = "def m(self):\n" + textwrap.indent(statement, "    ") + "\n"
    old, new = _rewritten(body, frozenset({"x"}), control={"lax.scan": "scan"})
    line = _line_of(old, "mark()")
    assert new[line].index("mark()") == old[line].index("mark()")


def test_keys_spanning_lines_after_the_value_keep_the_statements_lines() -> None:
    # ``setitem`` takes the value before the keys: the keys' own line breaks
    # follow the value, which moves up, but the statement keeps its lines.
    old, new = _rewritten(
        "def m(self):\n    self.a[f(\n        0)] = mark()\n    return after()\n", frozenset({"a"})
    )
    assert len(new) == len(old)
    assert _line_of(new, "after()") == _line_of(old, "after()")
    assert _line_of(new, "f(") == _line_of(old, "f(")


def test_one_line_statements_are_unchanged_in_shape() -> None:
    _, new = _rewritten("def m(self, v):\n    self.x = v\n    self.x += self.x\n", frozenset({"x"}))
    assert new[-2].strip() == '__autostate__.set(self, "x", v)'
    assert new[-1].strip() == (
        '__autostate__.set(self, "x", __autostate__.iadd(__autostate__.get(self, "x"), '
        '__autostate__.get(self, "x")))'
    )

