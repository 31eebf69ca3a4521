"""Differential bug hunt 14: every road to state that is not a plain method call.

- Closures a method returns that capture ``self`` and write state: called in
  the same call, after the method returned (eagerly, and after ``f``
  returned), stored in a state.
- PyTorch-style hooks: lists and ``OrderedDict``s of callables on the model,
  registered from outside after construction (module functions taking the
  model, the model's own bound methods, lambdas and nested functions closing
  over the model, another model's bound method), called in ``__call__``.
- Dispatch tables built in the class body (original, unrewritten functions),
  ``functools.partialmethod``, ``functools.singledispatchmethod``,
  ``getattr(self, name)()`` with computed names, ``operator.methodcaller``,
  ``map(self.step, xs)``, ``sorted(xs, key=self.score)`` with a score that
  writes state, ``functools.reduce``, ``jax.tree_util.tree_map(self.bump, ...)``.
- Code outside the class: module-level helpers and helpers in another module
  that read and write ``model.x``, a method of another decorated class
  called with this model as receiver.
- Transformations inside methods: ``jax.jit`` / ``jax.vmap`` /
  ``jax.eval_shape`` of a method that writes state (the documented escape),
  the same reading only; ``jax.checkpoint`` of a ``functools.partial`` and
  with ``static_argnums``; ``lax.scan`` over a body reached by ``getattr``,
  a class-body table, ``functools.partial`` or ``operator.methodcaller``;
  ``jax.lax.associative_scan`` and ``jax.named_call`` of state-writing
  methods; a locally aliased ``lax.scan``.
- Several models: a model method passed as a callback to another model's
  method (called in a loop, in ``lax.scan`` and ``fori_loop``), a parent's
  method passed down to a child, a sub-model reached through two paths and
  through a stored callback, under ``grad`` and ``vmap``.
- Generators and context managers: generator methods (the documented
  decoration error), module-level generators that write ``model.x`` between
  yields consumed inside a method, context-manager objects that write state
  on enter and exit (``with model.mode():``), ``__getattr__`` forwarding.

Each source is written plain and decorated (``differential.pair``; ``lax.*``
is a Python loop in the plain module); a case that shows a mismatch stays,
marked ``xfail(strict=True)`` with what differs.
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
    X,
    _fcall,
    assert_same,
    assert_user_line,
    check,
    check_transform,
    pair,
    snapshot,
)

import autostate
from autostate.errors import (
    DecorationError,
    EscapedStateError,
    StateAccessError,
    TracedEagerStateError,
    UnhandledLocalStateError,
)

Loader = Callable[..., types.ModuleType]

X1 = jnp.float32(1.5)
X2 = jnp.float32(2.0)
XS = jnp.arange(1.0, 4.0)


def no_tracer(model: Any) -> None:
    assert not autostate.lifetime.contains_tracer(snapshot(model)), "tracer leaked into the model"


def modes_of(f: Any, method: str) -> list[Callable[..., Any]]:
    call = _fcall(f, method)
    return [call, jax.jit(call)]


# ======================================================================================
# 1. Closures returned by methods
# ======================================================================================

CLOSURES = """
@DECORATE
class Acc:
    def __init__(self):
        self.w = jnp.asarray(2.0)
        self.n = jnp.zeros(())
        self.hist = jnp.zeros(3)

    def make_bumper(self, k):
        def bump(x):
            self.n = self.n + x * k
            self.hist = jnp.roll(self.hist, 1).at[0].set(self.n)
            return self.n * self.w
        return bump

    def make_lambda(self):
        return lambda x: self._add(x)

    def _add(self, x):
        self.n = self.n + x
        return self.n

    def use_now(self, x):
        b = self.make_bumper(2.0)
        return b(x) + b(x)

    def use_lambda(self, x):
        g = self.make_lambda()
        return g(x) * g(x)

    def closures_in_list(self, x):
        fs = [self.make_bumper(k) for k in (1.0, 2.0, 3.0)]
        return jnp.stack([f(x) for f in fs])

    def closure_in_scan(self, xs):
        b = self.make_bumper(0.5)
        return lax.scan(lambda c, x: (c + b(x), None), jnp.zeros(()), xs)[0]

    def closure_as_scan_body(self, xs):
        def outer(k):
            def body(c, x):
                self.n = self.n + x * k
                return c + self.n, self.n
            return body
        return lax.scan(outer(3.0), jnp.zeros(()), xs)

    def closure_in_cond(self, x):
        up, down = self.make_bumper(1.0), self.make_bumper(-1.0)
        return lax.cond(x > 1.6, up, down, x)

    def closure_in_checkpoint(self, x):
        return checkpoint(self.make_bumper(2.0))(x) + self.n
