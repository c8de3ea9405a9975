"""A LoRA run's export streamed from its checkpoint (models.hf.save_lora_merged, as
train.loop.export writes it): peft's merge_and_unload in the checkpoint's dtypes, each
checkpoint tensor read once, no model built, shards over the size limit; the host peak
is measured in tests/test_hf_stream.py."""

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from models import hf
from train.config import TrainConfig
from train.loop import export
from train.trainer import Trainer

HF = Path(__file__).parent / "data" / "hf"


def _trainer(pretrained, **overrides):
  """A LoRA trainer on ``pretrained`` (LLaMA, q and v adapted), its adapters' B non-zero."""
  cfg = TrainConfig(name="t", pretrained=str(pretrained), task="lm", trainable="lora",
                    dtype="float32", compare_baseline=False, **overrides)
  trainer = Trainer.create(cfg)
  key = iter(jax.random.split(jax.random.key(0), 64))
  trainer.state["params"] = jax.tree_util.tree_map_with_path(
      lambda p, v: 0.3 * jax.random.normal(next(key), v.shape)
      if "lora_b" in jax.tree_util.keystr(p) else v, trainer.state["params"])
  return trainer, cfg


def _adapted(trainer, cfg) -> dict[str, np.ndarray]:
  """The HF name -> ``scale * A @ B`` (torch layout) of each adapted linear, by hand."""
  model = nnx.merge(trainer.graphdef, trainer.state["params"], trainer.state["rest"])
  scale = cfg.lora_alpha / cfg.lora_rank
  out = {}
  for ours, theirs in (("query", "q_proj"), ("value", "v_proj")):
    lora = getattr(model.stack.blocks.attn, ours)
    a, b = np.asarray(lora.lora_a[...]), np.asarray(lora.lora_b[...])
    for i in range(a.shape[0]):
      out[f"model.layers.{i}.self_attn.{theirs}.weight"] = scale * (
          a[i].reshape(a.shape[1], -1) @ b[i].reshape(b.shape[1], -1)).T
  return out


def _dtypes(path: Path) -> dict[str, str]:
  with safe_open(str(path), framework="numpy") as f:
    return {k: f.get_slice(k).get_dtype() for k in f.keys()}


def test_a_bf16_checkpoint_exports_in_bf16_with_its_own_bytes(tmp_path):
  """A bf16 checkpoint: the export is bf16 as peft's merge_and_unload of a model loaded in
  bf16 (before: fp32, twice the size): every tensor the run did not train is the
  checkpoint's bytes, each adapted one the checkpoint's weight plus ``scale * A @ B``
  rounded to bf16 once; config.json says so."""
  src = tmp_path / "bf16"
  shutil.copytree(HF / "llama_untied", src)
  fp32 = load_file(src / "model.safetensors")
  save_file({k: v.astype(jax.numpy.bfloat16) for k, v in fp32.items()},
            str(src / "model.safetensors"))
  checkpoint = {k: v.astype(jax.numpy.bfloat16) for k, v in fp32.items()}
  trainer, cfg = _trainer(src, policy="lowmembp", base_dtype="nf4",
                          export_dir=str(tmp_path / "out"))
  export(trainer, cfg)
  out = Path(cfg.export_dir)
  assert set(_dtypes(out / "model.safetensors").values()) == {"BF16"}
  assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
  with safe_open(str(out / "model.safetensors"), framework="flax") as f:
    got = {k: np.asarray(f.get_tensor(k)) for k in f.keys()}
  assert got.keys() == checkpoint.keys()
  delta = _adapted(trainer, cfg)
  assert len(delta) == 4  # q and v of the fixture's two layers
  for k, v in checkpoint.items():
    want = v if k not in delta else (v.astype(np.float32) + delta[k]).astype(v.dtype)
    np.testing.assert_array_equal(got[k].view(np.uint16), want.view(np.uint16), err_msg=k)
    assert (k in delta) == (not np.array_equal(got[k], v)), k


def test_each_checkpoint_tensor_is_read_once_and_no_model_is_built(tmp_path, monkeypatch):
  """The export streams the checkpoint (each tensor read once, written as it is read) and
  builds no model: before, a QLoRA or MS-norm run built the fp32 model on the host and
  then its fp32 HF state beside it (~2x the fp32 model: 54 GiB for 7B)."""
  import train.loop
  reads = []
  original = hf.SafetensorsFiles.__getitem__
  monkeypatch.setattr(hf.SafetensorsFiles, "__getitem__",
                      lambda self, key: reads.append(key) or original(self, key))
  trainer, cfg = _trainer(HF / "llama_untied", policy="lowmembp", base_dtype="nf4",
                          export_dir=str(tmp_path / "out"))
  reads.clear()

  def refuse(*args, **kwargs):
    raise AssertionError("the export built a model")
  monkeypatch.setattr(train.loop, "build_model", refuse)
  export(trainer, cfg)
  checkpoint = load_file(HF / "llama_untied" / "model.safetensors")
  assert sorted(reads) == sorted(checkpoint)


