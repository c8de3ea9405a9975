"""Mesa (arXiv 2111.11124) as a policy method: ``quant="mesa"``, ``quant_bits=8``.

What backward keeps of an activation becomes its code (:mod:`lowmem_jax.quant`: per-group
EMA range, stochastic rounding), made once per activation and shared by all its readers:

* an activation read by linears (a block's input for q, k and v, an MLP's hidden state)
  is carried as a :class:`~lowmem_jax.quant.QTensor`, value and code; a linear reading it
  keeps the code (:func:`lowmem_jax.methods.read`);
* an exact activation keeps the code of its input; a gated one (``act(g) * u``) one rule
  keeping the codes of ``g`` and ``u``;
* a standard norm keeps the code of its input, an MS norm only that of its output (shared
  with the linears), both return their output carried with its code;
* under ``hidden=recompute`` an MLP's coded activation and its last linear (one that
  trains, or has an adapter) keep the codes of the activation's input(s) only and
  recompute its output in backward (:class:`CodedHidden`); an uncoded activation
  (approx2 GELU's 2-bit code) and the last linear keep what they keep;
* attention keeps head-wise codes of q, k and v (its backward recomputes the
  probabilities from them: no N x N array, not even in 8 bits) and returns ``o`` carried
  with its head-wise code, for the out-projection.

Each code has state (the EMA range, an update count, a PRNG key for the rounding noise):
the strategies declare it as :class:`~lowmem_jax.quant.QuantState` s. ``quant_bits`` is
the code width; the codes are uint8, so 8 is the width implemented. Preset ``mesa8``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

from jax.ad_checkpoint import checkpoint_name

from lowmem_jax import attention as attention_lib
from lowmem_jax import quant
from lowmem_jax.baseline import (Activation, Attention, KeepRun, Norm, NormWrapper, Wrapper,
                                 gated_product)
from lowmem_jax.methods import Field, Method, Strategy, check_choice

QUANTS = ("none", "mesa")
BITS = (8,)  # code widths lowmem_jax.quant implements (uint8 codes)


@dataclasses.dataclass(frozen=True)
class Coder:
  """How one activation is coded: ``groups`` contiguous groups along ``axis`` (head-wise:
  ``axis=2, groups=heads`` for ``[B, N, H, D]``), by ``implementation``."""
  groups: int = 1
  axis: int = -1
  implementation: str = "xla"

  def init(self) -> quant.QuantState:
    return quant.QuantState.create(self.groups)

  def code(self, state: quant.QuantState, x, *, kept: bool = False):
    """``(x carried with its code, updated state)``; ``kept``: the carrier's flag
    (:class:`~lowmem_jax.quant.QTensor`)."""
    return quant.quantize_tensor(x, state, axis=self.axis, groups=self.groups,
                                 implementation=self.implementation, kept=kept)

  def code_inputs(self, states: dict, inputs, *, gated: bool):
    """An activation's inputs (``h``; or ``g`` and ``u`` when ``gated``) each carried with
    its code, in the states named by :func:`input_names`; ``(coded, updated states)``."""
    coded, updated = [], {}
    for name, x in zip(input_names(gated), inputs, strict=True):
      qt, updated[name] = self.code(states[name], x)
      coded.append(qt)
    return coded, updated


def input_names(gated: bool) -> tuple[str, ...]:
  """The names of the code states of an activation's inputs."""
  return ("gate", "up") if gated else ("input",)


@dataclasses.dataclass(frozen=True)
class CodedShared(Strategy):
  """An activation read by linears, carried with its code: each of them keeps the code
  (one for all). An activation that arrives carried (coded by its producer) passes.
  ``kept``: it stands where an MS norm's output would (the embeddings entering a post-LN
  stack of them) and is carried in that form, flagged as kept by its producer."""
  coder: Coder
  kept: bool = False

  def init_state(self):
    return {"code": self.coder.init()}

  def apply(self, states, x):
    if isinstance(x, quant.QTensor):
      return x, {}
    qt, state = self.coder.code(states["code"], x, kept=self.kept)
    return qt, {"code": state}


