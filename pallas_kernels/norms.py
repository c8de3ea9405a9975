"""Fused MS-LayerNorm / MS-RMSNorm kernels: one row per program, any hidden size.

Mirrors :mod:`lowmem_jax.norms`: ``ms_norm_forward`` / ``ms_norm_input_grad`` take their
references' arguments (plus keyword-only ``interpret`` and ``max_block``). Forward reads
x and writes ``y`` (x's dtype) and fp32 ``rstd`` per row. Backward reads g, y and rstd
and writes dx (``rstd * (g - mean(g) - y * mean(g * y))`` for LayerNorm, without the
``mean(g)`` term for RMSNorm). A row is processed in power-of-two column blocks with
masks, so the hidden size need not be a power of two; a row that fits one block is read
once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from lowmem_jax.norms import check_kind
from pallas_kernels import layout

MAX_BLOCK = 8192  # columns per load


def _block(cols: int, max_block: int) -> int:
  """Columns per load: Triton's ranges are powers of two."""
  if max_block < 1 or max_block & (max_block - 1):
    raise ValueError(f"max_block must be a power of two >= 1, got {max_block}")
  return min(pl.next_power_of_2(cols), max_block)


def _columns(k, block, cols):
  """Column block ``k``'s column indices and their mask (the columns before the row's
  end). Indices, not a ``pl.ds`` slice: jax >= 0.12 refuses a slice that a concrete
  start puts past the array's end, even under a mask (a one-block row: k = 0), and a
  masked block past a row's end is how these kernels read a row of any width."""
  idx = k * block + jnp.arange(block)
  return idx, idx < cols


def _load(ref, row, idx, mask):
  """``row``'s columns ``idx`` as fp32, zeros where ``mask`` is off (past the row's end)."""
  x = plgpu.load(ref.at[row, idx], mask=mask, other=0)
  return jnp.where(mask, x.astype(jnp.float32), 0.0)


def _row_sums(refs, row, cols, block, fn, count):
  """The ``count`` row sums of ``fn(mask, *blocks)`` (fp32), block by block."""

  def block_terms(k):
    idx, mask = _columns(k, block, cols)
    return fn(mask, *(_load(r, row, idx, mask) for r in refs))

  if cols <= block:  # the whole row in one block
    return tuple(jnp.sum(v) for v in block_terms(0))

  def body(k, acc):
    return tuple(a + v for a, v in zip(acc, block_terms(k)))

  zeros = tuple(jnp.zeros((block,), jnp.float32) for _ in range(count))
  return tuple(jnp.sum(a) for a in jax.lax.fori_loop(0, pl.cdiv(cols, block), body, zeros))


def _forward_kernel(x_ref, y_ref, rstd_ref, *, kind, eps, cols, block):
  row = pl.program_id(0)
  mean = 0.0
  if kind == "layer":
    mean = _row_sums((x_ref,), row, cols, block, lambda m, x: (x,), 1)[0] / cols
  sq = _row_sums((x_ref,), row, cols, block,
                 lambda m, x: (jnp.where(m, x - mean, 0.0) ** 2,), 1)[0]
  rstd = jax.lax.rsqrt(sq / cols + eps)
  plgpu.store(rstd_ref.at[pl.ds(row, 1)], jnp.full((1,), rstd, jnp.float32))

  @pl.loop(0, pl.cdiv(cols, block))
  def _(k):
    idx, mask = _columns(k, block, cols)
    x = _load(x_ref, row, idx, mask)
    plgpu.store(y_ref.at[row, idx], ((x - mean) * rstd).astype(y_ref.dtype), mask=mask)


def _backward_kernel(g_ref, y_ref, rstd_ref, dx_ref, *, kind, cols, block):
  row = pl.program_id(0)
  g_sum, gy_sum = _row_sums((g_ref, y_ref), row, cols, block, lambda m, g, y: (g, g * y), 2)
  g_mean = g_sum / cols if kind == "layer" else 0.0
  gy_mean = gy_sum / cols
  rstd = plgpu.load(rstd_ref.at[pl.ds(row, 1)])

  @pl.loop(0, pl.cdiv(cols, block))
  def _(k):
    idx, mask = _columns(k, block, cols)
    g, y = _load(g_ref, row, idx, mask), _load(y_ref, row, idx, mask)
    plgpu.store(dx_ref.at[row, idx],
                (rstd * (g - g_mean - y * gy_mean)).astype(dx_ref.dtype), mask=mask)


def _check(kind, x):
  check_kind(kind)
  if x.ndim < 1:
    raise ValueError("ms norm kernels need at least one axis (the normalised one)")


def _num_warps(block):
  return min(max(block // 256, 1), 8)


@functools.partial(jax.jit, static_argnames=("kind", "eps", "interpret", "max_block"))
def ms_norm_forward(kind: str, x, eps: float, *, interpret: bool = False,
                    max_block: int = MAX_BLOCK):
  """``(y, rstd)``: y in x's shape and dtype, rstd fp32 of shape ``x.shape[:-1]``.
  Reference: ``lowmem_jax.norms.ms_norm_forward``."""
  _check(kind, x)
  cols = x.shape[-1]
  rows = x.size // cols if cols else 0
  if rows == 0 or cols == 0:  # as the jnp path: the mean of an empty row is NaN
    return x, jnp.full(x.shape[:-1], jnp.nan, jnp.float32)
  block = _block(cols, max_block)
  y, rstd = pl.pallas_call(
      functools.partial(_forward_kernel, kind=kind, eps=eps, cols=cols, block=block),
      out_shape=(jax.ShapeDtypeStruct((rows, cols), x.dtype),
                 jax.ShapeDtypeStruct((rows,), jnp.float32)),
      grid=(rows,), interpret=interpret,
      compiler_params=layout.compiler_params(num_warps=_num_warps(block)),
      name=f"ms_{kind}_norm_forward",
  )(x.reshape(rows, cols))
  return y.reshape(x.shape), rstd.reshape(x.shape[:-1])


@functools.partial(jax.jit, static_argnames=("kind", "interpret", "max_block"))
def ms_norm_input_grad(kind: str, g, y, rstd, *, interpret: bool = False,
                       max_block: int = MAX_BLOCK):
  """dx (g's dtype) from the cotangent, the saved output y and the saved fp32 rstd.
  Reference: ``lowmem_jax.norms.ms_norm_input_grad``."""
  _check(kind, g)
  cols = g.shape[-1]
  rows = g.size // cols if cols else 0
  if rows == 0 or cols == 0:
    return jnp.zeros_like(g)
  block = _block(cols, max_block)
  dx = pl.pallas_call(
      functools.partial(_backward_kernel, kind=kind, cols=cols, block=block),
      out_shape=jax.ShapeDtypeStruct((rows, cols), g.dtype),
      grid=(rows,), interpret=interpret,
      compiler_params=layout.compiler_params(num_warps=_num_warps(block)),
      name=f"ms_{kind}_norm_backward",
  )(g.reshape(rows, cols), y.reshape(rows, cols), rstd.reshape(rows))
  return dx.reshape(g.shape)
