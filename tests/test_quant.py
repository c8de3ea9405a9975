"""Mesa 8-bit quantization (lowmem_jax.quant): the jnp reference (layout, error bound,
clamping, unbiased stochastic rounding, seeds, EMA range) and the custom_vjp rules that
keep only codes (coded_vjp, ms_norm_coded): exact forward, backward at the dequantized
inputs, one shared uint8 residual. fp32 unless a test says otherwise."""

import functools
import math
import re

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from lowmem_jax import activations, attention, norms, quant
from lowmem_jax.memory import saved_residuals
from lowmem_jax.quant import QuantState, coded_vjp, ms_norm_coded, quantize_tensor

F32_ULP_1 = 2.0 ** -23  # one ulp of fp32 at 1, relative


def rand(shape, seed, scale=1.0, dtype=jnp.float32):
  x = scale * np.random.default_rng(seed).standard_normal(shape)
  return jnp.asarray(x.astype(np.float32)).astype(dtype)


def rel_err(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def assert_quantized_grad(got, want, at_deq, rtol=1e-5):
  """``got`` is autodiff at the dequantized inputs (coded_vjp's contract) to rounding and
  not exact autodiff: the backward really ran there, not at the inputs themselves.

  At the dequantized inputs: rtol of the largest entry, 1e-5 in fp32 (the two sides may
  sum their <= 512 terms in other orders: n u = 3e-5 of sum|a_i|, ~1e-6 of the largest
  entry here); a bf16 result, one ulp (2^-7). Not exact: the inputs moved by up to one
  step (range / 255) move the gradient by >= 2.3e-3 relative (measured, 8 data seeds);
  1e-4 is 100x the fp32 rounding of a backward run at the inputs themselves. (It was
  0 < err < 2e-2 or 3e-2, picked by eye: the mixed test sat at 0.83 of it and over it at
  another data seed, and a backward dequantizing half a step off passed it.)"""
  at = np.asarray(at_deq, np.float64)
  np.testing.assert_allclose(np.asarray(got, np.float64), at, rtol=rtol,
                             atol=rtol * float(np.abs(at).max()))
  err = rel_err(got, want)
  assert err > 1e-4, err


def ms_input_grad(kind, x, y, g, eps=1e-6):
  """DESIGN's MS-norm backward in float64 from the output ``y`` (rstd from ``x``)."""
  x, y, g = (np.asarray(a, np.float64) for a in (x, y, g))
  mean = lambda a: a.mean(-1, keepdims=True)
  if kind == "layer":
    return (g - mean(g) - y * mean(g * y)) / np.sqrt(x.var(-1, keepdims=True) + eps)
  return (g - y * mean(g * y)) / np.sqrt(mean(x * x) + eps)


def quantized(x, groups=1, axis=-1, state=None):
  state = QuantState.create(groups) if state is None else state
  return quantize_tensor(x, state, axis=axis, groups=groups)[0]


# ----------------------------------------------------------------------------- layout
@pytest.mark.parametrize("shape,axis,groups,view", [
    ((2, 5, 4, 8), 2, 4, (10, 4, 8)),     # head-wise [B, N, H, D]
    ((2, 5, 4, 8), -2, 4, (10, 4, 8)),
    ((2, 5, 4, 8), 2, 2, (10, 2, 16)),    # two heads per group
    ((3, 7, 12), -1, 3, (21, 3, 4)),      # channel groups
    ((3, 7, 12), -1, 1, (21, 1, 12)),     # one range per tensor row layout
    ((6, 10), 0, 1, (1, 1, 60)),          # whole tensor, one group
    ((6, 10), 0, 6, (1, 6, 10)),
    ((5,), 0, 5, (1, 5, 1)),
])
def test_group_view(shape, axis, groups, view):
  assert quant.group_view(shape, axis, groups) == view
  x = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)
  x3 = x.reshape(view)  # groups are contiguous along the axis
  for g in range(groups):
    per = shape[axis] // groups
    want = np.take(np.asarray(x), np.arange(g * per, (g + 1) * per), axis=axis)
    np.testing.assert_array_equal(np.sort(np.asarray(x3[:, g]).ravel()), np.sort(want.ravel()))


@pytest.mark.parametrize("shape,axis,groups,match", [
    ((3, 7, 12), -1, 5, "5 groups do not divide axis 2 of size 12"),
    ((2, 5, 4, 8), 2, 3, "3 groups do not divide axis 2 of size 4"),
    ((3, 7, 12), 0, 0, "0 groups"),
    ((3, 7, 12), 1, -1, "-1 groups"),
    ((), 0, 1, "scalar"),
    ((4, 6, 3, 5), 6, 3, r"axis 6 is out of bounds for shape \[4, 6, 3, 5\]"),  # was axis 2
    ((4, 6), -3, 1, "axis -3 is out of bounds"),
])
def test_group_view_rejects_bad_groups(shape, axis, groups, match):
  with pytest.raises(ValueError, match=match):
    quant.group_view(shape, axis, groups)


