"""Differential bug hunt 23: Python 3.12 and 3.13 syntax and semantics around state.

Each source is written plain and decorated (``differential.pair``) and run
the same way on both (eagerly, through ``f``, under ``jax.jit`` and after
``freeze``; methods returning text run eagerly and through ``f`` only):

- PEP 701 f-strings (3.12): the f-string's own quotes inside a field,
  backslashes and comments in fields, multi-line fields, ``{self.x=}`` in
  its spellings, format specs that read state, deep nesting, f-strings in
  decorators and default values.
- PEP 695 type parameters (3.12): generic properties and ``__init__``,
  ``type`` statements in class bodies and methods, generic nested functions
  and classes writing state, generic bases decorated and undecorated.
- PEP 709 inlined comprehensions (3.12): ``locals()``/``vars()``/``dir()``
  inside comprehensions, comprehension variables shadowing state readers,
  class-body comprehensions.
- 3.13: ``locals()``/``f_locals`` (PEP 667), ``copy.replace``,
  ``warnings.deprecated`` on methods, ``ReadOnly``/``TypeIs`` annotations,
  docstrings, ``__static_attributes__`` and ``__firstlineno__``.
- ``except*`` and ``match`` around state; the user's line in errors and
  tracebacks of rewritten methods.

The sources are text, so this file imports on 3.11; a case that needs newer
syntax or library is skipped below its version. A case that shows a
mismatch stays, marked ``xfail(strict=True, reason="BUG: ...")``.
"""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path

import jax.numpy as jnp
import pytest
from differential import (  # noqa: I001 - tests/ is on sys.path
    Call,
    Loader,
    assert_same,
    check,
    pair,
    snapshot,
)

import autostate
from autostate.errors import DecorationError, UnhandledLocalStateError

X1 = jnp.float32(1.5)
X2 = jnp.float32(2.0)
TEXT = ("eager", "f")  # a method returning a str cannot leave jax.jit

py312 = pytest.mark.skipif(sys.version_info < (3, 12), reason="Python 3.12 syntax")
py313 = pytest.mark.skipif(sys.version_info < (3, 13), reason="Python 3.13 semantics")


def assert_here(err: BaseException) -> None:
    """The error names the user's file and the line marked ``# HERE``."""
    found = re.search(r"(\S+\.py):(\d+)", str(err))
    assert found, f"no user file:line in: {err}"
    line = Path(found[1]).read_text().splitlines()[int(found[2]) - 1]
    assert "# HERE" in line, f"{found[0]} is {line!r}, not the marked line"


def _bug(reason: str) -> pytest.MarkDecorator:
    return pytest.mark.xfail(strict=True, reason="BUG: " + reason)


# ======================================================================================
# 1. PEP 701 f-strings
# ======================================================================================

