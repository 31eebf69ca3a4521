"""Differential bug hunt 28: combinations of the roads to state.

Earlier hunts tried each road to state on its own (methods defined outside
the class, ``functools.wraps`` wrappers, inheritance, bound methods handed to
``lax``, helpers in other modules, copies, closures, ``getattr`` / ``setattr``
with computed names, ``vars(self)``, static and class methods, properties,
mixins, sub-model replacement, ``vmap``, exceptions). Here they are stacked
the way an adversarial reviewer would stack them:

- a function defined outside the class, wrapped by a ``functools.wraps``
  decorator, assigned in the class body, inherited by an undecorated
  subclass and handed as a bound method to ``lax.scan`` / ``fori_loop`` /
  ``cond`` / ``switch``, under ``jax.grad`` and ``jax.vmap`` of ``f``;
- helpers in another module (two modules written plain and decorated)
  writing the model, called from a method inside ``jax.checkpoint`` under
  ``jax.grad``, from a ``lax.scan`` body, through ``getattr`` with a computed
  name; a helper using JAX's own ``lax.scan`` (the documented escape);
- ``copy.copy`` / ``copy.deepcopy`` of ``self`` or a sub-model inside a
  method, the copy written in a ``lax`` body, a copy returned from ``f``;
- closures made by a method or in ``__init__``, kept on the model and
  called later in a ``scan`` body or through ``jax.checkpoint``;
- ``functools.partial`` of a bound method, ``operator.methodcaller``,
  ``getattr(self, computed)``, ``setattr(self, name, v)`` in a loop inside a
  ``lax`` body, ``vars(self)`` reads after writes in a body;
- a staticmethod / classmethod receiving the instance, a property setter
  writing state, reached from ``lax`` bodies and under ``vmap`` of ``f``;
- cooperative ``super()`` chains through mixins each writing state, with a
  mixin method that is a lambda in the mixin's class body;
- a sub-model replaced inside a method (eagerly, and the documented error
  under ``f``), then read;
- ``jax.vmap`` inside a method over a closure reading state (after a write)
  and writing it (the documented escape);
- exceptions: writes then a raise, caught inside the model (through wrapped,
  inherited and helper roads) and outside ``f``.

Each source is written plain and decorated (``differential.pair``; ``lax.*``
is a Python loop and ``jax.checkpoint`` the identity in the plain module);
``run_case`` compares outputs, states and every attribute (dtypes, shapes,
values to 1e-6) eagerly, through ``f``, under ``jax.jit`` of ``f`` and after
``autostate.freeze`` (plus one more call on the frozen model). A case that
shows a mismatch stays, marked ``xfail(strict=True)`` with what differs.

It found two bugs, both fixed (one mechanism: ``control._with_eager_states``
threaded only an eager model's slots through a ``lax`` body, not those of a
copy made inside a running call): a ``copy.copy`` / ``copy.deepcopy`` of a
model made inside a functionalized call and written in a ``lax`` body or
``jax.checkpoint`` leaked JAX's raw ``UnexpectedTracerError`` (eagerly
right); a ``tree_map`` / ``stop_gradient`` copy of a sub-model written in a
``lax`` body wrote the original's state through ``f`` (eagerly the copy's).
"""

from __future__ import annotations

import itertools
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
    PYLAX,
    X,
    check_transform,
    pair,
    plain_path,
    same,
    snapshot,
    user_line,
)

import autostate

Loader = Callable[..., types.ModuleType]


def _call(obj: Any, name: str) -> Callable[..., Any]:
    return obj if name == "__call__" else getattr(obj, name)


def _out(v: Any) -> Any:
    """A model returned by a call is compared by its attributes."""

    def is_model(x: Any) -> bool:
        return type(x).__module__.startswith("autostate_testmod") and hasattr(x, "__dict__")

    if is_model(v):
        return snapshot(v)
    if isinstance(v, list | tuple):
        return type(v)(_out(x) for x in v)
    return v


def run_case(
    plain: types.ModuleType,
    dec: types.ModuleType,
    build: str,
    calls: list[tuple[str, tuple[Any, ...]]],
    modes: tuple[str, ...] = ("eager", "f", "jit", "freeze"),
    extra: tuple[str, tuple[Any, ...]] | None = None,
) -> None:
    """The calls on the plain model are the reference for every mode."""
    ref = eval(build, vars(plain))  # noqa: S307
    expected = [_out(_call(ref, m)(*a)) for m, a in calls]
    expected_snap = snapshot(ref)

    if "eager" in modes:
        model = eval(build, vars(dec))  # noqa: S307
        got = [_out(_call(model, m)(*a)) for m, a in calls]
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
            got.append(_out(out))
        same(expected, got, f"{mode} outputs")
        for key, value in states.items():
            same(snapshot(plain_path(ref, key)), snapshot(value), f"{mode} state {key}")
        same(before, snapshot(model), f"{mode}: the eager model changed")
        if mode == "jit" and "freeze" in modes:
            frozen = autostate.freeze(f, states)
            same(expected_snap, snapshot(frozen), "frozen attributes")
            if extra is not None:
                m, a = extra
                same(_out(_call(ref, m)(*a)), _out(_call(frozen, m)(*a)), "frozen call")
                same(snapshot(ref), snapshot(frozen), "frozen attributes after a call")


_COUNTER = itertools.count()


def pair2(write_module: Loader, helper: str, source: str) -> tuple[Any, Any, Any, Any]:
    """A helper module and a model module importing it (``import HELPERS as helpers``),
    each written plain and decorated: ``(plain, dec, plain_helpers, dec_helpers)``."""
    n = next(_COUNTER)
    hp = write_module(HEADER + PYLAX + "LAXW = lax\n" + helper, name=f"autostate_testmod_h28p{n}")
    hd = write_module(
        HEADER + "from jax import lax\ncheckpoint = jax.checkpoint\nLAXW = autostate\n" + helper,
        name=f"autostate_testmod_h28d{n}",
    )
    plain_src = source.replace("HELPERS", hp.__name__).replace("@DECORATE", "")
    plain = write_module(HEADER + PYLAX + "LAXW = lax\n" + plain_src)
    dec_src = source.replace("HELPERS", hd.__name__).replace("@DECORATE", "@autostate.stateful")
    dec = write_module(
        HEADER + "from jax import lax\ncheckpoint = jax.checkpoint\nLAXW = autostate\n" + dec_src
    )
    return plain, dec, hp, hd


