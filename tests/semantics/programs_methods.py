"""The programs the methods cases run (``test_methods.py``): class
sources run plain and decorated, and their expected values. Other concept
files import some of them too.
"""

from __future__ import annotations

ALIASES = """
def logged(fn):
    @functools.wraps(fn)
    def wrapper(self, *args):
        return fn(self, *args)
    return wrapper


@DECORATE
class W:
    def __init__(self):
        self.n = jnp.zeros(())

    @logged
    def step(self, x):
        self.n += x
        return self.n

    __call__ = step
    again = step

    def scale(self, k):
        self.n = self.n * k
        return self.n

    times = scale

    @property
    def value(self):
        return self.n + 0

    @value.setter
    def value(self, v):
        self.n = v

    alias_value = value

    def set_via_alias(self, v):
        self.alias_value = v
        return self.value

    @staticmethod
    def bump(model, x):
        model.n = model.n + x
        return model.n

    bump_alias = bump

    def call_static(self, x):
        return self.bump_alias(self, x)

    @classmethod
    def kind(cls):
        return cls.__name__

    kind_alias = kind

    def named(self, x):
        self.n = self.n + x
        return self.n + len(self.kind_alias())
"""


HIDDEN_METHODS = """
import functools
import jax.numpy as jnp


def logged(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


def twice(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


def external(self, x):
    self.count = self.count + 1
    return x * self.count


def make_method(step):
    def inc(self, x):
        self.count = self.count + step
        return x * self.count
    return inc


class CountMixin:
    def bump(self, x):
        self.count = self.count + 1
        return x * self.count


class Wrapped:
    def __init__(self):
        self.count = jnp.zeros(())

    @twice
    @logged
    def __call__(self, x):
        self.count = self.count + 1
        return x * self.count


class Assigned:
    def __init__(self):
        self.count = jnp.zeros(())

    __call__ = external


class Factory:
    def __init__(self):
        self.count = jnp.zeros(())

    __call__ = make_method(2)


class Mixed(CountMixin):
    def __init__(self):
        self.count = jnp.zeros(())

    def __call__(self, x):
        return self.bump(x)
"""


MISC = """
def helper(model, x):
    model.n = model.n + x
    return model.n * 2


@DECORATE
class Leaf:
    def __init__(self, k=1.0):
        self.n = jnp.zeros(())
        self.k = jnp.asarray(k)

    def step(self, c, x):
        self.n = self.n + x * self.k
        return c + self.n, self.n

    def __call__(self, x):
        self.n = self.n + x
        return self.n * self.k


@DECORATE
class Misc:
    def __init__(self):
        self.n = jnp.zeros(())
        self.leaf = Leaf(2.0)
        self.leaves = {"a": Leaf(3.0)}
        self.opt = None
        self.scale = 1.5

    def make_inc(self):
        def inc(v):
            self.n += v
            return self.n
        return inc

    def use_closure(self, v):
        inc = self.make_inc()
        inc(v)
        return inc(v)

    def helper_in_scan(self, xs):
        return lax.scan(lambda c, x: (c + helper(self, x) + helper(self.leaf, x), None),
                        jnp.zeros(()), xs)[0]

    def sub_bound_scan(self, xs):
        return lax.scan(self.leaf.step, jnp.zeros(()), xs)

    def fori_sub_models(self, k):
        def body(i, c):
            return c + self.leaf(k) + self.leaves["a"](c)
        return lax.fori_loop(0, 3, body, jnp.zeros(()))

    def copies(self, v):
        twin = copy.copy(self.leaf)
        twin(v)
        deep = copy.deepcopy(self.leaves)
        deep["a"](v)
        return twin.n + deep["a"].n, self.leaf.n

    def values_gen(self, v):
        gen = (self.n * i for i in range(3))
        self.n = self.n + v
        return list(gen)

    def fluent(self, v):
        self.n += v
        return self

    def partial_write(self, v):
        self.n = self.n + v
        raise ValueError("boom")

    def float_state(self, v):
        self.scale = self.scale * 2
        return v * self.scale

    def swap_none(self, v):
        self.opt = v
        return self.opt
"""


LAST = """
@DECORATE
class Loop:
    def __init__(self):
        self.i = jnp.zeros((), jnp.int32)
        self.acc = jnp.zeros(())
        self.w = jnp.full((2,), 2.0)

    def py_range(self):
        for self.i in range(3):
            self.acc = self.acc + self.i
        return self.acc

    @functools.cached_property
    def doubled(self):
        return self.w * 2

    def __call__(self, x):
        self.acc = self.acc + x
        return self.doubled * self.acc
"""


