"""Shared test settings.

Matmul precision: XLA:GPU runs fp32 matmuls as TF32 unless told otherwise, so every test
runs under ``jax.default_matmul_precision("highest")`` (fp32 means fp32 on every backend)
unless it says otherwise with ``@pytest.mark.precision("default")``: memory and speed
checks, which must see the executable users get. Subprocess tests pass the same choice
through ``JAX_DEFAULT_MATMUL_PRECISION`` (set here for the whole session).
"""

import os

TEST_PRECISION = "highest"
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", TEST_PRECISION)
# pytest-xdist workers share one GPU: each takes memory as it needs it, not 75% up front
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402  (after the environment: JAX reads it at import)
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def matmul_precision(request):
  """The test's matmul precision: its ``precision`` marker, else ``highest``."""
  marker = request.node.get_closest_marker("precision")
  name = marker.args[0] if marker else TEST_PRECISION
  if name == "default":
    name = None
  with jax.default_matmul_precision(name):
    yield name
