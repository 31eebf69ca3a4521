"""Gradients of functions of models kept as objects.

``autostate.value_and_grad(loss)(model, batch)`` differentiates a function of
a model with respect to its trainable parameters (the leaves of its ``f``)
and leaves the model as the plain call would: a state the forward pass
assigns (running statistics, a step counter) lands in the model with its
primal value; ``optimizers.Optimizer`` applies the gradients.

Both work eagerly and inside ``autostate.jit``, where they make one compiled
training step of a model object::

    @autostate.jit
    def train_step(model, opt, x, y):
        loss, grads = autostate.value_and_grad(loss_fn)(model, x, y)
        opt.update(grads)
        return loss

The gradients are a ``FunctionalModel``: a pytree of the trainable
parameters with the paths of ``f`` (so optax masks written for ``f`` apply),
read like the model (``grads.norm.scale``, ``grads.blocks[0].w``).
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, Literal, ParamSpec, Protocol, TypeVar, overload

import jax
import jax.numpy as jnp

from autostate import graph as _graph
from autostate import tree as _tree
from autostate.api import functionalize
from autostate.effects.local_state import HandledLocalStateRef
from autostate.errors import InvalidArgumentError, InvalidTypeError, format_error, user_location
from autostate.functional import ConstantRef, FunctionalModel, instance_pairs
from autostate.lifetime import contains_tracer

if TYPE_CHECKING:
    from autostate.lifting.core import Swapped

__all__ = ["grad", "value_and_grad"]


M = TypeVar("M")
P = ParamSpec("P")
V = TypeVar("V", covariant=True)
A = TypeVar("A", covariant=True)


# The types. With the model first (``argnums=0``, the default) the gradient
# is shaped like that model's f: ``FunctionalModel[Net]``, read like the
# model (``grads.fc.weight``). ``Net`` is taken from the model a call is
# given, not from ``fn``'s first parameter, so an unannotated lambda
# (``value_and_grad(lambda m: ...)``) types as well; the value is what ``fn``
# returns, the other arguments are ``fn``'s. With ``argnums`` given (other
# models), ``Any``.
class _ValueAndGrad(Protocol[P, V]):
    def __call__(self, model: M, /, *args: P.args, **kwargs: P.kwargs) -> tuple[
        V, FunctionalModel[M]
    ]: ...


class _Grad(Protocol[P]):
    def __call__(self, model: M, /, *args: P.args, **kwargs: P.kwargs) -> FunctionalModel[M]: ...


class _GradAux(Protocol[P, A]):
    def __call__(self, model: M, /, *args: P.args, **kwargs: P.kwargs) -> tuple[
        FunctionalModel[M], A
    ]: ...


@overload
def value_and_grad(
    fn: Callable[Concatenate[Any, P], V], argnums: Literal[0] = 0, has_aux: bool = False,
    **options: Any,
) -> _ValueAndGrad[P, V]: ...


@overload
def value_and_grad(
    fn: Callable[P, Any], argnums: int | Sequence[int], has_aux: bool = False,
    **options: Any,
) -> Callable[P, tuple[Any, Any]]: ...


def value_and_grad(
    fn: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False,
    **options: Any,
) -> Callable[..., tuple[Any, Any]]:
    """The value of ``fn`` and its gradient with respect to the trainable
    parameters of the model(s) at ``argnums``.

    ``fn`` takes models (and anything else) and returns a scalar (with
    ``has_aux``, ``(scalar, aux)``). It may call the models' methods, which
    may assign their states: those writes land in the models with their
    primal values, as the plain call would leave them, and states are never
    differentiated. A model's parameters may not be assigned inside ``fn``
    (do that after, with the gradient: ``Optimizer.update``).

    Args:
        fn: the function to differentiate.
        argnums: which positional argument(s) are the differentiated models.
        has_aux: ``fn`` returns ``(value, aux)``.
        **options: the other options of ``jax.value_and_grad`` (``holomorphic``,
            ``allow_int``, ``reduce_axes``).

    Returns:
        A function returning ``(value, grads)`` (``((value, aux), grads)`` with
        ``has_aux``). ``grads`` is shaped like ``f`` of the model, a
        ``FunctionalModel`` of gradients read like the model
        (``grads.norm.scale``); a tuple of them for a tuple ``argnums``.

    Examples:
        >>> @autostate.stateful
        ... class Scale:
        ...     def __init__(self):
        ...         self.w = jnp.full(2, 3.0)
        ...         self.calls = jnp.zeros((), jnp.int32)
        ...
        ...     def __call__(self, x):
        ...         self.calls += 1
        ...         return (self.w * x).sum()
        >>> model = Scale()
        >>> loss, grads = autostate.value_and_grad(lambda m, x: m(x))(model, jnp.ones(2))
        >>> print(loss, grads.w, model.calls)
        6.0 [1. 1.] 1
    """
    numbers = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    def run(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        # (the lift: read by the first call)
        from autostate.lifting.autodiff import value_and_grad as lifted_value_and_grad
        from autostate.lifting.core import write_back

        models = [_model_at(args, i) for i in numbers]
        _check_apart(models, numbers)
        pairs = [functionalize(model) for model in models]
        fs = [f for f, _ in pairs]

        def loss(*diffed: FunctionalModel) -> tuple[Any, Any]:
            # Each model's new states come out with the value (nothing the
            # derivative captures is changed in place).
            def nested(k: int, handled: list[Any]) -> tuple[Any, list[dict[str, Any]]]:
                if k == len(diffed):
                    called = list(args)
                    for i, model in zip(numbers, handled):
                        called[i] = model
                    with _differentiated_through_any_path(models, diffed):
                        return fn(*called, **kwargs), []
                (out, inner), written = diffed[k]._run(
                    pairs[k][1], lambda model: nested(k + 1, [*handled, model]), (), {}
                )
                return out, [written, *inner]

            out, written = nested(0, [])
            value, aux = out if has_aux else (out, None)
            return value, (aux, written)

        # The lifted derivative, as a method's jax.value_and_grad: the other
        # models the function reaches (a discriminator called on the
        # generator's output, a teacher) keep their state writes, with their
        # primal values, as the plain call leaves them.
        (value, (aux, new)), grads = lifted_value_and_grad(
            loss, argnums=tuple(range(len(fs))), has_aux=True, **options
        )(*fs)
        for model, (f, before), states in zip(models, pairs, new):
            # The states land as a lax body's do: the lift's one write-back.
            write_back(_own_states(model, f), before, states)
        grads = grads[0] if isinstance(argnums, int) else grads
        return ((value, aux) if has_aux else value), grads

    functools.update_wrapper(run, fn, updated=())
    return run


@overload
def grad(
    fn: Callable[Concatenate[Any, P], Any], argnums: Literal[0] = 0,
    has_aux: Literal[False] = False, **options: Any,
) -> _Grad[P]: ...


@overload
def grad(
    fn: Callable[Concatenate[Any, P], tuple[Any, A]], argnums: Literal[0] = 0, *,
    has_aux: Literal[True], **options: Any,
) -> _GradAux[P, A]: ...


@overload
def grad(
    fn: Callable[P, Any], argnums: int | Sequence[int], has_aux: bool = False,
    **options: Any,
) -> Callable[P, Any]: ...


def grad(
    fn: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False,
    **options: Any,
) -> Callable[..., Any]:
    """The gradient of ``fn`` with respect to the trainable parameters of the
    model(s) at ``argnums``: ``value_and_grad`` without the value (with
    ``has_aux``, ``(grads, aux)``).

    Examples:
        >>> @autostate.stateful
        ... class Scale:
        ...     def __init__(self):
        ...         self.w = jnp.full(2, 3.0)
        ...
        ...     def __call__(self, x):
        ...         return (self.w * x).sum()
        >>> print(autostate.grad(lambda m, x: m(x))(Scale(), jnp.arange(2.0)).w)
        [0. 1.]
    """
    both = value_and_grad(fn, argnums, has_aux, **options)

    def run(*args: Any, **kwargs: Any) -> Any:
        value, grads = both(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    functools.update_wrapper(run, fn, updated=())
    return run


def _refuse_jax_grad(model: Any, jax_frame: types.FrameType) -> None:
    """``jax.grad(loss)(model)`` with an integer or key state: JAX's refusal said
    in the model's words (which states, and what differentiates the parameters)."""
    if jax_frame.f_locals.get("allow_int") or jax_frame.f_locals.get("holomorphic"):
        return
    from autostate.state_dicts import state_dict

    kept = [
        f"{name!r} ({value.dtype})"
        for name, value in state_dict(model).items()
        if isinstance(value, jax.Array) and not jnp.issubdtype(value.dtype, jnp.inexact)
    ]
    if not kept:
        return
    raise InvalidTypeError(
        format_error(
            f"jax.grad differentiates every array of the {type(model).__name__} it is "
            f"given, its states included, and cannot differentiate its state"
            f"{'s' if len(kept) > 1 else ''} {', '.join(kept[:3])}"
            f"{', ...' if len(kept) > 3 else ''}.",
            where=user_location(),
            fix="use `autostate.grad(loss)(model)` (or `autostate.value_and_grad`): it "
            "differentiates the model's parameters, gives their gradients in the model's "
            "shape, and lets the loss update its states (running statistics, counters, "
            "keys).",
        )
    )


