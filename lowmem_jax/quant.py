"""Mesa 8-bit activations (arXiv 2111.11124): ops that save uint8 codes for backward.

The forward is exact; what backward keeps of an activation is its 8-bit code
``clip(floor((x - lo) / scale + u), 0, 255)`` with ``scale = (hi - lo) / 255``, ``u``
uniform noise (stochastic rounding, unbiased inside ``[lo, hi]``), and backward runs on
``dequantize(code) = lo + code * scale``. Quantization is asymmetric and per group: the
tensor is viewed, for free, as ``[outer, G, inner]`` with contiguous groups along one
axis (head-wise for ``[B, N, H, D]``: axis 2, ``G = H``). ``lo``/``hi`` per group are an
EMA (decay 0.9) of each batch's min/max, the first batch taking its own; values outside
the range clamp to 0 / 255 (the reference code wraps modulo 256, a bug we do not copy).

Noise comes from an explicit PRNG key: the key gives a 32-bit seed and element ``i`` of
the flattened tensor gets ``u = hash(i, seed) / 2**24``, a counter-based hash (indices
wrap past 2**32 elements: the noise then repeats, it stays uniform). The hash and the
per-group step are defined here and imported by the kernels
(:mod:`pallas_kernels.quant`), so both compute them identically by construction.

Codes are made once per tensor (:func:`quantize_tensor` -> :class:`QTensor`) and shared
by every op that reads the tensor: q, k and v projections keep one code of their input,
not three. :func:`coded_vjp` runs any ``fn`` with exact forward and backward at the
dequantized inputs; :func:`ms_norm_coded` is MS-BP's norm whose one residual is the code
of its output, the same code the next linear keeps.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from lowmem_jax import dispatch, norms
from lowmem_jax.carried import Carried

DECAY = 0.9       # EMA decay of the per-group range
LEVELS = 255      # codes 0..255


# ----------------------------------------------------------------------------- layout
def group_view(shape: Sequence[int], axis: int, groups: int) -> tuple[int, int, int]:
  """``(outer, G, inner)``: the free 3-D view of a tensor with ``groups`` contiguous
  groups along ``axis``."""
  shape = tuple(int(d) for d in shape)
  if not shape:
    raise ValueError("quantize: expects at least one axis, got a scalar")
  if not -len(shape) <= axis < len(shape):
    raise ValueError(f"quantize: axis {axis} is out of bounds for shape {list(shape)}")
  axis = axis % len(shape)
  if groups < 1 or shape[axis] % groups:
    raise ValueError(f"quantize: {groups} groups do not divide axis {axis} of size "
                     f"{shape[axis]} (shape {list(shape)})")
  outer = math.prod(shape[:axis])
  return outer, groups, math.prod(shape[axis:]) // groups


def seed_of(key) -> jax.Array:
  """The uint32 seed of a PRNG key (typed or raw ``uint32[2]``)."""
  if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.wrap_key_data(key)
  return jax.random.bits(key, (), jnp.uint32)


# ----------------------------------------------------------------------------- noise, step
def _hash32(x):
  """lowbias32 on uint32 -> uint32, a well-mixed integer hash."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


GOLDEN = 0x9E3779B9  # the index multiplier of the hash's input (2**32 / golden ratio)


def _unit(bits):
  """The top 24 bits of uint32 ``bits`` as ``[0, 1)`` fp32."""
  return (bits >> 8).astype(jnp.float32) * jnp.float32(2.0 ** -24)


def uniform_noise(index, seed):
  """``[0, 1)`` fp32 noise (24 bits) of uint32 element indices and a seed,
  ``hash(index * GOLDEN + seed)``: the stochastic-rounding noise of this reference and of
  the kernels."""
  return _unit(_hash32(index.astype(jnp.uint32) * jnp.uint32(GOLDEN) + seed.astype(jnp.uint32)))


