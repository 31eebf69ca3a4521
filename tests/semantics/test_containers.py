"""Containers as state: lists, dicts, sets, deques, tuples, namedtuples and
containers JAX takes as one leaf; element writes, in-place container methods,
holders of sub-models, unsortable keys.

Each case runs a class as plain Python and decorated (the harness in
``tests/semantics/harness.py``, or a direct comparison) and asserts the
decorated program means what the plain one does: eagerly, through
``f(states, ...)``, under ``jax.jit`` and after ``autostate.freeze``, or that it
is refused with a clear error. A known difference stays as ``xfail(strict=True)``
with what differs.
"""

from __future__ import annotations

import collections
import re
import sys
import types
import typing
import weakref
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autostate
import autostate.errors
from autostate import errors
from autostate.errors import (
    InvalidTypeError,
    TracedEagerStateError,
)
from semantics.harness import (
    Call,
    Loader,
    X,
    _fcall,
    assert_bits,
    assert_same,
    assert_typed,
    assert_user_line,
    check,
    check_transform,
    error_line,
    pair,
    run_case,
    same,
    snapshot,
    staged,
    user_line,
)
from semantics.programs_containers import BEAM, DQN, EMA_LR, GPT, GROW, HELPER_MODULE, OUTSIDE
from semantics.programs_containers import SYNTAX_FORMS as CONSTRUCTS
from semantics.programs_functional import REBUILD
from semantics.programs_methods import PROBE
from semantics.programs_numerics import DTYPES
from semantics.programs_shared import A1 as WEAK_ONE
from semantics.programs_shared import A2 as WEAK_TWO
from semantics.programs_shared import PROMPT, X1, X23, XK, XP
from semantics.programs_shared import TWO as X2
from semantics.programs_shared import V2_SIGNED as V2
from semantics.programs_submodels import SUBMODELS
from semantics.programs_transformations import KV, LAZY
from semantics.references import (
    dqn_calls,
    jitted,
)

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
        staged(lambda x: model(x, module.Split.TRAIN))(1.0)
    assert [int(v) for v in model.counts.values()] == [0, 0]


def test_model_built_inside_jit_keeps_enum_keyed_tracers(write_module: Loader) -> None:
    module = write_module(COUNTER)

    def build_and_call(x: jax.Array) -> jax.Array:
        model = module.Counter()
        model.counts = {module.Split.TRAIN: x.astype(jnp.int32), module.Split.EVAL: x.astype(jnp.int32)}
        return model(x, module.Split.TRAIN)

    assert float(staged(build_and_call)(jnp.asarray(2.0))) == 6.0


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
        staged(lambda m, x: m(x, module.Split.TRAIN))(model, 1.0)
    assert_clear(err, where, "Split")
    with pytest.raises(InvalidTypeError) as err:
        jax.tree_util.tree_leaves(model)
    assert_clear(err, where, "Split")


def test_a_lax_call_threading_the_state(write_module: Loader) -> None:
    module = write_module(COUNTER)
    model = module.Counter()
    assert float(model.total(jnp.ones(3))) == 3.0  # a body that assigns no state
    # A body that assigns a state threads every state of the model (autostate/lifting).
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


UNSORTED_HOLDERS = """
@DECORATE
class Leaf:
    def __init__(self, k):
        self.w = jnp.ones(3) * k
        self.n = jnp.zeros(())

    def __call__(self, x):
        self.n = self.n + x.sum()
        return x * self.w


@DECORATE
class ByMixedKeys:
    def __init__(self):
        self.leaves = {1: Leaf(1.0), (2, "a"): Leaf(2.0), 0: Leaf(3.0)}
        self.tables = {1: jnp.ones(3), "a": jnp.full(3, 2.0)}

    def __call__(self, x):
        for k in self.leaves:
            x = self.leaves[k](x)
        return (x * self.tables["a"] + self.tables[1]).sum()

    def peek(self, x):
        return sum((self.leaves[k].w * x).sum() for k in self.leaves)
"""


def test_sub_models_and_parameters_under_keys_that_do_not_sort(write_module: Loader) -> None:
    # (a model holding them ran eagerly and in f, and jax.jit(f) and
    # autostate.jit raised JAX's "Comparator raised exception while sorting")
    plain, dec = pair(write_module, UNSORTED_HOLDERS)
    calls: list[Call] = [("__call__", (jnp.arange(3.0),))] * 2
    check(plain, dec, "ByMixedKeys()", calls)
    ref, model = plain.ByMixedKeys(), dec.ByMixedKeys()
    step = autostate.jit(lambda m, x: m(x))
    for _ in range(2):
        assert_same(ref(jnp.arange(3.0)), step(model, jnp.arange(3.0)), "autostate.jit output")
    assert_same(snapshot(ref), snapshot(model), "autostate.jit attributes")
    # The model as JAX's pytree (jax.jit given the model itself).
    rebuilt = jax.tree_util.tree_map(lambda a: a, model)
    assert list(rebuilt.leaves) == list(model.leaves) and list(rebuilt.tables) == [1, "a"]
    x = jnp.arange(3.0)
    assert_same(ref.peek(x), jax.jit(lambda m, x: m.peek(x))(model, x), "jax.jit of the model")


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
    step = staged(lambda f, s, x: f(s, x))  # the user's line inside the trace
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
    step = staged(lambda f, s, x, k: f(s, x, k), static_argnums=3)
    _, states = step(f, states, 2.0, first)
    out, states = step(f, states, 2.0, last)
    assert float(out) == (4.0 if last == first else 2.0)
    frozen = autostate.freeze(f, states)
    assert sorted(frozen.counts) == sorted(eager.counts)  # (jit returns a dict's keys sorted)
    assert int(frozen.counts[first]) == (2 if last == first else 1)


def test_an_ordered_dict_keeps_enum_keys_through_jit(write_module: Loader) -> None:
    module = write_module(SORTABLE)
    f, states = module.Ordered().functionalize()
    step = staged(lambda f, s, x: f(s, x, module.Split.EVAL))
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


A1 = jnp.asarray(1.5)


A2 = jnp.asarray(-0.5)


# A method's name is no type: whether a call is refused is one lookup in the
# analysis's table of mutating names, the same for every name in it; one dict
# and one list mutator stand for them all.
NAMES = ["update", "append"]


SUB = """
@DECORATE
class Sub:
    def __init__(self):
        self.value = jnp.zeros(())
        self.w = jnp.asarray(2.0)

    def NAME(self, x):
        self.value = 0.5 * self.value + 0.5 * x * self.w
        return self.value
"""


# How the model holds its sub-models: the attribute a method reassigns (state
# to the analysis, a sub-model at run time) or only __init__ assigns.
HOLDERS = {
    "direct": """
@DECORATE
class Model:
    def __init__(self):
        self.sub = Sub()

    def __call__(self, x):
        return self.sub.NAME(x) + 1.0
""",
    "reset": """
@DECORATE
class Model:
    def __init__(self):
        self.sub = Sub()

    def reset(self):
        self.sub = Sub()

    def __call__(self, x):
        return self.sub.NAME(x) + 1.0
""",
    "list": """
@DECORATE
class Model:
    def __init__(self):
        self.subs = [Sub(), Sub()]

    def reset(self):
        self.subs = [Sub(), Sub()]

    def __call__(self, x):
        return self.subs[1].NAME(x) + self.subs[0].NAME(2.0 * x)
""",
    "dict": """
@DECORATE
class Model:
    def __init__(self):
        self.subs = {"a": Sub(), "b": Sub()}

    def reset(self):
        self.subs = {"a": Sub(), "b": Sub()}

    def __call__(self, x):
        return self.subs["a"].NAME(x) * self.subs["b"].NAME(x)
""",
}


def _source(holder: str, name: str) -> str:
    return (SUB + HOLDERS[holder]).replace("NAME", name)


@pytest.mark.parametrize("holder", list(HOLDERS))
@pytest.mark.parametrize("name", NAMES)
def test_a_sub_model_method_named_like_a_mutator(write_module: Loader, holder: str, name: str):
    plain, dec = pair(write_module, _source(holder, name))
    calls = [("__call__", (A1,)), ("__call__", (A2,))]
    check(plain, dec, "Model()", calls)
    check_transform(plain, dec, "Model()", [("__call__", (X,)), ("__call__", (X,))], A1, "grad")


