"""``autostate.export``: one method as a ``jax.export`` program that threads states.

The program takes and returns the flat state dict of ``state_dicts``; the
parameters are baked in as constants.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.export

from autostate.errors import InvalidTypeError, format_error
from autostate.state_dicts import array_spec, flatten_states, handle_for_reading, unflatten_states


def _shape_dtype(x: Any) -> jax.ShapeDtypeStruct:
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    spec = array_spec(x)
    if spec is None:
        raise InvalidTypeError(
            format_error(
                f"autostate.export takes arrays or jax.ShapeDtypeStruct as example "
                f"arguments, got a {type(x).__name__}.",
                fix="pass arrays (or pytrees of them); bind other arguments in a method.",
            )
        )
    return jax.ShapeDtypeStruct(spec[0], jax.dtypes.canonicalize_dtype(spec[1]))


def export(
    model: Any,
    *example_args: Any,
    method: str = "__call__",
    platforms: Sequence[str] | None = None,
) -> jax.export.Exported:
    """``model.<method>`` as a ``jax.export.Exported`` that threads states.

    Example::

        exp = autostate.export(model, x)
        blob = exp.serialize()                        # bytes for another process
        exp = jax.export.deserialize(blob)
        out, states = exp.call(autostate.state_dict(model), x)

    The program's call is ``(states, *args) -> (out, new_states)`` where
    ``states`` is the flat dict ``state_dict(model)`` returns. Parameters are
    baked in as constants. Serialization needs the ``flatbuffers`` package
    (``pip install autostate[export]``).

    **Arguments:**
    - ``model``: a ``@stateful`` instance.
    - ``example_args``: arrays or ``jax.ShapeDtypeStruct``s (or pytrees of
      them) giving the shapes and dtypes the program accepts.
    - ``method``: the method to export (default ``"__call__"``).
    - ``platforms``: lowering platforms (default: the current backend).

    **Returns:** the ``jax.export.Exported``.
    """
    f, states = handle_for_reading(model, "export")
    flat, layout = flatten_states(states)
    call = f if method == "__call__" else getattr(f, method)

    def step(flat_states: dict[str, Any], *args: Any) -> tuple[Any, dict[str, Any]]:
        out, new_states = call(unflatten_states(layout, flat_states), *args)
        return out, flatten_states(new_states)[0]

    step.__name__ = f"{type(model).__name__}_{method.strip('_') or 'call'}"
    specs = jax.tree_util.tree_map(_shape_dtype, (flat, example_args))
    return jax.export.export(jax.jit(step), platforms=platforms)(specs[0], *specs[1])
