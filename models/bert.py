"""BERT and RoBERTa (post-LN encoders) for sequence classification, on the memory policy.

Embeddings (word + position + token type, then a standard LayerNorm with its affine), then
``num_layers`` post-LN layers::

    x = LN1(x + attn_out(attn(x)))
    x = LN2(x + fc2(gelu(fc1(x))))          # exact-erf GELU (policy activation "gelu")

and a head on token 0: ``classifier(tanh(pooler(x[:, 0])))`` (BERT's pooler + classifier;
RoBERTa's ``classifier.dense`` + ``classifier.out_proj`` have the same shape of function).
RoBERTa differs from BERT only in its position ids (they start at ``pad_token_id + 1``,
padding tokens get ``pad_token_id``, as HF does) and in HF parameter names.

MS norms (``policy.merges_norm_affine``). LN1/LN2 become ``models.norm.Norm`` without
parameters (MS-LayerNorm): each saves for backward only its output ``y`` and an fp32 rstd,
and ``y`` is the very array the following linears save as their input. A post-LN norm
output has two readers, so its affine ``(gamma, beta)`` lives twice:

* merged into the linear(s) reading ``y`` (``merge_norm_affine``, float64, at import):
  LN1 -> ``fc1`` of the same layer; LN2 -> ``q/k/v`` of the next layer; the last LN2 ->
  the pooler dense (RoBERTa: ``classifier.dense``);
* re-applied on the residual path, ``h = gamma * y + beta``, with ``gamma``/``beta`` kept
  as parameters of the layer (``attention_affine``/``output_affine``,
  :class:`ResidualAffine`). Its backward needs ``y`` (for d gamma), the same shared array,
  so it saves nothing new. The hidden state ``encode`` returns is ``h`` of the last layer.

A layer takes ``y`` (what its q/k/v read) and the previous layer's ``output_affine`` and
rebuilds ``h`` itself, so under remat a layer boundary keeps one array, not two. Layer 0's
q/k/v read the embeddings LayerNorm, which stays standard (its output has no shared
reader worth it) and is never merged. At random init ``gamma = 1, beta = 0``: nothing to
merge. After fine-tuning the two copies of an affine may differ; the function is still
exactly representable by HF BERT: the export (:func:`hf_map`, ``kept``) writes the residual gamma/beta as
the LayerNorm and un-merges each merged linear with them (``W = W' / gamma``,
``b = b' - beta @ W``).

Dropout where HF BERT has it (``hidden_dropout``: after the embeddings, the attention's
out-projection and ``fc2``; ``attention_dropout``: on the attention probabilities;
``classifier_dropout``, default ``hidden_dropout``: before the classifier, and for RoBERTa
also before its head's dense), each keeping only its key for backward
(:mod:`models.dropout`); ``model.eval()`` turns it off. The presets have none;
:func:`config_from_hf` reads the checkpoint's rates. One difference under MS norms: RoBERTa's
dropout before its head's dense (our ``pooler``, which holds the last LN2's affine merged)
drops the normalized feature before that affine, not after it.

Not modelled: relative position embeddings, decoder / cross-attention variants,
activations other than exact GELU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowmem_jax.dropout import check_rate
from lowmem_jax.methods import read
from lowmem_jax.policy import MemoryPolicy
from models.attention import SelfAttention
from models.dropout import Dropout
from models.config import check_positive, hf_value, init_model, make_config, replace_fields, \
    token_ids
from models.embedding import Embed
from models.hf_state import CheckpointError, Linear as HFLinear, Norm as HFNorm, Tensor
from models.linear import Linear
from models.mlp import Mlp
from models.norm import Norm
from models.sites import Site, as_array, seed_sites
from models.stack import BlockStack

MODEL_TYPES = ("bert", "roberta")


# ----------------------------------------------------------------------------- config
@dataclasses.dataclass(frozen=True)
class BertConfig:
  """A BERT/RoBERTa encoder with a sequence-classification head.

  ``max_positions`` is the size of the position table (RoBERTa's is 514 for 512 tokens:
  positions start at ``pad_token_id + 1``). ``eps`` is HF's ``layer_norm_eps``.
  ``initializer_range`` is the std of embeddings and of a freshly initialised head.
  Dropout rates (HF's ``hidden_dropout_prob``, ``attention_probs_dropout_prob``,
  ``classifier_dropout``; None: ``hidden_dropout``) are 0 in the presets.
  """
  vocab_size: int = 30522
  dim: int = 768
  num_layers: int = 12
  num_heads: int = 12
  mlp_dim: int = 3072
  max_positions: int = 512
  type_vocab_size: int = 2
  eps: float = 1e-12
  num_labels: int = 2
  pad_token_id: int = 0
  model_type: str = "bert"
  initializer_range: float = 0.02
  hidden_dropout: float = 0.0
  attention_dropout: float = 0.0
  classifier_dropout: float | None = None

  def __post_init__(self):
    check_positive(self, ints=("vocab_size", "dim", "num_layers", "num_heads", "mlp_dim",
                               "max_positions", "type_vocab_size", "num_labels"),
                   numbers=("eps", "initializer_range"))
    if self.model_type not in MODEL_TYPES:
      raise ValueError(f"BertConfig: unknown model_type {self.model_type!r}; valid: "
                       f"{', '.join(map(repr, MODEL_TYPES))}")
    for name in ("hidden_dropout", "attention_dropout", "classifier_dropout"):
      if name != "classifier_dropout" or self.classifier_dropout is not None:
        check_rate(getattr(self, name), f"BertConfig: {name}")
    if self.dim % self.num_heads:
      raise ValueError(f"BertConfig: dim {self.dim} is not a multiple of num_heads "
                       f"{self.num_heads}")
    pad = self.pad_token_id
    if isinstance(pad, bool) or not isinstance(pad, (int, np.integer)) or not (
        0 <= pad < self.vocab_size):
      raise ValueError(f"BertConfig: pad_token_id must be an integer in [0, vocab_size="
                       f"{self.vocab_size}), got {pad!r}")
    if self.model_type == "roberta" and self.max_positions <= pad + 1:
      raise ValueError(
          f"BertConfig: RoBERTa positions start at pad_token_id + 1 = {pad + 1}, so "
          f"max_positions must exceed it; got {self.max_positions}")

  @property
  def head_dim(self) -> int:
    return self.dim // self.num_heads

  @property
  def head_dropout(self) -> float:
    """The classifier's dropout rate (HF: ``classifier_dropout`` or else the hidden one)."""
    return self.hidden_dropout if self.classifier_dropout is None else self.classifier_dropout

  @property
  def max_tokens(self) -> int:
    """The longest sequence the position table covers."""
    offset = self.pad_token_id + 1 if self.model_type == "roberta" else 0
    return self.max_positions - offset


