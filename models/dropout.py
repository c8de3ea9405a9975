"""Dropout as a model component: :func:`lowmem_jax.dropout.dropout` with its key in the
train state.

``Dropout(rate)`` holds a PRNG key and a call count (a :class:`DropoutKey`, seeded by
:func:`models.sites.seed_sites` like every site key, one per layer in a block stack); each
training call draws its mask from ``fold_in(key, count)`` and counts one up. The count is
carried in the train state, so a resumed run draws the masks the uninterrupted one would,
and remat's recomputed forward (same count) draws the same mask. Backward keeps only the
key (:mod:`lowmem_jax.dropout`), never the mask.

``deterministic`` (``model.eval()`` sets it, ``model.train()`` clears it, as for
``nnx.Dropout``): the identity, nothing counted. Rate 0 is the identity and holds no state,
so a model without dropout has the same variables as before dropout existed.
"""

from __future__ import annotations

import jax
from flax import nnx

from lowmem_jax import sampling
from lowmem_jax.dropout import check_rate, dropout
from models.sites import StateSite


class DropoutKey(StateSite):
  """A dropout's state: PRNG key data and call count (:class:`lowmem_jax.sampling.KeyState`)."""


class Dropout(nnx.Module):
  """Dropout at ``rate`` whose backward keeps its key, not its mask (module docstring)."""

  def __init__(self, rate: float, *, what: str = "dropout rate"):
    self.rate = check_rate(rate, what)
    self.deterministic = False
    self.key_state = DropoutKey(sampling.KeyState.create()) if self.rate else None

  @property
  def active(self) -> bool:
    """Whether a call drops anything (a rate above 0, not in eval mode)."""
    return bool(self.rate) and not self.deterministic

  @property
  def updates_state(self) -> bool:
    """Whether a forward writes state here (its call count): when :attr:`active`."""
    return self.active

  def next_key(self) -> jax.Array | None:
    """This call's key (None when not :attr:`active`), counting the call: for an op that
    draws its own mask from it (attention-probability dropout)."""
    if not self.active:
      return None
    state = self.key_state.read()
    self.key_state.write(state.advanced(), state)
    return state.step_key()

  def __call__(self, x: jax.Array) -> jax.Array:
    key = self.next_key()
    return x if key is None else dropout(x, self.rate, key)
