"""The run: its folder, resume, the step loop with its log/eval/save boundaries, export.

Steps are dispatched without reading anything back; the host waits for the device only at a
boundary (a log, eval or save step, and the last), where it first reads the trainer's
``first_bad``: a non-finite step anywhere since the last boundary stops the run there with
that step's number and values, the last good state saved (see ``train.trainer``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowmem_jax import cli_checks
from lowmem_jax.memory import write_json
from lowmem_jax.policy import MemoryPolicy
from models import lora, sites
from train import (interrupt, kernel_time, loss_scale, planner, pretrained_record, runs,
                   sharding)
from train.batches import Batches, batch_items
from train.checkpoint import Checkpoints, StateMismatchError
from train.config import INPUT_FIELDS, TrainConfig, config_diff
from train.datasets import check_for_run, make_datasets
from train.images import pixel_normalization
from train.memory_report import print_memory
from train.metrics import Log, finished_result
from train.model import (build_model, model_config, model_family, resolve_path,
                         split_trainable, trainable_filter)
from train.optim import make_schedule, warmup_warning
from train.tokenize import configured_eos, load_tokenizer, special_token_ids
from train.trainer import Trainer


def train(cfg: TrainConfig) -> dict:
  """Runs the loop; returns the final metrics."""
  if cfg.distributed and not jax.distributed.is_initialized():  # once a process
    try:
      jax.distributed.initialize()
    except (ValueError, RuntimeError) as e:  # no cluster found (a resume on one machine)
      raise ValueError(f"distributed=true: jax.distributed.initialize() failed "
                       f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); outside "
                       "a cluster set distributed=false to run on this machine alone") from None
  cache = use_compile_cache(cfg.compile_cache)
  if cache != os.path.expanduser(cfg.compile_cache):  # JAX_COMPILATION_CACHE_DIR's: say so
    cfg = cfg.replace(compile_cache=cache)
  budget = on_every_host(lambda: _checked(cfg))
  # what out_dir held before: a run that fails before its first step leaves it as it was
  existed = cfg.out_dir is not None and Path(cfg.out_dir).exists()
  held_run = existed and runs.holds_run(cfg.out_dir)
  had = {n for n in runs.ARTIFACTS if existed and Path(cfg.out_dir, n).exists()}
  # the run folder; refuses to write over a run before any work (checked on the first
  # host, then every host told)
  cfg = on_every_host(lambda: runs.prepare(cfg, primary=jax.process_index() == 0))
  # Ctrl-C: in the steps saved, then stopped (one host: all would have to stop together)
  ctrl_c = interrupt.InterruptHandler(enabled=jax.process_count() == 1)
  try:
    with ctrl_c:
      return _run(cfg, budget, ctrl_c)
  except BaseException as e:
    if not existed:  # a run that failed before its first step leaves no folder behind
      (runs.remove_if_empty if isinstance(e, KeyboardInterrupt) else runs.remove_unstarted)(
          Path(cfg.out_dir))
    elif not (held_run or isinstance(e, KeyboardInterrupt)):
      # a folder made beforehand that held no run: its own files kept, the run's removed
      runs.remove_unstarted(Path(cfg.out_dir), keep=had)
    out = Path(cfg.out_dir)
    runs.release_claim(out)  # a folder that existed: as it was, if nothing was written
    if isinstance(e, KeyboardInterrupt) and runs.holds_run(out):
      # where it continues: the run's own config.json (train.runs.resumed_config); without
      # a checkpoint the same command starts it again at step 0 (the folder holds a run:
      # the command that started it would be refused there)
      again = f"python -m train --out-dir {shlex.quote(str(out))} --resume"
      e.add_note(f"continue from the last checkpoint with: {again}" if runs.has_checkpoint(out)
                 else f"no checkpoint was saved; start the run again at step 0, with its "
                      f"config.json, with: {again}")
    raise


def _run(cfg: TrainConfig, budget: int | None, ctrl_c: interrupt.InterruptHandler) -> dict:
  """The run in its prepared folder ``cfg.out_dir``: data, model, trainer, resume, steps."""
  out = Path(cfg.out_dir)
  # the checkpoint's fingerprint before the model reads it; written with config.json
  record = pretrained_record.take(cfg, out, resuming=cfg.resume and runs.has_checkpoint(out))
  plan = kept = None
  if cfg.memory_budget is not None and cfg.resume and runs.has_checkpoint(out):
    kept = _checkpoint_plan(cfg, out)
  # the data first, checked against the model's shapes (a bad line is found before a 7B
  # checkpoint is read), then the plan, then the model
  train_set, eval_set = make_datasets(
      cfg, nnx.eval_shape(lambda: build_model(cfg, load_weights=False)))
  check_for_run(cfg, train_set, eval_set)
  if cfg.memory_budget is None:
    model = _built(cfg)
  else:
    cfg, plan = (kept, None) if kept is not None else _plan(cfg, train_set, eval_set,
                                                            budget)
    model = build_model(cfg)
  _say_dropout(cfg, model)
  ctrl_c.check()
  batches = Batches(train_set, cfg.batch_size, seed=cfg.seed, example_ids=cfg.grad_norm_cache)
  if cfg.grad_norm_cache and not sites.attach_grad_norm_caches(
      model, len(train_set), cfg.batch_size // cfg.grad_accum):
    raise ValueError(f"grad_norm_cache=true needs sampled linears, but policy "
                     f"{cfg.policy!r} samples none (use wta-crs)")
  trainer = Trainer.create(cfg, model)
  if cfg.overwrite and jax.process_index() == 0:  # every check has passed: replace it now
    runs.delete_previous(out)
  # closed however the run ends (orbax's and tensorboard's threads, left running at an
  # interrupt, crashed the interpreter's exit)
  with contextlib.closing(Checkpoints(out / "checkpoints",
                                      max_to_keep=cfg.keep_checkpoints)) as ckpt:
    return _train_steps(cfg, out, trainer, ckpt, batches, eval_set, plan, record, ctrl_c)


def _train_steps(cfg: TrainConfig, out: Path, trainer: Trainer, ckpt: Checkpoints,
                 batches: Batches, eval_set, plan, record: dict | None,
                 ctrl_c: interrupt.InterruptHandler) -> dict:
  """Resume (if asked), the steps with their log, eval and save boundaries, the export."""
  start = 0
  ctrl_c.check()
  labels = getattr(batches.dataset, "class_names", None)  # the class of each label id
  if cfg.resume and ckpt.latest_step() is not None:
    _check_labels(out, labels)
    start = _resume(trainer, ckpt, batches, cfg)
    ctrl_c.check()
    if start >= cfg.steps:
      print(f"nothing to train: the run in {out} already finished at step {start} "
            f"(steps={cfg.steps}); pass --set steps=N with N > {start} to train further",
            flush=True)
      export(trainer, cfg, labels)  # --resume --export: the finished run's weights
      return finished_result(out / "metrics.jsonl", start)
    if cfg.export_dir and export_reads_pretrained(cfg):  # before training, not at its end
      pretrained_record.check_unchanged(cfg, out)
    print(f"resumed from step {start} ({ckpt.directory})", flush=True)
  if jax.process_index() == 0:
    # each whole or not at all: a kill while writing left a file that refused --resume
    write_json(str(out / "config.json"), cfg.record(), announce=False)
    if labels is not None:  # which class each id is: the export's names, a resume's check
      write_json(str(out / runs.LABELS_FILE), list(labels), announce=False)
    if record is not None:
      pretrained_record.write(out, record)
  with contextlib.ExitStack() as closing:  # however the steps end
    log = closing.enter_context(contextlib.closing(Log(
        out / "metrics.jsonl", cfg.steps, "tokens" if cfg.task == "lm" else "examples", start,
        enabled=jax.process_index() == 0)))  # one host writes the run's log
    memory = print_memory(trainer, trainer.put(batches.peek()), cfg)
    log.write({"event": "memory", "step": start, **memory})
    if plan is not None:
      log.write({"event": "plan", "step": start, "memory_budget": plan.budget,
                 "policy": plan.chosen.policy, "grad_accum": plan.chosen.grad_accum,
                 "predicted_peak": plan.chosen.peak, "planning_s": plan.seconds,
                 "eval_batch_size": plan.eval_batch_size,
                 "predicted_eval_peak": plan.eval_peak})
    metrics, final, schedule = {}, {}, make_schedule(cfg)
    # the data position after each step since the last boundary: a save of that step's state
    # resumes there
    data_after = {start: batches.state()}
    # the speed of a log window counts the steps' time only: what else the host waits for
    # in it (evals, saves, a trace's writing, the memory profile) adds to `paused`
    t0, t_items, last_step, paused = time.perf_counter(), 0, start, 0.0
    trace, tracing = profile_window(cfg, start), False

    def close_open_trace():  # a run stopped in the window (an error, Ctrl-C): its trace kept
      if tracing:
        jax.profiler.stop_trace()
        print(f"\nprofile: the run stopped at step {step}; steps {trace[0]}..{step} traced "
              f"to {cfg.profile_dir}", flush=True)
    closing.callback(close_open_trace)
    ctrl_c.check()
    ctrl_c.in_steps = True  # a Ctrl-C from here on: saved after the step in flight
    for step in range(start + 1, cfg.steps + 1):
      if trace and step == trace[0]:
        jax.block_until_ready(trainer.state)  # no earlier step runs inside the trace
        t = time.perf_counter()  # (the wait was the steps': only the start is paused)
        jax.profiler.start_trace(cfg.profile_dir)
        tracing, trace_t0 = True, time.perf_counter()
        paused += trace_t0 - t
      batch = trainer.put(next(batches))
      data_after[step] = batches.state()
      metrics = trainer.step(batch)
      if trace and step == trace[1]:
        jax.block_until_ready(trainer.state)
        traced_s = time.perf_counter() - trace_t0  # the steps', not the trace's writing
        jax.profiler.stop_trace()
        tracing = False
        profile = traced_time(trainer, cfg.profile_dir, trace, traced_s)
        print(f"\nprofile: steps {trace[0]}..{trace[1]} traced to {cfg.profile_dir}"
              + (f"; {kernel_time.one_line(profile)}" if profile else ""), flush=True)
        if profile:
          log.write({"event": "profile", "step": step, **profile})
        paused += time.perf_counter() - trace_t0 - traced_s
      if step == start + 1 and (plan is not None or cfg.memory_profile):
        jax.block_until_ready(trainer.state)
        t = time.perf_counter()
        if plan is not None:  # the prediction against the real peak
          report = planner.real_peak_report(plan)
          print(report.pop("line"), flush=True)
          log.write({"event": "plan_check", "step": step, **report})
        if cfg.memory_profile:
          jax.profiler.save_device_memory_profile(cfg.memory_profile)
        paused += time.perf_counter() - t
      t_items += batch_items(batch, cfg.task)
      log_now = step % cfg.log_every == 0 or step == cfg.steps
      eval_now = eval_set is not None and cfg.eval_every and (step % cfg.eval_every == 0
                                                              or step == cfg.steps)
      stopping = ctrl_c.requested and step != cfg.steps  # read once: set by a signal
      save_now = stopping or (cfg.save_every and step % cfg.save_every == 0
                              and step != cfg.steps)
      if not (log_now or eval_now or save_now):
        continue  # no value read back: the host runs ahead of the device
      _stop_if_non_finite(trainer, ckpt, data_after)
      data_after = {step: data_after[step]}
      if log_now:
        loss = float(metrics["loss"])
        dt = time.perf_counter() - t0 - paused
        grad_norm = float(metrics["grad_norm"])  # a skipped float16 step's: inf, logged null
        record = {"step": step, "loss": loss,
                  "grad_norm": grad_norm if math.isfinite(grad_norm) else None,
                  "lr": float(schedule(step - 1 - int(metrics.get("skipped_steps", 0)))),
                  "steps_per_s": (step - last_step) / dt, "items_per_s": t_items / dt}
        if "loss_scale" in metrics:  # float16: the scale and the steps skipped so far
          record |= {"loss_scale": float(metrics["loss_scale"]),
                     "skipped_steps": int(metrics["skipped_steps"])}
        if jax.default_backend() == "gpu":
          stats = jax.local_devices()[0].memory_stats()
          record["peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
        log.write(record)
        log.progress(step, loss, record["steps_per_s"], record["items_per_s"])
        t0, t_items, last_step, paused = time.perf_counter(), 0, step, 0.0
      t = time.perf_counter()
      if eval_now:
        final = {"step": step, **trainer.evaluate(
            Batches(eval_set, cfg.eval_batch_size, shuffle=False, drop_last=False)
            .epoch_batches())}
        log.write(final)
        f1 = (f", macro-F1 {final['eval_f1_macro']:.4f}" if "eval_f1_macro" in final
              else "")
        sys.stderr.write(f"\n  eval @ {step}: loss {final['eval_loss']:.4f}, "
                         f"accuracy {final['eval_accuracy']:.4f}{f1}\n")
      if save_now:
        trainer.save(ckpt, batches.state())
      paused += time.perf_counter() - t
      if stopping:
        print(f"\ninterrupted: step {step} is saved in {ckpt.directory}", flush=True)
        raise KeyboardInterrupt
    trainer.save(ckpt, batches.state())  # the last step is a boundary: checked above
    ctrl_c.in_steps = False
    ctrl_c.check()  # a Ctrl-C in the last step: saved, stopped before the export
  export(trainer, cfg, labels)
  result = {"step": int(trainer.state["step"]), "loss": float(metrics.get("loss", np.nan)),
            **{k: v for k, v in final.items() if k != "step"}, "memory": memory}
  return result


# a pretrained directory's files that say how to feed the model (HF's tokenizer and image
# processor): an export carries them, so it is a pretrained directory of its own
INPUT_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "vocab.txt", "preprocessor_config.json", "generation_config.json")
TOKENIZER_FILES = INPUT_FILES[:4]  # a tokenizer's own (a run's tokenizer replaces them)


def export_base_config(cfg: TrainConfig) -> TrainConfig | None:
  """The config of the model an export built on the host merges into, where it is not
  the trained model itself: an fp32 base (the run stored its frozen kernels in
  ``base_dtype``), for a LoRA run in the checkpoint's own parametrization (an MS-norm
  policy stores each norm's affine merged into the linears after it; an export of that
  would write norms of 1 and every linear that reads one changed: the same function,
  not the checkpoint's tensors). None: the trained model is the export's base (or the
  run is no LoRA run: a model trained in full under MS norms exports the merged
  parametrization it trained)."""
  if cfg.trainable == "lora":
    policy = MemoryPolicy.parse(cfg.policy)
    if policy.merges_norm_affine:
      return cfg.replace(base_dtype="float32",
                         policy=dataclasses.replace(policy, norm="standard").spec)
  return cfg.replace(base_dtype="float32") if cfg.base_dtype != "float32" else None


def export_reads_pretrained(cfg: TrainConfig) -> bool:
  """Whether :func:`export` reads the pretrained checkpoint again (a LoRA run's merges
  into it; :func:`export_base_config`'s base is read from it), so writes its values."""
  return bool(cfg.pretrained) and (cfg.trainable == "lora"
                                    or export_base_config(cfg) is not None)


def with_export_base(trained, cfg: TrainConfig):
  """``trained`` rebuilt on the host CPU as :func:`export_base_config` says (the seed's
  init, or the pretrained checkpoint read again), with the run's trained parameters put
  in, or ``trained`` itself where that says None. For a LoRA run without a checkpoint
  and a run that froze weights by pattern in a base dtype; a LoRA run from a checkpoint
  streams it instead (:func:`export`)."""
  base_cfg = export_base_config(cfg)
  if base_cfg is None:
    return trained
  with jax.default_device(jax.devices("cpu")[0]):
    model = build_model(base_cfg)
    # on the host as jax arrays (device_get's numpy arrays are read-only)
    nnx.update(model, jax.tree.map(jnp.asarray, jax.device_get(
        nnx.state(trained, trainable_filter(cfg)))))
  return model


def _check_labels(out: Path, labels) -> None:
  """A resumed classifier run's data maps its labels to the ids the run trained with:
  a ValueError naming both where its classes changed (a label added to the data shifts
  the sorted ids), before any step."""
  saved = out / runs.LABELS_FILE
  if labels is None or not saved.is_file():
    return
  try:
    before = json.loads(saved.read_text())
  except (OSError, ValueError) as e:
    raise ValueError(f"{saved}: unreadable ({e}); it names the class of each label id the "
                     "run trained with: put it back, or delete it to resume unchecked") from None
  if before != list(labels):
    raise ValueError(f"the data's classes {list(labels)} are not the ones the run in {out} "
                     f"trained with {before} ({saved}): ids would mean other classes; "
                     "resume with the run's data, or start a new run")


def export(trainer: Trainer, cfg: TrainConfig, labels=None) -> None:
  """Writes the trainer's model as HF safetensors to ``cfg.export_dir``, if set, with the
  pretrained directory's :data:`INPUT_FILES` (the run's ``tokenizer`` in place of the
  checkpoint's where one is set); a classifier's ``labels`` (its class names, by id)
  name its classes in config.json (``id2label``, ``label2id``). A LoRA run from a
  checkpoint is that checkpoint with the adapters merged, in its dtypes, streamed
  (``models.hf.save_lora_merged``: the host holds a shard, not the model); any other
  run's model merged and written whole (:func:`with_export_base`)."""
  if not cfg.export_dir:
    return
  params, rest = trainer.state["params"], trainer.state["rest"]
  if jax.process_count() > 1:  # every host gathers the state (a collective); one writes
    from jax.experimental import multihost_utils
    # a leaf at a time, to host memory: the devices never hold more than one whole leaf
    gather = lambda x: (np.asarray(multihost_utils.process_allgather(x, tiled=True))
                        if isinstance(x, jax.Array) and not x.is_fully_addressable else x)
    params, rest = jax.tree.map(gather, (params, rest))
    if jax.process_index() != 0:
      return
  if cfg.out_dir and export_reads_pretrained(cfg):  # a run's (its record in out_dir)
    pretrained_record.check_unchanged(cfg, Path(cfg.out_dir))
  from models import hf
  model = nnx.merge(trainer.graphdef, params, rest)
  streamed = cfg.trainable == "lora" and cfg.pretrained
  if not streamed:
    model = lora.strip_lora(with_export_base(model, cfg))
  files = {name: os.path.join(resolve_path(cfg.pretrained), name)
           for name in INPUT_FILES} if cfg.pretrained else {}
  tokenizer = resolve_path(cfg.tokenizer) if cfg.tokenizer and cfg.task != "image" else None
  ids = {}  # the run's tokenizer's special ids, where they are not the checkpoint's
  if tokenizer:
    folder = tokenizer if os.path.isdir(tokenizer) else None  # a folder of tokenizer files
    tokenizer = os.path.join(folder, "tokenizer.json") if folder else tokenizer
  # the checkpoint's own tokenizer: the same tokenizer.json and the same end token (which
  # ends the data's texts: train.tokenize.configured_eos)
  eos_name = configured_eos(folder or tokenizer) if tokenizer else None
  own = bool(tokenizer and files) and _same_tokenizer(tokenizer, files["tokenizer.json"]) and (
      eos_name == configured_eos(resolve_path(cfg.pretrained)))
  if tokenizer and not own:
    # another tokenizer than the checkpoint's: its files in place of the directory's, and
    # its special ids in the config (an LM learned to end texts with its eos)
    files = {k: v for k, v in files.items() if k not in TOKENIZER_FILES}
    files.update({name: os.path.join(folder, name) for name in TOKENIZER_FILES} if folder
                 else {"tokenizer.json": tokenizer})
    if cfg.task == "lm":
      ids = special_token_ids(load_tokenizer(tokenizer)[0], eos_name)
      model.cfg = dataclasses.replace(model.cfg, **ids)
  if labels is None and cfg.pretrained and not cfg.new_head:  # the head was read: its names
    labels = hf.checkpoint_labels(resolve_path(cfg.pretrained),
                                  getattr(model.cfg, "num_labels", 0))
  if streamed:
    hf.save_lora_merged(model, cfg.export_dir, resolve_path(cfg.pretrained),
                        new_head=cfg.new_head, labels=labels)
  else:
    hf.save_pretrained(model, cfg.export_dir, labels=labels)
  copied = [name for name, source in files.items() if os.path.isfile(source)]
  for name in copied:  # each whole or not at all, as save_pretrained's files
    target = os.path.join(cfg.export_dir, name)
    text = Path(files[name]).read_bytes()
    if name == "generation_config.json" and ids:  # the same ids as config.json
      text = json.dumps({**json.loads(text), **{k: v for k, v in ids.items()
                                                 if v is not None}}, indent=2).encode()
    Path(target + ".tmp").write_bytes(text)
    os.replace(target + ".tmp", target)
  print(f"exported HF safetensors to {cfg.export_dir}"
        + (f" (with {', '.join(copied)})" if copied else ""), flush=True)


def _same_tokenizer(a: str, b: str) -> bool:
  """Whether two tokenizer.json files hold the same tokenizer: the same bytes, or the
  same content written another way (``save(pretty=False)``); False where either is
  missing or unreadable."""
  if not (os.path.isfile(a) and os.path.isfile(b)):
    return False
  if os.path.samefile(a, b) or Path(a).read_bytes() == Path(b).read_bytes():
    return True
  from tokenizers import Tokenizer
  try:
    return Tokenizer.from_file(a).to_str() == Tokenizer.from_file(b).to_str()
  except Exception:  # noqa: BLE001 - tokenizers raises a bare Exception
    return False


# fp16 has 5 exponent bits: without loss scaling a mean loss's cotangents (1/tokens)
# underflow as the tokens a step grow (llama-tiny, 16 x 1024 tokens: gradients 22% off
# fp32's, scaled 0.23%, bf16's 1.7%; the digits ViT's 64 x 17 tokens train as in bf16)
FLOAT16_WARNING = ("warning: dtype=float16 with loss_scale=none: with many tokens a step "
                   "its gradients underflow (16k tokens: 22% off fp32's); leave loss_scale "
                   "at auto (dynamic under float16), or use bfloat16 (fp32's range)")


def _built(cfg: TrainConfig):
  """The model; on a mesh built in host memory, from where the trainer puts each device
  its share (before: whole on the first device, which FSDP is there to avoid)."""
  if not cfg.mesh:
    return build_model(cfg)
  try:
    host = jax.local_devices(backend="cpu")[0]  # this host's (devices() lists all hosts')
  except RuntimeError:  # JAX_PLATFORMS without cpu
    return build_model(cfg)
  with jax.default_device(host):
    return build_model(cfg)


def _say_dropout(cfg: TrainConfig, model) -> None:
  """The model's dropout rates (BERT/RoBERTa: the checkpoint's, as transformers uses them),
  or a note where the pretrained config.json asks for dropout that the model lacks."""
  from models.hf import dropout_fields
  model_cfg = getattr(model, "cfg", None)
  if hasattr(model_cfg, "hidden_dropout"):
    rates = dict(hidden_dropout=model_cfg.hidden_dropout,
                 attention_dropout=model_cfg.attention_dropout,
                 classifier_dropout=model_cfg.head_dropout)
    if any(rates.values()):
      print(f"dropout: {', '.join(f'{k} {v:g}' for k, v in rates.items())} (backward keeps "
            "its keys, not its masks; --set model.<field>=0 turns one off)", flush=True)
    return
  fields = dropout_fields(resolve_path(cfg.pretrained)) if cfg.pretrained else []
  if fields:
    print(f"note: {cfg.pretrained}'s config.json sets {', '.join(fields)}; this model has "
          "no dropout: this fine-tune runs without it (transformers' would use it)",
          flush=True)


def _checked(cfg: TrainConfig) -> int | None:
  """The checks before any work; the planner's budget or None."""
  if cfg.memory_budget is None and cfg.batch_size % cfg.grad_accum:  # else the plan's
    raise ValueError(f"batch_size {cfg.batch_size} is not a multiple of grad_accum "
                     f"{cfg.grad_accum}")
  check_inputs(cfg)
  warning = None if cfg.resume else warmup_warning(cfg)  # a resume says its schedule's change
  if warning:
    print(warning, file=sys.stderr, flush=True)
  if cfg.dtype == "float16" and cfg.loss_scale == "none":
    print(FLOAT16_WARNING, file=sys.stderr, flush=True)
  # the planner's budget ("auto": the device's memory) checked before any work
  return None if cfg.memory_budget is None else planner.resolve_budget(cfg.memory_budget)


def on_every_host(check):
  """``check()``; on a multi-host run every host then learns whether each one passed, so
  a refusal on one host (the run folder is checked on the first only) stops them all
  with one line, not a collective another host never joins (a hang, or a traceback of
  a timeout)."""
  if jax.process_count() == 1:
    return check()
  try:
    result, error = check(), None
  except Exception as e:  # noqa: BLE001 - raised below, once every host has said
    result, error = None, e
  from jax.experimental import multihost_utils
  failed = np.asarray(multihost_utils.process_allgather(np.array(error is not None)))
  if error is not None:
    raise error
  if failed.any():
    raise ValueError(f"host(s) {np.flatnonzero(failed).tolist()} refused this run (their "
                     "output says why); this host stops too")
  return result


def check_inputs(cfg: TrainConfig) -> None:
  """What can be checked before the run folder is made: that the files and folders the
  config names exist, and the model preset with its overrides (``model.<field>``)."""
  for field in INPUT_FIELDS:
    value = getattr(cfg, field)
    if value is None or value == "digits":
      continue
    try:
      path = resolve_path(value)  # a pkg: that is not installed is an error here
    except ValueError as e:
      raise ValueError(f"{field}={e}") from None
    if not os.path.exists(path):
      raise ValueError(f"{field}={value!r}: no such file or folder")
  if cfg.profile_dir:  # a folder made when written
    problem = cli_checks.folder_problem(cfg.profile_dir)
    if problem:
      raise ValueError(f"profile_dir={cfg.profile_dir!r} {problem}")
  if cfg.export_dir:  # written after the last step: found out now, not then
    from models import hf
    base = resolve_path(cfg.pretrained) if cfg.pretrained else None
    hf.check_export_dir(cfg.export_dir, f"export_dir={cfg.export_dir!r}",
                        base if base and os.path.isdir(base) else None, cfg.out_dir)
  if cfg.memory_profile:  # a file, written after step 1
    parent = os.path.dirname(os.path.abspath(cfg.memory_profile))
    if os.path.isdir(cfg.memory_profile):
      raise ValueError(f"memory_profile={cfg.memory_profile!r} is a folder; name a file")
    if not os.path.isdir(parent):
      raise ValueError(f"memory_profile={cfg.memory_profile!r}: no such folder {parent}")
    if not os.access(parent, os.W_OK | os.X_OK) or (
        os.path.exists(cfg.memory_profile) and not os.access(cfg.memory_profile, os.W_OK)):
      raise ValueError(f"memory_profile={cfg.memory_profile!r}: not writable")
  if cfg.tokenizer and cfg.task != "image":
    load_tokenizer(resolve_path(cfg.tokenizer))  # raises on a file that is no tokenizer
  model_cfg = model_config(cfg)  # the preset's or the pretrained config.json, overridden
  family = model_family(cfg, model_cfg)
  if cfg.task not in family.tasks:
    source = f"pretrained={cfg.pretrained!r}" if cfg.pretrained else f"model={cfg.model!r}"
    raise ValueError(f"task={cfg.task!r}: {source} is a {family.class_name}, which trains "
                     f"for task={' or '.join(family.tasks)}; set task= to match, or pick "
                     "another model")
  if cfg.data == "digits" and cfg.task != "image":  # the default data: images only
    needs = {"text": "a jsonl of {\"text\", \"label\"}",
             "lm": "a .txt, or a jsonl of {\"text\"} or {\"instruction\", \"output\"}"}
    raise ValueError(f"task={cfg.task!r} needs its data: set data=<file> "
                     f"({needs[cfg.task]}); data=digits is images")
  if cfg.export_dir and not family.hf_model_types:
    raise ValueError(f"export_dir={cfg.export_dir!r}: model {cfg.model} ({family.class_name}) "
                     "has no Hugging Face format to export to")
  if cfg.pretrained:  # its tensors' names and shapes, from the file headers
    from models import hf
    hf.check_pretrained(resolve_path(cfg.pretrained), policy=cfg.policy, new_head=cfg.new_head,
                        **cfg.model_overrides)
    if cfg.task == "image":
      pixel_normalization(resolve_path(cfg.pretrained))  # raises on a bad processor file
  elif cfg.new_head:
    raise ValueError("new_head=true replaces a pretrained model's head; set pretrained=<dir>")
  mesh = sharding.make_mesh(cfg.mesh)  # raises when it needs more devices than there are
  devices = math.prod(mesh.shape.values()) if mesh is not None else 1
  if cfg.batch_size % devices:  # each step's batch is split over every device
    raise ValueError(f"batch_size={cfg.batch_size} is not divisible by the {devices} devices "
                     f"of mesh={cfg.mesh!r}")
  micro = cfg.batch_size // cfg.grad_accum
  if micro % devices:  # and so is each micro-batch
    raise ValueError(f"batch_size={cfg.batch_size} / grad_accum={cfg.grad_accum} = {micro} "
                     f"examples per micro-batch, not divisible by the {devices} devices of "
                     f"mesh={cfg.mesh!r}")
  if cfg.eval_batch_size % devices:  # else every eval batch would run whole on each device
    raise ValueError(f"eval_batch_size={cfg.eval_batch_size} is not divisible by the "
                     f"{devices} devices of mesh={cfg.mesh!r} (try "
                     f"{cfg.eval_batch_size - cfg.eval_batch_size % devices or devices})")
  # the model's shapes, nothing materialized or read: the policy's sites take the backend
  # (attention=cudnn off a GPU), the trainable split its parameter paths
  split_trainable(cfg, nnx.eval_shape(lambda: build_model(cfg, load_weights=False)))


def traced_time(trainer: Trainer, folder: str, steps: tuple[int, int],
                wall_s: float) -> dict | None:
  """Where the traced steps' device time went (:func:`train.kernel_time.summarize`, the
  kernels placed by the compiled step's source lines); None when the trace holds no
  device kernels (CPU). The steps' wall time includes feeding their batches, so ``idle``
  is what the input pipeline and the host cost the device."""
  try:  # the trace is written; a summary that cannot be made must not stop the run
    kernels = kernel_time.read_trace(folder)
    if not kernels:
      return None
    compiled = trainer.compiled_step[1] if trainer.compiled_step else None
    where = kernel_time.hlo_sources(compiled.as_text()) if compiled is not None else None
    return kernel_time.summarize(kernels, steps[1] - steps[0] + 1, wall_s, where)
  except Exception as e:  # noqa: BLE001 - any reader failure: the run goes on
    print(f"warning: profile: the trace in {folder} could not be summarized "
          f"({type(e).__name__}: {e})", file=sys.stderr, flush=True)
    return None


def profile_window(cfg: TrainConfig, start: int) -> tuple[int, int] | None:
  """The steps of ``profile_start..profile_stop`` that this run takes (it starts after
  ``start``, ends at ``steps``), or None: no ``profile_dir``, or none of them (said)."""
  if not cfg.profile_dir:
    return None
  first, last = max(cfg.profile_start, start + 1), min(cfg.profile_stop, cfg.steps)
  if first > last:
    print(f"profile: steps {cfg.profile_start}..{cfg.profile_stop} are not among this "
          f"run's steps {start + 1}..{cfg.steps}: no trace (set profile_start/profile_stop)",
          flush=True)
    return None
  return first, last


def use_compile_cache(path: str) -> str:
  """Keeps compiled programs in JAX's persistent cache at ``path`` unless one is set already
  (``JAX_COMPILATION_CACHE_DIR``, ``jax.config``): the same command again, or a resume,
  loads the train step (minutes to compile for a 7B model) rather than compiling it. The
  folder in use ("": none)."""
  if path and not jax.config.jax_compilation_cache_dir:
    from jax.experimental.compilation_cache import compilation_cache
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(path))
    compilation_cache.reset_cache()  # read the new folder even after an earlier compile
  return jax.config.jax_compilation_cache_dir or ""


