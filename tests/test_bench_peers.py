"""train.bench_peers: which peer case and shapes a bench config gets, the peer subprocesses
(a fake peers script here: no torch needed), and the peer rows in the bench's table/JSON."""

import json
import textwrap

import pytest

from train import bench, bench_peers
from train.config import load_config

pytestmark = pytest.mark.precision("default")


def _peers_script():
  from test_peers import peers
  return peers


def _cfg(*sets):
  return load_config("digits-vit", None, list(sets))


def test_vit_lora_case_has_the_bench_shapes():
  args = bench_peers.peer_args(_cfg("model=vit-b16", "batch_size=64", "trainable=lora",
                                    "lora_rank=8", "lora_targets=query,value"))
  parsed = _peers_script().parse_args(args)
  assert parsed.case == "vit-lora" and parsed.targets == ["query", "value"]
  assert parsed.shapes == {"image_size": 224, "patch_size": 16, "channels": 3, "dim": 768,
                           "layers": 12, "heads": 12, "mlp_dim": 3072, "num_classes": 1000,
                           "batch": 64}
  assert (parsed.rank, parsed.alpha, parsed.dtype, parsed.grad_clip) == (8, 16.0, "bfloat16",
                                                                          1.0)
  full = _peers_script().parse_args(bench_peers.peer_args(_cfg("model=vit-tiny")))
  assert full.case == "vit-full" and full.shapes["image_size"] == 32


def test_llama_lora_case_has_the_bench_shapes():
  cfg = _cfg("task=lm", "model=llama-7b", "model.num_layers=4", "max_len=1024", "batch_size=4",
             "trainable=lora", "lora_targets=query,key,value,out,gate,up,down", "dtype=float32")
  parsed = _peers_script().parse_args(bench_peers.peer_args(cfg))
  assert parsed.case == "llama-lora" and parsed.dtype == "float32"
  assert parsed.shapes == {"vocab": 32000, "dim": 4096, "layers": 4, "heads": 32,
                           "kv_heads": 32, "head_dim": 128, "mlp_dim": 11008, "seq": 1024,
                           "batch": 4}
  assert parsed.targets == ["query", "key", "value", "out", "gate", "up", "down"]


@pytest.mark.parametrize("sets, why", [
    (["task=text", "model=bert-base"], "no PyTorch peer for model 'bert-base' on task 'text'"),
    (["task=text", "model=llama-tiny"], "no PyTorch peer for model 'llama-tiny'"),
    (["trainable=frozen:head"], "trainable='frozen:head' has no peer"),
    (["grad_accum=2"], "grad_accum=2 has no peer"),
])
def test_cases_without_a_peer_are_a_note(sets, why, capsys):
  with pytest.raises(ValueError, match=why):
    bench_peers.peer_args(_cfg(*sets))
  out = bench_peers.run_peers(_cfg(*sets), 2, 1)
  assert out["peers"] == [] and why.split(" (")[0] in out["peers_note"]
  assert f"note: --peers skipped: {why}" in capsys.readouterr().out


def _fake_script(tmp_path, body):
  """A stand-in for benchmarks/peers.py: ``body`` runs with ``args`` (argv) and ``out``
  (the --json path)."""
  script = tmp_path / "peers.py"
  script.write_text("import json, sys\nargs = sys.argv[1:]\n"
                    "out = args[args.index('--json') + 1]\n" + textwrap.dedent(body))
  return script


def test_a_missing_package_is_one_line_and_no_rows(tmp_path, monkeypatch, capsys):
  script = _fake_script(tmp_path, """\
      open(out, "w").write(json.dumps({"case": "vit-lora", "missing": "timm (needs torchvision)",
                                       "install": "pip install torchvision, built for the "
                                                  "installed torch"}))
      print("peers: vit-lora needs timm", file=sys.stderr)
      sys.exit(3)
      """)
  monkeypatch.setattr(bench_peers, "PEERS_SCRIPT", script)
  out = bench_peers.run_peers(_cfg("model=vit-tiny", "trainable=lora"), 2, 1)
  assert out["peers"] == [] and out["peers_note"].startswith("timm (needs torchvision) is not")
  lines = capsys.readouterr().out.splitlines()
  assert lines == ["note: --peers skipped: timm (needs torchvision) is not importable "
                   "(pip install torchvision, built for the installed torch): no vit-lora peer"]


def _peer(ckpt, peak=None, ms=30.0):
  return {"case": "vit-lora", "checkpointing": ckpt, "device": "cuda" if peak else "cpu",
          "device_name": "NVIDIA H100" if peak else "cpu", "versions": {"torch": "2.11"},
          "step_ms": ms, "throughput": 64 / ms * 1e3, "items_per_step": 64,
          "peak_mib": peak, "resident_mib": None if peak is None else 400.0,
          "peak_minus_resident_mib": None if peak is None else peak - 400.0}