SIGNATURES = """
@DECORATE
class Sig:
    def __init__(self):
        self.c = jnp.zeros(())
    def __call__(self, x, /, y=1.0, *args, scale, **kw):
        self.c = self.c + (x + y + sum(args)) * scale + sum(kw.values())
        return self.c
    def step(self, x, /, *, states=0.0):
        self.c = self.c * 2 + x + states
        return self.c
"""


RUNTIME = (
    "\n@DECORATE\nclass Tabs:\n"
    "\tdef __init__(self):\n\t\tself.c = jnp.zeros(())\n\t\tself.mode = 'train'\n"
    "\tbump = lambda self, x: setattr(self, 'c', self.c + x)  # LAMBDA\n"
    "\tdef __call__(self, x): self.c = self.c + x; return self.c  # ONELINER\n"
    "\tdef eval(self):\n\t\tself.mode = 'eval'  # STATIC\n"
    "\tpoke = staticmethod(lambda m, x: setattr(m, 'c', m.c * x))  # STATICMETHOD\n"
)


CLOSURES = """
@DECORATE
class Acc:
    def __init__(self):
        self.w = jnp.asarray(2.0)
        self.n = jnp.zeros(())
        self.hist = jnp.zeros(3)

    def make_bumper(self, k):
        def bump(x):
            self.n = self.n + x * k
            self.hist = jnp.roll(self.hist, 1).at[0].set(self.n)
            return self.n * self.w
        return bump

    def make_lambda(self):
        return lambda x: self._add(x)

    def _add(self, x):
        self.n = self.n + x
        return self.n

    def use_now(self, x):
        b = self.make_bumper(2.0)
        return b(x) + b(x)

    def use_lambda(self, x):
        g = self.make_lambda()
        return g(x) * g(x)

    def closures_in_list(self, x):
        fs = [self.make_bumper(k) for k in (1.0, 2.0, 3.0)]
        return jnp.stack([f(x) for f in fs])

    def closure_in_scan(self, xs):
        b = self.make_bumper(0.5)
        return lax.scan(lambda c, x: (c + b(x), None), jnp.zeros(()), xs)[0]

    def closure_as_scan_body(self, xs):
        def outer(k):
            def body(c, x):
                self.n = self.n + x * k
                return c + self.n, self.n
            return body
        return lax.scan(outer(3.0), jnp.zeros(()), xs)

    def closure_in_cond(self, x):
        up, down = self.make_bumper(1.0), self.make_bumper(-1.0)
        return lax.cond(x > 1.6, up, down, x)

    def closure_in_checkpoint(self, x):
        return checkpoint(self.make_bumper(2.0))(x) + self.n
"""


FORWARD_HOOKS = """
import collections
import functools


@DECORATE
class Layer:
    def __init__(self):
        self.w = jnp.asarray(3.0)
        self.n = jnp.zeros(())
        self.seen = jnp.zeros(())
        self.hooks = []
        self.pre = collections.OrderedDict()

    def record(self, y):
        self.seen = self.seen + y
        return None

    def __call__(self, x):
        for h in self.pre.values():
            r = h(x)
            if r is not None:
                x = r
        self.n = self.n + 1
        y = x * self.w
        for h in self.hooks:
            r = h(self, y)
            if r is not None:
                y = r
        return y


@DECORATE
class Pair:
    def __init__(self):
        self.a = Layer()
        self.b = Layer()

    def __call__(self, x):
        return self.b(self.a(x))


def count_hook(m, y):
    m.seen = m.seen + y
    return None


def scale_hook(m, y):
    m.n = m.n * 2
    return y + m.n


def with_hooks(m, *hooks):
    m.hooks.extend(hooks)
    return m


def with_bound_pre(m):
    m.pre["rec"] = m.record
    return m


def with_lambda_pre(m):
    m.pre["lam"] = lambda x: x + m.n
    return m


def with_nested_pre(m):
    def make(model):
        def hook(x):
            model.seen = model.seen + 10 * x
            return None
        return hook
    m.pre["nested"] = make(m)
    return m


def weighted_hook(k, m, y):
    m.seen = m.seen + k * y
    return None


def with_partial_hook(m):
    m.hooks.append(functools.partial(weighted_hook, 3.0))
    return m


def with_foreign_hook(m, other):
    m.hooks.append(lambda mm, y: other.record(y))
    return m


def with_partial_over_model(m):
    m.pre["p"] = functools.partial(count_hook, m)
    return m


def hook_over(model, mm, y):
    model.seen = model.seen + y
    return None


def with_partial_in_list(m):
    m.hooks.append(functools.partial(hook_over, m))
    return m


def cross_hooked():
    p = Pair()
    p.b.pre["from_a"] = p.a.record
    p.a.hooks.append(lambda m, y: p.b.record(y))
    return p
"""


