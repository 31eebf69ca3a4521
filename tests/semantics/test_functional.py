"""``functionalize``/``freeze`` round trips: the states dict and its keys,
constants, ``copy``/``deepcopy``/``pickle`` of models and of ``f``.

Each case runs a class as plain Python and decorated (the harness in
``tests/semantics/harness.py``, or a direct comparison) and asserts the
decorated program means what the plain one does: eagerly, through
``f(states, ...)``, under ``jax.jit`` and after ``autostate.freeze``, or that it
is refused with a clear error. A known difference stays as ``xfail(strict=True)``
with what differs.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import pickle
import re
import sys
import types
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autostate
from autostate import errors
from autostate.errors import (
    StateAccessError,
    TracedEagerStateError,
)
from semantics.harness import (
    OPTIMIZERS,
    Loader,
    X,
    assert_bits,
    assert_clear,
    assert_same,
    assert_step,
    assert_typed,
    attrs,
    build_pair,
    check,
    check_transform,
    class_pair,
    data_for,
    error_line,
    f_train_step,
    floats,
    jit_counted,
    library,
    load_plain,
    names_of,
    no_handler_left,
    pair,
    plain_path,
    raises_autostate,
    read_plain,
    run_case,
    run_reference,
    same,
    snapshot,
    staged,
    train_compare,
)
from semantics.programs_class_shapes import EQX, PY313
from semantics.programs_containers import GPT
from semantics.programs_eager_writes import EAGER, SOURCE
from semantics.programs_escapes import TORCH_TRAINING as TORCH
from semantics.programs_functional import (
    CATS,
    CNN,
    MODELS,
    MULTI,
    NET,
    PACK,
    REBUILD,
    STATIC,
    TRAINER,
    VARIANTS,
)
from semantics.programs_functional import COPIES as RETURNED_COPIES
from semantics.programs_methods import CALLABLES
from semantics.programs_numerics import DTYPES, KINDS
from semantics.programs_shared import (
    A1,
    A2,
    ADAM,
    B3,
    KEY,
    LIT_STEPS,
    ONE,
    PACK_XS,
    PROMPT,
    TORCH_HEADER,
    V2,
    X1,
    XL,
    XV1,
    XV2,
    py313,
)
from semantics.programs_shared import TWO as X2
from semantics.programs_state_inference import NNX
from semantics.programs_static_state import LORA
from semantics.references import (
    JF_STEP,
    assert_shared,
    batch,
    cnn,
    gpt,
    has_tracer,
    images,
    jitted,
    lightning,
    params_of,
    ref_gpt,
    ref_greedy,
    step_jit,
    train_both,
    trained_pair,
)
from semantics.twins import (
    DECORATED,
    Classes,
    DecoratedChild,
    DecoratedParent,
    filled,
    run_twins,
    written,
)

HERE = __file__


@autostate.stateful
class Base:
    def __init__(self, start=0.0):
        self.x = jnp.array(start)

    def step(self, v):
        self.x += v
        return self.x

    def describe(self):
        return "base"


@autostate.stateful
class Child(Base):
    def __init__(self, start=1.0, *, extra=2.0):
        super().__init__(start)
        self.y = jnp.array(extra)

    def step(self, v):
        out = super().step(v)
        self.y = self.y + out
        return self.y

    def describe(self):
        return "child of " + super().describe()


def test_pickle_class_by_reference():
    assert pickle.loads(pickle.dumps(Base)) is Base
    assert pickle.loads(pickle.dumps(Child)) is Child


def test_pickle_instance_keeps_state_and_behaviour():
    model = Child()
    model.step(1.0)
    clone = pickle.loads(pickle.dumps(model))
    assert type(clone) is Child
    assert float(clone.x) == 2.0 and float(clone.y) == 4.0
    assert float(clone.step(1.0)) == 7.0  # x = 3, y = 4 + 3
    assert float(model.y) == 4.0  # the original is independent
    f, states = clone.functionalize()
    assert sorted(states) == ["x", "y"]


def test_pickle_frozen_model():
    f, states = Base(1.0).functionalize()
    _, states = f.step(states, 2.0)
    frozen = autostate.freeze(f, states)
    clone = pickle.loads(pickle.dumps(frozen))
    assert float(clone.x) == 3.0
    assert float(clone.step(1.0)) == 4.0


jit_call = staged(lambda f, s, *a: f(s, *a))


COPIES = """
import copy
import jax.numpy as jnp


class Copier:
    def __init__(self):
        self.count = jnp.zeros(())
        self.sub = Leaf()

    def __call__(self, x):
        trial = copy.copy(self)
        trial.count = trial.count + 100
        deep = copy.deepcopy(self)
        deep.count = deep.count + 7
        deep.sub.n = deep.sub.n + 5
        self.count = self.count + x
        self.sub.n = self.sub.n + 1
        return trial.count + deep.count + deep.sub.n


class Leaf:
    def __init__(self):
        self.n = jnp.zeros(())

    def touch(self):
        self.n = self.n + 0


# A copy protocol of its own: copies start three counts ahead.
class AheadCopier(Copier):
    def __getstate__(self):
        return {"count": self.count + 3, "sub": self.sub}

    def __setstate__(self, state):
        self.__dict__.update(state)


# Another: a reduction whose copies start counting from zero.
class ZeroCountCopier(Copier):
    def __reduce__(self):
        return (type(self).__new__, (type(self),), {"count": self.count * 0, "sub": self.sub})
"""


@pytest.mark.parametrize("name", ["Copier", "AheadCopier", "ZeroCountCopier"])
def test_copies_inside_a_functionalized_call_own_their_state(write_module, name):
    plain_cls, cls, module = class_pair(write_module, COPIES, name)
    autostate.stateful(module.Leaf)
    plain = plain_cls()
    expected = [float(plain(1.0)) for _ in range(2)]
    eager = cls()
    assert [float(eager(1.0)) for _ in range(2)] == expected
    f, states = cls().functionalize()
    outs = []
    for _ in range(2):
        out, states = jit_call(f, states, 1.0)
        outs.append(float(out))
    assert outs == expected
    assert {k: float(v) for k, v in states.items()} == {
        "count": float(plain.count), "sub.n": float(plain.sub.n)
    }


@pytest.mark.parametrize("method,arg", [("tolist", ()), ("grow", (1.0,))])
def test_state_structure_changes_between_calls(
    write_module: Loader, method: str, arg: tuple[Any, ...]
) -> None:
    plain, dec = pair(write_module, DTYPES)
    check(plain, dec, "Trees()", [(method, arg)])
    m = dec.Trees()
    getattr(m, method)(*arg)
    p = plain.Trees()
    getattr(p, method)(*arg)
    assert type(m.t) is type(p.t) and len(m.t) == len(p.t)


def test_category_subset(write_module: Loader) -> None:
    plain, dec = pair(write_module, VARIANTS)
    m = dec.Mixed()
    f, states = m.functionalize("cache")
    assert sorted(states) == ["kv"]
    p = plain.Mixed()
    expected = [p.only_cache(1.0), p.only_cache(2.0)]
    got = []
    for x in (1.0, 2.0):
        out, states = staged(f.only_cache)(states, x)
        got.append(out)
    assert_same(expected, got)
    assert_same(p.kv, states["kv"])
    # the other category is an eager slot inside f: written under jit, a clear error
    with pytest.raises(errors.TracedEagerStateError, match="Mixed.n"):
        staged(f)(states, 1.0)
    # eagerly it updates f.model in place (documented), never the original model
    _, states = f(states, 1.0)
    assert_same(np.ones(2), f.model.n)
    assert_same(np.zeros(2), m.n)
    frozen = autostate.freeze(f, states)
    assert_same(np.ones(2), frozen.n)


def test_category_predicate_and_both_arguments(write_module: Loader) -> None:
    _, dec = pair(write_module, VARIANTS)
    _, s1 = dec.Mixed().functionalize("cache")
    _, s2 = dec.Mixed().functionalize(category_predicate=lambda c: c == "cache")
    assert sorted(s1) == sorted(s2) == ["kv"]
    with pytest.raises(errors.CategoryArgumentError):
        dec.Mixed().functionalize("cache", category_predicate=lambda c: True)


def test_freeze_then_functionalize_again_is_the_same_f(write_module: Loader) -> None:
    _, dec = pair(write_module, VARIANTS)
    f, states = dec.Mixed().functionalize()
    _, states = f(states, 1.0)
    f2, states2 = autostate.freeze(f, states).functionalize()
    assert f == f2 and hash(f) == hash(f2)
    assert_same(states, states2)
    step = jax.jit(lambda f, s, x: f(s, x))
    a = step(f, states, 1.0)
    b = step(f2, states2, 1.0)
    assert step._cache_size() == 1
    assert_same(a, b)


def test_nested_functionalize_inside_a_method(write_module: Loader) -> None:
    _, dec = pair(write_module, VARIANTS)
    o = dec.Outer()
    expected = [o(1.0), o(1.0)]
    assert_same(np.zeros(2), o.inner.n)  # the inner f works on a copy
    f, states = dec.Outer().functionalize()
    got = []
    for _ in range(2):
        out, states = f(states, 1.0)
        got.append(out)
    assert_same(expected, got)


def test_states_from_another_f_and_bad_keys(write_module: Loader) -> None:
    _, dec = pair(write_module, VARIANTS)
    fa, sa = dec.Mixed().functionalize()
    _, sb = dec.Inner().functionalize()
    with pytest.raises(errors.UnhandledLocalStateError, match="'kv' is missing"):
        fa(sb, 1.0)
    with pytest.raises(errors.UnhandledLocalStateError, match="missing"):
        staged(fa)({"n": sa["n"]}, 1.0)
    with pytest.raises(errors.StateDictError, match="'zz'"):
        fa({**sa, "zz": jnp.zeros(())}, 1.0)
    with pytest.raises(errors.InvalidTypeError):
        fa(list(sa.values()), 1.0)
    out, _ = fa(sa, 1.0)  # still works
    assert float(out) == 6.0


def test_pickle_model_then_continue(write_module: Loader) -> None:
    plain, dec = pair(write_module, DTYPES)
    p, d = plain.Trees(), dec.Trees()
    p.step(1.0)
    d.step(1.0)
    d2 = pickle.loads(pickle.dumps(d))
    assert_same(p.step(2.0), d2.step(2.0))
    assert_same(snapshot(p), snapshot(d2))
    f, states = d2.functionalize()
    assert_same(p.step(3.0), staged(f.step)(states, 3.0)[0])


def test_pickle_f_and_frozen_keep_aliasing(write_module: Loader) -> None:
    plain, dec = pair(write_module, VARIANTS)
    f, states = dec.Two().functionalize()
    _, states = f(states, 1.0)
    g = pickle.loads(pickle.dumps(f))
    assert g == f
    assert g.model.p.shared is g.model.q.shared
    frozen = pickle.loads(pickle.dumps(autostate.freeze(f, states)))
    assert frozen.p.shared is frozen.q.shared is frozen.alias
    p = plain.Two()
    p(1.0)
    assert_same(p(2.0), frozen(2.0))
    assert_same(snapshot(p), snapshot(frozen))


def test_pickle_f_made_by_tree_map(write_module: Loader) -> None:
    plain, dec = pair(write_module, VARIANTS)
    f, states = dec.Two().functionalize()
    h = pickle.loads(pickle.dumps(jax.tree_util.tree_map(lambda v: v * 3, f)))
    out, _ = h(states, 1.0)
    p = plain.Two()
    p.p.shared.w = p.p.shared.w * 3
    assert_same(p(1.0), out)


def test_pickle_prng_and_namedtuple_states(write_module: Loader) -> None:
    plain, dec = pair(write_module, DTYPES)
    p, d = plain.Keys(1), dec.Keys(1)
    p(1.0)
    d(1.0)
    d2 = pickle.loads(pickle.dumps(d))
    assert_same(p(2.0), d2(2.0))
    f, states = dec.Trees().functionalize()
    states2 = pickle.loads(pickle.dumps(states))
    assert type(states2["pt"]) is dec.Pt
    assert_same(f.step(states, 1.0), f.step(states2, 1.0))


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
    step = staged(lambda f, s, x: f(s, x))
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


def full(v: float) -> Any:
    return jnp.full((2,), v, jnp.float32)


def differential(write_module: Loader, source: str, scenario: Callable[[Any], Any]) -> None:
    """Runs ``scenario(module)`` with the plain and the decorated module; same result."""
    plain, dec = pair(write_module, source, fresh=True)
    assert_same(scenario(plain), scenario(dec), "scenario")


def _written(k: Any, cls: str = "Model") -> Any:
    model = getattr(k, cls)()
    model.step(full(1.0))
    model.step(full(1.5))
    return model


def test_functionalize_then_eager_writes_then_freeze(write_module: Loader) -> None:
    def scenario(k: Any) -> Any:
        model = _written(k)
        if hasattr(model, "functionalize"):
            f, states = model.functionalize()
            model.step(full(2.0))
            model.x = full(3.0)
            _, states = staged(lambda f, s, v: f.step(s, v))(f, states, full(4.0))
            frozen = autostate.freeze(f, states)
            frozen.step(full(6.0))
            return [model.x, model.n, frozen.x, frozen.n]
        ref = copy.deepcopy(model)
        model.step(full(2.0))
        model.x = full(3.0)
        ref.step(full(4.0))
        ref.step(full(6.0))
        return [model.x, model.n, ref.x, ref.n]

    differential(write_module, EAGER, scenario)


@pytest.mark.parametrize("build", ["TwoPaths()", "Callables()", "Statics()", "CopiesSelf()"])
def test_rebuilt_models_match_plain(write_module: Loader, build: str) -> None:
    plain, dec = pair(write_module, REBUILD, fresh=True)
    check(plain, dec, build, [("__call__", (1.0,)), ("__call__", (2.0,)), ("__call__", (3.0,))])


def test_two_fs_from_one_model_interleaved_under_jit(write_module: Loader) -> None:
    plain, dec = pair(write_module, REBUILD, fresh=True)
    ref1, ref2 = plain.TwoPaths(), plain.TwoPaths()
    model = dec.TwoPaths()
    f1, s1 = model.functionalize()
    f2, s2 = model.functionalize()
    step = staged(lambda f, s, x: f(s, x))
    outs, exp = [], []
    for v in (1.0, 2.0, 3.0):
        o1, s1 = step(f1, s1, v)
        o2, s2 = step(f2, s2, v * 10)
        outs += [o1, o2]
        exp += [ref1(v), ref2(v * 10)]
    assert_same(exp, outs, "outs")
    a, b = autostate.freeze(f1, s1), autostate.freeze(f2, s2)
    np.testing.assert_allclose(a.a.n, ref1.a.n)
    np.testing.assert_allclose(b.table["q"][1].n, ref2.table["q"][1].n)


def test_f_called_twice_in_one_trace_and_a_tree_map_copy(write_module: Loader) -> None:
    plain, dec = pair(write_module, REBUILD, fresh=True)
    ref = plain.TwoPaths()
    e1, e2 = ref(1.0), ref(2.0)
    f, states = dec.TwoPaths().functionalize()

    @staged
    def run(f: Any, s: Any) -> Any:
        g = jax.tree_util.tree_map(lambda v: v, f)
        o1, s = f(s, 1.0)
        o2, s = g(s, 2.0)
        return (o1, o2), s

    (o1, o2), states = run(f, states)
    assert_same([e1, e2], [o1, o2], "outs")
    np.testing.assert_allclose(autostate.freeze(f, states).a.n, ref.a.n)


def test_nested_functionalize_inside_a_traced_call(write_module: Loader) -> None:
    src = REBUILD + """

