"""The one-command GPU check: stages run as subprocesses, a failing or hanging stage is
recorded and the rest still run, the report's structure (smoke mode on the CPU)."""

import json
import signal
import sys
import textwrap

import pytest

from conftest import cli_error
from lowmem_jax import gpu_check
from lowmem_jax.gpu_check import Stage

pytestmark = pytest.mark.precision("default")


def _py(code):
  return [sys.executable, "-c", code]


def test_failing_hanging_and_missing_stages_are_recorded_not_fatal(tmp_path):
  write_json = (f"import json; open({str(tmp_path / 'ok.json')!r}, 'w')"
                ".write(json.dumps({'a': 1}))")  # stages run in the repository root
  stages = [
      Stage("ok", _py(write_json), 30, json_file="ok.json"),
      Stage("fails", _py("import sys; print('boom', file=sys.stderr); sys.exit(3)"), 30),
      Stage("hangs", _py("import time; time.sleep(120)"), 1),
      Stage("missing", None, 30),
      Stage("after", _py("print('still runs')"), 30),
  ]
  records = gpu_check.run_stages(stages, tmp_path, budget_s=120)
  status = {r["name"]: r["status"] for r in records}
  assert status == {"ok": "passed", "fails": "failed", "hangs": "timeout",
                    "missing": "missing", "after": "passed"}
  by = {r["name"]: r for r in records}
  assert by["ok"]["json"] == {"a": 1} and by["ok"]["exit_code"] == 0
  assert by["fails"]["exit_code"] == 3 and "boom" in by["fails"]["stderr_tail"]
  assert by["hangs"]["exit_code"] != 0
  assert "still runs" in by["after"]["stdout_tail"]
  assert (tmp_path / "logs" / "fails.err").exists()


def test_budget_cuts_timeouts_and_keeps_the_later_stages_reserve(tmp_path):
  stages = [Stage("a", _py("pass"), 1000, reserve_s=0),
            Stage("b", _py("pass"), 1000, reserve_s=40),
            Stage("c", None, 1000, reserve_s=500)]  # missing: reserves nothing
  records = gpu_check.run_stages(stages, tmp_path, budget_s=100)
  assert records[0]["timeout_s"] <= 60 and records[1]["timeout_s"] <= 100
  records = gpu_check.run_stages([Stage("late", _py("pass"), 10)], tmp_path, budget_s=0)
  assert records[0]["status"] == "skipped"


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="1" skipped="1" tests="5">
<testcase classname="tests.test_a" name="test_ok" file="tests/test_a.py" line="3" time="0.5"/>
<testcase classname="tests.test_a.TestB" name="test_bad[x-1]" file="tests/test_a.py" time="12.25">
  <failure message="assert 0">trace</failure></testcase>
<testcase classname="tests.test_c" name="test_err" file="tests/test_c.py">
  <error message="fixture">trace</error></testcase>
<testcase classname="tests.test_c" name="test_skip" file="tests/test_c.py">
  <skipped message="no gpu"/></testcase>
<testcase classname="tests.test_c" name="test_ok2" file="tests/test_c.py" time="3"/>
</testsuite></testsuites>
"""


def test_junit_counts_and_failing_ids(tmp_path):
  path = tmp_path / "j.xml"
  path.write_text(JUNIT)
  counts = gpu_check.parse_junit(path)
  assert {k: counts[k] for k in ("passed", "failed", "errors", "skipped", "total")} == {
      "passed": 2, "failed": 1, "errors": 1, "skipped": 1, "total": 5}
  assert counts["failing"] == ["tests/test_a.py::TestB::test_bad[x-1]",
                               "tests/test_c.py::test_err (error)"]
  assert counts["slowest"][:3] == [["tests/test_a.py::TestB::test_bad[x-1]", 12.2],
                                   ["tests/test_c.py::test_ok2", 3.0],
                                   ["tests/test_a.py::test_ok", 0.5]]
  assert counts["test_s"] == 15.8

def test_markdown_lists_the_slowest_tests(tmp_path):
  """Where the GPU suite's time goes: the report names its slowest tests."""
  path = tmp_path / "j.xml"
  path.write_text(JUNIT)
  stage = {"name": "tests", "status": "passed", "exit_code": 0, "wall_s": 20.0,
           "timeout_s": 400, "json": None, "tests": gpu_check.parse_junit(path)}
  report = gpu_check.build_report([stage], args={"argv": []}, git={"commit": None},
                                  started="2026-11-27T10:00:00", wall_s=20.0)
  md = gpu_check.markdown(report)
  assert ("Slowest tests (16 s of worker time in all):\n"
          "- 12.2 s `tests/test_a.py::TestB::test_bad[x-1]`\n"
          "- 3.0 s `tests/test_c.py::test_ok2`\n") in md



