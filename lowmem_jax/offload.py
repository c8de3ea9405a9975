"""Activation offload to host memory as a policy method: ``remat="offload"``.

A block runs under ``jax.checkpoint`` with
``jax.checkpoint_policies.save_and_offload_only_these_names``: the tensors the blocks tag
(:data:`lowmem_jax.remat.CHECKPOINT_NAMES`) are copied to pinned host memory in forward
and back to the device in backward; everything else in the block is recomputed. The
device keeps the block input only, at the cost of the host transfers (whether XLA
overlaps them with compute is for a GPU measurement to show; none has been made). Combines with the methods that change what the ops save
(``lowmembp+offload``); it is a value of ``remat``, so not with another remat.

On the CPU backend host and device memory are the same RAM: JAX lowers the moves to
nothing, so the named tensors stay where they are and ``offload`` computes and keeps
exactly what ``remat:save=<all names>`` does. Preset ``offload``.
"""

from __future__ import annotations

import jax

from lowmem_jax import gpu_target
from lowmem_jax.baseline import Block
from lowmem_jax.methods import Method
from lowmem_jax.remat import CHECKPOINT_NAMES

SOURCE, DESTINATION = "device", "pinned_host"


def checkpoint_policy():
  """The ``jax.checkpoint`` policy: offload every named tensor, save nothing else."""
  return jax.checkpoint_policies.save_and_offload_only_these_names(
      names_which_can_be_saved=(), names_which_can_be_offloaded=CHECKPOINT_NAMES,
      offload_src=SOURCE, offload_dst=DESTINATION)


def _check_device():
  if gpu_target.active() is not None:  # a CUDA GPU has pinned host memory; a simulated
    return                             # one lists no memories
  device = jax.devices()[0]
  kinds = [m.kind for m in device.addressable_memories()]
  if DESTINATION not in kinds:
    raise ValueError(f"offload: {device.platform} device {device.id} has no "
                     f"{DESTINATION!r} memory (it has {', '.join(kinds)}); use remat instead")


def _block(policy, inner):
  if policy.remat != "offload":
    return inner
  _check_device()
  return Block(checkpoint_policy(), saves="policy")


METHOD = Method(
    name="offload",
    values={"remat": ("offload",)},
    presets={"offload": {"remat": "offload"}},
    strategies={"block": _block},
)
