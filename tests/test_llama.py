"""LLaMA: parity with HF transformers (logits, export), MS-norm merge and gradients, remat,
checkpoint errors, configs, and what backward saves (lowmem_jax.memory.saved_residuals).

The HF checkpoints and logits are golden files (tests/make_hf_fixtures.py), so only the
tests that run transformers live need torch."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import make_hf_fixtures as fixtures
from lowmem_jax.memory import saved_residuals
from models import hf, llama, rope
from models.hf_state import CheckpointError

HF_SHAPE = fixtures.LLAMA_SHAPE  # GQA: 4 query heads, 2 kv heads, head_dim 8; rope_theta 5000
TOL = 1e-4

requires_torch = pytest.mark.skipif(not fixtures.torch_available(), reason=fixtures.NO_TORCH)
_tokens = fixtures.llama_tokens


def _hf_logits(model, tokens):
  """Live: a transformers model's logits."""
  return fixtures.llama_outputs(model, tokens)["logits"]


def _golden(name):
  """(directory, tokens, HF logits) of a golden checkpoint."""
  ref = fixtures.reference(name)
  return fixtures.DATA / name, ref["tokens"], ref["logits"]


@pytest.fixture(scope="module", params=["llama_untied", "llama_tied", "llama3_rope"],
                ids=["untied", "tied", "llama3-rope"])
def hf_ckpt(request):
  """(directory, tokens, HF logits) of a saved random HF LlamaForCausalLM, weights drawn
  with std 0.2 (10x HF's default) so attention is far from uniform and SiLU far from
  its linear region: the parity checks exercise every op. llama3-rope: untied's weights
  with Llama 3.1's RoPE scaling."""
  return _golden(request.param)


@pytest.fixture(scope="module")
def untied_ckpt():
  """As ``hf_ckpt`` (untied) but with HF's default init std 0.02. ReSiLU2's 2-level step
  derivative is a coarse per-element approximation: at std 0.2 the lowmembp embedding
  gradient's cosine to the exact one measured 0.93-0.97 (3 seeds), at 0.02 0.997-0.998."""
  return _golden("llama_untied_std002")


def _max_abs(a, b):
  return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def _loss_fn(graphdef):
  def loss(state, tokens):
    logits = nnx.merge(graphdef, state)(tokens)
    logp = jax.nn.log_softmax(logits[:, :-1])
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))
  return loss


def _logits_and_grads(model, tokens):
  graphdef, state = nnx.split(model)
  logits = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens)
  loss, grads = jax.jit(jax.value_and_grad(_loss_fn(graphdef)))(state, tokens)
  return np.asarray(logits), float(loss), nnx.to_pure_dict(grads)


# ----------------------------------------------------------------------------- HF parity
@pytest.mark.parametrize("policy", ["baseline", "lowmembp"])
def test_logits_match_hf(hf_ckpt, policy):
  path, tokens, ref = hf_ckpt
  model = hf.load_pretrained(path, policy=policy, dtype=jnp.float32)
  assert model.cfg.rope_theta == HF_SHAPE["rope_theta"] and model.cfg.num_kv_heads == 2
  merged = model.policy.merges_norm_affine
  assert (model.stack.layer(0).norm1.scale is None) == merged  # MS norms carry no params
  assert (model.norm.scale is None) == merged
  # Tied embeddings: the final norm's scale cannot merge into the shared table.
  assert (model.head_scale is not None) == (merged and model.cfg.tie_embeddings)
  assert (model.lm_head is None) == model.cfg.tie_embeddings
  out = model(tokens)
  assert out.shape == ref.shape and out.dtype == jnp.float32
  assert _max_abs(out, ref) < TOL


@requires_torch
@pytest.mark.parametrize("name", sorted(fixtures.LLAMA_VARIANTS))
def test_golden_files_match_live_hf(name):
  """tests/data/hf/llama_* are what make_hf_fixtures builds today: the same weights,
  tokens and HF logits."""
  model, live = fixtures.build(name)
  fixtures.assert_golden(name, model, live)


