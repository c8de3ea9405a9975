"""What a run logs: the progress line, ``metrics.jsonl`` (and TensorBoard), and reading it back."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


class Log:
  """Progress line on stderr, metrics as JSON lines, and TensorBoard scalars when
  ``tensorboardX`` is installed (``<out_dir>/tensorboard``)."""

  def __init__(self, path: Path, total: int, unit: str, start: int = 0, *,
               enabled: bool = True):
    self.enabled = enabled
    if not enabled:  # another host of a multi-host run: its records are the first host's
      self.file, self.tensorboard = None, None
      return
    path.parent.mkdir(parents=True, exist_ok=True)
    truncate_metrics(path, start)
    self.path, self.file, self.total, self.unit = path, open(path, "a"), total, unit
    try:
      from tensorboardX import SummaryWriter
      # purge_step: TensorBoard drops the old run's scalars from the resumed step on
      self.tensorboard = SummaryWriter(str(path.parent / "tensorboard"),
                                       purge_step=start + 1 if start else None)
    except ImportError:
      self.tensorboard = None

  def write(self, record: dict) -> None:
    if not self.enabled:
      return
    self.file.write(json.dumps(record) + "\n")
    self.file.flush()
    if self.tensorboard is not None and "step" in record:
      for key, value in record.items():
        if key != "step" and isinstance(value, (int, float)):
          self.tensorboard.add_scalar(key, value, record["step"])

  def progress(self, step, loss, steps_per_s, items_per_s) -> None:
    if not self.enabled:
      return
    width = 24
    done = int(width * step / self.total)
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {step}/{self.total} "
                     f"loss {loss:.4f} | {steps_per_s:.2f} steps/s | "
                     f"{items_per_s:.0f} {self.unit}/s ")
    sys.stderr.flush()

  def close(self):
    """Best effort: a failure to flush (a full disk) is a warning, so it never replaces
    the error the run is ending with (a checkpoint that could not be saved there)."""
    if self.file is None or self.file.closed:
      return
    sys.stderr.write("\n")
    for name, closable in (("metrics.jsonl", self.file), ("tensorboard", self.tensorboard)):
      try:
        if closable is not None:
          closable.close()
      except OSError as e:
        print(f"warning: could not finish writing {name} in {self.path.parent}: {e}",
              file=sys.stderr, flush=True)
        if closable is self.tensorboard:
          _abandon(self.tensorboard)


def _abandon(writer) -> None:
  """A tensorboardX writer whose close failed, given up: its worker thread stopped and its
  event files marked closed, else its atexit hook failed the same flush again and the
  worker died at exit, two tracebacks after the run's one error line (tensorboardX's
  internals: best effort)."""
  for file_writer in (getattr(writer, "all_writers", None) or {}).values():
    events = getattr(file_writer, "event_writer", None)
    try:
      events._worker.stop()
    except Exception:  # noqa: BLE001 - already stopped, or not this tensorboardX
      pass
    if events is not None:
      events._closed = True


def metric_records(path: Path):
  """``(line, record)`` of each readable JSON line of a metrics.jsonl (a line cut short
  by a kill is skipped)."""
  if not path.exists():
    return
  for line in path.read_text().splitlines():
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      continue
    if isinstance(record, dict):
      yield line, record


def truncate_metrics(path: Path, start: int) -> None:
  """Drops the records a run resumed at step ``start`` writes again: every record past
  ``start``, and events (the memory report) at ``start``. A fresh run starts empty."""
  if not path.exists():
    return
  kept = [line + "\n" for line, record in metric_records(path)
          if isinstance(record.get("step"), int)
          and (record["step"] < start or (record["step"] == start and "event" not in record))]
  tmp = path.with_suffix(".tmp")
  tmp.write_text("".join(kept))
  os.replace(tmp, path)


def finished_result(path: Path, step: int) -> dict:
  """The result of a run finished at ``step``, read back from its metrics.jsonl."""
  result = {"step": step, "loss": float("nan")}
  for _, record in metric_records(path):
    if record.get("step", step + 1) <= step and "event" not in record:  # not a plan's
      if "loss" in record:
        result["loss"] = record["loss"]
      result.update({k: v for k, v in record.items() if k.startswith("eval_")})
  return result
