"""Differential bug hunt 31: lazy initialisation, ensembles and layer stacking.

The idioms of users coming from PyTorch, Flax NNX / linen and Equinox:

- Lazy modules (PyTorch ``nn.LazyLinear``, Flax ``@compact``): ``self.w =
  None`` in ``__init__``, set on the first call from the input's shape;
  eagerly, then ``functionalize`` after the first eager call; ``functionalize``
  *before* the first call (a ``None`` state is static: the documented
  ``StaticStateError``); an init function (build, call once, functionalize)
  under ``jax.jit``, ``jax.eval_shape`` and ``jax.vmap`` over keys; a lazily
  created sub-model and a lazily built list of sub-models (through ``f``
  before the first call: the documented ``StateAccessError``); a list filled
  with ``append`` (static: refused inside a traced ``f``); a Flax-style
  ``self.params`` dict that gains its keys on the first call (works through
  ``f`` and ``jit`` before the first call); a lazy weight reset to ``None``
  eagerly; lazy creation inside a ``lax`` body and ``jax.checkpoint``;
  an outside-built lazy model under ``jax.eval_shape``; a lazy model primed
  inside ``jax.jit`` / ``jax.vmap`` and returned.
- Ensembles: ``jax.vmap`` over a constructor with per-member keys (the
  model itself: stacked leaves, ``vmap`` of its eager call refused, its
  ``functionalize()``; ``functionalize()`` inside the ``vmap``, the documented
  way); states of N members stacked with ``jax.tree.map`` and ``jax.vmap(f,
  in_axes=(0, None))``; stacked ``f`` too, with per-member gradients; a model
  holding a list of N members called in a Python loop against ``vmap`` of
  one member's ``f`` over its states.
- Scan over layers: ``f`` of one layer, per-layer ``(f, states)`` stacked,
  ``lax.scan`` over them in a function and inside a method of an outer model
  that holds the stacked pair (BatchNorm-style running statistics and
  counters written by the layer; gradients against hand-written JAX and
  finite differences); an Equinox-style stacked sub-model
  (``jax.vmap(Layer)(keys)``) scanned in a method.
- Models constructed inside traced code: inside ``jax.jit`` (called, then
  returned, and ``functionalize()``-d there), inside JAX's own ``lax.scan``
  body and ``jax.vmap`` in a plain function, inside a method during its call
  (eagerly, in ``f``, under ``jit``, in a routed ``lax.scan`` body); a model
  built in an outer ``jit`` and written in an inner transformation (the
  documented ``TracedEagerStateError``); a sub-model replaced inside a ``lax``
  body.
- Structure changes across calls: a KV cache grown by concatenation, a list
  state that grows, shrinks and is reset, a tuple that grows, ``None`` <->
  array toggles, through ``f`` with and without ``jit``; growing a state
  inside a ``lax.scan`` body (the documented ``ControlFlowStateError``).

Each source is written plain and decorated (``differential.pair``; ``lax.*``
is a Python loop and ``checkpoint`` the identity in the plain module);
``run_case`` compares outputs, states and every attribute (dtypes, shapes,
values) eagerly, through ``f``, under ``jax.jit`` of ``f`` and after
``autostate.freeze``. A case that shows a mismatch stays, marked
``xfail(strict=True, reason="BUG: ...")`` with what differs.

It found three bugs. Two share one mechanism (``runtime.store_state`` lets
an eager ``lax`` body assign a sub-model to a state unchecked, while
``control._with_eager_states`` swaps the state's slot for the body): a
sub-model created lazily inside a ``lax.scan`` / ``cond`` body of an eager
call (``if self.cell is None: self.cell = Cell()``) is silently dropped (the
attribute is ``None`` again after the call); a sub-model replaced inside a
``lax.scan`` / ``cond`` / ``checkpoint`` body stays on the eager model
holding the body's tracers. The third: a model built inside nested
transformations (``jax.jit`` of ``jax.grad``, ``jax.jit`` of ``jax.vmap``; a
jitted training step whose forward builds a temporary sub-model) cannot
write its own state (``TracedEagerStateError``) when the value holds a
tracer of an enclosing trace: ``local_state._check_not_traced`` accepted only
tracers of the exact trace the model was built in.

All three are fixed: a sub-model assigned inside an eager model's ``lax``
body is refused (``StateAccessError`` at the line, as through ``f``), and a
model may keep values of its home trace and of the traces that one runs in.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from differential import (  # noqa: I001 - tests/ is on sys.path
    pair,
    plain_path,
    same,
    snapshot,
    user_line,
)

import autostate
from autostate.errors import (
    ControlFlowStateError,
    StateAccessError,
    TracedEagerStateError,
)

Loader = Callable[..., types.ModuleType]


def _call(obj: Any, name: str) -> Callable[..., Any]:
    return obj if name == "__call__" else getattr(obj, name)


def run_case(
    plain: types.ModuleType,
    dec: types.ModuleType,
    build: str,
    calls: list[tuple[str, tuple[Any, ...]]],
    modes: tuple[str, ...] = ("eager", "f", "jit", "freeze"),
) -> None:
    """The calls on the plain model are the reference for every mode."""
    ref = eval(build, vars(plain))  # noqa: S307
    expected = [_call(ref, m)(*a) for m, a in calls]
    expected_snap = snapshot(ref)

    if "eager" in modes:
        model = eval(build, vars(dec))  # noqa: S307
        got = [_call(model, m)(*a) for m, a in calls]
        same(expected, got, "eager outputs")
        same(expected_snap, snapshot(model), "eager attributes")

    for mode in ("f", "jit"):
        if mode not in modes:
            continue
        model = eval(build, vars(dec))  # noqa: S307
        before = snapshot(model)
        f, states = model.functionalize()
        got = []
        for m, a in calls:
            fn = lambda f, s, *a, m=m: _call(f, m)(s, *a)  # noqa: E731
            if mode == "jit":
                fn = jax.jit(fn)
            out, states = fn(f, states, *a)
            got.append(out)
        same(expected, got, f"{mode} outputs")
        for key, value in states.items():
            same(snapshot(plain_path(ref, key)), snapshot(value), f"{mode} state {key}")
        same(before, snapshot(model), f"{mode}: the eager model changed")
        if mode == "jit" and "freeze" in modes:
            same(expected_snap, snapshot(autostate.freeze(f, states)), "frozen attributes")


def f_modes(f: Any, method: str = "__call__") -> list[Callable[..., Any]]:
    """``f.<method>`` called directly and under ``jax.jit``."""
    call = lambda s, *a: _call(f, method)(s, *a)  # noqa: E731
    return [call, jax.jit(call)]


def stack(*trees: Any) -> Any:
    return jax.tree.map(lambda *a: jnp.stack(a), *trees)


def has_tracer(obj: Any) -> bool:
    return any(isinstance(v, jax.core.Tracer) for v in jax.tree_util.tree_leaves(snapshot_raw(obj)))


def snapshot_raw(obj: Any, depth: int = 0) -> Any:
    """Every attribute value of a model, unconverted (tracers stay tracers)."""
    if depth > 6:
        return None
    if isinstance(obj, list | tuple):
        return [snapshot_raw(v, depth + 1) for v in obj]
    if isinstance(obj, dict):
        return [snapshot_raw(v, depth + 1) for v in obj.values()]
    if hasattr(obj, "__dict__") and type(obj).__module__.startswith("autostate_testmod"):
        return [snapshot_raw(getattr(obj, k), depth + 1) for k in sorted(vars(obj))]
    return obj


X23 = jnp.arange(6.0).reshape(2, 3) / 6.0
XS = jnp.stack([X23, -2.0 * X23, X23 + 0.5])


# ======================================================================================
# 1. Lazy modules
# ======================================================================================

LAZY = """
@DECORATE
class LazyLinear:
    def __init__(self, seed, out):
        self.key = jax.random.key(seed)
        self.out = out
        self.w = None
        self.b = None
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        if self.w is None:
            self.key, sub = jax.random.split(self.key)
            self.w = jax.random.normal(sub, (x.shape[-1], self.out))  # lazy w
            self.b = jnp.zeros(self.out)
        self.calls += 1
        return x @ self.w + self.b

    def reset(self):
        self.w = None
        self.b = None


