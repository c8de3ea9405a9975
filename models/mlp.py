"""Transformer MLPs on the memory policy's activation (GELU/SiLU, exact or approx2)."""

from __future__ import annotations

from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from lowmem_jax.policy import MemoryPolicy


class Mlp(nnx.Module):
  """``fc2(act(fc1(x)))`` (ViT, BERT). Under approx2 the activation keeps 2 bits/element."""

  def __init__(self, dim: int, hidden: int, *, activation: str = "gelu", use_bias: bool = True,
               policy: MemoryPolicy | str = "baseline", dtype=None, rngs: nnx.Rngs):
    self.activation = activation
    self.policy = MemoryPolicy.parse(policy)
    self.fc1 = nnx.Linear(dim, hidden, use_bias=use_bias, dtype=dtype, rngs=rngs)
    self.fc2 = nnx.Linear(hidden, dim, use_bias=use_bias, dtype=dtype, rngs=rngs)

  def __call__(self, x):
    h = checkpoint_name(self.fc1(x), "mlp_hidden")
    a = checkpoint_name(self.policy.activation_fn(self.activation)(h), "mlp_act")
    return checkpoint_name(self.fc2(a), "mlp_out")


class GatedMlp(nnx.Module):
  """``down(act(gate(x)) * up(x))`` (LLaMA's SwiGLU), no biases."""

  def __init__(self, dim: int, hidden: int, *, activation: str = "silu",
               policy: MemoryPolicy | str = "baseline", dtype=None, rngs: nnx.Rngs):
    self.activation = activation
    self.policy = MemoryPolicy.parse(policy)
    self.gate = nnx.Linear(dim, hidden, use_bias=False, dtype=dtype, rngs=rngs)
    self.up = nnx.Linear(dim, hidden, use_bias=False, dtype=dtype, rngs=rngs)
    self.down = nnx.Linear(hidden, dim, use_bias=False, dtype=dtype, rngs=rngs)

  def __call__(self, x):
    g = checkpoint_name(self.gate(x), "mlp_hidden")
    u = checkpoint_name(self.up(x), "mlp_hidden")
    a = checkpoint_name(self.policy.activation_fn(self.activation)(g) * u, "mlp_act")
    return checkpoint_name(self.down(a), "mlp_out")