"""

CLOSURE_CALLS = {
    "use_now": [("use_now", (X1,)), ("use_now", (X2,))],
    "use_lambda": [("use_lambda", (X1,)), ("use_lambda", (X2,))],
    "closures_in_list": [("closures_in_list", (X1,))],
    "closure_in_scan": [("closure_in_scan", (XS,)), ("closure_in_scan", (XS,))],
    "closure_as_scan_body": [("closure_as_scan_body", (XS,))],
    "closure_in_cond": [("closure_in_cond", (X1,)), ("closure_in_cond", (X2,))],
    "closure_in_checkpoint": [("closure_in_checkpoint", (X1,))],
}


@pytest.mark.parametrize("case", sorted(CLOSURE_CALLS))
def test_closures_returned_by_methods_and_called_in_the_call(
    write_module: Loader, case: str
) -> None:
    plain, dec = pair(write_module, CLOSURES)
    check(plain, dec, "Acc()", CLOSURE_CALLS[case])


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_closures_under_grad_and_vmap(write_module: Loader, transform: str) -> None:
    plain, dec = pair(write_module, CLOSURES)
    x = X1 if transform == "grad" else jnp.arange(3.0)
    calls = [("use_now", (X,)), ("closure_in_checkpoint", (X,))]
    if transform == "grad":  # the plain reference's Python ``if`` needs a concrete predicate
        calls.append(("closure_in_cond", (X,)))
    check_transform(plain, dec, "Acc()", calls, x, transform)


def test_closure_called_after_the_method_returned_eagerly(write_module: Loader) -> None:
    plain, dec = pair(write_module, CLOSURES)
    p, d = plain.Acc(), dec.Acc()
    bp, bd = p.make_bumper(2.0), d.make_bumper(2.0)
    outs_p = [bp(X1), p._add(X2), bp(X2)]
    outs_d = [bd(X1), d._add(X2), bd(X2)]
    assert_same(outs_p, outs_d, "outputs")
    assert_same(snapshot(p), snapshot(d), "attributes")


def test_closure_returned_by_f_refuses_to_run_after_the_call(write_module: Loader) -> None:
    """Plain Python's closure keeps writing the model after the call; f's model is
    gone when f returns, so calling the closure is the documented unhandled error."""
    _, dec = pair(write_module, CLOSURES)
    f, states = dec.Acc().functionalize()
    bump, new = f.make_bumper(states, 2.0)
    with pytest.raises(UnhandledLocalStateError, match="State 'n'") as info:
        bump(X1)
    assert_user_line(info.value, dec.__file__)
    assert_same(states, new, "states unchanged")


def test_eager_closure_called_inside_jit_refuses_the_traced_write(write_module: Loader) -> None:
    _, dec = pair(write_module, CLOSURES)
    model = dec.Acc()
    bump = model.make_bumper(2.0)
    with pytest.raises(TracedEagerStateError, match="'n'") as info:
        jax.jit(bump)(X1)
    assert_user_line(info.value, dec.__file__)
    no_tracer(model)
    assert_same(np.float32(0.0), model.n, "unchanged")


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
        step = jax.jit(lambda f, s, x: f(s, x)) if jit else (lambda f, s, x: f(s, x))
        outs = []
        for x in (X1, X2):
            out, states = step(f, states, x)
            outs.append(out)
        assert_same(expected, outs, f"outputs jit={jit}")
        assert_same(p.n, states["n"], f"state jit={jit}")
        assert_same(np.float32(0.0), model.n, "the eager model is unchanged")


# ======================================================================================
# 2. Hooks registered from outside
# ======================================================================================

HOOKS = """
import collections
import functools


@DECORATE
class Layer:
    def __init__(self):
        self.w = jnp.asarray(3.0)
        self.n = jnp.zeros(())
        self.seen = jnp.zeros(())
        self.hooks = []
        self.pre = collections.OrderedDict()

    def record(self, y):
        self.seen = self.seen + y
        return None

    def __call__(self, x):
        for h in self.pre.values():
            r = h(x)
            if r is not None:
                x = r
        self.n = self.n + 1
        y = x * self.w
        for h in self.hooks:
            r = h(self, y)
            if r is not None:
                y = r
        return y


