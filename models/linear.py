"""The blocks' linear layers: ``nnx.Linear`` / ``nnx.LinearGeneral`` plus the policy's
say in what their backward keeps.

Same parameters (``kernel``, ``bias``) and function as the Flax layers, so checkpoints,
LoRA and sharding see no difference. The layer computes its dense function through its
strategy (``policy.linear_strategy(name)``, held in ``self.saving``): the baseline
keeps the input, or what a carried input carries (Mesa: its code); WTA-CRS keeps a
sample of the token rows for the weight gradient.

A linear that reads a norm's output (``reads_norm``) under MS norms has that norm's
affine merged into its kernel (and bias) at load, and keeps the affine beside it as
:class:`NormAffine` (identity until a checkpoint fills it). What trains behind the merged
norm reads the norm's real output through it: LoRA's adapter (:mod:`models.lora`), and
the linear itself once :meth:`_PolicyDense.unmerge_norm_affine` has put its kernel back
in the unmerged form (a head trained in full beside the adapters).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from flax import nnx

from lowmem_jax import quantized_weight
from lowmem_jax.dense import Dense
from lowmem_jax.policy import MemoryPolicy
from models.sites import Site, as_array


class FrozenKernel(nnx.Variable):
  """A frozen kernel stored as a :class:`~lowmem_jax.quantized_weight.QuantizedKernel`
  (bf16 / int8 / nf4): not a parameter (no gradient, no optimizer state), never written
  by a forward pass."""


class NormAffine(nnx.Variable):
  """The affine of the norm a linear reads (scale; shift where the linear has a bias),
  merged into that linear's kernel under MS norms: fixed (neither trained nor written by a
  forward pass), shaped like the linear's input features."""


def fold_norm_affine(kernel, scale, shift, n_in: int, n_out: int):
  """``(kernel * scale, shift . kernel)``: the kernel ``[lead..., in..., out...]`` and the
  bias term that make ``x_hat @ k' + b'`` equal ``(scale * x_hat + shift) @ kernel``
  (``scale``/``shift``: ``[lead..., in...]``; the bias term None without a shift).
  Elementwise products and sums: exact fp32, whatever the matmul precision. Its own
  backward saves nothing the size of the kernel (``jax.checkpoint``); a matmul that reads
  the folded kernel keeps it as it keeps any weight."""
  ones = (1,) * n_out

  @jax.checkpoint
  def fold(kernel, scale, shift):
    folded = kernel * scale.reshape(scale.shape + ones).astype(kernel.dtype)
    if shift is None:
      return folded, None
    axes = tuple(range(kernel.ndim - n_in - n_out, kernel.ndim - n_out))
    return folded, jnp.sum(shift.reshape(shift.shape + ones).astype(kernel.dtype) * kernel,
                           axis=axes)
  return fold(kernel, scale, shift)


def read_through_norm_affine(x, kernel, bias, affine, n_in: int, n_out: int):
  """``(x', kernel', bias')`` with ``x' @ kernel' + bias'`` equal to ``(g * x + s) @ kernel
  + bias`` for ``affine = (g, s or None)`` (None: all as given). The affine is folded into
  the smaller of the input and the kernel, since backward keeps what the matmul reads: an
  adapter's ``g A`` (``d x r``) beside its input ``x_hat``, the norm's output the base
  shares; a pooled head's ``g * x + s`` (``B x d``) rather than its whole kernel."""
  if affine is None:
    return x, kernel, bias
  value = as_array(x)
  if value.size < kernel.size:
    scale, shift = affine
    read = value * scale
    return (read if shift is None else read + shift).astype(value.dtype), kernel, bias
  folded, shifted = fold_norm_affine(kernel, *affine, n_in, n_out)
  return x, folded, bias if shifted is None else (shifted if bias is None else bias + shifted)