def view_noise(shape: Sequence[int], seed):
  """:func:`uniform_noise` of every element of an ``[O, G, I]`` view (flat index
  ``(o * G + g) * I + i``), the same bits, formed so that no array of the view's size
  is independent of ``seed``: ``index * GOLDEN`` is split (mod 2**32) into three per-axis
  vectors joined to the seed first. An array that depends on nothing in a scanned layer
  would be hoisted out of the scan by JAX and live through the whole loop as a uint32
  array per coded activation; this way the whole hash fuses into the quantize fusion.
  (A view with all its elements on one axis, ``[1, 1, N]``, still has one such vector.)"""
  o, g, i = (int(d) for d in shape)
  u32 = jnp.uint32

  def axis_term(size, axis, stride):
    dims = [1, 1, 1]
    dims[axis] = size
    coeff = u32(stride * GOLDEN % 2 ** 32)
    return jax.lax.broadcasted_iota(u32, tuple(dims), axis) * coeff

  key = jnp.asarray(seed, u32) + axis_term(o, 0, g * i)   # [O, 1, 1]
  key = key + axis_term(g, 1, i)                     # [O, G, 1]
  key = key + axis_term(i, 2, 1)                     # [O, G, I]
  return _unit(_hash32(key))


def group_step(lo, hi):
  """The per-group step ``(hi - lo) / 255`` (1e-30 for a flat range: codes all 0),
  rounded up to 16 significant bits, so ``code * step`` is exact in fp32 and a fused
  multiply-add changes nothing."""
  step = (hi - lo) / LEVELS
  step = jnp.where(step > 0, step, jnp.float32(1e-30))
  bits = jax.lax.bitcast_convert_type(step, jnp.uint32)
  return jax.lax.bitcast_convert_type((bits + 0xFF) & ~jnp.uint32(0xFF), jnp.float32)


# ----------------------------------------------------------------------------- reference
def quantize_reference(x3, lo, hi, seed):
  """``x3: [O, G, I]`` -> uint8 codes (plain jnp; the kernels' reference)."""
  # group_step keeps 16 significant bits: code * step is exact in fp32, so dequantized
  # values are the same bits whether or not XLA fuses ``code * step + lo`` into an FMA
  lo3, step = lo[None, :, None], group_step(lo, hi)[None, :, None]
  t = (x3.astype(jnp.float32) - lo3) / step + view_noise(x3.shape, seed)
  return jnp.clip(jnp.floor(t), 0, LEVELS).astype(jnp.uint8)


def dequantize_reference(codes3, lo, hi, dtype):
  """uint8 ``[O, G, I]`` codes -> values ``lo + code * scale`` in ``dtype``."""
  step = group_step(lo, hi)[None, :, None]
  return (codes3.astype(jnp.float32) * step + lo[None, :, None]).astype(dtype)


def _check_implementation(implementation):
  dispatch.check_implementation(implementation, "quantization")


def _on_group_view(reference, a, axis: int, groups: int, implementation: str, *args):
  """``reference`` (or its kernel, per ``implementation``) of ``a`` on its ``[O, G, I]``
  view, reshaped back to ``a``'s shape."""
  op = dispatch.implementation_of(reference, implementation, "quantization")
  return op(a.reshape(group_view(a.shape, axis, groups)), *args).reshape(a.shape)


def quantize(x, lo, hi, seed, *, axis: int = -1, groups: int = 1,
             implementation: str = "xla"):
  """Codes of ``x`` (uint8, x's shape) for per-group ranges ``lo``/``hi`` (fp32 ``[G]``)."""
  return _on_group_view(quantize_reference, x, axis, groups, implementation, lo, hi, seed)


def dequantize(codes, lo, hi, dtype, *, axis: int = -1, groups: int = 1,
               implementation: str = "xla"):
  """Values of uint8 ``codes`` in ``dtype``."""
  return _on_group_view(dequantize_reference, codes, axis, groups, implementation, lo, hi, dtype)


# ----------------------------------------------------------------------------- EMA range
def batch_range(x, *, axis: int = -1, groups: int = 1):
  """Per-group (min, max) of ``x`` in fp32, gradient-free. Reduced in ``x``'s dtype
  (exact: min and max only pick), only the ``[G]`` results cast: no fp32 copy of ``x``.
  One reduction yields both: XLA:GPU ran ``x.min()`` and ``x.max()`` as two kernels that
  each read all of ``x`` (compiled for an H100, ``docs/h100_compiled.md``)."""
  view = group_view(x.shape, axis, groups)
  x = jax.lax.stop_gradient(x)
  # one group: reduce x flat (a [O, 1, I] view gets a layout copy on XLA:CPU)
  x3, reduced = (x.reshape(-1), (0,)) if groups == 1 else (x.reshape(view), (0, 2))
  inf = jnp.array(jnp.inf, x.dtype)
  lo, hi = jax.lax.reduce((x3, x3), (inf, -inf), _min_max, reduced)
  return lo.astype(jnp.float32).reshape(groups), hi.astype(jnp.float32).reshape(groups)


