"""WTA-CRS under LoRA: the adapter's A takes the sampled linear strategy of its base.

Exact forward, dx and dB; dA is the WTA-CRS estimate from the sampled rows of x and the
same rows of A's output cotangent ``scale * g B^T`` (unbiased); the adapted linear keeps
k rows of x, never all of them; the frozen base keeps no x at all.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from lowmem_jax.memory import peak_buffers, saved_residuals
from lowmem_jax.policy import MemoryPolicy
from lowmem_jax.sampling import (DEFAULT_RATIO, budget, sampled_weight_grad,
                                 sampling_probabilities, wta_crs_select)
from lowmem_jax.wta_crs import SampledLinear
from models import lora, registry
from models.linear import Linear
from models.sites import (GradNormCache, Site, SiteState, attach_grad_norm_caches,
                          seed_sites, set_example_ids)
from jax_versions import skip_unless_cpu_bounds_hold
from test_sampling import max_z, rand, skewed_rows

WTA = "wta-crs+sample_targets=fc1"
LEAD, D_IN, D_OUT, RANK, ALPHA = (2, 50), 64, 48, 4, 8.0
ROWS = LEAD[0] * LEAD[1]
K = budget(ROWS, DEFAULT_RATIO)
NUM_KEYS = 4000


class _One(nnx.Module):
  """One adapted linear, named fc1 as in our blocks."""

  def __init__(self, policy):
    self.fc1 = Linear(D_IN, D_OUT, policy=policy, name="fc1", rngs=nnx.Rngs(0))
    seed_sites(self, nnx.Rngs(0))

  def __call__(self, x):
    return self.fc1(x)


def _adapted(policy):
  model = lora.apply_lora(_One(policy), rank=RANK, alpha=ALPHA, targets=("fc1",))
  model.fc1.lora_b[...] = rand((RANK, D_OUT), 3) * 0.5  # B != 0: A gets a gradient
  return model


def _inputs():
  # rows of very different norms: WTA-CRS keeps some deterministically, samples the rest
  x = skewed_rows(ROWS, D_IN, 1, spread=5.0).reshape(LEAD + (D_IN,))
  return x, rand(LEAD + (D_OUT,), 2)  # the input and the output cotangent


def _loss(graphdef, params, states, rest, x, g, key_data=None):
  model = nnx.merge(graphdef, params, states, rest, copy=True)
  if key_data is not None:
    model.fc1.read_x.sampler.key[...] = key_data
  return jnp.sum(model(2.0 * x) * g)  # 2x: an activation made inside, not an argument


def _split(model):
  return nnx.split(model, lora.LoRAParam, SiteState, ...)


@functools.partial(jax.jit, static_argnums=0)
def _grads(graphdef, params, states, rest, x, g, key_data):
  """(y, dA, dB, dx) for this key."""
  y = nnx.merge(graphdef, params, states, rest, copy=True)(2.0 * x)
  dp, dx = jax.grad(_loss, argnums=(1, 4))(graphdef, params, states, rest, x, g, key_data)
  return y, dp["fc1"]["lora_a"][...], dp["fc1"]["lora_b"][...], dx


def _plain_lora_grads(x, g):
  graphdef, params, states, rest = _split(_adapted("baseline"))
  return _grads(graphdef, params, states, rest, x, g, None)


def _key_data(seed):
  return jax.random.key_data(jax.random.key(seed))


def test_forward_dx_db_exact_and_da_is_the_estimator_on_a_x_rows():
  x, g = _inputs()
  y0, da0, db0, dx0 = _plain_lora_grads(x, g)
  model = _adapted(WTA)
  graphdef, params, states, rest = _split(model)
  y, da, db, dx = _grads(graphdef, params, states, rest, x, g, _key_data(7))
  np.testing.assert_array_equal(y, y0)
  np.testing.assert_allclose(dx, dx0, rtol=1e-6, atol=1e-6 * float(jnp.abs(dx0).max()))
  np.testing.assert_allclose(db, db0, rtol=1e-6, atol=1e-6 * float(jnp.abs(db0).max()))
  # dA: WTA-CRS on rows of 2x and of A's output cotangent scale * g B^T, at the
  # site's key folded with its call count (0)
  x2d = (2.0 * x).reshape(ROWS, D_IN)
  ga = (ALPHA / RANK) * g.reshape(ROWS, D_OUT) @ model.fc1.lora_b[...].T
  key = jax.random.fold_in(jax.random.wrap_key_data(_key_data(7)), 0)
  idx, scale = wta_crs_select(sampling_probabilities(x2d), K, key)
  assert 0 < int(jnp.sum(scale == 1.0)) < K  # winners kept and rows drawn
  expected = sampled_weight_grad(x2d, ga, idx, scale)
  np.testing.assert_allclose(da, expected, rtol=1e-5, atol=1e-5 * float(jnp.abs(expected).max()))
  np.testing.assert_allclose(da0, x2d.T @ ga, rtol=1e-5, atol=1e-5 * float(jnp.abs(da0).max()))
  assert float(jnp.abs(da - da0).max()) > 1e-3 * float(jnp.abs(da0).max())  # sampled


def test_da_is_unbiased_over_keys():
  x, g = _inputs()
  _, da0, _, _ = _plain_lora_grads(x, g)
  graphdef, params, states, rest = _split(_adapted(WTA))
  keys = jax.vmap(lambda i: jax.random.key_data(jax.random.key(i)))(jnp.arange(NUM_KEYS))
  grad_a = jax.jit(jax.vmap(lambda kd: _grads.__wrapped__(
      graphdef, params, states, rest, x, g, kd)[1]))
  samples = grad_a(keys)
  # elementwise: the mean over the keys is within 5 standard errors of the exact dA
  # (256 entries; a Gaussian entry leaves 5 s.e. with probability 6e-7)
  assert max_z(samples, np.asarray(da0)) < 5.0
  # and the check has power: dropping the scales (a biased estimate) fails it
  x2d = (2.0 * x).reshape(ROWS, D_IN)
  ga = (ALPHA / RANK) * g.reshape(ROWS, D_OUT) @ params["fc1"]["lora_b"][...].T
  p = sampling_probabilities(x2d)
  biased = jax.jit(jax.vmap(lambda kd: sampled_weight_grad(
      x2d, ga, *(lambda i, s: (i, jnp.ones_like(s)))(*wta_crs_select(
          p, K, jax.random.fold_in(jax.random.wrap_key_data(kd), 0))))))(keys)
  assert max_z(biased, np.asarray(da0)) > 50.0


def _activation_residuals(policy):
  """Residuals of the adapted linear's backward (arguments excluded: the input is 2x)."""
  graphdef, params, states, rest = _split(_adapted(policy))
  x, g = _inputs()
  return saved_residuals(lambda p, x: _loss(graphdef, p, states, rest, x, g), params, x)


