"""Constructs refused with a clear error, at decoration time or at the first
call that reaches them: the error type, its wording and the user's file:line.

Each case runs a class as plain Python and decorated (the harness in
``tests/semantics/harness.py``, or a direct comparison) and asserts the
decorated program means what the plain one does: eagerly, through
``f(states, ...)``, under ``jax.jit`` and after ``autostate.freeze``, or that it
is refused with a clear error. A known difference stays as ``xfail(strict=True)``
with what differs.
"""

from __future__ import annotations

import functools
import linecache
import re
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autostate
from autostate import errors
from autostate.errors import (
    DecorationError,
    InvalidTypeError,
    SourceUnavailableError,
    StateAccessError,
    StaticStateError,
    TracedEagerStateError,
)
from semantics.harness import (
    HEADER,
    Loader,
    assert_clear,
    assert_same,
    assert_user_line,
    check,
    class_pair,
    pair,
    raises_autostate,
    staged,
)
from semantics.programs_attribute_access import PROTO
from semantics.programs_escapes import HELPER_WRITES
from semantics.programs_methods import RUNTIME
from semantics.programs_shared import POSITIVE_CALLS as TWO_CALLS
from semantics.programs_shared import X1, py312
from semantics.programs_state_inference import NNX, PLAIN_SUBMODEL

HERE = __file__

THIS_FILE = Path(__file__).read_text().splitlines()


@functools.cache
def line_of(marker: str) -> int:
    hits = [n for n, line in enumerate(THIS_FILE, start=1) if line.rstrip().endswith(marker)]
    assert len(hits) == 1, marker
    return hits[0]


def assert_no_libcst(err: BaseException) -> None:
    assert not type(err).__module__.startswith("libcst")
    assert "libcst" not in str(err).lower()
    chained = err.__cause__ or (None if err.__suppress_context__ else err.__context__)
    assert chained is None or not type(chained).__module__.startswith("libcst")
    for frame in traceback.extract_tb(err.__traceback__):
        assert "libcst" not in frame.filename


def decoration_error(cls: type, *, exc_type: type = DecorationError, **kwargs) -> str:
    with pytest.raises(exc_type) as info:
        autostate.stateful(cls, **kwargs)
    err = info.value
    assert isinstance(err, DecorationError)
    assert isinstance(err, ValueError)
    assert isinstance(err, autostate.AutostateError)
    assert_no_libcst(err)
    return str(err)


def check_message(message: str, cls: type, attr: str, marker: str, *fix_words: str) -> None:
    assert f"class {cls.__name__}" in message
    assert repr(attr) in message
    assert f"{__file__}:{line_of(marker)}" in message
    assert "fix:" in message
    fix = message.split("fix:", 1)[1]
    for word in fix_words:
        assert word in fix


def test_del_of_state():
    class DelState:
        def __init__(self):
            self.x = jnp.zeros(())

        def step(self):
            self.x += 1

        def reset(self):
            del self.x  # ERR-del

    message = decoration_error(DelState)
    check_message(message, DelState, "x", "# ERR-del", "self.x = None")
    assert "`del self.x`" in message


def test_setattr_and_getattr_with_a_literal_state_name_are_the_attribute():
    """``setattr(self, "x", v)`` / ``getattr(self, "x")`` with a literal name mean
    ``self.x = v`` / ``self.x``: rewritten as the state access (no error)."""

    class NamedAccess:
        def __init__(self):
            self.x = jnp.zeros(())

        def step(self):
            self.x += 1

        def reset(self):
            setattr(self, "x", jnp.zeros(()))  # noqa: B010

        def peek(self):
            return getattr(self, "x") * 1  # noqa: B009

    model = autostate.stateful(NamedAccess)()
    model.step()
    f, states = model.functionalize()
    out, states = staged(lambda f, s: f.peek(s))(f, states)
    assert float(out) == 1.0
    _, states = staged(lambda f, s: f.reset(s))(f, states)
    assert float(states["x"]) == 0.0
    model.reset()
    assert float(model.peek()) == 0.0


def test_reflection_on_non_state_names_is_allowed():
    class Reflective:
        def __init__(self):
            self.x = jnp.zeros(())
            self.config = 1

        def step(self):
            self.x += getattr(self, "config")  # noqa: B009
            return getattr(self, "missing", None)

    autostate.stateful(Reflective)
    model = Reflective()
    assert model.step() is None and float(model.x) == 1.0


def test_state_first_assigned_outside_init():
    class Late:
        def __init__(self):
            self.w = jnp.ones(())

        def step(self):
            self.count = 0  # ERR-late

    message = decoration_error(Late)
    check_message(message, Late, "count", "# ERR-late", "__init__", "autostate.state")


def test_nested_function_assigning_state_is_accepted_and_threaded():
    # Issue 10: closures that assign state are no longer rejected; the lax.cond
    # they run in threads the state (tests/semantics/test_control_flow.py covers all modes).
    @autostate.stateful
    class NestedWrite:
        def __init__(self):
            self.x = jnp.zeros(())

        def step(self, v):
            def body(carry):
                self.x = carry
                return carry

            return jax.lax.cond(v > 0, body, body, v)

    model = NestedWrite()
    model.step(jnp.float32(3.0))
    assert float(model.x) == 3.0


