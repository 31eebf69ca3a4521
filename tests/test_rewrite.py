"""Tests for ``autostate/transform/rewrite.py``: every rule of the rewrite table.

Each rule is checked three ways with identical results: eagerly on a fresh
model (plain Python semantics), through ``functionalize()`` without ``jit``,
and through ``jax.jit`` of the functionalized model. The generated source of
a small method is checked line by line.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import textwrap
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autostate
from autostate.transform import analysis, rewrite

# --- helpers -------------------------------------------------------------------


def assert_same(a: Any, b: Any) -> None:
    """Same tree structure (python scalars and arrays both count as leaves) and values."""
    leaves_a, def_a = jax.tree_util.tree_flatten(a)
    leaves_b, def_b = jax.tree_util.tree_flatten(b)
    assert def_a == def_b, (def_a, def_b)
    for x, y in zip(leaves_a, leaves_b):
        if isinstance(x, str) or isinstance(y, str):
            assert x == y
        else:
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6)


def run_three_ways(make, method: str, *args: Any) -> tuple[Any, dict[str, Any]]:
    """Runs ``make().<method>(*args)`` eagerly, functionalized, and jitted.

    Asserts the three give the same output and states and returns the eager
    ``(out, states)``. ``args`` are closed over, so they stay python values
    under ``jit``; the states are traced.
    """
    model = make()
    eager_out = getattr(model, method)(*args)
    _, eager_states = model.functionalize()

    def call(f, states):
        if method == "__call__":
            return f(states, *args)
        return getattr(f, method)(states, *args)

    f, states = make().functionalize()
    out, new_states = call(f, states)
    assert_same(out, eager_out)
    assert_same(new_states, eager_states)
    jit_out, jit_states = jax.jit(call)(f, states)
    assert_same(jit_out, eager_out)
    assert_same(jit_states, eager_states)
    return eager_out, eager_states


# --- reads, =, augmented operators ----------------------------------------------


@autostate.stateful
class Scalars:
    def __init__(self):
        self.f = jnp.array(7.0)
        self.i = jnp.array(13, dtype=jnp.int32)
        self.m = jnp.array([[1.0, 2.0], [3.0, 4.0]])
        self.scale = 2.0

    def read(self):
        return self.f * self.scale + self.i

    def assign(self, v):
        self.f = v
        return self.f

    def add(self, v):
        self.f += v
        return self.f

    def sub(self, v):
        self.f -= v
        return self.f

    def mul(self, v):
        self.f *= v
        return self.f

    def div(self, v):
        self.f /= v
        return self.f

    def floordiv(self, v):
        self.f //= v
        return self.f

    def mod(self, v):
        self.f %= v
        return self.f

    def pow(self, v):
        self.f **= v
        return self.f

    def matmul(self, v):
        self.m @= v
        return self.m

    def lshift(self, v):
        self.i <<= v
        return self.i

    def rshift(self, v):
        self.i >>= v
        return self.i

    def and_(self, v):
        self.i &= v
        return self.i

    def or_(self, v):
        self.i |= v
        return self.i

    def xor(self, v):
        self.i ^= v
        return self.i

    def precedence(self, v):
        # The right side is one operand: f = f * (v + 1), not f * v + 1.
        self.f *= v + 1
        return self.f


def test_read():
    out, states = run_three_ways(Scalars, "read")
    assert float(out) == 27.0
    assert float(states["f"]) == 7.0


def test_assign():
    out, states = run_three_ways(Scalars, "assign", 3.5)
    assert float(out) == 3.5 and float(states["f"]) == 3.5


M = np.array([[1.0, 2.0], [3.0, 4.0]])
W = np.array([[0.0, 1.0], [1.0, 0.0]])


@pytest.mark.parametrize(
    "method, arg, expected",
    [
        ("add", 2.0, 9.0),
        ("sub", 2.0, 5.0),
        ("mul", 2.0, 14.0),
        ("div", 2.0, 3.5),
        ("floordiv", 2.0, 3.0),
        ("mod", 4.0, 3.0),
        ("pow", 2.0, 49.0),
        ("lshift", 2, 52),
        ("rshift", 2, 3),
        ("and_", 6, 4),
        ("or_", 2, 15),
        ("xor", 6, 11),
        ("precedence", 2.0, 21.0),
    ],
)
def test_augmented_operators(method, arg, expected):
    out, states = run_three_ways(Scalars, method, arg)
    assert np.asarray(out).item() == expected
    name = "i" if isinstance(arg, int) else "f"
    assert np.asarray(states[name]).item() == expected


def test_augmented_matmul():
    out, states = run_three_ways(Scalars, "matmul", jnp.asarray(W))
    np.testing.assert_array_equal(out, M @ W)
    np.testing.assert_array_equal(states["m"], M @ W)


def test_eager_state_updates_in_place_and_reads_from_outside():
    model = Scalars()
    model.add(1.0)
    model.add(1.0)
    assert float(model.f) == 9.0
    model.f = jnp.array(1.0)  # assignment from outside the class
    assert float(model.add(1.0)) == 2.0


# --- subscripts on arrays ---------------------------------------------------------


@autostate.stateful
class Arrays:
    def __init__(self):
        self.v = jnp.arange(4.0)
        self.grid = jnp.zeros((2, 3))
        self.ints = jnp.array([12, 10, 7, 5], dtype=jnp.int32)
        self.pos = 1

    def set_index(self, x):
        self.v[2] = x
        return self.v

    def set_slice(self, x):
        self.v[1:3] = x
        return self.v

    def set_tuple_index(self, x):
        self.grid[1, 2] = x
        self.grid[0] = x + 1
        return self.grid

    def set_state_index(self, x):
        self.v[self.pos] = x
        return self.v

    def item_add(self, x):
        self.v[1] += x
        return self.v

    def item_sub(self, x):
        self.v[1] -= x
        return self.v

    def item_mul(self, x):
        self.v[3] *= x
        return self.v

    def item_div(self, x):
        self.v[3] /= x
        return self.v

    def item_floordiv(self, x):
        self.v[3] //= x
        return self.v

    def item_mod(self, x):
        self.v[3] %= x
        return self.v

    def item_pow(self, x):
        self.v[3] **= x
        return self.v

    def item_lshift(self, x):
        self.ints[0] <<= x
        return self.ints

    def item_rshift(self, x):
        self.ints[0] >>= x
        return self.ints

    def item_and(self, x):
        self.ints[1] &= x
        return self.ints

    def item_or(self, x):
        self.ints[2] |= x
        return self.ints

    def item_xor(self, x):
        self.ints[3] ^= x
        return self.ints

    def item_slice_add(self, x):
        self.v[::2] += x
        return self.v


@pytest.mark.parametrize(
    "method, arg, expected",
    [
        ("set_index", 9.0, [0.0, 1.0, 9.0, 3.0]),
        ("set_slice", 9.0, [0.0, 9.0, 9.0, 3.0]),
        ("set_state_index", 9.0, [0.0, 9.0, 2.0, 3.0]),
        ("item_add", 5.0, [0.0, 6.0, 2.0, 3.0]),
        ("item_sub", 5.0, [0.0, -4.0, 2.0, 3.0]),
        ("item_mul", 2.0, [0.0, 1.0, 2.0, 6.0]),
        ("item_div", 2.0, [0.0, 1.0, 2.0, 1.5]),
        ("item_floordiv", 2.0, [0.0, 1.0, 2.0, 1.0]),
        ("item_mod", 2.0, [0.0, 1.0, 2.0, 1.0]),
        ("item_pow", 2.0, [0.0, 1.0, 2.0, 9.0]),
        ("item_slice_add", 10.0, [10.0, 1.0, 12.0, 3.0]),
    ],
)
def test_float_array_item_updates(method, arg, expected):
    out, states = run_three_ways(Arrays, method, arg)
    np.testing.assert_allclose(out, expected)
    np.testing.assert_allclose(states["v"], expected)


@pytest.mark.parametrize(
    "method, arg, expected",
    [
        ("item_lshift", 1, [24, 10, 7, 5]),
        ("item_rshift", 2, [3, 10, 7, 5]),
        ("item_and", 6, [12, 2, 7, 5]),
        ("item_or", 8, [12, 10, 15, 5]),
        ("item_xor", 3, [12, 10, 7, 6]),
    ],
)
def test_int_array_item_updates(method, arg, expected):
    out, states = run_three_ways(Arrays, method, arg)
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(states["ints"], expected)
    assert states["ints"].dtype == jnp.int32


def test_multi_dimensional_item_set():
    out, _ = run_three_ways(Arrays, "set_tuple_index", 4.0)
    np.testing.assert_array_equal(out, [[5.0, 5.0, 5.0], [0.0, 0.0, 4.0]])


def test_array_item_set_does_not_change_the_old_array():
    model = Arrays()
    old = model.v
    model.set_index(9.0)
    np.testing.assert_array_equal(old, [0.0, 1.0, 2.0, 3.0])
    np.testing.assert_array_equal(model.v, [0.0, 1.0, 9.0, 3.0])


# --- subscripts on dict / list / tuple state ----------------------------------------


@autostate.stateful
class Containers:
    def __init__(self):
        self.d = {"a": jnp.zeros(3), "b": jnp.array(1.0), "c": {"x": jnp.array(2.0)}}
        self.items = [jnp.array(1.0), jnp.zeros(2)]
        self.pair = (jnp.array(1.0), jnp.array(2.0))

    def dict_set(self, v):
        self.d["b"] = v
        return self.d

    def dict_new_key(self, v):
        self.d["new"] = v
        return self.d

    def dict_aug(self, v):
        self.d["b"] += v
        return self.d["b"]

    def dict_nested_array(self, v):
        self.d["a"][0] = v
        self.d["a"][2] += v
        return self.d["a"]

    def dict_nested_dict(self, v):
        self.d["c"]["x"] *= v
        self.d["c"]["y"] = v
        return self.d["c"]

    def dict_del(self):
        del self.d["b"]
        return self.d

    def dict_del_nested(self):
        del self.d["c"]["x"]
        return self.d["c"]

    def list_set(self, v):
        self.items[0] = v
        return self.items

    def list_aug(self, v):
        self.items[0] -= v
        return self.items[0]

    def list_nested(self, v):
        self.items[1][1] = v
        return self.items[1]

    def list_del(self):
        del self.items[0]
        return len(self.items)

    def tuple_set(self, v):
        self.pair[1] = v
        return self.pair

    def tuple_aug(self, v):
        self.pair[0] += v
        return self.pair[0]


def test_dict_item_set():
    out, states = run_three_ways(Containers, "dict_set", 5.0)
    assert float(out["b"]) == 5.0 and float(states["d"]["b"]) == 5.0
    np.testing.assert_array_equal(states["d"]["a"], [0.0, 0.0, 0.0])


def test_dict_item_new_key():
    _, states = run_three_ways(Containers, "dict_new_key", 5.0)
    assert sorted(states["d"]) == ["a", "b", "c", "new"]
    assert float(states["d"]["new"]) == 5.0


def test_dict_item_augmented():
    out, states = run_three_ways(Containers, "dict_aug", 2.0)
    assert float(out) == 3.0 and float(states["d"]["b"]) == 3.0


def test_nested_subscript_into_array_in_dict():
    out, states = run_three_ways(Containers, "dict_nested_array", 4.0)
    np.testing.assert_array_equal(out, [4.0, 0.0, 4.0])
    np.testing.assert_array_equal(states["d"]["a"], [4.0, 0.0, 4.0])


def test_nested_subscript_into_dict_in_dict():
    out, states = run_three_ways(Containers, "dict_nested_dict", 3.0)
    assert float(out["x"]) == 6.0 and float(out["y"]) == 3.0
    assert sorted(states["d"]["c"]) == ["x", "y"]


def test_del_dict_item():
    out, states = run_three_ways(Containers, "dict_del")
    assert sorted(out) == ["a", "c"]
    assert sorted(states["d"]) == ["a", "c"]


def test_del_nested_dict_item():
    out, states = run_three_ways(Containers, "dict_del_nested")
    assert out == {}
    assert states["d"]["c"] == {}


def test_list_item_set_augmented_nested_and_del():
    out, states = run_three_ways(Containers, "list_set", 7.0)
    assert float(out[0]) == 7.0 and isinstance(states["items"], list)
    out, _ = run_three_ways(Containers, "list_aug", 3.0)
    assert float(out) == -2.0
    out, states = run_three_ways(Containers, "list_nested", 7.0)
    np.testing.assert_array_equal(out, [0.0, 7.0])
    np.testing.assert_array_equal(states["items"][1], [0.0, 7.0])
    out, states = run_three_ways(Containers, "list_del")
    assert out == 1 and len(states["items"]) == 1


def test_tuple_item_set_and_augmented():
    out, states = run_three_ways(Containers, "tuple_set", 9.0)
    assert isinstance(out, tuple) and isinstance(states["pair"], tuple)
    assert [float(x) for x in states["pair"]] == [1.0, 9.0]
    out, states = run_three_ways(Containers, "tuple_aug", 9.0)
    assert float(out) == 10.0 and float(states["pair"][0]) == 10.0


@pytest.mark.parametrize(
    "method, arg",
    [
        ("dict_set", 5.0),
        ("dict_aug", 5.0),
        ("dict_nested_array", 5.0),
        ("dict_nested_dict", 5.0),
        ("dict_del", None),
        ("dict_del_nested", None),
        ("list_set", 5.0),
        ("list_nested", 5.0),
        ("list_del", None),
        ("tuple_set", 5.0),
    ],
)
def test_container_updates_copy_and_leave_the_old_value_unchanged(method, arg):
    model = Containers()
    old_d, old_items, old_pair = model.d, model.items, model.pair
    old_c, old_a = old_d["c"], old_d["a"]
    snapshot = jax.tree_util.tree_map(np.asarray, (old_d, old_items, old_pair))
    getattr(model, method)(*([] if arg is None else [arg]))
    changed = {
        "d": model.d is not old_d,
        "items": model.items is not old_items,
        "pair": model.pair is not old_pair,
    }
    assert sum(changed.values()) == 1
    assert_same((old_d, old_items, old_pair), snapshot)
    assert old_d["c"] is old_c and old_d["a"] is old_a
    assert sorted(old_d["c"]) == ["x"]


# --- multiple targets -----------------------------------------------------------------


@autostate.stateful
class Targets:
    def __init__(self):
        self.a = jnp.array(1.0)
        self.b = jnp.array(2.0)
        self.rest = [jnp.array(0.0), jnp.array(0.0)]
        self.i = jnp.asarray(0)  # an int array: a python int would be static state
        self.slots = jnp.zeros(4)
        self.total = jnp.array(0.0)
        self.d = {"k": jnp.array(0.0)}

    def swap(self):
        self.a, self.b = self.b, self.a
        return self.a, self.b

    def nested_tuple(self, xs):
        (self.a, local), self.b = xs
        return local

    def mixed_with_item(self, v):
        self.a, self.slots[1], self.d["k"] = v, v + 1, v + 2
        return self.slots

    def starred(self, xs):
        self.a, *self.rest = xs
        return self.rest

    def starred_list_target(self, xs):
        [*self.rest, self.b] = xs
        return self.rest

    def chained(self, v):
        self.a = self.b = v
        return self.a + self.b

    def chained_left_to_right(self, v):
        # Python assigns left to right: `i` is set before `slots[i]` is indexed.
        self.i = self.slots[self.i] = v
        return self.i

    def tuple_left_to_right(self, v):
        self.i, self.slots[self.i] = v, 5.0
        return self.slots

    def loop_target(self):
        for self.i in range(4):
            self.total += self.i
        return self.i

    def loop_tuple_target(self):
        for self.a, self.b in [(1.0, 2.0), (3.0, 4.0)]:
            self.total += self.a * self.b
        return self.total

    def annotated(self, v):
        self.a: float = v * 3
        return self.a


def test_tuple_target_swap():
    out, states = run_three_ways(Targets, "swap")
    assert (float(out[0]), float(out[1])) == (2.0, 1.0)
    assert (float(states["a"]), float(states["b"])) == (2.0, 1.0)


def test_nested_tuple_target_with_a_local():
    out, states = run_three_ways(Targets, "nested_tuple", ((5.0, 6.0), 7.0))
    assert out == 6.0
    assert (float(states["a"]), float(states["b"])) == (5.0, 7.0)


def test_tuple_target_mixing_attributes_and_items():
    out, states = run_three_ways(Targets, "mixed_with_item", 3.0)
    np.testing.assert_array_equal(out, [0.0, 4.0, 0.0, 0.0])
    assert float(states["a"]) == 3.0 and float(states["d"]["k"]) == 5.0


def test_starred_targets():
    out, states = run_three_ways(Targets, "starred", (1.0, 2.0, 3.0))
    assert out == [2.0, 3.0] and float(states["a"]) == 1.0
    out, states = run_three_ways(Targets, "starred_list_target", (1.0, 2.0, 3.0))
    assert out == [1.0, 2.0] and float(states["b"]) == 3.0


def test_chained_assignment():
    out, states = run_three_ways(Targets, "chained", 4.0)
    assert float(out) == 8.0
    assert float(states["a"]) == 4.0 and float(states["b"]) == 4.0


def test_chained_assignment_is_left_to_right():
    out, states = run_three_ways(Targets, "chained_left_to_right", 2)
    assert out == 2
    np.testing.assert_array_equal(states["slots"], [0.0, 0.0, 2.0, 0.0])


def test_tuple_assignment_is_left_to_right():
    out, _ = run_three_ways(Targets, "tuple_left_to_right", 3)
    np.testing.assert_array_equal(out, [0.0, 0.0, 0.0, 5.0])


def test_for_loop_target():
    out, states = run_three_ways(Targets, "loop_target")
    assert out == 3 and int(states["i"]) == 3
    assert float(states["total"]) == 6.0


def test_for_loop_tuple_target():
    out, states = run_three_ways(Targets, "loop_tuple_target")
    assert float(out) == 14.0
    assert (float(states["a"]), float(states["b"])) == (3.0, 4.0)


def test_annotated_assignment():
    out, states = run_three_ways(Targets, "annotated", 2.0)
    assert float(out) == 6.0 and float(states["a"]) == 6.0


# --- __init__, comprehensions, control flow --------------------------------------------


@autostate.stateful
class InitReads:
    def __init__(self, n):
        self.x = jnp.ones(n)
        self.y = self.x * 2
        self.x += 1
        self.x[0] = 10.0
        self.sizes = [self.x.shape[0] for _ in range(2)]
        self.ready = self.x.sum()

    def __call__(self, v):
        self.x = self.x + v
        self.y = self.y + v
        return self.x

    def step(self):
        self.ready = self.x.sum()


def test_reads_in_init_after_assignment():
    model = InitReads(3)
    np.testing.assert_array_equal(model.x, [10.0, 2.0, 2.0])
    np.testing.assert_array_equal(model.y, [2.0, 2.0, 2.0])
    assert model.sizes == [3, 3]
    assert float(model.ready) == 14.0
    _, states = model.functionalize()
    assert sorted(states) == ["ready", "x", "y"]
    out, states = run_three_ways(functools.partial(InitReads, 3), "__call__", 1.0)
    np.testing.assert_array_equal(out, [11.0, 3.0, 3.0])


@autostate.stateful
class Flow:
    def __init__(self):
        self.x = jnp.array(1.0)
        self.hist = [jnp.array(0.0)] * 3
        self.mode = "double"
        self.k = 2

    def comprehension(self):
        return [self.x * i for i in range(3)], {i: self.x + i for i in range(2)}

    def comprehension_writes(self):
        self.hist = [self.x + i for i in range(3)]
        return sum(h for h in self.hist)

    def conditional(self, up):
        if up:
            self.x = self.x + 1
        elif self.mode == "double":
            self.x = self.x * 2
        return self.x if up else -self.x

    def python_loop(self, n):
        for i in range(n):
            self.x = self.x * self.k + i
        count = 0
        while count < n:
            self.x -= 1
            count += 1
        return self.x

    def with_target(self):
        with contextlib.nullcontext(jnp.array(5.0)) as self.x:
            self.x += 1
        return self.x

    def generator_expression(self):
        return tuple(self.x + j for j in range(2))

    def lambda_read(self):
        add = lambda v: v + self.x  # noqa: E731
        return add(1.0)

    def nested_read(self):
        def inner(v):
            return v * self.x

        return inner(3.0)


def test_state_in_comprehensions():
    out, _ = run_three_ways(Flow, "comprehension")
    assert [float(v) for v in out[0]] == [0.0, 1.0, 2.0]
    assert {k: float(v) for k, v in out[1].items()} == {0: 1.0, 1: 2.0}
    out, states = run_three_ways(Flow, "comprehension_writes")
    assert float(out) == 6.0
    assert [float(v) for v in states["hist"]] == [1.0, 2.0, 3.0]
    out, _ = run_three_ways(Flow, "generator_expression")
    assert [float(v) for v in out] == [1.0, 2.0]


@pytest.mark.parametrize("up, expected", [(True, 2.0), (False, -2.0)])
def test_state_in_conditionals(up, expected):
    out, states = run_three_ways(Flow, "conditional", up)
    assert float(out) == expected
    assert float(states["x"]) == abs(expected)


def test_state_in_python_loops():
    # x: 1 -> 1*2+0=2 -> 2*2+1=5 -> 5*2+2=12, then minus 3.
    out, states = run_three_ways(Flow, "python_loop", 3)
    assert float(out) == 9.0 and float(states["x"]) == 9.0


def test_state_read_in_closures():
    out, _ = run_three_ways(Flow, "lambda_read")
    assert float(out) == 2.0
    out, _ = run_three_ways(Flow, "nested_read")
    assert float(out) == 3.0


@autostate.stateful
class Syntax:
    def __init__(self):
        self.x = jnp.array(1.5)
        self.tag = "t"

    def rename(self, tag):
        self.tag = tag

    def fstrings(self):
        self.x += 1
        return f"{self.x}|{self.tag!r}|" + f'{self.tag:>3}' + f"""{self.x:.2f}"""  # fmt: skip


def test_state_read_inside_fstrings():
    model = Syntax()
    assert model.fstrings() == "2.5|'t'|  t2.50"


def test_with_as_target():
    out, states = run_three_ways(Flow, "with_target")
    assert float(out) == 6.0 and float(states["x"]) == 6.0


# --- what is not rewritten --------------------------------------------------------------


class Partial:
    def __init__(self):
        self.count = jnp.array(0.0)
        self.weight = jnp.array(3.0)
        self.log = []

    def step(self, x):
        self.count += 1
        self.log.append(x)
        return x * self.weight

    def pure(self, x):
        return x * self.weight

    @staticmethod
    def helper(x):
        return x + 1

    @classmethod
    def build(cls):
        return cls()


ORIGINAL_PURE = Partial.__dict__["pure"]
ORIGINAL_STEP = Partial.__dict__["step"]
ORIGINAL_INIT = Partial.__dict__["__init__"]
ORIGINAL_HELPER = Partial.__dict__["helper"].__func__
ORIGINAL_BUILD = Partial.__dict__["build"].__func__
autostate.stateful(Partial)


def test_untouched_methods_keep_their_function_object():
    autostate.tree.class_info(Partial)  # installed (at the class's first use)
    assert Partial.__dict__["pure"] is ORIGINAL_PURE
    assert Partial.__dict__["helper"].__func__ is ORIGINAL_HELPER
    assert Partial.__dict__["build"].__func__ is ORIGINAL_BUILD
    assert Partial.__dict__["step"] is not ORIGINAL_STEP
    assert Partial.__dict__["__init__"] is not ORIGINAL_INIT
    assert Partial.__dict__["step"].__code__.co_filename == ORIGINAL_STEP.__code__.co_filename


def test_non_state_attributes_are_plain_python():
    assert autostate.tree.class_info(Partial).state == {"count"}
    model = Partial.build()
    assert float(model.step(2.0)) == 6.0
    assert model.log == [2.0]
    log = model.log
    model.step(3.0)
    assert model.log is log and log == [2.0, 3.0]
    model.weight = jnp.array(10.0)
    assert float(model.pure(1.0)) == 10.0
    assert "weight" in vars(model) and float(vars(model)["weight"]) == 10.0
    model.extra = "anything"
    assert model.extra == "anything"
    assert float(model.count) == 2.0
    _, states = model.functionalize()
    assert list(states) == ["count"]


# --- the generated source ---------------------------------------------------------------


def rewritten_source(text: str, first_line: int, *, init_text: str | None = None):
    """(original wrapper source, rewritten wrapper source) of one method."""
    source = analysis.MethodSource(
        key="step",
        attr="step",
        filename="model.py",
        first_line=first_line,
        text=textwrap.indent(textwrap.dedent(text).lstrip("\n"), "    "),
        freevars=(),
        has_receiver=True,
    )
    init = analysis.MethodSource(
        key="__init__",
        attr="__init__",
        filename="model.py",
        first_line=1,
        text=textwrap.indent(
            textwrap.dedent(init_text or "def __init__(self):\n    self.x = self.y = self.z = 0\n"),
            "    ",
        ),
        freevars=(),
        has_receiver=True,
    )
    facts = [analysis.collect_facts("M", init), analysis.collect_facts("M", source)]
    result = analysis.analyze_class("M", facts)
    step = result.methods[1]
    new = rewrite.rewrite_method(
        step.module, step.function, step.receiver, result.state, "M", is_init=False
    )
    original, shift = analysis.wrapper_source("M", source)
    return original, new, shift


def test_generated_source_keeps_each_statement_on_its_line():
    original, new, shift = rewritten_source(
        """
        def step(self, v):
            self.x = v
            self.y += v
            self.z[0] = v
            self.z[1] *= v
            self.x, self.y = (v,
                              v)
            del self.z[0]
            return self.x + self.w
        """,
        first_line=20,
    )
    old_lines, new_lines = original.splitlines(), new.splitlines()
    assert len(new_lines) == len(old_lines)
    # Line n of the generated text is line n + shift of the file.
    line = {n: new_lines[n - 1 - shift].strip() for n in range(20, 29)}
    assert line[20] == "def step(self, v):"
    assert line[21] == '__autostate__.set(self, "x", v)'
    assert line[22] == '__autostate__.set(self, "y", __autostate__.iadd(__autostate__.get(self, "y"), v))'
    assert line[23] == '__autostate__.setitem(self, "z", v, __autostate__.ix[0])'
    assert line[24] == (
        '__autostate__.augitem(__autostate__.item(self, "z", __autostate__.ix[1]), "*", v)'
    )
    assert line[25] == "__autostate__.target(self).x, __autostate__.target(self).y = (v,"
    assert line[26] == "v)"
    assert line[27] == "del __autostate__.target(self).z[0]"
    # `w` is not state: it stays a plain attribute read.
    assert line[28] == 'return __autostate__.get(self, "x") + self.w'


def test_generated_source_for_init_uses_init():
    source = analysis.MethodSource(
        key="__init__",
        attr="__init__",
        filename="model.py",
        first_line=5,
        text="    def __init__(self):\n        self.x = 0\n        self.y = self.x + 1\n",
        freevars=(),
        has_receiver=True,
    )
    facts = analysis.collect_facts("M", source)
    new = rewrite.rewrite_method(
        facts.module, facts.function, "self", frozenset({"x"}), "M", is_init=True
    )
    lines = new.splitlines()
    shift = analysis.wrapper_source("M", source)[1]
    assert lines[5 - shift].strip() == '__autostate__.init(self, "x", 0)'
    assert lines[6 - shift].strip() == 'self.y = __autostate__.get(self, "x") + 1'


def test_compiled_methods_report_the_original_line_numbers():
    lines = {
        name: fn.__code__.co_firstlineno
        for name, fn in vars(Targets).items()
        if getattr(getattr(fn, "__code__", None), "co_filename", None) == __file__
    }
    assert len(lines) == 12
    source_lines, start = inspect.getsourcelines(Targets)
    for name, first in lines.items():
        assert source_lines[first - start].strip().startswith(f"def {name}(")


# --- issue 11: Python semantics of each construct (generated source) -----------------------


def _rewritten(body: str, state: frozenset[str]) -> str:
    text = textwrap.indent(textwrap.dedent(body).lstrip("\n"), "    ")
    source = analysis.MethodSource(
        key="m", attr="m", filename="model.py", first_line=10, text=text, freevars=(),
        has_receiver=True, mangle_as="M",
    )
    facts = analysis.collect_facts("M", source)
    code = rewrite.rewrite_method(facts.module, facts.function, "self", state, "M", is_init=False)
    return code


def test_augmented_item_takes_keys_and_old_item_before_the_value():
    out = _rewritten("def m(self):\n    self.d[k()] *= v()\n", frozenset({"d"}))
    assert '__autostate__.augitem(__autostate__.item(self, "d", __autostate__.ix[k()]), "*", v())' in out


def test_augmented_assignment_uses_the_in_place_operator():
    out = _rewritten("def m(self, n):\n    self.seen += range(n)\n    self.o |= n\n", frozenset({"seen", "o"}))
    assert '__autostate__.iadd(__autostate__.get(self, "seen"), range(n))' in out
    assert '__autostate__.ior(__autostate__.get(self, "o"), n)' in out


def test_self_documenting_f_string_keeps_the_original_text():
    out = _rewritten('def m(self):\n    return f"{self.x=}", f"{ self.x = :>3}"\n', frozenset({"x"}))
    assert "self.x={__autostate__.get(self, 'x')!r}" in out
    assert " self.x = {__autostate__.get(self, 'x'):>3}" in out


def test_match_value_patterns_and_doubly_nested_f_strings_stay_dotted_names():
    out = _rewritten(
        """
        def m(self, v):
            match v:
                case self.x:
                    return f"a {f'b {self.x}'}"
            return self.x
        """,
        frozenset({"x"}),
    )
    assert "case self.x:" in out
    assert "f\"a {f'b {self.x}'}\"" in out
    assert 'return __autostate__.get(self, "x")' in out


@pytest.mark.parametrize(
    ("op", "start", "operand", "expected"),
    [("+", [1], range(2), [1, 0, 1]), ("|", {"a": 1}, [("b", 2)], {"a": 1, "b": 2}),
     ("|", {1}, {2}, {1, 2}), ("-", {1, 2}, {2}, {1})],
)
def test_in_place_runtime_operators_copy_mutable_containers(op, start, operand, expected):
    from autostate import runtime

    function = getattr(runtime, rewrite.INPLACE_NAMES[op])
    result = function(start, operand)
    assert result == expected and result is not start
    assert start != expected  # the old value is unchanged
