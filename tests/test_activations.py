"""Tests for lowmem_jax.activations: ReGELU2 / ReSiLU2 (exact forward, 2-bit backward)."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowmem_jax import activations
from lowmem_jax.activations import (REGELU2, RESILU2, regelu2, regelu2_derivative, resilu2,
                                    resilu2_derivative)
from lowmem_jax.memory import saved_residuals

# Constants copied from the LowMemoryBP reference code (arXiv 2406.16282), independent of
# the library.
DESIGN = {
    "regelu2": dict(
        c=(-3.1858810036855245, -0.001178821281161997, 3.190832613414926),
        a=(-0.04922261145617846, 1.0979632065417297, -0.048740595085551286)),
    "resilu2": dict(
        c=(-6.3050461001646445, -0.0008684942046214787, 6.325815242089708),
        a=(-0.04060357190528599, 1.080925428529668, -0.040321856624382146)),
}

_erf = np.vectorize(math.erf, otypes=[np.float64])


def gelu_ref(x):
  x = np.asarray(x, np.float64)
  return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def silu_ref(x):
  x = np.asarray(x, np.float64)
  return x / (1.0 + np.exp(-x))


FNS = {
    "regelu2": (regelu2, gelu_ref, regelu2_derivative, REGELU2),
    "resilu2": (resilu2, silu_ref, resilu2_derivative, RESILU2),
}
NAMES = tuple(FNS)
LOW_DTYPES = {"bfloat16": (jnp.bfloat16, 2.0 ** -8), "float16": (jnp.float16, 2.0 ** -10)}


def ref_flag(x, name):
  """flag = (x > c0) + (x > c1) + (x > c2), compared in fp32 (x is cast to fp32 first)."""
  xf = np.asarray(jnp.asarray(x).astype(jnp.float32))
  c = [np.float32(ci) for ci in DESIGN[name]["c"]]
  return (xf > c[0]).astype(np.int64) + (xf > c[1]) + (xf > c[2])


def ref_levels(name):
  a0, a1, a2 = DESIGN[name]["a"]
  return np.array([0.0, a0, a0 + a1, a0 + a1 + a2], np.float64).astype(np.float32)


def ref_grad(x, g, name):
  """dx = g * d[flag] in fp32, cast to g's dtype."""
  gf = np.asarray(jnp.asarray(g).astype(jnp.float32))
  dx = gf * ref_levels(name)[ref_flag(x, name)]
  return np.asarray(jnp.asarray(dx).astype(jnp.asarray(g).dtype))


def rand(shape, seed, scale=3.0, dtype=jnp.float32):
  x = scale * np.random.default_rng(seed).standard_normal(shape)
  return jnp.asarray(x.astype(np.float32)).astype(dtype)


@functools.partial(jax.jit, static_argnums=0)
def fwd(fn, x):
  """``fn(x)`` under jit (one compile per shape instead of one per op and shape)."""
  return fn(x)


@functools.partial(jax.jit, static_argnums=0)
def grad_sum(fn, x):
  return jax.grad(lambda v: fn(v).sum())(x)


@functools.partial(jax.jit, static_argnums=0)
def vjp(fn, x, g):
  """Value and VJP of ``fn`` at ``x`` for cotangent ``g`` (jitted: one compile per shape)."""
  y, pullback = jax.vjp(fn, x)
  return y, pullback(g)[0]


