"""Shared test setup: a private decoration cache, and modules built from source text."""

from __future__ import annotations

import atexit
import ctypes
import fcntl
import gc
import importlib.util
import itertools
import json
import os
import resource
import shutil
import sys
import tempfile
import textwrap
import threading
import types
from collections.abc import Callable, Iterator
from importlib import metadata as _version
from pathlib import Path
from typing import Any

import pytest

# Decoration caches to disk by default; tests must never write to the home dir.
# The private cache is removed when the process exits.
if "AUTOSTATE_CACHE_DIR" not in os.environ:
    os.environ["AUTOSTATE_CACHE_DIR"] = tempfile.mkdtemp(prefix="autostate-test-cache-")
    atexit.register(shutil.rmtree, os.environ["AUTOSTATE_CACHE_DIR"], ignore_errors=True)

# One XLA compilation cache for the session, shared by the xdist workers and
# the subprocesses the tests start (they inherit the environment): tests
# compile the same small programs over and over, under new function objects
# that JAX's in-memory caches do not recognise. Every compilation is cached,
# however short. Removed when the session ends.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="autostate-test-xla-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
if "jax" in sys.modules:  # jax read its environment before this file ran: tell it too
    _config = sys.modules["jax"].config
    _config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    _config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    _config.update("jax_persistent_cache_min_entry_size_bytes", -1)

# Cheaper XLA code generation for the session (and the subprocesses, which
# inherit it). Most of the suite's time is XLA compiling one small program per
# new (primitive, shape) that eager JAX meets; what XLA makes of a program is
# JAX's concern, not autostate's, so the suite does not need XLA's optimized
# code. These flags halve a compilation on jaxlib 0.10 (about 43 -> 21 ms) and
# cut it by a fifth on 0.12. `make bench` and users keep XLA's defaults;
# AUTOSTATE_TEST_XLA_DEFAULTS=1 runs the suite with them too. An unknown flag
# aborts XLA, so the fusion-emitter switch (in jaxlib 0.8 to 0.10, absent
# from 0.12) is passed only below 0.11.
_XLA_FAST_COMPILE = [
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
]
if tuple(int(part) for part in _version.version("jaxlib").split(".")[:2]) < (0, 11):
    _XLA_FAST_COMPILE.append("--xla_cpu_use_fusion_emitters=false")
if not os.environ.get(
    "AUTOSTATE_TEST_XLA_DEFAULTS"
) and "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = " ".join(
        [os.environ.get("XLA_FLAGS", ""), *_XLA_FAST_COMPILE]
    ).strip()

# The tolerance policy's one XLA flag (tests/tolerance.py): a jitted program
# rounds to bfloat16/float16 where the Python code does, on every backend.
from tolerance import EXCESS_PRECISION_FLAG  # noqa: E402

if "xla_allow_excess_precision" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {EXCESS_PRECISION_FLAG}".strip()



# One MLIR context per thread, kept until the next release of JAX's caches
# (below), instead of a new one for every program JAX lowers: making a
# context loads every dialect JAX uses (5 to 8 ms, a third of lowering one
# of the suite's small programs, most of them one eager primitive at a new
# shape), and each cached program kept its own context alive. On
# tests/semantics/test_static_state.py: 52 -> 40 CPU-seconds, peak resident
# memory 1.41 -> 0.49 GB. The context is where the programs' types and
# constants are interned, so a new one is made when the caches that hold the
# programs are emptied. Per thread: a context is not thread-safe, and tests
# lower from several threads. Where JAX has no such function, nothing changes.
_mlir_contexts = threading.local()
_mlir_generation = 0


def _reuse_mlir_contexts() -> None:
    try:
        from jax._src.interpreters import mlir
    except ImportError:
        return
    make = getattr(mlir, "make_ir_context", None)
    if make is None or getattr(make, "_kept_per_thread", False):
        return

    def make_ir_context() -> Any:
        kept = getattr(_mlir_contexts, "kept", None)
        if kept is None or kept[0] != _mlir_generation:
            kept = _mlir_contexts.kept = (_mlir_generation, make())
        return kept[1]

    make_ir_context._kept_per_thread = True  # type: ignore[attr-defined]
    mlir.make_ir_context = make_ir_context


_reuse_mlir_contexts()


def pytest_configure(config: pytest.Config) -> None:
    """On an accelerator: the backend's precision policy (``tests/tolerance.py``),
    the CPU for the subprocesses the tests start, since one process at a
    time can hold a TPU (this one does), and generated programs that fail
    reported as drawn, not shrunk (each shrinking step compiles again: one
    took over five minutes on a TPU v5e)."""
    from hypothesis import Phase, settings
    from tolerance import on_accelerator, use_backend_precision

    if os.environ.get("JAX_PLATFORMS") == "cpu" or not on_accelerator():
        return
    use_backend_precision()
    os.environ["JAX_PLATFORMS"] = "cpu"  # read by JAX in the subprocesses only: this one has started
    settings.register_profile("accelerator", phases=[Phase.explicit, Phase.reuse, Phase.generate])
    settings.load_profile("accelerator")


# Resident memory (MB) above which a test's teardown empties JAX's caches even
# inside a test file (a file of many cases, each compiling its own programs).
_RSS_LIMIT_MB = float(os.environ.get("AUTOSTATE_TEST_RSS_LIMIT_MB", "2000"))
# ... and above which they are emptied after a test file's last test.
_FILE_END_MB = float(os.environ.get("AUTOSTATE_TEST_FILE_END_MB", "1200"))


