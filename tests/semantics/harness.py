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

import contextlib
import copy
import enum
import functools
import itertools
import os
import re
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import dispatch as _jax_dispatch  # no public way to drop a failed runtime token
from jax.extend.core import jaxpr_as_fun
from tolerance import tolerance

import autostate
from autostate import effects as _engine
from autostate.effects import local_state as _local_state
from semantics.programs_shared import BUILDS, KEY, LIBRARY

Loader = Callable[..., types.ModuleType]
Call = tuple[str, tuple[Any, ...]]


class _X:
    """Placeholder argument: replaced by the traced input under grad/vmap."""


X = _X()

HEADER = """
from __future__ import annotations
import abc
import collections
import copy
import dataclasses
import copy
import enum
import functools
import typing
import weakref
from typing import NamedTuple
import jax
import jax.numpy as jnp
import numpy as np
import autostate
from autostate import guard as _guard
from autostate.effects import local_state as _local_state
from autostate import effects as _engine
TRACES = []
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

    _NONE = object()

    @staticmethod
    def cond(pred, t, f, *ops, operand=_NONE):
        if operand is not _PyLax._NONE:
            ops = (operand,)
        return t(*ops) if bool(pred) else f(*ops)

    @staticmethod
    def switch(i, branches, *ops):
        return branches[min(max(int(i), 0), len(branches) - 1)](*ops)

    @staticmethod
    def map(fn, xs, batch_size=None):
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


_PAIRS: dict[tuple[Any, ...], tuple[types.ModuleType, types.ModuleType]] = {}


def pair(
    write_module: Loader,
    source: str,
    *,
    fresh: bool = False,
    plain_subs: Sequence[tuple[str, str]] = (),
    checkpoint_as_identity: bool = False,
) -> tuple[types.ModuleType, types.ModuleType]:
    """The source as plain Python and decorated (see ``_pair``), built once per
    source text and options.

    ``fresh``: new modules, not the cached ones (for a test that edits its
    modules or classes, or counts what happens at import).
    """
    if fresh:
        return _pair(write_module, source, plain_subs=plain_subs,
                     checkpoint_as_identity=checkpoint_as_identity)
    key = (source, tuple(plain_subs), checkpoint_as_identity)
    if key not in _PAIRS:
        _PAIRS[key] = _pair(write_module, source, plain_subs=plain_subs,
                            checkpoint_as_identity=checkpoint_as_identity)
    for module in _PAIRS[key]:
        # A cached pair outlives the test that wrote it: its modules stay
        # importable, so its classes pickle by reference in any later test.
        sys.modules.setdefault(module.__name__, module)
    return _PAIRS[key]


def _pair(
    write_module: Loader,
    source: str,
    *,
    plain_subs: Sequence[tuple[str, str]] = (),
    checkpoint_as_identity: bool = False,
) -> tuple[types.ModuleType, types.ModuleType]:
    """The source as plain Python and decorated; ``lax.*`` is a Python loop in the plain one.

    ``@DECORATE_HOST`` is ``@autostate.stateful(fallback="host")``; ``LAXW.scan`` & co. are
    ``autostate.scan`` & co. (used from undecorated helpers), a Python loop in the plain one.
    ``plain_subs``: ``(old, new)`` replaced in the plain source only (a spelling that would
    take JAX's own primitive there). ``checkpoint_as_identity``: ``jax.checkpoint`` /
    ``jax.remat`` are the identity in the plain module too (plain JAX would leak the tracer
    of a remat body that writes ``self``).
    """
    plain = write_module(_plain_source(source, plain_subs, checkpoint_as_identity))
    dec = write_module(_decorated_source(source))
    return plain, dec


def _plain_source(
    source: str, plain_subs: Sequence[tuple[str, str]] = (), checkpoint_as_identity: bool = False
) -> str:
    plain_src = source.replace("@AUTOCHECKPOINT", "@checkpoint")
    for tag in ("@DECORATE_HOST", "@DECORATE"):
        plain_src = plain_src.replace(tag, "")
    for old, new in plain_subs:
        assert old in plain_src, old
        plain_src = plain_src.replace(old, new)
    if checkpoint_as_identity:
        plain_src = (
            plain_src.replace("@jax.checkpoint", "@checkpoint")
            .replace("jax.checkpoint(", "checkpoint(")
            .replace("jax.remat(", "checkpoint(")
        )
    return HEADER + PYLAX + "LAXW = lax\n" + plain_src


def _decorated_source(source: str) -> str:
    dec_src = (
        source.replace("@DECORATE_HOST", '@autostate.stateful(fallback="host")')
        .replace("@DECORATE", "@autostate.stateful")
        .replace("@AUTOCHECKPOINT", "@autostate.checkpoint")
    )
    return (
        HEADER + "from jax import lax\ncheckpoint = jax.checkpoint\nSTATE = autostate.state\n"
        + "LAXW = autostate\n" + dec_src
    )


_HELPER_MODULES = itertools.count()


def pair_with_helpers(
    write_module: Loader, helper: str, source: str
) -> tuple[types.ModuleType, types.ModuleType, types.ModuleType, types.ModuleType]:
    """A helper module and a model module importing it (``import HELPERS as helpers``),
    each written plain and decorated: ``(plain, dec, plain_helpers, dec_helpers)``."""
    n = next(_HELPER_MODULES)
    hp = write_module(_plain_source(helper), name=f"autostate_testmod_helpers_plain{n}")
    hd = write_module(_decorated_source(helper), name=f"autostate_testmod_helpers_dec{n}")
    plain = write_module(_plain_source(source.replace("HELPERS", hp.__name__)))
    dec = write_module(_decorated_source(source.replace("HELPERS", hd.__name__)))
    return plain, dec, hp, hd


def _is_model(obj: Any) -> bool:
    return (
        hasattr(obj, "__dict__")
        and not isinstance(obj, jax.Array | np.ndarray | type | types.ModuleType)
        and not callable(obj)
        or (hasattr(obj, "__dict__") and type(obj).__module__.startswith("autostate_testmod"))
    )


def snapshot(obj: Any, depth: int = 0) -> Any:
    """Every attribute of a (plain or decorated) model, read with getattr, once the
    effects of the programs dispatched before have run (an accelerator runs them
    after the call returned, and their callbacks may write the model). A callback
    without an effect runs when its program's outputs are ready: block on them first."""
    if depth == 0:
        jax.effects_barrier()
    if depth > 6:
        return "<deep>"
    if isinstance(obj, autostate.Stack):  # (its plain reference: the list of its layers)
        return [snapshot(layer, depth + 1) for layer in obj]
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
    if isinstance(obj, bool | int | float | complex | str | type(None)):
        return obj
    if hasattr(obj, "__dict__") and type(obj).__module__.startswith("autostate_testmod"):
        return {
            "__class__": type(obj).__name__,
            **{k: snapshot(getattr(obj, k), depth + 1) for k in sorted(vars(obj))},
        }
    return f"<{type(obj).__name__}>"


def _is_key_snapshot(v: Any) -> bool:
    return isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str) and v[0] == "key"


