"""ReGELU2 and ReSiLU2 (Approx-BP, LowMemoryBP ICML 2024): exact forward, 2-bit backward.

The forward is the exact activation. The backward replaces its derivative by the
derivative of a surrogate ``h(x) = sum_i a_i * max(x - c_i, 0)`` (with ``sum a_i = 1``,
``sum a_i c_i = 0``), fitted to the activation by minimising the L2 distance of the
functions. That derivative is a 4-level step, so backward needs only
``flag = (x > c0) + (x > c1) + (x > c2)``: 2 bits per element, packed 4 per byte
(:mod:`lowmem_jax.packing`). Nothing else of the input's size is saved.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from lowmem_jax import dispatch
from lowmem_jax.packing import pack_2bit, unpack_2bit


@dataclasses.dataclass(frozen=True)
class StepDerivative:
  """The surrogate's derivative: ``d[flag]`` with ``d = (0, a0, a0+a1, a0+a1+a2)``."""
  name: str
  thresholds: tuple[float, float, float]  # c, ascending
  slopes: tuple[float, float, float]      # a, summing to 1

  @property
  def levels(self) -> tuple[float, float, float, float]:
    a0, a1, a2 = self.slopes
    return (0.0, a0, a0 + a1, a0 + a1 + a2)

  def code(self, x: jnp.ndarray) -> jnp.ndarray:
    """The 2-bit code ``(x > c0) + (x > c1) + (x > c2)`` as uint8, compared in fp32. A NaN
    codes as 0 (derivative 0, where the exact one is NaN): its forward output is NaN,
    so the loss, and the trainer's non-finite check, still see it."""
    xf = x.astype(jnp.float32)
    c0, c1, c2 = self.thresholds
    return ((xf > c0).astype(jnp.uint8) + (xf > c1).astype(jnp.uint8)
            + (xf > c2).astype(jnp.uint8))

  def derivative_of_code(self, code: jnp.ndarray) -> jnp.ndarray:
    """fp32 derivative level for each code."""
    return jnp.asarray(self.levels, jnp.float32)[code]

  def derivative(self, x: jnp.ndarray) -> jnp.ndarray:
    """The surrogate's derivative at ``x`` (fp32): what the backward multiplies by."""
    return self.derivative_of_code(self.code(x))

  def surrogate(self, x: jnp.ndarray) -> jnp.ndarray:
    """The piecewise-linear surrogate ``h(x)`` itself (fp32), for plots and tests."""
    xf = x.astype(jnp.float32)
    return sum(a * jnp.maximum(xf - c, 0.0) for a, c in zip(self.slopes, self.thresholds))


# Constants from the LowMemoryBP reference code (arXiv 2406.16282).
REGELU2 = StepDerivative(
    "regelu2",
    thresholds=(-3.1858810036855245, -0.001178821281161997, 3.190832613414926),
    slopes=(-0.04922261145617846, 1.0979632065417297, -0.048740595085551286),
)
RESILU2 = StepDerivative(
    "resilu2",
    thresholds=(-6.3050461001646445, -0.0008684942046214787, 6.325815242089708),
    slopes=(-0.04060357190528599, 1.080925428529668, -0.040321856624382146),
)


def _check_floating(x, name):
  if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
    raise TypeError(f"{name} expects a floating-point array, got {jnp.result_type(x)}")


def gelu(x: jnp.ndarray) -> jnp.ndarray:
  """Exact GELU ``0.5*x*(1+erf(x/sqrt(2)))`` in fp32, returned in the input dtype.

  Written as ``0.5*x*erfc(-x/sqrt(2))`` (the same function): ``1 + erf`` cancels to 0
  in the negative tail (x < -4) while ``erfc`` keeps full relative accuracy. Plain autodiff.
  """
  _check_floating(x, "gelu")
  xf = x.astype(jnp.float32)
  return (0.5 * xf * jax.lax.erfc(xf * (-1.0 / math.sqrt(2.0)))).astype(x.dtype)


def silu(x: jnp.ndarray) -> jnp.ndarray:
  """SiLU ``x * sigmoid(x)`` computed in fp32, returned in the input dtype. Plain autodiff."""
  _check_floating(x, "silu")
  xf = x.astype(jnp.float32)
  return (xf * jax.nn.sigmoid(xf)).astype(x.dtype)


EXACT = {"gelu": gelu, "silu": silu}
_TITLES = {"gelu": "GELU", "silu": "SiLU"}
STEPS = {"gelu": REGELU2, "silu": RESILU2}


def check_kind(kind: str) -> None:
  if kind not in STEPS:
    raise ValueError(f"unknown activation kind {kind!r}; valid: {', '.join(STEPS)}")


def approx2_forward(kind: str, x):
  """``(exact activation of x, its packed 2-bit code)``: the jnp reference of the fused
  forward kernel."""
  return EXACT[kind](x), pack_2bit(STEPS[kind].code(x))


def approx2_backward(kind: str, g, packed):
  """``g * d[code]`` in g's dtype (fp32 math), codes unpacked from ``packed``: the jnp
  reference of the fused backward kernel."""
  code = unpack_2bit(packed, g.shape)
  return (g.astype(jnp.float32) * STEPS[kind].derivative_of_code(code)).astype(g.dtype)


@functools.cache
def approx2_fn(kind: str, implementation: str = "xla"):
  """The approx2 activation for ``kind`` in {"gelu", "silu"}: ReGELU2 or ReSiLU2.

  A custom_vjp: exact forward; backward multiplies by the surrogate's step derivative
  read from a 2-bit code per element, saved packed 4 per byte (the only residual).
  ``implementation``: "xla" (jnp), "pallas" (fused GPU kernels) or "pallas_interpret"
  (the same kernels in interpret mode, any backend).
  """
  check_kind(kind)
  forward = dispatch.implementation_of(approx2_forward, implementation, "activation")
  backward = dispatch.implementation_of(approx2_backward, implementation, "activation")
  name = STEPS[kind].name

  @jax.custom_vjp
  def act(x):
    _check_floating(x, name)
    return forward(kind, x)[0]

  def act_fwd(x):
    _check_floating(x, name)
    # Residual: the packed code alone, ceil(n/4) bytes; shape comes back with g.
    return forward(kind, x)

  def act_bwd(packed, g):
    return (backward(kind, g, packed),)

  act.defvjp(act_fwd, act_bwd)
  act.__name__ = name
  act.__doc__ = (
      f"{name}(x): the exact {_TITLES[kind]} of a float array, in its dtype. Saves for "
      "backward only a 2-bit code per element of x, packed 4 per byte (ceil(n/4) bytes), "
      "and multiplies the gradient by the surrogate's step derivative read from it "
      f"(implementation {implementation!r}).")
  return act


regelu2 = approx2_fn("gelu", "xla")
resilu2 = approx2_fn("silu", "xla")
regelu2_derivative = REGELU2.derivative
resilu2_derivative = RESILU2.derivative