@DECORATE
class Outer:
    def __init__(self):
        self.sub = Leaf(2.0)
        self.k = jnp.ones(())

    def __call__(self, x):
        g, st = self.sub.functionalize()
        out, st = g(st, x)
        self.k = self.k + out + st["n"]
        return self.k
"""
    _, dec = pair(write_module, src, fresh=True)
    # Plain meaning: functionalize() is a snapshot; the inner call never changes self.sub.
    expected_k = 1.0 + (2.0 * 1.0 + 1.0) + 1.0
    model = dec.Outer()
    f, states = model.functionalize()
    out_e, st_e = f(states, 1.0)
    out_j, st_j = staged(lambda f, s, x: f(s, x))(f, states, 1.0)
    np.testing.assert_allclose(out_e, expected_k)
    np.testing.assert_allclose(out_j, expected_k)
    np.testing.assert_allclose(st_j["sub.n"], 0.0)
    np.testing.assert_allclose(st_e["sub.n"], 0.0)


def test_round_trip_functionalize_jit_freeze_eager_functionalize(write_module: Loader) -> None:
    plain, dec = library(write_module)
    template, model, n_out = build_pair(plain, dec, "tracked")
    data = data_for(n_out, 6)
    ref_model = copy.deepcopy(template)
    params = None
    for rnd in range(2):
        f, states = model.functionalize()
        params = names_of(f)
        assert_same(read_plain(ref_model, params), params, f"round {rnd} params")
        assert_same(read_plain(ref_model, states), states, f"round {rnd} states")
        chunk = data[3 * rnd: 3 * rnd + 2]
        ref = run_reference(ref_model, params, dict(states), "sgd", chunk)
        opt_state = ()
        step = f_train_step("sgd")
        for i, (x, y) in enumerate(chunk):
            loss, f, opt_state, states = step(f, opt_state, states, x, y)
            assert_step(ref[i], loss, f, states, f"round {rnd} step {i}")
        model = autostate.freeze(f, states)
        ref_model = load_plain(ref_model, ref[-1][1], ref[-1][2])
        x = data[3 * rnd + 2][0]
        assert_same(ref_model(x), model(x), f"round {rnd} eager call")
        assert_same(snapshot(ref_model), snapshot(model), f"round {rnd} eager state")


def trainer_reference(template: Any, f: Any, states: Any, data: Any) -> list[tuple[Any, Any, Any]]:
    return run_reference(template, names_of(f), dict(states), "momentum", data)


def test_trainer_holding_f_and_an_optimizer_eagerly(write_module: Loader) -> None:
    _, dec = pair(write_module, TRAINER)
    plain, _ = library(write_module)
    template, model, n_out = build_pair(plain, dec, "mlp_dropout")
    data = data_for(n_out, 3)
    trainer = dec.FTrainer(model)
    ref = trainer_reference(template, trainer.f, trainer.states, data)
    for i, (x, y) in enumerate(data):
        loss = trainer.train_step(x, y)
        assert_step(ref[i], loss, trainer.f, trainer.states, f"eager step {i}")
        assert_same(ref[i][0], trainer.loss)
        assert int(trainer.opt.t) == i + 1


@pytest.mark.parametrize("jit", [False, True])
def test_trainer_holding_f_and_an_optimizer_functionalized(write_module: Loader, jit: bool) -> None:
    _, dec = pair(write_module, TRAINER)
    plain, _ = library(write_module)
    template, model, n_out = build_pair(plain, dec, "mlp_dropout")
    data = data_for(n_out, 3)
    trainer = dec.FTrainer(model)
    ref = trainer_reference(template, trainer.f, trainer.states, data)
    tf, ts = trainer.functionalize()
    step = staged(tf.train_step) if jit else tf.train_step
    for i, (x, y) in enumerate(data):
        loss, ts = step(ts, x, y)
        assert_step(ref[i], loss, ts["f"], ts["states"], f"step {i}")
        assert int(ts["opt.t"]) == i + 1
    frozen = autostate.freeze(tf, ts)
    assert_step(ref[-1], frozen.loss, frozen.f, frozen.states, "frozen trainer")
    x, y = data[0]
    frozen.train_step(x, y)
    assert int(frozen.opt.t) == len(data) + 1


@pytest.mark.parametrize("mode", ["eager", "f", "jit"])
def test_trainer_holding_the_model_and_refreezing_it(write_module: Loader, mode: str) -> None:
    _, dec = pair(write_module, TRAINER)
    plain, _ = library(write_module)
    template, model, n_out = build_pair(plain, dec, "mlp_dropout")
    data = data_for(n_out, 2)
    trainer = dec.ModelTrainer(model)
    f0, s0 = model.functionalize()
    ref = trainer_reference(template, f0, s0, data)
    if mode == "eager":
        for i, (x, y) in enumerate(data):
            loss = trainer.train_step(x, y)
            f, states = trainer.model.functionalize()
            assert_step(ref[i], loss, f, states, f"eager step {i}")
        return
    # Inside a functionalized call the sub-model cannot be replaced: the documented
    # StateAccessError, naming the user's line, and the trainer left as it was.
    tf, ts = trainer.functionalize()
    step = staged(tf.train_step) if mode == "jit" else tf.train_step
    before = jax.tree_util.tree_map(np.asarray, ts)
    with pytest.raises(StateAccessError) as err:
        step(ts, *data[0])
    assert "self.model = autostate.freeze" in source_line_of(err.value)
    assert_same(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(ts))
    assert_same(snapshot(template), snapshot(trainer.model))


def source_line_of(err: BaseException) -> str:
    """The source text at the ``file:line`` an autostate message names."""
    import linecache

    match = re.search(r"at (\S+\.py):(\d+)", str(err))
    assert match, f"no user file:line in: {err}"
    return linecache.getline(match.group(1), int(match.group(2)))


NESTED = """
@DECORATE
class Leaf:
    def __init__(self, static):
        self.w = jnp.ones(2)
        self.n = jnp.zeros(())
        if static:
            self.training = True

    def __call__(self, x):
        self.n += 1
        return (self.w * x).sum()

    def eval(self):
        self.training = False


@DECORATE
class Outer:
    def __init__(self, static):
        self.model = Leaf(static)
        self.k = jnp.zeros(())

    def __call__(self, x):
        g, st = self.model.functionalize()
        out, st = g(st, x)
        self.k = self.k + out + st["n"]
        return self.k
