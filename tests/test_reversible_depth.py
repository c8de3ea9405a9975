"""benchmarks.reversible_depth: compiled memory against depth, and the real-step cases run
in fresh processes (on the CPU here: no peak; the GPU check runs the same code)."""

import json

import jax.numpy as jnp
import pytest

from benchmarks import reversible_depth as rd
from conftest import cli_error

TINY = rd.SMOKE["overrides"]


def test_reversible_temp_is_flat_in_depth():
  rows = [rd.compile_row("revvit-tiny", "reversible", layers, 2, jnp.bfloat16, TINY)
          for layers in (2, 4)]
  growth = rd.depth_growth(rows)["reversible"]
  assert growth["layers"] == [2, 4]
  assert growth["temp_growth_per_layer"] == 0  # rebuilt in backward, not kept
  # the parameters (arguments) and their gradients (outputs) grow with depth
  assert growth["argument_output_growth_per_layer"] > 0


@pytest.mark.slow
def test_cli_runs_each_case_in_a_fresh_process(tmp_path, monkeypatch):
  monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # what main sets, undone
  out = tmp_path / "rd.json"
  result = rd.main(["--smoke", "--run", "--policies", "reversible", "--depths", "2",
                    "--variants", "lhs,vanilla-concurrent", "--no-compile-rows", "--steps", "1",
                    "--rounds", "1",
                    "--warmup", "1", "--json", str(out)])
  assert json.loads(out.read_text()) == json.loads(json.dumps(result))
  rows = {r["case"]: r for r in result["run_rows"]}
  # the claim first, variants last, each named by the schedule it runs
  assert list(rows) == ["reversible", "pareprop[lhs]", "reversible[vanilla-concurrent]"]
  for r in rows.values():  # run_case's figures, from each fresh process
    assert "error" not in r and r["finite"] and r["step_ms"] > 0, r
    assert r["compiled"]["temp"] > 0 and r["param_bytes"] > 0
  assert rows["reversible"]["speed_vs_reversible"] == 1.0
  assert rows["pareprop[lhs]"]["speed_vs_reversible"] > 0
  assert "latency_hiding_scheduler" in rows["pareprop[lhs]"]["xla_flags"]
  control = rows["reversible[vanilla-concurrent]"]
  assert control["policy"] == "reversible" and "concurrent_region" in control["xla_flags"]
  assert control["speed_vs_reversible"] > 0


def test_target_goes_with_the_compile_rows():
  for argv in (["--target", "h100"], ["--compile-only", "--no-compile-rows", "--target", "h100"]):
    with pytest.raises(SystemExit):
      rd.main(["--smoke", *argv])


@pytest.mark.parametrize("argv,message", [
    (["--depths", "2,2"], "--depths '2,2': layer counts >= 1, each once"),  # ZeroDivisionError
    (["--depths", "x"], "expected comma-separated layer counts"),
    (["--batch", "0"], "--batch must be >= 1, got 0"),  # was the default, silently
    (["--steps", "0"], "--steps must be >= 1, got 0"),  # every row an UnboundLocalError
    (["--warmup", "-1"], "--warmup must be >= 0, got -1"),
    (["--json", "/nonexistent/x.json"], "the directory /nonexistent does not exist"),
])
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
  assert message in cli_error(rd.main, ["--smoke", "--compile-only", *argv], capsys)


def test_no_compile_rows_without_real_steps_is_an_error(capsys, monkeypatch):
  """On a machine that cannot run real steps (a CPU, without --run), --no-compile-rows
  wrote a JSON with no row and exited 0, ignoring --variants, --steps and --rounds."""
  monkeypatch.setattr(rd, "_can_run", lambda: False)
  assert cli_error(rd.main, ["--smoke", "--no-compile-rows"], capsys).startswith(
      "--no-compile-rows leaves nothing to measure: no real steps on ")
  assert cli_error(rd.main, ["--smoke", "--no-compile-rows", "--compile-only"], capsys) == (
      "--no-compile-rows leaves nothing to measure: --compile-only runs no steps (drop one "
      "of them)")
