"""``jax.checkpoint`` and the derivatives (``grad``, ``value_and_grad``,
``jacfwd``, ``jacrev``, ``jacobian``, ``hessian``, ``jvp``, ``vjp``,
``linearize``), and ``custom_vjp``/``custom_jvp``: ``checkpoint``'s states go
into its arguments and output, a derivative's into its auxiliary output; a
custom rule's run as plain Python, or a write JAX traces away is refused."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

from autostate.effects.local_state import (
    handler_cells,
    run_with_states,
    running_call,
    running_calls,
    running_cells,
)
from autostate.errors import EscapedStateError, format_error, user_location
from autostate.lifetime import LostValue, ended_trace_of, holds_escaped_tracer
from autostate.lifting.core import (
    PassedModels,
    after_states,
    assigned_since,
    bound_to,
    current_values,
    land,
    lift,
    probed,
    settled,
    traceable,
    transformation,
    with_eager_states,
)


def checkpoint(fun: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    """``jax.checkpoint`` (``jax.remat``) of a function that may read and assign state.

    Loss, gradients and new states equal those without remat; only what is
    saved for the backward pass changes. ``autostate.remat`` is the same
    function, under JAX's other name.

    Args:
        fun: the function to rematerialize.
        **options: those of ``jax.checkpoint`` (``prevent_cse``, ``policy``,
            ``static_argnums``).

    Returns:
        The checkpointed function.

    Examples:
        >>> @autostate.stateful
        ... class Block:
        ...     def __init__(self):
        ...         self.calls = jnp.zeros((), jnp.int32)
        ...         self.w = jnp.full(2, 3.0)
        ...
        ...     def __call__(self, x):
        ...         self.calls += 1
        ...         return jnp.sin(self.w * x).sum()
        >>> f, states = Block().functionalize()
        >>> loss = lambda f, s, x: autostate.checkpoint(f)(s, x)
        >>> (y, states), grads = jax.value_and_grad(loss, has_aux=True)(f, states, 0.0)
        >>> print(y, states["calls"], grads.model.w)
        0.0 1 [0. 0.]
    """
    static = options.pop("static_argnums", None) or ()
    static = (static,) if isinstance(static, int) else tuple(static)

    return transformation(
        fun,
        "a jax.checkpoint",
        lambda args, kwargs: _checkpoint_call(fun, args, kwargs, static, options),
    )


remat = checkpoint


def _checkpoint_call(
    fun: Callable, args: tuple, kwargs: dict, static: tuple[int, ...], options: dict
) -> Any:
    passed = PassedModels(args, received_at=None, returned_at=None, loop=False)
    return passed.result(_checkpoint_lifted(passed.body(fun), args, kwargs, static, options))


def _checkpoint_lifted(
    fun: Callable, args: tuple, kwargs: dict, static: tuple[int, ...], options: dict
) -> Any:
    cells = running_cells()
    plain = functools.partial(jax.checkpoint, static_argnums=static, **options)
    if not cells:
        return plain(fun)(*args, **kwargs)  # type: ignore[call-arg]
    what = "a jax.checkpoint"
    written = probed(cells, what, lambda: fun(*args, **kwargs))
    if any(i >= len(args) or i < -len(args) for i in static):
        written = []  # a static argument given by keyword: JAX's own error, its numbers the user's

    def as_arguments(pure_of: Callable, values: list[Any]) -> tuple[Any, list[Any]]:
        rematted = jax.checkpoint(pure_of(fun), static_argnums=after_states(static), **options)
        return rematted(values, *args, **kwargs)

    return lift(
        cells, written, what, as_arguments,
        lambda: plain(fun)(*args, **kwargs),  # type: ignore[call-arg]
    )


# --- derivatives --------------------------------------------------------------------
# A derivative's placement: the states the function assigns leave it as
# auxiliary outputs and are assigned after, so each keeps its primal value;
# one it only reads is a constant of the derivative. ``apply(g, has_aux)``
# takes the derivative of ``g``; ``split`` takes the states' values out of
# what it gave with ``has_aux=True``.


def _with_aux_states(
    fun: Callable, has_aux: bool, what: str,
    apply: Callable[[Callable, bool], Any], split: Callable[[Any, bool], tuple[Any, dict[int, Any]]],
) -> Any:
    """``fun``'s derivative, ``apply(fun, has_aux)``, with the states ``fun``
    assigns leaving it as auxiliary outputs: it runs once, as plain Python
    does, and only the states it assigned travel."""
    cells = running_cells()
    if not cells:
        return apply(fun, has_aux)
    before = current_values(cells)

    def threaded(*inner: Any, **inner_kwargs: Any) -> tuple[Any, tuple[Any, dict[int, Any]]]:
        # A container of arrays is the body's own copy, so a change in place
        # (``d = self.stats; d["m"] = ...``) is seen, and leaves it as an
        # assignment does, with its primal value.
        values = [settled(v) if traceable(v) else v for v in before]
        changed = assigned_since(values)
        with bound_to(cells, cells, values, what):
            out = settled(fun(*inner, **inner_kwargs))
            after = current_values(cells)
        out, aux = out if has_aux else (out, None)
        written = {i: after[i] for i in changed(after)}
        return out, (aux, written)

    result, assigned = split(apply(threaded, True), has_aux)
    land(cells, assigned)
    return result


def _split_pair(raw: Any, has_aux: bool) -> tuple[Any, dict[int, Any]]:
    """``(derivative, aux)``: grad, jacfwd, jacrev, jacobian, hessian."""
    found, (aux, values) = raw
    return ((found, aux) if has_aux else found), values


def _split_value(raw: Any, has_aux: bool) -> tuple[Any, dict[int, Any]]:
    """``((value, aux), grad)``: value_and_grad."""
    (value, (aux, values)), grads = raw
    return (((value, aux) if has_aux else value), grads), values


def _split_last(raw: Any, has_aux: bool) -> tuple[Any, dict[int, Any]]:
    """``(..., aux)``: jvp, vjp, linearize."""
    *rest, (aux, values) = raw
    return ((*rest, aux) if has_aux else tuple(rest)), values


def _lifted(
    name: str, roots: tuple, fun: Callable, has_aux: bool,
    apply: Callable[[Callable, bool], Any], split: Callable[[Any, bool], tuple[Any, dict[int, Any]]],
) -> Any:
    """``jax.<name>`` of ``fun`` (``apply``), eager models' states handled for the call."""
    what = f"a jax.{name}"
    return with_eager_states(
        roots, lambda: _with_aux_states(fun, has_aux, what, apply, split), what, once=True
    )


