"""Ctrl-C (SIGINT) or SIGTERM during a run: in the steps, the first saves after the step in
flight and stops; before them (loading, compiling) it stops at once, and at the next safe
point if Python swallowed it. SIGTERM is what ``kill``, docker, Kubernetes and SLURM send
before they kill a job: it was the default, death at once, with everything since the last
periodic checkpoint lost.

Without this, a Ctrl-C raised ``KeyboardInterrupt`` wherever Python happened to be: in
the steps everything since the last periodic checkpoint (``save_every`` steps back, or
none) was lost; and where it landed in a finalizer or a gc callback (jax's, orbax's event
loops), Python printed "Exception ignored" and the run went on.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading


_writing = 0        # blocks in :func:`uninterrupted` (checkpoints being written)
_deferred = False   # a stop that came meanwhile


@contextlib.contextmanager
def uninterrupted():
  """Within, an installed :class:`InterruptHandler`'s stop-at-once waits for the block's
  end, then raises ``KeyboardInterrupt``: a checkpoint being written is completed. A
  second Ctrl-C during orbax's save raised inside it, and orbax's commit thread then
  failed at the interpreter's exit (a traceback, a ``*.orbax-checkpoint-tmp`` folder)."""
  global _writing, _deferred
  _writing += 1
  try:
    yield
  finally:
    _writing -= 1
    stop = _deferred and not _writing
    if not _writing:
      _deferred = False
  if stop:
    raise KeyboardInterrupt


# each signal handled, and the handler it takes over from (Python's defaults only)
SIGNALS = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}


class InterruptHandler:
  """Within ``with``, SIGINT or SIGTERM sets :attr:`requested` and, outside the steps or
  when it comes twice, raises ``KeyboardInterrupt`` as Ctrl-C does; :meth:`check` raises
  it again at a safe point if it was swallowed. In the steps (:attr:`in_steps`) the first
  only sets :attr:`requested`: the loop saves at its next step's end, then stops.
  Installed only in the main thread over Python's default handlers (never over a
  caller's own), where ``enabled`` (a multi-host run's hosts would not stop at the same
  step: not there)."""

  def __init__(self, enabled: bool = True):
    self.requested = False
    self.in_steps = False
    self._enabled = enabled
    self._installed: list[signal.Signals] = []

  def __enter__(self) -> InterruptHandler:
    if self._enabled and threading.current_thread() is threading.main_thread():
      self._installed = [s for s, default in SIGNALS.items() if signal.getsignal(s) is default]
    for signum in self._installed:
      signal.signal(signum, self._handler)
    return self

  def __exit__(self, *exc) -> None:
    for signum in self._installed:
      signal.signal(signum, SIGNALS[signum])
    self._installed = []

  def check(self) -> None:
    """Raises ``KeyboardInterrupt`` if a Ctrl-C came (one a finalizer swallowed)."""
    if self.requested:
      raise KeyboardInterrupt

  def _handler(self, signum, frame) -> None:
    global _deferred
    if self.requested or not self.in_steps:
      self.requested = True
      if _writing:
        _deferred = True
        sys.stderr.write("\ninterrupt: stopping once the checkpoint being written is "
                         "complete\n")
        sys.stderr.flush()
        return
      raise KeyboardInterrupt
    self.requested = True
    name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
    sys.stderr.write(f"\ninterrupt ({name}): saving after this step, then stopping ({name} "
                     "again stops at once, unsaved)\n")
    sys.stderr.flush()
