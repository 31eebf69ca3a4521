"""Differential bug hunt 4: stored callables, sub-model assignment, writes
behind the descriptors, plain holders and special methods through f.

Each source is built twice with ``write_module``: plain Python (``@DECORATE``
removed) and ``@autostate.stateful``. The plain run is the reference.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import pytest
from differential import (  # noqa: I001 - tests/ is on sys.path
    _fcall,
    assert_same,
    check,
    raises_autostate,
    snapshot,
)

import autostate

Loader = Callable[..., types.ModuleType]
Call = tuple[str, tuple[Any, ...]]

HEADER = """
from __future__ import annotations
import collections
import copy
import dataclasses
import functools
import typing
import weakref
import jax
import jax.numpy as jnp
import numpy as np
import autostate
TRACES = []
"""

PYLAX = ""

_PAIRS: dict[str, tuple[types.ModuleType, types.ModuleType]] = {}


def pair(write_module: Loader, source: str) -> tuple[types.ModuleType, types.ModuleType]:
    """The source as plain Python and decorated, built once per source text."""
    if source not in _PAIRS:
        _PAIRS[source] = _pair(write_module, source)
    return _PAIRS[source]


def _pair(write_module: Loader, source: str) -> tuple[types.ModuleType, types.ModuleType]:
    """The source as plain Python and decorated; ``lax.*`` is a Python loop in the plain one."""
    plain = write_module(
        HEADER + PYLAX + source.replace("@DECORATE", "").replace("@AUTOCHECKPOINT", "@checkpoint")
    )
    dec = write_module(
        HEADER + "from jax import lax\ncheckpoint = jax.checkpoint\nSTATE = autostate.state\n"
        + source.replace("@DECORATE", "@autostate.stateful").replace(
            "@AUTOCHECKPOINT", "@autostate.checkpoint"
        )
    )
    return plain, dec


def f_still_works(f: Any, states: dict[str, Any], name: str, *args: Any) -> None:
    """f answers the same eagerly and under jit after a refused call."""
    out1, s1 = _fcall(f, name)(states, *args)
    out2, s2 = jax.jit(lambda f, s, *a: _fcall(f, name)(s, *a))(f, states, *args)
    assert_same(out1, out2, "after refusal")
    assert_same(s1, s2, "states after refusal")


# ======================================================================================
# 1. Callables kept as attributes
# ======================================================================================

CALLABLES = """
@DECORATE
class Sub:
    def __init__(self, w=2.0):
        self.w = jnp.asarray(w)
        self.c = jnp.zeros(())

    def fwd(self, x):
        self.c = self.c + 1
        return self.w * x


@DECORATE
class MultiCell:
    def __init__(self):
        self.n = jnp.zeros(())
        self.a = Sub(2.0)
        self.b = Sub(3.0)
        a, b, k, box = self.a, self.b, 1.5, [10.0]
        self.fn = lambda x: a.fwd(x) + b.fwd(x) * k + box[0] + self._bump(x)

    def _bump(self, x):
        self.n = self.n + x
        return self.n

    def __call__(self, x):
        return self.fn(x)


@DECORATE
class Nested:
    def __init__(self):
        self.n = jnp.zeros(())
        self.make = lambda s: (lambda x: self._bump(x * s))

    def _bump(self, x):
        self.n = self.n + x
        return self.n

    def __call__(self, x):
        return self.make(2.0)(x)


@DECORATE
class Defaults:
    def __init__(self, s=2.0, t=3.0):
        self.n = jnp.zeros(())
        self.fn = lambda x, s=s, *, t=t: self._bump(x * s + t)

    def _bump(self, x):
        self.n = self.n + x
        return self.n

    def __call__(self, x):
        return self.fn(x)


@DECORATE
class KwOnly:
    def __init__(self, k):
        self.n = jnp.zeros(())
        self.fn = lambda x, *, k=k: self._bump(x) * k

    def _bump(self, x):
        self.n = self.n + x
        return self.n

    def __call__(self, x):
        return self.fn(x)