def test_api_errors():
  x = rand((4, 6), 0)
  lo, hi = quant.batch_range(x)
  with pytest.raises(ValueError, match="unknown quantization implementation 'triton'"):
    quant.quantize(x, lo, hi, jnp.uint32(0), implementation="triton")
  with pytest.raises(ValueError, match="groups do not divide"):
    quant.quantize(x, lo, hi, jnp.uint32(0), groups=4)
  with pytest.raises(ValueError, match="state has 1 groups, asked for 2"):
    quantize_tensor(x, QuantState.create(1), groups=2)
  with pytest.raises(ValueError, match="unknown norm kind 'batch'"):
    ms_norm_coded("batch", x, 1e-6, QuantState.create(1))
  with pytest.raises(ValueError, match="state has 2 groups, asked for 1"):
    ms_norm_coded("layer", x, 1e-6, QuantState.create(2))


# ----------------------------------------------------------------------------- the reference
def np_noise(index, seed):
  """The documented noise, in numpy: lowbias32 of ``index * 0x9E3779B9 + seed``."""
  with np.errstate(over="ignore"):
    x = index.astype(np.uint32) * np.uint32(0x9E3779B9) + np.uint32(seed)
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
  return (x >> np.uint32(8)).astype(np.float32) * np.float32(2.0 ** -24)


def test_noise_is_the_documented_hash():
  """The noise the reference and the kernels share (lowmem_jax.quant.uniform_noise)
  is the documented hash, wrap-around indices and extreme seeds included."""
  rng = np.random.default_rng(0)
  index = np.concatenate([np.arange(2000), [2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1],
                          rng.integers(0, 2 ** 32, 1000)]).astype(np.uint32)
  for seed in (0, 1, 2 ** 31, 2 ** 32 - 1, 123456789):
    got = np.asarray(quant.uniform_noise(jnp.asarray(index), jnp.uint32(seed)))
    np.testing.assert_array_equal(got, np_noise(index, seed))
  u = np_noise(np.arange(2 ** 16, dtype=np.uint32), 5)
  assert u.min() >= 0 and u.max() < 1 and abs(u.mean() - 0.5) < 0.01


def _full_size_ops_independent_of(fn, shape, *args):
  """Primitives of ``fn(*args)``'s jaxpr with an output of ``shape``'s size that depend
  on none of the arguments (JAX hoists such values out of a scanned layer)."""
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  size, tainted, found = int(np.prod(shape)), set(jaxpr.invars), []
  for eqn in jaxpr.eqns:
    if any(not isinstance(v, jax.extend.core.Literal) and v in tainted for v in eqn.invars):
      tainted.update(eqn.outvars)
    elif any(int(np.prod(v.aval.shape)) >= size for v in eqn.outvars):
      found.append(str(eqn.primitive))
  return found


@pytest.mark.parametrize("shape", [(3, 5, 7), (9, 1, 16), (4, 3, 1), (2, 700, 3)], ids=str)
def test_view_noise_is_the_flat_index_noise_formed_from_the_seed(shape):
  """``view_noise`` (what quantize_reference adds) is uniform_noise of the flat index (the
  kernels' formula), bit for bit, and no array of the view's size in it is independent
  of the seed: nothing a scan over layers could hoist and keep live as a uint32 array."""
  index = jnp.arange(int(np.prod(shape)), dtype=jnp.uint32).reshape(shape)
  for seed in (0, 7, 2 ** 31, 2 ** 32 - 1):
    np.testing.assert_array_equal(np.asarray(quant.view_noise(shape, jnp.uint32(seed))),
                                  np.asarray(quant.uniform_noise(index, jnp.uint32(seed))))
  assert _full_size_ops_independent_of(
      lambda seed: quant.view_noise(shape, seed), shape, jnp.uint32(1)) == []
  # the flat-index form would be hoisted: the check sees it
  assert _full_size_ops_independent_of(
      lambda seed: quant.uniform_noise(index, seed), shape, jnp.uint32(1))


def test_group_step_of_flat_and_inverted_ranges_is_a_positive_rounded_step():
  lo = jnp.asarray([0.5, 2.0, 0.0, 1e-3], jnp.float32)
  hi = jnp.asarray([0.5, 1.0, 1e-37, 1e-3 + 1e-6], jnp.float32)  # flat, inverted, tiny
  step = np.asarray(quant.group_step(lo, hi))
  assert np.all(step > 0) and np.all(step.view(np.uint32) & 0xFF == 0)
  flat = np.array(1e-30, np.float32).view(np.uint32)  # a flat range: 1e-30, rounded up
  np.testing.assert_array_equal(step[:2].view(np.uint32), (flat + 0xFF) & ~np.uint32(0xFF))
  assert step[3] >= np.float32(1e-6) / 255


