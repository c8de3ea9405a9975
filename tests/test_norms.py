"""Tests for lowmem_jax.norms: MS-LayerNorm / MS-RMSNorm and the affine merge."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowmem_jax.memory import saved_residuals
from lowmem_jax.norms import layer_norm, merge_norm_affine, ms_layer_norm, ms_rms_norm, rms_norm

PAIRS = {
    "layer": (ms_layer_norm, layer_norm),
    "rms": (ms_rms_norm, rms_norm),
}
KINDS = tuple(PAIRS)
# Hidden sizes 8, 7, 12, 100, 33, 1, 768; every eps with a non-power-of-two hidden size.
SHAPE_EPS = [((4, 8), 1e-6), ((3, 7), 1e-6), ((3, 7), 1e-5), ((3, 7), 0.1), ((2, 5, 12), 0.1),
             ((6, 100), 1e-5), ((6, 100), 0.1), ((2, 3, 2, 33), 1e-6), ((5, 1), 1e-5),
             ((1, 768), 1e-6)]


def rand(shape, seed, scale=1.0, shift=0.0, dtype=jnp.float32):
  x = shift + scale * np.random.default_rng(seed).standard_normal(shape)
  return jnp.asarray(x.astype(np.float32)).astype(dtype)


def ref_norm64(x, kind, eps):
  """Independent float64 reference: (y, rstd) with eps inside the rsqrt, biased variance."""
  x = np.asarray(x, np.float64)
  if kind == "layer":
    xc = x - x.mean(-1, keepdims=True)
    rstd = 1.0 / np.sqrt((xc * xc).mean(-1, keepdims=True) + eps)
    return xc * rstd, rstd
  rstd = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
  return x * rstd, rstd


def ref_grad64(x, g, kind, eps):
  """DESIGN.md backward in float64: LN rstd*(g - mean g - y mean(g y)); RMS without mean g."""
  y, rstd = ref_norm64(x, kind, eps)
  g = np.asarray(g, np.float64)
  inner = g - y * (g * y).mean(-1, keepdims=True)
  if kind == "layer":
    inner = inner - g.mean(-1, keepdims=True)
  return rstd * inner


@functools.partial(jax.jit, static_argnums=(0, 3))
def value_and_vjp(fn, x, g, eps):
  y, pullback = jax.vjp(lambda v: fn(v, eps=eps), x)
  return y, pullback(g)[0]


@functools.partial(jax.jit, static_argnums=(0, 3))
def both_value_and_vjp(kind, x, g, eps):
  """(y_ms, dx_ms, y_std, dx_std) in one compile."""
  ms_fn, std_fn = PAIRS[kind]
  return value_and_vjp(ms_fn, x, g, eps) + value_and_vjp(std_fn, x, g, eps)


def assert_close(actual, desired, rtol=1e-5):
  """Relative to the array's scale: entries near zero are judged against the largest one."""
  actual = np.asarray(actual, np.float64)
  desired = np.asarray(desired, np.float64)
  np.testing.assert_allclose(actual, desired, rtol=rtol,
                             atol=rtol * max(1.0, float(np.abs(desired).max(initial=0.0))))


# ----------------------------------------------------------------------------- values and VJPs
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape,eps", SHAPE_EPS)
def test_matches_standard_norm_values_and_vjp(kind, shape, eps):
  # Small spread and an offset: var ~ 0.09, so eps = 0.1 changes the result a lot.
  x = rand(shape, seed=sum(shape), scale=0.3, shift=0.5)
  g = rand(shape, seed=sum(shape) + 1)
  y_ms, dx_ms, y_std, dx_std = both_value_and_vjp(kind, x, g, eps)
  assert y_ms.dtype == jnp.float32 and y_ms.shape == shape
  assert dx_ms.dtype == jnp.float32 and dx_ms.shape == shape
  assert_close(y_ms, y_std)
  assert_close(dx_ms, dx_std)
  # And both agree with the float64 formulas, eps included.
  assert_close(y_ms, ref_norm64(x, kind, eps)[0])
  assert_close(dx_ms, ref_grad64(x, g, kind, eps))


@pytest.mark.parametrize("kind", KINDS)
def test_eps_is_used(kind):
  ms_fn, _ = PAIRS[kind]
  x = rand((3, 16), seed=0, scale=0.3)
  g = rand((3, 16), seed=1)
  y_small, dx_small = value_and_vjp(ms_fn, x, g, 1e-6)
  y_big, dx_big = value_and_vjp(ms_fn, x, g, 0.1)
  assert np.abs(np.asarray(y_small) - np.asarray(y_big)).max() > 0.1
  assert np.abs(np.asarray(dx_small) - np.asarray(dx_big)).max() > 0.1
  # Default eps is 1e-6.
  np.testing.assert_array_equal(np.asarray(jax.jit(ms_fn)(x)), np.asarray(y_small))