def assert_same(
    expected: Any, got: Any, where: str = "", *, rtol: float = 1e-5, atol: float = 1e-6
) -> None:
    """Equal structure and values (numbers compared as arrays, to ``rtol`` / ``atol``;
    complex numbers as complex; a snapshotted key by its key data)."""
    if _is_key_snapshot(got):
        got = got[1]
    if _is_key_snapshot(expected):
        expected = expected[1]
    if isinstance(expected, dict):
        assert isinstance(got, dict), f"{where}: expected dict, got {type(got).__name__}"
        assert sorted(map(str, expected)) == sorted(map(str, got)), f"{where}: keys differ"
        for k in expected:
            assert_same(expected[k], got[k], f"{where}[{k!r}]", rtol=rtol, atol=atol)
        return
    if isinstance(expected, list | tuple):
        assert isinstance(got, list | tuple), f"{where}: expected sequence, got {type(got)}"
        assert type(expected) is type(got) or (
            hasattr(expected, "_fields") or hasattr(got, "_fields")
        ), f"{where}: {type(expected).__name__} vs {type(got).__name__}"
        assert len(expected) == len(got), f"{where}: lengths differ"
        for i, (a, b) in enumerate(zip(expected, got)):
            assert_same(a, b, f"{where}[{i}]", rtol=rtol, atol=atol)
        return
    if isinstance(expected, str) or expected is None:
        assert expected == got, f"{where}: {expected!r} != {got!r}"
        return
    a, b = np.asarray(expected), np.asarray(got)
    assert a.shape == b.shape, f"{where}: shape {a.shape} != {b.shape}"
    tol = tolerance(rtol, atol)
    if np.iscomplexobj(a) or np.iscomplexobj(b):
        np.testing.assert_allclose(a.astype(np.complex128), b.astype(np.complex128), **tol,
                                   err_msg=where)
        return
    np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), **tol, err_msg=where)


def _method(obj: Any, name: str) -> Callable[..., Any]:
    return getattr(obj, name)


def _fcall(f: Any, name: str) -> Callable[..., Any]:
    return f if name == "__call__" else getattr(f, name)


_PATH_STEP = re.compile(r"\.?([^\W\d]\w*)|\[(-?\d+)\]|\[('(?:[^'\\]|\\.)*')\]")