def test_reference_is_ieee_fp32_in_every_context():
  """Codes are ``floor((x - lo) / step + u)`` rounded step by step in fp32 (what the GPU
  kernels compute too), and dequantized values the same bits eagerly and under jit (the
  step keeps 16 significant bits, so a fused multiply-add changes nothing)."""
  o, g, i = 6, 3, 50
  x = rand((o, g, i), 1, scale=2.0)
  lo = jnp.asarray([-3.0, -1.7, -5.1], jnp.float32)
  hi = jnp.asarray([2.9, 1.3, 4.3], jnp.float32)
  seed = 4242
  step = np.asarray(quant.group_step(lo, hi))
  assert np.all(step >= (np.asarray(hi) - np.asarray(lo)) / 255)  # rounded up
  assert np.all(step.view(np.uint32) & 0xFF == 0)                 # 16 significant bits
  index = np.arange(o * g * i, dtype=np.uint32).reshape(o, g, i)
  t = ((np.asarray(x) - np.asarray(lo)[None, :, None]) / step[None, :, None]
       + np_noise(index, seed))
  assert t.dtype == np.float32
  want = np.clip(np.floor(t), 0, 255).astype(np.uint8)
  eager = quant.quantize_reference(x, lo, hi, jnp.uint32(seed))
  jitted = jax.jit(quant.quantize_reference)(x, lo, hi, jnp.uint32(seed))
  np.testing.assert_array_equal(np.asarray(eager), want)
  np.testing.assert_array_equal(np.asarray(jitted), want)
  values = (want.astype(np.float32) * step[None, :, None]) + np.asarray(lo)[None, :, None]
  np.testing.assert_array_equal(
      np.asarray(quant.dequantize_reference(eager, lo, hi, jnp.float32)), values)
  np.testing.assert_array_equal(
      np.asarray(jax.jit(quant.dequantize_reference, static_argnums=3)(eager, lo, hi,
                                                                       jnp.float32)), values)


@pytest.mark.parametrize("shape,axis,groups", [((4, 9, 3, 16), 2, 3), ((50, 40), -1, 4),
                                               ((7, 300), 0, 1)], ids=str)
def test_error_below_one_step_inside_the_range(shape, axis, groups):
  x = rand(shape, 2, scale=3.0)

  @jax.jit
  def run(x):
    qt = quantized(x, groups, axis)  # first update: the range is the batch's own
    return qt.codes, qt.dequantized(), qt.lo, qt.hi, quant.batch_range(x, axis=axis,
                                                                      groups=groups)

  codes, values, lo, hi, (batch_lo, batch_hi) = run(x)
  np.testing.assert_array_equal(np.asarray(lo), np.asarray(batch_lo))
  np.testing.assert_array_equal(np.asarray(hi), np.asarray(batch_hi))
  view = quant.group_view(shape, axis, groups)
  err = np.abs(np.asarray(values) - np.asarray(x)).reshape(view)
  step = np.asarray(quant.group_step(lo, hi))
  assert np.all(err < step[None, :, None])
  assert np.all(np.asarray(codes).reshape(view).max(axis=(0, 2)) >= 254)
  assert np.all(np.asarray(codes).reshape(view).min(axis=(0, 2)) <= 1)


def test_range_endpoints_are_exact():
  lo, hi = jnp.asarray([-1.25], jnp.float32), jnp.asarray([0.75], jnp.float32)
  x = jnp.asarray([[[-1.25] * 64]], jnp.float32)
  codes = quant.quantize_reference(x, lo, hi, jnp.uint32(3))
  assert not np.asarray(codes).any()  # lo is code 0 whatever the noise
  np.testing.assert_array_equal(np.asarray(quant.dequantize_reference(codes, lo, hi,
                                                                      jnp.float32)), x)
  x = jnp.full((1, 1, 64), 0.75, jnp.float32)
  codes = np.asarray(quant.quantize_reference(x, lo, hi, jnp.uint32(3)))
  assert set(np.unique(codes)) <= {254, 255}


def test_values_outside_the_range_clamp_without_wrapping():
  """Far above hi gives 255, far below lo gives 0: no modulo-256 wrap-around (the
  reference Mesa code's bug), including values whose unclipped code is 256, 511, 512."""
  lo, hi = jnp.asarray([-1.0], jnp.float32), jnp.asarray([1.0], jnp.float32)
  step = float(quant.group_step(lo, hi)[0])
  k = np.asarray([1, 2, 3.5, 255.5, 256, 257, 300, 510, 511, 512, 1000, 1e6, 1e30 / step])
  above = jnp.asarray((1.0 + k * step).astype(np.float32).reshape(1, 1, -1))
  below = jnp.asarray((-1.0 - k * step).astype(np.float32).reshape(1, 1, -1))
  extreme = jnp.asarray([[[np.inf, -np.inf, 3e38, -3e38]]], jnp.float32)
  for seed in range(4):
    s = jnp.uint32(seed)
    assert np.all(np.asarray(quant.quantize_reference(above, lo, hi, s)) == 255)
    assert np.all(np.asarray(quant.quantize_reference(below, lo, hi, s)) == 0)
    np.testing.assert_array_equal(np.asarray(quant.quantize_reference(extreme, lo, hi, s)),
                                  [[[255, 0, 255, 0]]])


def test_flat_range_codes_zero():
  x = jnp.full((3, 2, 5), 1.5, jnp.float32)
  qt = quantized(x, groups=2, axis=1)
  assert not np.asarray(qt.codes).any()
  np.testing.assert_array_equal(np.asarray(qt.dequantized()), np.asarray(x))


