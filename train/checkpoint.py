"""Checkpoints with orbax: the train state (model + optimizer) and the loop's position.

Each save is atomic (orbax writes a temporary directory and renames it when complete),
so a run killed mid-save keeps its last complete checkpoint. A checkpoint holds the
state pytree and JSON metadata (step, data iterator position, config), which is all a
resumed run needs to continue bit for bit.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp


class Checkpoints:

  def __init__(self, directory: str | os.PathLike, *, max_to_keep: int = 3):
    self.directory = os.path.abspath(directory)
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                             enable_async_checkpointing=False))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, meta: dict) -> None:
    """Writes ``state`` (a pytree of arrays) and ``meta`` (JSON) for ``step``."""
    self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                    meta=ocp.args.JsonSave(meta)), force=True)
    self.manager.wait_until_finished()

  def restore(self, abstract_state, step: int | None = None):
    """``(state, meta)`` of ``step`` (default: the latest), shaped like ``abstract_state``."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory} to resume from")
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
    out = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
    return out["state"], out["meta"]

  def close(self) -> None:
    self.manager.close()
