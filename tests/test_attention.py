"""Flash attention vs jax.nn.dot_product_attention (XLA): values, grads, residuals, memory;
the dispatch decision ("auto", "cudnn" refusals) on CPU; the padded cuDNN path's padding
logic (run through XLA on CPU); every model preset's attention at N = 17 .. 2048 on GPU."""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from lowmem_jax import attention as attn
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


def test_flash_propagates_nan_like_softmax():
  """A NaN in a query row gives NaN in that row's output (not a silent 0), as xla does."""
  q, k, v = (jax.random.normal(jax.random.key(i), (1, 8, 2, 4)) for i in range(3))
  q = q.at[0, 3, 1, 0].set(jnp.nan)
  for implementation in ("flash", "xla"):
    out = np.asarray(attention(q, k, v, implementation=implementation))
    assert np.all(np.isnan(out[0, 3, 1])), implementation
    assert np.all(np.isfinite(np.delete(out[0, :, 1], 3, axis=0)))


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
    pytest.skip("auto may pick cuDNN on GPU")
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


def test_key_blocks_are_equal_and_at_most_block_k():
  assert attn.key_block(197, 512) == 197
  assert attn.key_block(197, 128) == 99    # two blocks, one padded key (not 59)
  assert attn.key_block(1024, 512) == 512
  assert attn.key_block(600, 512) == 300
  assert attn.key_block(17, 4) == 4        # five blocks of at most 4: 4 x 5 = 20 >= 17
  assert attn.key_block(0, 512) == 1


@pytest.mark.parametrize("causal,mask_kind,n,block_k,masked", [
    (False, None, 40, 20, False),   # two whole blocks: nothing to mask
    (False, None, 40, 512, False),  # one block
    (False, None, 41, 20, False),   # three blocks of 14, one padded key: a -inf bias
    (True, None, 40, 20, True),
    (False, "padding", 40, 20, True),
])
def test_flash_builds_an_n_by_block_mask_only_for_causal_or_a_mask(causal, mask_kind, n,
                                                                     block_k, masked):
  # XLA:GPU constant-folded an all-true or padding mask into N x block buffers per head
  # (28 MiB at ViT-B LoRA's peak): without causal or a mask none is built (padded keys
  # get a -inf bias per key instead)
  q, k, v = _qkv(2, n, n, 2, 2, 8)
  mask = _padding_mask(2, n) if mask_kind else None
  jaxpr = jax.make_jaxpr(jax.grad(_loss("flash", causal, mask, block_k), argnums=(0, 1, 2)))(
      q, k, v)
  block = attn.key_block(n, block_k)

  def selects(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "select_n" and eqn.outvars[0].aval.shape[-2:] == (n, block):
        yield eqn
    for sub in jax.extend.core.subjaxprs(jaxpr):
      yield from selects(sub)

  assert any(True for _ in selects(jaxpr.jaxpr)) == masked


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
    (dict(q=jnp.ones((2, 3, 4, 8), jnp.int32), k=jnp.ones((2, 5, 2, 8), jnp.int32),
          v=jnp.ones((2, 5, 2, 8), jnp.int32)), "must be floating point, got int32"),
    (dict(causal="yes"), "causal must be a Python bool, got 'yes'"),
    (dict(causal=jnp.array(True)), "causal must be a Python bool"),
])
def test_bad_input_is_a_clear_error(bad, match):
  args = dict(q=jnp.ones((2, 3, 4, 8)), k=jnp.ones((2, 5, 2, 8)), v=jnp.ones((2, 5, 2, 8)))
  kwargs = {key: bad.pop(key) for key in list(bad) if key not in args}
  args.update(bad)
  with pytest.raises((ValueError, TypeError), match=match):
    attention(args["q"], args["k"], args["v"], **kwargs)


# ----------------------------------------------------------------------------- dispatch
H100 = dict(backend="gpu", cudnn_version=90800, compute_capability=(9, 0))
A100 = dict(backend="gpu", cudnn_version=90800, compute_capability=(8, 0))


