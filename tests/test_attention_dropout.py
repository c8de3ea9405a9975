"""Attention-probability dropout (lowmem_jax/attention.py): "flash" (mask drawn again in
backward, never saved) against the plain "xla" reference with the same key: values and
gradients; the mask itself; its statistics; the errors; the policy's strategies (baseline,
Mesa's coded attention, qkv=recompute) passing the key; and what the compiled grad keeps."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowmem_jax import attention as attn
from lowmem_jax import methods, quant
from lowmem_jax.attention import attention, dropout_keep_mask
from lowmem_jax.baseline import Attention
from lowmem_jax.memory import peak_buffers, saved_residuals
from lowmem_jax.policy import MemoryPolicy
from lowmem_jax.qkv_recompute import RecomputeQKV

KEY = jax.random.key(7)
# jitted: op by op, a flash call with dropout takes seconds on CPU
attention_jit = jax.jit(attention, static_argnames=(
    "causal", "implementation", "scale", "block_k", "name", "dropout_rate"))


def _qkv(b, n, m, h, k, d, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(ks[0], (b, n, h, d)), jax.random.normal(ks[1], (b, m, k, d)),
          jax.random.normal(ks[2], (b, m, k, d)))


def _mask(kind, b, h, n, m):
  if kind == "padding":
    keep = jax.random.uniform(jax.random.key(1), (b, 1, 1, m)) > 0.3
  elif kind == "full":
    keep = jax.random.uniform(jax.random.key(2), (b, h, n, m)) > 0.4
  else:
    return None
  return keep.at[..., 0].set(True)  # every row sees a key


def _weighted_sum(o):
  weights = jnp.cos(jnp.arange(o.size, dtype=jnp.float32)).reshape(o.shape)
  return jnp.sum(o.astype(jnp.float32) * weights)  # a cotangent that differs per element


def _loss(impl, rate, key=KEY, **kw):
  return lambda q, k, v: _weighted_sum(attention(
      q, k, v, implementation=impl, dropout_rate=rate, dropout_key=key, **kw))


@pytest.mark.parametrize("causal,heads,kv_heads,mask_kind,n,m,block_k,rate", [
    (False, 4, 4, None, 33, 33, 512, 0.1),      # one block
    (True, 4, 4, None, 37, 45, 16, 0.3),        # ragged last block, N != M
    (False, 4, 2, "padding", 37, 45, 16, 0.1),  # GQA + padding mask
    (True, 6, 1, "padding", 20, 64, 32, 0.5),   # multi-query, causal, M a block multiple
    (True, 4, 2, "full", 33, 33, 8, 0.2),       # causal + per-head mask, many blocks
])
def test_flash_matches_the_xla_reference_with_the_same_key(causal, heads, kv_heads, mask_kind,
                                                            n, m, block_k, rate):
  q, k, v = _qkv(2, n, m, heads, kv_heads, 8)
  kw = dict(causal=causal, mask=_mask(mask_kind, 2, heads, n, m), block_k=block_k)
  def run(q, k, v):
    outs = [attention(q, k, v, implementation=impl, dropout_rate=rate, dropout_key=KEY, **kw)
            for impl in ("flash", "xla")]
    grads = [jax.value_and_grad(_loss(impl, rate, **kw), argnums=(0, 1, 2))(q, k, v)
             for impl in ("flash", "xla")]
    return outs, grads, attention(q, k, v, implementation="xla", **kw)

  with jax.default_matmul_precision("highest"):
    (out, ref), ((lf, gf), (lr, gr)), undropped = jax.jit(run)(q, k, v)
  assert float(jnp.max(jnp.abs(ref - undropped))) > 0.1  # the dropout does act
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=2e-6)
  np.testing.assert_allclose(lf, lr, rtol=1e-5, atol=1e-4)
  for a, r in zip(gf, gr):
    np.testing.assert_allclose(a, r, rtol=1e-5, atol=5e-6)


def test_bf16_flash_close_to_the_fp32_reference():
  q, k, v = _qkv(2, 40, 40, 4, 2, 16)
  kw = dict(causal=True, block_k=16, dropout_rate=0.2, dropout_key=KEY)
  ref = attention_jit(q, k, v, implementation="xla", **kw)
  out = attention_jit(*(t.astype(jnp.bfloat16) for t in (q, k, v)), implementation="flash",
                      **kw)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(out.astype(jnp.float32), ref, atol=4e-2)


def test_a_different_key_or_block_gives_another_result():
  q, k, v = _qkv(1, 20, 20, 2, 2, 8)
  run = lambda key, block_k: attention_jit(q, k, v, implementation="flash", block_k=block_k,
                                       dropout_rate=0.3, dropout_key=key)
  base = run(KEY, 8)
  np.testing.assert_array_equal(base, run(jax.random.key(7), 8))   # deterministic
  assert float(jnp.max(jnp.abs(base - run(jax.random.key(8), 8)))) > 0.1
  assert float(jnp.max(jnp.abs(base - run(KEY, 10)))) > 0.1       # the mask is per block


@pytest.mark.parametrize("impl", ["flash", "xla", "auto"])
def test_rate_zero_is_no_dropout_bit_for_bit_and_the_same_program(impl):
  q, k, v = _qkv(2, 17, 23, 4, 2, 8)
  kw = dict(causal=True, mask=_mask("padding", 2, 4, 17, 23), block_k=8)
  plain = lambda q, k, v: _weighted_sum(attention(q, k, v, implementation=impl, **kw))
  zero = _loss(impl, 0.0, **kw)
  np.testing.assert_array_equal(attention_jit(q, k, v, implementation=impl, **kw),
                                attention_jit(q, k, v, implementation=impl, dropout_rate=0.0,
                                          dropout_key=KEY, **kw))
  grad = lambda f: jax.grad(f, argnums=(0, 1, 2))
  assert str(jax.make_jaxpr(grad(zero))(q, k, v)) == str(jax.make_jaxpr(grad(plain))(q, k, v))
  for a, b in zip(jax.jit(grad(zero))(q, k, v), jax.jit(grad(plain))(q, k, v)):
    np.testing.assert_array_equal(a, b)


def test_keep_mask_is_the_one_flash_applies():
  """q = 0 (uniform probabilities 1 / M) and v one-hot over the keys: o[b, i, h, j] is
  keep[b, h, i, j] / (M (1 - rate)), so flash's output spells out the mask it drew."""
  b, n, m, h, kv_heads, rate, block_k = 2, 5, 13, 4, 2, 0.4, 5
  q = jnp.zeros((b, n, h, m))
  v = jnp.broadcast_to(jnp.eye(m)[None, :, None, :], (b, m, kv_heads, m))
  out = attention_jit(q, jnp.ones_like(v), v, implementation="flash", block_k=block_k,
                  dropout_rate=rate, dropout_key=KEY)
  seen = jnp.transpose(out, (0, 2, 1, 3)) * m * (1 - rate) > 0.5        # [B, H, N, M]
  keep = dropout_keep_mask(KEY, (b, h, n, m), rate, attn.key_block(m, block_k))
  assert keep.shape == (b, h, n, m) and keep.dtype == jnp.bool_
  np.testing.assert_array_equal(seen, keep)
  np.testing.assert_allclose(jnp.where(keep, out.transpose(0, 2, 1, 3), 1 / (m * (1 - rate))),
                             1 / (m * (1 - rate)), rtol=1e-6)