def _min_max(a, b):
  return jax.lax.min(a[0], b[0]), jax.lax.max(a[1], b[1])


def ema_range(lo, hi, count, batch_lo, batch_hi, decay: float = DECAY):
  """``decay * old + (1 - decay) * batch``; the first update (count 0) takes the batch's."""
  first = count == 0
  new_lo = jnp.where(first, batch_lo, decay * lo + (1 - decay) * batch_lo)
  new_hi = jnp.where(first, batch_hi, decay * hi + (1 - decay) * batch_hi)
  return new_lo, new_hi


def _update_and_code(x, lo, hi, count, seed, *, axis, groups, implementation):
  """The EMA range updated with ``x``'s batch range, and ``x``'s codes under it:
  ``(codes, lo, hi)``."""
  lo, hi = ema_range(lo, hi, count, *batch_range(x, axis=axis, groups=groups))
  codes = quantize(jax.lax.stop_gradient(x), lo, hi, seed, axis=axis, groups=groups,
                   implementation=implementation)
  return codes, lo, hi


@dataclasses.dataclass(frozen=True)
class QuantState:
  """A quantization site's state, carried in the train state: per-group EMA range
  (fp32 ``[G]``), the number of updates so far, and the site's PRNG key data."""
  lo: jax.Array
  hi: jax.Array
  count: jax.Array
  key: jax.Array

  @classmethod
  def create(cls, groups: int = 1, key=None) -> "QuantState":
    key = jax.random.key(0) if key is None else key
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
      key = jax.random.key_data(key)
    return cls(jnp.zeros((groups,), jnp.float32), jnp.zeros((groups,), jnp.float32),
               jnp.zeros((), jnp.int32), jnp.asarray(key, jnp.uint32))

  def step_key(self):
    """This update's key: the site key folded with the update count."""
    return jax.random.fold_in(jax.random.wrap_key_data(self.key), self.count)


jax.tree_util.register_dataclass(QuantState, data_fields=["lo", "hi", "count", "key"],
                                 meta_fields=[])


# ----------------------------------------------------------------------------- QTensor
@dataclasses.dataclass(frozen=True)
class QTensor(Carried):
  """An activation with its 8-bit code: ops that read it save ``codes`` (not ``value``).

  A pytree (arrays as leaves, layout as static metadata), so it may cross ``jax.checkpoint``
  and other transformation boundaries, e.g. between rematted layers. ``kept``: its
  producer's backward keeps ``codes`` anyway (an MS norm's output), so a reader keeping
  them adds nothing; otherwise only its readers keep them.
  """
  value: jax.Array
  codes: jax.Array
  lo: jax.Array
  hi: jax.Array
  axis: int
  groups: int
  implementation: str = "xla"
  kept: bool = False

  def dequantized(self):
    """What backward sees: the codes' values in the activation's dtype."""
    return dequantize(self.codes, self.lo, self.hi, self.value.dtype, axis=self.axis,
                      groups=self.groups, implementation=self.implementation)


jax.tree_util.register_dataclass(QTensor, data_fields=["value", "codes", "lo", "hi"],
                                 meta_fields=["axis", "groups", "implementation", "kept"])


def quantize_tensor(x, state: QuantState, *, axis: int = -1, groups: int = 1,
                    implementation: str = "xla", kept: bool = False
                    ) -> tuple[QTensor, QuantState]:
  """Updates the site's EMA range with ``x``'s batch range and codes ``x`` with it;
  ``kept``: the QTensor's (``x`` stands where a value its producer keeps would)."""
  if state.lo.shape != (groups,):
    raise ValueError(f"quantize_tensor: state has {state.lo.shape[0]} groups, asked "
                     f"for {groups}")
  codes, lo, hi = _update_and_code(x, state.lo, state.hi, state.count,
                                   seed_of(state.step_key()), axis=axis, groups=groups,
                                   implementation=implementation)
  new_state = QuantState(lo, hi, state.count + 1, state.key)
  return QTensor(x, codes, lo, hi, axis % x.ndim, groups, implementation, kept), new_state