A1 = jnp.asarray(1.0)
A2 = jnp.asarray(2.0)
V3 = jnp.arange(3.0)
XS = jnp.array([0.5, -1.0, 2.0, 1.5])


# ======================================================================================
# 1. A function defined outside the class, wrapped, assigned, inherited, handed to lax
# ======================================================================================

OUTSIDE_WRAPPED = """
def logged(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


def counting(fn):
    @functools.wraps(fn)
    def wrapper(self, *args):
        self.calls = self.calls + 1
        return fn(self, *args)
    return wrapper


def _step(self, carry, x):
    self.total = self.total + x * self.w
    self.n += 1
    return carry + self.total, self.total * 2.0


def _body(self, i, c):
    self.total = self.total * 0.5 + i
    return c + self.total


def _up(self, x):
    self.total = self.total + x
    return x * 2.0


def _down(self, x):
    self.n -= 1
    return x - self.total


@DECORATE
class Base:
    def __init__(self):
        self.w = jnp.asarray(1.5)
        self.total = jnp.zeros(())
        self.n = jnp.zeros((), jnp.int32)
        self.calls = jnp.zeros((), jnp.int32)

    step = logged(_step)
    body = counting(_body)
    up = logged(_up)
    down = counting(_down)


class Child(Base):
    def scan(self, xs):
        c, ys = lax.scan(self.step, 0.0, xs)
        return c, ys

    def fori(self, x):
        return lax.fori_loop(0, 3, self.body, x)

    def branch(self, x):
        return lax.cond(x > 0, self.up, self.down, x)

    def pick(self, i, x):
        return lax.switch(i, [self.up, self.down, self.step.__get__(self)
                              and (lambda v: self.step(0.0, v)[1])], x)


class GrandChild(Child):
    def __call__(self, xs):
        c, ys = self.scan(xs)
        return self.fori(c) + self.branch(ys[0]) + self.branch(-ys[-1])
"""


@pytest.mark.parametrize(
    "calls",
    [
        [("scan", (XS,)), ("scan", (XS * 2,))],
        [("fori", (A1,)), ("fori", (A2,))],
        [("branch", (A1,)), ("branch", (-A2,)), ("branch", (A2,))],
        [("pick", (0, A1)), ("pick", (1, A2)), ("pick", (2, A1))],
        [("pick", (jnp.asarray(2), A1)), ("pick", (jnp.asarray(1), A2))],
    ],
    ids=["scan", "fori_loop", "cond", "switch-int", "switch-traced"],
)
def test_outside_wrapped_assigned_inherited_bound_to_lax(
    write_module: Loader, calls: list[tuple[str, tuple[Any, ...]]]
) -> None:
    plain, dec = pair(write_module, OUTSIDE_WRAPPED)
    run_case(plain, dec, "Child()", calls, extra=calls[0])


def test_outside_wrapped_inherited_two_levels_call(write_module: Loader) -> None:
    plain, dec = pair(write_module, OUTSIDE_WRAPPED)
    run_case(
        plain,
        dec,
        "GrandChild()",
        [("__call__", (XS,)), ("__call__", (XS[::-1],))],
        extra=("__call__", (XS,)),
    )


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_outside_wrapped_inherited_under_grad_and_vmap(
    write_module: Loader, transform: str
) -> None:
    plain, dec = pair(write_module, OUTSIDE_WRAPPED)
    x = jnp.array([[0.5, 1.0, -2.0], [1.0, 2.0, 3.0]]) if transform == "vmap" else XS[:3]
    calls = (
        [("__call__", (X,)), ("fori", (A1,))]
        if transform == "grad"
        else [("scan", (X,)), ("fori", (A1,)), ("scan", (X,))]
    )
    check_transform(plain, dec, "GrandChild()", calls, x, transform)


# ======================================================================================
# 2. Helpers in another module
# ======================================================================================

HELPER_MOD = """
def accumulate(model, x):
    model.total = model.total + jnp.sin(x) * model.w
    model.hits = model.hits + 1
    return model.total * x


def call_named(model, name, *args):
    return getattr(model, name)(*args)


def bump_all(model, names, v):
    for n in names:
        setattr(model, n, getattr(model, n) + v)


def scan_with_jax(model, xs):
    return jax.lax.scan(lambda c, x: (c + accumulate(model, x), None), 0.0, xs)[0]


def scan_with_autostate(model, xs):
    return LAXW.scan(lambda c, x: (c + accumulate(model, x), None), 0.0, xs)[0]


def failing(model, x):
    model.total = model.total + x.sum()
    if x.shape[0] > 2:
        raise KeyError("too long")
    model.hits = model.hits + 1
    return x.sum()
"""

HELPER_MODEL = """
import HELPERS as helpers


@DECORATE
class M:
    def __init__(self):
        self.w = jnp.asarray(0.75)
        self.total = jnp.zeros(())
        self.hits = jnp.zeros((), jnp.int32)
        self.a = jnp.zeros(())
        self.b = jnp.zeros(())

    def _touch(self):
        self.total = self.total
        self.hits = self.hits
        self.a = self.a
        self.b = self.b

    def ckpt(self, x):
        g = checkpoint(lambda v: helpers.accumulate(self, v) * self.w)
        return g(x) + self.total

    def scanned(self, xs):
        def body(c, x):
            return c + helpers.accumulate(self, x), self.total
        return lax.scan(body, 0.0, xs)

    def named(self, xs):
        kind = "scan" + "ned"
        c, ys = helpers.call_named(self, kind, xs)
        return c + ys.sum()

    def loop_names(self, x):
        def body(i, c):
            helpers.bump_all(self, ["a", "b"], x * i)
            return c + self.a - self.b * 0.5
        return lax.fori_loop(0, 3, body, x)

    def via_jax_scan(self, xs):
        return helpers.scan_with_jax(self, xs)

    def via_autostate_scan(self, xs):
        return helpers.scan_with_autostate(self, xs)

    def guarded(self, x):
        try:
            return helpers.failing(self, x)
        except KeyError:
            self.b = self.b + 1
            return -self.total
"""


def test_helper_module_in_checkpoint_in_method(write_module: Loader) -> None:
    plain, dec, _, _ = pair2(write_module, HELPER_MOD, HELPER_MODEL)
    run_case(plain, dec, "M()", [("ckpt", (A1,)), ("ckpt", (A2,))], extra=("ckpt", (A1,)))


