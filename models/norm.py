"""A block's norm, as the memory policy says.

Standard norms hold ``scale`` (and ``bias`` for LayerNorm) and run plain autodiff. MS
norms (``policy.merges_norm_affine``) hold no parameters: their affine lives merged in
the linear layer(s) that read the output (``lowmem_jax.norms.merge_norm_affine``, done
at build or checkpoint import), so the norm output is the very array those linears save.

Under Mesa (``policy.quantizes``) the norm returns a :class:`lowmem_jax.quant.QTensor`:
its output with the uint8 code that every linear reading it keeps. A standard norm also
keeps the code of its input; an MS norm keeps only the code of its output (shared with
the linears) and the fp32 rstd.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from flax import nnx

from lowmem_jax import quant
from lowmem_jax.policy import MemoryPolicy
from models.sites import int8_site


class Norm(nnx.Module):
  """LayerNorm (``kind="layer"``) or RMSNorm (``kind="rms"``) over the last axis."""

  def __init__(self, dim: int, *, kind: str = "layer", eps: float = 1e-6,
               use_bias: bool = True, policy: MemoryPolicy | str = "baseline"):
    if kind not in ("layer", "rms"):
      raise ValueError(f"Norm: unknown kind {kind!r}; valid: 'layer', 'rms'")
    self.kind, self.eps, self.dim = kind, float(eps), dim
    self.policy = policy = MemoryPolicy.parse(policy)
    has_affine = not policy.merges_norm_affine
    self.scale = nnx.Param(jnp.ones((dim,), jnp.float32)) if has_affine else None
    has_bias = has_affine and kind == "layer" and use_bias
    self.bias = nnx.Param(jnp.zeros((dim,), jnp.float32)) if has_bias else None
    self.input_code = int8_site(policy) if has_affine else None
    self.output_code = int8_site(policy)

  def __call__(self, x, *, name: str | None = "norm_out"):
    fn = self.policy.norm_fn(self.kind)
    if self.policy.merges_norm_affine:
      if self.output_code is not None:
        return self.output_code.ms_norm(self.kind, x, self.eps)
      return fn(x, self.eps, name=name)
    affine = (self.scale[...],) if self.kind == "rms" else (
        self.scale[...], None if self.bias is None else self.bias[...])
    if self.input_code is None:
      return fn(x, *affine, self.eps, name=name)
    rule = functools.partial(_standard_norm, fn, self.eps, self.bias is None
                             and self.kind == "layer")
    y = quant.int8_vjp(rule, [self.input_code(x)], tuple(a for a in affine if a is not None))
    return self.output_code(y)


def _standard_norm(fn, eps, no_bias, x, *affine):
  if no_bias:
    affine = affine + (None,)
  return fn(x, *affine, eps)
