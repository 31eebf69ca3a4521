"""transform/loops.py: the rolled form each ``for`` loop gets from the analysis's facts."""

from __future__ import annotations

import ast
import textwrap

import libcst as cst
import pytest

from autostate.transform import loop_facts, loops
from autostate.transform.method import OUTER_NAME


def rolled(body: str, state: frozenset[str] = frozenset()) -> ast.FunctionDef:
    """The method ``m`` of a wrapper module around ``body``, after ``roll_loops``
    with the facts ``loop_facts.loop_facts`` finds (in a class whose states are ``state``)."""
    method = textwrap.indent(textwrap.dedent(body), " " * 12)
    text = f"class C:\n    def {OUTER_NAME}():\n        def m(self, x, xs):\n{method}"
    function = cst.parse_module(text).body[0].body.body[0].body.body[0]  # type: ignore[attr-defined]
    facts = loop_facts.loop_facts(function, "self", "C")
    tree = ast.parse(text)
    loops.roll_loops(tree, "m", "__autostate__", facts, state)
    compile(tree, "<test>", "exec")  # (what it made compiles)
    outer = tree.body[0].body[0]  # type: ignore[attr-defined]
    return outer.body[-1]


def functions(method: ast.FunctionDef) -> list[ast.FunctionDef]:
    return [n for n in ast.walk(method) if isinstance(n, ast.FunctionDef) and n is not method]


def unrolled_reasons(method: ast.FunctionDef) -> list[str]:
    return [
        n.args[1].value  # type: ignore[attr-defined]
        for n in ast.walk(method)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "unrolled"
    ]


def test_a_loop_gets_its_body_as_a_function_of_what_it_carries() -> None:
    method = rolled("""
        n = 0
        for block in self.blocks:
            x = block(x)
            h = x * 2
            tmp = x + 1
        return x, h, block
    """)
    (body,) = functions(method)
    assert body.name == "__autostate_body_1"
    run = next(n for n in ast.walk(method) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "run")
    names, reads, wants_last = (ast.literal_eval(a) for a in run.args[2:])
    # x: read and live; h: live after the loop only; tmp: neither (dropped).
    assert names == ("h", "x") and reads == (False, True) and wants_last is True
    # The body keeps its lines in both copies; what is added takes the for's line.
    lines = sorted({n.lineno for n in ast.walk(method) if isinstance(n, ast.Assign) and "block" in ast.unparse(n)})
    for_line = next(n.lineno for n in ast.walk(method) if isinstance(n, ast.For))
    assert body.lineno == for_line and for_line + 1 in lines


def test_a_local_assigned_before_the_body_reads_it_is_not_carried() -> None:
    method = rolled("""
        h, n = None, 0
        for block in self.blocks:
            h = block(x)
            x = x + h
            n += 1
        h += 1
        return x
    """)
    run = next(n for n in ast.walk(method) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "run")
    names, reads, _ = (ast.literal_eval(a) for a in run.args[2:])
    # h: assigned first, read after the loop (by `h += 1`); n: read first (`n += 1`).
    assert names == ("h", "n", "x") and reads == (False, True, True)


_CALLS_G = "its body calls `g`, a function defined outside the loop that reads a local the body assigns"
_CALLS_H = _CALLS_G.replace("`g`", "`h`")
_HANDED_G = "`g`, a function defined outside the loop that reads a local its body assigns, is handed on"
_HANDED = "a function defined outside the loop reads a local its body assigns and is handed on"