FSTRINGS = r'''
def tag(label):
    def deco(fn):
        fn.label = label
        return fn
    return deco


@DECORATE
class F:
    def __init__(self):
        self.n = jnp.zeros(())
        self.width = 8
        self.d = {"k": jnp.ones(()), "j": jnp.full((), 2.0)}
        self.items = [jnp.ones(()), jnp.full((), 3.0)]
        self.name = "m"

    def same_quotes(self, v):
        self.n = self.n + v
        return f"{self.d["k"] + self.n:.2f}|{self.d['j']:.1f}|{f"{f"{f"{self.n:.1f}"}"}"}", self.n

    def backslash_in_field(self, v):
        self.n = self.n + v
        return f"{"\n".join(f"{float(x):.1f}" for x in self.items)}|{'\t'.join([str(int(self.n))])}", self.n

    def comment_in_field(self, v):
        self.n = self.n + v
        return f"{self.n  # the count
            :.2f}|{
            self.d["k"]  # self.d["k"] = 0
            * 2
        :.1f}", self.n

    def debug_forms(self, v):
        self.n = self.n + v
        return f"{self.n=:.2f}|{self.n = :.1f}|{self.d['k']=!s:>5}|{self.n + 1=:.1f}|{self.width=}|{self.name = !r}", self.n

    def debug_multiline(self, v):
        self.n = self.n + v
        return f"{
            self.n
            =:.1f}|{self.width
 = }", self.n

    def triple_lines(self, v):
        self.n = self.n + v
        return f"""a
            {float(self.n):.1f}
        b {
            self.width
        } c""", self.n

    def state_in_spec(self, v):
        self.n = self.n + v
        return f"{float(self.n):{self.width}.{self.width - 6}f}|{self.name:>{self.width}}|{self.name:{"*"}^{self.width}}", self.n, self.width

    def deep_nesting(self, v):
        self.n = self.n + v
        return f"{f"{f"{f"{f"{f"{self.name * int(self.n)}"}"}"}"}"}|{f'{f"{f'{self.width}'}"}'}", self.n

    def write_in_field(self, v):
        s = f"{self.d.update(k=self.d["k"] + v) or "ok"}|{self.items.append(self.n) or len(self.items)}"
        self.n = self.n + v
        return s, self.d["k"], len(self.items)

    def default_reads_state(self, v):
        def inner(s=f"{float(self.n):.1f}", t=f"{self.name!r}"):
            return s + t
        self.n = self.n + v
        return inner(), f"{float(self.n):.1f}"

    def widen(self):
        self.width += 1

    @tag(f"{'step':>{6}}|{"x" * 2}")
    def tagged(self, v, sep=f"{'-' * 3}"):
        self.n = self.n + v
        return f"{sep}{float(self.n):.1f}{sep}{type(self).tagged.label}", self.n
'''

FSTRING_CALLS = ["same_quotes", "triple_lines", "backslash_in_field", "comment_in_field", "debug_forms",
                 "state_in_spec", "deep_nesting", "write_in_field",
                 "default_reads_state", "tagged"]


@py312
@pytest.mark.parametrize("method", FSTRING_CALLS)
def test_pep701_fstrings(write_module: Loader, method: str) -> None:
    plain, dec = pair(write_module, FSTRINGS)
    check(plain, dec, "F()", [(method, (X1,)), (method, (X2,))], modes=TEXT)





@py312
@_bug("a field spanning lines with `=` (`{\\n    self.n\\n    =}`): the decorated text has "
      "the wrapper's indentation (4 spaces) where Python shows the user's (12)")
def test_pep701_multiline_debug_field_keeps_its_indentation(write_module: Loader) -> None:
    plain, dec = pair(write_module, FSTRINGS)
    check(plain, dec, "F()", [("debug_multiline", (X1,))], modes=TEXT)


def debug_source(body: str) -> str:
    """A class whose ``show`` ends with ``body``; ``d`` and ``width`` are states."""
    return """
@DECORATE
class D:
    def __init__(self):
        self.n = jnp.zeros(())
        self.width = 3
        self.name = "m"
        self.d = {"k": jnp.ones(())}

    def widen(self):
        self.width += 1

    def touch(self):
        self.d["k"] = self.d["k"] + 1

    def show(self, v):
        self.n = self.n + v
        BODY
""".replace("BODY", body)



@py312
@pytest.mark.parametrize(
    "body",
    [
        pytest.param('return f"{self.n=:.1f}|{self.d["k"]=!s}", self.n', id="quote_in_state_field"),
        pytest.param('d = {"k": 1}\n        return f"{self.n=:.1f}|{d["k"]=}", self.n',
                     id="quote_in_local_field"),
        pytest.param('return f"{self.width # the width\n=}", self.n', id="comment"),
        pytest.param('return f"{\'\\t\'.join([self.name] * self.width)=}", self.n', id="backslash"),
        pytest.param("return f'{self.n=:.1f}|{self.d[\"k\"]=!s}', self.n", id="other_quote"),
        pytest.param('return f"""{self.n=:.1f}|{self.d["k"]=!s}""", self.n', id="triple_quote"),
        pytest.param('return f"{self.n=:.1f}|{f"{self.width=}"=}", self.n', id="nested_debug"),
        pytest.param("return f'''{self.n\n=:.1f}|{self.d['k'] = }''', self.n", id="triple_multiline"),
        pytest.param('return f"{self.n=:{self.width}.1f}", self.n', id="state_spec_in_debug"),
        pytest.param('return f"{(lambda: self.n)()=}|{[self.width for _ in range(2)]=}", self.n',
                     id="lambda_and_comprehension"),
        pytest.param('return rf"{self.name=}\\d{self.width!r:>{self.width}}", self.n', id="raw"),
        pytest.param("return f\"{self.name=!a}{'{'}{self.width=:}\", self.n", id="braces"),
    ],
)
def test_pep701_debug_fields(write_module: Loader, body: str) -> None:
    plain, dec = pair(write_module, debug_source(body))
    check(plain, dec, "D()", [("touch", ()), ("show", (X1,)), ("show", (X2,))], modes=TEXT)


