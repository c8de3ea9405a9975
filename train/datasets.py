"""The training and eval datasets a config names, checked against the model's labels."""

from __future__ import annotations

import functools
import os
import re
import sys

import numpy as np

from train import images
from train.causal_lm import causal_lm
from train.config import TrainConfig
from train.model import model_config, resolve_path
from train.text import text_classification


def make_datasets(cfg: TrainConfig, model=None):
  """(train dataset, eval dataset or None) for the config's task. Class labels are checked
  against the model's ``num_labels`` (``model`` given, or the preset's), and, ``model``
  given, ``max_len`` and the token ids against its positions and vocabulary; string labels
  and class folders map to ids from the training set, which the eval set reuses. A
  pretrained model's images are normalized as its ``preprocessor_config.json`` says: 8-bit
  codes in the train and eval steps (:class:`train.trainer.Trainer`), float images here."""
  model_cfg = getattr(model, "cfg", None)
  if cfg.task == "image":
    if model_cfg is None:  # the image size of the model
      model_cfg = model_config(cfg)
    num_labels = getattr(model_cfg, "num_labels", None)
    if cfg.data == "digits":
      if num_labels is not None and num_labels < images.DIGITS_NUM_CLASSES:
        raise ValueError(f"data=digits has {images.DIGITS_NUM_CLASSES} classes but the model "
                         f"has num_labels={num_labels}; set model.num_labels="
                         f"{images.DIGITS_NUM_CLASSES}" + (" and new_head=true (a fresh head "
                         "for them)" if cfg.pretrained and not cfg.new_head else ""))
      train, test = images.digits("train", seed=cfg.seed), images.digits("test", seed=cfg.seed)
      size = (model_cfg.image_size, model_cfg.channels)
      if train.arrays["image"].shape[1:] != (size[0], size[0], size[1]):
        print(f"images: the 8x8 digits resized to {size[0]}x{size[0]}x{size[1]} for the model "
              "(bilinear)", flush=True)
        train, test = (images.resized(d, *size) for d in (train, test))
    else:
      scans = [images.scan_folder(cfg.data, num_labels=num_labels)]  # both, then decode
      if cfg.eval_data is not None:
        scans.append(images.scan_folder(cfg.eval_data, class_names=scans[0].class_names,
                                        class_names_from=cfg.data, num_labels=num_labels))
      size = f"{model_cfg.image_size}x{model_cfg.image_size}x{model_cfg.channels}"
      for scan in scans:
        print(f"images: {scan.summary()}, read at {size} for model "
              f"{cfg.pretrained or cfg.model}", flush=True)
      if not cfg.pretrained and cfg.model == "vit-digits":
        print(f"note: model=vit-digits (the default, made for the 8x8 digits) reads "
              f"{cfg.data} at {size}; for photos set pretrained=<dir> or model=<a ViT "
              "preset>", file=sys.stderr, flush=True)
      load = functools.partial(images.load_images, image_size=model_cfg.image_size,
                               channels=model_cfg.channels)
      train, test = load(scans[0]), (load(scans[1]) if len(scans) == 2 else None)
    train, test = (_checkpoint_label_ids(d, cfg) for d in (train, test))
    stats = images.pixel_normalization(resolve_path(cfg.pretrained)) if cfg.pretrained else None
    if stats is None:
      if cfg.pretrained:
        print(f"note: {cfg.pretrained} has no preprocessor_config.json (or it says "
              "do_normalize false): pixels go in unnormalized, in [0, 1]; a checkpoint "
              "pretrained on normalized pixels (HF ViT: (x - 0.5) / 0.5) wants that file "
              "beside its config.json", file=sys.stderr, flush=True)
      return train, test
    print(f"images: normalized as {cfg.pretrained}'s preprocessor_config.json says: mean "
          f"{stats[0].tolist()}, std {stats[1].tolist()}", flush=True)
    # 8-bit codes go to the device as they are: the steps look up each code's normalized
    # value (train.images.model_pixels); float images are normalized per batch here
    return tuple(d if d is None or _image_dtype(d) == np.uint8 else images.normalized(d, *stats)
                 for d in (train, test))
  if model_cfg is not None and cfg.max_len > model_cfg.max_tokens:
    raise ValueError(f"max_len={cfg.max_len} exceeds the {model_cfg.max_tokens} positions "
                     f"of model {cfg.pretrained or cfg.model}; set max_len <= "
                     f"{model_cfg.max_tokens}")
  tokenizer = (resolve_path(cfg.tokenizer) if cfg.tokenizer else
               os.path.join(resolve_path(cfg.pretrained), "tokenizer.json")
               if cfg.pretrained else None)
  if tokenizer is None:
    raise ValueError(f"task={cfg.task!r} needs tokenizer=<tokenizer.json> or pretrained=<dir>")
  if cfg.task == "lm":
    load = functools.partial(causal_lm, tokenizer=tokenizer, max_len=cfg.max_len)
    in_vocab = functools.partial(_in_vocab, model_cfg=model_cfg, tokenizer=tokenizer,
                                 pretrained=cfg.pretrained)
    out = [None if path is None else in_vocab(load(path), path=path)
           for path in (cfg.data, cfg.eval_data)]
    for path, dataset in zip((cfg.data, cfg.eval_data), out):
      if dataset is not None:  # each row is padded to max_len: the share that trains said
        mask = dataset.arrays["loss_mask"]
        print(f"lm: {path}: {len(dataset)} rows of max_len={cfg.max_len}, {int(mask.sum())} "
              f"tokens in the loss ({mask.mean():.0%} of the row slots)", flush=True)
    return tuple(out)
  num_labels = (getattr(model_cfg, "num_labels", None) if model_cfg is not None
                else cfg.model_overrides.get("num_labels"))
  load = functools.partial(
      text_classification, tokenizer=tokenizer, max_len=cfg.max_len, num_labels=num_labels,
      text_key=cfg.text_key, label_key=cfg.label_key, text_pair_key=cfg.text_pair_key,
      head_hint=" and new_head=true" if cfg.pretrained and not cfg.new_head else "")
  in_vocab = functools.partial(_in_vocab, model_cfg=model_cfg, tokenizer=tokenizer,
                               pretrained=cfg.pretrained)
  train = in_vocab(load(cfg.data), path=cfg.data)
  _say_text_data(cfg.data, train, cfg, model_cfg)
  test = None if cfg.eval_data is None else in_vocab(load(
      cfg.eval_data, label_names=train.class_names, label_names_from=cfg.data,
      int_labels=train.class_names is None), path=cfg.eval_data)
  if test is not None:
    _say_text_data(cfg.eval_data, test, cfg, model_cfg)
  return _checkpoint_label_ids(train, cfg), _checkpoint_label_ids(test, cfg)


