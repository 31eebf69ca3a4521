"""transform/loop_facts.py: what the analysis finds of each ``for`` statement."""

from __future__ import annotations

import textwrap

import libcst as cst

from autostate.transform import loop_facts


def _loops_of(body: str) -> tuple:
    text = "class C:\n def m(self, x, xs):\n" + textwrap.indent(textwrap.dedent(body), "  ")
    function = cst.parse_module(text).body[0].body.body[0]
    return loop_facts.loop_facts(function, "self", "C")


def test_loop_facts_name_what_the_body_binds_reads_first_and_leaves_live():
    (loop,) = _loops_of("""
        h, n = None, 0
        for b in self.blocks:
            h = b(x)          # bound before it is read
            x = x + h         # read first (and bound)
            n += 1            # read first
            tmp = x * 2       # bound only
            if x is None:
                late = 1      # bound in a branch: not surely
            y = late
        return x + h
    """)
    assert loop.targets == ("b",) and loop.reason is None and loop.may_roll
    assert loop.bound == {"h", "x", "n", "tmp", "late", "y"}
    assert {"x", "n", "late", "b"} <= loop.read_first and not {"h", "tmp"} & loop.read_first
    assert loop.live is not None and {"x", "h"} <= loop.live and "tmp" not in loop.live
    assert loop.carried == ("h", "late", "n", "x") and not loop.wants_last
    # A function reading the locals by name: any may be live.
    (by_name,) = _loops_of("for b in self.blocks:\n    x = b(x)\nreturn locals()\n")
    assert by_name.live is None and by_name.wants_last


def test_loop_facts_list_every_for_statement_in_source_order():
    found = _loops_of("""
        for i in range(3):
            for b in self.blocks:
                x = b(x)
        def inner(self):
            for c in self.blocks:
                break
        class Local:
            for k in xs:  # (a class body's: not the method's)
                pass
        for a, (b, c) in zip(xs, xs):
            pass
    """)
    assert [f.targets for f in found] == [("i",), ("b",), ("c",), ("a", "b", "c")]
    assert [f.may_roll for f in found] == [False, True, True, True]
    assert found[2].reason == "a `break` or `continue` in its body"
    assert found[1].receiver == "self" and found[2].receiver is None  # (``inner``'s own self)