def _shapes(n, m=None, heads=12, kv_heads=None, d=64, b=2):
  m = n if m is None else m
  return (b, n, heads, d), (b, m, heads if kv_heads is None else kv_heads, d)


def _choose(n, m=None, heads=12, kv_heads=None, d=64, dtype=jnp.bfloat16, causal=False,
            mask_shape=None, **platform):
  return attn.choose_implementation(*_shapes(n, m, heads, kv_heads, d), dtype, causal=causal,
                                    mask_shape=mask_shape, **(platform or H100))


@pytest.mark.parametrize("n", [66, 198, 1024, 2048])
@pytest.mark.parametrize("causal,heads,kv_heads,d", [
    (False, 12, 12, 64),    # ViT-B
    (True, 32, 32, 128),    # LLaMA-7B
    (True, 4, 2, 16),       # llama-tiny: GQA
    (True, 32, 1, 128),     # multi-query
])
def test_auto_takes_cudnn_where_it_accepts_the_shape(n, causal, heads, kv_heads, d):
  for dtype in (jnp.bfloat16, jnp.float16):
    choice = _choose(n, heads=heads, kv_heads=kv_heads, d=d, dtype=dtype, causal=causal)
    assert choice == attn.Choice("cudnn", ""), choice


@pytest.mark.parametrize("n,implementation", [
    (17, "flash"), (63, "flash"), (65, "cudnn_padded"), (197, "cudnn_padded"),
    (577, "cudnn_padded")])
def test_odd_lengths_are_refused_and_auto_pads_them_where_cudnn_measured_faster(
    n, implementation):
  """AUTO_GPU_TABLE["paddable"], from the H100's attention bench: ours up to 64."""
  choice = _choose(n)
  assert choice.implementation == implementation
  assert f"sequence length Q {n}, KV {n}" in choice.reason
  assert attn.cudnn_refusal(*_shapes(n), jnp.bfloat16, **H100, padded=True) is None
  assert "Q 16, KV 17" in _choose(16, 17).reason  # either length odd


@pytest.mark.parametrize("kwargs,implementation,reason", [
    (dict(dtype=jnp.float32), "flash", "dtype float32"),
    (dict(dtype=jnp.float32, n=17), "flash", "dtype float32"),   # padding does not help
    (dict(d=20), "flash", "head dim 20"),
    (dict(d=256), "cudnn", ""),                                  # Hopper, cuDNN >= 9.5
    (dict(d=256, **A100), "flash", "up to 128"),
    (dict(d=256, backend="gpu", cudnn_version=90400, compute_capability=(9, 0)), "flash",
     "up to 128"),
    (dict(d=256, backend="gpu", cudnn_version=90800, compute_capability=None), "flash",
     "up to 128"),                                              # unknown GPU: conservative
    (dict(backend="cpu"), "flash", "backend 'cpu'"),
    (dict(backend="tpu", cudnn_version=90800), "flash", "backend 'tpu'"),
    (dict(backend="gpu", cudnn_version=None), "flash", "no cuDNN"),
    (dict(backend="gpu", cudnn_version=8903), "flash", "older than 8904"),
    (dict(backend="gpu", cudnn_version=8904), "cudnn", ""),
    (dict(backend="gpu", cudnn_version=91000, compute_capability=(10, 3)), "flash", "10.3"),
    (dict(backend="gpu", cudnn_version=91100, compute_capability=(10, 3)), "cudnn", ""),
    (dict(mask_shape=(2, 1, 1, 198)), "flash", "broadcasts over queries or keys"),
    (dict(mask_shape=(2, 12, 198, 198)), "flash", "N x M bias"),
    (dict(mask_shape=(2, 1, 197, 197), n=197), "flash", "sequence length Q 197"),
    (dict(causal=True, m=256), "flash", "causal with N 198 != M 256"),
    (dict(m=256), "cudnn", ""),                                   # cross-length, not causal
])
def test_dispatch_decision(kwargs, implementation, reason):
  kwargs = dict(kwargs)
  n = kwargs.pop("n", 198)
  platform = {key: kwargs.pop(key) for key in list(kwargs)
              if key in ("backend", "cudnn_version", "compute_capability")}
  choice = _choose(n, **kwargs, **platform)
  assert choice.implementation == implementation, choice
  assert reason in choice.reason if reason else choice.reason == "", choice


