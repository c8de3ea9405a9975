"""WTA-CRS (arXiv 2305.15265) as a policy method: ``sampled_linear="wta-crs"``.

The linears named in ``sample_targets`` (attribute names in our blocks, see
:data:`LINEAR_NAMES`) take their weight gradient from ``sample_ratio`` of the token rows
and save only those rows (:mod:`lowmem_jax.sampling`). One sample per activation, shared
by all its readers, as Mesa codes an activation once: a norm returns its output carried
as a :class:`~lowmem_jax.sampling.SampledTensor` (:class:`SampledNorm`), an activation
read through a shared site (the MLP's hidden state) is carried there
(:class:`SampledShared`), so q, k and v (fc1; gate and up) keep ONE ``[k, D]`` buffer of
rows, one ``idx`` and one ``scale``, not three. Each reader's ``dW`` is the estimator on
those rows: unbiased, as a lone sampled linear's. A sampled linear reading a plain input
(``out`` reads the attention's ``o``, when named) samples it itself. Every sampler has state,
a :class:`~lowmem_jax.sampling.KeyState` (its key and call count, and the gradient-norm
cache when the trainer attaches one: the readers' squared output-gradient norms summed,
the optimal ``p_i ~ ||x_i|| sqrt(sum_r ||g_ri||^2)`` for one shared sample).

Under MS norms (``lowmembp+wta-crs``) a norm keeps its output for its own backward, so
its readers' ``dW`` are exact from that buffer at no cost: the norm carries its output
whole (:class:`WholeNorm`), unsampled; only the other activations are sampled (the MLP's
hidden state). Sampling it anyway kept more than ``lowmembp`` alone on XLA:GPU (ViT-B
LoRA: the rows beside the kept output, and the sampled backward's transients).

A frozen kernel (LoRA's base, and every linear that does not train: ``train.model``
freezes them) has no weight gradient to estimate, so it is never sampled;
it reads the carried value keeping nothing of it (:func:`read_sampled`). Under LoRA the
trained linear reading the layer input is the adapter's ``A`` (:mod:`models.lora` gives
it the base's site), so ``dA`` is the one sampled, with ``A``'s output cotangent
``scale * g B^T`` in place of ``g``. Heads and embeddings are never sampled.

With Mesa (``mesa8+wta-crs``) both would carry the same activation: Mesa's code stays the
carrier. Where its producer keeps the code anyway (an MS norm's output, ``QTensor.kept``:
what q, k, v, fc1, gate and up read under ``lowmem``), a sampled linear reading it is the
exact linear on that code, as under :class:`WholeNorm`. Elsewhere (an activation coded
for its readers only: under LoRA the frozen base keeps nothing, so fc2's and down's
input is kept for the adapter alone) it draws its sample of the value (its own key, as a
linear reading a plain input) and keeps only the ``k`` sampled rows of the code, gathered
in forward, with their indices and scales. Backward dequantizes those rows
(:func:`code_rows`): ``dW`` is the estimator on the rows Mesa's backward sees, unbiased
for Mesa's ``dW``. So the combination keeps Mesa's memory less 0.7 of the codes that only
sampled readers keep, plus ``8k`` bytes per such reader (the weights are kept as given:
no cast copy).
Preset ``wta-crs``.

Measured (CPU, jax 0.10.2, bf16 compute, fp32 parameters: the config's): MiniLM (6
layers, D 384, F 1536) minilm-text, batch 16 x 64, LoRA r8 on query, key, value, out,
fc1, fc2; the whole train step (``python -m train.bench --config-name minilm-text --set
trainable=lora --set lora_targets=query,key,value,out,fc1,fc2 --set lora_rank=8
--compile-only --live``). MiB: ``peak``: the most distinct bytes live at any point of the
step's schedule (:func:`lowmem_jax.memory.peak_buffers`, arguments included); ``temp``:
the compiled temp allocation. Each combination keeps no more than either of its parts:

=================  =====  =====  ============
policy              peak   temp  peak vs LoRA
=================  =====  =====  ============
baseline           278.6  191.4  1
wta-crs            238.7  148.7  0.86
lowmembp           235.9  148.7  0.85
lowmembp+wta-crs   210.7  120.5  0.76
mesa8              171.1   83.9  0.61
mesa8+wta-crs      161.8   71.6  0.58
lowmem             162.1   74.9  0.58
lowmem+wta-crs     155.8   65.6  0.56
=================  =====  =====  ============

Per token per layer, what is kept (D = 384, F = 1536; post-LN BERT): attention q, k, v,
o (4D, whatever the policy); the two LayerNorms' inputs (2D; MS norms: their outputs);
the GELU input (F; approx2: F/16 in fp32 terms); for the adapters' ``dA``: the layer
input (D, shared by q/k/v) + the attention norm's output (D, fc1) + the GELU output (F,
fc2) = 8D + 2F without sampling, 6D + F + 0.3 (2D + F) = 6.6D + 1.3F with (``out``'s
rows of ``o`` would add 0.3D to what attention keeps: ``out`` is not sampled by
default). So WTA-CRS alone removes at most the readers' 2D + F of 8D + 2F (37% of the
activation memory; 26% at k = 0.3 rows), and less of the peak, which also holds the
parameters and backward's transients: 30% below LoRA's peak is out of its reach on
post-LN BERT. With lowmembp the GELU keeps a 2-bit code (F/16) and the MS norms keep their
outputs, which q, k, v and fc1 read whole (:class:`WholeNorm`): 6D + 0.36F. (Sampling
those outputs too measured 205.0 MiB here on the CPU, 5.7 less, but on XLA:GPU for ViT-B
LoRA it kept 188 MiB more than lowmembp alone: ``docs/h100_compiled.md``.)
"""

