"""The host-callback fallback, ``@stateful(fallback="host")`` (autostate/host.py)."""

from __future__ import annotations

import copy
import gc
import pickle
import re
import threading
import weakref

import jax
import jax.extend.core  # not imported by jax itself
import jax.numpy as jnp
import numpy as np
import pytest

import autostate
from autostate import host
from autostate.errors import HostStateError, HostStateTypeError

CALLBACK = re.compile(r"python_\w*callback")


def compiled_callbacks(fn, *args) -> int:
    """Python callbacks in the compiled program of ``jax.jit(fn)(*args)``."""
    return len(CALLBACK.findall(jax.jit(fn).lower(*args).compile().as_text()))


def _jaxprs_in_params(params) -> list:
    # jax.extend.core.jaxprs_in_params is newer than the oldest jax supported (0.8.0).
    found = []
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, jax.extend.core.ClosedJaxpr):
                found.append(item.jaxpr)
            elif isinstance(item, jax.extend.core.Jaxpr):
                found.append(item)
    return found


def jaxpr_primitives(fn, *args) -> set[str]:
    names: set[str] = set()

    def visit(jaxpr) -> None:
        for eqn in jaxpr.eqns:
            names.add(eqn.primitive.name)
            for sub in _jaxprs_in_params(eqn.params):
                visit(sub)

    visit(jax.make_jaxpr(fn)(*args).jaxpr)
    return names


@autostate.stateful(fallback="host")
class Counter:
    def __init__(self, start=0.0):
        self.n = jnp.asarray(start, jnp.float32)

    def __call__(self, x):
        self.n += x
        return self.n * 2

    def bump_cond(self, p):
        def yes(_):
            self.n += 1.0
            return 0

        def no(_):
            self.n -= 0.5
            return 0

        jax.lax.cond(p, yes, no, 0)
        return self.n

    def bump_scan(self, k):
        def body(carry, _):
            self.n = self.n * 2 + 1
            return carry, self.n

        return jax.lax.scan(body, 0, None, length=k)[1]

    def bump_while(self, limit):
        def body(i):
            self.n += i
            return i + 1

        jax.lax.while_loop(lambda i: i < limit, body, 0)
        return self.n

    def bump_fori(self, k):
        def body(i, carry):
            self.n = self.n + i
            return carry + self.n

        return jax.lax.fori_loop(0, k, body, 0.0)


def eager_reference(start, ops):
    """The same updates as plain Python floats."""
    n, outs = start, []
    for op, arg in ops:
        if op == "cond":
            n = n + 1.0 if arg else n - 0.5
            outs.append(n)
        elif op == "scan":
            seq = []
            for _ in range(arg):
                n = n * 2 + 1
                seq.append(n)
            outs.append(seq)
        elif op == "while":
            for i in range(arg):
                n += i
            outs.append(n)
        elif op == "fori":
            carry = 0.0
            for i in range(arg):
                n = n + i
                carry += n
            outs.append(carry)
    return n, outs


# --- 1. closures in lax control flow ----------------------------------------------


def test_closures_in_lax_control_flow_under_jit_match_the_eager_python_loop():
    traces = []

    def call(m, op, arg):
        traces.append(op)
        return getattr(m, f"bump_{op}")(arg)

    jitted = {
        "cond": jax.jit(lambda m, p: call(m, "cond", p)),
        "scan": jax.jit(lambda m: call(m, "scan", 3)),
        "while": jax.jit(lambda m, k: call(m, "while", k)),
        "fori": jax.jit(lambda m: call(m, "fori", 4)),
    }
    ops = [
        ("cond", True),
        ("cond", False),
        ("scan", 3),
        ("while", 4),
        ("fori", 4),
        ("cond", True),
        ("scan", 3),
        ("while", 3),
        ("fori", 4),
        ("cond", False),
    ]
    c = Counter(1.0)
    outs = []
    for op, arg in ops:
        if op in ("scan", "fori"):
            outs.append(jitted[op](c))
        else:
            outs.append(jitted[op](c, arg))
    n, expected = eager_reference(1.0, ops)
    assert float(c.n) == n
    for got, want in zip(outs, expected):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want, np.float32))
    # Repeated calls reuse one trace each: state lives outside the program.
    assert sorted(traces) == ["cond", "fori", "scan", "while"]


