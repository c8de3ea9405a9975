"""Multi-head self-attention on the memory policy's attention implementation.

q, k and v are projected straight to ``[B, N, heads, head_dim]`` and the out-projection
contracts ``(heads, head_dim)`` directly (``LinearGeneral``), so no reshape makes a
second copy of what the attention saves: the out-projection saves the very ``o`` that
the attention saved. Grouped-query attention via ``num_kv_heads``.

Under Mesa (``policy.quantizes``) the block input is coded once for q, k and v, the
attention keeps head-wise uint8 codes of q, k and v (its backward recomputes the
probabilities from them: no N x N array is kept, not even in 8 bits), and the
out-projection keeps the head-wise code of ``o``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from lowmem_jax import quant
from lowmem_jax.attention import attention
from lowmem_jax.policy import MemoryPolicy
from models.linear import LinearGeneral
from models.sites import int8_site


def _attend(causal, implementation, q, k, v, mask):
  return attention(q, k, v, causal=causal, mask=mask, implementation=implementation)


class SelfAttention(nnx.Module):

  def __init__(self, dim: int, num_heads: int, *, num_kv_heads: int | None = None,
               head_dim: int | None = None, qkv_bias: bool = True, out_bias: bool = True,
               causal: bool = False, policy: MemoryPolicy | str = "baseline",
               dtype=None, rngs: nnx.Rngs):
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    head_dim = dim // num_heads if head_dim is None else head_dim
    if num_heads % num_kv_heads:
      raise ValueError(f"SelfAttention: {num_heads} heads not a multiple of "
                       f"{num_kv_heads} kv heads")
    self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
    self.causal = causal
    self.policy = policy = MemoryPolicy.parse(policy)
    proj = dict(use_bias=qkv_bias, dtype=dtype, rngs=rngs, policy=policy)
    self.query = LinearGeneral(dim, (num_heads, head_dim), name="query", **proj)
    self.key = LinearGeneral(dim, (num_kv_heads, head_dim), name="key", **proj)
    self.value = LinearGeneral(dim, (num_kv_heads, head_dim), name="value", **proj)
    self.out = LinearGeneral((num_heads, head_dim), dim, axis=(-2, -1), use_bias=out_bias,
                             dtype=dtype, rngs=rngs, policy=policy, name="out")
    # Mesa sites (None unless the policy quantizes): input, q/k/v and o, head-wise.
    self.input_code = int8_site(policy)
    self.q_code = int8_site(policy, num_heads, axis=2)
    self.k_code = int8_site(policy, num_kv_heads, axis=2)
    self.v_code = int8_site(policy, num_kv_heads, axis=2)
    self.o_code = int8_site(policy, num_heads, axis=2)

  def __call__(self, x, *, mask: jax.Array | None = None,
               rotary: Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]] | None = None):
    """``x: [B, N, D]`` (or its QTensor); ``mask``: bool, broadcastable to
    ``[B, H, N, N]`` (True = attend); ``rotary(q, k) -> (q, k)`` applies position
    embeddings (RoPE) to the projections."""
    if self.input_code is not None:
      x = self.input_code(x)
    q = checkpoint_name(self.query(x), "qkv_proj")
    k = checkpoint_name(self.key(x), "qkv_proj")
    v = checkpoint_name(self.value(x), "qkv_proj")
    if rotary is not None:
      q, k = rotary(q, k)
    if self.q_code is None:
      o = self.policy.attention_fn()(q, k, v, causal=self.causal, mask=mask, name="attn_out")
    else:
      fn = functools.partial(_attend, self.causal, self.policy.attention)
      o = quant.int8_vjp(fn, [self.q_code(q), self.k_code(k), self.v_code(v)], (), (mask,))
      o = self.o_code(checkpoint_name(o, "attn_out"))
    return checkpoint_name(self.out(o), "attn_proj")
