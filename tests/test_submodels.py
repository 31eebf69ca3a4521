"""Sub-models assigned outside ``__init__`` stay sub-models.

``self.sub = Leaf()`` in a method other than ``__init__`` (a ``reset``, a
lazy ``build``) makes the analysis call ``sub`` a state, since a method
assigns it. Its value is a model, though: its own states must stay states
(keys ``sub.n`` of the states dict, threaded under jit), as if ``__init__``
alone had assigned it. Assigning such an attribute inside a functionalized
call would change the model's structure, so it is refused with an error at
the user's line; eagerly it means what plain Python means.

Each case runs the same source undecorated (plain Python) and decorated,
eagerly, through ``f(states, ...)`` and under ``jax.jit``.
"""

from __future__ import annotations

import copy
import pickle
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autostate

SOURCE = """
import jax
import jax.numpy as jnp
import autostate


@DECORATE
class Leaf:
    def __init__(self, k=0.0):
        self.n = jnp.zeros(()) + k

    def __call__(self, x):
        self.n = self.n + x
        return self.n * 2


@DECORATE
class Reset:
    def __init__(self):
        self.sub = Leaf()

    def reset(self, k=0.0):
        self.sub = Leaf(k)

    def __call__(self, x):
        self.sub.n = self.sub.n + x
        return self.sub(x)


@DECORATE
class Lazy:
    def __init__(self):
        self.w = jnp.ones(())
        self.blocks = None
        self.by_name = {}

    def build(self):
        self.blocks = [Leaf(1.0), Leaf(2.0)]
        self.by_name = {"a": Leaf(3.0)}

    def __call__(self, x):
        y = self.w * x
        if self.blocks is not None:
            for block in self.blocks:
                y = y + block(x)
        for leaf in self.by_name.values():
            y = y + leaf(y)
        return y


@DECORATE
class Drops:
    def __init__(self):
        self.sub = Leaf(1.0)

    def drop(self):
        self.sub = None

    def __call__(self, x):
        return x if self.sub is None else self.sub(x)


@DECORATE
class Scanned:
    def __init__(self):
        self.sub = Leaf()

    def reset(self):
        self.sub = Leaf(0.5)

    def __call__(self, xs):
        def body(carry, x):
            return carry + self.sub(x), None

        out, _ = jax.lax.scan(body, jnp.zeros(()), xs)
        return out
"""


@pytest.fixture
def pair(write_module: Callable[..., types.ModuleType]) -> tuple[Any, Any]:
    """The source above as plain Python and decorated with ``@autostate.stateful``."""
    plain = write_module(SOURCE.replace("@DECORATE", ""))
    decorated = write_module(SOURCE.replace("@DECORATE", "@autostate.stateful"))
    return plain, decorated


def _states_of(model: Any) -> dict[str, float]:
    """Every sub-model state of a plain or decorated model, by path."""
    out: dict[str, float] = {}

    def walk(path: str, obj: Any) -> None:
        if isinstance(obj, list | tuple):
            for i, item in enumerate(obj):
                walk(f"{path}[{i}]", item)
        elif isinstance(obj, dict):
            for k, item in obj.items():
                walk(f"{path}[{k!r}]", item)
        elif hasattr(type(obj), "__init__") and hasattr(obj, "__dict__") and not isinstance(
            obj, jax.Array
        ):
            for k in vars(obj):
                walk(f"{path}.{k}" if path else k, getattr(obj, k))
        elif isinstance(obj, jax.Array):
            out[path] = float(obj)

    walk("", model)
    return out


def test_the_analysis_calls_them_state_and_functionalize_keeps_their_states(pair: Any) -> None:
    _, dec = pair
    assert "sub" in autostate.tree.class_info(dec.Reset).state
    _, states = dec.Reset().functionalize()
    assert sorted(states) == ["sub.n"]
    lazy = dec.Lazy()
    lazy.build()
    _, states = lazy.functionalize()
    assert sorted(states) == ["blocks[0].n", "blocks[1].n", "by_name['a'].n"]
    for value in states.values():
        assert isinstance(value, jax.Array)


@pytest.mark.parametrize("mode", ["eager", "f", "jit", "jit_twice"])
def test_a_reset_sub_model_runs_as_plain_python(pair: Any, mode: str) -> None:
    plain, dec = pair
    expected_model = plain.Reset()
    expected_model.reset(2.0)
    expected = [float(expected_model(x)) for x in (1.0, 2.0, 3.0)]

    model = dec.Reset()
    model.reset(2.0)
    if mode == "eager":
        got = [float(model(x)) for x in (1.0, 2.0, 3.0)]
        assert _states_of(model) == _states_of(expected_model)
    else:
        f, states = model.functionalize()
        call = f if mode == "f" else jax.jit(f)
        got = []
        for x in (1.0, 2.0, 3.0):
            out, states = call(states, x)
            got.append(float(out))
        assert float(states["sub.n"]) == float(expected_model.sub.n)
        if mode == "jit_twice":
            frozen = autostate.freeze(f, states)
            assert float(frozen.sub.n) == float(expected_model.sub.n)
            assert float(frozen(1.0)) == float(expected_model(1.0))
    assert got == expected