_graph.on_jax_grad(_refuse_jax_grad)


def _model_at(args: tuple, i: int) -> Any:
    model = args[i] if -len(args) <= i < len(args) else None
    if not _graph.is_stateful_instance(model):
        raise InvalidArgumentError(
            format_error(
                f"autostate.value_and_grad differentiates the model at argument {i}, but it "
                f"is {type(model).__name__}, not an instance of a @stateful class.",
                where=user_location(),
                fix="pass the model at that position, or set argnums to the models' "
                "positions; for arrays and pytrees use jax.value_and_grad.",
            )
        )
    return model


def _check_apart(models: Sequence[Any], numbers: Sequence[int]) -> None:
    """Refuses differentiated models that share an instance: each is
    differentiated through its own ``f``, and a shared sub-model's state
    written through both would keep only one of the writes."""
    seen: dict[int, int] = {}
    for model, i in zip(models, numbers):
        for obj in _graph.instances_of(model):
            j = seen.setdefault(id(obj), i)
            if j != i:
                raise InvalidArgumentError(
                    format_error(
                        f"autostate.value_and_grad differentiates the models at arguments "
                        f"{j} and {i}, which share a {type(obj).__name__}: each is "
                        "differentiated on its own, so the shared instance's state writes "
                        "would not add up.",
                        where=user_location(),
                        fix="hold both in one @stateful model and differentiate that one "
                        "argument; its gradient then reads as both.",
                    )
                )