# ----------------------------------------------------------------------------- forward
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", [(1000,), (3, 5), (2, 3, 13)])
def test_forward_fp32_matches_reference(name, shape):
  fn, ref, _, _ = FNS[name]
  x = rand(shape, seed=1)
  y = fwd(fn, x)
  assert y.dtype == jnp.float32 and y.shape == shape
  np.testing.assert_allclose(np.asarray(y, np.float64), ref(np.asarray(x)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_forward_fp32_wide_range_and_special_points(name):
  fn, ref, _, _ = FNS[name]
  x = np.concatenate([np.linspace(-15, 15, 3001), [0.0, -0.0, 1e-30, -1e-30, 50.0, -50.0]])
  x = x.astype(np.float32)
  y = np.asarray(fn(jnp.asarray(x)), np.float64)
  np.testing.assert_allclose(y, ref(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name,jax_fn", [("regelu2", lambda x: jax.nn.gelu(x, approximate=False)),
                                         ("resilu2", jax.nn.silu)])
def test_forward_fp32_matches_jax_nn(name, jax_fn):
  x = rand((4, 257), seed=2)
  np.testing.assert_allclose(np.asarray(fwd(FNS[name][0], x)), np.asarray(jax_fn(x)),
                             rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", list(LOW_DTYPES))
def test_forward_low_precision_keeps_dtype(name, dtype):
  fn, ref, _, _ = FNS[name]
  jdtype, rtol = LOW_DTYPES[dtype]
  x = rand((6, 67), seed=3, dtype=jdtype)
  y = fwd(fn, x)
  assert y.dtype == jdtype and y.shape == x.shape
  # Reference on the already-rounded input: only the output rounding differs.
  expected = ref(np.asarray(x.astype(jnp.float32)))
  # atol: the fp32 erf form loses relative accuracy in GELU's negative tail (|err| < 1e-6).
  np.testing.assert_allclose(np.asarray(y.astype(jnp.float32), np.float64), expected,
                             rtol=rtol, atol=1e-6)


# ----------------------------------------------------------------------------- backward
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", [(1001,), (3, 5), (7,), (2, 3, 13)])
def test_grad_fp32_is_exactly_g_times_step(name, shape):
  fn = FNS[name][0]
  x = rand(shape, seed=4, scale=4.0)
  g = rand(shape, seed=5, scale=1.0)
  _, dx = vjp(fn, x, g)
  assert dx.dtype == jnp.float32 and dx.shape == shape
  np.testing.assert_array_equal(np.asarray(dx), ref_grad(x, g, name))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", list(LOW_DTYPES))
def test_grad_low_precision(name, dtype):
  fn = FNS[name][0]
  jdtype, _ = LOW_DTYPES[dtype]
  x = rand((5, 33), seed=6, scale=4.0, dtype=jdtype)
  g = rand((5, 33), seed=7, scale=1.0, dtype=jdtype)
  _, dx = vjp(fn, x, g)
  assert dx.dtype == jdtype
  np.testing.assert_array_equal(np.asarray(dx.astype(jnp.float32)),
                                np.asarray(jnp.asarray(ref_grad(x, g, name)).astype(jnp.float32)))


@pytest.mark.parametrize("name", NAMES)
def test_grad_all_four_levels_near_thresholds(name):
  fn = FNS[name][0]
  c = DESIGN[name]["c"]
  # Points on each side of each threshold and far out: every flag value is hit.
  x = np.array([c[0] - 1.0, c[0] - 1e-3, c[0] + 1e-3, c[1] - 1e-3, c[1] + 1e-3,
                c[2] - 1e-3, c[2] + 1e-3, c[2] + 1.0, -100.0, 100.0], np.float32)
  expected_flag = np.array([0, 0, 1, 1, 2, 2, 3, 3, 0, 3])
  np.testing.assert_array_equal(ref_flag(x, name), expected_flag)
  dx = grad_sum(fn, jnp.asarray(x))
  np.testing.assert_array_equal(np.asarray(dx), ref_levels(name)[expected_flag])
  np.testing.assert_array_equal(np.asarray(FNS[name][3].code(jnp.asarray(x))), expected_flag)


@pytest.mark.parametrize("name", NAMES)
def test_derivative_functions(name):
  _, _, deriv, step = FNS[name]
  x = rand((4, 99), seed=8, scale=5.0)
  d = deriv(x)
  assert d.dtype == jnp.float32 and d.shape == x.shape
  np.testing.assert_array_equal(np.asarray(d), ref_levels(name)[ref_flag(x, name)])
  np.testing.assert_array_equal(np.asarray(step.derivative(x)), np.asarray(d))
  # Same derivative from a bf16 input (compared in fp32 after the cast).
  xb = x.astype(jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(deriv(xb)), ref_levels(name)[ref_flag(xb, name)])


@pytest.mark.parametrize("name", NAMES)
def test_library_constants_match_design(name):
  step = FNS[name][3]
  assert step.name == name
  assert step.thresholds == DESIGN[name]["c"]
  assert step.slopes == DESIGN[name]["a"]
  np.testing.assert_allclose(step.levels, ref_levels(name).astype(np.float64), rtol=1e-7)
  assert list(step.thresholds) == sorted(step.thresholds)


# ----------------------------------------------------------------------------- surrogate
@pytest.mark.parametrize("name", NAMES)
def test_surrogate_constraints(name):
  a = np.array(DESIGN[name]["a"])
  c = np.array(DESIGN[name]["c"])
  assert abs(a.sum() - 1.0) < 1e-12
  assert abs((a * c).sum()) < 1e-12
  levels = ref_levels(name)
  assert levels[0] == 0.0
  assert abs(float(levels[3]) - 1.0) < 1e-6


@pytest.mark.parametrize("name", NAMES)
def test_surrogate_formula_and_tails(name):
  step, ref = FNS[name][3], FNS[name][1]
  a, c = DESIGN[name]["a"], DESIGN[name]["c"]
  x = np.linspace(-12, 12, 2401).astype(np.float32)
  h = np.asarray(step.surrogate(jnp.asarray(x)), np.float64)
  h_ref = sum(ai * np.maximum(x.astype(np.float64) - ci, 0.0) for ai, ci in zip(a, c))
  np.testing.assert_allclose(h, h_ref, rtol=1e-5, atol=1e-5)
  # sum a = 1, sum a*c = 0  =>  h = 0 below c0 and h = x above c2.
  lo, hi = x < c[0], x > c[2]
  np.testing.assert_allclose(h[lo], 0.0, atol=0)
  np.testing.assert_allclose(h[hi], x[hi], rtol=1e-5, atol=1e-5)
  # It approximates the activation it was fitted to (loosely; max gap ~0.16 GELU, ~0.26 SiLU).
  assert np.abs(h - ref(x)).max() < {"regelu2": 0.2, "resilu2": 0.3}[name]


@pytest.mark.parametrize("name", NAMES)
def test_surrogate_numeric_derivative_matches_derivative(name):
  step, deriv = FNS[name][3], FNS[name][2]
  c = np.array(DESIGN[name]["c"])
  delta = 1e-2
  x = np.random.default_rng(0).uniform(-10, 10, size=4000)
  x = x[np.min(np.abs(x[:, None] - c[None, :]), axis=1) > 4 * delta].astype(np.float32)
  xj = jnp.asarray(x)
  h_plus, h_minus, d = jax.jit(
      lambda v: (step.surrogate(v + delta), step.surrogate(v - delta), deriv(v)))(xj)
  fd = (np.asarray(h_plus, np.float64) - np.asarray(h_minus, np.float64)) / (2 * delta)
  np.testing.assert_allclose(fd, np.asarray(d, np.float64), atol=2e-3)
  # And the custom_vjp gradient is that same derivative.
  np.testing.assert_allclose(np.asarray(grad_sum(FNS[name][0], xj)), fd, atol=2e-3)


# ----------------------------------------------------------------------------- residuals
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", [(3, 5), (7,), (2, 3, 13), (4, 8), (1,)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_only_residual_is_packed_code(name, shape, dtype):
  fn = FNS[name][0]
  x = rand(shape, seed=9, dtype=dtype)
  res = saved_residuals(lambda v: fn(v).sum(), x)
  n = math.prod(shape)
  assert len(res.items) == 1, res.table()
  (r,) = res.items
  assert r.dtype == "uint8"
  assert r.shape == (math.ceil(n / 4),)
  assert res.total_bytes == math.ceil(n / 4)


@pytest.mark.parametrize("name", NAMES)
def test_residual_under_jit_and_inside_larger_function(name):
  fn = FNS[name][0]
  x = rand((6, 10), seed=10)
  # jit inside: still one packed code of ceil(60/4) = 15 bytes.
  res = saved_residuals(jax.jit(lambda v: fn(v).sum()), x)
  assert [(r.dtype, r.shape) for r in res.items] == [("uint8", (15,))], res.table()
  # Exact activation saves a full-size array (the comparison point).
  exact = {"regelu2": activations.gelu, "resilu2": activations.silu}[name]
  assert saved_residuals(lambda v: exact(v).sum(), x).total_bytes >= x.size * 4


# ----------------------------------------------------------------------------- edge cases
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", [(0,), (0, 3), (2, 0, 5)])
def test_size_zero(name, shape):
  fn = FNS[name][0]
  x = jnp.zeros(shape, jnp.float32)
  y = fn(x)
  assert y.shape == shape and y.dtype == jnp.float32
  dx = grad_sum(fn, x)
  assert dx.shape == shape and dx.dtype == jnp.float32
  _, dx2 = vjp(fn, x, jnp.zeros(shape, jnp.float32))
  assert dx2.shape == shape


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 7, 13, 1001])
def test_sizes_not_divisible_by_four(name, n):
  fn = FNS[name][0]
  x = rand((n,), seed=n, scale=4.0)
  g = rand((n,), seed=n + 1, scale=1.0)
  y, dx = vjp(fn, x, g)
  np.testing.assert_allclose(np.asarray(y, np.float64), FNS[name][1](np.asarray(x)),
                             rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(dx), ref_grad(x, g, name))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int8, jnp.uint8, jnp.bool_])
