"""The harness of the differential tests (``tests/semantics/``).

A source text is written twice with ``write_module``: as plain Python
(``@DECORATE`` removed; ``lax.*`` replaced by Python loops, which is what a
state write inside them means) and decorated with ``@autostate.stateful``
(``@DECORATE_HOST``: ``fallback="host"``). ``check`` runs the same calls on
both, eagerly, through ``f(states, ...)``, under ``jax.jit`` and after
``autostate.freeze``, and compares outputs and attributes.

The ``jit`` path is ``staged``: the call is traced exactly as ``jax.jit``
traces it (``jax.jit(fn).trace``), and a short program called once is then run
one primitive at a time instead of compiled. What the decorated code does
under tracing is autostate's and is checked either way; what XLA makes of the
staged program is JAX's. ``AUTOSTATE_TEST_COMPILE=1`` makes ``staged`` plain
``jax.jit``, so every case also compiles; ``tests/models/`` always compiles.
"""

from __future__ import annotations

import enum
import functools
import os
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxpr_as_fun

import autostate

Loader = Callable[..., types.ModuleType]
Call = tuple[str, tuple[Any, ...]]


class _X:
    """Placeholder argument: replaced by the traced input under grad/vmap."""


X = _X()

HEADER = """
from __future__ import annotations
import abc
import typing
import copy
import dataclasses
import functools
import jax
import jax.numpy as jnp
import numpy as np
import autostate
"""


PYLAX = """

class _PyLax:
    \"\"\"What a lax primitive means as a Python loop: the plain reference.\"\"\"

    @staticmethod
    def scan(body, init, xs, length=None, reverse=False):
        n = length if xs is None else len(jax.tree_util.tree_leaves(xs)[0])
        carry, ys = init, []
        for i in (reversed(range(n)) if reverse else range(n)):
            x = None if xs is None else jax.tree_util.tree_map(lambda a: a[i], xs)
            carry, y = body(carry, x)
            ys.append(y)
        if reverse:
            ys = ys[::-1]
        if ys and jax.tree_util.tree_leaves(ys[0]):
            return carry, jax.tree_util.tree_map(lambda *v: jnp.stack(v), *ys)
        return carry, (ys[0] if ys else None)

    @staticmethod
    def fori_loop(lo, hi, body, init):
        for i in range(int(lo), int(hi)):
            init = body(i, init)
        return init

    @staticmethod
    def while_loop(cond, body, init):
        while bool(cond(init)):
            init = body(init)
        return init

    @staticmethod
    def cond(pred, t, f, *ops):
        return t(*ops) if bool(pred) else f(*ops)

    @staticmethod
    def switch(i, branches, *ops):
        return branches[min(max(int(i), 0), len(branches) - 1)](*ops)

    @staticmethod
    def map(fn, xs):
        return jnp.stack([fn(x) for x in xs])

    @staticmethod
    def checkpoint(fn, **kw):
        return fn


lax = _PyLax()
checkpoint = lambda fn, **kw: fn
STATE = lambda v, **kw: v
"""


# A program whose length times the calls made of it so far exceeds this
# compiles: one compilation then costs less than running (and compiling) its
# primitives one by one, call after call.
_STAGED_EQNS = int(os.environ.get("AUTOSTATE_TEST_STAGED_EQNS", "60"))


class staged:  # noqa: N801 (used as jax.jit is: a function-like decorator)
    """``jax.jit(fn)`` without compiling: traced as ``jit`` traces, the staged
    program run primitive by primitive (see the module docstring).

    It is ``jax.jit`` itself for a long program or one called again (see
    ``_STAGED_EQNS``), with ``donate_argnums`` or static arguments, under
    ``jax.disable_jit``, when the arguments do not flatten to the program's
    inputs, and with ``AUTOSTATE_TEST_COMPILE=1``. Anything else
    (``lower``, ``trace``, ``_cache_size``) is the ``jax.jit`` object's.
    """

    def __init__(self, fn: Callable[..., Any], **jit_options: Any) -> None:
        self._jitted = jax.jit(fn, **jit_options)
        self._compile = any(jit_options.values()) or os.environ.get("AUTOSTATE_TEST_COMPILE") == "1"
        self._calls: dict[int, int] = {}
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._compile or jax.config.jax_disable_jit:
            return self._jitted(*args, **kwargs)
        traced = self._jitted.trace(*args, **kwargs)
        leaves = jax.tree_util.tree_leaves((args, kwargs))
        program = traced.jaxpr
        calls = self._calls[id(program.jaxpr)] = self._calls.get(id(program.jaxpr), 0) + 1
        if len(leaves) != len(program.in_avals) or len(program.eqns) * calls > _STAGED_EQNS:
            return self._jitted(*args, **kwargs)
        outs = [jnp.asarray(out) for out in jaxpr_as_fun(program)(*leaves)]
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(traced.out_info), outs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._jitted, name)

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        return self if obj is None else functools.partial(self, obj)