DISPATCH = """
import functools
import operator


@DECORATE
class Disp:
    def __init__(self):
        self.w = jnp.asarray(2.0)
        self.n = jnp.zeros(())
        self.calls = jnp.zeros((), jnp.int32)
        self.names = {"u": "up", "d": "down"}

    def up(self, x):
        self.n = self.n + x
        return self.n

    def down(self, x):
        self.n = self.n - x
        return self.n

    def scaled(self, x, k=1.0):
        self.n = self.n * k + x
        return self.n

    TABLE = {"up": up, "down": down}
    up2 = functools.partialmethod(scaled, k=2.0)

    def via_class_table(self, x):
        return self.TABLE["up"](self, x) + self.TABLE["down"](self, x * 0.5)

    def via_partialmethod(self, x):
        return self.up2(x) * self.w

    def via_getattr(self, x):
        out = jnp.zeros(())
        for key in ("u", "d", "u"):
            out = out + getattr(self, self.names[key])(x)
        return out

    def via_methodcaller(self, x):
        return operator.methodcaller("up", x)(self) + operator.methodcaller("scaled", x, k=3.0)(self)

    def via_attrgetter(self, x):
        self.up(x)
        return operator.attrgetter("n")(self) * self.w

    def via_map(self, xs):
        return jnp.stack(list(map(self.up, xs)))

    def score(self, x):
        self.calls = self.calls + 1
        self.n = self.n + x
        return float(x)

    def via_sorted(self, x):
        vals = [x, x * 3, x * 2]
        order = sorted(vals, key=self.score)
        return jnp.stack(order) + self.n

    def via_reduce(self, xs):
        return functools.reduce(lambda a, b: a + self.up(b), list(xs), jnp.zeros(()))

    def via_tree_map(self, x):
        return jax.tree_util.tree_map(self.up, {"a": x, "b": x * 2})

    def via_partial(self, x):
        return functools.partial(self.scaled, k=0.5)(x) + functools.partial(Disp.up, self)(x)

    def scan_getattr(self, xs):
        body = getattr(self, "body_" + "up")
        return lax.scan(body, jnp.zeros(()), xs)

    def body_up(self, c, x):
        self.n = self.n + x
        return c + self.n, self.n

    BODIES = {"up": body_up}

    def scan_class_table(self, xs):
        return lax.scan(functools.partial(self.BODIES["up"], self), jnp.zeros(()), xs)

    def scan_partial(self, xs):
        def body(k, c, x):
            self.n = self.n + x * k
            return c + self.n, None
        return lax.scan(functools.partial(body, 2.0), jnp.zeros(()), xs)[0]

    def scan_methodcaller(self, xs):
        return lax.scan(lambda c, x: (c + operator.methodcaller("up", x)(self), None),
                        jnp.zeros(()), xs)[0]

    def fori_dispatch(self, x):
        return lax.fori_loop(0, 3, lambda i, c: c + getattr(self, self.names["u"])(x), jnp.zeros(()))
"""


GENS = """
def ticker(model, n):
    for i in range(n):
        model.n = model.n + i
        yield model.n


class Mode:
    def __init__(self, model, scale):
        self.model, self.scale = model, scale

    def __enter__(self):
        self.old = self.model.scale
        self.model.scale = self.scale
        self.model.entered = self.model.entered + 1
        return self.model

    def __exit__(self, *exc):
        self.model.scale = self.old
        return False


@DECORATE
class Gen:
    def __init__(self):
        self.n = jnp.zeros(())
        self.scale = jnp.ones(())
        self.entered = jnp.zeros(())

    def consume(self, x):
        vals = [v * x for v in ticker(self, 3)]
        return jnp.stack(vals)

    def zipped(self, xs):
        return sum(a * b for a, b in zip(ticker(self, 3), xs))

    def mode(self, scale):
        return Mode(self, scale)

    def reset(self):
        self.scale = jnp.ones(())
        self.entered = jnp.zeros(())

    def fwd(self, x):
        self.n = self.n + x * self.scale
        return self.n

    def with_mode(self, x):
        with self.mode(x * 2):
            y = self.fwd(x)
        return y + self.fwd(x)
"""