# ======================================================================================
# 2. PEP 695 type parameters and ``type`` statements
# ======================================================================================

GENERICS = """
type Pair[T] = tuple[T, T]


class PlainBase[T]:
    def __init__(self, v: T):
        self.base = v

    def grow[U](self, k: U) -> U:
        self.base = self.base * k
        return k


@DECORATE
class Child(PlainBase[jax.Array]):
    def __init__(self):
        super().__init__(jnp.ones(()))
        self.n = jnp.zeros(())

    def step(self, v):
        self.n = self.n + self.base + v
        self.grow(2.0)
        return self.n, self.base


@DECORATE
class GBase[T: (float, jax.Array)]:
    def __init__[S](self, v: T, k: S = 2):
        self.g = v
        self.k = k
        self.kinds = (T.__name__, S.__name__)

    def bump(self, v: T) -> T:
        self.g = self.g + v * self.k
        return self.g

    @property
    def total[R](self) -> R:
        return self.g * 2

    @total.setter
    def total[R](self, value: R) -> None:
        self.g = value / 2


class PlainChild[V](GBase[V]):
    def more(self, v: V) -> V:
        self.g = self.g * 2 + v
        self.total = self.total + 1
        return self.g, self.total


@DECORATE
class Typed[T]:
    type Vec = list[T]

    def __init__(self):
        self.n = jnp.zeros(())
        self.items = [jnp.ones(()), jnp.full((), 2.0)]

    def aliases(self, v):
        type Local[K] = dict[K, T]
        type Lazy = self.n.dtype
        self.n = self.n + v
        names = (Typed.Vec.__name__, Local.__name__, [p.__name__ for p in Local.__type_params__])
        return names, jnp.zeros((), Lazy.__value__) + self.n

    def nested_generic(self, v):
        def helper[U](x: U) -> U:
            self.n = self.n + x
            return self.n

        class Local[W]:
            def get(inner, w: W) -> W:
                return w * 2

        def writes_item[U: jax.Array](i: int, x: U) -> None:
            self.items[i] = self.items[i] + x

        writes_item(1, v)
        return helper(v) + Local().get(self.n), self.items[1]

    def generic_lambda_in_comprehension[U](self, v: U) -> U:
        fs = [lambda k=k: self.n * k for k in range(3)]
        self.n = self.n + v
        return sum(f() for f in fs) + self.n


@DECORATE
class Outer:
    def __init__(self):
        self.child = PlainChild[jax.Array](jnp.ones(()))
        self.typed = Typed[int]()

    def __call__(self, v):
        a = self.child.bump(v)
        b = self.child.more(v)
        c = self.typed.nested_generic(v)
        return a, b, c
"""


