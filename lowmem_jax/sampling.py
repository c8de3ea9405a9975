"""WTA-CRS (arXiv 2305.15265): a linear layer whose weight gradient is estimated from k rows.

The forward is the exact linear. For backward the layer saves only ``k = budget(rows,
ratio)`` rows of its input (``[k, in]``, the input dtype), their int32 indices and fp32
scales, plus the kernel: never the ``rows x in`` input. ``dx`` and ``dbias`` are exact
(they need no input); ``dkernel`` is the unbiased estimate
``sum_j scale_j * x[idx_j]^T g[idx_j]`` of ``x^T g``.

Winner-take-all column-row sampling picks the rows in forward, from ``p_i`` proportional
to ``||x_i||`` (times optional ``row_weights``, e.g. per-example output-gradient norms
cached from the last epoch, since ``g`` is unknown in forward; the paper's optimum is
``||x_i|| * ||g_i||``): the rows whose probability mass beats the budget are kept
deterministically with scale 1, the other slots are sampled with replacement from the
remaining rows and reweighted. Its variance is at most that of plain column-row
sampling (CRS) with the same k. Shapes are static, so all of it jits.

Several linears reading one activation (q, k and v) share one sample: :func:`sample_tensor`
carries the activation with its rows, indices and scales (:class:`SampledTensor`), and
:func:`sampled_linear` reads it, saving those rows (one buffer for all the readers).
:func:`linear_on_sample` is the layer on a sample drawn by the caller (:func:`select`) that
keeps something else from which backward rebuilds the rows (Mesa's code of the input,
:mod:`lowmem_jax.wta_crs`).
"""

from __future__ import annotations

import dataclasses
import fractions
import functools
import math
import numbers
import operator

import jax
import jax.numpy as jnp

from lowmem_jax.carried import Carried

DEFAULT_RATIO = 0.3  # the paper's budget: k = 0.3 |D|


# ----------------------------------------------------------------------------- budget, p
def budget(rows: int, ratio: float) -> int:
  """Rows kept for backward: ``max(1, ceil(ratio * rows))``, at most ``rows``.

  ``ratio`` is read as the decimal it prints as, so ``0.7`` of 10 rows is 7, not the
  8 that ``ceil(0.7 * 10 = 7.000000000000001)`` would give.
  """
  try:
    rows = operator.index(rows)
  except TypeError:
    raise ValueError(f"budget: rows must be an int, got {rows!r}") from None
  if rows < 1:
    raise ValueError(f"budget: rows must be >= 1, got {rows}")
  try:
    r = float(ratio)
  except (TypeError, ValueError):
    raise ValueError(f"budget: ratio must be a number in (0, 1], got {ratio!r}") from None
  if not 0.0 < r <= 1.0:  # also rejects NaN
    raise ValueError(f"budget: ratio must be in (0, 1], got {ratio!r}")
  k = math.ceil(fractions.Fraction(repr(r)) * rows)
  return min(max(1, k), rows)


def sampling_probabilities(x2d, row_weights=None):
  """fp32 ``p[rows]`` proportional to ``||x_i||_2 * row_weights_i``; uniform if all zero.

  ``row_weights`` (``[rows]``, >= 0) multiplies the row norms; negative weights count
  as 0. Norms are taken in fp32 whatever the dtype of ``x2d``.
  """
  xf = x2d.astype(jnp.float32)
  w = jnp.sqrt(jnp.sum(xf * xf, axis=-1))
  if row_weights is not None:
    w = w * jnp.maximum(row_weights.astype(jnp.float32), 0.0)
  total = jnp.sum(w)
  uniform = jnp.full_like(w, 1.0 / w.shape[0])
  return jnp.where(total > 0, w / jnp.where(total > 0, total, 1.0), uniform)


# ----------------------------------------------------------------------------- selection
def _check_select(p, k):
  if jnp.ndim(p) != 1:
    raise ValueError(f"expected a 1-D vector of probabilities, got shape {jnp.shape(p)}")
  if isinstance(k, bool) or not isinstance(k, numbers.Integral) or not 1 <= k <= p.shape[0]:
    raise ValueError(f"k must be an int in [1, {p.shape[0]}] (the number of rows), got {k!r}")


