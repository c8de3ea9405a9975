"""Guards the compiled memory of full training steps measured for the closing figures
(CPU, jax 0.10.2; docs/step_memory_*_cpu.json): lowmembp vs baseline."""

import pytest

from models import step_memory


@pytest.mark.slow
@pytest.mark.parametrize("model,overrides,batch,seq,temp_ratio,residual_ratio", [
    # measured: temp 12793.8 -> 9246.4 MiB (0.723), saved 6841.7 -> 2518.4 MiB (0.368)
    ("vit-b16", {}, 64, 0, 0.74, 0.38),
    # measured: temp 2800.3 -> 2629.3 MiB (0.939), saved 2316.9 -> 1749.6 MiB (0.755)
    ("llama-7b", {"num_layers": 2}, 4, 512, 0.95, 0.77),
], ids=["vit-b16", "llama-7b-2l"])
def test_lowmembp_step_memory_vs_baseline(model, overrides, batch, seq, temp_ratio,
                                          residual_ratio):
  import jax.numpy as jnp
  rows = step_memory.measure(model, ["baseline", "lowmembp"], batch, seq, jnp.bfloat16,
                             overrides)
  base, low = rows
  assert low["compiled"]["temp"] < temp_ratio * base["compiled"]["temp"], rows
  assert low["saved_residual_bytes"] < residual_ratio * base["saved_residual_bytes"], rows


def test_unknown_model_and_bad_override():
  with pytest.raises(ValueError, match="unknown model"):
    step_memory.build("gpt-2", "baseline", None, {})
  with pytest.raises(ValueError, match="key=value"):
    step_memory._overrides(["num_layers"])
