"""Differential bug hunt 16: bad input and misuse of the public API.

Every mistake a user makes with the public names must give a clear autostate
error (an ``AutostateError`` subclass naming the user's file:line and a fix),
never an internal traceback, a raw JAX error autostate could have caught, or a
silently wrong result. Where the "mistake" is none (plain Python would run it),
the decorated run is compared with plain Python instead.

- ``functionalize()`` arguments: ``category`` and ``category_predicate``
  together, a predicate that is not callable, an unhashable category, unknown
  ``state_sharing`` modes; ``autostate.functionalize`` given ``None``, a class
  instead of an instance, or an ``f``.
- Calling ``f``: states that are ``None``, the model, a list, the lazy thunk
  (on models with and without integer constants); missing, extra and foreign
  keys (a parent's, a sub-model's); values of the wrong shape, a Python list,
  ``None``, a numpy array, another dtype (compared with plain Python holding
  the same value); stale states of an earlier ``functionalize`` and of another
  instance; ``f.<name>`` for a missing method, a property, a parameter, a
  staticmethod and a classmethod.
- ``autostate.freeze``: a model instead of ``f``, ``None`` / a list / packed
  states / a parent's states / ``{}``, freezing twice.
- ``autostate.pack``: packed and unpacked states swapped, a model packed in
  place of ``f``, ``param_dict`` of a packed ``f``.
- ``autostate.state`` / ``constant`` outside ``self.x = ...`` in ``__init__``
  (in a method, as a local, inside a list, nested), duplicate explicit names
  across sub-models, an explicit name equal to a constant's path.
- ``@stateful`` on a function, an instance, an unknown ``fallback``, ``dict``
  and ``float`` subclasses, an ``Enum`` (with and without state), a
  ``NamedTuple``, a class with a metaclass, a class whose ``__init__`` raises,
  decorated twice with different options.
- ``state_dict`` / ``load_state_dict`` / ``load_param_dict``: wrong keys and
  shapes, ``None`` and a list as the dict, ``f`` without its states, a list as
  the states.
- Checkpoints and export: ``save`` of a class or of ``f``, ``load`` of a plain
  ``.npz`` or with ``like=f``; ``export`` with an unknown method, a string
  argument, ``static_argnums`` out of range.
- Host fallback: ``inference_mode`` of a functional model, calling the view,
  a non-array host state.

Each source is written plain and decorated (``differential.pair``); the plain
run is the reference. A case that shows autostate misbehaving stays, marked
``xfail(strict=True)`` with what differs.
"""

from __future__ import annotations

import enum
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from differential import (  # noqa: I001 - tests/ is on sys.path
    assert_same,
    assert_user_line,
    check,
    pair,
    raises_autostate,
    snapshot,
)

import autostate
from autostate import errors

Loader = Callable[..., types.ModuleType]
HERE = __file__


def assert_clear(
    err: BaseException, exc_type: type[BaseException], filename: str, *needles: str
) -> None:
    """An autostate error of ``exc_type`` naming ``filename:line``, with a fix and ``needles``."""
    assert isinstance(err, exc_type), f"{type(err).__name__}: {err}"
    assert isinstance(err, autostate.AutostateError), f"{type(err).__name__}: {err}"
    assert_user_line(err, filename)
    text = str(err)
    assert "fix:" in text, f"no fix in: {text}"
    for needle in needles:
        assert needle in text, f"{needle!r} not in: {text}"


def plain_error(fn: Callable[[], Any]) -> tuple[type[BaseException], str]:
    """The exception plain Python raises for ``fn()``: its type and message."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the reference error, whatever it is
        return type(exc), str(exc)
    raise AssertionError("plain Python did not raise")


def written_file(tmp_path: Path) -> str:
    """The module ``write_module`` wrote last (the decorated one of a pair that failed)."""
    return str(max(tmp_path.glob("*.py"), key=lambda p: p.stat().st_mtime_ns))


MODELS = """
@DECORATE
class Counter:
    def __init__(self):
        self.count = jnp.zeros(())
        self.w = jnp.ones(2)

    def __call__(self, x):
        self.count += 1
        return x * self.w * self.count

    def reset(self):
        self.count = jnp.zeros(())

    @property
    def doubled(self):
        return self.count * 2

    @staticmethod
    def helper(x):
        return x + 1

    @classmethod
    def make(cls):
        return cls()


@DECORATE
class WithPos:
    def __init__(self):
        self.count = jnp.zeros(())
        self.pos = jnp.arange(3)  # an int array: a constant, in the states dict

    def __call__(self, x):
        self.count += 1
        return x + self.pos.sum() + self.count