@DECORATE
class Counting:
    def __init__(self):
        self.n = jnp.zeros(())
        count = 0

        def fn(x):
            nonlocal count
            count += 1
            return self._bump(x) * count

        self.fn = fn

    def _bump(self, x):
        self.n = self.n + x
        return self.n

    def __call__(self, x):
        return self.fn(x)


@DECORATE
class BoundBefore:
    def __init__(self):
        head = Sub(4.0)
        self.score = head.fwd
        self.head = head

    def __call__(self, x):
        return self.score(x)


@DECORATE
class Tied:
    def __init__(self):
        s = Sub(2.0)
        self.a = s
        self.b = s
        self.fa = self.a.fwd
        self.fb = self.b.fwd

    def __call__(self, x):
        return self.fa(x) + self.fb(x) + self.a.c


@DECORATE
class Foreign:
    def __init__(self):
        self.n = jnp.zeros(())
        self.score = Sub(5.0).fwd

    def __call__(self, x):
        self.n = self.n + 1
        return self.score(x) + self.n


@DECORATE
class DeadRef:
    def __init__(self):
        self.n = jnp.zeros(())
        self.ref = weakref.ref(Sub(1.0))

    def __call__(self, x):
        self.n = self.n + x
        r = self.ref()
        return self.n if r is None else r.fwd(x)


@DECORATE
class Child:
    def __init__(self, parent):
        self._parent = weakref.ref(parent)
        self.k = jnp.ones(())

    def fwd(self, x):
        return self._parent().scale * x * self.k


@DECORATE
class Parent:
    def __init__(self):
        self.scale = jnp.asarray(3.0)
        self.n = jnp.zeros(())
        self.child = Child(self)

    def __call__(self, x):
        self.n = self.n + self.child.fwd(x)
        return self.n


def _helper(x):
    return x * 7


@DECORATE
class StaticObjs:
    def __init__(self):
        self.n = jnp.zeros(())
        self.sfn = staticmethod(_helper)
        self.cfn = type(self).scale_of

    @classmethod
    def scale_of(cls, x):
        return x * 0.5

    def __call__(self, x):
        self.n = self.n + self.sfn(x) + self.cfn(x)
        return self.n


@DECORATE
class TreePartial:
    def __init__(self):
        self.n = jnp.zeros(())
        self.fn = jax.tree_util.Partial(self._bump)

    def _bump(self, x):
        self.n = self.n + x
        return self.n

    def __call__(self, x):
        return self.fn(x)


@DECORATE
class InList:
    def __init__(self):
        self.n = jnp.zeros(())
        self.sub = Sub(3.0)
        self.fns = ([self._bump, lambda x: self.sub.fwd(x)], {"r": weakref.ref(self.sub)})

    def _bump(self, x):
        self.n = self.n + x
        return self.n

    def __call__(self, x):
        return self.fns[0][0](x) + self.fns[0][1](x) + self.fns[1]["r"]().fwd(x)


def _outer_of(model):
    return lambda: model.n


@DECORATE
class ViaFunction:
    def __init__(self):
        self.n = jnp.zeros(())
        get = _outer_of(self)
        self.fn = lambda x: get() + x

    def __call__(self, x):
        self.n = self.n + x
        return self.fn(x)


@DECORATE
class ViaBox:
    def __init__(self):
        self.n = jnp.zeros(())
        box = [self]
        self.fn = lambda x: box[0].n + x

    def __call__(self, x):
        self.n = self.n + x
        return self.fn(x)


@DECORATE
class Appender:
    def __init__(self):
        self.n = jnp.zeros(())
        self.log = [jnp.zeros(())]
        self.push = self.log.append

    def __call__(self, x):
        self.n = self.n + x
        self.push(self.n)
        return self.n
