"""The package's shape (DESIGN.md section 4), checked from its source.

Every ``import`` in ``autostate/`` — at module level or inside a function —
is an edge of the module graph; the graph must have no cycle, ``transform``
must not import JAX, ``effects`` must not import libcst, no module may
assign an attribute of another module (no hooks set from outside), and no
module uses a private name (``_name``) of another.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "autostate"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str) -> str:
    """The module an imported dotted name lives in (``a.b.func`` -> ``a.b``)."""
    while name not in MODULES and "." in name:
        name = name.rpartition(".")[0]
    return name


@functools.cache
def _tree(module: str) -> ast.Module:
    """``module``'s syntax tree, parsed once: every check reads the same files."""
    return ast.parse(MODULES[module].read_text())


@functools.cache
def _imports(module: str) -> tuple[tuple[str, int], ...]:
    """``(imported module, line)`` for every import statement in ``module``."""
    tree = _tree(module)
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                full = f"{base}.{alias.name}"
                found.append((full if _resolve(full) == full else base, node.lineno))
    return tuple(found)


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module in MODULES:
        edges = set()
        for name, _line in _imports(module):
            if name.split(".")[0] != "autostate":
                continue
            target = _resolve(name)
            if target != module:
                edges.add(target)
        graph[module] = edges
    return graph


