"""Static state: bools, ints, strings, enums and ``None`` placeholders held as
structure rather than arrays; modes (``train``/``eval``), one retrace per
value, and the refusal of a different value assigned inside a traced call.

Each case runs a class as plain Python and decorated (the harness in
``tests/semantics/harness.py``, or a direct comparison) and asserts the
decorated program means what the plain one does: eagerly, through
``f(states, ...)``, under ``jax.jit`` and after ``autostate.freeze``, or that it
is refused with a clear error. A known difference stays as ``xfail(strict=True)``
with what differs.
"""

from __future__ import annotations

import enum
import pickle
import re
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autostate
from autostate import errors
from autostate.errors import (
    StateAccessError,
    StaticStateError,
    TracedEagerStateError,
)
from semantics.harness import (
    Loader,
    X,
    _fcall,
    assert_bits,
    assert_same,
    assert_typed,
    assert_user_line,
    attrs,
    build_pair,
    check,
    check_transform,
    class_pair,
    data_for,
    error_line,
    jit_counted,
    keys_of,
    library,
    modes_of,
    no_tracer,
    pair,
    plain_path,
    raises_autostate,
    read_plain,
    run_case,
    same,
    snapshot,
    staged,
    user_line,
)
from semantics.programs_class_shapes import CONTROL, DATACLASSES, SHAPES
from semantics.programs_containers import GROW
from semantics.programs_eager_writes import SOURCE as SHARED_PATHS
from semantics.programs_escapes import TORCH_TRAINING
from semantics.programs_functional import STATIC
from semantics.programs_methods import LAST, MISC, PROBE, RUNTIME
from semantics.programs_numerics import DTYPES
from semantics.programs_shared import (
    ONE,
    TORCH_HEADER,
    V2,
    V2_SIGNED,
    X1,
    X3,
    X23,
    XB,
    XL,
    XP,
    XQ,
    py312,
)
from semantics.programs_shared import TWO as X2
from semantics.programs_shared import XA as XA4
from semantics.programs_shared import XM_ROUTED as XM
from semantics.programs_state_inference import CLASS_ATTRS, CLASS_DEFAULTS, PLAIN_SUB, RESET
from semantics.programs_state_inference import MOE_AUX_LOSS as MOE
from semantics.programs_static_state import (
    ACCUM,
    ASSIGN,
    BATCHNORM,
    HELD,
    LORA,
    NORMS,
    ONE_SHOT,
    QAT,
    TORCHLIKE,
    TRACEBACKS,
)
from semantics.programs_static_state import COMMON_LAYERS as MODELS
from semantics.programs_static_state import TORCH_IDIOMS as TORCH
from semantics.programs_submodels import TORCH as TORCH_MODULES
from semantics.programs_transformations import LAZY
from semantics.references import (
    batch,
    cnn,
    grads_of,
    images,
    jitted,
    lifecycle,
    module_file_name,
    ref_cnn,
    staged_method_call,
    step_jit,
    train_both,
)


class Mode(enum.Enum):
    GREEDY = "greedy"
    SAMPLE = "sample"


@autostate.stateful
class Dropout:
    """The PyTorch idiom: ``train()``/``eval()`` written by the user, a bool state."""

    def __init__(self, rate=0.5):
        self.rate = rate
        self.training = True
        self.key = jax.random.key(0)

    def __call__(self, x):
        if not self.training:
            return x
        self.key, sub = jax.random.split(self.key)
        keep = jax.random.bernoulli(sub, 1 - self.rate, x.shape)
        return jnp.where(keep, x / (1 - self.rate), 0.0)

    def train(self):
        self.training = True

    def eval(self):
        self.training = False


@autostate.stateful
class Decoder:
    def __init__(self):
        self.mode = Mode.GREEDY
        self.label = "start"
        self.cache = None
        self.steps = 0

    def __call__(self, logits):
        if self.mode is Mode.GREEDY:
            return jnp.argmax(logits)
        return jnp.argmin(logits)

    def sample(self):
        self.mode = Mode.SAMPLE

    def fill(self, x):
        self.cache = x

    def relabel(self, label):
        self.label = label

    def step(self):
        self.steps += 1


def test_train_eval_idiom_under_jit_retraces_once_per_mode():
    traces = []

    @staged
    def step(f, states, x):
        traces.append(1)
        return f(states, x)

    model = Dropout()
    x = jnp.ones(8)
    f, states = model.functionalize()
    assert sorted(states) == ["key"]  # training is structure, not a state
    out_train, _ = step(f, states, x)
    assert set(np.unique(np.asarray(out_train))) <= {0.0, 2.0}
    model.eval()
    f_eval, states = model.functionalize()
    out_eval, new_states = step(f_eval, states, x)
    np.testing.assert_array_equal(out_eval, x)
    # eval mode draws no key: the state comes back unchanged.
    np.testing.assert_array_equal(
        jax.random.key_data(new_states["key"]), jax.random.key_data(states["key"])
    )
    assert len(traces) == 2
    model.train()
    f_again, states = model.functionalize()
    step(f_again, states, x)
    step(f_eval, states, x)
    assert len(traces) == 2
    assert jax.tree_util.tree_structure(f_eval) != jax.tree_util.tree_structure(f)
    assert "static" in repr(model) and "training" in repr(model)


def test_traced_call_assigning_another_static_value_names_the_attribute():
    f, states = Dropout().functionalize()
    with pytest.raises(StaticStateError) as info:
        staged(lambda f, s: f.eval(s))(f, states)
    message = str(info.value)
    assert "'training'" in message and "True" in message and "False" in message
    assert "autostate.freeze(f, states).eval().functionalize()" in message
    assert isinstance(info.value, (autostate.AutostateError, ValueError))
    # Assigning the value it already holds is no change.
    _, same = staged(lambda f, s: f.train(s))(f, states)
    assert sorted(same) == ["key"]
    # Untraced functionalized calls are pure too.
    with pytest.raises(StaticStateError):
        f.eval(states)


def test_enum_and_string_state_under_jit():
    model = Decoder()
    logits = jnp.array([0.1, 0.9, 0.0])
    f, states = model.functionalize()
    assert states == {"cache": None}  # the placeholder; the Python values are structure
    assert int(staged(lambda f, s, x: f(s, x)[0])(f, states, logits)) == 1
    model.sample()
    model.relabel("other")
    f, states = model.functionalize()
    assert int(staged(lambda f, s, x: f(s, x)[0])(f, states, logits)) == 2
    frozen = autostate.freeze(f, states)
    assert frozen.mode is Mode.SAMPLE and frozen.label == "other"


def test_python_int_state_is_static_and_a_traced_increment_is_an_error():
    model = Decoder()
    model.step()
    assert model.steps == 1 and type(model.steps) is int
    f, states = model.functionalize()
    assert "steps" not in states
    with pytest.raises(StaticStateError, match="'steps'"):
        staged(lambda f, s: f.step(s))(f, states)


def test_a_none_state_becomes_an_array_state_when_assigned_one():
    model = Decoder()
    _, states = model.functionalize()
    assert states["cache"] is None
    model.fill(jnp.ones(2))
    _, states = model.functionalize()
    np.testing.assert_array_equal(states["cache"], [1.0, 1.0])


LAZY_STATES = """
@DECORATE
class LazyRNN:
    def __init__(self):
        self.h = None                  # sized by the first input
        self.acts = {"last": None}     # a captured activation, in a container state
        self.w = jnp.array([0.5, 2.0])

    def __call__(self, x):
        if self.h is None:
            self.h = jnp.zeros_like(x)
        self.h = self.h * self.w + x
        self.acts["last"] = self.h * 2
        return self.h.sum()

    def reset(self):
        self.h = None
"""


@pytest.mark.parametrize("history", ["fresh", "called_and_reset"])
def test_a_none_placeholder_means_plain_python_whatever_its_history(write_module, history):
    plain, dec = pair(write_module, LAZY_STATES)
    build = {
        "fresh": "LazyRNN()",
        "called_and_reset": "(lambda m: (m(jnp.ones(2)), m.reset(), m)[2])(LazyRNN())",
    }[history]
    x = jnp.array([1.0, 3.0])
    calls = [("__call__", (x,)), ("__call__", (x,)), ("reset", ()), ("__call__", (x,))]
    check(plain, dec, build, calls)


def test_an_array_given_to_a_none_placeholder_under_jit_is_carried_by_the_new_states(
    write_module,
):
    _, dec = pair(write_module, LAZY_STATES)
    f, states = dec.LazyRNN().functionalize()
    assert states["h"] is None and states["acts"] == {"last": None}
    traces = []

    @staged
    def step(f, states, x):
        traces.append(1)
        return f(states, x)

    x = jnp.array([1.0, 3.0])
    out, states = step(f, states, x)
    np.testing.assert_array_equal(states["h"], x)
    np.testing.assert_array_equal(states["acts"]["last"], 2 * x)
    frozen = autostate.freeze(f, states)
    np.testing.assert_array_equal(frozen.h, x)
    out, states = step(f, states, x)  # the states now hold arrays: one more trace
    np.testing.assert_array_equal(states["h"], [1.5, 9.0])
    step(f, states, x)
    assert len(traces) == 2 and float(out) == 10.5


def test_a_python_value_given_to_a_none_placeholder_decides_its_kind(write_module):
    _, dec = pair(write_module, """
@DECORATE
class Labelled:
    def __init__(self):
        self.label = None

    def name(self, label):
        self.label = label

    def clear(self):
        self.label = None
""")
    model = dec.Labelled()
    model.name("relu")  # eagerly as if first assigned: a static state, f's structure
    f, states = model.functionalize()
    assert "label" not in states and autostate.freeze(f, states).label == "relu"
    model.clear()  # None again: the placeholder, whatever came before
    f, states = model.functionalize()
    assert states == {"label": None}
    with pytest.raises(StaticStateError, match="placeholder None") as info:
        staged(lambda f, s: f.name(s, "gelu"))(f, states)
    assert "model.label = 'gelu'" in str(info.value) and f"{dec.__file__}:" in str(info.value)
    _, states = staged(lambda f, s: f.name(s, jnp.ones(2)))(f, states)
    np.testing.assert_array_equal(states["label"], [1.0, 1.0])


_CALLABLE_IN_PLACEHOLDER = """
@DECORATE
class Act:
    def __init__(self):
        self.w = jnp.ones(3)
        self.fn = None

    def pick(self, x):
        self.fn = FN  # <- a function in the placeholder
        return self.fn(x * self.w)

    def pick_in_jit(self, x):
        return jax.jit(self.pick)(x)

    def pick_in_scan(self, x):
        return lax.scan(lambda c, _: (self.pick(c), None), x, None, length=2)[0]
"""


@pytest.mark.parametrize("fn", ["jnp.sin", "lambda v: v * 2", "functools.partial(jnp.multiply, 2.0)"])
def test_a_function_given_to_a_none_placeholder(write_module: Any, fn: str) -> None:
    """Eagerly, at autostate.jit and at a jax.jit inside a method plain Python. A function
    is a static value (as a string is): inside f (under jax.jit or not) and in a lax body
    it would change the structure, refused at the line, the states left as they were. A
    partial is no static value, and the new states could not carry it (JAX: "not a valid
    JAX type"): refused at the line in f, and at the call in a jax.jit or a lax body."""
    plain, dec = pair(write_module, "import functools\n" + _CALLABLE_IN_PLACEHOLDER.replace("FN", fn))
    x = jnp.arange(3.0)
    expected = plain.Act().pick(x)
    model = dec.Act()
    same(expected, model.pick(x))
    model = dec.Act()
    same(expected, autostate.jit(lambda m, x: m.pick(x))(model, x))
    same(expected, model.fn(x))
    static = not fn.startswith("functools")
    in_f = errors.StaticStateError if static else errors.InvalidTypeError
    for call in (lambda f: f.pick, lambda f: jax.jit(f.pick)):
        f, states = dec.Act().functionalize()
        with pytest.raises(in_f, match="placeholder None") as err:
            call(f)(states, x)
        user_line(err.value, dec, "<- a function in the placeholder")
        assert states == {"fn": None}
    bodies = [("pick_in_scan", "lax.scan(")] + ([] if static else [("pick_in_jit", "jax.jit(self.pick)")])
    for name, line in bodies:
        model = dec.Act()
        with pytest.raises(errors.AutostateError, match="placeholder None" if static else "cannot return") as err:
            getattr(model, name)(x)
        user_line(err.value, dec, "<- a function in the placeholder" if static else line)
        assert model.fn is None
        no_tracer(model)
    if static:  # an object boundary: written back
        model = dec.Act()
        same(expected, model.pick_in_jit(x))
        same(expected, model.fn(x))
        no_tracer(model)


def test_true_and_one_are_different_structures():
    a, b = Decoder(), Decoder()
    a.relabel(True)
    b.relabel(1)
    assert jax.tree_util.tree_structure(a) != jax.tree_util.tree_structure(b)
    fa, _ = a.functionalize()
    fb, _ = b.functionalize()
    assert jax.tree_util.tree_structure(fa) != jax.tree_util.tree_structure(fb)


@autostate.stateful
class Sub:
    def __init__(self):
        self.w = jnp.ones(2)

    def __call__(self, x):
        return x * self.w


@autostate.stateful
class Mixed:
    def __init__(self):
        self.a = [Sub(), 3, "relu", None]
        self.cfg = {"scale": 2.0, "w": jnp.ones(2), "act": jax.nn.relu}

    def __call__(self, x):
        return self.cfg["act"](self.a[0](x) * self.a[1] * self.cfg["scale"]) @ self.cfg["w"]


def test_python_values_in_containers_are_never_leaves():
    model = Mixed()
    leaves = jax.tree_util.tree_leaves(model)
    assert all(isinstance(leaf, jax.Array) for leaf in leaves) and len(leaves) == 2
    f, states = model.functionalize()
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(f)]
    assert paths == [".model.a[0].w", ".model.cfg['w']"]
    out, _ = staged(lambda f, s, x: f(s, x))(f, states, jnp.ones(2))
    assert float(out) == 12.0
    rebuilt = jax.tree.map(lambda x: x * 2, model)
    assert rebuilt.a[1:] == [3, "relu", None] and rebuilt.cfg["scale"] == 2.0
    np.testing.assert_array_equal(rebuilt.a[0].w, [2.0, 2.0])


@autostate.stateful
class Counter:
    def __init__(self):
        self.count = jnp.zeros(())
        self.total = 0.0

    def __call__(self, x):
        self.count += 1
        self.total = self.total + x.sum()
        return x * self.count


@autostate.stateful
class UsesTemporary:
    def __init__(self):
        self.scale = jnp.ones(())
        self.seen = jnp.zeros(())

    def __call__(self, x):
        helper = Counter()  # built inside the (traced) call
        helper(x)
        y = helper(x)
        self.seen += helper.count
        return y * self.scale