# ----------------------------------------------------------------------------- unbiased
def test_stochastic_rounding_is_unbiased_over_elements():
  """n copies of v = lo + (k + 0.3) * step: the mean dequantized value is v within 4
  standard errors; round-to-nearest (always k) or truncation is ~200 standard errors off,
  so the bound has the power to catch a biased rounding."""
  n, k = 200_000, 100
  lo, hi = jnp.asarray([-2.0], jnp.float32), jnp.asarray([3.0], jnp.float32)
  step = float(quant.group_step(lo, hi)[0])
  v = np.float32(-2.0 + (k + 0.3) * step)
  frac = (float(v) + 2.0) / step - k  # 0.3, up to v's fp32 rounding
  x = jnp.full((1, 1, n), v, jnp.float32)
  codes = np.asarray(quant.quantize_reference(x, lo, hi, jnp.uint32(11)))
  assert set(np.unique(codes)) == {k, k + 1}
  mean = float(np.mean(np.asarray(quant.dequantize_reference(jnp.asarray(codes), lo, hi,
                                                             jnp.float32), np.float64)))
  se = step * np.sqrt(frac * (1 - frac) / n)
  assert abs(mean - float(v)) < 4 * se, (mean - float(v)) / se
  assert abs(np.mean(codes == k + 1) - frac) < 4 * np.sqrt(frac * (1 - frac) / n)
  nearest = -2.0 + np.round(frac + k) * step  # deterministic rounding of the same values
  assert abs(nearest - float(v)) > 100 * se


def test_stochastic_rounding_is_unbiased_over_seeds():
  """Each element, quantized under 4000 seeds, averages to itself."""
  seeds = jnp.arange(4000, dtype=jnp.uint32)
  x = jnp.linspace(-0.9, 0.9, 37, dtype=jnp.float32).reshape(1, 1, -1)
  lo, hi = jnp.asarray([-1.0], jnp.float32), jnp.asarray([1.0], jnp.float32)
  step = float(quant.group_step(lo, hi)[0])
  codes = jax.vmap(lambda s: quant.quantize_reference(x, lo, hi, s))(seeds)
  values = np.asarray(jax.vmap(lambda c: quant.dequantize_reference(c, lo, hi, jnp.float32))(
      codes), np.float64)
  mean = values.mean(axis=0)
  se = step * 0.5 / np.sqrt(len(seeds))  # worst case p = 1/2
  assert np.all(np.abs(mean - np.asarray(x, np.float64)) < 4.5 * se)


def test_seeds():
  x = rand((8, 2, 64), 3)
  lo, hi = quant.batch_range(x, axis=1, groups=2)
  q = lambda s: np.asarray(quant.quantize(x, lo, hi, jnp.uint32(s), axis=1, groups=2))
  a, b = q(1), q(2)
  np.testing.assert_array_equal(a, q(1))  # same seed, same codes
  assert np.mean(a != b) > 0.2            # another seed rounds other elements up
  assert np.all(np.abs(a.astype(int) - b.astype(int)) <= 1)  # but only by one step


def test_seed_of_typed_and_raw_keys():
  key = jax.random.key(7)
  raw = jax.random.key_data(key)
  assert quant.seed_of(key).dtype == jnp.uint32
  assert int(quant.seed_of(key)) == int(quant.seed_of(raw))
  assert int(quant.seed_of(key)) != int(quant.seed_of(jax.random.key(8)))


# ----------------------------------------------------------------------------- EMA range
@pytest.mark.parametrize("axis,groups", [(-1, 1), (2, 4)])
def test_batch_range_reduces_in_the_input_dtype(axis, groups):
  """Per-group min/max of a bf16 activation, in fp32, equal to those of its fp32 upcast,
  with no array of the activation's size in fp32 on the way (a copy the compiled step
  kept beside the activation)."""
  x = rand((2, 5, 4, 8), 3, scale=4.0, dtype=jnp.bfloat16)
  lo, hi = quant.batch_range(x, axis=axis, groups=groups)
  view = quant.group_view(x.shape, axis, groups)
  x3 = np.asarray(x.astype(jnp.float32)).reshape(view)
  assert lo.dtype == hi.dtype == jnp.float32 and lo.shape == (groups,)
  np.testing.assert_array_equal(np.asarray(lo), x3.min(axis=(0, 2)))
  np.testing.assert_array_equal(np.asarray(hi), x3.max(axis=(0, 2)))
  jaxpr = jax.make_jaxpr(lambda x: quant.batch_range(x, axis=axis, groups=groups))(x)
  fp32 = [e for e in jaxpr.eqns for v in e.outvars
          if v.aval.dtype == jnp.float32 and v.aval.size == x.size]
  assert fp32 == [], jaxpr
  # min and max in one reduction: XLA:GPU ran two reductions as two reads of x
  reductions = [e.primitive.name for e in jaxpr.eqns if "reduce" in e.primitive.name]
  assert reductions == ["reduce"], jaxpr


def test_batch_range_propagates_nan():
  """A NaN in a group makes that group's min and max NaN (as ``jnp.min``/``jnp.max``), so
  a non-finite activation is not hidden by the range."""
  x = jnp.array([[1.0, 2.0], [jnp.nan, -3.0]], jnp.float32)
  lo, hi = quant.batch_range(x, axis=0, groups=2)
  assert np.isnan(lo[1]) and np.isnan(hi[1])
  np.testing.assert_array_equal(np.asarray([lo[0], hi[0]]), [1.0, 2.0])