@DECORATE
class Parent:
    def __init__(self):
        self.c = Counter()
        self.n = jnp.zeros(())

    def __call__(self, x):
        self.n += 1
        return self.c(x)
"""


@pytest.fixture
def mods(write_module: Loader) -> tuple[types.ModuleType, types.ModuleType]:
    return pair(write_module, MODELS)


# ======================================================================================
# 1. functionalize() arguments
# ======================================================================================


def test_category_and_predicate_together(mods: Any) -> None:
    _, dec = mods
    with raises_autostate(errors.CategoryArgumentError) as info:
        dec.Counter().functionalize("state", category_predicate=lambda c: True)
    assert_clear(info.value, errors.CategoryArgumentError, HERE, "category_predicate")
    with raises_autostate(errors.CategoryArgumentError) as info:
        autostate.functionalize(dec.Counter(), "state", category_predicate=lambda c: True)
    assert_clear(info.value, errors.CategoryArgumentError, HERE)


@pytest.mark.parametrize("mode", ["shared", None, True, "Allowed"])
def test_unknown_state_sharing(mods: Any, mode: Any) -> None:
    _, dec = mods
    with raises_autostate(errors.InvalidArgumentError) as info:
        dec.Counter().functionalize(state_sharing=mode)
    assert_clear(
        info.value, errors.InvalidArgumentError, HERE, "'forbidden', 'allowed' or 'unsafe'"
    )


def test_category_predicate_not_callable(mods: Any) -> None:
    _, dec = mods
    with raises_autostate(errors.InvalidTypeError) as info:
        dec.Counter().functionalize(category_predicate="state")
    assert_clear(info.value, errors.InvalidTypeError, HERE, "category_predicate")


def test_unhashable_category(mods: Any) -> None:
    _, dec = mods
    with raises_autostate(errors.InvalidTypeError) as info:
        dec.Counter().functionalize(["state"])
    assert_clear(info.value, errors.InvalidTypeError, HERE, "category")


@pytest.mark.parametrize("api", ["functionalize", "state_dict", "param_dict", "save"])
def test_none_as_model(api: str, tmp_path: Path) -> None:
    calls: dict[str, Callable[[], Any]] = {
        "functionalize": lambda: autostate.functionalize(None)[0]({}),
        "state_dict": lambda: autostate.state_dict(None),
        "param_dict": lambda: autostate.param_dict(None),
        "save": lambda: autostate.save(tmp_path / "none.npz", None),
    }
    with raises_autostate(errors.InvalidTypeError) as info:
        calls[api]()
    assert_clear(info.value, errors.InvalidTypeError, HERE)


@pytest.mark.parametrize("api", ["functionalize", "state_dict", "save", "export"])
def test_class_instead_of_instance(mods: Any, api: str, tmp_path: Path) -> None:
    _, dec = mods
    calls: dict[str, Callable[[], Any]] = {
        "functionalize": lambda: autostate.functionalize(dec.Counter),
        "state_dict": lambda: autostate.state_dict(dec.Counter),
        "save": lambda: autostate.save(tmp_path / "cls.npz", dec.Counter),
        "export": lambda: autostate.export(dec.Counter, jnp.ones(())),
    }
    with raises_autostate(errors.InvalidTypeError) as info:
        calls[api]()
    assert_clear(info.value, errors.InvalidTypeError, HERE, "Counter")


def test_functionalize_of_f(mods: Any) -> None:
    _, dec = mods
    f, _ = dec.Counter().functionalize()
    with raises_autostate(errors.InvalidTypeError) as info:
        autostate.functionalize(f)
    assert_clear(info.value, errors.InvalidTypeError, HERE, "functionalize")


# ======================================================================================
# 2. Calling f with bad states
# ======================================================================================


def _bad_states(kind: str, model: Any, lazy_states: Any) -> Any:
    return {
        "None": None,
        "model": model,
        "list": [jnp.zeros(())],
        "thunk": lazy_states,
    }[kind]


@pytest.mark.parametrize("kind", ["None", "model", "list", "thunk"])
def test_f_states_not_a_dict(mods: Any, kind: str) -> None:
    _, dec = mods
    model = dec.Counter()
    f, thunk = model.functionalize(lazy=True)
    with raises_autostate(errors.InvalidTypeError) as info:
        f(_bad_states(kind, model, thunk), 1.0)
    assert_clear(info.value, errors.InvalidTypeError, HERE, "States must be a dict")


@pytest.mark.parametrize("kind", ["None", "model", "list", "thunk"])
def test_f_states_not_a_dict_with_constants(mods: Any, kind: str) -> None:
    _, dec = mods
    model = dec.WithPos()
    f, thunk = model.functionalize(lazy=True)
    with raises_autostate(errors.InvalidTypeError) as info:
        f(_bad_states(kind, model, thunk), 1.0)
    assert_clear(info.value, errors.InvalidTypeError, HERE, "States must be a dict")


def test_f_missing_state_key(mods: Any) -> None:
    _, dec = mods
    f, _ = dec.Counter().functionalize()
    with raises_autostate(errors.UnhandledLocalStateError) as info:
        f({}, 1.0)
    # Raised where the state is read: the model's line in the user's file.
    assert_clear(info.value, errors.UnhandledLocalStateError, dec.__file__, "'count' is missing")
    with raises_autostate(errors.UnhandledLocalStateError) as info:
        jax.jit(lambda f, s: f(s, 1.0))(f, {})
    assert_clear(info.value, errors.UnhandledLocalStateError, dec.__file__, "'count' is missing")


def test_f_missing_constant_key(mods: Any) -> None:
    _, dec = mods
    f, states = dec.WithPos().functionalize()
    with raises_autostate(errors.UnhandledLocalStateError) as info:
        f({"count": states["count"]}, 1.0)
    assert_clear(info.value, errors.UnhandledLocalStateError, HERE, "'pos'")


def test_f_extra_key(mods: Any) -> None:
    _, dec = mods
    f, states = dec.Counter().functionalize()
    with raises_autostate(errors.StateDictError) as info:
        f({**states, "cuont": jnp.zeros(())}, 1.0)
    assert_clear(info.value, errors.StateDictError, HERE, "'cuont'", "did you mean 'count'")


def test_f_states_of_parent_and_of_sub_model(mods: Any) -> None:
    _, dec = mods
    f, states = dec.Counter().functionalize()
    fp, parent_states = dec.Parent().functionalize()
    with raises_autostate(errors.StateDictError) as info:
        f(parent_states, 1.0)
    assert_clear(info.value, errors.StateDictError, HERE, "'c.count'")
    with raises_autostate(errors.StateDictError) as info:
        fp(states, 1.0)
    assert_clear(info.value, errors.StateDictError, HERE, "did you mean 'c.count'")


@pytest.mark.parametrize("value", ["shape", "list", "None", "str"])
def test_f_state_value_of_wrong_kind_fails_as_plain_python(mods: Any, value: str) -> None:
    """A wrong value in the states dict is what plain Python holding it does."""
    plain, dec = mods
    bad = {"shape": jnp.zeros(3), "list": [0.0], "None": None, "str": "a"}

    def run_plain() -> None:
        m = plain.Counter()
        m.count = bad[value]
        m(1.0)

    expected = plain_error(run_plain)
    f, _ = dec.Counter().functionalize()
    with pytest.raises(expected[0]) as info:
        f({"count": bad[value]}, 1.0)
    assert str(info.value) == expected[1]


@pytest.mark.parametrize("value", ["numpy", "int32", "float16"])
def test_f_state_value_of_other_array_kind_as_plain_python(mods: Any, value: str) -> None:
    """A numpy array (converted to jax, as documented) or another dtype means what plain does."""
    plain, dec = mods

    def given() -> Any:
        return {
            "numpy": np.full((), 2.0),
            "int32": jnp.full((), 2, jnp.int32),
            "float16": jnp.full((), 2, jnp.float16),
        }[value]

    ref = plain.Counter()
    ref.count = jnp.asarray(given())
    expected = (ref(3.0), ref.count)
    f, _ = dec.Counter().functionalize()
    out, states = f({"count": given()}, 3.0)
    assert_same(snapshot(expected), snapshot((out, states["count"])))
    assert states["count"].dtype == expected[1].dtype
    out, states = jax.jit(lambda f, s: f(s, 3.0))(f, {"count": given()})
    assert_same(snapshot(expected), snapshot((out, states["count"])))


def test_f_does_not_mutate_a_numpy_state_it_is_given(mods: Any) -> None:
    plain, dec = mods
    arr = np.full((), 2.0)
    model = dec.Counter()
    model.count = arr
    model(3.0)
    assert float(arr) == 2.0  # eagerly: converted on assignment, the caller's array untouched
    f, _ = dec.Counter().functionalize()
    given = np.full((), 2.0)
    states = {"count": given}
    out1, _ = f(states, 3.0)
    out2, _ = f(states, 3.0)  # the same states again: the same result (f is pure)
    ref = plain.Counter()
    ref.count = jnp.asarray(np.full((), 2.0))
    expected = ref(3.0)
    assert_same(snapshot(expected), snapshot(out1))
    assert_same(snapshot(expected), snapshot(out2))
    assert float(given) == 2.0


def test_stale_states_and_states_of_another_instance(mods: Any) -> None:
    """States are values: an earlier call's, or another instance's, run as plain Python would."""
    plain, dec = mods
    model = dec.Counter()
    f0, s0 = model.functionalize()
    _, s1 = f0(s0, 1.0)
    model(1.0)
    model(1.0)
    f2, _ = model.functionalize()  # a later f of the same (changed) model
    out, s = f2(s1, 2.0)  # the states of the first call
    ref = plain.Counter()
    ref(1.0)
    expected = ref(2.0)
    assert_same(snapshot(expected), snapshot(out))
    assert_same(snapshot(ref.count), snapshot(s["count"]))
    other = dec.Counter()
    out, s = f2(other.functionalize()[1], 2.0)
    assert_same(snapshot(plain.Counter()(2.0)), snapshot(out))
    assert float(model.count) == 2.0  # the eager model is untouched by f


@pytest.mark.parametrize("name", ["nonexistent", "doubled", "w", "count"])
def test_f_method_that_is_not_a_method(mods: Any, name: str) -> None:
    _, dec = mods
    f, states = dec.Counter().functionalize()
    with raises_autostate(errors.MethodNotFoundError) as info:
        getattr(f, name)(states)
    assert_clear(info.value, errors.MethodNotFoundError, HERE, repr(name))


def test_f_staticmethod_and_classmethod_as_plain_python(mods: Any) -> None:
    plain, dec = mods
    f, states = dec.Counter().functionalize()
    out, new = f.helper(states, 1.0)
    assert out == plain.Counter().helper(1.0)
    assert_same(snapshot(states), snapshot(new))
    made, _ = f.make(states)
    assert type(made) is dec.Counter
    assert_same(snapshot(plain.Counter.make()), snapshot(made))


# ======================================================================================
# 3. freeze
# ======================================================================================


def test_freeze_of_a_model(mods: Any) -> None:
    _, dec = mods
    model = dec.Counter()
    _, states = model.functionalize()
    with raises_autostate(errors.InvalidTypeError) as info:
        autostate.freeze(model, states)
    assert_clear(info.value, errors.InvalidTypeError, HERE, "freeze expects the f")
    with raises_autostate(errors.InvalidTypeError) as info:
        autostate.freeze(states, model.functionalize()[0])  # arguments swapped
    assert_clear(info.value, errors.InvalidTypeError, HERE, "got dict")


def test_freeze_with_wrong_keys(mods: Any) -> None:
    _, dec = mods
    f, _ = dec.Counter().functionalize()
    _, parent_states = dec.Parent().functionalize()
    with raises_autostate(errors.StateDictError) as info:
        autostate.freeze(f, parent_states)
    assert_clear(info.value, errors.StateDictError, HERE, "autostate.freeze", "'c.count'")
    with raises_autostate(errors.UnhandledLocalStateError) as info:
        autostate.freeze(f, {})
    assert_clear(info.value, errors.UnhandledLocalStateError, HERE, "Cannot freeze")


@pytest.mark.parametrize("kind", ["None", "values", "packed"])
def test_freeze_states_not_a_dict(mods: Any, kind: str) -> None:
    _, dec = mods
    f, states = dec.Counter().functionalize()
    bad = {
        "None": None,
        "values": list(states.values()),
        "packed": autostate.pack(f, states)[1],
    }[kind]
    with raises_autostate(errors.InvalidTypeError) as info:
        autostate.freeze(f, bad)
    assert_clear(info.value, errors.InvalidTypeError, HERE)


def test_freeze_twice_gives_independent_models(mods: Any) -> None:
    plain, dec = mods
    f, states = dec.Counter().functionalize()
    _, states = f(states, 1.0)
    a, b = autostate.freeze(f, states), autostate.freeze(f, states)
    a(1.0)
    ref_a, ref_b = plain.Counter(), plain.Counter()
    ref_a(1.0), ref_b(1.0)
    ref_a(1.0)
    assert_same(snapshot(ref_a), snapshot(a))
    assert_same(snapshot(ref_b), snapshot(b))
    assert_same(snapshot(ref_b.count), snapshot(states["count"]))


# ======================================================================================
# 4. pack
# ======================================================================================


def test_packed_and_unpacked_states_swapped(mods: Any) -> None:
    _, dec = mods
    f, states = dec.Counter().functionalize()
    pf, pstates = autostate.pack(f, states)
    with raises_autostate(errors.InvalidTypeError) as info:
        pf(states, 1.0)
    assert_clear(info.value, errors.InvalidTypeError, HERE, "PackedStates")
    with raises_autostate(errors.InvalidTypeError) as info:
        f(pstates, 1.0)
    assert_clear(info.value, errors.InvalidTypeError, HERE, "States must be a dict")
    with raises_autostate(errors.InvalidTypeError) as info:
        autostate.freeze(pf, states)
    assert_clear(info.value, errors.InvalidTypeError, HERE, "PackedStates")
    with raises_autostate(errors.MethodNotFoundError) as info:
        pf.nonexistent(pstates)
    assert_clear(info.value, errors.MethodNotFoundError, HERE, "'nonexistent'")


def test_pack_of_a_model_instead_of_f(mods: Any) -> None:
    _, dec = mods
    model = dec.Counter()
    _, states = model.functionalize()
    with raises_autostate(errors.InvalidTypeError) as info:
        pf, pstates = autostate.pack(model, states)
        pf(pstates, 1.0)
    assert_clear(info.value, errors.InvalidTypeError, HERE)


def test_param_dict_of_packed_f(mods: Any) -> None:
    _, dec = mods
    f, states = dec.Counter().functionalize()
    pf, _ = autostate.pack(f, states)
    try:
        got = autostate.param_dict(pf)
    except errors.InvalidTypeError as err:
        assert_clear(err, errors.InvalidTypeError, HERE, "pack")
        return
    assert sorted(got) == sorted(autostate.param_dict(f))


# ======================================================================================
# 5. autostate.state / constant misused
# ======================================================================================

STATE_MISUSE = """
@DECORATE
class InMethod:
    def __init__(self):
        self.x = jnp.zeros(())

    def step(self):
        self.x = STATE(self.x + 1)
        return self.x


