"""The dense function every linear layer computes, casting to the compute dtype itself."""

from __future__ import annotations

import dataclasses

import jax

from lowmem_jax.quantized_weight import QuantizedKernel, frozen_dense


@dataclasses.dataclass(frozen=True)
class Dense:
  """``x`` contracted with ``kernel`` over ``contract`` trailing axes, plus bias, all cast
  to ``dtype`` here. The weights come as stored (fp32), so a strategy that keeps its
  inputs keeps them, not a per-step cast (:class:`lowmem_jax.baseline.Linear`).
  ``preferred``: the dot's ``preferred_element_type`` (None: the compute dtype). A frozen
  :class:`~lowmem_jax.quantized_weight.QuantizedKernel` is dequantized inside the op
  (:func:`~lowmem_jax.quantized_weight.frozen_dense`: keeps the stored form only)."""
  contract: int
  dtype: object
  preferred: object = None

  def __call__(self, x, kernel, bias=None):
    if isinstance(kernel, QuantizedKernel):
      y = frozen_dense(x, kernel, contract=self.contract, dtype=self.dtype,
                       preferred=self.preferred)
      return y if bias is None else y + bias.astype(y.dtype)
    x, kernel = x.astype(self.dtype), kernel.astype(self.dtype)
    axes = (tuple(range(x.ndim - self.contract, x.ndim)), tuple(range(self.contract)))
    y = jax.lax.dot_general(x, kernel, (axes, ((), ())), preferred_element_type=self.preferred)
    return y if bias is None else y + bias.astype(y.dtype)
