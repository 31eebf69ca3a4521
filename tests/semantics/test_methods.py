"""Callables: bound methods, callables holding models (``functools.partial``,
lambdas, closures, nested functions), generators, properties and user
descriptors, ``classmethod``/``staticmethod``, methods replaced at runtime,
hooks.

Each case runs a class as plain Python and decorated (the harness in
``tests/semantics/harness.py``, or a direct comparison) and asserts the
decorated program means what the plain one does: eagerly, through
``f(states, ...)``, under ``jax.jit`` and after ``autostate.freeze``, or that it
is refused with a clear error. A known difference stays as ``xfail(strict=True)``
with what differs.
"""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.util
import inspect
import pickle
import re
import sys
import textwrap
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerance import tolerance

import autostate
from autostate import errors
from autostate.errors import (
    DecorationError,
    InvalidTypeError,
    StateAccessError,
    TracedEagerStateError,
    UnhandledLocalStateError,
)
from semantics.harness import (
    HEADER,
    Call,
    Loader,
    X,
    _fcall,
    assert_same,
    assert_user_line,
    build_pair,
    check,
    check_transform,
    class_pair,
    data_for,
    error_line,
    floats,
    keys_of,
    library,
    load_plain,
    names_of,
    no_tracer,
    outputs_in_mode,
    pair,
    pair_with_helpers,
    raises_autostate,
    run_case,
    same,
    snapshot,
    staged,
    train_against_reference,
    user_line,
)
from semantics.programs_attribute_access import BEHIND
from semantics.programs_class_shapes import EQX, LATE, MORE, MORE_DEFS, PY313, SRC2
from semantics.programs_containers import HELPER_MODULE, OUTSIDE
from semantics.programs_control_flow import DECORATED_METHODS, DESCRIPTORS
from semantics.programs_escapes import ESCAPES, NESTED_GEN, TRANSFORMS_INSIDE
from semantics.programs_exceptions import RAISE_IN_LAX
from semantics.programs_functional import MODELS, MULTI
from semantics.programs_methods import (
    ALIASES,
    CALLABLES,
    CLOSURE_HOOKS,
    CLOSURES,
    DISPATCH,
    FRAMES,
    GENERATOR_METHODS,
    GENS,
    HIDDEN_METHODS,
    LAST,
    MADE,
    MISC,
    OUTSIDE_WRAPPED,
    PROBE,
    RECEIVERS,
    RUNTIME,
    SIGNATURES,
)
from semantics.programs_methods import FORWARD_HOOKS as HOOKS
from semantics.programs_shared import (
    _COUNTER,
    A1,
    A2,
    FILE_HEADER,
    KEY,
    STACK,
    V2,
    V2_RANGE,
    V3,
    X1,
    XP,
    XS3,
    XS_SIGNED,
    Build,
    py313,
)
from semantics.programs_shared import POSITIVE_CALLS as TWO_CALLS
from semantics.programs_shared import TWO as X2
from semantics.programs_static_state import ONE_SHOT
from semantics.programs_submodels import STRUCT, TORCH

BODY_RUNS: list[str] = []

CLAMPED = """
class Clamped:
    def __set_name__(self, owner, name):
        self.key = "_" + name
    def __get__(self, obj, cls=None):
        return self if obj is None else obj.__dict__[self.key]
    def __set__(self, obj, value):
        obj.__dict__[self.key] = jnp.clip(value, 0.0, 1.0)

"""


