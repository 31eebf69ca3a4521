"""The programs the escapes cases run (``test_escapes.py``): class
sources run plain and decorated, and their expected values. Other concept
files import some of them too.
"""

from __future__ import annotations

HELPER_WRITES = """
import jax.numpy as jnp


def bump(m):
    m.count = m.count + 1


class NoStates:
    def __init__(self):
        self.w = jnp.ones(())
        self.count = 0

    def __call__(self, x):
        bump(self)
        return x * self.w + self.count
"""


TRANSFORMS_INSIDE = """
import jax.lax as L
from jax.lax import scan as my_scan

if type(lax).__name__ == "_PyLax":  # the plain reference: Python loops
    L = lax
    my_scan = lax.scan


@DECORATE
class T:
    def __init__(self):
        self.n = jnp.zeros(())
        self.w = jnp.array([1.0, 2.0])

    def vmap_reads(self, xs):
        return jax.vmap(lambda x: x * self.w + self.n)(xs)

    def grad_reads(self, x):
        self.n = self.n + 1
        return jax.grad(lambda v: jnp.sum(jnp.sin(v * self.w)) * self.n)(x)

    def alias_scan(self, xs):
        def body(c, x):
            self.n = self.n + x
            return c, self.n
        a = L.scan(body, 0.0, xs)[1]
        b = my_scan(body, 0.0, xs, reverse=True)[1]
        return a, b

    def scan_length(self, k):
        def body(c, _):
            self.n = self.n + k
            return c + self.n, None
        return lax.scan(body, jnp.zeros(()), None, length=3)[0]

    def vmap_writes(self, xs):
        def one(x):
            self.n = self.n + x
            return x
        return jax.vmap(one)(xs)

    def grad_writes(self, x):
        def loss(v):
            self.n = v * 2
            return v ** 2
        return jax.grad(loss)(x)

    def jit_bound(self, x):
        return jax.jit(self.bump)(x)

    def bump(self, x):
        self.n = self.n + x
        return self.n

    def dynamic_scan(self, xs):
        def body(c, x):
            self.n = self.n + x
            return c, None
        getattr(jax.lax, "scan")(body, 0.0, xs)
        return self.n

    def gen(self, k):
        for i in range(k):
            yield self.bump(float(i))
"""


NESTED = """
import functools


@DECORATE
class Nest:
    def __init__(self):
        self.w = jnp.asarray(2.0)
        self.n = jnp.zeros(())

    def step(self, x):
        self.n = self.n + x
        return self.n * self.w

    def read(self, x):
        return self.n * x + self.w

    def block(self, x, k=1.0):
        self.n = self.n + x * k
        return jnp.sin(x) * self.w * k

    def jit_write(self, x):
        return jax.jit(self.step)(x)

    def vmap_write(self, xs):
        return jax.vmap(self.step)(xs)

    def eval_shape_write(self, x):
        return jax.eval_shape(self.step, x).shape

    def jit_read(self, x):
        self.n = self.n + 1
        return jax.jit(self.read)(x)

    def vmap_read(self, xs):
        self.n = self.n + 1
        return jax.vmap(self.read)(xs)

    def checkpoint_partial(self, x):
        return checkpoint(functools.partial(self.block, k=2.0))(x) + self.n

    def checkpoint_static(self, x):
        return checkpoint(self.block, static_argnums=(1,))(x, 3.0) + self.n

    def associative(self, xs):
        def combine(a, b):
            self.n = self.n + 1
            return a + b
        return jax.lax.associative_scan(combine, xs)

    def named(self, x):
        return jax.named_call(self.step, name="my_step")(x) + self.n

    def aliased_scan(self, xs):
        scan = lax.scan
        return scan(lambda c, x: (c + self.step(x), None), jnp.zeros(()), xs)[0]
"""


