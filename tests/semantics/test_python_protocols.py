"""Python protocols on models: operators, ``__getitem__``, ``__iter__``,
``__len__``, ``__eq__``/hash, ``__bool__``, context managers.

Each case runs a class as plain Python and decorated (the harness in
``tests/semantics/harness.py``, or a direct comparison) and asserts the
decorated program means what the plain one does: eagerly, through
``f(states, ...)``, under ``jax.jit`` and after ``autostate.freeze``, or that it
is refused with a clear error. A known difference stays as ``xfail(strict=True)``
with what differs.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import jax.numpy as jnp
import pytest

import autostate
from autostate import errors
from semantics.harness import (
    Call,
    Loader,
    assert_same,
    check,
    floats,
    pair,
    run_case,
    same,
    snapshot,
    staged,
    user_line,
)
from semantics.programs_attribute_access import PROTO
from semantics.programs_methods import FRAMES, GENERATOR_METHODS, GENS
from semantics.programs_python_protocols import CMS, ITER
from semantics.programs_shared import A1, A2, X1
from semantics.programs_shared import TWO as X2
from semantics.programs_shared import XS3 as XS
from semantics.programs_submodels import STRUCT


def test_eq_override_and_unhashable_instances(write_module: Loader) -> None:
    plain, dec = pair(write_module, STRUCT)
    check(plain, dec, "EqNet()", [("__call__", (1.0,)), ("__call__", (2.0,))])














def test_weakref_to_model(write_module: Loader) -> None:
    _, dec = pair(write_module, PROTO)
    m = dec.Acc()
    r = weakref.ref(m)
    assert r() is m
    f, states = m.functionalize()
    del m
    gc.collect()
    assert r() is None  # f does not keep the original alive
    out, _ = f(states, 1.0)
    assert float(out) == 3.0


def test_default_eq_and_hash_are_identity(write_module: Loader) -> None:
    plain, dec = pair(write_module, PROTO)
    for mod in (plain, dec):
        a, b = mod.Acc(), mod.Acc()
        h = hash(a)
        a(1.0)
        assert hash(a) == h
        assert a == a and a != b and not (a == b)
        assert len({a, b, a}) == 2
        assert {a: 1}[a] == 1
    assert dec.Acc.__eq__ is object.__eq__


def test_user_dunder_protocol_methods(write_module: Loader) -> None:
    plain, dec = pair(write_module, PROTO)
    check(plain, dec, "Buf(3)", [("push", (2.0,)), ("push", (3.0,))])
    f, states = dec.Buf(3).functionalize()
    assert f.describe(states)[0] == "Buf(n=3)"
    p, d = plain.Buf(3), dec.Buf(3)
    for m in (p, d):
        m += 1.0
        m[1] = 5.0
    assert_same(snapshot(p), snapshot(d))
    assert repr(p) == repr(d) == str(d) == "Buf(n=3)"
    assert len(d) == 3
    assert_same(list(p), list(d))


def test_dunder_method_through_f(write_module: Loader) -> None:
    plain, dec = pair(write_module, PROTO)
    p = plain.Buf(3)
    p[0] = 9.0
    f, states = dec.Buf(3).functionalize()
    try:
        _, states = f.__setitem__(states, 0, 9.0)
    except autostate.AutostateError:
        return  # a clear refusal would do
    assert_same(p.items, states["items"])






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


def test_context_manager_from_outside_around_f_and_eager(write_module: Loader) -> None:
    """``with model.mode(2.0): model.fwd(x)`` from a training loop, eagerly."""
    plain, dec = pair(write_module, GENS)
    outs = []
    models = (plain.Gen(), dec.Gen())
    for m in models:
        with m.mode(3.0):
            a = m.fwd(X1)
        outs.append([a, m.fwd(X2)])
    assert_same(outs[0], outs[1], "outputs")
    assert_same(snapshot(models[0]), snapshot(models[1]), "attributes")




def test_context_manager_exited_after_the_entering_call_returned(write_module: Loader) -> None:
    plain, dec = pair(write_module, FRAMES)
    got = []
    for mod in (plain, dec):
        m = mod.Stream()
        cm = m.scope(1.0)
        entered = cm.__enter__()
        middle = m.bump(5.0)
        cm.__exit__(None, None, None)
        got.append(floats([entered, middle, m.x, m.n]))
    assert_same(got[0], got[1])












def test_generator_dunder_iter_using_state_is_refused(write_module: Loader) -> None:
    with pytest.raises(errors.DecorationError) as info:
        pair(write_module, """
