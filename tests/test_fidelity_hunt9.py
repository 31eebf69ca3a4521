"""Differential bug hunt 9: Python constructs around state, PyTorch idioms,
transformations not covered before, and realistic models end to end.

- Python constructs in methods that touch state: ``with self:`` whose
  ``__enter__``/``__exit__`` write state, a ``contextlib.contextmanager``
  (as a method, and nested in one), ``try``/``except``/``finally``, an
  exception caught after a write (also one raised inside a ``lax`` body),
  lambdas with default arguments, ``nonlocal`` closures, generator
  expressions and lazy generators, ``match`` class patterns, iteration over
  ``vars(self)``.
- PyTorch idioms: lazy initialization (``LazyLinear``, ``hasattr``),
  ``setattr``/``getattr`` with f-string names, ``__dict__.update``,
  ``register_buffer``-style helpers, ``train()``/``eval()`` flags, Python-int
  step counters, states that change shape or dtype, a cache reset to ``None``.
- Transformations: ``lax.fori_loop``/``while_loop``/``switch``/``map`` and
  their keyword forms, ``jax.checkpoint`` with a ``policy``, nested ``jit``,
  ``named_scope``, ``jvp``/``linearize``/``jacfwd``/``jacrev``/``hessian``/
  ``eval_shape``/``make_jaxpr`` of ``f``, ``custom_jvp``/``custom_vjp``,
  ``vmap`` with ``in_axes`` dicts and ``axis_name`` + ``lax.pmean``.
- Realistic models: spectral normalization, an EMA teacher sharing a
  sub-model with its student, a GAN with two optimizers, gradient
  accumulation, a learning-rate schedule held by the model, an attention
  block with a KV cache written by ``.at[].set`` and
  ``lax.dynamic_update_slice`` at a traced position.

Each source is written plain and decorated (``differential.pair``; ``lax.*``
is a Python loop in the plain module); a case that shows a mismatch stays,
marked ``xfail(strict=True)`` with what differs.
"""

from __future__ import annotations

import re
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from differential import (  # noqa: I001 - tests/ is on sys.path
    HEADER,
    X,
    _fcall,
    assert_same,
    check,
    check_transform,
    pair,
    snapshot,
)

import autostate
from autostate.errors import (
    ControlFlowStateError,
    DecorationError,
    EscapedStateError,
    StateAccessError,
    StaticStateError,
    TracedEagerStateError,
    UnhandledLocalStateError,
)

Loader = Callable[..., types.ModuleType]

X1 = jnp.float32(1.5)
X2 = jnp.float32(2.0)
XS = jnp.arange(1.0, 4.0)
V3 = jnp.array([0.5, 1.0, -1.0])


def real_lax_pair(write_module: Loader, source: str) -> tuple[types.ModuleType, types.ModuleType]:
    """The source plain and decorated, both with JAX's own ``lax`` (for calls whose
    branches do not assign state, where undecorated JAX is the reference)."""
    plain = write_module(HEADER + "from jax import lax\n" + source.replace("@DECORATE", ""))
    dec = write_module(
        HEADER + "from jax import lax\n" + source.replace("@DECORATE", "@autostate.stateful")
    )
    return plain, dec


def modes_of(f: Any, method: str) -> list[Callable[..., Any]]:
    """The functional call of ``method``, as is and under ``jax.jit``."""
    call = _fcall(f, method)
    return [call, jax.jit(call)]


def no_tracer(model: Any) -> None:
    assert not autostate.lifetime.contains_tracer(snapshot(model)), "tracer leaked into the model"


# ======================================================================================
# 1. Python constructs in methods that touch state
# ======================================================================================

CONSTRUCTS = """
import contextlib


@DECORATE
class Ctx:
    __match_args__ = ("s",)

    def __init__(self):
        self.w = jnp.ones(3)
        self.depth = jnp.zeros(())
        self.s = jnp.zeros(())
        self.log = jnp.zeros(())

    def __enter__(self):
        self.depth = self.depth + 1
        return self

    def __exit__(self, *exc):
        self.depth = self.depth - 1
        self.log = self.log + 10
        return False

    def with_self(self, x):
        with self:
            self.s = self.s + x * self.depth
        return self.s + self.depth

    def nested_cm(self, x):
        @contextlib.contextmanager
        def scope():
            self.depth = self.depth + 1
            try:
                yield self.s
            finally:
                self.depth = self.depth - 1
                self.s = self.s * 2
        with scope() as v:
            self.s = self.s + x + v
        return self.s

    def try_finally(self, x):
        try:
            self.s = self.s + x
            raise ValueError("boom")
        except ValueError:
            self.log = self.log + 1
        finally:
            self.depth = self.depth + 2
        return self.s

    def raising_inner(self, x):
        self.s = self.s + x
        raise KeyError("inner")

    def catches(self, x):
        try:
            self.raising_inner(x)
        except KeyError:
            self.log = self.log + 100
        return self.s + self.log

    def lambda_default(self, x):
        f = lambda v, base=self.s: v + base
        self.s = self.s + 1
        return f(x) + self.s

    def closure_nonlocal(self, x):
        total = jnp.zeros(())
        def add(v):
            nonlocal total
            total = total + v * self.s
            self.s = self.s + 1
        add(x)
        add(x)
        return total

    def genexpr_writes(self, x):
        def bump(i):
            self.s = self.s + i * x
            return self.s
        vals = list(bump(i) for i in range(3))
        d = {i: bump(i) for i in range(2)}
        return jnp.stack(vals), d

    def fstring(self, x):
        self.s = self.s + x
        msg = f"depth={self.depth} s={self.s!r}"
        return self.s, len(msg) > 0

    def assert_eagerly(self, x):
        self.s = self.s + x
        assert self.log.shape == ()
        return self.s

    def lazy_gen(self, n):
        def gen():
            for i in range(n):
                self.s = self.s + i
                yield self.s
        return gen()

    def consume_lazy(self, x):
        out = [v for v in self.lazy_gen(3)]
        return jnp.stack(out) + x

    def class_pattern(self, x):
        self.s = self.s + x
        match self:
            case Ctx(s):
                return s * 2
        return x

    def match_shape(self, x):
        match self.w.shape:
            case (3,):
                self.s = self.s + x
            case _:
                self.s = self.s - x
        return self.s

    def sum_over_vars_keys(self, x):
        self.s = self.s + x
        return sum(jnp.sum(getattr(self, k)) for k in sorted(vars(self)))

    def scan_raises(self, xs):
        def body(c, x):
            self.s = self.s + x
            if c.ndim == 0:
                raise ValueError("stop")
            return c, x
        try:
            lax.scan(body, jnp.zeros(()), xs)
        except ValueError:
            pass
        return self.s

    def cond_raises(self, x):
        def yes(v):
            self.s = self.s + v
            raise ValueError("stop")
        def no(v):
            return v
        try:
            lax.cond(x > 0, yes, no, x)
        except ValueError:
            pass
        return self.s + 1

    def count_arrays(self):
        return sum(1 for v in vars(self).values() if isinstance(v, jax.Array))

    def buffers(self):
        return {k: v for k, v in self.__dict__.items() if isinstance(v, jax.Array)}
"""

CONSTRUCT_METHODS = [
    "with_self", "nested_cm", "try_finally", "catches", "lambda_default", "closure_nonlocal",
    "genexpr_writes", "fstring", "assert_eagerly", "consume_lazy", "class_pattern",
    "match_shape", "sum_over_vars_keys",
]


@pytest.mark.parametrize("method", CONSTRUCT_METHODS)
def test_python_constructs_around_state(write_module: Loader, method: str) -> None:
    plain, dec = pair(write_module, CONSTRUCTS)
    check(plain, dec, "Ctx()", [(method, (X1,)), (method, (X2,))])


@pytest.mark.parametrize("transform", ["grad", "vmap"])
@pytest.mark.parametrize(
    "method", ["with_self", "nested_cm", "try_finally", "catches", "lambda_default",
               "closure_nonlocal", "consume_lazy"],
)
def test_python_constructs_under_grad_and_vmap(
    write_module: Loader, method: str, transform: str
) -> None:
    plain, dec = pair(write_module, CONSTRUCTS)
    x = X1 if transform == "grad" else jnp.arange(3.0)
    check_transform(plain, dec, "Ctx()", [(method, (X,)), (method, (X,))], x, transform)


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