REFUSED = {
    "on_the_class": """
@DECORATE
class M:
    scale = Clamped()
    def __init__(self):
        self.scale = jnp.asarray(0.5)
    def __call__(self, x):
        self.scale = self.scale + x
        return self.scale * 2
""",
    "on_an_undecorated_base": """
class Base:
    scale = Clamped()

@DECORATE
class M(Base):
    def __init__(self):
        self.scale = jnp.asarray(0.5)
    def __call__(self, x):
        self.scale = self.scale + x
        return self.scale
""",
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_state_held_by_a_user_data_descriptor_is_refused_at_the_class(write_module, case):
    with pytest.raises(errors.DecorationError) as info:
        pair(write_module, CLAMPED + REFUSED[case])
    message = str(info.value)
    assert "data descriptor" in message and "would never run" in message
    assert ".py:" in message  # the class statement's file:line
    assert "fix: keep the value in a plain attribute and make" in message


FIXED = """
@DECORATE
class M:
    def __init__(self):
        self.scale = jnp.asarray(0.5)
        self.calls = jnp.zeros((), jnp.int32)
    @property
    def scale(self):
        return self._scale
    @scale.setter
    def scale(self, value):
        self._scale = jnp.clip(value, 0.0, 1.0)
    def __call__(self, x):
        self.scale = self.scale + x
        self.calls = self.calls + 1
        return self.scale * 2
"""


def test_the_fix_it_gives_means_what_the_descriptor_meant(write_module):
    plain, dec = pair(write_module, FIXED)
    calls = [("__call__", (jnp.asarray(0.3),)), ("__call__", (jnp.asarray(0.4),)),
             ("__call__", (jnp.asarray(-2.0),))]
    check(plain, dec, "M()", calls)


KEPT = """
class Doc:
    def __get__(self, obj, cls=None):
        return "a non-data descriptor"

@DECORATE
class M:
    doc = Doc()
    def __init__(self):
        self.w = jnp.ones(2)
        self.n = jnp.zeros(())
    @staticmethod
    def twice_of(v):
        return 2 * v
    def __call__(self, x):
        self.n = self.n + self.twice_of(1.0)
        return x * self.w + len(self.doc)
"""


def test_descriptors_without_set_are_left_alone(write_module):
    plain, dec = pair(write_module, KEPT)
    check(plain, dec, "M()", [("__call__", (jnp.arange(2.0),)), ("__call__", (jnp.ones(2),))])


CACHED = """
@DECORATE
class Cached:
    def __init__(self):
        self.w = jnp.array([1.0, 2.0])   # a parameter
        self.s = jnp.array(1.0)          # a state

    @functools.cached_property
    def norm(self):                      # over a parameter: the same value every time
        return jnp.sum(self.w ** 2)

    @functools.cached_property
    def snap(self):                      # over a state: the first value, kept
        return self.s * 3

    def __call__(self):
        self.s = self.s + 2
        return self.norm * self.s

    def read_snap(self):
        out = self.snap  # the cached read
        self.s = self.s + 2
        return out
"""


SNAPS = [("read_snap", ()), ("read_snap", ()), ("__call__", ())]


def test_a_cached_property_means_plain_python_eagerly_and_through_f(write_module):
    plain, dec = pair(write_module, CACHED)
    check(plain, dec, "Cached()", SNAPS, modes=("eager", "f"))


def test_a_cached_property_over_parameters_means_plain_python_under_jit(write_module):
    plain, dec = pair(write_module, CACHED)
    check(plain, dec, "Cached()", [("__call__", ()), ("__call__", ())], modes=("jit",))


def test_a_cached_property_first_computed_from_a_state_under_jit_is_refused(write_module):
    _, dec = pair(write_module, CACHED)
    f, states = dec.Cached().functionalize()
    step = staged(lambda f, s: f.read_snap(s))
    with pytest.raises(errors.StateAccessError, match=r"cached_property Cached.snap") as info:
        step(f, states)
    message = str(info.value)
    assert "state 's'" in message and "model.snap" in message
    assert f"{dec.__file__}:" in message  # the line that read it
    assert "snap" not in vars(f.model)  # nothing of the trace kept
    # The fix it gives: computed once before functionalizing, f keeps the value.
    plain, _ = pair(write_module, CACHED)
    check(plain, dec, "(lambda m: (m.snap, m)[1])(Cached())", SNAPS, modes=("jit",))


def _make():
    @autostate.stateful
    class Counter:
        def __init__(self):
            self.n = jnp.zeros(())
            self.w = jnp.ones(())

        def __call__(self, x):
            self.n = self.n + 1
            return x * self.w

    return Counter


def _plain(make):
    """The same class undecorated: the reference."""

    class Counter:
        def __init__(self):
            self.n = jnp.zeros(())
            self.w = jnp.ones(())

        def __call__(self, x):
            self.n = self.n + 1
            return x * self.w

    return Counter


def forward10(self, x):
    self.n = self.n + 10
    return x * 2 * self.w


def _run_all(model, name, calls):
    """Eager outputs and n; f's and jit's, from a fresh functionalize each."""
    f, states = model.functionalize()
    jitted = staged(lambda f, s, x: getattr(f, name)(s, x) if name else f(s, x))
    call = getattr(f, name) if name else f
    f_out, s = [], states
    for x in calls:
        out, s = call(s, x)
        f_out.append(float(out))
    j_out, js = [], states
    for x in calls:
        out, js = jitted(f, js, x)
        j_out.append(float(out))
    eager = [float((getattr(model, name) if name else model)(x)) for x in calls]
    return eager, float(model.n), f_out, float(s["n"]), j_out, float(js["n"])


def _plain_run(model, name, calls):
    outs = [float((getattr(model, name) if name else model)(x)) for x in calls]
    return outs, float(model.n)


def test_a_class_method_replaced_after_the_first_instance() -> None:
    Counter, Plain = _make(), _plain(None)
    model, ref = Counter(), Plain()
    model(1.0), ref(1.0)
    Counter.__call__ = forward10
    Plain.__call__ = forward10
    eager, n, f_out, f_n, j_out, j_n = _run_all(model, None, [1.0, 2.0])
    ref_out, ref_n = _plain_run(ref, None, [1.0, 2.0])
    assert f_out == j_out == eager == ref_out and f_n == j_n == n == ref_n == 21.0


def test_a_class_method_replaced_before_the_first_instance() -> None:
    Counter = _make()
    Counter.__call__ = forward10
    model = Counter()
    eager, n, f_out, f_n, j_out, j_n = _run_all(model, None, [1.0, 3.0])
    assert f_out == j_out == [2.0, 6.0] and f_n == j_n == 20.0
    assert eager == [2.0, 6.0] and n == 20.0


def test_one_instance_method_replaced_with_types_method_type() -> None:
    Counter = _make()
    model, other = Counter(), Counter()
    model.forward = types.MethodType(forward10, model)
    eager, n, f_out, f_n, j_out, j_n = _run_all(model, "forward", [1.0, 2.0])
    assert f_out == j_out == [2.0, 4.0] and f_n == j_n == 20.0
    assert eager == [2.0, 4.0] and n == 20.0
    assert float(other.n) == 0.0 and "forward" not in vars(other)
    # frozen: the method is bound to the frozen model, not the eager one
    f, states = model.functionalize()
    _, states = f.forward(states, 1.0)
    frozen = autostate.freeze(f, states)
    frozen.forward(1.0)
    assert float(frozen.n) == 40.0 and float(model.n) == 20.0


def test_a_closure_over_the_model_held_by_the_instance() -> None:
    Counter = _make()
    model = Counter()
    model.twice = lambda x: model(x) + model(x)
    eager, n, f_out, f_n, j_out, j_n = _run_all(model, "twice", [1.0])
    assert f_out == j_out == eager == [2.0] and f_n == j_n == n == 2.0


def test_a_plain_function_held_by_the_instance() -> None:
    Counter = _make()
    model = Counter()
    model.act = jnp.tanh
    f, states = model.functionalize()
    out, new = f.act(states, 0.5)
    # The plain call's value on this backend (an accelerator's tanh is not NumPy's).
    np.testing.assert_allclose(out, jnp.tanh(0.5), **tolerance(1e-6, 0.0))
    assert new == states


SOURCE = """
import jax
import jax.numpy as jnp
import autostate


@DECORATE
class Head:
    def __init__(self):
        self.w = jnp.asarray(3.0)
        self.calls = jnp.zeros(())

    def forward(self, x):
        self.calls = self.calls + 1
        return self.w * x


@DECORATE
class SelfBound:
    def __init__(self, train=True):
        self.n = jnp.zeros(())
        self.step_fn = self._train if train else self._eval

    def _train(self, x):
        self.n = self.n + x
        return self.n * 2

    def _eval(self, x):
        return self.n * x

    def __call__(self, x):
        return self.step_fn(x)


@DECORATE
class Closes:
    def __init__(self, k=2.0):
        self.n = jnp.zeros(())
        self.head = Head()
        head = self.head
        self.bump = lambda x: self._bump(x, k)
        self.fns = [lambda x: head.forward(x) * k]

    def _bump(self, x, k):
        self.n = self.n + x * k
        return self.n

    def __call__(self, x):
        return self.bump(x) + self.fns[0](x)


@DECORATE
class Reads:
    def __init__(self):
        self.n = jnp.asarray(2.0)
        self.scaled = lambda x: self.n * x * 10


@DECORATE
class Switchable:
    def __init__(self):
        self.n = jnp.zeros(())
        self.step_fn = self._train

    def eval(self):
        self.step_fn = self._eval

    def _train(self, x):
        self.n = self.n + x
        return self.n * 2

    def _eval(self, x):
        return self.n * x

    def __call__(self, x):
        return self.step_fn(x)


@DECORATE
class Branches:
    def __init__(self):
        self.n = jnp.zeros(())
        self.branches = [self.up, self.down]
        self.by_name = {"up": self.up}

    def up(self, x):
        self.n = self.n + x
        return self.n

    def down(self, x):
        self.n = self.n - x
        return self.n

    def __call__(self, i, x):
        return jax.lax.switch(i, self.branches, x) + self.by_name["up"](x)


@DECORATE
class Delegates:
    def __init__(self):
        head = Head()
        self.score = head.forward  # before the sub-model's own attribute
        self.head = head
        self.bias = jnp.asarray(0.5)

    def __call__(self, x):
        return self.score(x) + self.bias
"""


@pytest.fixture
def pair_bound_methods(write_module: Callable[..., types.ModuleType]) -> tuple[Any, Any]:
    return pair(write_module, SOURCE)


CASES = [
    ("SelfBound", (), [(1.0,), (2.0,)]),
    ("Branches", (), [(0, 1.0), (1, 2.0), (0, 0.5)]),
    ("Delegates", (), [(1.0,), (2.0,)]),
    ("Closes", (), [(1.0,), (2.0,)]),
    ("Closes", (3.0,), [(1.0,)]),
]


def _run_plain(model: Any, calls: list[tuple]) -> list[float]:
    out = []
    for args in calls:
        if isinstance(model.__dict__.get("branches"), list):  # lax.switch: Python's own choice
            i, x = args
            out.append(float(model.branches[i](x)) + float(model.by_name["up"](x)))
        else:
            out.append(float(model(*args)))
    return out


@pytest.mark.parametrize(("cls", "ctor", "calls"), CASES, ids=[f"{c[0]}{c[1]}" for c in CASES])
def test_stored_bound_methods_act_on_the_running_model(
    pair_bound_methods: Any, cls: str, ctor: tuple, calls: list[tuple]
) -> None:
    plain, dec = pair_bound_methods
    expected_model = getattr(plain, cls)(*ctor)
    expected = _run_plain(expected_model, calls)
    for mode in ("eager", "f", "jit"):
        model = getattr(dec, cls)(*ctor)
        if mode == "eager":
            got = [float(model(*args)) for args in calls]
            result = model
        else:
            f, states = model.functionalize()
            call = f if mode == "f" else staged(f)
            got = []
            for args in calls:
                out, states = call(states, *args)
                got.append(float(out))
            result = autostate.freeze(f, states)
            # f's calls never touched the model they were made from.
            fresh = getattr(dec, cls)(*ctor)
            assert jax.tree_util.tree_map(float, vars_of(model)) == jax.tree_util.tree_map(
                float, vars_of(fresh)
            )
        assert got == pytest.approx(expected), mode
        assert vars_of(result) == pytest.approx(vars_of(expected_model)), mode


def vars_of(model: Any) -> dict[str, float]:
    """The array attributes of a model and of its sub-models, by path."""
    out: dict[str, float] = {}
    for name, value in vars(model).items():
        if isinstance(value, jax.Array) or hasattr(getattr(model, name), "shape"):
            out[name] = float(getattr(model, name))
        elif hasattr(value, "__dict__") and not isinstance(value, types.MethodType):
            out.update({f"{name}.{k}": v for k, v in vars_of(value).items()})
    return out


def test_a_frozen_models_methods_are_bound_to_it(pair_bound_methods: Any) -> None:
    _, dec = pair_bound_methods
    f, states = dec.SelfBound().functionalize()
    _, states = staged(f)(states, 1.0)
    frozen = autostate.freeze(f, states)
    assert frozen.step_fn.__self__ is frozen
    frozen(2.0)
    assert float(frozen.n) == 3.0
    branches = dec.Branches()
    f, states = branches.functionalize()
    frozen = autostate.freeze(f, states)
    assert all(m.__self__ is frozen for m in frozen.branches)
    assert frozen.by_name["up"].__self__ is frozen
    delegates = autostate.freeze(*dec.Delegates().functionalize())
    assert delegates.score.__self__ is delegates.head
    closes = autostate.freeze(*dec.Closes().functionalize())
    closes(1.0)
    assert float(closes.n) == 2.0 and float(closes.head.calls) == 1.0


def test_gradients_reach_a_parameter_read_through_a_stored_method(pair_bound_methods: Any) -> None:
    _, dec = pair_bound_methods
    model = dec.Delegates()
    f, states = model.functionalize()
    params = autostate.param_dict(f) if hasattr(autostate, "param_dict") else None

    def loss(f: Any, x: Any) -> Any:
        return f(states, x)[0]

    grads = jax.grad(loss)(f, 2.0)
    grad_leaves = [float(g) for g in jax.tree_util.tree_leaves(grads)]
    # d/dw (w * x + b) = x = 2, d/db = 1: neither baked in as a constant.
    assert sorted(grad_leaves) == [1.0, 2.0]
    del params


def test_an_eager_model_passed_to_jit_as_a_pytree_reads_its_traced_copy(pair_bound_methods: Any) -> None:
    _, dec = pair_bound_methods
    model = dec.SelfBound(train=False)
    model.n = jnp.asarray(2.0)

    def read(m: Any, x: Any) -> Any:
        return m.step_fn(x)

    assert float(staged(read)(model, 3.0)) == 6.0
    # Traced through the method: the gradient of n * x in n is x, not 0.
    grad = jax.grad(lambda m: read(m, 3.0))(model)
    assert float(grad.n) == 3.0
    # And through a closure over the model (a lambda kept as an attribute).
    reads = dec.Reads()
    assert float(staged(lambda m: m.scaled(3.0))(reads)) == 60.0
    assert float(jax.grad(lambda m: m.scaled(3.0))(reads).n) == 30.0


def test_copies_and_pickles_rebind_as_plain_python_does(pair_bound_methods: Any) -> None:
    plain, dec = pair_bound_methods
    for module in (plain, dec):
        model = module.SelfBound()
        model(1.0)
        deep = copy.deepcopy(model)
        assert deep.step_fn.__self__ is deep
        deep(1.0)
        assert float(deep.n) == 2.0 and float(model.n) == 1.0
        clone = pickle.loads(pickle.dumps(model))
        assert clone.step_fn.__self__ is clone
        shallow = copy.copy(model)
        assert shallow.step_fn.__self__ is model  # a shallow copy shares it, as in Python


def test_a_method_switched_by_another_method_stays_bound_to_the_running_model(
    pair_bound_methods: Any,
) -> None:
    plain, dec = pair_bound_methods
    expected_model = plain.Switchable()
    expected_model(1.0)
    expected_model.eval()
    expected = [float(expected_model(x)) for x in (2.0, 3.0)]
    for mode in ("eager", "f", "jit"):
        model = dec.Switchable()
        model(1.0)
        model.eval()  # eagerly: plain Python
        got, after = outputs_in_mode(model, mode, (2.0, 3.0))
        assert after.step_fn.__self__ is after
        assert float(after.n) == float(expected_model.n)
        assert got == expected, mode


@pytest.mark.parametrize("jit", [False, True])
def test_switching_a_stored_method_inside_a_functionalized_call_is_refused(
    pair_bound_methods: Any, jit: bool
) -> None:
    _, dec = pair_bound_methods
    f, states = dec.Switchable().functionalize()
    call = staged(f.eval) if jit else f.eval
    with pytest.raises(autostate.AutostateError, match="method bound to one") as info:
        call(states)
    assert dec.__file__ in str(info.value)
    out, _ = staged(f)(states, 1.0)  # f still runs
    assert float(out) == 2.0


PARTIAL_SOURCE = """
import functools
import jax.numpy as jnp
import autostate


@autostate.stateful
class Partial:
    def __init__(self):
        self.n = jnp.zeros(())
        self.fns = [functools.partial(self._add, k=2.0)]

    def _add(self, x, k):
        self.n = self.n + k * x
        return self.n

    def __call__(self, x):
        return self.fns[0](x)
"""


def test_a_partial_of_a_method_is_refused_at_functionalize_naming_the_path(
    write_module: Callable[..., types.ModuleType],
) -> None:
    module = write_module(PARTIAL_SOURCE)
    model = module.Partial()
    assert float(model(1.0)) == 2.0  # eagerly: plain Python
    with pytest.raises(autostate.errors.InvalidTypeError, match=r"at fns\[0\]\.func") as info:
        model.functionalize()
    assert "lambda" in str(info.value)


class Plain:
    BODY_RUNS.append("Plain")

    def __init__(self):
        self.x = jnp.array(0.0)

    def step(self):
        self.x += 1
        return self.x


def test_rewritten_method_carries_the_original_metadata():
    step = Plain.__dict__["step"]
    assert step.__name__ == "step"
    assert step.__qualname__ == "Plain.step"
    assert step.__module__ == __name__
    assert step.__code__.co_filename == __file__


QUALNAMES = """
@DECORATE
class Named:
    def __init__(self):
        self.n = jnp.zeros(())
        self.act = lambda v: v

    def step(self):
        def inner(v):
            return v

        class Local:
            pass

        self.n = self.n + 1
        return [inner.__qualname__, Local.__qualname__, (lambda: 0).__qualname__]
"""


def test_what_a_rewritten_method_defines_is_named_as_plain_python_names_it(write_module):
    # (named under the compiled wrapper: `Named.__autostate_outer__.<locals>.step.<locals>.inner`,
    # which pickle's errors and every repr of such a function showed)
    plain, dec = pair(write_module, QUALNAMES)
    want = ["Named.step.<locals>.inner", "Named.step.<locals>.Local", "Named.step.<locals>.<lambda>"]
    assert plain.Named().step() == want
    model = dec.Named()
    assert model.step() == want
    assert model.act.__qualname__ == plain.Named().act.__qualname__ == "Named.__init__.<locals>.<lambda>"


def make_closure_class(offset: float):
    factor = 10.0

    @autostate.stateful
    class Closed:
        def __init__(self):
            self.x = jnp.array(offset)

        def step(self, v):
            self.x = self.x * factor + v + offset
            return self.x

    def set_factor(value):
        nonlocal factor
        factor = value

    return Closed, set_factor


def test_closures_of_the_enclosing_function_are_kept():
    Closed, set_factor = make_closure_class(1.0)
    assert Closed.__qualname__ == "make_closure_class.<locals>.Closed"
    model = Closed()
    assert float(model.x) == 1.0
    assert float(model.step(2.0)) == 13.0  # 1 * 10 + 2 + 1
    # The rewritten method shares the closure cells: rebinding is seen.
    set_factor(0.0)
    assert float(model.step(2.0)) == 3.0
    f, states = Closed().functionalize()
    out, _ = staged(lambda f, s: f.step(s, 1.0))(f, states)
    assert float(out) == 2.0  # 1 * 0 + 1 + 1
    other, _ = make_closure_class(5.0)
    assert float(other().step(0.0)) == 55.0


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


@autostate.stateful
class Defaults:
    def __init__(self, start: float = 1.0, *, scale: float = 2.0) -> None:
        """Builds the model."""
        self.x = jnp.array(start * scale)

    def step(self, v: float = 3.0, *, times: int = 2) -> jax.Array:
        """Adds ``v`` ``times`` times."""
        for _ in range(times):
            self.x += v
        return self.x


def test_default_and_keyword_only_defaults_are_kept():
    model = Defaults()
    assert float(model.x) == 2.0
    assert float(model.step()) == 8.0
    assert float(model.step(1.0, times=1)) == 9.0
    assert float(Defaults(2.0, scale=3.0).x) == 6.0
    step = Defaults.__dict__["step"]
    assert step.__defaults__ == (3.0,)
    assert step.__kwdefaults__ == {"times": 2}


def test_docstrings_and_annotations_are_kept():
    step = Defaults.__dict__["step"]
    assert step.__doc__ == "Adds ``v`` ``times`` times."
    assert Defaults.__init__.__doc__ == "Builds the model."
    assert step.__annotations__ == {"v": "float", "times": "int", "return": "jax.Array"}
    assert str(inspect.signature(Defaults.step)) == (
        "(self, v: 'float' = 3.0, *, times: 'int' = 2) -> 'jax.Array'"
    )


CALLS: list[str] = []


def logged(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        CALLS.append(fn.__name__)
        return fn(*args, **kwargs)

    return wrapper


@autostate.stateful
class Decorated:
    def __init__(self):
        self.x = jnp.array(1.0)
        self.value = 2.0

    @property
    def value(self):
        """The value."""
        return self.x * 10

    @value.setter
    def value(self, v):
        self.x = jnp.asarray(v)

    @staticmethod
    def double(v):
        return v * 2

    @classmethod
    def make(cls, v):
        model = cls()
        model.value = v
        return model

    @logged
    def step(self, v):
        """Logged step."""
        self.x = self.x + self.double(v)
        return self.x


def test_property_with_setter_is_rewritten_and_still_a_property():
    assert isinstance(Decorated.__dict__["value"], property)
    assert Decorated.__dict__["value"].__doc__ == "The value."
    model = Decorated()
    assert float(model.x) == 2.0
    assert float(model.value) == 20.0
    model.value = 3.0
    assert float(model.x) == 3.0


def test_staticmethod_and_classmethod_still_work():
    assert isinstance(Decorated.__dict__["double"], staticmethod)
    assert isinstance(Decorated.__dict__["make"], classmethod)
    assert Decorated.double(2.0) == 4.0
    model = Decorated.make(5.0)
    assert type(model) is Decorated
    assert float(model.x) == 5.0


def test_wraps_style_decorator_wraps_the_rewritten_function():
    CALLS.clear()
    model = Decorated()
    assert float(model.step(1.0)) == 4.0
    assert float(model.x) == 4.0
    assert CALLS == ["step"]
    assert Decorated.step.__doc__ == "Logged step."
    assert Decorated.step.__wrapped__.__code__.co_filename == __file__
    f, states = Decorated().functionalize()
    out, states = staged(lambda f, s: f.step(s, 1.0))(f, states)
    assert float(out) == 4.0 and float(states["x"]) == 4.0
    assert CALLS == ["step", "step"]


@autostate.stateful
class Raises:
    def __init__(self):
        self.x = jnp.array(1.0)

    def explicit(self, v):
        self.x = self.x + v
        raise ValueError(f"bad value {v}")

    def name_error(self, v):
        self.x += v
        self.x = self.x * undefined_name  # noqa: F821
        return self.x

    def on_rewritten_line(self, v):
        self.x = self.x + v[0]
        return self.x


def test_inspect_getsource_returns_the_original_text():
    text = inspect.getsource(Raises.name_error)
    assert text.splitlines()[0].strip() == "def name_error(self, v):"
    assert "self.x += v" in text and "__autostate__" not in text
    assert inspect.getsource(Child.__init__).strip().startswith("def __init__(self, start=1.0")
    assert "super().step(v)" in inspect.getsource(Child.step)
    assert inspect.getsource(Decorated.step).lstrip().startswith("@logged")




def test_an_assigned_function_outside_the_class_is_left_unchanged(write_module):
    _, cls, module = class_pair(write_module, HIDDEN_METHODS, "Assigned")
    autostate.tree.class_info(cls)  # installed (at the class's first use)
    assert cls.__dict__["__call__"] is not module.external  # a rewritten copy
    assert module.external.__code__.co_filename == cls.__dict__["__call__"].__code__.co_filename


PRIVATE = """
@DECORATE
class Private:
    def __init__(self):
        self.n = jnp.zeros(())

    def _bump(self, x):
        self.n = self.n + x
        return self.n
"""


def test_private_method_through_f(write_module: Loader) -> None:
    plain, dec = pair(write_module, PRIVATE)
    check(plain, dec, "Private()", [("_bump", (1.0,))], modes=("f",))


WRAPPED = """
CALLS = []


def logged(fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        CALLS.append(fn.__name__)
        return fn(self, *args, **kwargs) * 1.0
    return wrapper


def scaled(k):
    def deco(fn):
        @functools.wraps(fn)
        def wrapper(self, x):
            return fn(self, x * k)
        return wrapper
    return deco


HALF = scaled(2.0)


def outside(self, x):
    self.n = self.n + x
    return self.n


def outside_item(self, x):
    self.n = self.n * x
    return self.n


@DECORATE
class W:
    def __init__(self):
        self.n = jnp.zeros(())
        self.w = jnp.ones(())

    @logged
    @scaled(3.0)
    def step(self, x):
        self.n += x
        return self.n

    external = outside

    @HALF
    def half(self, x):
        self.n -= x
        return self.n


W.late = outside_item
"""


@pytest.mark.parametrize(
    "calls",
    [
        [("step", (1.0,)), ("step", (2.0,))],
        [("external", (1.0,)), ("external", (2.0,))],
        [("late", (2.0,)), ("step", (1.0,)), ("late", (3.0,))],
    ],
    ids=["wraps", "assigned_in_body", "assigned_after_class"],
)
def test_methods_defined_by_wrappers_and_assignment(write_module: Loader, calls: list[Call]) -> None:
    plain, dec = pair(write_module, WRAPPED)
    check(plain, dec, "W()", calls)


def test_partial_of_decorator_factory(write_module: Loader) -> None:
    plain, dec = pair(write_module, WRAPPED)
    check(plain, dec, "W()", [("half", (1.0,)), ("half", (2.0,))])


ALIASED_WRAPPED = """
def logged(fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        return fn(self, *args, **kwargs)
    return wrapper


@DECORATE
class W:
    def __init__(self):
        self.n = jnp.zeros(())

    @logged
    def step(self, x):
        self.n += x
        return self.n

    __call__ = step
"""


def test_aliased_wraps_decorated_method(write_module: Loader) -> None:
    plain, dec = pair(write_module, ALIASED_WRAPPED)
    check(plain, dec, "W()", [("step", (1.0,)), ("__call__", (2.0,))])


PARTIALMETHOD = """
@DECORATE
class PM:
    def __init__(self):
        self.n = jnp.zeros(())

    def _add(self, k, x):
        self.n = self.n + k * x
        return self.n

    double = functools.partialmethod(_add, 2.0)
"""


def test_functools_partialmethod(write_module: Loader) -> None:
    plain, dec = pair(write_module, PARTIALMETHOD)
    check(plain, dec, "PM()", [("double", (1.0,)), ("double", (3.0,))])


PROPS = """
@DECORATE
class Thermo:
    def __init__(self):
        self._c = jnp.zeros(())
        self.reads = jnp.zeros((), jnp.int32)

    @property
    def fahrenheit(self):
        return self._c * 9 / 5 + 32

    @fahrenheit.setter
    def fahrenheit(self, f):
        self._c = (f - 32) * 5 / 9

    @property
    def celsius(self):
        self.reads += 1
        return self._c

    def set_f(self, f):
        self.fahrenheit = f
        return self.celsius

    def warm(self, d):
        self.fahrenheit += d
        return self.fahrenheit

    @classmethod
    def at(cls, c):
        t = cls()
        t._c = jnp.asarray(c, jnp.float32)
        return t

    @staticmethod
    def reset(obj):
        obj._c = jnp.zeros(())
        return obj.celsius

    def reset_self(self):
        return Thermo.reset(self)
"""


def test_properties_with_setters(write_module: Loader) -> None:
    plain, dec = pair(write_module, PROPS)
    check(plain, dec, "Thermo()", [("set_f", (212.0,)), ("warm", (9.0,)), ("set_f", (50.0,))])


def test_classmethod_constructor_and_staticmethod_writer(write_module: Loader) -> None:
    plain, dec = pair(write_module, PROPS)
    check(plain, dec, "Thermo.at(5.0)", [("warm", (9.0,)), ("reset_self", ()), ("warm", (1.0,))])


def test_property_setter_from_outside(write_module: Loader) -> None:
    plain, dec = pair(write_module, PROPS)
    p, d = plain.Thermo(), dec.Thermo()
    p.fahrenheit = 100.0
    d.fahrenheit = 100.0
    assert_same(snapshot(p), snapshot(d))
    f, states = d.functionalize()
    assert_same(snapshot(p._c), snapshot(states["_c"]))


def test_closure_returned_by_a_method_runs_later_eagerly(write_module: Loader) -> None:
    plain, dec = pair(write_module, MISC)
    p, d = plain.Misc(), dec.Misc()
    pi, di = p.make_inc(), d.make_inc()
    assert_same([pi(1.0), pi(2.0)], [di(1.0), di(2.0)])
    assert_same(snapshot(p), snapshot(d))
    f, states = dec.Misc().functionalize()
    inc, states = f.make_inc(states)
    with raises_autostate():
        inc(1.0)  # the handler has returned: a clear error, not a silent write


def test_method_returning_self(write_module: Loader) -> None:
    plain, dec = pair(write_module, MISC)
    p, d = plain.Misc(), dec.Misc()
    assert p.fluent(1.0).fluent(2.0) is p
    assert d.fluent(1.0).fluent(2.0) is d
    assert_same(snapshot(p), snapshot(d))
    f, states = dec.Misc().functionalize()
    out, states = f.fluent(states, 1.0)
    assert float(states["n"]) == 1.0
    with raises_autostate():
        out.n  # noqa: B018  the returned model's handler has returned


def test_undecorated_hook_holding_the_model(write_module: Loader) -> None:
    plain, dec = pair(write_module, STRUCT)
    check(plain, dec, "Hooked()", [("__call__", (1.0,))], modes=("eager",))
    model = dec.Hooked()
    # f's copy of the model would still reach the original through the
    # plain Hook: refused when functionalized, naming the path and the fix.
    with pytest.raises(autostate.errors.InvalidTypeError, match=r"plain Hook object \(at hook\.owner\)"):
        model.functionalize()
    assert float(model.hits) == 0.0


def test_generator_method_calling_a_state_writer(write_module: Loader) -> None:
    plain, dec = pair(write_module, TRANSFORMS_INSIDE)
    p, d = plain.T(), dec.T()
    assert_same(list(p.gen(3)), list(d.gen(3)))
    assert_same(snapshot(p), snapshot(d))
    f, states = dec.T().functionalize()
    gen, states = f.gen(states, 3)
    with raises_autostate():
        list(gen)  # runs after the handler has returned


def test_cached_property_with_jit_closing_over_f(write_module: Loader) -> None:
    plain, dec = pair(write_module, LAST)
    ref = plain.Loop()
    expected = [ref(1.0), ref(2.0)]
    f, states = dec.Loop().functionalize()
    step = staged(lambda s, x: f(s, x))
    got = []
    for x in (1.0, 2.0):
        out, states = step(states, x)
        got.append(out)
    assert_same(expected, got)
    out, states = f(states, 3.0)  # and eagerly afterwards: no tracer cached in f.model
    assert_same(ref(3.0), out)


def test_kwargs_through_f_and_jit(write_module: Loader) -> None:
    plain, dec = pair(write_module, MORE_DEFS)
    ref = plain.Sig()
    expected = [ref.kw_only(1.0, scale=0.5), ref.varargs(1.0, a=2.0, b=3.0)[0],
                ref.forward(2.0, shift=3.0)]
    f, states = dec.Sig().functionalize()
    o1, states = staged(lambda f, s: f.kw_only(s, 1.0, scale=0.5))(f, states)
    o2, states = staged(lambda f, s: f.varargs(s, 1.0, a=2.0, b=3.0))(f, states)
    o3, states = f.forward(states, 2.0, shift=3.0)
    assert_same(expected, [o1, o2[0], o3])
    assert (int(o2[1]), int(o2[2])) == (1, 2)
    assert_same(np.asarray(ref.s), states["s"])


def test_generator_and_async_methods_without_state_work(write_module: Loader) -> None:
    src = """
@DECORATE
class Gens:
    def __init__(self):
        self.s = jnp.zeros(())

    def __call__(self, x):
        self.s = self.s + sum(self.values(x))
        return self.s

    def values(self, x):
        for i in range(3):
            yield x * i

    async def later(self, x):
        return x * 2
"""
    plain, dec = pair(write_module, src)
    check(plain, dec, "Gens()", [("__call__", (1.0,))] * 2)
    import asyncio

    assert asyncio.run(dec.Gens().later(3.0)) == 6.0


@pytest.mark.parametrize(
    "build",
    ["LATE_CLS()", "make_late()()", "make_with_super()()", "make_many()[0]()", "make_many()[2]()",
     "make_late_loop()[0]()"],
)
def test_closures_and_globals_rebound_after_decoration(write_module: Loader, build: str) -> None:
    plain, dec = pair(write_module, LATE)
    check(plain, dec, build, [("__call__", (2.0,)), ("__call__", (1.0,))])


def f_still_works(f: Any, states: dict[str, Any], name: str, *args: Any) -> None:
    """f answers the same eagerly and under jit after a refused call."""
    out1, s1 = _fcall(f, name)(states, *args)
    out2, s2 = staged(lambda f, s, *a: _fcall(f, name)(s, *a))(f, states, *args)
    assert_same(out1, out2, "after refusal")
    assert_same(s1, s2, "states after refusal")


@pytest.mark.parametrize(
    "build",
    ["MultiCell()", "Nested()", "Defaults()", "BoundBefore()", "Tied()", "Parent()",
     "StaticObjs()", "InList()", "DeadRef()", "Foreign()"],
)
def test_stored_callables_follow_the_running_model(write_module: Loader, build: str) -> None:
    plain, dec = pair(write_module, CALLABLES)
    check(plain, dec, build, [("__call__", (1.0,)), ("__call__", (2.0,))])


@pytest.mark.parametrize(
    ("build", "attribute", "holder"),
    [
        ("ViaFunction()", "ViaFunction.fn", "a plain closure object"),  # through a helper's closure
        ("ViaBox()", "ViaBox.fn", "a plain closure object"),  # a closure over a list holding it
        ("TreePartial()", "TreePartial.fn", "a plain functools.partial"),  # jax.tree_util.Partial
        ("Appender()", "Appender.push", "a method of a list the model holds"),  # self.log.append
    ],
)
def test_a_model_reached_through_a_plain_callable_is_refused_by_functionalize(
    write_module: Loader, build: str, attribute: str, holder: str
) -> None:
    """Eagerly the model means what plain Python means; ``functionalize()`` refuses
    it (docs/limitations.md), since f's copy would leave the callable on the original."""
    plain, dec = pair(write_module, CALLABLES)
    model, ref = eval(build, vars(dec)), eval(build, vars(plain))  # noqa: S307
    assert_same(ref(1.0), model(1.0), "eager call")
    assert_same(snapshot(ref), snapshot(model), "eager attributes")
    with pytest.raises(errors.InvalidTypeError) as err:
        model.functionalize()
    message = str(err.value)
    assert message.startswith(attribute) and holder in message and "inside f would" in message
    assert_same(snapshot(ref), snapshot(model), "the refused functionalize changed the model")


def test_nonlocal_counter_cell_shared_like_python(write_module: Loader) -> None:
    plain, dec = pair(write_module, CALLABLES)
    check(plain, dec, "Counting()", [("__call__", (1.0,)), ("__call__", (2.0,))],
          modes=("eager", "f"))


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


def test_grad_reaches_params_of_two_submodels_through_a_closure(write_module: Loader) -> None:
    plain, dec = pair(write_module, CALLABLES)
    f, states = dec.MultiCell().functionalize()
    g = jax.grad(lambda f: f(states, 2.0)[0])(f)
    assert float(g.model.a.w) == 2.0
    assert float(g.model.b.w) == pytest.approx(3.0)
    gj = staged(jax.grad(lambda f: f(states, 2.0)[0]))(f)
    assert float(gj.model.b.w) == pytest.approx(3.0)


def test_cached_property_eager_f_caches_traced_is_refused(write_module: Loader) -> None:
    plain, dec = pair(write_module, BEHIND)
    check(plain, dec, "Behind()", [("use_cached", (2.0,)), ("use_cached", (3.0,))],
          modes=("eager", "f"))
    f, states = dec.Behind().functionalize()
    try:
        out, _ = staged(lambda f, s, x: f.use_cached(s, x))(f, states, 2.0)
        assert float(out) == 12.0
        assert "doubled" not in vars(f.model), "a traced cached_property leaked into f"
    except autostate.errors.StateAccessError as err:
        assert "doubled" in str(err)
    f_still_works(f, states, "__call__", 1.0)
    out, _ = staged(lambda f, s, x: f(s, x))(f, states, 2.0)
    assert float(out) == float(plain.Behind()(2.0))
    out, _ = f.use_cached(states, 2.0)
    assert float(out) == 12.0


def _import(path: Path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _decorated(source: str) -> str:
    return (
        FILE_HEADER
        + textwrap.dedent(source)
        .replace("@DECORATE_HOST", '@autostate.stateful(fallback="host")')
        .replace("@DECORATE", "@autostate.stateful")
    )


def _plain_text(source: str) -> str:
    text = textwrap.dedent(source)
    for tag in ("@DECORATE_HOST", "@DECORATE"):
        text = text.replace(tag, "")
    return FILE_HEADER + text


@pytest.fixture
def files(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """``files(source)`` -> (plain module, decorated path, import(name)); cleans sys.modules."""
    added: list[str] = []

    def make(source: str) -> tuple[types.ModuleType, Path, Callable[[str], types.ModuleType]]:
        i = next(_COUNTER)
        plain_path_ = tmp_path / f"autostate_testmod_files_plain{i}.py"
        dec_path = tmp_path / f"autostate_testmod_files_dec{i}.py"
        plain_path_.write_text(_plain_text(source))
        dec_path.write_text(_decorated(source))
        name = f"autostate_testmod_files_p{i}"
        added.append(name)
        plain = _import(plain_path_, name)

        def load(tag: str) -> types.ModuleType:
            mod_name = f"autostate_testmod_files_{tag}{i}"
            added.append(mod_name)
            return _import(dec_path, mod_name)

        return plain, dec_path, load

    yield make
    for name in added:
        sys.modules.pop(name, None)


@pytest.fixture(params=["cold", "warm"])
def build(request: pytest.FixtureRequest, files: Callable[..., Any]) -> Build:
    """``build(source)`` -> (plain module, decorated module imported cold or warm)."""

    def make(source: str) -> tuple[types.ModuleType, types.ModuleType]:
        plain, _, load = files(source)
        cold = load("cold")
        if request.param == "cold":
            return plain, cold
        return plain, load("warm")  # the same unchanged file: its classes were decided

    return make


EDITED = """
@DECORATE
class Deleted:
    scale = 2.0

    def __init__(self):
        self.v = jnp.zeros(())

    def bump(self):
        self.v = self.v + self.scale
        return self.v

    def gone(self):
        self.v = self.v * 100
        return self.v


del Deleted.gone
Deleted.scale = 3.0


@DECORATE
class Replaced:
    def __init__(self):
        self.v = jnp.zeros(())
        self.w = jnp.ones(())

    def bump(self):
        self.v = self.v + 1
        return self.v


def _new_bump(self):
    self.v = self.v + 10 * self.w
    return self.v


def _new_init(self):
    self.v = jnp.full((), 5.0)
    self.w = jnp.full((), 2.0)


Replaced.bump = _new_bump
Replaced.__init__ = _new_init


@DECORATE
class Base:
    def __init__(self):
        self.v = jnp.zeros(())

    def bump(self):
        self.v = self.v + 1
        return self.v

    def twice(self):
        self.bump()
        return self.bump()


class Child(Base):
    def bump(self):
        self.v = self.v + 100
        return super().bump()


class Other(Base):
    pass


def _base_bump(self):
    self.v = self.v - 1
    return self.v


Base.bump = _base_bump
del Child.bump


@DECORATE
class Added:
    def __init__(self):
        self.v = jnp.zeros(())
        self.count = jnp.zeros((), jnp.int32)

    def step(self, x):
        self.v = self.v + x
        return self.v


def _tick(self, x):
    self.count = self.count + 1
    self.v = self.v * x
    return self.count


Added.tick = _tick
Added.__call__ = lambda self, x: self.step(x) + self.tick(x)
"""


def test_a_method_deleted_and_a_class_attribute_changed(build: Build) -> None:
    def scenario(m: Any) -> Any:
        d = m.Deleted()
        return [d.bump(), d.bump(), hasattr(d, "gone"), hasattr(m.Deleted, "gone")]

    plain, dec = build(EDITED)
    assert_same(scenario(plain), scenario(dec), "scenario")
    check(plain, dec, "Deleted()", [("bump", ()), ("bump", ())])


def test_methods_and_init_replaced_by_module_functions(build: Build) -> None:
    plain, dec = build(EDITED)
    check(plain, dec, "Replaced()", [("bump", ()), ("bump", ())])


@pytest.mark.parametrize("cls", ["Base", "Child", "Other"])
def test_base_method_replaced_and_subclass_override_deleted(build: Build, cls: str) -> None:
    def scenario(m: Any) -> Any:
        c = getattr(m, cls)()
        return [c.bump(), c.twice(), "bump" in vars(getattr(m, cls))]

    plain, dec = build(EDITED)
    assert_same(scenario(plain), scenario(dec), "scenario")
    check(plain, dec, f"{cls}()", [("twice", ()), ("bump", ())])


def test_methods_added_after_the_class_statement_write_state(build: Build) -> None:
    """Eagerly a method set on the class after its statement means what plain
    Python means; inside ``f`` its write of an attribute no method of the class
    statement assigns is the documented refusal (docs/limitations.md, "A method
    added to a class after its class statement"), at the added method's line."""
    plain, dec = build(EDITED)
    calls = [("__call__", (2.0,)), ("tick", (3.0,)), ("__call__", (1.0,))]
    check(plain, dec, "Added()", calls, modes=("eager",))
    f, states = dec.Added().functionalize()
    with pytest.raises(autostate.errors.StateAccessError) as info:
        f(states, 2.0)
    assert "Added.count is not state" in str(info.value) and "fix:" in str(info.value)
    assert f"{dec.__file__}:" in str(info.value)


def test_contextmanager_method_using_state_is_the_documented_generator_error(
    write_module: Loader,
) -> None:
    source = """
import contextlib


@DECORATE
class Scoped:
    def __init__(self):
        self.s = jnp.zeros(())

    @contextlib.contextmanager
    def scaled(self, k):
        old = self.s  # HERE
        self.s = self.s * k
        yield self.s
        self.s = old + self.s
"""
    with pytest.raises(DecorationError, match="generator method 'scaled' uses state 's'") as info:
        pair(write_module, source)
    assert re.search(r"at \S+autostate_testmod_\d+\.py:\d+ \(in Scoped\.scaled\)", str(info.value))
    assert "fix:" in str(info.value)






































def kinds(*names: str) -> list[str]:
    """(``tracked``/``factory`` hold a float state, ``out_mean``, that a ``parameters()``
    walking ``vars(m)`` inside a method must see as an array, as plain Python does.)"""
    return list(names)


# (``from_config`` / ``factory`` build an ``MLP`` / a ``TrackedResidual`` another way:
# the helpers run the same code on them.)
STRUCTURE_KINDS = kinds("mlp_dropout", "tracked", "multihead")


@pytest.mark.parametrize(
    ("kind", "base_decorated"),
    [(k, True) for k in STRUCTURE_KINDS] + [(k, False) for k in STRUCTURE_KINDS],
)
def test_user_helpers_match_plain_eagerly(write_module: Loader, kind: str,
                                          base_decorated: bool) -> None:
    plain, dec = library(write_module, base_decorated)
    template, model, n_out = build_pair(plain, dec, kind)
    x, y = data_for(n_out, 1)[0]
    for when in ("fresh", "after a call"):
        assert repr(template) == repr(model), when
        assert [type(m).__name__ for m in template.modules()] == [
            type(m).__name__ for m in model.modules()], when
        assert template.num_params() == model.num_params(), when
        assert_same(template.parameters(), model.parameters(), f"{when} parameters")
        assert_same(template.l2(), model.l2(), f"{when} l2")
        assert_same(template.regularized(x, y), model.regularized(x, y), f"{when} loss")
        assert_same(template(x), model(x), when)
    assert_same(snapshot(template), snapshot(model))


@pytest.mark.parametrize("kind", kinds("mlp_dropout", "tracked", "multihead"))
def test_user_helpers_through_f_and_on_the_frozen_model(write_module: Loader, kind: str) -> None:
    plain, dec = library(write_module)
    template, model, n_out = build_pair(plain, dec, kind)
    x, y = data_for(n_out, 1)[0]
    f, states = model.functionalize()
    for call in (f.num_params, staged(f.num_params, static_argnums=())):
        n, _ = call(states)
        assert int(n) == template.num_params()
    for call in (f.l2, staged(f.l2)):
        v, _ = call(states)
        assert_same(template.l2(), v)
    ps, _ = f.parameters(states)
    assert_same(template.parameters(), ps)
    frozen = autostate.freeze(f, states)
    assert repr(frozen) == repr(template)
    assert frozen.num_params() == template.num_params()
    assert_same(template.regularized(x, y), frozen.regularized(x, y))


def multi(write_module: Loader) -> tuple[types.ModuleType, types.ModuleType]:
    return pair(write_module, MULTI)




def test_model_holding_a_sub_model_and_its_bound_method(write_module: Loader) -> None:
    plain, dec = multi(write_module)
    template, model = plain.Classifier(KEY), dec.Classifier(KEY)
    data = data_for(None, 2)
    f, states, ref = train_against_reference(template, model, data)
    assert_same(ref[-1][2], states)
    frozen = autostate.freeze(f, states)
    assert frozen.features.__self__ is frozen.backbone
    p = load_plain(template, ref[-1][1], ref[-1][2])
    assert_same(p(data[0][0]), frozen(data[0][0]))
    assert_same(snapshot(p.backbone), snapshot(frozen.backbone))


def test_model_holding_only_a_bound_method_of_another_model(write_module: Loader) -> None:
    """The backbone is reachable only through ``self.features``: its parameters and
    states still belong to the model (plain Python trains and updates them)."""
    plain, dec = multi(write_module)
    template, model = plain.Classifier(KEY, False), dec.Classifier(KEY, False)
    data = data_for(None, 2)
    eager = [model(x) for x, _ in data]
    assert_same([template(x) for x, _ in data], eager, "eager")
    template, model = plain.Classifier(KEY, False), dec.Classifier(KEY, False)
    f, states = model.functionalize()
    names = set(names_of(f)) | set(states)
    assert any("mods[1].mean" in k for k in names), sorted(names)
    step = staged(lambda f, s, x: f(s, x))
    for x, _ in data:
        out, states = step(f, states, x)
        assert_same(template(x), out, "through f")
    mean = [v for k, v in states.items() if k.endswith("mods[1].mean")]
    assert_same(template.features.__self__.body.mods[1].mean, mean[0])


HOLDERS = """
@DECORATE
class Counter:
    def __init__(self):
        self.n = jnp.zeros(())

    def __call__(self, x):
        self.n += 1
        return x * self.n


@DECORATE
class Holder:
    def __init__(self, how):
        c = Counter()
        if how == "lambda":
            self.fn = lambda x: c(x)
        elif how == "bound":
            self.fn = c.__call__
        elif how == "list_bound":
            self.fn = [c.__call__]
        elif how == "dict_bound":
            self.fn = {"a": c.__call__}
        else:
            self.fn = c.__call__
            self.c = c

    def __call__(self, x):
        fn = self.fn
        if isinstance(fn, list):
            fn = fn[0]
        elif isinstance(fn, dict):
            fn = fn["a"]
        return fn(x)
"""


@pytest.mark.parametrize(
    "how",
    ["lambda", "bound", "list_bound", "dict_bound", "bound_and_attribute"],
)
def test_sub_model_reached_through_a_stored_callable(write_module: Loader, how: str) -> None:
    plain, dec = pair(write_module, HOLDERS)
    ref = plain.Holder(how)
    expected = [ref(1.0), ref(2.0)]
    eager = dec.Holder(how)
    assert_same(expected, [eager(1.0), eager(2.0)], "eager")
    f, states0 = dec.Holder(how).functionalize()
    assert list(states0.values())[0].shape == ()
    for jit in (False, True):
        call = staged(f) if jit else f
        got, states = [], states0
        for x in (1.0, 2.0):
            out, states = call(states, x)
            got.append(out)
        assert_same(expected, got, f"jit={jit}")
        assert_same([np.float32(2.0)], list(states.values()), f"jit={jit}")


METHODS = """
import contextlib

@contextlib.contextmanager
def pair_cm(a, b):
    yield a, b

@DECORATE
class Kinds:
    def __init__(self):
        self.c = jnp.zeros(())
        self._t = jnp.zeros(())
        self.n = jnp.zeros((), jnp.int32)
        self.a = jnp.zeros(())
        self.rest = ()

    read = lambda self: self.c * 2
    bump = lambda self, v: setattr(self, "c", self.c + v)

    def _add(self, k, v):
        self.c = self.c + k * v
        return self.c

    double = functools.partialmethod(_add, 2.0)

    @staticmethod
    def static_bump(model, v):
        model.c = model.c + v
        return model.c

    @classmethod
    def class_scale(cls, model, v):
        model.c = model.c * v
        return model.c

    @property
    def t(self):
        return self._t

    @t.setter
    def t(self, v):
        self._t = jnp.clip(v, 0.0, 10.0)
        self.n = self.n + 1

    @t.deleter
    def t(self):
        self._t = jnp.zeros(())

    def __call__(self, v):
        self.c = self.c + v
        return self.read()

    def via_static(self, v):
        return Kinds.static_bump(self, v) + type(self).class_scale(self, 2.0)

    def via_property(self, v):
        self.t = self.t + v
        self.t += v
        return self.t

    def clear(self):
        del self.t
        return self.t

    def nested_writes(self, x):
        def bump(k):
            self.c = self.c + k
            def inner():
                self.a += self.c
            inner()
        bump(x); bump(2 * x)
        g = lambda: [bump(i) for i in range(2)]
        g()
        return self.c + self.a

    def targets(self, xs):
        ys = [self.a * 2 for self.a in xs]
        with pair_cm(xs[0], xs[1]) as (self.a, self.c):
            s = self.a + self.c
        for self.a, *self.rest in [(xs[0], xs[1], xs[2]), (xs[2], xs[1], xs[0])]:
            pass
        return ys, s, self.a + sum(self.rest)

    def object_setattr(self, x):
        object.__setattr__(self, "c", self.c + x)
        super().__setattr__("a", self.a - x)
        return self.c + self.a
"""


XS = jnp.arange(1.0, 4.0)


@pytest.mark.parametrize(
    "calls",
    [
        [("__call__", (X1,)), ("bump", (X2,)), ("read", ())],
        [("double", (X1,)), ("double", (X2,))],
        [("via_static", (X1,)), ("via_static", (X2,))],
        [("via_property", (3.0,)), ("via_property", (4.0,)), ("clear", ())],
        [("nested_writes", (X1,)), ("nested_writes", (X2,))],
        [("targets", (XS,))],
        [("object_setattr", (X1,)), ("object_setattr", (X2,))],
    ],
    ids=[
        "class-body-lambdas",
        "partialmethod",
        "static-and-class-methods",
        "property",
        "nested-writes",
        "comprehension-with-starred-targets",
        "object-setattr",
    ],
)
def test_method_kinds(write_module: Loader, calls: list[Any]) -> None:
    check(*pair(write_module, METHODS), "Kinds()", calls)


CACHED_NORM = """
@DECORATE
class Cached:
    def __init__(self):
        self.w = jnp.ones(2)
        self.c = jnp.zeros(())
    @functools.cached_property
    def norm(self):
        return jnp.sum(self.w ** 2)
    def __call__(self, x):
        self.c = self.c + x * self.norm
        return self.c
"""


def test_cached_property_reading_parameters(write_module: Loader) -> None:
    # Not frozen: a cached_property first used under jit is not kept (documented).
    check(*pair(write_module, CACHED_NORM), "Cached()", TWO_CALLS, modes=("eager", "f", "jit"))


def test_positional_keyword_only_and_var_kwargs_under_jit(write_module: Loader) -> None:
    plain, dec = pair(write_module, SIGNATURES)
    ref = plain.Sig()
    expected = [ref(1.0, 2.0, 3.0, scale=2.0, z=1.0), ref(1.0, scale=1.0)]
    model = dec.Sig()
    assert_same(expected, [model(1.0, 2.0, 3.0, scale=2.0, z=1.0), model(1.0, scale=1.0)])
    f, states = dec.Sig().functionalize()
    jitted = staged(lambda f, s, *a, **k: f(s, *a, **k))
    out1, states = jitted(f, states, 1.0, 2.0, 3.0, scale=2.0, z=1.0)
    out2, states = jitted(f, states, 1.0, scale=1.0)
    assert_same(expected, [out1, out2])
    assert_same(ref.c, states["c"])


CLASS_BODY_HELPER = """
@DECORATE
class Tagged:
    def _tag(fn):
        fn.tagged = True
        return fn

    def __init__(self):
        self.c = jnp.zeros(())

    @_tag
    def __call__(self, x):
        self.c = self.c + x
        return self.c
"""


def test_class_body_helper_decorator(write_module: Loader) -> None:
    check(*pair(write_module, CLASS_BODY_HELPER), "Tagged()", TWO_CALLS)


INIT_CALLS_THROUGH_CLASS = """
@DECORATE
class Resettable:
    def __init__(self):
        type(self).reset(self)
    def reset(self):
        self.c = jnp.zeros(())
    def __call__(self, x):
        self.c = self.c + x
        return self.c
"""


def test_init_calling_a_method_through_the_class(write_module: Loader) -> None:
    check(*pair(write_module, INIT_CALLS_THROUGH_CLASS), "Resettable()", TWO_CALLS)


SINGLEDISPATCH = """
@DECORATE
class Dispatch:
    def __init__(self):
        self.c = jnp.zeros(())
        self.n = jnp.zeros(())

    @functools.singledispatchmethod
    def add(self, v):
        self.c = self.c + v
        return self.c

    @add.register
    def _(self, v: int):
        self.n = self.n + v
        return self.n
"""


def test_singledispatchmethod_writes(write_module: Loader) -> None:
    check(
        *pair(write_module, SINGLEDISPATCH),
        "Dispatch()",
        [("add", (1.5,)), ("add", (2,))],
        modes=("eager", "f"),
    )


CACHED_WRITES = """
@DECORATE
class CachedWrites:
    def __init__(self):
        self.c = jnp.zeros(())
        self.hits = jnp.zeros(())
    @functools.cached_property
    def scale(self):
        self.hits = self.hits + 1
        return 2.0
    def __call__(self, x):
        self.c = self.c + x * self.scale
        return self.c + self.hits
"""


def test_cached_property_writing_state(write_module: Loader) -> None:
    check(*pair(write_module, CACHED_WRITES), "CachedWrites()", TWO_CALLS, modes=("eager", "f"))


PARTIALMETHOD_FOREIGN = """
def _bump(self, k, x):
    self.c = self.c + k * x
    return self.c

@DECORATE
class Partial:
    def __init__(self):
        self.c = jnp.zeros(())
    double = functools.partialmethod(_bump, 2.0)
"""


def test_partialmethod_of_a_module_function(write_module: Loader) -> None:
    check(
        *pair(write_module, PARTIALMETHOD_FOREIGN),
        "Partial()",
        [("double", (X1,)), ("double", (X2,))],
        modes=("eager", "f"),
    )


def test_class_body_lambdas_through_f(write_module: Loader) -> None:
    plain, dec = pair(write_module, RUNTIME)
    ref = plain.Tabs()
    ref.bump(X1)
    ref.poke(ref, X2)
    f, states = dec.Tabs().functionalize()
    _, states = staged(lambda f, s: f.bump(s, X1))(f, states)
    _, states = f.poke(states, f.model, X2)
    assert_same(ref.c, states["c"])




CLOSURE_CALLS = {
    "use_now": [("use_now", (X1,)), ("use_now", (X2,))],
    "use_lambda": [("use_lambda", (X1,)), ("use_lambda", (X2,))],
    "closures_in_list": [("closures_in_list", (X1,))],
    "closure_in_scan": [("closure_in_scan", (XS3,)), ("closure_in_scan", (XS3,))],
    "closure_as_scan_body": [("closure_as_scan_body", (XS3,))],
    "closure_in_cond": [("closure_in_cond", (X1,)), ("closure_in_cond", (X2,))],
    "closure_in_checkpoint": [("closure_in_checkpoint", (X1,))],
}


# The cases a family's grad/vmap test traces (under ``staged``) run eagerly and
# through ``f`` in the family's differential test; the others in every mode.
EAGER_F = ("eager", "f")
ALL_MODES = ("eager", "f", "jit", "freeze")
CLOSURES_TRACED = {"use_now", "closure_in_checkpoint", "closure_in_cond"}


@pytest.mark.parametrize("case", sorted(CLOSURE_CALLS))
def test_closures_returned_by_methods_and_called_in_the_call(
    write_module: Loader, case: str
) -> None:
    plain, dec = pair(write_module, CLOSURES)
    modes = EAGER_F if case in CLOSURES_TRACED else ALL_MODES
    check(plain, dec, "Acc()", CLOSURE_CALLS[case], modes=modes)


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_closures_under_grad_and_vmap(write_module: Loader, transform: str) -> None:
    plain, dec = pair(write_module, CLOSURES)
    x = X1 if transform == "grad" else jnp.arange(3.0)
    calls = [("use_now", (X,)), ("closure_in_checkpoint", (X,))]
    if transform == "grad":  # the plain reference's Python ``if`` needs a concrete predicate
        calls.append(("closure_in_cond", (X,)))
    assert {name for name, _ in calls} <= CLOSURES_TRACED
    check_transform(plain, dec, "Acc()", calls, x, transform)


def test_closure_called_after_the_method_returned_eagerly(write_module: Loader) -> None:
    plain, dec = pair(write_module, CLOSURES)
    p, d = plain.Acc(), dec.Acc()
    bp, bd = p.make_bumper(2.0), d.make_bumper(2.0)
    outs_p = [bp(X1), p._add(X2), bp(X2)]
    outs_d = [bd(X1), d._add(X2), bd(X2)]
    assert_same(outs_p, outs_d, "outputs")
    assert_same(snapshot(p), snapshot(d), "attributes")


STORED_CLOSURE = """
@DECORATE
class Armed:
    def __init__(self):
        self.n = jnp.zeros(())
        self.cb = None

    def arm(self, k):
        self.cb = lambda x: self._add(x * k)

    def _add(self, x):
        self.n = self.n + x
        return self.n

    def __call__(self, x):
        if self.cb is None:
            return self._add(x)
        return self.cb(x)
"""


def test_closure_stored_in_a_state_eagerly(write_module: Loader) -> None:
    plain, dec = pair(write_module, STORED_CLOSURE)
    p, d = plain.Armed(), dec.Armed()
    outs = []
    for m in (p, d):
        outs.append([m(X1), m.arm(2.0), m(X2), m(X1)])
    assert_same(outs[0], outs[1], "outputs")
    assert_same(snapshot(p), snapshot(d), "attributes")


def test_closure_stored_in_a_state_then_functionalized(write_module: Loader) -> None:
    """A state holding a lambda over the model, armed eagerly: f must write f's
    copy (the states it returns), never the eager model."""
    plain, dec = pair(write_module, STORED_CLOSURE)
    p = plain.Armed()
    p.arm(2.0)
    expected = [p(X1), p(X2)]
    model = dec.Armed()
    model.arm(2.0)
    for jit in (False, True):
        f, states = model.functionalize()
        step = staged(lambda f, s, x: f(s, x)) if jit else (lambda f, s, x: f(s, x))
        outs = []
        for x in (X1, X2):
            out, states = step(f, states, x)
            outs.append(out)
        assert_same(expected, outs, f"outputs jit={jit}")
        assert_same(p.n, states["n"], f"state jit={jit}")
        assert_same(np.float32(0.0), model.n, "the eager model is unchanged")


HOOK_BUILDS = {
    "module-functions": "with_hooks(Layer(), count_hook, scale_hook)",
    "bound-method": "with_bound_pre(Layer())",
    "lambda-over-model": "with_lambda_pre(Layer())",
    "nested-function": "with_nested_pre(Layer())",
    "across-models": "cross_hooked()",
    "partial-without-model": "with_partial_hook(Layer())",
}


HOOKS_TRACED = ["module-functions", "across-models"]


@pytest.mark.parametrize("case", sorted(HOOK_BUILDS))
def test_hooks_registered_from_outside(write_module: Loader, case: str) -> None:
    plain, dec = pair(write_module, HOOKS)
    modes = EAGER_F if case in HOOKS_TRACED else ALL_MODES
    check(plain, dec, HOOK_BUILDS[case], [("__call__", (X1,)), ("__call__", (X2,))], modes=modes)


@pytest.mark.parametrize("transform", ["grad", "vmap"])
@pytest.mark.parametrize("case", HOOKS_TRACED)
def test_hooks_under_grad_and_vmap(write_module: Loader, case: str, transform: str) -> None:
    plain, dec = pair(write_module, HOOKS)
    x = X1 if transform == "grad" else jnp.arange(3.0)
    check_transform(plain, dec, HOOK_BUILDS[case], [("__call__", (X,))] * 2, x, transform)


def test_hook_registered_after_functionalize_does_not_reach_f(write_module: Loader) -> None:
    """f was taken before the hook: like a copy made before, it runs without it."""
    plain, dec = pair(write_module, HOOKS)
    ref = plain.Layer()
    expected = [ref(X1)]
    model = dec.Layer()
    f, states = model.functionalize()
    model.hooks.append(plain.scale_hook)
    out, states = f(states, X1)
    assert_same(expected, [out], "f ran without the late hook")
    assert_same(ref.n, states["n"], "state")


def test_hook_closing_over_a_model_outside_the_graph(write_module: Loader) -> None:
    """A hook lambda whose cell holds another model: functionalize() follows the
    closure (documented: a lambda naming a model directly is rebound to f's copy),
    so that model's states join f's; the eager one stays as it was, as any
    sub-model of a functionalized model does."""
    plain, dec = pair(write_module, HOOKS)
    p_other = plain.Layer()
    p = plain.with_foreign_hook(plain.Layer(), p_other)
    expected = [p(X1), p(X2)]
    d_other = dec.Layer()
    model = dec.with_foreign_hook(dec.Layer(), d_other)
    for jit in (False, True):
        f, states = model.functionalize()
        step = staged(lambda f, s, x: f(s, x)) if jit else (lambda f, s, x: f(s, x))
        outs = []
        for x in (X1, X2):
            out, states = step(f, states, x)
            outs.append(out)
        assert_same(expected, outs, "outputs")
        assert_same(p.n, states["n"], "state")
        (other_key,) = [k for k in states if k.endswith(".seen")]
        assert_same(p_other.seen, states[other_key], "the other model's state")
        assert_same(np.float32(0.0), d_other.seen, "the eager other model is unchanged")
        no_tracer(d_other)


def test_partial_over_the_model_in_a_hook_list_is_refused(write_module: Loader) -> None:
    """``functools.partial(hook, model)`` in a list: documented refusal at
    functionalize, naming the path."""
    plain, dec = pair(write_module, HOOKS)
    p, d = plain.with_partial_in_list(plain.Layer()), dec.with_partial_in_list(dec.Layer())
    assert_same(p(X1), d(X1), "eager")
    assert_same(snapshot(p), snapshot(d), "eager attributes")
    with pytest.raises(autostate.errors.InvalidTypeError, match=r"hooks\[0\]") as info:
        d.functionalize()
    assert_user_line(info.value, __file__)


def test_partial_over_the_model_in_an_ordered_dict_of_hooks(write_module: Loader) -> None:
    plain, dec = pair(write_module, HOOKS)
    try:
        check(plain, dec, "with_partial_over_model(Layer())", [("__call__", (X1,))] * 2)
    except autostate.errors.InvalidTypeError as err:  # the documented refusal, as in a list
        assert "pre['p'].args[0]" in str(err)
        assert_user_line(err, check.__code__.co_filename)  # where check() functionalizes


def test_one_shot_hook_eagerly_like_plain(write_module: Loader) -> None:
    plain, dec = pair(write_module, ONE_SHOT)
    check(plain, dec, "with_hooks(Layer(), one_shot)", [("__call__", (X1,))] * 2, modes=("eager",))


DISPATCH_CASES = {
    "via_class_table": [("via_class_table", (X1,)), ("via_class_table", (X2,))],
    "via_partialmethod": [("via_partialmethod", (X1,)), ("via_partialmethod", (X2,))],
    "via_getattr": [("via_getattr", (X1,)), ("via_getattr", (X2,))],
    "via_methodcaller": [("via_methodcaller", (X1,))],
    "via_attrgetter": [("via_attrgetter", (X1,))],
    "via_map": [("via_map", (XS3,)), ("via_map", (XS3,))],
    "via_reduce": [("via_reduce", (XS3,))],
    "via_tree_map": [("via_tree_map", (X1,))],
    "via_partial": [("via_partial", (X1,)), ("via_partial", (X2,))],
    "scan_getattr": [("scan_getattr", (XS3,))],
    "scan_class_table": [("scan_class_table", (XS3,))],
    "scan_partial": [("scan_partial", (XS3,))],
    "scan_methodcaller": [("scan_methodcaller", (XS3,))],
    "fori_dispatch": [("fori_dispatch", (X1,))],
}


DISPATCH_TRACED = ["via_class_table", "via_partialmethod", "via_getattr", "fori_dispatch"]


@pytest.mark.parametrize("case", sorted(DISPATCH_CASES))
def test_dispatch_roads_to_state(write_module: Loader, case: str) -> None:
    plain, dec = pair(write_module, DISPATCH)
    modes = EAGER_F if case in DISPATCH_TRACED else ALL_MODES
    check(plain, dec, "Disp()", DISPATCH_CASES[case], modes=modes)


def test_sorted_key_writing_state_eagerly_and_in_f(write_module: Loader) -> None:
    """``float(x)`` in the key needs a concrete value: eager and un-jitted f only."""
    plain, dec = pair(write_module, DISPATCH)
    check(
        plain, dec, "Disp()", [("via_sorted", (X1,)), ("via_sorted", (X2,))], modes=("eager", "f")
    )


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_dispatch_under_grad_and_vmap(write_module: Loader, transform: str) -> None:
    plain, dec = pair(write_module, DISPATCH)
    x = X1 if transform == "grad" else jnp.arange(3.0)
    calls = [(name, (X,)) for name in DISPATCH_TRACED]
    check_transform(plain, dec, "Disp()", calls, x, transform)


SINGLEDISPATCH_TYPED = """
import functools


@DECORATE
class Typed:
    def __init__(self):
        self.n = jnp.zeros(())
        self.k = jnp.zeros(())

    @functools.singledispatchmethod
    def feed(self, x):
        self.n = self.n + x
        return self.n

    @feed.register
    def _(self, x: int):
        self.k = self.k + x
        return self.k

    def __call__(self, x):
        return self.feed(x) + self.feed(2)
"""


def test_singledispatchmethod_writing_state(write_module: Loader) -> None:
    plain, dec = pair(write_module, SINGLEDISPATCH_TYPED)
    check(plain, dec, "Typed()", [("__call__", (X1,)), ("__call__", (X2,))])


PARTIALMETHOD_OF_FUNCTION = """
def _accumulate(self, x, scale):
    self.n = self.n + x * scale
    return self.n


@DECORATE
class Acc2:
    def __init__(self):
        self.n = jnp.zeros(())

    add_twice = functools.partialmethod(_accumulate, scale=2.0)
"""


def test_partialmethod_of_a_module_function_writing_state(write_module: Loader) -> None:
    plain, dec = pair(write_module, PARTIALMETHOD_OF_FUNCTION)
    check(plain, dec, "Acc2()", [("add_twice", (X1,)), ("add_twice", (X2,))])


def _outside_pair(write_module: Loader) -> tuple[types.ModuleType, types.ModuleType]:
    import sys

    if "written_helpers" not in sys.modules:
        write_module(HELPER_MODULE, name="written_helpers")
    return pair(write_module, OUTSIDE)


OUTSIDE_CASES = {
    "local": [("local", (X1,)), ("local", (X2,))],
    "other_module": [("other_module", (X1,)), ("other_module", (X2,))],
    "other_module_list": [("other_module_list", (X1,)), ("other_module_list", (X2,))],
    "method_alias_append": [("method_alias_append", (X1,)), ("method_alias_append", (X2,))],
    "other_module_autostate_scan": [("other_module_autostate_scan", (XS3,))],
    "duck_typed": [("duck_typed", (X1,)), ("duck_typed", (X2,))],
}


OUTSIDE_TRACED = ["local", "other_module", "duck_typed"]


@pytest.mark.parametrize("case", list(OUTSIDE_CASES))
def test_code_outside_the_class(write_module: Loader, case: str) -> None:
    plain, dec = _outside_pair(write_module)
    modes = EAGER_F if case in OUTSIDE_TRACED else ALL_MODES
    check(plain, dec, "Out()", OUTSIDE_CASES[case], modes=modes)


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_code_outside_the_class_under_grad_and_vmap(write_module: Loader, transform: str) -> None:
    plain, dec = _outside_pair(write_module)
    x = X1 if transform == "grad" else jnp.arange(3.0)
    calls = [(name, (X,)) for name in OUTSIDE_TRACED]
    check_transform(plain, dec, "Out()", calls, x, transform)


CALLBACKS = """
import types
import weakref


def _module_step(model, x):
    model.own = model.own * 2 + x
    return model.own


@DECORATE
class Stats:
    def __init__(self):
        self.mean = jnp.zeros(())
        self.count = jnp.zeros((), jnp.int32)

    def observe(self, x):
        self.mean = 0.5 * self.mean + 0.5 * x
        self.count = self.count + 1
        return x * 2


@DECORATE
class Runner:
    def __init__(self):
        self.w = jnp.asarray(1.5)
        self.ticks = jnp.zeros(())

    def run_loop(self, cb, xs):
        out = jnp.zeros(())
        for x in xs:
            self.ticks = self.ticks + 1
            out = out + cb(x * self.w)
        return out

    def run_scan(self, cb, xs):
        def body(c, x):
            self.ticks = self.ticks + 1
            return c + cb(x * self.w), None
        return lax.scan(body, jnp.zeros(()), xs)[0]

    def run_fori(self, cb, x):
        def body(i, c):
            self.ticks = self.ticks + 1
            return c + cb(x + i)
        return lax.fori_loop(0, 3, body, jnp.zeros(()))


@DECORATE
class Parent:
    def __init__(self):
        self.stats = Stats()
        self.runner = Runner()
        self.alias = self.stats
        self.cb = self.stats.observe
        self.own = jnp.zeros(())
        self.weak = weakref.WeakMethod(self.stats.observe)
        self.bound = types.MethodType(_module_step, self)

    def _on_step(self, x):
        self.own = self.own + x
        return self.alias.observe(x)

    def sibling_loop(self, xs):
        return self.runner.run_loop(self.stats.observe, xs)

    def sibling_scan(self, xs):
        return self.runner.run_scan(self.stats.observe, xs)

    def stored_cb_scan(self, xs):
        return self.runner.run_scan(self.cb, xs)

    def parent_cb_fori(self, x):
        return self.runner.run_fori(self._on_step, x)

    def cond_between_models(self, x):
        return lax.cond(x > 1.6, self.stats.observe, self._on_step, x)

    def switch_between_models(self, i, x):
        return lax.switch(i, [self.stats.observe, self._on_step, self.cb], x)

    def map_sibling(self, xs):
        return lax.map(self.alias.observe, xs)

    def while_sibling(self, x):
        return lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] + self.cb(c[1])),
                              (0, x))[1]

    def checkpoint_runner(self, xs):
        return checkpoint(functools.partial(self.runner.run_scan, self.stats.observe))(xs)

    def method_type_cb(self, x):
        return self.runner.run_fori(self.bound, x)

    def weak_cb(self, x):
        return self.weak()(x) + self.bound(x)

    def lambda_cb_scan(self, xs):
        return self.runner.run_scan(lambda v: self._on_step(v) + self.stats.observe(v), xs)
"""


CALLBACK_CASES = {
    "sibling_loop": [("sibling_loop", (XS3,)), ("sibling_loop", (XS3,))],
    "sibling_scan": [("sibling_scan", (XS3,)), ("sibling_scan", (XS3,))],
    "stored_cb_scan": [("stored_cb_scan", (XS3,))],
    "parent_cb_fori": [("parent_cb_fori", (X1,)), ("parent_cb_fori", (X2,))],
    "lambda_cb_scan": [("lambda_cb_scan", (XS3,))],
    "cond_between_models": [("cond_between_models", (X1,)), ("cond_between_models", (X2,))],
    "switch_between_models": [
        ("switch_between_models", (0, X1)),
        ("switch_between_models", (1, X2)),
        ("switch_between_models", (2, X1)),
    ],
    "map_sibling": [("map_sibling", (XS3,))],
    "while_sibling": [("while_sibling", (X1,))],
    "checkpoint_runner": [("checkpoint_runner", (XS3,))],
    "method_type_cb": [("method_type_cb", (X1,)), ("method_type_cb", (X2,))],
}


CALLBACKS_TRACED = ["sibling_scan", "stored_cb_scan", "lambda_cb_scan"]


@pytest.mark.parametrize("case", sorted(CALLBACK_CASES))
def test_model_methods_as_callbacks_of_other_models(write_module: Loader, case: str) -> None:
    plain, dec = pair(write_module, CALLBACKS)
    modes = EAGER_F if case in CALLBACKS_TRACED else ALL_MODES
    check(plain, dec, "Parent()", CALLBACK_CASES[case], modes=modes)


def test_weak_method_callback_follows_the_running_model(write_module: Loader) -> None:
    plain, dec = pair(write_module, CALLBACKS)
    check(plain, dec, "Parent()", [("weak_cb", (X1,)), ("weak_cb", (X2,))], modes=("f",))


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_callbacks_under_grad_and_vmap(write_module: Loader, transform: str) -> None:
    plain, dec = pair(write_module, CALLBACKS)
    calls = [(name, (X,)) for name in CALLBACKS_TRACED]
    x = XS3 if transform == "grad" else jnp.arange(6.0).reshape(2, 3)
    check_transform(plain, dec, "Parent()", calls, x, transform)


def test_a_callback_from_outside_passed_to_f(write_module: Loader) -> None:
    """A sub-model method of the *eager* model passed into f as the callback:
    plain Python writes that model; through f it writes the eager model eagerly
    and is refused under jit."""
    plain, dec = pair(write_module, CALLBACKS)
    p = plain.Runner()
    ps = plain.Stats()
    expected = p.run_loop(ps.observe, XS3)
    r, s = dec.Runner(), dec.Stats()
    f, states = r.functionalize()
    out, states = f.run_loop(states, s.observe, XS3)
    assert_same(expected, out, "output")
    assert_same(snapshot(ps), snapshot(s), "the eager Stats was written like plain Python")
    assert_same(p.ticks, states["ticks"], "ticks")
    s2 = dec.Stats()
    with pytest.raises(TracedEagerStateError, match="'mean'"):
        staged(lambda st, xs: f.run_loop(st, s2.observe, xs))(states, XS3)
    no_tracer(s2)


GEN_CASES = {
    "consume": [("consume", (X1,)), ("consume", (X2,))],
    "zipped": [("zipped", (XS3,))],
    "with_mode": [("with_mode", (X1,)), ("with_mode", (X2,))],
}


@pytest.mark.parametrize("case", sorted(GEN_CASES))
def test_generators_and_context_managers_outside_the_class(write_module: Loader, case: str) -> None:
    plain, dec = pair(write_module, GENS)
    check(plain, dec, "Gen()", GEN_CASES[case])


def test_generator_method_writing_state_is_the_documented_decoration_error(
    write_module: Loader,
) -> None:
    source = """
@DECORATE
class Stream:
    def __init__(self):
        self.n = jnp.zeros(())

    def steps(self, k):
        for i in range(k):
            self.n = self.n + i
            yield self.n
"""
    with pytest.raises(DecorationError, match="generator method 'steps' uses state 'n'") as info:
        pair(write_module, source)
    assert "autostate_testmod_" in str(info.value) and "fix:" in str(info.value)






USER_DECORATORS = """
import time

CALLS = []


def timed(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kw):
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        CALLS.append(("timed", fn.__name__, time.perf_counter() >= t0))
        return out
    return wrapper


def logged(fn):
    # no functools.wraps: a bare closure over the method
    def wrapper(self, *args):
        CALLS.append(("logged", len(args)))
        return fn(self, *args)
    return wrapper


def repeat(n):
    def deco(fn):
        @functools.wraps(fn)
        def wrapper(self, *args):
            out = None
            for _ in range(n):
                out = fn(self, *args)
            return out
        return wrapper
    return deco


def when(flag_name):
    def deco(fn):
        @functools.wraps(fn)
        def wrapper(self, x):
            if getattr(self, flag_name):
                return fn(self, x)
            return x
        return wrapper
    return deco


def using(ahelper):
    # no functools.wraps, and a function of the class body in the closure besides
    def deco(zfn):
        def wrapper(self, x):
            return zfn(self, ahelper(self, x))
        return wrapper
    return deco


def twice_sum(fn):
    @functools.wraps(fn)
    def wrapper(self, x):
        return fn(self, x) + fn(self, x * 2)
    return wrapper


@DECORATE
class Wrapped:
    def __init__(self, on=True):
        self.on = on
        self.s = jnp.zeros(())
        self.n = jnp.zeros((), jnp.int32)
        self.hits = jnp.zeros(())  # a state only the method under `logged` assigns
        self.deep = jnp.zeros(())  # only `stacked` (`logged` under wraps-style ones)
        self.outer = jnp.zeros(())  # only `logged_timed` (`logged` over `timed`)
        self.helped_total = jnp.zeros(())  # only `helped` (`using(doubled_input)`)

    @timed
    def timed_step(self, x):
        self.s = self.s + x
        return self.s

    @logged
    def logged_step(self, x):
        self.hits = self.hits + x
        self.n = self.n + 1
        self.s = self.s * 2 + x
        return self.s

    @repeat(3)
    def thrice(self, x):
        self.s = self.s + x
        self.n += 1
        return self.s

    @when("on")
    def gated(self, x):
        self.s = self.s - x
        return self.s

    @twice_sum
    def doubled(self, x):
        self.s = self.s + x
        return self.s

    @timed
    @repeat(2)
    @logged
    def stacked(self, x):
        self.deep = self.deep + x
        self.n = self.n + 1
        self.s = self.s + x * self.n
        return self.s

    def doubled_input(self, x):
        return x * 2

    @using(doubled_input)
    def helped(self, x):
        self.helped_total = self.helped_total + x
        return self.helped_total

    @logged
    @timed
    def logged_timed(self, x):
        self.outer = self.outer + x
        return self.outer
"""


WRAPPED_CASES = {
    "timed": ("Wrapped()", [("timed_step", (X1,)), ("timed_step", (X2,))]),
    "logged-no-wraps": ("Wrapped()", [("logged_step", (X1,)), ("logged_step", (X2,))]),
    "decorator-with-args": ("Wrapped()", [("thrice", (X1,)), ("thrice", (X2,))]),
    "conditional-on": ("Wrapped(True)", [("gated", (X1,)), ("gated", (X2,))]),
    "conditional-off": ("Wrapped(False)", [("gated", (X1,)), ("gated", (X2,))]),
    "calls-twice": ("Wrapped()", [("doubled", (X1,)), ("doubled", (X2,))]),
    "stacked": ("Wrapped()", [("stacked", (X1,)), ("stacked", (X2,))]),
    "logged-over-timed": ("Wrapped()", [("logged_timed", (X1,)), ("logged_timed", (X2,))]),
    "given-a-helper": ("Wrapped()", [("helped", (X1,)), ("helped", (X2,))]),
}


@pytest.mark.parametrize("case", sorted(WRAPPED_CASES))
def test_user_decorators_on_methods(write_module: Loader, case: str) -> None:
    plain, dec = pair(write_module, USER_DECORATORS)
    build, calls = WRAPPED_CASES[case]
    plain.CALLS.clear()
    dec.CALLS.clear()
    check(plain, dec, build, calls, modes=("eager",))
    # one eager run each: the wrappers' side effects happen as often
    assert plain.CALLS == dec.CALLS
    check(plain, dec, build, calls, modes=("f",) if case in WRAPPED_TRACED else ("f", "jit", "freeze"))


# traced by test_user_decorators_under_grad_and_vmap
WRAPPED_TRACED = {"stacked": "stacked", "calls-twice": "doubled", "decorator-with-args": "thrice"}


def test_user_decorators_under_grad_and_vmap(write_module: Loader) -> None:
    plain, dec = pair(write_module, USER_DECORATORS)
    calls = [(name, (X,)) for name in WRAPPED_TRACED.values()]
    check_transform(plain, dec, "Wrapped()", calls, X1, "grad")
    check_transform(plain, dec, "Wrapped()", calls, jnp.arange(3.0), "vmap")


MADE_CASES = {
    "loop-in-class-body": ("Looped()", [("add1", (X1,)), ("add3", (X2,)), ("add2", (X1,))]),
    "factory-in-class-body": ("Looped()", [("mul", (X1,)), ("add1", (X2,))]),
    "borrowed": ("Borrower()", [("__call__", (X1,)), ("forward", (X2,))]),
}


@pytest.mark.parametrize("case", sorted(MADE_CASES))
def test_methods_made_by_code(write_module: Loader, case: str) -> None:
    plain, dec = pair(write_module, MADE)
    build, calls = MADE_CASES[case]
    check(plain, dec, build, calls)


BORROW_LATE = """
@DECORATE
class Donor:
    def __init__(self):
        self.s = jnp.zeros(())

    def forward(self, x):
        self.s = self.s * 2 + x
        return self.s


FIRST = Donor()          # Donor is complete: Donor.forward is the rewritten one
FIRST.forward(1.0)


@DECORATE
class Borrower:
    forward = Donor.forward

    def __init__(self):
        self.s = jnp.ones(())

    def __call__(self, x):
        return self.forward(x) + self.s
"""


def test_method_borrowed_from_a_completed_decorated_class(write_module: Loader) -> None:
    plain, dec = pair(write_module, BORROW_LATE)
    p, d = plain.Borrower(), dec.Borrower()
    assert_same(p.forward(X1), d.forward(X1), "eager output")
    assert_same(snapshot(p), snapshot(d), "b.s after one eager call")  # a raw request: fails here
    check(plain, dec, "Borrower()", [("__call__", (X1,)), ("forward", (X2,))])
    check(plain, dec, "Donor()", [("forward", (X1,))])


REPLACED = """
import types


@DECORATE
class Net:
    def __init__(self):
        self.s = jnp.zeros(())
        self.w = jnp.full((), 2.0)

    def __call__(self, x):
        self.s = self.s + x
        return self.s * self.w

    def forward(self, x):
        return self(x) + 1


class SubNet(Net):
    def __init__(self):
        super().__init__()
        self.t = jnp.zeros(())

    def __call__(self, x):
        self.t = self.t - x
        return super().__call__(x) + self.t


def new_call(self, x):
    # replaces Net.__call__ after the first instance: not rewritten
    self.s = self.s * 3 + x
    return self.s - self.w


def new_forward(self, x):
    self.s = self.s + 100 * x
    return self.s


def timed(fn):
    @functools.wraps(fn)
    def wrapper(self, *a):
        self.s = self.s + 0.5
        return fn(self, *a)
    wrapper.timed = True
    return wrapper


def build_replaced():
    first = Net()
    first(1.0)
    Net.__call__ = new_call
    return Net()


def build_subclass_replaced():
    SubNet()
    SubNet.__call__ = new_call     # the subclass's, not Net's
    return SubNet()


def build_wrapped_later():
    Net()
    if not getattr(Net.forward, "timed", False):   # once per module
        Net.forward = timed(Net.forward)
    return Net()


def build_instance_method():
    m = Net()
    m.forward = types.MethodType(new_forward, m)
    return m
"""


REPLACED_CASES = {
    "class-call-replaced": ("build_replaced()", [("__call__", (X1,)), ("forward", (X2,))]),
    "subclass-call-replaced": (
        "build_subclass_replaced()",
        [("__call__", (X1,)), ("forward", (X2,))],
    ),
    "wrapped-after-first-instance": (
        "build_wrapped_later()",
        [("forward", (X1,)), ("forward", (X2,))],
    ),
    "instance-method-type": ("build_instance_method()", [("forward", (X1,)), ("__call__", (X2,))]),
}


@pytest.mark.parametrize("case", sorted(REPLACED_CASES))
def test_methods_replaced_after_the_first_instance(write_module: Loader, case: str) -> None:
    # each case edits its own module's classes: a fresh pair per case
    plain, dec = pair(write_module, REPLACED + f"\n# {case}\n")
    build, calls = REPLACED_CASES[case]
    check(plain, dec, build, calls)


def test_instance_method_type_is_what_f_forward_calls(write_module: Loader) -> None:
    plain, dec = pair(write_module, REPLACED + "\n# method-type-f\n")
    ref = plain.build_instance_method()
    expected = ref.forward(X1)
    f, states = dec.build_instance_method().functionalize()
    out, states = f.forward(states, X1)
    assert_same(expected, out)
    assert_same(np.asarray(ref.s), states["s"])
    out, states = staged(lambda f, s, x: f.forward(s, x))(f, states, X2)
    assert_same(ref.forward(X2), out)
    assert_same(np.asarray(ref.s), states["s"])


LRU = """
@DECORATE
class Cached:
    def __init__(self):
        self.s = jnp.zeros(())

    @functools.lru_cache(maxsize=None)
    def cached(self, k):
        self.s = self.s + k   # HERE
        return k * 2
"""


def test_lru_cache_on_a_state_writing_method_is_the_documented_error(write_module: Loader) -> None:
    """``functools.lru_cache`` keeps the function in a C wrapper, not a
    closure: the documented 'decorator autostate cannot see through'."""
    with pytest.raises(DecorationError, match="cannot reach the function inside") as info:
        pair(write_module, LRU)
    assert "@functools.lru_cache" in error_line(info.value)


def test_partial_over_the_instance_held_as_a_method(write_module: Loader) -> None:
    """``m.forward = functools.partial(Fwd.alt, m)``: plain Python eagerly;
    ``functionalize()`` is the documented ``InvalidTypeError`` (a partial
    holding the model), naming the line that functionalizes."""
    plain, dec = pair(write_module, SRC2)
    check(
        plain, dec, "partial_forward()", [("forward", (X1,)), ("forward", (X2,))], modes=("eager",)
    )
    model = dec.partial_forward()
    with pytest.raises(InvalidTypeError, match="functools.partial") as info:
        model.functionalize()
    assert_user_line(info.value, __file__)


COUNTING = """
def counting(fn):
    @functools.wraps(fn)
    def wrapper(self, *a):
        self.ncalls = self.ncalls + 1   # HERE: the wrapper runs as the method
        return fn(self, *a)
    return wrapper


@DECORATE
class Counted:
    def __init__(self):
        self.ncalls = jnp.zeros((), jnp.int32)
        self.s = jnp.zeros(())

    @counting
    def __call__(self, x):
        self.s = self.s + x
        return self.s


@DECORATE
class Auto:
    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if "__call__" in cls.__dict__:
            cls.__call__ = counting(cls.__call__)

    def __init__(self):
        self.ncalls = jnp.zeros((), jnp.int32)
        self.s = jnp.zeros(())

    def __call__(self, x):
        return x


class AutoSub(Auto):
    def __call__(self, x):
        self.s = self.s + x * self.ncalls
        return self.s
"""


@pytest.mark.parametrize("build", ["Counted()", "AutoSub()"], ids=["class-body", "init-subclass"])
def test_a_wrapper_that_writes_state(write_module: Loader, build: str) -> None:
    plain, dec = pair(write_module, COUNTING)
    check(plain, dec, build, [("__call__", (X1,)), ("__call__", (X2,))])


MORE_CASES = {
    "template-forward": ("Lin()", [("__call__", (X1,)), ("__call__", (X2,))]),
    "instance-forward-via-call": ("patched()", [("__call__", (X1,)), ("forward", (X2,))]),
    "super-in-lambda": ("Q()", [("step", (X1,)), ("step", (X2,))]),
    "super-in-scan-body": ("Q()", [("scanned", (jnp.arange(3.0),)), ("step", (X1,))]),
    "static-base-array-sub": ("S1()", [("__call__", (X1,)), ("__call__", (X2,))]),
    "set-before-super-init": ("Early()", [("step", (X1,)), ("step", (X2,))]),
    "no-super-init": ("NoSuper()", [("step", (X1,)), ("step", (X2,))]),
    "generic-alias-instance": ("Box[jax.Array](jnp.ones(()))", [("put", (X1,)), ("put", (X2,))]),
}


@pytest.mark.parametrize("case", sorted(MORE_CASES))
def test_more_ways_to_reach_methods(write_module: Loader, case: str) -> None:
    plain, dec = pair(write_module, MORE)
    build, calls = MORE_CASES[case]
    check(plain, dec, build, calls)


LATE_SETATTR = """
@DECORATE
class Late:
    def __init__(self):
        self.s = jnp.zeros(())
        self.u = jnp.zeros(())

    def bump(self, x):
        self.s = self.s + x
        return self.s


Late()


def late(self, x):
    self.s = self.s - x
    self.u = self.u * 3 + 1   # HERE: u is no state of Late
    return self.s


Late.late = late   # after the first instance: not rewritten
"""


def test_method_set_after_the_first_instance_writing_a_non_state(write_module: Loader) -> None:
    """Documented: a method added after the first instance is not rewritten;
    its write of a state goes through the descriptor, and its write of a
    non-state is refused inside a functionalized call, naming the line."""
    plain, dec = pair(write_module, LATE_SETATTR)
    check(plain, dec, "Late()", [("late", (X1,)), ("bump", (X2,))], modes=("eager",))
    f, states = dec.Late().functionalize()
    with pytest.raises(StateAccessError, match="Late.u is not state") as info:
        staged(lambda f, s, x: f.late(s, x))(f, states, X1)
    assert "# HERE" in error_line(info.value)


CLASS_DECORATED = """
def make_inc(k):
    def inc(self, x):
        self.s = self.s + k * x
        self.hits = self.hits + 1
        return self.s
    return inc


def add_methods(cls):
    for k in (1, 2):
        setattr(cls, f"inc{k}", make_inc(k))
    return cls


@add_methods
@DECORATE
class Above:
    def __init__(self):
        self.s = jnp.zeros(())
        self.hits = jnp.zeros(())


@DECORATE
@add_methods
class Below:
    def __init__(self):
        self.s = jnp.zeros(())
        self.hits = jnp.zeros(())


@DECORATE
class Base:
    def __init__(self):
        self.s = jnp.zeros(())
        self.hits = jnp.zeros(3)

    def add(self, x, k):
        self.s = self.s + k * x
        return self.s


class LoopSub(Base):
    for _k in (1, 2, 3):
        def _m(self, x, _k=_k):
            self.hits = self.hits.at[_k - 1].add(1)
            return super().add(x, _k) * 2      # zero-argument super in a loop-made method
        locals()[f"add{_k}"] = _m
    del _m, _k
"""


@pytest.mark.parametrize(
    "build,calls",
    [
        ("Below()", [("inc2", (X1,)), ("inc1", (X2,))]),
        ("LoopSub()", [("add2", (X1,)), ("add3", (X2,)), ("add2", (X1,))]),
    ],
    ids=["class-decorator-below", "loop-methods-with-super"],
)
def test_methods_added_by_class_decorators_and_loops(
    write_module: Loader, build: str, calls: list
) -> None:
    plain, dec = pair(write_module, CLASS_DECORATED)
    check(plain, dec, build, calls)
    assert keys_of(dec, build)[:2] == (["hits", "s"], [])


ASSIGNED_LATE = """
@DECORATE
class Donor:
    def __init__(self):
        self.s = jnp.zeros(())

    def forward(self, x):
        self.s = self.s * 2 + x
        return self.s


@DECORATE
class Other:
    def __init__(self):
        self.s = jnp.ones(())      # a parameter of Other
        self.t = jnp.zeros(())

    def __call__(self, x):
        self.t = self.t + x
        return self.t


Donor()
Other()
Other.forward = Donor.forward     # Donor's rewritten function, set on a complete class
"""


def test_rewritten_method_set_on_another_class(write_module: Loader) -> None:
    """Eagerly the borrowed rewritten method writes a plain attribute, as plain
    Python; through f the write to what is a parameter of the complete class
    is the documented StateAccessError (a method added after the first use)."""
    plain, dec = pair(write_module, ASSIGNED_LATE)
    p, d = plain.Other(), dec.Other()
    assert_same(p.forward(X1), d.forward(X1), "eager output")
    assert_same(snapshot(p), snapshot(d), "attributes after one eager call")
    f, states = dec.Other().functionalize()
    with pytest.raises(StateAccessError, match="Other.s is not state") as info:
        f.forward(states, X1)
    assert_user_line(info.value, dec.__file__)  # Donor.forward's write


def test_instance_method_type_survives_freeze_and_deepcopy(write_module: Loader) -> None:
    """After jit and freeze, ``frozen.forward`` is bound to the frozen model
    (as a deep copy of plain Python's model would be) and keeps counting."""
    plain, dec = pair(write_module, REPLACED + "\n# freeze-method-type\n")
    ref = plain.build_instance_method()
    f, states = dec.build_instance_method().functionalize()
    expected = [ref.forward(X1), ref(X2)]
    out1, states = staged(lambda f, s, x: f.forward(s, x))(f, states, X1)
    out2, states = staged(lambda f, s, x: f(s, x))(f, states, X2)
    assert_same(expected, [out1, out2])
    frozen = autostate.freeze(f, states)
    assert frozen.forward.__self__ is frozen
    assert_same(ref.forward(X1), frozen.forward(X1))
    assert_same(snapshot(ref), snapshot(frozen))
    clone, ref_clone = copy.deepcopy(frozen), copy.deepcopy(ref)
    assert_same(ref_clone.forward(X2), clone.forward(X2))
    assert_same(snapshot(ref), snapshot(frozen), "the original is untouched by its copy")
    assert_same(snapshot(ref_clone), snapshot(clone))


@pytest.fixture
def mods(write_module: Loader) -> tuple[types.ModuleType, types.ModuleType]:
    return pair(write_module, MODELS)


def test_f_staticmethod_and_classmethod_as_plain_python(mods: Any) -> None:
    plain, dec = mods
    f, states = dec.Counter().functionalize()
    out, new = f.helper(states, 1.0)
    assert out == plain.Counter().helper(1.0)
    assert_same(snapshot(states), snapshot(new))
    made, _ = f.make(states)
    assert type(made) is dec.Counter
    assert_same(snapshot(plain.Counter.make()), snapshot(made))


def _decorated_pair(write_module: Loader) -> tuple[types.ModuleType, types.ModuleType]:
    plain = write_module(HEADER + "AUTOCKPT = lambda fn, **kw: fn\n"
                         + DECORATED_METHODS.replace("@DECORATE", ""))
    dec = write_module(HEADER + "AUTOCKPT = autostate.checkpoint\n"
                       + DECORATED_METHODS.replace("@DECORATE", "@autostate.stateful"))
    return plain, dec


@pytest.mark.parametrize("calls", [
    [("named", (V3,)), ("named", (V3 * 2,))],
    [("remat_policy", (V3,)), ("remat_policy", (V3 * 2,))],
    [("remat_static", (V3, 3)), ("remat_static", (V3, 1)), ("remat_static", (V3, 3))],
], ids=["named_call", "autostate-checkpoint-policy", "autostate-checkpoint-static"])
def test_transformations_as_method_decorators(write_module: Loader, calls: list[Any]) -> None:
    plain, dec = _decorated_pair(write_module)
    check(plain, dec, "Dm()", calls, modes=("eager", "f"))
    # under jit the static argument must be static: jit the method itself
    ref = plain.Dm()
    expected = [getattr(ref, m)(*a) for m, a in calls]
    f, states = dec.Dm().functionalize()
    outs = []
    for m, a in calls:
        out, states = staged(_fcall(f, m), static_argnums=(2,) if len(a) > 1 else ())(
            states, *a)
        outs.append(out)
    assert_same(expected, outs, "jit")
    assert_same(snapshot(ref.mean), states["mean"], "jit state")


@pytest.mark.parametrize("method", ["named", "remat_policy"])
def test_method_decorators_under_grad_and_vmap(write_module: Loader, method: str) -> None:
    plain, dec = _decorated_pair(write_module)
    check_transform(plain, dec, "Dm()", [(method, (X,))] * 2, V3, "grad")
    check_transform(plain, dec, "Dm()", [(method, (X,))] * 2, STACK, "vmap")




def test_generator_consumed_partly_then_resumed_after_other_calls(write_module: Loader) -> None:
    plain, dec = pair(write_module, FRAMES)
    got = []
    for mod in (plain, dec):
        m = mod.Stream()
        g = m.gen([1.0, 2.0, 3.0])
        first = next(g)
        middle = m.bump(100.0)
        rest = list(g)
        got.append(floats([first, middle, rest, m.x, m.n]))
    assert_same(got[0], got[1])


@pytest.mark.filterwarnings("ignore:Python iterable type 'generator':DeprecationWarning")
def test_generator_started_in_one_f_call_resumed_in_the_next(write_module: Loader) -> None:
    """The generator made in call 1 holds f's handled copy; resumed inside call 2
    it reaches call 2's states, which plain Python's one model also has."""
    plain, dec = pair(write_module, FRAMES)
    p = plain.Stream()
    g, first = p.start([1.0, 2.0])
    expected = floats([first, p.resume(g), p.x, p.n])
    f, s = dec.Stream().functionalize()
    (gd, first_d), s = f.start(s, [1.0, 2.0])
    out, s = f.resume(s, gd)
    assert_same(expected, floats([first_d, out, s["x"], s["n"]]))


@pytest.mark.filterwarnings("ignore:Python iterable type 'generator':DeprecationWarning")
def test_generator_of_one_models_f_resumed_inside_another_models_f(
    write_module: Loader,
) -> None:
    plain, dec = pair(write_module, FRAMES)
    pa, pb = plain.Stream(), plain.Stream()
    g = pa.gen([1.0, 2.0])
    expected_out = floats(pb.resume(g))
    fa, sa = dec.Stream().functionalize()
    fb, sb = dec.Stream().functionalize()
    gd, _ = fa.gen(sa, [1.0, 2.0])
    try:
        out, sb2 = fb.resume(sb, gd)
    except UnhandledLocalStateError as e:  # a clear error is an acceptable answer
        assert_user_line(e, dec.__file__)
        return
    # otherwise: plain meaning for B (A's writes must not land in B's states)
    assert_same([expected_out, floats(pb.x), floats(pb.n)], floats([out, sb2["x"], sb2["n"]]))


@pytest.mark.filterwarnings("error::DeprecationWarning")
def test_a_generator_argument_of_f_raises_no_jax_deprecation(write_module: Loader) -> None:
    plain, dec = pair(write_module, FRAMES)
    p = plain.Stream()
    expected = floats([p.resume(p.gen([1.0, 2.0])), p.x])
    f, s = dec.Stream().functionalize()
    helper = dec.Stream()  # an eager generator handed to f (its model is another one)
    out, s = f.resume(s, helper.gen([1.0, 2.0]))
    assert_same(expected[0], floats(out), "output")
    assert_same(np.float32(2.0), s["x"], "f's x: its own 1 * 2")


def test_named_buffers_generator_interleaved_with_calls_eagerly(write_module: Loader) -> None:
    plain, dec = pair(write_module, TORCH)

    def run(mod: types.ModuleType) -> list[Any]:
        model = mod.Tree()
        gen = model.named_buffers()
        first = next(gen)
        model(V2)
        return [first, *gen, *model.named_parameters()]

    assert_same(run(plain), run(dec))


def test_keyword_only_call_arguments_under_jit(write_module: Loader) -> None:
    plain, dec = pair(write_module, EQX)
    key = jax.random.key(3)
    ref = plain.DUnder(jnp.ones(2))
    expected = [ref(V2, key=key), ref(V2, inference=True), ref(V2 * 2)]
    f, states = dec.DUnder(jnp.ones(2)).functionalize()
    step = staged(lambda f, s, x, key, inference: f(s, x, key=key, inference=inference),
                   static_argnums=4)
    outs = []
    for x, k, inf in ((V2, key, False), (V2, None, True), (V2 * 2, None, False)):
        out, states = step(f, states, x, k, inf)
        outs.append(out)
    assert_same(expected, outs)
    assert_same(snapshot(ref), snapshot(autostate.freeze(f, states)))
    ref2 = plain.SubclassHook(jnp.ones(2))
    f2, s2 = dec.SubclassHook(jnp.ones(2)).functionalize()
    out, s2 = staged(lambda f, s, x: f(s, x, double=True))(f2, s2, V2)
    assert_same(ref2(V2, double=True), out)
    assert_same(ref2.count, s2["count"])


def assert_here(err: BaseException) -> None:
    """The error names the user's file and the line marked ``# HERE``."""
    found = re.search(r"at (\S+\.py):(\d+)", str(err))
    assert found, f"no user file:line in: {err}"
    line = Path(found[1]).read_text().splitlines()[int(found[2]) - 1]
    assert "# HERE" in line, f"{found[0]} is {line!r}, not the marked line"


@pytest.mark.parametrize(
    ("body", "kind"),
    [
        ("def steps(self, n):\n        yield from (self.n + i for i in range(n))  # HERE",
         "generator"),
        ("def steps(self, n):\n        yield from range(n)\n        self.n = self.n + 1  # HERE",
         "generator"),
        ("async def steps(self, n):\n        self.n = self.n + n  # HERE", "async"),
        ("async def steps(self, n):\n        async with n:\n            return self.n  # HERE",
         "async"),
    ],
    ids=["yield_from_read", "yield_from_write", "async_write", "async_with_read"],
)
def test_generator_and_async_methods_are_the_documented_error(
    write_module: Loader, body: str, kind: str
) -> None:
    source = f"""
@DECORATE
class Stream:
    def __init__(self):
        self.n = jnp.zeros(())

    def step(self):
        self.n = self.n + 1

    {body}
"""
    with pytest.raises(DecorationError, match=f"{kind} method 'steps' uses state 'n'") as err:
        pair(write_module, source)
    assert_here(err.value)
    assert "fix:" in str(err.value)


def test_generator_method_not_touching_state_is_plain(write_module: Loader) -> None:
    source = """
@DECORATE
class Gen:
    def __init__(self):
        self.n = jnp.zeros(())
        self.k = 3

    def step(self, v):
        self.n = self.n + v + sum(self.ks())
        return self.n

    def ks(self):
        yield from range(self.k)
"""
    plain, dec = pair(write_module, source)
    check(plain, dec, "Gen()", [("step", (X1,)), ("step", (X2,))])


def test_methods_made_by_a_loop_over_locals_in_the_class_body(write_module: Loader) -> None:
    source = """
def make(sign):
    def method(self, v):
        self.n = self.n + sign * v
        return self.n
    return method


@DECORATE
class Loop:
    def __init__(self):
        self.n = jnp.zeros(())

    for _name, _sign in (("inc", 1), ("dec", -1)):
        locals()[_name] = make(_sign)
    del _name, _sign
"""
    plain, dec = pair(write_module, source)
    check(plain, dec, "Loop()", [("inc", (X1,)), ("dec", (X2,)), ("inc", (X2,))])
    assert sorted(dec.Loop().functionalize()[1]) == ["n"]


def test_static_method_on_an_instance_from_outside(write_module: Loader) -> None:
    plain, dec = pair(write_module, RECEIVERS)
    p, d = plain.Rc(), dec.Rc()
    assert_same(plain.Rc.bump(p, X1), dec.Rc.bump(d, X1))
    assert_same(snapshot(p), snapshot(d))
    assert_same(snapshot(plain.Rc.fresh(X2)), snapshot(dec.Rc.fresh(X2)))


def test_annotations_of_a_nested_function_keep_their_text(write_module: Loader) -> None:
    source = """
@DECORATE
class An:
    def __init__(self):
        self.x = jnp.zeros(())

    def step(self, v):
        def g(w: self.x, k: "self.x" = 1) -> self.x.dtype:
            return w
        self.x = self.x + v
        y: self.x = 3
        return sorted(g.__annotations__.items()), self.x + y
"""
    plain, dec = pair(write_module, source)
    check(plain, dec, "An()", [("step", (X1,))], modes=("eager", "f"))


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












def test_generator_nested_in_method_consumed_in_the_call(write_module: Loader) -> None:
    plain, dec = pair(write_module, NESTED_GEN)
    run_case(plain, dec, "G()", [("run", (A1,)), ("run", (A2,))], extra=("run", (A1,)))


CACHED_OVER_PARAMETERS = """
import functools
@DECORATE
class M:
    def __init__(self):
        self.w = jnp.asarray([[2.0, 0.0], [0.0, 4.0]])
        self.calls = jnp.zeros((), jnp.int32)
    @functools.cached_property
    def inv(self):
        return jnp.linalg.inv(self.w)
    def __call__(self, x):
        self.calls += 1
        return self.inv @ x + self.inv.sum()
"""


def test_cached_property_over_parameters(write_module: Loader) -> None:
    plain, dec = pair(write_module, CACHED_OVER_PARAMETERS)
    run_case(plain, dec, "M()", [("__call__", (V2_RANGE,)), ("__call__", (jnp.ones(2),))],
             modes=("eager", "f"))
    run_case(plain, dec, "M()", [("__call__", (V2_RANGE,)), ("__call__", (jnp.ones(2),))],
             modes=("jit",))


CACHED_INVALIDATE = """
import functools
@DECORATE
class M:
    def __init__(self):
        self.w = jnp.asarray([[2.0, 0.0], [0.0, 4.0]])
        self.n = jnp.zeros((), jnp.int32)
    @functools.cached_property
    def inv(self):
        return jnp.linalg.inv(self.w)
    def set_w(self, scale):
        self.w = self.w * scale
        self.__dict__.pop("inv", None)
        return self.inv.sum()
    def __call__(self, x):
        self.n += 1
        return self.inv @ x
"""


def test_cached_property_invalidated_eagerly(write_module: Loader) -> None:
    plain, dec = pair(write_module, CACHED_INVALIDATE)
    calls = [("__call__", (jnp.ones(2),)), ("set_w", (A2,)), ("__call__", (jnp.ones(2),))]
    run_case(plain, dec, "M()", calls, modes=("eager",))
    # Computed from a state under jax.jit, the value cannot be kept for the next
    # call as plain Python keeps it: refused (tests/test_user_descriptors.py).
    f, states = dec.M().functionalize()
    with pytest.raises(errors.StateAccessError, match="cached_property M.inv"):
        staged(lambda f, s, x: f(s, x))(f, states, jnp.ones(2))


def test_cached_property_invalidated_through_f(write_module: Loader) -> None:
    plain, dec = pair(write_module, CACHED_INVALIDATE)
    calls = [("__call__", (jnp.ones(2),)), ("set_w", (A2,)), ("__call__", (jnp.ones(2),))]
    run_case(plain, dec, "M()", calls, modes=("f",))


CACHED_DELETED = CACHED_INVALIDATE.replace('self.__dict__.pop("inv", None)', "del self.inv")


def test_cached_property_deleted_through_f(write_module: Loader) -> None:
    # ``del self.inv`` after a write, as PyTorch users clear a cache (the
    # cache is full there: the first call filled it).
    plain, dec = pair(write_module, CACHED_DELETED)
    calls = [("__call__", (jnp.ones(2),)), ("set_w", (A2,)), ("__call__", (jnp.ones(2),)),
             ("set_w", (A2,))]
    run_case(plain, dec, "M()", calls, modes=("eager", "f"))


def test_cached_property_assigned_in_a_method_is_refused(write_module: Loader) -> None:
    with pytest.raises(errors.DecorationError) as info:
        pair(write_module, """
import functools
@DECORATE
class M:
    def __init__(self):
        self.w = jnp.asarray(2.0)
    @functools.cached_property
    def scale(self):
        return self.w * 3
    def override(self, v):
        self.scale = v
        return self.scale
""")
    assert "'scale'" in str(info.value) and "M.override" in str(info.value)


PARTIALMETHOD_KEYWORDS = """
import functools
@DECORATE
class M:
    def __init__(self):
        self.v = jnp.zeros(())
    def _bump(self, x, *, by=1.0, sign=1):
        self.v = self.v + sign * by * x
        return self.v
    up = functools.partialmethod(_bump, by=2.0)
    down = functools.partialmethod(_bump, sign=-1)
    def __call__(self, x):
        return self.up(x) + self.down(x, by=0.5)
"""


def test_partialmethod_with_keywords(write_module: Loader) -> None:
    plain, dec = pair(write_module, PARTIALMETHOD_KEYWORDS)
    run_case(plain, dec, "M()", [("__call__", (A1,)), ("up", (A2,)), ("down", (A1,))],
             extra=("down", (A2,)))


PROP_AUG = """
@DECORATE
class M:
    def __init__(self):
        self._t = jnp.asarray(1.0)
    @property
    def temperature(self):
        return self._t
    @temperature.setter
    def temperature(self, v):
        self._t = jnp.maximum(v, 0.1)
    def __call__(self, x):
        self.temperature *= 0.5
        self.temperature -= 0.05
        return x / self.temperature
"""


def test_augmented_assignment_through_a_property_setter(write_module: Loader) -> None:
    plain, dec = pair(write_module, PROP_AUG)
    run_case(plain, dec, "M()", [("__call__", (A1,))] * 4, extra=("__call__", (A2,)))


READONLY = """
@DECORATE
class M:
    def __init__(self):
        self._rate = jnp.asarray(0.5)
    @property
    def rate(self):
        return self._rate
    def __call__(self, x):
        try:
            self.rate = x
            ok = 1.0
        except AttributeError:
            ok = 0.0
        self._rate = self._rate + 1
        return self.rate * ok + 10 * (1 - ok)
"""


def test_read_only_property_assigned_raises_like_plain(write_module: Loader) -> None:
    plain, dec = pair(write_module, READONLY)
    run_case(plain, dec, "M()", [("__call__", (A1,))] * 2, extra=("__call__", (A1,)))


GETTER_WRITES = """
@DECORATE
class Ids:
    def __init__(self):
        self.counter = jnp.zeros((), jnp.int32)
        self.w = jnp.asarray(2.0)
    @property
    def next_id(self):
        self.counter += 1
        return self.counter
    def __call__(self, x):
        a = self.next_id
        b = self.next_id
        return x * self.w + a * 10 + b
"""


def test_property_getter_that_writes_state(write_module: Loader) -> None:
    plain, dec = pair(write_module, GETTER_WRITES)
    run_case(plain, dec, "Ids()", [("__call__", (A1,)), ("__call__", (A2,))],
             extra=("__call__", (A1,)))


DELETER = """
@DECORATE
class M:
    def __init__(self):
        self._cache = jnp.zeros(3)
        self.valid = jnp.asarray(False)
    @property
    def cache(self):
        return self._cache
    @cache.setter
    def cache(self, v):
        self._cache = v
        self.valid = jnp.asarray(True)
    @cache.deleter
    def cache(self):
        self._cache = jnp.zeros_like(self._cache)
        self.valid = jnp.asarray(False)
    def __call__(self, x):
        self.cache = self.cache + x
        return self.cache.sum()
    def reset(self):
        del self.cache
        return self.valid
"""


def test_property_deleter_resets_state(write_module: Loader) -> None:
    plain, dec = pair(write_module, DELETER)
    ones = jnp.ones(3)
    run_case(plain, dec, "M()", [("__call__", (ones,)), ("reset", ()), ("__call__", (ones,))],
             extra=("reset", ()))


DESCRIPTOR = """
class Clamped:
    def __set_name__(self, owner, name):
        self.key = "_" + name
    def __get__(self, obj, cls=None):
        if obj is None:
            return self
        return obj.__dict__[self.key]
    def __set__(self, obj, value):
        obj.__dict__[self.key] = jnp.clip(value, 0.0, 1.0)

@DECORATE
class M:
    scale = Clamped()
    def __init__(self):
        self.scale = jnp.asarray(0.5)
    def __call__(self, x):
        self.scale = self.scale + x
        return self.scale * 2
"""


def test_user_data_descriptor_for_an_assigned_name_is_refused(write_module: Loader) -> None:
    # autostate's state descriptor would replace Clamped, whose __set__ would
    # then never run (2.4 where plain Python gives 2.0): a clear refusal
    # (tests/test_user_descriptors.py has the family).
    with pytest.raises(errors.DecorationError) as info:
        pair(write_module, DESCRIPTOR)
    assert "data descriptor (Clamped" in str(info.value)


CHAIN = """
@DECORATE
class Acc:
    def __init__(self):
        self.total = jnp.zeros(())
        self.n = jnp.zeros((), jnp.int32)
    def push(self, x):
        self.total = self.total + x
        self.n += 1
        return self
    def mean(self):
        return self.total / self.n
    def __call__(self, x):
        return self.push(x).push(2 * x).push(3 * x).mean()
"""


def test_methods_returning_self_for_chaining(write_module: Loader) -> None:
    plain, dec = pair(write_module, CHAIN)
    run_case(plain, dec, "Acc()", [("__call__", (A1,)), ("__call__", (A2,))],
             extra=("__call__", (A1,)))
    ref, model = plain.Acc(), dec.Acc()
    same(ref.push(A1).push(A2).mean(), model.push(A1).push(A2).mean(), "chained outside")








def test_outside_wrapped_inherited_two_levels_call(write_module: Loader) -> None:
    plain, dec = pair(write_module, OUTSIDE_WRAPPED)
    run_case(
        plain,
        dec,
        "GrandChild()",
        [("__call__", (XS_SIGNED,)), ("__call__", (XS_SIGNED[::-1],))],
        extra=("__call__", (XS_SIGNED,)),
    )


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_outside_wrapped_inherited_under_grad_and_vmap(
    write_module: Loader, transform: str
) -> None:
    plain, dec = pair(write_module, OUTSIDE_WRAPPED)
    x = jnp.array([[0.5, 1.0, -2.0], [1.0, 2.0, 3.0]]) if transform == "vmap" else XS_SIGNED[:3]
    calls = (
        [("__call__", (X,)), ("fori", (A1,))]
        if transform == "grad"
        else [("scan", (X,)), ("fori", (A1,)), ("scan", (X,))]
    )
    check_transform(plain, dec, "GrandChild()", calls, x, transform)


def test_closures_kept_on_the_model_under_grad(write_module: Loader) -> None:
    plain, dec = pair(write_module, CLOSURE_HOOKS)
    check_transform(plain, dec, "M()", [("scan_hooks", (X,)), ("ckpt_hook", (A1,))], XS_SIGNED, "grad")


def test_closure_made_in_init_writes_no_state(write_module: Loader) -> None:
    # A closure defined in __init__ is part of __init__: what it assigns is not state. Eagerly
    # outside lax it is plain Python; traced (a lax body, f) it is the documented guard.
    plain, dec = pair(write_module, CLOSURE_HOOKS)
    run_case(plain, dec, "M()", [("init_hook_direct", (A2,))], modes=("eager",))
    with pytest.raises(autostate.errors.StateAccessError) as e:
        dec.M().init_hook_in_cond(-A1)
    user_line(e.value, dec, "self.y = self.y + v * 3.0")
    f, states = dec.M().functionalize()
    for fn in (f.init_hook_direct, staged(f.init_hook_direct), f.init_hook_in_cond):
        with pytest.raises(autostate.errors.StateAccessError) as e:
            fn(states, -A1)
        user_line(e.value, dec, "self.y = self.y + v * 3.0")


def test_property_setter_under_vmap_of_f(write_module: Loader) -> None:
    plain, dec = pair(write_module, DESCRIPTORS)
    check_transform(
        plain,
        dec,
        "M()",
        [("set_plain", (X,)), ("set_plain", (X,))],
        jnp.array([0.5, -3.0, 9.0]),
        "vmap",
    )
    check_transform(plain, dec, "M()", [("set_in_scan", (X,))], jnp.stack([XS_SIGNED, XS_SIGNED * 0.1]), "vmap")
    check_transform(plain, dec, "M()", [("set_in_scan", (X,))], XS_SIGNED * 0.1, "grad")


def test_wraps_lambda_not_closing_over_the_function_is_refused(write_module: Loader) -> None:
    # documented (errors.md, "A method decorator autostate cannot see through")
    src = RAISE_IN_LAX.replace(
        "(lambda fn: functools.wraps(fn)(lambda self, *a: fn(self, *a)))(_body)",
        "functools.wraps(_body)(lambda self, c, x: _body(self, c, x))",
    )
    with pytest.raises(autostate.errors.DecorationError) as e:
        pair(write_module, src)[1].M()
    named_line(e.value, "def _body(self, c, x):")  # the wrapped function's line


def named_line(err: BaseException, text: str) -> None:
    """The error names a file:line (of a written module) whose source holds ``text``."""
    assert isinstance(err, autostate.AutostateError), repr(err)
    found = re.findall(r"(/\S+?\.py):(\d+)", str(err))
    assert any(
        text in open(path).read().splitlines()[int(n) - 1]  # noqa: SIM115
        for path, n in found
    ), f"no line holding {text!r} in: {err}"
    assert "fix" in str(err).lower(), str(err)


REMOTE_METHODS = """
import functools


def count_calls(fn):
    @functools.wraps(fn)
    def wrapper(self, *args):
        self.calls = self.calls + 1
        return fn(self, *args)
    return wrapper


@count_calls
def step(self, c, x):
    self.total = self.total + x * self.w
    return c + self.total, self.total


def tick(self, i, c):
    self.total = self.total * 0.5
    return c + i


def forward(self, x, scale=1.0):
    self.total = self.total + x * scale
    return self.total * self.w
"""


REMOTE_MODEL = """
import HELPERS as remote


class Base:
    step = remote.step
    tick = remote.tick


@DECORATE
class M(Base):
    def __init__(self):
        self.w = jnp.asarray(0.5)
        self.total = jnp.zeros(())
        self.calls = jnp.zeros((), jnp.int32)
        self.on_instance = types.MethodType(remote.tick, self)

    __call__ = functools.partialmethod(remote.forward, scale=3.0)

    def scan(self, xs):
        return lax.scan(self.step, 0.0, xs)

    def fori(self, x):
        return lax.fori_loop(0, 3, self.on_instance, x)

    def both(self, xs):
        c, ys = self.scan(xs)
        return self(c) + self.fori(ys[-1])


@DECORATE
class Direct:
    def __init__(self):
        self.w = jnp.asarray(0.5)
        self.total = jnp.zeros(())
        self.calls = jnp.zeros((), jnp.int32)

    step = remote.step

    def scan(self, xs):
        return lax.scan(self.step, 0.0, xs)
"""


def _remote(write_module: Loader) -> tuple[Any, Any]:
    src = "import types\n" + REMOTE_MODEL
    plain, dec, _, _ = pair_with_helpers(write_module, REMOTE_METHODS, src)
    return plain, dec


@pytest.mark.parametrize(
    "build,name,args",
    [
        ("Direct()", "scan", (XS_SIGNED,)),
        ("M()", "scan", (XS_SIGNED,)),
        ("M()", "fori", (A2,)),
        ("M()", "__call__", (A2,)),
        ("M()", "both", (XS_SIGNED,)),
    ],
)
def test_methods_from_another_module(
    write_module: Loader, build: str, name: str, args: tuple[Any, ...]
) -> None:
    plain, dec = _remote(write_module)
    run_case(plain, dec, build, [(name, args), (name, args)], extra=(name, args))


def test_methods_from_another_module_under_grad(write_module: Loader) -> None:
    plain, dec = _remote(write_module)
    check_transform(plain, dec, "M()", [("both", (X,)), ("__call__", (A1,))], XS_SIGNED, "grad")


def jit_call(f: Any, states: Any, *args: Any, method: str = "__call__") -> Any:
    return staged(lambda f, s, *a: (f if method == "__call__" else getattr(f, method))(s, *a))(
        f, states, *args
    )


@pytest.mark.parametrize("build", ["Probe(0, 3, 2)", "hooked(0)"])
def test_stored_activations_and_hooks(write_module: Loader, build: str) -> None:
    plain, dec = pair(write_module, PROBE)
    calls = [
        ("__call__", (XP,)),
        ("__call__", (XP * 2,)),
        ("clear_hook_calls", ()),
        ("__call__", (-XP,)),
    ]
    check(plain, dec, build, calls)
    check_transform(plain, dec, build, [("__call__", (X,)), ("__call__", (X,))], XP, "grad")


def test_hook_registered_after_functionalize_is_not_seen_by_f(write_module: Loader) -> None:
    # f is a copy: a hook registered on the model afterwards changes the model only
    plain, dec = pair(write_module, PROBE)
    model = dec.Probe(0, 3, 2)
    f, states = model.functionalize()
    model.register_forward_hook(dec.double_hook)
    out, _ = jit_call(f, states, XP)
    assert_same(plain.Probe(0, 3, 2)(XP), out, "f without the hook")
    assert_same(
        plain.Probe(0, 3, 2).register_forward_hook(plain.double_hook)(XP),
        model(XP),
        "eager model with the hook",
    )


CONSUMED_GENERATORS: dict[str, list[tuple[str, tuple[Any, ...]]]] = {
    "yield_from_sub_model": [("consume", (XS3,)), ("consume", (XS3 * 2,))],
    "send_accumulator": [("drive", (XS3,)), ("drive", (XS3,))],
    "islice": [("islice", (XS3,)), ("islice", (XS3,))],
    "accumulate_map": [("accumulate", (XS3,))],
    "chain": [("chained", (XS3,))],
    "zip_interleaved": [("zipped", (XS3,))],
    "partial_consume_finally_at_frame_exit": [("partial_consume", (XS3,))] * 2,
    "partial_close": [("partial_close", (XS3,))] * 2,
    "throw_in": [("throw_in", (XS3,))] * 2,
    "map_once": [("map_once", (XS3,))] * 2,
    "comprehension_mixed": [("comprehension_mixed", (XS3,))],
    "walrus": [("walrus", (XS3,))],
    "setattr_in_comprehension": [("setattr_comp", (XS3,))],
    "dict_comp_and_genexp": [("dict_comp", (XS3,))],
    "iter_generator": [("iterate", ()), ("iterate", ())],
    "generator_in_scan_body": [("scan_inner_gen", (XS3,)), ("scan_inner_gen", (XS3,))],
}


@pytest.mark.filterwarnings(
    "ignore:Python iterable type:DeprecationWarning"
)
@pytest.mark.parametrize("case", sorted(CONSUMED_GENERATORS))
def test_generators_consumed_in_the_call(write_module: Loader, case: str) -> None:
    plain, dec = pair(write_module, GENERATOR_METHODS)
    modes = EAGER_F if case in GENERATORS_TRACED else ALL_MODES
    check(plain, dec, "M()", CONSUMED_GENERATORS[case], modes=modes)


GENERATORS_TRACED = {"yield_from_sub_model": "consume", "send_accumulator": "drive",
                     "zip_interleaved": "zipped"}


@pytest.mark.filterwarnings(
    "ignore:Python iterable type:DeprecationWarning"
)
@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_generators_under_grad_and_vmap(write_module: Loader, transform: str) -> None:
    plain, dec = pair(write_module, GENERATOR_METHODS)
    calls = [(name, (X,)) for name in GENERATORS_TRACED.values()]
    x = XS3 if transform == "grad" else jnp.arange(6.0).reshape(2, 3)
    check_transform(plain, dec, "M()", calls, x, transform)


@pytest.mark.filterwarnings(
    "ignore:Python iterable type:DeprecationWarning"
)
def test_lazy_reads_see_writes_made_before_consumption_eagerly(write_module: Loader) -> None:
    plain, dec = pair(write_module, ESCAPES)
    got = []
    for mod in (plain, dec):
        m = mod.E()
        g = m.lazy_reads(XS3)
        m.bump(5.0)
        got.append([float(v) for v in g])
    same(got[0], got[1])


@pytest.mark.filterwarnings(
    "ignore:Python iterable type:DeprecationWarning"
)
@pytest.mark.parametrize("jit", [False, True])
def test_generator_started_in_one_call_resumed_in_the_next(write_module: Loader, jit: bool) -> None:
    plain, dec = pair(write_module, ESCAPES)
    plain.BOX.clear()
    ref = plain.E()
    expected = [ref.start([1.0, 2.0, 3.0]), ref.resume(), ref.finish(), snapshot(ref)]
    dec.BOX.clear()
    f, s = dec.E().functionalize()
    start = staged(f.start, static_argnums=1) if jit else f.start
    resume = staged(f.resume) if jit else f.resume
    finish = staged(f.finish) if jit else f.finish
    a, s = start(s, (1.0, 2.0, 3.0))
    b, s = resume(s)
    c, s = finish(s)
    same(expected, [a, b, c, {"__class__": "E", **snapshot(s)}])


ACCEPTED = {
    "generator_lambda": """
@DECORATE
class A:
    def __init__(self):
        self.x = jnp.zeros(())
    def bump(self):
        self.x = self.x + 1
    steps = lambda self, k: (yield setattr(self, "x", self.x + k))  # HERE
""",
    "vars_self": """
@DECORATE
class A:
    def __init__(self):
        self.x = jnp.zeros(())
    def bump(self):
        self.x = self.x + 1
    def steps(self, k):
        for i in range(k):
            vars(self)["x"] = vars(self)["x"] + i  # HERE
            yield i
""",
    "property": """
@DECORATE
class A:
    def __init__(self):
        self.x = jnp.zeros(())
    def bump(self):
        self.x = self.x + 1  # HERE
    @property
    def value(self):
        return self.x
    def steps(self, k):
        for i in range(k):
            self.bump()
            yield self.value * i
""",
    "staticmethod_taking_the_model": """
@DECORATE
class A:
    def __init__(self):
        self.x = jnp.zeros(())
    def bump(self):
        self.x = self.x + 1
    @staticmethod
    def gen(model, k):
        for i in range(k):
            model.x = model.x + i  # HERE
            yield model.x
    def steps(self, k):
        return self.gen(self, k)
""",
    "nested_generator": """
@DECORATE
class A:
    def __init__(self):
        self.x = jnp.zeros(())
    def bump(self):
        self.x = self.x + 1
    def steps(self, k):
        def inner(this):
            for i in range(k):
                this.x = this.x + i  # HERE
                yield this.x
        return inner(self)
""",
    "alias_of_self": """
@DECORATE
class A:
    def __init__(self):
        self.x = jnp.zeros(())
    def bump(self):
        self.x = self.x + 1
    def steps(self, k):
        me = self
        for i in range(k):
            me.x = me.x + i  # HERE
            yield me.x
""",
}


@pytest.mark.filterwarnings(
    "ignore:Python iterable type:DeprecationWarning"
)
@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_generator_spellings_accepted_by_the_analysis(write_module: Loader, case: str) -> None:
    """Eagerly plain Python; consumed after ``f`` the documented unhandled-state error."""
    plain, dec = pair(write_module, ACCEPTED[case])
    got = []
    for mod in (plain, dec):
        m = mod.A()
        got.append(([snapshot(v) for v in m.steps(3)], snapshot(m)))
    same(got[0], got[1])
    f, s = dec.A().functionalize()
    g, new = f.steps(s, 3)
    same(snapshot(s), snapshot(new))
    with pytest.raises(errors.UnhandledLocalStateError) as info:
        list(g)
    user_line(info.value, dec, "# HERE")


SUSPENDED_ACCESS = {
    "generator_returning_state": (
        "    def steps(self, xs):\n        yield 1\n        return self.n  # HERE\n",
        "generator method 'steps'",
    ),
    "async_generator": (
        "    async def steps(self, k):\n        for i in range(k):\n"
        "            self.n = self.n + i  # HERE\n            yield self.n\n",
        "async method 'steps'",
    ),
    "async_enter": (
        "    async def __aenter__(self):\n        self.n = self.n + 1  # HERE\n"
        "        return self\n",
        "async method '__aenter__'",
    ),
    "wrapped_generator": (
        "    @logged\n    def steps(self, k):\n        for i in range(k):\n"
        "            self.n = self.n + i  # HERE\n            yield self.n\n",
        "generator method 'steps'",
    ),
    "external_generator_assigned": ("    steps = external\n", "generator method 'steps'"),
    "contextmanager_touching_state": (
        "    @contextlib.contextmanager\n    def mode(self):\n        old = self.n  # HERE\n"
        "        try:\n            yield\n        finally:\n            self.bump(old)\n",
        "generator method 'mode'",
    ),
}


REFUSED_HEAD = """
import contextlib


def logged(fn):
    @functools.wraps(fn)
    def wrapper(self, *a):
        return fn(self, *a)
    return wrapper


def external(self, k):
    for i in range(k):
        self.n = self.n + i  # HERE
        yield self.n


@DECORATE
class A:
    def __init__(self):
        self.n = jnp.zeros(())

    def bump(self, v):
        self.n = self.n + v
"""


@pytest.mark.filterwarnings(
    "ignore:Python iterable type:DeprecationWarning"
)
@pytest.mark.parametrize("case", sorted(SUSPENDED_ACCESS))
def test_suspended_state_access_is_the_documented_decoration_error(
    write_module: Loader, case: str
) -> None:
    body, what = SUSPENDED_ACCESS[case]
    with pytest.raises(errors.DecorationError) as info:
        pair(write_module, REFUSED_HEAD + "\n" + body)
    assert what in str(info.value)
    assert "# HERE" in error_line(info.value)
    assert "fix:" in str(info.value)


HELD = """
import itertools


@DECORATE
class H:
    def __init__(self, kind):
        self.acc = jnp.zeros(())
        if kind == "generator":
            self.stream = self.ticks()
        elif kind == "genexp":
            self.stream = (self.add(float(i)) for i in itertools.count(1))
        else:
            self.stream = map(self.add, itertools.count(1.0))

    def add(self, v):
        self.acc = self.acc + v
        return self.acc

    def ticks(self):
        i = 0
        while True:
            i += 1
            yield self.add(float(i))

    def __call__(self):
        return next(self.stream)
"""


@pytest.mark.filterwarnings(
    "ignore:Python iterable type:DeprecationWarning"
)
@pytest.mark.parametrize("kind", ["generator", "genexp", "map"])
def test_iterator_over_own_method_kept_on_the_model(write_module: Loader, kind: str) -> None:
    """f's copy of the model cannot be put in the iterator's frame (or the
    map's bound method): functionalize() refuses it, naming the attribute, as
    it refuses a functools.partial; eagerly it means what plain Python does."""
    plain, dec = pair(write_module, HELD)
    ref = plain.H(kind)
    model = dec.H(kind)
    same([ref(), ref()], [model(), model()], "eager outputs")
    same(ref.acc, model.acc, "eager acc")
    with pytest.raises(errors.InvalidTypeError) as info:
        model.functionalize()
    text = str(info.value)
    assert "H.stream" in text and ("generator" in text or "map" in text), text
    assert "fix:" in text


DEFERRED = """
import operator
import weakref


def deferred(fn):
    @functools.wraps(fn)
    def wrapper(self, *a):
        return lambda: fn(self, *a)
    return wrapper


def memo(fn):
    cache = {}

    @functools.wraps(fn)
    def wrapper(self, k):
        key = (id(self), k)
        if key not in cache:
            cache[key] = fn(self, k)
        return cache[key]
    return wrapper


@DECORATE
class D:
    def __init__(self):
        self.x = jnp.ones(())
        self.n = jnp.zeros((), jnp.int32)
        self.pending = []
        self.weak = weakref.WeakMethod(self.bump)

    def bump(self, v):
        self.x = self.x + v
        return self.x

    @deferred
    def later(self, v):
        return self.bump(v)

    def use_later(self, v):
        t = self.later(v)
        self.bump(1.0)
        return t() + self.x

    def tree_map(self, d):
        return jax.tree.map(self.bump, d)

    def methodcaller(self, v):
        return operator.methodcaller("bump", v)(self) + sum(map(self.bump, [v, v]))

    def score(self, v):
        self.n = self.n + 1
        return -v

    def sort_by(self, v):
        order = sorted([3.0, 1.0, 2.0], key=self.score)
        return jnp.asarray(order) * self.bump(v) + self.n

    def via_weak(self, v):
        return self.weak()(v) + self.x

    @memo
    def scaled(self, k):
        return self.x * k

    def stale(self, v):
        a = self.scaled(2.0)
        self.bump(v)
        return a + self.scaled(2.0)

    @functools.singledispatchmethod
    def step(self, v):
        self.x = self.x + v
        return self.x

    @step.register
    def _(self, v: int):
        self.n = self.n + v
        return self.n

    def run_step(self, a, b, t):
        return self.step(a), self.step(b), self.step(t)

    def defer_lambda(self, v):
        self.pending = [*self.pending, lambda: self.bump(v)]  # HERE
        return self.x

    def defer_partial(self, v):
        self.pending = self.pending + [functools.partial(self.bump, v)]
        return self.x

    def defer_map(self, v):
        self.pending = self.pending + [map(self.bump, [v])]
        return self.x

    def flush(self):
        outs = [cb() if callable(cb) else next(cb) for cb in self.pending]
        self.pending = []
        return outs


@D.step.register
def _late(self, v: tuple):
    self.x = self.x * 2
    self.n = self.n + len(v)
    return self.x
"""


DEFERRED_CASES: dict[str, tuple[list[tuple[str, tuple[Any, ...]]], tuple[str, ...]]] = {
    "thunk_from_wraps_decorator": ([("use_later", (A2,))] * 2, ("eager", "f", "jit", "freeze")),
    "jax_tree_map_of_method": (
        [("tree_map", ({"a": A1, "b": (A2, A1)},))] * 2,
        ("eager", "f", "jit", "freeze"),
    ),
    "methodcaller_and_map": ([("methodcaller", (A1,))] * 2, ("eager", "f", "jit", "freeze")),
    "sorted_with_a_counting_key": ([("sort_by", (A1,))] * 2, ("eager", "f", "jit", "freeze")),
    "weak_method_kept_on_the_model": ([("via_weak", (A2,))] * 2, ("eager", "f", "jit", "freeze")),
    # a Python-level memo keeps what the first call computed, as in plain Python
    # (under jit a Python cache of traced values is JAX's own matter)
    "memo_decorator_stale_as_plain": ([("stale", (A1,)), ("stale", (A2,))], ("eager", "f")),
    # a Python int through jit is traced (dispatched as an array): eager and f only
    "singledispatch_registered_after_decoration": (
        [("run_step", (A1, 2, (1, 2))), ("run_step", (A2, 3, (4,)))],
        ("eager", "f"),
    ),
}


@pytest.mark.filterwarnings(
    "ignore:Python iterable type:DeprecationWarning"
)
@pytest.mark.parametrize("case", sorted(DEFERRED_CASES))
def test_deferred_callables(write_module: Loader, case: str) -> None:
    plain, dec = pair(write_module, DEFERRED)
    calls, modes = DEFERRED_CASES[case]
    check(plain, dec, "D()", calls, modes=modes)


@pytest.mark.filterwarnings(
    "ignore:Python iterable type:DeprecationWarning"
)
def test_callbacks_in_a_state_list_eagerly(write_module: Loader) -> None:
    plain, dec = pair(write_module, DEFERRED)
    got = []
    for mod in (plain, dec):
        m = mod.D()
        m.defer_lambda(A1)
        m.defer_partial(A2)
        m.defer_map(A1)
        got.append((m.flush(), snapshot(m)))
    same(got[0], got[1])


@pytest.mark.filterwarnings(
    "ignore:Python iterable type:DeprecationWarning"
)
@pytest.mark.parametrize("jit", [False, True])
def test_lambda_of_self_into_a_state_inside_f_is_state_access_error(
    write_module: Loader, jit: bool
) -> None:
    _, dec = pair(write_module, DEFERRED)
    f, s = dec.D().functionalize()
    with pytest.raises(errors.StateAccessError) as info:
        (staged(f.defer_lambda) if jit else f.defer_lambda)(s, A1)
    user_line(info.value, dec, "# HERE")


@pytest.mark.filterwarnings(
    "ignore:Python iterable type:DeprecationWarning"
)
@pytest.mark.parametrize("method", ["defer_partial", "defer_map"])
@pytest.mark.parametrize("jit", [False, True])
def test_partial_of_self_into_a_state_inside_f(
    write_module: Loader, method: str, jit: bool
) -> None:
    """Refused as the lambda is: the partial (or map) would stay bound to f's
    internal copy of the model."""
    _, dec = pair(write_module, DEFERRED)
    f, s = dec.D().functionalize()
    with pytest.raises(errors.StateAccessError) as info:
        (staged(getattr(f, method)) if jit else getattr(f, method))(s, A1)
    user_line(info.value, dec, "self.pending = self.pending + [")


@pytest.mark.filterwarnings(
    "ignore:Python iterable type:DeprecationWarning"
)
def test_lru_cache_on_a_state_reading_method_is_the_documented_error(
    write_module: Loader,
) -> None:
    with pytest.raises(errors.DecorationError, match="cannot reach the function inside") as info:
        pair(write_module, """
@DECORATE
class C:
    def __init__(self):
        self.x = jnp.zeros(())

    def bump(self):
        self.x = self.x + 1

    @functools.lru_cache(maxsize=None)
    def read(self, k):  # HERE
        return self.x * k
""")
    assert "fix:" in str(info.value)
    assert "# HERE" in error_line(info.value) or "lru_cache" in error_line(info.value)


@pytest.mark.filterwarnings(
    "ignore:Python iterable type:DeprecationWarning"
)
def test_partial_of_a_method_kept_on_the_model_is_the_documented_error(
    write_module: Loader,
) -> None:
    plain, dec = pair(write_module, """
@DECORATE
class P:
    def __init__(self):
        self.x = jnp.zeros(())
        self.later = functools.partial(self.bump, 1.0)

    def bump(self, v):
        self.x = self.x + v
        return self.x

    def fire(self):
        return self.later()
""")
    ref, model = plain.P(), dec.P()
    same([ref.fire(), ref.fire(), snapshot(ref)], [model.fire(), model.fire(), snapshot(model)])
    with pytest.raises(errors.InvalidTypeError, match="functools.partial") as info:
        model.functionalize()
    assert "later" in str(info.value) and "fix:" in str(info.value)












@pytest.mark.parametrize(
    "calls",
    [
        [("step", (1.0,)), ("__call__", (2.0,)), ("again", (0.5,))],
        [("__call__", (2.0,)), ("times", (3.0,)), ("scale", (0.5,))],
        [("set_via_alias", (4.0,)), ("step", (1.0,))],
        [("call_static", (2.0,)), ("bump_alias", (None, 1.0))],
        [("named", (1.0,)), ("__call__", (1.0,))],
    ],
    ids=["wrapped", "plain", "property", "staticmethod", "classmethod"],
)
def test_aliased_methods(write_module: Loader, calls: list[Call]) -> None:
    plain, dec = pair(write_module, ALIASES, fresh=True)
    if calls[-1][0] == "bump_alias":  # a static method called through the class
        ref, model = plain.W(), dec.W()
        assert_same(plain.W.bump_alias(ref, 1.0), dec.W.bump_alias(model, 1.0), rtol=1e-6, atol=0.0)
        assert_same(snapshot(ref), snapshot(model), rtol=1e-6, atol=0.0)
        calls = calls[:-1]
    check(plain, dec, "W()", calls, modes=("eager", "f", "jit"), rtol=1e-6, atol=0.0)
