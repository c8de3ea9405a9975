"""Run folders: where a run writes, and whether it starts, continues or replaces a run.

| ``out_dir`` | ``resume`` | what happens |
|---|---|---|
| unset | no | a new folder ``runs/<name>/<YYYYmmdd-HHMMSS>`` (``-2``, ``-3``... when taken) |
| unset | yes | the newest run under ``runs/<name>/`` with a checkpoint; none: a new folder |
| set | no | that folder, which must not hold a run unless ``overwrite=true`` |
| set | yes | that folder's run; without a checkpoint it starts at step 0, and says so |

``python -m train --resume`` without ``--config``/``--config-name`` continues with the
run's own ``config.json`` and the command's ``--set`` on top (:func:`resumed_config`).

A folder holds a run when it has checkpoints, ``metrics.jsonl`` or ``config.json``. A
new run takes an ``out_dir`` by creating :data:`CLAIM_FILE` in it at once (``O_EXCL``),
so of two commands started together the second is refused; a claim whose process has
ended (a run killed before it wrote anything) is taken over where that process ran on
this host (one of another host cannot be asked), and a run that fails before its first
step gives its claim back.
``overwrite=true`` deletes only what a run writes there (:data:`ARTIFACTS`), and only once
the new run's data, labels and model have passed their checks (:func:`delete_previous`,
called by ``train.loop`` before its first write): a command refused for its input leaves
the previous run as it was.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import socket
import time
from collections.abc import Sequence
from pathlib import Path

from train.config import TrainConfig, load_config, named_keys

RUNS_DIR = Path("runs")  # relative to the current folder
LABELS_FILE = "labels.json"  # a classifier run's class names, by label id (train.loop)
# made at once (O_EXCL) by the run that takes a folder, naming it (_owner), so of two
# commands started together on one out_dir the second is refused, not both writing there
CLAIM_FILE = ".lowmem-run"
ARTIFACTS = ("checkpoints", "metrics.jsonl", "tensorboard", "config.json", "pretrained.json",
             LABELS_FILE, CLAIM_FILE)
STAMP = re.compile(r"^(\d{8}-\d{6})(?:-(\d+))?$")


def has_checkpoint(folder: Path) -> bool:
  ckpts = Path(folder) / "checkpoints"
  return ckpts.is_dir() and any(p.name.isdigit() and p.is_dir() for p in ckpts.iterdir())


def holds_run(folder: Path) -> bool:
  folder = Path(folder)
  return has_checkpoint(folder) or any((folder / f).exists()
                                       for f in ("metrics.jsonl", "config.json"))


def is_run_folder(folder: Path) -> bool:
  """Whether ``folder`` is a run's: a checkpoint or a metrics.jsonl (a config.json alone
  may be the user's own)."""
  return has_checkpoint(folder) or (Path(folder) / "metrics.jsonl").exists()


def _owner() -> str:
  """``"<host> <pid> <start>"``: this process; its start time (Linux's ``/proc``, else
  ``-``) tells it from a later process given the same pid (a restarted container's
  python is pid 1 again)."""
  return f"{socket.gethostname()} {os.getpid()} {_started(os.getpid())}"


def _started(pid: int) -> str:
  try:  # field 22 of /proc/<pid>/stat, counted after the ")" that ends the command name
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
  except (OSError, IndexError):
    return "-"


def claim(folder: Path) -> None:
  """Takes ``folder`` for this process (:data:`CLAIM_FILE`, made at once), or a
  ValueError: a live process holds it (of this host, or of another, which cannot be
  asked). A claim of a process of this host that has ended is taken over."""
  path = Path(folder) / CLAIM_FILE
  for _ in range(3):
    try:
      fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
      text = _read_claim(path)
      if text is not None and _claim_is_stale(text):
        _take_over(path, text)
        continue
      raise ValueError(f"out_dir {folder} is taken by another command ({path} names "
                       f"{text or 'it'}); leave out_dir unset for a new folder, or remove "
                       "that file if no such command runs") from None
    with os.fdopen(fd, "w") as f:
      f.write(_owner())
    return
  raise ValueError(f"out_dir {folder}: other commands keep taking it; leave out_dir unset")


def _take_over(path: Path, stale: str) -> None:
  """Moves the stale claim ``stale`` aside (a rename: of two commands taking it over, one
  moves it); a fresh claim moved instead (made since it was read) is put back."""
  aside = path.with_name(f"{CLAIM_FILE}.{os.getpid()}")
  try:
    os.rename(path, aside)
  except FileNotFoundError:
    return  # another command moved it first
  if _read_claim(aside) != stale:
    try:
      os.link(aside, path)  # put back, unless yet another claim is there now
    except FileExistsError:
      pass
  aside.unlink(missing_ok=True)


def release_claim(folder: Path) -> None:
  """Gives back this process's claim on ``folder`` where no run was written there."""
  path = Path(folder) / CLAIM_FILE
  if _read_claim(path) == _owner() and not holds_run(folder):
    path.unlink(missing_ok=True)


