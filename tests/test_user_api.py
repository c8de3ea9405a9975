"""The library as a user imports it: README's "Use" snippets (read from README.md, so the
test breaks when the README drifts), a 2-layer pre-LN Transformer of our own trained under
several policies, the public names and their docstrings, and one-line misuse errors."""

import contextlib
import io
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import lowmem_jax
from lowmem_jax import MemoryPolicy, ms_layer_norm
from lowmem_jax.attention import attention
from lowmem_jax.memory import peak_buffers, saved_residuals, step_memory
from lowmem_jax.reversible import reversible_stack
from models.attention import SelfAttention
from models.mlp import Mlp
from models.norm import Norm
from models.sites import seed_sites
from models.stack import BlockStack

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def use_snippets() -> list[str]:
  """The ```python blocks of README's "## Use" section, in order."""
  text = README.read_text()
  section = text.split("\n## Use\n", 1)[1].split("\n## ", 1)[0]
  return re.findall(r"```python\n(.*?)```", section, re.S)


def run_snippet(code: str, scope: dict) -> str:
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    exec(compile(code, str(README), "exec"), scope)
  return out.getvalue()


# ----------------------------------------------------------------------------- README
def test_readme_use_snippets_run_as_written(tmp_path):
  snippets = use_snippets()
  assert len(snippets) == 3, "README's Use section changed: update this test"
  scope: dict = {}
  printed = run_snippet(snippets[0], scope)
  # "one uint8 array, n/4 bytes"
  n = 8 * 197 * 768
  assert re.search(rf"uint8\[{n // 4}\]\s+{n // 4:,}", printed), printed
  assert re.search(r"total\s+[\d,]+\s+1 arrays", printed), printed
  assert scope["act"] is lowmem_jax.regelu2 and scope["norm"] is ms_layer_norm
  run_snippet(snippets[1], scope)  # own block under lowmem, after the first (as read)
  assert all(np.isfinite(g).all() for g in jax.tree.leaves(scope["grads"]))

  # Models: a real HF directory where the snippet names one; vit-tiny for vit-b16 (time)
  from models import hf, vit
  hf.save_pretrained(vit.ViT("vit-tiny"), tmp_path / "hf-vit")
  code = (snippets[2].replace('"vit-b16"', '"vit-tiny"')
          .replace('"path/to/hf-vit"', repr(str(tmp_path / "hf-vit")))
          .replace('"out/"', repr(str(tmp_path / "out"))))
  run_snippet(code, {})
  assert (tmp_path / "out" / "model.safetensors").exists()
  assert hf.load_pretrained(tmp_path / "out").cfg == vit.config("vit-tiny")


def test_readme_comments_on_the_plain_functions_hold():
  x = jnp.linspace(-5.0, 5.0, 101)
  exact = MemoryPolicy.parse("baseline").activation_fn("gelu")
  np.testing.assert_allclose(exact(x), jax.nn.gelu(x, approximate=False), rtol=1e-6, atol=1e-7)
  assert MemoryPolicy.parse("lowmembp").merges_norm_affine
  assert not MemoryPolicy.parse("baseline").merges_norm_affine


# ----------------------------------------------------------------------------- own model
D, HEADS, MLP, LAYERS = 16, 2, 32, 2


