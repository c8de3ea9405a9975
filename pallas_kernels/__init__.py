"""Pallas kernels for the hot ops: 2-bit pack/unpack, fused ReGELU2/ReSiLU2 forward and
backward, fused MS-LayerNorm/MS-RMSNorm forward and backward, Mesa's per-group uint8
quantize/dequantize with hash-based stochastic rounding.

Triton-style ``pallas_call`` with explicit masked loads and stores (jax 0.10 and 0.11);
every kernel also runs with ``interpret=True``, which is how CPU tests check it against
its jnp reference in :mod:`lowmem_jax`. Imports nothing of ours: method constants
(thresholds, derivative levels) come in as static arguments.
"""