INSIDE = """
LOG = []


def _record(m):
    LOG.append(np.asarray(m))


@DECORATE
class Net:
    def __init__(self):
        self.w = jnp.array([1.0, -2.0, 0.5])
        self.mean = jnp.zeros(3)
        self.calls = jnp.zeros((), jnp.int32)

    def helper_read(self, x):
        return x * self.w + self.mean

    def block(self, x):
        self.mean = 0.5 * self.mean + x
        return jnp.sin(x * self.w) * self.mean

    def bump(self, k, x):
        self.mean = self.mean + k * x
        self.calls += 1
        return self.mean.sum()

    def step(self, k, c, x):
        self.mean = self.mean * 0.5 + k * x
        self.calls += 1
        return c + self.mean.sum(), self.mean

    def fstep(self, k, i, v):
        self.mean = self.mean + v * k
        self.calls += 1
        return v * 0.5 + i

    def below(self, v):
        return v < self.mean.sum()

    def grow(self, v):
        self.calls += 1
        self.mean = self.mean + 0.5
        return v + 1.0

    # --- nested jax.jit -----------------------------------------------------------

    def jit_lambda_after_write(self, x):
        self.mean = self.mean + x
        self.calls += 1
        return jax.jit(lambda v: self.helper_read(v))(x)

    def jit_bound_twice(self, x):
        a = jax.jit(self.helper_read)(x)
        self.mean = self.mean + 1.0
        b = jax.jit(self.helper_read)(x)
        return a + b

    def jit_result_assigned(self, x):
        new = jax.jit(lambda m, v: m * 0.5 + v)(self.mean, x)
        self.mean = new
        return new.sum()

    def jit_static_arg(self, x):
        g = jax.jit(lambda v, k: v * k + self.mean, static_argnums=1)
        self.calls += 1
        return g(x, 3)

    # --- checkpoint / remat ---------------------------------------------------------

    def ckpt_bound(self, x):
        return jax.checkpoint(self.block)(x)

    def remat_policy(self, x):
        return jax.remat(self.block, policy=jax.checkpoint_policies.everything_saveable)(x)

    def ckpt_decorated_nested(self, x):
        @jax.checkpoint
        def inner(v):
            self.calls += 1
            return self.block(v) * 2
        return inner(x)

    # --- naming and compile-time evaluation ------------------------------------------

    def named_call_read(self, x):
        self.calls += 1
        return jax.named_call(self.helper_read, name="hr")(x)

    def named_scope_nested(self, x):
        with jax.named_scope("outer"):
            self.mean = self.mean + x
            with jax.named_scope("inner"):
                self.calls += 2
                y = self.mean * self.w
        return y

    def named_scope_scan(self, xs):
        def body(c, x):
            with jax.named_scope("step"):
                self.mean = self.mean * 0.5 + x
                self.calls += 1
            return c + 1.0, self.mean.sum()
        with jax.named_scope("loop"):
            return lax.scan(body, 0.0, xs)

    def cte_read(self, x):
        self.calls += 1
        with jax.ensure_compile_time_eval():
            k = jnp.arange(3.0)
            m = self.mean * 2
        self.mean = self.mean + x * k
        return m

    def cte_write(self, x):
        with jax.ensure_compile_time_eval():
            self.mean = self.mean + x
        return self.mean * self.w

    # --- lax primitives handed bound methods ---------------------------------------

    def lax_map_read(self, xs):
        return lax.map(self.helper_read, xs)

    def lax_map_partial_write(self, xs):
        return lax.map(functools.partial(self.bump, 2.0), xs)

    def assoc_read(self, xs):
        return jax.lax.associative_scan(lambda a, b: a + b * self.w, xs)

    def reduce_read(self, xs):
        self.calls += 1
        return jax.lax.reduce(xs * self.w, 0.0, jax.lax.add, (0,))

    def while_cond_method(self, x):
        self.mean = self.mean + x
        return lax.while_loop(self.below, lambda v: v + 1.0, 0.0)

    def while_cond_method_body_writes(self, x):
        return lax.while_loop(self.below, self.grow, 0.0)

    def scan_partial(self, xs):
        return lax.scan(functools.partial(self.step, 3.0), 0.0, xs)

    def fori_partial(self, x):
        return lax.fori_loop(0, 3, functools.partial(self.fstep, 2.0), x)

    # --- vmap / grad family of closures that only read state ------------------------

    def vmap_read(self, xs):
        self.calls += 1
        return jax.vmap(self.helper_read)(xs)

    def vmap_read_after_write(self, x):
        self.mean = self.mean + x
        return jax.vmap(lambda v, m: v * m + self.mean, in_axes=(0, None))(
            jnp.stack([x, 2 * x]), self.w)

    def grad_read_after_write(self, x):
        self.mean = self.mean + x
        return jax.grad(lambda v: (jnp.sin(v) * self.mean).sum())(x)

    def jvp_read_after_write(self, x):
        self.mean = self.mean + x
        return jax.jvp(lambda v: jnp.sin(v) * self.mean, (x,), (jnp.ones(3),))

    def linearize_read_after_write(self, x):
        self.mean = self.mean + x
        y, lin = jax.linearize(lambda v: jnp.sin(v) * self.mean, x)
        return y, lin(jnp.ones(3))

    def hessian_read(self, x):
        self.mean = self.mean + x
        return jax.hessian(lambda v: (jnp.sin(v) * self.mean).sum())(x)

    def jit_grad_read(self, x):
        self.mean = self.mean + x
        return jax.jit(jax.grad(lambda v: (v * self.mean * self.w).sum()))(x)

    def vg_has_aux_read(self, x):
        def loss(v):
            y = (v * self.w + self.mean) ** 2
            return y.sum(), y
        (l, aux), g = jax.value_and_grad(loss, has_aux=True)(x)
        self.mean = self.mean + g
        self.calls += 1
        return l, aux

    def cvjp_state_as_argument(self, x):
        self.mean = self.mean + x
        @jax.custom_vjp
        def g(v, m):
            return v * m
        def fwd(v, m):
            return v * m, (v, m)
        def bwd(res, ct):
            return (ct * res[1], ct * res[0])
        g.defvjp(fwd, bwd)
        return g(x, self.mean).sum()

    # --- callbacks -------------------------------------------------------------------

    def debug_print(self, x):
        self.mean = self.mean + x
        jax.debug.print("mean={m}", m=self.mean)
        return self.mean

    def debug_callback(self, x):
        self.mean = self.mean + x
        jax.debug.callback(_record, self.mean)
        self.calls += 1
        return self.mean

    def debug_callback_in_scan(self, xs):
        def body(c, x):
            self.mean = self.mean + x
            jax.debug.callback(_record, self.mean)
            self.calls += 1
            return c + self.mean.sum(), self.mean
        return lax.scan(body, 0.0, xs)

    def pure_cb(self, x):
        self.mean = self.mean + x
        y = jax.pure_callback(lambda m: (np.asarray(m) * 2).astype(np.float32),
                              jax.ShapeDtypeStruct((3,), jnp.float32), self.mean,
                              vmap_method="sequential")
        return y + self.w

    def pure_cb_in_cond(self, x):
        def yes(v):
            self.mean = self.mean + v
            return jax.pure_callback(lambda m: (np.asarray(m) + 1).astype(np.float32),
                                     jax.ShapeDtypeStruct((3,), jnp.float32), self.mean,
                                     vmap_method="sequential")
        def no(v):
            self.calls += 1
            return v
        return lax.cond(x.sum() > 0, yes, no, x)

    # --- custom derivatives of closures reading state ---------------------------------

    def cjvp_read(self, x):
        @jax.custom_jvp
        def g(v):
            return jnp.sin(v) * self.w + self.mean
        @g.defjvp
        def g_jvp(p, t):
            return g(p[0]), jnp.cos(p[0]) * self.w * t[0] * 3
        return g(x).sum()

    def cjvp_read_after_write(self, x):
        @jax.custom_jvp
        def g(v):
            return jnp.sin(v) * self.w + self.mean
        @g.defjvp
        def g_jvp(p, t):
            return g(p[0]), jnp.cos(p[0]) * self.w * t[0] * 3
        self.calls += 1
        self.mean = self.mean + 1.0
        return g(x).sum()

    def cvjp_read_after_write(self, x):
        @jax.custom_vjp
        def g(v):
            return v * self.w + self.mean
        def fwd(v):
            return g(v), v
        def bwd(res, ct):
            return (ct * self.w * 10,)
        g.defvjp(fwd, bwd)
        self.mean = self.mean + 1.0
        return g(x).sum()

    def custom_gradient_read(self, x):
        self.mean = self.mean + x
        @jax.custom_gradient
        def g(v):
            return (v * self.mean).sum(), lambda ct: ct * self.w
        return g(x)

    def cjvp_param_only(self, x):
        @jax.custom_jvp
        def g(v):
            return jnp.sin(v) * self.w
        @g.defjvp
        def g_jvp(p, t):
            return g(p[0]), jnp.cos(p[0]) * self.w * t[0] * 3
        self.mean = self.mean + 1.0
        return g(x).sum()

    # --- a transformation of a closure that writes state (the documented escape) ------

    def loss_writes(self, v):
        self.mean = self.mean + v
        return (v * self.w).sum() ** 2, self.mean

    def vg_has_aux_write(self, x):
        (l, aux), g = jax.value_and_grad(self.loss_writes, has_aux=True)(x)
        return l + g.sum()
"""