@contextlib.contextmanager
def _differentiated_through_any_path(models: Sequence[Any], diffed: Sequence[FunctionalModel]) -> Iterator[None]:
    """For the call of the differentiated function, the models' own instances
    hold the parameters being differentiated, so a path that reaches one other
    than the argument (a parent model given as another argument, the
    function's closure: ``grad(lambda head: loss(model))(model.head)``) is
    differentiated too, as the one object of the plain call is."""
    swapped: list[tuple[dict[str, Any], str, Any]] = []
    try:
        for model, f in zip(models, diffed):
            for obj, twin in instance_pairs(model, f):
                states = _tree.info_of(obj).state
                for attr, value in twin.__dict__.items():
                    if attr in states or _graph.holds_instance(value) or not contains_tracer(value):
                        continue
                    old = obj.__dict__.get(attr)
                    new = jax.tree_util.tree_map(
                        lambda n, o: o if type(n) is ConstantRef else n,
                        value, _graph.materialized(old), is_leaf=lambda x: type(x) is ConstantRef,
                    )
                    swapped.append((obj.__dict__, attr, old))
                    obj.__dict__[attr] = new
        yield
    finally:
        for held, attr, old in reversed(swapped):
            held[attr] = old


def _own_states(model: Any, f: FunctionalModel) -> Swapped:
    """``model``'s eager state slots, each named as ``f``'s states dict names it."""
    return [
        (obj, attr, obj.__dict__[attr], ref.name)
        for obj, twin in instance_pairs(model, f)
        for attr in _tree.info_of(obj).state
        if type(ref := twin.__dict__.get(attr)) is HandledLocalStateRef
    ]


def __getattr__(name: str) -> Any:
    # ``Optimizer`` lived here until it moved to ``optimizers`` (so that this
    # module, imported by ``import autostate``, decorates nothing): pickles
    # made before name it here.
    if name == "Optimizer":
        from autostate.optimizers import Optimizer

        return Optimizer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