PRESETS: dict[str, BertConfig] = {
    "bert-base": BertConfig(),
    "roberta-base": BertConfig(vocab_size=50265, max_positions=514, type_vocab_size=1,
                               eps=1e-5, pad_token_id=1, model_type="roberta"),
    "bert-tiny": BertConfig(vocab_size=512, dim=64, num_layers=2, num_heads=4, mlp_dim=128,
                            max_positions=64),
    "roberta-tiny": BertConfig(vocab_size=512, dim=64, num_layers=2, num_heads=4, mlp_dim=128,
                               max_positions=66, type_vocab_size=1, eps=1e-5, pad_token_id=1,
                               model_type="roberta"),
}

def config(name: str, **overrides) -> BertConfig:
  """The preset ``name`` with ``overrides`` applied (e.g. ``num_labels=3``)."""
  return make_config(BertConfig, PRESETS, name, overrides)


# ----------------------------------------------------------------------------- modules
class ResidualAffine(nnx.Module):
  """``gamma * y + beta`` on the residual path of a post-LN layer under MS norms.

  The LayerNorm's own affine, kept here because the MS norm has none; the same affine is
  merged into the linear(s) reading ``y``. Backward keeps ``y``, already saved by them.
  """

  def __init__(self, dim: int):
    self.scale = nnx.Param(jnp.ones((dim,), jnp.float32))
    self.bias = nnx.Param(jnp.zeros((dim,), jnp.float32))

  def __call__(self, y):
    return residual_affine(y, self.scale[...], self.bias[...])


def residual_affine(y, scale, bias):
  """``scale * y + bias``; ``y`` plain or carried (Mesa: backward keeps its code, for
  d gamma)."""
  return read(_affine, [y], (scale, bias))


def _affine(y, scale, bias):
  return y * scale.astype(y.dtype) + bias.astype(y.dtype)


