"""LLaMA (decoder-only, causal LM) on the memory policy, with Hugging Face interop.

Blocks: pre-RMSNorm -> self-attention (causal, grouped-query, no biases, RoPE in HF's
rotate-half form) -> residual; pre-RMSNorm -> SwiGLU MLP -> residual. A final RMSNorm
and the LM head (its own linear, or the embedding transposed when ``tie_embeddings``).

Under MS norms (``policy.merges_norm_affine``) the norms hold no parameters: each norm's
scale is merged into the linears that read it (input norm -> q, k, v; post-attention
norm -> gate, up; final norm -> lm_head), so each norm saves only its output (the very
array those linears save) and an fp32 ``rstd`` per row. With tied embeddings the final
norm's scale cannot live in the shared embedding: it is kept as ``head_scale`` and
applied to the head's weight (not to the activation), so the norm output is still the
array the head saves; the fused loss applies it inside each pass (no scaled copy of the
table is kept for backward).

Loss: ``model.token_losses(tokens, targets, chunk=...)`` gives the per-token cross-entropy
of the logits ``model(tokens)`` returns without making them: the head fused with its loss
in token chunks (:mod:`lowmem_jax.lm_loss`) when it is one plain matmul, else (a
LoRA-wrapped head) from the logits. RevLlama (:mod:`models.revllama`) shares it.

HF interop (``models.hf`` dispatches here for ``model_type == "llama"``):
``config_from_hf``, ``config_to_hf``, ``hf_map`` (HF names of our variables),
``HF_IGNORED_KEYS``.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowmem_jax import baseline
from lowmem_jax.lm_loss import DEFAULT_CHUNK, chunked_cross_entropy, logits_cross_entropy
from lowmem_jax.policy import MemoryPolicy
from lowmem_jax.quantized_weight import QuantizedKernel, frozen_dense
from models.attention import SelfAttention
from models.config import check_positive, hf_value, init_model, make_config, token_ids
from models.embedding import Embed, table_value
from models.hf_state import CheckpointError, Linear as HFLinear, Norm as HFNorm, Tensor
from models.linear import Linear
from models.mlp import GatedMlp
from models.norm import Norm
from models import rope
from models.rope import apply_rope, rope_tables  # noqa: F401  (re-exported)
from models.sites import as_array, seed_sites
from models.stack import BlockStack


# ----------------------------------------------------------------------------- config
@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """LLaMA hyper-parameters. ``head_dim=None`` means ``dim // num_heads`` (see
  :attr:`resolved_head_dim`); kept unresolved so ``dataclasses.replace(cfg, dim=...)``
  stays consistent."""
  vocab_size: int = 32000
  dim: int = 4096
  num_layers: int = 32
  num_heads: int = 32
  num_kv_heads: int = 32
  head_dim: int | None = None
  mlp_dim: int = 11008
  max_seq_len: int = 4096
  rope_theta: float = 10000.0
  # RoPE scaling (HF's rope_scaling / rope_parameters): "default", "linear" (factor) or
  # "llama3" (all four; Llama 3.1/3.2 use factor 8 or 32, 1, 4, 8192)
  rope_type: str = "default"
  rope_factor: float = 1.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_seq_len: int = 8192
  eps: float = 1e-5            # rms_norm_eps
  tie_embeddings: bool = False
  model_type: str = "llama"
  # special token ids, from a checkpoint's config.json and written back on export (HF's
  # generate() stops on eos; Llama 3 has several): HF LlamaConfig's defaults
  bos_token_id: int | None = 1
  eos_token_id: int | tuple[int, ...] | None = 2
  pad_token_id: int | None = None

  def __post_init__(self):
    check_positive(self, ints=("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads",
                               "mlp_dim", "max_seq_len"), numbers=("rope_theta", "eps"))
    rope.check_scaling("LlamaConfig", self.rope_type, self.rope_factor,
                       self.rope_low_freq_factor, self.rope_high_freq_factor,
                       self.rope_original_max_seq_len)
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"LlamaConfig: num_heads {self.num_heads} is not a multiple of "
                       f"num_kv_heads {self.num_kv_heads}")
    if self.head_dim is None:
      if self.dim % self.num_heads:
        raise ValueError(f"LlamaConfig: dim {self.dim} is not divisible by num_heads "
                         f"{self.num_heads}; set head_dim explicitly")
    else:
      check_positive(self, ints=("head_dim",))
    if self.resolved_head_dim % 2:
      raise ValueError(f"LlamaConfig: head_dim {self.resolved_head_dim} must be even (RoPE "
                       "rotates pairs of halves)")
    if not isinstance(self.tie_embeddings, (bool, np.bool_)):
      raise ValueError(f"LlamaConfig: tie_embeddings must be a bool, got "
                       f"{self.tie_embeddings!r}")
    if self.model_type != "llama":
      raise ValueError(f"LlamaConfig: model_type must be 'llama', got {self.model_type!r}")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
      value = getattr(self, name)
      ids = value if isinstance(value, tuple) else (value,)
      if value is not None and not all(
          isinstance(i, (int, np.integer)) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"LlamaConfig: {name} must be a token id >= 0"
                         f"{' (or a tuple of them)' if name == 'eos_token_id' else ''} or "
                         f"None, got {value!r}")

  @property
  def max_tokens(self) -> int:
    """The longest sequence the model takes (its context, ``max_seq_len``)."""
    return self.max_seq_len

  @property
  def resolved_head_dim(self) -> int:
    return self.dim // self.num_heads if self.head_dim is None else int(self.head_dim)

  def rope_tables(self, seq_len: int, dtype):
    """RoPE's ``cos, sin`` for positions ``0..seq_len-1`` (:mod:`models.rope`)."""
    inv_freq = rope.inv_frequencies(
        self.resolved_head_dim, self.rope_theta, self.rope_type, self.rope_factor,
        self.rope_low_freq_factor, self.rope_high_freq_factor, self.rope_original_max_seq_len)
    return rope_tables(seq_len, inv_freq, dtype)


