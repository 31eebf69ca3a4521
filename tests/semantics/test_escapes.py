"""Values leaving a call: leaked tracers, state escaping through globals,
closures and return values, transformations inside methods.

Each case runs a class as plain Python and decorated (the harness in
``tests/semantics/harness.py``, or a direct comparison) and asserts the
decorated program means what the plain one does: eagerly, through
``f(states, ...)``, under ``jax.jit`` and after ``autostate.freeze``, or that it
is refused with a clear error. A known difference stays as ``xfail(strict=True)``
with what differs.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tolerance import on_accelerator

import autostate
from autostate import errors, runtime
from autostate.errors import (
    ControlFlowStateError,
    EscapedStateError,
    TracedEagerStateError,
    TracedValueError,
    UnhandledLocalStateError,
)
from semantics.harness import (
    Call,
    Loader,
    X,
    _fcall,
    _method,
    assert_same,
    assert_user_line,
    check,
    check_transform,
    class_pair,
    floats,
    modes_of,
    no_handler_left,
    no_tracer,
    pair,
    pair_with_helpers,
    plain_path,
    raises_after_the_call,
    raises_autostate,
    run_case,
    same,
    snapshot,
    staged,
    user_line,
)
from semantics.programs_attribute_access import CONTEXT_CONSTRUCTS as CONSTRUCTS
from semantics.programs_class_shapes import LATE
from semantics.programs_containers import HELPER_MODULE
from semantics.programs_containers import OUTSIDE as OTHER_MODULE_HELPERS
from semantics.programs_control_flow import (
    BODIES,
    BUILT,
    CLOSURE_TRANSFORMS,
    HELPER_MOD,
    HELPER_MODEL,
    STACKED,
)
from semantics.programs_control_flow import OPTAX_TRAINER as TRAINER
from semantics.programs_eager_writes import EAGER
from semantics.programs_escapes import (
    CROSS,
    HELPER_WRITES,
    INSIDE,
    NESTED,
    NESTED_GEN,
    SYNTAX,
    TORCH_TRAINING,
    TRANSFORMED_WRITES,
    TRANSFORMS_INSIDE,
    VMAPCK,
)
from semantics.programs_escapes import ESCAPES as AFTER_THE_CALL
from semantics.programs_escapes import HELPER_ESCAPES as ESCAPES
from semantics.programs_methods import CLOSURES, DISPATCH, FRAMES
from semantics.programs_shared import (
    A1,
    REAL,
    STACK,
    TORCH_HEADER,
    TRAIN_XS,
    V3,
    V3_RANGE,
    V3_STACK,
    X1,
    X23_STACK,
    X_BATCH,
    XS,
    XS3,
    XS_SIGNED,
    YS,
)
from semantics.programs_shared import TWO as X2
from semantics.programs_shared import X1_WEAK as WEAK_X
from semantics.programs_shared import XB_VMAP as XB
from semantics.programs_shared import Y_BATCH as Y
from semantics.programs_static_state import TORCHLIKE
from semantics.programs_submodels import TORCH
from semantics.programs_transformations import CUSTOM_DERIVATIVES as OUTSIDE
from semantics.twins import (
    DECORATED,
    filled,
    same_observations,
    written,
)

INSIDE_PLAIN: list[tuple[str, str]] = []


@autostate.stateful
class Linear:
    def __init__(self):
        self.w = jnp.ones(2)  # a parameter: no method assigns it

    def __call__(self, x):
        return x * self.w


@autostate.stateful
class Trainer:
    def __init__(self):
        self.steps = jnp.zeros((), jnp.int32)

    def step(self, model, g):
        model.w = model.w - 0.1 * g
        self.steps += 1
        return self.steps


def _sgd(model, g):
    model.w = model.w - 0.1 * g
    return model.w.sum()


ROADS = {
    "jit closure": lambda m: staged(lambda g: _sgd(m, g))(jnp.ones(2)),
    "jit of grad": lambda m: staged(jax.grad(lambda g: _sgd(m, g) * 1.0))(jnp.ones(2)),
    "jit of vmap": lambda m: staged(jax.vmap(lambda g: _sgd(m, g)))(jnp.ones((3, 2))),
    "f of another model under jit": lambda m: staged(
        lambda f, s, g: f.step(s, m, g)
    )(*Trainer().functionalize(), jnp.ones(2)),
}


@autostate.stateful
class _KeepsACallable:
    def __init__(self):
        self.fn = None
        self.scale = jnp.zeros(2)

    def keep(self, x):
        self.fn = lambda: x * 2  # a closure over a value of the call
        return x.sum()

    def keep_array(self, x):
        self.scale = x * 2  # the way that works: the array is a state
        return x.sum()


def test_a_callable_closing_over_a_traced_value_is_refused_not_kept():
    # (it was kept: eagerly under jax.jit, and written back by autostate.jit,
    # the model held a function over a tracer, and calling it raised
    # UnexpectedTracerError)
    x = jnp.ones(2)
    model = _KeepsACallable()
    with pytest.raises(TracedEagerStateError, match="State 'fn' was assigned a JAX tracer"):
        jax.jit(lambda x: model.keep(x))(x)
    with pytest.raises(errors.StateAccessError, match="assigned _KeepsACallable.fn a value that keeps"):
        autostate.jit(lambda m, x: m.keep(x))(model, x)
    assert model.fn is None
    autostate.jit(lambda m, x: m.keep_array(x))(model, x)
    np.testing.assert_allclose(model.scale, [2.0, 2.0])


@pytest.mark.parametrize("road", sorted(ROADS))
def test_a_traced_write_to_a_parameter_of_an_outside_model_is_refused(road: str) -> None:
    model = Linear()
    with pytest.raises(TracedEagerStateError, match="held a concrete array") as info:
        ROADS[road](model)
    assert __file__.rpartition("/")[2] in str(info.value)  # the user's line
    assert "fix:" in str(info.value)
    assert type(model.w) is type(jnp.ones(2))  # no tracer left
    assert float(model(jnp.ones(2)).sum()) == 2.0


def test_a_model_built_inside_the_trace_takes_its_values() -> None:
    def inside(g):
        m = Linear()
        return _sgd(m, g)

    assert float(staged(inside)(jnp.ones(2))) == pytest.approx(1.8)
    assert float(jax.grad(inside)(jnp.ones(2)).sum()) == pytest.approx(-0.2)


def test_a_model_passed_to_the_transformation_takes_its_values() -> None:
    model = Linear()
    out, new = staged(lambda m, g: (_sgd(m, g), m))(model, jnp.ones(2))
    assert float(out) == pytest.approx(1.8)
    assert float(new.w[0]) == pytest.approx(0.9)
    assert float(model.w[0]) == 1.0  # the eager model keeps its own


def test_eager_writes_are_plain_python() -> None:
    model = Linear()
    assert float(_sgd(model, jnp.ones(2))) == pytest.approx(1.8)
    f, states = Trainer().functionalize()
    f.step(states, model, jnp.ones(2))  # an eager call of f: as plain Python
    assert float(model.w[0]) == pytest.approx(0.8)


@autostate.stateful
class Inner:
    def __init__(self) -> None:
        self.n = jnp.zeros(())

    def _loss(self, v):
        self.n = v * 2
        return v**2

    def grad(self, x):
        return jax.grad(self._loss)(x)

    def value_and_grad(self, x):
        return jax.value_and_grad(self._loss)(x)[1]

    def jvp(self, x):
        return jax.jvp(self._loss, (x,), (jnp.ones(()),))[1]

    def jacrev(self, x):
        return jax.jacrev(self._loss)(x)

    def linearize(self, x):
        return jax.linearize(self._loss, x)[0]

    def step(self, x):
        self.n = self.n + x
        return self.n**2


@pytest.mark.parametrize("jit", [False, True], ids=["f", "jit"])
@pytest.mark.parametrize("method", ["grad", "value_and_grad", "jvp", "jacrev", "linearize"])
def test_a_state_written_inside_a_derivative_of_a_method_keeps_its_primal_value(
    method: str, jit: bool
) -> None:
    # (test_control_flow's derivative cases check the meaning against hand-threaded code.)
    f, states = Inner().functionalize()
    call = getattr(f, method)
    out, new = (jax.jit(call) if jit else call)(states, jnp.float32(1.5))
    assert float(out) == (2.25 if method == "linearize" else 3.0)  # v**2, or its derivative
    assert float(new["n"]) == 3.0  # v * 2 at the primal
    out, new = jax.jit(f.step)(new, 1.0)  # f is left usable
    assert float(out) == 16.0 and float(new["n"]) == 4.0


def test_transformations_of_f_from_outside_are_not_escapes() -> None:
    f, states = Inner().functionalize()

    def loss(states: dict) -> jax.Array:
        return f.step(states, 1.0)[0]

    assert float(jax.grad(loss)(states)["n"]) == 2.0
    assert float(jax.jacfwd(loss)(states)["n"]) == 2.0
    assert float(jax.grad(jax.checkpoint(loss))(states)["n"]) == 2.0
    assert float(jax.linearize(loss, states)[0]) == 1.0
    out, new = jax.vmap(lambda s: f.step(s, 1.0))({"n": jnp.arange(3.0)})
    assert new["n"].tolist() == [1.0, 2.0, 3.0]
    out, new = jax.checkpoint(lambda s: f.step(s, 1.0))(states)
    assert float(new["n"]) == 1.0


jit_call = staged(lambda f, s, *a: f(s, *a))


def test_no_tracer_is_left_in_f_after_a_refused_write(write_module):
    _, cls, _ = class_pair(write_module, HELPER_WRITES, "NoStates")
    f, states = cls().functionalize()
    with pytest.raises(autostate.errors.StateAccessError):
        jit_call(f, states, 1.0)
    leaves = jax.tree_util.tree_leaves(f)
    assert not any(isinstance(x, jax.core.Tracer) for x in leaves)
    assert f.model.count == 0


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
        "dynamic_scan",
    ],  # (grad_writes keeps its primal value, jit_bound lands: test_control_flow)
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
                staged(lambda f, s, a: _fcall(f, method)(s, a))(f, states, arg)
        assert "fix:" in str(err.value)
        assert not autostate.lifetime.contains_tracer(snapshot(model)), "tracer leaked"


def test_global_and_nonlocal_in_methods(write_module: Loader) -> None:
    plain, dec = pair(write_module, SYNTAX)
    before_dec, before_plain = dec.CALLS, plain.CALLS
    check(plain, dec, "Syntax()", [("with_global", (1.0,))] * 3, modes=("eager", "f"))
    assert plain.CALLS - before_plain == 3
    assert dec.CALLS - before_dec == 6  # eager run and f run
    # a fresh factory per build, so each run's nonlocal counter starts at 0
    check(plain, dec, "make_counter()()", [("__call__", (1.0,))] * 3, modes=("eager",))
    check(plain, dec, "make_counter()()", [("__call__", (1.0,))] * 3, modes=("f",))


def test_global_rebound_between_calls(write_module: Loader) -> None:
    plain, dec = pair(write_module, LATE)
    ref, model = plain.LATE_CLS(), dec.LATE_CLS()
    f, states = dec.LATE_CLS().functionalize()
    try:
        for gain in (3.0, 7.0):
            plain.GAIN = dec.GAIN = gain
            expected = ref(1.0)
            assert_same(expected, model(1.0))
            out, states = f(states, 1.0)
            assert_same(expected, out)
    finally:
        plain.GAIN = dec.GAIN = 3.0


def unwrap(value: Any) -> Any:
    """What a raw ``__dict__`` entry means: a slot's value, or the value itself."""
    return value.read() if runtime.is_slot(value) else value