@py312
@pytest.mark.parametrize(
    ("build", "calls"),
    [
        ("Child()", [("step", (X1,)), ("step", (X2,))]),
        ("GBase(jnp.ones(()))", [("bump", (X1,)), ("bump", (X2,))]),
        ("PlainChild(jnp.ones(()), 3)", [("more", (X1,)), ("bump", (X2,)), ("more", (X2,))]),
        ("Typed()", [("nested_generic", (X1,)), ("nested_generic", (X2,))]),
        ("Typed()", [("generic_lambda_in_comprehension", (X1,))] * 2),
        ("Outer()", [("__call__", (X1,)), ("__call__", (X2,))]),
    ],
    ids=["undecorated_generic_base", "generic_init_and_property", "undecorated_generic_subclass",
         "generic_nested_functions", "generic_method_lambdas", "generic_submodels"],
)
def test_pep695_generics(write_module: Loader, build: str, calls: list[Call]) -> None:
    plain, dec = pair(write_module, GENERICS)
    check(plain, dec, build, calls)


@py312
def test_pep695_type_statements_in_methods(write_module: Loader) -> None:
    plain, dec = pair(write_module, GENERICS)
    check(plain, dec, "Typed()", [("aliases", (X1,)), ("aliases", (X2,))], modes=("eager", "f"))


@py312
def test_pep695_type_params_and_state_sets(write_module: Loader) -> None:
    plain, dec = pair(write_module, GENERICS)
    g = dec.GBase(jnp.ones(()))
    assert g.kinds == plain.GBase(jnp.ones(())).kinds == ("T", "S")
    for cls in ("GBase", "PlainChild", "Typed"):
        assert [p.__name__ for p in getattr(dec, cls).__type_params__] == [
            p.__name__ for p in getattr(plain, cls).__type_params__
        ]
    assert [p.__name__ for p in dec.GBase.__init__.__type_params__] == ["S"]
    assert [p.__name__ for p in dec.GBase.total.fget.__type_params__] == ["R"]
    assert dec.GBase.__type_params__[0].__constraints__ == plain.GBase.__type_params__[0].__constraints__
    assert sorted(g.functionalize()[1]) == ["g"]
    assert sorted(dec.Child().functionalize()[1]) == ["base", "n"]
    assert sorted(dec.Typed().functionalize()[1]) == ["items", "n"]


@py312
def test_pep695_lazy_alias_read_after_the_call(write_module: Loader) -> None:
    source = """
@DECORATE
class Later:
    def __init__(self):
        self.n = jnp.zeros(())

    def alias(self, v):
        self.n = self.n + v
        type Now = self.n
        return Now

    def touch(self, v):
        self.n = self.n * v
        return self.n
"""
    plain, dec = pair(write_module, source)
    ref, model = plain.Later(), dec.Later()
    a_ref, a_dec = ref.alias(X1), model.alias(X1)
    ref.touch(X2)
    model.touch(X2)
    assert_same(a_ref.__value__, a_dec.__value__, "alias read after the call")
    # Through f, the alias escapes the call like a returned closure: what it
    # reads is the model inside f, whose states live only while f runs.
    f, states = dec.Later().functionalize()
    alias, states = f.alias(states, X1)
    with pytest.raises(UnhandledLocalStateError, match="'n'"):
        alias.__value__  # noqa: B018


# ======================================================================================
# 3. PEP 709 inlined comprehensions
# ======================================================================================

