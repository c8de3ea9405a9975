"""The learning-rate schedule (warmup, then cosine, linear or constant) and the optimizer."""

from __future__ import annotations

import optax

from train.config import TrainConfig


def make_schedule(cfg: TrainConfig):
  """Linear warmup over ``warmup_steps`` to ``lr``, then ``cfg.schedule`` down to the end."""
  if cfg.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, max(cfg.warmup_steps, 1),
                                              max(cfg.steps, cfg.warmup_steps + 1))
  after = (optax.linear_schedule(cfg.lr, 0.0, max(cfg.steps - cfg.warmup_steps, 1))
           if cfg.schedule == "linear" else optax.constant_schedule(cfg.lr))
  warmup = optax.linear_schedule(0.0, cfg.lr, max(cfg.warmup_steps, 1))
  return optax.join_schedules([warmup, after], [cfg.warmup_steps])


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  """AdamW or SGD with momentum 0.9 on the schedule, after global-norm clipping when set."""
  schedule = make_schedule(cfg)
  if cfg.optimizer == "adamw":
    opt = optax.adamw(schedule, weight_decay=cfg.weight_decay)
  else:
    opt = optax.sgd(schedule, momentum=0.9)
  return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), opt) if cfg.grad_clip else opt