def full(v: float) -> Any:
    return jnp.full((2,), v, jnp.float32)


def _written(k: Any, cls: str = "Model") -> Any:
    model = getattr(k, cls)()
    model.step(full(1.0))
    model.step(full(1.5))
    return model


def test_a_tracer_write_to_an_eager_model_is_refused_and_changes_nothing(
    write_module: Loader,
) -> None:
    _, dec = pair(write_module, EAGER, fresh=True)
    model = _written(dec)
    snap = dict(vars(model))

    def bad(v: Any) -> Any:
        model.x = v
        return v

    with pytest.raises(Exception) as info:  # noqa: PT011 - refused as an autostate or jax error
        staged(bad)(full(2.0))
    assert not isinstance(info.value, AssertionError)
    np.testing.assert_allclose(model.x, full(1.5))
    np.testing.assert_allclose(unwrap(snap["x"]), full(1.5))
    assert not isinstance(unwrap(vars(model)["x"]), jax.core.Tracer)


def f_and_jit(f: Any, method: str) -> list[Callable[..., Any]]:
    """The functional call of ``method``, as is and under ``jax.jit``."""
    call = _fcall(f, method)
    return [call, staged(call)]


def test_raw_scan_in_a_helper_then_overwritten_is_refused_or_works(write_module: Loader) -> None:
    """Plain Python leaks a tracer that is overwritten before anyone sees it: the
    values are well defined (f may refuse it clearly, never leak)."""
    _, dec = pair(write_module, ESCAPES, fresh=True)
    f, states = dec.M().functionalize()
    for call in f_and_jit(f, "helper_then_overwrite"):
        try:
            out, new = call(states, XS3)
        except EscapedStateError:
            continue
        assert_same(np.asarray(XS3) * 2, out)
        assert_same({"s": 0.0, "d": {"a": 0.0, "b": 1.0}, "t": (0.0, 1.0)}, new)


def test_raw_scan_in_a_helper_then_read_array_is_escaped_state_error(write_module: Loader) -> None:
    _, dec = pair(write_module, ESCAPES, fresh=True)
    f, states = dec.M().functionalize()
    for call in f_and_jit(f, "helper_then_read_array"):
        with pytest.raises(EscapedStateError, match="State 's'"):
            call(states, XS3)


ESCAPED_PYTREE_READS = [
    ("helper_then_read_dict", XS3, "d"),
    ("helper_then_read_tuple", XS3, "t"),
]


@pytest.mark.parametrize(
    "method,arg,state", ESCAPED_PYTREE_READS, ids=[c[0] for c in ESCAPED_PYTREE_READS]
)
def test_escaped_pytree_state_read_is_a_clear_error(
    write_module: Loader, method: str, arg: Any, state: str
) -> None:
    _, dec = pair(write_module, ESCAPES, fresh=True)
    f, states = dec.M().functionalize()
    for call in f_and_jit(f, method):
        with pytest.raises(EscapedStateError, match=f"State '{state}'"):
            call(states, arg)


def test_state_written_in_grad_and_overwritten_after(write_module: Loader) -> None:
    """Plain Python's tracer is overwritten before the method returns: its values, in every mode."""
    plain, dec = pair(write_module, ESCAPES, fresh=True)
    check(plain, dec, "M()", [("grad_then_overwrite", (jnp.float32(1.5),))])


def test_pytree_state_written_in_grad_keeps_its_primal_value(write_module: Loader) -> None:
    """A dict state assigned inside ``jax.grad``, then read or returned by the method."""
    _, dec = pair(write_module, ESCAPES, fresh=True)
    f, states = dec.M().functionalize()
    for call in f_and_jit(f, "grad_then_read_dict"):
        out, new = call(states, jnp.float32(1.5))
        assert float(out) == 6.0  # d["a"] + the gradient, 3 + 3
        assert {k: float(v) for k, v in new["d"].items()} == {"a": 3.0, "b": 1.5}
    for call in f_and_jit(f, "grad_then_return_dict"):
        out, _ = call(states, jnp.float32(1.5))
        assert {k: float(v) for k, v in out.items()} == {"a": 3.0, "b": 1.5}


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


def test_a_global_eager_model_written_in_a_scan_body_is_refused(write_module: Loader) -> None:
    _, dec = pair(write_module, BODIES)
    model = dec.B()
    f, states = model.functionalize()
    calls = [lambda: model.global_model_in_scan(XS3), *[
        (lambda c=c: c(states, XS3)) for c in modes_of(f, "global_model_in_scan")]]
    for call in calls:
        with pytest.raises(TracedEagerStateError, match="State 'n'"):
            call()
        assert_same(np.float32(0.0), dec.OTHER.n, "the global model is unchanged")
        no_tracer(dec.OTHER)


@pytest.mark.parametrize("method", ["__call__", "clipped"])
def test_custom_jvp_and_vjp_functions_in_methods(write_module: Loader, method: str) -> None:
    plain, dec = pair(write_module, OUTSIDE)
    check(plain, dec, "Net()", [(method, (V3,))])
    # the custom rule runs under grad; under vmap it is JAX's batching of the function
    check_transform(plain, dec, "Net()", [(method, (X,))] * 2, V3, "grad")


@pytest.mark.parametrize("method", ["custom_vjp_writes", "custom_jvp_writes"])
def test_custom_derivative_closure_writing_state(write_module: Loader, method: str) -> None:
    """Concrete calls run the closure like plain Python; under jit its write would hold a
    tracer of the custom derivative's own trace: refused, naming the user's line."""
    plain, dec = pair(write_module, OUTSIDE)
    check(plain, dec, "Net()", [(method, (V3,))] * 2, modes=("eager", "f"))
    f, states = dec.Net().functionalize()
    with pytest.raises(EscapedStateError, match="State 'mean'") as info:
        staged(_fcall(f, method))(states, V3)
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


def test_eager_model_under_vmap_with_an_unbatched_named_axis_write(write_module: Loader) -> None:
    """The pmean'd statistics are unbatched, so plain Python keeps concrete values; so
    does the decorated eager model."""
    plain, dec = pair(write_module, OUTSIDE)
    xs = jnp.arange(12.0).reshape(4, 3)
    ref, model = plain.BN(3, "batch"), dec.BN(3, "batch")
    assert_same(jax.vmap(ref, axis_name="batch")(xs), jax.vmap(model, axis_name="batch")(xs))
    assert_same(snapshot(ref), snapshot(model))
    no_tracer(model)


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
        staged(bump)(X1)
    assert_user_line(info.value, dec.__file__)
    no_tracer(model)
    assert_same(np.float32(0.0), model.n, "unchanged")


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
    assert_same(list(p.lazy(XS3)), list(d.lazy(XS3)), "eager")
    assert_same(snapshot(p), snapshot(d), "eager attributes")
    f, states = dec.Disp().functionalize()
    it, new = f.lazy(states, XS3)
    with pytest.raises(UnhandledLocalStateError, match="State 'n'") as info:
        list(it)
    assert_user_line(info.value, dec.__file__)
    assert_same(states, new, "states unchanged")


def _outside_pair(write_module: Loader) -> tuple[types.ModuleType, types.ModuleType]:
    import sys

    if "written_helpers" not in sys.modules:
        write_module(HELPER_MODULE, name="written_helpers")
    return pair(write_module, OTHER_MODULE_HELPERS)


def test_helper_with_jax_scan_is_the_documented_escape(write_module: Loader) -> None:
    _, dec = _outside_pair(write_module)
    f, states = dec.Out().functionalize()
    for call in modes_of(f, "other_module_jax_scan", compiled=True):
        with pytest.raises(EscapedStateError, match="State '(n|hist)'") as info:
            call(states, XS3)
        assert_user_line(info.value, __file__)  # the call of f, as documented
    model = dec.Out()
    with pytest.raises(TracedEagerStateError, match="'n'"):
        model.other_module_jax_scan(XS3)
    no_tracer(model)


@pytest.mark.parametrize(
    "method,arg", [("eval_shape_write", X1)]
)
def test_a_transformation_of_a_state_writing_method_is_the_documented_escape(
    write_module: Loader, method: str, arg: Any
) -> None:
    """Plain Python leaks a tracer into ``self.n``; autostate refuses, naming the line."""
    _, dec = pair(write_module, NESTED)
    f, states = dec.Nest().functionalize()
    for call in modes_of(f, method, compiled=True):
        with pytest.raises(EscapedStateError, match="State 'n'") as info:
            call(states, arg)
        assert_user_line(info.value, __file__)  # the call of f, as documented
    model = dec.Nest()
    with pytest.raises(TracedEagerStateError, match="'n'") as info:
        getattr(model, method)(arg)
    assert_user_line(info.value, dec.__file__)
    no_tracer(model)
    assert_same(np.float32(0.0), model.n, "unchanged")


def stack(write_module: Loader) -> tuple[Any, Any, Any]:
    _, dec = pair(write_module, STACKED)
    model = dec.Stack(2)
    assert model.layers.w.shape == (2, 3) and model.layers.mean.shape == (2, 3)
    return dec, model, (model.layers.w, model.layers.mean)


# Transformations applied inside methods, on three programs: ``Nest`` (a write
# under checkpoint / named_call / associative_scan, a bound method read under
# vmap), ``Net`` (nested jit, checkpoint, naming, compile-time evaluation, lax
# primitives handed bound methods, the vmap / grad family, callbacks, custom
# derivatives) and ``Inside`` (transformations of closures inside scan bodies,
# value_and_grad with a state as aux, a host callback reading a state).
INSIDE_PROGRAMS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "nest": (NESTED, "Nest()", {}),
    "net": (INSIDE, "Net()", {"checkpoint_as_identity": True}),
    "closures": (
        CLOSURE_TRANSFORMS,
        "Inside()",
        {"plain_subs": INSIDE_PLAIN, "checkpoint_as_identity": True},
    ),
}


# Nest.jit_read (a write, then jax.jit of a bound method reading it) is
# Net.jit_bound_twice's second call; Nest.vmap_read (a write, then jax.vmap of a
# bound method reading it) is Net.vmap_read.
NESTED_CALLS: dict[str, list[Call]] = {
    "checkpoint_partial": [("checkpoint_partial", (X1,)), ("checkpoint_partial", (X2,))],
    "checkpoint_static": [("checkpoint_static", (X1,))],
    "associative": [("associative", (XS3,))],
    "named": [("named", (X1,)), ("named", (X2,))],
}