def test_explicit_cudnn_takes_a_full_mask_auto_does_not():
  q_shape, k_shape = _shapes(198)
  assert attn.cudnn_refusal(q_shape, k_shape, jnp.bfloat16, mask_shape=(2, 1, 198, 198),
                            **H100) is None
  assert "broadcasts" in attn.cudnn_refusal(q_shape, k_shape, jnp.bfloat16,
                                            mask_shape=(2, 1, 1, 198), **H100)


@pytest.mark.parametrize("n", [2, 18, 64])
def test_short_even_lengths_go_to_ours_with_the_reason(n):
  """AUTO_GPU_TABLE["as_is"]: cuDNN takes the shape, but at N <= 64 ours measured faster."""
  choice = _choose(n)
  assert choice == attn.Choice("flash", f"length {n}: flash measured faster (AUTO_GPU_TABLE)")
  assert _choose(66).implementation == "cudnn"


def test_auto_table_rows_pick_by_length(monkeypatch):
  monkeypatch.setitem(attn.AUTO_GPU_TABLE, "paddable", ((256, "cudnn_padded"), (None, "flash")))
  assert _choose(197).implementation == "cudnn_padded"
  assert _choose(577).implementation == "flash"
  assert _choose(198).implementation == "cudnn"       # "as_is" row untouched
  assert _choose(197, mask_shape=(2, 1, 1, 197)).implementation == "flash"  # no padding masks
  assert _choose(197, dtype=jnp.float32).implementation == "flash"


def test_auto_never_picks_a_path_that_keeps_n_by_n_or_is_refused(monkeypatch):
  monkeypatch.setitem(attn.AUTO_GPU_TABLE, "paddable", ((None, "cudnn_padded"),))
  platforms = [H100, A100, dict(backend="cpu"), dict(backend="gpu", cudnn_version=None)]
  for platform in platforms:
    for dtype in (jnp.bfloat16, jnp.float32):
      for n, m in [(1, 1), (17, 17), (17, 30), (64, 64), (197, 197)]:
        for causal in (False, True):
          for mask in (None, (2, 1, 1, m), (2, 12, n, m)):
            for d in (16, 64, 72, 256):
              choice = _choose(n, m, d=d, dtype=dtype, causal=causal, mask_shape=mask,
                               **platform)
              assert choice.implementation in ("cudnn", "cudnn_padded", "flash")
              if choice.implementation != "flash":
                assert attn.cudnn_refusal(
                    *_shapes(n, m, d=d), dtype, mask_shape=mask, **platform,
                    padded=choice.implementation == "cudnn_padded") is None, choice


def test_padded_length():
  assert [attn.padded_length(n) for n in (1, 2, 17, 18, 197, 577, 1024)] == [
      2, 2, 18, 18, 198, 578, 1024]


def test_choose_implementation_defaults_to_this_backend():
  choice = attn.choose_implementation((2, 196, 12, 64), (2, 196, 12, 64), jnp.bfloat16)
  assert choice == attn.choose_implementation((2, 196, 12, 64), (2, 196, 12, 64),
                                              jnp.bfloat16, backend=attn._platform()[0],
                                              cudnn_version=attn.cudnn_version(),
                                              compute_capability=attn.compute_capability())


def test_runtime_queries_are_none_off_gpu():
  if jax.default_backend() == "gpu":
    pytest.skip("on GPU they return the real versions")
  assert attn.cudnn_version() is None and attn.compute_capability() is None