def test_lax_control_flow_without_jit_updates_in_place():
    c = Counter(0.0)
    assert float(c.bump_cond(True)) == 1.0
    np.testing.assert_allclose(c.bump_scan(2), [3.0, 7.0])
    assert float(c.n) == 7.0
    assert float(c(3.0)) == 20.0
    assert float(c.n) == 10.0


def test_the_model_as_a_closure_and_as_an_argument_share_one_store():
    c = Counter(0.0)
    by_closure = jax.jit(lambda x: c(x))
    by_argument = jax.jit(lambda m, x: m(x))
    by_closure(1.0)
    by_argument(c, 2.0)
    by_closure(3.0)
    assert float(c.n) == 6.0
    # A pytree copy (as an optimizer update makes) keeps using the same state.
    copied = jax.tree.map(lambda leaf: leaf, c)
    copied(4.0)
    assert float(c.n) == 10.0


# --- 2. vmap ----------------------------------------------------------------------


def test_vmap_keeps_per_example_state_across_jitted_calls():
    c = Counter(10.0)
    step = jax.jit(jax.vmap(lambda x: c(x)))
    xs = jnp.arange(3.0)
    np.testing.assert_allclose(step(xs), 2 * (10.0 + xs))
    np.testing.assert_allclose(c.n, 10.0 + xs)  # outside vmap: the stacked examples
    np.testing.assert_allclose(step(xs), 2 * (10.0 + 2 * xs))
    np.testing.assert_allclose(c.n, 10.0 + 2 * xs)
    # The same without jit.
    np.testing.assert_allclose(jax.vmap(lambda x: c(x))(xs), 2 * (10.0 + 3 * xs))
    # Writing the stacked value back outside vmap keeps it per-example.
    c.n = c.n - 10.0
    np.testing.assert_allclose(step(xs), 2 * (4 * xs))
    # Assigning a per-example-shaped value outside vmap makes it shared again.
    c.n = jnp.asarray(1.0)
    assert float(jax.jit(lambda x: c(x))(1.0)) == 4.0


def test_nested_vmap_and_a_state_written_by_the_outer_vmap_only():
    c = Counter(0.0)
    xs = jnp.arange(6.0).reshape(2, 3)
    nested = jax.jit(jax.vmap(jax.vmap(lambda x: c(x))))
    nested(xs)
    nested(xs)
    np.testing.assert_allclose(c.n, 2 * xs)

    d = Counter(0.0)

    def outer(x):
        d(x)  # per outer example
        return jax.vmap(lambda y: d.n + y)(jnp.arange(3.0))  # shared by the inner axis

    out = jax.jit(jax.vmap(outer))(jnp.asarray([1.0, 5.0]))
    np.testing.assert_allclose(out, [[1.0, 2.0, 3.0], [5.0, 6.0, 7.0]])
    np.testing.assert_allclose(d.n, [1.0, 5.0])


def test_vmap_over_a_scan_whose_body_updates_state():
    c = Counter(0.0)

    def run(x):
        def body(carry, _):
            c(x)
            return carry, c.n

        return jax.lax.scan(body, 0, None, length=3)[1]

    out = jax.jit(jax.vmap(run))(jnp.asarray([1.0, 2.0]))
    np.testing.assert_allclose(out, [[1.0, 2.0, 3.0], [2.0, 4.0, 6.0]])
    np.testing.assert_allclose(c.n, [3.0, 6.0])


def test_vmap_batch_axes_mismatch_is_a_clear_error():
    c = Counter(0.0)
    jax.vmap(lambda x: c(x))(jnp.arange(3.0))
    for fn in (jax.vmap(lambda x: c(x)), jax.jit(jax.vmap(lambda x: c(x)))):
        with pytest.raises(HostStateError) as info:
            fn(jnp.arange(4.0))
        message = str(info.value)
        assert "Counter.n" in message
        assert "vmap axes of sizes (3,)" in message and "(4,)" in message
        assert "fix:" in message
    np.testing.assert_allclose(c.n, [0.0, 1.0, 2.0])  # untouched by the failed calls


