"""Differential bug hunt: each case runs the same class plain and decorated.

Every source below is written twice with ``write_module``: once as plain
Python (``@DECORATE`` removed) and once with ``@autostate.stateful``. The
plain run is the reference; the decorated one must mean the same eagerly,
through ``f(states, ...)``, under ``jax.jit`` (and, where it applies,
``jax.grad`` / ``jax.vmap``), and after ``autostate.freeze``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from differential import (  # noqa: I001 - tests/ is on sys.path
    Call,
    Loader,
    X,
    _fcall,
    _method,
    assert_same,
    assert_user_line,
    check,
    check_transform,
    pair,
    raises_autostate,
    snapshot,
)

import autostate

# ======================================================================================
# Realistic models
# ======================================================================================

BATCHNORM = """
@DECORATE
class BatchNorm:
    def __init__(self, n, momentum=0.9):
        self.scale = jnp.ones(n)
        self.bias = jnp.zeros(n)
        self.mean = jnp.zeros(n)
        self.var = jnp.ones(n)
        self.momentum = momentum
        self.training = True

    def train(self):
        self.training = True
        return self

    def eval(self):
        self.training = False
        return self

    def __call__(self, x):
        if self.training:
            mu = x.mean(0)
            var = x.var(0)
            self.mean = self.momentum * self.mean + (1 - self.momentum) * mu
            self.var = self.momentum * self.var + (1 - self.momentum) * var
        else:
            mu, var = self.mean, self.var
        return (x - mu) / jnp.sqrt(var + 1e-5) * self.scale + self.bias
"""

XB = jnp.arange(12.0).reshape(4, 3)


def test_batchnorm_training(write_module: Loader) -> None:
    plain, dec = pair(write_module, BATCHNORM)
    check(plain, dec, "BatchNorm(3)", [("__call__", (XB,)), ("__call__", (XB * 2,))])


def test_batchnorm_eval_mode_set_eagerly(write_module: Loader) -> None:
    plain, dec = pair(write_module, BATCHNORM)
    check(plain, dec, "BatchNorm(3)", [("__call__", (XB,))], modes=("eager",))
    check(plain, dec, "BatchNorm(3).eval()", [("__call__", (XB,))])


def test_batchnorm_eval_inside_f_is_a_static_state_error(write_module: Loader) -> None:
    _, dec = pair(write_module, BATCHNORM)
    f, states = dec.BatchNorm(3).functionalize()
    with raises_autostate(autostate.errors.StaticStateError):
        f.eval(states)


def test_batchnorm_grad_and_vmap(write_module: Loader) -> None:
    plain, dec = pair(write_module, BATCHNORM)
    check_transform(plain, dec, "BatchNorm(3)", [("__call__", (X,))], XB, "grad")
    check_transform(plain, dec, "BatchNorm(3)", [("__call__", (X,))], jnp.stack([XB, XB + 1]),
                    "vmap")


KVCACHE = """
@DECORATE
class KVCache:
    def __init__(self, n, d):
        self.k = np.zeros((n, d), np.float32)
        self.v = np.zeros((n, d), np.float32)
        self.pos = np.zeros((), np.int32)

    def __call__(self, k, v):
        i = self.pos.copy()
        self.k[i] = k
        self.v[i, :] = v * 2
        self.pos += 1
        return self.k.sum() + self.v[i].sum()


@DECORATE
class AtCache:
    def __init__(self, n, d):
        self.cache = jnp.zeros((n, d))
        self.pos = jnp.zeros((), jnp.int32)

    def write(self, x):
        self.cache = self.cache.at[self.pos].set(x)
        self.pos = self.pos + 1
        return self.cache[: self.pos.shape[0] if self.pos.ndim else 2].sum()

    def read(self):
        return self.cache * (jnp.arange(self.cache.shape[0]) < self.pos)[:, None]
"""


def test_kv_cache_item_writes(write_module: Loader) -> None:
    plain, dec = pair(write_module, KVCACHE)
    row = jnp.arange(3.0)
    # plain numpy arrays vs autostate's jax arrays: only eager-comparable for plain
    check(plain, dec, "KVCache(4, 3)", [("__call__", (np.asarray(row), np.asarray(row) + 1))] * 3)


def test_kv_cache_at_set(write_module: Loader) -> None:
    plain, dec = pair(write_module, KVCACHE)
    row = jnp.arange(3.0)
    check(plain, dec, "AtCache(4, 3)", [("write", (row,)), ("write", (row + 1,)), ("read", ())])
    check_transform(plain, dec, "AtCache(4, 3)", [("write", (X,)), ("read", ())],
                    jnp.stack([row, row * 3]), "vmap")


RNG = """
@DECORATE
class Dropout:
    def __init__(self, seed, rate=0.5):
        self.key = jax.random.PRNGKey(seed)
        self.typed = jax.random.key(seed + 1)
        self.rate = rate

    def __call__(self, x):
        self.key, sub = jax.random.split(self.key)
        self.typed, sub2 = jax.random.split(self.typed)
        keep = jax.random.bernoulli(sub, 1 - self.rate, x.shape)
        noise = jax.random.normal(sub2, x.shape)
        return jnp.where(keep, x / (1 - self.rate), 0.0) + noise