def test_helper_module_in_checkpoint_under_grad(write_module: Loader) -> None:
    plain, dec, _, _ = pair2(write_module, HELPER_MOD, HELPER_MODEL)
    check_transform(plain, dec, "M()", [("ckpt", (X,)), ("ckpt", (X,))], A2, "grad")


def test_helper_module_in_scan_body_under_grad_and_vmap(write_module: Loader) -> None:
    plain, dec, _, _ = pair2(write_module, HELPER_MOD, HELPER_MODEL)
    run_case(plain, dec, "M()", [("scanned", (XS,)), ("named", (XS,))], extra=("named", (XS,)))
    check_transform(plain, dec, "M()", [("scanned", (X,))], XS, "grad")
    check_transform(plain, dec, "M()", [("named", (X,))], jnp.stack([XS, XS * 2]), "vmap")


def test_helper_module_setattr_computed_names_in_fori_body(write_module: Loader) -> None:
    plain, dec, _, _ = pair2(write_module, HELPER_MOD, HELPER_MODEL)
    run_case(
        plain,
        dec,
        "M()",
        [("loop_names", (A1,)), ("loop_names", (A2,))],
        extra=("loop_names", (A1,)),
    )


def test_helper_module_with_autostate_scan(write_module: Loader) -> None:
    plain, dec, _, _ = pair2(write_module, HELPER_MOD, HELPER_MODEL)
    run_case(
        plain, dec, "M()", [("via_autostate_scan", (XS,))] * 2, extra=("via_autostate_scan", (XS,))
    )


def test_helper_module_with_jax_scan_is_the_documented_escape(write_module: Loader) -> None:
    _, dec, _, hd = pair2(write_module, HELPER_MOD, HELPER_MODEL)
    f, states = dec.M().functionalize()
    for fn in (f.via_jax_scan, jax.jit(f.via_jax_scan)):
        with pytest.raises(autostate.AutostateError) as e:
            fn(states, XS)
        assert isinstance(e.value, autostate.errors.EscapedStateError), repr(e.value)
        # documented: named where the tracer would escape (the return of f: this file)
        assert f"{__file__}:" in str(e.value) and "autostate.scan" in str(e.value)
    with pytest.raises(autostate.AutostateError) as e:
        dec.M().via_jax_scan(XS)
    user_line(e.value, hd, "model.total = model.total + jnp.sin(x)")


def test_helper_module_raises_after_write_caught_in_method(write_module: Loader) -> None:
    plain, dec, _, _ = pair2(write_module, HELPER_MOD, HELPER_MODEL)
    run_case(
        plain,
        dec,
        "M()",
        [("guarded", (V3[:2],)), ("guarded", (V3,)), ("guarded", (V3[:1],))],
        extra=("guarded", (V3,)),
    )


# ======================================================================================
# 3. Copies of the model made inside methods, written in lax bodies, returned
# ======================================================================================

COPIES = """
@DECORATE
class Sub:
    def __init__(self, k):
        self.k = jnp.asarray(k)
        self.s = jnp.zeros(())

    def bump(self, x):
        self.s = self.s + x * self.k
        return self.s


@DECORATE
class M:
    def __init__(self):
        self.x = jnp.zeros(())
        self.sub = Sub(2.0)

    def _inc(self, v):
        self.x = self.x + v
        return self.x

    def shallow_scan(self, xs):
        other = copy.copy(self)
        def body(c, v):
            return c + other._inc(v), other.x
        c, ys = lax.scan(body, 0.0, xs)
        self.x = self.x + 100.0
        return c, ys, other.x, self.x

    def deep_fori(self, v):
        twin = copy.deepcopy(self)
        def body(i, c):
            twin.sub.bump(v)
            return c + twin._inc(i * v)
        c = lax.fori_loop(0, 3, body, 0.0)
        return c, twin.sub.s, self.sub.s, twin.x, self.x

    def shallow_sub_shared(self, v):
        other = copy.copy(self)
        other.sub.bump(v)          # a shallow copy shares the sub-model
        other._inc(v)
        return self.sub.s, other.x, self.x

    def deep_sub_in_cond(self, v):
        sub2 = copy.deepcopy(self.sub)
        out = lax.cond(v > 0, sub2.bump, self.sub.bump, v)
        return out, sub2.s, self.sub.s

    def ckpt_copy(self, v):
        other = copy.copy(self)
        g = checkpoint(lambda a: other._inc(a) * 2.0)
        return g(v) + self._inc(v)

    def copy_as_cond_operand(self, v):
        o = copy.deepcopy(self)
        out = lax.cond(v > 0, lambda m: m._inc(v), lambda m: m.x, o)
        return out, o.x, self.x

    def snapshot_copy(self, v):
        self._inc(v)
        saved = copy.deepcopy(self)
        self._inc(v)
        return saved
"""


@pytest.mark.parametrize(
    "name,args",
    [
        ("shallow_scan", (XS,)),
        ("deep_fori", (A2,)),
        ("shallow_sub_shared", (A1,)),
        ("deep_sub_in_cond", (A1,)),
        ("ckpt_copy", (A2,)),
        ("copy_as_cond_operand", (A2,)),
    ],
)
def test_copy_of_self_written_in_lax(
    write_module: Loader, name: str, args: tuple[Any, ...]
) -> None:
    plain, dec = pair(write_module, COPIES)
    run_case(plain, dec, "M()", [(name, args), (name, args)], extra=(name, args))


def test_copy_of_self_returned_from_f(write_module: Loader) -> None:
    plain, dec = pair(write_module, COPIES)
    run_case(plain, dec, "M()", [("snapshot_copy", (A1,)), ("snapshot_copy", (A2,))])


def test_copy_returned_from_f_is_usable_afterwards(write_module: Loader) -> None:
    plain, dec = pair(write_module, COPIES)
    ref = plain.M()
    saved_ref = ref.snapshot_copy(A1)
    f, states = dec.M().functionalize()
    for fn in (f.snapshot_copy, jax.jit(f.snapshot_copy)):
        saved, _ = fn(states, A1)
        same(snapshot(saved_ref), snapshot(saved), "returned copy")
        same(saved_ref._inc(A2), saved._inc(A2), "eager call on the returned copy")
        same(snapshot(saved_ref), snapshot(saved), "returned copy after a call")
        saved_ref = ref.snapshot_copy(A1) if fn is f.snapshot_copy else saved_ref
        ref = plain.M()
        saved_ref = ref.snapshot_copy(A1)