# A state read inside a transformation is a read of the closed-over value,
# whatever the transformation: one case per kind of trace, not per spelling.
# Covered elsewhere: jit_static_arg by jit_lambda_after_write (and used in
# test_value_and_grad_has_aux_...); lax_map_read by lax_map_partial_write;
# assoc_read by CALLABLES_INSIDE's assoc_method; reduce_read by its
# reduce_method; hessian_read by grad_read_after_write and its hessian_count;
# pure_cb by its pure_cb_method.
INSIDE_CALLS: dict[str, Any] = {
    "jit_lambda_after_write": V3,
    "jit_bound_twice": V3,
    "jit_result_assigned": V3,
    "ckpt_bound": V3,
    "remat_policy": V3,
    "ckpt_decorated_nested": V3,
    "named_call_read": V3,
    "named_scope_nested": V3,
    "named_scope_scan": STACK,
    "cte_read": V3,
    "cte_write": V3,
    "lax_map_partial_write": STACK,
    "while_cond_method": V3 * 4,
    "while_cond_method_body_writes": V3,
    "scan_partial": STACK,
    "fori_partial": V3,
    "vmap_read": STACK,
    "vmap_read_after_write": V3,
    "grad_read_after_write": V3,
    "jvp_read_after_write": V3,
    "linearize_read_after_write": V3,
    "jit_grad_read": V3,
    "vg_has_aux_read": V3,
    "cvjp_state_as_argument": V3,
    "debug_print": V3,
    "pure_cb_in_cond": V3,
    "cjvp_param_only": V3,
}


# Inside.reduce_read (lax.reduce, associative_scan reading a state) is
# CALLABLES_INSIDE's reduce_method and assoc_method.
CLOSURE_CALLS: dict[str, list[Call]] = {
    "grad-hessian-jvp-linearize-vjp-of-carry": [("grads_of_carry", (XS_SIGNED,))],
    "value_and_grad-has_aux": [("value_and_grad_aux", (WEAK_X,))],
    "tree_map-in-scan-body": [("tree_map_in_body", (XS_SIGNED,))],
    "ensure_compile_time_eval-in-body": [("compile_time_eval_in_body", (XS_SIGNED,))],
    "debug.callback-reads-state": [("callback_reads_state", (WEAK_X,))],
}


ALL_MODES = ("eager", "f", "jit", "freeze")


# Under jit a host callback that reads a state is refused with the fix
# (test_a_host_callback_reading_state_under_jit_says_how_to_pass_it).
INSIDE_CASES: dict[str, tuple[str, list[Call], tuple[str, ...]]] = {
    **{f"nest-{k}": ("nest", calls, ALL_MODES) for k, calls in NESTED_CALLS.items()},
    **{f"net-{m}": ("net", [(m, (arg,))], ALL_MODES) for m, arg in INSIDE_CALLS.items()},
    **{
        f"closures-{k}": (
            "closures", calls, ("eager", "f") if k == "debug.callback-reads-state" else ALL_MODES
        )
        for k, calls in CLOSURE_CALLS.items()
    },
}


def inside_pair(write_module: Loader, program: str) -> tuple[types.ModuleType, types.ModuleType]:
    source, _, options = INSIDE_PROGRAMS[program]
    return pair(write_module, source, **options)


@pytest.mark.parametrize("case", sorted(INSIDE_CASES))
def test_transformations_inside_methods(write_module: Loader, case: str) -> None:
    program, calls, modes = INSIDE_CASES[case]
    plain, dec = inside_pair(write_module, program)
    check(plain, dec, INSIDE_PROGRAMS[program][1], calls, modes=modes)


# Net's methods under grad and vmap of the input (a pure_callback has no JVP, and the
# plain module's Python while/cond cannot take a batched predicate, in plain JAX as well):
# one case per kind of inner call (checkpoint, nested jit, compile-time evaluation, a lax
# loop, an inner transformation, a custom derivative), under the transformations where it
# meets the outer one. Also covered so: remat_policy and ckpt_decorated_nested by
# ckpt_bound; lax_map_partial_write and fori_partial by scan_partial; jit_grad_read by
# jit_lambda_after_write and vg_has_aux_read.
UNDER_GRAD_AND_VMAP: dict[str, tuple[str, ...]] = {
    "ckpt_bound": ("grad", "vmap"),
    "jit_lambda_after_write": ("grad", "vmap"),
    "cte_write": ("grad", "vmap"),
    "scan_partial": ("grad", "vmap"),
    "vmap_read_after_write": ("grad",),
    "vg_has_aux_read": ("grad",),
    "cjvp_param_only": ("grad",),
}


# (program, calls, the input under grad, under vmap, the transformations)
UNDER_GRAD_AND_VMAP_CASES: dict[str, tuple[str, list[Call], Any, Any, tuple[str, ...]]] = {
    "nest-checkpoint_partial-named-jit_read": (
        "nest",
        [("checkpoint_partial", (X,)), ("named", (X,)), ("jit_read", (X,))],
        X1,
        jnp.arange(3.0),
        ("grad", "vmap"),
    ),
    **{
        f"net-{m}": ("net", [(m, (X,))] * 2, INSIDE_CALLS[m],
                     jnp.stack([INSIDE_CALLS[m], INSIDE_CALLS[m] + 1]), transforms)
        for m, transforms in UNDER_GRAD_AND_VMAP.items()
    },
}


@pytest.mark.parametrize(
    "case,transform",
    [(case, t) for case, spec in UNDER_GRAD_AND_VMAP_CASES.items() for t in spec[4]],
)
def test_transformations_inside_methods_under_grad_and_vmap(
    write_module: Loader, case: str, transform: str
) -> None:
    program, calls, x_grad, x_vmap, _ = UNDER_GRAD_AND_VMAP_CASES[case]
    plain, dec = inside_pair(write_module, program)
    x = x_grad if transform == "grad" else x_vmap
    check_transform(plain, dec, INSIDE_PROGRAMS[program][1], calls, x, transform)


def test_debug_callback_sees_the_plain_values(write_module: Loader) -> None:
    """``jax.debug.callback`` of a state (in a method and inside a scan body) receives
    the values plain Python has at that point, eagerly, in ``f`` and under ``jit``."""
    plain, dec = pair(write_module, INSIDE, checkpoint_as_identity=True)
    calls = [("debug_callback", (V3,)), ("debug_callback_in_scan", (STACK,)),
             ("debug_callback", (-V3,))]
    plain.LOG.clear()
    ref = plain.Net()
    expected = [getattr(ref, m)(*a) for m, a in calls]
    expected_log = list(plain.LOG)
    assert len(expected_log) == 4

    dec.LOG.clear()
    model = dec.Net()
    assert_same(expected, [getattr(model, m)(*a) for m, a in calls], "eager")
    assert_same(expected_log, list(dec.LOG), "eager log")
    for mode in ("f", "jit"):
        dec.LOG.clear()
        f, states = dec.Net().functionalize()
        outs = []
        for m, a in calls:
            call = _fcall(f, m) if mode == "f" else staged(_fcall(f, m))
            out, states = call(states, *a)
            outs.append(out)
        jax.effects_barrier()
        assert_same(expected, outs, mode)
        assert_same(expected_log, list(dec.LOG), f"{mode} log")
        assert_same(snapshot(ref.mean), states["mean"], mode)


CUSTOM_READS = ["cjvp_read", "cjvp_read_after_write", "cvjp_read_after_write",
                "custom_gradient_read"]


@pytest.mark.parametrize("method", CUSTOM_READS)
def test_custom_derivative_closures_reading_state_eagerly_and_in_f(
    write_module: Loader, method: str
) -> None:
    plain, dec = pair(write_module, INSIDE, checkpoint_as_identity=True)
    check(plain, dec, "Net()", [(method, (V3,)), (method, (V3 * 2,))], modes=("eager", "f"))


@pytest.mark.parametrize("method", CUSTOM_READS)
def test_custom_derivative_closures_reading_state_under_jit(
    write_module: Loader, method: str
) -> None:
    plain, dec = pair(write_module, INSIDE, checkpoint_as_identity=True)
    check(plain, dec, "Net()", [(method, (V3,)), (method, (V3 * 2,))], modes=("jit",))


def test_custom_jvp_closure_reading_batched_state(write_module: Loader) -> None:
    plain, dec = pair(write_module, INSIDE, checkpoint_as_identity=True)
    means = jnp.stack([jnp.zeros(3), jnp.ones(3)])

    def ref(mean: Any) -> Any:
        m = plain.Net()
        m.mean = mean
        return m.cjvp_read(V3)

    f, states = dec.Net().functionalize()
    batched = {"mean": means, "calls": states["calls"]}
    out, _ = jax.vmap(f.cjvp_read, in_axes=({"mean": 0, "calls": None}, None))(batched, V3)
    assert_same(jax.vmap(ref)(means), out)


def test_grad_through_a_custom_jvp_closure_reading_state_is_an_autostate_error(
    write_module: Loader,
) -> None:
    """Plain JAX leaks the JVP tracer of a state closed over by a ``custom_jvp``
    function (``UnexpectedTracerError``); autostate refuses, naming the user's line."""
    plain, dec = pair(write_module, INSIDE, checkpoint_as_identity=True)

    def plain_loss(mean: Any) -> Any:
        m = plain.Net()
        m.mean = mean
        return m.cjvp_read(V3)

    with pytest.raises(jax.errors.UnexpectedTracerError):
        jax.grad(plain_loss)(jnp.zeros(3))
    f, states = dec.Net().functionalize()
    with pytest.raises(autostate.AutostateError) as info:
        jax.grad(lambda s: f.cjvp_read(s, V3)[0], allow_int=True)(states)
    assert_user_line(info.value, dec.__file__)


@pytest.mark.parametrize("outer", ["grad", "jax.jit(grad)"])
@pytest.mark.parametrize(("source", "method", "line"), [
    ("INSIDE", "cjvp_read", "return jnp.sin(v) * self.w + self.mean"),
    ("CALLABLES_INSIDE", "cvjp_output_assigned", "return v * self.w + self.mean"),
])
def test_a_custom_rule_reading_state_under_grad_of_checkpoint_of_f_is_an_autostate_error(
    write_module: Loader, source: str, method: str, line: str, outer: str
) -> None:
    """``jax.grad`` of a loss of ``jax.checkpoint(f)``: JAX traces the custom
    rule after the checkpoint's trace has ended, so a state it reads has no
    value there. Plain JAX, the state passed in by hand and closed over, leaks
    the tracer (``UnexpectedTracerError``); autostate refuses at the line that
    reads, naming the checkpoint, and ``f`` stays usable."""
    plain, dec = pair(write_module, INSIDE if source == "INSIDE" else CALLABLES_INSIDE,
                      checkpoint_as_identity=source == "INSIDE")

    def plain_loss(mean: Any, x: Any) -> Any:
        m = plain.Net()
        m.mean = mean
        return getattr(m, method)(x)

    with pytest.raises(jax.errors.UnexpectedTracerError):
        jax.grad(jax.checkpoint(plain_loss), argnums=1)(plain.Net().mean, V3)
    f, states = dec.Net().functionalize()
    grad = jax.grad(jax.checkpoint(lambda s, x: getattr(f, method)(s, x)[0]), argnums=1)
    with pytest.raises(EscapedStateError) as info:
        (jax.jit(grad) if outer == "jax.jit(grad)" else grad)(states, V3)
    user_line(info.value, dec, line)
    assert "jax.checkpoint" in str(info.value) and "lax body" not in str(info.value)
    expected = jax.grad(lambda x: getattr(plain.Net(), method)(x))(V3)
    assert_same(expected, jax.grad(lambda x: getattr(f, method)(states, x)[0])(V3))