def test_lazy_generator_returned_by_f_is_refused_after_the_call(write_module: Loader) -> None:
    plain, dec = pair(write_module, CONSTRUCTS)
    p, d = plain.Ctx(), dec.Ctx()
    assert_same(list(p.lazy_gen(3)), list(d.lazy_gen(3)), "eager")
    assert_same(snapshot(p), snapshot(d), "eager attributes")
    f, states = dec.Ctx().functionalize()
    gen, new = f.lazy_gen(states, 3)
    with pytest.raises(UnhandledLocalStateError, match="State 's'"):
        list(gen)
    assert_same(states, new, "the states are unchanged")


@pytest.mark.parametrize("method,arg", [("scan_raises", XS), ("cond_raises", X1)])
def test_exception_raised_inside_a_lax_body_after_a_write(
    write_module: Loader, method: str, arg: Any
) -> None:
    """Plain Python's loop keeps the write made before the raise; JAX keeps
    nothing a body that raises computed. The state is not silently rolled
    back: reading it is a ControlFlowStateError naming it and the lax call,
    eagerly, through f and under jit (it was the old value, silently)."""
    _, dec = pair(write_module, CONSTRUCTS)
    model = dec.Ctx()
    with pytest.raises(ControlFlowStateError, match=r"State 'Ctx\.s' has no value.*ValueError"):
        getattr(model, method)(arg)
    with pytest.raises(ControlFlowStateError, match="has no value"):
        model.s  # noqa: B018 - the read is the test
    with pytest.raises(ControlFlowStateError, match="has no value"):
        model.functionalize()
    model.s = jnp.full((), 5.0)  # assigning it gives it a value again
    assert_same(np.float32(5.0), model.s, "assigned again")
    f, states = dec.Ctx().functionalize()
    for call in modes_of(f, method):
        with pytest.raises(ControlFlowStateError, match=r"State 's' has no value.*ValueError"):
            call(states, arg)
    assert_same(np.float32(0.0), states["s"], "the states given to f are unchanged")


@pytest.mark.parametrize("method", ["count_arrays", "buffers"])
def test_iterating_the_instance_dict_sees_values(write_module: Loader, method: str) -> None:
    plain, dec = pair(write_module, CONSTRUCTS)
    check(plain, dec, "Ctx()", [(method, ())])


def test_sum_over_vars_keys_under_grad(write_module: Loader) -> None:
    plain, dec = pair(write_module, CONSTRUCTS)
    check_transform(plain, dec, "Ctx()", [("sum_over_vars_keys", (X,))], X1, "grad")


# ======================================================================================
# 2. PyTorch idioms
# ======================================================================================

TORCH = """
@DECORATE
class LazyLinear:
    def __init__(self, out):
        self.out = out
        self.w = None

    def __call__(self, x):
        if self.w is None:
            self.w = jnp.ones((x.shape[-1], self.out)) * 0.5  # LAZY
        return x @ self.w


@DECORATE
class Dyn:
    def __init__(self, n):
        self.n = n
        for i in range(n):
            setattr(self, f"layer{i}", jnp.full((), float(i + 1)))
        self.acc = jnp.zeros(())

    def __call__(self, x):
        for i in range(self.n):
            x = x * getattr(self, f"layer{i}")
        self.acc = self.acc + x
        return x


@DECORATE
class Sub:
    def __init__(self, k):
        self.w = jnp.full((2,), k)
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.calls += 1
        return x * self.w


@DECORATE
class NamedLayers:
    def __init__(self, n):
        self.n = n
        for i in range(n):
            setattr(self, f"layer{i}", Sub(float(i + 1)))

    def __call__(self, x):
        for i in range(self.n):
            x = getattr(self, f"layer{i}")(x)
        return x


@DECORATE
class DictUpdate:
    def __init__(self):
        self.__dict__.update(a=jnp.ones(()), b=jnp.zeros(()))
        self.c = jnp.zeros(())

    def __call__(self, x):
        self.c = self.c + x * self.a + self.b
        return self.c


@DECORATE
class Buffers:
    def __init__(self):
        self._buffers = {}
        self.register_buffer("mean", jnp.zeros(2))
        self.steps = jnp.zeros((), jnp.int32)

    def register_buffer(self, name, value):
        self._buffers[name] = value

    def __call__(self, x):
        self._buffers = {**self._buffers, "mean": 0.9 * self._buffers["mean"] + 0.1 * x}
        self.steps += 1
        return self._buffers["mean"]


@DECORATE
class Mode:
    def __init__(self):
        self.training = True
        self.mean = jnp.zeros(())

    def train(self, mode=True):
        self.training = mode
        return self

    def eval(self):
        return self.train(False)

    def set_eval(self):
        self.eval()

    def __call__(self, x):
        if self.training:
            self.mean = 0.5 * self.mean + 0.5 * x
            return x - x
        return x - self.mean

    def predict_in_eval(self, x):
        old = self.training
        self.training = False  # TOGGLE
        y = self(x)
        self.training = old
        return y


@DECORATE
class PyCounter:
    def __init__(self):
        self.step = 0
        self.acc = jnp.zeros(())

    def __call__(self, x):
        self.step += 1  # STEP
        self.acc = self.acc + x * self.step
        return self.acc


@DECORATE
class ShapeChange:
    def __init__(self):
        self.hist = jnp.zeros((0,))

    def __call__(self, x):
        self.hist = jnp.concatenate([self.hist, x[None]])
        return self.hist.sum()


@DECORATE
class DtypeChange:
    def __init__(self):
        self.v = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.v = self.v + x
        return self.v


@DECORATE
class ResetCache:
    def __init__(self):
        self.cache = jnp.zeros(())

    def reset(self):
        self.cache = None

    def __call__(self, x):
        if self.cache is None:
            self.cache = x
        else:
            self.cache = self.cache + x
        return self.cache
"""


@pytest.mark.parametrize(
    "build,calls",
    [
        ("Dyn(3)", [("__call__", (X1,))] * 2),
        ("NamedLayers(3)", [("__call__", (jnp.array([1.0, 2.0]),))] * 2),
        ("DictUpdate()", [("__call__", (X1,))] * 2),
        ("Buffers()", [("__call__", (jnp.array([1.0, 2.0]),))] * 2),
        ("Mode()", [("__call__", (X1,)), ("__call__", (X2,))]),
        ("Mode().eval()", [("__call__", (X1,)), ("__call__", (X2,))]),
        ("ShapeChange()", [("__call__", (X1,))] * 3),
        ("DtypeChange()", [("__call__", (X1,))] * 2),
    ],
    ids=["dyn-names", "named-sub-models", "dict-update", "buffers", "train", "eval",
         "shape-change", "dtype-change"],
)
def test_torch_idioms(write_module: Loader, build: str, calls: list[Any]) -> None:
    plain, dec = pair(write_module, TORCH)
    check(plain, dec, build, calls)


def test_named_sub_models_have_path_names(write_module: Loader) -> None:
    _, dec = pair(write_module, TORCH)
    _, states = dec.NamedLayers(2).functionalize()
    assert sorted(states) == ["layer0.calls", "layer1.calls"]


@pytest.mark.parametrize("transform", ["grad", "vmap"])
@pytest.mark.parametrize("build", ["Dyn(3)", "Buffers()", "Mode()"])
def test_torch_idioms_under_grad_and_vmap(write_module: Loader, build: str, transform: str) -> None:
    plain, dec = pair(write_module, TORCH)
    x = X1 if transform == "grad" else jnp.arange(3.0)
    if build == "Buffers()":
        x = jnp.array([1.0, 2.0]) if transform == "grad" else jnp.ones((3, 2))
    check_transform(plain, dec, build, [("__call__", (X,)), ("__call__", (X,))], x, transform)


def test_eval_switched_eagerly_between_calls(write_module: Loader) -> None:
    plain, dec = pair(write_module, TORCH)
    check(plain, dec, "Mode()", [("__call__", (X1,)), ("set_eval", ()), ("__call__", (X2,))],
          modes=("eager",))


def test_lazy_linear_eagerly_like_plain(write_module: Loader) -> None:
    plain, dec = pair(write_module, TORCH)
    check(plain, dec, "LazyLinear(2)", [("__call__", (V3,))] * 2, modes=("eager",))


