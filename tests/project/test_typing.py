"""Typing: the documented programs type-check with mypy (and the plugin) and
pyright, ``f(states, x)`` returns the method's type, ``constant()`` and
``state()`` keep their value's, and ``autostate.Stateful`` works at run time
as ``@stateful`` does.

One mypy run and one pyright run check every documented program at once:
each ``python`` block of README.md and docs/ that imports autostate (what
``tests/project/test_docs.py`` runs; a tutorial's ``--8<--`` script included), read
at test time, less the blocks documented to raise, plus the usage files below
whose ``reveal_type`` lines pin the types.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import autostate
from autostate.transform.method import INPLACE_TENSOR_METHODS

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>\w*)\n(?P<code>.*?)^(?P=indent)```$", re.M | re.S)
_SNIPPET = re.compile(r'^--8<-- "(?P<path>[^"]+)"$', re.M)
_ERROR = re.compile(r"^\w+: ")

# Both checkers, both forms that need no plugin: the ``autostate.Stateful``
# base and ``autostate.functionalize(model)``.
TYPED = textwrap.dedent(
    """
    import jax
    import jax.numpy as jnp

    import autostate


    class Counter(autostate.Stateful):
        def __init__(self) -> None:
            self.count = jnp.zeros(())
            self.table = autostate.constant(jnp.ones(3))
            self.kv = autostate.state(jnp.ones(2), category="cache")

        def __call__(self, x: jax.Array) -> jax.Array:
            self.count += 1
            return x * self.count

        def step(self, x: jax.Array, *, scale: float = 1.0) -> tuple[jax.Array, int]:
            return x * scale, 1

        def eval(self):  # a user's own eval() returns the model, as PyTorch's does
            self.training = False
            return self


    @autostate.stateful
    class Plain:
        def __init__(self) -> None:
            self.w = jnp.ones(2)

        def __call__(self, x: int) -> str:
            return str(x)


    f, states = Counter().functionalize()
    out, states = f(states, jnp.ones(2))
    model = autostate.freeze(f, states)
    g, plain_states = autostate.functionalize(Plain())
    reveal_type(f)
    reveal_type(model)
    reveal_type(states)
    reveal_type(f(states, jnp.ones(2)))
    reveal_type(g(plain_states, 1))
    reveal_type(autostate.freeze(g, plain_states))
    reveal_type(model.table)
    reveal_type(model.kv)
    reveal_type(Counter().train())
    reveal_type(autostate.load("ckpt.npz", like=Plain()))


    def loss(model: Counter, x: jax.Array) -> jax.Array:
        return model(x).sum()


    step = autostate.jit(loss)
    reveal_type(step(Counter(), jnp.ones(2)))
    reveal_type(autostate.jit(static_argnums=1)(loss)(Counter(), jnp.ones(2)))
    reveal_type(autostate.value_and_grad(loss)(Counter(), jnp.ones(2)))
    reveal_type(autostate.grad(lambda m: m(jnp.ones(2)).sum())(Counter()))
    reveal_type(autostate.grad(lambda m: (m(jnp.ones(2)).sum(), "aux"), has_aux=True)(Counter()))
    """
)
# A compiled function keeps its parameters: a wrong argument is an error in both.
WRONG = textwrap.dedent(
    """
    import jax
    import jax.numpy as jnp

    import autostate


    class Counter(autostate.Stateful):
        def __init__(self) -> None:
            self.count = jnp.zeros(())


    @autostate.jit
    def step(model: Counter, x: jax.Array) -> jax.Array:
        return x


    step(Counter(), "x")  # E: not an Array
    step(jnp.ones(2), jnp.ones(2))  # E: not a Counter
    """
)
TYPED_REVEALS = [
    "FunctionalModel[Counter]",
    "Counter",
    "dict[str, Any]",
    "tuple[Array, dict[str, Any]]",
    "tuple[str, dict[str, Any]]",
    "Plain",
    "Array",
    "Array",
    "Counter",
    "Plain",
    "Array",
    "Array",
    "tuple[Array, FunctionalModel[Counter]]",
    "FunctionalModel[Counter]",
    "tuple[FunctionalModel[Counter], str]",
]

# mypy with the plugin: the decorator form, ``train``/``eval`` and ``f.<method>``.
DECORATED = textwrap.dedent(
    """
    import jax
    import jax.numpy as jnp

    import autostate


    @autostate.stateful
    class Counter:
        def __init__(self) -> None:
            self.count = jnp.zeros(())

        def __call__(self, x: jax.Array) -> jax.Array:
            self.count += 1
            return x * self.count

        def step(self, x: jax.Array, *, scale: float = 1.0) -> tuple[jax.Array, int]:
            return x * scale, 1


    @autostate.stateful(category="cache")
    class Cache(Counter):
        pass


    class Modes:
        def eval(self) -> None:
            self.training = False


    @autostate.stateful
    class OwnEval(Modes):
        pass


    f, states = Counter().functionalize()
    reveal_type(f)
    reveal_type(f(states, jnp.ones(2)))
    reveal_type(f.step(states, jnp.ones(2), scale=2.0))
    reveal_type(Counter().train(False))
    reveal_type(Counter().eval())
    reveal_type(Cache().functionalize("cache")[0])
    reveal_type(Cache().eval())
    reveal_type(OwnEval().eval())
    reveal_type(OwnEval().train())
    reveal_type(autostate.freeze(f, states))
    reveal_type(f.model)
    reveal_type(f.state_names())
    f.missing(states)  # E: no method
    f(states, "x")  # E: not an Array
    """
)
DECORATED_REVEALS = [
    "FunctionalModel[Counter]",
    "tuple[Array, dict[str, Any]]",
    "tuple[tuple[Array, int], dict[str, Any]]",
    "Counter",
    "Counter",
    "FunctionalModel[Cache]",
    "Cache",
    "None",
    "OwnEval",
    "Counter",
    "Counter",
    "frozenset[str]",
]

# What a checker reports on the documented programs that the program cannot
# avoid, each owned by its page (``(checker, page prefix, message pattern,
# why)``); nothing else may be reported. The programs use the typed forms
# (``autostate.functionalize(model)``, ``autostate.Stateful``), so the methods
# ``@stateful`` adds are reported only where noted here.
TOLERATED = [
    ("mypy", "docs/ecosystem.md", r"PyTreeDef",
     "jax's stubs name PyTreeDef without defining it: `==` on two tree structures"),
    ("both", "docs/migration/pytorch.md", r"\"savez\"",
     "numpy's stubs: `np.savez(path, **arrays)` might pass an array as `allow_pickle` "
     "(an explicit `allow_pickle=` would be saved as an array by numpy 2.0)"),
    ("pyright", "", r'to parameter "params" of type "Params"',
     "optax types params as its ArrayTree (arrays, iterables, mappings): `optimizer.init(f)` "
     "on a registered pytree class such as FunctionalModel (or an Equinox module)"),
    ("pyright", "", r'Cannot access attribute "(' + "|".join(INPLACE_TENSOR_METHODS) + r')" for class "Array"',
     "jax.Array has no PyTorch in-place methods (`self.x.mul_(m)`): the rewrite gives them their "
     "meaning on a state, pyright reads jax's stubs (docs/limitations.md)"),
]
# Pyright has no plugins: a method a decorator adds is unknown to it, and no
# annotation of ``stateful`` can say "the same class, with these methods"
# (README.md, "Type checking"). The documented programs use the typed forms;
# ``decorated.py`` pins what pyright reports on the decorator form.
PYRIGHT_DECORATOR_FORM = re.compile(r'Cannot access attribute "(functionalize|train|eval)" for class "(\w+)"')


def _programs() -> dict[str, str]:
    """``{file name: source}`` of every documented program, its page and line in a comment."""
    programs = {}
    for doc in DOCS:
        text = doc.read_text()
        blocks = [
            (m["lang"], re.sub(f"^{m['indent']}", "", m["code"], flags=re.M), m.start())
            for m in _FENCE.finditer(text)
        ]
        for i, (lang, code, start) in enumerate(blocks):
            code = _SNIPPET.sub(lambda m: (ROOT / m["path"]).read_text(), code)
            if lang != "python" or not re.search(r"^(import|from) autostate\b", code, re.M):
                continue
            nxt = blocks[i + 1] if i + 1 < len(blocks) else None
            if nxt is not None and nxt[0] == "text" and _ERROR.match(nxt[1].strip()):
                continue  # documented to raise: wrong on purpose
            page = f"{doc.relative_to(ROOT)}:{text.count(chr(10), 0, start) + 1}"
            programs[f"doc{len(programs):03d}.py"] = f"# {page}\n{code}"
    return programs


def _write_programs(tmp: Path) -> tuple[Path, dict[str, str]]:
    """The documented programs and the usage files, one module each, under ``tmp/src``."""
    src = tmp / "src"
    src.mkdir()
    files = {**_programs(), "typed.py": TYPED, "decorated.py": DECORATED, "wrong.py": WRONG}
    for name, code in files.items():
        (src / name).write_text(code)
    return src, files


# Where the programs find autostate, and the tutorials ``tutorial_train``.
PATHS = [str(ROOT), str(ROOT / "examples")]


def _mypy(tmp: Path, src: Path) -> list[tuple[str, int, str]]:
    """One mypy run with the plugin: ``(file, line, message)`` of each error and reveal.

    In a process of its own: what mypy builds (every module of JAX the programs
    import) is gone when it ends, rather than left in this worker's memory.
    With no cache written (``os.devnull``, as mypy documents): one run never
    reads one back (14.3-15.1 -> 13.2 CPU-seconds, the same report)."""
    (tmp / "mypy.ini").write_text(
        "[mypy]\n"
        f"mypy_path = {','.join(PATHS)}\n"
        "follow_imports = silent\n"
        "plugins = autostate.mypy_plugin\n"
        "[mypy-optax.*,orbax.*,sklearn.*,tqdm.*]\n"  # no type information
        "ignore_missing_imports = True\n"
    )
    run = subprocess.run(
        [
            sys.executable, "-m", "mypy", str(src),
            "--config-file", str(tmp / "mypy.ini"),
            "--cache-dir", os.devnull,
            "--no-error-summary",
            "--show-absolute-path",
        ],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))},
    )
    stdout, stderr = run.stdout, run.stderr
    found = []
    for line in stdout.splitlines():
        m = re.match(r"(?P<file>[^:]+):(?P<line>\d+): (?P<kind>error|note): (?P<message>.*)", line)
        assert m is not None or not line.strip(), stdout + stderr
        if m is not None and (m["kind"] == "error" or "Revealed type" in m["message"]):
            found.append((Path(m["file"]).name, int(m["line"]), m["message"]))
    return found


def _pyright(src: Path) -> list[tuple[str, int, str]]:
    """One pyright run, its standard rules, from the pip package (which bundles
    pyright and node: nothing is downloaded); errors carry their rule."""
    (src / "pyrightconfig.json").write_text(
        json.dumps({"typeCheckingMode": "standard", "pythonVersion": "3.11", "extraPaths": PATHS})
    )
    env = {**os.environ, "PYRIGHT_PYTHON_IGNORE_WARNINGS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "pyright", "--outputjson", "--pythonpath", sys.executable, str(src)],
        cwd=src, env=env, capture_output=True, text=True, timeout=600,
    )
    assert run.stdout.startswith("{"), run.stdout + run.stderr
    return [
        (
            Path(d["file"]).name,
            d["range"]["start"]["line"] + 1,
            f"{d['message']}  [{d.get('rule', '')}]"
            if d["severity"] == "error"
            else "Revealed " + d["message"],
        )
        for d in json.loads(run.stdout)["generalDiagnostics"]
        if d["severity"] == "error" or d["message"].startswith("Type of")
    ]



def _revealed(found, name: str) -> list[str]:
    """The revealed types of file ``name``, in line order, module paths dropped."""
    types = []
    for file, _, message in sorted(found):
        if file == name and message.startswith("Revealed"):
            text = re.split(r"Revealed type is |Revealed Type of \".*\" is ", message, maxsplit=1)[1]
            types.append(re.sub(r"[\w.]+\.(\w+)", r"\1", text.strip('"')))
    return types


def _errors(found, name: str) -> list[tuple[int, str]]:
    return sorted((line, message) for file, line, message in found if file == name and not
                  message.startswith("Revealed"))


def _unexplained(checker: str, found, files) -> list[str]:
    left = []
    for file, line, message in found:
        if not file.startswith("doc") or message.startswith("Revealed"):
            continue
        code = files[file]
        page = code.split("\n", 1)[0][2:]
        if any(
            who in ("both", checker) and page.startswith(prefix) and re.search(pattern, message)
            for who, prefix, pattern, _ in TOLERATED
        ):
            continue
        source = code.splitlines()[line - 1].strip()
        left.append(f"{page} (+{line - 1}): {source}\n    {message}")
    return left


def test_mypy_with_the_plugin_types_the_documented_programs(tmp_path):
    """No error in any documented program; ``f(states, x)`` returns the type of
    ``__call__``'s result, ``constant``/``state`` keep the value's type, and the
    plugin types the decorator form: ``functionalize``, ``train``, ``eval``
    and ``f.<method>``."""
    pytest.importorskip("mypy.api")
    src, files = _write_programs(tmp_path)
    found = _mypy(tmp_path, src)
    left = _unexplained("mypy", found, files)
    assert not left, "\n".join(left)
    assert any(f.startswith("doc") for f in files)  # the docs were found
    assert _errors(found, "typed.py") == []
    assert _revealed(found, "typed.py") == TYPED_REVEALS
    assert _revealed(found, "decorated.py") == DECORATED_REVEALS
    errors = _errors(found, "decorated.py")
    lines = DECORATED.splitlines()
    assert [lines[line - 1].split("  # E: ")[1] for line, _ in errors] == ["no method", "not an Array"]
    assert '"Counter" has no method "missing" to call functionally' in errors[0][1]
    assert 'has incompatible type "str"; expected "Array"' in errors[1][1]
    _assert_wrong_arguments_reported(found)


def _assert_wrong_arguments_reported(found) -> None:
    lines = WRONG.splitlines()
    errors = _errors(found, "wrong.py")
    assert [lines[line - 1].split("  # E: ")[1] for line, _ in errors] == [
        "not an Array", "not a Counter"
    ], errors


def test_pyright_types_the_documented_programs(tmp_path):
    """No error in any documented program: they use the typed forms
    (``autostate.Stateful``, ``autostate.functionalize``), which give the same
    types as with mypy; on the decorator form pyright, which has no plugins,
    reports the methods ``@stateful`` adds as unknown (the documented limitation)."""
    pytest.importorskip("pyright")  # a test dependency; an offline accelerator machine may lack it
    src, files = _write_programs(tmp_path)
    found = _pyright(src)
    left = _unexplained("pyright", found, files)
    assert not left, "\n".join(left)
    assert _errors(found, "typed.py") == []
    assert _revealed(found, "typed.py") == TYPED_REVEALS
    errors = _errors(found, "decorated.py")
    names = [m[1] for _, message in errors if (m := PYRIGHT_DECORATOR_FORM.search(message))]
    assert names == ["functionalize", "train", "eval", "functionalize", "eval", "train"]
    assert len(names) == len(errors)
    _assert_wrong_arguments_reported(found)



class Counter(autostate.Stateful):
    def __init__(self):
        self.count = jnp.zeros(())

    def __call__(self, x):
        self.count += 1
        return x * self.count


class Child(Counter):
    def __call__(self, x):
        self.count += 2
        return x


@autostate.stateful(category="cache")
class Cached(autostate.Stateful):
    def __init__(self):
        self.kv = jnp.zeros(2)

    def write(self, x):
        self.kv = x


def test_stateful_base_class_decorates_subclasses():
    model = Counter()
    model(jnp.ones(2))
    assert float(model.count) == 1.0
    f, states = model.functionalize()
    out, states = jax.jit(lambda f, s, x: f(s, x))(f, states, jnp.ones(2))
    assert float(states["count"]) == 2.0
    child = Child()
    child(1.0)
    assert float(child.count) == 2.0
    assert autostate.tree.class_info(Child).state == {"count"}
    _, cached = Cached().functionalize("cache")
    assert sorted(cached) == ["kv"]


def test_constant_and_state_return_markers_typed_as_their_value():
    """At run time ``constant``/``state`` return a marker; once ``__init__`` has
    run the attribute holds the value, the type the annotations promise."""

    @autostate.stateful
    class Model:
        def __init__(self):
            self.table = autostate.constant(jnp.arange(3.0))
            self.kv = autostate.state(jnp.zeros(2), category="cache")

    model = Model()
    assert isinstance(model.table, jax.Array) and isinstance(model.kv, jax.Array)
    assert model.table.tolist() == [0.0, 1.0, 2.0]