@pytest.mark.parametrize("holder", ["reset", "list", "dict"])
def test_reset_then_call_eagerly(write_module: Loader, holder: str):
    """The reassignment runs too (eagerly: inside f it would change the
    model's structure, which is refused whatever the method's name)."""
    plain, dec = pair(write_module, _source(holder, "update"))
    check(plain, dec, "Model()", [("__call__", (A1,)), ("reset", ()), ("__call__", (A2,))],
          modes=("eager",))
    model = dec.Model()
    model(A1)
    model.reset()
    f, states = model.functionalize()
    ref = plain.Model()
    ref(A1)
    ref.reset()
    out, states = staged(lambda f, s, x: f(s, x))(f, states, A2)
    np.testing.assert_allclose(out, ref(A2), rtol=1e-6)


def test_the_sub_model_written_by_its_update_is_the_state_f_returns(write_module: Loader):
    """The bug's own model: the EMA's value is a state of f, not lost."""
    plain, dec = pair(write_module, _source("reset", "update"))
    f, states = dec.Model().functionalize()
    assert sorted(states) == ["sub.value"]
    out, states = staged(lambda f, s, x: f(s, x))(f, states, A1)
    ref = plain.Model()
    np.testing.assert_allclose(out, ref(A1), rtol=1e-6)
    np.testing.assert_allclose(states["sub.value"], ref.sub.value, rtol=1e-6)


HELPER = """
class Scaler:
    def __init__(self, k):
        self.k = k

    def update(self, x):
        return x * self.k

    def add(self, x):
        return x + self.k


@DECORATE
class WithHelper:
    def __init__(self):
        self.helper = Scaler(2.0)
        self.n = jnp.zeros(())
        self.w = jnp.asarray(3.0)

    RESET

    def __call__(self, x):
        self.n = self.n + 1.0
        return self.helper.update(x * self.w) + self.helper.add(self.n)
"""


def test_a_helper_object_with_an_update_method(write_module: Loader):
    plain, dec = pair(write_module, HELPER.replace("RESET", ""))
    check(plain, dec, "WithHelper()", [("__call__", (A1,)), ("__call__", (A2,))])
    check_transform(plain, dec, "WithHelper()", [("__call__", (X,)), ("__call__", (X,))], A1,
                    "grad")


def test_a_helper_object_reassigned_in_reset(write_module: Loader):
    """Reassigned in a method, the helper is a state holding an opaque
    object: eagerly, through f and under grad it runs as in plain Python
    (jax.jit cannot take such a state as an argument, whatever its methods'
    names)."""
    source = HELPER.replace("RESET", "def reset(self):\n        self.helper = Scaler(-1.0)")
    plain, dec = pair(write_module, source)
    calls = [("__call__", (A1,)), ("reset", ()), ("__call__", (A2,))]
    check(plain, dec, "WithHelper()", calls, modes=("eager",))
    check(plain, dec, "WithHelper()", [("__call__", (A1,)), ("__call__", (A2,))], modes=("f",))
    f, states = dec.WithHelper().functionalize()

    def twice(model_call, x):
        return model_call(x) + model_call(x)

    expected = jax.grad(lambda x: twice(plain.WithHelper(), x))(A1)
    got = jax.grad(lambda x: f(f(states, x)[1], x)[0] + f(states, x)[0])(A1)
    np.testing.assert_allclose(got, expected, rtol=1e-6)


# Values that cannot be an object with an ``update`` of its own (containers,
# and arrays, which have no such methods at all): the documented decoration
# error, naming the line of the call and the fix.
PROVEN = {
    "list": ("[]", "self.log.append(x)"),
    "dict": ("{}", "self.log.update(k=x)"),
    "set": ("set()", "self.log.add(1)"),
    "list()": ("list(())", "self.log.extend([x])"),
    "deque": ("collections.deque()", "self.log.append(x)"),
    "comprehension": ("[0 for _ in range(2)]", "self.log.pop()"),
    "nested": ("[[], []]", "self.log[0].append(x)"),
    "declared": ("autostate.state([])", "self.log.clear()"),
    "arithmetic": ("[0] * 2", "self.log.insert(0, x)"),
    "array": ("jnp.zeros(3)", "self.log.append(x)"),
}


@pytest.mark.parametrize("case", list(PROVEN))
def test_a_container_state_changed_in_place_is_the_documented_error(
    write_module: Loader, case: str
):
    value, call = PROVEN[case]
    module = write_module(
        f"""
import collections
import jax.numpy as jnp
import autostate


class Log:
    def __init__(self):
        self.log = {value}

    def reset(self):
        self.log = {value.replace("autostate.state([])", "[]")}

    def record(self, x):
        {call}
        return x
"""
    )
    with pytest.raises(errors.DecorationError, match="mutates state 'log' in place") as info:
        autostate.stateful(module.Log)
    message = str(info.value)
    where = re.search(r"at (\S+\.py):(\d+)", message)
    assert where, message
    assert Path(where[1]).read_text().splitlines()[int(where[2]) - 1].strip() == call
    assert "fix: assign a new value" in message


def test_a_shadowed_constructor_shows_no_container(write_module: Loader):
    """A local ``list`` is no builtin: ``list()`` here builds a sub-model."""
    plain, dec = pair(
        write_module,
        SUB.replace("NAME", "update")
        + """
@DECORATE
class Log:
    def __init__(self):
        list = Sub
        self.log = list()

    def reset(self):
        list = Sub
        self.log = list()

    def __call__(self, x):
        return self.log.update(x)
""",
    )
    check(plain, dec, "Log()", [("__call__", (A1,)), ("__call__", (A2,))])


# Values that may be an object with methods of its own: decorating succeeds.
UNPROVEN_SPELLINGS = {
    # An item a method puts in may be anything (a sub-model here).
    "item-replaced": ("[[]]", "self.log[0] = Sub()", "self.log[0].update(x)"),
    "items-added": ("[[]]", "self.log += [Sub()]", "self.log[1].update(x)"),
    # No item to prove anything of; an unpacked one is unknown.
    "empty": ("[]", "self.log = [Sub()]", "self.log[0].update(x)"),
    "starred": ("[[]]", "self.log = [*self.log]", "self.log[0].append(x)"),
    # A whole value whose spelling shows no container or array.
    "slice": ("[]", "self.log = self.log[-1:]", "self.log.append(x)"),
    "name": ("[]", "self.log = x", "self.log.append(x)"),
    "tuple-target": ("[]", "(self.log,) = ([],)", "self.log.append(x)"),
    "call": ("[]", "self.log = make()", "self.log.append(x)"),
    "either": ("[]", "self.log = [] if x else Sub()", "self.log.update(x)"),
    "inherited-only": (None, "pass", "self.log.update(x)"),
}


@pytest.mark.parametrize("case", list(UNPROVEN_SPELLINGS))
def test_what_proves_no_container_is_not_refused(write_module: Loader, case: str):
    init, other, call = UNPROVEN_SPELLINGS[case]
    module = write_module(
        f"""
import autostate


def make():
    return []


@autostate.stateful
class Sub:
    def __init__(self):
        self.n = 0

    def update(self, x):
        self.n = self.n + 1


@autostate.stateful
class Base:
    def __init__(self):
        self.log = Sub()

    def reset(self):
        self.log = Sub()


class Log({"Base" if init is None else ""}):
    def __init__(self):
        {"super().__init__()" if init is None else f"self.log = {init}"}

    def other(self, x):
        {other}

    def __call__(self, x):
        {call}
"""
    )
    autostate.stateful(module.Log)  # no DecorationError


# A list state the analysis cannot prove a container (what a method assigns
# is an expression, not a display), changed in place: the change reaches the
# states f returns, in every mode, as plain Python's model keeps it.
UNPROVEN = """
@DECORATE
class History:
    def __init__(self):
        self.losses = []
        self.w = jnp.asarray(2.0)

    def record(self, x):
        self.losses.append(x * self.w)
        self.losses.extend([x])
        return len(self.losses)

    def keep_last(self):
        self.losses = self.losses[-1:]
        return 0
"""


