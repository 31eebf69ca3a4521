"""Exceptions raised by autostate, and the one place that formats them.

Every error subclasses ``AutostateError`` and the builtin exception the
situation calls for (``ValueError``, ``TypeError``, ``RuntimeError``), so both
``except autostate.AutostateError`` and ``except ValueError`` catch it.
Messages say what went wrong, where (``file:line`` of the user's code when
known), and how to fix it.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import sysconfig
import traceback
from collections.abc import Iterator
from typing import Any, TypeVar


class AutostateError(Exception):
    """Base class of every error autostate raises on purpose.

    Each error also derives from the built-in exception it refines
    (``ValueError``, ``TypeError``, ``RuntimeError`` or ``AttributeError``), so
    code that catches those keeps working. The message says what went wrong,
    at which line of the user's code, and how to fix it; ``docs/errors.md``
    lists every error.

    Examples:
        >>> @autostate.stateful
        ... class Counter:
        ...     def __init__(self):
        ...         self.count = jnp.zeros(())
        ...
        ...     def __call__(self):
        ...         self.count += 1
        >>> f, states = Counter().functionalize()
        >>> try:
        ...     autostate.state_dict(f)  # f holds no states: state_dict(f, states)
        ... except autostate.AutostateError as e:
        ...     error = e
        >>> print(type(error).__name__, isinstance(error, TypeError))
        InvalidTypeError True
    """


E = TypeVar("E", bound=AutostateError)


_USER_LINE: Any = object()  # format_error's default: the user's innermost line


# The write refusals autostate raised inside the running functionalized call
# or lax body (a static state given a new value, an attribute that is not
# state assigned). Code that catches one (``except Exception:`` around the
# assignment) goes on as if the write had happened, which it did in plain
# Python: the call raises the refusal again when it returns.
_REFUSALS: contextvars.ContextVar[list[AutostateError] | None] = contextvars.ContextVar(
    "autostate_refusals", default=None
)


def refused(error: E) -> E:
    """``error``, recorded as a write refusal of the running call (see ``_REFUSALS``)."""
    found = _REFUSALS.get()
    if found is not None and not any(e is error for e in found):
        found.append(error)
    return error


@contextlib.contextmanager
def _recorded() -> Iterator[list[AutostateError]]:
    """The write refusals made inside the block, in a list of its own (yielded)."""
    found: list[AutostateError] = []
    token = _REFUSALS.set(found)
    try:
        yield found
    finally:
        _REFUSALS.reset(token)


@contextlib.contextmanager
def refusals_raised_again(what: str) -> Iterator[None]:
    """Raises again, when the block returns, a write refusal that code inside
    it caught; ``what`` names the block (``"the call of f"``)."""
    with _recorded() as found:
        yield
    if found:
        error = found[0]
        note = (
            f"(autostate raised this inside {what}, and code there caught it; plain Python "
            "would have made the assignment, so the call cannot go on as it would: it is "
            "raised again when the call returns. Make the assignment one autostate can "
            "make, as the fix says, rather than catching the error.)"
        )
        if note not in getattr(error, "__notes__", ()):
            error.add_note(note)
        raise refused(error)


@contextlib.contextmanager
def refusals_kept_apart() -> Iterator[list[AutostateError]]:
    """Records the write refusals made inside the block in a list of its own
    (yielded): an attempt that fails and is undone clears it; one that
    succeeds hands them on to the running call, as if made there."""
    with _recorded() as found:
        yield found
    for error in found:
        refused(error)


def format_error(what: str, *, where: str | None = _USER_LINE, fix: str | None = None) -> str:
    """Builds the "what / where / fix" message every autostate error uses;
    ``where`` defaults to the user's line that led here, ``None`` for none."""
    if where is _USER_LINE:
        where = user_location()
    parts = [what]
    if where:
        parts.append(f"  at {where}")
    if fix:
        parts.append(f"  fix: {fix}")
    return "\n".join(parts)


def holder_fix(value: Any) -> str | None:
    """The fix a class of plain objects gives for a model that keeps one of them
    where autostate cannot follow it (its class attribute
    ``_autostate_holder_fix``, as ``autostate.nn.KeyStream``'s), where the
    general fix would be to decorate the class: None if it gives none."""
    fix = getattr(type(value), "_autostate_holder_fix", None)
    return fix if isinstance(fix, str) else None


class InvalidArgumentError(AutostateError, ValueError):
    """An argument has a value autostate does not accept (an unknown mode)."""


class InvalidTypeError(AutostateError, TypeError):
    """An argument or a state has a type autostate cannot work with."""


class MethodNotFoundError(AutostateError, AttributeError):
    """``f.<name>`` names no method of the functionalized model's class."""


