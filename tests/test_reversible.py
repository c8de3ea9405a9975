"""Tests for lowmem_jax.reversible: reversible stacks (RevViT) and the PaReprop schedule."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowmem_jax.memory import saved_residuals
from lowmem_jax.norms import layer_norm
from lowmem_jax.reversible import SCHEDULES, layer_keys, reference_stack, reversible_stack

DIM, HIDDEN, BATCH, SEQ = 16, 32, 2, 8
TOL = dict(rtol=1e-5, atol=1e-5)
DROP = 0.25


# ----------------------------------------------------------------------------- blocks
def dropout(x, key):
  if key is None:
    return x
  keep = jax.random.bernoulli(key, 1.0 - DROP, x.shape)
  return jnp.where(keep, x / (1.0 - DROP), 0.0)


def mlp_block(p, x, key):
  """f: LayerNorm -> GELU MLP, scaled by an int32 per-layer counter, then dropout."""
  h = layer_norm(x, p["ln_scale"], p["ln_bias"])
  h = jax.nn.gelu(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
  h = h * (1.0 + 0.1 * p["calls"].astype(h.dtype))
  return dropout(h, key)


def attention_block(p, x, key):
  """g: LayerNorm -> single-head softmax self-attention, then dropout."""
  h = layer_norm(x, p["ln_scale"], p["ln_bias"])
  q, k, v = h @ p["wq"], h @ p["wk"], h @ p["wv"]
  a = jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2) / np.sqrt(DIM), axis=-1)
  return dropout((a @ v) @ p["wo"], key)


F, G = mlp_block, attention_block


def init_params(depth, seed=0):
  rng = np.random.default_rng(seed)

  def normal(*shape, scale=0.5):
    w = rng.standard_normal((depth,) + shape) * scale / np.sqrt(shape[0])
    return jnp.asarray(w.astype(np.float32))

  def norm_params():
    return dict(ln_scale=1.0 + normal(DIM, scale=0.4), ln_bias=normal(DIM, scale=0.4))

  params_f = dict(norm_params(), w1=normal(DIM, HIDDEN), b1=normal(HIDDEN, scale=0.5),
                  w2=normal(HIDDEN, DIM), b2=normal(DIM, scale=0.2),
                  calls=jnp.arange(depth, dtype=jnp.int32))
  params_g = dict(norm_params(), wq=normal(DIM, DIM), wk=normal(DIM, DIM),
                  wv=normal(DIM, DIM), wo=normal(DIM, DIM))
  return params_f, params_g


def inputs(seed=1):
  rng = np.random.default_rng(seed)
  x1, x2 = (jnp.asarray(rng.standard_normal((BATCH, SEQ, DIM)).astype(np.float32))
            for _ in range(2))
  return x1, x2


def make_key(kind, seed=0):
  return {"none": None, "typed": jax.random.key(seed), "raw": jax.random.PRNGKey(seed)}[kind]


def loss(stack, params_f, params_g, x1, x2, key):
  y1, y2 = stack(F, G, params_f, params_g, x1, x2, key)
  return jnp.sum(jnp.tanh(y1) * y2) + 0.5 * jnp.sum(y1 * y1) - jnp.sum(y2)


# "pareprop-stream" is PaReprop's arithmetic with a stream annotation: it has its own test
# below, not a second run of every case (suite time).
SCHEDULES = tuple(s for s in SCHEDULES if s != "pareprop-stream")
STACKS = {
    "reference": reference_stack,
    **{s: functools.partial(reversible_stack, schedule=s) for s in SCHEDULES},
}


# Many small scans get compiled here: XLA's backend (LLVM) at -O0 halves the CPU compile
# time and changes nothing these tests check (compiled temp bytes measured identical).
FAST_COMPILE = {"xla_backend_optimization_level": 0}


@functools.partial(jax.jit, compiler_options=FAST_COMPILE)
def outputs_and_grads(params_f, params_g, x1, x2, key):
  """Per stack: its output (y1, y2) and the loss gradients w.r.t. (params_f, params_g, x1, x2)."""
  return {name: (stack(F, G, params_f, params_g, x1, x2, key),
                 jax.grad(functools.partial(loss, stack), argnums=(0, 1, 2, 3),
                          allow_int=True)(params_f, params_g, x1, x2, key))
          for name, stack in STACKS.items()}


@functools.cache
def results(depth, key_kind):
  return outputs_and_grads(*init_params(depth), *inputs(), make_key(key_kind))


# (depth, key): deterministic blocks at odd and even depths, dropout with typed and raw keys.
CASES = [(1, "none"), (3, "none"), (8, "none"), (2, "raw"), (8, "typed")]


def assert_trees_close(actual, expected, **tol):
  flat_a, tree_a = jax.tree_util.tree_flatten_with_path(actual)
  flat_e, tree_e = jax.tree_util.tree_flatten_with_path(expected)
  assert tree_a == tree_e
  for (path, a), (_, e) in zip(flat_a, flat_e):
    assert a.shape == e.shape and a.dtype == e.dtype, jax.tree_util.keystr(path)
    if a.dtype != jax.dtypes.float0:
      np.testing.assert_allclose(a, e, err_msg=jax.tree_util.keystr(path), **tol)


def max_abs_diff(a, b):
  return max(float(jnp.max(jnp.abs(u - v))) for u, v in
             zip(jax.tree.leaves(a), jax.tree.leaves(b)) if u.dtype != jax.dtypes.float0)


# ----------------------------------------------------------------------------- keys, forward
def test_layer_keys_fold_in_layer_then_branch():
  assert layer_keys(None, 3) == (None, None)
  for key in (jax.random.key(7), jax.random.PRNGKey(7)):
    keys_f, keys_g = layer_keys(key, 3)
    assert keys_f.shape == keys_g.shape == (3,) + key.shape
    for i in range(3):
      layer = jax.random.fold_in(key, i)
      for stacked, branch in ((keys_f, 0), (keys_g, 1)):
        expected = jax.random.key_data(jax.random.fold_in(layer, branch))
        np.testing.assert_array_equal(jax.random.key_data(stacked[i]), expected)


def python_loop_stack(params_f, params_g, x1, x2, key):
  """The stack written out by hand, keys from the fold_in formula (independent of the module)."""
  depth = params_f["w1"].shape[0]
  for i in range(depth):
    layer = lambda tree: jax.tree.map(lambda a: a[i], tree)
    kf = kg = None
    if key is not None:
      kf = jax.random.fold_in(jax.random.fold_in(key, i), 0)
      kg = jax.random.fold_in(jax.random.fold_in(key, i), 1)
    x1 = x1 + F(layer(params_f), x2, kf)
    x2 = x2 + G(layer(params_g), x1, kg)
  return x1, x2


def test_reference_matches_python_loop():
  params_f, params_g = init_params(2)
  x1, x2 = inputs()
  key = jax.random.key(3)
  both = jax.jit(lambda *args: (reference_stack(F, G, *args), python_loop_stack(*args)),
                 compiler_options=FAST_COMPILE)
  out, expected = both(params_f, params_g, x1, x2, key)
  np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("depth,key_kind", CASES)
def test_forward_matches_reference(depth, key_kind, schedule):
  res = results(depth, key_kind)
  (y1, y2), (ref1, ref2) = res[schedule][0], res["reference"][0]
  assert y1.shape == y2.shape == (BATCH, SEQ, DIM)
  np.testing.assert_allclose(y1, ref1, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(y2, ref2, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("depth,key_kind", CASES)
def test_grads_match_reference(depth, key_kind, schedule):
  """params_f, params_g, x1, x2; with dropout the backward must replay forward's keys."""
  res = results(depth, key_kind)
  grads, ref = res[schedule][1], res["reference"][1]
  assert_trees_close(grads, ref, **TOL)
  # The int32 counter gets a float0 cotangent, shaped like the leaf.
  assert grads[0]["calls"].dtype == jax.dtypes.float0
  assert grads[0]["calls"].shape == (depth,)