"""


def test_rng_key_splitting(write_module: Loader) -> None:
    plain, dec = pair(write_module, RNG)
    x = jnp.ones(5)
    check(plain, dec, "Dropout(0)", [("__call__", (x,))] * 3)


EMA = """
@DECORATE
class EMA:
    def __init__(self, decay=0.5):
        self.w = jnp.array([1.0, 2.0])
        self.ema = jnp.array([1.0, 2.0])
        self.decay = decay
        self.steps = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        y = jnp.dot(self.w, x)
        self.ema = self.decay * self.ema + (1 - self.decay) * self.w * x
        self.steps += 1
        return y + jnp.dot(self.ema, x)
"""


def test_ema_and_counter(write_module: Loader) -> None:
    plain, dec = pair(write_module, EMA)
    x = jnp.array([0.5, -1.0])
    check(plain, dec, "EMA()", [("__call__", (x,)), ("__call__", (x * 2,))])
    check_transform(plain, dec, "EMA()", [("__call__", (X,)), ("__call__", (X,))], x, "grad")


def test_ema_grad_wrt_parameters(write_module: Loader) -> None:
    plain, dec = pair(write_module, EMA)
    x = jnp.array([0.5, -1.0])

    def plain_loss(w: jax.Array) -> jax.Array:
        m = plain.EMA()
        m.w = w
        return m(x) + m(x)

    f, states = dec.EMA().functionalize()

    def dec_loss(f: Any) -> jax.Array:
        out1, s = f(states, x)
        out2, _ = f(s, x)
        return out1 + out2

    g = jax.grad(dec_loss)(f)
    assert_same(jax.grad(plain_loss)(jnp.array([1.0, 2.0])), g.model.w, "grad w")


OPTIM = """
import optax


@DECORATE
class Trainer:
    def __init__(self):
        self.w = jnp.array([0.0, 0.0])
        self.opt = optax.adam(0.1)
        self.opt_state = self.opt.init(self.w)
        self.step = jnp.zeros((), jnp.int32)

    def loss(self, w, x, y):
        return jnp.mean((x @ w - y) ** 2)

    def train_step(self, x, y):
        loss, g = jax.value_and_grad(self.loss)(self.w, x, y)
        updates, self.opt_state = self.opt.update(g, self.opt_state, self.w)
        self.w = optax.apply_updates(self.w, updates)
        self.step += 1
        return loss
"""


def test_optimizer_stored_in_model(write_module: Loader) -> None:
    plain, dec = pair(write_module, OPTIM)
    x = jnp.array([[1.0, 2.0], [3.0, 4.0], [0.5, -1.0]])
    y = jnp.array([1.0, 2.0, 3.0])
    check(plain, dec, "Trainer()", [("train_step", (x, y))] * 3)


SUBMODELS = """
@DECORATE
class Block:
    def __init__(self, i):
        self.w = jnp.full((2,), float(i + 1))
        self.calls = jnp.zeros((), jnp.int32)
        self.last = jnp.zeros(2)

    def __call__(self, x):
        self.calls += 1
        self.last = x
        return x * self.w


@DECORATE
class Net:
    def __init__(self):
        self.blocks = [Block(i) for i in range(3)]
        self.heads = {"a": Block(10), "b": Block(20)}
        self.pair = (Block(5), Block(6))
        self.total = jnp.zeros(2)

    def __call__(self, x):
        for b in self.blocks:
            x = b(x)
        out = {k: h(x) for k, h in self.heads.items()}
        x = self.pair[0](x) + self.pair[1](x)
        self.total += x
        return out, x
"""


def test_submodel_lists_dicts_tuples(write_module: Loader) -> None:
    plain, dec = pair(write_module, SUBMODELS)
    x = jnp.array([1.0, -1.0])
    check(plain, dec, "Net()", [("__call__", (x,)), ("__call__", (x,))])
    check_transform(plain, dec, "Net()", [("__call__", (X,))], x, "grad")
    check_transform(plain, dec, "Net()", [("__call__", (X,))], jnp.stack([x, 2 * x]), "vmap")


# ======================================================================================
# lax control flow reaching state
# ======================================================================================

CONTROL = """
@DECORATE
class Loops:
    def __init__(self):
        self.acc = jnp.zeros(())
        self.n = jnp.zeros((), jnp.int32)
        self.buf = jnp.zeros(4)

    def _update(self, x):
        self.acc = self.acc + x
        self.n += 1

    def scan_helper(self, xs):
        def body(c, x):
            self._update(x)
            return c + self.acc, self.n
        return lax.scan(body, jnp.zeros(()), xs)

    def step(self, c, x):
        self.acc = self.acc * 0.5 + x
        self.buf = self.buf.at[self.n % 4].set(x)
        self.n = self.n + 1
        return c + self.acc, self.acc

    def scan_bound(self, xs):
        return lax.scan(self.step, jnp.zeros(()), xs)

    def fori_closure(self, k):
        def body(i, c):
            self.acc = self.acc + i * k
            self.buf = self.buf.at[i % 4].add(k)
            return c * 2.0
        return lax.fori_loop(0, 5, body, jnp.ones(()))

    def _pos(self, x):
        self.acc = self.acc + x
        return x

    def _neg(self, x):
        self.n = self.n - 1
        return -x

    def cond_bound(self, p, x):
        return lax.cond(p, self._pos, self._neg, x)

    def switch_lambdas(self, i, x):
        return lax.switch(i, [lambda v: self._pos(v), lambda v: self._neg(v),
                                  lambda v: v * self.acc], x)

    def while_counter(self, limit):
        def cond(c):
            return self.n < limit
        def body(c):
            self.n += 1
            self.acc = self.acc + c
            return c + 1.0
        return lax.while_loop(cond, body, jnp.zeros(()))

    def nested_scan(self, xs):
        def inner(c, x):
            self.acc = self.acc + x
            return c, None
        def outer(c, row):
            lax.scan(inner, None, row)
            self.n += 1
            return c + self.acc, None
        return lax.scan(outer, jnp.zeros(()), xs)[0]

    def map_reads(self, xs):
        return lax.map(lambda x: x * self.acc + self.n, xs)

    @AUTOCHECKPOINT
    def remat_method(self, x):
        self.acc = self.acc + jnp.sin(x)
        return self.acc * x

    def remat_inner(self, x):
        @checkpoint
        def inner(y):
            self.acc = self.acc + jnp.cos(y)
            return self.acc * y
        return inner(x) + inner(2 * x)
