"""Dynamic loss scaling for float16 compute, as PyTorch's ``torch.amp.GradScaler``.

fp16 has 5 exponent bits: a mean loss's cotangents (1/tokens, times probabilities) fall
below its smallest number as the tokens a step grow, and the gradients lose them. The step
differentiates ``loss * scale`` instead and divides the gradients by ``scale`` (a power of
two: exact). A step whose loss is finite but whose gradients are not overflowed: it is
skipped (parameters, optimizer and site state as they were; only its step count and the
scale move: the optimizer's own count, which its schedule reads, does not, as in PyTorch
where ``optimizer.step`` is not called) and halves the scale. ``GROWTH_INTERVAL`` finite
steps in a row double it. At ``MIN_SCALE`` there is nothing left to back off: a step
that overflows there is non-finite, and the trainer stops the run as for any other. A
non-finite loss is never skipped: the forward itself overflowed, which no scale fixes.

The state lives in the train state under ``"loss_scale"`` (so a checkpoint holds it and a
resume goes on with the scale the run reached), on runs that scale only:
``{"scale": f32, "good": i32 (finite steps since the last change), "skipped": i32}``.
bf16 (the default) has fp32's exponent range and needs none.
"""

from __future__ import annotations

import jax.numpy as jnp

INIT_SCALE = 2.0 ** 16      # GradScaler's init_scale
GROWTH_INTERVAL = 2000      # GradScaler's growth_interval; factors 2 and 1/2 as its
MIN_SCALE = 1.0
MAX_SCALE = 2.0 ** 24       # far below fp32's range (the scaled loss is fp32)

MODES = ("auto", "dynamic", "none")  # config field loss_scale; auto: dynamic under float16


def enabled(loss_scale: str, dtype: str) -> bool:
  """Whether a run with config fields ``loss_scale`` and ``dtype`` scales its loss."""
  return loss_scale == "dynamic" or (loss_scale == "auto" and dtype == "float16")


def init() -> dict:
  """The state of a run's first step."""
  return {"scale": jnp.float32(INIT_SCALE), "good": jnp.zeros((), jnp.int32),
          "skipped": jnp.zeros((), jnp.int32)}


def overflowed(state: dict, loss, grad_norm):
  """Whether a step with this loss and (unscaled) gradient norm is one to skip: a finite
  loss, gradients that are not, and a scale that can still back off."""
  return jnp.isfinite(loss) & ~jnp.isfinite(grad_norm) & (state["scale"] > MIN_SCALE)


def update(state: dict, finite) -> dict:
  """The state after a step whose gradients were ``finite`` (else it was skipped)."""
  scale, good = state["scale"], state["good"] + 1
  grow = finite & (good >= GROWTH_INTERVAL)
  scale = jnp.where(finite, jnp.where(grow, jnp.minimum(scale * 2, MAX_SCALE), scale),
                    jnp.maximum(scale / 2, MIN_SCALE))
  return {"scale": scale, "good": jnp.where(finite & ~grow, good, 0),
          "skipped": state["skipped"] + (~finite).astype(jnp.int32)}