def test_integer_input_raises_type_error(name, dtype):
  with pytest.raises(TypeError):
    FNS[name][0](jnp.ones((4,), dtype))


# ----------------------------------------------------------------------------- transformations
@pytest.mark.parametrize("name", NAMES)
def test_under_jit(name):
  fn = FNS[name][0]
  x = rand((3, 13), seed=11, scale=4.0)
  g = rand((3, 13), seed=12, scale=1.0)
  y = jax.jit(fn)(x)
  assert y.dtype == jnp.float32
  # Not bitwise: XLA fuses differently under jit (see the GELU tail note in the report).
  np.testing.assert_allclose(np.asarray(y), np.asarray(fn(x)), rtol=1e-6, atol=1e-6)
  dx = jax.jit(lambda v, w: jax.vjp(fn, v)[1](w)[0])(x, g)
  np.testing.assert_array_equal(np.asarray(dx), ref_grad(x, g, name))


@pytest.mark.parametrize("name", NAMES)
def test_under_vmap(name):
  fn = FNS[name][0]
  x = rand((4, 3, 7), seed=13, scale=4.0)
  g = rand((4, 3, 7), seed=14, scale=1.0)
  np.testing.assert_array_equal(np.asarray(jax.jit(jax.vmap(fn))(x)), np.asarray(fwd(fn, x)))
  # vmap of a per-example VJP: each example's packed code has its own ceil(21/4) bytes.
  dx = jax.jit(jax.vmap(lambda v, w: jax.vjp(fn, v)[1](w)[0]))(x, g)
  np.testing.assert_array_equal(np.asarray(dx), ref_grad(x, g, name))
  # grad of a vmapped function, and vmap with the cotangent unbatched.
  dx2 = jax.jit(jax.grad(lambda v, w: jnp.vdot(jax.vmap(fn)(v), w)))(x, g)
  np.testing.assert_array_equal(np.asarray(dx2), ref_grad(x, g, name))
  g0 = g[0]
  dx3 = jax.jit(jax.vmap(lambda v, w: jax.vjp(fn, v)[1](w)[0], in_axes=(0, None)))(x, g0)
  np.testing.assert_array_equal(np.asarray(dx3), ref_grad(x, jnp.broadcast_to(g0, x.shape), name))


