"""LoRA under MS norms trains what peft trains: an adapter behind a merged norm reads the
norm's real output (``x_hat @ (g A) + s A``) and a head trained in full behind one is held
unmerged, so with the same checkpoint (non-trivial norm affines) and the same adapters,
``ms-bp`` (MS norms alone: every other backward exact) gives ``baseline``'s function, LoRA
gradients, steps and export, and peft's gradients. fp32, ``highest`` matmul precision."""

import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import make_hf_fixtures as fixtures
from models import hf, lora

HF = Path(__file__).parent / "data" / "hf"
# Every linear of each family: adapters behind a merged norm and behind none.
TARGETS = {"vit": "query,key,value,out,fc1,fc2",
           "bert": "query,key,value,out,fc1,fc2",
           "roberta": "query,key,value,out,fc1,fc2",
           "llama_untied": "query,key,value,out,gate,up,down",
           "llama_tied": "query,key,value,out,gate,up,down"}


def _inputs(name):
  if name == "vit":
    return (jnp.asarray(fixtures.vit_images()),)
  if name.startswith("llama"):
    return (jnp.asarray(fixtures.llama_tokens()),)
  cfg = hf.config_from_pretrained(HF / name)
  tokens, mask, types = fixtures.bert_batch(cfg.vocab_size, cfg.pad_token_id,
                                            cfg.type_vocab_size)
  return jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(types)


def _key(path):
  """A key of its own for each variable path (the same under every policy)."""
  return jax.random.key(zlib.crc32("/".join(map(str, path)).encode()))


def _model(name, policy):
  """The fixture under ``policy`` with LoRA r=4 on every linear (seed 0) and B made
  non-zero (the same values under every policy)."""
  model = hf.load_pretrained(HF / name, policy=policy, dtype=jnp.float32)
  lora.apply_lora(model, rank=4, alpha=8, targets=TARGETS[name])
  for path, var in nnx.iter_graph(model):
    if isinstance(var, lora.LoRAParam) and path[-1] == "lora_b":
      var[...] = 0.3 * jax.random.normal(_key(path), var[...].shape)
  return model


def _loss(model, inputs):
  out = model(*inputs)
  probe = jax.random.normal(jax.random.key(7), out.shape)
  return jnp.sum(out * probe) / out.size ** 0.5


def _trained(model):
  """``{path: value}`` of the LoRA trainables (adapters, a head trained in full)."""
  return {p: np.asarray(v.get_value()) for p, v in
          nnx.to_flat_state(nnx.state(model, lora.LoRAParam))}


def _grads(model, inputs):
  graphdef, params, rest = nnx.split(model, lora.LoRAParam, ...)
  grads = jax.jit(jax.grad(lambda p: _loss(nnx.merge(graphdef, p, rest), inputs)))(params)
  return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(grads)}


def _adam_steps(model, inputs, steps=3):
  """``steps`` AdamW steps on the LoRA trainables (in place); the losses."""
  graphdef, params, rest = nnx.split(model, lora.LoRAParam, ...)
  tx = optax.adamw(3e-2, weight_decay=0.1)
  opt = tx.init(params)

  @jax.jit
  def step(params, opt):
    loss, g = jax.value_and_grad(lambda p: _loss(nnx.merge(graphdef, p, rest), inputs))(params)
    updates, opt = tx.update(g, opt, params)
    return optax.apply_updates(params, updates), opt, loss

  losses = []
  for _ in range(steps):
    params, opt, loss = step(params, opt)
    losses.append(float(loss))
  nnx.update(model, params)
  return losses


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_lora_under_ms_norms_has_the_baseline_function_gradients_and_steps(name):
  inputs = _inputs(name)
  base, ms = _model(name, "baseline"), _model(name, "ms-bp")
  assert ms.policy.merges_norm_affine and not base.policy.merges_norm_affine
  # the same trainables, by path and value: the head is held unmerged under ms-bp
  want, have = _trained(base), _trained(ms)
  assert want.keys() == have.keys()
  for path in want:
    np.testing.assert_allclose(have[path], want[path], rtol=1e-5, atol=1e-6, err_msg=path)
  np.testing.assert_allclose(_loss(ms, inputs), _loss(base, inputs), rtol=1e-5)
  want, have = _grads(base, inputs), _grads(ms, inputs)
  for path in want:  # before the fix, the adapters behind a norm were 28-62% apart
    scale = np.abs(want[path]).max()
    assert scale > 0, path
    np.testing.assert_allclose(have[path], want[path], rtol=0, atol=2e-5 * scale,
                               err_msg=str(path))
  np.testing.assert_allclose(_adam_steps(ms, inputs), _adam_steps(base, inputs), rtol=1e-5)
  want, have = _trained(base), _trained(ms)
  for path in want:
    np.testing.assert_allclose(have[path], want[path], rtol=0,
                               atol=1e-4 * np.abs(want[path]).max(), err_msg=str(path))


