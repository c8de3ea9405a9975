"""Frozen kernels stored in less memory: ``bfloat16``, ``int8`` or ``nf4``, dequantized
inside the matmul.

A kernel ``[lead..., in..., out...]`` (``lead``: the layer axis of a stacked model) is
stored as a :class:`QuantizedKernel`, a pytree whose array leaves all keep ``lead``
(so ``lax.scan`` over a block stack slices them like any parameter):

* ``bfloat16``: the kernel cast (round to nearest even): relative error <= 2^-8.
* ``int8``: symmetric per output column, ``scale = absmax / 127`` over the inputs,
  ``q = round(w / scale)``: ``|err| <= scale / 2 = absmax / 254``.
* ``nf4`` (QLoRA, arXiv 2305.14314): per output column, blocks of 64 inputs (``in``
  flattened, zero-padded to a multiple of 64), ``absmax`` per block in fp32, each weight
  the nearest of the 16 NF4 levels times ``absmax``: ``|err| <= absmax * gap / 2`` with
  ``gap`` the largest distance between adjacent levels. Two 4-bit indices per uint8:
  input row ``2j`` in the low nibble, ``2j + 1`` in the high one (bitsandbytes puts the
  first in the high nibble; we do not share its storage).
* ``nf4-dq``: ``nf4`` with its absmax scales minus their mean stored int8 blockwise
  (blocks of 256, symmetric absmax): QLoRA's "double quantization", with a linear 8-bit
  code where bitsandbytes uses its dynamic map. One name for the whole storage, as
  ``base_dtype`` takes it: no flag can ask for an int8 kernel double-quantized.

A table (an embedding ``[V, D]``) is stored with ``n_in=1, n_out=0``: each row a lead
index, its ``D`` values the inputs, so int8 has one scale per row and nf4 blocks run
along the row; :func:`take_rows` gathers rows in the stored form.

:func:`quantize` / :func:`dequantize` are the plain-jnp reference. :func:`frozen_dense`
is the matmul with such a kernel (or, ``transposed``, with a table: ``x @ E^T``, a tied
LM head): it dequantizes to the compute dtype inside the op and saves only the stored
kernel (resident anyway) for backward, which dequantizes again for ``dx = g W^T``: no
dequantized copy is kept between forward and backward, and there is no weight gradient
(the kernel is frozen).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

# Storage names: float32 is kept as it is (no QuantizedKernel); nf4-dq is nf4 with its
# absmax scales double-quantized (a QuantizedKernel of format "nf4", ``scale`` None).
FORMATS = ("float32", "bfloat16", "int8", "nf4", "nf4-dq")
NF4_BLOCK = 64     # inputs per absmax block (QLoRA)
SCALE_BLOCK = 256  # absmax values per block of the double quantization (QLoRA)
# The 16 NF4 levels, exactly as bitsandbytes' csrc/kernels.cu (dDequantizeNF4) has them:
# quantiles of N(0, 1) normalised to [-1, 1], with an exact 0.
NF4_LEVELS = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], np.float32)
NF4_MAX_GAP = float(np.max(np.diff(NF4_LEVELS)))  # 1 - 0.6961928 (the bottom gap)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedKernel:
  """A frozen kernel in ``format``; ``tail`` is its logical shape without lead axes
  (``in... + out...``), ``n_in`` how many of those are inputs.

  ``data``: bf16 kernel | int8 values (kernel-shaped) | uint8 NF4 index pairs
  ``[lead, Kp/2, N]``. ``scale``: int8: fp32 ``[lead, out...]``; nf4: fp32 absmax
  ``[lead, Kp/64, N]`` (None when double-quantized). Double quantization: ``scale_codes``
  int8 ``[lead, Mp]``, ``scale_scale`` fp32 ``[lead, Mp/256]``, ``scale_offset`` fp32
  ``[lead]``."""
  data: jax.Array
  scale: jax.Array | None = None
  scale_codes: jax.Array | None = None
  scale_scale: jax.Array | None = None
  scale_offset: jax.Array | None = None
  format: str = dataclasses.field(default="bfloat16", metadata=dict(static=True))
  tail: tuple = dataclasses.field(default=(), metadata=dict(static=True))
  n_in: int = dataclasses.field(default=1, metadata=dict(static=True))

  @property
  def lead(self) -> tuple:
    stored = 2 if self.format == "nf4" else len(self.tail)
    return tuple(self.data.shape[:self.data.ndim - stored])

  @property
  def shape(self) -> tuple:
    """The logical (dequantized) shape: ``lead + tail``."""
    return self.lead + tuple(self.tail)

  @property
  def dtype(self):
    """The logical dtype: the fp32 kernel it stands for."""
    return jnp.dtype(jnp.float32)

  @property
  def nbytes(self) -> int:
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(self))

  @property
  def storage(self) -> str:
    """The storage name (:data:`FORMATS`) this kernel was made with."""
    return "nf4-dq" if self.format == "nf4" and self.scale is None else self.format

  def __getitem__(self, key):
    # ``variable[...]`` (nnx) reads the whole value; a kernel is not indexed otherwise
    if key is not Ellipsis:
      raise TypeError(f"QuantizedKernel: only [...] reads it, got [{key!r}]")
    return self


def _split(w, n_in: int, n_out: int):
  """``w [lead, in..., out...]`` as ``[lead, K, N]``, with ``lead``, ``tail``."""
  lead_nd = w.ndim - n_in - n_out
  if lead_nd < 0:
    raise ValueError(f"quantize: a kernel with {n_in} input and {n_out} output axes needs "
                     f"ndim >= {n_in + n_out}, got shape {w.shape}")
  lead, tail = w.shape[:lead_nd], w.shape[lead_nd:]
  k, n = math.prod(tail[:n_in]), math.prod(tail[n_in:])
  return w.reshape(lead + (k, n)), tuple(lead), tuple(tail)


def _pad_axis(x, axis: int, multiple: int):
  pad = -x.shape[axis] % multiple
  if not pad:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths)


def _absmax_int8(x, axis: int):
  """Symmetric int8 of ``x`` along ``axis``: ``(q int8, scale fp32)``, ``q * scale ~ x``."""
  scale = jnp.max(jnp.abs(x), axis=axis, keepdims=True) / 127.0
  q = jnp.round(jnp.where(scale > 0, x / jnp.where(scale > 0, scale, 1.0), 0.0))
  return jnp.clip(q, -127, 127).astype(jnp.int8), scale


def quantize(w, format: str, *, n_in: int = 1, n_out: int = 1) -> QuantizedKernel:
  """``w [lead..., in..., out...]`` (fp32) stored in ``format`` (:data:`FORMATS` but
  float32). Jitted: one compile per shape."""
  if format not in FORMATS[1:]:
    raise ValueError(f"quantize: format={format!r} is not one of {', '.join(FORMATS[1:])}")
  w = jnp.asarray(w, jnp.float32)
  if format != "bfloat16" and not isinstance(w, jax.core.Tracer):
    # absmax scaling has no place for inf or NaN: it would spread to the weight's whole
    # block (nf4), column (int8) or kernel (nf4-dq's scale offset), and flip +inf's sign
    bad = int(w.size - jnp.count_nonzero(jnp.isfinite(w)))
    if bad:
      raise ValueError(f"quantize: {bad} of {w.size} weights are inf or NaN, which "
                       f"{format} cannot store")
  double_quant = format == "nf4-dq"
  return _quantize(w, "nf4" if double_quant else format, n_in,
                   n_out, double_quant)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _quantize(w, format, n_in, n_out, double_quant):
  flat, lead, tail = _split(w, n_in, n_out)
  meta = dict(format=format, tail=tail, n_in=n_in)
  if format == "bfloat16":
    return QuantizedKernel(w.astype(jnp.bfloat16), **meta)
  if format == "int8":
    q, scale = _absmax_int8(flat, axis=-2)
    return QuantizedKernel(q.reshape(w.shape), scale.reshape(lead + tail[n_in:]), **meta)
  blocks = _pad_axis(flat, -2, NF4_BLOCK)
  kp, n = blocks.shape[-2:]
  blocks = blocks.reshape(lead + (kp // NF4_BLOCK, NF4_BLOCK, n))
  absmax = jnp.max(jnp.abs(blocks), axis=-2, keepdims=True)
  normed = jnp.where(absmax > 0, blocks / jnp.where(absmax > 0, absmax, 1.0), 0.0)
  mids = jnp.asarray((NF4_LEVELS[1:] + NF4_LEVELS[:-1]) / 2)
  index = jnp.sum(normed[..., None] > mids, axis=-1).astype(jnp.uint8)  # nearest level
  pairs = index.reshape(lead + (kp // 2, 2, n))
  codes = pairs[..., 0, :] | (pairs[..., 1, :] << 4)
  absmax = absmax[..., 0, :]
  if not double_quant:
    return QuantizedKernel(codes, absmax, **meta)
  scales = absmax.reshape(lead + (-1,))
  offset = jnp.mean(scales, axis=-1)
  padded = _pad_axis(scales - offset[..., None], -1, SCALE_BLOCK)
  q, s = _absmax_int8(padded.reshape(lead + (-1, SCALE_BLOCK)), axis=-1)
  return QuantizedKernel(codes, None, q.reshape(lead + (-1,)), s[..., 0], offset, **meta)


def nf4_absmax(k: QuantizedKernel):
  """The fp32 absmax scales ``[lead, Kp/64, N]`` of an nf4 kernel (double-quantized ones
  dequantized first)."""
  if k.scale is not None:
    return k.scale
  lead = k.lead
  q = k.scale_codes.reshape(lead + (-1, SCALE_BLOCK)).astype(jnp.float32)
  scales = (q * k.scale_scale[..., None]).reshape(lead + (-1,)) + k.scale_offset[..., None]
  kp = -(-math.prod(k.tail[:k.n_in]) // NF4_BLOCK)
  n = math.prod(k.tail[k.n_in:])
  return scales[..., :kp * n].reshape(lead + (kp, n))


def take_rows(k: QuantizedKernel, ids) -> QuantizedKernel:
  """The rows ``ids`` (integers, any shape) of a table's single lead axis, in the stored
  form: ``dequantize(take_rows(k, ids))`` is ``dequantize(k)[ids]`` without dequantizing
  the rest. No gradient flows to the table (frozen)."""
  if len(k.lead) != 1:
    raise ValueError(f"take_rows: a table has one lead (row) axis, got lead {k.lead}")
  ids = jnp.asarray(ids)
  return jax.tree.map(lambda x: jax.lax.stop_gradient(jnp.take(x, ids, axis=0)), k)


def dequantize(k: QuantizedKernel, dtype=jnp.float32):
  """The kernel ``[lead..., in..., out...]`` in ``dtype`` (computed in fp32, then cast)."""
  lead, tail = k.lead, tuple(k.tail)
  if k.format == "bfloat16":
    return k.data.astype(dtype)
  if k.format == "int8":
    scale = k.scale.reshape(lead + (1,) * k.n_in + tail[k.n_in:])
    return (k.data.astype(jnp.float32) * scale).astype(dtype)
  codes = k.data
  pairs = jnp.stack([codes & 15, codes >> 4], axis=-2)  # [lead, Kp/2, 2, N]
  kp, n = 2 * codes.shape[-2], codes.shape[-1]
  values = jnp.asarray(NF4_LEVELS)[pairs.reshape(lead + (kp // NF4_BLOCK, NF4_BLOCK, n))]
  w = values * nf4_absmax(k)[..., None, :]
  w = w.reshape(lead + (kp, n))[..., :math.prod(tail[:k.n_in]), :]
  return w.reshape(lead + tail).astype(dtype)


# ----------------------------------------------------------------------------- the matmul
def _dot(x, w, contract: int, preferred, transposed: bool = False):
  """``x``'s trailing ``contract`` axes with ``w``'s leading ones (``transposed``: its
  trailing ones: ``w`` is ``[out..., in...]``)."""
  w_axes = range(w.ndim - contract, w.ndim) if transposed else range(contract)
  axes = (tuple(range(x.ndim - contract, x.ndim)), tuple(w_axes))
  return jax.lax.dot_general(x, w, (axes, ((), ())), preferred_element_type=preferred)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _frozen_dense(contract, dtype, preferred, transposed, x, kernel):
  return _dot(x.astype(dtype), dequantize(kernel, dtype), contract, preferred, transposed)


def _frozen_dense_fwd(contract, dtype, preferred, transposed, x, kernel):
  y = _frozen_dense(contract, dtype, preferred, transposed, x, kernel)
  # the stored kernel only (resident anyway) and an empty array for x's dtype
  return y, (kernel, jnp.zeros((0,), x.dtype))


def _frozen_dense_bwd(contract, dtype, preferred, transposed, res, g):
  kernel, x_like = res
  w = dequantize(kernel, dtype)
  n_out = w.ndim - contract
  w_out = range(n_out) if transposed else range(contract, w.ndim)
  axes = (tuple(range(g.ndim - n_out, g.ndim)), tuple(w_out))
  dx = jax.lax.dot_general(g.astype(dtype), w, (axes, ((), ())),
                           preferred_element_type=preferred)
  return dx.astype(x_like.dtype), None  # the kernel is frozen: no gradient


_frozen_dense.defvjp(_frozen_dense_fwd, _frozen_dense_bwd)


def frozen_dense(x, kernel: QuantizedKernel, *, contract: int, dtype, preferred=None,
                 transposed: bool = False):
  """``x`` contracted (``contract`` trailing axes) with ``dequantize(kernel, dtype)``;
  ``transposed``: with its trailing axes, the kernel a table ``[out, in...]`` (a tied
  LM head ``h @ E^T``). Saves the stored kernel only; backward dequantizes it again for
  ``dx``; no weight gradient."""
  if kernel.lead and not transposed:
    raise ValueError(f"frozen_dense: a stacked kernel (lead axes {kernel.lead}) is used "
                     "one layer at a time")
  return _frozen_dense(contract, jnp.dtype(dtype),
                       None if preferred is None else jnp.dtype(preferred), bool(transposed),
                       x, kernel)


def frozen_dense_reference(x, kernel: QuantizedKernel, *, contract: int, dtype,
                           preferred=None, transposed: bool = False):
  """:func:`frozen_dense` by plain autodiff (keeps the dequantized kernel: tests only)."""
  w = jax.lax.stop_gradient(dequantize(kernel, dtype))
  return _dot(x.astype(dtype), w, contract, preferred, transposed)
