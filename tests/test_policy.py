"""MemoryPolicy: presets, parsing, combinations, errors, and what models ask of it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowmem_jax import activations, baseline, norms
from lowmem_jax.memory import saved_residuals
from lowmem_jax.policy import CHECKPOINT_NAMES, PRESETS, REMAT_POLICY_NAMES, MemoryPolicy


@pytest.mark.parametrize("spec,expected", [
    ("baseline", MemoryPolicy()),
    ("approx-bp", MemoryPolicy(activation="approx2")),
    ("ms-bp", MemoryPolicy(norm="ms")),
    ("lowmembp", MemoryPolicy(activation="approx2", norm="ms")),
    ("approx-bp+ms-bp", MemoryPolicy(activation="approx2", norm="ms")),
    ("remat", MemoryPolicy(remat="full")),
    ("lowmembp+remat", MemoryPolicy(activation="approx2", norm="ms", remat="full")),
    ("remat:dots_saveable", MemoryPolicy(remat="dots_saveable")),
    ("remat:save=qkv_proj,attn_out", MemoryPolicy(remat=("qkv_proj", "attn_out"))),
    ("lowmembp + attention=xla", MemoryPolicy(activation="approx2", norm="ms", attention="xla")),
    ("kernels=xla", MemoryPolicy(kernels="xla")),
    ("mesa8", MemoryPolicy(quant="mesa")),
    ("lowmembp+mesa8", MemoryPolicy(activation="approx2", norm="ms", quant="mesa")),
    ("lowmem", MemoryPolicy(activation="approx2", norm="ms", quant="mesa")),
    ("wta-crs", MemoryPolicy(sampled_linear="wta-crs")),
    ("wta-crs+sample_ratio=0.5+sample_targets=fc1,fc2",
     MemoryPolicy(sampled_linear="wta-crs", sample_ratio=0.5, sample_targets=("fc1", "fc2"))),
    ("reversible", MemoryPolicy(reversible="vanilla")),
    ("pareprop", MemoryPolicy(reversible="pareprop")),
])
def test_parse(spec, expected):
  assert MemoryPolicy.parse(spec) == expected


@pytest.mark.parametrize("spec", ["baseline", "lowmembp", "lowmembp+remat", "ms-bp+remat:dots_saveable",
                                  "remat:save=norm_out,mlp_act", "approx-bp+attention=flash+kernels=xla",
                                  "lowmembp+mesa8", "mesa8+wta-crs+sample_ratio=0.25",
                                  "wta-crs+sample_targets=query,fc2", "lowmembp+pareprop"])
def test_spec_round_trips(spec):
  policy = MemoryPolicy.parse(spec)
  assert MemoryPolicy.parse(policy.spec) == policy
  assert str(policy) == policy.spec


def test_spec_prefers_preset_names():
  assert MemoryPolicy(activation="approx2", norm="ms", remat="full").spec == "lowmembp+remat"
  assert MemoryPolicy().spec == "baseline"
  assert MemoryPolicy.parse("lowmembp+mesa8+remat").spec == "lowmem+remat"


def test_add_combines_and_parse_passes_policies_through():
  p = MemoryPolicy.parse("lowmembp")
  assert p + "remat" == MemoryPolicy.parse("lowmembp+remat")
  assert MemoryPolicy.parse(p) is p


def test_every_remat_policy_name_maps_to_jax():
  for name in REMAT_POLICY_NAMES:
    assert MemoryPolicy(remat=name).checkpoint_policy() is getattr(jax.checkpoint_policies, name)
  assert MemoryPolicy(remat="full").checkpoint_policy() is jax.checkpoint_policies.nothing_saveable
  assert MemoryPolicy().checkpoint_policy() is None


@pytest.mark.parametrize("spec,match", [
    ("lowmemory", "unknown preset 'lowmemory'.*baseline, plain, approx-bp, ms-bp, lowmembp, remat"),
    ("remat:dots", "unknown remat 'dots'.*dots_saveable"),
    ("remat:save=qkv", "unknown checkpoint name in remat 'qkv'.*qkv_proj"),
    ("remat:save=", "saves nothing"),
    ("attention=fast", "unknown attention 'fast'.*cudnn"),
    ("activation=relu", "unknown activation 'relu'"),
    ("norm=batch", "unknown norm 'batch'"),
    ("kernels=cuda", "unknown kernels 'cuda'"),
    ("speed=fast", "unknown field 'speed'"),
    ("remat+remat:dots_saveable", "already set remat"),
    ("attention=xla+attention=flash", "already set attention"),
    ("", "non-empty"),
    ("quant=int4", "unknown quant 'int4'"),
    ("wta-crs+sample_ratio=0", r"sample_ratio must be in \(0, 1\]"),
    ("wta-crs+sample_ratio=lots", "sample_ratio must be a number"),
    ("wta-crs+sample_targets=proj", "unknown linear in sample_targets 'proj'"),
    ("reversible+mesa8", "keeps no block activations"),
    ("pareprop+remat", "keeps no block activations"),
    ("reversible=fast", "unknown reversible 'fast'"),
    ("sample_targets=fc1", "sampled_linear is 'none'"),
    ("lowmembp+sample_ratio=0.5", "sampled_linear is 'none'"),
])
def test_bad_specs_are_clear_errors(spec, match):
  with pytest.raises(ValueError, match=match):
    MemoryPolicy.parse(spec)


@pytest.mark.parametrize("spec", ["lowmembp+", "+remat", "lowmembp++remat", "+"])
def test_an_empty_part_is_named(spec):
  """A stray '+' said "unknown preset ''; valid presets: ..." (no hint where)."""
  with pytest.raises(ValueError) as e:
    MemoryPolicy.parse(spec)
  assert str(e.value) == (f"MemoryPolicy: {spec!r} has an empty part; join presets and "
                          "field=value by single '+' (e.g. 'lowmembp+remat')")


def test_bad_constructor_values_are_errors():
  with pytest.raises(ValueError, match="unknown norm"):
    MemoryPolicy(norm="MS")
  with pytest.raises(ValueError, match="checkpoint name"):
    MemoryPolicy(remat=("qkv_proj", "nope"))
  assert MemoryPolicy(remat=["qkv_proj"]).remat == ("qkv_proj",)  # lists normalised


def test_reversible_on_a_standard_model_names_both_reversible_families():
  with pytest.raises(ValueError, match=r"Llama: .*revvit-\*, revllama-\*"):
    MemoryPolicy.parse("reversible").check_architecture("Llama")


def test_presets_are_valid_policies():
  for name, fields in PRESETS.items():
    assert MemoryPolicy.parse(name) == MemoryPolicy(**fields)


def test_a_stateful_plain_function_names_the_modules_to_build_from():
  with pytest.raises(ValueError, match=r"'lowmem': its norm keeps state .*models\.norm\.Norm"
                                       r".*models\.attention\.SelfAttention.*seed_sites"):
    MemoryPolicy.parse("lowmem").norm_fn("layer")


def test_activation_and_norm_choices():
  exact, approx = MemoryPolicy(), MemoryPolicy.parse("lowmembp")
  assert approx.activation_fn("gelu") is activations.regelu2
  assert approx.activation_fn("silu") is activations.resilu2
  assert approx.norm_fn("layer") is norms.ms_layer_norm
  assert approx.norm_fn("rms") is norms.ms_rms_norm and approx.merges_norm_affine
  assert exact.norm_fn("layer") is baseline.lean_layer_norm and not exact.merges_norm_affine
  assert MemoryPolicy.parse("plain").norm_fn("layer") is norms.layer_norm
  x = jnp.linspace(-4, 4, 33)
  for kind, ref in (("gelu", activations.gelu), ("silu", activations.silu)):
    assert jnp.allclose(exact.activation_fn(kind)(x), ref(x), atol=1e-6)
    assert jnp.allclose(approx.activation_fn(kind)(x), ref(x), atol=1e-6)
  with pytest.raises(ValueError, match="unknown activation kind"):
    exact.activation_fn("relu")
  with pytest.raises(ValueError, match="unknown norm kind"):
    exact.norm_fn("batch")


def test_kernels_field_picks_the_implementation():
  interp = MemoryPolicy.parse("lowmembp+kernels=pallas_interpret")
  assert interp.kernel_implementation() == "pallas_interpret"
  assert interp.activation_fn("gelu") is activations.approx2_fn("gelu", "pallas_interpret")
  assert interp.norm_fn("rms") is norms.ms_norm_fn("rms", "pallas_interpret")
  assert MemoryPolicy(kernels="xla").kernel_implementation() == "xla"
  # The baseline's norms have no kernels: the field does not change them.
  assert MemoryPolicy(kernels="pallas_interpret").norm_fn("layer") is baseline.lean_layer_norm


def test_auto_kernels_pick_xla_until_pallas_is_measured_faster():
  from lowmem_jax.policy import AUTO_PALLAS_BACKENDS
  expected = "pallas" if jax.default_backend() in AUTO_PALLAS_BACKENDS else "xla"
  assert MemoryPolicy().kernel_implementation() == expected


def test_pallas_on_a_backend_without_it_is_a_clear_error():
  if jax.default_backend() == "gpu":
    pytest.skip("Pallas runs here")
  with pytest.raises(ValueError, match="compile for GPU only.*pallas_interpret"):
    MemoryPolicy.parse("lowmembp+kernels=pallas").activation_fn("gelu")


def test_attention_fn_uses_the_policy_implementation_and_block():
  fn = MemoryPolicy(attention="xla").attention_fn()
  assert fn.keywords == {"implementation": "xla", "block_k": 512}
  fn = MemoryPolicy.parse("lowmembp+attention=flash+attention_block=64").attention_fn()
  assert fn.keywords == {"implementation": "flash", "block_k": 64}


def test_attention_block_reaches_mesa_coded_attention():
  strategy = MemoryPolicy.parse("lowmem+attention_block=8").attention_strategy(num_heads=2)
  assert strategy.inner.block_k == 8


@pytest.mark.parametrize("value", ["0", "-3", "x", "6.5"])
def test_attention_block_must_be_a_positive_integer(value):
  with pytest.raises(ValueError, match="attention_block must be a positive integer"):
    MemoryPolicy.parse(f"baseline+attention_block={value}")


def test_remat_block_saves_only_named_tensors():
  w = jnp.ones((8, 8))

  def block(x):
    h = jax.ad_checkpoint.checkpoint_name(jnp.sin(x @ w), CHECKPOINT_NAMES[1])
    return jnp.sum(jnp.cos(h @ w))

  x = jnp.ones((4, 8))
  full = saved_residuals(MemoryPolicy.parse("remat").remat_block(block), x)
  named = saved_residuals(MemoryPolicy.parse(f"remat:save={CHECKPOINT_NAMES[1]}").remat_block(block), x)
  plain = saved_residuals(MemoryPolicy().remat_block(block), x)
  assert full.total_bytes == 0
  assert named.total_bytes == 4 * 8 * 4
  assert plain.total_bytes > named.total_bytes


@pytest.mark.parametrize("spec", ["wta-crs", "mesa8", "lowmem+offload"])
def test_remat_block_on_a_user_module_keeps_its_state_updates(spec):
  """``policy.remat_block`` around a user's NNX block that holds policy state (WTA-CRS
  keys, Mesa ranges): each step advances it as without remat, so the steps' gradients are
  the unrematted ones (a plain ``jax.checkpoint`` ran the block on a copy: the counts
  stayed 0 and every step drew the same sample)."""
  from flax import nnx
  from models.mlp import Mlp
  from models.sites import seed_sites
  x = jax.random.normal(jax.random.key(1), (4, 16, 8))

  def steps(policy_spec):
    policy = MemoryPolicy.parse(policy_spec)
    rngs = nnx.Rngs(0)
    mlp = Mlp(8, 32, policy=policy, rngs=rngs)
    seed_sites(mlp, rngs)
    step = nnx.jit(nnx.grad(lambda m, x: policy.remat_block(lambda m, x: m(x))(m, x).sum()))
    grads = [step(mlp, x) for _ in range(2)]
    return grads, nnx.state(mlp, nnx.Not(nnx.Param))

  rematted, state = steps(spec if "remat" in spec or "offload" in spec else spec + "+remat")
  plain, plain_state = steps(spec.replace("+offload", ""))
  counts = [int(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(state)
            if "count" in jax.tree_util.keystr(path)]
  assert max(counts) == 2, counts  # the state below equals the unrematted run's
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               (nnx.to_pure_dict(rematted[0]), nnx.to_pure_dict(rematted[1]), state),
               (nnx.to_pure_dict(plain[0]), nnx.to_pure_dict(plain[1]), plain_state))
  assert not np.array_equal(rematted[0]["fc1"]["kernel"][...], rematted[1]["fc1"]["kernel"][...])


def test_policy_is_hashable_and_frozen():
  p = MemoryPolicy.parse("lowmembp")
  assert hash(p) == hash(MemoryPolicy.parse("approx-bp+ms-bp"))
  with pytest.raises(dataclasses.FrozenInstanceError):
    p.norm = "standard"


def test_plain_functions_refuse_stateful_strategies_and_theory_skips_codes():
  """Mesa's strategies keep state a plain function cannot carry: asking for one is an
  error (not the uncoded function), and the theoretical figure is left to measurement."""
  from lowmem_jax import block_stack, memory
  mesa = MemoryPolicy.parse("mesa8")
  for ask in (lambda: mesa.activation_fn("gelu"), lambda: mesa.norm_fn("layer"),
              mesa.attention_fn,
              lambda: MemoryPolicy.parse("wta-crs").linear_fn("fc1")):
    with pytest.raises(ValueError, match="keeps state"):
      ask()
  cfg = block_stack.StackConfig()
  for spec in ("mesa8", "lowmembp+mesa8"):
    assert memory.theoretical_bytes_per_token(cfg, MemoryPolicy.parse(spec), 2) is None
  assert memory.theoretical_bytes_per_token(cfg, MemoryPolicy.parse("lowmembp"), 2) == 16184
  assert MemoryPolicy.parse("lowmembp").activation_fn("gelu") is not None


@pytest.mark.parametrize("spec", ["baseline", "lowmembp", "plain"])
def test_linear_fn_is_the_linear_with_its_gradients(spec):
  """x @ kernel + bias over the last ``contract`` axes, in x's dtype; exact gradients."""
  keys = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(keys[0], (2, 5, 3, 4))
  kernel, bias = jax.random.normal(keys[1], (3, 4, 6)), jax.random.normal(keys[2], (6,))
  ct = jax.random.normal(keys[3], (2, 5, 6))
  linear = MemoryPolicy.parse(spec).linear_fn("fc1")

  def ours(x, kernel, bias):
    return jnp.sum(linear(x, kernel, bias, contract=2) * ct)

  def ref(x, kernel, bias):
    return jnp.sum((jnp.einsum("bnij,ijo->bno", x, kernel) + bias) * ct)

  assert linear(x, kernel, contract=2).dtype == jnp.float32
  assert linear(x.astype(jnp.bfloat16), kernel, contract=2).dtype == jnp.bfloat16
  for a, b in zip(jax.grad(ours, (0, 1, 2))(x, kernel, bias),
                  jax.grad(ref, (0, 1, 2))(x, kernel, bias)):
    assert jnp.allclose(a, b, rtol=1e-6, atol=1e-5)
  assert jnp.allclose(ours(x, kernel, bias), ref(x, kernel, bias), rtol=1e-6)