def test_lambda_assigning_state_is_accepted():
    @autostate.stateful
    class LambdaWrite:
        def __init__(self):
            self.x = jnp.zeros(())

        def step(self, v):
            update = lambda u: [u for self.x in [u]]  # noqa: E731
            return update(v)

    model = LambdaWrite()
    model.step(jnp.float32(2.0))
    assert float(model.x) == 2.0


def test_nested_write_is_accepted_by_analysis():
    from autostate.transform import analysis

    init = analysis.MethodSource(
        "__init__", "__init__", "m.py", 5, "    def __init__(self):\n        self.x = 0\n", (), True
    )
    step = analysis.MethodSource(
        "step",
        "step",
        "m.py",
        8,
        "    def step(self):\n        def body():\n            self.x = 1\n        body()\n",
        (),
        True,
    )
    facts = [analysis.collect_facts("M", init), analysis.collect_facts("M", step)]
    # Its writes are threaded at run time (autostate.lifting, or the host store).
    result = analysis.analyze_class("M", facts)
    assert result.state == {"x"}


def test_rebinding_the_receiver():
    class Rebind:
        def __init__(self):
            self.x = jnp.zeros(())

        def step(self, other):
            self.x += 1
            self = other  # ERR-rebind
            return self

    message = decoration_error(Rebind)
    check_message(message, Rebind, "x", "# ERR-rebind", "self")
    assert "`self`" in message


def test_undecorated_base_class_assigning_inferred_state():
    class UndecoratedBase:
        def __init__(self):
            self.x = jnp.zeros(())

        def bump(self):
            # (A whole-value write would reach state; see tests/semantics/.)
            self.x[0] = 1  # ERR-base

    class Derived(UndecoratedBase):
        def step(self):
            self.x += 2

    message = decoration_error(Derived)
    check_message(message, Derived, "x", "# ERR-base", "UndecoratedBase", "@autostate.stateful")
    assert "UndecoratedBase.bump" in message


def test_undecorated_base_class_that_only_reads_is_fine():
    class ReadingBase:
        def __init__(self):
            self.x = jnp.zeros(())

        def double(self):
            return self.x * 2

    class Derived(ReadingBase):
        def step(self):
            self.x += 2
            return self.double()

    autostate.stateful(Derived)
    model = Derived()
    assert float(model.step()) == 4.0
    f, states = model.functionalize()
    out, states = staged(lambda f, s: f.step(s))(f, states)
    assert float(out) == 8.0 and float(states["x"]) == 4.0


def test_source_unavailable_for_a_class_built_by_exec():
    namespace: dict = {}
    exec(
        "import jax.numpy as jnp\n"
        "class Dynamic:\n"
        "    def __init__(self):\n"
        "        self.x = jnp.zeros(())\n"
        "    def step(self):\n"
        "        self.x += 1\n",
        namespace,
    )
    cls = namespace["Dynamic"]
    message = decoration_error(cls, exc_type=SourceUnavailableError)
    assert "Dynamic." in message
    assert "<string>:" in message
    assert "fix:" in message and ".py file" in message.split("fix:", 1)[1]


def test_generator_method_using_state():
    class Gen:
        def __init__(self):
            self.x = jnp.zeros(())

        def step(self):
            self.x += 1

        def values(self):
            yield self.x  # ERR-gen

    message = decoration_error(Gen)
    check_message(message, Gen, "x", "# ERR-gen", "regular method")
    assert "generator" in message


def test_async_method_using_state():
    class Async:
        def __init__(self):
            self.x = jnp.zeros(())

        def step(self):
            self.x += 1

        async def fetch(self):
            return self.x  # ERR-async

    message = decoration_error(Async)
    check_message(message, Async, "x", "# ERR-async", "regular", "method")
    assert "async" in message


def test_generator_not_touching_state_is_fine():
    class GenOk:
        def __init__(self):
            self.x = jnp.zeros(())
            self.items = [1, 2]

        def step(self):
            self.x += 1

        def each(self):
            yield from self.items

    autostate.stateful(GenOk)
    assert list(GenOk().each()) == [1, 2]


@pytest.mark.parametrize(
    "call",
    [
        "self.items.append(v)",
        "self.items.extend([v])",
        "self.table.update(k=v)",
        "self.items[0].append(v)",
    ],
)
def test_in_place_mutation_of_state(write_module, call):
    module = write_module(
        f"""
        import jax.numpy as jnp

        class Mutates:
            def __init__(self):
                self.items = [[]]
                self.table = {{}}

            def reset(self):
                self.items = [[]]
                self.table = {{}}

            def add(self, v):
                {call}
        """
    )
    message = decoration_error(module.Mutates)
    attr = call.split(".")[1].split("[")[0]
    assert "class Mutates" in message
    assert repr(attr) in message
    assert f"{module.__file__}:14" in message
    assert "assign a new value" in message


def test_in_place_mutation_of_non_state_is_plain_python():
    class Logs:
        def __init__(self):
            self.x = jnp.zeros(())
            self.log = []

        def step(self, v):
            self.x += v
            self.log.append(v)

    autostate.stateful(Logs)
    model = Logs()
    model.step(1.0)
    model.step(2.0)
    assert model.log == [1.0, 2.0] and float(model.x) == 3.0