def test_a_program_traced_before_its_state_was_batched_fails_at_run_time():
    c = Counter(0.0)
    read = jax.jit(lambda: c.n + 0.0)
    assert float(read()) == 0.0
    jax.vmap(lambda x: c(x))(jnp.arange(3.0))
    # The compiled read expects a scalar; the state now holds three examples.
    with pytest.raises(RuntimeError, match="Counter.n now holds values for vmap axes of sizes"):
        read()
    np.testing.assert_allclose(jax.jit(lambda: c.n + 0.0)(), [0.0, 1.0, 2.0])


# --- 3. grad ----------------------------------------------------------------------


def test_grad_reads_and_writes_state_as_a_constant():
    c = Counter(1.0)

    def loss(x):
        return c(x) * x  # (n + x) * 2 * x with n read back as a constant

    # c(x) writes n + x, then reads it back: a constant for differentiation.
    value, grad = jax.value_and_grad(loss)(2.0)
    assert float(value) == 12.0 and float(grad) == 6.0
    assert float(c.n) == 3.0
    g = jax.jit(jax.grad(loss))
    assert float(g(1.0)) == 8.0  # n becomes 4
    assert float(g(1.0)) == 10.0  # n becomes 5
    assert float(jax.grad(jax.jit(loss))(1.0)) == 12.0
    assert float(c.n) == 6.0


# --- 4. errors --------------------------------------------------------------------


@autostate.stateful(fallback="host")
class Cache:
    def __init__(self):
        self.buffer = autostate.state(jax.ShapeDtypeStruct((3,), jnp.float32))
        self.stats = {"count": jnp.zeros((), jnp.int32), "sum": jnp.zeros(2)}

    def fill(self, x):
        self.buffer = jnp.full((3,), x, jnp.float32)

    def total(self):
        return self.buffer.sum()

    def record(self, stats):
        self.stats = stats


def test_get_before_set_is_an_error_eagerly_and_when_traced():
    cache = Cache()
    with pytest.raises(HostStateError, match="Cache.buffer was read before it was set"):
        cache.total()
    with pytest.raises(HostStateError, match="read before it was set"):
        jax.jit(lambda m: m.total())(cache)
    # Set then get in one program is fine: the write runs first.
    assert float(jax.jit(lambda m, x: (m.fill(x), m.total())[1])(cache, 2.0)) == 6.0
    np.testing.assert_allclose(cache.buffer, [2.0, 2.0, 2.0])


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (jnp.zeros(3), HostStateTypeError, r"changed shape from \(\) to \(3,\)"),
        (jnp.zeros((), jnp.int32), HostStateTypeError, "changed dtype from float32 to int32"),
        ("five", HostStateTypeError, "must be a JAX/NumPy array"),
        (None, HostStateTypeError, "must be a JAX/NumPy array"),
    ],
)
def test_a_write_keeps_shape_dtype_and_array_type(value, error, match):
    c = Counter(1.0)
    with pytest.raises(error, match=match):
        c.n = value
    with pytest.raises(TypeError, match=match):  # the seed's builtin
        jax.jit(lambda m: setattr(m, "n", value))(c)
    assert float(c.n) == 1.0


def test_a_write_keeps_pytree_structure():
    cache = Cache()
    cache.record({"count": jnp.ones((), jnp.int32), "sum": jnp.ones(2)})
    with pytest.raises(HostStateTypeError, match="Cache.stats changed pytree structure"):
        cache.record({"count": jnp.ones((), jnp.int32)})
    with pytest.raises(HostStateTypeError, match="changed pytree structure"):
        jax.jit(lambda m: m.record([jnp.ones((), jnp.int32), jnp.ones(2)]))(cache)
    assert int(cache.stats["count"]) == 1


def test_non_array_initial_state_is_a_type_error(write_module):
    module = write_module(
        """
        import autostate

        @autostate.stateful(fallback="host")
        class Named:
            def __init__(self):
                self.label = "start"

            def rename(self, label):
                self.label = label
        """
    )
    with pytest.raises(TypeError, match="Named.label was given the str value 'start'"):
        module.Named()