class BertEmbeddings(nnx.Module):
  """Word + position + token-type embeddings, then a standard LayerNorm (never merged)."""

  def __init__(self, cfg: BertConfig, *, dtype, rngs: nnx.Rngs):
    init = nnx.initializers.normal(cfg.initializer_range)
    embed = dict(embedding_init=init, rngs=rngs)
    self.word = Embed(cfg.vocab_size, cfg.dim, **embed)
    self.position = Embed(cfg.max_positions, cfg.dim, **embed)
    self.token_type = Embed(cfg.type_vocab_size, cfg.dim, **embed)
    # The standard LayerNorm with its affine whatever the policy (DESIGN.md: the
    # embeddings LN is left as is).
    self.norm = Norm(cfg.dim, kind="layer", eps=cfg.eps, policy=MemoryPolicy())
    self.dropout = Dropout(cfg.hidden_dropout)
    self.dtype = dtype

  def __call__(self, tokens, positions, token_types):
    x = self.word(tokens) + self.position(positions) + self.token_type(token_types)
    return self.dropout(self.norm(x.astype(self.dtype)))


class BertLayer(nnx.Module):
  """One post-LN layer. Under MS norms ``attention_affine``/``output_affine`` hold the
  LayerNorms' gamma/beta for the residual path (see the module docstring)."""

  def __init__(self, cfg: BertConfig, policy: MemoryPolicy, *, dtype, rngs: nnx.Rngs):
    self.attention = SelfAttention(cfg.dim, cfg.num_heads, policy=policy, dtype=dtype,
                                   dropout=cfg.attention_dropout, rngs=rngs)
    self.attention_dropout = Dropout(cfg.hidden_dropout)  # on the out-projection's output
    self.attention_norm = Norm(cfg.dim, kind="layer", eps=cfg.eps, policy=policy)
    self.mlp = Mlp(cfg.dim, cfg.mlp_dim, activation="gelu", policy=policy, dtype=dtype,
                   rngs=rngs)
    self.output_dropout = Dropout(cfg.hidden_dropout)  # on fc2's output
    self.output_norm = Norm(cfg.dim, kind="layer", eps=cfg.eps, policy=policy)
    merged = policy.merges_norm_affine
    self.attention_affine = ResidualAffine(cfg.dim) if merged else None
    self.output_affine = ResidualAffine(cfg.dim) if merged else None

  def __call__(self, carry, mask):
    """``carry = (y, affine)``: ``y`` the previous norm's output, read by q/k/v, and the
    ``(scale, bias)`` that turns it into the residual stream (None when the previous
    norm keeps its affine). Returns this layer's ``(LN2 output, its affine)``."""
    y, affine = carry
    h = as_array(y) if affine is None else residual_affine(y, *affine)
    y1 = self.attention_norm(h + self.attention_dropout(self.attention(y, mask=mask)))
    h1 = as_array(y1) if self.attention_affine is None else self.attention_affine(y1)
    y2 = self.output_norm(h1 + self.output_dropout(self.mlp(y1)))
    out = self.output_affine
    return y2, None if out is None else (out.scale[...], out.bias[...])


