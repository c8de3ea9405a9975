"""train.bench: per-policy compiled memory and interleaved step times of the real train step."""

import json
import sys
import textwrap

import pytest

from conftest import TINY_MODEL, cli_error, set_args
from train import bench

TINY_OVERRIDES = [f"model.{k}={v}" for k, v in TINY_MODEL.items()] + ["batch_size=16"]
TINY = set_args(TINY_OVERRIDES)


@pytest.mark.slow
@pytest.mark.precision("default")
def test_bench_end_to_end(tmp_path, capsys):
  out = tmp_path / "bench.json"
  result = bench.main([*TINY, "--policies", "lowmembp", "--profile",
                       "--steps", "3", "--warmup", "1", "--json", str(out)])
  text = capsys.readouterr().out
  data = json.loads(out.read_text())
  assert data == json.loads(json.dumps(result))
  for key in ("device_kind", "backend", "jax_version", "config", "rows"):
    assert key in data
  assert data["config"]["model_overrides"] == TINY_MODEL
  assert data["config"]["batch_size"] == 16 and data["items_per_step"] == 16
  assert data["throughput_unit"] == "examples/s"
  rows = {r["policy"]: r for r in data["rows"]}
  assert list(rows) == ["baseline", "lowmembp"]  # baseline first when not asked for
  for r in data["rows"]:
    for key in ("temp_mib", "temp_ratio", "total_mib", "total_ratio", "step_ms",
                "speed_ratio", "throughput", "compiled", "queued_ms", "queued_speed_ratio"):
      assert r[key] > 0 if key != "compiled" else r[key]["temp"] > 0, (key, r)
    # + 3 rounds of 3 queued steps, + 3 traced (--profile)
    assert r["steps_run"] == 4 + 3 * 3 + 3 and r["finite"]
    if data["backend"] == "cpu":  # no device kernels in a CPU trace: a note, no figures
      assert "profile" not in r
    else:
      assert r["profile"]["steps"] == 3 and r["profile"]["busy_ms"] > 0
    assert r["throughput"] == pytest.approx(16 / (r["step_ms"] / 1e3))
    assert "peak_mib" not in r  # only with --peak on a GPU
  base, low = rows["baseline"], rows["lowmembp"]
  assert base["temp_ratio"] == base["speed_ratio"] == base["total_ratio"] == 1.0
  assert base["queued_speed_ratio"] == 1.0 and "queued ms" in text
  if data["backend"] == "cpu":  # the CPU compiler's figure (XLA:GPU fuses differently)
    assert low["compiled"]["temp"] < base["compiled"]["temp"]
    assert low["temp_ratio"] < 1.0
  assert "speed vs base" in text and "lowmembp" in text
  if data["backend"] == "cpu":
    assert "note: --profile: the traces held no device kernels" in text
  else:
    assert "device time per step, traced (3 queued steps" in text

  # the figures read off the timed executable are Trainer.compiled_memory's
  from train.config import load_config
  from train.batches import Batches
  from train.datasets import make_datasets
  from train.trainer import Trainer
  cfg = load_config("digits-vit", None, TINY_OVERRIDES + ["policy=baseline"])
  trainer = Trainer.create(cfg)
  batch = trainer.put(next(Batches(make_datasets(cfg)[0], 16, seed=cfg.seed)))
  assert trainer.compiled_memory(batch).as_dict() == base["compiled"]


@pytest.mark.slow
def test_compile_only_runs_nothing(tmp_path, capsys, monkeypatch):
  monkeypatch.setattr(bench, "_Runner", _NoSteps)
  out = tmp_path / "compiled.json"
  result = bench.main([*TINY, "--policies", "lowmem,baseline", "--compile-only", "--live",
                       "--json", str(out)])
  data = json.loads(out.read_text())
  assert data == json.loads(json.dumps(result)) and data["timed_steps"] == 0
  rows = {r["policy"]: r for r in data["rows"]}
  assert list(rows) == ["lowmem", "baseline"] and rows["baseline"]["temp_ratio"] == 1.0
  assert data["baseline"] == "baseline"  # the ratios' base (it said the first policy)
  assert rows["lowmem"]["canonical_policy"] == "lowmem"
  for r in rows.values():
    assert r["compiled"]["temp"] > 0 and r["step_ms"] is None and r["throughput"] is None
    # the distinct bytes live at the peak fit in what the executable allocates
    assert r["argument_mib"] < r["live_mib"] <= r["total_mib"], r
    assert len(r["live_by_source"]) == 5
  assert rows["baseline"]["live_ratio"] == 1.0
  text = capsys.readouterr().out
  assert "compiled only" in text and "live MiB" in text
  for bad in (["--compile-only", "--peak"], ["--live"]):
    with pytest.raises(SystemExit):
      bench.main([*TINY, *bad])