def test_value_and_grad_has_aux_of_a_state_writing_loss_keeps_the_primal(
    write_module: Loader,
) -> None:
    """``value_and_grad(self.loss, has_aux=True)`` whose loss writes ``self.mean`` (and
    returns it as aux): plain Python leaks a tracer into the model; the state keeps
    its primal value, eagerly and through ``f``."""
    _, dec = pair(write_module, INSIDE, checkpoint_as_identity=True)
    model = dec.Net()
    w, mean = model.w, model.mean
    dot = (V3 * w).sum()
    expected = dot**2 + (2 * dot * w).sum()
    assert_same(expected, model.vg_has_aux_write(V3), "eager output")
    assert_same(mean + V3, model.mean, "eager state")
    no_tracer(model)
    f, states = dec.Net().functionalize()
    for call in modes_of(f, "vg_has_aux_write", compiled=True):
        out, new = call(states, V3)
        assert_same(expected, out, "output")
        assert_same(mean + V3, new["mean"], "state")



def test_coroutine_returned_by_f_refuses_to_run_after_the_call(write_module: Loader) -> None:
    _, dec = pair(write_module, FRAMES)
    f, s = dec.Stream().functionalize()
    coro, new = f.abump(s, X1)
    with pytest.raises(UnhandledLocalStateError, match="State 'x'") as info:
        asyncio.run(coro)
    assert_user_line(info.value, dec.__file__)
    assert_same(floats(s), floats(new), "the states are unchanged")
    no_handler_left()


def test_context_manager_returned_by_f_refuses_to_enter_after_the_call(
    write_module: Loader,
) -> None:
    _, dec = pair(write_module, FRAMES)
    f, s = dec.Stream().functionalize()
    cm, _ = f.scope(s, 1.0)
    with pytest.raises(UnhandledLocalStateError, match="State 'x'") as info:
        cm.__enter__()
    assert_user_line(info.value, dec.__file__)


def test_named_buffers_generator_consumed_after_f_returned(write_module: Loader) -> None:
    _, dec = pair(write_module, TORCH)
    f, states = dec.Tree().functionalize()
    gen, _ = f.named_buffers(states)
    try:
        items = list(gen)
    except autostate.AutostateError as err:
        assert_user_line(err, dec.__file__)
    else:
        assert_same([("calls", np.int32(0))], items)


def run_f(dec: types.ModuleType, build: str, calls: list[tuple[str, tuple[Any, ...]]],
          jit: bool) -> tuple[list[Any], dict[str, Any], Any]:
    model = eval(build, vars(dec))  # noqa: S307
    f, states = model.functionalize()
    outs = []
    for m, a in calls:
        fn = (lambda f, s, *a, m=m: (f if m == "__call__" else getattr(f, m))(s, *a))  # noqa: E731
        if jit:
            fn = staged(fn)
        out, states = fn(f, states, *a)
        outs.append(out)
    return outs, states, f


def run_modes(dec: types.ModuleType, build: str, calls: list[tuple[str, tuple[Any, ...]]],
              keys: list[str]) -> dict[str, tuple[list[Any], dict[str, Any]]]:
    """Outputs and the named states after ``calls``: eagerly, through ``f``, under ``jit``."""
    model = eval(build, vars(dec))  # noqa: S307
    outs = [(model if m == "__call__" else getattr(model, m))(*a) for m, a in calls]
    result = {"eager": (outs, {k: plain_path(model, k) for k in keys})}
    for jit in (False, True):
        outs, states, _ = run_f(dec, build, calls, jit)
        result["jit" if jit else "f"] = (outs, {k: states[k] for k in keys})
    return result


GAN_SUB = """
import optax


@DECORATE
class Gen:
    def __init__(self, key, z=2, d=3):
        self.w = STATE(jax.random.normal(key, (z, d)) * 0.5)

    def __call__(self, z):
        return jnp.tanh(z @ self.w)

    def loss(self, z, disc):
        return jax.nn.softplus(-disc(self(z))).mean()


@DECORATE
class Disc:
    def __init__(self, key, d=3):
        self.w = STATE(jax.random.normal(key, (d,)) * 0.5)

    def __call__(self, x):
        return x @ self.w

    def loss(self, real, fake):
        return jax.nn.softplus(-self(real)).mean() + jax.nn.softplus(self(fake)).mean()


@DECORATE
class GAN:
    def __init__(self, seed):
        kg, kd, kk = jax.random.split(jax.random.PRNGKey(seed), 3)
        self.G = Gen(kg)
        self.D = Disc(kd)
        self.g_opt = optax.adam(0.05)
        self.d_opt = optax.sgd(0.1, momentum=0.9)
        self.g_state = self.g_opt.init(self.G.w)
        self.d_state = self.d_opt.init(self.D.w)
        self.key = kk
        self.step = jnp.zeros((), jnp.int32)

    def train_step(self, real):
        self.key, kd, kg = jax.random.split(self.key, 3)
        fake = jax.lax.stop_gradient(self.G(jax.random.normal(kd, (real.shape[0], 2))))
        ld, gd = jax.value_and_grad(lambda D: D.loss(real, fake))(self.D)
        upd, self.d_state = self.d_opt.update(gd.w, self.d_state, self.D.w)
        self.D.w = optax.apply_updates(self.D.w, upd)
        zg = jax.random.normal(kg, (real.shape[0], 2))
        frozen_d = jax.lax.stop_gradient(self.D)
        lg, gg = jax.value_and_grad(lambda G: G.loss(zg, frozen_d))(self.G)
        upd, self.g_state = self.g_opt.update(gg.w, self.g_state, self.G.w)
        self.G.w = optax.apply_updates(self.G.w, upd)
        self.step += 1
        return ld, lg
"""


def _gan_hand(seed: int, steps: int) -> tuple[list[Any], dict[str, Any]]:
    kg, kd, kk = jax.random.split(jax.random.PRNGKey(seed), 3)
    gw, dw = jax.random.normal(kg, (2, 3)) * 0.5, jax.random.normal(kd, (3,)) * 0.5
    gopt, dopt = optax.adam(0.05), optax.sgd(0.1, momentum=0.9)
    gs, ds = gopt.init(gw), dopt.init(dw)
    outs = []
    for _ in range(steps):
        kk, k1, k2 = jax.random.split(kk, 3)
        zd = jax.random.normal(k1, (2, 2))
        fake = jnp.tanh(zd @ gw)
        ld, g = jax.value_and_grad(
            lambda dw: jax.nn.softplus(-(REAL @ dw)).mean() + jax.nn.softplus(fake @ dw).mean())(dw)  # noqa: B023
        u, ds = dopt.update(g, ds, dw)
        dw = optax.apply_updates(dw, u)
        zg = jax.random.normal(k2, (2, 2))
        lg, g = jax.value_and_grad(lambda gw: jax.nn.softplus(-(jnp.tanh(zg @ gw) @ dw)).mean())(gw)  # noqa: B023
        u, gs = gopt.update(g, gs, gw)
        gw = optax.apply_updates(gw, u)
        outs.append((np.asarray(ld), np.asarray(lg)))
    return outs, {"g_w": gw, "d_w": dw, "step": steps}


def test_gan_grad_over_sub_models_inside_a_method(write_module: Loader) -> None:
    # jax.grad over a sub-model (a pytree only when decorated): no plain reference, so
    # eager / f / jit are compared with the hand-threaded GAN.
    _, dec = pair(write_module, GAN_SUB)
    ref_outs, ref = _gan_hand(1, 2)
    for mode, (outs, states) in run_modes(dec, "GAN(1)", [("train_step", (REAL,))] * 2,
                                          ["G.w", "D.w", "step"]).items():
        assert_same(ref_outs, [tuple(np.asarray(o) for o in out) for out in outs], mode)
        assert_same(np.asarray(ref["g_w"]), np.asarray(states["G.w"]), f"{mode} G.w")
        assert_same(np.asarray(ref["d_w"]), np.asarray(states["D.w"]), f"{mode} D.w")
        assert int(states["step"]) == 2, mode


FIT_STEPS = 2


def _hand_fit(seed: int, opt: Any) -> tuple[Any, Any]:
    """The first ``FIT_STEPS`` batches fitted by hand: (params, losses)."""
    k1, _ = jax.random.split(jax.random.PRNGKey(seed))
    p = (jax.random.normal(k1, (3, 2)) * 0.5, jnp.zeros(2))
    s = opt.init(p)

    def body(c, b):
        p, s = c
        lval, g = jax.value_and_grad(lambda p: ((jnp.tanh(b[0] @ p[0] + p[1]) - b[1]) ** 2).mean())(p)
        u, s = opt.update(g, s, p)
        return (optax.apply_updates(p, u), s), lval

    (p, s), losses = jax.lax.scan(body, (p, s), (TRAIN_XS[:FIT_STEPS], YS[:FIT_STEPS]))
    return p, losses


def test_trainer_grad_over_sub_model_inside_a_method(write_module: Loader) -> None:
    _, dec = pair(write_module, TRAINER)
    p, losses = _hand_fit(0, optax.adam(0.1))
    calls = [("train_step", ((TRAIN_XS[i], YS[i]),)) for i in range(FIT_STEPS)]
    for mode, (outs, states) in run_modes(dec, "Trainer(0)", calls,
                                          ["model.w", "model.b", "step"]).items():
        assert_same(np.asarray(losses), np.asarray(outs), f"{mode} losses")
        assert_same(np.asarray(p[0]), np.asarray(states["model.w"]), f"{mode} w")
        assert_same(np.asarray(p[1]), np.asarray(states["model.b"]), f"{mode} b")
        assert int(states["step"]) == FIT_STEPS, mode


def test_trainer_writing_sub_model_parameters_is_the_documented_error(write_module: Loader) -> None:
    # Model.w is a parameter (no method of Model assigns it); the Trainer assigning it
    # inside a functionalized call is the documented StateAccessError at the user's line
    _, dec = pair(write_module, TRAINER)
    p, losses = _hand_fit(0, optax.adam(0.1))
    model = dec.Trainer(0, cls=dec.Model)
    got = [model.train_step((TRAIN_XS[i], YS[i])) for i in range(FIT_STEPS)]
    assert_same(np.asarray(losses), np.asarray(got), "eager losses")
    assert_same(np.asarray(p[0]), np.asarray(model.model.w), "eager w")
    f, states = dec.Trainer(0, cls=dec.Model).functionalize()
    with pytest.raises(autostate.errors.StateAccessError) as err:
        f.train_step(states, (TRAIN_XS[0], YS[0]))
    assert "Model.w is not state" in str(err.value)
    assert_user_line(err.value, dec.__file__.rsplit("/", 1)[-1])


