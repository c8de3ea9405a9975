"""Multi-head attention for ``[B, N, H, D]`` inputs, with a memory-efficient path.

``implementation``:
  * ``"flash"``: ours, pure JAX. Blockwise forward over key/value blocks with an online
    softmax; a custom_vjp that saves only q, k, v, o and the fp32 row log-sum-exp and
    recomputes the scores block by block in backward. No ``N x M`` array is saved, and
    the largest temporary is ``N x block_k`` per head. Runs on every backend.
  * ``"cudnn"``: ``jax.nn.dot_product_attention(implementation="cudnn")`` (GPU, 16-bit).
  * ``"xla"``: ``jax.nn.dot_product_attention(implementation="xla")``, plain autodiff;
    it saves the ``N x M`` probabilities. The reference.
  * ``"auto"``: cuDNN on GPU for bf16/fp16 inputs, otherwise ``"flash"``.

Grouped-query attention: k and v may have fewer heads ``K`` than q (``H % K == 0``);
query head ``h`` reads kv head ``h // (H // K)``, as in ``jax.nn.dot_product_attention``.
``mask`` is boolean (True = attend), broadcastable to ``[B, H, N, M]``; a padding mask
``[B, 1, 1, M]`` costs ``B * M``. ``causal`` is top-left aligned (query i sees keys
j <= i). A query row with no visible key returns zeros in ``"flash"`` (the XLA path
returns the mean of v there); mask such rows out of the loss.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

IMPLEMENTATIONS = ("auto", "flash", "cudnn", "xla")
DEFAULT_BLOCK_K = 512


def _validate(q, k, v, mask):
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(
        "attention expects q, k, v of rank 4 [batch, seq, heads, head_dim]; got "
        f"q{list(q.shape)}, k{list(k.shape)}, v{list(v.shape)}")
  if k.shape != v.shape:
    raise ValueError(f"attention: k{list(k.shape)} and v{list(v.shape)} differ in shape")
  b, _, h, d = q.shape
  if k.shape[0] != b or k.shape[3] != d:
    raise ValueError(
        f"attention: batch/head_dim of q{list(q.shape)} and k{list(k.shape)} differ")
  if h % k.shape[2]:
    raise ValueError(
        f"attention: {h} query heads are not a multiple of {k.shape[2]} kv heads")
  if not (q.dtype == k.dtype == v.dtype):
    raise TypeError(f"attention: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
  if mask is not None:
    target = (b, h, q.shape[1], k.shape[1])
    if mask.dtype != jnp.bool_:
      raise TypeError(f"attention: mask must be boolean (True = attend), got {mask.dtype}")
    try:
      jnp.broadcast_shapes(mask.shape, target)
    except ValueError:
      raise ValueError(
          f"attention: mask{list(mask.shape)} does not broadcast to [B, H, N, M] = "
          f"{list(target)}") from None
    if mask.ndim != 4:
      raise ValueError(f"attention: mask must have rank 4 [B, H, N, M], got {mask.ndim}")


def attention(q, k, v, *, causal: bool = False, mask=None, implementation: str = "auto",
              scale: float | None = None, block_k: int = DEFAULT_BLOCK_K,
              name: str | None = None):
  """Scaled dot-product attention; returns ``[B, N, H, D]`` in q's dtype.

  ``name`` tags the output with ``checkpoint_name``; in ``"flash"`` it is tagged inside
  the rule, so the saved ``o`` and the output stay one array.
  """
  _validate(q, k, v, mask)
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
        f"unknown attention implementation {implementation!r}; valid: {', '.join(IMPLEMENTATIONS)}")
  if block_k < 1:
    raise ValueError(f"attention: block_k must be positive, got {block_k}")
  scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
  if implementation == "auto":
    on_gpu = jax.default_backend() == "gpu"
    implementation = "cudnn" if on_gpu and q.dtype in (jnp.bfloat16, jnp.float16) else "flash"
  if implementation in ("xla", "cudnn"):
    out = jax.nn.dot_product_attention(
        q, k, v, mask=mask, scale=scale, is_causal=causal, implementation=implementation)
    return out if name is None else checkpoint_name(out, name)
  return _flash(q, k, v, mask, causal, scale, min(block_k, max(k.shape[1], 1)), name)


# ----------------------------------------------------------------------------- flash
def _grouped(q, num_kv_heads):
  b, n, h, d = q.shape
  return q.reshape(b, n, num_kv_heads, h // num_kv_heads, d)


def _mask_blocks(mask, num_kv_heads, m, num_blocks, block):
  """Boolean mask -> ``[num_blocks, B', K', G', N', block]`` (broadcast dims kept at 1)."""
  if mask is None:
    return None
  bm, hm, nm, mm = mask.shape
  pad = num_blocks * block - mm if mm == m else 0
  if mm == 1:
    mask = jnp.broadcast_to(mask, (bm, hm, nm, m))
    pad = num_blocks * block - m
  if pad:
    mask = jnp.pad(mask, ((0, 0), (0, 0), (0, 0), (0, pad)))
  if hm == 1:
    mask = mask[:, :, None]
  else:
    mask = mask.reshape(bm, num_kv_heads, hm // num_kv_heads, nm, -1)
  mask = mask.reshape(mask.shape[:4] + (num_blocks, block))
  return jnp.moveaxis(mask, 4, 0)


def _block_valid(j, block, n, m, causal, mask_j):
  """Which (query, key) pairs of kv block ``j`` may attend: ``[.., N, block]`` bool."""
  kpos = j * block + jnp.arange(block)
  valid = (kpos < m)[None, :]
  if causal:
    valid = valid & (kpos[None, :] <= jnp.arange(n)[:, None])
  if mask_j is not None:
    valid = valid & mask_j
  return valid


def _kv_blocks(x, num_blocks, block):
  b, m, kh, d = x.shape
  pad = num_blocks * block - m
  if pad:
    x = jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))
  return jnp.moveaxis(x.reshape(b, num_blocks, block, kh, d), 1, 0)


def _scores(qg, kj, scale):
  return jnp.einsum("bnhgd,bkhd->bhgnk", qg, kj,
                    preferred_element_type=jnp.float32) * scale


def _flash_forward(q, k, v, mask, causal, scale, block):
  b, n, h, d = q.shape
  m, kh = k.shape[1], k.shape[2]
  nb = -(-m // block)
  qg = _grouped(q, kh)
  masks = _mask_blocks(mask, kh, m, nb, block)

  def step(carry, xs):
    row_max, row_sum, acc = carry
    j, kj, vj, mask_j = xs
    s = _scores(qg, kj, scale)
    valid = _block_valid(j, block, n, m, causal, mask_j)
    s = jnp.where(valid, s, -jnp.inf)
    new_max = jnp.maximum(row_max, s.max(-1))
    safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
    p = jnp.exp(s - safe_max[..., None])
    alpha = jnp.exp(row_max - safe_max)
    row_sum = row_sum * alpha + p.sum(-1)
    acc = acc * alpha[..., None] + jnp.einsum(
        "bhgnk,bkhd->bhgnd", p.astype(v.dtype), vj, preferred_element_type=jnp.float32)
    return (new_max, row_sum, acc), None

  g = h // kh
  init = (jnp.full((b, kh, g, n), -jnp.inf, jnp.float32),
          jnp.zeros((b, kh, g, n), jnp.float32),
          jnp.zeros((b, kh, g, n, d), jnp.float32))
  xs = (jnp.arange(nb), _kv_blocks(k, nb, block), _kv_blocks(v, nb, block), masks)
  (row_max, row_sum, acc), _ = jax.lax.scan(step, init, xs)
  seen = row_sum > 0
  out = jnp.where(seen[..., None], acc / jnp.where(seen, row_sum, 1.0)[..., None], 0.0)
  # +inf for rows that see no key: exp(s - lse) is then 0 in backward.
  lse = jnp.where(seen, row_max + jnp.log(jnp.where(seen, row_sum, 1.0)), jnp.inf)
  out = jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, n, h, d).astype(q.dtype)
  return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _flash(q, k, v, mask, causal, scale, block, name):
  return _flash_fwd(q, k, v, mask, causal, scale, block, name)[0]


def _flash_fwd(q, k, v, mask, causal, scale, block, name):
  out, lse = _flash_forward(q, k, v, mask, causal, scale, block)
  out = out if name is None else checkpoint_name(out, name)
  # Residuals: q, k, v, o and the fp32 row log-sum-exp; never an N x M array.
  return out, (q, k, v, mask, out, lse)


def _flash_bwd(causal, scale, block, name, res, do):
  del name
  q, k, v, mask, out, lse = res
  b, n, h, d = q.shape
  m, kh = k.shape[1], k.shape[2]
  nb = -(-m // block)
  qg, dog = _grouped(q, kh), _grouped(do, kh)
  delta = jnp.einsum("bnhgd,bnhgd->bhgn", dog.astype(jnp.float32),
                     _grouped(out, kh).astype(jnp.float32))
  masks = _mask_blocks(mask, kh, m, nb, block)

  def step(dq, xs):
    j, kj, vj, mask_j = xs
    s = _scores(qg, kj, scale)
    valid = _block_valid(j, block, n, m, causal, mask_j)
    p = jnp.where(valid, jnp.exp(s - lse[..., None]), 0.0)
    dv = jnp.einsum("bhgnk,bnhgd->bkhd", p.astype(do.dtype), dog,
                    preferred_element_type=jnp.float32)
    dp = jnp.einsum("bnhgd,bkhd->bhgnk", dog, vj, preferred_element_type=jnp.float32)
    ds = (p * (dp - delta[..., None]) * scale).astype(q.dtype)
    dq = dq + jnp.einsum("bhgnk,bkhd->bnhgd", ds, kj, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bhgnk,bnhgd->bkhd", ds, qg, preferred_element_type=jnp.float32)
    return dq, (dk.astype(k.dtype), dv.astype(v.dtype))

  xs = (jnp.arange(nb), _kv_blocks(k, nb, block), _kv_blocks(v, nb, block), masks)
  dq, (dk, dv) = jax.lax.scan(step, jnp.zeros(qg.shape, jnp.float32), xs)

  def unblock(x):
    return jnp.moveaxis(x, 0, 1).reshape(b, nb * block, kh, d)[:, :m]

  return (dq.reshape(b, n, h, d).astype(q.dtype), unblock(dk), unblock(dv), None)


_flash.defvjp(_flash_fwd, _flash_bwd)