def test_adapted_linear_keeps_k_rows_of_x_and_the_frozen_base_none():
  full = [r for r in _activation_residuals("baseline").items if r.shape[-1] == D_IN]
  assert [r.shape for r in full] == [LEAD + (D_IN,)]  # plain LoRA: all of x (for dA)
  res = _activation_residuals(WTA)
  kept = {(r.shape, r.dtype) for r in res.items}
  assert ((K, D_IN), "float32") in kept  # the sampled rows, their indices and scales
  assert ((K,), "int32") in kept and ((K,), "float32") in kept
  # no [rows, D_IN] array: neither A (dA from the rows) nor the frozen base (dx = g W^T)
  assert all(r.shape[-1] != D_IN or r.shape == (K, D_IN) for r in res.items), res.table()
  assert ((LEAD + (RANK,)), "float32") in kept  # x @ A, for dB


def test_frozen_base_alone_keeps_no_input():
  """A frozen linear's backward needs only W: under the lean baseline and plain autodiff
  alike nothing of x is kept."""
  for policy in ("baseline", "plain", WTA):
    base = _One(policy).fc1
    base.freeze_kernel()
    res = saved_residuals(lambda x: jnp.sum(base(2.0 * x)), _inputs()[0])
    assert not res.items, (policy, res.table())


