"""Vision Transformer (pre-LN), Flax NNX, on the memory policy; HF ``ViTForImageClassification``.

``ViT(cfg, policy="lowmembp", rngs=nnx.Rngs(0))`` on ``[B, H, W, C]`` images returns
``[B, num_labels]`` logits. The policy picks each block's norm (standard or MS, whose
affine then lives merged in q/k/v and fc1), activation (GELU or ReGELU2), attention and
remat; the model never branches on preset names. The final norm is applied to the class
token only (LayerNorm is per token, so this is HF's function) and, under MS norms, its
affine is merged into the classifier.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from lowmem_jax.policy import MemoryPolicy
from models.attention import SelfAttention
from models.config import check_positive, hf_value, init_model, make_config, replace_fields
from models.hf_state import CheckpointError, Linear as HFLinear, Norm as HFNorm, Tensor
from models.linear import Linear
from models.mlp import Mlp
from models.norm import Norm
from models.sites import seed_sites
from models.stack import BlockStack


@dataclasses.dataclass(frozen=True)
class ViTConfig:
  image_size: int = 224
  patch_size: int = 16
  channels: int = 3
  dim: int = 768
  num_layers: int = 12
  num_heads: int = 12
  mlp_dim: int = 3072
  num_labels: int = 1000
  eps: float = 1e-12
  qkv_bias: bool = True
  model_type: str = "vit"

  def __post_init__(self):
    check_positive(self, ints=("image_size", "patch_size", "channels", "dim", "num_layers",
                               "num_heads", "mlp_dim", "num_labels"), numbers=("eps",))
    if self.image_size % self.patch_size:
      raise ValueError(f"ViTConfig: image_size {self.image_size} is not a multiple of "
                       f"patch_size {self.patch_size}")
    if self.dim % self.num_heads:
      raise ValueError(f"ViTConfig: dim {self.dim} not divisible by {self.num_heads} heads")

  @property
  def num_patches(self) -> int:
    return (self.image_size // self.patch_size) ** 2


PRESETS = {
    "vit-ti16": dict(dim=192, num_layers=12, num_heads=3, mlp_dim=768),
    "vit-s16": dict(dim=384, num_layers=12, num_heads=6, mlp_dim=1536),
    "vit-b16": dict(dim=768, num_layers=12, num_heads=12, mlp_dim=3072),
    "vit-l16": dict(dim=1024, num_layers=24, num_heads=16, mlp_dim=4096),
    "vit-tiny": dict(image_size=32, patch_size=8, dim=64, num_layers=2, num_heads=4,
                     mlp_dim=128, num_labels=10),
    # scikit-learn's 8x8 digits: 16 patches of 2x2 pixels, 10 classes
    "vit-digits": dict(image_size=8, patch_size=2, channels=1, dim=64, num_layers=4,
                       num_heads=4, mlp_dim=256, num_labels=10, eps=1e-6),
}


def config(name: str = "vit-b16", **overrides) -> ViTConfig:
  """A preset's config with fields overridden (``config("vit-b16", num_layers=2)``)."""
  return make_config(ViTConfig, PRESETS, name, overrides)


def check_qkv_bias(cfg: ViTConfig, policy: MemoryPolicy) -> None:
  """MS norms merge each LayerNorm's shift into the bias of the linears that read it
  (``models.linear``): without a bias on q, k and v the shift would be dropped (a
  ``qkv_bias: false`` checkpoint could not load; a fresh model could not learn it)."""
  if policy.merges_norm_affine and not cfg.qkv_bias:
    raise ValueError(f"qkv_bias=False with policy {str(policy)!r}: its MS norms merge the "
                     "LayerNorm's shift into the biases of query, key and value, which this "
                     "config does not have; use a policy without MS norms (e.g. 'baseline', "
                     "'mesa8', 'approx-bp') or qkv_bias=True")