_PAIRS: dict[str, tuple[types.ModuleType, types.ModuleType]] = {}


def pair(write_module: Loader, source: str) -> tuple[types.ModuleType, types.ModuleType]:
    """The source as plain Python and decorated, built once per source text."""
    if source not in _PAIRS:
        _PAIRS[source] = _pair(write_module, source)
    for module in _PAIRS[source]:
        # A cached pair outlives the test that wrote it: its modules stay
        # importable, so its classes pickle by reference in any later test.
        sys.modules.setdefault(module.__name__, module)
    return _PAIRS[source]


def _pair(write_module: Loader, source: str) -> tuple[types.ModuleType, types.ModuleType]:
    """The source as plain Python and decorated; ``lax.*`` is a Python loop in the plain one.

    ``@DECORATE_HOST`` is ``@autostate.stateful(fallback="host")``; ``LAXW.scan`` & co. are
    ``autostate.scan`` & co. (used from undecorated helpers), a Python loop in the plain one.
    """
    plain_src = source.replace("@AUTOCHECKPOINT", "@checkpoint")
    for tag in ("@DECORATE_HOST", "@DECORATE"):
        plain_src = plain_src.replace(tag, "")
    plain = write_module(HEADER + PYLAX + "LAXW = lax\n" + plain_src)
    dec_src = (
        source.replace("@DECORATE_HOST", '@autostate.stateful(fallback="host")')
        .replace("@DECORATE", "@autostate.stateful")
        .replace("@AUTOCHECKPOINT", "@autostate.checkpoint")
    )
    dec = write_module(
        HEADER + "from jax import lax\ncheckpoint = jax.checkpoint\nSTATE = autostate.state\n"
        + "LAXW = autostate\n" + dec_src
    )
    return plain, dec


def _is_model(obj: Any) -> bool:
    return (
        hasattr(obj, "__dict__")
        and not isinstance(obj, jax.Array | np.ndarray | type | types.ModuleType)
        and not callable(obj)
        or (hasattr(obj, "__dict__") and type(obj).__module__.startswith("autostate_testmod"))
    )


def snapshot(obj: Any, depth: int = 0) -> Any:
    """Every attribute of a (plain or decorated) model, read with getattr."""
    if depth > 6:
        return "<deep>"
    if isinstance(obj, list | tuple):
        return type(obj)(snapshot(v, depth + 1) for v in obj) if not hasattr(obj, "_fields") else (
            tuple(snapshot(v, depth + 1) for v in obj)
        )
    if isinstance(obj, dict):
        return {k: snapshot(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, jax.Array | np.ndarray | np.generic):
        if jax.dtypes.issubdtype(obj.dtype, jax.dtypes.prng_key):
            return ("key", np.asarray(jax.random.key_data(obj)))
        return np.asarray(obj)
    if isinstance(obj, bool | int | float | str | type(None)):
        return obj
    if hasattr(obj, "__dict__") and type(obj).__module__.startswith("autostate_testmod"):
        return {
            "__class__": type(obj).__name__,
            **{k: snapshot(getattr(obj, k), depth + 1) for k in sorted(vars(obj))},
        }
    return f"<{type(obj).__name__}>"


def assert_same(expected: Any, got: Any, where: str = "") -> None:
    """Equal structure and values (numbers compared as arrays)."""
    if isinstance(expected, dict):
        assert isinstance(got, dict), f"{where}: expected dict, got {type(got).__name__}"
        assert sorted(map(str, expected)) == sorted(map(str, got)), f"{where}: keys differ"
        for k in expected:
            assert_same(expected[k], got[k], f"{where}[{k!r}]")
        return
    if isinstance(expected, list | tuple):
        assert isinstance(got, list | tuple), f"{where}: expected sequence, got {type(got)}"
        assert type(expected) is type(got) or (
            hasattr(expected, "_fields") or hasattr(got, "_fields")
        ), f"{where}: {type(expected).__name__} vs {type(got).__name__}"
        assert len(expected) == len(got), f"{where}: lengths differ"
        for i, (a, b) in enumerate(zip(expected, got)):
            assert_same(a, b, f"{where}[{i}]")
        return
    if isinstance(expected, str) or expected is None:
        assert expected == got, f"{where}: {expected!r} != {got!r}"
        return
    if isinstance(got, tuple) and len(got) == 2 and got[0] == "key":
        got = got[1]
    if isinstance(expected, tuple) and len(expected) == 2 and expected[0] == "key":
        expected = expected[1]
    a, b = np.asarray(expected), np.asarray(got)
    assert a.shape == b.shape, f"{where}: shape {a.shape} != {b.shape}"
    np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=1e-5, atol=1e-6,
                               err_msg=where)