@DECORATE
class Pair:
    def __init__(self):
        self.a = Layer()
        self.b = Layer()

    def __call__(self, x):
        return self.b(self.a(x))


def count_hook(m, y):
    m.seen = m.seen + y
    return None


def scale_hook(m, y):
    m.n = m.n * 2
    return y + m.n


def with_hooks(m, *hooks):
    m.hooks.extend(hooks)
    return m


def with_bound_pre(m):
    m.pre["rec"] = m.record
    return m


def with_lambda_pre(m):
    m.pre["lam"] = lambda x: x + m.n
    return m


def with_nested_pre(m):
    def make(model):
        def hook(x):
            model.seen = model.seen + 10 * x
            return None
        return hook
    m.pre["nested"] = make(m)
    return m


def weighted_hook(k, m, y):
    m.seen = m.seen + k * y
    return None


def with_partial_hook(m):
    m.hooks.append(functools.partial(weighted_hook, 3.0))
    return m


def with_foreign_hook(m, other):
    m.hooks.append(lambda mm, y: other.record(y))
    return m


def with_partial_over_model(m):
    m.pre["p"] = functools.partial(count_hook, m)
    return m


def hook_over(model, mm, y):
    model.seen = model.seen + y
    return None


def with_partial_in_list(m):
    m.hooks.append(functools.partial(hook_over, m))
    return m


def cross_hooked():
    p = Pair()
    p.b.pre["from_a"] = p.a.record
    p.a.hooks.append(lambda m, y: p.b.record(y))
    return p
"""

HOOK_BUILDS = {
    "module-functions": "with_hooks(Layer(), count_hook, scale_hook)",
    "bound-method": "with_bound_pre(Layer())",
    "lambda-over-model": "with_lambda_pre(Layer())",
    "nested-function": "with_nested_pre(Layer())",
    "across-models": "cross_hooked()",
    "partial-without-model": "with_partial_hook(Layer())",
}


@pytest.mark.parametrize("case", sorted(HOOK_BUILDS))
def test_hooks_registered_from_outside(write_module: Loader, case: str) -> None:
    plain, dec = pair(write_module, HOOKS)
    check(plain, dec, HOOK_BUILDS[case], [("__call__", (X1,)), ("__call__", (X2,))])


@pytest.mark.parametrize("transform", ["grad", "vmap"])
@pytest.mark.parametrize("case", ["module-functions", "across-models"])
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
        step = jax.jit(lambda f, s, x: f(s, x)) if jit else (lambda f, s, x: f(s, x))
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


ONE_SHOT = (
    HOOKS
    + """

def one_shot(m, y):
    m.n = m.n + 100
    m.hooks.remove(one_shot)
    return None
"""
)


def test_one_shot_hook_eagerly_like_plain(write_module: Loader) -> None:
    plain, dec = pair(write_module, ONE_SHOT)
    check(plain, dec, "with_hooks(Layer(), one_shot)", [("__call__", (X1,))] * 2, modes=("eager",))


def test_one_shot_hook_inside_jit_is_refused(write_module: Loader) -> None:
    """Removing the hook inside a traced call changes the model outside its states:
    the documented StateAccessError naming ``hooks``."""
    _, dec = pair(write_module, ONE_SHOT)
    model = dec.with_hooks(dec.Layer(), dec.one_shot)
    f, states = model.functionalize()
    with pytest.raises(StateAccessError, match="hooks") as info:
        jax.jit(lambda f, s, x: f(s, x))(f, states, X1)
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


HOLDERS = """
import collections


class Plain:
    def __init__(self, model=None):
        self.model = model
        self.w = jnp.ones(())


@DECORATE
class Holder:
    def __init__(self, kind, back):
        self.n = jnp.zeros(())
        make = {"dict": dict, "OrderedDict": collections.OrderedDict,
                "defaultdict": lambda **kw: collections.defaultdict(int, **kw)}[kind]
        self.extra = make(a=Plain(self if back else None))

    def __call__(self, x):
        self.n = self.n + x * self.extra["a"].w
        return self.n
