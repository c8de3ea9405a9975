"""The checkpoint a run started from, recorded in its folder so its export merges into it.

An export that reads the pretrained checkpoint again (a LoRA run's, which merges the
adapters into the checkpoint's tensors; a run with a frozen base in ``base_dtype``, whose
fp32 base is read again) writes that checkpoint's values, not the run's. So a run
records the checkpoint's fingerprint (:mod:`models.hf_fingerprint`) in ``pretrained.json``
when it starts, keeps it through resumes, and checks it when it resumes and before it
exports: a checkpoint changed since is one error naming the files, before anything is
trained or written.
"""

from __future__ import annotations

import json
from pathlib import Path

from lowmem_jax.memory import write_json
from models.hf_fingerprint import differences, fingerprint
from models.hf_state import CheckpointError
from train.config import TrainConfig
from train.model import resolve_path

RECORD = "pretrained.json"


def take(cfg: TrainConfig, out: Path, *, resuming: bool) -> dict | None:
  """The record of a run from a checkpoint, taken at its start (before the model reads
  the checkpoint), for :func:`write`; None without a checkpoint, or at a resume of a run
  that holds its own (one written before this record existed gets one now)."""
  if not cfg.pretrained or (resuming and (Path(out) / RECORD).exists()):
    return None
  path = resolve_path(cfg.pretrained)
  return {"pretrained": path, "files": fingerprint(path)}


def write(out: Path, record: dict) -> None:
  """Writes ``record`` to ``out/pretrained.json`` (whole or not at all), with the run's
  config.json: a run that fails before it leaves neither."""
  write_json(str(Path(out) / RECORD), record, announce=False)


def check_unchanged(cfg: TrainConfig, out: Path) -> None:
  """A :class:`CheckpointError` if the checkpoint differs from the run's record, which the
  export would merge into. Nothing to check without a record."""
  file = Path(out) / RECORD
  if not cfg.pretrained or not file.exists():
    return
  try:
    recorded = json.loads(file.read_text())["files"]
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise CheckpointError(f"{file}: unreadable ({e}); it records the checkpoint the run "
                          "started from") from None
  path = resolve_path(cfg.pretrained)
  changed = differences(recorded, fingerprint(path))
  if changed:
    raise CheckpointError(
        f"pretrained={cfg.pretrained!r} changed since the run in {out} started from it "
        f"({', '.join(changed)}): the export would use other weights than the run trained "
        "on; put back the checkpoint the run started from (the run's own checkpoints hold "
        "what it trained), then resume")