COMPREHENSIONS = """
import sys


@DECORATE
class C:
    scale = 3
    table = [2 * i for i in range(scale)]
    names = {k: len(k) for k in ("a", "bb")}

    def __init__(self):
        self.n = jnp.zeros(())
        self.items = [jnp.ones(()), jnp.full((), 2.0)]
        self.d = {"a": jnp.ones(()), "b": jnp.zeros(())}

    def locals_inside(self, v):
        self.n = self.n + v
        k = 2
        seen = [sorted(locals()) for _ in range(1)][0]
        also = {i: sorted(vars()) for i in range(1)}[0]
        scope = [sorted(dir()) for j in range(1)][0]
        return seen, also, scope, self.n * k

    def frame_inside(self, v):
        self.n = self.n + v
        k = 3
        code_names = [sys._getframe().f_code.co_name for _ in range(1)]
        # (the runtime's closure variable shows in f_locals: docs/rewrite_rules.md)
        frame_locals = [
            sorted(n for n in sys._getframe().f_locals if not n.startswith("__autostate"))
            for _ in range(1)
        ][0]
        return code_names, frame_locals, self.n * k

    def frame_write_through(self, v):
        k = 0
        frame = sys._getframe()
        frame.f_locals["k"] = self.n + v  # PEP 667: writes the local (3.13)
        self.n = k * 2
        snapshot = locals()
        snapshot["k"] = 100.0  # a snapshot: the local keeps its value (3.13)
        return self.n, k, "k" in frame.f_locals, len([n for n in locals() if n == "snapshot"])

    def shadowing(self, v):
        self.n = self.n + v
        n = [self for self in range(2)]
        items = [x * self.n for x in self.items]
        d = {self: x for self, x in self.d.items()}
        nested = [[y + self.n for y in self.items] for _ in range(2)]
        return n, items, d, nested, self.n

    def reset(self):
        self.d = dict(self.d)  # (makes d a state: its items change in place below)

    def writes_inside(self, v):
        self.items = [x + v for x in self.items]
        out = [self.d.__setitem__(k, self.d[k] + v) for k in sorted(self.d)]
        self.n = sum(x for x in self.items) + len(out)
        return self.n, [self.n + i for i in range(2)]

    def class_attrs(self, v):
        self.n = self.n + v + sum(C.table) + sum(type(self).names.values())
        return self.n

    def walrus_leak(self, v):
        picked = [(last := x) for x in self.items if x is not None]
        self.n = self.n + last + v
        return self.n, len(picked)
"""

COMPREHENSION_CALLS = ["shadowing", "writes_inside", "class_attrs", "walrus_leak"]


@pytest.mark.parametrize("method", COMPREHENSION_CALLS)
def test_comprehensions_around_state(write_module: Loader, method: str) -> None:
    plain, dec = pair(write_module, COMPREHENSIONS)
    check(plain, dec, "C()", [(method, (X1,)), (method, (X2,))])


@pytest.mark.parametrize("method", ["locals_inside", "frame_inside"])
def test_scope_builtins_inside_comprehensions(write_module: Loader, method: str) -> None:
    plain, dec = pair(write_module, COMPREHENSIONS)
    check(plain, dec, "C()", [(method, (X1,))], modes=("eager", "f"))


@py313
def test_pep667_frame_locals_write_through(write_module: Loader) -> None:
    plain, dec = pair(write_module, COMPREHENSIONS)
    check(plain, dec, "C()", [("frame_write_through", (X1,)), ("frame_write_through", (X2,))])



# ======================================================================================
# 4. Python 3.13: copy.replace, warnings.deprecated, typing, class attributes
# ======================================================================================

PY313 = '''
import sys
import warnings
from typing import ReadOnly, TypedDict, TypeIs


class Opts(TypedDict):
    lr: ReadOnly[float]


@DECORATE
@dataclasses.dataclass
class Cell:
    w: jax.Array
    n: jax.Array = dataclasses.field(default_factory=lambda: jnp.zeros(()))

    def step(self, v):
        self.n = self.n + self.w * v
        return self.n

    def replaced(self, v):
        other = copy.replace(self, w=self.w * 2)
        self.n = self.n + other.w + v
        return other.w, other.n, self.n


@DECORATE
class Custom:
    def __init__(self):
        self.n = jnp.zeros(())
        self.w = jnp.ones(())

    def __replace__(self, /, **changes):
        new = copy.copy(self)
        for k, val in changes.items():
            setattr(new, k, val)
        return new

    def step(self, v):
        self.n = self.n + self.w * v
        return self.n

    def replaced(self, v):
        other = copy.replace(self, w=self.w + v)
        other.n = other.n + 10
        self.n = self.n + other.w
        return other.n, self.n


@DECORATE
class Old:
    """A model whose methods carry 3.13 decorators and annotations.

        Indented text: 3.13 strips it at compile time.
    """

    def __init__(self):
        self.n = jnp.zeros(())
        self.opts: Opts = {"lr": 0.5}

    @warnings.deprecated("use step")
    def old_step(self, v: float) -> jax.Array:
        """Deprecated.

            Keeps its indentation in __doc__ only before 3.13.
        """
        self.n = self.n + v * self.opts["lr"]
        return self.n

    def is_big(self, v: object) -> TypeIs[float]:
        self.n = self.n + 1
        return v > 1

    def step(self, v: ReadOnly[float]) -> jax.Array:
        """Adds v.

        More text.
        """
        self.n = self.n + v
        return self.n, sys._getframe().f_lineno - sys._getframe().f_code.co_firstlineno
'''