def _method(obj: Any, name: str) -> Callable[..., Any]:
    return getattr(obj, name)


def _fcall(f: Any, name: str) -> Callable[..., Any]:
    return f if name == "__call__" else getattr(f, name)


def plain_path(model: Any, key: str) -> Any:
    return eval("m." + key if not key.startswith("[") else "m" + key, {"m": model})  # noqa: S307


def check(
    plain: types.ModuleType,
    dec: types.ModuleType,
    build: str,
    calls: Sequence[Call],
    modes: Sequence[str] = ("eager", "f", "jit", "freeze"),
) -> None:
    """Runs ``calls`` on a plain and a decorated model built by ``build``."""
    ref = eval(build, vars(plain))  # noqa: S307
    expected = [_method(ref, m)(*a) for m, a in calls]
    expected_snap = snapshot(ref)

    if "eager" in modes:
        model = eval(build, vars(dec))  # noqa: S307
        got = [_method(model, m)(*a) for m, a in calls]
        assert_same(expected, got, "eager outputs")
        assert_same(expected_snap, snapshot(model), "eager attributes")

    for mode in ("f", "jit"):
        if mode not in modes:
            continue
        model = eval(build, vars(dec))  # noqa: S307
        before = snapshot(model)
        f, states = model.functionalize()
        got = []
        jitted: dict[str, Any] = {}
        for m, a in calls:
            if mode == "f":
                out, states = _fcall(f, m)(states, *a)
            else:
                if m not in jitted:
                    jitted[m] = staged(lambda f, s, *a, m=m: _fcall(f, m)(s, *a))
                out, states = jitted[m](f, states, *a)
            got.append(out)
        assert_same(expected, got, f"{mode} outputs")
        for key, value in states.items():
            assert_same(snapshot(plain_path(ref, key)), snapshot(value), f"{mode} state {key}")
        assert_same(before, snapshot(model), f"{mode}: the eager model changed")
        if mode == "jit" and "freeze" in modes:
            frozen = autostate.freeze(f, states)
            assert_same(expected_snap, snapshot(frozen), "frozen attributes")


