"""Misuse of the dict, checkpoint, export and pack entry points: a clear error at the user's line.

Covers ``autostate/state_dicts.py``, ``autostate/serialization.py``,
``autostate/export.py`` and ``autostate/packing.py``: every refusal is an
autostate error of the documented type naming this file's line and a fix;
what is accepted computes what plain Python computes.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autostate
from autostate import errors


@autostate.stateful
class Counter:
    def __init__(self):
        self.count = jnp.zeros(())
        self.w = jnp.ones(2)

    def __call__(self, x):
        self.count += 1
        return x * self.w * self.count

    def scaled(self, x, k):
        self.count += 1
        return x * k


def assert_clear(err: BaseException, exc_type: type[BaseException], *needles: str) -> None:
    assert isinstance(err, exc_type), f"{type(err).__name__}: {err}"
    assert isinstance(err, autostate.AutostateError)
    text = str(err)
    assert f"{__file__}:" in text, f"no user line in: {text}"
    assert "fix:" in text, f"no fix in: {text}"
    for needle in needles:
        assert needle in text, f"{needle!r} not in: {text}"


# --- load_state_dict / load_param_dict --------------------------------------


@pytest.mark.parametrize(
    ("load", "given", "needle"),
    [
        ("load_state_dict", {"count": jnp.ones(3)}, "state shape/dtype mismatches"),
        ("load_state_dict", {"count": jnp.ones(()), "cnt": jnp.ones(())}, "unexpected state"),
        ("load_state_dict", {}, "missing state keys"),
        ("load_param_dict", {"w": jnp.ones(3)}, "parameter shape/dtype mismatches"),
        ("load_param_dict", {"count": jnp.ones(())}, "unexpected parameter"),
        ("load_param_dict", {}, "missing parameter keys"),
    ],
)
def test_strict_load_errors_name_the_user_line(load: str, given: dict, needle: str) -> None:
    with pytest.raises(errors.StateDictError) as info:
        getattr(autostate, load)(Counter(), given)
    assert_clear(info.value, errors.StateDictError, "does not fit Counter", needle)


@pytest.mark.parametrize("load", ["load_state_dict", "load_param_dict"])
@pytest.mark.parametrize(
    ("given", "name"), [(None, "NoneType"), ([jnp.ones(())], "list"), (jnp.ones(()), "ArrayImpl")]
)
def test_load_of_something_not_a_dict(load: str, given: object, name: str) -> None:
    with pytest.raises(errors.InvalidTypeError) as info:
        getattr(autostate, load)(Counter(), given)
    assert_clear(info.value, errors.InvalidTypeError, f"got {name}", f"autostate.{load}")


def test_load_into_a_packed_f_is_refused() -> None:
    f, states = Counter().functionalize()
    pf, _ = autostate.pack(f, states)
    with pytest.raises(errors.InvalidTypeError) as info:
        autostate.load_state_dict(pf, {"count": jnp.ones(())})
    assert_clear(info.value, errors.InvalidTypeError, "got the pf", "autostate.freeze(pf")


def test_load_still_loads() -> None:
    model = autostate.load_state_dict(Counter(), {"count": jnp.full((), 3.0)})
    model = autostate.load_param_dict(model, {"w": jnp.full(2, 2.0)})
    ref = Counter()
    ref.count, ref.w = jnp.full((), 3.0), jnp.full(2, 2.0)
    np.testing.assert_array_equal(model(jnp.ones(2)), ref(jnp.ones(2)))
    np.testing.assert_array_equal(model.count, ref.count)


# --- state_dict(f, states) --------------------------------------------------


@pytest.mark.parametrize("kind", ["list", "tuple", "array", "packed"])
def test_state_dict_of_f_with_states_not_a_dict(kind: str) -> None:
    f, states = Counter().functionalize()
    given = {
        "list": list(states.values()),
        "tuple": tuple(states.values()),
        "array": jnp.zeros(()),
        "packed": autostate.pack(f, states)[1],
    }[kind]
    with pytest.raises(errors.InvalidTypeError) as info:
        autostate.state_dict(f, given)
    assert_clear(info.value, errors.InvalidTypeError, "autostate.state_dict", "states dict")


# --- checkpoints --------------------------------------------------------------


def test_checkpoint_errors_name_the_file_and_the_user_line(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.npz"
    autostate.save(path, Counter())
    with pytest.raises(errors.CheckpointError) as info:
        autostate.load(path, like=_Wider())
    assert_clear(info.value, errors.CheckpointError, str(path), "saved from")
    plain = tmp_path / "plain.npz"
    np.savez(plain, count=np.zeros(()))
    with pytest.raises(errors.CheckpointError) as info:
        autostate.load(plain, like=Counter())
    assert_clear(info.value, errors.CheckpointError, str(plain), "no autostate manifest")
    broken = tmp_path / "broken.npz"
    broken.write_bytes(path.read_bytes()[:100])
    with pytest.raises(errors.CheckpointError) as info:
        autostate.load_arrays(broken)
    assert_clear(info.value, errors.CheckpointError, str(broken), "corrupted")


@autostate.stateful
class _Wider:
    def __init__(self):
        self.count = jnp.zeros(3)
        self.w = jnp.ones(2)

    def __call__(self, x):
        self.count += 1
        return x * self.w


# --- export ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "static_argnums"),
    [((jnp.ones(2),), 1), ((jnp.ones(2),), -2), ((jnp.ones(2), 3.0), (0, 2)), ((), 0)],
)
def test_export_static_argnums_out_of_range(args: tuple, static_argnums: object) -> None:
    with pytest.raises(errors.InvalidArgumentError) as info:
        autostate.export(Counter(), *args, static_argnums=static_argnums)
    assert_clear(info.value, errors.InvalidArgumentError, "static_argnums", "position")


def test_export_static_argnums_not_an_int() -> None:
    with pytest.raises(errors.InvalidTypeError) as info:
        autostate.export(Counter(), jnp.ones(2), static_argnums="0")  # type: ignore[arg-type]
    assert_clear(info.value, errors.InvalidTypeError, "static_argnums", "str")


@pytest.mark.parametrize("static_argnums", [1, -1])
def test_export_negative_static_argnums_counts_from_the_end(static_argnums: int) -> None:
    model = Counter()
    exported = autostate.export(
        model, jnp.ones(2), 3.0, method="scaled", static_argnums=static_argnums
    )
    out, states = exported.call(autostate.state_dict(model), jnp.full(2, 2.0))
    ref = Counter()
    np.testing.assert_array_equal(out, ref.scaled(jnp.full(2, 2.0), 3.0))
    np.testing.assert_array_equal(states["count"], ref.count)


# --- pack -------------------------------------------------------------------------


def test_pack_of_a_model_is_refused() -> None:
    model = Counter()
    _, states = model.functionalize()
    with pytest.raises(errors.InvalidTypeError) as info:
        autostate.pack(model, states)
    assert_clear(info.value, errors.InvalidTypeError, "the model Counter", "functionalize()")


def test_pack_twice_and_pack_of_bad_states_are_refused() -> None:
    f, states = Counter().functionalize()
    pf, pstates = autostate.pack(f, states)
    for bad in (lambda: autostate.pack(pf, pstates), lambda: autostate.pack(f, pstates)):
        with pytest.raises(errors.InvalidTypeError) as info:
            bad()
        assert_clear(info.value, errors.InvalidTypeError, "packed already")
    with pytest.raises(errors.InvalidTypeError) as info:
        autostate.pack(f, list(states.values()))
    assert_clear(info.value, errors.InvalidTypeError, "got list")
    with pytest.raises(errors.InvalidTypeError) as info:
        autostate.pack([f], states)
    assert_clear(info.value, errors.InvalidTypeError, "got list")


def test_param_dict_and_state_dict_of_a_packed_f() -> None:
    f, states = Counter().functionalize()
    _, states = f(states, jnp.ones(2))
    pf, pstates = autostate.pack(f, states)
    got = autostate.param_dict(pf)
    want = autostate.param_dict(f)
    assert sorted(got) == sorted(want) == ["w"]
    for key in want:
        np.testing.assert_array_equal(got[key], want[key])
    got_states = autostate.state_dict(pf, pstates)
    assert sorted(got_states) == ["count"]
    np.testing.assert_array_equal(got_states["count"], 1.0)
    # inside a jitted step, as for f
    jitted = jax.jit(autostate.state_dict)(pf, pstates)
    np.testing.assert_array_equal(jitted["count"], 1.0)


def test_state_dict_of_a_packed_f_with_wrong_states() -> None:
    f, states = Counter().functionalize()
    pf, _ = autostate.pack(f, states)
    with pytest.raises(errors.InvalidTypeError) as info:
        autostate.state_dict(pf)
    assert_clear(info.value, errors.InvalidTypeError, "state_dict(pf, pstates)")
    with pytest.raises(errors.InvalidTypeError) as info:
        autostate.state_dict(pf, states)
    assert_clear(info.value, errors.InvalidTypeError, "PackedStates")