@DECORATE
class LazyMLP:
    def __init__(self, seed, sizes):
        self.layers = [LazyLinear(seed + i, n) for i, n in enumerate(sizes)]

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.relu(layer(x))
        return self.layers[-1](x)


@DECORATE
class Head:
    def __init__(self, n):
        self.w = jnp.linspace(-1.0, 1.0, n)
        self.count = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.count += 1
        return x @ self.w * self.count


@DECORATE
class LazyHead:
    def __init__(self):
        self.scale = jnp.asarray(2.0)
        self.head = None

    def __call__(self, x):
        if self.head is None:
            self.head = Head(x.shape[-1])  # lazy head
        return self.head(x) * self.scale


@DECORATE
class LazyStack:
    def __init__(self, n):
        self.n = n
        self.layers = []

    def __call__(self, x):
        if not self.layers:
            self.layers = [Head(x.shape[-1]) for _ in range(self.n)]  # lazy layers
        return sum(layer(x) for layer in self.layers)


@DECORATE
class AppendStack:
    def __init__(self, n):
        self.n = n
        self.layers = []

    def __call__(self, x):
        while len(self.layers) < self.n:
            self.layers.append(Head(x.shape[-1]))
        return sum(layer(x) for layer in self.layers)


@DECORATE
class Compact:
    def __init__(self, seed, out):
        self.key = jax.random.key(seed)
        self.out = out
        self.params = {}
        self.steps = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        if "w" not in self.params:
            self.key, sub = jax.random.split(self.key)
            w = jax.random.normal(sub, (x.shape[-1], self.out))
            self.params = {**self.params, "w": w, "b": jnp.zeros(self.out)}
        self.steps += 1
        return x @ self.params["w"] + self.params["b"]


def primed(model, *args):
    model(*args)
    return model


def reset_after(model, *args):
    model(*args)
    model.reset()
    return model
"""


def test_lazy_linear_after_the_first_eager_call(write_module: Loader) -> None:
    # A lazily made weight is assigned in __call__, so it is a state (docs/faq.md, "A
    # weight that a method re-initializes is a state"): in `states`, not in f.
    plain, dec = pair(write_module, LAZY)
    run_case(plain, dec, "LazyLinear(0, 2)", [("__call__", (X23,)), ("__call__", (2 * X23,))],
             modes=("eager",))
    calls = [("__call__", (X23,)), ("__call__", (-X23,))]
    plain.X = dec.X = X23
    run_case(plain, dec, "primed(LazyLinear(0, 2), X)", calls)
    run_case(plain, dec, "primed(LazyMLP(3, [4, 2]), X)", calls)
    f, states = dec.primed(dec.LazyLinear(0, 2), X23).functionalize()
    assert sorted(states) == ["b", "calls", "key", "w"]
    assert autostate.param_dict(f) == {}


def test_lazy_linear_functionalized_before_the_first_call_means_plain_python(
    write_module: Loader,
) -> None:
    # None is a placeholder an array may replace inside f (tests/test_static_state.py):
    # the lazy weight is made by the first call of f, eagerly as under jit.
    plain, dec = pair(write_module, LAZY)
    run_case(plain, dec, "LazyLinear(0, 2)", [("__call__", (X23,)), ("__call__", (-X23,))])
    f, states = dec.LazyLinear(0, 2).functionalize()
    assert sorted(states) == ["b", "calls", "key", "w"] and states["w"] is None


def test_lazy_weight_reset_to_none_eagerly_is_refilled_by_f(write_module: Loader) -> None:
    # After `model.reset()` the None is the value of an array state (it is in `states`),
    # which a call of f may fill again: the same numbers as plain Python.
    plain, dec = pair(write_module, LAZY)
    plain.X = dec.X = X23
    run_case(plain, dec, "reset_after(LazyLinear(0, 2), X)", [("__call__", (X23,)),
                                                              ("__call__", (X23 * 3,))])
    f, states = dec.reset_after(dec.LazyLinear(0, 2), X23).functionalize()
    assert states["w"] is None


def test_lazy_init_function_under_jit_eval_shape_and_vmap(write_module: Loader) -> None:
    """Flax's ``model.init(key, x)``: build, call once, functionalize, inside a trace."""
    plain, dec = pair(write_module, LAZY)

    def init(seed_key: Any, x: Any) -> Any:
        m = dec.LazyMLP(0, [4, 2])
        m.layers[0].key = seed_key
        m(x)
        return m.functionalize()

    refs = []
    for seed in range(3):
        r = plain.LazyMLP(0, [4, 2])
        r.layers[0].key = jax.random.key(seed)
        refs.append(r)
    expected = [[r(X23) for r in refs], [r(-X23) for r in refs]]

    f, states = jax.jit(init)(jax.random.key(1), X23)
    out, states = jax.jit(lambda f, s, x: f(s, x))(f, states, -X23)
    same(expected[1][1], out, "jit init")
    same(snapshot(refs[1]), snapshot(autostate.freeze(f, states)), "jit init, frozen")

    abstract_f, abstract_states = jax.eval_shape(init, jax.random.key(1), X23)
    assert abstract_states["layers[0].w"].shape == (3, 4)
    assert abstract_states["layers[1].w"].shape == (4, 2)

    keys = jnp.stack([jax.random.key(s) for s in range(3)])
    F, S = jax.vmap(init, in_axes=(0, None))(keys, X23)
    assert S["layers[0].w"].shape == (3, 3, 4)
    out, S = jax.jit(jax.vmap(lambda f, s: f(s, -X23)))(F, S)
    same(jnp.stack(expected[1]), out, "vmap init")
    for i in range(3):
        member = autostate.freeze(*jax.tree.map(lambda a, i=i: a[i], (F, S)))
        same(snapshot(refs[i]), snapshot(member), f"member {i}")