class PlainBlock(nnx.Module):
  """Pre-LN block on the policy's plain functions (``reference``: jnp and jax.nn only)."""

  def __init__(self, policy, rngs, reference=False):
    self.policy, self.reference = policy, reference
    self.affine = reference or not policy.merges_norm_affine
    if self.affine:
      self.scales = nnx.Param(1.0 + 0.1 * jax.random.normal(rngs.params(), (2, D)))
      self.biases = nnx.Param(0.1 * jax.random.normal(rngs.params(), (2, D)))
    self.qkv, self.out = nnx.Linear(D, 3 * D, rngs=rngs), nnx.Linear(D, D, rngs=rngs)
    self.fc1, self.fc2 = nnx.Linear(D, MLP, rngs=rngs), nnx.Linear(MLP, D, rngs=rngs)

  def norm(self, x, i):
    if self.reference:
      mean = x.mean(-1, keepdims=True)
      var = ((x - mean) ** 2).mean(-1, keepdims=True)
      return (x - mean) / jnp.sqrt(var + 1e-6) * self.scales[i] + self.biases[i]
    fn = self.policy.norm_fn("layer")
    return fn(x, self.scales[i], self.biases[i], 1e-6) if self.affine else fn(x, 1e-6)

  def __call__(self, x):
    b, n, _ = x.shape
    q, k, v = (t.reshape(b, n, HEADS, D // HEADS)
               for t in jnp.split(self.qkv(self.norm(x, 0)), 3, axis=-1))
    if self.reference:
      s = jnp.einsum("bnhd,bmhd->bhnm", q, k) / np.sqrt(D // HEADS)
      o = jnp.einsum("bhnm,bmhd->bnhd", jax.nn.softmax(s, axis=-1), v)
    else:
      o = attention(q, k, v)
    x = x + self.out(o.reshape(b, n, D))
    h = self.fc1(self.norm(x, 1))
    act = (lambda h: jax.nn.gelu(h, approximate=False)) if self.reference else \
        self.policy.activation_fn("gelu")
    return x + self.fc2(act(h))


class ModuleBlock(nnx.Module):
  """Pre-LN block from the modules that hold a policy's state (any policy)."""

  def __init__(self, policy, rngs):
    self.norm1, self.norm2 = Norm(D, policy=policy), Norm(D, policy=policy)
    self.attn = SelfAttention(D, HEADS, policy=policy, rngs=rngs)
    self.mlp = Mlp(D, MLP, policy=policy, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.norm1(x))
    return x + self.mlp(self.norm2(x))


class Net(nnx.Module):
  """``LAYERS`` blocks, then a classifier on the mean token: blocks in a Python loop, or
  (``policy``) in :class:`models.stack.BlockStack` (one scanned block: half the compile)."""

  def __init__(self, make_block, rngs, policy=None):
    if policy is None:
      self.blocks = nnx.List([make_block(rngs) for _ in range(LAYERS)])
    else:
      self.blocks = BlockStack(make_block, LAYERS, policy, rngs)
    self.head = nnx.Linear(D, 3, rngs=rngs)
    seed_sites(self, rngs)

  def __call__(self, x):
    if isinstance(self.blocks, BlockStack):
      x = self.blocks(x)
    else:
      for block in self.blocks:
        x = block(x)
    return self.head(x.mean(axis=1))


def net(spec, kind="plain"):
  policy = MemoryPolicy.parse(spec)
  if kind == "module":
    return Net(lambda r: ModuleBlock(policy, r), nnx.Rngs(0), policy)
  return Net(lambda r: PlainBlock(policy, r, reference=kind == "reference"), nnx.Rngs(0))


X = jax.random.normal(jax.random.key(1), (4, 6, D))
Y = jnp.array([0, 1, 2, 1])


def loss_fn(model, x, y):
  logp = jax.nn.log_softmax(model(x))
  return -jnp.take_along_axis(logp, y[:, None], axis=1).mean()


def sgd_losses(model, steps=3, lr=0.3):
  @nnx.jit
  def step(model, x, y):
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p, g: p - lr * g, params, grads))
    return loss
  return [float(step(model, X, Y)) for _ in range(steps)]


@pytest.mark.parametrize("spec,kind", [("baseline", "plain"), ("lowmembp", "plain"),
                                       ("mesa8", "module"), ("lowmem", "module")])
def test_own_model_trains(spec, kind):
  losses = sgd_losses(net(spec, kind))
  assert np.isfinite(losses).all() and losses[-1] < losses[0], losses


def test_own_model_baseline_gradients_equal_plain_autodiff():
  """fp32 at ``highest`` (conftest): the lean baseline's functions are the exact ones."""
  grads = [nnx.jit(nnx.grad(loss_fn))(net("baseline", kind), X, Y)
           for kind in ("plain", "reference")]
  ours, ref = (jax.tree.leaves(g) for g in grads)
  assert len(ours) == len(ref) == LAYERS * 10 + 2
  for a, b in zip(ours, ref):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("spec", ["mesa8", "wta-crs", "lowmem"])