@pytest.mark.parametrize("implementation", ["cudnn", "cudnn_padded"])
def test_cudnn_on_a_refused_shape_is_a_clear_error_before_jax(monkeypatch, implementation):
  q, k, v = (t.astype(jnp.bfloat16) for t in _qkv(2, 17, 17, 4, 4, 64))
  if implementation == "cudnn":
    monkeypatch.setattr(attn, "_platform", lambda: ("gpu", 90800, (9, 0)))
    match = r"cuDNN refuses q\[2, 17, 4, 64\] k\[2, 17, 4, 64\] bfloat16.*sequence length Q 17"
  else:  # padding fixes the length, not the dtype
    monkeypatch.setattr(attn, "_platform", lambda: ("gpu", 90800, (9, 0)))
    q, k, v = (t.astype(jnp.float32) for t in (q, k, v))
    match = r"cuDNN refuses q\[2, 17, 4, 64\].*float32.*dtype float32"
  called = []
  monkeypatch.setattr(jax.nn, "dot_product_attention", lambda *a, **kw: called.append(1))
  for run in (lambda: attention(q, k, v, implementation=implementation),
              lambda: jax.jit(functools.partial(attention, implementation=implementation))(
                  q, k, v),
              lambda: jax.grad(lambda q: jnp.sum(attention(
                  q, k, v, implementation=implementation).astype(jnp.float32)))(q)):
    with pytest.raises(ValueError, match=match):
      run()
  assert called == []   # refused before jax's attention was called


def test_cudnn_on_cpu_names_the_backend():
  if jax.default_backend() != "cpu":
    pytest.skip("CPU only")
  q, k, v = _qkv(1, 8, 8, 2, 2, 8, jnp.bfloat16)
  with pytest.raises(ValueError, match=r"q\[1, 8, 2, 8\].*backend 'cpu'"):
    attention(q, k, v, implementation="cudnn")


def test_auto_on_a_gpu_refused_shape_runs_flash(monkeypatch):
  """Simulated H100 (decision only): N = 17 bf16 goes to ours, which runs anywhere."""
  monkeypatch.setattr(attn, "_platform", lambda: ("gpu", 90800, (9, 0)))
  q, k, v = _qkv(2, 17, 17, 4, 4, 64, jnp.bfloat16)
  np.testing.assert_array_equal(attention(q, k, v, implementation="auto"),
                                attention(q, k, v, implementation="flash"))


# ----------------------------------------------------------------------------- padded path
@pytest.mark.parametrize("causal,heads,kv_heads,mask_kind,n,m", [
    (True, 4, 4, None, 17, 17),         # ViT digits length
    (False, 4, 2, None, 15, 22),        # GQA, only the query padded
    (True, 6, 1, None, 9, 9),           # multi-query, causal
    (False, 4, 2, "padding", 19, 19),   # key-padding mask [B, 1, 1, M]
    (True, 4, 4, "full", 13, 13),       # per-head [B, H, N, M] mask, causal
    (False, 2, 2, None, 1, 7),          # a single query
])
def test_padded_path_matches_xla(causal, heads, kv_heads, mask_kind, n, m):
  """The padding/slicing of "cudnn_padded", run through XLA's attention in fp32."""
  b, d = 2, 8
  q, k, v = _qkv(b, n, m, heads, kv_heads, d, seed=3)
  mask = {None: None, "padding": _padding_mask(b, m),
          "full": (jax.random.uniform(jax.random.key(2), (b, heads, n, m)) > 0.4
                   ).at[..., 0].set(True)}[mask_kind]
  weights = jnp.cos(jnp.arange(b * n * heads * d, dtype=jnp.float32)).reshape(b, n, heads, d)

  def loss(fn):
    return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v) * weights),
                                      argnums=(0, 1, 2)))

  padded = loss(lambda q, k, v: attn._padded(q, k, v, mask, causal, 0.35, "xla"))
  ref = loss(lambda q, k, v: attention(q, k, v, causal=causal, mask=mask, scale=0.35,
                                       implementation="xla"))
  (lp, gp), (lr, gr) = padded(q, k, v), ref(q, k, v)
  # The loss sums b*n*heads*d products o*w that cancel (w = cos): the two paths (and the
  # CPU compiler at another optimization level) sum in other orders, so their rounding
  # differs by up to ~N*eps*sum|o*w|, not eps*|loss|. |o| <= max|v| (attention averages
  # rows of v), so sum|o*w| <= sum|w| * max|v|; 1e-6 of that is ~8 ulps of the absolute
  # sum (measured: 3.6e-5 at -O0 against a bound of ~2.4e-3). The gradients below are the
  # elementwise check.
  assert abs(float(lp) - float(lr)) <= 1e-6 * float(jnp.sum(jnp.abs(weights))
                                                     * jnp.max(jnp.abs(v))), (lp, lr)
  for a, r in zip(gp, gr):
    assert a.shape == r.shape
    np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-6)


