"""Multi-head self-attention on the memory policy's attention strategy.

q, k and v are projected straight to ``[B, N, heads, head_dim]`` and the out-projection
contracts ``(heads, head_dim)`` directly (``LinearGeneral``), so no reshape makes a
second copy of what the attention saves: the out-projection saves the very ``o`` that
the attention saved. Grouped-query attention via ``num_kv_heads``. The block input that
q, k and v read is one shared site (``shared_input``): what they keep of it is made once.

A ``qkv`` strategy that recomputes (``qkv=recompute``, :mod:`lowmem_jax.qkv_recompute`)
gets the projections and the attention as one pure function of ``(x, params, consts)``
(the modules split into their parameters and the rest); its output then passes a shared
site of its own (``shared_output``: under Mesa, the out-projection keeps its code).

``dropout`` > 0 drops attention probabilities (HF BERT's ``attention_probs_dropout_prob``):
the attention draws the mask from a key this module counts (:class:`models.dropout.Dropout`)
and, in its ``"flash"`` form, draws it again in backward rather than keeping it.
"""

from __future__ import annotations

import functools

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from lowmem_jax.policy import MemoryPolicy
from models.dropout import Dropout
from models.linear import LinearGeneral
from models.rope import apply_rope
from models.sites import Site


class SelfAttention(nnx.Module):

  def __init__(self, dim: int, num_heads: int, *, num_kv_heads: int | None = None,
               head_dim: int | None = None, qkv_bias: bool = True, out_bias: bool = True,
               causal: bool = False, policy: MemoryPolicy | str = "baseline",
               dtype=None, dropout: float = 0.0, rngs: nnx.Rngs):
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    head_dim = dim // num_heads if head_dim is None else head_dim
    if num_heads % num_kv_heads:
      raise ValueError(f"SelfAttention: {num_heads} heads not a multiple of "
                       f"{num_kv_heads} kv heads")
    self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
    self.causal = causal
    self.policy = policy = MemoryPolicy.parse(policy)
    proj = dict(use_bias=qkv_bias, dtype=dtype, rngs=rngs, policy=policy, reads_norm=True)
    self.query = LinearGeneral(dim, (num_heads, head_dim), name="query", **proj)
    self.key = LinearGeneral(dim, (num_kv_heads, head_dim), name="key", **proj)
    self.value = LinearGeneral(dim, (num_kv_heads, head_dim), name="value", **proj)
    self.out = LinearGeneral((num_heads, head_dim), dim, axis=(-2, -1), use_bias=out_bias,
                             dtype=dtype, rngs=rngs, policy=policy, name="out")
    self.shared_input = Site(policy.shared_strategy())
    self.attend = Site(policy.attention_strategy(num_heads, num_kv_heads, causal=causal))
    self.qkv = Site(policy.qkv_strategy(num_heads, num_kv_heads, causal=causal))
    if self.qkv.strategy.recomputes:
      self.shared_output = Site(policy.shared_strategy(num_heads, axis=2))
    self.probs_dropout = Dropout(dropout, what="attention dropout")

  def __call__(self, x, *, mask: jax.Array | None = None,
               rope: tuple[jax.Array, jax.Array] | None = None):
    """``x: [B, N, D]`` (plain or carried); ``mask``: bool, broadcastable to
    ``[B, H, N, N]`` (True = attend); ``rope``: the ``(cos, sin)`` tables of rotary
    position embeddings (:func:`models.rope.rope_tables`) applied to q and k."""
    x = self.shared_input(x)
    parts = (self.query, self.key, self.value, self.attend)
    key = self.probs_dropout.next_key()  # None: no dropout (rate 0 or eval mode)
    rate = 0.0 if key is None else self.probs_dropout.rate
    if self.qkv.strategy.recomputes:
      graphdef, params, rest = nnx.split(parts, nnx.Param, ...)
      # the rate is static (bound), the key an array (among the constants)
      o = self.qkv(functools.partial(_run, graphdef, rate), x, params, (rest, mask, rope, key))
      o = self.shared_output(o)
    else:
      o = _attend(*parts, x, mask, rope, rate, key)
    return checkpoint_name(self.out(o), "attn_proj")


def _attend(query, key, value, attend, x, mask, rope, rate, dropout_key):
  """``attend(q, k, v, mask)`` on the projections of ``x`` (RoPE applied to q and k), its
  probabilities dropped at ``rate`` with ``dropout_key`` when ``rate`` > 0."""
  q = checkpoint_name(query(x), "qkv_proj")
  k = checkpoint_name(key(x), "qkv_proj")
  v = checkpoint_name(value(x), "qkv_proj")
  if rope is not None:
    q, k = apply_rope(q, *rope), apply_rope(k, *rope)
  if not rate:
    return attend(q, k, v, mask)
  return attend(q, k, v, mask, dropout_rate=rate, dropout_key=dropout_key)


def _run(graphdef, rate, x, params, consts):
  """:func:`_attend` as a pure function of the split modules (for the ``qkv`` site)."""
  rest, mask, rope, key = consts
  return _attend(*nnx.merge(graphdef, params, rest), x, mask, rope, rate, key)
