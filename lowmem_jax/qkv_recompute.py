"""q, k and v recomputed in backward from what their input keeps: the ``qkv`` field.

The attention's backward needs q, k and v. By default (``qkv="keep"``) it keeps them, or
what a method keeps of them: Mesa 8-bit codes (three per layer, each the size of the
block input's code), the baseline the bf16 projections themselves. With
``qkv="recompute"`` the projections and the attention run as one function whose
backward keeps only what the projections' input keeps anyway (the shared code of the
norm output under Mesa, the norm output itself otherwise; it is read by LoRA's ``A`` or
the projections' weight gradients in any case) and the weights, and recomputes q, k and
v (3 D x D per token of the 12 D x D a transformer block's forward multiplies: q, k, v,
out and the MLP's pair of 4D-wide ones) before the attention's backward.
Nothing of q, k, v is kept between forward and backward: under ``lowmem`` on ViT-B/16
LoRA batch 64, 370 MiB less in all, of which the codes are 333 (H100 compile,
``docs/h100_compiled.md``).

The strategy (:class:`RecomputeQKV`) is asked for at the ``qkv`` site of
:class:`models.attention.SelfAttention` and of :func:`lowmem_jax.block_stack.block`,
which then hand it the projections and the attention as a pure function of
``(x, params, consts)``. The attention inside runs
exact and stateless (Mesa's codes of q, k and v would have no reader). Under a block
checkpoint policy (remat, offload) the policy decides what a block keeps: ``recompute``
does nothing there. WTA-CRS sampling of query, key or value (state that a forward
updates) cannot run inside the recomputed function: that combination is an error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from lowmem_jax import layers, quant, wta_crs
from lowmem_jax.baseline import Attention
from lowmem_jax.methods import Field, Method, Strategy

QKV = ("keep", "recompute")
PROJECTIONS = ("query", "key", "value")


@dataclasses.dataclass(frozen=True)
class RecomputeQKV(Strategy):
  """``run(x, params, consts)`` (projections, then attention) whose backward keeps what
  ``x`` carries (its code: :func:`lowmem_jax.quant.coded_vjp`) or ``x`` itself
  (``jax.checkpoint``), with ``params`` and ``consts``, and recomputes the rest."""
  recomputes = True

  def __call__(self, run: Callable, x, params, consts):
    if isinstance(x, quant.QTensor):
      return quant.coded_vjp(run, [x], (params,), (consts,))
    return layers.checkpoint(run)(x, params, consts)


def _active(policy) -> bool:
  return policy.qkv == "recompute" and policy.checkpoint_policy() is None


def _qkv(policy, inner, *, num_heads=None, num_kv_heads=None, causal=False):
  return RecomputeQKV() if _active(policy) else inner


def _attention(policy, inner, *, num_heads=None, num_kv_heads=None, causal=False):
  # inside the recomputed function: exact, keeping nothing beyond its backward's own run
  return Attention(policy.attention, causal, policy.attention_block) if _active(policy) \
      else inner


def _check(policy):
  wta_crs.check_not_recomputed(policy, "qkv", PROJECTIONS)


METHOD = Method(
    name="qkv-recompute",
    fields=(Field("qkv", "keep", "keep (the attention keeps q, k, v or their codes) | "
                  "recompute (backward recomputes them from what their input keeps)",
                  choices=QKV),),
    strategies={"qkv": _qkv, "attention": _attention},
    check=_check,
)