def test_a_temporary_instance_inside_a_jitted_function_works():
    @staged
    def run(x):
        c = Counter()
        c(x)
        return c(x), c.count, c.total

    y, count, total = run(jnp.ones(3))
    np.testing.assert_array_equal(y, [2.0, 2.0, 2.0])
    assert float(count) == 2.0 and float(total) == 6.0


def test_a_temporary_instance_inside_a_functionalized_call_works():
    f, states = UsesTemporary().functionalize()
    y, states = staged(lambda f, s, x: f(s, x))(f, states, jnp.ones(2))
    np.testing.assert_array_equal(y, [2.0, 2.0])
    assert float(states["seen"]) == 2.0


def test_a_model_built_outside_still_refuses_tracers():
    c = Counter()
    with pytest.raises(TracedEagerStateError, match=r"functionalize\(\)"):
        staged(lambda x: c(x))(jnp.ones(2))
    # Passed into the trace as an argument, it is a copy whose writes would be lost.
    with pytest.raises(TracedEagerStateError):
        staged(lambda c, x: c(x))(c, jnp.ones(2))
    assert float(c.count) == 0.0


SOURCE = """
import enum


class Mode(enum.Enum):
    A = 1
    B = 2


@DECORATE
class Shaped:
    def __init__(self):
        self.shape = (2,)
        self.w = jnp.ones(())

    def __call__(self, x):
        return jnp.zeros(self.shape) + x * self.w

    def grow(self):
        self.shape = (self.shape[0] + 1,)

    def measure(self, x):
        self.shape = (self.shape[0], x.sum())


@DECORATE
class Config:
    def __init__(self):
        self.cfg = {
            "m": jnp.zeros(2),
            "name": "relu",
            "scale": 0.5,
            "flags": [True, 1, None],
            "mode": (Mode.A, "x"),
        }

    def __call__(self, x):
        c = self.cfg
        act = jax.nn.relu if c["name"] == "relu" else jnp.tanh
        y = act(c["m"] + x) * c["scale"] * (2.0 if c["mode"][0] is Mode.A else 3.0)
        y = y + (1.0 if c["flags"][0] is True else 0.0) + c["flags"][1]
        self.cfg = {**c, "m": c["m"] + x, "scale": c["scale"] * 2}
        return y

    def switch(self):
        self.cfg = {**self.cfg, "name": "tanh", "mode": (Mode.B, "y"), "flags": [1, True, None]}
"""


@pytest.fixture
def mods(write_module: Loader) -> tuple[types.ModuleType, types.ModuleType]:
    return pair(write_module, SOURCE)


def same_leaves(expected: Any, got: Any) -> None:
    """Same structure, Python types and values; arrays by value."""
    e_leaves, e_def = jax.tree_util.tree_flatten(expected)
    g_leaves, g_def = jax.tree_util.tree_flatten(got)
    assert e_def == g_def, (expected, got)
    for a, b in zip(e_leaves, g_leaves):
        if isinstance(a, bool | int | str):
            assert type(a) is type(b) and a == b, (expected, got)
        else:
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


def python_values(value: Any) -> list[Any]:
    return [
        leaf
        for leaf in jax.tree_util.tree_leaves(dict(value) if isinstance(value, dict) else value)
        if isinstance(leaf, bool | int | str)
    ]


def counted_jit(fn: Callable[..., Any]) -> tuple[Callable[..., Any], list[int]]:
    traces: list[int] = []

    def traced(*a: Any) -> Any:
        traces.append(1)
        return fn(*a)

    return staged(traced), traces


def test_a_tuple_of_ints_is_structure_under_jit_and_retraces_per_value(mods) -> None:
    plain, dec = mods
    ref, model = plain.Shaped(), dec.Shaped()
    f, states = model.functionalize()
    assert states == {"shape": (2,)} and isinstance(states, dict)
    assert jax.tree_util.tree_leaves(states) == []
    step, traces = counted_jit(lambda f, s, x: f(s, x))
    grow = staged(lambda f, s: f.grow(s))
    for i in range(3):
        out, states = step(f, states, 1.5)
        same_leaves(ref(1.5), out)
        out, states = step(f, states, 2.5)  # same value: no new trace
        same_leaves(ref(2.5), out)
        _, states = grow(f, states)
        ref.grow()
        assert states["shape"] == ref.shape and type(states["shape"][0]) is int
        assert len(traces) == i + 1
    frozen = autostate.freeze(f, states)
    assert frozen.shape == (5,) and type(frozen.shape[0]) is int
    same_leaves(ref(1.0), frozen(1.0))


def test_a_tuple_of_ints_through_f_without_jit_and_eagerly(mods) -> None:
    plain, dec = mods
    ref, model = plain.Shaped(), dec.Shaped()
    model.grow()
    ref.grow()
    f, states = model.functionalize()
    _, states = f.grow(states)
    ref.grow()
    out, states = f(states, 1.0)
    same_leaves(ref(1.0), out)
    same_leaves(ref.shape, states["shape"])
    model = autostate.freeze(f, states)
    model.grow()
    ref.grow()
    same_leaves(ref.shape, model.shape)


def test_a_traced_value_assigned_into_the_container_is_an_array_as_in_plain_python(mods) -> None:
    plain, dec = mods
    ref = plain.Shaped()
    ref.measure(jnp.ones(3))
    f, states = dec.Shaped().functionalize()
    _, states = staged(lambda f, s, x: f.measure(s, x))(f, states, jnp.ones(3))
    assert type(states["shape"][0]) is int and isinstance(states["shape"][1], jax.Array)
    same_leaves(ref.shape, states["shape"])
    same_leaves(ref.shape, autostate.freeze(f, states).shape)


def test_python_values_in_a_mixed_dict_state_under_jit(mods) -> None:
    plain, dec = mods
    ref, model = plain.Config(), dec.Config()
    f, states = model.functionalize()
    step, traces = counted_jit(lambda f, s, x: f(s, x))
    switch = staged(lambda f, s: f.switch(s))
    x = jnp.array([0.5, -1.0])
    for _ in range(2):
        out, states = step(f, states, x)
        same_leaves(ref(x), out)
    assert len(traces) == 1
    # The Python float is a leaf (a weak float32 once it crossed jit), the rest structure.
    scale = states["cfg"]["scale"]
    assert isinstance(scale, jax.Array) and scale.weak_type and float(scale) == ref.cfg["scale"]
    assert python_values(states) == python_values(ref.cfg)
    _, states = switch(f, states)
    ref.switch()
    assert python_values(states) == python_values(ref.cfg)
    assert type(states["cfg"]["flags"][0]) is int and type(states["cfg"]["flags"][1]) is bool
    same_leaves(ref(x), step(f, states, x)[0])
    assert len(traces) == 2
    frozen = autostate.freeze(f, states)
    assert frozen.cfg["mode"][0] is dec.Mode.B and frozen.cfg["name"] == "tanh"


def test_true_and_one_inside_a_container_are_different_structures(mods) -> None:
    _, dec = mods
    a, b = dec.Config(), dec.Config()
    a.switch()
    b.switch()
    b.cfg = {**b.cfg, "flags": [True, True, None]}
    sa, sb = a.functionalize()[1], b.functionalize()[1]
    assert jax.tree_util.tree_structure(sa) != jax.tree_util.tree_structure(sb)


def test_an_eager_model_passed_to_jit_keeps_its_python_values(mods) -> None:
    plain, dec = mods
    model, ref = dec.Shaped(), plain.Shaped()
    model.grow()
    ref.grow()
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree_util.tree_leaves(model))
    same_leaves(ref(2.0), staged(lambda m, x: m(x))(model, 2.0))
    doubled = jax.tree.map(lambda v: v * 2, model)
    assert doubled.shape == (3,) and float(doubled.w) == 2.0


def test_pickling_and_tree_maps_keep_the_python_values(mods, monkeypatch) -> None:
    _, dec = mods
    monkeypatch.setitem(sys.modules, dec.__name__, dec)  # (pair caches modules across tests)
    model = dec.Config()
    f, states = model.functionalize()
    back = pickle.loads(pickle.dumps(states))
    assert type(back) is type(states) and python_values(back) == python_values(states)
    mapped = jax.tree.map(lambda v: v + 1, states)
    assert type(mapped) is type(states) and mapped["cfg"]["name"] == "relu"
    assert float(mapped["cfg"]["scale"]) == 1.5
    copied = states.copy()
    assert type(copied) is type(states) and copied == states
    frozen = pickle.loads(pickle.dumps(autostate.freeze(f, states)))
    assert frozen.cfg["mode"] == (dec.Mode.A, "x") and frozen.cfg["flags"] == [True, 1, None]


def test_vmap_over_states_with_python_values(mods) -> None:
    plain, dec = mods
    f, states = dec.Config().functionalize()
    batch = jax.tree.map(lambda v: jnp.stack([v, v]), states)
    xs = jnp.array([[0.5, -1.0], [1.0, 2.0]])
    outs, new = jax.vmap(lambda s, x: f(s, x))(batch, xs)
    for i in range(2):
        ref = plain.Config()
        same_leaves(ref(xs[i]), outs[i])
    assert new["cfg"]["name"] == "relu" and new["cfg"]["mode"][0] is dec.Mode.A


def test_a_whole_python_number_in_an_array_state_stays_dynamic(write_module: Loader) -> None:
    _, dec = pair(
        write_module,
        """
@DECORATE
class Count:
    def __init__(self):
        self.n = jnp.zeros((), jnp.int32)
        self.pair = (0.5, jnp.ones(()))

    def __call__(self):
        self.n = self.n + 1
        self.pair = (self.pair[0] * 2, self.pair[1])
        return self.n
""",
    )
    model = dec.Count()
    model.n = 3  # an array state assigned a Python int keeps being a leaf
    f, states = model.functionalize()
    assert type(states) is dict  # no Python values inside containers: a plain dict
    step, traces = counted_jit(lambda f, s: f(s))
    _, states = step(f, states)
    _, states = step(f, states)
    assert int(states["n"]) == 5 and isinstance(states["n"], jax.Array) and len(traces) == 1
    assert isinstance(states["pair"][0], jax.Array) and float(states["pair"][0]) == 2.0


@autostate.stateful
class Keeps:
    def __init__(self):
        self.w = jnp.ones(2)
        self.log = []
        self.seen = {}
        self.tags = set()
        self.nested = {"inner": [0]}

    def append(self, x):
        self.log.append(x)
        return x * self.w

    def item(self, x):
        self.seen.update(k=1)
        return x * self.w

    def add(self, x):
        self.tags.add("t")
        return x * self.w

    def deep(self, x):
        self.nested["inner"].append(1)
        return x * self.w

    def fine(self, x):
        _ = len(self.log) + len(self.seen)
        return x * self.w


@autostate.stateful
class Leaf:
    def __init__(self):
        self.n = jnp.zeros(())

    def __call__(self, x):
        self.n = self.n + 1
        return x


@autostate.stateful
class Holder:
    """A static container next to a sub-model in one attribute."""

    def __init__(self):
        self.parts = [Leaf(), []]

    def __call__(self, x):
        self.parts[1].append(0)
        return self.parts[0](x)


TRANSFORMS: dict[str, Callable[[Any, Any, Any, str], Any]] = {
    "jit": lambda f, s, x, m: staged(lambda f, s, x: getattr(f, m)(s, x))(f, s, x),
    "grad": lambda f, s, x, m: jax.grad(lambda x: getattr(f, m)(s, x)[0].sum())(x),
    "vmap": lambda f, s, x, m: jax.vmap(lambda x: getattr(f, m)(s, x)[0])(jnp.stack([x, x])),
}


CHANGES = {"append": "Keeps.log", "item": "Keeps.seen", "add": "Keeps.tags", "deep": "Keeps.nested"}


@pytest.mark.parametrize("how", list(TRANSFORMS))
@pytest.mark.parametrize("method", list(CHANGES))
def test_an_in_place_change_inside_a_traced_call_is_refused(method: str, how: str) -> None:
    f, states = Keeps().functionalize()
    before = (list(f.model.log), dict(f.model.seen), set(f.model.tags), {"inner": [0]})
    with pytest.raises(autostate.AutostateError, match=CHANGES[method]):
        TRANSFORMS[how](f, states, jnp.ones(2), method)
    # Put back, and f still works.
    m = f.model
    assert (m.log, m.seen, m.tags, m.nested) == before
    out, _ = staged(lambda f, s, x: f.fine(s, x))(f, states, jnp.full(2, 3.0))
    np.testing.assert_allclose(out, jnp.full(2, 3.0))


def test_reading_static_containers_under_jit_is_fine() -> None:
    f, states = Keeps().functionalize()
    out, _ = staged(lambda f, s, x: f.fine(s, x))(f, states, jnp.ones(2))
    np.testing.assert_allclose(out, jnp.ones(2))


def test_an_eager_call_of_f_changes_its_own_copy_as_python_would() -> None:
    model = Keeps()
    f, states = model.functionalize()
    f.append(states, 1.0)
    f.append(states, 2.0)
    assert f.model.log == [1.0, 2.0]
    assert model.log == []  # f holds a copy of the model
    plain = Keeps.__new__(Keeps)
    plain.__dict__.update(log=[])
    plain.log.append(1.0)
    plain.log.append(2.0)
    assert plain.log == f.model.log


def test_a_static_container_beside_a_sub_model_is_checked_too() -> None:
    f, states = Holder().functionalize()
    with pytest.raises(autostate.AutostateError, match="Holder.parts"):
        staged(lambda f, s, x: f(s, x))(f, states, jnp.ones(2))
    assert f.model.parts[1] == []


def test_a_traced_value_never_stays_in_a_static_list() -> None:
    f, states = Keeps().functionalize()
    with pytest.raises(autostate.AutostateError):
        staged(lambda f, s, x: f.append(s, x))(f, states, jnp.ones(2))
    assert f.model.log == []
    assert not any(isinstance(v, jax.core.Tracer) for v in f.model.log)


jit_call = staged(lambda f, s, *a: f(s, *a))


LOGGING = """
import jax.numpy as jnp


class Logging:
    def __init__(self):
        self.w = jnp.ones(())
        self.log = []

    def __call__(self, x):
        self.log.append(x)
        return x * self.w
"""


def test_an_in_place_change_of_a_model_without_states_is_refused_and_undone(write_module):
    _, cls, _ = class_pair(write_module, LOGGING, "Logging")
    f, states = cls().functionalize()
    assert states == {}
    with pytest.raises(autostate.errors.StateAccessError, match="outside its states"):
        jit_call(f, states, 1.0)
    assert f.model.log == []  # no tracer left behind in f's static data