@pytest.mark.parametrize("name", NAMES)
def test_under_scan(name):
  fn = FNS[name][0]
  x = rand((5, 7), seed=15, scale=4.0)
  g = rand((5, 7), seed=16, scale=1.0)

  def loss(v, w):
    def body(carry, rows):
      xr, wr = rows
      return carry + jnp.vdot(fn(xr), wr), None
    return jax.lax.scan(body, jnp.float32(0), (v, w))[0]

  np.testing.assert_array_equal(np.asarray(jax.jit(jax.grad(loss))(x, g)), ref_grad(x, g, name))
  # Residuals of a scanned sum: the stacked packed codes, 5 x ceil(7/4) bytes, nothing else.
  def loss_sum(v):
    return jax.lax.scan(lambda c, xr: (c + fn(xr).sum(), None), jnp.float32(0), v)[0]

  res = saved_residuals(loss_sum, x)
  assert [(r.dtype, r.shape) for r in res.items] == [("uint8", (5, 2))], res.table()


@pytest.mark.parametrize("name", NAMES)
def test_under_checkpoint(name):
  fn = FNS[name][0]
  x = rand((3, 11), seed=17, scale=4.0)
  g = rand((3, 11), seed=18, scale=1.0)
  loss = lambda v, w: jnp.vdot(fn(v), w)
  dx = jax.jit(jax.grad(jax.checkpoint(loss)))(x, g)
  np.testing.assert_array_equal(np.asarray(dx), ref_grad(x, g, name))
  policy = jax.checkpoint_policies.everything_saveable
  dx2 = jax.jit(jax.grad(jax.checkpoint(loss, policy=policy)))(x, g)
  np.testing.assert_array_equal(np.asarray(dx2), ref_grad(x, g, name))
  # Full remat of the function saves nothing but its argument.
  assert saved_residuals(jax.checkpoint(lambda v: fn(v).sum()), x).items == ()


@pytest.mark.parametrize("name", NAMES)
def test_nested_grad(name):
  fn = FNS[name][0]
  x = rand((4, 9), seed=19, scale=4.0)
  u = rand((4, 9), seed=20, scale=1.0)
  v = rand((4, 9), seed=21, scale=1.0)
  first = jax.grad(lambda y: fn(y).sum())
  # The surrogate derivative is piecewise constant: its own derivative is zero.
  second = jax.jit(jax.grad(lambda y: first(y).sum()))(x)
  np.testing.assert_array_equal(np.asarray(second), np.zeros(x.shape, np.float32))
  # Differentiating the backward with respect to its cotangent gives u * d(x).
  d_cot = jax.jit(jax.grad(
      lambda w, y, t: jnp.vdot(jax.grad(lambda z: jnp.vdot(fn(z), w))(y), t)))(v, x, u)
  np.testing.assert_array_equal(np.asarray(d_cot), ref_grad(x, u, name))
