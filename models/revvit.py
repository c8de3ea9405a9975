"""Reversible ViT (RevViT, CVPR 2022), Flax NNX, on the memory policy.

Two residual streams, both starting from the patch embedding: block ``i`` maps
``(x1, x2)`` to ``y1 = x1 + F_i(x2)``, ``y2 = x2 + G_i(y1)`` with ``F = attn(norm(.))``
and ``G = mlp(norm(.))`` (ViT's sub-blocks). The head reads the class token of the
concatenated streams through a ``2 * dim`` LayerNorm, as RevViT does.

Under ``policy.reversible`` ("vanilla" or "pareprop") the whole stack is one custom_vjp
that saves only its final outputs and rebuilds each block's inputs in backward:
activation memory independent of depth. Under any other policy the same stack runs under
plain autodiff, the baseline for memory and gradients (:mod:`models.reversible_stack`).
Norms and activations follow the policy (MS norms, approx2); Mesa and WTA-CRS sites are
not supported in the blocks (under ``reversible`` they would have nothing to act on).
Presets ``revvit-*`` mirror ``vit-*``; there is no HF checkpoint format for RevViT.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from lowmem_jax.policy import MemoryPolicy
from models import vit
from models.config import derived_presets, init_model
from models.attention import SelfAttention
from models.linear import Linear
from models.mlp import Mlp
from models.norm import Norm
from models.reversible_stack import PreNorm, ReversibleStack

# ``revvit-<x>``: the ``vit-<x>`` preset's config (the same sizes).
PRESETS, config = derived_presets("rev", vit.PRESETS, vit.config, "RevViT")


def _attention(cfg: vit.ViTConfig, policy: MemoryPolicy, dtype, rngs: nnx.Rngs) -> PreNorm:
  """``F(x) = attn(norm(x))``."""
  return PreNorm(Norm(cfg.dim, eps=cfg.eps, policy=policy),
                 SelfAttention(cfg.dim, cfg.num_heads, qkv_bias=cfg.qkv_bias, policy=policy,
                               dtype=dtype, rngs=rngs))


def _mlp(cfg: vit.ViTConfig, policy: MemoryPolicy, dtype, rngs: nnx.Rngs) -> PreNorm:
  """``G(x) = mlp(norm(x))``."""
  return PreNorm(Norm(cfg.dim, eps=cfg.eps, policy=policy),
                 Mlp(cfg.dim, cfg.mlp_dim, activation="gelu", policy=policy, dtype=dtype,
                     rngs=rngs))


class RevViT(nnx.Module):

  def __init__(self, cfg: vit.ViTConfig | str = "revvit-digits",
               policy: MemoryPolicy | str = "baseline", *, dtype=jnp.bfloat16,
               rngs: nnx.Rngs | None = None):
    rngs = init_model(self, cfg, config, vit.ViTConfig, policy, dtype, rngs, reversible=True)
    policy, c = self.policy, self.cfg
    vit.check_qkv_bias(c, policy)
    vit.init_embeddings(self, c, dtype, rngs)
    self.stack = ReversibleStack(lambda r: _attention(c, policy, dtype, r),
                                 lambda r: _mlp(c, policy, dtype, r), c.num_layers, policy,
                                 rngs)
    self.norm = Norm(2 * c.dim, eps=c.eps, policy=policy)
    self.head = Linear(2 * c.dim, c.num_labels, dtype=dtype, rngs=rngs, policy=policy)

  def __call__(self, images):
    x = vit.embed(self, images)
    y1, y2 = self.stack(x, x)
    h = jnp.concatenate([y1[:, 0], y2[:, 0]], axis=-1)
    return self.head(self.norm(h)).astype(jnp.float32)