def test_batchnorm_eval_mode_set_eagerly(write_module: Loader) -> None:
    plain, dec = pair(write_module, BATCHNORM)
    check(plain, dec, "BatchNorm(3)", [("__call__", (XB,))], modes=("eager",))
    check(plain, dec, "BatchNorm(3).eval()", [("__call__", (XB,))])


def test_batchnorm_eval_inside_f_is_a_static_state_error(write_module: Loader) -> None:
    _, dec = pair(write_module, BATCHNORM)
    f, states = dec.BatchNorm(3).functionalize()
    with raises_autostate(autostate.errors.StaticStateError):
        f.eval(states)


def test_none_state_becomes_an_array(write_module: Loader) -> None:
    # None is a placeholder an array may replace, inside f too (tests/test_static_state.py).
    plain, dec = pair(write_module, MISC)
    check(plain, dec, "Misc()", [("swap_none", (jnp.ones(2),)), ("swap_none", (jnp.ones(2),))])


def test_for_self_i_in_python_range(write_module: Loader) -> None:
    plain, dec = pair(write_module, LAST)
    check(plain, dec, "Loop()", [("py_range", ()), ("py_range", ())])


@pytest.mark.parametrize("method", ["bump_int", "flip"])
def test_python_int_and_bool_states_are_static_inside_f(write_module: Loader, method: str) -> None:
    plain, dec = pair(write_module, DTYPES)
    check(plain, dec, "Py()", [(method, ()), ("step", (1.0,))], modes=("eager",))
    f, states = dec.Py().functionalize()
    with pytest.raises(errors.StaticStateError):
        getattr(f, method)(states)
    # set eagerly, then functionalize: the new value is f's structure
    m = dec.Py()
    getattr(m, method)()
    p = plain.Py()
    getattr(p, method)()
    f, states = m.functionalize()
    out, _ = staged(f.step)(states, 1.0)
    assert_same(p.step(1.0), out)


def test_enum_and_string_static_states(write_module: Loader) -> None:
    plain, dec = pair(write_module, DTYPES)
    check(plain, dec, "Static()", [("same", ()), ("__call__", (2.0,))])
    f, states = dec.Static().functionalize()
    assert states == {}
    with pytest.raises(errors.StaticStateError, match="mode"):
        f.set_b(states)
    out, _ = f(states, 1.0)  # f still usable after the refusal
    assert float(out) == 3.0
    m, p = dec.Static(), plain.Static()
    m.set_b()
    p.set_b()
    f, states = m.functionalize()
    assert_same(p(2.0), staged(f)(states, 2.0)[0])
    assert autostate.freeze(f, states).mode is dec.Mode.B


STATICS = """
import collections


class Box:
    def __init__(self):
        self.items = []


@DECORATE
class Inner:
    def __init__(self):
        self.w = jnp.ones(2)
        self.seen = []

    def __call__(self, x):
        self.seen.append(1)
        return x * self.w


@DECORATE
class S:
    shared = []

    def __init__(self):
        self.w = jnp.ones(2)
        self.log = [3, 1, 2]
        self.cfg = {"a": 1, "b": 2}
        self.tags = {"t"}
        self.tup = ([], 1)
        self.box = Box()
        self.dq = collections.deque([1])
        self.od = collections.OrderedDict(a=1)
        self.dd = collections.defaultdict(list)
        self.ba = bytearray(b"ab")
        self.deep = {"l": [{"k": []}]}
        self.inner = Inner()

    # --- in-place changes -------------------------------------------------------
    def sort(self, x):
        self.log.sort()
        return x * self.w

    def popitem(self, x):
        self.cfg.popitem()
        return x * self.w

    def append_tracer(self, x):
        self.log.append(x)
        return x * self.w

    def extend(self, x):
        self.log.extend([1, 2])
        return x * self.w

    def clear(self, x):
        self.tags.clear()
        return x * self.w

    def in_tuple(self, x):
        self.tup[0].append(x)
        return x * self.w

    def deep_change(self, x):
        self.deep["l"][0]["k"].append(x)
        return x * self.w

    def in_cond(self, x):
        def yes(v):
            self.log.append(1)
            return v

        return lax.cond(x[0] > 0, yes, lambda v: v, x * self.w)

    def in_scan(self, x):
        def body(c, _):
            self.cfg.update(z=3)
            return c, None

        c, _ = lax.scan(body, x * self.w, None, length=2)
        return c

    def in_sub(self, x):
        return self.inner(x)

    def in_box(self, x):
        self.box.items.append(x)
        return x * self.w

    def in_deque(self, x):
        self.dq.append(x)
        return x * self.w

    def in_odict(self, x):
        self.od.update(b=2)
        return x * self.w

    def in_ddict(self, x):
        self.dd["k"].append(x)
        return x * self.w

    def in_bytearray(self, x):
        self.ba.append(1)
        return x * self.w

    def in_class_list(self, x):
        self.shared.append(x)
        return x * self.w

    # --- legitimate code --------------------------------------------------------
    def reads(self, x):
        total = len(self.log) + sum(self.log) + len(self.cfg) + len(self.tags)
        total += sum(v for v in self.cfg.values()) + sorted(self.log)[0]
        total += len(list(self.log)) + len(dict(self.cfg)) + len(copy.copy(self.log))
        total += sum(k == "a" for k in self.cfg) + len(self.dq) + self.od["a"] + len(self.ba)
        arr = jnp.array(self.log, jnp.float32)
        doubled = {k: v * 2 for k, v in self.cfg.items()}
        return x * self.w * total + arr.sum() + doubled["b"] + len(self.tup[0])

    def local_copy(self, x):
        l = list(self.log)
        l.append(1)
        l.sort()
        c = dict(self.cfg)
        c["z"] = 9
        d = copy.deepcopy(self.deep)
        d["l"][0]["k"].append(1)
        return x * self.w * (len(l) + len(c) + len(d["l"][0]["k"]))

    def push_pop(self, x):
        self.log.append(x)
        self.log.pop()
        return x * self.w
"""


CHANGED_STATICS = {
    "sort": "S.log",
    "popitem": "S.cfg",
    "append_tracer": "S.log",
    "extend": "S.log",
    "clear": "S.tags",
    "in_tuple": "S.tup",
    "deep_change": "S.deep",
    "in_cond": "S.log",
    "in_scan": "S.cfg",
    "in_sub": "seen",
}


_JIT = {
    "jit": lambda f, s, x, m: staged(lambda f, s, x: _fcall(f, m)(s, x))(f, s, x),
    "vmap": lambda f, s, x, m: jax.vmap(lambda x: _fcall(f, m)(s, x)[0])(jnp.stack([x, x])),
}


def _statics_of(model: Any) -> Any:
    return (
        list(model.log), dict(model.cfg), sorted(model.tags), list(model.tup[0]),
        list(model.box.items), list(model.dq), dict(model.od), dict(model.dd),
        list(model.ba), repr(model.deep), list(model.inner.seen), list(type(model).shared),
    )


def _refused_and_put_back(dec: Any, method: str, where: str, how: str = "jit") -> None:
    f, states = dec.S().functionalize()
    before = _statics_of(f.model)
    try:
        with pytest.raises(autostate.AutostateError, match=where):
            _JIT[how](f, states, jnp.ones(2), method)
    finally:
        after = _statics_of(f.model)
        type(f.model).shared.clear()
    assert after == before, "the static container was not put back"
    out, _ = staged(lambda f, s, x: f.reads(s, x))(f, states, jnp.ones(2))
    assert np.all(np.isfinite(np.asarray(out)))


@pytest.mark.parametrize("method", list(CHANGED_STATICS))
def test_an_in_place_change_is_refused_and_put_back(write_module: Loader, method: str) -> None:
    _, dec = pair(write_module, STATICS, fresh=True)
    _refused_and_put_back(dec, method, CHANGED_STATICS[method])


@pytest.mark.parametrize("method", ["append_tracer", "in_tuple"])
def test_an_in_place_change_under_vmap_is_refused(write_module: Loader, method: str) -> None:
    _, dec = pair(write_module, STATICS, fresh=True)
    _refused_and_put_back(dec, method, CHANGED_STATICS[method], "vmap")


_SLIPS = {
    "in_box": "S.box",
    "in_deque": "S.dq",
    "in_odict": "S.od",
    "in_bytearray": "S.ba",
    "in_class_list": "S.shared",
}


@pytest.mark.parametrize("method", list(_SLIPS))
def test_in_place_changes_that_slip_through(write_module: Loader, method: str) -> None:
    _, dec = pair(write_module, STATICS, fresh=True)
    _refused_and_put_back(dec, method, _SLIPS[method])


def test_defaultdict_change_is_put_back(write_module: Loader) -> None:
    _, dec = pair(write_module, STATICS, fresh=True)
    _refused_and_put_back(dec, "in_ddict", "S.dd")


@pytest.mark.parametrize("method", ["reads", "local_copy", "push_pop"])
def test_legit_static_use_works_under_jit(write_module: Loader, method: str) -> None:
    plain, dec = pair(write_module, STATICS, fresh=True)
    check(plain, dec, "S()", [(method, (jnp.ones(2),)), (method, (jnp.full(2, 2.0),))])


@pytest.mark.parametrize("method", ["reads", "local_copy"])
def test_legit_static_use_under_grad_and_vmap(write_module: Loader, method: str) -> None:
    plain, dec = pair(write_module, STATICS, fresh=True)
    for transform, x in (("grad", jnp.ones(2)), ("vmap", jnp.ones((3, 2)))):
        check_transform(plain, dec, "S()", [(method, (X,))], x, transform)


@pytest.mark.parametrize("method", ["sort", "popitem", "extend", "in_tuple", "in_sub"])
def test_eager_f_changes_its_own_copy_like_plain_python(write_module: Loader, method: str) -> None:
    plain, dec = pair(write_module, STATICS, fresh=True)
    ref = plain.S()
    model = dec.S()
    f, states = model.functionalize()
    for v in (1.0, 2.0):
        getattr(ref, method)(jnp.full(2, v))
        _, states = _fcall(f, method)(states, jnp.full(2, v))
    assert_same(_statics_of(ref)[:-1], _statics_of(f.model)[:-1], "f's copy")
    assert _statics_of(model)[:-1] == _statics_of(dec.S())[:-1], "the eager model changed"


def test_jit_after_eager_f_changed_a_static_list(write_module: Loader) -> None:
    src = """
@DECORATE
class Counter:
    def __init__(self):
        self.w = jnp.ones(())
        self.log = []

    def push(self, x):
        self.log.append(1)
        return x

    def count(self, x):
        return x * self.w * len(self.log)
"""
    plain, dec = pair(write_module, src, fresh=True)
    ref = plain.Counter()
    f, states = dec.Counter().functionalize()
    count = staged(lambda f, s, x: f.count(s, x))
    for _ in range(2):
        ref.push(1.0)
        f.push(states, 1.0)
        out, _ = count(f, states, 2.0)
        np.testing.assert_allclose(out, ref.count(2.0))


def test_eager_f_pushes_then_freeze(write_module: Loader) -> None:
    plain, dec = pair(write_module, STATICS, fresh=True)
    ref = plain.S()
    f, states = dec.S().functionalize()
    for v in (1.0, 2.0):
        ref.extend(jnp.full(2, v))
        _, states = f.extend(states, jnp.full(2, v))
    frozen = autostate.freeze(f, states)
    assert frozen.log == ref.log


def test_a_refused_call_leaves_a_working_f_for_eager_calls(write_module: Loader) -> None:
    plain, dec = pair(write_module, STATICS, fresh=True)
    f, states = dec.S().functionalize()
    with pytest.raises(autostate.AutostateError, match="S.log"):
        staged(lambda f, s, x: f.append_tracer(s, x))(f, states, jnp.ones(2))
    ref = plain.S()
    ref.append_tracer(jnp.full(2, 3.0))
    _, states = f.append_tracer(states, jnp.full(2, 3.0))
    assert len(f.model.log) == len(ref.log) == 4
    assert not any(isinstance(v, jax.core.Tracer) for v in f.model.log)


def f_and_jit(f: Any, method: str) -> list[Callable[..., Any]]:
    """The functional call of ``method``, as is and under ``jax.jit``."""
    call = _fcall(f, method)
    return [call, staged(call)]


HELD_REFUSED = {
    "logged_in_list": "Sub.log",
    "logged_in_dict": "Sub.log",
    "logged_in_tuple": "Sub.log",
    "box_in_list": "M.boxes",
    "nested_box_dict": "M.box",
    "box_in_dict_of_lists": "M.tagged",
}


@pytest.mark.parametrize("method", list(HELD_REFUSED))
def test_in_place_changes_held_outside_states_refused_under_jit(
    write_module: Loader, method: str
) -> None:
    plain, dec = pair(write_module, HELD, fresh=True)
    check(plain, dec, "M()", [(method, (jnp.float32(1.0),))], modes=("eager",))
    f, states = dec.M().functionalize()
    before = _held(f.model)
    with pytest.raises(autostate.AutostateError, match=HELD_REFUSED[method]):
        staged(_fcall(f, method))(states, jnp.float32(1.0))
    assert before == _held(f.model), "the container was not put back"


def _held(m: Any) -> Any:
    return repr(
        ([s.log for s in m.subs], m.named["a"].log, m.pair[0].log, m.box.items, m.box.inner,
         m.boxes[0].items, m.tagged["t"][0].inner)
    )


LATE = """
@DECORATE
class Cache:
    def __init__(self):
        self.kv = None
        self.count = 0
        self.flag = False
        self.w = jnp.ones(2)

    def fill(self, x):
        if self.kv is None:
            self.kv = x * self.w
        else:
            self.kv = self.kv + x
        return self.kv

    def bump(self, x):
        self.count += 1
        return x * self.count

    def toggle(self, x):
        self.flag = not self.flag
        return x * self.w if self.flag else -x * self.w
"""


@pytest.mark.parametrize("method", ["fill", "bump", "toggle"])
def test_static_state_changed_eagerly_like_plain_python(write_module: Loader, method: str) -> None:
    plain, dec = pair(write_module, LATE, fresh=True)
    check(plain, dec, "Cache()", [(method, (jnp.float32(1.5),))] * 2, modes=("eager",))


@pytest.mark.parametrize("method", ["bump", "toggle"])
def test_static_state_changed_in_f_or_jit_is_a_static_state_error(
    write_module: Loader, method: str
) -> None:
    _, dec = pair(write_module, LATE, fresh=True)
    f, states = dec.Cache().functionalize()
    for call in f_and_jit(f, method):
        with pytest.raises(autostate.errors.StaticStateError):
            call(states, jnp.float32(1.5))


