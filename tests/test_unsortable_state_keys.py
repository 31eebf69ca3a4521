"""A state holding a dict whose keys do not sort (plain ``Enum`` members,
``{1: a, "x": b}``, instances of a class without ``<``).

JAX flattens a dict in the sorted order of its keys, so such a dict cannot be
one of ``f``'s states. Eagerly the model behaves as plain Python does; where
the dict would have to be flattened (``functionalize()``, ``f``, ``jax.jit``
of the model, a ``lax`` call threading the state, a ``fallback="host"``
store) autostate raises ``InvalidTypeError`` naming the line that assigned
the state, the key types and the fix, never JAX's own sorting error.
"""

from __future__ import annotations

import collections
import sys
import types
from collections.abc import Callable

import jax
import jax.numpy as jnp
import pytest

import autostate
from autostate.errors import InvalidTypeError, TracedEagerStateError

Loader = Callable[..., types.ModuleType]

HEADER = """
import collections
import enum
import jax
import jax.numpy as jnp
import autostate


class Split(enum.Enum):
    TRAIN = "train"
    EVAL = "eval"


class Key:
    def __init__(self, name):
        self.name = name
"""

COUNTER = HEADER + """
@autostate.stateful
class Counter:
    def __init__(self):
        self.counts = {Split.TRAIN: jnp.zeros((), jnp.int32), Split.EVAL: jnp.zeros((), jnp.int32)}
        self.seen = jnp.zeros(())

    def __call__(self, x, split):
        self.counts[split] += 1
        return x * self.counts[split]

    def reset(self):
        self.counts = {Split.EVAL: jnp.zeros((), jnp.int32), Split.TRAIN: jnp.zeros((), jnp.int32)}

    def total(self, xs):
        def body(carry, x):
            return carry + x, None

        return jax.lax.scan(body, 0.0, xs)[0]

    def scan(self, xs):
        def body(carry, x):
            self.seen = self.seen + x
            return carry + x, None

        return jax.lax.scan(body, jnp.zeros(()), xs)[0]
"""


def line_of(module: types.ModuleType, text: str) -> str:
    """``file:line`` of the one line of ``module``'s source holding ``text``."""
    path = module.__file__
    assert path is not None
    with open(path) as source:
        numbers = [i + 1 for i, line in enumerate(source.read().splitlines()) if text in line]
    assert len(numbers) == 1, (text, numbers)
    return f"{path}:{numbers[0]}"


def assert_clear(err: pytest.ExceptionInfo[InvalidTypeError], where: str, *kinds: str) -> None:
    """The error names the line, the key types and the fix, and is no JAX error."""
    message = str(err.value)
    assert isinstance(err.value, autostate.AutostateError)
    assert isinstance(err.value, TypeError)
    assert "keys cannot be sorted" in message
    assert f"  at {where}\n" in message, message
    label = "type" if len(kinds) == 1 else "types"
    assert f"(keys of {label} {', '.join(kinds)})" in message, message
    assert "fix: key the dict by str, int or IntEnum values" in message
    assert "`{split.value: ...}`" in message
    assert "StrEnum or IntEnum" in message
    assert "collections.OrderedDict" in message
    assert "Comparator" not in message
    assert err.value.__cause__ is None
    assert err.value.__context__ is None or err.value.__suppress_context__


# --- eager: plain Python -------------------------------------------------------


def test_eager_model_with_enum_keys_runs_as_plain_python(write_module: Loader) -> None:
    module = write_module(COUNTER)
    model = module.Counter()
    train, eval_ = module.Split.TRAIN, module.Split.EVAL
    outs = [model(2.0, train), model(2.0, train), model(3.0, eval_)]
    assert [float(o) for o in outs] == [2.0, 4.0, 3.0]
    assert list(model.counts) == [train, eval_]
    assert [int(v) for v in model.counts.values()] == [2, 1]
    model.reset()
    assert list(model.counts) == [eval_, train]  # a new dict, in its own order
    assert [int(v) for v in model.counts.values()] == [0, 0]


def test_eager_model_with_enum_keys_still_refuses_a_leaked_tracer(write_module: Loader) -> None:
    module = write_module(COUNTER)
    model = module.Counter()
    with pytest.raises(TracedEagerStateError):
        jax.jit(lambda x: model(x, module.Split.TRAIN))(1.0)
    assert [int(v) for v in model.counts.values()] == [0, 0]


def test_model_built_inside_jit_keeps_enum_keyed_tracers(write_module: Loader) -> None:
    module = write_module(COUNTER)

    def build_and_call(x: jax.Array) -> jax.Array:
        model = module.Counter()
        model.counts = {module.Split.TRAIN: x.astype(jnp.int32), module.Split.EVAL: x.astype(jnp.int32)}
        return model(x, module.Split.TRAIN)

    assert float(jax.jit(build_and_call)(jnp.asarray(2.0))) == 6.0


# --- the clear error where the dict must be flattened ---------------------------


