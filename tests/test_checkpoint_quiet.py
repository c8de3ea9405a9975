"""A corrupt checkpoint is reported on stderr by our one warning or error line alone.

orbax closes a restore's event loop as soon as one array read fails, with the other reads
still in flight; before train.checkpoint let them finish, those reads then failed on the
closed loop and buried the warning under up to 1,400 lines of "RuntimeError: Event loop is
closed" tracebacks, "Exception ignored in: <coroutine object
_read_array_index_and_device_put ...>" and TensorStore spec dumps. An empty OCDBT manifest
(every array's open fails, the first failure closing the loop on the rest) showed that on
10 of 11 CLI resumes on a 2-core CPU (this test: 5 failures in 5 runs); a deleted array file
on about half.
"""

import asyncio
import re

import pytest

from conftest import TINY_TRAIN, set_args, stderr_lines
from test_train import _copy, _run, finished_run  # noqa: F401 (a fixture)

NOISE = re.compile(r"Traceback|Event loop is closed|Exception ignored|Task was destroyed|"
                   r"never retrieved|TensorStore\(")


def _empty_manifest(step_dir) -> None:
  """Corrupts a checkpoint: its state's OCDBT manifest (the index of every array) emptied."""
  (step_dir / "state" / "manifest.ocdbt").write_bytes(b"")


@pytest.mark.slow  # two CLI resumes (no step compiled): ~15 s on 2 cores, ~23 s in all
def test_corrupt_checkpoints_leave_only_our_lines_on_stderr(finished_run, tmp_path):
  run = _copy(finished_run, tmp_path / "run")
  ckpts = tmp_path / "run" / "checkpoints"
  # steps=2: the run is finished once step 2 is restored, so nothing is compiled
  args = ["--out-dir", run.out_dir, "--resume", *set_args(TINY_TRAIN),
          "--set", "steps=2", "--set", "save_every=2"]

  _empty_manifest(ckpts / "4")
  proc = _run(args, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = stderr_lines(proc.stderr, progress=True)
  noise = [line for line in lines if NOISE.search(line)]
  assert not noise, f"{len(lines)} stderr lines, {len(noise)} of them noise:\n" + \
      "\n".join(lines[:40])
  corrupt = [line for line in lines if "is corrupt" in line]
  assert len(corrupt) == 1 and "warning: checkpoint step 4" in corrupt[0] and \
      "resumed from step 2" in corrupt[0], lines
  # the rest: the config change this test makes (steps 4 -> 2)
  assert all(line.startswith("warning: resuming with a config that differs")
             for line in lines if line not in corrupt), lines
  assert (ckpts / "4.corrupt").is_dir() and "already finished at step 2" in proc.stdout

  _empty_manifest(ckpts / "2")  # now every checkpoint is unreadable
  proc = _run(args, timeout=300)
  lines = stderr_lines(proc.stderr, progress=True)
  assert proc.returncode == 2 and len(lines) == 1, f"{len(lines)} stderr lines:\n" + \
      "\n".join(lines[:40])
  assert lines[0].startswith("error: no intact checkpoint in ") and \
      "steps 2 are all unreadable" in lines[0], lines


def test_loops_closed_during_a_restore_finish_their_pending_tasks_first(monkeypatch):
  from train import checkpoint
  done = []

  async def read(fail: bool, delay: float):
    await asyncio.sleep(delay)
    done.append(delay)
    if fail:
      raise OSError("unreadable")

  async def restore():  # as orbax's: the first failure ends it, the other reads pending
    await asyncio.gather(read(True, 0.0), read(False, 0.05), read(True, 0.1))

  with checkpoint._reads_finish_before_loops_close():
    loop = asyncio.new_event_loop()
    with pytest.raises(OSError):
      loop.run_until_complete(restore())
    assert asyncio.all_tasks(loop)  # still reading
    loop.close()
  assert loop.is_closed() and not asyncio.all_tasks(loop) and done == [0.0, 0.05, 0.1]
  assert not isinstance(asyncio.get_event_loop_policy(), checkpoint._FinishPendingOnClose)

  # a read that never ends is cancelled after the timeout
  monkeypatch.setattr(checkpoint, "PENDING_READS_TIMEOUT_S", 0.1)
  with checkpoint._reads_finish_before_loops_close():
    loop = asyncio.new_event_loop()
    forever = loop.create_task(asyncio.Event().wait())
    loop.run_until_complete(asyncio.sleep(0))
    loop.close()
  assert loop.is_closed() and forever.cancelled()


def test_reads_that_failed_unretrieved_before_the_close_are_not_logged(caplog):
  """A read that failed before the loop closed, its error never retrieved (orbax waits on
  the first failure only), is no pending task: asyncio logs it when the task is collected
  ("Task exception was never retrieved" and a traceback per read: 36 stderr lines on one
  loaded CI run). Loops made during a restore drop that; other errors still reach asyncio's
  log, and loops made outside a restore are untouched."""
  from train import checkpoint

  async def fail():
    raise OSError("unreadable")

  def failed_reads():  # each task's collection is its __del__, called here at a known time
    loop = asyncio.new_event_loop()
    tasks = [loop.create_task(fail()) for _ in range(2)]
    loop.run_until_complete(asyncio.wait(tasks))  # both failed, neither retrieved
    loop.call_exception_handler({"message": "another error"})
    loop.close()
    for task in tasks:
      task.__del__()

  with checkpoint._reads_finish_before_loops_close():
    failed_reads()
  assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == ["another error"]
  caplog.clear()
  failed_reads()
  logged = [r.getMessage().split("\n")[0] for r in caplog.records if r.name == "asyncio"]
  assert logged == ["another error"] + ["Task exception was never retrieved"] * 2, logged


@pytest.mark.parametrize("damage", ["truncated", "binary"])
def test_an_unreadable_orbax_step_metadata_is_one_warning(finished_run, tmp_path, capsys,
                                                          caplog, damage):
  """A truncated or binary (not UTF-8) ``_CHECKPOINT_METADATA`` (orbax's bookkeeping; our
  arrays and metadata intact) resumes, with one warning of ours instead of absl ERROR
  lines per read (orbax logs the two apart: json parse, read)."""
  from train.loop import train
  run = _copy(finished_run, tmp_path / "run")
  path = tmp_path / "run" / "checkpoints" / "4" / "_CHECKPOINT_METADATA"
  if damage == "truncated":
    path.write_text(path.read_text()[:20])
  else:
    path.write_bytes(b"\x00garbage\xff" * 7)
  capsys.readouterr()
  result = train(run.replace(resume=True))
  err = capsys.readouterr().err
  assert result["step"] == 4
  assert not [r for r in caplog.records if "Metadata file" in r.getMessage()]
  warnings = [line for line in err.splitlines() if line.startswith("warning: ")]
  assert warnings == [f"warning: {path} (orbax's save time and handler names) is unreadable; "
                      "the arrays and metadata of step 4 passed their checksum, so the run "
                      "resumes from it"], err
