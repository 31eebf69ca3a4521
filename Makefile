# Two commands set up everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The interpreters `make test-all` runs the suite with: each of python3.11/3.12/3.13
# that runs, found on PATH or among pyenv's versions (a pyenv shim of a version
# that is not selected exists on PATH but does not run).
PYENV_ROOT ?= $(shell pyenv root 2>/dev/null)
runs = $(if $(shell $(1) -c "" 2>/dev/null && echo y),$(1))
find_python = $(firstword $(call runs,python$(1)) $(foreach c,$(wildcard $(PYENV_ROOT)/versions/$(1).*/bin/python$(1)),$(call runs,$(c))))
PYTHONS := $(foreach v,3.11 3.12 3.13,$(call find_python,$(v)))
# `make test-min`: the oldest supported Python with the lower bounds of pyproject.toml.
MIN_PYTHON ?= python3.11
export NO_MKDOCS_2_WARNING := 1

.PHONY: demo test test-accel accel-wheels docs docs-serve test-min test-all dist bench lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Editable in setuptools' compat mode: the clone goes on sys.path through a
# .pth file, which mypy and pyright follow (the default mode's import hook
# they cannot), so a program outside the clone type-checks against it.
EDITABLE := --config-settings editable_mode=compat

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet $(EDITABLE) -e ".[test,examples,docs]"
	touch $@

$(VENV)/.installed-bench: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet $(EDITABLE) -e ".[test,examples,docs,bench]"
	touch $@

demo: $(VENV)/.installed-test
	$(BIN)/python examples/demo.py

# pytest runs one worker per core (pytest-xdist). Each worker takes a
# contiguous half of the tests and steals the tail of the other's when idle
# (`--dist worksteal`): a test file then stays on one worker, which decorates
# its programs and compiles its JAX programs once, where `--dist load` deals
# a file's tests out to both and each repeats that work (three semantics
# files: 151 CPU-seconds with load, 139 with worksteal, 120 in one process).
XDIST := -n auto --dist worksteal

# mypy and the strict docs build, one process each, run beside pytest (a
# worker leaves its core idle at times, and neither reads what the other writes). Their output follows
# pytest's; the target fails if any of the four does.
test: $(VENV)/.installed-test
	$(BIN)/ruff check .
	@logs=$$(mktemp -d); \
	{ $(BIN)/mypy -p autostate > $$logs/mypy 2>&1; echo $$? > $$logs/mypy.rc; } & \
	{ ( $(MKDOCS_STRICT) ) > $$logs/docs 2>&1; echo $$? > $$logs/docs.rc; } & \
	$(BIN)/python -m pytest -q $(XDIST); rc=$$?; wait; \
	echo "mypy -p autostate:"; cat $$logs/mypy; \
	echo "mkdocs build --strict:"; cat $$logs/docs; \
	failed=; [ $$rc -eq 0 ] || failed="$$failed pytest"; \
	[ "$$(cat $$logs/mypy.rc)" = 0 ] || failed="$$failed mypy"; \
	[ "$$(cat $$logs/docs.rc)" = 0 ] || failed="$$failed docs"; \
	rm -rf $$logs; \
	if [ -n "$$failed" ]; then echo "make test failed:$$failed"; exit 1; fi

# The suite on an accelerator (a TPU, a GPU) in one process: one program at a
# time may hold a TPU, and the tests' subprocesses run on its host's CPU
# (tests/conftest.py). XLA keeps its default flags (the suite's fast-compile
# flags are CPU's); tests/tolerance.py is the precision policy. No venv is made:
# ACCEL_PYTHON is the interpreter whose JAX sees the accelerator, with the
# test dependencies importable (CONTRIBUTING.md: a machine without network).
# ARGS: what pytest runs (default: the whole suite), e.g. ARGS=tests/unit.
ACCEL_PYTHON ?= python3
ARGS ?= tests
test-accel:
	AUTOSTATE_TEST_XLA_DEFAULTS=1 PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" \
	  $(ACCEL_PYTHON) -m pytest -q -rs -p no:xdist -p no:cacheprovider $(ARGS)

