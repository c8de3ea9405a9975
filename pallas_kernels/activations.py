"""Fused ReGELU2 / ReSiLU2 kernels: one pass forward, one pass backward.

Mirrors :mod:`lowmem_jax.activations`: ``approx2_forward`` / ``approx2_backward`` take
their references' arguments (plus keyword-only ``interpret`` and ``block_elements``) and
read the thresholds and derivative levels from there (``STEPS``). Forward reads x once
and writes y and the packed 2-bit code (``ceil(n/4)`` bytes). Backward reads g and the
packed code and writes dx; the unpacked code lives only in registers, never in HBM.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from lowmem_jax.activations import STEPS, check_kind
from pallas_kernels import layout


def erfc(z):
  """erfc from exp and a rational fit, for kernels (Triton has no erf/erfc).

  The fit's own relative error is < 1.2e-7; evaluated in fp32 it is within 4e-7 of the
  true erfc for |z| <= 1 and 4e-6 in the far tail (``jax.lax.erfc`` in fp32: 6e-7 and
  4e-6), so GELU stays within 1e-6 absolute. The classical Chebyshev-fitted form
  ``t * exp(-z^2 + P(t))``, ``t = 1 / (1 + |z| / 2)``, reflected for ``z < 0``.
  """
  a = jnp.abs(z)
  t = 1.0 / (1.0 + 0.5 * a)
  poly = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (
      -0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (
          -0.82215223 + t * 0.17087277))))))))
  r = t * jnp.exp(-a * a + poly)
  return jnp.where(z >= 0, r, 2.0 - r)


def _activation(kind, xf):
  if kind == "gelu":
    return 0.5 * xf * erfc(xf * (-1.0 / math.sqrt(2.0)))
  return xf / (1.0 + jnp.exp(-xf))


def _forward_kernel(x_ref, y_ref, packed_ref, *, t, kind, thresholds):
  rows, quads, mask, byte_mask = t.tile()
  xf = plgpu.load(x_ref.at[rows, quads, :], mask=mask, other=0).astype(jnp.float32)
  plgpu.store(y_ref.at[rows, quads, :], _activation(kind, xf).astype(y_ref.dtype), mask=mask)
  c0, c1, c2 = thresholds
  code = ((xf > c0).astype(jnp.int32) + (xf > c1).astype(jnp.int32)
          + (xf > c2).astype(jnp.int32))
  code = jnp.where(mask, code, 0)
  plgpu.store(packed_ref.at[rows, quads], layout.pack_bytes(code), mask=byte_mask)


def _backward_kernel(g_ref, packed_ref, dx_ref, *, t, levels):
  rows, quads, mask, byte_mask = t.tile()
  byte = plgpu.load(packed_ref.at[rows, quads], mask=byte_mask, other=0)
  code = layout.unpack_bytes(byte)
  l0, l1, l2, l3 = levels
  d = jnp.where(code == 0, l0, jnp.where(code == 1, l1, jnp.where(code == 2, l2, l3)))
  g = plgpu.load(g_ref.at[rows, quads, :], mask=mask, other=0).astype(jnp.float32)
  plgpu.store(dx_ref.at[rows, quads, :], (g * d).astype(dx_ref.dtype), mask=mask)


@functools.partial(jax.jit, static_argnames=("kind", "interpret", "block_elements"))
def approx2_forward(kind: str, x, *, interpret: bool = False,
                    block_elements: int = layout.BLOCK_ELEMENTS):
  """``(act(x), packed codes)``: y in x's dtype (fp32 math), codes ``uint8[ceil(n/4)]``.
  Reference: ``lowmem_jax.activations.approx2_forward``."""
  check_kind(kind)
  n = x.size
  if n == 0:
    return x, jnp.zeros((0,), jnp.uint8)
  t = layout.tiling(n, block_elements, itemsize=x.dtype.itemsize, what=f"re{kind}2_forward")
  y, packed = pl.pallas_call(
      functools.partial(_forward_kernel, t=t, kind=kind, thresholds=STEPS[kind].thresholds),
      out_shape=(jax.ShapeDtypeStruct((t.rows, t.quads, 4), x.dtype),
                 jax.ShapeDtypeStruct((t.rows, t.quads), jnp.uint8)),
      grid=t.grid, interpret=interpret, compiler_params=layout.compiler_params(),
      name=f"re{kind}2_forward",
  )(layout.as_tiles(x, t))
  return layout.from_tiles(y, t, x.shape), packed.reshape(-1)


@functools.partial(jax.jit, static_argnames=("kind", "interpret", "block_elements"))
def approx2_backward(kind: str, g, packed, *, interpret: bool = False,
                     block_elements: int = layout.BLOCK_ELEMENTS):
  """``dx = g * levels[code]`` in g's dtype (fp32 math) from the packed codes.
  Reference: ``lowmem_jax.activations.approx2_backward``."""
  check_kind(kind)
  n = g.size
  if n == 0:
    return g
  t = layout.tiling(n, block_elements, itemsize=g.dtype.itemsize, what="approx2_backward")
  dx = pl.pallas_call(
      functools.partial(_backward_kernel, t=t, levels=STEPS[kind].levels),
      out_shape=jax.ShapeDtypeStruct((t.rows, t.quads, 4), g.dtype),
      grid=t.grid, interpret=interpret, compiler_params=layout.compiler_params(),
      name="approx2_backward",
  )(layout.as_tiles(g, t), packed.reshape(t.rows, t.quads))
  return layout.from_tiles(dx, t, g.shape)