@DECORATE
class AsLocal:
    def __init__(self):
        self.x = jnp.zeros(())

    def step(self):
        y = STATE(jnp.ones(()))
        self.x = self.x + y
        return self.x


@DECORATE
class InList:
    def __init__(self):
        self.xs = [STATE(jnp.zeros(()))]

    def step(self):
        return self.xs[0] + 1


@DECORATE
class Nested:
    def __init__(self):
        self.x = STATE(STATE(jnp.zeros(())))

    def step(self):
        self.x = self.x + 1
        return self.x
"""


def test_state_marker_assigned_in_a_method(write_module: Loader) -> None:
    plain, dec = pair(write_module, STATE_MISUSE)
    ref = plain.InMethod()
    expected = ref.step()
    try:
        model = dec.InMethod()
        got = model.step()
    except autostate.AutostateError as err:  # a clear refusal is fine too
        assert_clear(err, autostate.AutostateError, dec.__file__, "autostate.state")
        return
    assert isinstance(model.x, jax.Array), f"model.x is {model.x!r}"
    assert_same(snapshot(expected), snapshot(got))
    f, states = dec.InMethod().functionalize()
    _, states = f.step(states)
    assert isinstance(states["x"], jax.Array), f"states['x'] is {states['x']!r}"


@pytest.mark.parametrize(
    "cls",
    ["AsLocal", "InList", "Nested"],
)
def test_state_marker_outside_init_assignment(write_module: Loader, cls: str) -> None:
    plain, dec = pair(write_module, STATE_MISUSE)
    try:
        check(plain, dec, f"{cls}()", [("step", ())], modes=("eager",))
    except autostate.AutostateError as err:  # a clear refusal is fine too
        assert_clear(err, autostate.AutostateError, dec.__file__, "autostate.state")


DUPLICATE_NAMES = """
@DECORATE
class Cache:
    def __init__(self):
        self.kv = STATE(jnp.zeros(2), name="kv")

    def __call__(self, x):
        self.kv = self.kv + x
        return self.kv


