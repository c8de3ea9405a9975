"""RoPE's application: 16-bit inputs rounded once from the exact fp32 sum (the same
value in every compiled program), fp32 as written; backward keeps nothing of x's size."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowmem_jax.memory import saved_residuals
from models import rope

SHAPE = (2, 12, 4, 16)  # [B, T, H, D]


def _inputs(dtype):
  x = jax.random.normal(jax.random.key(0), SHAPE, jnp.float32).astype(dtype)
  cos, sin = rope.rope_tables(SHAPE[1], rope.inv_frequencies(SHAPE[3], 1e4), dtype)
  return x, cos, sin


def _rotate_half(x):
  return np.concatenate([-x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]], axis=-1)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["fp16", "bf16"])
def test_16_bit_rope_is_the_exact_sum_rounded_once(dtype):
  """Both products are exact in fp32, so the result cannot depend on whether a compiler
  fuses a multiply into the add (FMA). The 16-bit formula ``x * cos + rot(x) * sin``
  missed it in 292 of these 1536 fp16 elements with per-op rounding (XLA:CPU without
  AVX512-FP16) and in 134 with XLA:CPU's fp16 FMAs, 245 in bf16; which product an FMA
  takes unrounded varies between programs, and the reversible stack's rebuild needs
  every program to agree."""
  x, cos, sin = _inputs(dtype)
  x64, cos64, sin64 = (np.asarray(a, np.float64) for a in (x, cos, sin))
  want = (x64 * cos64 + _rotate_half(x64) * sin64).astype(np.float32).astype(dtype)
  got = jax.jit(rope.apply_rope)(x, cos, sin)
  assert got.dtype == dtype
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  # inside a program that also takes its gradient (as the reversible stack's backward)
  both = jax.jit(lambda x: jax.vjp(lambda x: rope.apply_rope(x, cos, sin), x))
  out, pullback = both(x)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))


def test_fp32_rope_is_the_formula():
  x, cos, sin = _inputs(jnp.float32)
  want = x * cos + jnp.asarray(_rotate_half(np.asarray(x))) * sin
  np.testing.assert_allclose(rope.apply_rope(x, cos, sin), want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16], ids=["fp32", "fp16"])
def test_backward_keeps_nothing_of_x_size(dtype):
  x, cos, sin = _inputs(dtype)
  saved = saved_residuals(lambda x: jnp.sum(rope.apply_rope(x, cos, sin)), x)
  assert all(np.prod(r.shape) < x.size for r in saved.items), saved