VMAPCK = """
@DECORATE
class Counter:
    def __init__(self):
        self.w = jnp.array([1.0, 2.0])
        self.n = jnp.zeros((), jnp.int32)
        self.total = jnp.zeros(())

    def pure(self, x):
        return jnp.tanh(x * self.w)

    def counted(self, x):
        self.n += 1
        return x * self.w

    def summed(self, x):
        self.total = self.total + x.sum()
        return x * self.w


@DECORATE
class Block:
    def __init__(self, scale):
        self.w = jnp.eye(2) * scale
        self.mean = jnp.zeros(2)
        self.calls = jnp.zeros((), jnp.int32)

    def forward(self, x):
        self.mean = 0.5 * self.mean + 0.5 * x.mean(0)
        self.calls += 1
        return jnp.tanh(x @ self.w) + x


@DECORATE
class Net:
    def __init__(self):
        self.sub = Counter()
        self.blocks = [Block(0.5), Block(1.5)]

    def vmapped_pure(self, xs):
        return jax.vmap(self.sub.pure)(xs)

    def vmapped_writer(self, xs):
        return jax.vmap(self.sub.counted)(xs)

    def vmapped_batched_writer(self, xs):
        return jax.vmap(self.sub.summed)(xs)

    def __call__(self, x):
        for b in self.blocks:
            x = checkpoint(b.forward)(x)
        return x

    def loss(self, x):
        return (self(x) ** 2).sum()
"""


NESTED_GEN = """
@DECORATE
class G:
    def __init__(self):
        self.x = jnp.zeros(())
    def run(self, k):
        def gen():
            for i in range(3):
                self.x = self.x + k * i
                yield self.x
        return jnp.stack(list(gen()))
    def lazy(self, k):
        def gen():
            for i in range(3):
                self.x = self.x + k * i
                yield self.x
        return gen()
"""