def test_python_numbers_become_arrays():
    c = Counter(0.0)
    c.n = 2.5
    assert isinstance(c.n, jax.Array) and float(c.n) == 2.5


# --- 5. inference mode ------------------------------------------------------------


def test_inference_mode_reads_state_at_the_jit_boundary_without_callbacks():
    c = Counter(3.0)
    frozen = autostate.inference_mode(c)
    traces = []

    def predict(m, x):
        traces.append(1)
        return m.n * x

    names = jaxpr_primitives(predict, frozen, 2.0)
    assert not names & {"host_get", "host_set", "io_callback"}, names
    assert compiled_callbacks(predict, frozen, 2.0) == 0
    traces.clear()
    run = jax.jit(lambda m, x: predict(m, x))
    assert float(run(frozen, 2.0)) == 6.0
    # Training the original model continues; the view follows it. (A typed
    # input: after jax 0.10.2 adds a Python float to an unpickled weak-typed
    # array, strong f32 + Python float comes out weak-typed, a re-trace.)
    c(jnp.float32(1.0))
    assert float(run(frozen, 2.0)) == 8.0
    assert len(traces) == 1  # the state is an input: no re-trace per call
    # The un-frozen model does call back.
    assert compiled_callbacks(lambda m, x: m(x), c, 2.0) == 3


def test_inference_mode_forbids_set_and_captured_models():
    c = Counter(3.0)
    frozen = autostate.inference_mode(c)
    with pytest.raises(HostStateError, match="Counter.n was set in inference mode"):
        frozen(1.0)
    with pytest.raises(HostStateError, match="set in inference mode"):
        jax.jit(lambda m, x: m(x))(frozen, 1.0)
    assert float(frozen.n) == 3.0  # eager reads are fine
    # A captured view bakes the current value in, like any closed-over array.
    assert float(jax.jit(lambda x: frozen.n * x)(2.0)) == 6.0
    with pytest.raises(
        HostStateTypeError, match="expects a model with host-fallback state; list has none"
    ):
        autostate.inference_mode([jnp.zeros(2)])
    assert float(c.n) == 3.0


def test_an_inference_view_made_inside_a_staged_trace_is_refused():
    # Made inside jax.jit, a view has no boundary to read its state at: the
    # value read while tracing would be baked in and reused after the host
    # state changed.
    c = Counter(1.0)
    step = jax.jit(lambda m, x: autostate.inference_mode(m).n * x)
    with pytest.raises(HostStateError, match=r"inside a jax.jit trace") as info:
        step(c, 2.0)
    assert "view = autostate.inference_mode(model)" in str(info.value)
    assert "test_host.py:" in str(info.value)
    with pytest.raises(HostStateError, match=r"inside a jax.jit trace"):
        jax.lax.scan(lambda k, x: (k, autostate.inference_mode(c).n * x), 0, jnp.ones(2))
    # The view made outside and passed in reads the current value on every call.
    view = autostate.inference_mode(c)
    run = jax.jit(lambda v, x: v.n * x)
    assert float(run(view, 2.0)) == 2.0
    c(jnp.float32(4.0))
    assert float(run(view, 2.0)) == 10.0
    # Under vmap (nothing staged) the view is read on each call, as plain Python reads it.
    read = jax.vmap(lambda x: autostate.inference_mode(c).n * x)
    np.testing.assert_array_equal(read(jnp.ones(2)), [5.0, 5.0])


# --- 6. mixing with the functional engine ----------------------------------------


@autostate.stateful(category="host", fallback="host")
class Gate:
    def __init__(self):
        self.opened = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        def open_(_):
            self.opened += 1
            return 0

        jax.lax.cond(x.sum() > 0, open_, lambda _: 0, 0)
        return x * 2


@autostate.stateful
class Net:
    def __init__(self):
        self.gate = Gate()
        self.total = jnp.zeros(())

    def __call__(self, x):
        y = self.gate(x)
        self.total = self.total + y.sum()
        return y


