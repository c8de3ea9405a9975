"""The largest batch whose peak fits a memory budget, in few trials (standard library only:
``benchmarks/llama_fit.py`` searches with compiled peaks, ``benchmarks/peers.py`` with
PyTorch runs that may run out of memory).

:func:`largest_fitting` grows the batch from 1, at least doubling it each time, until one
misses the budget (or the cap is reached), then narrows the bracket ``(largest fit,
smallest miss)`` to one. Where two peaks are known the next batch is read off the straight
line through them (a step's peak is close to affine in the batch: the resident state plus
the activations of each example): growing, the batch just past the line's boundary when
that is beyond the doubling; narrowing, the line's boundary inside the bracket, with a
plain bisection step whenever the line's step failed to halve the bracket (so it is never
much slower than bisection, and exact peaks on a line end in 4 trials). A miss with no
peak (out of memory: ``math.inf``) leaves the line out: plain doubling and bisection.

The answer is exact given that the peak does not shrink as the batch grows: every batch
up to the answer fits, and answer + 1 was tried and missed (or the answer is the cap).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class FitSearch:
  """The answer and how it was found."""
  best: int            # the largest batch that fits; 0: not even batch 1
  peak: float | None   # its peak (None when best is 0)
  tried: tuple         # ((batch, peak), ...) in the order tried; a peak inf: no figure
  budget: float
  cap: int

  @property
  def trials(self) -> int:
    return len(self.tried)

  @property
  def capped(self) -> bool:
    """The cap fits: the real boundary may lie beyond it."""
    return self.best == self.cap


def _on_line(b0: int, p0: float, b1: int, p1: float, budget: float) -> int | None:
  """The largest batch whose peak on the line through ``(b0, p0)``, ``(b1, p1)`` is within
  ``budget``; None when the line does not rise or a peak is not finite."""
  if not (math.isfinite(p0) and math.isfinite(p1)) or b1 == b0 or (p1 - p0) / (b1 - b0) <= 0:
    return None
  slope = (p1 - p0) / (b1 - b0)
  return b0 + math.floor((budget - p0) / slope)


def largest_fitting(peak_of: Callable[[int], float], budget: float, cap: int) -> FitSearch:
  """The largest batch in ``1..cap`` whose ``peak_of(batch)`` is <= ``budget`` (module
  docstring); ``peak_of`` is called once per batch tried."""
  if cap < 1:
    raise ValueError(f"largest_fitting: cap must be >= 1, got {cap}")
  peaks: dict[int, float] = {}

  def fits(b: int) -> bool:
    peaks[b] = peak_of(b)
    return peaks[b] <= budget

  def result(best: int) -> FitSearch:
    return FitSearch(best, peaks.get(best), tuple(peaks.items()), budget, cap)

  if not fits(1):
    return result(0)
  lo, hi, prev = 1, None, None  # lo: largest fit; hi: smallest miss; prev: the fit before lo
  while hi is None:
    if lo == cap:
      return result(cap)
    line = None if prev is None else _on_line(prev, peaks[prev], lo, peaks[lo], budget)
    b = min(cap, max(2 * lo, -1 if line is None else line + 1))
    if fits(b):
      prev, lo = lo, b
    else:
      hi = b
  halved = True  # whether the last step halved the bracket (else the next one bisects)
  while hi - lo > 1:
    line = _on_line(lo, peaks[lo], hi, peaks[hi], budget) if halved else None
    b = (lo + hi) // 2 if line is None else min(hi - 1, max(lo + 1, line))
    width = hi - lo
    if fits(b):
      lo = b
    else:
      hi = b
    halved = line is None or 2 * (hi - lo) <= width
  return result(lo)


def largest_at_most(fits: Callable[[int], bool], start: int) -> tuple[int, tuple]:
  """The largest batch in ``1..start`` for which ``fits(batch)`` (a real run), trying
  ``start`` first: where a prediction is close, ``start`` or a batch just below it.
  Steps down by 1, 2, 4... until one fits, then bisects the gap above it. Returns the
  batch (0: not even batch 1) and ``((batch, fitted), ...)`` in the order tried."""
  if start < 1:
    raise ValueError(f"largest_at_most: start must be >= 1, got {start}")
  tried: dict[int, bool] = {}

  def ok(b: int) -> bool:
    tried[b] = bool(fits(b))
    return tried[b]

  if ok(start) or start == 1:
    return (start if tried[start] else 0), tuple(tried.items())
  hi, step = start, 1  # hi: the smallest batch known not to fit
  while True:
    b = max(1, start - step)
    if ok(b):
      lo = b
      break
    hi = b
    if b == 1:
      return 0, tuple(tried.items())
    step *= 2
  while hi - lo > 1:
    b = (lo + hi) // 2
    if ok(b):
      lo = b
    else:
      hi = b
  return lo, tuple(tried.items())
