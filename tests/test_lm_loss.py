"""The fused, chunked LM head + cross-entropy (lowmem_jax.lm_loss) against its plain-jnp
reference: values and gradients (h and w, untied and tied layouts, masks, ragged chunks,
bf16), what backward computes for a frozen head, and the compiled memory it saves."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lowmem_jax.lm_loss import chunked_cross_entropy, cross_entropy_reference, \
    logits_cross_entropy

D, V = 16, 37
SHAPE = (2, 9)  # 18 tokens: 2 rows of 9 positions


def _inputs(dtype=jnp.float32, transposed=False, seed=0):
  k = jax.random.split(jax.random.key(seed), 4)
  h = jax.random.normal(k[0], SHAPE + (D,), jnp.float32).astype(dtype)
  w = (2.0 * jax.random.normal(k[1], (V, D) if transposed else (D, V), jnp.float32)
       ).astype(dtype)
  targets = jax.random.randint(k[2], SHAPE, 0, V)
  # every 3rd target the argmax: some tokens right, some wrong
  logits = jnp.einsum("btd,vd->btv" if transposed else "btd,dv->btv", h.astype(jnp.float32),
                      w.astype(jnp.float32))
  targets = jnp.where(jnp.arange(18).reshape(SHAPE) % 3 == 0, jnp.argmax(logits, -1), targets)
  weights = jax.random.uniform(k[3], SHAPE) * (jnp.arange(18).reshape(SHAPE) % 4 != 1)
  return h, w, targets, weights  # every 4th token masked (weight 0)


def _loss_and_grads(fn, h, w, targets, weights, **kw):
  def loss(h, w):
    losses, correct = fn(h, w, targets, **kw)
    return jnp.sum(losses * weights), (losses, correct)
  (total, (losses, correct)), grads = jax.jit(
      jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(h, w)
  return total, losses, correct, grads


def _max_abs(a, b):
  return float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))))


def test_logits_cross_entropy_is_optax():
  k = jax.random.split(jax.random.key(3), 2)
  logits = 3.0 * jax.random.normal(k[0], (5, 11))
  targets = jax.random.randint(k[1], (5,), 0, 11)
  losses, correct = logits_cross_entropy(logits, targets)
  np.testing.assert_allclose(
      losses, optax.softmax_cross_entropy_with_integer_labels(logits, targets), rtol=1e-6)
  np.testing.assert_array_equal(correct, jnp.argmax(logits, -1) == targets)


# chunk // rows positions per step: 8 -> 4 of 9 (ragged), 6 -> 3 (divides), 64 -> all 9
@pytest.mark.parametrize("chunk,transposed", [(8, True), (6, False), (64, False)],
                         ids=["ragged-tied", "divides-untied", "one-step-untied"])
def test_values_and_gradients_match_reference(chunk, transposed):
  h, w, targets, weights = _inputs(transposed=transposed)
  ref = _loss_and_grads(cross_entropy_reference, h, w, targets, weights,
                        transposed=transposed)
  got = _loss_and_grads(chunked_cross_entropy, h, w, targets, weights, chunk=chunk,
                        transposed=transposed)
  assert got[1].shape == SHAPE and got[1].dtype == jnp.float32 and got[2].dtype == jnp.bool_
  np.testing.assert_allclose(got[1], ref[1], rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(got[2], ref[2])
  assert 0 < int(ref[2].sum()) < 18  # some right, some wrong: the comparison means something
  for g, r in zip(got[3], ref[3]):
    assert g.shape == r.shape and g.dtype == r.dtype
    assert _max_abs(g, r) < 1e-5 * float(jnp.max(jnp.abs(r)))
  # masked tokens (weight 0) contribute nothing to the gradient of h
  masked = weights == 0
  assert bool(masked.any()) and float(jnp.max(jnp.abs(got[3][0][masked]))) == 0.0


@pytest.mark.parametrize("transposed", [True, False], ids=["tied", "untied"])
def test_scale_inside_matches_the_scaled_weight(transposed):
  """``scale [D]`` (a tied head's merged norm scale) applied inside: values and the
  gradients of h, w and scale equal the reference on ``w * scale`` by autodiff."""
  h, w, targets, weights = _inputs(transposed=transposed)
  scale = 1.0 + 0.5 * jax.random.normal(jax.random.key(7), (D,))

  def grads(fn, **kw):
    def loss(h, w, scale):
      losses, _ = fn(h, w, targets, transposed=transposed, scale=scale, **kw)
      return jnp.sum(losses * weights), losses
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(h, w, scale)

  (_, ref_losses), ref = grads(cross_entropy_reference)
  (_, losses), got = grads(chunked_cross_entropy, chunk=5)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-6, atol=1e-6)
  for g, r, x in zip(got, ref, (h, w, scale)):
    assert g.shape == x.shape and g.dtype == x.dtype
    assert _max_abs(g, r) < 1e-5 * float(jnp.max(jnp.abs(r)))
  # only the scale asked for: the same dscale
  dscale = jax.jit(jax.grad(lambda s: jnp.sum(chunked_cross_entropy(
      h, w, targets, chunk=5, transposed=transposed, scale=s)[0] * weights)))(scale)
  np.testing.assert_allclose(dscale, got[2], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape", [(18,), (2, 3, 3)], ids=["flat", "3d"])
def test_any_leading_shape(shape):
  """Tokens given flat (one row) or with two leading axes (rows merged): the same values
  and gradients as the reference."""
  h, w, targets, weights = _inputs()
  h, targets, weights = h.reshape(shape + (D,)), targets.reshape(shape), weights.reshape(shape)
  ref = _loss_and_grads(cross_entropy_reference, h, w, targets, weights)
  got = _loss_and_grads(chunked_cross_entropy, h, w, targets, weights, chunk=5)
  np.testing.assert_allclose(got[1], ref[1], rtol=1e-6, atol=1e-6)
  for g, r in zip(got[3], ref[3]):
    assert g.shape == r.shape and _max_abs(g, r) < 1e-5 * float(jnp.max(jnp.abs(r)))


@pytest.mark.parametrize("shape", [(2, 0), (0, 5), (0,)], ids=["no-positions", "no-rows",
                                                              "no-tokens"])
def test_no_tokens_gives_empty_losses_and_zero_gradients(shape):
  """An empty token set (a sequence axis of length 0 too): the reference's empty losses
  and zero gradients, not a slice out of bounds."""
  h, w, _, _ = _inputs()
  h = jnp.zeros(shape + (D,))
  targets, weights = jnp.zeros(shape, jnp.int32), jnp.ones(shape)
  ref = _loss_and_grads(cross_entropy_reference, h, w, targets, weights)
  got = _loss_and_grads(chunked_cross_entropy, h, w, targets, weights, chunk=4)
  for g, r in zip(got[1:3] + got[3], ref[1:3] + ref[3]):
    assert g.shape == r.shape and g.dtype == r.dtype
    np.testing.assert_array_equal(g, r)


@pytest.mark.parametrize("w_dtype", [jnp.bfloat16, jnp.float32], ids=["w-bf16", "w-fp32"])
def test_bf16_against_fp32_reference(w_dtype):
  """bf16 h; w in bf16 or as stored in fp32 (cast to bf16 inside). The forward
  accumulates in fp32, so losses match the fp32 reference on the bf16-rounded inputs to
  fp32 rounding; backward rounds the softmax gradient (and dh) to bf16 (8 bits): gradients
  within 2**-6 of the reference's largest entry (measured 2**-8.7 .. 2**-7.5, 4 seeds)."""
  h, w, targets, weights = _inputs(jnp.bfloat16)
  w = w.astype(w_dtype)
  rounded = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)
  ref = _loss_and_grads(cross_entropy_reference, rounded(h), rounded(w), targets, weights)
  got = _loss_and_grads(chunked_cross_entropy, h, w, targets, weights, chunk=4)
  np.testing.assert_allclose(got[1], ref[1], rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(got[2], ref[2])
  for g, r, x in zip(got[3], ref[3], (h, w)):
    assert g.dtype == x.dtype
    assert _max_abs(g, r) < 2.0 ** -6 * float(jnp.max(jnp.abs(r)))


def test_fp16_gradients_of_a_mean_are_as_close_as_the_reference_s():
  """fp16 (5 exponent bits): a mean's cotangent 1/tokens times softmax's ~1/V went below
  fp16's smallest numbers when cast, and the gradient kept mostly -onehot: 3x the fp16
  reference's error here (1.55e-3 against 4.9e-4), 85x at 1024 tokens x 32000 words."""
  n, d, v = 512, 32, 8192
  rng = np.random.default_rng(0)
  h = jnp.asarray(rng.normal(size=(1, n, d)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(d, v)) * 0.02, jnp.float32)
  targets = jnp.asarray(rng.integers(0, v, (1, n)), jnp.int32)

  def grads(fn, dtype, **kw):
    mean = lambda h, w: jnp.mean(fn(h.astype(dtype), w.astype(dtype), targets, **kw)[0])
    with jax.default_matmul_precision("highest"):
      return jax.grad(mean, argnums=(0, 1))(h, w)

  exact = grads(cross_entropy_reference, jnp.float32)
  errors = {name: [float(jnp.linalg.norm(g - e) / jnp.linalg.norm(e))
                   for g, e in zip(grads(fn, jnp.float16, **kw), exact)]
            for name, fn, kw in (("chunked", chunked_cross_entropy, {"chunk": 256}),
                                 ("reference", cross_entropy_reference, {}))}
  for got, ref in zip(errors["chunked"], errors["reference"]):
    assert got < 1.25 * ref, errors


def test_out_of_range_targets_are_finite_and_masked():
  """An ignore index (-100) selects no logit, as in logits_cross_entropy: the loss is
  finite and, weighted 0, adds nothing to either gradient."""
  h, w, targets, weights = _inputs()
  ignored = targets.at[0, :3].set(-100)
  mask = weights.at[0, :3].set(0.0)
  got = _loss_and_grads(chunked_cross_entropy, h, w, ignored, mask, chunk=4)
  ref = _loss_and_grads(cross_entropy_reference, h, w, ignored, mask)
  same = _loss_and_grads(chunked_cross_entropy, h, w, targets, mask, chunk=4)
  assert bool(jnp.all(jnp.isfinite(got[1])))
  np.testing.assert_allclose(got[1], ref[1], rtol=1e-6, atol=1e-6)
  for g, r in zip(got[3], same[3]):
    np.testing.assert_array_equal(g, r)


def _dots(fn, *args):
  return str(jax.make_jaxpr(fn)(*args)).count("dot_general")


def test_frozen_head_computes_no_weight_gradient():
  """Backward computes only the gradients asked for: with w not differentiated (a frozen
  or LoRA-wrapped base head), no dw matmul; forward 1, backward 2 (logits, dh) vs 3."""
  h, w, targets, weights = _inputs()
  loss = lambda h, w: jnp.sum(chunked_cross_entropy(h, w, targets, chunk=4)[0] * weights)
  assert _dots(jax.grad(loss, argnums=0), h, w) == 3
  assert _dots(jax.grad(loss, argnums=1), h, w) == 3
  assert _dots(jax.grad(loss, argnums=(0, 1)), h, w) == 4
  ref = jax.grad(lambda h: jnp.sum(cross_entropy_reference(h, w, targets)[0] * weights))(h)
  assert _max_abs(jax.jit(jax.grad(loss))(h, w), ref) < 1e-5 * float(jnp.max(jnp.abs(ref)))


@pytest.mark.precision("default")
def test_compiled_temp_holds_chunks_of_logits():
  """Value and both gradients compiled on this backend: the reference's temp holds the
  [N, V] fp32 logits (and their gradient); the chunked one about two [chunk, V] arrays (a
  chunk's logits and their gradient; N / chunk = 8)."""
  n, d, v, chunk = 512, 32, 2048, 64
  h = jax.ShapeDtypeStruct((n, d), jnp.float32)
  w = jax.ShapeDtypeStruct((d, v), jnp.float32)
  t = jax.ShapeDtypeStruct((n,), jnp.int32)

  def temp(fn, **kw):
    step = jax.value_and_grad(lambda h, w, t: jnp.sum(fn(h, w, t, **kw)[0]), argnums=(0, 1))
    return jax.jit(step).lower(h, w, t).compile().memory_analysis().temp_size_in_bytes

  logits_bytes = n * v * 4
  assert temp(cross_entropy_reference) >= logits_bytes
  assert temp(chunked_cross_entropy, chunk=chunk) < logits_bytes / 2


def test_errors_name_the_argument():
  h, w, targets, _ = _inputs()
  with pytest.raises(ValueError, match="chunk must be a positive int"):
    chunked_cross_entropy(h, w, targets, chunk=0)
  with pytest.raises(ValueError, match=r"w must be \[D, V\]"):
    chunked_cross_entropy(h, w.T, targets)
  with pytest.raises(ValueError, match="h and w must be floating"):
    chunked_cross_entropy(h, w.astype(jnp.int32), targets)
  with pytest.raises(ValueError, match="targets must be integers of shape"):
    chunked_cross_entropy(h, w, targets.astype(jnp.float32))
  with pytest.raises(ValueError, match=r"scale must be floating \[D\]"):
    chunked_cross_entropy(h, w, targets, scale=jnp.ones((D + 1,)))
