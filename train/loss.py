"""The loss of each task: cross-entropy over classes (image, text) or next tokens (lm).

A causal LM that has ``token_losses`` (LLaMA, RevLlama) computes its next-token loss with
the fused, chunked head (:func:`lowmem_jax.lm_loss.chunked_cross_entropy`: no
``[B, T, V]`` fp32 logits) when ``lm_loss_chunk > 0``; otherwise, and for the other tasks,
the loss is taken on the model's logits. An image batch's uint8 codes become the model's
floats here, inside the step (:func:`train.images.model_pixels`), for the train and eval
losses alike.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from lowmem_jax.lm_loss import DEFAULT_CHUNK, logits_cross_entropy
from train.images import model_pixels


def eval_metrics(model, batch: dict, task: str, lm_loss_chunk: int = DEFAULT_CHUNK,
                 pixel_values=None):
  """``(loss_sum, correct, count, predictions, classes)``: :func:`loss_and_metrics`' sums
  and, for a classifier (image, text), each example's predicted class from the same logits
  and the number of classes (None, None for lm), which the host counts against the labels
  (O(batch) out, whatever the classes)."""
  if task == "lm":
    return (*loss_and_metrics(model, batch, task, lm_loss_chunk)[1], None, None)
  logits = _class_logits(model, batch, task, pixel_values)
  losses, correct = logits_cross_entropy(logits, batch["label"])
  return (jnp.sum(losses), jnp.sum(correct.astype(jnp.float32)),
          jnp.float32(losses.shape[0]), jnp.argmax(logits, axis=-1).astype(jnp.int32),
          jnp.int32(logits.shape[-1]))


def confusion_counts(labels, predictions, num_classes: int) -> np.ndarray:
  """``[K, K]`` counts of (label, prediction) pairs (rows: labels), on the host."""
  flat = np.asarray(labels, np.int64) * num_classes + np.asarray(predictions, np.int64)
  return np.bincount(flat, minlength=num_classes * num_classes).reshape(num_classes, -1)


def class_f1(confusion) -> tuple[np.ndarray, np.ndarray]:
  """Each class's F1 = 2 TP / (2 TP + FP + FN) (0 where it never occurs) and whether it
  occurs as a label or a prediction (rows: labels, columns: predictions)."""
  confusion = np.asarray(confusion, np.float64)
  tp = np.diag(confusion)
  denominator = 2 * tp + (confusion.sum(0) - tp) + (confusion.sum(1) - tp)
  seen = denominator > 0
  return np.where(seen, 2 * tp / np.maximum(denominator, 1), 0.0), seen


def macro_f1(confusion) -> float:
  """The mean of :func:`class_f1` over the classes that occur (0 where none does)."""
  f1, seen = class_f1(confusion)
  return float(np.mean(f1[seen])) if seen.any() else 0.0


def _class_logits(model, batch: dict, task: str, pixel_values=None):
  """A classifier's logits (image, text). An image's 8-bit codes are made the model's
  floats from ``pixel_values`` (:func:`train.images.code_values`; None: ``code / 255``).
  Text pairs carry segment ids (types): the second text is segment 1, as HF embeds it."""
  if task == "image":
    return model(model_pixels(batch["image"], pixel_values))
  return model(batch["tokens"], batch["mask"], batch.get("types"))


def loss_and_metrics(model, batch: dict, task: str, lm_loss_chunk: int = DEFAULT_CHUNK,
                     pixel_values=None):
  """Mean loss over the counted examples/tokens and (loss_sum, correct, count).
  ``lm_loss_chunk``: tokens per chunk of the fused LM head and loss (task "lm"), 0 for
  the loss on the full logits; ``pixel_values``: an image's value per 8-bit code
  (:func:`train.images.code_values`)."""
  if task in ("image", "text"):
    losses, correct = logits_cross_entropy(
        _class_logits(model, batch, task, pixel_values), batch["label"])
    weights = jnp.ones(losses.shape, jnp.float32)
  else:
    tokens, targets = batch["tokens"], batch["targets"]
    if lm_loss_chunk and hasattr(model, "token_losses"):
      losses, correct = model.token_losses(tokens, targets, chunk=lm_loss_chunk)
    else:
      losses, correct = logits_cross_entropy(model(tokens), targets)
    weights = batch["loss_mask"].astype(jnp.float32)
  count = jnp.maximum(weights.sum(), 1.0)
  loss_sum = jnp.sum(losses * weights)
  return loss_sum / count, (loss_sum, jnp.sum(correct * weights), weights.sum())