def test_pytest_log_fallback():
  log = textwrap.dedent("""\
      ..F.s
      FAILED tests/test_a.py::test_bad - assert 0
      ERROR tests/test_b.py::test_err - RuntimeError
      2 failed, 940 passed, 3 skipped, 1 error in 201.3s
      """)
  counts = gpu_check.parse_pytest_log(log)
  assert (counts["passed"], counts["failed"], counts["errors"], counts["skipped"]) == (
      940, 2, 1, 3)
  assert counts["failing"] == ["tests/test_a.py::test_bad", "tests/test_b.py::test_err (error)"]


def test_device_slug():
  assert gpu_check.device_slug("NVIDIA H100 80GB HBM3") == "h100"
  assert gpu_check.device_slug("NVIDIA H200") == "h200"
  assert gpu_check.device_slug("NVIDIA A100-SXM4-80GB") == "a100"
  assert gpu_check.device_slug("cpu") == "cpu"
  assert gpu_check.device_slug(None) == "unknown"


def test_the_tests_stage_keeps_the_callers_xla_flags(tmp_path, monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/d")
  tests = next(s for s in gpu_check.build_stages(tmp_path) if s.name == "tests")
  assert tests.env["XLA_FLAGS"] == "--xla_dump_to=/tmp/d --xla_gpu_autotune_level=0"


def test_gpu_stages_run_the_asked_commands(tmp_path):
  stages = {s.name: s for s in gpu_check.build_stages(tmp_path, workers=12)}
  assert list(stages)[-1] == "tests" and list(stages)[0] == "env"
  vit, llama = " ".join(stages["bench-vit"].cmd), " ".join(stages["bench-llama"].cmd)
  assert "model=vit-b16" in vit and "batch_size=64" in vit and "lora_targets=query,value" in vit
  assert "--peers" in stages["bench-vit"].cmd and "--peers" in stages["bench-llama"].cmd
  # where the device time goes, ours and the peers'
  assert "--profile" in stages["bench-vit"].cmd and "--profile" in stages["bench-llama"].cmd
  vit_policies = stages["bench-vit"].cmd[stages["bench-vit"].cmd.index("--policies") + 1]
  assert "lowmem+qkv=recompute" in vit_policies.split(",")
  assert "--peak" not in stages["bench-vit"].cmd  # only when asked for (or implied by GPU peers)
  from train.bench import parse_policies
  llama_cmd = stages["bench-llama"].cmd
  assert "wta-crs" in parse_policies(llama_cmd[llama_cmd.index("--policies") + 1])
  for item in ("model=llama-7b", "model.num_layers=4", "max_len=1024", "batch_size=4",
               "lora_rank=8", "lora_targets=query,key,value,out,gate,up,down"):
    assert item in llama
  assert f"out_dir={tmp_path / 'train-run'}" in " ".join(stages["train"].cmd)
  plan = " ".join(stages["train-plan"].cmd)  # the planner in the train loop, on a real choice
  for item in ("-m train", "model=vit-b16", "batch_size=64", "trainable=lora",
               "memory_budget=2GiB", f"out_dir={tmp_path / 'train-plan-run'}"):
    assert item in plan
  assert "train-plan" in gpu_check.THIRD_CALL and "train-plan" not in gpu_check.DEFAULT_STAGES
  assert "-n 12" in " ".join(stages["tests"].cmd)
  assert stages["tests"].env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
  assert stages["tests"].env["XLA_FLAGS"].split()[-1] == "--xla_gpu_autotune_level=0"
  rev = stages["reversible-depth"].cmd
  assert rev[1:3] == ["-m", "benchmarks.reversible_depth"] and "--smoke" not in rev
  assert rev[rev.index("--json") + 1] == str(tmp_path / "reversible-depth.json")
  smoke = {s.name: s for s in gpu_check.build_stages(tmp_path, smoke=True)}
  assert "--smoke" in smoke["reversible-depth"].cmd
  assert "--run" in smoke["reversible-depth"].cmd  # a CPU makes no row without it
  remat = stages["bench-remat"].cmd
  assert "--peak" in remat and "--peers" not in remat and "--profile" not in remat
  assert parse_policies(remat[remat.index("--policies") + 1]) == list(gpu_check.REMAT_POLICIES)
  budget = gpu_check.GPU_BUDGET_S  # one call: 10 minutes a command, 15 a lease, start included
  assert budget + gpu_check.KILL_GRACE_S + 30 <= 10 * 60
  assert budget + gpu_check.KILL_GRACE_S + 30 + 120 <= 15 * 60 - 180  # 3 minutes left
  reserve = sum(s.reserve_s for s in stages.values() if s.name in gpu_check.DEFAULT_STAGES)
  assert reserve < budget - 120  # the first call's stages leave the tests two minutes
  assert sum(s.reserve_s for s in stages.values() if s.name in gpu_check.SECOND_CALL) < budget
  tests_cmd = stages["tests"].cmd  # the project's addopts (-n auto --maxprocesses 8) off
  assert tests_cmd[tests_cmd.index("-o") + 1] == "addopts="
  assert stages["reversible-depth"].env == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
  fit = stages["llama-fit"]  # a call of its own: its budget stops new rows before the timeout
  assert fit.cmd[1:3] == ["-m", "benchmarks.llama_fit"] and "--smoke" not in fit.cmd
  assert "llama-fit" not in gpu_check.DEFAULT_STAGES and "llama-fit" in gpu_check.THIRD_CALL
  assert float(fit.cmd[fit.cmd.index("--budget-s") + 1]) + 120 <= fit.timeout_s
  assert sum(s.reserve_s for s in stages.values() if s.name in gpu_check.THIRD_CALL) < budget
  assert "--smoke" in smoke["llama-fit"].cmd


def _assert_report_structure(report, names):
  assert [r["name"] for r in report["stages"]] == names
  for r in report["stages"]:
    assert {"name", "cmd", "status", "exit_code", "wall_s", "timeout_s", "json"} <= set(r)
  assert {"commit", "dirty"} <= set(report["git"])
  assert report["environment"]["jax"] and report["environment"]["device_kind"]


def test_every_stage_shares_one_compilation_cache(tmp_path, monkeypatch):
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")  # conftest's; a user's own would win
  probe = Stage("probe", [sys.executable, "-c",
                          "import os; print(os.environ['JAX_COMPILATION_CACHE_DIR'])"], 60)
  rec = gpu_check.run_stages([probe], tmp_path, budget_s=60)[0]
  assert rec["status"] == "passed"
  assert rec["stdout_tail"].strip() == str(tmp_path / gpu_check.XLA_CACHE)


def test_git_changes_are_reported_only_for_the_commit_named():
  """A --commit that is not this checkout's HEAD (a copy laid over another checkout, as
  on the GPU machines) says nothing of local changes: their report said 'with local
  changes' of a clean tree."""
  head = gpu_check.git_info()
  if head["commit"] is None:
    pytest.skip("not a git checkout")
  assert isinstance(head["dirty"], bool)
  assert isinstance(gpu_check.git_info(head["commit"][:7])["dirty"], bool)
  assert gpu_check.git_info("abc123") == {"commit": "abc123", "from": "--commit", "dirty": None}


def test_smoke_report_structure(tmp_path, monkeypatch):
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # the stages' subprocesses: CPU on any machine
  tests = tmp_path / "t"
  tests.mkdir()
  (tests / "test_tiny.py").write_text(
      "import pytest\n\ndef test_ok():\n  pass\n\ndef test_bad():\n  assert 0\n\n"
      "@pytest.mark.skip\ndef test_skip():\n  pass\n")
  out = tmp_path / "out"
  report = gpu_check.main(["--smoke", "--stages", "env,tests", "--out", str(out),
                           "--tests", str(tests / "test_tiny.py"), "--workers", "0",
                           "--docs", str(tmp_path / "docs"), "--commit", "abc123"])
  _assert_report_structure(report, ["env", "tests"])
  assert report["git"]["commit"] == "abc123"
  env, tests_stage = report["stages"]
  assert env["status"] == "passed" and env["json"]["platform"] == "cpu"
  assert tests_stage["status"] == "failed" and tests_stage["exit_code"] == 1  # not fatal
  assert {k: report["tests"][k] for k in ("passed", "failed", "skipped")} == {
      "passed": 1, "failed": 1, "skipped": 1}
  assert report["tests"]["failing"][0].endswith("test_tiny.py::test_bad")
  saved = json.loads((out / "report.json").read_text())
  assert saved["stage_status"] == {"passed": ["env"], "failed": ["tests"]}
  md = (out / "report.md").read_text()
  assert md.startswith("# lowmem-jax GPU check: cpu") and "| tests | failed | 1 |" in md
  assert "test_tiny.py::test_bad" in md
  docs = sorted(p.name for p in (tmp_path / "docs").iterdir())
  assert len(docs) == 2 and docs[0].startswith("cpu-") and docs[0].endswith(".json")


def test_docs_hold_the_stages_finished_when_the_call_is_cut(tmp_path, monkeypatch):
  """With --docs the docs report is written after every stage, named for the device once
  the env stage names it (the old name removed): a call its caller kills (the device's
  time ran out) still leaves what it finished where the caller collects it (before:
  only at the end)."""
  def run_stages(stages, out, budget, on_stage):
    env = {"name": "env", "status": "passed", "exit_code": 0, "wall_s": 1.0,
           "json": {"platform": "gpu", "device_kind": "NVIDIA H100 80GB HBM3"}}
    on_stage([{"name": "env", "status": "running"}])
    on_stage([env])
    raise KeyboardInterrupt  # killed in the next stage
  monkeypatch.setattr(gpu_check, "run_stages", run_stages)
  monkeypatch.setattr(gpu_check, "build_report", lambda records, **kw: {
      "environment": next((r["json"] for r in records if "json" in r), {}), "stages": records})
  monkeypatch.setattr(gpu_check, "markdown", lambda report: json.dumps(report))
  with pytest.raises(KeyboardInterrupt):
    gpu_check.main(["--stages", "env,bench-vit", "--out", str(tmp_path / "out"), "--docs",
                    str(tmp_path / "docs"), "--commit", "abc123"])
  docs = sorted(p.name for p in (tmp_path / "docs").iterdir())
  assert len(docs) == 2 and all(name.startswith("h100-") for name in docs), docs
  saved = json.loads((tmp_path / "docs" / docs[0]).read_text())
  assert [s["name"] for s in saved["stages"]] == ["env"]


def test_unknown_stage_is_an_error(tmp_path):
  with pytest.raises(SystemExit):
    gpu_check.main(["--stages", "nope", "--out", str(tmp_path)])
  with pytest.raises(SystemExit):  # two ways of choosing the stages at once
    gpu_check.main(["--stages", "env", "--call", "2", "--out", str(tmp_path)])
  assert gpu_check.CALLS[2] == gpu_check.SECOND_CALL and gpu_check.CALLS[3] == (
      "env", "llama-fit", "train-plan")


def _no_stages(*args, **kwargs):
  raise AssertionError("ran stages before checking the arguments")


BAD_ARGS = [
    (["--stages", "foo"], "--stages: unknown stage(s) foo; valid: env, train, "),
    (["--stages", ","], "--stages names no stage, got ','; valid: env, "),
    (["--budget", "-1"], "--budget must be > 0, got -1.0"),
    (["--budget", "0"], "--budget must be > 0, got 0.0"),
    (["--workers", "-1"], "--workers must be >= 0, got -1"),
    (["--out", "a-file"], "--out a-file is a file, not a directory"),
    (["--out", "a-file/sub"], "--out a-file/sub cannot be made: a-file is a file, not a "
     "directory"),
    (["--docs", "a-file"], "--docs a-file is a file, not a directory"),
    (["--tests", "tests/x.py -k 'a"], "--tests tests/x.py -k 'a: No closing quotation"),
    (["--shard", "3/2"], "--shard expects K/N with 1 <= K <= N, got '3/2'"),
    (["--shard", "1"], "--shard expects K/N with 1 <= K <= N, got '1'"),
    (["--shard", "1/2", "--tests", "tests/x.py"], "--shard splits the default test "),
]


def test_shards_cover_every_test_file_once(tmp_path):
  """--shard K/N: the suite over N calls, each file in exactly one part; the tests
  stage runs the part."""
  files = sorted(f"tests/{p.name}" for p in (gpu_check.ROOT / "tests").glob("test_*.py"))
  parts = [gpu_check.tests_shard(k, 3) for k in (1, 2, 3)]
  assert sorted(sum(parts, [])) == files and all(parts)
  assert gpu_check.tests_shard(1, 1) == files
  stage = {s.name: s for s in gpu_check.build_stages(tmp_path, tests=parts[1])}["tests"]
  assert stage.cmd[-len(parts[1]):] == parts[1] and "tests" not in stage.cmd


@pytest.mark.parametrize("argv,message", BAD_ARGS, ids=[" ".join(a) for a, _ in BAD_ARGS])
def test_bad_arguments_are_refused_before_any_folder(argv, message, tmp_path, capsys,
                                                     monkeypatch):
  """Refused with one line before the run's folder (default: runs/gpu-check-<time> in
  the working directory) is made and before any stage runs."""
  monkeypatch.chdir(tmp_path)
  monkeypatch.setattr(gpu_check, "run_stages", _no_stages)
  (tmp_path / "a-file").write_text("")
  assert cli_error(gpu_check.main, argv, capsys).startswith(message)
  assert [p.name for p in tmp_path.iterdir()] == ["a-file"]


@pytest.mark.slow
def test_a_timed_out_pytest_still_reports_its_counts(tmp_path):
  (tmp_path / "test_hang.py").write_text(
      "import time\n\ndef test_ok():\n  pass\n\ndef test_hang():\n  time.sleep(300)\n")
  # Run with SIGINT ignored, as a check started in the background is (and as this test
  # sometimes was under xdist: the stage was then SIGKILLed without a report): the stage
  # must still get the SIGINT and write its JUnit file.
  stage = Stage("tests", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-o", "addopts=", "--junitxml", str(tmp_path / "j.xml"),
                          "-o", "junit_family=xunit1", str(tmp_path / "test_hang.py")],
                10, junit_file="j.xml")  # pytest starts and runs test_ok well within it
  previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
  try:
    rec = gpu_check.run_stages([stage], tmp_path, budget_s=60)[0]
  finally:
    signal.signal(signal.SIGINT, previous)
  assert rec["status"] == "timeout"
  counts = rec["tests"]
  assert counts["source"] == "junit" and counts["passed"] == 1 and counts["interrupted"] == 1


