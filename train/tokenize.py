"""Tokenizers for text data: a private copy without padding/truncation, its special tokens."""

from __future__ import annotations

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
      raise MissingFileError(f"tokenizer file not found: {p}")
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


def special_affixes(tok) -> tuple[list[int], list[int]]:
  """The special ids the tokenizer's post-processor puts before and after one sequence."""
  probe = "hello world"
  plain = tok.encode(probe, add_special_tokens=False).ids
  full = tok.encode(probe, add_special_tokens=True).ids
  for k in range(len(full) - len(plain) + 1):
    if full[k:k + len(plain)] == plain:
      return full[:k], full[k + len(plain):]
  raise ValueError("cannot locate the text inside the tokenizer's post-processed encoding")


def eos_ids(tok, suffix: list[int]) -> list[int]:
  """End-of-text ids: the post-processor's suffix (e.g. BERT's [SEP]), else a known end token."""
  if suffix:
    return suffix
  for name in EOS_CANDIDATES:
    i = tok.token_to_id(name)
    if i is not None:
      return [i]
  return []


def special_token_ids(tok) -> dict:
  """``bos_token_id`` and ``eos_token_id`` as the LM data feeds them (the post-processor's
  first prefix id; the end-of-text id after each text, :func:`eos_ids`), None where the
  tokenizer has none: what an exported model's config says of its tokenizer."""
  prefix, suffix = special_affixes(tok)
  eos = eos_ids(tok, suffix)
  return {"bos_token_id": prefix[0] if prefix else None,
          "eos_token_id": eos[0] if eos else None}


def check_max_len(max_len: int) -> None:
  if not isinstance(max_len, (int, np.integer)) or max_len < 1:
    raise ValueError(f"max_len must be a positive int, got {max_len!r}")
