"""2-bit packing of codes in {0, 1, 2, 3}, four per byte.

Layout (fixed; the Pallas kernels must match it bit for bit): element ``i`` of the
flattened array goes to byte ``i >> 2``, bits ``2*(i & 3)`` and ``2*(i & 3) + 1``
(little-endian fields). ``n`` codes take ``ceil(n / 4)`` bytes; the unused high
fields of the last byte are zero.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax.numpy as jnp

_SHIFTS = (0, 2, 4, 6)


def packed_size(n: int) -> int:
  """Number of bytes that hold ``n`` 2-bit codes."""
  return -(-n // 4)


def pack_2bit(codes: jnp.ndarray) -> jnp.ndarray:
  """Packs codes (any shape, values in 0..3) into ``uint8[ceil(n/4)]``.

  Values outside 0..3 are an error of the caller; only their low two bits are kept.
  """
  flat = jnp.ravel(codes).astype(jnp.uint8) & 3
  n = flat.shape[0]
  pad = packed_size(n) * 4 - n
  if pad:
    flat = jnp.pad(flat, (0, pad))
  quads = flat.reshape(-1, 4)
  return (quads[:, 0]
          | (quads[:, 1] << 2)
          | (quads[:, 2] << 4)
          | (quads[:, 3] << 6)).astype(jnp.uint8)


def check_packed(packed, shape: Sequence[int]) -> tuple[int, ...]:
  """``shape`` as a tuple of ints, once ``packed`` is a 1-D uint8 array of exactly the
  bytes that hold it; a one-line error otherwise."""
  shape = tuple(int(d) for d in shape)
  n = math.prod(shape)
  if packed.ndim != 1 or packed.dtype != jnp.uint8:
    raise ValueError(
        f"unpack_2bit expects a 1-D uint8 array, got {packed.dtype}{list(packed.shape)}")
  if packed.shape[0] != packed_size(n):
    raise ValueError(
        f"unpack_2bit: {packed.shape[0]} bytes cannot hold shape {shape} "
        f"({n} codes need {packed_size(n)} bytes)")
  return shape


def unpack_2bit(packed: jnp.ndarray, shape: Sequence[int]) -> jnp.ndarray:
  """Inverse of :func:`pack_2bit`: returns ``uint8[shape]`` codes in 0..3."""
  shape = check_packed(packed, shape)
  shifts = jnp.asarray(_SHIFTS, dtype=jnp.uint8)
  codes = (packed[:, None] >> shifts[None, :]) & 3
  return codes.reshape(-1)[:math.prod(shape)].reshape(shape)