def test_an_unproven_list_state_changed_in_place_is_never_lost(write_module: Loader):
    plain, dec = pair(write_module, UNPROVEN)
    calls = [("record", (A1,)), ("record", (A2,)), ("keep_last", ()), ("record", (A1,))]
    check(plain, dec, "History()", calls, modes=("eager",))
    ref = plain.History()
    for m, a in calls:
        getattr(ref, m)(*a)
    for mode in ("f", "jit"):
        model = dec.History()
        f, states = model.functionalize()
        given = states
        for m, a in calls:
            call = getattr(f, m)
            if mode == "jit":
                call = staged(lambda f, s, *a, m=m: getattr(f, m)(s, *a))
                out, states = call(f, states, *a)
            else:
                out, states = call(states, *a)
        assert given == {"losses": []} and model.losses == [], mode
        assert len(states["losses"]) == len(ref.losses) == 3, mode
        np.testing.assert_allclose(jnp.stack(states["losses"]), jnp.stack(ref.losses), rtol=1e-6)
        frozen = autostate.freeze(f, states)
        assert len(frozen.losses) == 3
    model = dec.History()
    f, states = model.functionalize()
    grad = jax.grad(lambda x: sum(f.record(states, x)[1]["losses"]))(A1)
    np.testing.assert_allclose(grad, 3.0)


def test_an_unproven_list_state_changed_in_a_lax_body_is_refused(write_module: Loader):
    """One trace of a scan body would append one tracer, not one per step."""
    module = write_module(
        """
import jax
import jax.numpy as jnp
import autostate


def fresh():
    return []


@autostate.stateful
class ScanLog:
    def __init__(self):
        self.losses = fresh()

    def reset(self):
        self.losses = fresh()

    def __call__(self, xs):
        def body(c, x):
            self.losses.append(x)
            return c + x, x
        c, _ = jax.lax.scan(body, 0.0, xs)
        return c
"""
    )
    f, states = module.ScanLog().functionalize()
    xs = jnp.arange(3.0)
    with pytest.raises(autostate.AutostateError):
        f(states, xs)
    with pytest.raises(autostate.AutostateError):
        staged(lambda s, x: f(s, x))(states, xs)
    with pytest.raises(autostate.AutostateError):
        module.ScanLog()(xs)


def test_an_unproven_list_state_of_an_unhandled_category_is_refused_under_jit(
    write_module: Loader,
):
    """A state f does not handle lives in the model: changed in place under
    jax.jit the change would be lost when the trace ends."""
    module = write_module(
        """
import jax.numpy as jnp
import autostate


def fresh():
    return []


@autostate.stateful
class Logged:
    def __init__(self):
        self.losses = autostate.state(fresh(), category="log")
        self.w = autostate.state(jnp.ones(()), category="params")

    def __call__(self, x):
        self.losses.append(x * self.w)
        self.w = self.w + 1.0
        return x
"""
    )
    model = module.Logged()
    f, states = model.functionalize("params")
    out, new = f(states, A1)  # eagerly the model's own list changes, as plain Python's
    assert len(model.losses) == 1 and float(new["w"]) == 2.0
    model = module.Logged()
    f, states = model.functionalize("params")
    with pytest.raises(errors.StateAccessError, match="losses"):
        staged(lambda s, x: f(s, x))(states, A1)


UNDECORATED_BASE = SUB.replace("NAME", "update") + """
class Base:
    def step(self, x):
        return self.sub.update(x) + 1.0

@DECORATE
class Model(Base):
    def __init__(self):
        self.sub = Sub()

    def reset(self):
        self.sub = Sub()
"""


def test_an_undecorated_base_calling_a_sub_models_update(write_module: Loader):
    plain, dec = pair(write_module, UNDECORATED_BASE)
    check(plain, dec, "Model()", [("step", (A1,)), ("step", (A2,))])


def test_an_undecorated_base_appending_to_a_list_state_is_refused(write_module: Loader):
    with pytest.raises(errors.DecorationError) as info:
        pair(write_module, """
class Base:
    def push(self, x):
        self.buf.append(x)
        return len(self.buf)

@DECORATE
class Model(Base):
    def __init__(self):
        self.buf = []

    def reset(self):
        self.buf = []
""")
    message = str(info.value)
    assert "its undecorated base class Base changes state 'buf' in place" in message
    assert "self.buf.append(...)" in message and "fix: decorate Base" in message


def test_an_undecorated_base_appending_to_an_unproven_list_threads_it(write_module: Loader):
    plain, dec = pair(write_module, """
def make():
    return [jnp.zeros(())]

class Base:
    def push(self, x):
        self.buf.append(x)
        return len(self.buf)

@DECORATE
class Model(Base):
    def __init__(self):
        self.buf = make()

    def reset(self):
        self.buf = make()
""")
    ref = plain.Model()
    expected = [ref.push(A1), ref.push(A2)]
    model = dec.Model()
    f, states = model.functionalize()
    before = len(states["buf"])
    out1, states1 = f.push(states, A1)
    out2, states2 = f.push(states1, A2)
    assert [out1, out2] == expected
    assert len(states["buf"]) == before and len(model.buf) == before  # nothing else changed
    assert len(states2["buf"]) == len(ref.buf)
    np.testing.assert_allclose(states2["buf"][-1], ref.buf[-1])


SOURCE = """
import collections


class Tagged(dict):
    pass


class Items(list):
    pass


def make(kind):
    zero = jnp.zeros(2)
    if kind == "counter":
        return collections.Counter(a=zero, n=0)
    if kind == "dict_subclass":
        box = Tagged(a=zero, n=0)
        box.tag = "kept"
        return box
    if kind == "user_dict":
        return collections.UserDict(a=zero, n=0)
    if kind == "list_subclass":
        return Items([zero, 0])
    if kind == "user_list":
        return collections.UserList([zero, 0])
    if kind == "deque":
        return collections.deque([zero, 0], maxlen=2)
    if kind == "nested":
        return {"inner": collections.Counter(a=zero, n=0), "w": zero}


@DECORATE
class Model:
    def __init__(self, kind):
        self.kind = kind
        self.box = make(kind)
        self.scale = jnp.full(2, 2.0)

    def __call__(self, x):
        if self.kind == "nested":
            inner = self.box["inner"]
            self.box["inner"] = collections.Counter(a=inner["a"] + x * self.scale, n=inner["n"] + 1)
            return self.box["inner"]["a"].sum()
        key_a, key_n = ("a", "n") if isinstance(self.box, (dict, collections.UserDict)) else (0, 1)
        self.box[key_a] = self.box[key_a] + x * self.scale
        self.box[key_n] = self.box[key_n] + 1
        return self.box[key_a].sum()
"""


KINDS = ["counter", "dict_subclass", "user_dict", "list_subclass", "user_list", "deque", "nested"]


def _same_box(expected, got, where: str) -> None:
    """Same type (by name: the plain and decorated modules define their own),
    same items, same ``maxlen`` and own attributes."""
    assert type(expected).__name__ == type(got).__name__, f"{where}: {type(got)}"
    if isinstance(expected, collections.deque):
        assert expected.maxlen == got.maxlen, where
    own = {k: v for k, v in getattr(expected, "__dict__", {}).items() if k != "data"}
    assert own == {k: v for k, v in getattr(got, "__dict__", {}).items() if k != "data"}, where
    items = dict(expected) if hasattr(expected, "keys") else dict(enumerate(expected))
    got_items = dict(got) if hasattr(got, "keys") else dict(enumerate(got))
    assert sorted(items, key=str) == sorted(got_items, key=str), where
    for key, value in items.items():
        if isinstance(value, int):
            assert type(got_items[key]) is int and got_items[key] == value, f"{where}[{key!r}]"
        elif hasattr(value, "keys"):
            _same_box(value, got_items[key], f"{where}[{key!r}]")
        else:
            np.testing.assert_allclose(got_items[key], value, err_msg=f"{where}[{key!r}]")


def _models(write_module: Loader, kind: str):
    plain, dec = pair(write_module, SOURCE)
    return plain.Model(kind), dec.Model(kind)