from __future__ import annotations

import dataclasses
import functools
import math

from lowmem_jax import quant, sampling
from lowmem_jax.baseline import Norm, NormWrapper, Shared, keep_inputs
from lowmem_jax.methods import Field, Method, Strategy, check_choice, read, value_of
from lowmem_jax.sampling import SampledTensor

SAMPLED_LINEARS = ("none", "wta-crs")
LINEAR_NAMES = ("query", "key", "value", "out", "fc1", "fc2", "gate", "up", "down")
# Sampled by default: all but ``out``, whose input ``o`` the attention keeps anyway (flash:
# q, k, v, o, lse), so its rows would add memory (0.3D per token) for a noisier dW:
# measured 240.3 -> 237.8 MiB on the MiniLM LoRA step below.
DEFAULT_TARGETS = tuple(name for name in LINEAR_NAMES if name != "out")


@dataclasses.dataclass(frozen=True)
class Sampler:
  """Draws the rows of an activation that its readers keep: ``ratio`` of them, with the
  row weights of the site's gradient-norm cache when the trainer attached one. ``lean``:
  how readers that do not sample keep the value (:class:`~lowmem_jax.sampling.SampledTensor`)."""
  ratio: float
  lean: bool

  def sample(self, state: sampling.KeyState, x):
    """``(x carried with its sample, updated state)``."""
    weights = sampling.row_weights(state, x.shape[:-1])
    sample = sampling.sample_tensor(x, state.step_key(), ratio=self.ratio,
                                    row_weights=weights, lean=self.lean)
    return sample, state.advanced()


@dataclasses.dataclass(frozen=True)
class SampledShared(Strategy):
  """An activation read by linears, carried with one sample of its rows, which each
  sampled reader keeps (one ``[k, in]`` buffer for all). One that arrives carried
  (sampled by its producer, a norm) passes."""
  sampler: Sampler

  def init_state(self):
    return {"sampler": sampling.KeyState.create()}

  def apply(self, states, x):
    if value_of(x) is not x:
      return x, {}
    sample, state = self.sampler.sample(states["sampler"], x)
    return sample, {"sampler": state}


@dataclasses.dataclass(frozen=True)
class WholeShared(Strategy):
  """An activation standing where an MS norm's output would (the embeddings entering a
  post-LN stack of them), carried whole as :class:`WholeNorm` carries that output: its
  readers keep it whole, one buffer for all, and their ``dW`` are exact."""
  lean: bool

  def __call__(self, x):
    return x if value_of(x) is not x else SampledTensor.whole(x, self.lean)


@dataclasses.dataclass(frozen=True)
class SampledNorm(NormWrapper):
  """``inner``'s norm returning its output carried with one sample of its rows (what
  the sampled linears reading it keep), so that every block input, a norm's output or
  the embeddings', arrives in one form (a block stack's scan carry)."""
  inner: Norm
  sampler: Sampler

  def init_state(self):
    return {"sampler": sampling.KeyState.create()}

  def apply(self, states, x, affine=(), *, eps: float, name=None):
    y = self.inner(x, affine, eps=eps, name=name)
    sample, state = self.sampler.sample(states["sampler"], y)
    return sample, {"sampler": state}


