"""Causal-LM data: text files and instruction jsonl -> ``tokens``, ``targets``, ``loss_mask``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

from train.dataset import ArrayDataset, MissingFileError
from train.jsonl import field, read_jsonl, read_text
from train.tokenize import (ENCODE_CHUNK, EOS_CANDIDATES, check_max_len, configured_eos,
                            eos_ids, load_tokenizer, special_affixes)

# Alpaca's two prompts (github.com/tatsu-lab/stanford_alpaca, train.py PROMPT_DICT). The model
# is trained on the tokens of `output` (and the end token) that follow the formatted prompt.
DEFAULT_PROMPT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
DEFAULT_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n")


def causal_lm(path, tokenizer, *, max_len: int,
              prompt_template: str = DEFAULT_PROMPT) -> ArrayDataset:
  """Next-token data -> ``tokens`` (inputs), ``targets`` (the next tokens) and ``loss_mask``.

  - ``.txt``: the whole file is one token stream (the tokenizer's start token, the text, its
    end token) cut into windows of ``max_len + 1`` tokens with stride ``max_len``, so
    consecutive windows share one token and every next-token pair is trained exactly once; the
    last window is padded. ``loss_mask`` is True on every real target.
  - ``.jsonl`` (or ``.json`` holding one array of objects, as Alpaca's): one row per record,
    truncated to ``max_len + 1`` tokens (a warning counts the tokens cut) and right-padded
    (a row left with no target in the loss, its prompt as long as ``max_len`` or its text
    one token, is dropped, its lines and the reason said). A line
    ``{"text": ...}`` is trained on all of its tokens. A line ``{"instruction", "input"
    (optional), "output"}`` becomes ``prompt_template.format(instruction=..., input=...)``
    followed by the output, tokenized as one text (as Alpaca and TRL do: a tokenizer that
    marks a text's start, such as LLaMA's "▁", marks it once) and split at the prompt's
    last character by the tokens' offsets: ``loss_mask`` is True only where the target is
    a token of the output (one that covers any of its characters) or the end token. With
    the default template an empty input uses Alpaca's no-input prompt.

  Start/end tokens are the ones the tokenizer's post-processor adds to one sequence (BERT:
  [CLS] ... [SEP]; LLaMA: <s>); when it adds no end token, the tokenizer's own
  (``tokenizer_config.json``'s ``eos_token``), else the first of ``EOS_CANDIDATES`` in the
  vocabulary ends each text and output, so the model learns to stop (a warning says so
  when there is none). A text that already starts (ends) with them keeps its own, not two.
  A ``.txt`` file's CRLF line ends are read as ``\\n``.
  """
  check_max_len(max_len)
  p = Path(path)
  if p.is_dir():
    raise ValueError(f"data {p} is a folder; this task reads a text file (.txt), .jsonl or .json")
  if not p.is_file():
    raise MissingFileError(f"data file not found: {p}")
  tok, pad_id = load_tokenizer(tokenizer)
  prefix, suffix = special_affixes(tok)
  eos = eos_ids(tok, suffix, configured_eos(tokenizer))
  if not eos:
    named = tokenizer if isinstance(tokenizer, (str, os.PathLike)) else type(tokenizer).__name__
    print(f"warning: the tokenizer ({named}) has no end-of-text token (its post-processor "
          "adds none, no tokenizer_config.json names one, and none of "
          f"{', '.join(EOS_CANDIDATES)} is in its vocabulary): texts and outputs end "
          "without one, so the model does not learn to stop", file=sys.stderr, flush=True)
  suffix_lower = p.suffix.lower()
  if suffix_lower == ".txt":
    text = read_text(p).replace("\r\n", "\n")  # Windows line ends: no "\r" token to learn
    if not text.strip():
      raise ValueError(f"empty dataset: {p} has no text")
    ids = tok.encode(text, add_special_tokens=False).ids
    head, tail = _affixes(ids, prefix, eos)
    stream = head + ids + tail
    if len(stream) < 2:
      raise ValueError(f"{p} tokenizes to {len(stream)} token(s); need at least 2")
    starts = range(0, len(stream) - 1, max_len)
    n, rows = len(starts), ((stream[s:s + max_len + 1], None, None) for s in starts)
  elif suffix_lower in (".jsonl", ".json"):
    n, rows = _causal_rows(p, tok, prefix, eos, prompt_template)
  else:
    raise ValueError(f"causal_lm reads .txt, .jsonl or .json (an array of records) files, "
                     f"got {p.name}")

  # each row written into the arrays as it is encoded: only its length and place are kept
  tokens = np.full((n, max_len), pad_id, np.int32)
  targets = np.full((n, max_len), pad_id, np.int32)
  loss_mask = np.zeros((n, max_len), bool)
  lengths, wheres = np.zeros(n, np.int64), []
  for i, (ids, in_loss, where) in enumerate(rows):
    lengths[i] = len(ids)
    wheres.append(where)
    ids = ids[:max_len + 1]
    m = len(ids) - 1
    if m < 1:
      continue
    tokens[i, :m] = ids[:-1]
    targets[i, :m] = ids[1:]
    loss_mask[i, :m] = True if in_loss is None else in_loss[1:m + 1]
  kept = loss_mask.any(1)
  if not kept.any():
    raise ValueError(f"{p}: no example has a token to train on: "
                     + _no_target_reason(lengths, range(n), max_len))
  if not kept.all():  # a step of such rows would train on nothing (and still decay weights)
    dropped = np.flatnonzero(~kept)
    where = [wheres[i].removeprefix(str(p)) for i in dropped]
    print(f"warning: {p}: {len(where)} of {n} examples have no token to train on ("
          + _no_target_reason(lengths, dropped, max_len) + "), dropped: "
          + ", ".join(where[:10]) + (", ..." if len(where) > 10 else ""),
          file=sys.stderr, flush=True)
  if suffix_lower != ".txt":
    cut = [i for i in np.flatnonzero(kept) if lengths[i] > max_len + 1]
    if cut:
      lost = int(sum(lengths[i] - (max_len + 1) for i in cut))
      print(f"warning: {p}: {len(cut)} of {n} examples are longer than max_len + 1 = "
            f"{max_len + 1} tokens and were cut at it ({lost} tokens not trained, e.g. "
            + ", ".join(wheres[i].removeprefix(str(p)) for i in cut[:5])
            + "); raise max_len to keep them", file=sys.stderr, flush=True)
  if kept.all():  # no copy
    return ArrayDataset({"tokens": tokens, "targets": targets, "loss_mask": loss_mask})
  return ArrayDataset({"tokens": tokens[kept], "targets": targets[kept],
                       "loss_mask": loss_mask[kept]})


def _causal_rows(p: Path, tok, prefix, eos, template):
  """The number of jsonl records and an iterator of (token ids, per-token in-loss flags
  or None for all, "file:line") for each, encoded :data:`ENCODE_CHUNK` at a time."""
  if "{instruction}" not in template:
    raise ValueError("prompt_template must contain '{instruction}'")
  records = read_jsonl(p)
  texts, kinds = [], []
  for where, obj in records:
    if "output" in obj:
      instruction = field(where, obj, "instruction")
      inp = field(where, obj, "input", optional=True) or ""
      output = field(where, obj, "output")
      t = DEFAULT_PROMPT_NO_INPUT if template == DEFAULT_PROMPT and not inp.strip() else template
      try:
        prompt = t.format(instruction=instruction, input=inp)
      except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"bad prompt_template (only {{instruction}} and {{input}} are "
                         f"filled; literal braces must be doubled): {e!r}") from e
      texts.append(prompt + output)
      kinds.append(len(prompt))
    elif "text" in obj:
      texts.append(field(where, obj, "text"))
      kinds.append(None)
    else:
      raise ValueError(f"{where}: missing key: need 'text' or 'instruction'/'output' "
                       f"(has {sorted(obj)})")
  wheres = [where for where, _ in records]
  del records

  def rows():
    for start in range(0, len(texts), ENCODE_CHUNK):
      chunk = tok.encode_batch(texts[start:start + ENCODE_CHUNK], add_special_tokens=False)
      stop = start + ENCODE_CHUNK
      for encoding, prompt_chars, where in zip(chunk, kinds[start:stop], wheres[start:stop]):
        head, tail = _affixes(encoding.ids, prefix, eos)
        ids = head + encoding.ids + tail  # whole: the caller cuts at max_len + 1, says so
        if prompt_chars is None:  # a plain text: every token
          yield ids, None, where
        else:  # the prompt's tokens end within its characters; the output's cover its own
          output = [end > prompt_chars for _, end in encoding.offsets]
          yield ids, [False] * len(head) + output + [True] * len(tail), where
  return len(texts), rows()


def _affixes(ids: list[int], prefix: list[int], eos: list[int]) -> tuple[list[int], list[int]]:
  """The start and end tokens to put around ``ids``, but neither one twice: a text that
  already begins with the start token(s) ("<s>[INST] ... </s>", a pre-templated chat text)
  or ends with the end token(s) keeps its own."""
  head = [] if prefix and ids[:len(prefix)] == prefix else prefix
  tail = [] if eos and ids[-len(eos):] == eos else eos
  return head, tail


def _no_target_reason(lengths, indices, max_len: int) -> str:
  """Why rows (of ``lengths`` tokens) have no target in the loss: too few tokens, or a
  prompt of max_len tokens."""
  short = sum(1 for i in indices if lengths[i] < 2)
  reasons = []
  if short:
    reasons.append(f"{short} tokenize to fewer than 2 tokens, nothing to predict")
  if len(indices) - short:
    reasons.append(f"{len(indices) - short} have a prompt that fills max_len={max_len}, "
                   "so no output token is within it")
  return "; ".join(reasons)