MADE = """
def make_inc(k):
    def inc(self, x):
        self.s = self.s + k * x
        return self.s
    inc.__name__ = f"inc{k}"
    return inc


@DECORATE
class Looped:
    def __init__(self):
        self.s = jnp.zeros(())
        self.hits = jnp.zeros(3)

    for _k in (1, 2, 3):
        def _m(self, x, _k=_k):
            self.hits = self.hits.at[_k - 1].add(1)
            self.s = self.s + _k * x
            return self.s
        locals()[f"add{_k}"] = _m
    del _m, _k

    mul = make_inc(10)


@DECORATE
class SetLater:
    def __init__(self):
        self.s = jnp.zeros(())

    def __call__(self, x):
        return self.inc2(x) + self.s


for _name, _k in (("inc2", 2), ("inc5", 5)):
    setattr(SetLater, _name, make_inc(_k))


@DECORATE
class Donor:
    def __init__(self):
        self.s = jnp.zeros(())

    def forward(self, x):
        self.s = self.s * 2 + x
        return self.s


@DECORATE
class Borrower:
    forward = Donor.forward

    def __init__(self):
        self.s = jnp.ones(())
        self.w = jnp.full((), 3.0)

    def __call__(self, x):
        return self.forward(x * self.w)
"""


FRAMES = """
import asyncio
import contextlib


@DECORATE
class Stream:
    def __init__(self):
        self.x = jnp.ones(())
        self.n = jnp.zeros(())

    def bump(self, v):
        self.x = self.x + v
        self.n = self.n + 1
        return self.x

    def gen(self, vs):
        for v in vs:
            yield self.bump(v)

    def start(self, vs):
        g = self.gen(vs)
        first = next(g)
        return g, first

    def resume(self, g):
        out = next(g)
        self.x = self.x * 2
        return out

    async def abump(self, v):
        await asyncio.sleep(0)
        out = self.bump(v)
        await asyncio.sleep(0)
        return out + self.bump(v)

    async def astep(self, v, go, ready):
        self.bump(v)
        ready.set()
        await go.wait()
        return self.bump(v)

    async def await_other(self, other, v):
        out = await other.abump(v)
        return out + self.bump(out)

    def run_async(self, v):
        return asyncio.run(self.abump(v))

    @contextlib.contextmanager
    def scope(self, v):
        self.bump(v)
        try:
            yield self.bump(v)
        finally:
            self.bump(v * 10)
"""


RECEIVERS = """
class Plain:
    def __init__(self, x):
        self.x = x
        self.n = x


@DECORATE
class Rc:
    def __init__(this):
        this.n = jnp.zeros(())
        this.x = jnp.ones(())
        this.others = [Plain(1.0), Plain(2.0)]

    def step(this, v):
        this.n += v
        this.x = this.x * 2
        return this.n + this.x

    def shadow_comprehension(self, v):
        self.n = self.n + v
        vals = [self.x for self in self.others]
        total = sum(self.n for self in self.others)
        return vals, total, self.n

    def nested_param_self(self, v):
        def helper(self, k):
            return self.x * k
        lam = lambda self: self.n  # noqa: E731
        self.n = self.n + v
        return helper(self.others[0], 2.0), lam(self.others[1]), helper(self, 3.0)

    def nested_class_self(self, v):
        outer = self
        class Inner:
            def __init__(self):
                self.x = 10.0
            def get(self):
                return self.x + outer.x
        self.x = self.x + v
        return Inner().get()

    def lambda_default_self(self, v):
        get = lambda self=self: self.n  # noqa: E731
        self.n = self.n + v
        return get(), get(self.others[0])

    @staticmethod
    def bump(m, v):
        m.n += v
        return m.n

    def calls_static(self, v):
        return Rc.bump(self, v) + self.bump(self, v)

    @classmethod
    def fresh(cls, v):
        obj = cls()
        obj.n += v
        return obj

    def calls_class(self, v):
        other = type(self).fresh(v)
        self.n = self.n + other.n
        return self.n

    def global_self(self, v):
        def g():
            global self  # noqa: PLW0603
            self = Plain(v)
            return self.x
        r = g()
        self.n = self.n + v
        return r
"""