SYNTAX = """
CALLS = 0


@DECORATE
class Syntax:
    table = {k: k * 2 for k in range(3)}
    scales = [i + 0.5 for i in range(3)]
    act = staticmethod(lambda v: v * 3)
    read = lambda self: self.s * 2

    def __init__(self):
        self.s = jnp.zeros(())
        self.mode = "add"
        self.hist = jnp.zeros(3)

    def matcher(self, cmd, x):
        match cmd:
            case "add":
                self.s = self.s + x
            case ("mul", k):
                self.s = self.s * k
            case {"set": v}:
                self.s = jnp.asarray(v, jnp.float32)
            case [a, b, *rest]:
                self.s = self.s + a + b + len(rest)
            case _:
                self.s = self.s - 1
        return self.s

    def match_self_state(self, x):
        match self.mode:
            case "add":
                self.s = self.s + x
            case _:
                pass
        return self.s

    def walrus(self, x):
        if (n := self.s + x) > -100:
            self.s = n
        ys = [(y := self.s * i) for i in range(3)]
        self.hist = jnp.stack(ys) + y
        return self.hist

    def comprehension(self, x):
        self.hist = jnp.stack([self.s * k + x for k in self.scales])
        self.s = sum(self.hist[i] for i in range(3))
        return {k: self.s * v for k, v in self.table.items()}

    def lambdas(self, x):
        add = lambda v: self.s + v
        self.s = add(x) + self.act(x) + self.read()
        return self.s

    def with_global(self, x):
        global CALLS
        CALLS += 1
        self.s = self.s + x
        return self.s


def make_counter():
    count = 0

    @DECORATE
    class Nonlocal:
        def __init__(self):
            self.s = jnp.zeros(())

        def __call__(self, x):
            nonlocal count
            count += 1
            self.s = self.s + x * count
            return self.s

    return Nonlocal
"""


ESCAPES = """
import weakref
BOX = []


@DECORATE
class E:
    def __init__(self):
        self.x = jnp.zeros(())
        self.closed = jnp.zeros(())

    def bump(self, v):
        self.x = self.x + v
        return self.x

    def close_mark(self):
        self.closed = self.closed + 1
        return self.closed

    def gen(self, vs):
        try:
            for v in vs:
                yield self.bump(v)
        finally:
            self.close_mark()

    def lazy_calls(self, xs):
        return (self.bump(v) for v in xs)

    def lazy_reads(self, xs):
        return (self.x * v for v in xs)

    def lazy_map(self, xs):
        return map(self.bump, xs)

    def start(self, vs):
        g = self.gen(vs)
        BOX.append(g)
        return next(g)

    def resume(self):
        return next(BOX[-1])

    def finish(self):
        BOX.pop().close()
        return self.closed

    def start_return(self, vs):
        g = self.gen(vs)
        next(g)
        return g

    def stash(self, xs):
        BOX.append(self.gen(xs))
        return self.x

    def register_later(self, v):
        BOX.append(functools.partial(self.bump, v))
        BOX.append(weakref.WeakMethod(self.bump))
        return self.x
"""


TRANSFORMED_WRITES = """
@DECORATE
class Esc:
    def __init__(self):
        self.w = jnp.array([1.0, -2.0, 0.5])
        self.mean = jnp.zeros(3)
        self.calls = jnp.zeros((), jnp.int32)

    def step(self, x):
        self.mean = self.mean + x  # <- step writes
        return x * self.w, self.mean

    def loss(self, x):
        self.mean = self.mean + x  # <- loss writes
        return (jnp.sin(x) * self.w).sum()

    def vmap_bound(self, xs):
        return jax.vmap(self.step)(xs)[0]

    def vmap_lambda(self, xs):
        return jax.vmap(lambda x: self.step(x)[0] * 2)(xs)

    def jacrev_write(self, x):
        return jax.jacrev(self.loss)(x)

    def jacfwd_write(self, x):
        return jax.jacfwd(self.loss)(x)

    def hessian_write(self, x):
        return jax.hessian(self.loss)(x)

    def vectorize_write(self, xs):
        return jnp.vectorize(lambda x: self.step(x)[0], signature="(n)->(n)")(xs)

    def root_write(self, x):
        def f(v):
            self.mean = self.mean + v  # <- root writes
            return v * v - 2.0 - x * x
        def solve(g, v0):
            v = v0
            for _ in range(20):
                v = v - g(v) / (2 * v)
            return v
        return jax.lax.custom_root(f, jnp.ones(3), solve, lambda g, y: y / g(jnp.ones(3)))

    def matvec_count(self, v):
        self.calls += 1  # <- matvec writes
        return v * jnp.abs(self.w)

    def linsolve_count(self, b):
        return jax.lax.custom_linear_solve(self.matvec_count, b,
                                           lambda mv, r: r / jnp.abs(self.w))

    def vmap_then_overwrite(self, xs):
        ys, means = jax.vmap(self.step)(xs)
        self.mean = means.mean(0)
        return ys

    def grad_then_overwrite(self, x):
        g, m = jax.grad(lambda v: (self.step(v)[0].sum(), self.mean), has_aux=True)(x)
        self.mean = m * 2
        return g

    def add_count(self, a, b):
        self.calls += 1  # <- reduce writes
        return a + b

    def reduce_write(self, xs):
        return jax.lax.reduce(xs, 0.0, self.add_count, (0,))
"""