def _plan(cfg: TrainConfig, train_set, eval_set,
          budget: int) -> tuple[TrainConfig, "planner.Plan"]:
  """Runs the planner for ``budget`` bytes on the first batch's shapes (and, when the run
  evaluates, the eval batch that fits), prints its table; ``cfg`` with the chosen policy,
  grad_accum and eval batch, and the plan."""
  example = Batches(train_set, cfg.batch_size, seed=cfg.seed).peek()
  result = planner.plan(cfg, example, budget, progress=lambda line: print(line, flush=True),
                        predict_eval=(planner.predict_eval_peak
                                      if eval_set is not None and cfg.eval_every else None))
  print(result.table(), result.summary(), sep="\n", flush=True)
  return result.apply(cfg), result


def _checkpoint_plan(cfg: TrainConfig, out: Path) -> TrainConfig:
  """A resumed planned run keeps its plan: ``cfg`` with the policy, grad_accum and eval
  batch of the newest checkpoint in ``out`` that records them (said), not planned again
  (another plan could change the state's arrays, and the run's numerics). A run that was not planned
  keeps its own: a ValueError saying so (a budget added at a resume), before any work."""
  ckpt = Checkpoints(out / "checkpoints")
  try:
    metas = [(step, ckpt.read_meta(step)) for step in reversed(ckpt.steps())]
  finally:
    ckpt.close()
  for step, meta in metas:
    saved = meta.get("config", {})
    if saved.get("memory_budget") is not None and "policy" in saved and "grad_accum" in saved:
      # the eval batch too, where the plan halved it to fit (or it is over the budget)
      eval_batch = saved.get("eval_batch_size", cfg.eval_batch_size)
      print(f"planner: resuming the plan the run chose (policy {saved['policy']}, grad_accum "
            f"{saved['grad_accum']}, eval_batch_size {eval_batch}, checkpoint step {step}); "
            "memory_budget is not planned again (a new run plans afresh)", flush=True)
      if cfg.batch_size % saved["grad_accum"]:
        raise ValueError(f"batch_size {cfg.batch_size} is not a multiple of grad_accum "
                         f"{saved['grad_accum']}, which the run's plan chose and a resume "
                         "keeps; resume with a batch_size it divides, or plan a new run")
      return cfg.replace(policy=saved["policy"], grad_accum=saved["grad_accum"],
                         eval_batch_size=eval_batch)
  saved = metas[0][1].get("config", {}) if metas else {}
  raise ValueError(
      f"memory_budget={cfg.memory_budget}: the run in {out} was not planned (policy "
      f"{saved.get('policy', '?')}, grad_accum {saved.get('grad_accum', '?')}), and a resume "
      "keeps its policy and grad_accum; resume without memory_budget (--set "
      "memory_budget=null), or plan a new run")