class _PolicyDense:
  """What our Linear and LinearGeneral add to Flax's: the policy's strategy."""

  def _setup_policy(self, policy, name, reads_norm: bool, in_shape: tuple[int, ...]):
    self.policy = MemoryPolicy.parse(policy)
    self.role = name
    self.frozen = False
    self.saving = Site(self.policy.linear_strategy(name))
    # the merged norm's affine (MS norms), and whether the kernel is held unmerged
    merged = reads_norm and self.policy.merges_norm_affine
    self.norm_scale = NormAffine(jnp.ones(in_shape, jnp.float32)) if merged else None
    self.norm_shift = (NormAffine(jnp.zeros(in_shape, jnp.float32))
                       if merged and self.bias is not None else None)
    self.affine_at_call = False

  def norm_affine(self):
    """``(scale, shift or None)`` of the merged norm this linear reads, or None (no norm
    merged into it)."""
    if self.norm_scale is None:
      return None
    return self.norm_scale[...], None if self.norm_shift is None else self.norm_shift[...]

  def unmerge_norm_affine(self) -> None:
    """Holds the kernel and bias unmerged (``W = W' / scale``, ``b = b' - shift . W``) and
    folds the norm's affine in at each call, so that a linear that trains behind a merged
    norm trains the parameters a model with the norm's affine trains (peft's). A scale of
    0 leaves that input row 0 (it reaches the output through the shift alone, as in the
    unmerged model). Each call folds the affine into the smaller of the input and the
    kernel (:func:`read_through_norm_affine`)."""
    if self.norm_scale is None or self.affine_at_call:
      return
    n_in, n_out = self.kernel_axes()
    scale, shift = self.norm_affine()
    inverse = jnp.where(scale == 0, 0.0, 1 / jnp.where(scale == 0, 1.0, scale))
    kernel = fold_norm_affine(self.kernel[...], inverse, None, n_in, n_out)[0]
    self.kernel.set_value(kernel)
    if shift is not None:
      self.bias.set_value(self.bias[...] - fold_norm_affine(kernel, scale, shift, n_in,
                                                             n_out)[1])
    self.affine_at_call = True

  def merge_norm_affine(self) -> None:
    """Undoes :meth:`unmerge_norm_affine`: the kernel and bias merged again (for export)."""
    if not self.affine_at_call:
      return
    n_in, n_out = self.kernel_axes()
    kernel, shifted = fold_norm_affine(self.kernel[...], *self.norm_affine(), n_in, n_out)
    self.kernel.set_value(kernel)
    if shifted is not None:
      self.bias.set_value(self.bias[...] + shifted)
    self.affine_at_call = False

  def freeze_kernel(self) -> None:
    """Marks the kernel as not trained (LoRA's base): the policy's strategy for a frozen
    linear (no WTA-CRS sample: there is no weight gradient to estimate)."""
    self.frozen = True
    self.saving = Site(self.policy.linear_strategy(self.role, frozen=True))

  @property
  def keeps_input(self) -> bool:
    """Whether backward keeps (a form of) the input: for the weight gradient, so only
    while the kernel trains (not frozen, not stored as a :class:`FrozenKernel`); a
    frozen linear's backward needs its kernel alone."""
    return not (self.frozen or isinstance(self.kernel, FrozenKernel))

  def store_kernel(self, format: str) -> None:
    """Stores the (frozen) kernel in ``format`` (``lowmem_jax.quantized_weight.FORMATS``),
    once, as a :class:`FrozenKernel`; the layer then uses the frozen strategy
    (:meth:`freeze_kernel`). ``float32`` leaves it as it is, frozen; a kernel stored in
    ``format`` already (a streamed load) is only frozen."""
    if format == "float32":
      self.freeze_kernel()
      return
    kernel = self.kernel[...]
    if isinstance(kernel, quantized_weight.QuantizedKernel):
      if kernel.storage != format:
        raise ValueError(f"store_kernel: {self.role or 'this linear'}'s kernel is stored as "
                         f"{kernel.storage} already, not {format}")
      self.freeze_kernel()
      return
    n_in, n_out = self.kernel_axes()
    self.kernel = FrozenKernel(quantized_weight.quantize(kernel, format, n_in=n_in,
                                                         n_out=n_out))
    self.freeze_kernel()

  def kernel_axes(self) -> tuple[int, int]:
    """``(input axes, output axes)`` of one layer's kernel."""
    out = self.out_features
    axis = getattr(self, "axis", (-1,))
    return (len(axis) if isinstance(axis, tuple) else 1,
            len(out) if isinstance(out, tuple) else 1)

  def _policy_call(self, x, contract: int):
    dtype = self.dtype or jnp.result_type(as_array(x), self.kernel[...].dtype)
    kernel, bias = self.kernel[...], None if self.bias is None else self.bias[...]
    if self.affine_at_call:
      x, kernel, bias = read_through_norm_affine(x, kernel, bias, self.norm_affine(),
                                                 contract, len(kernel.shape) - contract)
    dense = Dense(contract, jnp.dtype(dtype), self.preferred_element_type)
    y = self.saving(dense, x, kernel, bias, contract=contract)
    pref = self.preferred_element_type
    return y if pref is None else y.astype(pref)


class Linear(nnx.Linear, _PolicyDense):
  """``nnx.Linear`` that follows the memory policy; ``name`` is its role ("fc1", ...);
  ``reads_norm``: its input is a norm's output (the norm's affine merged into it under
  MS norms)."""

  def __init__(self, in_features: int, out_features: int, *,
               policy: MemoryPolicy | str = "baseline", name: str | None = None,
               reads_norm: bool = False, **kwargs):
    super().__init__(in_features, out_features, **kwargs)
    self._setup_policy(policy, name, reads_norm, (in_features,))

  def __call__(self, x):
    return self._policy_call(x, 1)


class LinearGeneral(nnx.LinearGeneral, _PolicyDense):
  """``nnx.LinearGeneral`` (contracting the trailing ``len(axis)`` axes) that follows
  the memory policy."""

  def __init__(self, in_features, out_features, *, policy: MemoryPolicy | str = "baseline",
               name: str | None = None, reads_norm: bool = False, **kwargs):
    super().__init__(in_features, out_features, **kwargs)
    in_shape = tuple(in_features) if isinstance(in_features, tuple) else (in_features,)
    self._setup_policy(policy, name, reads_norm, in_shape)

  def __call__(self, x):
    axis = self.axis if isinstance(self.axis, tuple) else (self.axis,)
    return self._policy_call(x, len(axis))