def test_a_host_submodel_inside_one_functionalize_of_the_functional_rest():
    net = Net()
    f, states = net.functionalize("state")
    assert list(states) == ["total"]
    step = jax.jit(lambda f, s, x: f(s, x))
    for x in (jnp.ones(2), -jnp.ones(2), jnp.ones(2)):
        _, states = step(f, states, x)
    assert float(states["total"]) == 4.0
    assert int(net.gate.opened) == 2  # the host part called back into its store
    assert float(net.total) == 0.0  # the functional part did not touch the model


def test_functionalize_moves_host_state_into_the_dict_and_freeze_captures_it():
    c = Counter(0.0)
    c(2.0)
    f, states = c.functionalize()
    assert {k: float(v) for k, v in states.items()} == {"n": 2.0}
    out, states = jax.jit(lambda f, s, x: f(s, x))(f, states, 1.0)
    assert float(out) == 6.0 and float(states["n"]) == 3.0
    assert float(c.n) == 2.0  # functional: the store is untouched
    assert compiled_callbacks(lambda f, s, x: f(s, x), f, states, 1.0) == 0
    assert {k: float(v) for k, v in autostate.state_dict(c).items()} == {"n": 2.0}
    frozen = autostate.freeze(f, states)
    assert isinstance(frozen, Counter)
    f2, states2 = frozen.functionalize()
    assert float(states2["n"]) == 3.0

    net = Net()
    net(jnp.ones(2))
    _, all_states = net.functionalize()
    assert {k: float(v) for k, v in all_states.items()} == {"gate.opened": 1.0, "total": 4.0}


# --- 7. isolation, threads, garbage collection ---------------------------------------


def test_two_instances_never_share_a_store():
    a, b = Counter(0.0), Counter(0.0)
    step = jax.jit(lambda m, x: m(x))
    step(a, 1.0)
    step(a, 1.0)
    step(b, 5.0)
    assert (float(a.n), float(b.n)) == (2.0, 5.0)
    assert a.__dict__["n"].store is not b.__dict__["n"].store
    # deepcopy and pickle give independent stores holding the current values.
    for clone in (copy.deepcopy(a), pickle.loads(pickle.dumps(a))):
        clone(10.0)
        assert (float(a.n), float(clone.n)) == (2.0, 12.0)


def test_threads_calling_different_instances_lose_no_update():
    models = [Counter(0.0) for _ in range(8)]
    step = jax.jit(lambda m: m(1.0))
    calls = 25
    errors = []

    def run(m):
        try:
            for _ in range(calls):
                step(m)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(m,)) for m in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert [float(m.n) for m in models] == [float(calls)] * 8


def test_a_store_is_released_with_its_model():
    jax.clear_caches()  # earlier tests' jit caches hold their models' structure
    gc.collect()
    before = host.live_store_count()
    c = Counter(0.0)
    c(1.0)
    store = weakref.ref(c.__dict__["n"].store)
    assert host.live_store_count() == before + 1
    del c
    gc.collect()
    assert store() is None
    assert host.live_store_count() == before

    # A compiled program holds its store weakly; jit's own cache keys hold the
    # model's structure until the cache is cleared, as for any static value.
    c = Counter(0.0)
    jax.jit(lambda m: m(1.0))(c)
    store = weakref.ref(c.__dict__["n"].store)
    del c
    jax.clear_caches()
    gc.collect()
    assert store() is None
    assert host.live_store_count() == before


# --- 8. cost ----------------------------------------------------------------------


def test_one_callback_per_state_access():
    c = Counter(0.0)

    def three_updates(m, x):
        for _ in range(3):
            m.n = m.n + x
        return m.n

    assert compiled_callbacks(three_updates, c, 1.0) == 7  # 3 x (get + set) + final get
    # Counted as they run: a fori_loop body with three accesses, five iterations.
    before = host.callback_count(c)
    jax.jit(lambda m: m.bump_fori(5))(c)
    assert host.callback_count(c) - before == 15
    c.n = c.n + 1.0  # eager accesses touch the store directly
    assert host.callback_count(c) - before == 15
    cache = Cache()
    # A pytree state is still one callback per access, whatever its leaf count.
    assert compiled_callbacks(lambda m: m.record(m.stats), cache) == 2


# --- 8. freeze and load give host-backed models back ------------------------------------