"""


@pytest.mark.parametrize("back", [False, True], ids=["array", "back-reference"])
@pytest.mark.parametrize(
    "kind",
    [
        "dict",
        "OrderedDict",
        "defaultdict",
    ],
)
def test_plain_objects_in_dict_subclasses_are_refused_like_in_a_dict(
    write_module: Loader, kind: str, back: bool
) -> None:
    _, dec = pair(write_module, HOLDERS)
    with pytest.raises(autostate.errors.InvalidTypeError, match=r"extra\['a'\]") as info:
        dec.Holder(kind, back).functionalize()
    assert_user_line(info.value, __file__)


# ======================================================================================
# 3. Dispatch tables, partialmethod, singledispatchmethod, functional builtins
# ======================================================================================

DISPATCH = """
import functools
import operator


@DECORATE
class Disp:
    def __init__(self):
        self.w = jnp.asarray(2.0)
        self.n = jnp.zeros(())
        self.calls = jnp.zeros((), jnp.int32)
        self.names = {"u": "up", "d": "down"}

    def up(self, x):
        self.n = self.n + x
        return self.n

    def down(self, x):
        self.n = self.n - x
        return self.n

    def scaled(self, x, k=1.0):
        self.n = self.n * k + x
        return self.n

    TABLE = {"up": up, "down": down}
    up2 = functools.partialmethod(scaled, k=2.0)

    def via_class_table(self, x):
        return self.TABLE["up"](self, x) + self.TABLE["down"](self, x * 0.5)

    def via_partialmethod(self, x):
        return self.up2(x) * self.w

    def via_getattr(self, x):
        out = jnp.zeros(())
        for key in ("u", "d", "u"):
            out = out + getattr(self, self.names[key])(x)
        return out

    def via_methodcaller(self, x):
        return operator.methodcaller("up", x)(self) + operator.methodcaller("scaled", x, k=3.0)(self)

    def via_attrgetter(self, x):
        self.up(x)
        return operator.attrgetter("n")(self) * self.w

    def via_map(self, xs):
        return jnp.stack(list(map(self.up, xs)))

    def score(self, x):
        self.calls = self.calls + 1
        self.n = self.n + x
        return float(x)

    def via_sorted(self, x):
        vals = [x, x * 3, x * 2]
        order = sorted(vals, key=self.score)
        return jnp.stack(order) + self.n

    def via_reduce(self, xs):
        return functools.reduce(lambda a, b: a + self.up(b), list(xs), jnp.zeros(()))

    def via_tree_map(self, x):
        return jax.tree_util.tree_map(self.up, {"a": x, "b": x * 2})

    def via_partial(self, x):
        return functools.partial(self.scaled, k=0.5)(x) + functools.partial(Disp.up, self)(x)

    def scan_getattr(self, xs):
        body = getattr(self, "body_" + "up")
        return lax.scan(body, jnp.zeros(()), xs)

    def body_up(self, c, x):
        self.n = self.n + x
        return c + self.n, self.n

    BODIES = {"up": body_up}

    def scan_class_table(self, xs):
        return lax.scan(functools.partial(self.BODIES["up"], self), jnp.zeros(()), xs)

    def scan_partial(self, xs):
        def body(k, c, x):
            self.n = self.n + x * k
            return c + self.n, None
        return lax.scan(functools.partial(body, 2.0), jnp.zeros(()), xs)[0]

    def scan_methodcaller(self, xs):
        return lax.scan(lambda c, x: (c + operator.methodcaller("up", x)(self), None),
                        jnp.zeros(()), xs)[0]

    def fori_dispatch(self, x):
        return lax.fori_loop(0, 3, lambda i, c: c + getattr(self, self.names["u"])(x), jnp.zeros(()))
