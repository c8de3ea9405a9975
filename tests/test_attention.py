"""Flash attention vs jax.nn.dot_product_attention (XLA): values, grads, residuals, memory."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowmem_jax.attention import attention
from lowmem_jax.memory import saved_residuals, step_memory


def _qkv(b, n, m, h, k, d, dtype=jnp.float32, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(ks[0], (b, n, h, d), dtype),
          jax.random.normal(ks[1], (b, m, k, d), dtype),
          jax.random.normal(ks[2], (b, m, k, d), dtype))


def _padding_mask(b, m, seed=1):
  keep = jax.random.uniform(jax.random.key(seed), (b, 1, 1, m)) > 0.3
  return keep.at[..., 0].set(True)  # every row sees at least one key


def _loss(impl, causal, mask, block_k=512):
  def f(q, k, v):
    o = attention(q, k, v, causal=causal, mask=mask, implementation=impl, block_k=block_k)
    weights = jnp.cos(jnp.arange(o.size, dtype=jnp.float32)).reshape(o.shape)
    return jnp.sum(o.astype(jnp.float32) * weights)  # a cotangent that differs per element
  return f


@pytest.mark.parametrize("causal,heads,kv_heads,mask_kind,n,m,block_k", [
    (False, 4, 4, None, 33, 33, 512),       # one block
    (True, 4, 4, None, 37, 45, 16),         # ragged last block, N != M
    (False, 4, 2, "padding", 37, 45, 16),   # GQA + padding mask
    (True, 6, 1, "padding", 20, 64, 32),    # multi-query, causal, M a block multiple
    (False, 6, 2, "full", 37, 45, 16),      # per-head [B, H, N, M] mask
    (True, 4, 2, "full", 33, 33, 8),        # causal + full mask, many blocks
    (False, 4, 1, None, 1, 45, 16),         # a single query
])
def test_flash_matches_xla_values_and_grads(causal, heads, kv_heads, mask_kind, n, m, block_k):
  b, d = 2, 8
  q, k, v = _qkv(b, n, m, heads, kv_heads, d)
  if mask_kind == "padding":
    mask = _padding_mask(b, m)
  elif mask_kind == "full":
    mask = jax.random.uniform(jax.random.key(2), (b, heads, n, m)) > 0.4
    mask = mask.at[..., 0].set(True)
  else:
    mask = None
  flash = jax.jit(jax.value_and_grad(_loss("flash", causal, mask, block_k), argnums=(0, 1, 2)))
  ref = jax.jit(jax.value_and_grad(_loss("xla", causal, mask), argnums=(0, 1, 2)))
  (lf, gf), (lr, gr) = flash(q, k, v), ref(q, k, v)
  np.testing.assert_allclose(lf, lr, rtol=1e-5, atol=1e-4)
  out = jax.jit(functools.partial(attention, causal=causal, mask=mask, block_k=block_k,
                                  implementation="flash"))(q, k, v)
  np.testing.assert_allclose(
      out, attention(q, k, v, causal=causal, mask=mask, implementation="xla"),
      rtol=1e-5, atol=2e-6)
  for a, r in zip(gf, gr):
    np.testing.assert_allclose(a, r, rtol=1e-4, atol=2e-5)


def test_bf16_close_to_fp32_reference():
  q, k, v = _qkv(2, 40, 40, 4, 2, 16)
  ref = attention(q, k, v, causal=True, implementation="xla")
  out = attention(*(t.astype(jnp.bfloat16) for t in (q, k, v)), causal=True,
                  implementation="flash", block_k=16)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(out.astype(jnp.float32), ref, atol=3e-2)


def test_auto_is_flash_on_cpu():
  q, k, v = _qkv(1, 9, 9, 2, 2, 4)
  if jax.default_backend() != "cpu":
    pytest.skip("auto picks cuDNN on GPU")
  np.testing.assert_array_equal(attention(q, k, v), attention(q, k, v, implementation="flash"))


def test_flash_saves_no_n_by_n_array():
  b, n, h, d = 1, 256, 2, 8
  q, k, v = _qkv(b, n, n, h, h, d)
  for impl in ("flash", "xla"):
    res = saved_residuals(lambda q, k, v: jnp.sum(jnp.sin(
        attention(q, k, v, implementation=impl, block_k=64))), q, k, v)
    big = [r for r in res.items if int(np.prod(r.shape)) >= b * h * n * n]
    if impl == "flash":
      assert big == [], res.table()
      # o (shared with the sin's residual input) and the fp32 lse; q, k, v are arguments.
      assert res.total_bytes <= 2 * (b * n * h * d * 4) + b * h * n * 4, res.table()
    else:  # the check above can fail: the XLA path does keep N x N probabilities
      assert big, res.table()


def test_flash_compiled_memory_below_xla():
  q, k, v = _qkv(1, 1024, 1024, 2, 2, 16)
  temps = {impl: step_memory(jax.grad(_loss(impl, True, None, 128), argnums=(0, 1, 2)),
                             q, k, v).temp for impl in ("flash", "xla")}
  # XLA keeps 2 x 1024 x 1024 fp32 probabilities (8 MiB); flash works in 1024 x 128 blocks.
  assert temps["flash"] < 0.5 * temps["xla"], temps


def test_fully_masked_rows_give_zeros_and_finite_grads():
  q, k, v = _qkv(1, 5, 6, 2, 2, 4)
  mask = jnp.ones((1, 1, 5, 6), bool).at[:, :, 2, :].set(False)
  out = attention(q, k, v, mask=mask, implementation="flash", block_k=4)
  np.testing.assert_array_equal(out[:, 2], 0.0)
  grads = jax.grad(_loss("flash", False, mask, 4), argnums=(0, 1, 2))(q, k, v)
  for g in grads:
    assert np.isfinite(np.asarray(g)).all()
  np.testing.assert_array_equal(grads[0][:, 2], 0.0)


def test_name_tags_output_for_remat():
  q, k, v = _qkv(1, 8, 8, 2, 2, 4)
  f = lambda q, k, v: jnp.sum(jnp.sin(attention(q, k, v, implementation="flash",
                                                  name="attn_out")))
  policy = jax.checkpoint_policies.save_only_these_names("attn_out")
  res = saved_residuals(jax.checkpoint(f, policy=policy), q, k, v)
  assert [r.shape for r in res.items] == [q.shape], res.table()
  assert "attn_out" in res.items[0].source


def test_under_jit_and_vmap():
  q, k, v = _qkv(3, 10, 12, 2, 1, 4)
  f = functools.partial(attention, implementation="flash", block_k=5)
  ref = attention(q, k, v, implementation="xla")
  np.testing.assert_allclose(jax.jit(f)(q, k, v), ref, rtol=1e-5, atol=1e-6)
  vm = jax.vmap(lambda q, k, v: f(q[None], k[None], v[None])[0])(q, k, v)
  np.testing.assert_allclose(vm, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad,match", [
    (dict(q=jnp.ones((2, 3, 4))), "rank 4"),
    (dict(k=jnp.ones((2, 5, 3, 8)), v=jnp.ones((2, 5, 3, 8))), "not a multiple"),
    (dict(v=jnp.ones((2, 6, 2, 8))), "differ in shape"),
    (dict(mask=jnp.ones((2, 1, 1, 5))), "boolean"),
    (dict(mask=jnp.ones((2, 1, 1, 7), bool)), "does not broadcast"),
    (dict(implementation="fast"), "unknown attention implementation"),
    (dict(block_k=0), "block_k"),
])
def test_bad_input_is_a_clear_error(bad, match):
  args = dict(q=jnp.ones((2, 3, 4, 8)), k=jnp.ones((2, 5, 2, 8)), v=jnp.ones((2, 5, 2, 8)))
  kwargs = {key: bad.pop(key) for key in list(bad) if key not in args}
  args.update(bad)
  with pytest.raises((ValueError, TypeError), match=match):
    attention(args["q"], args["k"], args["v"], **kwargs)
