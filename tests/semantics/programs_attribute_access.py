"""The programs the attribute access cases run (``test_attribute_access.py``): class
sources run plain and decorated, and their expected values. Other concept
files import some of them too.
"""

from __future__ import annotations

DUNDERS = """
@DECORATE
class D:
    def __init__(self):
        self.x = jnp.zeros(())

    def step(self, v):
        self.x = self.x + v
        return self.x

    def raw(self, v):
        self.__dict__["x"] = v
        return self.x

    def extra(self, v):
        self.__dict__["note"] = v
        return self.note

    def kind(self):
        return float(len(self.__class__.__name__))


class E(D):
    pass


@DECORATE
class Switch:
    def __init__(self):
        self.x = jnp.zeros(())

    def become(self):
        self.__class__ = Other
        return 1.0


@DECORATE
class Other(Switch):
    def step(self, v):
        self.x = self.x + v
        return self.x
"""


HOOKS = """
import dataclasses
import jax.numpy as jnp


class Clamped:
    def __init__(self):
        self.count = jnp.zeros(())

    def __setattr__(self, name, value):
        if name == "count":
            value = jnp.minimum(value, 10.0)
        super().__setattr__(name, value)

    def __call__(self, x):
        self.count = self.count + 55 * x
        return self.count


class Counted:
    reads = 0

    def __init__(self):
        self.count = jnp.zeros(())

    def __getattribute__(self, name):
        if name == "count":
            type(self).reads += 1
        return object.__getattribute__(self, name)

    def __call__(self, x):
        self.count = self.count + x
        return self.count


@dataclasses.dataclass(frozen=True)
class Frozen:
    count: object

    def __call__(self, x):
        self.count = self.count + x
        return self.count
"""


PROTO = """
@DECORATE
class Acc:
    k = 5.0

    def __init__(self, n=2):
        self.w = jnp.ones(n)
        self.n = jnp.zeros(n)
        self.k = jnp.zeros(())
        self.tag = "acc"

    def __call__(self, x):
        self.n = self.n + x * self.w
        self.k = self.k + 1
        return self.n.sum() + self.k

    def same(self, v):
        self.n = v
        return self.n is v

    def reset(self):
        self.__init__(self.n.shape[0])
        return self.n


@DECORATE
class Leaf:
    def __init__(self):
        self.n = jnp.zeros(())
        self.w = jnp.ones(())

    def __call__(self, x):
        self.n = self.n + x * self.w
        return self.n


@DECORATE
class Host:
    def __init__(self):
        self.n = jnp.zeros(())

    def call_extra(self, x):
        self.n = self.n + x
        return self.extra(x) + self.n

    def use_param(self, x):
        self.n = self.n + (x * self.added).sum()
        return self.n


@DECORATE
class Made:
    count = 0

    def __new__(cls, *args, **kwargs):
        obj = super().__new__(cls)
        obj.created = "yes"
        Made.count += 1
        return obj

    def __init__(self, scale):
        self.scale = scale
        self.n = jnp.zeros(())

    def __call__(self, x):
        self.n = self.n + x * self.scale
        return self.n


@DECORATE
class Base:
    def __init__(self):
        self.__v = jnp.zeros(())
        self.w = jnp.ones(())

    def bump(self):
        self.__v = self.__v + self.w
        return self.__v


class Sub(Base):
    def __init__(self):
        super().__init__()
        self.__v = jnp.full((), 10.0)

    def bump2(self):
        self.__v = self.__v * 2
        return self.__v + self._Base__v


class Fast(Leaf):
    def __call__(self, x):
        self.n = self.n + 100 * x
        return self.n


@DECORATE
class Buf:
    def __init__(self, n):
        self.items = jnp.zeros(n)
        self.pos = jnp.zeros((), jnp.int32)
        self.hits = jnp.zeros(())

    def __repr__(self):
        return f"Buf(n={len(self)})"

    def __len__(self):
        return self.items.shape[0]

    def __getitem__(self, i):
        return self.items[i]

    def __setitem__(self, i, v):
        self.items = self.items.at[i].set(v)

    def __iter__(self):
        return iter([self.items[i] for i in range(len(self))])

    def __iadd__(self, v):
        self.items = self.items + v
        return self

    def __add__(self, v):
        return self.items + v

    def __enter__(self):
        self.hits = self.hits + 1
        return self

    def __exit__(self, *exc):
        self.hits = self.hits * 10
        return False

    def push(self, v):
        self[self.pos] = v
        self.pos = self.pos + 1
        with self:
            s = sum(self)
        other = self
        other += 1.0
        return s + len(self) + self[0] + (self + 1.0).sum()

    def describe(self):
        return repr(self)


@DECORATE
class Kid:
    def __init__(self, parent):
        self._parent = weakref.ref(parent)
        self.n = jnp.zeros(())

    def __call__(self, x):
        self.n = self.n + x
        return self._parent().total + self.n


@DECORATE
class Par:
    def __init__(self):
        self.total = jnp.zeros(())
        self.kid = Kid(self)

    def __call__(self, x):
        self.total = self.total + 10 * x
        return self.kid(x)
"""


