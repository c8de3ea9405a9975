"""One block stack for every model: blocks stored stacked, run with ``lax.scan``.

``BlockStack(make_block, num_layers, policy, rngs)`` builds ``num_layers`` blocks as one
module whose variables carry a leading layer axis (``nnx.vmap`` over ``make_block``, each
layer its own init key), and ``stack(carry, *shared)`` runs them in order with a
scan: the program holds one block however deep the model, so compile time does
not grow with depth, and remat is applied here, once, by the policy
(``policy.remat_block``). The policy's ``layers`` field may run the same blocks
unrolled instead (:mod:`lowmem_jax.layers`: no residuals stacked, which on a GPU are
copies). ``carry`` is any pytree a block maps to the same structure
(ViT/LLaMA: the hidden state; BERT: the norm output and the affine it carries);
``shared`` are the same for every layer (RoPE tables, masks).

State a block updates in its forward (Mesa's ranges, WTA-CRS key counts) is stacked like
the parameters and comes back updated, per layer. ``stack.layer(i)`` is a view of layer
``i`` (a copy, for reading); HF import/export and LoRA work on the stacked variables
(:mod:`models.hf_state`, :mod:`models.lora`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx

from lowmem_jax.policy import MemoryPolicy
from models.linear import FrozenKernel, NormAffine

# Variables a forward pass never writes: scanned as inputs, not carried out of the scan
# (a stored frozen kernel carried out would be a fresh copy of it per step).
READ_ONLY = nnx.Any(nnx.Param, FrozenKernel, NormAffine)


def stacked(make: Callable[[nnx.Rngs], nnx.Module], num_layers: int,
            rngs: nnx.Rngs) -> nnx.Module:
  """``num_layers`` modules ``make(rngs)`` as one module with stacked variables (each
  layer initialised from its own split of ``rngs``)."""

  @nnx.split_rngs(splits=num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=num_layers)
  def create(rngs):
    return make(rngs)

  return create(rngs)


class BlockStack(nnx.Module):
  """``num_layers`` blocks of one kind, stacked, scanned, rematted per the policy."""

  def __init__(self, make_block: Callable[[nnx.Rngs], nnx.Module], num_layers: int,
               policy: MemoryPolicy | str, rngs: nnx.Rngs):
    if num_layers < 1:
      raise ValueError(f"BlockStack: num_layers must be >= 1, got {num_layers}")
    self.num_layers = num_layers
    self.policy = MemoryPolicy.parse(policy)
    self.blocks = stacked(make_block, num_layers, rngs)

  def __call__(self, carry, *shared):
    """``carry`` through every block in order: ``carry = block_i(carry, *shared)``.

    Functional inside (``lax.scan``, or the policy's ``layers`` strategy, over the stacked
    state, each layer merged afresh), so
    the stack also runs in a model that was merged inside a jax transform; state the
    blocks update (anything but ``nnx.Param`` and stored frozen kernels) is written back
    once, after the scan.
    """
    graphdef, params, rest = nnx.split(self.blocks, READ_ONLY, ...)

    def layer(carry, layer_state):
      block = nnx.merge(graphdef, *layer_state)
      carry = block(carry, *shared)
      return carry, nnx.state(block, nnx.Not(READ_ONLY))

    run_layers = self.policy.layers_strategy()  # lax.scan, or its unrolled twin
    carry, new_rest = run_layers(self.policy.remat_block(layer), carry, (params, rest))
    if any(getattr(m, "updates_state", False) for _, m in nnx.iter_graph(self.blocks)):
      nnx.update(self.blocks, new_rest)  # not where nothing writes (eval mode, no state)
    return carry

  def layer(self, i: int) -> nnx.Module:
    """Layer ``i`` as a plain block (a copy of its variables)."""
    if not -self.num_layers <= i < self.num_layers:
      raise IndexError(f"BlockStack: layer {i} of {self.num_layers}")
    graphdef, state = nnx.split(self.blocks)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))