def test_vmap_over_a_pure_sub_model_method(write_module: Loader) -> None:
    plain, dec = pair(write_module, VMAPCK)
    check(plain, dec, "Net()", [("vmapped_pure", (XB,)), ("vmapped_pure", (XB * 2,))])


def test_vmap_over_a_sub_model_method_writing_an_unbatched_value(write_module: Loader) -> None:
    # plain Python traces the method once; n + 1 is concrete, so n becomes 1 per call
    plain, dec = pair(write_module, VMAPCK)
    check(plain, dec, "Net()", [("vmapped_writer", (XB,)), ("vmapped_writer", (XB * 2,))])


def test_generator_returned_and_consumed_after_f(write_module: Loader) -> None:
    plain, dec = pair(write_module, NESTED_GEN)
    ref, model = plain.G(), dec.G()
    same(list(ref.lazy(A1)), list(model.lazy(A1)), "eager")
    same(ref.x, model.x, "eager state")
    f, states = dec.G().functionalize()
    gen, new_states = f.lazy(states, A1)
    same({"x": jnp.zeros(())}, new_states, "nothing ran yet")
    with pytest.raises(errors.UnhandledLocalStateError) as info:
        next(gen)
    user_line(info.value, dec, "self.x = self.x + k * i")


def test_model_returned_from_f_is_a_clear_unhandled_error(write_module: Loader) -> None:
    # train() returns self: f.train gives back f's model, whose states are f's refs
    _, dec = pair(write_module, TORCHLIKE)
    f, states = dec.BN(2).functionalize()
    out, _ = f.train(states)
    assert isinstance(out, dec.BN)
    with pytest.raises(autostate.errors.UnhandledLocalStateError):
        _ = out.mean
    assert out.training is True


def test_helper_module_with_jax_scan_is_the_documented_escape(write_module: Loader) -> None:
    _, dec, _, hd = pair_with_helpers(write_module, HELPER_MOD, HELPER_MODEL)
    f, states = dec.M().functionalize()
    for fn in (f.via_jax_scan, jax.jit(f.via_jax_scan)):
        with pytest.raises(autostate.AutostateError) as e:
            fn(states, XS_SIGNED)
        assert isinstance(e.value, autostate.errors.EscapedStateError), repr(e.value)
        # documented: named where the tracer would escape (the return of f: this file)
        assert f"{__file__}:" in str(e.value) and "autostate.scan" in str(e.value)
    with pytest.raises(autostate.AutostateError) as e:
        dec.M().via_jax_scan(XS_SIGNED)
    user_line(e.value, hd, "model.total = model.total + jnp.sin(x)")


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
        [("read_after_write", (V3_RANGE,)), ("in_scan", (XS_SIGNED,)), ("read_after_write", (V3_RANGE,))],
        extra=("in_scan", (XS_SIGNED,)),
    )


def functools_partial(fn: Callable[..., Any], *a: Any) -> Callable[..., Any]:
    return lambda *b: fn(*a, *b)


def test_jvp_of_a_closure_that_writes_keeps_the_primal(write_module: Loader) -> None:
    _, dec = inside_pair(write_module, "closures")
    w = dec.Inside().w
    expected = jax.jvp(lambda v: v * w, (WEAK_X,), (1.0,))[1]
    model = dec.Inside()
    assert_same(expected, model.jvp_write(WEAK_X), "eager")
    assert_same(WEAK_X * 2.0, model.s, "eager state")
    f, states = dec.Inside().functionalize()
    for call in (f.jvp_write, jax.jit(f.jvp_write)):
        out, new = call(states, WEAK_X)
        assert_same(expected, out, "output")
        assert_same(WEAK_X * 2.0, new["s"], "state")


def test_a_host_callback_reading_state_under_jit_says_how_to_pass_it(
    write_module: Loader,
) -> None:
    # Under jax.jit(f) the callback's Python function runs after the traced
    # call ended: the read is refused with the fix (pass the value as an
    # argument); JAX reports it wrapped in its own JaxRuntimeError (eagerly
    # and through f without jit it reads the plain value: the case above).
    _, dec = inside_pair(write_module, "closures")
    f, states = dec.Inside().functionalize()
    with raises_after_the_call() as raised:
        out, _ = jax.jit(f.callback_reads_state)(states, WEAK_X)
        jax.block_until_ready(out)
    assert "UnhandledLocalStateError" in str(raised.value)
    assert "as the callback's argument" in str(raised.value)