def test_a_none_placeholder_given_an_array_in_f_or_jit_means_plain_python(
    write_module: Loader,
) -> None:
    # None is a placeholder, not a mode (DESIGN.md section 3): the new states carry the array.
    plain, dec = pair(write_module, LATE, fresh=True)
    check(plain, dec, "Cache()", [("fill", (jnp.float32(1.5),))] * 2)


def test_static_state_error_names_the_user_line_and_no_tracer(write_module: Loader) -> None:
    _, dec = pair(write_module, LATE, fresh=True)
    f, states = dec.Cache().functionalize()
    with pytest.raises(autostate.errors.StaticStateError) as info:
        staged(f.toggle)(states, jnp.float32(1.5))
    text = str(info.value)
    assert f"{dec.__file__}:" in text, text
    assert "Tracer" not in text, text


def test_batchnorm_training_flag_then_eval(write_module: Loader) -> None:
    plain, dec = pair(write_module, MODELS, fresh=True)
    check(plain, dec, "BatchNorm(3)", [("__call__", (X3,)), ("__call__", (X3 * 2,))])
    check(plain, dec, "BatchNorm(3).eval()", [("__call__", (X3,))])


def test_batchnorm_eval_switched_eagerly_between_jitted_calls(write_module: Loader) -> None:
    plain, dec = pair(write_module, MODELS, fresh=True)
    ref, model = plain.BatchNorm(3), dec.BatchNorm(3)
    step = staged(lambda f, s, x: f(s, x))
    for switch in (False, True):
        if switch:
            ref.eval()
            model.eval()
        f, states = model.functionalize()
        out, states = step(f, states, X3)
        assert_same(ref(X3), out, f"eval={switch}")
        model = autostate.freeze(f, states)
        assert_same(snapshot(ref), snapshot(model), f"frozen eval={switch}")


def test_kv_cache_with_integer_position(write_module: Loader) -> None:
    plain, dec = pair(write_module, MODELS, fresh=True)
    calls = [("__call__", (jnp.full(2, float(i)), jnp.full(2, 1.0 + i))) for i in range(3)]
    check(plain, dec, "KVCache(4, 2)", calls)


def test_eval_switched_eagerly_between_calls(write_module: Loader) -> None:
    plain, dec = pair(write_module, TORCH)
    check(plain, dec, "Mode()", [("__call__", (X1,)), ("set_eval", ()), ("__call__", (X2,))],
          modes=("eager",))


def test_python_int_step_counter_eagerly_and_refused_in_f(write_module: Loader) -> None:
    plain, dec = pair(write_module, TORCH)
    check(plain, dec, "PyCounter()", [("__call__", (X1,))] * 3, modes=("eager",))
    f, states = dec.PyCounter().functionalize()
    for call in modes_of(f, "__call__"):
        with pytest.raises(StaticStateError, match="static state 'step'") as info:
            call(states, X1)
        assert f"{dec.__file__}:" in str(info.value)


def test_mode_flag_toggled_and_restored_inside_f_is_a_static_state_error(
    write_module: Loader,
) -> None:
    """Plain Python restores the flag before the call returns; a functionalized call may
    not assign a static state another value even for a moment (documented)."""
    plain, dec = pair(write_module, TORCH)
    check(plain, dec, "Mode()", [("predict_in_eval", (X1,))] * 2, modes=("eager",))
    f, states = dec.Mode().functionalize()
    for call in modes_of(f, "predict_in_eval"):
        with pytest.raises(StaticStateError, match="static state 'training'") as info:
            call(states, X1)
        assert f"{dec.__file__}:" in str(info.value)


@pytest.mark.parametrize("modes", [("eager",), ("f",)])
def test_cache_reset_to_none_then_rebuilt(write_module: Loader, modes: tuple[str, ...]) -> None:
    plain, dec = pair(write_module, TORCH)
    check(plain, dec, "ResetCache()",
          [("__call__", (X1,)), ("reset", ()), ("__call__", (X2,)), ("__call__", (X1,))],
          modes=modes)


def test_cache_reset_to_none_between_jitted_calls(write_module: Loader) -> None:
    plain, dec = pair(write_module, TORCH)
    ref = plain.ResetCache()
    f, states = dec.ResetCache().functionalize()
    step = staged(lambda f, s, x: f(s, x))
    for x in (X1, X2):
        out, states = step(f, states, x)
        assert_same(ref(x), out)
    ref.reset()
    _, states = staged(f.reset)(states)
    assert states["cache"] is None
    for x in (X1, X2):
        out, states = step(f, states, x)
        assert_same(ref(x), out)
    assert_same(ref.cache, states["cache"])


def source_line_of(err: BaseException) -> str:
    """The source text at the ``file:line`` an autostate message names."""
    import linecache
    import re

    match = re.search(r"at (\S+\.py):(\d+)", str(err))
    assert match, f"no user file:line in: {err}"
    return linecache.getline(match.group(1), int(match.group(2)))


@pytest.mark.parametrize("base_decorated", [True, False])
def test_train_eval_recursing_over_children(write_module: Loader, base_decorated: bool) -> None:
    plain, dec = library(write_module, base_decorated)
    template, model, n_out = build_pair(plain, dec, "multihead")
    data = data_for(n_out, 4)
    template.trunk.body.mods[3].rate = model.trunk.body.mods[3].rate = 0.5
    assert_same(template(data[0][0]), model(data[0][0]), "train mode")
    assert template.eval() is template
    assert model.eval() is model
    assert all(m.training is False for m in model.modules())
    f, states = model.functionalize()
    step = staged(lambda f, s, x: f(s, x))
    for x, _ in data[1:3]:
        out, new_states = step(f, states, x)
        assert_same(template(x), out, "eval mode through f")
        assert_same(read_plain(template, states), new_states, "eval mode states")
        for k in states:
            if k.endswith((".mean", ".var", ".count", ".key")):
                assert_same(states[k], new_states[k], f"eval mode keeps {k}")
        states = new_states
    model = autostate.freeze(f, states)
    assert_same(snapshot(template), snapshot(model))
    assert all(m.training is False for m in model.modules())
    template.train()
    model.train()
    f, states = model.functionalize()
    x = data[3][0]
    out, states = step(f, states, x)
    assert_same(template(x), out, "back in train mode")
    assert_same(read_plain(template, states), states)


def test_eval_called_through_f_is_the_documented_static_state_error(write_module: Loader) -> None:
    plain, dec = library(write_module)
    template, model, _ = build_pair(plain, dec, "mlp_dropout")
    f, states = model.functionalize()
    for call in (f.eval, staged(f.eval)):
        with pytest.raises(StaticStateError) as err:
            call(states)
        assert "self.training = mode" in source_line_of(err.value)
        assert "functionalize" in str(err.value)
    assert all(m.training is True for m in model.modules())
    out, _ = f(states, data_for(2, 1)[0][0])
    assert_same(template(data_for(2, 1)[0][0]), out)


def named_line(err: BaseException) -> tuple[str, str]:
    """The ``file`` and the text of the line an error message names."""
    found = re.search(r"  at (\S+?):(\d+)", str(err))
    assert found, f"no file:line in: {err}"
    path, number = found.group(1), int(found.group(2))
    return path, Path(path).read_text().splitlines()[number - 1]


def assert_at(err: BaseException, marker: str) -> None:
    """The error names a line of the test's module holding ``marker``."""
    path, text = named_line(err)
    assert "autostate_testmod" in path, f"not the user's file: {path}"
    assert_user_line(err, path)
    assert marker in text, f"{marker!r} is not on the line the error names: {text!r}"


def test_python_int_class_attribute_state_is_static_in_f(write_module: Loader) -> None:
    plain, dec = pair(write_module, CLASS_ATTRS)
    f, states = dec.ClassAttrs().functionalize()
    with raises_autostate(StaticStateError) as info:
        staged(lambda f, s: f.count(s))(f, states)
    assert_at(info.value, "# HERE")


def test_static_state_in_a_tab_indented_method_names_its_line(write_module: Loader) -> None:
    plain, dec = pair(write_module, RUNTIME)
    f, states = dec.Tabs().functionalize()
    with raises_autostate(StaticStateError) as info:
        staged(lambda f, s: f.eval(s))(f, states)
    assert_at(info.value, "# STATIC")


PYINSIDE = """
class Mode(enum.Enum):
    A = 1
    B = 2


@DECORATE
class Shaped:
    def __init__(self):
        self.shape = (2,)
        self.w = jnp.ones(())

    def __call__(self, x):
        return jnp.zeros(self.shape) + x * self.w

    def grow(self):
        self.shape = (self.shape[0] + 1,)


@DECORATE
class Tagged:
    def __init__(self):
        self.cfg = {"m": jnp.zeros(2), "name": "relu"}

    def __call__(self, x):
        self.cfg = {"m": self.cfg["m"] + x, "name": self.cfg["name"]}
        return self.cfg["m"] * (2.0 if self.cfg["name"] == "relu" else 3.0)


@DECORATE
class Moded:
    def __init__(self):
        self.both = (Mode.A, jnp.zeros(()))

    def __call__(self, x):
        self.both = (self.both[0], self.both[1] + x)
        return self.both[1] * (2.0 if self.both[0] is Mode.A else 3.0)
"""


def test_tuple_of_ints_state_eagerly_and_through_f(write_module: Loader) -> None:
    plain, dec = pair(write_module, "import enum\n" + PYINSIDE)
    lifecycle(
        plain,
        dec,
        "Shaped()",
        [
            ("eager", [("grow", ()), ("__call__", (X1,))]),
            ("f", [("grow", ()), ("__call__", (X2,))]),
        ],
    )


def test_tuple_of_ints_state_under_jit(write_module: Loader) -> None:
    plain, dec = pair(write_module, "import enum\n" + PYINSIDE)
    lifecycle(plain, dec, "Shaped()", [("eager", [("grow", ())]), ("jit", [("__call__", (X1,))])])


def test_tuple_of_ints_state_written_under_jit_keeps_python_ints(write_module: Loader) -> None:
    plain, dec = pair(write_module, "import enum\n" + PYINSIDE)
    ref = plain.Shaped()
    ref.grow()
    f, states = dec.Shaped().functionalize()
    _, states = staged(f.grow)(states)
    frozen = autostate.freeze(f, states)
    assert_typed(attrs(ref), attrs(frozen), "frozen after a jitted grow")


def test_str_inside_a_dict_state_under_jit(write_module: Loader) -> None:
    plain, dec = pair(write_module, "import enum\n" + PYINSIDE)
    lifecycle(plain, dec, "Tagged()", [("jit", [("__call__", (X1,)), ("__call__", (X2,))])])


def test_str_inside_a_dict_state_eagerly_and_through_f(write_module: Loader) -> None:
    plain, dec = pair(write_module, "import enum\n" + PYINSIDE)
    lifecycle(
        plain, dec, "Tagged()", [("eager", [("__call__", (X1,))]), ("f", [("__call__", (X2,))])]
    )


def test_enum_inside_a_tuple_state_under_jit(write_module: Loader) -> None:
    plain, dec = pair(write_module, "import enum\n" + PYINSIDE)
    lifecycle(plain, dec, "Moded()", [("jit", [("__call__", (X1,))])])


def _static_pair(write_module: Loader) -> tuple[types.ModuleType, types.ModuleType]:
    return pair(write_module, "import enum\n" + STATIC)


def test_instances_with_different_static_configs_in_one_jitted_function(
    write_module: Loader,
) -> None:
    plain, dec = _static_pair(write_module)
    check(plain, dec, "Stack()", [("__call__", (jnp.array([0.5, -1.0]),))] * 3)
    lifecycle(
        plain,
        dec,
        "Stack()",
        [
            ("jit", [("__call__", (jnp.array([0.5, -1.0]),))] * 2),
            ("eager", [("__call__", (jnp.array([1.0, 1.0]),))]),
            ("jit", [("__call__", (jnp.array([0.25, 2.0]),))]),
        ],
    )


def test_static_changes_eagerly_retrace_once_per_structure(write_module: Loader) -> None:
    """Changing a static state eagerly is a new structure (one trace per value);
    going back to a value seen before, or functionalizing / freezing again, is not."""
    plain, dec = _static_pair(write_module)
    step, traces = jit_counted(lambda f, s, x: f(s, x))
    ref, model = plain.Block(), dec.Block()
    x = jnp.array([0.5, -1.0])
    script = [
        ("eval", (), 2),
        ("train", (), 2),
        ("eval", (), 2),
        ("train", (), 2),
        ("set_mode", ("B",), 3),
        ("set_mode", ("A",), 3),
        ("bump", (), 4),
        # `cache` starts as the placeholder None, a state (`states["cache"] is None`):
        # an array is one more structure; None again is the one seen before.
        ("remember", (jnp.ones(2),), 5),
        ("forget", (), 5),
        ("remember", (jnp.zeros(2),), 5),
        ("forget", (), 5),
    ]
    f, states = model.functionalize()
    out, states = step(f, states, x)
    assert_typed(ref(x), out, "first call")
    model = autostate.freeze(f, states)
    for name, args, expected_traces in script:
        getattr(ref, name)(*[getattr(plain.Mode, a) if isinstance(a, str) else a for a in args])
        getattr(model, name)(*[getattr(dec.Mode, a) if isinstance(a, str) else a for a in args])
        f, states = model.functionalize()
        out, states = step(f, states, x)
        assert_typed(ref(x), out, f"after {name}{args}")
        assert len(traces) == expected_traces, (name, args, len(traces), expected_traces)
        model = autostate.freeze(f, states)
    assert_typed(attrs(ref), attrs(model), "attributes")


ARRAY_TO_INT = """
@DECORATE
class Steps:
    def __init__(self):
        self.n = jnp.zeros((), jnp.int32)

    def step(self, x):
        self.n = self.n + 1
        return x * self.n

    def reset(self):
        self.n = 0

    def scaled(self, x):
        return x if self.n == 0 else x * self.n
"""


def test_array_state_reset_to_a_python_int_eagerly(write_module: Loader) -> None:
    plain, dec = pair(write_module, ARRAY_TO_INT)
    lifecycle(
        plain,
        dec,
        "Steps()",
        [
            ("jit", [("step", (X1,))]),
            ("eager", [("reset", ()), ("scaled", (X1,)), ("step", (X1,)), ("reset", ())]),
        ],
    )


@pytest.mark.xfail(
    strict=True,
    raises=jax.errors.TracerBoolConversionError,
    reason="BUG: an array state set to a Python int eagerly (`self.n = 0` in reset()) stays "
    "a leaf of `states` (`{'n': 0}`) instead of becoming static as an int state is (docs: "
    "a state holding a Python int is static), so `if self.n == 0:` in the jitted f raises "
    "JAX's TracerBoolConversionError; plain Python runs",
)
def test_array_state_reset_to_a_python_int_is_static_under_jit(write_module: Loader) -> None:
    plain, dec = pair(write_module, ARRAY_TO_INT)
    lifecycle(
        plain,
        dec,
        "Steps()",
        [
            ("eager", [("step", (X1,)), ("reset", ())]),
            ("jit", [("scaled", (X1,))]),
        ],
    )