def _derivative(
    jax_fn: Callable[..., Any], split: Callable[[Any, bool], tuple[Any, dict[int, Any]]]
) -> Callable[..., Any]:
    """What stands for ``jax_fn``, a transformation of ``fun`` taking ``argnums``."""
    name = jax_fn.__name__

    def derivative(fun: Callable[..., Any], argnums: Any = 0, has_aux: bool = False,
                   **options: Any) -> Callable[..., Any]:
        def differentiated(*args: Any, **kwargs: Any) -> Any:
            def apply(g: Callable, aux: bool) -> Any:
                return jax_fn(g, argnums=argnums, has_aux=aux, **options)(*args, **kwargs)

            return _lifted(name, (fun, args, kwargs), fun, has_aux, apply, split)

        functools.update_wrapper(differentiated, fun, updated=())
        return differentiated

    return _documented(derivative, name)


def _at_primals(jax_fn: Callable[..., Any]) -> Callable[..., Any]:
    """What stands for ``jax_fn``, applied at ``*primals`` (vjp, linearize)."""
    name = jax_fn.__name__

    def derivative(fun: Callable[..., Any], *primals: Any, has_aux: bool = False,
                   **options: Any) -> Any:
        def apply(g: Callable, aux: bool) -> Any:
            return jax_fn(g, *primals, has_aux=aux, **options)

        return _lifted(name, (fun, primals), fun, has_aux, apply, _split_last)

    return _documented(derivative, name)


def jvp(fun: Callable[..., Any], primals: Any, tangents: Any, has_aux: bool = False) -> Any:
    def apply(g: Callable, aux: bool) -> Any:
        return jax.jvp(g, primals, tangents, has_aux=aux)

    return _lifted("jvp", (fun, primals, tangents), fun, has_aux, apply, _split_last)


