"""Plain and decorated twins of the same classes, defined at module level.

The eager-write differential (``run_twins``) needs real module-level classes:
copies, pickles by reference, finalizers, threads, ``__reduce__`` and
``__getstate__`` see them as any user's module would. Each class comes as
``Plain*`` (plain Python) and ``Decorated*`` (``@autostate.stateful``);
``PLAIN`` and ``DECORATED`` bundle one run's classes, and a scenario written
against a ``Classes`` runs with both.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import autostate

FINALIZED: list[Any] = []


LOGGED: list[str] = []


class PlainModel:
    def __init__(self) -> None:
        self.x = jnp.zeros(3)
        self.n = jnp.array(0, jnp.int32)
        self.flag = jnp.array(False)
        self.pair = (jnp.zeros(2), {"k": jnp.zeros(2)})

    def step(self, v: Any) -> Any:
        self.x = v
        self.n = self.n + 1
        return self.x * 2

    def add(self, v: Any) -> None:
        self.x += v

    def toggle(self) -> None:
        self.flag = ~self.flag

    def set_pair(self, a: Any, b: Any) -> None:
        self.pair = (a, {"k": b})

    def scan_step(self, carry: Any, v: Any) -> tuple[Any, Any]:
        self.x = self.x + v
        self.n = self.n + 1
        return carry + v.sum(), self.x

    def step_with_callback(self, v: Any, w: Any, callback: Callable[[Any], None]) -> None:
        self.x = v
        callback(self)
        self.x = w

    def swap(self) -> None:
        self.x, self.pair = self.pair, self.x

    def chain(self, v: Any) -> None:
        self.x = self.pair = v

    def loop(self, vs: list[Any]) -> None:
        for self.x in vs:
            self.n = self.n + 1

    def scan_all(self, xs: Any) -> tuple[Any, Any]:
        return jax.lax.scan(self.scan_step, jnp.float32(0), xs)


@autostate.stateful
class DecoratedModel:
    def __init__(self) -> None:
        self.x = jnp.zeros(3)
        self.n = jnp.array(0, jnp.int32)
        self.flag = jnp.array(False)
        self.pair = (jnp.zeros(2), {"k": jnp.zeros(2)})

    def step(self, v: Any) -> Any:
        self.x = v
        self.n = self.n + 1
        return self.x * 2

    def add(self, v: Any) -> None:
        self.x += v

    def toggle(self) -> None:
        self.flag = ~self.flag

    def set_pair(self, a: Any, b: Any) -> None:
        self.pair = (a, {"k": b})

    def scan_step(self, carry: Any, v: Any) -> tuple[Any, Any]:
        self.x = self.x + v
        self.n = self.n + 1
        return carry + v.sum(), self.x

    def step_with_callback(self, v: Any, w: Any, callback: Callable[[Any], None]) -> None:
        self.x = v
        callback(self)
        self.x = w

    def swap(self) -> None:
        self.x, self.pair = self.pair, self.x

    def chain(self, v: Any) -> None:
        self.x = self.pair = v

    def loop(self, vs: list[Any]) -> None:
        for self.x in vs:
            self.n = self.n + 1

    def scan_all(self, xs: Any) -> tuple[Any, Any]:
        return jax.lax.scan(self.scan_step, jnp.float32(0), xs)


# Generator methods that use state are refused by @stateful (their body would run
# after the call that handles state returned), so these live outside the class and
# reach the state through its descriptors, as any code outside the class does.
def values(model: Any) -> Iterator[Any]:
    while True:
        yield model.x


def stepper(model: Any, vs: list[Any]) -> Iterator[Any]:
    for v in vs:
        model.x = v
        yield model.x


class PlainChild:
    def __init__(self) -> None:
        self.x = jnp.zeros(2)

    def bump(self, v: Any) -> None:
        self.x = self.x + v


@autostate.stateful
class DecoratedChild:
    def __init__(self) -> None:
        self.x = jnp.zeros(2)

    def bump(self, v: Any) -> None:
        self.x = self.x + v


class PlainParent:
    def __init__(self, child: Any) -> None:
        self.child = child
        self.y = jnp.zeros(2)

    def bump(self, v: Any) -> None:
        self.child.bump(v)
        self.y = self.y + v

    def set_child(self, v: Any) -> None:
        self.child.x = v


@autostate.stateful
class DecoratedParent:
    def __init__(self, child: Any) -> None:
        self.child = child
        self.y = jnp.zeros(2)

    def bump(self, v: Any) -> None:
        self.child.bump(v)
        self.y = self.y + v

    def set_child(self, v: Any) -> None:
        self.child.x = v


class PlainRebuiltCopy:
    """A dataclass-style ``__copy__``: a new instance built from the fields."""

    def __init__(self, x: Any = None) -> None:
        self.x = jnp.zeros(3) if x is None else x

    def step(self, v: Any) -> None:
        self.x = v

    def __copy__(self) -> Any:
        return type(self)(self.x)


@autostate.stateful
class DecoratedRebuiltCopy:
    """A dataclass-style ``__copy__``: a new instance built from the fields."""

    def __init__(self, x: Any = None) -> None:
        self.x = jnp.zeros(3) if x is None else x

    def step(self, v: Any) -> None:
        self.x = v

    def __copy__(self) -> Any:
        return type(self)(self.x)


class PlainSharedDictCopy:
    """A ``__copy__`` whose copy shares the very ``__dict__`` object."""

    def __init__(self) -> None:
        self.x = jnp.zeros(3)

    def step(self, v: Any) -> None:
        self.x = v

    def __copy__(self) -> Any:
        new = type(self).__new__(type(self))
        new.__dict__ = self.__dict__
        return new


@autostate.stateful
class DecoratedSharedDictCopy:
    """A ``__copy__`` whose copy shares the very ``__dict__`` object."""

    def __init__(self) -> None:
        self.x = jnp.zeros(3)

    def step(self, v: Any) -> None:
        self.x = v

    def __copy__(self) -> Any:
        new = type(self).__new__(type(self))
        new.__dict__ = self.__dict__
        return new


class PlainReplaceable:
    """``copy.replace``'s protocol (``__replace__``), written by hand."""

    def __init__(self) -> None:
        self.x = jnp.zeros(3)
        self.n = jnp.array(0, jnp.int32)

    def step(self, v: Any) -> None:
        self.x = v
        self.n = self.n + 1

    def __replace__(self, **changes: Any) -> Any:
        new = copy.copy(self)
        for name, value in changes.items():
            setattr(new, name, value)
        return new