def test_the_module_graph_has_no_cycle():
    graph = _graph()
    # The root package only re-exports; importing it from inside is a cycle.
    offenders = [m for m, edges in graph.items() if m != "autostate" and "autostate" in edges]
    assert offenders == [], f"modules importing the root package: {offenders}"
    done: set[str] = set()

    def visit(module: str, trail: list[str]) -> None:
        if module in trail:
            cycle = trail[trail.index(module) :] + [module]
            pytest.fail("import cycle: " + " -> ".join(cycle))
        if module in done:
            return
        for target in sorted(graph[module]):
            # A package's __init__ importing its own submodules is not a cycle.
            if not target.startswith(module + "."):
                visit(target, [*trail, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


def _runs_at_import(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements of ``body`` that run when the module is imported: not
    those inside functions, nor under ``if TYPE_CHECKING:``."""
    found = []
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        found.append(node)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            found += _runs_at_import(node.orelse)
            continue
        for field in ("body", "orelse", "finalbody", "handlers"):
            inner = getattr(node, field, None)
            if isinstance(inner, list):
                found += _runs_at_import(inner)
    return found


def _import_time_graph() -> dict[str, set[str]]:
    """The edges ``_graph`` has, for the imports that run at import time."""
    graph: dict[str, set[str]] = {}
    for module in MODULES:
        lines = {
            node.lineno
            for node in _runs_at_import(_tree(module).body)
            if isinstance(node, (ast.Import, ast.ImportFrom))
        }
        graph[module] = {
            _resolve(name)
            for name, line in _imports(module)
            if line in lines and name.split(".")[0] == "autostate" and _resolve(name) != module
        }
    return graph


def _longest_chain(graph: dict[str, set[str]], module: str, memo: dict) -> list[str]:
    if module not in memo:
        below = [_longest_chain(graph, m, memo) for m in sorted(graph[module])]
        memo[module] = [module, *max(below, key=len, default=[])]
    return memo[module]


# Ten floors, one per layer (DESIGN.md section 4): ground (values, errors),
# core (graph, effects, guard, runtime), the lift (its core, then a family,
# then the routes table), the features, the front door. Runtime reaches the
# lift only for the rewritten code, when it first asks.
IMPORT_FLOORS = 10


def test_import_autostate_runs_few_floors_of_modules():
    # A chain that grows a floor per concern is a dependency pointing the
    # wrong way: move the definition to its layer, or import what only a call
    # needs in the call. (Counted from the root: ``autostate.nn``, imported on
    # first use, stands on the front door, as a user's layers do.)
    chain = _longest_chain(_import_time_graph(), "autostate", {})
    assert len(chain) <= IMPORT_FLOORS, f"{len(chain)} floors: " + " -> ".join(chain)


# What a call needs is imported by the call (``autostate/__init__.py``'s
# ``_ON_FIRST_USE``, the lift's families by the first call routed to them):
# never by ``import autostate``, whose cost every program pays.
_ON_FIRST_USE = [
    "libcst", "autostate.transform.analysis", "autostate.nn", "autostate.compiled",
    "autostate.optimizers", "autostate.packing", "autostate.serialization", "autostate.stacks",
    "autostate.state_dicts", "autostate.render", "autostate.copies", "autostate.host",
    "autostate.lifting.core", "autostate.lifting.loops", "autostate.lifting.branches",
    "autostate.lifting.autodiff", "autostate.lifting.mapping", "autostate.lifting.jit",
]
_FIRST_USE_PROCESS = """
import json, sys
import autostate
imported = sorted(m for m in {names} if m in sys.modules)
# The names are the modules' own objects, read on first use.
import autostate.lifting.loops, autostate.optimizers, autostate.state_dicts, autostate.stacks
from autostate import Optimizer, Stack, load_state_dict, scan
import autostate.summary, autostate.export
same = [
    scan is autostate.lifting.loops.scan, autostate.map is autostate.lifting.loops.map,
    Optimizer is autostate.optimizers.Optimizer, Stack is autostate.stacks.Stack,
    load_state_dict is autostate.state_dicts.load_state_dict,
    # a module named as a public function leaves the function in place
    callable(autostate.summary), callable(autostate.export),
    "scan" in dir(autostate), sorted(autostate.__all__) == sorted(set(autostate.__all__)),
]
print(json.dumps([imported, same]))
"""


def test_import_autostate_leaves_what_a_call_needs_to_the_call(tmp_path):
    # A fresh process with an empty decoration cache: nothing is decorated at
    # import (a decoration from a cold cache would import libcst).
    env = {**os.environ, "AUTOSTATE_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([str(PACKAGE.parent), os.environ.get("PYTHONPATH", "")])}
    script = _FIRST_USE_PROCESS.format(names=repr(_ON_FIRST_USE))
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path,
                          capture_output=True, text=True, check=False, timeout=300)
    assert done.returncode == 0, done.stderr
    imported, same = json.loads(done.stdout.strip().splitlines()[-1])
    assert imported == []
    assert all(same), same


@pytest.mark.parametrize(
    ("layer", "forbidden"), [("autostate.transform", "jax"), ("autostate.effects", "libcst")]
)
def test_layers_do_not_import_what_they_must_not_know(layer, forbidden):
    for module in MODULES:
        if module == layer or module.startswith(layer + "."):
            for name, line in _imports(module):
                assert name.split(".")[0] != forbidden, f"{module}:{line} imports {name}"


def test_no_module_assigns_attributes_of_another_module():
    for module in MODULES:
        tree = _tree(module)
        aliases = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases |= {(a.asname or a.name).split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    if _resolve(full) == full or not full.startswith("autostate"):
                        aliases.add(alias.asname or alias.name)
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "setattr"
                and node.args
                and isinstance(node.args[0], ast.Name)
                and node.args[0].id in aliases
            ):
                pytest.fail(f"{module}:{node.lineno} setattr on module {node.args[0].id}")
            for target in targets:
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id in aliases
                ):
                    pytest.fail(f"{module}:{node.lineno} assigns {target.value.id}.{target.attr}")


def _private_uses(module: str, source: str | None = None) -> list[str]:
    """The private names of other modules of the package that ``module`` uses:
    imported by name (``from autostate.x import _y``), read through a module
    it imported (``_x._y``, ``autostate.x._y``) or fetched by name
    (``getattr(_x, "_y")``). ``source`` stands for the module's text."""
    tree = _tree(module) if source is None else ast.parse(source)
    modules: dict[str, str] = {}  # local name -> a module of the package
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("autostate"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if _resolve(full) == full:
                    modules[alias.asname or alias.name] = full
                elif alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{module}:{node.lineno} imports {full}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("autostate"):
                    # ``import autostate.x`` binds ``autostate``: ``autostate.x._y``
                    # is read through the dotted name, below.
                    modules[alias.asname or "autostate"] = alias.name if alias.asname else "autostate"

    def module_of(value: ast.expr) -> str | None:
        """The package's module an expression names (``_x``, ``autostate.x``)."""
        if isinstance(value, ast.Name):
            return modules.get(value.id)
        if isinstance(value, ast.Attribute):
            base = module_of(value.value)
            dotted = f"{base}.{value.attr}" if base else None
            return dotted if dotted in MODULES else None
        return None

    def private(name: str) -> bool:
        return name.startswith("_") and not name.startswith("__")

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            owner = module_of(node.value)
            if owner is not None and owner != module:
                found.append(f"{module}:{node.lineno} reads {owner}.{node.attr}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and private(node.args[1].value)
        ):
            owner = module_of(node.args[0])
            if owner is not None and owner != module:
                found.append(f"{module}:{node.lineno} reads {owner}.{node.args[1].value}")
    return found


def test_no_module_uses_a_private_name_of_another():
    found = [use for module in MODULES for use in _private_uses(module)]
    assert not found, "\n".join(found)


def test_the_private_name_check_sees_every_way_of_reaching_one():
    source = """
from autostate.graph import _walk
from autostate import graph as _g
from autostate.effects import local_state
import autostate.effects.local_state
import autostate.values as v
_g._kinds
local_state._ACTIVE
autostate.effects.local_state._ACTIVE
v._classify
getattr(_g, "_kinds")
_g.map_tree, v.kind_of, getattr(_g, "__name__"), vars(_g)["x"]
"""
    found = [use.split(" ", 1)[1] for use in _private_uses("autostate.api", source)]
    assert sorted(found) == sorted([
        "imports autostate.graph._walk",
        "reads autostate.graph._kinds",
        "reads autostate.effects.local_state._ACTIVE",
        "reads autostate.effects.local_state._ACTIVE",
        "reads autostate.values._classify",
        "reads autostate.graph._kinds",
    ])
    # A module's own private names are its own.
    assert _private_uses("autostate.graph", "from autostate import graph as g\ng._x") == []


def test_the_checks_see_the_real_imports():
    # Guards the checks above against passing vacuously.
    graph = _graph()
    assert "autostate.effects.local_state" in graph["autostate.runtime"]
    assert "autostate.transform.pipeline" in graph["autostate.api"]
    assert {"autostate.tree", "autostate.errors"} <= graph["autostate.effects.local_state"]
    assert any(name == "libcst" for name, _ in _imports("autostate.transform.analysis"))
    assert any(name == "jax" for name, _ in _imports("autostate.effects.local_state"))
    assert "autostate.lifting.loops" in graph and not _private_uses("autostate.lifting.loops")
    # Imports inside a function are edges, but not floors.
    assert "autostate.api" in graph["autostate.state_dicts"]
    assert "autostate.api" not in _import_time_graph()["autostate.state_dicts"]
    assert "autostate.effects.local_state" in _import_time_graph()["autostate.state_values"]
