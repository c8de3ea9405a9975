"""The fused ReGELU2 / ReSiLU2 Pallas kernels (interpret mode) against the jnp path of
lowmem_jax.activations: same packed codes bit for bit, same y to 1e-6, same dx exactly."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowmem_jax import activations, packing
from lowmem_jax.activations import REGELU2, RESILU2, approx2_fn
from lowmem_jax.memory import saved_residuals
from pallas_kernels import activations as pa
from pallas_kernels import layout

KINDS = ("gelu", "silu")
STEPS = activations.STEPS
# dtype -> (rtol, atol) of y against the jnp path (16-bit: one rounding of the output).
DTYPES = {"float32": (jnp.float32, 1e-6, 1e-6), "bfloat16": (jnp.bfloat16, 2.0 ** -8, 1e-6),
          "float16": (jnp.float16, 2.0 ** -10, 1e-6)}
SHAPES = ((0,), (1,), (3,), (5,), (1000,), (4099,), (3, 5, 7), (2, 0, 3), (7, 129))


def rand(shape, seed, scale=4.0, dtype=jnp.float32):
  """Normal values plus, where room, every threshold and its fp32 neighbours (all codes)."""
  x = scale * np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
  flat = x.reshape(-1)
  special = []
  for c in REGELU2.thresholds + RESILU2.thresholds:
    c = np.float32(c)
    special += [np.nextafter(c, np.float32(-np.inf)), c, np.nextafter(c, np.float32(np.inf))]
  special += [0.0, -0.0, 30.0, -30.0, 100.0, -100.0]
  k = min(len(special), flat.size // 2)
  flat[:k] = np.asarray(special[:k], np.float32)
  return jnp.asarray(x).astype(dtype)


xla_forward = jax.jit(activations.approx2_forward, static_argnums=0)


@functools.partial(jax.jit, static_argnums=(0, 1))
def value_and_vjp(kind, implementation, x, g):
  y, pullback = jax.vjp(approx2_fn(kind, implementation), x)
  return y, pullback(g)[0]


def kernel_forward(kind, x, block_elements=layout.BLOCK_ELEMENTS):
  return pa.approx2_forward(kind, x, interpret=True, block_elements=block_elements)


def kernel_backward(kind, g, packed, block_elements=layout.BLOCK_ELEMENTS):
  return pa.approx2_backward(kind, g, packed, interpret=True, block_elements=block_elements)


def f64(a):
  return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


def check_kernels(kind, shape, dtype, block_elements=layout.BLOCK_ELEMENTS, seed=0):
  jdtype, rtol, atol = DTYPES[dtype]
  x = rand(shape, seed, dtype=jdtype)
  g = rand(shape, seed + 1, scale=1.0, dtype=jdtype)
  n = math.prod(shape)
  y, packed = kernel_forward(kind, x, block_elements)
  y_ref, packed_ref = xla_forward(kind, x)
  assert y.dtype == jdtype and y.shape == shape
  assert packed.dtype == jnp.uint8 and packed.shape == (math.ceil(n / 4),)
  np.testing.assert_array_equal(np.asarray(packed), np.asarray(packed_ref))
  np.testing.assert_allclose(f64(y), f64(y_ref), rtol=rtol, atol=atol)
  dx = kernel_backward(kind, g, packed, block_elements)
  _, dx_ref = value_and_vjp(kind, "xla", x, g)
  assert dx.dtype == jdtype and dx.shape == shape
  np.testing.assert_array_equal(f64(dx), f64(dx_ref))


# ----------------------------------------------------------------------------- erfc
def test_erfc_matches_lax_erfc_fp32_wide_range():
  z = np.concatenate([np.linspace(-15, 15, 30001), [0.0, -0.0, 1e-30, -1e-30, 40.0, -40.0,
                                                    np.inf, -np.inf]]).astype(np.float32)
  got = f64(jax.jit(pa.erfc)(jnp.asarray(z)))
  want = f64(jax.jit(jax.lax.erfc)(jnp.asarray(z)))
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
  # Relative: a few fp32 ulps in the centre, fp32 rounding of -z^2 grows it in the tail.
  centre = np.abs(z) <= 3
  np.testing.assert_allclose(got[centre], want[centre], rtol=2e-6, atol=0)
  normal = want > 1e-30
  np.testing.assert_allclose(got[normal], want[normal], rtol=1e-5, atol=0)
  assert np.all(got >= 0) and np.all(got <= 2)


def test_erfc_fit_relative_error_below_1_2e_7_in_float64():
  """The documented bound is the fit's own error: check it with fp64 arithmetic."""
  z = np.linspace(-10, 10, 20001)
  want = np.vectorize(math.erfc, otypes=[np.float64])(z)
  with jax.enable_x64(True):
    got = np.asarray(pa.erfc(jnp.asarray(z, jnp.float64)))
  assert got.dtype == np.float64
  assert np.max(np.abs(got - want) / want) < 1.2e-7