@py313
@pytest.mark.parametrize(
    ("build", "calls"),
    [
        ("Cell(jnp.ones(()))", [("step", (X1,)), ("replaced", (X2,)), ("step", (X1,))]),
        ("Custom()", [("step", (X1,)), ("replaced", (X2,)), ("replaced", (X1,))]),
        ("Old()", [("step", (X1,)), ("is_big", (2.0,)), ("step", (X2,))]),
    ],
    ids=["dataclass_replace", "custom_replace", "typing_313"],
)
def test_python313_library(write_module: Loader, build: str, calls: list[Call]) -> None:
    plain, dec = pair(write_module, PY313)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        check(plain, dec, build, calls)


@py313
@pytest.mark.parametrize("cls", ["Cell", "Custom"])
def test_copy_replace_of_a_decorated_model(write_module: Loader, cls: str) -> None:
    import copy

    plain, dec = pair(write_module, PY313)
    build = "Cell(jnp.ones(()))" if cls == "Cell" else "Custom()"
    ref, model = eval(build, vars(plain)), eval(build, vars(dec))  # noqa: S307
    ref.step(X1)
    model.step(X1)
    r2, m2 = copy.replace(ref, w=X2), copy.replace(model, w=X2)
    assert_same(snapshot(r2), snapshot(m2), "replaced copy")
    assert_same(r2.step(X1), m2.step(X1), "replaced copy steps")
    assert_same(snapshot(ref), snapshot(model), "original untouched")
    assert sorted(m2.functionalize()[1]) == sorted(model.functionalize()[1])


@py313
def test_warnings_deprecated_method(write_module: Loader) -> None:
    plain, dec = pair(write_module, PY313)
    for mod in (plain, dec):
        with pytest.warns(DeprecationWarning, match="use step"):
            out = mod.Old().old_step(X1)
        assert_same(X1 * 0.5, out)
    assert dec.Old.old_step.__deprecated__ == plain.Old.old_step.__deprecated__ == "use step"
    f, states = dec.Old().functionalize()
    with pytest.warns(DeprecationWarning, match="use step"):
        out, states = f.old_step(states, X2)
    assert_same(X2 * 0.5, out)
    assert_same(X2 * 0.5, states["n"])


@py313
def test_docstrings_and_class_attributes_313(write_module: Loader) -> None:
    plain, dec = pair(write_module, PY313)
    for cls in ("Cell", "Custom", "Old"):
        p, d = getattr(plain, cls), getattr(dec, cls)
        eval("Cell(jnp.ones(()))" if cls == "Cell" else f"{cls}()", vars(dec))  # noqa: S307
        assert d.__static_attributes__ == p.__static_attributes__, cls
        assert d.__firstlineno__ == _first_line(dec, cls) != p.__firstlineno__, cls
        assert p.__firstlineno__ == _first_line(plain, cls), cls
        assert d.__doc__ == p.__doc__, cls
    for name in ("old_step", "step", "is_big"):
        assert getattr(dec.Old, name).__doc__ == getattr(plain.Old, name).__doc__
        assert getattr(dec.Old, name).__annotations__ == getattr(plain.Old, name).__annotations__
    assert "    Keeps" not in dec.Old.old_step.__doc__  # stripped at compile time (3.13)
    assert dec.Old().step(X1)[1] == plain.Old().step(X1)[1]


def _first_line(module: object, cls: str) -> int:
    """The line of the class's first decorator (else of ``class``), 1-based."""
    lines = Path(module.__file__).read_text().splitlines()
    n = next(i for i, line in enumerate(lines) if line.startswith(f"class {cls}"))
    while n > 0 and lines[n - 1].startswith("@"):
        n -= 1
    return n + 1


