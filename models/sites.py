"""Per-call state that a forward pass updates: Mesa's EMA ranges and step PRNG keys.

A *site* is one place in a model where a stateful method acts: an :class:`Int8Site`
codes one activation for backward (Mesa, :mod:`lowmem_jax.quant`), a :class:`KeySite`
hands a fresh PRNG key to one sampled linear (WTA-CRS). Their state is
:class:`SiteState`: not trained, updated by each training forward and carried in the
train state (so it is checkpointed and resumes exactly). A key comes from the site's key
folded with its call count; :func:`seed_sites` gives every site of a model its own key.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lowmem_jax import quant


class SiteState(nnx.Variable):
  """State a forward pass updates (EMA ranges, call counts, site keys); not trained."""


class KeySite(nnx.Module):
  """A fresh PRNG key per call: the site key folded with the number of calls so far."""

  def __init__(self):
    self.key = SiteState(jax.random.key_data(jax.random.key(0)))
    self.count = SiteState(jnp.zeros((), jnp.int32))

  def next_key(self):
    key = jax.random.fold_in(jax.random.wrap_key_data(self.key[...]), self.count[...])
    self.count[...] = self.count[...] + 1
    return key


class Int8Site(nnx.Module):
  """Codes one activation as uint8 for backward, with ``groups`` contiguous groups along
  ``axis`` (head-wise: ``axis=2, groups=heads`` for ``[B, N, H, D]``)."""

  def __init__(self, groups: int = 1, axis: int = -1, implementation: str = "xla"):
    state = quant.QuantState.create(groups)
    self.lo, self.hi = SiteState(state.lo), SiteState(state.hi)
    self.count, self.key = SiteState(state.count), SiteState(state.key)
    self.groups, self.axis, self.implementation = groups, axis, implementation

  def _state(self) -> quant.QuantState:
    return quant.QuantState(self.lo[...], self.hi[...], self.count[...], self.key[...])

  def _store(self, state: quant.QuantState) -> None:
    self.lo[...], self.hi[...], self.count[...] = state.lo, state.hi, state.count

  def __call__(self, x) -> quant.QTensor:
    """``x`` with its code (a QTensor made upstream is passed through)."""
    if isinstance(x, quant.QTensor):
      return x
    qt, state = quant.quantize_tensor(x, self._state(), axis=self.axis, groups=self.groups,
                                      implementation=self.implementation)
    self._store(state)
    return qt

  def ms_norm(self, kind: str, x, eps: float) -> quant.QTensor:
    """MS norm of ``x`` whose only saved activation is this site's code of the output."""
    qt, state = quant.ms_norm_int8(kind, x, eps, self._state(), groups=self.groups,
                                   implementation=self.implementation)
    self._store(state)
    return qt


class GradNormCache(nnx.Variable):
  """WTA-CRS: per-example output-gradient norm of one sampled linear, from the last time
  each example was seen (0 before that: such examples weigh the mean of the seen ones).
  Not trained: the train step differentiates w.r.t. it only to read the squared norms
  back (``lowmem_jax.sampling``)."""


def attach_grad_norm_caches(model: nnx.Module, num_examples: int, batch_size: int) -> int:
  """Gives every sampled linear of ``model`` a :class:`GradNormCache` over
  ``num_examples`` examples and an ``example_ids`` slot for ``batch_size`` ids; returns
  how many linears got one."""
  samplers = [m for _, m in nnx.iter_graph(model) if isinstance(m, KeySite)]
  for site in samplers:
    site.grad_norms = GradNormCache(jnp.zeros((num_examples,), jnp.float32))
    site.example_ids = SiteState(jnp.zeros((batch_size,), jnp.int32))
  return len(samplers)


def set_example_ids(model: nnx.Module, ids) -> None:
  """Tells the sampled linears which examples the next forward's batch rows are."""
  for _, site in nnx.iter_graph(model):
    if isinstance(site, KeySite) and getattr(site, "grad_norms", None) is not None:
      site.example_ids[...] = jnp.asarray(ids, jnp.int32)


def cached_weights(cache, ids):
  """Row weights of examples ``ids``: their cached norm, or the mean of the cached norms
  for examples not seen yet (1 while none is), so both are on one scale. The cotangent
  goes to ``cache[ids]`` unchanged (straight through), seen or not: that is how the
  train step reads each example's squared gradient norm back."""
  seen = cache > 0
  count = jnp.sum(seen)
  fill = jnp.where(count > 0, jnp.sum(cache) / jnp.maximum(count, 1), 1.0)
  w = cache[ids]
  return w + jax.lax.stop_gradient(jnp.where(w > 0, w, fill) - w)


def update_grad_norms(cache, squared_norm_sums):
  """The new cache: ``sqrt`` of the squared output-gradient norms summed over each
  example's rows, for the examples of this batch (nonzero), the old value elsewhere."""
  return jnp.where(squared_norm_sums > 0, jnp.sqrt(squared_norm_sums), cache)


def int8_site(policy, groups: int = 1, axis: int = -1) -> Int8Site | None:
  """An Int8Site when the policy quantizes, else None."""
  if not policy.quantizes:
    return None
  return Int8Site(groups, axis, policy.kernel_implementation())


def as_array(x):
  """The activation itself, whether given plain or as a QTensor."""
  return x.value if isinstance(x, quant.QTensor) else x


def seed_sites(model: nnx.Module, rngs: nnx.Rngs) -> int:
  """Gives each site of ``model`` its own key (``fold_in(key, i)`` in graph order, one
  key drawn from ``rngs.params`` only when there are sites, so models without any draw
  nothing); returns the number of sites."""
  sites = [m for _, m in nnx.iter_graph(model) if isinstance(m, (KeySite, Int8Site))]
  key = rngs.params() if sites else None
  for i, site in enumerate(sites):
    site.key[...] = jax.random.key_data(jax.random.fold_in(key, i))
  return len(sites)
