"""train.trainer: the jitted train step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from train.config import TrainConfig
from train.trainer import Trainer

MODEL = {"num_layers": 1, "dim": 32, "mlp_dim": 64, "num_heads": 2, "num_kv_heads": 2}


def _lm_batch(batch=4, seq=12, vocab=256):
  """An LM batch whose rows count different numbers of loss tokens (3, 12, 7, 1)."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, vocab, (batch, seq), dtype=np.int32)
  lengths = np.array([3, 12, 7, 1][:batch])
  mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int32)
  return {"tokens": jnp.asarray(tokens), "targets": jnp.asarray(np.roll(tokens, -1, axis=1)),
          "loss_mask": jnp.asarray(mask)}


def test_grad_accum_keeps_the_whole_batch_mean():
  """grad_accum splits the batch, not the loss: the loss is the mean over every loss token
  of the batch and the gradient its gradient, whatever the split. Before, the step averaged
  the micro-batches' means, which weighs a token of a short micro-batch more (here the
  loss moved by 1e-3 relative); the planner changes grad_accum on its own."""
  batch = _lm_batch()
  out = {}
  for accum in (1, 2, 4):
    cfg = TrainConfig(name="t", task="lm", model="llama-tiny", model_overrides=MODEL,
                      policy="baseline", dtype="float32", precision="highest",
                      batch_size=4, grad_accum=accum, optimizer="sgd", lr=0.1,
                      warmup_steps=0, eval_every=0, compare_baseline=False)
    trainer = Trainer.create(cfg)
    metrics = jax.device_get(trainer.step(batch))
    out[accum] = (float(metrics["loss"]), float(metrics["grad_norm"]),
                  float(metrics["count"]), jax.device_get(trainer.state["params"]))
  loss, norm, count, params = out[1]
  assert count == 3 + 12 + 7 + 1
  for accum in (2, 4):
    assert out[accum][2] == count
    assert out[accum][0] == pytest.approx(loss, rel=1e-6), (accum, out[accum][0], loss)
    assert out[accum][1] == pytest.approx(norm, rel=1e-5), (accum, out[accum][1], norm)
    # SGD's update is linear in the gradient: the same parameters
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 out[accum][3], params)


def test_a_stored_base_exports_the_fp32_base_with_the_adapters_merged(tmp_path):
  """A QLoRA run (base_dtype nf4) exports LoRA merged into the fp32 base it came from (the
  seed's init here, a pretrained checkpoint read again otherwise), as peft merges into the
  original base: not into the nf4-dequantized one. It was refused at config time."""
  from models import hf
  from train.loop import export
  from train.model import build_model
  cfg = TrainConfig(name="t", task="lm", model="llama-tiny", model_overrides=MODEL,
                    policy="baseline", dtype="float32", batch_size=4, trainable="lora",
                    lora_targets="query,value", base_dtype="nf4", lr=0.05, warmup_steps=0,
                    eval_every=0, compare_baseline=False, export_dir=str(tmp_path / "hf"))
  trainer = Trainer.create(cfg)
  trainer.step(_lm_batch())
  export(trainer, cfg)
  exported = hf.read_safetensors(tmp_path / "hf")
  fp32 = hf.hf_state(build_model(cfg.replace(base_dtype="float32", trainable="full")))
  # no adapter on key: the fp32 base exactly (nf4's dequantized value differs by ~1e-2)
  name = "model.layers.0.self_attn.k_proj.weight"
  np.testing.assert_array_equal(exported[name], fp32[name])
  # query: the fp32 base plus the trained adapter's B A (nonzero after a step)
  name = "model.layers.0.self_attn.q_proj.weight"
  delta = exported[name] - fp32[name]
  assert 1e-6 < np.abs(delta).max() < 1.0, np.abs(delta).max()


def test_evaluate_gives_the_macro_f1_of_the_models_predictions():
  """A classifier's eval adds macro F1 (and, of two classes, class 1's F1) from the same
  logits as its accuracy, over every batch: checked against the predictions taken here."""
  from flax import nnx
  from train.loss import macro_f1
  cfg = TrainConfig(name="t", task="image", model="vit-digits", policy="baseline",
                    dtype="float32", precision="highest", batch_size=8, eval_every=0,
                    compare_baseline=False)
  trainer = Trainer.create(cfg)
  rng = np.random.default_rng(0)
  images = rng.standard_normal((24, 8, 8, 1)).astype(np.float32)
  labels = rng.integers(0, 10, 24).astype(np.int32)
  batches = [{"image": images[i:i + 10], "label": labels[i:i + 10]} for i in (0, 10, 20)]
  out = trainer.evaluate(batches)
  model = nnx.merge(trainer.graphdef, trainer.state["params"], trainer.state["rest"])
  guess = np.argmax(np.asarray(model(jnp.asarray(images))), axis=-1)
  confusion = np.zeros((10, 10))
  np.add.at(confusion, (labels, guess), 1)
  assert out["eval_accuracy"] == pytest.approx(np.mean(guess == labels))
  assert out["eval_f1_macro"] == pytest.approx(macro_f1(confusion))
  assert "eval_f1" not in out  # ten classes: no positive class


