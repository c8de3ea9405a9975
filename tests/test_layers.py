"""lowmem_jax.layers: a block stack scanned or unrolled, same values and gradients."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowmem_jax import MemoryPolicy, layers
from lowmem_jax.layers import Scanned, Unrolled, ordered
from lowmem_jax.methods import Method
from models import revvit
from models.sites import seed_sites
from test_methods_in_models import TINY, _inputs  # tiny 2-layer ViT, LLaMA, BERT
from train.config import TrainConfig
from train.trainer import Trainer

def _step(carry, layer):
  """A toy layer: a matmul and a bias on the carry, an integer per layer, and a per-layer
  output that depends on the carry (scan's ``ys``)."""
  w, b, n = layer
  return jnp.tanh(carry @ w + b), carry.sum() * n


def _toy_loss(strategy, w, b, x):
  carry, ys = strategy(_step, x, (w, b, jnp.arange(1, w.shape[0] + 1)))
  return jnp.sum(carry ** 2) + jnp.sum(ys)


def test_unrolled_matches_scan_values_and_gradients():
  k = jax.random.split(jax.random.key(0), 3)
  w = 0.3 * jax.random.normal(k[0], (4, 8, 8))
  b = jax.random.normal(k[1], (4, 8))
  x = jax.random.normal(k[2], (3, 8))
  want = jax.value_and_grad(functools.partial(_toy_loss, Scanned()), argnums=(0, 1, 2))
  got = jax.jit(jax.value_and_grad(functools.partial(_toy_loss, Unrolled()), argnums=(0, 1, 2)))
  (v0, g0), (v1, g1) = want(w, b, x), got(w, b, x)
  np.testing.assert_allclose(v1, v0, rtol=1e-6)
  for a, e in zip(g1, g0):
    np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6)
  # only some inputs differentiated (a frozen weight): the others get no cotangent work
  g_b = jax.grad(functools.partial(_toy_loss, Unrolled()), argnums=1)(w, b, x)
  np.testing.assert_allclose(g_b, g0[1], rtol=1e-5, atol=1e-6)


def test_unrolled_backward_slices_frozen_weights_again():
  """A frozen weight's slice is not kept from forward to backward: the backward takes it
  again from the stacked array (which the step holds anyway). Compiled for an H100, ViT-B
  LoRA under lowmem+qkv=recompute+layers=unrolled held 192 MiB of such slices at its
  peak."""
  w, b, x = 0.1 * jnp.ones((3, 4, 4)), jnp.zeros((3, 4)), jnp.ones((2, 4))

  def kept_shapes(strategy, *argnums):
    def loss(b, w):
      carry, _ = strategy(lambda c, layer: (jnp.tanh(c @ layer[0] + layer[1]), None), x,
                          (w, b))
      return jnp.sum(carry ** 2)
    args = (b, w)
    _, pullback = jax.vjp(lambda *d: loss(*[d[argnums.index(i)] if i in argnums else a
                                            for i, a in enumerate(args)]),
                          *(args[i] for i in argnums))
    return [leaf.shape for leaf in jax.tree.leaves(pullback)]

  def each_layer_kept(step, carry, xs):  # ordered without layer_of: the slices are kept
    for i in range(3):
      carry, _ = ordered(step)(carry, jax.tree.map(lambda a, i=i: a[i], xs))
    return carry, None

  # layers 1 and 2 keep their w slice (layer 0's input is not differentiated: its
  # backward needs no w)
  assert kept_shapes(each_layer_kept, 0).count((4, 4)) == 2
  frozen = kept_shapes(Unrolled(), 0)  # b differentiated, w frozen
  assert (4, 4) not in frozen and (3, 4, 4) in frozen
  assert (4, 4) in kept_shapes(Unrolled(), 0, 1)  # w differentiated: its slices kept