def test_functionalize_names_the_line_that_built_the_state(write_module: Loader) -> None:
    module = write_module(COUNTER)
    where = line_of(module, "self.counts = {Split.TRAIN")
    with pytest.raises(InvalidTypeError) as err:
        module.Counter().functionalize()
    assert_clear(err, where, "Split")
    assert "State 'counts'" in str(err.value)
    _, initial_states = module.Counter().functionalize(lazy=True)
    with pytest.raises(InvalidTypeError) as err:
        initial_states()
    assert_clear(err, where, "Split")


def test_functionalize_names_the_latest_eager_write(write_module: Loader) -> None:
    module = write_module(COUNTER)
    model = module.Counter()
    model(1.0, module.Split.TRAIN)
    with pytest.raises(InvalidTypeError) as err:
        model.functionalize()
    assert_clear(err, line_of(module, "self.counts[split] += 1"), "Split")
    model.reset()
    with pytest.raises(InvalidTypeError) as err:
        model.functionalize()
    assert_clear(err, line_of(module, "self.counts = {Split.EVAL"), "Split")


def test_jit_and_tree_util_of_the_eager_model(write_module: Loader) -> None:
    module = write_module(COUNTER)
    model = module.Counter()
    where = line_of(module, "self.counts = {Split.TRAIN")
    with pytest.raises(InvalidTypeError) as err:
        jax.jit(lambda m, x: m(x, module.Split.TRAIN))(model, 1.0)
    assert_clear(err, where, "Split")
    with pytest.raises(InvalidTypeError) as err:
        jax.tree_util.tree_leaves(model)
    assert_clear(err, where, "Split")


def test_a_lax_call_threading_the_state(write_module: Loader) -> None:
    module = write_module(COUNTER)
    model = module.Counter()
    assert float(model.total(jnp.ones(3))) == 3.0  # a body that assigns no state
    # A body that assigns a state threads every state of the model (control.py).
    with pytest.raises(InvalidTypeError) as err:
        model.scan(jnp.ones(3))
    assert_clear(err, line_of(module, "jax.lax.scan(body, jnp.zeros"), "Split")
    assert "State 'Counter.counts'" in str(err.value)
    assert [int(v) for v in model.counts.values()] == [0, 0]  # the model is left as it was


MIXED = HEADER + """
@autostate.stateful
class Mixed:
    def __init__(self):
        self.table = {1: jnp.zeros(()), "x": jnp.ones(())}

    def __call__(self, key, v):
        self.table[key] = self.table[key] + v
        return self.table[key]
"""


def test_keys_of_mixed_types(write_module: Loader) -> None:
    module = write_module(MIXED)
    model = module.Mixed()
    assert float(model(1, 2.0)) == 2.0 and float(model("x", 2.0)) == 3.0
    with pytest.raises(InvalidTypeError) as err:
        model.functionalize()
    assert_clear(err, line_of(module, "self.table[key] = "), "int", "str")


CUSTOM = HEADER + """
@autostate.stateful
class ByKey:
    def __init__(self, a, b):
        self.table = {a: jnp.zeros(()), b: jnp.zeros(())}

    def __call__(self, key, v):
        self.table[key] += v
        return self.table[key]
"""


def test_keys_of_a_class_without_ordering(write_module: Loader) -> None:
    module = write_module(CUSTOM)
    a, b = module.Key("a"), module.Key("b")
    model = module.ByKey(a, b)
    assert float(model(b, 3.0)) == 3.0 and float(model.table[a]) == 0.0
    with pytest.raises(InvalidTypeError) as err:
        model.functionalize()
    assert_clear(err, line_of(module, "self.table[key] += v"), "Key")


NESTED = HEADER + """
@autostate.stateful
class Nested:
    def __init__(self):
        self.stats = {"runs": [{Split.TRAIN: jnp.zeros(()), Split.EVAL: jnp.zeros(())}]}
        self.n = jnp.zeros(())

    def __call__(self, x):
        self.n += x
        return self.n

    def reset(self):
        self.stats = {"runs": []}
"""


def test_a_dict_nested_in_a_state(write_module: Loader) -> None:
    module = write_module(NESTED)
    model = module.Nested()
    assert float(model(2.0)) == 2.0
    with pytest.raises(InvalidTypeError) as err:
        model.functionalize()
    assert_clear(err, line_of(module, 'self.stats = {"runs": [{'), "Split")


LATER = HEADER + """
@autostate.stateful
class Later:
    def __init__(self):
        self.counts = {"train": jnp.zeros(())}

    def split_up(self):
        self.counts = {Split.TRAIN: jnp.zeros(()), Split.EVAL: jnp.zeros(())}

    def __call__(self, x):
        self.counts = {**self.counts, Split.TRAIN: x, Split.EVAL: x}
        return self.counts[Split.TRAIN] * 2
"""


def test_a_later_write_in_a_method(write_module: Loader) -> None:
    module = write_module(LATER)
    model = module.Later()
    f, states = model.functionalize()  # str keys: fine
    model.split_up()
    assert list(model.counts) == [module.Split.TRAIN, module.Split.EVAL]
    with pytest.raises(InvalidTypeError) as err:
        model.functionalize()
    assert_clear(err, line_of(module, "self.counts = {Split.TRAIN"), "Split")