@dataclasses.dataclass(frozen=True)
class CodedActivation(Wrapper):
  """``inner``'s activation whose backward keeps the code of its input, or, gated, one
  rule for ``act(g) * u`` keeping the codes of ``g`` and ``u`` only. ``saved_bits``: the
  code width."""
  inner: Activation
  coder: Coder
  saved_bits: int = 8

  @property
  def gated(self) -> bool:
    return self.inner.gated

  @property
  def arithmetic(self) -> Activation:
    """``inner``'s arithmetic, which this strategy runs at the dequantized inputs."""
    return self.inner.arithmetic

  def init_state(self):
    return {name: self.coder.init() for name in input_names(self.gated)}

  def apply(self, states, *inputs):
    coded, updated = self.coder.code_inputs(states, inputs, gated=self.gated)
    rule = functools.partial(gated_product, self.fn) if self.gated else self.fn
    return quant.coded_vjp(rule, coded), updated


@dataclasses.dataclass(frozen=True)
class CodedHidden(Strategy):
  """An MLP's activation and last linear, ``run(inputs, params, consts)``, whose backward
  keeps the codes of the activation's input(s) (``h``; ``g`` and ``u``) and the weights,
  and recomputes the activation's output from them (``hidden=recompute`` under Mesa): the
  output's own code, which the last linear kept, is gone. Forward exact; backward is
  ``run``'s vjp at the dequantized inputs."""
  coder: Coder
  gated: bool = False
  recomputes = True

  def init_state(self):
    return {name: self.coder.init() for name in input_names(self.gated)}

  def apply(self, states, run: Callable, inputs, params, consts):
    coded, updated = self.coder.code_inputs(states, inputs, gated=self.gated)
    fn = functools.partial(_run_inputs, run, len(coded))
    return quant.coded_vjp(fn, coded, (params,), (consts,)), updated


def _run_inputs(run, n, *args):
  """``run(inputs, params, consts)`` with ``inputs`` the first ``n`` of ``args``."""
  return run(args[:n], *args[n:])


def _affine_norm(fn, eps, num_affine, x, *affine):
  # coded_vjp differentiates arrays only: a LayerNorm without bias gets its None back
  affine = affine + (None,) * (num_affine - len(affine))
  return fn(x, *affine, eps)


@dataclasses.dataclass(frozen=True)
class CodedNorm(NormWrapper):
  """``inner``'s norm returning its output carried with its code (what the linears
  reading it keep). With an affine it keeps the code of its input; an MS norm keeps
  only the code of its output and the fp32 rstd (:func:`lowmem_jax.quant.ms_norm_coded`)."""
  inner: Norm
  coder: Coder

  def init_state(self):
    names = ("input", "output") if self.has_affine else ("output",)
    return {name: self.coder.init() for name in names}

  def apply(self, states, x, affine=(), *, eps: float, name=None):
    del name  # the tagged array would be the output's value, not what is kept
    if not self.has_affine:
      qy, out = quant.ms_norm_coded(self.inner.kind, x, eps, states["output"],
                                    groups=self.coder.groups,
                                    implementation=self.coder.implementation)
      return qy, {"output": out}
    qx, in_state = self.coder.code(states["input"], x)
    rule = functools.partial(_affine_norm, self.fn, float(eps), len(affine))
    y = quant.coded_vjp(rule, [qx], tuple(a for a in affine if a is not None))
    qy, out_state = self.coder.code(states["output"], y)
    return qy, {"input": in_state, "output": out_state}


def _attend(causal, implementation, block_k, dropout_rate, q, k, v, mask, dropout_key):
  return attention_lib.attention(q, k, v, causal=causal, mask=mask,
                                 implementation=implementation, block_k=block_k,
                                 dropout_rate=dropout_rate, dropout_key=dropout_key)


