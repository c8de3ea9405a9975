"""Mesa 8-bit, WTA-CRS and the policy's sites inside the real models (ViT, LLaMA, BERT):
same forward as baseline, gradients close to exact, less saved, site state carried."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowmem_jax.memory import saved_residuals
from lowmem_jax.wta_crs import SampledLinear
from models import bert, llama, vit
from models.sites import CodeSite, KeySite, SiteState, seed_sites
from test_reversible import assert_trees_close

TINY = {
    "vit": lambda pol: vit.ViT(vit.config("vit-tiny", num_layers=2), pol, dtype=jnp.float32),
    "llama": lambda pol: llama.Llama(llama.config("llama-tiny", num_layers=2), pol,
                                     dtype=jnp.float32),
    "bert": lambda pol: bert.Bert(bert.config("bert-tiny", num_layers=2), pol,
                                  dtype=jnp.float32),
}


def _inputs(kind):
  if kind == "vit":
    return (jax.random.normal(jax.random.key(1), (4, 32, 32, 3)),)
  tokens = jax.random.randint(jax.random.key(1), (4, 16), 0, 100)
  return (tokens,) if kind == "llama" else (tokens, jnp.ones((4, 16), bool))


def _loss_and_grads(model, inputs):
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(p):
    out = nnx.merge(graphdef, p, rest, copy=True)(*inputs)
    return jnp.mean(jnp.sin(out))

  value, grads = jax.jit(jax.value_and_grad(loss))(params)
  residuals = saved_residuals(loss, params)
  return value, grads, residuals


def assert_grads_close(got, want, rel=1e-5):
  """Gradient trees equal to fp32 rounding: every leaf within ``rel`` of the trees'
  common scale (the largest magnitude of any leaf). Not of each leaf's own scale: a
  gradient that is zero in exact arithmetic (a key bias's: softmax ignores it) is
  rounding noise, which two programs round differently."""
  scale = max(float(np.abs(w).max()) for w in jax.tree.leaves(want))
  assert_trees_close(got, want, rtol=0, atol=rel * scale)


def _same_params(src, dst):
  """Copies src's Params into dst (same architecture, same parameter tree)."""
  nnx.update(dst, nnx.state(src, nnx.Param))
  return dst


def _rel_err(a, b):
  a, b = np.asarray(a), np.asarray(b)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("kind,policy,tol", [
    ("vit", "mesa8", 0.1), ("llama", "mesa8", 0.1), ("bert", "mesa8", 0.1),
    ("vit", "lowmembp+mesa8", None), ("bert", "lowmembp+mesa8", None),
    ("llama", "wta-crs", None), ("bert", "wta-crs", None)])
def test_forward_exact_gradients_close_and_less_saved(kind, policy, tol):
  base = TINY[kind]("baseline")
  ours = TINY[kind](policy)
  if ours.policy.merges_norm_affine:  # merged norms: compare with the ms-bp model
    base = TINY[kind](policy.replace("+mesa8", ""))
  _same_params(base, ours)
  inputs = _inputs(kind)
  lb, gb, rb = _loss_and_grads(base, inputs)
  lo, go, ro = _loss_and_grads(ours, inputs)
  np.testing.assert_allclose(lo, lb, rtol=1e-6, atol=1e-6)  # the forward is exact
  assert ro.total_bytes < rb.total_bytes
  if tol is not None:  # int8: the gradient within a few % of exact, and not exact
    flat = lambda g: np.concatenate([np.ravel(x) for x in jax.tree.leaves(g)])
    err = _rel_err(flat(go), flat(gb))
    per_leaf = [_rel_err(o, b) for o, b in zip(jax.tree.leaves(go), jax.tree.leaves(gb))
                if np.linalg.norm(np.asarray(b)) > 1e-3]
    assert 0 < err < tol, err
    assert np.median(per_leaf) < tol, per_leaf
  if policy == "wta-crs":  # sampled weight gradients: input-side grads exact
    # (the embeddings' gradient flows only through exact dx of the sampled linears)
    leaves_b = dict(jax.tree_util.tree_flatten_with_path(gb)[0])
    leaves_o = dict(jax.tree_util.tree_flatten_with_path(go)[0])
    emb = [k for k in leaves_b if "embed" in jax.tree_util.keystr(k)
           or "word" in jax.tree_util.keystr(k)]
    assert emb
    for k in emb:
      np.testing.assert_allclose(leaves_o[k], leaves_b[k], rtol=1e-4, atol=1e-6)


def test_mesa8_saves_uint8_codes_and_no_float_activation():
  model = TINY["vit"]("mesa8")
  _, _, res = _loss_and_grads(model, _inputs("vit"))
  act = 4 * 17 * 64  # one [B, N, D] activation of vit-tiny
  floats = [r for r in res.items if r.dtype == "float32" and np.prod(r.shape) >= act]
  codes = [r for r in res.items if r.dtype == "uint8" and np.prod(r.shape) >= act]
  assert codes and not floats, floats


def test_sites_carry_state_and_get_distinct_keys():
  model = TINY["vit"]("mesa8+wta-crs")
  sites = [m for _, m in nnx.iter_graph(model) if isinstance(m, (CodeSite, KeySite))]
  assert any(isinstance(s, KeySite) for s in sites) and any(isinstance(s, CodeSite)
                                                            for s in sites)
  # one key per state and per layer (the blocks' states are stacked over layers)
  keys = [tuple(k) for s in sites for k in np.asarray(s.key[...]).reshape(-1, 2).tolist()]
  assert len(set(keys)) == len(keys) > len(sites)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  @jax.jit
  def forward(p, rest, x):
    m = nnx.merge(graphdef, p, rest, copy=True)
    m(x)
    return nnx.split(m, nnx.Param, ...)[2]

  x = _inputs("vit")[0]
  rest1 = forward(params, rest, x)
  rest2 = forward(params, rest1, 2 * x)
  nnx.update(model, rest2)
  site = model.stack.layer(0).norm1.saving.input
  assert int(site.count[...]) == 2
  # EMA of per-batch ranges: the first batch's, then 0.9 old + 0.1 new
  nnx.update(model, rest1)
  lo1 = float(model.stack.layer(0).norm1.saving.input.lo[...][0])
  nnx.update(model, rest2)
  lo2 = float(model.stack.layer(0).norm1.saving.input.lo[...][0])
  assert lo2 != lo1


@pytest.mark.parametrize("kind", ["vit", "bert"])
def test_eval_mode_forward_leaves_the_site_state(kind):
  model = TINY[kind]("mesa8+wta-crs")
  seed_sites(model, nnx.Rngs(0))
  inputs = _inputs(kind)
  before = jax.tree.map(np.asarray, nnx.state(model, SiteState))
  model.eval()
  out = model(*inputs)
  jax.tree.map(np.testing.assert_array_equal, nnx.state(model, SiteState), before)
  model.train()  # training forwards update it again, to the same output (to rounding: the
  np.testing.assert_allclose(model(*inputs), out, rtol=1e-5, atol=1e-5)  # scan differs)
  changed = jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != b)),
                                         nnx.state(model, SiteState), before))
  assert any(changed)


