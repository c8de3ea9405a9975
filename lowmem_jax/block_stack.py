"""A built-in pre-LN Transformer block stack in pure JAX, driven by a MemoryPolicy.

Used by the memory report (``python -m lowmem_jax.memory``) and the memory tests, so
methods can be compared on the library alone, before the Flax models. Two flavours:
``"vit"`` (LayerNorm, GELU MLP, biases, bidirectional) and ``"llama"`` (RMSNorm,
SwiGLU MLP, no biases, causal). Layers are stacked on a leading axis and run with
``lax.scan`` (remat savings only show in CPU compiled memory in scan form).

Under ``norm="ms"`` the blocks hold no norm parameters: the norm affine is assumed
merged into the following linear (see :func:`lowmem_jax.norms.merge_norm_affine`),
so the norm output is the very array the next matmul saves.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from lowmem_jax.policy import MemoryPolicy


@dataclasses.dataclass(frozen=True)
class StackConfig:
  kind: str = "vit"          # "vit" | "llama"
  num_layers: int = 2
  dim: int = 768
  num_heads: int = 12
  num_kv_heads: int | None = None  # llama only; None = num_heads
  mlp_dim: int = 3072
  eps: float = 1e-6

  def __post_init__(self):
    if self.kind not in ("vit", "llama"):
      raise ValueError(f"StackConfig: unknown kind {self.kind!r}; valid: 'vit', 'llama'")
    if self.dim % self.num_heads:
      raise ValueError(f"StackConfig: dim {self.dim} not divisible by {self.num_heads} heads")
    if self.num_heads % self.kv_heads:
      raise ValueError(f"StackConfig: {self.num_heads} heads not a multiple of "
                       f"{self.kv_heads} kv heads")

  @property
  def kv_heads(self) -> int:
    return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

  @property
  def head_dim(self) -> int:
    return self.dim // self.num_heads


def init_stack(key, cfg: StackConfig, policy: MemoryPolicy | str = "baseline"):
  """fp32 parameters with a leading ``num_layers`` axis (no norm params under MS norms)."""
  policy = MemoryPolicy.parse(policy)
  d, f, kvd = cfg.dim, cfg.mlp_dim, cfg.kv_heads * cfg.head_dim
  # the out-projection contracts (heads, head_dim) of o directly: no reshape of o or wo
  shapes = {"wqkv": (d, d + 2 * kvd), "wo": (cfg.num_heads, cfg.head_dim, d),
            "w_out": (f, d)}
  shapes["w_in"] = (d, 2 * f) if cfg.kind == "llama" else (d, f)
  keys = jax.random.split(key, len(shapes))
  fan_in = {"wqkv": d, "wo": d, "w_out": f, "w_in": d}
  params = {name: jax.random.normal(k, (cfg.num_layers,) + s, jnp.float32) / fan_in[name] ** 0.5
            for k, (name, s) in zip(keys, sorted(shapes.items()))}
  if cfg.kind == "vit":
    for name, s in list(shapes.items()):
      params["b" + name[1:]] = jnp.zeros((cfg.num_layers, s[-1]), jnp.float32)
  if not policy.merges_norm_affine:
    for norm in ("norm1", "norm2"):
      params[norm + "_scale"] = jnp.ones((cfg.num_layers, d), jnp.float32)
      if cfg.kind == "vit":
        params[norm + "_bias"] = jnp.zeros((cfg.num_layers, d), jnp.float32)
  return params


def _linear(p, name, x, policy, contract=1):
  """The policy's linear strategy on ``x`` with weights ``w<name>`` (``b<name>``)."""
  return policy.linear_fn(name)(x, p["w" + name], p.get("b" + name), contract=contract)


def _norm(p, which, x, cfg, policy):
  kind = "rms" if cfg.kind == "llama" else "layer"
  fn = policy.norm_fn(kind)
  if policy.merges_norm_affine:
    return fn(x, eps=cfg.eps, name="norm_out")
  scale = p[which + "_scale"]
  if kind == "rms":
    return fn(x, scale, eps=cfg.eps, name="norm_out")
  return fn(x, scale, p[which + "_bias"], eps=cfg.eps, name="norm_out")