"""


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("jit", [False, True])
def test_nested_functionalize_of_a_sub_model_inside_f(write_module: Loader, static: bool,
                                                     jit: bool) -> None:
    """Plain meaning: functionalize() is a snapshot; the inner call leaves self.model alone."""
    _, dec = pair(write_module, NESTED)
    eager = dec.Outer(static)
    expected = [eager(1.0), eager(2.0)]
    assert float(eager.model.n) == 0.0
    f, states = dec.Outer(static).functionalize()
    call = staged(f) if jit else f
    got = []
    for x in (1.0, 2.0):
        out, states = call(states, x)
        got.append(out)
    assert_same(expected, got)
    assert float(states["model.n"]) == 0.0


def train_some(f: Any, states: Any, data: Any, opt: str = "sgd") -> tuple[Any, Any, Any]:
    opt_state = OPTIMIZERS[opt][0](f)
    step = f_train_step(opt)
    losses = []
    for x, y in data:
        loss, f, opt_state, states = step(f, opt_state, states, x, y)
        losses.append(loss)
    return f, states, losses


@pytest.mark.parametrize("how", ["pickle_frozen", "deepcopy_frozen", "pickle_f_states",
                                 "deepcopy_f_states"])
def test_copy_mid_training_then_continue(write_module: Loader, how: str) -> None:
    plain, dec = library(write_module, fresh=True)
    template, model, n_out = build_pair(plain, dec, "mlp_dropout")
    data = data_for(n_out, 4)
    f, states = model.functionalize()
    ref = run_reference(template, names_of(f), dict(states), "sgd", data)
    f, states, _ = train_some(f, states, data[:2])
    if how == "pickle_frozen":
        f, states = pickle.loads(pickle.dumps(autostate.freeze(f, states))).functionalize()
    elif how == "deepcopy_frozen":
        f, states = copy.deepcopy(autostate.freeze(f, states)).functionalize()
    elif how == "pickle_f_states":
        f, states = pickle.loads(pickle.dumps((f, states)))
    else:
        f, states = copy.deepcopy((f, states))
    step = f_train_step("sgd")
    for i, (x, y) in enumerate(data[2:], start=2):
        loss, f, _, states = step(f, (), states, x, y)
        assert_step(ref[i], loss, f, states, f"{how} step {i}")


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "copy"])
def test_copy_of_an_eager_model_between_calls_is_independent(write_module: Loader,
                                                             how: str) -> None:
    plain, dec = library(write_module, fresh=True)
    template, model, n_out = build_pair(plain, dec, "tracked")
    data = data_for(n_out, 4)
    dup = {"deepcopy": copy.deepcopy, "copy": copy.copy,
           "pickle": lambda m: pickle.loads(pickle.dumps(m))}[how]
    for x, _ in data[:2]:
        assert_same(template(x), model(x))
    p2, d2 = dup(template) if how != "pickle" else copy.deepcopy(template), dup(model)
    for x, _ in data[2:]:
        assert_same(template(x), model(x), "original")
        assert_same(template(x), model(x), "original again")
        assert_same(p2(x), d2(x), "copy")
    assert_same(snapshot(template), snapshot(model), "original state")
    assert_same(snapshot(p2), snapshot(d2), "copy state")
    f, states = d2.functionalize()
    assert_same(read_plain(p2, states), states, "copy functionalized")


def test_keypaths_of_f_follow_the_model(write_module: Loader) -> None:
    plain, dec = library(write_module)
    template, model, _ = build_pair(plain, dec, "multihead")
    f, states = model.functionalize()
    names = sorted(names_of(f))
    assert "trunk.body.mods[0].w" in names
    assert "heads['a'].proj.w" in names
    assert "pair[1].scale" in names
    assert "trunk.body.mods[1].mean" not in names  # a state, not a parameter
    assert "trunk.body.mods[1].mean" in states
    assert "heads['b'].seen" in states
    assert_same(read_plain(template, names), names_of(f))
    # A path-based mask (no weight decay on biases / norms) sees the user's names.
    decay = jax.tree_util.tree_map_with_path(
        lambda p, v: v * (0.5 if p[-1].name == "w" else 1.0), f)
    for k, v in names_of(decay).items():
        factor = 0.5 if k.endswith(".w") else 1.0
        assert_same(np.asarray(plain_path(template, k)) * factor, v, k)
    out, _ = jax.jit(decay)(states, data_for(None, 1)[0][0])
    assert out.shape == (5,)


def multi(write_module: Loader) -> tuple[types.ModuleType, types.ModuleType]:
    return pair(write_module, MULTI)


def test_ema_copy_by_deepcopy_updated_from_the_online_model(write_module: Loader) -> None:
    plain, dec = multi(write_module)
    template, model, n_out = build_pair(plain, dec, "mlp_dropout")
    ema = copy.deepcopy(model)
    data = data_for(n_out, 3)
    f, states = model.functionalize()
    fe, se = ema.functionalize()
    assert jax.tree_util.tree_structure(f) == jax.tree_util.tree_structure(fe)
    ref = run_reference(template, names_of(f), dict(states), "sgd", data)
    ref_ema = names_of(fe)
    step = f_train_step("sgd")
    ema_update = staged(lambda e, p: jax.tree_util.tree_map(lambda a, b: 0.8 * a + 0.2 * b, e, p))
    for i, (x, y) in enumerate(data):
        loss, f, _, states = step(f, (), states, x, y)
        assert_step(ref[i], loss, f, states, f"step {i}")
        fe = ema_update(fe, f)
        ref_ema = jax.tree_util.tree_map(lambda a, b: 0.8 * a + 0.2 * b, ref_ema, ref[i][1])
        assert_same(ref_ema, names_of(fe), f"ema step {i}")
    teacher = autostate.freeze(fe, states).eval()
    p_teacher = load_plain(template, ref_ema, ref[-1][2]).eval()
    assert_same(p_teacher(data[0][0]), teacher(data[0][0]))
    assert_same(snapshot(template), snapshot(ema), "the eager EMA copy never moved")


def test_states_of_another_model_are_a_clear_error(write_module: Loader) -> None:
    plain, dec = library(write_module)
    _, model, _ = build_pair(plain, dec, "mlp_dropout")
    _, other, _ = build_pair(plain, dec, "multihead")
    f, states = model.functionalize()
    _, other_states = other.functionalize()
    x = data_for(2, 1)[0][0]
    before = jax.tree_util.tree_map(np.asarray, states)
    for call in (f, staged(f)):
        with pytest.raises(autostate.AutostateError) as err:
            call(other_states, x)
        assert "trunk." in str(err.value) or "body." in str(err.value), str(err.value)
    assert_same(before, states)
    out, _ = f(states, x)  # f still works
    assert out.shape == (5, 2)


def test_states_of_a_same_structured_model_are_interchangeable(write_module: Loader) -> None:
    plain, dec = library(write_module)
    a, b = dec.MLP(KEY, 3, 2), dec.MLP(jax.random.PRNGKey(5), 3, 2)
    x = data_for(2, 1)[0][0]
    b(x)
    b(x)
    fa, _ = a.functionalize()
    _, sb = b.functionalize()
    out, new = staged(fa)(sb, x)
    p = plain.MLP(jax.random.PRNGKey(5), 3, 2)
    p(x)
    p(x)
    ref = load_plain(plain.MLP(KEY, 3, 2), {}, read_plain(p, sb))
    assert_same(ref(x), out)
    assert_same(read_plain(ref, new), new)


@pytest.mark.parametrize("jit", [False, True])
def test_stale_f_after_a_layer_was_added_eagerly(write_module: Loader, jit: bool) -> None:
    plain, dec = library(write_module)
    model = dec.MLP(KEY, 3, 2)
    f_old, s_old = model.functionalize()
    model.body.mods.append(dec.BatchNorm(8))
    f_new, s_new = model.functionalize()
    assert "body.mods[4].mean" in s_new
    x = data_for(2, 1)[0][0]
    call_old, call_new = (staged(f_old), staged(f_new)) if jit else (f_old, f_new)
    with pytest.raises(autostate.AutostateError) as err:
        call_old(s_new, x)
    assert "body.mods[4]" in str(err.value)
    with pytest.raises(autostate.AutostateError) as err:
        call_new(s_old, x)
    assert "body.mods[4]" in str(err.value)
    template = plain.MLP(KEY, 3, 2)
    template.body.mods.append(plain.BatchNorm(8))
    out, s_new = call_new(s_new, x)
    assert_same(template(x), out)
    assert_same(read_plain(template, s_new), s_new)


def test_stale_f_after_eval_keeps_its_train_mode_snapshot(write_module: Loader) -> None:
    """functionalize() is a snapshot: eval() on the model afterwards does not reach f."""
    plain, dec = library(write_module)
    template, model, _ = build_pair(plain, dec, "mlp_dropout")
    f, states = model.functionalize()
    model.eval()
    x = data_for(2, 1)[0][0]
    out, new = staged(f)(states, x)
    assert_same(template(x), out)  # the template is still in train mode
    assert_same(read_plain(template, new), new)
    f2, s2 = model.functionalize()
    assert jax.tree_util.tree_structure(f2) != jax.tree_util.tree_structure(f)
    out2, _ = staged(f2)(s2, x)
    template.eval()
    p = load_plain(plain.MLP(KEY, 3, 2, rate=0.5).eval(), {}, {})
    assert_same(p(x), out2)


def test_forgetting_the_returned_states_is_the_documented_pitfall(write_module: Loader) -> None:
    plain, dec = library(write_module)
    template, model, _ = build_pair(plain, dec, "mlp_dropout")
    f, states = model.functionalize()
    data = data_for(2, 3)
    step = staged(lambda f, s, x: f(s, x))
    outs = [step(f, states, x)[0] for x, _ in data]
    fresh = [copy.deepcopy(template)(x) for x, _ in data]
    assert_same(fresh, outs)  # every call starts from the initial states
    assert int(states["steps"]) == 0


@pytest.mark.parametrize("how", ["pickle", "deepcopy", "save_load"])
def test_frozen_trainer_holding_f_copied_and_continued(write_module: Loader, how: str,
                                                       tmp_path: Any) -> None:
    plain, _ = library(write_module)
    _, dec = pair(write_module, TRAINER, fresh=True)
    template, model, n_out = build_pair(plain, dec, "mlp_dropout")
    data = data_for(n_out, 3)
    trainer = dec.FTrainer(model)
    ref = trainer_reference(template, trainer.f, trainer.states, data)
    tf, ts = trainer.functionalize()
    for x, y in data[:2]:
        _, ts = staged(tf.train_step)(ts, x, y)
    frozen = autostate.freeze(tf, ts)
    if how == "pickle":
        frozen = pickle.loads(pickle.dumps(frozen))
    elif how == "deepcopy":
        frozen = copy.deepcopy(frozen)
    else:
        autostate.save(tmp_path / "trainer.npz", frozen)
        frozen = autostate.load(tmp_path / "trainer.npz", like=dec.FTrainer(
            dec.MLP(jax.random.PRNGKey(9), 3, 2, rate=0.5)))
    for i, (x, y) in enumerate(data[2:], start=2):
        loss = frozen.train_step(x, y)
        assert_step(ref[i], loss, frozen.f, frozen.states, f"{how} step {i}")
    assert int(frozen.opt.t) == len(data)


# The family of the nested-functionalize bug: whatever kind of state the
# sub-model holds, ``self.sub.functionalize()`` inside a running f starts from
# the running call's values and leaves them alone, as it does eagerly.
NESTED_KINDS = """
@DECORATE
class Leaf:
    def __init__(self, kind):
        self.w = jnp.ones(2)
        self.n = jnp.zeros(())
        if kind == "static":
            self.training = True
        elif kind == "named":
            self.m = autostate.state(jnp.ones(()), name="leaf_m")
        elif kind == "constant":
            self.c = autostate.constant(jnp.full((), 3.0))
        elif kind == "dict":
            self.d = {"a": jnp.zeros(()), "b": jnp.ones(())}
        elif kind == "category":
            self.s = autostate.state(jnp.ones(()), category="stats")

    def __call__(self, x):
        self.n = self.n + 1
        return (self.w * x).sum() + self.n

    def bump(self):
        self.n = self.n + 10
        return self.n


@DECORATE
class Outer:
    def __init__(self, kind):
        self.model = Leaf(kind)
        self.k = jnp.zeros(())

    def __call__(self, x):
        self.model.bump()
        g, st = self.model.functionalize()
        out, st = g(st, x)
        self.k = self.k + out + st["n"]
        return self.k