def _image_dtype(dataset) -> np.dtype:
  """The dtype of the images a batch of ``dataset`` carries (after its transform)."""
  return dataset.take(np.arange(1))["image"].dtype


def _say_text_data(path, dataset, cfg: TrainConfig, model_cfg) -> None:
  """One line of what a text file gave (examples, classes and their counts); a warning
  for texts cut at max_len (silently, before) and for blank ones."""
  counts = np.bincount(dataset.arrays["label"])
  names = dataset.class_names or [str(i) for i in range(len(counts))]
  classes = ", ".join(f"{n}: {c}" for n, c in zip(names, counts) if c)
  shown = classes if len(classes) <= 200 else classes[:200] + " ..."
  print(f"text: {path}: {len(dataset)} examples, {int(np.count_nonzero(counts))} classes "
        f"({shown})" + (", sentence pairs" if "types" in dataset.arrays else ""), flush=True)
  if dataset.truncated:
    room = (f" (the model takes up to {model_cfg.max_tokens})"
            if model_cfg is not None and model_cfg.max_tokens > cfg.max_len else "")
    print(f"warning: {path}: {dataset.truncated} of {len(dataset)} examples are longer than "
          f"max_len={cfg.max_len} tokens and were cut to it; set a larger max_len{room} to "
          "train on more of them", file=sys.stderr, flush=True)
  if dataset.empty:
    print(f"warning: {path}: {len(dataset.empty)} example(s) have a blank text (first: "
          f"{dataset.empty[0]}): they train on the special tokens alone",
          file=sys.stderr, flush=True)