def test_special_token_ids_are_carried_to_the_export():
  """bos/eos/pad ids come from config.json and go back to it: the export wrote bos 1, eos 2
  and no pad whatever the checkpoint said (a Llama 3 export would stop generating on
  token 2 and never on its own eos ids)."""
  hf_cfg = llama.config_to_hf(llama.config("llama-tiny"))
  assert (hf_cfg["bos_token_id"], hf_cfg["eos_token_id"], hf_cfg["pad_token_id"]) == (1, 2, None)
  source = dict(hf_cfg, bos_token_id=5, eos_token_id=[6, 7], pad_token_id=8)
  cfg = llama.config_from_hf(json.loads(json.dumps(source)))
  assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (5, (6, 7), 8)
  back = llama.config_to_hf(cfg)
  assert (back["bos_token_id"], back["eos_token_id"], back["pad_token_id"]) == (5, [6, 7], 8)
  assert llama.config_from_hf(json.loads(json.dumps(back))) == cfg
  absent = {k: v for k, v in source.items() if not k.endswith("_token_id")}
  cfg = llama.config_from_hf(absent)  # HF LlamaConfig's defaults
  assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (1, 2, None)
  with pytest.raises(ValueError, match=r"eos_token_id must be a token id >= 0 \(or a tuple"):
    llama.config_from_hf(dict(source, eos_token_id=[6, -1]))


def test_export_roundtrip(hf_ckpt, tmp_path):
  """lowmembp (merged norms) -> our save_pretrained -> our loader: the same function, in
  a HF config and state (merged norms written as 1; see the transformers twin below)."""
  path, tokens, ref = hf_ckpt
  model = hf.load_pretrained(path, policy="lowmembp", dtype=jnp.float32)
  hf.save_pretrained(model, tmp_path)
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
  assert llama.config_from_hf(config) == model.cfg
  state = hf.read_safetensors(tmp_path)
  np.testing.assert_array_equal(state["model.layers.1.input_layernorm.weight"], 1.0)
  np.testing.assert_array_equal(state["model.layers.0.post_attention_layernorm.weight"], 1.0)
  assert ("lm_head.weight" in state) != model.cfg.tie_embeddings
  # Untied: the final norm is merged into lm_head; tied: kept as the head scale.
  final_is_one = bool(np.all(state["model.norm.weight"] == 1.0))
  assert final_is_one != model.cfg.tie_embeddings
  again = hf.load_pretrained(tmp_path, policy="baseline", dtype=jnp.float32)
  assert _max_abs(again(tokens), ref) < TOL


@requires_torch
def test_export_roundtrip_to_transformers(hf_ckpt, tmp_path):
  """lowmembp (merged norms) -> our save_pretrained -> transformers: the same function."""
  import transformers
  path, tokens, ref = hf_ckpt
  model = hf.load_pretrained(path, policy="lowmembp", dtype=jnp.float32)
  hf.save_pretrained(model, tmp_path)
  back = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
  assert _max_abs(_hf_logits(back.float().eval(), tokens), ref) < TOL


# ----------------------------------------------------------------------------- gradients
@pytest.fixture(scope="module")
def policy_runs(untied_ckpt):
  path, tokens, ref = untied_ckpt
  runs = {}
  for policy in ("baseline", "ms-bp", "lowmembp", "remat"):
    model = hf.load_pretrained(path, policy=policy, dtype=jnp.float32)
    runs[policy] = _logits_and_grads(model, tokens)
  return ref, runs