@pytest.mark.slow
def test_smoke_run_of_the_model_stages(tmp_path, monkeypatch):
  """A model stage end to end: the LLaMA train.bench case at tiny shapes (the ViT case
  is the same command on another preset and tests/test_train_bench.py runs it; the README's
  train command is run by tests/test_train.py; the tests stage by the report test above)."""
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # the stages' subprocesses: CPU on any machine
  names = ["env", "bench-llama"]
  report = gpu_check.main(["--smoke", "--stages", ",".join(names), "--out", str(tmp_path)])
  _assert_report_structure(report, names)
  status = {r["name"]: r["status"] for r in report["stages"]}
  assert status == dict.fromkeys(names, "passed"), report["stage_status"]
  bench = {r["name"]: r for r in report["stages"]}["bench-llama"]["json"]
  assert [r["policy"] for r in bench["rows"]] == ["baseline", "lowmembp"]
  assert bench["throughput_unit"] == "tokens/s"
  # --peers: HF Llama + peft on the same tiny shapes, or one note naming what is missing
  if "peers_note" in bench:
    assert "not importable" in bench["peers_note"] and bench["peers"] == []
  else:
    assert [r["policy"] for r in bench["peers"]] == ["torch+peft", "torch+peft+ckpt"]
    for r in bench["peers"]:
      assert r["step_ms"] > 0 and r["peer"]["shapes"]["seq"] == 32 and r["peer"]["finite"]