@DECORATE
class TwoCaches:
    def __init__(self):
        self.a = Cache()
        self.b = Cache()

    def __call__(self, x):
        return self.a(x) + self.b(x)


@DECORATE
class NamedLikeConstant:
    def __init__(self):
        self.a = STATE(jnp.zeros(()), name="b")
        self.b = jnp.zeros((), jnp.int32)

    def __call__(self):
        self.a = self.a + 1
"""


def test_duplicate_explicit_names_across_sub_models(write_module: Loader) -> None:
    plain, dec = pair(write_module, DUPLICATE_NAMES)
    model = dec.TwoCaches()
    # Eagerly it is plain Python: two separate caches.
    ref = plain.TwoCaches()
    assert_same(snapshot(ref(jnp.ones(2))), snapshot(model(jnp.ones(2))))
    for call in (
        model.functionalize,
        lambda: autostate.state_dict(model),
        lambda: autostate.param_dict(model),
    ):
        with raises_autostate(errors.StateSharingError) as info:
            call()
        assert_clear(info.value, errors.StateSharingError, HERE, "'kv'", "a.kv", "b.kv")


def test_explicit_name_equal_to_a_constant_path(write_module: Loader) -> None:
    _, dec = pair(write_module, DUPLICATE_NAMES)
    with raises_autostate(errors.StateSharingError) as info:
        dec.NamedLikeConstant().functionalize()
    assert_clear(info.value, errors.StateSharingError, HERE, "'b'")


# ======================================================================================
# 6. @stateful misused, and classes of unusual kinds
# ======================================================================================


def test_stateful_on_a_function_and_on_an_instance(write_module: Loader) -> None:
    mod = write_module(
        """
