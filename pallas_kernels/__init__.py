"""Pallas kernels for the hot ops (2-bit pack/unpack, fused activations, fused MS norms).

Imports nothing of ours. The kernels arrive with the Pallas issue; until then every op
runs through its plain-jnp version in :mod:`lowmem_jax`.
"""
