"""Frozen kernels in bf16 / int8 / nf4 (lowmem_jax.quantized_weight): round-trip error
bounds, the matmul against its plain-autodiff reference (values, dx, what it saves),
embedding tables (row gather, the tied head's matmul, the fused LM loss on a stored
head), a tiny LLaMA's logits against the fp32 model (untied and tied), resident bytes
(nf4 with double quantization too), LoRA gradients."""

import math
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowmem_jax import quantized_weight as qw
from lowmem_jax import lm_loss
from lowmem_jax.dense import Dense
from lowmem_jax.memory import saved_residuals
from models.linear import FrozenKernel
from models.lora import LoRAParam
from train.config import TrainConfig
from train.model import build_model, store_frozen_kernels

HF_DATA = pathlib.Path(__file__).parent / "data" / "hf"

# a stacked kernel [layers=2, in=100, out=(3, 5)]: 100 inputs are not a multiple of 64
W = jax.random.normal(jax.random.key(0), (2, 100, 3, 5)) * jnp.linspace(0.1, 3.0, 15
                                                                        ).reshape(3, 5)
CASES = ["bfloat16", "int8", "nf4", "nf4-dq"]


def _roundtrip(format, w=W, n_in=1):
  k = qw.quantize(w, format, n_in=n_in, n_out=w.ndim - 1 - n_in)
  return k, np.asarray(qw.dequantize(k), np.float64), np.asarray(w, np.float64)


def test_nf4_levels_are_qlora_s():
  """The 16 levels of bitsandbytes' NF4: sorted, -1 and 1 at the ends, an exact 0,
  7 negative and 8 positive ones; the largest gap is the bottom one (-1 -> -0.6961928)."""
  levels = qw.NF4_LEVELS
  assert levels.shape == (16,) and np.all(np.diff(levels) > 0)
  assert levels[0] == -1 and levels[-1] == 1 and levels[7] == 0
  assert levels[6] == np.float32(-0.09105003625154495)
  assert levels[8] == np.float32(0.07958029955625534)
  assert qw.NF4_MAX_GAP == pytest.approx(1 - 0.6961928009986877)


@pytest.mark.parametrize("format", CASES)
def test_dequantize_quantize_error_within_derived_bound(format):
  """Derived bounds (fp32 slack 1e-6 relative):
  bf16: round to nearest with 8 significant bits: |err| <= 2^-8 |w|.
  int8: q = round(w / s), s = absmax_col / 127, |q| <= 127 so no clipping:
        |err| = s |w/s - q| <= s / 2 = absmax_col / 254, per output column.
  nf4:  w / A in [-1, 1] (A: the block's absmax) goes to the nearest level l, so
        |w/A - l| <= half the gap around it <= max_gap / 2: |err| <= A max_gap / 2.
  nf4 + double quantization: A is stored as A' with |A - A'| <= s2 / 2 (int8 of
        A - mean(A) in blocks of 256, s2 = block absmax / 127) and |l| <= 1, so
        |err| <= A max_gap / 2 + |A - A'|."""
  k, got, w = _roundtrip(format)
  double_quant = format == "nf4-dq"
  err = np.abs(got - w)
  if format == "bfloat16":
    assert np.all(err <= 2.0 ** -8 * np.abs(w))
    return
  flat = w.reshape(2, 100, 15)
  if format == "int8":
    bound = np.max(np.abs(flat), axis=1, keepdims=True) / 254
    assert np.all(err.reshape(flat.shape) <= bound * (1 + 1e-6))
    return
  padded = np.pad(flat, ((0, 0), (0, 28), (0, 0))).reshape(2, 2, 64, 15)
  absmax = np.max(np.abs(padded), axis=2, keepdims=True)
  bound = absmax * qw.NF4_MAX_GAP / 2
  if double_quant:
    stored = np.asarray(qw.nf4_absmax(k), np.float64)[:, :, None, :]
    centred = absmax - absmax.reshape(2, -1).mean(axis=1)[:, None, None, None]
    s2 = np.max(np.abs(centred), axis=(1, 2, 3), keepdims=True) / 127  # 30 < 256 scales
    assert np.all(np.abs(stored - absmax) <= s2 / 2 * (1 + 1e-5) + 1e-7)
    bound = bound + np.abs(stored - absmax)
  err = np.pad(err.reshape(flat.shape), ((0, 0), (0, 28), (0, 0))).reshape(padded.shape)
  assert np.all(err <= bound * (1 + 1e-6) + 1e-7)
  if not double_quant:  # each block's absmax is a level (+-1) times itself: exact
    hit = np.abs(padded) == absmax
    assert np.all(err[hit] <= 1e-6 * absmax.repeat(64, axis=2)[hit])


