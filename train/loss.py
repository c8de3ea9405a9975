"""The loss of each task: cross-entropy over classes (image, text) or next tokens (lm)."""

from __future__ import annotations

import jax.numpy as jnp
import optax


def loss_and_metrics(model, batch: dict, task: str):
  """Mean loss over the counted examples/tokens and (loss_sum, correct, count)."""
  if task == "image":
    logits, labels = model(batch["image"]), batch["label"]
    weights = jnp.ones(labels.shape, jnp.float32)
  elif task == "text":
    logits, labels = model(batch["tokens"], batch["mask"]), batch["label"]
    weights = jnp.ones(labels.shape, jnp.float32)
  else:
    logits, labels = model(batch["tokens"]), batch["targets"]
    weights = batch["loss_mask"].astype(jnp.float32)
  losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
  count = jnp.maximum(weights.sum(), 1.0)
  correct = jnp.sum((jnp.argmax(logits, -1) == labels) * weights)
  loss_sum = jnp.sum(losses * weights)
  return loss_sum / count, (loss_sum, correct, weights.sum())