PRESETS: dict[str, dict] = {
    # A small random model for tests and smoke runs (GQA: 4 heads, 2 kv heads).
    "llama-tiny": dict(vocab_size=256, dim=64, num_layers=2, num_heads=4, num_kv_heads=2,
                       mlp_dim=176, max_seq_len=256),
    # Llama-2-7b / -13b shapes (rms_norm_eps 1e-5, rope_theta 1e4, context 4096).
    "llama-7b": dict(vocab_size=32000, dim=4096, num_layers=32, num_heads=32,
                     num_kv_heads=32, mlp_dim=11008, max_seq_len=4096),
    "llama-13b": dict(vocab_size=32000, dim=5120, num_layers=40, num_heads=40,
                      num_kv_heads=40, mlp_dim=13824, max_seq_len=4096),
}


def config(name: str = "llama-tiny", **overrides) -> LlamaConfig:
  """A preset's config with fields overridden, e.g. ``config("llama-7b", num_layers=2)``;
  an unknown preset or field is a ValueError naming the valid ones."""
  return make_config(LlamaConfig, PRESETS, name, overrides)


def _replace(cfg: LlamaConfig, overrides: dict) -> LlamaConfig:
  return make_config(LlamaConfig, {"cfg": dataclasses.asdict(cfg)}, "cfg", overrides)


# ----------------------------------------------------------------------------- model
class LlamaBlock(nnx.Module):
  """Pre-RMSNorm attention and SwiGLU MLP, each with a residual connection."""

  def __init__(self, cfg: LlamaConfig, policy: MemoryPolicy, *, dtype, rngs: nnx.Rngs):
    self.norm1 = Norm(cfg.dim, kind="rms", eps=cfg.eps, policy=policy)
    self.attn = SelfAttention(cfg.dim, cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                              head_dim=cfg.resolved_head_dim, qkv_bias=False,
                              out_bias=False, causal=True, policy=policy, dtype=dtype,
                              rngs=rngs)
    self.norm2 = Norm(cfg.dim, kind="rms", eps=cfg.eps, policy=policy)
    self.mlp = GatedMlp(cfg.dim, cfg.mlp_dim, activation="silu", policy=policy, dtype=dtype,
                        rngs=rngs)

  def __call__(self, x, cos, sin, mask):
    x = x + self.attn(self.norm1(x), mask=mask, rope=(cos, sin))
    return x + self.mlp(self.norm2(x))