def _attend(h, p, cfg: StackConfig, policy: MemoryPolicy):
  """The attention's q, k, v projections of ``h: [B, N, D]`` and its core:
  ``o: [B, N, heads, head_dim]``."""
  b, n, d = h.shape
  hd, kvd = cfg.head_dim, cfg.kv_heads * cfg.head_dim
  qkv = checkpoint_name(_linear(p, "qkv", h, policy), "qkv_proj")
  q = qkv[..., :d].reshape(b, n, cfg.num_heads, hd)
  k = qkv[..., d:d + kvd].reshape(b, n, cfg.kv_heads, hd)
  v = qkv[..., d + kvd:].reshape(b, n, cfg.kv_heads, hd)
  return policy.attention_fn()(q, k, v, causal=cfg.kind == "llama", name="attn_out")


def block(p, x, cfg: StackConfig, policy: MemoryPolicy):
  """One pre-LN block on ``x: [B, N, D]`` (compute dtype = x.dtype)."""
  h = _norm(p, "norm1", x, cfg, policy)
  # The ``qkv`` site gets the projections and the attention as one pure function of the
  # norm output and their weights; under qkv=recompute its backward keeps only those.
  qkv = policy.qkv_strategy(cfg.num_heads, cfg.kv_heads, causal=cfg.kind == "llama")
  weights = {name: p[name] for name in ("wqkv", "bqkv") if name in p}
  o = qkv(lambda h, w, _: _attend(h, w, cfg, policy), h, weights, None)
  # Out-projection contracts (heads, head_dim) directly, so it saves the very o the
  # attention saved (a reshape to [B, N, D] would be a second array in the jaxpr).
  x = x + checkpoint_name(_linear(p, "o", o, policy, contract=2), "attn_proj")
  h = _norm(p, "norm2", x, cfg, policy)
  u = checkpoint_name(_linear(p, "_in", h, policy), "mlp_hidden")
  inputs = (u[..., :cfg.mlp_dim], u[..., cfg.mlp_dim:]) if cfg.kind == "llama" else (u,)
  # The ``hidden`` site gets the activation and the last linear as one pure function;
  # under hidden=recompute its backward keeps only the activation's input(s).
  weights = {name: p[name] for name in ("w_out", "b_out") if name in p}
  act, gated = ("silu", True) if cfg.kind == "llama" else ("gelu", False)
  hidden = policy.hidden_strategy(act, gated=gated)
  out = hidden(lambda a, w, _: _activate_out(a, w, cfg, policy), inputs, weights, None)
  return x + out


def _activate_out(inputs, p, cfg: StackConfig, policy: MemoryPolicy):
  """The MLP's activation of ``inputs`` (``(h,)``, or LLaMA's ``(gate, up)``) and its
  last linear."""
  if cfg.kind == "llama":
    a = policy.activation_fn("silu", gated=True)(*inputs)
  else:
    a = policy.activation_fn("gelu")(*inputs)
  return _linear(p, "_out", checkpoint_name(a, "mlp_act"), policy)


def apply_stack(params, x, cfg: StackConfig, policy: MemoryPolicy | str = "baseline"):
  """Runs all layers with ``lax.scan`` (or as the policy's ``layers`` says); each block
  is rematted per the policy."""
  policy = MemoryPolicy.parse(policy)
  body = policy.remat_block(lambda p, h: block(p, h, cfg, policy))
  out, _ = policy.layers_strategy()(lambda h, p: (body(p, h), None), x, params)
  return out


def stack_loss(params, x, cfg: StackConfig, policy: MemoryPolicy | str = "baseline"):
  """A scalar loss of the stack's output, for memory measurements.

  Linear in the output (its inner product with the input, held constant), so the loss
  saves nothing and every residual belongs to the blocks; its gradient is not a constant
  that XLA could fold away.
  """
  out = apply_stack(params, x, cfg, policy)
  return jnp.sum(out * jax.lax.stop_gradient(x), dtype=jnp.float32) / x.size


def sgd_step(params, x, cfg: StackConfig, policy: MemoryPolicy | str = "baseline",
             lr: float = 1e-3):
  """A whole train step (loss, gradients, SGD update), for compiled-memory comparisons."""
  loss, grads = jax.value_and_grad(stack_loss)(params, x, cfg, policy)
  return loss, jax.tree.map(lambda p, g: p - lr * g, params, grads)