@pytest.mark.parametrize(
    "inner",
    [
        lambda m, xs: jax.lax.scan(lambda c, x: (c + m(x).sum(), None), 0.0, xs)[0],
        lambda m, xs: jax.vmap(lambda x: m(x))(xs),
        lambda m, xs: staged(lambda x: m(x))(xs[0]),
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
        staged(g)(jax.random.key(0), X23_STACK)
    user_line(err.value, dec, "# built mean")


@pytest.mark.filterwarnings(
    "ignore:Python iterable type:DeprecationWarning"
)
@pytest.mark.parametrize(
    "method, text",
    [
        ("lazy_calls", "self.x = self.x + v"),
        ("lazy_reads", "return (self.x * v for v in xs)"),
        ("lazy_map", "self.x = self.x + v"),
    ],
)
def test_lazy_iterator_consumed_after_f_is_unhandled_state(
    write_module: Loader, method: str, text: str
) -> None:
    plain, dec = pair(write_module, AFTER_THE_CALL)
    ref, model = plain.E(), dec.E()
    same([float(v) for v in getattr(ref, method)(XS3)], [float(v) for v in getattr(model, method)(XS3)])
    same(snapshot(ref), snapshot(model), "eager")
    f, states = dec.E().functionalize()
    it, new = getattr(f, method)(states, XS3)
    same(snapshot(states), snapshot(new), "nothing ran in the call")
    with pytest.raises(errors.UnhandledLocalStateError) as info:
        next(it)
    user_line(info.value, dec, text)


@pytest.mark.filterwarnings(
    "ignore:Python iterable type:DeprecationWarning"
)
@pytest.mark.parametrize("jit", [False, True])
def test_generator_stashed_by_f_resumed_after_it(write_module: Loader, jit: bool) -> None:
    _, dec = pair(write_module, AFTER_THE_CALL)
    dec.BOX.clear()
    f, s = dec.E().functionalize()
    (staged(f.stash, static_argnums=1) if jit else f.stash)(s, (1.0, 2.0))
    g = dec.BOX.pop()
    with pytest.raises(errors.UnhandledLocalStateError) as info:
        next(g)
    # the write in bump is refused; the finally's write is refused too and names its line
    assert isinstance(info.value.__context__, errors.UnhandledLocalStateError)
    user_line(info.value, dec, "self.closed = self.closed + 1")
    user_line(info.value.__context__, dec, "self.x = self.x + v")


@pytest.mark.usefixtures("young_gc")
@pytest.mark.filterwarnings(
    "ignore:Python iterable type:DeprecationWarning"
)
def test_generator_collected_after_f_reports_its_finally(write_module: Loader) -> None:
    """Plain Python writes ``closed`` when the dropped generator is collected;
    after ``f`` returned that write is the documented unhandled-state error,
    reported as unraisable (it runs in the garbage collector)."""
    plain, dec = pair(write_module, AFTER_THE_CALL)
    ref = plain.E()
    g = ref.start_return((1.0, 2.0))
    del g
    assert float(ref.closed) == 1.0
    f, s = dec.E().functionalize()
    caught: list[Any] = []
    old = sys.unraisablehook
    sys.unraisablehook = caught.append
    try:
        g, new = f.start_return(s, (1.0, 2.0))
        del g
        gc.collect()
    finally:
        sys.unraisablehook = old
    assert len(caught) == 1
    user_line(caught[0].exc_value, dec, "self.closed = self.closed + 1")
    same({"x": np.float32(1.0), "closed": np.float32(0.0)}, {k: np.asarray(v) for k, v in new.items()})


@pytest.mark.filterwarnings(
    "ignore:Python iterable type:DeprecationWarning"
)
@pytest.mark.parametrize("jit", [False, True])
def test_callbacks_registered_in_f_called_after_it(write_module: Loader, jit: bool) -> None:
    _, dec = pair(write_module, AFTER_THE_CALL)
    dec.BOX.clear()
    f, s = dec.E().functionalize()
    (staged(f.register_later) if jit else f.register_later)(s, A1)
    partial, weak = dec.BOX
    dec.BOX.clear()
    with pytest.raises(errors.UnhandledLocalStateError) as info:
        partial()
    user_line(info.value, dec, "self.x = self.x + v")
    method = weak()
    assert method is not None
    with pytest.raises(errors.UnhandledLocalStateError) as info:
        method(A1)
    user_line(info.value, dec, "self.x = self.x + v")


CALLABLES_INSIDE = """
@DECORATE
class Sub:
    def __init__(self):
        self.n = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.n += 1
        return x * 2


@DECORATE
class Net:
    def __init__(self):
        self.w = jnp.array([1.0, -2.0, 0.5])
        self.mean = jnp.ones(3)
        self.calls = jnp.zeros((), jnp.int32)
        self.key = jax.random.PRNGKey(3)
        self.sub = Sub()

    # --- writes that do not depend on the transformed input ---------------------------

    def count_step(self, x):
        self.calls += 1
        return x * self.w + self.mean

    def vmap_count(self, xs):
        return jax.vmap(self.count_step)(xs)

    def count_loss(self, x):
        self.calls += 1
        return (jnp.sin(x) * self.w).sum() + self.mean.sum()

    def jacrev_count(self, x):
        return jax.jacrev(lambda v: jnp.sin(v) * self.w + self.count_loss(v))(x)

    def hessian_count(self, x):
        return jax.hessian(self.count_loss)(x)

    def decay_step(self, x):
        self.mean = self.mean * 0.5
        return x * self.mean

    def vmap_decay(self, xs):
        return jax.vmap(self.decay_step)(xs)

    def key_step(self, x):
        self.key, k = jax.random.split(self.key)
        return x + jax.random.normal(k, x.shape)

    def vmap_key(self, xs):
        return jax.vmap(self.key_step)(xs)

    def sub_step(self, x):
        return self.sub(x) + self.calls

    def vmap_sub(self, xs):
        return jax.vmap(self.sub_step)(xs)

    def scan_count(self, x):
        def body(c, v):
            self.calls += 1
            return c + v, c
        return lax.scan(body, 0.0, x)[0]

    def vmap_scan(self, xs):
        return jax.vmap(self.scan_count)(xs)

    def grad_scan(self, x):
        return jax.grad(self.scan_count)(x)

    def fori_count(self, x):
        def body(i, v):
            self.calls += 2
            self.mean = self.mean * 0.9
            return v * self.w
        return lax.fori_loop(0, 3, body, x)

    def vmap_fori(self, xs):
        return jax.vmap(self.fori_count)(xs)

    def _inc(self, v, k):
        self.calls += k
        return v * k

    def cond_count(self, x):
        return lax.cond(self.calls % 2 == 0, lambda v: self._inc(v, 1), lambda v: self._inc(v, 3), x)

    def vmap_cond(self, xs):
        return jax.vmap(self.cond_count)(xs)

    def jacrev_aux(self, x):
        def loss(v):
            self.calls += 1
            y = jnp.sin(v) * self.mean
            return y, y.sum()
        j, aux = jax.jacrev(loss, has_aux=True)(x)
        self.mean = self.mean + aux
        return j

    def pmean_step(self, x):
        m = jax.lax.pmean(x, "b")
        self.mean = 0.9 * self.mean + 0.1 * m
        return x - m

    def vmap_pmean(self, xs):
        return jax.vmap(self.pmean_step, axis_name="b")(xs)

    def count_write(self, x):
        self.mean = self.mean + x
        self.calls += 1
        return self.mean * self.w

    def named_call_write(self, x):
        return jax.named_call(self.count_write, name="cw")(x)

    def cjvp_primal_write(self, x):
        @jax.custom_jvp
        def g(v):
            self.mean = self.mean + v
            self.calls += 1
            return jnp.sin(v) * self.w
        @g.defjvp
        def g_jvp(p, t):
            return g(p[0]), jnp.cos(p[0]) * self.w * t[0]
        return g(x).sum()

    def cvjp_primal_write(self, x):
        @jax.custom_vjp
        def g(v):
            self.mean = self.mean + v
            return v * self.w
        def fwd(v):
            return g(v), v
        def bwd(res, ct):
            return (ct * self.w,)
        g.defvjp(fwd, bwd)
        return g(x).sum()

    def cvjp_bwd_reads_state(self, x):
        @jax.custom_vjp
        def g(v):
            return v * self.w
        def fwd(v):
            return g(v), None
        def bwd(res, ct):
            return (ct * self.mean,)  # <- bwd reads
        g.defvjp(fwd, bwd)
        y = g(x)
        self.mean = self.mean + 1.0
        return y.sum()

    # --- reads ---------------------------------------------------------------------------

    def vectorize_scalar(self, xs):
        self.mean = self.mean + 1.0
        return jnp.vectorize(lambda a, b: a * b + self.mean.sum())(xs, self.w)

    def combine(self, a, b):
        return a * self.w + b + self.mean

    def assoc_method(self, xs):
        self.mean = self.mean + 0.5
        return jax.lax.associative_scan(self.combine, xs)

    def add_pair(self, a, b):
        return a + b

    def reduce_method(self, xs):
        self.calls += 1
        return jax.lax.reduce(xs * self.w, 0.0, self.add_pair, (0,))

    def custom_root_read(self, x):
        self.mean = self.mean + 1.0
        def f(v):
            return v * v - self.mean - 2.0 - x * x
        def solve(g, v0):
            v = v0
            for _ in range(30):
                v = v - g(v) / (2 * v)
            return v
        return jax.lax.custom_root(f, jnp.ones(3), solve, lambda g, y: y / g(jnp.ones(3)))

    def linear_solve_read(self, b):
        self.mean = self.mean + 1.0
        diag = jnp.abs(self.w) + self.mean
        return jax.lax.custom_linear_solve(lambda v: diag * v, b, lambda mv, r: r / diag,
                                           symmetric=True)

    def cvjp_output_assigned(self, x):
        @jax.custom_vjp
        def g(v):
            return v * self.w + self.mean
        def fwd(v):
            return g(v), (v, self.mean)
        def bwd(res, ct):
            return (ct * self.w * 2 + res[1],)
        g.defvjp(fwd, bwd)
        y = g(x)
        self.mean = self.mean + y
        return y.sum()

    def host_double(self, v):
        return (np.asarray(v) * 2).astype(np.float32)

    def pure_cb_method(self, x):
        self.mean = self.mean + x
        return jax.pure_callback(self.host_double, jax.ShapeDtypeStruct((3,), jnp.float32),
                                 self.mean, vmap_method="sequential")

    def cte_branch(self, x):
        with jax.ensure_compile_time_eval():
            if self.mean.sum() > 3:
                y = x * 2
            else:
                y = x
        self.mean = self.mean + x
        return y
"""


# One case per kind of callable and trace: also covered so, jacfwd_count by
# jacrev_count and hessian_count (forward over reverse); vectorize_count by vmap_count
# (jnp.vectorize is vmap) and vectorize_scalar; jacfwd_fori by vmap_fori and grad_scan;
# assoc_count by Nest.associative (a write in the combine function); jacrev_read by
# Net.grad_read_after_write.
CALLABLES_INSIDE_CALLS: dict[str, Any] = {
    "vmap_count": V3_STACK,
    "jacrev_count": V3,
    "hessian_count": V3,
    "vmap_decay": V3_STACK,
    "vmap_key": V3_STACK,
    "vmap_sub": V3_STACK,
    "vmap_scan": V3_STACK,
    "grad_scan": V3,
    "vmap_fori": V3_STACK,
    "vmap_cond": V3_STACK,
    "vmap_pmean": V3_STACK,
    "jacrev_aux": V3,
    "named_call_write": V3,
    "vectorize_scalar": V3_STACK,
    "assoc_method": V3_STACK,
    "reduce_method": V3_STACK,
    "custom_root_read": V3,
    "linear_solve_read": V3,
    "cvjp_output_assigned": V3,
    "pure_cb_method": V3,
}


@pytest.mark.parametrize("method", sorted(CALLABLES_INSIDE_CALLS))
def test_callables_inside_methods(write_module: Loader, method: str) -> None:
    plain, dec = pair(write_module, CALLABLES_INSIDE)
    check(plain, dec, "Net()", [(method, (CALLABLES_INSIDE_CALLS[method],))])


# Each under the outer transformation that meets it: grad through a lax loop under an
# inner vmap and through custom_root's own derivative rule, vmap over jacrev's batching.
CALLABLES_UNDER_GRAD_AND_VMAP = [
    ("vmap_scan", "grad"), ("custom_root_read", "grad"), ("jacrev_aux", "vmap"),
]


@pytest.mark.parametrize("method,transform", CALLABLES_UNDER_GRAD_AND_VMAP)
def test_callables_inside_methods_under_grad_and_vmap_of_f(
    write_module: Loader, method: str, transform: str
) -> None:
    plain, dec = pair(write_module, CALLABLES_INSIDE)
    arg = CALLABLES_INSIDE_CALLS[method]
    x = arg if transform == "grad" else jnp.stack([arg, arg + 1])
    check_transform(plain, dec, "Net()", [(method, (X,))] * 2, x, transform)


@pytest.mark.parametrize("method", ["cjvp_primal_write", "cvjp_primal_write", "cte_branch"])
def test_custom_primals_writing_state_and_compile_time_eval_eagerly_and_in_f(
    write_module: Loader, method: str
) -> None:
    """Eagerly JAX runs a custom_jvp / custom_vjp primal (and an
    ``ensure_compile_time_eval`` block) on concrete values: a write there is plain."""
    plain, dec = pair(write_module, CALLABLES_INSIDE)
    check(plain, dec, "Net()", [(method, (V3,)), (method, (V3 * 2,))], modes=("eager", "f"))


def test_grad_of_f_through_a_custom_vjp_primal_that_writes_state(write_module: Loader) -> None:
    """Under ``jax.grad`` (not jitted) the ``fwd`` rule runs the primal on concrete
    values: the state it writes comes out concrete, as plain Python's would."""
    plain, dec = pair(write_module, CALLABLES_INSIDE)
    f, states = dec.Net().functionalize()

    def ref(x: Any) -> Any:
        m = plain.Net()
        return m.cvjp_primal_write(x), m.mean

    g, (out, new) = jax.grad(
        lambda x: (lambda o: (o[0], o))(f.cvjp_primal_write(states, x)), has_aux=True)(V3)
    assert_same(jax.grad(lambda x: ref(x)[0])(V3), g)
    assert_same(ref(V3), (out, new["mean"]))


def test_grad_of_f_through_a_custom_vjp_bwd_reading_state(write_module: Loader) -> None:
    plain, dec = pair(write_module, CALLABLES_INSIDE)
    ref = plain.Net()
    expected = jax.grad(ref.cvjp_bwd_reads_state)(V3)
    model = dec.Net()
    assert_same(expected, jax.grad(model.cvjp_bwd_reads_state)(V3), "eager")
    assert_same(snapshot(ref), snapshot(model), "eager attributes")
    f, states = dec.Net().functionalize()
    # The backward pass runs after f returned: it reads the state as the call
    # left it (the method assigned it after calling g), as plain Python's reads
    # the attribute after the method returned.
    grad = jax.grad(lambda x: f.cvjp_bwd_reads_state(states, x)[0])
    assert_same(expected, grad(V3), "f")
    assert_same(expected, jax.jit(grad)(V3), "jax.jit of grad of f")


@pytest.mark.parametrize("method", ["cjvp_primal_write", "cvjp_primal_write"])
def test_custom_primal_writing_state_under_jit_is_escaped_state_error(
    write_module: Loader, method: str
) -> None:
    """Under ``jit`` JAX traces the primal into its own jaxpr: plain JAX would leak
    that tracer into the model; autostate refuses at the line that called it."""
    _, dec = pair(write_module, CALLABLES_INSIDE)
    f, states = dec.Net().functionalize()
    with pytest.raises(EscapedStateError, match="State '(mean|calls)' is assigned inside") as info:
        jax.jit(getattr(f, method))(states, V3)
    assert_user_line(info.value, str(dec.__file__))
    assert "fix" in str(info.value)
    out, _ = jax.jit(f.count_write)(states, V3)  # f is left usable
    assert_same(np.asarray((V3 + 1) * jnp.array([1.0, -2.0, 0.5])), out)


def test_compile_time_eval_branch_on_a_state_under_jit_is_traced_value_error(
    write_module: Loader,
) -> None:
    _, dec = pair(write_module, CALLABLES_INSIDE)
    f, states = dec.Net().functionalize()
    with pytest.raises(TracedValueError) as info:
        staged(f.cte_branch)(states, V3)
    user_line(info.value, dec, "if self.mean.sum() > 3:")


ESCAPE_CASES: dict[str, tuple[Any, str]] = {
    "vectorize_write": (V3_STACK, "# <- step writes"),
    "root_write": (V3, "# <- root writes"),
    "linsolve_count": (V3, "# <- matvec writes"),
}


@pytest.mark.parametrize("method", sorted(ESCAPE_CASES))
def test_input_dependent_write_in_a_transformed_callable_is_refused(
    write_module: Loader, method: str
) -> None:
    """Eagerly: ``TracedEagerStateError`` at the write, the model unchanged; through
    ``f`` and ``jit(f)``: ``EscapedStateError`` naming a user line, ``f`` still usable."""
    _, dec = pair(write_module, TRANSFORMED_WRITES)
    arg, text = ESCAPE_CASES[method]
    model = dec.Esc()
    with pytest.raises(TracedEagerStateError) as info:
        getattr(model, method)(arg)
    user_line(info.value, dec, text)
    no_tracer(model)
    assert_same(snapshot(dec.Esc()), snapshot(model), "unchanged")
    f, states = dec.Esc().functionalize()
    for call in (getattr(f, method), jax.jit(getattr(f, method))):
        with pytest.raises(EscapedStateError) as info:
            call(states, arg)
        msg = str(info.value)
        assert f"{__file__}:" in msg or f"{dec.__file__}:" in msg, msg
        assert "fix" in msg
    out, new = jax.jit(f.step)(states, V3)  # f is left usable
    assert_same((V3 * jnp.array([1.0, -2.0, 0.5]), V3, V3), (*out, new["mean"]))
    no_tracer(autostate.freeze(f, new))


# (jacrev_write, jacfwd_write and hessian_write keep the primal write: below.)


@pytest.mark.parametrize("method", ["jacrev_write", "jacfwd_write", "hessian_write"])
def test_write_in_a_derivative_of_a_method_keeps_its_primal_value(
    write_module: Loader, method: str
) -> None:
    """``jax.jacrev/jacfwd/hessian(self.loss)`` whose loss writes ``self.mean``: the
    derivative of the loss with the state a constant, and the state's primal value."""
    _, dec = pair(write_module, TRANSFORMED_WRITES)
    w = dec.Esc().w
    expected = (jnp.diag(-jnp.sin(V3) * w) if method == "hessian_write"
                else jnp.cos(V3) * w)
    model = dec.Esc()
    assert_same(expected, getattr(model, method)(V3), "eager")
    assert_same(V3, model.mean, "eager state")
    no_tracer(model)
    f, states = dec.Esc().functionalize()
    for call in (getattr(f, method), jax.jit(getattr(f, method))):
        out, new = call(states, V3)
        assert_same(expected, out, "output")
        assert_same(V3, new["mean"], "state")


def test_escaped_write_overwritten_in_the_method(write_module: Loader) -> None:
    """Plain Python leaves the grad's tracer only until the method overwrites it;
    the write keeps its primal value, so every mode is plain Python's."""
    plain, dec = pair(write_module, TRANSFORMED_WRITES)
    calls = [("grad_then_overwrite", (V3,)), ("grad_then_overwrite", (V3 * 2,))]
    check(plain, dec, "Esc()", calls)


def test_reduce_computation_writing_state_eagerly_is_traced_eager_state_error(
    write_module: Loader,
) -> None:
    _, dec = pair(write_module, TRANSFORMED_WRITES)
    model = dec.Esc()
    with pytest.raises(TracedEagerStateError) as info:
        model.reduce_write(V3_STACK)
    user_line(info.value, dec, "# <- reduce writes")
    no_tracer(model)


@pytest.mark.xfail(strict=True, reason=(
    "BUG: a jax.lax.reduce computation (a bound method) that assigns state, through f: "
    "a bare AssertionError from JAX's reduce (message '[Array(0, dtype=int32)]'); with f "
    "and states as jit arguments NotImplementedError \"Reduction computations can't close "
    "over Tracers. Please open an issue\"; expected EscapedStateError naming the user's "
    "line, as eagerly (TracedEagerStateError) and for vmap/custom_root/custom_linear_solve"))
def test_reduce_computation_writing_state_through_f_is_an_autostate_error(
    write_module: Loader,
) -> None:
    _, dec = pair(write_module, TRANSFORMED_WRITES)
    f, states = dec.Esc().functionalize()
    with pytest.raises(autostate.AutostateError):
        f.reduce_write(states, V3_STACK)
    with pytest.raises(autostate.AutostateError):
        staged(lambda f, s, x: f.reduce_write(s, x))(f, states, V3_STACK)


@pytest.mark.xfail(strict=True, reason=(
    "BUG: under jax.checking_leaks(), jax.vmap(self.step)(xs) inside a method, where step "
    "assigns state from its input, called through f: JAX's 'Exception: Leaked trace "
    "BatchTrace' instead of the EscapedStateError the same call raises without "
    "checking_leaks (eagerly: TracedEagerStateError at the write). The same for "
    "jnp.vectorize, a custom_linear_solve matvec, a custom_root function and, under "
    "jax.jit(f.m), a custom_vjp / custom_jvp primal ('Leaked trace DynamicJaxprTrace ... "
    "referred to by <LocalStateEffectImpl>'): the functional write keeps the inner trace's "
    "tracer in the state cell until f returns"))
@pytest.mark.usefixtures("young_gc")  # jax.checking_leaks: see young_gc
def test_escaping_write_through_f_under_checking_leaks(write_module: Loader) -> None:
    _, dec = pair(write_module, TRANSFORMED_WRITES)
    f, states = dec.Esc().functionalize()
    with jax.checking_leaks(), pytest.raises(EscapedStateError):
        f.vmap_bound(states, V3_STACK)


CALLBACKS = """
@DECORATE
class Cb:
    def __init__(self):
        self.w = jnp.array([1.0, -2.0, 0.5])
        self.mean = jnp.zeros(3)
        self.last = jnp.zeros(3)
        self.log = []

    def log_host(self, v):
        self.log.append(np.asarray(v))

    def debug_log(self, x):
        self.mean = self.mean + x
        jax.debug.callback(self.log_host, self.mean)
        return self.mean.sum()

    def set_last(self, v):
        self.last = jnp.asarray(v) * 2  # <- host write

    def debug_write(self, x):
        self.mean = self.mean + x
        jax.debug.callback(self.set_last, self.mean)
        return self.mean.sum()

    def set_last_ret(self, v):
        self.last = jnp.asarray(v) * 2  # <- pure host write
        return np.asarray(v, np.float32) + 1

    def pure_write(self, x):
        self.mean = self.mean + x
        return jax.pure_callback(self.set_last_ret, jax.ShapeDtypeStruct((3,), jnp.float32),
                                 self.mean)

    def times_w(self, v):
        return (np.asarray(v) * np.asarray(self.w)).astype(np.float32)

    def pure_reads_param(self, x):
        self.mean = self.mean + x
        return jax.pure_callback(self.times_w, jax.ShapeDtypeStruct((3,), jnp.float32), self.mean)
"""


def _cb_pair(write_module: Loader) -> tuple[types.ModuleType, types.ModuleType]:
    return pair(write_module, CALLBACKS)


def test_debug_callback_method_appending_to_a_list_eagerly_in_f_and_jit_of_f(
    write_module: Loader,
) -> None:
    plain, dec = _cb_pair(write_module)
    ref = plain.Cb()
    expected = [ref.debug_log(V3), ref.debug_log(V3 * 2)]
    assert len(ref.log) == 2
    model = dec.Cb()
    got = [model.debug_log(V3), model.debug_log(V3 * 2)]
    assert_same(expected, got, "eager")
    assert_same(snapshot(ref), snapshot(model), "eager attributes")
    for how in ("f", "jit(f)"):
        m = dec.Cb()
        f, states = m.functionalize()
        call = f.debug_log if how == "f" else staged(f.debug_log)
        outs = []
        for v in (V3, V3 * 2):
            out, states = call(states, v)
            outs.append(out)
        jax.effects_barrier()
        assert_same(expected, outs, how)
        assert_same(snapshot(ref), snapshot(autostate.freeze(f, states)), f"{how}: frozen")
        assert m.log == [], f"{how}: the eager model changed"


@pytest.mark.xfail(strict=True, reason=(
    "BUG: jax.debug.callback(self.log_host, ...) where log_host appends to a list that is "
    "not state, in a call of f under jax.jit with f passed as an argument "
    "(jax.jit(lambda f, s, x: f.m(s, x))(f, states, x)): the callback is bound to the copy "
    "of the model unflattened inside the trace, so the entries are silently lost: "
    "freeze(f, states).log == [] (expected 2 entries, as eagerly and with jax.jit(f.m), or "
    "the documented StateAccessError)"))
def test_debug_callback_method_appending_to_a_list_with_f_as_a_jit_argument(
    write_module: Loader,
) -> None:
    plain, dec = _cb_pair(write_module)
    ref = plain.Cb()
    expected = [ref.debug_log(V3), ref.debug_log(V3 * 2)]
    f, states = dec.Cb().functionalize()
    step = staged(lambda f, s, x: f.debug_log(s, x))
    outs = []
    for v in (V3, V3 * 2):
        out, states = step(f, states, v)
        outs.append(out)
    jax.effects_barrier()
    assert_same(expected, outs)
    assert_same(snapshot(ref), snapshot(autostate.freeze(f, states)), "frozen")


@pytest.mark.xfail(strict=True, reason=(
    "BUG: a host callback given a bound method of the model (jax.debug.callback("
    "self.log_host, ...), jax.pure_callback(self.times_w, ...)) in a call of f under "
    "jax.jit with f passed as an argument: the callback keeps the traced copy of the model "
    "alive; jax.checking_leaks() reports 'Exception: Leaked trace DynamicJaxprTrace ... "
    "<Net>.w is referred to by <method> ... _FlatCallback' (jax.jit(f.m) does not leak)"))
@pytest.mark.usefixtures("young_gc")  # jax.checking_leaks: see young_gc
def test_host_callback_bound_method_with_f_as_a_jit_argument_does_not_leak(
    write_module: Loader,
) -> None:
    _, dec = _cb_pair(write_module)
    f, states = dec.Cb().functionalize()
    with jax.checking_leaks():
        staged(lambda f, s, x: f.debug_log(s, x))(f, states, V3)
        jax.effects_barrier()


@pytest.mark.xfail(strict=True, reason=(
    "BUG: jax.pure_callback(self.times_w, ...) whose host function reads a parameter "
    "(self.w), in a call of f under jax.jit with f passed as an argument: a raw "
    "TracerArrayConversionError inside JAX's JaxRuntimeError ('INTERNAL: CpuCallback "
    "error'); expected the value (as eagerly, through f and with jax.jit(f.m)) or an "
    "autostate error naming the line"))
def test_pure_callback_method_reading_a_parameter_with_f_as_a_jit_argument(
    write_module: Loader,
) -> None:
    plain, dec = _cb_pair(write_module)
    expected = plain.Cb().pure_reads_param(V3)
    f, states = dec.Cb().functionalize()
    assert_same(expected, staged(f.pure_reads_param)(states, V3)[0], "jit(f.m)")
    try:
        out, _ = staged(lambda f, s, x: f.pure_reads_param(s, x))(f, states, V3)
    except autostate.AutostateError as err:
        user_line(err, dec, "np.asarray(self.w)")
    else:
        assert_same(expected, out)


def test_pure_callback_method_reading_a_parameter_eagerly_in_f_and_jit_of_f(
    write_module: Loader,
) -> None:
    plain, dec = _cb_pair(write_module)
    check(plain, dec, "Cb()", [("pure_reads_param", (V3,)), ("pure_reads_param", (V3 * 2,))],
          modes=("eager", "f"))
    f, states = dec.Cb().functionalize()
    ref = plain.Cb()
    for v in (V3, -V3):
        out, states = staged(f.pure_reads_param)(states, v)
        assert_same(ref.pure_reads_param(v), out)


@pytest.mark.parametrize("method", ["debug_write", "pure_write"])
def test_host_callback_method_writing_a_state(write_module: Loader, method: str) -> None:
    """Eagerly and through ``f`` the callback runs during the call: plain values. Under
    ``jit`` it runs after the call: the documented ``UnhandledLocalStateError``, wrapped
    by JAX in its ``JaxRuntimeError``, naming the line. So does a ``jax.pure_callback``
    through ``f`` on an accelerator: called outside a trace, it is a program of its own,
    which runs after ``f`` returned (docs/limitations.md)."""
    plain, dec = _cb_pair(write_module)
    after_f = method == "pure_write" and on_accelerator()
    calls = [(method, (V3,)), (method, (V3 * 2,))]
    check(plain, dec, "Cb()", calls, modes=("eager",) if after_f else ("eager", "f"))
    text = "# <- host write" if method == "debug_write" else "# <- pure host write"
    lines = open(dec.__file__).read().splitlines()
    number = next(i + 1 for i, line in enumerate(lines) if text in line)
    for run in (jax.jit, lambda fn: fn)[: 2 if after_f else 1]:
        f, states = dec.Cb().functionalize()
        with raises_after_the_call() as info:
            out, _ = run(getattr(f, method))(states, V3)
            jax.block_until_ready(out)
        msg = str(info.value)
        assert UnhandledLocalStateError.__name__ in msg
        assert f"{dec.__file__}:{number}" in msg


def batch(i: int) -> tuple[Any, Any]:
    return X_BATCH * (1.0 + 0.25 * i) - 0.1 * i, Y + 0.1 * i


STEPS = [("fit_step", batch(i)) for i in range(2)]


def torch(write_module: Loader) -> tuple[types.ModuleType, types.ModuleType]:
    return pair(write_module, TORCH_HEADER + TORCH_TRAINING)


def test_forward_inside_grad_writing_model_states(write_module: Loader) -> None:
    """The forward pass inside the trainer's value_and_grad updates the model's input
    statistics (values that do not depend on the differentiated weights)."""
    plain, dec = torch(write_module)
    check(plain, dec, "ForwardTrainer()", STEPS)


@pytest.mark.parametrize("mode", ["eager", "f", "jit"])
def test_forward_inside_grad_keeping_its_output_keeps_the_primal(
    write_module: Loader, mode: str
) -> None:
    """``self.last_out = out`` inside jax.grad: plain Python keeps a JVP tracer; the
    state keeps the output's primal value (PyTorch's forward-hook habit)."""
    plain, dec = torch(write_module)
    x, y = batch(0)
    ref = plain.ForwardTrainer()
    w0 = ref.model.w
    ref.fit_step(x, y)
    expected = jnp.tanh((x - ref.model.running_mean) @ w0)  # the forward pass inside
    trainer = dec.ForwardTrainer(keep_output=True)
    if mode == "eager":
        trainer.fit_step(x, y)
        got = trainer
    else:
        f, states = trainer.functionalize()
        _, states = (jax.jit(f.fit_step) if mode == "jit" else f.fit_step)(states, x, y)
        got = autostate.freeze(f, states)
    assert_same(expected, got.model.last_out, "the kept output")
    assert_same(ref.model.w, got.model.w, "the step")
    assert not autostate.lifetime.contains_tracer(snapshot(got))


def cross(write_module: Loader) -> tuple[types.ModuleType, types.ModuleType]:
    plain, dec = pair(write_module, CROSS)
    for mod in (plain, dec):  # a fresh global for every test (the modules are shared)
        mod.TALLY = mod.Tally()
    return plain, dec


@pytest.mark.parametrize("target", ["argument", "global"])
def test_write_to_an_object_outside_f_without_jit_is_plain_python(write_module: Loader,
                                                                  target: str) -> None:
    """The other object is not in f's graph: an eager f call writes it eagerly, as the
    plain call does (and f's own state is threaded)."""
    plain, dec = cross(write_module)
    ref_w, ref_t = plain.Writer(), (plain.Tally() if target == "argument" else plain.TALLY)
    f, states = dec.Writer().functionalize()
    other = dec.Tally() if target == "argument" else dec.TALLY
    for x in (1.0, 2.0, 0.5):
        if target == "argument":
            expected = ref_w.write_arg(x, ref_t)
            out, states = f.write_arg(states, x, other)
        else:
            expected = ref_w.write_global(x)
            out, states = f.write_global(states, x)
        assert_same(expected, out)
    assert_same(snapshot(ref_t), snapshot(other))
    assert_same(ref_w.n, states["n"])


@pytest.mark.parametrize("target", ["argument", "global", "jit argument"])
def test_write_to_an_object_outside_f_under_jit_is_refused(write_module: Loader,
                                                          target: str) -> None:
    _, dec = cross(write_module)
    f, states = dec.Writer().functionalize()
    other = dec.Tally() if target != "global" else dec.TALLY
    before = snapshot(other)
    with raises_autostate(errors.TracedEagerStateError) as err:
        if target == "argument":
            staged(lambda f, s, x: f.write_arg(s, x, other))(f, states, 1.0)
        elif target == "jit argument":
            staged(lambda f, s, x, o: f.write_arg(s, x, o))(f, states, 1.0, other)
        else:
            staged(lambda f, s, x: f.write_global(s, x))(f, states, 1.0)
    user_line(err.value, dec, "TALLY.count += 1" if target == "global" else "other.count += 1")
    assert_same(before, snapshot(other))
    assert not autostate.lifetime.contains_tracer(snapshot(other))
    assert_same(jnp.float32(1.0), f.write_arg(states, 1.0, dec.Tally())[0], "f still works")


def has_tracer(tree: Any) -> bool:
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(tree))


def _transformed(how: str, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    if how == "jit":
        return staged(fn)
    if how == "grad":
        return jax.grad(lambda v: jnp.sum(jnp.asarray(fn(v), jnp.float32)))
    return jax.vmap(fn)


TRACED_WRITES: dict[str, Callable[[Any, Any], Any]] = {
    "inside a method": lambda m, v: m.step(v),
    "from outside": lambda m, v: setattr(m, "x", v),
    "augmented inside a method": lambda m, v: m.add(v),
    "a tuple state holding a tracer": lambda m, v: m.set_pair(v[:2], filled(1.0, 2)),
    "object.__setattr__": lambda m, v: object.__setattr__(m, "x", v),
}


@pytest.mark.parametrize("how", ["jit", "grad", "vmap"])
@pytest.mark.parametrize("write", list(TRACED_WRITES), ids=list(TRACED_WRITES))
def test_a_traced_value_is_refused_and_the_model_unchanged(how: str, write: str) -> None:
    model = written(DECORATED)
    model.step(filled(2.0))  # a frozen slot: the fast path
    before = [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(model)]
    arg = jnp.ones((2, 3)) if how == "vmap" else jnp.ones(3)
    with pytest.raises(autostate.AutostateError):
        _transformed(how, lambda v: TRACED_WRITES[write](model, v))(arg)
    assert not has_tracer(vars(model)) and not has_tracer(model)
    after = [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(model)]
    same_observations(before, after, "model after the refused write", True)
    model.step(filled(3.0))  # still a working eager model
    np.testing.assert_array_equal(np.asarray(model.x), filled(3.0))


# A state every example of a jax.vmap in a method shares (reached through the
# closure or a bound method, not a sub-model passed as a mapped argument),
# assigned a per-example value: plain Python leaves a tracer in it, and no one
# value means what a loop over the examples would. Refused at the vmap in every
# mode, the model and states unchanged, even where the method overwrites the
# state after (``vmap_then_overwrite``: stricter than plain Python).
PER_EXAMPLE_WRITES: dict[str, tuple[str, str, Any, str]] = {
    "nested": (NESTED, "Nest()", "vmap_write", XS3, "n"),
    "bound": (TRANSFORMED_WRITES, "Esc()", "vmap_bound", V3_STACK, "mean"),
    "lambda": (TRANSFORMED_WRITES, "Esc()", "vmap_lambda", V3_STACK, "mean"),
    "overwritten": (TRANSFORMED_WRITES, "Esc()", "vmap_then_overwrite", V3_STACK, "mean"),
    "sub_model": (VMAPCK, "Net()", "vmapped_batched_writer", XB, "total"),
    "closure": (VMAP_INSIDE, "M()", "write_in_vmap", V3_RANGE, "n"),
    "tuple": (ESCAPES, "M()", "vmap_then_read_tuple", XS3, "t"),
}


@pytest.mark.parametrize("case", sorted(PER_EXAMPLE_WRITES))
def test_per_example_write_to_a_shared_state_is_refused_at_the_vmap(
    write_module: Loader, case: str
) -> None:
    source, build, method, arg, state = PER_EXAMPLE_WRITES[case]
    _, dec = pair(write_module, source, fresh=True)
    pattern = rf"State '(\w+\.)*{state}' is assigned a value that differs from example"
    model = eval(build, vars(dec))  # noqa: S307
    before = snapshot(model)
    with pytest.raises(ControlFlowStateError, match=pattern) as info:
        getattr(model, method)(arg)
    assert f"{dec.__file__}:" in str(info.value) and "lax.pmean" in str(info.value)
    assert_same(before, snapshot(model), "unchanged")
    no_tracer(model)
    f, states = eval(build, vars(dec)).functionalize()  # noqa: S307
    for call in modes_of(f, method):
        with pytest.raises(ControlFlowStateError, match=pattern) as info:
            call(states, arg)
        assert f"{dec.__file__}:" in str(info.value)


# A jax.jit helper the decorator never saw, handed a running sub-model: its trace
# writes a state JAX gives no way back, refused. JAX's cache would replay that
# trace on the next call without running the function, so a running model's
# states flatten with a key of their call: the helper is traced, and the write
# refused, at every call (it was silently lost from the second call on).
JITTED_HELPER = """
@jax.jit
def apply(m, x):
    return m(x)


@DECORATE
class Norm:
    def __init__(self):
        self.mean = jnp.zeros(2)

    def __call__(self, x):
        self.mean = 0.9 * self.mean + 0.1 * x
        return x - self.mean


@DECORATE
class Net:
    def __init__(self):
        self.norm = Norm()

    def __call__(self, x):
        return apply(self.norm, x)
"""


def test_a_jitted_helper_writing_a_running_state_is_refused_at_every_call(write_module: Loader) -> None:
    _, dec = pair(write_module, JITTED_HELPER, fresh=True)
    x = jnp.array([0.3, -0.7])
    model = dec.Net()
    for _ in range(2):
        with pytest.raises(TracedEagerStateError):
            model(x)
        no_tracer(model)
    f, states = dec.Net().functionalize()
    for call in (f, staged(f), f, staged(f)):
        with pytest.raises(EscapedStateError, match="norm.mean"):
            call(states, x)