class Llama(nnx.Module):
  """LLaMA causal LM: ``model(tokens[B, T], mask=None) -> logits[B, T, V]`` (float32).

  ``policy``: a :class:`MemoryPolicy` or its spec string. Parameters are fp32; compute
  runs in ``dtype`` (the embedding output is cast to it). ``rngs`` defaults to
  ``nnx.Rngs(0)``.
  """

  def __init__(self, cfg: LlamaConfig | str, policy: MemoryPolicy | str = "baseline", *,
               dtype=jnp.bfloat16, rngs: nnx.Rngs | None = None):
    rngs = init_model(self, cfg, config, LlamaConfig, policy, dtype, rngs)
    cfg = self.cfg
    init = nnx.initializers.normal(stddev=0.02)  # HF's initializer_range
    self.embed = Embed(cfg.vocab_size, cfg.dim, embedding_init=init, rngs=rngs)
    self.stack = BlockStack(lambda r: LlamaBlock(cfg, self.policy, dtype=self.dtype, rngs=r),
                            cfg.num_layers, self.policy, rngs)
    self.norm = Norm(cfg.dim, kind="rms", eps=cfg.eps, policy=self.policy)
    if cfg.tie_embeddings:
      self.lm_head = None
      # The final norm's scale, merged into the (tied) head weight at call time.
      self.head_scale = (nnx.Param(jnp.ones((cfg.dim,), jnp.float32))
                         if self.policy.merges_norm_affine else None)
    else:
      self.lm_head = Linear(cfg.dim, cfg.vocab_size, use_bias=False, dtype=self.dtype,
                            preferred_element_type=jnp.float32, kernel_init=init,
                            rngs=rngs, policy=self.policy, reads_norm=True)
      self.head_scale = None
    seed_sites(self, rngs)

  def __call__(self, tokens, mask=None):
    return self.head(self.hidden(tokens, mask))

  def hidden(self, tokens, mask=None):
    """The final norm's output ``[B, T, D]`` in the compute dtype (carried where the
    policy carries it): what the head reads."""
    tokens = token_ids(tokens, "Llama", self.cfg.max_seq_len)
    b, t = tokens.shape
    attn_mask = None
    if mask is not None:
      mask = jnp.asarray(mask)
      if mask.shape != (b, t):
        raise ValueError(f"Llama: mask must have shape [batch, seq] = {[b, t]}, got "
                         f"{list(mask.shape)}")
      attn_mask = mask.astype(jnp.bool_)[:, None, None, :]  # keys only; causal is separate

    x = self.embed(tokens).astype(self.dtype)
    cos, sin = self.cfg.rope_tables(t, self.dtype)
    return self.norm(self.stack(x, cos, sin, attn_mask))

  def head(self, h):
    """Logits ``[B, T, V]`` (float32) of :meth:`hidden`'s output."""
    if self.lm_head is not None:
      return self.lm_head(h).astype(jnp.float32)
    h = as_array(h)  # the tied head keeps h itself
    w = self._tied_weight()
    if isinstance(w, QuantizedKernel):  # a frozen stored table: dequantized inside the op
      return frozen_dense(h, w, contract=1, dtype=self.dtype, preferred=jnp.float32,
                          transposed=True)
    return jnp.einsum("btd,vd->btv", h, w.astype(self.dtype),
                      preferred_element_type=jnp.float32)

  def _tied_weight(self):
    """The embedding ``[V, D]`` as the tied head multiplies by it: with the final norm's
    merged scale applied, that product in the compute dtype; else the table as stored
    (fp32, or a frozen ``QuantizedKernel``: one copy serves lookup and head)."""
    table = self.embed.embedding[...]
    if self.head_scale is None:
      return table
    return (table_value(table) * self.head_scale[...][None, :]).astype(self.dtype)

  def head_weight(self):
    """``(w, transposed, scale)``: the head as one matmul ``h @ (w * scale)`` (``w [D,
    V]``, or ``[V, D]`` with ``transposed``, as stored, a frozen ``QuantizedKernel``
    included; cast or dequantized to the compute dtype inside the matmul; ``scale [D]``
    the tied head's merged norm scale, or None), or None when it is not a plain
    matmul."""
    if self.lm_head is None:
      scale = None if self.head_scale is None else self.head_scale[...]
      return self.embed.embedding[...], True, scale
    kernel = plain_kernel(self.lm_head)
    return None if kernel is None else (kernel, False, None)

  def token_losses(self, tokens, targets, mask=None, *, chunk: int = DEFAULT_CHUNK):
    """Per-token ``(cross-entropy fp32 [B, T], argmax == target [B, T])`` of the logits
    ``self(tokens, mask)`` returns: see :func:`head_losses`."""
    return head_losses(self.hidden(tokens, mask), self.head, self.head_weight(), targets,
                       chunk)