class Bert(nnx.Module):
  """BERT/RoBERTa encoder + sequence-classification head. Params fp32, compute ``dtype``.

  ``encode(tokens, mask, token_types=None)`` -> last hidden state ``[B, T, D]`` (fp32);
  ``model(tokens, mask, token_types=None)`` -> logits ``[B, num_labels]`` (fp32);
  ``forward(...)`` -> both from one pass. ``mask`` is True on real tokens.
  """

  def __init__(self, cfg: BertConfig | str, policy: MemoryPolicy | str = "baseline", *,
               dtype=jnp.bfloat16, rngs: nnx.Rngs | None = None):
    rngs = init_model(self, cfg, config, BertConfig, policy, dtype, rngs)
    cfg, dtype = self.cfg, self.dtype
    self.embeddings = BertEmbeddings(cfg, dtype=dtype, rngs=rngs)
    # What layer 0's q/k/v keep of the embeddings output (Mesa: its code), made here so
    # it enters the stack in the form every layer returns its output in.
    self.shared_embeddings = Site(self.policy.shared_strategy(norm="layer"))
    self.stack = BlockStack(lambda r: BertLayer(cfg, self.policy, dtype=dtype, rngs=r),
                            cfg.num_layers, self.policy, rngs)
    head = dict(dtype=dtype, kernel_init=nnx.initializers.normal(cfg.initializer_range),
                bias_init=nnx.initializers.zeros_init(), rngs=rngs)
    # Under MS norms the last LN2's affine is merged into ``pooler``.
    self.pooler = Linear(cfg.dim, cfg.dim, policy=self.policy, reads_norm=True, **head)
    self.classifier = Linear(cfg.dim, cfg.num_labels, policy=self.policy, **head)
    self.head_dropout = Dropout(cfg.head_dropout)
    seed_sites(self, rngs)

  # -------------------------------------------------------------------------- inputs
  def _inputs(self, tokens, mask, token_types):
    tokens = token_ids(tokens, "Bert", self.cfg.max_tokens)
    mask = jnp.ones(tokens.shape, bool) if mask is None else jnp.asarray(mask)
    if mask.shape != tokens.shape:
      raise ValueError(f"Bert: mask{list(mask.shape)} must match tokens{list(tokens.shape)}")
    mask = mask if mask.dtype == jnp.bool_ else mask != 0
    token_types = (jnp.zeros_like(tokens) if token_types is None
                   else jnp.asarray(token_types))
    if token_types.shape != tokens.shape:
      raise ValueError(f"Bert: token_types{list(token_types.shape)} must match "
                       f"tokens{list(tokens.shape)}")
    return tokens, mask, token_types

  def _positions(self, tokens):
    if self.cfg.model_type == "roberta":
      # HF create_position_ids_from_input_ids: count real tokens, offset by the pad id.
      pad = self.cfg.pad_token_id
      real = (tokens != pad).astype(jnp.int32)
      return jnp.cumsum(real, axis=1) * real + pad
    return jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)

  # -------------------------------------------------------------------------- forward
  def _encode(self, tokens, mask, token_types):
    """The last LN2 output ``y`` and the ``(scale, bias)`` that turns it into the hidden
    state (None when the norms keep their affine)."""
    tokens, mask, token_types = self._inputs(tokens, mask, token_types)
    y = self.shared_embeddings(self.embeddings(tokens, self._positions(tokens), token_types))
    # Layer 0 reads the embeddings LayerNorm, which keeps its affine: under MS norms it
    # gets the identity (exact: y * 1 + 0 == y) so every layer sees one carry structure.
    d = self.cfg.dim
    identity = ((jnp.ones((d,), jnp.float32), jnp.zeros((d,), jnp.float32))
                if self.policy.merges_norm_affine else None)
    return self.stack((y, identity), mask[:, None, None, :])

  def _logits(self, y):
    first = as_array(y)[:, 0]
    if self.cfg.model_type == "roberta":  # RobertaClassificationHead drops before its dense
      first = self.head_dropout(first)
    pooled = jnp.tanh(self.pooler(first))
    return self.classifier(self.head_dropout(pooled)).astype(jnp.float32)

  def forward(self, tokens, mask=None, token_types=None):
    """``(hidden [B, T, D], logits [B, num_labels])``, both fp32, from one pass."""
    y, affine = self._encode(tokens, mask, token_types)
    hidden = as_array(y) if affine is None else residual_affine(y, *affine)
    return hidden.astype(jnp.float32), self._logits(y)

  def encode(self, tokens, mask=None, token_types=None):
    """The last hidden state ``[B, T, D]`` in fp32 (HF's ``last_hidden_state``)."""
    return self.forward(tokens, mask, token_types)[0]

  def __call__(self, tokens, mask=None, token_types=None):
    """Sequence-classification logits ``[B, num_labels]`` in fp32."""
    y, _ = self._encode(tokens, mask, token_types)
    return self._logits(y)


def classifier_head(cfg: BertConfig) -> tuple[str, ...]:
  """The model's linears that make its classification head (trained in full under LoRA:
  ``models.lora.apply_lora``'s ``modules_to_save``): HF's ``classifier``, which for
  RoBERTa holds its dense layer (our ``pooler``) too; BERT's pooler is pretrained."""
  return ("classifier",) if cfg.model_type == "bert" else ("pooler", "classifier")


