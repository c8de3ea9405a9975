"""Guards the compiled memory of full training steps measured for the closing figures
(CPU, jax 0.10.2; docs/step_memory_*_cpu.json): lowmembp vs baseline."""

import pytest

from models import step_memory


# Per compiler: (compiled temp ratio, saved-residual ratio) lowmembp / baseline that a
# backend must beat. CPU (jax 0.10.2): vit-b16 temp 12793.8 -> 9246.4 MiB (0.723), saved
# 6841.7 -> 2518.4 MiB (0.368); llama-7b 2 layers temp 2800.3 -> 2629.3 MiB (0.939), saved
# 2316.9 -> 1749.6 MiB (0.755). GPU: temp not yet measured for these steps; on an H100 the
# ViT-B/16 full step peaked at 7957 / 10515 MiB (0.757) and LLaMA-width LoRA steps had
# equal temp, so lowmembp must not cost more there. Saved residuals are jaxpr-level (the
# same on every backend once the attention path is fixed: flash here).
RATIOS = {
    "cpu": {"vit-b16": (0.74, 0.38), "llama-7b-2l": (0.95, 0.77)},
    "gpu": {"vit-b16": (1.0, 0.38), "llama-7b-2l": (1.0, 0.77)},
}


@pytest.mark.slow
@pytest.mark.precision("default")
@pytest.mark.parametrize("model,overrides,batch,seq", [
    ("vit-b16", {}, 64, 0), ("llama-7b", {"num_layers": 2}, 4, 512),
], ids=["vit-b16", "llama-7b-2l"])
def test_lowmembp_step_memory_vs_baseline(request, model, overrides, batch, seq):
  import jax
  import jax.numpy as jnp
  backend = jax.default_backend()
  if backend not in RATIOS:
    pytest.skip(f"no compiled-memory figure for the {backend} compiler")
  temp_ratio, residual_ratio = RATIOS[backend][request.node.callspec.id]
  rows = step_memory.measure(model, ["baseline+attention=flash", "lowmembp+attention=flash"],
                             batch, seq, jnp.bfloat16, overrides)
  base, low = rows
  if temp_ratio < 1.0:
    assert low["compiled"]["temp"] < temp_ratio * base["compiled"]["temp"], (backend, rows)
  else:
    assert low["compiled"]["temp"] <= base["compiled"]["temp"], (backend, rows)
  assert low["saved_residual_bytes"] < residual_ratio * base["saved_residual_bytes"], rows


def test_unknown_model_and_bad_override():
  with pytest.raises(ValueError, match="unknown model"):
    step_memory.build("gpt-2", "baseline", None, {})
  with pytest.raises(ValueError, match="key=value"):
    step_memory._overrides(["num_layers"])
