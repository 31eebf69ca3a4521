"""``autostate.summary``: a table of what a model holds.

One row per array (and per static state) under the names the rest of
autostate uses: parameters by their ``param_dict`` path, states and
constants by their ``state_dict`` key, static states (a Python value a
method assigns, such as a mode flag) by name. The rows come from one walk
of the functionalized model (``tree.iter_tree`` over ``f.model``, as
``param_dict`` reads it): an array reachable from two paths is counted
once, under its first path, and listed again as tied; a sub-model reachable
from two paths is listed once.

Nothing here reads values, so a summary works on tracers inside ``jit``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from autostate import graph as _graph
from autostate import values as _values
from autostate.effects.local_state import HandledLocalStateRef, StateSlot
from autostate.errors import InvalidTypeError, format_error
from autostate.functional import CONSTANT, ConstantRef, FunctionalModel
from autostate.state_values import HandledStaticState, StaticState

if TYPE_CHECKING:
    from autostate.packing import PackedStates

# (``render``, ``state_dicts`` and ``packing`` are imported by the first
# summary: this module is imported by every ``import autostate``, as the
# package's ``summary`` is this module's function.)

KINDS = ("parameter", "state", "constant", "static")


@dataclasses.dataclass(frozen=True)
class SummaryRow:
    """One row of a ``Summary``.

    Attributes:
        path: the parameter's path or the state's name, as ``param_dict`` and
            ``state_dict`` key it.
        kind: ``"parameter"``, ``"state"``, ``"constant"`` or ``"static"``.
        shape: the array's shape (``None`` for a static value).
        dtype: the dtype's name (for a static value, its type's).
        count: the number of elements (0 for a static value or a tied path).
        bytes: the bytes the array takes (0 for a static value or a tied path).
        category: a state's category (``None`` for parameters).
        value: a static state's value (``None`` otherwise).
        tied_to: for a later path to an array listed before, that array's path.
    """

    path: str
    kind: str
    shape: tuple[int, ...] | None
    dtype: str
    count: int
    bytes: int
    category: Hashable | None = None
    value: Any = None
    tied_to: str | None = None


@dataclasses.dataclass(frozen=True)
class KindTotal:
    """The totals of one kind: ``count`` elements in ``bytes`` bytes, over ``entries`` rows."""

    count: int
    bytes: int
    entries: int


class Summary:
    """What ``autostate.summary`` returns: rows, totals, and a table as ``str()``.

    Attributes:
        model_name: the model's class name.
        rows: every ``SummaryRow``, in the model's attribute order.
    """

    def __init__(self, model_name: str, rows: tuple[SummaryRow, ...]):
        self.model_name = model_name
        self.rows = rows

    @property
    def totals(self) -> dict[str, KindTotal]:
        """Per kind (the kinds present, in ``KINDS`` order): count, bytes, entries."""
        out = {}
        for kind in KINDS:
            rows = [r for r in self.rows if r.kind == kind and r.tied_to is None]
            if rows:
                out[kind] = KindTotal(sum(r.count for r in rows), sum(r.bytes for r in rows), len(rows))
        return out

    @property
    def total_params(self) -> int:
        """The number of parameter elements (each tied array once)."""
        return sum(r.count for r in self.rows if r.kind == "parameter")

    @property
    def total_count(self) -> int:
        """The number of array elements of every kind."""
        return sum(r.count for r in self.rows)

    @property
    def total_bytes(self) -> int:
        """The bytes of every array of every kind."""
        return sum(r.bytes for r in self.rows)

    def __str__(self) -> str:
        header = ("path", "kind", "shape", "dtype", "count", "bytes")
        body = [_cells(r) for r in self.rows]
        widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

        def line(cells: tuple[str, ...]) -> str:
            left = [c.ljust(w) for c, w in zip(cells[:4], widths)]
            right = [c.rjust(w) for c, w in zip(cells[4:], widths[4:])]
            return "  ".join(left + right).rstrip()

        rule = "-" * len(line(tuple("-" * w for w in widths)))
        out = [f"{self.model_name} summary", line(header), rule, *map(line, body), rule]
        for kind, total in self.totals.items():
            if kind == "static":
                out.append(f"static states: {total.entries}")
            else:
                out.append(
                    f"{kind}s: {_plural(total.entries, 'array')}, "
                    f"{_plural(total.count, 'element')}, {_human(total.bytes)}"
                )
        out.append(f"total: {_plural(self.total_count, 'element')}, {_human(self.total_bytes)}")
        return "\n".join(out)

    def __repr__(self) -> str:
        return str(self)


def _cells(row: SummaryRow) -> tuple[str, ...]:
    kind = row.kind
    if row.kind == "state" and row.category not in (None, "state"):
        kind = f"state ({row.category})"
    if row.kind == "static":
        return (row.path, kind, "", f"{row.dtype} = {row.value!r}", "", "")
    path = row.path if row.tied_to is None else f"{row.path} (tied to {row.tied_to})"
    shape = "" if row.shape is None else str(tuple(row.shape))
    if row.tied_to is not None:
        return (path, kind, shape, row.dtype, "-", "-")
    return (path, kind, shape, row.dtype, f"{row.count:,}", f"{row.bytes:,}")


def _plural(n: int, noun: str) -> str:
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError  # pragma: no cover


def _array_row(path: str, kind: str, leaf: Any, **extra: Any) -> SummaryRow:
    from autostate.state_dicts import array_spec

    spec = array_spec(leaf)
    if spec is None:  # a state holding a non-array leaf
        return SummaryRow(path, kind, None, type(leaf).__name__, 0, 0, **extra)
    shape, dtype = spec
    count = int(np.prod(shape, dtype=np.int64))
    return SummaryRow(path, kind, shape, str(dtype), count, count * dtype.itemsize, **extra)


def _static_row(name: str, value: Any, category: Hashable | None) -> SummaryRow:
    return SummaryRow(name, "static", None, type(value).__name__, 0, 0, category, value)


def _is_row(x: Any) -> bool:
    return _values.is_array(x) or type(x) in (HandledLocalStateRef, ConstantRef) or isinstance(x, StateSlot)


def _rows(body: Any, states: Mapping[str, Any]) -> tuple[SummaryRow, ...]:
    from autostate.render import state_label
    from autostate.state_dicts import flatten_states

    flat, layout = flatten_states(states)
    keys = {name: (state_keys, statics) for name, _, state_keys, statics in layout}
    rows: list[SummaryRow] = []
    first_path: dict[int, str] = {}
    done: set[str] = set()

    def state_rows(name: str, kind: str, category: Hashable | None) -> None:
        if name in done:  # one state under one explicit name in two places
            return
        done.add(name)
        state_keys, statics = keys.get(name, ([], {}))
        if not state_keys:  # a state with no leaves (None, an empty dict)
            rows.append(SummaryRow(name, kind, None, type(states[name]).__name__, 0, 0, category))
        for key in state_keys:
            if key in statics:
                rows.append(_static_row(key, statics[key], category))
            else:
                rows.append(_array_row(key, kind, flat[key], category=category))

    for path, node in _graph.iter_tree(body, _is_row):
        if type(node) in (HandledStaticState, StaticState):
            rows.append(_static_row(getattr(node, "name", None) or path, node.value, node.category))
        elif type(node) is ConstantRef:
            state_rows(node.name, "constant", CONSTANT)
        elif type(node) is HandledLocalStateRef:
            kind = "constant" if node.category == CONSTANT else "state"
            state_rows(node.name, kind, node.category)
        elif isinstance(node, StateSlot):  # a category this f does not handle: in f itself
            name = getattr(node, "name", None) or path
            category = getattr(node, "category", None)
            _, value = state_label(node, name)
            kind = "constant" if category == CONSTANT else "state"
            rows.append(_array_row(name, kind, value, category=category))
        elif id(node) in first_path:
            row = _array_row(path, "parameter", node, tied_to=first_path[id(node)])
            rows.append(dataclasses.replace(row, count=0, bytes=0))  # counted at its first path
        else:
            first_path[id(node)] = path
            rows.append(_array_row(path, "parameter", node))
    for name in states:  # states no path reaches (none, for a model functionalize made)
        if name not in done:
            state_rows(name, "state", None)
    return tuple(rows)


def summary(model: Any, states: Mapping[str, Any] | PackedStates | None = None) -> Summary:
    """A table of the model's parameters, states, constants and static states.

    Each row names an array by its ``param_dict`` path or ``state_dict``
    key and gives its kind, shape, dtype, element count and bytes; static
    states (a Python value a method assigns) show their value. Under the
    rows, totals per kind and overall. An array reachable from two paths (tied weights) is
    counted once and its later paths are listed as tied; a sub-model
    reachable from two paths is listed once. Static configuration (sizes,
    ``eps``, the ``training`` flag that ``train()``/``eval()`` set) is not a
    row: ``repr(model)`` shows it.

    Args:
        model: a ``@stateful`` model, the ``f`` of ``functionalize()`` (with
            ``states``), or the ``pf`` of ``autostate.pack`` (with its
            ``PackedStates``).
        states: with ``f`` (or ``pf``), its states. Tracers are fine: a
            summary reads shapes and dtypes only.

    Returns:
        A ``Summary``: ``print`` it for the table; ``.rows`` (``SummaryRow``s),
        ``.totals`` (per kind), ``.total_params``, ``.total_count`` and
        ``.total_bytes`` hold the numbers.

    Raises:
        InvalidTypeError: ``f`` without its states, or states with a model.

    Examples:
        >>> import jax.numpy as jnp, autostate
        >>> @autostate.stateful
        ... class Norm:
        ...     def __init__(self, n):
        ...         self.weight = jnp.ones(n)
        ...         self.running_mean = jnp.zeros(n)
        ...         self.training = True
        ...     def eval(self):
        ...         self.training = False
        ...     def __call__(self, x):
        ...         self.running_mean = 0.9 * self.running_mean + 0.1 * x.mean(0)
        ...         return x * self.weight
        >>> s = autostate.summary(Norm(3))
        >>> s.total_params
        3
        >>> print(s)
        Norm summary
        path          kind       shape  dtype        count  bytes
        ---------------------------------------------------------
        weight        parameter  (3,)   float32          3     12
        running_mean  state      (3,)   float32          3     12
        training      static            bool = True
        ---------------------------------------------------------
        parameters: 1 array, 3 elements, 12 B
        states: 1 array, 3 elements, 12 B
        static states: 1
        total: 6 elements, 24 B
    """
    from autostate.packing import PackedModel
    from autostate.state_dicts import handle_for_reading, state_dict

    if isinstance(model, PackedModel):
        if states is None:
            raise InvalidTypeError(format_error(
                "autostate.summary(pf) needs the packed states: pf holds no states.",
                fix="call autostate.summary(pf, pstates).",
            ))
        model, states = model.unpack(states)  # type: ignore[arg-type]  # checked there
    if isinstance(model, FunctionalModel):
        state_dict(model, states)  # the same checks of the states dict
        return Summary(type(model.model).__name__, _rows(model.model, states))  # type: ignore[arg-type]
    if states is not None:
        raise InvalidTypeError(format_error(
            "autostate.summary takes a states dict only with an f (or a packed pf).",
            fix="call autostate.summary(model) or autostate.summary(f, states).",
        ))
    f, handled = handle_for_reading(model, "summary")
    return Summary(type(model).__name__, _rows(f.model, handled))