def test_lazy_model_primed_inside_jit_or_vmap_and_returned(write_module: Loader) -> None:
    # Built and lazily initialised inside the trace: the returned model holds the arrays
    # (its None became an array there) and is an ordinary eager model afterwards.
    plain, dec = pair(write_module, LAZY)
    ref = plain.primed(plain.LazyLinear(0, 2), X23)
    m = jax.jit(lambda x: dec.primed(dec.LazyLinear(0, 2), x))(X23)
    same(snapshot(ref), snapshot(m), "jit")
    same(ref(-X23), m(-X23))
    same(snapshot(ref), snapshot(m))
    refs = [plain.primed(plain.LazyLinear(0, 2), x) for x in XS]
    ms = jax.vmap(lambda x: dec.primed(dec.LazyLinear(0, 2), x))(XS)
    same(jnp.stack([r.w for r in refs]), ms.w)
    same(jnp.stack([r.calls for r in refs]), ms.calls)


def test_lazy_sub_model_and_lazy_layer_list(write_module: Loader) -> None:
    plain, dec = pair(write_module, LAZY)
    plain.X = dec.X = X23
    calls = [("__call__", (X23,)), ("__call__", (X23 * 2,))]
    for cls in ("LazyHead()", "LazyStack(2)", "AppendStack(2)"):
        run_case(plain, dec, cls, calls, modes=("eager",))
        run_case(plain, dec, f"primed({cls}, X)", calls)
    # The lazily made head's weights are parameters of f (it is a sub-model): gradients
    # against plain Python.
    f, states = dec.primed(dec.LazyHead(), X23).functionalize()
    assert sorted(autostate.param_dict(f)) == ["head.w", "scale"]

    def plain_loss(w: Any, scale: Any) -> Any:
        m = plain.primed(plain.LazyHead(), X23)
        m.head.w, m.scale = w, scale
        return m(X23).sum()

    ref = plain.primed(plain.LazyHead(), X23)
    gw, gs = jax.grad(plain_loss, argnums=(0, 1))(ref.head.w, ref.scale)
    g = jax.grad(lambda f: f(states, X23)[0].sum())(f)
    same(gw, g.model.head.w, "grad head.w")
    same(gs, g.model.scale, "grad scale")


@pytest.mark.parametrize(("cls", "text"), [("LazyHead()", "# lazy head"),
                                           ("LazyStack(2)", "# lazy layers")])
def test_lazy_sub_model_built_inside_f_is_the_documented_error(
    write_module: Loader, cls: str, text: str
) -> None:
    # docs/errors.md, "StateAccessError: replacing a sub-model inside a functionalized call".
    _, dec = pair(write_module, LAZY)
    model = eval(cls, vars(dec))  # noqa: S307
    f, states = model.functionalize()
    for call in f_modes(f):
        with pytest.raises(StateAccessError, match="holds .or would hold. a sub-model") as err:
            call(states, X23)
        user_line(err.value, dec, text)
    assert snapshot(model) == snapshot(eval(cls, vars(dec)))  # noqa: S307


def test_lazy_layer_list_filled_by_append_inside_jit_is_refused(write_module: Loader) -> None:
    # A list only __init__ assigns is static: appended to inside a traced f, refused,
    # naming the attribute (rewrite_rules.md section 7), and put back.
    _, dec = pair(write_module, LAZY)
    f, states = dec.AppendStack(2).functionalize()
    with pytest.raises(StateAccessError, match=r"AppendStack.layers") as err:
        jax.jit(lambda f, s, x: f(s, x))(f, states, X23)
    assert "fix" in str(err.value)
    assert f.model.layers == []


def test_flax_compact_params_dict_filled_through_f_before_the_first_call(
    write_module: Loader,
) -> None:
    # A dict state may gain keys in a call of f: the states f returns hold them.
    plain, dec = pair(write_module, LAZY)
    calls = [("__call__", (X23,)), ("__call__", (-X23,)), ("__call__", (2 * X23,))]
    run_case(plain, dec, "Compact(5, 2)", calls)


