"""The compiled memory of the train step, printed before training (an OOM foretold), beside
``baseline``'s."""

from __future__ import annotations

import math

from lowmem_jax.memory import MiB
from lowmem_jax.policy import MemoryPolicy
from train.config import TrainConfig
from train.planner import abstract_trainer
from train.trainer import Trainer


def _mib(b):
  return f"{b / MiB:.1f} MiB"


def print_memory(trainer: Trainer, batch, cfg: TrainConfig) -> dict:
  """Compiled memory of the step (predicts an OOM before it happens), beside baseline's
  (an abstract trainer: its model and optimizer state are shapes, nothing materialized)."""
  ours = trainer.compiled_memory(batch)
  report = {"policy": MemoryPolicy.parse(cfg.policy).spec, **ours.as_dict()}
  devices = math.prod(trainer.mesh.shape.values()) if trainer.mesh is not None else 1
  where = f" per device ({devices} devices)" if devices > 1 else ""
  if devices > 1:
    report["devices"] = devices
  line = (f"compiled step memory{where} [{report['policy']}]: temp {_mib(ours.temp)}, "
          f"arguments {_mib(ours.argument)}, total {_mib(ours.total)}")
  if cfg.compare_baseline and MemoryPolicy.parse(cfg.policy) != MemoryPolicy():
    base = abstract_trainer(cfg.with_policy("baseline", resume=False))
    mem = base.compiled_memory(batch)
    report["baseline"] = mem.as_dict()
    line += (f"\n                       [baseline]: temp {_mib(mem.temp)}, arguments "
             f"{_mib(mem.argument)}, total {_mib(mem.total)}  (ours/baseline temp "
             f"{ours.temp / max(mem.temp, 1):.3f}, total {ours.total / max(mem.total, 1):.3f})")
  print(line, flush=True)
  return report
