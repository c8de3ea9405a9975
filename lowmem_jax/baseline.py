"""The baseline method: what each site saves with no memory-saving method on.

The exact function and what its backward needs, as a Flax user's model would keep it:
linears save their input, GELU/SiLU their input (``jax.nn``'s, plain autodiff), affine
norms their input and fp32 statistics, attention q, k, v, o and the row log-sum-exp
(:mod:`lowmem_jax.attention`: never an N x N array), blocks everything their ops save.
Every other method starts from these strategies and replaces or wraps some of them.

Fields: ``attention`` (the implementation, :data:`lowmem_jax.attention.IMPLEMENTATIONS`)
and ``kernels`` (which code runs our ops with kernels: "xla" jnp, "pallas" GPU kernels,
"pallas_interpret" those kernels in interpret mode, "auto" Pallas where measured faster,
see :meth:`lowmem_jax.policy.MemoryPolicy.kernel_implementation`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax

from lowmem_jax import attention as attention_lib
from lowmem_jax import norms
from lowmem_jax.methods import Field, Method, Strategy, check_choice, read

KERNELS = ("auto", "xla", "pallas", "pallas_interpret")
# "exact" is what a Flax user writes: jax.nn's activations in the compute dtype, plain
# autodiff (nnx.gelu is jax.nn.gelu). activations.gelu/silu are the fp32 references.
EXACT_ACTIVATIONS = {"gelu": functools.partial(jax.nn.gelu, approximate=False),
                     "silu": jax.nn.silu}
STANDARD_NORMS = {"layer": norms.layer_norm, "rms": norms.rms_norm}


# ----------------------------------------------------------------------------- strategies
@dataclasses.dataclass(frozen=True)
class Shared(Strategy):
  """An activation read by one or more linears, kept as it is: each saves the array
  itself, one buffer for all of them."""

  def __call__(self, x):
    return x


@dataclasses.dataclass(frozen=True)
class Linear(Strategy):
  """``dense(x, kernel, bias)``: plain autodiff saves ``x`` (a carried ``x``: what its
  carrier keeps, :func:`lowmem_jax.methods.read`)."""

  def __call__(self, dense, x, kernel, bias, *, contract: int):
    del contract
    return read(dense, [x], (kernel,) if bias is None else (kernel, bias))


def gated(fn, g, u):
  """``fn(g) * u``: a gated activation (SwiGLU's ``silu(gate) * up``)."""
  return fn(g) * u


@dataclasses.dataclass(frozen=True)
class Activation(Strategy):
  """``fn(h)``, or ``fn(g) * u`` when ``gated``. ``saved_bits``: bits per element that
  ``fn``'s backward keeps of its input (None: the input itself, in its dtype)."""
  kind: str
  fn: Callable
  gated: bool = False
  saved_bits: int | None = None

  def __call__(self, *inputs):
    return gated(self.fn, *inputs) if self.gated else self.fn(*inputs)


@dataclasses.dataclass(frozen=True)
class Norm(Strategy):
  """``fn(x, *affine, eps, name=name)`` over the last axis. ``has_affine``: whether the
  norm holds its scale (and bias); without, the model merges them into the linears that
  read the output. ``affine``: ``(scale, bias or None)`` for "layer", ``(scale,)`` for
  "rms", ``()`` without affine."""
  kind: str
  fn: Callable
  has_affine: bool = True

  def __call__(self, x, affine=(), *, eps: float, name: str | None = None):
    return self.fn(x, *affine, eps, name=name)


@dataclasses.dataclass(frozen=True)
class Attention(Strategy):
  """:func:`lowmem_jax.attention.attention` with ``implementation``; output tagged
  ``attn_out``."""
  implementation: str
  causal: bool = False

  @property
  def fn(self) -> Callable:
    """``fn(q, k, v, *, causal, mask, name)`` with this implementation."""
    return functools.partial(attention_lib.attention, implementation=self.implementation)

  def __call__(self, q, k, v, mask=None):
    return self.fn(q, k, v, causal=self.causal, mask=mask, name="attn_out")


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
    return jax.checkpoint(fn, policy=self.checkpoint_policy)


# ----------------------------------------------------------------------------- hooks
def _shared(policy, inner, *, groups: int = 1, axis: int = -1):
  return Shared()


def _linear(policy, inner, *, name=None, frozen=False):
  return Linear()


def _activation(policy, inner, *, kind: str, gated: bool = False):
  check_choice("activation kind", kind, tuple(EXACT_ACTIVATIONS), who="MemoryPolicy")
  return Activation(kind, EXACT_ACTIVATIONS[kind], gated)


def _norm(policy, inner, *, kind: str):
  check_choice("norm kind", kind, tuple(STANDARD_NORMS), who="MemoryPolicy")
  return Norm(kind, STANDARD_NORMS[kind])


def _attention(policy, inner, *, num_heads=None, num_kv_heads=None, causal=False):
  return Attention(policy.attention, causal)


def _block(policy, inner):
  return Block()


METHOD = Method(
    name="baseline",
    fields=(
        Field("attention", "auto", "the attention implementation: "
              + " | ".join(attention_lib.IMPLEMENTATIONS) + " (lowmem_jax.attention)",
              choices=attention_lib.IMPLEMENTATIONS),
        Field("kernels", "auto", "which code runs our ops: " + " | ".join(KERNELS),
              choices=KERNELS),
    ),
    presets={"baseline": {}},
    strategies={"shared": _shared, "linear": _linear, "activation": _activation,
                "norm": _norm, "attention": _attention, "block": _block},
)
