"""Random keys for layers: a default stream, explicit keys, and key streams.

A layer that draws random numbers (an initialiser, a dropout mask) takes one
``key=`` argument, which may be:

- ``None``: the next key of the module-level default stream, which
  ``manual_seed`` reseeds (PyTorch's ``torch.manual_seed``);
- a ``KeyStream``: its next key (the role of ``nnx.Rngs``: one stream
  hands each layer of a model its own key);
- a JAX key (``jax.random.key(0)``, or a raw ``uint32[2]`` key) or an int seed.

The default stream is Python state that a JAX trace would read only once, so
a layer built inside ``jax.jit`` or ``jax.vmap`` must be given its key (an
ensemble: ``jax.vmap(lambda k: Model(key=k))(keys)``); without one it is a
clear error, never the same weights for every member.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from autostate.errors import InvalidArgumentError, format_error
from autostate.lifetime import current_trace

__all__ = ["KeyLike", "KeyStream", "manual_seed", "next_key", "split_key"]


class KeyStream:
    """A stream of independent keys derived from one key, one per ``next()``.

    Key ``i`` is ``jax.random.fold_in(key, i)``: the stream never reuses a key,
    and a traced parent key (inside ``jax.vmap``) gives traced keys, so every
    ensemble member draws its own.

    Args:
        key: the parent key (a JAX key, a raw ``uint32[2]`` key, or an int seed);
            ``None`` takes the next key of the default stream.

    Differences from PyTorch:
        PyTorch has no equivalent: its layers draw from one global generator. A stream
        is ``flax.nnx.Rngs``'s role: one key, handed to every layer of a model.

    Examples:
        >>> import autostate.nn as nn
        >>> keys = nn.KeyStream(0)
        >>> a, b = nn.Linear(2, 2, key=keys), nn.Linear(2, 2, key=keys)
        >>> bool((a.weight == b.weight).all())
        False
    """

    # What a model that keeps a stream and draws from it in a method is told
    # (``autostate.errors.holder_fix``): a stream is plain Python state, for
    # building layers, not a state of the model.
    _autostate_holder_fix = (
        "a KeyStream is for building layers, not a state: make it a local of __init__ "
        "(`keys = nn.KeyStream(seed)`, `nn.Linear(..., key=keys)`); to draw keys in a "
        "method, keep the key itself as a state "
        "(`self.key = jax.random.key(0)` in __init__, then "
        "`self.key, k = jax.random.split(self.key)` where a key is needed), or pass "
        "the key to the method (`model(x, key=k)`)."
    )

    def __init__(self, key: KeyLike = None):
        self.key = _as_key(next_key() if key is None else key)
        self.count = 0

    def next(self) -> jax.Array:
        """The stream's next key."""
        key = jax.random.fold_in(self.key, self.count)
        self.count += 1
        return key

    def __repr__(self) -> str:
        return f"KeyStream(count={self.count})"


KeyLike = jax.Array | int | KeyStream | None

# The default stream: (seed, keys drawn). Its key is made at the first draw,
# not at import (making a JAX array starts the backend).
_default_seed = 0
_default_drawn = 0


def manual_seed(seed: int) -> None:
    """Reseeds the default key stream that layers built without ``key=`` use.

    Args:
        seed: an int, as for ``torch.manual_seed``.

    Examples:
        >>> import autostate.nn as nn
        >>> nn.manual_seed(0); a = nn.Linear(2, 2)
        >>> nn.manual_seed(0); b = nn.Linear(2, 2)
        >>> bool((a.weight == b.weight).all())
        True
    """
    global _default_seed, _default_drawn
    _default_seed, _default_drawn = int(seed), 0


def next_key() -> jax.Array:
    """The next key of the default stream (see ``manual_seed``).

    Raises:
        InvalidArgumentError: called while JAX traces a function (``jax.jit``,
            ``jax.vmap``): the stream is Python state the trace would read once.
    """
    global _default_drawn
    if current_trace() is not None:
        raise InvalidArgumentError(
            format_error(
                "A layer was built inside a JAX transformation (jax.jit, jax.vmap, ...) without "
                "a key: the default key stream is Python state, which the trace would read "
                "once, so every call (every ensemble member) would get the same key.",
                fix="pass a key: `Layer(..., key=key)` (an ensemble: "
                "`jax.vmap(lambda k: Model(key=k))(jax.random.split(key, n))`).",
            )
        )
    key = jax.random.fold_in(jax.random.key(_default_seed), _default_drawn)
    _default_drawn += 1
    return key


def split_key(key: KeyLike) -> jax.Array:
    """The key a layer uses: ``key``'s next key if it is a stream, the default
    stream's next key if it is ``None``, else ``key`` itself as a JAX key."""
    if key is None:
        return next_key()
    if isinstance(key, KeyStream):
        return key.next()
    return _as_key(key)


def _as_key(key: jax.Array | int | KeyStream) -> jax.Array:
    if isinstance(key, KeyStream):
        return key.next()
    if isinstance(key, int):
        return jax.random.key(key)
    if isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key
    if isinstance(key, jax.Array) and key.dtype == jnp.uint32 and key.shape[-1:] == (2,):
        return jax.random.wrap_key_data(key)
    raise InvalidArgumentError(
        format_error(
            f"key= takes a JAX key, an int seed, an autostate.nn.KeyStream or None; got "
            f"{type(key).__name__}.",
            fix="pass `jax.random.key(seed)`, a seed, or `autostate.nn.KeyStream(seed)`.",
        )
    )
