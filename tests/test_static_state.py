"""Static state: Python bools, ints, strings and enums are structure, not states;
None is a placeholder an array may replace, also inside ``f``.

Also the two neighbours of that rule: python values inside a model's
containers are never leaves, and a model built inside a trace (a temporary
instance in a jitted step) may keep that trace's values.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from differential import check, pair  # noqa: I001 - tests/ is on sys.path

import autostate
from autostate.errors import StaticStateError, TracedEagerStateError


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

    @jax.jit
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
        jax.jit(lambda f, s: f.eval(s))(f, states)
    message = str(info.value)
    assert "'training'" in message and "True" in message and "False" in message
    assert "autostate.freeze(f, states).eval().functionalize()" in message
    assert isinstance(info.value, (autostate.AutostateError, ValueError))
    # Assigning the value it already holds is no change.
    _, same = jax.jit(lambda f, s: f.train(s))(f, states)
    assert sorted(same) == ["key"]
    # Untraced functionalized calls are pure too.
    with pytest.raises(StaticStateError):
        f.eval(states)


def test_enum_and_string_state_under_jit():
    model = Decoder()
    logits = jnp.array([0.1, 0.9, 0.0])
    f, states = model.functionalize()
    assert states == {"cache": None}  # the placeholder; the Python values are structure
    assert int(jax.jit(lambda f, s, x: f(s, x)[0])(f, states, logits)) == 1
    model.sample()
    model.relabel("other")
    f, states = model.functionalize()
    assert int(jax.jit(lambda f, s, x: f(s, x)[0])(f, states, logits)) == 2
    frozen = autostate.freeze(f, states)
    assert frozen.mode is Mode.SAMPLE and frozen.label == "other"


def test_python_int_state_is_static_and_a_traced_increment_is_an_error():
    model = Decoder()
    model.step()
    assert model.steps == 1 and type(model.steps) is int
    f, states = model.functionalize()
    assert "steps" not in states
    with pytest.raises(StaticStateError, match="'steps'"):
        jax.jit(lambda f, s: f.step(s))(f, states)


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

    @jax.jit
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
        jax.jit(lambda f, s: f.name(s, "gelu"))(f, states)
    assert "model.label = 'gelu'" in str(info.value) and f"{dec.__file__}:" in str(info.value)
    _, states = jax.jit(lambda f, s: f.name(s, jnp.ones(2)))(f, states)
    np.testing.assert_array_equal(states["label"], [1.0, 1.0])


def test_true_and_one_are_different_structures():
    a, b = Decoder(), Decoder()
    a.relabel(True)
    b.relabel(1)
    assert jax.tree_util.tree_structure(a) != jax.tree_util.tree_structure(b)
    fa, _ = a.functionalize()
    fb, _ = b.functionalize()
    assert jax.tree_util.tree_structure(fa) != jax.tree_util.tree_structure(fb)


# --- python values inside containers ------------------------------------------------


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
    out, _ = jax.jit(lambda f, s, x: f(s, x))(f, states, jnp.ones(2))
    assert float(out) == 12.0
    rebuilt = jax.tree.map(lambda x: x * 2, model)
    assert rebuilt.a[1:] == [3, "relu", None] and rebuilt.cfg["scale"] == 2.0
    np.testing.assert_array_equal(rebuilt.a[0].w, [2.0, 2.0])


# --- models built inside a trace ----------------------------------------------------


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
    @jax.jit
    def run(x):
        c = Counter()
        c(x)
        return c(x), c.count, c.total

    y, count, total = run(jnp.ones(3))
    np.testing.assert_array_equal(y, [2.0, 2.0, 2.0])
    assert float(count) == 2.0 and float(total) == 6.0


def test_a_temporary_instance_inside_a_functionalized_call_works():
    f, states = UsesTemporary().functionalize()
    y, states = jax.jit(lambda f, s, x: f(s, x))(f, states, jnp.ones(2))
    np.testing.assert_array_equal(y, [2.0, 2.0])
    assert float(states["seen"]) == 2.0


def test_a_model_built_outside_still_refuses_tracers():
    c = Counter()
    with pytest.raises(TracedEagerStateError, match=r"functionalize\(\)"):
        jax.jit(lambda x: c(x))(jnp.ones(2))
    # Passed into the trace as an argument, it is a copy whose writes would be lost.
    with pytest.raises(TracedEagerStateError):
        jax.jit(lambda c, x: c(x))(c, jnp.ones(2))
    assert float(c.count) == 0.0