def test_ema_range_updates():
  x1, x2, x3 = rand((4, 6, 8), 4), rand((4, 6, 8), 5, 2.0), rand((4, 6, 8), 6, 0.5)
  s0 = QuantState.create(2, jax.random.key(1))
  assert int(s0.count) == 0
  qt1, s1 = quantize_tensor(x1, s0, axis=-1, groups=2)
  b1 = quant.batch_range(x1, groups=2)
  np.testing.assert_array_equal(np.asarray(s1.lo), np.asarray(b1[0]))  # first: batch's own
  np.testing.assert_array_equal(np.asarray(s1.hi), np.asarray(b1[1]))
  state = s1
  for count, x in ((2, x2), (3, x3)):
    prev = state
    qt, state = quantize_tensor(x, prev, axis=-1, groups=2)
    bmin, bmax = (np.asarray(a) for a in quant.batch_range(x, groups=2))
    want_lo = np.float32(0.9) * np.asarray(prev.lo) + np.float32(0.1) * bmin
    want_hi = np.float32(0.9) * np.asarray(prev.hi) + np.float32(0.1) * bmax
    assert want_lo.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(state.lo), want_lo)
    np.testing.assert_array_equal(np.asarray(state.hi), want_hi)
    assert int(state.count) == count
    np.testing.assert_array_equal(np.asarray(state.key), np.asarray(s0.key))
    np.testing.assert_array_equal(np.asarray(qt.lo), np.asarray(state.lo))  # codes use it
  # Under jit XLA may fuse the update into an FMA: within one rounding.
  js = jax.jit(lambda x, s: quantize_tensor(x, s, axis=-1, groups=2)[1])(x2, s1)
  _, es = quantize_tensor(x2, s1, axis=-1, groups=2)
  np.testing.assert_allclose(np.asarray(js.lo), np.asarray(es.lo), rtol=2 * F32_ULP_1)


def test_each_update_draws_new_noise():
  x = rand((16, 32), 7)
  s = QuantState.create(1)
  qt1, s1 = quantize_tensor(x, s)
  lo, hi = qt1.lo, qt1.hi
  assert int(quant.seed_of(s.step_key())) != int(quant.seed_of(s1.step_key()))
  again = quant.quantize(x, lo, hi, quant.seed_of(s.step_key()))
  np.testing.assert_array_equal(np.asarray(qt1.codes), np.asarray(again))
  other = quant.quantize(x, lo, hi, quant.seed_of(s1.step_key()))
  assert np.any(np.asarray(other) != np.asarray(qt1.codes))


def test_quantize_tensor_head_wise_ranges():
  b, n, h, d = 2, 5, 4, 8
  x = rand((b, n, h, d), 8) * jnp.asarray([0.5, 1.0, 2.0, 4.0])[None, None, :, None]
  qt, state = quantize_tensor(x, QuantState.create(h), axis=2, groups=h)
  np.testing.assert_array_equal(np.asarray(state.lo), np.asarray(x).min(axis=(0, 1, 3)))
  np.testing.assert_array_equal(np.asarray(state.hi), np.asarray(x).max(axis=(0, 1, 3)))
  assert qt.axis == 2 and qt.groups == h and qt.codes.shape == x.shape
  err = np.abs(np.asarray(qt.dequantized()) - np.asarray(x))
  step = np.asarray(quant.group_step(state.lo, state.hi))
  assert np.all(err < step[None, None, :, None])
  # Per-head steps: the error of the narrow head is far below the wide head's step.
  assert err[:, :, 0].max() < step[3] / 4


def test_quantize_tensor_is_gradient_transparent():
  """The QTensor's value is x itself (codes are gradient-free)."""
  x = rand((3, 8), 9)
  g = jax.grad(lambda x: jnp.sum(quantized(x).value * 3.0))(x)
  np.testing.assert_array_equal(np.asarray(g), np.full(x.shape, 3.0, np.float32))


# ----------------------------------------------------------------------------- coded_vjp
def linear(x, w, b):
  return x @ w + b


def attention_masked(q, k, v, mask, *, implementation):
  return attention.attention(q, k, v, mask=mask, implementation=implementation)


def test_int8_linear():
  x, w, b = rand((4, 16, 32), 10), rand((32, 24), 11, 0.2), rand((24,), 12)
  r = rand((4, 16, 24), 13)
  state = QuantState.create(1, jax.random.key(3))

  def loss(x, w, b, quantize):
    if not quantize:
      return jnp.sum(linear(x, w, b) * r)
    qt = quantized(x, state=state)
    return jnp.sum(coded_vjp(linear, [qt], (w, b)) * r)

  qt = quantized(x, state=state)
  np.testing.assert_array_equal(np.asarray(coded_vjp(linear, [qt], (w, b))),
                                np.asarray(linear(x, w, b)))  # forward exact
  got = jax.jit(jax.grad(loss, (0, 1, 2)), static_argnums=3)(x, w, b, True)
  want = jax.jit(jax.grad(loss, (0, 1, 2)), static_argnums=3)(x, w, b, False)
  # dx = g @ w.T and db = sum(g) do not read x: exact. dW reads it: at the dequantized x.
  np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), rtol=1e-6, atol=1e-5)
  assert_quantized_grad(got[1], want[1], jnp.einsum("bnc,bnf->cf", qt.dequantized(), r))


@pytest.mark.parametrize("fn", [activations.gelu, jax.nn.silu], ids=["gelu", "silu"])
def test_int8_activation(fn):
  x, r = rand((8, 64), 14, 2.0), rand((8, 64), 15)

  @jax.jit
  def run(x):
    qt = quantized(x)
    out, pullback = jax.vjp(lambda x: coded_vjp(fn, [quantized(x)]), x)
    exact, exact_pullback = jax.vjp(fn, x)
    at_deq = jax.vjp(fn, qt.dequantized())[1](r)[0]
    return out, exact, pullback(r)[0], exact_pullback(r)[0], at_deq

  out, exact, got, want, at_deq = run(x)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(exact))
  assert_quantized_grad(got, want, at_deq)


