"""The fine-tuning loop: one jitted optax step, eval, checkpoints, logging, profiling.

The model is split into the trainable parameters, everything else, and a graph
definition; the train state is the pytree ``{"step", "params", "rest", "opt"}``. The
step (donated state) computes loss and gradients, accumulating over ``grad_accum``
micro-batches with ``lax.scan``, applies the optax update, and keeps the old state when
the loss or gradient is not finite so the last good state can be saved.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import json
import math
import os
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from lowmem_jax.memory import MiB, StepMemory, compiled_memory
from lowmem_jax.policy import MemoryPolicy
from models import lora, sites
from train import data as data_lib
from train import runs, sharding
from train.checkpoint import Checkpoints, StateMismatchError
from train.config import TrainConfig, config_diff

# ----------------------------------------------------------------------------- model
from train.model import (PRESET_FAMILIES, _preset_family, build_model, model_config,  # noqa: F401
                         resolve_path, trainable_filter)


# ----------------------------------------------------------------------------- optimiser
def make_schedule(cfg: TrainConfig):
  if cfg.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, max(cfg.warmup_steps, 1),
                                              max(cfg.steps, cfg.warmup_steps + 1))
  after = (optax.linear_schedule(cfg.lr, 0.0, max(cfg.steps - cfg.warmup_steps, 1))
           if cfg.schedule == "linear" else optax.constant_schedule(cfg.lr))
  warmup = optax.linear_schedule(0.0, cfg.lr, max(cfg.warmup_steps, 1))
  return optax.join_schedules([warmup, after], [cfg.warmup_steps])


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  schedule = make_schedule(cfg)
  if cfg.optimizer == "adamw":
    opt = optax.adamw(schedule, weight_decay=cfg.weight_decay)
  else:
    opt = optax.sgd(schedule, momentum=0.9)
  return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), opt) if cfg.grad_clip else opt


# ----------------------------------------------------------------------------- losses
def loss_and_metrics(model, batch: dict, task: str):
  """Mean loss over the counted examples/tokens and (loss_sum, correct, count)."""
  if task == "image":
    logits, labels = model(batch["image"]), batch["label"]
    weights = jnp.ones(labels.shape, jnp.float32)
  elif task == "text":
    logits, labels = model(batch["tokens"], batch["mask"]), batch["label"]
    weights = jnp.ones(labels.shape, jnp.float32)
  else:
    logits, labels = model(batch["tokens"]), batch["targets"]
    weights = batch["loss_mask"].astype(jnp.float32)
  losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
  count = jnp.maximum(weights.sum(), 1.0)
  correct = jnp.sum((jnp.argmax(logits, -1) == labels) * weights)
  loss_sum = jnp.sum(losses * weights)
  return loss_sum / count, (loss_sum, correct, weights.sum())


# ----------------------------------------------------------------------------- state & steps
def matmul_precision(name: str):
  """Decorator: trace ``fn`` under ``jax.default_matmul_precision(name)`` ("default":
  leave JAX's setting alone). Around the whole step, so the backward of every op, our
  custom_vjp rules included, is traced under it too (they trace after the forward)."""
  def wrap(fn):
    if name == "default":
      return fn

    @functools.wraps(fn)
    def traced(*args):
      with jax.default_matmul_precision(name):
        return fn(*args)
    return traced
  return wrap


@dataclasses.dataclass
class Trainer:
  """Everything the loop needs: the split model, optimizer, jitted steps."""
  cfg: TrainConfig
  graphdef: object
  tx: optax.GradientTransformation
  state: dict
  mesh: object = None

  @classmethod
  def create(cls, cfg: TrainConfig, model=None) -> "Trainer":
    model = build_model(cfg) if model is None else model
    graphdef, params, rest = nnx.split(model, trainable_filter(cfg), ...)
    if not jax.tree.leaves(params):
      raise ValueError(f"trainable={cfg.trainable!r} leaves no parameter to train")
    tx = make_optimizer(cfg)
    state = {"step": jnp.zeros((), jnp.int32), "params": params, "rest": rest,
             "opt": tx.init(params)}
    mesh = sharding.make_mesh(cfg.mesh)
    if mesh is not None:
      state = sharding.shard_state(state, mesh)
    return cls(cfg, graphdef, tx, state, mesh)

  @functools.cached_property
  def train_step(self):
    cfg, graphdef, tx = self.cfg, self.graphdef, self.tx
    trainable = trainable_filter(cfg)

    def grads_of(params, rest, batch):
      """Loss, metrics, gradients and ``rest`` as the forward left it (site state)."""
      batch = dict(batch)
      ids = batch.pop("example_id", None)
      # WTA-CRS gradient-norm caches: differentiated only to read back, per example,
      # the squared output-gradient norms (see lowmem_jax.sampling.wta_crs_linear)
      caches = nnx.state(nnx.merge(graphdef, params, rest, copy=True), sites.GradNormCache)
      use_caches = ids is not None and bool(jax.tree.leaves(caches))

      def loss_fn(p, caches):
        # copy=True: fresh Variables at this trace level, so sites may update them
        model = nnx.merge(graphdef, p, rest, copy=True)
        if use_caches:
          nnx.update(model, caches)
          sites.set_example_ids(model, ids)
        loss, aux = loss_and_metrics(model, batch, cfg.task)
        return loss, (aux, nnx.split(model, trainable, ...)[2])

      (loss, (aux, rest)), (grads, cache_grads) = jax.value_and_grad(
          loss_fn, argnums=(0, 1), has_aux=True)(params, caches)
      if use_caches:
        model = nnx.merge(graphdef, params, rest, copy=True)
        nnx.update(model, jax.tree.map(sites.update_grad_norms, caches, cache_grads))
        rest = nnx.split(model, trainable, ...)[2]
      return loss, aux, grads, rest

    @matmul_precision(cfg.precision)
    def step(state, batch):
      params, rest = state["params"], state["rest"]
      if cfg.grad_accum == 1:
        loss, aux, grads, rest = grads_of(params, rest, batch)
      else:  # scan over micro-batches: activations of one micro-batch at a time
        micro = jax.tree.map(lambda x: x.reshape((cfg.grad_accum, -1) + x.shape[1:]), batch)

        def body(carry, mb):
          acc, rest = carry
          loss, aux, grads, rest = grads_of(params, rest, mb)
          return (jax.tree.map(jnp.add, acc, (loss, aux, grads)), rest), None

        zeros = jax.tree.map(jnp.zeros_like, (jnp.float32(0), (jnp.float32(0),) * 3, params))
        ((loss, aux, grads), rest), _ = jax.lax.scan(body, (zeros, rest), micro)
        loss, grads = loss / cfg.grad_accum, jax.tree.map(lambda g: g / cfg.grad_accum, grads)
      grad_norm = optax.tree.norm(grads)
      updates, opt = tx.update(grads, state["opt"], params)
      new = {"step": state["step"] + 1, "params": optax.apply_updates(params, updates),
             "rest": rest, "opt": opt}  # rest: site state (Mesa ranges, keys) updated
      finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
      new = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, state)
      return new, {"loss": loss, "grad_norm": grad_norm, "finite": finite,
                   "correct": aux[1], "count": aux[2]}

    return jax.jit(step, donate_argnums=0)

  @functools.cached_property
  def eval_step(self):
    cfg, graphdef = self.cfg, self.graphdef

    @matmul_precision(cfg.precision)
    def step(params, rest, batch):
      return loss_and_metrics(nnx.merge(graphdef, params, rest), batch, cfg.task)[1]

    return jax.jit(step)

  def put(self, batch: dict) -> dict:
    if self.mesh is not None:
      return sharding.shard_batch(batch, self.mesh)
    return {k: jnp.asarray(v) for k, v in batch.items()}

  def compiled_memory(self, batch) -> StepMemory:
    """Compiled memory of this very train step (temp, arguments, total...)."""
    return compiled_memory(self.train_step.lower(self.state, batch).compile())

  def evaluate(self, batches) -> dict:
    loss = correct = count = 0.0
    for batch in batches:
      # a last partial batch that the mesh cannot split runs unsharded
      b = (self.put(batch) if self.mesh is None or _divisible(batch, self.mesh)
           else {k: jnp.asarray(v) for k, v in batch.items()})
      l, c, n = jax.device_get(self.eval_step(self.state["params"], self.state["rest"], b))
      loss, correct, count = loss + float(l), correct + float(c), count + float(n)
    return {"eval_loss": loss / max(count, 1), "eval_accuracy": correct / max(count, 1)}

  # checkpoint helpers: the state as a list of leaves, restored into this structure
  def save(self, ckpt: Checkpoints, batches, extra: dict | None = None) -> None:
    step = int(self.state["step"])
    meta = {"step": step, "data": batches.state(), "config": _jsonable(self.cfg)}
    ckpt.save(step, {"leaves": jax.tree.leaves(self.state)}, {**meta, **(extra or {})})

  def restore(self, ckpt: Checkpoints, batches) -> dict:
    """Loads the newest intact checkpoint into the state and ``batches``; its metadata."""
    leaves, treedef = jax.tree.flatten(self.state)
    restored, meta = ckpt.restore({"leaves": leaves})
    self.state = jax.tree.unflatten(treedef, restored["leaves"])
    if self.mesh is not None:
      self.state = sharding.shard_state(self.state, self.mesh)
    batches.restore(meta["data"])
    return meta


def _divisible(batch, mesh) -> bool:
  size = math.prod(mesh.shape.values())
  return all(v.shape[0] % size == 0 for v in batch.values())


def _jsonable(cfg: TrainConfig) -> dict:
  return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


# ----------------------------------------------------------------------------- data
def make_datasets(cfg: TrainConfig, model=None):
  """(train dataset, eval dataset or None) for the config's task. Class labels are checked
  against the model's ``num_labels`` (``model`` given, or the preset's); string labels and
  class folders map to ids from the training set, which the eval set reuses."""
  model_cfg = getattr(model, "cfg", None)
  if cfg.task == "image":
    if model_cfg is None:  # the image size of the model
      model_cfg = model_config(cfg)
    num_labels = getattr(model_cfg, "num_labels", None)
    if cfg.data == "digits":
      if num_labels is not None and num_labels < data_lib.DIGITS_NUM_CLASSES:
        raise ValueError(f"data=digits has {data_lib.DIGITS_NUM_CLASSES} classes but the model "
                         f"has num_labels={num_labels}; set model.num_labels="
                         f"{data_lib.DIGITS_NUM_CLASSES}")
      return data_lib.digits("train", seed=cfg.seed), data_lib.digits("test", seed=cfg.seed)
    folder = functools.partial(data_lib.image_folder, image_size=model_cfg.image_size,
                               channels=model_cfg.channels, num_labels=num_labels)
    train = folder(cfg.data)
    test = None if cfg.eval_data is None else folder(
        cfg.eval_data, class_names=train.class_names, class_names_from=cfg.data)
    return train, test
  tokenizer = cfg.tokenizer or (os.path.join(resolve_path(cfg.pretrained), "tokenizer.json")
                                if cfg.pretrained else None)
  if tokenizer is None:
    raise ValueError(f"task={cfg.task!r} needs tokenizer=<tokenizer.json> or pretrained=<dir>")
  if cfg.task == "lm":
    load = functools.partial(data_lib.causal_lm, tokenizer=tokenizer, max_len=cfg.max_len)
    return load(cfg.data), (None if cfg.eval_data is None else load(cfg.eval_data))
  num_labels = (getattr(model_cfg, "num_labels", None) if model_cfg is not None
                else cfg.model_overrides.get("num_labels"))
  load = functools.partial(data_lib.text_classification, tokenizer=tokenizer,
                           max_len=cfg.max_len, num_labels=num_labels)
  train = load(cfg.data)
  test = None if cfg.eval_data is None else load(
      cfg.eval_data, label_names=train.class_names, label_names_from=cfg.data,
      int_labels=train.class_names is None)
  return train, test


# ----------------------------------------------------------------------------- the loop
class Log:
  """Progress line on stderr, metrics as JSON lines, and TensorBoard scalars when
  ``tensorboardX`` is installed (``<out_dir>/tensorboard``)."""

  def __init__(self, path: Path, total: int, unit: str, start: int = 0):
    path.parent.mkdir(parents=True, exist_ok=True)
    _truncate_metrics(path, start)
    self.file, self.total, self.unit = open(path, "a"), total, unit
    try:
      from tensorboardX import SummaryWriter
      # purge_step: TensorBoard drops the old run's scalars from the resumed step on
      self.tensorboard = SummaryWriter(str(path.parent / "tensorboard"),
                                       purge_step=start + 1 if start else None)
    except ImportError:
      self.tensorboard = None

  def write(self, record: dict) -> None:
    self.file.write(json.dumps(record) + "\n")
    self.file.flush()
    if self.tensorboard is not None and "step" in record:
      for key, value in record.items():
        if key != "step" and isinstance(value, (int, float)):
          self.tensorboard.add_scalar(key, value, record["step"])

  def progress(self, step, loss, steps_per_s, items_per_s) -> None:
    width = 24
    done = int(width * step / self.total)
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {step}/{self.total} "
                     f"loss {loss:.4f} | {steps_per_s:.2f} steps/s | "
                     f"{items_per_s:.0f} {self.unit}/s ")
    sys.stderr.flush()

  def close(self):
    sys.stderr.write("\n")
    self.file.close()
    if self.tensorboard is not None:
      self.tensorboard.close()


def _metric_records(path: Path):
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


def _truncate_metrics(path: Path, start: int) -> None:
  """Drops the records a run resumed at step ``start`` writes again: every record past
  ``start``, and events (the memory report) at ``start``. A fresh run starts empty."""
  if not path.exists():
    return
  kept = [line + "\n" for line, record in _metric_records(path)
          if isinstance(record.get("step"), int)
          and (record["step"] < start or (record["step"] == start and "event" not in record))]
  tmp = path.with_suffix(".tmp")
  tmp.write_text("".join(kept))
  os.replace(tmp, path)


def _mib(b):
  return f"{b / MiB:.1f} MiB"


def print_memory(trainer: Trainer, batch, cfg: TrainConfig) -> dict:
  """Compiled memory of the step (predicts an OOM before it happens), beside baseline's."""
  ours = trainer.compiled_memory(batch)
  report = {"policy": MemoryPolicy.parse(cfg.policy).spec, **ours.as_dict()}
  line = (f"compiled step memory [{report['policy']}]: temp {_mib(ours.temp)}, "
          f"arguments {_mib(ours.argument)}, total {_mib(ours.total)}")
  if cfg.compare_baseline and MemoryPolicy.parse(cfg.policy) != MemoryPolicy():
    base_cfg = cfg.replace(policy="baseline", resume=False)
    model = nnx.eval_shape(lambda: build_model(base_cfg, load_weights=False))
    base = Trainer.create(base_cfg, model)
    mem = base.compiled_memory(batch)
    report["baseline"] = mem.as_dict()
    line += (f"\n                       [baseline]: temp {_mib(mem.temp)}, arguments "
             f"{_mib(mem.argument)}, total {_mib(mem.total)}  (ours/baseline temp "
             f"{ours.temp / max(mem.temp, 1):.3f}, total {ours.total / max(mem.total, 1):.3f})")
  print(line, flush=True)
  return report


