"""State written inside ``lax`` control flow and ``jax.checkpoint`` (autostate/control.py).

Every primitive runs a model whose bodies read and assign state (closures,
lambdas, bound methods, sub-model calls, traced subscripts, augmented
assignments), in every mode — eager, ``f`` without jit, jit, grad, vmap —
and is compared with the same computation written by hand in pure JAX with
the states threaded through the carry.
"""

from __future__ import annotations

import collections
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.lax import scan as plain_scan
from jax.lax import while_loop

import autostate
from autostate.errors import ControlFlowStateError, EscapedStateError, TracedEagerStateError
from autostate.lifetime import contains_tracer


def _weights(seed: int, n: int = 3) -> jax.Array:
    return jax.random.normal(jax.random.PRNGKey(seed), (n, n)) * 0.5


# --- models and their hand-threaded references ----------------------------------------


@autostate.stateful
class Stats:
    def __init__(self):
        self.mean = jnp.zeros(3)
        self.steps = jnp.zeros((), jnp.int32)

    def __call__(self, h):
        self.mean = 0.9 * self.mean + 0.1 * h
        self.steps += 1
        return h


@autostate.stateful
class ScanModel:
    """A bound method as the scan body; a sub-model keeps statistics in it."""

    def __init__(self):
        self.w = _weights(0)
        self.stats = Stats()
        self.hist = jnp.zeros((4, 3))
        self.last = jnp.zeros(3)
        self.frozen = jnp.zeros(())

    def _step(self, h, x):
        h = jnp.tanh(h @ self.w + x)
        h = self.stats(h)
        self.hist[self.stats.steps % 4] = h  # a traced index
        self.last = h
        self.frozen = lax.stop_gradient(h.sum())
        return h, h.sum()

    def __call__(self, xs):
        _, ys = lax.scan(self._step, jnp.zeros(3), xs)
        # Reads a state written inside the scan: the gradient flows through it.
        return ys.sum() + (self.last * self.stats.mean).sum()


def scan_reference(model, states, xs):
    w = model.w

    def step(carry, x):
        h, mean, steps, hist, last, frozen = carry
        h = jnp.tanh(h @ w + x)
        mean = 0.9 * mean + 0.1 * h
        steps = steps + 1
        hist = hist.at[steps % 4].set(h)
        return (h, mean, steps, hist, h, lax.stop_gradient(h.sum())), h.sum()

    names = ("stats.mean", "stats.steps", "hist", "last", "frozen")
    init = (jnp.zeros(3), *(states[n] for n in names))
    (_, *new), ys = lax.scan(step, init, xs)
    new = dict(zip(names, new))
    return ys.sum() + (new["last"] * new["stats.mean"]).sum(), new


@autostate.stateful
class Block:
    def __init__(self, seed):
        self.w = _weights(seed)
        self.mean = jnp.zeros(3)
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        y = jnp.tanh(x @ self.w)
        self.mean = 0.9 * self.mean + 0.1 * y
        self.calls += 1
        return x + y


@autostate.stateful
class CondModel:
    """Stochastic depth: ``lax.cond(skip, identity, block, x)``."""

    def __init__(self):
        self.block = Block(1)
        self.skipped = jnp.zeros(())

    def __call__(self, x):
        def skip(x):
            self.skipped += 1.0
            return x

        return jax.lax.cond(x.sum() > 0, skip, self.block, x).sum()


def cond_reference(model, states, x):
    w = model.block.w

    def skip(ops):
        x, (mean, calls, skipped) = ops
        return x, (mean, calls, skipped + 1.0)

    def run(ops):
        x, (mean, calls, skipped) = ops
        y = jnp.tanh(x @ w)
        return x + y, (0.9 * mean + 0.1 * y, calls + 1, skipped)

    init = (states["block.mean"], states["block.calls"], states["skipped"])
    y, (mean, calls, skipped) = lax.cond(x.sum() > 0, skip, run, (x, init))
    return y.sum(), {"block.mean": mean, "block.calls": calls, "skipped": skipped}