LAZY_IN_BODY = """
@DECORATE
class Cell:
    def __init__(self, d):
        self.w = jnp.eye(d) * 0.5
        self.steps = jnp.zeros((), jnp.int32)

    def __call__(self, h, x):
        self.steps += 1
        h = jnp.tanh(h @ self.w + x)
        return h, h.sum()


@DECORATE
class RNN:
    def __init__(self):
        self.cell = None
        self.w = None

    def __call__(self, xs):
        if self.cell is None:
            self.cell = Cell(xs.shape[-1])
        return lax.scan(self.cell, jnp.zeros(xs.shape[-1]), xs)

    def in_body(self, xs):
        def body(h, x):
            if self.cell is None:
                self.cell = Cell(xs.shape[-1])  # cell in body
            return self.cell(h, x)
        return lax.scan(body, jnp.zeros(xs.shape[-1]), xs)

    def in_cond(self, x):
        def make(x):
            self.cell = Cell(x.shape[-1])  # cell in cond
            return x
        return lax.cond(x.sum() > 0, make, lambda x: x, x)

    def array_in_body(self, xs):
        def body(h, x):
            if self.w is None:
                self.w = jnp.eye(xs.shape[-1])  # w in body
            return h @ self.w + x, h.sum()
        return lax.scan(body, jnp.zeros(xs.shape[-1]), xs)

    def array_in_checkpoint(self, x):
        def inner(x):
            if self.w is None:
                self.w = jnp.eye(x.shape[-1])  # w in checkpoint
            return x @ self.w
        return checkpoint(inner)(x)


def primed(model, *args):
    model(*args)
    return model
"""

XR = jnp.arange(6.0).reshape(3, 2) / 6.0


def test_lazy_sub_model_created_before_a_lax_scan(write_module: Loader) -> None:
    plain, dec = pair(write_module, LAZY_IN_BODY)
    plain.XR = dec.XR = XR
    calls = [("__call__", (XR,)), ("__call__", (XR * 2,))]
    run_case(plain, dec, "RNN()", calls, modes=("eager",))
    run_case(plain, dec, "primed(RNN(), XR)", calls)


@pytest.mark.parametrize(("method", "arg"), [("in_body", XR), ("in_cond", XR[1])])
def test_lazy_sub_model_created_inside_a_lax_body_eagerly(
    write_module: Loader, method: str, arg: Any
) -> None:
    plain, dec = pair(write_module, LAZY_IN_BODY)
    # Refused as through f (below), naming the line; the model is left as it was.
    model = dec.RNN()
    with pytest.raises(StateAccessError, match="sub-model") as err:
        getattr(model, method)(arg)
    user_line(err.value, dec, "self.cell = Cell(")
    assert model.cell is None and not has_tracer(model)


def test_lazy_sub_model_created_inside_a_lax_body_through_f(write_module: Loader) -> None:
    _, dec = pair(write_module, LAZY_IN_BODY)
    f, states = dec.RNN().functionalize()
    for call in f_modes(f, "in_body"):
        with pytest.raises(StateAccessError, match="sub-model") as err:
            call(states, XR)
        user_line(err.value, dec, "# cell in body")


@pytest.mark.parametrize(("method", "arg", "text"), [
    ("array_in_body", XR, "return lax.scan(body, jnp.zeros(xs.shape[-1]), xs)"),
    ("array_in_checkpoint", XR[1], "return checkpoint(inner)(x)"),
])
def test_lazy_array_inside_a_lax_body_is_the_documented_control_flow_error(
    write_module: Loader, method: str, arg: Any, text: str
) -> None:
    # docs/limitations.md: a None placeholder first given its array inside a body,
    # whose carries and outputs keep their structure.
    _, dec = pair(write_module, LAZY_IN_BODY)
    model = dec.RNN()
    with pytest.raises(ControlFlowStateError) as err:
        getattr(model, method)(arg)
    user_line(err.value, dec, text)
    assert model.w is None
    f, states = dec.RNN().functionalize()
    for call in f_modes(f, method):
        with pytest.raises(ControlFlowStateError) as err:
            call(states, arg)
        user_line(err.value, dec, text)


def test_outside_built_lazy_model_under_eval_shape_is_refused(write_module: Loader) -> None:
    _, dec = pair(write_module, LAZY)
    model = dec.LazyLinear(0, 2)
    with pytest.raises(TracedEagerStateError) as err:
        jax.eval_shape(lambda x: model(x), X23)
    user_line(err.value, dec, "self.key, sub = jax.random.split(self.key)")
    assert model.w is None and int(model.calls) == 0


# ======================================================================================
# 2. Ensembles
# ======================================================================================

ENSEMBLE = """
@DECORATE
class Member:
    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.w = jax.random.normal(k1, (3, 2))
        self.b = jax.random.normal(k2, (2,))
        self.mean = jnp.zeros(2)
        self.steps = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        y = jnp.tanh(x @ self.w + self.b)
        self.mean = 0.9 * self.mean + 0.1 * y.mean(0)  # member mean
        self.steps += 1
        return y - self.mean


@DECORATE
class Ensemble:
    def __init__(self, seed, n):
        self.members = [Member(k) for k in jax.random.split(jax.random.key(seed), n)]
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.calls += 1
        return jnp.stack([m(x) for m in self.members])

    def vote(self, x):
        return jnp.stack([m(x) for m in self.members]).mean(0)


def member_keys(seed, n):
    return jax.random.split(jax.random.key(seed), n)
"""


def _members(mod: types.ModuleType, n: int = 3) -> list[Any]:
    return [mod.Member(k) for k in mod.member_keys(0, n)]


def test_vmap_over_the_constructor_returns_the_stacked_model(write_module: Loader) -> None:
    plain, dec = pair(write_module, ENSEMBLE)
    keys = dec.member_keys(0, 3)
    ms = jax.vmap(lambda k: dec.Member(k))(keys)
    refs = _members(plain)
    same(jnp.stack([r.w for r in refs]), ms.w)
    same(jnp.stack([r.mean for r in refs]), ms.mean)
    # Its eager call under vmap would keep the vmap's tracers: refused, naming the line.
    with pytest.raises(TracedEagerStateError) as err:
        jax.vmap(lambda m: m(X23))(ms)
    user_line(err.value, dec, "# member mean")
    same(jnp.zeros((3,), jnp.int32), ms.steps)
    # Functionalized, it is the ensemble.
    f, states = ms.functionalize()
    step = jax.jit(jax.vmap(lambda f, s, x: f(s, x), in_axes=(0, 0, None)))
    for x in (X23, -X23):
        out, states = step(f, states, x)
        same(jnp.stack([r(x) for r in refs]), out)
    same(jnp.stack([r.mean for r in refs]), states["mean"])
    same(jnp.stack([r.steps for r in refs]), states["steps"])


