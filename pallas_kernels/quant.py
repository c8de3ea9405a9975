"""Mesa 8-bit quantize / dequantize as Pallas kernels, bit-identical to the jnp reference
(``lowmem_jax.quant.quantize_reference`` / ``dequantize_reference``), whose noise
(``uniform_noise``) and per-group step (``group_step``) they import.

On the ``[O, G, I]`` view of a tensor (``G`` contiguous groups, one ``lo``/``hi`` each):
``code = clip(floor((x - lo) / step + u), 0, 255)`` with ``step = (hi - lo) / 255`` rounded
up to 16 significant bits (a flat range gets 1e-30) and ``u`` the stochastic-rounding
noise of flat element ``(o * G + g) * I + i`` (uint32, wrapping); ``value = code * step +
lo``.

Tiling: a program owns one group ``g`` and a ``[block_outer, block_inner]`` tile of its
``(o, i)`` plane, so its range is two scalars and a head-wise view with a small inner
size (head_dim 64) still gives programs of ``block_elements`` elements. Grid
``(cdiv(O, block_outer), G, cdiv(I, block_inner))``; masks cover ragged O and I. Pallas
folds grid axes past CUDA's 65535 limit into axis 0 and forms offsets in 64 bits once an
array passes 4 GiB; a uint8 array of more than 2**31 (and at most 2**32) elements would
get 32-bit offsets past int32, and tile coordinates are int32: such sizes are refused
(use the jnp path there).

Bit identity on GPU: the kernels do what XLA:GPU does, op by op. XLA:GPU lowers an fp32
``/`` to ``div.full.f32`` (LLVM ``-nvptx-prec-divf32=1``: approximate, within 2 ulp, not
IEEE), so the compiled quantize kernel issues ``div.full.f32`` too; its ``-``, ``+`` and
``*`` are the IEEE ``.rn`` forms, which a compiler never fuses into an FMA (the reference's
``code * step`` is exact, so an FMA there changes nothing either). On a GPU the codes are
therefore the reference's codes on that GPU; they can differ from the CPU's by one step
where ``(x - lo) / step + u`` lies within ~2 ulp of an integer (a division that rounds
differently), which stochastic rounding makes harmless. Interpret mode runs the same
arithmetic through XLA. The per-group step is computed once, outside the kernels, by the
reference's own function.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from lowmem_jax.quant import LEVELS, group_step, uniform_noise
from pallas_kernels import layout

BLOCK_ELEMENTS = layout.BLOCK_ELEMENTS  # elements per program (a power of two)
BLOCK_INNER = 1024                    # widest tile along I (a power of two)


# ----------------------------------------------------------------------------- IEEE ops
def _ieee(op: str, a, b, interpret: bool):
  """``a op b`` in fp32 as XLA computes it on this backend: ``add``, ``sub``, ``mul``
  rounded once to nearest even (never fused into an FMA), ``div`` as XLA:GPU's
  ``div.full.f32``."""
  if interpret:  # the same XLA arithmetic as the reference
    return {"add": jnp.add, "sub": jnp.subtract, "mul": jnp.multiply,
            "div": jnp.divide}[op](a, b)
  b = jnp.broadcast_to(b, a.shape)
  instruction = "div.full.f32" if op == "div" else f"{op}.rn.f32"
  [out] = plgpu.elementwise_inline_asm(
      f"{instruction} $0, $1, $2;", args=[a, b], constraints="=f,f,f", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])
  return out


# ----------------------------------------------------------------------------- tiling
def _blocks(outer: int, inner: int, block_inner: int, block_elements: int):
  for name, v in (("block_inner", block_inner), ("block_elements", block_elements)):
    if v < 1 or v & (v - 1):
      raise ValueError(f"{name} must be a power of two, got {v}")
  bi = min(pl.next_power_of_2(inner), block_inner, block_elements)
  bo = min(pl.next_power_of_2(outer), max(1, block_elements // bi))
  return bo, bi


def _tile(shape, bo, bi):
  """Inside a kernel: the group, the tile's outer and inner slices, its ``[bo, bi]``
  mask and the uint32 flat indices ``(o * G + g) * I + i`` of its elements."""
  outer, groups, inner = shape
  g = pl.program_id(1)
  o = pl.program_id(0) * bo + jnp.arange(bo)
  i = pl.program_id(2) * bi + jnp.arange(bi)
  mask = (o < outer)[:, None] & (i < inner)[None, :]
  row = o.astype(jnp.uint32) * jnp.uint32(groups % 2 ** 32) + g.astype(jnp.uint32)
  index = row[:, None] * jnp.uint32(inner % 2 ** 32) + i.astype(jnp.uint32)[None, :]
  return (g, pl.ds(pl.program_id(0) * bo, bo), pl.ds(pl.program_id(2) * bi, bi), mask,
          index)


def _grid(shape, bo, bi):
  outer, groups, inner = shape
  return (pl.cdiv(outer, bo), groups, pl.cdiv(inner, bi))


def _check_size(shape, what: str):
  """Sizes the kernels index safely: int32 tile coordinates, and no uint8 array whose
  offsets Pallas would form in 32 bits past int32."""
  layout.check_offsets(shape[0] * shape[1] * shape[2], 1, what)  # the uint8 codes
  if max(shape) >= 2 ** 31:
    raise ValueError(f"{what}: view {list(shape)} has an axis of 2**31 or more elements; "
                     "use the jnp path (implementation='xla')")


def _check_range(lo, hi, groups, what):
  if lo.shape != (groups,) or hi.shape != (groups,):
    raise ValueError(f"{what}: lo{list(lo.shape)} / hi{list(hi.shape)} must have shape "
                     f"[{groups}] (one range per group)")


# ----------------------------------------------------------------------------- kernels
def _quantize_kernel(x_ref, lo_ref, step_ref, seed_ref, codes_ref, *, shape, bo, bi,
                     interpret):
  g, outer, inner, mask, index = _tile(shape, bo, bi)
  lo = plgpu.load(lo_ref.at[pl.ds(g, 1)])
  step = plgpu.load(step_ref.at[pl.ds(g, 1)])
  seed = plgpu.load(seed_ref.at[pl.ds(0, 1)])
  x = plgpu.load(x_ref.at[outer, g, inner], mask=mask, other=0).astype(jnp.float32)
  t = _ieee("div", _ieee("sub", x, lo, interpret), step, interpret)
  t = _ieee("add", t, uniform_noise(index, seed), interpret)
  # clip(floor(t), 0, 255); NaN -> 0 as XLA's float -> uint8 conversion gives.
  code = jnp.where(t >= 0, jnp.minimum(jnp.floor(t), float(LEVELS)), 0.0)
  plgpu.store(codes_ref.at[outer, g, inner], code.astype(jnp.uint8), mask=mask)


def _dequantize_kernel(codes_ref, lo_ref, step_ref, out_ref, *, shape, bo, bi, interpret):
  g, outer, inner, mask, _ = _tile(shape, bo, bi)
  lo = plgpu.load(lo_ref.at[pl.ds(g, 1)])
  step = plgpu.load(step_ref.at[pl.ds(g, 1)])
  code = plgpu.load(codes_ref.at[outer, g, inner], mask=mask, other=0).astype(jnp.float32)
  value = _ieee("add", _ieee("mul", code, step, interpret), lo, interpret)
  plgpu.store(out_ref.at[outer, g, inner], value.astype(out_ref.dtype), mask=mask)


# ----------------------------------------------------------------------------- entry points
@functools.partial(jax.jit, static_argnames=("kernel", "name", "out_dtype", "interpret",
                                             "block_inner", "block_elements"))
def _launch(kernel, name, a3, lo, hi, extra, out_dtype, interpret, block_inner,
            block_elements):
  """``kernel`` over the ``[O, G, I]`` array ``a3`` (a program per group and tile), given
  fp32 ``lo`` and the reference's :func:`group_step` per group, then ``extra`` inputs:
  an output of ``a3``'s shape in ``out_dtype``."""
  if a3.size == 0:
    return jnp.zeros(a3.shape, out_dtype)
  _check_size(a3.shape, f"{name} kernel")
  lo, hi = lo.astype(jnp.float32), hi.astype(jnp.float32)
  bo, bi = _blocks(a3.shape[0], a3.shape[2], block_inner, block_elements)
  return pl.pallas_call(
      functools.partial(kernel, shape=a3.shape, bo=bo, bi=bi, interpret=interpret),
      out_shape=jax.ShapeDtypeStruct(a3.shape, out_dtype),
      grid=_grid(a3.shape, bo, bi), interpret=interpret,
      compiler_params=layout.compiler_params(), name=f"mesa_{name}",
  )(a3, lo, group_step(lo, hi), *extra)


