"""The smallest autostate model: a counter that mutates ``self``."""

import jax
import jax.numpy as jnp

import autostate


@autostate.stateful
class Counter:
    def __init__(self):
        self.count = jnp.zeros((), int)  # state, because __call__ assigns it

    def __call__(self, x):
        self.count += 1
        return x * self.count


counter = Counter()
print(counter(2.0), counter.count)  # eager, plain Python: 2.0 1

f, states = autostate.functionalize(counter)  # a pure function of the states
y, states = jax.jit(lambda f, s, x: f(s, x))(f, states, 2.0)
print(y, states)  # 4.0 {'count': Array(2, dtype=int32)}
print(autostate.freeze(f, states).count)  # 2: a Counter again, state inside
