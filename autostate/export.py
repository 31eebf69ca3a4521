"""``autostate.export``: one method as a ``jax.export`` program that threads states.

The program takes and returns the flat state dict of ``state_dicts``; the
parameters are baked in as constants.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.export

from autostate import values as _values
from autostate.errors import InvalidArgumentError, InvalidTypeError, format_error

# (``state_dicts`` is imported by the first export: this module is imported by
# every ``import autostate``, as the package's ``export`` is this module's
# function.)


def _shape_dtype(x: Any) -> jax.ShapeDtypeStruct:
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    from autostate.state_dicts import array_spec

    spec = array_spec(x)
    if spec is None:
        raise InvalidTypeError(
            format_error(
                f"autostate.export takes arrays or jax.ShapeDtypeStruct as example "
                f"arguments, got a {type(x).__name__}.",
                fix="pass arrays (or pytrees of them); bind other arguments in a method.",
            )
        )
    if jax.dtypes.issubdtype(spec[1], jax.dtypes.extended):  # typed PRNG keys
        return jax.ShapeDtypeStruct(spec[0], spec[1])
    # Weakly typed as under jax.jit (a Python number, ``jnp.asarray(1.0)``): it
    # takes the dtype of what it meets, so the program promotes as the model does.
    weak = _values.is_python_number(x) or bool(getattr(x, "weak_type", False))
    return jax.ShapeDtypeStruct(spec[0], jax.dtypes.canonicalize_dtype(spec[1]), weak_type=weak)


def _static_positions(static_argnums: int | Sequence[int], count: int) -> set[int]:
    """``static_argnums`` as positions in ``example_args``; negative ones count from
    the end, as ``jax.jit``'s do, and one past either end is an error, as there."""
    given = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
    positions = set()
    for i in given:
        if not isinstance(i, int) or isinstance(i, bool):
            raise InvalidTypeError(
                format_error(
                    f"autostate.export: static_argnums holds a {type(i).__name__}, not an int.",
                    fix="give positions in the example arguments: static_argnums=1 or (1, 2).",
                )
            )
        if not -count <= i < count:
            given_args = "1 example positional argument was" if count == 1 else (
                f"{count} example positional arguments were"
            )
            raise InvalidArgumentError(
                format_error(
                    f"autostate.export: static_argnums={static_argnums!r} names position {i}, "
                    f"but {given_args} given.",
                    fix="count positions in the example arguments after the model, from 0 "
                    "(the states are not one of them), and pass every static argument's "
                    "value among them.",
                )
            )
        positions.add(i % count)
    return positions


def _is_traced_argument(value: Any) -> bool:
    from autostate.state_dicts import array_spec

    leaves = jax.tree_util.tree_leaves(value)
    return bool(leaves) and all(array_spec(leaf) is not None for leaf in leaves) and not any(
        isinstance(leaf, (bool, str)) for leaf in leaves
    )


def export(
    model: Any,
    *example_args: Any,
    method: str = "__call__",
    platforms: Sequence[str] | None = None,
    static_argnums: int | Sequence[int] = (),
    **example_kwargs: Any,
) -> jax.export.Exported:
    """``model.<method>`` as a ``jax.export.Exported`` that threads states.

    The program's call is ``(states, *args, **kwargs) -> (out, new_states)``
    where ``states`` is the flat dict ``state_dict(model)`` returns.
    Parameters are baked in as constants. Serialization needs the
    ``flatbuffers`` package (``pip install autostate[export]``).

    Args:
        model: a ``@stateful`` instance.
        *example_args: arrays or ``jax.ShapeDtypeStruct``s (or pytrees of
            them) giving the shapes and dtypes the program accepts.
        method: the method to export (default ``"__call__"``).
        platforms: lowering platforms (default: the current backend).
        static_argnums: positions in ``example_args`` that are Python values
            baked into the program (the call omits them); negative ones count
            from the end.
        **example_kwargs: keyword arguments; array-valued ones are program
            inputs, others (``train=False``, ``mode="greedy"``) are static and
            baked in.

    Returns:
        The ``jax.export.Exported``.

    Raises:
        InvalidArgumentError: a ``static_argnums`` position is out of range
            (as ``jax.jit`` raises).

    Examples:
        >>> @autostate.stateful
        ... class Counter:
        ...     def __init__(self):
        ...         self.count = jnp.zeros((), jnp.int32)
        ...         self.w = jnp.full(2, 3.0)
        ...
        ...     def __call__(self, x, power=1):
        ...         self.count += 1
        ...         return self.w * x**power
        >>> model = Counter()
        >>> program = autostate.export(model, jax.ShapeDtypeStruct((2,), jnp.float32))
        >>> blob = program.serialize()  # bytes: the Counter class is not needed to run it
        >>> program = jax.export.deserialize(blob)
        >>> out, states = program.call(autostate.state_dict(model), jnp.ones(2))
        >>> print(out, states)
        [3. 3.] {'count': Array(1, dtype=int32)}

        Static arguments are baked in; the program takes the others:

        >>> program = autostate.export(model, jnp.full(2, 2.0), 2, static_argnums=1)
        >>> print(program.call(autostate.state_dict(model), jnp.full(2, 2.0))[0])
        [12. 12.]
    """
    from autostate.state_dicts import flatten_states, handle_for_reading, unflatten_states

    f, states = handle_for_reading(model, "export", rebuilds=True)
    flat, layout = flatten_states(states)
    call = f if method == "__call__" else getattr(f, method)
    static_pos = _static_positions(static_argnums, len(example_args))
    dynamic_args = [a for i, a in enumerate(example_args) if i not in static_pos]
    static_kwargs = {k: v for k, v in example_kwargs.items() if not _is_traced_argument(v)}
    dynamic_kwargs = {k: v for k, v in example_kwargs.items() if k not in static_kwargs}

    def step(flat_states: dict[str, Any], /, *args: Any, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        given = iter(args)
        full = [a if i in static_pos else next(given) for i, a in enumerate(example_args)]
        out, new_states = call(
            unflatten_states(layout, flat_states), *full, **kwargs, **static_kwargs
        )
        return out, flatten_states(new_states)[0]

    step.__name__ = f"{type(model).__name__}_{method.strip('_') or 'call'}"
    specs = jax.tree_util.tree_map(_shape_dtype, (flat, dynamic_args, dynamic_kwargs))
    return jax.export.export(jax.jit(step), platforms=platforms)(
        specs[0], *specs[1], **specs[2]
    )