# ----------------------------------------------------------------------------- HF interop
# Keys a checkpoint may carry that this model does not use: buffers, pretraining heads,
# and RobertaModel's pooler (RoBERTa's classification head does not read it). BERT's
# pooler is read where the checkpoint has one.
HF_IGNORED_KEYS = ("embeddings.position_ids", "embeddings.token_type_ids", "pooler.dense.",
                   "lm_head.", "cls.predictions.", "cls.seq_relationship.", "qa_outputs.")
# the classification head (RoBERTa's dense + out_proj), replaced by a fresh one under
# ``load_pretrained(new_head=True)``; a checkpoint without it keeps the fresh one anyway
HF_HEAD_KEYS = ("classifier.",)

_ARCHITECTURES = {"bert": "BertForSequenceClassification",
                  "roberta": "RobertaForSequenceClassification"}
# HF's config-class defaults, for keys a config.json leaves out.
_HF_DEFAULTS = {
    "bert": dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12,
                 num_attention_heads=12, intermediate_size=3072, max_position_embeddings=512,
                 type_vocab_size=2, layer_norm_eps=1e-12, pad_token_id=0,
                 initializer_range=0.02),
    "roberta": dict(vocab_size=50265, hidden_size=768, num_hidden_layers=12,
                    num_attention_heads=12, intermediate_size=3072,
                    max_position_embeddings=512, type_vocab_size=2, layer_norm_eps=1e-12,
                    pad_token_id=1, initializer_range=0.02),
}
_HF_FIELDS = dict(vocab_size="vocab_size", dim="hidden_size", num_layers="num_hidden_layers",
                  num_heads="num_attention_heads", mlp_dim="intermediate_size",
                  max_positions="max_position_embeddings", type_vocab_size="type_vocab_size",
                  eps="layer_norm_eps", pad_token_id="pad_token_id",
                  initializer_range="initializer_range")
_HF_FLOATS = ("eps", "initializer_range")


def config_from_hf(hf: Mapping[str, object], **overrides) -> BertConfig:
  """A :class:`BertConfig` from a HF ``config.json`` dict; ``overrides`` change fields
  (e.g. ``num_labels=3`` for a new head). Unsupported variants raise CheckpointError."""
  model_type = hf.get("model_type")
  if model_type not in MODEL_TYPES:
    raise CheckpointError(f"config_from_hf: model_type {model_type!r} is not one of "
                          f"{', '.join(MODEL_TYPES)}")
  if hf.get("hidden_act", "gelu") != "gelu":
    raise CheckpointError(f"config_from_hf: hidden_act {hf['hidden_act']!r} is not "
                          "supported; only the exact-erf 'gelu'")
  if hf.get("position_embedding_type", "absolute") != "absolute":
    raise CheckpointError("config_from_hf: position_embedding_type "
                          f"{hf['position_embedding_type']!r} is not supported; only 'absolute'")
  if hf.get("is_decoder") or hf.get("add_cross_attention"):
    raise CheckpointError("config_from_hf: decoder / cross-attention BERT is not supported")
  defaults = _HF_DEFAULTS[model_type]
  fields = {ours: hf_value(hf, theirs, float if ours in _HF_FLOATS else int, defaults[theirs])
            for ours, theirs in _HF_FIELDS.items()}
  num_labels = hf_value(hf, "num_labels", int, None)
  if num_labels is None:
    num_labels = len(hf["id2label"]) if hf.get("id2label") else 2
  fields.update(num_labels=num_labels, model_type=model_type,
                # HF's defaults where config.json leaves them out
                hidden_dropout=hf_value(hf, "hidden_dropout_prob", float, 0.1),
                attention_dropout=hf_value(hf, "attention_probs_dropout_prob", float, 0.1),
                classifier_dropout=hf_value(hf, "classifier_dropout", float, None))
  return replace_fields(BertConfig(**fields), overrides)


def config_to_hf(cfg: BertConfig) -> dict:
  """The HF ``config.json`` of ``cfg`` as a ``*ForSequenceClassification`` model."""
  labels = {str(i): f"LABEL_{i}" for i in range(cfg.num_labels)}
  return {
      "architectures": [_ARCHITECTURES[cfg.model_type]],
      "model_type": cfg.model_type,
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.dim,
      "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads,
      "intermediate_size": cfg.mlp_dim,
      "hidden_act": "gelu",
      "hidden_dropout_prob": cfg.hidden_dropout,
      "attention_probs_dropout_prob": cfg.attention_dropout,
      "classifier_dropout": cfg.classifier_dropout,
      "max_position_embeddings": cfg.max_positions,
      "type_vocab_size": cfg.type_vocab_size,
      "initializer_range": cfg.initializer_range,
      "layer_norm_eps": cfg.eps,
      "pad_token_id": cfg.pad_token_id,
      "position_embedding_type": "absolute",
      "id2label": labels,
      "label2id": {v: int(k) for k, v in labels.items()},
      "dtype": "float32",
  }