"""

DISPATCH_CASES = {
    "via_class_table": [("via_class_table", (X1,)), ("via_class_table", (X2,))],
    "via_partialmethod": [("via_partialmethod", (X1,)), ("via_partialmethod", (X2,))],
    "via_getattr": [("via_getattr", (X1,)), ("via_getattr", (X2,))],
    "via_methodcaller": [("via_methodcaller", (X1,))],
    "via_attrgetter": [("via_attrgetter", (X1,))],
    "via_map": [("via_map", (XS,)), ("via_map", (XS,))],
    "via_reduce": [("via_reduce", (XS,))],
    "via_tree_map": [("via_tree_map", (X1,))],
    "via_partial": [("via_partial", (X1,)), ("via_partial", (X2,))],
    "scan_getattr": [("scan_getattr", (XS,))],
    "scan_class_table": [("scan_class_table", (XS,))],
    "scan_partial": [("scan_partial", (XS,))],
    "scan_methodcaller": [("scan_methodcaller", (XS,))],
    "fori_dispatch": [("fori_dispatch", (X1,))],
}


@pytest.mark.parametrize("case", sorted(DISPATCH_CASES))
def test_dispatch_roads_to_state(write_module: Loader, case: str) -> None:
    plain, dec = pair(write_module, DISPATCH)
    check(plain, dec, "Disp()", DISPATCH_CASES[case])


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
    calls = [
        ("via_class_table", (X,)),
        ("via_partialmethod", (X,)),
        ("via_getattr", (X,)),
        ("fori_dispatch", (X,)),
    ]
    check_transform(plain, dec, "Disp()", calls, x, transform)


def test_lazy_map_returned_by_f_refuses_to_run_after_the_call(write_module: Loader) -> None:
    """``return map(self.up, xs)``: plain Python writes when it is consumed; f's model
    is gone by then, so consuming it is the documented unhandled-state error."""
    source = (
        DISPATCH
        + """
    def lazy(self, xs):
        return map(self.up, xs)
"""
    )
    plain, dec = pair(write_module, source)
    p, d = plain.Disp(), dec.Disp()
    assert_same(list(p.lazy(XS)), list(d.lazy(XS)), "eager")
    assert_same(snapshot(p), snapshot(d), "eager attributes")
    f, states = dec.Disp().functionalize()
    it, new = f.lazy(states, XS)
    with pytest.raises(UnhandledLocalStateError, match="State 'n'") as info:
        list(it)
    assert_user_line(info.value, dec.__file__)
    assert_same(states, new, "states unchanged")


SINGLEDISPATCH = """
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
    plain, dec = pair(write_module, SINGLEDISPATCH)
    check(plain, dec, "Typed()", [("__call__", (X1,)), ("__call__", (X2,))])


PARTIALMETHOD = """
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
    plain, dec = pair(write_module, PARTIALMETHOD)
    check(plain, dec, "Acc2()", [("add_twice", (X1,)), ("add_twice", (X2,))])


# ======================================================================================
# 4. Code outside the class
# ======================================================================================

HELPER_MODULE = """
import jax
import jax.numpy as jnp
import autostate


def bump(model, x):
    model.n = model.n + x
    model.hist = model.hist.at[0].add(x)
    return model.n


def bump_list(model, x):
    model.items += [x]
    return len(model.items)


def scan_with(scan, model, xs):
    return scan(lambda c, x: (c + bump(model, x), None), jnp.zeros(()), xs)[0]


def scan_with_jax(model, xs):
    return jax.lax.scan(lambda c, x: (c + bump(model, x), None), jnp.zeros(()), xs)[0]
"""

OUTSIDE = """
import hunt14_helpers as H


def local_bump(model, x):
    model.n = model.n * 2 + x
    return model.n


@DECORATE
class Out:
    def __init__(self):
        self.n = jnp.zeros(())
        self.hist = jnp.zeros(2)
        self.items = [jnp.zeros(())]
        self.sub = Leaf()

    def touch(self):
        self.n = self.n
        self.hist = self.hist
        self.items = self.items

    def local(self, x):
        return local_bump(self, x) + local_bump(self.sub, x)

    def other_module(self, x):
        return H.bump(self, x) + self.n

    def other_module_list(self, x):
        return H.bump_list(self, x) + 0 * x

    def other_module_autostate_scan(self, xs):
        return H.scan_with(LAXW.scan, self, xs)

    def other_module_jax_scan(self, xs):
        return H.scan_with_jax(self, xs)

    def method_alias_append(self, x):
        lst = self.items
        lst.append(x)
        return len(self.items) + 0 * x

    def duck_typed(self, x):
        return Leaf.grow(self, x) + Leaf.grow(self.sub, x)


@DECORATE
class Leaf:
    def __init__(self):
        self.n = jnp.ones(())

    def grow(self, x):
        self.n = self.n + x * 10
        return self.n
