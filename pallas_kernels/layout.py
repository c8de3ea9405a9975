"""The 2-D tiling every elementwise kernel here shares, and its launch settings.

A flat array of ``n`` elements is viewed, for free, as ``[rows, quads, 4]`` with
``quads * 4 = width``, the largest power of two up to ``MAX_WIDTH`` dividing ``n``:
element ``i`` sits at ``(i // width, (i % width) // 4, i % 4)`` and its 2-bit code goes
to byte ``(i // width, (i % width) // 4)`` of a ``[rows, quads]`` uint8 array, which is
the packed layout (byte ``i >> 2``, bits ``2 * (i & 3)``) read row-major. A program
handles a ``[block_rows, block_quads, 4]`` tile; row and column starts stay far below
2**31. The Triton lowering forms element offsets in 64 bits only for an array past
4 GiB: an array of 2**31 to 2**32 one-byte elements (the uint8 codes that ``pack_2bit``
reads and ``unpack_2bit`` writes, an fp8 input) would get them in 32 bits, past int32,
and is refused (:func:`tiling`'s ``itemsize``). Sizes not divisible by 4
are padded by at most 3 elements (one copy; such tensors are small in practice).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

MAX_WIDTH = 4096          # elements per row of the 2-D view
BLOCK_ELEMENTS = 8192     # elements per program (a power of two)


@dataclasses.dataclass(frozen=True)
class Tiling:
  n: int          # real elements
  rows: int
  quads: int      # bytes per row = width / 4
  block_rows: int
  block_quads: int

  @property
  def padded(self) -> int:
    return self.rows * self.quads * 4

  @property
  def grid(self) -> tuple[int, int]:
    return (pl.cdiv(self.rows, self.block_rows), pl.cdiv(self.quads, self.block_quads))

  def tile(self):
    """Inside a kernel: the tile's row slice, quad slice, ``[R, Q, 4]`` mask of the real
    elements (inside the array, not the padding after element ``n - 1``) and ``[R, Q]``
    mask of the bytes inside the array."""
    i, j = pl.program_id(0), pl.program_id(1)
    rows = i * self.block_rows + jnp.arange(self.block_rows)
    quads = j * self.block_quads + jnp.arange(self.block_quads)
    byte_mask = (rows < self.rows)[:, None] & (quads < self.quads)[None, :]
    mask = byte_mask[..., None]
    if self.padded != self.n:  # padding sits in the last byte: lanes >= n % 4
      last = (rows == self.rows - 1)[:, None, None] & (quads == self.quads - 1)[None, :, None]
      lane = jnp.arange(4)[None, None, :]
      mask = mask & ~(last & (lane >= self.n % 4))
    return (pl.ds(i * self.block_rows, self.block_rows),
            pl.ds(j * self.block_quads, self.block_quads), mask, byte_mask)


def check_offsets(n: int, itemsize: int, what: str) -> None:
  """A ValueError for an array of ``n`` elements of ``itemsize`` bytes whose offsets the
  Pallas Triton lowering would form in 32 bits past int32 (at most 4 GiB, more than
  2**31 elements)."""
  if 2 ** 31 < n and n * itemsize <= 2 ** 32:
    raise ValueError(f"{what}: {n} elements of {itemsize} byte(s) get 32-bit offsets past "
                     "int32 in the Pallas Triton lowering; use the jnp path "
                     "(implementation='xla') for this size")


def tiling(n: int, block_elements: int = BLOCK_ELEMENTS, *, itemsize: int = 1,
           what: str = "kernel") -> Tiling:
  """The ``[rows, quads, 4]`` view of ``n`` elements (padded up to a multiple of 4);
  ``itemsize``: the smallest element, in bytes, of an ``n``-element array the kernel
  reads or writes (a ValueError where its offsets would pass int32 in 32 bits)."""
  if block_elements < 4 or block_elements & (block_elements - 1):
    raise ValueError(f"block_elements must be a power of two >= 4, got {block_elements}")
  check_offsets(n, itemsize, what)
  padded = -(-n // 4) * 4
  width = 4
  while width < MAX_WIDTH and padded % (2 * width) == 0:
    width *= 2
  quads = width // 4
  block_quads = min(pl.next_power_of_2(quads), block_elements // 4)
  block_rows = max(1, block_elements // (4 * block_quads))
  return Tiling(n=n, rows=padded // width, quads=quads,
                block_rows=block_rows, block_quads=block_quads)


def as_tiles(x: jax.Array, t: Tiling) -> jax.Array:
  """Flat view of ``x`` as ``[rows, quads, 4]`` (pads only when ``n % 4 != 0``)."""
  flat = jnp.ravel(x)
  if t.padded != t.n:
    flat = jnp.pad(flat, (0, t.padded - t.n))
  return flat.reshape(t.rows, t.quads, 4)


def from_tiles(tiles: jax.Array, t: Tiling, shape) -> jax.Array:
  flat = tiles.reshape(-1)
  if t.padded != t.n:
    flat = flat[:t.n]
  return flat.reshape(shape)


def _shifts():
  """``[1, 1, 4]`` bit offsets 0, 2, 4, 6 of the four codes in a byte (int32), as
  ``lowmem_jax.packing``."""
  return (2 * jnp.arange(4, dtype=jnp.int32))[None, None, :]


def pack_bytes(codes):
  """Inside a kernel: int32 codes ``[R, Q, 4]`` in 0..3 -> their ``[R, Q]`` uint8 bytes."""
  return jnp.sum(codes << _shifts(), axis=-1).astype(jnp.uint8)


def unpack_bytes(byte):
  """Inside a kernel: ``[R, Q]`` bytes -> their int32 codes ``[R, Q, 4]`` in 0..3."""
  return (byte.astype(jnp.int32)[..., None] >> _shifts()) & 3


def compiler_params(num_warps: int = 4, num_stages: int = 1):
  """Triton launch settings (ignored in interpret mode)."""
  from jax.experimental.pallas import triton as plgpu
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
