"""Token embeddings: ``nnx.Embed`` whose table, when frozen, is stored in a base dtype.

Same parameter (``embedding [V, D]``) and function as Flax's, so checkpoints, LoRA and
sharding see no difference. :meth:`Embed.store_table` stores a frozen table once as a
:class:`~models.linear.FrozenKernel` (a
:class:`~lowmem_jax.quantized_weight.QuantizedKernel` with one lead axis, the rows:
``bfloat16``, or ``int8`` with one absmax scale per row); a lookup gathers the rows in
that form and dequantizes only them. A tied LM head reads the same stored table
(``models.llama``): one copy serves both.

Which format a table gets for a ``base_dtype`` (:data:`TABLE_FORMATS`): ``nf4`` stores
tables in bf16, as QLoRA does: transformers' ``replace_with_bnb_linear`` swaps
``nn.Linear`` layers only (for ``Linear4bit``) and leaves ``nn.Embedding`` in the load
dtype (bf16 in the QLoRA recipe). It also skips ``lm_head`` ("kept in full precision for
numerical stability"); we store an untied head in the base dtype like any frozen linear
(its logit error is bounded in tests/test_quantized_weight.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lowmem_jax import quantized_weight
from models.linear import FrozenKernel

# base_dtype -> the format a frozen table is stored in
TABLE_FORMATS = {"float32": "float32", "bfloat16": "bfloat16", "int8": "int8",
                 "nf4": "bfloat16", "nf4-dq": "bfloat16"}


def table_value(table, dtype=jnp.float32):
  """An embedding table ``[V, D]`` in ``dtype``: a stored one dequantized."""
  if isinstance(table, quantized_weight.QuantizedKernel):
    return quantized_weight.dequantize(table, dtype)
  return table.astype(dtype)


def check_ids(ids, rows: int) -> None:
  """A ValueError if concrete ``ids`` (an eager call) index past a table of ``rows``:
  under ``jit`` (traced ids) a gather out of range gives NaN rows, not an error, so
  ``train`` checks its data before step 1."""
  if isinstance(ids, jax.core.Tracer) or not hasattr(ids, "dtype"):
    return
  if not jnp.issubdtype(ids.dtype, jnp.integer) or np.size(ids) == 0:
    return
  ids = np.asarray(ids)  # on the host: a jnp reduction inside a trace would be traced
  low, high = int(ids.min()), int(ids.max())
  if low < 0 or high >= rows:
    bad = low if low < 0 else high
    raise ValueError(f"Embed: index {bad} is out of range for a table of {rows} rows "
                     f"(ids must be 0..{rows - 1})")


class Embed(nnx.Embed):
  """``nnx.Embed`` whose frozen table may be stored in a base dtype (:meth:`store_table`)."""

  def store_table(self, format: str) -> None:
    """Stores the (frozen) table in ``format`` (``lowmem_jax.quantized_weight.FORMATS``),
    once, as a :class:`~models.linear.FrozenKernel` with one row per lead index.
    ``float32`` leaves it as it is; a table stored in ``format`` already (a streamed
    load) is left alone."""
    if format == "float32":
      return
    table = self.embedding[...]
    if isinstance(table, quantized_weight.QuantizedKernel):
      if table.storage != format:
        raise ValueError(f"store_table: the embedding table is stored as {table.storage} "
                         f"already, not {format}")
      return
    self.embedding = FrozenKernel(quantized_weight.quantize(table, format, n_in=1, n_out=0))

  def __call__(self, inputs, out_sharding=None):
    table = self.embedding[...]
    check_ids(inputs, self.num_embeddings)
    if not isinstance(table, quantized_weight.QuantizedKernel):
      return super().__call__(inputs, out_sharding=out_sharding)
    inputs = jnp.asarray(inputs)
    if not jnp.issubdtype(inputs.dtype, jnp.integer):
      raise ValueError("Embed: input type must be an integer or unsigned integer")
    # self.dtype: the fp32 parameter dtype unless one was given (as Flax's)
    return quantized_weight.dequantize(quantized_weight.take_rows(table, inputs), self.dtype)