def check_transform(
    plain: types.ModuleType,
    dec: types.ModuleType,
    build: str,
    calls: Sequence[Call],
    x: Any,
    transform: str,
) -> None:
    """``jax.grad`` or ``jax.vmap`` over X, plain model built inside vs f from outside."""
    keys = sorted(eval(build, vars(dec)).functionalize()[1])  # noqa: S307

    def plain_fn(xv: Any) -> Any:
        m = eval(build, vars(plain))  # noqa: S307
        outs = [_method(m, n)(*[xv if v is X else v for v in a]) for n, a in calls]
        return outs, {k: plain_path(m, k) for k in keys}

    model = eval(build, vars(dec))  # noqa: S307
    f, states0 = model.functionalize()

    def dec_fn(xv: Any) -> Any:
        s = states0
        outs = []
        for n, a in calls:
            out, s = _fcall(f, n)(s, *[xv if v is X else v for v in a])
            outs.append(out)
        return outs, s

    if transform == "grad":

        def scalar(fn: Callable[..., Any]) -> Callable[..., Any]:
            def g(xv: Any) -> Any:
                outs, st = fn(xv)
                leaves = jax.tree_util.tree_leaves((outs, st))
                return sum(jnp.sum(jnp.asarray(v, jnp.float32)) for v in leaves
                           if jnp.issubdtype(jnp.asarray(v).dtype, jnp.floating))

            return g

        assert_same(jax.grad(scalar(plain_fn))(x), jax.grad(scalar(dec_fn))(x), "grad")
        assert_same(jax.grad(scalar(plain_fn))(x), staged(jax.grad(scalar(dec_fn)))(x), "jit grad")
    else:
        assert_same(jax.vmap(plain_fn)(x), jax.vmap(dec_fn)(x), "vmap")
        assert_same(jax.vmap(plain_fn)(x), staged(jax.vmap(dec_fn))(x), "jit vmap")


def _is_py(v: Any) -> bool:
    return isinstance(v, bool | int | float | complex) and not isinstance(v, np.generic)


def same(expected: Any, got: Any, where: str = "") -> None:
    """Equal structure, dtypes, shapes and values (floats to 1e-6); Python
    scalars of the same type; enum members by class name and member (the plain
    and decorated modules define their own)."""
    if isinstance(expected, dict):
        assert isinstance(got, dict), f"{where}: expected dict, got {type(got).__name__}"
        assert sorted(map(str, expected)) == sorted(map(str, got)), (
            f"{where}: keys differ: {sorted(map(str, expected))} != {sorted(map(str, got))}"
        )
        for k in expected:
            same(expected[k], got[k], f"{where}[{k!r}]")
        return
    if isinstance(expected, list | tuple):
        assert isinstance(got, list | tuple), f"{where}: expected sequence, got {type(got)}"
        assert len(expected) == len(got), f"{where}: lengths differ"
        for i, (a, b) in enumerate(zip(expected, got, strict=True)):
            same(a, b, f"{where}[{i}]")
        return
    if isinstance(expected, str) or expected is None:
        assert expected == got, f"{where}: {expected!r} != {got!r}"
        return
    if isinstance(expected, tuple) and expected and expected[0] == "key":
        expected = expected[1]
    if isinstance(expected, enum.Enum):  # plain and decorated modules define their own
        assert isinstance(got, enum.Enum), f"{where}: {expected!r} != {got!r}"
        assert (type(expected).__name__, expected.name) == (type(got).__name__, got.name), where
        return
    if _is_py(expected) and _is_py(got):
        assert type(expected) is type(got) and expected == got, f"{where}: {expected!r} != {got!r}"
        return
    a = np.asarray(jnp.asarray(expected)) if _is_py(expected) else np.asarray(expected)
    b = np.asarray(jnp.asarray(got)) if _is_py(got) else np.asarray(got)
    assert a.dtype == b.dtype, f"{where}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{where}: shape {a.shape} != {b.shape}"
    if np.issubdtype(a.dtype, np.inexact):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6, err_msg=where)
    else:
        np.testing.assert_array_equal(a, b, err_msg=where)


def user_line(
    err: BaseException, module: types.ModuleType, text: str, *, fix: bool = True
) -> None:
    """The error is autostate's, names a line of ``module`` holding ``text``
    and (``fix``) says how to fix it."""
    assert isinstance(err, autostate.AutostateError), f"not an autostate error: {err!r}"
    path = module.__file__
    assert path is not None
    with open(path) as fh:
        lines = fh.read().splitlines()
    numbers = [i + 1 for i, line in enumerate(lines) if text in line]
    assert numbers, f"{text!r} not in the source"
    assert any(f"{path}:{n}" in str(err) for n in numbers), f"no {path}:{numbers} in: {err}"
    if fix:
        assert "fix" in str(err).lower(), f"no fix in: {err}"


def raises_autostate(exc: type[BaseException] = autostate.AutostateError) -> Any:
    return pytest.raises(exc)


def assert_user_line(err: BaseException, filename: str) -> None:
    assert f"{filename}:" in str(err), f"no user file:line in: {err}"