import autostate


def decorate_function():
    @autostate.stateful
    def g(x):
        return x


class Plain:
    pass


def decorate_instance():
    return autostate.stateful(Plain())
"""
    )
    with raises_autostate(errors.InvalidTypeError) as info:
        mod.decorate_function()
    assert_clear(info.value, errors.InvalidTypeError, mod.__file__, "got function")
    with raises_autostate(errors.InvalidTypeError) as info:
        mod.decorate_instance()
    assert_clear(info.value, errors.InvalidTypeError, mod.__file__, "got Plain")


@pytest.mark.parametrize("fallback", ["gpu", True, "HOST"])
def test_stateful_unknown_fallback(fallback: Any) -> None:
    with raises_autostate(errors.InvalidArgumentError) as info:
        autostate.stateful(fallback=fallback)
    assert_clear(info.value, errors.InvalidArgumentError, HERE, "fallback")


BUILTIN_SUBCLASSES = """
@DECORATE
class Registry(dict):
    def __init__(self):
        super().__init__()
        self.x = jnp.zeros(())

    def step(self):
        self.x = self.x + 1
        self["last"] = self.x
        return len(self)


@DECORATE
class Scale(float):
    def __init__(self, v):
        self.x = jnp.zeros(())

    def step(self):
        self.x = self.x + self
        return self.x