@dataclasses.dataclass(frozen=True)
class WholeNorm(NormWrapper):
  """``inner``'s norm, which keeps its output for its own backward (an MS norm,
  ``keeps_output``), returning it carried whole
  (:meth:`~lowmem_jax.sampling.SampledTensor.whole`): its sampled readers' ``dW`` are
  exact from the buffer the norm keeps anyway; a sample's rows would only add memory
  and noise. Carried, not plain, so that sampled readers know not to sample it and
  every block input arrives in one form (a block stack's scan carry)."""
  inner: Norm
  lean: bool

  def __call__(self, x, affine=(), *, eps: float, name=None):
    return SampledTensor.whole(self.inner(x, affine, eps=eps, name=name), self.lean)


@dataclasses.dataclass(frozen=True)
class SampledLinear(Strategy):
  """``dense``'s function with a WTA-CRS weight gradient. Reading a
  :class:`~lowmem_jax.sampling.SampledTensor`, it keeps the rows carried (shared with
  the other readers), their indices and scales, and the kernel. Reading Mesa's
  :class:`~lowmem_jax.quant.QTensor`, it draws ``k`` rows of the value with its own key
  and keeps those rows of the code, gathered in forward, with their indices and scales:
  backward dequantizes them. Reading a plain input it samples ``k`` rows of the value
  and keeps them. Reading a value its producer keeps anyway (an MS norm's output:
  carried whole, or a code with ``kept``), it is the exact linear on what the producer
  keeps: a sample would only add memory and noise."""
  ratio: float

  def init_state(self):
    return {"sampler": sampling.KeyState.create()}

  def apply(self, states, dense, x, kernel, bias, *, contract: int):
    rows = math.prod(value_of(x).shape[:value_of(x).ndim - contract])
    if (isinstance(x, SampledTensor) and x.is_whole) or (isinstance(x, quant.QTensor)
                                                         and (x.kept or not rows)):
      return read(dense, [x], (kernel,) if bias is None else (kernel, bias)), {}
    # dense casts to its compute dtype: the activation here, the weights inside the rule
    # (which keeps them as given, not a cast copy)
    value = value_of(x).astype(dense.dtype)
    if isinstance(x, SampledTensor):
      if contract != 1:
        raise ValueError(f"SampledLinear: a shared sample is of rows of [..., in]; this "
                         f"linear contracts {contract} axes")
      return sampling.sampled_linear(value, kernel, bias, x), {}
    state = states["sampler"]
    weights = sampling.row_weights(state, value.shape[:value.ndim - contract])
    if isinstance(x, quant.QTensor):
      idx, scale = sampling.select(value, state.step_key(), ratio=self.ratio,
                                   row_weights=weights, contract_ndim=contract)
      rows, rows_of = _sampled_code(x, contract, idx)
      y = sampling.linear_on_sample(value, kernel, bias, rows, rows_of, idx, scale,
                                    row_weights=weights, contract_ndim=contract)
    else:
      y = sampling.wta_crs_linear(value, kernel, bias, state.step_key(), ratio=self.ratio,
                                  contract_ndim=contract, row_weights=weights)
    return y, {"sampler": state.advanced()}


def code_rows(axis, groups, implementation, dtype, code, idx):
  """The sampled rows (``[k, in]``, ``dtype``) of an activation from ``code``: ``(rows
  [k, *in_dims], lo, hi)``, rows ``idx`` of Mesa's codes (``groups`` along ``axis`` of a
  row), gathered in forward. The values are the ones Mesa's backward sees
  (:meth:`lowmem_jax.quant.QTensor.dequantized`), rows ``idx``."""
  del idx
  rows, lo, hi = code
  rows = quant.dequantize(rows, lo, hi, dtype, axis=axis, groups=groups,
                          implementation=implementation)
  return rows.reshape(rows.shape[0], -1)


def _sampled_code(qt: quant.QTensor, contract: int, idx):
  """What a sampled linear reading ``qt`` (contracting its trailing ``contract`` axes)
  keeps: rows ``idx`` of the code with the ranges, and the :func:`code_rows` that
  dequantizes them. The code's groups must lie inside a row."""
  lead_ndim = qt.codes.ndim - contract
  if qt.groups == 1:
    axis = -1
  elif qt.axis >= lead_ndim:
    axis = qt.axis - lead_ndim + 1
  else:
    raise ValueError(f"SampledLinear: the code's {qt.groups} groups lie along axis "
                     f"{qt.axis}, across the rows of this linear's input (it contracts "
                     f"the last {contract} of {qt.codes.ndim} axes); sample another linear")
  in_dims = tuple(qt.codes.shape[lead_ndim:])
  rows = qt.codes.reshape(-1, math.prod(in_dims))[idx].reshape((idx.shape[0],) + in_dims)
  return ((rows, qt.lo, qt.hi),
          functools.partial(code_rows, axis, qt.groups, qt.implementation, qt.value.dtype))


