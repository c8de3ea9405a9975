"""The learning-rate schedule (warmup, then cosine, linear or constant) and the optimizer."""

from __future__ import annotations

import jax
import optax

from train.config import TrainConfig


def make_schedule(cfg: TrainConfig):
  """Linear warmup over ``warmup_steps`` from 0 to ``lr`` (none at 0: step 1 takes ``lr``),
  then ``cfg.schedule`` down to the end (cosine and linear reach 0 at ``steps``)."""
  decay_steps = max(cfg.steps - cfg.warmup_steps, 1)
  if cfg.schedule == "cosine":
    after = optax.cosine_decay_schedule(cfg.lr, decay_steps)
  elif cfg.schedule == "linear":
    after = optax.linear_schedule(cfg.lr, 0.0, decay_steps)
  else:
    after = optax.constant_schedule(cfg.lr)
  if not cfg.warmup_steps:
    return after
  warmup = optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps)
  return optax.join_schedules([warmup, after], [cfg.warmup_steps])


def warmup_warning(cfg: TrainConfig) -> str | None:
  """What is wrong when the warmup takes the whole run (``warmup_steps >= steps``: the
  rate never reaches ``lr``, and no decay follows), else None."""
  if not cfg.warmup_steps or cfg.warmup_steps < cfg.steps:
    return None
  last = float(make_schedule(cfg)(cfg.steps - 1))  # the rate of the last step
  return (f"warning: warmup_steps={cfg.warmup_steps} >= steps={cfg.steps}: the whole run "
          f"warms up (its last step's learning rate is {last:.3g}, not lr={cfg.lr:g}"
          + (f", and the {cfg.schedule} decay never starts" if cfg.schedule != "constant"
             else "") + "); set warmup_steps below steps")


def decays(params):
  """Which trainable parameters weight decay shrinks: all but biases and norm scales (a
  leaf named ``bias`` or ``*scale``; a norm's shift is its ``bias``), as HF's Trainer
  leaves out biases and LayerNorm weights. By name, not by rank: stacked layers give a
  bias a layer axis, and q, k, v's a head axis. Under MS norms a norm's scale lives in
  the next linear's kernel, which decays."""
  def decayed(path, _):
    names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    names = [n for n in names if n != "value"]  # an nnx Variable's own field
    last = names[-1] if names else None
    return not (isinstance(last, str) and (last == "bias" or last.endswith("scale")))
  return jax.tree_util.tree_map_with_path(decayed, params)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  """AdamW or SGD with momentum 0.9 (SGDW), on the schedule, after global-norm clipping when
  set. Weight decay is decoupled in both (``lr * weight_decay * param`` a step, outside the
  momentum), so the default 0.05 means the same for either (PyTorch SGD's coupled decay,
  through the momentum, would be 10x it), and skips biases and norm scales (by name:
  :func:`decays`)."""
  schedule = make_schedule(cfg)
  if cfg.optimizer == "adamw":
    opt = optax.adamw(schedule, weight_decay=cfg.weight_decay, mask=decays)
  else:
    opt = optax.chain(optax.trace(decay=0.9),
                      optax.add_decayed_weights(cfg.weight_decay, mask=decays),
                      optax.scale_by_learning_rate(schedule))
  return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), opt) if cfg.grad_clip else opt