def test_markdown_shows_key_figures_and_a_low_copy():
  rows = [{"kernel": "pack_2bit", "pallas_GBps": 480.0, "speedup_vs_xla": 1.1},
          {"kernel": "approx2_backward", "error": "CompileError: triton"}]
  copy = {"Bps": 1.076e12, "pct_peak": 32.1, "low": True}
  stages = [
      {"name": "env", "status": "passed", "exit_code": 0, "wall_s": 3.0, "timeout_s": 60,
       "json": {"device_kind": "NVIDIA H100 80GB HBM3", "jax": "0.11.2", "cudnn": 90800,
                "cuda_runtime": 12080}},
      {"name": "bench-vit", "status": "passed", "exit_code": 0, "wall_s": 50.0,
       "timeout_s": 120, "stdout_tail": "table", "json": {"rows": [
           {"policy": "baseline", "step_ms": 28.1, "temp_mib": 6000.0, "profile": {
               "busy_ms": 20.04, "wall_ms": 28.5, "kind_ms": {
                   "matmul": 12.0, "attention": 3.0, "copy": 0.5, "other": 6.0}}}], "peers": [
           {"policy": "torch+peft", "step_ms": 28.4, "peak_mib": 3653.0},
           {"policy": "torch+peft+ckpt", "error": "CUDA out of memory"}]}},
      {"name": "bench-llama", "status": "passed", "exit_code": 0, "wall_s": 50.0,
       "timeout_s": 120, "stdout_tail": "table", "json": {"rows": [
           {"policy": "baseline", "step_ms": 36.0, "temp_mib": 5000.0}], "peers": [],
           "peers_note": "peft is not importable"}},
      {"name": "kernel-bench", "status": "failed", "exit_code": 1, "wall_s": 40.0,
       "timeout_s": 120, "stdout_tail": "", "stderr_tail": "Traceback: boom",
       "json": {"kernels": {"copy": copy, "rows": rows}}},
      {"name": "attention-bench", "status": "timeout", "exit_code": -9, "wall_s": 120.0,
       "timeout_s": 120, "json": {"unexpected": "shape"}},
      {"name": "llama-fit", "status": "passed", "exit_code": 0, "wall_s": 400.0,
       "timeout_s": 480, "stdout_tail": "table", "json": {"rows": [
           {"kind": "ours", "policy": "baseline", "base_dtype": "bfloat16", "seq": 2048,
            "max_batch_aot": 6, "max_batch_run": 5, "tokens_per_s": 9000.0,
            "real_peak": 60 * 2**30, "error_pct": 2.5},
           {"kind": "ours", "policy": "lowmem", "base_dtype": "bfloat16", "seq": 2048,
            "error": "boom"},
           {"kind": "peer", "policy": "torch+peft", "base_dtype": "nf4", "seq": 2048,
            "missing": "bitsandbytes"}]}},
      {"name": "reversible-depth", "status": "timeout", "exit_code": -9, "wall_s": 200.0,
       "timeout_s": 200, "stdout_tail": "", "json": {"run_rows": [
           {"case": "reversible", "layers": 12, "peak_bytes_in_use": 3 * 2**30,
            "step_ms": 40.0, "speed_vs_reversible": 1.0},
           {"case": "pareprop", "layers": 12, "error": "exit 1: boom"}]}},
  ]
  report = gpu_check.build_report(stages, args={"argv": []}, git={"commit": None},
                                  started="2026-11-23T10:00:00", wall_s=213.0)
  assert report["stage_status"] == {"passed": ["env", "bench-vit", "bench-llama", "llama-fit"],
                                    "failed": ["kernel-bench"],
                                    "timeout": ["attention-bench", "reversible-depth"]}
  md = gpu_check.markdown(report)
  assert md.startswith("# lowmem-jax GPU check: NVIDIA H100 80GB HBM3, jax 0.11.2 "
                       "(CUDA 12.8, cuDNN 9.8.0)")
  assert ("- bench-vit: baseline 28.1 ms, temp 6000 MiB, device busy 20.04 of 28.50 ms per "
          "step (matmul 12.00, attention 3.00, copy 0.50, other 6.00 ms); torch+peft 28.4 ms, "
          "peak 3653 MiB; torch+peft+ckpt failed\n") in md
  assert "- bench-llama: baseline 36.0 ms, temp 5000 MiB; no peers: peft is not importable" in md
  assert "measured copy 1076 GB/s (32% of peak) **LOW" in md
  assert "pack_2bit 480 GB/s (1.10x XLA), approx2_backward failed\n" in md
  assert "| attention-bench | timeout | -9 |" in md and "Traceback: boom" in md
  assert "- reversible-depth: reversible x12 peak 3072 MiB, 40.0 ms (1.00x rev)\n" in md
  assert ("- llama-fit (batch AOT/run): baseline bfloat16 batch 6/5 x 2048 9000 tok/s, peak "
          "60.0 GiB (pred +2.5%); lowmem bfloat16 failed; torch+peft nf4 missing "
          "bitsandbytes\n") in md


