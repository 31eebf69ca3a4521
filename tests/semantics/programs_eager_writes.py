"""The programs the eager writes cases run (``test_eager_writes.py``): class
sources run plain and decorated, and their expected values. Other concept
files import some of them too.
"""

from __future__ import annotations

SOURCE = """

@DECORATE
class Block:
    def __init__(self, k=1.0):
        self.w = jnp.full((2,), k)
        self.n = jnp.zeros(())

    def __call__(self, x):
        self.n = self.n * 2 + 1          # order-sensitive: two uses are not one use
        return jnp.sin(x * self.w) + self.n


@DECORATE
class Paths:
    \"\"\"One Block on five paths: two attributes, a list, a dict, a tuple.\"\"\"

    def __init__(self):
        enc = Block(2.0)
        self.enc = enc
        self.dec_in = self.enc
        self.layers = [enc, enc]
        self.d = {"a": enc, "b": Block(3.0)}
        self.t = (enc,)

    def __call__(self, x):
        y = self.enc(x) + self.dec_in(x)
        y = y + self.layers[1](y) + self.d["a"](x) + self.d["b"](x) + self.t[0](x)
        return y

    def poke(self, v):
        self.layers[0].n = self.layers[0].n + v
        return self.dec_in.n


@DECORATE
class Twice:
    \"\"\"One stateful sub-model called twice per forward; the second use sees the first.\"\"\"

    def __init__(self):
        self.blk = Block(0.5)
        self.scale = jnp.full((2,), 3.0)

    def __call__(self, x):
        h = self.blk(x * self.scale)
        return self.blk(h) * self.scale


@DECORATE
class Diamond:
    \"\"\"A leaf reached at two depths; its first path is the deeper one.\"\"\"

    def __init__(self):
        leaf = Block(1.5)
        self.x = Twice()
        self.x.blk = leaf
        self.y = leaf

    def __call__(self, x):
        return self.x(x) + self.y(x)


@DECORATE
class Emb:
    def __init__(self):
        self.w = jnp.arange(4.0).reshape(2, 2) / 4 + 0.5

    def __call__(self, x):
        return x @ self.w


@DECORATE
class Head:
    def __init__(self):
        self.w = jnp.ones((2, 2))
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, h):
        self.calls += 1
        return h @ self.w.T


@DECORATE
class LM:
    \"\"\"PyTorch-style tying: the same array object in two attributes.\"\"\"

    def __init__(self):
        self.embed = Emb()
        self.head = Head()
        self.head.w = self.embed.w

    def __call__(self, x):
        return jnp.tanh(self.head(self.embed(x))).sum()


@DECORATE
class Norm:
    def __init__(self, mean):
        self.mean = mean

    def __call__(self, x):
        self.mean = 0.5 * self.mean + x
        return self.mean


@DECORATE
class TiedStat:
    \"\"\"Two modules start from one running-mean array object, then diverge.\"\"\"

    def __init__(self):
        init = jnp.zeros(2)
        self.a = Norm(init)
        self.b = Norm(init)

    def __call__(self, x):
        return self.a(x) + self.b(2 * x)


@DECORATE
class Child:
    def __init__(self):
        self.n = jnp.zeros(())
        self.parent = None

    def __call__(self, x):
        self.n = self.n + x
        return self.n * self.parent.scale


@DECORATE
class Parent:
    \"\"\"A cycle: the child holds its parent.\"\"\"

    def __init__(self):
        self.scale = jnp.full((), 2.0)
        self.child = Child()
        self.child.parent = self
        self.total = jnp.zeros(())

    def __call__(self, x):
        y = self.child(x)
        self.total = self.total + y
        return y + self.child.parent.total * self.scale

    def read(self, x):
        return self.scale * x + self.total


@DECORATE
class Selfish:
    \"\"\"A model in its own list and dict.\"\"\"

    def __init__(self):
        self.n = jnp.zeros(())
        self.w = jnp.full((), 3.0)
        self.me = [self]
        self.d = {"me": self}

    def __call__(self, x):
        self.n = self.me[0].n + x * self.d["me"].w
        return self.me[0].n + self.d["me"].n


@DECORATE
class A:
    def __init__(self):
        self.n = jnp.zeros(())
        self.w = jnp.full((), 1.5)
        self.other = None

    def __call__(self, x):
        self.n = self.n + x * self.w
        return self.other(x) + self.n

    def peek(self):
        return self.other.other.n + self.other.n


@DECORATE
class B:
    def __init__(self, a):
        self.n = jnp.zeros(())
        self.other = a

    def __call__(self, x):
        self.n = self.n + 2 * x * self.other.w
        return self.n


def mutual():
    a = A()
    a.other = B(a)
    return a


@DECORATE
class Act:
    def __init__(self, kind):
        self.kind = kind
        self.mode = "train"
        self.w = jnp.full((2,), 2.0)

    def __call__(self, x):
        y = jnp.tanh(x) if self.kind == "tanh" else jax.nn.relu(x)
        return y * self.w if self.mode == "train" else y

    def eval(self):
        self.mode = "eval"


@DECORATE
class Modes:
    \"\"\"A static str state on a shared sub-model; a str config shared by two.\"\"\"

    def __init__(self):
        act = Act("tanh")
        self.a = act
        self.b = act
        cfg = "relu"
        self.c = Act(cfg)
        self.d = Act(cfg)

    def __call__(self, x):
        return self.a(x) + self.b(x) + self.c(x) + self.d(x)

    def eval(self):
        self.b.eval()


@DECORATE
class Pool:
    \"\"\"A dict state (declared) holding a sub-model that is also an attribute.\"\"\"

    def __init__(self):
        blk = Block(3.0)
        self.pool = STATE({"a": blk})
        self.alias = blk

    def __call__(self, x):
        return self.pool["a"](x) + self.alias(x)


@DECORATE
class Rot:
    \"\"\"A list of sub-models reordered inside a call.\"\"\"

    def __init__(self):
        self.blocks = [Block(1.0), Block(2.0)]

    def __call__(self, x):
        y = self.blocks[0](x)
        self.blocks = self.blocks[::-1]
        return y


@DECORATE
class Bag:
    \"\"\"Array and container states, for aliasing across the f boundary.\"\"\"

    def __init__(self):
        self.n = jnp.zeros(2)
        self.items = [jnp.zeros(())]
        self.d = {"k": jnp.zeros(())}
        self.w = jnp.full((2,), 2.0)

    def __call__(self, x):
        self.n = self.n + x
        self.items = self.items + [jnp.asarray(x)]
        self.d["k"] = self.d["k"] + x
        return self.n * self.w + len(self.items)


@DECORATE
class KV:
    def __init__(self):
        self.kv = STATE(jnp.zeros(2), name="kv", category="cache")
        self.n = jnp.zeros(())

    def __call__(self, x):
        self.kv = self.kv + x
        self.n = self.n + 1
        return self.kv * self.n


@DECORATE
class SharedKV:
    \"\"\"A sub-model with an explicitly named state, on two paths.\"\"\"

    def __init__(self):
        k = KV()
        self.a = k
        self.b = [k]

    def __call__(self, x):
        return self.a(x) + self.b[0](x)


@DECORATE
class DictOrder:
    \"\"\"A shared sub-model under dict keys whose insertion order is not sorted.\"\"\"

    def __init__(self):
        blk = Block(1.0)
        self.d = {"z": blk, "a": blk}
        self.c = blk

    def __call__(self, x):
        return self.c(x) + self.d["a"](x)
"""