"""


@pytest.mark.parametrize(
    "build",
    ["MultiCell()", "Nested()", "Defaults()", "BoundBefore()", "Tied()", "Parent()",
     "StaticObjs()", "InList()", "DeadRef()"],
)
def test_stored_callables_follow_the_running_model(write_module: Loader, build: str) -> None:
    plain, dec = pair(write_module, CALLABLES)
    check(plain, dec, build, [("__call__", (1.0,)), ("__call__", (2.0,))])


def test_closure_over_model_through_a_helper_function(write_module: Loader) -> None:
    """The closure's cell holds a function that closes over the model."""
    plain, dec = pair(write_module, CALLABLES)
    try:
        check(plain, dec, "ViaFunction()", [("__call__", (1.0,)), ("__call__", (2.0,))])
    except autostate.AutostateError:
        pass  # a clear refusal is fine


def test_closure_over_a_list_holding_the_model(write_module: Loader) -> None:
    plain, dec = pair(write_module, CALLABLES)
    try:
        check(plain, dec, "ViaBox()", [("__call__", (1.0,)), ("__call__", (2.0,))])
    except autostate.AutostateError:
        pass


def test_method_bound_to_a_model_outside_the_graph(write_module: Loader) -> None:
    plain, dec = pair(write_module, CALLABLES)
    try:
        check(plain, dec, "Foreign()", [("__call__", (1.0,)), ("__call__", (2.0,))])
    except autostate.AutostateError:
        pass


def test_tree_util_partial_of_a_method(write_module: Loader) -> None:
    plain, dec = pair(write_module, CALLABLES)
    try:
        check(plain, dec, "TreePartial()", [("__call__", (1.0,)), ("__call__", (2.0,))])
    except autostate.AutostateError:
        pass


def test_builtin_method_of_a_model_list(write_module: Loader) -> None:
    """``self.push = self.log.append``: f must not append tracers to the eager model."""
    plain, dec = pair(write_module, CALLABLES)
    model = dec.Appender()
    ref = plain.Appender()
    ref(1.0)
    model(1.0)
    assert len(model.log) == len(ref.log) == 2
    try:
        f, states = model.functionalize()
        jax.jit(f)(states, 2.0)
    except autostate.AutostateError:
        return
    assert len(model.log) == 2, "f's call appended to the eager model's list"
    for v in model.log:
        assert not isinstance(v, jax.core.Tracer), "leaked tracer"


def test_nonlocal_counter_cell_shared_like_python(write_module: Loader) -> None:
    plain, dec = pair(write_module, CALLABLES)
    check(plain, dec, "Counting()", [("__call__", (1.0,)), ("__call__", (2.0,))],
          modes=("eager", "f"))


def test_kwdefaults_distinguish_jit_cache_entries(write_module: Loader) -> None:
    """Two models whose closures differ only in a keyword-only default."""
    plain, dec = pair(write_module, CALLABLES)
    step = jax.jit(lambda f, s, x: f(s, x))
    f1, s1 = dec.KwOnly(2.0).functionalize()
    f2, s2 = dec.KwOnly(5.0).functionalize()
    out1, _ = step(f1, s1, 1.0)
    out2, _ = step(f2, s2, 1.0)
    assert float(out1) == float(plain.KwOnly(2.0)(1.0)) == 2.0
    assert float(out2) == float(plain.KwOnly(5.0)(1.0)) == 5.0


def test_positional_defaults_distinguish_jit_cache_entries(write_module: Loader) -> None:
    plain, dec = pair(write_module, CALLABLES)
    step = jax.jit(lambda f, s, x: f(s, x))
    outs = [float(step(*dec.Defaults(s, 0.0).functionalize(), 1.0)[0]) for s in (2.0, 5.0)]
    assert outs == [float(plain.Defaults(s, 0.0)(1.0)) for s in (2.0, 5.0)]