"""


@pytest.mark.parametrize("kind", ["plain", "static", "named", "constant", "dict", "category"])
def test_nested_functionalize_of_every_kind_of_state(write_module: Loader, kind: str) -> None:
    _, dec = pair(write_module, NESTED_KINDS)
    eager = dec.Outer(kind)
    expected = [eager(1.0), eager(2.0)]
    expected_n = float(eager.model.n)
    f, states = dec.Outer(kind).functionalize()
    for call in (f, staged(f)):
        st, got = states, []
        for x in (1.0, 2.0):
            out, st = call(st, x)
            got.append(out)
        assert_same(expected, got, kind)
        assert float(st["model.n"]) == expected_n


def test_category_subset_f_handles_only_the_cache_eagerly_and_freeze_sees_the_rest(
        write_module: Loader) -> None:
    plain, dec = pair(write_module, CATS)
    ref = plain.Decoder()
    expected = [ref(x) for x in (1.0, 2.0)]
    model = dec.Decoder()
    f, states = model.functionalize("cache")
    assert sorted(states) == ["kv", "pos", "table"]  # constants travel with every selection
    got = []
    for x in (1.0, 2.0):
        out, states = f(states, x)  # eagerly: steps is an eager slot inside f
        got.append(out)
    assert_same(expected, got)
    frozen = autostate.freeze(f, states)
    assert_same(snapshot(ref), snapshot(frozen))


def test_category_subset_write_to_unhandled_state_under_jit_names_the_line(write_module: Loader) -> None:
    _, dec = pair(write_module, CATS)
    f, states = dec.Decoder().functionalize("cache")
    with pytest.raises(errors.TracedEagerStateError) as info:
        staged(lambda f, s, x: f(s, x))(f, states, 1.0)
    assert "steps" in str(info.value)
    assert f"{Path(dec.__file__).name}:" in str(info.value)
    # a method that writes only the handled category is fine under jit
    out, states = staged(lambda f, s, x: f.decode(s, x))(f, states, 2.0)
    assert float(out) == 6.0 and int(states["pos"]) == 1


@pytest.mark.parametrize("select", ["none", "predicate-all", "predicate-two", "category-state"])
def test_category_selections_match_plain(write_module: Loader, select: str) -> None:
    plain, dec = pair(write_module, CATS)
    ref = plain.Decoder()
    calls = [("__call__", (1.0,)), ("decode", (2.0,)), ("__call__", (3.0,)), ("retable", ())]
    expected = [getattr(ref, m)(*a) for m, a in calls]
    model = dec.Decoder()
    if select == "none":
        f, states = model.functionalize()
    elif select == "predicate-all":
        f, states = model.functionalize(category_predicate=lambda c: True)
    elif select == "predicate-two":
        f, states = model.functionalize(category_predicate=lambda c: c in ("cache", "state",
                                                                           "constant"))
    else:
        f, states = autostate.functionalize(model, "state")
        f, states = f, states
    expected_keys = {"none": ["kv", "pos", "steps", "table"], "predicate-all": ["kv", "pos", "steps", "table"],
                     "predicate-two": ["kv", "pos", "steps", "table"], "category-state": ["steps", "table"]}[select]
    assert sorted(states) == expected_keys
    if select == "category-state":
        return  # decode writes the cache, which this f does not handle: checked eagerly above
    got = []
    step = {m: staged(lambda f, s, *a, m=m: (f if m == "__call__" else getattr(f, m))(s, *a))
            for m in {m for m, _ in calls}}
    for m, a in calls:
        out, states = step[m](f, states, *a)
        got.append(out)
    assert_same(expected, got)
    assert_same(snapshot(ref), snapshot(autostate.freeze(f, states)))


def test_constant_is_in_states_not_in_f_and_gets_no_gradient(write_module: Loader) -> None:
    _, dec = pair(write_module, CATS)
    f, states = dec.Decoder().functionalize()
    assert "table" in states
    assert len(jax.tree_util.tree_leaves(f)) == 1  # w only
    assert sorted(autostate.param_dict(f)) == ["w"]
    g = jax.grad(lambda f: f(states, 1.0)[0])(f)
    assert_same(np.asarray([1.0, 0.0, 0.0]), g.model.w)
    assert "table" in autostate.state_dict(dec.Decoder())


def _train(f: Any, states: Any, xs: list[Any]) -> tuple[Any, Any, list[Any]]:
    step = staged(lambda f, s, x: f(s, x))
    outs = []
    for x in xs:
        out, states = step(f, states, x)
        outs.append(out)
    return f, states, outs


@pytest.mark.parametrize("how", ["state_dict", "save-load", "pickle-f", "pickle-frozen"])
def test_mid_training_round_trip_continues_like_plain(write_module: Loader, how: str,
                                                      tmp_path: Path) -> None:
    plain, dec = pair(write_module, PACK, fresh=True)
    ref = plain.Mixed(8)
    expected = [ref(x) for x in PACK_XS * 2]
    f, states, first = _train(*dec.Mixed(8).functionalize(), PACK_XS)
    if how == "state_dict":
        sd = autostate.state_dict(f, states)
        model = autostate.load_state_dict(dec.Mixed(8), sd)
        f2, states2 = model.functionalize()
    elif how == "save-load":
        autostate.save(tmp_path / "m.npz", autostate.freeze(f, states))
        f2, states2 = autostate.load(tmp_path / "m.npz", like=dec.Mixed(0)).functionalize()
    elif how == "pickle-f":
        f2, states2 = pickle.loads(pickle.dumps((f, states)))
    else:
        f2, states2 = pickle.loads(pickle.dumps(autostate.freeze(f, states))).functionalize()
    _, states2, rest = _train(f2, states2, PACK_XS)
    assert_same(expected, first + rest)
    assert_same(snapshot(ref), snapshot(autostate.freeze(f2, states2)))


def _static_pair(write_module: Loader) -> tuple[types.ModuleType, types.ModuleType]:
    return pair(write_module, "import enum\n" + STATIC)


def test_functionalize_and_freeze_round_trips_never_retrace(write_module: Loader) -> None:
    plain, dec = _static_pair(write_module)
    step, traces = jit_counted(lambda f, s, x: f(s, x))
    ref, model = plain.Stack(), dec.Stack()
    x = jnp.array([0.5, -1.0])
    for i in range(4):
        f, states = model.functionalize()
        f2, states = model.functionalize()  # a second f of the same model: the same structure
        out, states = step(f2 if i % 2 else f, states, x)
        assert_typed(ref(x), out, f"round {i}")
        model = autostate.freeze(f, states)
        if i == 2:
            assert_typed(ref(x), model(x), "eager in between")
    assert len(traces) == 1
    assert_typed(attrs(ref), attrs(model), "attributes")


def test_eager_model_and_its_f_live_independent_lives(write_module: Loader) -> None:
    """``functionalize`` is a snapshot: the eager model and ``f`` go on separately,
    as a ``copy.deepcopy`` taken at that moment would in plain Python."""
    import copy

    plain, dec = pair(write_module, KINDS)
    ref = plain.Kinds()
    model = dec.Kinds()
    for m in (ref, model):
        m.step(X1)
    snap = copy.deepcopy(ref)
    f, states = model.functionalize()
    f2, states2 = model.functionalize()
    step = staged(lambda f, s, x: f.step(s, x))
    for i in range(2):
        assert_typed(ref.weak_only(), model.weak_only(), f"eager {i}")
        expected = snap.step(X2)
        out, states = step(f, states, X2)
        assert_typed(expected, out, f"jit {i}", jitted=True, output=True)
        out2, states2 = f2.step(states2, X2)  # a second f of the same model, not jitted
        snap2 = _replay(plain, [("step", (X1,))] + [("step", (X2,))] * (i + 1))
        assert_typed(attrs(snap2), attrs(autostate.freeze(f2, states2)), f"second f {i}")
    assert_typed(attrs(ref), attrs(model), "the eager model")
    assert_typed(attrs(snap), attrs(autostate.freeze(f, states)), "f's model", jitted=True)


def _replay(plain: types.ModuleType, calls: list[tuple[str, tuple[Any, ...]]]) -> Any:
    ref = plain.Kinds()
    for name, args in calls:
        getattr(ref, name)(*args)
    return ref


def test_states_edited_by_hand_between_calls(write_module: Loader) -> None:
    """A value the user puts into ``states`` is the state's value, with its dtype and
    weak type, as assigning it to the plain model's attribute is."""
    plain, dec = pair(write_module, KINDS)
    ref = plain.Kinds()
    f, states = dec.Kinds().functionalize()
    step = staged(lambda f, s, x: f.step(s, x))
    edits = {
        "wf": lambda v: jnp.float32(v),  # weak -> strong
        "i2f": lambda v: v.astype(jnp.int8),  # another int width
        "bf": lambda v: v.astype(jnp.float32),  # bf16 -> f32
        "fl": lambda v: 3.0,  # back to a Python float
        "key": lambda v: jax.random.key(5),  # a fresh key
        "u8": lambda v: jnp.full(3, 250, jnp.uint8),
    }
    for name, edit in edits.items():
        setattr(ref, name, edit(getattr(ref, name)))
        states = {**states, name: edit(states[name])}
        out, states = step(f, states, X1)
        assert_typed(ref.step(X1), out, f"after editing {name}", jitted=True, output=True)
        for key in states:
            assert_typed(getattr(ref, key), states[key], f"{name}: state {key}", jitted=True)


def test_values_assigned_from_outside_between_jitted_calls(write_module: Loader) -> None:
    """``model.x = v`` from a training loop, between functionalize/freeze rounds."""
    plain, dec = pair(write_module, KINDS)
    ref, model = plain.Kinds(), dec.Kinds()
    step = staged(lambda f, s, x: f.step(s, x))
    writes = [
        ("wi", jnp.asarray(7)),
        ("wf", 2.5),
        ("h", jnp.ones(2, jnp.float16)),
        ("mask", jnp.array([True, False, True])),
        ("c64", jnp.zeros(2, jnp.complex64)),
        ("zero", jnp.zeros((0, 2))),
        ("d0", np.float32(4.0)),
        ("raw", jax.random.PRNGKey(9)),
    ]
    for name, value in writes:
        setattr(ref, name, value)
        setattr(model, name, value)
        f, states = model.functionalize()
        out, states = step(f, states, X2)
        assert_typed(ref.step(X2), out, f"after model.{name} = ...", jitted=True, output=True)
        model = autostate.freeze(f, states)
        assert_typed(attrs(ref), attrs(model), f"after model.{name} = ...", jitted=True)


