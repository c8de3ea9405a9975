"""Tests for lowmem_jax.packing: 2-bit codes, four per byte, fixed little-endian layout."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowmem_jax.packing import pack_2bit, packed_size, unpack_2bit

SIZES = (0, 1, 2, 3, 4, 5, 7, 8, 13, 1000, 1001)
SHAPES = ((), (0,), (0, 3), (2, 3), (3, 5, 7), (4, 1, 2), (2, 2, 2, 3), (1, 13))


def ref_pack(codes) -> np.ndarray:
  """Independent reference: element i -> byte i >> 2, bits 2*(i & 3) and 2*(i & 3) + 1."""
  flat = np.asarray(codes).reshape(-1).astype(np.int64)
  out = np.zeros(-(-flat.size // 4), dtype=np.uint8)
  for i, c in enumerate(flat):
    out[i >> 2] |= np.uint8((int(c) & 3) << (2 * (i & 3)))
  return out


def random_codes(shape, seed=0, dtype=np.uint8):
  return np.random.default_rng(seed).integers(0, 4, size=shape).astype(dtype)


@pytest.mark.parametrize("n", SIZES)
def test_packed_size(n):
  assert packed_size(n) == math.ceil(n / 4)


@pytest.mark.parametrize("n", SIZES)
def test_round_trip_1d(n):
  codes = random_codes((n,), seed=n)
  packed = pack_2bit(jnp.asarray(codes))
  assert packed.dtype == jnp.uint8
  assert packed.shape == (math.ceil(n / 4),)
  out = unpack_2bit(packed, (n,))
  assert out.dtype == jnp.uint8
  assert out.shape == (n,)
  np.testing.assert_array_equal(np.asarray(out), codes)


@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip_multi_dim(shape):
  codes = random_codes(shape, seed=len(shape))
  packed = pack_2bit(jnp.asarray(codes))
  assert packed.shape == (math.ceil(codes.size / 4),)
  out = unpack_2bit(packed, shape)
  assert out.shape == tuple(shape)
  np.testing.assert_array_equal(np.asarray(out), codes)


@pytest.mark.parametrize("n", SIZES)
def test_bit_layout_matches_reference(n):
  codes = random_codes((n,), seed=100 + n)
  np.testing.assert_array_equal(np.asarray(pack_2bit(jnp.asarray(codes))), ref_pack(codes))


@pytest.mark.parametrize("shape", [(2, 3), (3, 5, 7), (4, 1, 2)])
def test_bit_layout_multi_dim_is_row_major(shape):
  codes = random_codes(shape, seed=7)
  np.testing.assert_array_equal(np.asarray(pack_2bit(jnp.asarray(codes))),
                                ref_pack(codes.reshape(-1)))


def test_bit_layout_hand_computed():
  # Codes 0,1,2,3 -> 0b11_10_01_00 = 0xE4; then 3 alone -> 0x03; 1,0,2 -> 0b10_00_01 = 0x21.
  np.testing.assert_array_equal(
      np.asarray(pack_2bit(jnp.array([0, 1, 2, 3, 3], jnp.uint8))), [0xE4, 0x03])
  np.testing.assert_array_equal(
      np.asarray(pack_2bit(jnp.array([1, 0, 2], jnp.uint8))), [0x21])
  # Each position alone, code 3: the field moves by two bits.
  for pos in range(4):
    codes = np.zeros(4, np.uint8)
    codes[pos] = 3
    assert int(pack_2bit(jnp.asarray(codes))[0]) == 3 << (2 * pos)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 7, 13, 1001])
def test_unused_high_fields_of_last_byte_are_zero(n):
  codes = np.full((n,), 3, np.uint8)  # every used field all ones
  packed = np.asarray(pack_2bit(jnp.asarray(codes)))
  used = n - 4 * (packed.size - 1)  # fields used in the last byte, 1..4
  assert packed[-1] == (1 << (2 * used)) - 1
  if packed.size > 1:
    assert np.all(packed[:-1] == 0xFF)


@pytest.mark.parametrize("dtype", [np.uint8, np.int32, np.int8, np.uint32])
def test_pack_accepts_integer_dtypes(dtype):
  codes = random_codes((11,), seed=3, dtype=dtype)
  np.testing.assert_array_equal(np.asarray(pack_2bit(jnp.asarray(codes))), ref_pack(codes))


def test_pack_keeps_only_low_two_bits():
  values = np.arange(256, dtype=np.uint8)
  np.testing.assert_array_equal(np.asarray(pack_2bit(jnp.asarray(values))),
                                np.asarray(pack_2bit(jnp.asarray(values & 3))))


def test_all_code_values_in_every_position():
  # All 256 byte patterns: unpack(byte) -> 4 codes -> pack gives the byte back.
  packed = jnp.arange(256, dtype=jnp.uint8)
  codes = unpack_2bit(packed, (256 * 4,))
  expected = np.array([(b >> (2 * k)) & 3 for b in range(256) for k in range(4)], np.uint8)
  np.testing.assert_array_equal(np.asarray(codes), expected)
  np.testing.assert_array_equal(np.asarray(pack_2bit(codes)), np.arange(256, dtype=np.uint8))


@pytest.mark.parametrize("shape", [(13,), (3, 5), (2, 2, 3)])
def test_under_jit(shape):
  codes = random_codes(shape, seed=11)
  packed = jax.jit(pack_2bit)(jnp.asarray(codes))
  np.testing.assert_array_equal(np.asarray(packed), ref_pack(codes))
  out = jax.jit(unpack_2bit, static_argnums=1)(packed, shape)
  np.testing.assert_array_equal(np.asarray(out), codes)
  # A closure with the shape baked in works too.
  out2 = jax.jit(lambda p: unpack_2bit(p, shape))(packed)
  np.testing.assert_array_equal(np.asarray(out2), codes)


@pytest.mark.parametrize("n", [1, 4, 7, 13])
def test_under_vmap(n):
  batch = random_codes((5, n), seed=n)
  packed = jax.vmap(pack_2bit)(jnp.asarray(batch))
  assert packed.shape == (5, math.ceil(n / 4))
  np.testing.assert_array_equal(np.asarray(packed), np.stack([ref_pack(r) for r in batch]))
  out = jax.vmap(lambda p: unpack_2bit(p, (n,)))(packed)
  np.testing.assert_array_equal(np.asarray(out), batch)


def test_under_jit_of_vmap():
  batch = random_codes((3, 2, 5), seed=5)
  f = jax.jit(jax.vmap(lambda c: unpack_2bit(pack_2bit(c), c.shape)))
  np.testing.assert_array_equal(np.asarray(f(jnp.asarray(batch))), batch)


@pytest.mark.parametrize("nbytes,shape", [(3, (13,)), (5, (13,)), (0, (1,)), (1, (0,)),
                                          (2, (3, 3)), (1, (5,))])
def test_unpack_wrong_byte_count_raises(nbytes, shape):
  with pytest.raises(ValueError, match="bytes"):
    unpack_2bit(jnp.zeros((nbytes,), jnp.uint8), shape)


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.int32, jnp.uint16, jnp.uint32, jnp.float32])
def test_unpack_wrong_dtype_raises(dtype):
  with pytest.raises(ValueError, match="uint8"):
    unpack_2bit(jnp.zeros((4,), dtype), (13,))


@pytest.mark.parametrize("shape", [(2, 2), (4, 1), ()])
def test_unpack_non_1d_raises(shape):
  with pytest.raises(ValueError, match="1-D"):
    unpack_2bit(jnp.zeros(shape, jnp.uint8), (4,))