DYNAMIC = """
import operator


@DECORATE
class M:
    def __init__(self):
        self.acc0 = jnp.zeros(())
        self.acc1 = jnp.zeros(())
        self.acc2 = jnp.zeros(())
        self.scale = jnp.asarray(1.5)
        self.names = ("acc0", "acc1", "acc2")

    def _touch(self):
        self.acc0 = self.acc0
        self.acc1 = self.acc1
        self.acc2 = self.acc2

    def step(self, c, x, k=1.0):
        self.acc0 = self.acc0 + x * k
        return c + self.acc0, self.acc0

    def partial_scan(self, xs):
        return lax.scan(functools.partial(self.step, k=self.scale), 0.0, xs)

    def methodcaller_fori(self, x):
        call = operator.methodcaller("step", 0.0, x, k=2.0)
        return lax.fori_loop(0, 3, lambda i, c: c + call(self)[0], 0.0)

    def getattr_cond(self, x, which):
        name = ["ste", "p"]
        fn = getattr(self, "".join(name))
        other = getattr(type(self), "st" + "ep")
        return lax.cond(which, lambda v: fn(0.0, v)[0], lambda v: other(self, 1.0, v, 3.0)[1], x)

    def setattr_loop(self, xs):
        def body(c, x):
            for i, n in enumerate(self.names):
                setattr(self, n, getattr(self, n) + x * (i + 1))
            total = sum(v for k, v in vars(self).items() if k.startswith("acc"))
            return c + total, self.__dict__["acc2"]
        return lax.scan(body, 0.0, xs)

    def dict_write_in_body(self, x):
        def body(i, c):
            vars(self)["acc1"] = self.acc1 + x
            self.__dict__.update(acc2=self.acc2 - x)
            return c + self.acc1 * self.acc2
        return lax.fori_loop(0, 3, body, 0.0)

    def tree_partial_scan(self, xs):
        return lax.scan(jax.tree_util.Partial(self.step, k=0.5), 0.0, xs)
"""


BEHIND = """
@DECORATE
class Sub:
    def __init__(self):
        self.w = jnp.asarray(2.0)
        self.c = jnp.zeros(())

    def fwd(self, x):
        self.c = self.c + 1
        return self.w * x


@DECORATE
class Behind:
    def __init__(self):
        self.w = jnp.asarray(3.0)
        self.n = jnp.zeros(())
        self.cfg = 1
        self.sub = Sub()

    def via_vars(self, x):
        vars(self)["n"] = x
        return x

    def via_update(self, x):
        self.__dict__.update(n=x)
        return x

    def via_object_state(self, x):
        object.__setattr__(self, "n", x)
        return x

    def via_object_param(self, x):
        object.__setattr__(self, "w", x)
        return x

    def via_sub_vars(self, x):
        vars(self.sub)["w"] = x
        return x

    def add_attr(self, x):
        vars(self)["extra"] = 1
        return x

    def del_attr(self, x):
        self.__dict__.pop("cfg")
        return x

    def set_static(self, x):
        vars(self)["cfg"] = 2
        return x

    def dunder_setattr(self, x):
        self.__setattr__("n", self.n + x)
        return self.n

    @functools.cached_property
    def doubled(self):
        return self.w * 2

    def use_cached(self, x):
        return self.doubled * x

    def __call__(self, x):
        self.n = self.n + x
        return self.n * self.w + self.sub.fwd(x)
"""


