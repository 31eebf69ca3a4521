"""Differential bug hunt, second round: object protocol, dtypes, f variants, serialization.

Every source below is written twice with ``write_module``: once as plain
Python (``@DECORATE`` removed, ``STATE(v, ...)`` is ``v``) and once with
``@autostate.stateful``. The plain run is the reference; the decorated one
must mean the same eagerly, through ``f(states, ...)``, under ``jax.jit`` and
after ``autostate.freeze``. Cases that fail because autostate misbehaves are
``xfail(strict=True, reason="BUG: ...")``; documented limitations assert the
documented error.
"""

from __future__ import annotations

import collections
import gc
import pickle
import sys
import types
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autostate
from autostate import errors

Loader = Callable[..., types.ModuleType]
Call = tuple[str, tuple[Any, ...]]

HEADER = """
from __future__ import annotations
import collections
import enum
import weakref
from typing import NamedTuple
import jax
import jax.numpy as jnp
import numpy as np
import autostate
"""

_PAIRS: dict[str, tuple[types.ModuleType, types.ModuleType]] = {}


def pair(write_module: Loader, source: str) -> tuple[types.ModuleType, types.ModuleType]:
    """The source as plain Python and decorated, built once per source text."""
    if source not in _PAIRS:
        plain = write_module(
            HEADER + "STATE = lambda v, **kw: v\n" + source.replace("@DECORATE", "")
        )
        dec = write_module(
            HEADER + "STATE = autostate.state\n"
            + source.replace("@DECORATE", "@autostate.stateful")
        )
        _PAIRS[source] = (plain, dec)
    for mod in _PAIRS[source]:
        sys.modules[mod.__name__] = mod  # pickling by reference, in later tests too
    return _PAIRS[source]