def plain_error(fn: Callable[[], Any]) -> tuple[type[BaseException], str]:
    """The exception plain Python raises for ``fn()``: its type and message."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the reference error, whatever it is
        return type(exc), str(exc)
    raise AssertionError("plain Python did not raise")


@pytest.fixture
def mods(write_module: Loader) -> tuple[types.ModuleType, types.ModuleType]:
    return pair(write_module, MODELS)


def test_category_and_predicate_together(mods: Any) -> None:
    _, dec = mods
    with raises_autostate(errors.CategoryArgumentError) as info:
        dec.Counter().functionalize("state", category_predicate=lambda c: True)
    assert_clear(info.value, errors.CategoryArgumentError, HERE, "category_predicate")
    with raises_autostate(errors.CategoryArgumentError) as info:
        autostate.functionalize(dec.Counter(), "state", category_predicate=lambda c: True)
    assert_clear(info.value, errors.CategoryArgumentError, HERE)


@pytest.mark.parametrize("mode", ["shared", None, True, "Allowed"])
def test_unknown_state_sharing(mods: Any, mode: Any) -> None:
    _, dec = mods
    with raises_autostate(errors.InvalidArgumentError) as info:
        dec.Counter().functionalize(state_sharing=mode)
    assert_clear(
        info.value, errors.InvalidArgumentError, HERE, "'forbidden', 'allowed' or 'unsafe'"
    )


def test_category_predicate_not_callable(mods: Any) -> None:
    _, dec = mods
    with raises_autostate(errors.InvalidTypeError) as info:
        dec.Counter().functionalize(category_predicate="state")
    assert_clear(info.value, errors.InvalidTypeError, HERE, "category_predicate")


def test_unhashable_category(mods: Any) -> None:
    _, dec = mods
    with raises_autostate(errors.InvalidTypeError) as info:
        dec.Counter().functionalize(["state"])
    assert_clear(info.value, errors.InvalidTypeError, HERE, "category")


@pytest.mark.parametrize("api", ["functionalize", "state_dict", "param_dict", "save"])
def test_none_as_model(api: str, tmp_path: Path) -> None:
    calls: dict[str, Callable[[], Any]] = {
        "functionalize": lambda: autostate.functionalize(None)[0]({}),
        "state_dict": lambda: autostate.state_dict(None),
        "param_dict": lambda: autostate.param_dict(None),
        "save": lambda: autostate.save(tmp_path / "none.npz", None),
    }
    with raises_autostate(errors.InvalidTypeError) as info:
        calls[api]()
    assert_clear(info.value, errors.InvalidTypeError, HERE)


def test_a_bare_stack_is_read_and_refused_where_it_would_be_rebuilt(mods: Any, tmp_path: Path) -> None:
    # (functionalize, load(like=stack) and freeze raised AttributeError: "'Stack'
    # object has no attribute '__dict__'"; f of it did under jax.jit)
    _, dec = mods
    stack = autostate.stack([dec.Counter(), dec.Counter()])
    assert sorted(autostate.state_dict(stack)) == sorted(autostate.state_dict(stack.stacked))
    autostate.save(tmp_path / "s.npz", stack)
    for api, call in (
        ("functionalize()", lambda: autostate.functionalize(stack)),
        ("autostate.load", lambda: autostate.load(tmp_path / "s.npz", like=stack)),
    ):
        with raises_autostate(errors.InvalidTypeError) as info:
            call()
        assert_clear(info.value, errors.InvalidTypeError, HERE, f"{api} expects a model")
        assert "stack.stacked" in str(info.value)
    loaded = autostate.load(tmp_path / "s.npz", like=stack.stacked)  # the way it names
    assert sorted(autostate.state_dict(loaded)) == sorted(autostate.state_dict(stack))


@pytest.mark.parametrize("given", ["int", "array", "list of models"])
def test_what_is_not_a_model_is_refused_where_f_would_break(
    mods: Any, given: str, tmp_path: Path
) -> None:
    # (functionalize took it: f ran eagerly and raised AttributeError
    # "'list' object has no attribute '__dict__'" under jax.jit; save wrote an
    # empty checkpoint; autostate.Optimizer raised that AttributeError)
    _, dec = mods
    value = {"int": 3, "array": jnp.ones(3), "list of models": [dec.Counter()]}[given]
    for api, call in (
        ("functionalize()", lambda: autostate.functionalize(value)),
        ("autostate.save", lambda: autostate.save(tmp_path / "v.npz", value)),
        ("autostate.param_dict", lambda: autostate.param_dict(value)),
        ("autostate.Optimizer", lambda: autostate.Optimizer(value, optax.sgd(0.1))),
    ):
        with raises_autostate(errors.InvalidTypeError) as info:
            call()
        assert_clear(info.value, errors.InvalidTypeError, HERE, f"{api} expects a model")


@pytest.mark.parametrize("api", ["functionalize", "state_dict", "save", "export"])
def test_class_instead_of_instance(mods: Any, api: str, tmp_path: Path) -> None:
    _, dec = mods
    calls: dict[str, Callable[[], Any]] = {
        "functionalize": lambda: autostate.functionalize(dec.Counter),
        "state_dict": lambda: autostate.state_dict(dec.Counter),
        "save": lambda: autostate.save(tmp_path / "cls.npz", dec.Counter),
        "export": lambda: autostate.export(dec.Counter, jnp.ones(())),
    }
    with raises_autostate(errors.InvalidTypeError) as info:
        calls[api]()
    assert_clear(info.value, errors.InvalidTypeError, HERE, "Counter")


def test_functionalize_of_f(mods: Any) -> None:
    _, dec = mods
    f, _ = dec.Counter().functionalize()
    with raises_autostate(errors.InvalidTypeError) as info:
        autostate.functionalize(f)
    assert_clear(info.value, errors.InvalidTypeError, HERE, "functionalize")


def _bad_states(kind: str, model: Any, lazy_states: Any) -> Any:
    return {
        "None": None,
        "model": model,
        "list": [jnp.zeros(())],
        "thunk": lazy_states,
    }[kind]


@pytest.mark.parametrize("kind", ["None", "model", "list", "thunk"])
def test_f_states_not_a_dict(mods: Any, kind: str) -> None:
    _, dec = mods
    model = dec.Counter()
    f, thunk = model.functionalize(lazy=True)
    with raises_autostate(errors.InvalidTypeError) as info:
        f(_bad_states(kind, model, thunk), 1.0)
    assert_clear(info.value, errors.InvalidTypeError, HERE, "States must be a dict")


@pytest.mark.parametrize("kind", ["None", "model", "list", "thunk"])
def test_f_states_not_a_dict_with_constants(mods: Any, kind: str) -> None:
    _, dec = mods
    model = dec.WithPos()
    f, thunk = model.functionalize(lazy=True)
    with raises_autostate(errors.InvalidTypeError) as info:
        f(_bad_states(kind, model, thunk), 1.0)
    assert_clear(info.value, errors.InvalidTypeError, HERE, "States must be a dict")


def test_f_missing_state_key(mods: Any) -> None:
    _, dec = mods
    f, _ = dec.Counter().functionalize()
    with raises_autostate(errors.UnhandledLocalStateError) as info:
        f({}, 1.0)
    # Raised where the state is read: the model's line in the user's file.
    assert_clear(info.value, errors.UnhandledLocalStateError, dec.__file__, "'count' is missing")
    with raises_autostate(errors.UnhandledLocalStateError) as info:
        staged(lambda f, s: f(s, 1.0))(f, {})
    assert_clear(info.value, errors.UnhandledLocalStateError, dec.__file__, "'count' is missing")


def test_f_missing_constant_key(mods: Any) -> None:
    _, dec = mods
    f, states = dec.WithPos().functionalize()
    with raises_autostate(errors.UnhandledLocalStateError) as info:
        f({"count": states["count"]}, 1.0)
    assert_clear(info.value, errors.UnhandledLocalStateError, HERE, "'pos'")


def test_f_extra_key(mods: Any) -> None:
    _, dec = mods
    f, states = dec.Counter().functionalize()
    with raises_autostate(errors.StateDictError) as info:
        f({**states, "cuont": jnp.zeros(())}, 1.0)
    assert_clear(info.value, errors.StateDictError, HERE, "'cuont'", "did you mean 'count'")


def test_f_states_of_parent_and_of_sub_model(mods: Any) -> None:
    _, dec = mods
    f, states = dec.Counter().functionalize()
    fp, parent_states = dec.Parent().functionalize()
    with raises_autostate(errors.StateDictError) as info:
        f(parent_states, 1.0)
    assert_clear(info.value, errors.StateDictError, HERE, "'c.count'")
    with raises_autostate(errors.StateDictError) as info:
        fp(states, 1.0)
    assert_clear(info.value, errors.StateDictError, HERE, "did you mean 'c.count'")


@pytest.mark.parametrize("value", ["shape", "list", "None", "str"])
def test_f_state_value_of_wrong_kind_fails_as_plain_python(mods: Any, value: str) -> None:
    """A wrong value in the states dict is what plain Python holding it does."""
    plain, dec = mods
    bad = {"shape": jnp.zeros(3), "list": [0.0], "None": None, "str": "a"}

    def run_plain() -> None:
        m = plain.Counter()
        m.count = bad[value]
        m(1.0)

    expected = plain_error(run_plain)
    f, _ = dec.Counter().functionalize()
    with pytest.raises(expected[0]) as info:
        f({"count": bad[value]}, 1.0)
    assert str(info.value) == expected[1]


def test_stale_states_and_states_of_another_instance(mods: Any) -> None:
    """States are values: an earlier call's, or another instance's, run as plain Python would."""
    plain, dec = mods
    model = dec.Counter()
    f0, s0 = model.functionalize()
    _, s1 = f0(s0, 1.0)
    model(1.0)
    model(1.0)
    f2, _ = model.functionalize()  # a later f of the same (changed) model
    out, s = f2(s1, 2.0)  # the states of the first call
    ref = plain.Counter()
    ref(1.0)
    expected = ref(2.0)
    assert_same(snapshot(expected), snapshot(out))
    assert_same(snapshot(ref.count), snapshot(s["count"]))
    other = dec.Counter()
    out, s = f2(other.functionalize()[1], 2.0)
    assert_same(snapshot(plain.Counter()(2.0)), snapshot(out))
    assert float(model.count) == 2.0  # the eager model is untouched by f


@pytest.mark.parametrize("name", ["nonexistent", "doubled", "count"])
def test_f_method_that_is_not_a_method(mods: Any, name: str) -> None:
    _, dec = mods
    f, states = dec.Counter().functionalize()
    with raises_autostate(errors.MethodNotFoundError) as info:
        getattr(f, name)(states)
    assert_clear(info.value, errors.MethodNotFoundError, HERE, repr(name))


def test_f_reads_a_parameter_as_the_model(mods: Any) -> None:
    # A parameter (or sub-model) reads as the model's, as a gradient shaped like f
    # is read (``grads.w``); a state is no attribute of f (its value is in states).
    _, dec = mods
    f, _ = dec.Counter().functionalize()
    assert f.w is f.model.w
    grads = jax.grad(lambda f: jnp.sum(f.model.w))(f)
    assert_same(snapshot(jnp.ones_like(f.w)), snapshot(grads.w))


def test_freeze_of_a_model(mods: Any) -> None:
    _, dec = mods
    model = dec.Counter()
    _, states = model.functionalize()
    with raises_autostate(errors.InvalidTypeError) as info:
        autostate.freeze(model, states)
    assert_clear(info.value, errors.InvalidTypeError, HERE, "freeze expects the f")
    with raises_autostate(errors.InvalidTypeError) as info:
        autostate.freeze(states, model.functionalize()[0])  # arguments swapped
    assert_clear(info.value, errors.InvalidTypeError, HERE, "got dict")


def test_freeze_with_wrong_keys(mods: Any) -> None:
    _, dec = mods
    f, _ = dec.Counter().functionalize()
    _, parent_states = dec.Parent().functionalize()
    with raises_autostate(errors.StateDictError) as info:
        autostate.freeze(f, parent_states)
    assert_clear(info.value, errors.StateDictError, HERE, "autostate.freeze", "'c.count'")
    with raises_autostate(errors.UnhandledLocalStateError) as info:
        autostate.freeze(f, {})
    assert_clear(info.value, errors.UnhandledLocalStateError, HERE, "Cannot freeze")


@pytest.mark.parametrize("kind", ["None", "values", "packed"])
def test_freeze_states_not_a_dict(mods: Any, kind: str) -> None:
    _, dec = mods
    f, states = dec.Counter().functionalize()
    bad = {
        "None": None,
        "values": list(states.values()),
        "packed": autostate.pack(f, states)[1],
    }[kind]
    with raises_autostate(errors.InvalidTypeError) as info:
        autostate.freeze(f, bad)
    assert_clear(info.value, errors.InvalidTypeError, HERE)


def test_freeze_twice_gives_independent_models(mods: Any) -> None:
    plain, dec = mods
    f, states = dec.Counter().functionalize()
    _, states = f(states, 1.0)
    a, b = autostate.freeze(f, states), autostate.freeze(f, states)
    a(1.0)
    ref_a, ref_b = plain.Counter(), plain.Counter()
    ref_a(1.0), ref_b(1.0)
    ref_a(1.0)
    assert_same(snapshot(ref_a), snapshot(a))
    assert_same(snapshot(ref_b), snapshot(b))
    assert_same(snapshot(ref_b.count), snapshot(states["count"]))


def test_inference_mode_of_a_functional_model(mods: Any) -> None:
    _, dec = mods
    for model in (dec.Counter(), dec.Counter().functionalize()[0]):
        with raises_autostate(errors.HostStateTypeError) as info:
            autostate.inference_mode(model)
        assert_clear(info.value, errors.HostStateTypeError, HERE, 'fallback="host"')


def ref_sample(p: dict[str, Any], s: dict[str, Any], prompt: Any, steps: int, temp: float) -> Any:
    logits, s = ref_gpt(p, s, prompt)
    logits = logits[-1]
    out = jnp.zeros(steps, jnp.int32)

    def body(i: Any, carry: Any) -> Any:
        logits, out, s = carry
        s = dict(s)
        s["rng"], sub = jax.random.split(s["rng"])
        tok = jax.random.categorical(sub, logits / temp).astype(jnp.int32)
        logits, s = ref_gpt(p, s, tok[None])
        return logits[-1], out.at[i].set(tok), s

    _, out, s = jax.lax.fori_loop(0, steps, body, (logits, out, s))
    return out, s


def test_gpt_reset_then_decode_again_through_f(write_module: Loader) -> None:
    _, _, f, states, p = gpt(write_module)
    run = jitted("greedy_fori", 2)
    first, s = run(f, states, PROMPT)
    _, s = jitted("reset")(f, s)
    assert_same(snapshot(states), snapshot(s), "reset gives the empty cache")
    again, s = run(f, s, PROMPT)
    assert_bits(first, again)
    # the hand-threaded reference compiled as one program (its ops one by one cost
    # a compilation each)
    assert_bits(jax.jit(ref_greedy, static_argnums=3)(p, states, PROMPT, 2)[0], again)


def train_f(f: Any, s: Any, steps: range, o: Any = None) -> tuple[Any, Any, Any]:
    o = ADAM.init(f) if o is None else o
    for i in steps:
        x, y = images(i)
        _, f, o, s = JF_STEP(f, o, s, x, y)
    return f, s, o


_UNINTERRUPTED: dict[int, Any] = {}


def uninterrupted(write_module: Loader, n: int) -> tuple[Any, Any, Any]:
    if n not in _UNINTERRUPTED:
        _, _, f, s, p = cnn(write_module)
        f, s, p, o, ro = train_both(f, s, p, range(n))
        _UNINTERRUPTED[n] = (f, s, o)
    return _UNINTERRUPTED[n]


def resume_and_compare(f: Any, s: Any, o: Any, want: tuple[Any, Any, Any], n: int) -> None:
    f, s, o = train_f(f, s, range(3, n), o)
    wf, ws, wo = want
    assert_bits(params_of(wf), params_of(f), "params after resuming")
    assert_bits(dict(ws), dict(s), "states after resuming")
    assert_bits(wo, o, "optimizer state after resuming")


RESUMES = ["dicts", "freeze_pickle", "f_states_pickle", "save_load", "freeze_eager_refunctionalize"]


@pytest.mark.parametrize("how", RESUMES)
def test_resume_mid_training_is_identical_to_an_uninterrupted_run(
    write_module: Loader, how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    want = uninterrupted(write_module, 5)
    _, dec = pair(write_module, "import optax\n" + CNN)
    monkeypatch.setitem(sys.modules, dec.__name__, dec)
    _, _, f, s, _ = cnn(write_module)
    f, s, o = train_f(f, s, range(3))
    o_saved = pickle.loads(pickle.dumps(o))
    if how == "dicts":
        fresh = dec.CNN(7)
        fresh = autostate.load_param_dict(fresh, autostate.param_dict(f))
        fresh = autostate.load_state_dict(fresh, autostate.state_dict(f, s))
        f2, s2 = fresh.functionalize()
    elif how == "freeze_pickle":
        f2, s2 = pickle.loads(pickle.dumps(autostate.freeze(f, s))).functionalize()
    elif how == "f_states_pickle":
        f2, s2 = pickle.loads(pickle.dumps((f, s)))
    elif how == "save_load":
        autostate.save(tmp_path / "ckpt.npz", autostate.freeze(f, s))
        f2, s2 = autostate.load(tmp_path / "ckpt.npz", like=dec.CNN(7)).functionalize()
    else:
        m = autostate.freeze(f, s)
        m(images(99)[0][: 0 + 4] * 0)  # an eager call in training mode moves the stats ...
        m = autostate.load_state_dict(m, autostate.state_dict(f, s))  # ... put them back
        f2, s2 = m.functionalize()
    assert jax.tree_util.tree_structure(f2) == jax.tree_util.tree_structure(f)
    resume_and_compare(f2, s2, o_saved, want, 5)


@pytest.mark.parametrize("how", ["freeze_pickle", "save_load", "dicts"])
def test_resume_a_sampler_with_a_typed_key_state(
    write_module: Loader, how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, _, f, s, p = gpt(write_module, seed=2)
    plain, dec = pair(write_module, GPT)
    monkeypatch.setitem(sys.modules, dec.__name__, dec)
    run = jitted("sample_fori", 3, 0.7)
    first, s1 = run(f, s, PROMPT)
    want, _ = run(f, s1, PROMPT[:1])
    model = autostate.freeze(f, s1)
    if how == "freeze_pickle":
        back = pickle.loads(pickle.dumps(model))
    elif how == "save_load":
        autostate.save(tmp_path / "gpt.npz", model)
        back = autostate.load(tmp_path / "gpt.npz", like=dec.GPT(5))
    else:
        back = autostate.load_state_dict(
            autostate.load_param_dict(dec.GPT(5), autostate.param_dict(model)),
            autostate.state_dict(model),
        )
    assert jax.dtypes.issubdtype(back.rng.dtype, jax.dtypes.prng_key)
    assert_bits(s1["rng"], back.rng, "key restored")
    f2, s2 = back.functionalize()
    got, _ = run(f2, s2, PROMPT[:1])
    assert_bits(want, got, "resumed sampling")
    ref_out, _ = jax.jit(ref_sample, static_argnums=(3, 4))(p, dict(s1), PROMPT[:1], 3, 0.7)
    assert_bits(ref_out, got, "hand-threaded")



SELF_F = """
@DECORATE
class Probe:
    def __init__(self):
        self.x = jnp.ones(())
        self.n = jnp.zeros(())

    def step(self, v):
        self.x = self.x * 2 + v
        self.n = self.n + 1
        return self.x

    def probe_self(self, v):
        self.x = self.x + 1
        f, s = self.functionalize()
        out, s = f.step(s, v)
        return out + self.x, s["x"], self.n

    def freeze_self(self, v):
        self.x = self.x + 1
        f, s = self.functionalize()
        out, s = f.step(s, v)
        ahead = autostate.freeze(f, s)
        return ahead.x + self.x, ahead.n, self.n

    def deepcopy_self(self, v):
        c = copy.deepcopy(self)
        c.step(v)
        self.x = self.x + c.x
        return c.x, c.n, self.x