@pytest.mark.parametrize("kind", KINDS)
def test_eager_f_jit_and_freeze_keep_the_container(write_module: Loader, kind: str) -> None:
    ref, model = _models(write_module, kind)
    xs = [jnp.float32(1.0), jnp.float32(0.5)]
    expected = [float(ref(x)) for x in xs]

    assert [float(model(x)) for x in xs] == pytest.approx(expected)
    _same_box(ref.box, model.box, "eager")

    _, fresh = _models(write_module, kind)
    f, states = fresh.functionalize()
    jitted = staged(lambda f, s, x: f(s, x))
    for mode in ("f", "jit"):
        s = states
        outs = []
        for x in xs:
            out, s = (f if mode == "f" else lambda *a: jitted(f, *a))(s, x)
            outs.append(float(out))
        assert outs == pytest.approx(expected), mode
        _same_box(ref.box, s["box"], f"{mode} states")
    _same_box(fresh.box, _models(write_module, kind)[1].box, "the eager model is unchanged")
    frozen = autostate.freeze(f, s)
    _same_box(ref.box, frozen.box, "frozen")
    assert float(frozen(xs[0])) == pytest.approx(float(ref(xs[0])))


@pytest.mark.parametrize("kind", ["counter", "deque", "nested"])
def test_a_frozen_model_passes_through_jit_as_a_pytree(write_module: Loader, kind: str) -> None:
    _, model = _models(write_module, kind)
    f, states = model.functionalize()
    frozen = autostate.freeze(f, states)
    again = staged(lambda m: m)(frozen)
    _same_box(frozen.box, again.box, "through jit")


@pytest.mark.parametrize("kind", ["counter", "user_list", "nested"])
def test_grad_through_a_state_in_the_container(write_module: Loader, kind: str) -> None:
    ref, model = _models(write_module, kind)
    f, states = model.functionalize()

    def loss(x):
        out, s = f(states, x)
        box = s["box"]["inner"] if kind == "nested" else s["box"]
        first = box["a"] if hasattr(box, "keys") else box[0]
        return out + first.sum()

    # d/dx of 2 * sum(x * scale): the output and the state each give 4.
    assert float(jax.grad(loss)(jnp.float32(1.0))) == pytest.approx(8.0)
    assert float(staged(jax.grad(loss))(jnp.float32(1.0))) == pytest.approx(8.0)


@pytest.mark.parametrize("kind", ["counter", "dict_subclass", "deque"])
def test_a_tracer_in_the_container_of_an_eager_model_is_refused(
    write_module: Loader, kind: str
) -> None:
    _, model = _models(write_module, kind)
    with pytest.raises(autostate.errors.TracedEagerStateError) as info:
        staged(lambda x: model(x))(jnp.float32(1.0))
    assert "test_opaque_containers" not in str(info.value)  # the user's module, not ours
    assert not any(
        isinstance(leaf, jax.core.Tracer)
        for leaf in (model.box.values() if hasattr(model.box, "values") else model.box)
    )


DELETING = """
import collections


class Items(list):
    pass


@DECORATE
class Shrinking:
    def __init__(self, kind):
        zero = jnp.zeros(2)
        if kind == "counter":
            self.box = collections.Counter(a=zero, b=zero + 1)
        elif kind == "user_dict":
            self.box = collections.UserDict(a=zero, b=zero + 1)
        else:
            self.box = Items([zero, zero + 1])

    def drop(self, x):
        del self.box["a" if hasattr(self.box, "keys") else 0]
        return x
"""


@pytest.mark.parametrize("kind", ["counter", "user_dict", "list_subclass"])
def test_del_of_an_item_keeps_the_type(write_module: Loader, kind: str) -> None:
    plain, dec = pair(write_module, DELETING)
    ref = plain.Shrinking(kind)
    ref.drop(1.0)
    model = dec.Shrinking(kind)
    model.drop(1.0)
    _same_box(ref.box, model.box, "eager")
    f, states = dec.Shrinking(kind).functionalize()
    _, after = staged(f.drop)(states, 1.0)
    _same_box(ref.box, after["box"], "jit")


@autostate.stateful
class Stats:
    def __init__(self):
        self.mean = jnp.zeros(())

    def observe(self, x):
        self.mean = self.mean + x
        return self.mean


@autostate.stateful
class Observer:
    def __init__(self, how):
        self.stats = Stats()
        if how == "ref":
            self.reach = weakref.ref(self.stats)
        elif how == "method":
            self.reach = weakref.WeakMethod(self.stats.observe)
        else:
            self.reach = weakref.proxy(self.stats)
        self.how = how

    def __call__(self, x):
        if self.how == "ref":
            return self.reach().observe(x)
        if self.how == "method":
            return self.reach()(x)
        return self.reach.observe(x)


@pytest.mark.parametrize("how", ["ref", "method"])
def test_weak_references_follow_fs_copy(how: str) -> None:
    model = Observer(how)
    f, states = model.functionalize()
    out, new = f(states, 2.0)
    assert float(out) == 2.0 and float(new["stats.mean"]) == 2.0
    out, new = staged(lambda f, s, x: f(s, x))(f, new, 3.0)
    assert float(out) == 5.0 and float(new["stats.mean"]) == 5.0
    assert float(model.stats.mean) == 0.0  # the eager model is its own
    frozen = autostate.freeze(f, new)
    assert float(frozen(1.0)) == 6.0 and float(frozen.stats.mean) == 6.0
    assert float(model(1.0)) == 1.0


def test_a_weak_proxy_to_a_model_is_refused_with_the_path() -> None:
    model = Observer("proxy")
    assert float(model(1.0)) == 1.0  # eagerly it is plain Python
    with pytest.raises(InvalidTypeError, match=r"weakref.proxy.*\(at reach\)") as info:
        model.functionalize()
    assert f"{__file__}:" in str(info.value) and "weakref.ref" in str(info.value)


class Plain:
    def __init__(self, held):
        self.held = held


class MyDict(dict):
    pass


class MyList(list):
    pass


class Pair(typing.NamedTuple):
    a: typing.Any
    b: typing.Any


HOLDERS_holders = {
    "OrderedDict": lambda v: collections.OrderedDict(a=v),
    "defaultdict": lambda v: collections.defaultdict(int, a=v),
    "NamedTuple": lambda v: Pair(v, 0),
    "MyDict": lambda v: MyDict(a=v),
    "MyList": lambda v: MyList([v]),
}


WALKED = {"OrderedDict", "defaultdict", "NamedTuple"}


@autostate.stateful
class Holding:
    def __init__(self, holder, what):
        self.n = jnp.zeros(())
        inner = {"model": Stats(), "array": jnp.ones(()), "plain": Plain(jnp.ones(()))}[what]
        self.extra = HOLDERS_holders[holder](inner)

    def first(self):
        extra = self.extra
        return extra["a"] if isinstance(extra, dict) else extra[0]

    def __call__(self, x):
        first = self.first()
        if isinstance(first, Stats):
            return first.observe(x)
        self.n = self.n + x
        return self.n


@pytest.mark.parametrize("holder", list(HOLDERS_holders))
def test_a_sub_model_in_a_container_subclass(holder: str) -> None:
    model = Holding(holder, "model")
    if holder in WALKED:
        f, states = model.functionalize()
        out, new = staged(lambda f, s, x: f(s, x))(f, states, 2.0)
        assert float(out) == 2.0 and float(model.first().mean) == 0.0
        assert sorted(float(v) for v in new.values()) == [0.0, 2.0]
    else:
        with pytest.raises(InvalidTypeError, match=rf"{holder}.*register") as info:
            model.functionalize()
        assert f"{__file__}:" in str(info.value)


@pytest.mark.parametrize("holder", list(HOLDERS_holders))
@pytest.mark.parametrize("what", ["array", "plain"])
def test_an_array_in_a_container_subclass(holder: str, what: str) -> None:
    model = Holding(holder, what)
    if holder in WALKED and what == "array":
        f, states = model.functionalize()  # a parameter, as in a dict
        assert len(jax.tree_util.tree_leaves(f)) == 1
        return
    with pytest.raises(InvalidTypeError, match="holds an array inside") as info:
        model.functionalize()
    assert f"{__file__}:" in str(info.value)


def grow(model, x):
    model.items += [x]  # outside the class: the list changed in place


def alias_append(model, x):
    items = model.items
    items.append(x)


@autostate.stateful
class Growing:
    def __init__(self):
        self.items = [jnp.zeros(())]

    def reset(self):
        self.items = [jnp.zeros(())]

    def add(self, x, helper):
        helper(self, x)
        return len(self.items)