def test_seed_sites_draws_nothing_without_sites():
  rngs = nnx.Rngs(0)
  assert seed_sites(nnx.Linear(2, 2, rngs=nnx.Rngs(1)), rngs) == 0
  assert int(rngs.params.count[...]) == 0


def test_baseline_params_do_not_depend_on_the_policy_sites():
  a, b = TINY["llama"]("baseline"), TINY["llama"]("mesa8+wta-crs")
  for x, y in zip(jax.tree.leaves(nnx.state(a, nnx.Param)),
                  jax.tree.leaves(nnx.state(b, nnx.Param))):
    np.testing.assert_array_equal(x, y)
  assert not jax.tree.leaves(nnx.state(a, SiteState))
  assert jax.tree.leaves(nnx.state(b, SiteState))


def _sampled(linear) -> bool:
  return isinstance(linear.saving.strategy, SampledLinear)


def test_wta_crs_targets_pick_the_linears():
  model = TINY["vit"]("wta-crs+sample_targets=fc1,fc2")
  block = model.stack.layer(0)
  assert _sampled(block.mlp.fc1) and _sampled(block.mlp.fc2)
  assert not _sampled(block.attn.query) and not _sampled(model.head)


def test_mesa8_pallas_kernels_match_the_jnp_path_in_a_model():
  vit_cfg = vit.config("vit-tiny", num_layers=1)
  models = [vit.ViT(vit_cfg, p, dtype=jnp.float32)
            for p in ("mesa8+kernels=xla", "mesa8+kernels=pallas_interpret")]
  inputs = (jax.random.normal(jax.random.key(1), (2, 32, 32, 3)),)
  (la, ga, _), (lb, gb, _) = (_loss_and_grads(m, inputs) for m in models)
  # Two programs that code the same values: equal to fp32 rounding. The loss is a mean of
  # terms of size 1 (its value, -0.007, is their cancelling). jaxlib 0.12 on a CPU: loss
  # 2.3e-8 apart, gradients 5.1e-7 of their scale (0.10: both exact); one code one step
  # off moves them by 3.6e-2 of it.
  np.testing.assert_allclose(la, lb, rtol=0, atol=1e-6)
  assert_grads_close(ga, gb)


@pytest.mark.parametrize("kind,policy", [("bert", "mesa8+remat"),
                                         ("vit", "lowmembp+mesa8+wta-crs")])
def test_combinations_run_with_an_exact_forward(kind, policy):
  ours = TINY[kind](policy)
  base = _same_params(ours, TINY[kind]("ms-bp" if ours.policy.merges_norm_affine
                                       else "baseline"))
  inputs = _inputs(kind)
  (lo, go, _), (lb, _, _) = _loss_and_grads(ours, inputs), _loss_and_grads(base, inputs)
  np.testing.assert_allclose(lo, lb, rtol=1e-6, atol=1e-6)
  assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(go))


def test_cached_weights_put_unseen_examples_on_the_seen_scale():
  from models.sites import cached_weights
  cache = jnp.array([0.0, 0.02, 0.04, 0.0])
  np.testing.assert_allclose(cached_weights(cache, jnp.array([0, 1, 2, 3])),
                             [0.03, 0.02, 0.04, 0.03], rtol=1e-6)
  np.testing.assert_array_equal(cached_weights(jnp.zeros(3), jnp.array([0, 2])), [1.0, 1.0])


def test_lora_bases_run_unsampled_and_reversible_models_refuse_lora():
  from models import lora, revvit
  model = lora.apply_lora(TINY["vit"]("wta-crs"), targets=("query", "fc1"))
  block = model.stack.layer(0)
  assert not _sampled(block.attn.query.base) and not _sampled(block.mlp.fc1.base)
  assert not _sampled(block.attn.key)  # frozen too, as peft freezes the base model
  model = lora.apply_lora(TINY["vit"]("wta-crs"), targets=("query", "fc1"), freeze_rest=False)
  assert _sampled(model.stack.layer(0).attn.key)  # left to train in full
  rev = revvit.RevViT(revvit.config("revvit-digits", num_layers=1), "reversible")
  with pytest.raises(ValueError, match="LoRA is not supported"):
    lora.apply_lora(rev, targets=("query",))