def quantize(x3: jax.Array, lo: jax.Array, hi: jax.Array, seed, *, interpret: bool = False,
             block_inner: int = BLOCK_INNER,
             block_elements: int = BLOCK_ELEMENTS) -> jax.Array:
  """uint8 codes of a float ``x3: [O, G, I]`` for fp32 ranges ``lo``/``hi: [G]`` and a
  uint32 ``seed`` (stochastic rounding); reference: ``lowmem_jax.quant.quantize_reference``."""
  if x3.ndim != 3 or not jnp.issubdtype(x3.dtype, jnp.floating):
    raise ValueError(f"quantize kernel expects a float [O, G, I] array, got "
                     f"{x3.dtype}{list(x3.shape)}")
  _check_range(lo, hi, x3.shape[1], "quantize kernel")
  seed = jnp.asarray(seed, jnp.uint32).reshape(1)
  return _launch(_quantize_kernel, "quantize", x3, lo, hi, (seed,), jnp.dtype(jnp.uint8),
                 interpret, block_inner, block_elements)


def dequantize(codes3: jax.Array, lo: jax.Array, hi: jax.Array, dtype, *,
               interpret: bool = False, block_inner: int = BLOCK_INNER,
               block_elements: int = BLOCK_ELEMENTS) -> jax.Array:
  """Values ``code * step + lo`` (fp32 math) in ``dtype`` of uint8 ``codes3: [O, G, I]``;
  reference: ``lowmem_jax.quant.dequantize_reference``."""
  dtype = jnp.dtype(dtype)
  if codes3.ndim != 3 or codes3.dtype != jnp.uint8:
    raise ValueError(f"dequantize kernel expects uint8 [O, G, I] codes, got "
                     f"{codes3.dtype}{list(codes3.shape)}")
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f"dequantize kernel: dtype must be floating, got {dtype}")
  _check_range(lo, hi, codes3.shape[1], "dequantize kernel")
  return _launch(_dequantize_kernel, "dequantize", codes3, lo, hi, (), dtype, interpret,
                 block_inner, block_elements)