@pytest.mark.parametrize("broken", ["self.x += (1", "self.x += = 1"])
def test_unparsable_source_is_a_decoration_error(write_module, broken):
    module = write_module(
        """
        class Edited:
            def __init__(self):
                self.x = 0

            def step(self):
                self.x += 1
        """
    )
    path = Path(module.__file__)
    # The file changed on disk after import: the method's lines no longer parse.
    path.write_text(path.read_text().replace("self.x += 1", broken))
    linecache.checkcache(str(path))
    message = decoration_error(module.Edited)
    assert "Edited" in message
    assert f"{module.__file__}:" in message
    assert "reload the module" in message


def test_unknown_fallback_is_rejected():
    with pytest.raises(ValueError) as info:
        autostate.stateful(fallback="device")
    assert "'device'" in str(info.value)
    assert "fallback" in str(info.value)


def test_decorating_a_function_is_a_type_error():
    with pytest.raises(TypeError) as info:
        autostate.stateful(line_of)
    assert isinstance(info.value, autostate.AutostateError) or "classes" in str(info.value)
    assert "class" in str(info.value)


@autostate.stateful
class Eager:
    def __init__(self):
        self.x = jnp.array([1.0, 2.0])
        self.calls = jnp.zeros(())

    def __call__(self, v):
        self.x = self.x + v
        return (self.x * v).sum()


def assert_untouched(model: Eager) -> None:
    leaves = jax.tree_util.tree_leaves(model)
    assert not any(isinstance(leaf, jax.core.Tracer) for leaf in leaves)
    np.testing.assert_array_equal(model.x, [1.0, 2.0])
    assert not isinstance(model.x, jax.core.Tracer)
    # The model still works eagerly afterwards.
    assert float(model(1.0)) == 5.0
    np.testing.assert_array_equal(model.x, [2.0, 3.0])


def check_traced_error(err: TracedEagerStateError) -> None:
    assert isinstance(err, autostate.AutostateError)
    assert isinstance(err, RuntimeError)
    message = str(err)
    assert "functionalize()" in message
    assert "'x'" in message
    assert 'fallback="host"' in message
    # autostate's own transformation is the first fix named, then the others.
    fix = message.split("fix:", 1)[1]
    assert fix.index("autostate.jit") < fix.index("functionalize()") < fix.index("fallback=")


@pytest.mark.parametrize(
    "transform",
    [
        lambda m: staged(m)(1.0),
        lambda m: staged(lambda v: m(v))(1.0),
        lambda m: jax.grad(m)(1.0),
        lambda m: jax.vmap(m)(jnp.ones(3)),
    ],
    ids=["jit", "jit-lambda", "grad", "vmap"],
)
def test_eager_model_under_a_transformation(transform):
    model = Eager()
    with pytest.raises(TracedEagerStateError) as info:
        transform(model)
    check_traced_error(info.value)
    assert_untouched(model)


def test_functionalized_model_under_the_same_transformations_works():
    f, states = Eager().functionalize()
    out, new = staged(lambda f, s, v: f(s, v))(f, states, 1.0)
    assert float(out) == 5.0
    np.testing.assert_array_equal(new["x"], [2.0, 3.0])
    grad = jax.grad(lambda v: f(states, v)[0])(1.0)
    assert float(grad) == 7.0  # d/dv sum((x + v) * v) = sum(x + 2v) at v=1
    outs, _ = jax.vmap(lambda v: f(states, v))(jnp.ones(3))
    np.testing.assert_array_equal(outs, [5.0, 5.0, 5.0])


@autostate.stateful
class Counted:
    def __init__(self):
        self.w = jnp.array([1.0, 2.0])
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, v):
        self.calls += 1
        return (self.w * v).sum()


def test_jax_grad_of_a_model_names_its_integer_state_and_autostate_grad():
    model = Counted()
    with pytest.raises(InvalidTypeError) as info:
        jax.grad(lambda m: m(2.0))(model)  # JAX_GRAD_OF_MODEL
    err = info.value
    assert isinstance(err, TypeError)  # (as JAX's own refusal)
    assert "'calls' (int32)" in str(err)
    assert f"{HERE}:{line_of('# JAX_GRAD_OF_MODEL')}" in str(err)
    assert "autostate.grad(loss)(model)" in str(err).split("fix:", 1)[1]
    with pytest.raises(InvalidTypeError, match="'calls'"):
        jax.value_and_grad(lambda m: m(2.0))(model)
    assert int(model.calls) == 0  # refused before the call ran
    # What the fix says: the parameters' gradient, the state written as the call would.
    grads = autostate.grad(lambda m: m(2.0))(model)
    np.testing.assert_array_equal(grads.w, [2.0, 2.0])
    assert int(model.calls) == 1


def test_jax_grad_of_a_model_is_jaxs_where_jax_would_accept_it():
    """allow_int (JAX differentiates the integer leaves as float0), a model with
    floating arrays only, and jax.grad of f: JAX's own meaning, unchanged."""
    model = Counted()
    grads = jax.grad(lambda m: (m.w * 3.0).sum(), allow_int=True)(model)
    np.testing.assert_array_equal(grads.w, [3.0, 3.0])
    floats = Eager()
    grads = jax.grad(lambda m: (m.x * 2.0).sum())(floats)
    np.testing.assert_array_equal(grads.x, [2.0, 2.0])
    f, states = Counted().functionalize()
    grads = jax.grad(lambda f: f(states, 1.0)[0])(f)
    np.testing.assert_array_equal(grads.model.w, [1.0, 1.0])