# ----------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernels_fp32(kind, shape):
  check_kernels(kind, shape, "float32")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("shape", [(5,), (4099,), (3, 5, 7)], ids=str)
def test_kernels_low_precision(kind, dtype, shape):
  check_kernels(kind, shape, dtype)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape,block_elements", [((1000,), 16), ((4099,), 64), ((13, 64), 16),
                                                  ((3, 5, 7), 4)], ids=str)
def test_kernels_small_blocks(kind, shape, block_elements):
  check_kernels(kind, shape, "float32", block_elements, seed=3)


@pytest.mark.parametrize("kind", KINDS)
def test_kernels_wide_range_and_special_values(kind):
  x = np.concatenate([np.linspace(-20, 20, 8001),
                      [np.inf, -np.inf, np.nan, 1e-30, -1e-30, 1e30, -1e30]]).astype(np.float32)
  x = jnp.asarray(x)
  y, packed = kernel_forward(kind, x)
  y_ref, packed_ref = xla_forward(kind, x)
  np.testing.assert_array_equal(np.asarray(packed), np.asarray(packed_ref))
  np.testing.assert_allclose(f64(y), f64(y_ref), rtol=1e-6, atol=1e-6)
  g = jnp.ones_like(x)
  np.testing.assert_array_equal(f64(kernel_backward(kind, g, packed)),
                                f64(value_and_vjp(kind, "xla", x, g)[1]))


@pytest.mark.parametrize("kind", KINDS)
def test_kernel_codes_cover_all_levels(kind):
  step = STEPS[kind]
  c = step.thresholds
  x = jnp.asarray([c[0] - 1, c[0] + 1e-3, c[1] + 1e-3, c[2] + 1], jnp.float32)
  _, packed = kernel_forward(kind, x)
  np.testing.assert_array_equal(np.asarray(packed), [0 | 1 << 2 | 2 << 4 | 3 << 6])
  dx = kernel_backward(kind, jnp.ones_like(x), packed)
  np.testing.assert_array_equal(np.asarray(dx), np.asarray(step.levels, np.float32))


def test_unknown_kind_raises():
  with pytest.raises(ValueError, match="unknown activation"):
    pa.approx2_forward("relu", jnp.ones((4,)), interpret=True)
  with pytest.raises(ValueError, match="unknown activation kind"):
    approx2_fn("relu", "pallas_interpret")
  with pytest.raises(ValueError, match="unknown activation implementation 'triton'"):
    approx2_fn("gelu", "triton")


# ----------------------------------------------------------------------------- end to end
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", [(1,), (3, 5, 7), (4099,)], ids=str)
def test_approx2_fn_pallas_interpret_matches_xla(kind, dtype, shape):
  jdtype, rtol, atol = DTYPES[dtype]
  x = rand(shape, 5, dtype=jdtype)
  g = rand(shape, 6, scale=1.0, dtype=jdtype)
  y, dx = value_and_vjp(kind, "pallas_interpret", x, g)
  y_ref, dx_ref = value_and_vjp(kind, "xla", x, g)
  assert y.dtype == dx.dtype == jdtype
  np.testing.assert_allclose(f64(y), f64(y_ref), rtol=rtol, atol=atol)
  np.testing.assert_array_equal(f64(dx), f64(dx_ref))


