"""The MLP's last linear reads its input recomputed in backward: the ``hidden`` field.

An MLP's last linear (``fc2``, LLaMA's ``down``) reads the activation's output ``a``
(``act(h)``, or ``act(g) * u``). By default (``hidden="keep"``) that linear keeps ``a``
for its weight gradient (or, under LoRA, for its adapter ``A``'s), beside what the
activation keeps of its own input (``h``, or ``g`` and ``u``; a 2-bit code under
Approx-BP). With ``hidden="recompute"`` the activation and the last linear run as one
function whose backward keeps only the activation's input(s) and the weights
(``jax.checkpoint``), and recomputes ``a`` (one elementwise pass) before the linear's
backward. The arithmetic is the policy's own, approximations included: only what is kept
between forward and backward changes.

What it saves, per token and layer (bf16): the exact baseline keeps ``h`` and ``a``
(2 x 2F bytes) or ``g``, ``u`` and ``a`` (3 x 2F), and now ``h`` (or ``g``, ``u``): 2F
bytes less. Under Approx-BP (``lowmembp``) GELU kept a 2-bit code of ``h`` and the linear
``a``: now ``h``, F / 4 bytes less; the gated product kept a code and three ``[tokens,
F]`` arrays: now ``g`` and ``u``. Compiled for an H100 (LLaMA-7B widths,
4 layers, 4 x 1024 tokens, LoRA on all 7 linears), the baseline's temp is 344 MiB
(4 x 86 MiB, one ``a`` a layer) less, ``docs/h100_compiled.md``.

Only where the last linear keeps its input (it trains, or has a LoRA adapter): a frozen
one keeps nothing of it, so the MLP runs as modules there (recomputing would keep ``h``
whole in place of the activation's code: ViT-B/16 with LoRA on query and value, lowmembp,
2 layers, batch 16: 347 -> 435 MiB compiled on the CPU before that rule).

Under Mesa (``quant``) the site keeps the 8-bit codes of the activation's input(s)
(:class:`lowmem_jax.mesa.CodedHidden`: forward exact, backward the vjp at the dequantized
inputs), and the output's own code, which the last linear kept, is gone: per token and
layer F bytes less where the activation keeps codes of its input(s) (``mesa8``; the gated
product under ``lowmem``). ``lowmem``'s GELU keeps a 2-bit code of its input, not a
code of 8 bits, and stays as it is (an 8-bit code of ``h`` in place of the 2-bit one and
the output's would save F / 4 bytes, and the 2-bit rule read at a dequantized input
flips near its thresholds: :func:`lowmem_jax.mesa._hidden`). Not with WTA-CRS
sampling the last linear (``fc2`` or ``down`` in ``sample_targets``): a sampler updates
its key in forward, which a recomputed function cannot (an error says so); sampling the
other linears is fine. Under a block checkpoint policy (remat, offload) the policy
decides what a block keeps: ``recompute`` does nothing there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from lowmem_jax import layers, wta_crs
from lowmem_jax.methods import Field, Method, Strategy

HIDDEN = ("keep", "recompute")


@dataclasses.dataclass(frozen=True)
class RecomputeHidden(Strategy):
  """``run(inputs, params, consts)`` (the activation, then the last linear) whose
  backward keeps ``inputs`` (``h``, or ``(g, u)``), ``params`` and ``consts``, and
  recomputes the activation's output."""
  recomputes = True

  def __call__(self, run: Callable, inputs, params, consts):
    return layers.checkpoint(run)(inputs, params, consts)


def _active(policy) -> bool:
  return policy.hidden == "recompute" and policy.checkpoint_policy() is None


def _hidden(policy, inner, *, kind, gated=False):
  return RecomputeHidden() if _active(policy) else inner  # baseline.KeepRun


# the last linears the site recomputes with the activation (GELU MLP, gated MLP)
LAST_LINEARS = ("fc2", "down")


def _check(policy):
  wta_crs.check_not_recomputed(policy, "hidden", LAST_LINEARS)


METHOD = Method(
    name="hidden-recompute",
    fields=(Field("hidden", "keep", "keep (the MLP's last linear keeps its input) | "
                  "recompute (backward recomputes it from the activation's input)",
                  choices=HIDDEN),),
    strategies={"hidden": _hidden},
    check=_check,
)