def plain_path(model: Any, key: str, at: int = 0) -> Any:
    """The value a state name (``blocks[0].bn.mean``) names in a plain model. A
    name through a stack (``blocks.mean``, ``autostate.stack``) meets the plain
    reference's list of layers: the value is the layers' values, stacked."""
    obj = model
    while at < len(key):
        step = _PATH_STEP.match(key, at)
        if step is None:  # (a key only Python reads: a tuple, a float, a double-quoted str)
            rest = key[at:] if key[at] in ".[" else "." + key[at:]
            return eval("m" + rest, {"m": obj})  # noqa: S307
        attr, index, item = step.groups()
        if attr is not None and isinstance(obj, list):
            values = [plain_path(layer, key, at) for layer in obj]
            return jax.tree_util.tree_map(lambda *v: jnp.stack(v), *values)
        if attr is not None:
            obj = getattr(obj, attr)
        else:
            obj = obj[int(index)] if index is not None else obj[eval(item)]  # noqa: S307
        at = step.end()
    return obj


def check(
    plain: types.ModuleType,
    dec: types.ModuleType,
    build: str,
    calls: Sequence[Call],
    modes: Sequence[str] = ("eager", "f", "jit", "freeze"),
    *,
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> None:
    """Runs ``calls`` on a plain and a decorated model built by ``build``: outputs and
    attributes equal (to ``rtol`` / ``atol``) in every mode."""
    tol = {"rtol": rtol, "atol": atol}
    ref = eval(build, vars(plain))  # noqa: S307
    # Outputs ready before a snapshot: a callback without an effect (jax.pure_callback)
    # that writes the model runs with its program, after the call on an accelerator.
    expected = jax.block_until_ready([_method(ref, m)(*a) for m, a in calls])
    expected_snap = snapshot(ref)

    if "eager" in modes:
        model = eval(build, vars(dec))  # noqa: S307
        got = jax.block_until_ready([_method(model, m)(*a) for m, a in calls])
        assert_same(expected, got, "eager outputs", **tol)
        assert_same(expected_snap, snapshot(model), "eager attributes", **tol)

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
        assert_same(expected, got, f"{mode} outputs", **tol)
        for key, value in states.items():
            assert_same(snapshot(plain_path(ref, key)), snapshot(value), f"{mode} state {key}", **tol)
        assert_same(before, snapshot(model), f"{mode}: the eager model changed", **tol)
        if mode == "jit" and "freeze" in modes:
            frozen = autostate.freeze(f, states)
            assert_same(expected_snap, snapshot(frozen), "frozen attributes", **tol)


def outputs_in_mode(model: Any, mode: str, xs: Sequence[Any]) -> tuple[list[float], Any]:
    """``float(model(x))`` for each of ``xs``: eagerly (``mode="eager"``), or through
    ``f`` (``"f"``) or ``staged(f)`` (``"jit"``) from the model's states. Returns the
    outputs and what holds the states after the calls: ``model`` itself eagerly,
    ``autostate.freeze(f, states)`` otherwise."""
    if mode == "eager":
        return [float(model(x)) for x in xs], model
    f, states = model.functionalize()
    call = f if mode == "f" else staged(f)
    got = []
    for x in xs:
        out, states = call(states, x)
        got.append(float(out))
    return got, autostate.freeze(f, states)


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

        # The plain reference once (it builds its model inside: every evaluation
        # is the same), against the decorated ``f`` eagerly and staged.
        expected = jax.grad(scalar(plain_fn))(x)
        assert_same(expected, jax.grad(scalar(dec_fn))(x), "grad")
        assert_same(expected, staged(jax.grad(scalar(dec_fn)))(x), "jit grad")
    else:
        expected = jax.vmap(plain_fn)(x)
        assert_same(expected, jax.vmap(dec_fn)(x), "vmap")
        assert_same(expected, staged(jax.vmap(dec_fn))(x), "jit vmap")


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
        np.testing.assert_allclose(a, b, **tolerance(1e-6, 1e-6), err_msg=where)
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


@contextlib.contextmanager
def raises_after_the_call() -> Iterator[pytest.ExceptionInfo[jax.errors.JaxRuntimeError]]:
    """``pytest.raises(JaxRuntimeError)`` for a callback that fails while its program
    runs: at the call on CPU, after the call returned on an accelerator (waited for
    here; inside the ``with``, block on the outputs of a callback without an effect,
    ``jax.pure_callback``). JAX keeps the failed program's runtime token and raises
    its error again at every later ``jax.effects_barrier``: it is dropped here, so
    what runs next does not fail with it."""
    try:
        with pytest.raises(jax.errors.JaxRuntimeError) as info:
            yield info
            jax.effects_barrier()
    finally:
        _jax_dispatch.runtime_tokens.clear()


def assert_user_line(err: BaseException, filename: str) -> None:
    assert f"{filename}:" in str(err), f"no user file:line in: {err}"


def no_tracer(model: Any) -> None:
    assert not autostate.lifetime.contains_tracer(snapshot(model)), "tracer leaked into the model"


def refused_everywhere(
    dec: types.ModuleType, build: str, method: str, args: tuple[Any, ...], write_line: str
) -> None:
    """Eagerly, through ``f`` and under ``jax.jit(f)``: an autostate error, the model
    and the given states left as they were, no tracer anywhere."""
    model = eval(build, vars(dec))  # noqa: S307
    before = snapshot(model)
    with pytest.raises(autostate.errors.TracedEagerStateError) as info:
        getattr(model, method)(*args)
    user_line(info.value, dec, write_line)
    no_tracer(model)
    assert_same(before, snapshot(model), "eager model after the refused call")
    model = eval(build, vars(dec))  # noqa: S307
    f, states = model.functionalize()
    kept = snapshot(states)
    for call in (_fcall(f, method), jax.jit(_fcall(f, method))):
        with pytest.raises(autostate.errors.EscapedStateError) as info:
            call(states, *args)
        assert "fix" in str(info.value)
        assert __file__ in str(info.value), str(info.value)  # the line that calls f
    assert_same(kept, snapshot(states), "states after the refused call")
    assert_same(before, snapshot(model), "model after the refused call")


# ---------------------------------------------------------------------------
# run_case: ``check`` compared with ``same`` (dtypes and Python scalar types too)


class S:
    """A static argument: baked into the jitted function instead of traced."""

    def __init__(self, value: Any) -> None:
        self.value = value


def _args(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(a.value if isinstance(a, S) else a for a in args)


_JITS: dict[tuple[str, tuple[Any, ...]], Any] = {}


def _jitted(name: str, args: tuple[Any, ...]) -> Any:
    """One staged ``f.<name>`` per method and static-argument layout, reused across cases."""
    layout = tuple((i, a.value) if isinstance(a, S) else None for i, a in enumerate(args))
    key = (name, layout)
    if key not in _JITS:

        def fn(f: Any, s: Any, *traced: Any) -> Any:
            it = iter(traced)
            full = [lay[1] if lay is not None else next(it) for lay in layout]
            return _fcall(f, name)(s, *full)

        _JITS[key] = staged(fn)
    return _JITS[key]


def _out(v: Any) -> Any:
    """A model returned by a call is compared by its attributes."""
    if type(v).__module__.startswith("autostate_testmod") and hasattr(v, "__dict__"):
        return snapshot(v)
    if isinstance(v, list | tuple):
        items = [_out(x) for x in v]
        if all(a is b for a, b in zip(items, v)):
            return v
        return type(v)(*items) if hasattr(v, "_fields") else type(v)(items)
    return v


def run_case(
    plain: types.ModuleType,
    dec: types.ModuleType,
    build: str,
    calls: Sequence[Call],
    modes: Sequence[str] = ("eager", "f", "jit", "freeze"),
    extra: Call | None = None,
) -> None:
    """The calls on the plain model are the reference for every mode, compared with
    ``same``; a model returned by a call is compared by its attributes; ``S(v)``
    arguments are static under jit. ``extra``: a call made on the frozen model too."""
    ref = eval(build, vars(plain))  # noqa: S307
    expected = [_out(_fcall(ref, m)(*_args(a))) for m, a in calls]
    expected_snap = snapshot(ref)

    if "eager" in modes:
        model = eval(build, vars(dec))  # noqa: S307
        got = [_out(_fcall(model, m)(*_args(a))) for m, a in calls]
        same(expected, got, "eager outputs")
        same(expected_snap, snapshot(model), "eager attributes")

    for mode in ("f", "jit"):
        if mode not in modes:
            continue
        model = eval(build, vars(dec))  # noqa: S307
        before = snapshot(model)
        f, states = model.functionalize()
        got = []
        for m, a in calls:
            if mode == "f":
                out, states = _fcall(f, m)(states, *_args(a))
            else:
                traced = tuple(v for v in a if not isinstance(v, S))
                out, states = _jitted(m, a)(f, states, *traced)
            got.append(_out(out))
        same(expected, got, f"{mode} outputs")
        for key, value in states.items():
            same(snapshot(plain_path(ref, key)), snapshot(value), f"{mode} state {key}")
        same(before, snapshot(model), f"{mode}: the eager model changed")
        if mode == "jit" and "freeze" in modes:
            frozen = autostate.freeze(f, states)
            same(expected_snap, snapshot(frozen), "frozen attributes")
            if extra is not None:
                m, a = extra
                same(_out(_fcall(ref, m)(*_args(a))), _out(_fcall(frozen, m)(*_args(a))),
                     "frozen call")
                same(snapshot(ref), snapshot(frozen), "frozen attributes after a call")


def _bits(a: Any) -> np.ndarray:
    """An array's exact bits (keys as key data)."""
    a = jnp.asarray(a) if not isinstance(a, jax.Array) else a
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        a = jax.random.key_data(a)
    return np.atleast_1d(np.asarray(a)).view(np.uint8)


def assert_bits(expected: Any, got: Any, where: str = "", *, bitwise: bool = False) -> None:
    """Same structure, dtypes, shapes and values, exactly (typed keys compared by their
    key data). ``bitwise``: the very bits (``-0.0`` is not ``0.0``, a NaN's payload counts)."""
    e_leaves, e_tree = jax.tree_util.tree_flatten(expected)
    g_leaves, g_tree = jax.tree_util.tree_flatten(got)
    assert e_tree == g_tree, f"{where}: {e_tree} != {g_tree}"
    for i, (a, b) in enumerate(zip(e_leaves, g_leaves)):
        a, b = jnp.asarray(a), jnp.asarray(b)
        assert a.dtype == b.dtype, f"{where}[{i}]: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{where}[{i}]: shape {a.shape} != {b.shape}"
        if bitwise:
            np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=f"{where}[{i}]")
            continue
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{where}[{i}]")


# ---------------------------------------------------------------------------
# Training: a decorated model's ``f`` trained against the plain model with its
# params and states threaded by hand.


def library(write_module: Loader, base_decorated: bool = True,
            fresh: bool = False) -> tuple[types.ModuleType, types.ModuleType]:
    """The library plain and decorated; ``fresh``: new modules, in ``sys.modules`` while
    the test runs (for pickling by reference)."""
    src = LIBRARY.replace("@BASEDEC\n", "@DECORATE\n" if base_decorated else "")
    return pair(write_module, src, fresh=fresh)


def names_of(f: Any) -> dict[str, Any]:
    """``f``'s leaves by keypath, without the leading ``.model``."""
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(f):
        name = jax.tree_util.keystr(path)
        assert name.startswith(".model"), name
        out[name.removeprefix(".model").removeprefix(".")] = leaf
    return out


def plain_set(model: Any, key: str, value: Any) -> None:
    target = "m." + key if not key.startswith("[") else "m" + key
    exec(f"{target} = v", {"m": model, "v": value})  # noqa: S102


def load_plain(template: Any, params: dict[str, Any], states: dict[str, Any]) -> Any:
    m = copy.deepcopy(template)
    for k, v in {**params, **states}.items():
        plain_set(m, k, v)
    return m


def read_plain(model: Any, keys: Any) -> dict[str, Any]:
    return {k: plain_path(model, k) for k in keys}


def mse(out: Any, y: Any) -> Any:
    return jnp.mean((out - y) ** 2)


def ref_loss_fn(template: Any, method: str = "__call__") -> Callable[..., Any]:
    """The plain model's loss as a pure function of (params, states, x, y)."""

    def loss(params: dict[str, Any], states: dict[str, Any], x: Any, y: Any) -> Any:
        m = load_plain(template, params, states)
        out = getattr(m, method)(x)
        return mse(out, y), read_plain(m, states)

    return loss


def f_loss(f: Any, states: dict[str, Any], x: Any, y: Any) -> Any:
    out, states = f(states, x)
    return mse(out, y), states


def sgd(lr: float) -> tuple[Callable[..., Any], Callable[..., Any]]:
    def init(p: Any) -> Any:
        return ()

    def update(p: Any, g: Any, s: Any) -> Any:
        return jax.tree_util.tree_map(lambda a, b: a - lr * b, p, g), s

    return init, update


def momentum(lr: float, beta: float = 0.9) -> tuple[Callable[..., Any], Callable[..., Any]]:
    def init(p: Any) -> Any:
        return jax.tree_util.tree_map(jnp.zeros_like, p)

    def update(p: Any, g: Any, mu: Any) -> Any:
        mu = jax.tree_util.tree_map(lambda m, b: beta * m + b, mu, g)
        return jax.tree_util.tree_map(lambda a, m: a - lr * m, p, mu), mu

    return init, update


def adam(lr: float, b1: float = 0.9, b2: float = 0.99) -> tuple[Callable[..., Any], Callable[..., Any]]:
    def init(p: Any) -> Any:
        def zeros() -> Any:
            return jax.tree_util.tree_map(jnp.zeros_like, p)

        return (jnp.zeros((), jnp.int32), zeros(), zeros())

    def update(p: Any, g: Any, s: Any) -> Any:
        t, m, v = s
        t = t + 1
        m = jax.tree_util.tree_map(lambda a, b: b1 * a + (1 - b1) * b, m, g)
        v = jax.tree_util.tree_map(lambda a, b: b2 * a + (1 - b2) * b * b, v, g)
        mh = jax.tree_util.tree_map(lambda a: a / (1 - b1**t), m)
        vh = jax.tree_util.tree_map(lambda a: a / (1 - b2**t), v)
        p = jax.tree_util.tree_map(lambda a, b, c: a - lr * b / (jnp.sqrt(c) + 1e-8), p, mh, vh)
        return p, (t, m, v)

    return init, update


OPTIMIZERS = {"sgd": sgd(0.1), "momentum": momentum(0.05), "adam": adam(0.01)}


def batches(n: int, n_in: int = 3, n_out: int = 2, batch: int = 5) -> list[tuple[Any, Any]]:
    out = []
    for i in range(n):
        kx, ky = jax.random.split(jax.random.PRNGKey(100 + i))
        out.append((jax.random.normal(kx, (batch, n_in)), jax.random.normal(ky, (batch, n_out))))
    return out


def run_reference(template: Any, params: dict[str, Any], states: dict[str, Any], opt: str,
                  data: list[tuple[Any, Any]], jit: bool = True,
                  compiled: bool = False) -> list[tuple[Any, Any, Any]]:
    """Plain model + hand-threaded params/states: (loss, params, states) after every step.

    ``compiled``: under ``jax.jit`` itself, to compare with a compiled (donated) step
    bit for bit (Adam amplifies a last-bit difference in a near-zero gradient)."""
    init, update = OPTIMIZERS[opt]
    grad_fn = jax.value_and_grad(ref_loss_fn(template), has_aux=True)

    def step(params: Any, opt_state: Any, states: Any, x: Any, y: Any) -> Any:
        (loss, states), grads = grad_fn(params, states, x, y)
        params, opt_state = update(params, grads, opt_state)
        return loss, params, opt_state, states

    if jit:
        step = jax.jit(step) if compiled else staged(step)
    opt_state = init(params)
    trace = []
    for x, y in data:
        loss, params, opt_state, states = step(params, opt_state, states, x, y)
        trace.append((loss, params, states))
    return trace


def f_train_step(opt: str, donate: bool = False) -> Callable[..., Any]:
    _, update = OPTIMIZERS[opt]

    def step(f: Any, opt_state: Any, states: Any, x: Any, y: Any) -> Any:
        (loss, states), grads = jax.value_and_grad(f_loss, has_aux=True)(f, states, x, y)
        f, opt_state = update(f, grads, opt_state)
        return loss, f, opt_state, states

    return staged(step, donate_argnums=(0, 1, 2) if donate else ())


def assert_step(ref: tuple[Any, Any, Any], loss: Any, f: Any, states: Any, where: str) -> None:
    r_loss, r_params, r_states = ref
    assert_same(r_loss, loss, f"{where} loss")
    assert_same(r_params, names_of(f), f"{where} params")
    assert_same(r_states, states, f"{where} states")


def build_pair(plain: types.ModuleType, dec: types.ModuleType, kind: str) -> tuple[Any, Any, Any]:
    src, n_out = BUILDS[kind]
    template = eval(src, {**vars(plain), "KEY": KEY})  # noqa: S307
    model = eval(src, {**vars(dec), "KEY": KEY})  # noqa: S307
    return template, model, n_out


def data_for(n_out: Any, n: int = 6) -> list[tuple[Any, Any]]:
    if n_out is None:
        return [(x, y[:, 0]) for x, y in batches(n, 3, 1)]
    return batches(n, 3, n_out)


def train_against_reference(template: Any, model: Any, data: Any, opt: str = "momentum") -> Any:
    f, states = model.functionalize()
    assert_same(read_plain(template, names_of(f)), names_of(f), "initial params")
    assert_same(read_plain(template, states), states, "initial states")
    ref = run_reference(template, names_of(f), dict(states), opt, data)
    opt_state = OPTIMIZERS[opt][0](f)
    step = f_train_step(opt)
    for i, (x, y) in enumerate(data):
        loss, f, opt_state, states = step(f, opt_state, states, x, y)
        assert_step(ref[i], loss, f, states, f"step {i}")
    return f, states, ref


# ---------------------------------------------------------------------------
# Small helpers the concept files share.


def class_pair(write_module: Loader, source: str, cls_name: str) -> tuple[type, type, types.ModuleType]:
    """The class ``cls_name`` of ``source`` twice: plain Python, and decorated by calling
    ``autostate.stateful`` on it (with the module it was defined in)."""
    plain = getattr(write_module(source), cls_name)
    module = write_module(source)
    return plain, autostate.stateful(getattr(module, cls_name)), module


def modes_of(f: Any, method: str = "__call__", *, compiled: bool = False) -> list[Callable[..., Any]]:
    """``f.<method>`` called directly and under ``jax.jit`` (``staged``; ``compiled``:
    ``jax.jit`` itself, for a case that checks what the compiled call raises)."""
    call = _fcall(f, method)
    return [call, jax.jit(call) if compiled else staged(call)]


def floats(tree: Any) -> Any:
    """Numbers as floats, tuples as lists, dicts as dicts: comparable across modes."""
    if isinstance(tree, dict):
        return {k: floats(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return [floats(v) for v in tree]
    return float(tree)


def error_line(err: BaseException) -> str:
    """The source text of the test module line an error names."""
    m = re.search(r"at (\S+autostate_testmod_\d+\.py):(\d+)", str(err))
    assert m, f"no user file:line in: {err}"
    return Path(m.group(1)).read_text().splitlines()[int(m.group(2)) - 1]


def keys_of(dec: types.ModuleType, build: str) -> tuple[list[str], list[str], list[str]]:
    """State names, ``param_dict`` keys and ``state_dict`` keys of a fresh model."""
    model = eval(build, vars(dec))  # noqa: S307
    _, states = model.functionalize()
    return (
        sorted(states),
        sorted(autostate.param_dict(model)),
        sorted(autostate.state_dict(model)),
    )


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
def tracers_in(obj: Any, path: str = "model", seen: set[int] | None = None,
               depth: int = 0) -> list[str]:
    """Where a ``jax.core.Tracer`` sits in ``obj``: its ``__dict__`` (raw, as
    ``vars`` gives it), ``__slots__``, lists, tuples, dicts, sets and
    closures, recursively."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 14:
        return []
    seen.add(id(obj))
    if isinstance(obj, jax.core.Tracer):
        return [path]
    if obj is None or isinstance(
        obj, jax.Array | np.ndarray | str | bytes | int | float | type | BaseException
        | types.ModuleType
    ):
        return []
    found: list[str] = []
    if isinstance(obj, list | tuple | set | frozenset):
        for i, v in enumerate(obj):
            found += tracers_in(v, f"{path}[{i}]", seen, depth + 1)
        return found
    if isinstance(obj, dict):
        for k, v in obj.items():
            found += tracers_in(v, f"{path}[{k!r}]", seen, depth + 1)
        return found
    if isinstance(obj, types.FunctionType):
        for i, cell in enumerate(obj.__closure__ or ()):
            try:
                found += tracers_in(cell.cell_contents, f"{path}<cell {i}>", seen, depth + 1)
            except ValueError:
                pass
        return found
    if isinstance(obj, types.MethodType):
        return tracers_in(obj.__self__, f"{path}.__self__", seen, depth + 1)
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict):
        for k, v in d.items():
            found += tracers_in(v, f"{path}.{k}", seen, depth + 1)
    for klass in type(obj).__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for k in (slots,) if isinstance(slots, str) else slots:
            try:
                v = getattr(obj, k)
            except Exception:  # noqa: BLE001 - an unset slot, or a read that refuses
                continue
            found += tracers_in(v, f"{path}.{k}", seen, depth + 1)
    return found

def no_tracers(*objs: Any) -> None:
    for obj in objs:
        where = tracers_in(obj)
        assert not where, f"tracers left at {where}"


# --- Typed comparisons: dtype, weak type and bits, not only values ---------


def is_key(v: Any) -> bool:
    return isinstance(v, jax.Array) and jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key)


def _zero_folded_bytes(a: np.ndarray) -> bytes:
    """The array's bytes, with -0.0 read as 0.0 (XLA folds ``x + 0`` under jit)."""
    if a.dtype.kind in "fc" or a.dtype.name == "bfloat16":
        a = np.where(a == 0, np.zeros_like(a), a)
    return a.tobytes()


def typed(v: Any, depth: int = 0) -> Any:
    """A value as a comparable structure that keeps dtype, weak type and bits."""
    if depth > 8:
        return "<deep>"
    if is_key(v):
        return ("key", str(v.dtype), v.shape, np.asarray(jax.random.key_data(v)).tobytes())
    if isinstance(v, jax.Array):
        return ("arr", str(v.dtype), bool(v.weak_type), v.shape, _zero_folded_bytes(np.asarray(v)))
    if isinstance(v, np.ndarray | np.generic):
        a = np.asarray(v)
        return ("arr", str(a.dtype), False, a.shape, _zero_folded_bytes(a))
    if isinstance(v, bool | int | str | type(None)):
        return (type(v).__name__, v)
    if isinstance(v, float | complex):
        return ("py" + type(v).__name__, v)
    if isinstance(v, dict):
        return (type(v).__name__, [("item", k, typed(x, depth + 1)) for k, x in v.items()])
    if isinstance(v, list | tuple):
        return (type(v).__name__, [typed(x, depth + 1) for x in v])
    if hasattr(v, "__dict__") and type(v).__module__.startswith("autostate_testmod"):
        return (
            type(v).__name__,
            [("item", k, typed(getattr(v, k), depth + 1)) for k in sorted(vars(v))],
        )
    return ("obj", type(v).__name__)


def assert_typed(
    expected: Any,
    got: Any,
    where: str = "",
    jitted: bool = False,
    output: bool = False,
    exact: bool = True,
) -> None:
    """Same structure, types, dtypes, weak types, shapes and bits.

    ``jitted``: Python floats / complex numbers may have crossed a jit boundary,
    where JAX makes them weak-typed 0-d arrays; both sides are compared so.
    ``output``: the value is what a jitted function returned, where a Python int or
    bool is an array too (a static state stays a Python value).
    ``exact=False``: floating values within 1e-6 (a fused program may round
    differently), everything else still exact.
    """
    e, g = typed(expected), typed(got)
    if jitted:
        kinds = ("pyfloat", "pycomplex", "int", "bool") if output else ("pyfloat", "pycomplex")
        e, g = _as_jitted(e, kinds), _as_jitted(g, kinds)
    if not exact:
        e_vals: list[Any] = []
        g_vals: list[Any] = []
        e, g = _floats_out(e, e_vals), _floats_out(g, g_vals)
        assert e == g, f"{where}:\n expected {e}\n      got {g}"
        for a, b in zip(e_vals, g_vals):
            np.testing.assert_allclose(a, b, **tolerance(1e-6, 1e-6), err_msg=where)
        return
    assert e == g, f"{where}:\n expected {e}\n      got {g}"


def _floats_out(t: Any, vals: list[Any]) -> Any:
    """``t`` with each float array's bytes replaced by a marker, the values in ``vals``."""
    if t[0] == "arr" and jnp.issubdtype(jnp.dtype(t[1]), jnp.inexact):
        vals.append(np.frombuffer(t[4], jnp.dtype(t[1])).astype(np.complex128))
        return t[:4]
    if t[0] == "item":
        return ("item", t[1], _floats_out(t[2], vals))
    if len(t) == 2 and isinstance(t[1], list):
        return (t[0], [_floats_out(x, vals) for x in t[1]])
    return t


def _as_jitted(t: Any, kinds: tuple[str, ...]) -> Any:
    if t[0] in kinds:
        return typed(jnp.asarray(t[1]))
    if t[0] == "item":
        return ("item", t[1], _as_jitted(t[2], kinds))
    if len(t) == 2 and isinstance(t[1], list):
        return (t[0], [_as_jitted(x, kinds) for x in t[1]])
    return t


def attrs(model: Any) -> dict[str, Any]:
    """Every attribute of a model, read with getattr (values, never slots)."""
    return {k: getattr(model, k) for k in sorted(vars(model))}


def jit_counted(fn: Callable[..., Any]) -> tuple[Callable[..., Any], list[int]]:
    """``jax.jit(fn)`` and a list that grows by one per trace."""
    traces: list[int] = []

    def traced(*a: Any) -> Any:
        traces.append(1)
        return fn(*a)

    return staged(traced), traces


def no_handler_left() -> None:
    """Nothing of a call outlives it: no handler running, no instance guarded."""
    assert not _engine.handler_running(), "a handler is still running after the call"
    assert not _local_state._BODY_INSTANCES.get(), "instances are still guarded after the call"


def train_compare(
    plain: types.ModuleType,
    dec: types.ModuleType,
    build: str,
    xs: Any,
    loss_fn: Callable[[Any, Callable[[str], Any]], Any],
    lr: float = 0.1,
    method: str = "__call__",
) -> None:
    """SGD over ``xs``: plain model stepped in Python vs ``lax.scan`` over ``(f, states)``."""
    model = eval(build, vars(dec))  # noqa: S307
    f0, states0 = model.functionalize()
    pnames = sorted(autostate.param_dict(f0))
    ref = eval(build, vars(plain))  # noqa: S307
    ref_losses = []
    for i in range(len(jax.tree_util.tree_leaves(xs)[0])):
        x = jax.tree_util.tree_map(lambda a, i=i: a[i], xs)
        params = {k: plain_path(ref, k) for k in pnames}

        def loss(params: dict[str, Any], x: Any = x) -> Any:
            m = copy.deepcopy(ref)
            for k, v in params.items():
                plain_set(m, k, v)
            out = getattr(m, method)(x)
            return loss_fn(out, lambda k: plain_path(m, k)), {k: plain_path(m, k) for k in states0}

        (val, st), g = jax.value_and_grad(loss, has_aux=True)(params)
        for k in pnames:
            plain_set(ref, k, params[k] - lr * g[k])
        for k, v in st.items():
            plain_set(ref, k, v)
        ref_losses.append(val)

    def step(carry: Any, x: Any) -> Any:
        f, s = carry

        def loss(f: Any) -> Any:
            out, s2 = (f if method == "__call__" else getattr(f, method))(s, x)
            return loss_fn(out, lambda k: s2[k]), s2

        (val, s2), g = jax.value_and_grad(loss, has_aux=True)(f)
        return (jax.tree_util.tree_map(lambda p, d: p - lr * d, f, g), s2), val

    for run in (staged(jax.lax.scan, static_argnums=0),):
        (f, s), losses = run(step, (f0, states0), xs)
        assert_same(np.stack(ref_losses), losses, "losses")
        got = autostate.param_dict(f)
        for k in pnames:
            assert_same(np.asarray(plain_path(ref, k)), got[k], f"param {k}")
        for k in s:
            assert_same(snapshot(plain_path(ref, k)), snapshot(s[k]), f"state {k}")
        assert_same(snapshot(ref), snapshot(autostate.freeze(f, s)), "frozen")