def test_closure_cell_value_distinguishes_jit_cache_entries(write_module: Loader) -> None:
    src = CALLABLES + """
@DECORATE
class CellK:
    def __init__(self, k):
        self.n = jnp.zeros(())
        self.fn = lambda x: self._bump(x) * k

    def _bump(self, x):
        self.n = self.n + x
        return self.n

    def __call__(self, x):
        return self.fn(x)
"""
    plain, dec = pair(write_module, src)
    step = jax.jit(lambda f, s, x: f(s, x))
    outs = [float(step(*dec.CellK(k).functionalize(), 1.0)[0]) for k in (2.0, 5.0)]
    assert outs == [float(plain.CellK(k)(1.0)) for k in (2.0, 5.0)]


def test_functools_partial_in_a_dict_is_refused_at_functionalize(write_module: Loader) -> None:
    src = CALLABLES + """
@DECORATE
class PartialDict:
    def __init__(self):
        self.n = jnp.zeros(())
        self.fns = {"a": (functools.partial(lambda k, x: self._bump(x * k), 2.0),)}

    def _bump(self, x):
        self.n = self.n + x
        return self.n

    def __call__(self, x):
        return self.fns["a"][0](x)
"""
    plain, dec = pair(write_module, src)
    model = dec.PartialDict()
    assert float(model(1.0)) == float(plain.PartialDict()(1.0))
    with raises_autostate():
        model.functionalize()


RETRACE = CALLABLES + """
@DECORATE
class Retrace:
    def __init__(self):
        self.n = jnp.zeros(())
        self.sub = Sub(2.0)
        self.step = self._bump
        self.fn = lambda x: self._bump(x) + self.sub.fwd(x)
        self.ref = weakref.ref(self.sub)
        self.score = self.sub.fwd

    def _bump(self, x):
        TRACES.append(1)
        self.n = self.n + x
        return self.n

    def __call__(self, x):
        return self.fn(x) + self.step(x) + self.ref().fwd(x) + self.score(x)
"""


def test_functionalize_freeze_functionalize_does_not_retrace(write_module: Loader) -> None:
    plain, dec = pair(write_module, RETRACE)
    check(plain, dec, "Retrace()", [("__call__", (1.0,)), ("__call__", (2.0,))])
    model = dec.Retrace()
    f1, s1 = model.functionalize()
    step = jax.jit(lambda f, s, x: f(s, x))
    dec.TRACES.clear()
    _, s = step(f1, s1, 1.0)
    n_traces = len(dec.TRACES)
    f2, s2 = autostate.freeze(f1, s).functionalize()
    assert jax.tree_util.tree_structure(f1) == jax.tree_util.tree_structure(f2)
    _, s = step(f2, s2, 1.0)
    f3, s3 = autostate.freeze(f2, s).functionalize()
    _, s = step(f3, s3, 1.0)
    assert len(dec.TRACES) == n_traces, "jit retraced an equal f"
    assert_same(snapshot(s), {k: snapshot(v) for k, v in s.items()})


def test_grad_reaches_params_of_two_submodels_through_a_closure(write_module: Loader) -> None:
    plain, dec = pair(write_module, CALLABLES)
    f, states = dec.MultiCell().functionalize()
    g = jax.grad(lambda f: f(states, 2.0)[0])(f)
    assert float(g.model.a.w) == 2.0
    assert float(g.model.b.w) == pytest.approx(3.0)
    gj = jax.jit(jax.grad(lambda f: f(states, 2.0)[0]))(f)
    assert float(gj.model.b.w) == pytest.approx(3.0)


def test_grad_through_weakref_to_parent(write_module: Loader) -> None:
    plain, dec = pair(write_module, CALLABLES)
    f, states = dec.Parent().functionalize()
    g = jax.jit(jax.grad(lambda f: f(states, 2.0)[0]))(f)
    assert float(g.model.scale) == pytest.approx(2.0)


# ======================================================================================
# 2. Sub-models assigned outside __init__
# ======================================================================================