@autostate.stateful
class SwitchModel:
    def __init__(self):
        self.a = jnp.zeros(3)
        self.b = jnp.zeros((), jnp.int32)
        self.w = _weights(2)

    def __call__(self, x):
        index = jnp.clip(jnp.floor(x.sum()).astype(jnp.int32), 0, 2)

        def first(x):
            self.a += x
            return x * 2.0

        def second(x):
            self.b += 1
            return jnp.tanh(x @ self.w)

        return lax.switch(index, [first, second, lambda x: x + self.a], x).sum()


def switch_reference(model, states, x):
    w = model.w
    index = jnp.clip(jnp.floor(x.sum()).astype(jnp.int32), 0, 2)

    def first(x, a, b):
        a = a + x
        return x * 2.0, a, b

    def second(x, a, b):
        b = b + 1
        return jnp.tanh(x @ w), a, b

    branches = [first, second, lambda x, a, b: (x + a, a, b)]
    y, a, b = lax.switch(index, branches, x, states["a"], states["b"])
    return y.sum(), {"a": a, "b": b}


@autostate.stateful
class WhileModel:
    """Writes in the body, reads in ``cond_fun``; ``from jax.lax import while_loop``."""

    def __init__(self):
        self.n = jnp.zeros((), jnp.int32)
        self.acc = jnp.zeros(3)

    def __call__(self, x):
        def body(v):
            self.n += 1
            self.acc = self.acc + v
            return v * 0.5

        return while_loop(lambda v: (self.acc.sum() < 5.0) & (self.n < 6), body, x).sum()


def while_reference(model, states, x):
    def body(carry):
        v, n, acc = carry
        n = n + 1
        return v * 0.5, n, acc + v

    carry = (x, states["n"], states["acc"])
    v, n, acc = lax.while_loop(lambda c: (c[2].sum() < 5.0) & (c[1] < 6), body, carry)
    return v.sum(), {"n": n, "acc": acc}


@autostate.stateful
class Decoder:
    """A KV-cache greedy decode inside ``lax.fori_loop``."""

    def __init__(self):
        self.w = _weights(3)
        self.cache = jnp.zeros((8, 3))
        self.pos = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        def body(i, h):
            h = jnp.tanh(h @ self.w)
            self.cache[self.pos] = h
            self.pos += 1
            return h + 0.1 * self.cache.sum(0)

        return jax.lax.fori_loop(0, 4, body, x).sum()


def fori_reference(model, states, x):
    w = model.w

    def body(i, carry):
        h, cache, pos = carry
        h = jnp.tanh(h @ w)
        cache = cache.at[pos].set(h)
        return h + 0.1 * cache.sum(0), cache, pos + 1

    h, cache, pos = lax.fori_loop(0, 4, body, (x, states["cache"], states["pos"]))
    return h.sum(), {"cache": cache, "pos": pos}


@autostate.stateful
class MapModel:
    def __init__(self):
        self.count = jnp.zeros(())
        self.total = jnp.zeros(())

    def __call__(self, x):
        def row(r):
            self.count += 1.0
            self.total = self.total + r.sum()
            return r * self.count

        return jax.lax.map(row, x.reshape(3, 1)).sum()


def map_reference(model, states, x):
    def step(carry, r):
        count, total = carry
        count = count + 1.0
        return (count, total + r.sum()), r * count

    (count, total), ys = lax.scan(step, (states["count"], states["total"]), x.reshape(3, 1))
    return ys.sum(), {"count": count, "total": total}


@autostate.stateful
class BNBlock:
    def __init__(self, seed):
        self.w = _weights(seed)
        self.mean = jnp.zeros(3)
        self.var = jnp.ones(3)

    def __call__(self, x):
        m, v = x.mean(0), x.var(0)
        self.mean = 0.9 * self.mean + 0.1 * m
        self.var = 0.9 * self.var + 0.1 * v
        return jnp.tanh(((x - m) / jnp.sqrt(v + 1e-5)) @ self.w)


