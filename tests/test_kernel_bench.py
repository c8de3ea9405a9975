"""The kernel benchmark: device timing in one looped program, the copy check, the CLI
(interpret mode: a smoke test, not a timing). No assertion looks at a time."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from conftest import cli_error
from lowmem_jax import kernel_bench

pytestmark = pytest.mark.precision("default")


def test_looped_returns_the_op_result():
  x = jnp.arange(12.0).reshape(3, 4)
  out = kernel_bench.looped(lambda a, b: (a * 2, a + b), 5)(x, x)
  np.testing.assert_allclose(out[0], x * 2)
  np.testing.assert_allclose(out[1], x + x)


def test_loop_runs_the_op_every_iteration():
  """The compiled loop keeps the op in its body with the asked trip count: XLA neither
  hoists it out nor folds the calls into one."""
  x = jnp.ones((256, 128), jnp.bfloat16)
  n = kernel_bench.MIN_LOOP_TRIPS  # fewer trips XLA:GPU may unroll
  hlo = kernel_bench.looped(lambda a: jnp.sin(a) * 2, n).lower(x).compile().as_text()
  assert kernel_bench.loop_intact(hlo, n)
  assert not kernel_bench.loop_intact(hlo, n + 1)
  body = hlo.split("while(")[1]
  assert f'"known_trip_count":{{"n":"{n}"}}' in body


def test_loop_check_catches_a_hoisted_op():
  """Without the barrier the op is loop-invariant: XLA hoists it and the check says so."""
  x = jnp.ones((256, 128), jnp.float32)

  @jax.jit
  def naive(a):
    return lax.fori_loop(0, 7, lambda i, o: jnp.sin(a) * 2, jnp.zeros_like(a))

  assert not kernel_bench.loop_intact(naive.lower(x).compile().as_text(), 7)
  assert not kernel_bench.loop_intact(jax.jit(jnp.sin).lower(x).compile().as_text(), 7)


GPU_LIKE_HLO = """\
%command_buffer (p0: bf16[64,32]) -> (bf16[64,32], u8[512]) {
  %p0 = bf16[64,32]{1,0} parameter(0)
  ROOT %custom-call.1 = (bf16[64,32]{1,0}, u8[512]{0}) custom-call(%p0), custom_call_target="__gpu$xla.gpu.triton"
}

%wrapped_add_computation (a: s32[], b: s32[]) -> s32[] {
  ROOT %add = s32[] add(%a, %b)
}

%body (t: (s32[], bf16[64,32])) -> (s32[], bf16[64,32]) {
  %i = s32[] get-tuple-element(%t), index=0
  %x = bf16[64,32]{1,0} get-tuple-element(%t), index=1
  %wrapped_add = s32[] fusion(%i, %one), kind=kLoop, calls=%wrapped_add_computation
  %call = (bf16[64,32]{1,0}, u8[512]{0}) call(%x), to_apply=%command_buffer
  ROOT %r = (s32[], bf16[64,32]{1,0}) tuple(%wrapped_add, %x)
}