@pytest.mark.parametrize("mode", ["eager", "f", "jit"])
def test_a_lazily_built_list_and_dict_of_sub_models_run_as_plain_python(
    pair: Any, mode: str
) -> None:
    plain, dec = pair
    expected_model = plain.Lazy()
    expected_model.build()
    expected = [float(expected_model(x)) for x in (1.0, 0.5)]

    model = dec.Lazy()
    model.build()
    if mode == "eager":
        got = [float(model(x)) for x in (1.0, 0.5)]
        assert _states_of(model) == _states_of(expected_model)
    else:
        f, states = model.functionalize()
        call = f if mode == "f" else jax.jit(f)
        got = []
        for x in (1.0, 0.5):
            out, states = call(states, x)
            got.append(float(out))
        frozen = autostate.freeze(f, states)
        assert _states_of(frozen) == _states_of(expected_model)
    assert got == expected


def test_gradients_flow_through_states_of_a_lazily_built_sub_model(pair: Any) -> None:
    plain, dec = pair
    model = dec.Lazy()
    model.build()
    f, states = model.functionalize()

    def loss(states: dict, x: Any) -> Any:
        return f(states, x)[0]

    grads = jax.grad(loss)(states, 1.0)
    assert sorted(grads) == sorted(states)
    # y = w*x + (b0.n + x)*2 + (b1.n + x)*2 ; then y += (a.n + y)*2
    assert float(grads["blocks[0].n"]) == pytest.approx(2.0 * 3.0)
    assert float(grads["by_name['a'].n"]) == pytest.approx(2.0)
    assert float(jax.grad(loss, argnums=1)(states, 1.0)) == pytest.approx((1 + 2 + 2) * 3.0)
    del plain


def test_a_scan_over_a_reset_sub_model_matches_plain_python(pair: Any) -> None:
    plain, dec = pair
    xs = jnp.arange(4.0)
    expected_model = plain.Scanned()
    expected_model.reset()
    model = dec.Scanned()
    model.reset()
    f, states = model.functionalize()
    out, states = jax.jit(f)(states, xs)
    # Plain Python cannot run a state write inside lax.scan; its loop is the meaning.
    expected = 0.0
    for x in np.asarray(xs):
        expected += float(expected_model.sub(float(x)))
    assert float(out) == pytest.approx(expected)
    assert float(states["sub.n"]) == pytest.approx(float(expected_model.sub.n))


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(
    ("cls", "method", "args"),
    [("Reset", "reset", (1.0,)), ("Lazy", "build", ()), ("Drops", "drop", ())],
)
def test_assigning_a_sub_model_inside_a_functionalized_call_is_refused_at_the_users_line(
    pair: Any, jit: bool, cls: str, method: str, args: tuple
) -> None:
    _, dec = pair
    model = getattr(dec, cls)()
    if cls == "Lazy":
        model.build()
    f, states = model.functionalize()
    call = getattr(f, method)
    if jit:
        call = jax.jit(call)
    with pytest.raises(autostate.AutostateError, match="sub-model") as info:
        call(states, *args)
    message = str(info.value)
    assert dec.__file__ in message and "functionalize()" in message
    # The refusal left no tracer behind: f still runs, eagerly and jitted.
    out, _ = f(states, 1.0)
    out_jit, _ = jax.jit(f)(states, 1.0)
    assert float(out) == float(out_jit)


def test_the_same_assignments_eagerly_mean_plain_python_then_functionalize_again(
    pair: Any,
) -> None:
    plain, dec = pair
    for make in (plain.Drops, dec.Drops):
        model = make()
        assert float(model(1.0)) == 4.0
        model.drop()
        assert float(model(1.0)) == 1.0
    model = dec.Reset()
    model(1.0)
    f, states = model.functionalize()
    _, states = jax.jit(f)(states, 1.0)
    model.reset(5.0)  # eagerly, on the model itself
    assert float(model.sub.n) == 5.0
    f, states = model.functionalize()
    out, states = jax.jit(f)(states, 1.0)
    assert float(out) == (5.0 + 1.0 + 1.0) * 2
    drops = dec.Drops()
    drops.drop()
    f, states = drops.functionalize()
    # The dropped sub-model's state is a None placeholder: no arrays, and f means plain Python.
    assert states == {"sub": None} and jax.tree.leaves(states) == []
    assert float(jax.jit(f)(states, 1.0)[0]) == 1.0


def test_copies_and_pickles_of_a_reset_sub_model_are_independent(pair: Any) -> None:
    _, dec = pair
    model = dec.Reset()
    model.reset(1.0)
    model(1.0)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert clone.sub is not model.sub
        assert float(clone.sub.n) == float(model.sub.n)
        clone(1.0)
        assert float(clone.sub.n) != float(model.sub.n)
    shallow = copy.copy(model)
    assert shallow.sub is model.sub  # plain Python's shallow copy shares the sub-model


def test_a_host_fallback_model_keeps_a_reset_sub_model(
    write_module: Callable[..., types.ModuleType],
) -> None:
    source = SOURCE.replace("@DECORATE\nclass Reset", '@autostate.stateful(fallback="host")\nclass Reset')
    source = source.replace("@DECORATE", "@autostate.stateful")
    module = write_module(source)
    model = module.Reset()
    model.reset(2.0)
    assert float(model(1.0)) == (2.0 + 1.0 + 1.0) * 2
    f, states = model.functionalize()
    assert sorted(states) == ["sub.n"]
    out, states = jax.jit(f)(states, 1.0)
    assert float(out) == (4.0 + 1.0 + 1.0) * 2
