"""The programs the numerics cases run (``test_numerics.py``): class
sources run plain and decorated, and their expected values. Other concept
files import some of them too.
"""

from __future__ import annotations

KINDS = """
class Pt(typing.NamedTuple):
    a: typing.Any
    b: typing.Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Moments:
    m: typing.Any
    n: typing.Any


@DECORATE
class Kinds:
    def __init__(self):
        self.fl = 0.5
        self.cx = 1 + 1j
        self.wf = jnp.asarray(0.0)
        self.wi = jnp.asarray(0)
        self.i2f = jnp.zeros((), jnp.int32)
        self.bf = jnp.zeros(2, jnp.bfloat16)
        self.h = jnp.zeros(2, jnp.float16)
        self.c64 = jnp.ones(2, jnp.complex64)
        self.u8 = jnp.zeros(3, jnp.uint8)
        self.mask = jnp.zeros(3, bool)
        self.zero = jnp.zeros((0, 2))
        self.d0 = jnp.float32(0)
        self.key = jax.random.key(0)
        self.raw = jax.random.PRNGKey(1)
        self.pt = Pt(jnp.zeros(2), jnp.zeros((), jnp.int32))
        self.mom = Moments(jnp.zeros(2), jnp.zeros((), jnp.int32))
        self.nested = {"a": [jnp.zeros(1), (jnp.ones(()), {"z": jnp.zeros((), jnp.uint8)})]}
        self.w = jnp.ones(2)

    def step(self, x):
        self.fl = self.fl * 0.5 + 1.0
        self.cx = self.cx * 1j
        self.wf = self.wf + 1
        self.wi = self.wi + 1
        self.i2f = self.i2f + 0.5
        self.bf = self.bf + 0.25
        self.h += 1.5
        self.c64 = self.c64 * 1j + x
        self.u8 = self.u8 + 100
        self.mask = self.mask | (jnp.arange(3) < x)
        self.zero = self.zero * x
        self.d0 = self.d0 + x
        self.key, k = jax.random.split(self.key)
        self.raw, k2 = jax.random.split(self.raw)
        self.pt = self.pt._replace(a=self.pt.a + x, b=self.pt.b + 1)
        self.mom = Moments(self.mom.m * 0.5 + x, self.mom.n + 1)
        inner = self.nested["a"][1]
        self.nested = {"a": [self.nested["a"][0] + x, (inner[0] * 2, {"z": inner[1]["z"] + 1})]}
        return (
            jax.random.bits(k) ^ jax.random.bits(k2),
            self.fl * self.w,
            self.wf + self.wi,
            self.bf.sum(),
            self.u8,
        )

    def weak_only(self):
        self.wf = self.wf * 2
        self.wi = self.wi * 3
        self.fl = self.fl + 2.0
        return self.wf + self.fl, self.wi + 1
"""


CHANGES = """
@DECORATE
class Changing:
    def __init__(self):
        self.n = jnp.zeros((), jnp.int32)
        self.buf = jnp.zeros((0, 2))
        self.hist = ()
        self.log = []
        self.seen = {}
        self.kv = jnp.zeros(2)
        self.lo = jnp.zeros(2, jnp.bfloat16)

    def promote(self, x):
        self.n = self.n + 0.5
        return self.n * x

    def demote(self):
        self.n = self.n.astype(jnp.int32)
        return self.n

    def to_bool(self):
        self.n = self.n > 0
        return self.n

    def widen(self, x):
        self.lo = self.lo + x
        return self.lo

    def narrow(self):
        self.lo = self.lo.astype(jnp.bfloat16)
        return self.lo

    def push(self, x):
        self.buf = jnp.concatenate([self.buf, jnp.stack([x, -x])[None]])
        self.hist = self.hist + (x,)
        self.log = self.log + [x * 2]
        self.seen = {**self.seen, f"k{len(self.seen)}": x}
        return self.buf.sum(0), len(self.hist)

    def drop(self):
        self.buf = self.buf[1:]
        self.hist = self.hist[1:]
        self.log = self.log[:-1]
        return self.buf.shape[0]

    def clear_kv(self):
        self.kv = None

    def fill_kv(self, x):
        self.kv = (jnp.zeros(2) if self.kv is None else self.kv) + x
        return self.kv
"""


OVER = """
@DECORATE
class Noisy:
    def __init__(self, seed=0):
        self.key = jax.random.key(seed)
        self.raw = jax.random.PRNGKey(seed + 7)
        self.fl = 0.5
        self.wi = jnp.asarray(0)
        self.bf = jnp.zeros(2, jnp.bfloat16)
        self.u8 = jnp.zeros(2, jnp.uint8)
        self.h = jnp.zeros((), jnp.float16)
        self.w = jnp.array([1.0, -2.0])

    def __call__(self, x):
        self.key, k = jax.random.split(self.key)
        self.raw, k2 = jax.random.split(self.raw)
        self.fl = self.fl * 0.5 + 1.0
        self.wi = self.wi + 1
        self.bf = self.bf + x.astype(jnp.bfloat16)
        self.u8 = self.u8 + 100
        self.h = self.h + 0.25
        noise = jax.random.uniform(k, (2,)) + jax.random.uniform(k2, (2,))
        return (x * self.w + noise) * self.fl + self.wi
"""


