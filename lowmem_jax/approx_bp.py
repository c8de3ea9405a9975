"""Approx-BP (LowMemoryBP, ICML 2024) as a policy method: ``activation="approx2"``.

GELU and SiLU become ReGELU2 and ReSiLU2 (:mod:`lowmem_jax.activations`): the exact
forward, a backward that keeps 2 bits per element of the input (the code of a 4-level
step derivative) instead of the input itself. Preset ``approx-bp``.

A gated activation (SwiGLU's ``silu(g) * u``) stays exact: the product's backward needs
``silu(g)`` for ``du`` whatever ``dg`` uses, and the lean baseline's exact rule keeping
``g`` and ``u`` (2 arrays) keeps less than ReSiLU2's code beside ``silu(g)`` and ``u``.
On LLaMA, Approx-BP therefore saves nothing over the lean baseline.
"""

from __future__ import annotations

import dataclasses

from lowmem_jax import activations
from lowmem_jax.methods import Field, Method

ACTIVATIONS = ("exact", "approx2")


def _activation(policy, inner, *, kind: str, gated: bool = False):
  if policy.activation != "approx2":
    return inner
  # A gated product's backward needs act(g) for du whatever dg uses: the exact rule
  # keeping g and u is less than a code of g beside act(g) and u, so it stays.
  if gated:
    return inner
  fn = activations.approx2_fn(kind, policy.kernel_implementation())
  return dataclasses.replace(inner, fn=fn, saved_bits=2)


METHOD = Method(
    name="approx-bp",
    fields=(Field("activation", "exact", "exact (the baseline's exact rule) | approx2 (ReGELU2/"
                  "ReSiLU2: the backward keeps a 2-bit code per element)",
                  choices=ACTIVATIONS),),
    presets={"approx-bp": {"activation": "approx2"}},
    strategies={"activation": _activation},
)
