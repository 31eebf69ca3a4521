"""The runtime's name in rewritten methods: invisible to ``locals()``, never a user's.

A rewritten method reaches ``autostate.runtime`` through a closure variable
(``method.runtime_name``): ``__autostate__``, or ``__autostate_<n>__`` where
the method's text spells that. Plain Python has no such variable, so
``locals()``, ``vars()`` and ``dir()`` called with no argument leave it out
(``runtime.without_runtime``), in the method and in the nested functions,
lambdas and comprehensions in it; and a user's own ``__autostate__`` (a
global, a parameter, a local, the receiver) is the user's.

Each source is written plain and decorated (``differential.pair``) and run
eagerly, through ``f(states, ...)`` and, where the method returns arrays,
under ``jax.jit``; the plain run is the reference.
"""

from __future__ import annotations

import pickle

import jax.numpy as jnp
import pytest
from differential import Loader, assert_same, check, pair, snapshot  # noqa: I001 - tests/ is on sys.path

from autostate.transform import analysis
from autostate.transform.method import RUNTIME_NAME, MethodSource, runtime_name

X1 = jnp.float32(1.5)
X2 = jnp.float32(2.0)
ALL = ("eager", "f", "jit", "freeze")
NO_JIT = ("eager", "f")

# ======================================================================================
# 1. locals(), vars(), dir() with no argument
# ======================================================================================

SCOPES = """
@DECORATE
class Sc:
    def __init__(self, width=3, lr=0.5):
        self.n = jnp.zeros(())
        self.init_locals = sorted(locals())
        self.init_vars = sorted(vars())
        self.init_dir = dir()

    def names(self, v):
        self.n = self.n + v
        return sorted(locals()), sorted(vars()), dir(), self.n

    def counts(self, v):
        total = self.n + v
        self.n = total
        return self.n + len(locals()) + 10 * len(vars()) + 100 * len(dir())

    def before_any_state(self, v):
        early = sorted(locals())
        self.n = self.n * 2 + v
        return early, self.n

    def values(self, v):
        self.n = self.n + v
        scope = locals()
        return [k for k in scope], scope["v"] + self.n

    def nested(self, v):
        def inner(w):
            return self.n + w, sorted(locals())
        lam = lambda w: (self.n * w, sorted(locals()), dir())
        comp = [sorted(locals()) for _ in range(2) if self.n is not None]
        dcomp = {k: sorted(locals()) for k in ("a",) if self.n is not None}
        first = {k: 0 for k in locals() if k != "self"}
        gen = list(sorted(vars()) for _ in range(1) if self.n is not None)
        self.n = inner(v)[0] + lam(v)[0]
        return inner(v)[1], lam(v)[1], lam(v)[2], comp, dcomp, sorted(first), gen, self.n

    def nested_counts(self, v):
        def inner(w):
            return self.n + w + len(locals())
        lam = lambda w: self.n * w + len(locals()) + 10 * len(dir())
        comp = [len(locals()) for _ in range(2) if self.n is not None]
        gen = sum(len(vars()) for _ in range(3) if self.n is not None)
        self.n = inner(v) + lam(v)
        return self.n + sum(comp) + 100 * gen

    def nested_writer(self, v):
        def bump(w):
            self.n = self.n + w
            return sorted(locals())
        seen = bump(v)
        return seen, sorted(locals()), self.n

    def formatted(self, v):
        self.n = self.n + v
        return f"{sorted(locals())}", f'{dir()!r:>40}', f'''{sorted(vars())}''', self.n

    def class_body(self, v):
        self.n = self.n + v
        class Inner:
            k = self.n
            ns = sorted(locals())
        return Inner.ns, self.n

    def control(self, v):
        c, _ = lax.scan(lambda c, x: (c + x, None), v, jnp.ones(2))
        return c + len(locals()) + 10 * len(dir())
"""


@pytest.mark.parametrize(
    ("method", "modes"),
    [
        ("names", NO_JIT),
        ("counts", ALL),
        ("before_any_state", NO_JIT),
        ("values", NO_JIT),
        ("nested", NO_JIT),
        ("nested_counts", ALL),
        ("nested_writer", NO_JIT),
        ("formatted", NO_JIT),
        ("class_body", NO_JIT),
        ("control", ALL),
    ],
)
def test_scope_names_are_plain_pythons(write_module: Loader, method: str, modes: tuple) -> None:
    plain, dec = pair(write_module, SCOPES)
    check(plain, dec, "Sc()", [(method, (X1,)), (method, (X2,))], modes=modes)