def test_freeze_gives_a_host_model_its_store_back_so_closures_keep_working():
    c = Counter(1.0)
    f, states = c.functionalize()
    _, states = jax.jit(lambda f, s, x: f(s, x))(f, states, 2.0)
    frozen = autostate.freeze(f, states)
    slot = frozen.__dict__["n"]
    assert type(slot) is host.HostSlot and slot.store is not c.__dict__["n"].store
    assert float(frozen.n) == 3.0
    # A closure assigning state inside lax control flow, eagerly and under jit,
    # continues from the frozen value.
    n, (want,) = eager_reference(3.0, [("fori", 3)])
    assert float(frozen.bump_fori(3)) == want and float(frozen.n) == n
    n, (want,) = eager_reference(n, [("fori", 4)])
    assert float(jax.jit(lambda m: m.bump_fori(4))(frozen)) == want
    assert float(frozen.n) == n
    assert float(c.n) == 1.0  # the original keeps its own store
    f2, states2 = frozen.functionalize()
    assert float(states2["n"]) == n


@autostate.stateful(fallback="host")
class TwoKinds:
    def __init__(self):
        self.n = jnp.zeros(())
        self.seen = autostate.state(jnp.zeros(()), category="seen")

    def __call__(self, x):
        self.n += x
        self.seen += 1.0
        return self.n


def test_freeze_restores_only_the_host_part_of_a_mixed_model():
    net = Net()
    net(jnp.ones(2))
    f, states = net.functionalize()
    # (Running f would fail: the gate's closure cannot assign functional state.)
    states = {"gate.opened": states["gate.opened"] + 1, "total": states["total"] * 2}
    frozen = autostate.freeze(f, states)
    assert type(frozen.gate.__dict__["opened"]) is host.HostSlot
    assert type(frozen.__dict__["total"]) is autostate.effects.FrozenLocalStateRequest
    assert (int(frozen.gate.opened), float(frozen.total)) == (2, 8.0)
    frozen(jnp.ones(2))  # eagerly: the gate's lax.cond closure writes its store
    jax.jit(lambda m, x: m.gate(x))(frozen, jnp.ones(2))
    assert (int(frozen.gate.opened), float(frozen.total)) == (4, 12.0)
    assert int(net.gate.opened) == 1

    # A host state functionalize did not handle keeps the original's slot.
    f, states = net.functionalize("state")
    frozen = autostate.freeze(f, states)
    assert frozen.gate.__dict__["opened"] is net.gate.__dict__["opened"]

    # Within one instance: the handled states get a new store, the others keep theirs.
    two = TwoKinds()
    two(1.0)
    f, states = two.functionalize("state")
    assert list(states) == ["n"]
    frozen = autostate.freeze(f, states)
    assert frozen.__dict__["seen"] is two.__dict__["seen"]
    assert frozen.__dict__["n"].store is not two.__dict__["n"].store
    jax.jit(lambda m, x: m(x))(frozen, 2.0)
    assert (float(frozen.n), float(two.n), float(two.seen)) == (3.0, 1.0, 2.0)


def test_load_and_load_state_dict_give_host_backed_models(tmp_path):
    c = Counter(0.0)
    c(2.0)
    autostate.save(tmp_path / "counter.npz", c)
    for loaded in (
        autostate.load_state_dict(Counter(5.0), autostate.state_dict(c)),
        autostate.load(tmp_path / "counter.npz", like=Counter(5.0)),
    ):
        assert type(loaded.__dict__["n"]) is host.HostSlot
        n, (want,) = eager_reference(2.0, [("fori", 3)])
        assert float(jax.jit(lambda m: m.bump_fori(3))(loaded)) == want
        assert float(loaded.n) == n
    assert float(c.n) == 2.0


def test_freeze_inside_a_trace_keeps_frozen_requests():
    c = Counter(1.0)
    f, states = c.functionalize()

    def inside(f, s):
        frozen = autostate.freeze(f, s)
        assert type(frozen.__dict__["n"]) is autostate.effects.FrozenLocalStateRequest
        return frozen.n + 1

    assert float(jax.jit(inside)(f, states)) == 2.0