"""


def test_stateful_dict_subclass(write_module: Loader, tmp_path: Path) -> None:
    """Decided: a builtin's subclass (dict, float, tuple, an exception) is refused at
    its class statement: a model is rebuilt from its __dict__, their data is elsewhere."""
    with raises_autostate(errors.DecorationError) as info:
        pair(write_module, BUILTIN_SUBCLASSES)
    assert_clear(info.value, errors.DecorationError, written_file(tmp_path), "Registry", "dict")


def test_stateful_float_subclass(write_module: Loader, tmp_path: Path) -> None:
    source = BUILTIN_SUBCLASSES[BUILTIN_SUBCLASSES.index("@DECORATE\nclass Scale") :]
    with raises_autostate(errors.DecorationError) as info:
        pair(write_module, source)
    assert_clear(info.value, errors.DecorationError, written_file(tmp_path), "Scale", "float")


ENUMS = """
import enum


@DECORATE
class Mode(enum.Enum):
    TRAIN = 1
    EVAL = 2

    def scale(self, x):
        return x * self.value
"""


def test_stateful_enum_without_state_is_plain(write_module: Loader) -> None:
    plain, dec = pair(write_module, ENUMS)
    assert dec.Mode.EVAL.scale(3.0) == plain.Mode.EVAL.scale(3.0)
    assert dec.Mode(1) is dec.Mode.TRAIN
    assert [m.name for m in dec.Mode] == [m.name for m in plain.Mode]
    assert isinstance(dec.Mode.TRAIN, enum.Enum)


def test_stateful_enum_with_state_write(write_module: Loader, tmp_path: Path) -> None:
    source = ENUMS.replace(
        "        return x * self.value\n",
        "        return x * self.value\n\n    def bump(self):\n        self.count = 1\n",
    )
    with raises_autostate(errors.DecorationError) as info:
        pair(write_module, source)
    assert_clear(info.value, errors.DecorationError, written_file(tmp_path), "'count'")
    assert "(in Mode.bump)" in str(info.value)


def test_stateful_namedtuple(write_module: Loader, tmp_path: Path) -> None:
    source = """
import typing


