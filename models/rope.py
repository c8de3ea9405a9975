"""Rotary position embeddings (RoPE) in Hugging Face's layout: the tables and their
application to ``[B, T, H, D]`` projections."""

from __future__ import annotations

import jax.numpy as jnp


def rope_tables(seq_len: int, head_dim: int, theta: float, dtype=jnp.float32):
  """``cos, sin`` of shape ``[1, seq_len, 1, head_dim]`` (broadcast over ``[B, T, H, D]``)
  for positions ``0..seq_len-1``, computed in fp32 and cast to ``dtype`` (as HF does).
  HF layout: the ``head_dim // 2`` frequencies repeated twice."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  freqs = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]
  emb = jnp.concatenate([freqs, freqs], axis=-1)[None, :, None, :]
  return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def _rotate_half(x):
  half = x.shape[-1] // 2
  return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x, cos, sin):
  """HF's ``x * cos + rotate_half(x) * sin`` on ``x: [B, T, H, D]`` (tables from
  :func:`rope_tables`, in x's dtype).

  Linear in ``x`` with constant tables: backward keeps only the tables (built once per
  forward and shared by all layers), nothing of x's size."""
  return x * cos + _rotate_half(x) * sin