def test_eval_shape_of_a_model_that_writes_state():
    """Eagerly and inside autostate.jit: refused at the write, naming eval_shape;
    the spelling the fix gives runs."""
    model = Eager()
    with pytest.raises(TracedEagerStateError, match="eval_shape"):
        jax.eval_shape(model, 1.0)
    assert_untouched(model)

    @autostate.jit
    def step(model, v):
        jax.eval_shape(model, v)
        return model(v)

    model = Eager()
    with pytest.raises(TracedEagerStateError) as info:
        step(model, 1.0)
    message = str(info.value)
    assert "jax.eval_shape" in message and "inside the trace or call it lives in" in message
    assert "built outside" not in message
    assert "jax.eval_shape(f, states, x)" in message.split("fix:", 1)[1]
    assert_untouched(model)

    @autostate.jit
    def fixed(model, v):
        f, states = model.functionalize()
        out, new = jax.eval_shape(f, states, v)
        assert out.shape == () and new["x"].shape == (2,)
        return model(v)

    model = Eager()
    assert float(fixed(model, 1.0)) == 5.0
    np.testing.assert_array_equal(model.x, [2.0, 3.0])


def test_an_error_inside_autostate_jit_names_the_users_function_and_arguments():
    """JAX's words for a traced value used as a Python one name the function
    autostate.jit compiled and its arguments (each model array by its path),
    and the traceback shows no frame of autostate's own code."""

    @autostate.jit
    def step(model, v, *, scale):
        return model(v * scale).item()  # ITEM_IN_JIT

    with pytest.raises(jax.errors.ConcretizationTypeError) as info:
        step(Eager(), 1.0, scale=jnp.float32(2.0))
    message = str(info.value)
    assert f"the function step at {HERE}:" in message
    assert "for autostate.jit" in message
    assert "model.x" in message and "v" in message and "scale" in message
    assert "_pure" not in message and "buffers[" not in message and "others[" not in message
    package = Path(autostate.__file__).parent
    frames = [f.filename for f in traceback.extract_tb(info.value.__traceback__)]
    assert not [f for f in frames if Path(f).is_relative_to(package)], frames
    assert any(f == HERE for f in frames)
    assert line_of("# ITEM_IN_JIT") in [f.lineno for f in traceback.extract_tb(
        info.value.__traceback__) if f.filename == HERE]


@autostate.stateful
class ScanItem:
    def __init__(self):
        self.total = jnp.zeros(())

    def __call__(self, xs):
        def body(carry, x):
            self.total = self.total + x
            return carry + float(x), None  # FLOAT_IN_SCAN

        return jax.lax.scan(body, 0.0, xs)[0]


def test_an_error_in_a_lax_body_inside_autostate_jit_shows_only_the_users_frames():
    """The lift's own frames (``autostate.lifting``) are hidden from the
    traceback as the rest of autostate's are."""
    with pytest.raises(jax.errors.ConcretizationTypeError) as info:
        autostate.jit(lambda m, xs: m(xs))(ScanItem(), jnp.ones(3))
    package = Path(autostate.__file__).parent
    frames = traceback.extract_tb(info.value.__traceback__)
    assert not [f.filename for f in frames if Path(f.filename).is_relative_to(package)]
    assert line_of("# FLOAT_IN_SCAN") in [f.lineno for f in frames if f.filename == HERE]


def test_user_location_skips_only_autostate_jax_and_the_standard_library(tmp_path, monkeypatch) -> None:
    """A user's folder named like a skipped one (``jax_md``, ``autostate_examples``)
    or a package installed in the standard library's site-packages is the user's."""
    import os
    import sysconfig
    import traceback

    from autostate import errors

    stdlib = sysconfig.get_paths()["stdlib"]
    jax_dir = os.path.dirname(jax.__file__)
    ours = os.path.dirname(errors.__file__)
    cases = {
        jax_dir + "_md" + os.sep + "model.py": True,
        ours + "_examples" + os.sep + "model.py": True,
        os.path.join(stdlib, "site-packages", "mylib", "model.py"): True,
        os.path.join(jax_dir, "_src", "core.py"): False,
        os.path.join(ours, "runtime.py"): False,
        os.path.join(stdlib, "functools.py"): False,
    }
    for filename, is_user in cases.items():
        stack = traceback.StackSummary.from_list([(filename, 7, "f", "x = 1")])
        monkeypatch.setattr(traceback, "extract_stack", lambda stack=stack: stack)
        assert (errors.user_location() == f"{filename}:7") is is_user, filename


@autostate.stateful
class Registers:
    def __init__(self):
        self.w = jnp.ones(2)

    def register(self, marker, name, value):
        setattr(self, name, getattr(autostate, marker)(value))  # computed name: unseen

    def add_to_marker(self, marker, value):
        kept = getattr(autostate, marker)(value)
        return kept + 1  # the marker used as a value


@pytest.mark.parametrize("marker", ["state", "constant"])
def test_a_marker_the_decorator_did_not_see_is_named_as_written(marker):
    other = "constant" if marker == "state" else "state"
    model = Registers()
    with pytest.raises(autostate.errors.StateAccessError) as info:
        model.register(marker, "pos", jnp.arange(3))
    message = str(info.value)
    assert f"Registers.pos was assigned an autostate.{marker}(...)" in message
    assert f"`self.x = autostate.{marker}(value)`" in message
    assert f"autostate.{other}(" not in message
    assert f"{__file__.rpartition('/')[2]}:{line_of('# computed name: unseen')}" in message
    assert "pos" not in vars(model)
    with pytest.raises(autostate.AutostateError) as info:
        model.add_to_marker(marker, jnp.arange(3))
    assert f"autostate.{marker}(value) declares" in str(info.value)
    assert f"autostate.{other}(" not in str(info.value)


