"""The class transform: a class's source in, a complete cacheable decision out.

``@stateful`` hands a class to ``pipeline.decide_class``, which runs every
step in order and returns a ``ClassDecision``: which attributes are state,
what construction initializes, and each method rewritten so that its state
reads and writes become calls of the runtime (``__autostate__.get``/``set``).

* ``source`` and ``method`` find the functions a class body defines and
  their source text, located by their code objects;
* ``analysis`` decides the state set from the methods' facts, or refuses
  what the engine cannot express with a ``DecorationError``;
* ``rewrite`` rewrites only what ``analysis`` decided, each rewrite on the
  line it came from; ``walk`` is the libcst tree walk both use;
* ``loader`` compiles the rewritten source at the user's line numbers and
  caches the result, in memory and on disk, keyed by everything it depends
  on (so a warm start loads code without importing libcst).

The decision is a pure function of source text and the class's options:
nothing here imports JAX (``tests/project/test_architecture.py`` checks it) or
knows about the effect engine's runtime values. This file imports nothing,
so importing one submodule costs no more than that submodule.
"""