def _rss_mb() -> float:
    """The resident memory now (Linux; elsewhere the peak so far)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):
        return _peak_rss_mb()


# Python's cyclic collector walks every object of its oldest generation,
# and a test session's heap is large and long-lived (JAX, the test modules,
# their programs). What survives the full collection after collection and at
# each release (below) is set aside (``gc.freeze``); the young generation is
# collected every 10,000 allocations rather than 700. On two semantics files
# the collector's own time went from 2.1 to 0.6 of 31 CPU-seconds;
# tests/unit/nn took 138 CPU-seconds instead of 141; peak memory the same.
gc.set_threshold(10_000, 20, 20)

# A release collects what was made since the last one (the file's programs,
# models and modules) and sets the survivors aside in turn. Walking the whole
# heap again (``gc.unfreeze`` first) took about 0.1 CPU-second a file and
# found nearly nothing more (on 13 unit files: 6,455 objects against 6,445,
# 1.27 CPU-seconds against 0.02): what was set aside is the session's. It is
# still done every ``_FULL_EVERY`` releases and whenever memory is over the
# limit (below), for the cycles an earlier file's survivors leave later.
_FULL_EVERY = 16
_releases = 0


def pytest_collection_finish(session: pytest.Session) -> None:
    gc.collect()
    gc.freeze()


def _release_memory(*, whole_heap: bool) -> None:
    import jax

    global _mlir_generation, _releases
    jax.clear_caches()
    _mlir_generation += 1  # (the next program lowers in a new MLIR context)
    _releases += 1
    if whole_heap or _releases % _FULL_EVERY == 0:
        gc.unfreeze()
    gc.collect()
    gc.freeze()
    try:  # hand the freed memory back to the system (glibc keeps it otherwise)
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After a test file's last test, JAX's in-memory caches are emptied once
    the worker holds more than ``_FILE_END_MB``: each file compiles its own
    programs (new function objects, new models), which a later file never
    calls again, and a worker that keeps them all grows by gigabytes over the
    session. Below that they are kept: the small programs of eager JAX (one
    primitive at a shape) are the same from file to file, and one read back
    from the session's compilation cache on disk (above) is lowered again
    first (on nine semantics and unit files: 163 CPU-seconds releasing after
    every file, 153 keeping them). Inside a file they are emptied once the
    worker holds more than ``_RSS_LIMIT_MB`` (and a quarter GB more than after
    the last time). Last of the teardown hooks: the file's module fixtures are
    gone by then, and collected with the rest."""
    global _rss_after_release
    last_of_file = nextitem is None or nextitem.path != item.path
    rss = _rss_mb()
    over = rss > max(_RSS_LIMIT_MB, _rss_after_release + 256)
    if (last_of_file and rss > _FILE_END_MB) or over:
        _release_memory(whole_heap=over)
        _rss_after_release = _rss_mb()  # (what stays is not the caches': no release per test)


_rss_after_release = 0.0


def _peak_rss_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # (bytes there, KiB here)


_peaks: dict[str, float] = {}


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Each xdist worker hands its peak resident memory to the controller
    (``make test`` prints them: a worker must stay under 3 GB)."""
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        output["peak_rss_mb"] = _peak_rss_mb()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    peak = getattr(node, "workeroutput", {}).get("peak_rss_mb")
    if peak is not None:
        _peaks[node.gateway.id] = peak


def pytest_terminal_summary(terminalreporter: Any) -> None:
    peaks = _peaks or {"this process": _peak_rss_mb()}
    terminalreporter.write_line(
        "peak resident memory: "
        + ", ".join(f"{name} {mb / 1024:.2f} GB" for name, mb in sorted(peaks.items()))
    )


@pytest.fixture(scope="session")
def once_per_session(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[str, Callable[[Path], Any]], Any]:
    """``once_per_session(name, compute)``: ``compute(folder)``'s result
    (JSON), computed once per session.

    For a module fixture that starts a process: such a fixture runs once in
    each pytest-xdist worker that runs a test of its module. Here the first
    worker that asks computes the result and the others read it.
    """

    def once(name: str, compute: Callable[[Path], Any]) -> Any:
        if "PYTEST_XDIST_WORKER" not in os.environ:
            return compute(tmp_path_factory.mktemp(name))
        shared = tmp_path_factory.getbasetemp().parent  # the session's, above each worker's
        result = shared / f"{name}.json"
        with open(shared / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if not result.exists():
                result.write_text(json.dumps(compute(tmp_path_factory.mktemp(name))))
        return json.loads(result.read_text())

    return once


_module_counter = itertools.count()


@pytest.fixture
def young_gc() -> Iterator[None]:
    """``gc.collect()`` in the test looks only at what the test made: what was made
    before it is set aside (``gc.freeze``) until the next release of memory
    that walks the whole heap (above), so a collection does not walk every
    object of the session (nor does ``jax.checking_leaks``, which collects and
    searches a leaked tracer's referrers). A cycle the test leaves is still
    collected."""
    gc.freeze()
    yield


@pytest.fixture
def write_module(tmp_path: Path) -> Iterator[Callable[..., types.ModuleType]]:
    """Writes source text to a ``.py`` file under ``tmp_path`` and imports it.

    ``write_module(source, name=None)`` returns the imported module; it is in
    ``sys.modules`` while the test runs (so pickling by reference works) and
    removed afterwards.
    """
    added: list[str] = []

    def load(source: str, name: str | None = None) -> types.ModuleType:
        name = name or f"autostate_testmod_{next(_module_counter)}"
        path = tmp_path / f"{name}.py"
        path.write_text(textwrap.dedent(source))
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        added.append(name)
        spec.loader.exec_module(module)
        return module

    yield load
    for name in added:
        sys.modules.pop(name, None)