def _stop_if_non_finite(trainer: Trainer, ckpt: Checkpoints, data_after: dict) -> None:
  """Waits for the device. After a non-finite step: saves the last good state (the step
  before it, which the step kept) with its data position ``data_after[step]``, unless a
  periodic save holds it already, and raises FloatingPointError naming the bad step."""
  bad = trainer.first_bad_step()
  if bad is None:
    return
  good = int(trainer.state["step"])
  saved = f"is saved in {ckpt.directory}"
  try:  # a periodic save may hold that step already: keep it (its data position)
    if good not in ckpt.steps():
      trainer.save(ckpt, data_after[good], {"reason": "non-finite"})
  except Exception as e:  # noqa: BLE001 - the NaN is the message, the save a footnote
    saved = f"could not be saved ({type(e).__name__}: {str(e)[:80]})"
  scaling = jax.device_get(trainer.state.get("loss_scale"))
  hint = ""
  if scaling is not None and math.isfinite(bad["loss"]) and \
      float(scaling["scale"]) <= loss_scale.MIN_SCALE:
    hint = (f"; float16 gradients overflowed at every loss scale down to "
            f"{loss_scale.MIN_SCALE:g} ({int(scaling['skipped'])} steps skipped so far): "
            "train in bfloat16 (the default) or float32")
  raise FloatingPointError(
      f"non-finite loss or gradient at step {bad['step']} (loss {bad['loss']}, "
      f"grad norm {bad['grad_norm']}); the last good state (step {good}) {saved}{hint}")