@autostate.stateful
class DecoratedReplaceable:
    """``copy.replace``'s protocol (``__replace__``), written by hand."""

    def __init__(self) -> None:
        self.x = jnp.zeros(3)
        self.n = jnp.array(0, jnp.int32)

    def step(self, v: Any) -> None:
        self.x = v
        self.n = self.n + 1

    def __replace__(self, **changes: Any) -> Any:
        new = copy.copy(self)
        for name, value in changes.items():
            setattr(new, name, value)
        return new


class PlainGetState:
    """Copies and pickles drop ``cache``; ``__setstate__`` resets it."""

    def __init__(self) -> None:
        self.x = jnp.zeros(3)
        self.cache = jnp.zeros(3)

    def step(self, v: Any) -> None:
        self.x = v
        self.cache = self.cache + 1

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["cache"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.cache = jnp.full(3, -1.0)


@autostate.stateful
class DecoratedGetState:
    """Copies and pickles drop ``cache``; ``__setstate__`` resets it."""

    def __init__(self) -> None:
        self.x = jnp.zeros(3)
        self.cache = jnp.zeros(3)

    def step(self, v: Any) -> None:
        self.x = v
        self.cache = self.cache + 1

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["cache"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.cache = jnp.full(3, -1.0)


def _fresh_plain_reduce() -> Any:
    return PlainReduce()


def _fresh_decorated_reduce() -> Any:
    return DecoratedReduce()


class PlainReduce:
    """Copies and pickles of this class are fresh instances."""

    def __init__(self) -> None:
        self.x = jnp.zeros(3)

    def step(self, v: Any) -> None:
        self.x = v

    def __reduce__(self) -> Any:
        return (_fresh_plain_reduce, ())


@autostate.stateful
class DecoratedReduce:
    """Copies and pickles of this class are fresh instances."""

    def __init__(self) -> None:
        self.x = jnp.zeros(3)

    def step(self, v: Any) -> None:
        self.x = v

    def __reduce__(self) -> Any:
        return (_fresh_decorated_reduce, ())


class PlainFinalized:
    """``__del__`` writes state and records what it saw."""

    def __init__(self) -> None:
        self.x = jnp.zeros(3)

    def step(self, v: Any) -> None:
        self.x = v

    def __del__(self) -> None:
        self.x = self.x + 100
        FINALIZED.append(self.x)


@autostate.stateful
class DecoratedFinalized:
    """``__del__`` writes state and records what it saw."""

    def __init__(self) -> None:
        self.x = jnp.zeros(3)

    def step(self, v: Any) -> None:
        self.x = v

    def __del__(self) -> None:
        self.x = self.x + 100
        FINALIZED.append(self.x)


@dataclasses.dataclass
class PlainData:
    x: Any
    n: Any = None

    def step(self, v: Any) -> None:
        self.x = v


@autostate.stateful
@dataclasses.dataclass
class DecoratedData:
    x: Any
    n: Any = None

    def step(self, v: Any) -> None:
        self.x = v


class PlainHooked:
    """A user ``__setattr__`` and a property whose setter writes state."""

    def __init__(self) -> None:
        self.x = jnp.zeros(3)

    def __setattr__(self, name: str, value: Any) -> None:
        LOGGED.append(name)
        object.__setattr__(self, name, value)

    def step(self, v: Any) -> None:
        self.x = v

    @property
    def value(self) -> Any:
        return self.x

    @value.setter
    def value(self, v: Any) -> None:
        self.x = v


@autostate.stateful
class DecoratedHooked:
    """A user ``__setattr__`` and a property whose setter writes state."""

    def __init__(self) -> None:
        self.x = jnp.zeros(3)

    def __setattr__(self, name: str, value: Any) -> None:
        LOGGED.append(name)
        object.__setattr__(self, name, value)

    def step(self, v: Any) -> None:
        self.x = v

    @property
    def value(self) -> Any:
        return self.x

    @value.setter
    def value(self, v: Any) -> None:
        self.x = v


class PlainSub(PlainModel):
    def __init__(self) -> None:
        super().__init__()
        self.extra = jnp.zeros(3)

    def step(self, v: Any) -> Any:
        out = super().step(v)
        self.extra = self.x + 1
        return out


class DecoratedSub(DecoratedModel):  # decorated too, as a subclass of a decorated class
    def __init__(self) -> None:
        super().__init__()
        self.extra = jnp.zeros(3)

    def step(self, v: Any) -> Any:
        out = super().step(v)
        self.extra = self.x + 1
        return out


SET_ITEMS: list[Any] = []


class RecordingDict(dict):  # type: ignore[type-arg]
    """An instance ``__dict__`` that records the item writes made through it."""

    def __setitem__(self, key: Any, value: Any) -> None:
        SET_ITEMS.append(key)
        super().__setitem__(key, value)


@dataclasses.dataclass(frozen=True)
class Classes:
    """One run's classes: all plain, or all decorated."""

    Model: type
    Child: type
    Parent: type
    RebuiltCopy: type
    SharedDictCopy: type
    Replaceable: type
    GetState: type
    Reduce: type
    Finalized: type
    Data: type
    Hooked: type
    Sub: type
    decorated: bool


PLAIN = Classes(
    PlainModel, PlainChild, PlainParent, PlainRebuiltCopy, PlainSharedDictCopy,
    PlainReplaceable, PlainGetState, PlainReduce, PlainFinalized, PlainData, PlainHooked,
    PlainSub, False,
)


DECORATED = Classes(
    DecoratedModel, DecoratedChild, DecoratedParent, DecoratedRebuiltCopy,
    DecoratedSharedDictCopy, DecoratedReplaceable, DecoratedGetState, DecoratedReduce,
    DecoratedFinalized, DecoratedData, DecoratedHooked, DecoratedSub, True,
)


def filled(value: float, size: int = 3) -> jax.Array:
    return jnp.full(size, value, jnp.float32)


def written(k: Classes) -> Any:
    """A model whose ``x`` and ``n`` have been written: frozen requests, not initial ones."""
    model = k.Model()
    model.step(filled(1.0))
    return model


def same_observations(plain: Any, decorated: Any, where: str, dtypes: bool) -> None:
    if isinstance(plain, dict):
        assert isinstance(decorated, dict) and list(decorated) == list(plain), where
        for key in plain:
            same_observations(plain[key], decorated[key], f"{where}[{key!r}]", dtypes)
    elif isinstance(plain, (list, tuple)):
        assert type(decorated) is type(plain) and len(decorated) == len(plain), where
        for i, (a, b) in enumerate(zip(plain, decorated)):
            same_observations(a, b, f"{where}[{i}]", dtypes)
    elif plain is None or isinstance(plain, (str, bool)):
        assert decorated == plain, where
    else:
        a, b = np.asarray(plain), np.asarray(decorated)
        np.testing.assert_array_equal(b, a, err_msg=where)
        if dtypes:
            assert b.dtype == a.dtype, f"{where}: dtype {b.dtype} != {a.dtype}"


def run_twins(scenario: Callable[[Classes], Any], *, dtypes: bool = True) -> Any:
    """Runs ``scenario`` with the plain and the decorated classes; the observations match."""
    plain = scenario(PLAIN)
    decorated = scenario(DECORATED)
    same_observations(plain, decorated, "observation", dtypes)
    return decorated