MIN_COPY_SCAN = """
@DECORATE
class M:
    def __init__(self):
        self.x = jnp.zeros(())

    def _inc(self, v):
        self.x = self.x + v
        return self.x

    def run(self, xs):
        other = copy.copy(self)
        c, _ = lax.scan(lambda c, v: (c + other._inc(v), None), 0.0, xs)
        return c, other.x, self.x
"""


def test_copy_made_in_method_written_in_scan_eagerly(write_module: Loader) -> None:
    plain, dec = pair(write_module, MIN_COPY_SCAN)
    run_case(plain, dec, "M()", [("run", (XS,))], modes=("eager",))


def test_copy_made_in_method_written_in_scan_through_f(write_module: Loader) -> None:
    # plain: (4.0, 3.0, 0.0) for xs = [0.5, -1, 2, 1.5]; f and jit(f) raised
    # UnexpectedTracerError before the copy's states were threaded.
    plain, dec = pair(write_module, MIN_COPY_SCAN)
    run_case(plain, dec, "M()", [("run", (XS,))], modes=("f", "jit"))


# ======================================================================================
# 4. Closures kept on the model, called later in lax bodies
# ======================================================================================

CLOSURES = """
@DECORATE
class M:
    def __init__(self):
        self.x = jnp.zeros(())
        self.y = jnp.zeros(())
        self.hooks = []
        def init_hook(v):
            self.y = self.y + v * 3.0
            return self.y
        self.init_hook = init_hook
        self.hooks.append(self.make(2.0))
        self.hooks.append(self.make(-1.0))

    def make(self, k):
        def hook(v):
            self.x = self.x + k * v
            return self.x
        return hook

    def scan_hooks(self, xs):
        def body(c, v):
            for h in self.hooks:
                c = c + h(v)
            return c, self.x + self.y
        return lax.scan(body, 0.0, xs)

    def ckpt_hook(self, v):
        return checkpoint(self.hooks[0])(v) * checkpoint(self.hooks[1])(v)

    def cond_hooks(self, v):
        return lax.cond(v > 0, self.hooks[1], self.hooks[0], v)

    def init_hook_in_cond(self, v):
        return lax.cond(v > 0, self.hooks[1], self.init_hook, v)

    def init_hook_direct(self, v):
        return self.init_hook(v)

    def fresh_closure_in_fori(self, v):
        bump = self.make(v)
        return lax.fori_loop(0, 4, lambda i, c: c + bump(i * 1.0), 0.0)
"""


@pytest.mark.parametrize(
    "name,args",
    [
        ("scan_hooks", (XS,)),
        ("ckpt_hook", (A2,)),
        ("cond_hooks", (A1,)),
        ("cond_hooks", (-A1,)),
        ("fresh_closure_in_fori", (A2,)),
    ],
)
def test_closures_kept_on_the_model_called_in_lax(
    write_module: Loader, name: str, args: tuple[Any, ...]
) -> None:
    plain, dec = pair(write_module, CLOSURES)
    run_case(plain, dec, "M()", [(name, args), (name, args)], extra=(name, args))


def test_closures_kept_on_the_model_under_grad(write_module: Loader) -> None:
    plain, dec = pair(write_module, CLOSURES)
    check_transform(plain, dec, "M()", [("scan_hooks", (X,)), ("ckpt_hook", (A1,))], XS, "grad")


def test_closure_made_in_init_writes_no_state(write_module: Loader) -> None:
    # A closure defined in __init__ is part of __init__: what it assigns is not state. Eagerly
    # outside lax it is plain Python; traced (a lax body, f) it is the documented guard.
    plain, dec = pair(write_module, CLOSURES)
    run_case(plain, dec, "M()", [("init_hook_direct", (A2,))], modes=("eager",))
    with pytest.raises(autostate.errors.StateAccessError) as e:
        dec.M().init_hook_in_cond(-A1)
    user_line(e.value, dec, "self.y = self.y + v * 3.0")
    f, states = dec.M().functionalize()
    for fn in (f.init_hook_direct, jax.jit(f.init_hook_direct), f.init_hook_in_cond):
        with pytest.raises(autostate.errors.StateAccessError) as e:
            fn(states, -A1)
        user_line(e.value, dec, "self.y = self.y + v * 3.0")


# ======================================================================================
# 5. partial, methodcaller, getattr / setattr with computed names, vars(self) in lax
# ======================================================================================

DYNAMIC = """
import operator


@DECORATE
class M:
    def __init__(self):
        self.acc0 = jnp.zeros(())
        self.acc1 = jnp.zeros(())
        self.acc2 = jnp.zeros(())
        self.scale = jnp.asarray(1.5)
        self.names = ("acc0", "acc1", "acc2")

    def _touch(self):
        self.acc0 = self.acc0
        self.acc1 = self.acc1
        self.acc2 = self.acc2

    def step(self, c, x, k=1.0):
        self.acc0 = self.acc0 + x * k
        return c + self.acc0, self.acc0

    def partial_scan(self, xs):
        return lax.scan(functools.partial(self.step, k=self.scale), 0.0, xs)

    def methodcaller_fori(self, x):
        call = operator.methodcaller("step", 0.0, x, k=2.0)
        return lax.fori_loop(0, 3, lambda i, c: c + call(self)[0], 0.0)

    def getattr_cond(self, x, which):
        name = ["ste", "p"]
        fn = getattr(self, "".join(name))
        other = getattr(type(self), "st" + "ep")
        return lax.cond(which, lambda v: fn(0.0, v)[0], lambda v: other(self, 1.0, v, 3.0)[1], x)

    def setattr_loop(self, xs):
        def body(c, x):
            for i, n in enumerate(self.names):
                setattr(self, n, getattr(self, n) + x * (i + 1))
            total = sum(v for k, v in vars(self).items() if k.startswith("acc"))
            return c + total, self.__dict__["acc2"]
        return lax.scan(body, 0.0, xs)

    def dict_write_in_body(self, x):
        def body(i, c):
            vars(self)["acc1"] = self.acc1 + x
            self.__dict__.update(acc2=self.acc2 - x)
            return c + self.acc1 * self.acc2
        return lax.fori_loop(0, 3, body, 0.0)

    def tree_partial_scan(self, xs):
        return lax.scan(jax.tree_util.Partial(self.step, k=0.5), 0.0, xs)
"""


