"""The model registry: preset name -> family (config, module, HF mapping, input kind).

Every model family is one line of :data:`FAMILIES`; its module provides ``PRESETS``
(preset names), ``config(name, **overrides)``, the model class, and, for families with
Hugging Face checkpoints, ``config_from_hf``, ``config_to_hf``, ``hf_map`` and
``HF_IGNORED_KEYS`` (:mod:`models.hf`). The trainer, ``models.step_memory`` and
``models.hf`` look models up here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType

import jax.numpy as jnp
from flax import nnx

@dataclasses.dataclass(frozen=True)
class Family:
  """A model family. ``inputs``: "image" (``[B, H, W, C]`` floats -> class logits) or
  "tokens" (``[B, T]`` ids, with a padding mask -> per-sequence or per-token logits);
  ``tasks``: the train tasks it serves (``image``, ``text``: a class per sequence, ``lm``).
  ``hf_model_types``: the HF ``config.json`` ``model_type`` values it loads;
  ``reversible``: its blocks make a reversible stack (policies choose ``reversible=``, not
  the blocks' norm, activation or attention)."""
  name: str
  module_name: str
  class_name: str
  inputs: str
  tasks: tuple[str, ...]  # what train's ``task`` may be: image, text (classes), lm
  hf_model_types: tuple[str, ...] = ()
  reversible: bool = False

  @property
  def module(self) -> ModuleType:
    return importlib.import_module(self.module_name)

  @property
  def model_class(self) -> type:
    return getattr(self.module, self.class_name)

  @property
  def presets(self) -> tuple[str, ...]:
    return tuple(self.module.PRESETS)

  def classifier_head(self, cfg) -> tuple[str, ...]:
    """The attribute names of the linears that make a model's classification head (its
    module's ``classifier_head(cfg)``: trained in full under LoRA); none for a family
    without one (LLaMA: an LM head, frozen under LoRA as peft's CAUSAL_LM leaves it)."""
    head = getattr(self.module, "classifier_head", None)
    return () if head is None else head(cfg)

  def config(self, preset: str, **overrides):
    """The preset's config with fields overridden (errors name the valid ones)."""
    return self.module.config(preset, **overrides)

  def build(self, cfg, policy="baseline", *, dtype=jnp.bfloat16, rngs=None) -> nnx.Module:
    return self.model_class(cfg, policy, dtype=dtype, rngs=rngs)


FAMILIES = (
    Family("vit", "models.vit", "ViT", "image", ("image",), ("vit",)),
    Family("revvit", "models.revvit", "RevViT", "image", ("image",), reversible=True),
    Family("llama", "models.llama", "Llama", "tokens", ("lm",), ("llama",)),
    Family("revllama", "models.revllama", "RevLlama", "tokens", ("lm",), reversible=True),
    Family("bert", "models.bert", "Bert", "tokens", ("text",), ("bert", "roberta")),
)


def all_presets() -> dict[str, Family]:
  """Every preset name and its family."""
  return {name: f for f in FAMILIES for name in f.presets}


def family(preset: str) -> Family:
  """The family of the preset ``preset``; ValueError naming every preset otherwise."""
  presets = all_presets()
  if preset not in presets:
    raise ValueError(f"unknown model {preset!r}; valid presets: {', '.join(presets)} "
                     "(or pretrained=<HF directory>)")
  return presets[preset]


def family_of(model: nnx.Module) -> Family:
  """The family of a built model (by its class)."""
  for f in FAMILIES:
    if type(model) is f.model_class:
      return f
  raise ValueError(f"{type(model).__name__} is not a registered model family")


def hf_model_types() -> tuple[str, ...]:
  """Every HF ``model_type`` some family loads."""
  return tuple(t for f in FAMILIES for t in f.hf_model_types)


def hf_family(model_type: str) -> Family:
  """The family that loads HF checkpoints of ``model_type``."""
  from models.hf_state import CheckpointError
  for f in FAMILIES:
    if model_type in f.hf_model_types:
      return f
  raise CheckpointError(f"unsupported model_type {model_type!r}; supported: "
                        f"{', '.join(hf_model_types())}")


def config(preset: str, **overrides):
  """The config of ``preset`` with ``overrides`` applied."""
  return family(preset).config(preset, **overrides)


def build(preset: str, policy="baseline", *, dtype=jnp.bfloat16, rngs=None, **overrides):
  """The model of ``preset`` (fields ``overrides``) under ``policy``."""
  f = family(preset)
  return f.build(f.config(preset, **overrides), policy, dtype=dtype, rngs=rngs)
