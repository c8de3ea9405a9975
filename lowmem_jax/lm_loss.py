"""A language-model head fused with its cross-entropy, in token chunks.

``logits = h @ w`` (fp32 accumulation) for every token of ``h [..., D]`` over a vocabulary
of ``V`` is ``[..., V]`` fp32: 500 MiB for LLaMA-7B's V = 32000 at 4096 tokens, and autodiff
keeps its gradient too. :func:`chunked_cross_entropy` computes per-token cross-entropy and
argmax accuracy ``chunk`` tokens at a time: no fp32 array of more than ``[chunk, V]`` exists
in forward or backward (besides ``dw``'s fp32 accumulator, the weight's size). It saves its
arguments ``h`` and ``w`` as given (no copies: the weight as stored, cast to the compute
dtype again in backward), an optional per-feature ``scale`` of the weight (a tied head's
merged norm scale, applied inside each pass, so no scaled copy of the table is kept) and
an fp32 log-sum-exp per token; backward recomputes each chunk's logits from them.

:func:`cross_entropy_reference` is the same function in plain jnp (full logits, autodiff);
:func:`logits_cross_entropy` is its loss on given logits (optax's formula), for heads that
cannot be fused.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from lowmem_jax.quantized_weight import QuantizedKernel, dequantize

# Tokens per chunk: [1024, 32000] fp32 is 125 MiB (the whole [4096, 32000]: 500 MiB). A
# trained head reads and writes its fp32 [D, V] gradient accumulator once per chunk (1 GB
# per chunk at LLaMA-7B widths), so much smaller chunks trade time for little memory
# (a design estimate; not measured on a GPU).
DEFAULT_CHUNK = 1024


def logits_cross_entropy(logits, targets):
  """``(losses, correct)``: per-token ``logsumexp(logits) - logits[target]`` in fp32 (as
  optax's ``softmax_cross_entropy_with_integer_labels``) and ``argmax(logits) == target``.
  A target outside ``[0, V)`` selects no logit (its loss is the log-sum-exp, finite)."""
  logits = logits.astype(jnp.float32)
  losses = jax.nn.logsumexp(logits, axis=-1) - _target_logit(logits, targets)
  return losses, jnp.argmax(logits, axis=-1) == targets


def _hits(logits, targets):
  """``[..., V]`` bool: the one-hot of ``targets`` (all False for one outside [0, V))."""
  return jnp.arange(logits.shape[-1]) == targets[..., None]


def _target_logit(logits, targets):
  return jnp.sum(jnp.where(_hits(logits, targets), logits, 0.0), axis=-1)


def _logits(h, w, transposed: bool):
  """``h [N, D] @ w`` with fp32 accumulation; ``w`` is ``[D, V]``, or ``[V, D]`` when
  ``transposed`` (a tied embedding), in ``h``'s dtype."""
  contract = ((h.ndim - 1,), (1,) if transposed else (0,))
  return jax.lax.dot_general(h, w, (contract, ((), ())), preferred_element_type=jnp.float32)


def cross_entropy_reference(h, w, targets, *, transposed: bool = False, scale=None):
  """:func:`chunked_cross_entropy` in plain jnp: the full fp32 logits, then
  :func:`logits_cross_entropy`; autodiff keeps the logits' size (and the scaled weight)."""
  return logits_cross_entropy(_logits(h, _weight(w, h.dtype, scale, transposed), transposed),
                              targets)


def _weight(w, dtype, scale=None, transposed: bool = False):
  """``w`` in ``dtype`` for the matmuls: a frozen
  :class:`~lowmem_jax.quantized_weight.QuantizedKernel` dequantized (inside each pass,
  so only its stored form is saved), an array cast; with ``scale [D]``, multiplied by it
  along its ``D`` axis in fp32 first."""
  if scale is None:
    return dequantize(w, dtype) if isinstance(w, QuantizedKernel) else w.astype(dtype)
  return (_weight(w, jnp.float32) * _along_d(scale, transposed)).astype(dtype)


def _along_d(scale, transposed: bool):
  """``scale [D]`` in fp32, shaped to broadcast along a weight's ``D`` axis (``[V, D]``
  when ``transposed``, else ``[D, V]``)."""
  scale = scale.astype(jnp.float32)
  return scale[None, :] if transposed else scale[:, None]


def _padded(x, length: int):
  """``x [R, T, ...]`` with zero positions appended along T up to ``length``."""
  pad = length - x.shape[1]
  return x if not pad else jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))


