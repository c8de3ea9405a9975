"""Transformer MLPs on the memory policy: ``fc2(act(fc1(x)))`` and LLaMA's gated form.

Each MLP holds the policy's strategies for its sites: the input its first linear(s) read
(``shared_input``), the activation (``act``: exact or approx2 GELU/SiLU, and what it
keeps), the activation's output that the last linear reads (``shared_hidden``), and the
activation with the last linear (``hidden``: as modules, or as one pure function whose
backward recomputes the activation's output, ``hidden=recompute``,
:mod:`lowmem_jax.hidden_recompute`).
"""

from __future__ import annotations

import functools

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
    self.fc1 = Linear(dim, hidden, name="fc1", reads_norm=True, **dense)
    self.fc2 = Linear(hidden, dim, name="fc2", **dense)
    self.shared_input = Site(policy.shared_strategy())
    self.act = Site(policy.activation_strategy(activation))
    self.shared_hidden = Site(policy.shared_strategy())
    self.hidden = Site(policy.hidden_strategy(activation))

  def __call__(self, x):
    h = checkpoint_name(self.fc1(self.shared_input(x)), "mlp_hidden")
    return _last(self.hidden, self.act, self.shared_hidden, self.fc2, (h,))


class GatedMlp(nnx.Module):
  """``down(act(gate(x)) * up(x))`` (LLaMA's SwiGLU), no biases."""

  def __init__(self, dim: int, hidden: int, *, activation: str = "silu",
               policy: MemoryPolicy | str = "baseline", dtype=None, rngs: nnx.Rngs):
    self.activation = activation
    self.policy = policy = MemoryPolicy.parse(policy)
    dense = dict(use_bias=False, dtype=dtype, rngs=rngs, policy=policy)
    self.gate = Linear(dim, hidden, name="gate", reads_norm=True, **dense)
    self.up = Linear(dim, hidden, name="up", reads_norm=True, **dense)
    self.down = Linear(hidden, dim, name="down", **dense)
    self.shared_input = Site(policy.shared_strategy())
    self.act = Site(policy.activation_strategy(activation, gated=True))
    self.shared_hidden = Site(policy.shared_strategy())
    self.hidden = Site(policy.hidden_strategy(activation, gated=True))

  def __call__(self, x):
    x = self.shared_input(x)
    g = checkpoint_name(self.gate(x), "mlp_hidden")
    u = checkpoint_name(self.up(x), "mlp_hidden")
    return _last(self.hidden, self.act, self.shared_hidden, self.down, (g, u))


def _run(graphdef, arithmetic, inputs, params, rest):
  """The activation's ``arithmetic`` on ``inputs``, then the last linear (split as
  ``graphdef``, ``params``, ``rest``): one pure function, for the ``hidden`` site."""
  a = checkpoint_name(arithmetic(*inputs), "mlp_act")
  return nnx.merge(graphdef, params, rest)(a)


def _last(hidden, act, shared_hidden, last, inputs):
  """The activation and the last linear on ``inputs``, as the ``hidden`` site says.

  As modules: the activation keeps what its site keeps, and the last linear what it keeps
  of the output in the form ``shared_hidden`` gives it. Or, where the site recomputes, one
  pure function of the activation's arithmetic and the last linear, whose strategy decides
  what is kept of ``inputs`` (the output is recomputed: no form of it is chosen). Only
  where the last linear keeps its input (it trains, or has an adapter): a frozen one keeps
  nothing of it, and recomputing would keep the activation's input whole in place of
  what the activation keeps (under Approx-BP, a 2-bit code)."""
  if not (hidden.strategy.recomputes and last.keeps_input):
    return last(shared_hidden(checkpoint_name(act(*inputs), "mlp_act")))
  graphdef, params, rest = nnx.split(last, nnx.Param, ...)
  return hidden(functools.partial(_run, graphdef, act.strategy.arithmetic), inputs, params,
                rest)
