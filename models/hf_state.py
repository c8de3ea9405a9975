"""Reading and writing Hugging Face state dicts (name -> numpy array) with clear errors.

A model module's ``from_hf_state(reader, cfg, policy, dtype, rngs)`` takes tensors by HF
name through :class:`StateReader`, which checks shapes and remembers what was used;
``reader.finish()`` then names every missing, unexpected or mis-shaped key at once.
Tensors stay in float64/float32 numpy until the model holds them, so the norm-affine
merge (``lowmem_jax.norms.merge_norm_affine``) runs in float64.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax.numpy as jnp
import numpy as np


class CheckpointError(ValueError):
  """A checkpoint does not match the model: names the missing/unexpected/mis-shaped keys."""


class StateReader:

  def __init__(self, state: Mapping[str, np.ndarray], *, ignore: Sequence[str] = ()):
    self.state = state
    self.ignore = tuple(ignore)  # key substrings that may be present and unused
    self.used: set[str] = set()
    self.missing: list[str] = []
    self.misshaped: list[str] = []

  def has(self, key: str) -> bool:
    return key in self.state

  def take(self, key: str, shape: Sequence[int] | None = None) -> np.ndarray:
    """The tensor ``key`` as float64 numpy; zeros of ``shape`` if it is missing or
    mis-shaped (recorded for :meth:`finish`)."""
    if key not in self.state:
      self.missing.append(key)
      return np.zeros(() if shape is None else tuple(shape))
    value = np.asarray(self.state[key])
    self.used.add(key)
    if shape is not None and tuple(value.shape) != tuple(shape):
      self.misshaped.append(f"{key}: checkpoint {list(value.shape)}, model {list(shape)}")
      return np.zeros(tuple(shape))  # keep going: finish() reports every problem
    return value.astype(np.float64) if np.issubdtype(value.dtype, np.floating) else value

  def take_optional(self, key: str, shape: Sequence[int] | None = None):
    return self.take(key, shape) if key in self.state else None

  def finish(self) -> None:
    """Raises :class:`CheckpointError` naming every problem found while reading."""
    unexpected = sorted(k for k in self.state if k not in self.used
                        and not any(s in k for s in self.ignore))
    problems = []
    if self.missing:
      problems.append(f"missing keys ({len(self.missing)}): {', '.join(self.missing[:20])}")
    if unexpected:
      problems.append(f"unexpected keys ({len(unexpected)}): {', '.join(unexpected[:20])}")
    if self.misshaped:
      problems.append(f"mis-shaped keys ({len(self.misshaped)}): "
                      + "; ".join(self.misshaped[:20]))
    if problems:
      raise CheckpointError("checkpoint does not match the model: " + " | ".join(problems))


# ----------------------------------------------------------------------------- linears
def read_linear(reader: StateReader, prefix: str, module, *, norm=None) -> None:
  """Loads HF ``{prefix}.weight`` (torch ``[out, in]``) and ``.bias`` into an
  ``nnx.Linear``/``nnx.LinearGeneral`` (kernel ``[in..., out...]``).

  ``norm=(scale, bias)`` (either may be None) folds the affine of the norm that feeds
  this linear into it (``merge_norm_affine``, float64), for MS-norm policies.
  """
  from lowmem_jax.norms import merge_norm_affine

  shape = tuple(module.kernel[...].shape)
  n_in = _num_in_axes(module)
  d_in, d_out = int(np.prod(shape[:n_in])), int(np.prod(shape[n_in:]))
  kernel = reader.take(f"{prefix}.weight", (d_out, d_in)).T
  has_bias = getattr(module, "bias", None) is not None
  bias = reader.take(f"{prefix}.bias", (d_out,)) if has_bias else None
  if norm is not None:
    kernel, bias = merge_norm_affine(norm[0], norm[1], kernel.astype(np.float32), bias)
    if bias is not None and not has_bias:
      raise CheckpointError(f"{prefix}: merging the norm bias needs a bias on this linear")
  module.kernel[...] = jnp.asarray(np.asarray(kernel, np.float32).reshape(shape))
  if has_bias:
    module.bias[...] = jnp.asarray(np.asarray(bias, np.float32).reshape(
        tuple(module.bias[...].shape)))


def write_linear(state: dict, prefix: str, module) -> None:
  """The inverse of :func:`read_linear` (without a merge): torch layout into ``state``."""
  kernel = np.asarray(module.kernel[...], np.float32)
  n_in = _num_in_axes(module)
  d_in = int(np.prod(kernel.shape[:n_in]))
  state[f"{prefix}.weight"] = kernel.reshape(d_in, -1).T
  if getattr(module, "bias", None) is not None:
    state[f"{prefix}.bias"] = np.asarray(module.bias[...], np.float32).reshape(-1)


def _num_in_axes(module) -> int:
  axis = getattr(module, "axis", (-1,))
  return len(axis) if isinstance(axis, tuple) else 1
