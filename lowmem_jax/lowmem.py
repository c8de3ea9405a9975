"""The combined preset ``lowmem``: LowMemoryBP with Mesa 8-bit codes (``lowmembp+mesa8``).

Chosen by measurement among the combinations that recompute no matmul (remat does, and
pays for it in speed): what each keeps of ViT-B/16 LoRA (query, value; rank 8), batch 64,
bf16, compiled train-step temp on CPU (a proxy: XLA:CPU stacks bf16 residuals as fp32)::

    python -m train.bench --compile-only --synthetic 64 --set model=vit-b16 \
      --set batch_size=64 --set trainable=lora --set lora_targets=query,value \
      --policies baseline,lowmembp,mesa8,lowmem,remat,remat:dots_saveable,\
      remat:save=qkv_proj,attn_out,offload

=================================  ========  ==========
policy                             temp MiB  / baseline
=================================  ========  ==========
baseline (lean exact)              6100.9    1.000
lowmembp                           3268.7    0.536
mesa8                              2695.8    0.442
lowmem                             1300.4    0.213
remat (full)                       1678.3    0.275
remat:dots_saveable                8070.3    1.323
remat:save=qkv_proj,attn_out       3451.3    0.566
offload (CPU: host is the device)  6285.5    1.030
=================================  ========  ==========

JSON: ``docs/lowmem_candidates_vitb_lora_cpu.json``.

What a block keeps under it: the 2-bit ReGELU2/ReSiLU2 codes of its activations, the MS
norms' outputs as 8-bit codes shared with the linears that read them, head-wise 8-bit
codes of q, k and v for attention (the probabilities are recomputed from them), and the
linears' inputs as 8-bit codes; frozen linears keep nothing. Gated activations stay
exact on their (coded) inputs. ``lowmem+qkv=recompute`` (:mod:`lowmem_jax.qkv_recompute`)
keeps no codes of q, k and v either: backward recomputes them from the norm output's
code, three matmuls per block. Compiled for an H100 (ViT-B/16 LoRA batch 64,
``docs/h100_compiled.md``) it is under timm+peft with checkpointing's 1279 MiB without remat
(1205 MiB in all against ``lowmem``'s 1575), as is ``lowmembp+qkv=recompute+
attention_block=64`` (1272). Measured on an H200 (``docs/gpu/README.md``, 2026-11-27):
1037 MiB at 0.98x timm+peft's speed (timm+peft with checkpointing: 1291 MiB at 0.50x),
``lowmem`` 1513 MiB at 0.99x: the recompute costs 1.2% of the step there. It stays a
field, not part of ``lowmem``: at LLaMA-7B widths (compiled for an H100) it keeps 70 MiB
less of 5.6 GiB at 4 layers, and at 2 layers 19 MiB less with a bf16 base, 30 more with
an fp32 one (``docs/h100_compiled.md``); its three matmuls are untimed there, and
a preset of its own would rename ``lowmem+qkv=recompute`` (the canonical spec) in every
report and table.
"""

from __future__ import annotations

from lowmem_jax.methods import Method

METHOD = Method(
    name="lowmem",
    presets={"lowmem": {"activation": "approx2", "norm": "ms", "quant": "mesa",
                        "quant_bits": 8}},
)