def test_ms_bp_gradients_exact_and_lowmembp_close(policy_runs):
  ref, runs = policy_runs
  base_logits, base_loss, base = runs["baseline"]
  assert _max_abs(base_logits, ref) < TOL
  g_base = base["embed"]["embedding"]
  scale = float(np.max(np.abs(g_base)))
  assert scale > 1e-3  # a non-trivial gradient

  # MS-BP: the merged model is the same function and the MS-RMSNorm backward is exact.
  ms_logits, ms_loss, ms = runs["ms-bp"]
  assert _max_abs(ms_logits, ref) < TOL and abs(ms_loss - base_loss) < 1e-5
  assert _max_abs(ms["embed"]["embedding"], g_base) < 1e-4 * scale
  for name in ("attn", "mlp"):  # linears that read no norm are unmerged in both models
    leaf = "out" if name == "attn" else "down"
    a = ms["stack"]["blocks"][name][leaf]["kernel"][1]
    b = base["stack"]["blocks"][name][leaf]["kernel"][1]
    assert _max_abs(a, b) < 1e-4 * float(np.max(np.abs(b)))

  # LowMemoryBP on LLaMA: MS-RMSNorm, and the gated SiLU stays exact (a 2-bit code of the
  # gate cannot keep less than the exact rule's g and u, lowmem_jax/approx_bp.py): exact.
  lm_logits, lm_loss, lm = runs["lowmembp"]
  assert _max_abs(lm_logits, ref) < TOL and abs(lm_loss - base_loss) < 1e-5
  assert _max_abs(lm["embed"]["embedding"], g_base) < 1e-4 * scale


def test_remat_matches_baseline(policy_runs):
  _, runs = policy_runs
  base_logits, base_loss, base = runs["baseline"]
  logits, loss, grads = runs["remat"]
  np.testing.assert_allclose(logits, base_logits, rtol=0, atol=1e-6)
  assert abs(loss - base_loss) < 1e-6
  flat_b = jax.tree_util.tree_flatten_with_path(base)[0]
  flat_r = dict(jax.tree_util.tree_flatten_with_path(grads)[0])
  assert len(flat_b) == len(flat_r)
  for key, g in flat_b:
    np.testing.assert_allclose(flat_r[key], g, rtol=1e-5, atol=1e-7, err_msg=str(key))


# ----------------------------------------------------------------------------- checkpoint errors
@pytest.mark.parametrize("problem,key", [
    ("missing", "model.layers.1.mlp.up_proj.weight"),
    ("missing", "model.layers.0.input_layernorm.weight"),
    ("unexpected", "model.layers.2.self_attn.q_proj.weight"),
    ("misshaped", "model.layers.0.self_attn.k_proj.weight"),
])
@pytest.mark.parametrize("policy", ["baseline", "ms-bp"])
def test_checkpoint_errors_name_the_key(untied_ckpt, tmp_path, problem, key, policy):
  from safetensors.numpy import save_file
  src, _, _ = untied_ckpt
  state = dict(hf.read_safetensors(src))
  if problem == "missing":
    del state[key]
  elif problem == "unexpected":
    state[key] = np.zeros((32, 32), np.float32)
  else:
    state[key] = np.zeros((8, 32), np.float32)  # k_proj is [2 kv heads * 8, 32]
  save_file(state, str(tmp_path / "model.safetensors"))
  shutil.copy(src / "config.json", tmp_path / "config.json")
  with pytest.raises(CheckpointError, match=problem.replace("misshaped", "mis-shaped")) as e:
    hf.load_pretrained(tmp_path, policy=policy, dtype=jnp.float32)
  assert key in str(e.value)