# ----------------------------------------------------------------------------- coded vjp
def coded_vjp(fn: Callable, quantized: Sequence[QTensor], diff_args: Sequence = (),
             const_args: Sequence = ()):
  """``fn(*values, *diff_args, *const_args)``, whose backward keeps the QTensors' codes.

  Residuals: the codes and per-group ranges of ``quantized``, ``diff_args`` (weights:
  they live anyway) and ``const_args`` (no gradient: masks). Backward dequantizes and
  takes ``jax.vjp(fn)`` there, so it recomputes ``fn``'s forward where its vjp needs it
  (a matmul's vjp needs none; an activation's is elementwise). ``fn`` must be hashable
  (a module-level function or ``functools.partial`` of one).
  """
  quantized, diff_args, const_args = tuple(quantized), tuple(diff_args), tuple(const_args)
  meta = tuple((q.axis, q.groups, q.implementation, q.value.dtype) for q in quantized)
  values = tuple(q.value for q in quantized)
  packs = tuple((q.codes, q.lo, q.hi) for q in quantized)
  return _coded_apply(fn, meta, values, diff_args, const_args, packs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _coded_apply(fn, meta, values, diff_args, const_args, packs):
  del meta, packs
  return fn(*values, *diff_args, *const_args)


def _coded_fwd(fn, meta, values, diff_args, const_args, packs):
  out = fn(*values, *diff_args, *const_args)
  return out, (diff_args, const_args, packs)


def _coded_bwd(fn, meta, res, g):
  diff_args, const_args, packs = res
  approx = tuple(
      dequantize(codes, lo, hi, dtype, axis=axis, groups=groups,
                 implementation=implementation)
      for (axis, groups, implementation, dtype), (codes, lo, hi) in zip(meta, packs))
  n = len(approx)
  _, vjp = jax.vjp(lambda *a: fn(*a, *const_args), *approx, *diff_args)
  grads = vjp(g)
  return (grads[:n], grads[n:], _zero_cotangents(const_args), _zero_cotangents(packs))


def _zero_cotangents(tree):
  def zero(x):
    if jnp.issubdtype(x.dtype, jnp.inexact):
      return jnp.zeros_like(x)
    return jnp.zeros(x.shape, jax.dtypes.float0)
  return jax.tree.map(zero, tree)


_coded_apply.defvjp(_coded_fwd, _coded_bwd)


# ----------------------------------------------------------------------------- MS norm
def ms_norm_coded(kind: str, x, eps: float, state: QuantState, *, groups: int = 1,
                 implementation: str = "xla") -> tuple[QTensor, QuantState]:
  """MS-LayerNorm / MS-RMSNorm (no affine) whose residuals are the uint8 code of its
  output ``y`` (the same code the next linears keep) and fp32 ``rstd`` per row."""
  if kind not in ("layer", "rms"):
    raise ValueError(f"unknown norm kind {kind!r}; valid: 'layer', 'rms'")
  _check_implementation(implementation)
  if state.lo.shape != (groups,):
    raise ValueError(f"ms_norm_coded: state has {state.lo.shape[0]} groups, asked for "
                     f"{groups}")
  seed = seed_of(state.step_key())
  y, codes, lo, hi = _ms_coded(kind, float(eps), groups, implementation, x, state.lo,
                              state.hi, state.count, seed)
  qt = QTensor(y, codes, lo, hi, x.ndim - 1, groups, implementation, kept=True)
  return qt, QuantState(lo, hi, state.count + 1, state.key)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _ms_coded(kind, eps, groups, implementation, x, lo, hi, count, seed):
  return _ms_coded_fwd(kind, eps, groups, implementation, x, lo, hi, count, seed)[0]


def _ms_coded_fwd(kind, eps, groups, implementation, x, lo, hi, count, seed):
  forward = dispatch.implementation_of(norms.ms_norm_forward, implementation, "norm")
  y, rstd = forward(kind, x, eps)
  codes, lo, hi = _update_and_code(y, lo, hi, count, seed, axis=-1, groups=groups,
                                   implementation=implementation)
  return (y, codes, lo, hi), (codes, lo, hi, rstd)


def _ms_coded_bwd(kind, eps, groups, implementation, res, cts):
  del eps
  codes, lo, hi, rstd = res
  g = cts[0]
  y = dequantize(codes, lo, hi, g.dtype, groups=groups, implementation=implementation)
  input_grad = dispatch.implementation_of(norms.ms_norm_input_grad, implementation, "norm")
  dx = input_grad(kind, g, y, rstd)
  return (dx, jnp.zeros_like(lo), jnp.zeros_like(hi),
          jnp.zeros((), jax.dtypes.float0), jnp.zeros((), jax.dtypes.float0))


_ms_coded.defvjp(_ms_coded_fwd, _ms_coded_bwd)