@pytest.mark.parametrize("kind", KINDS)
def test_eager_call_matches(kind):
  ms_fn, std_fn = PAIRS[kind]
  x = rand((2, 9), seed=2, shift=1.0)
  assert_close(ms_fn(x), std_fn(x))
  assert_close(jax.grad(lambda v: (ms_fn(v) ** 3).sum())(x),
               jax.grad(lambda v: (std_fn(v) ** 3).sum())(x))


@pytest.mark.parametrize("kind", KINDS)
def test_output_statistics(kind):
  ms_fn, _ = PAIRS[kind]
  y = np.asarray(jax.jit(ms_fn)(rand((5, 64), seed=3, scale=2.0, shift=3.0)), np.float64)
  if kind == "layer":
    np.testing.assert_allclose(y.mean(-1), 0.0, atol=1e-6)
    np.testing.assert_allclose(y.var(-1), 1.0, rtol=1e-5)
  else:
    np.testing.assert_allclose((y * y).mean(-1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_dtype(kind, dtype):
  ms_fn, std_fn = PAIRS[kind]
  x = rand((4, 48), seed=4, shift=0.5, dtype=dtype)
  g = rand((4, 48), seed=5, dtype=dtype)
  y, dx = value_and_vjp(ms_fn, x, g, 1e-6)
  assert y.dtype == dtype and dx.dtype == dtype
  y_ref, dx_ref = value_and_vjp(std_fn, x.astype(jnp.float32), g.astype(jnp.float32), 1e-6)
  assert_close(y.astype(jnp.float32), y_ref, rtol=1e-2)
  assert_close(dx.astype(jnp.float32), dx_ref, rtol=3e-2)


# ----------------------------------------------------------------------------- residuals
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(4, 8), (3, 7), (2, 5, 12)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("name", [None, "n"])
def test_residuals_are_y_and_rstd_shared_with_matmul(kind, shape, dtype, name):
  ms_fn, std_fn = PAIRS[kind]
  x = rand(shape, seed=6, dtype=dtype)
  w = rand((shape[-1], 6), seed=7, dtype=dtype)
  rows = math.prod(shape[:-1])
  # With name= too: the tag is applied inside the rule, so it makes no second copy of y.
  res = saved_residuals(lambda v, k: (ms_fn(v, name=name) @ k).sum(), x, w)
  got = sorted(((r.dtype, r.shape) for r in res.items), key=str)
  want = sorted([(jnp.dtype(dtype).name, shape), ("float32", shape[:-1])], key=str)
  # The matmul saves the very same y: two arrays in all, not three.
  assert got == want, res.table()
  assert res.total_bytes == x.size * jnp.dtype(dtype).itemsize + rows * 4
  # The standard norm saves more than that for the same function.
  std = saved_residuals(lambda v, k: (std_fn(v) @ k).sum(), x, w)
  assert std.total_bytes > res.total_bytes, std.table()


@pytest.mark.parametrize("kind", KINDS)
def test_residuals_never_include_x_or_mean(kind):
  ms_fn, _ = PAIRS[kind]
  x = rand((3, 10), seed=8)
  # Alone: y + rstd, nothing else (in particular neither x nor the mean).
  res = saved_residuals(lambda v: ms_fn(v).sum(), x)
  assert sorted(((r.dtype, r.shape) for r in res.items), key=str) == sorted(
      [("float32", (3,)), ("float32", (3, 10))], key=str), res.table()
  assert res.total_bytes == 3 * 10 * 4 + 3 * 4


@pytest.mark.parametrize("kind", KINDS)
def test_name_tags_the_output(kind):
  ms_fn, std_fn = PAIRS[kind]
  x = rand((4, 6), seed=9)
  w = rand((6, 3), seed=10)
  policy = jax.checkpoint_policies.save_only_these_names("n")

  def make(fn, name):
    return jax.checkpoint(lambda v, k: (jnp.sin(fn(v, name=name)) @ k).sum(), policy=policy)

  # The matmul is the last op: under the policy only the tagged y is kept (rstd recomputed).
  last = jax.checkpoint(lambda v, k: (ms_fn(v, name="n") @ k).sum(), policy=policy)
  res = saved_residuals(last, x, w)
  assert [(r.dtype, r.shape) for r in res.items] == [("float32", (4, 6))], res.table()
  for fn in (ms_fn, std_fn):
    tagged = saved_residuals(make(fn, "n"), x, w)
    assert [(r.dtype, r.shape) for r in tagged.items] == [("float32", (4, 6))], tagged.table()
    assert "named 'n'" in tagged.items[0].source
    # Without the tag, or with another name, nothing is saved under this policy.
    assert saved_residuals(make(fn, None), x, w).items == ()
    assert saved_residuals(make(fn, "other"), x, w).items == ()
  # The tag changes neither value nor gradient.
  g = rand((4, 6), seed=11)
  tagged_fn = lambda v, name=None, eps=1e-6: ms_fn(v, eps=eps, name="n")
  y0, dx0 = value_and_vjp(ms_fn, x, g, 1e-6)
  y1, dx1 = value_and_vjp(tagged_fn, x, g, 1e-6)
  np.testing.assert_array_equal(np.asarray(y1), np.asarray(y0))
  np.testing.assert_array_equal(np.asarray(dx1), np.asarray(dx0))
  # Under the policy the gradient is unchanged too.
  loss = lambda v, k: (jnp.sin(ms_fn(v, name="n")) @ k).sum()
  np.testing.assert_allclose(
      np.asarray(jax.jit(jax.grad(jax.checkpoint(loss, policy=policy)))(x, w)),
      np.asarray(jax.jit(jax.grad(loss))(x, w)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_transforms(kind):
  ms_fn, std_fn = PAIRS[kind]
  x = rand((3, 4, 10), seed=12, shift=0.2)
  g = rand((3, 4, 10), seed=13)
  loss_ms = lambda v, c: jnp.vdot(ms_fn(v), c)
  loss_std = lambda v, c: jnp.vdot(std_fn(v), c)
  ref = jax.jit(jax.grad(loss_std))(x, g)
  assert_close(jax.jit(jax.vmap(jax.grad(loss_ms)))(x, g), ref)
  assert_close(jax.jit(jax.grad(jax.checkpoint(loss_ms)))(x, g), ref)

  def scanned(v, c):
    return jax.lax.scan(lambda acc, rc: (acc + loss_ms(*rc), None), jnp.float32(0), (v, c))[0]

  assert_close(jax.jit(jax.grad(scanned))(x, g), ref)


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("fn", [ms_layer_norm, ms_rms_norm, layer_norm, rms_norm])
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint8, jnp.bool_])
def test_integer_input_raises_type_error(fn, dtype):
  with pytest.raises(TypeError):
    fn(jnp.ones((2, 4), dtype))


@pytest.mark.parametrize("fn", [ms_layer_norm, ms_rms_norm, layer_norm, rms_norm])
def test_scalar_input_raises_value_error(fn):
  with pytest.raises(ValueError, match="scalar"):
    fn(jnp.float32(1.0))


@pytest.mark.parametrize("fn,affine", [(ms_layer_norm, 2), (ms_rms_norm, 1)])
def test_affine_given_to_an_ms_norm_is_a_clear_error(fn, affine):
  """An MS norm has no affine: passing one (as to the standard norm) names the fix."""
  x, scale = jnp.ones((2, 4)), jnp.ones(4)
  with pytest.raises(TypeError, match=r"takes no scale or bias.*merge_norm_affine"):
    fn(x, scale)
  with pytest.raises(TypeError, match=fn.__name__ + r"\(\) takes"):
    fn(x, *(scale,) * affine, 1e-6)


# ----------------------------------------------------------------------------- affine merge
def _affine_case(d_in, out_shape, seed, rms=False, with_bias=True, with_kernel_bias=True):
  rng = np.random.default_rng(seed)
  f32 = lambda a: jnp.asarray(np.asarray(a, np.float32))
  x = f32(rng.standard_normal((5, d_in)) * 0.7 + 0.3)
  scale = f32(1.0 + 0.5 * rng.standard_normal(d_in))
  bias = f32(0.5 * rng.standard_normal(d_in))
  kernel = f32(rng.standard_normal((d_in,) + out_shape) / math.sqrt(d_in))
  kbias = f32(0.5 * rng.standard_normal(out_shape))
  return (x, scale, None if (rms or not with_bias) else bias, kernel,
          kbias if with_kernel_bias else None)


def _linear(y, kernel, kbias):
  out = jnp.tensordot(y, kernel, axes=1, precision=jax.lax.Precision.HIGHEST)
  return out if kbias is None else out + kbias


@functools.partial(jax.jit, static_argnums=0)
def _merged_vs_affine(kind, x, scale, bias, kernel, kbias, new_w, new_b):
  """(ms_norm(x) @ W' + b', norm(x, scale, bias) @ W + b), compiled once per case."""
  if kind == "layer":
    want = _linear(layer_norm(x, scale, bias), kernel, kbias)
    got = _linear(ms_layer_norm(x), new_w, new_b)
  else:
    want = _linear(rms_norm(x, scale), kernel, kbias)
    got = _linear(ms_rms_norm(x), new_w, new_b)
  return got, want


@pytest.mark.parametrize("d_in,out_shape", [(16, (8,)), (12, (3, 5)), (7, (11,))])
@pytest.mark.parametrize("with_bias,with_kernel_bias", [(True, True), (True, False),
                                                        (False, True), (False, False)])
def test_merge_layer_norm_affine(d_in, out_shape, with_bias, with_kernel_bias):
  x, scale, bias, kernel, kbias = _affine_case(d_in, out_shape, seed=d_in,
                                               with_bias=with_bias,
                                               with_kernel_bias=with_kernel_bias)
  new_w, new_b = merge_norm_affine(scale, bias, kernel, kbias)
  assert new_w.shape == kernel.shape and new_w.dtype == jnp.float32
  if bias is None and kbias is None:
    assert new_b is None
  else:
    assert new_b.shape == out_shape and new_b.dtype == jnp.float32
  got, want = _merged_vs_affine("layer", x, scale, bias, kernel, kbias, new_w, new_b)
  assert got.shape == (5,) + out_shape
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  # The merge itself is the float64 formula, cast once.
  s64, w64 = np.asarray(scale, np.float64), np.asarray(kernel, np.float64)
  np.testing.assert_array_equal(
      np.asarray(new_w), (s64.reshape((d_in,) + (1,) * len(out_shape)) * w64).astype(np.float32))


@pytest.mark.parametrize("d_in,out_shape", [(16, (8,)), (12, (3, 5))])
@pytest.mark.parametrize("with_kernel_bias", [True, False])
def test_merge_rms_norm_affine(d_in, out_shape, with_kernel_bias):
  x, scale, _, kernel, kbias = _affine_case(d_in, out_shape, seed=d_in + 1, rms=True,
                                            with_kernel_bias=with_kernel_bias)
  new_w, new_b = merge_norm_affine(scale, None, kernel, kbias)
  if kbias is None:
    assert new_b is None
  else:
    np.testing.assert_array_equal(np.asarray(new_b), np.asarray(kbias))
  got, want = _merged_vs_affine("rms", x, scale, None, kernel, kbias, new_w, new_b)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_merge_without_scale():
  x, _, bias, kernel, kbias = _affine_case(10, (4,), seed=3)
  new_w, new_b = merge_norm_affine(None, bias, kernel, kbias)
  np.testing.assert_array_equal(np.asarray(new_w), np.asarray(kernel))
  got, want = _merged_vs_affine("layer", x, None, bias, kernel, kbias, new_w, new_b)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_merge_bf16_kernel_keeps_dtype():
  x, scale, bias, kernel, kbias = _affine_case(16, (2, 4), seed=4)
  kernel16 = kernel.astype(jnp.bfloat16)
  new_w, new_b = merge_norm_affine(scale, bias, kernel16, kbias.astype(jnp.bfloat16))
  assert new_w.dtype == jnp.bfloat16 and new_b.dtype == jnp.bfloat16
  assert new_w.shape == (16, 2, 4) and new_b.shape == (2, 4)
  got, want = _merged_vs_affine(
      "layer", x, scale, bias, kernel16.astype(jnp.float32),
      kbias.astype(jnp.bfloat16).astype(jnp.float32), new_w.astype(jnp.float32),
      new_b.astype(jnp.float32))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("case", ["scale", "bias", "kernel_bias", "kernel_bias_flat", "scalar"])
def test_merge_mismatched_shapes_raise(case):
  d_in = 8
  scale, bias = jnp.ones((d_in,)), jnp.zeros((d_in,))
  kernel, kbias = jnp.ones((d_in, 2, 3)), jnp.zeros((2, 3))
  if case == "scale":
    scale = jnp.ones((d_in + 1,))
  elif case == "bias":
    bias = jnp.zeros((d_in, 1))
  elif case == "kernel_bias":
    kbias = jnp.zeros((3, 2))
  elif case == "kernel_bias_flat":
    kbias = jnp.zeros((6,))
  else:
    kernel = jnp.float32(1.0)
  with pytest.raises(ValueError, match="merge_norm_affine"):
    merge_norm_affine(scale, bias, kernel, kbias)
