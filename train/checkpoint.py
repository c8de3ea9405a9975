"""Checkpoints with orbax: the train state (model + optimizer) and the loop's position.

Each save is atomic (orbax writes a temporary directory and renames it when complete),
so a run killed mid-save keeps its last complete checkpoint. A checkpoint holds the
state pytree and JSON metadata (step, data iterator position, config, a checksum of the
state and one of the metadata), which is all a resumed run needs to continue bit for bit.
A save that fails (a full disk) is one ``OSError`` naming the step and folder.

Restore checks what it reads: a newest checkpoint that cannot be read (truncated or
missing array files, garbage metadata) or whose arrays fail the checksum is renamed
``<step>.corrupt`` and the previous one is used, with a warning naming both steps.
A checkpoint whose arrays have other shapes than the model's is no corruption but a
changed config: :class:`StateMismatchError`.

A failed read is quiet. An unparsable ``_CHECKPOINT_METADATA`` (orbax's bookkeeping) is
one warning of ours, not absl ERROR lines per read. And orbax runs each restore on a fresh
event loop and closes it as soon as the first array read fails, with the other reads still
in flight; their TensorStore callbacks then hit the closed loop ("RuntimeError: Event loop
is closed" tracebacks) and their coroutines are collected half-run ("Exception ignored in:
<coroutine object _read_array_index_and_device_put ...>" with a spec dump), pages of
stderr around the one warning. Restores here run under
:func:`_reads_finish_before_loops_close`, so a loop orbax closes first lets its pending
reads finish (their errors collected and dropped), and the errors of reads that failed
before it closed, never retrieved, are not logged when their tasks are collected.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from train import interrupt


class StateMismatchError(ValueError):
  """The checkpoint's arrays do not fit the state being restored (a changed config)."""

  def __init__(self, step: int, detail: str):
    super().__init__(f"checkpoint step {step} does not fit this model: {detail}")
    self.step, self.detail = step, detail


class NoIntactCheckpointError(ValueError):
  """Every checkpoint in the folder is unreadable."""


@jax.jit
def _checksum(leaves):
  """uint32 checksum of every leaf's bits (sums weighted by odd position and leaf
  factors, wrapping): any single flipped bit changes it."""
  total = jnp.uint32(0)
  for i, x in enumerate(leaves):
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    if x.dtype.itemsize == 8:
      bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    elif x.dtype == jnp.bool_:
      bits = x.astype(jnp.uint32)
    else:
      unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
      bits = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
    bits = bits.reshape(-1)
    # odd weights: a flipped bit k moves the sum by 2**k * odd, never 0 mod 2**32
    weights = (jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2654435761)) | jnp.uint32(1)
    total = total + jnp.sum(bits * weights, dtype=jnp.uint32) * jnp.uint32(2 * i + 1)
  return total


def state_checksum(state) -> int:
  """The checksum a checkpoint stores for ``state`` (any pytree of arrays)."""
  leaves = jax.tree.leaves(state)
  return int(_checksum(leaves)) if leaves else 0


def meta_checksum(meta: dict) -> str:
  """The checksum a checkpoint stores for its JSON metadata (all but the checksums): a
  changed data position that still parses would resume on other batches."""
  body = {k: v for k, v in meta.items() if k != "meta_checksum"}
  return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def _dtype_name(dtype) -> str:
  try:
    return np.dtype(dtype).name
  except TypeError:  # PRNG key dtypes
    return str(dtype)


def _few(names: list[str], n: int = 3) -> str:
  """The first ``n`` of ``names``, and how many more; "none" when empty."""
  if not names:
    return "none"
  more = f" and {len(names) - n} more" if len(names) > n else ""
  return ", ".join(names[:n]) + more


def _short(e: BaseException) -> str:
  """One line of an exception (orbax/tensorstore messages run to pages)."""
  text = (str(e).strip().splitlines() or [""])[0]
  text = text[:117] + "..." if len(text) > 120 else text
  return f"{type(e).__name__}: {text}" if text else type(e).__name__


# How long a closing loop waits for the reads still pending after a failed restore (they
# end as soon as their files are read or fail); any still running then are cancelled.
PENDING_READS_TIMEOUT_S = 120.0


def _finish_pending_tasks(loop: asyncio.AbstractEventLoop) -> None:
  """Runs ``loop`` until no task on it is pending (their results and errors dropped), at
  most PENDING_READS_TIMEOUT_S; then cancels what is left."""
  try:
    asyncio.get_running_loop()
    return  # inside a running loop: cannot run another here
  except RuntimeError:
    pass
  deadline = time.monotonic() + PENDING_READS_TIMEOUT_S
  while pending := asyncio.all_tasks(loop):  # again: tasks may start tasks
    finished = asyncio.gather(*pending, return_exceptions=True)
    try:
      loop.run_until_complete(
          asyncio.wait_for(finished, max(deadline - time.monotonic(), 0.0)))
    except asyncio.TimeoutError:  # wait_for cancelled them
      return