SUBMODELS = """
@DECORATE
class Sub:
    def __init__(self, w=2.0):
        self.w = jnp.asarray(w)
        self.c = jnp.zeros(())

    def fwd(self, x):
        self.c = self.c + 1
        return self.w * x


@DECORATE
class Blocks:
    def __init__(self):
        self.blocks = [Sub(1.0), Sub(2.0)]
        self.a = Sub(3.0)
        self.b = Sub(4.0)
        self.lazy = None
        self.pair = (Sub(5.0), jnp.zeros(()))
        self.score = self.a.fwd

    def relist(self, x):
        self.blocks = list(self.blocks)
        return self.blocks[0].fwd(x) + self.blocks[1].fwd(x)

    def same(self, x):
        self.a = self.a
        return self.a.fwd(x)

    def swap(self, x):
        self.a, self.b = self.b, self.a
        return self.a.fwd(x)

    def build(self):
        self.lazy = Sub(6.0)

    def use_lazy(self, x):
        return self.lazy.fwd(x)

    def build_inside(self, x):
        if self.lazy is None:
            self.lazy = Sub(6.0)
        return self.lazy.fwd(x)

    def bump_pair(self, x):
        self.pair = (self.pair[0], self.pair[1] + x)
        return self.pair[0].fwd(x) + self.pair[1]

    def bind_inside(self, x):
        self.score = self.b.fwd
        return self.score(x)

    def __call__(self, x):
        return self.a.fwd(x) + self.b.fwd(x)


@DECORATE
class Reset:
    def __init__(self):
        self.reset()

    def reset(self):
        self.head = Sub(3.0)
        self.n = jnp.zeros(())

    def __call__(self, x):
        self.n = self.n + 1
        return self.head.fwd(x) + self.n
"""


def _either_plain_or_refused(plain: Any, dec: Any, build: str, calls: list[Call]) -> None:
    """Eagerly like plain Python; through f either like plain or a StateAccessError."""
    check(plain, dec, build, calls, modes=("eager",))
    model = eval(build, vars(dec))  # noqa: S307
    f, states = model.functionalize()
    try:
        check(plain, dec, build, calls, modes=("f", "jit", "freeze"))
    except autostate.errors.StateAccessError:
        f_still_works(f, states, "__call__", 1.0)


def test_relisting_the_same_submodels(write_module: Loader) -> None:
    plain, dec = pair(write_module, SUBMODELS)
    _either_plain_or_refused(plain, dec, "Blocks()", [("relist", (1.0,)), ("relist", (2.0,))])


def test_reassigning_the_same_submodel_is_allowed(write_module: Loader) -> None:
    plain, dec = pair(write_module, SUBMODELS)
    check(plain, dec, "Blocks()", [("same", (1.0,)), ("same", (2.0,)), ("__call__", (1.0,))])


def test_swapping_submodels_inside_f_is_refused_and_f_survives(write_module: Loader) -> None:
    plain, dec = pair(write_module, SUBMODELS)
    check(plain, dec, "Blocks()", [("swap", (1.0,)), ("__call__", (1.0,))], modes=("eager",))
    model = dec.Blocks()
    f, states = model.functionalize()
    for call in (f.swap, jax.jit(f.swap)):
        with raises_autostate(autostate.errors.StateAccessError):
            call(states, 1.0)
    f_still_works(f, states, "__call__", 1.0)
    assert float(f(states, 1.0)[0]) == float(plain.Blocks()(1.0))


def test_lazily_built_submodel_eagerly_then_functionalized(write_module: Loader) -> None:
    plain, dec = pair(write_module, SUBMODELS)
    check(plain, dec, "(lambda m: (m.build(), m)[1])(Blocks())",
          [("use_lazy", (1.0,)), ("use_lazy", (2.0,))])
    model = dec.Blocks()
    model.build()
    f, states = model.functionalize()
    assert any(k.startswith("lazy") for k in states)
    g = jax.grad(lambda f: f.use_lazy(states, 2.0)[0])(f)
    assert float(g.model.lazy.w) == 2.0


