"""Reading and writing Hugging Face state dicts (name -> numpy array) with clear errors.

A model module's ``from_hf_state(reader, cfg, policy, dtype, rngs)`` takes tensors by HF
name through :class:`StateReader`, which checks shapes and remembers what was used;
``reader.finish()`` then names every missing, unexpected or mis-shaped key at once.
Tensors stay in float64/float32 numpy until the model holds them, so the norm-affine
merge (``lowmem_jax.norms.merge_norm_affine``) runs in float64.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

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
    """The tensor ``key`` as float64 numpy (zeros of ``shape`` if it is missing, recorded)."""
    if key not in self.state:
      self.missing.append(key)
      return np.zeros(() if shape is None else tuple(shape))
    value = np.asarray(self.state[key])
    if shape is not None and tuple(value.shape) != tuple(shape):
      self.misshaped.append(f"{key}: checkpoint {list(value.shape)}, model {list(shape)}")
    self.used.add(key)
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