@DECORATE
class Holder:
    def __init__(self):
        self.sub = Probe()
        self.y = jnp.zeros(())

    def probe_sub(self, v):
        self.sub.x = self.sub.x + 1
        fs, ss = self.sub.functionalize()
        out, ss = fs.step(ss, v)
        self.y = self.y + out
        return out, ss["x"], self.sub.x
"""


@pytest.mark.parametrize(
    "method,expected",
    [
        # x = 2; f's copy: 2 * 2 + 3 = 7 (self untouched): 7 + 2, its x, n 0
        ("probe_self", [9.0, 7.0, 0.0]),
        ("freeze_self", [9.0, 1.0, 0.0]),
    ],
)
def test_functionalize_and_freeze_self_inside_a_method(
    write_module: Loader, method: str, expected: list[float]
) -> None:
    _, dec = pair(write_module, SELF_F)
    m = dec.Probe()
    got = {"eager": floats([getattr(m, method)(3.0), m.x, m.n])}
    f, s = dec.Probe().functionalize()
    out, s1 = getattr(f, method)(s, 3.0)
    got["f"] = floats([out, s1["x"], s1["n"]])
    out, s2 = staged(lambda f, s: getattr(f, method)(s, 3.0))(f, s)
    got["jit"] = floats([out, s2["x"], s2["n"]])
    for mode, g in got.items():
        assert_same([expected, 2.0, 0.0], g, mode)
    no_handler_left()


def test_deepcopy_self_inside_a_method(write_module: Loader) -> None:
    plain, dec = pair(write_module, SELF_F)
    check(plain, dec, "Probe()", [("deepcopy_self", (X1,)), ("step", (X2,)), ("deepcopy_self", (X2,))])


def test_functionalize_a_sub_model_inside_the_outer_call(write_module: Loader) -> None:
    _, dec = pair(write_module, SELF_F)
    # sub.x = 2; its f: 2 * 2 + 3 = 7 (the sub-model untouched); y = 7
    expected = [[7.0, 7.0, 2.0], 2.0, 7.0]
    m = dec.Holder()
    assert_same(expected, floats([m.probe_sub(3.0), m.sub.x, m.y]), "eager")
    f, s = dec.Holder().functionalize()
    for mode, call in (("f", f.probe_sub), ("jit", staged(f.probe_sub))):
        out, s1 = call(s, 3.0)
        assert_same(expected, floats([out, s1["sub.x"], s1["y"]]), mode)


def test_f_used_after_its_model_is_garbage_collected(write_module: Loader) -> None:
    plain, dec = pair(write_module, SELF_F)
    p = plain.Probe()
    expected = floats([p.step(X1), p.step(X2), p.x, p.n])
    model = dec.Probe()
    model.step(X1)  # the model's own value is not f's business after functionalize
    model = dec.Probe()
    f, s = model.functionalize()
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None, "f keeps the eager model alive"
    out1, s = f.step(s, X1)
    out2, s = staged(f.step)(s, X2)
    assert_same(expected, floats([out1, out2, s["x"], s["n"]]))
    frozen = autostate.freeze(f, s)
    assert_same(expected[2:], floats([frozen.x, frozen.n]), "frozen")


def test_split_merge_rounds(write_module: Loader) -> None:
    """nnx.split / train / nnx.merge twice, as functionalize / jit / freeze,
    with an eager eval call between rounds and eval mode switched at the end."""
    plain, dec = pair(write_module, NNX)

    def rounds(mod: types.ModuleType, decorated: bool) -> tuple[list[Any], Any]:
        model = mod.make()
        outs = []
        step = staged(lambda f, s, x: f(s, x))
        for r in range(2):
            if decorated:
                f, states = model.functionalize()
                for i in range(2):
                    y, states = step(f, states, B3 * (r + i + 1))
                    outs.append(y)
                f = jax.tree_util.tree_map(lambda a: a * 0.9, f)
                model = autostate.freeze(f, states)
            else:
                for i in range(2):
                    outs.append(model(B3 * (r + i + 1)))
                for layer in model.layers:
                    for k, v in list(vars(layer).items()):
                        if k in ("kernel", "bias", "scale"):
                            setattr(layer, k, v * 0.9)
            outs.append(model(B3, use_running_average=True))
        mod.set_eval(model)
        outs.append(model(B3))
        return outs, model

    ref_outs, ref = rounds(plain, False)
    outs, model = rounds(dec, True)
    assert_same(ref_outs, outs)
    assert_same(snapshot(ref), snapshot(model))


def test_split_by_category_like_nnx_split(write_module: Loader) -> None:
    """functionalize("batch_stats"): the other states stay eager slots of f's model,
    written by an eager f and refused under jit (documented)."""
    plain, dec = pair(write_module, NNX)
    ref = plain.CatBN()
    expected = [ref(V2), ref(V2 * 2)]
    f, states = dec.CatBN().functionalize("batch_stats")
    assert sorted(states) == ["mean"]
    o1, states = f(states, V2)
    o2, states = f(states, V2 * 2)
    assert_same(expected, [o1, o2])
    frozen = autostate.freeze(f, states)
    assert_same(snapshot(ref), snapshot(frozen))
    with pytest.raises(TracedEagerStateError, match="steps") as err:
        staged(lambda f, s, x: f(s, x))(f, states, V2)
    assert "self.steps += 1" in error_line(err.value)


def test_explicit_state_passing_mixed_with_autostate_states(write_module: Loader) -> None:
    """An eqx.nn.State-like dict threaded by hand next to autostate's own states."""
    plain, dec = pair(write_module, EQX)
    s0 = {"mean": jnp.zeros(2)}

    def run_plain() -> tuple[list[Any], Any, Any]:
        model, st, outs = plain.EqxState(), s0, []
        for i in range(3):
            y, st = model(V2 * (i + 1), st, scale=2.0, inference=(i == 1))
            outs.append(y)
        return outs, st, model

    ref_outs, ref_st, ref = run_plain()
    model, st, outs = dec.EqxState(), s0, []
    for i in range(3):
        y, st = model(V2 * (i + 1), st, scale=2.0, inference=(i == 1))
        outs.append(y)
    assert_same(ref_outs, outs)
    assert_same(ref_st, st)
    assert_same(snapshot(ref), snapshot(model))
    f, states = dec.EqxState().functionalize()
    step = staged(lambda f, s, x, st, inf: f(s, x, st, scale=2.0, inference=inf),
                   static_argnums=4)
    st, outs = s0, []
    for i in range(3):
        (y, st), states = step(f, states, V2 * (i + 1), st, i == 1)
        outs.append(y)
    assert_same(ref_outs, outs)
    assert_same(ref_st, st)
    assert_same(snapshot(ref), snapshot(autostate.freeze(f, states)))


def test_tree_at_surgery_on_a_frozen_model(write_module: Loader) -> None:
    """eqx.tree_at(lambda m: m.lin.weight, model, w) done with jax.tree_util on a
    frozen model: the new model runs like a plain one built with that weight, and
    the original is untouched."""
    plain, dec = pair(write_module, EQX)
    ref = plain.WithFrozen()
    ref(V2)
    ref.lin = dataclasses.replace(ref.lin, weight=jnp.full((2,), 3.0))
    f, states = dec.WithFrozen().functionalize()
    _, states = f(states, V2)
    frozen = autostate.freeze(f, states)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(frozen)
    new = jax.tree_util.tree_unflatten(treedef, [
        jnp.full((2,), 3.0) if "weight" in jax.tree_util.keystr(k) else v for k, v in leaves])
    assert_same(ref(V2), new(V2))
    assert_same(snapshot(ref), snapshot(new))
    assert_same(np.ones(2), frozen.lin.weight)
    assert_same(np.int32(1), frozen.count)
    f2, s2 = new.functionalize()
    out, s2 = staged(lambda f, s, x: f(s, x))(f2, s2, V2)
    assert_same(ref(V2), out)
    assert_same(snapshot(ref), snapshot(autostate.freeze(f2, s2)))


def source_modules(write_module: Loader) -> tuple[types.ModuleType, types.ModuleType]:
    return pair(write_module, SOURCE)


def leaf_names(f: Any) -> list[str]:
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(f)]


def test_pickle_deepcopy_save_load_keep_the_shared_block(write_module: Loader, tmp_path: Path) -> None:
    plain, dec = source_modules(write_module)
    p = plain.Paths()
    p(ONE)
    f, states = dec.Paths().functionalize()
    _, states = f(states, ONE)
    frozen = autostate.freeze(f, states)
    eager = dec.Paths()
    eager(ONE)
    autostate.save(tmp_path / "paths.npz", frozen)
    copies = {
        "pickle frozen": pickle.loads(pickle.dumps(frozen)),
        "pickle eager": pickle.loads(pickle.dumps(eager)),
        "deepcopy frozen": copy.deepcopy(frozen),
        "deepcopy eager": copy.deepcopy(eager),
        "load": autostate.load(tmp_path / "paths.npz", like=dec.Paths()),
    }
    expected_out = p(ONE)
    expected = snapshot(p)
    for how, c in copies.items():
        assert c.enc is c.dec_in is c.layers[0] is c.layers[1] is c.d["a"] is c.t[0], how
        assert c.enc is not frozen.enc and c.enc is not eager.enc, how
        assert_same(expected_out, c(ONE), how)
        assert_same(expected, snapshot(c), how)
        f2, s2 = c.functionalize()
        assert list(s2) == ["enc.n", "d['b'].n"], how


def test_cycle_round_trips_through_deepcopy_pickle_and_save_load(
    write_module: Loader, tmp_path: Path
) -> None:
    plain, dec = source_modules(write_module)
    p = plain.Parent()
    p(1.0)
    m = dec.Parent()
    m(1.0)
    autostate.save(tmp_path / "cyc.npz", m)
    for how, c in {
        "deepcopy": copy.deepcopy(m),
        "pickle": pickle.loads(pickle.dumps(m)),
        "load": autostate.load(tmp_path / "cyc.npz", like=dec.Parent()),
    }.items():
        assert c.child.parent is c, how
        assert c is not m, how
        assert_same(snapshot(p), snapshot(c), how)
    c = copy.deepcopy(m)
    assert_same(p(2.0), c(2.0))
    assert_same(np.full((), 1.0), m.child.n)  # the original is independent of the copy
    assert sorted(autostate.state_dict(m)) == ["child.n", "total"]
    assert list(autostate.param_dict(m)) == ["scale"]


def test_one_states_dict_reused_for_two_calls_gives_the_same_result(write_module: Loader) -> None:
    _, dec = source_modules(write_module)
    f, states = dec.Bag().functionalize()
    before = jax.tree_util.tree_map(np.asarray, dict(states))
    r1 = f(states, ONE)
    r2 = f(states, ONE)
    r3 = staged(f)(states, ONE)
    assert_same(r1, r2)
    assert_same(r1, r3)
    assert_same(before, dict(states))
    assert r1[1]["items"] is not r2[1]["items"]