def test_train_plan_reads_the_runs_plan_and_its_check(tmp_path):
  """The stage's JSON is the run's metrics.jsonl: the plan chosen and, after step 1, the
  prediction against the real peak (the records as python -m train writes them)."""
  gib = 2 ** 30
  records = [{"event": "memory", "step": 0},
             {"event": "plan", "step": 0, "memory_budget": 2 * gib, "policy": "lowmem",
              "grad_accum": 2, "predicted_peak": int(1.5 * gib), "planning_s": 30.0},
             {"event": "plan_check", "step": 1, "predicted_peak": int(1.5 * gib),
              "real_peak": int(1.48 * gib), "error_pct": 1.35},
             {"step": 3, "loss": 2.0}]
  writer = ("import json, pathlib, sys; p = pathlib.Path(sys.argv[1]); "
            "p.parent.mkdir(parents=True); "
            "p.write_text(''.join(json.dumps(r) + chr(10) for r in json.loads(sys.argv[2])))")
  stage = gpu_check.Stage("train-plan", [sys.executable, "-c", writer,
                                         str(tmp_path / "run" / "metrics.jsonl"),
                                         json.dumps(records)],
                          60, 10, json_file="run/metrics.jsonl")
  rec = gpu_check.run_stage(stage, tmp_path, 60)
  assert rec["status"] == "passed" and rec["json"] == {"records": records}
  assert gpu_check._plan_figure(rec) == (
      "train-plan (memory_budget 2.00 GiB): lowmem x grad_accum 2, predicted peak 1.500 GiB, "
      "real 1.480 GiB (error +1.35% of the real peak)")
  cpu = {"json": {"records": records[:2] + [{**records[2], "real_peak": None}]}}
  assert gpu_check._plan_figure(cpu).endswith("predicted peak 1.500 GiB")  # no check
  assert gpu_check._plan_figure({"json": None}) is None


