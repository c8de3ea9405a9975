"""A block's norm, as the memory policy's norm strategy says.

A strategy with an affine (``has_affine``) gets the norm's ``scale`` (and ``bias`` for
LayerNorm); one without (MS norms) gets none: the affine lives merged in the linear(s)
that read the output (``lowmem_jax.norms.merge_norm_affine``, done at build or
checkpoint import), so the norm output is the very array those linears save. The output
may come carried with what its readers keep (Mesa: its code).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from lowmem_jax.policy import MemoryPolicy
from models.sites import Site


class Norm(nnx.Module):
  """LayerNorm (``kind="layer"``) or RMSNorm (``kind="rms"``) over the last axis."""

  def __init__(self, dim: int, *, kind: str = "layer", eps: float = 1e-6,
               use_bias: bool = True, policy: MemoryPolicy | str = "baseline"):
    if kind not in ("layer", "rms"):
      raise ValueError(f"Norm: unknown kind {kind!r}; valid: 'layer', 'rms'")
    self.kind, self.eps, self.dim = kind, float(eps), dim
    self.policy = policy = MemoryPolicy.parse(policy)
    strategy = policy.norm_strategy(kind)
    has_affine = strategy.has_affine
    self.scale = nnx.Param(jnp.ones((dim,), jnp.float32)) if has_affine else None
    has_bias = has_affine and kind == "layer" and use_bias
    self.bias = nnx.Param(jnp.zeros((dim,), jnp.float32)) if has_bias else None
    self.saving = Site(strategy)

  def _affine(self):
    if self.scale is None:
      return ()
    if self.kind == "rms":
      return (self.scale[...],)
    return (self.scale[...], None if self.bias is None else self.bias[...])

  def __call__(self, x, *, name: str | None = "norm_out"):
    return self.saving(x, self._affine(), eps=self.eps, name=name)