def test_a_write_inside_f_eagerly_and_under_jit(write_module: Loader) -> None:
    module = write_module(LATER)
    f, states = module.Later().functionalize()
    # Writes inside f are not checked (the write path stays as fast as it
    # was): the call refuses the state where it returns it, at the f call.
    line = sys._getframe().f_lineno + 2
    with pytest.raises(InvalidTypeError) as err:
        f(states, 1.0)
    assert_clear(err, f"{__file__}:{line}", "Split", "str")
    line = sys._getframe().f_lineno + 1
    step = jax.jit(lambda f, s, x: f(s, x))  # the user's line inside the trace
    with pytest.raises(InvalidTypeError) as err:
        step(f, states, 1.0)
    assert_clear(err, f"{__file__}:{line}", "Split", "str")


def test_states_built_by_hand_for_an_eager_f(write_module: Loader) -> None:
    module = write_module(LATER)
    f, _ = module.Later().functionalize()
    states = {"counts": {module.Split.TRAIN: jnp.zeros(()), "train": jnp.zeros(())}}
    line = sys._getframe().f_lineno + 2
    with pytest.raises(InvalidTypeError) as err:
        f(states, 1.0)
    assert_clear(err, f"{__file__}:{line}", "Split", "str")
    assert "State 'counts'" in str(err.value)


HOST = HEADER + """
@autostate.stateful(fallback="host")
class HostCounter:
    def __init__(self, keys):
        self.counts = {k: jnp.zeros(()) for k in keys}

    def __call__(self, split):
        self.counts = {**self.counts, split: jnp.ones(())}
        return self.counts[split]
"""


def test_a_host_store_refuses_the_dict_where_it_is_assigned(write_module: Loader) -> None:
    module = write_module(HOST)
    with pytest.raises(InvalidTypeError) as err:
        module.HostCounter([module.Split.TRAIN, module.Split.EVAL])
    assert_clear(err, line_of(module, "self.counts = {k:"), "Split")
    assert 'fallback="host" store' in str(err.value)
    model = module.HostCounter([module.Split.TRAIN])  # one key sorts
    with pytest.raises(InvalidTypeError) as err:
        model(module.Split.EVAL)
    assert_clear(err, line_of(module, "self.counts = {**self.counts"), "Split")


# --- keys that sort keep working -----------------------------------------------

SORTABLE = HEADER + """
class Phase(enum.IntEnum):
    TRAIN = 0
    EVAL = 1


class Mode(enum.StrEnum):
    TRAIN = "train"
    EVAL = "eval"


@autostate.stateful
class Counter:
    def __init__(self, keys):
        self.counts = {k: jnp.zeros((), jnp.int32) for k in keys}

    def __call__(self, x, key):
        self.counts[key] += 1
        return x * self.counts[key]


@autostate.stateful
class Ordered:
    def __init__(self):
        self.counts = collections.OrderedDict(
            [(Split.TRAIN, jnp.zeros((), jnp.int32)), (Split.EVAL, jnp.zeros((), jnp.int32))]
        )

    def __call__(self, x, key):
        self.counts[key] += 1
        return x * self.counts[key]
"""


@pytest.mark.parametrize("keys", ["Phase", "Mode", "str", "one Split"])
def test_sortable_keys_work_eagerly_through_f_and_jit(write_module: Loader, keys: str) -> None:
    module = write_module(SORTABLE)
    members = {
        "Phase": list(module.Phase),
        "Mode": list(module.Mode),
        "str": ["train", "eval"],
        "one Split": [module.Split.TRAIN],  # one key: nothing to compare
    }[keys]
    first, last = members[0], members[-1]
    eager = module.Counter(members)
    assert float(eager(2.0, first)) == 2.0 and float(eager(2.0, first)) == 4.0
    f, states = module.Counter(members).functionalize()
    step = jax.jit(lambda f, s, x, k: f(s, x, k), static_argnums=3)
    _, states = step(f, states, 2.0, first)
    out, states = step(f, states, 2.0, last)
    assert float(out) == (4.0 if last == first else 2.0)
    frozen = autostate.freeze(f, states)
    assert sorted(frozen.counts) == sorted(eager.counts)  # (jit returns a dict's keys sorted)
    assert int(frozen.counts[first]) == (2 if last == first else 1)


def test_an_ordered_dict_keeps_enum_keys_through_jit(write_module: Loader) -> None:
    module = write_module(SORTABLE)
    f, states = module.Ordered().functionalize()
    step = jax.jit(lambda f, s, x: f(s, x, module.Split.EVAL))
    _, states = step(f, states, 1.0)
    out, states = step(f, states, 3.0)
    assert float(out) == 6.0
    assert type(states["counts"]) is collections.OrderedDict
    assert [int(v) for v in states["counts"].values()] == [0, 2]


def test_other_flatten_errors_are_left_alone() -> None:
    class Broken:
        pass

    def flatten(_: Broken) -> None:
        raise ValueError("broken flatten")

    jax.tree_util.register_pytree_node(Broken, flatten, lambda aux, children: Broken())
    from autostate.lifetime import contains_tracer

    with pytest.raises(ValueError, match="broken flatten"):
        contains_tracer({"a": Broken()})
