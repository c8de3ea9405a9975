"""Transformer MLPs on the memory policy's activation (GELU/SiLU, exact or approx2).

Under Mesa (``policy.quantizes``) the input is coded once for the first linear(s), the
exact activation keeps the code of its input (approx2 keeps its 2-bit code, smaller
still), and the last linear keeps the code of its input.
"""

from __future__ import annotations

import functools

from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from lowmem_jax import quant
from lowmem_jax.policy import MemoryPolicy
from models.linear import Linear
from models.sites import int8_site


def _gated(act, g, u):
  return act(g) * u


class Mlp(nnx.Module):
  """``fc2(act(fc1(x)))`` (ViT, BERT). Under approx2 the activation keeps 2 bits/element."""

  def __init__(self, dim: int, hidden: int, *, activation: str = "gelu", use_bias: bool = True,
               policy: MemoryPolicy | str = "baseline", dtype=None, rngs: nnx.Rngs):
    self.activation = activation
    self.policy = policy = MemoryPolicy.parse(policy)
    dense = dict(use_bias=use_bias, dtype=dtype, rngs=rngs, policy=policy)
    self.fc1 = Linear(dim, hidden, name="fc1", **dense)
    self.fc2 = Linear(hidden, dim, name="fc2", **dense)
    self.input_code = int8_site(policy)
    self.act_code = int8_site(policy) if policy.activation == "exact" else None
    self.hidden_code = int8_site(policy)

  def __call__(self, x):
    if self.input_code is not None:
      x = self.input_code(x)
    h = checkpoint_name(self.fc1(x), "mlp_hidden")
    act = self.policy.activation_fn(self.activation)
    a = act(h) if self.act_code is None else quant.int8_vjp(act, [self.act_code(h)])
    a = checkpoint_name(a, "mlp_act")
    if self.hidden_code is not None:
      a = self.hidden_code(a)
    return checkpoint_name(self.fc2(a), "mlp_out")


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
    self.input_code = int8_site(policy)
    self.gate_code = int8_site(policy)
    self.up_code = int8_site(policy)
    self.hidden_code = int8_site(policy)

  def __call__(self, x):
    if self.input_code is not None:
      x = self.input_code(x)
    g = checkpoint_name(self.gate(x), "mlp_hidden")
    u = checkpoint_name(self.up(x), "mlp_hidden")
    act = self.policy.activation_fn(self.activation)
    if self.gate_code is None:
      a = act(g) * u
    else:  # one rule for act(g) * u: keeps the codes of g and u only
      a = quant.int8_vjp(functools.partial(_gated, act), [self.gate_code(g), self.up_code(u)])
    a = checkpoint_name(a, "mlp_act")
    if self.hidden_code is not None:
      a = self.hidden_code(a)
    return checkpoint_name(self.down(a), "mlp_out")