def test_int_state_from_init_is_static_and_a_traced_increment_names_the_line(
    write_module: Loader,
) -> None:
    source = ARRAY_TO_INT.replace("self.n = jnp.zeros((), jnp.int32)", "self.n = 0")
    plain, dec = pair(write_module, source)
    lifecycle(plain, dec, "Steps()", [("eager", [("step", (X1,))]), ("jit", [("scaled", (X2,))])])
    f, states = dec.Steps().functionalize()
    assert "n" not in states
    with pytest.raises(StaticStateError, match="'n'") as info:
        staged(f.step)(states, X1)
    assert_user_line(info.value, dec.__file__)
    assert "Tracer" not in str(info.value)


def test_one_shot_hook_inside_jit_is_refused(write_module: Loader) -> None:
    """Removing the hook inside a traced call changes the model outside its states:
    the documented StateAccessError naming ``hooks``."""
    _, dec = pair(write_module, ONE_SHOT)
    model = dec.with_hooks(dec.Layer(), dec.one_shot)
    f, states = model.functionalize()
    with pytest.raises(StateAccessError, match="hooks") as info:
        staged(lambda f, s, x: f(s, x))(f, states, X1)
    assert_user_line(info.value, __file__)
    assert len(model.hooks) == 1


def test_one_shot_hook_in_eager_f_runs_once_as_in_python(write_module: Loader) -> None:
    """Decided: an eager call of f changes a list f's model holds outside its
    states as plain Python changes the model's (docs/rewrite_rules.md); the
    caller's states are never changed, and jit refuses the change (above)."""
    plain, dec = pair(write_module, ONE_SHOT)
    ref = plain.with_hooks(plain.Layer(), plain.one_shot)
    expected = [ref(X1), ref(X1)]
    f, states = dec.with_hooks(dec.Layer(), dec.one_shot).functionalize()
    before = dict(states)
    out1, new1 = f(states, X1)
    out2, _ = f(new1, X1)
    assert_same(expected, [out1, out2], "outputs")
    assert_same(before, states, "the caller's states")
    assert len(f.model.hooks) == 0 and len(ref.hooks) == 0


def assert_line_is(err: BaseException, module: types.ModuleType, text: str) -> None:
    """The error names ``module``'s file at a line whose source contains ``text``."""
    assert_user_line(err, module.__file__)
    m = re.search(re.escape(module.__file__) + r":(\d+)", str(err))
    assert m, str(err)
    line = Path(module.__file__).read_text().splitlines()[int(m.group(1)) - 1]
    assert text in line, f"{line!r} is not the line of {text!r}: {err}"


def test_a_subclass_turning_an_array_state_into_a_python_int(write_module: Loader) -> None:
    """Eagerly the int step counts as in plain Python; it is a static state,
    so a functionalized call that counts it is the documented
    ``StaticStateError`` naming the base's line that assigns it."""
    plain, dec = pair(write_module, SHAPES)
    calls = [("__call__", (X1,)), ("__call__", (X2,)), ("__call__", (X2,))]
    check(plain, dec, "IntStepper()", calls, modes=("eager",))
    names, _, _ = keys_of(dec, "IntStepper()")
    assert names == ["total"]
    f, states = dec.IntStepper().functionalize()
    with pytest.raises(StaticStateError) as info:
        f(states, X1)
    assert_line_is(info.value, dec, "self.step = self.step + 1")
    with pytest.raises(StaticStateError) as info:
        staged(lambda f, s, x: f(s, x))(f, states, X1)
    assert_line_is(info.value, dec, "self.step = self.step + 1")


def test_post_init_python_int_counter_eagerly(write_module: Loader) -> None:
    plain, dec = pair(write_module, DATACLASSES)
    check(
        plain, dec, "Posted()", [("bump", ()), ("bump", ()), ("__call__", (X1,))], modes=("eager",)
    )


def test_cnn_eval_after_training_uses_running_stats(write_module: Loader) -> None:
    ref, _, f, s, p = cnn(write_module)
    f, s, p, _, _ = train_both(f, s, p, range(3))
    trained = autostate.freeze(f, s)
    trained.eval()
    assert trained.bn.training is False
    fe, se = trained.functionalize()
    x, _ = images(9)
    want, want_s = ref_cnn(p, dict(s), x, False)
    out, s2 = jitted("__call__")(fe, se, x)
    assert_same(want, out, "jitted eval")
    assert_bits(dict(s), dict(s2), "eval leaves the states alone")
    assert_same(want, trained(x), "eager eval")
    # the plain class holding the trained values, run eagerly
    for k, v in {**p, **dict(s)}.items():
        exec(f"m.{k} = v", {"m": ref, "v": v})  # noqa: S102
    ref.eval()
    assert_same(want, ref(x), "plain eval")


def test_cnn_train_eval_train_switches_continue_like_hand_threaded(write_module: Loader) -> None:
    _, model, f, s, p = cnn(write_module)
    f, s, p, o, ro = train_both(f, s, p, range(2))
    m = autostate.freeze(f, s)
    m.eval()
    fe, se = m.functionalize()
    x, _ = images(7)
    out, se = jitted("__call__")(fe, se, x)
    assert_same(ref_cnn(p, dict(s), x, False)[0], out)
    m.train()
    f2, s2 = m.functionalize()
    assert jax.tree_util.tree_structure(f2) == jax.tree_util.tree_structure(f)
    train_both(f2, s2, p, range(2, 4), o=o, ro=ro)


def test_cnn_eval_mode_is_a_new_structure_of_f(write_module: Loader) -> None:
    _, model, f, s, _ = cnn(write_module)
    model.eval()
    fe, _ = model.functionalize()
    assert jax.tree_util.tree_structure(fe) != jax.tree_util.tree_structure(f)
    traces = []

    @staged
    def run(f: Any, s: Any, x: Any) -> Any:
        traces.append(1)
        return f(s, x)

    x, _ = images(0)
    run(f, s, x)
    run(fe, s, x)
    run(f, s, x)
    run(fe, s, x)
    assert len(traces) == 2


def test_eval_toggled_eagerly_between_calls(write_module: Loader) -> None:
    plain, dec = pair(write_module, TORCH_MODULES)
    calls = [("__call__", (V2,)), ("set_eval", ()), ("__call__", (V2,))]
    check(plain, dec, "Net()", calls, modes=("eager",))
    model = dec.Net()
    model.eval()
    f, states = model.functionalize()
    with pytest.raises(StaticStateError) as err:
        f.train(states)
    assert "self.training = mode" in error_line(err.value)


def test_for_self_i_in_range_python_int_eagerly(write_module: Loader) -> None:
    plain, dec = pair(write_module, ASSIGN)
    check(plain, dec, "A()", [("for_range", ()), ("for_range", ())], modes=("eager",))


def test_for_self_i_in_range_inside_f_is_a_static_state_error(write_module: Loader) -> None:
    _, dec = pair(write_module, ASSIGN)
    f, states = dec.A().functionalize()
    with pytest.raises(autostate.errors.StaticStateError) as err:
        f.for_range(states)
    assert_user_line(err.value, ".py")


@pytest.mark.xfail(strict=True, reason="BUG: an eager f call mutating a plain sub-object "
                   "(self.cfg.lr *= 0.5) changes the eager model too: f.model.cfg is model.cfg (a list is copied)")
def test_eager_f_on_a_plain_sub_object_leaves_the_model_alone(write_module: Loader) -> None:
    _, dec = pair(write_module, PLAIN_SUB)
    model = dec.Opt()
    f, states = model.functionalize()
    out, states = f.decay(states, X1)
    assert f.model.cfg.lr == 0.5
    assert model.cfg.lr == 1.0, "the eager model changed"


def shared_paths(write_module: Loader) -> tuple[types.ModuleType, types.ModuleType]:
    return pair(write_module, SHARED_PATHS)


def test_static_mode_set_through_one_path_is_seen_through_the_other(write_module: Loader) -> None:
    plain, dec = shared_paths(write_module)
    check(plain, dec, "Modes()", [("__call__", (ONE,)), ("eval", ()), ("__call__", (ONE,))],
          modes=("eager",))
    p, m = plain.Modes(), dec.Modes()
    p.eval()
    m.eval()
    assert m.a.mode == "eval" and m.a is m.b
    f, states = m.functionalize()
    out, _ = staged(f)(states, ONE)
    assert_same(p(ONE), out)
    frozen = autostate.freeze(f, states)
    assert frozen.a is frozen.b and frozen.a.mode == "eval" and frozen.c.mode == "train"
    assert frozen.c.kind == frozen.d.kind == "relu"


def test_static_mode_changed_inside_f_is_the_documented_error(write_module: Loader) -> None:
    _, dec = shared_paths(write_module)
    f, states = dec.Modes().functionalize()
    with raises_autostate(errors.StaticStateError) as err:
        f.eval(states)
    assert "a.mode" in str(err.value)
    assert_user_line(err.value, ".py")


def assert_here(err: BaseException) -> None:
    """The error names the user's file and the line marked ``# HERE``."""
    found = re.search(r"(\S+\.py):(\d+)", str(err))
    assert found, f"no user file:line in: {err}"
    line = Path(found[1]).read_text().splitlines()[int(found[2]) - 1]
    assert "# HERE" in line, f"{found[0]} is {line!r}, not the marked line"


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


@py312
def test_static_write_error_names_the_users_line(write_module: Loader) -> None:
    _, dec = pair(write_module, TRACEBACKS)
    f, states = dec.Tb().functionalize()
    with pytest.raises(autostate.AutostateError) as err:
        f.static_write(states, X1)
    assert_here(err.value)


ACTNORM = """
@DECORATE
class ActNormPy:
    def __init__(self, d):
        self.scale = jnp.ones(d)
        self.bias = jnp.zeros(d)
        self.initialized = False

    def __call__(self, x):
        if not self.initialized:
            self.bias = -x.mean(0)
            self.scale = 1.0 / (x.std(0) + 1e-6)
            self.initialized = True
        return (x + self.bias) * self.scale


@DECORATE
class ActNormArr:
    def __init__(self, d, use_cond=False):
        self.scale = jnp.ones(d)
        self.bias = jnp.zeros(d)
        self.initialized = jnp.array(False)
        self.use_cond = use_cond

    def _init(self, x):
        self.bias = -x.mean(0)
        self.scale = 1.0 / (x.std(0) + 1e-6)

    def __call__(self, x):
        if self.use_cond:
            lax.cond(self.initialized, lambda x: None, self._init, x)
        else:
            first = jnp.logical_not(self.initialized)
            self.bias = jnp.where(first, -x.mean(0), self.bias)
            self.scale = jnp.where(first, 1.0 / (x.std(0) + 1e-6), self.scale)
        self.initialized = jnp.array(True)
        return (x + self.bias) * self.scale


@DECORATE
class Flow:
    def __init__(self, d):
        self.norms = [ActNormArr(d), ActNormArr(d, use_cond=True)]
        self.w = jnp.eye(d) * 0.5 + 0.1

    def __call__(self, x):
        for n in self.norms:
            x = n(x) @ self.w
        return x
"""


XA = jnp.array([[1.0, 2.0, 0.0], [3.0, -2.0, 1.0], [2.0, 0.0, 5.0]])


def test_actnorm_python_flag_eager_like_plain(write_module: Loader) -> None:
    plain, dec = pair(write_module, ACTNORM)
    check(plain, dec, "ActNormPy(3)", [("__call__", (XA,)), ("__call__", (XA * 2,))],
          modes=("eager",))


def test_actnorm_python_flag_after_eager_init_through_f(write_module: Loader) -> None:
    plain, dec = pair(write_module, ACTNORM)
    ref, model = plain.ActNormPy(3), dec.ActNormPy(3)
    ref(XA)
    model(XA)
    f, states = model.functionalize()
    out, states = staged(lambda f, s, x: f(s, x))(f, states, XA * 2)
    assert_same(np.asarray(ref(XA * 2)), np.asarray(out))
    frozen = autostate.freeze(f, states)
    assert_same(snapshot(ref), snapshot(frozen))


@pytest.mark.parametrize("jit", [False, True])
def test_actnorm_python_flag_through_f_is_the_documented_error(write_module: Loader,
                                                              jit: bool) -> None:
    _, dec = pair(write_module, ACTNORM)
    f, states = dec.ActNormPy(3).functionalize()
    call = (lambda f, s, x: f(s, x))  # noqa: E731
    with pytest.raises(autostate.errors.StaticStateError) as err:
        (staged(call) if jit else call)(f, states, XA)
    assert "initialized" in str(err.value)
    assert_user_line(err.value, dec.__file__.rsplit("/", 1)[-1])


def test_actnorm_array_flag(write_module: Loader) -> None:
    """A data-dependent init behind an array flag (the flow holds a ``jnp.where`` one
    and a ``lax.cond`` one): every mode, and grad through the initialising call."""
    build = "Flow(3)"
    plain, dec = pair(write_module, ACTNORM)
    check(plain, dec, build, [("__call__", (XA,)), ("__call__", (XA * 2 + 1,)), ("__call__", (XA,))])
    check_transform(plain, dec, build, [("__call__", (X,)), ("__call__", (XA,))], XA, "grad")


def test_actnorm_array_flag_grad_after_init(write_module: Loader) -> None:
    _, dec = pair(write_module, ACTNORM)
    f, states = dec.ActNormArr(3).functionalize()
    _, states = f(states, XA)
    g = staged(jax.grad(lambda f: f(states, XA * 2)[0].sum()))(f)
    # after initialisation scale and bias are the states; a plain (x + b) * s has no params
    assert autostate.param_dict(g) == {}
    bias, scale = -XA.mean(0), 1.0 / (XA.std(0) + 1e-6)
    out, _ = f(states, XA * 2)
    assert_same(np.asarray((XA * 2 + bias) * scale), np.asarray(out))


V3 = jnp.arange(3.0)


