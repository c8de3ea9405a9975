"""The attention benchmark's CLI (smoke on CPU) and its timing arithmetic."""

import types

import jax
import jax.numpy as jnp
import pytest
from conftest import cli_error

from lowmem_jax import attention_bench


@pytest.mark.slow
def test_attention_bench_smoke(tmp_path, capsys):
  if jax.default_backend() == "gpu":
    pytest.skip("the GPU run is the real benchmark (gpu_check)")
  out = tmp_path / "attention.json"
  result = attention_bench.main(["--json", str(out), "--lengths", "17", "--models", "llama"])
  assert out.exists() and result["smoke"]
  rows = {r["implementation"]: r for r in result["rows"]}
  assert list(rows) == ["cudnn", "cudnn_padded", "flash", "xla"]
  assert rows["cudnn"]["status"] == "refused" and "backend 'cpu'" in rows["cudnn"]["reason"]
  for impl in ("flash", "xla"):
    assert rows[impl]["status"] == "ok" and rows[impl]["ms"] is not None, rows[impl]
    assert rows[impl]["temp_bytes"] is not None
  assert {r["auto"] for r in result["rows"]} == {"flash"}
  assert rows["flash"]["fastest_no_nxn"] == "flash"   # the only timed path without N x N
  assert "ms fwd+bwd" in capsys.readouterr().out


def test_time_per_call_differences_out_the_launch_cost(monkeypatch):
  """On a fake clock (a real sleep overshoots on a loaded machine): run(count) takes
  launch + per_call * count, its first repeat a hiccup more; the best of the repeats of
  two counts differences out the launch exactly."""
  per_call, launch, hiccup = 0.002, 0.01, 0.05
  clock, calls = [0.0], []
  monkeypatch.setattr(attention_bench, "time", types.SimpleNamespace(
      perf_counter=lambda: clock[0]))

  def run(count):
    clock[0] += launch + per_call * count + (hiccup if len(calls) % 3 == 1 else 0.0)
    calls.append(count)
    return jnp.zeros(())

  measured = attention_bench.time_per_call(run, smoke=False)
  assert measured == pytest.approx(per_call, rel=1e-9), measured
  assert len(calls) == 7 and calls[-1] > calls[1] == 2, calls  # warm-up, 3 + 3 repeats


def test_loop_feeds_each_call_into_the_next():
  """The timed loop is not one call repeated: its result depends on the count."""
  q, k, v, cotangent = attention_bench._inputs(
      dict(heads=2, kv_heads=2, head_dim=8, tokens=16), 8, jnp.float32)
  loop = jax.jit(lambda count: attention_bench._loop("flash", False, count, q, k, v,
                                                     cotangent))
  one, two = loop(1), loop(2)
  assert all(float(jnp.max(jnp.abs(a - b))) > 0 for a, b in zip(one, two))


@pytest.mark.parametrize("argv,message", [
    (["--models", "gpt"], "--models: unknown gpt; valid: "),
    (["--lengths", "0"], "--lengths '0': sequence lengths must be >= 1"),  # ZeroDivisionError
    (["--lengths", "abc"], "--lengths 'abc': expected comma-separated sequence lengths"),
    (["--budget", "-5"], "--budget must be > 0, got -5.0"),  # every row was "skipped"
    (["--json", "/nonexistent/x.json"], "the directory /nonexistent does not exist"),
])
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
  assert message in cli_error(attention_bench.main, ["--smoke", *argv], capsys)


def test_rows_past_the_time_budget_are_reported_as_skipped():
  rows = attention_bench.run_bench(attention_bench.SMOKE_MODELS, (8,), jnp.bfloat16,
                                   smoke=True, budget_s=0.0)
  assert {r["status"] for r in rows} == {"refused", "skipped"}, rows
  assert all(r["ms"] is None and r["fastest_no_nxn"] is None for r in rows)
