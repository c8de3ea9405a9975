"""Text classification data: jsonl ``{"text", "label"}`` -> ``tokens``, ``mask``, ``label``
(pairs: ``types``), and the label map from names to ids."""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from train.dataset import ArrayDataset
from train.jsonl import field, read_jsonl
from train.tokenize import ENCODE_CHUNK, check_max_len, load_tokenizer


def text_classification(path, tokenizer, *, max_len: int, text_key: str = "text",
                        label_key: str = "label", text_pair_key: str | None = None,
                        label_names: list[str] | None = None,
                        label_names_from: str | None = None, int_labels: bool | None = None,
                        num_labels: int | None = None, head_hint: str = "") -> ArrayDataset:
  """jsonl lines ``{"text": ..., "label": int or str}`` -> ``tokens``, ``mask``, ``label``
  (a file holding one JSON array of such objects works too).

  Sequences get the tokenizer's special tokens ([CLS] ... [SEP]) and are truncated to
  ``max_len`` keeping them, then right-padded with the pad id (``mask`` is False there).
  With ``text_pair_key`` the two texts are encoded as a pair and ``types`` (segment ids) is
  added. String labels map to ids by ``label_names`` (default: their sorted unique values);
  int labels must lie in ``[0, len(label_names))`` when names are given. An eval set passes
  the training set's names (``label_names_from``: its file, for errors) and ``int_labels``
  (the training set's kind: eval labels must be of the same kind). Every id must be below
  ``num_labels`` (the model's; ``head_hint`` is added to the fix it names). Integral float
  labels (``1.0``, as pandas writes ints) are ids; other floats (regression) are refused.
  ``class_names`` on the dataset holds the names when known; ``truncated`` counts the
  examples cut to ``max_len`` and ``empty`` the blank texts' places ("file:line").
  """
  check_max_len(max_len)
  tok, pad_id = load_tokenizer(tokenizer)
  records = read_jsonl(path)
  _check_keys(records[0], text_key, text_pair_key, label_key)
  texts, raw_labels, empty = [], [], []
  for where, obj in records:
    text = field(where, obj, text_key)
    if text_pair_key is not None:
      text = (text, field(where, obj, text_pair_key))
    if not "".join(text if isinstance(text, tuple) else (text,)).strip():
      empty.append(where)
    texts.append(text)
    raw_labels.append((where, _label(where, field(where, obj, label_key,
                                                  kind=(int, str, float)), label_key)))
  labels, class_names = _label_ids(path, raw_labels, label_names, label_names_from, int_labels,
                                   num_labels, head_hint)

  n_special = tok.num_special_tokens_to_add(text_pair_key is not None)
  if max_len <= n_special:
    raise ValueError(f"max_len={max_len} leaves no room for text after the tokenizer's "
                     f"{n_special} special tokens")
  tok.enable_truncation(max_length=int(max_len))
  n = len(texts)
  tokens = np.full((n, max_len), pad_id, np.int32)
  types = np.zeros((n, max_len), np.int32)
  mask = np.zeros((n, max_len), bool)
  truncated = 0
  for start in range(0, n, ENCODE_CHUNK):  # written as encoded: no Encoding of all at once
    try:
      encodings = tok.encode_batch(texts[start:start + ENCODE_CHUNK], add_special_tokens=True)
    except Exception as e:  # tokenizers raises its own type on impossible truncation
      raise ValueError(f"cannot encode {path} with max_len={max_len}: {e}") from e
    for i, enc in enumerate(encodings, start):
      ids = enc.ids[:max_len]
      tokens[i, :len(ids)] = ids
      types[i, :len(ids)] = enc.type_ids[:max_len]
      mask[i, :len(ids)] = True
      truncated += bool(enc.overflowing)
  arrays = {"tokens": tokens, "mask": mask, "label": labels}
  if text_pair_key is not None:
    arrays["types"] = types
  ds = ArrayDataset(arrays)
  ds.class_names = class_names
  ds.truncated = truncated
  ds.empty = empty
  return ds


# field names of common datasets' exports (HF datasets: SST-2 "sentence", MRPC "sentence1"/
# "sentence2", QNLI "question"/"sentence"), named in the hint of a missing text field
PAIR_FIELDS = (("sentence1", "sentence2"), ("question", "sentence"), ("question1", "question2"),
               ("premise", "hypothesis"))


