"""Rematerialisation of blocks as a policy method: the ``remat`` field.

``remat``: None (a block keeps what its ops save), "full" (only its input; everything
else is recomputed in backward), a ``jax.checkpoint_policies`` name, or a tuple of
:data:`CHECKPOINT_NAMES` to save (``remat:save=qkv_proj,attn_out`` in a spec; the rest is
recomputed). Other methods may add values (``values={"remat": ...}`` in their
:class:`~lowmem_jax.methods.Method`) and the block strategy for them. Preset ``remat``.
"""

from __future__ import annotations

import jax

from lowmem_jax.baseline import Block
from lowmem_jax.methods import Field, Method, check_choice

# Tensors the blocks tag with jax.ad_checkpoint.checkpoint_name, for remat:save=...
CHECKPOINT_NAMES = (
    "norm_out",    # output of a block's norm (input of the next linear)
    "qkv_proj",    # query/key/value projections
    "attn_out",    # attention output, before the out-projection
    "attn_proj",   # out-projection output
    "mlp_hidden",  # first MLP linear(s) output, before the activation
    "mlp_act",     # activation output (input of the last MLP linear)
)  # (not the last MLP linear's output: no backward reads it, so saving it keeps nothing)

# jax.checkpoint_policies entries that are policies themselves (not policy factories).
REMAT_POLICY_NAMES = tuple(n for n in (
    "nothing_saveable", "everything_saveable", "dots_saveable", "checkpoint_dots",
    "dots_with_no_batch_dims_saveable", "checkpoint_dots_with_no_batch_dims",
) if hasattr(jax.checkpoint_policies, n))


def _check(value, extra):
  if isinstance(value, list):
    value = tuple(value)
  if isinstance(value, tuple):
    if not value:
      raise ValueError("MemoryPolicy: remat=() saves nothing; use remat='full'")
    for name in value:
      check_choice("checkpoint name in remat", name, CHECKPOINT_NAMES)
    return tuple(n for n in CHECKPOINT_NAMES if n in value)  # one spec for one set of names
  if value is not None:
    check_choice("remat", value, ("full",) + REMAT_POLICY_NAMES + extra)
  return value


def _check_saved_names(policy):
  if isinstance(policy.remat, tuple) and "norm_out" in policy.remat and policy.quant != "none":
    raise ValueError(f"MemoryPolicy: remat:save=norm_out under quant={policy.quant!r}: the "
                     "norm's output is kept as its 8-bit code, which no name saves; drop "
                     "norm_out")


def _block(policy, inner):
  remat = policy.remat
  if remat == "full":
    return Block(jax.checkpoint_policies.nothing_saveable, saves="input")
  if isinstance(remat, tuple):
    return Block(jax.checkpoint_policies.save_only_these_names(*remat), saves="policy")
  if remat in REMAT_POLICY_NAMES:
    return Block(getattr(jax.checkpoint_policies, remat), saves="policy")
  return inner  # None, or a value another method adds (and acts on)


METHOD = Method(
    name="remat",
    fields=(Field("remat", None, "None | full | a jax.checkpoint_policies name | a tuple "
                  "of checkpoint names to save (the rest of the block is recomputed)",
                  check=_check),),
    presets={"remat": {"remat": "full"}},
    strategies={"block": _block},
    check=_check_saved_names,
)
