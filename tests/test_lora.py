"""LoRA: unchanged function at start, only adapters (and the classification head)
trainable, merge/unmerge/strip, and the adapter reads the shared norm output (no second
copy saved)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowmem_jax.memory import saved_residuals
from models import lora, vit


def _model(policy="lowmembp"):
  return vit.ViT("vit-tiny", policy, dtype=jnp.float32, rngs=nnx.Rngs(0))


def _images():
  return jax.random.normal(jax.random.key(1), (2, 32, 32, 3))


def _perturb_adapters(model):
  for path, var in nnx.iter_graph(model):
    if isinstance(var, lora.LoRAParam) and path[-1] == "lora_b":
      var[...] = jax.random.normal(jax.random.key(len(path)), var[...].shape) * 0.1


def test_starts_as_the_base_function_and_only_adapters_and_the_head_train():
  model, x = _model(), _images()
  before = model(x)
  lora.apply_lora(model, rank=4, alpha=8, targets=("query", "value", "fc1"))
  np.testing.assert_array_equal(model(x), before)
  trainable = nnx.to_flat_state(nnx.state(model, lora.trainable_filter()))
  # A and B for 3 targets, each stacked over the layers, and the head (peft's
  # modules_to_save for a classifier): its kernel and bias, trained in full
  head = {("head", "kernel"), ("head", "bias")}
  assert len(trainable) == 2 * 3 + 2 and head <= {path for path, _ in trainable}
  assert all(v.get_value().shape[0] == model.cfg.num_layers for p, v in trainable
             if p not in head)
  assert not model.head.frozen and model.stack.blocks.mlp.fc2.frozen
  grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2), argnums=nnx.DiffState(0, lora.LoRAParam))(model)
  assert {type(v) for v in jax.tree.leaves(grads, is_leaf=lambda v: isinstance(v, nnx.Variable))} \
      == {lora.LoRAParam}
  # B starts at 0, so only B gets a gradient at first; it must be non-zero.
  assert any(float(jnp.abs(v[...]).max()) > 0 for p, v in nnx.iter_graph(grads)
             if isinstance(v, nnx.Variable) and p[-1] == "lora_b")


def test_merge_unmerge_and_strip_keep_the_function():
  model, x = _model(), _images()
  lora.apply_lora(model, rank=4, alpha=8)
  _perturb_adapters(model)
  adapted = model(x)
  kernel = np.asarray(model.stack.blocks.attn.query.base.kernel[...])
  lora.merge_lora(model)
  np.testing.assert_allclose(model(x), adapted, atol=1e-5)
  lora.unmerge_lora(model)
  np.testing.assert_allclose(model.stack.blocks.attn.query.base.kernel[...], kernel, atol=1e-6)
  np.testing.assert_allclose(model(x), adapted, atol=1e-5)
  lora.strip_lora(model)
  assert isinstance(model.stack.blocks.attn.query, nnx.LinearGeneral)
  np.testing.assert_allclose(model(x), adapted, atol=1e-5)


def test_adapter_shares_the_norm_output():
  """Under MS norms the adapter's A matmul reads the saved norm output: adding LoRA to
  q and v adds to the residuals only the rank-sized x @ A arrays and, per adapter, the
  weight its matmul reads (``g A``, the norm's scale folded in), plus what the head (trained
  unmerged) reads through the final norm's affine: its pooled input ``g x + s`` and ``g``.
  Nothing of the tokens' width beyond the rank."""
  x, rank, c = _images(), 4, vit.config("vit-tiny")
  totals = {}
  for with_lora in (False, True):
    model = _model("lowmembp")
    if with_lora:
      lora.apply_lora(model, rank=rank, targets=("query", "value"))
    graphdef, state = nnx.split(model)
    res = saved_residuals(lambda s, x: nnx.merge(graphdef, s)(x).sum(), state, x)
    totals[with_lora] = sum(r.nbytes for r in res.items)
  tokens = x.shape[0] * (c.num_patches + 1)
  extra_per_layer = 2 * (tokens + c.dim) * rank * 4  # x @ A and g A for q and v, fp32
  head = (x.shape[0] + 1) * c.dim * 4
  assert totals[True] - totals[False] == c.num_layers * extra_per_layer + head


def _lora_error(model, **kw) -> str:
  with pytest.raises(ValueError) as e:
    lora.apply_lora(model, **kw)
  return str(e.value)


def test_bad_targets_and_rank_are_clear_errors():
  assert _lora_error(_model(), targets=("q_proj",)) == (
      "apply_lora: no linear named ['q_proj']; this model has fc1, fc2, head, key, out, "
      "query, value")
  # one misspelt target among good ones left its linears without adapters, silently
  assert _lora_error(_model(), targets="query,vlaue") == (
      "apply_lora: no linear named ['vlaue']; this model has fc1, fc2, head, key, out, "
      "query, value")
  # a float, str or bool rank failed in jax.random ('Shapes must be 1D sequences...') or
  # with '<' between str and int; True and alpha <= 0 built adapters that do nothing or
  # train with the sign flipped
  for rank in (0, 2.5, "8", True):
    assert _lora_error(_model(), rank=rank) == f"LoRA rank must be a positive int, got {rank!r}"
  for alpha in (0, -16.0, float("nan")):
    assert _lora_error(_model(), alpha=alpha) == (
        "LoRA alpha must be a positive number (the adapter's scale is alpha / rank), got "
        f"{alpha!r}")


def test_targets_as_one_string_and_a_second_apply():
  """``targets="query,value"`` (as the CLI's lora_targets) was read letter by letter
  ('no linear named ['q', 'u', ...]'); a second apply_lora said 'no linear named query'
  (the first had wrapped them)."""
  model = lora.apply_lora(_model(), targets="query, value")
  assert sorted(p[-1] for p, n in nnx.iter_graph(model) if isinstance(n, lora.LoRALinear)) \
      == ["query", "value"]
  assert _lora_error(model, targets=("key",)) == (
      "apply_lora: the model has LoRA adapters already (on query, value); strip_lora(model) "
      "merges them first")


def test_modules_to_save_train_in_full_and_default_to_the_classifier_head():
  """A fresh head left frozen would stay random: by default it trains (peft's SEQ_CLS
  saves ``classifier``); ``modules_to_save=()`` leaves the adapters alone, and a name
  that is no linear of the model is refused."""
  from models import bert, llama
  for model, head in ((bert.Bert(bert.config("bert-tiny")), {"classifier"}),
                      (bert.Bert(bert.config("roberta-tiny")), {"pooler", "classifier"}),
                      (llama.Llama(llama.config("llama-tiny")), set())):
    lora.apply_lora(model)
    trained = {p[0] for p, _ in nnx.to_flat_state(nnx.state(model, lora.LoRAParam))
               if not p[-1].startswith("lora_")}
    assert trained == head, (model.cfg.model_type, trained)
  model = lora.apply_lora(_model(), modules_to_save=())
  assert model.head.frozen and not isinstance(model.head.kernel, lora.LoRAParam)
  with pytest.raises(ValueError, match=r"modules_to_save names \['fc9'\], not linears of "
                                       r"the model \(head\)"):
    lora.apply_lora(_model(), modules_to_save=("fc9",))
  stored = _model()
  stored.head.store_kernel("int8")
  with pytest.raises(ValueError, match=r"modules_to_save \['head'\] are stored in a base "
                                       r"dtype"):
    lora.apply_lora(stored)
