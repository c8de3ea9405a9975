"""The in-memory dataset every loader returns: equal-length numpy arrays, one row per example."""

from __future__ import annotations

import numpy as np


class MissingFileError(FileNotFoundError, ValueError):
  """A dataset or tokenizer path that does not exist (both a FileNotFoundError and a ValueError)."""


class ArrayDataset:
  """In-memory examples: a dict of equal-length numpy arrays, row ``i`` of each is example ``i``.

  ``class_names`` (when the loader knows them) lists the label names by label id.
  """

  class_names: list[str] | None = None

  def __init__(self, arrays: dict[str, np.ndarray]):
    if not arrays:
      raise ValueError("empty dataset: no arrays given")
    arrays = {name: np.asarray(a) for name, a in arrays.items()}
    lengths = {}
    for name, a in arrays.items():
      if a.ndim == 0:
        raise ValueError(f"array {name!r} is a scalar; every array needs a leading example axis")
      lengths[name] = a.shape[0]
    if len(set(lengths.values())) != 1:
      raise ValueError(f"arrays have different lengths: {lengths}")
    if next(iter(lengths.values())) == 0:
      raise ValueError("empty dataset: arrays have no rows")
    self.arrays = arrays

  def __len__(self) -> int:
    return next(iter(self.arrays.values())).shape[0]

  def take(self, indices: np.ndarray) -> dict[str, np.ndarray]:
    """The rows ``indices`` of every array, as a batch."""
    indices = np.asarray(indices)
    return {name: a[indices] for name, a in self.arrays.items()}

  def __repr__(self) -> str:
    fields = ", ".join(f"{k}: {a.dtype}{list(a.shape)}" for k, a in self.arrays.items())
    return f"ArrayDataset(n={len(self)}, {fields})"