def test_ordered_fences_what_backward_keeps():
  """The forward's kept tensors and output pass one optimization barrier, the backward's
  kept tensors and cotangent another, and the backward's results (the input's and the
  weight's cotangents) a third, so a weight's gradient is not deferred past the layer;
  without differentiation, none."""
  fn = ordered(lambda x, w: jnp.sin(x @ w))
  x, w = jnp.ones((2, 3)), jnp.ones((3, 3))
  grad_jaxpr = str(jax.make_jaxpr(jax.grad(lambda x, w: fn(x, w).sum(), argnums=(0, 1)))(x, w))
  assert grad_jaxpr.count("optimization_barrier") == 3
  last = [line for line in grad_jaxpr.splitlines() if "optimization_barrier" in line][-1]
  assert "f32[2,3]" in last.split("=")[0] and "f32[3,3]" in last.split("=")[0], last
  assert "optimization_barrier" not in str(jax.make_jaxpr(fn)(x, w))


@pytest.mark.parametrize("kind,policy", [
    ("vit", "baseline"), ("vit", "lowmembp"), ("vit", "remat"), ("vit", "mesa8"),
    ("llama", "baseline"), ("llama", "wta-crs"), ("llama", "lowmem+qkv=recompute"),
    ("bert", "lowmembp"), ("bert", "offload")])
def test_models_unrolled_match_scanned(kind, policy):
  """Same loss, gradients and per-layer site state (Mesa ranges, WTA-CRS keys) whether
  the stack scans or unrolls its blocks: a scale-relative tolerance (a gradient that is 0
  in exact arithmetic, the key bias's under softmax, is rounding noise either way)."""
  scanned, unrolled = TINY[kind](policy), TINY[kind](policy + "+layers=unrolled")
  nnx.update(unrolled, nnx.state(scanned, nnx.Param))
  results = []
  for model in (scanned, unrolled):
    seed_sites(model, nnx.Rngs(3))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p, graphdef=graphdef, rest=rest):
      m = nnx.merge(graphdef, p, rest, copy=True)
      return jnp.mean(jnp.sin(m(*_inputs(kind)))), nnx.state(m, nnx.Not(nnx.Param))
    results.append(jax.jit(jax.value_and_grad(loss, has_aux=True))(params))
  ((v0, state0), g0), ((v1, state1), g1) = results
  np.testing.assert_allclose(v1, v0, rtol=1e-6)
  scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(g0))
  for a, e in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
    np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-6 * scale)
  for a, e in zip(jax.tree.leaves(state1), jax.tree.leaves(state0)):
    if jnp.issubdtype(e.dtype, jax.dtypes.prng_key):
      a, e = jax.random.key_data(a), jax.random.key_data(e)
    if jnp.issubdtype(e.dtype, jnp.floating):  # Mesa's EMA ranges: an ulp apart at most
      np.testing.assert_allclose(a, e, rtol=1e-6)
    else:  # keys, counts
      np.testing.assert_array_equal(a, e)


def test_lora_train_steps_unrolled_match_scanned():
  """The trainer with LoRA: the frozen base and the first layer's input (a frozen
  embedding's output) are not differentiated, the adapters are."""
  states = []
  for layers in ("scan", "unrolled"):
    cfg = TrainConfig(name="t", task="lm", model="llama-tiny",
                      model_overrides={"num_layers": 2, "dim": 32, "mlp_dim": 64,
                                       "num_heads": 2, "num_kv_heads": 2},
                      policy=f"lowmembp+layers={layers}", trainable="lora", lora_rank=4,
                      dtype="float32", precision="highest", batch_size=4, optimizer="sgd",
                      lr=0.1, warmup_steps=0, eval_every=0, compare_baseline=False)
    trainer = Trainer.create(cfg)
    tokens = np.random.default_rng(0).integers(0, 256, (4, 13), dtype=np.int32)
    batch = {"tokens": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:]),
             "loss_mask": jnp.ones((4, 12), jnp.int32)}
    for _ in range(2):
      metrics = trainer.step(batch)
    states.append((jax.device_get(metrics), jax.device_get(trainer.state["params"])))
  (m0, p0), (m1, p1) = states
  np.testing.assert_allclose(m1["loss"], m0["loss"], rtol=1e-6)
  assert float(m0["grad_norm"]) > 0
  np.testing.assert_allclose(m1["grad_norm"], m0["grad_norm"], rtol=1e-5)
  jax.tree.map(lambda a, e: np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-7), p1, p0)