jit_call = staged(lambda f, s, *a: f(s, *a))




def test_a_helper_writing_a_non_state_is_refused_whatever_the_states(write_module):
    plain_cls, cls, _ = class_pair(write_module, HELPER_WRITES, "NoStates")
    plain = plain_cls()
    assert [float(plain(1.0)) for _ in range(2)] == [2.0, 3.0]
    eager = cls()
    assert [float(eager(1.0)) for _ in range(2)] == [2.0, 3.0]  # eager is plain Python
    f, states = cls().functionalize()
    assert states == {}
    # Empty states, traced or concrete: refused, never a silently constant count.
    for call in (lambda: jit_call(f, states, 1.0), lambda: f(states, 1.0)):
        with pytest.raises(autostate.errors.StateAccessError) as info:
            call()
        message = str(info.value)
        assert "NoStates.count is not state" in message
        assert "self.count = autostate.state(...)" in message


@pytest.mark.parametrize("slots", ['("w",)', '("w", "__dict__")', "()"])
def test_slots_are_rejected_at_decoration_with_their_names(write_module, slots):
    module = write_module(
        f"""
        import jax.numpy as jnp

        class Slotted:
            __slots__ = {slots}

            def __init__(self):
                self.w = jnp.zeros(())

            def step(self):
                self.w = self.w + 1
        """
    )
    with pytest.raises(autostate.errors.DecorationError) as info:
        autostate.stateful(module.Slotted)
    message = str(info.value)
    assert "Slotted" in message and "__slots__" in message
    assert "Slotted.w" in message or slots == "()"
    assert "fix: remove __slots__" in message


def test_arrays_in_a_plain_object_are_refused_at_functionalize(write_module):
    _, cls, _ = class_pair(write_module, PLAIN_SUBMODEL, "Net")
    model = cls()
    for entry in (model.functionalize, lambda: autostate.param_dict(model)):
        with pytest.raises(autostate.errors.InvalidTypeError) as info:
            entry()
        message = str(info.value)
        assert "Net.blocks" in message and "blocks[0].w" in message
        assert "decorate Linear with @autostate.stateful" in message




def test_augmented_assignment_to_self_is_a_documented_decoration_error(
    write_module: Loader,
) -> None:
    source = PROTO.replace("        other = self\n        other += 1.0\n", "        self += 1.0\n")
    with pytest.raises(errors.DecorationError, match="receiver `self` is rebound") as err:
        pair(write_module, source)
    assert ".py:" in str(err.value)


ERR_HEAD = "import jax\nimport jax.numpy as jnp\nimport autostate\n\n\n"


DOC_ERRORS = {
    "del": """
@autostate.stateful
class Cache:
    def __init__(self):
        self.kv = jnp.zeros(4)

    def update(self, x):
        self.kv = x

    def reset(self):
        del self.kv  # HERE
""",
    "outside-init": """
@autostate.stateful
class Tracker:
    def __init__(self):
        self.scale = jnp.ones(())

    def __call__(self, x):
        self.last = x  # HERE
        return x * self.scale
""",
    "rebind-self": """
@autostate.stateful
class Counter:
    def __init__(self):
        self.count = jnp.zeros(())

    def __call__(self, other=None):
        if other is not None:
            self = other  # HERE
        self.count += 1
        return self.count
""",
    "generator": """
@autostate.stateful
class Stream:
    def __init__(self):
        self.step = jnp.zeros(())

    def advance(self):
        self.step += 1

    def steps(self, n):
        for _ in range(n):
            yield self.step  # HERE
""",
    "async": """
@autostate.stateful
class Stream:
    def __init__(self):
        self.step = jnp.zeros(())

    async def advance(self):
        self.step += 1  # HERE
""",
    "append": """
@autostate.stateful
class History:
    def __init__(self):
        self.losses = []

    def record(self, loss):
        self.losses.append(loss)  # HERE

    def reset(self):
        self.losses = []
""",
    "generator-in-local-class": """
def make():
    @autostate.stateful
    class Stream:
        def __init__(self):
            self.step = jnp.zeros(())

        def advance(self):
            self.step += 1

        def steps(self, n):
            yield self.step  # HERE
    return Stream


make()
""",
    "del-in-nested-class": """
class Outer:
    @autostate.stateful
    class Cache:
        def __init__(self):
            self.kv = jnp.zeros(4)

        def update(self, x):
            self.kv = x

        def reset(self):
            del self.kv  # HERE
""",
    "async-generator": """
@autostate.stateful
class Stream:
    def __init__(self):
        self.step = jnp.zeros(())

    async def steps(self):
        self.step += 1  # HERE
        yield self.step
""",
    "outside-init-in-factory-class": """
def make(v):
    @autostate.stateful
    class Tracker:
        def __init__(self):
            self.scale = jnp.ones(()) * v

        def __call__(self, x):
            self.last = x  # HERE
            return x * self.scale
    return Tracker


make(1.0)
""",
}


