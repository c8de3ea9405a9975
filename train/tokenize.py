"""Tokenizers for text data: a private copy without padding/truncation, its special tokens."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from train.dataset import MissingFileError

# End-of-text tokens looked up, in order, when the tokenizer's post-processor adds none.
EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")
PAD_CANDIDATES = ("[PAD]", "<pad>", "<|pad|>", "<|finetune_right_pad_id|>")


def load_tokenizer(tokenizer):
  """A private copy of ``tokenizer`` (a tokenizers.Tokenizer, a HF fast tokenizer, or a path to
  tokenizer.json or its folder) with its own padding and truncation settings switched off."""
  from tokenizers import Tokenizer
  if isinstance(tokenizer, (str, os.PathLike)):
    p = Path(tokenizer)
    if p.is_dir():
      p = p / "tokenizer.json"
    if not p.is_file():
      raise MissingFileError(f"tokenizer file not found: {p}" + _slow_tokenizer_note(p.parent))
    try:
      tok = Tokenizer.from_file(str(p))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception
      raise ValueError(f"{p}: not a tokenizers tokenizer.json ({e})") from None
  else:
    tok = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not isinstance(tok, Tokenizer):
      raise ValueError("tokenizer must be a tokenizers.Tokenizer or a path to tokenizer.json, "
                       f"got {type(tokenizer).__name__}")
    tok = Tokenizer.from_str(tok.to_str())
  pad_id = (tok.padding or {}).get("pad_id")
  tok.no_padding()
  tok.no_truncation()
  if pad_id is None:
    pad_id = next((i for i in map(tok.token_to_id, PAD_CANDIDATES) if i is not None), 0)
  return tok, int(pad_id)


# records a tokenizers ``encode_batch`` call takes (in parallel), written into the arrays
# before the next: every record's Encoding at once peaked at ~75x a jsonl file's size
# (100 MB of instructions, 32k BPE, max_len 1024: 7.6 GB; 1.6 GB chunked)
ENCODE_CHUNK = 4096

# a slow (Python) tokenizer's files, which only transformers reads
SLOW_TOKENIZER_FILES = ("vocab.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
                        "vocab.json")


def _slow_tokenizer_note(folder: Path) -> str:
  """What a folder without tokenizer.json holds instead, and how to make one."""
  found = [n for n in SLOW_TOKENIZER_FILES if (folder / n).is_file()]
  if not found:
    return ""
  return (f"; {folder} has {', '.join(found)} (a slow tokenizer's files), which are not "
          "read: write its tokenizer.json with transformers, "
          "AutoTokenizer.from_pretrained(d).save_pretrained(d)")


def special_affixes(tok) -> tuple[list[int], list[int]]:
  """The special ids the tokenizer's post-processor puts before and after one sequence."""
  probe = "hello world"
  plain = tok.encode(probe, add_special_tokens=False).ids
  full = tok.encode(probe, add_special_tokens=True).ids
  for k in range(len(full) - len(plain) + 1):
    if full[k:k + len(plain)] == plain:
      return full[:k], full[k + len(plain):]
  raise ValueError("cannot locate the text inside the tokenizer's post-processed encoding")


def configured_eos(tokenizer) -> str | None:
  """The end token ``tokenizer`` names as transformers reads it: a HF tokenizer's
  ``eos_token``, or for a path the ``eos_token`` of the ``tokenizer_config.json`` beside its
  tokenizer.json; None where there is none (or it cannot be read)."""
  if not isinstance(tokenizer, (str, os.PathLike)):
    name = getattr(tokenizer, "eos_token", None)
    return name if isinstance(name, str) else None
  p = Path(tokenizer)
  config = (p if p.is_dir() else p.parent) / "tokenizer_config.json"
  try:
    name = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
  except (OSError, ValueError, AttributeError):
    return None
  name = name.get("content") if isinstance(name, dict) else name  # an AddedToken's form
  return name if isinstance(name, str) else None


def eos_ids(tok, suffix: list[int], configured: str | None = None) -> list[int]:
  """End-of-text ids: the post-processor's suffix (e.g. BERT's [SEP]), else the tokenizer's
  configured end token (:func:`configured_eos`; DeepSeek's is none of the known names),
  else a known end token; [] when there is none."""
  if suffix:
    return suffix
  for name in (configured, *EOS_CANDIDATES):
    i = None if name is None else tok.token_to_id(name)
    if i is not None:
      return [i]
  return []


def special_token_ids(tok, configured: str | None = None) -> dict:
  """``bos_token_id`` and ``eos_token_id`` as the LM data feeds them (the post-processor's
  first prefix id; the end-of-text id after each text, :func:`eos_ids`), None where the
  tokenizer has none: what an exported model's config says of its tokenizer."""
  prefix, suffix = special_affixes(tok)
  eos = eos_ids(tok, suffix, configured)
  return {"bos_token_id": prefix[0] if prefix else None,
          "eos_token_id": eos[0] if eos else None}


def check_max_len(max_len: int) -> None:
  if not isinstance(max_len, (int, np.integer)) or max_len < 1:
    raise ValueError(f"max_len must be a positive int, got {max_len!r}")