def test_ignored_and_unsupported_hf_keys(untied_ckpt, tmp_path):
  from safetensors.numpy import save_file
  src, tokens, ref = untied_ckpt
  state = dict(hf.read_safetensors(src))
  state["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones((4,), np.float32)
  save_file(state, str(tmp_path / "model.safetensors"))
  config = json.loads((src / "config.json").read_text())
  (tmp_path / "config.json").write_text(json.dumps(config))
  assert _max_abs(hf.load_pretrained(tmp_path, dtype=jnp.float32)(tokens), ref) < TOL
  for bad in ({"attention_bias": True}, {"hidden_act": "gelu"}):
    with pytest.raises(CheckpointError, match=next(iter(bad))):
      llama.config_from_hf({**config, **bad})


# Llama 3.1 8B's config.json as transformers 4.x writes it (theta top-level, "rope_scaling")
LLAMA31_ROPE = {"rope_theta": 500000.0, "rope_scaling": {
    "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192, "rope_type": "llama3"}}


def test_rope_scaling_read_from_either_transformers_format_and_written_back():
  """Llama 3's RoPE scaling from transformers 4.x's ``rope_scaling`` (``type`` in older
  files) or 5.x's ``rope_parameters``; the export writes both, and reads back the same."""
  base = {k: v for k, v in json.loads((fixtures.DATA / "llama_untied" / "config.json")
                                       .read_text()).items() if k != "rope_parameters"}
  v4 = llama.config_from_hf({**base, **LLAMA31_ROPE})
  assert (v4.rope_type, v4.rope_theta, v4.rope_factor, v4.rope_low_freq_factor,
          v4.rope_high_freq_factor, v4.rope_original_max_seq_len) == (
              "llama3", 500000.0, 8.0, 1.0, 4.0, 8192)
  v5 = llama.config_from_hf({**base, "rope_parameters": {
      **LLAMA31_ROPE["rope_scaling"], "rope_theta": 500000.0}})
  assert v5 == v4
  back = llama.config_to_hf(v4)
  assert back["rope_scaling"] == LLAMA31_ROPE["rope_scaling"]
  assert back["rope_parameters"] == {**LLAMA31_ROPE["rope_scaling"], "rope_theta": 500000.0}
  assert llama.config_from_hf(json.loads(json.dumps(back))) == v4
  old = llama.config_from_hf({**base, "rope_scaling": {"type": "linear", "factor": 2.0}})
  assert (old.rope_type, old.rope_factor, old.rope_theta) == ("linear", 2.0, 10000.0)
  assert "rope_scaling" not in llama.config_to_hf(llama.config())  # default: as before

  def error(**keys):
    with pytest.raises(CheckpointError) as e:
      llama.config_from_hf({**base, **keys})
    return str(e.value)
  assert "rope_type 'dynamic' is not supported (only 'default', 'linear', 'llama3')" in error(
      rope_scaling={"rope_type": "dynamic", "factor": 2.0})
  assert "rope_type 'yarn' is not supported" in error(
      rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
  no_original = {k: v for k, v in LLAMA31_ROPE["rope_scaling"].items()
                 if k != "original_max_position_embeddings"}
  assert llama.config_from_hf({**base, "rope_scaling": no_original}
                              ).rope_original_max_seq_len == base["max_position_embeddings"]
  assert "rope_scaling has no 'low_freq_factor', which rope_type 'llama3' needs" in error(
      rope_scaling={"rope_type": "llama3", "factor": 8.0})
  assert "rope_parameters (default) and rope_scaling (llama3) disagree" in error(
      rope_parameters={"rope_type": "default", "rope_theta": 1e4}, **LLAMA31_ROPE)
  assert "rope_parameters (linear) and rope_scaling (linear) disagree" in error(  # 4.x vs 5.x
      rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
      rope_scaling={"rope_type": "linear", "factor": 4.0})
  assert "rope_scaling: factor='8' is not a number" in error(
      rope_scaling={**LLAMA31_ROPE["rope_scaling"], "factor": "8"})
  assert "rope_scaling must be an object, got 'llama3'" in error(rope_scaling="llama3")
  assert "partial_rotary_factor=0.5 is not supported" in error(
      rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})
  with pytest.raises(ValueError, match="rope_factor must be positive, got 0.0"):
    llama.config_from_hf({**base, "rope_scaling": {"type": "linear", "factor": 0.0}})


def test_linear_rope_scaling_divides_the_positions():
  """HF's "linear" RoPE: position p under factor f is the default's position p / f."""
  plain = llama.config(rope_theta=5000.0)
  linear = llama.config(rope_theta=5000.0, rope_type="linear", rope_factor=2.0)
  cos, sin = plain.rope_tables(8, jnp.float32)
  cos2, sin2 = linear.rope_tables(16, jnp.float32)
  np.testing.assert_allclose(cos2[:, ::2], cos, atol=1e-6)
  np.testing.assert_allclose(sin2[:, ::2], sin, atol=1e-6)


@requires_torch
@pytest.mark.parametrize("scaling", [
    {"rope_type": "default"}, {"rope_type": "linear", "factor": 4.0},
    LLAMA31_ROPE["rope_scaling"], {**LLAMA31_ROPE["rope_scaling"], "factor": 32.0},
    {**fixtures.LLAMA3_ROPE}], ids=["default", "linear", "llama3.1", "llama3.2", "fixture"])
def test_rope_frequencies_match_transformers(scaling):
  """Our frequencies are transformers' own (its rope init function), at Llama 3.1/3.2's
  real constants (head_dim 128, theta 5e5) and the llama3_rope fixture's."""
  import torch  # noqa: F401
  import transformers
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
  theta, head_dim = (5000.0, 8) if scaling == fixtures.LLAMA3_ROPE else (500000.0, 128)
  hf_cfg = transformers.LlamaConfig(
      hidden_size=head_dim * 2, num_attention_heads=2, max_position_embeddings=131072,
      rope_parameters={**scaling, "rope_theta": theta})
  kind = scaling["rope_type"]
  if kind == "default":
    want = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
  else:
    want, attention_factor = ROPE_INIT_FUNCTIONS[kind](hf_cfg, "cpu")
    assert attention_factor == 1.0
  ours = llama.config_from_hf(llama.config_to_hf(llama.config_from_hf(hf_cfg.to_dict())))
  got = rope.inv_frequencies(head_dim, theta, ours.rope_type, ours.rope_factor,
                             ours.rope_low_freq_factor, ours.rope_high_freq_factor,
                             ours.rope_original_max_seq_len)
  np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=2e-7, atol=0)


@pytest.mark.parametrize("policy", ["baseline", "ms-bp"])
def test_state_roundtrip_tied_without_torch(policy):
  """hf_state -> load_state is the identity on the function (tied head, random
  final-norm scale); a redundant lm_head.weight is accepted only if it equals the table."""
  cfg = llama.config(tie_embeddings=True, num_layers=1)
  model = llama.Llama(cfg, "baseline", dtype=jnp.float32)
  model.norm.scale[...] = jnp.linspace(0.5, 1.5, cfg.dim)
  tokens = _tokens(1, 5, vocab=cfg.vocab_size)
  ref = model(tokens)
  state = hf.hf_state(model)
  assert "lm_head.weight" not in state
  for extra in (None, state["model.embed_tokens.weight"]):
    full = dict(state) if extra is None else {**state, "lm_head.weight": extra}
    loaded = llama.Llama(cfg, policy, dtype=jnp.float32)
    hf.load_state(loaded, full)
    assert _max_abs(loaded(tokens), ref) < 1e-5
    again = hf.hf_state(loaded)
    assert set(again) == set(state)
    np.testing.assert_allclose(again["model.norm.weight"], state["model.norm.weight"])
  bad = {**state, "lm_head.weight": state["model.embed_tokens.weight"] + 1.0}
  with pytest.raises(CheckpointError, match="lm_head.weight"):
    hf.load_state(llama.Llama(cfg, policy, dtype=jnp.float32), bad)


def test_a_tied_config_whose_head_differs_fails_before_the_weights_are_read(
    untied_ckpt, tmp_path, monkeypatch):
  """An untied checkpoint whose config.json says ``tie_word_embeddings``: lm_head.weight
  is compared with the table first, so the error (naming the checkpoint) comes after
  those two reads, not after the whole model; a head of another shape fails the header
  check, before any read."""
  from safetensors.numpy import save_file
  src, _, _ = untied_ckpt
  shutil.copytree(src, tmp_path / "tied")
  config = json.loads((src / "config.json").read_text())
  (tmp_path / "tied" / "config.json").write_text(json.dumps({**config,
                                                              "tie_word_embeddings": True}))
  reads = []
  read = hf.SafetensorsFiles.__getitem__
  monkeypatch.setattr(hf.SafetensorsFiles, "__getitem__",
                      lambda self, key: reads.append(key) or read(self, key))
  with pytest.raises(CheckpointError, match=r"tied: lm_head.weight differs from "
                                            r"model.embed_tokens.weight"):
    hf.load_pretrained(tmp_path / "tied", dtype=jnp.float32)
  assert sorted(reads) == ["lm_head.weight", "model.embed_tokens.weight"]
  state = dict(hf.read_safetensors(src))
  state["lm_head.weight"] = state["lm_head.weight"][:-1]
  save_file(state, str(tmp_path / "tied" / "model.safetensors"))
  reads.clear()
  with pytest.raises(CheckpointError, match=r"mis-shaped keys \(1\): lm_head.weight"):
    hf.load_pretrained(tmp_path / "tied", dtype=jnp.float32)
  assert reads == []


# ----------------------------------------------------------------------------- configs
def test_presets_and_config_errors():
  cfg = llama.config("llama-7b", num_layers=2)
  assert (cfg.dim, cfg.num_layers, cfg.num_heads, cfg.mlp_dim, cfg.vocab_size) == (
      4096, 2, 32, 11008, 32000)
  assert cfg.eps == 1e-5 and cfg.rope_theta == 10000.0 and cfg.resolved_head_dim == 128
  big = llama.config("llama-13b")
  assert (big.dim, big.num_layers, big.num_heads, big.mlp_dim) == (5120, 40, 40, 13824)
  assert llama.config().num_kv_heads < llama.config().num_heads  # tiny is GQA
  assert llama.config_from_hf(llama.config_to_hf(big)) == big
  with pytest.raises(ValueError, match="llama-tiny.*llama-7b.*llama-13b"):
    llama.config("llama-70b")
  with pytest.raises(ValueError, match=r"unknown LlamaConfig field\(s\) layers \(did you mean "
                     r"num_layers\?\); valid:.*num_layers"):
    llama.config("llama-7b", layers=2)
  for bad, pattern in [(dict(num_kv_heads=3), "not a multiple"),
                       (dict(dim=30, head_dim=None), "not divisible"),
                       (dict(head_dim=7), "even"),
                       (dict(num_layers=0), "num_layers must be a positive int"),
                       (dict(eps=0.0), "eps must be a positive"),
                       (dict(model_type="bert"), "model_type"),
                       (dict(rope_type="yarn"), "rope_type 'yarn' is not supported"),
                       (dict(rope_factor=2.0), "rope_factor 2.0 needs rope_type 'linear'"),
                       (dict(rope_type="llama3", rope_low_freq_factor=4.0),
                        "0 < rope_low_freq_factor < rope_high_freq_factor")]:
    with pytest.raises(ValueError, match=pattern):
      llama.config("llama-tiny", **bad)
  with pytest.raises(ValueError, match="unknown LlamaConfig preset 'llama-x'"):
    llama.Llama("llama-x")


def test_model_call_bf16_mask_and_errors():
  model = llama.Llama("llama-tiny", "lowmembp")  # default compute dtype bf16
  assert model.dtype == jnp.bfloat16 and model.stack.layer(0).norm2.scale is None
  tokens = _tokens(2, 10, vocab=256)
  logits = nnx.jit(lambda m, t: m(t))(model, tokens)
  assert logits.shape == (2, 10, 256) and logits.dtype == jnp.float32
  assert bool(jnp.all(jnp.isfinite(logits)))

  # Left padding + mask == the unpadded sequence: RoPE scores depend only on i - j.
  model32 = llama.Llama("llama-tiny", "baseline", dtype=jnp.float32)
  f32 = nnx.jit(lambda t, mask=None: model32(t, mask=mask))
  short = _tokens(1, 6, vocab=256, seed=3)
  padded = np.concatenate([np.zeros((1, 3), np.int32), short], axis=1)
  mask = np.array([[False] * 3 + [True] * 6])
  np.testing.assert_allclose(f32(padded, mask=mask)[:, 3:], f32(short), atol=2e-5)
  np.testing.assert_array_equal(f32(short, mask=np.ones((1, 6), bool)), f32(short))

  with pytest.raises(ValueError, match="exceeds the 256 positions"):
    f32(np.zeros((1, 257), np.int32))
  with pytest.raises(ValueError, match="int tokens"):
    f32(np.zeros((1, 4), np.float32))
  with pytest.raises(ValueError, match="mask must have shape"):
    f32(short, mask=np.ones((1, 5), bool))


# ----------------------------------------------------------------------------- saved residuals
def test_saved_residuals_ms_norms_share_their_output():
  b, t, d, f, layers = 2, 8, 32, 48, 2
  cfg = llama.config(vocab_size=96, dim=d, num_layers=layers, num_heads=4, num_kv_heads=2,
                     mlp_dim=f)
  tokens = jnp.asarray(_tokens(b, t, vocab=96))

  def residuals(policy):
    graphdef, state = nnx.split(llama.Llama(cfg, policy, dtype=jnp.float32))
    return saved_residuals(_loss_fn(graphdef), state, tokens)

  plain = residuals("autodiff=plain")
  base, ms, low = residuals("baseline"), residuals("ms-bp"), residuals("lowmembp")
  assert low.total_bytes == ms.total_bytes < base.total_bytes < plain.total_bytes

  # By hand (fp32 compute: casts are no-ops, every array 4 bytes/element). The lean
  # RMSNorm keeps its input x [B,T,D] only; MS-RMSNorm keeps one fp32 rstd [B,T] instead.
  # Plain-autodiff RMSNorm (y = x * rstd * scale) keeps x, the unscaled x * rstd [B,T,D]
  # (for d/dscale), two [B,T,1] fp32 row stats (rsqrt's output and its jvp factor) and
  # the scale broadcast [1,1,D]. All keep the output, the very array q/k/v (gate/up)
  # save, counted once. 2 norms per layer + the final norm (whose output the fused LM
  # head keeps, not plain autodiff's logits path: the loss here is over logits).
  num_norms = 2 * layers + 1
  assert base.total_bytes - ms.total_bytes == num_norms * (4 * b * t * d - 4 * b * t)
  plain_norm = 4 * (2 * b * t * d + 2 * b * t + d) - 4 * b * t
  # plain also keeps SiLU(g) beside g and u in each layer's gated product: [B,T,F] fp32
  assert plain.total_bytes - ms.total_bytes >= num_norms * plain_norm

  # Under lowmembp every [B,T,D] residual is a norm output (tagged norm_out inside the MS
  # rule, hence the array the linears save), one per norm: not the norm input, not the
  # residual stream; the norm adds only its fp32 rstd [B,T]. The blocks' residuals come
  # out of the scan stacked over layers ([layers, B, T, D], named only "output of scan"),
  # the final norm's alone.

  def count(shape):
    found = [r for r in low.items if r.shape in (shape, (layers,) + shape)]
    return found, sum(layers if len(r.shape) > len(shape) else 1 for r in found)

  full, n = count((b, t, d))
  assert n == num_norms and all("'norm_out'" in r.source or "scan" in r.source for r in full)
  rstd, n = count((b, t))
  assert n == num_norms and all(r.dtype == "float32" for r in rstd)
  assert not {"rms_norm", "_rms_norm_stats"} & set(low.by_origin())
  assert {"rms_norm", "_rms_norm_stats"} <= set(plain.by_origin())


# ----------------------------------------------------------------------------- fused LM loss
def _token_loss_grads(model, tokens, targets, weights, chunk):
  """Weighted loss sum, per-token (losses, correct) and the gradients of every Param, by
  ``model.token_losses`` with ``chunk`` (0: from the logits)."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(p):
    losses, correct = nnx.merge(graphdef, p, rest, copy=True).token_losses(
        tokens, targets, chunk=chunk)
    return jnp.sum(losses * weights), (losses, correct)
  (total, aux), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  return total, aux, nnx.to_pure_dict(grads)


@pytest.mark.parametrize("name,policy,overrides", [
    ("llama-tiny", "lowmembp", {}),                          # final norm merged into lm_head
    ("llama-tiny", "lowmembp", {"tie_embeddings": True}),    # head_scale on the embedding
    ("revllama-tiny", "lowmembp", {}),
], ids=["untied-lowmembp", "tied-lowmembp", "revllama-lowmembp"])
def test_fused_lm_loss_equals_logits_path(name, policy, overrides):
  """token_losses with a ragged chunk (18 tokens, chunk 4): the loss, accuracy and every
  parameter's gradient of the loss on the full logits, fp32 at highest precision."""
  from models import revllama
  family = revllama if name.startswith("rev") else llama
  cls = revllama.RevLlama if name.startswith("rev") else llama.Llama
  model = cls(family.config(name, num_layers=1, **overrides), policy, dtype=jnp.float32,
              rngs=nnx.Rngs(1))
  if getattr(model, "head_scale", None) is not None:  # a merged scale that is not 1
    model.head_scale[...] = 1.0 + 0.5 * jax.random.normal(jax.random.key(5), (model.cfg.dim,))
  assert model.head_weight() is not None
  tokens = jnp.asarray(_tokens(2, 9, vocab=256))
  targets = jnp.roll(tokens, -1, axis=1)
  weights = (jnp.arange(18).reshape(2, 9) % 5 != 0).astype(jnp.float32)
  ref_total, (ref_losses, ref_correct), ref_grads = _token_loss_grads(
      model, tokens, targets, weights, 0)
  total, (losses, correct), grads = _token_loss_grads(model, tokens, targets, weights, 4)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(correct, ref_correct)
  assert abs(float(total) - float(ref_total)) < 1e-4
  scale = max(float(np.max(np.abs(g))) for g in jax.tree.leaves(ref_grads))
  diffs = jax.tree.map(_max_abs, grads, ref_grads)
  assert max(jax.tree.leaves(diffs)) < 1e-5 * scale, diffs


@pytest.mark.parametrize("base_dtype", ["float32", "int8"])
def test_tied_head_under_ms_norms_keeps_no_scaled_table(base_dtype):
  """A tied head with the final norm's scale merged (``head_scale``): the fused loss
  applies the scale inside its passes, so backward keeps no ``[V, D]`` array beyond the
  stored table, as without MS norms (before: a bf16 copy of table x scale every step)."""
  from models.lora import LoRAParam
  from train.config import TrainConfig
  from train.model import build_model
  vocab, dim = 512, 64
  kept = {}
  for policy in ("baseline", "lowmembp"):
    cfg = TrainConfig(name="t", task="lm", model="llama-tiny", policy=policy,
                      trainable="lora", lora_targets="query,value", base_dtype=base_dtype,
                      model_overrides=dict(tie_embeddings=True, vocab_size=vocab, dim=dim))
    model = build_model(cfg)
    assert (model.head_scale is not None) == (policy == "lowmembp")
    graphdef, params, rest = nnx.split(model, LoRAParam, ...)
    tokens = jnp.arange(32).reshape(2, 16) % vocab

    def loss(params):
      losses, _ = nnx.merge(graphdef, params, rest).token_losses(tokens, tokens, chunk=8)
      return losses.mean()
    kept[policy] = [r.shape for r in saved_residuals(loss, params).items
                    if np.prod(r.shape) >= vocab * dim]
  assert kept == {"baseline": [], "lowmembp": []}, kept


def test_fused_lm_loss_falls_back_for_a_lora_head():
  """A LoRA-wrapped lm_head is not one matmul: head_weight is None and token_losses takes
  the loss on the logits (what the model returns, adapter included)."""
  from lowmem_jax.lm_loss import logits_cross_entropy
  from models.lora import apply_lora
  model = apply_lora(llama.Llama(llama.config(num_layers=1), "baseline", dtype=jnp.float32),
                     targets=("lm_head",))
  model.lm_head.lora_b[...] = 0.1 * jnp.ones_like(model.lm_head.lora_b[...])
  assert model.head_weight() is None
  tokens = jnp.asarray(_tokens(2, 5, vocab=256))
  losses, correct = model.token_losses(tokens, tokens, chunk=4)
  ref_losses, ref_correct = logits_cross_entropy(model(tokens), tokens)
  np.testing.assert_array_equal(losses, ref_losses)
  np.testing.assert_array_equal(correct, ref_correct)
  with pytest.raises(ValueError, match="chunk must be an int >= 0"):
    model.token_losses(tokens, tokens, chunk=-1)