@pytest.mark.parametrize(
    "name,args",
    [
        ("partial_scan", (XS,)),
        ("methodcaller_fori", (A1,)),
        ("getattr_cond", (A2, True)),
        ("getattr_cond", (A2, False)),
        ("setattr_loop", (XS,)),
        ("dict_write_in_body", (A2,)),
        ("tree_partial_scan", (XS,)),
    ],
)
def test_dynamic_roads_in_lax(write_module: Loader, name: str, args: tuple[Any, ...]) -> None:
    plain, dec = pair(write_module, DYNAMIC)
    run_case(plain, dec, "M()", [(name, args), (name, args)], extra=(name, args))


def test_dynamic_roads_under_vmap(write_module: Loader) -> None:
    plain, dec = pair(write_module, DYNAMIC)
    xs = jnp.stack([XS, XS * -0.5])
    check_transform(plain, dec, "M()", [("partial_scan", (X,)), ("setattr_loop", (X,))], xs, "vmap")


# ======================================================================================
# 6. Static and class methods taking the instance, property setters, in lax and vmap
# ======================================================================================

DESCRIPTORS = """
def _get_shift(self):
    return self._shift


def _set_shift(self, v):
    self._shift = jnp.tanh(v)


@DECORATE
class M:
    def __init__(self):
        self._scale = jnp.asarray(1.0)
        self.count = jnp.zeros((), jnp.int32)
        self.total = jnp.zeros(())
        self._shift = jnp.zeros(())

    shift = property(_get_shift, _set_shift)  # accessors defined outside the class

    def clear(self):  # makes `total` state: the static / class methods have no receiver
        self.total = self.total * 0.0

    @property
    def scale(self):
        return self._scale

    @scale.setter
    def scale(self, v):
        self._scale = jnp.clip(v, 0.25, 4.0)
        self.count += 1

    @staticmethod
    def bump(m, x):
        m.total = m.total + x * m.scale
        return m.total

    @classmethod
    def reset(cls, m):
        m.total = jnp.zeros(())
        return cls.bump(m, 1.0)

    def set_in_scan(self, xs):
        def body(c, x):
            self.scale = self.scale * (1.0 + x)
            return c + M.bump(self, x), self.scale
        return lax.scan(body, 0.0, xs)

    def static_in_cond(self, x):
        return lax.cond(x > 0, functools.partial(type(self).bump, self),
                        lambda v: type(self).reset(self) * v, x)

    def set_plain(self, x):
        self.scale += x
        self.shift = self.shift + x
        return self.bump(self, x) + self.scale + self.shift

    def shift_in_fori(self, x):
        def body(i, c):
            self.shift = self.shift - x * i
            return c + self.shift
        return lax.fori_loop(0, 3, body, 0.0)
"""


@pytest.mark.parametrize(
    "name,args",
    [
        ("set_in_scan", (XS,)),
        ("static_in_cond", (A2,)),
        ("static_in_cond", (-A2,)),
        ("set_plain", (A2,)),
        ("shift_in_fori", (A2,)),
    ],
)
def test_static_class_methods_and_setters_in_lax(
    write_module: Loader, name: str, args: tuple[Any, ...]
) -> None:
    plain, dec = pair(write_module, DESCRIPTORS)
    run_case(plain, dec, "M()", [(name, args), (name, args)], extra=(name, args))


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
    check_transform(plain, dec, "M()", [("set_in_scan", (X,))], jnp.stack([XS, XS * 0.1]), "vmap")
    check_transform(plain, dec, "M()", [("set_in_scan", (X,))], XS * 0.1, "grad")


# ======================================================================================
# 7. super() chains through mixins, a lambda in a mixin's body, lax over them
# ======================================================================================

MIXINS = """
def _mix_b_step(self, x):
    self.b = self.b + x
    return super(MixB, self).step(x) * 2.0


class MixA:
    def step(self, x):
        self.a = self.a + x
        return self.a

    peek = lambda self, v: self.a * v + self.b
    bump_b = lambda self, v, name="b": setattr(self, name, getattr(self, name) + v)


class MixB(MixA):
    step = _mix_b_step


class MixC(MixA):
    def step(self, x):
        self.c = self.c * 0.5 + x
        return super().step(x) + self.c


@DECORATE
class M(MixB, MixC):
    def __init__(self):
        self.a = jnp.zeros(())
        self.b = jnp.zeros(())
        self.c = jnp.ones(())
        self.n = jnp.zeros((), jnp.int32)

    def step(self, x):
        self.n += 1
        return super().step(x) + self.peek(x)

    def scan(self, xs):
        def body(carry, x):
            self.bump_b(x)
            return carry + self.step(x), self.peek(2.0)
        return lax.scan(body, 0.0, xs)

    def ckpt(self, x):
        return checkpoint(self.step)(x) + checkpoint(self.peek)(x)


class Sub(M):
    def step(self, x):
        out = super().step(x)
        self.bump_b(-0.5)
        return out
"""


@pytest.mark.parametrize(
    "build,name,args",
    [
        ("M()", "step", (A2,)),
        ("M()", "scan", (XS,)),
        ("M()", "ckpt", (A1,)),
        ("Sub()", "scan", (XS,)),
        ("Sub()", "ckpt", (A2,)),
    ],
)
def test_super_chain_through_mixins_with_lambdas(
    write_module: Loader, build: str, name: str, args: tuple[Any, ...]
) -> None:
    plain, dec = pair(write_module, MIXINS)
    run_case(plain, dec, build, [(name, args), (name, args)], extra=(name, args))


def test_super_chain_through_mixins_under_grad(write_module: Loader) -> None:
    plain, dec = pair(write_module, MIXINS)
    check_transform(plain, dec, "Sub()", [("scan", (X,)), ("ckpt", (A1,))], XS, "grad")


# ======================================================================================
# 8. A sub-model replaced inside a method, then read
# ======================================================================================

REPLACE = """
@DECORATE
class Leaf:
    def __init__(self, k):
        self.k = jnp.asarray(k)
        self.n = jnp.zeros(())

    def __call__(self, x):
        self.n = self.n + x * self.k
        return self.n


def _swap(self, k):
    self.leaf = Leaf(k)
    return self.leaf(1.0)


def keep(fn):
    @functools.wraps(fn)
    def wrapper(self, *a):
        return fn(self, *a)
    return wrapper


@DECORATE
class Net:
    def __init__(self):
        self.leaf = Leaf(1.0)
        self.spare = Leaf(5.0)

    swap = keep(_swap)

    def rotate(self):
        self.leaf, self.spare = self.spare, self.leaf
        return self.leaf.k

    def __call__(self, x):
        return self.leaf(x) + self.spare(x * 0.5)


class Child(Net):
    pass
"""