def snapshot(obj: Any, depth: int = 0) -> Any:
    """Every attribute of a (plain or decorated) model, read with getattr."""
    if depth > 6:
        return "<deep>"
    if isinstance(obj, list | tuple):
        return [snapshot(v, depth + 1) for v in obj]
    if isinstance(obj, dict):
        return {k: snapshot(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, jax.Array | np.ndarray | np.generic):
        if jax.dtypes.issubdtype(obj.dtype, jax.dtypes.prng_key):
            return np.asarray(jax.random.key_data(obj))
        return np.asarray(obj)
    if isinstance(obj, bool | int | float | complex | str | type(None)):
        return obj
    if hasattr(obj, "__dict__") and type(obj).__module__.startswith("autostate_testmod"):
        return {
            "__class__": type(obj).__name__,
            **{k: snapshot(getattr(obj, k), depth + 1) for k in sorted(vars(obj))
               if not k.startswith("_ref")},
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
        assert len(expected) == len(got), f"{where}: lengths differ"
        for i, (a, b) in enumerate(zip(expected, got)):
            assert_same(a, b, f"{where}[{i}]")
        return
    if isinstance(expected, str) or expected is None:
        assert expected == got, f"{where}: {expected!r} != {got!r}"
        return
    a, b = np.asarray(expected), np.asarray(got)
    assert a.shape == b.shape, f"{where}: shape {a.shape} != {b.shape}"
    if np.iscomplexobj(a) or np.iscomplexobj(b):
        np.testing.assert_allclose(a.astype(np.complex128), b.astype(np.complex128), rtol=1e-5,
                                   err_msg=where)
        return
    np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=1e-3, atol=1e-6,
                               err_msg=where)


def _fcall(f: Any, name: str) -> Callable[..., Any]:
    return f if name == "__call__" else getattr(f, name)


def plain_path(model: Any, key: str) -> Any:
    return eval("m." + key, {"m": model})  # noqa: S307


def check(
    plain: types.ModuleType,
    dec: types.ModuleType,
    build: str,
    calls: Sequence[Call],
    modes: Sequence[str] = ("eager", "f", "jit", "freeze"),
) -> None:
    """Runs ``calls`` on a plain and a decorated model built by ``build``."""
    ref = eval(build, vars(plain))  # noqa: S307
    expected = [getattr(ref, m)(*a) for m, a in calls]
    expected_snap = snapshot(ref)
    if "eager" in modes:
        model = eval(build, vars(dec))  # noqa: S307
        got = [getattr(model, m)(*a) for m, a in calls]
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
                    jitted[m] = jax.jit(lambda f, s, *a, m=m: _fcall(f, m)(s, *a))
                out, states = jitted[m](f, states, *a)
            got.append(out)
        assert_same(expected, got, f"{mode} outputs")
        for key, value in states.items():
            assert_same(snapshot(plain_path(ref, key)), snapshot(value), f"{mode} state {key}")
        assert_same(before, snapshot(model), f"{mode}: the eager model changed")
        if mode == "jit" and "freeze" in modes:
            frozen = autostate.freeze(f, states)
            assert_same(expected_snap, snapshot(frozen), "frozen attributes")


# ======================================================================================
# Python object protocol on decorated instances
# ======================================================================================

PROTO = """
@DECORATE
class Acc:
    k = 5.0

    def __init__(self, n=2):
        self.w = jnp.ones(n)
        self.n = jnp.zeros(n)
        self.k = jnp.zeros(())
        self.tag = "acc"

    def __call__(self, x):
        self.n = self.n + x * self.w
        self.k = self.k + 1
        return self.n.sum() + self.k

    def same(self, v):
        self.n = v
        return self.n is v

    def reset(self):
        self.__init__(self.n.shape[0])
        return self.n


@DECORATE
class Leaf:
    def __init__(self):
        self.n = jnp.zeros(())
        self.w = jnp.ones(())

    def __call__(self, x):
        self.n = self.n + x * self.w
        return self.n


@DECORATE
class Host:
    def __init__(self):
        self.n = jnp.zeros(())

    def call_extra(self, x):
        self.n = self.n + x
        return self.extra(x) + self.n

    def use_param(self, x):
        self.n = self.n + (x * self.added).sum()
        return self.n


@DECORATE
class Made:
    count = 0

    def __new__(cls, *args, **kwargs):
        obj = super().__new__(cls)
        obj.created = "yes"
        Made.count += 1
        return obj

    def __init__(self, scale):
        self.scale = scale
        self.n = jnp.zeros(())

    def __call__(self, x):
        self.n = self.n + x * self.scale
        return self.n


@DECORATE
class Base:
    def __init__(self):
        self.__v = jnp.zeros(())
        self.w = jnp.ones(())

    def bump(self):
        self.__v = self.__v + self.w
        return self.__v


class Sub(Base):
    def __init__(self):
        super().__init__()
        self.__v = jnp.full((), 10.0)

    def bump2(self):
        self.__v = self.__v * 2
        return self.__v + self._Base__v


class Fast(Leaf):
    def __call__(self, x):
        self.n = self.n + 100 * x
        return self.n


@DECORATE
class Buf:
    def __init__(self, n):
        self.items = jnp.zeros(n)
        self.pos = jnp.zeros((), jnp.int32)
        self.hits = jnp.zeros(())

    def __repr__(self):
        return f"Buf(n={len(self)})"

    def __len__(self):
        return self.items.shape[0]

    def __getitem__(self, i):
        return self.items[i]

    def __setitem__(self, i, v):
        self.items = self.items.at[i].set(v)

    def __iter__(self):
        return iter([self.items[i] for i in range(len(self))])

    def __iadd__(self, v):
        self.items = self.items + v
        return self

    def __add__(self, v):
        return self.items + v

    def __enter__(self):
        self.hits = self.hits + 1
        return self

    def __exit__(self, *exc):
        self.hits = self.hits * 10
        return False

    def push(self, v):
        self[self.pos] = v
        self.pos = self.pos + 1
        with self:
            s = sum(self)
        other = self
        other += 1.0
        return s + len(self) + self[0] + (self + 1.0).sum()

    def describe(self):
        return repr(self)


@DECORATE
class Kid:
    def __init__(self, parent):
        self._parent = weakref.ref(parent)
        self.n = jnp.zeros(())

    def __call__(self, x):
        self.n = self.n + x
        return self._parent().total + self.n


@DECORATE
class Par:
    def __init__(self):
        self.total = jnp.zeros(())
        self.kid = Kid(self)

    def __call__(self, x):
        self.total = self.total + 10 * x
        return self.kid(x)
"""


def test_hasattr_getattr_setattr_from_outside(write_module: Loader) -> None:
    plain, dec = pair(write_module, PROTO)
    for mod in (plain, dec):
        m = mod.Acc()
        m(1.0)
        assert hasattr(m, "n") and hasattr(m, "w") and not hasattr(m, "missing")
        assert getattr(m, "missing", 7) == 7
        setattr(m, "n", jnp.full(2, 3.0))  # noqa: B010
        setattr(m, "w", jnp.full(2, 2.0))  # noqa: B010
    p, d = plain.Acc(), dec.Acc()
    for m in (p, d):
        setattr(m, "n", jnp.full(2, 3.0))  # noqa: B010
        setattr(m, "w", jnp.full(2, 2.0))  # noqa: B010
        m(1.0)
    assert_same(snapshot(p), snapshot(d))
    assert_same(getattr(p, "n", None), getattr(d, "n", None))


def test_dir_and_vars_keys_match_plain(write_module: Loader) -> None:
    plain, dec = pair(write_module, PROTO)
    p, d = plain.Acc(), dec.Acc()
    p(1.0)
    d(1.0)
    assert sorted(vars(p)) == sorted(vars(d))
    public = {n for n in dir(p) if not n.startswith("_")}
    assert public <= set(dir(d))


def test_identity_after_assignment(write_module: Loader) -> None:
    plain, dec = pair(write_module, PROTO)
    v = jnp.arange(2.0)
    for mod in (plain, dec):
        m = mod.Acc()
        m.n = v
        assert m.n is v
        assert m.same(v) is True
    f, states = dec.Acc().functionalize()
    out, states = f.same(states, v)
    assert out is True
    assert states["n"] is v


def test_isinstance_type_and_class_on_model_f_model_and_frozen(write_module: Loader) -> None:
    _, dec = pair(write_module, PROTO)
    m = dec.Acc()
    f, states = m.functionalize()
    frozen = autostate.freeze(f, states)
    for obj in (m, f.model, frozen):
        assert type(obj) is dec.Acc
        assert obj.__class__ is dec.Acc
        assert isinstance(obj, dec.Acc)


def test_weakref_to_model(write_module: Loader) -> None:
    _, dec = pair(write_module, PROTO)
    m = dec.Acc()
    r = weakref.ref(m)
    assert r() is m
    f, states = m.functionalize()
    del m
    gc.collect()
    assert r() is None  # f does not keep the original alive
    out, _ = f(states, 1.0)
    assert float(out) == 3.0


def test_default_eq_and_hash_are_identity(write_module: Loader) -> None:
    plain, dec = pair(write_module, PROTO)
    for mod in (plain, dec):
        a, b = mod.Acc(), mod.Acc()
        h = hash(a)
        a(1.0)
        assert hash(a) == h
        assert a == a and a != b and not (a == b)
        assert len({a, b, a}) == 2
        assert {a: 1}[a] == 1
    assert dec.Acc.__eq__ is object.__eq__


def test_class_attribute_shadowed_by_instance_state(write_module: Loader) -> None:
    plain, dec = pair(write_module, PROTO)
    for mod in (plain, dec):
        a, b = mod.Acc(), mod.Acc()
        a(1.0)
        a(1.0)
        assert mod.Acc.k == 5.0
        assert float(a.k) == 2.0 and float(b.k) == 0.0
    check(plain, dec, "Acc()", [("__call__", (1.0,)), ("__call__", (2.0,))])


def test_param_added_from_outside_after_construction(write_module: Loader) -> None:
    plain, dec = pair(write_module, PROTO)
    p, d = plain.Host(), dec.Host()
    for m in (p, d):
        m.added = jnp.arange(3.0)
    expected = [p.use_param(1.0), p.use_param(2.0)]
    assert "added" in autostate.param_dict(d)
    f, states = d.functionalize()
    got = []
    for x in (1.0, 2.0):
        out, states = jax.jit(lambda f, s, x: f.use_param(s, x))(f, states, x)
        got.append(out)
    assert_same(expected, got)
    g = jax.grad(lambda f: f.use_param(states, 1.0)[0])(f)
    assert_same(np.ones(3), g.model.added)


def test_sub_model_added_from_outside_after_construction(write_module: Loader) -> None:
    plain, dec = pair(write_module, PROTO)
    p, d = plain.Host(), dec.Host()
    p.extra = plain.Leaf()
    d.extra = dec.Leaf()
    expected = [p.call_extra(1.0), p.call_extra(2.0)]
    f, states = d.functionalize()
    assert sorted(states) == ["extra.n", "n"]
    got = []
    for x in (1.0, 2.0):
        out, states = jax.jit(f.call_extra)(states, x)
        got.append(out)
    assert_same(expected, got)
    assert_same(snapshot(p.extra.n), states["extra.n"])


def test_delete_parameter_and_state_from_outside(write_module: Loader) -> None:
    plain, dec = pair(write_module, PROTO)
    p, d = plain.Acc(), dec.Acc()
    del p.tag
    del d.tag
    assert not hasattr(p, "tag") and not hasattr(d, "tag")
    del p.n
    with pytest.raises(errors.StateAccessError, match="Cannot delete state 'n'"):
        del d.n
    assert hasattr(d, "n")  # refused: the state is still there


def test_init_called_twice_resets(write_module: Loader) -> None:
    plain, dec = pair(write_module, PROTO)
    check(plain, dec, "Acc()", [("__call__", (1.0,)), ("reset", ()), ("__call__", (2.0,))],
          modes=("eager",))
    for mod in (plain, dec):
        m = mod.Acc()
        m(1.0)
        m.__init__(3)
        assert m.n.shape == (3,)
    m = dec.Acc()
    m(1.0)
    m.__init__(3)
    f, states = m.functionalize()
    assert states["n"].shape == (3,)
    out, _ = jax.jit(f)(states, 1.0)
    assert float(out) == 4.0


def test_new_override(write_module: Loader) -> None:
    plain, dec = pair(write_module, PROTO)
    check(plain, dec, "Made(2.0)", [("__call__", (1.0,)), ("__call__", (1.0,))])
    m = dec.Made(2.0)
    f, states = m.functionalize()
    assert f.model.created == "yes"
    frozen = autostate.freeze(f, states)
    assert frozen.created == "yes"
    again = pickle.loads(pickle.dumps(m))
    assert again.created == "yes" and float(again(1.0)) == 2.0


def test_name_mangling_across_an_auto_decorated_subclass(write_module: Loader) -> None:
    plain, dec = pair(write_module, PROTO)
    check(plain, dec, "Sub()", [("bump", ()), ("bump2", ()), ("bump", ()), ("bump2", ())])
    assert sorted(dec.Sub().functionalize()[1]) == ["_Base__v", "_Sub__v"]


def test_class_reassignment_to_a_subclass(write_module: Loader) -> None:
    plain, dec = pair(write_module, PROTO)
    p, d = plain.Leaf(), dec.Leaf()
    for m, mod in ((p, plain), (d, dec)):
        m(1.0)
        m.__class__ = mod.Fast
    expected = [p(1.0), p(2.0)]
    f, states = d.functionalize()
    assert type(f.model) is dec.Fast
    got = []
    for x in (1.0, 2.0):
        out, states = jax.jit(f)(states, x)
        got.append(out)
    assert_same(expected, got)


def test_user_dunder_protocol_methods(write_module: Loader) -> None:
    plain, dec = pair(write_module, PROTO)
    check(plain, dec, "Buf(3)", [("push", (2.0,)), ("push", (3.0,))])
    f, states = dec.Buf(3).functionalize()
    assert f.describe(states)[0] == "Buf(n=3)"
    p, d = plain.Buf(3), dec.Buf(3)
    for m in (p, d):
        m += 1.0
        m[1] = 5.0
    assert_same(snapshot(p), snapshot(d))
    assert repr(p) == repr(d) == str(d) == "Buf(n=3)"
    assert len(d) == 3
    assert_same(list(p), list(d))


def test_augmented_assignment_to_self_is_a_documented_decoration_error(
    write_module: Loader,
) -> None:
    source = PROTO.replace("        other = self\n        other += 1.0\n", "        self += 1.0\n")
    with pytest.raises(errors.DecorationError, match="receiver `self` is rebound") as err:
        pair(write_module, source)
    assert ".py:" in str(err.value)


def test_dunder_method_through_f(write_module: Loader) -> None:
    plain, dec = pair(write_module, PROTO)
    p = plain.Buf(3)
    p[0] = 9.0
    f, states = dec.Buf(3).functionalize()
    try:
        _, states = f.__setitem__(states, 0, 9.0)
    except autostate.AutostateError:
        return  # a clear refusal would do
    assert_same(p.items, states["items"])


def test_weakref_to_parent_in_a_sub_model(write_module: Loader) -> None:
    plain, dec = pair(write_module, PROTO)
    p = plain.Par()
    expected = [p(1.0), p(1.0)]
    model = dec.Par()
    assert_same(expected, [model(1.0), model(1.0)], "eager")
    model = dec.Par()
    try:
        f, states = model.functionalize()
    except autostate.AutostateError:
        return  # refusing it (like a plain object holding the model) would do
    got = []
    for _ in range(2):
        out, states = f(states, 1.0)
        got.append(out)
    assert_same(expected, got, "f")


# ======================================================================================
# Dtypes and values
# ======================================================================================

DTYPES = """
class Pt(NamedTuple):
    a: jax.Array
    b: jax.Array


class Mode(enum.Enum):
    A = 1
    B = 2


@DECORATE
class Typed:
    def __init__(self, dtype):
        self.x = jnp.zeros(3, dtype)
        self.dtype = dtype

    def step(self, v):
        self.x = self.x + jnp.asarray(v).astype(self.dtype)
        self.x = self.x.at[0].set(self.x[1] * 2)
        return self.x


@DECORATE
class Py:
    def __init__(self):
        self.fl = 1.5
        self.cx = 1 + 2j
        self.i = 3
        self.b = True
        self.w = jnp.ones(())

    def step(self, x):
        self.fl = self.fl * 2 + x
        self.cx = self.cx * 1j
        return self.fl * self.w + self.i * self.b

    def bump_int(self):
        self.i = self.i + 1

    def flip(self):
        self.b = not self.b


@DECORATE
class Np:
    def __init__(self):
        self.arr = np.ones(2, np.float32)
        self.sc = np.float32(2.0)
        self.ints = np.arange(3)
        self.lst = [np.zeros(1), {"k": np.ones(1)}]

    def step(self, x):
        self.arr = self.arr + x
        self.sc = self.sc * 2
        self.ints = self.ints + 1
        self.lst = [self.lst[0] + x, {"k": self.lst[1]["k"] * 2}]
        return self.arr.sum() + self.sc


@DECORATE
class Strs:
    def __init__(self):
        self.labels = np.array(["a", "b"])
        self.n = jnp.zeros(())

    def __call__(self, x):
        self.n = self.n + x
        self.labels = self.labels
        return self.n


@DECORATE
class Trees:
    def __init__(self):
        self.pt = Pt(jnp.zeros(2), jnp.ones(2))
        self.nested = {"a": [jnp.zeros(1), (jnp.zeros(1), {"z": jnp.ones(1)})]}
        self.empty_l = []
        self.empty_t = ()
        self.empty_d = {}
        self.t = (jnp.zeros(()), jnp.ones(()))

    def step(self, x):
        self.pt = self.pt._replace(a=self.pt.a + x)
        inner = self.nested["a"][1]
        self.nested = {"a": [self.nested["a"][0] * 2, (inner[0] + x, {"z": inner[1]["z"] * x})]}
        self.empty_l = []
        self.empty_t = ()
        self.empty_d = {}
        return self.pt.a.sum() + self.nested["a"][1][1]["z"].sum()

    def tolist(self):
        self.t = list(self.t)
        return self.t[1]

    def grow(self, x):
        self.t = tuple(self.t) + (x,)
        return sum(self.t)


@DECORATE
class Static:
    def __init__(self):
        self.mode = Mode.A
        self.name = "x"
        self.w = jnp.ones(())

    def set_b(self):
        self.mode = Mode.B

    def same(self):
        self.mode = Mode.A
        self.name = "x"
        return self.w

    def __call__(self, x):
        return x * self.w * (2.0 if self.mode is Mode.A else 3.0) + len(self.name)


@DECORATE
class Keys:
    def __init__(self, seed):
        self.key = jax.random.key(seed)
        self.raw = jax.random.PRNGKey(seed + 1)
        self.acc = jnp.zeros(())

    def __call__(self, x):
        self.key, sub = jax.random.split(self.key)
        self.raw, sub2 = jax.random.split(self.raw)
        self.acc = self.acc + jax.random.normal(sub, ()) + jax.random.uniform(sub2, ()) * x
        return self.acc


@DECORATE
class Ordered:
    def __init__(self):
        self.d = {"b": jnp.zeros(()), "a": jnp.ones(())}
        self.ik = {2: jnp.zeros(()), 1: jnp.ones(())}

    def first(self, x):
        self.d = {k: v + x for k, v in self.d.items()}
        return list(self.d.values())[0] + list(self.ik.values())[0] * 10

    def touch(self):
        self.ik = dict(self.ik)


@DECORATE
class Typed2:
    def __init__(self):
        self.od = collections.OrderedDict(b=jnp.zeros(()), a=jnp.ones(()))
        self.dd = collections.defaultdict(lambda: jnp.zeros(()))
        self.dd["x"] = jnp.ones(())

    def put(self, k, v):
        self.od[k] = v
        self.dd[k] += v
        return self.dd[k]
"""

DTYPE_NAMES = ["int8", "uint8", "int16", "float16", "bfloat16", "int32", "bool"]


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_small_dtype_states(write_module: Loader, dtype: str) -> None:
    plain, dec = pair(write_module, DTYPES)
    dt = jnp.dtype(dtype)
    v = 1 if dtype != "bool" else True
    check(plain, dec, f"Typed(jnp.{dtype})", [("step", (v,)), ("step", (v,)), ("step", (v,))])
    f, states = dec.Typed(dt).functionalize()
    for _ in range(2):
        _, states = jax.jit(f.step)(states, v)
        assert states["x"].dtype == dt


def test_int8_wraps_like_plain(write_module: Loader) -> None:
    plain, dec = pair(write_module, DTYPES)
    check(plain, dec, "Typed(jnp.int8)", [("step", (100,)), ("step", (100,))])


def test_python_float_and_complex_states(write_module: Loader) -> None:
    plain, dec = pair(write_module, DTYPES)
    check(plain, dec, "Py()", [("step", (1.0,)), ("step", (0.5,))])
    f, states = dec.Py().functionalize()
    assert sorted(states) == ["cx", "fl"]  # int and bool are static
    assert isinstance(states["fl"], float) and isinstance(states["cx"], complex)
    out, states = f.step(states, 1.0)
    assert_same(plain.Py().step(1.0), out)


@pytest.mark.parametrize("method", ["bump_int", "flip"])
def test_python_int_and_bool_states_are_static_inside_f(write_module: Loader, method: str) -> None:
    plain, dec = pair(write_module, DTYPES)
    check(plain, dec, "Py()", [(method, ()), ("step", (1.0,))], modes=("eager",))
    f, states = dec.Py().functionalize()
    with pytest.raises(errors.StaticStateError):
        getattr(f, method)(states)
    # set eagerly, then functionalize: the new value is f's structure
    m = dec.Py()
    getattr(m, method)()
    p = plain.Py()
    getattr(p, method)()
    f, states = m.functionalize()
    out, _ = jax.jit(f.step)(states, 1.0)
    assert_same(p.step(1.0), out)


def test_numpy_states_become_jax_arrays_as_documented(write_module: Loader) -> None:
    _, dec = pair(write_module, DTYPES)
    m = dec.Np()
    for v in (m.arr, m.sc, m.ints, m.lst[0], m.lst[1]["k"]):
        assert isinstance(v, jax.Array)
    assert m.sc.dtype == jnp.float32
    m.arr = np.zeros(2)
    assert isinstance(m.arr, jax.Array)
    m.step(1.0)
    f, states = dec.Np().functionalize()
    eager = dec.Np()
    expected = [eager.step(1.0), eager.step(2.0)]
    got = []
    for x in (1.0, 2.0):
        out, states = jax.jit(f.step)(states, x)
        got.append(out)
    assert_same(expected, got)
    assert_same(snapshot(eager.lst), snapshot(states["lst"]))
    assert states["ints"].dtype == eager.ints.dtype


def test_numpy_string_array_state(write_module: Loader) -> None:
    plain, dec = pair(write_module, DTYPES)
    try:
        check(plain, dec, "Strs()", [("__call__", (1.0,))], modes=("eager",))
    except autostate.AutostateError as err:
        assert "labels" in str(err)  # a clear refusal naming the attribute would do


def test_namedtuple_nested_and_empty_containers(write_module: Loader) -> None:
    plain, dec = pair(write_module, DTYPES)
    check(plain, dec, "Trees()", [("step", (1.0,)), ("step", (2.0,))])
    f, states = dec.Trees().functionalize()
    _, states = jax.jit(f.step)(states, 1.0)
    assert type(states["pt"]).__name__ == "Pt"
    frozen = autostate.freeze(f, states)
    assert type(frozen.pt) is dec.Pt
    assert frozen.empty_l == [] and frozen.empty_t == () and frozen.empty_d == {}


@pytest.mark.parametrize("method,arg", [("tolist", ()), ("grow", (1.0,))])
def test_state_structure_changes_between_calls(
    write_module: Loader, method: str, arg: tuple[Any, ...]
) -> None:
    plain, dec = pair(write_module, DTYPES)
    check(plain, dec, "Trees()", [(method, arg)])
    m = dec.Trees()
    getattr(m, method)(*arg)
    p = plain.Trees()
    getattr(p, method)(*arg)
    assert type(m.t) is type(p.t) and len(m.t) == len(p.t)


def test_enum_and_string_static_states(write_module: Loader) -> None:
    plain, dec = pair(write_module, DTYPES)
    check(plain, dec, "Static()", [("same", ()), ("__call__", (2.0,))])
    f, states = dec.Static().functionalize()
    assert states == {}
    with pytest.raises(errors.StaticStateError, match="mode"):
        f.set_b(states)
    out, _ = f(states, 1.0)  # f still usable after the refusal
    assert float(out) == 3.0
    m, p = dec.Static(), plain.Static()
    m.set_b()
    p.set_b()
    f, states = m.functionalize()
    assert_same(p(2.0), jax.jit(f)(states, 2.0)[0])
    assert autostate.freeze(f, states).mode is dec.Mode.B


def test_prng_key_states(write_module: Loader) -> None:
    plain, dec = pair(write_module, DTYPES)
    check(plain, dec, "Keys(0)", [("__call__", (1.0,)), ("__call__", (2.0,))])
    f, states = dec.Keys(0).functionalize()
    assert jax.dtypes.issubdtype(states["key"].dtype, jax.dtypes.prng_key)


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


# ======================================================================================
# functionalize variants
# ======================================================================================

VARIANTS = """
@DECORATE
class Mixed:
    def __init__(self):
        self.w = jnp.ones(2)
        self.n = jnp.zeros(2)
        self.kv = STATE(jnp.zeros(2), category="cache")

    def __call__(self, x):
        self.n = self.n + x
        self.kv = self.kv + 2 * x
        return (self.n * self.w + self.kv).sum()

    def only_cache(self, x):
        self.kv = self.kv * self.w + x
        return self.kv.sum()

    def fail(self, x, boom):
        self.n = self.n + x
        if boom:
            raise ValueError("boom")
        return self.n.sum()

    def bad_shape(self, x):
        self.n = self.n + x
        return self.n @ jnp.ones(3)


@DECORATE
class Inner:
    def __init__(self):
        self.w = jnp.ones(2)
        self.n = jnp.zeros(2)

    def __call__(self, x):
        self.n = self.n + x
        return (self.n * self.w).sum()


@DECORATE
class Outer:
    def __init__(self):
        self.inner = Inner()
        self.m = jnp.zeros(())

    def __call__(self, x):
        g, s = self.inner.functionalize()
        out, s = g(s, x)
        self.m = self.m + out
        return self.m


@DECORATE
class Tied:
    def __init__(self, shared):
        self.shared = shared
        self.own = jnp.zeros(())

    def __call__(self, x):
        self.own = self.own + x
        return self.shared(x) + self.own


@DECORATE
class Two:
    def __init__(self):
        s = Inner()
        self.p = Tied(s)
        self.q = Tied(s)
        self.alias = s

    def __call__(self, x):
        return self.p(x) + self.q(2 * x) + self.alias.n.sum()
"""


def test_category_subset(write_module: Loader) -> None:
    plain, dec = pair(write_module, VARIANTS)
    m = dec.Mixed()
    f, states = m.functionalize("cache")
    assert sorted(states) == ["kv"]
    p = plain.Mixed()
    expected = [p.only_cache(1.0), p.only_cache(2.0)]
    got = []
    for x in (1.0, 2.0):
        out, states = jax.jit(f.only_cache)(states, x)
        got.append(out)
    assert_same(expected, got)
    assert_same(p.kv, states["kv"])
    # the other category is an eager slot inside f: written under jit, a clear error
    with pytest.raises(errors.TracedEagerStateError, match="Mixed.n"):
        jax.jit(f)(states, 1.0)
    # eagerly it updates f.model in place (documented), never the original model
    _, states = f(states, 1.0)
    assert_same(np.ones(2), f.model.n)
    assert_same(np.zeros(2), m.n)
    frozen = autostate.freeze(f, states)
    assert_same(np.ones(2), frozen.n)


def test_category_predicate_and_both_arguments(write_module: Loader) -> None:
    _, dec = pair(write_module, VARIANTS)
    _, s1 = dec.Mixed().functionalize("cache")
    _, s2 = dec.Mixed().functionalize(category_predicate=lambda c: c == "cache")
    assert sorted(s1) == sorted(s2) == ["kv"]
    with pytest.raises(errors.CategoryArgumentError):
        dec.Mixed().functionalize("cache", category_predicate=lambda c: True)


def test_freeze_then_functionalize_again_is_the_same_f(write_module: Loader) -> None:
    _, dec = pair(write_module, VARIANTS)
    f, states = dec.Mixed().functionalize()
    _, states = f(states, 1.0)
    f2, states2 = autostate.freeze(f, states).functionalize()
    assert f == f2 and hash(f) == hash(f2)
    assert_same(states, states2)
    step = jax.jit(lambda f, s, x: f(s, x))
    a = step(f, states, 1.0)
    b = step(f2, states2, 1.0)
    assert step._cache_size() == 1
    assert_same(a, b)


def test_nested_functionalize_inside_a_method(write_module: Loader) -> None:
    _, dec = pair(write_module, VARIANTS)
    o = dec.Outer()
    expected = [o(1.0), o(1.0)]
    assert_same(np.zeros(2), o.inner.n)  # the inner f works on a copy
    f, states = dec.Outer().functionalize()
    got = []
    for _ in range(2):
        out, states = f(states, 1.0)
        got.append(out)
    assert_same(expected, got)


def test_states_from_another_f_and_bad_keys(write_module: Loader) -> None:
    _, dec = pair(write_module, VARIANTS)
    fa, sa = dec.Mixed().functionalize()
    _, sb = dec.Inner().functionalize()
    with pytest.raises(errors.UnhandledLocalStateError, match="'kv' is missing"):
        fa(sb, 1.0)
    with pytest.raises(errors.UnhandledLocalStateError, match="missing"):
        jax.jit(fa)({"n": sa["n"]}, 1.0)
    with pytest.raises(errors.StateDictError, match="'zz'"):
        fa({**sa, "zz": jnp.zeros(())}, 1.0)
    with pytest.raises(errors.InvalidTypeError):
        fa(list(sa.values()), 1.0)
    out, _ = fa(sa, 1.0)  # still works
    assert float(out) == 6.0


def test_f_reused_after_exceptions(write_module: Loader) -> None:
    _, dec = pair(write_module, VARIANTS)
    f, states = dec.Mixed().functionalize()
    with pytest.raises(ValueError, match="boom"):
        f.fail(states, 1.0, True)
    with pytest.raises(ValueError, match="boom"):
        jax.jit(f.fail, static_argnums=2)(states, 1.0, True)
    with pytest.raises(TypeError):
        jax.jit(f.bad_shape)(states, 1.0)
    out, s = f.fail(states, 1.0, False)
    assert float(out) == 2.0
    out, s = jax.jit(f)(states, 1.0)
    assert float(out) == 6.0
    assert f == dec.Mixed().functionalize()[0]


def test_vmap_ensemble_over_stacked_states(write_module: Loader) -> None:
    plain, dec = pair(write_module, VARIANTS)
    f, states = dec.Mixed().functionalize()
    offsets = [0.0, 1.0, 5.0]
    stacked = jax.tree_util.tree_map(lambda v: jnp.stack([v + o for o in offsets]), states)
    outs, new = jax.jit(jax.vmap(f, in_axes=(0, None)))(stacked, 2.0)
    for i, o in enumerate(offsets):
        p = plain.Mixed()
        p.n, p.kv = p.n + o, p.kv + o
        assert_same(p(2.0), outs[i])
        assert_same(p.n, new["n"][i])
        assert_same(p.kv, new["kv"][i])


def test_lax_scan_over_f_with_prng_state(write_module: Loader) -> None:
    plain, dec = pair(write_module, DTYPES)
    xs = jnp.arange(4.0)
    p = plain.Keys(3)
    expected = [p(x) for x in xs]
    f, states = dec.Keys(3).functionalize()

    def body(s: dict[str, Any], x: jax.Array) -> tuple[dict[str, Any], jax.Array]:
        out, s = f(s, x)
        return s, out

    final, outs = jax.jit(lambda s: jax.lax.scan(body, s, xs))(states)
    assert_same(np.stack([np.asarray(e) for e in expected]), outs)
    assert_same(snapshot(p.key), snapshot(final["key"]))
    assert_same(snapshot(p.raw), snapshot(final["raw"]))


def test_grad_wrt_states_and_params(write_module: Loader) -> None:
    plain, dec = pair(write_module, VARIANTS)
    f, states = dec.Mixed().functionalize()

    def plain_loss(n: jax.Array, kv: jax.Array, w: jax.Array) -> jax.Array:
        p = plain.Mixed()
        p.n, p.kv, p.w = n, kv, w
        out = p(1.0)
        return out + (p.n ** 2).sum() + (p.kv ** 2).sum()

    def dec_loss(f: Any, s: dict[str, Any]) -> jax.Array:
        out, s = f(s, 1.0)
        return out + (s["n"] ** 2).sum() + (s["kv"] ** 2).sum()

    gn, gkv, gw = jax.grad(plain_loss, argnums=(0, 1, 2))(states["n"], states["kv"], f.model.w)
    gf, gs = jax.jit(jax.grad(dec_loss, argnums=(0, 1)))(f, states)
    assert_same(gn, gs["n"])
    assert_same(gkv, gs["kv"])
    assert_same(gw, gf.model.w)


def test_donated_states(write_module: Loader) -> None:
    """Donating the first states dict deletes the model's arrays (they are
    shared, as docs/scaling_out.md says); donating a copy keeps the model."""
    plain, dec = pair(write_module, VARIANTS)
    m = dec.Mixed()
    f, states = m.functionalize()
    states = jax.tree_util.tree_map(jnp.copy, states)
    step = jax.jit(lambda f, s, x: f(s, x), donate_argnums=1)
    p = plain.Mixed()
    for x in (1.0, 2.0):
        out, states = step(f, states, x)
        assert_same(p(x), out)
    assert_same(p.n, states["n"])
    assert_same(np.zeros(2), m.n)  # the eager model's buffers are not the donated ones
    assert float(m(1.0)) == 6.0


def test_tied_sub_model_in_two_parents(write_module: Loader) -> None:
    plain, dec = pair(write_module, VARIANTS)
    check(plain, dec, "Two()", [("__call__", (1.0,)), ("__call__", (2.0,))])
    f, states = dec.Two().functionalize()
    assert sorted(states) == ["p.own", "p.shared.n", "q.own"]
    frozen = autostate.freeze(f, states)
    assert frozen.p.shared is frozen.q.shared is frozen.alias


def test_tied_parameter_gets_one_summed_gradient(write_module: Loader) -> None:
    plain, dec = pair(write_module, VARIANTS)
    f, states = dec.Two().functionalize()

    def plain_loss(w: jax.Array) -> jax.Array:
        t = plain.Two()
        t.p.shared.w = w
        return t(1.0)

    g = jax.grad(lambda f: f(states, 1.0)[0])(f)
    assert_same(jax.grad(plain_loss)(jnp.ones(2)), g.model.p.shared.w)
    assert g.model.p.shared is g.model.q.shared


def test_one_sub_model_held_by_two_root_models(write_module: Loader) -> None:
    plain, dec = pair(write_module, VARIANTS)
    results = []
    for mod in (plain, dec):
        s = mod.Inner()
        a, b = mod.Tied(s), mod.Tied(s)
        outs = [a(1.0), b(2.0)]
        results.append((outs, snapshot(s.n)))
    assert_same(results[0], results[1])
    s = dec.Inner()
    a, b = dec.Tied(s), dec.Tied(s)
    b(2.0)
    f, states = a.functionalize()
    assert_same(np.full(2, 2.0), states["shared.n"])  # sees b's eager write
    _, states = f(states, 1.0)
    assert_same(np.full(2, 2.0), s.n)  # f never writes the shared original
    assert_same(np.full(2, 3.0), states["shared.n"])


# ======================================================================================
# Serialization
# ======================================================================================


def test_pickle_model_then_continue(write_module: Loader) -> None:
    plain, dec = pair(write_module, DTYPES)
    p, d = plain.Trees(), dec.Trees()
    p.step(1.0)
    d.step(1.0)
    d2 = pickle.loads(pickle.dumps(d))
    assert_same(p.step(2.0), d2.step(2.0))
    assert_same(snapshot(p), snapshot(d2))
    f, states = d2.functionalize()
    assert_same(p.step(3.0), jax.jit(f.step)(states, 3.0)[0])


def test_pickle_f_and_frozen_keep_aliasing(write_module: Loader) -> None:
    plain, dec = pair(write_module, VARIANTS)
    f, states = dec.Two().functionalize()
    _, states = f(states, 1.0)
    g = pickle.loads(pickle.dumps(f))
    assert g == f
    assert g.model.p.shared is g.model.q.shared
    frozen = pickle.loads(pickle.dumps(autostate.freeze(f, states)))
    assert frozen.p.shared is frozen.q.shared is frozen.alias
    p = plain.Two()
    p(1.0)
    assert_same(p(2.0), frozen(2.0))
    assert_same(snapshot(p), snapshot(frozen))


def test_pickle_f_made_by_tree_map(write_module: Loader) -> None:
    plain, dec = pair(write_module, VARIANTS)
    f, states = dec.Two().functionalize()
    h = pickle.loads(pickle.dumps(jax.tree_util.tree_map(lambda v: v * 3, f)))
    out, _ = h(states, 1.0)
    p = plain.Two()
    p.p.shared.w = p.p.shared.w * 3
    assert_same(p(1.0), out)


def test_pickle_prng_and_namedtuple_states(write_module: Loader) -> None:
    plain, dec = pair(write_module, DTYPES)
    p, d = plain.Keys(1), dec.Keys(1)
    p(1.0)
    d(1.0)
    d2 = pickle.loads(pickle.dumps(d))
    assert_same(p(2.0), d2(2.0))
    f, states = dec.Trees().functionalize()
    states2 = pickle.loads(pickle.dumps(states))
    assert type(states2["pt"]) is dec.Pt
    assert_same(f.step(states, 1.0), f.step(states2, 1.0))


def test_state_dict_round_trip_into_a_fresh_model(write_module: Loader) -> None:
    plain, dec = pair(write_module, DTYPES)
    for build in ("Trees()", "Keys(2)", "Typed(jnp.bfloat16)", "Py()"):
        d = eval(build, vars(dec))  # noqa: S307
        p = eval(build, vars(plain))  # noqa: S307
        arg = (1,) if "Typed" in build else (1.0,)
        name = "__call__" if "Keys" in build else "step"
        getattr(d, name)(*arg)
        getattr(p, name)(*arg)
        fresh = autostate.load_state_dict(eval(build, vars(dec)), autostate.state_dict(d))  # noqa: S307
        assert_same(snapshot(p), snapshot(fresh), build)
        assert_same(getattr(p, name)(*arg), getattr(fresh, name)(*arg), build)


def test_state_dict_of_f_and_mismatch(write_module: Loader) -> None:
    _, dec = pair(write_module, VARIANTS)
    f, states = dec.Mixed().functionalize()
    _, states = f(states, 1.0)
    sd = autostate.state_dict(f, states)
    assert sorted(sd) == ["kv", "n"]
    model = autostate.load_state_dict(dec.Mixed(), sd)
    assert_same(np.ones(2), model.n)
    with pytest.raises(errors.StateDictError, match="'n'"):
        autostate.load_state_dict(dec.Mixed(), {**sd, "n": jnp.ones(2, jnp.int32)})
    with pytest.raises(errors.StateDictError, match="missing"):
        autostate.load_state_dict(dec.Mixed(), {"n": sd["n"]})


def test_param_dict_round_trip(write_module: Loader) -> None:
    plain, dec = pair(write_module, VARIANTS)
    pd = autostate.param_dict(dec.Two())
    assert sorted(pd) == ["p.shared.w"]  # the tied weight appears once
    model = autostate.load_param_dict(dec.Two(), {"p.shared.w": jnp.full(2, 3.0)})
    assert model.q.shared.w is model.p.shared.w
    p = plain.Two()
    p.p.shared.w = jnp.full(2, 3.0)
    assert_same(p(1.0), model(1.0))


def test_save_load_npz_then_continue(write_module: Loader, tmp_path: Path) -> None:
    plain, dec = pair(write_module, DTYPES)
    for build, name, arg in (("Keys(4)", "__call__", 1.0), ("Trees()", "step", 1.0),
                             ("Typed(jnp.float16)", "step", 1)):
        p = eval(build, vars(plain))  # noqa: S307
        d = eval(build, vars(dec))  # noqa: S307
        getattr(p, name)(arg)
        getattr(d, name)(arg)
        path = tmp_path / "m.npz"
        autostate.save(path, d)
        loaded = autostate.load(path, like=eval(build, vars(dec)))  # noqa: S307
        assert_same(snapshot(p), snapshot(loaded), build)
        assert_same(getattr(p, name)(arg), getattr(loaded, name)(arg), build)
        params, states = autostate.load_arrays(path)
        assert sorted(states) == sorted(autostate.state_dict(d))


def test_export_round_trip_with_prng_state(write_module: Loader) -> None:
    pytest.importorskip("flatbuffers")
    plain, dec = pair(write_module, DTYPES)
    m = dec.Keys(5)
    exp = jax.export.deserialize(autostate.export(m, jnp.float32(1.0)).serialize())
    states = autostate.state_dict(m)
    p = plain.Keys(5)
    for x in (1.0, 2.0):
        out, states = exp.call(states, jnp.float32(x))
        assert_same(p(x), out)
    assert_same(snapshot(p.key), snapshot(states["key"]))
