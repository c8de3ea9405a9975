"""train.memory_report: the baseline beside our step is an abstract trainer (nothing
materialized); compiles are replaced by a stub, so the test builds shapes only."""

import jax

from lowmem_jax.memory import StepMemory
from train import memory_report
from train.config import TrainConfig
from train.planner import abstract_trainer
from train.trainer import Trainer

from conftest import TINY_MODEL


def test_baseline_comparison_materializes_no_state(monkeypatch, capsys):
  seen = []

  def compiled_memory(self, batch):
    seen.append((self.cfg.policy, jax.tree.leaves(self.state)))
    return StepMemory(temp=100, argument=10, output=5, alias=0, generated_code=0, peak=None)

  monkeypatch.setattr(Trainer, "compiled_memory", compiled_memory)
  cfg = TrainConfig(name="t", policy="lowmembp", compare_baseline=True, dtype="float32",
                    model_overrides=TINY_MODEL)
  ours = abstract_trainer(cfg)
  report = memory_report.print_memory(ours, {}, cfg)
  assert [p for p, _ in seen] == ["lowmembp", "baseline"]
  base_leaves = seen[1][1]
  # parameters and optimizer state (AdamW's moments) as shapes, none as arrays
  assert len(base_leaves) > 2 * len(jax.tree.leaves(ours.state["params"]))
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in base_leaves)
  assert report["baseline"]["total"] == 115
  assert "[baseline]: temp 0.0 MiB" in capsys.readouterr().out