def test_building_a_submodel_inside_f_is_refused(write_module: Loader) -> None:
    plain, dec = pair(write_module, SUBMODELS)
    check(plain, dec, "Blocks()", [("build_inside", (1.0,))], modes=("eager",))
    f, states = dec.Blocks().functionalize()
    with raises_autostate(autostate.errors.StateAccessError):
        f.build_inside(states, 1.0)
    with raises_autostate(autostate.errors.StateAccessError):
        jax.jit(f.build_inside)(states, 1.0)
    f_still_works(f, states, "__call__", 1.0)


def test_binding_a_submodel_method_inside_f_is_refused(write_module: Loader) -> None:
    plain, dec = pair(write_module, SUBMODELS)
    check(plain, dec, "Blocks()", [("bind_inside", (1.0,))], modes=("eager",))
    f, states = dec.Blocks().functionalize()
    with raises_autostate(autostate.errors.StateAccessError):
        jax.jit(f.bind_inside)(states, 1.0)
    f_still_works(f, states, "__call__", 1.0)


def test_tuple_of_model_and_array_state(write_module: Loader) -> None:
    plain, dec = pair(write_module, SUBMODELS)
    _either_plain_or_refused(plain, dec, "Blocks()", [("bump_pair", (1.0,)), ("bump_pair", (2.0,))])


def test_submodel_assigned_in_a_helper_called_by_init(write_module: Loader) -> None:
    plain, dec = pair(write_module, SUBMODELS)
    check(plain, dec, "Reset()", [("__call__", (1.0,)), ("__call__", (2.0,))])
    f, states = dec.Reset().functionalize()
    assert "head.c" in states
    g = jax.grad(lambda f: f(states, 2.0)[0])(f)
    assert float(g.model.head.w) == 2.0


# ======================================================================================
# 3. Writes behind the descriptors
# ======================================================================================

BEHIND = """
@DECORATE
class Sub:
    def __init__(self):
        self.w = jnp.asarray(2.0)
        self.c = jnp.zeros(())

    def fwd(self, x):
        self.c = self.c + 1
        return self.w * x


@DECORATE
class Behind:
    def __init__(self):
        self.w = jnp.asarray(3.0)
        self.n = jnp.zeros(())
        self.cfg = 1
        self.sub = Sub()

    def via_vars(self, x):
        vars(self)["n"] = x
        return x

    def via_update(self, x):
        self.__dict__.update(n=x)
        return x

    def via_object_state(self, x):
        object.__setattr__(self, "n", x)
        return x

    def via_object_param(self, x):
        object.__setattr__(self, "w", x)
        return x

    def via_sub_vars(self, x):
        vars(self.sub)["w"] = x
        return x

    def add_attr(self, x):
        vars(self)["extra"] = 1
        return x

    def del_attr(self, x):
        self.__dict__.pop("cfg")
        return x

    def set_static(self, x):
        vars(self)["cfg"] = 2
        return x

    def dunder_setattr(self, x):
        self.__setattr__("n", self.n + x)
        return self.n

    @functools.cached_property
    def doubled(self):
        return self.w * 2

    def use_cached(self, x):
        return self.doubled * x

    def __call__(self, x):
        self.n = self.n + x
        return self.n * self.w + self.sub.fwd(x)
"""


@pytest.mark.parametrize("method", ["via_vars", "via_update"])
def test_state_writes_through_the_instance_dict_are_state_writes(
    write_module: Loader, method: str
) -> None:
    """``vars(self)["n"] = x`` and ``self.__dict__.update(n=x)`` in a method
    mean ``self.n = x`` for a state, as in plain Python: eagerly, in f and
    under jit (they were refused inside f)."""
    plain, dec = pair(write_module, BEHIND)
    check(plain, dec, "Behind()", [(method, (5.0,)), ("__call__", (1.0,))])