@pytest.mark.parametrize("case", sorted(DOC_ERRORS))
def test_documented_decoration_errors_name_the_user_line(write_module: Loader, case: str) -> None:
    text = ERR_HEAD + DOC_ERRORS[case].lstrip("\n")
    line = next(i for i, s in enumerate(text.splitlines(), 1) if "# HERE" in s)
    with pytest.raises(autostate.errors.DecorationError) as info:
        write_module(text, name=f"refused_{case.replace('-', '_')}")
    assert f"refused_{case.replace('-', '_')}.py:{line}" in str(info.value), str(info.value)
    assert "fix:" in str(info.value)


def test_slots_error_names_the_user_file(write_module: Loader) -> None:
    text = ERR_HEAD + """
@autostate.stateful
class Slotted:
    __slots__ = ("w", "__dict__")

    def __init__(self):
        self.w = jnp.zeros(())

    def step(self):
        self.w = self.w + 1
"""
    with pytest.raises(autostate.errors.DecorationError) as info:
        write_module(text, name="refused_slots")
    assert "refused_slots.py:" in str(info.value)


def test_runtime_errors_are_autostate_errors(write_module: Loader) -> None:
    dec = write_module(ERR_HEAD + """
@autostate.stateful
class Flag:
    def __init__(self):
        self.training = True
        self.count = jnp.zeros(())

    def eval(self):
        self.training = False

    def __call__(self, x):
        self.count += x
        return self.count
""")
    f, states = dec.Flag().functionalize()
    with pytest.raises(autostate.errors.StaticStateError):
        f.eval(states)
    with pytest.raises(autostate.errors.TracedEagerStateError):
        staged(dec.Flag())(1.0)
    with pytest.raises(autostate.errors.UnhandledLocalStateError):
        f.model(1.0)
    with pytest.raises(autostate.errors.MethodNotFoundError):
        f.nope(states)
    with pytest.raises(autostate.errors.StateDictError):
        f({"cnt": jnp.zeros(())}, 1.0)
    with pytest.raises(autostate.errors.InvalidArgumentError):
        autostate.stateful(fallback="gpu")
    with pytest.raises(autostate.errors.InvalidTypeError):
        autostate.stateful(lambda: None)


def named_line(err: BaseException) -> tuple[str, str]:
    """The ``file`` and the text of the line an error message names."""
    found = re.search(r"  at (\S+?):(\d+)", str(err))
    assert found, f"no file:line in: {err}"
    path, number = found.group(1), int(found.group(2))
    return path, Path(path).read_text().splitlines()[number - 1]


def assert_at(err: BaseException, marker: str) -> None:
    """The error names a line of the test's module holding ``marker``."""
    path, text = named_line(err)
    assert "autostate_testmod" in path, f"not the user's file: {path}"
    assert_user_line(err, path)
    assert marker in text, f"{marker!r} is not on the line the error names: {text!r}"


REBIND_HEAD = """
@DECORATE
class Rebind:
    def __init__(self):
        self.c = jnp.zeros(())
    def __call__(self, x, other):
        self.c = self.c + x
"""


@pytest.mark.parametrize(
    "statement",
    [
        "(self,\n         y) = (other, 1)  # HERE",
        "for self in [other]: pass  # HERE",
        "z = [(self := o) for o in [other]]  # HERE",
        "with other as self: pass  # HERE",
        "self += 1  # HERE",
    ],
    ids=["tuple", "for", "walrus-in-comprehension", "with", "augmented"],
)
def test_receiver_rebinding_is_a_decoration_error_at_its_line(
    write_module: Loader, statement: str
) -> None:
    source = REBIND_HEAD + "        " + statement + "\n"
    with raises_autostate(DecorationError) as info:
        pair(write_module, source)
    assert "rebound" in str(info.value)
    path, text = named_line(info.value)
    assert_user_line(info.value, path)
    assert text.strip().startswith(statement.split("\n")[0].strip()[:6])


HEAD = """
@DECORATE
class Bad:
    def __init__(self):
        self.c = jnp.zeros(())
    def __call__(self, x):
        self.c = self.c + x
        return self.c
"""


@pytest.mark.parametrize(
    ("tail", "words"),
    [
        ("    def reset(self): x = 1; del self.c  # HERE\n", "del self.c"),
        ("\tdef reset(self):\n\t\ts = '''\n\tdoc'''\n\t\tdel self.c  # HERE\n", None),
        ("    def poke(self):\n        delattr(self, 'c',  # HERE\n            )\n", "deletes state"),
        (
            "    def reset(self):\n        x = 1 + \\\n            2; del self.c  # HERE\n",
            "del self.c",
        ),
        (
            "    async def later(self):\n        await something()\n        x = 1; y = self.c  # HERE\n",
            "async method",
        ),
        ("    async def later(self):\n        self.c = 3  # HERE\n", "async method"),
        ("    def gen(self):\n        yield 1\n        self.c += 1  # HERE\n", "generator method"),
        (
            "    def gen(self):\n        x = yield\n        self.c = self.c + x  # HERE\n",
            "generator method",
        ),
        ("    def late(self): self.z = 3  # HERE\n", "first assigned outside __init__"),
        ("    def grow(self):\n        y = 1\n        self.c.append(y)  # HERE\n", "in place"),
    ],
    ids=[
        "del-one-liner",
        "del-tabs",
        "delattr-continued",
        "del-after-backslash",
        "async-read",
        "async-write",
        "generator-write",
        "yield-expression",
        "first-assigned-one-liner",
        "append",
    ],
)
def test_decoration_errors_name_their_line(write_module: Loader, tail: str, words: Any) -> None:
    source = HEAD + tail
    if "\t" in tail:  # a whole class indented with tabs
        source = source.replace("    ", "\t")
    with raises_autostate(DecorationError) as info:
        pair(write_module, source)
    if words:
        assert words in str(info.value)
    assert "fix:" in str(info.value)
    assert_at(info.value, "# HERE")