def test_vmap_of_functionalize_over_keys(write_module: Loader) -> None:
    # docs/tutorials/ensemble.md
    plain, dec = pair(write_module, ENSEMBLE)
    f, states = jax.vmap(lambda k: dec.Member(k).functionalize())(dec.member_keys(0, 3))
    refs = _members(plain)
    step = jax.vmap(lambda f, s, x: f(s, x), in_axes=(0, 0, None))
    for i, x in enumerate((X23, -X23, X23 * 2)):
        out, states = (jax.jit(step) if i else step)(f, states, x)
        same(jnp.stack([r(x) for r in refs]), out)
    for i, r in enumerate(refs):
        same(snapshot(r), snapshot(autostate.freeze(*jax.tree.map(lambda a, i=i: a[i],
                                                                   (f, states)))))


def test_stacked_states_of_members_with_one_f(write_module: Loader) -> None:
    # Same parameters, per-member states: jax.vmap(f, in_axes=(0, None)).
    plain, dec = pair(write_module, ENSEMBLE)
    key = jax.random.key(7)
    warm = [X23, -X23, 2 * X23]
    models = [dec.Member(key) for _ in warm]
    refs = [plain.Member(key) for _ in warm]
    for m, r, x in zip(models, refs, warm, strict=True):
        m(x)
        r(x)
    pairs = [m.functionalize() for m in models]
    f = pairs[0][0]
    states = stack(*[s for _, s in pairs])
    for i, x in enumerate((X23, X23 + 1.0)):
        fn = jax.vmap(f, in_axes=(0, None))
        out, states = (jax.jit(fn) if i else fn)(states, x)
        same(jnp.stack([r(x) for r in refs]), out)
    same(jnp.stack([r.mean for r in refs]), states["mean"])
    same(jnp.stack([r.steps for r in refs]), states["steps"])


def test_stacked_f_and_states_with_per_member_gradients(write_module: Loader) -> None:
    plain, dec = pair(write_module, ENSEMBLE)
    pairs = [m.functionalize() for m in _members(dec)]
    F = stack(*[f for f, _ in pairs])
    S = stack(*[s for _, s in pairs])

    def loss(f: Any, s: Any, x: Any) -> Any:
        out, s = f(s, x)
        return (out**2).sum(), s

    grads, S2 = jax.jit(jax.vmap(jax.grad(loss, has_aux=True), in_axes=(0, 0, None)))(F, S, X23)

    def plain_loss(w: Any, b: Any, i: int) -> Any:
        m = _members(plain)[i]
        m.w, m.b = w, b
        return (m(X23) ** 2).sum()

    refs = _members(plain)
    for i, r in enumerate(refs):
        gw, gb = jax.grad(plain_loss, argnums=(0, 1))(r.w, r.b, i)
        same(gw, grads.model.w[i], f"grad w {i}")
        same(gb, grads.model.b[i], f"grad b {i}")
        r(X23)
    same(jnp.stack([r.mean for r in refs]), S2["mean"])


def test_ensemble_of_a_list_of_members_against_vmap_of_one_member(write_module: Loader) -> None:
    plain, dec = pair(write_module, ENSEMBLE)
    calls = [("__call__", (X23,)), ("vote", (-X23,)), ("__call__", (2 * X23,))]
    run_case(plain, dec, "Ensemble(0, 3)", calls)
    # The ensemble's states, regrouped per member, through vmap of one member's f.
    f_e, s_e = dec.Ensemble(0, 3).functionalize()
    pairs = [m.functionalize() for m in _members(dec)]
    F = stack(*[f for f, _ in pairs])
    S = {k: jnp.stack([s_e[f"members[{i}].{k}"] for i in range(3)]) for k in ("mean", "steps")}
    step = jax.jit(jax.vmap(lambda f, s, x: f(s, x), in_axes=(0, 0, None)))
    for x in (X23, -X23):
        out_v, S = step(F, S, x)
        out_e, s_e = jax.jit(lambda f, s, x: f(s, x))(f_e, s_e, x)
        same(out_e, out_v)
    for i in range(3):
        same(s_e[f"members[{i}].mean"], S["mean"][i])


# ======================================================================================
# 3. Scan over layers
# ======================================================================================

LAYERS = """
@DECORATE
class Layer:
    def __init__(self, key):
        self.w = jax.random.normal(key, (3, 3)) * 0.5
        self.b = jnp.zeros(3)
        self.mean = jnp.zeros(3)
        self.n = jnp.zeros((), jnp.int32)

    def __call__(self, h):
        y = jnp.tanh(h @ self.w + self.b)
        self.mean = 0.9 * self.mean + 0.1 * y.mean(0)  # layer mean
        self.n += 1
        return y - self.mean

    def forward(self, h):
        return jnp.tanh(h @ self.w + self.b) - self.mean


def layer_keys(seed, n):
    return jax.random.split(jax.random.key(seed), n)


@DECORATE
class Stack:
    \"\"\"Holds the stacked (f, states) of its layers and scans f over them.\"\"\"

    def __init__(self, seed, n):
        self.F, self.S = jax.vmap(lambda k: Layer(k).functionalize())(layer_keys(seed, n))
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        def body(h, fs):
            f, s = fs
            h, s = f(s, h)
            self.calls += 1
            return h, s

        h, self.S = lax.scan(body, x, (self.F, self.S))
        return h


@DECORATE
class ListStack:
    \"\"\"The plain reference of Stack: a Python list of layers.\"\"\"

    def __init__(self, seed, n):
        self.layers = [Layer(k) for k in layer_keys(seed, n)]
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x)
            self.calls += 1
        return x


@DECORATE
class EqxStack:
    \"\"\"Equinox's idiom: one sub-model with stacked leaves.\"\"\"

    def __init__(self, seed, n):
        self.layers = jax.vmap(Layer)(layer_keys(seed, n))

    def read(self, x):
        return lax.scan(lambda h, layer: (layer.forward(h), None), x, self.layers)[0]

    def write(self, x):
        return lax.scan(lambda h, layer: (layer(h), None), x, self.layers)[0]  # eqx write
"""