OUTSIDE_WRAPPED = """
def logged(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


def counting(fn):
    @functools.wraps(fn)
    def wrapper(self, *args):
        self.calls = self.calls + 1
        return fn(self, *args)
    return wrapper


def _step(self, carry, x):
    self.total = self.total + x * self.w
    self.n += 1
    return carry + self.total, self.total * 2.0


def _body(self, i, c):
    self.total = self.total * 0.5 + i
    return c + self.total


def _up(self, x):
    self.total = self.total + x
    return x * 2.0


def _down(self, x):
    self.n -= 1
    return x - self.total


@DECORATE
class Base:
    def __init__(self):
        self.w = jnp.asarray(1.5)
        self.total = jnp.zeros(())
        self.n = jnp.zeros((), jnp.int32)
        self.calls = jnp.zeros((), jnp.int32)

    step = logged(_step)
    body = counting(_body)
    up = logged(_up)
    down = counting(_down)


class Child(Base):
    def scan(self, xs):
        c, ys = lax.scan(self.step, 0.0, xs)
        return c, ys

    def fori(self, x):
        return lax.fori_loop(0, 3, self.body, x)

    def branch(self, x):
        return lax.cond(x > 0, self.up, self.down, x)

    def pick(self, i, x):
        return lax.switch(i, [self.up, self.down, self.step.__get__(self)
                              and (lambda v: self.step(0.0, v)[1])], x)


class GrandChild(Child):
    def __call__(self, xs):
        c, ys = self.scan(xs)
        return self.fori(c) + self.branch(ys[0]) + self.branch(-ys[-1])
"""


CLOSURE_HOOKS = """
@DECORATE
class M:
    def __init__(self):
        self.x = jnp.zeros(())
        self.y = jnp.zeros(())
        self.hooks = []
        def init_hook(v):
            self.y = self.y + v * 3.0
            return self.y
        self.init_hook = init_hook
        self.hooks.append(self.make(2.0))
        self.hooks.append(self.make(-1.0))

    def make(self, k):
        def hook(v):
            self.x = self.x + k * v
            return self.x
        return hook

    def scan_hooks(self, xs):
        def body(c, v):
            for h in self.hooks:
                c = c + h(v)
            return c, self.x + self.y
        return lax.scan(body, 0.0, xs)

    def ckpt_hook(self, v):
        return checkpoint(self.hooks[0])(v) * checkpoint(self.hooks[1])(v)

    def cond_hooks(self, v):
        return lax.cond(v > 0, self.hooks[1], self.hooks[0], v)

    def init_hook_in_cond(self, v):
        return lax.cond(v > 0, self.hooks[1], self.init_hook, v)

    def init_hook_direct(self, v):
        return self.init_hook(v)

    def fresh_closure_in_fori(self, v):
        bump = self.make(v)
        return lax.fori_loop(0, 4, lambda i, c: c + bump(i * 1.0), 0.0)
"""


PROBE = """
def double_hook(module, x):
    return x * 2.0


def count_hook(module, x):
    module.hook_calls = module.hook_calls + 1
    return None


@DECORATE
class Probe:
    def __init__(self, seed, d, depth, none_init=False):
        keys = jax.random.split(jax.random.PRNGKey(seed), depth)
        self.layers = [jax.random.normal(k, (d, d)) * 0.5 for k in keys]
        self.last_hidden = None if none_init else jnp.zeros((d, d))
        self.attn_maps = []
        self.hooks = []
        self.hook_calls = jnp.zeros((), jnp.int32)

    def register_forward_hook(self, fn):
        self.hooks.append(fn)
        return self

    def clear_hook_calls(self):
        self.hook_calls = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.attn_maps = []
        for w in self.layers:
            a = jax.nn.softmax(x @ x.T / x.shape[-1])
            self.attn_maps = self.attn_maps + [a]
            x = jnp.tanh(a @ x @ w)
            for fn in self.hooks:
                r = fn(self, x)
                if r is not None:
                    x = r
        self.last_hidden = x
        return x.sum()


@DECORATE
class Logger:
    def __init__(self):
        self.log = []
        self.w = jnp.ones(3)

    def __call__(self, x):
        self.log.append(x.sum())
        return x * self.w


def hooked(seed):
    return Probe(seed, 3, 2).register_forward_hook(count_hook).register_forward_hook(double_hook)


def warmed(seed):
    m = hooked(seed)
    m(jnp.ones((3, 3)))
    return m
"""


