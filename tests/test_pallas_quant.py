"""The Mesa 8-bit Pallas kernels (interpret mode; compiled on GPU) against the jnp
reference of lowmem_jax.quant: the same codes bit for bit, the same dequantized values
exactly, for every shape, group count, block size and float dtype."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowmem_jax import quant
from pallas_kernels import quant as pq
from jax_versions import skip_unless_pallas_lowers_for_cuda_here

ON_GPU = jax.default_backend() == "gpu"
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# [O, G, I] views: ragged outer and inner sizes, one and several groups, a single element.
SHAPES = ((1, 1, 1), (3, 4, 37), (1, 1, 1000), (7, 3, 1), (2, 12, 64))
# Small blocks: many programs along O and I, ragged last tiles in both.
BLOCK_CASES = (((5, 2, 13), 4, 16), ((33, 1, 5), 4, 8), ((3, 4, 37), 8, 8),
               ((1, 1, 1000), 64, 64), ((9, 3, 100), 32, 128))


def case(shape, seed=0, dtype=jnp.float32):
  """Values in (and a little outside) a per-group range, that range, and a seed."""
  rng = np.random.default_rng(seed)
  g = shape[1]
  lo = rng.uniform(-3.0, -0.5, g).astype(np.float32)
  hi = rng.uniform(0.5, 3.0, g).astype(np.float32)
  x = rng.uniform(-1.2, 1.2, shape) * (hi - lo)[None, :, None] / 2 + (hi + lo)[None, :, None] / 2
  return (jnp.asarray(x.astype(np.float32)).astype(dtype), jnp.asarray(lo), jnp.asarray(hi),
          jnp.uint32(rng.integers(0, 2 ** 32)))


ref_quantize = jax.jit(quant.quantize_reference)
ref_dequantize = jax.jit(quant.dequantize_reference, static_argnums=3)


def bits(a):
  """The raw bits of an array (exact comparison of floats, NaN included)."""
  a = np.asarray(a)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def check(shape, dtype="float32", seed=0, interpret=True, **blocks):
  x, lo, hi, s = case(shape, seed, DTYPES[dtype])
  codes = pq.quantize(x, lo, hi, s, interpret=interpret, **blocks)
  assert codes.dtype == jnp.uint8 and codes.shape == shape
  np.testing.assert_array_equal(np.asarray(codes), np.asarray(ref_quantize(x, lo, hi, s)))
  values = pq.dequantize(codes, lo, hi, x.dtype, interpret=interpret, **blocks)
  assert values.dtype == x.dtype and values.shape == shape
  np.testing.assert_array_equal(bits(values), bits(ref_dequantize(codes, lo, hi, x.dtype)))
  return codes


# ----------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernels_fp32(shape):
  check(shape, "float32", seed=sum(shape))


@pytest.mark.parametrize("dtype,shape", [("bfloat16", (3, 4, 37)), ("bfloat16", (2, 12, 64)),
                                         ("float16", (5, 2, 13))], ids=str)
def test_kernels_16_bit(dtype, shape):
  check(shape, dtype, seed=len(dtype))


@pytest.mark.parametrize("shape,block_inner,block_elements", BLOCK_CASES, ids=str)
def test_kernels_small_blocks(shape, block_inner, block_elements):
  bo, bi = pq._blocks(shape[0], shape[2], block_inner, block_elements)
  grid = pq._grid(shape, bo, bi)
  assert math.prod(grid) > shape[1]  # several programs per group
  check(shape, "float32", seed=3, block_inner=block_inner, block_elements=block_elements)


def test_small_blocks_cover_ragged_tiles_in_both_dims():
  tiles = [(s, pq._blocks(s[0], s[2], b, e)) for s, b, e in BLOCK_CASES]
  assert any(s[0] % bo and pq._grid(s, bo, bi)[0] > 1 for s, (bo, bi) in tiles)
  assert any(s[2] % bi and pq._grid(s, bo, bi)[2] > 1 for s, (bo, bi) in tiles)


def test_all_codes_and_clamping():
  """A ramp across and beyond the range: every code 0..255 appears, values past either
  end clamp to 0 / 255, non-finite inputs as the reference (NaN -> 0)."""
  ramp = np.linspace(-2.0, 2.0, 4096, dtype=np.float32)
  special = np.asarray([np.inf, -np.inf, np.nan, 1e30, -1e30, -1.0, 1.0], np.float32)
  x = jnp.asarray(np.concatenate([ramp, special]).reshape(1, 1, -1))
  lo, hi = jnp.asarray([-1.0], jnp.float32), jnp.asarray([1.0], jnp.float32)
  for seed in (0, 7):
    codes = pq.quantize(x, lo, hi, jnp.uint32(seed), interpret=True)
    np.testing.assert_array_equal(np.asarray(codes), np.asarray(ref_quantize(x, lo, hi,
                                                                             jnp.uint32(seed))))
    c = np.asarray(codes).reshape(-1)
    assert set(np.unique(c[:4096])) == set(range(256))
    np.testing.assert_array_equal(c[4096:4101], [255, 0, 0, 255, 0])


def test_flat_range_gives_code_zero_and_value_lo():
  x = jnp.full((2, 2, 5), 0.25, jnp.float32)
  lo = hi = jnp.asarray([0.25, 0.25], jnp.float32)
  codes = pq.quantize(x, lo, hi, jnp.uint32(1), interpret=True)
  np.testing.assert_array_equal(np.asarray(codes),
                                np.asarray(ref_quantize(x, lo, hi, jnp.uint32(1))))
  assert not np.asarray(codes).any()
  np.testing.assert_array_equal(np.asarray(pq.dequantize(codes, lo, hi, jnp.float32,
                                                         interpret=True)), np.asarray(x))


def test_dequantize_every_code_and_dtype():
  codes = jnp.asarray(np.arange(256, dtype=np.uint8).reshape(4, 2, 32))
  lo = jnp.asarray([-1.5, 0.1], jnp.float32)
  hi = jnp.asarray([2.0, 0.7], jnp.float32)
  for dtype in DTYPES.values():
    np.testing.assert_array_equal(
        bits(pq.dequantize(codes, lo, hi, dtype, interpret=True, block_elements=16)),
        bits(ref_dequantize(codes, lo, hi, dtype)))


@pytest.mark.parametrize("shape", [(0, 3, 5), (2, 3, 0), (0, 1, 0)], ids=str)
def test_empty(shape):
  lo = hi = jnp.zeros((shape[1],), jnp.float32)
  codes = pq.quantize(jnp.zeros(shape, jnp.bfloat16), lo, hi, jnp.uint32(0), interpret=True)
  assert codes.shape == shape and codes.dtype == jnp.uint8
  values = pq.dequantize(codes, lo, hi, jnp.bfloat16, interpret=True)
  assert values.shape == shape and values.dtype == jnp.bfloat16


def test_seed_forms_and_jit():
  x, lo, hi, _ = case((3, 2, 9), 5)
  want = np.asarray(ref_quantize(x, lo, hi, jnp.uint32(2 ** 32 - 5)))
  for seed in (jnp.uint32(2 ** 32 - 5), jnp.asarray([2 ** 32 - 5], jnp.uint32), jnp.int32(-5)):
    np.testing.assert_array_equal(np.asarray(pq.quantize(x, lo, hi, seed, interpret=True)),
                                  want)
  f = jax.jit(lambda x, s: pq.dequantize(pq.quantize(x, lo, hi, s, interpret=True), lo, hi,
                                         jnp.float32, interpret=True))
  np.testing.assert_array_equal(
      bits(f(x, jnp.uint32(9))),
      bits(ref_dequantize(ref_quantize(x, lo, hi, jnp.uint32(9)), lo, hi, jnp.float32)))


# ----------------------------------------------------------------------------- dispatch
@pytest.mark.parametrize("shape,axis,groups,dtype", [((2, 5, 4, 8), 2, 4, "float32"),
                                                     ((3, 7, 12), -1, 3, "bfloat16"),
                                                     ((6, 10), 0, 2, "float32")], ids=str)
def test_lowmem_quant_dispatch_matches_xla(shape, axis, groups, dtype):
  rng = np.random.default_rng(len(shape))
  x = jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(DTYPES[dtype])
  lo, hi = quant.batch_range(x, axis=axis, groups=groups)
  seed = jnp.uint32(77)
  run = functools.partial(quant.quantize, x, lo, hi, seed, axis=axis, groups=groups)
  codes = run(implementation="pallas_interpret")
  np.testing.assert_array_equal(np.asarray(codes), np.asarray(run(implementation="xla")))
  deq = functools.partial(quant.dequantize, codes, lo, hi, x.dtype, axis=axis, groups=groups)
  np.testing.assert_array_equal(bits(deq(implementation="pallas_interpret")),
                                bits(deq(implementation="xla")))


def test_int8_linear_through_pallas_interpret_matches_xla():
  """A whole coded_vjp step (codes, EMA range, backward at the dequantized input)."""
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((4, 6, 16)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)

  def loss(x, w, implementation):
    qt, _ = quant.quantize_tensor(x, quant.QuantState.create(4), axis=-1, groups=4,
                                  implementation=implementation)
    return jnp.sum(quant.coded_vjp(jnp.matmul, [qt], (w,)) ** 2)

  grads = {impl: jax.jit(jax.grad(loss, (0, 1)), static_argnums=2)(x, w, impl)
           for impl in ("xla", "pallas_interpret")}
  for a, b in zip(grads["xla"], grads["pallas_interpret"]):
    np.testing.assert_array_equal(bits(a), bits(b))


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_coded_ms_norm_runs_the_norm_kernels_too(kind):
  """quant.ms_norm_coded (the MS norm of lowmembp+mesa8) under pallas_interpret runs the
  norm kernels, not only the quantize ones (before: the jnp norm, whatever the policy's
  kernels said), with the xla path's values and gradients."""
  import re
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((3, 5, 24)), jnp.float32)

  def loss(x, implementation):
    qt, _ = quant.ms_norm_coded(kind, x, 1e-6, quant.QuantState.create(2), groups=2,
                                implementation=implementation)
    return jnp.sum(jnp.sin(qt.value) * jnp.arange(24.0))

  jaxpr = str(jax.make_jaxpr(jax.grad(loss), static_argnums=1)(x, "pallas_interpret"))
  assert {f"ms_{kind}_norm_forward", f"ms_{kind}_norm_backward", "mesa_quantize",
          "mesa_dequantize"} <= set(re.findall(r"name=(\w+)", jaxpr))
  with jax.default_matmul_precision("highest"):
    values = {impl: jax.jit(jax.value_and_grad(loss), static_argnums=1)(x, impl)
              for impl in ("xla", "pallas_interpret")}
  np.testing.assert_allclose(float(values["pallas_interpret"][0]), float(values["xla"][0]),
                             rtol=1e-6)
  np.testing.assert_allclose(np.asarray(values["pallas_interpret"][1]),
                             np.asarray(values["xla"][1]), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- errors
def test_bad_arguments():
  x, lo, hi, s = case((2, 3, 4))
  with pytest.raises(ValueError, match="power of two"):
    pq.quantize(x, lo, hi, s, interpret=True, block_inner=24)
  with pytest.raises(ValueError, match="power of two"):
    pq.dequantize(jnp.zeros((2, 3, 4), jnp.uint8), lo, hi, jnp.float32, interpret=True,
                  block_elements=100)
  with pytest.raises(ValueError, match=r"one range per group"):
    pq.quantize(x, lo[:2], hi[:2], s, interpret=True)
  with pytest.raises(ValueError, match=r"float \[O, G, I\]"):
    pq.quantize(x.reshape(6, 4), lo, hi, s, interpret=True)
  with pytest.raises(ValueError, match=r"uint8 \[O, G, I\]"):
    pq.dequantize(jnp.zeros((2, 3, 4), jnp.int32), lo, hi, jnp.float32, interpret=True)
  with pytest.raises(ValueError, match="must be floating"):
    pq.dequantize(jnp.zeros((2, 3, 4), jnp.uint8), lo, hi, jnp.int32, interpret=True)


def test_sizes_past_int32_indexing_are_refused():
  """2**31 < n <= 2**32 uint8 elements would get 32-bit offsets, and tile coordinates
  are int32: clear errors, found while tracing (nothing is allocated)."""
  lo = hi = jax.ShapeDtypeStruct((1,), jnp.float32)
  two = jax.ShapeDtypeStruct((2,), jnp.float32)

  def quantize(shape, lo=lo, hi=hi):
    return jax.eval_shape(lambda x, lo, hi: pq.quantize(x, lo, hi, 0, interpret=True),
                          jax.ShapeDtypeStruct(shape, jnp.bfloat16), lo, hi)

  def dequantize(shape, lo=lo, hi=hi):
    return jax.eval_shape(lambda c, lo, hi: pq.dequantize(c, lo, hi, jnp.bfloat16,
                                                          interpret=True),
                          jax.ShapeDtypeStruct(shape, jnp.uint8), lo, hi)

  for fn in (quantize, dequantize):
    with pytest.raises(ValueError, match="32-bit offsets"):
      fn((2 ** 31 + 1, 1, 1))
    with pytest.raises(ValueError, match="2\\*\\*31 or more"):
      fn((1, 1, 2 ** 32 + 8))
    assert fn((2 ** 30, 2, 1), two, two).shape == (2 ** 30, 2, 1)


# ----------------------------------------------------------------------------- GPU lowering
def _gpu_ir(fn, *args):
  """The module ``fn`` lowers to for CUDA (no GPU needed: Triton IR is built by JAX)."""
  return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_gpu_lowering_uses_ieee_arithmetic():
  """The compiled kernels do XLA:GPU's arithmetic: its fp32 division is ``div.full.f32``
  (``-nvptx-prec-divf32=1``), and ``-``, ``+``, ``*`` are the unfused ``.rn`` forms (with an IEEE
  division here the large GPU cases below disagreed with XLA's codes on an H100)."""
  skip_unless_pallas_lowers_for_cuda_here()
  x = jnp.zeros((300, 12, 64), jnp.bfloat16)
  lo, hi = jnp.zeros((12,), jnp.float32), jnp.ones((12,), jnp.float32)
  ir = _gpu_ir(lambda x, lo, hi: pq.quantize(x, lo, hi, jnp.uint32(3)), x, lo, hi)
  assert "mesa_quantize" in ir and "div.full.f32" in ir
  assert all(f"{op}.rn.f32" in ir for op in ("sub", "add")) and "div.rn.f32" not in ir
  ir = _gpu_ir(lambda c, lo, hi: pq.dequantize(c, lo, hi, jnp.bfloat16),
               jnp.zeros(x.shape, jnp.uint8), lo, hi)
  assert "mesa_dequantize" in ir and all(f"{op}.rn.f32" in ir for op in ("mul", "add"))


@pytest.mark.skipif(not ON_GPU, reason="compiled Pallas kernels need a GPU")
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape,block_inner,block_elements",
                         [((64, 12, 64), pq.BLOCK_INNER, pq.BLOCK_ELEMENTS),
                          ((1000, 1, 769), pq.BLOCK_INNER, pq.BLOCK_ELEMENTS),
                          ((3, 2, 70001), pq.BLOCK_INNER, pq.BLOCK_ELEMENTS),
                          ((33, 3, 37), 16, 64)], ids=str)
def test_compiled_kernels_on_gpu(shape, dtype, block_inner, block_elements):
  codes = check(shape, dtype, seed=11, interpret=False, block_inner=block_inner,
                block_elements=block_elements)
  assert len(np.unique(np.asarray(codes))) > 200