def _failing_for(failing_spec: str, error: Exception):
  """``train.bench._make_runner`` that raises ``error`` for ``failing_spec`` only."""
  make = bench._make_runner

  def runner(cfg, spec, train_set):
    if spec == failing_spec:
      raise error
    return make(cfg, spec, train_set)
  return runner


def test_compile_only_reports_a_failing_policy(monkeypatch, capsys):
  """One policy that cannot compile is a ``failed`` entry; the others' rows stand. The
  baseline's failure ends the run."""
  monkeypatch.setattr(bench, "_make_runner", _failing_for(
      "lowmembp", RuntimeError("no such device memory space\nsecond line")))
  result = bench.main([*TINY, "--policies", "lowmembp", "--compile-only"])
  assert [r["policy"] for r in result["rows"]] == ["baseline"]
  assert result["failed"] == {"lowmembp": "RuntimeError: no such device memory space"}
  assert "lowmembp: failed: RuntimeError" in capsys.readouterr().out
  monkeypatch.setattr(bench, "_make_runner", lambda *a: 1 / 0)
  with pytest.raises(ZeroDivisionError):
    bench.main([*TINY, "--policies", "lowmembp", "--compile-only"])


class _NoSteps(bench._Runner):
  def __call__(self):
    raise AssertionError("--compile-only ran a step")


@pytest.mark.precision("default")
def test_synthetic_llama_lm_with_lora_and_peers(tmp_path, monkeypatch, capsys):
  """--synthetic N: random tokens shaped for a preset (no data files), LoRA on all seven
  linears, as the GPU check runs LLaMA-7B widths. --peers (a fake peers script: the real
  one is tests/test_peers.py's) adds their rows; peers on a GPU imply --peak."""
  from train import bench_peers
  script = tmp_path / "peers.py"
  script.write_text(textwrap.dedent("""\
      import json, sys
      args = sys.argv[1:]
      ckpt = "--checkpointing" in args
      open(args[args.index("--json") + 1], "w").write(json.dumps({
          "case": args[args.index("--case") + 1], "checkpointing": ckpt, "device": "cuda",
          "device_name": "fake GPU", "versions": {"torch": "0"}, "step_ms": 2.0 + ckpt,
          "throughput": 32.0, "peak_mib": 10.0 - 5 * ckpt, "resident_mib": 4.0,
          "peak_minus_resident_mib": 6.0 - 5 * ckpt, "seq": args[args.index("--seq") + 1]}))
      """))
  monkeypatch.setattr(bench_peers, "PEERS_SCRIPT", script)
  asked = []
  argvs = []  # what the peak subprocesses would be given: every item a string, as Popen needs
  monkeypatch.setattr(bench, "measure_peaks",
                      lambda *a: (asked.append(a[1]), argvs.append(a[0])) and None)
  out = tmp_path / "bench.json"
  result = bench.main([
      "--synthetic", "8", "--set", "model=llama-tiny", "--set", "task=lm",
      "--set", "max_len=16", "--set", "batch_size=4", "--set", "trainable=lora",
      "--set", "lora_targets=query,key,value,out,gate,up,down", "--set",
      "model.num_layers=1", "--policies", "baseline", "--steps", "2", "--warmup", "1",
      "--json", str(out), "--peers"])
  row = result["rows"][0]
  assert row["policy"] == "baseline" and row["finite"] and row["steps_run"] == 3 + 3 * 2
  assert result["items_per_step"] == 4 * 16 and json.loads(out.read_text())["rows"]
  assert asked == [["baseline"]]  # the peers ran on "cuda": our peaks were asked for
  assert all(isinstance(item, str) for item in argvs[0]), argvs  # no --config-name None
  assert "--config-name" not in argvs[0] and "model=llama-tiny" in argvs[0]
  lora, ckpt = json.loads(out.read_text())["peers"]
  assert (lora["policy"], ckpt["policy"]) == ("torch+peft", "torch+peft+ckpt")
  # the peers are timed queued on one batch: set against our baseline timed the same way
  assert lora["queued_speed_ratio"] == pytest.approx(row["queued_ms"] / 2.0)
  assert lora["peer"]["case"] == "llama-lora" and lora["peer"]["seq"] == "16"
  assert ckpt["peak_mib"] == 5.0 and "peak_ratio" not in ckpt  # no peak of ours
  # its speed ratio too (it was against our interleaved time, which feeds a new batch)
  assert ckpt["speed_ratio"] == pytest.approx(row["queued_ms"] / 3.0)
  text = capsys.readouterr().out
  assert "torch+peft+ckpt: resident 4.0 MiB before the step, peak - resident 1.0 MiB" in text
  assert [ln.split()[0] for ln in text.splitlines() if ln.startswith("torch+peft")][-4:] == [
      "torch+peft", "torch+peft+ckpt", "torch+peft:", "torch+peft+ckpt:"]
  with pytest.raises(ValueError, match="unknown model"):
    bench.synthetic_dataset(bench.load_config("digits-vit", None, ["model=gpt-2"]), 4)