def _hf_prefix(cfg: BertConfig, keys) -> str:
  """"bert."/"roberta." (``*For*`` checkpoints) or "" (plain ``BertModel`` ones)."""
  for prefix in (f"{cfg.model_type}.", ""):
    if keys is not None and f"{prefix}embeddings.word_embeddings.weight" in keys:
      return prefix
  return f"{cfg.model_type}."  # neither, or writing: the usual names


def _head_names(cfg: BertConfig, prefix: str) -> tuple[str, str]:
  """HF names of (pooler / head dense, classifier / out_proj)."""
  if cfg.model_type == "roberta":
    return "classifier.dense", "classifier.out_proj"
  return f"{prefix}pooler.dense", "classifier"


def hf_map(cfg: BertConfig, keys=None) -> list:
  """HF ``*ForSequenceClassification`` names of our variables (``bert.``/``roberta.``
  prefixed or not, :mod:`models.hf_state`).

  Under MS norms every LayerNorm after the embeddings is merged into the linear(s)
  reading it (LN1 -> fc1; LN2 -> the next layer's q/k/v, the last one -> the pooler)
  and kept for the residual path. A checkpoint with no classification head at all (a
  plain ``BertModel``/``RobertaModel``, e.g. sentence encoders) keeps the model's fresh
  head (merged like a loaded one, so every policy computes the same function); BERT's
  pooler is read where it has one (a ``BertForMaskedLM`` has none: it stays fresh).
  """
  prefix = _hf_prefix(cfg, keys)
  e = f"{prefix}embeddings."
  entries = [Tensor(f"{e}word_embeddings.weight", "embeddings.word.embedding"),
             Tensor(f"{e}position_embeddings.weight", "embeddings.position.embedding"),
             Tensor(f"{e}token_type_embeddings.weight", "embeddings.token_type.embedding"),
             HFNorm(f"{e}LayerNorm", "embeddings.norm")]
  ours = "stack.blocks"
  prev = None  # the LN2 the next q/k/v read (merged there under MS norms)
  for i in range(cfg.num_layers):
    p = f"{prefix}encoder.layer.{i}."
    ln1, ln2 = f"{p}attention.output.LayerNorm", f"{p}output.LayerNorm"
    entries += [HFLinear(f"{p}attention.self.{n}", f"{ours}.attention.{n}", i, norm=prev)
                for n in ("query", "key", "value")]
    entries += [
        HFLinear(f"{p}attention.output.dense", f"{ours}.attention.out", i),
        HFNorm(ln1, f"{ours}.attention_norm", i,
               kept=(f"{ours}.attention_affine.scale", f"{ours}.attention_affine.bias")),
        HFLinear(f"{p}intermediate.dense", f"{ours}.mlp.fc1", i, norm=ln1),
        HFLinear(f"{p}output.dense", f"{ours}.mlp.fc2", i),
        HFNorm(ln2, f"{ours}.output_norm", i,
               kept=(f"{ours}.output_affine.scale", f"{ours}.output_affine.bias"))]
    prev = ln2
  dense, out = _head_names(cfg, prefix)
  head = (out,) if cfg.model_type == "bert" else (dense, out)
  # BERT's pooler is read where the checkpoint has one; a BertForMaskedLM's or
  # BertForTokenClassification's has none, and transformers starts that one fresh too
  fresh_pooler = cfg.model_type == "bert" and keys is not None and not any(
      f"{dense}.{w}" in keys for w in ("weight", "bias"))
  if keys is None or any(f"{n}.{w}" in keys for n in head for w in ("weight", "bias")):
    return entries + [HFLinear(dense, "pooler", norm=prev, keep_weights=fresh_pooler),
                      HFLinear(out, "classifier")]
  # no head in the checkpoint: keep the fresh one
  return entries + [HFLinear(dense, "pooler", norm=prev,
                             keep_weights=cfg.model_type == "roberta" or fresh_pooler)]
