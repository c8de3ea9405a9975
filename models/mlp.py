"""Transformer MLPs on the memory policy: ``fc2(act(fc1(x)))`` and LLaMA's gated form.

Each MLP holds the policy's strategies for its sites: the input its first linear(s) read
(``shared_input``), the activation (``act``: exact or approx2 GELU/SiLU, and what it
keeps), and the activation's output that the last linear reads (``shared_hidden``).
"""

from __future__ import annotations

from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from lowmem_jax.policy import MemoryPolicy
from models.linear import Linear
from models.sites import Site


class Mlp(nnx.Module):
  """``fc2(act(fc1(x)))`` (ViT, BERT)."""

  def __init__(self, dim: int, hidden: int, *, activation: str = "gelu", use_bias: bool = True,
               policy: MemoryPolicy | str = "baseline", dtype=None, rngs: nnx.Rngs):
    self.activation = activation
    self.policy = policy = MemoryPolicy.parse(policy)
    dense = dict(use_bias=use_bias, dtype=dtype, rngs=rngs, policy=policy)
    self.fc1 = Linear(dim, hidden, name="fc1", **dense)
    self.fc2 = Linear(hidden, dim, name="fc2", **dense)
    self.shared_input = Site(policy.shared_strategy())
    self.act = Site(policy.activation_strategy(activation))
    self.shared_hidden = Site(policy.shared_strategy())

  def __call__(self, x):
    h = checkpoint_name(self.fc1(self.shared_input(x)), "mlp_hidden")
    a = checkpoint_name(self.act(h), "mlp_act")
    return checkpoint_name(self.fc2(self.shared_hidden(a)), "mlp_out")


class GatedMlp(nnx.Module):
  """``down(act(gate(x)) * up(x))`` (LLaMA's SwiGLU), no biases."""

  def __init__(self, dim: int, hidden: int, *, activation: str = "silu",
               policy: MemoryPolicy | str = "baseline", dtype=None, rngs: nnx.Rngs):
    self.activation = activation
    self.policy = policy = MemoryPolicy.parse(policy)
    dense = dict(use_bias=False, dtype=dtype, rngs=rngs, policy=policy)
    self.gate = Linear(dim, hidden, name="gate", **dense)
    self.up = Linear(dim, hidden, name="up", **dense)
    self.down = Linear(hidden, dim, name="down", **dense)
    self.shared_input = Site(policy.shared_strategy())
    self.act = Site(policy.activation_strategy(activation, gated=True))
    self.shared_hidden = Site(policy.shared_strategy())

  def __call__(self, x):
    x = self.shared_input(x)
    g = checkpoint_name(self.gate(x), "mlp_hidden")
    u = checkpoint_name(self.up(x), "mlp_hidden")
    a = checkpoint_name(self.act(g, u), "mlp_act")
    return checkpoint_name(self.down(self.shared_hidden(a)), "mlp_out")