def test_unknown_policy_is_named():
  with pytest.raises(ValueError, match="invalid policy 'bogus'.*unknown preset 'bogus'"):
    bench.main([*TINY, "--policies", "baseline,bogus"])
  with pytest.raises(ValueError, match="'lowmembp\\+nope'"):
    bench.parse_policies("lowmembp+nope")


def _no_work(*args, **kwargs):
  raise AssertionError("ran before checking the arguments")


BAD_ARGS = [
    (["--json", "{tmp}"], "--json {tmp} is a directory; give a file name"),
    (["--json", "{tmp}/no/b.json"], "--json {tmp}/no/b.json: the directory {tmp}/no does not "
     "exist"),
    (["--png", "{tmp}"], "--png {tmp} is a directory; give a file name"),
    (["--png", "{tmp}/no/b.png"], "--png {tmp}/no/b.png: the directory {tmp}/no does not "
     "exist"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--warmup", "0"], "--warmup must be >= 1, got 0"),
    (["--synthetic", "-1"], "--synthetic must be >= 0, got -1"),
]


@pytest.mark.parametrize("argv,message", BAD_ARGS, ids=[" ".join(a) for a, _ in BAD_ARGS])
def test_bad_arguments_are_refused_before_any_run(argv, message, tmp_path, capsys,
                                                  monkeypatch):
  """The output paths are checked up front, by the names given (not at the end, after all
  the work, as the ``.tmp`` file the JSON is first written to)."""
  for name in ("run", "compile_only", "run_peers", "measure_peaks"):
    monkeypatch.setattr(bench, name, _no_work)
  argv = [*TINY, "--policies", "lowmembp", *(a.format(tmp=tmp_path) for a in argv)]
  assert cli_error(bench.main, argv, capsys) == message.format(tmp=tmp_path)
  assert list(tmp_path.iterdir()) == []


def test_parse_policies():
  assert bench.parse_policies(",".join(bench.DEFAULT_POLICIES)) == list(bench.DEFAULT_POLICIES)
  assert bench.parse_policies("lowmembp,remat:save=qkv_proj,attn_out") == [
      "baseline", "lowmembp", "remat:save=qkv_proj,attn_out"]
  assert bench.parse_policies(["remat", "baseline"]) == ["remat", "baseline"]
  assert bench.parse_policies("wta-crs+sample_targets=fc1,fc2,mesa8") == [
      "baseline", "wta-crs+sample_targets=fc1,fc2", "mesa8"]
  with pytest.raises(ValueError, match="listed twice"):  # the same policy, spelled twice
    bench.parse_policies("baseline,lowmembp,approx-bp+ms-bp")
  with pytest.raises(ValueError, match="no policy"):
    bench.parse_policies(" , ")


def _result(peak=False):
  rows = []
  for name, temp, total, ms in (("baseline", 10.0, 20.0, 4.0), ("lowmembp", 6.0, 15.0, 5.0)):
    row = {"policy": name, "temp_mib": temp, "temp_ratio": temp / 10, "total_mib": total,
           "total_ratio": total / 20, "step_ms": ms, "speed_ratio": 4.0 / ms,
           "throughput": 16 / ms * 1e3}
    if peak:
      row.update(peak_mib=total * 2, peak_ratio=total / 20)
    rows.append(row)
  return {"rows": rows, "throughput_unit": "examples/s", "device_kind": "cpu",
          "backend": "cpu", "config": {"pretrained": None, "model": "vit-digits",
                                       "batch_size": 16, "dtype": "bfloat16"}}


def test_table():
  text = bench.table(_result())
  assert "examples/s" in text.splitlines()[0] and "peak" not in text
  assert "0.600" in text and "0.800" in text  # lowmembp's temp and speed ratios
  assert "peak MiB" in bench.table(_result(peak=True))


def test_profiles_are_printed_for_our_rows_and_the_peers(capsys):
  from train.kernel_time import Kernel, summarize
  ours = summarize([Kernel("nvjet_tst", "dot.1", 0, 3e6), Kernel("loop_fusion", "f.2", 3e6, 1e6)],
                   steps=1, wall_s=5e-3, where={"dot.1": "models/linear.py:9 (f)"}.get)
  theirs = summarize([Kernel("fmha_cutlassF", "", 0, 2e6)], steps=1, wall_s=2e-3)
  result = _result()
  result["rows"][0]["profile"] = ours
  result["peers"] = [{"policy": "torch+peft", "profile": theirs}, {"policy": "torch+peft+ckpt"}]
  bench.print_profiles(result)
  lines = capsys.readouterr().out.splitlines()
  start = lines.index("device time per step, traced (1 queued steps; kind from the kernel's "
                      "name)")
  assert lines[start + 3].split()[:8] == ["baseline", "5.00", "4.00", "1.00", "3.00", "0.00",
                                          "0.00", "1.00"]
  assert lines[start + 4].split()[:8] == ["torch+peft", "2.00", "2.00", "0.00", "0.00", "2.00",
                                          "0.00", "0.00"]
  assert len([x for x in lines if x.startswith(("baseline  ", "torch+peft+ckpt"))]) == 1
  assert "baseline: device time by source (ms per step)" in lines
  assert any("models/linear.py:9 (f)" in x and "matmul" in x for x in lines)
  bench.print_profiles(_result())
  assert "no device kernels" in capsys.readouterr().out


def test_a_failing_trace_is_a_warning_not_a_failed_bench(monkeypatch, capsys):
  from train import kernel_time

  def boom(run, steps, where=None):
    raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED")
  monkeypatch.setattr(kernel_time, "trace_steps", boom)

  class Runner:  # a runner whose trainer has no compiled step kept (compiled for a target)
    trainer = type("T", (), {"compiled_step": None})()
  assert bench.profile_runners({"baseline": Runner()}, 2) == {"baseline": None}
  assert ("warning: --profile [baseline] failed: RuntimeError: CUPTI_ERROR_NOT_INITIALIZED"
          in capsys.readouterr().out)


def test_png_without_matplotlib_is_skipped_with_a_note(tmp_path, monkeypatch, capsys):
  monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
  path = tmp_path / "bench.png"
  assert bench.plot(_result(), str(path)) is False
  assert not path.exists()
  assert "matplotlib is not installed" in capsys.readouterr().out


def test_png_with_matplotlib(tmp_path):
  pytest.importorskip("matplotlib")
  path = tmp_path / "bench.png"
  assert bench.plot(_result(), str(path))
  assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert bench.plot(_result(peak=True), str(path))


def test_a_policy_that_fails_is_reported_and_the_others_still_run(monkeypatch, capsys):
  """One policy's failure (here its build; on a GPU, say, a host offload XLA refuses) is a
  reported row, not the end of the bench; the baseline's is fatal (every ratio needs it)."""
  monkeypatch.setattr(bench, "_make_runner", _failing_for(
      "lowmembp", ValueError("lowmembp: cannot build here\nsecond line")))
  cfg = bench.load_config("digits-vit", None, TINY_OVERRIDES)
  result = bench.run(cfg, ["baseline", "lowmembp"], steps=1, warmup=1)
  assert [r["policy"] for r in result["rows"]] == ["baseline"]
  assert result["policies"] == ["baseline"]
  assert result["failed"] == {"lowmembp": "ValueError: lowmembp: cannot build here"}
  assert "failed [lowmembp]: ValueError" in capsys.readouterr().out
  monkeypatch.setattr(bench, "_make_runner", lambda *a: (_ for _ in ()).throw(
      ValueError("baseline broke")))
  with pytest.raises(ValueError, match="baseline broke"):
    bench.run(cfg, ["baseline", "lowmembp"], steps=1, warmup=1)


def test_peaks_go_on_past_a_failed_subprocess(monkeypatch):
  """--peak: one policy's subprocess failing records its error; the others' peaks stay."""
  def fake_run(cmd, **kwargs):
    spec, out = cmd[cmd.index("--policies") + 1], cmd[cmd.index("--peak-child") + 1]
    if spec == "offload":
      return bench.subprocess.CompletedProcess(cmd, 1, "", "Traceback\nXlaRuntimeError: no\n")
    open(out, "w").write(json.dumps({"policy": spec, "peak_bytes_in_use": 2**20 * 7,
                                     "backend": "gpu"}))
    return bench.subprocess.CompletedProcess(cmd, 0, "", "")

  monkeypatch.setattr(bench.subprocess, "run", fake_run)
  peaks, errors = bench.measure_peaks([], ["baseline", "offload", "remat"], 3)
  assert peaks == {"baseline": 7 * 2**20, "remat": 7 * 2**20}
  assert errors == {"offload": "XlaRuntimeError: no"}
