"""The baseline method: the exact function, keeping only what an exact backward needs.

``autodiff="lean"`` (preset ``baseline``) keeps what PyTorch keeps, or less: each op runs
under :func:`keep_inputs` (``jax.checkpoint``, nothing saveable), so its backward keeps
its inputs and recomputes the rest (cheap elementwise work and casts):

* a linear: its input and the weight as stored (fp32; the compute-dtype cast is redone in
  backward, so no per-step cast of a weight is held);
* GELU/SiLU: its input; the gated ``silu(g) * u``: ``g`` and ``u`` (the product, which
  the next linear keeps, is recomputed with the derivative);
* LayerNorm/RMSNorm: its input (statistics recomputed from it);
* attention: q, k, v, o and the row log-sum-exp (:mod:`lowmem_jax.attention`: never an
  N x N array on any backend).

Under a block checkpoint policy (remat, offload) the policy decides what a block keeps
and the ops run under plain autodiff. Plain autodiff of the same functions,
``autodiff="plain"`` (preset ``plain``, with XLA's
attention: what a Flax user writes), keeps far more: ``jax.nn.gelu``'s intermediates,
fp32 copies of a norm's input and output, the per-step bf16 copy of every weight, and
with ``attention=xla`` the fp32 N x N probabilities. Every other method starts from these
strategies and replaces or wraps some of them.

Fields: ``autodiff`` (above), ``attention`` (the implementation,
:data:`lowmem_jax.attention.IMPLEMENTATIONS`) and ``kernels`` (which code runs our ops
with kernels: "xla" jnp, "pallas" GPU kernels, "pallas_interpret" those kernels in
interpret mode, "auto" Pallas where measured faster, see
:meth:`lowmem_jax.policy.MemoryPolicy.kernel_implementation`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax

from lowmem_jax import attention as attention_lib
from lowmem_jax import gpu_target, layers, norms
from lowmem_jax.methods import Field, Method, Strategy, check_choice, read, value_of

KERNELS = ("auto", "xla", "pallas", "pallas_interpret")
AUTODIFF = ("lean", "plain")
# The exact functions a Flax user writes: jax.nn's activations in the compute dtype
# (nnx.gelu is jax.nn.gelu; activations.gelu/silu are the fp32 references), standard
# norms with fp32 statistics.
EXACT_ACTIVATIONS = {"gelu": functools.partial(jax.nn.gelu, approximate=False),
                     "silu": jax.nn.silu}
STANDARD_NORMS = {"layer": norms.layer_norm, "rms": norms.rms_norm}


def keep_inputs(fn: Callable) -> Callable:
  """``fn`` whose backward keeps only its (differentiable) inputs and recomputes what
  else its derivative needs: ``jax.checkpoint`` saving nothing computed inside
  (:func:`lowmem_jax.layers.checkpoint`)."""
  return layers.checkpoint(fn, jax.checkpoint_policies.nothing_saveable)


@functools.cache
def lean_activation(kind: str) -> Callable:
  """The exact activation of ``kind`` (:data:`EXACT_ACTIVATIONS`) keeping only its input."""
  fn = keep_inputs(EXACT_ACTIVATIONS[kind])
  fn.__name__ = f"lean_{kind}"
  return fn


def lean_layer_norm(x, scale=None, bias=None, eps: float = 1e-6, *, name: str | None = None):
  """:func:`lowmem_jax.norms.layer_norm` keeping only its input (and affine): the
  statistics and normalised rows are recomputed in backward."""
  y = keep_inputs(lambda x, s, b: norms.layer_norm(x, s, b, eps))(x, scale, bias)
  return norms.tag(y, name)


def lean_rms_norm(x, scale=None, eps: float = 1e-6, *, name: str | None = None):
  """:func:`lowmem_jax.norms.rms_norm` keeping only its input (and scale)."""
  y = keep_inputs(lambda x, s: norms.rms_norm(x, s, eps))(x, scale)
  return norms.tag(y, name)


LEAN_NORMS = {"layer": lean_layer_norm, "rms": lean_rms_norm}


# ----------------------------------------------------------------------------- strategies
@dataclasses.dataclass(frozen=True)
class Shared(Strategy):
  """An activation read by one or more linears, kept as it is: each saves the array
  itself, one buffer for all of them."""

  def __call__(self, x):
    return x


@dataclasses.dataclass(frozen=True)
class Linear(Strategy):
  """``dense(x, kernel, bias)``, which casts to the compute dtype itself. ``lean``: keeps
  ``x`` and the weights as given (the cast is redone in backward); plain autodiff keeps
  ``x`` and the cast weights. A carried ``x``: what its carrier keeps
  (:func:`lowmem_jax.methods.read`)."""
  lean: bool = True

  def __call__(self, dense, x, kernel, bias, *, contract: int):
    del contract
    weights = (kernel,) if bias is None else (kernel, bias)
    if self.lean and value_of(x) is x:
      return keep_inputs(dense)(x, *weights)
    return read(dense, [x], weights)


def gated_product(fn, g, u):
  """``fn(g) * u``: a gated activation (SwiGLU's ``silu(gate) * up``)."""
  return fn(g) * u


@dataclasses.dataclass(frozen=True)
class Activation(Strategy):
  """``fn(h)``, or ``fn(g) * u`` when ``gated``. ``saved_bits``: bits per element that
  ``fn``'s backward keeps of its input (None: the input itself, in its dtype).
  ``keep_gate_inputs``: the gated product keeps only ``g`` and ``u`` (one rule for
  ``fn(g) * u``: ``fn(g)`` is recomputed in backward, not kept beside them)."""
  kind: str
  fn: Callable
  gated: bool = False
  saved_bits: int | None = None
  keep_gate_inputs: bool = False

  @property
  def arithmetic(self) -> "Activation":
    """What the activation computes, forward and backward, apart from what it keeps:
    itself (a site that recomputes it, ``hidden``, runs this)."""
    return self

  def __call__(self, *inputs):
    if not self.gated:
      return self.fn(*inputs)
    product = functools.partial(gated_product, self.fn)
    return (keep_inputs(product) if self.keep_gate_inputs else product)(*inputs)


@dataclasses.dataclass(frozen=True)
class Norm(Strategy):
  """``fn(x, *affine, eps, name=name)`` over the last axis. ``has_affine``: whether the
  norm holds its scale (and bias); without, the model merges them into the linears that
  read the output. ``affine``: ``(scale, bias or None)`` for "layer", ``(scale,)`` for
  "rms", ``()`` without affine. ``keeps_output``: its backward reads its output, which it
  keeps (MS norms): a reader of the output keeps it at no further cost."""
  kind: str
  fn: Callable
  has_affine: bool = True
  keeps_output: bool = False

  def __call__(self, x, affine=(), *, eps: float, name: str | None = None):
    return self.fn(x, *affine, eps, name=name)


class Wrapper(Strategy):
  """A strategy around another (``inner``), whose function and ``kind`` it reports."""

  @property
  def fn(self) -> Callable:
    return self.inner.fn

  @property
  def kind(self) -> str:
    return self.inner.kind


class NormWrapper(Wrapper):
  """A strategy around a norm (``inner``), reporting what the norm says of itself."""

  @property
  def has_affine(self) -> bool:
    return self.inner.has_affine

  @property
  def keeps_output(self) -> bool:
    return self.inner.keeps_output


@dataclasses.dataclass(frozen=True)
class Attention(Strategy):
  """:func:`lowmem_jax.attention.attention` with ``implementation`` (and ``"flash"``'s
  most keys per block, ``block_k``); output tagged ``attn_out``."""
  implementation: str
  causal: bool = False
  block_k: int = attention_lib.DEFAULT_BLOCK_K

  @property
  def fn(self) -> Callable:
    """``fn(q, k, v, *, causal, mask, name, dropout_rate, dropout_key)`` with this
    implementation."""
    return functools.partial(attention_lib.attention, implementation=self.implementation,
                             block_k=self.block_k)

  def __call__(self, q, k, v, mask=None, *, dropout_rate: float = 0.0, dropout_key=None):
    return self.fn(q, k, v, causal=self.causal, mask=mask, name="attn_out",
                   dropout_rate=dropout_rate, dropout_key=dropout_key)


@dataclasses.dataclass(frozen=True)
class KeepRun(Strategy):
  """A ``qkv`` or ``hidden`` site's ops as they are, each keeping what it keeps (the
  attention q, k, v; the MLP's last linear its input). ``recomputes``: the model hands
  the site its ops as one pure function ``run(inputs, params, consts)`` (a strategy that
  recomputes them needs that); it does not for this one, and runs them as modules."""
  recomputes = False

  def __call__(self, run: Callable, inputs, params, consts):
    return run(inputs, params, consts)


@dataclasses.dataclass(frozen=True)
class Block(Strategy):
  """Runs a block, rematted by ``checkpoint_policy`` (a ``jax.checkpoint`` policy) or as
  it is (None). ``saves``, for memory accounting: "ops" (what the block's ops save),
  "input" (its input only) or "policy" (what the checkpoint policy keeps)."""
  checkpoint_policy: Callable | None = None
  saves: str = "ops"

  def __call__(self, fn: Callable) -> Callable:
    if self.checkpoint_policy is None:
      return fn
    return layers.checkpoint(fn, self.checkpoint_policy)


# ----------------------------------------------------------------------------- hooks
def _shared(policy, inner, *, groups: int = 1, axis: int = -1, norm=None):
  return Shared()


def _lean(policy) -> bool:
  """Whether ops keep only their inputs: ``autodiff="lean"`` and no checkpoint policy on
  the blocks. Under one (remat, offload), the policy decides what a block keeps; an op's
  own ``jax.checkpoint`` would hide its insides from it (``dots_saveable`` could not save
  a dot inside one) and keep a named tensor twice."""
  return policy.autodiff == "lean" and policy.checkpoint_policy() is None


def _linear(policy, inner, *, name=None, frozen=False):
  return Linear(lean=_lean(policy))


def _activation(policy, inner, *, kind: str, gated: bool = False):
  check_choice("activation kind", kind, tuple(EXACT_ACTIVATIONS), who="MemoryPolicy")
  if not _lean(policy):
    return Activation(kind, EXACT_ACTIVATIONS[kind], gated)
  return Activation(kind, lean_activation(kind), gated, keep_gate_inputs=gated)


def _norm(policy, inner, *, kind: str):
  check_choice("norm kind", kind, tuple(STANDARD_NORMS), who="MemoryPolicy")
  if not _lean(policy):
    return Norm(kind, STANDARD_NORMS[kind])
  return Norm(kind, LEAN_NORMS[kind])


def _attention(policy, inner, *, num_heads=None, num_kv_heads=None, causal=False):
  backend = gpu_target.backend()
  if policy.attention in ("cudnn", "cudnn_padded") and backend != "gpu":
    # before any work: the first call would refuse every shape on this backend
    raise ValueError(f"MemoryPolicy(attention={policy.attention!r}): cuDNN's fused attention "
                     f"runs on a CUDA GPU and this backend is {backend!r}; use "
                     "attention='auto' (cuDNN where it takes the shape, else ours) or 'flash'")
  return Attention(policy.attention, causal, policy.attention_block)


def _qkv(policy, inner, *, num_heads=None, num_kv_heads=None, causal=False):
  return KeepRun()


def _hidden(policy, inner, *, kind, gated=False):
  return KeepRun()


def _block(policy, inner):
  return Block()


def _check_block(value, extra):
  try:
    block = int(value)
  except (TypeError, ValueError):
    block = None
  if block is None or block < 1 or str(block) != str(value).strip():
    raise ValueError(f"MemoryPolicy: attention_block must be a positive integer, got {value!r}")
  return block


def _check_attention_block(policy):
  if (policy.attention_block != policy.default("attention_block")
      and policy.attention not in ("auto", "flash")):
    raise ValueError(f"MemoryPolicy: attention_block={policy.attention_block} sizes flash "
                     f"attention's key blocks, but attention={policy.attention!r} runs none; "
                     "drop one of them")


METHOD = Method(
    name="baseline",
    fields=(
        Field("attention", "auto", "the attention implementation: "
              + " | ".join(attention_lib.IMPLEMENTATIONS) + " (lowmem_jax.attention)",
              choices=attention_lib.IMPLEMENTATIONS),
        Field("attention_block", attention_lib.DEFAULT_BLOCK_K, "flash attention's most keys "
              "per block (lowmem_jax.attention.key_block): smaller keeps smaller score "
              "blocks in backward, in more steps", check=_check_block),
        Field("kernels", "auto", "which code runs our ops: " + " | ".join(KERNELS),
              choices=KERNELS),
        Field("autodiff", "lean", "lean (each op keeps only its inputs, as PyTorch does) | "
              "plain (plain JAX autodiff of the same functions)", choices=AUTODIFF),
    ),
    presets={"baseline": {}, "plain": {"autodiff": "plain", "attention": "xla"}},
    check=_check_attention_block,
    strategies={"shared": _shared, "linear": _linear, "activation": _activation,
                "norm": _norm, "attention": _attention, "qkv": _qkv, "hidden": _hidden,
                "block": _block},
)