TORCH_TRAINING = """
def get_param(model, name):
    *path, leaf = name.split(".")
    for p in path:
        model = getattr(model, p)
    return getattr(model, leaf)


def set_param(model, name, value):
    *path, leaf = name.split(".")
    for p in path:
        model = getattr(model, p)
    setattr(model, leaf, value)


def init_wb(n_in, n_out, scale):
    w = scale * jnp.linspace(-1.0, 1.0, n_in * n_out).reshape(n_in, n_out)
    return w, jnp.linspace(0.0, 0.2, n_out)


class LinearOps:
    \"\"\"An undecorated base that only reads.\"\"\"

    def named_parameters(self, prefix=""):
        return {prefix + "w": self.w, prefix + "b": self.b}

    def apply(self, params, x, prefix=""):
        return jnp.tanh(x @ params[prefix + "w"] + params[prefix + "b"])


@DECORATE
class Linear(LinearOps):
    \"\"\"The optimizer's writes make w and b states: declared as such.\"\"\"

    def __init__(self, n_in, n_out, scale=1.0):
        w, b = init_wb(n_in, n_out, scale)
        self.w = STATE(w)
        self.b = STATE(b)
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.calls += 1
        return self.apply(self.named_parameters(), x)


@DECORATE
class ParamLinear(LinearOps):
    \"\"\"w and b are parameters: no method of the class assigns them.\"\"\"

    def __init__(self, n_in, n_out, scale=1.0):
        self.w, self.b = init_wb(n_in, n_out, scale)
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, x):
        self.calls += 1
        return self.apply(self.named_parameters(), x)


@DECORATE
class MLP:
    def __init__(self, as_state=True, int_buffer=False):
        cls = Linear if as_state else ParamLinear
        self.l1 = cls(3, 4, 1.0)
        self.l2 = cls(4, 2, 0.5)
        # A non-trainable integer buffer (an output permutation), never assigned again.
        self.perm = jnp.array([1, 0]) if int_buffer else None

    def named_parameters(self):
        return {**self.l1.named_parameters("l1."), **self.l2.named_parameters("l2.")}

    def _permute(self, y):
        return y if self.perm is None else y[:, self.perm]

    def apply(self, params, x):
        return self._permute(self.l2.apply(params, self.l1.apply(params, x, "l1."), "l2."))

    def __call__(self, x):
        return self._permute(self.l2(self.l1(x)))


def sgd_update(opt, grads):
    buf = dict(opt.buf)
    for name in sorted(grads):
        buf[name] = opt.momentum * buf[name] + grads[name]
        set_param(opt.model, name, get_param(opt.model, name) - opt.lr * buf[name])
    return buf


@DECORATE
class SGD:
    def __init__(self, model, lr=0.1, momentum=0.9):
        self.model = model
        self.lr = STATE(lr)
        self.momentum = momentum
        self.buf = {k: jnp.zeros_like(v) for k, v in model.named_parameters().items()}
        self.steps = jnp.zeros((), jnp.int32)
        self.grad_norm = jnp.zeros(())

    def zero_grad(self):
        self.grad_norm = jnp.zeros(())

    def step(self, grads):
        self.steps += 1
        self.grad_norm = self.grad_norm + sum(jnp.sum(g * g) for g in grads.values())
        self.buf = sgd_update(self, grads)


@DECORATE
class FixedLrSGD:
    \"\"\"The same, with the lr a Python float no method of the class assigns.\"\"\"

    def __init__(self, model, lr=0.1, momentum=0.9):
        self.model = model
        self.lr = lr
        self.momentum = momentum
        self.buf = {k: jnp.zeros_like(v) for k, v in model.named_parameters().items()}

    def zero_grad(self):
        pass

    def step(self, grads):
        self.buf = sgd_update(self, grads)


def adam_update(opt, name, g, st):
    st["step"] = st["step"] + 1
    st["m"] = opt.b1 * st["m"] + (1 - opt.b1) * g
    st["v"] = opt.b2 * st["v"] + (1 - opt.b2) * g * g
    mh = st["m"] / (1 - opt.b1 ** st["step"])
    vh = st["v"] / (1 - opt.b2 ** st["step"])
    p = get_param(opt.model, name)
    set_param(opt.model, name, p - opt.lr * mh / (jnp.sqrt(vh) + opt.eps))


def moments(model):
    return {
        k: {"m": jnp.zeros_like(v), "v": jnp.zeros_like(v), "step": jnp.zeros((), jnp.int32)}
        for k, v in model.named_parameters().items()
    }


@DECORATE
class Adam:
    \"\"\"``self.state[name]`` changed through a local alias, then stored back.\"\"\"

    def __init__(self, model, lr=0.05, betas=(0.9, 0.99), eps=1e-8):
        self.model = model
        self.lr = STATE(lr)
        self.b1, self.b2 = betas
        self.eps = eps
        self.state = moments(model)

    def zero_grad(self):
        pass

    def step(self, grads):
        for name, g in grads.items():
            st = self.state[name]
            adam_update(self, name, g, st)
            self.state[name] = st


@DECORATE
class AliasAdam(Adam):
    \"\"\"A state dict changed through the alias only (the base's step makes it a state).\"\"\"

    def step(self, grads):
        for name, g in grads.items():
            st = self.state[name]
            adam_update(self, name, g, st)


@DECORATE
class TorchAdam:
    \"\"\"PyTorch's layout exactly: no method assigns ``self.state``, each step changes
    ``self.state[name]`` in place through a local alias.\"\"\"

    def __init__(self, model, lr=0.05, betas=(0.9, 0.99), eps=1e-8):
        self.model = model
        self.lr = STATE(lr)
        self.b1, self.b2 = betas
        self.eps = eps
        self.state = moments(model)

    def zero_grad(self):
        pass

    def step(self, grads):
        for name, g in grads.items():
            st = self.state[name]
            adam_update(self, name, g, st)


@DECORATE
class LazyAdam(Adam):
    \"\"\"Moments created on the first step, PyTorch's ``defaultdict(dict)``.\"\"\"

    def __init__(self, model, lr=0.05):
        super().__init__(model, lr)
        self.state = collections.defaultdict(dict)

    def step(self, grads):
        for name in grads:
            if "m" not in self.state[name]:
                p = get_param(self.model, name)
                self.state[name] = {
                    "m": jnp.zeros_like(p), "v": jnp.zeros_like(p), "step": jnp.zeros((), jnp.int32)
                }
        super().step(grads)


@DECORATE
class StepLR:
    def __init__(self, opt, gamma=0.5, every=2):
        self.opt = opt
        self.gamma = gamma
        self.every = every
        self.base_lr = opt.lr
        self.epoch = jnp.zeros((), jnp.int32)

    def step(self):
        self.epoch += 1
        self.opt.lr = self.base_lr * self.gamma ** (self.epoch // self.every)


@DECORATE
class EarlyStopping:
    def __init__(self, patience=2, min_delta=0.0):
        self.patience = patience
        self.min_delta = min_delta
        self.best = jnp.asarray(jnp.inf)
        self.bad = jnp.zeros((), jnp.int32)
        self.stop = jnp.asarray(False)

    def update(self, loss):
        improved = loss < self.best - self.min_delta
        self.best = jnp.where(improved, loss, self.best)
        self.bad = jnp.where(improved, 0, self.bad + 1)
        self.stop = self.stop | (self.bad >= self.patience)
        return self.stop


@DECORATE
class MeanMetric:
    def __init__(self):
        self.total = 0.0
        self.count = jnp.zeros((), jnp.int32)

    def update(self, v):
        self.total = self.total + v
        self.count += 1

    def compute(self):
        return self.total / self.count

    def reset(self):
        self.total = 0.0
        self.count = jnp.zeros((), jnp.int32)


@DECORATE
class Trainer:
    def __init__(self, model, opt, sched=None, stopper=None, metric=None):
        self.model = model
        self.opt = opt
        self.sched = sched
        self.stopper = stopper
        self.metric = metric
        self.global_step = jnp.zeros((), jnp.int32)

    def loss_fn(self, params, x, y):
        return jnp.mean((self.model.apply(params, x) - y) ** 2)

    def fit_step(self, x, y):
        loss, grads = jax.value_and_grad(self.loss_fn)(self.model.named_parameters(), x, y)
        self.opt.zero_grad()
        self.opt.step(grads)
        if self.sched is not None:
            self.sched.step()
        if self.metric is not None:
            self.metric.update(loss)
        if self.stopper is not None:
            self.stopper.update(loss)
        self.global_step += 1
        return loss, self.model(x)

    def evaluate(self, x, y):
        return self.loss_fn(self.model.named_parameters(), x, y)


def sgd_trainer(as_state=True, lr_state=True, sched=True):
    model = MLP(as_state)
    opt = SGD(model) if lr_state else FixedLrSGD(model)
    return Trainer(model, opt, StepLR(opt) if sched else None, EarlyStopping(), MeanMetric())


@DECORATE
class GroupSGD:
    \"\"\"PyTorch's ``param_groups``: a list of dicts no method of the class assigns.\"\"\"

    def __init__(self, model, lr=0.1):
        self.model = model
        self.param_groups = [{"params": sorted(model.named_parameters()), "lr": lr}]

    def zero_grad(self):
        pass

    def step(self, grads):
        for group in self.param_groups:
            for name in group["params"]:
                set_param(self.model, name, get_param(self.model, name) - group["lr"] * grads[name])


@DECORATE
class GroupStepLR:
    \"\"\"PyTorch's scheduler: ``group["lr"] = ...`` on the optimizer's param_groups.\"\"\"

    def __init__(self, opt, gamma=0.5):
        self.opt = opt
        self.gamma = gamma

    def step(self):
        for group in self.opt.param_groups:
            group["lr"] = group["lr"] * self.gamma


@DECORATE
class TorchEarlyStopping:
    \"\"\"The usual PyTorch recipe: Python numbers and an ``if`` on the loss.\"\"\"

    def __init__(self, patience=1):
        self.patience = patience
        self.best = float("inf")
        self.counter = 0
        self.early_stop = False

    def __call__(self, loss):
        if loss < self.best:
            self.best = loss
            self.counter = 0
        else:
            self.counter += 1
            if self.counter >= self.patience:
                self.early_stop = True
        return self.early_stop


@DECORATE
class BNNet:
    \"\"\"Input statistics updated by the forward pass (from x only) and, optionally, the
    last output kept on the model, PyTorch's forward-hook habit.\"\"\"

    def __init__(self, keep_output=False):
        self.w = STATE(jnp.array([[0.5, -1.0], [2.0, 0.5], [-0.5, 1.0]]))
        self.running_mean = jnp.zeros(3)
        self.seen = jnp.zeros((), jnp.int32)
        self.keep_output = keep_output
        self.last_out = jnp.zeros((4, 2))

    def forward(self, w, x):
        self.seen += 1
        self.running_mean = 0.9 * self.running_mean + 0.1 * x.mean(0)
        out = jnp.tanh((x - self.running_mean) @ w)
        if self.keep_output:
            self.last_out = out
        return out


@DECORATE
class ForwardTrainer:
    \"\"\"``jax.value_and_grad`` of a loss whose forward pass writes the model's states.\"\"\"

    def __init__(self, keep_output=False, lr=0.2):
        self.model = BNNet(keep_output)
        self.lr = lr
        self.loss = jnp.zeros(())

    def fit_step(self, x, y):
        def loss_fn(w):
            return jnp.mean((self.model.forward(w, x) - y) ** 2)

        self.loss, g = jax.value_and_grad(loss_fn)(self.model.w)
        self.model.w = self.model.w - self.lr * g
        return self.loss


@DECORATE
class AccumSGD:
    \"\"\"Gradient accumulation with PyTorch's ``zero_grad(set_to_none=...)``.\"\"\"

    def __init__(self, model, lr=0.1, set_to_none=False):
        self.model = model
        self.lr = lr
        self.micro = jnp.zeros((), jnp.int32)
        self.zero_grad(set_to_none)

    def zero_grad(self, set_to_none=False):
        if set_to_none:
            self.grads = None
        else:
            self.grads = {k: jnp.zeros_like(v) for k, v in self.model.named_parameters().items()}

    def accumulate(self, grads):
        self.micro += 1
        if self.grads is None:
            self.grads = grads
        else:
            self.grads = {k: self.grads[k] + g for k, g in grads.items()}

    def step(self):
        for k, g in self.grads.items():
            set_param(self.model, k, get_param(self.model, k) - self.lr * g / self.micro)
        self.micro = jnp.zeros((), jnp.int32)


@DECORATE
class AccumTrainer:
    def __init__(self, set_to_none=False):
        self.model = MLP()
        self.opt = AccumSGD(self.model, set_to_none=set_to_none)
        self.set_to_none = set_to_none

    def fit_step(self, x, y):
        losses = []
        for xb, yb in ((x[:2], y[:2]), (x[2:], y[2:])):
            def loss_fn(p, xb=xb, yb=yb):
                return jnp.mean((self.model.apply(p, xb) - yb) ** 2)

            loss, g = jax.value_and_grad(loss_fn)(self.model.named_parameters())
            self.opt.accumulate(g)
            losses.append(loss)
        self.opt.step()
        self.opt.zero_grad(self.set_to_none)
        return jnp.stack(losses)


@DECORATE
class PatchingScheduler:
    \"\"\"PyTorch's LRScheduler wraps ``optimizer.step`` to count its calls.\"\"\"

    def __init__(self, opt):
        self.opt = opt
        self.opt_calls = jnp.zeros((), jnp.int32)
        orig = opt.step
        sched = self

        @functools.wraps(orig)
        def patched(*args, **kwargs):
            sched.opt_calls += 1
            return orig(*args, **kwargs)

        opt.step = patched

    def step(self):
        self.opt_calls = self.opt_calls + 0


def patched_trainer():
    model = MLP()
    opt = SGD(model)
    return Trainer(model, opt, PatchingScheduler(opt))


@DECORATE
class ArgTrainer:
    \"\"\"Holds no model: ``fit_step(model, x, y)`` steps the model it is given.\"\"\"

    def __init__(self, lr=0.1):
        self.lr = lr
        self.steps = jnp.zeros((), jnp.int32)

    def fit_step(self, model, x, y):
        def loss_fn(p):
            return jnp.mean((model.apply(p, x) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(model.named_parameters())
        for name, g in grads.items():
            set_param(model, name, get_param(model, name) - self.lr * g)
        self.steps += 1
        return loss


def group_trainer(int_buffer=False):
    model = MLP(int_buffer=int_buffer)
    opt = GroupSGD(model)
    return Trainer(model, opt, GroupStepLR(opt))


def adam_trainer(kind="Adam"):
    model = MLP()
    opt = globals()[kind](model)
    return Trainer(model, opt, StepLR(opt, 0.7, 1), EarlyStopping(1, 0.01), MeanMetric())
"""