def test_one_spec_for_one_set_of_names():
  """Names given in another order or twice are the same policy with one spec (a resume
  reported "remat:save=qkv_proj,attn_out -> remat:save=attn_out,qkv_proj" as a change)."""
  for a, b in (("remat:save=qkv_proj,attn_out", "remat:save=attn_out,qkv_proj,attn_out"),
               ("wta-crs+sample_targets=fc1,fc2", "wta-crs+sample_targets=fc2,fc1,fc1")):
    assert MemoryPolicy.parse(a) == MemoryPolicy.parse(b)
    assert MemoryPolicy.parse(b).spec == a


@pytest.mark.parametrize("spec, message", [
    # each changed nothing, silently (the compiled step the same program, or only dearer)
    ("mesa8+remat:save=norm_out", r"remat:save=norm_out under quant='mesa': the norm's "
     r"output is kept as its 8-bit code, which no name saves; drop norm_out"),
    ("remat:save=mlp_out", r"unknown checkpoint name in remat 'mlp_out'"),
    ("reversible+qkv=recompute", r"reversible='vanilla' keeps no block activations, so "
     r"qkv='recompute' would change nothing"),
    ("attention=xla+attention_block=4", r"attention_block=4 sizes flash attention's key "
     r"blocks, but attention='xla' runs none; drop one of them"),
    ("plain+attention_block=4", r"attention_block=4 sizes flash"),
])
def test_fields_that_would_change_nothing_are_refused(spec, message):
  with pytest.raises(ValueError, match=message):
    MemoryPolicy.parse(spec)
  assert MemoryPolicy.parse("attention=flash+attention_block=4").attention_block == 4
  assert MemoryPolicy.parse("lowmembp+remat:save=norm_out").remat == ("norm_out",)