@pytest.mark.parametrize("kind", KINDS)
def test_approx2_fn_pallas_interpret_grad(kind):
  x = rand((6, 11), 7)
  w = rand((6, 11), 8, scale=1.0)
  loss = lambda impl: jax.jit(jax.grad(lambda v: jnp.sum(approx2_fn(kind, impl)(v) * w)))
  np.testing.assert_array_equal(np.asarray(loss("pallas_interpret")(x)),
                                np.asarray(loss("xla")(x)))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(1,), (7,), (3, 5), (2, 3, 13), (4, 8)], ids=str)
def test_only_residual_is_the_packed_code(kind, shape):
  fn = approx2_fn(kind, "pallas_interpret")
  res = saved_residuals(lambda v: fn(v).sum(), rand(shape, 9))
  n = math.prod(shape)
  assert [(r.dtype, r.shape) for r in res.items] == [("uint8", (math.ceil(n / 4),))], res.table()
  assert res.total_bytes == math.ceil(n / 4)


@pytest.mark.parametrize("kind", KINDS)
def test_size_zero_end_to_end(kind):
  fn = approx2_fn(kind, "pallas_interpret")
  for shape in [(0,), (0, 3), (2, 0, 5)]:
    x = jnp.zeros(shape, jnp.float32)
    y, dx = value_and_vjp(kind, "pallas_interpret", x, x)
    assert y.shape == dx.shape == shape and y.dtype == dx.dtype == jnp.float32
    assert fn(x).shape == shape


# ----------------------------------------------------------------------------- structure
def _outvars_outside_kernels(jaxpr, found=None):
  """Every outvar aval of ``jaxpr`` and its sub-jaxprs, not entering pallas_call kernels;
  also counts the pallas_calls met."""
  found = found if found is not None else {"avals": [], "pallas_calls": 0}
  for eqn in jaxpr.eqns:
    found["avals"] += [v.aval for v in eqn.outvars]
    if eqn.primitive.name == "pallas_call":
      found["pallas_calls"] += 1
      continue
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else (param,):
        if hasattr(sub, "eqns"):                          # a Jaxpr
          _outvars_outside_kernels(sub, found)
        elif hasattr(sub, "jaxpr") and hasattr(sub, "consts"):  # a ClosedJaxpr
          _outvars_outside_kernels(sub.jaxpr, found)
  return found


def _full_size_uint8(found, n):
  return [a for a in found["avals"] if a.dtype == jnp.uint8 and math.prod(a.shape) == n]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(7, 129), (64, 64), (3, 5, 7)], ids=str)
def test_backward_materialises_no_full_size_codes(kind, shape):
  n = math.prod(shape)
  g = jnp.zeros(shape, jnp.float32)
  p = jnp.zeros((math.ceil(n / 4),), jnp.uint8)
  closed = jax.make_jaxpr(
      lambda g, p: pa.approx2_backward(kind, g, p, interpret=False))(g, p)
  found = _outvars_outside_kernels(closed.jaxpr)
  assert found["pallas_calls"] == 1
  assert not _full_size_uint8(found, n), closed
  # The forward neither: y and the packed bytes come straight out of the kernel.
  closed = jax.make_jaxpr(lambda x: pa.approx2_forward(kind, x, interpret=False))(g)
  found = _outvars_outside_kernels(closed.jaxpr)
  assert found["pallas_calls"] == 1
  assert not _full_size_uint8(found, n), closed


def test_structural_check_catches_an_unpacked_code():
  """Control: the jnp backward unpacks to uint8[x.shape], and the walk sees it."""
  shape = (7, 129)
  n = math.prod(shape)
  g = jnp.zeros(shape, jnp.float32)
  p = jnp.zeros((math.ceil(n / 4),), jnp.uint8)
  closed = jax.make_jaxpr(
      lambda g, p: jax.jit(lambda g, p: g * REGELU2.derivative_of_code(
          packing.unpack_2bit(p, g.shape)))(g, p))(g, p)
  found = _outvars_outside_kernels(closed.jaxpr)
  assert found["pallas_calls"] == 0
  assert _full_size_uint8(found, n)