def test_lazy_linear_first_built_inside_f_means_plain_python(write_module: Loader) -> None:
    # None is a placeholder (DESIGN.md section 3): the weight built inside f lands in the states.
    plain, dec = pair(write_module, TORCH)
    check(plain, dec, "LazyLinear(2)", [("__call__", (V3,))] * 2)
    f, states = dec.LazyLinear(2).functionalize()
    for call in modes_of(f, "__call__"):
        _, new_states = call(states, V3)
        assert_same(new_states["w"], jnp.ones((3, 2)) * 0.5)


def test_lazy_linear_built_eagerly_then_functionalized(write_module: Loader) -> None:
    plain, dec = pair(write_module, TORCH)
    ref, model = plain.LazyLinear(2), dec.LazyLinear(2)
    assert_same(ref(V3), model(V3))
    f, states = model.functionalize()
    assert sorted(states) == ["w"]
    out, states = jax.jit(lambda f, s, x: f(s, x))(f, states, V3 * 2)
    assert_same(ref(V3 * 2), out)
    assert_same(ref.w, states["w"])
    grad = jax.grad(lambda s: f(s, V3)[0].sum())(states)
    assert_same(np.outer(np.asarray(V3), np.ones(2)), grad["w"])


def test_hasattr_lazy_cache_is_a_documented_decoration_error(write_module: Loader) -> None:
    source = """
@DECORATE
class HasattrCache:
    def __init__(self):
        self.k = jnp.ones(())

    def __call__(self, x):
        if not hasattr(self, "cache"):
            self.cache = x * 0
        self.cache = self.cache + x
        return self.cache * self.k
"""
    with pytest.raises(DecorationError, match="'cache' by name") as info:
        pair(write_module, source)
    assert re.search(r"\.py:\d+ \(in HasattrCache\.__call__\)", str(info.value))
    assert "fix:" in str(info.value)


def test_state_initialized_by_dict_update_is_a_clear_decoration_error(write_module: Loader) -> None:
    """Plain Python runs it; the analysis sees no `self.count = ...` in __init__ and
    says so at the user's line (the message calls it 'first assigned outside __init__')."""
    source = """
@DECORATE
class Counted:
    def __init__(self):
        self.__dict__.update(count=jnp.zeros((), jnp.int32))

    def __call__(self, x):
        self.count += 1
        return x * self.count
"""
    with pytest.raises(DecorationError, match="state 'count'") as info:
        pair(write_module, source)
    assert re.search(r"\.py:\d+ \(in Counted\.__call__\)", str(info.value))
    assert "fix:" in str(info.value)


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
    step = jax.jit(lambda f, s, x: f(s, x))
    for x in (X1, X2):
        out, states = step(f, states, x)
        assert_same(ref(x), out)
    ref.reset()
    _, states = jax.jit(f.reset)(states)
    assert states["cache"] is None
    for x in (X1, X2):
        out, states = step(f, states, x)
        assert_same(ref(x), out)
    assert_same(ref.cache, states["cache"])


# ======================================================================================
# 3a. lax control flow inside methods: more primitives, keyword forms, nesting
# ======================================================================================

LAXES = """
def py_assoc_scan(fn, xs):
    out = [xs[0]]
    for x in xs[1:]:
        out.append(fn(out[-1], x))
    return jnp.stack(out)


def py_fori_loop(lower, upper, body, init, unroll=None):
    return lax.fori_loop(lower, upper, body, init)


PLAIN = type(lax).__name__ == "_PyLax"
ASSOC = py_assoc_scan if PLAIN else jax.lax.associative_scan
FORI = py_fori_loop if PLAIN else jax.lax.fori_loop  # routed like lax.fori_loop


@DECORATE
class Net:
    def __init__(self):
        self.w = jnp.array([1.0, -2.0, 0.5])
        self.calls = jnp.zeros((), jnp.int32)
        self.mean = jnp.zeros(3)

    def __call__(self, x):
        self.calls += 1
        self.mean = 0.9 * self.mean + 0.1 * x
        return jnp.sum(jnp.sin(x * self.w) * self.mean) + x @ x

    def fori(self, x, n):
        def body(i, h):
            self.calls += 1
            self.mean = self.mean + h * i
            return h * 0.5 + self.mean
        return lax.fori_loop(0, n, body, x)

    def while_(self, x):
        def cond(c):
            return c[0] < 3
        def body(c):
            self.mean = self.mean + c[1]
            self.calls += 1
            return (c[0] + 1, c[1] * 2)
        return lax.while_loop(cond, body, (0, x))[1]

    def while_cond_reads_state(self, x):
        def cond(v):
            return self.calls < 3
        def body(v):
            self.calls += 1
            self.mean = self.mean + v
            return v * 2
        return lax.while_loop(cond, body, x)

    def switch(self, i, x):
        def b0(v):
            self.mean = self.mean + v
            return v
        def b1(v):
            self.calls += 2
            return v * 2
        def b2(v):
            self.mean = self.mean * v
            self.calls += 1
            return -v
        return lax.switch(i, [b0, b1, b2], x)

    def map_(self, xs):
        def one(x):
            self.calls += 1
            self.mean = self.mean + x
            return x * self.w
        return lax.map(one, xs)

    def nested_jit_read(self, x):
        self.calls += 1
        return jax.jit(lambda v: v * self.w + self.mean)(x)

    def named(self, x):
        with jax.named_scope("block"):
            self.mean = self.mean + x
            self.calls += 1
        return self.mean

    def ckpt_policy(self, x):
        def block(v):
            self.mean = self.mean + v
            self.calls += 1
            return jnp.sin(v * self.w) * self.mean
        return checkpoint(block, policy=jax.checkpoint_policies.nothing_saveable)(x).sum()

    def ckpt_policy_dots(self, x):
        @functools.partial(checkpoint, policy=jax.checkpoint_policies.dots_saveable)
        def block(v):
            self.mean = self.mean + v
            return jnp.sin(v * self.w) @ self.mean
        return block(x)

    def ckpt_static(self, x):
        def block(v, k):
            self.mean = self.mean + v * k
            return v * self.mean * (2 if k > 1 else 3)
        return checkpoint(block, static_argnums=(1,))(x, 2).sum()

    def assoc(self, xs):
        self.mean = self.mean + xs.sum(0)
        return ASSOC(jnp.add, xs)

    def scan_in_cond(self, x, flag):
        def yes(v):
            def body(c, _):
                self.calls += 1
                self.mean = self.mean + c
                return c * 0.5, None
            return lax.scan(body, v, None, length=3)[0]
        def no(v):
            self.calls += 10
            return v
        return lax.cond(flag, yes, no, x)

    def while_in_scan(self, xs):
        def body(c, x):
            def wc(k):
                return k < 2
            def wb(k):
                self.calls += 1
                return k + 1
            lax.while_loop(wc, wb, 0)
            self.mean = self.mean + x
            return c, self.calls
        return lax.scan(body, 0.0, xs)[1]

    def scan_keywords(self, xs):
        def body(c, x):
            self.mean = self.mean + x
            return c, self.mean
        return lax.scan(body, init=0.0, xs=xs)[1]

    def fori_keywords(self, x):
        def body(i, v):
            self.mean = self.mean + v * i
            return v
        return FORI(0, 4, body, x, unroll=2)

    def scan_partial_method(self, xs):
        return lax.scan(functools.partial(self.bump, 2.0), 0.0, xs)[1]

    def bump(self, k, c, x):
        self.mean = self.mean + k * x
        return c, self.mean

    def cond_different_states(self, x):
        def yes(v):
            self.mean = self.mean + v
            return v
        def no(v):
            self.calls += 1
            return v
        return lax.cond(x.sum() > 0, yes, no, x)

    def cond_python_float(self, x):
        def yes(v):
            self.mean = 0.0 * self.mean + 1.0
            return v
        def no(v):
            self.mean = self.mean + v
            return v
        return lax.cond(x.sum() > 0, yes, no, x)
"""

STACK = jnp.stack([V3, V3 * 2])

