# Two commands set up everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test bench lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[test,examples]"
	touch $@

$(VENV)/.installed-bench: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[test,examples,bench]"
	touch $@

demo: $(VENV)/.installed-test
	$(BIN)/python examples/demo.py

test: $(VENV)/.installed-test
	$(BIN)/ruff check .
	$(BIN)/mypy -p autostate
	$(BIN)/python -m pytest -q

bench: $(VENV)/.installed-bench
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info