def test_init_sees_its_own_names(write_module: Loader) -> None:
    plain, dec = pair(write_module, SCOPES)
    model = dec.Sc(width=4)
    assert model.init_locals == ["lr", "self", "width"]
    assert model.init_vars == model.init_locals
    assert model.init_dir == model.init_locals
    assert_same(snapshot(plain.Sc(width=4)), snapshot(model), "attributes")


def test_a_class_body_namespace_stays_the_namespace(write_module: Loader) -> None:
    # ``locals()`` in a class body is the namespace the class is made from
    # (it never holds the runtime: a class body's locals skip closure
    # variables), so it is returned as it is and a write to it defines.
    source = """
@DECORATE
class Ns:
    def __init__(self):
        self.n = jnp.zeros(())

    def step(self, v):
        self.n = self.n + v
        class Body:
            k = self.n
            locals()["made"] = 2
            vars()["also"] = 3
        return Body.made + Body.also + self.n
"""
    plain, dec = pair(write_module, source)
    check(plain, dec, "Ns()", [("step", (X1,))], modes=ALL)


# ======================================================================================
# 2. Hyperparameters saved from locals() in __init__
# ======================================================================================

HPARAMS = """
def config(**kw):
    return sorted(kw.items())


@DECORATE
class Hp:
    def __init__(self, width=3, lr=0.5, name="net"):
        self.hparams = {k: v for k, v in locals().items() if k != "self"}
        raw = dict(locals())
        del raw["self"]
        self.raw = raw
        self.w = jnp.ones((width,)) * lr
        self.label = "{name}-{width}".format(**locals())
        self.keys = config(**locals())[0][0]

    def step(self, v):
        self.w = self.w + v
        return self.w

    def describe(self, v):
        self.w = self.w * v
        text = "%(v)s" % vars()
        return "{v}|{self.__class__.__name__}".format(**locals()), text, sorted(locals())

    def call_with(self, v):
        self.w = self.w + v
        def takes(self, v):
            return v * 2
        return takes(**{k: x for k, x in locals().items() if k != "takes"}) + self.w
"""


def test_hparams_from_locals_are_plain(write_module: Loader) -> None:
    plain, dec = pair(write_module, HPARAMS)
    check(plain, dec, "Hp(width=4, lr=0.25)", [("step", (X1,)), ("call_with", (X2,))], modes=ALL)
    check(plain, dec, "Hp()", [("describe", (2,))], modes=NO_JIT)
    expected, model = plain.Hp(width=4, lr=0.25), dec.Hp(width=4, lr=0.25)
    assert model.hparams == expected.hparams == {"width": 4, "lr": 0.25, "name": "net"}
    assert model.raw == expected.raw
    assert model.label == expected.label == "net-4"
    for saved in (model.hparams, model.raw):
        assert pickle.loads(pickle.dumps(saved)) == saved
        assert pickle.dumps(saved) == pickle.dumps(expected.hparams)


# ======================================================================================
# 3. A user's own __autostate__
# ======================================================================================


@pytest.mark.parametrize(
    ("prelude", "signature", "body"),
    [
        pytest.param("__autostate__ = 5.0", "self, v",
                     "self.n = self.n + v\n        return __autostate__ + self.n", id="global"),
        pytest.param("__autostate__ = 5.0\n__autostate_1__ = 7.0", "self, v",
                     "self.n = self.n + v\n        return __autostate__ + __autostate_1__ + self.n",
                     id="both-globals"),
        pytest.param("", "self, __autostate__",
                     "self.n = self.n + __autostate__\n        return self.n", id="parameter"),
        pytest.param("", "self, v",
                     "__autostate__ = v * 2\n        self.n = self.n + __autostate__\n"
                     "        return self.n + len(locals()) + 10 * len(dir())", id="local"),
        pytest.param("", "__autostate__, v",
                     "__autostate__.n = __autostate__.n + v\n        return __autostate__.n",
                     id="receiver"),
        pytest.param("", "self, v",
                     "f = lambda __autostate__: __autostate__ + self.n\n"
                     "        self.n = f(v)\n        return self.n", id="lambda-parameter"),
        pytest.param("autostate_ = 5.0", "self, v",
                     "self.n = self.n + v\n        return autostate_ + self.n", id="lookalike"),
    ],
)
def test_a_user_name_spelled_like_the_runtime_is_the_users(
    write_module: Loader, prelude: str, signature: str, body: str
) -> None:
    source = f"""
{prelude}


@DECORATE
class G:
    def __init__(self):
        self.n = jnp.zeros(())

    def step({signature}):
        {body}

    def touch(self):
        self.n = self.n
"""
    plain, dec = pair(write_module, source)
    check(plain, dec, "G()", [("step", (X1,)), ("step", (X2,))], modes=ALL)