"""

XS = jnp.arange(1.0, 5.0)


@pytest.mark.parametrize(
    "calls",
    [
        [("scan_helper", (XS,))],
        [("scan_bound", (XS,)), ("scan_bound", (XS * 2,))],
        [("fori_closure", (jnp.float32(1.5),))],
        [("cond_bound", (jnp.bool_(True), 2.0)), ("cond_bound", (jnp.bool_(False), 2.0))],
        [("switch_lambdas", (0, 2.0)), ("switch_lambdas", (1, 3.0)), ("switch_lambdas", (2, 4.0))],
        [("while_counter", (jnp.int32(4),))],
        [("nested_scan", (XS.reshape(2, 2),))],
        [("cond_bound", (jnp.bool_(True), 2.0)), ("map_reads", (XS,))],
        [("remat_method", (1.0,)), ("remat_method", (2.0,))],
        [("remat_inner", (1.0,))],
    ],
    ids=["scan_helper", "scan_bound", "fori", "cond", "switch", "while", "nested", "map", "remat", "remat_inner"],
)
def test_lax_control_flow_writes_state(write_module: Loader, calls: list[Call]) -> None:
    plain, dec = pair(write_module, CONTROL)
    check(plain, dec, "Loops()", calls, modes=("eager", "f", "jit"))


def test_grad_through_scan_and_remat(write_module: Loader) -> None:
    plain, dec = pair(write_module, CONTROL)
    # plain python inside a trace: a fresh model, so jax's own scan threads nothing but
    # the body runs once per trace; compare against the plain loop by hand instead.
    f, states = dec.Loops().functionalize()

    def loss(x: jax.Array) -> jax.Array:
        out, s = f.remat_method(states, x)
        out2, s = f.remat_method(s, x)
        return out + out2 + s["acc"]

    def ref(x: jax.Array) -> jax.Array:
        m = plain.Loops()
        a = m.remat_method(x)
        b = m.remat_method(x)
        return a + b + m.acc

    assert_same(jax.grad(ref)(1.3), jax.grad(loss)(1.3), "grad remat")
    assert_same(jax.grad(ref)(1.3), jax.jit(jax.grad(loss))(1.3), "jit grad remat")


JAX_CHECKPOINT_ON_METHOD = """
@DECORATE
class Remat:
    def __init__(self):
        self.acc = jnp.zeros(())

    @jax.checkpoint
    def __call__(self, x):
        self.acc = self.acc + x
        return self.acc
"""


def test_jax_checkpoint_on_a_method_is_a_clear_decoration_error(write_module: Loader) -> None:
    with raises_autostate(autostate.errors.DecorationError) as err:
        pair(write_module, JAX_CHECKPOINT_ON_METHOD)
    assert_user_line(err.value, ".py")


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


# ======================================================================================
# How code reaches state: Python constructs
# ======================================================================================

CONSTRUCTS = """
@DECORATE
class C:
    def __init__(self):
        self.x = jnp.zeros(3)
        self.a = jnp.zeros(())
        self.b = jnp.ones(())
        self.t = (jnp.zeros(()),)
        self.lst = [jnp.zeros(())]
        self.d = {"k": jnp.zeros(2)}
        self.i = jnp.zeros((), jnp.int32)
        self.rest = [jnp.zeros(())]

    def read_after_write(self, v):
        self.a = self.a + v
        y = self.a * 2
        self.a = y + self.a
        return y, self.a

    def aug_containers(self, v):
        self.t += (v,)
        self.lst += [v * 2]
        self.d |= {"j": v * jnp.ones(2)}
        return sum(self.t), sum(self.lst), self.d["j"]


    def setattr_dynamic(self, v):
        for name in ("a", "b"):
            setattr(self, name, getattr(self, name) + v)
        return self.a + self.b

    def for_target(self):
        total = jnp.zeros(())
        for self.a in jnp.arange(3.0):
            total = total + self.a
        return total

    def for_int_target(self):
        for self.i in jnp.arange(4, dtype=jnp.int32):
            pass
        return self.i

    def chained(self, v):
        self.a = self.b = v * 3
        self.a, self.b = self.b, self.a + 1
        return self.a - self.b

    def star(self, v):
        self.a, *self.rest = [v, v + 1, v + 2]
        return self.rest

    def annotated(self, v):
        self.a: jax.Array = v + 1
        return self.a

    def with_target(self, v):
        import contextlib
        with contextlib.nullcontext(v * 5) as self.b:
            inner = self.b
        return inner

    def comprehension(self, v):
        self.a = sum(self.x[i] * v for i in range(3))
        self.lst = [self.a + j for j in range(2)]
        return [self.b * k for k in range(2)]

    def lambdas(self, v):
        def bump():
            self.a += v
        bump()
        bump()
        get = lambda: self.a  # noqa: E731
        return get()

    def delete_item(self):
        self.d["tmp"] = jnp.ones(2)
        del self.d["tmp"]
        return self.d

    def fstring_len(self, v):
        self.a = self.a + v
        return jnp.float32(len(f"{self.a=}") > 0) + self.a

    def walrus(self, v):
        self.a = (y := self.a + v) * 2
        return y

    def pow_and_matmul(self, v):
        self.x **= 2
        self.x += v
        self.b //= 2.0
        self.b -= 1
        self.b *= -3
        self.b /= 2
        self.b %= 5.0
        return self.x
