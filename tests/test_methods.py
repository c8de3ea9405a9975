"""The method registry and the strategies the policy hands each site: composition in
method order, carried activations, sites holding strategy state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lowmem_jax import activations, baseline, methods, norms, quant
from lowmem_jax import policy as policy_lib
from lowmem_jax.baseline import Activation, Linear, Norm, Shared
from lowmem_jax.memory import saved_residuals
from lowmem_jax.mesa import CodedActivation, CodedAttention, CodedNorm, CodedShared, Coder
from lowmem_jax.policy import METHODS, PRESETS, MemoryPolicy
from lowmem_jax.wta_crs import SampledLinear
from models.sites import CodeSite, KeySite, Site, StateSite, seed_sites


def test_each_method_brings_its_fields_presets_and_known_site_kinds():
  for method in METHODS:
    for preset in method.presets:
      policy = MemoryPolicy.parse(preset)
      assert policy == MemoryPolicy(**PRESETS[preset])
      assert MemoryPolicy.parse(policy.spec) == policy, preset
  # a field or preset defined by two methods is an error naming it
  mesa = next(m for m in METHODS if m.name == "mesa")
  with pytest.raises(ValueError, match="redefines the policy field 'quant'"):
    policy_lib._collect(METHODS + (methods.Method("again", fields=mesa.fields[:1]),))
  with pytest.raises(ValueError, match="redefines the preset 'mesa8'"):
    policy_lib._collect(METHODS + (methods.Method("again", presets={"mesa8": {}}),))
  with pytest.raises(ValueError, match="unknown site kinds.*'lienar'"):
    methods.Method("typo", strategies={"lienar": lambda policy, inner: inner})


def test_the_baseline_strategies_keep_inputs_and_plain_is_autodiff():
  p = MemoryPolicy()
  assert isinstance(p.shared_strategy(), Shared)
  assert p.linear_strategy("fc1") == Linear(lean=True)
  act = p.activation_strategy("gelu")
  assert isinstance(act, Activation) and act.saved_bits is None and not act.gated
  assert act.fn is baseline.lean_activation("gelu")
  assert p.activation_strategy("silu", gated=True).keep_gate_inputs
  norm = p.norm_strategy("rms")
  assert isinstance(norm, Norm) and norm.has_affine and norm.fn is baseline.lean_rms_norm
  assert p.block_strategy().checkpoint_policy is None
  plain = MemoryPolicy.parse("plain")
  assert (plain.autodiff, plain.attention) == ("plain", "xla")
  assert plain.linear_strategy("fc1") == Linear(lean=False)
  assert plain.norm_strategy("rms").fn is norms.rms_norm
  assert not plain.activation_strategy("silu", gated=True).keep_gate_inputs
  x = jnp.linspace(-3, 3, 8)
  np.testing.assert_array_equal(p.activation_strategy("silu", gated=True)(x, 2 * x),
                                jax.nn.silu(x) * 2 * x)
  with pytest.raises(ValueError, match="unknown site kind 'mlp'"):
    p.strategy("mlp")


def test_later_methods_replace_or_wrap_earlier_strategies():
  low = MemoryPolicy.parse("lowmembp")
  assert low.activation_strategy("gelu").fn is activations.regelu2
  assert low.activation_strategy("gelu").saved_bits == 2
  assert not low.norm_strategy("layer").has_affine
  mesa = MemoryPolicy.parse("lowmembp+mesa8")
  # approx2 keeps 2 bits per element: fewer than a code, so Mesa leaves it...
  assert mesa.activation_strategy("gelu") == low.activation_strategy("gelu")
  # ...but a gated product's backward needs act(g) and u: Mesa keeps codes of g and u,
  # with the exact SiLU (approx2 leaves a gated product to the lean exact rule)
  assert low.activation_strategy("silu", gated=True) == MemoryPolicy().activation_strategy(
      "silu", gated=True)
  gated = mesa.activation_strategy("silu", gated=True)
  assert isinstance(gated, CodedActivation) and gated.fn is baseline.lean_activation("silu")
  assert set(gated.init_state()) == {"gate", "up"}
  exact = MemoryPolicy.parse("mesa8").activation_strategy("gelu")
  assert isinstance(exact, CodedActivation) and set(exact.init_state()) == {"input"}
  norm = mesa.norm_strategy("layer")
  assert isinstance(norm, CodedNorm) and not norm.has_affine
  assert set(norm.init_state()) == {"output"}
  assert set(MemoryPolicy.parse("mesa8").norm_strategy("layer").init_state()) == {
      "input", "output"}
  attn = mesa.attention_strategy(4, 2, causal=True)
  assert isinstance(attn, CodedAttention) and attn.inner.causal
  assert (attn.heads.groups, attn.kv_heads.groups, attn.heads.axis) == (4, 2, 2)
  assert isinstance(mesa.shared_strategy(groups=2, axis=2), CodedShared)


def test_wta_crs_samples_the_targets_unless_frozen():
  p = MemoryPolicy.parse("mesa8+wta-crs+sample_targets=fc1+sample_ratio=0.5")
  assert p.linear_strategy("fc1") == SampledLinear(0.5)
  assert isinstance(p.linear_strategy("fc1", frozen=True), Linear)
  assert isinstance(p.linear_strategy("fc2"), Linear)
  assert isinstance(p.linear_strategy(None), Linear)


def test_the_code_width_is_a_parameter():
  assert MemoryPolicy.parse("mesa8") == MemoryPolicy(quant="mesa", quant_bits=8)
  assert MemoryPolicy(quant="mesa").spec == "mesa8"
  assert MemoryPolicy.parse("quant=mesa+quant_bits=8") == MemoryPolicy.parse("mesa8")
  assert MemoryPolicy.parse("mesa8+quant_bits=8") == MemoryPolicy.parse("mesa8")
  with pytest.raises(ValueError, match="unknown quant_bits 4; valid: 8"):
    MemoryPolicy.parse("mesa8+quant_bits=4")
  with pytest.raises(ValueError, match="quant_bits must be an integer"):
    MemoryPolicy.parse("quant_bits=many")


def _carried(x):
  qt, _ = quant.quantize_tensor(x, quant.QuantState.create(1))
  return qt


def test_read_runs_plain_inputs_plainly_and_carried_ones_by_their_rule():
  x = jax.random.normal(jax.random.key(0), (16, 8))
  w = jax.random.normal(jax.random.key(1), (8, 4))
  np.testing.assert_array_equal(methods.read(jnp.matmul, [x], (w,)), x @ w)
  qt = _carried(x)
  assert methods.value_of(qt) is qt.value and methods.value_of(x) is x
  np.testing.assert_array_equal(methods.read(jnp.matmul, [qt], (w,)), x @ w)
  res = saved_residuals(lambda v, w: jnp.sum(methods.read(jnp.matmul, [_carried(v)], (w,))),
                        x, w)
  assert [r.dtype for r in res.items if r.shape == x.shape] == ["uint8"]
  with pytest.raises(ValueError, match="mix plain and carried"):
    methods.read(jnp.add, [qt, x])


class _Holder(nnx.Module):

  def __init__(self, strategy):
    self.site = Site(strategy)


def test_a_site_holds_its_strategy_state_and_updates_it():
  holder = _Holder(CodedShared(Coder()))
  assert isinstance(holder.site.code, CodeSite) and holder.site.state_names == ("code",)
  x = jnp.arange(12.0).reshape(3, 4)
  with pytest.warns(UserWarning, match=r"default PRNG key.*seed_sites\(model, rngs\)"):
    holder.site(x)  # a key nobody set: every such site would draw the same noise
  holder = _Holder(CodedShared(Coder()))
  seed_sites(holder, nnx.Rngs(0))
  qt = holder.site(x)
  assert isinstance(qt, quant.QTensor) and int(holder.site.code.count[...]) == 1
  np.testing.assert_allclose(holder.site.code.hi[...], [11.0])
  assert holder.site(qt) is qt and int(holder.site.code.count[...]) == 1  # coded upstream
  sampled = _Holder(SampledLinear(0.5))
  assert isinstance(sampled.site.sampler, KeySite)
  stateless = _Holder(Shared())
  assert stateless.site.state_names == () and stateless.site(x) is x
  assert not jax.tree.leaves(nnx.state(stateless))


def test_seed_sites_gives_stacked_states_a_key_per_layer():
  @nnx.vmap(in_axes=None, out_axes=0, axis_size=3)
  def stacked(_):
    return _Holder(MemoryPolicy.parse("mesa8").attention_strategy(2))

  holders = [stacked(0), _Holder(SampledLinear(0.5))]

  class Model(nnx.Module):
    def __init__(self):
      self.parts = nnx.List(holders)

  model = Model()
  assert seed_sites(model, nnx.Rngs(0)) == 4 * 3 + 1
  keys = [np.asarray(s.key[...]).reshape(-1, 2) for _, s in nnx.iter_graph(model)
          if isinstance(s, StateSite)]
  assert keys[0].shape == (3, 2)
  flat = {tuple(k) for block in keys for k in block}
  assert len(flat) == 13
