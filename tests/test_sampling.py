"""Tests for lowmem_jax.sampling: WTA-CRS selection and the sampled linear layer."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowmem_jax.memory import saved_residuals
from lowmem_jax.sampling import (DEFAULT_RATIO, _sample_with_replacement, budget, crs_select,
                                 linear_reference, sample_tensor, sampled_linear,
                                 sampled_weight_grad, sampling_probabilities, wta_crs_linear,
                                 wta_crs_select)

NUM_DRAWS = 4000  # Monte Carlo estimates per statistical test (vmapped, one compile)


def rand(shape, seed, dtype=jnp.float32):
  x = np.random.default_rng(seed).standard_normal(shape)
  return jnp.asarray(x.astype(np.float32)).astype(dtype)


def skewed_rows(rows, cols, seed, spread=3.0):
  """Rows whose norms span ``exp(spread)``, shuffled: gives WTA-CRS a non-empty winner set."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((rows, cols)) * np.exp(np.linspace(0.0, spread, rows))[:, None]
  return jnp.asarray(x[rng.permutation(rows)].astype(np.float32))


def winners(p, k):
  """Numpy reference of the winner set: (|C|, P_C) from the definition, c in 1..k-1."""
  ps = np.sort(np.asarray(p, np.float64))[::-1]
  cs = np.cumsum(ps)
  num = sum(1 for c in range(1, k) if cs[c - 1] > c / k)
  return num, float(cs[num - 1]) if num else 0.0


@functools.partial(jax.jit, static_argnums=(0, 1))
def estimates(select, k, x2d, g2d, p, keys):
  """One sampled weight gradient per key: ``[len(keys), in, out]``."""
  return jax.vmap(lambda key: sampled_weight_grad(x2d, g2d, *select(p, k, key)))(keys)


@functools.partial(jax.jit, static_argnums=3)
def estimate_from_key(x2d, g2d, key, k):
  """The estimator on the rows WTA-CRS picks from ``||x_i||``: what dkernel must be."""
  idx, scale = wta_crs_select(sampling_probabilities(x2d), k, key)
  return sampled_weight_grad(x2d, g2d, idx, scale)


def max_z(samples, exact):
  """Largest elementwise |mean - exact| in standard errors of the mean (floored, for
  deterministic estimators)."""
  samples = np.asarray(samples, np.float64)
  se = samples.std(0, ddof=1) / math.sqrt(samples.shape[0])
  floor = 1e-6 * np.abs(exact).max()
  return float((np.abs(samples.mean(0) - exact) / np.maximum(se, floor)).max())


@functools.partial(jax.jit, static_argnames=("contract_ndim", "ratio"))
def layer_vjp(x, kernel, bias, key, g, row_weights=None, *, contract_ndim=1,
              ratio=DEFAULT_RATIO):
  """``(y, (dx, dkernel, dbias, drow_weights))`` of :func:`wta_crs_linear`, jitted; ``g``
  None: a cotangent of ones."""
  fn = lambda x, w, b, r: wta_crs_linear(x, w, b, key, ratio=ratio, row_weights=r,
                                         contract_ndim=contract_ndim)
  y, pullback = jax.vjp(fn, x, kernel, bias, row_weights)
  return y, pullback(jnp.ones_like(y) if g is None else g)


# ----------------------------------------------------------------------------- budget, p
def test_budget():
  assert budget(10, 0.3) == 3
  assert budget(10, 0.7) == 7  # not 8 from 0.7 * 10 = 7.000000000000001
  assert budget(128, DEFAULT_RATIO) == 39
  assert budget(3, 0.01) == 1
  assert budget(5, 1.0) == 5
  assert budget(1, 0.5) == 1


@pytest.mark.parametrize("ratio,shown", [(0.0, "0.0"), (-0.1, "-0.1"), (1.5, "1.5"),
                                         (float("nan"), "nan"), ("a", "'a'")])
def test_budget_rejects_bad_ratio(ratio, shown):
  with pytest.raises(ValueError, match=f"ratio must be .*got {shown}$"):
    budget(10, ratio)


def test_budget_rejects_bad_rows():
  with pytest.raises(ValueError, match="rows must be >= 1, got 0"):
    budget(0, 0.3)