@autostate.stateful
class Deep:
    """Per-block gradient checkpointing over blocks with BatchNorm statistics."""

    def __init__(self, remat=True):
        self.blocks = [BNBlock(10 + i) for i in range(3)]
        self.remat = remat

    def __call__(self, x):
        x = x.reshape(1, 3) * jnp.arange(1.0, 3.0)[:, None]
        for i, block in enumerate(self.blocks):
            if not self.remat:
                x = block(x)
            elif i == 0:
                x = jax.checkpoint(block)(x)
            elif i == 1:
                x = jax.remat(block, policy=jax.checkpoint_policies.nothing_saveable)(x)
            else:

                @functools.partial(jax.checkpoint, prevent_cse=False)
                def run(x, block=block):
                    return block(x)

                x = run(x)
        return x.sum()


def deep_reference(model, states, x):
    x = x.reshape(1, 3) * jnp.arange(1.0, 3.0)[:, None]
    new = {}
    for i, block in enumerate(model.blocks):
        m, v = x.mean(0), x.var(0)
        new[f"blocks[{i}].mean"] = 0.9 * states[f"blocks[{i}].mean"] + 0.1 * m
        new[f"blocks[{i}].var"] = 0.9 * states[f"blocks[{i}].var"] + 0.1 * v
        x = jnp.tanh(((x - m) / jnp.sqrt(v + 1e-5)) @ block.w)
    return x.sum(), new


CASES = {
    "scan": (ScanModel, scan_reference, (4, 3)),
    "cond": (CondModel, cond_reference, (3,)),
    "switch": (SwitchModel, switch_reference, (3,)),
    "while_loop": (WhileModel, while_reference, (3,)),
    "fori_loop": (Decoder, fori_reference, (3,)),
    "map": (MapModel, map_reference, (3,)),
    "checkpoint": (Deep, deep_reference, (3,)),
}
# while_loop has no reverse-mode derivative in JAX itself; it is differentiated
# forward (jax.jacfwd), the derivative JAX gives it.
FORWARD_ONLY = {"while_loop"}


def _input(shape, seed=0, batch=None):
    full = shape if batch is None else (batch, *shape)
    x = jax.random.normal(jax.random.PRNGKey(seed + 7), full)
    if batch is not None:
        # Mixed signs, so a cond/switch predicate differs across examples.
        signs = jnp.where(jnp.arange(batch) % 2 == 0, 1.0, -1.0)
        x = x.reshape(batch, -1) + 2.0 * signs[:, None]
        x = x.reshape(full)
    else:
        x = x + 1.0
    return x


def _close(actual, expected):
    assert jax.tree_util.tree_structure(actual) == jax.tree_util.tree_structure(expected)
    for a, e in zip(jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected)):
        assert not isinstance(a, jax.core.Tracer)
        assert np.asarray(a).dtype == np.asarray(e).dtype
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("case", sorted(CASES))
def test_eager(case):
    make, reference, shape = CASES[case]
    model = make()
    _, states = make().functionalize()
    for seed in (0, 1):
        x = _input(shape, seed)
        out = model(x)
        expected, states = reference(model, states, x)
        _close(out, expected)
        _close(model.functionalize()[1], states)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("jit", [False, True], ids=["f", "jit"])
def test_functionalized(case, jit):
    make, reference, shape = CASES[case]
    model = make()
    f, states = model.functionalize()
    expected_states = states
    call = jax.jit(lambda f, s, x: f(s, x)) if jit else (lambda f, s, x: f(s, x))
    for seed in (0, 1):
        x = _input(shape, seed)
        out, states = call(f, states, x)
        assert not contains_tracer(states)
        expected, expected_states = reference(model, expected_states, x)
        _close(out, expected)
        _close(states, expected_states)