def test_a_carried_norm_output_read_as_an_array_names_as_array(spec):
  """Under a stateful policy a Norm's output is carried (its code or sample) to the
  library's linears; read as an array in the user's own code (a pooled head, indexing,
  arithmetic, nnx.Linear) it is one error naming models.sites.as_array, which gives the
  value (before: "'QTensor' object has no attribute 'mean'", "not a valid JAX type")."""
  from models.sites import as_array
  x = jax.random.normal(jax.random.key(0), (2, 5, 8))
  norm = Norm(8, policy=spec)
  seed_sites(norm, nnx.Rngs(0))
  y = norm(x)
  assert (y.shape, y.dtype, y.ndim) == ((2, 5, 8), jnp.float32, 3)
  head = nnx.Linear(8, 3, rngs=nnx.Rngs(0))
  for misread in (lambda: y.mean(1), lambda: y[:, 0], lambda: y + 1, lambda: 2 * y,
                  lambda: y @ jnp.ones((8, 3)), lambda: np.asarray(y), lambda: head(y)):
    with pytest.raises((TypeError, AttributeError), match=r"of a (QTensor|SampledTensor): .*"
                       r"read its value with models\.sites\.as_array\(x\)"):
      misread()
  np.testing.assert_allclose(as_array(y), Norm(8)(x), rtol=1e-6, atol=1e-6)


def test_memory_tools_take_an_nnx_model():
  model = net("lowmembp")
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(params, x):
    return loss_fn(nnx.merge(graphdef, params, rest), x, Y)

  def step(params, x):
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, jax.grad(loss)(params, x))

  kept = saved_residuals(loss, params, X)
  assert kept.total_bytes > 0 and any(r.dtype == "uint8" for r in kept.items)  # 2-bit codes
  assert step_memory(step, params, X).temp > 0
  assert peak_buffers(step, params, X).table()


# ----------------------------------------------------------------------------- public names
@pytest.mark.parametrize("name", lowmem_jax.__all__)
def test_public_names_import(name):
  scope: dict = {}
  exec(f"from lowmem_jax import {name}", scope)
  assert scope[name] is getattr(lowmem_jax, name)


@pytest.mark.parametrize("name", ["regelu2", "resilu2", "ms_layer_norm", "ms_rms_norm"])
def test_op_docstrings_say_what_backward_keeps_and_name_real_arguments(name):
  doc = getattr(lowmem_jax, name).__doc__
  assert "Saves for backward" in doc
  assert "``kind``" not in doc  # the factory's argument, not this function's


# ----------------------------------------------------------------------------- misuse
Q = jnp.ones((2, 8, 4, 16))
MISUSE = {
    "norm kind": (lambda: MemoryPolicy.parse("lowmembp").norm_fn("batch"),
                  "unknown norm kind 'batch'"),
    "policy": (lambda: MemoryPolicy.parse("lowmem-bp"), "unknown preset 'lowmem-bp'"),
    "affine to MS norm": (lambda: ms_layer_norm(jnp.ones((2, 16)), jnp.ones(16)),
                          "takes no scale or bias"),
    "stateful plain fn": (lambda: MemoryPolicy.parse("mesa8").activation_fn("gelu"),
                          "models.norm.Norm"),
    "attention rank": (lambda: attention(Q[0], Q[0], Q[0]), "rank 4"),
    "attention heads": (lambda: attention(Q, Q[:, :, :3], Q[:, :, :3]), "not a multiple"),
    "attention ints": (lambda: attention(*(Q.astype(jnp.int32),) * 3), "floating point"),
    "bf16 reversible streams": (
        lambda: reversible_stack(lambda p, x, k: x * p, lambda p, x, k: x * p, jnp.ones(2),
                                 jnp.ones(2), *(jnp.ones((2, 4), jnp.bfloat16),) * 2),
        "bfloat16.*float32 streams"),
}


