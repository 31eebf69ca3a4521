"""A state's container changed in place inside ``lax`` control flow.

``self.sub.items[0] = v``, ``d = self.d; d["k"] = v`` or ``d.update(...)``
inside a ``lax`` body keeps the container object and changes what it holds.
Plain Python's loop keeps the change; autostate must thread it as it threads
an assignment (``control._writes`` tells one from the other by the state's
leaves, not only by the object). Each case runs plain (``lax.*`` as a Python
loop), eagerly, through ``f``, under ``jax.jit`` and after ``freeze``, for
every primitive: ``scan``, ``fori_loop``, ``while_loop``, ``cond``,
``switch``, ``map`` and ``jax.checkpoint``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from differential import check, pair, raises_autostate

from autostate.errors import ControlFlowStateError, EscapedStateError

# One body per way of reaching the container; {step} is where it runs.
SOURCE = """
@DECORATE
class Leaf:
    def __init__(self):
        self.items = [jnp.zeros(()), jnp.ones(2)]
        self.table = {"a": jnp.zeros(()), "b": [jnp.zeros(2)]}

    def reset(self):  # (assigned in a method: states)
        self.items = [jnp.zeros(()), jnp.ones(2)]
        self.table = {"a": jnp.zeros(()), "b": [jnp.zeros(2)]}


def helper_update(leaf, x):
    leaf.items[0] = leaf.items[0] + x          # a helper's in-place write


@DECORATE
class Root:
    def __init__(self):
        self.leaf = Leaf()
        self.own = [jnp.zeros(())]
        self.count = jnp.zeros((), jnp.int32)

    def reset(self):
        self.own = [jnp.zeros(())]

    def change(self, x):
        self.leaf.items[0] = self.leaf.items[0] + x       # a sub-model's list item
        d = self.leaf.table                                # an alias taken in the body
        d["a"] = d["a"] + 2 * x
        d["b"][0] = d["b"][0] + x                          # nested: a list in a dict
        mine = self.own
        mine[0] = mine[0] * 0.5 + x                        # the model's own state, aliased
        helper_update(self.leaf, x)

    def update_dict(self, x):
        self.leaf.table.update(a=self.leaf.table["a"] - x)

    def scan(self, xs):
        def body(c, x):
            self.change(x)
            return c + 1, x * 2
        c, ys = lax.scan(body, 0, xs)
        return c, ys, self.leaf.items[0], self.own[0]

    def fori(self, n, x):
        def body(i, acc):
            self.change(x)
            return acc + i
        return lax.fori_loop(0, n, body, 0), self.leaf.table["a"]

    def while_(self, x):
        def cond(c):
            return c < 3
        def body(c):
            self.change(x)
            self.update_dict(x)
            return c + 1
        return lax.while_loop(cond, body, 0), self.leaf.table["a"]

    def cond_(self, p, x):
        def yes(v):
            self.change(v)
            return v
        def no(v):
            self.update_dict(v)
            return -v
        return lax.cond(p, yes, no, x), self.leaf.items[0], self.leaf.table["a"]

    def switch_(self, i, x):
        def first(v):
            self.change(v)
            return v
        def second(v):
            self.leaf.table["b"][0] = self.leaf.table["b"][0] * v
            return v * 3
        return lax.switch(i, [first, second], x), self.leaf.table["b"][0]

    def map_(self, xs):
        def one(x):
            self.change(x)
            return x + self.own[0]
        return lax.map(one, xs), self.own[0]

    def remat(self, x):
        def block(v):
            self.change(v)
            return v * self.leaf.items[0]
        return checkpoint(block)(x), self.leaf.items[0]
"""

X = jnp.asarray(1.5)
XS = jnp.asarray([1.0, -2.0, 0.5])

CALLS = {
    "scan": [("scan", (XS,)), ("scan", (XS * 2,))],
    "fori_loop": [("fori", (3, X)), ("fori", (2, -X))],
    "while_loop": [("while_", (X,))],
    "cond": [("cond_", (True, X)), ("cond_", (False, X)), ("cond_", (True, -X))],
    "switch": [("switch_", (0, X)), ("switch_", (1, X)), ("switch_", (0, -X))],
    "map": [("map_", (XS,))],
    "checkpoint": [("remat", (X,)), ("remat", (-X,))],
}


@pytest.mark.parametrize("primitive", sorted(CALLS))
def test_an_in_place_change_in_a_lax_body_means_what_plain_python_means(write_module, primitive):
    plain, dec = pair(write_module, SOURCE)
    check(plain, dec, "Root()", CALLS[primitive])


def test_an_in_place_change_in_a_scan_body_under_grad(write_module):
    plain, dec = pair(write_module, SOURCE)

    def loss(model_cls, x, functional):
        model = model_cls()
        if functional:
            f, states = model.functionalize()
            (c, ys, item, own), _ = f.scan(states, XS * x)
        else:
            c, ys, item, own = model.scan(XS * x)
        return item + own + ys.sum()

    expected = jax.grad(lambda x: loss(plain.Root, x, False))(X)
    got = jax.grad(lambda x: loss(dec.Root, x, True))(X)
    assert jnp.allclose(expected, got)


ESCAPING = """
@DECORATE
class Root:
    def __init__(self):
        self.items = [jnp.zeros(())]

    def peek(self, x):
        def cond(c):
            self.items[0] = self.items[0] + x   # a cond_fun must not change state
            return c < 2
        return lax.while_loop(cond, lambda c: c + 1, 0)

    def peek_alias(self, x):
        def cond(c):
            items = self.items
            items[0] = items[0] + x
            return c < 2
        return lax.while_loop(cond, lambda c: c + 1, 0)