# ======================================================================================
# 5. except* and match around state
# ======================================================================================

CONTROL = """
@DECORATE
class Leaf:
    __match_args__ = ("w", "n")

    def __init__(self, w):
        self.w = w
        self.n = jnp.zeros(())

    def step(self, v):
        self.n = self.n + self.w * v
        return self.n


@DECORATE
class Ctl:
    def __init__(self):
        self.n = jnp.zeros(())
        self.mode = 1
        self.modes = {"train": 1, "eval": 2}
        self.leaf = Leaf(jnp.full((), 2.0))
        self.log = [jnp.zeros(())]
        self.errors = jnp.zeros((), jnp.int32)

    def set_mode(self, m):
        self.mode = m

    def groups(self, v):
        try:
            try:
                self.n = self.n + v
                raise ExceptionGroup("outer", [ValueError("a"), ExceptionGroup("inner", [KeyError("b"), TypeError("c")])])
            except* ValueError as eg:
                self.log = self.log + [self.n * len(eg.exceptions)]
            except* KeyError:
                self.n = self.n * 3
                raise RuntimeError("from handler")
            finally:
                self.n = self.n + 1
        except* TypeError as eg:
            self.errors = self.errors + len(eg.exceptions)
        except* RuntimeError:
            self.n = self.n - 0.5
        return self.n, self.log[-1]

    def match_value(self, v):
        match self.mode:
            case 0:
                self.n = self.n - v
            case self.mode if self.mode > 5:
                self.n = self.n * 100
            case 1 | 2 as m if self.n is not None:
                self.n = self.n + v * m
            case _:
                self.n = jnp.zeros(())
        match 2:
            case self.mode:
                hit = 1.0
            case _:
                hit = 0.0
        return self.n, hit

    def match_class(self, v):
        match self.leaf:
            case Leaf(w, n) if n is not None:
                self.leaf.step(v)
                out = w + n
            case Leaf():
                out = jnp.zeros(())
        match {"leaf": self.leaf, "log": self.log}:
            case {"leaf": Leaf(w=w), "log": [first, *rest]}:
                self.log = [first + w, *rest]
        return out, self.leaf.n, self.log[0]

    def match_capture_from_state(self, v):
        match (self.n, self.log):
            case (n, [*items]) if len(items) == 1:
                self.n = n + items[0] + v
            case (n, _):
                self.n = n
        match self.modes:
            case {"train": self.mode}:
                same = True
            case _:
                same = False
        return self.n, same
"""

CONTROL_CALLS = ["groups", "match_value", "match_class", "match_capture_from_state"]


@py312
@pytest.mark.parametrize("method", CONTROL_CALLS)
def test_except_star_and_match(write_module: Loader, method: str) -> None:
    plain, dec = pair(write_module, CONTROL)
    check(plain, dec, "Ctl()", [(method, (X1,)), (method, (X2,))])


@py312
def test_match_value_pattern_after_a_mode_change(write_module: Loader) -> None:
    plain, dec = pair(write_module, CONTROL)
    check(plain, dec, "Ctl()", [("set_mode", (2,)), ("match_value", (X1,)),
                                ("set_mode", (7,)), ("match_value", (X2,))], modes=("eager",))
    ref, model = plain.Ctl(), dec.Ctl()
    ref.set_mode(2)
    model.set_mode(2)
    f, states = model.functionalize()
    out, states = f.match_value(states, X1)
    assert_same(ref.match_value(X1), out)


# ======================================================================================
# 6. The user's line in errors and tracebacks
# ======================================================================================