"""


@pytest.mark.parametrize(
    "calls",
    [
        [("read_after_write", (2.0,)), ("read_after_write", (1.0,))],
        [("setattr_dynamic", (2.0,))],
        [("for_target", ())],
        [("for_int_target", ())],
        [("chained", (2.0,))],
        [("star", (1.0,))],
        [("annotated", (4.0,))],
        [("with_target", (2.0,))],
        [("comprehension", (2.0,))],
        [("lambdas", (2.0,)), ("lambdas", (3.0,))],
        [("walrus", (2.0,))],
        [("pow_and_matmul", (1.0,))],
    ],
    ids=lambda c: c[0][0],
)
def test_constructs(write_module: Loader, calls: list[Call]) -> None:
    plain, dec = pair(write_module, CONSTRUCTS)
    check(plain, dec, "C()", calls)


def test_augmented_containers_change_structure(write_module: Loader) -> None:
    plain, dec = pair(write_module, CONSTRUCTS)
    check(plain, dec, "C()", [("aug_containers", (1.0,))], modes=("eager", "f"))
    # the states' structure changes, so jit returns the new structure (a retrace next time)
    check(plain, dec, "C()", [("aug_containers", (1.0,)), ("aug_containers", (2.0,))],
          modes=("eager", "f", "jit"))


def test_delete_item_and_fstring(write_module: Loader) -> None:
    plain, dec = pair(write_module, CONSTRUCTS)
    check(plain, dec, "C()", [("delete_item", ())], modes=("eager", "f", "jit"))
    check(plain, dec, "C()", [("fstring_len", (1.0,))], modes=("eager", "f"))


NPITEMS = """
@DECORATE
class Items:
    def __init__(self):
        self.x = np.zeros(3, np.float32)
        self.d = {"k": np.zeros(2, np.float32)}
        self.lst = [np.zeros(2, np.float32), np.ones(2, np.float32)]
        self.tup = (np.zeros(2, np.float32),)

    def nested_item(self, v):
        self.d["k"][0] = v
        self.d["k"] += 1.0
        self.x[1:] = v
        self.x[0] += self.x[1]
        self.lst[1][0] = v * 3
        return self.d["k"].sum() + self.x.sum()

    def list_index_items(self, v):
        self.lst[0] = self.lst[0] + v
        self.lst[-1] *= 2
        self.d["new"] = np.ones(2, np.float32) * v
        return self.lst[0].sum()
"""


@pytest.mark.parametrize("method", ["nested_item", "list_index_items"])
def test_item_writes_on_numpy_states(write_module: Loader, method: str) -> None:
    plain, dec = pair(write_module, NPITEMS)
    calls = [(method, (np.float32(3.0),)), (method, (np.float32(1.0),))]
    modes = ("eager", "f", "jit", "freeze") if method == "nested_item" else ("eager", "f")
    check(plain, dec, "Items()", calls, modes=modes)


# ======================================================================================
# How code reaches state: methods from elsewhere
# ======================================================================================

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


INHERIT = """
class Undecorated:
    def bump(self, x):
        self.count = self.count + 1
        self.total = self.total + x
        return self.total


@DECORATE
class Base(Undecorated):
    def __init__(self):
        self.count = jnp.zeros((), jnp.int32)
        self.total = jnp.zeros(())
        self.log = jnp.zeros(3)

    def step(self, x):
        self.log = self.log.at[self.count % 3].set(x)
        return self.bump(x)


@DECORATE
class Child(Base):
    def __init__(self):
        super().__init__()
        self.extra = jnp.ones(())

    def step(self, x):
        y = super().step(x * 2)
        self.extra = self.extra * 2 + y
        return self.extra


class GrandChild(Child):
    def step(self, x):
        self.total = self.total - 100.0
        return super().step(x) + self.total


class Mixin:
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.mixed = jnp.zeros(())

    def step(self, x):
        self.mixed = self.mixed + x
        return super().step(x) + self.mixed


@DECORATE
class Diamond(Mixin, Child):
    pass
"""


@pytest.mark.parametrize("cls", ["Base", "Child", "GrandChild", "Diamond"])
def test_inheritance_super_chains_and_undecorated_bases(write_module: Loader, cls: str) -> None:
    plain, dec = pair(write_module, INHERIT)
    check(plain, dec, f"{cls}()", [("step", (1.0,)), ("step", (2.0,)), ("bump", (3.0,))])


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


# ======================================================================================
# Adversarial reaches: setattr, __dict__, hooks, class defaults
# ======================================================================================

DYNAMIC_ONLY = """
@DECORATE
class Dyn:
    def __init__(self):
        self.a = jnp.zeros(())
        self.count = jnp.zeros(())

    def bump(self, name, v):
        setattr(self, name, getattr(self, name) + v)
        self.count += 1
        return getattr(self, name)
