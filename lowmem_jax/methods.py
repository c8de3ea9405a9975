"""What a memory-saving method is, for the policy: its fields, presets and strategies.

A method is one module in ``lowmem_jax/`` that defines ``METHOD = Method(...)`` and is
named once in :data:`lowmem_jax.policy.METHOD_MODULES`. It declares

* ``fields``: the :class:`lowmem_jax.policy.MemoryPolicy` fields it adds (``quant``,
  ``quant_bits``), each with its default, its check and a one-line doc;
* ``values``: values it adds to another method's field (offload: ``remat="offload"``);
* ``presets``: named field settings (``mesa8``), combined with ``+`` in a spec;
* ``strategies``: for each kind of site in a model (:data:`SITES`), a hook
  ``hook(policy, inner, **site) -> strategy`` that returns the strategy for that site,
  given the one the methods before it chose (``inner``): the same ``inner`` where the
  method does not act, a replacement, or a wrapper of it.

A *strategy* decides what one site saves for backward; models call it and never test a
method's name. Stateless strategies are called as ``strategy(*args)``. Stateful ones
(Mesa's ranges, WTA-CRS's keys) declare their state, pure pytrees, in ``init_state()``
and run as ``apply(states, *args) -> (out, updated_states)``: the model holds that state
(:class:`models.sites.Site`), since this library has no Flax dependency.

A *carried* activation is one that travels with the form its readers keep (Mesa's
:class:`lowmem_jax.quant.QTensor`: the value with its uint8 code): :func:`read` runs an
op on it with the carrier's rule, :func:`value_of` gives the value. A method declares its
carrier types in ``Method.carriers``.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping, Sequence

# The kinds of site a strategy is asked for, and what a model passes for each:
#   shared(groups=1, axis=-1, norm=None)   an activation read by one or more linears:
#                                          ``x -> kept x`` (made once for all readers;
#                                          ``norm``: it stands where that norm's output
#                                          would, and is carried in the same form)
#   linear(name, frozen)                   ``(dense, x, kernel, bias, *, contract) -> y``
#   activation(kind, gated)                ``h -> act(h)``, or ``(g, u) -> act(g) * u``
#   norm(kind)                             ``(x, affine, *, eps, name) -> y``
#   attention(num_heads, num_kv_heads, causal)   ``(q, k, v, mask) -> o``
#   qkv(num_heads, num_kv_heads, causal)   ``(run, x, params, consts) -> o``: the q, k, v
#                                          projections of ``x`` and the attention as one
#                                          pure function ``run(x, params, consts)`` (the
#                                          model builds it when ``strategy.recomputes``)
#   hidden(kind, gated)                    ``(run, inputs, params, consts) -> y``: an
#                                          MLP's activation (its ``arithmetic``) and last
#                                          linear as one pure function ``run(inputs,
#                                          params, consts)`` (the model builds it when
#                                          ``strategy.recomputes``); the activation's
#                                          site's ``kind`` and ``gated``
#   block()                                ``fn -> fn`` run as a rematted/offloaded block
#   layers()                               ``(step, carry, xs) -> (carry, ys)``: a stack's
#                                          blocks run in order, as ``lax.scan`` would
SITES = ("shared", "linear", "activation", "norm", "attention", "qkv", "hidden", "block",
         "layers")


class Strategy:
  """Base of the strategies: stateless by default (no state, ``apply`` calls it)."""

  def init_state(self) -> dict[str, object]:
    """The state this strategy updates in a forward pass, by name (pure pytrees)."""
    return {}

  def apply(self, states: dict, *args, **kwargs):
    """``(out, updated states)``; a stateless strategy updates nothing."""
    return self(*args, **kwargs), {}


@dataclasses.dataclass(frozen=True)
class Field:
  """A policy field: ``check(value, extra)`` returns it normalised (e.g. "0.5" -> 0.5) or
  raises ValueError naming the field (``extra``: values other methods add to it);
  ``choices`` is the short form of such a check."""
  name: str
  default: object
  doc: str
  choices: tuple | None = None
  check: Callable[[object, tuple], object] | None = None

  def normalise(self, value, extra: Sequence = ()):
    """The checked value; ``extra``: values other methods add to this field."""
    if self.check is not None:
      return self.check(value, tuple(extra))
    check_choice(self.name, value, tuple(self.choices) + tuple(extra))
    return value


def check_choice(what: str, value, valid: Sequence, who: str = "MemoryPolicy") -> None:
  """ValueError ``"<who>: unknown <what> <value>; valid: ..."`` unless ``value`` is valid."""
  if value not in valid:
    raise ValueError(f"{who}: unknown {what} {value!r}; valid: {', '.join(map(repr, valid))}")


@dataclasses.dataclass(frozen=True)
class Method:
  """One method as the policy sees it (see the module docstring)."""
  name: str
  fields: tuple[Field, ...] = ()
  values: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
  presets: Mapping[str, Mapping[str, object]] = dataclasses.field(default_factory=dict)
  strategies: Mapping[str, Callable] = dataclasses.field(default_factory=dict)
  # check(policy): errors that involve several fields; check_model(policy, model,
  # reversible): errors for a model that cannot do what the policy asks.
  check: Callable | None = None
  check_model: Callable | None = None
  # carrier type -> rule(fn, inputs, diff_args, const_args) for ops reading it
  carriers: Mapping[type, Callable] = dataclasses.field(default_factory=dict)
  # compiler_options(policy): the XLA options a step under the policy is compiled with
  # ({} for none), for what the method's layout needs from the compiler
  compiler_options: Callable | None = None

  def __post_init__(self):
    unknown = set(self.strategies) - set(SITES)
    if unknown:
      raise ValueError(f"Method {self.name!r}: unknown site kinds {sorted(unknown)}; "
                       f"valid: {', '.join(SITES)}")


_CARRIERS: dict[type, Callable] = {}


def load(*modules: str) -> tuple[Method, ...]:
  """The ``METHOD`` of each module, in order; records their carrier types."""
  found = tuple(importlib.import_module(m).METHOD for m in modules)
  for method in found:
    _CARRIERS.update(method.carriers)
  return found


def value_of(x):
  """The activation itself, whether given plain or carried."""
  return x.value if isinstance(x, tuple(_CARRIERS)) else x


def read(fn: Callable, inputs: Sequence, diff_args: Sequence = (), const_args: Sequence = ()):
  """``fn(*inputs, *diff_args, *const_args)``: plain autodiff for plain inputs; for
  carried ones (all of one carrier type), the carrier's rule, which keeps the carried
  form for backward. ``diff_args`` are differentiated (weights), ``const_args`` not."""
  carried = [type(x) for x in inputs if type(x) in _CARRIERS]
  if not carried:
    return fn(*inputs, *diff_args, *const_args)
  if len(carried) != len(inputs) or len(set(carried)) != 1:
    raise ValueError("read: inputs mix plain and carried activations "
                     f"({[type(x).__name__ for x in inputs]}); carry all or none")
  return _CARRIERS[carried[0]](fn, inputs, diff_args, const_args)