def _read_claim(path: Path) -> str | None:
  try:
    return path.read_text().strip()
  except OSError:
    return None


def _claim_is_stale(text: str) -> bool:
  """Whether the process a claim names is gone: this process itself (an earlier run of
  it), or one of this host no longer running, or whose pid a later process has."""
  if text == _owner():
    return True
  host, _, rest = text.partition(" ")
  pid, _, start = rest.partition(" ")
  if host != socket.gethostname() or not pid.isdigit():
    return False
  try:
    os.kill(int(pid), 0)
  except ProcessLookupError:
    return True
  except PermissionError:  # alive, another user's
    pass
  return start not in ("", "-") and _started(int(pid)) not in (start, "-")


def new_run_folder(parent: Path, now: float | None = None) -> Path:
  """Creates and returns ``parent/<YYYYmmdd-HHMMSS>``, suffixed ``-2``, ``-3``... when that
  folder exists (mkdir is atomic: two runs started in the same second get two folders)."""
  stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
  Path(parent).mkdir(parents=True, exist_ok=True)
  n = 1
  while True:
    path = Path(parent) / (stamp if n == 1 else f"{stamp}-{n}")
    try:
      path.mkdir()
      return path
    except FileExistsError:
      n += 1


def remove_if_empty(folder: Path) -> None:
  """Removes ``folder`` if it holds nothing but this process's claim (a run that failed
  before writing a file)."""
  folder = Path(folder)
  release_claim(folder)
  try:
    folder.rmdir()  # only an empty folder
    print(f"removed the empty run folder {folder}", flush=True)
  except OSError:
    pass


def remove_unstarted(folder: Path, *, keep: set[str] | None = None) -> None:
  """Removes the folder of a run that failed before its first step (no checkpoint, no
  step in ``metrics.jsonl``, events such as the memory report aside): its own files
  (:data:`ARTIFACTS`), then the folder if that leaves it empty. A refused first step (a check after the folder was made, a memory
  report that could not compile) so leaves nothing that would refuse the corrected
  command. Call it only for a folder this run made, or one that held no run before it,
  with ``keep``: the names of :data:`ARTIFACTS` that were there before it (the user's
  own ``tensorboard/``, say), kept, as is the folder."""
  from train.metrics import metric_records
  folder = Path(folder)
  if has_checkpoint(folder) or any("event" not in record for _, record in
                                   metric_records(folder / "metrics.jsonl")):
    return  # a step was logged: the run started (its log is kept)
  for name in ARTIFACTS:
    path = folder / name
    if keep is not None and name in keep:
      continue
    if path.is_dir():
      shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
      path.unlink(missing_ok=True)
  if keep is not None:  # made before the run (mkdir -p $OUT): left
    return
  try:
    folder.rmdir()
    print(f"removed the run folder {folder}: the run stopped before its first step",
          flush=True)
  except OSError:
    pass


def newest_run(parent: Path) -> Path | None:
  """The newest timestamped run folder in ``parent`` that has a checkpoint."""
  if not Path(parent).is_dir():
    return None
  found = []
  for p in Path(parent).iterdir():
    m = STAMP.match(p.name)
    if m and p.is_dir() and has_checkpoint(p):
      found.append(((m.group(1), int(m.group(2) or 1)), p))
  return max(found)[1] if found else None


# The fields that say which run a resume continues (its folder, or the newest run of the
# name they derive); the rest of the command's settings apply to the run's own config.
RESUME_WHERE = ("out_dir", "name", "task", "model", "pretrained", "data")
# What a resume does not take from the run's config.json: one-off outputs and the replace
# switch (the command names them again where it wants them).
NOT_RESUMED = ("overwrite", "profile_dir", "profile_start", "profile_stop", "memory_profile",
               "export_dir")


def resumed_config(where: TrainConfig, overrides: Sequence[str]) -> TrainConfig:
  """The config a resume continues with: the run's own ``config.json`` (of ``where.out_dir``,
  or of the newest run of ``where.name`` with a checkpoint) with ``overrides`` (the
  command's ``--set`` and flags) applied, so a resume needs none of the run's settings
  again and changes only what it names (:data:`NOT_RESUMED` back to their defaults unless
  named). Where there is no such file, the command's own config (the defaults and
  ``overrides``), said so when the folder exists."""
  folder = (Path(where.out_dir) if where.out_dir is not None
            else newest_run(RUNS_DIR / where.name))
  saved = None if folder is None else folder / "config.json"
  if saved is None or not saved.is_file():
    if folder is not None and folder.is_dir():
      print(f"resuming {folder}, which holds no config.json: with this command's config",
            flush=True)
    return load_config(None, None, [*overrides, "resume=true"])
  resumed = load_config(None, str(saved), ["overwrite=false", *overrides,
                                           f"out_dir={folder}", "resume=true"])
  named = named_keys(overrides)
  refuse_named_plan(folder, named, resumed.memory_budget)
  defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
  resumed = resumed.replace(**{k: defaults[k] for k in NOT_RESUMED if k not in named})
  shown = [o for o in overrides if o.partition("=")[0].strip() != "out_dir"]
  print(f"resuming with the run's config ({saved})"
        + (f" and {', '.join(shown)}" if shown else ""), flush=True)
  return resumed


