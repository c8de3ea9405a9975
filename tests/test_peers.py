"""benchmarks/peers.py: the PyTorch peers' arguments, and a tiny CPU run of each case where
its packages import (timm needs torchvision, which is not installed beside the CPU torch
here: the ViT cases skip)."""

import importlib.util
import json
import math
from pathlib import Path

import pytest

pytestmark = pytest.mark.precision("default")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "peers.py"


def _load():
  spec = importlib.util.spec_from_file_location("peers_script", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


peers = _load()


def test_defaults_are_the_gpu_check_shapes():
  vit = peers.parse_args(["--case", "vit-lora"])
  assert vit.shapes == {"image_size": 224, "patch_size": 16, "channels": 3, "dim": 768,
                        "layers": 12, "heads": 12, "mlp_dim": 3072, "num_classes": 1000,
                        "batch": 64}
  assert vit.lora and vit.targets == ["query", "value"] and (vit.warmup, vit.steps) == (3, 15)
  llama = peers.parse_args(["--case", "llama-lora"])
  assert {k: llama.shapes[k] for k in ("dim", "mlp_dim", "heads", "layers", "seq", "batch",
                                       "vocab")} == {
      "dim": 4096, "mlp_dim": 11008, "heads": 32, "layers": 4, "seq": 1024, "batch": 4,
      "vocab": 32000}
  assert llama.targets == ["query", "key", "value", "out", "gate", "up", "down"]
  full = peers.parse_args(["--case", "vit-full"])
  assert not full.lora and full.targets == []


def test_smoke_shapes_and_explicit_flags_win():
  args = peers.parse_args(["--case", "llama-lora", "--smoke", "--seq", "8", "--layers", "1"])
  assert args.shapes["dim"] == 64 and args.shapes["seq"] == 8 and args.shapes["layers"] == 1
  assert (args.warmup, args.steps) == (1, 2)
  args = peers.parse_args(["--case", "vit-lora", "--smoke", "--steps", "5", "--targets",
                           "key,out,fc2"])
  assert args.shapes["image_size"] == 32 and args.steps == 5
  assert args.targets == ["key", "out", "fc2"]


@pytest.mark.parametrize("argv, message", [
    (["--case", "vit-full", "--seq", "8"], "--seq applies to llama cases, not vit-full"),
    (["--case", "llama-lora", "--image-size", "32"],
     "--image-size applies to vit cases, not llama-lora"),
    (["--case", "vit-lora", "--batch", "0"], "--batch must be >= 1, got 0"),
    (["--case", "vit-lora", "--image-size", "30"],
     "--image-size 30 is not a multiple of --patch-size 16"),
    (["--case", "llama-lora", "--kv-heads", "5"], "--heads 32 is not a multiple of --kv-heads 5"),
    (["--case", "llama-lora", "--dim", "100"], "--dim 100 is not divisible by --heads 32"),
    (["--case", "llama-lora", "--targets", "query,fc1"],
     "--targets: fc1 not among the llama linears"),
    (["--case", "vit-full", "--targets", "query"], "--targets applies to LoRA cases"),
    (["--case", "vit-lora", "--steps", "0"], "--steps must be >= 1"),
    (["--case", "vit-lora", "--rank", "0"], "--rank must be >= 1"),
    (["--case", "bert-lora"], "invalid choice: 'bert-lora'"),
    (["--case", "vit-lora", "--base-dtype", "bf16"],
     "--base-dtype bfloat16 applies to llama-lora (a frozen base), not vit-lora"),
    (["--case", "llama-full", "--base-dtype", "nf4"], "applies to llama-lora"),
    (["--case", "llama-lora", "--base-dtype", "int8"], "invalid choice: 'int8'"),
    (["--case", "llama-lora", "--max-batch", "0"], "--max-batch must be >= 1"),
    # said before the measurement (it ran, then failed to write)
    (["--case", "vit-lora", "--json", "/nonexistent/x.json"],
     "--json /nonexistent/x.json: not a file in an existing directory"),
])
def test_bad_arguments_exit_2_naming_the_flag(argv, message, capsys):
  with pytest.raises(SystemExit) as e:
    peers.parse_args(argv)
  assert e.value.code == 2 and message in capsys.readouterr().err


def test_requirements_and_a_missing_package(tmp_path, monkeypatch, capsys):
  assert peers.requirements("vit-lora") == ["torch", "timm", "peft"]
  assert peers.requirements("llama-full") == ["torch", "transformers"]
  # torch first: bitsandbytes needs it (a machine without torch said "missing: bitsandbytes")
  assert peers.requirements("llama-lora", "nf4") == ["torch", "bitsandbytes", "transformers",
                                                     "peft"]
  monkeypatch.setattr(peers, "requirements", lambda case, base: ["no_such_package_xyz"])
  out = tmp_path / "peer.json"
  with pytest.raises(SystemExit) as e:
    peers.main(["--case", "llama-lora", "--smoke", "--json", str(out)])
  assert e.value.code == peers.EXIT_MISSING
  assert json.loads(out.read_text()) == {"case": "llama-lora", "missing": "no_such_package_xyz",
                                         "install": "pip install 'lowmem-jax[peers]'"}
  assert "llama-lora needs no_such_package_xyz" in capsys.readouterr().err
  # not in the peers extra, which the hint named: each is built for the installed torch
  assert peers.install_hint("bitsandbytes") == ("pip install bitsandbytes, built for the "
                                                "installed torch")
  assert peers.install_hint("timm (needs torchvision)").startswith("pip install torchvision,")


def _run(case, tmp_path, *flags):
  missing = peers.missing_package(case)
  if missing:
    pytest.skip(f"{case}: {missing} does not import")
  out = tmp_path / f"{case}.json"
  result = peers.main(["--case", case, "--smoke", "--device", "cpu", "--json", str(out),
                       *flags])
  assert json.loads(out.read_text()) == json.loads(json.dumps(result))
  return result


@pytest.mark.parametrize("case", list(peers.CASES))
def test_smoke_run_on_cpu_with_and_without_checkpointing(case, tmp_path):
  """Tiny shapes: every trainable tensor gets a gradient (checkpointing included), and
  checkpointing recomputes the same function (the same losses)."""
  plain = _run(case, tmp_path, "--layers", "1")
  ckpt = _run(case, tmp_path, "--layers", "1", "--checkpointing")
  for r in (plain, ckpt):
    assert r["case"] == case and r["device"] == "cpu" and r["timing"] == "host clock"
    assert r["peak_bytes"] is None and "CUDA only" in r["peak_note"]
    assert r["finite"] and r["step_ms"] > 0 and len(r["step_ms_all"]) == 2
    assert r["tensors_with_gradient"] == r["trainable_tensors"] > 0
    assert r["throughput"] == pytest.approx(r["items_per_step"] / (r["step_ms"] / 1e3))
  assert ckpt["checkpointing"] and not plain["checkpointing"]
  assert ckpt["final_loss"] == pytest.approx(plain["final_loss"], rel=1e-2)
  s = plain["shapes"]
  if case == "llama-lora":  # r*(in+out) per adapter on q,k,v,o (D,D), gate,up (D,F), down
    d, f, r = s["dim"], s["mlp_dim"], 8
    assert plain["trainable_params"] == s["layers"] * r * (4 * 2 * d + 3 * (d + f))
    assert plain["items_per_step"] == s["batch"] * s["seq"]
  if case == "vit-lora":  # one adapter on the fused qkv: r*(D + 3D) per layer; the head
    head = (s["dim"] + 1) * s["num_classes"]  # trains in full (modules_to_save)
    assert plain["trainable_params"] == s["layers"] * 8 * 4 * s["dim"] + head
  if not plain["lora"]:
    assert plain["trainable_params"] == plain["total_params"]
  assert not math.isnan(plain["final_loss"])


def test_bf16_base_and_the_largest_batch_on_cpu(tmp_path):
  """--base-dtype bf16: the model in bf16, peft's adapters fp32; --find-max-batch on CPU
  (nothing runs out of memory): every batch up to the cap fits, then it is timed."""
  r = _run("llama-lora", tmp_path, "--layers", "1", "--base-dtype", "bf16", "--find-max-batch",
           "--max-batch", "3")
  assert r["base_dtype"] == "bfloat16" and r["adapter_dtype"] == "float32"
  frozen = r["total_params"] - r["trainable_params"]
  assert r["parameter_bytes"] == 2 * frozen + 4 * r["trainable_params"]
  assert r["find_max_batch"] == {"max_batch": 3, "capped": True, "cap": 3,
                                 "tries": [[1, 0], [2, 0], [3, 0]]}
  assert r["shapes"]["batch"] == 3 and r["items_per_step"] == 3 * r["shapes"]["seq"]
  assert r["finite"] and r["tensors_with_gradient"] == r["trainable_tensors"]
