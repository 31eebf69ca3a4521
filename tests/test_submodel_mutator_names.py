"""A method named like a container's mutator (``update``, ``add``, ``pop``,
...) on a sub-model or another object held in an attribute.

The analysis sees source, not types: ``self.ema.update(x)`` changes a
container in place only if ``ema`` holds one. It refuses the call at
decoration only where no value the class assigns to the attribute can be an
object with methods of its own: each is a container (``[]``, ``{}``,
``list(...)``, ``[[], []]`` for ``self.x[0].append``), an array or a literal
by its spelling. A sub-model or a helper object runs as in plain Python,
eagerly, through ``f``, under ``jax.jit`` and ``jax.grad``. A container
spelled otherwise is left to the run time, which threads the change through
``f`` or refuses it, never loses it silently.
"""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from differential import Loader, X, check, check_transform, pair  # noqa: I001 - tests/ is on sys.path

import autostate
from autostate import errors

A1 = jnp.asarray(1.5)
A2 = jnp.asarray(-0.5)

NAMES = ["update", "add", "pop", "clear", "append", "extend", "insert", "remove", "setdefault",
         "discard"]

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
@pytest.mark.parametrize("name", ["update", "pop", "clear"])
def test_reset_then_call_eagerly(write_module: Loader, holder: str, name: str):
    """The reassignment runs too (eagerly: inside f it would change the
    model's structure, which is refused whatever the method's name)."""
    plain, dec = pair(write_module, _source(holder, name))
    check(plain, dec, "Model()", [("__call__", (A1,)), ("reset", ()), ("__call__", (A2,))],
          modes=("eager",))
    model = dec.Model()
    model(A1)
    model.reset()
    f, states = model.functionalize()
    ref = plain.Model()
    ref(A1)
    ref.reset()
    out, states = jax.jit(lambda f, s, x: f(s, x))(f, states, A2)
    np.testing.assert_allclose(out, ref(A2), rtol=1e-6)


def test_the_sub_model_written_by_its_update_is_the_state_f_returns(write_module: Loader):
    """The bug's own model: the EMA's value is a state of f, not lost."""
    plain, dec = pair(write_module, _source("reset", "update"))
    f, states = dec.Model().functionalize()
    assert sorted(states) == ["sub.value"]
    out, states = jax.jit(lambda f, s, x: f(s, x))(f, states, A1)
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
                call = jax.jit(lambda f, s, *a, m=m: getattr(f, m)(s, *a))
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
        jax.jit(lambda s, x: f(s, x))(states, xs)
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
        jax.jit(lambda s, x: f(s, x))(states, A1)


# --- the same rule in an undecorated base class ---------------------------------
# Its methods are not rewritten; they reach state through the class's
# descriptors, and a container state changed in place there is refused at
# decoration where the spelling shows a container, as in the class itself.

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
