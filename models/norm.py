"""A block's norm, as the memory policy says.

Standard norms hold ``scale`` (and ``bias`` for LayerNorm) and run plain autodiff. MS
norms (``policy.merges_norm_affine``) hold no parameters: their affine lives merged in
the linear layer(s) that read the output (``lowmem_jax.norms.merge_norm_affine``, done
at build or checkpoint import), so the norm output is the very array those linears save.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from lowmem_jax.policy import MemoryPolicy


class Norm(nnx.Module):
  """LayerNorm (``kind="layer"``) or RMSNorm (``kind="rms"``) over the last axis."""

  def __init__(self, dim: int, *, kind: str = "layer", eps: float = 1e-6,
               use_bias: bool = True, policy: MemoryPolicy | str = "baseline"):
    if kind not in ("layer", "rms"):
      raise ValueError(f"Norm: unknown kind {kind!r}; valid: 'layer', 'rms'")
    self.kind, self.eps, self.dim = kind, float(eps), dim
    self.policy = MemoryPolicy.parse(policy)
    has_affine = not self.policy.merges_norm_affine
    self.scale = nnx.Param(jnp.ones((dim,), jnp.float32)) if has_affine else None
    has_bias = has_affine and kind == "layer" and use_bias
    self.bias = nnx.Param(jnp.zeros((dim,), jnp.float32)) if has_bias else None

  def __call__(self, x, *, name: str | None = "norm_out"):
    fn = self.policy.norm_fn(self.kind)
    if self.policy.merges_norm_affine:
      return fn(x, self.eps, name=name)
    if self.kind == "rms":
      return fn(x, self.scale[...], self.eps, name=name)
    bias = None if self.bias is None else self.bias[...]
    return fn(x, self.scale[...], bias, self.eps, name=name)
