"""The Pallas 2-bit pack / unpack kernels (interpret mode) against lowmem_jax.packing, bit
for bit, and the shared 2-D tiling of pallas_kernels.layout."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowmem_jax import packing as ref
from pallas_kernels import layout
from pallas_kernels import packing as pk

SIZES = (0, 1, 2, 3, 4, 5, 7, 13, 64, 1000, 1001, 4096 * 3 + 8, 70001)
SHAPES = ((2, 3), (3, 5, 7), (4, 1, 2), (2, 2, 2, 3), (1, 13), (7, 0), (0, 3), (16, 64, 3))
# Small blocks: many programs, ragged last row block, several column programs.
BLOCK_CASES = ([(n, 16) for n in (1, 5, 13, 64, 1000, 1001, 832, 2051)]
               + [(n, 64) for n in (1001, 2051, 4096 * 3 + 8)] + [(13, 4), (832, 4)])


def random_codes(shape, seed=0, high=4, dtype=np.uint8):
  return np.random.default_rng(seed).integers(0, high, size=shape).astype(dtype)


def pallas_pack(codes, block_elements=layout.BLOCK_ELEMENTS):
  return pk.pack_2bit(jnp.asarray(codes), interpret=True, block_elements=block_elements)


def pallas_unpack(packed, shape, block_elements=layout.BLOCK_ELEMENTS):
  return pk.unpack_2bit(jnp.asarray(packed), shape, interpret=True,
                        block_elements=block_elements)


def check_pack_unpack(codes, block_elements=layout.BLOCK_ELEMENTS):
  shape, n = codes.shape, codes.size
  want = np.asarray(ref.pack_2bit(jnp.asarray(codes)))
  got = pallas_pack(codes, block_elements)
  assert got.dtype == jnp.uint8 and got.shape == (math.ceil(n / 4),)
  np.testing.assert_array_equal(np.asarray(got), want)
  out = pallas_unpack(got, shape, block_elements)
  assert out.dtype == jnp.uint8 and out.shape == shape
  np.testing.assert_array_equal(np.asarray(out), np.asarray(ref.unpack_2bit(got, shape)))
  np.testing.assert_array_equal(np.asarray(out), codes & 3)


# ----------------------------------------------------------------------------- bit identity
@pytest.mark.parametrize("n", SIZES)
def test_pack_unpack_bit_identical_1d(n):
  check_pack_unpack(random_codes((n,), seed=n))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_pack_unpack_bit_identical_multi_dim(shape):
  check_pack_unpack(random_codes(shape, seed=len(shape)))


@pytest.mark.parametrize("n,block_elements", BLOCK_CASES)
def test_small_blocks(n, block_elements):
  t = layout.tiling(n, block_elements)
  assert t.grid[0] * t.grid[1] > 1 or n <= block_elements
  check_pack_unpack(random_codes((n,), seed=n + block_elements), block_elements)


def test_small_blocks_cover_both_grid_dims_and_ragged_rows():
  """The cases above really exercise several column programs and a ragged last row tile."""
  tilings = [layout.tiling(n, b) for n, b in BLOCK_CASES]
  assert any(t.grid[0] > 1 and t.grid[1] > 1 for t in tilings)
  assert any(t.grid[0] > 1 and t.rows % t.block_rows for t in tilings)
  assert any(t.padded != t.n and t.grid[0] > 1 for t in tilings)


@pytest.mark.parametrize("n", [1, 3, 13, 1001])
def test_high_bits_are_dropped(n):
  """Codes above 3 keep only their low two bits, as in the reference."""
  check_pack_unpack(random_codes((n,), seed=n, high=256), block_elements=16)


def test_other_integer_dtypes():
  codes = np.random.default_rng(3).integers(-8, 8, size=(5, 7)).astype(np.int32)
  want = np.asarray(ref.pack_2bit(jnp.asarray(codes)))
  np.testing.assert_array_equal(np.asarray(pallas_pack(codes, 16)), want)


@pytest.mark.parametrize("n,block_elements", [(1, 16), (5, 16), (1001, 64), (4096 * 3 + 8, 8192)])
def test_unpack_arbitrary_bytes(n, block_elements):
  """Any byte string (including non-zero unused high fields) unpacks as the reference."""
  packed = jnp.asarray(random_codes((math.ceil(n / 4),), seed=n, high=256))
  got = pallas_unpack(packed, (n,), block_elements)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(ref.unpack_2bit(packed, (n,))))


def test_unused_high_fields_are_zero():
  codes = np.full((5,), 3, np.uint8)
  np.testing.assert_array_equal(np.asarray(pallas_pack(codes, 16)), [0xFF, 0x03])


def test_pack_under_jit_and_grad_free_composition():
  codes = jnp.asarray(random_codes((3, 11), seed=5))
  f = jax.jit(lambda c: pk.unpack_2bit(pk.pack_2bit(c, interpret=True, block_elements=16),
                                       (3, 11), interpret=True, block_elements=16))
  np.testing.assert_array_equal(np.asarray(f(codes)), np.asarray(codes))


# ----------------------------------------------------------------------------- tiling
@pytest.mark.parametrize("block_elements", [4, 8, 16, 64, 1024, layout.BLOCK_ELEMENTS])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 13, 64, 100, 1000, 1001, 4096, 4100,
                               4096 * 3 + 8, 8192 * 5, 70001, 2 ** 20 + 3])
def test_tiling_invariants(n, block_elements):
  t = layout.tiling(n, block_elements)
  padded = math.ceil(n / 4) * 4
  width = t.quads * 4
  pow2 = lambda v: v >= 1 and v & (v - 1) == 0
  assert t.n == n
  assert t.rows * t.quads * 4 == t.padded == padded
  assert t.rows * t.quads == math.ceil(n / 4)
  assert pow2(width) and padded % width == 0 and width <= layout.MAX_WIDTH
  # The largest such width.
  assert width == layout.MAX_WIDTH or padded % (2 * width) != 0
  assert pow2(t.block_rows) and pow2(t.block_quads)
  assert t.block_rows * t.block_quads * 4 == block_elements
  assert t.quads % t.block_quads == 0
  assert t.grid == (math.ceil(t.rows / t.block_rows), math.ceil(t.quads / t.block_quads))


@pytest.mark.parametrize("block_elements", [0, 1, 2, 3, 6, 12, 100, 8191])
def test_tiling_rejects_bad_block_elements(block_elements):
  with pytest.raises(ValueError, match="power of two"):
    layout.tiling(100, block_elements)


def test_pack_rejects_bad_block_elements():
  with pytest.raises(ValueError, match="power of two"):
    pk.pack_2bit(jnp.zeros((10,), jnp.uint8), interpret=True, block_elements=24)


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("nbytes,shape", [(3, (13,)), (5, (13,)), (0, (1,)), (1, (0,)),
                                          (5, (3, 5))])
def test_unpack_wrong_byte_count(nbytes, shape):
  with pytest.raises(ValueError, match="bytes"):
    pk.unpack_2bit(jnp.zeros((nbytes,), jnp.uint8), shape, interpret=True)


@pytest.mark.parametrize("packed", [jnp.zeros((4,), jnp.int32), jnp.zeros((4,), jnp.int8),
                                    jnp.zeros((4,), jnp.float32), jnp.zeros((2, 2), jnp.uint8)],
                         ids=["int32", "int8", "float32", "2d"])
def test_unpack_wrong_dtype_or_rank(packed):
  with pytest.raises(ValueError, match="1-D uint8"):
    pk.unpack_2bit(packed, (13,), interpret=True)


def test_one_byte_arrays_past_int32_offsets_are_refused():
  """Pallas's Triton lowering forms offsets in 32 bits for an array of at most 4 GiB: the
  uint8 codes of 2**31 < n <= 2**32 elements (and an fp8 activation input) are refused
  while tracing, as the Mesa kernels' are (before: accepted, the docstring said safe);
  16-bit inputs of that many elements pass 4 GiB and are not."""
  from pallas_kernels import activations as pa
  big = 2 ** 31 + 4
  codes = jax.ShapeDtypeStruct((big,), jnp.uint8)
  with pytest.raises(ValueError, match=r"pack_2bit: 2147483652 elements of 1 byte\(s\) get "
                                       "32-bit offsets past int32"):
    jax.eval_shape(lambda c: pk.pack_2bit(c, interpret=True), codes)
  with pytest.raises(ValueError, match="unpack_2bit: .* 32-bit offsets"):
    jax.eval_shape(lambda p: pk.unpack_2bit(p, (big,), interpret=True),
                   jax.ShapeDtypeStruct((big // 4,), jnp.uint8))
  with pytest.raises(ValueError, match="regelu2_forward: .* 32-bit offsets"):
    jax.eval_shape(lambda x: pa.approx2_forward("gelu", x, interpret=True),
                   jax.ShapeDtypeStruct((big,), jnp.float8_e4m3fn))
  y, packed = jax.eval_shape(lambda x: pa.approx2_forward("gelu", x, interpret=True),
                             jax.ShapeDtypeStruct((big,), jnp.bfloat16))
  assert y.shape == (big,) and packed.shape == (big // 4,)
  assert jax.eval_shape(lambda c: pk.pack_2bit(c, interpret=True),
                        jax.ShapeDtypeStruct((2 ** 31,), jnp.uint8)).shape == (2 ** 29,)
