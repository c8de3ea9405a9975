"""The blocks' linear layers: ``nnx.Linear`` / ``nnx.LinearGeneral`` plus the policy's
say in what their backward keeps.

Same parameters (``kernel``, ``bias``) and function as the Flax layers, so checkpoints,
LoRA and sharding see no difference. Two policy methods act here:

* Mesa (``policy.quantizes``): an input given as a :class:`lowmem_jax.quant.QTensor` is
  saved as its uint8 code (``quant.int8_vjp``), the code its producer made once for all
  of its readers.
* WTA-CRS (``policy.samples(name)``): the weight gradient comes from a sample of the
  token rows and only those rows are saved (``lowmem_jax.sampling``); a
  :class:`models.sites.KeySite` gives each call its key.

Anything else runs the Flax layer unchanged (plain autodiff saves the input).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from lowmem_jax import quant, sampling
from lowmem_jax.policy import MemoryPolicy
from models.sites import KeySite, cached_weights


def _dense(contract: int, preferred, x, kernel, bias=None):
  """``x`` contracted with ``kernel`` over ``contract`` trailing axes, plus bias."""
  axes = (tuple(range(x.ndim - contract, x.ndim)), tuple(range(contract)))
  y = jax.lax.dot_general(x, kernel, (axes, ((), ())), preferred_element_type=preferred)
  return y if bias is None else y + bias.astype(y.dtype)


class _PolicyDense:
  """What our Linear and LinearGeneral add to Flax's: the policy's residual choice."""

  def _setup_policy(self, policy, name):
    self.policy = MemoryPolicy.parse(policy)
    self.role = name
    self.sampler = KeySite() if name is not None and self.policy.samples(name) else None

  def _policy_call(self, x, contract: int, flax_call):
    if self.sampler is None and not isinstance(x, quant.QTensor):
      return flax_call(x)
    value = x.value if isinstance(x, quant.QTensor) else x
    dtype = self.dtype or jnp.result_type(value, self.kernel[...])
    kernel = self.kernel[...].astype(dtype)
    bias = None if self.bias is None else self.bias[...].astype(dtype)
    if self.sampler is not None:
      y = sampling.wta_crs_linear(value.astype(dtype), kernel, bias, self.sampler.next_key(),
                                  ratio=self.policy.sample_ratio, contract_ndim=contract,
                                  row_weights=self._row_weights(value, contract))
      pref = self.preferred_element_type
      return y if pref is None else y.astype(pref)
    fn = functools.partial(_dense, contract, self.preferred_element_type)
    return quant.int8_vjp(fn, [x], (kernel,) if bias is None else (kernel, bias))


  def _row_weights(self, x, contract: int):
    """Cached per-example output-gradient norms broadcast to x's rows (None without a
    cache, or for a batch that is not the one the ids were set for)."""
    cache = getattr(self.sampler, "grad_norms", None)
    if cache is None:
      return None
    ids = self.sampler.example_ids[...]
    lead = x.shape[:x.ndim - contract]
    if not lead or lead[0] != ids.shape[0]:
      return None
    w = cached_weights(cache[...], ids).reshape((ids.shape[0],) + (1,) * (len(lead) - 1))
    return jnp.broadcast_to(w, lead)


class Linear(nnx.Linear, _PolicyDense):
  """``nnx.Linear`` that follows the memory policy; ``name`` is its role ("fc1", ...)."""

  def __init__(self, in_features: int, out_features: int, *,
               policy: MemoryPolicy | str = "baseline", name: str | None = None, **kwargs):
    super().__init__(in_features, out_features, **kwargs)
    self._setup_policy(policy, name)

  def __call__(self, x):
    return self._policy_call(x, 1, super().__call__)


class LinearGeneral(nnx.LinearGeneral, _PolicyDense):
  """``nnx.LinearGeneral`` (contracting the trailing ``len(axis)`` axes) that follows
  the memory policy."""

  def __init__(self, in_features, out_features, *, policy: MemoryPolicy | str = "baseline",
               name: str | None = None, **kwargs):
    super().__init__(in_features, out_features, **kwargs)
    self._setup_policy(policy, name)

  def __call__(self, x):
    axis = self.axis if isinstance(self.axis, tuple) else (self.axis,)
    return self._policy_call(x, len(axis), super().__call__)