def _drop_unretrieved_read_errors(loop: asyncio.AbstractEventLoop, context: dict) -> None:
  """A restore loop's exception handler: a read that failed before the loop closed and whose
  error orbax never retrieved (it waits on the first failure only) is logged by asyncio when
  its task is collected, a traceback per read; dropped here (the restore's own error says
  it). Anything else goes to asyncio's default handler."""
  if context.get("message") != "Task exception was never retrieved":
    loop.default_exception_handler(context)


class _FinishPendingOnClose(asyncio.AbstractEventLoopPolicy):
  """``base``'s policy, except that the loops it makes finish their pending tasks when
  closed, before closing (asyncio.run() would cancel them; a bare loop.close() leaves them
  to run on a closed loop)."""

  def __init__(self, base: asyncio.AbstractEventLoopPolicy):
    self.base = base

  def get_event_loop(self):
    return self.base.get_event_loop()

  def set_event_loop(self, loop):
    self.base.set_event_loop(loop)

  def new_event_loop(self):
    loop = self.base.new_event_loop()
    close = loop.close

    def finish_then_close():
      if not loop.is_closed() and not loop.is_running():
        _finish_pending_tasks(loop)
      close()

    loop.close = finish_then_close
    loop.set_exception_handler(_drop_unretrieved_read_errors)
    return loop

  def get_child_watcher(self):
    return self.base.get_child_watcher()

  def set_child_watcher(self, watcher):
    self.base.set_child_watcher(watcher)


@contextlib.contextmanager
def _reads_finish_before_loops_close():
  """Within: event loops (orbax makes one per restore) finish their pending tasks before
  they close. A restore whose first array read fails then waits for its other reads
  instead of leaving them to fail noisily on a closed loop. The policy is process-wide
  while set: a loop another thread makes meanwhile cleans up the same way on close, the
  wait asyncio.run() would do, nothing more."""
  base = asyncio.get_event_loop_policy()
  asyncio.set_event_loop_policy(_FinishPendingOnClose(base))
  try:
    yield
  finally:
    asyncio.set_event_loop_policy(base)


class _OrbaxLogFilter(logging.Filter):
  """Takes off absl's log what our checkpoints say themselves, once: orbax's ERROR lines
  about a step's unparsable or unreadable (not UTF-8) ``_CHECKPOINT_METADATA`` (its
  bookkeeping: save time, handler names; each read logs it again; the folders they name
  are collected for one warning of ours), warnings of reads whose outcome our checks
  decide, and a failed save's tracebacks from orbax's threads (the save raises it)."""
  PREFIXES = ("Failed to json parse Metadata file: ", "Failed to read Metadata file: ")

  def __init__(self):
    super().__init__()
    self.files: set[str] = set()
    self.saving = 0  # saves of ours in progress

  # warnings of a read whose outcome our checks decide (a missing _CHECKPOINT_METADATA, an
  # item's unreadable metadata: the arrays restore or fail their checksum): dropped
  DROPPED = ("Metadata file does not exist: ", 'Item "state" was found in the checkpoint, '
             "but could not be restored")

  def filter(self, record: logging.LogRecord) -> bool:
    message = record.getMessage()
    if message.startswith(self.DROPPED):
      return False
    if self.saving and "_SignalingThread.run() raised an exception" in message:
      return False  # a save's failed write, with its traceback: the save raises it, once
    for prefix in self.PREFIXES:
      if message.startswith(prefix):
        self.files.add(message[len(prefix):].split(", ", 1)[0])
        return False
    return True


_ORBAX_LOG = _OrbaxLogFilter()
logging.getLogger("absl").addFilter(_ORBAX_LOG)


