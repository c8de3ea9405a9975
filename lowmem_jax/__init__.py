"""lowmem-jax: memory-saving backpropagation for Transformers in JAX.

Ops are functions of arrays (no Flax here): ``regelu2``/``resilu2`` save a 2-bit code,
``ms_layer_norm``/``ms_rms_norm`` share their output with the next linear,
``lowmem_jax.attention.attention`` saves no N x N array, :mod:`lowmem_jax.quant` (Mesa)
saves uint8 codes, :mod:`lowmem_jax.sampling` (WTA-CRS) saves a sample of token rows,
:mod:`lowmem_jax.reversible` saves only a stack's outputs. :class:`MemoryPolicy` picks
them for a whole model.
"""

from lowmem_jax.activations import (REGELU2, RESILU2, StepDerivative, gelu, regelu2,
                                    regelu2_derivative, resilu2, resilu2_derivative, silu)
from lowmem_jax.norms import (layer_norm, merge_norm_affine, ms_layer_norm, ms_rms_norm,
                              rms_norm)
from lowmem_jax.packing import pack_2bit, packed_size, unpack_2bit
from lowmem_jax.policy import PRESETS, MemoryPolicy

__all__ = [
    "MemoryPolicy", "PRESETS", "REGELU2", "RESILU2", "StepDerivative", "gelu",
    "layer_norm", "merge_norm_affine", "ms_layer_norm", "ms_rms_norm", "pack_2bit",
    "packed_size", "regelu2", "regelu2_derivative", "resilu2", "resilu2_derivative",
    "rms_norm", "silu", "unpack_2bit",
]
__version__ = "0.1.0"