def test_storage_layout_and_bytes():
  """Packed sizes: bf16 2 B/param; int8 1 B + an fp32 scale per column; nf4 a uint8 per
  two inputs + an fp32 absmax per 64 (0.5625 B/param when K % 64 == 0); with double
  quantization an int8 per 64 + an fp32 scale per 256 of those + 4 B (their mean)."""
  w = jax.random.normal(jax.random.key(1), (128, 32))
  sizes = {f: qw.quantize(w, f).nbytes for f in CASES}
  assert sizes == {"bfloat16": 2 * 4096, "int8": 4096 + 4 * 32,
                   "nf4": 4096 // 2 + 4 * 2 * 32, "nf4-dq": 4096 // 2 + 256 + 4 + 4}
  k = qw.quantize(W, "nf4", n_out=2)
  assert k.shape == W.shape and k.lead == (2,) and k.data.dtype == jnp.uint8
  assert k.data.shape == (2, 64, 15) and k.scale.shape == (2, 2, 15)
  # input row 2j in the low nibble, 2j + 1 in the high one
  w2 = jnp.zeros((64, 1)).at[0, 0].set(-1.0).at[1, 0].set(1.0)
  assert int(qw.quantize(w2, "nf4").data[0, 0]) == 0 | (15 << 4)


def _has_gradient(g) -> bool:
  """A cotangent that is not symbolically or numerically zero (float0: an int leaf)."""
  return g.dtype != jax.dtypes.float0 and bool(jnp.any(g != 0))


def _linear_case(format):
  w = W[0].reshape(100, 15)
  x = jax.random.normal(jax.random.key(2), (4, 7, 100))
  return x, w, qw.quantize(w, format)


@pytest.mark.parametrize("format", ["bfloat16", "int8", "nf4"])
def test_linear_output_error_bound(format):
  """y = x W: |x W' - x W|_n = |sum_k x_k (W'-W)_kn| <= |x|_1 max_k |W'-W|_kn per output."""
  x, w, k = _linear_case(format)
  dense = Dense(1, jnp.float32)
  err_w = np.max(np.abs(np.asarray(qw.dequantize(k)) - np.asarray(w)), axis=0)
  bound = np.sum(np.abs(np.asarray(x)), axis=-1, keepdims=True) * err_w
  err_y = np.abs(np.asarray(dense(x, k)) - np.asarray(x @ w))
  assert np.all(err_y <= bound * (1 + 1e-5) + 1e-6)
  assert np.max(err_y) > 0  # the quantization changed something


@pytest.mark.parametrize("format", ["int8", "nf4"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_frozen_dense_matches_reference_and_saves_no_dequantized_kernel(format, dtype):
  """Values and dx as the plain-autodiff reference (tight); its backward keeps no array
  of the kernel's size (the reference keeps the dequantized kernel: the check can fail);
  no weight gradient."""
  x, w, k = _linear_case(format)
  bias = jnp.linspace(-1, 1, 15)
  ours = lambda x, k: jnp.sum(jnp.tanh(Dense(1, dtype)(x, k, bias).astype(jnp.float32)))
  # the same function: Dense adds the bias in its compute dtype (an fp32 bias added to a
  # bf16 y is another function, ~1 bf16 ulp of y apart: 0.2 at |y| ~ 30)
  ref = lambda x, k: jnp.sum(jnp.tanh((qw.frozen_dense_reference(
      x, k, contract=1, dtype=dtype) + bias.astype(dtype)).astype(jnp.float32)))
  # the same arithmetic (bitwise on CPU); elsewhere a dot may sum its 15 or 100 terms in
  # another order: fp32 slack, and in bf16 one rounding of the output to either side
  tol = 1e-6 if dtype == jnp.float32 else 2.0 ** -7
  assert float(ours(x, k)) == pytest.approx(float(ref(x, k)), rel=tol)
  dx, dk = jax.grad(ours, argnums=(0, 1), allow_int=True)(x, k)
  dx_ref = jax.grad(ref)(x, k)
  atol = 1e-6 if dtype == jnp.float32 else 2.0 ** -16 * float(jnp.abs(dx_ref).max())
  np.testing.assert_allclose(np.asarray(dx, np.float32), np.asarray(dx_ref, np.float32),
                             rtol=tol, atol=atol)
  assert not any(_has_gradient(g) for g in jax.tree.leaves(dk))
  big = lambda s: [r for r in s.items if math.prod(r.shape) >= w.size]
  assert not big(saved_residuals(ours, x, k))
  assert big(saved_residuals(ref, x, k))


TABLE = jax.random.normal(jax.random.key(4), (40, 100)) * jnp.linspace(0.1, 2.0, 40)[:, None]
IDS = jnp.array([[3, 39, 0], [3, 17, 8]])


@pytest.mark.parametrize("format", ["bfloat16", "int8", "nf4"])
def test_table_rows_within_bound_and_gathered_exactly(format):
  """A table [V, D] stored with its rows as lead axes (n_in=1, n_out=0): int8 has one
  scale per row, |err| <= absmax_row / 254 (as a linear's per output column: a row is
  an output of the tied head); nf4 blocks of 64 run along the row, |err| <= A gap / 2
  (bounds derived in test_dequantize_quantize_error_within_derived_bound); bf16
  <= 2^-8 |w|. take_rows gathers the stored rows: equal to indexing the dequantized
  table, exactly."""
  k = qw.quantize(TABLE, format, n_in=1, n_out=0)
  assert k.lead == (40,) and k.shape == (40, 100)
  got, w = np.asarray(qw.dequantize(k), np.float64), np.asarray(TABLE, np.float64)
  err = np.abs(got - w)
  if format == "bfloat16":
    assert np.all(err <= 2.0 ** -8 * np.abs(w))
  elif format == "int8":
    assert k.scale.shape == (40,)
    assert np.all(err <= np.max(np.abs(w), axis=1, keepdims=True) / 254 * (1 + 1e-6))
  else:
    blocks = np.pad(w, ((0, 0), (0, 28))).reshape(40, 2, 64)
    bound = np.max(np.abs(blocks), axis=2, keepdims=True) * qw.NF4_MAX_GAP / 2
    padded = np.pad(err, ((0, 0), (0, 28))).reshape(40, 2, 64)
    assert np.all(padded <= bound * (1 + 1e-6) + 1e-7)
  rows = qw.dequantize(qw.take_rows(k, IDS))
  assert rows.shape == (2, 3, 100)
  np.testing.assert_array_equal(rows, qw.dequantize(k)[IDS])


def test_tied_head_matmul_on_a_stored_table():
  """h @ E^T with E an int8 table (frozen_dense, transposed): values and dh as the
  plain-autodiff reference (tight), no residual of the table's size (the reference
  keeps the dequantized table: the check can fail), no gradient for the table."""
  k = qw.quantize(TABLE, "int8", n_in=1, n_out=0)
  h = jax.random.normal(jax.random.key(5), (2, 3, 100))
  ours = lambda h, k: jnp.sum(jnp.tanh(qw.frozen_dense(h, k, contract=1, dtype=jnp.float32,
                                                       transposed=True)))
  ref = lambda h, k: jnp.sum(jnp.tanh(qw.frozen_dense_reference(
      h, k, contract=1, dtype=jnp.float32, transposed=True)))
  assert float(ours(h, k)) == pytest.approx(float(ref(h, k)), rel=1e-6)
  # the reference is h @ E^T (a sum of 240 terms ~1 in another order: 1e-5)
  np.testing.assert_allclose(float(ref(h, k)), float(jnp.sum(jnp.tanh(
      h @ qw.dequantize(k).T))), rtol=1e-5)
  dh, dk = jax.grad(ours, argnums=(0, 1), allow_int=True)(h, k)
  np.testing.assert_allclose(dh, jax.grad(ref)(h, k), rtol=1e-6, atol=1e-6)
  assert not any(_has_gradient(g) for g in jax.tree.leaves(dk))
  big = lambda s: [r for r in s.items if math.prod(r.shape) >= TABLE.size]
  assert not big(saved_residuals(ours, h, k))
  assert big(saved_residuals(ref, h, k))


@pytest.mark.parametrize("format,transposed", [("nf4", False), ("int8", True)])
def test_fused_lm_loss_on_a_stored_head(format, transposed):
  """chunked_cross_entropy with a stored head (an nf4 kernel [D, V]; an int8 table
  [V, D], the tied head): losses, accuracy and dh as the reference on the dequantized
  weight (tight); it saves the stored form only (no array of the weight's size)."""
  w = TABLE if transposed else TABLE.T  # V = 40, D = 100
  k = qw.quantize(w, format, n_in=1, n_out=0 if transposed else 1)
  h = jax.random.normal(jax.random.key(6), (2, 5, 100))
  targets = jax.random.randint(jax.random.key(7), (2, 5), 0, 40)
  fused = lambda h, k: lm_loss.chunked_cross_entropy(h, k, targets, chunk=4,
                                                     transposed=transposed)
  ref = lambda h, k: lm_loss.cross_entropy_reference(h, qw.dequantize(k), targets,
                                                     transposed=transposed)
  for got, want in zip(jax.jit(fused)(h, k), ref(h, k)):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  total = lambda f: lambda h, k: jnp.sum(f(h, k)[0] * jnp.arange(1.0, 6.0))
  want = jax.jit(jax.grad(total(ref)))(h, k)  # fp32 sums over V in another order
  np.testing.assert_allclose(jax.jit(jax.grad(total(fused)))(h, k), want, rtol=1e-5,
                             atol=1e-5 * float(jnp.max(jnp.abs(want))))
  big = [r for r in saved_residuals(total(fused), h, k).items
         if math.prod(r.shape) >= w.size // 2]
  assert not big, big


def test_fused_lm_loss_on_a_stored_table_with_a_merged_scale():
  """The tied head under MS norms: an int8 table [V, D] and the final norm's scale [D],
  applied inside the fused loss: losses and the gradients of h and the scale as the
  reference on the dequantized table times the scale; it saves no array of the table's
  size (the stored form and D floats only)."""
  k = qw.quantize(TABLE, "int8", n_in=1, n_out=0)  # V = 40, D = 100
  h = jax.random.normal(jax.random.key(6), (2, 5, 100))
  scale = 1.0 + 0.5 * jax.random.normal(jax.random.key(8), (100,))
  targets = jax.random.randint(jax.random.key(7), (2, 5), 0, 40)
  weights = jnp.arange(1.0, 6.0)
  fused = lambda h, s: jnp.sum(lm_loss.chunked_cross_entropy(
      h, k, targets, chunk=4, transposed=True, scale=s)[0] * weights)
  ref = lambda h, s: jnp.sum(lm_loss.cross_entropy_reference(
      h, qw.dequantize(k), targets, transposed=True, scale=s)[0] * weights)
  np.testing.assert_allclose(jax.jit(fused)(h, scale), ref(h, scale), rtol=1e-6)
  got = jax.jit(jax.grad(fused, argnums=(0, 1)))(h, scale)
  for g, w in zip(got, jax.jit(jax.grad(ref, argnums=(0, 1)))(h, scale)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(w))))
  big = [r for r in saved_residuals(fused, h, scale).items
         if math.prod(r.shape) >= TABLE.size // 2]
  assert not big, big


# --------------------------------------------------------------------------- in a model
# dim 128, 4 kv heads, mlp 256: every kernel's K x N is a multiple of 64 x 256, so nf4's
# absmax blocks and double quantization's blocks of 256 scales come out whole
MODEL = {"num_layers": 1, "dim": 128, "num_kv_heads": 4, "mlp_dim": 256}


def _cfg(base_dtype="float32", **model):
  return TrainConfig(name="t", task="lm", model="llama-tiny", policy="baseline",
                     dtype="float32", trainable="lora", lora_targets="query,value",
                     model_overrides={**MODEL, **model}, base_dtype=base_dtype)


@pytest.fixture(scope="module")
def fp32_model():
  return build_model(_cfg())


TOKENS = jax.random.randint(jax.random.key(3), (2, 12), 0, 256)
# one compile per model structure (fp32, each format), shared by the tests
logits = nnx.jit(lambda model: model(TOKENS))
TABLE_PATH = ("embed", "embedding")


def _kernels(model):
  """The base weights: every linear's kernel (not LoRA's) and the embedding table."""
  return {p: v for p, v in nnx.iter_graph(model) if p and p[-1] in ("kernel", "embedding")
          and isinstance(v, (FrozenKernel, nnx.Param)) and not isinstance(v, LoRAParam)}


def _with_kernels(model, kernels):
  """A copy of ``model`` whose (fp32) weights at the given paths are replaced."""
  model = nnx.clone(model)
  found = _kernels(model)
  for path, value in kernels.items():
    found[path][...] = value
  return model


EPS = {"bfloat16": 2.0 ** -8, "int8": 1 / 254, "nf4": qw.NF4_MAX_GAP / 2}


def _check_first_order_bound(fp32_model, format, n_frozen):
  """Stores ``fp32_model``'s frozen weights in ``format``; checks the logits' error
  against the bound of test_tiny_llama_logits_within_first_order_bound."""
  model = nnx.clone(fp32_model)
  store_frozen_kernels(model, _cfg(format))
  stored, plain = _kernels(model), _kernels(fp32_model)
  frozen = [p for p, v in stored.items() if isinstance(v, FrozenKernel)]
  assert len(frozen) == n_frozen
  assert stored[TABLE_PATH][...].storage == ("bfloat16" if format == "nf4" else format)
  dw = {p: qw.dequantize(stored[p][...]) - plain[p][...] for p in frozen}
  h = 0.25
  shifted = [_with_kernels(fp32_model, {p: plain[p][...] + s * h * d for p, d in dw.items()})
             for s in (1, -1)]
  first = (logits(shifted[0]) - logits(shifted[1])) / (2 * h)
  err = float(jnp.max(jnp.abs(logits(model) - logits(fp32_model))))
  bound = (1 + 4 * EPS[format]) * float(jnp.max(jnp.abs(first))) + 1e-5
  assert 0 < err <= bound, (err, bound)
  return model


@pytest.mark.parametrize("format", ["bfloat16", "int8", "nf4"])
def test_tiny_llama_logits_within_first_order_bound(fp32_model, format):
  """Storing the frozen weights (7 linears per block, the LM head, the embedding table)
  changes W by dW = dequantize(quantize(W)) - W (bounded above). The logits change by
  J dW + R, J the logits' derivative in the weights and R second order in dW:
  |R| <~ eps |J dW| with eps the largest relative error of the stored weights (<= 2^-8
  bf16, <= 1/254 int8 of the column's or row's absmax, <= 0.152 nf4 of the block absmax;
  an nf4 base stores the table in bf16, 2^-8 < 0.152). Bound:
  max |d logits| <= (1 + 4 eps) max |J dW| + 1e-5, J dW by a central difference
  (f(W + h dW) - f(W - h dW)) / 2h, h = 1/4 (its error is third order in dW)."""
  _check_first_order_bound(fp32_model, format, n_frozen=9)


def test_tied_llama_stores_its_table_once_and_its_fused_loss_reads_it():
  """Tied embeddings, int8 base: one stored table (no LM head kernel) serves the lookup
  and the head; logits within the first-order bound above; the fused chunked loss on the
  stored table (transposed) equals the loss of the logits path."""
  tied = build_model(_cfg(tie_embeddings=True))
  model = _check_first_order_bound(tied, "int8", n_frozen=8)
  assert model.lm_head is None  # 7 linears and the table stored
  targets = jnp.roll(TOKENS, -1, axis=1)
  fused = nnx.jit(lambda m: m.token_losses(TOKENS, targets, chunk=8))(model)
  plain = lm_loss.logits_cross_entropy(logits(model), targets)
  np.testing.assert_allclose(fused[0], plain[0], rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(fused[1], plain[1])


def test_resident_bytes_per_format(fp32_model):
  """Bytes of the stored linear kernels (LM head included) per parameter: bf16 2; int8
  1 + 4/K (an fp32 scale per output column; K = 128, the MLP's down 256); nf4 0.5 + 4/64 =
  0.5625 (an fp32 absmax per 64); nf4-dq 0.5 + 1/64 (an int8 code per absmax)
  + 4/(64 * 256) (an fp32 scale per 256 codes) + 4/(K N) (their mean) ~= 0.516. The
  embedding table: bf16 2, int8 1 + 4/D (a scale per row), nf4 and nf4-dq in bf16."""
  kernels = {p: v[...] for p, v in _kernels(fp32_model).items() if p != TABLE_PATH}
  n = sum(k.size for k in kernels.values())
  inputs = lambda p: 256 if p[-2] == "down" else 128
  expect = {"bfloat16": 2 * n,
            "int8": sum(k.size + 4 * k.size // inputs(p) for p, k in kernels.items()),
            "nf4": 0.5625 * n,
            "nf4-dq": sum(k.size * (0.5 + 1 / 64 + 4 / 64 / 256) + 4 for k in kernels.values())}
  table = fp32_model.embed.embedding[...]
  table_bytes = {"bfloat16": 2 * table.size, "int8": table.size + 4 * table.shape[0],
                 "nf4": 2 * table.size, "nf4-dq": 2 * table.size}
  per_param = {}
  for format in expect:
    model = nnx.clone(fp32_model)
    store_frozen_kernels(model, _cfg(format))
    stored = {p: v[...] for p, v in nnx.iter_graph(model) if isinstance(v, FrozenKernel)}
    assert stored[TABLE_PATH].nbytes == table_bytes[format]
    del stored[TABLE_PATH]
    assert set(stored) == set(kernels)
    got = sum(k.nbytes for k in stored.values())
    assert got == expect[format], (format, got, expect[format])
    per_param[format] = got / n
  assert per_param["nf4"] == 0.5625 and 0.515 < per_param["nf4-dq"] < 0.517, per_param


def test_lora_gradients_flow_with_an_nf4_base():
  """Adapters get finite, nonzero gradients through nf4 bases; the bases are not in the
  trained set and get no gradient."""
  cfg = _cfg("nf4")
  model = build_model(cfg)
  for _, v in nnx.iter_graph(model):  # B != 0, so A's gradient is not zero either
    if isinstance(v, LoRAParam) and not jnp.any(v[...]):
      v[...] = 0.01 * jnp.ones_like(v[...])
  graphdef, params, frozen, rest = nnx.split(model, LoRAParam, FrozenKernel, ...)
  loss = lambda p, f: jnp.mean(logits(nnx.merge(graphdef, p, f, rest, copy=True)) ** 2)
  grads, frozen_grads = jax.grad(loss, argnums=(0, 1), allow_int=True)(params, frozen)
  leaves = jax.tree.leaves(grads)
  assert len(leaves) == 4 and all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
  assert all(float(jnp.max(jnp.abs(g))) > 0 for g in leaves)
  assert jax.tree.leaves(frozen_grads)
  assert not any(_has_gradient(g) for g in jax.tree.leaves(frozen_grads))


def test_base_dtype_config_errors():
  """Double quantization is the base dtype nf4-dq: a name for another format is an error
  that lists the valid ones."""
  with pytest.raises(ValueError, match="base_dtype='nf4' needs frozen weights"):
    TrainConfig(base_dtype="nf4")
  with pytest.raises(ValueError, match="base_dtype='int4' is not one of"):
    TrainConfig(base_dtype="int4", trainable="lora")
  with pytest.raises(ValueError, match="base_dtype='int8-dq' is not one of .*'nf4-dq'"):
    TrainConfig(base_dtype="int8-dq", trainable="lora")
  assert TrainConfig(base_dtype="nf4-dq", trainable="lora").base_dtype == "nf4-dq"
  with pytest.raises(ValueError, match="quantize: format='int8-dq' is not one of"):
    qw.quantize(W, "int8-dq")
  with pytest.raises(ValueError, match="quantize: format='int4'"):
    qw.quantize(W, "int4")


@pytest.mark.parametrize("base_dtype", ["float32", "bfloat16", "int8"])
def test_frozen_by_pattern_with_a_stored_base(base_dtype):
  """trainable=frozen:<regex> with base_dtype: the matched kernels are stored (no longer
  parameters) and the rest trains; before, the check that the regex matched counted
  parameters only and refused every such run ("matches no parameter path")."""
  from train.model import split_trainable
  cfg = _cfg(base_dtype).replace(trainable="frozen:mlp")
  _, params, rest = split_trainable(cfg, nnx.eval_shape(lambda: build_model(cfg)))
  trained = {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(params)}
  assert trained and not any("mlp" in p for p in trained), trained
  stored = [p for p, v in nnx.to_flat_state(rest) if isinstance(v, FrozenKernel)]
  assert bool(stored) == (base_dtype != "float32"), stored
  assert all("mlp" in "/".join(map(str, p)) for p in stored), stored
  with pytest.raises(ValueError, match="matches no parameter path"):
    split_trainable(cfg.replace(trainable="frozen:nomatch"),
                    nnx.eval_shape(lambda: build_model(cfg.replace(trainable="frozen:nomatch"))))


@pytest.mark.parametrize("format", ["int8", "nf4", "nf4-dq"])
def test_inf_or_nan_weights_are_refused_not_spread(format, tmp_path):
  """absmax scaling has no place for inf or NaN: stored, one +inf became -inf and NaN'd its
  block (nf4), its column (int8) or the whole kernel (nf4-dq's scale offset), silently.
  Refused, naming the checkpoint's tensor; bf16 keeps them, as an fp32 load does."""
  import shutil
  from safetensors.numpy import load_file, save_file
  from models import hf
  w = np.full((128, 2), 0.01, np.float32)
  w[0, 0], w[5, 1] = np.inf, np.nan
  with pytest.raises(ValueError, match=rf"^quantize: 2 of 256 weights are inf or NaN, "
                                       rf"which {format} cannot store$"):
    qw.quantize(w, format)
  assert int(jnp.sum(~jnp.isfinite(qw.dequantize(qw.quantize(w, "bfloat16"))))) == 2

  path = pathlib.Path(shutil.copytree(HF_DATA / "llama_untied", tmp_path / "ckpt"))
  tensors = load_file(path / "model.safetensors")
  name = "model.layers.1.mlp.up_proj.weight"
  tensors[name] = tensors[name].copy()
  tensors[name][3, 4] = -np.inf
  save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
  cfg = TrainConfig(name="t", task="lm", pretrained=str(path), dtype="float32",
                    trainable="lora", base_dtype=format)
  with pytest.raises(hf.CheckpointError, match=rf"^{re.escape(str(path))}.*: {name}: "
                                               rf"quantize: 1 of \d+ weights are inf or NaN"):
    build_model(cfg)
