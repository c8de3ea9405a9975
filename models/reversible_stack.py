"""A reversible two-stream stack of Flax modules, on the memory policy.

``ReversibleStack(make_f, make_g, num_layers, policy, rngs)`` builds ``num_layers``
pairs of sub-blocks as two modules whose variables carry a leading layer axis (the
layout the stack scans over, so no per-call copy of the parameters) and maps
``(x1, x2)`` to ``(y1, y2)``: ``y1 = x1 + F_i(x2)``, ``y2 = x2 + G_i(y1)``. The streams
are kept in fp32 whatever the compute dtype (F and G compute in it): rebuilding
``x2 = y2 - G(y1)`` in bf16 cancels catastrophically when ``|G(y1)| >> |x2|`` (measured:
50% gradient error at depth 12 with bf16 streams, the error of plain autodiff with fp32
streams). Under
``policy.reversible`` ("vanilla" | "pareprop" | "pareprop-stream") it runs
:func:`lowmem_jax.reversible.reversible_stack` (saves only the outputs, rebuilds block
inputs in backward); otherwise :func:`lowmem_jax.reversible.reference_stack` (plain
autodiff of the same blocks: the baseline). Mesa, WTA-CRS and remat do not apply to its
blocks (a ValueError says so).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax.numpy as jnp
from flax import nnx

from lowmem_jax import reversible
from lowmem_jax.policy import MemoryPolicy
from models.stack import stacked


def _apply(graphdef, state, x, key):
  """One sub-block from its graph definition and (per-layer) state; computes in the
  blocks' dtype, returns in the streams' (fp32)."""
  del key  # the sub-blocks here draw no randomness
  return nnx.merge(graphdef, state, copy=True)(x).astype(x.dtype)


class PreNorm(nnx.Module):
  """``body(norm(x))``: one stream's sub-block (RevViT's F and G, RevLlama's G)."""

  def __init__(self, norm: nnx.Module, body: nnx.Module):
    self.norm, self.body = norm, body

  def __call__(self, x):
    return self.body(self.norm(x))


class ReversibleStack(nnx.Module):

  def __init__(self, make_f: Callable, make_g: Callable, num_layers: int,
               policy: MemoryPolicy, rngs: nnx.Rngs):
    self.policy = policy
    self.f_blocks = stacked(make_f, num_layers, rngs)
    self.g_blocks = stacked(make_g, num_layers, rngs)

  def __call__(self, x1, x2):
    """``(y1, y2)`` in fp32 (float64 for float64 inputs) from inputs of any float dtype."""
    stream = jnp.promote_types(jnp.result_type(x1, x2), jnp.float32)
    x1, x2 = x1.astype(stream), x2.astype(stream)
    graph_f, params_f = nnx.split(self.f_blocks)
    graph_g, params_g = nnx.split(self.g_blocks)
    f, g = functools.partial(_apply, graph_f), functools.partial(_apply, graph_g)
    if self.policy.reversible == "none":
      return reversible.reference_stack(f, g, params_f, params_g, x1, x2)
    return reversible.reversible_stack(f, g, params_f, params_g, x1, x2,
                                       schedule=self.policy.reversible)
