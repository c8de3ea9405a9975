"""WTA-CRS under Mesa (``mesa8+wta-crs``): a sampled linear reading Mesa's code keeps only
the sampled rows of the code, its own indices and scales, and no rows of the value;
reading a code its producer keeps anyway (an MS norm's output, ``QTensor.kept``) it is
the exact linear on that code. Exact forward, dx and dbias; dW is the estimator on the sampled rows of
the dequantized activation. That the combination keeps no more than either part on a
LoRA step is checked in test_wta_lora (beside wta-crs's own peak, one compile less).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowmem_jax import quant
from lowmem_jax.dense import Dense
from lowmem_jax.memory import saved_residuals
from lowmem_jax.sampling import (DEFAULT_RATIO, KeyState, budget, linear_reference,
                                 sampled_weight_grad, sampling_probabilities, wta_crs_select)
from lowmem_jax.wta_crs import SampledLinear
from test_sampling import rand, skewed_rows

# (x shape, contracted axes, kernel's output axes, the code's axis and groups): a linear
# reading a block input coded as one group, and an out-projection reading o coded head-wise
CASES = [((2, 24, 16), 1, (12,), -1, 1), ((2, 12, 4, 8), 2, (16,), 2, 4)]


def _coded_reader(x_shape, contract, out_dims, axis, groups, kept=False):
  """(f(x, kernel, bias) -> y: the sampled linear on ``x`` carried with its code, as
  Mesa's shared site (``kept``: an MS norm) carries it; code(x) -> that QTensor; x,
  kernel, bias)."""
  lead = x_shape[:len(x_shape) - contract]
  x = skewed_rows(int(np.prod(lead)), int(np.prod(x_shape[len(lead):])), 1,
                  spread=5.0).reshape(x_shape)
  kernel = rand(x_shape[len(lead):] + out_dims, 2)
  bias = rand(out_dims, 3)
  strategy = SampledLinear(DEFAULT_RATIO)
  states = strategy.init_state()

  def code(x):
    return quant.quantize_tensor(x, quant.QuantState.create(groups), axis=axis,
                                 groups=groups, kept=kept)[0]

  def f(x, kernel, bias):
    y, _ = strategy.apply(states, Dense(contract, jnp.float32), code(x), kernel, bias,
                          contract=contract)
    return y

  return f, code, x, kernel, bias


def _value_and_vjp(fn, g, *args):
  y, vjp = jax.vjp(fn, *args)
  return (y,) + vjp(g)


@pytest.mark.parametrize("x_shape,contract,out_dims,axis,groups", CASES)
def test_dw_is_the_estimator_on_the_dequantized_rows(x_shape, contract, out_dims, axis,
                                                    groups):
  f, code, x, kernel, bias = _coded_reader(x_shape, contract, out_dims, axis, groups)
  lead = x_shape[:len(x_shape) - contract]
  rows, k = int(np.prod(lead)), budget(int(np.prod(lead)), DEFAULT_RATIO)
  g = rand(lead + out_dims, 4)

  @jax.jit  # one compile: eager, each op would compile on its own
  def ours_and_reference(x, kernel, bias, g):
    ours = _value_and_vjp(f, g, x, kernel, bias)
    exact = _value_and_vjp(lambda x, k, b: linear_reference(x, k, b, contract), g, x,
                           kernel, bias)
    # the sample: drawn from the value with the site's key folded with its count (0)
    x2d, g2d = x.reshape(rows, -1), g.reshape(rows, -1)
    idx, scale = wta_crs_select(sampling_probabilities(x2d), k, KeyState.create().step_key())
    # dW on those rows of what Mesa's backward sees: the dequantized code
    deq = code(x).dequantized().reshape(rows, -1)
    want = sampled_weight_grad(deq, g2d, idx, scale).reshape(kernel.shape)
    exact_rows = sampled_weight_grad(x2d, g2d, idx, scale).reshape(kernel.shape)
    return ours, exact, scale, want, exact_rows

  (y, dx, dk, db), (y0, dx0, _, db0), scale, want, exact_rows = ours_and_reference(
      x, kernel, bias, g)
  np.testing.assert_array_equal(y, y0)
  np.testing.assert_allclose(dx, dx0, rtol=1e-6, atol=1e-6 * float(jnp.abs(dx0).max()))
  np.testing.assert_allclose(db, db0, rtol=1e-6, atol=1e-6 * float(jnp.abs(db0).max()))
  assert 0 < int(jnp.sum(scale == 1.0)) < k  # winners kept and rows drawn
  np.testing.assert_allclose(dk, want, rtol=1e-6, atol=1e-6 * float(jnp.abs(want).max()))
  # and not the rows of the exact value: the test tells the two apart
  assert float(jnp.abs(exact_rows - want).max()) > 1e-4 * float(jnp.abs(want).max())


@pytest.mark.parametrize("x_shape,contract,out_dims,axis,groups", CASES)
def test_keeps_the_sampled_rows_of_the_code_and_no_rows_of_the_value(x_shape, contract,
                                                                     out_dims, axis, groups):
  f, _, x, kernel, bias = _coded_reader(x_shape, contract, out_dims, axis, groups)
  k = budget(int(np.prod(x_shape[:len(x_shape) - contract])), DEFAULT_RATIO)
  lead, in_dims = x_shape[:len(x_shape) - contract], x_shape[len(x_shape) - contract:]
  # 2x: an activation made inside (arguments are not counted as residuals)
  res = saved_residuals(lambda x, k_, b: jnp.sum(f(2.0 * x, k_, b)), x, kernel, bias)
  kept = {(r.shape, r.dtype) for r in res.items}
  # k of the code's rows (0.3 of it), not all of it; their indices
  assert ((k,) + in_dims, "uint8") in kept and ((k,), "int32") in kept, res.table()
  assert (x_shape, "uint8") not in kept, res.table()
  # no floating array of the input's rows, neither all of them nor k
  rows_shapes = {x_shape, (k,) + in_dims, (k, int(np.prod(in_dims))),
                 (int(np.prod(lead)), int(np.prod(in_dims)))}
  assert not [r for r in res.items if r.dtype != "uint8" and r.shape in rows_shapes], \
      res.table()


@pytest.mark.parametrize("x_shape,contract,out_dims,axis,groups", CASES)
def test_a_code_its_producer_keeps_is_read_exactly(x_shape, contract, out_dims, axis,
                                                   groups):
  """An MS norm keeps its output's code for its own backward: the reader's dW is Mesa's
  exact one from it (no sample, no indices), as a plain coded linear's."""
  f, code, x, kernel, bias = _coded_reader(x_shape, contract, out_dims, axis, groups,
                                           kept=True)
  lead = x_shape[:len(x_shape) - contract]
  g = rand(lead + out_dims, 4)

  @jax.jit
  def ours_and_mesa(x, kernel, bias, g):
    ours = _value_and_vjp(f, g, x, kernel, bias)
    mesa = _value_and_vjp(lambda x, k, b: quant.coded_vjp(
        lambda v, k, b: linear_reference(v, k, b, contract), [code(x)], (k, b)),
        g, x, kernel, bias)
    return ours, mesa

  ours, mesa = ours_and_mesa(x, kernel, bias, g)
  for a, b, name in zip(ours, mesa, ("y", "dx", "dkernel", "dbias")):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * float(jnp.abs(b).max()),
                               err_msg=name)
  res = saved_residuals(lambda x, k_, b: jnp.sum(f(2.0 * x, k_, b)), x, kernel, bias)
  assert not [r for r in res.items if r.dtype == "int32"], res.table()  # no indices


def test_bad_group_axis_raises():
  # groups along the rows (axis 1 of [2, 24, 16] for a linear contracting 1 axis)
  f, _, x, kernel, bias = _coded_reader((2, 24, 16), 1, (12,), 1, 4)
  with pytest.raises(ValueError, match="groups lie along axis 1"):
    jax.eval_shape(f, x, kernel, bias)