def test_locals_beside_a_users_own_autostate(write_module: Loader) -> None:
    source = """
@DECORATE
class U:
    def __init__(self):
        self.n = jnp.zeros(())

    def step(self, v):
        __autostate__ = v
        self.n = self.n + __autostate__
        return sorted(locals()), dir(), self.n
"""
    plain, dec = pair(write_module, source)
    check(plain, dec, "U()", [("step", (X1,))], modes=NO_JIT)
    assert dec.U.step.__code__.co_freevars == ("__autostate_1__",)


def test_runtime_name_avoids_every_spelling_in_the_text() -> None:
    assert runtime_name("def f(self):\n    return self.x\n") == RUNTIME_NAME
    assert runtime_name("return __autostate__") == "__autostate_1__"
    assert runtime_name("__autostate__ + __autostate_1__") == "__autostate_2__"
    assert runtime_name("return autostate_ + __autostate_2__") == RUNTIME_NAME
    # Python reads identifiers in NFKC: a fullwidth "a" spells the same name.
    assert runtime_name("return __\uff41utostate__") == "__autostate_1__"


def test_the_wrapper_binds_the_chosen_name() -> None:
    text = "    def step(self, __autostate__):\n        return self.x\n"
    source = MethodSource("step", "step", "m.py", 3, text, ("k",), True, "M", "step")
    wrapper, _ = analysis.wrapper_source("M", source)
    assert " def __autostate_outer__(k, __autostate_1__):\n" in wrapper


# ======================================================================================
# 4. A module that rebinds locals / vars / dir
# ======================================================================================

REBOUND = """
import builtins

CALLS = []


def locals():
    CALLS.append("locals")
    return {"mine": 1, "__autostate__": 0}


def vars(*args):
    CALLS.append("vars")
    return builtins.vars(*args) if args else {"v": 2}


def dir():
    CALLS.append("dir")
    return ["__autostate__", "d"]


@DECORATE
class Rb:
    def __init__(self):
        self.n = jnp.zeros(())

    def step(self, v):
        self.n = self.n + v
        return sorted(locals()), sorted(vars()), dir(), self.n

    def counts(self, v):
        self.n = self.n + v
        return self.n + len(locals()) + 10 * len(vars()) + 100 * len(dir())

    def local_rebind(self, v, dir=lambda: ["p"]):
        locals = lambda: {"q": 3}
        self.n = self.n + v
        return locals(), dir(), self.n
"""


def test_a_modules_own_scope_functions_are_called_as_written(write_module: Loader) -> None:
    plain, dec = pair(write_module, REBOUND)
    check(plain, dec, "Rb()", [("step", (X1,)), ("local_rebind", (X2,))], modes=NO_JIT)
    check(plain, dec, "Rb()", [("counts", (X1,))], modes=ALL)
    plain.CALLS.clear()
    dec.CALLS.clear()
    plain.Rb().step(X1)
    dec.Rb().step(X1)
    assert dec.CALLS == plain.CALLS == ["locals", "vars", "dir"]


# ======================================================================================
# 5. What stays: frame inspection
# ======================================================================================


def test_frame_inspection_still_shows_the_runtime(write_module: Loader) -> None:
    # Documented (docs/faq.md): a frame's f_locals lists every closure
    # variable, the runtime's included; only the calls are rewritten.
    source = """
import sys


@DECORATE
class Fr:
    def __init__(self):
        self.n = jnp.zeros(())

    def step(self, v):
        self.n = self.n + v
        return sorted(sys._getframe().f_locals)
"""
    plain, dec = pair(write_module, source)
    assert plain.Fr().step(X1) == ["self", "v"]
    assert dec.Fr().step(X1) == [RUNTIME_NAME, "self", "v"]