def test_peer_runs_with_and_without_checkpointing_and_a_failure_is_a_row(tmp_path,
                                                                        monkeypatch, capsys):
  script = _fake_script(tmp_path, f"""\
      if "--checkpointing" in args:
        print("RuntimeError: CUDA out of memory", file=sys.stderr)
        sys.exit(1)
      result = {_peer(False, peak=3653.0)!r}
      result["argv"] = args
      open(out, "w").write(json.dumps(result))
      """)
  monkeypatch.setattr(bench_peers, "PEERS_SCRIPT", script)
  cfg = _cfg("model=vit-tiny", "trainable=lora", "batch_size=8")
  out = bench_peers.run_peers(cfg, steps=7, warmup=2, profile=True)
  ok, failed = out["peers"]
  assert ok["name"] == "torch+peft" and "--checkpointing" not in ok["argv"]
  assert "--profile" in ok["argv"]
  assert ok["argv"][ok["argv"].index("--steps") + 1] == "7"
  assert ok["argv"][ok["argv"].index("--batch") + 1] == "8"
  assert failed["name"] == "torch+peft+ckpt" and "out of memory" in failed["error"]
  assert bench_peers.ran_on_gpu(out)
  text = capsys.readouterr().out
  assert "peer [torch+peft]: 30.00 ms/step, peak 3653.0 MiB (resident 400.0)" in text
  assert "warning: peer torch+peft+ckpt failed (exit 1): RuntimeError: CUDA out of memory" in text


def _result(peak):
  rows = []
  for name, ms, pk in (("baseline", 28.0, 6733.0), ("lowmembp", 28.0, 4177.0)):
    row = {"policy": name, "temp_mib": 1.0, "temp_ratio": 1.0, "total_mib": 2.0,
           "total_ratio": 1.0, "step_ms": ms, "speed_ratio": 1.0, "throughput": 64 / ms * 1e3}
    if peak:
      row.update(peak_mib=pk, peak_ratio=pk / 6733.0)
    rows.append(row)
  return {"rows": rows, "baseline": "baseline", "throughput_unit": "examples/s"}


def test_merge_puts_peer_rows_beside_ours_with_ratios_to_our_baseline():
  peers = {"peers": [{"name": "torch+peft", **_peer(False, peak=3653.0, ms=28.4)},
                     {"name": "torch+peft+ckpt", **_peer(True, peak=1279.0, ms=56.0)},
                     {"name": "torch+peft+ckpt", "checkpointing": True, "error": "boom"}]}
  merged = bench_peers.merge_peers(_result(peak=True), peers)
  lora, ckpt, failed = merged["peers"]
  assert lora["policy"] == "torch+peft" and lora["peak_mib"] == 3653.0
  assert lora["peak_ratio"] == pytest.approx(3653 / 6733)
  assert ckpt["speed_ratio"] == pytest.approx(28.0 / 56.0)
  assert ckpt["peak_minus_resident_mib"] == 879.0 and ckpt["peer"]["checkpointing"]
  assert failed == {"policy": "torch+peft+ckpt", "peer": peers["peers"][2]}
  assert "profile" not in lora  # the peer traced nothing (no --profile)
  traced = {"name": "torch+peft", **_peer(False), "profile": {"busy_ms": 1.0}}
  merged_traced = bench_peers.merge_peers(_result(peak=False), {"peers": [traced]})
  assert merged_traced["peers"][0]["profile"] == {"busy_ms": 1.0}
  lines = bench.table(merged).splitlines()
  assert lines[0].split()[-3:] == ["peak", "MiB", "ratio"]
  assert lines[-3].split() == ["torch+peft", "-", "-", "-", "-", "28.40", "0.986", "2254",
                               "3653.0", "0.543"]
  assert lines[-1].split() == ["torch+peft+ckpt", "-", "-", "-", "-", "failed", "-", "-",
                               "-", "-"]
  assert json.loads(json.dumps(merged)) == merged


def test_merge_without_peaks_and_a_note():
  cpu = bench_peers.merge_peers(_result(peak=False),
                                {"peers": [{"name": "torch+peft", **_peer(False)}]})
  assert "peak_mib" not in cpu["peers"][0] and "peak" not in bench.table(cpu)
  assert cpu["peers"][0]["speed_ratio"] == pytest.approx(28.0 / 30.0)
  # a peer's steps are queued on one batch: set against our baseline timed so, where the
  # bench has that figure (it was against our interleaved time, which feeds new batches)
  queued = _result(peak=False)
  queued["rows"][0]["queued_ms"] = 21.0
  row = bench_peers.merge_peers(queued, {"peers": [{"name": "torch+peft", **_peer(False)}]}
                                )["peers"][0]
  assert row["speed_ratio"] == row["queued_speed_ratio"] == pytest.approx(21.0 / 30.0)
  # our rows without --peak, the peers' with a peak: the peer's peak, no ratio
  gpu = bench_peers.merge_peers(_result(peak=False),
                                {"peers": [{"name": "torch+peft", **_peer(False, 3653.0)}]})
  assert "peak_ratio" not in gpu["peers"][0]
  assert bench.table(gpu).splitlines()[2].split()[-2:] == ["-", "-"]  # baseline: no peak
  assert bench.table(gpu).splitlines()[-1].split()[-2:] == ["3653.0", "-"]
  noted = bench_peers.merge_peers(_result(peak=False), {"peers": [], "peers_note": "no torch"})
  assert noted["peers"] == [] and noted["peers_note"] == "no torch"
  assert len(bench.table(noted).splitlines()) == 4


def test_peer_names():
  assert bench_peers.peer_name(True, False) == "torch+peft"
  assert bench_peers.peer_name(True, True) == "torch+peft+ckpt"
  assert bench_peers.peer_name(False, True) == "torch+ckpt"
  assert bench_peers.PEERS_SCRIPT.name == "peers.py" and bench_peers.PEERS_SCRIPT.exists()
