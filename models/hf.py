"""Hugging Face checkpoints: ``load_pretrained`` and ``save_pretrained``.

A model directory holds ``config.json`` and ``model.safetensors`` (or shards listed in
``model.safetensors.index.json``). ``model_type`` picks the family in
:mod:`models.registry` (``vit``, ``llama``, ``bert``/``roberta``); its module declares
the map from HF names to our variables (``hf_map``), which one generic reader/writer
(:mod:`models.hf_state`) applies; when the policy uses MS norms it merges each norm's
affine into the linear(s) reading it (float64, then cast). ``save_pretrained`` writes HF
names back so HF transformers loads the same function: pre-LN models export merged norms as weight 1, bias 0 with the
merged linears; post-LN models (BERT/RoBERTa), whose residual path keeps gamma/beta,
export those and un-merge the linears.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowmem_jax.policy import MemoryPolicy
from models import registry
from models.hf_state import CheckpointError, StateReader, read_state, write_state


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
  return hf_config, registry.hf_family(hf_config.get("model_type", ""))


def init_from_config(path: str | os.PathLike, *, policy: MemoryPolicy | str = "baseline",
                     dtype=jnp.float32, seed: int = 0, **overrides):
  """The architecture of a HF model directory, randomly initialised (no weights read):
  for shapes and compiled-memory estimates (e.g. under ``nnx.eval_shape``)."""
  hf_config, family = _read_config(Path(path))
  cfg = family.module.config_from_hf(hf_config, **overrides)
  return family.build(cfg, MemoryPolicy.parse(policy), dtype=dtype, rngs=nnx.Rngs(seed))


def load_pretrained(path: str | os.PathLike, *, policy: MemoryPolicy | str = "baseline",
                    dtype=jnp.float32, seed: int = 0, **overrides):
  """Builds our model from a HF model directory. ``overrides`` change config fields
  (e.g. ``num_labels``); parameters the checkpoint lacks (a new head) are initialised
  from ``seed`` only where the architecture module allows it, otherwise it is an error."""
  path = Path(path)
  hf_config, family = _read_config(path)
  cfg = family.module.config_from_hf(hf_config, **overrides)
  model = family.build(cfg, MemoryPolicy.parse(policy), dtype=dtype, rngs=nnx.Rngs(seed))
  load_state(model, read_safetensors(path))
  return model


def load_state(model, state: dict[str, np.ndarray]) -> None:
  """Loads HF tensors ``state`` into ``model`` (in place) by its family's map; every
  missing, unexpected or mis-shaped key is named in one CheckpointError."""
  module = registry.hf_family(model.cfg.model_type).module
  reader = StateReader(state, ignore=module.HF_IGNORED_KEYS)
  read_state(model, module.hf_map(model.cfg, frozenset(state)), reader)
  reader.finish()


def hf_state(model) -> dict[str, np.ndarray]:
  """``model``'s tensors under HF names (torch layout, float32)."""
  module = registry.hf_family(model.cfg.model_type).module
  return write_state(model, module.hf_map(model.cfg))


def save_pretrained(model, path: str | os.PathLike) -> None:
  """Writes ``config.json`` and ``model.safetensors`` in HF format (atomically)."""
  from safetensors.numpy import save_file

  module = registry.hf_family(model.cfg.model_type).module
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  state = hf_state(model)
  tmp = path / "model.safetensors.tmp"
  save_file(state, str(tmp), metadata={"format": "pt"})
  os.replace(tmp, path / "model.safetensors")
  tmp = path / "config.json.tmp"
  tmp.write_text(json.dumps(module.config_to_hf(model.cfg), indent=2))
  os.replace(tmp, path / "config.json")
