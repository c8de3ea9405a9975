"""``train.bench --peers``: the PyTorch peers of the bench's case, beside our policies.

For the config's model (a ``vit`` preset on images or a ``llama`` preset on ``task=lm``),
:func:`peer_args` gives ``benchmarks/peers.py``'s case and the bench's very shapes (batch,
image or sequence size, widths, LoRA rank, alpha and targets, dtype, clip);
:func:`run_peers` runs it twice, without and with gradient checkpointing, each in its own
process (the allocator's peak is per process), before the bench touches the device;
:func:`merge_peers` puts their rows into the bench's result beside ours: step time and
peak, with ratios to our ``baseline`` (speed: baseline time / peer time; peak: peer peak
/ baseline peak, where both exist). A missing package (torch, timm, peft, transformers)
is one printed line and no peer rows; a peer that fails is a warning and a row with its
error, so our figures still come out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from train.config import TrainConfig

PEERS_SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "peers.py"


def peer_name(lora: bool, checkpointing: bool) -> str:
  """The row's name: ``torch+peft`` (LoRA) or ``torch`` (full fine-tuning), ``+ckpt``."""
  return ("torch+peft" if lora else "torch") + ("+ckpt" if checkpointing else "")


def peer_args(cfg: TrainConfig) -> list[str]:
  """``benchmarks/peers.py`` arguments for ``cfg``'s bench case (``--case`` and shapes);
  ValueError saying why there is no peer for it."""
  from models import registry
  from train.model import model_config

  if cfg.pretrained:
    raise ValueError("the peers are built from presets, not pretrained=<dir>")
  family = registry.family(cfg.model).name
  if (family, cfg.task) not in (("vit", "image"), ("llama", "lm")):
    raise ValueError(f"no PyTorch peer for model {cfg.model!r} on task {cfg.task!r} (vit "
                     "presets on images and llama presets on task=lm have one)")
  if cfg.trainable not in ("full", "lora"):
    raise ValueError(f"trainable={cfg.trainable!r} has no peer (full or lora)")
  if cfg.grad_accum != 1:
    raise ValueError(f"grad_accum={cfg.grad_accum} has no peer (one batch per step)")
  mc = model_config(cfg)
  lora = cfg.trainable == "lora"
  args = ["--case", f"{family}-{'lora' if lora else 'full'}", "--dtype", cfg.dtype,
          "--grad-clip", str(cfg.grad_clip), "--seed", str(cfg.seed),
          "--batch", str(cfg.batch_size), "--dim", str(mc.dim),
          "--layers", str(mc.num_layers), "--heads", str(mc.num_heads),
          "--mlp-dim", str(mc.mlp_dim)]
  if family == "vit":
    args += ["--image-size", str(mc.image_size), "--patch-size", str(mc.patch_size),
             "--channels", str(mc.channels), "--num-classes", str(mc.num_labels)]
  else:
    args += ["--vocab", str(mc.vocab_size), "--kv-heads", str(mc.num_kv_heads),
             "--head-dim", str(mc.resolved_head_dim), "--seq", str(cfg.max_len)]
  if lora:
    args += ["--rank", str(cfg.lora_rank), "--alpha", str(cfg.lora_alpha),
             "--targets", cfg.lora_targets]
  return args


def run_peers(cfg: TrainConfig, steps: int, warmup: int, profile: bool = False) -> dict:
  """Both peer runs (without, then with checkpointing): ``{"peers": [results]}``, or
  ``{"peers": [], "peers_note": why}`` when there is no peer or a package is missing.
  ``profile``: each peer also traces its steps (``benchmarks/peers.py --profile``)."""
  try:
    args = peer_args(cfg)
  except ValueError as e:
    print(f"note: --peers skipped: {e}", flush=True)
    return {"peers": [], "peers_note": str(e)}
  case = args[args.index("--case") + 1]
  lora = case.endswith("-lora")
  env = dict(os.environ)
  root = str(PEERS_SCRIPT.parents[1])
  env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
  peers = []
  with tempfile.TemporaryDirectory() as tmp:
    for ckpt in (False, True):
      name, out = peer_name(lora, ckpt), Path(tmp) / f"peer{int(ckpt)}.json"
      cmd = [sys.executable, str(PEERS_SCRIPT), *args, "--warmup", str(warmup),
             "--steps", str(steps), "--json", str(out)] + (["--checkpointing"] if ckpt else [])
      cmd += ["--profile"] if profile else []
      proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
      result = json.loads(out.read_text()) if out.exists() else {}
      if "missing" in result:
        install = result.get("install", "pip install 'lowmem-jax[peers]'")
        note = f"{result['missing']} is not importable ({install}): no {case} peer"
        print(f"note: --peers skipped: {note}", flush=True)
        return {"peers": [], "peers_note": note}
      if proc.returncode != 0 or not result:
        error = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"warning: peer {name} failed (exit {proc.returncode}): {error}", flush=True)
        peers.append({"name": name, "checkpointing": ckpt, "error": proc.stderr[-4000:],
                      "cmd": cmd})
        continue
      peers.append({"name": name, **result})
      peak = ("" if result["peak_mib"] is None else
              f", peak {result['peak_mib']:.1f} MiB (resident {result['resident_mib']:.1f})")
      print(f"peer [{name}]: {result['step_ms']:.2f} ms/step{peak} on "
            f"{result['device_name']}", flush=True)
  return {"peers": peers}


def ran_on_gpu(peers: dict) -> bool:
  """Whether a peer ran on CUDA (then our rows' peak is wanted beside theirs)."""
  return any(p.get("device") == "cuda" for p in peers["peers"])


def merge_peers(result: dict, peers: dict) -> dict:
  """``result`` (the bench's) with ``peers`` rows added: step time, speed ratio and
  throughput against our baseline, peak and peak ratio where both peaks exist. A peer is
  timed with its steps queued on one batch, so its ``speed_ratio`` is against our
  baseline timed so (``queued_ms``) where the bench has that figure, else against its
  interleaved step time."""
  base = next(r for r in result["rows"] if r["policy"] == result["baseline"])
  rows = []
  for p in peers["peers"]:
    row = {"policy": p["name"], "peer": p}
    if p.get("profile"):
      row["profile"] = p["profile"]
    if "error" not in p:
      like = base.get("queued_ms", base["step_ms"])  # timed as the peer is, where we can
      row.update(step_ms=p["step_ms"], speed_ratio=like / p["step_ms"],
                 throughput=p["throughput"])
      if "queued_ms" in base:  # one batch, steps queued
        row["queued_speed_ratio"] = base["queued_ms"] / p["step_ms"]
      if p["peak_mib"] is not None:
        row.update(peak_mib=p["peak_mib"], resident_mib=p["resident_mib"],
                   peak_minus_resident_mib=p["peak_minus_resident_mib"])
        if "peak_mib" in base:
          row["peak_ratio"] = p["peak_mib"] / base["peak_mib"]
    rows.append(row)
  merged = {**result, "peers": rows}
  if "peers_note" in peers:
    merged["peers_note"] = peers["peers_note"]
  return merged