def test_slots_error_names_its_class(write_module: Loader) -> None:
    source = """
@DECORATE
class Slotted:
    __slots__ = ("c",)
    def __init__(self):
        self.c = jnp.zeros(())
    def __call__(self, x):
        self.c = self.c + x
"""
    with raises_autostate(DecorationError) as info:
        pair(write_module, source)
    assert "__slots__" in str(info.value)
    path, _ = named_line(info.value)
    assert_user_line(info.value, path)


SUBCLASS_SLOTS = """
@DECORATE
class Base:
    def __init__(self):
        self.c = jnp.zeros(())
    def __call__(self, x):
        self.c = self.c + x
        return self.c

class OnlySlots(Base):  # HERE
    __slots__ = ("extra",)
"""


def test_slots_error_of_a_class_without_functions_names_a_line(write_module: Loader) -> None:
    with raises_autostate(DecorationError) as info:
        pair(write_module, SUBCLASS_SLOTS)
    assert "__slots__" in str(info.value)
    assert_at(info.value, "# HERE")


def test_dataclass_slots_above_stateful_is_an_error_with_a_line(write_module: Loader) -> None:
    source = """
@dataclasses.dataclass(slots=True)
@DECORATE
class SlotDc:
    c: jax.Array = dataclasses.field(default_factory=lambda: jnp.zeros(()))
    def __call__(self, x):
        self.c = self.c + x
        return self.c
"""
    # Refused at the class statement: @dataclass(slots=True) rebuilds the
    # decorated class, and the rebuilt class is decorated as it is made
    # (Python before 3.12 wraps an error of __set_name__ in a RuntimeError).
    with pytest.raises(Exception) as raised:  # noqa: PT011
        pair(write_module, source)
    error = raised.value if isinstance(raised.value, DecorationError) else raised.value.__cause__
    assert isinstance(error, DecorationError)
    assert "__slots__" in str(error)
    path, _ = named_line(error)
    assert_user_line(error, path)


@pytest.mark.parametrize(
    ("call", "marker"),
    [
        (lambda m, x: m(x), "# ONELINER"),
        (lambda m, x: m.bump(x), "# LAMBDA"),
        (lambda m, x: m.poke(m, x), "# STATICMETHOD"),
    ],
    ids=["one-liner", "class-body-lambda", "staticmethod-lambda"],
)
def test_eager_model_under_jit_names_the_writing_line(
    write_module: Loader, call: Callable[..., Any], marker: str
) -> None:
    plain, dec = pair(write_module, RUNTIME)
    model = dec.Tabs()
    with raises_autostate(TracedEagerStateError) as info:
        staged(lambda x: call(model, x))(X1)
    assert_at(info.value, marker)
    assert_same(0.0, model.c)  # no tracer kept


STATIC_WRITER = """
@DECORATE
class StaticWriter:
    def __init__(self):
        self.c = jnp.zeros(())

    @staticmethod
    def _bump(model, v):
        model.c = model.c + v  # HERE

    def __call__(self, v):
        StaticWriter._bump(self, v)
        return self.c
"""


def test_staticmethod_write_of_a_non_state_is_refused_at_its_line(write_module: Loader) -> None:
    """Static methods have no receiver (documented): ``model.c`` is not state."""
    plain, dec = pair(write_module, STATIC_WRITER)
    check(plain, dec, "StaticWriter()", TWO_CALLS, modes=("eager",))
    f, states = dec.StaticWriter().functionalize()
    assert states == {}
    with raises_autostate(StateAccessError) as info:
        f(states, X1)
    assert_at(info.value, "# HERE")


def test_errors_are_autostate_errors() -> None:
    """Every class used above is an AutostateError and the documented builtin."""
    for cls, builtin in [
        (DecorationError, ValueError),
        (StateAccessError, AttributeError),
        (StaticStateError, ValueError),
        (TracedEagerStateError, RuntimeError),
    ]:
        assert issubclass(cls, autostate.AutostateError) and issubclass(cls, builtin)




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


@pytest.mark.parametrize("decorator", [
    "@jax.jit",
    "@functools.partial(jax.jit, static_argnums=0)",
    "@functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)",
    "@jax.remat",
])
def test_jax_transformation_decorating_a_state_method_is_a_decoration_error(
    write_module: Loader, decorator: str
) -> None:
    """Plain Python cannot run these either (``self`` is no JAX type, or the remat body
    leaks the write); decoration refuses them at the method's line, naming a fix."""
    src = f"""
@autostate.stateful
class Bad:
    def __init__(self):
        self.mean = jnp.zeros(3)

    {decorator}
    def m(self, x):
        self.mean = self.mean + x
        return self.mean
"""
    with pytest.raises(DecorationError, match="fix") as info:
        write_module(HEADER + src)
    assert ".py:" in str(info.value) and "Bad.m" in str(info.value)
    if "checkpoint" in decorator or "remat" in decorator:
        assert "autostate.checkpoint" in str(info.value)