@DECORATE
class Point(typing.NamedTuple):
    a: float
    b: float = 1.0

    def total(self):
        return self.a + self.b
"""
    with raises_autostate(errors.DecorationError) as info:
        pair(write_module, source)
    assert_clear(info.value, errors.DecorationError, written_file(tmp_path), "tuple", "Point")


METACLASS = """
class Meta(type):
    made = []

    def __call__(cls, *args, **kwargs):
        inst = super().__call__(*args, **kwargs)
        Meta.made.append(cls.__name__)
        return inst


@DECORATE
class WithMeta(metaclass=Meta):
    def __init__(self, k):
        self.x = jnp.zeros(()) + k
        self.tag = "meta"

    def step(self, v):
        self.x = self.x + v
        return self.x * 2
"""


def test_stateful_with_a_metaclass(write_module: Loader) -> None:
    plain, dec = pair(write_module, METACLASS)
    check(plain, dec, "WithMeta(1.0)", [("step", (2.0,)), ("step", (3.0,))])
    assert type(dec.WithMeta) is dec.Meta
    assert "WithMeta" in dec.Meta.made


INIT_RAISES = """
@DECORATE
class Picky:
    def __init__(self, n):
        self.x = jnp.zeros(())
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        self.n = n

    def step(self):
        self.x = self.x + self.n
        return self.x
"""


def test_init_raises_as_plain_python(write_module: Loader) -> None:
    plain, dec = pair(write_module, INIT_RAISES)
    expected = plain_error(lambda: plain.Picky(-1))
    with pytest.raises(expected[0]) as info:
        dec.Picky(-1)
    assert str(info.value) == expected[1]
    # The class is unharmed: the next instance works as plain Python's.
    check(plain, dec, "Picky(2)", [("step", ()), ("step", ())])


def test_decorated_twice_with_different_options(write_module: Loader) -> None:
    mod = write_module(
        """
import jax.numpy as jnp
import autostate


@autostate.stateful(category="outer")
@autostate.stateful(category="inner")
class Twice:
    def __init__(self):
        self.x = jnp.zeros(())

    def step(self):
        self.x = self.x + 1
        return self.x