class ViTBlock(nnx.Module):
  """``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``."""

  def __init__(self, cfg: ViTConfig, policy: MemoryPolicy, dtype, rngs: nnx.Rngs):
    self.norm1 = Norm(cfg.dim, eps=cfg.eps, policy=policy)
    self.attn = SelfAttention(cfg.dim, cfg.num_heads, qkv_bias=cfg.qkv_bias, policy=policy,
                              dtype=dtype, rngs=rngs)
    self.norm2 = Norm(cfg.dim, eps=cfg.eps, policy=policy)
    self.mlp = Mlp(cfg.dim, cfg.mlp_dim, activation="gelu", policy=policy, dtype=dtype,
                   rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.norm1(x))
    return x + self.mlp(self.norm2(x))


class ViT(nnx.Module):

  def __init__(self, cfg: ViTConfig | str = "vit-b16", policy: MemoryPolicy | str = "baseline",
               *, dtype=jnp.bfloat16, rngs: nnx.Rngs | None = None):
    rngs = init_model(self, cfg, config, ViTConfig, policy, dtype, rngs)
    c = self.cfg
    check_qkv_bias(c, self.policy)
    init_embeddings(self, c, dtype, rngs)
    self.stack = BlockStack(lambda r: ViTBlock(c, self.policy, dtype, r), c.num_layers,
                            self.policy, rngs)
    self.norm = Norm(c.dim, eps=c.eps, policy=self.policy)
    self.head = Linear(c.dim, c.num_labels, dtype=dtype, rngs=rngs, policy=self.policy,
                       reads_norm=True)
    seed_sites(self, rngs)

  def __call__(self, images):
    x = self.stack(embed(self, images))
    return self.head(self.norm(x[:, 0])).astype(jnp.float32)


def init_embeddings(model: nnx.Module, c: ViTConfig, dtype, rngs: nnx.Rngs) -> None:
  """Gives ``model`` ViT's patch embedding, class token and position embedding."""
  model.patch_embed = nnx.Conv(c.channels, c.dim, kernel_size=(c.patch_size, c.patch_size),
                               strides=(c.patch_size, c.patch_size), padding="VALID",
                               dtype=dtype, rngs=rngs)
  init = nnx.initializers.truncated_normal(0.02)
  model.cls_token = nnx.Param(init(rngs.params(), (1, 1, c.dim), jnp.float32))
  model.pos_embed = nnx.Param(init(rngs.params(), (1, c.num_patches + 1, c.dim), jnp.float32))


def embed(model: nnx.Module, images):
  """``[B, H, W, C]`` images -> ``[B, 1 + patches, dim]`` tokens in ``model.dtype``."""
  c = model.cfg
  if images.ndim != 4 or images.shape[1:] != (c.image_size, c.image_size, c.channels):
    raise ValueError(f"{type(model).__name__} expects images [B, {c.image_size}, "
                     f"{c.image_size}, {c.channels}], got {list(images.shape)}")
  x = model.patch_embed(images.astype(model.dtype))
  x = x.reshape(x.shape[0], -1, c.dim)
  cls = jnp.broadcast_to(model.cls_token[...].astype(model.dtype), (x.shape[0], 1, c.dim))
  return jnp.concatenate([cls, x], axis=1) + model.pos_embed[...].astype(model.dtype)


def classifier_head(cfg: ViTConfig) -> tuple[str, ...]:
  """The model's linears that make its classification head (trained in full under LoRA:
  ``models.lora.apply_lora``'s ``modules_to_save``)."""
  del cfg
  return ("head",)


# ----------------------------------------------------------------------------- HF interop
# ViTModel's pooler (dense + tanh on the class token): ViTForImageClassification has none
# and its head reads the normed class token, as ours does
HF_IGNORED_KEYS = ("pooler.",)
# the classification head: absent from a ViTModel checkpoint (e.g. ImageNet-21k
# pretraining), replaced by a fresh one under ``load_pretrained(new_head=True)``
HF_HEAD_KEYS = ("classifier.",)