def plain_kernel(head):
  """``head``'s kernel ``[D, V]`` as stored (fp32 or a frozen ``QuantizedKernel``) when
  ``head`` computes exactly ``h @ kernel`` in its declared compute dtype (that of ``h``):
  our Linear with no bias whose strategy is the baseline's. None otherwise (LoRA-wrapped,
  held unmerged from the final norm, a sampled or stateful strategy)."""
  if (type(head) is not Linear or head.bias is not None or head.dtype is None
      or head.affine_at_call or head.saving.state_names
      or type(head.saving.strategy) is not baseline.Linear):
    return None
  return head.kernel[...]


def head_losses(h, head, weight, targets, chunk: int):
  """Per-token ``(losses, correct)`` of ``head(h)``'s logits: with ``chunk > 0`` and a
  plain head (``weight``: ``(w, transposed)``, not None) the fused, chunked
  :func:`lowmem_jax.lm_loss.chunked_cross_entropy` (``weight``: ``(w, transposed,
  scale)``) on ``h``'s value (no ``[B, T, V]``
  fp32 array; it saves ``h`` itself even where ``h`` comes carried: under Mesa the
  head's weight gradient is then exact, not from the code), else
  :func:`lowmem_jax.lm_loss.logits_cross_entropy` of ``head(h)``."""
  if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
    raise ValueError(f"head_losses: chunk must be an int >= 0 (0: the logits path), got "
                     f"{chunk!r}")
  targets = jnp.asarray(targets)
  if chunk and weight is not None:
    w, transposed, scale = weight
    return chunked_cross_entropy(as_array(h), w, targets, chunk=chunk,
                                 transposed=transposed, scale=scale)
  return logits_cross_entropy(head(h), targets)


# ----------------------------------------------------------------------------- HF interop
HF_IGNORED_KEYS = ("rotary_emb.inv_freq",)

_HF_UNSUPPORTED = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}


def config_from_hf(hf: dict, **overrides) -> LlamaConfig:
  """Our config from a HF ``config.json`` dict (``rope_theta`` top-level and RoPE scaling
  in ``rope_scaling``, as in transformers 4.x, or both in ``rope_parameters``, as in 5.x).
  Unsupported features (another RoPE scaling, biases, another activation) are a
  :class:`CheckpointError`."""
  if hf.get("model_type", "llama") != "llama":
    raise CheckpointError(f"config_from_hf: model_type {hf.get('model_type')!r} is not 'llama'")
  for key, want in _HF_UNSUPPORTED.items():
    if hf.get(key, want) not in (want, None):
      raise CheckpointError(f"config_from_hf: {key}={hf[key]!r} is not supported "
                            f"(only {want!r})")
  dim, heads = hf_value(hf, "hidden_size", int), hf_value(hf, "num_attention_heads", int)
  head_dim = hf_value(hf, "head_dim", int, None)
  if head_dim is not None and heads > 0 and dim % heads == 0 and head_dim == dim // heads:
    head_dim = None  # the default: keep configs canonical
  cfg = LlamaConfig(
      vocab_size=hf_value(hf, "vocab_size", int), dim=dim,
      num_layers=hf_value(hf, "num_hidden_layers", int), num_heads=heads,
      num_kv_heads=hf_value(hf, "num_key_value_heads", int, heads), head_dim=head_dim,
      mlp_dim=hf_value(hf, "intermediate_size", int),
      max_seq_len=hf_value(hf, "max_position_embeddings", int, 2048),
      eps=hf_value(hf, "rms_norm_eps", float, 1e-6),
      tie_embeddings=hf_value(hf, "tie_word_embeddings", bool, False),
      **_rope_from_hf(hf), **_special_tokens(hf))
  return _replace(cfg, overrides)


