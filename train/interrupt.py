"""Ctrl-C during a run: in the steps, the first saves after the step in flight and stops;
before them (loading, compiling) it stops at once, and at the next safe point if Python
swallowed it.

Without this, a Ctrl-C raised ``KeyboardInterrupt`` wherever Python happened to be: in
the steps everything since the last periodic checkpoint (``save_every`` steps back, or
none) was lost; and where it landed in a finalizer or a gc callback (jax's, orbax's event
loops), Python printed "Exception ignored" and the run went on.
"""

from __future__ import annotations

import signal
import sys
import threading


class InterruptHandler:
  """Within ``with``, SIGINT sets :attr:`requested` and, outside the steps or when
  pressed twice, raises ``KeyboardInterrupt`` as usual; :meth:`check` raises it again at
  a safe point if it was swallowed. In the steps (:attr:`in_steps`) the first only sets
  :attr:`requested`: the loop saves at its next step's end, then stops. Installed only in
  the main thread over Python's default handler (never over a caller's own), where
  ``enabled`` (a multi-host run's hosts would not stop at the same step: not there)."""

  def __init__(self, enabled: bool = True):
    self.requested = False
    self.in_steps = False
    self._enabled = enabled
    self._installed = False

  def __enter__(self) -> InterruptHandler:
    self._installed = (self._enabled and threading.current_thread() is threading.main_thread()
                       and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    if self._installed:
      signal.signal(signal.SIGINT, self._handler)
    return self

  def __exit__(self, *exc) -> None:
    if self._installed:
      signal.signal(signal.SIGINT, signal.default_int_handler)

  def check(self) -> None:
    """Raises ``KeyboardInterrupt`` if a Ctrl-C came (one a finalizer swallowed)."""
    if self.requested:
      raise KeyboardInterrupt

  def _handler(self, signum, frame) -> None:
    if self.requested or not self.in_steps:
      self.requested = True
      raise KeyboardInterrupt
    self.requested = True
    sys.stderr.write("\ninterrupt: saving after this step, then stopping "
                     "(Ctrl-C again to stop at once, unsaved)\n")
    sys.stderr.flush()