def test_wta_crs_linear_of_no_rows_is_the_empty_linear():
  """Zero rows: nothing to sample; the exact (empty) output and gradients (it was a
  ZeroDivisionError inside a reshape)."""
  from lowmem_jax.sampling import wta_crs_linear
  x, kernel, bias = jnp.ones((0, 5, 4)), jnp.ones((4, 3)), jnp.ones((3,))
  y = wta_crs_linear(x, kernel, bias, jax.random.key(0))
  assert y.shape == (0, 5, 3) and y.dtype == x.dtype
  grads = jax.grad(lambda x, k, b: wta_crs_linear(x, k, b, jax.random.key(0)).sum(),
                   argnums=(0, 1, 2))(x, kernel, bias)
  assert [g.shape for g in grads] == [(0, 5, 4), (4, 3), (3,)]
  assert not any(np.any(np.asarray(g)) for g in grads)
  from lowmem_jax.sampling import sample_tensor, select
  assert sample_tensor(x, jax.random.key(0)).is_whole  # a shared sample of no rows
  with pytest.raises(ValueError, match=r"select: x\[0, 5, 4\] has no rows to sample"):
    select(x, jax.random.key(0))


def test_sampling_probabilities():
  x = jnp.asarray([[3.0, 4.0], [0.0, 0.0], [1.0, 0.0], [0.0, 0.0]])
  np.testing.assert_allclose(sampling_probabilities(x), [5 / 6, 0, 1 / 6, 0], rtol=1e-6)
  w = jnp.asarray([0.0, 1.0, 2.0, 1.0])
  np.testing.assert_allclose(sampling_probabilities(x, w), [0, 0, 1, 0], rtol=1e-6)
  np.testing.assert_allclose(sampling_probabilities(jnp.zeros((4, 2))), [0.25] * 4)
  np.testing.assert_allclose(sampling_probabilities(x, jnp.zeros(4)), [0.25] * 4)
  p = sampling_probabilities(x.astype(jnp.bfloat16))
  assert p.dtype == jnp.float32


# ----------------------------------------------------------------------------- selection
def test_select_follows_the_definition():
  x = skewed_rows(40, 4, seed=0)
  p = sampling_probabilities(x)
  k = budget(40, 0.3)
  num, _ = winners(p, k)
  assert num > 0
  order = np.argsort(-np.asarray(p), kind="stable")
  for seed in range(3):
    idx, scale = jax.jit(wta_crs_select, static_argnums=1)(p, k, jax.random.key(seed))
    idx, scale = np.asarray(idx), np.asarray(scale)
    assert idx.shape == (k,) and idx.dtype == np.int32 and scale.dtype == np.float32
    np.testing.assert_array_equal(idx[:num], order[:num])  # winners, scale 1
    np.testing.assert_array_equal(scale[:num], 1.0)
    assert not set(idx[num:]) & set(order[:num])  # draws come from outside C
    rest = 1.0 - np.asarray(p)[order[:num]].sum()
    np.testing.assert_allclose(scale[num:], rest / ((k - num) * np.asarray(p)[idx[num:]]),
                               rtol=1e-4)


def test_select_is_nan_free_when_winners_hold_all_mass():
  p = jnp.asarray([0.5, 0.0, 0.5, 0.0, 0.0])  # k=4: |C| = 3, 1 - P_C = 0
  key = jax.random.key(0)
  for select in (wta_crs_select, crs_select):
    idx, scale = jax.jit(select, static_argnums=1)(p, 4, key)
    assert np.all(np.isfinite(scale))
    assert np.all(np.asarray(scale)[np.asarray(p)[np.asarray(idx)] == 0] == 0)
    if select is wta_crs_select:
      assert sorted(np.asarray(idx)[np.asarray(scale) > 0]) == [0, 2]
  idx, scale = jax.jit(wta_crs_select, static_argnums=1)(jnp.zeros(5), 4, key)
  np.testing.assert_array_equal(scale, 0.0)


def _frequency_z(weights, drawn_from, seed=0, m=200_000):
  """Pearson's chi-square of ``m`` draws from ``drawn_from`` against ``weights``'s
  frequencies, as a standard normal (Wilson-Hilferty): about N(0, 1) where they agree."""
  idx, _ = _sample_with_replacement(jax.random.key(seed), jnp.asarray(drawn_from, jnp.float32), m)
  counts = np.bincount(np.asarray(idx), minlength=len(weights))
  expected = m * np.asarray(weights) / np.sum(weights)
  chi2, df = np.sum((counts - expected) ** 2 / expected), len(weights) - 1
  return ((chi2 / df) ** (1 / 3) - (1 - 2 / (9 * df))) / np.sqrt(2 / (9 * df))