def test_a_states_dict_changed_by_the_user_is_what_f_reads(write_module: Loader) -> None:
    plain, dec = source_modules(write_module)
    f, states = dec.Bag().functionalize()
    states["n"] = jnp.full(2, 5.0)
    states["items"] = [jnp.zeros(()), jnp.zeros(())]
    states["d"]["k"] = jnp.full((), 3.0)
    p = plain.Bag()
    p.n, p.items, p.d["k"] = jnp.full(2, 5.0), [jnp.zeros(()), jnp.zeros(())], jnp.full((), 3.0)
    out, new = f(states, ONE)
    assert_same(p(ONE), out)
    for k in ("n", "items", "d"):
        assert_same(snapshot(getattr(p, k)), snapshot(new[k]), k)


def test_freeze_twice_gives_two_independent_models(write_module: Loader) -> None:
    plain, dec = source_modules(write_module)
    f, states = dec.Bag().functionalize()
    _, states = f(states, ONE)
    one, two = autostate.freeze(f, states), autostate.freeze(f, states)
    assert one is not two
    p = plain.Bag()
    p(ONE)
    ref = snapshot(p)
    one(ONE * 10)
    one.items.append(jnp.full((), 5.0))
    one.d["k"] = jnp.full((), -1.0)
    one.w = jnp.zeros(2)
    assert_same(ref, snapshot(two))
    assert_same(p(ONE), two(ONE))
    assert len(states["items"]) == 2
    assert_same(np.ones(2), states["d"]["k"])


def test_f_is_unchanged_by_freeze_and_by_writes_to_the_frozen_model(write_module: Loader) -> None:
    plain, dec = source_modules(write_module)
    f, states0 = dec.Paths().functionalize()
    leaves0 = [np.asarray(v) for v in jax.tree_util.tree_leaves(f)]
    _, states1 = f(states0, ONE)
    frozen = autostate.freeze(f, states1)
    frozen(ONE)
    frozen.enc.w = jnp.full((2,), 100.0)
    frozen.dec_in.n = jnp.full((), 100.0)
    frozen.d["b"].w = jnp.zeros(2)
    assert_same(leaves0, [np.asarray(v) for v in jax.tree_util.tree_leaves(f)])
    assert f.model.enc is f.model.dec_in
    p = plain.Paths()
    p(ONE)
    out, states2 = f(states1, ONE)
    assert_same(p(ONE), out)
    assert_same(p.enc.n, states2["enc.n"])
    assert_same(np.full((), 100.0), frozen.layers[0].n)


def test_frozen_shared_block_refunctionalized_is_independent_of_the_first_f(
    write_module: Loader,
) -> None:
    plain, dec = source_modules(write_module)
    f, states = dec.Paths().functionalize()
    _, states = f(states, ONE)
    frozen = autostate.freeze(f, states)
    f2, states2 = frozen.functionalize()
    assert list(states2) == list(states)
    assert_same(dict(states), dict(states2))
    out2, states2 = f2(states2, ONE)
    out1, _ = f(states, ONE)
    assert_same(out1, out2)
    assert f2.model is not f.model and f2.model.enc is f2.model.t[0]
    assert_same(states["enc.n"], frozen.enc.n)  # f2 did not write the frozen model
    p = plain.Paths()
    p(ONE)
    assert_same(p(ONE), out2)


def test_f_keypaths_name_a_shared_sub_model_as_param_dict_does(write_module: Loader) -> None:
    plain, dec = source_modules(write_module)
    check(plain, dec, "DictOrder()", [("__call__", (ONE,))])
    m = dec.DictOrder()
    f, states = m.functionalize()
    assert list(states) == ["d['z'].n"]
    assert [".model." + k for k in autostate.param_dict(m)] == leaf_names(f)


def test_a_category_subset_on_a_shared_sub_model(write_module: Loader) -> None:
    plain, dec = source_modules(write_module)
    p = plain.SharedKV()
    m = dec.SharedKV()
    fc, sc = m.functionalize("cache")
    assert list(sc) == ["kv"]
    out, sc = fc(sc, 1.0)
    assert_same(p(1.0), out)
    assert_same(p.a.kv, sc["kv"])
    # The unhandled category updates f's copy in place, once per use, on one object.
    assert fc.model.a is fc.model.b[0]
    assert_same(p.a.n, fc.model.b[0].n)
    assert_same(np.zeros(()), m.a.n)


def test_deepcopy_pickle_and_pack_of_f_keep_the_shared_block(write_module: Loader) -> None:
    plain, dec = source_modules(write_module)
    f, states = dec.Paths().functionalize()
    p = plain.Paths()
    expected = p(ONE)
    for how, g in {"deepcopy": copy.deepcopy(f), "pickle": pickle.loads(pickle.dumps(f))}.items():
        assert g.model.enc is g.model.layers[1] is g.model.d["a"], how
        out, new = g(states, ONE)
        assert_same(expected, out, how)
        assert_same(p.enc.n, new["enc.n"], how)
    pf, ps = autostate.pack(f, states)
    out, ps = staged(lambda f, s, x: f(s, x))(pf, ps, ONE)
    assert_same(expected, out)
    frozen = autostate.freeze(pf, ps)
    assert frozen.enc is frozen.dec_in is frozen.t[0]
    assert_same(snapshot(p), snapshot(frozen))


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


def test_life_cycle_jit_freeze_eager_refunctionalize_pickle_copy(write_module: Loader) -> None:
    # Fresh modules (not the cached pair): pickling needs them in sys.modules.
    plain, dec = pair(write_module, NET, fresh=True)
    ref = plain.Net()
    model = dec.Net()

    # 1. two jitted steps through f, then freeze
    f, states = model.functionalize()
    step = step_jit()
    for x in (XV1, XV2):
        want = ref(x)
        got, states = step(f, states, x)
        assert_same(want, got, "jit out")
    for key, value in states.items():
        assert_same(snapshot(plain_path(ref, key)), snapshot(value), f"state {key}")
    assert_same(snapshot(plain.Net()), snapshot(model), "the model itself changed")
    frozen = autostate.freeze(f, states)
    assert_shared(frozen)
    assert_same(snapshot(ref), snapshot(frozen), "frozen")

    # 2. eager steps on the frozen model
    for x in (XV2, XV1):
        assert_same(ref(x), frozen(x), "eager after freeze")
    assert_same(snapshot(ref), snapshot(frozen), "eager after freeze")

    # 3. functionalize again: f without jit, then a method through jit
    f2, states2 = frozen.functionalize()
    assert sorted(states2) == sorted(states)
    out, states2 = f2(states2, XV1)
    assert_same(ref(XV1), out, "second f")
    out, states2 = staged(lambda f, s: f.peek(s))(f2, states2)
    assert_same(ref.peek(), out, "second f peek")
    frozen2 = autostate.freeze(f2, states2)
    assert_shared(frozen2)
    assert_same(snapshot(ref), snapshot(frozen2), "second freeze")

    # 4. pickle round trip, then steps
    ref_p = pickle.loads(pickle.dumps(ref))
    model_p = pickle.loads(pickle.dumps(frozen2))
    assert_shared(model_p)
    assert_same(snapshot(ref_p), snapshot(model_p), "unpickled")
    assert_same(ref_p(XV2), model_p(XV2), "eager after unpickle")
    f3, states3 = model_p.functionalize()
    out, states3 = step(f3, states3, XV1)
    assert_same(ref_p(XV1), out, "jit after unpickle")
    model_p = autostate.freeze(f3, states3)
    assert_same(snapshot(ref_p), snapshot(model_p), "after unpickle")

    # 5. deepcopy: the copy moves on, the original does not
    ref_d, model_d = copy.deepcopy(ref_p), copy.deepcopy(model_p)
    assert_shared(model_d)
    assert model_d.items[0] is not model_p.items[0]
    assert_same(ref_d(XV2), model_d(XV2), "eager after deepcopy")
    assert_same(snapshot(ref_d), snapshot(model_d), "deepcopy stepped")
    assert_same(snapshot(ref_p), snapshot(model_p), "deepcopy source")
    f4, states4 = model_d.functionalize()
    out, states4 = step(f4, states4, XV1)
    assert_same(ref_d(XV1), out, "jit after deepcopy")
    assert_same(snapshot(ref_d), snapshot(autostate.freeze(f4, states4)), "last freeze")


def test_shallow_copy_shares_sub_models_like_plain(write_module: Loader) -> None:
    plain, dec = pair(write_module, NET)
    ref, model = plain.Net(), dec.Net()
    ref(XV1), model(XV1)
    ref_c, model_c = copy.copy(ref), copy.copy(model)
    assert model_c.items is model.items
    assert_same(ref_c(XV2), model_c(XV2), "shallow copy out")
    # the copy's own total moved; the shared sub-models moved for both
    assert_same(snapshot(ref), snapshot(model), "shallow copy source")
    assert_same(snapshot(ref_c), snapshot(model_c), "shallow copy")


def test_freeze_of_a_copy_of_states_and_tree_map(write_module: Loader) -> None:
    plain, dec = pair(write_module, NET)
    ref = plain.Net()
    f, states = dec.Net().functionalize()
    _, states = f(states, XV1)
    ref(XV1)
    doubled = jax.tree_util.tree_map(lambda a: a * 2, states)
    assert type(doubled) is type(states)
    assert sorted(doubled) == sorted(states)
    copied = jax.tree_util.tree_map(jnp.copy, states)
    out, copied = step_jit()(f, copied, XV2)
    assert_same(ref(XV2), out, "after tree_map copy")
    leaves, treedef = jax.tree_util.tree_flatten(copied)
    rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
    assert_same(snapshot(ref), snapshot(autostate.freeze(f, rebuilt)), "unflattened states")
    # doubled states mean what doubled attributes mean
    frozen = autostate.freeze(f, doubled)
    assert_same(2 * np.asarray(states["total"]), frozen.total, "doubled total")
    assert_same(2 * np.asarray(states["by['a'].mean"]), frozen.by["a"].mean, "doubled mean")


@pytest.mark.parametrize("path", ["items[0]", "items[1]", "by['b']", "pair[1]"])
def test_functionalize_a_sub_model_while_the_parent_exists(write_module: Loader, path: str) -> None:
    plain, dec = pair(write_module, NET)
    ref, model = trained_pair(plain, dec)
    sub = plain_path(model, path)
    f, states = sub.functionalize()
    assert sorted(states) == ["count", "mean"]
    ref_sub = copy.deepcopy(plain_path(ref, path))  # f is a copy: the parent does not move
    out, states = step_jit()(f, states, XV2)
    assert_same(ref_sub(XV2), out, "sub-model through f")
    assert_same(snapshot(ref_sub), snapshot(autostate.freeze(f, states)), "frozen sub-model")
    # the parent is untouched and still steps like plain
    assert_same(snapshot(ref), snapshot(model), "parent after the sub-model's f")
    assert_same(ref(XV1), model(XV1), "parent steps")
    assert_same(snapshot(ref), snapshot(model), "parent stepped")
    # and the parent functionalizes with the sub-model's names under its path
    pf, pstates = model.functionalize()
    out, pstates = pf(pstates, XV2)
    assert_same(ref(XV2), out, "parent f")
    assert_same(snapshot(ref), snapshot(autostate.freeze(pf, pstates)), "parent frozen")


def test_functionalize_twice_and_use_the_older_pair(write_module: Loader) -> None:
    plain, dec = pair(write_module, NET)
    ref, model = trained_pair(plain, dec)
    f1, s1 = model.functionalize()
    f2, s2 = model.functionalize()
    step = step_jit()
    ref_a, ref_b = copy.deepcopy(ref), copy.deepcopy(ref)
    out1, s1 = step(f1, s1, XV1)
    out2, s2 = step(f2, s2, XV2)
    assert_same(ref_a(XV1), out1, "older f")
    assert_same(ref_b(XV2), out2, "newer f")
    # the pairs are interchangeable: same names, same structure
    out, s_mixed = f1(s2, XV1)
    assert_same(ref_b(XV1), out, "older f on newer states")
    out, s1 = f2(s1, XV2)
    assert_same(ref_a(XV2), out, "newer f on older states")
    assert_same(snapshot(ref_a), snapshot(autostate.freeze(f1, s1)), "older frozen")
    assert_same(snapshot(ref_b), snapshot(autostate.freeze(f2, s_mixed)), "newer frozen")
    assert_same(snapshot(ref), snapshot(model), "the model moved")


