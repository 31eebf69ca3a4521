"""Assertions shared by the model tests: tree comparison and state paths."""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tolerance import tolerance

# Eager (op by op) and jitted (fused) float32 results may differ in the last bits;
# on an accelerator, the tolerance policy widens them (tests/tolerance.py).
RTOL = 1e-5
ATOL = 1e-6

# `f` passed as a jit ARGUMENT, as a training loop would.
jit_call = jax.jit(lambda f, s, *args: f(s, *args))


def as_numpy(leaf: Any) -> np.ndarray:
    if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
    return np.asarray(leaf)


def assert_trees_close(actual: Any, expected: Any) -> None:
    """Same structure; floats within a tight tolerance, ints, bools and keys exactly."""
    leaves_a, def_a = jax.tree_util.tree_flatten(actual)
    leaves_e, def_e = jax.tree_util.tree_flatten(expected)
    assert def_a == def_e, f"{def_a} != {def_e}"
    for a, e in zip(leaves_a, leaves_e):
        a, e = as_numpy(a), as_numpy(e)
        assert a.shape == e.shape, (a.shape, e.shape)
        if np.issubdtype(e.dtype, np.inexact):
            np.testing.assert_allclose(a, e, **tolerance(RTOL, ATOL))
        else:
            assert a.dtype == e.dtype, (a.dtype, e.dtype)
            np.testing.assert_array_equal(a, e)


def assert_generated_close(
    actual: Any, expected: Any, what: str, source: str, *, rtol: float, atol: float
) -> None:
    """Same structure, dtypes and shapes; floats within ``rtol``/``atol`` (the
    tolerance policy's, ``tests/tolerance.py``), the rest exactly. A mismatch names ``what`` and shows the generated
    program's ``source`` (the property tests)."""
    try:
        leaves_a, def_a = jax.tree_util.tree_flatten(actual)
        leaves_e, def_e = jax.tree_util.tree_flatten(expected)
        assert def_a == def_e, (def_a, def_e)
        for a, e in zip(leaves_a, leaves_e):
            a, e = np.asarray(a), np.asarray(e)
            assert a.shape == e.shape and a.dtype == e.dtype, (a.dtype, e.dtype, a.shape, e.shape)
            if np.issubdtype(e.dtype, np.inexact):
                np.testing.assert_allclose(a, e, **tolerance(rtol, atol))
            else:
                np.testing.assert_array_equal(a, e)
    except AssertionError as exc:
        raise AssertionError(f"{what} differ:\n{exc}\n--- source ---\n{source}") from None


def assert_states_close(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert sorted(actual) == sorted(expected)
    for name in expected:
        try:
            assert_trees_close(actual[name], expected[name])
        except AssertionError as exc:
            raise AssertionError(f"state {name!r}: {exc}") from None


_PATH_PART = re.compile(r"\.?([A-Za-z_]\w*)|\[(\d+)\]|\['([^']*)'\]")


def read_path(model: Any, name: str) -> Any:
    """The value at a state name (``blocks[0].bn.mean``, ``heads['a'].count``)."""
    obj, pos = model, 0
    while pos < len(name):
        match = _PATH_PART.match(name, pos)
        assert match is not None, f"bad state name {name!r} at {pos}"
        attr, index, key = match.groups()
        if attr is not None:
            obj = getattr(obj, attr)
        elif index is not None:
            obj = obj[int(index)]
        else:
            obj = obj[key]
        pos = match.end()
    return obj


def eager_states(model: Any, names: list[str]) -> dict[str, Any]:
    """The model's current state values, read as plain attributes from outside."""
    return {name: read_path(model, name) for name in names}