def _documented(derivative: Callable[..., Any], name: str) -> Callable[..., Any]:
    derivative.__name__ = derivative.__qualname__ = name
    derivative.__doc__ = (
        f"``jax.{name}`` of a function that may read and assign state (what a "
        f"method's ``jax.{name}(...)`` calls).\n\nA state is never differentiated: "
        "read inside, it is a constant; assigned inside, it keeps the primal value, "
        "as the same function with the state passed in by hand would give it."
    )
    return derivative


grad = _derivative(jax.grad, _split_pair)
value_and_grad = _derivative(jax.value_and_grad, _split_value)
jacfwd = _derivative(jax.jacfwd, _split_pair)
jacrev = _derivative(jax.jacrev, _split_pair)
jacobian = _derivative(jax.jacobian, _split_pair)
hessian = _derivative(jax.hessian, _split_pair)
vjp = _at_primals(jax.vjp)
linearize = _at_primals(jax.linearize)
jvp = _documented(jvp, "jvp")


# --- custom derivatives ------------------------------------------------------------
# A function with a custom derivative runs as plain Python where JAX calls it
# on concrete values (eagerly, ``f`` outside ``jit``), so a state it assigns
# there lands. Where JAX traces it into its own sub-program (under ``jit``)
# no placement can return the write: a state left holding a tracer of that
# finished trace is refused at the call, naming the state and the line, and
# the states are put back.


def _custom_call(call: Callable[[], Any], roots: tuple, what: str) -> Any:
    def checked() -> Any:
        cells = running_cells()
        before = [cell.value for cell in cells]
        out = call()
        for cell, value in zip(cells, before):
            if cell.value is not value and holds_escaped_tracer(cell.value):
                name = cell.name
                for c, v in zip(cells, before):
                    c.value = v
                raise EscapedStateError(
                    format_error(
                        f"State {name!r} is assigned inside {what} (or its rules) that JAX "
                        "traced into its own program, so the state would hold a tracer of "
                        "that finished program.",
                        where=user_location(),
                        fix="assign the state outside the function with the custom "
                        "derivative: return the new value from it and assign it after the "
                        "call.",
                    )
                )
        return out

    return with_eager_states(roots, checked, what)


