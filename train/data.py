"""Data for fine-tuning: in-memory datasets of numpy arrays and deterministic, resumable batches.

Every loader returns an ``ArrayDataset`` (a dict of equal-length numpy arrays, one row per
example); ``Batches`` turns it into an infinite stream of batches whose order depends only on
``(seed, epoch)``, so a run resumes exactly from ``Batches.state()``. numpy only: the training
loop moves batches to the device.

Loaders and the fields they return:

| loader | fields |
|---|---|
| ``digits`` | ``image`` f32 [n, 8, 8, 1] in [0, 1], ``label`` i32 |
| ``image_folder`` | ``image`` f32 [n, H, W, C] in [0, 1], ``label`` i32 |
| ``text_classification`` | ``tokens`` i32 [n, L], ``mask`` bool, ``label`` i32; pairs: ``types`` |
| ``causal_lm`` | ``tokens`` i32 [n, L], ``targets`` i32 [n, L], ``loss_mask`` bool [n, L] |
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

DIGITS_NUM_CLASSES = 10

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

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm")
# End-of-text tokens looked up, in order, when the tokenizer's post-processor adds none.
EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")
PAD_CANDIDATES = ("[PAD]", "<pad>", "<|pad|>", "<|finetune_right_pad_id|>")


class MissingFileError(FileNotFoundError, ValueError):
  """A dataset or tokenizer path that does not exist (both a FileNotFoundError and a ValueError)."""


# ----------------------------------------------------------------------------- dataset
class ArrayDataset:
  """In-memory examples: a dict of equal-length numpy arrays, row ``i`` of each is example ``i``.

  ``class_names`` (when the loader knows them) lists the label names by label id.
  """

  class_names: list[str] | None = None

  def __init__(self, arrays: dict[str, np.ndarray]):
    if not arrays:
      raise ValueError("empty dataset: no arrays given")
    arrays = {name: np.asarray(a) for name, a in arrays.items()}
    lengths = {}
    for name, a in arrays.items():
      if a.ndim == 0:
        raise ValueError(f"array {name!r} is a scalar; every array needs a leading example axis")
      lengths[name] = a.shape[0]
    if len(set(lengths.values())) != 1:
      raise ValueError(f"arrays have different lengths: {lengths}")
    if next(iter(lengths.values())) == 0:
      raise ValueError("empty dataset: arrays have no rows")
    self.arrays = arrays

  def __len__(self) -> int:
    return next(iter(self.arrays.values())).shape[0]

  def take(self, indices: np.ndarray) -> dict[str, np.ndarray]:
    """The rows ``indices`` of every array, as a batch."""
    indices = np.asarray(indices)
    return {name: a[indices] for name, a in self.arrays.items()}

  def __repr__(self) -> str:
    fields = ", ".join(f"{k}: {a.dtype}{list(a.shape)}" for k, a in self.arrays.items())
    return f"ArrayDataset(n={len(self)}, {fields})"


# ----------------------------------------------------------------------------- digits
def digits(split: str = "train", *, test_fraction: float = 0.2, seed: int = 0) -> ArrayDataset:
  """scikit-learn's bundled 8x8 digits (1797 images, no download), split per class.

  The split is stratified: within each class a ``default_rng(seed)`` permutation sends
  ``round(test_fraction * count)`` images to "test" and the rest to "train" (disjoint, fixed).
  """
  if split not in ("train", "test"):
    raise ValueError(f"digits split must be 'train' or 'test', got {split!r}")
  if not 0.0 < test_fraction < 1.0:
    raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
  try:
    from sklearn.datasets import load_digits
  except ImportError as e:
    raise ImportError("digits() needs scikit-learn: pip install scikit-learn") from e
  images, labels = load_digits(return_X_y=True)
  labels = labels.astype(np.int32)
  rng = np.random.default_rng(seed)
  test = []
  for c in range(DIGITS_NUM_CLASSES):
    members = rng.permutation(np.flatnonzero(labels == c))
    test.append(members[:int(round(test_fraction * len(members)))])
  is_test = np.zeros(len(labels), bool)
  is_test[np.concatenate(test)] = True
  rows = np.flatnonzero(is_test if split == "test" else ~is_test)
  image = (images[rows] / 16.0).astype(np.float32).reshape(-1, 8, 8, 1)
  ds = ArrayDataset({"image": image, "label": labels[rows]})
  ds.class_names = [str(c) for c in range(DIGITS_NUM_CLASSES)]
  return ds


# ----------------------------------------------------------------------------- images
def image_folder(path, *, image_size: int, channels: int = 3,
                 class_names: list[str] | None = None, class_names_from: str | None = None,
                 num_labels: int | None = None) -> ArrayDataset:
  """ImageNet-style folder ``path/<class_name>/<image>``; label ids follow sorted class names,
  or ``class_names`` (the training set's, read from ``class_names_from``) for an eval folder,
  which may hold fewer classes but no other. Every label must be below ``num_labels``.

  Images (read with Pillow) and ``.npy`` files (an HxWxC or HxW array: uint8 in [0, 255],
  uint16 in [0, 65535] or float in [0, 1]) are resized to ``image_size`` squared (bilinear,
  antialiased, aspect ratio not kept). Hidden entries and other files are ignored.
  Returns ``image`` f32 [n, H, W, C] in [0, 1] and ``label`` i32; ``class_names`` on the dataset.
  """
  root = Path(path)
  if not root.exists():
    raise MissingFileError(f"image folder not found: {root}")
  if not root.is_dir():
    raise ValueError(f"image folder is not a directory: {root}")
  if image_size < 1:
    raise ValueError(f"image_size must be >= 1, got {image_size}")
  if channels not in (1, 3, 4):
    raise ValueError(f"channels must be 1, 3 or 4, got {channels}")
  present = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
  if not present:
    raise ValueError(f"no class folders in {root} (expected {root}/<class_name>/<images>)")
  if class_names is None:
    class_names = present
  index = {name: i for i, name in enumerate(class_names)}
  files, labels = [], []
  for name in present:
    if name not in index:
      raise ValueError(f"class folder {root / name}: class {name!r} does not occur in the "
                       f"training data {class_names_from or ''} (its classes: {class_names})")
    found = sorted(p for p in (root / name).iterdir()
                   if p.is_file() and not p.name.startswith(".")
                   and p.suffix.lower() in IMAGE_SUFFIXES + (".npy",))
    if not found:
      raise ValueError(f"class folder {root / name} holds no images "
                       f"(.npy or {', '.join(IMAGE_SUFFIXES)})")
    if num_labels is not None and index[name] >= num_labels:
      raise ValueError(f"{found[0]}: class {name!r} is label {index[name]}, outside the "
                       f"model's num_labels={num_labels} ({len(class_names)} classes; set "
                       f"model.num_labels={len(class_names)})")
    files += found
    labels += [index[name]] * len(found)
  pil = None
  if any(f.suffix.lower() != ".npy" for f in files):
    try:
      from PIL import Image as pil
    except ImportError as e:
      raise ImportError(f"image_folder needs Pillow to read images in {root}: "
                        "pip install pillow") from e
  image = np.empty((len(files), image_size, image_size, channels), np.float32)
  for i, f in enumerate(files):
    if f.suffix.lower() == ".npy":
      image[i] = _load_npy_image(f, image_size, channels)
    else:
      image[i] = _load_pil_image(pil, f, image_size, channels)
  ds = ArrayDataset({"image": image, "label": np.asarray(labels, np.int32)})
  ds.class_names = class_names
  return ds


def _load_pil_image(pil, f: Path, size: int, channels: int) -> np.ndarray:
  """One image file -> f32 [size, size, channels] in [0, 1]."""
  mode = {1: "L", 3: "RGB", 4: "RGBA"}[channels]
  try:
    with pil.open(f) as im:
      im = im.convert(mode).resize((size, size), pil.Resampling.BILINEAR)
      a = np.asarray(im, np.float32) / 255.0
  except (OSError, ValueError) as e:
    raise ValueError(f"cannot read image {f}: {e}") from e
  return a.reshape(size, size, channels)


def _load_npy_image(f: Path, size: int, channels: int) -> np.ndarray:
  """One .npy HxWxC (or HxW) array -> f32 [size, size, channels] in [0, 1]."""
  try:
    a = np.load(f, allow_pickle=False)
  except (OSError, ValueError) as e:
    raise ValueError(f"cannot read {f}: {e}") from e
  if a.ndim == 2:
    a = a[:, :, None]
  if a.ndim != 3 or a.shape[0] < 1 or a.shape[1] < 1:
    raise ValueError(f"{f}: expected an HxWxC or HxW image array, got shape {a.shape}")
  if a.dtype == np.uint8:
    a = a.astype(np.float32) / 255.0
  elif a.dtype == np.uint16:
    a = a.astype(np.float32) / 65535.0
  elif a.dtype == np.bool_ or np.issubdtype(a.dtype, np.floating):
    a = a.astype(np.float32)
    if a.size and (not np.isfinite(a).all() or a.min() < 0.0 or a.max() > 1.0):
      raise ValueError(f"{f}: float image values must lie in [0, 1], "
                       f"got [{a.min()}, {a.max()}]")
  else:
    raise ValueError(f"{f}: unsupported image dtype {a.dtype} (uint8, uint16 or float in [0, 1])")
  a = _convert_channels(a, channels, f)
  if a.shape[:2] != (size, size):
    a = np.einsum("yh,hwc,xw->yxc", _resize_weights(a.shape[0], size), a,
                  _resize_weights(a.shape[1], size), optimize=True)
  return np.clip(a, 0.0, 1.0)


def _convert_channels(a: np.ndarray, channels: int, f: Path) -> np.ndarray:
  """HxWxC in [0, 1] -> HxWx``channels`` as Pillow's convert: grey is repeated, RGB -> L is
  ITU-R 601 luma, alpha is dropped or added as 1."""
  c = a.shape[2]
  if c == channels:
    return a
  if c not in (1, 3, 4):
    raise ValueError(f"{f}: image has {c} channels; expected 1, 3 or 4")
  if channels == 1:
    return a[:, :, :3] @ np.array([[0.299], [0.587], [0.114]], np.float32)
  rgb = np.repeat(a, 3, axis=2) if c == 1 else a[:, :, :3]
  if channels == 3:
    return rgb
  return np.concatenate([rgb, np.ones_like(rgb[:, :, :1])], axis=2)


def _resize_weights(n_in: int, n_out: int) -> np.ndarray:
  """[n_out, n_in] bilinear (triangle filter) resampling matrix, widened when downsampling
  (antialiased, as Pillow's BILINEAR resize); half-pixel centres."""
  scale = n_in / n_out
  support = max(scale, 1.0)
  centres = (np.arange(n_out) + 0.5) * scale
  w = np.maximum(0.0, 1.0 - np.abs((np.arange(n_in)[None, :] + 0.5 - centres[:, None]) / support))
  return (w / w.sum(1, keepdims=True)).astype(np.float32)  # every row has a pixel within 0.5


# ----------------------------------------------------------------------------- text helpers
def _load_tokenizer(tokenizer):
  """A private copy of ``tokenizer`` (a tokenizers.Tokenizer, a HF fast tokenizer, or a path to
  tokenizer.json or its folder) with its own padding and truncation settings switched off."""
  from tokenizers import Tokenizer
  if isinstance(tokenizer, (str, os.PathLike)):
    p = Path(tokenizer)
    if p.is_dir():
      p = p / "tokenizer.json"
    if not p.is_file():
      raise MissingFileError(f"tokenizer file not found: {p}")
    tok = Tokenizer.from_file(str(p))
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


def _special_affixes(tok) -> tuple[list[int], list[int]]:
  """The special ids the tokenizer's post-processor puts before and after one sequence."""
  probe = "hello world"
  plain = tok.encode(probe, add_special_tokens=False).ids
  full = tok.encode(probe, add_special_tokens=True).ids
  for k in range(len(full) - len(plain) + 1):
    if full[k:k + len(plain)] == plain:
      return full[:k], full[k + len(plain):]
  raise ValueError("cannot locate the text inside the tokenizer's post-processed encoding")


def _eos_ids(tok, suffix: list[int]) -> list[int]:
  """End-of-text ids: the post-processor's suffix (e.g. BERT's [SEP]), else a known end token."""
  if suffix:
    return suffix
  for name in EOS_CANDIDATES:
    i = tok.token_to_id(name)
    if i is not None:
      return [i]
  return []


def _read_jsonl(path) -> list[tuple[str, dict]]:
  """(where, object) for every record: one per non-blank line of a jsonl file, where is
  "file:line"; or, for a file holding one JSON array (Alpaca's .json), "file[item]"."""
  p = Path(path)
  if not p.is_file():
    raise MissingFileError(f"data file not found: {p}")
  text = p.read_text(encoding="utf-8-sig")
  if text.lstrip().startswith("["):
    try:
      items = json.loads(text)
    except json.JSONDecodeError as e:
      raise ValueError(f"{p}:{e.lineno}: bad json: {e.msg}") from None
    records = [(f"{p}[{i}]", obj) for i, obj in enumerate(items)]
  else:
    records = []
    for line_no, line in enumerate(text.split("\n"), 1):  # not splitlines: U+2028 is valid
      if not line.strip():
        continue
      try:
        records.append((f"{p}:{line_no}", json.loads(line)))
      except json.JSONDecodeError as e:
        raise ValueError(f"{p}:{line_no}: bad json line: {e.msg}") from None
  for where, obj in records:
    if not isinstance(obj, dict):
      raise ValueError(f"{where}: expected a json object, got {type(obj).__name__}")
  if not records:
    raise ValueError(f"empty dataset: {p} has no examples")
  return records


def _field(where: str, obj: dict, key: str, *, kind=str, optional: bool = False):
  """``obj[key]`` checked for type; ValueError naming the file, line and key."""
  if key not in obj or obj[key] is None:
    if optional:
      return None
    raise ValueError(f"{where}: missing key {key!r} (has {sorted(obj)})")
  value = obj[key]
  if not isinstance(value, kind) or isinstance(value, bool):
    kinds = kind if isinstance(kind, tuple) else (kind,)
    raise ValueError(f"{where}: {key!r} must be {' or '.join(k.__name__ for k in kinds)}, "
                     f"got {type(value).__name__}")
  return value


def _check_max_len(max_len: int) -> None:
  if not isinstance(max_len, (int, np.integer)) or max_len < 1:
    raise ValueError(f"max_len must be a positive int, got {max_len!r}")


# ----------------------------------------------------------------------------- classification
def text_classification(path, tokenizer, *, max_len: int, text_key: str = "text",
                        label_key: str = "label", text_pair_key: str | None = None,
                        label_names: list[str] | None = None,
                        label_names_from: str | None = None, int_labels: bool | None = None,
                        num_labels: int | None = None) -> ArrayDataset:
  """jsonl lines ``{"text": ..., "label": int or str}`` -> ``tokens``, ``mask``, ``label``
  (a file holding one JSON array of such objects works too).

  Sequences get the tokenizer's special tokens ([CLS] ... [SEP]) and are truncated to
  ``max_len`` keeping them, then right-padded with the pad id (``mask`` is False there).
  With ``text_pair_key`` the two texts are encoded as a pair and ``types`` (segment ids) is
  added. String labels map to ids by ``label_names`` (default: their sorted unique values);
  int labels must lie in ``[0, len(label_names))`` when names are given. An eval set passes
  the training set's names (``label_names_from``: its file, for errors) and ``int_labels``
  (the training set's kind: eval labels must be of the same kind). Every id must be below
  ``num_labels`` (the model's). ``class_names`` on the dataset holds the names when known.
  """
  _check_max_len(max_len)
  tok, pad_id = _load_tokenizer(tokenizer)
  records = _read_jsonl(path)
  texts, raw_labels = [], []
  for where, obj in records:
    text = _field(where, obj, text_key)
    if text_pair_key is not None:
      text = (text, _field(where, obj, text_pair_key))
    texts.append(text)
    raw_labels.append((where, _field(where, obj, label_key, kind=(int, str))))
  labels, class_names = _label_ids(path, raw_labels, label_names, label_names_from, int_labels,
                                   num_labels)

  n_special = tok.num_special_tokens_to_add(text_pair_key is not None)
  if max_len <= n_special:
    raise ValueError(f"max_len={max_len} leaves no room for text after the tokenizer's "
                     f"{n_special} special tokens")
  tok.enable_truncation(max_length=int(max_len))
  try:
    encodings = tok.encode_batch(texts, add_special_tokens=True)
  except Exception as e:  # tokenizers raises its own exception type on impossible truncation
    raise ValueError(f"cannot encode {path} with max_len={max_len}: {e}") from e
  n = len(encodings)
  tokens = np.full((n, max_len), pad_id, np.int32)
  types = np.zeros((n, max_len), np.int32)
  mask = np.zeros((n, max_len), bool)
  for i, enc in enumerate(encodings):
    ids = enc.ids[:max_len]
    tokens[i, :len(ids)] = ids
    types[i, :len(ids)] = enc.type_ids[:max_len]
    mask[i, :len(ids)] = True
  arrays = {"tokens": tokens, "mask": mask, "label": labels}
  if text_pair_key is not None:
    arrays["types"] = types
  ds = ArrayDataset(arrays)
  ds.class_names = class_names
  return ds


def _label_ids(path, raw: list[tuple[str, Any]], label_names, names_from=None,
               int_labels=None, num_labels=None) -> tuple[np.ndarray, list | None]:
  """int32 label ids and the class names (None for int labels without names)."""
  kinds = {type(v) for _, v in raw}
  if len(kinds) > 1:
    raise ValueError(f"{path}: labels mix ints and strings; use one kind")
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
        raise ValueError(f"{where}: label {v!r} is id {index[v]}, outside the model's "
                         f"num_labels={num_labels} ({len(names)} distinct labels; set "
                         f"model.num_labels={len(names)})")
      ids.append(index[v])
    return np.asarray(ids, np.int32), names
  limit = len(label_names) if label_names is not None else np.iinfo(np.int32).max
  for where, v in raw:
    if not 0 <= v < limit:
      raise ValueError(f"{where}: label {v} out of range [0, {limit})")
    if num_labels is not None and v >= num_labels:
      raise ValueError(f"{where}: label {v} is outside the model's num_labels={num_labels} "
                       f"(ids 0..{num_labels - 1})")
  return np.asarray([v for _, v in raw], np.int32), label_names


# ----------------------------------------------------------------------------- causal LM
def causal_lm(path, tokenizer, *, max_len: int,
              prompt_template: str = DEFAULT_PROMPT) -> ArrayDataset:
  """Next-token data -> ``tokens`` (inputs), ``targets`` (the next tokens) and ``loss_mask``.

  - ``.txt``: the whole file is one token stream (the tokenizer's start token, the text, its
    end token) cut into windows of ``max_len + 1`` tokens with stride ``max_len``, so
    consecutive windows share one token and every next-token pair is trained exactly once; the
    last window is padded. ``loss_mask`` is True on every real target.
  - ``.jsonl`` (or ``.json`` holding one array of objects, as Alpaca's): one row per record,
    truncated to ``max_len + 1`` tokens and right-padded. A line
    ``{"text": ...}`` is trained on all of its tokens. A line ``{"instruction", "input"
    (optional), "output"}`` becomes ``prompt_template.format(instruction=..., input=...)``
    followed by the output: ``loss_mask`` is True only where the target is an output token or
    the end token. With the default template an empty input uses Alpaca's no-input prompt.

  Start/end tokens are the ones the tokenizer's post-processor adds to one sequence (BERT:
  [CLS] ... [SEP]; LLaMA: <s>); when it adds no end token, the first of ``EOS_CANDIDATES`` in
  the vocabulary ends each text and output, so the model learns to stop.
  """
  _check_max_len(max_len)
  p = Path(path)
  if not p.is_file():
    raise MissingFileError(f"data file not found: {p}")
  tok, pad_id = _load_tokenizer(tokenizer)
  prefix, suffix = _special_affixes(tok)
  eos = _eos_ids(tok, suffix)
  suffix_lower = p.suffix.lower()
  if suffix_lower == ".txt":
    text = p.read_text(encoding="utf-8-sig")
    if not text.strip():
      raise ValueError(f"empty dataset: {p} has no text")
    stream = prefix + tok.encode(text, add_special_tokens=False).ids + eos
    if len(stream) < 2:
      raise ValueError(f"{p} tokenizes to {len(stream)} token(s); need at least 2")
    starts = range(0, len(stream) - 1, max_len)
    rows = [(stream[s:s + max_len + 1], None) for s in starts]
  elif suffix_lower in (".jsonl", ".json"):
    rows = _causal_rows(p, tok, prefix, eos, prompt_template, max_len)
  else:
    raise ValueError(f"causal_lm reads .txt or .jsonl files, got {p.name}")

  n = len(rows)
  tokens = np.full((n, max_len), pad_id, np.int32)
  targets = np.full((n, max_len), pad_id, np.int32)
  loss_mask = np.zeros((n, max_len), bool)
  for i, (ids, in_loss) in enumerate(rows):
    ids = ids[:max_len + 1]
    m = len(ids) - 1
    if m < 1:
      continue
    tokens[i, :m] = ids[:-1]
    targets[i, :m] = ids[1:]
    loss_mask[i, :m] = True if in_loss is None else in_loss[1:m + 1]
  empty = int((~loss_mask.any(1)).sum())
  if empty == n:
    raise ValueError(f"{p}: no example has a token to train on (max_len={max_len} too short?)")
  if empty:
    warnings.warn(f"{p}: {empty} of {n} examples have no target in the loss "
                  f"(output truncated away at max_len={max_len}, or empty)", stacklevel=2)
  return ArrayDataset({"tokens": tokens, "targets": targets, "loss_mask": loss_mask})


def _causal_rows(p: Path, tok, prefix, eos, template, max_len):
  """(token ids, per-token in-loss flags or None for all) for every jsonl line."""
  if "{instruction}" not in template:
    raise ValueError("prompt_template must contain '{instruction}'")
  records = _read_jsonl(p)
  texts, kinds = [], []
  for where, obj in records:
    if "output" in obj:
      instruction = _field(where, obj, "instruction")
      inp = _field(where, obj, "input", optional=True) or ""
      output = _field(where, obj, "output")
      t = DEFAULT_PROMPT_NO_INPUT if template == DEFAULT_PROMPT and not inp.strip() else template
      try:
        prompt = t.format(instruction=instruction, input=inp)
      except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"bad prompt_template (only {{instruction}} and {{input}} are "
                         f"filled; literal braces must be doubled): {e!r}") from e
      texts += [prompt, output]
      kinds.append("instruction")
    elif "text" in obj:
      texts += [_field(where, obj, "text"), ""]
      kinds.append("text")
    else:
      raise ValueError(f"{where}: missing key: need 'text' or 'instruction'/'output' "
                       f"(has {sorted(obj)})")
  encoded = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
  rows = []
  for j, kind in enumerate(kinds):
    first, second = encoded[2 * j], encoded[2 * j + 1]
    ids = (prefix + first + second + eos)[:max_len + 1]
    if kind == "text":
      rows.append((ids, None))
    else:
      n_prompt = len(prefix) + len(first)
      rows.append((ids, [k >= n_prompt for k in range(len(ids))]))
  return rows


# ----------------------------------------------------------------------------- batching
class Batches:
  """Deterministic, resumable, infinite batches over epochs.

  Epoch ``e`` visits the rows in ``np.random.default_rng([seed, e]).permutation(n)`` order
  (``arange(n)`` without shuffle). With ``drop_last`` the ``n % batch_size`` rows left at the
  end of an epoch are skipped; without it the last batch of each epoch is smaller.
  ``state()`` is ``{"epoch", "position"}`` (position: rows of the epoch's order already
  yielded); ``restore(state)`` continues exactly there, also with another batch size.
  ``example_ids``: each batch also carries ``"example_id"`` (int32 row numbers).
  """

  def __init__(self, dataset: ArrayDataset, batch_size: int, *, seed: int = 0,
               shuffle: bool = True, drop_last: bool = True, example_ids: bool = False):
    if not isinstance(batch_size, (int, np.integer)) or isinstance(batch_size, bool) \
        or batch_size < 1:
      raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    n = len(dataset)
    if n < 1:
      raise ValueError("empty dataset: nothing to batch")
    if drop_last and n < batch_size:
      raise ValueError(f"dataset of {n} examples is smaller than one batch of {batch_size} "
                       "(drop_last=True); use a smaller batch_size or drop_last=False")
    self.dataset = dataset
    self.batch_size = int(batch_size)
    self.seed = int(seed)
    self.shuffle = bool(shuffle)
    self.drop_last = bool(drop_last)
    self.example_ids = bool(example_ids)
    self._n = n
    self._epoch_end = n - n % self.batch_size if self.drop_last else n
    self.steps_per_epoch = n // self.batch_size if self.drop_last else -(-n // self.batch_size)
    self._epoch = 0
    self._position = 0
    self._order_epoch = -1
    self._order = None

  @property
  def epoch(self) -> int:
    """The epoch the next batch comes from."""
    return self._epoch

  def order(self, epoch: int) -> np.ndarray:
    """The row order of ``epoch``."""
    if not self.shuffle:
      return np.arange(self._n)
    if epoch != self._order_epoch:
      self._order = np.random.default_rng([self.seed, epoch]).permutation(self._n)
      self._order_epoch = epoch
    return self._order

  def __iter__(self) -> Batches:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    rows = self.order(self._epoch)[self._position:self._position + self.batch_size]
    self._position += len(rows)
    self._roll()
    batch = self.dataset.take(rows)
    if self.example_ids:
      batch["example_id"] = rows.astype(np.int32)
    return batch

  def _roll(self) -> None:
    """Move to the next epoch once the current one has no full (or, without drop_last, any)
    batch left, so that state() is always where the next batch starts."""
    remaining = self._epoch_end - self._position
    if remaining <= 0 or (self.drop_last and remaining < self.batch_size):
      self._epoch += 1
      self._position = 0

  def state(self) -> dict:
    """``{"epoch": int, "position": int}``: JSON-serialisable, for ``restore``."""
    return {"epoch": int(self._epoch), "position": int(self._position)}

  def restore(self, state: dict) -> None:
    """Continue exactly where ``state()`` was taken."""
    try:
      epoch, position = state["epoch"], state["position"]
    except (KeyError, TypeError) as e:
      raise ValueError(f"batch state must be {{'epoch': int, 'position': int}}, got {state!r}") \
          from e
    for name, v in (("epoch", epoch), ("position", position)):
      if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
        raise ValueError(f"batch state {name} must be a non-negative int, got {v!r}")
    if position > self._n:
      raise ValueError(f"batch state position {position} is past the dataset size {self._n}")
    self._epoch, self._position = int(epoch), int(position)
    self._roll()

  def epoch_batches(self) -> Iterator[dict[str, np.ndarray]]:
    """One pass over the rows in order, no shuffle, last partial batch kept (for eval).
    Leaves the training position untouched."""
    for start in range(0, self._n, self.batch_size):
      yield self.dataset.take(np.arange(start, min(start + self.batch_size, self._n)))
