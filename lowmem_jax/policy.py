"""The memory policy: one object that says how every layer saves for backward.

Models ask the policy which activation, norm and attention to use and whether to remat
a block; they never branch on preset names. Presets are named field settings, combined
with ``+``::

    MemoryPolicy.parse("lowmembp")                 # approx2 activations + MS norms
    MemoryPolicy.parse("lowmembp+remat")           # ... and full remat of each block
    MemoryPolicy.parse("remat:dots_saveable")      # any jax.checkpoint_policies name
    MemoryPolicy.parse("remat:save=qkv_proj,mlp_out")  # save only these tagged tensors
    MemoryPolicy.parse("lowmembp+attention=xla")   # any field as field=value

A new method adds its field values here and one line to ``PRESETS``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax

from lowmem_jax import activations, norms
from lowmem_jax import attention as attention_lib
from lowmem_jax.attention import attention

ACTIVATIONS = ("exact", "approx2")
NORMS = ("standard", "ms")
ATTENTIONS = attention_lib.IMPLEMENTATIONS
KERNELS = ("auto", "xla", "pallas", "pallas_interpret")
QUANTS = ("none", "int8")
SAMPLED_LINEARS = ("none", "wta-crs")
REVERSIBLES = ("none", "vanilla", "pareprop")
# Attribute names of the linears in our blocks (WTA-CRS applies to those in
# ``sample_targets``); heads and embeddings are never sampled.
LINEAR_NAMES = ("query", "key", "value", "out", "fc1", "fc2", "gate", "up", "down")
# Backends where kernels="auto" picks Pallas: none until a GPU measurement shows the
# kernels faster than XLA's fusions (see pallas_kernels/bench.py and docs/).
AUTO_PALLAS_BACKENDS: tuple[str, ...] = ()

# jax.checkpoint_policies entries that are policies themselves (not policy factories).
REMAT_POLICY_NAMES = tuple(n for n in (
    "nothing_saveable", "everything_saveable", "dots_saveable", "checkpoint_dots",
    "dots_with_no_batch_dims_saveable", "checkpoint_dots_with_no_batch_dims",
) if hasattr(jax.checkpoint_policies, n))

# Tensors the blocks tag with jax.ad_checkpoint.checkpoint_name, for remat:save=...
CHECKPOINT_NAMES = (
    "norm_out",    # output of a block's norm (input of the next linear)
    "qkv_proj",    # query/key/value projections
    "attn_out",    # attention output, before the out-projection
    "attn_proj",   # out-projection output
    "mlp_hidden",  # first MLP linear(s) output, before the activation
    "mlp_act",     # activation output (input of the last MLP linear)
    "mlp_out",     # last MLP linear output
)

# Named presets: the fields each sets. Combine with "+".
PRESETS: dict[str, dict[str, object]] = {
    "baseline": {},
    "approx-bp": {"activation": "approx2"},
    "ms-bp": {"norm": "ms"},
    "lowmembp": {"activation": "approx2", "norm": "ms"},
    "remat": {"remat": "full"},
    "mesa8": {"quant": "int8"},
    "wta-crs": {"sampled_linear": "wta-crs"},
    "reversible": {"reversible": "vanilla"},
    "pareprop": {"reversible": "pareprop"},
}

# "exact" is what a Flax user writes: jax.nn's activations in the compute dtype, plain
# autodiff (nnx.gelu is jax.nn.gelu). activations.gelu/silu are the fp32 references.
_EXACT_ACTIVATIONS = {"gelu": functools.partial(jax.nn.gelu, approximate=False),
                      "silu": jax.nn.silu}
_STANDARD_NORMS = {"layer": norms.layer_norm, "rms": norms.rms_norm}


def _choice(field, value, valid):
  if value not in valid:
    raise ValueError(
        f"MemoryPolicy: unknown {field} {value!r}; valid: {', '.join(map(repr, valid))}")


@dataclasses.dataclass(frozen=True)
class MemoryPolicy:
  """How layers save for backward.

  activation: "exact" (plain autodiff) | "approx2" (ReGELU2/ReSiLU2, 2-bit residual).
  norm: "standard" (affine norms, plain autodiff) | "ms" (MS-LayerNorm/MS-RMSNorm; the
    model merges the affine into the next linear).
  attention: "auto" | "flash" | "cudnn" | "cudnn_padded" | "xla" (see
    :mod:`lowmem_jax.attention`; "auto" never keeps an N x N array nor hits a shape
    cuDNN refuses).
  remat: None | "full" | a ``jax.checkpoint_policies`` name | a tuple of
    ``CHECKPOINT_NAMES`` to save (everything else in the block is recomputed).
  kernels: which implementation of our ops (approx2 activations, MS norms): "xla" (jnp),
    "pallas" (fused GPU kernels; an error on other backends), "pallas_interpret" (the
    kernels in interpret mode, any backend: for tests), "auto" (Pallas where measured
    faster, see ``AUTO_PALLAS_BACKENDS``; XLA elsewhere).
  quant: "none" | "int8" (Mesa: linear, activation, norm and attention inputs saved as
    uint8 codes with per-group EMA ranges, :mod:`lowmem_jax.quant`).
  sampled_linear: "none" | "wta-crs" (weight gradients of the ``sample_targets`` linears
    from ``sample_ratio`` of the token rows, :mod:`lowmem_jax.sampling`).
  reversible: "none" | "vanilla" | "pareprop" (reversible models rebuild block inputs
    in backward, :mod:`lowmem_jax.reversible`; needs a reversible architecture).
  """
  activation: str = "exact"
  norm: str = "standard"
  attention: str = "auto"
  remat: str | tuple[str, ...] | None = None
  kernels: str = "auto"
  quant: str = "none"
  sampled_linear: str = "none"
  sample_ratio: float = 0.3
  sample_targets: tuple[str, ...] = LINEAR_NAMES
  reversible: str = "none"

  def __post_init__(self):
    _choice("activation", self.activation, ACTIVATIONS)
    _choice("quant", self.quant, QUANTS)
    _choice("sampled_linear", self.sampled_linear, SAMPLED_LINEARS)
    _choice("reversible", self.reversible, REVERSIBLES)
    self._check_sampling()
    if self.sampled_linear == "none":
      for field in ("sample_ratio", "sample_targets"):
        if getattr(self, field) != _DEFAULTS[field]:
          raise ValueError(f"MemoryPolicy: {field} is set but sampled_linear is 'none'; "
                           "add 'wta-crs' to the spec")
    if self.reversible != "none":
      for field, value, default in (("quant", self.quant, "none"),
                                    ("sampled_linear", self.sampled_linear, "none"),
                                    ("remat", self.remat, None)):
        if value != default:
          raise ValueError(
              f"MemoryPolicy: reversible={self.reversible!r} keeps no block activations, "
              f"so {field}={value!r} would change nothing; drop one of them")
    _choice("norm", self.norm, NORMS)
    _choice("attention", self.attention, ATTENTIONS)
    _choice("kernels", self.kernels, KERNELS)
    remat = self.remat
    if isinstance(remat, list):
      remat = tuple(remat)
      object.__setattr__(self, "remat", remat)
    if isinstance(remat, tuple):
      if not remat:
        raise ValueError("MemoryPolicy: remat=() saves nothing; use remat='full'")
      for name in remat:
        _choice("checkpoint name in remat", name, CHECKPOINT_NAMES)
    elif remat is not None:
      _choice("remat", remat, ("full",) + REMAT_POLICY_NAMES)

  def _check_sampling(self):
    ratio = self.sample_ratio
    try:
      ratio = float(ratio)
    except (TypeError, ValueError):
      raise ValueError(f"MemoryPolicy: sample_ratio must be a number, got {ratio!r}") from None
    if not 0.0 < ratio <= 1.0:
      raise ValueError(f"MemoryPolicy: sample_ratio must be in (0, 1], got {ratio}")
    object.__setattr__(self, "sample_ratio", ratio)
    targets = self.sample_targets
    if isinstance(targets, str):
      targets = tuple(t.strip() for t in targets.split(",") if t.strip())
    targets = tuple(targets)
    if not targets:
      raise ValueError("MemoryPolicy: sample_targets is empty; name at least one of "
                       f"{', '.join(LINEAR_NAMES)}")
    for name in targets:
      _choice("linear in sample_targets", name, LINEAR_NAMES)
    object.__setattr__(self, "sample_targets", targets)

  # -------------------------------------------------------------------------- parsing
  @classmethod
  def parse(cls, spec: "str | MemoryPolicy") -> "MemoryPolicy":
    """A policy from a spec: presets, ``remat:...`` and ``field=value`` joined by ``+``."""
    if isinstance(spec, MemoryPolicy):
      return spec
    if not isinstance(spec, str) or not spec.strip():
      raise ValueError(f"MemoryPolicy.parse expects a non-empty string, got {spec!r}")
    fields: dict[str, object] = {}
    origin: dict[str, str] = {}
    for token in (t.strip() for t in spec.split("+")):
      for field, value in _token_fields(token).items():
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
    left = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
            if getattr(self, f.name) != f.default}
    tokens = []
    for name, fields in sorted(PRESETS.items(), key=lambda kv: -len(kv[1])):
      if fields and all(k in left and left[k] == v for k, v in fields.items()):
        tokens.append(name)
        for k in fields:
          del left[k]
    for field, value in left.items():
      if field == "sample_targets":
        tokens.append(f"{field}={','.join(value)}")
      elif field != "remat":
        tokens.append(f"{field}={value}")
      elif isinstance(value, tuple):
        tokens.append("remat:save=" + ",".join(value))
      else:
        tokens.append(f"remat:{value}")
    return "+".join(tokens) or "baseline"

  def __str__(self):
    return self.spec

  # -------------------------------------------------------------------------- what models ask
  def kernel_implementation(self) -> str:
    """"xla", "pallas" or "pallas_interpret": ``kernels`` resolved on this backend."""
    backend = jax.default_backend()
    if self.kernels == "auto":
      return "pallas" if backend in AUTO_PALLAS_BACKENDS else "xla"
    if self.kernels == "pallas" and backend != "gpu":
      raise ValueError(
          f"MemoryPolicy(kernels='pallas'): the Pallas kernels compile for GPU only and "
          f"this backend is {backend!r}; use kernels='xla', or 'pallas_interpret' to run "
          "them in interpret mode")
    return self.kernels

  def activation_fn(self, kind: str) -> Callable:
    """The activation to use for ``kind`` in {"gelu", "silu"}."""
    if kind not in _EXACT_ACTIVATIONS:
      raise ValueError(f"unknown activation kind {kind!r}; valid: 'gelu', 'silu'")
    if self.activation == "exact":
      return _EXACT_ACTIVATIONS[kind]
    return activations.approx2_fn(kind, self.kernel_implementation())

  @property
  def merges_norm_affine(self) -> bool:
    """True when norms carry no affine: the model folds it into the next linear."""
    return self.norm == "ms"

  def norm_fn(self, kind: str) -> Callable:
    """The norm for ``kind`` in {"layer", "rms"}.

    Standard: ``fn(x, scale, bias, eps, *, name)`` / ``fn(x, scale, eps, *, name)``;
    MS: ``fn(x, eps, *, name)``.
    """
    if kind not in _STANDARD_NORMS:
      raise ValueError(f"unknown norm kind {kind!r}; valid: 'layer', 'rms'")
    if self.norm == "standard":
      return _STANDARD_NORMS[kind]
    return norms.ms_norm_fn(kind, self.kernel_implementation())

  def attention_fn(self) -> Callable:
    """``attention(q, k, v, *, causal, mask)`` with this policy's implementation."""
    return functools.partial(attention, implementation=self.attention)

  @property
  def quantizes(self) -> bool:
    """True when activations are saved as 8-bit codes (Mesa)."""
    return self.quant == "int8"

  def samples(self, linear_name: str) -> bool:
    """True when the linear called ``linear_name`` takes WTA-CRS weight gradients."""
    return self.sampled_linear == "wta-crs" and linear_name in self.sample_targets

  def check_architecture(self, model: str, *, reversible: bool = False) -> None:
    """ValueError when the policy asks for what ``model`` cannot do (a reversible
    stack on a standard model)."""
    if self.reversible != "none" and not reversible:
      raise ValueError(f"{model}: policy {self.spec!r} needs a reversible architecture "
                       "(revvit-* models); standard blocks cannot be inverted")

  def checkpoint_policy(self):
    """The ``jax.checkpoint`` policy for a block, or None when blocks are not rematted."""
    if self.remat is None:
      return None
    if self.remat == "full":
      return jax.checkpoint_policies.nothing_saveable
    if isinstance(self.remat, tuple):
      return jax.checkpoint_policies.save_only_these_names(*self.remat)
    return getattr(jax.checkpoint_policies, self.remat)

  def remat_block(self, fn: Callable) -> Callable:
    """``fn`` wrapped in ``jax.checkpoint`` per the policy (``fn`` itself if no remat)."""
    policy = self.checkpoint_policy()
    return fn if policy is None else jax.checkpoint(fn, policy=policy)


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(MemoryPolicy)}


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
    names = [f.name for f in dataclasses.fields(MemoryPolicy) if f.name != "remat"]
    if field not in names:
      raise ValueError(f"MemoryPolicy: unknown field {field!r} in {token!r}; valid: "
                       f"{', '.join(names)} (remat is set as 'remat' or 'remat:...')")
    return {field: value}
  raise ValueError(
      f"MemoryPolicy: unknown preset {token!r}; valid presets: {', '.join(PRESETS)}; "
      f"also 'remat:<{'|'.join(REMAT_POLICY_NAMES)}>', 'remat:save=<names>', "
      "and field=value")