LAX_CALLS = [
    ("call", [("__call__", (V3,))] * 2),
    ("fori", [("fori", (V3, 3))] * 2),
    ("while", [("while_", (V3,))] * 2),
    ("while-cond-reads-state", [("while_cond_reads_state", (V3,))] * 2),
    ("switch", [("switch", (0, V3)), ("switch", (jnp.int32(2), V3)), ("switch", (jnp.int32(1), V3)),
                ("switch", (jnp.int32(7), V3)), ("switch", (jnp.int32(-4), V3))]),
    ("map", [("map_", (STACK,))] * 2),
    ("nested-jit-read", [("nested_jit_read", (V3,))] * 2),
    ("named-scope", [("named", (V3,))] * 2),
    ("checkpoint-policy", [("ckpt_policy", (V3,))] * 2),
    ("checkpoint-policy-decorator", [("ckpt_policy_dots", (V3,))] * 2),
    ("checkpoint-static-argnums", [("ckpt_static", (V3,))] * 2),
    ("associative-scan", [("assoc", (STACK,))] * 2),
    ("scan-in-cond", [("scan_in_cond", (X1, True)), ("scan_in_cond", (X1, False))]),
    ("while-in-scan", [("while_in_scan", (XS,))] * 2),
    ("scan-keywords", [("scan_keywords", (STACK,))] * 2),
    ("fori-unroll", [("fori_keywords", (V3,))] * 2),
    ("scan-partial-method", [("scan_partial_method", (STACK,))] * 2),
    ("cond-different-states", [("cond_different_states", (V3,)),
                               ("cond_different_states", (-V3 * 3,))]),
    ("cond-python-float", [("cond_python_float", (V3,)), ("cond_python_float", (-V3 * 3,))]),
]


@pytest.mark.parametrize("calls", [c[1] for c in LAX_CALLS], ids=[c[0] for c in LAX_CALLS])
def test_lax_control_flow_in_methods(write_module: Loader, calls: list[Any]) -> None:
    plain, dec = pair(write_module, LAXES)
    check(plain, dec, "Net()", calls)


LAX_TRANSFORMED = [
    ("fori", ("fori", (X, 3)), V3),
    ("switch", ("switch", (jnp.int32(2), X)), V3),
    ("map", ("map_", (X,)), STACK),
    ("checkpoint-policy", ("ckpt_policy", (X,)), V3),
    ("checkpoint-policy-decorator", ("ckpt_policy_dots", (X,)), V3),
    ("named-scope", ("named", (X,)), V3),
    ("call", ("__call__", (X,)), V3),
]


@pytest.mark.parametrize("transform", ["grad", "vmap"])
@pytest.mark.parametrize(
    "call,x", [c[1:] for c in LAX_TRANSFORMED], ids=[c[0] for c in LAX_TRANSFORMED]
)
def test_lax_control_flow_under_grad_and_vmap(
    write_module: Loader, call: Any, x: Any, transform: str
) -> None:
    plain, dec = pair(write_module, LAXES)
    xv = x if transform == "grad" else jnp.stack([x, x + 1])
    check_transform(plain, dec, "Net()", [call, call], xv, transform)


def test_cond_writing_different_states_grad_and_batched_predicate(write_module: Loader) -> None:
    plain, dec = pair(write_module, LAXES)
    call = ("cond_different_states", (X,))
    check_transform(plain, dec, "Net()", [call, call], V3, "grad")
    # a batched predicate: each example keeps the states of the branch it took
    xs = jnp.stack([V3, -V3 * 3, V3 * 2])
    f, states = dec.Net().functionalize()
    twice = jax.vmap(lambda x: [f.cond_different_states(s, x) for s in [states]][0])
    outs, new = jax.jit(twice)(xs)
    for i, x in enumerate(xs):
        ref = plain.Net()
        assert_same(ref.cond_different_states(x), outs[i], f"output {i}")
        assert_same({"mean": ref.mean, "calls": ref.calls},
                    {"mean": new["mean"][i], "calls": new["calls"][i]}, f"states {i}")


KEYWORD_LAX = """
@DECORATE
class Kw:
    def __init__(self):
        self.s = jnp.ones(())
        self.w = jnp.full((), 2.0)

    def cond_operand_keyword_no_state(self, x):
        return lax.cond(x > 0, lambda v: v * self.w, lambda v: -v, operand=x)

    def cond_operand_keyword(self, x):
        self.s = self.s + x
        return lax.cond(x > 0, lambda v: v * self.s, lambda v: -v, operand=x)

    def switch_operand_keyword(self, x):
        self.s = self.s + x
        return lax.switch(1, [lambda v: v, lambda v: v * self.s], operand=x)

    def cond_all_keywords(self, x):
        self.s = self.s + x
        return lax.cond(pred=x > 0, true_fun=lambda v: v * self.s, false_fun=lambda v: -v,
                        operand=x)

    def while_keywords(self, x):
        self.s = self.s + 1
        return lax.while_loop(cond_fun=lambda v: v < 10.0, body_fun=lambda v: v * self.s + 1,
                              init_val=x)

    def fori_keywords(self, x):
        self.s = self.s + 1
        return lax.fori_loop(lower=0, upper=3, body_fun=lambda i, v: v * self.s, init_val=x)

    def map_batch_size(self, xs):
        self.s = self.s + 1
        return lax.map(lambda v: v * self.s, xs, batch_size=2)

    def checkpoint_name_policy(self, x):
        self.s = self.s + x
        def blk(v):
            return jax.ad_checkpoint.checkpoint_name(v * self.s, "h")
        pol = jax.checkpoint_policies.save_only_these_names("h")
        return jax.checkpoint(blk, policy=pol)(x)
"""

KEYWORD_OK = ["while_keywords", "fori_keywords", "map_batch_size", "checkpoint_name_policy"]
KEYWORD_OPERAND = ["cond_operand_keyword_no_state", "cond_operand_keyword",
                  "switch_operand_keyword", "cond_all_keywords"]


@pytest.mark.parametrize("method", KEYWORD_OK)
def test_lax_keyword_forms_like_undecorated_jax(write_module: Loader, method: str) -> None:
    plain, dec = real_lax_pair(write_module, "import jax.ad_checkpoint\n" + KEYWORD_LAX)
    arg = jnp.arange(1.0, 5.0) if method == "map_batch_size" else X1
    check(plain, dec, "Kw()", [(method, (arg,))] * 2)


@pytest.mark.parametrize("method", KEYWORD_OPERAND)
def test_lax_operand_keyword_like_undecorated_jax(write_module: Loader, method: str) -> None:
    plain, dec = real_lax_pair(write_module, "import jax.ad_checkpoint\n" + KEYWORD_LAX)
    check(plain, dec, "Kw()", [(method, (X1,)), (method, (-X2,))])


def test_every_routed_wrapper_takes_every_parameter_of_jax() -> None:
    """The family of the operand= bug: a call that resolves to a JAX function is
    routed to ``autostate.control``, so each wrapper must take every parameter
    the JAX function takes, by the same name (or through ``**kwargs``)."""
    import inspect

    from autostate import control

    for target, name in control._TARGETS.items():
        theirs = inspect.signature(target).parameters
        ours = inspect.signature(getattr(control, name)).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in ours.values())
        for pname, param in theirs.items():
            if param.kind is param.VAR_POSITIONAL:
                assert any(p.kind is p.VAR_POSITIONAL for p in ours.values()), (name, pname)
            elif param.kind is not param.VAR_KEYWORD:
                assert pname in ours or takes_any, f"autostate.{name} lacks {pname!r}"


# ======================================================================================
# 3b. What lax bodies do besides threaded array states
# ======================================================================================