# Wheels of the dependencies an offline accelerator machine may lack, for its
# Python (ACCEL_PY_VERSION), into ACCEL_WHEELS; carry that folder there and
# install it as CONTRIBUTING.md says.
ACCEL_WHEELS ?= .wheels-accel
ACCEL_PY_VERSION ?= 3.11
ACCEL_WHEEL_NAMES ?= libcst pyyaml typing_extensions
accel-wheels:
	$(PYTHON) -m pip download --no-deps --only-binary=:all: --implementation cp \
	  --python-version $(ACCEL_PY_VERSION) --platform manylinux_2_28_x86_64 \
	  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -d $(ACCEL_WHEELS) $(ACCEL_WHEEL_NAMES)

# The documentation site, strict: a warning (a broken link, a missing page, a
# docstring that does not render) fails the build. Output: site/. Only what is
# not INFO is printed; `--quiet` is not used, since it hides the warnings from
# `--strict` too and the build then passes whatever they say.
MKDOCS_STRICT = out=$$($(BIN)/mkdocs build --strict --site-dir site 2>&1); rc=$$?; \
	printf '%s\n' "$$out" | grep -v '^INFO'; \
	[ $$rc -eq 0 ] && ! printf '%s\n' "$$out" | grep -q '^WARNING'

docs: $(VENV)/.installed-test
	$(MKDOCS_STRICT)

docs-serve: $(VENV)/.installed-test
	$(BIN)/mkdocs serve

# Both matrix targets run one worker per core (pytest-xdist) and fix
# hypothesis's seed, so every interpreter and version set runs the same
# property examples (`make test` keeps drawing new ones).
MATRIX_PYTEST := -m pytest -q $(XDIST) -p no:cacheprovider --hypothesis-seed=0

# The suite on the lower bounds: every ">=" in [project] dependencies pinned
# with "==", on the oldest supported Python, in its own venv.
test-min:
	rm -rf .venv-min
	$(MIN_PYTHON) -m venv .venv-min
	.venv-min/bin/python -m pip install --quiet --upgrade pip
	.venv-min/bin/python -c 'import re, tomllib; deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]; print("\n".join(d.replace(">=", "==") for d in deps))' > .venv-min/constraints.txt
	.venv-min/bin/python -m pip install --quiet -c .venv-min/constraints.txt -e ".[test,examples]"
	.venv-min/bin/python -m pip list 2>/dev/null | grep -Ei '^(jax|jaxlib|libcst|numpy) '
	.venv-min/bin/python $(MATRIX_PYTEST)

# The suite on every supported interpreter installed here, each in .venv-3.X.
test-all:
	@test -n "$(PYTHONS)" || { echo "none of python3.11/3.12/3.13 found"; exit 1; }
	@failed=; for py in $(PYTHONS); do \
	  venv=.venv-$$($$py -c 'import sys; print("%d.%d" % sys.version_info[:2])'); \
	  { [ -x $$venv/bin/python ] || { $$py -m venv $$venv && $$venv/bin/python -m pip install --quiet --upgrade pip; }; } && \
	  $$venv/bin/python -m pip install --quiet -e ".[test,examples]" && \
	  echo "== $$py: $$($$venv/bin/python -c 'import sys, jax; print(sys.version.split()[0], "jax", jax.__version__)')" && \
	  $$venv/bin/python $(MATRIX_PYTEST) || failed="$$failed $$venv"; \
	done; \
	if [ -n "$$failed" ]; then echo "test-all failed in:$$failed"; exit 1; fi; echo "test-all passed: $(PYTHONS)"

# A wheel and an sdist that install into a fresh venv and import.
dist: $(VENV)/.installed-test
	rm -rf dist .venv-dist
	$(BIN)/python -m pip install --quiet build
	$(BIN)/python -m build --outdir dist .
	$(PYTHON) -m venv .venv-dist
	.venv-dist/bin/python -m pip install --quiet dist/*.whl
	cd / && $(CURDIR)/.venv-dist/bin/python -c 'import autostate; print("wheel:", autostate.__version__, autostate.__file__)'
	.venv-dist/bin/python $(CURDIR)/examples/counter.py
	.venv-dist/bin/python -m pip install --quiet --force-reinstall --no-deps dist/*.tar.gz
	cd / && $(CURDIR)/.venv-dist/bin/python -c 'import autostate; print("sdist:", autostate.__version__, autostate.__file__)'
	.venv-dist/bin/python $(CURDIR)/examples/counter.py

bench: $(VENV)/.installed-bench
	$(BIN)/python benchmarks/run_all.py

lint: $(VENV)/.installed-test
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) .venv-min .venv-3.* .venv-dist build dist site *.egg-info $(ACCEL_WHEELS)