ENTRY %main (a: bf16[64,32]) -> bf16[64,32] {
  %w = (s32[], bf16[64,32]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"40"}}
}
"""


def test_loop_check_sees_kernels_in_command_buffers():
  """XLA:GPU may wrap the body's kernels in a called command-buffer computation, and a
  Pallas call with two outputs has a tuple shape: both still count as real work."""
  assert kernel_bench.loop_intact(GPU_LIKE_HLO, 40)
  assert not kernel_bench.loop_intact(GPU_LIKE_HLO, 41)
  counter_only = GPU_LIKE_HLO.replace("to_apply=%command_buffer", "to_apply=%nothing")
  assert not kernel_bench.loop_intact(counter_only, 40)


def test_device_seconds_reports_iters_and_loop():
  x = jnp.ones((64, 64), jnp.float32)
  n = kernel_bench.MIN_LOOP_TRIPS
  t = kernel_bench.device_seconds({"neg": jnp.negative}, {"neg": (x,)}, target_s=1e-4,
                                  rounds=2, min_iters=n, max_iters=n + 2)
  assert set(t["neg"]) == {"seconds", "iters", "loop_intact"}
  assert n <= t["neg"]["iters"] <= n + 2 and t["neg"]["loop_intact"]
  assert t["neg"]["seconds"] > 0


def test_copy_counts_bytes_read_and_written():
  n = kernel_bench.MIN_LOOP_TRIPS
  copy = kernel_bench.measure_copy(1000, jnp.bfloat16, target_s=1e-4, rounds=2,
                                   device=_Device("cpu"), min_iters=n, max_iters=n + 2)
  assert copy["bytes"] == 2 * 1000 * 2
  assert copy["Bps"] == pytest.approx(copy["bytes"] / copy["seconds"])
  assert copy["loop_intact"]
  assert copy["peak_Bps"] is None and copy["low"] is None  # no known peak, no flag


class _Device:
  def __init__(self, kind):
    self.device_kind = kind


@pytest.mark.parametrize("kind, peak", [
    ("NVIDIA H100 80GB HBM3", 3.35e12), ("NVIDIA H100 PCIe", 2.0e12),
    ("NVIDIA H200", 4.8e12), ("NVIDIA A100-SXM4-80GB", 2.039e12), ("NVIDIA L4", 0.3e12),
    ("NVIDIA L40S", 0.864e12), ("cpu", None)])
def test_spec_bandwidth_lookup(kind, peak):
  assert kernel_bench.spec_bandwidth(_Device(kind)) == peak


def test_copy_below_60_percent_of_peak_is_flagged(monkeypatch):
  monkeypatch.setattr(kernel_bench, "spec_bandwidth", lambda device: 1e15)  # unreachable
  copy = kernel_bench.measure_copy(1000, jnp.float32, target_s=1e-4, rounds=2,
                                   device=_Device("NVIDIA H100 80GB HBM3"))
  assert copy["low"] is True and copy["pct_peak"] < 60
  assert "LOW" in kernel_bench.copy_line(copy, "NVIDIA H100 80GB HBM3")
  assert copy["above_peak"] is False
  monkeypatch.setattr(kernel_bench, "spec_bandwidth", lambda device: 1.0)  # 1 B/s: beaten
  copy = kernel_bench.measure_copy(1000, jnp.float32, target_s=1e-4, rounds=2)
  assert copy["low"] is False and copy["above_peak"] is True
  line = kernel_bench.copy_line(copy, "x")
  assert "LOW" not in line and "ABOVE PEAK" in line


@pytest.mark.slow
def test_kernel_bench_smoke(tmp_path, capsys):
  out = tmp_path / "bench.json"
  result = kernel_bench.main(["--interpret", "--json", str(out)])
  assert out.exists()
  kernels = result["kernels"]
  names = [r["kernel"] for r in kernels["rows"]]
  assert names == ["pack_2bit", "unpack_2bit", "regelu2_forward", "approx2_backward",
                   "ms_layer_norm_forward", "ms_layer_norm_backward", "resilu2_forward",
                   "ms_rms_norm_forward", "ms_rms_norm_backward", "mesa_quantize",
                   "mesa_dequantize"]  # every kernel (before: no Mesa, SiLU or RMS one)
  for row in kernels["rows"]:  # Pallas (interpreted) agrees with the jnp path
    assert row["max_abs_err_vs_xla"] < 1e-2, row
    if row["kernel"].startswith(("mesa_", "pack", "unpack")):  # codes: bit for bit
      assert row["max_abs_err_vs_xla"] == 0, row
    assert row["loop_intact"], row
    assert "copy_low" in row and "above_peak" in row
  assert {"Bps", "bytes", "low", "pct_peak"} <= set(kernels["copy"])
  assert [r["policy"] for r in result["block_step"]][0] == "baseline"
  text = capsys.readouterr().out
  assert text.index("measured copy") < text.index("pallas GB/s")  # copy checked first
  assert "speed vs baseline" in text


def test_a_kernel_that_fails_is_a_row_and_the_bench_goes_on(monkeypatch):
  x = jnp.ones((64, 64), jnp.float32)

  def broken(a):
    raise NotImplementedError("no Triton lowering for this\nmore")

  monkeypatch.setattr(kernel_bench, "kernel_cases", lambda *a: [
      ("broken", broken, jnp.negative, (x,), 2 * x.nbytes),
      ("neg", jnp.negative, jnp.negative, (x,), 2 * x.nbytes)])
  n = kernel_bench.MIN_LOOP_TRIPS
  kernels = kernel_bench.bench_kernels(64, 64, jnp.float32, 2, False, target_s=1e-4,
                                       min_iters=n, max_iters=n + 1)
  broken_row, neg = kernels["rows"]
  assert broken_row == {"kernel": "broken",
                        "error": "NotImplementedError: no Triton lowering for this"}
  assert neg["kernel"] == "neg" and neg["max_abs_err_vs_xla"] == 0 and neg["loop_intact"]
  table = kernel_bench.kernel_table(kernels)
  assert "broken" in table and "failed" in table


@pytest.mark.parametrize("argv,message", [
    (["--rounds", "0"], "--rounds must be >= 1, got 0"),  # StatisticsError after the run
    (["--hidden", "0"], "--hidden must be >= 1, got 0"),  # ZeroDivisionError
    (["--dtype", "foo"], "--dtype 'foo' is not a dtype"),
    (["--dtype", "int32"], "--dtype 'int32' is not a floating dtype"),
    (["--target-ms", "0"], "--target-ms must be > 0"),
    (["--elements", "10", "--hidden", "64"], "--elements 10 is less than one row"),
    (["--json", "/nonexistent/x.json"], "the directory /nonexistent does not exist"),
])
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
  assert message in cli_error(kernel_bench.main, ["--no-step", *argv], capsys)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the kernels compile there")
def test_without_interpret_off_a_gpu_is_one_line_before_any_work(capsys):
  """Every kernel failed, a row each, after minutes ("Only interpret mode is supported on
  CPU backend")."""
  assert cli_error(kernel_bench.main, [], capsys).startswith(
      "the kernels compile for a GPU, and this backend is cpu: pass --interpret")