@DECORATE
class M:
    def __init__(self):
        self.k = jnp.zeros(())
    def __iter__(self):
        for i in range(3):
            self.k = self.k + i
            yield self.k
""")
    assert "__iter__" in str(info.value)
    assert ".py:" in str(info.value)


COUNTDOWN = """
@DECORATE
class Countdown:
    def __init__(self, n):
        self.n = n
        self.i = 0
        self.total = jnp.zeros(())
    def __iter__(self):
        self.i = 0
        return self
    def __next__(self):
        if self.i >= self.n:
            raise StopIteration
        self.i += 1
        self.total = self.total + self.i
        return self.total
    def run(self):
        return sum(v for v in self)
"""


def test_iterator_next_with_python_int_position(write_module: Loader) -> None:
    plain, dec = pair(write_module, COUNTDOWN)
    run_case(plain, dec, "Countdown(3)", [("run", ()), ("run", ())], modes=("eager",))
    ref, model = plain.Countdown(2), dec.Countdown(2)
    same(list(ref), list(model), "for loop outside")
    f, states = dec.Countdown(3).functionalize()
    with pytest.raises(errors.StaticStateError) as info:
        f.run(states)
    user_line(info.value, dec, "self.i += 1")


CONTAINERS = """
@DECORATE
class Lin:
    def __init__(self):
        self.w = jnp.asarray(2.0)
        self.calls = jnp.zeros((), jnp.int32)
    def __call__(self, x):
        self.calls += 1
        return x * self.w

@DECORATE
class Seq:
    def __init__(self, n):
        self.layers = [Lin() for _ in range(n)]
        self.n = jnp.zeros((), jnp.int32)
    def __len__(self):
        return len(self.layers)
    def __iter__(self):
        return iter(self.layers)
    def __getitem__(self, i):
        return self.layers[i]
    def __call__(self, x):
        self.n += 1
        for layer in self:
            x = layer(x)
        return x

@DECORATE
class Net:
    def __init__(self):
        self.empty = Seq(0)
        self.body = Seq(2)
        self.opt = self.empty or Lin()
    def __call__(self, x):
        y = self.body(self.empty(x)) + self.body[0](x) + self.opt(x)
        return y * len(self.body) + len(self.empty)
"""


def test_container_models_with_len_zero_iter_and_getitem(write_module: Loader) -> None:
    plain, dec = pair(write_module, CONTAINERS)
    run_case(plain, dec, "Net()", [("__call__", (A1,)), ("__call__", (A2,))],
             extra=("__call__", (A1,)))


def test_contextmanager_method_touching_state_is_refused(write_module: Loader) -> None:
    with pytest.raises(errors.DecorationError) as info:
        pair(write_module, """
import contextlib
@DECORATE
class M:
    def __init__(self):
        self.scale = jnp.asarray(1.0)
    @contextlib.contextmanager
    def scaled(self, s):
        old = self.scale
        self.scale = self.scale * s
        try:
            yield
        finally:
            self.scale = old
""")
    assert "scaled" in str(info.value) and ".py:" in str(info.value)


CM_VIA_METHOD = """
import contextlib
@DECORATE
class Net:
    def __init__(self):
        self.w = jnp.asarray(2.0)
        self.dropout_on = jnp.asarray(True)
        self.n = jnp.zeros((), jnp.int32)
    def _set_mode(self, flag):
        old = self.dropout_on
        self.dropout_on = jnp.asarray(flag)
        return old
    @contextlib.contextmanager
    def eval_mode(self):
        old = self._set_mode(False)
        try:
            yield self
        finally:
            self._set_mode(old)
    def forward(self, x):
        self.n += 1
        return jnp.where(self.dropout_on, x * 0.5, x) * self.w
    def __call__(self, x):
        a = self.forward(x)
        with self.eval_mode() as m:
            b = m.forward(x)
            try:
                with self.eval_mode():
                    raise KeyError("inner")
            except KeyError:
                b = b + self.dropout_on
        return a + 10 * b + self.dropout_on
"""


def test_contextmanager_method_reaching_state_through_methods(write_module: Loader) -> None:
    plain, dec = pair(write_module, CM_VIA_METHOD)
    run_case(plain, dec, "Net()", [("__call__", (A1,)), ("__call__", (A2,))],
             extra=("__call__", (A1,)))


MODULE_CM = """
import contextlib
@contextlib.contextmanager
def scaled(model, s):
    old = model.scale
    model.scale = model.scale * s
    try:
        yield model.scale
    finally:
        model.scale = old
        model.restores = model.restores + 1

