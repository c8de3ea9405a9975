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
from models.config import derived_presets, init_model, token_ids
from models.embedding import Embed
from models.attention import SelfAttention
from models.linear import Linear
from models.mlp import GatedMlp
from models.norm import Norm
from models.reversible_stack import PreNorm, ReversibleStack

# ``revllama-<x>``: the ``llama-<x>`` preset's config (the same sizes).
PRESETS, config = derived_presets("rev", llama.PRESETS, llama.config, "RevLlama")


class RevLlamaAttention(nnx.Module):
  """``F(x) = attn(rms_norm(x))`` with RoPE tables built from x's (static) length, in the
  compute dtype."""

  def __init__(self, cfg: llama.LlamaConfig, policy: MemoryPolicy, dtype, rngs: nnx.Rngs):
    self.cfg, self.dtype = cfg, dtype
    self.norm = Norm(cfg.dim, kind="rms", eps=cfg.eps, policy=policy)
    self.attn = SelfAttention(cfg.dim, cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                              head_dim=cfg.resolved_head_dim, qkv_bias=False,
                              out_bias=False, causal=True, policy=policy, dtype=dtype,
                              rngs=rngs)

  def __call__(self, x):
    # in the compute dtype, as LLaMA's: x is the fp32 stream the reversible stack carries
    cos, sin = self.cfg.rope_tables(x.shape[1], self.dtype)
    return self.attn(self.norm(x), rope=(cos, sin))


def _mlp(cfg: llama.LlamaConfig, policy: MemoryPolicy, dtype, rngs: nnx.Rngs) -> PreNorm:
  """``G(x) = swiglu(rms_norm(x))``."""
  return PreNorm(Norm(cfg.dim, kind="rms", eps=cfg.eps, policy=policy),
                 GatedMlp(cfg.dim, cfg.mlp_dim, activation="silu", policy=policy, dtype=dtype,
                          rngs=rngs))


class RevLlama(nnx.Module):
  """``model(tokens[B, T]) -> logits[B, T, V]`` (float32)."""

  def __init__(self, cfg: llama.LlamaConfig | str = "revllama-tiny",
               policy: MemoryPolicy | str = "baseline", *, dtype=jnp.bfloat16,
               rngs: nnx.Rngs | None = None):
    rngs = init_model(self, cfg, config, llama.LlamaConfig, policy, dtype, rngs,
                      reversible=True)
    cfg, policy = self.cfg, self.policy
    init = nnx.initializers.normal(stddev=0.02)
    self.embed = Embed(cfg.vocab_size, cfg.dim, embedding_init=init, rngs=rngs)
    self.stack = ReversibleStack(lambda r: RevLlamaAttention(cfg, policy, self.dtype, r),
                                 lambda r: _mlp(cfg, policy, self.dtype, r),
                                 cfg.num_layers, policy, rngs)
    self.norm = Norm(2 * cfg.dim, kind="rms", eps=cfg.eps, policy=policy)
    self.lm_head = Linear(2 * cfg.dim, cfg.vocab_size, use_bias=False, dtype=self.dtype,
                          preferred_element_type=jnp.float32, kernel_init=init, rngs=rngs,
                          policy=policy)

  def __call__(self, tokens, mask=None):
    """``mask`` must be None or all-True on the keys: the stack has no padding mask."""
    return self.head(self.hidden(tokens, mask))

  def hidden(self, tokens, mask=None):
    """The final norm's output ``[B, T, 2 * dim]`` (both streams): what the head reads."""
    tokens = token_ids(tokens, "RevLlama", self.cfg.max_seq_len)
    del mask  # causal attention only; padding on the right is masked in the loss
    x = self.embed(tokens).astype(self.dtype)
    y1, y2 = self.stack(x, x)
    return self.norm(jnp.concatenate([y1, y2], axis=-1))

  def head(self, h):
    """Logits ``[B, T, V]`` (float32) of :meth:`hidden`'s output."""
    return self.lm_head(h).astype(jnp.float32)

  def head_weight(self):
    """``(w [2 * dim, V], False, None)``, the kernel as stored, or None when the head is
    not a plain matmul (:func:`models.llama.plain_kernel`)."""
    kernel = llama.plain_kernel(self.lm_head)
    return None if kernel is None else (kernel, False, None)

  def token_losses(self, tokens, targets, mask=None, *, chunk: int = llama.DEFAULT_CHUNK):
    """Per-token ``(cross-entropy fp32 [B, T], argmax == target [B, T])`` of the logits
    ``self(tokens)`` returns: see :func:`models.llama.head_losses`."""
    return llama.head_losses(self.hidden(tokens, mask), self.head, self.head_weight(),
                             targets, chunk)
