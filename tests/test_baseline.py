"""The lean exact baseline: each op is the plain function, keeping only its inputs for
backward. Values and gradients against plain autodiff of the same function (fp32,
highest precision), what the jaxpr keeps, and what the compiled step keeps."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowmem_jax import baseline, block_stack, norms
from lowmem_jax.dense import Dense
from lowmem_jax.memory import peak_buffers, saved_residuals
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


VIT = block_stack.StackConfig(kind="vit", num_layers=2, dim=64, num_heads=4, mlp_dim=256)


def _stack_peak(spec, batch=2, seq=33, cfg=VIT):
  policy = MemoryPolicy.parse(spec)
  params = jax.eval_shape(lambda: block_stack.init_stack(jax.random.key(0), cfg, policy))
  step = functools.partial(block_stack.sgd_step, cfg=cfg, policy=policy)
  return peak_buffers(step, params, jax.ShapeDtypeStruct((batch, seq, cfg.dim), jnp.float32))


@pytest.mark.precision("default")
def test_the_compiled_baseline_keeps_no_n_by_n_and_less_than_plain():
  """Plain autodiff with XLA's attention keeps every layer's fp32 N x N probabilities
  until backward; the baseline's flash attention keeps none: at most the scores of the
  one block being worked on are live (N < its 512-key block here)."""
  batch, seq = 2, 33
  lean, plain = _stack_peak("baseline", batch, seq), _stack_peak("plain", batch, seq)
  one_layer = batch * VIT.num_heads * seq * seq * 4

  def square_bytes(peak):
    return sum(b.nbytes for b in peak.find(dtype="float32") if b.shape[-2:] == (seq, seq))

  assert square_bytes(plain) >= VIT.num_layers * one_layer
  assert square_bytes(lean) <= one_layer
  assert lean.bytes_of("temp") < plain.bytes_of("temp")
  # nearly all of the peak's temporaries are traced to a Python source line
  located = sum(b.nbytes for b in lean.find(kind="temp") if ".py:" in b.source)
  assert located >= 0.9 * lean.bytes_of("temp")