@pytest.mark.parametrize(
    "method",
    # (``object.__setattr__(self, "w", x)`` with a literal name is ``self.w = x``:
    # ``w`` is a state; tests/test_setattr_spellings.py.)
    ["via_sub_vars", "add_attr", "del_attr", "set_static"],
)
def test_writes_behind_descriptors_are_refused_and_f_survives(
    write_module: Loader, method: str
) -> None:
    plain, dec = pair(write_module, BEHIND)
    check(plain, dec, "Behind()", [(method, (5.0,)), ("__call__", (1.0,))], modes=("eager",))
    model = dec.Behind()
    before = snapshot(model)
    f, states = model.functionalize()
    with raises_autostate():
        getattr(f, method)(states, 5.0)
    f_still_works(f, states, "__call__", 1.0)
    with raises_autostate():
        jax.jit(getattr(f, method))(states, 5.0)
    f_still_works(f, states, "__call__", 1.0)
    out, _ = f(states, 1.0)
    assert float(out) == float(plain.Behind()(1.0))
    assert_same(before, snapshot(model), "the eager model changed")


def test_object_setattr_on_state_means_an_assignment(write_module: Loader) -> None:
    """object.__setattr__ reaches the state's descriptor: plain meaning."""
    plain, dec = pair(write_module, BEHIND)
    check(plain, dec, "Behind()", [("via_object_state", (5.0,)), ("__call__", (1.0,))])


def test_dunder_setattr_call_means_an_assignment(write_module: Loader) -> None:
    plain, dec = pair(write_module, BEHIND)
    try:
        check(plain, dec, "Behind()", [("dunder_setattr", (1.0,)), ("dunder_setattr", (2.0,))])
    except autostate.AutostateError:
        f, states = dec.Behind().functionalize()
        f_still_works(f, states, "__call__", 1.0)


def test_cached_property_eager_f_caches_traced_is_refused(write_module: Loader) -> None:
    plain, dec = pair(write_module, BEHIND)
    check(plain, dec, "Behind()", [("use_cached", (2.0,)), ("use_cached", (3.0,))],
          modes=("eager", "f"))
    f, states = dec.Behind().functionalize()
    try:
        out, _ = jax.jit(lambda f, s, x: f.use_cached(s, x))(f, states, 2.0)
        assert float(out) == 12.0
        assert "doubled" not in vars(f.model), "a traced cached_property leaked into f"
    except autostate.errors.StateAccessError as err:
        assert "doubled" in str(err)
    f_still_works(f, states, "__call__", 1.0)
    out, _ = jax.jit(lambda f, s, x: f(s, x))(f, states, 2.0)
    assert float(out) == float(plain.Behind()(2.0))
    out, _ = f.use_cached(states, 2.0)
    assert float(out) == 12.0


# ======================================================================================
# 4. Plain holders
# ======================================================================================

HOLDERS = """
class Config:
    def __init__(self):
        self.depth = 2
        self.name = "x"
        self.rates = (0.1, 0.2)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Pytree:
    a: jax.Array
    b: jax.Array


class Opt(typing.NamedTuple):
    count: jax.Array
    mu: jax.Array


@DECORATE
class Helper:
    def __init__(self, owner):
        self.owner = owner
        self.k = jnp.asarray(2.0)

    def read(self):
        return self.owner.n * self.k


class Hook:
    def __init__(self, model):
        self.model = model


class Box:
    def __init__(self, inner):
        self.inner = inner


@DECORATE
class Legit:
    def __init__(self):
        self.cfg = Config()
        self.tree = Pytree(jnp.ones(2), jnp.zeros(2))
        self.opt = Opt(jnp.zeros((), jnp.int32), jnp.zeros(2))
        self.helper = Helper(self)
        self.n = jnp.zeros(())

    def __call__(self, x):
        self.n = self.n + x
        self.opt = Opt(self.opt.count + 1, self.opt.mu + self.tree.a * x)
        return (self.n + self.helper.read() + self.tree.b.sum()) * self.cfg.depth


@DECORATE
class DeepHook:
    def __init__(self):
        self.n = jnp.zeros(())
        self.hold = Box(Box(Box(Box(Box(Box(Hook(self)))))))

    def __call__(self, x):
        self.n = self.n + x
        return self.hold.inner.inner.inner.inner.inner.inner.model.n


@DECORATE
class SetHook:
    def __init__(self):
        self.n = jnp.zeros(())
        self.hooks = frozenset([Hook(self)])

    def __call__(self, x):
        self.n = self.n + x
        return next(iter(self.hooks)).model.n


@DECORATE
class DequeHook:
    def __init__(self):
        self.n = jnp.zeros(())
        self.hooks = collections.deque([Hook(self)])

    def __call__(self, x):
        self.n = self.n + x
        return self.hooks[0].model.n


@DECORATE
class ShallowHook:
    def __init__(self):
        self.n = jnp.zeros(())
        self.hook = Hook(self)

    def __call__(self, x):
        self.n = self.n + x
        return self.hook.model.n
"""


