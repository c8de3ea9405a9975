"""benchmarks/llama_fit.py: the batch search against brute force (fake peaks), one --smoke
run end to end (fresh processes for the compiles and the run, its state stacked from one
layer, the peer's missing package), the JSON and the table."""

import importlib.util
import json
import math

import jax
import numpy as np
import pytest

from benchmarks import llama_fit
from benchmarks.fit_search import largest_at_most, largest_fitting
from train.planner import abstract_trainer

pytestmark = pytest.mark.precision("default")

PEAKS = {  # non-decreasing peaks of the batch, in bytes
    "affine": lambda b: 1000 + 37 * b,
    "convex": lambda b: 500 + 10 * b + b * b,
    "steps": lambda b: 800 + 50 * (b // 5) + 3 * b,
    "flat then steep": lambda b: 100 if b < 40 else 100 + 1000 * (b - 39),
}


def _counted(peak):
  calls = []

  def peak_of(b):
    calls.append(b)
    return peak(b)
  return peak_of, calls


@pytest.mark.parametrize("name", list(PEAKS))
def test_largest_fitting_is_the_brute_force_boundary(name):
  peak = PEAKS[name]
  for cap in (1, 7, 64, 256):
    for budget in range(0, peak(cap) + 60, max(7, peak(cap) // 1500)):
      peak_of, calls = _counted(peak)
      found = largest_fitting(peak_of, budget, cap)
      want = max((b for b in range(1, cap + 1) if peak(b) <= budget), default=0)
      assert found.best == want, (name, cap, budget)
      assert found.peak == (peak(want) if want else None)
      assert len(set(calls)) == len(calls) == found.trials  # no batch compiled twice
      assert [b for b, _ in found.tried] == calls and found.capped == (want == cap)
      if 0 < want < cap:
        assert want + 1 in calls  # the boundary is proven, not assumed
      # never much worse than doubling then bisecting
      assert found.trials <= 2 * math.ceil(math.log2(cap + 1)) + 2


def test_affine_peaks_take_four_compiles_and_the_cap_ends_the_search():
  for budget in (1300, 5000, 9000):  # boundaries 8, 108, 216
    found = largest_fitting(PEAKS["affine"], budget, 256)
    assert found.best == (budget - 1000) // 37 and found.trials <= 4
  found = largest_fitting(lambda b: 10, 100, 256)  # flat: plain doubling to the cap
  assert (found.best, found.capped, [b for b, _ in found.tried]) == (
      256, True, [1, 2, 4, 8, 16, 32, 64, 128, 256])
  found = largest_fitting(lambda b: 10 + b, 10**9, 256)  # the line jumps to the cap
  assert found.best == 256 and found.trials == 3
  found = largest_fitting(lambda b: 500, 100, 256)
  assert (found.best, found.peak, found.trials, found.capped) == (0, None, 1, False)
  with pytest.raises(ValueError, match="cap must be >= 1"):
    largest_fitting(lambda b: 0, 1, 0)


def test_out_of_memory_misses_fall_back_to_doubling_and_bisection():
  for boundary in (1, 2, 5, 37, 100):  # a run's peak, or inf where it runs out of memory
    found = largest_fitting(lambda b: 0 if b <= boundary else math.inf, 1, 256)
    assert found.best == boundary
    assert found.trials <= 2 * math.ceil(math.log2(boundary + 1)) + 1


def test_largest_at_most_tries_the_start_then_steps_down():
  for start in (1, 2, 9, 50):
    for k in range(0, start + 2):
      seen = []
      best, tried = largest_at_most(lambda b: seen.append(b) or b <= k, start)
      assert best == min(k, start) and seen[0] == start and len(set(seen)) == len(seen)
      assert tried == tuple((b, b <= k) for b in seen)
  assert largest_at_most(lambda b: b <= 48, 50)[1] == ((50, False), (49, False), (48, True))


@pytest.mark.slow
def test_smoke_run_end_to_end(tmp_path, capsys, monkeypatch):
  """Fresh processes compile (search) and run (confirm) one row; the peer's nf4 base needs
  torch and bitsandbytes (missing here: the row says which). The smoke budget is an XLA:CPU figure: the
  subprocesses run on the CPU on any machine."""
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  out = tmp_path / "fit.json"
  result = llama_fit.main(["--smoke", "--json", str(out)])
  assert json.loads(out.read_text()) == json.loads(json.dumps(result))
  ours, peer = result["rows"]
  assert (ours["kind"], ours["policy"], ours["base_dtype"], ours["seq"]) == (
      "ours", "baseline", "nf4", 32)
  # the smoke budget is crossed inside the cap: the boundary is proven by a miss
  assert 1 <= ours["max_batch_aot"] < 8 and not ours["capped"] and ours["compiles"] >= 2
  assert ours["predicted_peak_aot"] <= ours["budget_bytes"]
  tried = dict(map(tuple, ours["search"]["tried"]))
  assert tried[ours["max_batch_aot"] + 1] > ours["budget_bytes"]
  # CPU: nothing runs out of memory, no allocator peak
  assert ours["max_batch_run"] == ours["max_batch_aot"] and ours["real_peak"] is None
  assert ours["error_pct"] is None and ours["finite"] and ours["tokens_per_s"] > 0
  assert ours["tokens_per_step"] == 32 * ours["max_batch_run"] == ours["tokens_per_step_aot"]
  assert ours["confirm_tries"] == [[ours["max_batch_aot"], True]]
  # the run's executable is the search's at that batch: the same prediction, and the state
  # stacked from one layer had the abstract state's shapes and dtypes (the executable takes
  # nothing else): its bytes are the abstract ones, nf4 kernels and all
  assert ours["predicted_peak"] == ours["predicted_peak_aot"]
  spec = {"model": "llama-tiny", "layers": 2, "seq": 32, "base_dtype": "nf4"}
  cfg = llama_fit.row_config(spec, ours["max_batch_run"])
  state = abstract_trainer(cfg).state
  assert ours["state_bytes"] == sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
  assert any(x.dtype == np.uint8 for x in jax.tree.leaves(state))
  assert {k: v.shape for k, v in llama_fit.batch_shapes(cfg).items()} == dict.fromkeys(
      ("tokens", "targets", "loss_mask"), (ours["max_batch_run"], 32))
  assert peer["kind"] == "peer" and peer["base_dtype"] == "nf4"
  if "missing" in peer:  # torch first (bitsandbytes needs it), then bitsandbytes
    assert peer["missing"] == ("bitsandbytes" if importlib.util.find_spec("torch") else "torch")
  assert result["not_run"] == [] and result["device_kind"] == "cpu"
  printed = capsys.readouterr().out
  assert "max batch AOT" in printed and "baseline" in printed


def _aot_file(tmp_path, **over):
  """A --target run's JSON for the smoke shapes: baseline on nf4 at seq 32, batch 2."""
  result = {"benchmark": "llama_fit", "model": "llama-tiny", "layers": 2,
            "compile_target": "h100",
            "rows": [{"kind": "ours", "policy": "baseline", "base_dtype": "nf4", "seq": 32,
                      "max_batch_aot": 2, "predicted_peak_aot": 1000, "capped": False,
                      "budget_bytes": 2000, "device_kind": "NVIDIA H100 80GB HBM3",
                      "search": {"tried": [[1, 600], [2, 1000], [3, 2100]],
                                 "jax_version": "0.10.2"}},
                     {"kind": "ours", "policy": "remat", "base_dtype": "nf4", "seq": 32,
                      "max_batch_aot": 0, "predicted_peak_aot": None, "capped": False,
                      "budget_bytes": 2000}]}
  result.update(over)
  path = tmp_path / "aot.json"
  path.write_text(json.dumps(result))
  return path


def test_aot_json_gives_the_rows_it_holds_their_fit(tmp_path):
  path = _aot_file(tmp_path)
  args = llama_fit.parse_args(["--smoke", "--policies", "baseline,lowmem,remat",
                               "--aot-json", str(path)])
  specs = {s.get("policy"): s for s in llama_fit.row_specs(args) if s["kind"] == "ours"}
  fit = specs["baseline"]["aot"]
  assert (fit["max_batch"], fit["predicted_peak"], fit["compiles"]) == (2, 1000, 0)
  assert fit["aot_from"] == {"file": str(path), "compile_target": "h100",
                             "jax_version": "0.10.2",
                             "device_kind": "NVIDIA H100 80GB HBM3"}
  # a row the file lacks, and one whose batch 1 did not fit there, search here
  assert "aot" not in specs["lowmem"] and "aot" not in specs["remat"]


def test_peer_bases_choose_the_peer_rows(capsys):
  args = llama_fit.parse_args(["--smoke", "--bases", "nf4", "--peer-bases", "bfloat16"])
  assert [(s["kind"], s["base_dtype"]) for s in llama_fit.row_specs(args)] == [
      ("ours", "nf4"), ("peer", "bfloat16")]
  args = llama_fit.parse_args(["--smoke", "--bases", "nf4,bfloat16"])
  assert [s["base_dtype"] for s in llama_fit.row_specs(args) if s["kind"] == "peer"] == [
      "nf4", "bfloat16"]
  with pytest.raises(SystemExit):
    llama_fit.parse_args(["--smoke", "--peer-bases", "int8"])
  assert "--peer-bases int8: the peer builds float32, bfloat16, nf4" in capsys.readouterr().err
  # --policies none: the peer's rows only
  args = llama_fit.parse_args(["--smoke", "--policies", "none", "--peer-bases", "bfloat16"])
  assert [(s["kind"], s["base_dtype"]) for s in llama_fit.row_specs(args)] == [
      ("peer", "bfloat16")]


@pytest.mark.parametrize("content, message", [
    (None, "No such file"),
    ("{oops", "not JSON"),
    (json.dumps({"benchmark": "llama_fit", "model": "llama-tiny", "layers": 2}),
     "not the JSON of a 'python -m benchmarks.llama_fit --target GPU' run"),
    (json.dumps({"benchmark": "train_bench", "compile_target": "h100"}), "--target GPU"),
])
def test_aot_json_that_is_not_a_target_run_is_refused(tmp_path, capsys, content, message):
  path = tmp_path / "aot.json"
  if content is not None:
    path.write_text(content)
  with pytest.raises(SystemExit) as e:
    llama_fit.parse_args(["--smoke", "--aot-json", str(path)])
  err = capsys.readouterr().err
  assert e.value.code == 2 and f"--aot-json {path}" in err and message in err


def test_aot_json_of_another_model_or_with_target_is_refused(tmp_path, capsys):
  other = _aot_file(tmp_path, model="llama-7b", layers=None)
  with pytest.raises(SystemExit):
    llama_fit.parse_args(["--smoke", "--aot-json", str(other)])
  assert "its rows are llama-7b with layers=None, this run is llama-tiny with layers=2" in \
      capsys.readouterr().err
  with pytest.raises(SystemExit):
    llama_fit.parse_args(["--smoke", "--aot-json", str(_aot_file(tmp_path)), "--target",
                          "h100"])
  assert "does not go with --target" in capsys.readouterr().err


@pytest.mark.slow
def test_aot_json_row_confirms_without_searching(tmp_path, monkeypatch):
  """A row the file holds runs its batch in one fresh process and compiles nothing else;
  the prediction is the executable's that ran, beside the file's."""
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  path = _aot_file(tmp_path)
  calls = []
  real = llama_fit.run_child
  monkeypatch.setattr(llama_fit, "run_child",
                      lambda kind, *a, **k: calls.append(kind) or real(kind, *a, **k))
  result = llama_fit.main(["--smoke", "--no-peer", "--aot-json", str(path)])
  (row,) = result["rows"]
  assert calls == ["confirm"]
  assert row["max_batch_aot"] == row["max_batch_run"] == 2 and row["compiles"] == 0
  assert row["predicted_peak_aot"] == 1000 and row["predicted_peak"] > 0
  assert row["aot_from"]["file"] == str(path) and row["device_kind"] == "cpu"
  assert result["device_kind"] == "cpu" and row["finite"]
  assert f"by compiling ({path})" in llama_fit.summary(row)
  # compiled for an H100, run on this CPU: the row says its batch was not searched here
  assert row["note"] == ("the batch was compiled for NVIDIA H100 80GB HBM3 and ran on cpu: "
                         "not searched for this device")
  assert row["note"] in llama_fit.summary(row)


def test_budget_s_leaves_rows_out_and_says_which(tmp_path):
  result = llama_fit.main(["--smoke", "--budget-s", "-1", "--json", str(tmp_path / "f.json")])
  assert result["rows"] == []
  assert result["not_run"] == ["baseline / nf4 / seq 32", "torch+peft / nf4 / seq 32"]


def test_a_failed_row_makes_the_exit_status_1(capsys):
  """Every row "failed" (memory_budget=auto on a CPU) exited 0: gpu_check's llama-fit
  stage read passed."""
  ok = {"kind": "ours", "policy": "remat", "base_dtype": "nf4", "seq": 2048}
  missing = {"kind": "peer", "policy": "torch+peft", "base_dtype": "nf4", "seq": 2048,
             "missing": "bitsandbytes"}
  assert llama_fit.exit_status({"rows": [ok, missing]}) == 0
  assert llama_fit.exit_status(None) == 0  # a child's
  assert llama_fit.exit_status({"rows": [ok, {**ok, "policy": "lowmembp", "error": "x"}]}) == 1
  assert capsys.readouterr().err == "failed: lowmembp / nf4 / seq 2048\n"


def test_a_child_that_hangs_is_killed_and_its_row_is_an_error(monkeypatch):
  """--child-timeout: a row's process still running after it is killed, its row an error
  saying so, and the rows after it run (on a device lent for minutes, a hung child would
  have taken the whole call)."""
  import subprocess
  import sys
  done = llama_fit._run_timed([sys.executable, "-c", "print('ok')"], {"child_timeout": 30},
                              stdout=subprocess.PIPE)
  assert done.returncode == 0 and done.stdout == "ok\n"
  hung = [sys.executable, "-c", "import time; time.sleep(60)"]
  killed = llama_fit._run_timed(hung, {"child_timeout": 0.5}, stderr=subprocess.PIPE)
  assert killed.returncode is None and killed.stderr == "killed after 0.5 s (--child-timeout)"
  monkeypatch.setattr(llama_fit, "_run_timed", lambda cmd, spec, **kw: killed)
  row = llama_fit.run_child("search", {"child_timeout": 0.5}, 0.9)
  assert row == {"error": "search process exit None: killed after 0.5 s (--child-timeout)"}
  specs = lambda *argv: llama_fit.row_specs(llama_fit.parse_args(["--smoke", *argv]))
  assert specs()[0]["child_timeout"] == llama_fit.CHILD_TIMEOUT_S
  assert specs("--child-timeout", "0")[0]["child_timeout"] is None  # no limit


def test_peer_ratios_and_table():
  rows = [{"kind": "ours", "policy": "baseline", "base_dtype": "bfloat16", "seq": 2048,
           "max_batch_aot": 6, "max_batch_run": 5, "tokens_per_step": 10240,
           "predicted_peak": 60 * 2**30, "real_peak": 59 * 2**30, "error_pct": 1.7,
           "tokens_per_s": 9000.0},
          {"kind": "ours", "policy": "remat", "base_dtype": "nf4", "seq": 2048,
           "error": "search process exit 1: boom"},
          {"kind": "peer", "policy": "torch+peft", "base_dtype": "bfloat16", "seq": 2048,
           "max_batch_run": 4, "capped": False, "tokens_per_step": 8192,
           "tokens_per_s": 7500.0},
          {"kind": "peer", "policy": "torch+peft", "base_dtype": "nf4", "seq": 2048,
           "missing": "bitsandbytes"}]
  llama_fit.add_peer_ratios(rows)
  assert rows[0]["tokens_per_step_vs_peer"] == 10240 / 8192
  assert rows[0]["tokens_per_s_vs_peer"] == 9000 / 7500
  assert "tokens_per_s_vs_peer" not in rows[1]
  text = llama_fit.table({"rows": rows})
  lines = text.splitlines()
  assert "max batch AOT" in lines[0] and "tok/s vs peer" in lines[0]
  assert lines[2].split()[:5] == ["baseline", "bfloat16", "2048", "6", "5"]
  assert "1.25" in lines[2] and "1.20" in lines[2] and "+1.7" in lines[2]
  assert "failed" in lines[3] and "missing: bitsandbytes" in lines[5]
  assert llama_fit.summary(rows[1]) == "failed: search process exit 1: boom"
  assert llama_fit.summary(rows[0]) == "batch 6 by compiling, 5 by running, 9000 tokens/s"


@pytest.mark.parametrize("argv, message", [
    (["--bases", "fp8"], "base_dtype='fp8'"),
    (["--seq", "0"], "lengths >= 1"),
    (["--policies", "baseline,nope"], "nope"),
    (["--memory-budget", "lots"], "memory_budget='lots'"),
    (["--model", "llama-huge"], "llama-huge"),
    (["--cap", "0"], "--cap must be >= 1"),
    (["--policies", "none", "--no-peer"], "--policies none leaves only the peer's rows"),
    (["--policies", "none", "--target", "h100"], "nothing to run"),
    (["--json", "."], "--json . is a directory; give a file name"),
    (["--json", "/no-such-dir/f.json"], "--json /no-such-dir/f.json: the directory "
     "/no-such-dir does not exist"),
])
def test_bad_arguments_exit_2_naming_the_value(argv, message, capsys):
  with pytest.raises(SystemExit) as e:
    llama_fit.parse_args(["--smoke", *argv])
  assert e.value.code == 2 and message in capsys.readouterr().err


def test_peer_bases_it_cannot_build_are_missing_rows():
  row = llama_fit.peer_row({"base_dtype": "int8", "seq": 8, "model": "llama-tiny"}, 4)
  assert row["missing"].startswith("no int8 base")