"""


def test_setattr_dynamic_name_on_a_non_state_is_plain_eagerly_refused_in_f(
    write_module: Loader,
) -> None:
    plain, dec = pair(write_module, DYNAMIC_ONLY)
    check(plain, dec, "Dyn()", [("bump", ("a", 2.0)), ("bump", ("count", 1.0))], modes=("eager",))
    f, states = dec.Dyn().functionalize()
    out, states = f.bump(states, "count", 1.0)  # count is state: fine
    assert float(states["count"]) == 2.0
    with raises_autostate(autostate.errors.StateAccessError):
        f.bump(states, "a", 1.0)


CLASS_DEFAULT = """
@DECORATE
class Mode:
    training = True
    scale = 2.0

    def __init__(self):
        self.w = jnp.ones(())

    def eval(self):
        self.training = False
        return self

    def __call__(self, x):
        return x * self.w * (self.scale if self.training else 1.0)
"""


def test_class_level_default_for_a_state(write_module: Loader) -> None:
    plain, dec = pair(write_module, CLASS_DEFAULT)
    assert plain.Mode.training is True
    assert dec.Mode.training is True, "the class attribute itself must survive decoration"
    check(plain, dec, "Mode()", [("__call__", (3.0,))])
    check(plain, dec, "Mode().eval()", [("__call__", (3.0,))])



DICT_WRITE = """
@DECORATE
class DictWrite:
    def __init__(self):
        self.x = jnp.zeros(())

    def step(self, v):
        self.x = self.x + v
        return self.x

    def raw(self, v):
        RAW
        return self.x
"""


@pytest.mark.parametrize(
    "raw",
    [
        'self.__dict__["x"] = v',
        'vars(self)["x"] = v',
        "self.__dict__.update(x=v)",
        'object.__setattr__(self, "x", v)',
    ],
    ids=["dunder_dict_item", "vars_item", "dunder_dict_update", "object_setattr"],
)
def test_writing_a_state_behind_the_descriptor(write_module: Loader, raw: str) -> None:
    plain, dec = pair(write_module, DICT_WRITE.replace("RAW", raw))
    ref = plain.DictWrite()
    expected = [ref.step(1.0), ref.raw(jnp.float32(5.0)), ref.step(1.0)]
    model = dec.DictWrite()
    try:
        got = [model.step(1.0), model.raw(jnp.float32(5.0)), model.step(1.0)]
    except autostate.AutostateError as err:
        assert_user_line(err, ".py")  # a clear refusal naming the line is acceptable
        return
    assert_same(expected, got, "eager outputs")
    assert_same(snapshot(ref), snapshot(model), "eager attributes")
    for mode in ("f", "jit"):
        f, states = dec.DictWrite().functionalize()
        states0 = states
        call: Callable[..., Any] = (
            (lambda f, s, m, *a: _fcall(f, m)(s, *a)) if mode == "f"
            else jax.jit(lambda f, s, m, *a: _fcall(f, m)(s, *a), static_argnums=2)
        )
        try:
            outs = []
            for m, a in [("step", (1.0,)), ("raw", (jnp.float32(5.0),)), ("step", (1.0,))]:
                out, states = call(f, states, m, *a)
                outs.append(out)
        except autostate.AutostateError:
            # refused: f must be left as it was
            out, _ = f.step(states0, 1.0)
            assert float(out) == 1.0
            continue
        assert_same(expected, outs, f"{mode} outputs")
        assert_same(snapshot(ref.x), snapshot(states["x"]), f"{mode} state")


KWARGS_INIT = """
@DECORATE
class Config:
    def __init__(self, **kwargs):
        for k, v in kwargs.items():
            setattr(self, k, v)

    def step(self, v):
        self.mean = self.mean * 0.5 + v
        return self.mean
"""


def test_states_initialised_by_setattr_in_init(write_module: Loader) -> None:
    try:
        plain, dec = pair(write_module, KWARGS_INIT)
    except autostate.errors.DecorationError as err:
        # `mean` is first assigned outside __init__ as far as the source shows: documented.
        assert_user_line(err, ".py")
        return
    check(plain, dec, "Config(mean=jnp.zeros(()))", [("step", (1.0,)), ("step", (2.0,))])


DATACLASS = """
@DECORATE
@dataclasses.dataclass
class Running:
    mean: jax.Array = dataclasses.field(default_factory=lambda: jnp.zeros(2))
    count: jax.Array = dataclasses.field(default_factory=lambda: jnp.zeros((), jnp.int32))
    momentum: float = 0.5

    def update(self, x):
        self.mean = self.momentum * self.mean + (1 - self.momentum) * x
        self.count += 1
        return self.mean.sum()


@DECORATE
@dataclasses.dataclass
class WithPost(Running):
    extra: jax.Array = dataclasses.field(default_factory=lambda: jnp.ones(()))

    def __post_init__(self):
        self.extra = self.extra * 3

    def update(self, x):
        self.extra = self.extra + 1
        return super().update(x) + self.extra
"""


@pytest.mark.parametrize(
    "cls",
    [
        "Running",
        "WithPost",
    ],
)
def test_dataclass_generated_init(write_module: Loader, cls: str) -> None:
    source = DATACLASS if cls == "WithPost" else DATACLASS.split("@DECORATE\n@dataclasses.dataclass\nclass WithPost")[0]
    plain, dec = pair(write_module, source)
    x = jnp.array([1.0, 3.0])
    check(plain, dec, f"{cls}()", [("update", (x,)), ("update", (x,))])


HOOKS = """
@DECORATE
class Inner:
    def __init__(self):
        self.hits = jnp.zeros(())
        self.w = jnp.full((2,), 3.0)

    def __call__(self, x):
        self.hits = self.hits + 1
        return x * self.w


