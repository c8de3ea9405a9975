"""The learning-rate schedule (train/optim.py): warmup, then cosine, linear or constant;
the optimizers' weight decay."""

import jax
import numpy as np
import optax
import pytest

from train import config as config_lib
from train.optim import make_optimizer, make_schedule


def _schedule(*overrides):
  return make_schedule(config_lib.load_config(overrides=["lr=0.5", *overrides]))


@pytest.mark.parametrize("steps,warmup", [(300, 20), (60, 10), (20, 20), (5, 20)])
def test_cosine_is_optax_warmup_cosine(steps, warmup):
  ours = _schedule(f"steps={steps}", f"warmup_steps={warmup}")
  ref = optax.warmup_cosine_decay_schedule(0.0, 0.5, warmup, max(steps, warmup + 1))
  np.testing.assert_allclose([ours(i) for i in range(steps + 2)],
                             [ref(i) for i in range(steps + 2)], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
@pytest.mark.parametrize("steps", [1, 4])
def test_no_warmup_starts_at_lr(schedule, steps):
  """warmup_steps=0: the first update (optax's count 0) takes the full lr, and a decaying
  schedule reaches 0 at ``steps`` (steps=1 included: no empty decay)."""
  lrs = [float(_schedule(f"steps={steps}", "warmup_steps=0", f"schedule={schedule}")(i))
         for i in range(steps + 1)]
  assert lrs[0] == 0.5
  assert lrs[-1] == (0.5 if schedule == "constant" else 0.0), lrs
  assert all(a >= b for a, b in zip(lrs, lrs[1:])), lrs


def test_warmup_rises_linearly_from_zero():
  lrs = [float(_schedule("steps=10", "warmup_steps=4", "schedule=constant")(i))
         for i in range(6)]
  np.testing.assert_allclose(lrs, [0.0, 0.125, 0.25, 0.375, 0.5, 0.5])


def test_a_warmup_as_long_as_the_run_is_said_with_the_rate_it_ends_at():
  from train.optim import warmup_warning

  def warning(*overrides):
    return warmup_warning(config_lib.load_config(overrides=["lr=0.5", *overrides]))
  assert warning("steps=20", "warmup_steps=20") == (
      "warning: warmup_steps=20 >= steps=20: the whole run warms up (its last step's "
      "learning rate is 0.475, not lr=0.5, and the cosine decay never starts); set "
      "warmup_steps below steps")
  assert warning("steps=4", "warmup_steps=10", "schedule=constant").startswith(
      "warning: warmup_steps=10 >= steps=4: the whole run warms up (its last step's "
      "learning rate is 0.15, not lr=0.5); set")
  assert warning("steps=21", "warmup_steps=20") is None
  assert warning("steps=1", "warmup_steps=0") is None


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_weight_decay_applies_to_both_optimizers(optimizer):
  """A zero gradient still decays the weights by lr * weight_decay in the first step (SGD
  took no weight decay before: its default 0.05 was silently ignored)."""
  cfg = config_lib.load_config(overrides=[f"optimizer={optimizer}", "lr=0.1",
                                          "weight_decay=0.5", "grad_clip=0", "warmup_steps=0",
                                          "schedule=constant"])
  tx = make_optimizer(cfg)
  params = {"w": np.full((3,), 2.0, np.float32)}
  updates, state = tx.update({"w": np.zeros(3, np.float32)}, tx.init(params), params)
  np.testing.assert_allclose(updates["w"], -0.1 * 0.5 * 2.0, rtol=1e-6)
  # decoupled: the decay does not go through SGD's momentum (step 2: decay alone again)
  updates, _ = tx.update({"w": np.zeros(3, np.float32)}, state, params)
  np.testing.assert_allclose(updates["w"], -0.1 * 0.5 * 2.0, rtol=1e-6)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_biases_and_norm_scales_do_not_decay(optimizer):
  """As HF's Trainer: no weight decay on biases and norm weights (every parameter decayed,
  as torch.optim.AdamW(model.parameters()), layer-stacked biases and q, k, v's per-head
  biases included). Kernels, embeddings and LoRA's A and B decay."""
  from train.trainer import Trainer
  cfg = config_lib.load_config(overrides=[f"optimizer={optimizer}", "lr=0.1",
                                          "weight_decay=0.5", "grad_clip=0", "warmup_steps=0",
                                          "schedule=constant", "policy=baseline",
                                          "compare_baseline=false"])
  params = jax.tree.map(np.ones_like, Trainer.create(cfg).state["params"])
  tx = make_optimizer(cfg)
  updates, _ = tx.update(jax.tree.map(np.zeros_like, params), tx.init(params), params)
  moved = {jax.tree_util.keystr(path): bool(np.any(u)) for path, u in
           jax.tree_util.tree_flatten_with_path(updates)[0]}
  kept = sorted(k for k, m in moved.items() if not m)
  assert kept and all(("'bias'" in k or "'scale'" in k) for k in kept), kept
  assert all(not m for k, m in moved.items() if "'bias'" in k or "'scale'" in k)
  for name in ("['stack']['blocks']['attn']['query']['bias']", "['head']['bias']",
               "['stack']['blocks']['norm1']['scale']"):
    assert any(k.startswith(name) for k in kept), (name, kept)
  for name in ("['stack']['blocks']['attn']['query']['kernel']", "['pos_embed']",
               "['head']['kernel']"):
    assert any(k.startswith(name) and m for k, m in moved.items()), name
