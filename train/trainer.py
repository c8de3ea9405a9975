"""The train state and the jitted train and eval steps.

The model is split into the trainable parameters, everything else, and a graph
definition; the train state is the pytree ``{"step", "params", "rest", "opt"}`` (what a
checkpoint holds). The step (donated state) computes loss and gradients, accumulating over
``grad_accum`` micro-batches with ``lax.scan``, and applies the optax update.

Non-finite steps without a host sync per step: beside the state the step carries
``first_bad``, the step number, loss and gradient norm of the first step whose loss or
gradient was not finite (step 0: none yet). That step and every step after it leave the
whole state as it was (parameters, site state, optimizer counts, step), so the state stays
the last good one until the host reads ``first_bad`` when it next needs a value anyway.
Under float16 the loss is scaled (``train.loss_scale``): a step whose gradients overflow
is skipped and halves the scale; only one that overflows at the smallest scale stops.

An image batch may carry uint8 codes: both steps make them the model's floats, normalized
as a pretrained model's image processor says, from ``pixel_values`` (a constant of the
steps, :func:`train.images.code_values`), so the host only gathers and copies codes.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from lowmem_jax import gpu_target
from lowmem_jax.memory import StepMemory, compiled_memory
from lowmem_jax.policy import MemoryPolicy
from models import sites
from train import loss_scale, sharding
from train.checkpoint import Checkpoints, StateMismatchError
from train.config import TrainConfig
from train.images import code_values, pixel_normalization
from train.loss import class_f1, confusion_counts, eval_metrics, loss_and_metrics, macro_f1
from train.model import build_model, resolve_path, split_trainable, trainable_filter
from train.optim import make_optimizer


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


def no_bad_step() -> dict:
  """``first_bad`` before any non-finite step: step 0."""
  return {"step": jnp.zeros((), jnp.int32), "loss": jnp.zeros((), jnp.float32),
          "grad_norm": jnp.zeros((), jnp.float32)}


@dataclasses.dataclass
class Trainer:
  """Everything the loop needs: the split model, optimizer, jitted steps."""
  cfg: TrainConfig
  graphdef: object
  tx: optax.GradientTransformation
  state: dict
  mesh: object = None
  first_bad: dict = dataclasses.field(default_factory=no_bad_step)
  # (batch signature, executable) of the step compiled by compiled_memory, which step()
  # runs on batches of that signature: the step compiles once, not twice
  compiled_step: tuple | None = None
  # the model's input for each 8-bit image code ([256, channels or 1] f32, code_values): the
  # pretrained processor's normalization, made part of the steps
  pixel_values: np.ndarray | None = None

  @classmethod
  def create(cls, cfg: TrainConfig, model=None) -> "Trainer":
    model = build_model(cfg) if model is None else model
    graphdef, params, rest = split_trainable(cfg, model)
    tx = make_optimizer(cfg)
    mesh = sharding.make_mesh(cfg.mesh)
    if mesh is not None:  # the model split first: the optimizer's state is made split
      placed = sharding.shard_state({"params": params, "rest": rest}, mesh)
      params, rest = placed["params"], placed["rest"]
    state = {"step": jnp.zeros((), jnp.int32), "params": params, "rest": rest,
             "opt": tx.init(params)}
    if loss_scale.enabled(cfg.loss_scale, cfg.dtype):
      state["loss_scale"] = loss_scale.init()
    if mesh is not None:
      state = sharding.shard_state(state, mesh)
    trainer = cls(cfg, graphdef, tx, state, mesh, pixel_values=_pixel_values(cfg))
    if mesh is None:
      trainer.state = trainer.placed(state)
    trainer.first_bad = trainer.placed(no_bad_step())
    return trainer

  def placed(self, tree):
    """``tree`` committed where the state lives: replicated over the mesh, else on the
    state's device. A restored state is committed, and the step's outputs are: with
    every input committed from the start, the first step, the next ones and a resumed
    run's lower one program (one compile, which the persistent cache then holds)."""
    if self.mesh is not None:
      return jax.device_put(tree, jax.sharding.NamedSharding(self.mesh, jax.P()))
    first = jax.tree.leaves(self.state)[0]
    if isinstance(first, jax.core.Tracer):  # an abstract trainer (jax.eval_shape)
      return tree
    return jax.device_put(tree, first.sharding)

  @functools.cached_property
  def train_step(self):
    """``(state, first_bad, batch) -> (state, first_bad, metrics)``, jitted, the first two
    donated."""
    cfg, graphdef, tx, pixels = self.cfg, self.graphdef, self.tx, self.pixel_values
    trainable = trainable_filter(cfg)

    def grads_of(params, rest, batch, scale):
      """Loss, metrics, gradients and ``rest`` as the forward left it (site state). With
      a loss ``scale`` (not None), ``loss * scale`` is differentiated and the gradients
      (the WTA-CRS caches' squared norms too) divided back."""
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
        loss, aux = loss_and_metrics(model, batch, cfg.task, cfg.lm_loss_chunk, pixels)
        scaled = loss if scale is None else loss.astype(jnp.float32) * scale
        return scaled, (loss, aux, nnx.split(model, trainable, ...)[2])

      (_, (loss, aux, rest)), (grads, cache_grads) = jax.value_and_grad(
          loss_fn, argnums=(0, 1), has_aux=True)(params, caches)
      if scale is not None:
        grads = jax.tree.map(lambda g: g / scale.astype(g.dtype), grads)
        cache_grads = jax.tree.map(lambda g: g / (scale * scale).astype(g.dtype), cache_grads)
      if use_caches:
        model = nnx.merge(graphdef, params, rest, copy=True)
        nnx.update(model, jax.tree.map(sites.update_grad_norms, caches, cache_grads))
        rest = nnx.split(model, trainable, ...)[2]
      return loss, aux, grads, rest

    @matmul_precision(cfg.precision)
    def step(state, first_bad, batch):
      params, rest = state["params"], state["rest"]
      scaling = state.get("loss_scale")
      scale = None if scaling is None else scaling["scale"]
      if cfg.grad_accum == 1:
        loss, aux, grads, rest = grads_of(params, rest, batch, scale)
      else:  # scan over micro-batches: activations of one micro-batch at a time
        micro = sharding.micro_batches(batch, cfg.grad_accum, self.mesh)

        def body(carry, mb):
          # each micro-batch's mean loss and its gradient, weighted by its count of examples
          # or masked tokens: the sums over the batch, so the step is the whole batch's mean
          # (micro-batches of an LM batch hold different numbers of loss tokens)
          acc, rest = carry
          loss, aux, grads, rest = grads_of(params, rest, mb, scale)
          count = aux[2]
          sums = (loss * count, aux, jax.tree.map(lambda g: g * count.astype(g.dtype), grads))
          return (jax.tree.map(jnp.add, acc, sums), rest), None

        zeros = jax.tree.map(jnp.zeros_like, (jnp.float32(0), (jnp.float32(0),) * 3, params))
        ((loss, aux, grads), rest), _ = jax.lax.scan(body, (zeros, rest), micro)
        count = jnp.maximum(aux[2], 1.0)  # as loss_and_metrics' mean: none counted is 0
        loss, grads = loss / count, jax.tree.map(lambda g: g / count.astype(g.dtype), grads)
      grad_norm = optax.tree.norm(grads)
      updates, opt = tx.update(grads, state["opt"], params)
      new = {"step": state["step"] + 1, "params": optax.apply_updates(params, updates),
             "rest": rest, "opt": opt}  # rest: site state (Mesa ranges, keys) updated
      finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
      metrics = {"loss": loss, "grad_norm": grad_norm, "correct": aux[1], "count": aux[2]}
      if scaling is not None:  # an overflow: skipped, only the count and the scale move
        skip = loss_scale.overflowed(scaling, loss, grad_norm)
        new["loss_scale"] = loss_scale.update(scaling, finite)
        skipped = {**state, "step": new["step"], "loss_scale": new["loss_scale"]}
        new = jax.tree.map(lambda s, n: jnp.where(skip, s, n), skipped, new)
        finite = finite | skip
        metrics |= {"loss_scale": scale, "skipped_steps": new["loss_scale"]["skipped"]}
      halted = first_bad["step"] > 0
      keep_new, first = finite & ~halted, ~finite & ~halted
      new = jax.tree.map(lambda n, o: jnp.where(keep_new, n, o), new, state)
      if self.mesh is not None:  # each leaf where the state put it: one executable
        new = jax.lax.with_sharding_constraint(new, sharding.state_shardings(new, self.mesh))
      this = {"step": state["step"] + 1, "loss": loss.astype(jnp.float32),
              "grad_norm": grad_norm.astype(jnp.float32)}
      first_bad = jax.tree.map(lambda n, o: jnp.where(first, n, o), this, first_bad)
      return new, first_bad, metrics

    return jax.jit(step, donate_argnums=(0, 1), compiler_options=self.compiler_options)

  def step(self, batch: dict) -> dict:
    """One train step on ``batch``, dispatched only (nothing is read back): updates
    ``state`` and ``first_bad``; the step's metrics as device arrays."""
    run = self.train_step
    if self.compiled_step is not None and self.compiled_step[0] == _signature(batch):
      run = self.compiled_step[1]
    self.state, self.first_bad, metrics = run(self.state, self.first_bad, batch)
    return metrics

  def first_bad_step(self) -> dict | None:
    """Waits for the steps dispatched so far; the first non-finite one's ``{"step", "loss",
    "grad_norm"}`` (Python numbers), or None when all were finite."""
    bad = jax.device_get(self.first_bad)
    if int(bad["step"]) == 0:
      return None
    return {"step": int(bad["step"]), "loss": float(bad["loss"]),
            "grad_norm": float(bad["grad_norm"])}

  @functools.cached_property
  def eval_step(self):
    cfg, graphdef, pixels = self.cfg, self.graphdef, self.pixel_values

    @matmul_precision(cfg.precision)
    def step(params, rest, batch):
      model = nnx.merge(graphdef, params, rest)
      model.eval()  # no dropout; sites leave their state as it was
      return eval_metrics(model, batch, cfg.task, cfg.lm_loss_chunk, pixels)

    return jax.jit(step, compiler_options=self.compiler_options)

  @property
  def compiler_options(self) -> dict[str, str]:
    """The policy's XLA options for its steps (``MemoryPolicy.compiler_options``)."""
    return MemoryPolicy.parse(self.cfg.policy).compiler_options()

  def put(self, batch: dict) -> dict:
    if self.mesh is not None:
      return sharding.shard_batch(batch, self.mesh)
    return {k: jnp.asarray(v) for k, v in batch.items()}

  def lower(self, batch):
    """The train step lowered for this state and ``batch`` (for its text or compiled form);
    for the compile target's device under :func:`lowmem_jax.gpu_target.compiling_for`."""
    return self.train_step.lower(*gpu_target.place((self.state, self.first_bad, batch)))

  def compile(self, batch):
    """This very train step compiled for ``batch``. Compiled for this process's devices,
    the executable is kept: :meth:`step` runs it on batches like ``batch`` rather than
    compiling the same step again."""
    compiled = self.lower(batch).compile()
    if gpu_target.active() is None:
      self.compiled_step = (_signature(batch), compiled)
    return compiled

  def compiled_memory(self, batch) -> StepMemory:
    """Compiled memory of this very train step (temp, arguments, total...), from
    :meth:`compile`."""
    return compiled_memory(self.compile(batch))

  def evaluate(self, batches) -> dict:
    loss = correct = count = 0.0
    labels, guesses = [], []
    for batch in batches:
      # a last partial batch that the mesh cannot split runs unsharded
      b = (self.put(batch) if self.mesh is None or _divisible(batch, self.mesh)
           else {k: jnp.asarray(v) for k, v in batch.items()})
      l, c, n, guess, k = jax.device_get(self.eval_step(self.state["params"],
                                                        self.state["rest"], b))
      loss, correct, count = loss + float(l), correct + float(c), count + float(n)
      if guess is not None:
        labels.append(np.asarray(batch["label"]))
        guesses.append(guess)
    out = {"eval_loss": loss / max(count, 1), "eval_accuracy": correct / max(count, 1)}
    if guesses:  # a classifier: macro F1 (and, of two classes, class 1's)
      confusion = confusion_counts(np.concatenate(labels), np.concatenate(guesses), int(k))
      out["eval_f1_macro"] = macro_f1(confusion)
      if int(k) == 2:
        out["eval_f1"] = float(class_f1(confusion)[0][1])
    return out

  # checkpoint helpers: the state as a list of leaves, restored into this structure
  def save(self, ckpt: Checkpoints, data_state: dict, extra: dict | None = None) -> None:
    """Saves the state with ``data_state`` (``Batches.state()`` after this state's step)."""
    step = int(self.state["step"])
    meta = {"step": step, "data": data_state, "config": self.cfg.record(),
            "names": _leaf_names(self.state)}  # for a later mismatch's message
    ckpt.save(step, {"leaves": jax.tree.leaves(self.state)}, {**meta, **(extra or {})})

  def restore(self, ckpt: Checkpoints, batches) -> dict:
    """Loads the newest intact checkpoint into the state and ``batches``; its metadata.
    A checkpoint with a float16 loss scale where this run has none, or none where this
    run scales (the compute dtype changed, or a float16 run written before scaling),
    restores the rest: the scale dropped, or started afresh (as a PyTorch checkpoint
    without ``scaler.pt`` starts a new GradScaler), said so."""
    try:
      state, meta = self._restored(ckpt, self.state)
    except StateMismatchError as mismatch:
      if "loss_scale" in self.state:  # written without a scale: the rest, a fresh one
        other = {k: v for k, v in self.state.items() if k != "loss_scale"}
      else:  # written with one: read with it, then dropped
        other = {**self.state, "loss_scale": self.placed(loss_scale.init())}
      try:
        state, meta = self._restored(ckpt, other)
      except StateMismatchError:
        raise mismatch from None  # not the scale's: the first error says what differs
      scale = state.pop("loss_scale", None)
      if scale is None:
        state["loss_scale"] = self.state["loss_scale"]
      print(f"note: checkpoint step {meta['step']} was written "
            + ("without a loss scale: float16 scaling starts afresh at "
               f"{loss_scale.INIT_SCALE:g}" if scale is None else
               f"with a float16 loss scale ({float(scale['scale']):g}), which this run's "
               f"dtype={self.cfg.dtype} does not use: dropped"), flush=True)
    self.state = state
    self.compiled_step = None  # compiled for the state it replaced
    if self.mesh is not None:
      self.state = sharding.shard_state(self.state, self.mesh)
    self.first_bad = self.placed(no_bad_step())
    batches.restore(meta["data"])
    return meta

  def _restored(self, ckpt: Checkpoints, like: dict) -> tuple[dict, dict]:
    """``(state, meta)`` of the newest intact checkpoint, read into ``like``'s structure."""
    leaves, treedef = jax.tree.flatten(like)
    restored, meta = ckpt.restore({"leaves": leaves}, names=_leaf_names(like))
    return jax.tree.unflatten(treedef, restored["leaves"]), meta


def _pixel_values(cfg: TrainConfig) -> np.ndarray | None:
  """An image run's value per 8-bit code: ``code / 255``, normalized as a pretrained
  model's ``preprocessor_config.json`` says (:func:`train.images.pixel_normalization`)."""
  if cfg.task != "image":
    return None
  return code_values(pixel_normalization(resolve_path(cfg.pretrained)) if cfg.pretrained
                     else None)


def _leaf_names(state) -> list[str]:
  """The state's leaves' paths, in order: ``params/stack/blocks/attn/query/kernel``..."""
  return [jax.tree_util.keystr(path, simple=True, separator="/").removesuffix("/value")
          for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]]


def _signature(batch: dict) -> tuple:
  """What an executable is specialized to: each array's name, shape, dtype and sharding."""
  return tuple((k, v.shape, v.dtype, getattr(v, "sharding", None))
               for k, v in sorted(batch.items()))


def _divisible(batch, mesh) -> bool:
  size = math.prod(mesh.shape.values())
  return all(v.shape[0] % size == 0 for v in batch.values())