def _sample_with_replacement(key, weights, m):
  """``m`` i.i.d. indices with probability ``weights_i / total``, and that ``total``.

  Inverse-CDF sampling: O(rows + m log rows) work and no ``m x rows`` temporary (which
  ``jax.random.categorical`` would make). A zero-weight row is never drawn, unless
  every weight is zero (then ``total`` is 0 and callers give those slots scale 0).
  """
  cdf = jnp.cumsum(weights)
  total = cdf[-1]  # the cumsum's own total, so the probabilities below are exact for it
  u = jax.random.uniform(key, (m,), jnp.float32) * total
  idx = jnp.searchsorted(cdf, u, side="right")
  # u may round up to total; clamp to the last row that can be drawn.
  positive = weights > 0
  last = weights.shape[0] - 1 - jnp.argmax(positive[::-1])
  return jnp.minimum(idx, last).astype(jnp.int32), total


def wta_crs_select(p, k: int, key):
  """Winner-take-all column-row sampling of ``k`` slots: ``(idx int32[k], scale f32[k])``.

  ``p``: ``f32[rows]`` summing to 1 (:func:`sampling_probabilities`); ``k`` static.
  With ``p`` sorted descending, the winner set ``C`` is the top ``c`` rows for every
  ``c`` in ``1..k-1`` with ``cumsum(p_sorted)[c-1] > c / k`` (a prefix: that difference
  is concave in ``c`` and 0 at ``c = 0``). Slots ``j < |C|`` hold the winners with
  scale 1; slots ``j >= |C|`` hold i.i.d. draws, with replacement, from the rows outside
  ``C`` with probability ``p_i / (1 - P_C)`` and scale ``(1 - P_C) / ((k - |C|) p_i)``.
  Then ``sum_j scale_j x[idx_j]^T g[idx_j]`` is unbiased for ``x^T g`` (rows with
  ``p_i = 0`` are taken to contribute nothing). Rows with ``p_i = 0`` get scale 0
  wherever they land, so nothing is NaN when ``1 - P_C = 0``.
  """
  _check_select(p, k)
  p = p.astype(jnp.float32)
  top_p, top_idx = jax.lax.top_k(p, k)  # the k largest, descending: enough to find C
  c = jnp.arange(1, k, dtype=jnp.float32)
  num_winners = jnp.sum(jnp.cumsum(top_p)[:-1] > c / k)  # |C| in [0, k-1]
  slot = jnp.arange(k)
  is_winner = slot < num_winners
  in_c = jnp.zeros(p.shape, bool).at[top_idx].set(is_winner)
  rest_p = jnp.where(in_c, 0.0, p)  # p outside C; its total is 1 - P_C

  drawn, rest = _sample_with_replacement(key, rest_p, k)
  p_drawn = rest_p[drawn]
  num_drawn = (k - num_winners).astype(jnp.float32)
  drawn_scale = jnp.where(p_drawn > 0, rest / (num_drawn * jnp.where(p_drawn > 0, p_drawn, 1.0)),
                          0.0)
  idx = jnp.where(is_winner, top_idx, drawn).astype(jnp.int32)
  scale = jnp.where(is_winner, jnp.where(top_p > 0, 1.0, 0.0), drawn_scale)
  return idx, scale.astype(jnp.float32)


def crs_select(p, k: int, key):
  """Plain column-row sampling: ``k`` i.i.d. rows with probability ``p_i``, scale ``1/(k p_i)``.

  Unbiased like :func:`wta_crs_select`, with higher variance; for comparison and tests.
  """
  _check_select(p, k)
  p = p.astype(jnp.float32)
  idx, total = _sample_with_replacement(key, p, k)
  p_idx = p[idx]
  scale = jnp.where(p_idx > 0, total / (k * jnp.where(p_idx > 0, p_idx, 1.0)), 0.0)
  return idx, scale.astype(jnp.float32)