def _scan_layers(F: Any, S: Any, x: Any) -> Any:
    def body(h: Any, fs: Any) -> Any:
        f, s = fs
        return f(s, h)

    return jax.lax.scan(body, x, (F, S))


def test_scan_over_stacked_layer_states_in_a_function(write_module: Loader) -> None:
    plain, dec = pair(write_module, LAYERS)
    F, S = jax.vmap(lambda k: dec.Layer(k).functionalize())(dec.layer_keys(1, 4))
    ref = plain.ListStack(1, 4)
    for i, x in enumerate((X23, -X23, X23 * 2)):
        h, S = (jax.jit(_scan_layers) if i else _scan_layers)(F, S, x)
        same(ref(x), h, f"step {i}")
    same(jnp.stack([r.mean for r in ref.layers]), S["mean"])
    same(jnp.stack([r.n for r in ref.layers]), S["n"])


def test_scan_over_layers_gradients_against_hand_written_jax(write_module: Loader) -> None:
    plain, dec = pair(write_module, LAYERS)
    F, S = jax.vmap(lambda k: dec.Layer(k).functionalize())(dec.layer_keys(1, 4))
    _, S = _scan_layers(F, S, X23)  # running statistics that are not zero

    def loss(F: Any) -> Any:
        h, S2 = _scan_layers(F, S, -X23)
        return (h**2).sum() + S2["mean"].sum()

    def hand(ws: Any, bs: Any) -> Any:
        means = S["mean"]
        h = -X23
        new_means = []
        for i in range(4):
            y = jnp.tanh(h @ ws[i] + bs[i])
            m = 0.9 * means[i] + 0.1 * y.mean(0)
            new_means.append(m)
            h = y - m
        return (h**2).sum() + jnp.stack(new_means).sum()

    g = jax.jit(jax.grad(loss))(F)
    gw, gb = jax.grad(hand, argnums=(0, 1))(F.model.w, F.model.b)
    same(gw, g.model.w, "grad w")
    same(gb, g.model.b, "grad b")
    # Finite differences along one direction.
    d = jax.tree.map(lambda a: jnp.ones_like(a) * 1e-2, F)
    eps = 1e-2
    jloss = jax.jit(loss)
    up = jloss(jax.tree.map(lambda a, v: a + eps * v, F, d))
    down = jloss(jax.tree.map(lambda a, v: a - eps * v, F, d))
    directional = sum(jnp.vdot(a, v) for a, v in zip(jax.tree.leaves(g), jax.tree.leaves(d),
                                                      strict=True))
    np.testing.assert_allclose(float(up - down) / (2 * eps), float(directional), rtol=2e-2)


def test_outer_model_scanning_its_layers_f(write_module: Loader) -> None:
    plain, dec = pair(write_module, LAYERS)
    ref = plain.ListStack(2, 3)
    expected = [ref(X23), ref(-X23)]
    for mode in ("eager", "f", "jit"):
        model = dec.Stack(2, 3)
        if mode == "eager":
            got = [model(X23), model(-X23)]
            s_mean, s_n, calls = model.S["mean"], model.S["n"], model.calls
        else:
            f, states = model.functionalize()
            assert sorted(states) == ["S", "calls"]
            assert sorted(autostate.param_dict(f)) == ["F.model.b", "F.model.w"]
            call = lambda f, s, x: f(s, x)  # noqa: E731
            if mode == "jit":
                call = jax.jit(call)
            got = []
            for x in (X23, -X23):
                out, states = call(f, states, x)
                got.append(out)
            s_mean, s_n, calls = states["S"]["mean"], states["S"]["n"], states["calls"]
            frozen = autostate.freeze(f, states)
            same(calls, frozen.calls)
        same(expected, got, mode)
        same(jnp.stack([r.mean for r in ref.layers]), s_mean, mode)
        same(jnp.stack([r.n for r in ref.layers]), s_n, mode)
        same(ref.calls, calls, mode)
    # Gradients w.r.t. the stacked layer parameters held by the outer model.
    f, states = dec.Stack(2, 3).functionalize()
    g = jax.grad(lambda f: (f(states, X23)[0] ** 2).sum())(f)

    def plain_loss(ws: Any) -> Any:
        m = plain.ListStack(2, 3)
        for layer, w in zip(m.layers, ws, strict=True):
            layer.w = w
        return (m(X23) ** 2).sum()

    gw = jax.grad(plain_loss)([layer.w for layer in plain.ListStack(2, 3).layers])
    same(jnp.stack(gw), g.model.F.model.w)


def test_equinox_stacked_sub_model_scanned_in_a_method(write_module: Loader) -> None:
    plain, dec = pair(write_module, LAYERS)
    ref = plain.ListStack(3, 4)
    expected = X23
    for layer in ref.layers:
        expected = layer.forward(expected)
    model = dec.EqxStack(3, 4)
    same(expected, model.read(X23), "eager")
    f, states = model.functionalize()
    assert sorted(states) == ["layers.mean", "layers.n"]
    for call in f_modes(f, "read"):
        out, _ = call(states, X23)
        same(expected, out)
    # A write through a slice of the stacked sub-model cannot land: a clear error at the
    # line (control_flow.md says EscapedStateError; this is a ControlFlowStateError).
    with pytest.raises(autostate.AutostateError) as err:
        model.write(X23)
    user_line(err.value, dec, "# eqx write")
    for call in f_modes(f, "write"):
        with pytest.raises(autostate.AutostateError) as err:
            call(states, X23)
        user_line(err.value, dec, "# eqx write")


# ======================================================================================
# 4. Models constructed inside traced code
# ======================================================================================