@pytest.mark.parametrize("case", sorted(CASES))
def test_grad(case):
    make, reference, shape = CASES[case]
    model = make()
    f, states = model.functionalize()
    x = _input(shape)
    derivative = jax.jacfwd if case in FORWARD_ONLY else jax.grad

    def loss(x):
        return f(states, x)

    def reference_loss(x):
        return reference(model, states, x)

    grads, new = jax.jit(derivative(loss, has_aux=True))(x)
    expected_grads, expected_new = derivative(reference_loss, has_aux=True)(x)
    _close(grads, expected_grads)
    _close(new, expected_new)
    assert float(jnp.abs(grads).sum()) > 0


@pytest.mark.parametrize("case", sorted(CASES))
def test_vmap(case):
    make, reference, shape = CASES[case]
    model = make()
    f, states = model.functionalize()
    batch = 4
    batched = jax.tree_util.tree_map(lambda v: jnp.stack([v] * batch), states)
    x = _input(shape, batch=batch)
    out, new = jax.jit(jax.vmap(lambda s, x: f(s, x)))(batched, x)
    expected, expected_new = jax.vmap(lambda s, x: reference(model, s, x))(batched, x)
    _close(out, expected)
    _close(new, expected_new)


def test_vmap_of_cond_with_batched_predicate_updates_only_the_branch_taken():
    f, states = CondModel().functionalize()
    x = jnp.stack([jnp.ones(3), -jnp.ones(3), jnp.ones(3)])
    batched = jax.tree_util.tree_map(lambda v: jnp.stack([v] * 3), states)
    _, new = jax.vmap(lambda s, x: f(s, x))(batched, x)
    np.testing.assert_array_equal(new["skipped"], [1.0, 0.0, 1.0])
    np.testing.assert_array_equal(new["block.calls"], [0, 1, 0])
    assert float(jnp.abs(new["block.mean"][0]).sum()) == 0.0
    assert float(jnp.abs(new["block.mean"][1]).sum()) > 0.0


def test_checkpoint_equals_the_same_model_without_remat():
    x = _input((3,))
    results = []
    for remat in (True, False):
        f, states = Deep(remat=remat).functionalize()

        def loss(f, x, states=states):
            return f(states, x)

        (value, new), grads = jax.value_and_grad(loss, has_aux=True)(f, x)
        results.append((value, new, jax.tree_util.tree_leaves(grads)))
    _close(results[0], results[1])


def test_every_import_form_is_routed():
    @autostate.stateful
    class Forms:
        def __init__(self):
            self.n = jnp.zeros(())

        def __call__(self, x):
            def body(c, x):
                self.n += x
                return c, None

            jax.lax.scan(body, None, x)
            lax.scan(body, None, x)
            plain_scan(body, None, x)
            return self.n

    model = Forms()
    np.testing.assert_allclose(model(jnp.arange(3.0)), 9.0)
    f, states = model.functionalize()
    out, states = jax.jit(lambda f, s, x: f(s, x))(f, states, jnp.ones(2))
    np.testing.assert_allclose(states["n"], 15.0)


# --- zero overhead --------------------------------------------------------------------

_OPCODE = re.compile(r"=\s*[^=]*?\s([a-z][a-z0-9\-]*)\(")


def _opcodes(fn, *args):
    text = jax.jit(fn).lower(*args).compile().as_text()
    ops = collections.Counter()
    for line in text.splitlines():
        line = line.strip()
        if line.startswith(("HloModule", "ENTRY", "}", "//")) or "=" not in line:
            continue
        match = _OPCODE.search(line)
        if match:
            ops[match.group(1)] += 1
    return text, ops


@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_program_equals_hand_threaded(case):
    make, reference, shape = CASES[case]
    model = make()
    f, states = model.functionalize()
    x = _input(shape)
    text, ops = _opcodes(lambda s, x: f(s, x), states, x)
    ref_text, ref_ops = _opcodes(lambda s, x: reference(model, s, x), states, x)
    assert "custom-call" not in text and "callback" not in text.lower()
    assert ops == ref_ops, (ops - ref_ops, ref_ops - ops)