def _reentering(fn: Callable[..., Any], calls: list[tuple[Any, Any, dict[str, Any]]],
                what: str, at_end: bool = False) -> Callable[..., Any]:
    """``fn`` (a custom derivative or one of its rules), which JAX may trace after
    its call ended: then it reads the states the handlers running at the call
    (``calls``: each one's cells) had there, or, ``at_end`` (the backward rule,
    which plain Python runs after the method returned), those they had when the
    call ended; assigning them is refused (the call is over)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        refused: list[BaseException] = []
        gone = [
            (hid, _unless_ended(
                {name: cell.value for name, cell in cells.items()} if at_end else values,
                what, getattr(fn, "__name__", "the rule"), refused,
            ))
            for hid, cells, values in calls if running_call(hid) is None
        ]

        def within(k: int) -> Any:
            if k == len(gone):
                return fn(*args, **kwargs)
            cells = handler_cells(gone[k][0])
            before = {name: cell.value for name, cell in cells.items()}
            out = within(k + 1)
            for name, cell in cells.items():
                if cell.value is not before[name]:
                    refused.append(EscapedStateError(
                        format_error(
                            f"State {name!r} is assigned inside {what}, which JAX traced "
                            "after the call that called it had ended (under jax.checkpoint), "
                            "so the write has no call to land in.",
                            where=user_location(),
                            fix="assign the state outside the function with the custom "
                            "derivative: return the new value from it and assign it after "
                            "the call.",
                        )
                    ))
                    raise refused[-1]
            return out

        run_in = within
        for hid, values in reversed(gone):
            run_in = functools.partial(_run_states, hid, values, run_in)
        try:
            return run_in(0)
        except jax.errors.UnexpectedTracerError:
            # A value it reads (a parameter, a state) was one of a lax body or
            # vmap that has ended by now: JAX's own closure, or a state's cell.
            raise EscapedStateError(_late_read_message(what)) from None
        except EscapedStateError as error:
            if not gone or any(error is r for r in refused):
                raise
            raise EscapedStateError(_late_read_message(what)) from None

    functools.update_wrapper(run, fn)
    return run


def _unless_ended(
    values: dict[str, Any], what: str, rule: str, refused: list[BaseException]
) -> dict[str, Any]:
    """The states a call that has ended left, for a rule JAX traces now: one
    whose value is a tracer of a trace that has ended (the ``jax.checkpoint``
    or ``jax.jit`` the call ran in, whose derivative is taken outside it) has
    no value here, and reading it raises (into ``refused``), at the line that
    reads it, where JAX would leak the tracer."""
    ended = {name: ended_trace_of(value) for name, value in values.items()}
    if all(kind is None for kind in ended.values()):
        return values
    kept = dict(values)
    for name, kind in ended.items():
        if kind is None:
            continue

        def late(name: str = name, kind: str = kind) -> EscapedStateError:
            refused.append(EscapedStateError(_ended_read_message(what, rule, name, kind)))
            return refused[-1]  # type: ignore[return-value]

        kept[name] = LostValue(name, what, None, None, late)
    return kept


# What JAX says it traced for, as the construct a user wrote.
_CONSTRUCTS = {"checkpoint / remat": "jax.checkpoint", "jit": "jax.jit", "pjit": "jax.jit"}


def _ended_read_message(what: str, rule: str, name: str, kind: str) -> str:
    construct = _CONSTRUCTS.get(kind, kind or "JAX transformation")
    return format_error(
        f"{what[0].upper()}{what[1:]} (its rule {rule}) reads state {name!r} from a {construct} "
        f"around the call: JAX traced the rule after that {construct}'s trace had ended, to "
        "take a derivative outside it, so the state's value there (a traced value of that "
        "trace) no longer exists. Plain JAX leaks the tracer of a function closing over it "
        "in the same way.",
        where=user_location(),
        fix="pass what the function and its rules read as arguments of the function "
        "(`g(x, self.scale)` with `def g(x, scale)`, its cotangent zeros), so that JAX "
        f"carries them, or take the derivative inside the {construct}.",
    )


def _late_read_message(what: str) -> str:
    return format_error(
        f"{what[0].upper()}{what[1:]} reads a value that lived only inside a lax body or "
        "jax.vmap that has ended: JAX traced the function (or its forward rule) again "
        "after the call, for a derivative. Such a value is a layer's slice of a stacked "
        "sub-model in a lax.scan, jax.vmap or a loop over the stack rolled into a scan, or "
        "a state the body assigned before the call.",
        where=user_location(),
        fix="pass what the function and its rules read as arguments of the function "
        "(`g(x, self.scale)` with `def g(x, scale)`, its cotangent zeros), so that JAX "
        "carries them.",
    )


def _run_states(handler_id: Any, values: dict[str, Any], call: Callable[[int], Any],
                k: int) -> Any:
    return run_with_states(handler_id, values, call, (k,), {})[0]


class _StateChecked:
    """The call of a function with a custom derivative, its states checked
    (``_custom_call``); the function and the rules JAX may trace after the
    call has ended read the states as they were at the call (``_reentering``)."""

    fun: Callable[..., Any]
    _deferred: tuple[str, ...] = ()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        what = f"a jax.{type(self).__name__} function"

        def call() -> Any:
            calls = [(entry[0], entry[1], {name: cell.value for name, cell in entry[1].items()})
                     for entry in running_calls()]
            target = self
            if calls:
                target = object.__new__(type(self))  # (custom_vjp's __new__ takes fun)
                target.__dict__.update(self.__dict__)
                for name in self._deferred:
                    rule = getattr(self, name, None)
                    if rule is not None:
                        setattr(target, name, _reentering(rule, calls, what, name == "bwd"))
            return super(_StateChecked, target).__call__(*args, **kwargs)  # type: ignore[misc]

        return _custom_call(call, (self.fun, args, kwargs), what)


class custom_vjp(_StateChecked, jax.custom_vjp):  # noqa: N801 - jax's name
    """``jax.custom_vjp`` whose function may assign state where JAX runs it on
    concrete values (what a method's ``jax.custom_vjp`` calls); a write JAX
    traces away is refused at the call."""

    # (The backward rule runs when the derivative is taken: after the method
    # returned, it reads the states as the call left them.)
    _deferred = ("fun", "fwd", "bwd")


class custom_jvp(_StateChecked, jax.custom_jvp):  # noqa: N801 - jax's name
    """``jax.custom_jvp`` whose function may assign state where JAX runs it on
    concrete values (what a method's ``jax.custom_jvp`` calls); a write JAX
    traces away is refused at the call."""

    _deferred = ("fun", "jvp")