def test_kept_fraction_and_independence():
  """Over 2**21 draws the kept fraction is 1 - rate within 6 standard deviations
  (sqrt(rate (1 - rate) / 2**21) <= 3.5e-4); masks of different keys, and the blocks of
  one mask, agree where independent ones would: in (1 - rate)**2 + rate**2 of places."""
  shape, block = (4, 8, 256, 256), 128
  size = np.prod(shape)
  for rate in (0.1, 0.5, 0.9):
    keep = np.asarray(dropout_keep_mask(KEY, shape, rate, block))
    bound = 6 * np.sqrt(rate * (1 - rate) / size)
    assert abs(keep.mean() - (1 - rate)) < bound, (rate, keep.mean())
    other = np.asarray(dropout_keep_mask(jax.random.key(8), shape, rate, block))
    agree = (1 - rate) ** 2 + rate ** 2
    assert abs((keep == other).mean() - agree) < 2 * bound, rate
    first, second = keep[..., :block], keep[..., block:]        # the two key blocks
    assert abs((first == second).mean() - agree) < 4 * bound, rate
    low, high = keep[..., :block // 2], keep[..., block // 2:block]  # halves of one word
    assert abs((low == high).mean() - agree) < 4 * bound, rate


def test_auto_runs_flash_with_dropout_even_where_it_would_take_cudnn():
  gpu = dict(backend="gpu", cudnn_version=90800, compute_capability=(9, 0))
  shape = (2, 1024, 8, 64)
  assert attn.choose_implementation(shape, shape, jnp.bfloat16, **gpu).implementation == "cudnn"
  choice = attn.choose_implementation(shape, shape, jnp.bfloat16, dropout_rate=0.1, **gpu)
  assert choice.implementation == "flash" and "dropout" in choice.reason
  q, k, v = _qkv(1, 9, 9, 2, 2, 4)
  np.testing.assert_array_equal(
      attention_jit(q, k, v, dropout_rate=0.2, dropout_key=KEY),
      attention_jit(q, k, v, implementation="flash", dropout_rate=0.2, dropout_key=KEY))


@pytest.mark.parametrize("kw,match", [
    (dict(dropout_rate=0.1), "dropout_key"),
    (dict(dropout_rate=0.1, dropout_key=jax.random.split(KEY, 2)), "dropout_key"),
    (dict(dropout_rate=0.1, dropout_key=jnp.zeros((2,), jnp.float32)), "dropout_key"),
    (dict(dropout_rate=1.0, dropout_key=KEY), "dropout_rate"),
    (dict(dropout_rate=-0.1, dropout_key=KEY), "dropout_rate"),
    (dict(dropout_rate="0.1", dropout_key=KEY), "dropout_rate"),
    (dict(dropout_rate=True, dropout_key=KEY), "dropout_rate"),
    (dict(dropout_rate=jnp.float32(0.1), dropout_key=KEY), "dropout_rate"),
    (dict(dropout_rate=0.1, dropout_key=KEY, implementation="cudnn"),
     "cuDNN attention dropout is not available through jax's API.*'flash'"),
    (dict(dropout_rate=0.1, dropout_key=KEY, implementation="cudnn_padded"),
     "cuDNN attention dropout is not available"),
])
def test_bad_dropout_is_a_clear_error(kw, match):
  q, k, v = _qkv(1, 4, 4, 2, 2, 8)
  with pytest.raises(ValueError, match=match):
    attention(q, k, v, **kw)


def test_a_raw_uint32_key_works_and_gives_the_typed_keys_mask():
  q, k, v = _qkv(1, 6, 6, 2, 2, 4)
  run = lambda key: attention_jit(q, k, v, implementation="flash", dropout_rate=0.3,
                              dropout_key=key)
  np.testing.assert_array_equal(run(jax.random.PRNGKey(3)),
                                run(jax.random.wrap_key_data(jax.random.PRNGKey(3))))


def test_vmapped_over_keys():
  """One key per example, as a vmapped model would: each example's row is that of the
  call with its own key (another mask would differ by ~0.1, not in the last bits)."""
  q, k, v = _qkv(3, 10, 12, 2, 1, 4)
  f = functools.partial(attention, implementation="flash", block_k=5, dropout_rate=0.25)
  keys = jax.random.split(KEY, 3)
  vm = jax.jit(jax.vmap(lambda q, k, v, key: f(q[None], k[None], v[None],
                                                 dropout_key=key)[0]))(q, k, v, keys)
  one = jax.jit(lambda q, k, v, key: f(q, k, v, dropout_key=key))
  for i in range(3):
    np.testing.assert_allclose(vm[i], one(q[i:i + 1], k[i:i + 1], v[i:i + 1], keys[i])[0],
                               rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- strategies
def test_policy_attention_strategy_forwards_the_dropout_arguments():
  q, k, v = _qkv(2, 12, 12, 4, 2, 8)
  mask = _mask("padding", 2, 4, 12, 12)
  want = attention_jit(q, k, v, mask=mask, dropout_rate=0.2, dropout_key=KEY)
  same = functools.partial(np.testing.assert_allclose, desired=want, rtol=1e-6, atol=1e-6)
  for spec in ("baseline", "lowmembp+qkv=recompute"):  # jit: last-bit rounding only
    strategy = MemoryPolicy.parse(spec).attention_strategy(4, 2)
    assert isinstance(strategy, Attention), spec
    same(strategy(q, k, v, mask, dropout_rate=0.2, dropout_key=KEY))
  fn = MemoryPolicy.parse("baseline").attention_fn()
  same(fn(q, k, v, mask=mask, dropout_rate=0.2, dropout_key=KEY))
  with pytest.raises(AssertionError):  # the key does reach it
    same(fn(q, k, v, mask=mask, dropout_rate=0.2, dropout_key=jax.random.key(8)))


def test_mesa_coded_attention_passes_the_key_to_its_backward():
  """Mesa's backward is the exact vjp at the dequantized q, k, v: with dropout, that of
  the reference with the same key (another mask would differ by far more than 1e-5)."""
  q, k, v = _qkv(2, 12, 12, 4, 2, 8)
  strategy = MemoryPolicy.parse("mesa8").attention_strategy(4, 2)
  states = strategy.init_state()
  run = lambda q, k, v: methods.value_of(strategy.apply(
      states, q, k, v, None, dropout_rate=0.3, dropout_key=KEY)[0])
  codes = [strategy.heads.code(states["query"], q)[0]] + [
      strategy.kv_heads.code(states[n], x)[0] for n, x in (("key", k), ("value", v))]
  approx = [c.dequantized() for c in codes]
  ref = lambda q, k, v: attention(q, k, v, implementation="xla", dropout_rate=0.3,
                                  dropout_key=KEY)
  g = jax.random.normal(jax.random.key(9), q.shape)

  @jax.jit
  def both(q, k, v):
    out, vjp = jax.vjp(run, q, k, v)
    return out, vjp(g), jax.vjp(ref, *approx)[1](g)

  with jax.default_matmul_precision("highest"):
    out, got, want = both(q, k, v)
  np.testing.assert_allclose(out, attention_jit(q, k, v, dropout_rate=0.3, dropout_key=KEY),
                             rtol=1e-6, atol=1e-6)
  for a, r in zip(got, want):
    np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-5)


def _project_attend(implementation, x, params, consts):
  """The qkv site's pure function, the key a constant beside the mask (as the model's)."""
  mask, key = consts
  q, k, v = (jnp.einsum("bnd,dhe->bnhe", x, params[n]) for n in "qkv")
  return Attention(implementation, causal=True)(q, k, v, mask, dropout_rate=0.2,
                                                dropout_key=key)


def test_qkv_recompute_draws_the_same_mask_in_its_backward():
  keys = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(keys[0], (2, 6, 8))
  params = {n: jax.random.normal(k, (8, 2, 4)) / 3 for n, k in zip("qkv", keys[1:])}
  consts = (jnp.ones((2, 1, 1, 6), bool), KEY)
  run = functools.partial(RecomputeQKV(), functools.partial(_project_attend, "flash"))
  qx, _ = quant.quantize_tensor(x, quant.QuantState.create(1))
  g = jax.random.normal(jax.random.key(9), (2, 6, 2, 4))
  ref = lambda x, p: _project_attend("xla", x, p, consts)  # the plain reference

  @jax.jit
  def all_paths(x, params):
    out, vjp = jax.vjp(lambda x, p: run(x, p, consts), x, params)
    # the coded input's path (quant.coded_vjp): the key a constant of its rule
    coded = lambda value, p: run(quant.QTensor(value, qx.codes, qx.lo, qx.hi, qx.axis,
                                               qx.groups), p, consts)
    return (out, ref(x, params), vjp(g), jax.vjp(ref, x, params)[1](g),
            jax.vjp(coded, x, params)[1](g), jax.vjp(ref, qx.dequantized(), params)[1](g))

  with jax.default_matmul_precision("highest"):
    out, ref_out, got, want, got_coded, want_coded = all_paths(x, params)
  np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-6)
  for a, r in zip(jax.tree.leaves((got, got_coded)), jax.tree.leaves((want, want_coded))):
    np.testing.assert_allclose(a, r, rtol=1e-5, atol=2e-6)


