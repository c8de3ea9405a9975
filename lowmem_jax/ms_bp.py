"""MS-BP (LowMemoryBP, ICML 2024) as a policy method: ``norm="ms"``.

LayerNorm and RMSNorm become MS-LayerNorm / MS-RMSNorm (:mod:`lowmem_jax.norms`): no
affine of their own (the model merges it into the linears that read the output), and a
backward written in terms of the output, which those linears save anyway: the norm
keeps only an fp32 ``rstd`` per row. Presets ``ms-bp`` and ``lowmembp`` (with Approx-BP).
"""

from __future__ import annotations

import dataclasses

from lowmem_jax import norms
from lowmem_jax.methods import Field, Method

NORMS = ("standard", "ms")


def _norm(policy, inner, *, kind: str):
  if policy.norm != "ms":
    return inner
  fn = norms.ms_norm_fn(kind, policy.kernel_implementation())
  return dataclasses.replace(inner, fn=fn, has_affine=False, keeps_output=True)


METHOD = Method(
    name="ms-bp",
    fields=(Field("norm", "standard", "standard (affine norms, the baseline's rule) | ms "
                  "(MS-LayerNorm/MS-RMSNorm, affine merged into the next linear)",
                  choices=NORMS),),
    presets={"ms-bp": {"norm": "ms"}, "lowmembp": {"activation": "approx2", "norm": "ms"}},
    strategies={"norm": _norm},
)