ENUMS = """
import enum
class Mode(enum.Enum):
    TRAIN = enum.auto()
    EVAL = enum.auto()

class Pool(enum.IntEnum):
    MEAN = 0
    MAX = 1

class Opt(enum.Flag):
    NONE = 0
    CLIP = enum.auto()
    SCALE = enum.auto()

@DECORATE
class M:
    def __init__(self, pool=Pool.MEAN, opts=Opt.CLIP | Opt.SCALE):
        self.mode = Mode.TRAIN
        self.pool = pool
        self.opts = opts
        self.count = {Pool.MEAN: jnp.zeros((), jnp.int32), Pool.MAX: jnp.zeros((), jnp.int32)}
        self.stat = jnp.zeros(())
    def eval(self):
        self.mode = Mode.EVAL
    def train(self):
        self.mode = Mode.TRAIN
    def __call__(self, x):
        y = x.mean() if self.pool == Pool.MEAN else x.max()
        self.count[self.pool] += 1
        if Opt.CLIP in self.opts:
            y = jnp.clip(y, -1.0, 1.0)
        if self.opts & Opt.SCALE:
            y = y * 2
        if self.mode is Mode.TRAIN:
            self.stat = self.stat + y
        return y * (self.pool + 1)
"""


@pytest.mark.parametrize("build", ["M()", "M(Pool.MAX, Opt.NONE)", "M(Pool.MAX, Opt.SCALE)"])
def test_enum_intenum_flag_config(write_module: Loader, build: str) -> None:
    plain, dec = pair(write_module, ENUMS)
    run_case(plain, dec, build, [("__call__", (V3,)), ("__call__", (V3 - 1.5,))],
             extra=("__call__", (V3,)))


def test_static_enum_state_switched_by_eval(write_module: Loader) -> None:
    plain, dec = pair(write_module, ENUMS)
    calls = [("__call__", (V3,)), ("eval", ()), ("__call__", (V3,)), ("train", ()),
             ("__call__", (V3,))]
    run_case(plain, dec, "M()", calls, modes=("eager",))
    f, states = dec.M().functionalize()
    with pytest.raises(errors.StaticStateError) as info:
        f.eval(states)
    user_line(info.value, dec, "self.mode = Mode.EVAL")
    ref, model = plain.M(), dec.M()
    ref.eval()
    model.eval()
    f, states = model.functionalize()
    out, states = staged(lambda f, s, x: f(s, x))(f, states, V3)
    same(ref(V3), out, "jit in eval mode")
    same(snapshot(ref.count), snapshot(states["count"]), "count in eval mode")
    same(snapshot(ref.stat), snapshot(states["stat"]), "stat in eval mode")
    same(snapshot(ref), snapshot(autostate.freeze(f, states)), "frozen in eval mode")


def test_actnorm_python_flag_first_forward_eager(write_module: Loader) -> None:
    plain, dec = pair(write_module, NORMS)
    calls = [("__call__", (XA4,)), ("__call__", (XA4 * 2 + 1,)), ("__call__", (XA4,))]
    check(plain, dec, "ActNorm(3)", calls, modes=("eager",))
    check(plain, dec, "Glow(3, 2)", calls, modes=("eager",))


@pytest.mark.parametrize("build", ["ActNorm(3)", "Glow(3, 2)"])
def test_actnorm_python_flag_initialised_eagerly_then_f_jit_grad(write_module: Loader,
                                                                 build: str) -> None:
    plain, dec = pair(write_module, NORMS)
    ref, model = eval(build, vars(plain)), eval(build, vars(dec))  # noqa: S307
    assert_same(ref(XA4), model(XA4), "init call")
    f, states = model.functionalize()
    assert "initialized" not in " ".join(states)  # a static state: part of f's structure
    call = staged(lambda f, s, x: f(s, x))
    for x in (XA4 * 2, XA4 - 1):
        out, states = call(f, states, x)
        assert_same(ref(x), out, "jit outputs")
    assert_same(snapshot(ref), snapshot(autostate.freeze(f, states)), "frozen")
    # grad through the initialised flow wrt its input
    g_ref = jax.grad(lambda x: sum(jnp.sum(v) for v in jax.tree_util.tree_leaves(ref(x))))(XA4)
    g = jax.grad(lambda x: sum(jnp.sum(v) for v in
                               jax.tree_util.tree_leaves(f(states, x)[0])))(XA4)
    assert_same(g_ref, g, "grad")


@pytest.mark.parametrize("jit", [False, True])
def test_actnorm_python_flag_uninitialised_through_f_is_documented_error(
        write_module: Loader, jit: bool) -> None:
    _, dec = pair(write_module, NORMS)
    f, states = dec.Glow(3, 2).functionalize()
    call = (lambda f, s, x: f(s, x))  # noqa: E731
    with pytest.raises(autostate.errors.StaticStateError) as err:
        (staged(call) if jit else call)(f, states, XA4)
    assert "initialized" in str(err.value)
    assert_user_line(err.value, module_file_name(dec))


def test_spectral_norm_eval_mode_freezes_u(write_module: Loader) -> None:
    plain, dec = pair(write_module, NORMS)
    build = "SpectralNorm(1, 3, 4, n_power=2, loop=True)"
    ref, model = eval(build, vars(plain)), eval(build, vars(dec))  # noqa: S307
    for m in (ref, model):
        m(XA4)
        assert m.eval() is m
    f, states = model.functionalize()
    out, states2 = staged(lambda f, s, x: f(s, x))(f, states, XA4)
    assert_same(ref(XA4), out, "eval output")
    assert_same(np.asarray(ref.u), np.asarray(states2["u"]), "u unchanged in eval")
    model.train()
    ref.train()
    f, states = model.functionalize()
    out, states = staged(lambda f, s, x: f(s, x))(f, states, XA4)
    assert_same(ref(XA4), out, "train output")
    assert_same(np.asarray(ref.u), np.asarray(states["u"]), "u after train")


BN = """
@DECORATE
class BatchNorm:
    def __init__(self, d, momentum=0.1):
        self.gamma = jnp.ones(d)
        self.beta = jnp.zeros(d)
        self.running_mean = jnp.zeros(d)
        self.running_var = jnp.ones(d)
        self.num_batches_tracked = jnp.zeros((), jnp.int32)
        self.momentum = momentum
        self.training = True

    def train(self, mode=True):
        self.training = mode
        return self

    def eval(self):
        return self.train(False)

    def __call__(self, x):
        if self.training:
            mean, var = x.mean(0), x.var(0)
            n = x.shape[0]
            self.running_mean = (1 - self.momentum) * self.running_mean + self.momentum * mean
            self.running_var = ((1 - self.momentum) * self.running_var
                                + self.momentum * var * n / (n - 1))
            self.num_batches_tracked += 1
        else:
            mean, var = self.running_mean, self.running_var
        return (x - mean) / jnp.sqrt(var + 1e-5) * self.gamma + self.beta


@DECORATE
class Dropout:
    def __init__(self, seed, p=0.5):
        self.key = jax.random.PRNGKey(seed)
        self.p = p
        self.training = True

    def train(self, mode=True):
        self.training = mode
        return self

    def eval(self):
        return self.train(False)

    def __call__(self, x):
        if not self.training:
            return x
        self.key, sub = jax.random.split(self.key)
        keep = jax.random.bernoulli(sub, 1 - self.p, x.shape)
        return jnp.where(keep, x / (1 - self.p), 0.0)


@DECORATE
class Net:
    def __init__(self, d):
        self.training = True
        self.layers = [BatchNorm(d), Dropout(1), BatchNorm(d, momentum=0.3)]
        self.heads = {"a": BatchNorm(d), "b": Dropout(2, p=0.25)}
        self.w = jnp.eye(d) + 0.1

    def train(self, mode=True):
        self.training = mode
        for m in self.layers:
            m.train(mode)
        for m in self.heads.values():
            m.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x) @ self.w
        return {k: h(x) for k, h in self.heads.items()}

    def evaluate(self, x):
        was = self.training
        self.eval()
        out = self(x)
        self.train(was)
        return out
"""


def test_batchnorm_running_stats_train_mode(write_module: Loader) -> None:
    plain, dec = pair(write_module, BN)
    calls = [("__call__", (XA4,)), ("__call__", (XA4 * 2 - 1,)), ("__call__", (XA4,))]
    check(plain, dec, "BatchNorm(3)", calls)
    check_transform(plain, dec, "BatchNorm(3)", [("__call__", (X,)), ("__call__", (X,))], XA4,
                    "grad")


def test_eval_returns_self_and_propagates_to_list_and_dict(write_module: Loader) -> None:
    plain, dec = pair(write_module, BN)
    ref, model = plain.Net(3), dec.Net(3)
    for m in (ref, model):
        m(XA4)
        assert m.eval() is m
    assert_same(snapshot(ref), snapshot(model), "after eval()")
    assert model.layers[0].training is False and model.heads["a"].training is False
    assert model.heads["b"].training is False and model.layers[1].training is False
    f, states = model.functionalize()
    call = staged(lambda f, s, x: f(s, x))
    for x in (XA4 * 2, XA4 - 3):
        out, states2 = call(f, states, x)
        assert_same(ref(x), out, "eval outputs")
        assert_same(snapshot({k: plain_path(ref, k) for k in states}), snapshot(states2),
                    "eval leaves states unchanged")
        states = states2
    model.train()
    ref.train()
    f, states = model.functionalize()
    for x in (XA4 * 2, XA4 - 3):
        out, states = call(f, states, x)
        assert_same(ref(x), out, "train outputs")
    for k, v in states.items():
        assert_same(snapshot(plain_path(ref, k)), snapshot(v), k)


def test_net_train_mode_through_check(write_module: Loader) -> None:
    plain, dec = pair(write_module, BN)
    calls = [("__call__", (XA4,)), ("__call__", (XA4 * 2,))]
    check(plain, dec, "Net(3).eval()", calls)


def test_evaluate_toggling_mode_eager_like_plain(write_module: Loader) -> None:
    plain, dec = pair(write_module, BN)
    calls = [("__call__", (XA4,)), ("evaluate", (XA4 * 2,)), ("__call__", (XA4,))]
    check(plain, dec, "Net(3)", calls, modes=("eager",))


@pytest.mark.parametrize("jit", [False, True])
def test_evaluate_toggling_mode_through_f_is_documented_error(write_module: Loader,
                                                              jit: bool) -> None:
    _, dec = pair(write_module, BN)
    f, states = dec.Net(3).functionalize()
    call = (lambda f, s, x: f.evaluate(s, x))  # noqa: E731
    with pytest.raises(autostate.errors.StaticStateError) as err:
        (staged(call) if jit else call)(f, states, XA4)
    assert "training" in str(err.value)
    assert_user_line(err.value, module_file_name(dec))


@pytest.mark.parametrize("jit", [False, True])
def test_f_eval_on_train_model_is_documented_error(write_module: Loader, jit: bool) -> None:
    _, dec = pair(write_module, BN)
    f, states = dec.Net(3).functionalize()
    call = (lambda f, s: f.eval(s)[1])  # noqa: E731
    with pytest.raises(autostate.errors.StaticStateError) as err:
        (staged(call) if jit else call)(f, states)
    assert_user_line(err.value, module_file_name(dec))


def test_f_train_on_train_model_keeps_states(write_module: Loader) -> None:
    # assigning the value a static state already holds is no change: the states come back
    _, dec = pair(write_module, BN)
    f, states = dec.Net(3).functionalize()
    new = staged(lambda f, s: f.train(s)[1])(f, states)
    assert sorted(new) == sorted(states)
    for k in states:
        assert_same(snapshot(states[k]), snapshot(new[k]), k)


XT = jnp.array([[1.0, 2.0], [3.0, -1.0], [0.0, 5.0]])


@pytest.mark.parametrize("build", [
    "Net(2).eval().train()", "Net(2).apply(lambda m: setattr(m, 'training', False))"])
def test_torch_like_module_base_train_eval(write_module: Loader, build: str) -> None:
    plain, dec = pair(write_module, TORCHLIKE)
    calls = [("__call__", (XT,)), ("scan_calls", (jnp.stack([XT, XT * 2]),)), ("count", ()),
             ("all_buffers", ())]
    check(plain, dec, build, calls)


@pytest.mark.parametrize("jit", [False, True])
def test_torch_like_eval_through_f_is_documented_error(write_module: Loader, jit: bool) -> None:
    _, dec = pair(write_module, TORCHLIKE)
    f, states = dec.Net(2).functionalize()
    call = (lambda f, s: f.eval(s)[1])  # noqa: E731
    with pytest.raises(autostate.errors.StaticStateError) as err:
        (staged(call) if jit else call)(f, states)
    assert "training" in str(err.value)
    assert_user_line(err.value, module_file_name(dec))


def test_python_int_state_through_f_is_the_documented_error(write_module: Loader) -> None:
    _, dec = pair(write_module, """
@DECORATE
class Steps:
    def __init__(self):
        self.n = 0
        self.w = jnp.ones(2)

    def __call__(self, x):
        self.n += 1
        return x * self.w * self.n
""")
    model = dec.Steps()
    assert_same(np.ones(2), model(jnp.ones(2)), "eager")
    assert model.n == 1
    f, states = model.functionalize()
    assert dict(states) == {}
    with pytest.raises(autostate.errors.StaticStateError) as info:
        step_jit()(f, states, jnp.ones(2))
    assert_user_line(info.value, Path(dec.__file__).name)


# The QAT layers hold the observers as sub-models (min/max, per channel, moving
# average), which also covers each observer as the root; MinMaxObserver(3, ch_axis=1)
# as the root: test_observer_calculate_qparams_method_through_f.
@pytest.mark.parametrize(
    "build",
    [
        "TorchStyleMovingAverage()",
        "QATLinear(0, 3, 4)",
        "QATLinear(1, 3, 4, moving=True)",
    ],
)
def test_observers_track_and_fake_quantize(write_module: Loader, build: str) -> None:
    plain, dec = pair(write_module, QAT)
    calls = [("__call__", (XQ,)), ("__call__", (XQ * 2 - 1,)), ("__call__", (XQ * 0.5,))]
    modes = ("eager", "f") if "Torch" in build else ("eager", "f", "jit", "freeze")
    check(plain, dec, build, calls, modes=modes)


def test_observer_calculate_qparams_method_through_f(write_module: Loader) -> None:
    plain, dec = pair(write_module, QAT)
    calls = [("__call__", (XQ,)), ("calculate_qparams", ()), ("__call__", (XQ + 4,))]
    check(plain, dec, "MinMaxObserver(3, ch_axis=1)", calls)


@pytest.mark.parametrize("moving", [False, True])
def test_observers_disabled_after_calibration(write_module: Loader, moving: bool) -> None:
    plain, dec = pair(write_module, QAT)
    calls = [("__call__", (XQ * 3,)), ("__call__", (XQ - 2,))]
    check(plain, dec, f"frozen_qat(0, XQ, {moving})".replace("XQ", "jnp.ones((2, 3))"), calls)


