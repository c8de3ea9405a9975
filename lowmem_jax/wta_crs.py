"""WTA-CRS (arXiv 2305.15265) as a policy method: ``sampled_linear="wta-crs"``.

The linears named in ``sample_targets`` (attribute names in our blocks, see
:data:`LINEAR_NAMES`) take their weight gradient from ``sample_ratio`` of the token rows
and save only those rows (:func:`lowmem_jax.sampling.wta_crs_linear`). Each such linear
has state, a :class:`~lowmem_jax.sampling.KeyState` (its key and call count: a fresh key
per call). A frozen kernel (LoRA's base) has no weight gradient to estimate, so it is
never sampled; under LoRA the trained linear reading the layer input is the adapter's
``A`` (:mod:`models.lora` gives it the base's site), so ``dA`` is the one sampled, with
``A``'s output cotangent ``scale * g B^T`` in place of ``g``. Heads and embeddings are
never sampled. Preset ``wta-crs``.
"""

from __future__ import annotations

import dataclasses

from lowmem_jax import sampling
from lowmem_jax.methods import Field, Method, Strategy, check_choice, value_of

SAMPLED_LINEARS = ("none", "wta-crs")
LINEAR_NAMES = ("query", "key", "value", "out", "fc1", "fc2", "gate", "up", "down")


@dataclasses.dataclass(frozen=True)
class SampledLinear(Strategy):
  """``dense``'s function with a WTA-CRS weight gradient: saves ``k`` rows of the input
  (a carried input: its value's rows), their indices and scales, and the kernel."""
  ratio: float

  def init_state(self):
    return {"sampler": sampling.KeyState.create()}

  def apply(self, states, dense, x, kernel, bias, *, contract: int):
    state = states["sampler"]
    # dense casts to its compute dtype; the sampled rule takes everything cast already
    kernel = kernel.astype(dense.dtype)
    bias = None if bias is None else bias.astype(dense.dtype)
    value = value_of(x).astype(dense.dtype)
    weights = sampling.row_weights(state, value.shape[:value.ndim - contract])
    y = sampling.wta_crs_linear(value, kernel, bias, state.step_key(), ratio=self.ratio,
                                contract_ndim=contract, row_weights=weights)
    return y, {"sampler": state.advanced()}


def _linear(policy, inner, *, name=None, frozen=False):
  if policy.sampled_linear == "none" or frozen or name not in policy.sample_targets:
    return inner
  return SampledLinear(policy.sample_ratio)


def _check_ratio(value, extra):
  try:
    ratio = float(value)
  except (TypeError, ValueError):
    raise ValueError(f"MemoryPolicy: sample_ratio must be a number, got {value!r}") from None
  if not 0.0 < ratio <= 1.0:
    raise ValueError(f"MemoryPolicy: sample_ratio must be in (0, 1], got {ratio}")
  return ratio


def _check_targets(value, extra):
  targets = value
  if isinstance(targets, str):
    targets = tuple(t.strip() for t in targets.split(",") if t.strip())
  targets = tuple(targets)
  if not targets:
    raise ValueError("MemoryPolicy: sample_targets is empty; name at least one of "
                     f"{', '.join(LINEAR_NAMES)}")
  for name in targets:
    check_choice("linear in sample_targets", name, LINEAR_NAMES)
  return targets


def _check(policy):
  if policy.sampled_linear == "none":
    for field in ("sample_ratio", "sample_targets"):
      if getattr(policy, field) != policy.default(field):
        raise ValueError(f"MemoryPolicy: {field} is set but sampled_linear is 'none'; "
                         "add 'wta-crs' to the spec")


METHOD = Method(
    name="wta-crs",
    fields=(
        Field("sampled_linear", "none", "none | wta-crs (weight gradients of the "
              "sample_targets linears from sample_ratio of the token rows)",
              choices=SAMPLED_LINEARS),
        Field("sample_ratio", sampling.DEFAULT_RATIO, "the fraction of rows WTA-CRS keeps",
              check=_check_ratio),
        Field("sample_targets", LINEAR_NAMES, "the linears WTA-CRS samples, by attribute "
              "name", check=_check_targets),
    ),
    presets={"wta-crs": {"sampled_linear": "wta-crs"}},
    strategies={"linear": _linear},
    check=_check,
)