def test_int8_layer_norm_with_affine():
  x, r = rand((4, 16, 32), 16, 1.5), rand((4, 16, 32), 17)
  scale, bias = 1.0 + rand((32,), 18, 0.1), rand((32,), 19, 0.1)

  def loss(x, scale, bias, quantize):
    if not quantize:
      return jnp.sum(norms.layer_norm(x, scale, bias) * r)
    return jnp.sum(coded_vjp(norms.layer_norm, [quantized(x)], (scale, bias)) * r)

  np.testing.assert_array_equal(
      np.asarray(coded_vjp(norms.layer_norm, [quantized(x)], (scale, bias))),
      np.asarray(norms.layer_norm(x, scale, bias)))
  grads = jax.jit(jax.grad(loss, (0, 1, 2)), static_argnums=3)
  got, want = grads(x, scale, bias, True), grads(x, scale, bias, False)
  at_deq = grads(quantized(x).dequantized(), scale, bias, False)
  assert_quantized_grad(got[0], want[0], at_deq[0])
  assert_quantized_grad(got[1], want[1], at_deq[1])
  np.testing.assert_allclose(np.asarray(got[2]), np.asarray(want[2]), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("implementation", ["xla", "flash"])
def test_int8_attention_with_mask_as_const_arg(implementation):
  b, n, h, d = 2, 16, 4, 8
  q, k, v = (rand((b, n, h, d), s) for s in (20, 21, 22))
  mask = jnp.asarray(np.random.default_rng(23).random((b, 1, n, n)) > 0.3)
  mask = mask | jnp.eye(n, dtype=bool)[None, None]  # every query sees a key
  r = rand((b, n, h, d), 24)
  fn = functools.partial(attention_masked, implementation=implementation)

  def loss(q, k, v, quantize):
    if quantize:  # head-wise ranges; the mask is a const arg (saved, no gradient)
      qts = [quantized(t, groups=h, axis=2) for t in (q, k, v)]
      out = coded_vjp(fn, qts, (), (mask,))
    else:
      out = fn(q, k, v, mask)
    return jnp.sum(out * r), out

  grads = jax.jit(jax.grad(loss, (0, 1, 2), has_aux=True), static_argnums=3)
  got, out = grads(q, k, v, True)
  want, out_exact = grads(q, k, v, False)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(out_exact))
  at_deq, _ = grads(*(quantized(t, groups=h, axis=2).dequantized() for t in (q, k, v)), False)
  for g, w, a in zip(got, want, at_deq):
    assert_quantized_grad(g, w, a)


def test_coded_vjp_mixed_quantized_and_diff_args():
  """Gradients reach both the quantized inputs and diff_args; const_args get none."""
  x, y = rand((6, 8), 25), rand((6, 8), 26)
  w = rand((8, 8), 27)
  c = rand((6, 8), 28)

  def fn(x, y, w, c):
    return jnp.tanh(x @ w) * y + c

  def loss(x, y, w, quantize):
    if not quantize:
      return jnp.sum(fn(x, y, w, c) ** 2)
    return jnp.sum(coded_vjp(fn, [quantized(x), quantized(y)], (w,), (c,)) ** 2)

  grads = jax.jit(jax.grad(loss, (0, 1, 2)), static_argnums=3)
  got, want = grads(x, y, w, True), grads(x, y, w, False)
  # backward at the dequantized x, y with the exact forward's cotangent 2 fn(x, y, w, c)
  _, vjp = jax.vjp(lambda x, y, w: fn(x, y, w, c), quantized(x).dequantized(),
                   quantized(y).dequantized(), w)
  for g, e, a in zip(got, want, vjp(2.0 * fn(x, y, w, c))):
    assert_quantized_grad(g, e, a)


def test_int8_linear_saves_codes_not_x():
  x0, w = rand((4, 16, 32), 29), rand((32, 32), 30)

  def plain(x0, w):
    return jnp.sum((x0 * 2.0) @ w)

  def int8(x0, w):
    return jnp.sum(coded_vjp(jnp.matmul, [quantized(x0 * 2.0)], (w,)))

  size = x0.size
  base = saved_residuals(plain, x0, w)
  assert any(r.dtype == "float32" and np.prod(r.shape) == size for r in base.items), base.table()
  res = saved_residuals(int8, x0, w)
  full = [r for r in res.items if np.prod(r.shape) == size]
  assert [(r.dtype, r.shape) for r in full] == [("uint8", x0.shape)], res.table()
  assert res.total_bytes < size + 64, res.table()