def test_disable_fake_quant_and_reenable_observer_eagerly(write_module: Loader) -> None:
    plain, dec = pair(write_module, QAT)
    build = "MinMaxObserver(3, ch_axis=1).disable_fake_quant()"
    ref, model = eval(build, vars(plain)), eval(build, vars(dec))  # noqa: S307
    for m in (ref, model):
        outs = [m(XQ)]
        assert m.disable_observer() is m and m.observer_enabled is False
        outs.append(m(XQ * 9))
        m.enable_observer()
        outs.append(m(XQ * 2))
        m.outs = outs
    assert_same(snapshot(ref), snapshot(model), "eager toggles")
    model.disable_observer()
    ref.disable_observer()
    f, states = model.functionalize()
    out, states = staged_method_call(f, states, XQ * 7)
    assert_same(ref(XQ * 7), out, "jit with observer disabled")
    assert_same(snapshot(ref), snapshot(autostate.freeze(f, states)), "frozen")


@pytest.mark.parametrize("jit", [False, True])
def test_disable_observer_through_f_is_static_state_error(write_module: Loader, jit: bool) -> None:
    _, dec = pair(write_module, QAT)
    f, states = dec.QATLinear(0, 3, 4).functionalize()
    call = lambda f, s: f.freeze_observers(s)  # noqa: E731
    with pytest.raises(autostate.errors.StaticStateError) as err:
        (staged(call) if jit else call)(f, states)
    assert "observer_enabled" in str(err.value)
    assert_user_line(err.value, module_file_name(dec))


@pytest.mark.parametrize(
    "build",
    [
        "LoRALinear(0, 3, 3)",
        # (merged in the layers of a net, as merge() merges a layer; unmerged again
        # eagerly: test_lora_merge_unmerge_eagerly_same_outputs)
        "LoRANet(1, 3, 2).merge_all()",
    ],
)
def test_lora_merged_before_functionalize(write_module: Loader, build: str) -> None:
    plain, dec = pair(write_module, LORA)
    check(plain, dec, build, [("__call__", (XL,)), ("__call__", (XL * 3,))])