# HF's RoPE scaling keys -> our fields, for the rope types we compute
_HF_ROPE_KEYS = {"factor": ("rope_factor", float),
                 "low_freq_factor": ("rope_low_freq_factor", float),
                 "high_freq_factor": ("rope_high_freq_factor", float),
                 "original_max_position_embeddings": ("rope_original_max_seq_len", int)}


def _rope_from_hf(hf: dict) -> dict:
  """Our RoPE fields of a HF config dict: ``rope_parameters`` (5.x) or ``rope_scaling``
  (4.x; ``type`` in older files), ``rope_theta`` in the former or top-level."""
  params, legacy = hf.get("rope_parameters") or {}, hf.get("rope_scaling") or {}
  for key, value in (("rope_parameters", params), ("rope_scaling", legacy)):
    if not isinstance(value, dict):
      raise CheckpointError(f"config_from_hf: {key} must be an object, got {value!r}")
  kinds = [r.get("rope_type", r.get("type", "default")) for r in (params, legacy)]
  if params and legacy and (kinds[0] != kinds[1] or any(
      params.get(k) != legacy.get(k) for k in _HF_ROPE_KEYS if k in params or k in legacy)):
    # transformers 4.x reads the one, 5.x the other: which is meant cannot be told
    raise CheckpointError(f"config_from_hf: rope_parameters ({kinds[0]}) and rope_scaling "
                          f"({kinds[1]}) disagree: {params} vs {legacy}")
  scaling, kind = (params, kinds[0]) if params else (legacy, kinds[1])
  if kind not in rope.ROPE_TYPES:
    raise CheckpointError(f"config_from_hf: rope_type {kind!r} is not supported (only "
                          f"{', '.join(map(repr, rope.ROPE_TYPES))})")
  if scaling.get("partial_rotary_factor", 1.0) != 1.0:
    raise CheckpointError(f"config_from_hf: partial_rotary_factor="
                          f"{scaling['partial_rotary_factor']!r} is not supported (only 1.0)")
  fields = {"rope_type": kind,
            "rope_theta": hf_value(params, "rope_theta", float,
                                   hf_value(hf, "rope_theta", float, 10000.0))}
  where = "rope_parameters" if params else "rope_scaling"
  # absent, the original context is the model's own (transformers' default too)
  defaults = {"original_max_position_embeddings": hf.get("max_position_embeddings")}
  for key, (field, type_) in _HF_ROPE_KEYS.items():
    if field in rope.ROPE_TYPES[kind]:
      try:
        fields[field] = hf_value({**defaults, **scaling}, key, type_)
      except KeyError:
        raise CheckpointError(f"config_from_hf: {where} has no {key!r}, which rope_type "
                              f"{kind!r} needs") from None
      except ValueError as e:
        raise CheckpointError(f"config_from_hf: {where}: {e}") from None
  return fields


def _special_tokens(hf: dict) -> dict:
  """bos/eos/pad token ids of a HF config dict (absent: HF LlamaConfig's defaults; a list
  of eos ids as a tuple)."""
  eos = hf.get("eos_token_id", 2)
  return {"bos_token_id": hf.get("bos_token_id", 1),
          "eos_token_id": tuple(eos) if isinstance(eos, list) else eos,
          "pad_token_id": hf.get("pad_token_id")}


