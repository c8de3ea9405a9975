"""Normalisation layers: the standard ones (baseline) and MS-BP's memory-sharing ones.

MS-LayerNorm / MS-RMSNorm (LowMemoryBP, ICML 2024) have no affine parameters and write
their backward in terms of their *output* ``y``, which the next linear layer saves
anyway: the norm's only residuals are that same array ``y`` and an fp32 ``rstd`` per
row. The affine is folded into the following linear once, by :func:`merge_norm_affine`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from lowmem_jax import dispatch


def tag(y, name):
  """Tags ``y`` for ``jax.checkpoint`` policies (``remat:save=...``); no-op for None."""
  return y if name is None else checkpoint_name(y, name)



def _check_input(x, name):
  if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
    raise TypeError(f"{name} expects a floating-point array, got {jnp.result_type(x)}")
  if jnp.ndim(x) < 1:
    raise ValueError(f"{name} expects at least one axis (the normalised one), got a scalar")


def _layer_norm_stats(x, eps):
  xf = x.astype(jnp.float32)
  mean = jnp.mean(xf, axis=-1, keepdims=True)
  xc = xf - mean
  rstd = jax.lax.rsqrt(jnp.mean(xc * xc, axis=-1, keepdims=True) + eps)
  return xc, rstd


def _rms_norm_stats(x, eps):
  xf = x.astype(jnp.float32)
  rstd = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  return xf, rstd


# ----------------------------------------------------------------------------- standard
def _affine(y, scale, bias, dtype, name):
  """``y * scale + bias`` in fp32 (either optional), cast to ``dtype``, tagged ``name``."""
  if scale is not None:
    y = y * scale.astype(jnp.float32)
  if bias is not None:
    y = y + bias.astype(jnp.float32)
  return tag(y.astype(dtype), name)


def layer_norm(x, scale=None, bias=None, eps: float = 1e-6, *, name: str | None = None):
  """Standard LayerNorm over the last axis, fp32 statistics, plain autodiff (the
  reference; the baseline runs it keeping only its input, :mod:`lowmem_jax.baseline`).

  ``name`` tags the output with ``checkpoint_name`` (for ``remat:save=...``).
  """
  _check_input(x, "layer_norm")
  xc, rstd = _layer_norm_stats(x, eps)
  return _affine(xc * rstd, scale, bias, x.dtype, name)


def rms_norm(x, scale=None, eps: float = 1e-6, *, name: str | None = None):
  """Standard RMSNorm over the last axis, fp32 statistics, plain autodiff (the
  reference; the baseline runs it keeping only its input, :mod:`lowmem_jax.baseline`).

  ``name`` tags the output with ``checkpoint_name`` (for ``remat:save=...``).
  """
  _check_input(x, "rms_norm")
  xf, rstd = _rms_norm_stats(x, eps)
  return _affine(xf * rstd, scale, None, x.dtype, name)


# ----------------------------------------------------------------------------- MS-BP
_STATS = {"layer": _layer_norm_stats, "rms": _rms_norm_stats}


def check_kind(kind: str) -> None:
  if kind not in _STATS:
    raise ValueError(f"unknown norm kind {kind!r}; valid: {', '.join(_STATS)}")


def _mean(a):
  return jnp.mean(a, axis=-1, keepdims=True)


def ms_norm_forward(kind: str, x, eps: float):
  """MS norm forward in jnp: ``(y in x's dtype, fp32 rstd per row)``; the reference of the
  fused forward kernel."""
  centred, rstd = _STATS[kind](x, eps)
  return (centred * rstd).astype(x.dtype), rstd[..., 0]


def ms_norm_input_grad(kind: str, g, y, rstd):
  """MS norm backward in jnp from the output ``y`` and ``rstd`` (exact, eps included); the
  reference of the fused backward kernel."""
  gf, yf = g.astype(jnp.float32), y.astype(jnp.float32)
  bracket = gf - yf * _mean(gf * yf)
  if kind == "layer":
    bracket = bracket - _mean(gf)
  return (rstd[..., None] * bracket).astype(g.dtype)


@functools.cache
def ms_norm_fn(kind: str, implementation: str = "xla"):
  """The MS norm for ``kind`` in {"layer", "rms"}: ``fn(x, eps=1e-6, *, name=None)``.

  No affine. Saves for backward ``y`` (compute dtype: the very array the next linear
  saves) and fp32 ``rstd`` per row, never x or the mean. Backward, exact with eps:
  LayerNorm ``dx = rstd * (g - mean(g) - y * mean(g * y))``, RMSNorm
  ``dx = rstd * (g - y * mean(g * y))``. ``name`` tags ``y`` inside the rule, so tagging
  makes no second array. ``implementation``: "xla" (jnp), "pallas" (fused GPU kernels,
  one row per program) or "pallas_interpret" (those kernels in interpret mode).
  """
  check_kind(kind)
  forward = dispatch.implementation_of(ms_norm_forward, implementation, "norm")
  input_grad = dispatch.implementation_of(ms_norm_input_grad, implementation, "norm")

  @functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
  def norm(x, eps, name):
    return norm_fwd(x, eps, name)[0]

  def norm_fwd(x, eps, name):
    y, rstd = forward(kind, x, eps)
    y = tag(y, name)
    return y, (y, rstd)

  def norm_bwd(eps, name, res, g):
    del eps, name
    y, rstd = res
    return (input_grad(kind, g, y, rstd),)

  norm.defvjp(norm_fwd, norm_bwd)

  def ms_norm(x, eps: float = 1e-6, *, name: str | None = None):
    _check_input(x, f"ms_{kind}_norm")
    if jnp.ndim(eps):  # ms_layer_norm(x, scale): the affine goes into the next linear
      raise TypeError(f"ms_{kind}_norm(x, eps) takes no scale or bias (got an array of shape "
                      f"{list(jnp.shape(eps))} for eps): fold the affine into the next linear "
                      "with merge_norm_affine (policy.merges_norm_affine says when)")
    return norm(x, float(eps), name)

  ms_norm.__name__ = ms_norm.__qualname__ = f"ms_{kind}_norm"
  ms_norm.__doc__ = (
      f"MS-{'LayerNorm' if kind == 'layer' else 'RMSNorm'} of x over the last axis, no "
      "affine (fold it into the next linear: merge_norm_affine). Saves for backward y, the "
      "very array the next linear saves, and fp32 rstd per row; never x or the mean. Exact "
      f"backward. name tags y (checkpoint_name). Implementation {implementation!r}.")
  return ms_norm


ms_layer_norm = ms_norm_fn("layer", "xla")
ms_rms_norm = ms_norm_fn("rms", "xla")


# ----------------------------------------------------------------------------- affine merge
def merge_norm_affine(scale, bias, kernel, kernel_bias):
  """Folds a norm's affine into the linear that follows it, in float64.

  For ``linear(gamma * y + beta)`` with ``kernel`` in Flax layout ``[in, ...out]``:
  ``kernel' = gamma[:, None] * kernel`` and ``bias' = kernel_bias + beta @ kernel``,
  so ``linear'(y)`` computes the same function. ``scale``/``bias``/``kernel_bias`` may
  be None (no scale, an RMSNorm, a bias-free linear). Returns ``(kernel', bias')`` cast
  to the kernel's dtype (``bias'`` is None only if both biases are None). Done once, at
  model build or checkpoint import, not inside a jitted step.
  """
  w = np.array(kernel, dtype=np.float64)  # our own copy: scaled in place (host memory)
  if w.ndim < 1:
    raise ValueError("merge_norm_affine: kernel must have an input axis")
  d_in, out_shape = w.shape[0], w.shape[1:]
  dtype = jnp.result_type(kernel)

  def vector(name, v, n):
    v = np.asarray(v, dtype=np.float64)
    if v.shape != (n,):
      raise ValueError(
          f"merge_norm_affine: {name} has shape {v.shape}, expected ({n},) for kernel {w.shape}")
    return v

  new_b = None
  if kernel_bias is not None:
    new_b = np.asarray(kernel_bias, dtype=np.float64)
    if new_b.shape != out_shape:
      raise ValueError(
          f"merge_norm_affine: kernel_bias has shape {new_b.shape}, expected {out_shape}")
  if bias is not None:  # beta @ kernel, the kernel as given (before the scale)
    beta = vector("bias", bias, d_in)
    shift = np.tensordot(beta, w, axes=1)
    new_b = shift if new_b is None else new_b + shift
  if scale is not None:
    w *= vector("scale", scale, d_in).reshape((d_in,) + (1,) * len(out_shape))
  w = w.astype(dtype)  # the float64 copy freed before the device copy
  out_w = jnp.asarray(w)
  out_b = None if new_b is None else jnp.asarray(new_b.astype(dtype))
  return out_w, out_b