# --- what cannot work: clear errors --------------------------------------------------


@autostate.stateful
class Growing:
    def __init__(self):
        self.buf = jnp.zeros((1,))
        self.count = jnp.zeros((), jnp.int32)

    def grow(self, xs):
        def body(c, x):
            self.buf = jnp.concatenate([self.buf, x[None]])
            return c, None

        return lax.scan(body, None, xs)

    def retype(self, xs):
        def body(c, x):
            self.count = self.count + 0.5
            return c, None

        return lax.scan(body, None, xs)

    def decide(self, x):
        def keep_going(v):
            self.count += 1
            return v < 3.0

        return lax.while_loop(keep_going, lambda v: v + 1.0, x)


@pytest.mark.parametrize(
    "method,words",
    [("grow", ["buf'", "float32[1]", "float32[2]"]), ("retype", ["count'", "int32"])],
)
def test_state_changing_shape_in_a_loop_is_a_clear_error(method, words):
    for run in (
        lambda: getattr(Growing(), method)(jnp.ones(3)),
        lambda: getattr(Growing().functionalize()[0], method)(
            Growing().functionalize()[1], jnp.ones(3)
        ),
    ):
        with pytest.raises(ControlFlowStateError) as info:
            run()
        message = str(info.value)
        for word in [*words, "loop carries", "keep their shape"]:
            assert word in message


def test_cond_fun_assigning_state_is_a_clear_error():
    with pytest.raises(ControlFlowStateError, match="cond_fun"):
        Growing().decide(jnp.float32(0.0))


def test_map_with_batch_size_assigning_state_is_a_clear_error():
    @autostate.stateful
    class Batched:
        def __init__(self):
            self.n = jnp.zeros(())

        def __call__(self, xs):
            def row(r):
                self.n += 1.0
                return r

            return jax.lax.map(row, xs, batch_size=2)

    with pytest.raises(ControlFlowStateError, match="batch_size"):
        Batched()(jnp.ones((4, 2)))


# Code the decorator never saw: a helper outside any class.


def _raw_helper(model, xs):
    return jax.lax.scan(lambda h, x: (model(h), None), jnp.zeros(3), xs)[0]


def _supported_helper(model, xs):
    return autostate.scan(lambda h, x: (model(h + x), None), jnp.zeros(3), xs)[0]


@autostate.stateful
class UsesHelper:
    def __init__(self, helper):
        self.stats = Stats()
        self.helper = helper

    def __call__(self, xs):
        return self.helper(self.stats, xs)

    def then_read(self, xs):
        self.helper(self.stats, xs)
        return self.stats.mean * 2.0


def test_helper_with_autostate_scan_is_supported():
    xs = jnp.ones((4, 3))
    model = UsesHelper(_supported_helper)
    model(xs)
    assert int(model.stats.steps) == 4
    f, states = UsesHelper(_supported_helper).functionalize()
    _, new = jax.jit(lambda f, s, x: f(s, x))(f, states, xs)
    _close(new, model.functionalize()[1])


@pytest.mark.parametrize("jit", [False, True], ids=["f", "jit"])
def test_helper_with_raw_lax_scan_is_a_clear_error_not_a_leaked_tracer(jit):
    f, states = UsesHelper(_raw_helper).functionalize()
    call = jax.jit(lambda f, s, x: f(s, x)) if jit else (lambda f, s, x: f(s, x))
    with pytest.raises(EscapedStateError) as info:
        call(f, states, jnp.ones((4, 3)))
    message = str(info.value)
    assert "'stats.mean'" in message or "'stats.steps'" in message
    assert "autostate.scan" in message


def test_reading_an_escaped_state_is_a_clear_error_at_the_read():
    f, states = UsesHelper(_raw_helper).functionalize()
    with pytest.raises(EscapedStateError, match="stats.mean") as info:
        f.then_read(states, jnp.ones((4, 3)))
    assert "autostate.scan" in str(info.value)