def test_padded_keys_would_change_the_result_without_the_length_mask():
  """What the padded-path test relies on: the zero key padding adds is visible unless the
  key-length mask hides it."""
  q, k, v = _qkv(2, 17, 17, 4, 4, 8, seed=3)

  @jax.jit
  def unmasked_and_ref(q, k, v):
    pad = lambda x: attn._pad_axis(x, 1, 18)
    unmasked = jax.nn.dot_product_attention(pad(q), pad(k), pad(v))[:, :17]
    return unmasked, attn._padded(q, k, v, None, False, 1 / np.sqrt(8), "xla"), (
        jax.nn.dot_product_attention(q, k, v))

  unmasked, padded, ref = unmasked_and_ref(q, k, v)
  assert np.abs(np.asarray(unmasked - ref)).max() > 1e-3
  np.testing.assert_allclose(padded, ref, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- GPU
def _preset_geometries():
  """(name, heads, kv_heads, head_dim, causal, key mask) of every model preset the tests
  and the README use (rev* presets share their base's attention; roberta-* BERT's)."""
  from models import bert, llama, vit
  out = {}
  for name in vit.PRESETS:
    cfg = vit.config(name)
    out.setdefault((cfg.num_heads, cfg.num_heads, cfg.dim // cfg.num_heads, False, False),
                   name)
  for name in llama.PRESETS:
    cfg = llama.config(name)
    geometry = (cfg.num_heads, cfg.num_kv_heads, cfg.dim // cfg.num_heads, True)
    out.setdefault(geometry + (False,), name)
    if name == "llama-tiny":  # the lm task's padded batches: a [B, 1, 1, T] key mask
      out.setdefault(geometry + (True,), name + "+mask")
  for name in ("bert-base", "bert-tiny"):
    cfg = bert.config(name)
    out.setdefault((cfg.num_heads, cfg.num_heads, cfg.dim // cfg.num_heads, False, True),
                   name)
  return [(name,) + geometry for geometry, name in out.items()]


def _rel_err(a, ref):
  """Relative RMS error (stable where a max-abs error of bf16 results is noisy)."""
  diff = a.astype(jnp.float32) - ref.astype(jnp.float32)
  return float(jnp.linalg.norm(diff.ravel()) / jnp.linalg.norm(ref.astype(jnp.float32).ravel()))


def _fwd_bwd(implementation, causal, mask, cotangent):
  def f(q, k, v):
    o, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, causal=causal, mask=mask,
                                               implementation=implementation), q, k, v)
    return (o,) + vjp(cotangent.astype(o.dtype))
  return jax.jit(f)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="GPU only")
@pytest.mark.parametrize("n", [17, 197, 577, 1024, 2048])
@pytest.mark.parametrize("name,heads,kv_heads,d,causal,with_mask", _preset_geometries())
def test_gpu_auto_runs_every_preset_in_bf16(name, heads, kv_heads, d, causal, with_mask, n):
  """attention("auto") in bf16, forward and backward, about as close to the fp32 XLA
  result as XLA's own bf16 attention (relative RMS error within twice XLA's, or 1%; on
  CPU ours measured 0.8-1.2x XLA's), and it keeps no N x N array."""
  b = 2
  q, k, v = _qkv(b, n, n, heads, kv_heads, d, seed=n)
  mask = _padding_mask(b, n) if with_mask else None
  cotangent = jax.random.normal(jax.random.key(7), q.shape)
  ref = _fwd_bwd("xla", causal, mask, cotangent)(q, k, v)
  bf16 = tuple(t.astype(jnp.bfloat16) for t in (q, k, v))
  got = _fwd_bwd("auto", causal, mask, cotangent)(*bf16)
  xla = _fwd_bwd("xla", causal, mask, cotangent)(*bf16)
  choice = attn.choose_implementation(
      q.shape, k.shape, jnp.bfloat16, causal=causal,
      mask_shape=None if mask is None else mask.shape, backend="gpu",
      cudnn_version=attn.cudnn_version(), compute_capability=attn.compute_capability())
  for what, g, x, r in zip(("o", "dq", "dk", "dv"), got, xla, ref):
    assert g.dtype == jnp.bfloat16 and g.shape == r.shape
    assert _rel_err(g, r) <= max(2 * _rel_err(x, r), 1e-2), (
        what, choice, _rel_err(g, r), _rel_err(x, r))
  if n >= 577:  # N > head_dim: an N x N residual would be the largest thing saved
    res = saved_residuals(lambda q, k, v: jnp.sum(attention(
        q, k, v, causal=causal, mask=mask).astype(jnp.float32) ** 2), *bf16)
    assert not [r for r in res.items if int(np.prod(r.shape)) >= b * heads * n * n], (
        choice, res.table())


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="GPU only")
@pytest.mark.parametrize("n,causal", [(17, False), (197, False), (577, True), (1024, True)])
def test_gpu_cudnn_padded_matches_xla(n, causal):
  """The padded path on cuDNN itself (auto may not pick it until the bench says so)."""
  if attn.cudnn_refusal(*_shapes(n, heads=4), jnp.bfloat16, backend="gpu", padded=True,
                        cudnn_version=attn.cudnn_version(),
                        compute_capability=attn.compute_capability()) is not None:
    pytest.skip("no cuDNN")
  q, k, v = _qkv(2, n, n, 4, 4, 64, seed=n)
  cotangent = jax.random.normal(jax.random.key(7), q.shape)
  ref = _fwd_bwd("xla", causal, None, cotangent)(q, k, v)
  bf16 = tuple(t.astype(jnp.bfloat16) for t in (q, k, v))
  got = _fwd_bwd("cudnn_padded", causal, None, cotangent)(*bf16)
  xla = _fwd_bwd("xla", causal, None, cotangent)(*bf16)
  for what, g, x, r in zip(("o", "dq", "dk", "dv"), got, xla, ref):
    assert _rel_err(g, r) <= max(2 * _rel_err(x, r), 1e-2), (what, _rel_err(g, r),
                                                              _rel_err(x, r))


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="GPU only")
@pytest.mark.parametrize("n", [16, 17])
def test_gpu_cudnn_rule_matches_jax(n):
  """cudnn_refusal says what this jax/cuDNN does: if jax now trains odd lengths, the
  rule (CUDNN_SEQ_MULTIPLE) is stricter than needed; if it refuses even ones, too lax."""
  q, k, v = _qkv(2, n, n, 4, 4, 64, jnp.bfloat16)
  refused = attn.cudnn_refusal(q.shape, k.shape, q.dtype, backend="gpu",
                               cudnn_version=attn.cudnn_version(),
                               compute_capability=attn.compute_capability())
  grad = jax.jit(jax.grad(lambda q: jnp.sum(jax.nn.dot_product_attention(
      q, k, v, implementation="cudnn").astype(jnp.float32))))
  try:
    jax.block_until_ready(grad(q))
    jax_refused = None
  except NotImplementedError as e:
    jax_refused = str(e)
  assert (refused is None) == (jax_refused is None), (refused, jax_refused)
