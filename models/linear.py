"""The blocks' linear layers: ``nnx.Linear`` / ``nnx.LinearGeneral`` plus the policy's
say in what their backward keeps.

Same parameters (``kernel``, ``bias``) and function as the Flax layers, so checkpoints,
LoRA and sharding see no difference. The layer computes its dense function through its
strategy (``policy.linear_strategy(name)``, held in ``self.saving``): the baseline
keeps the input, or what a carried input carries (Mesa: its code); WTA-CRS keeps a
sample of the token rows for the weight gradient.
"""

from __future__ import annotations


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


class _PolicyDense:
  """What our Linear and LinearGeneral add to Flax's: the policy's strategy."""

  def _setup_policy(self, policy, name):
    self.policy = MemoryPolicy.parse(policy)
    self.role = name
    self.frozen = False
    self.saving = Site(self.policy.linear_strategy(name))

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
    bias = None if self.bias is None else self.bias[...]
    dense = Dense(contract, jnp.dtype(dtype), self.preferred_element_type)
    y = self.saving(dense, x, self.kernel[...], bias, contract=contract)
    pref = self.preferred_element_type
    return y if pref is None else y.astype(pref)


class Linear(nnx.Linear, _PolicyDense):
  """``nnx.Linear`` that follows the memory policy; ``name`` is its role ("fc1", ...)."""

  def __init__(self, in_features: int, out_features: int, *,
               policy: MemoryPolicy | str = "baseline", name: str | None = None, **kwargs):
    super().__init__(in_features, out_features, **kwargs)
    self._setup_policy(policy, name)

  def __call__(self, x):
    return self._policy_call(x, 1)


class LinearGeneral(nnx.LinearGeneral, _PolicyDense):
  """``nnx.LinearGeneral`` (contracting the trailing ``len(axis)`` axes) that follows
  the memory policy."""

  def __init__(self, in_features, out_features, *, policy: MemoryPolicy | str = "baseline",
               name: str | None = None, **kwargs):
    super().__init__(in_features, out_features, **kwargs)
    self._setup_policy(policy, name)

  def __call__(self, x):
    axis = self.axis if isinstance(self.axis, tuple) else (self.axis,)
    return self._policy_call(x, len(axis))
