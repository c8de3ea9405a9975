"""Reversible LLaMA: LLaMA's sub-blocks in RevViT's two-stream form, on the memory policy.

Both streams start from the token embedding; block ``i`` maps ``(x1, x2)`` to
``y1 = x1 + F_i(x2)``, ``y2 = x2 + G_i(y1)`` with ``F = causal attention(rms_norm(.))``
with RoPE and ``G = SwiGLU(rms_norm(.))``; the head reads the concatenated streams
through a ``2 * dim`` RMSNorm. Under ``policy.reversible`` the stack saves only its
outputs (:mod:`models.reversible_stack`). Causal language modelling only: the stack
takes no padding mask (pad on the right and mask the loss). A new architecture, trained
from scratch: no HF checkpoint maps onto it. Presets ``revllama-*`` mirror ``llama-*``.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from lowmem_jax.policy import MemoryPolicy
from models import llama
from models.attention import SelfAttention
from models.linear import Linear
from models.mlp import GatedMlp
from models.norm import Norm
from models.reversible_stack import ReversibleStack, check_policy

PRESETS = tuple("rev" + name for name in llama.PRESETS)


def config(name: str = "revllama-tiny", **overrides) -> llama.LlamaConfig:
  """``revllama-<x>``: the ``llama-<x>`` preset's config (the same sizes)."""
  if not name.startswith("revllama-"):
    raise ValueError(f"unknown reversible LLaMA preset {name!r}; valid: {', '.join(PRESETS)}")
  return llama.config(name[len("rev"):], **overrides)


class RevLlamaAttention(nnx.Module):
  """``F(x) = attn(rms_norm(x))`` with RoPE tables built from x's (static) length."""

  def __init__(self, cfg: llama.LlamaConfig, policy: MemoryPolicy, dtype, rngs: nnx.Rngs):
    self.cfg = cfg
    self.norm = Norm(cfg.dim, kind="rms", eps=cfg.eps, policy=policy)
    self.attn = SelfAttention(cfg.dim, cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                              head_dim=cfg.resolved_head_dim, qkv_bias=False,
                              out_bias=False, causal=True, policy=policy, dtype=dtype,
                              rngs=rngs)

  def __call__(self, x):
    cos, sin = llama.rope_tables(x.shape[1], self.cfg.resolved_head_dim, self.cfg.rope_theta,
                                 x.dtype)
    rotary = lambda q, k: (llama.apply_rope(q, cos, sin), llama.apply_rope(k, cos, sin))
    return self.attn(self.norm(x), rotary=rotary)


class RevLlamaMlp(nnx.Module):
  """``G(x) = swiglu(rms_norm(x))``."""

  def __init__(self, cfg: llama.LlamaConfig, policy: MemoryPolicy, dtype, rngs: nnx.Rngs):
    self.norm = Norm(cfg.dim, kind="rms", eps=cfg.eps, policy=policy)
    self.mlp = GatedMlp(cfg.dim, cfg.mlp_dim, activation="silu", policy=policy, dtype=dtype,
                        rngs=rngs)

  def __call__(self, x):
    return self.mlp(self.norm(x))


class RevLlama(nnx.Module):
  """``model(tokens[B, T]) -> logits[B, T, V]`` (float32)."""

  def __init__(self, cfg: llama.LlamaConfig | str = "revllama-tiny",
               policy: MemoryPolicy | str = "baseline", *, dtype=jnp.bfloat16,
               rngs: nnx.Rngs | None = None):
    self.cfg = cfg = config(cfg) if isinstance(cfg, str) else cfg
    self.policy = policy = MemoryPolicy.parse(policy)
    check_policy(policy, "RevLlama")
    self.dtype = jnp.dtype(dtype)
    rngs = nnx.Rngs(0) if rngs is None else rngs
    init = nnx.initializers.normal(stddev=0.02)
    self.embed = nnx.Embed(cfg.vocab_size, cfg.dim, embedding_init=init, rngs=rngs)
    self.stack = ReversibleStack(lambda r: RevLlamaAttention(cfg, policy, self.dtype, r),
                                 lambda r: RevLlamaMlp(cfg, policy, self.dtype, r),
                                 cfg.num_layers, policy, rngs)
    self.norm = Norm(2 * cfg.dim, kind="rms", eps=cfg.eps, policy=policy)
    self.lm_head = Linear(2 * cfg.dim, cfg.vocab_size, use_bias=False, dtype=self.dtype,
                          preferred_element_type=jnp.float32, kernel_init=init, rngs=rngs,
                          policy=policy)

  def __call__(self, tokens, mask=None):
    """``mask`` must be None or all-True on the keys: the stack has no padding mask."""
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(f"RevLlama expects int tokens [batch, seq], got {tokens.dtype}"
                       f"{list(tokens.shape)}")
    if tokens.shape[1] > self.cfg.max_seq_len:
      raise ValueError(f"RevLlama: sequence length {tokens.shape[1]} exceeds max_seq_len "
                       f"{self.cfg.max_seq_len}")
    del mask  # causal attention only; padding on the right is masked in the loss
    x = self.embed(tokens).astype(self.dtype)
    y1, y2 = self.stack(x, x)
    return self.lm_head(self.norm(jnp.concatenate([y1, y2], axis=-1))).astype(jnp.float32)
