"""models.hf_fingerprint and train.pretrained_record: a run's export merges into the
checkpoint the run started from, or says that checkpoint changed."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from models.hf_fingerprint import SAMPLE_BYTES, differences, fingerprint
from models.hf_state import CheckpointError
from train import config as config_lib
from train import loop
from train.loop import train

HF = Path(__file__).parent / "data" / "hf"


def _edit(directory: Path, edit) -> None:
  """Rewrites ``directory/model.safetensors`` with ``edit`` applied to its tensors."""
  file = directory / "model.safetensors"
  tensors = load_file(file)
  edit(tensors)
  save_file(tensors, file)


def test_a_fingerprint_follows_the_bytes_not_the_paths(tmp_path):
  """A copy has the same fingerprint; a retrained tensor, a change in the last sample of
  a large tensor, or a shape changes it; a change between the samples does not (the
  documented limit: three 4 KiB samples per tensor)."""
  checkpoint = tmp_path / "a"
  checkpoint.mkdir()
  rng = np.random.default_rng(0)
  name = "big"  # 64 KiB: sampled, not read whole
  save_file({name: rng.normal(size=(128, 128)).astype(np.float32),
             "small": rng.normal(size=(3,)).astype(np.float32)},
            checkpoint / "model.safetensors")
  first = fingerprint(checkpoint)
  assert list(first) == ["model.safetensors"]
  assert fingerprint(shutil.copytree(checkpoint, tmp_path / "copy")) == first

  def changed(edit) -> bool:
    shutil.rmtree(tmp_path / "b", ignore_errors=True)
    shutil.copytree(checkpoint, tmp_path / "b")
    _edit(tmp_path / "b", edit)
    return fingerprint(tmp_path / "b") != first

  def retrain(t):
    t[name] = t[name] + np.float32(1e-3)

  def last_element(t):
    t[name].reshape(-1)[-1] += 1.0

  def between_samples(t):  # an element past the first sample, before the middle one
    t[name].reshape(-1)[SAMPLE_BYTES // 4 + 10] += 1.0

  def reshape(t):
    t[name] = t[name][:-1]

  def small(t):
    t["small"][1] += 1.0

  assert changed(retrain) and changed(last_element) and changed(reshape) and changed(small)
  assert not changed(between_samples)
  assert not changed(lambda t: None)  # the same tensors written again


def test_differences_name_each_shard():
  recorded = {"a.safetensors": "1", "b.safetensors": "2", "c.safetensors": "3"}
  now = {"a.safetensors": "1", "b.safetensors": "9", "d.safetensors": "4"}
  assert differences(recorded, now) == ["b.safetensors (changed)", "c.safetensors (gone)",
                                        "d.safetensors (new)"]
  assert differences(recorded, recorded) == []


def _lora_run(tmp_path, checkpoint, *extra):
  return config_lib.load_config("digits-vit", None, [
      f"pretrained={checkpoint}", "new_head=true", "model.num_labels=10", "trainable=lora",
      "batch_size=32", "log_every=1", "eval_every=0", "compare_baseline=false",
      "dtype=float32", f"out_dir={tmp_path / 'run'}", "steps=2", *extra])


def test_a_lora_export_refuses_a_checkpoint_changed_since_the_run_started(tmp_path):
  """A LoRA run records its checkpoint's fingerprint in pretrained.json; a resume that
  would export (here of the finished run: nothing to train) after the checkpoint changed
  is one error naming the file, before anything is written; with the checkpoint put back
  it exports. Before, the export merged the adapters into the changed weights."""
  checkpoint = shutil.copytree(HF / "vit", tmp_path / "vit")
  cfg = _lora_run(tmp_path, checkpoint)
  train(cfg)
  record = json.loads((tmp_path / "run" / "pretrained.json").read_text())
  assert record["files"] == fingerprint(checkpoint)
  original = (checkpoint / "model.safetensors").read_bytes()
  _edit(checkpoint, lambda t: t.update(
      {k: v + np.float32(0.01) for k, v in t.items() if "encoder.layer.0." in k}))
  later = cfg.replace(resume=True, export_dir=str(tmp_path / "hf"))
  with pytest.raises(CheckpointError, match=r"changed since the run .* started from it "
                     r"\(model.safetensors \(changed\)\): the export would use other weights"):
    train(later)
  assert not (tmp_path / "hf").exists()
  # a resume that would train on, then export: refused before its first step
  with pytest.raises(CheckpointError, match="changed since the run"):
    train(later.replace(steps=3))
  records = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
  assert max(json.loads(r).get("step", 0) for r in records) == 2
  # the export itself checks too (a checkpoint changed during a run)
  from train.trainer import Trainer
  with pytest.raises(CheckpointError, match="changed since the run"):
    loop.export(Trainer.create(later), later)
  assert not (tmp_path / "hf").exists()
  (checkpoint / "model.safetensors").write_bytes(original)
  train(later)
  assert (tmp_path / "hf" / "model.safetensors").is_file()
  # the record stays the run's own through resumes; overwrite starts a new one
  assert json.loads((tmp_path / "run" / "pretrained.json").read_text()) == record


def test_a_record_is_made_per_run_and_only_from_a_checkpoint(tmp_path):
  """A new run in a folder that holds a stale record (of a run that failed before its
  first checkpoint) records its own checkpoint; a run without one writes none."""
  vit = shutil.copytree(HF / "vit", tmp_path / "vit")
  (tmp_path / "run").mkdir()
  (tmp_path / "run" / "pretrained.json").write_text('{"files": {"x": "0"}}')
  train(_lora_run(tmp_path, vit, "steps=1"))
  assert json.loads((tmp_path / "run" / "pretrained.json").read_text())["files"] == (
      fingerprint(vit))
  plain = config_lib.load_config("digits-vit", None, [
      "batch_size=32", "eval_every=0", "compare_baseline=false", "steps=1",
      f"out_dir={tmp_path / 'plain'}"])
  train(plain)
  assert not (tmp_path / "plain" / "pretrained.json").exists()


def test_a_run_from_a_checkpoint_that_fails_before_writing_leaves_no_folder(tmp_path):
  """The record is written with config.json, so a run that fails on its data leaves no
  folder behind, as one without a checkpoint does."""
  vit = shutil.copytree(HF / "vit", tmp_path / "vit")
  cfg = _lora_run(tmp_path, vit, "model.num_labels=5", "new_head=false")
  with pytest.raises(ValueError, match="data=digits has 10 classes"):
    train(cfg)
  assert not (tmp_path / "run").exists()