BUILT = """
@DECORATE
class Member:
    def __init__(self, key):
        self.w = jax.random.normal(key, (3,))
        self.mean = jnp.zeros(())
        self.n = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        y = x @ self.w
        self.mean = 0.5 * self.mean + 0.5 * y.mean()  # built mean
        self.n += 1
        return y * self.n


@DECORATE
class Outer:
    def __init__(self, seed):
        self.key = jax.random.key(seed)
        self.scale = jnp.asarray(2.0)
        self.total = jnp.zeros(())

    def __call__(self, x):
        self.key, sub = jax.random.split(self.key)
        tmp = Member(sub)
        y = tmp(x) + tmp(x)
        self.total = self.total + tmp.mean + tmp.n
        return y * self.scale

    def scanned(self, xs):
        def body(c, x):
            self.key, sub = jax.random.split(self.key)
            tmp = Member(sub)
            y = tmp(x)
            self.total = self.total + tmp.n
            return c + y.sum(), tmp.mean
        return lax.scan(body, jnp.zeros(()), xs)


@DECORATE
class Cell:
    def __init__(self, w):
        self.w = jnp.asarray(w)
        self.steps = jnp.zeros((), jnp.int32)

    def __call__(self, h):
        self.steps += 1
        return h * self.w


@DECORATE
class Swap:
    def __init__(self):
        self.cell = Cell(0.5)

    def scan(self, x):
        def body(h, _):
            self.cell = Cell(2.0)  # swap in scan
            return self.cell(h), None
        return lax.scan(body, x, None, length=2)[0]

    def cond(self, x):
        def t(x):
            self.cell = Cell(2.0)  # swap in cond
            return self.cell(x)
        return lax.cond(x > 0, t, lambda x: x, x)

    def ckpt(self, x):
        def t(x):
            self.cell = Cell(2.0)  # swap in checkpoint
            return self.cell(x)
        return checkpoint(t)(x)
"""


def test_model_built_inside_jit_called_and_returned(write_module: Loader) -> None:
    plain, dec = pair(write_module, BUILT)
    key = jax.random.key(0)
    ref = plain.Member(key)
    expected = [ref(X23), ref(-X23)]

    def use(k: Any, x: Any) -> Any:
        m = dec.Member(k)
        return m(x), m(-x), m

    a, b, m = jax.jit(use)(key, X23)
    same(expected, [a, b])
    same(snapshot(ref), snapshot(m), "returned model")
    # The returned model is an ordinary eager model.
    same(ref(X23 * 2), m(X23 * 2))
    same(snapshot(ref), snapshot(m))

    def init(k: Any, x: Any) -> Any:
        m = dec.Member(k)
        m(x)
        return m.functionalize()

    f, states = jax.jit(init)(key, X23)
    out, states = jax.jit(lambda f, s, x: f(s, x))(f, states, -X23)
    r2 = plain.Member(key)
    r2(X23)
    same(r2(-X23), out)
    same(snapshot(r2), snapshot(autostate.freeze(f, states)))


def test_model_built_inside_a_jax_scan_body_and_vmap_of_a_plain_function(
    write_module: Loader,
) -> None:
    plain, dec = pair(write_module, BUILT)
    key = jax.random.key(3)

    def run(mod: types.ModuleType, x: Any) -> Any:
        m = mod.Member(key)
        y = m(x)
        return y + m(x), m.mean, m.n

    def scanned(xs: Any) -> Any:
        return jax.lax.scan(lambda c, x: (c + run(dec, x)[0].sum(), run(dec, x)[1:]), 0.0, xs)

    c, ys = 0.0, []
    for x in XS:
        c = c + run(plain, x)[0].sum()
        ys.append(run(plain, x)[1:])
    expected = (c, (jnp.stack([y[0] for y in ys]), jnp.stack([y[1] for y in ys])))
    same(expected, scanned(XS), "scan")
    same(expected, jax.jit(scanned)(XS), "jit scan")
    expected_v = [jnp.stack(v) for v in zip(*[run(plain, x) for x in XS], strict=True)]
    same(expected_v, list(jax.vmap(lambda x: run(dec, x))(XS)), "vmap")


def test_model_built_inside_a_method_during_its_call(write_module: Loader) -> None:
    plain, dec = pair(write_module, BUILT)
    plain.XS = dec.XS = XS
    calls = [("__call__", (X23,)), ("scanned", (XS,)), ("__call__", (-X23,))]
    run_case(plain, dec, "Outer(0)", calls)
    f, states = dec.Outer(0).functionalize()

    def plain_loss(scale: Any) -> Any:
        m = plain.Outer(0)
        m.scale = scale
        return m(X23).sum()

    g = jax.grad(lambda f: f(states, X23)[0].sum())(f)
    same(jax.grad(plain_loss)(plain.Outer(0).scale), g.model.scale)


def test_model_built_inside_a_method_in_a_jitted_grad_step(write_module: Loader) -> None:
    # The everyday training step: jax.jit(jax.grad(loss)) over f, whose forward builds a
    # temporary sub-model (a dynamic sub-model in forward).
    plain, dec = pair(write_module, BUILT)
    f, states = dec.Outer(0).functionalize()

    def plain_loss(scale: Any) -> Any:
        m = plain.Outer(0)
        m.scale = scale
        return m(X23).sum()

    g = jax.jit(jax.grad(lambda f: f(states, X23)[0].sum()))(f)
    same(jax.grad(plain_loss)(plain.Outer(0).scale), g.model.scale)


def test_model_built_inside_jit_of_grad_of_a_plain_function(write_module: Loader) -> None:
    plain, dec = pair(write_module, BUILT)
    key = jax.random.key(0)

    def loss(mod: types.ModuleType, scale: Any, x: Any) -> Any:
        return (mod.Member(key)(x) * scale).sum()

    expected = jax.grad(lambda s: loss(plain, s, X23))(2.0)
    same(expected, jax.grad(lambda s: loss(dec, s, X23))(2.0), "grad")
    same(expected, jax.jit(jax.grad(lambda s, x: loss(dec, s, x)))(2.0, X23), "jit(grad)")


def test_ensemble_init_under_jit_of_vmap(write_module: Loader) -> None:
    plain, dec = pair(write_module, LAZY)

    def init(seed_key: Any, x: Any) -> Any:
        m = dec.LazyMLP(0, [4, 2])
        m.layers[0].key = seed_key
        m(x)
        return m.functionalize()

    keys = jnp.stack([jax.random.key(s) for s in range(3)])
    F, S = jax.jit(jax.vmap(init, in_axes=(0, None)))(keys, X23)
    refs = []
    for seed in range(3):
        r = plain.LazyMLP(0, [4, 2])
        r.layers[0].key = jax.random.key(seed)
        r(X23)
        refs.append(r)
    for i in range(3):
        member = autostate.freeze(*jax.tree.map(lambda a, i=i: a[i], (F, S)))
        same(snapshot(refs[i]), snapshot(member), f"member {i}")


