"""What some tests need from the installed jax, beyond the project's floor (jax 0.10.2).

CI runs jax 0.10.2 on Python 3.11; the GPU machines run 0.11.2 on Python 3.12, where pip
gives a fresh CPU-only machine 0.12 (0.12.0.1 on 2026-11-27: the suite passes there). Two
kinds of test depend on the version:

* bounds on XLA:CPU's compiled memory, measured with 0.10's XLA:CPU. 0.11's keeps more of
  some toy steps: lowmembp / baseline temp 0.874 on the ViT block stack (bound 0.85).
  The project's memory claims are the GPU's; these bounds guard the CPU compiler's
  figures where they were measured.
* Pallas's Triton kernels lowered for CUDA on a machine without a GPU: 0.10 lowers them
  anywhere; 0.11 asks for an attached GPU ("No supported GPU devices found").
"""

import jax
import pytest

CPU_BOUNDS_JAX = "0.10."  # the jax whose XLA:CPU the CPU compiled-memory bounds are from


def skip_unless_cpu_bounds_hold(backend: str) -> None:
  """Skips a compiled-memory bound on XLA:CPU from another jax than the one it was
  measured with (nothing to skip on a GPU)."""
  if backend == "cpu" and not jax.__version__.startswith(CPU_BOUNDS_JAX):
    pytest.skip(f"the CPU bound was measured with jax {CPU_BOUNDS_JAX}x's XLA:CPU; this is "
                f"jax {jax.__version__}")


def skip_unless_pallas_lowers_for_cuda_here() -> None:
  """Skips where jax cannot lower Pallas's Triton kernels for CUDA: jax >= 0.11 without
  an attached GPU."""
  if jax.__version_info__ >= (0, 11) and not any(d.platform == "gpu" for d in jax.devices()):
    pytest.skip(f"jax {jax.__version__} lowers Pallas's Triton kernels only with a GPU "
                "attached")
