"""Sites: where the memory policy's strategies act in a model, with their state.

A component (a linear, a norm, an MLP, the attention) asks the policy for the strategy of
each of its sites and holds it in a :class:`Site`, which it calls. A stateless strategy
is just called. A stateful one (Mesa's code ranges, WTA-CRS's keys) declares its state
as pure pytrees (:mod:`lowmem_jax.methods`); the site holds each in a :class:`StateSite`
of :class:`SiteState` variables: not trained, updated by each training forward and
carried in the train state (checkpointed, resumed exactly). :class:`CodeSite` holds a
Mesa code's :class:`~lowmem_jax.quant.QuantState`, :class:`KeySite` a sampled linear's
:class:`~lowmem_jax.sampling.KeyState`. :func:`seed_sites` gives every state its own key.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import jax
import jax.numpy as jnp
from flax import nnx

from lowmem_jax import methods, quant, sampling
# Re-exported for the trainer (train/): the WTA-CRS gradient-norm cache arithmetic.
from lowmem_jax.sampling import cached_weights, update_grad_norms  # noqa: F401


class SiteState(nnx.Variable):
  """State a forward pass updates (EMA ranges, call counts, site keys); not trained."""


class GradNormCache(nnx.Variable):
  """WTA-CRS: per-example output-gradient norm of one sampled linear, from the last time
  each example was seen (0 before that: such examples weigh the mean of the seen ones).
  Not trained: the train step differentiates w.r.t. it only to read the squared norms
  back (``lowmem_jax.sampling``)."""


class StateSite(nnx.Module):
  """One pure state (a registered dataclass pytree) held as variables, field by field;
  fields that are None are absent (and read back as None). ``seeded``: its key (if it
  has one) was set by :func:`seed_sites`."""

  def __init__(self, state):
    self.state_type = type(state)
    self.seeded = False
    for field in dataclasses.fields(state):
      value = getattr(state, field.name)
      if value is not None:
        setattr(self, field.name, SiteState(value))

  def read(self):
    """The state as its dataclass."""
    values = {}
    for field in dataclasses.fields(self.state_type):
      var = getattr(self, field.name, None)
      values[field.name] = None if var is None else var[...]
    return self.state_type(**values)

  def write(self, state, old) -> None:
    """Stores the fields of ``state`` that differ from ``old`` (the state read)."""
    for field in dataclasses.fields(self.state_type):
      value = getattr(state, field.name)
      if value is not getattr(old, field.name):
        getattr(self, field.name)[...] = value


class CodeSite(StateSite):
  """A Mesa code's state: per-group EMA range, update count, PRNG key."""


class KeySite(StateSite):
  """A sampled linear's state: PRNG key and call count (and, once the trainer attaches
  them, its gradient-norm cache and the current batch's example ids)."""


_HOLDERS = {quant.QuantState: CodeSite, sampling.KeyState: KeySite}


class Site(nnx.Module):
  """A place in a model where a strategy of the policy acts: ``site(*args)`` runs it.

  ``deterministic`` (False; ``model.eval()`` sets it, ``model.train()`` clears it, as for
  ``nnx.Dropout``): the forward leaves the site's state as it was. A forward's value never
  depends on that state (Mesa's ranges and WTA-CRS's keys shape only what is saved for
  backward), so an evaluation outside the train step changes nothing."""

  def __init__(self, strategy: methods.Strategy):
    self.strategy = strategy
    self.deterministic = False
    states = strategy.init_state()
    self.state_names = tuple(states)
    for name, state in states.items():
      setattr(self, name, _HOLDERS.get(type(state), StateSite)(state))

  @property
  def updates_state(self) -> bool:
    """Whether a forward writes state here (stateful and not deterministic)."""
    return bool(self.state_names) and not self.deterministic

  def __call__(self, *args, **kwargs):
    if not self.state_names:
      return self.strategy(*args, **kwargs)
    holders = [getattr(self, name) for name in self.state_names]
    if any(getattr(h, "key", None) is not None and not h.seeded for h in holders):
      warnings.warn("a policy site's state has the default PRNG key: every unseeded site "
                    "draws the same noise/sample; call models.sites.seed_sites(model, rngs) "
                    "once the model is built", stacklevel=2)
    states = {name: h.read() for name, h in zip(self.state_names, holders)}
    out, updated = self.strategy.apply(states, *args, **kwargs)
    if self.deterministic:
      return out
    for name, state in updated.items():
      getattr(self, name).write(state, states[name])
    return out


def as_array(x):
  """The activation itself, whether given plain or carried with its kept form."""
  return methods.value_of(x)


def attach_grad_norm_caches(model: nnx.Module, num_examples: int, batch_size: int) -> int:
  """Gives every sampled linear of ``model`` a :class:`GradNormCache` over
  ``num_examples`` examples and an ``example_ids`` slot for ``batch_size`` ids (one each
  per layer where states are stacked over layers); returns how many states got one."""
  samplers = [state for _, state in nnx.iter_graph(model) if isinstance(state, KeySite)]
  for state in samplers:
    layers = state.count[...].shape  # () or the stacked layers
    state.grad_norms = GradNormCache(jnp.zeros(layers + (num_examples,), jnp.float32))
    state.example_ids = SiteState(jnp.zeros(layers + (batch_size,), jnp.int32))
  return len(samplers)


def set_example_ids(model: nnx.Module, ids) -> None:
  """Tells the sampled linears which examples the next forward's batch rows are."""
  for _, state in nnx.iter_graph(model):
    if isinstance(state, KeySite) and getattr(state, "grad_norms", None) is not None:
      shape = state.example_ids[...].shape
      state.example_ids[...] = jnp.broadcast_to(jnp.asarray(ids, jnp.int32), shape)


def seed_sites(model: nnx.Module, rngs: nnx.Rngs) -> int:
  """Gives each site state of ``model`` its own key (``fold_in(key, i)``, ``i`` counting
  in graph order, one per layer where states are stacked over layers); one key is drawn
  from ``rngs.params`` only when there are states, so models without any draw nothing.
  Returns the number of keys set."""
  states = [s for _, s in nnx.iter_graph(model)
            if isinstance(s, StateSite) and getattr(s, "key", None) is not None]
  key = rngs.params() if states else None
  count = 0
  for state in states:
    shape = state.key[...].shape  # [..., 2]: stacked layers lead
    n = math.prod(shape[:-1])
    keys = [jax.random.key_data(jax.random.fold_in(key, count + i)) for i in range(n)]
    state.key[...] = jnp.stack(keys).reshape(shape)
    state.seeded = True
    count += n
  return count