def _scaled_row_outer_sum(x_rows, g_rows, scale):
  """``sum_j scale_j x_rows[j]^T g_rows[j]`` in fp32: ``[in, out]``."""
  xs = x_rows.astype(jnp.float32) * scale[:, None]
  return jax.lax.dot_general(xs, g_rows.astype(jnp.float32), (((0,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)


def sampled_weight_grad(x2d, g2d, idx, scale):
  """The estimator ``sum_j scale_j x2d[idx_j]^T g2d[idx_j]`` of ``x2d^T g2d``, fp32
  ``[in, out]``."""
  return _scaled_row_outer_sum(x2d[idx], g2d[idx], scale)


# ----------------------------------------------------------------------------- the layer
def linear_reference(x, kernel, bias=None, contract_ndim: int = 1):
  """Plain linear: the trailing ``contract_ndim`` axes of ``x`` against the leading ones
  of ``kernel``, accumulated in fp32 and cast to ``x.dtype``, then ``+ bias``. Plain autodiff.
  """
  y = jnp.tensordot(x, kernel, axes=contract_ndim, preferred_element_type=jnp.float32)
  y = y.astype(x.dtype)
  return y if bias is None else y + bias


def kept_rows(rows, idx):
  """``rows_of`` of a sample that keeps its rows themselves (:func:`wta_crs_linear`,
  :class:`SampledTensor`)."""
  del idx
  return rows


def _cast_linear(x, kernel, bias, contract_ndim):
  """:func:`linear_reference` with the weights cast to ``x``'s dtype."""
  bias = None if bias is None else bias.astype(x.dtype)
  return linear_reference(x, kernel.astype(x.dtype), bias, contract_ndim)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _sampled_linear(x, kernel, bias, kept, idx, scale, row_weights, contract_ndim, rows_of):
  """The exact linear whose ``dkernel`` is the estimator on the sampled rows
  ``rows_of(kept, idx)``."""
  del kept, idx, scale, row_weights
  return _cast_linear(x, kernel, bias, contract_ndim)


def _sampled_linear_fwd(x, kernel, bias, kept, idx, scale, row_weights, contract_ndim,
                        rows_of):
  y = _cast_linear(x, kernel, bias, contract_ndim)
  # Residuals: what the sample keeps (its k rows, never rows x in, the same buffer for
  # every reader of one SampledTensor; or Mesa's code of x, which its other readers keep
  # anyway), where the rows came from, their weights, and the weights as given (they
  # live anyway; a compute-dtype cast would be a copy held for backward).
  return y, (kept, idx, scale, kernel, bias, row_weights)


def _sampled_linear_bwd(contract_ndim, rows_of, res, g):
  kept, idx, scale, kernel, bias, row_weights = res
  out_ndim = kernel.ndim - contract_ndim
  lead_ndim = g.ndim - out_ndim
  out_axes = tuple(range(lead_ndim, g.ndim))
  # dx = g . kernel^T over the output axes: exact.
  dx = jax.lax.dot_general(g, kernel.astype(g.dtype),
                           ((out_axes, tuple(range(contract_ndim, kernel.ndim))), ((), ())),
                           preferred_element_type=jnp.float32)
  dx = dx.astype(g.dtype)
  dbias = None
  if bias is not None:
    dbias = jnp.sum(g.astype(jnp.float32), axis=tuple(range(lead_ndim))).astype(bias.dtype)
  g2d = g.reshape(-1, math.prod(g.shape[lead_ndim:]))
  dkernel = _scaled_row_outer_sum(rows_of(kept, idx), g2d[idx], scale)
  dkernel = dkernel.reshape(kernel.shape).astype(kernel.dtype)
  d_row_weights = None
  if row_weights is not None:
    gf = g2d.astype(jnp.float32)
    d_row_weights = jnp.sum(gf * gf, axis=-1).reshape(row_weights.shape)
    d_row_weights = d_row_weights.astype(row_weights.dtype)
  return dx, dkernel, dbias, None, None, None, d_row_weights


_sampled_linear.defvjp(_sampled_linear_fwd, _sampled_linear_bwd)


def select(x, key, *, ratio: float = DEFAULT_RATIO, row_weights=None,
           contract_ndim: int = 1):
  """``(idx int32[k], scale f32[k])``: the WTA-CRS sample of ``x``'s rows (its leading
  positions; the trailing ``contract_ndim`` axes flattened to ``in``), ``k =
  budget(rows, ratio)``, drawn with ``key`` from :func:`sampling_probabilities` (times
  ``row_weights``). No gradient flows through the choice (stop_gradient)."""
  x = jax.lax.stop_gradient(x)
  lead = x.shape[:x.ndim - contract_ndim]
  if not math.prod(lead):
    raise ValueError(f"select: x{list(x.shape)} has no rows to sample")
  x2d = x.reshape(math.prod(lead), math.prod(x.shape[len(lead):]))
  rw = None if row_weights is None else jax.lax.stop_gradient(row_weights).reshape(-1)
  return wta_crs_select(sampling_probabilities(x2d, rw), budget(x2d.shape[0], ratio), key)


def select_rows(x, key, *, ratio: float = DEFAULT_RATIO, row_weights=None,
                contract_ndim: int = 1):
  """``(rows [k, in], idx, scale)``: :func:`select`'s sample with its rows of ``x``."""
  idx, scale = select(x, key, ratio=ratio, row_weights=row_weights,
                      contract_ndim=contract_ndim)
  x2d = jax.lax.stop_gradient(x).reshape(-1, math.prod(x.shape[x.ndim - contract_ndim:]))
  return x2d[idx], idx, scale


def _check_key(key):
  dtype = getattr(key, "dtype", None)
  if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    if key.shape != ():
      raise ValueError(f"wta_crs_linear: key must be a single PRNG key, got shape {key.shape}")
    return
  if dtype != jnp.uint32 or jnp.ndim(key) != 1:
    raise ValueError("wta_crs_linear: key must be a PRNG key (jax.random.key(...)) or raw "
                     f"uint32[2] key data (jax.random.PRNGKey(...)), got {key!r}")


def wta_crs_linear(x, kernel, bias, key, *, ratio: float = DEFAULT_RATIO, row_weights=None,
                   contract_ndim: int = 1):
  """Linear layer with an exact forward and a WTA-CRS estimate of the weight gradient.

  ``x``: ``[..., *in_dims]``, its trailing ``contract_ndim`` axes contracted (2 for an
  out-projection reading ``[B, N, heads, head_dim]``). ``kernel``: ``[*in_dims, *out_dims]``
  (Flax layout), ``bias``: ``[*out_dims]`` or None, floating, as stored (fp32): cast to
  ``x``'s dtype inside, and kept as given for backward (no cast copy is held; their
  cotangents come in their own dtype). Returns ``tensordot(x, kernel) + bias`` (fp32
  accumulation, ``x.dtype``).

  Rows are the leading (non-contracted) positions of ``x``; ``k = budget(rows, ratio)``
  of them are chosen in forward by :func:`wta_crs_select` from
  :func:`sampling_probabilities` and saved, with their indices, scales and the kernel;
  nothing of size ``rows x in``. Backward: ``dx``, ``dbias`` exact; ``dkernel`` from the
  saved rows and the same rows of the output cotangent (fp32, cast to the kernel dtype).
  Even ``ratio=1`` (k = rows) is a random estimate, not the exact gradient: draws go
  with replacement. It is exact when fewer than k rows have ``p_i > 0``.

  ``key``: an explicit PRNG key (typed or raw uint32[2]); the same key gives the same
  rows. Its cotangent is None.

  ``row_weights``: optional, shape ``x.shape[:-contract_ndim]``, float >= 0; multiplies
  ``||x_i||`` in the sampling probabilities (e.g. cached per-example output-gradient norms
  broadcast to tokens; zero-weight rows are never selected, as for padding). **Its
  cotangent is not a derivative**: the rule returns the per-row squared output-gradient
  norm ``||g_i||^2`` (fp32, cast to its dtype). So a train step that differentiates
  w.r.t. a per-example cache, broadcast or gathered into ``row_weights``, receives per
  example the sum over its rows of ``||g_i||^2``: the squared gradient norms to store
  for the next epoch. Do not feed ``row_weights`` from parameters you train.
  """
  _check_linear(x, kernel, bias, contract_ndim, "wta_crs_linear")
  lead = x.shape[:x.ndim - contract_ndim]
  _check_row_weights(row_weights, lead, "wta_crs_linear")
  _check_key(key)
  if not math.prod(lead):  # no rows to sample: the exact (empty) linear, nothing kept
    return linear_reference(x, kernel.astype(x.dtype),
                            None if bias is None else bias.astype(x.dtype), contract_ndim)
  rows, idx, scale = select_rows(x, key, ratio=ratio, row_weights=row_weights,
                                 contract_ndim=contract_ndim)
  return _sampled_linear(x, kernel, bias, rows, idx, scale, row_weights, contract_ndim,
                         kept_rows)


def _check_linear(x, kernel, bias, contract_ndim, who):
  if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
    raise ValueError(f"{who}: x must be floating point, got {jnp.result_type(x)}")
  if not isinstance(contract_ndim, int) or isinstance(contract_ndim, bool) or not (
      1 <= contract_ndim <= min(x.ndim, kernel.ndim)):
    raise ValueError(f"{who}: contract_ndim must be an int in [1, "
                     f"{min(x.ndim, kernel.ndim)}] (x has {x.ndim} axes, kernel "
                     f"{kernel.ndim}), got {contract_ndim!r}")
  in_dims = x.shape[x.ndim - contract_ndim:]
  if kernel.shape[:contract_ndim] != in_dims:
    raise ValueError(f"{who}: x{list(x.shape)} and kernel{list(kernel.shape)} "
                     f"do not match: kernel's leading {contract_ndim} axes must be "
                     f"{list(in_dims)}")
  if not jnp.issubdtype(kernel.dtype, jnp.floating):
    raise ValueError(f"{who}: kernel must be floating point, got {kernel.dtype}")
  if bias is not None:
    out_dims = kernel.shape[contract_ndim:]
    if bias.shape != out_dims:
      raise ValueError(f"{who}: bias has shape {list(bias.shape)}, expected the "
                       f"kernel's output axes {list(out_dims)}")
    if not jnp.issubdtype(bias.dtype, jnp.floating):
      raise ValueError(f"{who}: bias must be floating point, got {bias.dtype}")


def _check_row_weights(row_weights, lead, who):
  if row_weights is None:
    return
  if jnp.shape(row_weights) != lead:
    raise ValueError(f"{who}: row_weights has shape {list(jnp.shape(row_weights))}, "
                     f"expected x's leading axes {list(lead)}")
  if not jnp.issubdtype(jnp.result_type(row_weights), jnp.floating):
    raise ValueError(f"{who}: row_weights must be floating point, got "
                     f"{jnp.result_type(row_weights)}")


# ----------------------------------------------------------------------------- shared sample
@dataclasses.dataclass(frozen=True)
class SampledTensor(Carried):
  """An activation ``[..., in]`` with one WTA-CRS sample of its rows, made once for all
  the linears that read it (q, k and v read one block input): each keeps these ``rows``
  (``[k, in]``, one buffer for all), ``idx`` and ``scale``, not a sample of its own.

  ``weights``: the row weights the sample was drawn with (None: ``||x_i||`` alone); each
  reader returns its ``||g_i||^2`` as their cotangent (:func:`wta_crs_linear`), so a
  per-example cache behind them receives the sum over the readers. ``lean`` (static):
  how ops that read it without sampling keep it (``lowmem_jax.wta_crs``): the value
  under ``keep_inputs`` (True) or plain autodiff (False), as they would keep a plain one.
  ``rows``, ``idx`` and ``scale`` None (:meth:`whole`): not sampled, because its producer
  keeps it whole anyway (an MS norm its output): its readers' ``dW`` are exact from it.
  A pytree (arrays as leaves), so it may be a scan carry (a block stack's).
  """
  value: jax.Array
  rows: jax.Array | None
  idx: jax.Array | None
  scale: jax.Array | None
  weights: jax.Array | None = None
  lean: bool = True

  @classmethod
  def whole(cls, x, lean: bool = True) -> "SampledTensor":
    """``x`` carried unsampled: its readers keep it whole (what its producer keeps)."""
    return cls(x, None, None, None, None, lean)

  @property
  def is_whole(self) -> bool:
    return self.rows is None


jax.tree_util.register_dataclass(SampledTensor,
                                 data_fields=["value", "rows", "idx", "scale", "weights"],
                                 meta_fields=["lean"])


def sample_tensor(x, key, *, ratio: float = DEFAULT_RATIO, row_weights=None,
                  lean: bool = True) -> SampledTensor:
  """``x`` (``[..., in]``, floating) carried with its WTA-CRS sample (:func:`select_rows`
  over its leading positions) for the linears that will read it."""
  if not jnp.issubdtype(jnp.result_type(x), jnp.floating) or jnp.ndim(x) < 2:
    raise ValueError(f"sample_tensor: x must be floating point with >= 2 axes, got "
                     f"{jnp.result_type(x)}{list(jnp.shape(x))}")
  _check_row_weights(row_weights, x.shape[:-1], "sample_tensor")
  _check_key(key)
  if not math.prod(x.shape[:-1]):  # no rows to sample: its readers' dW are exact (zero)
    return SampledTensor.whole(x, lean)
  rows, idx, scale = select_rows(x, key, ratio=ratio, row_weights=row_weights)
  return SampledTensor(x, rows, idx, scale, row_weights, lean)


def sampled_linear(x, kernel, bias, sample: SampledTensor):
  """:func:`wta_crs_linear` of ``x`` (``sample``'s value, cast to the compute dtype by
  the caller) on the rows ``sample`` carries: the same rows, indices and scales for
  every linear reading it, and ``rows`` saved as the one buffer they share (its own
  dtype; cast in backward). ``contract_ndim`` is 1."""
  _check_linear(x, kernel, bias, 1, "sampled_linear")
  if sample.is_whole:
    raise ValueError("sampled_linear: the sample is whole (SampledTensor.whole): read it "
                     "with the exact linear")
  if x.shape != sample.value.shape:
    raise ValueError(f"sampled_linear: x{list(x.shape)} is not the sampled value "
                     f"{list(sample.value.shape)}")
  return _sampled_linear(x, kernel, bias, sample.rows, sample.idx, sample.scale,
                         sample.weights, 1, kept_rows)


def linear_on_sample(x, kernel, bias, kept, rows_of, idx, scale, *, row_weights=None,
                     contract_ndim: int = 1):
  """:func:`wta_crs_linear` of ``x`` on a sample the caller drew (:func:`select`), whose
  rows backward rebuilds as ``rows_of(kept, idx)`` (``[k, in]``): its residuals are
  ``kept`` (a pytree: e.g. another method's code of all of ``x``, which other readers
  keep anyway), ``idx``, ``scale`` and the kernel. ``rows_of`` must be hashable (a
  module-level function or a ``functools.partial`` of one)."""
  _check_linear(x, kernel, bias, contract_ndim, "linear_on_sample")
  _check_row_weights(row_weights, x.shape[:x.ndim - contract_ndim], "linear_on_sample")
  return _sampled_linear(x, kernel, bias, kept, idx, scale, row_weights, contract_ndim,
                         rows_of)


# ----------------------------------------------------------------------------- state
@dataclasses.dataclass(frozen=True)
class KeyState:
  """A sampled linear's state, carried in the train state: its PRNG key data and the
  number of calls so far (each call samples with ``fold_in(key, count)``), and, when the
  trainer attaches one, the per-example output-gradient norm cache with the ids of the
  current batch's examples (see :func:`row_weights`)."""
  key: jax.Array
  count: jax.Array
  grad_norms: jax.Array | None = None
  example_ids: jax.Array | None = None

  @classmethod
  def create(cls) -> "KeyState":
    return cls(jax.random.key_data(jax.random.key(0)), jnp.zeros((), jnp.int32))

  def step_key(self):
    """This call's key: the site key folded with the call count."""
    return jax.random.fold_in(jax.random.wrap_key_data(self.key), self.count)

  def advanced(self) -> "KeyState":
    """The state after one call."""
    return dataclasses.replace(self, count=self.count + 1)


jax.tree_util.register_dataclass(KeyState,
                                 data_fields=["key", "count", "grad_norms", "example_ids"],
                                 meta_fields=[])


def cached_weights(cache, ids):
  """Row weights of examples ``ids``: their cached norm, or the mean of the cached norms
  for examples not seen yet (1 while none is), so both are on one scale. The cotangent
  goes to ``cache[ids]`` unchanged (straight through), seen or not: that is how the
  train step reads each example's squared gradient norm back."""
  seen = cache > 0
  count = jnp.sum(seen)
  fill = jnp.where(count > 0, jnp.sum(cache) / jnp.maximum(count, 1), 1.0)
  w = cache[ids]
  return w + jax.lax.stop_gradient(jnp.where(w > 0, w, fill) - w)


def update_grad_norms(cache, squared_norm_sums):
  """The new cache: ``sqrt`` of the squared output-gradient norms summed over each
  example's rows, for the examples of this batch (nonzero), the old value elsewhere."""
  return jnp.where(squared_norm_sums > 0, jnp.sqrt(squared_norm_sums), cache)


def row_weights(state: KeyState, lead: tuple[int, ...]):
  """The cached per-example norms of ``state`` broadcast to rows of leading shape
  ``lead`` (batch first), or None: without a cache, or for a batch that is not the one
  the ids were set for."""
  if state.grad_norms is None or not lead or lead[0] != state.example_ids.shape[0]:
    return None
  ids = state.example_ids
  w = cached_weights(state.grad_norms, ids).reshape((ids.shape[0],) + (1,) * (len(lead) - 1))
  return jnp.broadcast_to(w, lead)