"""


def _outside_pair(write_module: Loader) -> tuple[types.ModuleType, types.ModuleType]:
    import sys

    if "hunt14_helpers" not in sys.modules:
        write_module(HELPER_MODULE, name="hunt14_helpers")
    return pair(write_module, OUTSIDE)


OUTSIDE_CASES = {
    "local": [("local", (X1,)), ("local", (X2,))],
    "other_module": [("other_module", (X1,)), ("other_module", (X2,))],
    "other_module_list": [("other_module_list", (X1,)), ("other_module_list", (X2,))],
    "method_alias_append": [("method_alias_append", (X1,)), ("method_alias_append", (X2,))],
    "other_module_autostate_scan": [("other_module_autostate_scan", (XS,))],
    "duck_typed": [("duck_typed", (X1,)), ("duck_typed", (X2,))],
}


@pytest.mark.parametrize("calls", list(OUTSIDE_CASES.values()), ids=list(OUTSIDE_CASES))
def test_code_outside_the_class(write_module: Loader, calls: Any) -> None:
    plain, dec = _outside_pair(write_module)
    check(plain, dec, "Out()", calls)


def test_helper_in_another_module_list_state_f_is_pure(write_module: Loader) -> None:
    """``model.items += [x]`` from a helper: f called twice on the same states
    gives the same result, and the caller's states are not changed."""
    _, dec = _outside_pair(write_module)
    f, states = dec.Out().functionalize()
    before = snapshot(states)
    out1, new1 = f.other_module_list(states, X1)
    out2, new2 = f.other_module_list(states, X1)
    assert_same(before, snapshot(states), "the caller's states changed")
    assert_same(out1, out2, "f is not pure")
    assert_same(snapshot(new1), snapshot(new2), "f is not pure (states)")


def test_helper_with_jax_scan_is_the_documented_escape(write_module: Loader) -> None:
    _, dec = _outside_pair(write_module)
    f, states = dec.Out().functionalize()
    for call in modes_of(f, "other_module_jax_scan"):
        with pytest.raises(EscapedStateError, match="State '(n|hist)'") as info:
            call(states, XS)
        assert_user_line(info.value, __file__)  # the call of f, as documented
    model = dec.Out()
    with pytest.raises(TracedEagerStateError, match="'n'"):
        model.other_module_jax_scan(XS)
    no_tracer(model)


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_code_outside_the_class_under_grad_and_vmap(write_module: Loader, transform: str) -> None:
    plain, dec = _outside_pair(write_module)
    x = X1 if transform == "grad" else jnp.arange(3.0)
    calls = [("local", (X,)), ("other_module", (X,)), ("duck_typed", (X,))]
    check_transform(plain, dec, "Out()", calls, x, transform)


# ======================================================================================
# 5. Transformations inside methods
# ======================================================================================

NESTED = """
import functools


@DECORATE
class Nest:
    def __init__(self):
        self.w = jnp.asarray(2.0)
        self.n = jnp.zeros(())

    def step(self, x):
        self.n = self.n + x
        return self.n * self.w

    def read(self, x):
        return self.n * x + self.w

    def block(self, x, k=1.0):
        self.n = self.n + x * k
        return jnp.sin(x) * self.w * k

    def jit_write(self, x):
        return jax.jit(self.step)(x)

    def vmap_write(self, xs):
        return jax.vmap(self.step)(xs)

    def eval_shape_write(self, x):
        return jax.eval_shape(self.step, x).shape

    def jit_read(self, x):
        self.n = self.n + 1
        return jax.jit(self.read)(x)

    def vmap_read(self, xs):
        self.n = self.n + 1
        return jax.vmap(self.read)(xs)

    def checkpoint_partial(self, x):
        return checkpoint(functools.partial(self.block, k=2.0))(x) + self.n

    def checkpoint_static(self, x):
        return checkpoint(self.block, static_argnums=(1,))(x, 3.0) + self.n

    def associative(self, xs):
        def combine(a, b):
            self.n = self.n + 1
            return a + b
        return jax.lax.associative_scan(combine, xs)

    def named(self, x):
        return jax.named_call(self.step, name="my_step")(x) + self.n

    def aliased_scan(self, xs):
        scan = lax.scan
        return scan(lambda c, x: (c + self.step(x), None), jnp.zeros(()), xs)[0]
"""

NESTED_OK = {
    "jit_read": [("jit_read", (X1,)), ("jit_read", (X2,))],
    "vmap_read": [("vmap_read", (XS,))],
    "checkpoint_partial": [("checkpoint_partial", (X1,)), ("checkpoint_partial", (X2,))],
    "checkpoint_static": [("checkpoint_static", (X1,))],
    "associative": [("associative", (XS,))],
    "named": [("named", (X1,)), ("named", (X2,))],
}