def _steps(h, targets, step: int):
  """``(h, targets)`` padded along T to a multiple of ``step``, and the number of steps."""
  length = -(-h.shape[1] // step) * step
  return _padded(h, length), _padded(targets, length), length // step


def _slice(x, i, step: int):
  return jax.lax.dynamic_slice_in_dim(x, i * step, step, axis=1)


def _put(buffer, x, i, step: int):
  return jax.lax.dynamic_update_slice_in_dim(buffer, x.astype(buffer.dtype), i * step, axis=1)


def _forward(h, w, scale, targets, step, transposed):
  """Per-token ``(losses, correct, lse)`` of ``h [R, T, D]``, ``step`` positions of every
  row at a time (a ragged last step is padded)."""
  r, t = targets.shape
  w = _weight(w, h.dtype, scale, transposed)
  h, targets, num_steps = _steps(h, targets, step)

  def body(i, out):
    losses, correct, lse = out
    t_i = _slice(targets, i, step)
    logits = _logits(_slice(h, i, step), w, transposed)  # [R, step, V] fp32
    lse_i = jax.nn.logsumexp(logits, axis=-1)
    return (_put(losses, lse_i - _target_logit(logits, t_i), i, step),
            _put(correct, jnp.argmax(logits, axis=-1) == t_i, i, step),
            _put(lse, lse_i, i, step))

  shape = targets.shape
  out = (jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.bool_),
         jnp.zeros(shape, jnp.float32))
  out = jax.lax.fori_loop(0, num_steps, body, out)
  return tuple(x[:, :t] for x in out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _fused(h, w, scale, targets, step, transposed):
  losses, correct, _ = _forward(h, w, scale, targets, step, transposed)
  return losses, correct


def _fused_fwd(h, w, scale, targets, step, transposed):
  # symbolic_zeros: each argument comes with whether it is differentiated (perturbed)
  # (a stored QuantizedKernel comes as a pytree of them, and is frozen: no dw)
  stored = isinstance(w, QuantizedKernel)
  need = (h.perturbed, False if stored else w.perturbed,
          scale is not None and scale.perturbed)
  if stored:
    w = jax.tree.map(lambda p: p.value, w, is_leaf=lambda p: isinstance(p, CustomVJPPrimal))
  else:
    w = w.value
  h, targets = h.value, targets.value
  scale = None if scale is None else scale.value
  losses, correct, lse = _forward(h, w, scale, targets, step, transposed)
  # Residuals: h, w and scale as given (arguments: no copies; w's cast and scaling are
  # redone in backward), the targets and an fp32 log-sum-exp per token; never a
  # [tokens, V] array.
  return (losses, correct), (h, w, scale, targets, lse, need)


def _fused_bwd(step, transposed, res, cts):
  h, w, scale, targets, lse, (need_dh, need_dw, need_ds) = res
  g = cts[0]
  if isinstance(g, SymbolicZero) or not (need_dh or need_dw or need_ds):
    return None, None, None, None
  t, w_dtype, stored = h.shape[1], w.dtype, w
  # the gradient of the scaled weight, accumulated once: dw and dscale both come from it
  need_dws = need_dw or need_ds
  w = _weight(w, h.dtype, scale, transposed)
  h, targets, num_steps = _steps(h, targets, step)
  lse = _padded(lse, h.shape[1])
  g = _padded(g.astype(jnp.float32), h.shape[1])  # padded positions: g = 0, no contribution
  # fp16 (5 exponent bits): the cotangent goes into the compute dtype over its largest,
  # which comes back after the matmuls; a mean's 1/tokens times p ~ 1/V fell below fp16's
  # smallest number, and the gradient kept only -onehot. bf16 and fp32 have fp32's range.
  g_max = 1.0  # a constant 1 the compiler drops
  if w.dtype == jnp.float16:
    g_max = jnp.maximum(jnp.max(jnp.abs(g)), jnp.finfo(jnp.float32).tiny)
    g = g / g_max
  # dlogits @ w.T (contract V) and the chunk's tokens (rows and positions) for dw
  back = (((2,), (0,)) if transposed else ((2,), (1,)), ((), ()))
  tokens = (((0, 1), (0, 1)), ((), ()))

  def body(i, grads):
    dh, dw = grads
    h_i, t_i = _slice(h, i, step), _slice(targets, i, step)
    logits = _logits(h_i, w, transposed)
    # softmax - onehot, scaled by the token's cotangent (over g_max); matmuls in the
    # compute dtype with fp32 accumulation, as the attention backward does
    p = jnp.exp(logits - _slice(lse, i, step)[..., None])
    dlogits = ((p - _hits(logits, t_i)) * _slice(g, i, step)[..., None]).astype(w.dtype)
    if need_dh:
      dh = _put(dh, g_max * jax.lax.dot_general(dlogits, w, back,
                                                preferred_element_type=jnp.float32), i, step)
    if need_dws:  # [V, D] (tied) or [D, V]
      pair = (dlogits, h_i) if transposed else (h_i, dlogits)
      dw = dw + jax.lax.dot_general(*pair, tokens, preferred_element_type=jnp.float32)
    return dh, dw

  grads = (jnp.zeros(h.shape, h.dtype) if need_dh else None,
           jnp.zeros(w.shape, jnp.float32) if need_dws else None)
  dh, dws = jax.lax.fori_loop(0, num_steps, body, grads)
  dws = g_max * dws if need_dws else None  # once, after the chunks
  dw = ds = None
  if need_dw:
    dw = (dws if scale is None else dws * _along_d(scale, transposed)).astype(w_dtype)
  if need_ds:  # d scale_d = sum over V of dws * w (the weight before its scale)
    ds = jnp.sum(dws * _weight(stored, jnp.float32), axis=0 if transposed else 1)
    ds = ds.astype(scale.dtype)
  return dh[:, :t] if need_dh else None, dw, ds, None


_fused.defvjp(_fused_fwd, _fused_bwd, symbolic_zeros=True)


def chunked_cross_entropy(h, w, targets, *, chunk: int = DEFAULT_CHUNK,
                          transposed: bool = False, scale=None):
  """``(losses, correct)`` of ``logits = h @ (w * scale)`` (``scale [D]`` along ``w``'s
  ``D`` axis; None: 1): per-token fp32 cross-entropy
  ``logsumexp(logits) - logits[target]`` and ``argmax(logits) == target``, shaped like
  ``targets``, computed ``chunk`` tokens at a time: ``chunk // rows`` positions (at least
  one) of the last axis of every row of the leading axes per step, a ragged last step
  padded inside.

  ``h [..., D]`` in the compute dtype, ``w [D, V]`` (``[V, D]`` when ``transposed``) as
  stored (any float dtype, or a frozen ``QuantizedKernel``; cast or dequantized to ``h``'s
  dtype inside each pass), ``targets`` integer ``[...]``.
  Backward (a custom VJP) saves ``h``, ``w``, ``scale`` (no copies; the scaled weight is
  remade inside each pass) and an fp32 log-sum-exp per token, recomputes each chunk's
  softmax and accumulates ``dw`` over chunks in fp32 (cast to ``w``'s dtype at the end);
  gradients of ``h``, ``w`` or ``scale`` not asked for are not computed (a frozen head:
  no ``dw`` pass). Weight or mask tokens by multiplying ``losses``: a zero cotangent
  contributes nothing."""
  h, targets = jnp.asarray(h), jnp.asarray(targets)
  w = w if isinstance(w, QuantizedKernel) else jnp.asarray(w)
  if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
    raise ValueError(f"chunked_cross_entropy: chunk must be a positive int, got {chunk!r}")
  if h.ndim < 1 or len(w.shape) != 2 or h.shape[-1] != w.shape[1 if transposed else 0]:
    raise ValueError(f"chunked_cross_entropy: w must be [D, V] ([V, D] when transposed) "
                     f"with D = h's last axis, got h {list(h.shape)}, w {list(w.shape)}")
  if not (jnp.issubdtype(h.dtype, jnp.floating) and jnp.issubdtype(w.dtype, jnp.floating)):
    raise ValueError(f"chunked_cross_entropy: h and w must be floating, got {h.dtype} and "
                     f"{w.dtype}")
  if scale is not None:
    scale = jnp.asarray(scale)
    if scale.shape != h.shape[-1:] or not jnp.issubdtype(scale.dtype, jnp.floating):
      raise ValueError(f"chunked_cross_entropy: scale must be floating [D] = "
                       f"{list(h.shape[-1:])}, got {scale.dtype}{list(scale.shape)}")
  if targets.shape != h.shape[:-1] or not jnp.issubdtype(targets.dtype, jnp.integer):
    raise ValueError(f"chunked_cross_entropy: targets must be integers of shape "
                     f"{list(h.shape[:-1])}, got {targets.dtype}{list(targets.shape)}")
  lead = targets.shape
  if targets.size == 0:  # no token: nothing to chunk (a loop over an empty axis cannot slice)
    return jnp.zeros(lead, jnp.float32), jnp.zeros(lead, bool)
  t = lead[-1] if lead else 1
  rows = targets.size // t if t else 0
  # Steps slice the last (sequence) axis, every row at once: leading (batch) axes stay
  # whole in each step, so a batch-sharded h is computed where it lives.
  step = max(1, min(t, chunk // max(rows, 1)))
  losses, correct = _fused(h.reshape(rows, t, h.shape[-1]), w, scale,
                           targets.reshape(rows, t), step, bool(transposed))
  return losses.reshape(lead), correct.reshape(lead)
