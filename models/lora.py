"""LoRA adapters for any of our models: frozen base linears, trainable low-rank updates.

``apply_lora(model, rank=8, alpha=16, targets=("query", "value"))`` replaces, in place,
each of our linears (:mod:`models.linear`) whose attribute name is in ``targets`` by a
:class:`LoRALinear`: ``y = base(x) + (alpha / rank) * (x @ A) @ B`` with ``B = 0`` at
start, so the function is unchanged. Adapter weights are :class:`LoRAParam`, the
trainable set (``nnx.Optimizer(model, tx, wrt=LoRAParam)``, ``trainable_filter()``),
with the linears trained in full beside them (``modules_to_save``: by default the
classification head, which a fresh head needs).
The adapter's ``x @ A`` is the trained linear now: it takes over the base's linear site
(the policy's strategy for a trained linear of that name, and its state), and the base is
frozen (``freeze_kernel``: the policy's strategy for a frozen linear, whose backward needs
no ``x``: ``dx = g W^T``). So what backward keeps of ``x`` is what the policy keeps for a
trained linear: ``x`` itself (under MS norms, the shared norm output) under the baseline;
under WTA-CRS (``sample_targets`` naming the linear) only ``k`` sampled rows of ``x``,
their indices and scales, from which ``dA`` is estimated with ``A``'s output cotangent
``scale * g B^T`` (:mod:`lowmem_jax.sampling`). ``dx`` and ``dB`` are exact (``dB``
from the rank-sized ``x @ A``, kept). Every other linear is marked frozen too
(``freeze_rest``, as peft freezes the base model).
Under MS norms a base linear that reads a norm has the norm's affine ``(g, s)`` merged
into its kernel and reads the bare ``x_hat``; its adapter reads the norm's real output
``g * x_hat + s``, as peft's does, computed as ``x_hat @ (g A) + s A``: the same function,
parameters and gradients as under a policy that keeps the affine. Backward keeps of the
input the ``x_hat`` the base shares, and ``g A`` (``d x r``) per adapter
(:func:`models.linear.read_through_norm_affine`). A linear trained in full behind such a
norm (ViT's head) is held unmerged (``unmerge_norm_affine``) and folds the affine in at
each call.
``merge_lora`` folds adapters into the base kernels (for export), ``unmerge_lora`` undoes it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from lowmem_jax.dense import Dense
from models.linear import (FrozenKernel, Linear, LinearGeneral, fold_norm_affine,
                           read_through_norm_affine)
from models.sites import as_array


class LoRAParam(nnx.Param):
  """A weight that trains under LoRA fine-tuning: an adapter's, or one of a module
  trained in full beside them (``apply_lora(modules_to_save=...)``)."""


def trainable_filter():
  """The NNX filter of LoRA's trainable parameters."""
  return LoRAParam