def test_f_after_the_model_changed_eagerly_is_a_snapshot(write_module: Loader) -> None:
    plain, dec = pair(write_module, NET)
    ref, model = trained_pair(plain, dec)
    at_functionalize = copy.deepcopy(ref)
    f, states = model.functionalize()
    # eager changes after functionalize: a step, a replaced sub-model, a new parameter
    ref(XV2), model(XV2)
    ref.items[0] = plain.Leaf(7.0)
    model.items[0] = dec.Leaf(7.0)
    ref.bias = jnp.array([5.0, 5.0])
    model.bias = jnp.array([5.0, 5.0])
    ref.items[1].w = jnp.array([2.0, 3.0])
    model.items[1].w = jnp.array([2.0, 3.0])
    out, states = step_jit()(f, states, XV1)
    assert_same(at_functionalize(XV1), out, "f sees the model as it was")
    assert_same(snapshot(at_functionalize), snapshot(autostate.freeze(f, states)), "frozen")
    assert_same(ref(XV1), model(XV1), "the model keeps going eagerly")
    assert_same(snapshot(ref), snapshot(model), "the model")
    f2, s2 = model.functionalize()
    out, s2 = step_jit()(f2, s2, XV2)
    assert_same(ref(XV2), out, "functionalized again after the changes")


def test_functionalize_after_an_eager_reset_of_a_sub_model(write_module: Loader) -> None:
    plain, dec = pair(write_module, NET)
    ref, model = trained_pair(plain, dec)
    ref.by["b"].reset()
    model.by["b"].reset()
    f, states = model.functionalize()
    out, states = f(states, XV1)
    assert_same(ref(XV1), out, "after reset")
    _, states = staged(lambda f, s: f.peek(s))(f, states)
    assert_same(snapshot(ref), snapshot(autostate.freeze(f, states)), "after reset, frozen")


def test_states_missing_or_extra_keys_in_f_are_clear_errors(write_module: Loader) -> None:
    plain, dec = pair(write_module, NET)
    f, states = dec.Net().functionalize()
    partial = {k: v for k, v in states.items() if k != "total"}
    for bad in (partial, {**states, "totl": jnp.zeros(2)}):
        for call in (lambda s: f(s, XV1), lambda s: step_jit()(f, s, XV1),
                     lambda s: autostate.freeze(f, s)):
            with pytest.raises(autostate.AutostateError) as info:
                call(bad)
            assert "total" in str(info.value) or "totl" in str(info.value)


def test_copy_of_self_returned_from_f(write_module: Loader) -> None:
    plain, dec = pair(write_module, RETURNED_COPIES)
    run_case(plain, dec, "M()", [("snapshot_copy", (A1,)), ("snapshot_copy", (A2,))])


def test_copy_returned_from_f_is_usable_afterwards(write_module: Loader) -> None:
    plain, dec = pair(write_module, RETURNED_COPIES)
    ref = plain.M()
    saved_ref = ref.snapshot_copy(A1)
    f, states = dec.M().functionalize()
    for fn in (f.snapshot_copy, staged(f.snapshot_copy)):
        saved, _ = fn(states, A1)
        same(snapshot(saved_ref), snapshot(saved), "returned copy")
        same(saved_ref._inc(A2), saved._inc(A2), "eager call on the returned copy")
        same(snapshot(saved_ref), snapshot(saved), "returned copy after a call")
        saved_ref = ref.snapshot_copy(A1) if fn is f.snapshot_copy else saved_ref
        ref = plain.M()
        saved_ref = ref.snapshot_copy(A1)



def test_lora_training_only_adapters_in_scan(write_module: Loader) -> None:
    # w is assigned by merge(): a state, so only a and b are trained through f, as a
    # frozen base weight should be; the scan loop against the plain model.
    plain, dec = pair(write_module, LORA)
    f, _ = dec.LoRANet(0, 3, 2).functionalize()
    assert sorted(autostate.param_dict(f)) == [
        "layers[0].a",
        "layers[0].b",
        "layers[1].a",
        "layers[1].b",
    ]
    xs = jnp.stack([XL, -XL])
    train_compare(plain, dec, "LoRANet(0, 3, 2)", xs, lambda out, get: jnp.mean(out**2))
    check_transform(plain, dec, "LoRANet(0, 3, 2)", [("__call__", (X,))], XL, "grad")


GRADS = {
    "l1.w": jnp.full((3, 4), 0.1), "l1.b": jnp.full((4,), -0.2),
    "l2.w": jnp.full((4, 2), 0.3), "l2.b": jnp.full((2,), 0.05),
}


def torch(write_module: Loader) -> tuple[types.ModuleType, types.ModuleType]:
    return pair(write_module, TORCH_HEADER + TORCH)


def test_trained_trainer_saved_loaded_and_pickled_keeps_its_sharing(
    write_module: Loader, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain, dec = torch(write_module)
    monkeypatch.setitem(sys.modules, dec.__name__, dec)  # pickling by reference
    ref, trainer = plain.adam_trainer("AliasAdam"), dec.adam_trainer("AliasAdam")
    ref.fit_step(*batch(0))
    trainer.fit_step(*batch(0))
    autostate.save(tmp_path / "t.npz", trainer)
    loaded = [
        autostate.load(tmp_path / "t.npz", like=dec.adam_trainer("AliasAdam")),
        autostate.load_state_dict(dec.adam_trainer("AliasAdam"), autostate.state_dict(trainer)),
        pickle.loads(pickle.dumps(trainer)),  # noqa: S301
    ]
    for t in loaded:
        assert t.opt.model is t.model and t.sched.opt is t.opt
        assert_same(snapshot(ref), snapshot(t))
        r = copy.deepcopy(ref)
        assert_same(r.fit_step(*batch(3)), t.fit_step(*batch(3)))
        assert_same(snapshot(r), snapshot(t))


def test_lightning_trainer_freeze_and_deepcopy_keep_the_cycle(write_module: Loader) -> None:
    plain, dec = lightning(write_module)
    ref = plain.lit()
    f, states = dec.lit().functionalize()
    step = staged(lambda f, s, x, y: f.fit_step(s, x, y))
    for _, (x, y) in LIT_STEPS:
        ref.fit_step(x, y)
        _, states = step(f, states, x, y)
    frozen = autostate.freeze(f, states)
    assert frozen.model.trainer is frozen
    twin = copy.deepcopy(frozen)
    assert twin.model.trainer is twin and twin.model is not frozen.model
    ref_twin = copy.deepcopy(ref)
    x, y = LIT_STEPS[0][1]
    assert_same(ref.fit_step(x, y), frozen.fit_step(x, y))
    assert_same(ref_twin.fit_step(2 * x, y), twin.fit_step(2 * x, y))
    assert_same(snapshot(ref), snapshot(frozen))
    assert_same(snapshot(ref_twin), snapshot(twin))


@pytest.mark.parametrize("how", ["deepcopy", "copy"])
def test_copied_trainer_trained_independently(write_module: Loader, how: str) -> None:
    plain, dec = torch(write_module)
    cp = copy.deepcopy if how == "deepcopy" else copy.copy
    runs = []
    for mod in (plain, dec):
        t = mod.sgd_trainer()
        t.fit_step(*batch(0))
        twin = cp(t)
        outs = [t.fit_step(*batch(1)), twin.fit_step(*batch(2)), twin.fit_step(*batch(3)),
                t.fit_step(*batch(1))]
        ids = (twin.opt.model is twin.model, twin.sched.opt is twin.opt, twin.model is t.model)
        runs.append((outs, ids, snapshot(t), snapshot(twin)))
    assert runs[0][1] == runs[1][1]
    assert_same(runs[0][0], runs[1][0], "outputs")
    assert_same(runs[0][2], runs[1][2], "original")
    assert_same(runs[0][3], runs[1][3], "copy")


def test_deepcopy_of_a_frozen_trainer_then_both_trained_through_f(write_module: Loader) -> None:
    plain, dec = torch(write_module)
    ref = plain.adam_trainer("AliasAdam")
    ref.fit_step(*batch(0))
    f, states = dec.adam_trainer("AliasAdam").functionalize()
    step = staged(lambda f, s, x, y: f.fit_step(s, x, y))
    _, states = step(f, states, *batch(0))
    frozen = autostate.freeze(f, states)
    twin, ref_twin = copy.deepcopy(frozen), copy.deepcopy(ref)
    untouched = snapshot(ref_twin)
    assert twin.opt.model is twin.model and twin.sched.opt is twin.opt
    for t, r, i in ((frozen, ref, 1), (twin, ref_twin, 2)):
        ft, st = t.functionalize()
        out, st = step(ft, st, *batch(i))
        assert_same(r.fit_step(*batch(i)), out)
        assert_same(snapshot(r), snapshot(autostate.freeze(ft, st)))
    assert_same(untouched, snapshot(twin), "the frozen copy itself did not move")


def test_functionalize_the_model_a_trainer_holds(write_module: Loader) -> None:
    """f of trainer.model is a snapshot: the trainer keeps stepping the eager model;
    the frozen result put back on the trainer is a new object the optimizer does not
    hold, as a replaced attribute is in plain Python."""
    plain, dec = torch(write_module)
    ref, trainer = plain.sgd_trainer(), dec.sgd_trainer()
    ref.fit_step(*batch(0))
    trainer.fit_step(*batch(0))
    fm, sm = trainer.model.functionalize()
    ref_model = copy.deepcopy(ref.model)
    step = staged(lambda f, s, x: f(s, x))
    for i in range(2):
        assert_same(ref.fit_step(*batch(i + 1)), trainer.fit_step(*batch(i + 1)), f"trainer {i}")
        out, sm = step(fm, sm, batch(i)[0])
        assert_same(ref_model(batch(i)[0]), out, f"f of the model {i}")
    assert_same(snapshot(ref), snapshot(trainer), "the trainer, untouched by f")
    ref.model = ref_model
    trainer.model = autostate.freeze(fm, sm)
    assert trainer.opt.model is not trainer.model
    for i in range(2):
        assert_same(ref.fit_step(*batch(i)), trainer.fit_step(*batch(i)), f"after swap {i}")
    assert_same(snapshot(ref), snapshot(trainer))


def test_functionalize_the_optimizer_a_trainer_holds(write_module: Loader) -> None:
    plain, dec = torch(write_module)
    check(plain, dec, "sgd_trainer().opt", [("step", (GRADS,)), ("zero_grad", ()),
                                            ("step", (GRADS,))])
    f, states = dec.sgd_trainer().opt.functionalize()
    assert "model.l1.w" in states and "steps" in states


def test_functionalize_states_and_frozen_models_against_plain_copies() -> None:
    """States and a frozen model are snapshots, as two plain copies would be."""

    def scenario(k: Classes) -> Any:
        model = written(k)
        if k.decorated:
            f, states = model.functionalize()
            first, second = autostate.freeze(f, states), autostate.freeze(f, states)
            snapshot = dict(states)
        else:
            first, second = copy.copy(model), copy.copy(model)
            snapshot = {name: vars(model)[name] for name in ("x", "n", "flag", "pair")}
        model.step(filled(2.0))
        model.x = filled(3.0)
        first.step(filled(4.0))
        first.x = filled(5.0)
        second.add(filled(1.0))
        return [
            model.x, model.n, first.x, first.n, second.x, second.n,
            snapshot["x"], snapshot["n"], snapshot["pair"],
        ]

    run_twins(scenario)


def test_a_lazy_functionalize_is_a_snapshot_of_the_model_then() -> None:
    model = written(DECORATED)
    f, thunk = model.functionalize(lazy=True)
    model.step(filled(2.0))
    model.x = filled(3.0)
    states = thunk()
    np.testing.assert_array_equal(np.asarray(states["x"]), filled(1.0))
    np.testing.assert_array_equal(np.asarray(states["n"]), 1)


def test_an_unhandled_category_inside_f_and_a_frozen_model() -> None:
    """States of a category functionalize did not handle stay eager slots of ``f.model``."""
    model = DecoratedParent(DecoratedChild())
    model.bump(filled(1.0, 2))
    f, states = model.functionalize("nothing")
    assert states == {}
    frozen = autostate.freeze(f, states)
    model.bump(filled(2.0, 2))
    _, _ = f.bump(states, filled(10.0, 2))  # eager: updates f.model's own slots
    frozen.set_child(filled(7.0, 2))
    np.testing.assert_array_equal(np.asarray(model.child.x), filled(3.0, 2))
    np.testing.assert_array_equal(np.asarray(f.model.child.x), filled(11.0, 2))
    np.testing.assert_array_equal(np.asarray(frozen.child.x), filled(7.0, 2))
    np.testing.assert_array_equal(np.asarray(frozen.y), filled(1.0, 2))
    with pytest.raises(autostate.AutostateError):
        staged(lambda f, v: f.bump({}, v))(f, filled(1.0, 2))
    np.testing.assert_array_equal(np.asarray(f.model.child.x), filled(11.0, 2))
    assert not has_tracer(vars(f.model.child))
