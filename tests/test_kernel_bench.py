"""The kernel benchmark runs end to end (interpret mode: a smoke test, not a timing)."""

import pytest

from lowmem_jax import kernel_bench


@pytest.mark.slow
def test_kernel_bench_smoke(tmp_path, capsys):
  out = tmp_path / "bench.json"
  result = kernel_bench.main(["--interpret", "--json", str(out)])
  assert out.exists()
  names = [r["kernel"] for r in result["kernels"]["rows"]]
  assert names == ["pack_2bit", "unpack_2bit", "regelu2_forward", "approx2_backward",
                   "ms_layer_norm_forward", "ms_layer_norm_backward"]
  for row in result["kernels"]["rows"]:  # Pallas (interpreted) agrees with the jnp path
    assert row["max_abs_err_vs_xla"] < 1e-2, row
  assert [r["policy"] for r in result["block_step"]][0] == "baseline"
  assert "speed vs baseline" in capsys.readouterr().out


def test_spec_bandwidth_lookup():
  class Device:
    device_kind = "NVIDIA H100 80GB HBM3"
  assert kernel_bench.spec_bandwidth(Device()) == 3.35e12
  Device.device_kind = "cpu"
  assert kernel_bench.spec_bandwidth(Device()) is None