def test_eager_helper_with_raw_lax_scan_is_a_clear_error():
    model = UsesHelper(_raw_helper)
    with pytest.raises(TracedEagerStateError, match="autostate.scan"):
        model(jnp.ones((4, 3)))
    assert not isinstance(model.stats.mean, jax.core.Tracer)


# --- nesting, options, eager details ----------------------------------------------------


@autostate.stateful
class Nested:
    """A ``fori_loop`` and a ``cond`` inside a ``scan`` body, all assigning state."""

    def __init__(self):
        self.inner = jnp.zeros(())
        self.taken = jnp.zeros((), jnp.int32)

    def __call__(self, xs):
        def body(c, x):
            def add(i, v):
                self.inner += x
                return v + 1.0

            c = lax.fori_loop(0, 2, add, c)

            def take(_):
                self.taken += 1
                return None

            lax.cond(x > 0, take, lambda _: None, None)
            return c, None

        return lax.scan(body, 0.0, xs)[0]


def nested_reference(states, xs):
    def body(carry, x):
        c, inner, taken = carry
        return (c + 2.0, inner + 2 * x, taken + (x > 0).astype(jnp.int32)), None

    (c, inner, taken), _ = lax.scan(body, (0.0, states["inner"], states["taken"]), xs)
    return c, {"inner": inner, "taken": taken}


def test_nested_control_flow():
    xs = jnp.array([1.0, -2.0, 3.0])
    model = Nested()
    _, states = model.functionalize()
    out = model(xs)
    expected, expected_states = nested_reference(states, xs)
    _close(out, expected)
    _close(model.functionalize()[1], expected_states)
    f, states = Nested().functionalize()
    out, new = jax.jit(lambda f, s, x: f(s, x))(f, states, xs)
    _close((out, new), (expected, expected_states))
    grads = jax.grad(lambda xs: f(states, xs)[1]["inner"])(xs)
    np.testing.assert_allclose(grads, [2.0, 2.0, 2.0])


@autostate.stateful
class StaticArg:
    def __init__(self):
        self.total = jnp.zeros(())

    def __call__(self, x):
        def scaled(k, x):
            self.total += k * x.sum()
            return x * k

        return jax.checkpoint(scaled, static_argnums=(0,))(3, x).sum()


def test_checkpoint_with_static_argnums():
    f, states = StaticArg().functionalize()
    x = jnp.arange(3.0)
    (value, new), grads = jax.value_and_grad(lambda x: f(states, x), has_aux=True)(x)
    np.testing.assert_allclose(value, 9.0)
    np.testing.assert_allclose(new["total"], 9.0)
    np.testing.assert_allclose(grads, [3.0, 3.0, 3.0])


def test_eager_state_only_read_in_the_body_is_not_rewritten_as_a_write():
    model = ScanModel()
    before = vars(model)["w"]
    model(jnp.ones((4, 3)))
    assert vars(model)["w"] is before
    assert int(model.stats.steps) == 4


def test_class_without_state_of_its_own_is_routed():
    @autostate.stateful
    class Outer:
        def __init__(self):
            self.stats = Stats()

        def __call__(self, xs):
            return lax.scan(lambda h, x: (self.stats(h + x), None), jnp.zeros(3), xs)[0]

    model = Outer()
    model(jnp.ones((5, 3)))
    assert int(model.stats.steps) == 5


@autostate.stateful
class WithStatic:
    def __init__(self):
        self.stats = Stats()

    @staticmethod
    def run(stats, xs):
        return lax.scan(lambda h, x: (stats(h + x), None), jnp.zeros(3), xs)[0]

    def __call__(self, xs):
        return self.run(self.stats, xs)


