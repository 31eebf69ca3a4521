"""Bound methods a model keeps as attributes follow the model's copies.

``self.act = self._gelu``, ``self.branches = [self.up, self.down]`` (for
``lax.switch``) or ``self.score = self.head.forward`` hold methods bound to
an instance of the model. ``functionalize()``, ``freeze()``, a jitted call
and a model passed to ``jax.jit`` as a pytree all work on a rebuilt copy of
the model, so each such method must be bound to the copy: bound to the
original, it would read the original's values (a constant under jit, no
gradient) and write into it (lost, or a tracer in an eager model).

Each case runs the same source undecorated and decorated and compares
outputs and states, eagerly, through ``f(states, ...)`` and under jit.
"""

from __future__ import annotations

import copy
import pickle
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import pytest

import autostate

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
def pair(write_module: Callable[..., types.ModuleType]) -> tuple[Any, Any]:
    plain = write_module(SOURCE.replace("@DECORATE", ""))
    decorated = write_module(SOURCE.replace("@DECORATE", "@autostate.stateful"))
    return plain, decorated


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


@pytest.mark.parametrize("mode", ["eager", "f", "jit"])
@pytest.mark.parametrize(("cls", "ctor", "calls"), CASES, ids=[f"{c[0]}{c[1]}" for c in CASES])
def test_stored_bound_methods_act_on_the_running_model(
    pair: Any, mode: str, cls: str, ctor: tuple, calls: list[tuple]
) -> None:
    plain, dec = pair
    expected_model = getattr(plain, cls)(*ctor)
    expected = _run_plain(expected_model, calls)
    model = getattr(dec, cls)(*ctor)
    if mode == "eager":
        got = [float(model(*args)) for args in calls]
        result = model
    else:
        f, states = model.functionalize()
        call = f if mode == "f" else jax.jit(f)
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
    assert got == pytest.approx(expected)
    assert vars_of(result) == pytest.approx(vars_of(expected_model))


def vars_of(model: Any) -> dict[str, float]:
    """The array attributes of a model and of its sub-models, by path."""
    out: dict[str, float] = {}
    for name, value in vars(model).items():
        if isinstance(value, jax.Array) or hasattr(getattr(model, name), "shape"):
            out[name] = float(getattr(model, name))
        elif hasattr(value, "__dict__") and not isinstance(value, types.MethodType):
            out.update({f"{name}.{k}": v for k, v in vars_of(value).items()})
    return out


def test_a_frozen_models_methods_are_bound_to_it(pair: Any) -> None:
    _, dec = pair
    f, states = dec.SelfBound().functionalize()
    _, states = jax.jit(f)(states, 1.0)
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


def test_gradients_reach_a_parameter_read_through_a_stored_method(pair: Any) -> None:
    _, dec = pair
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


def test_an_eager_model_passed_to_jit_as_a_pytree_reads_its_traced_copy(pair: Any) -> None:
    _, dec = pair
    model = dec.SelfBound(train=False)
    model.n = jnp.asarray(2.0)

    def read(m: Any, x: Any) -> Any:
        return m.step_fn(x)

    assert float(jax.jit(read)(model, 3.0)) == 6.0
    # Traced through the method: the gradient of n * x in n is x, not 0.
    grad = jax.grad(lambda m: read(m, 3.0))(model)
    assert float(grad.n) == 3.0
    # And through a closure over the model (a lambda kept as an attribute).
    reads = dec.Reads()
    assert float(jax.jit(lambda m: m.scaled(3.0))(reads)) == 60.0
    assert float(jax.grad(lambda m: m.scaled(3.0))(reads).n) == 30.0


def test_copies_and_pickles_rebind_as_plain_python_does(pair: Any) -> None:
    plain, dec = pair
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


@pytest.mark.parametrize("mode", ["eager", "f", "jit"])
def test_a_method_switched_by_another_method_stays_bound_to_the_running_model(
    pair: Any, mode: str
) -> None:
    plain, dec = pair
    expected_model = plain.Switchable()
    expected_model(1.0)
    expected_model.eval()
    expected = [float(expected_model(x)) for x in (2.0, 3.0)]
    model = dec.Switchable()
    model(1.0)
    model.eval()  # eagerly: plain Python
    if mode == "eager":
        got = [float(model(x)) for x in (2.0, 3.0)]
    else:
        f, states = model.functionalize()
        call = f if mode == "f" else jax.jit(f)
        got = []
        for x in (2.0, 3.0):
            out, states = call(states, x)
            got.append(float(out))
        frozen = autostate.freeze(f, states)
        assert frozen.step_fn.__self__ is frozen
        assert float(frozen.n) == float(expected_model.n)
    assert got == expected


@pytest.mark.parametrize("jit", [False, True])
def test_switching_a_stored_method_inside_a_functionalized_call_is_refused(
    pair: Any, jit: bool
) -> None:
    _, dec = pair
    f, states = dec.Switchable().functionalize()
    call = jax.jit(f.eval) if jit else f.eval
    with pytest.raises(autostate.AutostateError, match="method bound to one") as info:
        call(states)
    assert dec.__file__ in str(info.value)
    out, _ = jax.jit(f)(states, 1.0)  # f still runs
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
