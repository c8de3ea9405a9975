"""hidden=recompute: the MLP's last linear reads the activation's output recomputed in
backward (lowmem_jax/hidden_recompute.py, models/mlp.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowmem_jax import block_stack, quant
from lowmem_jax.baseline import KeepRun
from lowmem_jax.hidden_recompute import RecomputeHidden
from lowmem_jax.memory import peak_buffers, saved_residuals
from lowmem_jax.mesa import CodedHidden, Coder
from lowmem_jax.policy import MemoryPolicy
from models import llama, lora, vit
from models.mlp import GatedMlp, Mlp
from test_methods_in_models import TINY, _same_params
from test_qkv_recompute import _inputs, assert_same_keeping_less, coded_gradient_errors
from jax_versions import skip_unless_cpu_bounds_hold


def test_policy_field_and_its_checks():
  p = MemoryPolicy.parse("lowmembp+hidden=recompute")
  assert p.hidden == "recompute" and MemoryPolicy.parse(p.spec) == p
  assert isinstance(p.hidden_strategy("gelu"), RecomputeHidden)
  assert type(MemoryPolicy.parse("lowmembp").hidden_strategy("gelu")) is KeepRun
  # under a block checkpoint policy the policy decides what a block keeps: no-op
  assert type(MemoryPolicy.parse("remat+hidden=recompute").hidden_strategy("gelu")) is KeepRun
  with pytest.raises(ValueError, match="unknown hidden 'again'"):
    MemoryPolicy.parse("hidden=again")
  lowmem = MemoryPolicy.parse("lowmem+hidden=recompute")
  coded = lowmem.hidden_strategy("silu", gated=True)
  assert isinstance(coded, CodedHidden) and set(coded.init_state()) == {"gate", "up"}
  # GELU under lowmem keeps a 2-bit code, fewer bits than a code of its input: kept
  assert type(lowmem.hidden_strategy("gelu")) is KeepRun
  assert isinstance(MemoryPolicy.parse("mesa8+hidden=recompute").hidden_strategy("gelu"),
                    CodedHidden)
  assert type(MemoryPolicy.parse("remat+mesa8+hidden=recompute").hidden_strategy("gelu")) \
      is KeepRun
  with pytest.raises(ValueError, match=r"hidden=recompute cannot recompute sampled linears "
                                       r"\(down, fc2:") as e:
    MemoryPolicy.parse("wta-crs+hidden=recompute")
  assert "\n" not in str(e.value)
  MemoryPolicy.parse("wta-crs+hidden=recompute+sample_targets=fc1")  # fc2, down not sampled


@pytest.mark.parametrize("cls,activation", [(Mlp, "gelu"), (GatedMlp, "silu")])
@pytest.mark.parametrize("policy", ["baseline", "lowmembp"])
def test_mlp_gradients_unchanged_and_the_hidden_output_not_kept(cls, activation, policy):
  """Same arithmetic (bitwise: the same ops recomputed), and backward keeps one
  ``[tokens, hidden]`` array fewer: the activation's output the last linear read."""
  x = jax.random.normal(jax.random.key(1), (2, 24, 16), jnp.bfloat16)
  grads, wide = {}, {}
  for spec in (policy, policy + "+hidden=recompute"):
    m = cls(16, 256, activation=activation, policy=spec, dtype=jnp.bfloat16,
            rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(m, nnx.Param, ...)

    def loss(p, x):
      return jnp.sum(nnx.merge(graphdef, p, rest, copy=True)(x).astype(jnp.float32) ** 2)
    grads[spec] = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
    kept = saved_residuals(loss, params, x).items
    wide[spec] = sorted(str(r.dtype) for r in kept if tuple(r.shape) == (2, 24, 256))
  for a, b in zip(jax.tree.leaves(grads[policy]),
                  jax.tree.leaves(grads[policy + "+hidden=recompute"]), strict=True):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  # recompute: the activation's input(s) only (h; g and u). keep: what the activation
  # keeps (baseline: its inputs; lowmembp: a 2-bit code of h or g, not this shape, and
  # for the gated product u and act(g)) and the output the last linear reads
  inputs = 2 if cls is GatedMlp else 1
  kept = {("baseline", 1): 2, ("baseline", 2): 3, ("lowmembp", 1): 1, ("lowmembp", 2): 3}
  assert wide[policy + "+hidden=recompute"] == ["bfloat16"] * inputs, wide
  assert wide[policy] == ["bfloat16"] * kept[policy, inputs], wide


@pytest.mark.parametrize("cls,activation", [(Mlp, "gelu"), (GatedMlp, "silu")])
def test_a_frozen_last_linear_is_not_recomputed(cls, activation):
  """A frozen last linear keeps nothing of its input, so recomputing it would only keep
  the activation's input whole in place of its 2-bit code (ViT-B/16, LoRA on query and
  value, 2 layers: 347 -> 435 MiB compiled before this rule): the site runs as modules,
  keeping what the policy without it keeps. With an adapter there, it recomputes."""
  x = jax.random.normal(jax.random.key(1), (2, 24, 16), jnp.bfloat16)

  def kept(spec, last):
    m = cls(16, 256, activation=activation, policy=spec, dtype=jnp.bfloat16,
            rngs=nnx.Rngs(0))
    first, name = ("fc1", "fc2") if cls is Mlp else ("gate", "down")
    if last != "trained":  # frozen: an adapter on the first linear, the rest frozen
      lora.apply_lora(m, targets=(name if last == "lora" else first,))
    graphdef, params, rest = nnx.split(m, nnx.Param if last == "trained" else lora.LoRAParam,
                                       ...)

    def loss(p, x):
      return jnp.sum(nnx.merge(graphdef, p, rest, copy=True)(x).astype(jnp.float32) ** 2)
    return sorted((tuple(r.shape), str(r.dtype)) for r in saved_residuals(loss, params, x).items)

  assert kept("lowmembp+hidden=recompute", "frozen") == kept("lowmembp", "frozen")
  for last in ("lora", "trained"):
    assert kept("lowmembp+hidden=recompute", last) != kept("lowmembp", last)
  # frozen, the last linear keeps nothing of the activation's output
  wide = [r for r in kept("lowmembp", "trained") if r[0] == (2, 24, 256)]
  assert [r for r in kept("lowmembp", "frozen") if r[0] == (2, 24, 256)] == wide[1:]


def test_a_kernel_stored_frozen_keeps_no_input():
  """A kernel a streamed load stored in its frozen form (``FrozenKernel``, without
  ``freeze_kernel``) counts as frozen: the MLP runs as modules for it."""
  from lowmem_jax import quantized_weight
  from models.linear import FrozenKernel
  m = Mlp(16, 64, policy="lowmembp+hidden=recompute", rngs=nnx.Rngs(0))
  assert m.fc2.keeps_input and not m.fc2.frozen
  m.fc2.kernel = FrozenKernel(quantized_weight.quantize(m.fc2.kernel[...], "bfloat16"))
  assert not m.fc2.keeps_input


@pytest.mark.parametrize("kind", ["vit", "llama"])  # Mlp (BERT's too), GatedMlp
def test_models_same_loss_and_gradients_keeping_less(kind):
  keep = TINY[kind]("baseline")
  recompute = _same_params(keep, TINY[kind]("baseline+hidden=recompute"))
  assert_same_keeping_less(keep, recompute, _inputs(kind))


@pytest.mark.parametrize("kind", ["vit", "llama"])
def test_with_wta_crs_sampling_the_other_linears(kind):
  """WTA-CRS sampling the first linears (the same draws: the samplers' keys are the
  model's): the same loss and gradients, keeping less."""
  spec = "wta-crs+sample_targets=query,key,value,fc1,gate,up"
  keep = TINY[kind](spec)
  recompute = _same_params(keep, TINY[kind](spec + "+hidden=recompute"))
  assert_same_keeping_less(keep, recompute, _inputs(kind))


@pytest.mark.parametrize("model,keep,itemsize", [("vit", "baseline", 2),
                                                 ("llama", "baseline", 2),
                                                 ("llama", "lowmem", 1)])  # 8-bit codes
def test_train_step_peak_drops_by_the_hidden_outputs(model, keep, itemsize):
  """The stacked activation outputs (or their codes) of every layer leave the compiled
  step's peak (measured, CPU: lowmem's 524288 bytes of codes, 524400 fewer)."""
  if model == "vit":
    cfg = vit.config("vit-tiny", num_layers=4, dim=64, mlp_dim=256, num_heads=4)
    make, x = vit.ViT, jax.ShapeDtypeStruct((16, 32, 32, 3), jnp.float32)
    tokens, hidden = 16 * ((cfg.image_size // cfg.patch_size) ** 2 + 1), cfg.mlp_dim
  else:
    cfg = llama.config("llama-tiny", num_layers=4, dim=64, mlp_dim=256)
    make, x = llama.Llama, jax.ShapeDtypeStruct((8, 64), jnp.int32)
    tokens, hidden = 8 * 64, cfg.mlp_dim
  peaks = {}
  for policy in (keep, keep + "+hidden=recompute"):
    graphdef, params, rest = nnx.split(make(cfg, policy, dtype=jnp.bfloat16), nnx.Param,
                                       ...)

    def loss(p, rest, x):
      return jnp.mean(nnx.merge(graphdef, p, rest, copy=True)(x).astype(jnp.float32))
    peaks[policy] = peak_buffers(jax.grad(loss), params, rest, x).peak_bytes
  outputs = cfg.num_layers * tokens * hidden * itemsize  # act(h) (its code) of every layer
  recomputed = tokens * hidden * 2  # one layer's, bf16, live in backward
  saved = peaks[keep] - peaks[keep + "+hidden=recompute"]
  assert saved >= outputs - recomputed, (saved, outputs, peaks)


@pytest.mark.parametrize("kind", ["vit", "llama"])
def test_block_stack_same_gradients_less_compiled_temp(kind):
  """The built-in block stack (the memory report's) asks for the same site."""
  skip_unless_cpu_bounds_hold(jax.default_backend())
  cfg = block_stack.StackConfig(kind=kind, num_layers=3, dim=32, num_heads=2, mlp_dim=128)
  params = block_stack.init_stack(jax.random.key(0), cfg)
  x = jax.random.normal(jax.random.key(1), (2, 16, 32), jnp.bfloat16)
  grads, temp = {}, {}
  for spec in ("baseline", "baseline+hidden=recompute"):
    step = jax.jit(jax.grad(block_stack.stack_loss), static_argnums=(2, 3))
    compiled = step.lower(params, x, cfg, spec).compile()
    grads[spec] = compiled(params, x)
    temp[spec] = compiled.memory_analysis().temp_size_in_bytes
  for a, b in zip(jax.tree.leaves(grads["baseline"]),
                  jax.tree.leaves(grads["baseline+hidden=recompute"]), strict=True):
    np.testing.assert_array_equal(a, b)
  # the 3 layers' bf16 activation outputs, [2, 16, 128] each, less one live in backward
  assert temp["baseline"] - temp["baseline+hidden=recompute"] >= 2 * 2 * 16 * 128 * 2, temp


# ----------------------------------------------------------------------------- under Mesa
def _gated_down(inputs, params, consts):
  """The gated product and a last linear: ``(silu(g) * u) @ w``."""
  g, u = inputs
  return (jax.nn.silu(g) * u) @ params["w"] + consts


def test_coded_backward_is_the_exact_vjp_at_the_dequantized_inputs():
  keys = jax.random.split(jax.random.key(0), 4)
  g, u = (jax.random.normal(k, (6, 32)) for k in keys[:2])
  params, consts = {"w": jax.random.normal(keys[2], (32, 8))}, jnp.float32(0.5)
  ct = jax.random.normal(keys[3], (6, 8))
  strategy = CodedHidden(Coder(), gated=True)
  states = strategy.init_state()

  def ours(g, u, params):
    out, updated = strategy.apply(states, _gated_down, (g, u), params, consts)
    return out, updated
  (out, updated), vjp = jax.vjp(ours, g, u, params)
  np.testing.assert_array_equal(out, _gated_down((g, u), params, consts))  # exact forward
  assert all(int(updated[n].count) == 1 for n in ("gate", "up"))  # ranges updated
  # backward: the vjp of the whole function at the inputs' dequantized codes
  coded = [quant.quantize_tensor(x, states[n])[0] for x, n in ((g, "gate"), (u, "up"))]
  deq = tuple(q.dequantized() for q in coded)
  assert float(jnp.max(jnp.abs(deq[0] - g))) > 0  # the code is not the input
  _, ref_vjp = jax.vjp(lambda g, u, p: _gated_down((g, u), p, consts), *deq, params)
  got = vjp((ct, jax.tree.map(jnp.zeros_like, updated)))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref_vjp(ct)), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind,exact,coded", [("vit", "baseline", "mesa8"),  # GELU
                                               ("llama", "lowmembp", "lowmem")])  # gated