@DECORATE
class Delegate:
    def __init__(self):
        self.inner = Inner()
        self.seen = jnp.zeros(())

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, x):
        self.seen = self.seen + x.sum()
        return self.inner(x) + self.w + self.hits


@DECORATE
class Redirect:
    def __init__(self):
        self._store = jnp.zeros(())
        self.writes = jnp.zeros((), jnp.int32)

    def __setattr__(self, name, value):
        if name == "value":
            name = "_store"
            value = value * 10
        object.__setattr__(self, name, value)

    def __getattr__(self, name):
        if name == "value":
            return self._store / 10
        raise AttributeError(name)

    def step(self, x):
        self._store = self._store + x
        self.writes += 1
        return self._store
"""


def test_getattr_delegation_to_a_sub_model(write_module: Loader) -> None:
    plain, dec = pair(write_module, HOOKS)
    x = jnp.array([1.0, 2.0])
    check(plain, dec, "Delegate()", [("__call__", (x,)), ("__call__", (x,))])


def test_setattr_getattr_hooks(write_module: Loader) -> None:
    plain, dec = pair(write_module, HOOKS)
    check(plain, dec, "Redirect()", [("step", (1.0,)), ("step", (2.0,))])
    p, d = plain.Redirect(), dec.Redirect()
    p.value = 2.0
    d.value = 2.0
    assert_same(snapshot(p), snapshot(d))
    assert float(p.value) == float(d.value)


# ======================================================================================
# Closures, copies, generators, helpers outside the class, odd structures
# ======================================================================================

MISC = """
def helper(model, x):
    model.n = model.n + x
    return model.n * 2


@DECORATE
class Leaf:
    def __init__(self, k=1.0):
        self.n = jnp.zeros(())
        self.k = jnp.asarray(k)

    def step(self, c, x):
        self.n = self.n + x * self.k
        return c + self.n, self.n

    def __call__(self, x):
        self.n = self.n + x
        return self.n * self.k


@DECORATE
class Misc:
    def __init__(self):
        self.n = jnp.zeros(())
        self.leaf = Leaf(2.0)
        self.leaves = {"a": Leaf(3.0)}
        self.opt = None
        self.scale = 1.5

    def make_inc(self):
        def inc(v):
            self.n += v
            return self.n
        return inc

    def use_closure(self, v):
        inc = self.make_inc()
        inc(v)
        return inc(v)

    def helper_in_scan(self, xs):
        return lax.scan(lambda c, x: (c + helper(self, x) + helper(self.leaf, x), None),
                        jnp.zeros(()), xs)[0]

    def sub_bound_scan(self, xs):
        return lax.scan(self.leaf.step, jnp.zeros(()), xs)

    def fori_sub_models(self, k):
        def body(i, c):
            return c + self.leaf(k) + self.leaves["a"](c)
        return lax.fori_loop(0, 3, body, jnp.zeros(()))

    def copies(self, v):
        twin = copy.copy(self.leaf)
        twin(v)
        deep = copy.deepcopy(self.leaves)
        deep["a"](v)
        return twin.n + deep["a"].n, self.leaf.n

    def values_gen(self, v):
        gen = (self.n * i for i in range(3))
        self.n = self.n + v
        return list(gen)

    def fluent(self, v):
        self.n += v
        return self

    def partial_write(self, v):
        self.n = self.n + v
        raise ValueError("boom")

    def float_state(self, v):
        self.scale = self.scale * 2
        return v * self.scale

    def swap_none(self, v):
        self.opt = v
        return self.opt
"""


@pytest.mark.parametrize(
    "calls",
    [
        [("use_closure", (2.0,))],
        [("helper_in_scan", (XS,))],
        [("sub_bound_scan", (XS,))],
        [("fori_sub_models", (jnp.float32(1.0),))],
        [("copies", (2.0,)), ("copies", (1.0,))],
        [("values_gen", (2.0,))],
    ],
    ids=lambda c: c[0][0],
)
def test_misc_reaches(write_module: Loader, calls: list[Call]) -> None:
    plain, dec = pair(write_module, MISC)
    check(plain, dec, "Misc()", calls)


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


def test_exception_after_a_write_keeps_the_write_eagerly(write_module: Loader) -> None:
    plain, dec = pair(write_module, MISC)
    p, d = plain.Misc(), dec.Misc()
    for m in (p, d):
        with pytest.raises(ValueError, match="boom"):
            m.partial_write(3.0)
    assert_same(snapshot(p), snapshot(d))
    f, states = dec.Misc().functionalize()
    with pytest.raises(ValueError, match="boom"):
        f.partial_write(states, 3.0)
    out, states2 = f.use_closure(states, 1.0)  # f still works after the exception
    assert float(states2["n"]) == 2.0


def test_python_float_state(write_module: Loader) -> None:
    plain, dec = pair(write_module, MISC)
    check(plain, dec, "Misc()", [("float_state", (1.0,)), ("float_state", (1.0,))])


def test_none_state_becomes_an_array(write_module: Loader) -> None:
    # None is a placeholder an array may replace, inside f too (tests/test_static_state.py).
    plain, dec = pair(write_module, MISC)
    check(plain, dec, "Misc()", [("swap_none", (jnp.ones(2),)), ("swap_none", (jnp.ones(2),))])


def test_scan_and_vmap_over_f_from_outside(write_module: Loader) -> None:
    plain, dec = pair(write_module, MISC)
    ref = plain.Misc()
    expected = [ref.use_closure(x) for x in XS]
    f, states = dec.Misc().functionalize()

    def body(s: dict[str, Any], x: jax.Array) -> tuple[dict[str, Any], jax.Array]:
        out, s = f.use_closure(s, x)
        return s, out

    states_out, outs = jax.lax.scan(body, states, XS)
    assert_same(np.stack([np.asarray(e) for e in expected]), outs, "scan outs")
    assert_same(snapshot(ref.n), snapshot(states_out["n"]), "scan state")
    # an ensemble: vmap over stacked states
    batched = jax.tree_util.tree_map(lambda v: jnp.stack([v, v + 1.0]), states)
    outs, new = jax.vmap(f.use_closure, in_axes=(0, None))(batched, 2.0)
    refs = []
    for offset in (0.0, 1.0):
        m = plain.Misc()
        m.n = m.n + offset
        m.leaf.n = m.leaf.n + offset
        m.leaves["a"].n = m.leaves["a"].n + offset
        refs.append(m.use_closure(2.0))
    assert_same(np.stack(refs), outs, "vmap outs")


STRUCT = """
@DECORATE
class Child:
    def __init__(self, parent=None):
        self.parent = parent
        self.n = jnp.zeros(())

    def __call__(self, x):
        self.n = self.n + x
        if self.parent is not None:
            self.parent.total = self.parent.total + x
        return self.n