def test_dropout_keys_matter():
  # The dropout cases above are only meaningful if the key moves the gradients far more
  # than the tolerance: a backward that did not replay forward's keys would fail them.
  ref = results(8, "typed")["reference"][1]
  other_key = outputs_and_grads(*init_params(8), *inputs(), make_key("typed", seed=1))
  assert max_abs_diff(other_key["reference"][1], ref) > 1e-2
  assert max_abs_diff(results(8, "none")["reference"][1], ref) > 1e-2


# ----------------------------------------------------------------------------- memory
def _residuals(stack, depth, key):
  params_f, params_g = init_params(depth)
  x1, x2 = inputs()
  return saved_residuals(lambda pf, pg, a, b: stack(F, G, pf, pg, a, b, key),
                         params_f, params_g, x1, x2)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_saved_residuals_do_not_grow_with_depth(schedule):
  key = jax.random.key(0)
  x_bytes = BATCH * SEQ * DIM * 4
  ref = []
  for depth in (2, 4, 8):
    res = _residuals(STACKS[schedule], depth, key)
    # Only the final (y1, y2): parameters and key are arguments, nothing per layer.
    assert [(r.shape, r.dtype) for r in res.items] == [((BATCH, SEQ, DIM), "float32")] * 2
    assert res.total_bytes == 2 * x_bytes
    ref.append(_residuals(reference_stack, depth, key).total_bytes)
  assert ref[0] < ref[1] < ref[2]
  assert ref[2] >= 3 * ref[0] and ref[0] > 10 * x_bytes