class _Three(nnx.Module):
  """Three linears reading one shared input, as q, k and v do; their outputs weighted
  1, 2, 3 so that each gets its own cotangent (g, 2g, 3g)."""

  def __init__(self, policy):
    self.shared_input = Site(MemoryPolicy.parse(policy).shared_strategy())
    for i, name in enumerate(("query", "key", "value")):
      setattr(self, name, Linear(D_IN, D_OUT, policy=policy, name=name, rngs=nnx.Rngs(i)))
    seed_sites(self, nnx.Rngs(0))

  def __call__(self, x):
    x = self.shared_input(x)
    return self.query(x) + 2.0 * self.key(x) + 3.0 * self.value(x)


def test_readers_of_one_shared_input_keep_one_sample():
  """q, k and v keep one [k, D] buffer of rows, one idx, one scale: not three. Each dW is
  the estimator on those rows (so each is unbiased, as a lone sampled linear's), and the
  shared site's gradient-norm cache receives the readers' squared norms summed."""
  model = _Three("wta-crs")
  attach_grad_norm_caches(model, num_examples=3, batch_size=LEAD[0])
  set_example_ids(model, jnp.array([2, 0]))
  graphdef, params, caches, rest = nnx.split(model, nnx.Param, GradNormCache, ...)
  x, g = _inputs()

  def loss(params, caches, x):
    return jnp.sum(nnx.merge(graphdef, params, caches, rest, copy=True)(2.0 * x) * g)

  res = saved_residuals(loss, params, caches, x)
  counts = {}
  for r in res.items:
    counts[(r.shape, r.dtype)] = counts.get((r.shape, r.dtype), 0) + 1
  assert counts[((K, D_IN), "float32")] == 1 and counts[((K,), "int32")] == 1, res.table()
  assert all(r.shape[-1] != D_IN or r.shape == (K, D_IN) for r in res.items), res.table()

  grads, cache_grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, caches, x)
  site = model.shared_input.sampler
  key = jax.random.fold_in(jax.random.wrap_key_data(site.key[...]), 0)
  x2d, g2d = (2.0 * x).reshape(ROWS, D_IN), g.reshape(ROWS, D_OUT)
  weights = jnp.repeat(jnp.ones(LEAD[0]), LEAD[1])  # no example seen yet: all 1
  idx, scale = wta_crs_select(sampling_probabilities(x2d, weights), K, key)
  for c, name in enumerate(("query", "key", "value"), start=1):
    want = sampled_weight_grad(x2d, c * g2d, idx, scale)
    np.testing.assert_allclose(grads[name]["kernel"][...], want, rtol=1e-5,
                               atol=1e-5 * float(jnp.abs(want).max()))
  # the cotangent reaching cache[ids] is, per example, sum over rows and readers of
  # ||g_i||^2: (1 + 4 + 9) ||g||^2 over the example's rows; example 1 is not in the batch
  per_example = 14.0 * jnp.sum(g2d.reshape(LEAD + (D_OUT,)) ** 2, axis=(1, 2))
  got = cache_grads["shared_input"]["sampler"]["grad_norms"][...]
  np.testing.assert_allclose(got, [per_example[1], 0.0, per_example[0]], rtol=1e-5)


def test_in_a_model_the_adapters_of_the_targets_are_sampled():
  model = lora.apply_lora(registry.build("bert-tiny", "wta-crs+sample_targets=query,fc2",
                                         dtype=jnp.float32), targets=("query", "value", "fc2"))
  block = model.stack.layer(0)
  sampled = {name: isinstance(lin.read_x.strategy, SampledLinear)
             for name, lin in (("query", block.attention.query), ("value", block.attention.value),
                               ("fc2", block.mlp.fc2))}
  assert sampled == {"query": True, "value": False, "fc2": True}
  assert not isinstance(block.attention.query.base.saving.strategy, SampledLinear)


