"""Hugging Face checkpoints: ``load_pretrained`` and ``save_pretrained``.

A model directory holds ``config.json`` and ``model.safetensors`` (or shards listed in
``model.safetensors.index.json``). ``model_type`` picks the architecture module
(``vit``, ``llama``, ``bert``/``roberta``); the module maps HF names to our parameters
and, when the policy uses MS norms, merges each norm's affine into the linear(s) reading
it (float64, then cast). ``save_pretrained`` writes HF names back so HF transformers
loads the same function: pre-LN models export merged norms as weight 1, bias 0 with the
merged linears; post-LN models (BERT/RoBERTa), whose residual path keeps gamma/beta,
export those and un-merge the linears.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowmem_jax.policy import MemoryPolicy
from models.hf_state import CheckpointError, StateReader

ARCHITECTURES = {"vit": "models.vit", "llama": "models.llama", "bert": "models.bert",
                 "roberta": "models.bert"}
MODEL_CLASSES = {"vit": "ViT", "llama": "Llama", "bert": "Bert", "roberta": "Bert"}


def _module(model_type: str):
  if model_type not in ARCHITECTURES:
    raise CheckpointError(f"unsupported model_type {model_type!r}; supported: "
                          f"{', '.join(ARCHITECTURES)}")
  return importlib.import_module(ARCHITECTURES[model_type])


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
  """All tensors of a model directory (single file or shards) as numpy arrays."""
  from safetensors.numpy import load_file

  path = Path(path)
  index = path / "model.safetensors.index.json"
  if index.exists():
    files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
  elif (path / "model.safetensors").exists():
    files = ["model.safetensors"]
  else:
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")
  state: dict[str, np.ndarray] = {}
  for name in files:
    state.update(load_file(str(path / name)))
  return state


def _read_config(path: Path):
  config_file = path / "config.json"
  if not config_file.exists():
    raise CheckpointError(f"{path}: no config.json")
  hf_config = json.loads(config_file.read_text())
  model_type = hf_config.get("model_type", "")
  return hf_config, _module(model_type), model_type


def init_from_config(path: str | os.PathLike, *, policy: MemoryPolicy | str = "baseline",
                     dtype=jnp.float32, seed: int = 0, **overrides):
  """The architecture of a HF model directory, randomly initialised (no weights read):
  for shapes and compiled-memory estimates (e.g. under ``nnx.eval_shape``)."""
  hf_config, module, model_type = _read_config(Path(path))
  cfg = module.config_from_hf(hf_config, **overrides)
  cls = getattr(module, MODEL_CLASSES[model_type])
  return cls(cfg, MemoryPolicy.parse(policy), dtype=dtype, rngs=nnx.Rngs(seed))


def load_pretrained(path: str | os.PathLike, *, policy: MemoryPolicy | str = "baseline",
                    dtype=jnp.float32, seed: int = 0, **overrides):
  """Builds our model from a HF model directory. ``overrides`` change config fields
  (e.g. ``num_labels``); parameters the checkpoint lacks (a new head) are initialised
  from ``seed`` only where the architecture module allows it, otherwise it is an error."""
  path = Path(path)
  hf_config, module, _ = _read_config(path)
  cfg = module.config_from_hf(hf_config, **overrides)
  reader = StateReader(read_safetensors(path), ignore=module.HF_IGNORED_KEYS)
  model = module.from_hf_state(reader, cfg, MemoryPolicy.parse(policy), dtype,
                               nnx.Rngs(seed))
  reader.finish()
  return model


def save_pretrained(model, path: str | os.PathLike) -> None:
  """Writes ``config.json`` and ``model.safetensors`` in HF format (atomically)."""
  from safetensors.numpy import save_file

  module = _module(model.cfg.model_type)
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  state = {k: np.ascontiguousarray(np.asarray(v, np.float32))
           for k, v in module.to_hf_state(model).items()}
  tmp = path / "model.safetensors.tmp"
  save_file(state, str(tmp), metadata={"format": "pt"})
  os.replace(tmp, path / "model.safetensors")
  tmp = path / "config.json.tmp"
  tmp.write_text(json.dumps(module.config_to_hf(model.cfg), indent=2))
  os.replace(tmp, path / "config.json")