def test_undecorated_variable_wrapper_is_the_documented_invalid_type_error(
    write_module: Loader,
) -> None:
    plain, dec = pair(write_module, NNX)
    check(plain, dec, "HoldsPlain()", [("__call__", (X1,))] * 2, modes=("eager",))
    with pytest.raises(InvalidTypeError, match=r"PlainVariable.*count\.value") as err:
        dec.HoldsPlain().functionalize()
    assert "fix:" in str(err.value)


def assert_here(err: BaseException) -> None:
    """The error names the user's file and the line marked ``# HERE``."""
    found = re.search(r"(\S+\.py):(\d+)", str(err))
    assert found, f"no user file:line in: {err}"
    line = Path(found[1]).read_text().splitlines()[int(found[2]) - 1]
    assert "# HERE" in line, f"{found[0]} is {line!r}, not the marked line"


@py312
@pytest.mark.parametrize(
    ("body", "kind"),
    [
        ("def steps[T](self, n: T):\n        yield self.n + n  # HERE", "generator"),
        ("async def steps[T](self, n: T):\n        self.n = self.n + n  # HERE", "async"),
        ('def steps[T](self, n: T):\n        """Doc.\n\n            More.\n        """\n'
         "        yield from [f\"{self.n}\" for _ in range(n)]  # HERE", "generator"),
    ],
    ids=["generic_generator", "generic_async", "generator_after_docstring"],
)
def test_documented_errors_name_the_users_line(write_module: Loader, body: str, kind: str) -> None:
    source = f"""
@DECORATE
class Stream[T]:
    def __init__(self):
        self.n = jnp.zeros(())

    def step(self):
        self.n = self.n + 1

    {body}
"""
    with pytest.raises(DecorationError, match=f"{kind} method 'steps' uses state 'n'") as err:
        pair(write_module, source)
    assert_here(err.value)




def test_state_without_any_initial_value_is_still_refused(write_module: Loader) -> None:
    source = """
@DECORATE
class Tracker:
    def helper(self):
        pass

    def __call__(self, x):
        self.last = x
        return x
"""
    with pytest.raises(autostate.errors.DecorationError, match="first assigned outside __init__"):
        pair(write_module, source, fresh=True)


def assert_at_marker(err: BaseException, marker: str) -> None:
    """The error names a line of the test's module holding ``marker``."""
    found = re.search(r"  at (\S+?):(\d+)", str(err))
    assert found, f"no file:line in: {err}"
    path = found.group(1)
    assert "autostate_testmod" in path, f"not the user's file: {path}"
    assert_user_line(err, path)
    text = Path(path).read_text().splitlines()[int(found.group(2)) - 1]
    assert marker in text, f"{marker!r} is not on the line the error names: {text!r}"


REBIND_HEAD_WITH_BOX = """
class Box:
    def __init__(self):
        self.c = 100.0

@DECORATE
class Rebind:
    def __init__(self):
        self.c = jnp.zeros(())
    def __call__(self, x):
        self.c = self.c + x
        return self.c
    def poke(self, v):
        y = self.c
"""


@pytest.mark.parametrize(
    "statement",
    [
        "try:\n            raise ValueError()\n        except ValueError as self:  # HERE\n"
        "            pass",
        "try:\n            raise ValueError()\n        except* ValueError as self:  # HERE\n"
        "            pass",
        "match v:\n            case self:  # HERE\n                pass",
        "match Box():\n            case Box() as self:  # HERE\n                pass",
        "match [v]:\n            case [*self]:  # HERE\n                pass",
        "match {}:\n            case {**self}:  # HERE\n                pass",
        "match Box():\n            case Box(c=self):  # HERE\n                pass",
        "import math as self  # HERE",
        "from math import pi as self  # HERE",
        "import self  # HERE",
        "del self  # HERE",
        "def self(): pass  # HERE",
        "class self: pass  # HERE",
        "def inner():\n            nonlocal self\n            self = Box()  # HERE",
        "(lambda: 0) if (self := v) else 0  # HERE",
    ],
    ids=[
        "except-as",
        "except-star-as",
        "match-capture",
        "match-as",
        "match-star",
        "match-mapping-rest",
        "match-class-keyword",
        "import-as",
        "from-import-as",
        "import",
        "del",
        "nested-def",
        "nested-class",
        "nonlocal-in-nested",
        "walrus",
    ],
)
def test_each_form_rebinding_the_receiver_is_an_error_at_its_line(
    write_module: Loader, statement: str
) -> None:
    with raises_autostate(DecorationError) as info:
        pair(write_module, REBIND_HEAD_WITH_BOX + "        " + statement + "\n")
    assert "rebound" in str(info.value)
    assert "fix:" in str(info.value)
    assert_at_marker(info.value, "# HERE")


def test_slots_error_of_a_decorated_class_without_functions_names_its_line(
    write_module: Loader,
) -> None:
    source = """
@DECORATE
class OnlySlots:  # HERE
    __slots__ = ("c",)
"""
    with raises_autostate(DecorationError) as info:
        pair(write_module, source)
    assert "__slots__" in str(info.value)
    assert_at_marker(info.value, "# HERE")
