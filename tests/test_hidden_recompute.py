"""hidden=recompute: the MLP's last linear reads the activation's output recomputed in
backward (lowmem_jax/hidden_recompute.py, models/mlp.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowmem_jax import block_stack
from lowmem_jax.baseline import KeepRun
from lowmem_jax.hidden_recompute import RecomputeHidden
from lowmem_jax.memory import peak_buffers, saved_residuals
from lowmem_jax.policy import MemoryPolicy
from models import llama, lora, vit
from models.mlp import GatedMlp, Mlp
from test_methods_in_models import TINY, _same_params
from test_qkv_recompute import _inputs, assert_same_keeping_less


def test_policy_field_and_its_checks():
  p = MemoryPolicy.parse("lowmembp+hidden=recompute")
  assert p.hidden == "recompute" and MemoryPolicy.parse(p.spec) == p
  assert isinstance(p.hidden_strategy(), RecomputeHidden)
  assert type(MemoryPolicy.parse("lowmembp").hidden_strategy()) is KeepRun
  # under a block checkpoint policy the policy decides what a block keeps: no-op
  assert type(MemoryPolicy.parse("remat+hidden=recompute").hidden_strategy()) is KeepRun
  with pytest.raises(ValueError, match="unknown hidden 'again'"):
    MemoryPolicy.parse("hidden=again")
  with pytest.raises(ValueError, match="hidden=recompute cannot recompute Mesa's"):
    MemoryPolicy.parse("lowmem+hidden=recompute")
  with pytest.raises(ValueError, match="hidden=recompute cannot recompute WTA-CRS's"):
    MemoryPolicy.parse("wta-crs+hidden=recompute+sample_targets=fc1")


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
    name = "fc2" if cls is Mlp else "down"
    trains = {"frozen": nnx.All(nnx.Param, nnx.Not(nnx.PathContains(name))),
              "lora": lora.LoRAParam, "trained": nnx.Param}[last]
    if last == "frozen":
      getattr(m, name).freeze_kernel()
    elif last == "lora":
      lora.apply_lora(m, targets=(name,))
    graphdef, params, rest = nnx.split(m, trains, ...)

    def loss(p, x):
      return jnp.sum(nnx.merge(graphdef, p, rest, copy=True)(x).astype(jnp.float32) ** 2)
    return sorted((tuple(r.shape), str(r.dtype)) for r in saved_residuals(loss, params, x).items)

  assert kept("lowmembp+hidden=recompute", "frozen") == kept("lowmembp", "frozen")
  for last in ("lora", "trained"):
    assert kept("lowmembp+hidden=recompute", last) != kept("lowmembp", last)
  # frozen, the last linear keeps nothing of the activation's output
  wide = [r for r in kept("lowmembp", "trained") if r[0] == (2, 24, 256)]
  assert [r for r in kept("lowmembp", "frozen") if r[0] == (2, 24, 256)] == wide[1:]


@pytest.mark.parametrize("kind", ["vit", "llama"])  # Mlp (BERT's too), GatedMlp
def test_models_same_loss_and_gradients_keeping_less(kind):
  keep = TINY[kind]("baseline")
  recompute = _same_params(keep, TINY[kind]("baseline+hidden=recompute"))
  assert_same_keeping_less(keep, recompute, _inputs(kind))


@pytest.mark.parametrize("model", ["vit", "llama"])
def test_train_step_peak_drops_by_the_hidden_outputs(model):
  """The stacked activation outputs of every layer leave the compiled step's peak."""
  if model == "vit":
    cfg = vit.config("vit-tiny", num_layers=4, dim=64, mlp_dim=256, num_heads=4)
    make, x = vit.ViT, jax.ShapeDtypeStruct((16, 32, 32, 3), jnp.float32)
    tokens, hidden = 16 * ((cfg.image_size // cfg.patch_size) ** 2 + 1), cfg.mlp_dim
  else:
    cfg = llama.config("llama-tiny", num_layers=4, dim=64, mlp_dim=256)
    make, x = llama.Llama, jax.ShapeDtypeStruct((8, 64), jnp.int32)
    tokens, hidden = 8 * 64, cfg.mlp_dim
  peaks = {}
  for policy in ("baseline", "baseline+hidden=recompute"):
    graphdef, params, rest = nnx.split(make(cfg, policy, dtype=jnp.bfloat16), nnx.Param,
                                       ...)

    def loss(p, rest, x):
      return jnp.mean(nnx.merge(graphdef, p, rest, copy=True)(x).astype(jnp.float32))
    peaks[policy] = peak_buffers(jax.grad(loss), params, rest, x).peak_bytes
  outputs = cfg.num_layers * tokens * hidden * 2  # bf16 act(h) of every layer
  recomputed = tokens * hidden * 2  # one layer's, live in backward
  saved = peaks["baseline"] - peaks["baseline+hidden=recompute"]
  assert saved >= outputs - recomputed, (saved, outputs, peaks)


@pytest.mark.parametrize("kind", ["vit", "llama"])
def test_block_stack_same_gradients_less_compiled_temp(kind):
  """The built-in block stack (the memory report's) asks for the same site."""
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