def _checkpoint_label_ids(dataset, cfg: TrainConfig):
  """``dataset`` with a pretrained classifier's own label ids, where its head is kept
  (not ``new_head``) and its config.json's ``id2label`` names every class of the data:
  each class takes the id the head was trained for (ids from the sorted class names could
  be another order: the head would have to learn its classes anew, permuted), and
  ``class_names`` becomes the checkpoint's list (in place). Otherwise ``dataset`` as it
  is."""
  names = getattr(dataset, "class_names", None)
  if dataset is None or names is None or not cfg.pretrained or cfg.new_head:
    return dataset
  from models.hf import checkpoint_labels, has_head
  ours = checkpoint_labels(resolve_path(cfg.pretrained))
  if ours is None:
    return dataset  # no usable label map: the model's own checks speak for the file
  if len(set(ours)) != len(ours):
    return dataset
  if not set(names) <= set(ours):
    if all(re.fullmatch(r"LABEL_\d+", n) for n in ours) or not has_head(
        resolve_path(cfg.pretrained)):
      return dataset  # a head of no names (HF's default id2label), or none: the data's ids
    missing = sorted(set(names) - set(ours))
    raise ValueError(
        f"data={cfg.data}: classes {missing[:5]}{' ...' if len(missing) > 5 else ''} are "
        f"not among the classes of {cfg.pretrained}'s head ({', '.join(ours[:5])}"
        f"{', ...' if len(ours) > 5 else ''}: {len(ours)}, its config.json's id2label); "
        f"set new_head=true and model.num_labels={len(names)} for a new head of the data's "
        "classes")
  index = {name: i for i, name in enumerate(ours)}
  if [index[n] for n in names] != list(range(len(names))):
    print(f"labels: {cfg.pretrained}'s head's own ids for the data's classes (its "
          "config.json's id2label)", flush=True)
  dataset.arrays["label"] = np.asarray([index[n] for n in names], np.int32)[
      dataset.arrays["label"]]
  dataset.class_names = ours
  return dataset


def _in_vocab(dataset, *, model_cfg, path, tokenizer, pretrained):
  """``dataset``, whose token ids the model's embedding table covers, or a ValueError: an
  id past the table reads no row (a NaN loss at step 1 on a GPU, after compiling). A
  pretrained model's table is its checkpoint's: only its tokenizer fits it."""
  if model_cfg is None:
    return dataset
  top = max(int(dataset.arrays[k].max()) for k in ("tokens", "targets")
            if k in dataset.arrays)
  if top >= model_cfg.vocab_size:
    raise ValueError(f"{path}: token id {top} (tokenizer {tokenizer}) is outside the "
                     f"model's vocab_size={model_cfg.vocab_size}; " + (
                         f"use the tokenizer {pretrained} was trained with (its "
                         "tokenizer.json; the embedding table is the checkpoint's)"
                         if pretrained else "use the model's tokenizer or set "
                         f"model.vocab_size={_vocab_size(tokenizer, top + 1)} (the "
                         "tokenizer's vocabulary: every id it can give)"))
  return dataset


def _vocab_size(tokenizer, at_least: int) -> int:
  """The vocabulary size of the tokenizer file ``tokenizer`` (at least ``at_least``): an
  id seen in one file is not the largest the tokenizer gives in another."""
  from train.tokenize import load_tokenizer
  try:
    return max(at_least, load_tokenizer(tokenizer)[0].get_vocab_size())
  except (OSError, ValueError):  # no tokenizer file to read: the id seen is what is known
    return at_least


def check_for_run(cfg: TrainConfig, train, test) -> None:
  """What a run needs of its datasets: a training set of one batch at least (an error
  naming ``data``), and an eval set where ``eval_every`` asks for one (a note)."""
  if len(train) < cfg.batch_size:
    unit = ("examples (a .txt's: max_len windows of its text)" if cfg.task == "lm"
            else "examples")
    raise ValueError(f"data={cfg.data!r}: {len(train)} {unit}, fewer than one batch of "
                     f"batch_size={cfg.batch_size}; set batch_size <= {len(train)}, or give "
                     "more data")
  if test is None and cfg.eval_every:
    print(f"note: no eval_data: eval_every={cfg.eval_every} evaluates nothing (set "
          "eval_data=<file>)", flush=True)