GENERATOR_METHODS = """
import itertools


@DECORATE
class Sub:
    def __init__(self):
        self.n = jnp.zeros(())

    def bump(self, v):
        self.n = self.n + v
        return self.n

    def gen(self, xs):
        for x in xs:
            yield self.bump(x)
        return len(xs) * 10.0


@DECORATE
class M:
    def __init__(self):
        self.sub = Sub()
        self.acc = jnp.zeros(())
        self.closed = jnp.zeros(())
        self.length = 3

    def add(self, v):
        self.acc = self.acc + v
        return self.acc

    def close_mark(self):
        self.closed = self.closed + 1
        return self.closed

    def gen(self, xs):
        r = yield from self.sub.gen(xs)
        yield self.add(r)

    def consume(self, xs):
        return jnp.stack(list(self.gen(xs)))

    def accumulator(self):
        total = jnp.zeros(())
        while True:
            v = yield total
            total = self.add(v) + total

    def drive(self, xs):
        g = self.accumulator()
        next(g)
        outs = [g.send(x) for x in xs]
        g.close()
        return jnp.stack(outs)

    def islice(self, xs):
        return jnp.stack(list(itertools.islice(self.gen(xs), 2)))

    def accumulate(self, xs):
        return jnp.stack(list(itertools.accumulate(map(self.add, xs))))

    def chained(self, xs):
        return jnp.stack(list(itertools.chain(self.sub.gen(xs), self.gen(xs))))

    def zipped(self, xs):
        return jnp.stack([a * b for a, b in zip(self.sub.gen(xs), self.gen(xs))])

    def gen_finally(self, xs):
        try:
            for v in xs:
                yield self.add(v)
        finally:
            self.close_mark()

    def partial_consume(self, xs):
        g = self.gen_finally(xs)
        a = next(g)
        return a + next(g)

    def partial_close(self, xs):
        g = self.gen_finally(xs)
        a = next(g)
        g.close()
        return a + self.closed

    def throw_in(self, xs):
        g = self.gen_finally(xs)
        a = next(g)
        try:
            g.throw(ValueError("t"))
        except ValueError:
            a = a + 100
        return a + self.closed

    def map_once(self, xs):
        m = map(self.add, xs)
        return next(m) + next(m)

    def comprehension_mixed(self, xs):
        return jnp.stack([self.add(v) + self.acc for v in xs])

    def walrus(self, xs):
        ys = [(y := self.add(v)) * 2 for v in xs]
        return jnp.stack(ys) + y

    def setattr_comp(self, xs):
        [setattr(self, "acc", self.acc + v) for v in xs]
        return self.acc

    def dict_comp(self, xs):
        d = {i: self.sub.bump(v) for i, v in enumerate(xs)}
        return d[len(xs) - 1] + sum(self.add(v) for v in xs)

    def __iter__(self):
        for i in range(self.length):
            yield self.add(float(i))

    def iterate(self):
        return sum(v for v in self)

    def scan_inner_gen(self, xs):
        def body(c, x):
            def local():
                for i in range(2):
                    self.acc = self.acc + x * i
                    yield self.acc
            g = self.gen_finally([x, x * 2])
            return c + next(g) + sum(local()), c
        return lax.scan(body, jnp.zeros(()), xs)
"""


