"""Rotary position embeddings (RoPE) in Hugging Face's layout: the frequencies (with the
scalings LLaMA checkpoints use), their tables, and their application to ``[B, T, H, D]``
projections."""

from __future__ import annotations

import math

import jax.numpy as jnp

# rope_type -> the scaling fields it reads (besides rope_theta), as LlamaConfig names them
ROPE_TYPES = {
    "default": (),
    "linear": ("rope_factor",),  # positions divided by factor (HF "linear")
    # Llama 3.1/3.2: low frequencies divided by factor, high ones kept, smoothed between
    "llama3": ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
               "rope_original_max_seq_len"),
}


def check_scaling(owner: str, rope_type: str, factor: float, low_freq_factor: float,
                  high_freq_factor: float, original_max_seq_len: int):
  """A ValueError naming the field when a RoPE scaling is unknown or cannot be computed
  (a factor that is not positive, llama3's high factor not above its low one)."""
  if rope_type not in ROPE_TYPES:
    raise ValueError(f"{owner}: rope_type {rope_type!r} is not supported; one of "
                     f"{', '.join(ROPE_TYPES)}")
  if rope_type == "default" and factor != 1.0:
    raise ValueError(f"{owner}: rope_factor {factor!r} needs rope_type 'linear' or 'llama3' "
                     "(rope_type is 'default')")
  if not factor > 0:
    raise ValueError(f"{owner}: rope_factor must be positive, got {factor!r}")
  if rope_type == "llama3":
    if not 0 < low_freq_factor < high_freq_factor:
      raise ValueError(f"{owner}: llama3 RoPE needs 0 < rope_low_freq_factor < "
                       f"rope_high_freq_factor, got {low_freq_factor!r} and {high_freq_factor!r}")
    if not original_max_seq_len > 0:
      raise ValueError(f"{owner}: rope_original_max_seq_len must be positive, got "
                       f"{original_max_seq_len!r}")


def inv_frequencies(head_dim: int, theta: float, rope_type: str = "default",
                    factor: float = 1.0, low_freq_factor: float = 1.0,
                    high_freq_factor: float = 4.0, original_max_seq_len: int = 8192):
  """The ``head_dim // 2`` rotation frequencies (fp32), computed as transformers does for
  ``rope_type`` (``default``, ``linear``, ``llama3``; none changes the attention scale).

  llama3: a frequency whose wavelength ``2 pi / f`` exceeds ``original_max_seq_len /
  low_freq_factor`` is divided by ``factor``; one below ``original_max_seq_len /
  high_freq_factor`` is kept; between them it is interpolated with weight
  ``(original_max_seq_len / wavelength - low) / (high - low)`` on the kept one."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  if rope_type == "linear":
    return inv_freq / factor
  if rope_type == "llama3":
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > original_max_seq_len / low_freq_factor, inv_freq / factor,
                       inv_freq)
    smooth = (original_max_seq_len / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ((wavelen >= original_max_seq_len / high_freq_factor)
              & (wavelen <= original_max_seq_len / low_freq_factor))
    return jnp.where(medium, smoothed, scaled)
  return inv_freq


def rope_tables(seq_len: int, inv_freq, dtype=jnp.float32):
  """``cos, sin`` of shape ``[1, seq_len, 1, head_dim]`` (broadcast over ``[B, T, H, D]``)
  for positions ``0..seq_len-1`` and frequencies ``inv_freq`` (:func:`inv_frequencies`),
  computed in fp32 and cast to ``dtype`` (as HF does). HF layout: the ``head_dim // 2``
  frequencies repeated twice."""
  freqs = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]
  emb = jnp.concatenate([freqs, freqs], axis=-1)[None, :, None, :]
  return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def _rotate_half(x):
  half = x.shape[-1] // 2
  return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x, cos, sin):
  """HF's ``x * cos + rotate_half(x) * sin`` on ``x: [B, T, H, D]`` (tables from
  :func:`rope_tables`, in x's dtype).

  16-bit ``x``: computed in fp32 and rounded once. A product of two 16-bit numbers is
  exact in fp32, so the sum is the same whether or not the compiler fuses a multiply and
  the add into an FMA; in 16 bits it is not: XLA:CPU on an AVX512-FP16 CPU fused one
  product (unrounded) in some programs and the other in others, and the reversible
  stack's rebuild (``x = y - F(...)``, exact only if F recomputes bit for bit) lost 5%
  of the attention's gradient (:mod:`lowmem_jax.reversible`). Linear in ``x`` with
  constant tables: backward keeps only the tables (built once per forward and shared by
  all layers; fp32 copies for 16-bit ``x``), nothing of x's size."""
  wide = jnp.promote_types(x.dtype, jnp.float32)
  w = lambda a: a.astype(wide)
  return (w(x) * w(cos) + w(_rotate_half(x)) * w(sin)).astype(x.dtype)
