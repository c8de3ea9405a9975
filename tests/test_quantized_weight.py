"""Frozen kernels in bf16 / int8 / nf4 (lowmem_jax.quantized_weight): round-trip error
bounds, the matmul against its plain-autodiff reference (values, dx, what it saves),
a tiny LLaMA's logits against the fp32 model, resident bytes, LoRA gradients."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowmem_jax import quantized_weight as qw
from lowmem_jax.dense import Dense
from lowmem_jax.memory import saved_residuals
from models.linear import FrozenKernel
from models.lora import LoRAParam
from train.config import TrainConfig
from train.model import build_model, store_frozen_kernels

# a stacked kernel [layers=2, in=100, out=(3, 5)]: 100 inputs are not a multiple of 64
W = jax.random.normal(jax.random.key(0), (2, 100, 3, 5)) * jnp.linspace(0.1, 3.0, 15
                                                                        ).reshape(3, 5)
CASES = [("bfloat16", False), ("int8", False), ("nf4", False), ("nf4", True)]


def _roundtrip(format, double_quant=False, w=W, n_in=1):
  k = qw.quantize(w, format, n_in=n_in, n_out=w.ndim - 1 - n_in, double_quant=double_quant)
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


@pytest.mark.parametrize("format,double_quant", CASES)
def test_dequantize_quantize_error_within_derived_bound(format, double_quant):
  """Derived bounds (fp32 slack 1e-6 relative):
  bf16: round to nearest with 8 significant bits: |err| <= 2^-8 |w|.
  int8: q = round(w / s), s = absmax_col / 127, |q| <= 127 so no clipping:
        |err| = s |w/s - q| <= s / 2 = absmax_col / 254, per output column.
  nf4:  w / A in [-1, 1] (A: the block's absmax) goes to the nearest level l, so
        |w/A - l| <= half the gap around it <= max_gap / 2: |err| <= A max_gap / 2.
  nf4 + double quantization: A is stored as A' with |A - A'| <= s2 / 2 (int8 of
        A - mean(A) in blocks of 256, s2 = block absmax / 127) and |l| <= 1, so
        |err| <= A max_gap / 2 + |A - A'|."""
  k, got, w = _roundtrip(format, double_quant)
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
  sizes = {f + ("+dq" if d else ""): qw.quantize(w, f, double_quant=d).nbytes
           for f, d in CASES}
  assert sizes == {"bfloat16": 2 * 4096, "int8": 4096 + 4 * 32,
                   "nf4": 4096 // 2 + 4 * 2 * 32, "nf4+dq": 4096 // 2 + 256 + 4 + 4}
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
  ref = lambda x, k: jnp.sum(jnp.tanh(
      (qw.frozen_dense_reference(x, k, contract=1, dtype=dtype) + bias).astype(jnp.float32)))
  tol = 1e-6 if dtype == jnp.float32 else 1e-2
  assert float(ours(x, k)) == pytest.approx(float(ref(x, k)), rel=tol)
  dx, dk = jax.grad(ours, argnums=(0, 1), allow_int=True)(x, k)
  np.testing.assert_allclose(dx, jax.grad(ref)(x, k), rtol=tol, atol=tol)
  assert not any(_has_gradient(g) for g in jax.tree.leaves(dk))
  big = lambda s: [r for r in s.items if math.prod(r.shape) >= w.size]
  assert not big(saved_residuals(ours, x, k))
  assert big(saved_residuals(ref, x, k))


# --------------------------------------------------------------------------- in a model
def _cfg(base_dtype="float32"):
  return TrainConfig(name="t", task="lm", model="llama-tiny", policy="baseline",
                     dtype="float32", trainable="lora", lora_targets="query,value",
                     model_overrides={"num_layers": 1}, base_dtype=base_dtype)


@pytest.fixture(scope="module")
def fp32_model():
  return build_model(_cfg())


TOKENS = jax.random.randint(jax.random.key(3), (2, 12), 0, 256)
# one compile per model structure (fp32, each format), shared by the tests
logits = nnx.jit(lambda model: model(TOKENS))


def _kernels(model):
  return {p: v for p, v in nnx.iter_graph(model) if p and p[-1] == "kernel"
          and isinstance(v, (FrozenKernel, nnx.Param)) and not isinstance(v, LoRAParam)}


def _with_kernels(model, kernels):
  """A copy of ``model`` whose (fp32) kernels at the given paths are replaced."""
  model = nnx.clone(model)
  found = _kernels(model)
  for path, value in kernels.items():
    found[path][...] = value
  return model


@pytest.mark.parametrize("format", ["bfloat16", "int8", "nf4"])
def test_tiny_llama_logits_within_first_order_bound(fp32_model, format):
  """Storing the frozen kernels changes W by dW = dequantize(quantize(W)) - W (bounded
  above). The logits change by J dW + R, J the logits' derivative in the kernels and R
  second order in dW: |R| <~ eps |J dW| with eps the kernels' relative error (<= 2^-8
  bf16, <= 1/254 int8, <= 0.152 nf4 of the block absmax). Bound:
  max |d logits| <= (1 + 4 eps) max |J dW| + 1e-5, J dW by a central difference
  (f(W + h dW) - f(W - h dW)) / 2h, h = 1/4 (its error is third order in dW)."""
  eps = {"bfloat16": 2.0 ** -8, "int8": 1 / 254, "nf4": qw.NF4_MAX_GAP / 2}[format]
  model = nnx.clone(fp32_model)
  store_frozen_kernels(model, _cfg(format))
  stored, plain = _kernels(model), _kernels(fp32_model)
  frozen = [p for p, v in stored.items() if isinstance(v, FrozenKernel)]
  assert len(frozen) == 7  # every linear of the block; not the LM head
  dw = {p: qw.dequantize(stored[p][...]) - plain[p][...] for p in frozen}
  h = 0.25
  shifted = [_with_kernels(fp32_model, {p: plain[p][...] + s * h * d for p, d in dw.items()})
             for s in (1, -1)]
  first = (logits(shifted[0]) - logits(shifted[1])) / (2 * h)
  err = float(jnp.max(jnp.abs(logits(model) - logits(fp32_model))))
  bound = (1 + 4 * eps) * float(jnp.max(jnp.abs(first))) + 1e-5
  assert 0 < err <= bound, (err, bound)


def test_resident_bytes_per_format(fp32_model):
  """Bytes of the frozen kernels' leaves per base parameter: bf16 2, int8 1 + 4/K,
  nf4 0.5 + 4/64 (K % 64 == 0 here except the MLP's down, K = 176 padded to 192)."""
  n = sum(v[...].size for p, v in _kernels(fp32_model).items() if p != ("lm_head", "kernel"))
  per_param = {}
  for format in ("bfloat16", "int8", "nf4"):
    model = nnx.clone(fp32_model)
    store_frozen_kernels(model, _cfg(format))
    leaves = jax.tree.leaves(nnx.state(model, FrozenKernel))
    per_param[format] = sum(x.nbytes for x in leaves) / n
  assert per_param["bfloat16"] == 2
  assert 1 < per_param["int8"] < 1 + 4 / 64
  assert 0.5625 <= per_param["nf4"] < 0.5625 * 192 / 176


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
  with pytest.raises(ValueError, match="base_dtype='nf4' needs frozen weights"):
    TrainConfig(base_dtype="nf4")
  with pytest.raises(ValueError, match="base_dtype='int4' is not one of"):
    TrainConfig(base_dtype="int4", trainable="lora")
  with pytest.raises(ValueError, match="quantize: format='int4'"):
    qw.quantize(W, "int4")