EAGER = """
import collections
import threading
import weakref


@DECORATE
class Model:
    def __init__(self):
        self.x = jnp.zeros(2)
        self.n = jnp.zeros((), jnp.int32)

    def step(self, v):
        self.x = v
        self.n = self.n + 1
        return self.x


@DECORATE
class Shared:
    \"\"\"A user __copy__ whose copy shares every __dict__ entry.\"\"\"

    def __init__(self):
        self.x = jnp.zeros(2)

    def step(self, v):
        self.x = v

    def __copy__(self):
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new


@DECORATE
class ByState:
    def __init__(self):
        self.x = jnp.zeros(2)

    def step(self, v):
        self.x = v

    def __getstate__(self):
        return self.__dict__

    def __setstate__(self, state):
        self.__dict__.update(state)


@DECORATE
class ByReduce:
    def __init__(self):
        self.x = jnp.zeros(2)

    def step(self, v):
        self.x = v

    def __reduce__(self):
        return (_rebuild, (type(self), self.__dict__))


def _rebuild(cls, d):
    new = object.__new__(cls)
    new.__dict__.update(d)
    return new


@DECORATE
class Hooked:
    \"\"\"Writes through a user __setattr__ and a property setter.\"\"\"

    def __init__(self):
        object.__setattr__(self, "log", [])
        self.x = jnp.zeros(2)

    def __setattr__(self, name, value):
        self.log.append(name)
        object.__setattr__(self, name, value)

    @property
    def xv(self):
        return self.x

    @xv.setter
    def xv(self, v):
        self.x = v

    def step(self, v):
        self.x = v


@DECORATE
class Tied:
    def __init__(self):
        self.a = jnp.zeros(2)
        self.b = self.a
        self.s1 = Model()
        self.s2 = self.s1

    def step(self, v):
        self.a = v
        self.s1.step(v * 2)
        return self.b


@DECORATE
class Numbers:
    def __init__(self):
        self.x = jnp.zeros(2)
        self.k = 0.0

    def step(self, v):
        self.x = v
        self.k = self.k + 1.0
"""