"""


@pytest.mark.parametrize("method", ["peek", "peek_alias"])
def test_a_while_cond_changing_state_in_place_is_refused(write_module, method):
    _, dec = pair(write_module, ESCAPING)
    f, states = dec.Root().functionalize()
    with raises_autostate(ControlFlowStateError) as info:
        getattr(f, method)(states, X)
    assert "cond_fun" in str(info.value)


PARAMETERS = """
@DECORATE
class Leaf:
    def __init__(self):
        self.items = [jnp.zeros(()), jnp.ones(2)]   # never assigned in a method: not state


def helper_update(leaf, x):
    leaf.items[0] = leaf.items[0] + x


@DECORATE
class Root:
    def __init__(self):
        self.leaf = Leaf()
        self.own = [jnp.zeros(())]                   # not state either

    def aliased(self, xs):
        def body(c, x):
            mine = self.own
            mine[0] = mine[0] + x
            return c, None
        return lax.scan(body, 0, xs)[0]

    def fori(self, n, x):
        def body(i, acc):
            helper_update(self.leaf, x)
            return acc + i
        return lax.fori_loop(0, n, body, 0)

    def scan(self, xs):
        def body(c, x):
            helper_update(self.leaf, x)
            return c, None
        return lax.scan(body, 0, xs)[0]
"""


@pytest.mark.parametrize("method", ["fori", "scan", "aliased"])
@pytest.mark.parametrize("mode", ["eager", "f"])
def test_a_parameter_changed_in_place_in_a_lax_body_is_refused_not_leaked(
    write_module, method, mode
):
    # Not state, so not threaded: the body's tracer would stay in the list
    # (plain Python's loop adds x each step). Refused, and the list put back.
    _, dec = pair(write_module, PARAMETERS)
    model = dec.Root()
    args = (3, X) if method == "fori" else (XS,)
    with raises_autostate(EscapedStateError) as info:
        if mode == "eager":
            getattr(model, method)(*args)
        else:
            f, states = model.functionalize()
            getattr(f, method)(states, *args)
    message = str(info.value)
    assert ("Root.own" if method == "aliased" else "Leaf.items") in message
    assert "autostate.state" in message and dec.__file__ in message
    for held in (model.leaf.items, model.own):
        assert float(held[0]) == 0.0 and not any(isinstance(v, jax.core.Tracer) for v in held)


OUTSIDE_ALIAS = """
@DECORATE
class Root:
    def __init__(self):
        self.items = [jnp.zeros(())]

    def reset(self):
        self.items = [jnp.zeros(())]

    def go(self, xs):
        items = self.items                  # taken before the call: not threaded
        def body(c, x):
            items[0] = items[0] + x
            return c, None
        lax.scan(body, 0, xs)
        return self.items[0]

    def collect(self, xs):
        seen = []                           # a closure list given the body's values
        def body(c, x):
            seen.append(x * 2)
            return c, None
        lax.scan(body, 0, xs)
        return seen
"""


@pytest.mark.parametrize("mode", ["eager", "f"])
@pytest.mark.parametrize("method", ["go", "collect"])
def test_a_change_in_place_through_a_reference_from_outside_the_body_is_refused(
    write_module, mode, method
):
    # The body would change the outer object, not the threaded copy: the
    # value left there is its tracer. Refused, naming the lax call's line;
    # the state keeps its value.
    _, dec = pair(write_module, OUTSIDE_ALIAS)
    model = dec.Root()
    with raises_autostate(EscapedStateError) as info:
        if mode == "eager":
            getattr(model, method)(XS)
        else:
            f, states = model.functionalize()
            getattr(f, method)(states, XS)
    message = str(info.value)
    assert dec.__file__ in message and "lax.scan" in message
    if method == "go" and mode == "f":
        assert "state 'items'" in message and "taken before the call" in message
    else:
        assert "captures" in message
    assert float(model.items[0]) == 0.0 and not isinstance(model.items[0], jax.core.Tracer)
