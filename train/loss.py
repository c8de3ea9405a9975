"""The loss of each task: cross-entropy over classes (image, text) or next tokens (lm).

A causal LM that has ``token_losses`` (LLaMA, RevLlama) computes its next-token loss with
the fused, chunked head (:func:`lowmem_jax.lm_loss.chunked_cross_entropy`: no
``[B, T, V]`` fp32 logits) when ``lm_loss_chunk > 0``; otherwise, and for the other tasks,
the loss is taken on the model's logits.
"""

from __future__ import annotations

import jax.numpy as jnp

from lowmem_jax.lm_loss import DEFAULT_CHUNK, logits_cross_entropy


def loss_and_metrics(model, batch: dict, task: str, lm_loss_chunk: int = DEFAULT_CHUNK):
  """Mean loss over the counted examples/tokens and (loss_sum, correct, count).
  ``lm_loss_chunk``: tokens per chunk of the fused LM head and loss (task "lm"), 0 for
  the loss on the full logits."""
  if task == "image":
    losses, correct = logits_cross_entropy(model(batch["image"]), batch["label"])
    weights = jnp.ones(losses.shape, jnp.float32)
  elif task == "text":
    # text pairs carry segment ids (types): the second text is segment 1, as HF embeds it
    logits = model(batch["tokens"], batch["mask"], batch.get("types"))
    losses, correct = logits_cross_entropy(logits, batch["label"])
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
