"""Pallas kernels for the hot ops: 2-bit pack/unpack, fused ReGELU2/ReSiLU2 forward and
backward, fused MS-LayerNorm/MS-RMSNorm forward and backward, Mesa's per-group uint8
quantize/dequantize with hash-based stochastic rounding.

``pallas_kernels/<op>.py`` mirrors ``lowmem_jax/<op>.py``: a kernel has its jnp
reference's name (less a ``_reference`` suffix) and positional arguments, plus
keyword-only settings (``interpret``, block sizes), and says which reference it matches.
Kernels import their method's constants and shared math (thresholds, derivative levels,
the noise hash, the quantization step) from the reference side; the references import a
kernel module only when dispatching to it (:mod:`lowmem_jax.dispatch`), so
``import lowmem_jax`` loads no Pallas.

Triton-style ``pallas_call`` with explicit masked loads and stores (jax 0.10 and 0.11);
every kernel also runs with ``interpret=True``, which is how CPU tests check it against
its reference.
"""