def test_draws_follow_the_weights_and_the_check_has_power():
  """Each row is drawn with probability weight / total: the unbiasedness checks catch a
  bias only above ~3% (drawing from weights**1.1 passed them). Over 200k draws: z within
  [-1.8, 1.5] for 10 seeds; from weights**1.1, z of 20-23 (and 6-8 from weights**1.03)."""
  w = np.random.default_rng(0).gamma(0.5, size=20) + 1e-3
  assert abs(_frequency_z(w, w)) < 5
  assert _frequency_z(w, w ** 1.1) > 10


def test_select_rejects_bad_k():
  with pytest.raises(ValueError, match="k must be an int in \\[1, 5\\]"):
    wta_crs_select(jnp.full(5, 0.2), 6, jax.random.key(0))
  with pytest.raises(ValueError, match="k must be"):
    crs_select(jnp.full(5, 0.2), 0, jax.random.key(0))


@pytest.mark.parametrize("nonzero", [3, 5])
def test_concentrated_p_gives_the_exact_gradient(nonzero):
  # k = 5. Fewer than k nonzero rows are all winners; exactly k rows with distinct norms
  # give k-1 winners and one draw that can only land on the last nonzero row (scale 1).
  rows, k = 16, 5
  x = np.zeros((rows, 6), np.float32)
  where = np.random.default_rng(1).permutation(rows)[:nonzero]
  x[where] = np.asarray(rand((nonzero, 6), 2)) * (1.0 + np.arange(nonzero))[:, None]
  x, kernel, g = jnp.asarray(x), rand((6, 3), 3), rand((rows, 3), 4)
  exact = x.T @ g
  for seed in range(4):
    _, (_, dkernel, _, _) = layer_vjp(x, kernel, None, jax.random.key(seed), g, ratio=k / rows)
    np.testing.assert_allclose(dkernel, exact, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- statistics
def test_wta_crs_is_unbiased_and_the_check_has_power():
  rows = 24
  k = budget(rows, 0.3)
  x, g = skewed_rows(rows, 3, seed=0), rand((rows, 2), 1)
  p = sampling_probabilities(x)
  num, p_c = winners(p, k)
  assert num > 0 and p_c < 0.9  # winners and draws both matter
  exact = np.asarray(x, np.float64).T @ np.asarray(g, np.float64)
  keys = jax.random.split(jax.random.key(7), NUM_DRAWS)

  assert max_z(estimates(wta_crs_select, k, x, g, p, keys), exact) < 5
  assert max_z(estimates(crs_select, k, x, g, p, keys), exact) < 5

  # The same check rejects biased variants: draws without the (1 - P_C) factor, and the
  # top-k rows alone with scale 1.
  def without_rest_factor(p, k, key):
    idx, scale = wta_crs_select(p, k, key)
    return idx, jnp.where(jnp.arange(k) < num, scale, scale / (1.0 - p_c))

  def top_k_only(p, k, key):
    del key
    return jax.lax.top_k(p, k)[1], jnp.ones(k, jnp.float32)

  assert max_z(estimates(without_rest_factor, k, x, g, p, keys), exact) > 10
  assert max_z(estimates(top_k_only, k, x, g, p, keys), exact) > 10


@pytest.mark.parametrize("use_g_norm", [False, True])
def test_wta_crs_has_lower_error_than_crs(use_g_norm):
  rows = 24
  k = budget(rows, 0.3)
  x, g = skewed_rows(rows, 3, seed=0), rand((rows, 2), 1)
  p = sampling_probabilities(x, jnp.linalg.norm(g, axis=1) if use_g_norm else None)
  assert winners(p, k)[0] > 0
  exact = x.T @ g
  keys = jax.random.split(jax.random.key(3), NUM_DRAWS)
  mse = {s.__name__: float(jnp.mean(jnp.sum((estimates(s, k, x, g, p, keys) - exact) ** 2,
                                            axis=(1, 2))))
         for s in (wta_crs_select, crs_select)}
  assert mse["wta_crs_select"] < 0.8 * mse["crs_select"], mse


# ----------------------------------------------------------------------------- the layer
def layer_args(x_shape, contract_ndim, out_dims, dtype, seed=0):
  in_dims = x_shape[len(x_shape) - contract_ndim:]
  x = rand(x_shape, seed, dtype)
  kernel = rand(in_dims + out_dims, seed + 1, dtype) / math.sqrt(math.prod(in_dims))
  bias = rand(out_dims, seed + 2, dtype)
  return x, kernel, bias


LAYER_CASES = [((2, 6, 8), 1, (5,)), ((2, 6, 3, 4), 2, (8,)), ((7, 4), 1, (2, 3))]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("x_shape,contract_ndim,out_dims", LAYER_CASES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_forward_is_the_exact_linear(dtype, x_shape, contract_ndim, out_dims, with_bias):
  x, kernel, bias = layer_args(x_shape, contract_ndim, out_dims, dtype)
  bias = bias if with_bias else None
  key = jax.random.key(0)
  y = wta_crs_linear(x, kernel, bias, key, contract_ndim=contract_ndim)
  ref = linear_reference(x, kernel, bias, contract_ndim)
  assert y.dtype == dtype and y.shape == x_shape[:len(x_shape) - contract_ndim] + out_dims
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(ref, np.float32))
  # Independent check of the reference itself (fp32 inputs, loose for bf16 rounding).
  x64, w64 = np.asarray(x, np.float64), np.asarray(kernel, np.float64)
  want = np.tensordot(x64, w64, axes=contract_ndim)
  if with_bias:
    want = want + np.asarray(bias, np.float64)
  tol = 1e-5 if dtype == jnp.float32 else 3e-2
  np.testing.assert_allclose(np.asarray(ref, np.float64), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("x_shape,contract_ndim,out_dims", LAYER_CASES)
def test_dx_dbias_exact_and_dkernel_is_the_estimator(x_shape, contract_ndim, out_dims):
  x, kernel, bias = layer_args(x_shape, contract_ndim, out_dims, jnp.float32)
  key = jax.random.key(5)
  lead = x_shape[:len(x_shape) - contract_ndim]
  g = rand(lead + out_dims, 9)
  y, (dx, dkernel, dbias, _) = layer_vjp(x, kernel, bias, key, g, contract_ndim=contract_ndim)
  _, ref_pullback = jax.vjp(lambda x, w, b: linear_reference(x, w, b, contract_ndim),
                            x, kernel, bias)
  ref_dx, ref_dkernel, ref_dbias = ref_pullback(g)
  np.testing.assert_array_equal(y, linear_reference(x, kernel, bias, contract_ndim))
  np.testing.assert_allclose(dx, ref_dx, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(dbias, ref_dbias, rtol=1e-6, atol=1e-6)
  assert dkernel.shape == kernel.shape
  # dkernel is exactly the estimator on the rows chosen from ||x_i||.
  rows = math.prod(y.shape[:y.ndim - len(out_dims)])
  want = estimate_from_key(x.reshape(rows, -1), g.reshape(rows, -1), key,
                           budget(rows, DEFAULT_RATIO)).reshape(kernel.shape)
  np.testing.assert_allclose(dkernel, want, rtol=1e-6, atol=1e-6)
  assert not np.allclose(dkernel, ref_dkernel, rtol=1e-3)  # a sample, not the exact one


def test_bf16_cotangent_dtypes():
  x, kernel, bias = layer_args((2, 6, 3, 4), 2, (8,), jnp.bfloat16)
  rw = jnp.ones((2, 6), jnp.bfloat16)
  _, (dx, dkernel, dbias, drw) = layer_vjp(x, kernel, bias, jax.random.key(0), None, rw,
                                           contract_ndim=2)
  assert (dx.dtype, dkernel.dtype, dbias.dtype, drw.dtype) == (jnp.bfloat16,) * 4
  np.testing.assert_allclose(np.asarray(drw, np.float32), 8.0)  # ||g_i||^2, 8 ones


def test_weights_as_stored_are_cast_inside_and_kept_as_given():
  """bf16 x with fp32 weights (as stored): the forward casts them; backward keeps them
  as given (arguments: alive anyway), no bf16 copy; their cotangents are fp32."""
  x, kernel, bias = layer_args((2, 6, 8), 1, (5,), jnp.float32)
  x = x.astype(jnp.bfloat16)
  key = jax.random.key(0)
  y, (dx, dkernel, dbias, _) = layer_vjp(x, kernel, bias, key, None)
  want = linear_reference(x, kernel.astype(jnp.bfloat16), bias.astype(jnp.bfloat16))
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))
  assert (y.dtype, dx.dtype, dkernel.dtype, dbias.dtype) == (
      jnp.bfloat16, jnp.bfloat16, jnp.float32, jnp.float32)
  res = saved_residuals(lambda x, w, b: wta_crs_linear(x, w, b, key).sum(), x, kernel, bias)
  assert not [r for r in res.items if r.shape in (kernel.shape, bias.shape)], res.table()


@pytest.mark.parametrize("dtype,contract_ndim", [(jnp.float32, 1), (jnp.bfloat16, 2)])
def test_saves_only_the_selected_rows(dtype, contract_ndim):
  x_shape = (4, 32, 16) if contract_ndim == 1 else (4, 32, 4, 4)
  x, kernel, bias = layer_args(x_shape, contract_ndim, (8,), dtype)
  rw = jnp.ones((4, 32), jnp.float32)
  rows, width, k = 128, 16, budget(128, DEFAULT_RATIO)
  key = jax.random.key(0)
  fn = lambda x, w, b, r: wta_crs_linear(x, w, b, key, row_weights=r,
                                         contract_ndim=contract_ndim).sum()
  res = saved_residuals(fn, x, kernel, bias, rw)
  # The kernel and row_weights are saved too, but they are arguments (alive anyway).
  got = sorted((r.shape, r.dtype) for r in res.items)
  assert got == sorted([((k, width), np.dtype(dtype).name), ((k,), "int32"),
                        ((k,), "float32")]), res.table()
  assert all(math.prod(r.shape) < rows * width for r in res.items)
  assert res.total_bytes == k * width * np.dtype(dtype).itemsize + 8 * k
  # The plain linear saves all of x for comparison.
  plain = saved_residuals(lambda x, w, b: jnp.sum(jnp.tanh(x) @ w + b), x.reshape(rows, -1),
                          kernel.reshape(width, -1), bias)
  assert any(math.prod(r.shape) == rows * width for r in plain.items)


def test_zero_weight_rows_are_never_selected():
  rows, k = 32, budget(32, 0.3)
  x = skewed_rows(rows, 4, seed=2)
  weights = jnp.asarray((np.arange(rows) % 3 != 0).astype(np.float32))  # 0 = padding
  p = sampling_probabilities(x, weights)
  keys = jax.random.split(jax.random.key(0), 500)
  idx, scale = jax.jit(jax.vmap(lambda key: wta_crs_select(p, k, key)))(keys)
  assert np.all(np.asarray(weights)[np.asarray(idx)][np.asarray(scale) > 0] == 1)
  # End to end: what padding rows hold does not change the weight gradient.
  kernel, g = rand((4, 3), 1), rand((rows, 3), 2)
  garbage = jnp.where(weights[:, None] > 0, x, 1e3 * rand((rows, 4), 3))

  dkernel = lambda x: layer_vjp(x, kernel, None, keys[0], g, weights)[1][1]
  np.testing.assert_array_equal(dkernel(x), dkernel(garbage))


def test_row_weights_cotangent_is_the_squared_gradient_norm():
  x, kernel, bias = layer_args((3, 5, 8), 1, (4,), jnp.float32)
  g = rand((3, 5, 4), 7)
  key = jax.random.key(1)
  rw = jnp.ones((3, 5))
  _, (_, _, _, drw) = layer_vjp(x, kernel, bias, key, g, rw)
  np.testing.assert_allclose(drw, jnp.sum(g * g, axis=-1), rtol=1e-6)

  # A per-example cache broadcast to tokens receives the per-example sum of ||g||^2.
  def loss(cache):
    y = wta_crs_linear(x, kernel, bias, key, row_weights=jnp.broadcast_to(cache[:, None], (3, 5)))
    return jnp.sum(y * g)

  np.testing.assert_allclose(jax.jit(jax.grad(loss))(jnp.ones(3)), jnp.sum(g * g, axis=(1, 2)),
                             rtol=1e-6)


def bad_input_cases():
  x, kernel, bias = layer_args((2, 6, 8), 1, (5,), jnp.float32)
  key = jax.random.key(0)
  ok = dict(x=x, kernel=kernel, bias=bias, key=key)
  return [
      (dict(ok, kernel=rand((7, 5), 0)), "do not match"),
      (dict(ok, contract_ndim=0), "contract_ndim must be an int in \\[1, 2\\]"),
      (dict(ok, contract_ndim=3), "contract_ndim must be"),
      (dict(ok, contract_ndim=2), "do not match"),
      (dict(ok, ratio=0.0), "ratio must be in \\(0, 1\\], got 0.0"),
      (dict(ok, ratio=2), "ratio must be in \\(0, 1\\], got 2"),
      (dict(ok, row_weights=jnp.ones((2, 5))), "row_weights has shape \\[2, 5\\]"),
      (dict(ok, row_weights=jnp.ones((2, 6), jnp.int32)), "row_weights must be floating"),
      (dict(ok, bias=jnp.ones(4)), "bias has shape \\[4\\]"),
      (dict(ok, kernel=kernel.astype(jnp.int32)), "kernel must be floating point, got int32"),
      (dict(ok, bias=bias.astype(jnp.int32)), "bias must be floating point, got int32"),
      (dict(ok, x=jnp.ones((2, 6, 8), jnp.int32), kernel=jnp.ones((8, 5), jnp.int32)),
       "x must be floating"),
      (dict(ok, key=0), "key must be a PRNG key"),
      (dict(ok, key=jnp.zeros(2, jnp.float32)), "key must be a PRNG key"),
      (dict(ok, key=jax.random.split(key, 2)), "single PRNG key"),
  ]


@pytest.mark.parametrize("case", range(15))
def test_bad_inputs_raise(case):
  kwargs, match = bad_input_cases()[case]
  kwargs = dict(kwargs)
  args = [kwargs.pop(n) for n in ("x", "kernel", "bias", "key")]
  with pytest.raises(ValueError, match=match):
    wta_crs_linear(*args, **kwargs)


def test_inside_jit_and_grad_of_a_bigger_function():
  x = rand((2, 8, 6), 0)
  w1, w2 = rand((6, 10), 1) / 3, rand((10, 4), 2) / 3
  b1, b2 = rand((10,), 3), rand((4,), 4)

  def loss(params, x, key, layer):
    w1, b1, w2, b2 = params
    k1, k2 = jax.random.split(key)
    h = jnp.tanh(layer(x, w1, b1, k1))
    return jnp.sum(jnp.sin(layer(h, w2, b2, k2)))

  sampled = lambda x, w, b, key: wta_crs_linear(x, w, b, key, ratio=0.25)
  exact = lambda x, w, b, key: linear_reference(x, w, b)
  grad = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=3)
  params = (w1, b1, w2, b2)
  key = jax.random.key(0)
  (gw1, gb1, gw2, gb2), gx = grad(params, x, key, sampled)
  (_, rb1, _, rb2), rx = grad(params, x, key, exact)
  # Input and bias gradients flow through exact dx: equal to plain autodiff.
  np.testing.assert_allclose(gx, rx, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(gb1, rb1, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(gb2, rb2, rtol=1e-5, atol=1e-6)
  # The same key repeats, another key differs.
  again = grad(params, x, jax.random.key(0), sampled)
  np.testing.assert_array_equal(again[0][0], gw1)
  np.testing.assert_array_equal(again[0][2], gw2)
  other = grad(params, x, jax.random.key(1), sampled)
  assert not np.allclose(other[0][0], gw1)
  assert not np.allclose(other[0][2], gw2)
  # A raw uint32[2] key works and draws the same rows as the typed key with that data.
  raw = grad(params, x, jax.random.PRNGKey(0), sampled)
  np.testing.assert_array_equal(raw[0][0], gw1)


def test_vmap_over_keys_of_the_layer():
  x, kernel, bias = layer_args((16, 4), 1, (3,), jnp.float32)
  g = rand((16, 3), 5)

  keys = jax.random.split(jax.random.key(0), 3)
  batched = jax.jit(jax.vmap(lambda key: layer_vjp(x, kernel, bias, key, g)[1][1]))(keys)
  for i in range(3):
    np.testing.assert_allclose(batched[i], layer_vjp(x, kernel, bias, keys[i], g)[1][1],
                               rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- shared sample
def test_a_linear_on_a_shared_sample_is_the_sampled_linear_on_its_rows():
  """Reading a SampledTensor made with a key gives what wta_crs_linear gives with that
  key: values and every cotangent, row weights' included."""
  x, kernel, bias = layer_args((2, 6, 8), 1, (5,), jnp.float32)
  key, rw, g = jax.random.key(3), jnp.abs(rand((2, 6), 4)) + 0.1, rand((2, 6, 5), 5)
  shared = lambda x, w, b, r: sampled_linear(x, w, b, sample_tensor(x, key, row_weights=r))
  y, pullback = jax.vjp(shared, x, kernel, bias, rw)
  y0, grads0 = layer_vjp(x, kernel, bias, key, g, rw)
  np.testing.assert_array_equal(y, y0)
  for got, want in zip(pullback(g), grads0):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match="is not the sampled value"):
    sampled_linear(x[:, :3], kernel, bias, sample_tensor(x, key))
  with pytest.raises(ValueError, match=">= 2 axes"):
    sample_tensor(x[0, 0], key)
