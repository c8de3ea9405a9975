"""Reversible backprop (RevViT, PaReprop) as a policy method: the ``reversible`` field.

A reversible model's stack keeps only its outputs and rebuilds block inputs in backward
(:mod:`lowmem_jax.reversible`; "pareprop" overlaps the rebuild with the gradient work,
"pareprop-stream" also annotates the rebuild to run on a second GPU stream).
It needs a reversible architecture (``revvit-*``, ``revllama-*``); blocks keep nothing,
so quantizing, sampling or rematting their activations would change nothing. Presets
``reversible`` and ``pareprop``.
"""

from __future__ import annotations

from lowmem_jax.methods import Field, Method

REVERSIBLES = ("none", "vanilla", "pareprop", "pareprop-stream")


# Fields that act on what blocks keep: a reversible stack's blocks keep nothing.
BLOCK_FIELDS = ("quant", "sampled_linear", "remat", "qkv")


def _set_block_fields(policy) -> list[str]:
  return [f for f in BLOCK_FIELDS if getattr(policy, f) != policy.default(f)]


def _check(policy):
  if policy.reversible != "none" and _set_block_fields(policy):
    field = _set_block_fields(policy)[0]
    raise ValueError(
        f"MemoryPolicy: reversible={policy.reversible!r} keeps no block activations, "
        f"so {field}={getattr(policy, field)!r} would change nothing; drop one of them")


def _check_model(policy, model: str, reversible: bool):
  if policy.reversible != "none" and not reversible:
    raise ValueError(f"{model}: policy {policy.spec!r} needs a reversible architecture "
                     "(revvit-*, revllama-* models); standard blocks cannot be inverted")
  if reversible and _set_block_fields(policy):
    raise ValueError(f"{model}: policy {policy.spec!r} is not supported; its blocks take "
                     "norm/activation/attention choices and reversible=vanilla|pareprop")


METHOD = Method(
    name="reversible",
    fields=(Field("reversible", "none", "none | vanilla | pareprop | pareprop-stream "
                  "(reversible models rebuild block inputs in backward)",
                  choices=REVERSIBLES),),
    presets={"reversible": {"reversible": "vanilla"}, "pareprop": {"reversible": "pareprop"}},
    check=_check,
    check_model=_check_model,
)