def _adapter_grads(policy, tokens, labels):
  """The LoRA adapters' gradients of a bert-tiny (q, v, fc2 adapted) under ``policy``."""
  model = registry.build("bert-tiny", policy, dtype=jnp.float32, max_positions=16)
  lora.apply_lora(model, rank=4, targets=("query", "value", "fc2"), seed=1)
  for path, b in nnx.iter_graph(model):
    if isinstance(b, nnx.Param) and path[-1] == "lora_b":
      b[...] = rand(b[...].shape, len(path)) * 0.5  # B != 0: A gets a gradient
  graphdef, params, rest = nnx.split(model, lora.LoRAParam, ...)

  def loss(params):
    logits = nnx.merge(graphdef, params, rest, copy=True)(tokens)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))

  with jax.default_matmul_precision("highest"):
    grads = jax.jit(jax.grad(loss))(params)
  layer0 = lambda name: grads["stack"]["blocks"]["attention" if name != "fc2" else "mlp"][
      name]["lora_a"][...][0]
  return {name: layer0(name) for name in ("query", "value", "fc2")}


def test_under_ms_norms_readers_of_a_norm_output_are_exact_and_the_rest_sampled():
  # An MS norm keeps its output for its own backward: q and v's dA read it whole
  # (exact, as under lowmembp alone); fc2 reads the GELU output, which is sampled.
  tokens = jax.random.randint(jax.random.key(0), (8, 16), 0, 100)
  labels = jnp.arange(8) % 2
  exact = _adapter_grads("lowmembp", tokens, labels)
  both = _adapter_grads("lowmembp+wta-crs", tokens, labels)
  # exact up to fp32 rounding of two different programs: dA sums 128 rows (8 x 16 tokens)
  # of products that reached q/v through one block's backward, so a few eps x sqrt(128)
  # of the array's scale (1.5e-6 of it measured under jaxlib 0.11's -O0 CPU code); the
  # sampled fc2 below is 1e-3 of its scale off or more
  for name in ("query", "value"):
    np.testing.assert_allclose(both[name], exact[name], rtol=0,
                               atol=1e-5 * float(jnp.abs(exact[name]).max()))
  gap = float(jnp.abs(both["fc2"] - exact["fc2"]).max())
  assert gap > 1e-3 * float(jnp.abs(exact["fc2"]).max()), gap  # fc2's dA is sampled


def test_linears_that_do_not_train_are_frozen_and_never_sampled():
  from train.config import TrainConfig
  from train.model import build_model

  def sampled(trainable):
    cfg = TrainConfig(name="t", task="text", model="bert-tiny", policy="wta-crs",
                      dtype="float32", trainable=trainable, lora_targets="query,value")
    block = build_model(cfg).stack.layer(0)
    sites = {"key": block.attention.key.saving, "fc1": block.mlp.fc1.saving,
             "fc2": block.mlp.fc2.saving}
    if trainable == "lora":
      sites.update({"query": block.attention.query.base.saving,
                    "query.A": block.attention.query.read_x})
    return {name: isinstance(site.strategy, SampledLinear) for name, site in sites.items()}

  assert sampled("lora") == {"key": False, "fc1": False, "fc2": False, "query": False,
                             "query.A": True}
  assert sampled("full") == {"key": True, "fc1": True, "fc2": True}
  assert sampled("frozen:fc1") == {"key": True, "fc1": False, "fc2": True}


LAYERS, TOKENS = 12, (16, 64)  # stacked residuals dominate the peak; no big N x N


@functools.lru_cache(maxsize=None)  # the three tests below share their compiles on a worker
def _lora_step_peak(policy):
  """The live buffers at the compiled peak (CPU) of a LoRA step (every block linear
  adapted) of a 12-layer bert-tiny (D 64, F 128): gradients of the adapters."""
  model = registry.build("bert-tiny", policy, dtype=jnp.float32, num_layers=LAYERS)
  lora.apply_lora(model, rank=8, targets=("query", "key", "value", "out", "fc1", "fc2"))
  graphdef, params, rest = nnx.split(model, lora.LoRAParam, ...)
  tokens = jax.ShapeDtypeStruct(TOKENS, jnp.int32)
  labels = jax.ShapeDtypeStruct(TOKENS[:1], jnp.int32)

  def step(params, rest, tokens, labels):
    def loss(params):
      logits = nnx.merge(graphdef, params, rest, copy=True)(tokens)
      return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))
    return jax.grad(loss)(params)

  return peak_buffers(step, params, rest, tokens, labels)