def test_a_cut_or_partly_failed_bench_still_shows_what_it_measured():
  partial = {"partial": "peers and peaks only", "peaks_mib": {"baseline": 6733.0},
             "peak_errors": {"offload": "XlaRuntimeError: host offload"},
             "peers_raw": {"peers": [{"name": "torch+peft", "step_ms": 28.4, "peak_mib": 3653.0},
                                     {"name": "torch+peft+ckpt", "error": "OOM"},
                                     {"name": "cpu-peer", "step_ms": 9.0, "peak_mib": None}]}}
  line = gpu_check._bench_figure({"name": "bench-remat", "json": partial})
  assert line == ("bench-remat: baseline peak 6733 MiB; torch+peft 28.4 ms, peak 3653 MiB; "
                  "torch+peft+ckpt failed; cpu-peer 9.0 ms; "
                  "(partial: the timed run did not finish); "
                  "offload failed: XlaRuntimeError: host offload")
  done = {"rows": [{"policy": "baseline", "step_ms": 28.1, "temp_mib": 6000.0}],
          "failed": {"offload": "ValueError: no pinned host"}}
  assert gpu_check._bench_figure({"name": "bench-remat", "json": done}) == (
      "bench-remat: baseline 28.1 ms, temp 6000 MiB; offload failed: ValueError: no pinned host")