BODIES = """
@DECORATE
class Other:
    def __init__(self):
        self.n = jnp.zeros(())

    def bump(self, x):
        self.n = self.n + x
        return self.n


OTHER = Other()


@DECORATE
class B:
    def __init__(self):
        self.a = jnp.zeros(())
        self.b = jnp.ones(())
        self.key = jax.random.PRNGKey(0)
        self.tkey = jax.random.key(1)
        self.step = 0
        self.trace_log = []
        self.lr = 0.5
        self.sub = Other()
        self.subs = [self.sub, self.sub]

    def global_model_in_scan(self, xs):
        def body(c, x):
            return c, OTHER.bump(x)
        return lax.scan(body, 0.0, xs)[1]

    def reset(self):
        self.b = jnp.ones(())

    def dyn_setattr_in_scan(self, xs):
        def body(c, x):
            for name in ("a", "b"):
                setattr(self, name, getattr(self, name) + x)
            return c, self.a * self.b
        return lax.scan(body, 0.0, xs)[1]

    def tied_in_scan(self, xs):
        def body(c, x):
            return c, self.subs[0].bump(x) + self.subs[1].bump(x)
        return lax.scan(body, 0.0, xs)[1]

    def keys_in_scan(self, xs):
        def body(c, x):
            self.key, sub = jax.random.split(self.key)
            self.tkey, tsub = jax.random.split(self.tkey)
            return c, jax.random.uniform(sub) + jax.random.uniform(tsub) + x
        return lax.scan(body, 0.0, xs)[1]

    def float_lr_in_scan(self, xs):
        def body(c, x):
            self.lr = self.lr * 0.9
            return c, x * self.lr
        return lax.scan(body, 0.0, xs)[1]

    def python_int_in_scan(self, xs):
        def body(c, x):
            self.a = 0  # INT
            return c, x
        lax.scan(body, 0.0, xs)
        return self.a

    def static_counter_in_scan(self, xs):
        def body(c, x):
            self.step += 1  # STATIC
            return c, x * 2
        return lax.scan(body, 0.0, xs)[1]

    def log_in_scan(self, xs):
        def body(c, x):
            self.trace_log.append(1)
            return c, x * 2
        return lax.scan(body, 0.0, xs)[1]
"""


@pytest.mark.parametrize(
    "method", ["dyn_setattr_in_scan", "tied_in_scan", "keys_in_scan", "float_lr_in_scan"]
)
def test_lax_bodies_writing_states_of_every_kind(write_module: Loader, method: str) -> None:
    plain, dec = pair(write_module, BODIES)
    check(plain, dec, "B()", [(method, (XS,))] * 2)


PARAM_WRITES = """
def set_b(m, v):
    m.b = v


@DECORATE
class P:
    def __init__(self):
        self.a = jnp.zeros(())
        self.b = jnp.ones(())  # a parameter: no method assigns `self.b`

    def touch(self):
        self.a = self.a + 1

    def via_setattr(self, xs):
        name = "b"
        def body(c, x):
            setattr(self, name, self.b + x)
            return c, self.b
        return lax.scan(body, 0.0, xs)[1]

    def via_helper(self, xs):
        def body(c, x):
            set_b(self, self.b + x)
            return c, self.b
        return lax.scan(body, 0.0, xs)[1]

    def via_helper_in_cond(self, xs):
        def yes(v):
            set_b(self, self.b + v)
            return v
        return lax.cond(xs.sum() > 0, yes, lambda v: v, xs[0])
"""

PARAM_WRITERS = ["via_setattr", "via_helper", "via_helper_in_cond"]


@pytest.mark.parametrize("method", PARAM_WRITERS)
def test_non_state_written_in_a_lax_body_is_refused_in_f(write_module: Loader, method: str) -> None:
    _, dec = pair(write_module, PARAM_WRITES)
    f, states = dec.P().functionalize()
    for call in modes_of(f, method):
        with pytest.raises(StateAccessError, match="P.b is not state") as info:
            call(states, XS)
        assert f"{dec.__file__}:" in str(info.value)
    assert_same(np.float32(1.0), vars(f.model)["b"], "the parameter is unchanged")


@pytest.mark.parametrize("method", PARAM_WRITERS)
def test_non_state_written_in_a_lax_body_eagerly(write_module: Loader, method: str) -> None:
    """Eagerly, as under f: a traced value assigned to an attribute that is not
    state inside a lax body is refused at the assignment, naming it; the model
    keeps its value and holds no tracer (it was a raw UnexpectedTracerError)."""
    _, dec = pair(write_module, PARAM_WRITES)
    model = dec.P()
    with pytest.raises(StateAccessError, match=r"P\.b is not state") as info:
        getattr(model, method)(XS)
    assert "lax." in str(info.value) and ".py:" in str(info.value)
    no_tracer(model)
    assert_same(np.float32(1.0), model.b, "refused: the parameter is unchanged")
    f, states = dec.P().functionalize()
    for call in modes_of(f, method):
        with pytest.raises(StateAccessError, match=r"P\.b is not state"):
            call(states, XS)


# The family: every routed lax call (and jax.checkpoint) traces its body, so
# in each one, eagerly as under f and jit, a traced value assigned to an
# attribute that is not state, and a new Python value assigned to a static
# state, are refused at the assignment; the model is left as it was.
EVERY_LAX_BODY = """
def set_b(m, v):
    m.b = v


@DECORATE
class Q:
    def __init__(self):
        self.a = jnp.zeros(())
        self.b = jnp.ones(())  # a parameter: no method assigns `self.b`
        self.step = 0          # a static state

    def touch(self):
        self.a = self.a + 1
        self.step = self.step + 0

    def write(self, what, v):
        if what == "param":
            set_b(self, self.b + v)
        elif what == "raise":
            self.a = self.a + v
            raise ValueError("stop")
        else:
            self.step += 1
        return v

    def caught(self, method, x):
        try:
            getattr(self, method)("raise", x)
        except ValueError:
            pass
        return self.a + 1

    def scan_(self, what, x):
        return lax.scan(lambda c, v: (c + self.write(what, v), None), 0.0, x * jnp.ones(3))[0]

    def cond_(self, what, x):
        return lax.cond(x > 0, lambda v: self.write(what, v), lambda v: v, x)

    def switch_(self, what, x):
        return lax.switch(1, [lambda v: v, lambda v: self.write(what, v)], x)

    def while_(self, what, x):
        return lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, self.write(what, c[1])),
                              (0, x))[1]

    def fori_(self, what, x):
        return lax.fori_loop(0, 3, lambda i, v: self.write(what, v), x)

    def map_(self, what, x):
        return lax.map(lambda v: self.write(what, v), x * jnp.ones(3))

    def checkpoint_(self, what, x):
        return jax.checkpoint(lambda v: self.write(what, v))(x)
"""

LAX_CALLS = ["scan_", "cond_", "switch_", "while_", "fori_", "map_", "checkpoint_"]


@pytest.mark.parametrize("method", LAX_CALLS)
@pytest.mark.parametrize("what", ["param", "static"])
def test_every_lax_body_refuses_what_it_cannot_thread(
    write_module: Loader, method: str, what: str
) -> None:
    _, dec = pair(write_module, EVERY_LAX_BODY)
    error, pattern = (
        (StateAccessError, r"Q\.b is not state") if what == "param"
        else (StaticStateError, r"(?i)static state .*step")
    )
    model = dec.Q()
    with pytest.raises(error, match=pattern) as info:
        getattr(model, method)(what, X1)
    assert ".py:" in str(info.value)
    no_tracer(model)
    assert model.step == 0
    assert_same(np.float32(1.0), model.b, "the parameter is unchanged")
    f, states = dec.Q().functionalize()
    call = _fcall(f, method)
    for mode in (call, jax.jit(lambda s, x: call(s, what, x))):
        with pytest.raises(error, match=pattern):
            mode(states, what, X1) if mode is call else mode(states, X1)


@pytest.mark.parametrize("method", LAX_CALLS)
def test_every_lax_body_that_raises_after_a_write_loses_the_state_loudly(
    write_module: Loader, method: str
) -> None:
    """A body that raises after assigning a state, caught around the lax call:
    reading the state is a ControlFlowStateError (plain Python kept the write;
    JAX keeps nothing), eagerly, through f and under jit; a new assignment
    gives it a value again."""
    _, dec = pair(write_module, EVERY_LAX_BODY)
    model = dec.Q()
    with pytest.raises(ControlFlowStateError, match=r"has no value.*raised ValueError"):
        model.caught(method, X1)
    model.a = jnp.full((), 2.0)
    assert_same(np.float32(3.0), model.caught.__self__.a + 1, "assigned again")
    f, states = dec.Q().functionalize()
    call = _fcall(f, "caught")
    for mode in (call, jax.jit(lambda s, x: call(s, method, x))):
        with pytest.raises(ControlFlowStateError, match=r"State 'a' has no value"):
            mode(states, method, X1) if mode is call else mode(states, X1)


