"""The lean exact baseline: each op is the plain function, keeping only its inputs for
backward. Values and gradients against plain autodiff of the same function (fp32,
highest precision) and what the jaxpr keeps."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowmem_jax import baseline, norms
from lowmem_jax.dense import Dense
from lowmem_jax.memory import saved_residuals
from lowmem_jax.policy import MemoryPolicy


def _rand(shape, seed, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def _value_and_grads(fn, *args):
  """fn's value and the gradient of a non-trivial scalar of it w.r.t. every argument."""
  def loss(*a):
    y = fn(*a)
    return jnp.sum(jnp.sin(y.astype(jnp.float32)) * jnp.arange(y.size).reshape(y.shape) / y.size)
  return fn(*args), jax.grad(loss, argnums=tuple(range(len(args))))(*args)


def _assert_same(lean, plain, *args, rtol=1e-6, atol=1e-6):
  (y1, g1), (y2, g2) = _value_and_grads(lean, *args), _value_and_grads(plain, *args)
  np.testing.assert_allclose(y1, y2, rtol=rtol, atol=atol)
  for a, b in zip(g1, g2, strict=True):
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


X = (3, 5, 16)


@pytest.mark.parametrize("kind", ["gelu", "silu"])
def test_lean_activations_are_the_exact_ones(kind):
  x = 3 * _rand(X, 0)
  _assert_same(baseline.lean_activation(kind), baseline.EXACT_ACTIVATIONS[kind], x)
  lean = MemoryPolicy().activation_strategy(kind, gated=True)
  plain = MemoryPolicy.parse("plain").activation_strategy(kind, gated=True)
  _assert_same(lean, plain, x, _rand(X, 1))


def test_lean_norms_are_the_standard_ones():
  x, s, b = 2 + 3 * _rand(X, 0), 1 + _rand(X[-1:], 1), _rand(X[-1:], 2)
  _assert_same(lambda x, s, b: baseline.lean_layer_norm(x, s, b, 1e-5),
               lambda x, s, b: norms.layer_norm(x, s, b, 1e-5), x, s, b)
  _assert_same(lambda x, s: baseline.lean_rms_norm(x, s, 1e-5),
               lambda x, s: norms.rms_norm(x, s, 1e-5), x, s)
  _assert_same(lambda x: baseline.lean_layer_norm(x), norms.layer_norm, x)


@pytest.mark.parametrize("contract", [1, 2])
def test_the_lean_linear_is_the_dense_function(contract):
  x = _rand(X, 0)
  kernel = _rand(X[-contract:] + (7,), 1)
  bias = _rand((7,), 2)
  dense = Dense(contract, jnp.float32)
  lean = functools.partial(baseline.Linear(lean=True), dense, contract=contract)
  plain = functools.partial(baseline.Linear(lean=False), dense, contract=contract)
  _assert_same(lean, plain, x, kernel, bias)
  _assert_same(lambda x, k: lean(x, k, None), lambda x, k: plain(x, k, None), x, kernel)


def _kept(fn, *args):
  """(dtype, shape) of what fn's backward keeps, arguments excluded."""
  return sorted((r.dtype, r.shape) for r in saved_residuals(fn, *args).items)


def test_lean_ops_keep_only_their_inputs():
  x, u = _rand(X, 0, jnp.bfloat16), _rand(X, 1, jnp.bfloat16)
  gelu = lambda x: baseline.lean_activation("gelu")(x * 2)
  assert _kept(gelu, x) == [("bfloat16", X)]
  # plain autodiff of jax.nn.gelu keeps more than its input
  assert len(_kept(lambda x: baseline.EXACT_ACTIVATIONS["gelu"](x * 2), x)) > 1
  swiglu = MemoryPolicy().activation_strategy("silu", gated=True)
  assert _kept(lambda g, u: swiglu(g * 2, u * 2), x, u) == [("bfloat16", X)] * 2
  s = jnp.ones(X[-1:], jnp.float32)
  assert _kept(lambda x: baseline.lean_layer_norm(x * 2, s, s), x) == [("bfloat16", X)]
  plain_norm = _kept(lambda x: norms.layer_norm(x * 2, s, s), x)
  assert ("float32", X) in plain_norm
  # a linear keeps its input and the fp32 weight as given, not its bf16 cast
  w = jnp.ones((16, 4), jnp.float32)
  dense = Dense(1, jnp.bfloat16)
  lean = lambda x, w: baseline.Linear(lean=True)(dense, x * 2, w, None, contract=1)
  assert _kept(lean, x, w) == [("bfloat16", X)]
  plain = lambda x, w: baseline.Linear(lean=False)(dense, x * 2, w, None, contract=1)
  assert ("bfloat16", (16, 4)) in _kept(plain, x, w)


# The compiled guards (no layer-stacked N x N, peak traced to source lines) run on the
# whole ViT step: tests/test_step_memory.py::test_the_vit_step_keeps_no_n_by_n_buffer.