def config_to_hf(cfg: LlamaConfig) -> dict:
  """A HF ``config.json`` dict for ``LlamaForCausalLM`` (readable by transformers 4.x and
  5.x: ``rope_theta`` both top-level and in ``rope_parameters``)."""
  return {
      "architectures": ["LlamaForCausalLM"],
      "model_type": "llama",
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.dim,
      "intermediate_size": cfg.mlp_dim,
      "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.resolved_head_dim,
      "hidden_act": "silu",
      "max_position_embeddings": cfg.max_seq_len,
      "rms_norm_eps": cfg.eps,
      **_rope_to_hf(cfg),
      "tie_word_embeddings": bool(cfg.tie_embeddings),
      "attention_bias": False,
      "attention_dropout": 0.0,
      "mlp_bias": False,
      "initializer_range": 0.02,
      "pretraining_tp": 1,
      "use_cache": True,
      "bos_token_id": cfg.bos_token_id,
      "eos_token_id": (list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple)
                       else cfg.eos_token_id),
      "pad_token_id": cfg.pad_token_id,
      "torch_dtype": "float32",
  }


def _rope_to_hf(cfg: LlamaConfig) -> dict:
  """RoPE's keys of a HF config dict: ``rope_theta`` top-level and a scaling in
  ``rope_scaling`` (transformers 4.x), both in ``rope_parameters`` (5.x)."""
  scaling = {key: getattr(cfg, field) for key, (field, _) in _HF_ROPE_KEYS.items()
             if field in rope.ROPE_TYPES[cfg.rope_type]}
  scaling = {"rope_type": cfg.rope_type, **scaling}
  out = {"rope_theta": float(cfg.rope_theta),
         "rope_parameters": {**scaling, "rope_theta": float(cfg.rope_theta)}}
  if cfg.rope_type != "default":
    out["rope_scaling"] = scaling
  return out


def hf_map(cfg: LlamaConfig, keys=None) -> list:
  """HF ``LlamaForCausalLM`` names of our variables (:mod:`models.hf_state`). With tied
  embeddings the final norm's scale is kept as ``head_scale`` when the policy merges it
  (the head is the embedding: nothing to merge into). A ``LlamaModel`` save (names
  without ``model.``, no ``lm_head``: embedding models ship so) loads as transformers'
  ``LlamaForCausalLM`` does: in full with tied embeddings; untied, ``lm_head`` missing."""
  m = ("" if keys is not None and "embed_tokens.weight" in keys
       and "model.embed_tokens.weight" not in keys else "model.")
  entries = [Tensor(f"{m}embed_tokens.weight", "embed.embedding")]
  for i in range(cfg.num_layers):
    hf, ours = f"{m}layers.{i}", "stack.blocks"
    norm1, norm2 = f"{hf}.input_layernorm", f"{hf}.post_attention_layernorm"
    entries += [HFNorm(norm1, f"{ours}.norm1", i, bias=False),
                HFNorm(norm2, f"{ours}.norm2", i, bias=False)]
    entries += [HFLinear(f"{hf}.self_attn.{n}_proj", f"{ours}.attn.{m}", i, norm=norm1)
                for n, m in (("q", "query"), ("k", "key"), ("v", "value"))]
    entries += [HFLinear(f"{hf}.self_attn.o_proj", f"{ours}.attn.out", i)]
    entries += [HFLinear(f"{hf}.mlp.{n}_proj", f"{ours}.mlp.{n}", i, norm=norm2)
                for n in ("gate", "up")]
    entries += [HFLinear(f"{hf}.mlp.down_proj", f"{ours}.mlp.down", i)]
  if not cfg.tie_embeddings:
    return entries + [HFNorm(f"{m}norm", "norm", bias=False),
                      HFLinear("lm_head", "lm_head", norm=f"{m}norm")]
  if keys is not None and "lm_head.weight" in keys:  # some exports write the tied copy too
    entries.append(Tensor("lm_head.weight", "embed.embedding",
                          copy_of=f"{m}embed_tokens.weight"))
  return entries + [HFNorm(f"{m}norm", "norm", bias=False, kept=("head_scale", None))]