def test_a_global_eager_model_written_in_a_scan_body_is_refused(write_module: Loader) -> None:
    _, dec = pair(write_module, BODIES)
    model = dec.B()
    f, states = model.functionalize()
    calls = [lambda: model.global_model_in_scan(XS), *[
        (lambda c=c: c(states, XS)) for c in modes_of(f, "global_model_in_scan")]]
    for call in calls:
        with pytest.raises(TracedEagerStateError, match="State 'n'"):
            call()
        assert_same(np.float32(0.0), dec.OTHER.n, "the global model is unchanged")
        no_tracer(dec.OTHER)


def test_python_int_assigned_to_a_float_state_in_a_scan_is_a_control_flow_error(
    write_module: Loader,
) -> None:
    _, dec = pair(write_module, BODIES)
    model = dec.B()
    f, states = model.functionalize()
    for call in [lambda: model.python_int_in_scan(XS),
                 *[(lambda c=c: c(states, XS)) for c in modes_of(f, "python_int_in_scan")]]:
        with pytest.raises(ControlFlowStateError, match="float32\\[\\] to int32\\[\\]") as info:
            call()
        assert f"{dec.__file__}:" in str(info.value)
    no_tracer(model)


def test_static_counter_in_a_scan_is_refused_in_f(write_module: Loader) -> None:
    _, dec = pair(write_module, BODIES)
    f, states = dec.B().functionalize()
    for call in modes_of(f, "static_counter_in_scan"):
        with pytest.raises(StaticStateError, match="static state 'step'"):
            call(states, XS)


def test_static_counter_in_a_scan_eagerly(write_module: Loader) -> None:
    """Eagerly, as under f: a Python-int state assigned a new value in a lax
    body is a StaticStateError at that line (it counted the body's traces, 2
    per call, against plain Python's 3 iterations); the state is unchanged."""
    _, dec = pair(write_module, BODIES)
    model = dec.B()
    with pytest.raises(StaticStateError, match=r"B\.step .* lax\.scan") as info:
        model.static_counter_in_scan(XS)
    assert ".py:" in str(info.value)
    assert model.step == 0
    assert type(vars(model)["step"]).__name__ == "StaticState"


def test_list_appended_in_a_scan_body_is_refused_under_jit(write_module: Loader) -> None:
    _, dec = pair(write_module, BODIES)
    f, states = dec.B().functionalize()
    with pytest.raises(StateAccessError, match="trace_log"):
        jax.jit(f.log_in_scan)(states, XS)
    assert f.model.trace_log == []


# ======================================================================================
# 3c. Transformations of f from outside, custom derivatives, named axes
# ======================================================================================

OUTSIDE = """
@jax.custom_jvp
def softplus(x):
    return jnp.log1p(jnp.exp(x))


@softplus.defjvp
def _softplus_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return softplus(x), jax.nn.sigmoid(x) * t


@jax.custom_vjp
def clip_grad(x):
    return x


def _clip_fwd(x):
    return x, None


def _clip_bwd(_, g):
    return (jnp.clip(g, -0.1, 0.1),)


clip_grad.defvjp(_clip_fwd, _clip_bwd)


@DECORATE
class Net:
    def __init__(self):
        self.w = jnp.array([1.0, -2.0, 0.5])
        self.mean = jnp.zeros(3)
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.calls += 1
        self.mean = 0.9 * self.mean + 0.1 * x
        h = softplus(x * self.w) + self.mean * x
        return jnp.sum(h * h)

    def clipped(self, x):
        self.calls += 1
        self.mean = 0.9 * self.mean + 0.1 * x
        return jnp.sum(clip_grad(self.mean * x) * self.w)

    def bump(self, x):
        self.mean = self.mean + x
        return x * 2

    def custom_vjp_writes(self, x):
        @jax.custom_vjp
        def g(v):
            return self.bump(v)
        def fwd(v):
            return self.bump(v), None
        def bwd(_, ct):
            return (ct,)
        g.defvjp(fwd, bwd)
        return g(x).sum() + self.mean.sum()  # READ

    def custom_jvp_writes(self, x):
        @jax.custom_jvp
        def g(v):
            return self.bump(v)
        @g.defjvp
        def g_jvp(p, t):
            return g(p[0]), t[0]
        return g(x).sum() + self.mean.sum()  # READ


@DECORATE
class Last:
    def __init__(self):
        self.last = jnp.zeros(3)
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.calls += 1
        self.last = x * 2
        return jnp.sum(x ** 2)


@DECORATE
class BN:
    def __init__(self, n, axis_name=None):
        self.axis_name = axis_name
        self.mean = jnp.zeros(n)
        self.var = jnp.ones(n)
        self.scale = jnp.ones(n) * 2

    def __call__(self, x):
        m, v = x, x * 0
        if self.axis_name is not None:
            m = jax.lax.pmean(x, self.axis_name)
            v = jax.lax.pmean((x - m) ** 2, self.axis_name)
        self.mean = 0.9 * self.mean + 0.1 * m
        self.var = 0.9 * self.var + 0.1 * v
        return (x - m) * self.scale
"""


@pytest.mark.parametrize("method", ["__call__", "clipped"])
def test_custom_jvp_and_vjp_functions_in_methods(write_module: Loader, method: str) -> None:
    plain, dec = pair(write_module, OUTSIDE)
    check(plain, dec, "Net()", [(method, (V3,))] * 2)
    check_transform(plain, dec, "Net()", [(method, (X,))] * 2, V3, "grad")
    check_transform(plain, dec, "Net()", [(method, (X,))] * 2, STACK, "vmap")


def _plain_and_f(plain: types.ModuleType, dec: types.ModuleType) -> tuple[Any, Any, Any]:
    f, states = dec.Net().functionalize()

    def plain_fn(x: Any) -> Any:
        m = plain.Net()
        out = m(x)
        return out, m.mean

    def f_fn(x: Any) -> Any:
        out, new = f(states, x)
        return out, new["mean"]

    return plain_fn, f_fn, (f, states)


FORWARD_TRANSFORMS: dict[str, Callable[[Callable[..., Any]], Any]] = {
    "jvp": lambda fn: jax.jvp(fn, (V3,), (jnp.ones(3),)),
    "linearize": lambda fn: (lambda y, lin: (y, lin(jnp.ones(3))))(*jax.linearize(fn, V3)),
    "jacfwd": lambda fn: jax.jacfwd(fn)(V3),
    "jacrev": lambda fn: jax.jacrev(fn)(V3),
    "hessian": lambda fn: jax.hessian(lambda x: fn(x)[0])(V3),
    "jit-hessian": lambda fn: jax.jit(jax.hessian(lambda x: fn(x)[0]))(V3),
    "vjp": lambda fn: (lambda y, back: (y, back((jnp.float32(1.0), jnp.ones(3)))))(
        *jax.vjp(fn, V3)),
}


@pytest.mark.parametrize("transform", list(FORWARD_TRANSFORMS))
def test_jvp_linearize_jacobians_hessian_of_f(write_module: Loader, transform: str) -> None:
    plain, dec = pair(write_module, OUTSIDE)
    plain_fn, f_fn, (f, states) = _plain_and_f(plain, dec)
    apply = FORWARD_TRANSFORMS[transform]
    assert_same(apply(plain_fn), apply(f_fn), transform)
    out, new = f(states, V3)  # f still works after the transformation
    assert_same(plain_fn(V3), (out, new["mean"]), "f afterwards")


def test_eval_shape_and_make_jaxpr_of_f(write_module: Loader) -> None:
    _, dec = pair(write_module, OUTSIDE)
    model = dec.Net()
    f, states = model.functionalize()
    shapes = jax.eval_shape(lambda s, x: f(s, x), states, V3)
    assert shapes[0].shape == () and shapes[1]["mean"].shape == (3,)
    assert shapes[1]["calls"].dtype == jnp.int32
    jaxpr = jax.make_jaxpr(lambda s, x: f(s, x))(states, V3)
    assert len(jaxpr.out_avals) == 3
    assert_same(np.zeros(3, np.float32), model.mean, "the eager model is unchanged")
    _, new = f(states, V3)
    assert_same(np.asarray(V3) * 0.1, new["mean"])


def test_jacrev_with_respect_to_f(write_module: Loader) -> None:
    plain, dec = pair(write_module, OUTSIDE)
    f, states = dec.Net().functionalize()

    def plain_loss(w: Any) -> Any:
        m = plain.Net()
        m.w = w
        return m(V3)

    g = jax.jacrev(lambda f, s, x: f(s, x)[0])(f, states, V3)
    assert_same(jax.grad(plain_loss)(plain.Net().w), g.model.w)