class LoRALinear(nnx.Module):

  def __init__(self, base, *, rank: int, alpha: float, rngs: nnx.Rngs):
    _check_rank_alpha(rank, alpha)
    kernel_shape = tuple(base.kernel[...].shape)
    axis = getattr(base, "axis", (-1,))
    self.n_in = len(axis) if isinstance(axis, tuple) else 1
    # Leading axes of a stacked base (the layer axis of models.stack): A and B get them too.
    out = base.out_features
    self.lead = len(kernel_shape) - self.n_in - (len(out) if isinstance(out, tuple) else 1)
    # A reads x as the trained linear: the base's site (strategy, sampler state) serves it
    self.read_x = base.saving
    base.freeze_kernel()
    self.base = base
    self.scale = float(alpha) / rank
    self.merged = False
    lead, rest = kernel_shape[:self.lead], kernel_shape[self.lead:]
    in_shape, out_shape = rest[:self.n_in], rest[self.n_in:]
    fan_in = math.prod(in_shape)
    self.lora_a = LoRAParam(jax.random.normal(rngs.params(), lead + in_shape + (rank,),
                                              jnp.float32) / fan_in ** 0.5)
    self.lora_b = LoRAParam(jnp.zeros(lead + (rank,) + out_shape, jnp.float32))

  def adapter_input(self):
    """``(A', bias)`` of the adapter's first product in the space of the base's kernel:
    ``(A, None)``, or under a merged norm ``(g A, s A)`` (:mod:`models.lora`); ``(A,
    None)`` again for a base held unmerged (a target that also trains in full, which
    folds the affine in at each call itself)."""
    a = self.lora_a[...]
    affine = self.base.norm_affine()
    if affine is None or self.base.affine_at_call:
      return a, None
    return fold_norm_affine(a, *affine, self.n_in, 1)

  def _times_b(self, left):
    """``scale * left @ B`` per layer (``left``: ``[lead..., m, rank]``), ``[lead..., m,
    out]`` with the output axes flattened."""
    b = self.lora_b[...]
    return self.scale * (left @ b.reshape(b.shape[:self.lead + 1] + (-1,)))

  def delta(self):
    """``scale * A' @ B`` shaped like the base kernel (fp32; per layer when stacked)."""
    a = self.adapter_input()[0]
    return self._times_b(a.reshape(a.shape[:self.lead] + (-1, a.shape[-1]))).reshape(
        self.base.kernel[...].shape)

  def checkpoint_delta(self, layer: int | None = None) -> np.ndarray:
    """``scale * A @ B`` on the host as ``[d_in, d_out]`` float32 (of row ``layer`` when
    stacked): the update to the kernel in the checkpoint's parametrization, where the norm
    before the linear keeps its affine (the adapter reads that norm's output, so ``A`` is
    the same there). One layer at a time, for a streamed export."""
    if self.lead != (layer is not None):
      raise ValueError(f"checkpoint_delta: the adapter has {self.lead} layer axes; "
                       f"layer={layer}")
    a, b = self.lora_a[...], self.lora_b[...]
    a, b = (a, b) if layer is None else (a[layer], b[layer])
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return self.scale * (a.reshape(-1, a.shape[-1]) @ b.reshape(b.shape[0], -1))

  def bias_delta(self):
    """``scale * (s A) @ B`` shaped like the base bias, or None (no merged norm shift)."""
    bias = self.adapter_input()[1]
    if bias is None:
      return None
    return self._times_b(bias[..., None, :]).reshape(self.base.bias[...].shape)

  @property
  def keeps_input(self) -> bool:
    """Whether backward keeps (a form of) the input: ``A``'s gradient reads it, unless the
    adapter is merged into the (frozen) base."""
    return not self.merged or self.base.keeps_input

  def __call__(self, x):
    y = self.base(x)
    if self.merged:
      return y
    # x @ A keeps what the policy keeps for a trained linear (of the base's name) reading x
    dense = Dense(self.n_in, as_array(x).dtype)
    x, weight, bias = read_through_norm_affine(x, self.lora_a[...], None,
                                               self.base.norm_affine(), self.n_in, 1)
    a = checkpoint_name(self.read_x(dense, x, weight, bias, contract=self.n_in), "lora_a")
    return y + (self.scale * jnp.tensordot(a, self.lora_b[...].astype(a.dtype), axes=1)
                ).astype(y.dtype)


def _check_rank_alpha(rank, alpha) -> None:
  """A positive int rank and a positive finite alpha (the adapter's scale is alpha / rank:
  at 0 the adapters change nothing, negative flips their sign), else a ValueError."""
  if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or rank < 1:
    raise ValueError(f"LoRA rank must be a positive int, got {rank!r}")
  if (isinstance(alpha, bool) or not isinstance(alpha, numbers.Real)
      or not math.isfinite(alpha) or alpha <= 0):
    raise ValueError(f"LoRA alpha must be a positive number (the adapter's scale is "
                     f"alpha / rank), got {alpha!r}")


def _targets(model, targets: Sequence[str]):
  for path, node in nnx.iter_graph(model):
    if path and path[-1] in targets and isinstance(node, (Linear, LinearGeneral)):
      yield path, node


def _parent(model, path):
  node = model
  for part in path[:-1]:
    node = node[part] if isinstance(part, int) else getattr(node, part)
  return node


