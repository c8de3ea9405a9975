"""A LoRA run's export streamed from its checkpoint (models.hf.save_lora_merged, as
train.loop.export writes it): peft's merge_and_unload in the checkpoint's dtypes, each
checkpoint tensor read once, no model built, shards over the size limit; the host peak
is measured in tests/test_hf_stream.py."""

import json
import re
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
  # "auto": the dtype the export's config names (transformers >= 4.56 calls it dtype)
  major, minor = (int(x) for x in re.findall(r"\d+", transformers.__version__)[:2])
  auto = {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": "auto"}
  theirs = transformers.LlamaForCausalLM.from_pretrained(
      tmp_path / "out", attn_implementation="eager", **auto)
  assert next(theirs.parameters()).dtype == torch.bfloat16
  theirs = theirs.float().eval()  # compared in fp32, as our loader computes
  with torch.no_grad():
    logits = theirs(torch.as_tensor(np.asarray(tokens))).logits.numpy()
  np.testing.assert_allclose(logits, ours, rtol=1e-4, atol=1e-4)


def test_a_model_without_adapters_is_refused(tmp_path):
  """A stripped (merged) LoRA model or one never adapted would export as the checkpoint,
  silently: one line says to use save_pretrained."""
  from models import lora
  trainer, cfg = _trainer(HF / "llama_untied")
  model = nnx.merge(trainer.graphdef, trainer.state["params"], trainer.state["rest"])
  for plain in (lora.strip_lora(model), hf.load_pretrained(HF / "llama_untied")):
    with pytest.raises(ValueError, match=r"^save_lora_merged: the model has no LoRA "
                                         r"adapters \(never applied, or merged by "
                                         r"strip_lora\): export it with save_pretrained$"):
      hf.save_lora_merged(plain, tmp_path / "out", HF / "llama_untied")
  assert not (tmp_path / "out").exists()


def test_an_export_over_its_own_checkpoint_or_beside_other_weights_is_refused(tmp_path):
  """Exporting into the checkpoint it merges into overwrote it (a later export from the
  run was then refused: the checkpoint had changed); an adapter left in the folder made
  transformers load that adapter's model, not the export."""
  import shutil
  base = tmp_path / "base"
  shutil.copytree(HF / "llama_untied", base)
  before = {p.name: p.read_bytes() for p in base.iterdir()}
  trainer, cfg = _trainer(base)
  model = nnx.merge(trainer.graphdef, trainer.state["params"], trainer.state["rest"])
  with pytest.raises(ValueError, match=f"^save_lora_merged: {base} is the checkpoint the "
                                       "model was loaded from; the export would overwrite it"):
    hf.save_lora_merged(model, base, base)
  assert {p.name: p.read_bytes() for p in base.iterdir()} == before
  out = tmp_path / "out"
  out.mkdir()
  (out / "adapter_model.safetensors").write_bytes(b"")
  with pytest.raises(ValueError, match=f"^save_lora_merged: {out} holds adapter_model."
                                       "safetensors: another model's weights or adapter"):
    hf.save_lora_merged(model, out, base)
  assert [p.name for p in out.iterdir()] == ["adapter_model.safetensors"]
  from models import registry
  with pytest.raises(ValueError, match="^save_lora_merged: RevViT has no Hugging Face format"):
    hf.save_lora_merged(registry.build("revvit-tiny"), out, base)


def _headless_vit(tmp_path) -> Path:
  """The ViT fixture saved as HF's ViTModel names it: no ``vit.`` prefix, no classifier."""
  path = tmp_path / "headless"
  path.mkdir()
  state = load_file(HF / "vit" / "model.safetensors")
  save_file({k.removeprefix("vit."): v for k, v in state.items()
             if not k.startswith("classifier")}, str(path / "model.safetensors"))
  shutil.copy(HF / "vit" / "config.json", path / "config.json")
  return path


@pytest.mark.parametrize("policy", ["baseline", "ms-bp"])
def test_an_untrained_fresh_head_under_ms_norms_exports_unmerged(policy, tmp_path):
  """A headless checkpoint's fresh head, not trained (``modules_to_save=()``), is held
  merged with the final norm under MS norms: the export un-merges it, so the exported
  model is the adapted one (before: the norm's affine applied twice, logits 1.5 off)."""
  import jax.numpy as jnp

  import make_hf_fixtures as fx
  from models import lora
  src = _headless_vit(tmp_path)
  model = hf.load_pretrained(src, policy=policy, dtype=jnp.float32)
  lora.apply_lora(model, targets=("query",), modules_to_save=())
  b = model.stack.blocks.attn.query.lora_b
  b.set_value(0.3 * jax.random.normal(jax.random.key(1), b[...].shape))
  images = jnp.asarray(fx.vit_images())
  want = np.asarray(model(images))
  hf.save_lora_merged(model, tmp_path / "out", src)
  got = np.asarray(hf.load_pretrained(tmp_path / "out", dtype=jnp.float32)(images))
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_a_bf16_vit_exports_its_trained_head_in_bf16_and_says_so(tmp_path):
  """Every tensor of a bf16 checkpoint is exported bf16, the trained head too (peft's
  merge of a bf16 model); ViT's config gains ``dtype`` (transformers loads in it), BERT's
  ``dtype`` and LLaMA's ``torch_dtype`` are set."""
  src = tmp_path / "bf16"
  shutil.copytree(HF / "vit", src)
  save_file({k: v.astype(jax.numpy.bfloat16)
             for k, v in load_file(src / "model.safetensors").items()},
            str(src / "model.safetensors"))
  cfg = TrainConfig(name="t", pretrained=str(src), task="image", trainable="lora",
                    dtype="float32", compare_baseline=False, policy="lowmembp",
                    export_dir=str(tmp_path / "out"))
  export(Trainer.create(cfg), cfg)
  assert set(_dtypes(tmp_path / "out" / "model.safetensors").values()) == {"BF16"}
  assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
  bf16 = [hf.OutTensor("w", (4,), np.dtype(jax.numpy.bfloat16), None)]
  fp32 = [hf.OutTensor("w", (4,), np.dtype(np.float32), None)]
  assert hf._with_dtype({"dtype": "float32"}, bf16) == {"dtype": "bfloat16"}
  assert hf._with_dtype({"torch_dtype": "float32"}, bf16) == {"torch_dtype": "bfloat16"}
  assert hf._with_dtype({}, fp32) == {}  # an fp32 export's config as before


def test_a_failed_export_leaves_no_temporary_file_and_the_last_export(tmp_path):
  """A tensor that cannot be made stops the export: its temporary files are removed, the
  previous export is left whole, and only our shard names are ever removed."""
  out = tmp_path / "out"
  ok = [hf.OutTensor(f"t{i}", (1000,), np.dtype(np.float32), lambda: np.ones(1000, np.float32))
        for i in range(4)]
  hf._write_model_dir(out, {"a": 1}, ok, 8000)
  (out / "model-notes-of-mine.safetensors").write_text("not ours")
  before = sorted(p.name for p in out.iterdir())

  def fail():
    raise RuntimeError("no tensor")
  with pytest.raises(RuntimeError, match="no tensor"):
    hf._write_model_dir(out, {"a": 2}, ok[:3] + [hf.OutTensor("t3", (1000,),
                                                              np.dtype(np.float32), fail)], 8000)
  assert sorted(p.name for p in out.iterdir()) == before
  hf._write_model_dir(out, {"a": 3}, ok, 10 ** 9)  # one file now
  assert sorted(p.name for p in out.iterdir()) == ["config.json", "model-notes-of-mine.safetensors",
                                                   "model.safetensors"]


def test_new_head_leaves_the_checkpoint_s_head_out_of_a_directory_or_a_mapping(tmp_path):
  """``new_head``: the checkpoint's head (other labels) is not read, the model's is
  written, whether the checkpoint is a directory or HF tensors in memory (before: a
  mapping failed on its missing file headers)."""
  from models import lora
  model = hf.load_pretrained(HF / "vit", new_head=True, num_labels=3)
  lora.apply_lora(model)
  hf.save_lora_merged(model, tmp_path / "dir", HF / "vit", new_head=True)
  hf.save_lora_merged(model, tmp_path / "map", load_file(HF / "vit" / "model.safetensors"),
                      new_head=True)
  a, b = (load_file(tmp_path / n / "model.safetensors") for n in ("dir", "map"))
  assert a.keys() == b.keys() and a["classifier.weight"].shape == (3, 64)
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)