@pytest.mark.parametrize("case", sorted(NESTED_OK))
def test_transformations_inside_methods(write_module: Loader, case: str) -> None:
    plain, dec = pair(write_module, NESTED)
    check(plain, dec, "Nest()", NESTED_OK[case])


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_transformations_inside_methods_under_grad_and_vmap(
    write_module: Loader, transform: str
) -> None:
    plain, dec = pair(write_module, NESTED)
    x = X1 if transform == "grad" else jnp.arange(3.0)
    calls = [("checkpoint_partial", (X,)), ("named", (X,)), ("jit_read", (X,))]
    check_transform(plain, dec, "Nest()", calls, x, transform)


@pytest.mark.parametrize(
    "method,arg", [("jit_write", X1), ("vmap_write", XS), ("eval_shape_write", X1)]
)
def test_a_transformation_of_a_state_writing_method_is_the_documented_escape(
    write_module: Loader, method: str, arg: Any
) -> None:
    """Plain Python leaks a tracer into ``self.n``; autostate refuses, naming the line."""
    _, dec = pair(write_module, NESTED)
    f, states = dec.Nest().functionalize()
    for call in modes_of(f, method):
        with pytest.raises(EscapedStateError, match="State 'n'") as info:
            call(states, arg)
        assert_user_line(info.value, __file__)  # the call of f, as documented
    model = dec.Nest()
    with pytest.raises(TracedEagerStateError, match="'n'") as info:
        getattr(model, method)(arg)
    assert_user_line(info.value, dec.__file__)
    no_tracer(model)
    assert_same(np.float32(0.0), model.n, "unchanged")


def test_a_locally_aliased_lax_scan_is_not_routed_and_refused(write_module: Loader) -> None:
    """``scan = lax.scan`` inside the method: the decorator routes dotted names it
    resolves in the globals, not a local alias; the write is refused, never kept."""
    _, dec = pair(write_module, NESTED)
    model = dec.Nest()
    with pytest.raises(TracedEagerStateError, match="'n'") as info:
        model.aliased_scan(XS)
    assert_user_line(info.value, dec.__file__)
    no_tracer(model)
    f, states = dec.Nest().functionalize()
    for call in modes_of(f, "aliased_scan"):
        with pytest.raises(EscapedStateError, match="State 'n'"):
            call(states, XS)


# ======================================================================================
# 6. Several models: callbacks across models, two paths
# ======================================================================================

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
    "sibling_loop": [("sibling_loop", (XS,)), ("sibling_loop", (XS,))],
    "sibling_scan": [("sibling_scan", (XS,)), ("sibling_scan", (XS,))],
    "stored_cb_scan": [("stored_cb_scan", (XS,))],
    "parent_cb_fori": [("parent_cb_fori", (X1,)), ("parent_cb_fori", (X2,))],
    "lambda_cb_scan": [("lambda_cb_scan", (XS,))],
    "cond_between_models": [("cond_between_models", (X1,)), ("cond_between_models", (X2,))],
    "switch_between_models": [
        ("switch_between_models", (0, X1)),
        ("switch_between_models", (1, X2)),
        ("switch_between_models", (2, X1)),
    ],
    "map_sibling": [("map_sibling", (XS,))],
    "while_sibling": [("while_sibling", (X1,))],
    "checkpoint_runner": [("checkpoint_runner", (XS,))],
    "method_type_cb": [("method_type_cb", (X1,)), ("method_type_cb", (X2,))],
}


@pytest.mark.parametrize("case", sorted(CALLBACK_CASES))
def test_model_methods_as_callbacks_of_other_models(write_module: Loader, case: str) -> None:
    plain, dec = pair(write_module, CALLBACKS)
    check(plain, dec, "Parent()", CALLBACK_CASES[case])


def test_weak_method_callback_follows_the_running_model(write_module: Loader) -> None:
    plain, dec = pair(write_module, CALLBACKS)
    check(plain, dec, "Parent()", [("weak_cb", (X1,)), ("weak_cb", (X2,))], modes=("f",))


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_callbacks_under_grad_and_vmap(write_module: Loader, transform: str) -> None:
    plain, dec = pair(write_module, CALLBACKS)
    calls = [("sibling_scan", (X,)), ("stored_cb_scan", (X,)), ("lambda_cb_scan", (X,))]
    x = XS if transform == "grad" else jnp.arange(6.0).reshape(2, 3)
    check_transform(plain, dec, "Parent()", calls, x, transform)