@pytest.mark.parametrize(
    "inner",
    [
        lambda m, xs: jax.lax.scan(lambda c, x: (c + m(x).sum(), None), 0.0, xs)[0],
        lambda m, xs: jax.vmap(lambda x: m(x))(xs),
        lambda m, xs: jax.jit(lambda x: m(x))(xs[0]),
        lambda m, xs: jax.checkpoint(lambda x: m(x))(xs[0]),
    ],
    ids=["lax.scan", "vmap", "jit", "checkpoint"],
)
def test_model_built_in_jit_written_in_an_inner_transformation_is_refused(
    write_module: Loader, inner: Callable[..., Any]
) -> None:
    _, dec = pair(write_module, BUILT)

    def g(k: Any, xs: Any) -> Any:
        m = dec.Member(k)
        return inner(m, xs), m.n

    with pytest.raises(TracedEagerStateError) as err:
        jax.jit(g)(jax.random.key(0), XS)
    user_line(err.value, dec, "# built mean")


def test_model_built_in_jit_threaded_by_autostate_scan(write_module: Loader) -> None:
    plain, dec = pair(write_module, BUILT)
    key = jax.random.key(0)

    def g(k: Any, xs: Any) -> Any:
        m = dec.Member(k)
        c, _ = autostate.scan(lambda c, x: (c + m(x).sum(), None), 0.0, xs)
        return c, m.n, m.mean

    ref = plain.Member(key)
    c = 0.0
    for x in XS:
        c = c + ref(x).sum()
    same((c, ref.n, ref.mean), g(key, XS), "eager")
    same((c, ref.n, ref.mean), jax.jit(g)(key, XS), "jit")


@pytest.mark.parametrize("method", ["scan", "cond", "ckpt"])
def test_sub_model_replaced_inside_a_lax_body_eagerly(write_module: Loader, method: str) -> None:
    plain, dec = pair(write_module, BUILT)
    model = dec.Swap()
    with pytest.raises(StateAccessError, match="sub-model") as err:
        getattr(model, method)(jnp.asarray(1.0))
    user_line(err.value, dec, "self.cell = Cell(2.0)")
    assert not has_tracer(model), "a tracer leaked into the eager model"


@pytest.mark.parametrize(("method", "text"), [("scan", "# swap in scan"), ("cond", "# swap in cond"),
                                              ("ckpt", "# swap in checkpoint")])
def test_sub_model_replaced_inside_a_lax_body_through_f(
    write_module: Loader, method: str, text: str
) -> None:
    _, dec = pair(write_module, BUILT)
    f, states = dec.Swap().functionalize()
    for call in f_modes(f, method):
        with pytest.raises(StateAccessError, match="sub-model") as err:
            call(states, jnp.asarray(1.0))
        user_line(err.value, dec, text)


# ======================================================================================
# 5. Structure changes across calls
# ======================================================================================

GROW = """
@DECORATE
class Cache:
    def __init__(self):
        self.kv = jnp.zeros((0, 2))
        self.hist = []
        self.seen = ()

    def __call__(self, x):
        self.kv = jnp.concatenate([self.kv, x[None]])
        self.hist = self.hist + [x.sum()]
        self.seen = self.seen + (x[0],)
        return self.kv.sum(0)

    def shrink(self):
        self.hist = self.hist[1:]
        self.kv = self.kv[1:]
        return self.kv.mean(0)

    def reset(self):
        self.kv = jnp.zeros((0, 2))
        self.hist = []
        self.seen = ()
        return self.kv.sum()

    def grow_in_scan(self, xs):
        def body(c, x):
            self.kv = jnp.concatenate([self.kv, x[None]])
            return c, None
        return lax.scan(body, jnp.zeros(()), xs)[0]  # grow in scan

    def append_in_scan(self, xs):
        def body(c, x):
            self.hist = self.hist + [x.sum()]
            return c, None
        return lax.scan(body, jnp.zeros(()), xs)[0]  # append in scan


@DECORATE
class Toggle:
    def __init__(self):
        self.cache = jnp.zeros(2)
        self.n = jnp.zeros((), jnp.int32)

    def clear(self):
        self.cache = None
        return self.n

    def __call__(self, x):
        self.n += 1
        if self.cache is None:
            self.cache = x
        else:
            self.cache = self.cache + x
        return self.cache * self.n


def cleared():
    t = Toggle()
    t.clear()
    return t
"""

V2 = jnp.array([1.0, -2.0])


def test_growing_cache_and_list_and_tuple_states(write_module: Loader) -> None:
    plain, dec = pair(write_module, GROW)
    calls = [
        ("__call__", (V2,)),
        ("__call__", (2 * V2,)),
        ("__call__", (-V2,)),
        ("shrink", ()),
        ("reset", ()),
        ("__call__", (V2 + 1,)),
    ]
    run_case(plain, dec, "Cache()", calls)


def test_none_array_toggle(write_module: Loader) -> None:
    plain, dec = pair(write_module, GROW)
    calls = [
        ("__call__", (V2,)),
        ("clear", ()),
        ("__call__", (2 * V2,)),
        ("__call__", (V2,)),
        ("clear", ()),
    ]
    run_case(plain, dec, "Toggle()", calls)
    run_case(plain, dec, "cleared()", [("__call__", (V2,)), ("clear", ()), ("__call__", (V2,))])


@pytest.mark.parametrize(("method", "text"), [("grow_in_scan", "# grow in scan"),
                                              ("append_in_scan", "# append in scan")])
def test_growing_a_state_inside_a_lax_scan_is_the_documented_error(
    write_module: Loader, method: str, text: str
) -> None:
    # docs/errors.md, "A state changes shape inside a loop body": the lax call's line.
    _, dec = pair(write_module, GROW)
    model = dec.Cache()
    with pytest.raises(ControlFlowStateError) as err:
        getattr(model, method)(XR)
    user_line(err.value, dec, text)
    assert model.kv.shape == (0, 2) and model.hist == []
    f, states = dec.Cache().functionalize()
    for call in f_modes(f, method):
        with pytest.raises(ControlFlowStateError) as err:
            call(states, XR)
        user_line(err.value, dec, text)