DTYPES = """
class Pt(NamedTuple):
    a: jax.Array
    b: jax.Array


class Mode(enum.Enum):
    A = 1
    B = 2


@DECORATE
class Typed:
    def __init__(self, dtype):
        self.x = jnp.zeros(3, dtype)
        self.dtype = dtype

    def step(self, v):
        self.x = self.x + jnp.asarray(v).astype(self.dtype)
        self.x = self.x.at[0].set((self.x[1] * 2).astype(self.dtype))
        return self.x


@DECORATE
class Py:
    def __init__(self):
        self.fl = 1.5
        self.cx = 1 + 2j
        self.i = 3
        self.b = True
        self.w = jnp.ones(())

    def step(self, x):
        self.fl = self.fl * 2 + x
        self.cx = self.cx * 1j
        return self.fl * self.w + self.i * self.b

    def bump_int(self):
        self.i = self.i + 1

    def flip(self):
        self.b = not self.b


@DECORATE
class Np:
    def __init__(self):
        self.arr = np.ones(2, np.float32)
        self.sc = np.float32(2.0)
        self.ints = np.arange(3)
        self.lst = [np.zeros(1), {"k": np.ones(1)}]

    def step(self, x):
        self.arr = self.arr + x
        self.sc = self.sc * 2
        self.ints = self.ints + 1
        self.lst = [self.lst[0] + x, {"k": self.lst[1]["k"] * 2}]
        return self.arr.sum() + self.sc


@DECORATE
class Strs:
    def __init__(self):
        self.labels = np.array(["a", "b"])
        self.n = jnp.zeros(())

    def __call__(self, x):
        self.n = self.n + x
        self.labels = self.labels
        return self.n


@DECORATE
class Trees:
    def __init__(self):
        self.pt = Pt(jnp.zeros(2), jnp.ones(2))
        self.nested = {"a": [jnp.zeros(1), (jnp.zeros(1), {"z": jnp.ones(1)})]}
        self.empty_l = []
        self.empty_t = ()
        self.empty_d = {}
        self.t = (jnp.zeros(()), jnp.ones(()))

    def step(self, x):
        self.pt = self.pt._replace(a=self.pt.a + x)
        inner = self.nested["a"][1]
        self.nested = {"a": [self.nested["a"][0] * 2, (inner[0] + x, {"z": inner[1]["z"] * x})]}
        self.empty_l = []
        self.empty_t = ()
        self.empty_d = {}
        return self.pt.a.sum() + self.nested["a"][1][1]["z"].sum()

    def tolist(self):
        self.t = list(self.t)
        return self.t[1]

    def grow(self, x):
        self.t = tuple(self.t) + (x,)
        return sum(self.t)


@DECORATE
class Static:
    def __init__(self):
        self.mode = Mode.A
        self.name = "x"
        self.w = jnp.ones(())

    def set_b(self):
        self.mode = Mode.B

    def same(self):
        self.mode = Mode.A
        self.name = "x"
        return self.w

    def __call__(self, x):
        return x * self.w * (2.0 if self.mode is Mode.A else 3.0) + len(self.name)


@DECORATE
class Keys:
    def __init__(self, seed):
        self.key = jax.random.key(seed)
        self.raw = jax.random.PRNGKey(seed + 1)
        self.acc = jnp.zeros(())

    def __call__(self, x):
        self.key, sub = jax.random.split(self.key)
        self.raw, sub2 = jax.random.split(self.raw)
        self.acc = self.acc + jax.random.normal(sub, ()) + jax.random.uniform(sub2, ()) * x
        return self.acc


@DECORATE
class Ordered:
    def __init__(self):
        self.d = {"b": jnp.zeros(()), "a": jnp.ones(())}
        self.ik = {2: jnp.zeros(()), 1: jnp.ones(())}

    def first(self, x):
        self.d = {k: v + x for k, v in self.d.items()}
        return list(self.d.values())[0] + list(self.ik.values())[0] * 10

    def touch(self):
        self.ik = dict(self.ik)


@DECORATE
class Typed2:
    def __init__(self):
        self.od = collections.OrderedDict(b=jnp.zeros(()), a=jnp.ones(()))
        self.dd = collections.defaultdict(lambda: jnp.zeros(()))
        self.dd["x"] = jnp.ones(())

    def put(self, k, v):
        self.od[k] = v
        self.dd[k] += v
        return self.dd[k]
"""


ODD = """
@DECORATE
class Odd:
    def __init__(self):
        self.w = jnp.array([1.0, -2.0])
        self.gain = 0.5
        self.cache = {"k": None, "v": jnp.zeros(2)}
        self.empty_l = []
        self.empty_d = {}
        self.empty_t = ()
        self.hits = jnp.zeros((), jnp.int32)
        self.flag = jnp.array(False)
        self.bytes = jnp.array([250, 3], jnp.uint8)
        self.small = jnp.array([120, -3], jnp.int8)
        self.nothing = None

    def __call__(self, x):
        self.gain = self.gain * 1.5
        self.cache = {"k": None, "v": self.cache["v"] + x}
        self.empty_l = list(self.empty_l)
        self.empty_d = dict(self.empty_d)
        self.empty_t = tuple(self.empty_t)
        self.hits += 1
        self.flag = ~self.flag
        self.bytes = self.bytes + jnp.uint8(4)
        self.small = self.small + jnp.int8(5)
        self.nothing = None
        return x * self.w * self.gain + jnp.where(self.flag, 1.0, 0.0)

    def peek(self):
        return self.cache["v"] * self.gain + self.hits
"""