def test_a_callback_from_outside_passed_to_f(write_module: Loader) -> None:
    """A sub-model method of the *eager* model passed into f as the callback:
    plain Python writes that model; through f it writes the eager model eagerly
    and is refused under jit."""
    plain, dec = pair(write_module, CALLBACKS)
    p = plain.Runner()
    ps = plain.Stats()
    expected = p.run_loop(ps.observe, XS)
    r, s = dec.Runner(), dec.Stats()
    f, states = r.functionalize()
    out, states = f.run_loop(states, s.observe, XS)
    assert_same(expected, out, "output")
    assert_same(snapshot(ps), snapshot(s), "the eager Stats was written like plain Python")
    assert_same(p.ticks, states["ticks"], "ticks")
    s2 = dec.Stats()
    with pytest.raises(TracedEagerStateError, match="'mean'"):
        jax.jit(lambda st, xs: f.run_loop(st, s2.observe, xs))(states, XS)
    no_tracer(s2)


# ======================================================================================
# 7. Generators, context managers, __getattr__
# ======================================================================================

GENS = """
def ticker(model, n):
    for i in range(n):
        model.n = model.n + i
        yield model.n


class Mode:
    def __init__(self, model, scale):
        self.model, self.scale = model, scale

    def __enter__(self):
        self.old = self.model.scale
        self.model.scale = self.scale
        self.model.entered = self.model.entered + 1
        return self.model

    def __exit__(self, *exc):
        self.model.scale = self.old
        return False


@DECORATE
class Gen:
    def __init__(self):
        self.n = jnp.zeros(())
        self.scale = jnp.ones(())
        self.entered = jnp.zeros(())

    def consume(self, x):
        vals = [v * x for v in ticker(self, 3)]
        return jnp.stack(vals)

    def zipped(self, xs):
        return sum(a * b for a, b in zip(ticker(self, 3), xs))

    def mode(self, scale):
        return Mode(self, scale)

    def reset(self):
        self.scale = jnp.ones(())
        self.entered = jnp.zeros(())

    def fwd(self, x):
        self.n = self.n + x * self.scale
        return self.n

    def with_mode(self, x):
        with self.mode(x * 2):
            y = self.fwd(x)
        return y + self.fwd(x)
"""

GEN_CASES = {
    "consume": [("consume", (X1,)), ("consume", (X2,))],
    "zipped": [("zipped", (XS,))],
    "with_mode": [("with_mode", (X1,)), ("with_mode", (X2,))],
}


@pytest.mark.parametrize("case", sorted(GEN_CASES))
def test_generators_and_context_managers_outside_the_class(write_module: Loader, case: str) -> None:
    plain, dec = pair(write_module, GENS)
    check(plain, dec, "Gen()", GEN_CASES[case])


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


GETATTR = """
@DECORATE
class Core:
    def __init__(self):
        self.n = jnp.zeros(())
        self.w = jnp.asarray(2.0)

    def bump(self, x):
        self.n = self.n + x
        return self.n * self.w


@DECORATE
class Wrapper:
    def __init__(self):
        self.core = Core()
        self.calls = jnp.zeros(())

    def __getattr__(self, name):
        if name.startswith("__") or name == "core":
            raise AttributeError(name)
        return getattr(self.core, name)

    def __call__(self, x):
        self.calls = self.calls + 1
        return self.bump(x) + self.n * self.w
"""


def test_getattr_forwarding_to_a_sub_model(write_module: Loader) -> None:
    plain, dec = pair(write_module, GETATTR)
    check(plain, dec, "Wrapper()", [("__call__", (X1,)), ("__call__", (X2,))])


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_getattr_forwarding_under_grad_and_vmap(write_module: Loader, transform: str) -> None:
    plain, dec = pair(write_module, GETATTR)
    x = X1 if transform == "grad" else jnp.arange(3.0)
    check_transform(plain, dec, "Wrapper()", [("__call__", (X,))] * 2, x, transform)


def test_forwarded_method_eagerly_from_outside(write_module: Loader) -> None:
    plain, dec = pair(write_module, GETATTR)
    p, d = plain.Wrapper(), dec.Wrapper()
    assert_same([p.bump(X1), p.n], [d.bump(X1), d.n], "forwarded")
    assert_same(snapshot(p), snapshot(d), "attributes")