def test_sub_model_replaced_eagerly_then_functionalized(write_module: Loader) -> None:
    plain, dec = pair(write_module, REPLACE)
    ref, model = plain.Child(), dec.Child()
    for m in (ref, model):
        m(A1)
        m.swap(3.0)
        m(A2)
        m.rotate()
        m(A1)
    same(snapshot(ref), snapshot(model), "eager")
    f, states = model.functionalize()
    assert sorted(states) == ["leaf.n", "spare.n"]
    out, states = jax.jit(lambda f, s, x: f(s, x))(f, states, A2)
    same(ref(A2), out, "jit after eager swaps")
    same(snapshot(ref), snapshot(autostate.freeze(f, states)), "frozen")


def test_sub_model_replaced_inside_f_is_the_documented_error(write_module: Loader) -> None:
    _, dec = pair(write_module, REPLACE)
    f, states = dec.Child().functionalize()
    for fn, args, text in (
        (f.swap, (3.0,), "self.leaf = Leaf(k)"),
        (jax.jit(f.swap, static_argnums=1), (3.0,), "self.leaf = Leaf(k)"),
        (f.rotate, (), "self.leaf, self.spare = self.spare, self.leaf"),
    ):
        with pytest.raises(autostate.errors.StateAccessError) as e:
            fn(states, *args)
        user_line(e.value, dec, text)
    out, states2 = f(states, A1)  # f still usable
    same(jnp.asarray(1.0 + 2.5), out, "f after the refused swap")


# ======================================================================================
# 9. jax.vmap inside a method over closures reading / writing state
# ======================================================================================

VMAP_INSIDE = """
def _read_after_write(self, xs):
    self.n = self.n + 1.0
    return jax.vmap(lambda x: x * self.w + self.n)(xs)


@DECORATE
class M:
    def __init__(self):
        self.w = jnp.asarray(2.0)
        self.n = jnp.zeros(())

    read_after_write = _read_after_write

    def in_scan(self, xs):
        def body(c, x):
            self.n = self.n + x
            ys = jax.vmap(lambda v: v * self.n)(jnp.arange(3.0))
            return c + ys.sum(), self.n
        return lax.scan(body, 0.0, xs)

    def write_in_vmap(self, xs):
        def g(x):
            self.n = self.n + x
            return x
        return jax.vmap(g)(xs)
"""


def test_vmap_inside_method_reading_state(write_module: Loader) -> None:
    plain, dec = pair(write_module, VMAP_INSIDE)
    run_case(
        plain,
        dec,
        "M()",
        [("read_after_write", (V3,)), ("in_scan", (XS,)), ("read_after_write", (V3,))],
        extra=("in_scan", (XS,)),
    )


def test_vmap_inside_method_writing_state_is_the_documented_escape(write_module: Loader) -> None:
    _, dec = pair(write_module, VMAP_INSIDE)
    f, states = dec.M().functionalize()
    for fn in (
        dec.M().write_in_vmap,
        functools_partial(f.write_in_vmap, states),
        functools_partial(jax.jit(f.write_in_vmap), states),
    ):
        with pytest.raises(autostate.AutostateError) as e:
            fn(V3)
        assert isinstance(
            e.value, autostate.errors.EscapedStateError | autostate.errors.TracedEagerStateError
        ), repr(e.value)
        assert "fix" in str(e.value) and ".py:" in str(e.value), str(e.value)


def functools_partial(fn: Callable[..., Any], *a: Any) -> Callable[..., Any]:
    return lambda *b: fn(*a, *b)


# ======================================================================================
# 10. Exceptions after writes, through wrapped / inherited / helper roads
# ======================================================================================

RAISES = """
def guard(fn):
    @functools.wraps(fn)
    def wrapper(self, x, *rest):
        try:
            return fn(self, x, *rest)
        except FloatingPointError:
            self.errors += 1
            return -1.0 * self.a
    return wrapper


def _risky(self, x, limit):
    self.a = self.a + x
    if limit < 0:
        raise FloatingPointError("limit")
    self.b = self.b + x * limit
    return self.a + self.b


@DECORATE
class Inner:
    def __init__(self):
        self.a = jnp.zeros(())
        self.b = jnp.zeros(())
        self.errors = jnp.zeros((), jnp.int32)

    risky = guard(_risky)
    raw = _risky


class Outer(Inner):
    def __init__(self):
        super().__init__()
        self.kid = Inner()
        self.caught = jnp.zeros((), jnp.int32)

    def __call__(self, x, limit):
        out = self.risky(x, limit) + self.kid.risky(x * 2.0, limit)
        try:
            out = out + self.kid.raw(x, limit)
        except FloatingPointError:
            self.caught = self.caught + 1
        return out, self.kid.a, self.kid.b
"""


def test_raise_after_writes_caught_by_wrapper_and_caller(write_module: Loader) -> None:
    plain, dec = pair(write_module, RAISES)
    calls = [("__call__", (A1, 2.0)), ("__call__", (A2, -1.0)), ("__call__", (A1, 3.0))]
    run_case(plain, dec, "Outer()", calls, modes=("eager", "f"), extra=calls[1])
    # under jit the Python `limit` must be static
    ref = plain.Outer()
    f, states = dec.Outer().functionalize()
    step = jax.jit(lambda f, s, x, limit: f(s, x, limit), static_argnums=3)
    for _, (x, limit) in calls:
        out, states = step(f, states, x, limit)
        same(ref(x, limit), out, "jit output")
    for key, value in states.items():
        same(snapshot(plain_path(ref, key)), snapshot(value), f"jit state {key}")


def test_raise_after_writes_out_of_f_leaves_states(write_module: Loader) -> None:
    plain, dec = pair(write_module, RAISES)
    ref, model = plain.Outer(), dec.Outer()
    for m in (ref, model):
        m(A1, 2.0)
        with pytest.raises(FloatingPointError):
            m.raw(A2, -1.0)
    same(snapshot(ref), snapshot(model), "eager keeps the partial write")
    f, states = dec.Outer().functionalize()
    _, states = f(states, A1, 2.0)
    given = {k: np.asarray(v) for k, v in states.items()}
    for fn in (f.raw, jax.jit(f.raw, static_argnums=2)):
        with pytest.raises(FloatingPointError):
            fn(states, A2, -1.0)
        same(given, {k: np.asarray(v) for k, v in states.items()}, "states unchanged")
    out, _ = f(states, A1, 2.0)
    ref2 = plain.Outer()
    ref2(A1, 2.0)
    same(ref2(A1, 2.0), out, "f usable after the raise")