CROSS = """
@DECORATE
class Tally:
    def __init__(self):
        self.count = jnp.zeros((), jnp.int32)
        self.total = jnp.zeros(())

    def reset(self):
        self.count = jnp.zeros((), jnp.int32)
        self.total = jnp.zeros(())


TALLY = Tally()


@DECORATE
class Writer:
    def __init__(self, other=None):
        self.n = jnp.zeros(())
        self.other = other

    def write_arg(self, x, other):
        self.n = self.n + x
        other.count += 1
        other.total = other.total + self.n
        return self.n * other.count

    def write_global(self, x):
        self.n = self.n + x
        TALLY.count += 1
        TALLY.total = TALLY.total + self.n
        return self.n * TALLY.count

    def write_attr(self, x):
        self.n = self.n + x
        self.other.count += 1
        self.other.total = self.other.total + self.n
        return self.n * self.other.count

    def read_global_alias(self, x):
        self.other.count += 1
        return x * TALLY.count

    def write_arg_read_attr(self, x, other):
        other.count += 1
        return x * self.other.count


@DECORATE
class Both:
    def __init__(self):
        self.tally = Tally()
        self.writer = Writer(self.tally)

    def via_arg(self, x):
        return self.writer.write_arg(x, self.tally)

    def via_attr(self, x):
        return self.writer.write_attr(x)

    def __call__(self, x):
        return self.via_arg(x) + self.via_attr(2.0 * x), self.tally.count


def global_writer():
    return Writer(TALLY)


@DECORATE
class Recorder:
    def __init__(self):
        self.calls = jnp.zeros((), jnp.int32)
        self.last = jnp.zeros(())

    def hook(self, module, out):
        self.calls += 1
        self.last = out.sum() * module.scale


@DECORATE
class Hooked:
    def __init__(self):
        self.scale = jnp.asarray(2.0)
        self.hooks = []
        self.n = jnp.zeros((), jnp.int32)

    def register_forward_hook(self, fn):
        self.hooks.append(fn)
        return self

    def __call__(self, x):
        self.n += 1
        out = jnp.tanh(x * self.scale)
        for h in self.hooks:
            h(self, out)
        return out


@DECORATE
class HookTrainer:
    \"\"\"A recorder's bound method registered as the model's forward hook: the recorder
    is reached through the trainer and through the hook.\"\"\"

    def __init__(self):
        self.model = Hooked()
        self.recorder = Recorder()
        self.model.register_forward_hook(self.recorder.hook)

    def __call__(self, x):
        return self.model(x), self.recorder.last, self.recorder.calls


def hooked_model():
    return Hooked().register_forward_hook(Recorder().hook)


@DECORATE
class KVCache:
    def __init__(self, n=4, d=2):
        self.k = jnp.zeros((n, d))
        self.pos = jnp.zeros((), jnp.int32)

    def reset(self):
        self.k = jnp.zeros_like(self.k)
        self.pos = jnp.zeros((), jnp.int32)


@DECORATE
class Attn:
    def __init__(self):
        self.wk = jnp.array([[1.0, 0.5], [0.0, -1.0], [0.5, 0.5]])
        self.wq = jnp.array([[0.5, 0.0], [1.0, 1.0], [-0.5, 0.5]])
        self.calls = jnp.zeros((), jnp.int32)

    def __call__(self, x, cache):
        self.calls += 1
        cache.k = cache.k.at[cache.pos].set(x @ self.wk)
        cache.pos += 1
        scores = cache.k @ (x @ self.wq)
        mask = jnp.arange(cache.k.shape[0]) < cache.pos
        return jnp.sum(jnp.where(mask, scores, 0.0))


@DECORATE
class CachedDecoder:
    def __init__(self):
        self.attn = Attn()
        self.cache = KVCache()

    def __call__(self, x):
        return self.attn(x, self.cache)

    def generate(self, x, n=3):
        self.cache.reset()
        return jnp.stack([self.attn(x * (i + 1), self.cache) for i in range(n)])
"""