@DECORATE
class M:
    def __init__(self):
        self.scale = jnp.asarray(1.0)
        self.restores = jnp.zeros((), jnp.int32)
    def set(self, s):
        self.scale = s
        self.restores = self.restores * 1
    def __call__(self, x):
        with scaled(self, 3.0) as s:
            y = x * s * self.scale
        return y + self.scale
"""


def test_module_level_contextmanager_taking_the_model(write_module: Loader) -> None:
    plain, dec = pair(write_module, MODULE_CM)
    run_case(plain, dec, "M()", [("__call__", (A1,)), ("set", (A2,)), ("__call__", (A1,))],
             extra=("__call__", (A2,)))


EXITSTACK = """
import contextlib
@DECORATE
class M:
    def __init__(self):
        self.lr = jnp.asarray(1.0)
        self.mom = jnp.asarray(0.9)
    def __call__(self, x):
        with contextlib.ExitStack() as stack:
            stack.callback(setattr, self, "lr", self.lr)
            stack.callback(setattr, self, "mom", self.mom)
            self.lr = self.lr * 0.1
            self.mom = self.mom * 0.0
            y = x * self.lr + self.mom
        self.lr = self.lr + 1.0
        return y
"""


def test_exitstack_callbacks_setattr_old_values_back(write_module: Loader) -> None:
    plain, dec = pair(write_module, EXITSTACK)
    run_case(plain, dec, "M()", [("__call__", (A1,)), ("__call__", (A2,))],
             extra=("__call__", (A1,)))


REPR = """
@DECORATE
class Leaf:
    def __init__(self):
        self.n = jnp.zeros((), jnp.int32)
        self.w = jnp.ones(2)
    def __repr__(self):
        raise RuntimeError("repr must not be called")
    def __str__(self):
        raise RuntimeError("str must not be called")
    def __call__(self, x):
        self.n += 1
        return x * self.w

@DECORATE
class Root:
    def __init__(self):
        self.leaf = Leaf()
        self.k = jnp.zeros((), jnp.int32)
    def __repr__(self):
        raise RuntimeError("repr must not be called")
    def __call__(self, x):
        self.k += 1
        return self.leaf(x) * self.k
"""


def test_repr_and_str_are_never_called(write_module: Loader) -> None:
    plain, dec = pair(write_module, REPR)
    run_case(plain, dec, "Root()", [("__call__", (A1,)), ("__call__", (A2,))],
             extra=("__call__", (A1,)))


ITEMS = """
@DECORATE
class Table:
    def __init__(self):
        self.table = jnp.zeros(4)
        self.writes = jnp.zeros((), jnp.int32)
    def __getitem__(self, i):
        return self.table[i]
    def __setitem__(self, i, v):
        self.writes += 1
        self.table = self.table.at[i].set(v)
    def __len__(self):
        return 4
    def __call__(self, x):
        self[0] = x
        self[1] += x * 2
        self[x.astype(int) % 4] -= 1.0
        return self[1] + len(self)
"""


def test_getitem_setitem_dunders_on_the_model(write_module: Loader) -> None:
    plain, dec = pair(write_module, ITEMS)
    run_case(plain, dec, "Table()", [("__call__", (A1,)), ("__call__", (A2,))],
             extra=("__call__", (jnp.asarray(3.0),)))


AUG_SCALAR = """
@DECORATE
class A:
    def __init__(self):
        self.i = jnp.asarray(7, jnp.int32)
        self.u = jnp.asarray(200, jnp.uint8)
        self.b = jnp.asarray([True, False, True])
        self.m = jnp.eye(2)
        self.f = jnp.asarray(2.5)
    def __call__(self, k):
        self.i //= 2
        self.i %= 3
        self.i <<= 2
        self.i >>= 1
        self.i ^= 5
        self.i |= 8
        self.i &= 14
        self.u += 100
        self.b &= jnp.asarray([True, True, False])
        self.b ^= True
        self.m @= jnp.asarray([[1.0, 2.0], [3.0, 4.0]])
        self.f **= 2
        self.f //= k
        self.f %= 1.5
        return self.i, self.u, self.b, self.m, self.f
"""


def test_every_augmented_operator_on_scalar_states(write_module: Loader) -> None:
    plain, dec = pair(write_module, AUG_SCALAR)
    run_case(plain, dec, "A()", [("__call__", (A2,)), ("__call__", (jnp.asarray(3.0),))],
             extra=("__call__", (A2,)))


IADD = """
@DECORATE
class Stat:
    def __init__(self):
        self.n = jnp.zeros((), jnp.int32)
        self.total = jnp.zeros(())
    def push(self, x):
        self.n += 1
        self.total += x
        return self
    def __iadd__(self, other):
        self.n = self.n + other.n
        self.total = self.total + other.total
        return self