def _resume(trainer: Trainer, ckpt: Checkpoints, batches, cfg: TrainConfig) -> int:
  """Restores the newest intact checkpoint; says which config fields changed. The step."""
  try:
    meta = trainer.restore(ckpt, batches)
  except StateMismatchError as e:
    diff = config_diff(ckpt.read_meta(e.step).get("config", {}), cfg)
    raise ValueError(f"cannot resume {ckpt.directory}: {e}; "
                     + (f"config fields that differ from the checkpoint's: {'; '.join(diff)}"
                        if diff else "resume with the config that wrote it")) from None
  step = int(meta["step"])
  saved = meta.get("config", {})
  diff = config_diff(saved, cfg)
  if diff:
    print(f"warning: resuming with a config that differs from the checkpoint's (step {step}): "
          + "; ".join(diff), file=sys.stderr, flush=True)
  schedule_change = _schedule_change(saved, cfg, step)
  if schedule_change:
    print(f"warning: {schedule_change}", file=sys.stderr, flush=True)
  return step


def _schedule_change(saved: dict, cfg: TrainConfig, step: int) -> str | None:
  """What a resume with a new ``steps`` does to the learning rate (the cosine or linear
  schedule is laid over the new total), where that changes the rate the run goes on with;
  ``saved``: the checkpoint's config."""
  old_steps = saved.get("steps")
  if not isinstance(old_steps, int) or old_steps == cfg.steps or step >= cfg.steps:
    return None
  before = cfg.replace(steps=old_steps, **{k: saved[k] for k in ("lr", "warmup_steps",
                                                                 "schedule") if k in saved})
  was, now = (float(make_schedule(c)(step)) for c in (before, cfg))
  if np.isclose(was, now, rtol=1e-3, atol=0):
    return None
  return (f"the {cfg.schedule} learning-rate schedule now ends at step {cfg.steps}, not "
          f"{old_steps}: the learning rate after step {step} is {now:.3g}, not {was:.3g}")