def delete_previous(folder: Path) -> None:
  """Deletes what a previous run wrote in ``folder`` (:data:`ARTIFACTS`; nothing else),
  for ``overwrite=true``, said so; nothing there: nothing said."""
  found = [Path(folder) / name for name in ARTIFACTS if (Path(folder) / name).exists()]
  for path in found:
    if path.is_dir():
      shutil.rmtree(path)
    else:
      path.unlink()
  if found:
    print(f"overwrite=true: the previous run in {folder} was deleted", flush=True)


def resumed_folder(cfg: TrainConfig) -> Path | None:
  """The folder a resume of ``cfg`` continues: ``out_dir``, else the newest run of its
  name with a checkpoint (None: nothing to resume)."""
  return Path(cfg.out_dir) if cfg.out_dir is not None else newest_run(RUNS_DIR / cfg.name)


def refuse_named_with_budget(named: set[str], budget) -> None:
  """A new run under ``memory_budget`` takes the policy and grad_accum its plan chooses: a
  command that also names either is a ValueError before any work, where it would be
  silently replaced."""
  changed = sorted(named & {"policy", "grad_accum"})
  if budget is not None and changed:
    raise ValueError(f"{', '.join(changed)}: memory_budget={budget} chooses the policy and "
                     "grad_accum; name them without memory_budget, or the budget alone")


def refuse_named_plan(folder: Path | None, named: set[str], budget) -> None:
  """A resume of a run planned by ``memory_budget`` keeps the policy and grad_accum the
  plan chose (``train.loop``): a command that also names either, with a ``budget`` in
  effect (not ``memory_budget=null``), is a ValueError before any work, where it would be
  silently replaced (the eval batch too, which the plan may have halved). A run that was
  not planned is left to the loop's own check."""
  changed = sorted(named & {"policy", "grad_accum", "eval_batch_size"})
  saved = None if folder is None else Path(folder) / "config.json"
  if budget is None or not changed or saved is None or not saved.is_file():
    return
  try:
    planned = json.loads(saved.read_text()).get("memory_budget")
  except (OSError, ValueError, AttributeError):
    return  # an unreadable config.json is the resume's own error
  if planned is not None:
    raise ValueError(
        f"{', '.join(changed)}: the run in {folder} chose its policy, grad_accum and eval "
        f"batch by memory_budget={planned}, which a resume keeps; to resume under another, "
        "add --set memory_budget=null")


def prepare(cfg: TrainConfig, primary: bool = True) -> TrainConfig:
  """``cfg`` with ``out_dir`` set to this run's folder (created). Prints where the run goes;
  refuses, before any work, to write over a run nobody asked to resume or replace.
  ``primary``: False on the other hosts of a multi-host run, which only create the folder."""
  if not primary and cfg.out_dir is not None:
    Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
    return cfg
  if cfg.out_dir is None:
    if cfg.distributed:
      raise ValueError("distributed=true needs an explicit out_dir (every host must write "
                       "the same folder)")
    parent = RUNS_DIR / cfg.name
    if cfg.resume:
      found = newest_run(parent)
      if found is not None:
        print(f"run folder: {found} (resuming the newest run of {cfg.name!r})", flush=True)
        return cfg.replace(out_dir=str(found))
      folder = new_run_folder(parent)
      print(f"nothing to resume: no run of {cfg.name!r} with a checkpoint in {parent}/; "
            f"starting a new run in {folder}", flush=True)
      return cfg.replace(out_dir=str(folder), resume=False)
    folder = new_run_folder(parent)
    print(f"run folder: {folder}", flush=True)
    return cfg.replace(out_dir=str(folder))

  folder = Path(cfg.out_dir)
  if folder.exists() and not folder.is_dir():
    raise ValueError(f"out_dir {folder} is a file, not a folder")
  if not cfg.resume and holds_run(folder):
    if not cfg.overwrite:
      raise ValueError(
          f"out_dir {folder} already holds a run; pass --resume to continue it, "
          "--overwrite (--set overwrite=true) to replace it, or leave out_dir unset for a "
          f"new folder under {RUNS_DIR / cfg.name}/")
    print(f"run folder: {folder} (overwrite=true: the previous run there is deleted once "
          "this run's data and model pass their checks)", flush=True)
  elif cfg.resume and not has_checkpoint(folder):
    print(f"run folder: {folder} (nothing to resume there, no checkpoint: starting at step "
          "0)", flush=True)
  else:
    print(f"run folder: {folder}", flush=True)
  folder.mkdir(parents=True, exist_ok=True)
  if not cfg.resume and not cfg.overwrite:
    claim(folder)
  return cfg