CONTEXT_CONSTRUCTS = """
import contextlib


@DECORATE
class Ctx:
    __match_args__ = ("s",)

    def __init__(self):
        self.w = jnp.ones(3)
        self.depth = jnp.zeros(())
        self.s = jnp.zeros(())
        self.log = jnp.zeros(())

    def __enter__(self):
        self.depth = self.depth + 1
        return self

    def __exit__(self, *exc):
        self.depth = self.depth - 1
        self.log = self.log + 10
        return False

    def with_self(self, x):
        with self:
            self.s = self.s + x * self.depth
        return self.s + self.depth

    def nested_cm(self, x):
        @contextlib.contextmanager
        def scope():
            self.depth = self.depth + 1
            try:
                yield self.s
            finally:
                self.depth = self.depth - 1
                self.s = self.s * 2
        with scope() as v:
            self.s = self.s + x + v
        return self.s

    def try_finally(self, x):
        try:
            self.s = self.s + x
            raise ValueError("boom")
        except ValueError:
            self.log = self.log + 1
        finally:
            self.depth = self.depth + 2
        return self.s

    def raising_inner(self, x):
        self.s = self.s + x
        raise KeyError("inner")

    def catches(self, x):
        try:
            self.raising_inner(x)
        except KeyError:
            self.log = self.log + 100
        return self.s + self.log

    def lambda_default(self, x):
        f = lambda v, base=self.s: v + base
        self.s = self.s + 1
        return f(x) + self.s

    def closure_nonlocal(self, x):
        total = jnp.zeros(())
        def add(v):
            nonlocal total
            total = total + v * self.s
            self.s = self.s + 1
        add(x)
        add(x)
        return total

    def genexpr_writes(self, x):
        def bump(i):
            self.s = self.s + i * x
            return self.s
        vals = list(bump(i) for i in range(3))
        d = {i: bump(i) for i in range(2)}
        return jnp.stack(vals), d

    def fstring(self, x):
        self.s = self.s + x
        msg = f"depth={self.depth} s={self.s!r}"
        return self.s, len(msg) > 0

    def assert_eagerly(self, x):
        self.s = self.s + x
        assert self.log.shape == ()
        return self.s

    def lazy_gen(self, n):
        def gen():
            for i in range(n):
                self.s = self.s + i
                yield self.s
        return gen()

    def consume_lazy(self, x):
        out = [v for v in self.lazy_gen(3)]
        return jnp.stack(out) + x

    def class_pattern(self, x):
        self.s = self.s + x
        match self:
            case Ctx(s):
                return s * 2
        return x

    def match_shape(self, x):
        match self.w.shape:
            case (3,):
                self.s = self.s + x
            case _:
                self.s = self.s - x
        return self.s

    def sum_over_vars_keys(self, x):
        self.s = self.s + x
        return sum(jnp.sum(getattr(self, k)) for k in sorted(vars(self)))

    def scan_raises(self, xs):
        def body(c, x):
            self.s = self.s + x
            if c.ndim == 0:
                raise ValueError("stop")
            return c, x
        try:
            lax.scan(body, jnp.zeros(()), xs)
        except ValueError:
            pass
        return self.s

    def cond_raises(self, x):
        def yes(v):
            self.s = self.s + v
            raise ValueError("stop")
        def no(v):
            return v
        try:
            lax.cond(x > 0, yes, no, x)
        except ValueError:
            pass
        return self.s + 1

    def count_arrays(self):
        return sum(1 for v in vars(self).values() if isinstance(v, jax.Array))

    def buffers(self):
        return {k: v for k, v in self.__dict__.items() if isinstance(v, jax.Array)}
"""
