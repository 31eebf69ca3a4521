"""PyTorch-style layers written as plain ``nn.Module`` classes.

Each layer is an ordinary class that mutates ``self``, readable as an example
of the decorator (``nn.Module`` is ``autostate.Stateful``, the base-class
spelling of ``@autostate.stateful``, with PyTorch's module protocol:
``forward``, ``register_buffer``, ``named_parameters``, ``modules``,
``apply``; see ``autostate.nn.module``), with PyTorch's semantics and names: default initialisation,
weight layouts (``Linear.weight`` is ``[out, in]``, ``Conv2d.weight``
``[out, in / groups, kh, kw]``), channels-first inputs, attribute names
(``weight``, ``bias``, ``running_mean``, ``running_var``,
``num_batches_tracked``), so a PyTorch checkpoint's arrays copy over as they
are. Paths differ only in spelling: PyTorch's ``layers.0.weight`` is
``layers[0].weight`` here for a plain list (a ``ModuleList`` or
``ModuleDict`` keeps PyTorch's spelling: ``h.0.weight``). ``nn.init`` has
PyTorch's initialisers, which write the model in place.

**Train and eval.** Every decorated class has ``model.train(mode=True)`` and
``model.eval()`` (unless it defines its own), which set ``training`` on the
model and every sub-model and return the model. ``training`` is static
config, part of ``f``'s structure: a jitted step compiles once per mode, and
``f_eval, states = autostate.freeze(f, states).eval().functionalize()`` turns
a trained ``f`` into its evaluation ``f``.

**Random keys.** A layer never seeds itself with a fixed key. Every layer
that draws random numbers takes ``key=``:

- nothing: the next key of a module-level default stream, which
  ``manual_seed`` reseeds, as ``torch.manual_seed`` does; two layers
  never get the same key;
- a ``KeyStream`` (``nnx.Rngs``'s role): a model hands one stream to
  its layers, each takes the stream's next key;
- a JAX key or an int seed.

A model built inside ``jax.jit`` or ``jax.vmap`` must be given a key (the
default stream is Python state that a trace reads once; without a key that
is a clear error); an ensemble, ``jax.vmap(lambda k: Model(key=k))(keys)``,
then gives each member its own keys. ``Dropout`` holds its key as a state
and splits it exactly once per training call, eagerly, in ``f`` under
``jax.jit``, and inside ``lax.scan`` / ``jax.checkpoint`` bodies.

Examples:
    >>> import jax, jax.numpy as jnp
    >>> import autostate
    >>> import autostate.nn as nn
    >>> model = nn.Sequential(nn.Linear(4, 8, key=0), nn.ReLU(), nn.Dropout(0.5, key=1))
    >>> f, states = model.functionalize()
    >>> sorted(states)
    ['layers[2].key']
    >>> f_eval, states = autostate.freeze(f, states).eval().functionalize()
    >>> out, states = jax.jit(lambda f, s, x: f(s, x))(f_eval, states, jnp.ones((2, 4)))
    >>> out.shape
    (2, 8)
"""

from __future__ import annotations

from autostate.nn import init
from autostate.nn.activation import (
    CELU,
    ELU,
    GELU,
    SELU,
    Flatten,
    Hardsigmoid,
    Hardswish,
    Hardtanh,
    Identity,
    LeakyReLU,
    LogSoftmax,
    Mish,
    ReLU,
    ReLU6,
    Sigmoid,
    SiLU,
    Softmax,
    Softplus,
    Tanh,
)
from autostate.nn.attention import MultiheadAttention
from autostate.nn.container import Sequential
from autostate.nn.conv import Conv1d, Conv2d, Conv3d, ConvTranspose2d
from autostate.nn.dropout import Dropout, Dropout1d, Dropout2d
from autostate.nn.embedding import Embedding
from autostate.nn.linear import Linear
from autostate.nn.module import Module, ModuleDict, ModuleList, Parameter
from autostate.nn.normalization import (
    BatchNorm1d,
    BatchNorm2d,
    BatchNorm3d,
    GroupNorm,
    LayerNorm,
    RMSNorm,
)
from autostate.nn.pooling import (
    AdaptiveAvgPool1d,
    AdaptiveAvgPool2d,
    AdaptiveMaxPool1d,
    AdaptiveMaxPool2d,
    AvgPool1d,
    AvgPool2d,
    MaxPool1d,
    MaxPool2d,
)
from autostate.nn.random import KeyStream, manual_seed
from autostate.nn.recurrent import GRU, LSTM, GRUCell, LSTMCell
from autostate.nn.torch_io import load_torch_state_dict, torch_state_dict
from autostate.nn.transformer import TransformerEncoder, TransformerEncoderLayer
from autostate.nn.upsampling import Upsample, UpsamplingBilinear2d, UpsamplingNearest2d

__all__: list[str] = [
    "AdaptiveAvgPool1d",
    "AdaptiveAvgPool2d",
    "AdaptiveMaxPool1d",
    "AdaptiveMaxPool2d",
    "AvgPool1d",
    "AvgPool2d",
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "CELU",
    "Conv1d",
    "Conv2d",
    "Conv3d",
    "ConvTranspose2d",
    "Dropout",
    "Dropout1d",
    "Dropout2d",
    "ELU",
    "Embedding",
    "Flatten",
    "GELU",
    "GRU",
    "GRUCell",
    "GroupNorm",
    "Hardsigmoid",
    "Hardswish",
    "Hardtanh",
    "Identity",
    "KeyStream",
    "LSTM",
    "LSTMCell",
    "LayerNorm",
    "LeakyReLU",
    "Linear",
    "LogSoftmax",
    "MaxPool1d",
    "MaxPool2d",
    "Mish",
    "Module",
    "ModuleDict",
    "ModuleList",
    "MultiheadAttention",
    "Parameter",
    "RMSNorm",
    "ReLU",
    "ReLU6",
    "SELU",
    "Sequential",
    "SiLU",
    "Sigmoid",
    "Softmax",
    "Softplus",
    "Tanh",
    "TransformerEncoder",
    "TransformerEncoderLayer",
    "Upsample",
    "UpsamplingBilinear2d",
    "UpsamplingNearest2d",
    "init",
    "load_torch_state_dict",
    "manual_seed",
    "torch_state_dict",
]