class StateSharingError(AutostateError, ValueError):
    """Two state requests conflict under the chosen ``state_sharing`` mode."""


class CategoryArgumentError(AutostateError, ValueError):
    """``category`` and ``category_predicate`` were both given, or neither."""


class UnhandledLocalStateError(AutostateError, RuntimeError):
    """A state was read or written outside the handler that owns it."""


class DecorationError(AutostateError, ValueError):
    """``@stateful`` found code it cannot rewrite; raised at decoration time."""


class SourceUnavailableError(DecorationError):
    """The class source cannot be found, so it cannot be rewritten."""


class TracedEagerStateError(AutostateError, RuntimeError):
    """An eager model was asked to store a JAX tracer (called under a transform)."""


class StaticStateError(AutostateError, ValueError):
    """A functionalized call assigned a static state (a bool, int, str, enum) a new value."""


class ControlFlowStateError(AutostateError, TypeError):
    """A state cannot be threaded through ``lax`` control flow as written."""


class EscapedStateError(AutostateError, RuntimeError):
    """A state holds a tracer of a ``lax`` body that autostate did not thread."""


class StackError(AutostateError, ValueError):
    """Layers that cannot be one stack, or a layer of a stack asked what its slice cannot hold."""


def user_location(tb: Any = None) -> str | None:
    """``file:line`` of the innermost frame of the user's code on the stack (or in
    traceback ``tb``), so errors raised deep inside still name the user's line."""
    # Folders, each ending in a separator: ``.../jax/`` is not a prefix of a
    # user's ``.../jax_md/``, nor autostate's folder of ``autostate_examples/``.
    skip = [os.path.join(os.path.dirname(__file__), "")]
    for name in ("jax", "jaxlib"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            skip.append(os.path.join(os.path.dirname(module.__file__), ""))  # type: ignore[arg-type, type-var]
    stdlib = os.path.join(sysconfig.get_paths()["stdlib"], "")
    frames = traceback.extract_stack() if tb is None else traceback.extract_tb(tb)
    for frame in reversed(frames):
        filename = frame.filename
        if any(filename.startswith(prefix) for prefix in skip):
            continue
        if filename.startswith("<frozen "):  # the standard library, frozen into Python
            continue
        # The standard library, but not the packages installed inside it
        # (a Python without a virtual environment keeps site-packages there).
        top = filename[len(stdlib):].split(os.sep, 1)[0]
        if filename.startswith(stdlib) and top not in ("site-packages", "dist-packages"):
            continue
        return f"{filename}:{frame.lineno}"
    return None


def escaped_state_message(name: str, where: str | None = None) -> str:
    """The message of ``EscapedStateError`` for state ``name``."""
    return format_error(
        f"State {name!r} was assigned inside a jax.lax control-flow body, jax.checkpoint or "
        "another JAX transformation that autostate did not thread, so it holds a tracer of "
        "that body, which has ended.",
        where=where,
        fix="call autostate.scan / cond / switch / while_loop / fori_loop / map / checkpoint "
        "(same signatures as jax's) in that code, or move the call into a method of an "
        "@autostate.stateful class, where jax.lax.* is threaded automatically; apply "
        "jax.jit / vmap / grad to f from outside, not to a closure that assigns state.",
    )


class TracedValueError(AutostateError, TypeError):
    """A traced value was used where Python needs a concrete one (``if``,
    ``bool()``, ``float()``, ``math``, ``numpy``) in a traced call: under
    ``jax.jit`` every state is traced, Python-number states too.

    Each one raised is also the JAX error it explains
    (``jax.errors.TracerBoolConversionError`` and the like), so code that
    catches JAX's type still catches it.
    """


_TRACED_VALUE_ERRORS: dict[type, type] = {}


def traced_value_error(raised: BaseException, message: str) -> TracedValueError:
    """A ``TracedValueError`` that is also of ``raised``'s JAX type."""
    kind = type(raised)
    made = _TRACED_VALUE_ERRORS.get(kind)
    if made is None:
        made = _TRACED_VALUE_ERRORS[kind] = type(
            "TracedValueError",
            (TracedValueError, kind),
            {"__init__": Exception.__init__, "__module__": __name__, "__doc__": TracedValueError.__doc__},
        )
    return made(message)


class StateAccessError(AutostateError, AttributeError):
    """A state attribute does not exist (yet) on the instance."""


class HostStateError(AutostateError, RuntimeError):
    """A host-fallback state was misused (read before set, set in inference mode)."""


class HostStateTypeError(AutostateError, TypeError):
    """A host-fallback state is not an array (or a pytree of arrays)."""


class HostStateChangeError(HostStateTypeError, RuntimeError):
    """A host-fallback state changed shape, dtype or pytree structure.

    A ``RuntimeError`` as equinox's ``StateIndex`` raised, and still a
    ``TypeError`` (``HostStateTypeError``) as autostate raised before.
    """


class StateDictError(AutostateError, ValueError):
    """A state or parameter dict does not match the model it is loaded into."""


class CheckpointError(AutostateError, ValueError):
    """A saved checkpoint is truncated, corrupted, or does not fit the model."""


class StateDictWarning(UserWarning):
    """``strict=False`` loading skipped keys.

    ``missing``, ``unexpected`` and ``mismatched`` hold ``(kind, key)`` pairs,
    ``kind`` being ``"state"`` or ``"parameter"``.
    """

    def __init__(
        self, message: str, missing: tuple[tuple[str, str], ...] = (),
        unexpected: tuple[tuple[str, str], ...] = (), mismatched: tuple[tuple[str, str], ...] = (),
    ):
        super().__init__(message)
        self.missing = missing
        self.unexpected = unexpected
        self.mismatched = mismatched


# --- the local-state engine's refusals (autostate.effects) ----------------------------


def unhandled_request_error(request: Any) -> UnhandledLocalStateError:
    """A request's ``get`` / ``set`` outside a handler."""
    # Mirrors penzai v1, where the effect methods of an unhandled request raise.
    label = repr(request.name) if request.name is not None else "(unnamed)"
    return UnhandledLocalStateError(format_error(
        f"State {label} (category {request.category!r}) is unhandled: the body "
        f"still holds its {type(request).__name__}, which has no running value.",
        fix="handle it first, `handler, states = handle_local_states(body, "
        "category=...)`, then call `out, states = handler((arg, states))`.",
    ))


def unhandled_ref_error(ref: Any, reason: str) -> UnhandledLocalStateError:
    """A handled reference used while its handler's call is not running:
    ``reason`` is ``"not running"``, or ``"another call"`` (a call with an
    equal id runs instead)."""
    if reason == "another call":
        return UnhandledLocalStateError(format_error(
            f"State {ref.name!r} (category {ref.category!r}) belongs to a "
            "functionalized call that is not running: it was reached inside "
            "another model's call (a generator, closure or bound method of the "
            "model, kept after its own call returned).",
            fix="use the model's state inside its own call, or freeze it first "
            "(autostate.freeze(f, states)) and pass the frozen model.",
        ))
    return UnhandledLocalStateError(format_error(
        f"State {ref.name!r} (category {ref.category!r}) is unhandled: it "
        f"belongs to handler {ref.handler_id!r}, which is not running.",
        fix="call the handler instead of its body: `out, states = "
        "handler((arg, states))`, or for a functionalized model `out, states = "
        "f(states, *args)`; use autostate.freeze(f, states) to get a model "
        "that runs on its own again. A function JAX runs after the call has "
        "ended cannot read a state either: a host callback (jax.debug.callback, "
        "jax.pure_callback) of a call under jax.jit. Pass the state's value in "
        "instead, as the callback's argument (`jax.debug.callback(fn, self.s)`).",
    ))


def duplicate_name_error(
    name: str, first: str | None = None, second: str | None = None
) -> StateSharingError:
    """Two states handled together with one explicit name, where sharing does not allow it."""
    where = f" (at {first} and at {second})" if first and second and first != second else ""
    return StateSharingError(format_error(
        f"Detected two local states with the same explicit name {name!r}{where}.",
        fix="give the states distinct names (autostate.state(..., name=...)); to share "
        "one state between two places, reach the same model instance from both (or "
        "reuse one InitialLocalStateRequest object and handle with "
        "state_sharing='allowed'); state_sharing='unsafe' merges same-named states.",
    ))


def handled_twice_error(name: str, handler_id: Any, path: str) -> StateSharingError:
    """A body handled again with the id of the handler whose state it already holds."""
    return StateSharingError(format_error(
        f"The body already holds state {name!r} handled by a handler with "
        f"id {handler_id!r} (at {path or 'the root'}); handling it again with the "
        "same id would mix the two handlers' states.",
        fix="freeze the body first (freeze_local_states / autostate.freeze), or "
        "pass another handler_id (or another category to functionalize()).",
    ))


def states_not_dict_error(states: Any) -> InvalidTypeError:
    """A handler called with states that are not a dict."""
    return InvalidTypeError(format_error(
        f"States must be a dict of name -> value, got {type(states).__name__}.",
        fix="pass the dict returned by handle_local_states/functionalize.",
    ))


def missing_state_error(name: str, handler_id: Any, names: Any) -> UnhandledLocalStateError:
    """A handled reference whose state is not among ``names``, the states its
    running handler was given."""
    return UnhandledLocalStateError(format_error(
        f"State {name!r} is missing from the states dict given to handler "
        f"{handler_id!r} (it has {sorted(names)}).",
        fix="pass the states dict returned by handle_local_states/functionalize "
        "(or by the previous call) unchanged in its keys.",
    ))


def shared_request_read_error(name: str) -> UnhandledLocalStateError:
    """A ``SharedLocalStateRequest`` read or written outside a handler."""
    return UnhandledLocalStateError(format_error(
        f"Shared state {name!r} has no value outside a handler.",
        fix="handle the tree with handle_local_states(..., state_sharing='allowed').",
    ))


def category_argument_error(category: Any, category_predicate: Any) -> CategoryArgumentError:
    """Neither or both of ``category`` and ``category_predicate`` given."""
    return CategoryArgumentError(format_error(
        "Exactly one of `category` and `category_predicate` must be given "
        f"(got category={category!r}, category_predicate={category_predicate!r}).",
        fix="pass category='state' to handle one category, or "
        "category_predicate=lambda c: True to handle all of them.",
    ))


def sharing_mode_error(state_sharing: Any) -> InvalidArgumentError:
    """A ``state_sharing`` argument that is not one of the three modes."""
    return InvalidArgumentError(format_error(
        f"Unknown state_sharing mode {state_sharing!r}.",
        fix="use 'forbidden', 'allowed' or 'unsafe'.",
    ))


def shared_request_forbidden_error(name: str) -> StateSharingError:
    """A ``SharedLocalStateRequest`` handled with ``state_sharing="forbidden"``."""
    return StateSharingError(format_error(
        "SharedLocalStateRequest must only be used when state_sharing is set "
        f"to 'allowed' or 'unsafe' (state {name!r}).",
        fix="handle with state_sharing='allowed'.",
    ))


def shared_request_first_error(name: str) -> StateSharingError:
    """A ``SharedLocalStateRequest`` met before any request giving its state a value."""
    return StateSharingError(format_error(
        f"SharedLocalStateRequest {name!r} must appear after some other state "
        "request with the same name and an explicit value.",
        fix="put the Initial/Frozen request with this name first in the tree.",
    ))


def freeze_handler_type_error(handler: Any) -> InvalidTypeError:
    """``freeze_local_states`` given something other than a handler."""
    return InvalidTypeError(format_error(
        f"freeze_local_states expects a WithFunctionalLocalState, got "
        f"{type(handler).__name__}.",
        fix="pass the handler returned by handle_local_states.",
    ))


def freeze_missing_state_error(name: str, names: Any) -> UnhandledLocalStateError:
    """Freezing a body whose state ``name`` is not among ``names``, the states given."""
    return UnhandledLocalStateError(format_error(
        f"Cannot freeze: state {name!r} is missing from the states dict "
        f"(it has {sorted(names)}).",
        fix="pass the states dict returned by functionalize/the last call.",
    ))


def conflicting_definitions_error(name: str) -> StateSharingError:
    """Hoisting two definitions of one shared state that are not the same initializer."""
    return StateSharingError(format_error(
        "Detected two local states with the same explicit name "
        f"{name!r} but different initializers or values! This is only "
        "allowed `unsafe` is set to `True`.",
        fix="define a shared state once (one FrozenLocalStateRequest, or "
        "InitialLocalStateRequests sharing one initializer object) and use "
        "SharedLocalStateRequests elsewhere, or pass unsafe=True to keep the "
        "first definition.",
    ))


def mismatched_category_error(name: str, got: Any, expected: Any) -> StateSharingError:
    """Embedding a request whose category differs from the shared request it replaces."""
    return StateSharingError(format_error(
        "Tried to substitute values with mismatched categories! Got "
        f"{got}, expected {expected} (state {name!r}).",
        fix="embed requests of the category the tree's SharedLocalStateRequest "
        "asks for (the requests dict returned by hoist_shared_state_requests).",
    ))


def rename_fn_type_error(rename_fn: Any) -> InvalidTypeError:
    """``rename_local_states`` given a ``rename_fn`` that is not callable."""
    return InvalidTypeError(format_error(
        f"rename_fn must be a function of a state name, got {type(rename_fn).__name__}.",
        fix="pass e.g. `lambda name: 'encoder.' + name`.",
    ))


def renamed_to_non_str_error(name: str, new_name: Any) -> InvalidTypeError:
    """A ``rename_fn`` that returned something other than a str for state ``name``."""
    return InvalidTypeError(format_error(
        f"rename_fn returned {type(new_name).__name__} {new_name!r:.80} for state "
        f"{name!r}; a state name must be a str.",
        fix="return the new name as a string, e.g. `lambda name: 'encoder.' + name`.",
    ))