@DECORATE
class Parent:
    def __init__(self):
        self.total = jnp.zeros(())
        self.kids = [Child(self), Child(self)]

    def __call__(self, x):
        return self.kids[0](x) + self.kids[1](2 * x) + self.total


class Hook:
    def __init__(self, owner):
        self.owner = owner

    def fire(self, x):
        self.owner.hits = self.owner.hits + x


@DECORATE
class Hooked:
    def __init__(self):
        self.hits = jnp.zeros(())
        self.hook = Hook(self)

    def __call__(self, x):
        self.hook.fire(x)
        self.hits = self.hits * 2
        return self.hits


@DECORATE
class Eq:
    def __init__(self, v):
        self.v = jnp.asarray(v)
        self.n = jnp.zeros(())

    def __eq__(self, other):
        return self.v == other.v

    __hash__ = None

    def __call__(self, x):
        self.n = self.n + x * self.v
        return self.n


@DECORATE
class EqNet:
    def __init__(self):
        self.a = Eq(1.0)
        self.b = Eq(1.0)

    def __call__(self, x):
        return self.a(x) + self.b(x)


@DECORATE
class Heads:
    def __init__(self):
        self.heads = {"a": Child()}

    def add(self, name):
        self.heads[name] = Child()

    def __call__(self, x):
        return sum(h(x) for h in self.heads.values())


@DECORATE
class Private:
    def __init__(self):
        self.__count = jnp.zeros(())

    def bump(me, x):
        me.__count += x
        return me.__count


@DECORATE
class PrivateChild(Private):
    def __init__(self):
        super().__init__()
        self.__count = jnp.ones(())

    def bump(self, x):
        self.__count = self.__count * 3
        return super().bump(x) + self.__count
"""


def test_cycle_child_writes_parent(write_module: Loader) -> None:
    plain, dec = pair(write_module, STRUCT)
    calls: list[Call] = [("__call__", (1.0,)), ("__call__", (2.0,))]
    check(plain, dec, "Parent()", calls, modes=("eager",))
    # `total` is assigned only through another object (documented: not state)
    f, states = dec.Parent().functionalize()
    with raises_autostate(autostate.errors.StateAccessError) as err:
        f(states, 1.0)
    assert_user_line(err.value, ".py")
    declared = STRUCT.replace(
        "self.total = jnp.zeros(())", "self.total = STATE(jnp.zeros(()))"
    )
    plain, dec = pair(write_module, declared)
    check(plain, dec, "Parent()", calls)


def test_undecorated_hook_holding_the_model(write_module: Loader) -> None:
    plain, dec = pair(write_module, STRUCT)
    check(plain, dec, "Hooked()", [("__call__", (1.0,))], modes=("eager",))
    model = dec.Hooked()
    # f's copy of the model would still reach the original through the
    # plain Hook: refused when functionalized, naming the path and the fix.
    with pytest.raises(autostate.errors.InvalidTypeError, match=r"plain Hook object \(at hook\.owner\)"):
        model.functionalize()
    assert float(model.hits) == 0.0


def test_eq_override_and_unhashable_instances(write_module: Loader) -> None:
    plain, dec = pair(write_module, STRUCT)
    check(plain, dec, "EqNet()", [("__call__", (1.0,)), ("__call__", (2.0,))])


def test_sub_model_added_by_item_assignment(write_module: Loader) -> None:
    plain, dec = pair(write_module, STRUCT)
    p, d = plain.Heads(), dec.Heads()
    p.add("b")
    d.add("b")
    assert_same([p(1.0), p(2.0)], [d(1.0), d(2.0)])
    assert_same(snapshot(p), snapshot(d))
    f, states = d.functionalize()
    assert sorted(states) == ["heads['a'].n", "heads['b'].n"]
    out, states = jax.jit(f)(states, 1.0)
    assert_same(p(1.0), out)
    with raises_autostate(autostate.errors.StateAccessError):
        jax.jit(f.add, static_argnums=1)(states, "c")


def test_mangled_private_names_and_receiver_named_me(write_module: Loader) -> None:
    plain, dec = pair(write_module, STRUCT)
    check(plain, dec, "Private()", [("bump", (1.0,)), ("bump", (2.0,))])
    check(plain, dec, "PrivateChild()", [("bump", (1.0,)), ("bump", (2.0,))])


TRANSFORMS_INSIDE = """
import jax.lax as L
from jax.lax import scan as my_scan