def test_legit_holders_work(write_module: Loader) -> None:
    plain, dec = pair(write_module, HOLDERS)
    check(plain, dec, "Legit()", [("__call__", (1.0,)), ("__call__", (2.0,))])
    f, states = dec.Legit().functionalize()
    g = jax.jit(jax.grad(lambda f: f(states, 2.0)[0]))(f)
    assert_same(np.full(2, 0.0), g.model.tree.a)


def test_shallow_back_reference_is_refused(write_module: Loader) -> None:
    _, dec = pair(write_module, HOLDERS)
    with raises_autostate():
        dec.ShallowHook().functionalize()


@pytest.mark.parametrize(
    "build",
    [
        "DeepHook()",
        "SetHook()",
        "DequeHook()",
    ],
)
def test_hidden_back_reference_is_refused_or_right(write_module: Loader, build: str) -> None:
    plain, dec = pair(write_module, HOLDERS)
    try:
        dec_model = eval(build, vars(dec))  # noqa: S307
        dec_model.functionalize()
    except autostate.AutostateError:
        return
    check(plain, dec, build, [("__call__", (1.0,)), ("__call__", (2.0,))])


# ======================================================================================
# 5. Special and private methods through f
# ======================================================================================

SPECIAL = """
class Mixin:
    def __len__(self):
        return 3


@DECORATE
class Seq(Mixin):
    def __init__(self):
        self.n = jnp.zeros(())
        self.w = jnp.asarray(2.0)

    def __getitem__(self, i):
        self.n = self.n + i
        return self.w * i

    def __neg__(self):
        self.n = self.n - 1
        return -self.w

    def __matmul__(self, other):
        self.n = self.n + other
        return self.w * other

    def _private(self, x):
        self.n = self.n * x
        return self.n

    def __call__(self, x):
        return self[x] + self._private(x)
"""


@pytest.mark.parametrize(
    "calls",
    [
        [("__getitem__", (2.0,)), ("__getitem__", (3.0,))],
        [("__neg__", ()), ("__matmul__", (3.0,))],
        [("_private", (2.0,)), ("__call__", (1.0,)), ("_private", (3.0,))],
    ],
)
def test_special_and_private_methods_through_f(write_module: Loader, calls: list[Call]) -> None:
    plain, dec = pair(write_module, SPECIAL)
    check(plain, dec, "Seq()", calls)


def test_inherited_special_method_from_plain_mixin(write_module: Loader) -> None:
    plain, dec = pair(write_module, SPECIAL)
    f, states = dec.Seq().functionalize()
    assert len(plain.Seq()) == 3
    out, _ = f.__len__(states)
    assert out == 3


def test_undefined_special_method_is_attribute_error(write_module: Loader) -> None:
    _, dec = pair(write_module, SPECIAL)
    f, _ = dec.Seq().functionalize()
    with pytest.raises(AttributeError):
        f.__pos__  # noqa: B018
