"""kernels="pallas_interpret" and kernels="xla" are the same model: the block stack under
"lowmembp" gives the same outputs, gradients and saved residuals with either. And
kernels="xla" never imports Pallas: not at import, not in a model's forward and backward."""

import functools
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lowmem_jax import block_stack
from lowmem_jax.block_stack import StackConfig
from lowmem_jax.memory import saved_residuals
from lowmem_jax.policy import MemoryPolicy

CONFIGS = {"vit": StackConfig(kind="vit", num_layers=2, dim=32, num_heads=4, mlp_dim=64),
           "llama": StackConfig(kind="llama", num_layers=2, dim=32, num_heads=4, mlp_dim=64)}
PALLAS, XLA = "lowmembp+kernels=pallas_interpret", "lowmembp+kernels=xla"
KERNEL_NAMES = {"vit": {"regelu2_forward", "approx2_backward", "ms_layer_norm_forward",
                        "ms_layer_norm_backward"},
                # the gated SiLU stays exact under approx2 (lowmem_jax/approx_bp.py)
                "llama": {"ms_rms_norm_forward", "ms_rms_norm_backward"}}


def _x(cfg, batch, seq):
  return jax.random.normal(jax.random.key(7), (batch, seq, cfg.dim), jnp.float32)


def _loss(params, x, cfg, spec):
  return jnp.sum(jnp.sin(block_stack.apply_stack(params, x, cfg, spec)))


@functools.cache
def _grad_fn(kind, spec):
  return jax.jit(jax.value_and_grad(functools.partial(_loss, cfg=CONFIGS[kind], spec=spec),
                                    argnums=(0, 1)))


def test_policy_resolves_kernels():
  assert MemoryPolicy.parse(PALLAS).kernel_implementation() == "pallas_interpret"
  assert MemoryPolicy.parse(XLA).kernel_implementation() == "xla"
  assert MemoryPolicy.parse(PALLAS).spec == PALLAS
  # Same parameters under both: kernels change no parameter layout.
  for cfg in CONFIGS.values():
    a = block_stack.init_stack(jax.random.key(0), cfg, PALLAS)
    b = block_stack.init_stack(jax.random.key(0), cfg, XLA)
    assert jax.tree.structure(a) == jax.tree.structure(b)


@pytest.mark.parametrize("kind", CONFIGS)
def test_pallas_interpret_really_dispatches_to_the_kernels(kind):
  cfg = CONFIGS[kind]
  params = block_stack.init_stack(jax.random.key(0), cfg, PALLAS)
  x = _x(cfg, 2, 5)
  names = lambda spec: set(re.findall(
      r"\b(re(?:gelu|silu)2_forward|approx2_backward|ms_(?:layer|rms)_norm_(?:for|back)ward)\b",
      str(jax.make_jaxpr(jax.grad(_loss, argnums=(0, 1)), static_argnums=(2, 3))(
          params, x, cfg, spec))))
  assert names(PALLAS) == KERNEL_NAMES[kind]
  assert names(XLA) == set()


@pytest.mark.parametrize("kind", CONFIGS)
def test_same_outputs_and_gradients(kind):
  cfg = CONFIGS[kind]
  params = block_stack.init_stack(jax.random.key(0), cfg, PALLAS)
  x = _x(cfg, 2, 7)
  forward = lambda spec: jax.jit(functools.partial(block_stack.apply_stack, cfg=cfg,
                                                   policy=spec))(params, x)
  out, out_ref = forward(PALLAS), forward(XLA)
  np.testing.assert_allclose(np.asarray(out), np.asarray(out_ref), rtol=1e-5, atol=1e-5)
  loss, (g, gx) = _grad_fn(kind, PALLAS)(params, x)
  loss_ref, (g_ref, gx_ref) = _grad_fn(kind, XLA)(params, x)
  np.testing.assert_allclose(float(loss), float(loss_ref), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(gx), np.asarray(gx_ref), rtol=1e-4, atol=1e-4)
  assert set(g) == set(g_ref)
  for name in g:
    np.testing.assert_allclose(np.asarray(g[name]), np.asarray(g_ref[name]), rtol=1e-4,
                               atol=1e-4, err_msg=name)