RAISE_IN_LAX = """
def _body(self, c, x):
    self.t = self.t + x
    if c is None:
        raise ArithmeticError("body")
    return c + self.t, None


@DECORATE
class Base:
    def __init__(self):
        self.t = jnp.zeros(())

    body = (lambda fn: functools.wraps(fn)(lambda self, *a: fn(self, *a)))(_body)


class M(Base):
    def run(self, xs):
        try:
            lax.scan(lambda c, x: self.body(None, x), 0.0, xs)
        except ArithmeticError:
            pass
        return self.t

    def run_then_assign(self, xs):
        try:
            lax.scan(self.body, None, xs)
        except ArithmeticError:
            self.t = jnp.asarray(-1.0)
        return self.t
"""


def test_lax_body_raising_after_write_through_inherited_lambda(write_module: Loader) -> None:
    plain, dec = pair(write_module, RAISE_IN_LAX)
    run_case(plain, dec, "M()", [("run_then_assign", (XS,))], extra=("run_then_assign", (XS,)))
    # the documented ControlFlowStateError when the lost value is read
    f, states = dec.M().functionalize()
    for fn in (lambda: dec.M().run(XS), lambda: f.run(states, XS)):
        with pytest.raises(autostate.errors.ControlFlowStateError) as e:
            fn()
        user_line(e.value, dec, "return self.t")


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


# ======================================================================================
# 11. Methods from another module, wrappers writing state, bound methods on the instance
# ======================================================================================

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
    plain, dec, _, _ = pair2(write_module, REMOTE_METHODS, src)
    return plain, dec


@pytest.mark.parametrize(
    "build,name,args",
    [
        ("Direct()", "scan", (XS,)),
        ("M()", "scan", (XS,)),
        ("M()", "fori", (A2,)),
        ("M()", "__call__", (A2,)),
        ("M()", "both", (XS,)),
    ],
)
def test_methods_from_another_module(
    write_module: Loader, build: str, name: str, args: tuple[Any, ...]
) -> None:
    plain, dec = _remote(write_module)
    run_case(plain, dec, build, [(name, args), (name, args)], extra=(name, args))


def test_methods_from_another_module_under_grad(write_module: Loader) -> None:
    plain, dec = _remote(write_module)
    check_transform(plain, dec, "M()", [("both", (X,)), ("__call__", (A1,))], XS, "grad")


# ======================================================================================
# 12. A copy JAX makes of a sub-model (tree_map / stop_gradient) written in a lax body
# ======================================================================================

# Plain Python has no reference here (an undecorated object is a pytree leaf, so tree_map
# returns it unchanged); docs/control_flow.md ("Stacked sub-models") promises that a write
# to such a copy where the method runs "stays the copy's, in f and under jit as eagerly".
JAX_COPY = """
@DECORATE
class Sub:
    def __init__(self):
        self.s = jnp.zeros(())

    def bump(self, x):
        self.s = self.s + x
        return self.s


@DECORATE
class M:
    def __init__(self):
        self.sub = Sub()

    def direct(self, xs):
        t = jax.tree_util.tree_map(lambda a: a, self.sub)
        for i in range(xs.shape[0]):
            t.bump(xs[i])
        return t.s, self.sub.s

    def in_scan(self, xs):
        t = jax.tree_util.tree_map(lambda a: a, self.sub)
        lax.scan(lambda c, v: (t.bump(v), None), 0.0, xs)
        return t.s, self.sub.s

    def in_fori(self, xs):
        t = jax.lax.stop_gradient(self.sub)
        lax.fori_loop(0, 3, lambda i, c: t.bump(xs[i]), 0.0)
        return t.s, self.sub.s
"""


def _jax_copy_modes(dec: types.ModuleType, name: str) -> list[Any]:
    model = dec.M()
    got = [(getattr(model, name)(V3), {"sub.s": model.sub.s})]
    f, states = dec.M().functionalize()
    got.append(getattr(f, name)(states, V3))
    got.append(jax.jit(getattr(f, name))(states, V3))
    return got


# (in_scan and in_fori wrote the original's state through f before the
# copy's states were threaded.)
@pytest.mark.parametrize("name", ["direct", "in_scan", "in_fori"])
def test_jax_made_copy_of_sub_model_written_in_lax(write_module: Loader, name: str) -> None:
    _, dec = pair(write_module, JAX_COPY)
    expected = ((jnp.asarray(3.0), jnp.asarray(0.0)), {"sub.s": jnp.asarray(0.0)})
    for mode, got in zip(("eager", "f", "jit"), _jax_copy_modes(dec, name), strict=True):
        same(expected, got, mode)


# ======================================================================================
# 13. jax.vmap of f against a per-example loop of plain models (batched predicates)
# ======================================================================================


def check_vmap_loop(
    plain: types.ModuleType,
    dec: types.ModuleType,
    build: str,
    calls: list[tuple[str, tuple[Any, ...]]],
    xs: Any,
) -> None:
    """``jax.vmap`` (and ``jit(vmap)``) of the calls through ``f`` over ``xs``, against one
    plain model per example (so a ``lax.cond`` predicate may depend on the example)."""
    model = eval(build, vars(dec))  # noqa: S307
    f, states0 = model.functionalize()
    keys = sorted(states0)
    per_example = []
    for i in range(xs.shape[0]):
        m = eval(build, vars(plain))  # noqa: S307
        outs = [_call(m, n)(*[xs[i] if v is X else v for v in a]) for n, a in calls]
        per_example.append((outs, {k: plain_path(m, k) for k in keys}))
    expected = jax.tree_util.tree_map(lambda *v: jnp.stack(v), *per_example)

    def dec_fn(xv: Any) -> Any:
        s, outs = states0, []
        for n, a in calls:
            out, s = _call(f, n)(s, *[xv if v is X else v for v in a])
            outs.append(out)
        return outs, s

    same(expected, jax.vmap(dec_fn)(xs), "vmap")
    same(expected, jax.jit(jax.vmap(dec_fn))(xs), "jit vmap")


def test_vmap_of_f_with_inherited_wrapped_methods_in_cond_and_switch(write_module: Loader) -> None:
    plain, dec = pair(write_module, OUTSIDE_WRAPPED)
    # __call__ takes both cond branches depending on the example (ys[0] > 0, -ys[-1] > 0)
    xs = jnp.array([[1.0, -2.0, 0.5], [-0.25, 0.5, -3.0], [-1.0, -1.0, -1.0]])
    check_vmap_loop(plain, dec, "GrandChild()", [("__call__", (X,)), ("__call__", (X,))], xs)
    check_vmap_loop(plain, dec, "Child()", [("branch", (X,)), ("branch", (X,))], xs[:, 0])