def test_lora_merge_unmerge_eagerly_same_outputs(write_module: Loader) -> None:
    plain, dec = pair(write_module, LORA)
    for mod in (plain, dec):
        m = mod.LoRANet(2, 3, 2)
        y0 = m(XL)
        assert m.merge_all() is m and m.layers[1].merged is True
        y1 = m(XL)
        m.merge_all()  # idempotent
        y2 = m(XL)
        m.unmerge_all()
        mod.result = (y0, y1, y2, m(XL), snapshot(m))
    assert_same(plain.result, dec.result, "merge / unmerge eagerly")
    np.testing.assert_allclose(dec.result[0], dec.result[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("jit", [False, True])
def test_lora_merge_through_f_is_static_state_error(write_module: Loader, jit: bool) -> None:
    _, dec = pair(write_module, LORA)
    f, states = dec.LoRANet(0, 3, 2).functionalize()
    call = lambda f, s: f.merge_all(s)  # noqa: E731
    with pytest.raises(autostate.errors.StaticStateError) as err:
        (staged(call) if jit else call)(f, states)
    assert "merged" in str(err.value)
    assert_user_line(err.value, module_file_name(dec))


def test_lora_merge_of_merged_model_through_f_is_noop(write_module: Loader) -> None:
    plain, dec = pair(write_module, LORA)
    check(plain, dec, "LoRANet(0, 3, 2).merge_all()", [("merge_all", ()), ("__call__", (XL,))][1:])
    f, states = dec.LoRANet(0, 3, 2).merge_all().functionalize()
    out, new = staged_method_call(f, states, method="merge_all")
    for k in states:
        assert_same(snapshot(states[k]), snapshot(new[k]), k)


def test_lora_array_flag_merge_inside_f(write_module: Loader) -> None:
    plain, dec = pair(write_module, LORA)
    calls = [
        ("__call__", (XL,)),
        ("merge", ()),
        ("__call__", (XL,)),
        ("merge", ()),
        ("__call__", (XL * 2,)),
        ("unmerge", ()),
        ("__call__", (XL,)),
    ]
    check(plain, dec, "LoRAArrayFlag(3, 3, 2)", calls)


@pytest.mark.parametrize("jit", [False, True])
def test_moe_python_int_dropped_counter_through_f(write_module: Loader, jit: bool) -> None:
    # dropped = 0 is a static Python int: adding an array to it inside f cannot be static
    _, dec = pair(write_module, MOE)
    f, states = dec.MoE(0, 3, py_init=True).functionalize()
    call = lambda f, s, x: f(s, x)  # noqa: E731
    with pytest.raises(autostate.errors.StaticStateError) as err:
        (staged(call) if jit else call)(f, states, XM)
    assert "dropped" in str(err.value)
    assert_user_line(err.value, module_file_name(dec))


def test_accum_python_int_k_eager(write_module: Loader) -> None:
    plain, dec = pair(write_module, ACCUM)
    calls = [("update", (g,)) for g in grads_of(plain, 7)]
    check(plain, dec, "AccumSGD(init_params(), 3)", calls, modes=("eager",))


@pytest.mark.parametrize("jit", [False, True])
def test_accum_python_int_k_through_f_is_static_state_error(
    write_module: Loader, jit: bool
) -> None:
    plain, dec = pair(write_module, ACCUM)
    f, states = dec.AccumSGD(dec.init_params(), 3).functionalize()
    call = lambda f, s, g: f.update(s, g)  # noqa: E731
    with pytest.raises(autostate.errors.StaticStateError) as err:
        (staged(call) if jit else call)(f, states, plain.grads_at(0))
    assert "'k'" in str(err.value) or "k" in str(err.value).split()
    assert_user_line(err.value, module_file_name(dec))


def test_last_hidden_none_init(write_module: Loader) -> None:
    # PyTorch's `self.last_hidden = None`: None is a placeholder, so the first write
    # means plain Python eagerly, through f and under jit (tests/test_static_state.py).
    plain, dec = pair(write_module, PROBE)
    calls = [("__call__", (XP,)), ("__call__", (XP * 2,))]
    check(plain, dec, "Probe(0, 3, 2, none_init=True)", calls)
    m = dec.Probe(0, 3, 2, none_init=True)
    m(XP)  # set eagerly first: then f works
    ref = plain.Probe(0, 3, 2, none_init=True)
    ref(XP)
    f, states = m.functionalize()
    out, states = staged_method_call(f, states, XP * 3)
    assert_same(ref(XP * 3), out, "after the eager first call")
    assert_same(snapshot(ref), snapshot(autostate.freeze(f, states)), "frozen")


def test_eval_then_train_toggle_between_jitted_steps(write_module: Loader) -> None:
    plain, dec = pair(write_module, RESET)
    ref, model = plain.Head(2, 3), dec.Head(2, 3)
    call = staged(lambda f, s, x: f(s, x))
    for mode, x in (("train", XP), ("eval", XP * 2), ("train", -XP), ("eval", XP)):
        getattr(ref, mode)()
        getattr(model, mode)()
        f, states = model.functionalize()
        out, states = call(f, states, x)
        model = autostate.freeze(f, states)
        assert_same(ref(x), out, f"{mode} output")
        assert_same(snapshot(ref), snapshot(model), f"{mode} attributes")


def test_lazy_weight_reset_to_none_eagerly_is_refilled_by_f(write_module: Loader) -> None:
    # After `model.reset()` the None is the value of an array state (it is in `states`),
    # which a call of f may fill again: the same numbers as plain Python.
    plain, dec = pair(write_module, LAZY)
    plain.X = dec.X = X23
    run_case(plain, dec, "reset_after(LazyLinear(0, 2), X)", [("__call__", (X23,)),
                                                              ("__call__", (X23 * 3,))])
    f, states = dec.reset_after(dec.LazyLinear(0, 2), X23).functionalize()
    assert states["w"] is None


def test_none_array_toggle(write_module: Loader) -> None:
    plain, dec = pair(write_module, GROW)
    calls = [
        ("__call__", (V2_SIGNED,)),
        ("clear", ()),
        ("__call__", (2 * V2_SIGNED,)),
        ("__call__", (V2_SIGNED,)),
        ("clear", ()),
    ]
    run_case(plain, dec, "Toggle()", calls)
    run_case(plain, dec, "cleared()", [("__call__", (V2_SIGNED,)), ("clear", ()), ("__call__", (V2_SIGNED,))])


STEPS = [("fit_step", batch(i)) for i in range(3)]


def torch(write_module: Loader) -> tuple[types.ModuleType, types.ModuleType]:
    return pair(write_module, TORCH_HEADER + TORCH_TRAINING)


def test_gradient_accumulation_with_grads_set_to_none(write_module: Loader) -> None:
    """``self.grads = None`` is a placeholder the gradients replace, inside f too
    (tests/test_static_state.py): plain Python in every mode."""
    plain, dec = torch(write_module)
    check(plain, dec, "AccumTrainer(True)", STEPS[:2], modes=("eager", "jit", "freeze"))


def test_static_class_default_inside_f(write_module: Loader) -> None:
    _, dec = pair(write_module, CLASS_DEFAULTS, fresh=True)
    f, states = dec.Mode().functionalize()
    assert states == {}
    with pytest.raises(autostate.errors.StaticStateError, match="static state 'training'"):
        f.eval(states)
    with pytest.raises(autostate.errors.StaticStateError, match="static state 'cache'"):
        f.remember(states, jnp.ones(2))
    model = dec.Mode()
    model.remember(jnp.ones(2))  # eagerly plain Python: None, then an array
    f, states = model.functionalize()
    assert list(states) == ["cache"]


# --- the one rule for changes outside states (DESIGN.md section 8) ------------------
# At an object boundary (autostate.jit, a jax.jit inside a method) a change of static
# config is written back as the plain call makes it, one trace per new mode; inside a
# traced body (a lax loop here) and in f it is refused at the user's line, with the fix.

_BOUNDARIES = """
@DECORATE
class Switch:
    def __init__(self):
        self.w = jnp.ones(3)
        self.training = True
        self.steps = jnp.zeros(())
        self.label = None  # a placeholder a call names

    def name_it(self, x):
        self.label = "eval"
        return x * self.w

    def inner_name(self, x):
        return jax.jit(self.name_it)(x)

    def switch_off(self, x):
        self.training = not self.training
        self.steps = self.steps + 1
        return x * self.w * (2.0 if self.training else 1.0)

    def inner_jit(self, x):
        return jax.jit(self.switch_off)(x)

    def in_scan(self, x):
        def body(c, _):
            return c + self.switch_off(x), None  # <- switched in a body
        return jax.lax.scan(body, x, None, length=2)[0]
"""


@pytest.mark.parametrize("boundary", ["autostate.jit", "jax.jit in a method",
                                      "jax.jit in a method under autostate.jit"])
def test_a_static_config_switched_at_an_object_boundary_is_written_back(
    write_module: Any, boundary: str
) -> None:
    dec = pair(write_module, _BOUNDARIES)[1]
    model = dec.Switch()
    x = jnp.ones(3)
    if boundary == "autostate.jit":
        call = autostate.jit(lambda m, x: m.switch_off(x))
    elif boundary == "jax.jit in a method":
        call = lambda m, x: m.inner_jit(x)  # noqa: E731
    else:
        call = autostate.jit(lambda m, x: m.inner_jit(x))
    outs = [call(model, x) for _ in range(3)]
    # The plain call flips the mode each time: False (x1), True (x2), False (x1).
    assert model.training is False and float(model.steps) == 3.0
    same([x, 2 * x, x], outs)
    no_tracer(model)


_METRICS = """
@DECORATE
class Metrics:
    def __init__(self):
        self.correct = 0  # a Python int, then an array: a count of a traced value
        self.done = False
        self.w = jnp.ones(3)

    def __call__(self, x):
        self.correct += (x > 0.5).sum()
        self.done = self.correct > 3
        return (x * self.w).sum()
"""


def test_a_static_state_given_a_traced_value_by_autostate_jit_becomes_an_array(
    write_module: Any,
) -> None:
    """``self.correct = 0`` then ``self.correct += (y == t).sum()``: eagerly an
    int becomes an array; a call compiled by autostate.jit writes the new
    structure back the same way, with one retrace for it."""
    plain, dec = pair(write_module, _METRICS)
    expected, model = plain.Metrics(), dec.Metrics()
    traces: list[int] = []

    def step(m: Any, x: Any) -> Any:
        traces.append(1)
        return m(x)

    call = autostate.jit(step)
    x = jnp.arange(3.0)
    for _ in range(3):
        same(expected(x), call(model, x))
        same((expected.correct, expected.done), (model.correct, model.done))
    assert isinstance(model.correct, jax.Array) and model.correct.dtype == jnp.int32
    assert len(traces) == 2  # the int's trace, then the array's
    no_tracer(model)


_COUNTED_INSIDE = """
@DECORATE
class CountedInside:
    def __init__(self):
        self.correct = 0  # a Python int
        self.seen = 0
        self.w = jnp.ones(3)

    def _count(self, x):
        self.seen += x.shape[0]  # another Python value: fine, as plain Python
        self.correct = self.correct + (x > 0.5).sum()  # <- a value of the trace
        return (x * self.w).sum()

    def in_jit(self, x):
        return jax.jit(self._count)(x)

    def in_grad(self, x):
        return jax.grad(self._count)(x)
"""


def test_a_static_state_given_a_traced_value_inside_a_jit_in_a_method(write_module: Any) -> None:
    """Inside a jax.jit in a method (run once per call) a static state takes
    another Python value, as plain Python's would, but a value of the jit's
    trace is refused as a static state's error, with the fix (it was the
    generic TracedEagerStateError, whose fix advised autostate.jit). Under
    jax.grad the write lands with its primal value, as documented."""
    dec = pair(write_module, _COUNTED_INSIDE)[1]
    model = dec.CountedInside()
    with pytest.raises(StaticStateError, match=r"CountedInside.correct \(a Python int") as err:
        model.in_jit(jnp.arange(3.0))
    assert "jnp.asarray(0)" in str(err.value)
    assert re.search(r"autostate_testmod_\d+\.py:\d+", str(err.value))  # the user's line
    assert model.correct == 0
    no_tracer(model)
    model.in_grad(jnp.arange(3.0))
    assert (int(model.correct), model.seen) == (2, 6)  # (the refused call counted 3 first)


_MODE_LATER = """
@DECORATE
class ModeLater:
    def __init__(self):
        self.mode = None  # a placeholder, given its first value by a call
        self.w = jnp.ones(2)

    def __call__(self, x):
        self.mode = "fast" if self.mode is None else self.mode + "!"
        return x * self.w * len(self.mode)
"""


def test_a_placeholder_given_a_python_value_by_autostate_jit_becomes_static(
    write_module: Any,
) -> None:
    """At an object boundary a placeholder None may become static, as eagerly
    (it raised the StaticStateError that belongs to f, whose fix is to assign
    it before functionalizing)."""
    plain, dec = pair(write_module, _MODE_LATER)
    expected, model = plain.ModeLater(), dec.ModeLater()
    call = autostate.jit(lambda m, x: m(x))
    x = jnp.ones(2)
    for _ in range(3):
        same(expected(x), call(model, x))
        assert model.mode == expected.mode
    f, states = model.functionalize()
    assert list(states) == []  # static now: structure, as eagerly
    f, states = dec.ModeLater().functionalize()  # inside f it stays refused, with its fix
    with pytest.raises(StaticStateError, match="placeholder None"):
        f(states, x)


_PRECISION = """
@DECORATE
class Precision:
    def __init__(self, dtype):
        self.w = jnp.full(2, 1.5, jnp.float32)
        self.compute_dtype = dtype  # a state: half() assigns it
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.calls += 1
        return x.astype(self.compute_dtype) * self.w.astype(self.compute_dtype)

    def half(self):
        self.compute_dtype = HALF
        return self
"""


@pytest.mark.parametrize(
    ("dtype", "half"),
    [("jnp.float32", "jnp.bfloat16"), ("jnp.dtype('float32')", "jnp.dtype('float16')"),
     ("np.float32", "np.float16")],
    ids=["jnp-scalar-type", "np.dtype", "numpy-type"],
)
def test_a_dtype_state_is_static_like_a_string(write_module: Any, dtype: str, half: str) -> None:
    """A dtype (or scalar type) held by a state is structure, as a string is: it
    was a leaf of the states dict, which `jax.jit(f)` refused with JAX's bare
    "Error interpreting argument ... as an abstract array"."""
    plain, dec = pair(write_module, _PRECISION.replace("HALF", half))
    x = jnp.ones(2) / 3
    for switched in (False, True):
        ref, model = plain.Precision(eval(dtype)), dec.Precision(eval(dtype))  # noqa: S307
        if switched:
            ref.half()
            model.half()
        expected = ref(x)
        f, states = model.functionalize()
        assert list(states) == ["calls"]
        out, states = staged(lambda f, s, x: f(s, x))(f, states, x)
        same(expected, out)
        same(expected, autostate.jit(lambda m, x: m(x))(model, x))
        assert autostate.freeze(f, states).compute_dtype == ref.compute_dtype
    # Switched inside f: refused as a string's change is, with the fix.
    f, states = dec.Precision(eval(dtype)).functionalize()  # noqa: S307
    with pytest.raises(StaticStateError, match="compute_dtype"):
        staged(lambda f, s: f.half(s))(f, states)
    # At an object boundary the switch is written back.
    model = dec.Precision(eval(dtype))  # noqa: S307
    autostate.jit(lambda m: m.half() and None)(model)
    assert model.compute_dtype == eval(half)  # noqa: S307


_ACTIVATION = """
def halved(x):
    return x / 2


@DECORATE
class Activation:
    def __init__(self, act):
        self.w = jnp.full(2, 1.5, jnp.float32)
        self.act = act  # a state: use() assigns it
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.calls += 1
        return self.act(x * self.w - 0.25)

    def use(self):
        self.act = OTHER
        return self

    def keep(self, x):
        self.act = lambda v: v * x  # a function over a value of the call
        return x.sum()
"""


@pytest.mark.parametrize(
    ("act", "other"),
    [("jax.nn.relu", "jax.nn.gelu"), ("jnp.tanh", "jax.nn.sigmoid"), ("halved", "jnp.exp")],
    ids=["custom_jvp", "jitted", "def"],
)
def test_a_function_state_is_static_like_a_string(write_module: Any, act: str, other: str) -> None:
    """A function held by a state (an activation a method switches) is
    structure, as a string is: it was a leaf of the states dict, which
    `jax.jit(f)` refused with JAX's bare "Error interpreting argument"."""
    plain, dec = pair(write_module, _ACTIVATION.replace("OTHER", other))
    x = jnp.arange(2.0) / 3
    for switched in (False, True):
        ref = plain.Activation(eval(act, vars(plain)))  # noqa: S307
        model = dec.Activation(eval(act, vars(dec)))  # noqa: S307
        if switched:
            ref.use()
            model.use()
        expected = ref(x)
        f, states = model.functionalize()
        assert list(states) == ["calls"]
        out, states = staged(lambda f, s, x: f(s, x))(f, states, x)
        same(expected, out)
        same(expected, autostate.jit(lambda m, x: m(x))(model, x))
    f, states = dec.Activation(eval(act, vars(dec))).functionalize()  # noqa: S307
    with pytest.raises(StaticStateError, match="'act'"):
        staged(lambda f, s: f.use(s))(f, states)
    # A function over a value of a compiled call is no structure: refused, model kept.
    model = dec.Activation(eval(act, vars(dec)))  # noqa: S307
    with pytest.raises(errors.StateAccessError, match="Activation.act a value that keeps"):
        autostate.jit(lambda m, x: m.keep(x))(model, x)
    assert model.act is eval(act, vars(dec))  # noqa: S307


@pytest.mark.parametrize("boundary", ["autostate.jit", "jax.jit in a method",
                                      "jax.jit in a method under autostate.jit"])
def test_a_static_config_given_to_a_placeholder_at_an_object_boundary_is_written_back(
    write_module: Any, boundary: str
) -> None:
    """``self.label = "eval"`` over the placeholder None: a static state, as the plain
    call makes it (it was refused as if in f); in f it stays refused."""
    dec = pair(write_module, _BOUNDARIES)[1]
    model, x = dec.Switch(), jnp.ones(3)
    call = {
        "autostate.jit": autostate.jit(lambda m, x: m.name_it(x)),
        "jax.jit in a method": lambda m, x: m.inner_name(x),
        "jax.jit in a method under autostate.jit": autostate.jit(lambda m, x: m.inner_name(x)),
    }[boundary]
    for _ in range(2):
        same(x, call(model, x))
        assert model.label == "eval"
    f, states = model.functionalize()
    assert "label" not in states and autostate.freeze(f, states).label == "eval"
    no_tracer(model)
    f, states = dec.Switch().functionalize()
    with pytest.raises(StaticStateError, match="placeholder None"):
        f.name_it(states, x)


@pytest.mark.parametrize(("name", "mode"), [
    *[("in_scan", mode) for mode in ("eager", "autostate.jit", "f", "jax.jit(f)")],
    ("switch_off", "f"), ("switch_off", "jax.jit(f)"), ("inner_jit", "f"),
])
def test_a_static_config_switched_in_a_traced_body_or_in_f_is_refused_at_the_line(
    write_module: Any, name: str, mode: str
) -> None:
    dec = pair(write_module, _BOUNDARIES)[1]
    model = dec.Switch()
    with pytest.raises(StaticStateError) as err:
        if mode == "eager":
            getattr(model, name)(jnp.ones(3))
        elif mode == "autostate.jit":
            autostate.jit(lambda m, x: getattr(m, name)(x))(model, jnp.ones(3))
        else:
            f, states = model.functionalize()
            call = getattr(f, name)
            (jax.jit(call) if mode == "jax.jit(f)" else call)(states, jnp.ones(3))
    assert "training" in str(err.value) and "fix:" in str(err.value)
    assert model.training is True and float(model.steps) == 0.0


_STRUCTURE = """
@DECORATE
class Leaf:
    def __init__(self, k):
        self.w = jnp.ones(3) * k
        self.n = jnp.zeros(())

    def __call__(self, x):
        self.n = self.n + 1
        return x * self.w


@DECORATE
class Holder:
    def __init__(self, leaf):
        self.leaf = leaf


@DECORATE
class Picker:
    def __init__(self):
        self.layers = [Leaf(1.0), Leaf(2.0)]
        self.b = self.layers[1]
        self.other = Holder(self.b)  # a sub-model two parents hold
        self.tied = Leaf(3.0)
        self.tied.w = self.b.w  # one array, two attributes
        self.cur = None  # a placeholder the calls fill with a sub-model

    def pick(self, x):
        self.cur = self.b
        return self.cur(x) + self.tied(x)

    def walk(self, x):
        for self.cur in self.layers:
            x = self.cur(x)
        return x

    def drop(self, x):
        self.cur = None
        return x * self.b.w

    def build(self, x):
        self.cur = Leaf(5.0)  # <- built in the call
        return self.cur(x)

    def rebind(self, x):
        self.cur = self.b
        self.cur = None
        self.cur = x * 2  # a new state, given a value of the call
        return x

    def in_scan(self, x):
        def body(c, _):
            self.cur = self.b  # <- swapped in a body
            return c + self.cur(x), None
        return jax.lax.scan(body, x, None, length=2)[0]

    def inner_jit(self, name, x):
        return jax.jit(getattr(self, name))(x)
"""


def _structure_seen(model: Any) -> tuple:
    """Which sub-model ``cur`` is, the sharing kept, and every leaf's count."""
    assert model.b is model.layers[1] and model.other.leaf is model.b, "shared sub-model"
    assert model.tied.w is model.b.w, "tied array"
    where = {id(model.b): "b", id(model.layers[0]): "layers[0]", id(None): "None"}
    counts = [float(leaf.n) for leaf in (*model.layers, model.tied)]
    return where.get(id(model.cur), type(model.cur).__name__), counts


@pytest.mark.parametrize("boundary", ["autostate.jit", "jax.jit in a method",
                                      "jax.jit in a method under autostate.jit"])
def test_a_submodel_assigned_at_an_object_boundary_is_written_back(
    write_module: Any, boundary: str
) -> None:
    """``self.cur = self.b`` and ``for self.cur in self.layers`` (over a None
    placeholder, then over a sub-model, then back to None) leave the model as
    the plain call does: the same sub-model, shared ones and tied arrays kept,
    the states right for the next compiled and eager calls."""
    plain_mod, dec = pair(write_module, _STRUCTURE)
    plain, model = plain_mod.Picker(), dec.Picker()
    x = jnp.arange(3.0)
    compiled = autostate.jit(lambda m, name, x: getattr(m, name)(x), static_argnums=1)
    inner = autostate.jit(lambda m, name, x: m.inner_jit(name, x), static_argnums=1)
    for name in ["pick", "walk", "drop", "walk", "pick", "pick", "drop"]:
        expected = getattr(plain, name)(x)
        if boundary == "autostate.jit":
            got = compiled(model, name, x)
        elif boundary == "jax.jit in a method":
            got = model.inner_jit(name, x)
        else:
            got = inner(model, name, x)
        same(expected, got, name)
        assert _structure_seen(model) == _structure_seen(plain), name
    for name in ["walk", "pick"]:  # eagerly after the compiled calls
        same(getattr(plain, name)(x), getattr(model, name)(x), f"eager {name}")
        assert _structure_seen(model) == _structure_seen(plain), f"eager {name}"
    no_tracer(model)


def test_a_submodel_built_in_a_call_at_an_object_boundary(write_module: Any) -> None:
    """autostate.jit writes back a sub-model built inside (its arrays are outputs
    of the program); a jax.jit inside a method runs on the model itself, so a
    sub-model built there would keep its tracers: refused at the line, put back."""
    dec = pair(write_module, _STRUCTURE)[1]
    model, x = dec.Picker(), jnp.arange(3.0)
    same(5.0 * x, autostate.jit(lambda m, x: m.build(x))(model, x))
    assert type(model.cur).__name__ == "Leaf" and float(model.cur.n) == 1.0
    same(jnp.full(3, 5.0), model.cur.w)
    same(5.0 * x, model.cur(x))
    model = dec.Picker()
    with pytest.raises(StateAccessError) as err:
        model.inner_jit("build", x)
    user_line(err.value, dec, "<- built in the call")
    assert "inside a jax.jit inside a method" in str(err.value)
    assert model.cur is None
    no_tracer(model)
    # Over the sub-model, a value of the jax.jit's trace would stay: refused, put back.
    with pytest.raises(StateAccessError, match="assigned a traced value") as err:
        model.inner_jit("rebind", x)
    user_line(err.value, dec, "return jax.jit(getattr(self, name))(x)")
    assert model.cur is None
    no_tracer(model)
    autostate.jit(lambda m, x: m.rebind(x))(model, x)  # plain Python there
    same(2 * x, model.cur)


@pytest.mark.parametrize("mode", ["eager", "autostate.jit", "f", "jax.jit(f)", "f inner_jit"])
def test_a_submodel_assigned_in_a_traced_body_or_in_f_is_refused_at_the_line(
    write_module: Any, mode: str
) -> None:
    dec = pair(write_module, _STRUCTURE)[1]
    model, x = dec.Picker(), jnp.arange(3.0)
    with pytest.raises(StateAccessError) as err:
        if mode == "eager":
            model.in_scan(x)
        elif mode == "autostate.jit":
            autostate.jit(lambda m, x: m.in_scan(x))(model, x)
        else:
            f, states = model.functionalize()
            if mode == "f inner_jit":
                f.inner_jit(states, "pick", x)
            else:
                (jax.jit(f.pick) if mode == "jax.jit(f)" else f.pick)(states, x)
    if mode in ("eager", "autostate.jit"):
        user_line(err.value, dec, "<- swapped in a body")
        assert "lax.scan" in str(err.value)
    else:
        user_line(err.value, dec, "self.cur = self.b")
        assert "functionalized call" in str(err.value)
    assert model.cur is None and _structure_seen(model)[1] == [0.0, 0.0, 0.0]
    no_tracer(model)


_PLAIN_HELD = """
class Config:  # a plain object the model holds: static, shared by every trace
    def __init__(self):
        self.count = 0
        self.log = []
        self.last = None


@DECORATE
class Holder:
    def __init__(self):
        self.w = jnp.ones(3)
        self.cfg = Config()

    def count(self, x):
        self.cfg.count += 1
        return x * self.w

    def log(self, x):
        self.cfg.log.append(1)
        return x * self.w

    def keep(self, x):
        self.cfg.last = x * self.w
        return x * self.w
"""


@pytest.mark.parametrize("name", ["count", "log", "keep"])
def test_a_plain_object_changed_in_place_in_a_compiled_call_is_refused(
    write_module: Any, name: str
) -> None:
    """autostate.jit writes back the models, not a plain object they hold: a change
    to it would be made once per trace, not once per call (``count`` stayed 1 after
    two calls), or keep the trace's tracer (``keep``). Refused, as in ``jax.jit(f)``,
    and put back."""
    dec = pair(write_module, _PLAIN_HELD)[1]
    model = dec.Holder()
    call = autostate.jit(lambda m, x: getattr(m, name)(x))
    with pytest.raises(StateAccessError) as err:
        call(model, jnp.ones(3))
    assert "Holder.cfg" in str(err.value) and "fix:" in str(err.value)
    assert_user_line(err.value, __file__)
    assert (model.cfg.count, model.cfg.log, model.cfg.last) == (0, [], None)
    no_tracer(model)