@pytest.mark.parametrize("kind", CONFIGS)
def test_second_order_autodiff_matches_xla(kind):
  """Reverse over reverse (a Hessian-vector product) through the kernels, the scanned
  stack's custom_vjp rules differentiated again: what the jnp path gives, each kernel
  being differentiated as its reference (JAX cannot differentiate a pallas_call). Forward
  over reverse is refused by JAX's own error (lowmem_jax.dispatch.differentiated_as)."""
  cfg = CONFIGS[kind]
  params = block_stack.init_stack(jax.random.key(0), cfg, PALLAS)
  x = _x(cfg, 2, 5)
  v = jax.random.normal(jax.random.key(8), x.shape)

  def grad_x(spec):
    return jax.grad(functools.partial(_loss, cfg=cfg, spec=spec), argnums=1)

  def vhp(spec):
    return jax.jit(jax.grad(lambda p, x: jnp.vdot(grad_x(spec)(p, x), v), argnums=(0, 1)))(
        params, x)

  got, want = vhp(PALLAS), vhp(XLA)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4,
                               atol=1e-4 * float(jnp.max(jnp.abs(b))))
  with pytest.raises(TypeError, match="custom_vjp"):
    jax.jvp(lambda x: grad_x(PALLAS)(params, x), (x,), (v,))


def _residuals(cfg, spec, batch, seq):
  params = block_stack.init_stack(jax.random.key(0), cfg, spec)
  forward = functools.partial(block_stack.apply_stack, cfg=cfg, policy=spec)
  return saved_residuals(forward, params, _x(cfg, batch, seq))


@pytest.mark.parametrize("kind", CONFIGS)
def test_same_saved_residual_bytes_per_token(kind):
  cfg, seq = CONFIGS[kind], 8
  per_token, arrays = {}, {}
  for spec in (PALLAS, XLA):
    small, large = _residuals(cfg, spec, 2, seq), _residuals(cfg, spec, 4, seq)
    per_token[spec] = (large.total_bytes - small.total_bytes) / (2 * seq * cfg.num_layers)
    arrays[spec] = sorted((r.dtype, r.shape) for r in small.items)
  assert per_token[PALLAS] == per_token[XLA] > 0
  # Array for array the same residuals (dtype and shape).
  assert arrays[PALLAS] == arrays[XLA]


# Modules that mean our kernels or Pallas's GPU front end (and its Triton lowering) were
# loaded. Flax itself imports Pallas's core (jax.extend.pallas), so past `import flax` only
# these are checked; lowmem_jax alone (no Flax) must load no Pallas module at all.
KERNEL_MODULES = ("jax.experimental.pallas", "jax._src.pallas.triton", "pallas_kernels")

NO_PALLAS_SCRIPT = textwrap.dedent("""
    import sys
    loaded = lambda prefixes: sorted(m for m in sys.modules if m.startswith(prefixes))
    import lowmem_jax, lowmem_jax.policy, lowmem_jax.quant
    assert not loaded(("jax.experimental.pallas", "jax._src.pallas", "pallas_kernels")), \\
        ("import lowmem_jax", loaded(("jax._src.pallas", "pallas_kernels")))
    import jax, jax.numpy as jnp
    from flax import nnx
    import models.vit
    KERNELS = {modules!r}
    assert not loaded(KERNELS), ("import models.vit", loaded(KERNELS))
    for spec in ("lowmembp+kernels=xla", "mesa8+kernels=xla"):
      model = models.vit.ViT("vit-tiny", spec, dtype=jnp.float32)
      grads = nnx.jit(nnx.grad(lambda m: m(jnp.ones((2, 32, 32, 3))).sum()))(model)
      jax.block_until_ready(jax.tree.leaves(nnx.state(grads)))
      assert not loaded(KERNELS), (spec, loaded(KERNELS))
    # Control: the interpret kernels do load Pallas, and the check above would see it.
    lowmem_jax.policy.MemoryPolicy.parse("lowmembp+kernels=pallas_interpret").activation_fn(
        "gelu")(jnp.ones((4,)))
    assert {{"pallas_kernels.activations", "jax.experimental.pallas"}} <= set(
        loaded(KERNELS)), loaded(KERNELS)
    print("ok")
""")


@pytest.mark.slow
def test_xla_kernels_never_import_pallas():
  script = NO_PALLAS_SCRIPT.format(modules=KERNEL_MODULES)
  proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                        timeout=300, cwd=Path(__file__).resolve().parents[1])
  assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
