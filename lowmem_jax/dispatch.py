"""Which code computes an op: its plain-jnp reference or its Pallas kernel.

An op with a kernel takes ``implementation``: "xla" runs the reference in
``lowmem_jax/<op>.py``; "pallas" runs the kernel of the same name in
``pallas_kernels/<op>.py`` (compiled, GPU only); "pallas_interpret" runs that kernel in
interpret mode (any backend: how CPU tests check it). A kernel takes its reference's
positional arguments and adds keyword-only settings (``interpret``, block sizes), so the
two read side by side. The kernel module is imported on first use: the jnp path never
imports Pallas.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

IMPLEMENTATIONS = ("xla", "pallas", "pallas_interpret")


def check_implementation(implementation: str, what: str) -> None:
  """Raises a one-line error naming ``what`` (e.g. "norm") for an unknown implementation."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"unknown {what} implementation {implementation!r}; valid: "
                     f"{', '.join(IMPLEMENTATIONS)}")


def implementation_of(reference: Callable, implementation: str, what: str) -> Callable:
  """``reference`` itself for "xla"; else its kernel, with ``interpret`` bound: the function
  named like ``reference`` (less a ``_reference`` suffix) in ``pallas_kernels.<op>``, where
  ``lowmem_jax.<op>`` is the reference's module."""
  check_implementation(implementation, what)
  if implementation == "xla":
    return reference
  op = reference.__module__.rsplit(".", 1)[-1]
  kernels = importlib.import_module(f"pallas_kernels.{op}")
  kernel = getattr(kernels, reference.__name__.removesuffix("_reference"))
  return functools.partial(kernel, interpret=implementation == "pallas_interpret")