# ImageNet's mean and std (HF's ViT/ConvNeXt processors): neither is exact in float32
IMAGENET = (np.array([0.485, 0.456, 0.406], np.float32), np.array([0.229, 0.224, 0.225],
                                                                  np.float32))


def _image_trainer(grad_accum: int = 1) -> Trainer:
  """A one-block RGB vit-digits trainer whose steps normalize 8-bit codes by IMAGENET."""
  import dataclasses

  from train.images import code_values
  cfg = TrainConfig(name="t", task="image", model="vit-digits",
                    model_overrides={"channels": 3, "num_layers": 1, "dim": 32,
                                     "mlp_dim": 64},
                    policy="baseline", dtype="float32", precision="highest", batch_size=8,
                    grad_accum=grad_accum, optimizer="sgd", lr=0.1, warmup_steps=0,
                    eval_every=0, compare_baseline=False)
  return dataclasses.replace(Trainer.create(cfg), pixel_values=code_values(IMAGENET))


def test_8_bit_codes_go_to_the_device_and_the_model_sees_the_host_s_floats(monkeypatch):
  """An image batch of uint8 codes is copied as codes (a quarter of float32's bytes) and
  made floats in the train and eval steps: the model receives, bit for bit, what the host
  fed it before (``(code / 255 - mean) / std`` in numpy, :func:`train.images.normalized`),
  in every micro-batch of grad_accum and in a last partial eval batch; the steps then
  train and evaluate as on those floats. A ``x / 255`` in the step would be off by up to
  7.2e-7 (XLA multiplies by the reciprocal)."""
  from models.vit import ViT
  from train.dataset import ArrayDataset
  from train.images import normalized
  rng = np.random.default_rng(0)
  codes = rng.integers(0, 256, (10, 8, 8, 3), dtype=np.uint8)
  codes[0, 0, :, :] = np.arange(24).reshape(8, 3) * 11  # codes 0 and 253 among them
  labels = rng.integers(0, 10, 10).astype(np.int32)
  host = normalized(ArrayDataset({"image": codes}), *IMAGENET).take(np.arange(10))["image"]
  assert host.dtype == np.float32
  seen = []
  call = ViT.__call__

  def spied(self, x, *args, **kwargs):
    jax.debug.callback(lambda v: seen.append(np.asarray(v)), x)
    return call(self, x, *args, **kwargs)
  monkeypatch.setattr(ViT, "__call__", spied)
  coded, floats = _image_trainer(grad_accum=2), _image_trainer(grad_accum=2)
  batch = coded.put({"image": codes[:8], "label": labels[:8]})
  assert batch["image"].dtype == jnp.uint8 and batch["image"].nbytes == 8 * 8 * 8 * 3
  for _ in range(2):
    coded.step(batch)
    floats.step({"image": host[:8], "label": labels[:8]})
  jax.block_until_ready((coded.state, floats.state))
  # step 1 of the codes: micro-batch i holds rows i, i + 2, ... (sharding.micro_batches)
  first = np.stack(seen[:2], axis=1).reshape(host[:8].shape)
  np.testing.assert_array_equal(first.view(np.int32), host[:8].view(np.int32))
  seen.clear()
  eval_batches = [{"image": codes[i:i + 8], "label": labels[i:i + 8]} for i in (0, 8)]
  out = coded.evaluate(eval_batches)
  jax.effects_barrier()
  assert [s.shape[0] for s in seen] == [8, 2]  # the last batch partial
  np.testing.assert_array_equal(np.concatenate(seen).view(np.int32), host.view(np.int32))
  want = floats.evaluate([{**b, "image": host[i:i + 8]} for b, i in zip(eval_batches, (0, 8))])
  assert out == pytest.approx(want, rel=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
               jax.device_get(coded.state["params"]), jax.device_get(floats.state["params"]))


def test_a_mismatched_normalization_is_one_line_naming_the_channels():
  """Stats of three channels for one-channel codes: said, not broadcast or indexed past."""
  from train.images import code_values, model_pixels
  with pytest.raises(ValueError, match="image normalization has 3 channels, the images 1"):
    model_pixels(jnp.zeros((2, 4, 4, 1), jnp.uint8), code_values(IMAGENET))