if type(lax).__name__ == "_PyLax":  # the plain reference: Python loops
    L = lax
    my_scan = lax.scan


@DECORATE
class T:
    def __init__(self):
        self.n = jnp.zeros(())
        self.w = jnp.array([1.0, 2.0])

    def vmap_reads(self, xs):
        return jax.vmap(lambda x: x * self.w + self.n)(xs)

    def grad_reads(self, x):
        self.n = self.n + 1
        return jax.grad(lambda v: jnp.sum(jnp.sin(v * self.w)) * self.n)(x)

    def alias_scan(self, xs):
        def body(c, x):
            self.n = self.n + x
            return c, self.n
        a = L.scan(body, 0.0, xs)[1]
        b = my_scan(body, 0.0, xs, reverse=True)[1]
        return a, b

    def scan_length(self, k):
        def body(c, _):
            self.n = self.n + k
            return c + self.n, None
        return lax.scan(body, jnp.zeros(()), None, length=3)[0]

    def vmap_writes(self, xs):
        def one(x):
            self.n = self.n + x
            return x
        return jax.vmap(one)(xs)

    def grad_writes(self, x):
        def loss(v):
            self.n = v * 2
            return v ** 2
        return jax.grad(loss)(x)

    def jit_bound(self, x):
        return jax.jit(self.bump)(x)

    def bump(self, x):
        self.n = self.n + x
        return self.n

    def dynamic_scan(self, xs):
        def body(c, x):
            self.n = self.n + x
            return c, None
        getattr(jax.lax, "scan")(body, 0.0, xs)
        return self.n

    def gen(self, k):
        for i in range(k):
            yield self.bump(float(i))
"""


@pytest.mark.parametrize(
    "calls",
    [
        [("vmap_reads", (jnp.ones((3, 2)),))],
        [("grad_reads", (jnp.ones(2),)), ("grad_reads", (jnp.ones(2),))],
        [("alias_scan", (XS,))],
        [("scan_length", (jnp.float32(2.0),))],
    ],
    ids=lambda c: c[0][0],
)
def test_transforms_inside_methods(write_module: Loader, calls: list[Call]) -> None:
    plain, dec = pair(write_module, TRANSFORMS_INSIDE)
    check(plain, dec, "T()", calls)


@pytest.mark.parametrize(
    "method",
    [
        "vmap_writes",
        "grad_writes",
        "jit_bound",
        "dynamic_scan",
    ],
)
def test_state_written_under_a_transformation_inside_a_method_is_a_clear_error(
    write_module: Loader, method: str
) -> None:
    """Plain Python leaks a tracer here; autostate must refuse clearly, never leak."""
    _, dec = pair(write_module, TRANSFORMS_INSIDE)
    arg = XS if method in ("vmap_writes", "dynamic_scan") else jnp.float32(1.5)
    for mode in ("eager", "f", "jit"):
        model = dec.T()
        f, states = model.functionalize()
        with raises_autostate() as err:
            if mode == "eager":
                _method(model, method)(arg)
            elif mode == "f":
                _fcall(f, method)(states, arg)
            else:
                jax.jit(lambda f, s, a: _fcall(f, method)(s, a))(f, states, arg)
        assert "fix:" in str(err.value)
        assert not autostate.lifetime.contains_tracer(snapshot(model)), "tracer leaked"


def test_generator_method_calling_a_state_writer(write_module: Loader) -> None:
    plain, dec = pair(write_module, TRANSFORMS_INSIDE)
    p, d = plain.T(), dec.T()
    assert_same(list(p.gen(3)), list(d.gen(3)))
    assert_same(snapshot(p), snapshot(d))
    f, states = dec.T().functionalize()
    gen, states = f.gen(states, 3)
    with raises_autostate():
        list(gen)  # runs after the handler has returned


LAST = """
@DECORATE
class Loop:
    def __init__(self):
        self.i = jnp.zeros((), jnp.int32)
        self.acc = jnp.zeros(())
        self.w = jnp.full((2,), 2.0)

    def py_range(self):
        for self.i in range(3):
            self.acc = self.acc + self.i
        return self.acc

    @functools.cached_property
    def doubled(self):
        return self.w * 2

    def __call__(self, x):
        self.acc = self.acc + x
        return self.doubled * self.acc
"""


def test_for_self_i_in_python_range(write_module: Loader) -> None:
    plain, dec = pair(write_module, LAST)
    check(plain, dec, "Loop()", [("py_range", ()), ("py_range", ())])


def test_cached_property_with_jit_closing_over_f(write_module: Loader) -> None:
    plain, dec = pair(write_module, LAST)
    ref = plain.Loop()
    expected = [ref(1.0), ref(2.0)]
    f, states = dec.Loop().functionalize()
    step = jax.jit(lambda s, x: f(s, x))
    got = []
    for x in (1.0, 2.0):
        out, states = step(states, x)
        got.append(out)
    assert_same(expected, got)
    out, states = f(states, 3.0)  # and eagerly afterwards: no tracer cached in f.model
    assert_same(ref(3.0), out)
