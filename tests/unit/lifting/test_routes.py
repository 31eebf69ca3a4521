"""lifting/routes.py: the one table of the JAX functions a method's calls go through."""

from __future__ import annotations

import inspect

import jax

import autostate
from autostate.lifting import routes


def test_every_wrapper_takes_every_parameter_of_its_jax_function() -> None:
    """The family of the operand= bug: a call that resolves to a JAX function
    goes through its row's function, which must take every parameter the JAX
    function takes, by the same name (or through ``**kwargs``)."""
    for target, name, _ in routes.TABLE:
        theirs = inspect.signature(target).parameters
        ours = inspect.signature(routes.through(target)).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in ours.values())
        for pname, param in theirs.items():
            if param.kind is param.VAR_POSITIONAL:
                assert any(p.kind is p.VAR_POSITIONAL for p in ours.values()), (name, pname)
            elif param.kind is not param.VAR_KEYWORD:
                assert pname in ours or takes_any, f"autostate.{name} lacks {pname!r}"


def test_a_row_routes_its_jax_function_and_nothing_else() -> None:
    for target, name, family in routes.TABLE:
        through = routes.through(target)
        assert routes.routed(target) is through
        assert through.__module__ == f"autostate.lifting.{family}"
        assert routes.wrapper_name(target) == name
    assert routes.routed(jax.lax.scan) is autostate.scan
    assert routes.routed(jax.remat) is autostate.checkpoint
    for other in (jax.numpy.sum, print, False, "scan", None):
        assert routes.routed(other) is other
        assert routes.wrapper_name(other) is None
    assert routes.wrapper_name([]) is None  # (unhashable)


def test_the_table_names_each_public_wrapper_once() -> None:
    names = {name for _, name, _ in routes.TABLE}
    for public in ("scan", "cond", "switch", "while_loop", "fori_loop", "map", "checkpoint", "vmap"):
        assert public in names
        assert getattr(autostate, public) in {routes.through(t) for t, n, _ in routes.TABLE if n == public}