@pytest.mark.parametrize("case", MISUSE)
def test_misuse_is_one_line_naming_the_problem(case):
  call, match = MISUSE[case]
  with pytest.raises((ValueError, TypeError), match=match) as info:
    call()
  assert len(str(info.value).splitlines()) == 1


def _stored(model):
  """``model`` with its MLPs' first kernel frozen and stored as nf4."""
  model.stack.blocks.mlp.fc1.store_kernel("nf4")
  return model


def test_model_dtype_and_export_misuse_name_the_problem(tmp_path):
  """A dtype typo or an int dtype (numpy's 'data type not understood', jax's 'Dtype must
  be inexact'), and save_pretrained of a LoRA model, of a RevViT (AttributeErrors deep in
  models.hf_state), into a file (FileExistsError) or of nf4-stored weights (written
  dequantized, silently): one ValueError line each."""
  from models import hf, lora, registry, vit
  for dtype, shown in (("float33", "'float33'"), (jnp.int32, "int32")):
    with pytest.raises(ValueError) as e:
      vit.ViT("vit-tiny", dtype=dtype)
    assert str(e.value) == (f"ViT: dtype {shown} is not a float dtype; use jnp.float32, "
                            "jnp.bfloat16 or jnp.float16 (or their names)")
  cases = [
      (lora.apply_lora(vit.ViT("vit-tiny")), tmp_path / "out",
       "save_pretrained: the model has LoRA adapters (on query, value), which HF's format "
       "has no place for: export lora.strip_lora(model) (merges them), or "
       "save_lora_merged(model, path, pretrained) (merged into the checkpoint's own tensors)"),
      (registry.build("revvit-tiny"), tmp_path / "out",
       "save_pretrained: RevViT has no Hugging Face format (those with one: ViT, Llama, "
       "Bert)"),
      (vit.ViT("vit-tiny"), README, f"save_pretrained: {README} is a file, not a directory"),
      (_stored(vit.ViT("vit-tiny")), tmp_path / "out",
       "save_pretrained: 1 frozen weight(s) are stored in a base dtype (e.g. stack.blocks.mlp."
       "fc1.kernel as nf4); the export would hold their dequantized values, not the "
       "checkpoint's: export a model loaded with base_dtype float32 (no store), or a LoRA "
       "model with save_lora_merged(model, path, pretrained)")]
  for model, path, message in cases:
    with pytest.raises(ValueError) as e:
      hf.save_pretrained(model, path)
    assert str(e.value) == message
  assert not (tmp_path / "out").exists()  # nothing written


def test_token_ids_past_a_table_are_an_error_in_eager_calls():
  """An eager call with an id past the vocabulary, a negative id or a BERT token type
  past its types names the index and the table (under jit a gather out of range is NaN
  rows, silently); ids in range and jitted calls are untouched."""
  from models import bert, llama
  model = llama.Llama(llama.config("llama-tiny"), "baseline", dtype=jnp.float32)
  for ids, bad in (([[1, 2, 256]], 256), ([[1, -1]], -1)):
    with pytest.raises(ValueError) as e:
      model(jnp.asarray(ids))
    assert str(e.value) == (f"Embed: index {bad} is out of range for a table of 256 rows "
                            "(ids must be 0..255)")
  model.embed.store_table("int8")  # a stored table is checked the same way
  with pytest.raises(ValueError, match="index 256 is out of range"):
    model(jnp.asarray([[256]]))
  assert model(jnp.asarray([[0, 255]])).shape == (1, 2, 256)
  assert np.isnan(nnx.jit(lambda m, t: m(t))(model, jnp.asarray([[256]]))).all()
  encoder = bert.Bert(bert.config("bert-tiny"), dtype=jnp.float32)
  tokens = jnp.ones((1, 4), jnp.int32)
  with pytest.raises(ValueError, match="index 2 is out of range for a table of 2 rows"):
    encoder(tokens, jnp.ones_like(tokens), token_types=2 * tokens)  # BERT has 2 types