@pytest.mark.parametrize("helper", [grow, alias_append], ids=["iadd", "alias"])
def test_list_states_changed_in_place_never_change_a_callers_dict(helper) -> None:
    model = Growing()
    f, states = model.functionalize()
    helper(model, 1.0)  # the eager model's list: not the states dict's
    assert len(model.items) == 2 and len(states["items"]) == 1
    out1, new1 = f.add(states, 2.0, helper)
    out2, _ = f.add(states, 2.0, helper)
    assert out1 == out2 == 2 and len(states["items"]) == 1 and len(new1["items"]) == 2
    frozen = autostate.freeze(f, new1)
    helper(frozen, 3.0)
    assert len(frozen.items) == 3 and len(new1["items"]) == 2
    np.testing.assert_allclose(jnp.stack(new1["items"]), [0.0, 2.0])


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
    check(plain, dec, "KVCache(4, 3)", [("__call__", (np.asarray(row), np.asarray(row) + 1))] * 2)


def test_kv_cache_at_set(write_module: Loader) -> None:
    plain, dec = pair(write_module, KVCACHE)
    row = jnp.arange(3.0)
    check(plain, dec, "AtCache(4, 3)", [("write", (row,)), ("write", (row + 1,)), ("read", ())])
    check_transform(plain, dec, "AtCache(4, 3)", [("write", (X,)), ("read", ())],
                    jnp.stack([row, row * 3]), "vmap")


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


def test_namedtuple_nested_and_empty_containers(write_module: Loader) -> None:
    plain, dec = pair(write_module, DTYPES)
    check(plain, dec, "Trees()", [("step", (1.0,)), ("step", (2.0,))])
    f, states = dec.Trees().functionalize()
    _, states = staged(f.step)(states, 1.0)
    assert type(states["pt"]).__name__ == "Pt"
    frozen = autostate.freeze(f, states)
    assert type(frozen.pt) is dec.Pt
    assert frozen.empty_l == [] and frozen.empty_t == () and frozen.empty_d == {}


def test_dict_state_keeps_insertion_order(write_module: Loader) -> None:
    plain, dec = pair(write_module, DTYPES)
    p, d = plain.Ordered(), dec.Ordered()
    assert list(p.d) == list(d.d) == ["b", "a"]
    assert list(p.ik) == list(d.ik) == [2, 1]
    check(plain, dec, "Ordered()", [("first", (1.0,))], modes=("eager", "f"))


def test_dict_subclass_states_keep_their_type(write_module: Loader) -> None:
    plain, dec = pair(write_module, DTYPES)
    p, d = plain.Typed2(), dec.Typed2()
    assert type(d.dd) is collections.defaultdict
    assert_same(p.put("y", 2.0), d.put("y", 2.0))
    assert type(d.od) is collections.OrderedDict
    assert list(p.od) == list(d.od)


def f_still_works(f: Any, states: dict[str, Any], name: str, *args: Any) -> None:
    """f answers the same eagerly and under jit after a refused call."""
    out1, s1 = _fcall(f, name)(states, *args)
    out2, s2 = staged(lambda f, s, *a: _fcall(f, name)(s, *a))(f, states, *args)
    assert_same(out1, out2, "after refusal")
    assert_same(s1, s2, "states after refusal")


def _either_plain_or_refused(plain: Any, dec: Any, build: str, calls: list[Call]) -> None:
    """Eagerly like plain Python; through f either like plain or a StateAccessError."""
    check(plain, dec, build, calls, modes=("eager",))
    model = eval(build, vars(dec))  # noqa: S307
    f, states = model.functionalize()
    try:
        check(plain, dec, build, calls, modes=("f", "jit", "freeze"))
    except autostate.errors.StateAccessError:
        f_still_works(f, states, "__call__", 1.0)


def test_tuple_of_model_and_array_state(write_module: Loader) -> None:
    plain, dec = pair(write_module, SUBMODELS)
    _either_plain_or_refused(plain, dec, "Blocks()", [("bump_pair", (1.0,)), ("bump_pair", (2.0,))])


def test_one_element_containers_none_and_number_states(write_module: Loader) -> None:
    plain, dec = pair(write_module, REBUILD, fresh=True)
    check(plain, dec, "OneElement()", [("__call__", (1.0,)), ("__call__", (2.0,))])


OBJECTS = """
@dataclasses.dataclass
class Box:
    a: typing.Any
    label: str


@DECORATE
class Holder:
    def __init__(self):
        self.box = Box(jnp.zeros(2), "b")
        self.log = []

    def __call__(self, x):
        self.box = Box(self.box.a + x, self.box.label + "!")
        self.log = self.log + [self.box.label]
        return self.box.a.sum(), len(self.log)
"""


def test_plain_objects_and_growing_lists_as_state_eagerly_and_through_f(
    write_module: Loader,
) -> None:
    plain, dec = pair(write_module, OBJECTS)
    ref, model = plain.Holder(), dec.Holder()
    for x in (X1, X2):
        assert_typed(ref(x), model(x), "eager")
    f, states = model.functionalize()
    for x in (X1, X2):
        out, states = f(states, x)
        assert_typed(ref(x), out, "f")
    assert (states["box"].label, states["log"]) == (ref.box.label, ref.log)
    np.testing.assert_array_equal(states["box"].a, ref.box.a)
    frozen = autostate.freeze(f, states)
    assert_typed(ref(X1), frozen(X1), "frozen")
    assert frozen.log == ref.log and type(frozen.box) is dec.Box


def test_append_to_a_list_state_is_the_documented_decoration_error(write_module: Loader) -> None:
    source = """
@DECORATE
class History:
    def __init__(self):
        self.losses = []

    def record(self, loss):
        self.losses.append(loss)

    def reset(self):
        self.losses = []
"""
    with pytest.raises(autostate.errors.DecorationError, match="mutates state 'losses'") as info:
        pair(write_module, source)
    where = re.search(r"at (\S+autostate_testmod_\d+\.py):(\d+)", str(info.value))
    assert where, str(info.value)
    line = Path(where[1]).read_text().splitlines()[int(where[2]) - 1]
    assert "self.losses.append(loss)" in line
    assert "fix:" in str(info.value)


DICT_SUBCLASS_HOLDERS = """
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
    _, dec = pair(write_module, DICT_SUBCLASS_HOLDERS)
    with pytest.raises(autostate.errors.InvalidTypeError, match=r"extra\['a'\]") as info:
        dec.Holder(kind, back).functionalize()
    assert_user_line(info.value, __file__)


def _outside_pair(write_module: Loader) -> tuple[types.ModuleType, types.ModuleType]:
    import sys

    if "written_helpers" not in sys.modules:
        write_module(HELPER_MODULE, name="written_helpers")
    return pair(write_module, OUTSIDE)


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


def test_gpt_cached_decode_matches_full_recompute(write_module: Loader) -> None:
    _, dec = pair(write_module, GPT)
    f, states = dec.GPT(0, n_blocks=1, length=8).functionalize()  # one block: the same cache
    toks, s = jitted("greedy_scan", 3)(f, states, PROMPT)
    full = jnp.concatenate([PROMPT, toks[:-1]])
    logits, _ = jitted("__call__")(f, states, full)
    assert_bits(toks, jnp.argmax(logits[2:], -1).astype(jnp.int32))


def test_del_items_of_two_states_in_one_statement(write_module: Loader) -> None:
    source = """
@DECORATE
class DelItems:
    def __init__(self):
        self.d = {"k": jnp.ones(()), "j": jnp.zeros(())}
        self.lst = [jnp.ones(()), jnp.zeros(()), jnp.ones(()) * 3]

    def drop(self, v):
        self.d["new"] = v
        del self.d["k"], self.lst[0], self.lst[-1]
        return self.d["new"] + self.lst[0]
"""
    plain, dec = pair(write_module, source)
    check(plain, dec, "DelItems()", [("drop", (X1,))])


# A mixture-of-experts router's counters (``self.usage.at[idx].add(1)`` in a method
# another method calls) are the DQN's writes below (``.at[i].set`` in ``add``, the
# key written by ``sample`` inside ``train_step``).
# (``sync="where"`` is ``jnp.where``: the state writes the other two make too.)
@pytest.mark.parametrize("sync", ["cond", "cond_assigns"])
def test_dqn_replay_buffer_and_target_sync(write_module: Loader, sync: str) -> None:
    plain, dec = pair(write_module, DQN)
    # Three transitions and two train steps: the second one syncs the target. Eagerly
    # and through f (the decorated lax.cond traces its branches there too); a key state
    # and state writes in a cond branch under jax.jit: test_submodels.py
    # (test_key_state_in_sub_models, test_a_model_in_the_carry_is_the_one_model).
    check(plain, dec, f"DQN(0, sync={sync!r})", dqn_calls()[:5], modes=("eager", "f"))


def test_lr_schedule_written_into_optax_state_in_place(write_module: Loader) -> None:
    plain, dec = pair(write_module, EMA_LR)
    check(plain, dec, "Scheduled()", [("step", (jnp.ones(2),)), ("step", (jnp.array([2.0, -1.0]),)),
                                     ("step", (jnp.ones(2),))])


NT_STATE = """
class Hyper(typing.NamedTuple):
    count: typing.Any
    hp: dict