def read_sampled(fn, inputs, diff_args=(), const_args=()):
  """The carrier rule of :class:`~lowmem_jax.sampling.SampledTensor` for ops that do not
  sample (a frozen LoRA base, a head, a residual affine): ``fn`` of the values, keeping
  what it keeps of a plain input (lean: under ``keep_inputs``, casts redone in backward)."""
  lean = all(x.lean for x in inputs)
  values = [x.value for x in inputs]
  return (keep_inputs(fn) if lean else fn)(*values, *diff_args, *const_args)


# ----------------------------------------------------------------------------- hooks
def _sampler(policy) -> Sampler:
  # readers that do not sample keep the value as the policy's plain linear keeps its input
  return Sampler(policy.sample_ratio, policy.linear_strategy().lean)


def _shared(policy, inner, *, groups: int = 1, axis: int = -1, norm=None):
  # Only where the activation is kept as it is: another method's carrier (Mesa's code)
  # stays, and its sampled readers each draw a sample of the value and keep the code.
  if policy.sampled_linear == "none" or not isinstance(inner, Shared):
    return inner
  if norm is not None and policy.norm_strategy(norm).keeps_output:
    return WholeShared(_sampler(policy).lean)  # in the form such a norm's output is
  return SampledShared(_sampler(policy))


def _norm(policy, inner, *, kind: str):
  if policy.sampled_linear == "none" or not isinstance(inner, Norm):
    return inner
  if inner.keeps_output:
    return WholeNorm(inner, _sampler(policy).lean)
  return SampledNorm(inner, _sampler(policy))


def _linear(policy, inner, *, name=None, frozen=False):
  if policy.sampled_linear == "none" or frozen or name not in policy.sample_targets:
    return inner
  return SampledLinear(policy.sample_ratio)


def _check_ratio(value, extra):
  try:
    ratio = float(value)
  except (TypeError, ValueError):
    raise ValueError(f"MemoryPolicy: sample_ratio must be a number, got {value!r}") from None
  if not 0.0 < ratio <= 1.0:
    raise ValueError(f"MemoryPolicy: sample_ratio must be in (0, 1], got {ratio}")
  return ratio


def _check_targets(value, extra):
  targets = value
  if isinstance(targets, str):
    targets = tuple(t.strip() for t in targets.split(",") if t.strip())
  targets = tuple(targets)
  if not targets:
    raise ValueError("MemoryPolicy: sample_targets is empty; name at least one of "
                     f"{', '.join(LINEAR_NAMES)}")
  for name in targets:
    check_choice("linear in sample_targets", name, LINEAR_NAMES)
  return tuple(n for n in LINEAR_NAMES if n in targets)  # one spec for one set of linears


def check_not_recomputed(policy, field: str, linears) -> None:
  """Raises where ``field=recompute`` (a site running ``linears`` inside a recomputed
  function) meets WTA-CRS sampling one of them: a sampler updates its key in forward,
  which a recomputed function cannot."""
  if getattr(policy, field) != "recompute" or policy.sampled_linear == "none":
    return
  sampled = sorted(set(policy.sample_targets) & set(linears))
  if sampled:
    raise ValueError(f"MemoryPolicy: {field}=recompute cannot recompute sampled linears "
                     f"({', '.join(sampled)}: WTA-CRS updates their keys in forward); "
                     f"drop them from sample_targets or use {field}=keep")


def _check(policy):
  if policy.sampled_linear == "none":
    for field in ("sample_ratio", "sample_targets"):
      if getattr(policy, field) != policy.default(field):
        raise ValueError(f"MemoryPolicy: {field} is set but sampled_linear is 'none'; "
                         "add 'wta-crs' to the spec")


METHOD = Method(
    name="wta-crs",
    fields=(
        Field("sampled_linear", "none", "none | wta-crs (weight gradients of the "
              "sample_targets linears from sample_ratio of the token rows)",
              choices=SAMPLED_LINEARS),
        Field("sample_ratio", sampling.DEFAULT_RATIO, "the fraction of rows WTA-CRS keeps",
              check=_check_ratio),
        Field("sample_targets", DEFAULT_TARGETS, "the linears WTA-CRS samples, by attribute "
              "name", check=_check_targets),
    ),
    presets={"wta-crs": {"sampled_linear": "wta-crs"}},
    strategies={"shared": _shared, "norm": _norm, "linear": _linear},
    check=_check,
    carriers={SampledTensor: read_sampled},
)