# ----------------------------------------------------------------------------- memory
def test_flash_dropout_keeps_no_n_by_m_array():
  """B=2, H=4, N=M=512, D=32, fp32, block_k 128; the grad's compiled peak, measured on
  XLA:CPU (jax 0.10.2): flash 16.2 MiB without dropout, 18.7 MiB with (the block's
  draws: uint32 [2, 4, 512, 64] and their halves' masks), the xla reference with dropout
  37.5 MiB (its fp32 [2, 4, 512, 512] probabilities, 2 MiB each, and the mask). Saved for
  backward: the same for flash with and without dropout (o and lse; q, k, v are inputs)."""
  b, n, h, d = 2, 512, 4, 32
  q, k, v = _qkv(b, n, n, h, h, d)
  peaks, saved = {}, {}
  for impl, rate in (("flash", 0.0), ("flash", 0.1), ("xla", 0.1)):
    f = lambda q, k, v: jnp.sum(jnp.sin(attention(
        q, k, v, implementation=impl, block_k=128, dropout_rate=rate, dropout_key=KEY)))
    pb = peak_buffers(jax.grad(f, argnums=(0, 1, 2)), q, k, v)
    big = [x for x in pb.buffers if x.shape and np.prod(x.shape) >= b * h * n * n]
    assert bool(big) == (impl == "xla"), pb.table()  # the check can fail: xla has them
    peaks[impl, rate] = pb.peak_bytes
    saved[impl, rate] = saved_residuals(f, q, k, v).total_bytes
  assert peaks["flash", 0.1] < 1.25 * peaks["flash", 0.0], peaks
  assert peaks["flash", 0.1] < 0.6 * peaks["xla", 0.1], peaks
  assert saved["flash", 0.1] == saved["flash", 0.0] < 0.1 * saved["xla", 0.1], saved
