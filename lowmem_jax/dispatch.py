"""Which code computes an op: its plain-jnp reference or its Pallas kernel.

An op with a kernel takes ``implementation``: "xla" runs the reference in
``lowmem_jax/<op>.py``; "pallas" runs the kernel of the same name in
``pallas_kernels/<op>.py`` (compiled, GPU only); "pallas_interpret" runs that kernel in
interpret mode (any backend: how CPU tests check it). A kernel takes its reference's
positional arguments and adds keyword-only settings (``interpret``, block sizes), so the
two read side by side. The kernel module is imported on first use: the jnp path never
imports Pallas.

A kernel is differentiated as its reference (:func:`differentiated_as`): JAX cannot
differentiate a ``pallas_call``, and second-order autodiff (``jax.grad`` of ``jax.grad``:
a Hessian-vector product) differentiates the custom_vjp rules that call the kernels, which
then gives what the jnp path gives.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

import jax
import numpy as np

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
  return differentiated_as(reference, functools.partial(
      kernel, interpret=implementation == "pallas_interpret"))


def differentiated_as(reference: Callable, kernel: Callable) -> Callable:
  """``kernel``, whose reverse-mode derivatives (any order) are ``reference``'s.

  The array arguments are the differentiable operands (integer ones get float0
  cotangents); the others (a kind, eps, a dtype) are fixed per call. Undifferentiated, only
  the kernel runs; differentiated, the kernel gives the values and the reference's VJP the
  cotangents (it recomputes the reference's forward: second-order use only, the first-order
  rules never differentiate a kernel). A custom_vjp, not a custom_jvp: JAX drops a custom
  JVP rule when it partially evaluates a scan body (the scanned block stack), so a
  Hessian-vector product must be reverse over reverse (``jax.grad`` of ``jax.grad``);
  forward mode over a kernel (``jax.jvp``, ``jax.hessian``) needs ``implementation="xla"``.
  """

  @functools.wraps(kernel)
  def op(*args):
    slots = [i for i, a in enumerate(args) if isinstance(a, (jax.Array, np.ndarray))]

    def with_arrays(arrays):
      full = list(args)
      for i, a in zip(slots, arrays):
        full[i] = a
      return full

    @jax.custom_vjp
    def run(*arrays):
      return kernel(*with_arrays(arrays))

    def run_fwd(*arrays):
      return run(*arrays), arrays

    def run_bwd(arrays, cotangents):
      return jax.vjp(lambda *a: reference(*with_arrays(a)), *arrays)[1](cotangents)

    run.defvjp(run_fwd, run_bwd)
    return run(*(args[i] for i in slots))

  return op
