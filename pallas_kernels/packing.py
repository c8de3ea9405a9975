"""2-bit pack / unpack as Pallas kernels, bit-identical to their references
``lowmem_jax.packing.pack_2bit`` / ``unpack_2bit`` (same names and arguments, plus
keyword-only ``interpret`` and ``block_elements``).

Layout: element ``i`` -> byte ``i >> 2``, bits ``2 * (i & 3)``; ``ceil(n / 4)`` bytes,
unused high fields zero. Tiling and 64-bit safety: :mod:`pallas_kernels.layout`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from lowmem_jax.packing import check_packed
from pallas_kernels import layout


def _pack_kernel(codes_ref, packed_ref, *, t: layout.Tiling):
  rows, quads, mask, byte_mask = t.tile()
  codes = plgpu.load(codes_ref.at[rows, quads, :], mask=mask, other=0).astype(jnp.int32)
  codes = jnp.where(mask, codes & 3, 0)  # padding and out-of-tile lanes pack as 0
  plgpu.store(packed_ref.at[rows, quads], layout.pack_bytes(codes), mask=byte_mask)


def _unpack_kernel(packed_ref, codes_ref, *, t: layout.Tiling):
  rows, quads, mask, byte_mask = t.tile()
  byte = plgpu.load(packed_ref.at[rows, quads], mask=byte_mask, other=0)
  codes = layout.unpack_bytes(byte)
  plgpu.store(codes_ref.at[rows, quads, :], codes.astype(jnp.uint8), mask=mask)


@functools.partial(jax.jit, static_argnames=("interpret", "block_elements"))
def pack_2bit(codes: jax.Array, *, interpret: bool = False,
              block_elements: int = layout.BLOCK_ELEMENTS) -> jax.Array:
  """Packs codes (any shape, values 0..3; higher bits dropped) into ``uint8[ceil(n/4)]``."""
  n = codes.size
  if n == 0:
    return jnp.zeros((0,), jnp.uint8)
  t = layout.tiling(n, block_elements, itemsize=1, what="pack_2bit")  # the uint8 codes
  packed = pl.pallas_call(
      functools.partial(_pack_kernel, t=t),
      out_shape=jax.ShapeDtypeStruct((t.rows, t.quads), jnp.uint8),
      grid=t.grid, interpret=interpret, compiler_params=layout.compiler_params(),
      name="pack_2bit",
  )(layout.as_tiles(codes.astype(jnp.uint8), t))
  return packed.reshape(-1)


@functools.partial(jax.jit, static_argnames=("shape", "interpret", "block_elements"))
def _unpack(packed, shape, interpret, block_elements):
  n = math.prod(shape)
  if n == 0:
    return jnp.zeros(shape, jnp.uint8)
  t = layout.tiling(n, block_elements, itemsize=1, what="unpack_2bit")  # the uint8 codes
  codes = pl.pallas_call(
      functools.partial(_unpack_kernel, t=t),
      out_shape=jax.ShapeDtypeStruct((t.rows, t.quads, 4), jnp.uint8),
      grid=t.grid, interpret=interpret, compiler_params=layout.compiler_params(),
      name="unpack_2bit",
  )(packed.reshape(t.rows, t.quads))  # ceil(n/4) == rows * quads
  return layout.from_tiles(codes, t, shape)


def unpack_2bit(packed: jax.Array, shape, *, interpret: bool = False,
                block_elements: int = layout.BLOCK_ELEMENTS) -> jax.Array:
  """Inverse of :func:`pack_2bit`: ``uint8[shape]`` codes in 0..3."""
  return _unpack(packed, check_packed(packed, shape), interpret, block_elements)
