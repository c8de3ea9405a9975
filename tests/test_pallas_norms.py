"""The fused MS-LayerNorm / MS-RMSNorm Pallas kernels (interpret mode) against the jnp
path of lowmem_jax.norms (``ms_norm_fn(kind, "xla")``)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowmem_jax import norms
from lowmem_jax.memory import saved_residuals
from lowmem_jax.norms import ms_norm_fn
from pallas_kernels import norms as pn

KINDS = ("layer", "rms")
# dtype -> (jnp dtype, relative tolerance of y and dx against the jnp path).
DTYPES = {"float32": (jnp.float32, None), "bfloat16": (jnp.bfloat16, 2.0 ** -7),
          "float16": (jnp.float16, 2.0 ** -9)}


def rand(shape, seed, scale=1.0, shift=0.0, dtype=jnp.float32):
  x = shift + scale * np.random.default_rng(seed).standard_normal(shape)
  return jnp.asarray(x.astype(np.float32)).astype(dtype)


def f64(a):
  return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


@functools.partial(jax.jit, static_argnums=(0, 1, 4))
def value_and_vjp(kind, implementation, x, g, eps=1e-6):
  y, pullback = jax.vjp(lambda v: ms_norm_fn(kind, implementation)(v, eps=eps), x)
  return y, pullback(g)[0]


@functools.partial(jax.jit, static_argnums=(0, 2))
def jnp_rstd(kind, x, eps):
  """The fp32 rstd the jnp path saves."""
  return norms._STATS[kind](x, eps)[1][..., 0]


def assert_close(got, want, dtype, fp32_tol):
  _, rel = DTYPES[dtype]
  got, want = f64(got), f64(want)
  if rel is None:
    np.testing.assert_allclose(got, want, rtol=fp32_tol, atol=fp32_tol)
  else:  # one 16-bit rounding apart, measured against the array's scale
    scale = max(float(np.max(np.abs(want), initial=0.0)), 1.0)
    np.testing.assert_allclose(got, want, rtol=rel, atol=rel * scale)


def check_kernels(kind, shape, dtype="float32", max_block=pn.MAX_BLOCK, eps=1e-6, seed=0,
                  scale=1.0, shift=0.0):
  jdtype, _ = DTYPES[dtype]
  x = rand(shape, seed, scale, shift, jdtype)
  g = rand(shape, seed + 1, dtype=jdtype)
  y, rstd = pn.ms_norm_forward(kind, x, eps, interpret=True, max_block=max_block)
  y_ref, dx_ref = value_and_vjp(kind, "xla", x, g, eps)
  rstd_ref = jnp_rstd(kind, x, eps)
  assert y.dtype == jdtype and y.shape == shape
  assert rstd.dtype == jnp.float32 and rstd.shape == shape[:-1]
  assert_close(y, y_ref, dtype, 1e-6)
  np.testing.assert_allclose(f64(rstd), f64(rstd_ref), rtol=1e-6, atol=0)
  # Backward from the very residuals the jnp path saved.
  dx = pn.ms_norm_input_grad(kind, g, y_ref, rstd_ref, interpret=True, max_block=max_block)
  assert dx.dtype == jdtype and dx.shape == shape
  assert_close(dx, dx_ref, dtype, 1e-5)
  return y, rstd, dx


# ----------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(5, 1), (5, 7), (4, 33), (3, 100), (2, 768), (2, 3, 33)],
                         ids=str)
def test_kernels_fp32(kind, shape):
  check_kernels(kind, shape)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape,max_block", [((5, 7), 4), ((4, 33), 8), ((3, 100), 32),
                                             ((2, 768), 32), ((2, 2, 33), 32)], ids=str)
def test_kernels_several_column_blocks(kind, shape, max_block):
  """Rows longer than a block: sums and stores loop over masked column blocks."""
  assert shape[-1] > max_block
  check_kernels(kind, shape, max_block=max_block, seed=2)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("shape,max_block", [((4, 7), pn.MAX_BLOCK), ((3, 100), 32)], ids=str)
def test_kernels_low_precision(kind, dtype, shape, max_block):
  check_kernels(kind, shape, dtype, max_block, seed=4)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("max_block", [pn.MAX_BLOCK, 32])
def test_kernels_offset_input(kind, max_block):
  """A mean far from zero (LayerNorm subtracts it; RMSNorm does not). fp32 sums in another
  order differ by a few 1e-7 * |mean| * rstd, so compare with the float64 truth too."""
  x = rand((3, 100), 6, scale=0.5, shift=3.0)
  y, rstd = pn.ms_norm_forward(kind, x, 1e-6, interpret=True, max_block=max_block)
  xd = f64(x)
  centred = xd - xd.mean(-1, keepdims=True) if kind == "layer" else xd
  rstd_true = 1 / np.sqrt(np.mean(centred * centred, axis=-1) + 1e-6)
  np.testing.assert_allclose(f64(rstd), rstd_true, rtol=1e-6)
  np.testing.assert_allclose(f64(y), centred * rstd_true[:, None], rtol=0, atol=2e-6)
  np.testing.assert_allclose(f64(y), f64(value_and_vjp(kind, "xla", x, x)[0]), rtol=0, atol=4e-6)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(0, 7), (2, 0, 33), (0, 0)], ids=str)
def test_no_rows(kind, shape):
  x = jnp.zeros(shape, jnp.float32)
  y, rstd = pn.ms_norm_forward(kind, x, 1e-6, interpret=True)
  assert y.shape == shape and y.dtype == jnp.float32
  assert rstd.shape == shape[:-1] and rstd.dtype == jnp.float32
  dx = pn.ms_norm_input_grad(kind, x, y, rstd, interpret=True)
  assert dx.shape == shape and dx.dtype == jnp.float32
  for impl in ("pallas_interpret", "xla"):
    y, dx = value_and_vjp(kind, impl, x, x)
    assert y.shape == dx.shape == shape


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_empty_rows_keep_shape_and_dtype(kind, dtype):
  jdtype, _ = DTYPES[dtype]
  x = jnp.zeros((3, 0), jdtype)
  y, rstd = pn.ms_norm_forward(kind, x, 1e-6, interpret=True)
  assert y.shape == (3, 0) and y.dtype == jdtype
  assert rstd.shape == (3,) and rstd.dtype == jnp.float32
  dx = pn.ms_norm_input_grad(kind, x, y, rstd, interpret=True)
  assert dx.shape == (3, 0) and dx.dtype == jdtype
  y, dx = value_and_vjp(kind, "pallas_interpret", x, x)
  assert y.shape == dx.shape == (3, 0) and dx.dtype == jdtype


@pytest.mark.parametrize("kind", KINDS)
def test_eps_is_used(kind):
  shape, eps = (4, 33), 0.1
  # Small inputs: eps = 0.1 dominates the variance and changes the result a lot.
  y, rstd, dx = check_kernels(kind, shape, eps=eps, seed=8, scale=0.05, max_block=8)
  y0, rstd0, dx0 = check_kernels(kind, shape, eps=1e-6, seed=8, scale=0.05, max_block=8)
  assert np.all(f64(rstd) < 0.5 * f64(rstd0))
  assert np.max(np.abs(f64(y) - f64(y0))) > 0.1
  assert np.max(np.abs(f64(dx) - f64(dx0))) > 0.1
  np.testing.assert_allclose(f64(rstd), 1 / np.sqrt(
      (np.var if kind == "layer" else lambda v, axis: np.mean(v * v, axis=axis))(
          f64(rand(shape, 8, 0.05)), axis=-1) + eps), rtol=1e-5)


def test_bad_arguments():
  with pytest.raises(ValueError, match="unknown norm kind"):
    pn.ms_norm_forward("batch", jnp.ones((2, 3)), 1e-6, interpret=True)
  with pytest.raises(ValueError, match="unknown norm kind"):
    pn.ms_norm_input_grad("batch", jnp.ones((2, 3)), jnp.ones((2, 3)), jnp.ones((2,)),
                          interpret=True)
  with pytest.raises(ValueError, match="at least one axis"):
    pn.ms_norm_forward("rms", jnp.float32(1.0), 1e-6, interpret=True)
  with pytest.raises(ValueError):
    ms_norm_fn("batch", "pallas_interpret")
  with pytest.raises(ValueError, match="unknown norm implementation 'triton'"):
    ms_norm_fn("layer", "triton")


# ----------------------------------------------------------------------------- end to end
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("shape", [(5, 7), (2, 3, 100)], ids=str)
def test_ms_norm_fn_pallas_interpret_matches_xla(kind, dtype, shape):
  jdtype, _ = DTYPES[dtype]
  x = rand(shape, 10, dtype=jdtype)
  g = rand(shape, 11, dtype=jdtype)
  y, dx = value_and_vjp(kind, "pallas_interpret", x, g)
  y_ref, dx_ref = value_and_vjp(kind, "xla", x, g)
  assert y.dtype == dx.dtype == jdtype and y.shape == dx.shape == shape
  assert_close(y, y_ref, dtype, 1e-6)
  assert_close(dx, dx_ref, dtype, 1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_ms_norm_fn_pallas_interpret_grad_and_eps(kind):
  x = rand((6, 33), 12, scale=0.1)
  w = rand((33, 5), 13)

  def grads(impl, eps):
    loss = lambda v, w: jnp.sum(jnp.sin(ms_norm_fn(kind, impl)(v, eps=eps) @ w))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)

  for eps in (1e-6, 0.1):
    loss, (gx, gw) = grads("pallas_interpret", eps)
    loss_ref, (gx_ref, gw_ref) = grads("xla", eps)
    # The loss sums sin(y @ w): its fp32 rounding scales with sum(|y| @ |w|) (~20x |loss|
    # here), not with |loss|; a 1e-6 relative check sat at its figure (1.05e-6, layer).
    # One fp32 ulp of that scale: measured differences are 0 to 0.06 of it.
    y = ms_norm_fn(kind, "xla")(x, eps=eps)
    scale = float(jnp.sum(jnp.abs(y) @ jnp.abs(w))) * float(jnp.finfo(jnp.float32).eps)
    np.testing.assert_allclose(float(loss), float(loss_ref), rtol=0, atol=scale)
    # rstd ~ 10 here: fp32 cancellation in dx is ~1e-6 of the gradient's scale.
    for got, want in ((gx, gx_ref), (gw, gw_ref)):
      scale = float(jnp.max(jnp.abs(want)))
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * scale)
  assert abs(float(grads("pallas_interpret", 0.1)[0]) - float(grads("xla", 1e-6)[0])) > 1e-3


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(3, 10), (2, 4, 7)], ids=str)
def test_saved_residuals_are_y_and_fp32_rstd(kind, dtype, shape):
  jdtype, _ = DTYPES[dtype]
  x = rand(shape, 14, dtype=jdtype)
  fn = ms_norm_fn(kind, "pallas_interpret")
  want = sorted([(jnp.dtype(jdtype).name, shape), ("float32", shape[:-1])], key=str)
  rows = int(np.prod(shape[:-1]))
  nbytes = x.size * jnp.dtype(jdtype).itemsize + rows * 4
  res = saved_residuals(lambda v: fn(v).sum(), x)
  assert sorted(((r.dtype, r.shape) for r in res.items), key=str) == want, res.table()
  assert res.total_bytes == nbytes
  # Followed by a linear: the linear saves the very same y (two arrays in all).
  w = rand((shape[-1], 3), 15, dtype=jdtype)
  res = saved_residuals(lambda v, k: (fn(v, name="norm_out") @ k).sum(), x, w)
  assert sorted(((r.dtype, r.shape) for r in res.items), key=str) == want, res.table()
  assert res.total_bytes == nbytes
  xla = saved_residuals(lambda v, k: (ms_norm_fn(kind, "xla")(v) @ k).sum(), x, w)
  assert xla.total_bytes == res.total_bytes


def test_max_block_must_be_a_power_of_two():
  """Triton's ranges are powers of two: max_block=6 would fail obscurely on a GPU (accepted
  in interpret mode before), 0 divided by zero."""
  x = jnp.ones((2, 12), jnp.float32)
  for bad in (0, -1, 6):
    with pytest.raises(ValueError, match=f"max_block must be a power of two >= 1, got {bad}"):
      pn.ms_norm_forward("layer", x, 1e-6, interpret=True, max_block=bad)
  y, _ = pn.ms_norm_forward("layer", x, 1e-6, interpret=True, max_block=4)
  assert y.shape == x.shape