@dataclasses.dataclass(frozen=True)
class CodedAttention(Wrapper):
  """``inner``'s attention keeping head-wise codes of q, k and v; returns ``o`` (tagged
  ``attn_out``) carried with its head-wise code."""
  inner: Attention
  heads: Coder
  kv_heads: Coder

  def init_state(self):
    return {"query": self.heads.init(), "key": self.kv_heads.init(),
            "value": self.kv_heads.init(), "output": self.heads.init()}

  def apply(self, states, q, k, v, mask=None, *, dropout_rate: float = 0.0,
            dropout_key=None):
    updated = {}
    qq, updated["query"] = self.heads.code(states["query"], q)
    qk, updated["key"] = self.kv_heads.code(states["key"], k)
    qv, updated["value"] = self.kv_heads.code(states["value"], v)
    fn = functools.partial(_attend, self.inner.causal, self.inner.implementation,
                           self.inner.block_k, dropout_rate)
    # the dropout key is a constant of the rule: backward draws the same mask again
    o = quant.coded_vjp(fn, [qq, qk, qv], (), (mask, dropout_key))
    qo, updated["output"] = self.heads.code(states["output"], checkpoint_name(o, "attn_out"))
    return qo, updated


# ----------------------------------------------------------------------------- hooks
def _coder(policy, groups: int = 1, axis: int = -1) -> Coder:
  return Coder(groups, axis, policy.kernel_implementation())


def _shared(policy, inner, *, groups: int = 1, axis: int = -1, norm=None):
  if policy.quant == "none":
    return inner
  kept = norm is not None and policy.norm_strategy(norm).keeps_output
  return CodedShared(_coder(policy, groups, axis), kept)


def _activation(policy, inner, *, kind: str, gated: bool = False):
  if policy.quant == "none":
    return inner
  # An activation that already keeps fewer bits than a code (approx2: 2) stays as it is.
  # A gated product's backward needs act(g) and u as well: two codes are less than that.
  if not gated and inner.saved_bits is not None and inner.saved_bits <= policy.quant_bits:
    return inner
  return CodedActivation(inner, _coder(policy), policy.quant_bits)


def _hidden(policy, inner, *, kind: str, gated: bool = False):
  if policy.quant == "none" or not inner.recomputes:
    return inner
  # An activation keeping fewer bits than a code of its input (approx2 GELU: 2) keeps
  # them, and the last linear its output's code: a code of the input in their place
  # saves F / 4 bytes a token, and the 2-bit rule read at a dequantized input flips
  # where the input sits within a step of a threshold (CPU, tiny ViT under lowmem:
  # relative gradient error 0.14 against 0.026).
  if not isinstance(policy.activation_strategy(kind, gated=gated), CodedActivation):
    return KeepRun()
  return CodedHidden(_coder(policy), gated)


def _norm(policy, inner, *, kind: str):
  return inner if policy.quant == "none" else CodedNorm(inner, _coder(policy))


def _attention(policy, inner, *, num_heads=None, num_kv_heads=None, causal=False):
  if policy.quant == "none":
    return inner
  if num_heads is None:
    raise ValueError("Mesa attention codes q, k, v and o head-wise: pass num_heads "
                     "(and num_kv_heads) to MemoryPolicy.attention_strategy")
  kv = num_heads if num_kv_heads is None else num_kv_heads
  return CodedAttention(inner, _coder(policy, num_heads, axis=2), _coder(policy, kv, axis=2))


def _check_bits(value, extra):
  try:
    bits = int(value)
  except (TypeError, ValueError):
    raise ValueError(f"MemoryPolicy: quant_bits must be an integer, got {value!r}") from None
  check_choice("quant_bits", bits, BITS + extra)
  return bits


METHOD = Method(
    name="mesa",
    fields=(
        Field("quant", "none", "none | mesa (activations kept as codes with per-group EMA "
              "ranges, lowmem_jax.quant)", choices=QUANTS),
        Field("quant_bits", 8, "bits per code under quant=mesa (8: uint8 codes)",
              check=_check_bits),
    ),
    presets={"mesa8": {"quant": "mesa", "quant_bits": 8}},
    strategies={"shared": _shared, "activation": _activation, "norm": _norm,
                "attention": _attention, "hidden": _hidden},
    carriers={quant.QTensor: quant.coded_vjp},
)