def _compiled_temp(stack, depth):
  params_f, params_g = init_params(depth)
  step = jax.jit(jax.grad(functools.partial(loss, stack), argnums=(0, 1), allow_int=True),
                 compiler_options=FAST_COMPILE)
  compiled = step.lower(params_f, params_g, *inputs(), None).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_compiled_temp_memory_flat_in_depth():
  # Measured on CPU (D=16), bytes: reference 87,536 -> 281,072 from 2 to 8 layers;
  # vanilla 23,352 and pareprop 37,504 at both depths. Tolerance: 1% of the reference's
  # growth (1.9 kB), below what keeping one [B, S, D] fp32 array per added layer would
  # add (6 x 512 B) and above the layer-sized index/key vectors a scan may hold (bytes).
  ref2, ref8 = (_compiled_temp(reference_stack, d) for d in (2, 8))
  assert ref8 > 2 * ref2
  for schedule in SCHEDULES:
    rev2, rev8 = (_compiled_temp(STACKS[schedule], d) for d in (2, 8))
    assert rev8 < ref8 / 3, schedule
    assert abs(rev8 - rev2) < 0.01 * (ref8 - ref2), schedule


# ----------------------------------------------------------------------------- errors
def test_bad_inputs_raise():
  params_f, params_g = init_params(3)
  x1, x2 = inputs()
  short_f = dict(params_f, w1=params_f["w1"][:2])
  with pytest.raises(ValueError, match="disagree on the layer axis"):
    reversible_stack(F, G, short_f, params_g, x1, x2)
  with pytest.raises(ValueError, match="disagree on the layer axis"):
    reference_stack(F, G, params_f, init_params(4)[1], x1, x2)
  with pytest.raises(ValueError, match="same shape"):
    reversible_stack(F, G, params_f, params_g, x1, x2[:, :4])
  with pytest.raises(ValueError, match="same dtype"):
    reversible_stack(F, G, params_f, params_g, x1, x2.astype(jnp.bfloat16))
  # 16-bit streams (blocks that keep their dtype): the rebuilt inputs would cancel
  f16, g16 = (lambda p, x, k, b=b: b(p, x, k).astype(x.dtype) for b in (F, G))
  for dtype in (jnp.bfloat16, jnp.float16):
    with pytest.raises(TypeError, match=f"streams x1, x2 are {jnp.dtype(dtype).name}.*float32"):
      reversible_stack(f16, g16, params_f, params_g, x1.astype(dtype), x2.astype(dtype))
  with pytest.raises(ValueError, match="unknown schedule 'fast'"):
    reversible_stack(F, G, params_f, params_g, x1, x2, schedule="fast")
  with pytest.raises(ValueError, match="scalar"):
    reversible_stack(F, G, dict(params_f, calls=jnp.int32(0)), params_g, x1, x2)
  with pytest.raises(ValueError, match="no leaves"):
    reversible_stack(F, G, {}, {}, x1, x2)
  with pytest.raises(ValueError, match="f must return an array of its input's shape and dtype"):
    reversible_stack(lambda p, x, k: x[..., :4], G, params_f, params_g, x1, x2)


