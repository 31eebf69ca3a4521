"""The one tolerance policy of the suite and of the benchmarks' pre-checks.

A comparison of autostate's result with plain Python (or with hand-written
JAX) asks for the precision the backend documents, not for CPU's bits:

* on CPU, float32 is IEEE float32 and the tolerances asked for are used as
  they are;
* on an accelerator (TPU, GPU), a float32 matrix product is, by default,
  a few bf16 (or TF32) passes: ``use_backend_precision`` asks JAX for
  ``jax_default_matmul_precision="highest"`` (full float32 products) for
  the whole process, and ``tolerance`` widens each asked tolerance by
  ``ACCELERATOR_FACTOR``: the accelerator's ``exp``, ``log``, ``pow`` and
  ``tanh`` are approximations a few ulps wide, and XLA fuses a jitted
  program differently from the same operations run one at a time, so two
  correct programs agree to about six digits there, not seven.

* on every backend, ``EXCESS_PRECISION_FLAG`` is in ``XLA_FLAGS`` (set by
  ``tests/conftest.py`` before JAX starts): by default XLA on a TPU or GPU
  may drop a rounding to bfloat16 or float16 inside a jitted program
  (``convert(convert(x, bf16), f32)`` becomes ``x``: JAX issue 23007), so a
  value the plain Python rounds to bfloat16 would keep float32 bits under
  ``jit``, a difference of up to half a bfloat16 step (0.4 %), not a few
  ulps. With the flag off, the compiled program rounds where the Python
  code does, as XLA:CPU always does; no tolerance has to cover it.

``tests/conftest.py`` calls ``use_backend_precision`` once per process; the
harness (``tests/semantics/harness.py``) and the benchmarks' pre-checks
(``benchmarks/_timing.py``) take their tolerances from ``tolerance``.
"""

from __future__ import annotations

import jax

ACCELERATOR_FACTOR = 10.0
EXCESS_PRECISION_FLAG = "--xla_allow_excess_precision=false"


def on_accelerator() -> bool:
    """Whether JAX's default backend is not the CPU."""
    return jax.default_backend() != "cpu"


def use_backend_precision() -> None:
    """Full float32 matrix products for the process where the backend's default is less."""
    if on_accelerator():
        jax.config.update("jax_default_matmul_precision", "highest")


def tolerance(rtol: float = 1e-5, atol: float = 1e-6) -> dict[str, float]:
    """``{"rtol", "atol"}`` for ``np.testing.assert_allclose`` on this backend:
    those asked for on CPU, ``ACCELERATOR_FACTOR`` times them elsewhere."""
    factor = ACCELERATOR_FACTOR if on_accelerator() else 1.0
    return {"rtol": rtol * factor, "atol": atol * factor}