@pytest.mark.parametrize("name", ["vit", "bert"])
def test_export_after_training_under_ms_norms_is_the_baseline_export(name, tmp_path):
  """Stripped and exported, the trained ms-bp model reloads (under baseline) as the
  trained baseline model: the adapters' ``g A`` and ``s A`` are merged, the head merged
  back."""
  inputs = _inputs(name)
  outputs = {}
  for policy in ("baseline", "ms-bp"):
    model = _model(name, policy)
    _adam_steps(model, inputs)
    trained = np.asarray(model(*inputs))
    hf.save_pretrained(lora.strip_lora(model), tmp_path / policy)
    np.testing.assert_allclose(model(*inputs), trained, rtol=1e-5, atol=1e-5)
    reloaded = hf.load_pretrained(tmp_path / policy, policy="baseline", dtype=jnp.float32)
    outputs[policy] = np.asarray(reloaded(*inputs))
    np.testing.assert_allclose(outputs[policy], trained, rtol=1e-5, atol=1e-5)
  # fp32 rounding, through Adam's steps (which scale each coordinate's gradient to ~1):
  # measured 1e-5 of the largest logit
  np.testing.assert_allclose(outputs["ms-bp"], outputs["baseline"], rtol=0,
                             atol=1e-4 * np.abs(outputs["baseline"]).max())


