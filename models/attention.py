"""Multi-head self-attention on the memory policy's attention strategy.

q, k and v are projected straight to ``[B, N, heads, head_dim]`` and the out-projection
contracts ``(heads, head_dim)`` directly (``LinearGeneral``), so no reshape makes a
second copy of what the attention saves: the out-projection saves the very ``o`` that
the attention saved. Grouped-query attention via ``num_kv_heads``. The block input that
q, k and v read is one shared site (``shared_input``): what they keep of it is made once.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from lowmem_jax.policy import MemoryPolicy
from models.linear import LinearGeneral
from models.sites import Site


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
    self.shared_input = Site(policy.shared_strategy())
    self.attend = Site(policy.attention_strategy(num_heads, num_kv_heads, causal=causal))

  def __call__(self, x, *, mask: jax.Array | None = None,
               rotary: Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]] | None = None):
    """``x: [B, N, D]`` (plain or carried); ``mask``: bool, broadcastable to
    ``[B, H, N, N]`` (True = attend); ``rotary(q, k) -> (q, k)`` applies position
    embeddings (RoPE) to the projections."""
    x = self.shared_input(x)
    q = checkpoint_name(self.query(x), "qkv_proj")
    k = checkpoint_name(self.key(x), "qkv_proj")
    v = checkpoint_name(self.value(x), "qkv_proj")
    if rotary is not None:
      q, k = rotary(q, k)
    o = self.attend(q, k, v, mask)
    return checkpoint_name(self.out(o), "attn_proj")