@DECORATE
class Holder:
    def __init__(self, named):
        d = {"lr": jnp.array(0.1)}
        self.s = Hyper(jnp.zeros((), jnp.int32), d) if named else (jnp.zeros((), jnp.int32), d)

    def step(self):
        hp = self.s[1]
        hp["lr"] = hp["lr"] * 0.5
        self.s = self.s
        return hp["lr"]
"""


@pytest.mark.parametrize("named", [False, True], ids=["tuple", "named_tuple"])
def test_dict_in_a_tuple_state_changed_in_place_leaves_callers_states(write_module: Loader,
                                                                     named: bool) -> None:
    _, dec = pair(write_module, NT_STATE)
    model = dec.Holder(named)
    f, states = model.functionalize()
    out, new = f.step(states)
    np.testing.assert_allclose(np.asarray(out), 0.05)
    np.testing.assert_allclose(np.asarray(new["s"][1]["lr"]), 0.05)
    np.testing.assert_allclose(np.asarray(states["s"][1]["lr"]), 0.1, err_msg="caller's states")
    np.testing.assert_allclose(np.asarray(model.s[1]["lr"]), 0.1, err_msg="eager model")


AUG_ITEMS = """
@DECORATE
class A:
    def __init__(self):
        self.i = np.arange(4, dtype=np.int32) + 5
        self.f = np.arange(4, dtype=np.float32) + 1.5
        self.b = np.zeros(4, bool)
        self.d = {"k": np.arange(3, dtype=np.int32)}
    def __call__(self, j):
        self.i[0] //= 2
        self.i[1] %= 3
        self.i[2] <<= 1
        self.i[3] >>= 1
        self.i[1:3] ^= 3
        self.f[0] **= 2
        self.f[1] //= np.float32(0.7)
        self.f[2] %= np.float32(1.1)
        self.f[j] -= np.float32(0.25)
        self.f[j] /= np.float32(2.0)
        self.b[j] |= True
        self.b[0] ^= True
        self.d["k"][1] *= 7
        self.d["k"][2] -= 9
        return self.i + 0, self.f + 0, self.b | False
"""


def test_every_augmented_operator_on_items(write_module: Loader) -> None:
    """Plain holds numpy arrays (which item-assign in place); autostate holds jax ones."""
    plain, dec = pair(write_module, AUG_ITEMS)
    run_case(plain, dec, "A()", [("__call__", (1,)), ("__call__", (2,))], extra=("__call__", (3,)))


ENUM_KEYS = """
import enum
class Split(enum.Enum):
    TRAIN = "train"
    EVAL = "eval"

@DECORATE
class Counter:
    def __init__(self):
        self.counts = {Split.TRAIN: jnp.zeros((), jnp.int32), Split.EVAL: jnp.zeros((), jnp.int32)}
    def __call__(self, x, split):
        self.counts[split] += 1
        return x * self.counts[split]
"""


def test_state_dict_keyed_by_a_plain_enum(write_module: Loader) -> None:
    plain, dec = pair(write_module, ENUM_KEYS)
    split = plain.Split
    ref = plain.Counter()
    expected = [ref(WEAK_ONE, split.TRAIN), ref(WEAK_ONE, split.TRAIN), ref(WEAK_TWO, split.EVAL)]
    model = dec.Counter()
    got = [model(WEAK_ONE, dec.Split.TRAIN), model(WEAK_ONE, dec.Split.TRAIN), model(WEAK_TWO, dec.Split.EVAL)]
    same(expected, got, "eager outputs")
    assert [int(v) for v in ref.counts.values()] == [int(v) for v in model.counts.values()]
    try:
        f, states = dec.Counter().functionalize()
        out, states = f(states, WEAK_ONE, dec.Split.TRAIN)
    except autostate.AutostateError as err:  # a clear refusal is acceptable through f
        user_line(err, dec, "self.counts = {")
    else:
        same(expected[0], out, "f output")


def test_kv_cache_prefill_reset_decode(write_module: Loader) -> None:
    # (``use_dus=True`` writes the cache by another JAX primitive: the same state writes.)
    plain, dec = pair(write_module, KV)
    calls = [("prefill_then_decode", (XK[:2], 2)), ("prefill_then_decode", (XK[1:], 2))]
    # Eagerly and through f (the decorated fori_loop traces its body there too); a
    # fori_loop writing a sub-model's states under jax.jit: test_submodels.py
    # (test_a_model_in_the_carry_is_the_one_model[fori_init]).
    check(plain, dec, "Decoder(1, 3, 5)", calls, modes=("eager", "f"))


def jit_call(f: Any, states: Any, *args: Any, method: str = "__call__") -> Any:
    return staged(lambda f, s, *a: (f if method == "__call__" else getattr(f, method))(s, *a))(
        f, states, *args
    )


TOK = jnp.array([3, 1, 2], jnp.int32)


def test_beam_search_list_cache_reordered_and_eos_finishes_beams(write_module: Loader) -> None:
    plain, dec = pair(write_module, BEAM)
    ref = plain.BeamDecoder(6, 5, 4, 3)
    ref.search2(TOK)
    assert bool(ref.finished.any())  # the next step exercises the finished mask
    calls = [("search2", (TOK,)), ("decode_step", ()), ("search2", (TOK[::-1],))]
    # Eagerly and through f; a list state that grows and shrinks under jax.jit:
    # test_growing_cache_and_list_and_tuple_states.
    check(plain, dec, "BeamDecoder(6, 5, 4, 3)", calls, modes=("eager", "f"))


@pytest.mark.parametrize("method", ["greedy", "greedy_python"])
def test_greedy_decode_fixed_cache(write_module: Loader, method: str) -> None:
    plain, dec = pair(write_module, BEAM)
    calls = [(method, (jnp.int32(2),)), (method, (jnp.int32(4),))]
    check(plain, dec, "BeamDecoder(6, 5, 4, 3)", calls)


BEAM_APPEND = """
@DECORATE
class Cache:
    def __init__(self):
        self.cache = []

    def reset(self):
        self.cache = []

    def __call__(self, h, idx):
        self.cache.append(h)
        self.cache = [c[idx] for c in self.cache]
        return jnp.stack(self.cache).sum(0)
"""


def test_cache_list_append_is_decoration_error(write_module: Loader) -> None:
    with pytest.raises(autostate.errors.DecorationError) as err:
        pair(write_module, BEAM_APPEND)
    msg = str(err.value)
    assert "self.cache.append" in msg and "self.cache = self.cache + [item]" in msg
    assert ".py:" in msg and "Cache.__call__" in msg


def test_list_appended_in_forward_not_state(write_module: Loader) -> None:
    # log is only appended (never assigned outside __init__): not state. Eagerly and through
    # f without jit it collects like plain Python; under jit a clear error, no tracer.
    plain, dec = pair(write_module, PROBE)
    calls = [("__call__", (XP,)), ("__call__", (XP * 2,))]
    check(plain, dec, "Logger()", calls, modes=("eager", "f"))
    model = dec.Logger()
    f, states = model.functionalize()
    with pytest.raises(autostate.errors.StateAccessError) as err:
        jit_call(f, states, XP)
    assert "Logger.log" in str(err.value) and "fix:" in str(err.value)
    assert __file__.rpartition("/")[2] + ":" in str(err.value)
    assert model.log == []


def test_flax_compact_params_dict_filled_through_f_before_the_first_call(
    write_module: Loader,
) -> None:
    # A dict state may gain keys in a call of f: the states f returns hold them.
    plain, dec = pair(write_module, LAZY)
    calls = [("__call__", (X23,)), ("__call__", (-X23,)), ("__call__", (2 * X23,))]
    run_case(plain, dec, "Compact(5, 2)", calls)


def test_growing_cache_and_list_and_tuple_states(write_module: Loader) -> None:
    plain, dec = pair(write_module, GROW)
    calls = [
        ("__call__", (V2,)),
        ("__call__", (2 * V2,)),
        ("__call__", (-V2,)),
        ("shrink", ()),
        ("reset", ()),
        ("__call__", (V2 + 1,)),
    ]
    run_case(plain, dec, "Cache()", calls)


# ---------------------------------------------------------------------------
# PyTorch's in-place tensor methods on a state (``self.x.mul_(m)``): the plain
# reference is the same class with each update spelled functionally, which is
# what PyTorch's in-place update means for the model.

INPLACE = """
@DECORATE
class RunningStats:
    def __init__(self, n, momentum=0.1):
        self.running_mean = jnp.zeros(n)
        self.running_var = jnp.ones(n)
        self.num_batches_tracked = jnp.zeros((), jnp.int32)
        self.momentum = momentum

    def __call__(self, x):
        m = self.momentum
        mean = self.running_mean.mul_(1 - m).add_(x.mean(0), alpha=m)
        self.running_var.mul_(1 - m).add_(x.var(0), alpha=m)
        self.num_batches_tracked.add_(1)
        return (x - mean) / jnp.sqrt(self.running_var + 1e-5)


