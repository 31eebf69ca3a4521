"""``autostate.nn.module``: ``Module``, ``ModuleList``, ``ModuleDict``,
``register_buffer`` and the ``named_*`` walks, with PyTorch's meaning."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autostate
import autostate.nn as nn
from autostate.errors import InvalidArgumentError, InvalidTypeError


class Block(nn.Module):
    def __init__(self, key: int):
        super(Block, self).__init__()  # noqa: UP008 (PyTorch's older spelling, kept)
        self.fc = nn.Linear(2, 2, key=key)
        self.act = nn.ReLU(True)
        self.register_buffer("scale", jnp.full(2, 3.0))
        self.register_buffer("mask", jnp.array([True, False]), persistent=False)

    def forward(self, x):
        return jnp.where(self.mask, self.act(self.fc(x)), x) * self.scale


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("steps", jnp.zeros((), jnp.int32))
        shared = Block(0)
        self.blocks = nn.ModuleList([shared, Block(1)])
        self.heads = nn.ModuleDict({"a": nn.Linear(2, 1, key=2), "b": shared})
        self.weight = nn.Parameter(jnp.ones(2))
        self.head_b_bias = self.heads["a"].bias  # one array under two names

    def forward(self, x):
        self.steps = self.steps + 1
        for block in self.blocks:
            x = block(x)
        return self.heads.a(x * self.weight)


def test_forward_is_called_eagerly_in_f_and_under_jit_and_grad():
    net = Net()
    x = jnp.ones((3, 2))
    expected = net(x)
    assert int(net.steps) == 1
    f, states = net.functionalize()
    out, states = jax.jit(f)(states, x)
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    assert int(states["steps"]) == 2
    out = autostate.jit(lambda m, x: m(x))(net, x)
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    assert int(net.steps) == 2
    grads = autostate.grad(lambda m, x: m(x).sum())(net, x)
    assert [n for n, _ in grads.model.named_parameters()] == [n for n, _ in net.named_parameters()]


def test_a_module_without_forward_says_so():
    class Empty(nn.Module):
        pass

    with pytest.raises(NotImplementedError, match='missing the required "forward"'):
        Empty()(1)
    layer = nn.Linear(2, 2, key=0)  # a layer that defines __call__ has forward too
    np.testing.assert_array_equal(layer.forward(jnp.ones(2)), layer(jnp.ones(2)))


def test_names_and_order_are_pytorchs():
    net = Net()
    assert [n for n, _ in net.named_modules()] == [
        "", "blocks", "blocks.0", "blocks.0.fc", "blocks.0.act", "blocks.1", "blocks.1.fc",
        "blocks.1.act", "heads", "heads.a",
    ]  # fmt: skip
    assert [n for n, _ in net.named_modules(remove_duplicate=False)][-2:] == ["heads.b.fc", "heads.b.act"]
    assert [n for n, _ in net.named_children()] == ["blocks", "heads"]
    # A module's own parameters come before its children's (a tied array
    # under its first name in that order, as PyTorch names it).
    assert [n for n, _ in net.named_parameters()] == [
        "weight", "head_b_bias", "blocks.0.fc.weight", "blocks.0.fc.bias", "blocks.1.fc.weight",
        "blocks.1.fc.bias", "heads.a.weight",
    ]  # fmt: skip
    assert [n for n, _ in net.named_parameters(remove_duplicate=False)][-1] == "heads.b.fc.bias"
    assert [n for n, _ in net.named_parameters(prefix="net", recurse=False)] == [
        "net.weight", "net.head_b_bias",
    ]
    assert [n for n, _ in net.named_buffers()] == [
        "steps", "blocks.0.scale", "blocks.0.mask", "blocks.1.scale", "blocks.1.mask",
    ]
    assert len(list(net.parameters())) == 7 and len(list(net.buffers())) == 5
    assert list(net.modules())[2] is net.blocks[0]
    assert list(net.children()) == [net.blocks, net.heads]


def test_state_dicts_name_entries_as_pytorch_and_leave_out_non_persistent_buffers():
    net = Net()
    f, states = net.functionalize()
    assert sorted(states) == [
        "blocks.0.mask", "blocks.0.scale", "blocks.1.mask", "blocks.1.scale", "steps",
    ]  # fmt: skip
    # A float buffer is never trained.
    assert sorted(autostate.param_dict(net)) == [
        "blocks.0.fc.bias", "blocks.0.fc.weight", "blocks.1.fc.bias", "blocks.1.fc.weight",
        "heads.a.bias", "heads.a.weight", "weight",
    ]  # fmt: skip
    # PyTorch's state_dict order: a module's parameters, its buffers, its
    # children; a shared module under each path; non-persistent buffers left out.
    assert list(nn.torch_state_dict(net)) == [
        "weight", "head_b_bias", "steps", "blocks.0.scale", "blocks.0.fc.weight",
        "blocks.0.fc.bias", "blocks.1.scale", "blocks.1.fc.weight", "blocks.1.fc.bias",
        "heads.a.weight", "heads.a.bias", "heads.b.scale", "heads.b.fc.weight", "heads.b.fc.bias",
    ]  # fmt: skip
    loaded = nn.load_torch_state_dict(net, nn.torch_state_dict(net))
    np.testing.assert_array_equal(loaded.blocks[1].mask, net.blocks[1].mask)


def test_module_list():
    layers = nn.ModuleList([nn.ReLU(), nn.Tanh()])
    layers.append(nn.Sigmoid())
    layers += [nn.Identity()]
    layers.insert(0, nn.SiLU())
    assert [type(m).__name__ for m in layers] == ["SiLU", "ReLU", "Tanh", "Sigmoid", "Identity"]
    assert type(layers[-1]).__name__ == "Identity" and len(layers[1:3]) == 2
    del layers[0]
    layers[0] = nn.GELU()
    assert type(layers.pop()).__name__ == "Identity"
    assert [type(m).__name__ for m in layers] == ["GELU", "Tanh", "Sigmoid"]
    assert sorted(vars(layers)) == ["0", "1", "2"]  # PyTorch's names: layers.0
    with pytest.raises(IndexError):
        layers[3]


def test_module_dict():
    d = nn.ModuleDict([("a", nn.ReLU())])
    d["b"] = nn.Tanh()
    d.update({"c": nn.Sigmoid()})
    assert list(d) == ["a", "b", "c"] and list(d.keys()) == ["a", "b", "c"]
    assert d.b is d["b"] and "c" in d and len(d) == 3
    assert type(d.pop("a")).__name__ == "ReLU" and list(d) == ["b", "c"]
    for bad in ("keys", "training", "x.y", ""):
        with pytest.raises(InvalidArgumentError):
            d[bad] = nn.ReLU()
    d.clear()
    assert len(d) == 0
    with pytest.raises(KeyError):
        d["b"]


def test_register_buffer_refuses_what_would_be_trained():
    class Computed(nn.Module):
        def __init__(self, name):
            super().__init__()
            self.register_buffer(name, jnp.zeros(2, jnp.int32))  # an int array: fine

    assert list(dict(Computed("count").named_buffers())) == ["count"]

    class ComputedFloat(nn.Module):
        def __init__(self, name):
            super().__init__()
            self.register_buffer(name, jnp.zeros(2))

    with pytest.raises(InvalidArgumentError, match="would be trained"):
        ComputedFloat("scale")
    with pytest.raises(InvalidTypeError):
        Computed.register_buffer(Computed("a"), "b", [1, 2])


def test_register_parameter_add_module_and_parameter():
    m = nn.Identity()
    m.register_parameter("w", jnp.ones(2))
    m.add_module("sub", nn.ReLU())
    assert [n for n, _ in m.named_parameters()] == ["w"]
    assert [n for n, _ in m.named_children()] == ["sub"]
    with pytest.raises(InvalidTypeError):
        nn.Parameter(jnp.ones(2, jnp.int32))
    with pytest.raises(InvalidArgumentError, match="buffer"):
        nn.Parameter(jnp.ones(2), requires_grad=False)


def test_apply_visits_children_first():
    net = Net()
    seen = []
    assert net.apply(lambda m: seen.append(type(m).__name__)) is net
    # As PyTorch: each module's children, then the module; a shared one on each path.
    assert seen == [
        "Linear", "ReLU", "Block", "Linear", "ReLU", "Block", "ModuleList", "Linear", "Linear",
        "ReLU", "Block", "ModuleDict", "Net",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("cls", "args", "kwargs"),
    [
        ("ReLU", [True], {}),
        ("ReLU6", [], {"inplace": True}),
        ("LeakyReLU", [0.2, True], {}),
        ("ELU", [0.5], {"inplace": True}),
        ("Hardtanh", [-0.5, 0.5, True], {}),
        ("SiLU", [], {"inplace": True}),
        ("SELU", [True], {}),
        ("CELU", [0.5, True], {}),
        ("Hardsigmoid", [], {"inplace": True}),
        ("Hardswish", [True], {}),
        ("Mish", [], {"inplace": True}),
        ("Dropout", [0.5, True], {"key": 0}),
    ],
)
def test_inplace_is_accepted_and_changes_nothing(cls, args, kwargs):
    x = jnp.linspace(-3.0, 8.0, 12)
    plain_args = [a for a in args if a is not True]
    plain = getattr(nn, cls)(*plain_args, **{k: v for k, v in kwargs.items() if k != "inplace"})
    layer = getattr(nn, cls)(*args, **kwargs)
    assert layer.inplace is True
    np.testing.assert_array_equal(layer(x), plain(x))
    np.testing.assert_array_equal(x, jnp.linspace(-3.0, 8.0, 12))


def test_a_layer_subclass_overrides_forward():
    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    layer = Scaled(2, 3, key=0)
    x = jnp.ones((1, 2))
    np.testing.assert_allclose(layer(x), 2 * (x @ layer.weight.T + layer.bias), rtol=1e-6)
    f, states = layer.functionalize()
    np.testing.assert_allclose(jax.jit(f)(states, x)[0], layer(x), rtol=1e-6)