def apply_lora(model, *, rank: int = 8, alpha: float = 16.0,
               targets: Sequence[str] = ("query", "value"), seed: int = 0,
               freeze_rest: bool = True, modules_to_save: Sequence[str] | None = None):
  """Wraps the target linears in LoRA adapters, in place; returns the model.

  ``modules_to_save`` (peft's name): linears of the model (attribute names) that train in
  full beside the adapters, their parameters made :class:`LoRAParam`. None: the model's
  classification head (:func:`classifier_head`: ViT's ``head``, BERT's
  ``classifier``, RoBERTa's ``pooler`` and ``classifier``, as peft's SEQ_CLS task saves
  ``classifier``); a fresh head that did not train would stay random. LLaMA's LM head
  does not train (peft's CAUSAL_LM). ``()``: the adapters alone.
  ``freeze_rest``: marks every other linear frozen too (``freeze_kernel``), as peft
  freezes the base model: under LoRA only the adapters (and the saved modules) train, so
  no strategy keeps anything for those linears' weight gradients (none samples them, and
  the MLP does not recompute for a frozen last linear, ``hidden=recompute``). Their
  gradients stay exact if taken anyway. False leaves them as they are (some of them to
  train in full).
  ``targets``: attribute names, or one comma-separated string (``"query,value"``)."""
  if isinstance(targets, str):
    targets = [t.strip() for t in targets.split(",") if t.strip()]
  _check_rank_alpha(rank, alpha)
  saved = _modules_to_save(model, modules_to_save)
  adapted = sorted({p[-1] for p, n in nnx.iter_graph(model) if isinstance(n, LoRALinear)})
  if adapted:
    raise ValueError(f"apply_lora: the model has LoRA adapters already (on "
                     f"{', '.join(map(str, adapted))}); strip_lora(model) merges them first")
  found = list(_targets(model, tuple(targets)))
  missing = [t for t in targets if t not in {p[-1] for p, _ in found}]
  if missing or not found:  # a misspelt target would leave its linears without adapters
    names = sorted({p[-1] for p, n in nnx.iter_graph(model)
                    if p and isinstance(n, (Linear, LinearGeneral))})
    raise ValueError(f"apply_lora: no linear named {missing or list(targets)}; this model "
                     f"has {', '.join(map(str, names))}")
  from models.reversible_stack import ReversibleStack
  if any(isinstance(n, ReversibleStack) for _, n in nnx.iter_graph(model)):
    raise ValueError("apply_lora: reversible models (revvit-*, revllama-*) keep their "
                     "blocks' weights stacked on a layer axis; LoRA is not supported there")
  rngs = nnx.Rngs(seed)
  for path, node in found:
    setattr(_parent(model, path), path[-1], LoRALinear(node, rank=rank, alpha=alpha, rngs=rngs))
  for node in saved:  # trained in full: LoRA's trainable set, behind a norm as peft's
    node.unmerge_norm_affine()
    node.kernel = LoRAParam(node.kernel[...])
    if node.bias is not None:
      node.bias = LoRAParam(node.bias[...])
  if freeze_rest:
    for _, node in list(nnx.iter_graph(model)):
      if (isinstance(node, (Linear, LinearGeneral)) and not node.frozen
          and not any(node is n for n in saved)):
        node.freeze_kernel()
  return model


def classifier_head(model) -> tuple[str, ...]:
  """The names of ``model``'s classification-head linears (its family module's
  ``classifier_head(cfg)``; none for a model without one, as LLaMA with its LM head, or
  a module that is not one of our model families)."""
  from models import registry
  try:
    family = registry.family_of(model)
  except ValueError:  # a module of the user's own: no head we know of
    return ()
  return family.classifier_head(model.cfg)


def _modules_to_save(model, names: Sequence[str] | None) -> list:
  """The model's top-level linears ``names`` (None: its classification head), or a
  ValueError naming those it has."""
  if names is None:
    names = classifier_head(model)
  if isinstance(names, str):
    names = [n.strip() for n in names.split(",") if n.strip()]
  linears = {name: getattr(model, name) for name in vars(model)
             if isinstance(getattr(model, name), (Linear, LinearGeneral))}
  unknown = [n for n in names if n not in linears]
  if unknown:
    raise ValueError(f"apply_lora: modules_to_save names {unknown}, not linears of the model "
                     f"({', '.join(linears)})")
  stored = [n for n in names if isinstance(linears[n].kernel, FrozenKernel)]
  if stored:
    raise ValueError(f"apply_lora: modules_to_save {stored} are stored in a base dtype "
                     "(frozen); a module that trains needs its fp32 weights")
  return [linears[n] for n in names]


def _adapters(model):
  return [n for _, n in nnx.iter_graph(model) if isinstance(n, LoRALinear)]


def _check_mergeable(lora):
  if not isinstance(lora.base.kernel[...], jax.Array):
    raise ValueError(f"merge_lora: the base kernel of {lora.base.role or 'a linear'} is "
                     f"stored as {lora.base.kernel[...].format} (base_dtype); merging needs "
                     "an fp32 base: load the model with base_dtype=float32 to merge or export")


def merge_lora(model):
  """Folds every adapter into its base kernel (``W += scale * A @ B``), in place."""
  for lora in _adapters(model):
    if not lora.merged:
      _check_mergeable(lora)
      lora.base.kernel.set_value(lora.base.kernel[...] + lora.delta())
      if (bias := lora.bias_delta()) is not None:
        lora.base.bias.set_value(lora.base.bias[...] + bias)
      lora.merged = True
  return model


def unmerge_lora(model):
  """Undoes :func:`merge_lora` (``W -= scale * A @ B``), in place."""
  for lora in _adapters(model):
    if lora.merged:
      lora.base.kernel.set_value(lora.base.kernel[...] - lora.delta())
      if (bias := lora.bias_delta()) is not None:
        lora.base.bias.set_value(lora.base.bias[...] - bias)
      lora.merged = False
  return model


def strip_lora(model):
  """Merges the adapters and puts the plain base linears back, with the norms merged into
  every linear trained in full behind one (for HF export), in place."""
  merge_lora(model)
  for _, node in list(nnx.iter_graph(model)):
    if isinstance(node, (Linear, LinearGeneral)):
      node.merge_norm_affine()
  for path, node in list(nnx.iter_graph(model)):
    if isinstance(node, LoRALinear):
      setattr(_parent(model, path), path[-1], node.base)
  return model