class Checkpoints:

  def __init__(self, directory: str | os.PathLike, *, max_to_keep: int = 3):
    self.directory = os.path.abspath(directory)
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                             enable_async_checkpointing=False),
        item_handlers={"state": ocp.StandardCheckpointHandler(),
                       "meta": ocp.JsonCheckpointHandler()})

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def save(self, step: int, state, meta: dict) -> None:
    """Writes ``state`` (a pytree of arrays) and ``meta`` (JSON) for ``step``, replacing a
    checkpoint of the same step."""
    if step in self.manager.all_steps():
      self.manager.delete(step)
    meta = {**meta, "checksum": state_checksum(state)}
    meta["meta_checksum"] = meta_checksum(meta)
    _ORBAX_LOG.saving += 1
    try:  # a Ctrl-C meanwhile stops the run once this is written (orbax's threads done)
      with interrupt.uninterrupted(), _reads_finish_before_loops_close():  # quiet, as a read
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
        self.manager.wait_until_finished()
    except Exception as e:
      raise OSError(f"could not save checkpoint step {step} in {self.directory} "
                    f"({_short(e)}); the checkpoints before it are intact") from e
    finally:
      _ORBAX_LOG.saving -= 1

  def restore(self, abstract_state, step: int | None = None, *, names=None):
    """``(state, meta)`` of ``step``, shaped like ``abstract_state``; by default the newest
    intact checkpoint (corrupt newer ones are set aside with a warning). ``names``: of
    ``abstract_state``'s leaves, in order, for a mismatch's message."""
    if step is not None:
      return self._restore(abstract_state, step, names)
    steps = self.steps()
    if not steps:
      raise FileNotFoundError(f"no checkpoint in {self.directory} to resume from")
    bad = []
    for step in reversed(steps):
      try:
        out = self._restore(abstract_state, step, names)
      except StateMismatchError:
        raise
      except Exception as e:  # noqa: BLE001 - any failure to read is a corrupt checkpoint
        bad.append((step, _short(e)))
        continue
      for b, reason in bad:
        print(f"warning: checkpoint step {b} in {self.directory} is corrupt ({reason}); "
              f"renamed it {b}.corrupt and resumed from step {step} instead",
              file=sys.stderr, flush=True)
        self._set_aside(b)
      self._warn_unreadable_metadata(step)
      return out
    raise NoIntactCheckpointError(
        f"no intact checkpoint in {self.directory}: steps "
        f"{', '.join(str(b) for b, _ in bad)} are all unreadable (newest: {bad[0][1]})")

  def read_meta(self, step: int) -> dict:
    """The JSON metadata of ``step`` alone ({} when unreadable)."""
    try:
      with _reads_finish_before_loops_close():
        meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
      return meta["meta"] if isinstance(meta["meta"], dict) else {}
    except Exception:  # noqa: BLE001
      return {}

  def _restore(self, abstract_state, step: int, names=None):
    with _reads_finish_before_loops_close():
      self._check_shapes(abstract_state, step, names)
      target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
      out = self.manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
    state, meta = out["state"], out["meta"]
    if not isinstance(meta, dict) or meta.get("step") != step:
      raise ValueError(f"metadata {meta!r:.60} is not that of step {step}")
    if "checksum" in meta and state_checksum(state) != meta["checksum"]:
      raise ValueError("the arrays read back fail the checksum")
    if "meta_checksum" in meta and meta_checksum(meta) != meta["meta_checksum"]:
      raise ValueError("the metadata (step, data position, config) fails its checksum")
    return state, meta

  def _check_shapes(self, abstract_state, step: int, names=None) -> None:
    """StateMismatchError when the stored arrays' structure, shapes or dtypes differ
    (``names``: of ``abstract_state``'s leaves, for the message)."""
    try:
      stored = self.manager.item_metadata(step)["state"]
      stored = jax.tree.leaves(getattr(stored, "tree", stored),
                               is_leaf=lambda x: hasattr(x, "shape"))
      stored = [(tuple(m.shape), _dtype_name(m.dtype)) for m in stored]
    except Exception:  # noqa: BLE001 - unreadable metadata: restore reports the corruption
      return
    if not stored:
      return
    wanted = [(tuple(x.shape), _dtype_name(x.dtype)) for x in jax.tree.leaves(abstract_state)]
    if len(stored) != len(wanted):
      detail = f"{len(stored)} arrays stored, {len(wanted)} expected"
      stored_names = self.read_meta(step).get("names")
      if names and stored_names:  # which arrays: those the other side lacks
        ours, theirs = set(names), set(stored_names)
        detail += (f"; only in the checkpoint: {_few([n for n in stored_names if n not in ours])}"
                   f"; only in this run: {_few([n for n in names if n not in theirs])}")
      raise StateMismatchError(step, detail)
    for i, (s, w) in enumerate(zip(stored, wanted)):
      if s != w:
        name = names[i] if names else f"array {i}"
        raise StateMismatchError(step, f"{name} is {s[1]}{list(s[0])} in the checkpoint, "
                                       f"{w[1]}{list(w[0])} in this run")

  def _warn_unreadable_metadata(self, step: int) -> None:
    """One warning when orbax could not parse the restored step's ``_CHECKPOINT_METADATA``
    (absl's ERROR lines for it are filtered): the arrays and our metadata passed their
    checks, so the resume goes on; the next save writes a fresh one."""
    path = os.path.join(self.directory, str(step), "_CHECKPOINT_METADATA")
    if path in _ORBAX_LOG.files:
      _ORBAX_LOG.files.discard(path)
      print(f"warning: {path} (orbax's save time and handler names) is unreadable; the "
            f"arrays and metadata of step {step} passed their checksum, so the run resumes "
            "from it", file=sys.stderr, flush=True)

  def _set_aside(self, step: int) -> None:
    """Renames a corrupt step folder so orbax no longer sees it (kept for inspection)."""
    src = os.path.join(self.directory, str(step))
    dst = src + ".corrupt"
    n = 1
    while os.path.exists(dst):
      n += 1
      dst = f"{src}.corrupt{n}"
    try:
      os.rename(src, dst)
    except OSError:
      return
    self.manager.reload()

  def close(self) -> None:
    self.manager.close()