@pytest.mark.parametrize("method", ["custom_vjp_writes", "custom_jvp_writes"])
def test_custom_derivative_closure_writing_state(write_module: Loader, method: str) -> None:
    """Concrete calls run the closure like plain Python; under jit its write would hold a
    tracer of the custom derivative's own trace: refused, naming the user's line."""
    plain, dec = pair(write_module, OUTSIDE)
    check(plain, dec, "Net()", [(method, (V3,))] * 2, modes=("eager", "f"))
    f, states = dec.Net().functionalize()
    with pytest.raises(EscapedStateError, match="State 'mean'") as info:
        jax.jit(_fcall(f, method))(states, V3)
    assert f"{dec.__file__}:" in str(info.value)
    ref = plain.Net()
    out, new = _fcall(f, method)(states, V3)  # f still works afterwards
    assert_same(getattr(ref, method)(V3), out)
    assert_same(ref.mean, new["mean"])


EAGER_UNDER_TRANSFORMS: dict[str, Callable[[Any], Any]] = {
    "grad": lambda m: jax.grad(m)(V3),
    "jvp": lambda m: jax.jvp(m, (V3,), (V3,)),
    "linearize": lambda m: jax.linearize(m, V3)[0],
    "jacfwd": lambda m: jax.jacfwd(m)(V3),
    "hessian": lambda m: jax.hessian(m)(V3),
    "vjp": lambda m: jax.vjp(m, V3)[0],
    "eval_shape": lambda m: jax.eval_shape(m, V3),
    "make_jaxpr": lambda m: jax.make_jaxpr(m)(V3),
}


@pytest.mark.parametrize("transform", list(EAGER_UNDER_TRANSFORMS))
def test_eager_model_under_a_transformation_refuses_a_traced_write(
    write_module: Loader, transform: str
) -> None:
    """Plain Python leaks a tracer into ``last``; the decorated model refuses the traced
    write and keeps what it had (``calls`` holds the untraced write made before it, as in
    plain Python, or its old value under a tracing-only transformation)."""
    _, dec = pair(write_module, OUTSIDE)
    model = dec.Last()
    with pytest.raises(TracedEagerStateError, match="State '(last|calls)'"):
        EAGER_UNDER_TRANSFORMS[transform](model)
    assert_same(np.zeros(3, np.float32), model.last)
    assert int(model.calls) in (0, 1)
    no_tracer(model)


def test_batchnorm_over_a_named_vmap_axis(write_module: Loader) -> None:
    _, dec = pair(write_module, OUTSIDE)
    xs = jnp.arange(12.0).reshape(4, 3)
    m = np.asarray(xs).mean(0)
    v = ((np.asarray(xs) - m) ** 2).mean(0)
    f, states = dec.BN(3, "batch").functionalize()
    run = jax.vmap(lambda s, x: f(s, x), in_axes=(None, 0), out_axes=(0, None),
                   axis_name="batch")
    for step in (run, jax.jit(run)):
        out, new = step(states, xs)
        assert_same((np.asarray(xs) - m) * 2, out)
        assert_same({"mean": 0.1 * m, "var": 0.9 + 0.1 * v}, new)

    def loss(f: Any, s: Any, x: Any) -> Any:
        out, s = jax.vmap(lambda s, x: f(s, x), in_axes=(None, 0), out_axes=(0, None),
                          axis_name="batch")(s, x)
        return (out ** 2).sum(), s

    grads, new = jax.grad(loss, has_aux=True)(f, states, xs)
    assert_same(2 * 2 * ((np.asarray(xs) - m) ** 2).sum(0), grads.model.scale)
    assert_same(0.1 * m, new["mean"])


def test_vmap_in_axes_dict_batches_one_state(write_module: Loader) -> None:
    _, dec = pair(write_module, OUTSIDE)
    xs = jnp.arange(12.0).reshape(4, 3)
    f, states = dec.BN(3).functionalize()
    batched = {"mean": states["mean"], "var": jnp.ones((4, 3)) * jnp.arange(4.0)[:, None]}
    out, new = jax.jit(jax.vmap(lambda s, x: f(s, x), in_axes=({"mean": None, "var": 0}, 0),
                                out_axes=(0, {"mean": 0, "var": 0})))(batched, xs)
    assert_same(np.zeros((4, 3)), out)
    assert_same(0.1 * np.asarray(xs), new["mean"])
    assert_same(0.9 * np.asarray(batched["var"]), new["var"])


def test_eager_model_under_vmap_with_an_unbatched_named_axis_write(write_module: Loader) -> None:
    """The pmean'd statistics are unbatched, so plain Python keeps concrete values; so
    does the decorated eager model."""
    plain, dec = pair(write_module, OUTSIDE)
    xs = jnp.arange(12.0).reshape(4, 3)
    ref, model = plain.BN(3, "batch"), dec.BN(3, "batch")
    assert_same(jax.vmap(ref, axis_name="batch")(xs), jax.vmap(model, axis_name="batch")(xs))
    assert_same(snapshot(ref), snapshot(model))
    no_tracer(model)


# ======================================================================================
# 4. Realistic models end to end
# ======================================================================================

MODELS = """
@DECORATE
class SpectralLinear:
    def __init__(self, n, m, key):
        self.w = jax.random.normal(key, (n, m)) * 0.5
        self.u = jnp.ones(n) / jnp.sqrt(n)
        self.sigma = jnp.ones(())

    def __call__(self, x):
        w = jax.lax.stop_gradient(self.w)
        v = w.T @ self.u
        v = v / (jnp.linalg.norm(v) + 1e-12)
        u = w @ v
        self.u = u / (jnp.linalg.norm(u) + 1e-12)
        self.sigma = self.u @ self.w @ v
        return x @ (self.w / self.sigma)


@DECORATE
class Body:
    def __init__(self, key):
        self.w = jax.random.normal(key, (3, 3)) * 0.3
        self.seen = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.seen += 1
        return jnp.tanh(x @ self.w)


@DECORATE
class TeacherStudent:
    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.shared = Body(k1)
        self.student = [self.shared, Body(k2)]
        self.teacher_head = copy.deepcopy(self.student[1])
        self.decay = 0.5

    def __call__(self, x):
        h = x
        for layer in self.student:
            h = layer(h)
        t = self.teacher_head(self.shared(x))
        self.teacher_head.seen = self.teacher_head.seen * 0
        return jnp.sum((h - t) ** 2)


@DECORATE
class EMATeacher:
    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.shared = Body(k1)
        self.student = [self.shared, Body(k2)]
        self.teacher_w = self.student[1].w * 1.0
        self.decay = 0.5

    def __call__(self, x):
        h = x
        for layer in self.student:
            h = layer(h)
        t = jnp.tanh(self.shared(x) @ self.teacher_w)
        self.teacher_w = self.decay * self.teacher_w + (1 - self.decay) * self.student[1].w
        return jnp.sum((h - t) ** 2)


@DECORATE
class Opt:
    def __init__(self, params, lr):
        self.lr = lr
        self.m = jax.tree_util.tree_map(jnp.zeros_like, params)
        self.t = jnp.zeros((), jnp.int32)

    def update(self, grads, params):
        self.t += 1
        self.m = jax.tree_util.tree_map(lambda m, g: 0.9 * m + g, self.m, grads)
        return jax.tree_util.tree_map(lambda p, m: p - self.lr * m, params, self.m)


@DECORATE
class GAN:
    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        g = {"w": jax.random.normal(k1, (2, 3)) * 0.3}
        d = {"w": jax.random.normal(k2, (3,)) * 0.3}
        self.g_opt = Opt(g, 0.1)
        self.d_opt = Opt(d, 0.05)
        self.g_params = g
        self.d_params = d

    def step(self, z, real):
        def d_loss(dp):
            fake = jnp.tanh(z @ self.g_params["w"])
            return (jnp.mean(jax.nn.softplus(-(real @ dp["w"])))
                    + jnp.mean(jax.nn.softplus(fake @ dp["w"])))
        def g_loss(gp):
            fake = jnp.tanh(z @ gp["w"])
            return jnp.mean(jax.nn.softplus(-(fake @ self.d_params["w"])))
        ld, gd = jax.value_and_grad(d_loss)(self.d_params)
        self.d_params = self.d_opt.update(gd, self.d_params)
        lg, gg = jax.value_and_grad(g_loss)(self.g_params)
        self.g_params = self.g_opt.update(gg, self.g_params)
        return ld, lg


@DECORATE
class Accum:
    def __init__(self, every):
        self.every = every
        self.w = jnp.array([0.5, -0.5])
        self.buf = jnp.zeros(2)
        self.count = jnp.zeros((), jnp.int32)
        self.applied = jnp.zeros(2)

    def __call__(self, x):
        g = jax.grad(lambda w: jnp.sum((x * w) ** 2))(self.w + self.applied)
        self.buf = self.buf + g
        self.count += 1
        full = self.count % self.every == 0
        self.applied = jnp.where(full, self.applied - 0.1 * self.buf / self.every, self.applied)
        self.buf = jnp.where(full, jnp.zeros_like(self.buf), self.buf)
        return self.applied


@DECORATE
class Sched:
    def __init__(self, base, warmup):
        self.base = base
        self.warmup = warmup
        self.step = jnp.zeros((), jnp.int32)

    def __call__(self):
        self.step += 1
        return self.base * jnp.minimum(1.0, self.step / self.warmup)


@DECORATE
class WithSched:
    def __init__(self):
        self.sched = Sched(0.1, 3)
        self.wv = jnp.ones(2)

    def __call__(self, x):
        lr = self.sched()
        self.wv = self.wv - lr * 2 * x * self.wv
        return lr, self.wv


@DECORATE
class Attn:
    def __init__(self, d, length, key):
        k1, k2 = jax.random.split(key)
        self.wq = jax.random.normal(k1, (d, d)) * 0.3
        self.wkv = jax.random.normal(k2, (d, 2 * d)) * 0.3
        self.k = jnp.zeros((length, d))
        self.v = jnp.zeros((length, d))
        self.pos = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        q = x @ self.wq
        kv = x @ self.wkv
        d = x.shape[-1]
        self.k = self.k.at[self.pos].set(kv[:d])
        self.v = jax.lax.dynamic_update_slice(self.v, kv[d:][None], (self.pos, 0))
        mask = jnp.arange(self.k.shape[0]) <= self.pos
        p = jax.nn.softmax(jnp.where(mask, self.k @ q, -1e9))
        self.pos += 1
        return x + p @ self.v

    def decode(self, x, n):
        return lax.fori_loop(0, n, lambda i, h: self(h), x)

    def decode_scan(self, xs):
        return lax.scan(lambda c, x: (c, self(x)), 0.0, xs)[1]
"""