def _check_keys(first: tuple[str, dict], text_key, text_pair_key, label_key) -> None:
  """The first record has the configured fields, or a ValueError naming the config fields
  that choose them and, where the record has a known pair of text fields, the pair."""
  where, obj = first
  for key, name in ((text_key, "text_key"), (text_pair_key, "text_pair_key"),
                    (label_key, "label_key")):
    if key is None or key in obj:
      continue
    hint = f"set {name}=<one of its fields>"
    if name == "text_key":
      pair = next((p for p in PAIR_FIELDS if set(p) <= set(obj)), None)
      strings = [k for k, v in obj.items() if isinstance(v, str) and k != label_key]
      if pair is not None and text_pair_key is None:
        hint = f"for sentence pairs set text_key={pair[0]} text_pair_key={pair[1]}"
      elif len(strings) == 1:
        hint = f"set text_key={strings[0]}"
    raise ValueError(f"{where}: missing key {key!r} (has {sorted(obj)}); {hint}")


def _label(where: str, value, key: str):
  """A label as read: an int or a str; an integral float as its int."""
  if isinstance(value, float):
    if not value.is_integer():
      raise ValueError(f"{where}: {key!r} is {value}, not a class: labels are class ids "
                       "(ints) or names (strings); regression is not supported")
    return int(value)
  return value


def _label_ids(path, raw: list[tuple[str, Any]], label_names, names_from=None,
               int_labels=None, num_labels=None, head_hint="") -> tuple[np.ndarray, list | None]:
  """int32 label ids and the class names (None for int labels without names)."""
  kinds = {type(v) for _, v in raw}
  if len(kinds) > 1:
    (first, v0), (where, v) = raw[0], next(r for r in raw if type(r[1]) is not type(raw[0][1]))
    raise ValueError(f"{where}: label {v!r} is {'a string' if isinstance(v, str) else 'an int'} "
                     f"but {first} has {v0!r}; labels mix ints and strings, use one kind")
  if int_labels is not None and (kinds == {int}) != int_labels:
    where, v = raw[0]
    raise ValueError(f"{where}: label {v!r} is {'a string' if int_labels else 'an int'} but "
                     f"the training data {names_from or ''} has "
                     f"{'int' if int_labels else 'string'} labels")
  if label_names is not None:
    label_names = [str(x) for x in label_names]
    if not label_names or len(set(label_names)) != len(label_names):
      raise ValueError(f"label_names must be non-empty and unique, got {label_names}")
  if kinds == {str}:
    names = label_names if label_names is not None else sorted({v for _, v in raw})
    index = {name: i for i, name in enumerate(names)}
    ids = []
    for where, v in raw:
      if v not in index:
        source = (f"does not occur in the training data {names_from}" if names_from
                  else "not in label_names")
        raise ValueError(f"{where}: label {v!r} {source} (labels: {names})")
      if num_labels is not None and index[v] >= num_labels:
        counts = collections.Counter(u for _, u in raw)
        listed = ", ".join(f"{n!r} {counts[n]}" for n in names[:8]) + (
            ", ..." if len(names) > 8 else "")
        raise ValueError(f"{where}: label {v!r} is id {index[v]}, outside the model's "
                         f"num_labels={num_labels} ({len(names)} distinct labels: {listed}; "
                         f"set model.num_labels={len(names)}{head_hint})")
      ids.append(index[v])
    return np.asarray(ids, np.int32), names
  for where, v in raw:
    if v < 0:
      raise ValueError(f"{where}: label {v} is negative; int labels are class ids 0, 1, ...")
    if v > np.iinfo(np.int32).max:
      raise ValueError(f"{where}: label {v} is too large for a class id")
    if label_names is not None and v >= len(label_names):
      raise ValueError(f"{where}: label {v} has no name among the {len(label_names)} "
                       f"label_names (ids 0..{len(label_names) - 1})")
    if num_labels is not None and v >= num_labels:
      low = min(u for _, u in raw)
      based = (f"; the labels look {low}-based (the smallest is {low}): ids start at 0, so "
               "ids below it would be classes never seen" if low > 0 else "")
      raise ValueError(f"{where}: label {v} is outside the model's num_labels={num_labels} "
                       f"(ids 0..{num_labels - 1}); set model.num_labels="
                       f"{max(u for _, u in raw) + 1}{head_hint}{based}")
  return np.asarray([v for _, v in raw], np.int32), label_names