def test_staticmethod_without_receiver_is_routed():
    model = WithStatic()
    model(jnp.ones((3, 3)))
    assert int(model.stats.steps) == 3
    f, states = WithStatic().functionalize()
    _, new = jax.jit(lambda f, s, x: f(s, x))(f, states, jnp.ones((3, 3)))
    assert int(new["stats.steps"]) == 3


def test_rewrite_routes_control_flow_on_the_same_line():
    from autostate.transform import analysis, rewrite

    text = (
        "    def step(self, xs):\n"
        "        h, _ = lax.scan(\n"
        "            self._step, 0.0, xs)\n"
        "        return jax.checkpoint(self.block)(h)\n"
    )
    source = analysis.MethodSource("step", "step", "m.py", 20, text, (), True)
    facts = analysis.collect_facts("M", source)
    assert {"lax.scan", "jax.checkpoint"} <= facts.references
    code = rewrite.rewrite_method(
        facts.module,
        facts.function,
        facts.receiver,
        frozenset(),
        "M",
        is_init=False,
        control={"lax.scan": "scan", "jax.checkpoint": "checkpoint"},
    )
    lines = code.splitlines()
    # Line n of the generated text is line n + shift of the file.
    shift = analysis.wrapper_source("M", source)[1]
    assert lines[20 - shift].strip() == "h, _ = __autostate__.control.routed(lax.scan)("
    assert (
        lines[22 - shift].strip()
        == "return __autostate__.control.routed(jax.checkpoint)(self.block)(h)"
    )


# --- checkpoint as a method decorator ---------------------------------------------------


@autostate.stateful
class RematMethod:
    def __init__(self):
        self.total = jnp.zeros(())

    @autostate.checkpoint
    def __call__(self, x):
        self.total = self.total + x
        return jnp.sin(x) * 2.0


def test_autostate_checkpoint_as_a_method_decorator():
    model = RematMethod()
    model(jnp.float32(2.0))
    assert float(model.total) == 2.0
    f, states = RematMethod().functionalize()
    (value, new), grad = jax.value_and_grad(lambda x: f(states, x), has_aux=True)(3.0)
    np.testing.assert_allclose(value, np.sin(3.0) * 2.0, rtol=1e-6)
    np.testing.assert_allclose(grad, np.cos(3.0) * 2.0, rtol=1e-6)
    np.testing.assert_allclose(new["total"], 3.0)


def test_jax_checkpoint_as_a_method_decorator_is_a_clear_decoration_error():
    from autostate.errors import DecorationError

    class JaxRematMethod:
        def __init__(self):
            self.total = jnp.zeros(())

        @jax.checkpoint
        def __call__(self, x):
            self.total = self.total + x
            return x

    with pytest.raises(DecorationError, match="autostate.checkpoint"):
        autostate.stateful(JaxRematMethod)


def _plain_wraps(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return wrapper


def test_wraps_decorated_method_is_analysed_from_its_own_source():
    # The state is assigned only in the decorated method: analysis must read that
    # method, not the decorator's wrapper.
    @autostate.stateful
    class Wrapped:
        def __init__(self):
            self.n = jnp.zeros(())

        @_plain_wraps
        def step(self, x):
            self.n += x
            return self.n

    model = Wrapped()
    model.step(jnp.float32(2.0))
    f, states = model.functionalize()
    assert set(states) == {"n"}
    _, states = jax.jit(lambda f, s: f.step(s, 1.0))(f, states)
    assert float(states["n"]) == 3.0


def test_vmap_of_a_closure_assigning_state_inside_a_method_is_a_clear_error():
    @autostate.stateful
    class VmapInside:
        def __init__(self):
            self.total = jnp.zeros(())

        def __call__(self, x):
            def g(x):
                self.total = self.total + x
                return x

            return jax.vmap(g)(x)

    f, states = VmapInside().functionalize()
    with pytest.raises(EscapedStateError, match="'total'") as info:
        jax.jit(lambda f, s, x: f(s, x))(f, states, jnp.ones(3))
    assert "from outside" in str(info.value)