HELPER_ESCAPES = """
def raw_scan(model, xs):
    def body(c, x):
        model.s = model.s + x
        model.d = {"a": model.d["a"] + x, "b": model.d["b"]}
        model.t = (model.t[0] + x, model.t[1])
        return c, x
    jax.lax.scan(body, 0.0, xs)


def threaded_scan(model, xs):
    def body(c, x):
        model.s = model.s + x
        model.d = {"a": model.d["a"] + x, "b": model.d["b"]}
        model.t = (model.t[0] + x, model.t[1])
        return c, x
    LAXW.scan(body, 0.0, xs)


@DECORATE
class M:
    def __init__(self):
        self.s = jnp.zeros(())
        self.d = {"a": jnp.zeros(()), "b": jnp.ones(())}
        self.t = (jnp.zeros(()), jnp.ones(()))

    def reset(self):
        self.s = jnp.zeros(())
        self.d = {"a": jnp.zeros(()), "b": jnp.ones(())}
        self.t = (jnp.zeros(()), jnp.ones(()))

    def helper_then_read_array(self, xs):
        raw_scan(self, xs)
        y = self.s * 2
        self.reset()
        return y

    def helper_then_read_dict(self, xs):
        raw_scan(self, xs)
        y = self.d["a"] * 2
        self.reset()
        return y

    def helper_then_read_tuple(self, xs):
        raw_scan(self, xs)
        y = self.t[0] * 2
        self.reset()
        return y

    def helper_then_overwrite(self, xs):
        raw_scan(self, xs)
        self.reset()
        return xs * 2

    def threaded_helper(self, xs):
        threaded_scan(self, xs)
        return self.s + self.d["a"] + self.t[0]

    def grad_then_read_dict(self, x):
        def loss(v):
            self.d = {"a": v * 2, "b": v}
            return v ** 2
        g = jax.grad(loss)(x)
        return self.d["a"] + g

    def grad_then_return_dict(self, x):
        def loss(v):
            self.d = {"a": v * 2, "b": v}
            return v ** 2
        jax.grad(loss)(x)
        out = self.d
        self.reset()
        return out

    def vmap_then_read_tuple(self, xs):
        def one(v):
            self.t = (v, v)
            return v
        jax.vmap(one)(xs)
        return self.t[0] + 1

    def jit_then_read_dict(self, x):
        @jax.jit
        def inner(v):
            self.d = {"a": v * 3, "b": v}
            return v
        inner(x)
        return self.d["a"] + 1

    def grad_then_overwrite(self, x):
        def loss(v):
            self.s = v * 2
            return v ** 2 + self.s
        g = jax.grad(loss)(x)
        self.s = g
        return g
"""