def train(cfg: TrainConfig) -> dict:
  """Runs the loop; returns the final metrics."""
  if cfg.distributed:
    jax.distributed.initialize()
  if cfg.batch_size % cfg.grad_accum:
    raise ValueError(f"batch_size {cfg.batch_size} is not a multiple of grad_accum "
                     f"{cfg.grad_accum}")
  # the run folder; refuses to write over a run before any work
  cfg = runs.prepare(cfg, primary=jax.process_index() == 0)
  out = Path(cfg.out_dir)
  model = build_model(cfg)
  train_set, eval_set = make_datasets(cfg, model)
  batches = data_lib.Batches(train_set, cfg.batch_size, seed=cfg.seed,
                             example_ids=cfg.grad_norm_cache)
  if cfg.grad_norm_cache and not sites.attach_grad_norm_caches(
      model, len(train_set), cfg.batch_size // cfg.grad_accum):
    raise ValueError(f"grad_norm_cache=true needs sampled linears, but policy "
                     f"{cfg.policy!r} samples none (use wta-crs)")
  trainer = Trainer.create(cfg, model)
  ckpt = Checkpoints(out / "checkpoints")
  start = 0
  if cfg.resume and ckpt.latest_step() is not None:
    start = _resume(trainer, ckpt, batches, cfg)
    if start >= cfg.steps:
      ckpt.close()
      print(f"nothing to do: the run in {out} already finished at step {start} "
            f"(steps={cfg.steps}); pass --set steps=N with N > {start} to train further",
            flush=True)
      return _finished_result(out / "metrics.jsonl", start)
    print(f"resumed from step {start} ({ckpt.directory})", flush=True)
  if jax.process_index() == 0:
    (out / "config.json").write_text(json.dumps(_jsonable(cfg), indent=1) + "\n")
  log = Log(out / "metrics.jsonl", cfg.steps, "tokens" if cfg.task == "lm" else "examples",
            start)
  first = trainer.put(_peek(batches))
  memory = print_memory(trainer, first, cfg)
  log.write({"event": "memory", "step": start, **memory})
  metrics, final, schedule = {}, {}, make_schedule(cfg)
  t0, t_items, last_step = time.perf_counter(), 0, start
  for step in range(start + 1, cfg.steps + 1):
    if cfg.profile_dir and step == cfg.profile_start:
      jax.profiler.start_trace(cfg.profile_dir)
    batch = trainer.put(next(batches))
    trainer.state, metrics = trainer.train_step(trainer.state, batch)
    if cfg.profile_dir and step == cfg.profile_stop:
      jax.block_until_ready(trainer.state)
      jax.profiler.stop_trace()
    if step == start + 1 and cfg.memory_profile:
      jax.block_until_ready(trainer.state)
      jax.profiler.save_device_memory_profile(cfg.memory_profile)
    t_items += int(np.prod(batch[next(iter(batch))].shape[:2 if cfg.task == "lm" else 1]))
    if not bool(metrics["finite"]):
      good = int(trainer.state["step"])
      saved = f"is saved in {ckpt.directory}"
      try:  # a periodic save may hold that step already: keep it (its data position)
        if good not in ckpt.steps():
          trainer.save(ckpt, batches, {"reason": "non-finite"})
      except Exception as e:  # noqa: BLE001 - the NaN is the message, the save a footnote
        saved = f"could not be saved ({type(e).__name__}: {str(e)[:80]})"
      log.close()
      ckpt.close()
      raise FloatingPointError(
          f"non-finite loss or gradient at step {step} (loss {float(metrics['loss'])}, "
          f"grad norm {float(metrics['grad_norm'])}); the last good state (step {good}) "
          f"{saved}")
    if step % cfg.log_every == 0 or step == cfg.steps:
      loss = float(metrics["loss"])
      dt = time.perf_counter() - t0
      record = {"step": step, "loss": loss, "grad_norm": float(metrics["grad_norm"]),
                "lr": float(schedule(step - 1)),
                "steps_per_s": (step - last_step) / dt, "items_per_s": t_items / dt}
      if jax.default_backend() == "gpu":
        record["peak_bytes_in_use"] = jax.devices()[0].memory_stats().get("peak_bytes_in_use")
      log.write(record)
      log.progress(step, loss, record["steps_per_s"], record["items_per_s"])
      t0, t_items, last_step = time.perf_counter(), 0, step
    if eval_set is not None and cfg.eval_every and (step % cfg.eval_every == 0
                                                     or step == cfg.steps):
      final = {"step": step, **trainer.evaluate(
          data_lib.Batches(eval_set, cfg.eval_batch_size, shuffle=False,
                           drop_last=False).epoch_batches())}
      log.write(final)
      sys.stderr.write(f"\n  eval @ {step}: loss {final['eval_loss']:.4f}, "
                       f"accuracy {final['eval_accuracy']:.4f}\n")
    if cfg.save_every and step % cfg.save_every == 0 and step != cfg.steps:
      trainer.save(ckpt, batches)
  trainer.save(ckpt, batches)
  log.close()
  ckpt.close()
  if cfg.export_dir:
    from models import hf
    model = lora.strip_lora(nnx.merge(trainer.graphdef, trainer.state["params"],
                                      trainer.state["rest"]))
    hf.save_pretrained(model, cfg.export_dir)
    print(f"exported HF safetensors to {cfg.export_dir}", flush=True)
  result = {"step": int(trainer.state["step"]), "loss": float(metrics.get("loss", np.nan)),
            **{k: v for k, v in final.items() if k != "step"}, "memory": memory}
  return result


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
  diff = config_diff(meta.get("config", {}), cfg)
  if diff:
    print(f"warning: resuming with a config that differs from the checkpoint's (step {step}): "
          + "; ".join(diff), file=sys.stderr, flush=True)
  return step


def _finished_result(metrics: Path, step: int) -> dict:
  """The result of a finished run, read back from its metrics.jsonl."""
  result = {"step": step, "loss": float("nan")}
  for _, record in _metric_records(metrics):
    if record.get("step", step + 1) <= step:
      if "loss" in record:
        result["loss"] = record["loss"]
      result.update({k: v for k, v in record.items() if k.startswith("eval_")})
  return result


def _peek(batches: data_lib.Batches) -> dict:
  """The next batch without advancing the iterator (for compiling before step 1)."""
  state = batches.state()
  batch = next(batches)
  batches.restore(state)
  return batch