# ----------------------------------------------------------------------------- ms_norm_coded
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_ms_norm_coded(kind):
  x, r = rand((4, 16, 32), 31, 2.0) + 0.5, rand((4, 16, 32), 32)
  exact = {"layer": norms.ms_layer_norm, "rms": norms.ms_rms_norm}[kind]
  state = QuantState.create(1, jax.random.key(5))
  qt, new_state = ms_norm_coded(kind, x, 1e-6, state)
  np.testing.assert_array_equal(np.asarray(qt.value), np.asarray(exact(x, 1e-6)))
  # The code is the output's, with the EMA-updated range and the state's noise seed.
  y = np.asarray(qt.value)
  np.testing.assert_array_equal(np.asarray(qt.lo), [y.min()])
  np.testing.assert_array_equal(np.asarray(qt.hi), [y.max()])
  np.testing.assert_array_equal(np.asarray(new_state.lo), np.asarray(qt.lo))
  assert int(new_state.count) == 1
  np.testing.assert_array_equal(
      np.asarray(qt.codes),
      np.asarray(quant.quantize(qt.value, qt.lo, qt.hi, quant.seed_of(state.step_key()))))
  got = jax.grad(lambda x: jnp.sum(ms_norm_coded(kind, x, 1e-6, state)[0].value * r))(x)
  want = jax.grad(lambda x: jnp.sum(exact(x, 1e-6) * r))(x)
  assert_quantized_grad(got, want, ms_input_grad(kind, x, qt.dequantized(), r))


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_ms_norm_coded_then_int8_linears(kind):
  """The norm's QTensor feeds the linears: their weight gradients read its codes, and
  the input gradient is close to exact autodiff of norm + linears."""
  x = rand((4, 16, 32), 33, 2.0)
  ws = [rand((32, 16), s, 0.2) for s in (34, 35, 36)]
  r = rand((4, 16, 16), 37)
  state = QuantState.create(1, jax.random.key(6))
  exact = {"layer": norms.ms_layer_norm, "rms": norms.ms_rms_norm}[kind]

  def loss(x, ws, quantize):
    if not quantize:
      y = exact(x, 1e-6)
      return sum(jnp.sum((y @ w) * r) for w in ws)
    qt, _ = ms_norm_coded(kind, x, 1e-6, state)
    return sum(jnp.sum(coded_vjp(jnp.matmul, [qt], (w,)) * r) for w in ws)

  grads = jax.jit(jax.grad(loss, (0, 1)), static_argnums=2)
  got, want = grads(x, ws, True), grads(x, ws, False)
  qt, _ = ms_norm_coded(kind, x, 1e-6, state)
  y_deq = qt.dequantized()
  g_y = sum(r @ w.T for w in ws)  # the linears' dx: exact (no input read)
  assert_quantized_grad(got[0], want[0], ms_input_grad(kind, x, y_deq, g_y))
  for dw, dw_exact in zip(got[1], want[1]):
    assert_quantized_grad(dw, dw_exact, jnp.einsum("bnc,bnf->cf", y_deq, r))


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_norm_and_three_linears_share_one_code(kind):
  """MS norm -> q, k, v linears reading one QTensor: exactly one uint8 array of the
  input's size is saved (the shared code), and no float array of that size."""
  x = rand((4, 16, 32), 38)
  ws = [rand((32, 32), s) for s in (39, 40, 41)]

  def block(x, ws):
    qt, _ = ms_norm_coded(kind, x, 1e-6, QuantState.create(1))
    return sum(jnp.sum(jnp.sin(coded_vjp(jnp.matmul, [qt], (w,)))) for w in ws)

  res = saved_residuals(block, x, ws)
  full = [(r.dtype, r.shape) for r in res.items if np.prod(r.shape) == x.size]
  # sin saves cos(out) ([4, 16, 32] float32 each): outputs, not the norm's input.
  uint8 = [f for f in full if f[0] == "uint8"]
  assert uint8 == [("uint8", x.shape)], res.table()
  outputs = [r for r in res.items if r.dtype == "float32" and np.prod(r.shape) == x.size]
  assert all("sin" in r.source or "cos" in r.source for r in outputs), res.table()
  assert len(outputs) == 3, res.table()

  def block_plain(x, ws):  # without the sin: nothing of x's size but the code
    qt, _ = ms_norm_coded(kind, x, 1e-6, QuantState.create(1))
    return sum(jnp.sum(coded_vjp(jnp.matmul, [qt], (w,))) for w in ws)

  res = saved_residuals(block_plain, x, ws)
  full = [(r.dtype, r.shape) for r in res.items if np.prod(r.shape) == x.size]
  assert full == [("uint8", x.shape)], res.table()
  assert res.total_bytes < x.size + 4 * 64 + 64, res.table()  # + rstd per row + ranges


# ----------------------------------------------------------------------------- bf16
def test_bf16_inputs():
  x, w = rand((4, 16, 32), 42, dtype=jnp.bfloat16), rand((32, 24), 43, 0.2, jnp.bfloat16)
  r = rand((4, 16, 24), 44, dtype=jnp.bfloat16)
  state = QuantState.create(2, jax.random.key(9))
  qt, _ = quantize_tensor(x, state, groups=2)
  # Codes of the bf16 values: those of their exact fp32 upcast.
  qt32, _ = quantize_tensor(x.astype(jnp.float32), state, groups=2)
  np.testing.assert_array_equal(np.asarray(qt.codes), np.asarray(qt32.codes))
  assert qt.dequantized().dtype == jnp.bfloat16

  def loss(x, w, quantize):
    if not quantize:
      return jnp.sum((x @ w).astype(jnp.float32) * r)
    qt, _ = quantize_tensor(x, state, groups=2)
    return jnp.sum(coded_vjp(jnp.matmul, [qt], (w,)).astype(jnp.float32) * r)

  grads = jax.jit(jax.grad(loss, (0, 1)), static_argnums=2)
  got, want = grads(x, w, True), grads(x, w, False)
  assert got[0].dtype == got[1].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
  # at the dequantized inputs, by the same bf16 matmul's autodiff (XLA:CPU 0.11 sums a
  # bf16 dot's 64 terms less exactly than an fp32 einsum: 3.8% off one entry of it)
  at_deq = grads(qt.dequantized(), w, False)[1]
  assert_quantized_grad(np.asarray(got[1], np.float32), np.asarray(want[1], np.float32),
                        np.asarray(at_deq, np.float32), rtol=2.0 ** -7)

  y, _ = ms_norm_coded("rms", x, 1e-6, QuantState.create(1))
  assert y.value.dtype == y.dequantized().dtype == jnp.bfloat16
  dx = jax.jit(jax.grad(lambda x: jnp.sum(ms_norm_coded("rms", x, 1e-6, QuantState.create(1))[0]
                                          .value.astype(jnp.float32) * r[..., :1])))(x)
  assert dx.dtype == jnp.bfloat16