@DECORATE
class Methods:
    def __init__(self):
        self.x = jnp.arange(4.0)
        self.i = jnp.arange(4, dtype=jnp.int32)
        self.cache = jnp.zeros((2, 3))
        self.d = {"a": jnp.ones(2), "b": jnp.zeros(2)}

    def __call__(self, v, pos):
        self.x.sub_(v, alpha=2.0).div_(4.0).clamp_(min=-1.0, max=0.5)
        self.i.mul_(3).clamp_max_(7)
        self.cache[:, pos].copy_(v[:2])
        self.cache[0].add_(1.0)
        self.d["a"].mul_(v[0])
        self.d["b"].fill_(3).lerp_(v[:2], 0.25)
        return self.x.sum() + self.cache.sum()

    def reset(self):
        self.x.zero_()
        self.cache.masked_fill_(self.cache > 1.5, -1.0)
        return self.x


@DECORATE
class Looped:
    def __init__(self):
        self.h = jnp.zeros(3)
        self.steps = jnp.zeros((), jnp.int32)

    def scan(self, xs):
        def body(carry, x):
            self.h.mul_(0.5).add_(x)
            self.steps.add_(1)
            return carry + self.h.sum(), self.h

        return lax.scan(body, 0.0, xs)

    def fori(self, x):
        def body(i, acc):
            self.h.addcmul_(x, x, value=0.5)
            return acc + self.h[i]

        return lax.fori_loop(0, 3, body, 0.0)


@DECORATE
class Shared:
    \"\"\"One running-stats module reachable from two paths: one state, both see it.\"\"\"

    def __init__(self):
        self.a = RunningStats(3)
        self.b = self.a

    def __call__(self, x):
        return self.a(x) + self.b(2 * x)
"""

INPLACE_FUNCTIONAL = [
    ("mean = self.running_mean.mul_(1 - m).add_(x.mean(0), alpha=m)",
     "self.running_mean = self.running_mean * (1 - m) + m * x.mean(0); mean = self.running_mean"),
    ("self.running_var.mul_(1 - m).add_(x.var(0), alpha=m)",
     "self.running_var = self.running_var * (1 - m) + m * x.var(0)"),
    ("self.num_batches_tracked.add_(1)", "self.num_batches_tracked = self.num_batches_tracked + 1"),
    ("self.x.sub_(v, alpha=2.0).div_(4.0).clamp_(min=-1.0, max=0.5)",
     "self.x = jnp.clip((self.x - 2.0 * v) / 4.0, -1.0, 0.5)"),
    ("self.i.mul_(3).clamp_max_(7)", "self.i = jnp.minimum(self.i * 3, 7)"),
    ("self.cache[:, pos].copy_(v[:2])", "self.cache = self.cache.at[:, pos].set(v[:2])"),
    ("self.cache[0].add_(1.0)", "self.cache = self.cache.at[0].add(1.0)"),
    ('self.d["a"].mul_(v[0])', 'self.d = {**self.d, "a": self.d["a"] * v[0]}'),
    ('self.d["b"].fill_(3).lerp_(v[:2], 0.25)',
     'self.d = {**self.d, "b": 3.0 + 0.25 * (v[:2] - 3.0)}'),
    ("self.x.zero_()", "self.x = jnp.zeros_like(self.x)"),
    ("self.cache.masked_fill_(self.cache > 1.5, -1.0)",
     "self.cache = jnp.where(self.cache > 1.5, -1.0, self.cache)"),
    ("self.h.mul_(0.5).add_(x)", "self.h = self.h * 0.5 + x"),
    ("self.steps.add_(1)", "self.steps = self.steps + 1"),
    ("self.h.addcmul_(x, x, value=0.5)", "self.h = self.h + 0.5 * x * x"),
]


def _inplace_pair(write_module: Loader) -> tuple[types.ModuleType, types.ModuleType]:
    return pair(write_module, INPLACE, plain_subs=INPLACE_FUNCTIONAL)


def test_inplace_running_stats_update_and_chain_value(write_module: Loader) -> None:
    plain, dec = _inplace_pair(write_module)
    x = jnp.arange(12.0).reshape(4, 3)
    check(plain, dec, "RunningStats(3)", [("__call__", (x,)), ("__call__", (x * x,))])
    f, states = dec.RunningStats(3).functionalize()
    assert sorted(states) == ["num_batches_tracked", "running_mean", "running_var"]
    assert states["num_batches_tracked"].dtype == jnp.int32


def test_inplace_methods_items_and_containers(write_module: Loader) -> None:
    plain, dec = _inplace_pair(write_module)
    v = jnp.array([1.0, -2.0, 3.0, 0.5])
    calls = [("__call__", (v, 1)), ("__call__", (-v, 2)), ("reset", ())]
    check(plain, dec, "Methods()", calls)
    model = dec.Methods()
    model(v, 0)
    assert model.i.dtype == jnp.int32 and model.x.dtype == jnp.float32


def test_inplace_in_lax_bodies(write_module: Loader) -> None:
    plain, dec = _inplace_pair(write_module)
    xs = jnp.arange(6.0).reshape(2, 3)
    check(plain, dec, "Looped()", [("scan", (xs,)), ("fori", (xs[1],)), ("scan", (-xs,))])
    check_transform(plain, dec, "Looped()", [("scan", (X,))], jnp.stack([xs, 2 * xs]), "vmap")
    check_transform(plain, dec, "Looped()", [("fori", (X,))], xs[0], "grad")


def test_inplace_reaches_every_path_of_a_shared_module(write_module: Loader) -> None:
    plain, dec = _inplace_pair(write_module)
    x = jnp.arange(6.0).reshape(2, 3)
    check(plain, dec, "Shared()", [("__call__", (x,)), ("__call__", (x + 1,))])
    model = dec.Shared()
    f, states = model.functionalize()
    assert sorted(states) == ["a.num_batches_tracked", "a.running_mean", "a.running_var"]
    model(x)
    assert model.a is model.b and int(model.b.num_batches_tracked) == 2


INPLACE_REFUSED = {
    "local_alias": """
@autostate.stateful
class Norm:
    def __init__(self):
        self.running_mean = jnp.zeros(2)

    def __call__(self, x):
        m = self.running_mean
        self.running_mean.mul_(0.9)
        return x - m
""",
    "alias_in_loop": """
@autostate.stateful
class Norm:
    def __init__(self):
        self.running_mean = jnp.zeros(2)

    def __call__(self, xs):
        m = self.running_mean[0]
        out = []
        for x in xs:
            out.append(x - m)
            self.running_mean.mul_(0.9)
        return out
""",
    "update_through_alias": """
@autostate.stateful
class Norm:
    def __init__(self):
        self.running_mean = jnp.zeros(2)

    def __call__(self, x):
        m = self.running_mean
        m.mul_(0.9)
        return x
""",
    "attribute_alias": """
@autostate.stateful
class Norm:
    def __init__(self):
        self.running_mean = jnp.zeros(2)
        self.mean_alias = self.running_mean

    def __call__(self, x):
        self.running_mean.mul_(0.9)
        return x - self.mean_alias
