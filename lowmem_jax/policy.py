"""The memory policy: one object that says how every layer saves for backward.

Models ask the policy for the *strategy* of each site (a linear, an activation, a norm,
the attention, a block, an activation shared by linears) and call it; they never test a
method's name. Presets are named field settings, combined with ``+``::

    MemoryPolicy.parse("lowmembp")                 # approx2 activations + MS norms
    MemoryPolicy.parse("lowmembp+remat")           # ... and full remat of each block
    MemoryPolicy.parse("remat:dots_saveable")      # any jax.checkpoint_policies name
    MemoryPolicy.parse("remat:save=qkv_proj,attn_out")  # save only these tagged tensors
    MemoryPolicy.parse("lowmembp+attention=xla")   # any field as field=value

The fields, presets and strategies come from the methods (:mod:`lowmem_jax.methods`),
one module each, listed in :data:`METHOD_MODULES`: adding a method is its module and one
line there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from lowmem_jax import gpu_target, methods
from lowmem_jax.dense import Dense
# Re-exported: the names blocks tag, the remat policy names, the linears WTA-CRS may sample.
from lowmem_jax.remat import CHECKPOINT_NAMES, REMAT_POLICY_NAMES  # noqa: F401
from lowmem_jax.wta_crs import LINEAR_NAMES  # noqa: F401

# The methods, in the order their strategies compose: each site's strategy starts from
# the baseline's, and every later method may replace or wrap what the earlier ones chose.
METHOD_MODULES = (
    "lowmem_jax.baseline",
    "lowmem_jax.approx_bp",
    "lowmem_jax.ms_bp",
    "lowmem_jax.remat",
    "lowmem_jax.offload",
    "lowmem_jax.hidden_recompute",  # before Mesa, which codes what its recompute keeps
    "lowmem_jax.mesa",
    "lowmem_jax.wta_crs",
    "lowmem_jax.reversible_bp",
    "lowmem_jax.qkv_recompute",
    "lowmem_jax.lowmem",
    "lowmem_jax.layers",
)
METHODS = methods.load(*METHOD_MODULES)

# Backends where kernels="auto" picks Pallas: none until a GPU measurement shows the
# kernels faster than XLA's fusions (see lowmem_jax/kernel_bench.py and docs/).
AUTO_PALLAS_BACKENDS: tuple[str, ...] = ()


def _collect(method_list):
  """The policy's fields, presets and extra field values from ``method_list``; a field or
  preset defined twice is a ValueError naming it."""
  fields: dict[str, methods.Field] = {}
  presets: dict[str, dict[str, object]] = {}
  extra: dict[str, tuple] = {}
  for method in method_list:
    for field in method.fields:
      if field.name in fields:
        raise ValueError(f"method {method.name!r} redefines the policy field {field.name!r}")
      fields[field.name] = field
    for name, setting in method.presets.items():
      if name in presets:
        raise ValueError(f"method {method.name!r} redefines the preset {name!r}")
      presets[name] = dict(setting)
    for name, values in method.values.items():
      extra[name] = extra.get(name, ()) + tuple(values)
  unknown = set(extra) - set(fields)
  if unknown:
    raise ValueError(f"methods add values to unknown policy fields {sorted(unknown)}")
  return fields, presets, extra


FIELDS, PRESETS, _EXTRA_VALUES = _collect(METHODS)


class _PolicyMethods:
  """What :class:`MemoryPolicy` does; its fields come from the methods."""

  def __post_init__(self):
    for name, field in FIELDS.items():
      value = field.normalise(getattr(self, name), _EXTRA_VALUES.get(name, ()))
      object.__setattr__(self, name, value)
    for method in METHODS:
      if method.check is not None:
        method.check(self)

  @staticmethod
  def default(field: str):
    """The default value of ``field``."""
    return FIELDS[field].default

  # -------------------------------------------------------------------------- parsing
  @classmethod
  def parse(cls, spec: "str | MemoryPolicy") -> "MemoryPolicy":
    """A policy from a spec: presets, ``remat:...`` and ``field=value`` joined by ``+``."""
    if isinstance(spec, cls):
      return spec
    if not isinstance(spec, str) or not spec.strip():
      raise ValueError(f"MemoryPolicy.parse expects a non-empty string, got {spec!r}")
    fields: dict[str, object] = {}
    origin: dict[str, str] = {}
    for token in (t.strip() for t in spec.split("+")):
      if not token:  # a stray '+': it read as the unknown preset ""
        raise ValueError(f"MemoryPolicy: {spec!r} has an empty part; join presets and "
                         "field=value by single '+' (e.g. 'lowmembp+remat')")
      for field, value in _token_fields(token).items():
        value = FIELDS[field].normalise(value, _EXTRA_VALUES.get(field, ()))
        if field in fields and fields[field] != value:
          raise ValueError(
              f"MemoryPolicy: {token!r} sets {field}={value!r} but {origin[field]!r} "
              f"already set {field}={fields[field]!r}")
        fields[field], origin[field] = value, token
    return cls(**fields)

  def __add__(self, other: "str | MemoryPolicy") -> "MemoryPolicy":
    return MemoryPolicy.parse(f"{self.spec}+{MemoryPolicy.parse(other).spec}")

  @property
  def spec(self) -> str:
    """The canonical spec string, presets first; ``MemoryPolicy.parse(p.spec) == p``."""
    left = {name: getattr(self, name) for name in FIELDS
            if getattr(self, name) != self.default(name)}
    tokens = []
    for name, fields in sorted(PRESETS.items(), key=lambda kv: -len(kv[1])):
      if (any(k in left for k in fields)
          and all(getattr(self, k) == v for k, v in fields.items())):
        tokens.append(name)
        for k in fields:
          left.pop(k, None)
    for field, value in left.items():
      if field == "remat":
        tokens.append("remat:save=" + ",".join(value) if isinstance(value, tuple)
                      else f"remat:{value}")
      elif isinstance(value, tuple):
        tokens.append(f"{field}={','.join(value)}")
      else:
        tokens.append(f"{field}={value}")
    return "+".join(tokens) or "baseline"

  def __str__(self):
    return self.spec

  # -------------------------------------------------------------------------- strategies
  def strategy(self, site: str, **kwargs):
    """The strategy for a site of kind ``site`` (:data:`lowmem_jax.methods.SITES`): the
    baseline's, replaced or wrapped by each method in turn."""
    methods.check_choice("site kind", site, methods.SITES)
    chosen = None
    for method in METHODS:
      hook = method.strategies.get(site)
      if hook is not None:
        chosen = hook(self, chosen, **kwargs)
    return chosen

  def shared_strategy(self, groups: int = 1, axis: int = -1, *, norm: str | None = None):
    """``x -> kept x`` for an activation that one or more linears read: what they keep
    of it, made once for all (``groups`` along ``axis``: how a method may split it).
    ``norm``: the activation stands where the output of a norm of that kind would (the
    embeddings entering a post-LN stack), and is carried as that norm's output is."""
    return self.strategy("shared", groups=groups, axis=axis, norm=norm)

  def linear_strategy(self, name: str | None = None, *, frozen: bool = False):
    """``(dense, x, kernel, bias, *, contract) -> y`` for the linear called ``name``
    ("fc1", ...; None for heads); ``frozen``: its kernel is not trained (LoRA's base)."""
    return self.strategy("linear", name=name, frozen=frozen)

  def activation_strategy(self, kind: str, *, gated: bool = False):
    """``h -> act(h)`` for ``kind`` in {"gelu", "silu"}; ``gated``: ``(g, u) -> act(g) * u``."""
    return self.strategy("activation", kind=kind, gated=gated)

  def norm_strategy(self, kind: str):
    """``(x, affine, *, eps, name) -> y`` for ``kind`` in {"layer", "rms"}; its
    ``has_affine`` says whether the norm holds its scale (and bias)."""
    return self.strategy("norm", kind=kind)

  def attention_strategy(self, num_heads: int | None = None,
                         num_kv_heads: int | None = None, *, causal: bool = False):
    """``(q, k, v, mask) -> o`` on ``[B, N, heads, head_dim]`` projections."""
    return self.strategy("attention", num_heads=num_heads, num_kv_heads=num_kv_heads,
                         causal=causal)

  def qkv_strategy(self, num_heads: int | None = None, num_kv_heads: int | None = None,
                   *, causal: bool = False):
    """``(run, x, params, consts) -> o``: the attention's q, k, v projections of ``x``
    and its core; ``recomputes`` says whether it wants them as one pure function
    ``run(x, params, consts)`` (:class:`models.attention.SelfAttention` builds it)."""
    return self.strategy("qkv", num_heads=num_heads, num_kv_heads=num_kv_heads,
                         causal=causal)

  def hidden_strategy(self, kind: str, *, gated: bool = False):
    """``(run, inputs, params, consts) -> y``: an MLP's activation of ``kind`` on
    ``inputs`` (``h``, or ``(g, u)`` when ``gated``) and its last linear; ``recomputes``
    says whether it wants them as one pure function ``run(inputs, params, consts)``
    (:mod:`models.mlp` builds it)."""
    return self.strategy("hidden", kind=kind, gated=gated)

  def block_strategy(self):
    """``fn -> fn`` running a block as the policy says (rematted, offloaded, as is);
    ``checkpoint_policy`` is the ``jax.checkpoint`` policy or None."""
    return self.strategy("block")

  def layers_strategy(self):
    """``(step, carry, xs) -> (carry, ys)`` with ``lax.scan``'s meaning: how a stack runs
    its blocks (``step`` is one block, ``xs`` the blocks' stacked variables)."""
    return self.strategy("layers")

  # -------------------------------------------------------------------------- shortcuts
  def kernel_implementation(self) -> str:
    """"xla", "pallas" or "pallas_interpret": ``kernels`` resolved on this backend (the
    compile target's, :mod:`lowmem_jax.gpu_target`)."""
    backend = gpu_target.backend()
    if self.kernels == "auto":
      return "pallas" if backend in AUTO_PALLAS_BACKENDS else "xla"
    if self.kernels == "pallas" and backend != "gpu":
      raise ValueError(
          f"MemoryPolicy(kernels='pallas'): the Pallas kernels compile for GPU only and "
          f"this backend is {backend!r}; use kernels='xla', or 'pallas_interpret' to run "
          "them in interpret mode")
    return self.kernels

  # The plain functions of the stateless strategies, for code without model state (the
  # pure-JAX block stack): a stateful one (Mesa's codes) is a ValueError, not dropped.
  def activation_fn(self, kind: str, *, gated: bool = False) -> Callable:
    """The activation function for ``kind`` in {"gelu", "silu"}; ``gated``: the function
    ``(g, u) -> act(g) * u`` (the strategy itself, which may keep only g and u)."""
    strategy = self._stateless(self.activation_strategy(kind, gated=gated), "activation")
    return strategy if gated else strategy.fn

  def linear_fn(self, name: str | None = None) -> Callable:
    """``linear(x, kernel, bias=None, *, contract=1)``: ``x`` contracted with ``kernel``
    over its last ``contract`` axes, plus bias, computed in ``x``'s dtype, saved as the
    policy says for the linear ``name`` ("fc1", ...; None: any other)."""
    strategy = self._stateless(self.linear_strategy(name), "linear")

    def linear(x, kernel, bias=None, *, contract=1):
      return strategy(Dense(contract, x.dtype), x, kernel, bias, contract=contract)
    return linear

  def norm_fn(self, kind: str) -> Callable:
    """The norm for ``kind`` in {"layer", "rms"}: ``fn(x, scale, bias, eps, *, name)`` /
    ``fn(x, scale, eps, *, name)``, or ``fn(x, eps, *, name)`` without affine."""
    return self._stateless(self.norm_strategy(kind), "norm").fn

  def attention_fn(self) -> Callable:
    """``attention(q, k, v, *, causal, mask)`` with this policy's implementation."""
    # one head is enough to build it: only its statefulness is asked here
    return self._stateless(self.attention_strategy(num_heads=1), "attention").fn

  def _stateless(self, strategy, site: str):
    if strategy.init_state():
      raise ValueError(f"MemoryPolicy {self.spec!r}: its {site} keeps state "
                       f"({type(strategy).__name__}), so it has no plain function; build "
                       "from the modules that hold it (models.norm.Norm, models.linear."
                       "Linear, models.mlp.Mlp, models.attention.SelfAttention), then "
                       "models.sites.seed_sites(model, rngs)")
    return strategy

  @property
  def merges_norm_affine(self) -> bool:
    """True when norms carry no affine: the model folds it into the next linear."""
    return not self.norm_strategy("layer").has_affine

  @property
  def quantizes(self) -> bool:
    """True when activations are kept as codes (Mesa)."""
    return self.quant != "none"

  def check_architecture(self, model: str, *, reversible: bool = False) -> None:
    """ValueError when the policy asks for what ``model`` cannot do (a reversible
    stack on a standard model)."""
    for method in METHODS:
      if method.check_model is not None:
        method.check_model(self, model, reversible)

  def compiler_options(self) -> dict[str, str]:
    """The XLA options to compile a step under this policy with (``jax.jit``'s
    ``compiler_options``; :class:`train.trainer.Trainer` passes them): each method's, and
    the passes they disable (``xla_disable_hlo_passes``) joined. {} for most policies."""
    merged: dict[str, str] = {}
    disabled: list[str] = []
    for method in METHODS:
      if method.compiler_options is None:
        continue
      for key, value in method.compiler_options(self).items():
        if key == "xla_disable_hlo_passes":
          disabled += [p for p in value.split(",") if p and p not in disabled]
        elif merged.setdefault(key, value) != value:
          raise ValueError(f"policy {self.spec}: methods ask for {key}={merged[key]!r} "
                           f"and {key}={value!r}")
    if disabled:
      merged["xla_disable_hlo_passes"] = ",".join(disabled)
    return merged

  def checkpoint_policy(self):
    """The ``jax.checkpoint`` policy for a block, or None when blocks are not rematted."""
    return self.block_strategy().checkpoint_policy

  def remat_block(self, fn: Callable) -> Callable:
    """``fn`` run as the block strategy says (``jax.checkpoint`` with the policy's
    checkpoint policy; ``fn`` itself without one)."""
    return self.block_strategy()(fn)