KEY = "jax.random.PRNGKey(0)"
Z = jnp.ones((4, 2)) * 0.5
REAL = jnp.ones((4, 3))
SEQ = jnp.stack([V3, -V3, V3 * 2])

MODEL_CASES = [
    ("spectral-norm", f"SpectralLinear(3, 2, {KEY})", [("__call__", (V3,))] * 3),
    ("teacher-student-shared", f"TeacherStudent({KEY})", [("__call__", (V3,))] * 3),
    ("ema-teacher", f"EMATeacher({KEY})", [("__call__", (V3,))] * 3),
    ("gan-two-optimizers", f"GAN({KEY})", [("step", (Z, REAL))] * 3),
    ("grad-accumulation", "Accum(2)", [("__call__", (jnp.array([1.0, 2.0]),))] * 5),
    ("lr-scheduler", "WithSched()", [("__call__", (jnp.array([1.0, 2.0]),))] * 4),
    ("attention-kv-cache", f"Attn(3, 4, {KEY})", [("__call__", (V3,))] * 3),
    ("attention-decode-fori", f"Attn(3, 6, {KEY})", [("decode", (V3, 2)), ("decode", (V3, 3))]),
    ("attention-decode-scan", f"Attn(3, 6, {KEY})", [("decode_scan", (SEQ,))]),
]


@pytest.mark.parametrize(
    "build,calls", [c[1:] for c in MODEL_CASES], ids=[c[0] for c in MODEL_CASES]
)
def test_realistic_models(write_module: Loader, build: str, calls: list[Any]) -> None:
    plain, dec = pair(write_module, MODELS)
    check(plain, dec, build, calls)


MODEL_TRANSFORMS = [
    ("spectral-norm", f"SpectralLinear(3, 2, {KEY})", "__call__", V3),
    ("ema-teacher", f"EMATeacher({KEY})", "__call__", V3),
    ("grad-accumulation", "Accum(2)", "__call__", jnp.array([1.0, 2.0])),
    ("attention-kv-cache", f"Attn(3, 4, {KEY})", "__call__", V3),
    ("attention-decode-scan", f"Attn(3, 6, {KEY})", "decode_scan", SEQ),
]


@pytest.mark.parametrize("transform", ["grad", "vmap"])
@pytest.mark.parametrize(
    "build,method,x", [c[1:] for c in MODEL_TRANSFORMS], ids=[c[0] for c in MODEL_TRANSFORMS]
)
def test_realistic_models_under_grad_and_vmap(
    write_module: Loader, build: str, method: str, x: Any, transform: str
) -> None:
    plain, dec = pair(write_module, MODELS)
    xv = x if transform == "grad" else jnp.stack([x, -x])
    check_transform(plain, dec, build, [(method, (X,)), (method, (X,))], xv, transform)


def test_teacher_student_shared_body_has_one_state(write_module: Loader) -> None:
    _, dec = pair(write_module, MODELS)
    f, states = dec.TeacherStudent(jax.random.PRNGKey(0)).functionalize()
    assert sorted(states) == ["shared.seen", "student[1].seen", "teacher_head.seen"]
    _, states = jax.jit(lambda f, s, x: f(s, x))(f, states, V3)
    assert int(states["shared.seen"]) == 2  # called through two paths
    assert int(states["student[1].seen"]) == 1
    assert int(states["teacher_head.seen"]) == 0


def test_gan_training_loop_in_lax_scan_over_f(write_module: Loader) -> None:
    plain, dec = pair(write_module, MODELS)
    ref = plain.GAN(jax.random.PRNGKey(0))
    expected = [ref.step(Z, REAL) for _ in range(3)]
    f, states = dec.GAN(jax.random.PRNGKey(0)).functionalize()

    def body(s: Any, _: Any) -> Any:
        out, s = f.step(s, Z, REAL)
        return s, out

    states, (d_losses, g_losses) = jax.jit(lambda s: jax.lax.scan(body, s, None, length=3))(
        states)
    assert_same([e[0] for e in expected], list(d_losses), "d losses")
    assert_same([e[1] for e in expected], list(g_losses), "g losses")
    frozen = autostate.freeze(f, states)
    assert_same(snapshot(ref), snapshot(frozen))


def test_gan_optimizer_states_are_separate(write_module: Loader) -> None:
    _, dec = pair(write_module, MODELS)
    model = dec.GAN(jax.random.PRNGKey(0))
    _, states = model.functionalize()
    assert sorted(states) == ["d_opt.m", "d_opt.t", "d_params", "g_opt.m", "g_opt.t", "g_params"]
    model.step(Z, REAL)
    assert int(model.g_opt.t) == 1 and int(model.d_opt.t) == 1


@pytest.mark.parametrize("offset", [0, 1, 3, 7])
def test_a_class_compiled_from_other_text_under_a_file_name(
    tmp_path: Any, offset: int
) -> None:
    """Code compiled under the name of a file that holds other text (the file
    was rewritten after the import, or ``compile(src, existing_path, ...)``):
    a DecorationError naming the file and line, never an internal traceback,
    whatever the file holds at the function's line."""
    path = tmp_path / "other.py"
    path.write_text("\n" * offset + "x = 1\n\n\nclass Other:\n    pass\n\n\ny = [\n    1,\n]\n")
    source = (
        "import jax.numpy as jnp\n\n\nclass Model:\n    def __init__(self):\n"
        "        self.n = jnp.zeros(())\n\n    def step(self):\n        self.n += 1\n"
    )
    namespace: dict[str, Any] = {}
    exec(compile(source, str(path), "exec"), namespace)  # noqa: S102
    with pytest.raises(autostate.errors.DecorationError, match="other.py") as info:
        autostate.tree.class_info(autostate.stateful(namespace["Model"]))
    assert "fix:" in str(info.value)
