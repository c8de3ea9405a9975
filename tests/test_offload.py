"""Activation offload (``offload``, lowmem_jax/offload.py): the presets, the exact function
and gradients, the named residuals kept in host memory, and the trainer and benches."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowmem_jax import block_stack, memory
from lowmem_jax.policy import CHECKPOINT_NAMES, MemoryPolicy
from conftest import TINY_MODEL

SAVE_ALL = "remat:save=" + ",".join(CHECKPOINT_NAMES)
STACKS = {"vit": block_stack.StackConfig(kind="vit", num_layers=2, dim=32, num_heads=4,
                                         mlp_dim=64),
          "llama": block_stack.StackConfig(kind="llama", num_layers=2, dim=32, num_heads=4,
                                           num_kv_heads=2, mlp_dim=48)}


def test_presets_parse_alone_and_combined():
  assert MemoryPolicy.parse("offload") == MemoryPolicy(remat="offload")
  assert MemoryPolicy.parse("remat:offload") == MemoryPolicy(remat="offload")
  both = MemoryPolicy.parse("lowmembp+offload")
  assert both == MemoryPolicy(activation="approx2", norm="ms", remat="offload")
  assert both.spec == "lowmembp+offload" and MemoryPolicy.parse(both.spec) == both
  assert both.checkpoint_policy() is not None
  with pytest.raises(ValueError, match="'remat' already set remat='full'"):
    MemoryPolicy.parse("remat+offload")
  assert memory.theoretical_bytes_per_token(STACKS["vit"], both, 2) is None  # measured


def _stack(kind, spec):
  cfg, policy = STACKS[kind], MemoryPolicy.parse(spec)
  params = block_stack.init_stack(jax.random.key(0), cfg, policy)
  x = jax.random.normal(jax.random.key(1), (2, 8, cfg.dim))
  return functools.partial(block_stack.stack_loss, cfg=cfg, policy=policy), params, x


@pytest.mark.parametrize("kind", ["vit", "llama"])
@pytest.mark.parametrize("spec,reference", [("offload", "baseline"),
                                            ("lowmembp+offload", "lowmembp")])
def test_block_stack_values_and_gradients_equal_the_reference(kind, spec, reference):
  (f, params, x), (f_ref, _, _) = _stack(kind, spec), _stack(kind, reference)
  value, grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(params, x)
  value_ref, grads_ref = jax.jit(jax.value_and_grad(f_ref, argnums=(0, 1)))(params, x)
  np.testing.assert_allclose(value, value_ref, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_vit_values_and_gradients_equal_baseline():
  from models import vit
  cfg = vit.config("vit-digits", **{**TINY_MODEL, "num_layers": 2})
  images = jax.random.normal(jax.random.key(1), (4, 8, 8, 1))
  out = {}
  for spec in ("baseline", "offload"):
    graphdef, params, rest = nnx.split(vit.ViT(cfg, spec, dtype=jnp.float32), nnx.Param, ...)
    loss = lambda p: jnp.mean(jnp.sin(nnx.merge(graphdef, p, rest, copy=True)(images)))
    out[spec] = jax.jit(jax.value_and_grad(loss))(params)
  np.testing.assert_allclose(out["offload"][0], out["baseline"][0], rtol=1e-6)
  for a, b in zip(jax.tree.leaves(out["offload"][1]), jax.tree.leaves(out["baseline"][1])):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _residual_spaces(spec):
  """(memory space, shape) of each activation the stack's backward keeps."""
  f, params, x = _stack("llama", spec)
  return [(str(aval.memory_space), tuple(aval.shape))
          for aval, source in memory._jax_saved_residuals(f, params, x)
          if not source.startswith(("from the argument", "from a literal"))]


def test_the_named_tensors_are_kept_in_host_memory():
  offload, save_all = _residual_spaces("offload"), _residual_spaces(SAVE_ALL)
  # the same tensors as saving every name, but in host memory; the block inputs (the
  # scan carry) and the loss's own stay on the device
  assert sorted(shape for _, shape in offload) == sorted(shape for _, shape in save_all)
  host = [shape for space, shape in offload if space == "MemorySpace.Host"]
  assert len(host) == 7 and all(len(s) >= 4 for s in host)  # [layers, B, N, ...]
  assert {space for space, _ in save_all} == {"MemorySpace.Device"}
  device = [shape for space, shape in offload if space == "MemorySpace.Device"]
  assert sorted(device) == [(2, 2, 8, 32), (2, 8, 32)]  # block inputs, loss input


def test_the_lowered_gpu_step_moves_them_to_pinned_host_and_back():
  """The train step lowered for a GPU (no GPU needed to lower) annotates each offloaded
  tensor for pinned host memory in forward and for the device in backward."""
  f, params, x = _stack("llama", "offload")
  step = jax.jit(jax.grad(f)).trace(params, x)
  gpu = step.lower(lowering_platforms=("cuda",)).as_text()
  assert gpu.count('_xla_buffer_placement = "pinned_host"') == 7
  assert gpu.count('_xla_buffer_placement = "device"') == 7
  # on the CPU host and device memory are one: the moves lower to nothing
  assert "_xla_buffer_placement" not in step.lower(lowering_platforms=("cpu",)).as_text()


def test_on_the_cpu_offload_keeps_what_saving_every_name_keeps():
  temps = []
  for spec in ("offload", SAVE_ALL):
    _, params, x = _stack("vit", spec)
    cfg, policy = STACKS["vit"], MemoryPolicy.parse(spec)
    step = functools.partial(block_stack.sgd_step, cfg=cfg, policy=policy)
    temps.append(memory.step_memory(step, params, x).temp)
  assert temps[0] == temps[1]


def test_the_trainer_and_benches_take_it():
  from train.bench import parse_policies
  from train.config import load_config
  assert parse_policies("offload,lowmembp+offload") == [
      "baseline", "offload", "lowmembp+offload"]
  cfg = load_config(overrides=["policy=lowmembp+offload"])
  assert MemoryPolicy.parse(cfg.policy).remat == "offload"