def test_unmerged_head_round_trips_and_a_zero_scale_keeps_the_function():
  """``unmerge_norm_affine`` then ``merge_norm_affine`` gives the merged kernel and bias
  back; a channel whose norm scale is 0 keeps the function (its row is 0, its shift
  contribution moved to the bias)."""
  inputs = _inputs("vit")
  model = hf.load_pretrained(HF / "vit", policy="ms-bp", dtype=jnp.float32)
  scale = np.asarray(model.head.norm_scale[...]).copy()
  scale[:3] = 0.0
  kernel = np.asarray(model.head.kernel[...]) * np.where(scale == 0, 0.0, 1.0)[:, None]
  model.head.norm_scale[...] = jnp.asarray(scale)
  model.head.kernel[...] = jnp.asarray(kernel)
  bias, before = np.asarray(model.head.bias[...]), np.asarray(model(*inputs))
  model.head.unmerge_norm_affine()
  assert model.head.affine_at_call
  assert not np.asarray(model.head.kernel[...])[:3].any()
  np.testing.assert_allclose(model(*inputs), before, rtol=1e-5, atol=1e-6)
  model.head.merge_norm_affine()
  np.testing.assert_allclose(model.head.kernel[...], kernel, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(model.head.bias[...], bias, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(model(*inputs), before, rtol=1e-5, atol=1e-6)


def _peft_available():
  try:
    import peft  # noqa: F401
  except ImportError:
    return False
  return fixtures.torch_available()


@pytest.mark.skipif(not _peft_available(), reason="needs torch, transformers and peft: "
                    "pip install -e '.[peers]'")
@pytest.mark.parametrize("policy", ["baseline", "ms-bp"])
def test_vit_lora_gradients_are_peft_s(policy):
  """The same checkpoint and adapters in transformers + peft (LoRA on every linear, the
  classifier in ``modules_to_save``): the same loss and the same gradient for every
  adapter and the head, under MS norms too."""
  import peft
  import torch
  import transformers
  (images,) = _inputs("vit")
  ours = _model("vit", policy)
  theirs = transformers.ViTForImageClassification.from_pretrained(HF / "vit")
  # transformers' module names for ours: before 5.x, and since
  names = {"query": ("attention.attention.query", "attention.q_proj"),
           "key": ("attention.attention.key", "attention.k_proj"),
           "value": ("attention.attention.value", "attention.v_proj"),
           "out": ("attention.output.dense", "attention.o_proj"),
           "fc1": ("intermediate.dense", "mlp.fc1"), "fc2": ("output.dense", "mlp.fc2")}
  suffixes = "|".join(n.replace(".", r"\.") for pair in names.values() for n in pair)
  theirs = peft.get_peft_model(theirs, peft.LoraConfig(
      r=4, lora_alpha=8, lora_dropout=0.0, target_modules=rf".*\.\d+\.({suffixes})",
      modules_to_save=["classifier"]))
  layers = ours.stack.blocks
  ours_by_name = {"query": layers.attn.query, "key": layers.attn.key,
                  "value": layers.attn.value, "out": layers.attn.out,
                  "fc1": layers.mlp.fc1, "fc2": layers.mlp.fc2}
  modules = dict(theirs.named_modules())

  def module(i, name):
    found = [m for key, m in modules.items() if hasattr(m, "lora_A")
             and any(key.endswith(f".{i}.{n}") for n in names[name])]
    assert len(found) == 1, (i, name, len(found))
    return found[0]

  with torch.no_grad():  # our adapters' values into peft's (torch layout: transposed)
    for name, lin in ours_by_name.items():
      a, b = np.asarray(lin.lora_a[...]), np.asarray(lin.lora_b[...])
      for i in range(ours.cfg.num_layers):
        m = module(i, name)
        m.lora_A["default"].weight.copy_(torch.from_numpy(a[i].reshape(-1, 4).T.copy()))
        m.lora_B["default"].weight.copy_(torch.from_numpy(b[i].reshape(4, -1).T.copy()))
  logits = theirs(pixel_values=torch.from_numpy(np.asarray(images).transpose(0, 3, 1, 2)))
  logits = logits.logits
  probe = torch.from_numpy(np.asarray(jax.random.normal(jax.random.key(7), logits.shape)))
  loss = (logits * probe).sum() / logits.numel() ** 0.5
  loss.backward()
  np.testing.assert_allclose(float(loss), float(_loss(ours, (images,))), rtol=1e-5)
  grads = _grads(ours, (images,))
  for name, lin in ours_by_name.items():
    path = ("stack", "blocks") + (("attn",) if name in ("query", "key", "value", "out")
                                  else ("mlp",)) + (name,)
    dA, dB = grads[path + ("lora_a",)], grads[path + ("lora_b",)]
    for i in range(ours.cfg.num_layers):
      m = module(i, name)
      want_a = m.lora_A["default"].weight.grad.numpy().T.reshape(dA[i].shape)
      want_b = m.lora_B["default"].weight.grad.numpy().T.reshape(dB[i].shape)
      for have, want, what in ((dA[i], want_a, "A"), (dB[i], want_b, "B")):
        np.testing.assert_allclose(have, want, rtol=0, atol=2e-5 * np.abs(want).max(),
                                   err_msg=f"{name} layer {i} {what}")
  head = theirs.base_model.model.classifier.modules_to_save["default"]
  np.testing.assert_allclose(grads[("head", "kernel")], head.weight.grad.numpy().T,
                             rtol=0, atol=2e-5 * np.abs(head.weight.grad.numpy()).max())
  np.testing.assert_allclose(grads[("head", "bias")], head.bias.grad.numpy(), rtol=0,
                             atol=2e-5 * np.abs(head.bias.grad.numpy()).max())


# transformers' module names of our linears (LLaMA, BERT and RoBERTa layers)
HF_LINEARS = {"llama": {"query": "self_attn.q_proj", "key": "self_attn.k_proj",
                        "value": "self_attn.v_proj", "out": "self_attn.o_proj",
                        "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"},
              "bert": {"query": "attention.self.query", "key": "attention.self.key",
                       "value": "attention.self.value", "out": "attention.output.dense",
                       "fc1": "intermediate.dense", "fc2": "output.dense"}}


@pytest.mark.skipif(not _peft_available(), reason="needs torch, transformers and peft: "
                    "pip install -e '.[peers]'")
@pytest.mark.parametrize("name,policy", [
    ("llama_untied", "baseline"), ("llama_untied", "ms-bp"), ("llama_untied", "lowmembp"),
    ("llama_tied", "ms-bp"), ("bert", "baseline"), ("bert", "ms-bp"), ("roberta", "ms-bp")])
def test_lm_and_text_lora_gradients_are_peft_s(name, policy):
  """LLaMA (an LM: SiLU is exact under lowmembp), BERT and RoBERTa (the classifier, and
  RoBERTa's dense + out_proj head, in ``modules_to_save``) with LoRA on every linear:
  the same loss and gradients as transformers + peft (the ViT test's, other families)."""
  import peft
  import torch
  import transformers
  family = "llama" if name.startswith("llama") else "bert"
  names = HF_LINEARS[family]
  inputs = _inputs(name)
  ours = _model(name, policy)
  if family == "llama":
    theirs = transformers.LlamaForCausalLM.from_pretrained(HF / name,
                                                           attn_implementation="eager")
  else:
    cls = (transformers.BertForSequenceClassification if name == "bert"
           else transformers.RobertaForSequenceClassification)
    theirs = cls.from_pretrained(HF / name, attn_implementation="eager")
  theirs.eval()
  suffixes = "|".join(n.replace(".", r"\.") for n in names.values())
  theirs = peft.get_peft_model(theirs, peft.LoraConfig(
      r=4, lora_alpha=8, lora_dropout=0.0, target_modules=rf".*\.\d+\.({suffixes})",
      modules_to_save=None if family == "llama" else ["classifier"]))
  modules = dict(theirs.named_modules())

  def module(i, n):
    found = [m for key, m in modules.items() if hasattr(m, "lora_A")
             and key.endswith(f".{i}.{names[n]}")]
    assert len(found) == 1, (i, n, len(found))
    return found[0]

  attn = "attn" if family == "llama" else "attention"
  path = lambda n: ("stack", "blocks", attn if n in ("query", "key", "value", "out")
                    else "mlp", n)
  blocks = ours.stack.blocks
  with torch.no_grad():  # our adapters' values into peft's (torch layout: transposed)
    for n in names:
      lin = getattr(getattr(blocks, path(n)[2]), n)
      a, b = np.asarray(lin.lora_a[...]), np.asarray(lin.lora_b[...])
      for i in range(ours.cfg.num_layers):
        module(i, n).lora_A["default"].weight.copy_(torch.from_numpy(a[i].reshape(-1, 4).T.copy()))
        module(i, n).lora_B["default"].weight.copy_(torch.from_numpy(b[i].reshape(4, -1).T.copy()))
  torch_inputs = [torch.from_numpy(np.asarray(x).astype(np.int64)) for x in inputs]
  out = (theirs(input_ids=torch_inputs[0]) if family == "llama" else theirs(
      input_ids=torch_inputs[0], attention_mask=torch_inputs[1],
      token_type_ids=torch_inputs[2])).logits
  probe = torch.from_numpy(np.asarray(jax.random.normal(jax.random.key(7), out.shape)))
  loss = (out * probe).sum() / out.numel() ** 0.5
  loss.backward()
  np.testing.assert_allclose(float(_loss(ours, inputs)), float(loss), rtol=1e-5)
  grads = _grads(ours, inputs)

  def close(have, want, what):
    np.testing.assert_allclose(have, want, rtol=0, atol=2e-5 * np.abs(want).max(),
                               err_msg=what)
  for n in names:
    for key, side in (("lora_a", "lora_A"), ("lora_b", "lora_B")):
      have = grads[path(n) + (key,)]
      for i in range(ours.cfg.num_layers):
        want = getattr(module(i, n), side)["default"].weight.grad.numpy().T
        close(have[i], want.reshape(have[i].shape), f"{n} layer {i} {key}")
  if family == "bert":
    head = theirs.base_model.model.classifier.modules_to_save["default"]
    pairs = ([("classifier", head)] if name == "bert"
             else [("pooler", head.dense), ("classifier", head.out_proj)])
    for ours_name, linear in pairs:
      close(grads[(ours_name, "kernel")], linear.weight.grad.numpy().T, f"{ours_name} kernel")
      close(grads[(ours_name, "bias")], linear.bias.grad.numpy(), f"{ours_name} bias")


@pytest.mark.parametrize("rows", [2, 40])  # x (2 x 8) or the kernel (8 x 32) is the smaller
@pytest.mark.parametrize("shift", [True, False])
def test_read_through_norm_affine_is_the_affine_then_the_matmul(rows, shift):
  """Either fold gives ``(g x + s) @ W + b`` and its gradients (plain jnp reference)."""
  from models.linear import read_through_norm_affine
  keys = jax.random.split(jax.random.key(3), 5)
  x = jax.random.normal(keys[0], (rows, 8))
  w, b = jax.random.normal(keys[1], (8, 32)), jax.random.normal(keys[2], (32,))
  g = jax.random.uniform(keys[3], (8,), minval=0.5, maxval=1.5)
  s = jax.random.normal(keys[4], (8,)) if shift else None

  def ours(x, w, b, g, s):
    x2, w2, b2 = read_through_norm_affine(x, w, b, (g, s), 1, 1)
    assert (x2 is x) == (rows * 8 >= 8 * 32)  # the affine went to the smaller side
    return jnp.sum(jnp.sin(x2 @ w2 + b2))

  def reference(x, w, b, g, s):
    return jnp.sum(jnp.sin((g * x + (0 if s is None else s)) @ w + b))

  args = (x, w, b, g, s)
  np.testing.assert_allclose(ours(*args), reference(*args), rtol=1e-5)
  argnums = (0, 1, 2, 3, 4) if shift else (0, 1, 2, 3)
  for have, want in zip(jax.grad(ours, argnums)(*args), jax.grad(reference, argnums)(*args)):
    # the two sum in another order: fp32 rounding of sums of 8-32 terms of size ~1
    np.testing.assert_allclose(have, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_a_target_that_also_trains_in_full_merges_in_its_own_space():
  """The head as a LoRA target and in ``modules_to_save`` (ViT's default): its base is
  held unmerged, so the adapter's update is ``A B`` there, not ``g A B``. Merged (and
  stripped) it keeps the function; it was 41% off."""
  inputs = _inputs("vit")
  outputs = {}
  for policy in ("baseline", "ms-bp"):
    model = hf.load_pretrained(HF / "vit", policy=policy, dtype=jnp.float32)
    lora.apply_lora(model, rank=4, alpha=8, targets="query,head")
    assert isinstance(model.head, lora.LoRALinear)
    assert model.head.base.affine_at_call == (policy == "ms-bp")
    for path, var in nnx.iter_graph(model):
      if isinstance(var, lora.LoRAParam) and path[-1] == "lora_b":
        var[...] = 0.3 * jax.random.normal(_key(path), var[...].shape)
    adapted = np.asarray(model(*inputs))
    lora.merge_lora(model)
    np.testing.assert_allclose(model(*inputs), adapted, rtol=1e-5, atol=1e-5)
    lora.unmerge_lora(model)
    lora.strip_lora(model)
    np.testing.assert_allclose(model(*inputs), adapted, rtol=1e-5, atol=1e-5)
    outputs[policy] = adapted
  np.testing.assert_allclose(outputs["ms-bp"], outputs["baseline"], rtol=1e-5, atol=1e-5)


def test_an_lm_head_trained_in_full_behind_the_final_norm_keeps_the_fused_loss():
  """LLaMA's untied ``lm_head`` in ``modules_to_save`` under MS norms is held unmerged:
  the chunked loss (which reads the head's kernel itself) must not take it for the
  merged one."""
  model = hf.load_pretrained(HF / "llama_untied", policy="ms-bp", dtype=jnp.float32)
  lora.apply_lora(model, rank=4, targets="query", modules_to_save=("lm_head",))
  assert model.lm_head.affine_at_call
  tokens = jnp.asarray(fixtures.llama_tokens())
  targets = jnp.roll(tokens, -1, axis=1)
  fused = model.token_losses(tokens, targets, chunk=4)[0]
  logits = model.token_losses(tokens, targets, chunk=0)[0]
  np.testing.assert_allclose(fused, logits, rtol=1e-5, atol=1e-6)


def _exported_run(tmp_path, name, policy, **overrides):
  """A LoRA run's trainer on the ``name`` fixture under ``policy``, its adapters' B set to
  the same non-zero values under every policy, exported with train.loop.export: the
  trainer, its config and the export's tensors."""
  from safetensors.numpy import load_file

  from train.config import TrainConfig
  from train.loop import export
  from train.trainer import Trainer
  task = "image" if name == "vit" else "lm"
  cfg = TrainConfig(name="t", pretrained=str(HF / name), task=task, trainable="lora",
                    policy=policy, dtype="float32", compare_baseline=False,
                    export_dir=str(tmp_path / f"{name}-{policy}"), **overrides)
  trainer = Trainer.create(cfg)
  trainer.state["params"] = jax.tree_util.tree_map_with_path(
      lambda p, v: 0.3 * jax.random.normal(_key(p), v.shape)
      if "lora_b" in jax.tree_util.keystr(p) else v, trainer.state["params"])
  export(trainer, cfg)
  return trainer, cfg, load_file(Path(cfg.export_dir) / "model.safetensors")


@pytest.mark.parametrize("name", ["vit", "llama_untied", "llama_tied", "bert", "roberta"])
def test_a_lora_export_under_ms_norms_is_the_checkpoint_plus_the_adapters(name, tmp_path):
  """A LoRA run under an MS-norm policy exports as peft's merge_and_unload: every tensor
  the run did not train is the checkpoint's, bit for bit (its norms too, not 1s with
  their affine folded into the linears after them), and each adapted linear is the
  baseline run's export. Before: 16 tensors of the LLaMA fixture changed (every norm's
  weight written as 1s)."""
  from safetensors.numpy import load_file
  checkpoint = load_file(HF / name / "model.safetensors")
  _, _, base = _exported_run(tmp_path, name, "baseline")
  _, _, ms = _exported_run(tmp_path, name, "lowmembp")
  assert sorted(ms) == sorted(base) == sorted(checkpoint)
  # the default targets (query, value) and the ViT's classifier (modules_to_save: held
  # unmerged under MS norms, its bias b + s W - s W off by rounding before any step)
  trained = [k for k in checkpoint if k.startswith("classifier") or (k.endswith(
      ".weight") and any(m in k for m in ("q_proj", "v_proj", "query", "value")))]
  assert trained == [k for k in checkpoint if not np.array_equal(base[k], checkpoint[k])
                     or k.startswith("classifier")]
  for k in checkpoint:
    if k in trained:  # the same adapters merged, the head's unmerge: fp32 rounding
      np.testing.assert_allclose(ms[k], base[k], rtol=0,
                                 atol=1e-6 * max(np.abs(base[k]).max(), 1), err_msg=k)
    else:
      np.testing.assert_array_equal(ms[k], checkpoint[k], err_msg=k)


def test_a_qlora_run_under_ms_norms_exports(tmp_path):
  """A LoRA run on an nf4 base under lowmembp exports (the trained head, put into the
  fp32 rebuild as read-only host arrays, could not be merged back in place): the export
  reloads as the fp32-base model with the run's adapters and head."""
  from safetensors.numpy import load_file

  from train.loop import with_export_base
  (images,) = _inputs("vit")
  trainer, cfg, exported = _exported_run(tmp_path, "vit", "lowmembp", base_dtype="nf4")
  trained = nnx.merge(trainer.graphdef, trainer.state["params"], trainer.state["rest"])
  want = np.asarray(with_export_base(trained, cfg)(images))
  got = hf.load_pretrained(cfg.export_dir, policy="baseline", dtype=jnp.float32)(images)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # merged into the checkpoint's fp32 tensors, not the nf4 ones the run stored
  checkpoint = load_file(HF / "vit" / "model.safetensors")
  for k, v in checkpoint.items():
    if not (k.startswith("classifier") or (k.endswith(".weight") and (
        "query" in k or "value" in k))):
      np.testing.assert_array_equal(exported[k], v, err_msg=k)


def test_a_map_that_merges_into_a_linear_without_the_affine_is_refused():
  """A model whose map merges a norm into a linear built without ``reads_norm`` would
  silently read the bare ``x_hat`` in its adapters again: the load says so."""
  from safetensors.numpy import load_file
  model = hf.init_from_config(HF / "vit", policy="ms-bp", dtype=jnp.float32)
  model.head.norm_scale = model.head.norm_shift = None
  with pytest.raises(ValueError, match=r"^head: the map merges vit.layernorm into it, but "
                                       r"the linear was not built with reads_norm=True"):
    hf.load_state(model, load_file(HF / "vit" / "model.safetensors"))