def _samples(peak, k):
  """Shapes of the stacked ``[LAYERS, k, width]`` row samples live at the peak."""
  return sorted(b.shape for b in peak.buffers
                if b.shape is not None and len(b.shape) == 3 and b.shape[:2] == (LAYERS, k))


@pytest.mark.slow
def test_lora_step_peak_of_wta_crs_is_below_lora():
  skip_unless_cpu_bounds_hold(jax.default_backend())  # 0.83 against 0.85: jax 0.10's figure
  base, wta = _lora_step_peak("baseline"), _lora_step_peak("wta-crs")
  # Per token per layer the adapters' A keep, for dA, the layer input (q, k, v: D), the
  # attention norm's output (fc1: D) and the GELU output (fc2: F) without sampling; one
  # sample of k = 0.3 rows of each with. Beside them q, k, v, o (4D), two LN inputs (2D)
  # and the GELU input (F): (6.6D + 1.3F) / (8D + 2F) = 0.77. Measured (CPU, jax 0.10.2):
  # 40.8 / 49.3 MiB = 0.83.
  assert wta.peak_bytes < 0.85 * base.peak_bytes, (wta.peak_bytes, base.peak_bytes)
  # at the peak: one stacked [layers, k, D] sample for q/k/v and one for fc1 (not four),
  # one [layers, k, F] for fc2
  k = budget(TOKENS[0] * TOKENS[1], DEFAULT_RATIO)
  assert _samples(wta, k) == [(LAYERS, k, 64), (LAYERS, k, 64), (LAYERS, k, 128)], wta.table()


@pytest.mark.slow
def test_lora_step_peak_of_mesa8_with_wta_crs_is_below_both_parts():
  # Under Mesa a sampled adapter keeps only the sampled rows of a code (fc2's input: its
  # frozen base keeps nothing), with their indices and scales, and reads a code its
  # producer keeps anyway (an MS norm's output, under lowmem) exactly: the combination
  # keeps less than either part. Measured (CPU, jax 0.10.2): mesa8+wta-crs 20.6 MiB,
  # mesa8 22.7 (wta-crs 40.8); lowmem+wta-crs 18.3, lowmem 19.7 (keeping fc2's whole
  # code they were 22.2 and 19.8).
  wta = _lora_step_peak("wta-crs")
  for part in ("mesa8", "lowmem"):
    alone, both = _lora_step_peak(part), _lora_step_peak(part + "+wta-crs")
    assert both.peak_bytes < min(alone.peak_bytes, wta.peak_bytes), both.table()
    # fc2's input (F = 128 wide): k sampled rows of its code, in place of all of it
    # (under mesa8 the GELU keeps its input's code, of that shape too)
    k = budget(TOKENS[0] * TOKENS[1], DEFAULT_RATIO)
    whole = [_codes(p).count((LAYERS,) + TOKENS + (128,)) for p in (alone, both)]
    assert (LAYERS, k, 128) in _codes(both) and whole[1] == whole[0] - 1, both.table()


def _codes(peak):
  """Shapes of the F-wide (128) uint8 codes live at the peak."""
  return [b.shape for b in peak.buffers
          if b.dtype == "uint8" and b.shape and b.shape[-1] == 128]


@pytest.mark.slow
def test_lora_step_peak_of_lowmembp_with_wta_crs_is_below_both_parts():
  # Under MS norms the norms' outputs are kept whole (the norms keep them): only fc2's
  # input is sampled, and the combination keeps no more than either part.
  # Measured (CPU, jax 0.10.2): 35.8 MiB, lowmembp 39.8 (wta-crs 40.8).
  wta = _lora_step_peak("wta-crs")
  ms, ms_wta = _lora_step_peak("lowmembp"), _lora_step_peak("lowmembp+wta-crs")
  assert ms_wta.peak_bytes <= min(ms.peak_bytes, wta.peak_bytes), ms_wta.table()
  k = budget(TOKENS[0] * TOKENS[1], DEFAULT_RATIO)
  assert _samples(ms_wta, k) == [(LAYERS, k, 128)], ms_wta.table()