@DECORATE
class Pair:
    def __init__(self):
        self.a = Stat()
        self.b = Stat()
        self.both = [self.a, self.b]
    def __call__(self, x):
        self.a.push(x).push(2 * x)
        self.b.push(x)
        self.a += self.b
        return self.a.total + self.both[0].n
"""


def test_iadd_merging_another_models_state(write_module: Loader) -> None:
    plain, dec = pair(write_module, IADD)
    run_case(plain, dec, "Pair()", [("__call__", (A1,)), ("__call__", (A2,))],
             extra=("__call__", (A1,)))
    ref, model = plain.Stat(), dec.Stat()
    for m, other in ((ref, plain.Stat()), (model, dec.Stat())):
        other.push(A2)
        m += other
        m += other
    same(snapshot(ref), snapshot(model), "+= from outside")


JAX_ARRAY = """
@DECORATE
class V:
    def __init__(self):
        self.v = jnp.arange(3.0)
    def __jax_array__(self):
        return self.v
    def bump(self, x):
        self.v = self.v + x
        return jnp.sum(jnp.asarray(self)) * 2
"""


def test_jax_array_protocol_reads_state(write_module: Loader) -> None:
    plain, dec = pair(write_module, JAX_ARRAY)
    run_case(plain, dec, "V()", [("bump", (A1,)), ("bump", (A2,))], extra=("bump", (A1,)))


@pytest.mark.filterwarnings(
    "ignore:Python iterable type:DeprecationWarning"
)
def test_for_over_model_eagerly(write_module: Loader) -> None:
    plain, dec = pair(write_module, GENERATOR_METHODS)
    got = []
    for mod in (plain, dec):
        m = mod.M()
        vals = [v for v in m]
        got.append((vals, snapshot(m)))
    same(got[0], got[1])


@pytest.mark.filterwarnings(
    "ignore:Python iterable type:DeprecationWarning"
)
def test_next_with_an_array_counter(write_module: Loader) -> None:
    plain, dec = pair(write_module, ITER)
    check(plain, dec, "Counter()", [("for_self", ()), ("for_self", ())], modes=("eager", "f"))
    got = []
    for mod in (plain, dec):
        m = mod.Counter(2)
        got.append(([v for v in m], snapshot(m)))
    same(got[0], got[1], "for x in model eagerly")


@pytest.mark.filterwarnings(
    "ignore:Python iterable type:DeprecationWarning"
)
def test_next_with_an_array_counter_under_jit_is_traced_value_error(write_module: Loader) -> None:
    _, dec = pair(write_module, ITER)
    f, s = dec.Counter().functionalize()
    with pytest.raises(errors.TracedValueError) as info:
        staged(f.for_self)(s)
    user_line(info.value, dec, "# HERE")


CM_CASES: dict[str, list[tuple[str, tuple[Any, ...]]]] = {
    "enter_exit_of_sub_model": [("with_self_flag", (A1,))] * 2,
    "raise_inside_with_caught_in_the_model": [("with_raise", (A2,))] * 2,
    "nested_contextmanager_and_enter": [("nested", (A2,))] * 2,
    "in_scan_body": [("in_scan", (XS,))] * 2,
    "two_in_one_with": [("both", (A1,))] * 2,
    "in_cond_branches": [("in_cond", (A1,)), ("in_cond", (A2,))],
    "in_fori_body": [("in_fori", (A1,))] * 2,
    "raise_caught_inside_scan_body": [("scan_raise", (XS,))] * 2,
    "closing_and_suppress": [("closing", (A1,))] * 2,
    "exit_stack": [("exit_stack", (A1,))] * 2,
}


@pytest.mark.filterwarnings(
    "ignore:Python iterable type:DeprecationWarning"
)
@pytest.mark.parametrize("case", sorted(CM_CASES))
def test_context_managers(write_module: Loader, case: str) -> None:
    plain, dec = pair(write_module, CMS)
    check(plain, dec, "Net()", CM_CASES[case])


@pytest.mark.filterwarnings(
    "ignore:Python iterable type:DeprecationWarning"
)
def test_with_model_from_outside_eagerly(write_module: Loader) -> None:
    plain, dec = pair(write_module, CMS)
    got = []
    for mod in (plain, dec):
        net = mod.Net()
        with net.flag as fl:
            a = net.fwd(A1)
            try:
                with net.train_mode(True):
                    b = net.fwd(A1)
                    raise RuntimeError("x")
            except RuntimeError:
                pass
        got.append(([a, b, fl.entered], snapshot(net)))
    same(got[0], got[1])