def _field_docs() -> str:
  by_method = []
  for method in METHODS:
    for field in method.fields:
      by_method.append(f"  {field.name} (default {field.default!r}; {method.name}): {field.doc}.")
  return "\n".join(by_method)


MemoryPolicy = dataclasses.make_dataclass(
    "MemoryPolicy", [(f.name, object, dataclasses.field(default=f.default))
                     for f in FIELDS.values()],
    bases=(_PolicyMethods,), frozen=True, kw_only=True)
MemoryPolicy.__module__ = __name__
MemoryPolicy.__doc__ = ("How layers save for backward: a frozen, hashable set of fields, one "
                        "group per method (lowmem_jax.methods).\n\n" + _field_docs())


def _token_fields(token: str) -> dict[str, object]:
  if token in PRESETS:
    return PRESETS[token]
  if token.startswith("remat:"):
    rest = token[len("remat:"):]
    if rest.startswith("save="):
      return {"remat": tuple(n.strip() for n in rest[len("save="):].split(",") if n.strip())}
    return {"remat": rest}
  if "=" in token:
    field, value = (s.strip() for s in token.split("=", 1))
    names = [name for name in FIELDS if name != "remat"]
    if field not in names:
      raise ValueError(f"MemoryPolicy: unknown field {field!r} in {token!r}; valid: "
                       f"{', '.join(names)} (remat is set as 'remat' or 'remat:...')")
    return {field: value}
  raise ValueError(
      f"MemoryPolicy: unknown preset {token!r}; valid presets: {', '.join(PRESETS)}; "
      f"also 'remat:<{'|'.join(REMAT_POLICY_NAMES)}>', 'remat:save=<names>', "
      "and field=value")