"""
    )
    model = mod.Twice()
    assert float(model.step()) == 1.0
    assert sorted(model.functionalize("outer")[1]) == ["x"]  # the last decoration's options
    assert model.functionalize("inner")[1] == {}
    f, states = model.functionalize()
    out, states = jax.jit(lambda f, s: f.step(s))(f, states)
    assert float(out) == 2.0 and float(states["x"]) == 2.0


# ======================================================================================
# 7. state_dict / param_dict and loading
# ======================================================================================


@pytest.mark.parametrize(
    "load", ["state_shape", "state_unexpected", "param_shape", "param_is_state"]
)
def test_load_dict_errors_name_the_user_line(mods: Any, load: str) -> None:
    _, dec = mods
    model = dec.Counter()
    calls: dict[str, Callable[[], Any]] = {
        "state_shape": lambda: autostate.load_state_dict(model, {"count": jnp.ones(3)}),
        "state_unexpected": lambda: autostate.load_state_dict(
            model, {"count": jnp.ones(()), "cnt": jnp.ones(())}
        ),
        "param_shape": lambda: autostate.load_param_dict(model, {"w": jnp.ones(3)}),
        "param_is_state": lambda: autostate.load_param_dict(model, {"count": jnp.ones(())}),
    }
    with raises_autostate(errors.StateDictError) as info:
        calls[load]()
    assert "does not fit Counter" in str(info.value)
    assert_clear(info.value, errors.StateDictError, HERE)


def test_load_state_dict_not_a_dict(mods: Any) -> None:
    _, dec = mods
    with raises_autostate(errors.InvalidTypeError) as info:
        autostate.load_state_dict(dec.Counter(), [jnp.ones(())])
    assert_clear(info.value, errors.InvalidTypeError, HERE, "got list")
    f, _ = dec.Counter().functionalize()
    with raises_autostate(errors.InvalidTypeError) as info:
        autostate.load_state_dict(f, {"count": jnp.ones(())})
    assert_clear(info.value, errors.InvalidTypeError, HERE, "got the f")


@pytest.mark.parametrize("load", ["load_state_dict", "load_param_dict"])
def test_load_dict_none(mods: Any, load: str) -> None:
    _, dec = mods
    with raises_autostate(errors.InvalidTypeError) as info:
        getattr(autostate, load)(dec.Counter(), None)
    assert_clear(info.value, errors.InvalidTypeError, HERE, "NoneType")


def test_state_dict_of_f_without_states(mods: Any) -> None:
    _, dec = mods
    f, _ = dec.Counter().functionalize()
    with raises_autostate(errors.InvalidTypeError) as info:
        autostate.state_dict(f)
    assert_clear(info.value, errors.InvalidTypeError, HERE, "state_dict(f, states)")
    with raises_autostate(errors.InvalidTypeError) as info:
        autostate.state_dict(dec.Counter(), {"count": jnp.zeros(())})
    assert_clear(info.value, errors.InvalidTypeError, HERE, "only with an f")


def test_state_dict_of_f_with_a_list(mods: Any) -> None:
    _, dec = mods
    f, states = dec.Counter().functionalize()
    with raises_autostate(errors.InvalidTypeError) as info:
        autostate.state_dict(f, list(states.values()))
    assert_clear(info.value, errors.InvalidTypeError, HERE)


# ======================================================================================
# 8. Checkpoints and export
# ======================================================================================


def test_save_f_and_load_like_f(mods: Any, tmp_path: Path) -> None:
    _, dec = mods
    f, _ = dec.Counter().functionalize()
    with raises_autostate(errors.InvalidTypeError) as info:
        autostate.save(tmp_path / "f.npz", f)
    assert_clear(info.value, errors.InvalidTypeError, HERE, "autostate.save expects a model")
    autostate.save(tmp_path / "m.npz", dec.Counter())
    with raises_autostate(errors.InvalidTypeError) as info:
        autostate.load(tmp_path / "m.npz", like=f)
    assert_clear(info.value, errors.InvalidTypeError, HERE, "autostate.load expects a model")


def test_load_a_plain_npz(mods: Any, tmp_path: Path) -> None:
    _, dec = mods
    path = tmp_path / "plain.npz"
    np.savez(path, count=np.zeros(()))
    for load in (
        lambda: autostate.load(path, like=dec.Counter()),
        lambda: autostate.load_arrays(path),
    ):
        with raises_autostate(errors.CheckpointError) as info:
            load()
        text = str(info.value)
        assert "no autostate manifest" in text and "fix:" in text
        assert str(path) in text  # a checkpoint error names the file (documented)


def test_export_unknown_method_and_bad_argument(mods: Any) -> None:
    _, dec = mods
    with raises_autostate(errors.MethodNotFoundError) as info:
        autostate.export(dec.Counter(), jnp.ones(()), method="forward")
    assert_clear(info.value, errors.MethodNotFoundError, HERE, "'forward'")
    with raises_autostate(errors.InvalidTypeError) as info:
        autostate.export(dec.Counter(), "x")
    assert_clear(info.value, errors.InvalidTypeError, HERE, "got a str")


def test_export_static_argnums_out_of_range(mods: Any) -> None:
    _, dec = mods
    with raises_autostate(errors.InvalidArgumentError) as info:
        autostate.export(dec.Counter(), jnp.ones(2), static_argnums=1)
    assert_clear(info.value, errors.InvalidArgumentError, HERE, "static_argnums")


# ======================================================================================
# 9. Host fallback misuse
# ======================================================================================

HOST = """
@DECORATE_HOST
class Tally:
    def __init__(self):
        self.n = jnp.zeros(())

    def __call__(self, x):
        self.n += x
        return self.n

    def rename(self):
        self.n = "abc"
"""


def test_inference_mode_of_a_functional_model(mods: Any) -> None:
    _, dec = mods
    for model in (dec.Counter(), dec.Counter().functionalize()[0]):
        with raises_autostate(errors.HostStateTypeError) as info:
            autostate.inference_mode(model)
        assert_clear(info.value, errors.HostStateTypeError, HERE, 'fallback="host"')


def test_inference_view_called_and_non_array_host_state(write_module: Loader) -> None:
    plain, dec = pair(write_module, HOST)
    model = dec.Tally()
    model(1.0)
    view = autostate.inference_mode(model)
    with raises_autostate(errors.HostStateError) as info:
        view(1.0)
    assert_clear(info.value, errors.HostStateError, dec.__file__, "inference mode")
    with raises_autostate(errors.HostStateError) as info:
        view.n = jnp.ones(())
    assert_clear(info.value, errors.HostStateError, HERE, "inference mode")
    assert float(model.n) == 1.0  # the original model is unchanged
    with raises_autostate(errors.HostStateTypeError) as info:
        model.rename()
    assert_clear(info.value, errors.HostStateTypeError, dec.__file__, "str")
    ref = plain.Tally()
    ref(1.0)
    assert_same(snapshot(ref(2.0)), snapshot(model(2.0)))