TRACEBACKS = '''
import functools
import sys


def passthrough(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


@DECORATE
class Tb[T]:
    """Class docstring.

        Indented.
    """

    def __init__(self):
        self.n = jnp.zeros(())
        self.count = 0

    @passthrough
    @functools.cache
    def cached(self):
        return 1

    @passthrough
    def fails[U](
        self,
        v: U,
        *,
        k: int = 2,
    ) -> U:
        """Docstring.

            With indented lines, which 3.13 strips.
        """
        self.n = self.n + v * k
        frame_line = sys._getframe().f_lineno
        if self.n is not None:
            raise ValueError(f"{self.n=}")  # RAISE
        return frame_line

    def fails_in_handler(self, v):
        """One line."""
        try:
            raise ExceptionGroup("g", [KeyError(1)])
        except* KeyError:
            self.n = self.n + v
            {}["missing"]  # RAISE

    def fails_in_comprehension(self, v):
        self.n = self.n + v
        return [1 / (k - 1) for k in range(3) if self.n is not None]  # RAISE

    def fails_in_fstring(self, v):
        self.n = self.n + v
        return f"{
            self.n
            :{self.count}d}"  # RAISE

    def static_write(self, v):
        """Writes a Python int state."""
        self.n = self.n + v
        self.count = self.count + 1  # HERE
        return self.n
'''


def _where(exc: BaseException) -> list[tuple[str, str]]:
    """(function, line text) of each traceback entry in the user's module."""
    import traceback

    entries = traceback.extract_tb(exc.__traceback__)
    return [(e.name, (e.line or "").strip()) for e in entries if "autostate_testmod" in e.filename]


@py312
@pytest.mark.parametrize(
    ("method", "exc"),
    [("fails", ValueError), ("fails_in_handler", KeyError),
     ("fails_in_comprehension", ZeroDivisionError), ("fails_in_fstring", ValueError)],
)
def test_traceback_lines_in_rewritten_methods(write_module: Loader, method: str, exc: type) -> None:
    plain, dec = pair(write_module, TRACEBACKS)
    got = []
    for mod in (plain, dec):
        with pytest.raises(exc) as err:
            getattr(mod.Tb(), method)(X1)
        # (and where the group the handler caught was raised)
        context = err.value.__context__
        got.append((_where(err.value), context and _where(context)))
    assert got[0] == got[1]
    marker = 'return f"{' if method == "fails_in_fstring" else "# RAISE"
    assert marker in got[1][0][-1][1]


@py312
def test_frame_line_after_a_docstring_and_a_long_signature(write_module: Loader) -> None:
    plain, dec = pair(write_module, TRACEBACKS)
    lines = []
    for mod in (plain, dec):
        model = mod.Tb()
        code = mod.Tb.fails.__wrapped__.__code__
        try:
            model.fails(X1)
        except ValueError as e:
            tb = e.__traceback__
            while tb.tb_next is not None:
                tb = tb.tb_next
            lines.append((tb.tb_lineno - code.co_firstlineno, tb.tb_frame.f_lineno - code.co_firstlineno))
    assert lines[0] == lines[1]


@py312
def test_static_write_error_names_the_users_line(write_module: Loader) -> None:
    _, dec = pair(write_module, TRACEBACKS)
    f, states = dec.Tb().functionalize()
    with pytest.raises(autostate.AutostateError) as err:
        f.static_write(states, X1)
    assert_here(err.value)


@py312
@pytest.mark.parametrize(
    ("body", "kind"),
    [
        ("def steps[T](self, n: T):\n        yield self.n + n  # HERE", "generator"),
        ("async def steps[T](self, n: T):\n        self.n = self.n + n  # HERE", "async"),
        ('def steps[T](self, n: T):\n        """Doc.\n\n            More.\n        """\n'
         "        yield from [f\"{self.n}\" for _ in range(n)]  # HERE", "generator"),
    ],
    ids=["generic_generator", "generic_async", "generator_after_docstring"],
)
def test_documented_errors_name_the_users_line(write_module: Loader, body: str, kind: str) -> None:
    source = f"""
@DECORATE
class Stream[T]:
    def __init__(self):
        self.n = jnp.zeros(())

    def step(self):
        self.n = self.n + 1

    {body}
"""
    with pytest.raises(DecorationError, match=f"{kind} method 'steps' uses state 'n'") as err:
        pair(write_module, source)
    assert_here(err.value)
