"""The in-memory dataset every loader returns: equal-length numpy arrays, one row per example."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


class MissingFileError(FileNotFoundError, ValueError):
  """A dataset or tokenizer path that does not exist (both a FileNotFoundError and a ValueError)."""


class ArrayDataset:
  """In-memory examples: a dict of equal-length numpy arrays, row ``i`` of each is example ``i``.

  ``class_names`` (when the loader knows them) lists the label names by label id.
  ``transform`` (when given) makes each batch :meth:`take` returns from the stored rows
  (a loader's per-example work: resizing, normalizing), so only a batch of its output is
  ever held; ``arrays`` stay in their stored form.
  """

  class_names: list[str] | None = None

  def __init__(self, arrays: dict[str, np.ndarray],
               transform: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None):
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
    self.transform = transform

  def __len__(self) -> int:
    return next(iter(self.arrays.values())).shape[0]

  def take(self, indices: np.ndarray) -> dict[str, np.ndarray]:
    """The rows ``indices`` of every array, as a batch (through ``transform``)."""
    indices = np.asarray(indices)
    batch = {name: a[indices] for name, a in self.arrays.items()}
    return batch if self.transform is None else self.transform(batch)

  def with_transform(self, f: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]
                     ) -> ArrayDataset:
    """The same rows with ``f`` applied to each batch after this dataset's own transform
    (class names kept; nothing is computed now)."""
    first = self.transform
    out = ArrayDataset(self.arrays, f if first is None else lambda batch: f(first(batch)))
    out.class_names = self.class_names
    return out

  def __repr__(self) -> str:
    fields = ", ".join(f"{k}: {a.dtype}{list(a.shape)}" for k, a in self.arrays.items())
    return f"ArrayDataset(n={len(self)}, {fields})"