""",
}


@pytest.mark.parametrize("case", list(INPLACE_REFUSED))
def test_inplace_alias_that_would_see_the_update_is_refused(write_module: Loader, case: str) -> None:
    with pytest.raises(errors.DecorationError) as info:
        write_module(HEADER + INPLACE_REFUSED[case])
    text = str(info.value)
    assert "Norm" in text and "running_mean" in text and "fix:" in text
    assert re.search(r"autostate_testmod_\d+\.py:\d+", text), text
    line = error_line(info.value)
    wanted = {"local_alias": "self.running_mean.mul_(0.9)", "alias_in_loop": "mul_(0.9)",
              "update_through_alias": "m.mul_(0.9)", "attribute_alias": "self.mean_alias ="}
    assert wanted[case] in line, (line, text)


def test_inplace_alias_not_read_after_the_update_is_accepted(write_module: Loader) -> None:
    module = write_module(HEADER + """
@autostate.stateful
class Norm:
    def __init__(self):
        self.running_mean = jnp.zeros(2)

    def __call__(self, x):
        m = self.running_mean
        y = x - m
        self.running_mean.mul_(0.5).add_(x)
        m = self.running_mean
        return y + m
""")
    model = module.Norm()
    out = model(jnp.ones(2))
    np.testing.assert_allclose(model.running_mean, np.ones(2))
    np.testing.assert_allclose(out, np.ones(2) * 2)


INPLACE_RUNTIME_ERRORS = """
@autostate.stateful
class Bad:
    def __init__(self):
        self.i = jnp.zeros(3, jnp.int32)
        self.x = jnp.zeros(3)

    def local(self, v):
        h = v * 2
        h.mul_(0.5)
        return h

    def to_int(self):
        self.i.mul_(0.5)

    def shape(self):
        self.x.add_(jnp.ones((2, 3)))

    def advanced(self):
        self.x[jnp.array([0, 2])].add_(1.0)

    def arguments(self):
        self.x.add_(1.0, beta=2.0)
"""


@pytest.mark.parametrize(
    ("method", "args", "needle"),
    [("local", (jnp.ones(2),), "h.mul_(0.5)"), ("to_int", (), "self.i.mul_(0.5)"),
     ("shape", (), "self.x.add_("), ("advanced", (), "self.x[jnp.array"),
     ("arguments", (), "self.x.add_(1.0, beta")],
)
def test_inplace_errors_say_what_to_write(write_module: Loader, method: str, args: Any,
                                          needle: str) -> None:
    module = write_module(HEADER + INPLACE_RUNTIME_ERRORS)
    for mode in ("eager", "jit"):
        model = module.Bad()
        before = snapshot(model)
        with pytest.raises(InvalidTypeError) as info:
            if mode == "eager":
                getattr(model, method)(*args)
            else:
                f, states = model.functionalize()
                jax.jit(_fcall(f, method))(states, *args)
        text = str(info.value)
        assert "fix:" in text and " = " in text, text
        assert needle in error_line(info.value), text
        assert_same(before, snapshot(model), f"{mode}: model after the error")


def test_inplace_running_stats_trace_the_functional_steps_primitives(write_module: Loader) -> None:
    plain, dec = _inplace_pair(write_module)
    # The same class decorated, its updates spelled functionally (as a port would write them).
    source = INPLACE.replace("@DECORATE", "@autostate.stateful")
    for inplace, spelled in INPLACE_FUNCTIONAL[:3]:
        source = source.replace(inplace, spelled)
    functional = write_module(HEADER + source)
    x = jnp.ones((4, 3))
    programs = []
    for module in (dec, functional):
        f, states = module.RunningStats(3).functionalize()
        programs.append([e.primitive.name for e in jax.make_jaxpr(f)(states, x).jaxpr.eqns])
    assert programs[0] == programs[1]


# An item assignment changes a list or dict state in place in plain Python: a
# local or another attribute bound to the whole container would see it.
ITEM_ALIAS_REFUSED = {
    "local": ("""
@DECORATE
class C:
    def __init__(self):
        self.lst = [jnp.zeros(()), jnp.zeros(())]

    def __call__(self, x):
        old = self.lst
        self.lst[0] = self.lst[0] + x
        return old[0]
""", "self.lst[0] = self.lst[0] + x"),
    "local_in_loop": ("""
@DECORATE
class C:
    def __init__(self):
        self.d = {"a": jnp.zeros(())}

    def __call__(self, x):
        d, out = self.d, []
        for _ in range(2):
            out.append(d["a"])
            self.d["a"] += x
        return out
""", 'self.d["a"] += x'),
    "nested": ("""
@DECORATE
class C:
    def __init__(self):
        self.rows = [[jnp.zeros(())], [jnp.ones(())]]

    def __call__(self, x):
        row = self.rows[0]
        self.rows[0][0] = self.rows[0][0] + x
        return row[0]
""", "self.rows[0][0] = self.rows[0][0] + x"),
    "view": ("""
@DECORATE
class C:
    def __init__(self):
        self.d = {"a": jnp.zeros(())}

    def __call__(self, x):
        values = self.d.values()
        self.d["a"] = self.d["a"] + x
        return list(values)
""", 'self.d["a"] = self.d["a"] + x'),
    "iterator": ("""
@DECORATE
class C:
    def __init__(self):
        self.lst = [jnp.zeros(()), jnp.ones(())]

    def __call__(self, x):
        it = iter(self.lst)
        self.lst[1] = x
        next(it)
        return next(it)
""", "self.lst[1] = x"),
    "loop": ("""
@DECORATE
class C:
    def __init__(self):
        self.lst = [jnp.zeros(()), jnp.ones(())]

    def __call__(self, x):
        out = []
        for v in self.lst:
            self.lst[-1] = self.lst[-1] + v
            out.append(v)
        return out
""", "self.lst[-1] = self.lst[-1] + v"),
    "delete": ("""
@DECORATE
class C:
    def __init__(self):
        self.d = {"a": jnp.zeros(()), "b": jnp.ones(())}

    def reset(self):
        self.d = {"a": jnp.zeros(()), "b": jnp.ones(())}

    def __call__(self, x):
        old = self.d
        del self.d["a"]
        return len(old)
""", 'del self.d["a"]'),
    "attribute_item": ("""
@DECORATE
class C:
    def __init__(self):
        self.rows = [[jnp.zeros(())]]
        self.first = self.rows[0]

    def __call__(self, x):
        self.rows[0][0] = self.rows[0][0] + x
        return self.first[0]
""", "self.first = self.rows[0]"),
    "attribute": ("""
@DECORATE
class C:
    def __init__(self):
        self.a = [jnp.zeros(())]
        self.b = self.a

    def __call__(self, x):
        self.b[0] = self.b[0] + x
        return self.a[0]
""", "self.b = self.a"),
}


@pytest.mark.parametrize("case", list(ITEM_ALIAS_REFUSED))
def test_an_alias_of_a_container_state_an_item_assignment_changes_is_refused(
    write_module: Loader, case: str
) -> None:
    source, line = ITEM_ALIAS_REFUSED[case]
    with pytest.raises(errors.DecorationError) as info:
        pair(write_module, source)
    assert "fix:" in str(info.value) and "would see" in str(info.value)
    assert line in error_line(info.value), str(info.value)


def test_an_item_taken_before_an_item_assignment_keeps_its_old_value(write_module: Loader) -> None:
    plain, dec = pair(write_module, """
@DECORATE
class C:
    def __init__(self):
        self.lst = [jnp.zeros(()), jnp.ones(())]
        self.first = self.lst[0]
        self.rows = [[jnp.zeros(())], [jnp.ones(())]]

    def __call__(self, x):
        old = self.lst[0]
        whole = self.lst
        y = whole[1]
        self.lst[0] = self.lst[0] + x
        other = self.rows[1]
        frozen = list(self.rows[0])
        self.rows[0][0] = self.rows[0][0] + x
        for i, v in enumerate(self.lst):
            self.lst[i] = v * x
        return old, y, self.first, self.lst[0], other[0], self.rows[0][0], frozen[0]
""")
    check(plain, dec, "C()", [("__call__", (jnp.float32(2.0),)), ("__call__", (jnp.float32(3.0),))])