def config_from_hf(hf: dict, **overrides) -> ViTConfig:
  num_labels = (len(hf["id2label"]) if "id2label" in hf
                else hf_value(hf, "num_labels", int, 1000))
  fields = dict(image_size=hf_value(hf, "image_size", int),
                patch_size=hf_value(hf, "patch_size", int),
                channels=hf_value(hf, "num_channels", int, 3),
                dim=hf_value(hf, "hidden_size", int),
                num_layers=hf_value(hf, "num_hidden_layers", int),
                num_heads=hf_value(hf, "num_attention_heads", int),
                mlp_dim=hf_value(hf, "intermediate_size", int),
                eps=hf_value(hf, "layer_norm_eps", float, 1e-12),
                qkv_bias=hf_value(hf, "qkv_bias", bool, True), num_labels=num_labels)
  if hf.get("hidden_act", "gelu") != "gelu":
    raise CheckpointError(f"config_from_hf: hidden_act {hf['hidden_act']!r} is not "
                          "supported; only the exact-erf 'gelu'")
  return replace_fields(ViTConfig(**fields), overrides)


def config_to_hf(cfg: ViTConfig) -> dict:
  return dict(model_type="vit", architectures=["ViTForImageClassification"],
              image_size=cfg.image_size, patch_size=cfg.patch_size,
              num_channels=cfg.channels, hidden_size=cfg.dim,
              num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
              intermediate_size=cfg.mlp_dim, layer_norm_eps=cfg.eps, qkv_bias=cfg.qkv_bias,
              hidden_act="gelu", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
              id2label={str(i): f"LABEL_{i}" for i in range(cfg.num_labels)},
              label2id={f"LABEL_{i}": i for i in range(cfg.num_labels)})


def hf_map(cfg: ViTConfig, keys=None) -> list:
  """HF ``ViTForImageClassification`` names of our variables (:mod:`models.hf_state`);
  a ``ViTModel`` checkpoint (names without ``vit.``, no ``classifier``) keeps the
  model's fresh head, merged with the final norm like a loaded one under MS norms."""
  prefix = "" if keys is not None and "embeddings.cls_token" in keys else "vit."
  emb = f"{prefix}embeddings"
  entries = [
      Tensor(f"{emb}.cls_token", "cls_token"),
      Tensor(f"{emb}.position_embeddings", "pos_embed"),
      Tensor(f"{emb}.patch_embeddings.projection.weight", "patch_embed.kernel",
             to_ours=lambda w: w.transpose(2, 3, 1, 0), to_hf=lambda w: w.transpose(3, 2, 0, 1)),
      Tensor(f"{emb}.patch_embeddings.projection.bias", "patch_embed.bias")]
  for i in range(cfg.num_layers):
    hf, ours = f"{prefix}encoder.layer.{i}", "stack.blocks"
    norm1, norm2 = f"{hf}.layernorm_before", f"{hf}.layernorm_after"
    entries += [HFNorm(norm1, f"{ours}.norm1", i), HFNorm(norm2, f"{ours}.norm2", i)]
    entries += [HFLinear(f"{hf}.attention.attention.{n}", f"{ours}.attn.{n}", i, norm=norm1)
                for n in ("query", "key", "value")]
    entries += [HFLinear(f"{hf}.attention.output.dense", f"{ours}.attn.out", i),
                HFLinear(f"{hf}.intermediate.dense", f"{ours}.mlp.fc1", i, norm=norm2),
                HFLinear(f"{hf}.output.dense", f"{ours}.mlp.fc2", i)]
  headless = keys is not None and not any(k.startswith(HF_HEAD_KEYS) for k in keys)
  return entries + [HFNorm(f"{prefix}layernorm", "norm"),
                    HFLinear("classifier", "head", norm=f"{prefix}layernorm",
                             keep_weights=headless)]