# ----------------------------------------------------------------------------- transforms
def model_loss(stack, embed, params_f, params_g, x):
  """The stack inside a bigger model: an embedding in front, a loss behind, dropout on."""
  y1, y2 = stack(F, G, params_f, params_g, jnp.tanh(x @ embed), x, jax.random.key(5))
  return jnp.mean((y1 + y2) ** 2)


@functools.cache
def nested_results():
  """Per stack, under one jit: first-order grads, and a grad of a grad (reverse over reverse)."""
  params_f, params_g = init_params(2)
  x1, _ = inputs()
  embed = jnp.asarray(np.random.default_rng(3).standard_normal((DIM, DIM)).astype(np.float32))

  @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
  def run(embed, params_f, params_g, x):
    out = {}
    for name, stack in STACKS.items():
      first = jax.grad(model_loss, argnums=(1, 2, 3), allow_int=True)(
          stack, embed, params_f, params_g, x)
      # The custom VJP's backward is itself differentiated here.
      input_grad = lambda x: jax.grad(model_loss, argnums=4)(stack, embed, params_f, params_g, x)
      second = jax.grad(lambda x: jnp.sum(jnp.sin(input_grad(x))))(x)
      out[name] = first, second
    return out

  return run(embed, params_f, params_g, x1)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_under_jit_and_nested_in_grad(schedule):
  res = nested_results()
  (first, second), (ref_first, ref_second) = res[schedule], res["reference"]
  assert_trees_close(first, ref_first, **TOL)
  np.testing.assert_allclose(second, ref_second, **TOL)


def test_pareprop_stream_annotates_the_rebuild_and_equals_pareprop():
  """The rebuild goes out as one call under JAX's GPU stream annotation, not each op and
  nested call in it (XLA:GPU failed to compile those: a cycle), through the API of this
  jax (0.10's ``compute_on2``, 0.11's ``compute_on``: the context manager the first
  version used is gone in 0.11); CPU ignores it and runs the same arithmetic: equal to
  pareprop's gradients to rounding."""
  args = (*init_params(3), *inputs(), jax.random.key(2))
  out, texts = {}, {}
  for s in ("pareprop", "pareprop-stream"):
    grad = jax.grad(functools.partial(loss, functools.partial(reversible_stack, schedule=s)),
                    argnums=(0, 1, 2, 3), allow_int=True)
    lowered = jax.jit(grad, compiler_options=FAST_COMPILE).lower(*args)
    texts[s], out[s] = lowered.as_text(), lowered.compile()(*args)
  annotated = [line for line in texts["pareprop-stream"].splitlines()
               if "_xla_stream_annotation" in line]
  assert len(annotated) == 1 and "call @compute_on(" in annotated[0], annotated[:3]
  assert '_xla_stream_annotation = "1"' in annotated[0]
  assert "_xla_stream_annotation" not in texts["pareprop"]
  # The call moves fusion boundaries (with the suite's CPU flags), so a gradient's sum over
  # its BATCH * SEQ = 16 rows may run in another order: a reassociated fp32 sum of n terms
  # moves by <= n u sum|a_i| (u = 2^-24), ~n ulps of the leaf's largest entry: 16 ulps
  # (measured <= 2 over 6 seeds and depths; an absolute 1e-6 was half an ulp at |g| ~ 22)
  flat = zip(jax.tree.leaves(out["pareprop-stream"]), jax.tree.leaves(out["pareprop"]))
  for a, e in ((a, e) for a, e in flat if e.dtype != jax.dtypes.float0):
    assert a.shape == e.shape and a.dtype == e.dtype
    ulp = float(np.spacing(np.abs(np.asarray(e)).max()))
    np.testing.assert_allclose(a, e, rtol=0, atol=16 * ulp)
