"""transform/loops.py: which ``for`` loops get a rolled form, and what it is."""

from __future__ import annotations

import ast
import textwrap

import pytest

from autostate.transform import loops
from autostate.transform.method import OUTER_NAME


def rolled(body: str) -> ast.FunctionDef:
    """The method ``m`` of a wrapper module around ``body``, after ``roll_loops``."""
    method = textwrap.indent(textwrap.dedent(body), " " * 12)
    text = f"class C:\n    def {OUTER_NAME}():\n        def m(self, x, xs):\n{method}"
    tree = ast.parse(text)
    loops.roll_loops(tree, "m", "__autostate__")
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
        ("g = lambda: x\nfor b in self.blocks:\n    x = b(g())", "a function defined outside the loop reads a local its body assigns"),
        # Made after the loop, but on an earlier trip of a loop around both: it may run in it.
        ("g = None\nfor _ in range(2):\n    for b in self.blocks:\n        x = b(g() if g else x)\n    g = lambda: x", "a function defined outside the loop reads a local its body assigns"),
    ],
)
def test_a_loop_a_function_cannot_carry_stays_as_written(loop: str, reason: str) -> None:
    method = rolled(loop + "\nreturn x\n")
    assert not functions(method) or all(f.name == "g" for f in functions(method))
    assert unrolled_reasons(method) == [reason]


def test_a_function_made_after_the_loop_does_not_keep_it_from_rolling() -> None:
    # It cannot run while the loop runs: it reads the locals the loop leaves.
    method = rolled("for b in self.blocks:\n    x = b(x)\ng = lambda: x\nreturn g()\n")
    assert not unrolled_reasons(method)
    assert any(f.name.startswith("__autostate_body") for f in functions(method))


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