def test_coded_forward_exact_gradients_close_and_less_saved(kind, exact, coded):
  """Forward exact; the last linear's weight gradient reads the output recomputed from
  the inputs' codes where it read the output's own code: about as far from exact (CPU,
  relative error of all gradients: vit 0.068 against mesa8's 0.095, llama 0.0090
  against lowmem's 0.0096)."""
  (ek, sk), (er, sr) = coded_gradient_errors(kind, exact, coded, coded + "+hidden=recompute")
  assert 0 < er < 1.2 * ek, (er, ek)
  assert sr < sk, (sr, sk)


@pytest.mark.parametrize("targets,recomputed", [("query,value,fc2", True),
                                                ("query,value", False)])
def test_trains_with_lora_and_updates_the_codes_it_keeps(tmp_path, targets, recomputed):
  """With an adapter on fc2 the hidden site codes the activation's input each step (and
  the activation's own site is idle); with fc2 frozen the MLP runs as modules and the
  activation codes it."""
  from conftest import TINY_TRAIN
  from models import sites
  from test_train import _trainer
  from train import config as config_lib
  from train.batches import Batches
  from train.images import digits
  cfg = config_lib.load_config("digits-vit", None, TINY_TRAIN + [
      f"out_dir={tmp_path}", "policy=mesa8+hidden=recompute", "trainable=lora",
      f"lora_targets={targets}"])
  trainer = _trainer(cfg)
  batches = Batches(digits("train"), cfg.batch_size)
  for _ in range(2):
    assert np.isfinite(float(trainer.step(next(batches))["loss"]))
  mlp = nnx.merge(trainer.graphdef, trainer.state["params"], trainer.state["rest"]).stack \
      .layer(0).mlp
  assert isinstance(mlp.hidden.strategy, CodedHidden)
  counts = {name: [int(s.count[...]) for _, s in nnx.iter_graph(site)
                   if isinstance(s, sites.CodeSite)]
            for name, site in (("hidden", mlp.hidden), ("act", mlp.act))}
  assert counts == ({"hidden": [2], "act": [0]} if recomputed else
                    {"hidden": [0], "act": [2]}), counts