@pytest.mark.parametrize(
    ("loop", "reason"),
    [
        ("for b in self.blocks:\n    x = b(x)\n    if x is None:\n        break", "a `break` or `continue` in its body"),
        ("for b in self.blocks:\n    continue", "a `break` or `continue` in its body"),
        ("for b in self.blocks:\n    return b(x)", "a `return` in its body"),
        ("for b in self.blocks:\n    yield b(x)", "a `yield` in its body"),
        ("for b in self.blocks:\n    global g\n    g = b(x)", "a `global` or `nonlocal` statement in its body"),
        ("for b in self.blocks:\n    del x", "a `del` of a local in its body"),
        ("for b in self.blocks:\n    def g():\n        pass", "a nested `def` in its body"),
        ("for b in self.blocks:\n    x = super().f(b)", "a zero-argument `super()` in its body"),
        ("for b in self.blocks:\n    x = locals()", "a call of `locals()` in its body"),
        ("for b in self.blocks:\n    x = eval('b(x)')", "a call of `eval()` in its body"),
        ("for self.b in self.blocks:\n    pass", "its target is not a name or a tuple of names"),
        ("for b in self.blocks:\n    xs.append(b(x))", "its body changes `xs` in place"),
        ("for b in self.blocks:\n    xs[0] = b(x)", "its body changes `xs` in place"),
        ("for b in self.blocks:\n    b.cache['k'] = x", "its body changes `b` in place"),
        ("for b in self.blocks:\n    b = b.inner", "its body assigns the loop variable"),
        ("for b in self.blocks:\n    self.log.append(x)", "its body changes `self` in place"),
        ("for b in self.blocks:\n    x = b(x) if __class__ else x", "`__class__` in its body"),
        # A function that can see one step's locals: called in the body (itself,
        # through another, or reading the loop variable), or handed on.
        ("g = lambda: x\nfor b in self.blocks:\n    x = b(g())", _CALLS_G),
        ("def g():\n    return x\nh = lambda: g()\nfor b in self.blocks:\n    x = b(h())", _CALLS_H),
        ("g = lambda: b\nfor b in self.blocks:\n    x = g()(x)", _CALLS_G),
        ("g = lambda: x\nhooks = [g]\nfor b in self.blocks:\n    x = b(x)", _HANDED_G),
        ("xs.register(lambda: x)\nfor b in self.blocks:\n    x = b(x)", _HANDED),
        # Made after the loop, but on an earlier trip of a loop around both: it may run in it.
        ("g = None\nfor _ in range(2):\n    for b in self.blocks:\n        x = b(g() if g else x)\n    g = lambda: x", _CALLS_G),
        # Made in the body and kept after the loop: it would see the scan's values.
        ("for b in self.blocks:\n    x = b(x)\n    g = lambda: x\ny = g()", "`g`, a function its body makes that reads a local the body assigns, is read after the loop"),
    ],
)
def test_a_loop_a_function_cannot_carry_stays_as_written(loop: str, reason: str) -> None:
    method = rolled(loop + "\nreturn x\n")
    assert not functions(method) or all(f.name == "g" for f in functions(method))
    assert unrolled_reasons(method) == [reason]


@pytest.mark.parametrize(
    "body",
    [
        # Made after the loop: it reads the locals the loop leaves.
        "for b in self.blocks:\n    x = b(x)\ng = lambda: x\nreturn g()",
        # Made before, only ever called outside the body: the same.
        "g = lambda: x\nfor b in self.blocks:\n    x = b(x)\nreturn g()",
        "def g(scale):\n    return x * scale\ny = g(1)\nfor b in self.blocks:\n    x = b(x)\nreturn g(2) + y",
        # Reading no local the body assigns; made in the body and used in its step.
        "act = lambda v: v * 2\nxs.register(act)\nfor b in self.blocks:\n    x = b(act(x))\nreturn x",
        "for b in self.blocks:\n    f = lambda v: v * x\n    x = b(f(x))\nreturn x",
        "for b in self.blocks:\n    x = b(x) if type(x) is b.__class__ else x\nreturn x",
    ],
)
def test_a_function_that_cannot_see_a_step_does_not_keep_it_from_rolling(body: str) -> None:
    method = rolled(body + "\n")
    assert not unrolled_reasons(method)
    assert any(f.name.startswith("__autostate_body") for f in functions(method))


def test_a_state_write_through_the_receiver_rolls() -> None:
    # ``self.log`` changed in place is a state's write where ``log`` is a state
    # (the rewrite threads it), else a change of ``self`` (above).
    method = rolled("for b in self.blocks:\n    self.log.append(x)\nreturn x\n", frozenset({"log"}))
    assert not unrolled_reasons(method)


def test_what_is_never_a_stack_is_left_alone() -> None:
    method = rolled("""
        for i in range(3):
            x = x + i
        for k, v in xs.items():
            x = x + v
        for y in [1, 2]:
            x = x + y
        return x
    """)
    assert not functions(method) and not unrolled_reasons(method)


def test_layer_attributes_and_nested_loops_roll() -> None:
    method = rolled("""
        for i, (b, s) in enumerate(zip(self.blocks, xs)):
            b.count = b.count + 1  # a layer's state assigned
            for c in b.inner:
                x = c(x) * s
        return x
    """)
    # (the inner loop, in both copies of the outer body)
    assert sorted(f.name for f in functions(method)) == ["__autostate_body_1"] * 2 + ["__autostate_body_2"]
    deferred = [n for n in ast.walk(method) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "Deferred"]
    assert [d.args[0].id for d in deferred] == ["enumerate", "zip"]  # type: ignore[attr-defined]


def test_the_analysis_loops_and_the_trees_match_in_every_block() -> None:
    # The facts are the analysis's, in source order; the tree's ``for``
    # statements are found in the same order in every kind of block.
    method = rolled("""
        try:
            for a in self.blocks:
                x = a(x)
        except ValueError:
            for b in self.blocks:
                x = b(x)
        else:
            async def later():
                for c in self.blocks:
                    await c
        finally:
            for d in self.blocks:
                x = d(x)
        match x:
            case None:
                with xs:
                    for e in self.blocks:
                        x = e(x)
        while x is None:
            for f in self.blocks:
                break
        return x
    """)
    bodies = sorted(f.name for f in functions(method) if f.name.startswith("__autostate_body"))
    assert bodies == [f"__autostate_body_{n}" for n in (1, 2, 3, 4)]
    assert sorted(unrolled_reasons(method)) == [
        "a `break` or `continue` in its body", "an `await` in its body",
    ]