CALLABLES = """
@DECORATE
class Sub:
    def __init__(self, w=2.0):
        self.w = jnp.asarray(w)
        self.c = jnp.zeros(())

    def fwd(self, x):
        self.c = self.c + 1
        return self.w * x


@DECORATE
class MultiCell:
    def __init__(self):
        self.n = jnp.zeros(())
        self.a = Sub(2.0)
        self.b = Sub(3.0)
        a, b, k, box = self.a, self.b, 1.5, [10.0]
        self.fn = lambda x: a.fwd(x) + b.fwd(x) * k + box[0] + self._bump(x)

    def _bump(self, x):
        self.n = self.n + x
        return self.n

    def __call__(self, x):
        return self.fn(x)


@DECORATE
class Nested:
    def __init__(self):
        self.n = jnp.zeros(())
        self.make = lambda s: (lambda x: self._bump(x * s))

    def _bump(self, x):
        self.n = self.n + x
        return self.n

    def __call__(self, x):
        return self.make(2.0)(x)


@DECORATE
class Defaults:
    def __init__(self, s=2.0, t=3.0):
        self.n = jnp.zeros(())
        self.fn = lambda x, s=s, *, t=t: self._bump(x * s + t)

    def _bump(self, x):
        self.n = self.n + x
        return self.n

    def __call__(self, x):
        return self.fn(x)


@DECORATE
class KwOnly:
    def __init__(self, k):
        self.n = jnp.zeros(())
        self.fn = lambda x, *, k=k: self._bump(x) * k

    def _bump(self, x):
        self.n = self.n + x
        return self.n

    def __call__(self, x):
        return self.fn(x)


@DECORATE
class Counting:
    def __init__(self):
        self.n = jnp.zeros(())
        count = 0

        def fn(x):
            nonlocal count
            count += 1
            return self._bump(x) * count

        self.fn = fn

    def _bump(self, x):
        self.n = self.n + x
        return self.n

    def __call__(self, x):
        return self.fn(x)


@DECORATE
class BoundBefore:
    def __init__(self):
        head = Sub(4.0)
        self.score = head.fwd
        self.head = head

    def __call__(self, x):
        return self.score(x)


@DECORATE
class Tied:
    def __init__(self):
        s = Sub(2.0)
        self.a = s
        self.b = s
        self.fa = self.a.fwd
        self.fb = self.b.fwd

    def __call__(self, x):
        return self.fa(x) + self.fb(x) + self.a.c


@DECORATE
class Foreign:
    def __init__(self):
        self.n = jnp.zeros(())
        self.score = Sub(5.0).fwd

    def __call__(self, x):
        self.n = self.n + 1
        return self.score(x) + self.n


@DECORATE
class DeadRef:
    def __init__(self):
        self.n = jnp.zeros(())
        self.ref = weakref.ref(Sub(1.0))

    def __call__(self, x):
        self.n = self.n + x
        r = self.ref()
        return self.n if r is None else r.fwd(x)


@DECORATE
class Child:
    def __init__(self, parent):
        self._parent = weakref.ref(parent)
        self.k = jnp.ones(())

    def fwd(self, x):
        return self._parent().scale * x * self.k


@DECORATE
class Parent:
    def __init__(self):
        self.scale = jnp.asarray(3.0)
        self.n = jnp.zeros(())
        self.child = Child(self)

    def __call__(self, x):
        self.n = self.n + self.child.fwd(x)
        return self.n


def _helper(x):
    return x * 7


@DECORATE
class StaticObjs:
    def __init__(self):
        self.n = jnp.zeros(())
        self.sfn = staticmethod(_helper)
        self.cfn = type(self).scale_of

    @classmethod
    def scale_of(cls, x):
        return x * 0.5

    def __call__(self, x):
        self.n = self.n + self.sfn(x) + self.cfn(x)
        return self.n


@DECORATE
class TreePartial:
    def __init__(self):
        self.n = jnp.zeros(())
        self.fn = jax.tree_util.Partial(self._bump)

    def _bump(self, x):
        self.n = self.n + x
        return self.n

    def __call__(self, x):
        return self.fn(x)


@DECORATE
class InList:
    def __init__(self):
        self.n = jnp.zeros(())
        self.sub = Sub(3.0)
        self.fns = ([self._bump, lambda x: self.sub.fwd(x)], {"r": weakref.ref(self.sub)})

    def _bump(self, x):
        self.n = self.n + x
        return self.n

    def __call__(self, x):
        return self.fns[0][0](x) + self.fns[0][1](x) + self.fns[1]["r"]().fwd(x)


def _outer_of(model):
    return lambda: model.n


@DECORATE
class ViaFunction:
    def __init__(self):
        self.n = jnp.zeros(())
        get = _outer_of(self)
        self.fn = lambda x: get() + x

    def __call__(self, x):
        self.n = self.n + x
        return self.fn(x)


@DECORATE
class ViaBox:
    def __init__(self):
        self.n = jnp.zeros(())
        box = [self]
        self.fn = lambda x: box[0].n + x

    def __call__(self, x):
        self.n = self.n + x
        return self.fn(x)


@DECORATE
class Appender:
    def __init__(self):
        self.n = jnp.zeros(())
        self.log = [jnp.zeros(())]
        self.push = self.log.append

    def __call__(self, x):
        self.n = self.n + x
        self.push(self.n)
        return self.n
"""