def test_an_export_over_the_shard_size_is_sharded_and_loads_as_one_file(tmp_path):
  """Over ``max_shard_bytes`` the export is shards and an index as transformers writes
  them; it loads as the single-file export does; each export into the folder removes
  the other's weight files."""
  trainer, cfg = _trainer(HF / "llama_untied")
  model = nnx.merge(trainer.graphdef, trainer.state["params"], trainer.state["rest"])
  one, out = tmp_path / "one", tmp_path / "out"
  hf.save_lora_merged(model, one, HF / "llama_untied")
  hf.save_lora_merged(model, out, HF / "llama_untied", max_shard_bytes=40_000)
  index = json.loads((out / "model.safetensors.index.json").read_text())
  files = sorted(set(index["weight_map"].values()))
  n = len(files)
  assert n >= 3 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
  whole = load_file(one / "model.safetensors")
  assert index["weight_map"].keys() == whole.keys()
  assert index["metadata"]["total_size"] == sum(v.nbytes for v in whole.values())
  for name in files:
    shard = load_file(out / name)
    assert sum(v.nbytes for v in shard.values()) <= 40_000 or len(shard) == 1
    for k, v in shard.items():
      np.testing.assert_array_equal(v, whole[k], err_msg=k)
  tokens = np.arange(12).reshape(2, 6) % 100
  np.testing.assert_array_equal(hf.load_pretrained(out)(tokens),
                                hf.load_pretrained(one)(tokens))
  hf.save_lora_merged(model, out, HF / "llama_untied")  # one file again: no shard left
  assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
  hf.save_lora_merged(model, out, HF / "llama_untied", max_shard_bytes=40_000)
  assert not (out / "model.safetensors").exists()


def test_a_checkpoint_changed_since_the_run_is_named(tmp_path):
  """A checkpoint that lost a tensor or changed a shape since the run read it: one
  CheckpointError naming each, before any file is written."""
  trainer, cfg = _trainer(HF / "llama_untied")
  model = nnx.merge(trainer.graphdef, trainer.state["params"], trainer.state["rest"])
  state = load_file(HF / "llama_untied" / "model.safetensors")
  del state["model.norm.weight"]
  state["model.layers.0.mlp.up_proj.weight"] = state["model.layers.0.mlp.up_proj.weight"][1:]
  with pytest.raises(hf.CheckpointError) as e:
    hf.save_lora_merged(model, tmp_path / "out", state)
  assert str(e.value).startswith("the checkpoint does not match the run's model")
  assert "model.norm.weight: missing" in str(e.value)
  assert "model.layers.0.mlp.up_proj.weight: checkpoint [" in str(e.value)
  assert not (tmp_path / "out").exists()


def test_a_sharded_bf16_export_loads_in_transformers(tmp_path):
  """transformers reads the sharded bf16 export (index, shards, torch_dtype) as our loader
  does: the same logits in fp32."""
  import make_hf_fixtures as fx
  if not fx.torch_available():
    pytest.skip(fx.NO_TORCH)
  import torch
  import transformers
  src = tmp_path / "bf16"
  shutil.copytree(HF / "llama_untied", src)
  save_file({k: v.astype(jax.numpy.bfloat16)
             for k, v in load_file(src / "model.safetensors").items()},
            str(src / "model.safetensors"))
  trainer, cfg = _trainer(src, policy="lowmembp")
  model = nnx.merge(trainer.graphdef, trainer.state["params"], trainer.state["rest"])
  hf.save_lora_merged(model, tmp_path / "out", src, max_shard_bytes=20_000)
  assert len(list((tmp_path / "out").glob("model-*-of-*.safetensors"))) >= 3
  tokens = fx.llama_tokens()
  ours = np.asarray(hf.load_pretrained(tmp_path / "out")(tokens))
  theirs = transformers.LlamaForCausalLM.from_pretrained(
      tmp_path / "out", attn_implementation="eager").float().eval()
  assert next(theirs.parameters()).dtype == torch.float32
  with torch.no_grad():
    logits = theirs(torch.as_tensor(np.asarray(tokens))).logits.numpy()
  np.testing.assert_allclose(logits, ours, rtol=1e-4, atol=1e-4)
