"""Deterministic, resumable batches over an ``ArrayDataset`` (numpy; the loop moves them to
the device): the order depends only on ``(seed, epoch)``, so a run resumes exactly."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from train.dataset import ArrayDataset


class Batches:
  """Deterministic, resumable, infinite batches over epochs.

  Epoch ``e`` visits the rows in ``np.random.default_rng([seed, e]).permutation(n)`` order
  (``arange(n)`` without shuffle). With ``drop_last`` the ``n % batch_size`` rows left at the
  end of an epoch are skipped; without it the last batch of each epoch is smaller.
  ``state()`` is ``{"epoch", "position"}`` (position: rows of the epoch's order already
  yielded); ``restore(state)`` continues exactly there, also with another batch size.
  ``example_ids``: each batch also carries ``"example_id"`` (int32 row numbers).
  """

  def __init__(self, dataset: ArrayDataset, batch_size: int, *, seed: int = 0,
               shuffle: bool = True, drop_last: bool = True, example_ids: bool = False):
    if not isinstance(batch_size, (int, np.integer)) or isinstance(batch_size, bool) \
        or batch_size < 1:
      raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    n = len(dataset)
    if n < 1:
      raise ValueError("empty dataset: nothing to batch")
    if drop_last and n < batch_size:
      raise ValueError(f"dataset of {n} examples is smaller than one batch of {batch_size}; "
                       f"set batch_size <= {n}, or give more data")
    self.dataset = dataset
    self.batch_size = int(batch_size)
    self.seed = int(seed)
    self.shuffle = bool(shuffle)
    self.drop_last = bool(drop_last)
    self.example_ids = bool(example_ids)
    self._n = n
    self._epoch_end = n - n % self.batch_size if self.drop_last else n
    self.steps_per_epoch = n // self.batch_size if self.drop_last else -(-n // self.batch_size)
    self._epoch = 0
    self._position = 0
    self._order_epoch = -1
    self._order = None

  @property
  def epoch(self) -> int:
    """The epoch the next batch comes from."""
    return self._epoch

  def order(self, epoch: int) -> np.ndarray:
    """The row order of ``epoch``."""
    if not self.shuffle:
      return np.arange(self._n)
    if epoch != self._order_epoch:
      self._order = np.random.default_rng([self.seed, epoch]).permutation(self._n)
      self._order_epoch = epoch
    return self._order

  def __iter__(self) -> Batches:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    rows = self.order(self._epoch)[self._position:self._position + self.batch_size]
    self._position += len(rows)
    self._roll()
    batch = self.dataset.take(rows)
    if self.example_ids:
      batch["example_id"] = rows.astype(np.int32)
    return batch

  def _roll(self) -> None:
    """Move to the next epoch once the current one has no full (or, without drop_last, any)
    batch left, so that state() is always where the next batch starts."""
    remaining = self._epoch_end - self._position
    if remaining <= 0 or (self.drop_last and remaining < self.batch_size):
      self._epoch += 1
      self._position = 0

  def peek(self) -> dict[str, np.ndarray]:
    """The next batch without advancing (for compiling the step before step 1)."""
    state = self.state()
    batch = next(self)
    self.restore(state)
    return batch

  def state(self) -> dict:
    """``{"epoch": int, "position": int}``: JSON-serialisable, for ``restore``."""
    return {"epoch": int(self._epoch), "position": int(self._position)}

  def restore(self, state: dict) -> None:
    """Continue exactly where ``state()`` was taken."""
    try:
      epoch, position = state["epoch"], state["position"]
    except (KeyError, TypeError) as e:
      raise ValueError(f"batch state must be {{'epoch': int, 'position': int}}, got {state!r}") \
          from e
    for name, v in (("epoch", epoch), ("position", position)):
      if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
        raise ValueError(f"batch state {name} must be a non-negative int, got {v!r}")
    if position > self._n:
      raise ValueError(f"batch state position {position} is past the dataset size {self._n}")
    self._epoch, self._position = int(epoch), int(position)
    self._roll()

  def epoch_batches(self) -> Iterator[dict[str, np.ndarray]]:
    """One pass over the rows in order, no shuffle, last partial batch kept (for eval).
    Leaves the training position untouched."""
    for start in range(0, self._n, self.batch_size):
      yield self.dataset.take(np.arange(start, min(start + self.batch_size, self._n)))


def batch_items(batch: dict, task: str) -> int:
  """Examples in a batch, or tokens (padding included) for a causal LM: what throughput counts."""
  first = batch[next(iter(batch))]
  return int(np.prod(first.shape[:2 if task == "lm" else 1]))
