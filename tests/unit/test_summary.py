"""``autostate.summary``: rows, totals and the table, checked against the model's own dicts."""

from __future__ import annotations

import contextlib
import io
import linecache
import re
import runpy
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import autostate
from autostate.errors import InvalidTypeError
from autostate.summary import Summary

ROOT = Path(__file__).resolve().parents[2]


@autostate.stateful
class Linear:
    def __init__(self, n_in, n_out):
        self.weight = jnp.ones((n_out, n_in))
        self.bias = jnp.zeros(n_out)

    def __call__(self, x):
        return x @ self.weight.T + self.bias


@autostate.stateful
class Norm:
    def __init__(self, n):
        self.weight = jnp.ones(n)
        self.running_mean = jnp.zeros(n)
        self.training = True

    def eval(self):
        self.training = False

    def __call__(self, x):
        if self.training:
            self.running_mean = 0.9 * self.running_mean + 0.1 * x.mean(0)
        return x * self.weight


@autostate.stateful
class Net:
    def __init__(self):
        self.embed = Linear(3, 4)
        self.norms = [Norm(4), Norm(4)]
        self.again = self.norms[0]  # one sub-model, two paths
        self.head = Linear(4, 3)
        self.head.weight = self.embed.weight.T  # a different array: not tied
        self.out = Linear(3, 4)
        self.out.weight = self.embed.weight  # tied
        self.positions = jnp.arange(4)  # an integer array: a constant
        self.table = autostate.constant(jnp.ones((2, 2)))
        self.cache = autostate.state({"k": jnp.zeros(2), "v": jnp.zeros((2, 3))}, category="cache")

    def __call__(self, x):
        x = self.norms[1](self.again(self.embed(x)))
        return self.out(self.head(x))


def _rows(s: Summary) -> dict[str, object]:
    return {r.path: r for r in s.rows}


def test_rows_name_every_array_by_its_dict_key_with_its_kind_and_size():
    model = Net()
    s = autostate.summary(model)
    rows = _rows(s)
    params, states = autostate.param_dict(model), autostate.state_dict(model)
    for key, value in params.items():
        row = rows[key]
        assert (row.kind, row.shape, row.dtype) == ("parameter", value.shape, str(value.dtype))
        assert (row.count, row.bytes) == (value.size, value.nbytes)
    for key, value in states.items():
        row = rows[key]
        assert (row.shape, row.count, row.bytes) == (value.shape, value.size, value.nbytes)
    kinds = {path: row.kind for path, row in rows.items() if path in states}
    assert {p for p, k in kinds.items() if k == "constant"} == {"positions", "table"}
    assert rows["cache['k']"].category == "cache" and rows["cache['k']"].kind == "state"
    assert [(r.path, r.value) for r in s.rows if r.kind == "static"] == [
        ("norms[0].training", True),
        ("norms[1].training", True),
    ]
    # The tied array is counted once; the shared sub-model is listed once.
    tied = rows["out.weight"]
    assert (tied.tied_to, tied.count, tied.bytes) == ("embed.weight", 0, 0)
    assert not any(path.startswith("again") for path in rows)
    assert set(rows) == set(params) | set(states) | {
        "out.weight",
        "norms[0].training",
        "norms[1].training",
    }


def test_totals_add_up_the_model_dicts():
    model = Net()
    s = autostate.summary(model)
    params, states = autostate.param_dict(model), autostate.state_dict(model)
    constants = {"positions", "table"}
    assert s.total_params == sum(v.size for v in params.values())
    assert s.totals["parameter"].count == s.total_params
    assert s.totals["parameter"].entries == len(params)
    assert s.totals["state"].bytes == sum(v.nbytes for k, v in states.items() if k not in constants)
    assert s.totals["constant"].count == sum(states[k].size for k in constants)
    assert s.totals["static"].entries == 2
    everything = [*params.values(), *states.values()]
    assert s.total_count == sum(v.size for v in everything)
    assert s.total_bytes == sum(v.nbytes for v in everything)


def test_the_table_shows_each_row_and_the_totals():
    model = Net()
    s = autostate.summary(model)
    text = str(s)
    lines = text.splitlines()
    assert lines[0] == "Net summary"
    assert lines[1].split() == ["path", "kind", "shape", "dtype", "count", "bytes"]
    for row in s.rows:
        (line,) = [ln for ln in lines if ln.startswith(row.path + " ")]
        assert row.kind in line
    (embed,) = [ln for ln in lines if ln.startswith("embed.weight ")]
    assert embed.split() == ["embed.weight", "parameter", "(4,", "3)", "float32", "12", "48"]
    assert "out.weight (tied to embed.weight)" in text
    assert re.search(r"^norms\[0\]\.training +static +bool = True$", text, re.M)
    assert re.search(r"^cache\['k'\] +state \(cache\) +\(2,\) +float32 +2 +8$", text, re.M)
    assert (
        f"parameters: {len(autostate.param_dict(model))} arrays, {s.total_params} elements" in text
    )
    assert lines[-1] == f"total: {s.total_count} elements, {s.total_bytes} B"
    assert repr(s) == text


def test_f_and_states_give_the_same_summary_eagerly_and_inside_jit():
    model = Net()
    model.eval()
    expected = str(autostate.summary(model))
    assert "bool = False" in expected
    f, states = model.functionalize()
    assert str(autostate.summary(f, states)) == expected
    seen = []

    @jax.jit
    def step(f, states, x):
        seen.append(str(autostate.summary(f, states)))
        return f(states, x)

    step(f, states, jnp.ones((2, 3)))
    assert seen == [expected]
    pf, pstates = autostate.pack(f, states)
    assert _rows(autostate.summary(pf, pstates)).keys() == _rows(autostate.summary(model)).keys()


def test_states_go_with_f_only():
    model = Net()
    f, states = model.functionalize()
    with pytest.raises(InvalidTypeError, match="needs the states dict"):
        autostate.summary(f)
    with pytest.raises(InvalidTypeError, match="takes a states dict only with an f"):
        autostate.summary(model, states)


def test_the_docs_show_the_real_table(tmp_path: Path, monkeypatch):
    """docs/summary.md: the table under its first program is what that program's model gives."""
    blocks = re.findall(r"```(\w+)\n(.*?)```", (ROOT / "docs" / "summary.md").read_text(), re.S)
    program = next(code for lang, code in blocks if lang == "python" and "import autostate" in code)
    table = next(code for lang, code in blocks if lang == "text")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "example.py").write_text(program)
    linecache.clearcache()  # decoration reads example.py's lines
    with contextlib.redirect_stdout(io.StringIO()):
        scope = runpy.run_path("example.py", run_name="__main__")
    assert str(autostate.summary(scope["model"])) == table.rstrip("\n")


def test_states_of_a_category_f_does_not_handle_are_listed_from_f():
    model = Net()
    f, states = model.functionalize(category="cache")
    assert "cache" in states and "norms[0].running_mean" not in states  # held by f itself
    rows = _rows(autostate.summary(f, states))
    whole = _rows(autostate.summary(model))
    assert rows.keys() == whole.keys()
    for path, row in whole.items():
        assert (rows[path].kind, rows[path].shape, rows[path].count) == (
            row.kind,
            row.shape,
            row.count,
        ), path