# ----------------------------------------------------------------------------- a model's step
@functools.cache
def _vit_tiny_step(spec: str):
  """vit-tiny, batch 8, bf16, the whole train step under ``spec``, compiled once:
  (compiled memory, buffers live at its peak, optimized HLO text, saved residual bytes)."""
  import tempfile

  from flax import nnx

  from lowmem_jax.buffer_assignment import no_persistent_cache, read_dump
  from lowmem_jax.memory import compiled_memory
  from models import step_memory
  graphdef, params, rest, inputs, targets = step_memory.step_args(
      "vit-tiny", spec, 8, 0, jnp.bfloat16, {})
  with tempfile.TemporaryDirectory() as dump, no_persistent_cache():
    compiled = jax.jit(step_memory.sgd_step).lower(graphdef, params, rest, inputs, targets) \
        .compile(compiler_options={"xla_dump_to": dump})
    peak = read_dump(dump)
  residuals = saved_residuals(
      lambda p, r, x, t: step_memory.loss_fn(nnx.merge(graphdef, p, r, copy=True), x, t),
      params, rest, inputs, targets)
  return compiled_memory(compiled), peak, compiled.as_text(), residuals.total_bytes


ACTIVATION = 8 * 17 * 64  # vit-tiny batch 8: 17 tokens of width 64, the smallest coded array
# where the quantize side of lowmem_jax.quant shows up as a buffer's source
QUANTIZE_SIDE = ("(view_noise)", "(uniform_noise)", "(batch_range)", "(quantize_reference)",
                 "(_update_and_code)", "(quantize_tensor)")


def _loop_carried_uint32(hlo_text: str, elements: int) -> list[str]:
  """uint32 arrays of at least ``elements`` carried by a while loop of the optimized HLO:
  a value computed once and kept live through every layer."""
  found = []
  for line in hlo_text.splitlines():
    if " while(" in line:
      for dims in re.findall(r"\bu32\[([\d,]+)\]", line.split(" while(")[0]):
        if math.prod(int(d) for d in dims.split(",")) >= elements:
          found.append(f"u32[{dims}]")
  return found


@pytest.mark.precision("default")
@pytest.mark.parametrize("spec", ["mesa8", "lowmembp+mesa8"])
def test_mesa_step_keeps_codes_and_no_noise_or_fp32_copy_of_its_own(spec):
  """The compiled vit-tiny step (batch 8, bf16): at its peak, what the quantize side of
  Mesa contributes is uint8 codes only; no uint32 buffer of an activation's size there, and
  no loop carries one (the rounding noise's index, hoisted out of the scanned layers, was
  one per coded shape: u32[136, 1, 128], [136, 4, 16], [136, 1, 64]). CPU (jax 0.10.2)
  compiled temp mesa8 967704 -> 964488 B, lowmembp+mesa8 885584 -> 883112 B: the backward
  holds the peak, the forward held the noise."""
  _, peak, hlo, _ = _vit_tiny_step(spec)
  assert _loop_carried_uint32(hlo, ACTIVATION) == []
  wide = [b for b in peak.buffers if b.shape and math.prod(b.shape) >= ACTIVATION]
  assert [b.type for b in wide if b.dtype == "uint32"] == [], peak.table()
  ours = [b for b in wide if b.source.endswith(QUANTIZE_SIDE)]
  assert ours and all(b.dtype == "uint8" for b in ours), peak.table()


@pytest.mark.precision("default")
def test_lowmembp_with_mesa8_keeps_no_more_than_either():
  """Issue 14's CPU check: a combination never costs more than either part (compiled temp
  of the whole step, the most bytes live at its peak, and jaxpr residuals). CPU (jax
  0.10.2): vit-tiny temp 1.5 baseline, 1.2 lowmembp, 0.9 mesa8, 0.8 both (MiB); peak
  2.14, 1.88, 1.55, 1.49 MiB; llama-tiny (batch 4 x 64, measured, not run here for the
  suite's time) temp 3.9, 3.6, 2.5, 2.4."""
  both_mem, both_peak, _, both_res = _vit_tiny_step("lowmembp+mesa8")
  for part in ("lowmembp", "mesa8"):
    mem, peak, _, res = _vit_tiny_step(part)
    assert both_mem.temp <= mem.temp, (part, both_mem, mem)
    assert both_peak.peak_bytes <= peak.peak_bytes, (part, both_peak.table(), peak.table())
    assert both_res <= res, (part, both_res, res)