def test_layers_field_parses_and_checks():
  policy = MemoryPolicy.parse("lowmem+layers=unrolled")
  assert policy.layers == "unrolled" and MemoryPolicy.parse(policy.spec) == policy
  assert isinstance(policy.layers_strategy(), Unrolled)
  assert isinstance(MemoryPolicy.parse("lowmem").layers_strategy(), Scanned)
  with pytest.raises(ValueError, match="unknown layers 'loop'"):
    MemoryPolicy.parse("layers=loop")


def test_unrolled_steps_compile_without_the_passes_that_hoist_weight_casts(monkeypatch):
  """An unrolled policy's steps are compiled without XLA's convert-mover and slice-sinker
  (the GPU compile is tests/test_gpu_target.py's); a scanned policy's with no options.
  Methods' disabled passes are joined; two values of another option are an error."""
  unrolled = MemoryPolicy.parse("lowmem+layers=unrolled")
  assert unrolled.compiler_options() == {
      "xla_disable_hlo_passes": "convert-mover,slice-sinker"}
  assert MemoryPolicy.parse("lowmem").compiler_options() == {}
  cfg = TrainConfig(name="t", task="lm", model="llama-tiny", policy=unrolled.spec,
                    dtype="float32", batch_size=2, eval_every=0, compare_baseline=False)
  assert Trainer.create(cfg).compiler_options == unrolled.compiler_options()
  assert Trainer.create(dataclasses.replace(cfg, policy="lowmem")).compiler_options == {}
  # the memory report's step (models.step_memory) is compiled with them too
  from models import step_memory as report
  seen = []

  def record(*args, compiler_options=None, **kwargs):
    seen.append(compiler_options)
    raise StopIteration  # the options are what this checks, not the compile
  monkeypatch.setattr(report, "step_memory", record)
  with pytest.raises(StopIteration):
    report.measure("llama-tiny", [unrolled.spec], 2, 8, jnp.float32, {"num_layers": 2})
  assert seen == [unrolled.compiler_options()]

  from lowmem_jax import policy as policy_module
  extra = [Method(name="a", compiler_options=lambda p: {
               "xla_disable_hlo_passes": "x,slice-sinker", "xla_foo": "1"}),
           Method(name="b", compiler_options=lambda p: {"xla_foo": "2"})]
  monkeypatch.setattr(policy_module, "METHODS", (*policy_module.METHODS, extra[0]))
  assert unrolled.compiler_options() == {
      "xla_disable_hlo_passes": "convert-mover,slice-sinker,x", "xla_foo": "1"}
  monkeypatch.setattr(policy_module, "METHODS", (*policy_module.METHODS, extra[1]))
  with pytest.raises(ValueError, match="xla_foo='1' and xla_foo='2'"):
    unrolled.compiler_options()


def test_reversible_stack_refuses_unrolled_layers():
  with pytest.raises(ValueError, match="layers='unrolled' is for standard block stacks"):
    revvit.RevViT("revvit-digits", "layers=unrolled", dtype=jnp.float32)


def test_recomputes_skip_the_cse_barrier_in_a_scanned_layer_only():
  """layers.checkpoint decides prevent_cse where it runs: off in a scanned layer (its
  forward and backward are two loops, nothing to merge; the barrier only forced each
  frozen weight's slice into a copy on XLA:GPU), on in an unrolled one and outside."""
  f = layers.checkpoint(lambda c, w: jnp.sin(c @ w))
  w, x = jnp.ones((3, 4, 4)), jnp.ones((2, 4))

  def jaxpr(strategy):
    return str(jax.make_jaxpr(lambda x, w: strategy(lambda c, wi: (f(c, wi), None), x, w))(x, w))

  assert "prevent_cse=False" in jaxpr(Scanned()) and "prevent_cse=True" not in jaxpr(Scanned())
  assert "prevent_cse=True" in jaxpr(Unrolled()) and "prevent_cse=False" not in jaxpr(Unrolled())
  assert "prevent_cse=True" in str(jax.make_jaxpr(f)(x, w[0]))
  # the same values and gradients either way
  def loss(strategy, w, x):
    return strategy(lambda c, wi: (f(c, wi), None), x, w)[0].sum()
  grads = [jax.grad(functools.partial(loss, s), argnums=(0, 1))(w, x)
           for s in (Scanned(), Unrolled())]
  for a, e in zip(*grads):
    np.testing.assert_allclose(a, e, rtol=1e-6)