WHILE_MODEL = """
def _keep_going(self, c):
    return (self.steps < self.limit) & (c < 50.0)


def _advance(self, c):
    self.steps += 1
    self.trace = self.trace.at[self.steps % 4].set(c)
    return c * 2.0 + 1.0


class Loops:
    keep_going = _keep_going
    advance = _advance


@DECORATE
class M(Loops):
    def __init__(self):
        self.steps = jnp.zeros((), jnp.int32)
        self.limit = jnp.asarray(5, jnp.int32)
        self.trace = jnp.zeros(4)

    def _touch(self):
        self.steps = self.steps
        self.trace = self.trace

    def run(self, c):
        return lax.while_loop(self.keep_going, self.advance, c)

    def mapped(self, xs):
        return lax.map(self.advance, xs)
"""


def test_while_loop_over_bound_methods_of_an_undecorated_base(write_module: Loader) -> None:
    plain, dec = pair(write_module, WHILE_MODEL)
    run_case(
        plain,
        dec,
        "M()",
        [("run", (A1,)), ("run", (jnp.asarray(30.0),)), ("mapped", (XS,))],
        extra=("run", (A2,)),
    )
    check_vmap_loop(
        plain, dec, "M()", [("run", (X,)), ("run", (X,))], jnp.array([0.0, 3.0, 20.0, 60.0])
    )


# ======================================================================================
# 14. Nested roads: scan -> bound method -> fori_loop -> closure over a shared sub-model
# ======================================================================================

NESTED = """
@DECORATE
class Counter:
    def __init__(self):
        self.n = jnp.zeros(())
        self.k = jnp.asarray(0.5)

    def add(self, v):
        self.n = self.n + v * self.k
        return self.n


def inner_loop(self, x):
    def body(i, c):
        for ctr in self.counters:
            c = c + ctr.add(x + i)
        return c
    return lax.fori_loop(0, 2, body, 0.0)


@DECORATE
class M:
    def __init__(self):
        shared = Counter()
        self.counters = [shared, Counter(), shared]
        self.alias = shared
        self.total = jnp.zeros(())

    inner = inner_loop

    def step(self, c, x):
        y = checkpoint(self.inner)(x)
        self.total = self.total + y
        return c + y, self.alias.n

    def __call__(self, xs):
        c, ys = lax.scan(self.step, 0.0, xs)
        pick = lax.switch(jnp.argmax(xs) % 3, [self.counters[0].add, self.counters[1].add,
                                                self.alias.add], c)
        return c, ys, pick
"""


def test_nested_lax_checkpoint_aliased_sub_models(write_module: Loader) -> None:
    plain, dec = pair(write_module, NESTED)
    run_case(
        plain,
        dec,
        "M()",
        [("__call__", (XS,)), ("__call__", (XS[::-1],))],
        extra=("__call__", (XS,)),
    )
    model = dec.M()
    assert sorted(model.functionalize()[1]) == ["counters[0].n", "counters[1].n", "total"]


def test_nested_lax_checkpoint_aliased_sub_models_grad_vmap(write_module: Loader) -> None:
    plain, dec = pair(write_module, NESTED)
    check_transform(plain, dec, "M()", [("__call__", (X,))], XS, "grad")
    check_vmap_loop(plain, dec, "M()", [("__call__", (X,))], jnp.stack([XS, XS[::-1] * 2.0]))


# ======================================================================================
# 15. Methods set on the class after its statement (before the first instance), wrapped
# ======================================================================================

LATE_METHODS = """
def logged(fn):
    @functools.wraps(fn)
    def wrapper(self, *a):
        return fn(self, *a)
    return wrapper


@DECORATE
class M:
    def __init__(self):
        self.w = jnp.asarray(1.5)
        self.h = jnp.zeros(())
        self.extra = 0.0

    def _touch(self):
        self.h = self.h


def _cell(self, c, x):
    self.h = jnp.tanh(self.h * self.w + x)
    return c + self.h, self.h


M.cell = logged(_cell)
setattr(M, "run", lambda self, xs: LAXW.scan(LAXW.checkpoint(self.cell), 0.0, xs))
M.run_jax = lambda self, xs: lax.scan(self.cell, 0.0, xs)  # a lambda is not rewritten
M.named = logged(lambda self, name, v: setattr(self, name, v))
"""


def test_methods_set_after_the_class_statement_in_checkpointed_scan(write_module: Loader) -> None:
    plain, dec = pair(write_module, LATE_METHODS)
    if not hasattr(dec.M, "cell"):
        pytest.skip("module did not load")
    ref, model = plain.M(), dec.M()
    same(ref.run(XS), model.run(XS), "eager")
    same(snapshot(ref), snapshot(model), "eager attributes")
    f, states = dec.M().functionalize()
    ref = plain.M()
    for fn in (f.run, jax.jit(f.run)):
        out, states = fn(states, XS)
        same(ref.run(XS), out, "f / jit")
        same(snapshot(ref.h), snapshot(states["h"]), "state h")
    check_transform(plain, dec, "M()", [("run", (X,))], XS, "grad")


def test_lax_in_a_lambda_method_is_the_documented_error(write_module: Loader) -> None:
    _, dec = pair(write_module, LATE_METHODS)
    with pytest.raises(autostate.errors.TracedEagerStateError) as e:
        dec.M().run_jax(XS)
    user_line(e.value, dec, "self.h = jnp.tanh(self.h * self.w + x)")
    assert "autostate.scan" in str(e.value)
    f, states = dec.M().functionalize()
    with pytest.raises(autostate.errors.EscapedStateError) as e:
        f.run_jax(states, XS)
    assert "autostate.scan" in str(e.value) and f"{__file__}:" in str(e.value)


def test_late_setattr_with_computed_name_on_a_non_state_is_refused(write_module: Loader) -> None:
    _, dec = pair(write_module, LATE_METHODS)
    f, states = dec.M().functionalize()
    with pytest.raises(autostate.errors.StateAccessError) as e:
        jax.jit(f.named, static_argnums=1)(states, "extra", A1)
    user_line(e.value, dec, "M.named = logged(lambda self, name, v: setattr(self, name, v))")
    out, new = f.named(states, "h", A2)  # a state by a computed name: fine
    same({"h": A2}, new, "computed-name write to a state")
