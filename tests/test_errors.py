"""Errors of ``@stateful``: every decoration-time rejection, and the runtime
error for an eager model called under a JAX transformation.

Each decoration error must be a ``DecorationError`` (also ``ValueError`` and
``autostate.AutostateError``) whose message names the class, the attribute,
``file:line`` of the offending statement and a fix, and must not leak libcst.
Offending lines are found by the marker comment at their end.
"""

from __future__ import annotations

import functools
import linecache
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autostate
from autostate.errors import DecorationError, SourceUnavailableError, TracedEagerStateError

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


# --- decoration-time errors ------------------------------------------------------------


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
    out, states = jax.jit(lambda f, s: f.peek(s))(f, states)
    assert float(out) == 1.0
    _, states = jax.jit(lambda f, s: f.reset(s))(f, states)
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
    # they run in threads the state (tests/test_control_flow.py covers all modes).
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
    # Its writes are threaded at run time (autostate.control, or the host store).
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
            # (A whole-value write would reach state; see tests/test_fidelity.py.)
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
    out, states = jax.jit(lambda f, s: f.step(s))(f, states)
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


# --- eager model under a transformation ----------------------------------------------------


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


@pytest.mark.parametrize(
    "transform",
    [
        lambda m: jax.jit(m)(1.0),
        lambda m: jax.jit(lambda v: m(v))(1.0),
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
    out, new = jax.jit(lambda f, s, v: f(s, v))(f, states, 1.0)
    assert float(out) == 5.0
    np.testing.assert_array_equal(new["x"], [2.0, 3.0])
    grad = jax.grad(lambda v: f(states, v)[0])(1.0)
    assert float(grad) == 7.0  # d/dv sum((x + v) * v) = sum(x + 2v) at v=1
    outs, _ = jax.vmap(lambda v: f(states, v))(jnp.ones(3))
    np.testing.assert_array_equal(outs, [5.0, 5.0, 5.0])


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


# --- a marker the decorator did not see names the marker the user wrote -------------


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
    assert f"test_errors.py:{line_of('# computed name: unseen')}" in message
    assert "pos" not in vars(model)
    with pytest.raises(autostate.AutostateError) as info:
        model.add_to_marker(marker, jnp.arange(3))
    assert f"autostate.{marker}(value) declares" in str(info.value)
    assert f"autostate.{other}(" not in str(info.value)
